"""Tests for q_learning_gridworld.py: environment, agent, optimality, sharding, command line.

The optimality tests compare against value iteration written here, independently of the
script (its own map parsing and moves), so a bug shared by both cannot hide.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import q_learning_gridworld as qlg

SCRIPT = Path(qlg.__file__)
GAMMA = qlg.Config().gamma
# Small runs for the tests that check mechanics rather than learning.
SMALL = {"total_timesteps": 20_000, "steps_per_block": 1_000, "num_curve_points": 10}

# A map the hyperparameters were never tuned on: random walls, fixed seed, built below.
RANDOM_MAP_SEED = 7
RANDOM_MAP_SHAPE = (9, 11)
RANDOM_MAP_WALL_FRACTION = 0.3


# ------------------------------------------------------------------------------------------
# Reference: value iteration and breadth-first search, independent of the script
# ------------------------------------------------------------------------------------------

MOVES = {0: (0, 1), 1: (1, 0), 2: (0, -1), 3: (-1, 0)}  # right, down, left, up


def reference_move(grid: list[str], row: int, col: int, action: int) -> tuple[int, int]:
    r, c = row + MOVES[action][0], col + MOVES[action][1]
    if 0 <= r < len(grid) and 0 <= c < len(grid[0]) and grid[r][c] != "#":
        return r, c
    return row, col


def find(grid: list[str], char: str) -> tuple[int, int]:
    return next((r, c) for r, line in enumerate(grid) for c, x in enumerate(line) if x == char)


def reference_q_star(layout: str, gamma: float) -> np.ndarray:
    """Q* [rows, cols, 4]: reward 1 on entering G, G terminal (V*(G) = 0), walls 0."""
    grid = [line for line in layout.splitlines() if line]
    rows, cols = len(grid), len(grid[0])
    goal = find(grid, "G")
    q = np.zeros((rows, cols, 4))
    for _ in range(10_000):
        v = q.max(axis=-1)
        v[goal] = 0.0
        new_q = np.zeros_like(q)
        for r in range(rows):
            for c in range(cols):
                if grid[r][c] == "#" or (r, c) == goal:
                    continue
                for a in range(4):
                    nr, nc = reference_move(grid, r, c, a)
                    new_q[r, c, a] = 1.0 if (nr, nc) == goal else gamma * v[nr, nc]
        if np.abs(new_q - q).max() < 1e-12:
            return new_q
        q = new_q
    raise AssertionError("value iteration did not converge")


def reference_shortest(layout: str) -> int | None:
    grid = [line for line in layout.splitlines() if line]
    start, goal = find(grid, "S"), find(grid, "G")
    frontier, seen, steps = [start], {start}, 0
    while frontier:
        if goal in frontier:
            return steps
        frontier = [
            n
            for cell in frontier
            for a in range(4)
            if (n := reference_move(grid, *cell, a)) not in seen and not seen.add(n)
        ]
        steps += 1
    return None


def random_map() -> str:
    """A random walled map (S and G far apart) where G is reachable from S."""
    rng = np.random.default_rng(RANDOM_MAP_SEED)
    rows, cols = RANDOM_MAP_SHAPE
    while True:
        walls = rng.random((rows, cols)) < RANDOM_MAP_WALL_FRACTION
        grid = [["#" if w else "." for w in line] for line in walls]
        grid[0][0], grid[rows - 1][cols - 1] = "S", "G"
        layout = "\n".join("".join(line) for line in grid)
        shortest = reference_shortest(layout)
        if shortest is not None and shortest > rows + cols:  # a detour is needed
            return layout


def greedy_walk(q: np.ndarray, layout: str) -> int | None:
    """Steps from S to G following argmax Q, or None if it never gets there."""
    grid = [line for line in layout.splitlines() if line]
    cell, goal = find(grid, "S"), find(grid, "G")
    for step in range(1, q.shape[0] * q.shape[1] + 1):
        cell = reference_move(grid, *cell, int(np.argmax(q[cell])))
        if cell == goal:
            return step
    return None


# ------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------

TINY = """
S.#
..G
"""  # cells: 0 S, 1 ., 2 #, 3 ., 4 ., 5 G
RIGHT, DOWN, LEFT, UP = 0, 1, 2, 3


def test_layouts_match_the_spec():
    for name, (rows, cols, shortest) in {
        "default": (8, 12, 18),
        "maze": (8, 12, 22),
        "four_rooms": (13, 13, 20),
    }.items():
        env = qlg.GridWorld(qlg.LAYOUTS[name])
        assert (env.rows, env.cols) == (rows, cols)
        assert env.map.shortest_path_length == reference_shortest(qlg.LAYOUTS[name])
        assert reference_shortest(qlg.LAYOUTS[name]) == shortest
    env = qlg.GridWorld(qlg.LAYOUTS["default"])
    assert (env.map.start, env.map.goal) == (7 * 12 + 11, 0)
    assert not (env.map.grid == "#").any()


def run_steps(env, actions):
    obs, state = env.reset(jax.random.key(0))
    out = []
    for action in actions:
        obs, state, reward, terminated, truncated, info = env.step(
            jax.random.key(1), state, jnp.int32(action)
        )
        out.append(
            (int(obs), int(state.time), float(reward), bool(terminated), bool(truncated),
             int(info["final_observation"]))
        )  # fmt: skip
    return out


def test_reset_starts_at_s():
    obs, state = qlg.GridWorld(TINY).reset(jax.random.key(0))
    assert int(obs) == 0 and int(state.cell) == 0 and int(state.time) == 0


def test_walls_edges_reward_termination_and_auto_reset():
    steps = run_steps(qlg.GridWorld(TINY), [UP, LEFT, RIGHT, RIGHT, DOWN, RIGHT, DOWN])
    # (obs, time, reward, terminated, truncated, final_observation)
    assert steps == [
        (0, 1, 0.0, False, False, 0),  # up: off the grid, stay at S
        (0, 2, 0.0, False, False, 0),  # left: off the grid, stay
        (1, 3, 0.0, False, False, 1),  # right
        (1, 4, 0.0, False, False, 1),  # right: wall, stay
        (4, 5, 0.0, False, False, 4),  # down
        (0, 0, 1.0, True, False, 5),  # right: enter G, reward, terminate, reset to S
        (3, 1, 0.0, False, False, 3),  # a new episode from S
    ]


def test_truncation_resets_and_keeps_final_observation():
    steps = run_steps(qlg.GridWorld(TINY, max_episode_steps=2), [RIGHT, DOWN, RIGHT])
    assert steps[1] == (0, 0, 0.0, False, True, 4)  # time limit: back to S, true cell kept
    assert steps[2] == (1, 1, 0.0, False, False, 1)
    # Entering G on the last allowed step is a termination, not a truncation.
    steps = run_steps(qlg.GridWorld(TINY, max_episode_steps=3), [RIGHT, DOWN, RIGHT])
    assert steps[2] == (0, 0, 1.0, True, False, 5)


def test_no_time_limit_by_default():
    steps = run_steps(qlg.GridWorld(TINY), [UP] * 50)
    assert not any(truncated for *_, truncated, _ in steps)
    assert steps[-1][1] == 50


@pytest.mark.parametrize(
    "layout, message",
    [
        ("", "empty"),
        ("\n\n  \n", "empty"),
        ("....\n.G..\n....", "exactly one S"),
        ("S...\n....", "exactly one G"),
        ("S.S\n..G", "exactly one S (start), found 2"),
        ("SGG", "exactly one G (goal), found 2"),
        ("S..\n..\n..G", "row 1 has 2 characters"),
        ("S.x\n..G", "unknown character 'x' at row 0 col 2"),
        ("S.#..\n##.#G", "cannot be reached"),
    ],
)
def test_bad_maps_raise_one_line(layout, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        qlg.parse_layout(layout)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        qlg.Config(layout=layout)


def test_a_run_parses_its_map_once():
    layout = "S..\n.#.\n..G\n"  # a map no other test uses
    before = qlg.parse_layout.cache_info().misses
    config = qlg.Config(layout=layout, max_episode_steps=5)  # checks the map
    qlg.make_train(config, qlg.GridWorld(config.layout, config.max_episode_steps))
    qlg.make_train(config)  # builds its own GridWorld from the same text
    assert qlg.parse_layout.cache_info().misses == before + 1


def test_map_text_tolerates_blank_edges_and_trailing_spaces():
    grid = qlg.parse_layout("\n\nS.  \n.G\n\n").grid
    assert grid.shape == (2, 2)


# ------------------------------------------------------------------------------------------
# Agent
# ------------------------------------------------------------------------------------------

NUM_POLICY_SAMPLES = 200_000
# 5 standard deviations of an empirical frequency near 1/4 from NUM_POLICY_SAMPLES draws.
POLICY_TOLERANCE = 5 * np.sqrt(0.25 * 0.75 / NUM_POLICY_SAMPLES)


@jax.jit
def sample_actions(q_s, bits, threshold):  # compiled once for all the cases below
    return jax.vmap(qlg.epsilon_greedy, in_axes=(None, 0, None))(q_s, bits, threshold)


@pytest.mark.parametrize(
    "q_s, epsilon",
    [
        ([1.0, 0.0, 1.0, 1.0], 0.3),  # three-way tie
        ([0.0, 0.0, 0.0, 0.0], 0.0),  # untrained: greedy must still be uniform
        ([0.5, 0.2, 0.5, 0.1], 0.1),
        ([0.1, 0.9, 0.3, 0.2], 0.0),  # a unique maximum, no exploration
        ([0.1, 0.9, 0.3, 0.2], 1.0),  # pure exploration
    ],
)
def test_epsilon_greedy_matches_distrax(q_s, epsilon):
    q_s = jnp.asarray(q_s, jnp.float32)
    bits = jax.random.bits(jax.random.key(3), (NUM_POLICY_SAMPLES,), jnp.uint32)
    actions = sample_actions(q_s, bits, qlg.explore_threshold(epsilon))
    frequencies = np.bincount(np.asarray(actions), minlength=4) / NUM_POLICY_SAMPLES
    with warnings.catch_warnings():  # distrax's TFP backend warns about a jax deprecation
        warnings.simplefilter("ignore", DeprecationWarning)
        import distrax
    expected = np.asarray(distrax.EpsilonGreedy(preferences=q_s, epsilon=epsilon).probs)
    np.testing.assert_allclose(frequencies, expected, atol=POLICY_TOLERANCE)


def test_terminal_step_does_not_bootstrap_but_truncated_one_does():
    # The next cell's best value, 5, is not that of the action taken (1): a bootstrap from
    # Q(s', a) instead of max Q(s', .) reads 1.
    q = jnp.zeros((3, 4)).at[2].set(jnp.array([0.0, 1.0, 5.0, 2.0]))
    kwargs = {"obs": 0, "action": 1, "reward": 1.0, "next_obs": 2, "learning_rate": 0.5}
    terminal = qlg.q_learning_update(q, terminated=True, gamma=0.9, **kwargs)
    assert float(terminal[0, 1]) == pytest.approx(0.5 * 1.0)
    not_terminal = qlg.q_learning_update(q, terminated=False, gamma=0.9, **kwargs)
    assert float(not_terminal[0, 1]) == pytest.approx(0.5 * (1.0 + 0.9 * 5.0))
    assert np.count_nonzero(np.asarray(terminal) != np.asarray(q)) == 1  # one entry moves


def test_update_uses_the_true_next_cell_not_the_reset_cell():
    """On 'GS.' with one step per episode, uniformly random actions and learning rate 1:
    left enters G (Q = 1); up and down stay at S and are truncated, so they bootstrap from
    S itself (Q = gamma * 1); right reaches a cell never acted from (Q = 0). Bootstrapping
    from the reset cell S would make Q(S, right) = gamma, from a terminal Q(S, left) > 1. Each
    block draws new random words: the same words every block would repeat one share of left."""
    config = qlg.Config(
        layout="GS.", max_episode_steps=1, epsilon=1.0, learning_rate=1.0, initial_q=0.0, **SMALL
    )
    out = jax.jit(qlg.make_train(config))(jax.random.key(0))
    q_start = np.asarray(out["q_values"])[0, 1]
    np.testing.assert_allclose(q_start, [0.0, GAMMA, 1.0, GAMMA], rtol=1e-6)
    # Every episode lasts one step; a quarter of them (left) reach G.
    metrics = jax.tree.map(np.asarray, out["metrics"])
    assert metrics["episodes"].sum() == config.total_timesteps
    np.testing.assert_array_equal(metrics["mean_episode_length"], 1.0)
    np.testing.assert_array_equal(metrics["episode_length"], 1)
    assert 0.2 < metrics["mean_return"].mean() < 0.3
    assert len(set(metrics["mean_return"].tolist())) > 1, metrics["mean_return"]


def test_returns_are_counted_exactly_past_2_to_the_24():
    """On 'SG' nearly every step reaches G, and every episode returns 1: in one block of 2^24 +
    2^22 steps the goals pass 2^24, where a float32 sum of rewards stops counting (it read
    0.87). Compiled at XLA's usual level, which runs these 20M steps 5x faster than the tests'."""
    steps = 2**24 + 2**22
    config = qlg.Config(
        layout="SG", total_timesteps=steps, steps_per_block=steps, num_curve_points=1
    )
    train = jax.jit(qlg.make_train(config)).lower(jax.random.key(0))
    metrics = train.compile({"xla_backend_optimization_level": 2})(jax.random.key(0))["metrics"]
    assert metrics["episodes"][0] > 2**24
    assert metrics["mean_return"][0] == 1.0


# ------------------------------------------------------------------------------------------
# train: purity, vmap, seeds, metrics
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_train():
    return qlg.make_train(qlg.Config(**SMALL))


@pytest.fixture(scope="module")
def small_runs(small_train):
    keys = jax.random.split(jax.random.key(42), 3)
    batched = jax.jit(jax.vmap(small_train))(keys)
    single = jax.jit(small_train)
    return keys, batched, [single(key) for key in keys]


def test_vmap_gives_what_single_key_gives(small_runs):
    _, batched, singles = small_runs
    for i, single in enumerate(singles):
        jax.tree.map(
            lambda b, s, i=i: np.testing.assert_array_equal(np.asarray(b)[i], s),
            batched,
            single,
        )


# The check above at XLA's default optimization level, which the script runs at (conftest.py
# lowers it for the tests): there an update written as .add(step) would give other last bits
# vmapped (q_learning_update says why).
AT_DEFAULT_LEVEL = f"""
import jax, numpy as np, q_learning_gridworld as qlg
train = qlg.make_train(qlg.Config(**{SMALL!r}))
keys = jax.random.split(jax.random.key(42), 3)
batched = jax.jit(jax.vmap(train))(keys)
for i in range(3):
    alone = jax.jit(train)(keys[i])
    for x, y in zip(jax.tree.leaves(alone), jax.tree.leaves(batched), strict=True):
        np.testing.assert_array_equal(x, y[i])
"""


def test_vmap_gives_what_single_key_gives_at_xlas_default_level():
    flags = [f for f in os.environ["XLA_FLAGS"].split() if "optimization_level" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", AT_DEFAULT_LEVEL], capture_output=True, text=True,
                         cwd=SCRIPT.parent, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


def test_train_runs_eagerly_for_debugging_as_readme_shows():
    """README's recipe: train() under jax.disable_jit(), each op run as Python reaches it (for
    print and pdb), gives the jitted result up to float rounding (XLA fuses the update)."""
    train = qlg.make_train(qlg.Config(total_timesteps=20, steps_per_block=10, num_curve_points=2))
    with jax.disable_jit():
        eager = train(jax.random.key(0))
    jitted = jax.jit(train)(jax.random.key(0))
    jax.tree.map(lambda e, j: np.testing.assert_allclose(e, j, rtol=1e-6), eager, jitted)
    assert not np.all(np.asarray(eager["q_values"]) == qlg.Config().initial_q)  # it learned


def test_seeds_are_independent(small_runs):
    _, batched, _ = small_runs
    lengths = np.asarray(batched["metrics"]["episode_length"])  # [seeds, episodes]
    q = np.asarray(batched["q_values"])
    for i in range(len(q)):
        for j in range(i):
            assert not np.array_equal(lengths[i], lengths[j])
            assert not np.array_equal(q[i], q[j])


def test_output_shapes_and_bounded_metrics(small_runs):
    _, batched, _ = small_runs
    assert batched["q_values"].shape == (3, 8, 12, 4)
    assert batched["q_values"].dtype == jnp.float32
    metrics = batched["metrics"]
    assert metrics["episode_length"].shape == (3, qlg.Config().num_recorded_episodes)
    for name in ("timestep", "episodes", "mean_episode_length", "mean_return"):
        assert metrics[name].shape == (3, SMALL["num_curve_points"])
    np.testing.assert_array_equal(
        metrics["timestep"][0], np.arange(1, 11) * SMALL["total_timesteps"] // 10
    )
    # Every step belongs to an ended episode except those of the one still running.
    ended_steps = np.nansum(metrics["episodes"] * metrics["mean_episode_length"], axis=1)
    assert np.all(ended_steps <= SMALL["total_timesteps"])
    assert np.all(ended_steps > SMALL["total_timesteps"] - 10_000)
    recorded = np.asarray(metrics["episode_length"])
    assert np.all(recorded[:, :10] >= 18)  # no episode is shorter than the shortest path


def test_curve_points_are_bounded_whatever_the_run_length():
    config = qlg.Config(total_timesteps=2_000, steps_per_block=100, num_curve_points=7)
    train = qlg.make_train(config)
    shapes = jax.eval_shape(train, jax.random.key(0))
    assert shapes["metrics"]["mean_episode_length"].shape == (7,)
    longer = qlg.make_train(
        qlg.Config(total_timesteps=200_000_000, steps_per_block=100, num_curve_points=7)
    )
    assert jax.eval_shape(longer, jax.random.key(0))["metrics"]["episodes"].shape == (7,)
    few_blocks = qlg.make_train(qlg.Config(total_timesteps=300, steps_per_block=100))
    assert jax.eval_shape(few_blocks, jax.random.key(0))["metrics"]["episodes"].shape == (3,)


def test_any_step_count_runs_exactly_that_many_steps():
    """2,345 steps in blocks of 1,000: two whole blocks and one of 345. With a time limit of one
    step every step ends an episode, so the episodes count the steps."""
    config = qlg.Config(total_timesteps=2_345, steps_per_block=1_000, max_episode_steps=1)
    metrics = jax.jit(qlg.make_train(config))(jax.random.key(0))["metrics"]
    np.testing.assert_array_equal(metrics["timestep"], [1_000, 2_000, 2_345])
    np.testing.assert_array_equal(metrics["episodes"], [1_000, 1_000, 345])


# ------------------------------------------------------------------------------------------
# Optimality against value iteration, with the default hyperparameters
# ------------------------------------------------------------------------------------------

NUM_OPTIMALITY_SEEDS = 4
OPTIMALITY_MAPS = {
    "default": qlg.LAYOUTS["default"],
    "maze": qlg.LAYOUTS["maze"],
    "four_rooms": qlg.LAYOUTS["four_rooms"],
    "random_walls": random_map(),
}


@pytest.mark.parametrize("name", OPTIMALITY_MAPS)
def test_default_settings_learn_a_shortest_path(name):
    layout = OPTIMALITY_MAPS[name]
    train = qlg.make_train(qlg.Config(layout=layout))
    keys = jax.random.split(jax.random.key(2024), NUM_OPTIMALITY_SEEDS)
    q_values = np.asarray(jax.jit(jax.vmap(train))(keys)["q_values"])
    q_star = reference_q_star(layout, GAMMA)
    grid = [line for line in layout.splitlines() if line]
    start = find(grid, "S")
    shortest = reference_shortest(layout)
    assert q_star[start].max() == pytest.approx(GAMMA ** (shortest - 1))
    for q in q_values:
        assert greedy_walk(q, layout) == shortest
        assert q[start].max() == pytest.approx(q_star[start].max(), rel=0.05)
        # From the optimistic start 1.0 with learning rate <= 1, every Q-value stays between
        # Q* and 1 (a bootstrap from the terminal step would push it above 1).
        assert np.all(q >= q_star - 1e-6) and np.all(q <= 1.0 + 1e-6)
        # Along the greedy path every chosen action is optimal and its value close to V*.
        cell = start
        while grid[cell[0]][cell[1]] != "G":
            action = int(np.argmax(q[cell]))
            assert q_star[cell][action] == pytest.approx(q_star[cell].max())
            assert q[cell][action] == pytest.approx(q_star[cell].max(), rel=0.05)
            cell = reference_move(grid, *cell, action)


@pytest.mark.parametrize("name", OPTIMALITY_MAPS)
def test_the_scripts_value_iteration_is_this_files(name):
    """The script's value_iteration, the yardstick its summary reports V*(S) and |V - V*| from,
    equals the independent one above at every cell an agent can act from (not a wall, not G)."""
    layout = OPTIMALITY_MAPS[name]
    env = qlg.GridWorld(layout)
    q_star = reference_q_star(layout, GAMMA)
    theirs = qlg.value_iteration(env, GAMMA).reshape(q_star.shape)
    grid = [line for line in layout.splitlines() if line]
    acts = np.array([[x not in "#G" for x in line] for line in grid])  # [rows, cols]
    np.testing.assert_allclose(theirs[acts], q_star[acts], atol=1e-9)


def test_the_summary_measures_each_seeds_path_and_value_against_the_optimum():
    """On 'S.G / ...' (shortest path 2 steps): a seed greedy on Q*/2 walks the shortest path and
    has V(S) = V*(S)/2, a relative error of 0.5 (of V*, not of V(S): 1.0); a seed that detours
    (down, right, right, up: 4 steps) reaches G but is not optimal (any path to G counted as
    optimal passed the suite)."""
    layout = "S.G\n...\n"
    env, config = qlg.GridWorld(layout), qlg.Config(layout=layout, num_seeds=2, gamma=0.9)
    detour = np.zeros((env.num_cells, 4))
    for cell, action in ((0, DOWN), (3, RIGHT), (4, RIGHT), (5, UP)):
        detour[cell, action] = 1.0
    q_values = np.stack([qlg.value_iteration(env, 0.9) / 2, detour]).astype(np.float32)
    summary = qlg.summarize(config, env, q_values, {"train_time_s": 1.0})
    optimal, detoured = summary["seeds"]
    assert optimal["shortest_path_length"] == 2 and optimal["greedy_path_length"] == 2
    assert optimal["v_star_start"] == pytest.approx(0.9)  # gamma^(shortest - 1)
    assert optimal["v_start_relative_error"] == pytest.approx(0.5)
    assert detoured["greedy_path_length"] == 4 and summary["optimal_seeds"] == 1
    assert qlg.greedy_path(env, detour) == [0, 3, 4, 5, 2]


def test_the_greedy_path_takes_the_first_maximum_on_ties():
    """As its docstring says: at S right and down tie, and right leads to G in 2 steps; the last
    maximum went down, into a row of zeros, and looped (no path)."""
    env = qlg.GridWorld("S.G\n...\n")
    q = np.zeros((env.num_cells, 4))
    q[0, [RIGHT, DOWN]] = 1.0
    q[1, RIGHT] = 1.0
    assert qlg.greedy_path(env, q) == [0, 1, 2]


@pytest.mark.parametrize("name", ["maze", "random_walls"])
def test_uniform_exploration_learns_the_whole_table(name):
    """Q-learning is off-policy: acting uniformly at random, every reachable (state, action)
    is visited often, and the whole Q-table converges to Q*."""
    layout = OPTIMALITY_MAPS[name]
    train = qlg.make_train(qlg.Config(layout=layout, epsilon=1.0))
    q = np.asarray(jax.jit(train)(jax.random.key(5))["q_values"])
    q_star = reference_q_star(layout, GAMMA)
    reachable = q_star.max(axis=-1) > 0  # [rows, cols]: not a wall, not G, connected to G
    assert reachable.sum() > 40
    np.testing.assert_allclose(q[reachable], q_star[reachable], rtol=0.05)


# ------------------------------------------------------------------------------------------
# Sharded multi-seed run (conftest shows the CPU as 2 devices)
# ------------------------------------------------------------------------------------------


@pytest.mark.cpu_devices
@pytest.mark.parametrize("batch_size", [None, 1])  # all seeds of a device at once, or one by one
def test_sharded_seeds_match_single_runs(small_train, batch_size):
    assert jax.device_count() == 2
    config = qlg.Config(num_seeds=3, seed=11, **SMALL)
    out, timings = qlg.train_seeds(small_train, config.seed, config.num_seeds, batch_size)
    assert len(timings["devices"]) == 2
    assert timings["padded_num_seeds"] == 4  # 3 seeds padded to a multiple of 2 devices
    assert out["q_values"].shape == (3, 8, 12, 4)
    assert timings["train_time_s"] > 0
    single = jax.jit(small_train)
    for i in range(3):
        expected = single(jax.random.fold_in(jax.random.key(config.seed), i))
        np.testing.assert_array_equal(out["q_values"][i], expected["q_values"])
        np.testing.assert_array_equal(
            out["metrics"]["episode_length"][i], expected["metrics"]["episode_length"]
        )


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def test_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        qlg.parse_config(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for field in qlg.dataclasses.fields(qlg.Config):
        assert "--" + field.name.replace("_", "-") in text
    assert "(default: 1000000)" in text and "(default: default)" in text


def test_layout_flag_reads_names_and_files(tmp_path):
    path = tmp_path / "map.txt"
    path.write_text("S.\n.G\n")
    assert qlg.parse_config(["--layout", str(path)]).layout == "S.\n.G\n"
    path.write_bytes(b"\xef\xbb\xbfS.\r\n.G\r\n")  # Notepad's: a byte-order mark, CRLF
    assert qlg.GridWorld(qlg.parse_config(["--layout", str(path)]).layout).map.grid.shape == (2, 2)
    assert qlg.parse_config(["--layout", "maze"]).layout == qlg.LAYOUTS["maze"]
    assert qlg.parse_config([]).layout == qlg.LAYOUTS["default"]


BAD_MAPS = {
    "no_start": ("....\n..G.\n", "exactly one S"),
    "no_goal": ("S...\n....\n", "exactly one G"),
    "two_starts": ("S.S\n..G\n", "exactly one S"),
    "two_goals": ("S.G\n..G\n", "exactly one G"),
    "ragged": ("S...\n..G\n", "row 1 has 3 characters"),
    "unknown_char": ("S.o\n..G\n", "unknown character 'o'"),
    "empty": ("", "empty"),
    "blank": (" \n\n  \n", "empty"),
    # Rows that an editor shows as one: Python's splitlines made two of them (a 2 x 2 map)
    "form_feed": ("S.\x0c.G\n", "unknown character '\\x0c' at row 0 col 2"),
    "line_separator": ("S.\u2028.G\n", "unknown character '\\u2028' at row 0 col 2"),
    "unreachable": ("S#.\n##G\n", "cannot be reached"),
}
BAD_FLAGS = [
    (["--layout", "no/such/file.txt"], "--layout"),
    (["--total-timesteps", "0"], "--total-timesteps"),
    (["--num-seeds", "0"], "--num-seeds"),
    (["--num-seeds", "-3"], "--num-seeds"),
    (["--num-seeds", "two"], "--num-seeds"),
    (["--steps-per-block", "0"], "--steps-per-block"),
    (["--num-curve-points", "0"], "--num-curve-points"),
    (["--num-recorded-episodes", "0"], "--num-recorded-episodes"),
    (["--max-episode-steps", "-1"], "--max-episode-steps"),
    (["--total-timesteps", str(2**31)], "--total-timesteps"),  # step counters are int32
    (["--epsilon", "-0.1"], "--epsilon"),
    (["--epsilon", "1.5"], "--epsilon"),
    (["--gamma", "1.0"], "--gamma"),
    (["--gamma", "-0.5"], "--gamma"),
    (["--learning-rate", "0"], "--learning-rate"),
    (["--learning-rate", "-0.1"], "--learning-rate"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--initial-q", "inf"], "--initial-q"),
    (["--initial-q", "1e39"], "--initial-q"),  # inf as a float32
    (["--gamma", "0.99999999999"], "--gamma"),  # 1.0 as a float32
    (["--learning-rate", "1e-46"], "--learning-rate"),  # 0 as a float32
    (["--learning-rate", "1e-38"], "--learning-rate"),  # below normal float32s: 0 to XLA
    (["--max-episode-steps", str(2**31)], "--max-episode-steps"),  # int32 counters
    (["--seed", str(2**63)], "--seed"),  # beyond what jax.random.key takes
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--num-seeds", str(10**12)], "--num-seeds"),  # cannot fit in memory: refused up front
    # One seed too many: the line names the flag that drives the memory, not --num-seeds. 2 TB,
    # refused on any machine (20 GB, refused here, was not on a GPU of 139 GB).
    (["--num-recorded-episodes", str(10**10)], "--num-recorded-episodes"),
    (["--total-timesteps", "2000000000", "--steps-per-block", "2000000000"], "--steps-per-block"),
    (["--total-timesteps", "1000", "--steps-per-block", str(2**31)], "--steps-per-block"),
]


def expect_one_line_error(capsys, tmp_path, argv, needle):
    output_dir = tmp_path / "out"
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        qlg.main([*argv, "--output-dir", str(output_dir)])
    assert exit_info.value.code not in (0, None)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], captured.err
    assert sorted(tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("name", BAD_MAPS)
def test_cli_rejects_bad_map_files(capsys, tmp_path, name):
    text, needle = BAD_MAPS[name]
    path = tmp_path / f"{name}.txt"
    path.write_text(text)
    expect_one_line_error(capsys, tmp_path, ["--layout", str(path)], needle)


@pytest.mark.parametrize("argv, needle", BAD_FLAGS)
def test_cli_rejects_bad_flags(capsys, tmp_path, argv, needle, monkeypatch):
    # The same on any machine: a GPU's 139 GB took a one-block run of 48 GB, and trained it.
    monkeypatch.setattr(qlg, "host_memory", lambda: 16 * 2**30)
    monkeypatch.setattr(qlg, "device_memory", lambda: 16 * 2**30)
    expect_one_line_error(capsys, tmp_path, argv, needle)


def test_too_many_blocks_to_index_are_refused_naming_the_fewest_steps(capsys, monkeypatch):
    """make_train indexes every block's curve point (24 bytes a block): 100,000 blocks of one
    step on a host of 2 MB are refused (had this check gone, the run would train, not hang)."""
    monkeypatch.setattr(qlg, "host_memory", lambda: 2_000_000)
    config = qlg.Config(total_timesteps=100_000, steps_per_block=1)
    with pytest.raises(SystemExit):
        qlg.check_memory(config, qlg.GridWorld(config.layout, config.max_episode_steps))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps-per-block: 100,000 blocks need" in err[0], err
    assert err[0].endswith("use --steps-per-block 3 or more"), err  # 24 x 100,000 / 1,000,000
    config = qlg.Config(total_timesteps=100_000, steps_per_block=3)
    qlg.check_memory(config, qlg.GridWorld(config.layout, config.max_episode_steps))  # accepted


def test_the_memory_is_the_tightest_cgroups_limit(fake_cgroups, tmp_path, capsys, monkeypatch):
    """In a container or a Slurm job (--mem) the cgroup's limit, not the machine's RAM, is the
    memory: in a cgroup of 1 GiB, 1,000 seeds passed the check against this machine's RAM and
    the kernel killed the run (exit 137, an empty folder left). Now one line naming
    --num-seeds."""
    assert qlg.cgroup_limit(*fake_cgroups) == 5 * 2**30  # v1's job, below v2's 6 GiB
    assert qlg.cgroup_limit(tmp_path / "no such file", tmp_path) == math.inf  # not Linux
    monkeypatch.setattr(qlg.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(qlg, "cgroup_limit", lambda: 2**30)
    config = qlg.Config(num_seeds=1_000)
    with pytest.raises(SystemExit):
        qlg.check_memory(config, qlg.GridWorld(config.layout, config.max_episode_steps))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-seeds 1000 needs about 2.5 GB" in err[0], err
    assert "(0.5 GB)" in err[0], err


def test_a_block_longer_than_the_run_needs_the_runs_memory_only(tmp_path, monkeypatch):
    """--steps-per-block 2*10^9 on a run of 1,000 steps is one block of 1,000 steps: accepted."""
    monkeypatch.setattr(qlg, "host_memory", lambda: 16 * 2**30)
    argv = ["--total-timesteps", "1000", "--steps-per-block", str(2 * 10**9)]
    qlg.main([*argv, "--output-dir", str(tmp_path / "run")])
    assert (tmp_path / "run" / "summary.json").is_file()


def test_cli_rejects_an_output_dir_that_is_a_file(capsys, tmp_path):
    path = tmp_path / "taken"
    path.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        qlg.main(["--output-dir", str(path)])
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--output-dir" in lines[0]
    assert path.read_text() == "keep me"


def test_a_run_under_jax_debug_nans_leaves_nan_where_no_episode_ended(tmp_path):
    """train's means are 0 where a curve point's stretch ended no episode (NaN would trip
    JAX_DEBUG_NANS=1); curves.csv still says nan there, as before, and only there."""
    argv = ["--num-seeds", "2", "--total-timesteps", "20000", "--steps-per-block", "100"]
    argv += ["--num-curve-points", "200", "--output-dir", str(tmp_path / "o")]
    env = {**os.environ, "JAX_DEBUG_NANS": "1"}
    result = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                            env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = (tmp_path / "o" / "curves.csv").read_text().splitlines()[1:]
    none_ended = [row.split(",")[2] == "0" for row in rows]  # seed,step,episodes,length,return
    assert any(none_ended) and not all(none_ended)
    assert [row.endswith(",nan,nan") for row in rows] == none_ended


def test_cli_process_bad_input_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--gamma", "1", "--output-dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "--gamma" in result.stderr
    assert not (tmp_path / "o").exists()


def test_a_run_started_with_stdout_and_stderr_closed_is_saved(tmp_path):
    """`>&- 2>&-`: Python starts with sys.stdout and sys.stderr None; the run goes on to its files,
    exit 0 (the three scripts share the line that opens /dev/null in their place)."""
    output = tmp_path / "run"
    argv = [sys.executable, str(SCRIPT), "--num-seeds", "2", "--output-dir", str(output)]
    closed = subprocess.run(["sh", "-c", 'exec "$@" >&- 2>&-', "sh", *argv], timeout=300)
    assert closed.returncode == 0
    assert all((output / name).is_file() for name in qlg.RUN_FILES), sorted(output.iterdir())


def test_cli_happy_path_writes_summary_and_figure(tmp_path):
    output_dir = tmp_path / "run"
    argv = ["--num-seeds", "3", "--layout", "maze", "--output-dir", str(output_dir)]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "agent-steps/s" in result.stdout and "compile" in result.stdout
    assert "\r" not in result.stdout + result.stderr  # plain lines in a log file
    summary = json.loads((output_dir / "summary.json").read_text())
    for key in ("config", "versions", "devices", "wall_time_s", "compile_time_s", "train_time_s"):
        assert key in summary
    assert summary["config"]["layout"] == qlg.LAYOUTS["maze"]
    assert summary["versions"]["jax"] == jax.__version__
    # What changes the bits: recorded as the run had them (conftest's XLA_FLAGS here)
    assert summary["jax_settings"]["XLA_FLAGS"] == os.environ["XLA_FLAGS"]
    assert summary["agent_steps_per_s"] > 0
    assert len(summary["seeds"]) == 3
    for seed in summary["seeds"]:
        assert seed["shortest_path_length"] == 22
        assert seed["greedy_path_length"] == 22
        assert seed["v_star_start"] == pytest.approx(GAMMA**21)
        assert seed["v_start"] == pytest.approx(GAMMA**21, rel=0.05)
    figure = output_dir / "q_learning_gridworld.png"
    assert figure.stat().st_size > 10_000


def test_benchmark_runs_from_the_repository_at_a_tiny_size():
    benchmark = SCRIPT.parent / "benchmarks" / "q_learning_gridworld.py"
    result = subprocess.run(
        [sys.executable, str(benchmark), "--timesteps", "20011", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    # A prime count of steps: one block (it ran blocks of 1 step, the gcd with 100,000, 80x slower)
    assert re.search(r"^ratio: [0-9]+x  \(20011 steps in blocks of 20011,", result.stdout, re.M), (
        result.stdout
    )


# ------------------------------------------------------------------------------------------
# Saved runs: curves.csv, q_tables.npy, --replot
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A small run saved by main, and what training returns for the same config and keys."""
    output_dir = tmp_path_factory.mktemp("saved")
    argv = ["--num-seeds", "2", "--output-dir", str(output_dir)]
    argv += [f"--{name.replace('_', '-')}={value}" for name, value in SMALL.items()]
    qlg.main(argv)
    config = qlg.Config(num_seeds=2, **SMALL)
    out, _ = qlg.train_seeds(qlg.make_train(config), config.seed, config.num_seeds)
    return output_dir, out


def test_csv_files_take_little_memory_to_write_and_read(tmp_path):
    """100,000 rows, written a seed at a time and parsed by numpy: 2.5 MB at the peak. All rows
    as Python floats, then a dict per row, took 41 MB: a run that the memory check let through
    ran out of memory drawing its figure, after training."""
    seeds, points = 1_000, 100
    values = np.random.default_rng(0).random((seeds, points))
    columns = {"seed": np.arange(seeds)[:, None], "step": np.arange(points), "value": values}
    tracemalloc.start()  # numpy reports its arrays to it too
    try:
        qlg.write_csv(tmp_path / "rows.csv", columns)
        read = qlg.read_csv(tmp_path / "rows.csv", tuple(columns), seeds)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10e6, peak
    np.testing.assert_array_equal(read["value"], values)  # every float as written
    np.testing.assert_array_equal(read["seed"][:, 0], np.arange(seeds))


def test_curves_csv_and_q_tables_round_trip(saved_run):
    output_dir, out = saved_run
    columns = ("seed", "step", "episodes", "mean_episode_length", "mean_return")
    curves = qlg.read_csv(output_dir / "curves.csv", columns, 2)
    assert tuple(curves) == columns and curves["step"].shape == (2, SMALL["num_curve_points"])
    np.testing.assert_array_equal(curves["seed"], [[0] * 10, [1] * 10])
    np.testing.assert_array_equal(curves["step"], out["metrics"]["timestep"])
    for name in columns[2:]:
        np.testing.assert_array_equal(curves[name], out["metrics"][name])
    first = qlg.read_csv(output_dir / "first_episodes.csv", ("seed", "episode", "length"), 2)
    np.testing.assert_array_equal(first["length"], out["metrics"]["episode_length"])
    marked = output_dir.parent / "marked.csv"  # a spreadsheet's byte-order mark first: it was
    marked.write_text("\ufeff" + (output_dir / "curves.csv").read_text())  # "its columns are not"
    np.testing.assert_array_equal(qlg.read_csv(marked, columns, 2)["step"], curves["step"])
    q_tables = np.load(output_dir / "q_tables.npy")
    assert q_tables.dtype == np.float32 and q_tables.shape == (2, 8, 12, 4)
    np.testing.assert_array_equal(q_tables, out["q_values"])
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["config"]["num_seeds"] == 2 and len(summary["seeds"]) == 2


def test_replot_redraws_the_figure_without_training(saved_run, monkeypatch, capsys):
    output_dir, _ = saved_run
    figure = output_dir / "q_learning_gridworld.png"
    figure.unlink()

    def no_training(*args, **kwargs):
        raise AssertionError("--replot must not train or compile")

    monkeypatch.setattr(qlg, "train_seeds", no_training)
    monkeypatch.setattr(jax, "jit", no_training)
    qlg.main(["--replot", str(output_dir)])
    assert figure.stat().st_size > 10_000
    assert capsys.readouterr().out.count("\n") == 1


@pytest.mark.parametrize("damaged", ["curves.csv", "q_tables.npy"])
def test_replot_of_a_run_with_a_damaged_file_is_one_line(saved_run, tmp_path, damaged):
    """A curves.csv with its header only gave numpy's warning (two lines) before an error that
    did not name the file; a q_tables.npy that is not .npy, numpy's advice to load it as a
    pickle (allow_pickle)."""
    run = tmp_path / "run"
    shutil.copytree(saved_run[0], run)
    header = (run / "curves.csv").read_text().splitlines()[0]
    (run / damaged).write_text(header if damaged == "curves.csv" else "not an array, but text")
    replot = [sys.executable, qlg.__file__, "--replot", str(run)]
    done = subprocess.run(replot, capture_output=True, text=True, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "allow_pickle" not in lines[0], lines
    assert f"cannot redraw ({damaged}: " in lines[0], lines  # numpy's own words named no file
    if damaged == "curves.csv":
        assert "cannot redraw (curves.csv: it holds no rows)" in lines[0], lines


def test_replot_takes_episodes_as_long_as_the_time_limit(tmp_path):
    """With --max-episode-steps 10, a run whose episodes the limit cuts has mean lengths of
    exactly 10: its own numbers, which check_episodes takes (the limit itself refused passed the
    suite), and refuses 10.5."""
    config = qlg.Config(total_timesteps=1_000, steps_per_block=100, num_curve_points=10,
                        max_episode_steps=10, num_recorded_episodes=3)  # fmt: skip
    curves = {
        "episodes": np.full((1, 10), 10.0),
        "mean_episode_length": np.full((1, 10), 10.0),
        "mean_return": np.zeros((1, 10)),
        "step": np.arange(100.0, 1_001.0, 100.0)[None],
    }
    first = {"length": np.full((1, config.num_recorded_episodes), 10.0)}
    qlg.check_episodes(tmp_path, config, curves, first)
    curves["mean_episode_length"][0, 3] = 10.5
    with pytest.raises(ValueError, match="its episodes and means are not ones a run makes"):
        qlg.check_episodes(tmp_path, config, curves, first)


def test_replot_refuses_saved_files_that_do_not_hold_together(saved_run, tmp_path, capsys):
    """Each was drawn (exit 0) or named no file: curves.csv without seed 1's rows (a band of
    seed 0's two halves), or with seed 1's first (drawn as seed 0), or with a value more than
    its header names, or each seed's steps reversed or scaled (a curve drawn backwards, or past
    the run's steps), or a negative mean episode length; first episodes longer than the run or
    negative (drawn as not ended), or fewer than the summary records; a summary edited to 1 or 3
    seeds, or to 2.5; Q-tables of another dtype (numpy's UFuncTypeError), or with a NaN (its
    cell drawn black, as a wall)."""
    run = tmp_path / "run"
    shutil.copytree(saved_run[0], run)
    whole = {name: (run / name).read_text() for name in ("summary.json", "curves.csv")}
    header, *rows = whole["curves.csv"].splitlines()
    summary = json.loads(whole["summary.json"])
    seeds = lambda n: json.dumps({**summary, "config": {**summary["config"], "num_seeds": n}})  # noqa: E731
    no_seed_1 = "\n".join([header, *(row for row in rows if row[0] != "1")])
    seed_1_first = "\n".join([header, *sorted(rows, key=lambda row: -int(row[0]))])  # same steps
    per_seed = [[row for row in rows if row.split(",")[0] == seed] for seed in "01"]
    steps_reversed = "\n".join([header, *(row for seed in per_seed for row in seed[::-1])])
    cells = [row.split(",") for row in rows]
    scaled = "\n".join([header, *(",".join([c[0], str(float(c[1]) * 10), *c[2:]]) for c in cells)])
    bad_table = "q_tables.npy: it holds complex128 (2, 8, 12, 4); the summary: float"
    tables = np.load(saved_run[0] / "q_tables.npy")
    with_nan = tables.copy()
    with_nan[0, 3, 3] = np.nan
    first_header, first_row, *first_rows = (run / "first_episodes.csv").read_text().splitlines()
    seed, episode, _ = first_row.split(",")
    first = lambda length: "\n".join([first_header, f"{seed},{episode},{length}", *first_rows])  # noqa: E731
    ended = next(i for i, row in enumerate(rows) if float(row.split(",")[2]) > 0)
    negative = [",".join([*r.split(",")[:3], "-540", *r.split(",")[4:]]) for r in rows[ended:][:1]]
    negative_mean = "\n".join([header, *rows[:ended], *negative, *rows[ended + 1 :]])
    lengths_are_not = "first_episodes.csv: its lengths are not ones a run makes"
    recorded = json.dumps({**summary, "config": {**summary["config"], "num_recorded_episodes": 5}})
    for name, damaged, why in (
        ("curves.csv", no_seed_1, "curves.csv: its rows are not the summary's 2 seeds"),
        ("curves.csv", seed_1_first, "curves.csv: its rows are not the summary's 2 seeds"),
        ("curves.csv", steps_reversed, "curves.csv: its rows are not the summary's 2 seeds"),
        ("curves.csv", scaled, "curves.csv: its last step is 200000, not the run's 20,000"),
        ("curves.csv", "\n".join([header, *(r + ",7" for r in rows)]), "curves.csv: its columns "),
        ("summary.json", seeds(1), "q_tables.npy: it holds float32 (2, 8, 12, 4); the summary: "),
        ("summary.json", seeds(3), "q_tables.npy: it holds float32 (2, 8, 12, 4); the summary: "),
        ("summary.json", seeds(2.5), "summary.json: num_seeds 2.5 is not of the type of its "),
        ("curves.csv", negative_mean, "curves.csv: its episodes and means are not ones a run "),
        ("first_episodes.csv", first(9_999_999), lengths_are_not),
        ("first_episodes.csv", first(-540), lengths_are_not),
        ("summary.json", recorded, "first_episodes.csv: it has 500 episodes, not the run's 5"),
        ("q_tables.npy", tables.astype(complex), bad_table),
        ("q_tables.npy", with_nan, "q_tables.npy: it holds a value that is not a finite number"),
    ):
        if isinstance(damaged, np.ndarray):
            np.save(run / name, damaged)
        else:
            (run / name).write_text(damaged)
        with pytest.raises(SystemExit) as exit_info:
            qlg.main(["--replot", str(run)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert f"cannot redraw ({why}" in err, err
        shutil.copy(saved_run[0] / name, run / name)


def test_replot_of_a_folder_that_is_no_run_or_with_a_bad_flag_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        qlg.main(["--replot", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--replot" in err, err
    # --layout (it has no default) and a flag at its default were let through, and ignored
    others = [("--num-seeds", "0"), ("--gamma", "0.5"), ("--overwrite", None)]
    for flag, value in [*others, ("--layout", "maze"), ("--gamma", "0.9")]:
        with pytest.raises(SystemExit) as exit_info:  # any other flag: the figures are the run's
            qlg.main(["--replot", str(tmp_path), flag, *([value] if value else [])])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and f"leave out {flag}" in err


def test_each_run_gets_a_new_folder_and_a_named_one_is_kept_unless_overwrite(
    tmp_path, monkeypatch, capsys
):
    """The default folder is new for every run (two in one second: _2); a folder named
    outright that holds a run is refused in one line; --overwrite replaces that run, and
    refuses a folder that holds anything else, leaving it as it was."""
    monkeypatch.chdir(tmp_path)
    tiny = ["--total-timesteps", "1000", "--steps-per-block", "500", "--num-seeds", "2"]
    qlg.main(tiny)
    qlg.main(tiny)
    first, second = sorted((tmp_path / "runs").glob("q_learning_gridworld_20*"))
    assert f"output {first.relative_to(tmp_path)}/" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        qlg.main([*tiny, "--output-dir", str(first)])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds a run" in err, err
    (first / "summary.json").write_text("an older run")
    qlg.main([*tiny, "--output-dir", str(first), "--overwrite"])
    assert json.loads((first / "summary.json").read_text())["config"]["output_dir"] == str(first)
    (second / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        qlg.main([*tiny, "--output-dir", str(second), "--overwrite"])
    assert "holds notes.txt, which no" in capsys.readouterr().err
    assert (second / "notes.txt").read_text() == "mine" and (second / "summary.json").exists()


def test_seed_i_is_the_same_agent_whatever_num_seeds(tmp_path):
    """Seeds 0 and 1 end with bit for bit the same Q-tables in a run of 3 seeds (one at a time
    on CPU) and one of 70 (vmapped): the layout changes, the agents do not."""
    tables = {}
    for num_seeds in (3, 70):
        output = tmp_path / str(num_seeds)
        argv = ["--num-seeds", str(num_seeds), "--total-timesteps", "20000"]
        qlg.main([*argv, "--steps-per-block", "10000", "--output-dir", str(output)])
        tables[num_seeds] = np.load(output / "q_tables.npy")[:2]
    np.testing.assert_array_equal(tables[3], tables[70])


def test_a_negative_seed_runs_end_to_end_as_fold_in_of_its_key(tmp_path):
    """--seed takes the signed 64-bit range (README); run from the command line, seed i of
    --seed -3 is train(fold_in(key(-3), i)) run alone, and not --seed 3's agent."""
    argv = ["--num-seeds", "2", *(f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items())]
    for seed in ("-3", "3"):
        qlg.main([*argv, f"--seed={seed}", "--output-dir", str(tmp_path / seed)])
    saved = {seed: np.load(tmp_path / seed / "q_tables.npy") for seed in ("-3", "3")}
    assert json.loads((tmp_path / "-3" / "summary.json").read_text())["config"]["seed"] == -3
    train = jax.jit(qlg.make_train(qlg.Config(**SMALL)))
    for i in range(2):
        alone = train(jax.random.fold_in(jax.random.key(-3), i))["q_values"]
        np.testing.assert_array_equal(saved["-3"][i], np.asarray(alone, np.float32))
    assert not np.array_equal(saved["-3"], saved["3"])


@pytest.mark.parametrize("asked", ["7", "1000000000"])
def test_too_many_curve_points_is_a_note_naming_the_flag(tmp_path, capsys, asked):
    """More points than blocks make one a block: a note, and the memory of those only (a
    billion points asked for would be 16 GB)."""
    argv = ["--total-timesteps", "300", "--steps-per-block", "100", "--num-curve-points", asked]
    qlg.main([*argv, "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"note: 3 curve points, not {asked}" in out and "--num-curve-points" in out


def test_a_map_too_large_for_the_figures_line_skips_value_iteration(monkeypatch):
    """The figure's line of a perfect learner's episode length is drawn for small maps only:
    on a large one value iteration takes minutes, while Ctrl-C waits for the figure."""
    env = qlg.GridWorld("S" + "." * 10_000 + "G")
    monkeypatch.setattr(qlg, "value_iteration", lambda *args: pytest.fail("value iteration ran"))
    assert qlg.expected_episode_length(env, epsilon=0.1, gamma=0.9) is None


@pytest.mark.parametrize("name", ["default", "maze", "four_rooms"])
def test_the_figures_expected_episode_length_is_exact(name):
    """Greedy on Q* walks a shortest path; exploring makes it longer, never shorter; with a time
    limit the line is not drawn (the figure showed 602 steps for episodes cut at 7). Any gamma
    in (0, 1) has the same greedy moves: at 0.4 the maze read 109 steps for 24.5, since Q*
    values below 1e-8 (gamma^distance) all counted as ties with isclose's default tolerance."""
    env = qlg.GridWorld(qlg.LAYOUTS[name])
    assert qlg.expected_episode_length(env, 0.0, 0.9) == pytest.approx(env.map.shortest_path_length)
    assert qlg.expected_episode_length(env, 0.0, 0.3) == pytest.approx(env.map.shortest_path_length)
    exploring = qlg.expected_episode_length(env, 0.1, 0.9)
    assert env.map.shortest_path_length < exploring
    assert qlg.expected_episode_length(env, 0.1, 0.4) == pytest.approx(exploring, rel=1e-6)
    limited = qlg.GridWorld(qlg.LAYOUTS[name], max_episode_steps=7)
    assert qlg.expected_episode_length(limited, 0.1, 0.9) is None


@pytest.mark.parametrize("gamma", ["0", "0.1"])
def test_a_start_value_of_zero_is_reported_not_divided_by(tmp_path, capsys, gamma):
    """gamma 0, or gamma^17 below value iteration's tolerance: V*(S) = 0, no relative error."""
    output_dir = tmp_path / "run"
    argv = ["--gamma", gamma, "--total-timesteps", "100000", "--output-dir", str(output_dir)]
    qlg.main([*argv, "--steps-per-block", "10000"])
    seed = json.loads((output_dir / "summary.json").read_text())["seeds"][0]
    assert seed["v_star_start"] == 0.0 and seed["v_start_relative_error"] is None


@pytest.mark.parametrize("kind", ["device", "fifo", "too_large", "shadows_a_built_in"])
def test_layout_reads_only_a_small_regular_file(tmp_path, monkeypatch, capsys, kind):
    """/dev/zero never ends, a FIFO blocks, a huge file takes minutes to parse, and a file
    named like a built-in map must not be silently replaced by it: one line each, no work."""
    monkeypatch.chdir(tmp_path)
    path = {
        "device": "/dev/zero",
        "fifo": "fifo",
        "too_large": "big.txt",
        "shadows_a_built_in": "maze",
    }[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "too_large":
        rows = ["S" + "." * 998, *["." * 999] * 298, "." * 998 + "G"]  # 300 KB, a map
        Path(path).write_text("\n".join(rows))  # (a map without S stopped at its parse)
    elif kind == "shadows_a_built_in":
        Path(path).write_text("S.G\n")
    with pytest.raises(SystemExit) as exit_info:
        qlg.main(["--layout", path, "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layout" in err[0], err
    shadowed = kind == "shadows_a_built_in"
    assert ("a built-in layout and a file" if shadowed else "file of at most 256 KiB") in err[0]
    assert not (tmp_path / "out").exists()


def test_a_folder_or_a_file_here_named_like_a_built_in_map_stops_no_run(tmp_path, monkeypatch):
    """A folder named maze is no map: --layout maze is the built-in one. A file named default
    here does not stop a run that leaves --layout out (it did: 'a built-in layout and a file')."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "maze").mkdir()
    (tmp_path / "default").write_text("S.G\n")
    assert qlg.parse_config(["--layout", "maze"]).layout == qlg.LAYOUTS["maze"]
    assert qlg.parse_config([]).layout == qlg.LAYOUTS["default"]
    assert qlg.parse_config(["--layout", "./default"]).layout == "S.G\n"


@pytest.mark.parametrize("name", ["", "x" * 300])
def test_output_dir_that_cannot_be_a_folder_is_one_line(tmp_path, monkeypatch, capsys, name):
    """An empty name would write into the current folder, a 300-character one is refused by
    the OS: both one line before any training, nothing written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        qlg.main(["--output-dir", name, "--num-seeds", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--output-dir" in err[0], err
    assert list(tmp_path.iterdir()) == []


SIGNAL_ARGV = [str(SCRIPT), "--num-seeds", "4096"]
SIGNAL_AFTER = " steps on "  # printed as training starts


def run_and_interrupt(argv: list[str], signum: int, after: str) -> tuple[int, str]:
    """Start the script with argv, send `signum` once `after` is printed -> (exit code, stderr)."""
    process = subprocess.Popen(
        [sys.executable, "-u", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    for line in process.stdout:  # "-u": lines arrive as they are printed
        seen.append(line)
        if after in line:
            process.send_signal(signum)
            break
    rest, _ = process.communicate(timeout=60)
    return process.returncode, "".join(seen) + rest


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_signal_during_training_is_one_line_and_its_exit_code(tmp_path, signum, code):
    """Ctrl-C (SIGINT), SIGTERM and a closed terminal (SIGHUP) stop a run that has started (here
    while it compiles) with one line and 130 / 143 / 129, no traceback, and no file written."""
    output = tmp_path / "run"
    argv = [*SIGNAL_ARGV, "--output-dir", str(output)]
    returncode, printed = run_and_interrupt(argv, signum, SIGNAL_AFTER)
    last = printed.strip().splitlines()[-1]
    assert returncode == code and "Traceback" not in printed, printed
    assert last.endswith("unfinished; no file half-written") and "stopped by" in last, printed
    assert not output.exists() or not any(output.iterdir())


def test_a_run_under_nohup_goes_on_after_sighup(tmp_path):
    """nohup ignores SIGHUP, so that a closed terminal does not end the run: the script, which
    otherwise stops on it (above), leaves it ignored, and the run ends whole, exit 0."""
    output = tmp_path / "run"
    process = subprocess.Popen(
        # A short run: 1M steps took over 120 s on a GPU shared by 14 test workers.
        ["nohup", sys.executable, "-u", str(SCRIPT), "--num-seeds", "3",
         "--total-timesteps", "200000", "--output-dir", output],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for line in process.stdout:  # the signal comes as it compiles: the run has not ended
        if SIGNAL_AFTER in line:
            process.send_signal(signal.SIGHUP)
            break
    else:
        pytest.fail("the run never started")
    printed, _ = process.communicate(timeout=120)
    assert process.returncode == 0 and (output / "summary.json").exists(), printed
