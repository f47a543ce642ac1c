"""Thousands of tabular Q-learning agents, and whole hyperparameter sweeps, in one compiled call.

The GridWorld and Q-learning are the textbook ones (same map format and dynamics as
q_learning_gridworld.py, but this file imports nothing from it). What is new is the shape of
the experiment: `make_train(config)` returns a pure function `train(rng, hparams)`, so

    jax.vmap(train, in_axes=(0, None))                   # many seeds of one setting
    jax.vmap(jax.vmap(train, in_axes=(0, None)),
             in_axes=(None, 0))                          # seeds x a whole hyperparameter grid

are single XLA programs. main() runs the same computation laid out for speed
(make_device_sweep): seeds sharded over every device, and on a CPU each device trains its
agents in chunks whose Q-tables fit in its cache. Each grid point is checked against exact
value iteration in summary.json.

    python parallel_q_learning.py --num-seeds 256 --learning-rates 0.05,0.1,0.5 \
        --epsilons 0.05,0.1,0.3                          # 256 x 9 agents
    python parallel_q_learning.py --benchmark            # + the speed story, measured here

`--benchmark` measures agent-steps/s of a plain Python/NumPy loop, one jitted agent, and
N = 1, 4, 16, ... vmapped agents on one device and on all devices, and runs the articles'
style of code (../shared/baselines/seed_style_q_learning.py) side by side for a ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

# A CPU is one XLA device by default, and one device runs one thread of this program: showing
# the CPU as one device per core lets the seed axis be sharded over every core (measured on 2
# cores: 2.2x the agent-steps/s of one device). It only shapes the CPU platform, so a GPU run
# is unaffected; a user who sets XLA_FLAGS keeps theirs.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={os.cpu_count()}")

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

matplotlib.use("Agg")  # figures go to files; no display needed
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

# ---------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (--total-timesteps for total_timesteps, ...)
# ---------------------------------------------------------------------------------------------


def flag(default, help: str):
    """A config field with its --help text next to it."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Config:
    layout: str = flag("default", "built-in layout (default, maze, four_rooms) or a map file")
    total_timesteps: int = flag(100_000, "environment steps per agent")
    num_seeds: int = flag(64, "independent agents per hyperparameter setting")
    seed: int = flag(0, "seed i trains with fold_in(key(seed), i), at every grid point")
    learning_rates: tuple[float, ...] = flag((0.05, 0.1, 0.5), "comma-separated, each > 0")
    epsilons: tuple[float, ...] = flag((0.05, 0.1, 0.3), "comma-separated, each in [0, 1]")
    gammas: tuple[float, ...] = flag((0.9,), "comma-separated, each in [0, 1)")
    max_episode_steps: int = flag(0, "time limit (truncation, still bootstraps); 0 = none")
    num_curve_points: int = flag(50, "points per learning curve (memory does not grow with steps)")
    rng_block_steps: int = flag(100, "steps whose random bits are drawn at once (measured best)")
    agents_per_chunk: int = flag(0, "agents trained together per device; 0: cache-sized on CPU")
    output_dir: str = flag("runs/parallel_q_learning", "where summary.json and figures go")
    benchmark: bool = flag(False, "also measure agent-steps/s vs number of agents")
    benchmark_max_agents: int = flag(16384, "largest N in the benchmark (N = 1, 4, 16, ...)")
    benchmark_seconds: float = flag(0.5, "target run time of one benchmark measurement")
    benchmark_repeats: int = flag(3, "repetitions per benchmark point (the median is kept)")
    yardstick: str = flag(
        "../shared/baselines/seed_style_q_learning.py",
        "articles-style script run by --benchmark, relative to this file; '' to skip",
    )


class ConfigError(ValueError):
    """A bad flag value: main() prints it as one line and exits 2."""

    def __init__(self, flag_name: str, message: str):
        super().__init__(f"--{flag_name.replace('_', '-')}: {message}")


class HParams(NamedTuple):
    """Hyperparameters as data: scalars for one agent, arrays [grid] for a sweep."""

    learning_rate: jax.Array | float
    epsilon: jax.Array | float
    gamma: jax.Array | float


# ---------------------------------------------------------------------------------------------
# Environment: GridWorld ('.' free, '#' wall, 'S' start, 'G' goal), gymnax-1.0-shaped API
# ---------------------------------------------------------------------------------------------

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

NUM_ACTIONS = 4
MOVES = ((0, 1), (1, 0), (0, -1), (-1, 0))  # (d_row, d_col) of 0 right, 1 down, 2 left, 3 up


class LayoutError(ValueError):
    """A map that cannot be played (message says what and where)."""


class EnvState(NamedTuple):
    cell: jax.Array  # flat index row * cols + col, int32
    time: jax.Array  # steps since the last reset, for the optional time limit


@dataclasses.dataclass(frozen=True, eq=False)
class GridWorld:
    """Deterministic GridWorld as a transition table: one step is one table lookup."""

    rows: int
    cols: int
    next_cell: np.ndarray  # [cells, actions] int32: where each action leads (walls: stay)
    start: int
    goal: int
    max_episode_steps: int  # 0: no time limit

    @property
    def num_cells(self) -> int:
        return self.rows * self.cols

    def reset(self, key: jax.Array | None) -> tuple[jax.Array, EnvState]:
        del key  # the start cell is fixed
        state = EnvState(cell=jnp.int32(self.start), time=jnp.int32(0))
        return state.cell, state

    def step(self, key: jax.Array | None, state: EnvState, action: jax.Array):
        """-> (obs, state, reward, terminated, truncated, info); resets itself when done.

        info["final_observation"] is the cell actually reached: the Q-update must bootstrap
        from it, not from the start cell that obs shows after an automatic reset."""
        del key  # deterministic dynamics: no randomness, so no key is spent
        reached = jnp.asarray(self.next_cell)[state.cell, action]
        terminated = reached == self.goal
        time = state.time + 1
        if self.max_episode_steps > 0:
            truncated = (time >= self.max_episode_steps) & ~terminated
        else:
            truncated = jnp.bool_(False)
        done = terminated | truncated
        obs = jnp.where(done, self.start, reached)
        state = EnvState(cell=obs, time=jnp.where(done, 0, time))
        reward = terminated.astype(jnp.float32)  # +1 on entering G, else 0
        return obs, state, reward, terminated, truncated, {"final_observation": reached}


def parse_layout(text: str) -> list[str]:
    """Map text -> rows, or LayoutError naming the problem and where it is."""
    lines = [line.rstrip("\r") for line in text.split("\n")]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise LayoutError("empty map")
    for r, line in enumerate(lines):
        if len(line) != len(lines[0]):
            raise LayoutError(
                f"ragged rows: row {r} has {len(line)} characters, row 0 has {len(lines[0])}"
            )
        for c, char in enumerate(line):
            if char not in ".#SG":
                raise LayoutError(f"unknown character {char!r} at row {r}, col {c} (use . # S G)")
    for char, name in (("S", "start"), ("G", "goal")):
        count = sum(line.count(char) for line in lines)
        if count != 1:
            raise LayoutError(f"the map needs exactly one {char} ({name}), found {count}")
    return lines


def shortest_distances(next_cell: np.ndarray, goal: int) -> np.ndarray:
    """Steps from every cell to the goal (BFS backwards over the transition table; -1: never)."""
    predecessors = [[] for _ in range(len(next_cell))]
    for cell, targets in enumerate(next_cell):
        for target in targets:
            predecessors[target].append(cell)
    distance = np.full(len(next_cell), -1)
    distance[goal] = 0
    queue = deque([goal])
    while queue:
        cell = queue.popleft()
        for previous in predecessors[cell]:
            if distance[previous] < 0:
                distance[previous] = distance[cell] + 1
                queue.append(previous)
    return distance


def make_env(layout: str, max_episode_steps: int = 0) -> GridWorld:
    """Built-in layout name or map file -> GridWorld (LayoutError if it cannot be played)."""
    if layout in LAYOUTS:
        text = LAYOUTS[layout]
    else:
        path = Path(layout)
        if not path.is_file():
            raise LayoutError(f"{layout!r} is neither a built-in layout {list(LAYOUTS)} nor a file")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise LayoutError(f"cannot read {layout!r}: {error}") from None
    lines = parse_layout(text)
    rows, cols = len(lines), len(lines[0])
    next_cell = np.zeros((rows * cols, NUM_ACTIONS), np.int32)
    for r, c in itertools.product(range(rows), range(cols)):
        for action, (dr, dc) in enumerate(MOVES):
            r2, c2 = r + dr, c + dc
            blocked = not (0 <= r2 < rows and 0 <= c2 < cols) or lines[r2][c2] == "#"
            next_cell[r * cols + c, action] = r * cols + c if blocked else r2 * cols + c2
    find = {
        char: r * cols + line.index(char)
        for r, line in enumerate(lines)
        for char in "SG"
        if char in line
    }
    env = GridWorld(rows, cols, next_cell, find["S"], find["G"], max_episode_steps)
    if shortest_distances(next_cell, env.goal)[env.start] < 0:
        raise LayoutError("G cannot be reached from S")
    return env


def value_iteration(env: GridWorld, gamma: float) -> np.ndarray:
    """Exact Q*[cells, actions]: Q*(s, a) = r + gamma * max Q*(s', .), with G terminal.

    Deterministic dynamics and a reward only on entering G: starting from 0, values are exact
    once they have propagated along the shortest paths, so the loop stops when nothing moves."""
    entered_goal = env.next_cell == env.goal
    q = np.zeros(env.next_cell.shape)
    for _ in range(env.num_cells + 1):  # longest possible shortest path, + 1 to confirm
        new_q = entered_goal + gamma * np.where(entered_goal, 0.0, q.max(axis=1)[env.next_cell])
        if np.array_equal(new_q, q):
            break
        q = new_q
    return q


# ---------------------------------------------------------------------------------------------
# Agent: epsilon-greedy from one random uint32 per step, and the Q-learning update
# ---------------------------------------------------------------------------------------------

# Random-number generation was ~40% of a step with floats (gridworld brief), so each step
# gets one uint32 from jax.random.bits and splits it into two 16-bit fields.
LOW_BITS = 16
LOW_MASK = (1 << LOW_BITS) - 1


def epsilon_threshold(epsilon: jax.Array | float) -> jax.Array:
    """epsilon in [0, 1] -> the count of 16-bit values below which a step explores.

    epsilon is thereby rounded to a multiple of 2^-16; epsilon = 1 gives 2^16: always."""
    return jnp.round(jnp.asarray(epsilon) * (1 << LOW_BITS)).astype(jnp.uint32)


def epsilon_greedy(q_s: jax.Array, bits: jax.Array, threshold: jax.Array) -> jax.Array:
    """Action for Q-values q_s [actions] from one uint32 of random bits.

    Low 16 bits: explore or not. High 16 bits: a uniform pick among the candidates, which
    are all actions when exploring and the maximal ones otherwise (uniform tie-breaks: with a
    zero-initialised table 'first maximum' would always walk right)."""
    explore = (bits & LOW_MASK) < threshold
    candidates = explore | (q_s == q_s.max())  # [actions] bool
    num_candidates = candidates.sum().astype(jnp.uint32)
    pick = ((bits >> LOW_BITS) * num_candidates) >> LOW_BITS  # uniform in [0, num_candidates)
    # The pick-th candidate is the number of positions whose running count is still <= pick.
    return jnp.sum(jnp.cumsum(candidates) <= pick.astype(jnp.int32))


def q_learning_update(q, cell, action, reward, terminated, reached, learning_rate, gamma):
    """q[cell, action] += lr * (r + gamma * max_a' q[reached, a'] - q[cell, action]).

    `reached` is the true next cell (never the reset cell), and a terminal step does not
    bootstrap. A truncated step still does: a time limit is not a terminal state."""
    target = reward + gamma * jnp.where(terminated, 0.0, q[reached].max())
    return q.at[cell, action].add(learning_rate * (target - q[cell, action]))


def greedy_path_length(q: jax.Array, env: GridWorld) -> jax.Array:
    """Steps the greedy policy (first maximal action) takes from S to G; num_cells if never.

    A deterministic policy that has not arrived within num_cells steps is in a loop."""

    def walk(carry, _):
        cell, steps, arrived = carry
        cell = jnp.where(arrived, cell, jnp.asarray(env.next_cell)[cell, q[cell].argmax()])
        return (cell, steps + ~arrived, arrived | (cell == env.goal)), None

    init = (jnp.int32(env.start), jnp.int32(0), jnp.bool_(False))
    (_, steps, arrived), _ = lax.scan(walk, init, length=env.num_cells)
    return jnp.where(arrived, steps, env.num_cells)


# ---------------------------------------------------------------------------------------------
# Train: one agent, pure and jittable; vmap it over seeds and hyperparameters
# ---------------------------------------------------------------------------------------------


class Schedule(NamedTuple):
    """How total_timesteps is cut: curve points x blocks x steps (derived from Config)."""

    num_points: int
    blocks_per_point: int
    block_steps: int

    @property
    def total_steps(self) -> int:
        return self.num_points * self.blocks_per_point * self.block_steps


def make_schedule(config: Config) -> Schedule:
    """Whole blocks per curve point, at most num_curve_points points; total_timesteps is
    rounded up to whole blocks and points (by less than one point; main says so)."""
    block_steps = min(config.rng_block_steps, config.total_timesteps)
    num_blocks = math.ceil(config.total_timesteps / block_steps)
    blocks_per_point = math.ceil(num_blocks / min(config.num_curve_points, num_blocks))
    return Schedule(math.ceil(num_blocks / blocks_per_point), blocks_per_point, block_steps)


class Curve(NamedTuple):
    """One entry per curve point, measured at its end: [points] per agent."""

    episodes: jax.Array  # goals reached during the interval
    greedy_path_length: jax.Array  # greedy S -> G steps (num_cells: never arrives)
    start_value: jax.Array  # max_a Q(S, a), to compare with V*(S)


class TrainResult(NamedTuple):
    q_table: jax.Array  # [rows, cols, actions], indexed [row, col, action]
    curve: Curve


class Carry(NamedTuple):
    q: jax.Array  # [cells, actions] float32
    env_state: EnvState
    obs: jax.Array
    episodes: jax.Array  # goals reached since the last curve point
    key: jax.Array


def make_train(
    config: Config, on_point: Callable[[int], None] | None = None
) -> Callable[[jax.Array, HParams], TrainResult]:
    """-> train(rng, hparams): one agent, pure, fully jittable.

    on_point(i), if given, is called on the host after curve point i (progress printing);
    it does not change any value."""
    env = make_env(config.layout, config.max_episode_steps)
    schedule = make_schedule(config)

    def train(rng: jax.Array, hparams: HParams) -> TrainResult:
        threshold = epsilon_threshold(hparams.epsilon)

        def agent_step(carry: Carry, bits: jax.Array) -> tuple[Carry, None]:
            action = epsilon_greedy(carry.q[carry.obs], bits, threshold)
            obs, env_state, reward, terminated, _, info = env.step(None, carry.env_state, action)
            reached = info["final_observation"]  # the true next cell, before any reset
            q = q_learning_update(
                carry.q, carry.obs, action, reward, terminated, reached, hparams.learning_rate,
                hparams.gamma,
            )  # fmt: skip
            carry = carry._replace(q=q, env_state=env_state, obs=obs)
            return carry._replace(episodes=carry.episodes + terminated), None

        def run_block(carry: Carry, _) -> tuple[Carry, None]:
            key, block_key = jax.random.split(carry.key)
            # All randomness of the block at once: splitting a key per step costs more than
            # the Q-learning itself. No unroll: unrolling this scan was 7x slower on CPU.
            bits = jax.random.bits(block_key, (schedule.block_steps,), jnp.uint32)
            carry, _ = lax.scan(agent_step, carry._replace(key=key), bits)
            return carry, None

        def run_interval(carry: Carry, point: jax.Array) -> tuple[Carry, Curve]:
            carry, _ = lax.scan(run_block, carry, length=schedule.blocks_per_point)
            curve = Curve(
                episodes=carry.episodes,
                greedy_path_length=greedy_path_length(carry.q, env),
                start_value=carry.q[env.start].max(),
            )
            if on_point is not None:  # `point` is not batched: one call per chunk, not per agent
                jax.debug.callback(on_point, point)
            return carry._replace(episodes=jnp.int32(0)), curve

        obs, env_state = env.reset(None)
        carry = Carry(
            q=jnp.zeros((env.num_cells, NUM_ACTIONS), jnp.float32),
            env_state=env_state,
            obs=obs,
            episodes=jnp.int32(0),
            key=rng,
        )
        carry, curve = lax.scan(run_interval, carry, jnp.arange(schedule.num_points))
        return TrainResult(carry.q.reshape(env.rows, env.cols, NUM_ACTIONS), curve)

    return train


def grid_points(config: Config) -> list[tuple[float, float, float]]:
    """Every (gamma, learning rate, epsilon) combination: gamma slowest, epsilon fastest."""
    return list(itertools.product(config.gammas, config.learning_rates, config.epsilons))


def hparam_grid(config: Config) -> HParams:
    """The grid as HParams of float32 arrays [grid], in grid_points order."""
    gammas, learning_rates, epsilons = np.array(grid_points(config), np.float32).T
    return HParams(learning_rates, epsilons, gammas)


def seed_mesh(devices: list | None = None) -> Mesh:
    """1-D mesh over the devices: the seed axis is split across it."""
    return Mesh(np.array(devices if devices is not None else jax.devices()), ("seeds",))


def make_seed_keys(seed: int, num_seeds: int, mesh: Mesh) -> jax.Array:
    """Keys [num_seeds rounded up to a multiple of the device count], sharded over the mesh.

    Created inside jit with that output sharding, so each device makes only its own keys
    (also across hosts). Seed i's key is fold_in(key(seed), i) whatever the padding, so
    results do not depend on the number of devices; main() drops the padded seeds."""
    num_padded = math.ceil(num_seeds / mesh.size) * mesh.size

    @partial(jax.jit, out_shardings=NamedSharding(mesh, PartitionSpec("seeds")))
    def make_keys():
        base = jax.random.key(seed)
        return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(num_padded))

    return make_keys()


def make_sweep(train: Callable) -> Callable:
    """train(rng, hparams) -> sweep(keys [seeds], grid HParams [grid]) -> results [grid, seeds].

    The idea in two lines. Every grid point runs with the same seeds' keys, on purpose:
    common random numbers make the comparison between settings less noisy (the seeds
    themselves are independent). make_device_sweep computes the same, laid out for speed."""
    over_seeds = jax.vmap(train, in_axes=(0, None))
    return jax.jit(jax.vmap(over_seeds, in_axes=(None, 0)))


# On a CPU, agents whose Q-tables fit in a core's L2 cache step fastest: beyond that, every
# step's gather and scatter misses the cache. Measured here (1 MB L2 per core, 2 devices):
# 4096 and 16384 agents ran 1.6-2.1x faster in chunks of 256 default-layout tables (384 KB)
# than all at once; chunks of 128, 512 or 1024 were slower. A GPU wants every agent at once.
CPU_CHUNK_BYTES = 384 * 1024


def chunk_size(config: Config, num_cells: int) -> int:
    """Agents per chunk on one device; 0: all at once (GPU/TPU, or CPU with --agents-per-chunk
    larger than the sweep)."""
    if config.agents_per_chunk > 0:
        return config.agents_per_chunk
    if jax.devices()[0].platform != "cpu":
        return 0
    return max(1, CPU_CHUNK_BYTES // (num_cells * NUM_ACTIONS * 4))


def make_device_sweep(train: Callable, mesh: Mesh, num_grid: int, agents_per_chunk: int):
    """make_sweep's results, computed as: each device takes its seeds (shard_map), pairs each
    with every grid point, and trains these agents chunk after chunk (lax.map), each chunk
    vmapped. One flat agent axis: measured ~30% faster than vmap nested over grid and seeds."""

    def device_sweep(keys: jax.Array, grid: HParams) -> TrainResult:
        num_seeds = keys.shape[0]  # this device's seeds
        agent = jnp.arange(num_seeds * num_grid)  # agent = seed * num_grid + grid point
        agents = (keys[agent // num_grid], jax.tree.map(lambda x: x[agent % num_grid], grid))
        if agents_per_chunk > 0:
            results = lax.map(lambda a: train(*a), agents, batch_size=agents_per_chunk)
        else:
            results = jax.vmap(train)(*agents)

        def to_grid_by_seeds(x: jax.Array) -> jax.Array:
            return x.reshape(num_seeds, num_grid, *x.shape[1:]).swapaxes(0, 1)

        return jax.tree.map(to_grid_by_seeds, results)  # [seeds * grid, ...] -> [grid, seeds, ...]

    # check_vma=False: train starts its scans from constants (a zero Q-table), which the
    # varying-across-devices type check would otherwise want cast per device by hand.
    seeds_sharded, replicated = PartitionSpec("seeds"), PartitionSpec()
    grid_by_seeds = PartitionSpec(None, "seeds")
    return jax.jit(
        jax.shard_map(
            device_sweep,
            mesh=mesh,
            in_specs=(seeds_sharded, replicated),
            out_specs=grid_by_seeds,
            check_vma=False,
        )
    )


def device_chunks(num_seeds: int, mesh: Mesh, num_grid: int, agents_per_chunk: int):
    """-> (chunks each device runs one after the other, agents in a full chunk)."""
    local_agents = math.ceil(num_seeds / mesh.size) * num_grid
    if agents_per_chunk <= 0:
        return 1, local_agents
    chunk = min(local_agents, agents_per_chunk)
    return math.ceil(local_agents / chunk), chunk  # lax.map: full chunks, then the rest


# ---------------------------------------------------------------------------------------------
# Memory check: refuse a sweep that cannot fit, before anything is written
# ---------------------------------------------------------------------------------------------

FLOAT_BYTES = 4
# Live copies of the Q-table per agent: the scan carry, the loop's double buffer, the output.
Q_TABLE_COPIES = 3
# Leave room for XLA's temporaries, the host copy of the results and everything else.
MEMORY_FRACTION = 0.5
MAX_LOOP_LENGTH = 2**31 - 1  # loop counters are int32


def bytes_per_agent(schedule: Schedule, num_cells: int) -> int:
    q_table = num_cells * NUM_ACTIONS * FLOAT_BYTES * Q_TABLE_COPIES
    random_bits = schedule.block_steps * FLOAT_BYTES * 2  # the block and its scan slices
    curve = schedule.num_points * len(Curve._fields) * FLOAT_BYTES
    return q_table + random_bits + curve


def available_memory() -> int:
    """Bytes the devices can hold: GPU/TPU memory, or the machine's RAM for the CPU."""
    devices = jax.devices()
    if devices[0].platform != "cpu":
        stats = [device.memory_stats() or {} for device in devices]
        if all("bytes_limit" in s for s in stats):
            return sum(s["bytes_limit"] for s in stats)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(config: Config, num_cells: int) -> None:
    schedule = make_schedule(config)
    num_devices = len(jax.devices())
    padded_seeds = math.ceil(config.num_seeds / num_devices) * num_devices
    grid = len(config.learning_rates) * len(config.epsilons) * len(config.gammas)
    needed = padded_seeds * grid * bytes_per_agent(schedule, num_cells)
    limit = MEMORY_FRACTION * available_memory()
    if needed > limit:
        raise ConfigError(
            "num_seeds",
            f"{config.num_seeds} seeds x {grid} grid points need about {needed / 1e9:.1f} GB, "
            f"more than {limit / 1e9:.1f} GB ({MEMORY_FRACTION:.0%} of the devices' memory); "
            "use fewer seeds or a smaller grid",
        )
    if config.benchmark:
        needed = config.benchmark_max_agents * bytes_per_agent(schedule, num_cells)
        if needed > limit:
            raise ConfigError(
                "benchmark_max_agents",
                f"{config.benchmark_max_agents} agents need about {needed / 1e9:.1f} GB, "
                f"more than {limit / 1e9:.1f} GB",
            )


def validate(config: Config) -> GridWorld:
    """Every check that can fail, before anything is written. -> the environment."""
    for name in (
        "total_timesteps",
        "num_seeds",
        "num_curve_points",
        "rng_block_steps",
        "benchmark_max_agents",
        "benchmark_repeats",
    ):
        if getattr(config, name) < 1:
            raise ConfigError(name, f"must be at least 1, got {getattr(config, name)}")
    if config.max_episode_steps < 0:
        raise ConfigError("max_episode_steps", "must be >= 0 (0: no time limit)")
    if config.agents_per_chunk < 0:
        raise ConfigError("agents_per_chunk", "must be >= 0 (0: cache-sized chunks on CPU)")
    if make_schedule(config).blocks_per_point > MAX_LOOP_LENGTH:
        raise ConfigError(
            "total_timesteps", f"too large: at most {MAX_LOOP_LENGTH} blocks per curve point"
        )
    if not config.benchmark_seconds > 0:
        raise ConfigError("benchmark_seconds", f"must be > 0, got {config.benchmark_seconds}")
    checks = (
        ("learning_rates", lambda x: x > 0, "> 0"),
        ("epsilons", lambda x: 0 <= x <= 1, "in [0, 1]"),
        ("gammas", lambda x: 0 <= x < 1, "in [0, 1)"),
    )
    for name, ok, rule in checks:
        for value in getattr(config, name):
            if not ok(value):
                raise ConfigError(name, f"each value must be {rule}, got {value}")
    try:
        env = make_env(config.layout, config.max_episode_steps)
    except LayoutError as error:
        raise ConfigError("layout", str(error)) from None
    output = Path(config.output_dir).absolute()
    existing = next(p for p in (output, *output.parents) if p.exists())  # "/" always exists
    if not existing.is_dir():
        raise ConfigError("output_dir", f"{str(existing)!r} exists and is not a directory")
    if not os.access(existing, os.W_OK):
        raise ConfigError("output_dir", f"{str(existing)!r} is not writable")
    check_memory(config, env.num_cells)
    return env


# ---------------------------------------------------------------------------------------------
# Reporting: summary.json (checked against value iteration), sweep heatmap, learning curves
# ---------------------------------------------------------------------------------------------

Z_95 = 1.96  # normal approximation of a 95% confidence interval of a mean


def mean_ci(values: np.ndarray) -> dict:
    """Mean and 95% CI across seeds (axis 0); the CI is null for a single seed."""
    values = np.asarray(values, np.float64)
    mean = values.mean()
    if len(values) < 2:
        return {"mean": float(mean), "ci95": None}
    half = Z_95 * values.std(ddof=1) / math.sqrt(len(values))
    return {"mean": float(mean), "ci95": [float(mean - half), float(mean + half)]}


def versions() -> dict:
    import jaxlib

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "matplotlib": matplotlib.__version__,
    }


def devices_info() -> list[str]:
    return [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]


def summarize_grid(config: Config, env: GridWorld, result: TrainResult) -> list[dict]:
    """Per grid point: final greedy path vs shortest, V(S) vs value iteration, episodes.

    optimal_time_share: the share of curve points at which the greedy path was already
    optimal, which tells settings apart by how fast they learn, not only where they end."""
    shortest = int(shortest_distances(env.next_cell, env.goal)[env.start])
    rows = []
    for g, (gamma, learning_rate, epsilon) in enumerate(grid_points(config)):
        exact_start_value = float(value_iteration(env, gamma)[env.start].max())
        paths = np.asarray(result.curve.greedy_path_length[g])  # [seeds, points]
        start_value = np.asarray(result.curve.start_value[g, :, -1])  # [seeds]
        rows.append(
            {
                "learning_rate": learning_rate,
                "epsilon": epsilon,
                "gamma": gamma,
                "shortest_path": shortest,
                "greedy_path_length": mean_ci(paths[:, -1]),
                "greedy_path_optimal_fraction": float(np.mean(paths[:, -1] == shortest)),
                "optimal_time_share": mean_ci(np.mean(paths == shortest, axis=1)),
                "value_iteration_start_value": exact_start_value,
                "start_value_abs_error": mean_ci(np.abs(start_value - exact_start_value)),
                "episodes_completed": mean_ci(np.asarray(result.curve.episodes[g]).sum(axis=1)),
            }
        )
    return rows


HEATMAP_MEASURES = {
    "greedy_path_optimal_fraction": "seeds with an optimal\ngreedy path at the end",
    "optimal_time_share": "share of training with an\noptimal greedy path (mean)",
}


def plot_heatmap(config: Config, rows: list[dict], path: Path) -> None:
    """Quality over learning rate x epsilon: one column of panels per gamma, one row per measure."""
    lrs, epsilons, gammas = config.learning_rates, config.epsilons, config.gammas
    per_gamma = len(lrs) * len(epsilons)  # the grid's gamma is slowest, epsilon fastest
    fig, axes = plt.subplots(
        len(HEATMAP_MEASURES),
        len(gammas),
        figsize=(1.5 + 3.2 * len(gammas), 6.4),
        squeeze=False,
        layout="constrained",
    )
    for m, (measure, label) in enumerate(HEATMAP_MEASURES.items()):
        for k, gamma in enumerate(gammas):
            ax = axes[m][k]
            values = [r[measure] for r in rows[k * per_gamma : (k + 1) * per_gamma]]
            values = np.array([v["mean"] if isinstance(v, dict) else v for v in values])
            values = values.reshape(len(lrs), len(epsilons))
            image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis", origin="lower")
            for (i, j), value in np.ndenumerate(values):
                color = "w" if value < 0.6 else "k"
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color=color)
            ax.set_xticks(range(len(epsilons)), [f"{e:g}" for e in epsilons])
            ax.set_yticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
            ax.set(xlabel="epsilon", ylabel="learning rate")
            if m == 0:
                ax.set_title(f"gamma = {gamma:g}")
        fig.colorbar(image, ax=axes[m].tolist(), label=label)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(config: Config, env: GridWorld, result: TrainResult, path: Path) -> None:
    """Greedy path length during training, mean and 95% CI band across seeds, per grid point."""
    schedule = make_schedule(config)
    steps = (np.arange(schedule.num_points) + 1) * schedule.blocks_per_point * schedule.block_steps
    shortest = shortest_distances(env.next_cell, env.goal)[env.start]
    lengths = np.asarray(result.curve.greedy_path_length, np.float64)  # [grid, seeds, points]
    mean = lengths.mean(axis=1)  # [grid, points]
    half = np.zeros_like(mean)
    if config.num_seeds > 1:
        half = Z_95 * lengths.std(axis=1, ddof=1) / math.sqrt(config.num_seeds)
    gammas = config.gammas
    per_gamma = len(config.learning_rates) * len(config.epsilons)  # the grid's gamma is slowest
    fig, axes = plt.subplots(1, len(gammas), figsize=(1 + 4.5 * len(gammas), 3.8), squeeze=False)
    for g, (_, learning_rate, epsilon) in enumerate(grid_points(config)):
        ax = axes[0][g // per_gamma]
        ax.plot(steps, mean[g], label=f"lr={learning_rate:g} eps={epsilon:g}")
        ax.fill_between(steps, mean[g] - half[g], mean[g] + half[g], alpha=0.2)
    for ax, gamma in zip(axes[0], gammas, strict=True):
        ax.axhline(shortest, color="k", ls="--", lw=1, label="shortest path")
        ax.set(
            xlabel="steps per agent",
            ylabel="greedy path length (cap: never arrives)",
            title=f"gamma = {gamma:g}",
            yscale="log",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Benchmark: the articles' speed story, measured here
# ---------------------------------------------------------------------------------------------

BENCHMARK_HPARAMS = HParams(learning_rate=0.1, epsilon=0.1, gamma=0.9)  # the yardstick's
YARDSTICK_STEPS, YARDSTICK_AGENTS = 20_000, 1024  # the yardstick command
YARDSTICK_ARGS = ("--timesteps", str(YARDSTICK_STEPS), "--num-agents", str(YARDSTICK_AGENTS))
RATIO_AGENTS = 4096  # the issue compares 4096 agents on all devices with the yardstick
# One agent is dominated by the per-block overhead, so it prefers long blocks (gridworld brief:
# 13.5M steps/s at 1000, 18.8M at 10000); many agents prefer short ones (cache), hence 100.
SINGLE_AGENT_BLOCK = 10_000
# Step counts are static (they shape the compiled loops), so each benchmark point guesses its
# rate before compiling: from the NumPy loop for the jitted agent, then from the previous N.
NUMPY_CALIBRATION_STEPS = 2_000
JIT_SPEEDUP_GUESS = 100  # jit one agent vs the NumPy loop (measured 100-130x)
VMAP_ONE_AGENT_SLOWDOWN = 3  # vmap of one agent vs jit: batched gathers and scatters
OVERSHOOT = 3  # a warm-up run this many times the target is kept as the only sample
MIN_STEPS_PER_CELL = 20  # the benchmark's one greedy evaluation costs <= 5% of the steps
CHUNKED, ALL_AT_ONCE = "vmap, chunks", "vmap, all at once"  # the benchmark's vmap methods


def numpy_q_learning(env: GridWorld, hparams: HParams, steps: int, seed: int) -> np.ndarray:
    """The same agent as a plain Python loop with NumPy: the articles' starting point."""
    rng = np.random.default_rng(seed)
    q = np.zeros((env.num_cells, NUM_ACTIONS))
    cell, episode_steps = env.start, 0
    for _ in range(steps):
        q_s = q[cell]
        if rng.random() < hparams.epsilon:
            action = int(rng.integers(NUM_ACTIONS))
        else:
            action = int(rng.choice(np.flatnonzero(q_s == q_s.max())))
        reached = int(env.next_cell[cell, action])
        terminated = reached == env.goal
        episode_steps += 1
        truncated = 0 < env.max_episode_steps <= episode_steps
        target = float(terminated) + hparams.gamma * (0.0 if terminated else q[reached].max())
        q[cell, action] += hparams.learning_rate * (target - q[cell, action])
        cell = env.start if terminated or truncated else reached
        episode_steps = 0 if terminated or truncated else episode_steps
    return q


def measure(train_fn: Callable, args: tuple, target_seconds: float, repeats: int) -> dict:
    """Compile (timed apart), then the median of `repeats` timed runs after one warm-up run.

    A warm-up run far over the target is kept as the only sample instead of repeating it:
    that bounds the benchmark's run time when a step-count guess was too high."""
    start = time.perf_counter()
    compiled = jax.jit(train_fn).lower(*args).compile()
    compile_seconds = time.perf_counter() - start
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - start)
        if len(samples) == 1 and samples[0] > OVERSHOOT * target_seconds:
            break
    kept = samples[1:] or samples  # the warm-up run is dropped when there are others
    return {"seconds": float(np.median(kept)), "compile_seconds": compile_seconds}


def steps_for(config: Config, rate_guess: float, agents: int, block: int) -> int:
    """Steps per agent (whole blocks) so one run takes about benchmark_seconds at rate_guess."""
    blocks = int(config.benchmark_seconds * rate_guess / agents / block)
    return block * max(1, blocks)


def run_yardstick(config: Config) -> dict:
    """Run the articles-style script in a subprocess; its one line gives agent-steps/s."""
    if not config.yardstick:
        return {"skipped": "--yardstick ''"}
    path = Path(__file__).resolve().parent / config.yardstick
    if not path.is_file():
        return {"skipped": f"{path} not found"}
    command = [sys.executable, str(path), *YARDSTICK_ARGS]
    # It runs on one device: give it the plain CPU platform, as its own docstring runs it
    # (measured: a little faster than with this process's split CPU).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    match = re.search(r"steps_per_s=([0-9.]+)", done.stdout)
    if done.returncode != 0 or match is None:
        return {"skipped": f"yardstick failed: {(done.stderr or done.stdout).strip()[-200:]}"}
    return {
        "command": " ".join(["python", config.yardstick, *YARDSTICK_ARGS]),
        "agent_steps_per_s": float(match.group(1)),
    }


def benchmark_agent_counts(config: Config) -> list[int]:
    """N = 1, 4, 16, ... up to benchmark_max_agents (included even if not a power of 4)."""
    counts = [1]
    while counts[-1] * 4 <= config.benchmark_max_agents:
        counts.append(counts[-1] * 4)
    if counts[-1] != config.benchmark_max_agents:
        counts.append(config.benchmark_max_agents)
    return counts


def run_benchmark(config: Config, env: GridWorld) -> dict:
    """agent-steps/s: NumPy loop, one jitted agent, vmapped N agents on 1 and all devices."""
    hparams = HParams(*(jnp.float32(x) for x in BENCHMARK_HPARAMS))
    key = jax.random.key(config.seed)
    rows = []

    def record(method: str, devices: int, agents: int, steps: int, timing: dict) -> float:
        rate = agents * steps / timing["seconds"]
        rows.append(
            {"method": method, "devices": devices, "agents": agents, "steps_per_agent": steps}
            | timing
            | {"agent_steps_per_s": rate}
        )
        print(f"  {method:<18} {devices:>7} {agents:>7} {steps:>10} {rate / 1e6:12.2f}")
        return rate

    print(f"  {'method':<18} {'devices':>7} {'agents':>7} {'steps':>10} {'M agent-steps/s':>12}")

    # 1. A plain Python loop over NumPy arrays, one agent: the articles' starting point.
    start = time.perf_counter()
    numpy_q_learning(env, BENCHMARK_HPARAMS, NUMPY_CALIBRATION_STEPS, config.seed)
    rate_guess = NUMPY_CALIBRATION_STEPS / (time.perf_counter() - start)
    steps = max(NUMPY_CALIBRATION_STEPS, int(config.benchmark_seconds * rate_guess))
    start = time.perf_counter()
    numpy_q_learning(env, BENCHMARK_HPARAMS, steps, config.seed)
    numpy_rate = record("numpy loop", 1, 1, steps, {"seconds": time.perf_counter() - start})

    # 2. One agent, the whole training loop as one jitted XLA program.
    steps = steps_for(config, JIT_SPEEDUP_GUESS * numpy_rate, 1, SINGLE_AGENT_BLOCK)
    single = dataclasses.replace(
        config, total_timesteps=steps, num_curve_points=1, rng_block_steps=SINGLE_AGENT_BLOCK
    )
    timing = measure(
        make_train(single), (key, hparams), config.benchmark_seconds, config.benchmark_repeats
    )
    jit_rate = record("jit, one agent", 1, 1, steps, timing)

    # 3. N vmapped agents, seeds sharded over a mesh of one device, then of all devices; in
    #    cache-sized chunks as main() runs them, then (all devices) all at once for contrast.
    counts = benchmark_agent_counts(config)
    chunk = chunk_size(config, env.num_cells)
    series = [(CHUNKED, seed_mesh(jax.devices()[:1]), chunk), (CHUNKED, seed_mesh(), chunk)]
    series += [(ALL_AT_ONCE, seed_mesh(), 0)] if chunk else []
    one_point = HParams(*(x.reshape(1) for x in hparams))  # a grid of one setting
    for method, mesh, agents_per_chunk in series:
        rate_guess = jit_rate / VMAP_ONE_AGENT_SLOWDOWN
        # N below the device count would only measure padding: start at one agent per device.
        for agents in [n for n in counts if n >= mesh.size]:
            steps = steps_for(config, rate_guess, agents, config.rng_block_steps)
            # Enough steps that the one greedy evaluation at the end (num_cells steps) is small.
            steps = max(steps, MIN_STEPS_PER_CELL * env.num_cells)
            timed = dataclasses.replace(config, total_timesteps=steps, num_curve_points=1)
            sweep = make_device_sweep(make_train(timed), mesh, 1, agents_per_chunk)
            keys = make_seed_keys(config.seed, agents, mesh)
            timing = measure(
                sweep, (keys, one_point), config.benchmark_seconds, config.benchmark_repeats
            )
            # The next N runs at least as fast per agent-step, about: guess this rate.
            rate_guess = record(method, mesh.size, agents, make_schedule(timed).total_steps, timing)

    # 4. The articles' code, same machine, same run; then the ratios the issue asks for.
    yardstick = run_yardstick(config)
    rate = {(r["method"], r["devices"], r["agents"]): r["agent_steps_per_s"] for r in rows}
    all_devices = len(jax.devices())
    compare_at = RATIO_AGENTS if RATIO_AGENTS in counts else counts[-1]
    best = rate[(CHUNKED, all_devices, compare_at)]
    vmap_name = f"{CHUNKED} {compare_at} agents on {all_devices} devices"
    ratios = {
        "jit one agent / numpy loop": jit_rate / numpy_rate,
        f"{vmap_name} / numpy loop": best / numpy_rate,
        f"{vmap_name} / on 1 device": best / rate[(CHUNKED, 1, compare_at)],
    }
    if chunk:
        ratios[f"{vmap_name} / {ALL_AT_ONCE}"] = best / rate[(ALL_AT_ONCE, all_devices, compare_at)]
    if "agent_steps_per_s" in yardstick:
        print(
            f"  {'yardstick':<18} {1:>7} {YARDSTICK_AGENTS:>7} {YARDSTICK_STEPS:>10} "
            f"{yardstick['agent_steps_per_s'] / 1e6:12.2f}   ({yardstick['command']})"
        )
        ratios[f"{vmap_name} / yardstick"] = best / yardstick["agent_steps_per_s"]
    else:
        print(f"  yardstick skipped: {yardstick['skipped']}")
    for name, ratio in ratios.items():
        print(f"  {name}: {ratio:.1f}x")
    return {
        "layout": config.layout,
        "hparams": BENCHMARK_HPARAMS._asdict(),
        "rows": rows,
        "yardstick": yardstick,
        "ratios": ratios,
    }


def plot_benchmark(bench: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    vmapped = [r for r in bench["rows"] if r["method"] in (CHUNKED, ALL_AT_ONCE)]
    series = sorted({(r["method"], r["devices"]) for r in vmapped})
    for method, devices in series:
        rows = [r for r in vmapped if (r["method"], r["devices"]) == (method, devices)]
        ax.plot(
            [r["agents"] for r in rows],
            [r["agent_steps_per_s"] for r in rows],
            "o-",
            label=f"{method}, {devices} device{'s' if devices > 1 else ''}",
        )
    for row, marker in zip(bench["rows"][:2], ("s", "^"), strict=True):
        ax.plot([1], [row["agent_steps_per_s"]], marker, ms=9, label=row["method"])
    if "agent_steps_per_s" in bench["yardstick"]:
        ax.plot(
            [1024],
            [bench["yardstick"]["agent_steps_per_s"]],
            "kx",
            ms=10,
            label="articles' style (yardstick)",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="agents",
        ylabel="agent-steps / s",
        title=f"Tabular Q-learning, {bench['layout']} GridWorld",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


class SweepRun(NamedTuple):
    result: TrainResult  # numpy arrays [grid, seeds, ...], padding dropped
    compile_time: float
    wall_time: float
    padded_seeds: int
    agents_per_chunk: int


def run_sweep(config: Config, env: GridWorld) -> SweepRun:
    """Compile and run the whole sweep as one call, printing progress as it goes."""
    schedule = make_schedule(config)
    num_grid = len(grid_points(config))
    num_agents = num_grid * config.num_seeds
    mesh = seed_mesh()
    chunk = chunk_size(config, env.num_cells)
    chunks, agents_in_chunk = device_chunks(config.num_seeds, mesh, num_grid, chunk)
    print(f"per device: {chunks} chunk(s) of up to {agents_in_chunk} agents (--agents-per-chunk)")

    # Progress: each device calls on_point after each curve point of each of its chunks.
    total_calls = mesh.size * chunks * schedule.num_points
    calls = itertools.count(1)  # next() on it is atomic: devices may call from two threads
    every = max(1, total_calls // 10)
    clock = {"start": 0.0}

    def on_point(_) -> None:
        call = next(calls)
        if call % every == 0 or call == total_calls:
            seconds = time.perf_counter() - clock["start"]
            done = num_agents * schedule.total_steps * call / total_calls
            print(f"  {call / total_calls:4.0%}  {seconds:6.2f}s  "
                  f"{done / seconds / 1e6:7.1f}M agent-steps/s", flush=True)  # fmt: skip

    sweep = make_device_sweep(make_train(config, on_point), mesh, num_grid, chunk)
    keys = make_seed_keys(config.seed, config.num_seeds, mesh)
    hparams = HParams(*(jnp.asarray(x) for x in hparam_grid(config)))
    start = time.perf_counter()
    compiled = sweep.lower(keys, hparams).compile()
    compile_time = time.perf_counter() - start
    print(f"compiled in {compile_time:.1f}s; training {schedule.total_steps} steps per agent")
    start = clock["start"] = time.perf_counter()
    result = jax.block_until_ready(compiled(keys, hparams))
    wall_time = time.perf_counter() - start
    # Drop the padded seeds; everything after this is [grid, seeds, ...] on the host.
    result = jax.tree.map(lambda x: np.asarray(x)[:, : config.num_seeds], result)
    return SweepRun(result, compile_time, wall_time, int(keys.shape[0]), chunk)


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error on two lines; the project wants one line."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_float_list(text: str) -> tuple[float, ...]:
    """'0.05,0.1,0.5' -> (0.05, 0.1, 0.5); empty or malformed items are an error."""
    items = text.split(",")
    if any(not item.strip() for item in items):
        raise argparse.ArgumentTypeError(f"empty item in {text!r} (expected e.g. 0.05,0.1)")
    try:
        values = tuple(float(item) for item in items)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"values must be finite: {text!r}")
    return values


def make_parser() -> OneLineParser:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        name = "--" + field.name.replace("_", "-")
        help_text = f"{field.metadata['help']} (default: {field.default})"
        if field.type == "bool":
            parser.add_argument(name, action="store_true", help=field.metadata["help"])
        elif field.type == "tuple[float, ...]":
            parser.add_argument(
                name,
                type=parse_float_list,
                default=field.default,
                help=help_text,
                metavar="X,Y,...",
            )
        else:
            kind = {"int": int, "float": float, "str": str}[field.type]
            parser.add_argument(name, type=kind, default=field.default, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> None:
    config = Config(**vars(make_parser().parse_args(argv)))
    try:
        env = validate(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None

    schedule = make_schedule(config)
    num_grid, num_devices = len(grid_points(config)), len(jax.devices())
    num_agents = num_grid * config.num_seeds
    print(
        f"{config.num_seeds} seeds x {num_grid} grid points = {num_agents} agents on "
        f"{env.rows}x{env.cols} {config.layout!r}, {num_devices} device(s): {devices_info()}"
    )
    if schedule.total_steps != config.total_timesteps:
        print(
            f"note: total_timesteps rounded up to {schedule.total_steps} = "
            f"{schedule.num_points} curve points x {schedule.blocks_per_point} blocks x "
            f"{schedule.block_steps} steps"
        )
    if config.num_seeds % num_devices:
        print(f"note: seeds padded to a multiple of {num_devices} devices; padding is dropped")

    run = run_sweep(config, env)
    rate = num_agents * schedule.total_steps / run.wall_time
    print(f"trained in {run.wall_time:.2f}s: {rate / 1e6:.1f}M agent-steps/s")
    result = run.result

    rows = summarize_grid(config, env, result)
    print(f"{'lr':>6} {'eps':>6} {'gamma':>6} {'optimal':>8} {'path':>7} {'|V(S)-V*(S)|':>13}")
    # optimal: fraction of seeds whose final greedy path is a shortest path
    for row in rows:
        print(
            f"{row['learning_rate']:6g} {row['epsilon']:6g} {row['gamma']:6g} "
            f"{row['greedy_path_optimal_fraction']:8.2f} {row['greedy_path_length']['mean']:7.1f} "
            f"{row['start_value_abs_error']['mean']:13.4f}"
        )

    bench = None
    if config.benchmark:
        print(f"benchmark (agent-steps/s, compile excluded, median of {config.benchmark_repeats}):")
        bench = run_benchmark(config, env)

    output = Path(config.output_dir)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # validate() checked what it could; the OS has the last word
        print(f"error: --output-dir: cannot create {config.output_dir!r}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    summary = {
        "config": dataclasses.asdict(config),
        "versions": versions(),
        "devices": devices_info(),
        "num_agents": num_agents,
        "seeds_padded_to": run.padded_seeds,  # a multiple of the device count
        "agents_per_chunk": run.agents_per_chunk,  # per device, chunk after chunk; 0: all at once
        "steps_per_agent": schedule.total_steps,
        "wall_time_s": run.wall_time,
        "compile_time_s": run.compile_time,
        "agent_steps_per_s": rate,
        "grid": rows,
    }
    (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_heatmap(config, rows, output / "sweep_heatmap.png")
    plot_curves(config, env, result, output / "learning_curves.png")
    written = ["summary.json", "sweep_heatmap.png", "learning_curves.png"]
    if bench is not None:
        bench = {
            "config": summary["config"],
            "versions": summary["versions"],
            "devices": summary["devices"],
            **bench,
        }
        (output / "benchmark.json").write_text(json.dumps(bench, indent=2) + "\n")
        plot_benchmark(bench, output / "benchmark.png")
        written += ["benchmark.json", "benchmark.png"]
    print(f"wrote {', '.join(written)} to {output}/")


if __name__ == "__main__":
    main()
