"""Thousands of tabular Q-learning agents, and whole hyperparameter sweeps, in one compiled call.

    python parallel_q_learning.py --num-seeds 256 --learning-rates 0.05,0.1,0.5 \
        --epsilons 0.05,0.1,0.3                          # 256 x 9 agents
    python benchmarks/parallel_q_learning.py             # the speed story, measured here

The GridWorld and Q-learning are the textbook ones (q_learning_gridworld.py's map format and
dynamics; nothing is imported from it), with Q from 0 as in the article, not that script's
optimistic 1.0: a few seeds end on a detour. New is the shape of the experiment: make_train(config)
returns a pure `train(rng, hparams)`, with the hyperparameters as data, so

    jax.jit(jax.vmap(train, in_axes=(0, None)))(keys, hparams)  # many seeds of one setting
    make_sweep(train)(keys, grid)                               # seeds x a whole grid

are single XLA programs. Below the algorithm, the appendix runs that make_sweep with the
seeds split over all devices, then checks each grid point against exact value iteration.
"""

import dataclasses
import itertools
import math
import os
import signal
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

# XLA runs this scan of small ops on about one core a device: one CPU device per core spreads
# the seeds over every core (README). A GPU run is unaffected; a user's XLA_FLAGS win.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={os.cpu_count() or 1}")
if __name__ == "__main__":  # a Ctrl-C or SIGTERM while JAX loads waits for the handlers
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# ----- Config: every field is a command-line flag (--total-timesteps for total_timesteps) -----

# The open 8x12 grid of R. Pégoud's "Vectorize and Parallelize RL Environments with JAX" ('.'
# free, 'S' start, 'G' goal): the shortest path takes 18 steps. --layout gives more maps.
DEFAULT_LAYOUT = "\n".join(["G..........."] + ["............"] * 6 + ["...........S"])


def option(default, help: str):
    """A Config field whose help text becomes its --flag's help in the command line."""
    return dataclasses.field(default=default, metadata={"help": help})


class ConfigError(ValueError):  # a bad flag value, as one line that names the flag
    def __init__(self, name: str, message: str):
        super().__init__(f"--{name.replace('_', '-')}: {message}")


@dataclasses.dataclass(frozen=True)
class Config:
    layout: str = option(DEFAULT_LAYOUT, "map text; CLI: default, maze, four_rooms or a file")
    total_timesteps: int = option(100_000, "environment steps per agent")
    num_seeds: int = option(64, "independent agents per hyperparameter setting")
    seed: int = option(0, "seed i trains with fold_in(key(seed), i), at every grid point")
    learning_rates: tuple[float, ...] = option((0.05, 0.1, 0.5), "comma-separated, each in (0, 1]")
    epsilons: tuple[float, ...] = option((0.05, 0.1, 0.3), "comma-separated, each in [0, 1]")
    gammas: tuple[float, ...] = option((0.9,), "comma-separated, each in [0, 1)")
    max_episode_steps: int = option(0, "time limit (truncation, still bootstraps); 0 = none")
    num_curve_points: int = option(50, "at most this many points per curve (memory does not grow)")
    # Short: thousands of agents' bits stay in cache (README). Another size draws other numbers.
    rng_block_steps: int = option(100, "steps whose random bits are drawn at once")
    agents_per_chunk: int = option(0, "agents a device trains at once; 0: cache-sized on CPU")
    output_dir: str = option("runs/parallel_q_learning_{time}", "run folder; {time}: its start")

    def __post_init__(self):
        # The ranges, checked here so make_train never sees them wrong (make_env checks the map).
        for name in ("total_timesteps", "num_seeds", "num_curve_points", "rng_block_steps"):
            if not 1 <= getattr(self, name) < 2**31:  # int32 counters: episodes, steps
                raise ConfigError(name, f"must be in [1, 2^31), got {getattr(self, name)}")
        for name in ("max_episode_steps", "agents_per_chunk"):
            if not 0 <= getattr(self, name) < 2**31:  # int32 in the compiled program
                raise ConfigError(name, f"must be in [0, 2^31), got {getattr(self, name)}")
        if not -(2**63) <= self.seed < 2**63:  # what jax.random.key takes
            raise ConfigError("seed", f"must be a 64-bit integer, got {self.seed}")
        for name, valid, rule in (
            ("learning_rates", lambda x: 1.2e-38 <= x <= 1, "in [1.2e-38, 1]"),  # less is 0 to XLA
            ("epsilons", lambda x: 0 <= x <= 1, "in [0, 1]"),
            ("gammas", lambda x: 0 <= x < 1 and np.float32(x) < 1, "in [0, 1) as a float32"),
        ):
            if not getattr(self, name):
                raise ConfigError(name, "needs at least one value")
            for value in getattr(self, name):
                if not valid(value):  # False for NaN
                    raise ConfigError(name, f"each value must be {rule}, got {value}")
            if len(set(np.float32(getattr(self, name)))) < len(getattr(self, name)):
                raise ConfigError(name, f"lists a value twice (in float32): {getattr(self, name)}")


class HParams(NamedTuple):
    """Hyperparameters as data: scalars for one agent, arrays [grid] for a sweep."""

    learning_rate: jax.Array | float
    epsilon: jax.Array | float
    gamma: jax.Array | float


# ----- Environment: GridWorld ('.' free, '#' wall, 'S' start, 'G' goal), gymnax-1.0 API -----

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
    next_cell: np.ndarray  # [cells, actions] int32: where each action leads (into a wall: stay)
    start: int
    goal: int
    shortest_path: int  # fewest steps from S to G
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
        truncated = jnp.bool_(False)
        if self.max_episode_steps > 0:  # Python-level: no time-limit code when there is no limit
            truncated = (time >= self.max_episode_steps) & ~terminated
        done = terminated | truncated
        obs = jnp.where(done, self.start, reached)
        state = EnvState(cell=obs, time=jnp.where(done, 0, time))
        reward = terminated.astype(jnp.float32)  # +1 on entering G, else 0
        return obs, state, reward, terminated, truncated, {"final_observation": reached}


def parse_layout(text: str) -> list[str]:
    """Map text -> rows, or LayoutError naming the problem and where it is."""
    # Rows split at "\n" only (not at a form feed); trailing spaces and outer blank lines dropped.
    lines = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n").split("\n")
    if not lines[0]:
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


def make_env(layout: str, max_episode_steps: int = 0) -> GridWorld:
    """Map text -> GridWorld, or LayoutError if it cannot be played."""
    lines = parse_layout(layout)
    rows, cols = len(lines), len(lines[0])
    next_cell = np.zeros((rows * cols, NUM_ACTIONS), np.int32)
    for r, c in itertools.product(range(rows), range(cols)):
        for action, (dr, dc) in enumerate(MOVES):
            r2, c2 = r + dr, c + dc
            blocked = not (0 <= r2 < rows and 0 <= c2 < cols) or lines[r2][c2] == "#"
            next_cell[r * cols + c, action] = r * cols + c if blocked else r2 * cols + c2
    start, goal = "".join(lines).index("S"), "".join(lines).index("G")
    # Shortest path: breadth-first, the frontier is the cells first reached in k steps.
    seen, frontier, shortest = np.arange(rows * cols) == start, np.array([start]), 0
    while not seen[goal]:
        frontier = np.unique(next_cell[frontier])
        frontier = frontier[~seen[frontier]]
        if frontier.size == 0:
            raise LayoutError("G cannot be reached from S")
        seen[frontier], shortest = True, shortest + 1
    return GridWorld(rows, cols, next_cell, start, goal, shortest, max_episode_steps)


# ----- Agent: epsilon-greedy from one random uint32 per step, and the Q-learning update -----

# Each step gets one uint32 from jax.random.bits, split into two 16-bit fields: one draw a step,
# not a float and an integer, and a block's words in one call (README).
RANDOM_FIELD_BITS = 16
RANDOM_FIELD_MASK = (1 << RANDOM_FIELD_BITS) - 1


def explore_threshold(epsilon: jax.Array | float) -> jax.Array:
    """epsilon in [0, 1] -> the count of 16-bit values below which a step explores.

    epsilon is thereby rounded to a multiple of 2^-16; epsilon = 1 gives 2^16: always."""
    return jnp.round(jnp.asarray(epsilon) * (1 << RANDOM_FIELD_BITS)).astype(jnp.uint32)


def epsilon_greedy(q_s: jax.Array, bits: jax.Array, threshold: jax.Array) -> jax.Array:
    """Action for Q-values q_s [actions] from one uint32 of random bits.

    Low 16 bits: explore or not. High 16 bits: a uniform pick among the candidates, which
    are all actions when exploring and the maximal ones otherwise (uniform tie-breaks: with a
    zero-initialised table argmax's first maximum would always pick right)."""
    explore = (bits & RANDOM_FIELD_MASK) < threshold
    candidates = explore | (q_s == q_s.max())  # [actions] bool
    # The j-th candidate with j = floor(u * count), u the high 16 bits as a fraction in [0, 1).
    j = ((bits >> RANDOM_FIELD_BITS) * candidates.sum()) >> RANDOM_FIELD_BITS
    rank = jnp.cumsum(candidates) - 1  # [actions] rank of each candidate among the candidates
    return jnp.argmax(candidates & (rank == j)).astype(jnp.int32)


def q_learning_update(q, cell, action, reward, terminated, reached, learning_rate, gamma):
    """q[cell, action] += lr * (r + gamma * max_a' q[reached, a'] - q[cell, action]), as a .set:
    an .add rounds differently under vmap (README). `reached` is the true next cell (never the
    reset cell); a terminal step does not bootstrap, a truncated one does (a time limit is not
    a terminal state)."""
    target = reward + gamma * jnp.where(terminated, 0.0, q[reached].max())
    return q.at[cell, action].set(q[cell, action] + learning_rate * (target - q[cell, action]))


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


# ----- Train: one agent, pure and jittable; vmap it over seeds and hyperparameters -----------


class StepPlan(NamedTuple):
    """How total_timesteps is cut (derived from Config): curve points of blocks_per_point blocks
    of block_steps steps, but the last point, which has the blocks and steps that are left."""

    num_points: int
    blocks_per_point: int
    block_steps: int
    last_point_blocks: int
    last_block_steps: int


def make_step_plan(config: Config) -> StepPlan:
    """Whole blocks per curve point, at most num_curve_points points, exactly total_timesteps."""
    block_steps = min(config.rng_block_steps, config.total_timesteps)
    num_blocks = math.ceil(config.total_timesteps / block_steps)
    per_point = math.ceil(num_blocks / min(config.num_curve_points, num_blocks))
    num_points = math.ceil(num_blocks / per_point)
    last_blocks = num_blocks - (num_points - 1) * per_point
    last_steps = config.total_timesteps - (num_blocks - 1) * block_steps
    return StepPlan(num_points, per_point, block_steps, last_blocks, last_steps)


class Curve(NamedTuple):
    """One entry per curve point, measured at its end: [points] per agent."""

    episodes: jax.Array  # episodes ended during the interval (at G or the time limit)
    greedy_path_length: jax.Array  # greedy S -> G steps (num_cells: never arrives)
    start_value: jax.Array  # max_a Q(S, a), to compare with V*(S)


class TrainResult(NamedTuple):
    q_table: jax.Array  # [rows, cols, actions], indexed [row, col, action]
    curve: Curve


class Carry(NamedTuple):
    q: jax.Array  # [cells, actions] float32
    env_state: EnvState
    obs: jax.Array
    episodes: jax.Array  # episodes ended since the last curve point
    key: jax.Array


def make_train(
    config: Config,
    env: GridWorld | None = None,
    plan: StepPlan | None = None,
    on_point: Callable[[int], None] | None = None,
) -> Callable[[jax.Array, HParams], TrainResult]:
    """-> train(rng, hparams): one agent, pure, fully jittable.

    env and plan are built from config unless given (main builds each once). on_point(i),
    if given, is called on the host after curve point i (progress); it changes no value."""
    env = env or make_env(config.layout, config.max_episode_steps)
    plan = plan or make_step_plan(config)

    def train(rng: jax.Array, hparams: HParams) -> TrainResult:
        threshold = explore_threshold(hparams.epsilon)

        def agent_step(carry: Carry, bits: jax.Array) -> tuple[Carry, None]:
            action = epsilon_greedy(carry.q[carry.obs], bits, threshold)
            obs, state, reward, terminated, truncated, info = env.step(
                None, carry.env_state, action
            )
            reached = info["final_observation"]  # the true next cell, before any reset
            lr, gamma = hparams.learning_rate, hparams.gamma
            q = q_learning_update(
                carry.q, carry.obs, action, reward, terminated, reached, lr, gamma
            )
            episodes = carry.episodes + (terminated | truncated)
            return carry._replace(q=q, env_state=state, obs=obs, episodes=episodes), None

        def run_block(steps: int, carry: Carry, _) -> tuple[Carry, None]:
            key, block_key = jax.random.split(carry.key)
            # All the block's randomness at once: a key split per step costs more than Q-learning.
            bits = jax.random.bits(block_key, (steps,), jnp.uint32)
            carry, _ = lax.scan(agent_step, carry._replace(key=key), bits)
            return carry, None

        def run_interval(blocks: int, last_steps: int, carry: Carry, point) -> tuple[Carry, Curve]:
            """`blocks` blocks, the last one of `last_steps` steps, then a curve point."""
            whole_blocks = partial(run_block, plan.block_steps)
            carry, _ = lax.scan(whole_blocks, carry, length=blocks - 1)
            carry, _ = run_block(last_steps, carry, None)
            curve = Curve(
                episodes=carry.episodes,
                greedy_path_length=greedy_path_length(carry.q, env),
                start_value=carry.q[env.start].max(),
            )
            if on_point is not None:  # `point` is not batched: one call per vmap, not per agent
                jax.debug.callback(on_point, point)
            return carry._replace(episodes=jnp.int32(0)), curve

        obs, env_state = env.reset(None)
        carry = Carry(
            q=jnp.zeros((env.num_cells, NUM_ACTIONS), jnp.float32),  # the article's start: 0
            env_state=env_state,
            obs=obs,
            episodes=jnp.int32(0),
            key=rng,
        )
        whole_points = partial(run_interval, plan.blocks_per_point, plan.block_steps)
        carry, curve = lax.scan(whole_points, carry, jnp.arange(plan.num_points - 1))
        last = (plan.last_point_blocks, plan.last_block_steps)
        carry, last_point = run_interval(*last, carry, plan.num_points - 1)
        curve = jax.tree.map(lambda c, p: jnp.concatenate([c, p[None]]), curve, last_point)
        return TrainResult(carry.q.reshape(env.rows, env.cols, NUM_ACTIONS), curve)

    return train


def grid_points(config: Config) -> list[HParams]:
    """Every combination of the lists, as HParams: gamma slowest, epsilon fastest."""
    product = itertools.product(config.gammas, config.learning_rates, config.epsilons)
    return [HParams(learning_rate=lr, epsilon=eps, gamma=gamma) for gamma, lr, eps in product]


def hparam_grid(config: Config) -> HParams:
    """The grid as HParams of float32 arrays [grid], in grid_points order."""
    return HParams(*np.array(grid_points(config), np.float32).T)


def make_sweep(train: Callable) -> Callable:
    """train(rng, hparams) -> sweep(keys [seeds], grid HParams [grid]) -> results [grid, seeds].

    Each (seed, grid point) pair is one agent on one flat vmapped axis. Every grid point runs
    with the same seeds' keys, on purpose: common random numbers make the comparison between
    settings less noisy (the seeds themselves are independent)."""

    def sweep(keys: jax.Array, grid: HParams) -> TrainResult:
        num_seeds, grid_size = keys.shape[0], grid.learning_rate.shape[0]
        agent = jnp.arange(num_seeds * grid_size)  # agent = seed * grid_size + grid point
        agent_hparams = jax.tree.map(lambda x: x[agent % grid_size], grid)
        results = jax.vmap(train)(keys[agent // grid_size], agent_hparams)  # [agents, ...]
        # [seeds * grid, ...] -> [grid, seeds, ...]
        return jax.tree.map(
            lambda x: x.reshape(num_seeds, grid_size, *x.shape[1:]).swapaxes(0, 1), results
        )

    return jax.jit(sweep)


# ===== Appendix: running it at scale and reporting =====

# ruff: noqa: E402 (what only the appendix uses is imported here, so the reference copies alone)
import argparse
import contextlib
import csv
import ctypes
import fcntl
import json
import logging
import platform
import socket
import subprocess
import sys
import time
import warnings
import zlib
from collections import Counter
from importlib import metadata
from pathlib import Path, PurePosixPath

from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# --layout's maps; maze (shortest path 22 steps) and four_rooms (20) have walls.
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

# On a CPU, agents whose Q-tables fit in a core's L2 cache step fastest: beyond that, every
# step's gather and scatter misses the cache (measured: see README). A GPU takes all at once.
CPU_CHUNK_BYTES = 384 * 1024


def wait(tree):
    """jax.block_until_ready that keeps Python responsive meanwhile: a Ctrl-C or SIGTERM is
    handled within 0.1 s, not only when the compiled call returns."""
    for leaf in jax.tree.leaves(tree):
        while not leaf.is_ready():
            time.sleep(0.05)
    return tree


def seed_mesh(devices: list | None = None) -> Mesh:  # the seed axis is split across it
    return Mesh(np.array(devices if devices is not None else jax.devices()), ("seeds",))


def chunks_per_device(config: Config, env: GridWorld, mesh: Mesh) -> int:
    """How many groups of seeds (each with the whole grid) a device trains one after another:
    about agents_per_chunk agents each, cache-sized on a CPU when 0, one group on a GPU."""
    local_seeds = math.ceil(config.num_seeds / mesh.size)
    agents = config.agents_per_chunk
    if agents == 0 and mesh.devices.flat[0].platform == "cpu":
        agents = CPU_CHUNK_BYTES // (env.num_cells * NUM_ACTIONS * 4)  # float32 tables
    if agents == 0:
        return 1
    chunks = min(local_seeds, max(1, round(local_seeds * len(grid_points(config)) / agents)))
    return math.ceil(local_seeds / math.ceil(local_seeds / chunks))  # no chunk of padding only


def make_seed_keys(seed: int, num_seeds: int, mesh: Mesh, chunks: int = 1) -> jax.Array:
    """Keys [num_seeds padded to a multiple of devices x chunks], made inside jit, each device
    its own (also across hosts). Seed i's key is fold_in(key(seed), i) whatever the padding, so
    results do not depend on the device count; the padded seeds are dropped after training."""
    num_keys = math.ceil(num_seeds / (mesh.size * chunks)) * mesh.size * chunks

    @partial(jax.jit, out_shardings=NamedSharding(mesh, P("seeds")))
    def make_keys():
        return jax.vmap(partial(jax.random.fold_in, jax.random.key(seed)))(jnp.arange(num_keys))

    return make_keys()


def shard_sweep(sweep: Callable, mesh: Mesh, chunks: int = 1) -> Callable:
    """sweep(keys, grid) with the seeds split over the mesh: each device cuts its keys into
    `chunks` groups and runs sweep on one group after another (lax.map), the grid each time."""

    def device_sweep(keys: jax.Array, grid: HParams) -> TrainResult:
        results = lax.map(lambda k: sweep(k, grid), keys.reshape(chunks, -1))
        # [chunks, grid, seeds per chunk, ...] -> [grid, this device's seeds, ...]
        return jax.tree.map(
            lambda x: x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:]), results
        )

    # check_vma=False: train starts its scans from constants (a zero Q-table), which the
    # varying-across-devices type check would otherwise want cast per device by hand.
    specs = {"in_specs": (P("seeds"), P()), "out_specs": P(None, "seeds")}
    return jax.jit(jax.shard_map(device_sweep, mesh=mesh, **specs, check_vma=False))


def check_output_dir(output_dir: str) -> None:
    """ConfigError unless output_dir, or the nearest parent that exists, is a writable folder."""
    if not output_dir:  # "" would write into the current folder
        raise ConfigError("output_dir", "must name a folder, not be empty")
    try:  # a name the OS refuses (too long, say), or a current folder deleted, raises here
        output = Path(output_dir).absolute()
        existing = next(p for p in (output, *output.parents) if p.exists())  # "/" exists
    except OSError as error:
        raise ConfigError("output_dir", str(error)) from None
    if not existing.is_dir():
        raise ConfigError("output_dir", f"{str(existing)!r} exists and is not a directory")
    if not os.access(existing, os.W_OK):
        raise ConfigError("output_dir", f"{str(existing)!r} is not writable")


def validate(config: Config, plan: StepPlan) -> tuple[GridWorld, Path]:
    """The checks that need the map or JAX, before any write -> (env, folder made on process 0)."""
    try:
        env = make_env(config.layout, config.max_episode_steps)
    except LayoutError as error:
        raise ConfigError("layout", str(error)) from None
    # Two epsilons that explore_threshold rounds alike would train the same agents twice.
    thresholds = np.asarray(explore_threshold(jnp.float32(config.epsilons))).tolist()
    for k, threshold in enumerate(thresholds):
        if (i := thresholds.index(threshold)) != k:
            alike = f"{config.epsilons[i]!r} and {config.epsilons[k]!r} explore alike"
            raise ConfigError("epsilons", f"{alike} (epsilon acts in steps of 2^-16)")
    if jax.process_index() == 0:  # process 0 writes for the cluster: the others' is not used
        check_output_dir(config.output_dir)
    # Per agent, in 4-byte words, by the flag that drives each part: the Q-table thrice (scan
    # carry, loop buffer, output), a block of bits and its scan slices, the curve. Half is spare.
    per_agent_terms = {
        "layout": 3 * env.num_cells * NUM_ACTIONS,
        "rng_block_steps": 2 * plan.block_steps,
        "num_curve_points": plan.num_points * len(Curve._fields),
    }
    per_agent = sum(per_agent_terms.values())
    grid = len(config.gammas) * len(config.learning_rates) * len(config.epsilons)  # not built yet
    padded_seeds = math.ceil(config.num_seeds / jax.device_count()) * jax.device_count()
    needed = 4 * per_agent * padded_seeds * grid * jax.local_device_count() / jax.device_count()
    stats = [device.memory_stats() or {} for device in jax.local_devices()]  # this host's
    if jax.default_backend() != "cpu" and all("bytes_limit" in s for s in stats):
        limit = sum(s["bytes_limit"] for s in stats) / 2
    else:  # RAM, or a cgroup's limit (a container's, a Slurm job's --mem: past it, a silent kill)
        limit = min(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), cgroup_limit()) / 2
    if 4 * per_agent > limit:  # one agent alone: name the flag of its largest part
        largest = max(per_agent_terms, key=per_agent_terms.get)
        raise ConfigError(largest, f"one agent needs about {4 * per_agent / 1e9:.1f} GB, more "
                          f"than {limit / 1e9:.1f} GB (half the memory)")  # fmt: skip
    if needed > limit:
        raise ConfigError(
            "num_seeds",
            f"{config.num_seeds} seeds x {grid} grid points need about {needed / 1e9:.1f} GB, "
            f"more than {limit / 1e9:.1f} GB (half the memory); use fewer seeds or a smaller grid",
        )
    try:  # last of the checks, so a refused run writes nothing, and before any training
        if jax.process_index() == 0:  # process 0 writes for the cluster
            return env, make_folder(config.output_dir)
    except OSError as error:
        raise ConfigError("output_dir", f"cannot create {config.output_dir!r}: {error}") from None
    return env, Path(config.output_dir)


CGROUP_LIMITS = {"": "memory.max", "memory": "memory.limit_in_bytes"}  # cgroup v2, v1


def cgroup_limit(proc=Path("/proc/self/cgroup"), root=Path("/sys/fs/cgroup")) -> float:
    """The tightest memory limit, in bytes, of the cgroups (v2 or v1) holding this process and
    of their parents; inf where none is set ("max", no such files, not Linux)."""
    try:
        lines = proc.read_text().splitlines()  # "id:controllers:/path", v2's controllers ""
    except OSError:  # not Linux
        return math.inf
    limit = math.inf
    for _, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        for name in {"", "memory"} & set(controllers.split(",")):
            for folder in (PurePosixPath(path), *PurePosixPath(path).parents):
                limit_file = root / name / str(folder).lstrip("/") / CGROUP_LIMITS[name]
                with contextlib.suppress(OSError, ValueError):  # no such file; "max"
                    limit = min(limit, int(limit_file.read_text()))
    return limit


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def run_sweep(config, env, plan, mesh, chunks) -> tuple[TrainResult, dict]:
    """Compile and run make_sweep over the mesh -> (numpy [grid, seeds, ...], timings)."""
    num_agents = len(grid_points(config)) * config.num_seeds
    # on_point: per device (this process's), chunk and point, on a device's thread (or on a GPU,
    # the main thread): next() is atomic, a line is one write.
    local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    total_calls = local_devices * chunks * plan.num_points
    calls, clock = itertools.count(1), {"start": 0.0}

    def on_point(_) -> None:
        call = next(calls)
        if call % max(1, total_calls // 10) == 0 or call == total_calls:
            seconds = time.perf_counter() - clock["start"]
            done = call / total_calls
            rate = num_agents * config.total_timesteps * done / seconds
            eta = seconds / done - seconds
            # Plain lines, no carriage return: they read the same in a terminal and a log file.
            print(f"  {done:4.0%}  train {seconds:6.2f} s  {rate / 1e6:.1f}M agent-steps/s  "
                  f"ETA {eta:.1f} s\n", end="", flush=True)  # fmt: skip

    sweep = shard_sweep(make_sweep(make_train(config, env, plan, on_point)), mesh, chunks)
    keys = make_seed_keys(config.seed, config.num_seeds, mesh, chunks)
    grid = hparam_grid(config)
    start = time.perf_counter()
    compiled = sweep.lower(keys, grid).compile()
    stop_if_received()
    compile_time = time.perf_counter() - start
    start = clock["start"] = time.perf_counter()
    try:
        result = wait(compiled(keys, grid))
        train_time = time.perf_counter() - start  # the compiled training call alone
        # Every agent's result on every process, also the shards other processes computed.
        result = multihost_utils.process_allgather(result, tiled=True)
    except (jax.errors.JaxRuntimeError, ValueError) as error:
        stop_if_received()  # handled inside on_point, a signal ends the call with this error
        if jax.process_count() == 1:  # its own error (out of memory, say), not a cluster's
            raise
        fail(f"another process of the cluster stopped ({str(error).splitlines()[0][:160]})", 1)
    timings = {
        "compile_time_s": compile_time,
        "train_time_s": train_time,
        "seeds_padded_to": int(keys.shape[0]),  # a multiple of devices x chunks
    }
    return jax.tree.map(lambda x: np.asarray(x)[:, : config.num_seeds], result), timings


# ----- Reporting: summary.json (checked against value iteration), heatmap, curves -----------

Z_95 = 1.96  # normal approximation of a 95% confidence interval of a mean


def value_iteration(env: GridWorld, gamma: float) -> np.ndarray:
    """Q*[cells, actions]: Q*(s, a) = r + gamma * max Q*(s', .), with G terminal. With
    deterministic moves and a reward only on entering G, iteration k moves values of gamma^k at
    most: stopped below 1e-12 (a long corridor would take a pass per cell)."""
    entered_goal = env.next_cell == env.goal
    q = np.zeros(env.next_cell.shape)
    for _ in range(env.num_cells + 1):  # longest possible shortest path, + 1 to confirm
        new_q = entered_goal + gamma * np.where(entered_goal, 0.0, q.max(axis=1)[env.next_cell])
        if np.abs(new_q - q).max() < 1e-12:
            return new_q
        q = new_q
    return q


def mean_ci(values: np.ndarray) -> dict:
    """Mean and 95% CI across seeds (axis 0); the CI is null for a single seed."""
    values = np.asarray(values, np.float64)
    mean = values.mean()
    if len(values) < 2:
        return {"mean": float(mean), "ci95": None}
    half = Z_95 * values.std(ddof=1) / math.sqrt(len(values))
    return {"mean": float(mean), "ci95": [float(mean - half), float(mean + half)]}


def share_ci(hits: np.ndarray) -> dict:
    """Share of the seeds (True) and its 95% Wilson score interval (Wilson 1927): unlike the
    mean's normal interval it stays inside [0, 1] and is not zero-wide at 0% or 100%."""
    n, p, shrink = len(hits), float(np.mean(hits)), 1 + Z_95**2 / len(hits)
    center = (p + Z_95**2 / (2 * n)) / shrink
    half = Z_95 * math.sqrt(p * (1 - p) / n + Z_95**2 / (4 * n**2)) / shrink
    return {"mean": p, "ci95": [max(0.0, center - half), min(1.0, center + half)]}


XLA_FLAGS = os.environ.get("XLA_FLAGS")  # as this script, imported, set them for JAX


def jax_settings() -> dict:
    """What else gives a run other bits: XLA's flags as JAX started with them (unless it had
    started before this script was imported), and JAX's switches of that kind."""
    names = ("jax_enable_x64", "jax_threefry_partitionable", "jax_default_matmul_precision")
    return {"XLA_FLAGS": XLA_FLAGS} | {name: getattr(jax.config, name) for name in names}


def versions() -> dict:
    packages = ("jax", "jaxlib", "numpy", "matplotlib")
    return {"python": platform.python_version()} | {p: metadata.version(p) for p in packages}


def heatmap_measures(paths: np.ndarray, shortest: int, weights: np.ndarray) -> dict:
    """HEATMAP_MEASURES of a grid point from its greedy path lengths [seeds, points], weighted."""
    on_path = paths == shortest
    return {
        "greedy_path_optimal_fraction": share_ci(on_path[:, -1]),
        "optimal_time_share": mean_ci(np.average(on_path, 1, weights)),
    }


def summarize_grid(config: Config, env: GridWorld, plan: StepPlan, result: TrainResult):
    """Per grid point: final greedy path vs shortest, V(S) vs value iteration, episodes, and
    the share of training steps whose curve point has an optimal greedy path (how fast, not
    only where to; a shorter last point weighs less)."""
    exact = {gamma: float(value_iteration(env, gamma)[env.start].max()) for gamma in config.gammas}
    weights = np.diff(curve_steps(config, plan), prepend=0)  # steps each point stands for
    rows = []
    for g, point in enumerate(grid_points(config)):
        paths = np.asarray(result.curve.greedy_path_length[g])  # [seeds, points]
        start_value = np.asarray(result.curve.start_value[g, :, -1])  # [seeds]
        rows.append(
            {
                **point._asdict(),
                "shortest_path": env.shortest_path,
                "greedy_path_length": mean_ci(paths[:, -1]),
                **heatmap_measures(paths, env.shortest_path, weights),
                "value_iteration_start_value": exact[point.gamma],
                "start_value_abs_error": mean_ci(np.abs(start_value - exact[point.gamma])),
                "episodes_completed": mean_ci(np.asarray(result.curve.episodes[g]).sum(axis=1)),
            }
        )
    return rows


HEATMAP_MEASURES = {
    "greedy_path_optimal_fraction": "share of seeds on a shortest path at the end",
    "optimal_time_share": "share of training on a shortest path (mean over seeds)",
}
RUN_FILES = ("summary.json", "curves.csv", "q_tables.npy")
CURVE_COLUMNS = (*HParams._fields, "seed", "step", "greedy_path_length")  # what --replot reads
RUN_NAMES = (*RUN_FILES, "sweep_heatmap.png", "learning_curves.png")  # all a run writes
SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", together: list | None = None):
    """Write to a temporary name beside path, then rename: no reader sees half a file. Given
    `together`, the rename waits for rename_all(together): the files appear all or none. A write
    that fails (a full disk, say) ends the script with one line; no temporary file stays."""
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
    """Each file written under its temporary name (atomic_open's `together`) to its own; a name a
    folder holds is one line before any is renamed, so no mix of old and new files is left."""
    if taken := [path for path in paths if path.is_dir()]:
        for path in paths:
            temporary(path).unlink(missing_ok=True)
        fail(f"cannot write {taken[0]} (a folder has its name)", status=1)
    for path in paths:
        os.replace(temporary(path), path)


def temporary(path: Path, kind: str = "tmp") -> Path:
    """Where a file is written before it is renamed to `path` ("old": where --overwrite keeps
    the previous run's file meanwhile). The suffix last: a writer may pick the format by it."""
    return path.with_name(f".{path.stem}.{kind}{path.suffix}")


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
def written_whole(what: str = "the run"):
    """A run's files (or `what`) are written whole: a signal that comes meanwhile waits, then
    ends the script, as does one whose exception was dropped earlier (RECEIVED)."""
    with signals_held() as caught:
        yield
    if caught := RECEIVED + caught:  # RECEIVED: stop() took one, yet its exception was dropped
        message = f"stopped by {SIGNALS[caught[0]]} once {what} was written whole"
        print(f"parallel_q_learning.py: {message}", file=sys.stderr)  # asked for: not an "error:"
        sys.exit(128 + caught[0])


def catchable() -> list[int]:
    """SIGNALS but those ignored (nohup's SIGHUP), which stay ignored."""
    return [signum for signum in SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]


def curve_steps(config: Config, plan: StepPlan) -> np.ndarray:
    """The step at which each curve point is measured; the last point may be shorter."""
    point_steps = plan.blocks_per_point * plan.block_steps
    return np.minimum(np.arange(1, plan.num_points + 1) * point_steps, config.total_timesteps)


def save_run(
    output: Path, summary: dict, config: Config, plan: StepPlan, result: TrainResult
) -> None:
    """RUN_FILES, all three or none: the summary; curves.csv, one row per grid point x seed x
    curve point; the final Q-tables [grid, seeds, rows, cols, actions]. The figures use these."""
    written = []  # renamed together once all are written
    with atomic_open(output / "summary.json", together=written) as file:
        json.dump(summary, file, indent=2, allow_nan=False)  # strict JSON: no NaN in it
    grid = np.array(grid_points(config))  # [grid, learning_rate epsilon gamma]
    seeds = np.arange(config.num_seeds)[:, None]
    columns = {name: grid[:, None, None, i] for i, name in enumerate(HParams._fields)}
    columns |= {"seed": seeds, "step": curve_steps(config, plan)}
    columns |= result.curve._asdict()  # [grid, seeds, points] each
    # [grid * seeds, points] each, written an agent at a time: Python floats for all of them at
    # once took ~40x numpy's memory.
    arrays = [x.reshape(-1, x.shape[-1]) for x in np.broadcast_arrays(*columns.values())]
    with atomic_open(output / "curves.csv", together=written) as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(columns)
        for agent in range(len(arrays[0])):
            writer.writerows(zip(*(x[agent].tolist() for x in arrays), strict=True))
    with atomic_open(output / "q_tables.npy", "wb", together=written) as file:
        np.save(file, np.asarray(result.q_table, np.float32))
    rename_all(written)


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


def saved_config(saved: dict) -> Config:
    """The Config of a run's summary.json. A setting it lacks (its default may not be the
    run's), or a value of another type than its default's (hand-edited: 2.5 seeds), is a
    ValueError; JSON keeps a tuple as a list, and may keep a float as an int."""
    defaults = {field.name: field.default for field in dataclasses.fields(Config)}
    for name, value in saved.items():
        if name not in defaults:  # a DQN run's "buffer_size", say
            raise ValueError(f"its config has {name!r}, not a setting of parallel_q_learning.py")
        default = defaults[name]  # an int may stand for a float; a bool stands for nothing else
        if isinstance(default, tuple):  # learning_rates: a list of numbers
            ok = type(value) is list and all(type(item) in (int, float) for item in value)
        else:
            ok = type(value) is type(default) or (type(default), type(value)) == (float, int)
        if not ok:
            raise ValueError(f"{name} {value!r} is not of the type of its default, {default!r}")
    if missing := [name for name in defaults if name not in saved]:
        raise ValueError(f"its config lacks {missing[0]!r}")
    return Config(**{name: tuple(v) if type(v) is list else v for name, v in saved.items()})


def plot_run(output: Path) -> None:
    """sweep_heatmap.png and learning_curves.png, drawn from the saved files alone."""
    with reading(output / "summary.json") as path:  # its config, and its grid that follows it
        summary = json.loads(path.read_text())
        if "grid" not in summary:  # the gridworld's, say
            raise ValueError("not a run of parallel_q_learning.py (it holds no grid)")
        config = saved_config(summary["config"])
        points = [tuple(row[name] for name in HParams._fields) for row in summary["grid"]]
        if points != [tuple(point) for point in grid_points(config)]:  # the heatmap's order
            raise ValueError("its grid is not its config's gammas x learning rates x epsilons")
        shape = (len(points), config.num_seeds, -1)  # curves.csv's [grid, seeds, points]
        env = make_env(config.layout)
    # Parsed by numpy (a dict per row took ~750 bytes); no rows: our line, not numpy's warning.
    path = output / "curves.csv"
    # utf-8-sig: a byte-order mark (a spreadsheet's save) is no part of the first column's name
    with (
        reading(path),
        open(path, encoding="utf-8-sig") as file,
        warnings.catch_warnings(action="ignore"),
    ):
        names = file.readline().strip().split(",")
        values = np.loadtxt(file, delimiter=",", ndmin=2)
        if not values.size:
            raise ValueError("it holds no rows")
        if missing := [name for name in CURVE_COLUMNS if name not in names]:
            raise ValueError(f"it has no column {missing[0]!r}")
        if twice := [name for name in names if names.count(name) > 1]:  # the last one was drawn
            raise ValueError(f"its header names {twice[0]!r} twice")
        if len(names) != values.shape[1]:
            raise ValueError(f"its header names {len(names)} columns, its rows {values.shape[1]}")
        curves = {name: values[:, i].reshape(shape) for i, name in enumerate(names)}
        grid = np.array(points)  # [grid, learning_rate epsilon gamma], as save_run writes it
        rows = {name: grid[:, None, None, i] for i, name in enumerate(HParams._fields)}
        steps = curve_steps(config, make_step_plan(config))  # the config's, as save_run wrote
        rows |= {"seed": np.arange(config.num_seeds)[:, None], "step": steps}
        if curves["step"].shape[-1] != len(steps) or any(
            (curves[name] != value).any() for name, value in rows.items()
        ):
            raise ValueError("its rows are not the summary's grid x seeds, each at its steps")
        lengths = curves["greedy_path_length"]  # steps, or num_cells: S never reaches G
        whole = (lengths >= env.shortest_path) & (lengths <= env.num_cells) & (lengths % 1 == 0)
        if not whole.all():  # NaN too; 1e308 overflowed; below the shortest path, drawn under it
            raise ValueError(
                f"its greedy_path_length holds a value that is not a whole number from the "
                f"shortest path, {env.shortest_path}, to {env.num_cells}"
            )
    with reading(output / "q_tables.npy") as path:  # its header: the figures draw no table
        tables = np.lib.format.open_memmap(path, mode="r")
        expected = (len(points), config.num_seeds, env.rows, env.cols, NUM_ACTIONS)
        if tables.shape != expected or tables.dtype.kind != "f":
            raise ValueError(
                f"it holds {tables.dtype} {tables.shape}; the summary: float {expected}"
            )
    with reading(output / "summary.json"):  # the figures read the rest of it
        if summary["steps_per_agent"] != config.total_timesteps:
            raise ValueError(f"its steps_per_agent is not its config's {config.total_timesteps}")
        weights = np.diff(steps, prepend=0)
        for row, paths in zip(summary["grid"], curves["greedy_path_length"], strict=True):
            if row["shortest_path"] != env.shortest_path:
                raise ValueError(f"a shortest_path is not its map's {env.shortest_path}")
            for name, want in heatmap_measures(paths, env.shortest_path, weights).items():
                saved = [row[name]["mean"], *(row[name]["ci95"] or [])]
                if not np.allclose(saved, [want["mean"], *(want["ci95"] or [])], 1e-9, 1e-12):
                    raise ValueError(f"its {name} is not curves.csv's (the heatmap draws it)")
        heatmap, learning = plot_heatmap(summary), plot_curves(summary, curves, env.num_cells)
    written = []  # both figures or neither (one that failed left the other redrawn)
    save_figure(heatmap, output / "sweep_heatmap.png", written)
    save_figure(learning, output / "learning_curves.png", written)
    rename_all(written)


def save_figure(fig, path: Path, together: list | None = None) -> None:
    import matplotlib.pyplot as plt

    with atomic_open(path, "wb", together=together) as file:
        fig.savefig(file, format="png", dpi=120)
    plt.close(fig)


def apart(values) -> dict[float, str]:
    """Each value as text, with the digits that tell it from the others (6 at least, as `:g`):
    gamma 0.999999 and 0.9999991 are two grid points, and showed as one."""
    values = set(values)
    digits = next(d for d in range(6, 18) if len({f"{v:.{d}g}" for v in values}) == len(values))
    return {value: f"{value:.{digits}g}" for value in values}


def ticks(values: list[float], most: int) -> tuple[range, list[str]]:
    """Positions and labels of at most `most` ticks over an axis of `values`."""
    step, texts = -(-len(values) // most), apart(values)
    return range(0, len(values), step), [texts[value] for value in values[::step]]


MOST_PANELS = 8  # gammas drawn side by side, in each figure


def shown_gammas(count: int) -> list[int]:
    """The indices of the gammas a figure draws: all, or MOST_PANELS spread evenly over them,
    the first and last among them (a panel each for 400 gammas took minutes to draw)."""
    return sorted({round(i) for i in np.linspace(0, count - 1, min(count, MOST_PANELS))})


def of_all(shown: list[int], gammas: list[float]) -> str:
    """What a figure's title adds when it leaves gammas out."""
    return "" if len(shown) == len(gammas) else f"; {len(shown)} of the {len(gammas)} gammas"


def plot_heatmap(summary: dict):
    """Quality over learning rate x epsilon: a column of panels per gamma drawn, a row per measure
    (each colour scale spans its row); a small grid's cells give their mean and 95% CI."""
    import matplotlib.pyplot as plt

    lrs, epsilons, gammas = (summary["config"][k] for k in ("learning_rates", "epsilons", "gammas"))
    titles, shown = apart(gammas), shown_gammas(len(gammas))
    annotated = len(epsilons) <= 6 and len(lrs) <= 10  # more cells: their texts would overlap
    fig, axes = plt.subplots(len(HEATMAP_MEASURES), len(shown), squeeze=False)
    fig.set_layout_engine("constrained")
    fig.set_size_inches(2.5 + 3.6 * len(shown), 7.2)
    one_seed = summary["config"]["num_seeds"] == 1  # no CI: a cell shows the seed's value
    cells = "cells: the seed's value" if one_seed else "cells: mean [95% CI]"
    fig.suptitle(
        f"{plural(summary['config']['num_seeds'], 'seed')} per cell, "
        f"{summary['steps_per_agent']:,} steps per agent; "
        + (cells if annotated else "colour: the mean over seeds")
        + of_all(shown, gammas)
    )
    for m, (measure, label) in enumerate(HEATMAP_MEASURES.items()):
        stats = [row[measure] for row in summary["grid"]]  # grid order: gamma slowest
        means = np.reshape([s["mean"] for s in stats], (len(gammas), len(lrs), len(epsilons)))
        cis = np.reshape([s["ci95"] or [np.nan] * 2 for s in stats], (*means.shape, 2))
        drawn = means[shown]  # the scale spans the gammas drawn
        low, high = drawn.min(), max(drawn.max(), drawn.min() + 0.01)  # one value: not 0 wide
        for ax, g in zip(axes[m], shown, strict=True):
            gamma, panel, ci = gammas[g], means[g], cis[g]
            image = ax.imshow(panel, vmin=low, vmax=high, cmap="viridis", origin="lower")
            if annotated:
                for (i, j), value in np.ndenumerate(panel):
                    color = "w" if value < (low + high) / 2 else "k"
                    low_ci, high_ci = np.clip(ci[i, j], 0, 1)  # both measures are shares
                    text = f"{value:.2f}" + ("" if one_seed else f"\n[{low_ci:.2f}, {high_ci:.2f}]")
                    ax.text(j, i, text, ha="center", va="center", color=color, fontsize=8)
            ax.set_xticks(*ticks(epsilons, most=6))
            ax.set_yticks(*ticks(lrs, most=10))
            ax.set(xlabel="epsilon", ylabel="learning rate", title=f"gamma = {titles[gamma]}")
        fig.colorbar(image, ax=axes[m].tolist(), label=label.replace(" (", "\n("))
    return fig


def plot_curves(summary: dict, curves: dict, num_cells: int):
    """Greedy path length during training, mean and 95% CI band across seeds, per grid point of
    the gammas drawn (num_cells: the length of a path that never reaches G)."""
    import matplotlib.pyplot as plt

    config = summary["config"]
    steps, lengths = curves["step"][0, 0], curves["greedy_path_length"]  # [grid, seeds, points]
    num_seeds, mean = lengths.shape[1], lengths.mean(axis=1)  # [grid, points]
    half = np.zeros_like(mean)
    if num_seeds > 1:
        half = Z_95 * lengths.std(axis=1, ddof=1) / math.sqrt(num_seeds)
    gammas = config["gammas"]
    texts = {name: apart(config[f"{name}s"]) for name in ("learning_rate", "epsilon", "gamma")}
    per_panel = len(summary["grid"]) // len(gammas)  # lines
    crowded = per_panel >= 9  # the legend goes below; beyond 30 lines it names none of them
    shown = shown_gammas(len(gammas))
    size = (2 + 4.5 * len(shown), 5.5 if crowded else 4)
    fig, axes = plt.subplots(1, len(shown), figsize=size, squeeze=False, layout="constrained")
    fig.suptitle(
        f"greedy path length from S: mean, 95% CI band over {plural(num_seeds, 'seed')}\n"
        f"(a path that never reaches G is drawn at the cell count, {num_cells})"
        + of_all(shown, gammas)
    )
    panels = {gammas[g]: ax for g, ax in zip(shown, axes[0], strict=True)}
    for g, row in enumerate(summary["grid"]):
        if row["gamma"] not in panels:
            continue
        ax = panels[row["gamma"]]
        lr, epsilon = texts["learning_rate"][row["learning_rate"]], texts["epsilon"][row["epsilon"]]
        label = f"lr {lr}, epsilon {epsilon}" if per_panel <= 30 else None
        ax.plot(steps, mean[g], label=label)
        ax.fill_between(steps, mean[g] - half[g], mean[g] + half[g], alpha=0.2)
    for gamma, ax in panels.items():
        shortest = summary["grid"][0]["shortest_path"]
        ax.axhline(shortest, color="k", ls="--", lw=1, label=f"shortest path ({shortest})")
        title = f"gamma = {texts['gamma'][gamma]}"
        ax.set(xlabel="steps per agent", ylabel="greedy path length", title=title)
        ax.set_xscale("log")  # the greedy path settles in the first tenth: log spreads it out
        where = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.2), "ncol": 2} if crowded else {}
        ax.legend(fontsize=7, **where)
    return fig


# ----- Command line --------------------------------------------------------------------------


# A message's control characters (a newline in a folder's name) shown escaped: still one line.
ESCAPED = {code: repr(chr(code))[1:-1] for code in (*range(32), 127)}


def fail(message: str, status: int = 2):  # one line, no traceback
    print(f"parallel_q_learning.py: error: {message.translate(ESCAPED)}", file=sys.stderr)
    raise SystemExit(status)


def parse_float_list(text: str) -> tuple[float, ...]:
    """'0.05,0.1,0.5' -> (0.05, 0.1, 0.5); an empty or malformed item is an error."""
    try:
        values = tuple(float(item) for item in text.split(","))  # float("") fails too
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers like 0.05,0.1: {text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"values must be finite: {text!r}")
    return values


# Larger is not a map anyone draws by hand, and parsing it in Python would take minutes.
MAX_MAP_BYTES = 256 * 1024  # about 500 x 500 cells


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


def parse_config(argv: list[str] | None = None) -> tuple[Config | Path, dict]:
    """Config from the command line: one --flag per field, its help and default shown; or,
    with --replot DIR, the saved run whose figures to redraw. Also the cluster flags, overwrite."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.error = fail  # argparse's usage + error is two lines; one is enough
    for field in dataclasses.fields(Config):
        # Defaults as typed: argparse converts a string default like a typed value.
        default, convert, text = field.default, field.type, field.metadata["help"]
        if field.type == tuple[float, ...]:
            default, convert = ",".join(f"{x:g}" for x in default), parse_float_list
        elif field.name == "layout":  # left out: the Config's map, not a file named "default"
            default, convert, text = argparse.SUPPRESS, read_layout, f"{text} (default: default)"
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=convert, default=default, help=text)
    replot = {"metavar": "DIR", "default": argparse.SUPPRESS}  # no "(default: ...)"
    parser.add_argument("--replot", **replot, help="redraw the figures of a saved run; no training")
    cluster = parser.add_argument_group("several processes, one JAX cluster (see README)")
    cluster.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address")
    cluster.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    cluster.add_argument("--process-id", type=int, metavar="I", help="this process, 0 to N-1")
    timeout_help = "seconds to wait for the cluster to form, or for a silent process"
    cluster.add_argument("--cluster-timeout", type=float, default=60.0, help=timeout_help)
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
        return Path(args["replot"]), {}
    cluster_flags = ("coordinator_address", "num_processes", "process_id", "cluster_timeout")
    cluster = {name: args.pop(name) for name in cluster_flags}
    cluster["overwrite"] = args.pop("overwrite")  # main checks the folder on process 0 only
    try:
        return Config(**args), cluster
    except ValueError as error:
        fail(str(error))


def run_folder(template: str, overwrite: bool) -> str:
    """The run's folder, checked (a `{time}` name is new: make_folder picks it). A folder named
    outright that holds files is refused, unless --overwrite, which replaces a run's files there
    (see replacing) but refuses anything else. ValueError('--flag ...')."""
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
    ours = {*RUN_NAMES, *(temporary(Path(n), k).name for n in RUN_NAMES for k in ("tmp", "old"))}
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


LOCKED = {}  # folder -> the descriptor whose lock this process holds until it ends
MADE = {}  # folder -> the folders make_folder made for it: itself if new, parents nearest first
FOUND_EMPTY = {}  # folder named outright -> run_folder found it empty (or not there yet)


def make_folder(folder: str) -> Path:
    """Make the run's folder and lock it. `{time}` becomes the start time, then _2, _3 while
    another run holds that name (mkdir is atomic). A folder named outright is an OSError if a
    running run has locked it, or if a run that has ended wrote there since run_folder looked."""
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


@contextlib.contextmanager
def replacing(folder: Path):
    """Writes a run over a previous run's files (--overwrite), and nothing else: a file put there
    meanwhile stays. The previous files, renamed aside (no space needed), stay until the new
    run is written whole; if a write fails (a full disk, say), they are put back as they were."""
    paths, moved, started = [folder / name for name in RUN_NAMES], [], False
    try:
        for path in paths:  # first what a write cut short (a crash) left
            temporary(path).unlink(missing_ok=True)
            temporary(path, "old").unlink(missing_ok=True)
            if path.exists():
                os.replace(path, temporary(path, "old"))
                moved.append(path)
        started = True
        yield
    except BaseException as error:  # the old files come back (all, or those set aside till then)
        stuck = path  # if not started: the file that would not move (immutable, another user's)
        for path in paths if started else moved:
            path.unlink(missing_ok=True)  # the new run's
            if temporary(path, "old").exists():
                os.replace(temporary(path, "old"), path)
        remove_if_empty(folder)  # made for this run, which wrote its files, then failed
        if isinstance(error, OSError) and not started:
            reason, stuck = error.strerror or error, error.filename or stuck  # as the OS names it
            fail(f"--overwrite: cannot set {stuck} aside ({reason}); the run there stays as it "
                 "was, and this one is not written", status=1)  # fmt: skip
        raise
    for path in paths:
        temporary(path, "old").unlink(missing_ok=True)


def check_backend() -> None:
    """One line, before any work, for a JAX_PLATFORMS or XLA_FLAGS that leaves JAX no device
    (else a traceback at its first use), or JAX_DISABLE_JIT (a run of hours). That first use
    loads JAX's plugins, and JAX drops what one raises, a signal's exception too: it waits."""
    if jax.config.jax_disable_jit:  # JAX_DISABLE_JIT=1, or main() under jax.disable_jit()
        fail(
            "JAX_DISABLE_JIT: the command line runs compiled only; to step through train(), call "
            "it from Python under jax.disable_jit() (README: Debugging)"
        )
    with signals_held() as caught:
        try:
            jax.devices()
        except Exception as error:  # a RuntimeError, or an AssertionError for a missing cuda
            detail = (str(error) or "JAX could start no platform").splitlines()[0][:200]
            # A cluster's wait for every process's list of devices, timed out:
            if jax.distributed.is_initialized() and "topolog" in detail:
                detail = detail.partition(" (you may need to uninstall")[0]  # JAX's plugin hint
                fail(f"another process of the cluster stopped ({detail})", 1)
            given = [f"{name}={os.environ[name]!r}" for name in ("JAX_PLATFORMS", "XLA_FLAGS") if
                     os.environ.get(name)]  # fmt: skip
            if not given:  # neither: JAX's own error, as it is
                raise
            fail(f"{', '.join(given)}: no JAX backend ({detail})")
    if caught:  # now to the handler in place again, which stops the run as anywhere else
        signal.raise_signal(caught[0])


def remove_if_empty(folder: Path) -> None:
    """Removes a stopped run's folder and the parents made for it if empty, not one made before."""
    try:  # a loop of symbolic links never resolves: nothing was made for it
        made = MADE.get(folder.resolve(), [])
    except (OSError, RuntimeError):
        return
    for path in made:
        with contextlib.suppress(OSError):  # rmdir removes only an empty folder
            path.rmdir()


KNOCK = "jax-cluster-knock"  # what a process sends process 0's probe: then its id and count


def read_knock(connection: socket.socket) -> tuple[int, int] | None:
    """(process id, --num-processes) that a knock on the probe sends within a second, or None
    for any other connection (the JAX client of a process that has knocked, say)."""
    line, end = b"", time.monotonic() + 1  # a second in all, however slowly the bytes come
    with connection, contextlib.suppress(OSError):  # OSError: said nothing more in the second
        while b"\n" not in line and len(line) < 100 and time.monotonic() < end:
            connection.settimeout(max(end - time.monotonic(), 1e-3))
            if not (more := connection.recv(100)):
                break
            line += more
    words = line.partition(b"\n")[0].decode(errors="replace").split()
    numbers = words[1:] if len(words) == 3 and words[0] == KNOCK else []
    if not numbers or not all(n.isascii() and n.isdigit() for n in numbers):
        return None
    return int(numbers[0]), int(numbers[1])


def check_coordinator(address: str, process_id: int, num_processes: int, timeout: float) -> None:
    """One-line errors for a cluster that cannot form: JAX would abort with a C++ trace. Process 0
    must be able to listen on the port; the others knock there, waiting up to `timeout` s for it
    to listen, and it waits as long for all of them to knock before JAX's coordinator starts."""
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 2**16:
        fail(f"--coordinator-address {address!r}: expected HOST:PORT, a port from 1 to 65535")
    if ":" in host:  # JAX's client aborts on an IPv6 address, and the probe below is IPv4
        fail(f"--coordinator-address {address}: IPv6; give a host name or IPv4")
    try:  # JAX's client would abort
        socket.getaddrinfo(host, int(port))
    except OSError as error:
        fail(f"--coordinator-address {address}: cannot resolve {host!r} ({error})")
    deadline = time.monotonic() + timeout
    if process_id == 0:
        with socket.socket() as probe:
            # As the coordinator will: a port that a run just ended on (TIME_WAIT) is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", int(port)))
            except OSError as error:
                fail(f"--coordinator-address {address}: cannot listen ({error})")
            probe.listen()
            # Processes counted by the id they knock with, not by connections: the JAX client
            # of a process that has knocked may connect here too, and is no other process.
            knocked = set()
            while len(knocked) < num_processes - 1:
                probe.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    knock = read_knock(probe.accept()[0])
                except OSError:  # the time-out
                    fail(
                        f"--coordinator-address {address}: {len(knocked)} of the "
                        f"{num_processes - 1} other processes came within {timeout:g} s "
                        "(--cluster-timeout); are they all running?"
                    )
                if knock is None or not 0 < knock[0] < knock[1]:  # not a process's knock
                    continue
                who, count = knock
                if count != num_processes:  # JAX would start without the processes beyond
                    fail("--num-processes differs between the processes; give all the same")
                if who in knocked:
                    fail(f"--process-id {who} was given to two processes")
                knocked.add(who)
        return
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1) as knock:
                knock.sendall(f"{KNOCK} {process_id} {num_processes}\n".encode())
            return
        except OSError:
            if time.monotonic() > deadline:
                fail(
                    f"--coordinator-address {address}: nobody answered within {timeout:g} s "
                    "(--cluster-timeout); is process 0 running?"
                )
            time.sleep(0.2)


def join_cluster(coordinator_address, num_processes, process_id, cluster_timeout) -> None:
    """Make the processes of a run one JAX cluster, before anything touches a device: from the
    flags, or without them by JAX's own detection in a SLURM or Open MPI job of several tasks.
    Processes other than 0 print nothing to stdout and write nothing."""
    flags = (coordinator_address, num_processes, process_id)
    if not 1 <= cluster_timeout < 2**31:  # False for NaN; JAX takes int32 seconds
        fail(f"--cluster-timeout must be in [1, 2^31) seconds, got {cluster_timeout}")
    seconds = int(cluster_timeout)
    timeouts = {"initialization_timeout": seconds, "heartbeat_timeout_seconds": seconds}

    def recover():
        """A process that dies is an error where the others next wait for it, not an abort with a
        C++ trace in each; a wait for the device lists is --cluster-timeout (JAX's: 2 and 5 min)."""
        jax.config.update("jax_enable_recoverability", True)
        minutes = math.ceil(cluster_timeout / 60)  # JAX counts these in whole minutes
        jax.config.update("jax_cpu_get_local_topology_timeout_minutes", minutes)
        jax.config.update("jax_cpu_get_global_topology_timeout_minutes", minutes + 1)

    if all(value is None for value in flags):
        names = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
        tasks = [f"{name}={os.environ[name]}" for name in names if os.environ.get(name, "1") != "1"]
        if tasks:
            recover()
            try:
                jax.distributed.initialize(**timeouts)
            except ValueError as error:  # the job's other variables are missing
                fail(
                    f"{tasks[0]}, but JAX finds no cluster to join ({error}); give "
                    "--coordinator-address, --num-processes and --process-id"
                )
    elif any(value is None for value in flags):
        fail("--coordinator-address, --num-processes and --process-id go together")
    else:
        if not 1 <= num_processes < 2**31:  # what JAX's cluster service takes
            fail(f"--num-processes must be in [1, 2^31), got {num_processes}")
        if not 0 <= process_id < num_processes:
            fail(f"--process-id must be in [0, --num-processes), got {process_id}")
        check_coordinator(coordinator_address, process_id, num_processes, cluster_timeout)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes gather
        recover()
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)
    check_backend()
    if jax.process_index() > 0:  # process 0 reports and writes for the whole cluster
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115


def check_same_flags(config: Config) -> None:
    """One line naming a flag whose value differs between the processes of a cluster (each would
    train its share with its own value), or their numbers of devices (the gather needs equal)."""
    devices = Counter(device.process_index for device in jax.devices())  # of each process
    if len(set(devices.values())) > 1:
        coordinator_ends_last()  # whose sync fails at once too: what stays is process 0's wait
        counts = ", ".join(f"{devices[i]} on process {i}" for i in sorted(devices))
        fail(f"the processes have other numbers of devices ({counts}); give all the same")
    values = {name: v for name, v in dataclasses.asdict(config).items() if name != "output_dir"}
    digests = np.array([[zlib.crc32(repr(v).encode()) for v in values.values()]], np.uint32)
    try:
        with gloo_quiet():  # the cluster's first gather: gloo connects
            every = multihost_utils.process_allgather(digests, tiled=True)  # [processes, flags]
    except (jax.errors.JaxRuntimeError, ValueError) as error:  # a process died: one line
        fail(f"another process of the cluster stopped ({str(error).splitlines()[0][:160]})", 1)
    if not (same := (every == every[0]).all(axis=0)).all():
        name = list(values)[int(np.argmin(same))]  # the first that differs
        coordinator_ends_last()
        fail(f"--{name.replace('_', '-')} differs between the processes; give all the same")


@contextlib.contextmanager
def gloo_quiet():
    """gloo's C++ prints "[Gloo] Rank N is connected to M peer ranks..." to file descriptor 1 in
    every process as the first gather connects: meanwhile that descriptor points to /dev/null."""
    if sys.stdout:
        sys.stdout.flush()
    try:
        kept = os.dup(1)
    except OSError:  # no stdout at all (>&-): nothing to keep clean
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(kept, 1)
        os.close(kept)


def coordinator_ends_last() -> None:
    """Before every process ends with the same error: JAX aborts a process whose coordinator,
    process 0, ends first (the watcher's line would replace this one's)."""
    with contextlib.suppress(jax.errors.JaxRuntimeError, ValueError):  # gloo raises the latter
        multihost_utils.sync_global_devices("every process ends")
    if jax.process_index() == 0:
        time.sleep(2)  # the others exit meanwhile (a fraction of a second)


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    config, cluster = parse_config(argv)
    if isinstance(config, Path):  # --replot DIR: the figures again from the saved files
        if not all((config / name).is_file() for name in RUN_FILES):
            fail(f"--replot: {str(config)!r} is not a saved run (needs {', '.join(RUN_FILES)})")
        try:
            with written_whole("each figure"):  # both redrawn, or a signal waits till they are
                plot_run(config)
        except Exception as error:  # a damaged file: one line, not a traceback
            fail(f"--replot {config}: cannot redraw ({describe(error)})"[:300])
        return print(f"redrew sweep_heatmap.png, learning_curves.png in {config}/ (no training)")
    # The progress line leaves the compiled sweep through jax.debug.callback, which needs JAX's
    # CPU platform: JAX_PLATFORMS=cuda gets cpu beside it (cuda, first, still runs the sweep).
    platforms = jax.config.jax_platforms
    if cpu_added := bool(platforms) and "cpu" not in platforms.split(","):
        jax.config.update("jax_platforms", f"{platforms},cpu")
    overwrite = cluster.pop("overwrite")
    join_cluster(**cluster)
    if cpu_added and jax.default_backend() == "cpu":  # JAX passes over a cuda it cannot see
        fail(f"JAX_PLATFORMS={platforms!r}: JAX finds no such device here, only the CPU")
    if jax.process_count() > 1:
        check_same_flags(config)
    if jax.process_index() == 0:  # process 0 writes for the cluster: the others' is not used
        try:
            run_folder(config.output_dir, overwrite)
        except ValueError as error:
            fail(str(error))
    plan = make_step_plan(config)
    try:
        env, output = validate(config, plan)
    except ConfigError as error:
        fail(str(error))
    config = dataclasses.replace(config, output_dir=str(output))
    print(f"output {output}/")
    mesh = seed_mesh()
    chunks = chunks_per_device(config, env, mesh)
    num_grid = len(grid_points(config))
    num_agents = num_grid * config.num_seeds
    print(
        f"{plural(config.num_seeds, 'seed')} x {plural(num_grid, 'grid point')} = "
        f"{plural(num_agents, 'agent')} on a {env.rows}x{env.cols} map, "
        f"{plural(mesh.size, jax.default_backend() + ' device')}, "
        f"{plural(chunks, 'chunk')} per device (--agents-per-chunk)"
    )
    if plan.num_points != config.num_curve_points:  # a curve point is made of whole blocks
        print(
            f"note: {plan.num_points} curve points, not {config.num_curve_points}: "
            "each point of --num-curve-points is a whole number of --rng-block-steps blocks"
        )

    try:
        result, timings = run_sweep(config, env, plan, mesh, chunks)
    except BaseException:  # stopped: leave no empty folder
        remove_if_empty(output)
        raise
    if jax.process_index() > 0:  # process 0 reports and writes the results of every process
        stop_if_received()  # as written_whole does for process 0
        return
    # From the end of training, a signal waits until the run is written: no trained run is lost.
    with written_whole():
        rows = summarize_grid(config, env, plan, result)
        rate = num_agents * config.total_timesteps / timings["train_time_s"]
        print(
            f"compile {timings['compile_time_s']:.1f} s, train {timings['train_time_s']:.2f} s: "
            f"{rate / 1e6:.1f}M agent-steps/s ({config.total_timesteps} steps per agent)"
        )
        print(
            "optimal: share of seeds whose final greedy path from S is a shortest path; path: its\n"
            "mean length (one that never reaches G counts as the cell count); V*: value iteration"
        )
        print(f"{'lr':>6} {'eps':>6} {'gamma':>6} {'optimal':>8} {'path':>7} {'|V(S)-V*(S)|':>13}")
        texts = {name: apart(row[name] for row in rows) for name in HParams._fields}
        for row in rows:
            optimal = row["greedy_path_optimal_fraction"]["mean"]
            path = row["greedy_path_length"]["mean"]
            abs_error = row["start_value_abs_error"]["mean"]
            lr, epsilon, gamma = (texts[name][row[name]] for name in texts)
            print(f"{lr:>6} {epsilon:>6} {gamma:>6} {optimal:8.2f} {path:7.1f} {abs_error:13.4f}")

        summary = {
            "config": dataclasses.asdict(config),
            "versions": versions(),
            "jax_settings": jax_settings(),
            "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
            "num_agents": num_agents,
            "chunks_per_device": chunks,  # run one after another, each a make_sweep call
            "steps_per_agent": config.total_timesteps,
            **timings,
            "agent_steps_per_s": rate,
            "wall_time_s": time.perf_counter() - start,  # the whole command, but the writes
            "grid": rows,
        }
        with replacing(output):  # the run --overwrite replaces stays till now
            save_run(output, summary, config, plan, result)
            plot_run(output)
        print(
            f"wrote {', '.join(RUN_FILES)}, sweep_heatmap.png, learning_curves.png to {output}/, "
            f"wall {summary['wall_time_s']:.1f} s"
        )


class BestEffortStream:
    """stdout or stderr, written while it can be: once it cannot (its reader left, `| head -1`;
    a full disk, `> /dev/full`; a closed terminal), its lines go to /dev/null and the run goes
    on, to be saved whole."""

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
                print(f"parallel_q_learning.py: {why}", file=sys.stderr)


class Stopped(BaseException):
    """SIGTERM or SIGHUP (a closed terminal), raised in the main thread as Ctrl-C raises
    KeyboardInterrupt; args[0] is the signal. A BaseException, as KeyboardInterrupt is: an
    `except Exception` (JAX has some) must not swallow it."""


RECEIVED: list[int] = []  # the signals stop() was called for


def stop(signum, frame):
    RECEIVED.append(signum)  # its exception may yet be dropped: stop_if_received
    # A second SIGTERM or SIGHUP (a hang-up sends two) must not cut the cleanup short.
    for other in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(other, ignore)
    raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)


def stop_if_received() -> None:
    """Raises again the first signal stop() took: C code that clears errors (JAX's first import
    of its MLIR dialects) may have dropped its exception, and the run gone on."""
    if RECEIVED:
        stop(RECEIVED[0], None)


def ignore(signum, frame):
    """A handler that does nothing. Not SIG_IGN: set while a signal is pending (SIGTERM and
    SIGHUP at once), Python would raise OSError('Signal 15 ignored due to race condition')."""


def send_again(unraisable) -> None:
    """sys.unraisablehook: Python drops an exception raised in a garbage-collector callback (JAX
    has one), a __del__ or a weakref callback, so a signal whose handler ran there is sent again
    10 ms later, from a timer, to whatever handles it then."""
    error = unraisable.exc_value
    if not isinstance(error, KeyboardInterrupt | Stopped):
        return sys.__unraisablehook__(unraisable)
    signum = error.args[0] if isinstance(error, Stopped) else signal.SIGINT
    if signal.getsignal(signum) is ignore:  # stop() ignores it from its first call
        signal.signal(signum, stop)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signum))
    signal.setitimer(signal.ITIMER_REAL, 0.01)


def rank(argv: list[str]) -> int:
    """This process's place in a cluster (0 alone): --process-id, or a SLURM / Open MPI rank."""
    flags = argparse.ArgumentParser(add_help=False, exit_on_error=False)  # main says what is wrong
    flags.add_argument("--process-id")
    ranks = [os.environ.get(name) for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK")]
    try:
        given = [flags.parse_known_args(argv)[0].process_id, *ranks]
    except argparse.ArgumentError:  # --process-id without a value
        given = ranks
    try:  # read as main reads it ("+1", " 1" too): a process other than 0 is watched
        return int(next((r for r in given if r is not None), "0"))
    except ValueError:  # a bad one: main says so
        return 0


def die_with_parent() -> None:
    """Run in the child before it starts: Linux ends it when its watcher is killed."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def watch(argv: list[str]) -> int:
    """Processes other than 0 of a cluster work in a child process and watch it: JAX ends one
    whose coordinator, process 0, has died with an abort and a C++ stack trace; this prints one
    line instead. The child's stderr waits for its end. The child has a session of its own: each
    signal reaches it once, from here, whether sent to the process group or to this pid alone."""
    child = subprocess.Popen(
        [sys.executable, __file__, *argv],
        env={**os.environ, "PARALLEL_Q_LEARNING_WATCHED": "1"},
        stderr=subprocess.PIPE,
        preexec_fn=die_with_parent,
        start_new_session=True,
    )
    for signum in catchable():  # nohup's SIGHUP stays ignored, here and in the child
        signal.signal(signum, lambda signum, frame: child.send_signal(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # one that came as JAX loaded: passed on
    errors = child.communicate()[1]
    if child.returncode == -signal.SIGABRT:
        fail("process 0 of the cluster stopped; so does this one", 1)
    sys.stderr.buffer.write(errors)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    if "PARALLEL_Q_LEARNING_WATCHED" not in os.environ and rank(sys.argv[1:]) > 0:
        sys.exit(watch(sys.argv[1:]))
    sys.unraisablehook = send_again  # before any handler that raises
    for signum in catchable():  # nohup's SIGHUP stays ignored
        signal.signal(signum, stop)
    # JAX logs an exception raised in a callback with its traceback: not a signal's (one line).
    logging.getLogger("jax._src.debugging").addFilter(
        lambda record: not (record.exc_info and record.exc_info[0] in (KeyboardInterrupt, Stopped))
    )
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
        unfinished = "unfinished; no file half-written"
        message = f"parallel_q_learning.py: stopped by {SIGNALS[signum]}, {unfinished}"
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signum)  # now: not after the compiled call still running in the background
    finally:  # the run has ended: in JAX's clean-up at exit, a signal has its default effect
        signal.setitimer(signal.ITIMER_REAL, 0)  # (it raised there, and was sent again: SIGALRM)
        for signum in catchable():
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
