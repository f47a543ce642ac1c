"""Tabular Q-learning on a GridWorld, fully jitted: one agent or thousands of seeds at once.

The whole experiment is one pure function, `train(rng)`, built by `make_train(config)`:
`jax.jit(train)(key)` trains one agent, `jax.jit(jax.vmap(train))(keys)` many, and the
command line runs the latter with the seeds split over all devices. Above the appendix line
is the algorithm (config, environment, agent, train); below it, running it and reporting.

    python q_learning_gridworld.py                       # one agent on the default map
    python q_learning_gridworld.py --num-seeds 64 --layout maze
    python q_learning_gridworld.py --layout my_map.txt   # '.' free, '#' wall, 'S', 'G'
"""

import dataclasses
import functools
import os
import signal
from typing import NamedTuple

# Unless XLA_FLAGS is set: each CPU core a JAX device, the seeds spread over all cores.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={os.cpu_count() or 1}"
if __name__ == "__main__":  # a Ctrl-C or SIGTERM while JAX loads waits for the handlers
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})

import jax
import jax.numpy as jnp
import numpy as np

# ----- Config -----------------------------------------------------------------------------

# The open 8x12 grid of R. Pégoud's "Vectorize and Parallelize RL Environments with JAX", G top
# left, S bottom right: the shortest path takes 18 steps. The hyperparameters were chosen on it.
DEFAULT_LAYOUT = "\n".join(["G..........."] + ["............"] * 6 + ["...........S"])


def option(default, help: str):
    """A Config field whose help text becomes its --flag's help in the command line."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Config:
    layout: str = option(DEFAULT_LAYOUT, "map text; CLI: default, maze, four_rooms or a file")
    total_timesteps: int = option(1_000_000, "environment steps per agent (seed)")
    learning_rate: float = option(0.1, "step size of the Q-learning update, in (0, 1]")
    gamma: float = option(0.9, "discount factor, in [0, 1)")
    epsilon: float = option(0.1, "probability of a uniformly random action, in [0, 1]")
    # Optimistic start (Sutton & Barto 2.6): every untried action looks best until tried. From
    # 0.0, epsilon-greedy can settle on a detour in a random maze, never trying the shortcut.
    initial_q: float = option(1.0, "initial Q-values; 1.0 is optimistic: no state is worth more")
    num_seeds: int = option(1, "independent agents trained at once, sharded over all devices")
    seed: int = option(0, "base random seed; agent i uses fold_in(key(seed), i)")
    output_dir: str = option("runs/q_learning_gridworld_{time}", "run folder; {time}: its start")
    max_episode_steps: int = option(0, "truncate an episode after this many steps (0: never)")
    # Large: one jax.random.bits call has a fixed cost, spread over many steps (README). Another
    # size gives each step other random numbers (other results, as valid).
    steps_per_block: int = option(100_000, "steps whose random numbers are drawn in one call")
    num_curve_points: int = option(10, "points on the learning curve (at most one per block)")
    num_recorded_episodes: int = option(500, "the first episodes whose lengths are recorded")

    def __post_init__(self):
        # Checked here, not only in the command line, so make_train never sees a bad config.
        parse_layout(self.layout)  # raises ValueError with a one-line reason
        for name, valid, rule in (
            # The step and episode counters are int32, jax's default.
            ("total_timesteps", 1 <= self.total_timesteps < 2**31, "in [1, 2^31)"),
            ("num_seeds", self.num_seeds >= 1, "at least 1"),
            ("steps_per_block", 1 <= self.steps_per_block < 2**31, "in [1, 2^31)"),
            ("num_curve_points", self.num_curve_points >= 1, "at least 1"),
            ("num_recorded_episodes", self.num_recorded_episodes >= 1, "at least 1"),
            ("max_episode_steps", 0 <= self.max_episode_steps < 2**31, "in [0, 2^31)"),
            ("epsilon", 0.0 <= self.epsilon <= 1.0, "in [0, 1]"),
            ("gamma", 0 <= self.gamma < 1 and np.float32(self.gamma) < 1, "in [0, 1) in float32"),
            ("initial_q", abs(self.initial_q) < 3.4e38, "below 3.4e38 in size (a float32)"),
            # NaN: False; below float32's smallest normal number, XLA computes with 0
            ("learning_rate", 1.2e-38 <= self.learning_rate <= 1.0, "in [1.2e-38, 1]"),
            ("seed", -(2**63) <= self.seed < 2**63, "a 64-bit integer"),  # jax.random.key
        ):
            if not valid:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be {rule} (got {getattr(self, name)})")


# ----- Environment ------------------------------------------------------------------------

NUM_ACTIONS = 4
MOVES = np.array([[0, 1], [1, 0], [0, -1], [-1, 0]])  # (row, col) step: right, down, left, up


class GridMap(NamedTuple):
    """A parsed map and the tables derived from it (numpy, outside jit)."""

    grid: np.ndarray  # [rows, cols] characters
    next_cell: np.ndarray  # [rows*cols, 4] int32: the flat cell (row*cols+col) an action reaches
    start: int  # flat cell of S
    goal: int  # flat cell of G
    shortest_path_length: int  # fewest steps from S to G


@functools.cache  # Config checks the map, then GridWorld is built from it: one parse a run
def parse_layout(text: str) -> GridMap:
    """Map text -> GridMap. Raises ValueError with a one-line reason."""
    # Rows split at "\n" only (not at a form feed); trailing spaces and outer blank lines dropped.
    lines = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n").split("\n")
    if not lines[0]:
        raise ValueError("--layout: the map is empty")
    for row, line in enumerate(lines):
        if len(line) != len(lines[0]):
            raise ValueError(
                f"--layout: row {row} has {len(line)} characters, row 0 has {len(lines[0])}"
            )
        for col, char in enumerate(line):
            if char not in ".#SG":
                raise ValueError(
                    f"--layout: unknown character {char!r} at row {row} col {col} (use . # S G)"
                )
    grid = np.array([list(line) for line in lines])
    for char, name in (("S", "start"), ("G", "goal")):
        count = int((grid == char).sum())
        if count != 1:
            raise ValueError(f"--layout: the map needs exactly one {char} ({name}), found {count}")
    # next_cell[cell, action]: off the grid or into a wall, the agent stays where it is. Walls,
    # never stood on, map to themselves (the appendix's value iteration then leaves them at 0).
    rows, cols = grid.shape
    next_cell = np.zeros((rows * cols, NUM_ACTIONS), np.int32)
    for cell, (row, col) in enumerate(np.ndindex(rows, cols)):
        for action, (r, c) in enumerate(MOVES + (row, col)):
            free = 0 <= r < rows and 0 <= c < cols and "#" not in (grid[r, c], grid[row, col])
            next_cell[cell, action] = r * cols + c if free else cell
    start, goal = (int(np.flatnonzero(grid.ravel() == char)[0]) for char in "SG")
    # Breadth-first search from S; no shortest path is longer than the number of cells.
    frontier, seen = {start}, {start}
    for steps in range(rows * cols):
        if goal in frontier:
            return GridMap(
                grid=grid, next_cell=next_cell, start=start, goal=goal, shortest_path_length=steps
            )
        frontier = set(next_cell[list(frontier)].ravel().tolist()) - seen
        seen |= frontier
    raise ValueError("--layout: G cannot be reached from S")


class EnvState(NamedTuple):
    cell: jax.Array  # int32 flat cell index row*cols+col
    time: jax.Array  # int32 steps taken since the last reset


class GridWorld:
    """Deterministic GridWorld with the gymnax 1.0 API (reset/step with auto-reset).

    Observation = the flat cell index. Reward 1.0 on the step that enters G, which terminates.
    With max_episode_steps > 0 an episode is truncated after that many steps (a time limit,
    not a terminal state: the agent still bootstraps from it).
    """

    def __init__(self, layout: str, max_episode_steps: int = 0):
        self.map = parse_layout(layout)
        self.rows, self.cols = self.map.grid.shape
        self.num_cells = self.rows * self.cols
        self.max_episode_steps = max_episode_steps

    def reset(self, key: jax.Array | None) -> tuple[jax.Array, EnvState]:
        del key  # every episode starts at S
        state = EnvState(cell=jnp.int32(self.map.start), time=jnp.int32(0))
        return state.cell, state

    def step(self, key: jax.Array | None, state: EnvState, action: jax.Array):
        """-> (obs, state, reward, terminated, truncated, info), back at S when done;
        info["final_observation"] is the cell the action really led to, before the reset."""
        next_cell = jnp.asarray(self.map.next_cell)[state.cell, action]
        time = state.time + 1
        terminated = next_cell == self.map.goal
        truncated = jnp.bool_(False)
        if self.max_episode_steps:  # Python-level: no time-limit code when there is no limit
            truncated = (time >= self.max_episode_steps) & ~terminated  # G at the limit: terminated
        done = terminated | truncated  # auto-reset: the next episode starts at S
        state = EnvState(
            cell=jnp.where(done, self.map.start, next_cell), time=jnp.where(done, 0, time)
        )
        reward = terminated.astype(jnp.float32)
        return state.cell, state, reward, terminated, truncated, {"final_observation": next_cell}


# ----- Agent ------------------------------------------------------------------------------

# One random 32-bit word a step, two 16-bit fields: the low half decides explore vs exploit, the
# high half picks the action. One draw a step, not a float and an integer (see README).
RANDOM_FIELD_BITS = 16
RANDOM_FIELD_MASK = (1 << RANDOM_FIELD_BITS) - 1


def explore_threshold(epsilon: float) -> int:
    """Explore when the 16-bit field is below this: epsilon rounded to a multiple of 2^-16."""
    return round(epsilon * (1 << RANDOM_FIELD_BITS))


def epsilon_greedy(q_s: jax.Array, bits: jax.Array, threshold: int) -> jax.Array:
    """Action for Q-values q_s [4] from one random uint32 `bits`.

    With probability epsilon pick uniformly among all actions, otherwise uniformly among the
    best ones: distrax.EpsilonGreedy's distribution. Uniform tie-breaks matter at the start,
    when all Q-values are equal (from initial_q 0, argmax's first maximum would always pick right).
    """
    explore = (bits & RANDOM_FIELD_MASK) < threshold
    candidates = explore | (q_s == q_s.max())  # [4] bool: the actions to choose among
    # The j-th candidate with j = floor(u * count), u the high 16 bits as a fraction in [0, 1).
    j = ((bits >> RANDOM_FIELD_BITS) * candidates.sum()) >> RANDOM_FIELD_BITS
    rank = jnp.cumsum(candidates) - 1  # [4] rank of each candidate among the candidates
    return jnp.argmax(candidates & (rank == j)).astype(jnp.int32)


def q_learning_update(q, obs, action, reward, terminated, next_obs, learning_rate, gamma):
    """next_obs must be the cell the action led to (info["final_observation"]), never the reset
    cell S. A terminal step has no future, so it does not bootstrap; a truncated one does."""
    bootstrap = jnp.where(terminated, 0.0, q[next_obs].max())
    target = reward + gamma * bootstrap
    new_value = q[obs, action] + learning_rate * (target - q[obs, action])
    # .set of a value computed here, not .at[...].add(step): XLA may fuse a multiply and an add
    # into one FMA (one rounding, not two) here with or without vmap, not in a vmapped scatter-add.
    # So vmap(train) matches train bit for bit: a last-bit difference would flip a later tie-break.
    return q.at[obs, action].set(new_value)


# ----- Train ------------------------------------------------------------------------------


class EpisodeStats(NamedTuple):
    """Totals over the episodes that ended in some stretch of training."""

    episodes: jax.Array  # int32 episodes that ended (terminated or truncated)
    length_sum: jax.Array  # int32 sum of their lengths
    return_sum: jax.Array  # int32 sum of their (undiscounted) returns: 1 a goal, 0 a time limit


class StepCarry(NamedTuple):
    """Carry of the per-step scan: kept small, it is read and written every step."""

    q: jax.Array  # [num_cells, 4] float32 Q-table
    env_state: EnvState
    obs: jax.Array  # int32 cell index the agent sees
    episodes: jax.Array  # int32 episodes ended so far
    goals: jax.Array  # int32 goals reached so far (a float32 sum would stop at 2^24)
    # [num_recorded_episodes] int32 length of episode i, for the first episodes (0: not ended)
    episode_lengths: jax.Array


class BlockCarry(NamedTuple):
    step_carry: StepCarry
    curve: EpisodeStats  # [num_points] each: the learning curve being filled in
    key: jax.Array


def make_train(config: Config, env: GridWorld | None = None):
    """-> train(rng) -> {"q_values", "metrics"}. Pass `env` where it is built already."""
    env = env or GridWorld(config.layout, config.max_episode_steps)
    # Whole blocks, then the rest of total_timesteps in one shorter block.
    full_blocks, rest = divmod(config.total_timesteps, config.steps_per_block)
    num_blocks = full_blocks + (rest > 0)
    # The curve has a fixed number of points (fewer only when there are fewer blocks), so the
    # memory for metrics does not grow with total_timesteps.
    num_points = min(config.num_curve_points, num_blocks)
    point_of_block = (np.arange(num_blocks) * num_points // num_blocks).astype(np.int32)
    blocks_done = np.bincount(point_of_block).cumsum()  # [num_points] blocks done at each point
    steps_done = np.minimum(blocks_done * config.steps_per_block, config.total_timesteps)
    threshold = explore_threshold(config.epsilon)

    def agent_env_step(carry: StepCarry, bits: jax.Array) -> tuple[StepCarry, None]:
        """One agent step and one environment step; `bits` is this step's random uint32."""
        action = epsilon_greedy(carry.q[carry.obs], bits, threshold)
        # key=None: GridWorld never reads it (random dynamics would need a share of `bits` too).
        obs, env_state, reward, terminated, truncated, info = env.step(
            None, carry.env_state, action
        )
        next_obs = info["final_observation"]  # the cell the action led to, not the reset S
        lr, gamma = config.learning_rate, config.gamma
        q = q_learning_update(carry.q, carry.obs, action, reward, terminated, next_obs, lr, gamma)
        done = terminated | truncated
        # Record the length of an episode that ends, while fewer than num_recorded_episodes
        # have: an index past the end of the array is dropped, which costs less than a cond.
        record_at = jnp.where(done, carry.episodes, config.num_recorded_episodes)
        length = carry.env_state.time + 1  # of the episode this step belongs to
        return StepCarry(
            q=q,
            env_state=env_state,
            obs=obs,
            episodes=carry.episodes + done,
            goals=carry.goals + terminated,
            episode_lengths=carry.episode_lengths.at[record_at].set(length, mode="drop"),
        ), None

    def run_block(steps: int, carry: BlockCarry, point: jax.Array) -> tuple[BlockCarry, None]:
        """`steps` steps, their randomness drawn in one call, their stats to curve `point`."""
        key, block_key = jax.random.split(carry.key)
        bits = jax.random.bits(block_key, (steps,), jnp.uint32)  # [steps]
        before = carry.step_carry
        # No unroll on purpose: unrolling this scan made it slower on CPU (measured: see README).
        after, _ = jax.lax.scan(agent_env_step, before, bits)
        # Length sums cost nothing per step: a block's steps are those of the episodes that
        # ended in it, plus the running episode's steps at its end, minus those it had at its
        # start. Returns likewise, simpler: GridWorld's only reward, 1, ends an episode, so the
        # returns of the episodes that ended in a block add up to the goals reached in it.
        stats = EpisodeStats(
            episodes=after.episodes - before.episodes,
            length_sum=steps + before.env_state.time - after.env_state.time,
            return_sum=after.goals - before.goals,
        )
        curve = jax.tree.map(lambda c, s: c.at[point].add(s), carry.curve, stats)
        return BlockCarry(step_carry=after, curve=curve, key=key), None

    def train(rng: jax.Array) -> dict:
        obs, env_state = env.reset(None)  # key=None: every episode starts at S
        step_carry = StepCarry(
            q=jnp.full((env.num_cells, NUM_ACTIONS), config.initial_q, jnp.float32),
            env_state=env_state,
            obs=obs,
            episodes=jnp.int32(0),
            goals=jnp.int32(0),
            episode_lengths=jnp.zeros(config.num_recorded_episodes, jnp.int32),
        )
        curve = EpisodeStats(
            episodes=jnp.zeros(num_points, jnp.int32),
            length_sum=jnp.zeros(num_points, jnp.int32),
            return_sum=jnp.zeros(num_points, jnp.int32),
        )
        carry = BlockCarry(step_carry=step_carry, curve=curve, key=rng)
        whole_blocks = functools.partial(run_block, config.steps_per_block)
        carry, _ = jax.lax.scan(whole_blocks, carry, point_of_block[:full_blocks])
        if rest:
            carry, _ = run_block(rest, carry, point_of_block[-1])
        curve = carry.curve  # [num_points] each
        ended = jnp.maximum(curve.episodes, 1)  # none: means of 0, not 0/0 (trips JAX_DEBUG_NANS)
        return {
            "q_values": carry.step_carry.q.reshape(env.rows, env.cols, NUM_ACTIONS),
            "metrics": {
                # [num_recorded_episodes] lengths of the first episodes, 0 where not ended
                "episode_length": carry.step_carry.episode_lengths,
                # [num_points] each, whatever the run length: steps done at each point, and
                # the episodes that ended in its stretch of training
                "timestep": jnp.asarray(steps_done, jnp.int32),
                "episodes": curve.episodes,
                "mean_episode_length": curve.length_sum / ended,
                "mean_return": curve.return_sum / ended,
            },
        }

    return train


# ===== Appendix: running it at scale and reporting =====

# ruff: noqa: E402 (what only the appendix uses is imported here, so the reference copies alone)
import argparse
import contextlib
import csv
import fcntl
import itertools
import json
import math
import platform
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path, PurePosixPath

# The built-in maps for --layout. "maze" (shortest path 22 steps) and "four_rooms" (20) have
# walls and were not used to choose the hyperparameters.
LAYOUTS = {
    "default": DEFAULT_LAYOUT,
    "maze": """
G..#.....#..
##.#.###.#.#
...#...#...#
.#####.###.#
.....#...#..
####.###.#.#
...#...#.#..
.#...#.....S
""",
    "four_rooms": """
#############
#G....#.....#
#.....#.....#
#...........#
#.....#.....#
#.....#.....#
##.####.....#
#.....###.###
#.....#.....#
#.....#.....#
#...........#
#.....#....S#
#############
""",
}
# On CPU, vmap turns each step's lookups and Q-update into batched gathers and scatters, which
# beat one seed after another only from about this many seeds a device (measured: see README).
CPU_MIN_SEEDS_TO_VMAP = 32
# Larger is not a map anyone draws by hand, and parsing it in Python would take minutes.
MAX_MAP_BYTES = 256 * 1024  # about 500 x 500 cells
CGROUP_LIMITS = {"": "memory.max", "memory": "memory.limit_in_bytes"}  # cgroup v2, v1
XLA_FLAGS = os.environ.get("XLA_FLAGS")  # as this script, imported, set them for JAX
RUN_FILES = ("summary.json", "curves.csv", "first_episodes.csv", "q_tables.npy")
RUN_NAMES = (*RUN_FILES, "q_learning_gridworld.png")  # all a run writes
SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
RECEIVED: list[int] = []  # the signals stop() was called for
LOCKED = {}  # folder -> the descriptor whose lock this process holds until it ends
MADE = {}  # folder -> the folders make_folder made for it: itself if new, parents nearest first
FOUND_EMPTY = {}  # folder named outright -> run_folder found it empty (or not there yet)
# A message's control characters (a newline in a folder's name) shown escaped: still one line.
ESCAPED = {code: repr(chr(code))[1:-1] for code in (*range(32), 127)}


def wait(tree):
    """jax.block_until_ready that handles a Ctrl-C or SIGTERM within 0.1 s, not at the end."""
    for leaf in jax.tree.leaves(tree):
        while not leaf.is_ready():
            time.sleep(0.05)
    return tree


def train_seeds(train, seed: int, num_seeds: int, batch_size: int | None = None):
    """jax.jit(jax.vmap(train)) over seeds 0..num_seeds-1 split over the devices -> (numpy
    outputs, timings). batch_size: each device runs its seeds that many at a time (None: all)."""
    devices = jax.devices()[:num_seeds]  # fewer seeds than devices: one seed a device
    num_keys = -(-num_seeds // len(devices)) * len(devices)  # padded, dropped after training
    mesh = jax.sharding.Mesh(np.array(devices), ("seeds",))
    spec = jax.sharding.PartitionSpec("seeds")
    # Key i = fold_in(key(seed), i): seed i's run does not depend on how many seeds run. The
    # keys are made inside jit with the seed sharding, so each device makes its own.
    fold_in = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    make_keys = jax.jit(
        lambda: fold_in(jax.random.key(seed), jnp.arange(num_keys)),
        out_shardings=jax.sharding.NamedSharding(mesh, spec),
    )
    per_device = jax.vmap(train)
    if batch_size is not None:
        per_device = functools.partial(jax.lax.map, train, batch_size=batch_size)
    # check_vma=False: train starts from constants (zeros, S), which shard_map's type check
    # would want marked as varying per device; no value is shared between devices anyway.
    run = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    )
    keys = make_keys()
    start = time.perf_counter()
    compiled = run.lower(keys).compile()
    stop_if_received()
    compiled_at = time.perf_counter()
    out = wait(compiled(keys))
    timings = {
        "compile_time_s": compiled_at - start,
        "train_time_s": time.perf_counter() - compiled_at,  # the compiled training call alone
        "devices": [str(device) for device in devices],
        "padded_num_seeds": num_keys,
        "batch_size": batch_size,
    }
    return jax.tree.map(lambda x: np.asarray(x)[:num_seeds], out), timings


def host_memory() -> int:
    """Bytes of RAM, or the memory limit of a cgroup holding this process where lower: a
    container's, or a Slurm job's --mem (past it the kernel kills the run, with no line)."""
    return min(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), cgroup_limit())


def cgroup_limit(proc=Path("/proc/self/cgroup"), root=Path("/sys/fs/cgroup")) -> float:
    """The tightest memory limit, in bytes, of the cgroups holding this process and of their
    parents, where one may be set instead; inf where none is ("max", no such files, not Linux)."""
    try:
        lines = proc.read_text().splitlines()  # "id:controllers:/path", v2's controllers ""
    except OSError:  # not Linux
        return math.inf
    limit = math.inf
    for _, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        for name in {"", "memory"} & set(controllers.split(",")):
            for folder in (PurePosixPath(path), *PurePosixPath(path).parents):
                file = root / name / str(folder).lstrip("/") / CGROUP_LIMITS[name]
                with contextlib.suppress(OSError, ValueError):  # no such file; "max"
                    limit = min(limit, int(file.read_text()))
    return limit


def device_memory() -> int:  # GPU memory where reported, else RAM (tests pretend other sizes)
    stats = [device.memory_stats() or {} for device in jax.devices()]
    if jax.default_backend() != "cpu" and all("bytes_limit" in s for s in stats):
        return sum(s["bytes_limit"] for s in stats)
    return host_memory()


def count_blocks(config: Config) -> int:
    return -(-config.total_timesteps // config.steps_per_block)  # the last one may be shorter


def check_memory(config: Config, env: GridWorld) -> None:
    """Refuse, before compiling, a run whose arrays need more than half the memory (the rest is
    for XLA and everything else), naming the flag to change. Bytes per seed by driving flag."""
    blocks = count_blocks(config)
    per_seed = {
        "--layout": 4 * 3 * env.num_cells * NUM_ACTIONS,  # the Q-table thrice: carry, loop, output
        # A block's random words, and more; a block is at most the whole run.
        "--steps-per-block": 4 * 6 * min(config.steps_per_block, config.total_timesteps),
        # On the device, then as rows of first_episodes.csv and points of the figure.
        "--num-recorded-episodes": 200 * config.num_recorded_episodes,
        "--num-curve-points": 4 * 4 * min(config.num_curve_points, blocks),
    }
    limit = device_memory() / 2
    half_host = host_memory() / 2
    if 24 * blocks > half_host:  # make_train's curve point of each block, in numpy, then jax
        fewest = -(-24 * config.total_timesteps // int(half_host))
        fail(
            f"--steps-per-block: {blocks:,} blocks need about {24 * blocks / 1e9:.1f} GB to "
            f"index, more than half the host's memory ({half_host / 1e9:.1f} GB); use "
            f"--steps-per-block {fewest:,} or more"
        )
    need = sum(per_seed.values())
    if need > limit:
        largest = max(per_seed, key=per_seed.get)
        fail(
            f"{largest}: one seed needs about {need / 1e9:.1f} GB, more than half the devices' "
            f"memory ({limit / 1e9:.1f} GB); lower {largest}"
        )
    if config.num_seeds * need > limit:
        fail(
            f"--num-seeds {config.num_seeds} needs about {config.num_seeds * need / 1e9:.1f} GB, "
            f"more than half the devices' memory ({limit / 1e9:.1f} GB); use fewer seeds"
        )


def value_iteration(env: GridWorld, gamma: float) -> np.ndarray:
    """Exact Q* [num_cells, 4] of the same MDP: the yardstick for the learned Q-values."""
    next_cell, goal = env.map.next_cell, env.map.goal
    q = np.zeros(next_cell.shape)
    while True:
        v = q.max(axis=1)
        v[goal] = 0.0  # G is terminal: nothing follows it
        new_q = (next_cell == goal) + gamma * v[next_cell]
        if np.abs(new_q - q).max() < 1e-12:
            return new_q
        q = new_q


def greedy_path(env: GridWorld, q: np.ndarray) -> list[int] | None:
    """Cells from S to G along argmax Q [cells, 4] (first on ties); None: a loop or dead end."""
    cells = [env.map.start]
    for _ in range(env.num_cells):
        cells.append(int(env.map.next_cell[cells[-1], np.argmax(q[cells[-1]])]))
        if cells[-1] == env.map.goal:
            return cells
    return None


def jax_settings() -> dict:
    """What else gives a run other bits: XLA's flags as JAX started with them (unless it had
    started before this script was imported), and JAX's switches of that kind."""
    names = ("jax_enable_x64", "jax_threefry_partitionable", "jax_default_matmul_precision")
    return {"XLA_FLAGS": XLA_FLAGS} | {name: getattr(jax.config, name) for name in names}


def summarize(config: Config, env: GridWorld, q_values: np.ndarray, timings: dict) -> dict:
    """summary.json: config, versions, JAX settings, timings, speed, and per seed the greedy
    path length from S against the shortest, and V(S) against V*(S) from value iteration."""
    v_star = float(value_iteration(env, config.gamma)[env.map.start].max())
    seeds = []
    for seed_index, q in enumerate(q_values.reshape(len(q_values), env.num_cells, NUM_ACTIONS)):
        path, v_start = greedy_path(env, q), float(q[env.map.start].max())
        seed = {
            "seed_index": seed_index,
            "greedy_path_length": None if path is None else len(path) - 1,
            "shortest_path_length": env.map.shortest_path_length,
            "v_start": v_start,
            "v_star_start": v_star,
            # None where V*(S) is 0: gamma 0, or gamma^(shortest - 1) below the VI tolerance.
            "v_start_relative_error": abs(v_start - v_star) / v_star if v_star else None,
        }
        seeds.append(seed)
    packages = ("jax", "jaxlib", "numpy", "matplotlib")  # what this script runs on
    versions = {"python": platform.python_version(), **{p: metadata.version(p) for p in packages}}
    return {
        "config": dataclasses.asdict(config),
        "versions": versions,
        "jax_settings": jax_settings(),
        **timings,
        "agent_steps_per_s": config.num_seeds * config.total_timesteps / timings["train_time_s"],
        "optimal_seeds": sum(s["greedy_path_length"] == s["shortest_path_length"] for s in seeds),
        "seeds": seeds,
    }


def expected_episode_length(env: GridWorld, epsilon: float, gamma: float) -> float | None:
    """Mean steps from S to G of epsilon-greedy on Q* (ties uniform): why even a perfect learner's
    episodes stay above the shortest path while it explores. None with a time limit (it cuts the
    episodes), a map too large to solve cheaply, or a Q*(S) of zeros (gamma 0, or tiny gamma^n)."""
    if env.num_cells > 2_500 or env.max_episode_steps:
        return None
    q = value_iteration(env, gamma)
    if not q[env.map.start].max():
        return None
    best = np.isclose(q, q.max(axis=1, keepdims=True), rtol=1e-9, atol=0)  # Q* may be ~1e-10
    policy = epsilon / NUM_ACTIONS + (1 - epsilon) * best / best.sum(axis=1, keepdims=True)
    # steps = 1 + E[steps of the next cell], 0 at G: one linear system over the cells S reaches,
    # solved exactly (an iteration stops short: 3463 for 3662 on the maze at epsilon 1).
    reached, frontier = np.arange(env.num_cells) == env.map.start, np.array([env.map.start])
    while frontier.size:
        frontier = np.unique(env.map.next_cell[frontier])
        frontier = frontier[~reached[frontier]]
        reached[frontier] = True
    moves = np.zeros((env.num_cells, env.num_cells))
    np.add.at(moves, (np.arange(env.num_cells)[:, None], env.map.next_cell), policy)
    moves[env.map.goal] = 0.0  # G ends the episode
    cells = np.flatnonzero(reached)
    ones = np.where(cells == env.map.goal, 0.0, 1.0)
    steps = np.linalg.solve(np.eye(len(cells)) - moves[np.ix_(cells, cells)], ones)
    return float(steps[cells == env.map.start][0])


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", together: list | None = None):
    """Write to a temporary name beside path, then rename: no reader sees half a file. Given
    `together`, the rename waits for rename_all(together): several files appear all or none.
    A write that fails (a full disk, say) ends the script with one line, leaving no temporary."""
    pending = [] if together is None else together
    try:  # a new file: one at that name could be a link, and writing through it writes elsewhere
        temporary(path).unlink(missing_ok=True)
        with open(temporary(path), mode.replace("w", "x")) as file:
            yield file
        pending.append(path)
        if together is None:
            rename_all(pending)
    except BaseException as error:  # an error, Ctrl-C: no temporary file left behind
        for written in {path, *pending}:
            temporary(written).unlink(missing_ok=True)
        if isinstance(error, OSError):
            reason = error.strerror or error  # no file name: the temporary one
            remove_if_empty(path.parent)  # the run's folder, if this was to be its first file
            fail(f"cannot write {path} ({reason})", status=1)
        raise


def rename_all(paths: list[Path]) -> None:
    """Each file written under its temporary name (atomic_open's `together`) to its own."""
    for path in paths:
        os.replace(temporary(path), path)


def temporary(path: Path) -> Path:
    """Where a file is written before its rename (suffix last: a writer picks a format by it)."""
    return path.with_name(f".{path.stem}.tmp{path.suffix}")


@contextlib.contextmanager
def signals_held():
    """Ctrl-C, SIGTERM and SIGHUP wait until the block is done; yields those that came."""
    caught = []
    held = {signum: signal.signal(signum, lambda n, _: caught.append(n)) for signum in catchable()}
    try:
        yield caught
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def written_whole():
    """A signal that comes meanwhile, or whose exception was dropped earlier (RECEIVED), ends
    the script once the block (a run's files) is done."""
    with signals_held() as caught:
        yield
    if caught := RECEIVED + caught:  # RECEIVED: stop() took one whose exception was dropped
        message = f"stopped by {SIGNALS[caught[0]]} once the run was written whole"
        print(f"q_learning_gridworld.py: {message}", file=sys.stderr)  # asked for: not an "error:"
        sys.exit(128 + caught[0])


def catchable() -> list[int]:
    """SIGNALS but those ignored, which stay ignored (nohup starts the script so for SIGHUP)."""
    return [signum for signum in SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]


def write_csv(path: Path, columns: dict, together: list | None = None) -> None:
    """Tidy CSV: the columns, broadcast to one shape ([seeds, points]), one row per element,
    written a seed at a time (Python floats for all of them at once took ~40x numpy's memory)."""
    arrays = np.broadcast_arrays(*columns.values())
    with atomic_open(path, together=together) as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(columns)
        for seed in range(arrays[0].shape[0]):
            writer.writerows(zip(*(a[seed].tolist() for a in arrays), strict=True))


def describe(error: Exception) -> str:
    """An error for a line of ours: our own ValueError's words, any other's with its type."""
    return str(error) if type(error) is ValueError else f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def reading(path: Path):
    """Reading a saved file (-> its path): whatever is wrong with it is one ValueError naming it."""
    try:
        yield path
    except Exception as error:
        raise ValueError(f"{path.name}: {describe(error)}") from None


def read_csv(path: Path, columns: tuple[str, ...], num_seeds: int) -> dict:
    """write_csv's file -> {column: float array [seeds, points]}, parsed by numpy (a dict a row
    took ~600 bytes). Its rows must be the summary's seeds in order, at the same rising column 2."""
    # utf-8-sig: a byte-order mark (a spreadsheet's save) is no part of the first column's name
    with (
        reading(path),
        open(path, encoding="utf-8-sig") as file,
        warnings.catch_warnings(action="ignore"),
    ):
        names = file.readline().strip().split(",")
        values = np.loadtxt(file, delimiter=",", ndmin=2)
        if not values.size:  # our line, not numpy's warning (ignored) and a reshape error
            raise ValueError("it holds no rows")
        if names != list(columns) or values.shape[1] != len(columns):
            raise ValueError(f"its columns are not {','.join(columns)}")
        table = {name: values[:, i].reshape(num_seeds, -1) for i, name in enumerate(names)}
        x = table[columns[1]]  # steps, or episode numbers
        seeds_in_order = (table["seed"] == np.arange(num_seeds)[:, None]).all()
        if not seeds_in_order or (x != x[0]).any() or (np.diff(x[0]) <= 0).any():
            raise ValueError(f"its rows are not the summary's {num_seeds} seeds, each at the same "
                             f"rising {columns[1]}s")  # fmt: skip
        return table


def save_run(output_dir: Path, summary: dict, out: dict) -> None:
    """RUN_FILES, all or none: the summary, the curves and first episode lengths (0: not ended)
    per seed, the final Q-tables [seeds, rows, cols, 4]: all that the figure is drawn from."""
    metrics, seed = out["metrics"], np.arange(len(out["q_values"]))[:, None]
    written = []  # renamed together once all are written
    with atomic_open(output_dir / "summary.json", together=written) as file:
        json.dump(summary, file, indent=2, allow_nan=False)  # strict JSON: no NaN in it
    curve = {"seed": seed, "step": metrics["timestep"], "episodes": metrics["episodes"]}
    for name in ("mean_episode_length", "mean_return"):  # a stretch where none ended: NaN
        curve[name] = np.where(metrics["episodes"] > 0, metrics[name], np.nan)
    write_csv(output_dir / "curves.csv", curve, written)
    episode = np.arange(1, metrics["episode_length"].shape[1] + 1)
    lengths = {"seed": seed, "episode": episode, "length": metrics["episode_length"]}
    write_csv(output_dir / "first_episodes.csv", lengths, written)
    with atomic_open(output_dir / "q_tables.npy", "wb", together=written) as file:
        np.save(file, np.asarray(out["q_values"], np.float32))
    rename_all(written)


def saved_config(saved: dict) -> Config:
    """The Config of a run's summary.json. A setting it lacks (its default may not be the
    run's) or of another type than its default (2.5 seeds) is a ValueError."""
    defaults = {field.name: field.default for field in dataclasses.fields(Config)}
    for name, value in saved.items():
        if name not in defaults:  # a DQN run's "buffer_size", say
            raise ValueError(f"its config has {name!r}, not a setting of q_learning_gridworld.py")
        default = defaults[name]  # an int may stand for a float; a bool stands for nothing else
        if type(value) is not type(default) and (type(default), type(value)) != (float, int):
            raise ValueError(f"{name} {value!r} is not of the type of its default, {default!r}")
    if missing := [name for name in defaults if name not in saved]:
        raise ValueError(f"its config lacks {missing[0]!r}")
    return Config(**saved)


def check_episodes(run_dir: Path, config: Config, curves: dict, first: dict) -> None:
    """ValueError naming the file unless its numbers are ones the run could make."""
    limit = config.max_episode_steps or config.total_timesteps
    with reading(run_dir / "curves.csv"):
        episodes, length = curves["episodes"], curves["mean_episode_length"]
        ret = curves["mean_return"]
        ended = episodes > 0
        means = np.where(ended, (length >= 1) & (length <= limit) & (ret >= 0) & (ret <= 1),
                         np.isnan(length) & np.isnan(ret))  # fmt: skip
        if not ((episodes % 1 == 0) & (episodes >= 0) & means).all():
            raise ValueError("its episodes and means are not ones a run makes")
        points = min(config.num_curve_points, count_blocks(config))
        if episodes.shape[1] != points:
            raise ValueError(f"it has {episodes.shape[1]} curve points, not the run's {points}")
        if (last := curves["step"][0, -1]) != config.total_timesteps:
            raise ValueError(f"its last step is {last:g}, not the run's {config.total_timesteps:,}")
    with reading(run_dir / "first_episodes.csv"):
        lengths = first["length"]  # [seeds, episodes]; 0: not ended
        if lengths.shape[1] != config.num_recorded_episodes:
            raise ValueError(f"it has {lengths.shape[1]} episodes, not the run's "
                             f"{config.num_recorded_episodes}")  # fmt: skip
        whole = (lengths % 1 == 0) & (lengths >= 0) & (lengths <= limit)
        if not whole.all() or (lengths.sum(axis=1) > config.total_timesteps).any():
            raise ValueError("its lengths are not ones a run makes")


def plot_run(run_dir: Path) -> Path:
    """Max-Q heatmap of seed 0 with its greedy actions, then two learning curves, drawn from
    the saved files alone (so the figure shows nothing that was not saved) -> its path."""
    from matplotlib.figure import Figure  # not pyplot: a file only, no display or backend
    from matplotlib.ticker import LogFormatter

    with reading(run_dir / "summary.json") as path:
        config = saved_config(json.loads(path.read_text())["config"])
    env, n = GridWorld(config.layout, config.max_episode_steps), config.num_seeds
    # Not np.load: a file that is not .npy, it would read as a pickle (and advise allow_pickle).
    with reading(run_dir / "q_tables.npy") as path, open(path, "rb") as file:
        tables, shape = np.lib.format.read_array(file), (n, env.rows, env.cols, NUM_ACTIONS)
        if tables.shape != shape or tables.dtype.kind != "f":  # [seeds, rows, cols, actions]
            raise ValueError(f"it holds {tables.dtype} {tables.shape}; the summary: float {shape}")
        if not np.isfinite(tables).all():  # a NaN cell was drawn black, as a wall
            raise ValueError("it holds a value that is not a finite number")
        q = tables[0].reshape(env.num_cells, NUM_ACTIONS)  # seed 0's
    columns = ("seed", "step", "episodes", "mean_episode_length", "mean_return")
    curves = read_csv(run_dir / "curves.csv", columns, n)
    first = read_csv(run_dir / "first_episodes.csv", ("seed", "episode", "length"), n)
    check_episodes(run_dir, config, curves, first)
    fig = Figure(figsize=(18, 5), layout="tight")
    ax_map, ax_episodes, ax_steps = fig.subplots(1, 3, width_ratios=[1.2, 1, 1])
    fig.suptitle(
        f"Q-learning on a {env.rows}x{env.cols} map: {plural(n, 'seed')} x "
        f"{config.total_timesteps:,} steps, learning rate {config.learning_rate:g}, "
        f"gamma {config.gamma:g}, epsilon {config.epsilon:g}"
    )
    walls = env.map.grid == "#"
    value = np.ma.masked_array(q.max(axis=1).reshape(walls.shape), mask=walls)
    ax_map.set_facecolor("black")  # seen through the masked cells: the walls
    fig.colorbar(ax_map.imshow(value), ax=ax_map, label="max_a Q(s, a)", shrink=0.8)
    # The greedy action of every free cell but G, red along the greedy path from S.
    cells = [cell for cell in np.flatnonzero(~walls) if cell != env.map.goal]
    on_path = set(greedy_path(env, q) or [])
    d_row, d_col = MOVES[q[cells].argmax(axis=1)].T
    colors = ["red" if cell in on_path else "white" for cell in cells]
    rows, cols = np.divmod(cells, env.cols)
    ax_map.quiver(cols, rows, d_col, -d_row, color=colors, pivot="middle", units="xy", scale=2.2)
    for char, cell in (("S", env.map.start), ("G", env.map.goal)):
        row, col = divmod(cell, env.cols)
        ax_map.text(col, row, char, ha="center", va="center", size=12, backgroundcolor="w")
    ax_map.set(title="seed 0: max-Q, greedy action (red: path from S)", xticks=[], yticks=[])

    lengths = np.where(first["length"] > 0, first["length"], np.nan)  # 0: not ended
    ax_episodes.set_title(f"the first {lengths.shape[1]} episodes: length of each")
    ax_steps.set_title(
        "mean episode length per curve point\n(episodes ended since the previous one)"
    )
    shortest = env.map.shortest_path_length
    expected = expected_episode_length(env, config.epsilon, config.gamma)
    for ax, x, y, x_label in (  # y: [seeds, points], NaN where no episode ended
        (ax_episodes, first["episode"][0], lengths, "episode"),
        (ax_steps, curves["step"][0], curves["mean_episode_length"], "environment steps"),
    ):
        y = np.ma.masked_invalid(y)  # mean, min and max over the seeds skip the NaN
        marker = "o" if len(x) <= 50 else None  # show where the few points are
        if n == 1:  # one seed is its own curve: no band to draw
            ax.plot(x, y[0], marker=marker, label="seed 0")
        else:
            ax.plot(x, y.mean(axis=0), marker=marker, label=f"mean of {n} seeds")
            band = f"min to max of {n} seeds"
            ax.fill_between(x, y.min(axis=0), y.max(axis=0), alpha=0.3, label=band)
        ax.axhline(shortest, color="black", ls="--", label=f"shortest path ({shortest})")
        if expected is not None:
            label = f"expected with epsilon = {config.epsilon:g} exploration ({expected:.1f})"
            ax.axhline(expected, color="gray", ls=":", label=label)
        # Log only where the lengths span a decade (the first episodes); plain numbers on it.
        log = y.max() > 10 * y.min()
        ax.set(yscale="log" if log else "linear", xlabel=x_label, ylabel="episode length (steps)")
        if log:  # 20, 30, 100 rather than 2x10^1, 3x10^1, 10^2
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1)))
        ax.legend()
    path = run_dir / "q_learning_gridworld.png"
    with atomic_open(path, "wb") as file:
        fig.savefig(file, format="png", dpi=100)
    return path


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def fail(message: str, status: int = 2):
    """Exit with one line on stderr, status 2 (argparse would add its usage) unless given."""
    print(f"q_learning_gridworld.py: error: {message.translate(ESCAPED)}", file=sys.stderr)
    sys.exit(status)


def read_layout(value: str) -> str:
    """--layout value -> map text: a built-in name, or a map file (a regular file, small)."""
    path = Path(value)
    if value in LAYOUTS and path.is_file():  # a folder of that name is no map: the name
        raise argparse.ArgumentTypeError(
            f"{value!r} is a built-in layout and a file: for the file, write ./{value}"
        )
    if value in LAYOUTS:
        return LAYOUTS[value]
    # A FIFO would hang and /dev/zero never ends: only a regular file of a map's size is read.
    if not path.is_file() or path.stat().st_size > MAX_MAP_BYTES:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a built-in layout ({', '.join(LAYOUTS)}) nor a regular "
            f"file of at most {MAX_MAP_BYTES // 1024} KiB"
        )
    try:  # utf-8-sig: a file saved with a byte-order mark (Windows Notepad) reads as it shows
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise argparse.ArgumentTypeError(f"cannot read {value!r}: {error}") from None


def parse_config(argv: list[str] | None = None) -> Config | Path:
    """Config from the command line (a --flag per field, with its help), or --replot's DIR."""
    parser = argparse.ArgumentParser(
        prog="q_learning_gridworld.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.error = fail
    for field in dataclasses.fields(Config):
        # --layout takes a name or a path; left out, the Config's own map (a default "default"
        # would go through read_layout too, and a file of that name here would stop every run).
        layout = field.name == "layout"
        default = argparse.SUPPRESS if layout else field.default
        convert = read_layout if layout else field.type
        text = field.metadata["help"] + (" (default: default)" if layout else "")
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=convert, default=default, help=text)
    replot = {"metavar": "DIR", "default": argparse.SUPPRESS}  # no "(default: ...)"
    parser.add_argument("--replot", **replot, help="redraw the figure of a saved run; no training")
    overwrite_help = "replace the run in an --output-dir that holds one"
    parser.add_argument("--overwrite", action="store_true", help=overwrite_help)
    args = vars(parser.parse_args(argv))
    if "replot" in args:  # the saved run's figures: no other flag may change them
        parser.set_defaults(**dict.fromkeys(args))  # None: left out (a given flag never is)
        given = [name for name, x in vars(parser.parse_args(argv)).items() if x is not None]
        if given := [name for name in given if name != "replot"]:
            other = "--" + given[0].replace("_", "-")
            fail(f"--replot redraws the saved run as it was saved; leave out {other}")
        if not args["replot"]:  # Path("") is the current folder
            fail("--replot must name a run's folder")
        return Path(args["replot"])
    overwrite = args.pop("overwrite")
    try:
        config = Config(**args)
        return dataclasses.replace(config, output_dir=run_folder(config.output_dir, overwrite))
    except ValueError as error:
        fail(str(error))


def run_folder(template: str, overwrite: bool) -> str:
    """The run's folder, checked (a `{time}` one is new: make_folder picks it); ValueError. One
    named outright must hold no files, or a run's alone with --overwrite (see replacing)."""
    if not template:  # "" would write into the current folder
        raise ValueError("--output-dir must name a folder, not be empty")
    given = f"--output-dir {template}"
    if "{time}" in template:
        if ".." in Path(template).parts:  # {time}/.. names a folder that exists: never new
            raise ValueError(f"{given}: '..' and {{time}} together are refused")
        if overwrite:  # a flag that would do nothing
            raise ValueError(f"--overwrite: nothing to replace in {given}, new each run")
        return template
    try:
        held = sorted(Path(template).iterdir())
    except NotADirectoryError:
        raise ValueError(f"{given} is not a folder") from None
    except OSError:  # no such folder yet (it is made later), or a name the OS refuses
        held = []
    ours = {*RUN_NAMES, *(f(Path(name)).name for name in RUN_NAMES for f in (temporary, set_aside))}
    if foreign := [path.name for path in held if path.is_dir() or path.name not in ours]:
        raise ValueError(
            f"{given} holds {foreign[0]}, which no run of this script "
            "writes: name a new or empty folder, or one that holds a run (--overwrite)"
        )
    if held and not overwrite:
        raise ValueError(f"{given} already holds a run; --overwrite replaces it")
    # make_folder looks again once it holds the lock: a run may end there meanwhile.
    try:  # a current folder deleted, or a symbolic link to itself: resolve() raises
        FOUND_EMPTY[Path(template).resolve()] = not held and not overwrite
    except (OSError, RuntimeError) as error:
        raise ValueError(f"{given}: {error}") from None
    return template


def make_folder(folder: str) -> Path:
    """Make the run's folder and lock it. `{time}` becomes the start time, then _2, _3 while
    taken (mkdir is atomic: two runs never share one). OSError if a folder named outright is
    locked by a running run, or written by one that ended since run_folder found it empty."""
    path, stamp = Path(folder), time.strftime("%Y-%m-%d_%H-%M-%S")
    new = [p for p in Path(folder.replace("{time}", stamp)).parents if not p.exists()]
    made = "{time}" in folder or not path.exists()  # a folder of the user's stays theirs
    try:
        if "{time}" not in folder:
            path.mkdir(parents=True, exist_ok=True)
        else:
            for copy in itertools.count(1):
                path = Path(folder.replace("{time}", stamp if copy == 1 else f"{stamp}_{copy}"))
                path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    path.mkdir()
                    break
    except OSError:  # a name the OS refuses, say: remove the parents made for it
        for parent in new:  # nearest first; rmdir removes only an empty folder
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    key = path.resolve()
    if key not in LOCKED:  # flock: the system releases it when this process ends
        LOCKED[key] = os.open(key, os.O_RDONLY)
        try:
            fcntl.flock(LOCKED[key], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(LOCKED.pop(key))
            raise OSError(f"{path} is in use by another run that has not ended") from None
        if FOUND_EMPTY.pop(key, False) and any(key.iterdir()):  # a run ended there meanwhile
            os.close(LOCKED.pop(key))
            raise OSError(f"{path} now holds another run's files; --overwrite replaces them")
    MADE[key] = [path, *new] if made else new
    return path


def set_aside(path: Path) -> Path:
    """Where --overwrite keeps a previous run's file while the new run is written."""
    return path.with_name(f".{path.stem}.old{path.suffix}")


@contextlib.contextmanager
def replacing(folder: Path):
    """Writes a run over a previous run's files alone (--overwrite: a file put there meanwhile
    stays), set aside (no space needed) until the new run is written whole, put back as they
    were if a write fails (a full disk, say)."""
    paths, moved, started = [folder / name for name in RUN_NAMES], [], False
    try:
        for path in paths:  # first what a write cut short (a crash) left
            temporary(path).unlink(missing_ok=True)
            set_aside(path).unlink(missing_ok=True)
            if path.exists():
                os.replace(path, set_aside(path))
                moved.append(path)
        started = True
        yield
    except BaseException as error:  # the old files come back (all, or those set aside till then)
        stuck = path  # if not started: the file that would not move (immutable, another user's)
        for path in paths if started else moved:
            path.unlink(missing_ok=True)  # the new run's
            if set_aside(path).exists():
                os.replace(set_aside(path), path)
        remove_if_empty(folder)  # made for this run, which wrote its files, then failed
        if isinstance(error, OSError) and not started:
            reason, stuck = error.strerror or error, error.filename or stuck  # as the OS names it
            fail(f"--overwrite: cannot set {stuck} aside ({reason}); the run there stays as it "
                 "was, and this one is not written", status=1)  # fmt: skip
        raise
    for path in paths:
        set_aside(path).unlink(missing_ok=True)


def check_backend() -> None:
    """One line, before any work, for a JAX_PLATFORMS or XLA_FLAGS that leaves JAX no device
    (else a traceback at its first use) and for JAX_DISABLE_JIT (a run would take hours). That
    first use loads JAX's plugins, and JAX drops what their initialize() raises, a signal's
    exception too: a signal waits until it is done."""
    if jax.config.jax_disable_jit:  # JAX_DISABLE_JIT=1, or main() under jax.disable_jit()
        fail(
            "JAX_DISABLE_JIT: the command line runs compiled only; to step through train(), call "
            "it from Python under jax.disable_jit() (README: Debugging)"
        )
    with signals_held() as caught:
        try:
            jax.devices()
        except Exception as error:  # a RuntimeError, or an AssertionError for a missing cuda
            given = [f"{name}={os.environ[name]!r}" for name in ("JAX_PLATFORMS", "XLA_FLAGS") if
                     os.environ.get(name)]  # fmt: skip
            if not given:  # neither: JAX's own error, as it is
                raise
            detail = (str(error).splitlines() or ["JAX could start no platform"])[0][:200]
            fail(f"{', '.join(given)}: no JAX backend ({detail})")
    if caught:  # now to the handler in place again, which stops the run as anywhere else
        signal.raise_signal(caught[0])


def remove_if_empty(folder: Path) -> None:
    """A stopped run's folder and the parents made for it (make_folder), removed if empty."""
    for path in MADE.get(folder.resolve(), []):
        with contextlib.suppress(OSError):  # rmdir removes only an empty folder
            path.rmdir()


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    config = parse_config(argv)
    if isinstance(config, Path):  # --replot DIR: the figure again from the saved files
        if not all((config / name).is_file() for name in RUN_FILES):
            fail(f"--replot: {str(config)!r} is not a saved run (needs {', '.join(RUN_FILES)})")
        try:
            path = plot_run(config)
        except Exception as error:  # a damaged file: one line, not a traceback
            fail(f"--replot {config}: cannot redraw ({describe(error)})"[:300])
        return print(f"redrew {path} from the files saved there (no training)")
    check_backend()
    env = GridWorld(config.layout, config.max_episode_steps)
    check_memory(config, env)
    try:  # before training, so that a bad --output-dir costs no training
        output_dir = make_folder(config.output_dir)
        if not os.access(output_dir, os.W_OK):  # a folder that was there already
            raise OSError(f"{output_dir} is not writable")
    except OSError as error:
        fail(f"--output-dir: {error}")
    config = dataclasses.replace(config, output_dir=str(output_dir))
    num_blocks = count_blocks(config)
    if config.num_curve_points > num_blocks:  # a curve point is made of whole blocks
        print(
            f"note: {num_blocks} curve points, not {config.num_curve_points}: --num-curve-points "
            "is at most --total-timesteps / --steps-per-block (lower --steps-per-block for more)"
        )
    print(f"output {output_dir}/")
    few_seeds = config.num_seeds < CPU_MIN_SEEDS_TO_VMAP * jax.device_count()
    batch_size = 1 if jax.default_backend() == "cpu" and few_seeds else None
    devices = plural(min(config.num_seeds, jax.device_count()), f"{jax.default_backend()} device")
    print(f"{plural(config.num_seeds, 'seed')} x {config.total_timesteps:,} steps on {devices}")
    try:
        train = make_train(config, env)
        out, timings = train_seeds(train, config.seed, config.num_seeds, batch_size)
    except BaseException:  # stopped: leave no empty folder
        remove_if_empty(output_dir)
        raise
    # From the end of training, a signal waits until the run is written: no trained run is lost.
    with written_whole():
        summary = summarize(config, env, out["q_values"], timings)
        seeds, seed_0 = plural(config.num_seeds, "seed"), summary["seeds"][0]
        print(
            f"compile {timings['compile_time_s']:.2f} s, train {timings['train_time_s']:.3f} s, "
            f"{summary['agent_steps_per_s'] / 1e6:.1f}M agent-steps/s"
        )
        print(
            f"greedy path from S is a shortest path ({seed_0['shortest_path_length']} steps) for "
            f"{summary['optimal_seeds']} of {seeds}; V(S) = {seed_0['v_start']:.4f} vs "
            f"V*(S) = {seed_0['v_star_start']:.4f} (seed 0)"
        )
        summary["wall_time_s"] = time.perf_counter() - start  # the whole command, but the writes
        with replacing(output_dir):  # the run --overwrite replaces stays till now
            save_run(output_dir, summary, out)
            figure_path = plot_run(output_dir)
        print(f"wrote {', '.join(RUN_FILES)} and {figure_path.name} to {output_dir}/; "
              f"wall {summary['wall_time_s']:.1f} s")  # fmt: skip


class BestEffortStream:
    """stdout or stderr, written while it can be (not after `| head -1`, `> /dev/full`, a closed
    terminal): then its lines go to /dev/null and the run goes on, to be saved whole."""

    def __init__(self, stream):
        if hasattr(stream, "reconfigure"):  # a folder name whose bytes its encoding cannot show
            stream.reconfigure(errors="backslashreplace")  # (stdout's default there: an error)
        self.stream = stream

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        return self.best_effort(self.stream.write, text) or len(text)

    def flush(self) -> None:
        self.best_effort(self.stream.flush)

    def best_effort(self, method, *args):
        try:
            return method(*args)
        except OSError as error:  # from now on, /dev/null
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
            if self is sys.stdout and not isinstance(error, BrokenPipeError):  # not | head -1
                why = f"stdout cannot be written ({error.strerror}); the run goes on, to its files"
                print(f"q_learning_gridworld.py: {why}", file=sys.stderr)


class Stopped(BaseException):
    """SIGTERM or SIGHUP (args[0]), raised as Ctrl-C raises KeyboardInterrupt; a BaseException
    as that is, so that an `except Exception` (JAX has some) does not swallow it."""


def stop(signum, frame):
    RECEIVED.append(signum)  # its exception may yet be dropped: stop_if_received
    # A second SIGTERM or SIGHUP (a hang-up sends two) must not cut the cleanup short.
    for other in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(other, ignore)
    raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)


def stop_if_received() -> None:
    """Raises again the first signal stop() took: C code that clears errors (JAX's first import
    of its MLIR dialects) may have dropped its exception. written_whole checks after training."""
    if RECEIVED:
        stop(RECEIVED[0], None)


def ignore(signum, frame):
    """A handler that does nothing. Not SIG_IGN: set while a signal is pending (SIGTERM and
    SIGHUP at once), Python would raise OSError('Signal 15 ignored due to race condition')."""


def send_again(unraisable) -> None:
    """sys.unraisablehook: Python drops an exception raised in a garbage-collector callback (JAX
    has one), a __del__ or a weakref callback, so a signal whose handler ran there would be lost.
    Such a signal is sent again 10 ms later, from a timer, to whatever handles it then."""
    error = unraisable.exc_value
    if not isinstance(error, KeyboardInterrupt | Stopped):
        return sys.__unraisablehook__(unraisable)
    signum = error.args[0] if isinstance(error, Stopped) else signal.SIGINT
    if signal.getsignal(signum) is ignore:  # stop() ignores it from its first call
        signal.signal(signum, stop)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signum))
    signal.setitimer(signal.ITIMER_REAL, 0.01)


if __name__ == "__main__":
    sys.unraisablehook = send_again  # before any handler that raises
    for signum in catchable():  # nohup's SIGHUP stays ignored
        signal.signal(signum, stop)
    # Figures go to files, with Agg: a notebook's `!python` passes on its own MPLBACKEND, which
    # may not load here (matplotlib would not even import). Set here, not for an importer.
    os.environ["MPLBACKEND"] = "Agg"
    # None: a stream closed before the start (`>&-`)
    sys.stdout = BestEffortStream(sys.stdout or open(os.devnull, "w"))  # noqa: SIM115
    sys.stderr = BestEffortStream(sys.stderr or open(os.devnull, "w"))  # noqa: SIM115
    try:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # any that came as JAX loaded
            main()
        finally:  # one that comes from now on waits for the defaults below
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    except (KeyboardInterrupt, Stopped) as interrupt:
        for signum in SIGNALS:  # a second signal (a process group's, say) must not cut this line
            signal.signal(signum, ignore)
        signum = interrupt.args[0] if isinstance(interrupt, Stopped) else signal.SIGINT
        message = f"stopped by {SIGNALS[signum]}, unfinished; no file half-written"
        print(f"q_learning_gridworld.py: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signum)  # now: not after the compiled call still running in the background
    finally:  # the run has ended: in JAX's clean-up at exit, a signal has its default effect
        signal.setitimer(signal.ITIMER_REAL, 0)  # (it raised there, and was sent again: SIGALRM)
        for signum in catchable():
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
