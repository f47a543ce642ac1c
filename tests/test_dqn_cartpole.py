"""Tests for dqn_cartpole.py: environment parity, replay buffer, TD target, seeds,
vmap == single key, learning, command line. Tiny configs; compiled functions are
shared through module-scoped fixtures to keep the file fast."""

import argparse
import contextlib
import csv
import dataclasses
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import flax
import gymnasium
import gymnax
import jax
import jax.numpy as jnp
import matplotlib.animation
import msgpack
import numpy as np
import pytest

import dqn_cartpole as dqn

TINY = dataclasses.replace(
    dqn.Config(),
    total_timesteps=1_000,
    eval_every=500,
    learning_starts=200,
    buffer_size=256,
    batch_size=16,
    hidden_sizes=(16, 16),
    train_frequency=2,
    target_update_interval=100,
    eval_episodes=2,
    num_seeds=3,
)
# TINY on the command line.
TINY_ARGS = shlex.split(
    "--total-timesteps 1000 --eval-every 500 --num-seeds 3 --hidden-sizes 16,16 --buffer-size 256 "
    "--batch-size 16 --train-frequency 2 --target-update-interval 100 --learning-starts 200 "
    "--eval-episodes 2"
)


def policy(obs: np.ndarray, rng: np.random.Generator, noise: float = 0.05) -> int:
    """A balancing controller; with `noise` 1 a random policy (short episodes)."""
    if rng.random() < noise:
        return int(rng.integers(2))
    return int(obs[2] + 0.5 * obs[3] + 0.01 * obs[0] + 0.05 * obs[1] > 0)


def set_state(state: dqn.EnvState, values, time: int) -> dqn.EnvState:
    x, x_dot, theta, theta_dot = (jnp.float32(v) for v in values)
    return state.replace(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot, time=jnp.int32(time))


# ---------------------------------------------------------------- environment parity


def test_parity_with_gymnasium_cartpole_v1():
    """Transition by transition: copy Gymnasium's state into ours, take the same action,
    compare obs, reward, terminated, truncated; one episode runs into the 500 limit."""
    env, step = dqn.CartPole(), jax.jit(dqn.CartPole().step)
    gym_env = gymnasium.make("CartPole-v1")
    rng = np.random.default_rng(0)
    _, state = env.reset(jax.random.key(0))
    lengths, endings = [], []
    for episode in range(4):
        gym_obs, _ = gym_env.reset(seed=episode)
        for t in range(600):
            state = set_state(state, gym_env.unwrapped.state, t)
            action = policy(gym_obs, rng, noise=0.05 if episode % 2 else 1.0)
            gym_obs, gym_reward, gym_term, gym_trunc, _ = gym_env.step(action)
            obs, state, reward, term, trunc, info = step(jax.random.key(t), state, action)
            np.testing.assert_allclose(info["final_observation"], gym_obs, atol=1e-5)
            assert (float(reward), bool(term), bool(trunc)) == (gym_reward, gym_term, gym_trunc)
            if gym_term or gym_trunc:
                # Auto-reset: the next observation is a fresh start, not the final one.
                assert np.abs(np.asarray(obs)).max() <= 0.05 and int(state.time) == 0
                lengths.append(t + 1)
                endings.append("truncated" if gym_trunc else "terminated")
                break
    assert 500 in lengths and "terminated" in endings  # both endings were compared
    assert lengths[endings.index("truncated")] == 500


@pytest.mark.parametrize(("noise", "steps", "ending"), [(0.5, 300, "terminated"),
                                                        (0.02, 1_100, "truncated")])  # fmt: skip
def test_parity_with_gymnax_cartpole_v1(noise, steps, ending):
    """Same reset for the same key, then the same transitions as gymnax's CartPole-v1: a noisy
    policy that drops the pole, and a steady one that reaches the 500-step time limit twice."""
    ours, theirs = dqn.CartPole(), dqn.make_env("gymnax")
    key = jax.random.key(3)
    obs, state = ours.reset(key)
    g_obs, g_state = theirs.reset(key)
    np.testing.assert_allclose(obs, g_obs, atol=1e-6)
    step, g_step = jax.jit(ours.step), jax.jit(theirs.step)
    rng = np.random.default_rng(1)
    endings = set()
    for t in range(steps):
        action = policy(np.asarray(g_obs), rng, noise=noise)
        k = jax.random.key(100 + t)
        state = set_state(
            state, [g_state.x, g_state.x_dot, g_state.theta, g_state.theta_dot], int(g_state.time)
        )
        _, state, reward, term, trunc, info = step(k, state, action)
        g_obs, g_state, g_reward, g_term, g_trunc, g_info = g_step(k, g_state, action)
        np.testing.assert_allclose(
            info["final_observation"], g_info["final_observation"], atol=1e-5
        )
        assert (float(reward), bool(term), bool(trunc)) == (
            float(g_reward),
            bool(g_term),
            bool(g_trunc),
        )
        endings |= {"terminated"} if g_term else {"truncated"} if g_trunc else set()
    assert ending in endings


# ---------------------------------------------------------------- replay buffer


def transition(i: int, terminated: bool = False) -> dqn.Transition:
    return dqn.Transition(
        obs=jnp.full(4, float(i)),
        action=jnp.int32(i % 2),
        reward=jnp.float32(1.0),
        next_obs=jnp.full(4, i + 0.5),
        terminated=jnp.bool_(terminated),
    )


def test_buffer_is_a_ring_that_overwrites_the_oldest():
    buffer = dqn.buffer_init(3, 4)
    for i in range(1, 6):  # 5 writes into 3 slots
        buffer = dqn.buffer_add(buffer, transition(i))
    assert int(buffer.size) == 3 and int(buffer.pointer) == 2
    np.testing.assert_array_equal(buffer.data.obs[:, 0], [4.0, 5.0, 3.0])


def test_buffer_samples_only_the_filled_part_and_stores_terminated():
    buffer = dqn.buffer_init(100, 4)
    for i in range(1, 4):
        buffer = dqn.buffer_add(buffer, transition(i, terminated=i == 2))
    batch = dqn.buffer_sample(buffer, jax.random.key(0), 1_000)
    assert set(np.asarray(batch.obs[:, 0]).tolist()) == {1.0, 2.0, 3.0}  # no empty slot
    np.testing.assert_array_equal(batch.terminated, batch.obs[:, 0] == 2.0)
    np.testing.assert_array_equal(batch.next_obs, batch.obs + 0.5)


def test_truncation_keeps_terminated_false_and_the_true_final_observation():
    env = dqn.CartPole()
    _, state = env.reset(jax.random.key(0))
    state = set_state(state, [0.0, 0.0, 0.0, 0.0], 499)
    obs, _, _, term, trunc, info = env.step(jax.random.key(1), state, 1)
    assert bool(trunc) and not bool(term)
    assert not np.allclose(info["final_observation"], obs)  # obs is the reset one
    assert float(info["final_observation"][1]) > 0  # pushed right: the real next state


# ---------------------------------------------------------------- TD target


@pytest.mark.parametrize("double_dqn", [False, True])
def test_truncated_transition_bootstraps_and_terminated_does_not(double_dqn):
    reward = jnp.array([1.0, 1.0])
    terminated = jnp.array([False, True])  # [truncated by the time limit, fell]
    next_q_target = jnp.array([[3.0, 5.0], [3.0, 5.0]])
    next_q_online = jnp.array([[2.0, 1.0], [2.0, 1.0]])  # prefers action 0
    target = dqn.td_target(
        reward, terminated, next_q_target, next_q_online if double_dqn else None, 0.9
    )
    bootstrap = 3.0 if double_dqn else 5.0  # Double DQN: online picks 0, target rates it 3
    np.testing.assert_allclose(target, [1.0 + 0.9 * bootstrap, 1.0])


def test_double_dqn_lets_the_online_net_pick_the_next_action():
    """dqn_loss passes td_target the online net's Q(s') under Double DQN: with an online and a
    target net that pick other actions on some s', the two losses differ (picking with the
    target net would make Double DQN plain DQN); with one net for both, they are the same."""
    network = dqn.QNetwork((8,), 2)
    keys = jax.random.split(jax.random.key(0), 4)
    online, target = (network.init(k, jnp.zeros(4)) for k in keys[:2])
    batch = dqn.Transition(
        obs=jax.random.normal(keys[2], (64, 4)),
        action=jnp.zeros(64, jnp.int32),
        reward=jnp.ones(64),
        next_obs=jax.random.normal(keys[3], (64, 4)),
        terminated=jnp.zeros(64, bool),
    )
    picks = [network.apply(p, batch.next_obs).argmax(-1) for p in (online, target)]
    assert (picks[0] != picks[1]).any()  # the nets disagree somewhere: the test can tell
    loss = partial(dqn.dqn_loss, apply_fn=network.apply, batch=batch, gamma=0.99)
    assert loss(online, target, double_dqn=True) != loss(online, target, double_dqn=False)
    assert loss(online, online, double_dqn=True) == loss(online, online, double_dqn=False)


# ---------------------------------------------------------------- network


def test_layer_norm_comes_between_each_dense_and_its_relu():
    """A LayerNorm right after a Dense cancels any shift its units share: adding 3 to the first
    Dense's bias leaves Q as it was (a LayerNorm after the ReLU would not)."""
    network = dqn.QNetwork((16, 16), 2, layer_norm=True)
    params = network.init(jax.random.key(0), jnp.zeros(4))
    bias = params["params"]["Dense_0"]["bias"]
    shifted = jax.tree.map(lambda x: x + 3.0 if x is bias else x, params)
    obs = jax.random.normal(jax.random.key(1), (32, 4))
    np.testing.assert_allclose(network.apply(shifted, obs), network.apply(params, obs), atol=1e-4)


# ---------------------------------------------------------------- train: keys and seeds


@pytest.fixture(scope="module")
def tiny_train():
    return dqn.make_train(TINY)


@pytest.fixture(scope="module")
def tiny_keys():
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(0), jnp.arange(3))


@pytest.fixture(scope="module")
def vmapped_out(tiny_train, tiny_keys):
    return jax.jit(jax.vmap(tiny_train))(tiny_keys)


def train_all(config: dqn.Config, grid: dqn.HParams, plan: dqn.SeedPlan) -> dict:
    """The command line's training, block after block to the end -> every agent's output."""
    env = dqn.CartPole()
    network = dqn.QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    *_, (_, carry, metrics) = dqn.train_agents(config, env, network, config.seed, grid, plan)
    return {"params": dqn.gather(carry.agent.params), "metrics": metrics}


def as_reported(out: dict) -> dict:
    """train's output with its metrics as train_agents reports them (NaN gaps, no counts)."""
    return {**out, "metrics": dqn.with_gaps(out["metrics"])}


def test_vmap_equals_single_key(tiny_train, tiny_keys, vmapped_out):
    single = jax.jit(tiny_train)
    for i in (0, 2):
        one = single(tiny_keys[i])
        jax.tree.map(
            lambda a, b, i=i: np.testing.assert_allclose(a[i], b, rtol=1e-4, atol=1e-4),
            vmapped_out,
            one,
        )


def test_seeds_in_batches_give_what_one_vmap_gives(tiny_keys, vmapped_out):
    """The CPU layout (each device runs its agents one vmapped batch at a time, lax.map) is
    only a layout, and hyperparameters as data are only data: in a grid of two learning rates
    x 3 seeds (padded to 64 agents), each grid point gets what train gives with that Config (its
    values as constants) on the same seeds' keys."""
    plan = dqn.plan_seeds(6, bytes_per_seed(TINY))  # 64 agents, two batches of 16 a device
    other = dataclasses.replace(TINY, learning_rate=1e-3)
    grid = dqn.hparam_grid([TINY.hparams()._asdict(), other.hparams()._asdict()])
    out = train_all(TINY, grid, plan)

    def same(a: dict, b: dict) -> None:
        """Equal up to float rounding. The step-0 evaluation is left out: an untrained network
        can nearly tie its two actions in a state it meets (seed 0's did, its return 140.5 or
        145), so its greedy return there flips with the last bit of a Q-value, in any layout."""
        a, b = (
            {**x, "metrics": {**x["metrics"], "eval_return": x["metrics"]["eval_return"][..., 1:]}}
            for x in (a, b)
        )
        close = partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4)
        jax.tree.map(close, a, b)

    same(jax.tree.map(lambda x: x[:3], out), as_reported(vmapped_out))  # grid point 0: TINY
    single = jax.jit(dqn.make_train(other))
    for seed in (0, 2):  # grid point 1, agents 3 to 5
        same(jax.tree.map(lambda x, i=3 + seed: x[i], out), as_reported(single(tiny_keys[seed])))
    kernels = out["params"]["params"]["Dense_0"]["kernel"]
    assert not np.allclose(kernels[:3], kernels[3:6])


def test_one_greedy_episode_function_scores_and_draws():
    """The evaluation inside train, --load and --render share greedy_episodes: asked for
    the observations, it returns the same returns, and one observation per step alive."""
    env = dqn.CartPole()
    network = dqn.QNetwork((16,), env.num_actions)
    params = network.init(jax.random.key(0), jnp.zeros(4))
    key = jax.random.key(1)
    returns = dqn.greedy_episodes(key, params, env, network, 3)
    same, (obs, alive) = dqn.greedy_episodes(key, params, env, network, 3, keep_obs=True)
    np.testing.assert_array_equal(returns, same)
    assert obs.shape == (500, 3, 4)
    np.testing.assert_array_equal(alive.sum(axis=0), returns)  # CartPole pays 1 per step


class CoinFlips(dqn.CartPole):
    """CartPole that pays a coin flip drawn from the step's key: a stochastic environment."""

    def step(self, key, state, action, params=None):
        obs, state, _, terminated, truncated, info = super().step(key, state, action, params)
        return (
            obs,
            state,
            jax.random.bernoulli(key).astype(jnp.float32),
            terminated,
            truncated,
            info,
        )


def test_greedy_episodes_give_each_step_and_episode_its_own_key():
    """A stochastic env's evaluation draws afresh at every step: episodes of coin flips are
    not all heads or all tails (one key for every step gave each episode one flip, repeated)."""
    env = CoinFlips()
    network = dqn.QNetwork((16,), env.num_actions)
    params = network.init(jax.random.key(0), jnp.zeros(4))
    returns, (_, alive) = dqn.greedy_episodes(jax.random.key(1), params, env, network, 8, True)
    lengths = alive.sum(axis=0)
    assert np.all((returns > 0) & (returns < lengths)), (returns, lengths)
    assert 0.25 < returns.sum() / lengths.sum() < 0.75


class KeyLog(dqn.CartPole):
    """CartPole that notes the key of each reset and step it is given (an auto-reset inside a
    step is the step's), in episodes of 20 steps."""

    default_params = dqn.EnvParams(max_steps_in_episode=20)

    def __init__(self):
        self.keys, self.stepping = {"reset": [], "step": []}, False

    def reset(self, key, params=None):
        if not self.stepping:
            jax.debug.callback(self.keys["reset"].append, jax.random.key_data(key))
        return super().reset(key, params)

    def step(self, key, state, action, params=None):
        jax.debug.callback(self.keys["step"].append, jax.random.key_data(key))
        self.stepping = True  # while tracing, not running: a Python flag does it
        out = super().step(key, state, action, params)
        self.stepping = False
        return out


def test_greedy_episodes_draw_resets_and_steps_from_keys_apart():
    """No step of an evaluation draws from an episode's reset key or a key split from it. (The
    steps' keys came from fold_in(key, t), which is split(key, n)[t]: episode t's reset key.)"""
    env, network = KeyLog(), dqn.QNetwork((16,), 2)
    params = network.init(jax.random.key(0), jnp.zeros(4))
    jax.block_until_ready(dqn.greedy_episodes(jax.random.key(1), params, env, network, 4))
    resets, steps = (np.reshape(env.keys[name], (-1, 2)) for name in ("reset", "step"))
    assert resets.shape == (4, 2) and steps.shape == (20 * 4, 2)
    split = jax.vmap(lambda key: jax.random.split(key, 4))(jax.random.wrap_key_data(resets))
    family = {tuple(k) for k in np.concatenate([resets, jax.random.key_data(split).reshape(-1, 2)])}
    assert not family & {tuple(k) for k in steps}
    assert len({tuple(k) for k in steps}) == len(steps)  # and no step shares one with another


def test_make_train_refuses_another_env_named_but_not_given():
    with pytest.raises(ValueError, match="pass the env"):
        dqn.make_train(dataclasses.replace(TINY, env="gymnax:Acrobot-v1"))


def test_help_shows_defaults_as_typed():
    text = " ".join(dqn.build_parser().format_help().split())
    assert "(default: 64,64)" in text and "(default: 0.995)" in text


def test_metrics_have_one_point_per_evaluation(vmapped_out):
    metrics = vmapped_out["metrics"]
    np.testing.assert_array_equal(metrics["step"][0], [0, 500, 1_000])  # step 0: untrained
    assert metrics["eval_return"].shape == (3, 3)
    # Step 0, untrained: no episode ended, no update ran; then each block has both.
    assert (metrics["episodes"][:, 0] == 0).all() and (metrics["updates"][:, 0] == 0).all()
    assert (metrics["loss"][:, 0] == 0).all() and (metrics["train_return"][:, 0] == 0).all()
    # Updates where t + 1 is even and >= 200: 200, 202, ..., 500 in the first block, 502... after.
    np.testing.assert_array_equal(metrics["updates"][:, 1:], [[151, 250]] * 3)
    assert (metrics["episodes"][:, 1:] > 0).all() and (metrics["train_return"][:, 1:] >= 1).all()
    assert np.all(metrics["eval_return"] >= 1) and np.all(metrics["eval_return"] <= 500)


def test_train_runs_under_jax_debug_nans():
    """No NaN in train's outputs (a block without an episode or an update reports 0 and a count
    of 0), so JAX_DEBUG_NANS, the first tool for a loss that diverges, can be turned on; the
    command line's with_gaps makes those 0s NaN (blank cells) and drops the counts."""
    config = dataclasses.replace(TINY, learning_starts=600)  # the first block has no update
    with jax.debug_nans(True):
        out = jax.jit(jax.vmap(dqn.make_train(config)))(jax.random.split(jax.random.key(0), 2))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(out))
    metrics = out["metrics"]
    assert (metrics["updates"][:, 1] == 0).all() and (metrics["loss"][:, 1] == 0).all()
    reported = dqn.with_gaps(jax.device_get(metrics))
    assert set(reported) == {"step", "eval_return", "train_return", "loss"}
    assert np.isnan(reported["loss"][:, :2]).all() and np.isfinite(reported["loss"][:, 2]).all()
    assert np.isnan(reported["train_return"][:, 0]).all() and reported["loss"].dtype == np.float32


def test_a_run_under_jax_debug_nans_leaves_blanks_where_a_block_had_no_update(tmp_path):
    """The command line under JAX_DEBUG_NANS=1: trains, and curves.csv leaves the loss blank
    for the block before the first update (and step 0's training columns)."""
    env = {**os.environ, "JAX_DEBUG_NANS": "1"}
    argv = [*TINY_ARGS, "--num-seeds", "1", "--learning-starts", "600"]
    argv = [sys.executable, dqn.__file__, *argv, "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "out" / "curves.csv") as file:
        rows = {int(row["step"]): row for row in csv.DictReader(file)}
    assert rows[0]["loss"] == rows[0]["train_return"] == rows[500]["loss"] == ""
    assert float(rows[500]["train_return"]) >= 1 and float(rows[1000]["loss"]) >= 0


def test_seeds_get_different_init_and_exploration():
    # At most one update runs, at the last step: the training returns depend on exploration
    # only.
    config = dataclasses.replace(TINY, learning_starts=TINY.total_timesteps, epsilon_end=1.0)
    keys = jax.random.split(jax.random.key(0), 3)
    out = jax.jit(jax.vmap(dqn.make_train(config)))(keys)
    kernel = out["params"]["params"]["Dense_0"]["kernel"]  # [seeds, 4, 16]
    assert not np.allclose(kernel[0], kernel[1]) and not np.allclose(kernel[1], kernel[2])
    returns = out["metrics"]["train_return"]  # [seeds, evals]
    assert len({tuple(np.round(r, 4)) for r in np.asarray(returns)}) == 3


def bytes_per_seed(config: dqn.Config) -> int:
    env = dqn.CartPole()
    network = dqn.QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    return sum(dqn.memory_need(config, env, network)[0].values())


def test_memory_batches_seeds_when_they_do_not_fit(monkeypatch):
    config = dataclasses.replace(TINY, num_seeds=8)
    need = bytes_per_seed(config)
    monkeypatch.setattr(dqn, "bytes_available", lambda device: int(4.5 * need))
    # 2 fit (half the memory); 4 per device.
    assert dqn.plan_seeds(config.num_seeds, need).seeds_per_batch == 2
    monkeypatch.setattr(dqn, "bytes_available", lambda device: need)
    with pytest.raises(MemoryError, match="--buffer-size"):
        dqn.plan_seeds(config.num_seeds, need)


@pytest.mark.cpu_devices
def test_seed_i_is_the_same_agent_whatever_num_seeds():
    """Seeds 0 and 1 train bit for bit the same agents in runs of 3 or 100 seeds: on a CPU every
    run has the same batch width, padded, so a seed runs in the same lane of the same batch
    program (3 seeds: two batches per device, mostly padding; 100 seeds: four)."""
    grid, need = dqn.hparam_grid([TINY.hparams()._asdict()]), bytes_per_seed(TINY)
    runs = {}
    for num_seeds in (3, 100):
        plan = dqn.plan_seeds(num_seeds, need)
        assert (plan.padded_seeds, plan.seeds_per_batch) == ({3: 64, 100: 128}[num_seeds], 16)
        out = train_all(dataclasses.replace(TINY, num_seeds=num_seeds), grid, plan)
        runs[num_seeds] = jax.tree.map(lambda x: np.asarray(x[:2]), out)
    jax.tree.map(np.testing.assert_array_equal, runs[3], runs[100])


@pytest.mark.cpu_devices
def test_gpu_layout_runs_on_a_cpu(monkeypatch, vmapped_out):
    """The layout a GPU gets (free memory from memory_stats, every agent of a device at once,
    no CPU batch limit), run on the CPU: it trains what jit(vmap(train)) trains."""
    need = bytes_per_seed(TINY)

    class Gpu:  # what a GPU device's memory_stats() reports
        def memory_stats(self):
            return {"bytes_limit": 100 * need, "bytes_in_use": 20 * need}

    assert dqn.bytes_available(Gpu()) == 80 * need
    monkeypatch.setattr(jax, "local_devices", lambda: [Gpu()])
    monkeypatch.setattr(dqn, "CPU_SEEDS_PER_BATCH", 1)  # a CPU plan would run 1 at a time
    plan = dqn.plan_seeds(48, need, platform="gpu")
    assert plan.seeds_per_batch == 24  # all a device holds: 40 fit in half the free memory
    plan = dqn.plan_seeds(3, need, platform="gpu")
    assert plan.seeds_per_batch == 2 and plan.padded_seeds == 4
    monkeypatch.undo()
    out = train_all(TINY, dqn.hparam_grid([TINY.hparams()._asdict()]), plan)
    same = partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4)
    jax.tree.map(lambda a, b: same(a[:3], b), out, as_reported(vmapped_out))


def test_memory_check_counts_what_every_agent_holds_between_blocks():
    """Every agent's training state (params, target, Adam's moments, buffer) stays in memory
    from block to block: the estimate covers it at least twice, and enough agents to outgrow
    half of this host's free memory are refused, naming --num-seeds."""
    env = dqn.CartPole()
    network = dqn.QNetwork(TINY.hidden_sizes, env.num_actions, TINY.layer_norm)
    terms, held = dqn.memory_need(TINY, env, network)
    init, _ = dqn.make_blocks(TINY, env, network)
    state = jax.eval_shape(init, jax.random.key(0), TINY.hparams())

    def nbytes(x):  # a key: two 32-bit words
        return 8 if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x.size * x.dtype.itemsize

    state_bytes = sum(nbytes(x) for x in jax.tree.leaves(state))
    per_agent = sum(held.values())
    assert per_agent >= 2 * state_bytes and max(held, key=held.get) == "--buffer-size"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    with pytest.raises(MemoryError, match="--num-seeds"):
        dqn.check_memory(terms, held, host // per_agent)
    plan = dqn.check_memory(terms, held, host // per_agent // 4)  # a quarter of it passes
    assert plan.padded_seeds >= host // per_agent // 4


@pytest.mark.cpu_devices
def test_memory_check_counts_the_padding_agents_of_whole_batches():
    """A CPU trains one seed as 64 agents (two batches of 16 a device), each holding its own
    buffer: one seed whose 64 agents do not fit is refused, naming the largest part of an
    agent's state (it passed, then ran out of memory, or hung)."""
    env = dqn.CartPole()
    terms, held = dqn.memory_need(TINY, env, dqn.QNetwork(TINY.hidden_sizes, 2, TINY.layer_norm))
    host, per_agent = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), sum(held.values())
    padded = dqn.plan_seeds(1, sum(terms.values())).padded_seeds
    assert padded == 64
    fat = {name: size * host // (per_agent * padded) for name, size in held.items()}
    with pytest.raises(MemoryError, match=r"--buffer-size: the training state of 64 agents \(1"):
        dqn.check_memory(terms, fat, 1)


def test_free_memory_is_what_the_tightest_cgroup_leaves(
    fake_cgroups, tmp_path, capsys, monkeypatch
):
    """In a container or a Slurm job (--mem) the cgroup's limit, not the machine's RAM, is what a
    run may use: in a cgroup of 2 GiB, 600 seeds with 100,000-transition buffers passed the
    check against this machine's RAM, and the kernel killed the run (exit 137, an empty folder
    left). Now one line naming --num-seeds, and no folder."""
    assert dqn.cgroup_free(*fake_cgroups) == 3 * 2**30  # v1's job: 5 GiB less 3 used, 1 cache
    assert dqn.cgroup_free(tmp_path / "no such file", tmp_path) == math.inf  # not Linux
    monkeypatch.setattr(dqn, "cgroup_free", lambda: 2 * 2**30)
    argv = "--total-timesteps 2000 --eval-every 1000 --num-seeds 600 --buffer-size 100000"
    with pytest.raises(SystemExit) as exit_info:
        dqn.main([*argv.split(), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert "--num-seeds: the training state of 600 agents" in err[0], err
    assert "more than half the 2.0 GiB free here" in err[0] and not (tmp_path / "run").exists()


def test_memory_estimate_takes_sizes_from_the_network():
    """The parameter count comes from the network itself, not from CartPole's sizes."""
    small = dataclasses.replace(TINY, hidden_sizes=(16,))
    wide = dataclasses.replace(TINY, hidden_sizes=(16, 256))
    extra_params = 16 * 256 + 256 + 2 * 256 + 256 * 2 + 2 - (16 * 2 + 2)  # Dense, LayerNorm
    # At least params, target, Adam's two moments, grads and updates, in 4-byte words.
    assert bytes_per_seed(wide) - bytes_per_seed(small) >= 6 * 4 * extra_params


def test_every_product_of_the_network_asks_for_full_float32():
    """A GPU multiplies float32 matrices in TF32 unless told otherwise, which solved fewer seeds
    (README): every product of the network, forward and backward, asks for HIGHEST."""
    network = dqn.QNetwork(hidden_sizes=(16, 16), num_actions=2, layer_norm=True)
    obs = jnp.ones((8, 4))
    params = network.init(jax.random.key(0), obs)
    grad = jax.make_jaxpr(jax.grad(lambda p: network.apply(p, obs).sum()))(params)

    def products(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn.params["precision"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from products(sub)

    precisions = list(products(grad.jaxpr))
    assert len(precisions) >= 6  # three layers forward, their weight gradients
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(p == highest for p in precisions), precisions


def test_matmul_backward_gives_the_plain_products_gradients():
    """matmul's own backward (the weight gradient on a copy of x^T) gives what JAX derives for
    the plain product, for inputs with two leading axes, under vmap over 5 agents."""
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(5, 2, 8, 3), (5, 3, 4), (5, 2, 8, 4)]  # x, kernel, dy
    x, kernel, dy = (jax.random.normal(k, shape) for k, shape in zip(keys, shapes, strict=True))

    def gradients(product):
        return jax.jit(jax.vmap(lambda x, k, dy: jax.vjp(product, x, k)[1](dy)))(x, kernel, dy)

    plain = gradients(lambda x, k: jnp.matmul(x, k, precision=jax.lax.Precision.HIGHEST))
    for ours, theirs in zip(gradients(dqn.matmul), plain, strict=True):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_devices
def test_cpu_runs_seeds_in_cache_sized_batches():
    config = dataclasses.replace(TINY, num_seeds=4 * dqn.CPU_SEEDS_PER_BATCH)  # 2 per device
    plan = dqn.plan_seeds(config.num_seeds, bytes_per_seed(config))
    assert plan.num_devices == 2
    assert plan.seeds_per_batch == dqn.CPU_SEEDS_PER_BATCH  # not all 2 * 16 at once


class FiveStepCartPole(dqn.CartPole):
    default_params = dqn.EnvParams(max_steps_in_episode=5)


def test_a_step_cut_by_the_time_limit_is_stored_as_not_terminal():
    """Episodes of 5 steps that the time limit ends (the pole cannot fall that soon): the buffer
    keeps terminated False for every one of them, so their targets bootstrap."""
    config = dataclasses.replace(TINY, total_timesteps=50, eval_every=50, learning_starts=50)
    network = dqn.QNetwork(config.hidden_sizes, 2, config.layer_norm)
    init, run_blocks = dqn.make_blocks(config, FiveStepCartPole(), network)
    hp = jax.tree.map(jnp.float32, config.hparams())
    carry, _ = jax.jit(init)(jax.random.key(0), hp)
    carry, metrics = jax.jit(run_blocks, static_argnums=3)(carry, hp, jnp.arange(1), 50)
    assert int(metrics["episodes"][0]) == 10  # all cut at 5 steps
    assert not np.asarray(carry.buffer.data.terminated[:50]).any()


class PaysItsAction(dqn.CartPole):
    """CartPole that pays 1 for action 1 (push right) and 0 for action 0."""

    def step(self, key, state, action, params=None):
        obs, state, _, terminated, truncated, info = super().step(key, state, action, params)
        return obs, state, jnp.float32(action), terminated, truncated, info


class PrefersAction0(flax.linen.Module):
    """Q = [1, 0] whatever the observation; its Dense only gives the optimizer params to hold."""

    @flax.linen.compact
    def __call__(self, obs):
        return flax.linen.Dense(2)(obs) * 0.0 + jnp.array([1.0, 0.0])


def test_exploration_ends_at_its_fraction_of_the_run():
    """epsilon 1 -> 0 over the first 40% of 2,000 steps, no update: a greedy action (0) pays 0,
    a random one 1 half the time. The first block's episodes earn something, the second's
    (steps 1,000 to 2,000, epsilon 0 since step 800) nothing."""
    config = dataclasses.replace(
        TINY,
        total_timesteps=2_000,
        eval_every=1_000,
        learning_starts=2_000,
        exploration_fraction=0.4,
        epsilon_start=1.0,
        epsilon_end=0.0,
    )
    train = dqn.make_train(config, PaysItsAction(), PrefersAction0())
    returns = np.asarray(jax.jit(train)(jax.random.key(0))["metrics"]["train_return"])
    assert returns[1] > 0 and returns[2] == 0.0, returns


def test_short_run_beats_a_random_policy():
    """Random play scores ~22; 10k steps of DQN (a fifth of the default budget, with the
    exploration decay scaled to match) should be well above it, not solving yet."""
    config = dataclasses.replace(
        dqn.Config(),
        total_timesteps=10_000,
        eval_every=5_000,
        exploration_fraction=0.5,
        num_seeds=8,
    )
    keys = jax.random.split(jax.random.key(1), config.num_seeds)
    final = jax.jit(jax.vmap(dqn.make_train(config)))(keys)["metrics"]["eval_return"][:, -1]
    assert np.median(final) > 60, final


def test_gymnax_env_trains_with_the_same_agent():
    config = dataclasses.replace(TINY, env="gymnax")
    out = jax.jit(dqn.make_train(config, dqn.make_env("gymnax")))(jax.random.key(0))
    assert np.all(np.isfinite(out["metrics"]["eval_return"]))
    assert out["params"]["params"]["Dense_0"]["kernel"].shape == (4, 16)


# ---------------------------------------------------------------- any gymnax environment

# A few hundred steps, one seed: enough to run every code path of an environment.
TINY_GYMNAX = dataclasses.replace(
    TINY, total_timesteps=400, eval_every=200, learning_starts=100, eval_episodes=1, num_seeds=1
)


def test_sizes_come_from_the_environment():
    """Acrobot: 6 observations, 3 actions; MinAtar's 10x10x4 image arrives flattened."""
    key = jax.random.key(0)
    for name, obs_size, num_actions in [
        ("gymnax:Acrobot-v1", 6, 3),
        ("gymnax:Breakout-MinAtar", 400, 3),
    ]:
        env = dqn.make_env(name)
        obs = jax.eval_shape(env.reset, key)[0]
        network = dqn.QNetwork((8,), env.num_actions)
        params = jax.eval_shape(network.init, key, obs)["params"]
        assert obs.shape == (obs_size,) and env.num_actions == num_actions
        assert params["Dense_0"]["kernel"].shape == (obs_size, 8)
        assert params["Dense_1"]["kernel"].shape == (8, num_actions)


GYMNAX_IDS = ["gymnax:MountainCar-v0", "gymnax:Breakout-MinAtar", "gymnax:BernoulliBandit-misc"]


@pytest.mark.parametrize("name", GYMNAX_IDS)
def test_tiny_run_on_a_gymnax_environment(name):
    """(CartPole-v1 above, Acrobot-v1 through the command line below; the bandit's time limit
    is a float.)"""
    env = dqn.make_env(name)
    config = dataclasses.replace(TINY_GYMNAX, env=name)
    returns = jax.jit(dqn.make_train(config, env))(jax.random.key(0))["metrics"]["eval_return"]
    # Rewards of at most 1 in size, per step of at most max_steps_in_episode.
    assert np.all(np.abs(returns) <= env.default_params.max_steps_in_episode), returns


def test_train_under_jax_enable_x64_writes_the_buffer_without_a_cast_warning():
    """Under JAX_ENABLE_X64 our CartPole's observations are float64 and the sampled actions
    int64, and writing them into the buffer's float32/int32 arrays warned twice ("In future JAX
    releases this will result in an error"): buffer_add casts them. A fresh process, since x64
    is set as JAX starts; that warning is an error there. The docstring's sweep, whose
    hyperparameters are float64 there, failed in lax.cond (a float64 loss, a float32 zero)."""
    code = (
        "import dataclasses, jax, dqn_cartpole as dqn\n"
        "config = dataclasses.replace(dqn.Config(), total_timesteps=400, eval_every=200,"
        " learning_starts=100, eval_episodes=1)\n"
        "out = jax.jit(dqn.make_train(config))(jax.random.key(0))\n"
        "assert out['metrics']['eval_return'].shape == (3,)\n"
        "hparams = jax.tree.map(lambda v: jax.numpy.full(2, v), config.hparams())\n"
        "hparams = hparams._replace(gamma=jax.numpy.linspace(0.99, 0.999, 2))  # float64\n"
        "keys = jax.random.split(jax.random.key(0), 2)\n"
        "out = jax.jit(jax.vmap(dqn.make_train(config)))(keys, hparams)\n"
        "assert out['metrics']['loss'].dtype == 'float32', out['metrics']['loss'].dtype\n"
    )
    env = os.environ | {"JAX_ENABLE_X64": "1", "PYTHONPATH": str(Path(dqn.__file__).parent)}
    run = subprocess.run(
        [
            sys.executable,
            "-W",
            "error:scatter inputs have incompatible types:FutureWarning",
            "-c",
            code,
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]


# ---------------------------------------------------------------- command line


@pytest.mark.cpu_devices
def test_cli_end_to_end_sharded_padded_then_load(tmp_path, monkeypatch, vmapped_out, capsys):
    """3 seeds on 2 devices (padded to two batches of 16 per device, the padding dropped) give what
    jit(vmap) gave; progress is reported after each block; then --load re-evaluates, by the
    run's own --solved-return (it took the env's 475)."""
    reports = []
    record = dqn.Progress.__call__
    monkeypatch.setattr(
        dqn.Progress,
        "__call__",
        lambda self, steps, seconds: (reports.append(steps), record(self, steps, seconds)),
    )
    out_dir = tmp_path / "run"
    dqn.main([*TINY_ARGS, "--solved-return", "20", "--output-dir", str(out_dir)])
    summary = json.loads((out_dir / "summary.json").read_text())
    for key in (
        "config",
        "versions",
        "devices",
        "wall_time_s",
        "compile_time_s",
        "agent_steps_per_s",
        "final_eval_return",
        "solved_fraction",
        "iqm",
    ):
        assert key in summary
    assert summary["seeds_padded_to"] == 64 and len(summary["devices"]) == 2
    assert summary["jax_settings"]["XLA_FLAGS"] == os.environ["XLA_FLAGS"]
    np.testing.assert_allclose(
        summary["final_eval_return"], vmapped_out["metrics"]["eval_return"][:, -1], atol=1e-4
    )
    assert summary["iqm"]["ci95"][0] <= summary["iqm"]["value"] <= summary["iqm"]["ci95"][1]
    assert reports == [500, 1_000]  # after each block of --eval-every 500 steps
    assert (out_dir / "learning_curves.png").stat().st_size > 0
    assert (out_dir / "params.msgpack").stat().st_size > 0

    dqn.main(
        [
            "--load",
            str(out_dir),
            "--eval-episodes",
            "2",
            "--render",
            "--env",
            "gymnax",
        ]
    )  # no --output-dir: the results of --load go into the run it loads
    loaded = json.loads((out_dir / "load_summary.json").read_text())
    assert len(loaded["final_eval_return"]) == 3 and loaded["config"]["env"] == "gymnax"
    assert loaded["environment"]["solved_return"] == summary["environment"]["solved_return"] == 20
    hits = sum(r >= 20 for r in loaded["final_eval_return"])
    assert loaded["solved_fraction"] == hits / 3
    assert (out_dir / "render.gif").read_bytes()[:3] == b"GIF"
    # The loaded run, named another way as --output-dir: its folder, as if left out (it asked
    # for --overwrite, which then did nothing). With --overwrite, refused as without the flag.
    (out_dir / "load_summary.json").unlink()
    dqn.main(["--load", str(out_dir), "--output-dir", str(out_dir.resolve())])
    assert (out_dir / "load_summary.json").exists() and (out_dir / "params.msgpack").exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        dqn.main(["--load", str(out_dir), "--output-dir", str(out_dir.resolve()), "--overwrite"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--overwrite: --load writes into the run's" in err, err

    # curves.csv: one row per seed x evaluation (step 0 included), the summary's finals in it.
    with open(out_dir / "curves.csv") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["seed", "step", "eval_return", "train_return", "loss"]
    assert [(int(r["seed"]), int(r["step"])) for r in rows] == [
        (seed, step) for seed in range(3) for step in (0, 500, 1_000)
    ]
    finals = [float(r["eval_return"]) for r in rows if r["step"] == "1000"]
    np.testing.assert_array_equal(np.float32(finals), np.float32(summary["final_eval_return"]))
    assert all(r["loss"] == r["train_return"] == "" for r in rows if r["step"] == "0")
    # --replot draws the figure again from the saved files alone: no training, no compiling.
    figure = out_dir / "learning_curves.png"
    figure.unlink()
    monkeypatch.setattr(dqn, "train_agents", lambda *a, **k: pytest.fail("--replot trained"))
    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("--replot compiled"))
    dqn.main(["--replot", str(out_dir)])
    assert figure.stat().st_size > 0
    # Its summary damaged outside the config: a KeyError that named no file; steps done that
    # went into the title ("-5 of 1,000 steps").
    summary = json.loads((out_dir / "summary.json").read_text())
    capsys.readouterr()  # the run's own lines
    for damage, why in (
        ({"environment": {}}, "KeyError: 'id'"),
        ({"steps_done": -5}, "its steps_done -5 is not a step count up to 1,000"),
        ({"grid": 5}, "its grid 5 is not a list of grid points"),  # it named no file
    ):
        (out_dir / "summary.json").write_text(json.dumps({**summary, **damage}))
        with pytest.raises(SystemExit) as exit_info:
            dqn.main(["--replot", str(out_dir)])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"cannot redraw (summary.json: {why})" in err, err


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_process_0_alone_is_one_line_once_the_cluster_timeout_passes(tmp_path, capsys):
    """Process 0 of two whose peer never starts: one line after --cluster-timeout (JAX would
    abort with a C++ stack trace), exit 2, nothing written."""
    cluster = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    argv = [*cluster, "--process-id", "0", "--cluster-timeout", "1"]
    with pytest.raises(SystemExit) as exit_info:
        dqn.main([*argv, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "0 of the 1 other processes came within 1 s (--cluster-timeout)" in err, err
    assert not (tmp_path / "out").exists()


def knock_on(address: str, knocks: list, check_coordinator) -> list[threading.Thread]:
    """Threads that knock on process 0's probe at `address` at once: (process id, processes) as
    check_coordinator does, or bytes as another client would send them."""

    def knock(who):
        if isinstance(who, tuple):  # a process: check_coordinator waits for the probe itself
            with contextlib.suppress(ValueError, SystemExit):  # process 0 gave up before
                check_coordinator(address, who[0], who[1], timeout=5)
            return
        for _ in range(100):  # a client: until the probe listens, within moments
            port = int(address.split(":")[1])
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as c:
                return c.sendall(who)
            time.sleep(0.05)

    threads = [threading.Thread(target=knock, args=(who,)) for who in knocks]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.parametrize(
    ("knocks", "problem"),
    [
        ([(1, 3), b"PRI * HTTP/2.0\r\n"], "1 of the 2 other processes came within 3 s"),
        ([(1, 3), b"jax-cluster-knock 0 3\n", b"jax-cluster-knock 7 3\n"], "1 of the 2 other"),
        ([(1, 3), (1, 3)], "--process-id 1 was given to two processes"),
        ([(1, 2)], "--num-processes differs between the processes"),
    ],
    ids=["a knock and a client", "ids no other process has", "one id twice", "another count"],
)
def test_process_0_counts_the_processes_that_knock_not_connections(knocks, problem):
    """Process 0 of three waits for processes 1 and 2 to knock. Another connection, such as the
    JAX client of process 1 once it knocked, is not process 2: counted as one, the cluster
    started without it, and JAX aborted with a C++ stack trace. A process id that knocks twice
    (two processes given --process-id 1) is named, and so is a process given another
    --num-processes; ids 0 and 7 are no other process of three (a knock of 0 was counted, and
    JAX aborted). Found by adversarial passes and a review."""
    address = f"127.0.0.1:{free_port()}"
    threads = knock_on(address, knocks, dqn.check_coordinator)
    with pytest.raises(ValueError, match=re.escape(problem)):
        dqn.check_coordinator(address, 0, 3, timeout=3)
    for thread in threads:
        thread.join()


def test_a_knock_is_read_within_a_second_however_slowly_it_comes():
    """A client that sent a byte at a time, each within a second of the last, held process 0
    past its --cluster-timeout (found by an adversarial pass): read_knock gives one second in
    all. A knock sent at once reads as (process id, processes)."""
    ours, theirs = socket.socketpair()
    theirs.sendall(b"jax-cluster-knock 1 3\n")
    assert dqn.read_knock(ours) == (1, 3)
    theirs.close()
    ours, theirs = socket.socketpair()

    def drip():
        with contextlib.suppress(OSError):  # read_knock has closed its end
            for byte in b"jax-cluster-knock 1 3\n":  # 2.2 s in all
                theirs.sendall(bytes([byte]))
                time.sleep(0.1)

    thread = threading.Thread(target=drip)
    thread.start()
    start = time.monotonic()
    assert dqn.read_knock(ours) is None and time.monotonic() - start < 1.5
    thread.join()
    theirs.close()


# Long enough for a process to be killed mid-training: 40 blocks.
LONG_CLUSTER_ARGS = [*TINY_ARGS, "--total-timesteps", "20000"]


def launch_cluster(tmp_path, argv: list[str], only_1=(), env_1=None) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a cluster on 127.0.0.1, one CPU device each, writing to
    tmp_path/process<i>; `only_1`: flags given to process 1 alone, last; `env_1`: its environment
    variables."""
    cluster = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=1"  # the last wins
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}  # on a GPU machine too
    return [
        subprocess.Popen(
            [sys.executable, "dqn_cartpole.py", *argv, *cluster, "--process-id", str(i)]
            + ["--output-dir", str(tmp_path / f"process{i}"), *(only_1 if i == 1 else ())],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env | (env_1 or {}) if i == 1 else env,
            cwd=dqn.__file__.rsplit("/", 1)[0],
        )
        for i in range(2)
    ]


@pytest.mark.cpu_devices
def test_two_processes_make_one_cluster_and_train_the_same_agents(tmp_path):
    """Two processes on 127.0.0.1, one CPU device each, form one JAX cluster: the seeds are
    sharded over both, only process 0 writes, both exit 0, and every agent is bit for bit the
    one a single process with two devices trains (TINY_ARGS: two blocks, a gather after each;
    the single process's programs are those other tests compiled)."""
    dqn.main([*TINY_ARGS, "--output-dir", str(tmp_path / "single")])
    (tmp_path / "a file").write_text("")  # process 1's folder, never used, cannot be made:
    processes = launch_cluster(tmp_path, TINY_ARGS, ["--output-dir", str(tmp_path / "a file/1")])
    results = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], results
    assert "2 cpu devices" in results[0][0] and "final greedy return" not in results[1][0]
    # Nor gloo's "[Gloo] Rank 1 is connected to 1 peer ranks...", a line in each (a pass found)
    assert results[0][0].startswith("output ") and results[1][0] == "", results
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a file", "process0", "single"]
    for name in ("params.msgpack", "curves.csv"):
        single = (tmp_path / "single" / name).read_bytes()
        assert (tmp_path / "process0" / name).read_bytes() == single, name


CLUSTER_FLAGS = " (on each of the 2 processes of the cluster, started as before)"


@pytest.mark.parametrize("victim", [0, 1])
def test_a_process_that_dies_stops_the_other_with_one_line(tmp_path, victim):
    """kill -9 of one process of a cluster, mid-training: the other stops within moments, its
    last line on stderr says why, exit 1, no traceback, no run written. Process 1 gone: process
    0 learns it at the next gather, and its checkpoint stays with the line to go on from it (it
    stayed unsaid: found by an adversarial pass). Process 0 gone takes the coordinator with it,
    which JAX answers with an abort and a C++ stack trace in process 1; its watcher makes that
    one line."""
    processes = launch_cluster(tmp_path, [*LONG_CLUSTER_ARGS, "--checkpoint-every", "500"])
    for line in processes[0].stderr:  # progress lines: the first block's (2%), then each 10%
        if re.search(r"\b[1-9]\d%", line):  # 2,000 steps: checkpoints written at 500 to 1,500
            break
    processes[victim].kill()
    survivor = processes[1 - victim]
    _, err = survivor.communicate(timeout=120)
    processes[victim].wait()
    last = err.strip().splitlines()[-1]
    assert survivor.returncode == 1 and "Traceback" not in err, err
    assert last.startswith("dqn_cartpole.py: error:") and "process" in last, err
    assert not (tmp_path / "process0" / "summary.json").exists()
    if victim == 1:
        assert (tmp_path / "process0" / dqn.CHECKPOINT).exists(), err
        hint = "to go on: " + last.split("; to go on: ", 1)[1]
        assert hint.endswith(CLUSTER_FLAGS), last
        with contextlib.chdir(Path(dqn.__file__).parent):  # the processes' folder: the paths
            assert_goes_on(hint.removesuffix(CLUSTER_FLAGS), tmp_path / "process0")  # from it


DIFFERS = "differs between the processes"


@pytest.mark.parametrize(
    ("only_1", "env_1", "line"),
    [
        (["--learning-rate", "0.05", "--hidden-sizes", "32"], {}, f"--learning-rate {DIFFERS}"),
        (["--checkpoint-every", "500"], {}, f"--checkpoint-every {DIFFERS}"),
        ([], {"JAX_ENABLE_X64": "1"}, f"JAX_ENABLE_X64 {DIFFERS}"),
        (
            [],
            {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
            "the processes have other numbers of devices (1 on process 0, 2 on process 1)",
        ),
    ],
    ids=["flags", "checkpoint-every", "x64", "devices"],
)
def test_processes_given_other_flags_are_one_line_before_training(tmp_path, only_1, env_1, line):
    """Process 1 given another learning rate and width: it would train its share of the agents
    with its own values (the width: JAX would abort on the other shape, a C++ trace from gloo).
    Or given another --checkpoint-every (both died at process 0's first checkpoint, its gather,
    each blaming the other), JAX_ENABLE_X64 (gloo aborted on float64 arrays, after training) or
    number of devices (a reshape error in the first gather). One line in both, naming the first
    that differs, exit 2, nothing written (found by adversarial passes)."""
    assert_each_says_differs(launch_cluster(tmp_path, TINY_ARGS, only_1, env_1), line)
    assert not any(tmp_path.iterdir())


def assert_each_says_differs(processes: list[subprocess.Popen], line: str) -> None:
    """Every process of the cluster ends with exit 2 and one line naming the flag, no traceback."""
    for process in processes:
        _, err = process.communicate(timeout=120)
        last = err.strip().splitlines()[-1]
        assert process.returncode == 2 and "Traceback" not in err, err
        assert last == f"dqn_cartpole.py: error: {line}; give all the same", err


def test_load_given_to_one_process_of_a_cluster_is_one_line(tmp_path):
    """--load (or --resume) given to process 1 alone: the two ran other programs and waited for
    each other's (--resume: for ever, deaf to SIGTERM and Ctrl-C; --load: training failed after
    43 s with Gloo's error). Now one line in both, exit 2, before any work."""
    run = tmp_path / "run"
    dqn.main([*TINY_ARGS, "--output-dir", str(run)])
    processes = launch_cluster(tmp_path, [], ["--load", str(run)])  # 0: the default run
    assert_each_says_differs(processes, f"--load {DIFFERS}")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]


def test_a_signal_to_process_1_stops_and_saves_the_whole_run(tmp_path):
    """Ctrl-C sent to process 1 of a cluster alone (`kill -INT`; SIGTERM, SIGHUP and a terminal's
    Ctrl-C alike): every process stops after the block in progress, and process 0 saves the run
    with a checkpoint and says how to go on, exit 130 in both. Process 0 used to end as if the
    run were done: exit 0, no checkpoint, the rest of the run lost; and a Ctrl-C or SIGHUP to
    process 1's pid alone was ignored by its watcher (found by an adversarial pass)."""
    processes = launch_cluster(tmp_path, LONG_CLUSTER_ARGS)
    for line in processes[0].stderr:  # progress lines: training runs
        if "%" in line:
            break
    processes[1].send_signal(signal.SIGINT)  # its watcher passes it on
    (_, err), _ = (process.communicate(timeout=120) for process in processes)
    assert [process.returncode for process in processes] == [130, 130], err
    assert "--resume" in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert (tmp_path / "process0" / dqn.CHECKPOINT).exists()


@pytest.mark.parametrize(
    ("held", "argv", "problem"),
    [
        (["summary.json"], [], "already holds a run"),
        (["summary.json", "checkpoint.npz"], [], "holds a stopped run: --resume"),
        (["summary.json", "notes.txt"], ["--overwrite"], "holds notes.txt, which no"),
        (["notes.txt"], [], "holds notes.txt, which no"),  # not "holds a run"
    ],
)
def test_an_output_dir_that_holds_a_run_is_kept_unless_overwrite(
    tmp_path, capsys, held, argv, problem
):
    """A folder named outright that holds a run is refused in one line; --overwrite replaces
    only what a run wrote, so a folder with anything else is refused too, and left as it was."""
    for name in held:
        (tmp_path / name).write_text("kept")
    with pytest.raises(SystemExit) as exit_info:
        dqn.main([*TINY_ARGS, "--output-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and problem in err, err
    assert all((tmp_path / name).read_text() == "kept" for name in held)


def test_replot_of_a_folder_without_a_run_is_one_line(tmp_path, capsys):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        dqn.main(["--replot", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "--replot" in err, err


def test_progress_in_a_log_file_is_plain_lines(capsys):
    """stderr not a terminal (a log file, a pipe): a plain line every 10% of the steps, with the
    rate and the time left, no carriage return. 40 blocks of 25 steps, 4 agents."""
    progress = dqn.Progress(num_agents=4, first=0, total=1_000, terminal=False)
    for block in range(1, 41):
        progress(25 * block, seconds=0.025 * block)
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines) and len(lines) == 11, lines  # 2.5%, 10%, ..., 100%
    assert all("agent-steps/s" in line and "ETA" in line for line in lines), lines
    assert lines[1].split()[:3] == ["10%", "train", "0.1"] and "4,000 agent-steps/s" in lines[1]
    assert lines[-1].split()[0] == "100%" and lines[-1].endswith("ETA 0 s"), lines


ACROBOT_SWEEP_ARGS = shlex.split(
    "--env gymnax:Acrobot-v1 --gamma 0.99,0.995 --num-seeds 1 --total-timesteps 400 "
    "--eval-every 200 --hidden-sizes 8 --buffer-size 128 --batch-size 8 --train-frequency 2 "
    "--learning-starts 100 --eval-episodes 1"
)


def test_sweep_labels_tell_every_grid_point_apart():
    """Values that differ in float32 are two grid points; labels of 6 digits (`:g`) showed gamma
    0.999999 and 0.9999991 as the same, twice, in the ranking and the figure."""
    default = dqn.Config().hparams()._asdict()
    lrs, gammas = (1e-3, 2.5e-3), (0.999999, 0.9999991)
    points = [default | {"learning_rate": lr, "gamma": g} for lr in lrs for g in gammas]
    assert dqn.point_labels(points) == [
        "learning_rate 0.001, gamma 0.999999",
        "learning_rate 0.001, gamma 0.9999991",
        "learning_rate 0.0025, gamma 0.999999",
        "learning_rate 0.0025, gamma 0.9999991",
    ]


def test_a_large_sweep_draws_its_best_and_worst_grid_points():
    """A row per grid point made 3,000 points a figure 111,000 pixels tall (21 MB), and past
    about 175,000 one that Agg refuses, after training. Beyond MOST_ROWS: the best and the worst
    half of that, the title saying how many there are; a small sweep keeps every row."""
    import matplotlib.pyplot as plt

    def result(value):  # a grid point whose seeds all returned `value`
        iqm = {"value": value, "ci95": [value, value]}
        return {"final_eval_return": [value] * 3, "iqm": iqm, "solved_fraction": value / 500,
                "solved_ci95": [0.0, 1.0]}  # fmt: skip

    for count, rows in (5, 5), (dqn.MOST_ROWS, dqn.MOST_ROWS), (3_000, dqn.MOST_ROWS):
        results = [result(float(i % 500)) for i in range(count)]
        labels = [f"point {i}" for i in range(count)]
        fig = dqn.plot_sweep(labels, results, 475.0, "title")
        ax = fig.axes[0]
        shown = [tick.get_text().split("\n")[0] for tick in ax.get_yticklabels()]
        assert len(shown) == rows and fig.get_size_inches()[1] < 20, (count, len(shown))
        best, worst = dqn.ranked(results)[: rows // 2], dqn.ranked(results)[-(rows // 2) :]
        if count > rows:
            assert shown == [labels[g] for g in best + worst]
            assert f"the best and the worst 20 of {count:,}" in ax.get_title()
        plt.close(fig)


def test_load_scores_every_grid_point_on_the_same_episodes():
    """Under --load, seed i of every grid point plays the same fresh episodes, as in training
    (common random numbers): agent a played key a, so that two grid points with the same params
    scored apart (found by a review)."""
    config = dataclasses.replace(TINY, num_seeds=2, eval_episodes=2)
    env = dqn.CartPole()
    network = dqn.QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    keys = jax.random.split(jax.random.key(1), 2)
    params = jax.vmap(network.init, in_axes=(0, None))(keys, jnp.zeros(4))
    twice = jax.tree.map(lambda x: jnp.concatenate([x, x]), params)  # 2 points x 2 seeds
    returns = dqn.load_evaluation(config, env, network, twice)()
    np.testing.assert_array_equal(returns[:2], returns[2:])


def test_cli_sweep_on_acrobot_then_load_takes_env_and_network_from_the_run(
    tmp_path, monkeypatch, capsys
):
    """A 2-point sweep on gymnax's Acrobot-v1 from the command line: sizes, solved return and
    the default folder follow the environment, the summary scores each grid point, the terminal
    ranks them; --load of that run plays Acrobot with the run's network without being told."""
    monkeypatch.chdir(tmp_path)
    dqn.main(ACROBOT_SWEEP_ARGS)
    # The default folder follows the environment, and is new for each run (its start time).
    (run,) = (tmp_path / "runs").glob("dqn_acrobot-v1_20*")
    summary = json.loads((run / "summary.json").read_text())
    # Acrobot: 6 observations, 3 actions, solved at -100 (Gymnasium's reward_threshold).
    assert summary["environment"] == {
        "id": "Acrobot-v1",
        "obs_size": 6,
        "num_actions": 3,
        "solved_return": -100,
    }
    assert [point["hparams"]["gamma"] for point in summary["grid"]] == [0.99, 0.995]
    for point in summary["grid"]:
        low, high = point["solved_ci95"]  # Wilson: inside [0, 1] even for one seed
        assert 0 <= low <= point["solved_fraction"] <= high <= 1 and high - low > 0.5
        assert point["iqm"]["ci95"][0] <= point["iqm"]["value"] <= point["iqm"]["ci95"][1]
    assert (run / "sweep.png").stat().st_size > 0
    with open(run / "curves.csv") as file:  # the swept hyperparameter is a column
        rows = list(csv.DictReader(file))
    assert list(rows[0])[:2] == ["gamma", "seed"]
    assert [float(r["gamma"]) for r in rows] == [0.99] * 3 + [0.995] * 3  # 1 seed x 3 evals
    out = capsys.readouterr().out
    assert "Acrobot-v1" in out and "best first" in out and "gamma 0.995" in out, out

    # Neither --env nor --hidden-sizes given: both come from the run (the default is cartpole),
    # and so does the rest of the config load_summary.json records (it recorded the defaults).
    dqn.main(["--load", str(run), "--eval-episodes", "1"])
    loaded = json.loads((run / "load_summary.json").read_text())
    assert loaded["config"] == summary["config"] | {"output_dir": str(run)}
    assert [point["hparams"]["gamma"] for point in loaded["grid"]] == [0.99, 0.995]
    assert all(point["final_eval_return"][0] <= 0 for point in loaded["grid"])  # -1 per step

    other_norm = "--no-layer-norm" if dqn.Config().layer_norm else "--layer-norm"
    for argv, flag in [
        (["--load", str(run), "--env", "cartpole"], "--env"),
        (["--load", str(run), "--hidden-sizes", "16"], "--hidden-sizes"),
        (["--load", str(run), other_norm], "--layer-norm"),
        (["--load", str(run), "--num-seeds", "2"], "--num-seeds 2 disagrees with the run"),
        (["--load", str(run), "--render"], "--render"),
        # training's flags: --total-timesteps 100 was "--learning-starts must be below ..."
        (["--load", str(run), "--total-timesteps", "100"], "run as it was saved; leave out --tot"),
        (["--load", str(run), "--gamma", "0.9,0.99"], "leave out --gamma"),
        (["--load", str(run), "--checkpoint-every", "7"], "leave out --checkpoint-every"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit):
            dqn.main([*argv, "--output-dir", str(tmp_path / "not_written")])
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "not_written").exists()

    # A call refused after checking a folder leaves no trace that a later --load trips on.
    copy = tmp_path / "copy"
    with pytest.raises(SystemExit):
        dqn.main(
            ["--total-timesteps", "100", "--learning-starts", "100", "--output-dir", str(copy)]
        )
    shutil.copytree(run, copy)  # a run arrives there, later
    # ... trained with a replay buffer no machine here holds: evaluating it needs none (--load
    # refused it, "lower --buffer-size", and then refused --buffer-size)
    saved = json.loads((copy / "summary.json").read_text())
    saved["config"] |= {"buffer_size": 2_000_000_000, "seed": 5, "eval_episodes": 3}
    (copy / "summary.json").write_text(json.dumps(saved))
    dqn.main(["--load", str(copy), "--eval-episodes", "1"])
    assert (copy / "load_summary.json").exists()
    # Evaluated with this command's seed and episodes, 0 and 10 unless given, not the run's.
    config = dqn.parse_command(["--load", str(copy)])[1]
    assert (config.seed, config.eval_episodes, config.buffer_size) == (0, 10, 2_000_000_000)
    assert dqn.parse_command(["--load", str(copy), "--seed", "7"])[1].seed == 7
    # Into another run's folder, with --overwrite: that run is replaced; the summary says whence.
    dqn.main(["--load", str(copy), "--eval-episodes", "1", "--output-dir", str(run), "--overwrite"])
    assert [path.name for path in run.iterdir()] == ["load_summary.json"]
    loaded = json.loads((run / "load_summary.json").read_text())
    assert loaded["loaded_from"] == str(copy.resolve()) and loaded["config"]["seed"] == 0


def test_scores_with_and_without_a_solved_return():
    final = np.array([500.0, 480.0, 100.0, 20.0])
    scored = dqn.scores(final, 475.0, seed=0)
    assert scored["solved_fraction"] == 0.5
    np.testing.assert_allclose(scored["solved_ci95"], [0.150, 0.850], atol=1e-3)  # Wilson, 2 of 4
    assert dqn.wilson_interval(0, 10)[0] == 0 and dqn.wilson_interval(10, 10)[1] == 1
    unsolvable = dqn.scores(final, None, seed=0)  # an environment with no reward_threshold
    assert unsolvable["solved_fraction"] is None and unsolvable["solved_ci95"] is None
    assert unsolvable["iqm"] == scored["iqm"] and "solved" not in dqn.score_line(unsolvable, None)
    for seed in (-1, -(2**63)):  # a --seed the command line takes (it crashed after training)
        low, high = dqn.scores(final, 475.0, seed)["iqm"]["ci95"]
        assert 20 <= low <= high <= 500
        curve = dqn.training_scores(final[:, None], np.array([1_000]), 475.0, seed)["curve"]
        assert curve["ci95_low"][0] == low and curve["ci95_high"][0] == high


def test_iqm_is_the_mean_of_the_middle_half():
    """A quarter (rounded down) cut from each end: one more cut from the bottom read 3.0 for
    the first; per column along the axis given."""
    assert dqn.iqm(np.array([1.0, 2.0, 3.0, 100.0]), axis=0) == 2.5
    assert dqn.iqm(np.array([0.0, 1.0, 2.0, 6.0, 100.0]), axis=0) == 3.0  # n 5: cut 1 each end
    columns = np.array([[4.0, 0.0], [1.0, 9.0], [3.0, 1.0], [2.0, 2.0]])
    np.testing.assert_array_equal(dqn.iqm(columns, axis=0), [2.5, 1.5])


def test_the_iqms_ci_is_the_2_5_and_97_5_percentiles_of_a_bootstrap_over_all_seeds():
    """bootstrap_iqm: BOOTSTRAP_SAMPLES resamplings of the seeds with replacement (every seed can
    be drawn, the last one too), the 2.5th and 97.5th percentiles of their IQMs: a 95% interval,
    with 2.5% of the bootstrap IQMs beyond each end (percentiles of 5 and 95 passed the suite)."""
    values = np.array([3.0, 9.0, 1.0, 7.0, 5.0, 8.0, 2.0, 500.0, 6.0, 4.0, 0.0, 450.0])
    value, low, high = dqn.bootstrap_iqm(values, seed=3)
    n = len(values)
    resampled = values[np.random.default_rng(3).integers(0, n, size=(dqn.BOOTSTRAP_SAMPLES, n))]
    middle = np.sort(resampled, axis=1)[:, n // 4 : n - n // 4].mean(axis=1)
    assert value == np.sort(values)[3:9].mean()
    assert (low, high) == pytest.approx(np.percentile(middle, [2.5, 97.5]), rel=1e-12)
    assert np.mean(middle < low) <= 0.025 and np.mean(middle > high) <= 0.025
    assert np.mean(middle <= low) >= 0.02 and np.mean(middle >= high) >= 0.02


def test_a_return_equal_to_the_solved_return_counts_as_solved():
    """Gymnasium's reward_threshold is reached at >=: a CartPole mean return of exactly 475
    (10 episodes, say 9 x 500 + 225) solves it."""
    scored = dqn.scores(np.array([475.0, 474.9, 500.0, 0.0]), 475.0, seed=0)
    assert scored["solved_fraction"] == 0.5
    assert scored["solved_ci95"] == pytest.approx(dqn.wilson_interval(2, 4))


def test_solved_along_the_way_is_of_the_best_evaluation_and_the_final_of_the_last():
    """A seed that solved at its second evaluation and then fell: solved along the way, not at
    the end; the final scores are the last column, the best ones each seed's maximum (taken
    from the last evaluation, the share along the way passed the suite)."""
    returns = np.array([[10.0, 480.0, 300.0], [10.0, 20.0, 30.0], [10.0, 490.0, 500.0]])
    scored = dqn.training_scores(returns, np.array([0, 500, 1_000]), 475.0, seed=0)
    assert scored["final_eval_return"] == [300.0, 30.0, 500.0]
    assert scored["best_eval_return"] == [480.0, 30.0, 500.0]
    assert scored["solved_fraction"] == pytest.approx(1 / 3)
    assert scored["solved_along_the_way"] == pytest.approx(2 / 3)


def test_grid_points_rank_by_solved_share_before_iqm():
    """A point that solves more seeds ranks above one with a higher IQM but fewer solved; the
    IQM orders equal shares, and a share of None (no solved return) counts as none solved."""

    def result(share, iqm):
        return {"solved_fraction": share, "iqm": {"value": iqm}}

    results = [result(0.2, 490.0), result(0.9, 300.0), result(0.9, 400.0), result(None, 500.0)]
    assert dqn.ranked(results) == [2, 1, 0, 3]


def test_render_draws_the_agent_with_the_median_final_return(tmp_path, monkeypatch):
    """--render's GIF is of the median agent (returns 5, 1, 3, 9, 7: agent 0, with 5), not the
    worst or the best; its title names it."""
    titles = []

    class Animation:  # draws frame 0 and writes a stub file instead of a GIF
        def __init__(self, fig, draw, frames):
            draw(0)
            titles.append(fig.axes[0].get_title())

        def save(self, path, writer):
            Path(path).write_bytes(b"GIF")

    monkeypatch.setattr(matplotlib.animation, "FuncAnimation", Animation)
    env = dqn.CartPole()
    network = dqn.QNetwork((8,), env.num_actions)
    keys = jax.random.split(jax.random.key(0), 5)
    params = jax.vmap(network.init, in_axes=(0, None))(keys, jnp.zeros(4))
    returns = np.array([5.0, 1.0, 3.0, 9.0, 7.0])
    dqn.render_median(dqn.Config(), env, network, params, returns, tmp_path / "render.gif")
    assert titles and titles[0].startswith("agent 0:"), titles


def test_train_without_hparams_trains_with_the_configs(tiny_keys):
    """train(key) is train(key, config.hparams()), the Config's values as data, for a Config
    whose hyperparameters are not the defaults. (It was checked against train(key, None), the
    same call, then with TINY, whose hyperparameters are the defaults.)"""
    config = dataclasses.replace(TINY, gamma=0.9, learning_rate=1e-3, tau=0.5)
    train = jax.jit(dqn.make_train(config))
    default, given = train(tiny_keys[0]), train(tiny_keys[0], config.hparams())
    jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4), default, given)


def test_train_is_its_blocks_run_one_at_a_time(tiny_keys, vmapped_out):
    """train(key) is init and run_blocks composed: run one block at a time (as the command line
    does, to save and resume between blocks), they give the same agents. (A shorter last block:
    the test with a signal, below.)"""
    env = dqn.CartPole()
    network = dqn.QNetwork(TINY.hidden_sizes, env.num_actions, TINY.layer_norm)
    init, run_blocks = dqn.make_blocks(TINY, env, network)
    hp = TINY.hparams()
    carry, metrics = jax.jit(jax.vmap(lambda key: init(key, hp)))(tiny_keys)
    run = jax.jit(jax.vmap(run_blocks, in_axes=(0, None, None, None)), static_argnums=3)
    for block, steps in [(0, 500), (1, 500)]:
        carry, more = run(carry, hp, jnp.array([block]), steps)
        metrics = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), metrics, more)
    np.testing.assert_array_equal(metrics["step"], vmapped_out["metrics"]["step"])
    # Not bit for bit: XLA compiles a loop of one block without the loop, and rounds some sums
    # in another order there (measured: params within 1e-6, the same returns). The command line
    # always runs one block a call, so a stopped and resumed run is bit for bit one never
    # stopped (the test with a signal, below).
    close = partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, carry.agent.params, vmapped_out["params"])
    jax.tree.map(close, metrics, vmapped_out["metrics"])
    assert np.all(carry.buffer.pointer == 1_000 % TINY.buffer_size)  # a transition a step


# Port 9 (discard) on this machine: nobody listens there.
CLUSTER = ["--coordinator-address", "127.0.0.1:9", "--num-processes", "2"]
BAD_INPUTS = [
    (["--num-seeds", "0"], "--num-seeds"),
    (["--total-timesteps", "-5"], "--total-timesteps"),
    (["--learning-rate", "0"], "--learning-rate"),
    (["--gamma", "1.0"], "--gamma"),
    (["--epsilon-start", "1.5"], "--epsilon-start"),
    (["--epsilon-end", "-0.1"], "--epsilon-end"),
    (["--batch-size", "512", "--buffer-size", "256"], "--batch-size"),
    (["--env", "pong"], "--env"),
    (["--hidden-sizes", "64,x"], "--hidden-sizes"),
    (["--num-seeds", "two"], "--num-seeds"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--eval", "5"], "--eval-every"),  # an abbreviation of two flags: argparse prints its usage
    (["--buffer-size", "256,512"], "--buffer-size"),  # a list on a flag that sets a shape
    (["--num-seeds", "2,4"], "--num-seeds"),
    (["--gamma", "0.99,1.5"], "--gamma"),  # one bad value in a sweep list
    # Which two are alike: the line said "lists a value twice" of a list of distinct decimals
    (
        ["--learning-rate", "0.1,0.2,0.10000000001"],
        "--learning-rate lists a value twice (in float32): 0.1 and 0.10000000001",
    ),
    (["--env", "gymnax:Pendulum-v1"], "--env"),  # continuous actions
    (["--env", "gymnax:NoSuchEnv-v0"], "--env"),
    (["--env", "gymnax:Acrobot-v1", "--render"], "--render"),
    # Numbers at the edges, before any work.
    (["--learning-rate", "inf"], "--learning-rate"),
    (["--max-grad-norm", "inf"], "--max-grad-norm"),
    (["--learning-starts", "1000", "--total-timesteps", "1000"], "--learning-starts"),
    (["--seed", "9223372036854775808"], "--seed"),
    (["--total-timesteps", "3000000000", "--eval-every", "3000000"], "--total-timesteps"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    # Memory: the results of all seeds, and the flag that drives one seed's need.
    (["--num-seeds", "1000000000"], "--num-seeds"),
    (["--eval-episodes", "2000000000"], "--eval-episodes"),  # 4 TB a seed: any machine refuses
    (["--buffer-size", "2000000000"], "lower --buffer-size"),  # below 2^31: the memory check
    # A cluster that cannot form: one line before any work, not JAX's abort after its time-out.
    (["--num-processes", "2"], "--process-id"),
    (CLUSTER + ["--process-id", "2"], "--process-id"),
    (["--coordinator-address", "nohost", "--num-processes", "2", "--process-id", "1"], "HOST:PORT"),
    # IPv6: JAX aborted with a C++ trace a minute later ([::1] was "cannot resolve")
    (["--coordinator-address", "::1:1234", "--num-processes", "1", "--process-id", "0"], "IPv6"),
    (["--coordinator-address", "[::1]:1234", "--num-processes", "1", "--process-id", "0"], "IPv6"),
    (CLUSTER + ["--process-id", "1", "--cluster-timeout", "0.5"], "--cluster-timeout"),
    (
        ["--coordinator-address", "no.invalid:1", "--num-processes", "1", "--process-id", "0"],
        "cannot resolve",
    ),
    (CLUSTER[:2] + ["--num-processes", str(2**31), "--process-id", "0"], "--num-processes"),
    (
        [
            "--coordinator-address",
            "localhost:\u0665\u0665",
            "--num-processes",
            "1",
            "--process-id",
            "0",
        ],
        "HOST:PORT",
    ),  # fmt: skip
    (CLUSTER + ["--process-id", "0", "--cluster-timeout", "nan"], "--cluster-timeout"),
    (["--cluster-timeout", "nan"], "--cluster-timeout"),  # given alone, checked all the same
    (
        ["--coordinator-address", "localhost:99999", "--num-processes", "2", "--process-id", "0"],
        "HOST:PORT",
    ),  # fmt: skip
    # Counters are int32 and train() computes in float32: refused, not wrapped or rounded.
    (["--train-frequency", "3000000000"], "--train-frequency"),
    (["--gamma", "0.99999999999"], "--gamma"),  # 1.0 as a float32
    (["--learning-rate", "1e-40"], "--learning-rate"),  # below float32's normal numbers: 0 to XLA
    (["--tau", "1e-39"], "--tau"),
    (["--train-frequency", "2147483647"], "--train-frequency"),  # no update would ever run
    (["--replot", ""], "--replot"),  # an empty folder name reads as not given
    (["--load", ""], "--load"),
    (["--resume", ""], "--resume"),
    (["--learning-rate", "1e-3,1e-3"], "--learning-rate"),  # two grid points the same
    (  # 101^3 grid points: refused before they are made (24 million took 7 GB, then an abort)
        [
            f"--{name}={','.join(str((i + 1) / 200) for i in range(101))}"
            for name in ("learning-rate", "gamma", "tau")
        ],
        "--learning-rate: the lists make 1,030,301 grid points",
    ),  # fmt: skip
    (["--solved-return", "nan"], "--solved-return"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD_INPUTS)
def test_cli_bad_input_is_one_line_and_writes_nothing(argv, flag, tmp_path, capsys):
    out_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        dqn.main([*argv, "--output-dir", str(out_dir)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code != 0
    assert len(err.splitlines()) == 1 and flag in err, err
    assert not out_dir.exists()


def test_a_slurm_job_without_its_cluster_is_one_line(tmp_path):
    """A SLURM task count with none of the job's other variables (JAX finds no coordinator):
    one line naming the variable and the flags to give, exit 2, nothing written; here as
    task 1, whose watcher passes the child's line on."""
    env = {**os.environ, "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    argv = [sys.executable, dqn.__file__, "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "SLURM_NTASKS=2" in result.stderr and "--coordinator-address" in result.stderr
    assert not (tmp_path / "out").exists()


def test_cluster_processes_whose_device_lists_never_all_come_are_one_line(monkeypatch):
    """A process that stops between joining and JAX's first use of a device: the others wait for
    its list of CPU devices --cluster-timeout rounded up to minutes (JAX's own waits are 2 and 5
    minutes), then say so in one line, exit 1, not "no JAX backend" blaming XLA_FLAGS."""
    updates = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.update({name: value}))
    monkeypatch.setattr(dqn, "check_coordinator", lambda *args: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: None)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)

    def devices():
        raise RuntimeError("Unable to initialize backend 'cpu': INTERNAL: Getting local "
                           "topologies failed: GetKeyValue() timed out (you may need to uninstall "
                           "the failing plugin package)\nand more")  # fmt: skip

    monkeypatch.setattr(jax, "devices", devices)
    args = {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 1}
    dqn.join_cluster(argparse.Namespace(**args, cluster_timeout=90.0))
    assert updates["jax_cpu_get_local_topology_timeout_minutes"] == 2
    assert updates["jax_cpu_get_global_topology_timeout_minutes"] == 3
    with pytest.raises(SystemExit) as stop:
        dqn.check_backend()
    line = "dqn_cartpole.py: error: another process of the cluster stopped (Unable to initialize"
    assert str(stop.value.code).startswith(line) and "\n" not in stop.value.code
    assert stop.value.code.endswith("GetKeyValue() timed out)")  # not JAX's hint on plugins

    # Another failure in a cluster (this host's platform, say) is still this host's own line.
    def no_gpu():
        raise RuntimeError("Unable to initialize backend 'cuda': no CUDA-capable device")

    monkeypatch.setattr(jax, "devices", no_gpu)
    with pytest.raises(ValueError, match="JAX_PLATFORMS=.*: no JAX backend .*'cuda'"):
        dqn.check_backend()


def test_cli_output_dir_that_is_a_file_and_load_without_params(tmp_path, capsys, monkeypatch):
    """Each refused in one line. From an empty folder: an empty --output-dir was "." there, and
    a run wrote its files into it (from a folder that holds files, another line refused it)."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    for argv, flag in [
        (["--output-dir", str(a_file)], "--output-dir"),
        (["--output-dir", str(a_file / "sub")], "--output-dir"),  # checked before training
        (["--output-dir", "x" * 300], "--output-dir"),  # a name the OS refuses
        (["--output-dir", ""], "--output-dir must name a folder, not be empty"),
        (["--load", str(tmp_path), "--output-dir", str(tmp_path / "o")], "--load"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            dqn.main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code != 0 and len(err.splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "o").exists() and not any((tmp_path / "empty").iterdir())


def test_cli_error_from_a_fresh_process_has_no_traceback():
    result = subprocess.run(
        [sys.executable, "dqn_cartpole.py", "--gamma", "2"],
        capture_output=True,
        text=True,
        cwd=dqn.__file__.rsplit("/", 1)[0],
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "dqn_cartpole.py: error: --gamma must be in [0, 1)"
    ]


def test_default_xla_flags_shard_over_every_core_and_ask_a_gpu_for_determinism():
    """Without the user's XLA_FLAGS the script shows one CPU device per core and adds the GPU
    determinism flag, which XLA's CPU backend must accept too (it aborts on unknown flags)."""
    code = (
        "import os, dqn_cartpole, jax; "
        "print(jax.device_count(), os.cpu_count(), os.environ['XLA_FLAGS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=dqn.__file__.rsplit("/", 1)[0])  # fmt: skip
    assert result.returncode == 0, result.stderr
    devices, cores, *flags = result.stdout.split()
    assert devices == cores and "--xla_gpu_deterministic_ops=true" in flags


def test_gymnax_is_used_for_env_gymnax():
    assert isinstance(dqn.make_env("gymnax"), type(gymnax.make("CartPole-v1")[0]))


def test_cli_flags_come_from_the_config_fields():
    args = dqn.build_parser().parse_args(["--no-double-dqn", "--hidden-sizes", "32,8"])
    assert args.double_dqn is False and args.hidden_sizes == (32, 8)
    names = {f.name for f in dataclasses.fields(dqn.Config)}
    assert names <= set(vars(args))


BENCHMARKS = {  # name: (script, a tiny size, what it prints last)
    "article": (
        "dqn_cartpole.py",
        "--timesteps 500 --num-agents 64 --repeats 1 --one-core",
        "on one core each:",
    ),
    "sweep": ("dqn_sweep.py", "--seeds 1 --timesteps 200 --repeats 1", "sweep / single:"),
    "time split": ("dqn_time_split.py", "--agents 2 --steps 50 --repeats 1", "environment step"),
    "profile": ("dqn_time_split.py", "--agents 2 --steps 50 --profile", "dot"),  # an update op
    "blocks": (
        "dqn_segments.py",
        "--seeds 2 --timesteps 600 --repeats 1 --checkpoint-every 100",
        "blocks / one call:",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def benchmark_runs(request):
    """The benchmarks' tiny runs, started (when selected) as this file's tests begin, each in its
    own process at a lower priority: they are compile-bound, and the tests before them leave part
    of the cores idle, which these fill."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_benchmark_runs_from_a_clone_at_a_tiny_size"]  # fmt: skip
    runs = {}
    for name in names:
        script, tiny, _ = BENCHMARKS[name]
        runs[name] = subprocess.Popen(
            [sys.executable, f"benchmarks/{script}", *tiny.split()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=dqn.__file__.rsplit("/", 1)[0],
        )
        os.setpriority(os.PRIO_PROCESS, runs[name].pid, 10)  # the processes it starts inherit it
    yield runs
    for run in runs.values():
        run.kill()
        run.communicate()


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_from_a_clone_at_a_tiny_size(benchmark_runs, name):
    """Each benchmark finds what it measures next to it (dqn_cartpole.py's also its yardstick)
    and prints the ratios. None forks itself once JAX has loaded (dqn_cartpole.py --one-core did
    to pin its runs, and JAX warned of a deadlock)."""
    stdout, stderr = benchmark_runs[name].communicate(timeout=600)
    assert benchmark_runs[name].returncode == 0 and "os.fork()" not in stderr, stderr
    assert BENCHMARKS[name][2] in stdout, stdout


def run_and_interrupt(argv: list[str], signum: int, after: str) -> tuple[int, str]:
    """Start the script with argv, send `signum` once `after` is printed -> (exit code, output)."""
    process = subprocess.Popen(
        [sys.executable, "-u", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    for line in process.stdout:  # "-u": lines arrive as they are printed
        seen.append(line)
        if after in line:
            process.send_signal(signum)
            break
    rest, _ = process.communicate(timeout=120)
    return process.returncode, "".join(seen) + rest


# 7 blocks of 500 steps, then one of 234: a stop after the first block has 6 to spare.
RESUME_ARGS = [*TINY_ARGS, "--total-timesteps", "3734"]


def assert_goes_on(line: str, folder) -> None:
    """The line ends with the command that goes on, to paste into a shell here: this Python (a
    bare `python` may be one without jax) and the script, by paths from here, then --resume."""
    python, script, *rest = shlex.split(line.rsplit("to go on: ", 1)[1])
    assert os.path.samefile(python, sys.executable), line
    assert os.path.samefile(script, dqn.__file__) and rest == ["--resume", str(folder)], line
    assert not python.startswith("..") and not script.startswith(".."), line


def test_the_line_to_go_on_when_the_current_folder_was_deleted(tmp_path, monkeypatch, capsys):
    """The folder the run started in, deleted meanwhile: the run is saved and the line to go on
    names the script by its absolute path (a relative one needs that folder), exit 129. In this
    process: the first progress line deletes the folder and sends the SIGHUP. The Python that ran
    it is named by its absolute path too."""
    gone, stopped = tmp_path / "gone", tmp_path / "stopped"
    gone.mkdir()
    monkeypatch.chdir(gone)

    def hang_up(progress, steps, seconds):
        if gone.exists():
            gone.rmdir()
            os.kill(os.getpid(), signal.SIGHUP)  # the run's StopRequest handles it

    monkeypatch.setattr(dqn.Progress, "__call__", hang_up)
    with pytest.raises(SystemExit) as exit_info:  # 3 blocks: stopped after the second
        dqn.main([*TINY_ARGS, "--total-timesteps", "1500", "--output-dir", str(stopped)])
    err = capsys.readouterr().err
    hint = shlex.join([sys.executable, dqn.__file__, "--resume", str(stopped)])
    assert exit_info.value.code == 129 and err.strip().endswith(f"to go on: {hint}"), err
    assert (stopped / dqn.CHECKPOINT).exists()


@pytest.mark.parametrize("when", ["in the last block", "as training ends"])
def test_a_signal_as_the_run_ends_waits_until_it_is_written(tmp_path, capsys, monkeypatch, when):
    """A SIGHUP in the last block (asked to stop, but the run has ended) or just after training,
    before the writing began, once ended the script unheard (exit 0), or lost the trained run
    (its folder removed, "unfinished"). Now the run is written whole, then it stops, exit 129."""

    def hang_up(progress, steps=1000, seconds=0.0):  # as Progress.__call__ or Progress.close
        if steps == 1000:  # the last block's progress line, or its close
            os.kill(os.getpid(), signal.SIGHUP)

    name = "__call__" if when == "in the last block" else "close"
    monkeypatch.setattr(dqn.Progress, name, hang_up)
    monkeypatch.setattr(dqn, "RECEIVED", [])  # what stop() notes, this test's own
    previous = {s: signal.signal(s, dqn.stop) for s in (signal.SIGHUP, signal.SIGTERM)}
    try:  # SIGHUP's handler outside training, as when run as a script
        with pytest.raises(SystemExit) as exit_info:
            dqn.main([*TINY_ARGS, "--output-dir", str(tmp_path / "run")])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    err = capsys.readouterr().err
    assert exit_info.value.code == 129, err
    assert err.strip().endswith("stopped by SIGHUP once the run was written whole"), err
    assert (tmp_path / "run" / "summary.json").exists()
    assert not (tmp_path / "run" / dqn.CHECKPOINT).exists()  # the run ended


def test_a_signal_saves_the_run_and_resume_ends_as_if_never_stopped(tmp_path, capsys, monkeypatch):
    """A closed terminal (SIGHUP; Ctrl-C and SIGTERM alike) mid-training: the block in progress
    ends, the run so far is saved (summary, curves, params, figure and a checkpoint of the whole
    training state), one line says how to go on, to paste into a shell, exit 129, no traceback.
    --resume then ends with the very files of a run never stopped, bit for bit, judged by the
    run's own --solved-return, drops the checkpoint and what --load wrote of the old params (its
    line and load_summary.json say at which step they are, not "final"); a damaged copy of it is
    one line, and so is the folder while a run still holds it or this user cannot write to it
    (named by --resume).
    So does a run killed past half way, from its --checkpoint-every checkpoint. Every run takes
    exactly 3,734 steps."""
    stopped, whole = tmp_path / "stopped run", tmp_path / "whole"
    argv = [dqn.__file__, *RESUME_ARGS, "--solved-return", "100", "--output-dir", str(stopped)]
    code, printed = run_and_interrupt(argv, signal.SIGHUP, "%  train")  # the first block's line
    assert code == 129 and "Traceback" not in printed, printed
    assert_goes_on(printed.strip().splitlines()[-1], stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    assert 0 < summary["steps_done"] < 3_734 and summary["steps_done"] % 500 == 0
    after = f"greedy return of 3 seeds after {summary['steps_done']:,} of 3,734 steps: "
    assert after in printed and "final greedy" not in printed, printed  # they were not final
    assert (stopped / dqn.CHECKPOINT).exists() and (stopped / "learning_curves.png").exists()
    with np.load(stopped / dqn.CHECKPOINT) as saved:  # the 3 seeds, not the 64 padded agents
        arrays = [saved[name] for name in saved.files if name.startswith(("carry_", "metrics_"))]
        assert {len(x) for x in arrays} == {3}, {len(x) for x in arrays}
    with np.load(stopped / dqn.CHECKPOINT) as file:
        arrays = dict(file)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for leaf in (arrays["carry_0"].astype(np.float64), arrays["carry_0"][..., None]):
        np.savez(damaged / dqn.CHECKPOINT, **{**arrays, "carry_0": leaf})
        with pytest.raises(SystemExit) as exit_info:
            dqn.main(["--resume", str(damaged)])  # before the block compiles, not a traceback
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "checkpoint does not fit its own config" in err, err
    run = json.loads(str(arrays["run"]))
    assert run["jax_enable_x64"] is False and run["render"] is False  # as this session runs
    np.savez(
        damaged / dqn.CHECKPOINT, **{**arrays, "run": json.dumps(run | {"jax_enable_x64": True})}
    )
    with pytest.raises(SystemExit) as exit_info:  # saved under JAX_ENABLE_X64: named, not "damaged"
        dqn.main(["--resume", str(damaged)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "its run had JAX_ENABLE_X64 set; so must this" in err, err
    held = os.open(stopped, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run that still writes there
    with pytest.raises(SystemExit):
        dqn.main(["--resume", str(stopped)])
    os.close(held)
    assert "error: --resume: " in capsys.readouterr().err  # the flag given, not --output-dir
    with monkeypatch.context() as patch, pytest.raises(SystemExit):  # a read-only mount, say
        patch.setattr(os, "access", lambda path, mode: False)
        dqn.main(["--resume", str(stopped)])
    assert f"error: --resume {stopped}: " in capsys.readouterr().err  # not --output-dir either
    # A folder where the run writes a file: it trained, then failed to write (exit 1), half of
    # the run written. Now one line before it trains.
    for name, flag in ("params.msgpack", "--resume"), ("load_summary.json", "--load"):
        moved = (stopped / name).rename(tmp_path / name) if (stopped / name).exists() else None
        (stopped / name).mkdir()
        with monkeypatch.context() as patch, pytest.raises(SystemExit) as exit_info:
            patch.setattr(dqn, "run_training", lambda *a, **k: pytest.fail("it trained"))
            patch.setattr(dqn, "greedy_episodes", lambda *a, **k: pytest.fail("it played"))
            dqn.main([flag, str(stopped)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"it holds a folder {name}, where" in err, err
        (stopped / name).rmdir()
        if moved:
            moved.rename(stopped / name)
    (stopped / "sweep.png").mkdir()  # a name --load never writes: no reason to refuse
    with monkeypatch.context() as patch:
        patch.setattr(dqn, "greedy_episodes", lambda *a, **k: pytest.fail("it played"))
        with pytest.raises(pytest.fail.Exception, match="it played"):
            dqn.main(["--load", str(stopped)])
    (stopped / "sweep.png").rmdir()
    dqn.main(["--load", str(stopped), "--eval-episodes", "1"])  # it said "final", and its
    loaded = json.loads((stopped / "load_summary.json").read_text())  # summary not which step
    assert loaded["steps_done"] == summary["steps_done"] and after in capsys.readouterr().out
    full = shutil.copytree(stopped, tmp_path / "full disk", ignore=lambda *_: ["load_summary.json"])
    before = {name: (full / name).read_bytes() for name in dqn.RUN_FILES}
    opened = dqn.atomic_open

    @contextlib.contextmanager
    def full_disk(path, *args, **kwargs):  # as the resumed run writes its params
        with opened(path, *args, **kwargs) as file:
            if path.name == "params.msgpack":
                raise OSError(28, "No space left on device")
            yield file

    with monkeypatch.context() as patch, pytest.raises(SystemExit) as exit_info:
        patch.setattr(dqn, "atomic_open", full_disk)
        dqn.main(["--resume", str(full)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and "params.msgpack (No space left" in err[-1], err
    # It left the new summary and curves beside the stop's params (--load scored them as the
    # whole run's); now the stop's three files, as they were, and its checkpoint to go on from
    assert {name: (full / name).read_bytes() for name in dqn.RUN_FILES} == before
    assert (full / dqn.CHECKPOINT).exists() and not list(full.glob(".*"))
    for name in ("load_summary.json", "render.gif"):  # as --load of the stopped run writes
        (stopped / name).write_text("{}")
    dqn.main(["--resume", str(stopped)])
    assert not any((stopped / name).exists() for name in ("load_summary.json", "render.gif"))
    resumed = json.loads((stopped / "summary.json").read_text())  # the run's own threshold
    assert resumed["environment"]["solved_return"] == 100 and "(>= 100)" in capsys.readouterr().out
    assert resumed["timed_from_step"] == summary["steps_done"]  # its timings are this session's
    dqn.main([*RESUME_ARGS, "--output-dir", str(whole)])
    assert json.loads((whole / "summary.json").read_text())["timed_from_step"] == 0
    for name in ("params.msgpack", "curves.csv"):
        assert (stopped / name).read_bytes() == (whole / name).read_bytes(), name
    assert not (stopped / dqn.CHECKPOINT).exists()
    lines = (whole / "curves.csv").read_text().splitlines()
    steps = [int(row["step"]) for row in csv.DictReader(lines)]
    assert steps[:9] == [*range(0, 3_501, 500), 3_734]
    # A crash (kill -9) after step 1,500: --resume goes on from a checkpoint that
    # --checkpoint-every 1000 saved (the default saves none this early), and ends as the whole
    # run did.
    crashed = tmp_path / "crashed"
    argv = [sys.executable, "-u", dqn.__file__, *RESUME_ARGS, "--checkpoint-every", "1000"]
    process = subprocess.Popen([*argv, "--output-dir", str(crashed)], stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    seen = []
    for line in process.stderr:  # progress lines: "  40%  train 0.6 s ...", one a block
        seen.append(line)
        done = (line.split() or [""])[0]
        if done.endswith("%") and int(done[:-1]) >= 40:  # 1,500 of 3,734 steps
            process.kill()
            break
    seen.append(process.communicate(timeout=60)[1])
    with np.load(crashed / dqn.CHECKPOINT) as file:  # saved at a multiple of 1,000 steps
        assert int(file["blocks_done"]) in (2, 4, 6), "".join(seen)
    assert not (crashed / "summary.json").exists(), "".join(seen)
    # --resume saves as often as the run did (it went back to the default of 25,000), or as told
    assert dqn.parse_command(["--resume", str(crashed)])[0].checkpoint_every == 1000
    told = ["--resume", str(crashed), "--checkpoint-every", "0"]
    assert dqn.parse_command(told)[0].checkpoint_every == 0
    dqn.main(["--resume", str(crashed)])
    for name in ("params.msgpack", "curves.csv"):
        assert (crashed / name).read_bytes() == (whole / name).read_bytes(), name


def test_curves_cut_short_are_refused_not_drawn(tmp_path):
    rows = ["seed,step,eval_return,train_return,loss", "0,0,9,,", "0,500,20,15,0.5"]
    rows += ["1,0,8,,", "1,500,30,12,0.4"]
    path, steps = tmp_path / "curves.csv", np.array([0, 500])
    shape = ([{}], 2, steps)  # one grid point (nothing swept), two seeds
    path.write_text("\n".join([*rows, ""]))  # a blank line: skipped, as csv.DictReader does
    assert dqn.read_curves(path, *shape)["step"].shape == (1, 2, 2)
    path.write_text("\ufeff" + "\n".join(rows))  # a spreadsheet's byte-order mark: "no seed"
    assert dqn.read_curves(path, *shape)["step"].shape == (1, 2, 2)
    path.write_text("\n".join([rows[0].replace("loss", "eval_return"), *rows[1:]]))
    with pytest.raises(ValueError, match="its header names 'eval_return' twice"):  # the loss
        dqn.read_curves(path, *shape)  # column was drawn as the returns
    path.write_text("\n".join([*rows[:4], "1,1000,30,12,0.4"]))  # mixed
    with pytest.raises(ValueError, match="its steps are not the run's evaluations, in order"):
        dqn.read_curves(path, *shape)
    # Seed 0's rows only, a summary edited to one seed (drawn as one seed going back to step
    # 0), no rows (a TypeError deep in matplotlib): each refused, naming the seeds.
    for text, num_seeds in (rows[:3], 2), (rows, 1), (rows[:1], 2):
        path.write_text("\n".join(text))
        with pytest.raises(ValueError, match=f"hold the summary's {num_seeds} seeds"):
            dqn.read_curves(path, [{}], num_seeds, steps)
    for row in "1,500,30,12", "1,500,30,12,0.4,7":  # a value short (read as NaN), one more
        path.write_text("\n".join([*rows[:4], row]))
        with pytest.raises(ValueError, match=r"^curves.csv: its line 5 has [46] values, not 5$"):
            dqn.read_curves(path, *shape)
    # Drawn: seeds in another order (seed 1's curve as seed 0's); a NaN evaluation was an error
    # in matplotlib, blamed on summary.json (where the figure is drawn); a text named no file.
    for text, why in (
        ([rows[0], *rows[3:], *rows[1:3]], "^curves.csv: its rows are not the summary's seeds"),
        ([*rows[:4], "1,500,nan,12,0.4"], "^curves.csv: an eval_return in it is not a finite"),
        ([*rows[:4], "1,500,x,12,0.4"], "^curves.csv: could not convert string to float: 'x'"),
    ):
        path.write_text("\n".join(text))
        with pytest.raises(ValueError, match=why):
            dqn.read_curves(path, *shape)


def test_replot_and_load_refuse_files_that_disagree(tmp_path, capsys):
    """Hand-edited files that each read well alone but disagree were drawn or reported as they
    came, exit 0: curves.csv's steps out of order or scaled (the histogram of "final" returns
    drew step 500's), a sweep's blocks of rows swapped (with or without their hyperparameter
    cells), a grid point's label edited, a seed's final return added, and under --load grid
    points that are NaN, alike, a boolean or not the config's. Now each is one line naming the
    file, exit 2, as --resume already refused them in its checkpoint."""
    one, sweep = tmp_path / "one", tmp_path / "sweep"
    dqn.main([*TINY_ARGS, "--output-dir", str(one)])
    dqn.main([*TINY_ARGS, "--learning-rate", "0.001,0.003", "--output-dir", str(sweep)])
    capsys.readouterr()

    def edit_csv(change):  # change: rows -> rows, each a list of cells, the header first
        def edit(folder):
            lines = (folder / "curves.csv").read_text().splitlines()
            rows = change([line.split(",") for line in lines])
            (folder / "curves.csv").write_text("\n".join(",".join(row) for row in rows))

        return edit

    def edit_json(change):  # change: edits the summary in place
        def edit(folder):
            summary = json.loads((folder / "summary.json").read_text())
            change(summary)
            (folder / "summary.json").write_text(json.dumps(summary))

        return edit

    # 3 seeds x 3 evaluations (steps 0, 500, 1000) a grid point; the sweep's second from row 10
    def steps_reordered(r):  # each seed's at steps 1000, 0, 500
        return [r[0], *(r[seed + i] for seed in (1, 4, 7) for i in (2, 0, 1))]

    def steps_scaled(r):
        return [r[0], *([row[0], str(int(row[1]) * 10), *row[2:]] for row in r[1:])]

    def swapped(r):
        return [r[0], *r[10:19], *r[1:10]]

    def swapped_keeping_cells(r):
        return [r[0], *([a[0], *b[1:]] for a, b in zip(r[1:19], swapped(r)[1:], strict=True))]

    def point(i, **change):
        return lambda summary: summary["grid"][i]["hparams"].update(change)

    def alike(summary):
        summary["grid"][1]["hparams"] = summary["grid"][0]["hparams"]

    def one_more_seed(summary):
        summary["grid"][0]["final_eval_return"].append(999.0)

    steps, final = "curves.csv: its steps are not", "summary.json: its final returns are not"
    column = "curves.csv: its learning_rate column is not the summary's grid points in order"
    cases = [
        (one, "--replot", edit_csv(steps_reordered), steps),
        (one, "--replot", edit_csv(steps_scaled), steps),
        (sweep, "--replot", edit_csv(swapped), column),
        (sweep, "--replot", edit_csv(swapped_keeping_cells), final),
        (sweep, "--replot", edit_json(point(1, learning_rate=0.5)), column),
        (sweep, "--replot", edit_json(one_more_seed), final),
        (sweep, "--load", edit_json(point(0, learning_rate=float("nan"))), "--learning-rate must"),
        (sweep, "--load", edit_json(alike), "summary.json: two of its grid points are alike"),
        (sweep, "--load", edit_json(point(0, tau=True)), "is not one number a hyperparameter"),
        (sweep, "--load", edit_json(point(0, learning_rate=0.5)), "not its first grid point"),
    ]
    for number, (run, flag, edit, why) in enumerate(cases):
        folder = shutil.copytree(run, tmp_path / f"edited {number}")
        edit(folder)
        before = {path.name: path.read_bytes() for path in folder.iterdir()}
        with pytest.raises(SystemExit) as exit_info:
            dqn.main([flag, str(folder)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and why in err, (number, err)
        assert {path.name: path.read_bytes() for path in folder.iterdir()} == before, number
    dqn.main(["--replot", str(sweep)])  # the files as written: drawn
    assert "redrew" in capsys.readouterr().out


def test_load_refuses_params_of_other_agents_than_the_summary_says(tmp_path, capsys):
    """One seed short, or the network's names and shapes in another dtype (complex params ended
    in a traceback, float64 ones were evaluated as they came). And the run's own params with more
    --eval-episodes than memory holds: one line before it plays (an out-of-memory traceback), no
    folder made and nothing written."""
    network = dqn.QNetwork(TINY.hidden_sizes, 2, TINY.layer_norm)
    init = jax.vmap(lambda key: network.init(key, jnp.zeros(4)))
    params = init(jax.random.split(jax.random.key(0), TINY.num_seeds))
    config = dataclasses.asdict(TINY) | {"output_dir": str(tmp_path)}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config}))
    (tmp_path / "curves.csv").write_text("seed,step\n")
    packed = msgpack.unpackb(flax.serialization.msgpack_serialize(params))
    for saved, problem in (
        (jax.tree.map(lambda x: x[1:], params), f"does not hold its {TINY.num_seeds} agents"),
        (jax.tree.map(lambda x: np.asarray(x, np.complex64), params), "not its own env's"),
        # Keys of two types: JAX's "Comparator raised exception while sorting ..." was the line.
        (msgpack.packb(packed | {1: 2}), "not its own env's"),
    ):
        if not isinstance(saved, bytes):
            saved = flax.serialization.msgpack_serialize(saved)
        (tmp_path / "params.msgpack").write_bytes(saved)
        with pytest.raises(SystemExit) as exit_info:
            dqn.main(["--load", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and problem in err[0], err
    (tmp_path / "params.msgpack").write_bytes(flax.serialization.msgpack_serialize(params))
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(SystemExit) as exit_info:  # 10^9 episodes: hundreds of GiB
        dqn.main(["--load", str(tmp_path), "--eval-episodes", "1000000000", "--output-dir",
                  str(elsewhere)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("dqn_cartpole.py: error: --eval-episodes 1000000000: evaluating"), err
    assert not elsewhere.exists() and not (tmp_path / "load_summary.json").exists()


def test_load_of_a_damaged_run_names_the_file_and_its_error(tmp_path, capsys):
    """A summary.json without its config was "cannot read a saved run ('config')"."""
    config = dataclasses.asdict(TINY) | {"output_dir": str(tmp_path)}
    (tmp_path / "curves.csv").write_text("seed,step\n")
    (tmp_path / "params.msgpack").write_bytes(b"")
    for summary, problem in (
        ({}, "cannot read its summary.json: KeyError: 'config'"),
        ({"config": config}, "cannot read its params.msgpack: Unpack failed: incomplete input"),
    ):
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        with pytest.raises(SystemExit) as exit_info:
            dqn.main(["--load", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and problem in err[0], err


def test_a_saved_config_of_other_types_is_refused_as_it_is_read(tmp_path, capsys):
    """A hand-edited value whose type is not its field's (a width of 16.0, a float seed count, a
    number for a flag) is one line as --load or --resume reads it, not a traceback later, and so
    are another script's config and an unknown env; the saved config itself, and an int for a
    float, are taken as they are; a setting left out is refused."""
    saved = json.loads(json.dumps(dataclasses.asdict(TINY)))  # as summary.json holds it
    assert dqn.saved_config(saved) == TINY
    assert dqn.saved_config(saved | {"gamma": 1}) == dataclasses.replace(TINY, gamma=1.0)
    with pytest.raises(
        ValueError, match="^its config lacks 'gamma'$"
    ):  # its default, not the run's
        dqn.saved_config({name: value for name, value in saved.items() if name != "gamma"})
    bad = [("hidden_sizes", [16.0, 16.0]), ("hidden_sizes", 16), ("num_seeds", 3.0)]
    bad += [("env", 5), ("layer_norm", "yes"), ("double_dqn", 1), ("learning_rate", None)]
    for name, value in bad:
        with pytest.raises(ValueError, match=f"^{name} .* is not of the type of its default"):
            dqn.saved_config(saved | {name: value})
    for edit, problem in (({"layout": "S.G"}, "'layout', not a setting of dqn_cartpole.py"),
                          ({"env": "nonsense"}, "--env nonsense is unknown")):  # fmt: skip
        with pytest.raises(ValueError, match=problem):  # another script's run, an unknown env
            dqn.saved_config(saved | edit)
    edited = saved | {"hidden_sizes": [16.0, 16.0]}
    (tmp_path / "summary.json").write_text(json.dumps({"config": edited}))
    (tmp_path / "params.msgpack").write_bytes(b"")
    (tmp_path / "curves.csv").write_text("seed,step\n")
    run = json.dumps({"config": edited, "points": [TINY.hparams()._asdict()]})
    metrics = {f"metrics_{name}": np.zeros((TINY.num_seeds, 1)) for name in dqn.CURVES}
    np.savez(tmp_path / dqn.CHECKPOINT, run=run, blocks_done=0, **metrics)
    for flag in ("--load", "--resume"):
        with pytest.raises(SystemExit) as exit_info:
            dqn.main([flag, str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and "hidden_sizes [16.0" in err[0], err


def test_a_second_sigterm_or_sighup_asks_again_and_a_second_ctrl_c_stops_at_once(capsys):
    """A hang-up sends SIGHUP twice (the shell's, then the kernel's), and a cluster's child gets
    SIGTERM from its watcher and from a process group's kill: each is the first request again,
    and the run is still saved. Only Ctrl-C again stops at once (as outside training), whatever
    handler was there before training: main's written_whole holds signals, not stops."""
    held = []  # the handler from before training, here one that holds signals
    previous = {s: signal.signal(s, lambda n, _: held.append(n)) for s in dqn.SIGNALS}
    try:
        with dqn.StopRequest() as stop:
            for signum in (signal.SIGHUP, signal.SIGHUP, signal.SIGTERM):
                os.kill(os.getpid(), signum)
            assert stop.signum == signal.SIGHUP
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert held == []
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    err = capsys.readouterr().err.splitlines()  # one notice, with no Ctrl-C hint after a hang-up
    assert len(err) == 1 and "SIGHUP: the run stops" in err[0] and "Ctrl-C" not in err[0], err
    with dqn.StopRequest():  # a first Ctrl-C: someone at the terminal, who can press it again
        os.kill(os.getpid(), signal.SIGINT)
    assert "(Ctrl-C again to stop at once, unsaved)" in capsys.readouterr().err


def test_a_watched_process_takes_ctrl_c_twice_as_one_request(monkeypatch, capsys):
    """Process 1 of a cluster runs in a child of its watcher, which passes every signal on. A
    scheduler that signals every process of a job (Slurm's srun on a Ctrl-C) reaches the child
    directly too: two Ctrl-Cs at once, which stopped it at once, unsaved, and process 0 with it.
    There they are one request: the run is saved."""
    monkeypatch.setenv("DQN_CARTPOLE_WATCHED", "1")
    with dqn.StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        assert stop.signum == signal.SIGINT
    err = capsys.readouterr().err.splitlines()  # no offer to press it again: none would tell
    assert len(err) == 1 and "Ctrl-C: the run stops" in err[0] and "again" not in err[0], err


def ctrl_c_twice(argv: list[str], cwd=None) -> tuple[int, list[str]]:
    """The script run with argv (in cwd), Ctrl-C as it starts training and again once it says
    it will stop after the block -> (exit code, lines printed)."""
    process = subprocess.Popen(
        [sys.executable, "-u", dqn.__file__, *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
    )  # fmt: skip
    printed = []
    for line in process.stdout:
        printed.append(line)
        if "at once per device" in line or "the run stops once" in line:
            process.send_signal(signal.SIGINT)
    return process.wait(timeout=120), printed


def test_stopped_at_once_before_anything_was_saved_leaves_no_folder(tmp_path):
    """Ctrl-C twice while the first block compiles: the second stops the run at once (exit 130,
    no traceback), and its folder, still empty, is removed. The first block is long (50k steps),
    so that the second signal comes before it ends even on a busy machine."""
    folder = tmp_path / "run"
    args = [*RESUME_ARGS, "--total-timesteps", "100000", "--eval-every", "50000"]  # the last wins
    code, printed = ctrl_c_twice([*args, "--output-dir", str(folder)])
    assert code == 130 and "Traceback" not in "".join(printed), printed
    assert not folder.exists(), sorted(folder.iterdir())


def test_overwrite_keeps_the_previous_run_until_the_new_one_saves(tmp_path, monkeypatch):
    """--overwrite removed the previous run as the new one started, so a run stopped at once (a
    second Ctrl-C, here raised after the first block), an error or a kill lost both. Now the
    previous run stays as it was until the new one saves: its first checkpoint replaces it, or
    its data at the end (a figure that then cannot be written does not undo them). Only a
    folder that held a run, under --overwrite, is one to replace; and only in its own main()."""
    folder, fresh = tmp_path / "run", tmp_path / "fresh"
    folder.mkdir()
    previous = {name: f"previous {name}" for name in [*dqn.RUN_FILES, "learning_curves.png"]}
    for name, text in previous.items():
        (folder / name).write_text(text)
    monkeypatch.setattr(dqn, "TO_REPLACE", set())
    blocks = []

    def interrupt(progress, steps, seconds):  # as the second Ctrl-C, after `stop_after` blocks
        blocks.append(steps)
        if len(blocks) == stop_after:
            raise KeyboardInterrupt

    monkeypatch.setattr(dqn.Progress, "__call__", interrupt)
    stop_after = 1  # no checkpoint yet
    with pytest.raises(KeyboardInterrupt):  # a new folder: nothing to replace
        dqn.main([*TINY_ARGS, "--output-dir", str(fresh), "--overwrite"])
    assert not dqn.TO_REPLACE  # the stopped script's line said "the run it was to replace stays"
    (fresh / ".curves.tmp.csv").touch()  # as a crash in a write leaves it: cleaned as it writes
    blocks.clear()
    with pytest.raises(KeyboardInterrupt):
        dqn.main([*TINY_ARGS, "--output-dir", str(fresh), "--overwrite"])
    assert fresh in dqn.TO_REPLACE
    argv = [*TINY_ARGS, "--output-dir", str(folder), "--overwrite", "--checkpoint-every"]
    blocks.clear()
    with pytest.raises(KeyboardInterrupt):
        dqn.main([*argv, "0"])
    assert {path.name: path.read_text() for path in folder.iterdir()} == previous
    assert folder in dqn.TO_REPLACE  # the stopped script's line: "the run it was to replace"
    with pytest.raises(SystemExit):  # the next main() in this process (a notebook) starts anew
        dqn.main(["--resume", str(tmp_path / "missing")])
    assert not dqn.TO_REPLACE  # a --load of the run would have replaced it with its summary
    blocks.clear()
    stop_after = 2  # after the first block's checkpoint
    with pytest.raises(KeyboardInterrupt):
        dqn.main([*argv, "500"])
    assert [path.name for path in folder.iterdir()] == [dqn.CHECKPOINT] and not dqn.TO_REPLACE
    # Killed after that checkpoint, before it removed the previous run's files it set aside:
    for name in previous:
        dqn.set_aside(folder / name).write_text(previous[name])
    stop_after = 0  # a --resume of it removes them, and goes on to the end
    dqn.main(["--resume", str(folder)])
    assert sorted(path.name for path in folder.iterdir()) == sorted(previous)
    assert json.loads((folder / "summary.json").read_text())["steps_done"] == 1_000
    # to the end, where the figure cannot be written: the data stay
    monkeypatch.setattr(dqn, "plot_run", lambda output: sys.exit("cannot write the figure"))
    with pytest.raises(SystemExit):
        dqn.main([*argv, "0"])
    assert sorted(path.name for path in folder.iterdir()) == sorted(dqn.RUN_FILES)
    assert json.loads((folder / "summary.json").read_text())["steps_done"] == 1_000


def test_a_checkpoint_on_the_way_that_cannot_be_written_does_not_end_the_run(
    tmp_path, monkeypatch, capsys
):
    """A full disk as a checkpoint fell due ended the run with one line, the trained agents
    lost, though its final files are far smaller (no replay buffers, target networks or
    optimizer states). Now one line says so and training goes on: the run ends written whole,
    replacing the previous run (--overwrite), which stayed as it was until then; no temporary
    file is left. One for a stop ended the run with one line, exit 1, and nothing of it saved
    (a folder of its own removed): now the run so far is saved without it, and the line that
    says it stopped says it has no checkpoint to go on from (a newline in the folder's name
    shown escaped, in each line)."""
    folder = tmp_path / "run\n1"
    shown = str(folder / dqn.CHECKPOINT).replace("\n", "\\n")
    folder.mkdir()
    previous = {name: f"previous {name}" for name in dqn.RUN_FILES}
    for name, text in previous.items():
        (folder / name).write_text(text)
    monkeypatch.setattr(dqn, "TO_REPLACE", set())
    tried = []

    def full_disk(file, **arrays):
        tried.append({path.name: path.read_bytes() for path in folder.iterdir()})
        file.write(b"part of a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    seen = []
    progress = dqn.Progress.__call__

    def look(self, steps, seconds):  # the folder as each block ends, before any checkpoint
        seen.append({path.name: path.read_bytes() for path in folder.iterdir()})
        progress(self, steps, seconds)

    with monkeypatch.context() as patch:
        patch.setattr(dqn.Progress, "__call__", look)
        argv = [*TINY_ARGS, "--checkpoint-every", "500", "--output-dir", str(folder), "--overwrite"]
        dqn.main(argv)
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "dqn_cartpole.py: warning:" in line]
    assert warnings == [
        f"dqn_cartpole.py: warning: cannot write {shown} (No space left on device); "
        "training goes on"
    ], captured.err
    aside = {dqn.set_aside(folder / name).name: text.encode() for name, text in previous.items()}
    being_written = dqn.temporary(folder / dqn.CHECKPOINT).name
    assert tried == [{**aside, being_written: b""}]  # after the first of two blocks
    assert seen == [{name: text.encode() for name, text in previous.items()}] * 2  # put back
    assert sorted(path.name for path in folder.iterdir()) == sorted(
        [*dqn.RUN_FILES, "learning_curves.png"]
    )
    assert json.loads((folder / "summary.json").read_text())["steps_done"] == 1_000
    # One for a stop (SIGTERM as training starts: after the first block): the run so far is
    # saved in place of the one it was to replace, without a checkpoint.
    start = dqn.Progress.__init__

    def stop_at_once(self, *args):
        start(self, *args)
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(dqn.Progress, "__init__", stop_at_once)
    with pytest.raises(SystemExit) as exit_info:
        dqn.main([*TINY_ARGS, "--output-dir", str(folder), "--overwrite"])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 143 and len(tried) == 2, err
    assert err[-2:] == [
        f"dqn_cartpole.py: warning: cannot write {shown} (No space left on device); the run so "
        "far is saved without it",
        f"dqn_cartpole.py: stopped by SIGTERM after 500 of 1,000 steps, saved in "
        f"{shown.removesuffix('/' + dqn.CHECKPOINT)}/; no checkpoint to go on from",
    ], err
    assert sorted(path.name for path in folder.iterdir()) == sorted(
        [*dqn.RUN_FILES, "learning_curves.png"]
    )
    assert json.loads((folder / "summary.json").read_text())["steps_done"] == 500


def test_a_checkpoint_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch, capsys):
    """A finished run removes its checkpoint; one that cannot go (immutable: chattr +i) was a
    traceback once the run was saved (an adversarial pass). Now one line, exit 1, the run saved."""
    unlink, output = Path.unlink, tmp_path / "run"

    def immutable(path, missing_ok=False):
        if path.name == dqn.CHECKPOINT:
            raise PermissionError(1, "Operation not permitted", str(path))
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", immutable)
    with pytest.raises(SystemExit) as exit_info:
        dqn.main([*TINY_ARGS, "--checkpoint-every", "500", "--output-dir", str(output)])
    err = capsys.readouterr().err.strip().splitlines()
    line = f"cannot remove {output / dqn.CHECKPOINT} (Operation not permitted): the run is saved"
    assert exit_info.value.code == 1 and err[-1].startswith(f"dqn_cartpole.py: error: {line}"), err
    assert all((output / name).exists() for name in dqn.RUN_FILES)


def test_a_stop_whose_checkpoint_fails_names_the_older_one_it_leaves(tmp_path, monkeypatch, capsys):
    """A stop at 1,500 steps whose checkpoint cannot be written saves the run so far beside the
    last checkpoint written, at 500: its line said "to go on" as if that checkpoint were this
    stop's, and --resume goes back 1,000 steps. Now it says which step the checkpoint is of."""
    savez, calls = np.savez, []

    def full_after_the_first(file, **arrays):
        calls.append(len(calls))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        savez(file, **arrays)

    monkeypatch.setattr(np, "savez", full_after_the_first)
    progress = dqn.Progress.__call__

    def stop_after_1000(self, steps, seconds):  # seen as the next block ends, at 1,500
        progress(self, steps, seconds)
        if steps == 1000:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(dqn.Progress, "__call__", stop_after_1000)
    folder, size = tmp_path / "run", ["--total-timesteps", "2000", "--checkpoint-every", "500"]
    with pytest.raises(SystemExit) as exit_info:
        dqn.main([*TINY_ARGS, *size, "--output-dir", str(folder)])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 143 and len(calls) == 3, err  # at 500, 1,000 and the stop
    assert "after 1,500 of 2,000 steps" in err[-1], err
    assert "; its checkpoint is from step 500, before this; to go on: " in err[-1], err
    assert json.loads((folder / "summary.json").read_text())["steps_done"] == 1_500


def test_the_line_to_go_on_names_a_python_in_this_folder_by_its_path(monkeypatch):
    """Run from the folder of its Python, the line named it `python`, which a shell looks up on
    PATH (another Python, maybe without jax); with no path to it (an embedded Python), a
    ValueError's traceback."""
    monkeypatch.chdir(Path(sys.executable).parent)
    python = shlex.split(dqn.resume_hint(Path("run")))[3]
    assert python == os.path.join(".", Path(sys.executable).name), python
    monkeypatch.setattr(sys, "executable", "")
    assert shlex.split(dqn.resume_hint(Path("run")))[3:] == [
        "python",
        dqn.__file__,
        "--resume",
        "run",
    ]


def test_a_resume_stopped_before_it_locks_its_folder_says_how_to_go_on(tmp_path, monkeypatch):
    """A --resume stopped after it read the checkpoint but before it locked the folder (as it
    joins a cluster, say) said only "unfinished": the checkpoint stays, and the line now says
    how to go on from it, as it does once the folder is locked. A new run stopped there has
    none to name."""
    folder = tmp_path / "run"
    blocks = []

    def interrupt(progress, steps, seconds):  # after the first block's checkpoint
        blocks.append(steps)
        if len(blocks) == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(dqn.Progress, "__call__", interrupt)
        with pytest.raises(KeyboardInterrupt):
            dqn.main([*TINY_ARGS, "--checkpoint-every", "500", "--output-dir", str(folder)])
    assert (folder / dqn.CHECKPOINT).exists()
    monkeypatch.setattr(dqn, "LOCKED", {})  # as a fresh process holds no lock
    monkeypatch.setattr(dqn, "join_cluster", lambda args: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        dqn.main(["--resume", str(folder)])
    assert not dqn.LOCKED and dqn.stopped_unfinished(signal.SIGINT) == (
        "dqn_cartpole.py: stopped by Ctrl-C, unfinished; no file half-written; its last "
        f"checkpoint stays, {dqn.resume_hint(folder)}"
    )
    with pytest.raises(KeyboardInterrupt):
        dqn.main([*TINY_ARGS, "--output-dir", str(tmp_path / "new")])
    assert dqn.stopped_unfinished(signal.SIGINT) == (
        "dqn_cartpole.py: stopped by Ctrl-C, unfinished; no file half-written"
    )


def test_stopped_at_once_says_how_to_go_on_from_the_last_checkpoint(tmp_path):
    """Ctrl-C twice while a resumed run compiles: it stops at once, unsaved, and the checkpoint
    it started from stays: the line says so, and how to go on (it said only "unfinished"). So
    does a run that was to replace it (--overwrite): the stopped run stays as it was, and the
    line says how to go on with it (it said only that the run stayed). Both started where the
    folder is `run`: the line says `--resume run`, as it was named (it spelled it absolutely)."""
    folder = tmp_path / "run"
    argv = [dqn.__file__, *RESUME_ARGS, "--output-dir", str(folder)]
    assert run_and_interrupt(argv, signal.SIGTERM, "%  train")[0] == 143  # saved after a block
    saved = (folder / dqn.CHECKPOINT).read_bytes()
    code, printed = ctrl_c_twice(["--resume", "run"], cwd=tmp_path)
    assert code == 130, printed
    assert "its last checkpoint stays, to go on: " in printed[-1], printed
    assert_goes_on(printed[-1].strip(), "run")
    code, printed = ctrl_c_twice([*RESUME_ARGS, "--output-dir", "run", "--overwrite"], tmp_path)
    assert code == 130, printed
    stays = "the run it was to replace stays; its last checkpoint stays, to go on: "
    assert stays in printed[-1], printed
    assert_goes_on(printed[-1].strip(), "run")
    assert (folder / dqn.CHECKPOINT).read_bytes() == saved


def test_resume_and_replot_refuse_other_flags_and_a_folder_without_a_checkpoint(tmp_path, capsys):
    for argv, flag in [
        (["--resume", str(tmp_path)], "--resume"),
        (["--resume", str(tmp_path), "--gamma", "0.9"], "--gamma"),
        (["--resume", str(tmp_path), "--overwrite"], "--overwrite"),
        (["--replot", str(tmp_path), "--total-timesteps", "5"], "leave out --total-timesteps"),
        (["--replot", str(tmp_path), "--load", str(tmp_path)], "leave out --load"),
        (["--replot", str(tmp_path), "--solved-return", "100"], "leave out --solved-return"),
        (["--replot", str(tmp_path), "--cluster-timeout", "5"], "leave out --cluster-timeout"),
        # one at its default value too (it was let through, and ignored)
        (["--replot", str(tmp_path), "--cluster-timeout", "60"], "leave out --cluster-timeout"),
        (["--resume", str(tmp_path), "--solved-return", "100"], "leave out --solved-return"),
        (["--load", str(tmp_path), "--overwrite"], "--overwrite: --load writes into the run's"),
        # how often to save, and a cluster's flags, are this command's: on to the checkpoint
        (["--resume", str(tmp_path), "--checkpoint-every", "7"], "no checkpoint.npz in it"),
        (["--resume", str(tmp_path / "finished")], "its run has ended"),
        # it said "checkpoint.npz is not an .npz archive" for each
        (["--resume", str(tmp_path / "missing")], "missing: no such folder"),
        (["--resume", str(tmp_path / "finished" / "summary.json")], "json: not a folder"),
        (["--resume", str(tmp_path / "gridworld")], "not a run of dqn_cartpole.py ("),
        # --load said "cannot read its summary.json: FileNotFoundError: [Errno 2] ..." for these
        (["--load", str(tmp_path / "missing")], "missing: no such folder"),
        (["--load", str(tmp_path / "finished" / "summary.json")], "json: not a folder"),
        (["--load", str(tmp_path)], "not a saved run (it has no summary.json)"),
        (["--load", str(tmp_path / "finished")], "cannot read its params.msgpack: no such file"),
        (["--load", str(tmp_path / "gridworld")], "not a setting of dqn_cartpole.py"),
        (["--replot", str(tmp_path / "missing")], "cannot redraw (no such folder)"),
        (["--replot", str(tmp_path / "finished" / "summary.json")], "redraw (not a folder)"),
    ]:
        finished = json.loads(json.dumps(dataclasses.asdict(dqn.Config())))  # as a run saves it
        for name, config in (("finished", finished), ("gridworld", {"layout": "four_rooms"})):
            (tmp_path / name).mkdir(exist_ok=True)  # a summary, and no checkpoint
            (tmp_path / name / "summary.json").write_text(json.dumps({"config": config}))
        with pytest.raises(SystemExit) as exit_info:
            dqn.main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_a_checkpoint_that_does_not_hold_together_is_one_line(tmp_path):
    """Refused as --resume reads it, before any training: a hand-edited or damaged checkpoint
    (one whose metrics are strings, or NaN, or of another --eval-every, went on to train and
    then failed, or wrote a run whose steps went backwards)."""
    config = dataclasses.asdict(dqn.Config())
    point = dqn.Config().hparams()._asdict()
    seeds, every = config["num_seeds"], config["eval_every"]

    def metrics(done=2, step=np.int32, returns=np.float32):  # as a run saves them
        arrays = {name: np.zeros((seeds, done + 1), returns) for name in dqn.CURVES}
        return arrays | {"step": np.tile(np.arange(done + 1) * every, (seeds, 1)).astype(step)}

    def checkpoint(points=(point,), done=2, arrays=None, **run):
        run = json.dumps({"config": config, "points": list(points)} | run)
        arrays = metrics(done) if arrays is None else arrays
        np.savez(tmp_path / dqn.CHECKPOINT, run=run, blocks_done=done,
                 **{f"metrics_{name}": x for name, x in arrays.items()})  # fmt: skip
        return str(tmp_path)

    assert dqn.load_checkpoint(checkpoint(solved_return=100.0)).solved_return == 100.0
    assert dqn.load_checkpoint(checkpoint()).solved_return is None  # the env's own
    # A run trained with --render: --resume, which takes no --render, removed the stopped run's
    # render.gif and drew none as the run ended.
    assert dqn.load_checkpoint(checkpoint(render=True)).render is True
    assert dqn.load_checkpoint(checkpoint()).render is False  # an older checkpoint: not said
    edited = metrics() | {"step": metrics()["step"] * 3 // 5}  # saved with --eval-every 300
    # Each written as it is read (they shared one file, written all at once: each check read
    # the last).
    agents, evaluations = "its arrays do not hold the same agents", "its metrics are not its"
    for changes, why in (
        ({"points": []}, "0 grid points, 2 of 10 blocks done"),
        ({"done": 10**6}, "1 grid points, 1000000 of 10 blocks done"),
        ({"points": [{"gamma": 0.9}]}, "a grid point is not one number a hyperparameter: {'g"),
        # A point that is not its config's, or not of numbers: --resume trained with it, and its
        # summary said the config's values.
        ({"points": [point | {"gamma": 0.5}]}, "its config is not its first grid point"),
        ({"points": [point, point]}, "two of its grid points are alike"),
        ({"points": [point | {"gamma": "0.5"}]}, "a grid point is not one number a hyperpa"),
        ({"points": [point | {"gamma": True}]}, "a grid point is not one number a hyperpa"),
        ({"points": [point | {"other": 1.0}]}, "a grid point is not one number a hyperpa"),
        ({"done": -1}, "1 grid points, -1 of 10 blocks done"),
        ({"done": 1, "arrays": metrics(0)}, agents),  # one block done, metrics of step 0 only
        # more agents than its config has seeds: --resume trained and reported the first ones
        ({"arrays": {name: np.concatenate([x, x]) for name, x in metrics().items()}}, agents),
        ({"arrays": metrics() | {"step": metrics(step=np.float32)["step"] * np.nan}}, evaluations),
        ({"arrays": metrics(step=str)}, evaluations),
        ({"arrays": metrics(returns=str)}, evaluations),
        ({"arrays": edited}, evaluations),
        # trained to the end, then the figure's check of curves.csv was a traceback
        ({"arrays": metrics() | {"eval_return": metrics()["eval_return"] + np.nan}}, "an eval_"),
        ({"solved_return": "yes"}, "its solved return 'yes' is not a number below 3.4e38"),
        ({"solved_return": 1e39}, "its solved return 1e+39 is not a number below 3.4e38"),
        ({"render": "yes"}, "its render 'yes' is not true or false"),
    ):
        with pytest.raises(ValueError, match=rf"no checkpoint to resume from \({re.escape(why)}"):
            dqn.load_checkpoint(checkpoint(**changes))
    (tmp_path / dqn.CHECKPOINT).write_bytes(os.urandom(1000))  # np.load: "allow_pickle=..."
    with pytest.raises(ValueError, match=r"\(checkpoint.npz is not an .npz archive\)$"):
        dqn.load_checkpoint(str(tmp_path))
    # A run killed as --overwrite first wrote over this one: its checkpoint is set aside.
    (tmp_path / dqn.CHECKPOINT).rename(dqn.set_aside(tmp_path / dqn.CHECKPOINT))
    with pytest.raises(ValueError, match="no checkpoint.npz, but .checkpoint.old.npz, which a run"):
        dqn.load_checkpoint(str(tmp_path))
    (tmp_path / "summary.json").write_text("{}")  # put back before the kill: not "it has ended"
    with pytest.raises(ValueError, match="no checkpoint.npz, but .checkpoint.old.npz, which a run"):
        dqn.load_checkpoint(str(tmp_path))
