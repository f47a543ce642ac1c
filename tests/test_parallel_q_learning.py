"""Tests for parallel_q_learning.py: vmap/sharding equivalences, optimality against value
iteration, list parsing, memory refusal, CLI errors, one small CLI run, and
benchmarks/parallel_q_learning.py at a tiny size."""

import contextlib
import csv
import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_q_learning as pq

SCRIPT = Path(pq.__file__)
BENCHMARK = SCRIPT.parent / "benchmarks" / "parallel_q_learning.py"


def load_benchmark():
    """The benchmark module under another name: it is also called parallel_q_learning."""
    spec = importlib.util.spec_from_file_location("benchmark_parallel_q_learning", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Tiny but real: 2 x 2 grid, 3 seeds (odd, so 2 devices need padding), 5 curve points.
SMALL = pq.Config(
    total_timesteps=3_000,
    num_seeds=3,
    num_curve_points=5,
    learning_rates=(0.1, 0.5),
    epsilons=(0.1, 0.3),
    gammas=(0.9,),
)


def assert_results_equal(a: pq.TrainResult, b: pq.TrainResult) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bit for bit


@pytest.fixture(scope="module")
def small():
    """Compiled once for the module: one agent, seeds of one setting, and the whole grid."""
    train = pq.make_train(SMALL)
    grid = pq.hparam_grid(SMALL)
    return {
        "train": train,
        "alone": jax.jit(train),
        "over_seeds": jax.jit(jax.vmap(train, in_axes=(0, None))),
        "sweep": pq.make_sweep(train),
        "keys": jax.random.split(jax.random.key(7), SMALL.num_seeds),
        "grid": pq.HParams(*(jnp.asarray(x) for x in grid)),
    }


def grid_point(grid: pq.HParams, g: int) -> pq.HParams:
    return pq.HParams(*(x[g] for x in grid))


# --- vmap and sharding -------------------------------------------------------------------------


def test_vmap_over_seeds_equals_each_seed_alone(small):
    hparams = grid_point(small["grid"], 1)
    batched = small["over_seeds"](small["keys"], hparams)
    for s in range(SMALL.num_seeds):
        alone = small["alone"](small["keys"][s], hparams)
        assert_results_equal(jax.tree.map(lambda x, s=s: x[s], batched), alone)


def test_vmap_over_grid_and_seeds_equals_each_alone(small):
    swept = small["sweep"](small["keys"], small["grid"])  # [grid, seeds, ...]
    assert swept.q_table.shape == (4, SMALL.num_seeds, 8, 12, 4)
    for g in range(4):
        for s in range(SMALL.num_seeds):
            alone = small["alone"](small["keys"][s], grid_point(small["grid"], g))
            assert_results_equal(jax.tree.map(lambda x, g=g, s=s: x[g, s], swept), alone)


# The check above at XLA's default optimization level, which the script runs at (conftest.py
# lowers it for the tests). There XLA fused a multiply and an add into one FMA in one agent's
# program but not in a vmapped scatter-add: with the update written as .add(step), seed s of a
# sweep could not be run again alone (its Q-table differed in the last bits after 3,000 steps).
AT_DEFAULT_LEVEL = """
import jax, numpy as np, parallel_q_learning as pq
config = pq.Config(total_timesteps=3_000, num_seeds=3, num_curve_points=5)
train = pq.make_train(config)
keys = jax.random.split(jax.random.key(0), 3)
hparams = pq.HParams(learning_rate=0.1, epsilon=0.3, gamma=0.9)
batched = jax.jit(jax.vmap(train, in_axes=(0, None)))(keys, hparams)
for s in range(3):
    alone = jax.jit(train)(keys[s], hparams)
    for x, y in zip(jax.tree.leaves(alone), jax.tree.leaves(batched), strict=True):
        np.testing.assert_array_equal(x, y[s])
"""


def test_vmap_over_seeds_equals_each_seed_alone_at_xlas_default_level():
    flags = [f for f in os.environ["XLA_FLAGS"].split() if "optimization_level" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", AT_DEFAULT_LEVEL], capture_output=True, text=True,
                         cwd=SCRIPT.parent, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


def test_train_runs_eagerly_for_debugging_as_readme_shows():
    """README's recipe: train() under jax.disable_jit(), each op run as Python reaches it (for
    print and pdb), gives the jitted result up to float rounding (XLA fuses the update)."""
    config = pq.Config(layout="S..G", total_timesteps=40, rng_block_steps=10, num_curve_points=2)
    train, hparams = pq.make_train(config), pq.HParams(0.5, 0.1, 0.9)
    with jax.disable_jit():
        eager = train(jax.random.key(0), hparams)
    jitted = jax.jit(train)(jax.random.key(0), hparams)
    jax.tree.map(lambda e, j: np.testing.assert_allclose(e, j, rtol=1e-6), eager, jitted)
    assert np.asarray(eager.q_table).any()  # it learned


def test_seeds_are_independent_and_hparams_matter(small):
    swept = small["sweep"](small["keys"], small["grid"])
    q = np.asarray(swept.q_table)
    assert not np.array_equal(q[0, 0], q[0, 1]), "two seeds learned the same table"
    assert not np.array_equal(q[0, 0], q[3, 0]), "two settings learned the same table"


@pytest.mark.cpu_devices
def test_sharded_over_two_devices_matches_one_device(small):
    assert len(jax.devices()) == 2, "conftest should expose 2 CPU devices"
    keys_two = pq.make_seed_keys(3, SMALL.num_seeds, pq.seed_mesh())
    keys_one = pq.make_seed_keys(3, SMALL.num_seeds, pq.seed_mesh(jax.devices()[:1]))
    assert keys_two.shape == (4,) and keys_one.shape == (3,)  # 3 seeds padded to 4 on 2 devices
    assert len(keys_two.sharding.device_set) == 2
    # Seed i's key does not depend on the padding or the device count.
    expected = jax.random.key_data(jax.random.fold_in(jax.random.key(3), 2))
    np.testing.assert_array_equal(jax.random.key_data(keys_two[2]), expected)
    two = small["sweep"](keys_two, small["grid"])
    assert len(two.q_table.sharding.device_set) == 2
    one = small["sweep"](keys_one, small["grid"])
    assert_results_equal(jax.tree.map(lambda x: x[:, : SMALL.num_seeds], two), one)


@pytest.mark.cpu_devices
@pytest.mark.parametrize("agents_per_chunk", [4, 12])  # 4: 1 seed x 4 grid points per chunk
def test_sharded_sweep_in_chunks_equals_one_sweep(small, agents_per_chunk):
    mesh = pq.seed_mesh()
    config = dataclasses.replace(SMALL, num_seeds=5, agents_per_chunk=agents_per_chunk)
    chunks = pq.chunks_per_device(config, pq.make_env(config.layout), mesh)
    assert chunks == (3 if agents_per_chunk == 4 else 1)  # 3 seeds x 4 grid points a device
    keys = pq.make_seed_keys(3, 5, mesh, chunks)  # 6 padded seeds: 3 per device
    sharded = pq.shard_sweep(small["sweep"], mesh, chunks)
    result = sharded(keys, small["grid"])
    assert result.q_table.shape == (4, 6, 8, 12, 4)
    assert len(result.q_table.sharding.device_set) == 2
    assert_results_equal(result, small["sweep"](keys, small["grid"]))


def test_flat_sweep_equals_nested_vmap(small):
    """make_sweep's flat agent axis computes what the nested vmap of the idea computes."""
    train = small["train"]
    nested = jax.jit(jax.vmap(jax.vmap(train, in_axes=(0, None)), in_axes=(None, 0)))
    assert_results_equal(
        small["sweep"](small["keys"], small["grid"]), nested(small["keys"], small["grid"])
    )


@pytest.mark.cpu_devices
def test_cache_sized_chunks_on_cpu():
    """--agents-per-chunk 0 on a CPU: about 256 default-map tables a chunk, whole seeds."""
    mesh, env = pq.seed_mesh(), pq.make_env(pq.DEFAULT_LAYOUT)
    one_setting = {"learning_rates": (0.1,), "epsilons": (0.1,)}
    assert pq.chunks_per_device(pq.Config(num_seeds=4096, **one_setting), env, mesh) == 8
    assert pq.chunks_per_device(pq.Config(num_seeds=64), env, mesh) == 1  # 288 agents a device
    # 9 seeds a device, 4 chunks of 3: no chunk is all padding.
    config = pq.Config(num_seeds=18, agents_per_chunk=20)
    assert pq.chunks_per_device(config, env, mesh) == 3


@pytest.mark.parametrize("total", [1, 99, 100, 2_345, 100_000, 123_457])
def test_the_schedule_runs_exactly_total_timesteps(total):
    """Whole points of whole blocks, then a last point with the blocks and steps left over."""
    for points in (3, 50):
        config = pq.Config(total_timesteps=total, rng_block_steps=100, num_curve_points=points)
        s = pq.make_step_plan(config)
        whole = (s.num_points - 1) * s.blocks_per_point * s.block_steps
        assert whole + (s.last_point_blocks - 1) * s.block_steps + s.last_block_steps == total
        assert 1 <= s.num_points <= points and 1 <= s.last_point_blocks <= s.blocks_per_point
        assert 1 <= s.last_block_steps <= s.block_steps
    curve = jax.eval_shape(pq.make_train(config), jax.random.key(0), pq.HParams(0.1, 0.1, 0.9))
    assert curve.curve.episodes.shape == (s.num_points,)


@pytest.mark.parametrize("total", [250, 2_345])
def test_train_steps_the_environment_exactly_total_timesteps(total):
    """What the step plan says, train does: its GridWorld steps exactly total_timesteps times
    (counted on the host, a callback per step), with few curve points or many."""
    steps = []

    class Counting(pq.GridWorld):
        def step(self, key, state, action):
            jax.debug.callback(lambda: steps.append(1))
            return super().step(key, state, action)

    for points in (3, 50):
        config = pq.Config(total_timesteps=total, rng_block_steps=100, num_curve_points=points)
        env = Counting(**dataclasses.asdict(pq.make_env(config.layout)))
        steps.clear()
        jax.block_until_ready(
            jax.jit(pq.make_train(config, env))(jax.random.key(0), pq.HParams(0.1, 0.1, 0.9))
        )
        jax.effects_barrier()
        assert len(steps) == total, points


def test_memory_does_not_grow_with_total_timesteps():
    key, hparams = jax.random.key(0), pq.HParams(0.1, 0.1, 0.9)
    shapes = [
        jax.eval_shape(pq.make_train(pq.Config(total_timesteps=t)), key, hparams)
        for t in (100_000, 2**31 - 1)
    ]
    assert shapes[0] == shapes[1]
    assert shapes[0].curve.episodes.shape == (pq.Config().num_curve_points,)


# --- correctness against value iteration (written here, independently of the script) ----------


def value_iteration_from_text(text: str, gamma: float):
    """Q*[row, col, action] by value iteration straight from the map text, and S, G positions."""
    rows = [line for line in text.strip("\n").split("\n")]
    height, width = len(rows), len(rows[0])
    find = {ch: (r, line.index(ch)) for r, line in enumerate(rows) for ch in "SG" if ch in line}
    moves = [(0, 1), (1, 0), (0, -1), (-1, 0)]

    def move(r, c, a):
        r2, c2 = r + moves[a][0], c + moves[a][1]
        if 0 <= r2 < height and 0 <= c2 < width and rows[r2][c2] != "#":
            return r2, c2
        return r, c

    q = np.zeros((height, width, 4))
    for _ in range(height * width + 1):
        new_q = np.zeros_like(q)
        for r in range(height):
            for c in range(width):
                for a in range(4):
                    r2, c2 = move(r, c, a)
                    goal = (r2, c2) == find["G"]
                    new_q[r, c, a] = 1.0 if goal else gamma * q[r2, c2].max()
        q = new_q
    return q, find["S"], find["G"], move


@pytest.mark.parametrize(("layout", "shortest"), [("default", 18), ("maze", 22)])
def test_greedy_policy_is_optimal_at_good_settings(layout, shortest):
    gamma = 0.9
    config = pq.Config(
        layout=pq.LAYOUTS[layout], total_timesteps=150_000, num_seeds=8, num_curve_points=10,
        learning_rates=(0.5,), epsilons=(0.3,), gammas=(gamma,),
    )  # fmt: skip
    keys = pq.make_seed_keys(config.seed, config.num_seeds, pq.seed_mesh())
    hparams = pq.HParams(*(jnp.asarray(x) for x in pq.hparam_grid(config)))
    result = pq.make_sweep(pq.make_train(config))(keys, hparams)
    q_star, start, goal, move = value_iteration_from_text(pq.LAYOUTS[layout], gamma)
    assert q_star[start].max() == pytest.approx(gamma ** (shortest - 1))
    # The script's own value iteration agrees with this one.
    env = pq.make_env(pq.LAYOUTS[layout])
    np.testing.assert_allclose(pq.value_iteration(env, gamma).reshape(q_star.shape), q_star)
    for q in np.asarray(result.q_table[0]):  # [rows, cols, actions] per seed
        cell, steps = start, 0
        while cell != goal and steps <= shortest:
            action = int(q[cell].argmax())
            assert q_star[cell][action] == pytest.approx(q_star[cell].max()), (cell, action)
            cell, steps = move(*cell, action), steps + 1
        assert cell == goal and steps == shortest
        assert q[start].max() == pytest.approx(q_star[start].max(), abs=1e-3)
    assert np.all(np.asarray(result.curve.greedy_path_length[0, :, -1]) == shortest)


def test_numpy_reference_loop_learns_the_same_values():
    env = pq.make_env(pq.DEFAULT_LAYOUT)
    q = load_benchmark().numpy_q_learning(env, pq.HParams(0.5, 0.3, 0.9), steps=20_000, seed=0)
    assert q[env.start].max() == pytest.approx(0.9**17, abs=1e-3)  # V*(S) = gamma^(18 - 1)


def test_summary_checks_each_grid_point_against_value_iteration(small):
    env = pq.make_env(SMALL.layout)
    result = jax.tree.map(np.asarray, small["sweep"](small["keys"], small["grid"]))
    rows = pq.summarize_grid(SMALL, env, pq.make_step_plan(SMALL), result)
    assert len(rows) == 4
    for row in rows:
        assert row["shortest_path"] == 18
        assert row["value_iteration_start_value"] == pytest.approx(row["gamma"] ** 17, rel=1e-5)
        lo, hi = row["greedy_path_length"]["ci95"]
        assert lo <= row["greedy_path_length"]["mean"] <= hi
        lo, hi = row["greedy_path_optimal_fraction"]["ci95"]
        assert 0 <= lo <= row["greedy_path_optimal_fraction"]["mean"] <= hi <= 1


def test_the_summarys_shares_are_of_seeds_with_a_wilson_interval_and_of_training_steps():
    """The share of seeds on a shortest path had the mean's normal interval: [1.0, 1.0] for 256
    of 256, a claim of certainty, and bounds beyond 1 (62 of 64: [0.926, 1.012]). The share of
    training on a shortest path weighed a shorter last curve point as a whole one (3,001 steps in
    points of 1,000: the last point's 1 step counted as a quarter of training)."""
    assert pq.share_ci(np.ones(256, bool))["ci95"] == pytest.approx([0.98522, 1.0], abs=1e-5)
    low, high = pq.share_ci(np.arange(64) < 62)["ci95"]
    assert (low, high) == pytest.approx([0.8930, 0.9914], abs=1e-4)
    config = dataclasses.replace(SMALL, total_timesteps=3_001, num_curve_points=4)
    config = dataclasses.replace(config, rng_block_steps=1_000)
    plan = pq.make_step_plan(config)
    np.testing.assert_array_equal(pq.curve_steps(config, plan), [1_000, 2_000, 3_000, 3_001])
    env = pq.make_env(config.layout)
    grid, seeds = 4, config.num_seeds
    paths = np.full((grid, seeds, 4), env.shortest_path)
    paths[..., -1] = env.num_cells  # off the path for the last step only
    zeros = np.zeros((grid, seeds, 4), np.float32)
    curve = pq.Curve(episodes=zeros, greedy_path_length=paths, start_value=zeros)
    result = pq.TrainResult(q_table=None, curve=curve)
    for row in pq.summarize_grid(config, env, plan, result):
        assert row["optimal_time_share"]["mean"] == pytest.approx(3_000 / 3_001)
        assert row["greedy_path_optimal_fraction"]["mean"] == 0.0
        assert row["greedy_path_optimal_fraction"]["ci95"][1] > 0  # not zero-wide at 0%


def test_the_summarys_means_have_a_normal_interval_of_the_sample_sd_and_errors_are_absolute():
    """One grid point of 4 seeds x 3 curve points: greedy_path_length is the last point's mean,
    1.96 sample SDs (n - 1) over sqrt(n) either side, not the best point's; start_value_abs_error
    is |V(S) - V*(S)|, so that seeds above V* and below it do not cancel out; 2 of 4 seeds end on
    a shortest path, though 3 were on one before. (ddof 0, a signed error and the best path
    length each passed the suite.)"""
    config = dataclasses.replace(SMALL, num_seeds=4, num_curve_points=3, rng_block_steps=1_000)
    config = dataclasses.replace(config, learning_rates=(0.1,), epsilons=(0.1,), gammas=(0.9,))
    env = pq.make_env(config.layout)
    s = env.shortest_path
    paths = np.array([[s + 9, s, s + 2], [s + 9, s + 5, s], [s, s, s + 4], [s + 7, s, s]])
    v_star = float(pq.value_iteration(env, 0.9)[env.start].max())
    offsets = np.array([0.1, -0.1, 0.3, -0.3])
    start_value = np.repeat((v_star + offsets)[:, None], 3, axis=1).astype(np.float32)
    curve = pq.Curve(
        episodes=np.zeros((1, 4, 3), np.float32),
        greedy_path_length=paths[None],
        start_value=start_value[None],
    )
    plan = pq.make_step_plan(config)
    (row,) = pq.summarize_grid(config, env, plan, pq.TrainResult(q_table=None, curve=curve))
    final = paths[:, -1].astype(float)
    half = 1.96 * final.std(ddof=1) / np.sqrt(len(final))
    assert row["greedy_path_length"]["mean"] == pytest.approx(final.mean())
    assert row["greedy_path_length"]["ci95"] == pytest.approx(
        [final.mean() - half, final.mean() + half]
    )
    assert row["start_value_abs_error"]["mean"] == pytest.approx(0.2, abs=1e-6)
    assert row["greedy_path_optimal_fraction"]["mean"] == 0.5


# --- environment and agent pieces ----------------------------------------------------------------


def test_env_terminates_at_goal_truncates_and_resets():
    env = pq.make_env(pq.DEFAULT_LAYOUT, max_episode_steps=3)
    one_left_of_goal = pq.EnvState(cell=jnp.int32(1), time=jnp.int32(0))
    obs, state, reward, terminated, truncated, info = env.step(None, one_left_of_goal, 2)
    assert (int(info["final_observation"]), float(reward), bool(terminated)) == (env.goal, 1, True)
    assert int(obs) == env.start and int(state.time) == 0 and not bool(truncated)
    state = pq.EnvState(cell=jnp.int32(env.start), time=jnp.int32(2))
    obs, state, reward, terminated, truncated, info = env.step(None, state, 0)  # into the wall
    assert int(info["final_observation"]) == env.start and bool(truncated)
    assert not bool(terminated) and float(reward) == 0.0


def test_episodes_count_those_the_time_limit_ends_too():
    """A time limit of 5 steps on the 18-step map: no episode reaches G, every one is cut
    after 5 steps, so 3,000 steps make 600 episodes (the count once read 0: goals only)."""
    config = dataclasses.replace(SMALL, max_episode_steps=5, num_curve_points=3)
    result = jax.jit(pq.make_train(config))(jax.random.key(0), pq.HParams(0.1, 0.1, 0.9))
    np.testing.assert_array_equal(result.curve.episodes, [200, 200, 200])


def test_a_truncated_step_bootstraps_from_the_cell_it_reached_and_a_terminal_one_does_not():
    """On 'GS.' with one step per episode, random actions and learning rate 1 (the gridworld's
    test, ported): left enters G (Q = 1, no bootstrap); up and down stay at S and are cut by the
    time limit, so they bootstrap from S itself (Q = gamma * 1); right reaches a cell never acted
    from (Q = 0). A time limit taken as terminal would leave up and down at 0."""
    config = pq.Config(layout="GS.", max_episode_steps=1, total_timesteps=2_000, num_curve_points=1)
    hparams = pq.HParams(learning_rate=1.0, epsilon=1.0, gamma=0.9)
    result = jax.jit(pq.make_train(config))(jax.random.key(0), hparams)
    np.testing.assert_allclose(np.asarray(result.q_table)[0, 1], [0.0, 0.9, 1.0, 0.9], rtol=1e-6)


def test_epsilon_greedy_breaks_ties_uniformly_and_explores():
    high = jnp.arange(1 << 16, dtype=jnp.uint32) << pq.RANDOM_FIELD_BITS  # every high field
    q_s = jnp.array([0.0, 1.0, 0.0, 1.0])
    pick = jax.vmap(pq.epsilon_greedy, in_axes=(None, 0, None))
    greedy = np.bincount(np.asarray(pick(q_s, high, pq.explore_threshold(0.0))), minlength=4)
    assert greedy[0] == greedy[2] == 0 and greedy[1] == greedy[3] == 1 << 15
    explore = np.bincount(np.asarray(pick(q_s, high, pq.explore_threshold(1.0))), minlength=4)
    np.testing.assert_array_equal(explore, [1 << 14] * 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("\n\n", "empty map"),
        ("S..\n.G", "ragged rows: row 1"),
        ("S.x\n..G", "'x' at row 0, col 2"),
        ("...\n..G", "exactly one S"),
        ("S.G\nG..", "exactly one G"),
        ("S#.\n##G", "cannot be reached"),
        ("", "empty map"),
        ("S.\x0c.G", r"'\\x0c' at row 0, col 2"),  # splitlines made two rows of what editors show
    ],
)
def test_bad_maps_are_refused(text, message):
    with pytest.raises(pq.LayoutError, match=message):
        pq.make_env(text)


# --- command line ------------------------------------------------------------------------------


def test_the_grid_points_run_gamma_slowest_and_epsilon_fastest_each_in_its_field():
    config = pq.Config(learning_rates=(0.1, 0.5), epsilons=(0.2, 0.3), gammas=(0.9, 0.99))
    expected = [
        (lr, eps, gamma) for gamma in (0.9, 0.99) for lr in (0.1, 0.5) for eps in (0.2, 0.3)
    ]
    assert [tuple(point) for point in pq.grid_points(config)] == expected
    np.testing.assert_array_equal(pq.hparam_grid(config), np.float32(expected).T)


def test_parse_float_list():
    assert pq.parse_float_list("0.05,0.1, 0.5") == (0.05, 0.1, 0.5)
    for bad in ("", "0.1,,x", "0.1,x", "0.1,", "nan"):
        with pytest.raises(pq.argparse.ArgumentTypeError):
            pq.parse_float_list(bad)


def test_memory_refusal_names_the_flag(monkeypatch):
    with pytest.raises(pq.ConfigError, match="--num-seeds: .* GB"):
        config = pq.Config(num_seeds=10**9)
        pq.validate(config, pq.make_step_plan(config))
    # A grid of a billion points: refused before it is built (it would fill the memory first).
    values = tuple(np.linspace(0.001, 0.999, 1000).tolist())
    config = pq.Config(learning_rates=values, epsilons=values, gammas=values)
    monkeypatch.setattr(pq, "grid_points", lambda config: pytest.fail("built the grid"))
    with pytest.raises(pq.ConfigError, match="--num-seeds: .* x 1000000000 grid points"):
        pq.validate(config, pq.make_step_plan(config))
    # One agent's block of random bits over half the memory (here 8 GiB of a CPU): named.
    monkeypatch.setattr(pq.jax, "default_backend", lambda: "cpu")
    pages = {"SC_PHYS_PAGES": 2**21, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(pq.os, "sysconf", pages.get)
    config = pq.Config(rng_block_steps=2**30, total_timesteps=2**30)
    with pytest.raises(pq.ConfigError, match="--rng-block-steps: one agent needs about 8.6 GB"):
        pq.validate(config, pq.make_step_plan(config))


def test_the_memory_is_the_tightest_cgroups_limit(fake_cgroups, tmp_path, monkeypatch):
    """In a container or a Slurm job (--mem) the cgroup's limit, not the machine's RAM, is the
    memory: in a cgroup of 1 GiB, 20,000 seeds passed the check against this machine's RAM,
    trained, and the kernel killed the run as it drew its figures (exit 137, half of it
    written). Now refused before it trains, naming --num-seeds."""
    assert pq.cgroup_limit(*fake_cgroups) == 5 * 2**30  # v1's job, below v2's 6 GiB
    assert pq.cgroup_limit(tmp_path / "no such file", tmp_path) == math.inf  # not Linux
    monkeypatch.setattr(pq.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(pq, "cgroup_limit", lambda: 2**30)
    config = pq.Config(num_seeds=20_000, output_dir=str(tmp_path / "run"))
    with pytest.raises(pq.ConfigError, match=r"--num-seeds: .* more than 0.5 GB \(half the memory"):
        pq.validate(config, pq.make_step_plan(config))
    assert not (tmp_path / "run").exists()


# Port 9 (discard) on this machine: nobody listens there.
CLUSTER = ["--coordinator-address", "127.0.0.1:9", "--num-processes", "2"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--num-seeds", "0"], "--num-seeds"),
        (["--total-timesteps", "-5"], "--total-timesteps"),
        (["--learning-rates", "0.1,,x"], "--learning-rates"),
        (["--learning-rates", ""], "--learning-rates"),
        (["--learning-rates", "0.1,0"], "--learning-rates"),
        (["--learning-rates", "0.1,5"], "--learning-rates"),  # above 1: NaN tables
        (["--seed", str(2**63)], "--seed"),
        (["--epsilons", "1.5"], "--epsilons"),
        # One 16-bit threshold: the same agents twice, labelled apart (a uniform draw below both)
        (["--epsilons", "0.1,1e-9,2e-9"], "--epsilons: 1e-09 and 2e-09 explore alike"),
        (["--gammas", "1.0"], "--gammas"),
        (["--layout", "no_such_layout"], "--layout"),
        (["--num-seeds", "1000000000"], "--num-seeds"),
        (["--num-seeds", "many"], "--num-seeds"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--layout", "/no/such/map.txt"], "--layout"),
        (["--agents-per-chunk", "-1"], "--agents-per-chunk"),
        # A cluster that cannot form: one line before any work, not JAX's abort after a wait.
        (["--num-processes", "2"], "--process-id"),
        ([*CLUSTER, "--process-id", "2"], "--process-id"),
        (["--coordinator-address", "x", "--num-processes", "2", "--process-id", "1"], "HOST:PORT"),
        # IPv6: JAX aborted with a C++ trace a minute later ([::1] was "cannot resolve")
        (["--coordinator-address", "::1:9", "--num-processes", "1", "--process-id", "0"], "IPv6"),
        (["--coordinator-address", "[::1]:9", "--num-processes", "1", "--process-id", "0"], "IPv6"),
        ([*CLUSTER, "--process-id", "1", "--cluster-timeout", "0.5"], "--cluster-timeout"),
        (
            ["--coordinator-address", "no.invalid:1", "--num-processes", "1", "--process-id", "0"],
            "cannot resolve",
        ),
        ([*CLUSTER[:2], "--num-processes", str(2**31), "--process-id", "0"], "--num-processes"),
        (
            ["--coordinator-address", "x:\u0665", "--num-processes", "1", "--process-id", "0"],
            "HOST",
        ),
        ([*CLUSTER, "--process-id", "0", "--cluster-timeout", "nan"], "--cluster-timeout"),
        (["--cluster-timeout", "nan"], "--cluster-timeout"),  # given alone, checked all the same
        (["--coordinator-address", "x:99999", "--num-processes", "2", "--process-id", "0"], "HOST"),
        (["--max-episode-steps", str(2**31)], "--max-episode-steps"),  # int32 counters
        (["--total-timesteps", str(2**31)], "--total-timesteps"),  # an episode count went negative
        (["--gammas", "0.9,0.9"], "--gammas"),  # two grid points the same
        (["--gammas", "0.99999999999"], "--gammas"),  # 1.0 as a float32
        (["--gammas", "0.9,0.9000000001"], "--gammas"),  # the same float32
        (["--learning-rates", "1e-39"], "--learning-rates"),  # below normal float32s: 0 to XLA
    ],
)
def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys, argv, flag):
    output = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        pq.main([*argv, "--output-dir", str(output)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err
    assert err.startswith("parallel_q_learning.py: error: "), err  # as argparse names its own
    assert not output.exists()


def test_an_mpi_job_without_its_cluster_is_one_line(tmp_path):
    """An Open MPI world size with none of the job's other variables (JAX finds no
    coordinator): one line naming the variable and the flags to give, exit 2, nothing written."""
    env = {**os.environ, "OMPI_COMM_WORLD_SIZE": "3"}
    argv = [sys.executable, pq.__file__, "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "OMPI_COMM_WORLD_SIZE=3" in result.stderr and "--coordinator-address" in result.stderr
    assert not (tmp_path / "out").exists()


def test_cli_refuses_bad_map_file_and_file_as_output_dir(tmp_path, capsys):
    bad_map = tmp_path / "bad.txt"
    bad_map.write_text("S..\n.G")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for argv, flag in (
        (["--layout", str(bad_map), "--output-dir", str(tmp_path / "out")], "--layout"),
        (["--output-dir", str(not_a_dir)], "--output-dir"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            pq.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code != 0 and err.count("\n") == 1 and flag in err, err
    assert not (tmp_path / "out").exists() and not_a_dir.read_text() == ""


def test_cluster_processes_whose_device_lists_never_all_come_are_one_line(monkeypatch, capsys):
    """A process that stops between joining and JAX's first use of a device: the others wait for
    its list of CPU devices --cluster-timeout rounded up to minutes (JAX's own waits are 2 and 5
    minutes), then say so in one line, exit 1, not "no JAX backend" blaming XLA_FLAGS."""
    updates = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.update({name: value}))
    monkeypatch.setattr(pq, "check_coordinator", lambda *args: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: None)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)

    def devices():
        raise RuntimeError("Unable to initialize backend 'cpu': INTERNAL: Getting local "
                           "topologies failed: GetKeyValue() timed out (you may need to uninstall "
                           "the failing plugin package)\nand more")  # fmt: skip

    monkeypatch.setattr(jax, "devices", devices)
    with pytest.raises(SystemExit) as stop:
        pq.join_cluster("127.0.0.1:1234", 2, 1, cluster_timeout=90.0)
    assert updates["jax_cpu_get_local_topology_timeout_minutes"] == 2
    assert updates["jax_cpu_get_global_topology_timeout_minutes"] == 3
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1, err
    assert "error: another process of the cluster stopped (Unable to initialize" in err
    assert err.endswith("GetKeyValue() timed out)\n")  # not JAX's hint on plugins

    # Another failure in a cluster (this host's platform, say) is still this host's own line.
    def no_gpu():
        raise RuntimeError("Unable to initialize backend 'cuda': no CUDA-capable device")

    monkeypatch.setattr(jax, "devices", no_gpu)
    with pytest.raises(SystemExit) as stop:
        pq.check_backend()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "JAX_PLATFORMS=" in err and "no JAX backend" in err, err


def test_cli_error_in_a_fresh_process_has_no_traceback(tmp_path):
    output = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--epsilons", "0.1,-1", "--output-dir", str(output)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "--epsilons" in done.stderr, done.stderr
    assert not output.exists()


def test_a_large_grid_draws_readable_figures(tmp_path, monkeypatch):
    """11 learning rates x 7 epsilons: the heatmap's cells hold no text (at 20 x 20 theirs
    overlapped into stripes) and its axes at most 6 and 10 tick labels; the curves' legend names
    none of the 77 lines (at 20 x 20 they fell out of the figure, with matplotlib's warning)."""
    import matplotlib.axes

    lrs, epsilons = (",".join(f"{0.08 * (i + 1):.2f}" for i in range(n)) for n in (11, 7))
    argv = ["--learning-rates", lrs, "--epsilons", epsilons, "--total-timesteps", "1000"]
    pq.main([*argv, "--output-dir", str(tmp_path)])
    texts = []
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda *args, **kwargs: texts.append(1))
    figures, save = [], pq.save_figure  # drawn and written, and kept for a look
    monkeypatch.setattr(pq, "save_figure", lambda fig, *to: (save(fig, *to), figures.append(fig)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pq.plot_run(tmp_path)
    assert not caught and not texts, [str(w.message) for w in caught]
    heatmap, curves = figures
    assert all(len(ax.get_xticks()) <= 6 and len(ax.get_yticks()) <= 10 for ax in heatmap.axes[:2])
    assert [text.get_text() for text in curves.axes[0].get_legend().get_texts()] == [
        "shortest path (18)"
    ]


def test_many_gammas_draw_a_few_panels_spread_over_them(tmp_path, monkeypatch):
    """A panel per gamma made 400 gammas a figure 1,400 inches wide, drawn in ten minutes while a
    Ctrl-C waited for the files: at most MOST_PANELS (here 3) are drawn, the first, the last
    and one between, and each title says how many of the gammas it shows."""
    gammas = [f"0.{i}" for i in range(1, 10)]
    argv = ["--gammas", ",".join(gammas), "--num-seeds", "2", "--total-timesteps", "300"]
    pq.main([*argv, "--output-dir", str(tmp_path)])
    monkeypatch.setattr(pq, "MOST_PANELS", 3)
    figures, save = [], pq.save_figure
    monkeypatch.setattr(pq, "save_figure", lambda fig, *to: (save(fig, *to), figures.append(fig)))
    pq.plot_run(tmp_path)
    for figure in figures:
        titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
        assert titles[:3] == ["gamma = 0.1", "gamma = 0.5", "gamma = 0.9"], titles
        assert figure.get_suptitle().endswith("; 3 of the 9 gammas"), figure.get_suptitle()
    assert len(figures[1].axes) == 3  # the curves: a panel per gamma shown, its lines alone


def test_swept_values_are_shown_with_the_digits_that_tell_them_apart():
    """Two gammas that differ in float32 are two grid points; with `:g` the table, the panel
    titles, the legend and the ticks showed 0.999999 for both."""
    assert pq.apart([0.999999, 0.9999991, 0.999999]) == {
        0.999999: "0.999999",
        0.9999991: "0.9999991",
    }
    assert pq.apart([0.05, 0.1, 0.5]) == {0.05: "0.05", 0.1: "0.1", 0.5: "0.5"}  # as :g
    assert pq.ticks([0.05, 0.1, 0.5, 1.0], most=2) == (range(0, 4, 2), ["0.05", "0.5"])


def test_one_seed_heatmap_shows_its_values_not_an_interval_of_nans(tmp_path, monkeypatch):
    """One seed has no 95% CI: each cell shows the seed's value (it showed '[nan, nan]')."""
    pq.main(["--num-seeds", "1", "--total-timesteps", "1000", "--output-dir", str(tmp_path)])
    figures = []
    monkeypatch.setattr(pq, "save_figure", lambda fig, *to: figures.append(fig))
    pq.plot_run(tmp_path)
    texts = [text.get_text() for text in figures[0].axes[0].texts]
    assert len(texts) == 9 and all(re.fullmatch(r"[01]\.[0-9]{2}", text) for text in texts), texts
    assert figures[0].get_suptitle().endswith("cells: the seed's value")


def test_cli_happy_path(tmp_path, monkeypatch):
    output = tmp_path / "run"
    argv = [
        sys.executable, str(SCRIPT), "--output-dir", str(output), "--num-seeds", "3",
        "--total-timesteps", "2000", "--learning-rates", "0.1,0.5", "--epsilons", "0.1",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "agent-steps/s" in done.stdout and "3 seeds x 2 grid points" in done.stdout
    # Not a terminal: plain progress lines, about every 10%, with the rate and the time left.
    assert "\r" not in done.stdout + done.stderr and done.stdout.count("ETA") >= 5
    summary = json.loads((output / "summary.json").read_text())
    for key in ("config", "versions", "devices", "wall_time_s", "compile_time_s"):
        assert key in summary
    assert summary["agent_steps_per_s"] > 0 and len(summary["devices"]) == jax.device_count()
    assert summary["jax_settings"]["XLA_FLAGS"] == os.environ["XLA_FLAGS"]
    assert [(r["learning_rate"], r["epsilon"]) for r in summary["grid"]] == [(0.1, 0.1), (0.5, 0.1)]
    for name in ("sweep_heatmap.png", "learning_curves.png"):
        assert (output / name).stat().st_size > 0
    # curves.csv: one row per grid point x seed x curve point, equal to what summary.json holds
    with open(output / "curves.csv") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == [
        "learning_rate", "epsilon", "gamma", "seed", "step", "episodes", "greedy_path_length",
        "start_value",
    ]  # fmt: skip
    points = 20  # 2000 steps are 20 blocks of 100 (--rng-block-steps): at most 20 points
    assert "note: 20 curve points, not 50" in done.stdout
    assert len(rows) == 2 * 3 * points and rows[-1]["step"] == str(summary["steps_per_agent"])
    for g, grid_row in enumerate(summary["grid"]):
        mine = rows[g * 3 * points : (g + 1) * 3 * points]
        assert {float(r["learning_rate"]) for r in mine} == {grid_row["learning_rate"]}
        final = [float(r["greedy_path_length"]) for r in mine[points - 1 :: points]]
        assert np.mean(final) == pytest.approx(grid_row["greedy_path_length"]["mean"])
        episodes = np.sum([float(r["episodes"]) for r in mine]) / 3
        assert episodes == pytest.approx(grid_row["episodes_completed"]["mean"])
    assert np.load(output / "q_tables.npy").shape == (2, 3, 8, 12, 4)
    # --replot: the same figures again from the saved files alone, no JAX compile
    for name in ("sweep_heatmap.png", "learning_curves.png"):
        (output / name).unlink()
    replot = [sys.executable, str(SCRIPT), "--replot", str(output)]
    done = subprocess.run(replot, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.count("\n") == 1, done.stderr[-2000:]
    for name in ("sweep_heatmap.png", "learning_curves.png"):
        assert (output / name).stat().st_size > 0
    # A summary damaged outside its config, a curves.csv without a column the figure draws:
    # KeyErrors that named no file.
    whole = {name: (output / name).read_text() for name in ("summary.json", "curves.csv")}
    no_path = whole["curves.csv"].replace("greedy_path", "path")  # a column renamed
    for name, damaged, why in (
        ("summary.json", json.dumps({**summary, "grid": [{}] * 2}), "summary.json: KeyError: "),
        ("curves.csv", no_path, "curves.csv: it has no column 'greedy_path_length'"),
    ):
        (output / name).write_text(damaged)
        done = subprocess.run(replot, capture_output=True, text=True, check=False)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"cannot redraw ({why}" in done.stderr, done.stderr
        (output / name).write_text(whole[name])
    # Drawn before (exit 0): a summary edited to 1 seed, its learning rates reordered (the
    # heatmap placed the rows by them), a grid point's gamma changed; a value more in every row
    # of curves.csv. Named no file: 2.5 seeds (a reshape error), an unknown gamma (in list), an
    # infinite path length (matplotlib's log scale).
    config, rows, grid = summary["config"], whole["curves.csv"].splitlines(), summary["grid"]
    not_its = "summary.json: its grid is not its config's gammas x learning rates x epsilons"
    shortest = "summary.json: a shortest_path is not its map's 18"
    share, five = "greedy_path_optimal_fraction", {"mean": 5, "ci95": [0.0, 0.56]}  # drawn: 5.00
    not_curves = f"summary.json: its {share} is not curves.csv's"
    column = rows[0].split(",").index("greedy_path_length")  # inf: matplotlib's error, no file
    inf = ",".join("inf" if i == column else v for i, v in enumerate(rows[1].split(",")))
    huge = inf.replace("inf", "1e308")  # finite: numpy's overflow warnings, then matplotlib's
    below = inf.replace("inf", "1")  # shorter than the shortest path: drawn under its line
    twice = rows[0].replace("start_value", "greedy_path_length")  # its values drawn as lengths
    assert twice.count("greedy_path_length") == 2
    step = rows[0].split(",").index("step")  # every step 0: matplotlib's two-line warning
    zero = [",".join("0" if i == step else v for i, v in enumerate(r.split(","))) for r in rows[1:]]
    for name, edit, why in (
        ("summary.json", {"config": {**config, "num_seeds": 1}}, "curves.csv: its rows are not"),
        ("summary.json", {"config": {**config, "learning_rates": [0.5, 0.1]}}, not_its),
        ("summary.json", {"grid": [{**grid[0], "gamma": 0.5}, *grid[1:]]}, not_its),
        ("summary.json", {"config": {**config, "num_seeds": 2.5}}, "summary.json: num_seeds 2.5"),
        # Drawn as they came: numbers the figures take from the summary, not from curves.csv
        ("summary.json", {"grid": [{**grid[0], "shortest_path": 3}, *grid[1:]]}, shortest),
        ("summary.json", {"grid": [{**grid[0], share: five}, *grid[1:]]}, not_curves),
        ("summary.json", {"steps_per_agent": 10**9}, "summary.json: its steps_per_agent is not"),
        ("summary.json", {"config": {**config, "layout": "G..\n###\n..S"}}, "summary.json: "),
        ("curves.csv", [rows[0], *(row + ",7" for row in rows[1:])], "curves.csv: its header "),
        ("curves.csv", [rows[0], inf, *rows[2:]], "curves.csv: its greedy_path_length holds"),
        ("curves.csv", [rows[0], huge, *rows[2:]], "curves.csv: its greedy_path_length holds"),
        ("curves.csv", [rows[0], below, *rows[2:]], "curves.csv: its greedy_path_length holds"),
        ("curves.csv", [twice, *rows[1:]], "curves.csv: its header names 'greedy_path_length' t"),
        ("curves.csv", [rows[0], *zero], "curves.csv: its rows are not"),
    ):  # fmt: skip
        damaged = json.dumps({**summary, **edit}) if name == "summary.json" else "\n".join(edit)
        (output / name).write_text(damaged)
        with pytest.raises(ValueError, match=f"^{re.escape(why)}"):
            pq.plot_run(output)
        (output / name).write_text(whole[name])
    (output / "curves.csv").write_text("\ufeff" + whole["curves.csv"])  # a byte-order mark
    pq.plot_run(output)  # (a spreadsheet's save): not part of the first column's name
    (output / "curves.csv").write_text(whole["curves.csv"])
    # A figure that cannot be drawn: the other one was redrawn already, and the two disagreed
    figures = {name: b"drawn before" for name in pq.RUN_NAMES if name.endswith(".png")}
    for name, old in figures.items():
        (output / name).write_bytes(old)

    class Undrawable:
        def savefig(self, *args, **kwargs):
            raise ValueError("the test's own")

    with monkeypatch.context() as patch, pytest.raises(ValueError, match="the test's own"):
        patch.setattr(pq, "plot_curves", lambda *args: Undrawable())
        pq.plot_run(output)
    assert {name: (output / name).read_bytes() for name in figures} == figures
    assert len(figures) == 2 and not list(output.glob(".*"))
    # A folder at a figure's name: the heatmap was replaced, then the rename failed, leaving its
    # temporary file and a traceback-worded line naming it. Now one line before either is renamed
    (output / "learning_curves.png").unlink()
    (output / "learning_curves.png").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        pq.plot_run(output)
    assert exit_info.value.code == 1 and not list(output.glob(".*"))
    assert (output / "sweep_heatmap.png").read_bytes() == figures["sweep_heatmap.png"]
    (output / "learning_curves.png").rmdir()
    # Q-tables that are not the run's: required, and never read (their header is read now)
    tables = np.load(output / "q_tables.npy")
    for damaged, why in (tables.astype(complex), "complex128"), (tables[:1], "float32 (1, 3"):
        np.save(output / "q_tables.npy", damaged)
        with pytest.raises(ValueError, match=f"^q_tables.npy: it holds {re.escape(why)}"):
            pq.plot_run(output)
    np.save(output / "q_tables.npy", tables)
    # A curves.csv with its header only: one line that names it (numpy's warning came first).
    (output / "curves.csv").write_text((output / "curves.csv").read_text().splitlines()[0])
    done = subprocess.run(replot, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot redraw (curves.csv: it holds no rows)" in done.stderr, done.stderr


def test_seed_i_is_the_same_agent_whatever_num_seeds(tmp_path):
    """Seeds 0 and 1 of every grid point end with bit for bit the same Q-tables in a run of 3
    seeds and in runs of 40 (other padding): a device's agents vmapped 18 or 180 at once, or in
    10 chunks of 18 (--agents-per-chunk 16: 2 seeds x 9 grid points)."""
    tables = {}
    for num_seeds, chunk in ((3, "0"), (40, "0"), (40, "16")):
        output = tmp_path / f"{num_seeds}_{chunk}"
        pq.main(["--num-seeds", str(num_seeds), "--total-timesteps", "20000", "--output-dir",
                 str(output), "--agents-per-chunk", chunk])  # fmt: skip
        tables[num_seeds, chunk] = np.load(output / "q_tables.npy")[:, :2]
    np.testing.assert_array_equal(tables[3, "0"], tables[40, "0"])
    np.testing.assert_array_equal(tables[3, "0"], tables[40, "16"])


def test_process_0_alone_is_one_line_once_the_cluster_timeout_passes(tmp_path, capsys):
    """Process 0 of three whose peers never start: one line after --cluster-timeout (JAX would
    abort with a C++ stack trace), exit 2, nothing written."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cluster = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "3"]
    argv = [*cluster, "--process-id", "0", "--cluster-timeout", "1"]
    with pytest.raises(SystemExit) as exit_info:
        pq.main([*argv, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "0 of the 2 other processes came within 1 s (--cluster-timeout)" in err, err
    assert not (tmp_path / "out").exists()


def launch_cluster(tmp_path, argv: list[str], only_1=(), env_1=None) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a cluster on 127.0.0.1, one CPU device each, writing to
    tmp_path/process<i>; `only_1`: flags given to process 1 alone, last; `env_1`: its environment
    variables."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cluster = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
    flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=1"  # the last wins
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}  # on a GPU machine too
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *argv, *cluster, "--process-id", str(i)]
            + ["--output-dir", str(tmp_path / f"process{i}"), *(only_1 if i == 1 else ())],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env | (env_1 or {}) if i == 1 else env,
        )  # fmt: skip
        for i in range(2)
    ]


@pytest.mark.cpu_devices
def test_two_processes_make_one_cluster_and_train_the_same_agents(tmp_path):
    """Two processes on 127.0.0.1, one CPU device each, form one JAX cluster: the seeds are
    sharded over both, only process 0 writes, both exit 0, and every agent is bit for bit the
    one a single process with two devices trains."""
    argv = ["--num-seeds", "5", "--total-timesteps", "2000", "--learning-rates", "0.1,0.5"]
    pq.main([*argv, "--output-dir", str(tmp_path / "single")])
    (tmp_path / "a file").write_text("")  # process 1's folder, never used, cannot be made:
    processes = launch_cluster(tmp_path, argv, ["--output-dir", str(tmp_path / "a file/1")])
    results = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], results
    assert "2 cpu devices" in results[0][0] and results[1][0].count("agent-steps/s") == 0
    # Nor gloo's "[Gloo] Rank 1 is connected to 1 peer ranks...", a line in each (a pass found)
    assert "[Gloo]" not in results[0][0] and results[1][0] == "", results
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a file", "process0", "single"]
    for name in ("q_tables.npy", "curves.csv"):
        single = (tmp_path / "single" / name).read_bytes()
        assert (tmp_path / "process0" / name).read_bytes() == single, name


def watching(pid: int) -> bool:
    """Whether watcher `pid` has its child, and has unblocked Ctrl-C (Linux: /proc/PID/status's
    SigBlk): past where it passes on a signal that came as it started the child."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    blocked = int(next(line.split()[1] for line in status if line.startswith("SigBlk:")), 16)
    child = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return bool(child) and not blocked & (1 << (signal.SIGINT - 1))


def test_ctrl_c_to_process_1s_pid_alone_reaches_its_child(tmp_path):
    """`kill -INT` (or `kill -HUP`) to process 1's pid alone, not to its terminal's process
    group: its watcher ignored it (a terminal's would reach the child too), and the run went on,
    here waiting for a process 0 that never comes until --cluster-timeout, exit 2 (found by an
    adversarial pass). Now the child has a session of its own, and the watcher passes on every
    signal: one line, exit 130. (The DQN's test sends it to process 1 as a cluster trains.)"""
    cluster = ["--coordinator-address", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1"]
    argv = [sys.executable, str(SCRIPT), *cluster, "--cluster-timeout", "60"]
    pipe = subprocess.PIPE
    process = subprocess.Popen([*argv, "--output-dir", str(tmp_path / "run")], stderr=pipe)
    while process.poll() is None and not watching(process.pid):
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    err = process.communicate(timeout=60)[1].decode().strip().splitlines()
    assert process.returncode == 130 and len(err) == 1 and "stopped by Ctrl-C" in err[0], err
    assert not (tmp_path / "run").exists()


def test_two_process_benchmark_runs_at_a_tiny_size():
    """So tiny (10 steps) that the script prints its rate as "0.0M agent-steps/s": read as 0, it
    ended the benchmark in a ZeroDivisionError; the benchmark reads summary.json's rate now."""
    bench = SCRIPT.parent / "benchmarks" / "two_processes.py"
    argv = ["parallel_q_learning.py", "--repeats", "1", "--num-seeds", "2"]
    argv += ["--total-timesteps", "10"]
    done = subprocess.run([sys.executable, str(bench), *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ratio = re.search(r"2 processes / 1 process: training rate ([\d.]+)x", done.stdout)
    assert ratio and float(ratio.group(1)) > 0, done.stdout


@pytest.mark.parametrize(
    ("held", "argv", "problem"),
    [
        (["summary.json"], [], "already holds a run"),
        (["summary.json", "notes.txt"], ["--overwrite"], "holds notes.txt, which no"),
        (["notes.txt"], [], "holds notes.txt, which no"),  # not "holds a run"
    ],
)
def test_an_output_dir_that_holds_a_run_is_kept_unless_overwrite(
    tmp_path, capsys, held, argv, problem
):
    for name in held:
        (tmp_path / name).write_text("kept")
    with pytest.raises(SystemExit) as exit_info:
        pq.main(["--output-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and problem in err, err
    assert all((tmp_path / name).read_text() == "kept" for name in held)


def test_a_signal_during_replot_waits_until_both_figures_are_redrawn(tmp_path, capsys, monkeypatch):
    """--replot writes two figures: a SIGTERM between them waits for the second, then stops the
    script (143), so the pair is never one new figure beside an old one."""
    run = tmp_path / "run"
    pq.main(["--num-seeds", "2", "--total-timesteps", "1000", "--output-dir", str(run)])
    for name in ("sweep_heatmap.png", "learning_curves.png"):
        (run / name).unlink()
    save_figure = pq.save_figure

    def then_a_signal(fig, path, together):
        save_figure(fig, path, together)
        os.kill(os.getpid(), signal.SIGTERM)  # after the first figure, before the second

    monkeypatch.setattr(pq, "save_figure", then_a_signal)
    monkeypatch.setattr(pq, "RECEIVED", [])
    previous = signal.signal(signal.SIGTERM, pq.stop)  # as when run as a script
    try:
        with pytest.raises(SystemExit) as exit_info:
            pq.main(["--replot", str(run)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err.strip()
    stopped = "parallel_q_learning.py: stopped by SIGTERM once each figure was written whole"
    assert exit_info.value.code == 143 and err == stopped, err
    assert (run / "sweep_heatmap.png").exists() and (run / "learning_curves.png").exists()


def test_replot_does_not_train_and_a_bad_folder_or_flag_is_one_line(tmp_path, capsys, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("--replot must not train or compile")

    run = tmp_path / "run"  # a real run (only refusals were replotted here, before any work)
    pq.main(["--num-seeds", "2", "--total-timesteps", "1000", "--output-dir", str(run)])
    for name in ("sweep_heatmap.png", "learning_curves.png"):
        (run / name).unlink()
    monkeypatch.setattr(pq, "run_sweep", no_training)
    monkeypatch.setattr(jax, "jit", no_training)
    pq.main(["--replot", str(run)])
    assert (run / "sweep_heatmap.png").exists() and (run / "learning_curves.png").exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        pq.main(["--replot", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--replot" in err, err
    for name in pq.RUN_FILES:  # the gridworld's run has these files too: named (a KeyError)
        (tmp_path / name).write_text('{"config": {}, "seeds": []}')
    with pytest.raises(SystemExit) as exit_info:
        pq.main(["--replot", str(tmp_path)])
    assert "not a run of parallel_q_learning.py" in capsys.readouterr().err
    # --layout (it has no default) and a flag at its default were let through, and ignored
    others = [("--num-seeds", "0"), ("--gamma", "0.5"), ("--overwrite", None)]
    for flag, value in [*others, ("--layout", "maze"), ("--gammas", "0.9")]:
        with pytest.raises(SystemExit) as exit_info:  # any other flag: the figures are the run's
            pq.main(["--replot", str(tmp_path), flag, *([value] if value else [])])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and f"leave out {flag}" in err


def test_help_shows_defaults_as_typed(capsys):
    with pytest.raises(SystemExit):
        pq.parse_config(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: 0.05,0.1,0.5)" in help_text and "(default: default)" in help_text
    assert "(0.05" not in help_text and "G..." not in help_text


def test_benchmark_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark().main(["--max-agents", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--max-agents" in err, err


@pytest.mark.cpu_devices
def test_benchmark_runs_at_a_tiny_size(tmp_path):
    """Into a folder named with {time}, as the scripts' (it was checked as the time filled in,
    that folder made and left empty, and then the results written to a folder named "{time}")."""
    argv = [
        sys.executable, str(BENCHMARK), "--output-dir", str(tmp_path / "bench_{time}"),
        "--max-agents", "4",
        "--agent-steps", "4000", "--numpy-steps", "200", "--repeats", "1",
        "--yardstick-timesteps", "100", "--yardstick-agents", "4",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "/ yardstick:" in done.stdout, done.stdout
    [output] = tmp_path.iterdir()
    assert output.name.startswith("bench_20"), output  # bench_YYYY-MM-DD_HH-MM-SS
    bench = json.loads((output / "benchmark.json").read_text())
    methods = {(r["method"], r["devices"], r["agents"]) for r in bench["rows"]}
    assert {
        ("numpy loop", 1, 1),
        ("jit, one agent", 1, 1),
        ("vmap, chunks", 1, 4),
        ("vmap, chunks", 2, 4),
        ("vmap, all at once", 2, 4),
    } <= methods
    assert bench["yardstick"]["agent_steps_per_s"] > 0
    assert any("on 1 device" in name for name in bench["ratios"])
    assert any(name.endswith("/ yardstick") for name in bench["ratios"])
    assert (output / "benchmark.png").stat().st_size > 0
    assert sorted(path.name for path in output.iterdir()) == ["benchmark.json", "benchmark.png"]


def test_benchmark_files_are_written_whole(tmp_path, capsys):
    """A write cut short (a Ctrl-C, a full disk) leaves the previous run's files as they were,
    both of them, and no temporary file; writes that end replace both. A full disk is one line
    naming the file, exit 1 (it was a traceback)."""
    write_whole = load_benchmark().write_whole
    paths = [tmp_path / "benchmark.json", tmp_path / "benchmark.png"]
    for path in paths:
        path.write_text("the previous run")

    def cut_short(temporary):
        temporary.write_text("half of")
        raise KeyboardInterrupt

    def this_run(temporary):
        temporary.write_text("this run")

    def full_disk(temporary):
        temporary.write_text("half of")
        raise OSError(28, "No space left on device")

    with pytest.raises(KeyboardInterrupt):  # the figure's write stops: the json stays old too
        write_whole({paths[0]: this_run, paths[1]: cut_short})
    assert sorted(tmp_path.iterdir()) == paths
    assert [path.read_text() for path in paths] == ["the previous run"] * 2
    with pytest.raises(SystemExit) as exit_info:
        write_whole({paths[0]: this_run, paths[1]: full_disk})
    err = capsys.readouterr().err.splitlines()  # prefixed by the command's name, pytest's here
    line = f": error: cannot write {paths[1]} (No space left on device)"
    assert exit_info.value.code == 1 and len(err) == 1 and err[0].endswith(line), err
    assert sorted(tmp_path.iterdir()) == paths
    assert [path.read_text() for path in paths] == ["the previous run"] * 2
    write_whole(dict.fromkeys(paths, this_run))
    assert sorted(tmp_path.iterdir()) == paths
    assert [path.read_text() for path in paths] == ["this run"] * 2


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
        pq.main(["--layout", path, "--output-dir", str(tmp_path / "out")])
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
    assert pq.parse_config(["--layout", "maze"])[0].layout == pq.LAYOUTS["maze"]
    assert pq.parse_config([])[0].layout == pq.LAYOUTS["default"]
    assert pq.parse_config(["--layout", "./default"])[0].layout == "S.G\n"


@pytest.mark.parametrize("name", ["", "x" * 300])
def test_output_dir_that_cannot_be_a_folder_is_one_line(tmp_path, monkeypatch, capsys, name):
    """An empty name would write into the current folder, a 300-character one is refused by
    the OS: both one line before any training, nothing written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        pq.main(["--output-dir", name, "--num-seeds", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--output-dir" in err[0], err
    assert list(tmp_path.iterdir()) == []


SIGNAL_ARGV = [str(SCRIPT), "--num-seeds", "1024"]
SIGNAL_AFTER = "10%"  # printed once training runs


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


# One signal here (the gridworld's tests send all three): each run costs a compile.
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGHUP, 129)])
def test_a_signal_during_training_is_one_line_and_its_exit_code(tmp_path, signum, code):
    """Ctrl-C (SIGINT), SIGTERM and a closed terminal (SIGHUP) stop the run within a moment,
    mid-training, with one line and 130 / 143 / 129, no traceback, and no file written."""
    output = tmp_path / "run"
    argv = [*SIGNAL_ARGV, "--output-dir", str(output)]
    returncode, printed = run_and_interrupt(argv, signum, SIGNAL_AFTER)
    last = printed.strip().splitlines()[-1]
    assert returncode == code and "Traceback" not in printed, printed
    assert last.endswith("unfinished; no file half-written") and "stopped by" in last, printed
    assert not output.exists() or not any(output.iterdir())


# The script run as __main__, with a stdout whose first progress line meets a SIGTERM: what
# stop() does when a GPU runs the progress callback on the main thread, where signals land.
SIGNAL_IN_CALLBACK = """
import runpy, signal, sys

class SignalWhilePrinting:
    def write(self, text):
        if "agent-steps/s" in text:
            script = sys.modules["__main__"]
            script.RECEIVED.append(signal.SIGTERM)
            raise script.Stopped(signal.SIGTERM)
        return sys.__stdout__.write(text)

    def flush(self):
        sys.__stdout__.flush()

sys.stdout, sys.argv = SignalWhilePrinting(), sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_signal_in_the_progress_callback_is_one_line(tmp_path):
    """A signal handled inside the callback ends the compiled call with an XLA error (and JAX
    logs its traceback): the run still stops with one line, 143, nothing written."""
    output = tmp_path / "run"
    argv = ["--num-seeds", "3", "--total-timesteps", "2000", "--output-dir", str(output)]
    command = [sys.executable, "-c", SIGNAL_IN_CALLBACK, str(SCRIPT), *argv]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 143 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("unfinished; no file half-written") and "SIGTERM" in last, done.stderr
    assert not output.exists() or not any(output.iterdir())


def test_process_0_counts_the_processes_that_knock_not_connections(capsys):
    """Process 0 of three waits for processes 1 and 2 to knock: a connection that is no knock
    (the JAX client of process 1 once it knocked) is not process 2, whom it waits for until the
    --cluster-timeout. The DQN's copy of the protocol is tested in full (ids, counts, a slow
    client); this checks the parallel script's copy on the case that made JAX abort."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"

    def client():
        for _ in range(100):  # until the probe listens, within moments
            port = int(address.split(":")[1])
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as c:
                return c.sendall(b"PRI * HTTP/2.0\r\n")
            time.sleep(0.05)

    threads = [threading.Thread(target=client)]
    threads.append(threading.Thread(target=pq.check_coordinator, args=(address, 1, 3, 5)))
    for thread in threads:
        thread.start()
    with pytest.raises(SystemExit):
        pq.check_coordinator(address, 0, 3, 3)
    for thread in threads:
        thread.join()
    assert "1 of the 2 other processes came within 3 s" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("only_1", "env_1", "line"),
    [
        (["--learning-rates", "0.1,0.5,0.9"], {}, "--learning-rates differs between the processes"),
        (
            [],
            {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
            "the processes have other numbers of devices (1 on process 0, 2 on process 1)",
        ),
    ],
    ids=["flags", "devices"],
)
def test_processes_given_other_flags_are_one_line_before_training(tmp_path, only_1, env_1, line):
    """Process 1 given another list of learning rates: JAX would abort on the other shape (a
    C++ trace from gloo), and another value of the same shape would silently train process 1's
    share of the agents with it. Or two devices to process 0's one: process 0 failed in its
    first gather and process 1 blamed process 0 (found by an adversarial pass). One line in both,
    naming what differs, exit 2, nothing written."""
    argv = ["--num-seeds", "3", "--total-timesteps", "2000"]
    for process in launch_cluster(tmp_path, argv, only_1, env_1):
        _, err = process.communicate(timeout=120)
        last = err.strip().splitlines()[-1]
        assert process.returncode == 2 and "Traceback" not in err, err
        assert last == f"parallel_q_learning.py: error: {line}; give all the same", err
    assert not any(tmp_path.iterdir())


def test_a_current_folder_that_was_deleted_is_one_line(tmp_path):
    """A relative --output-dir (the default, or one named) in a current folder that was deleted:
    one line."""
    for named in ("", "--output-dir run"):
        gone = tmp_path / "gone"
        gone.mkdir()
        deleted = f'cd "$1" && rmdir "$1" && exec "$2" "$3" --total-timesteps 1000 {named}'
        command = ["sh", "-c", deleted, "sh", gone, sys.executable, SCRIPT]
        result = subprocess.run(command, capture_output=True, text=True)
        err = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(err) == 1 and "--output-dir" in err[0], err


def test_an_error_of_a_run_of_one_process_is_its_own_not_a_clusters(tmp_path, capsys):
    """A failure of the compiled call in a run of one process (a GPU out of memory, say; here a
    transfer guard that forbids passing the grid to it) was reported as "another process of the
    cluster stopped". It is JAX's own error now, and the run's folder goes."""
    output = tmp_path / "made" / "run"
    argv = ["--num-seeds", "2", "--total-timesteps", "2000", "--output-dir", str(output)]
    with jax.transfer_guard("disallow"), pytest.raises(jax.errors.JaxRuntimeError) as error:
        pq.main(argv)
    assert "Disallowed host-to-device transfer" in str(error.value)
    assert "cluster" not in capsys.readouterr().err and not (tmp_path / "made").exists()
