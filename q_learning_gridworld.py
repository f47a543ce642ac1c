"""Tabular Q-learning on a GridWorld, fully jitted: one agent or thousands of seeds at once.

The whole experiment is one pure function, `train(rng)`, built by `make_train(config)`:
run it as `jax.jit(train)(key)` for one agent or `jax.jit(jax.vmap(train))(keys)` for many.
The file reads top to bottom: config, environment, agent, train, reporting, command line.

    python q_learning_gridworld.py                       # one agent on the default map
    python q_learning_gridworld.py --num-seeds 64 --layout maze
    python q_learning_gridworld.py --layout my_map.txt   # '.' free, '#' wall, 'S', 'G'

Why it is fast: the environment is a lookup table (next_cell[cell, action]), the whole
training loop is a `lax.scan` compiled by XLA, and the random numbers for a block of steps
are drawn in one call (one 32-bit word per step) instead of splitting a key every step.
"""

import os

# Show every CPU core to JAX as its own device, so that `--num-seeds N` spreads the seeds over
# all cores. Only when the user has not set XLA_FLAGS, and before jax is imported; it shapes
# the CPU platform only, so a GPU run is unaffected.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={os.cpu_count() or 1}"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import deque  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# ------------------------------------------------------------------------------------------
# CONFIG
# ------------------------------------------------------------------------------------------

# Built-in maps: '.' free, '#' wall, 'S' start, 'G' goal. "default" is the reference
# article's open 8x12 grid (shortest path 18 steps); "maze" (22 steps) and "four_rooms"
# (20 steps) have walls and were not used to choose the hyperparameters below.
LAYOUTS = {
    "default": """
G...........
............
............
............
............
............
............
...........S
""",
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


def _field(default, help_text: str):
    """A Config field whose help text becomes its --flag's help in the command line."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class Config:
    layout: str = _field(
        LAYOUTS["default"], "the map: a built-in name (default, maze, four_rooms) or a file path"
    )
    total_timesteps: int = _field(1_000_000, "environment steps per agent (seed)")
    learning_rate: float = _field(0.1, "step size of the Q-learning update, in (0, 1]")
    gamma: float = _field(0.9, "discount factor, in [0, 1)")
    epsilon: float = _field(0.1, "probability of a uniformly random action, in [0, 1]")
    # Optimistic start (Sutton & Barto 2.6): no state is worth more than 1.0, so every untried
    # action looks best until tried. From 0.0, epsilon-greedy could settle on a detour when
    # the shortest route needs several exploratory steps in a row (seen on random mazes).
    initial_q: float = _field(
        1.0, "initial Q-values; 1.0, the most any state is worth, is optimistic"
    )
    num_seeds: int = _field(1, "independent agents trained at once, sharded over all devices")
    seed: int = _field(0, "base random seed; agent i uses fold_in(key(seed), i)")
    output_dir: str = _field("runs/q_learning_gridworld", "where summary.json and figures go")
    max_episode_steps: int = _field(
        0, "time limit: truncate an episode after this many steps (0: none)"
    )
    # Large on purpose: on CPU one call to jax.random.bits costs ~80 us however few words it
    # draws (threefry, measured with jax 0.10.2), i.e. 40 ns per step at 2,000 steps a block
    # but 5 ns at 100,000. The draws take 4 bytes per step per seed while a block runs.
    steps_per_block: int = _field(
        100_000, "steps whose random numbers are drawn in one call; divides total-timesteps"
    )
    num_curve_points: int = _field(200, "points on the learning curve, whatever the run length")
    num_recorded_episodes: int = _field(500, "the first episodes whose lengths are recorded")

    def __post_init__(self):
        # Checked here, not only in the command line, so make_train never sees a bad config.
        parse_layout(self.layout)  # raises ValueError with a one-line reason
        counts = ("total_timesteps", "num_seeds", "steps_per_block", "num_curve_points")
        for name in (*counts, "num_recorded_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be at least 1 (got {getattr(self, name)})")
        if self.max_episode_steps < 0:
            raise ValueError(f"--max-episode-steps must be >= 0 (got {self.max_episode_steps})")
        if self.total_timesteps % self.steps_per_block:
            raise ValueError(
                f"--total-timesteps ({self.total_timesteps}) must be a multiple of "
                f"--steps-per-block ({self.steps_per_block})"
            )
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"--epsilon must be in [0, 1] (got {self.epsilon})")
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"--gamma must be in [0, 1) (got {self.gamma})")
        if not np.isfinite(self.initial_q):
            raise ValueError(f"--initial-q must be a finite number (got {self.initial_q})")
        if not 0.0 < self.learning_rate <= 1.0:
            raise ValueError(f"--learning-rate must be in (0, 1] (got {self.learning_rate})")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------------------------
# ENVIRONMENT
# ------------------------------------------------------------------------------------------

NUM_ACTIONS = 4
# (row, col) step of each action: 0 right, 1 down, 2 left, 3 up.
MOVES = np.array([[0, 1], [1, 0], [0, -1], [-1, 0]])
MAP_CHARS = ".#SG"


def parse_layout(text: str) -> np.ndarray:
    """Map text -> [rows, cols] array of characters. Raises ValueError with a one-line reason."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise ValueError("--layout: the map is empty")
    for row, line in enumerate(lines):
        if len(line) != len(lines[0]):
            raise ValueError(
                f"--layout: row {row} has {len(line)} characters, row 0 has {len(lines[0])}"
            )
        for col, char in enumerate(line):
            if char not in MAP_CHARS:
                raise ValueError(
                    f"--layout: unknown character {char!r} at row {row} col {col} (use . # S G)"
                )
    grid = np.array([list(line) for line in lines])
    for char, name in (("S", "start"), ("G", "goal")):
        count = int((grid == char).sum())
        if count != 1:
            raise ValueError(f"--layout: the map needs exactly one {char} ({name}), found {count}")
    if shortest_path_length(grid) is None:
        raise ValueError("--layout: G cannot be reached from S")
    return grid


def transition_table(grid: np.ndarray) -> np.ndarray:
    """next_cell[cell, action] (int32 [rows*cols, 4]) for flat cells row*cols+col.

    Moving off the grid or into a wall leaves the agent in place. Wall cells are never
    occupied; they map to themselves so that value iteration leaves them at 0.
    """
    rows, cols = grid.shape
    next_cell = np.zeros((rows * cols, NUM_ACTIONS), np.int32)
    for row in range(rows):
        for col in range(cols):
            for action, (d_row, d_col) in enumerate(MOVES):
                r, c = row + d_row, col + d_col
                blocked = not (0 <= r < rows and 0 <= c < cols) or grid[r, c] == "#"
                if blocked or grid[row, col] == "#":
                    r, c = row, col
                next_cell[row * cols + col, action] = r * cols + c
    return next_cell


def shortest_path_length(grid: np.ndarray) -> int | None:
    """Fewest steps from S to G (breadth-first search), or None when G is unreachable."""
    next_cell = transition_table(grid)
    start, goal = (int(np.flatnonzero(grid.ravel() == char)[0]) for char in "SG")
    distance = {start: 0}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            return distance[cell]
        for neighbour in next_cell[cell]:
            if int(neighbour) not in distance:
                distance[int(neighbour)] = distance[cell] + 1
                queue.append(int(neighbour))
    return None


class EnvState(NamedTuple):
    cell: jax.Array  # int32 flat cell index row*cols+col
    time: jax.Array  # int32 steps taken since the last reset


class GridWorld:
    """Deterministic GridWorld with the gymnax 1.0 API (reset/step with auto-reset).

    Observation = the flat cell index. Reward +1.0 on the step that enters G, else 0;
    entering G terminates. With max_episode_steps > 0 an episode is truncated after that
    many steps (a time limit, not a terminal state: the agent still bootstraps from it).
    """

    def __init__(self, layout: str, max_episode_steps: int = 0):
        self.grid = parse_layout(layout)  # [rows, cols] characters
        self.rows, self.cols = self.grid.shape
        self.num_cells = self.rows * self.cols
        flat = self.grid.ravel()
        self.start = int(np.flatnonzero(flat == "S")[0])
        self.goal = int(np.flatnonzero(flat == "G")[0])
        self.walls = self.grid == "#"  # [rows, cols] bool
        self.next_cell = transition_table(self.grid)  # [num_cells, 4] int32, numpy
        self.max_episode_steps = max_episode_steps

    def reset(self, key: jax.Array) -> tuple[jax.Array, EnvState]:
        del key  # every episode starts at S
        state = EnvState(cell=jnp.int32(self.start), time=jnp.int32(0))
        return state.cell, state

    def step(self, key: jax.Array, state: EnvState, action: jax.Array):
        """-> (obs, state, reward, terminated, truncated, info); resets to S when done.

        info["final_observation"] is the cell the action really led to, before the reset.
        """
        next_cell = jnp.asarray(self.next_cell)[state.cell, action]
        time = state.time + 1
        terminated = next_cell == self.goal
        if self.max_episode_steps:  # Python-level: no time-limit code when there is no limit
            truncated = (time >= self.max_episode_steps) & ~terminated
        else:
            truncated = jnp.bool_(False)
        reward = terminated.astype(jnp.float32)
        done = terminated | truncated
        _, reset_state = self.reset(key)
        state = EnvState(
            cell=jnp.where(done, reset_state.cell, next_cell),
            time=jnp.where(done, reset_state.time, time),
        )
        info = {"final_observation": next_cell}
        return state.cell, state, reward, terminated, truncated, info


# ------------------------------------------------------------------------------------------
# AGENT
# ------------------------------------------------------------------------------------------

# Each step uses one random 32-bit word, split into two 16-bit fields: the low half decides
# explore vs exploit, the high half picks the action. One word per step instead of several
# floats matters: random number generation is the largest cost left in the loop.
RANDOM_FIELD_BITS = 16
RANDOM_FIELD_MASK = (1 << RANDOM_FIELD_BITS) - 1


def explore_threshold(epsilon: float) -> int:
    """Explore when the 16-bit field is below this: epsilon rounded to a multiple of 2^-16."""
    return round(epsilon * (1 << RANDOM_FIELD_BITS))


def epsilon_greedy(q_s: jax.Array, bits: jax.Array, threshold: int) -> jax.Array:
    """Action for Q-values q_s [4] from one random uint32 `bits`.

    With probability epsilon pick uniformly among all actions, otherwise uniformly among
    the actions of maximal Q-value: the same distribution as distrax.EpsilonGreedy.
    Uniform tie-breaks matter at the start, when all Q-values are 0: always taking the
    first maximum would make the untrained agent walk right forever.
    """
    explore = (bits & RANDOM_FIELD_MASK) < threshold
    candidates = explore | (q_s == q_s.max())  # [4] bool: the actions to choose among
    # The j-th candidate with j = floor(u * count), u the high 16 bits as a fraction in [0, 1).
    j = ((bits >> RANDOM_FIELD_BITS) * candidates.sum()) >> RANDOM_FIELD_BITS
    rank = jnp.cumsum(candidates) - 1  # [4] rank of each candidate among the candidates
    return jnp.argmax(candidates & (rank == j)).astype(jnp.int32)


def q_learning_update(
    q: jax.Array,
    obs: jax.Array,
    action: jax.Array,
    reward: jax.Array,
    terminated: jax.Array,
    next_obs: jax.Array,
    learning_rate: float,
    gamma: float,
) -> jax.Array:
    """q[obs, action] += lr * (reward + gamma * max_a' q[next_obs, a'] - q[obs, action]).

    next_obs must be the cell the action led to (info["final_observation"]), never the
    auto-reset cell S. A terminal step has no future, so it does not bootstrap; a
    truncated one (time limit) does.
    """
    bootstrap = jnp.where(terminated, 0.0, q[next_obs].max())
    target = reward + gamma * bootstrap
    new_value = q[obs, action] + learning_rate * (target - q[obs, action])
    # .set of a value computed here rather than .at[...].add(step): XLA may fuse a multiply
    # and an add into one FMA (one rounding instead of two), which it can do here with or
    # without vmap but not inside a vmapped scatter-add. So vmap(train) matches train bit for
    # bit; a last-bit difference would flip a later tie-break and change the whole run.
    return q.at[obs, action].set(new_value)


# ------------------------------------------------------------------------------------------
# TRAIN
# ------------------------------------------------------------------------------------------


class EpisodeStats(NamedTuple):
    """Totals over the episodes that ended in some stretch of training."""

    episodes: jax.Array  # int32 episodes that ended (terminated or truncated)
    length_sum: jax.Array  # int32 sum of their lengths
    return_sum: jax.Array  # float32 sum of their (undiscounted) returns


class Runner(NamedTuple):
    """Carry of the per-step scan: kept small, it is read and written every step."""

    q: jax.Array  # [num_cells, 4] float32 Q-table
    env_state: EnvState
    obs: jax.Array  # int32 cell index the agent sees
    episodes: jax.Array  # int32 episodes ended so far
    reward_sum: jax.Array  # float32 rewards collected in the current block
    # [num_recorded_episodes] int32 length of episode i, for the first episodes (0: not ended)
    episode_lengths: jax.Array


class TrainState(NamedTuple):
    """Carry of the per-block scan."""

    runner: Runner
    curve: EpisodeStats  # [num_points] each: the learning curve being filled in
    block: jax.Array  # int32 index of the next block
    rng: jax.Array


def make_train(config: Config):
    env = GridWorld(config.layout, config.max_episode_steps)
    num_blocks = config.total_timesteps // config.steps_per_block
    # Derived constants. The curve has a fixed number of points (fewer only when there are
    # fewer blocks), so the memory for metrics does not grow with total_timesteps.
    num_points = min(config.num_curve_points, num_blocks)
    point_of_block = np.arange(num_blocks) * num_points // num_blocks  # [num_blocks]
    curve_timesteps = (np.searchsorted(point_of_block, np.arange(num_points), "right")) * (
        config.steps_per_block
    )  # [num_points] environment steps done when each point is complete
    threshold = explore_threshold(config.epsilon)

    def agent_env_step(runner: Runner, bits: jax.Array) -> tuple[Runner, None]:
        """One agent step and one environment step; `bits` is this step's random uint32."""
        action = epsilon_greedy(runner.q[runner.obs], bits, threshold)
        # key=None: GridWorld is deterministic and never reads its key (an environment with
        # random transitions would take its randomness from `bits` too, drawn per block).
        obs, env_state, reward, terminated, truncated, info = env.step(
            None, runner.env_state, action
        )
        q = q_learning_update(
            runner.q,
            runner.obs,
            action,
            reward,
            terminated,
            info["final_observation"],
            config.learning_rate,
            config.gamma,
        )
        done = terminated | truncated
        # Record the length of an episode that ends, while fewer than num_recorded_episodes
        # have: an index past the end of the array is dropped, which costs less than a cond.
        record_at = jnp.where(done, runner.episodes, config.num_recorded_episodes)
        runner = Runner(
            q=q,
            env_state=env_state,
            obs=obs,
            episodes=runner.episodes + done,
            reward_sum=runner.reward_sum + reward,
            episode_lengths=runner.episode_lengths.at[record_at].set(
                runner.env_state.time + 1, mode="drop"
            ),
        )
        return runner, None

    def run_block(state: TrainState, _) -> tuple[TrainState, None]:
        """config.steps_per_block steps, with all their randomness drawn in one call."""
        rng, block_rng = jax.random.split(state.rng)
        bits = jax.random.bits(block_rng, (config.steps_per_block,), jnp.uint32)  # [steps]
        before = state.runner._replace(reward_sum=jnp.float32(0.0))
        # unroll=1 on purpose: unrolling this scan made it ~7x slower on CPU (measured).
        after, _ = jax.lax.scan(agent_env_step, before, bits)
        # Episode lengths cost nothing per step: the block's steps are the steps of the
        # episodes that ended in it, plus those the running episode has at the end, minus
        # those it already had at the start. Returns likewise, and simpler here: GridWorld
        # pays its only reward on the step that ends an episode, so the rewards of a block
        # are exactly the returns of the episodes that ended in it.
        stats = EpisodeStats(
            episodes=after.episodes - before.episodes,
            length_sum=config.steps_per_block + before.env_state.time - after.env_state.time,
            return_sum=after.reward_sum,
        )
        point = state.block * num_points // num_blocks  # same mapping as point_of_block
        curve = jax.tree.map(lambda c, s: c.at[point].add(s), state.curve, stats)
        return TrainState(runner=after, curve=curve, block=state.block + 1, rng=rng), None

    def train(rng: jax.Array) -> dict:
        obs, env_state = env.reset(None)  # key=None: every episode starts at S
        runner = Runner(
            q=jnp.full((env.num_cells, NUM_ACTIONS), config.initial_q, jnp.float32),
            env_state=env_state,
            obs=obs,
            episodes=jnp.int32(0),
            reward_sum=jnp.float32(0.0),
            episode_lengths=jnp.zeros(config.num_recorded_episodes, jnp.int32),
        )
        curve = EpisodeStats(
            episodes=jnp.zeros(num_points, jnp.int32),
            length_sum=jnp.zeros(num_points, jnp.int32),
            return_sum=jnp.zeros(num_points, jnp.float32),
        )
        state = TrainState(runner=runner, curve=curve, block=jnp.int32(0), rng=rng)
        state, _ = jax.lax.scan(run_block, state, None, length=num_blocks)
        curve = state.curve
        episodes = jnp.maximum(curve.episodes, 1)  # no 0/0: the mean is NaN where none ended
        return {
            "q_values": state.runner.q.reshape(env.rows, env.cols, NUM_ACTIONS),
            "metrics": {
                # [num_recorded_episodes] lengths of the first episodes, 0 where not ended
                "episode_length": state.runner.episode_lengths,
                # Per stretch of training (the curve points), whatever the run length:
                "timestep": jnp.asarray(curve_timesteps, jnp.int32),  # [num_points]
                "episodes": curve.episodes,  # [num_points] episodes ended in each stretch
                "mean_episode_length": jnp.where(
                    curve.episodes > 0, curve.length_sum / episodes, jnp.nan
                ),
                "mean_return": jnp.where(curve.episodes > 0, curve.return_sum / episodes, jnp.nan),
            },
        }

    return train


# ------------------------------------------------------------------------------------------
# REPORTING (numpy and matplotlib, outside jit)
# ------------------------------------------------------------------------------------------

ARROWS = {0: (1, 0), 1: (0, -1), 2: (-1, 0), 3: (0, 1)}  # action -> (dx, dy), y pointing up


def value_iteration(env: GridWorld, gamma: float, tolerance: float = 1e-12) -> np.ndarray:
    """Exact Q* [num_cells, 4] of the same MDP: the yardstick for the learned Q-values."""
    reward = (env.next_cell == env.goal).astype(np.float64)  # [num_cells, 4]
    q = np.zeros(env.next_cell.shape)
    while True:
        v = q.max(axis=1)
        v[env.goal] = 0.0  # G is terminal: nothing follows it
        new_q = reward + gamma * v[env.next_cell]
        if np.abs(new_q - q).max() < tolerance:
            return new_q
        q = new_q


def greedy_path(env: GridWorld, q: np.ndarray) -> list[int] | None:
    """Cells visited following argmax Q from S (first maximum on ties), or None when the
    walk does not reach G within num_cells steps (a loop or a dead end)."""
    cells = [env.start]
    for _ in range(env.num_cells):
        cells.append(int(env.next_cell[cells[-1], int(np.argmax(q[cells[-1]]))]))
        if cells[-1] == env.goal:
            return cells
    return None


def summarize_seeds(env: GridWorld, config: Config, q_values: np.ndarray) -> list[dict]:
    """Per seed: greedy path length from S vs the shortest, V(S) vs V*(S)."""
    q_star = value_iteration(env, config.gamma)
    shortest = shortest_path_length(env.grid)
    rows = []
    for seed_index, q in enumerate(q_values.reshape(len(q_values), env.num_cells, NUM_ACTIONS)):
        path = greedy_path(env, q)
        v_start, v_star_start = float(q[env.start].max()), float(q_star[env.start].max())
        rows.append(
            {
                "seed_index": seed_index,
                "greedy_path_length": None if path is None else len(path) - 1,
                "shortest_path_length": shortest,
                "v_start": v_start,
                "v_star_start": v_star_start,
                "v_start_relative_error": abs(v_start - v_star_start) / v_star_start,
            }
        )
    return rows


def plot(env: GridWorld, q: np.ndarray, metrics: dict, path: Path) -> None:
    """Max-Q heatmap of seed 0 with its greedy actions, then two learning curves."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_map, ax_episodes, ax_steps) = plt.subplots(
        1, 3, figsize=(18, 5), gridspec_kw={"width_ratios": [1.2, 1, 1]}
    )
    q = q.reshape(env.rows, env.cols, NUM_ACTIONS)
    value = np.ma.masked_array(q.max(axis=-1), mask=env.walls)
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("black")  # walls
    image = ax_map.imshow(value, cmap=cmap)
    fig.colorbar(image, ax=ax_map, label="max_a Q(s, a)", shrink=0.8)
    on_path = set(greedy_path(env, q.reshape(-1, NUM_ACTIONS)) or [])
    for row in range(env.rows):
        for col in range(env.cols):
            cell = row * env.cols + col
            if env.walls[row, col] or cell == env.goal:
                continue
            dx, dy = ARROWS[int(np.argmax(q[row, col]))]
            ax_map.arrow(
                col - 0.25 * dx, row + 0.25 * dy, 0.45 * dx, -0.45 * dy, head_width=0.18,
                length_includes_head=True, color="red" if cell in on_path else "white",
            )  # fmt: skip
    for char in "SG":
        row, col = np.argwhere(env.grid == char)[0]
        ax_map.text(
            col, row, char, ha="center", va="center", fontsize=12, weight="bold",
            bbox={"facecolor": "white", "alpha": 0.8},
        )  # fmt: skip
    ax_map.set_title("seed 0: max-Q, greedy action (red: path from S)")
    ax_map.set_xticks([])
    ax_map.set_yticks([])

    shortest = shortest_path_length(env.grid)
    num_seeds = len(metrics["episode_length"])
    curves = (
        # (axis, x, y [seeds, points], x label)
        (ax_episodes, None, np.where(metrics["episode_length"] > 0, metrics["episode_length"],
                                     np.nan), "episode"),
        (ax_steps, metrics["timestep"][0], metrics["mean_episode_length"],
         "environment steps"),
    )  # fmt: skip
    for ax, x, y, x_label in curves:
        x = np.arange(1, y.shape[1] + 1) if x is None else x
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: nothing ended
            marker = "o" if len(x) <= 50 else None  # show where the few points are
            ax.plot(x, np.nanmean(y, axis=0), marker=marker, label=f"mean over {num_seeds} seed(s)")
            ax.fill_between(
                x, np.nanmin(y, axis=0), np.nanmax(y, axis=0), alpha=0.3, label="min to max"
            )
        ax.axhline(shortest, color="black", ls="--", label=f"shortest path ({shortest})")
        ax.set_yscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel("episode length (steps)")
        ax.legend()
    ax_episodes.set_title(f"the first {metrics['episode_length'].shape[1]} episodes")
    ax_steps.set_title("the whole run (mean of the episodes ended in each stretch)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "numpy", "matplotlib", "flax"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None  # not needed by this script; reported when installed
    return found


# ------------------------------------------------------------------------------------------
# COMMAND LINE
# ------------------------------------------------------------------------------------------


def make_seed_keys(seed: int, num_keys: int) -> jax.Array:
    """Key i = fold_in(key(seed), i): seed i's run does not depend on how many seeds run."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(num_keys))


# How one device runs its share of the seeds. vmap gives the table lookups and the Q-update
# a batch dimension, and on CPU those batched gathers/scatters cost about 1 us per step
# whatever the batch: measured (jax 0.10.2), vmap over 2 seeds ran 2M agent-steps/s, over 8
# 7M, over 32 17M, over 256 40M, while one seed after another runs ~16M. So on CPU a device
# runs its seeds one after another below this many, vmapped from it; a GPU always vmaps.
CPU_MIN_SEEDS_TO_VMAP = 32


def train_seeds(config: Config) -> tuple[dict, dict]:
    """Train config.num_seeds agents sharded over the devices -> (numpy outputs, timings)."""
    # A 1-D mesh over the devices; the seed axis is split across it. With fewer seeds than
    # devices only num_seeds devices are used; otherwise the seeds are padded up to a
    # multiple of the device count and the padding is dropped after training.
    devices = jax.devices()[: config.num_seeds]
    num_keys = -(-config.num_seeds // len(devices)) * len(devices)
    seeds_per_device = num_keys // len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("seeds",))
    seed_spec = jax.sharding.PartitionSpec("seeds")
    seed_sharding = jax.sharding.NamedSharding(mesh, seed_spec)
    # Keys are created inside jit with the seed sharding, so each device makes its own.
    keys = jax.jit(make_seed_keys, static_argnums=(0, 1), out_shardings=seed_sharding)(
        config.seed, num_keys
    )
    vmap_all = jax.default_backend() != "cpu" or seeds_per_device >= CPU_MIN_SEEDS_TO_VMAP
    train = make_train(config)

    def train_device_seeds(device_keys: jax.Array) -> dict:  # [seeds_per_device] keys
        # lax.map with batch_size = all: one vmap; batch_size = 1: one seed after another.
        return jax.lax.map(train, device_keys, batch_size=seeds_per_device if vmap_all else 1)

    # check_vma=False: train builds its initial carry from constants (zeros, S), which
    # shard_map's type check would want marked as varying per device; every value here is
    # per device anyway, since nothing is communicated between devices.
    train_all = jax.jit(
        jax.shard_map(
            train_device_seeds,
            mesh=mesh,
            in_specs=seed_spec,
            out_specs=seed_spec,
            check_vma=False,
        )
    )

    start = time.perf_counter()
    compiled = train_all.lower(keys).compile()
    compile_time = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    wall_time = time.perf_counter() - start
    out = jax.tree.map(lambda x: np.asarray(x)[: config.num_seeds], out)  # drop the padding
    timings = {
        "compile_time_s": compile_time,
        "wall_time_s": wall_time,  # the training call alone, compile excluded
        "agent_steps_per_s": config.num_seeds * config.total_timesteps / wall_time,
        "devices": [str(d) for d in devices],
        "padded_num_seeds": num_keys,
        "seeds_per_device_vmapped": vmap_all,
    }
    return out, timings


# Refuse, before compiling, a run whose arrays cannot fit: keep half the memory for XLA's
# own buffers and everything else on the machine.
MEMORY_FRACTION = 0.5


def bytes_needed(config: Config) -> int:
    """Rough device memory of a run: per seed, the Q-table (carry, loop double buffer and
    output), one block of random words and the metrics."""
    num_cells = parse_layout(config.layout).size
    per_seed = 4 * (
        3 * num_cells * NUM_ACTIONS
        + config.steps_per_block
        + config.num_recorded_episodes
        + 4 * config.num_curve_points
    )
    return config.num_seeds * per_seed


def bytes_available() -> int:
    """Memory of all devices: GPU/TPU memory where reported, else the machine's RAM."""
    stats = [device.memory_stats() or {} for device in jax.devices()]
    if jax.default_backend() != "cpu" and all("bytes_limit" in s for s in stats):
        return sum(s["bytes_limit"] for s in stats)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error (two lines); we want one line and exit code 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def read_layout(value: str) -> str:
    """--layout value -> map text: a built-in name, or else a path to a text file."""
    if value in LAYOUTS:
        return LAYOUTS[value]
    try:
        return Path(value).read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a built-in layout ({', '.join(LAYOUTS)}) "
            f"nor a readable file ({reason})"
        ) from None


def parse_config(argv: list[str] | None = None) -> Config:
    parser = OneLineParser(
        prog="q_learning_gridworld.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for field in dataclasses.fields(Config):
        default = "default" if field.name == "layout" else field.default
        convert = read_layout if field.name == "layout" else field.type
        parser.add_argument(
            _flag(field.name), type=convert, default=default, help=field.metadata["help"]
        )
    args = parser.parse_args(argv)
    if isinstance(args.layout, str) and args.layout == "default":
        args.layout = LAYOUTS["default"]  # argparse does not convert the default
    try:
        config = Config(**vars(args))
    except ValueError as error:
        parser.error(str(error))
    output_dir = Path(config.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        parser.error(f"--output-dir {config.output_dir!r} exists and is not a directory")
    needed, limit = bytes_needed(config), MEMORY_FRACTION * bytes_available()
    if needed > limit:
        parser.error(
            f"--num-seeds {config.num_seeds} needs about {needed / 1e9:.1f} GB, more than "
            f"{limit / 1e9:.1f} GB ({MEMORY_FRACTION:.0%} of the devices' memory); use fewer seeds"
        )
    return config


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    env = GridWorld(config.layout, config.max_episode_steps)
    out, timings = train_seeds(config)
    seeds = summarize_seeds(env, config, out["q_values"])
    optimal = sum(s["greedy_path_length"] == s["shortest_path_length"] for s in seeds)
    print(
        f"compile {timings['compile_time_s']:.2f} s, wall {timings['wall_time_s']:.3f} s, "
        f"{timings['agent_steps_per_s'] / 1e6:.1f}M agent-steps/s "
        f"({config.num_seeds} seeds x {config.total_timesteps} steps on "
        f"{len(timings['devices'])} {jax.default_backend()} device(s))"
    )
    print(
        f"greedy path from S is a shortest path ({seeds[0]['shortest_path_length']} steps) "
        f"for {optimal}/{config.num_seeds} seeds; V(S) = {seeds[0]['v_start']:.4f} vs "
        f"V*(S) = {seeds[0]['v_star_start']:.4f} (seed 0)"
    )

    output_dir = Path(config.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"q_learning_gridworld.py: error: --output-dir: {error}", file=sys.stderr)
        sys.exit(1)
    summary = {
        "config": dataclasses.asdict(config),
        "versions": versions(),
        **timings,
        "optimal_seeds": optimal,
        "seeds": seeds,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(env, out["q_values"][0], out["metrics"], output_dir / "q_learning_gridworld.png")
    print(f"wrote {output_dir / 'summary.json'} and {output_dir / 'q_learning_gridworld.png'}")


if __name__ == "__main__":
    main()
