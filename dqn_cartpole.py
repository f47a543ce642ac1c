"""DQN on CartPole-v1 or a discrete-action gymnax env: many seeds in one call (PureJaxRL style).

    python dqn_cartpole.py --num-seeds 512                     # train 512 independent agents
    python dqn_cartpole.py --load runs/dqn_cartpole_<time> --render   # re-evaluate, a GIF
    python dqn_cartpole.py --env gymnax:Acrobot-v1 --train-frequency 4 --gamma 0.99,0.995  # a sweep

The whole experiment (acting, replay buffer, updates, target network, greedy evaluation) is one
pure function from a key and HParams to params and metrics. Seed i trains on fold_in(key(seed), i):

    train = make_train(Config())
    keys = jax.vmap(partial(jax.random.fold_in, jax.random.key(0)))(jnp.arange(512))
    out = jax.jit(jax.vmap(train))(keys)  # {"params": [512, ...], "metrics": {name: [512, 11]}}
    hparams = jax.tree.map(lambda v: jnp.full(512, v), Config().hparams())  # a sweep of gamma:
    out = jax.jit(jax.vmap(train))(keys, hparams._replace(gamma=jnp.linspace(0.99, 0.999, 512)))

Beyond vanilla DQN, each with its reason where it is made: Double DQN, Huber loss, LayerNorm,
clipping, Polyak targets. Above the appendix line: the reference, complete. Below: at scale.
"""

import dataclasses
import math
import os
import signal
from functools import partial
from typing import Any, NamedTuple

if "XLA_FLAGS" not in os.environ:  # each CPU core a JAX device; a GPU run the same every time
    cores = f"--xla_force_host_platform_device_count={os.cpu_count() or 1}"
    os.environ["XLA_FLAGS"] = f"{cores} --xla_gpu_deterministic_ops=true"
if __name__ == "__main__":  # a Ctrl-C or SIGTERM while JAX loads waits for the handlers
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})

import distrax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct


# ---- Config --------------------------------------------------------------------------------
def option(default: Any, help: str) -> Any:
    """A Config field whose help text becomes its --flag's help."""
    return dataclasses.field(default=default, metadata={"help": help})


MAX_EVAL_POINTS = 1_000  # bounds the metrics memory: evaluations per run, after step 0's


@dataclasses.dataclass(frozen=True)
class Config:
    total_timesteps: int = option(50_000, "environment steps per seed")
    num_seeds: int = option(1, "independent agents trained at once (vmapped, sharded)")
    seed: int = option(0, "base seed; seed i of a run uses fold_in(key(seed), i)")
    learning_rate: float = option(2.5e-3, "Adam step size at the start of training")
    anneal_lr: bool = option(True, "decay the step size linearly to 0: freezes a good policy")
    # 0.995, not 0.99: a cart that drifts off the track 300 steps later, 0.99 hardly sees.
    gamma: float = option(0.995, "discount factor")
    buffer_size: int = option(500, "replay buffer capacity per seed; small: fresh data beat old")
    batch_size: int = option(32, "transitions per gradient update")
    hidden_sizes: tuple[int, ...] = option((64, 64), "MLP hidden widths, e.g. 64,64")
    layer_norm: bool = option(True, "LayerNorm after each hidden Dense: keeps Q from diverging")
    train_frequency: int = option(8, "environment steps per gradient update (4 for Acrobot)")
    learning_starts: int = option(1_000, "environment steps before the first update")
    # In environment steps, as CleanRL: the defaults move the target twice an update, 0.19 in all.
    target_update_interval: int = option(4, "environment steps between target updates")
    tau: float = option(0.1, "target update weight: 1 copies the online net, <1 is Polyak")
    # Tight: with 10, some seeds' solved policies later fell apart (README).
    max_grad_norm: float = option(0.5, "clip gradients to this global norm")
    epsilon_start: float = option(1.0, "exploration rate at step 0")
    epsilon_end: float = option(0.05, "exploration rate after the linear decay")
    exploration_fraction: float = option(0.1, "share of total_timesteps the decay lasts")
    double_dqn: bool = option(True, "Double DQN target: online net picks, target net rates")
    eval_every: int = option(5_000, "environment steps between greedy evaluations and key splits")
    eval_episodes: int = option(10, "fresh episodes per greedy evaluation (epsilon 0)")
    env: str = option("cartpole", "cartpole (ours), gymnax (its CartPole-v1) or gymnax:<id>")
    output_dir: str = option("runs/dqn_{env}_{time}", "run folder; {time}: its start")

    @property
    def blocks(self) -> tuple[tuple[int, int, int], ...]:
        """(first block, blocks, steps in each): the evaluation blocks, the last may be shorter."""
        full, rest = divmod(self.total_timesteps, self.eval_every)
        return tuple(b for b in ((0, full, self.eval_every), (full, 1, rest)) if b[1] and b[2])

    def __post_init__(self):
        """ValueError('--flag problem') for the first bad size or count; the CLI checks HParams."""
        positive = ("total_timesteps", "num_seeds", "buffer_size", "batch_size")
        positive += ("train_frequency", "target_update_interval", "eval_every", "eval_episodes")
        checks = [(name, getattr(self, name) >= 1, "must be >= 1") for name in positive]
        widths_ok = len(self.hidden_sizes) > 0 and min(self.hidden_sizes) >= 1
        few_evals = self.total_timesteps / max(1, self.eval_every) <= MAX_EVAL_POINTS
        checks += [
            ("hidden_sizes", widths_ok, "needs one or more widths >= 1, e.g. 64,64"),
            ("learning_starts", self.learning_starts >= 0, "must be >= 0"),
            ("batch_size", self.batch_size <= self.buffer_size, "must be <= --buffer-size"),
            ("eval_every", few_evals, f"is too small: more than {MAX_EVAL_POINTS} evaluations"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} {problem}")

    def hparams(self) -> "HParams":
        return HParams(**{name: getattr(self, name) for name in HParams._fields})


class HParams(NamedTuple):
    """The hyperparameters that change no array shape and no branch, as data: arrays [agents]
    under jax.vmap(train) make one compiled call a sweep. The command line checks their values."""

    learning_rate: jax.Array | float
    gamma: jax.Array | float
    tau: jax.Array | float
    max_grad_norm: jax.Array | float
    epsilon_start: jax.Array | float
    epsilon_end: jax.Array | float
    exploration_fraction: jax.Array | float


# ---- Environment: CartPole-v1 as Gymnasium defines it, with gymnax 1.0's API ------------
@struct.dataclass
class EnvState:
    x: jax.Array  # cart position (m)
    x_dot: jax.Array  # cart velocity
    theta: jax.Array  # pole angle (rad), 0 is upright
    theta_dot: jax.Array  # pole angular velocity
    time: jax.Array  # steps taken in this episode


@struct.dataclass
class EnvParams:
    # Gymnasium's classic_control/cartpole.py constants (total mass and the like: in step).
    gravity: float = 9.8
    masscart: float = 1.0
    masspole: float = 0.1
    length: float = 0.5  # half the pole's length
    force_mag: float = 10.0
    tau: float = 0.02  # seconds per Euler step (Gymnasium's name; not Config.tau)
    theta_threshold_radians: float = 12 * 2 * math.pi / 360
    x_threshold: float = 2.4
    max_steps_in_episode: int = 500  # the TimeLimit of CartPole-v1
    reset_bound: float = 0.05  # reset draws every state variable from U(-0.05, 0.05)


class CartPole:
    """Gymnasium's CartPole-v1 in JAX, gymnax 1.0's API: step -> (obs, state, reward, terminated,
    truncated, info), auto-reset at an episode's end, info["final_observation"] the obs before it.
    Terminated (the pole fell, the cart left) is a terminal state; truncated (500 steps) is not."""

    num_actions = 2
    default_params = EnvParams()

    def reset(self, key: jax.Array, params: EnvParams | None = None):
        bound = (self.default_params if params is None else params).reset_bound
        x, x_dot, theta, theta_dot = jax.random.uniform(key, (4,), minval=-bound, maxval=bound)
        state = EnvState(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot, time=jnp.int32(0))
        return self.observe(state), state

    def observe(self, state: EnvState) -> jax.Array:
        return jnp.stack([state.x, state.x_dot, state.theta, state.theta_dot])

    def step(self, key: jax.Array, state: EnvState, action, params: EnvParams | None = None):
        p = self.default_params if params is None else params
        total_mass, polemass_length = p.masspole + p.masscart, p.masspole * p.length
        force = jnp.where(action == 1, p.force_mag, -p.force_mag)
        cos, sin = jnp.cos(state.theta), jnp.sin(state.theta)
        temp = (force + polemass_length * state.theta_dot**2 * sin) / total_mass
        denominator = p.length * (4.0 / 3.0 - p.masspole * cos**2 / total_mass)
        theta_acc = (p.gravity * sin - cos * temp) / denominator
        x_acc = temp - polemass_length * theta_acc * cos / total_mass
        # Euler: positions move with the old velocities (Gymnasium's default integrator).
        stepped = EnvState(
            x=state.x + p.tau * state.x_dot,
            x_dot=state.x_dot + p.tau * x_acc,
            theta=state.theta + p.tau * state.theta_dot,
            theta_dot=state.theta_dot + p.tau * theta_acc,
            time=state.time + 1,
        )
        pole_fell = jnp.abs(stepped.theta) > p.theta_threshold_radians
        terminated = pole_fell | (jnp.abs(stepped.x) > p.x_threshold)  # or the cart left
        truncated = stepped.time >= p.max_steps_in_episode
        reward = jnp.float32(1.0)  # Gymnasium pays 1 on every step, the terminating one too
        final_obs = self.observe(stepped)
        reset_obs, reset_state = self.reset(key, params)
        done = terminated | truncated
        state = jax.tree.map(lambda r, s: jnp.where(done, r, s), reset_state, stepped)
        obs = jnp.where(done, reset_obs, final_obs)
        return obs, state, reward, terminated, truncated, {"final_observation": final_obs}


# ---- Network -------------------------------------------------------------------------------
@jax.custom_gradient
def matmul(x: jax.Array, kernel: jax.Array):
    """nn.Dense's x @ kernel, in full float32, not TF32 (a GPU's default; it solved fewer seeds).
    Its backward takes x^T dy from a copy of x^T that the barrier keeps XLA from folding back:
    faster on a CPU (README); plain nn.Dense differs only in rounding. Reverse mode only."""

    def backward(dy: jax.Array):
        x_t = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)
        return matmul(dy, kernel.T), matmul(x_t, dy.reshape(-1, dy.shape[-1]))

    return jnp.matmul(x, kernel, precision=jax.lax.Precision.HIGHEST), backward


class QNetwork(nn.Module):
    """MLP from an observation to one Q-value per action."""

    hidden_sizes: tuple[int, ...]
    num_actions: int
    layer_norm: bool = False

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:  # [..., obs] -> [..., actions]
        dense = partial(nn.Dense, dot_general=lambda x, kernel, *_, **__: matmul(x, kernel))
        x = obs
        for width in self.hidden_sizes:
            x = dense(width)(x)
            if self.layer_norm:
                x = nn.LayerNorm()(x)
            x = nn.relu(x)
        return dense(self.num_actions)(x)


# ---- Replay buffer: pure functions over fixed-size arrays ----------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # [..., obs]
    action: jax.Array  # [...] int32
    reward: jax.Array  # [...]
    next_obs: jax.Array  # [..., obs] the true next observation, before any auto-reset
    terminated: jax.Array  # [...] bool: a terminal state, NOT a time-limit truncation


class Buffer(NamedTuple):
    data: Transition  # every field has a leading [capacity] axis
    pointer: jax.Array  # next slot to write; wraps around (a ring)
    size: jax.Array  # filled slots, at most capacity


def buffer_init(capacity: int, obs_size: int) -> Buffer:
    data = Transition(
        obs=jnp.zeros((capacity, obs_size), jnp.float32),
        action=jnp.zeros(capacity, jnp.int32),
        reward=jnp.zeros(capacity, jnp.float32),
        next_obs=jnp.zeros((capacity, obs_size), jnp.float32),
        terminated=jnp.zeros(capacity, bool),
    )
    return Buffer(data=data, pointer=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: Buffer, transition: Transition) -> Buffer:
    """Write one transition at the pointer: the next empty slot, or the oldest once full. Cast to
    the buffer's dtypes: JAX_ENABLE_X64 makes float64 obs and int64 actions (else JAX warns)."""
    capacity, i = buffer.data.reward.shape[0], buffer.pointer
    data = jax.tree.map(lambda d, x: d.at[i].set(x.astype(d.dtype)), buffer.data, transition)
    pointer = (i + 1) % capacity
    return Buffer(data=data, pointer=pointer, size=jnp.minimum(buffer.size + 1, capacity))


def buffer_sample(buffer: Buffer, key: jax.Array, batch_size: int) -> Transition:
    """Uniform over the filled slots only (the zeros beyond `size` are not data)."""
    idx = jax.random.randint(key, (batch_size,), 0, jnp.maximum(buffer.size, 1))
    return jax.tree.map(lambda d: d[idx], buffer.data)  # [batch, ...]


# ---- Agent: target, loss, greedy episodes ---------------------------------------------------
class AgentState(NamedTuple):
    params: Any
    target_params: Any
    opt_state: Any


def td_target(reward, terminated, next_q_target, next_q_online, gamma: float):
    """r + gamma * Q_target(s', a') unless s' is terminal; a' is the online net's pick (Double DQN,
    van Hasselt 2016), or with next_q_online None the target net's own (plain DQN: its max). A
    truncated s' still bootstraps: the time limit is not part of the task, so s' has a future."""
    best = jnp.argmax(next_q_target if next_q_online is None else next_q_online, axis=-1)
    next_value = jnp.take_along_axis(next_q_target, best[..., None], axis=-1)[..., 0]
    return reward + gamma * (1.0 - terminated) * next_value


def dqn_loss(params, target_params, apply_fn, batch: Transition, gamma: float, double_dqn: bool):
    """Huber loss between Q(s, a) and the (constant) TD target, over the batch."""
    q = apply_fn(params, batch.obs)  # [batch, actions]
    q_taken = jnp.take_along_axis(q, batch.action[:, None], axis=-1)[:, 0]  # [batch]
    next_q_online = apply_fn(params, batch.next_obs) if double_dqn else None
    next_q_target = apply_fn(target_params, batch.next_obs)
    target = td_target(batch.reward, batch.terminated, next_q_target, next_q_online, gamma)
    # Huber, not squared error: a few large TD errors early on do not blow up the net.
    return jnp.mean(optax.huber_loss(q_taken, jax.lax.stop_gradient(target)))


def greedy_episodes(key, params, env, network: QNetwork, num_episodes: int, keep_obs=False):
    """The returns [episodes] of fresh greedy (epsilon 0) episodes side by side, each for the full
    time limit, steps after its end masked; `keep_obs`: also (obs, alive) [steps, episodes, ...]."""
    keys = jax.random.split(key, num_episodes + 1)  # one per episode's reset, one for the steps
    obs, state = jax.vmap(env.reset)(keys[:-1])  # [episodes, obs]
    max_steps = int(env.default_params.max_steps_in_episode)  # a float in gymnax's bandits

    def eval_step(carry, step_key):
        obs, state, alive, total = carry
        # Split here, not drawn for every step at once: [steps, episodes] keys grow with episodes.
        keys = jax.random.split(step_key, num_episodes)
        action = jnp.argmax(network.apply(params, obs), axis=-1)  # [episodes]
        next_obs, state, reward, terminated, truncated, _ = jax.vmap(env.step)(keys, state, action)
        total = total + reward * alive
        carry = (next_obs, state, alive & ~(terminated | truncated), total)
        return carry, ((obs, alive) if keep_obs else None)

    init = (obs, state, jnp.ones(num_episodes, bool), jnp.zeros(num_episodes, jnp.float32))
    (_, _, _, total), seen = jax.lax.scan(eval_step, init, jax.random.split(keys[-1], max_steps))
    return (total, seen) if keep_obs else total


# ---- Train: one pure function from a key to params and metrics -----------------------------
class Carry(NamedTuple):
    agent: AgentState
    buffer: Buffer
    env_state: Any
    obs: jax.Array  # [obs]
    episode_return: jax.Array  # return of the running training episode
    key: jax.Array


def make_blocks(config: Config, env, network: QNetwork):
    """(init, run_blocks): init(key, hp) -> (Carry, metrics [1] of the untrained network);
    run_blocks(carry, hp, blocks [n], steps) -> (Carry, metrics [n]): steps, then an evaluation."""
    num_updates = (config.total_timesteps - config.learning_starts) // config.train_frequency

    def make_optimizer(hp: HParams):
        lr = hp.learning_rate
        if config.anneal_lr:  # linear to 0, reached at about the last update
            lr = optax.linear_schedule(hp.learning_rate, 0.0, max(1, num_updates))
        return optax.chain(optax.clip_by_global_norm(hp.max_grad_norm), optax.adam(lr))

    def update(hp: HParams, agent: AgentState, buffer: Buffer, key: jax.Array):
        batch = buffer_sample(buffer, key, config.batch_size)
        loss, grads = jax.value_and_grad(dqn_loss)(
            agent.params, agent.target_params, network.apply, batch, hp.gamma, config.double_dqn
        )
        updates, opt_state = make_optimizer(hp).update(grads, agent.opt_state, agent.params)
        params = optax.apply_updates(agent.params, updates)
        return agent._replace(params=params, opt_state=opt_state), loss

    def no_update(hp: HParams, agent: AgentState, buffer: Buffer, key: jax.Array):
        return agent, jnp.float32(0.0)

    def step(hp: HParams, carry: Carry, xs) -> tuple[Carry, dict]:
        t, (act_key, env_key, sample_key) = xs  # t: the global step index, the same every seed
        # Linear from epsilon_start to epsilon_end over the first exploration_fraction of the run.
        progress = jnp.clip(t / (hp.exploration_fraction * config.total_timesteps), 0.0, 1.0)
        epsilon = (hp.epsilon_start - hp.epsilon_end) * (1.0 - progress) + hp.epsilon_end
        q_values = network.apply(carry.agent.params, carry.obs)  # [actions]
        action = distrax.EpsilonGreedy(q_values, epsilon).sample(seed=act_key)  # ties at random
        obs, state, reward, terminated, truncated, info = env.step(env_key, carry.env_state, action)
        transition = Transition(
            obs=carry.obs,
            action=action,
            reward=reward,
            next_obs=info["final_observation"],
            terminated=terminated,
        )
        buffer = buffer_add(carry.buffer, transition)

        # Predicates of t alone, which vmap does not batch: real branches, not a select of both.
        learning = t + 1 >= config.learning_starts
        updated = learning & ((t + 1) % config.train_frequency == 0)
        agent, loss = jax.lax.cond(updated, update, no_update, hp, carry.agent, buffer, sample_key)
        target = jax.lax.cond(
            learning & ((t + 1) % config.target_update_interval == 0),
            lambda a: optax.incremental_update(a.params, a.target_params, hp.tau),
            lambda a: a.target_params,
            agent,
        )

        episode_return = carry.episode_return + reward
        done = terminated | truncated
        carry = carry._replace(
            agent=agent._replace(target_params=target),
            buffer=buffer,
            env_state=state,
            obs=obs,
            episode_return=jnp.where(done, 0.0, episode_return),
        )
        # An episode's return is reported on its last step only; the loss where an update ran.
        stats = {"finished_return": jnp.where(done, episode_return, 0.0), "done": done}
        return carry, {**stats, "loss": loss, "updated": updated}

    def run_block(hp: HParams, steps: int, carry: Carry, block) -> tuple[Carry, dict]:
        # One split per block: the act, env and sample keys of all its steps, made at once.
        key, step_key, eval_key = jax.random.split(carry.key, 3)
        xs = (block * config.eval_every + jnp.arange(steps), jax.random.split(step_key, (steps, 3)))
        carry, info = jax.lax.scan(partial(step, hp), carry._replace(key=key), xs)
        returns = greedy_episodes(eval_key, carry.agent.params, env, network, config.eval_episodes)
        episodes, updates = info["done"].sum(), info["updated"].sum()
        return carry, {
            "step": block * config.eval_every + steps,
            "eval_return": returns.mean(),
            # Means over the episodes ended and updates run; 0 with none (NaN trips JAX_DEBUG_NANS).
            "train_return": info["finished_return"].sum() / jnp.maximum(episodes, 1),
            "loss": info["loss"].sum() / jnp.maximum(updates, 1),
            "episodes": episodes,
            "updates": updates,
        }

    def run_blocks(carry: Carry, hp: HParams, blocks: jax.Array, steps: int):
        return jax.lax.scan(partial(run_block, hp, steps), carry, blocks)

    def init(key: jax.Array, hp: HParams) -> tuple[Carry, dict]:
        key, init_key, reset_key, eval_key = jax.random.split(key, 4)
        obs, env_state = env.reset(reset_key)
        params = network.init(init_key, obs)
        opt_state = make_optimizer(hp).init(params)
        carry = Carry(
            agent=AgentState(params=params, target_params=params, opt_state=opt_state),
            buffer=buffer_init(config.buffer_size, obs.shape[-1]),
            env_state=env_state,
            obs=obs,
            episode_return=jnp.float32(0.0),
            key=key,
        )
        # The curves start at step 0, with the untrained network: no episode ended, no update.
        returns = greedy_episodes(eval_key, params, env, network, config.eval_episodes)
        start = {"step": 0, "eval_return": returns.mean(), "episodes": 0, "updates": 0}
        start |= {"train_return": jnp.float32(0.0), "loss": jnp.float32(0.0)}
        return carry, jax.tree.map(lambda x: jnp.asarray(x)[None], start)

    return init, run_blocks


def make_train(config: Config, env=None, network=None):
    """Returns train(key, hparams=None) -> {"params", "metrics"}: one seed's whole experiment
    (the Config's hyperparameters if hparams is None; float32, even under JAX_ENABLE_X64): init,
    then blocks of eval_every steps, each ending in a greedy evaluation."""
    if env is None and config.env != "cartpole":  # make_env(config.env) in the appendix builds it
        raise ValueError(f"make_train: pass the env for env={config.env!r}")
    env = CartPole() if env is None else env
    if network is None:
        network = QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    init, run_blocks = make_blocks(config, env, network)

    def train(key: jax.Array, hparams: HParams | None = None) -> dict:
        hp = jax.tree.map(jnp.float32, config.hparams() if hparams is None else hparams)
        carry, metrics = init(key, hp)
        for first, count, steps in config.blocks:
            carry, more = run_blocks(carry, hp, first + jnp.arange(count), steps)
            metrics = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), metrics, more)
        return {"params": carry.agent.params, "metrics": metrics}  # metrics: [1 + blocks]

    return train


# ===== Appendix: running it at scale and reporting =====
# ruff: noqa: E402  (the reference above runs on its own imports; these serve the machinery)
import argparse
import contextlib
import csv
import ctypes
import fcntl
import importlib.metadata
import itertools
import json
import platform
import shlex
import socket
import subprocess
import sys
import time
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import flax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

BOOTSTRAP_SAMPLES = 2_000
# A CPU's seeds, vmapped 16 at a time, stay in cache: faster than all at once (README); a GPU's not.
CPU_SEEDS_PER_BATCH = 16
# Gymnasium's reward_threshold for the ids it registers too (gymnasium/envs/__init__.py). A
# table rather than gymnasium.spec(id): running the script does not need gymnasium installed.
SOLVED_RETURNS = {"CartPole-v1": 475.0, "Acrobot-v1": -100.0, "MountainCar-v0": -110.0}
SOME_ENVS = "cartpole, gymnax, gymnax:Acrobot-v1, gymnax:MountainCar-v0, gymnax:Breakout-MinAtar"
# A million agents of the default config hold ~280 GiB (memory_need), more than a GPU has.
MAX_GRID_POINTS = 1_000_000
MOST_ROWS = 40  # of the sweep's figure: its best and worst 20 grid points
# The values the update rule can use, checked for every grid point: train() takes HParams as data.
HPARAM_RULES = {
    "learning_rate": (lambda x: 0 < x < math.inf, "must be > 0 and finite"),
    "gamma": (lambda x: 0 <= x < 1, "must be in [0, 1)"),
    "tau": (lambda x: 0 < x <= 1, "must be in (0, 1]"),
    "max_grad_norm": (lambda x: 0 < x < math.inf, "must be > 0 and finite"),
    "epsilon_start": (lambda x: 0 <= x <= 1, "must be in [0, 1]"),
    "epsilon_end": (lambda x: 0 <= x <= 1, "must be in [0, 1]"),
    "exploration_fraction": (lambda x: 0 < x <= 1, "must be in (0, 1]"),
}


def wait(tree):
    """jax.block_until_ready, but a Ctrl-C or SIGTERM is handled within 0.1 s, not at its end."""
    for leaf in jax.tree.leaves(tree):
        while not leaf.is_ready():
            time.sleep(0.05)
    return tree


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def gymnax_id(env: str) -> str:
    """The gymnax id of the environment an --env value names (our CartPole is CartPole-v1)."""
    if env in ("cartpole", "gymnax"):
        return "CartPole-v1"
    if not env.startswith("gymnax:"):
        raise ValueError(f"--env {env} is unknown; try {SOME_ENVS}")
    return env.removeprefix("gymnax:")


def make_env(env: str):
    """Our CartPole, or a gymnax environment with discrete actions (the same step API, gymnax
    1.0), its observations flattened to one vector (MinAtar's are 10x10 images with channels)."""
    if env == "cartpole":
        return CartPole()
    import gymnax  # imported here: it takes a second or two, and only gymnax envs need it
    from gymnax.environments.spaces import Discrete
    from gymnax.wrappers.purerl import FlattenObservationWrapper

    env_id = gymnax_id(env)
    try:
        gym_env, params = gymnax.make(env_id)
    except ValueError:
        raise ValueError(f"--env {env}: gymnax has no {env_id}; try {SOME_ENVS}") from None
    except Exception as error:  # one that downloads its data, say, offline
        raise ValueError(f"--env {env}: gymnax cannot make {env_id} ({error})"[:300]) from None
    if not isinstance(gym_env.action_space(params), Discrete):
        raise ValueError(f"--env {env}: DQN needs discrete actions, {env_id} has continuous ones")
    obs = jax.eval_shape(gym_env.reset, jax.random.key(0))[0]
    return gym_env if obs.ndim == 1 else FlattenObservationWrapper(gym_env)


def grid_points(lists: dict[str, tuple[float, ...]]) -> list[dict[str, float]]:
    """Every combination of the lists, the first flag changing slowest; ValueError('--flag
    problem') for a value the update rule cannot use, or for more than MAX_GRID_POINTS."""
    if (count := math.prod(len(values) for values in lists.values())) > MAX_GRID_POINTS:
        longest = max(lists, key=lambda name: len(lists[name]))
        raise ValueError(f"{flag(longest)}: the lists make {count:,} grid points (the product of "
                         f"their lengths), more than {MAX_GRID_POINTS:,}")  # fmt: skip
    for name, values in lists.items():
        valid, problem = HPARAM_RULES[name]
        with np.errstate(over="ignore"):  # beyond float32 becomes inf, which the rules refuse
            float32 = [float(np.float32(value)) for value in values]
        if not all(valid(value) for value in values):  # False for NaN too
            raise ValueError(f"{flag(name)} {problem}")
        if not all(valid(value) for value in float32):  # 1 - 1e-9 is 1 in float32, 1e-46 is 0
            raise ValueError(f"{flag(name)} {problem} as a float32, what train() computes with")
        if any(0 < abs(value) < np.finfo(np.float32).tiny for value in float32):  # 1e-40, say
            raise ValueError(f"{flag(name)}: below 1.2e-38, float32 values are 0 to XLA")
        if len(set(float32)) < len(values):  # two grid points that could not be told apart
            first = {}  # float32 value: the index of its first
            i, j = next((first[v], k) for k, v in enumerate(float32) if first.setdefault(v, k) != k)
            raise ValueError(f"{flag(name)} lists a value twice (in float32): {values[i]!r} and "
                             f"{values[j]!r}")  # fmt: skip
    return [dict(zip(lists, values, strict=True)) for values in itertools.product(*lists.values())]


def hparam_grid(points: list[dict[str, float]]) -> HParams:
    """The grid points as one HParams of float32 arrays [points]."""
    return HParams(*np.array([[p[name] for name in HParams._fields] for p in points], np.float32).T)


class SeedPlan(NamedTuple):
    num_devices: int
    padded_seeds: int  # agents (grid points x seeds) padded to whole batches on every device
    seeds_per_batch: int  # per device: agents vmapped at once (lax.map runs the batches)
    bytes_per_seed: int


def memory_need(config: Config, env, network: QNetwork) -> tuple[dict[str, int], dict]:
    """(A generous estimate of the device bytes one seed's `train` needs, by the flag that drives
    each part: a refusal names the largest; the bytes every agent holds from block to block).
    The latter thrice: a block's carry in and out, and the host's copy (measured: see README)."""
    obs = jax.eval_shape(env.reset, jax.random.key(0))[0]
    params = jax.tree.leaves(jax.eval_shape(network.init, jax.random.key(0), obs))
    num_params, widths = sum(x.size for x in params), config.hidden_sizes
    block = min(config.eval_every, config.total_timesteps)
    num_metrics = 6 * (1 + config.total_timesteps // block)
    buffer_words = config.buffer_size * (2 * obs.size + 3)
    words = {
        "--hidden-sizes": 6 * num_params,  # params, target, Adam's two moments, grads, updates
        "--buffer-size": buffer_words,  # the replay buffer
        "--eval-every": 2 * (3 * block + 5),  # a block's keys
        "--eval-episodes": 4 * config.eval_episodes * (max(widths) + obs.size),  # evaluation
        "--total-timesteps": num_metrics,
    }
    # An update's activations (batch x widths), named after the one further above its default.
    default = Config()
    wide = sum(widths) / sum(default.hidden_sizes) > config.batch_size / default.batch_size
    name = "--hidden-sizes" if wide else "--batch-size"
    words[name] = words.get(name, 0) + 6 * config.batch_size * sum(widths)
    held = {  # what every agent holds from block to block, by the flag that drives each part
        "--hidden-sizes": 4 * num_params,  # params, target and Adam's two moments
        "--buffer-size": buffer_words,
        "--total-timesteps": num_metrics,
    }
    # In bytes (4-byte words), x2 for the temporaries XLA keeps beside the loop; held x3 (above).
    need = {name: 2 * 4 * count for name, count in words.items()}
    return need, {name: 3 * 4 * count for name, count in held.items()}


def check_memory(terms: dict[str, int], held: dict[str, int], num_agents: int) -> SeedPlan:
    """The seed plan (plan_seeds), or a MemoryError naming the flag to change, before any work:
    one seed's training must fit in half a device's free memory, and what every agent trained,
    padding ones too, holds from block to block (saved on this host) in half the host's."""
    available = bytes_available(jax.local_devices()[0])
    need = sum(terms.values())
    if need > available // 2:
        largest = max(terms, key=terms.get)
        raise MemoryError(
            f"{largest}: one seed needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB "
            f"free per device (half of it usable); lower {largest}"
        )
    plan, per_agent = plan_seeds(num_agents, need), sum(held.values())
    host, trained = host_free(), plan.padded_seeds
    if per_agent * num_agents > host // 2:
        raise MemoryError(
            f"--num-seeds: the training state of {num_agents} agents needs "
            f"~{per_agent * num_agents / 2**30:.1f} GiB, more than half the "
            f"{host / 2**30:.1f} GiB free here; fewer seeds (or grid points)"
        )
    if per_agent * trained > host // 2:  # the padding agents each hold a buffer too
        largest = max(held, key=held.get)
        raise MemoryError(
            f"{largest}: the training state of {trained} agents ({num_agents} asked for, padded "
            f"to whole batches) needs ~{per_agent * trained / 2**30:.1f} GiB, more than half the "
            f"{host / 2**30:.1f} GiB free here; lower {largest}"
        )
    return plan


def bytes_available(device) -> int:
    """Free memory of one device; CPU devices share the host's (host_free)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return host_free() // jax.local_device_count()


def host_free() -> int:
    """Free RAM, or less where a cgroup limits this process's memory: a container's, or a Slurm
    job's --mem (past it the kernel kills the run, with no line and no checkpoint)."""
    return min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), cgroup_free())


CGROUP_FILES = {  # v2, v1: limit, usage, and the page cache in memory.stat the kernel can drop
    "": ("memory.max", "memory.current", "inactive_file"),
    "memory": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def cgroup_free(proc=Path("/proc/self/cgroup"), root=Path("/sys/fs/cgroup")) -> float:
    """Bytes left under the tightest memory limit of the cgroups holding this process and their
    parents (cgroup v2 or v1), less the page cache the kernel can drop, as `docker stats` counts;
    inf where none limits it (a limit of "max", no such files, not Linux)."""
    free = math.inf
    for folder, name in cgroup_folders(proc, root):
        limit, usage, cache = CGROUP_FILES[name]
        with contextlib.suppress(OSError, ValueError):  # no such file; "max"
            words = (folder / "memory.stat").read_text().split()  # lines of "name value"
            stat = dict(zip(words[::2], words[1::2], strict=False))
            used = int((folder / usage).read_text()) - int(stat.get(cache, 0))
            free = min(free, max(int((folder / limit).read_text()) - used, 0))
    return free


def cgroup_folders(proc: Path, root: Path):
    """Yields (folder, "" for cgroup v2 or "memory" for v1) of each memory cgroup holding this
    process, then of each of its parents up to the root, where a limit may be set instead."""
    try:
        lines = proc.read_text().splitlines()  # "id:controllers:/path", v2's controllers ""
    except OSError:  # not Linux
        return
    for _, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        for name in {"", "memory"} & set(controllers.split(",")):
            for folder in (PurePosixPath(path), *PurePosixPath(path).parents):
                yield root / name / str(folder).lstrip("/"), name


def plan_seeds(num_agents: int, need: int, platform=None) -> SeedPlan:
    """Pad the agents to a multiple of the device count; batch them when they do not fit. On a
    CPU, whole batches of CPU_SEEDS_PER_BATCH (or what fits), two at least a device (XLA compiles
    one batch without the loop, and rounds differently): seed i then runs in the same lane of the
    same loop, bit for bit the same whatever --num-seeds. `platform` other than "cpu": the GPU
    layout (a test runs it on a CPU). MemoryError when not even one agent fits."""
    devices = jax.devices()  # of every process in a cluster
    available = bytes_available(jax.local_devices()[0])
    fits = available // 2 // need  # half of it, as check_memory
    if fits < 1:
        raise MemoryError(
            f"one seed needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB free per "
            "device: lower --hidden-sizes, --buffer-size, --eval-every or --batch-size"
        )
    if (platform or devices[0].platform) == "cpu":
        batch = min(fits, CPU_SEEDS_PER_BATCH)
        batches = max(2, -(-num_agents // (batch * len(devices))))  # a device's batches
        return SeedPlan(len(devices), batches * batch * len(devices), batch, need)
    per_device = -(-num_agents // len(devices))  # the largest batch that fits and divides it:
    batch = max(b for b in range(1, fits + 1) if per_device % b == 0)
    return SeedPlan(len(devices), per_device * len(devices), batch, need)


def train_agents(config: Config, env, network, seed: int, grid: HParams, plan: SeedPlan,
                 start=None, timings=None):  # fmt: skip
    """Trains every agent (grid point x seed) with the reference's init and run_blocks, one
    evaluation block at a time, sharded over every device, yielding (blocks done, carry, metrics
    so far) after each: the caller saves or stops. `start` (load_checkpoint's) resumes; `timings`
    gets the compile and training seconds. Agent a trains grid point a // num_seeds with key
    fold_in(key(seed), a % num_seeds): every grid point gets the same keys, on purpose (common
    random numbers: a difference between points is not the luck of the draw)."""
    timings = {} if timings is None else timings
    mesh, spec = Mesh(np.array(jax.devices()), ("seeds",)), PartitionSpec("seeds")
    init, run_blocks = make_blocks(config, env, network)

    @partial(jax.jit, out_shardings=NamedSharding(mesh, spec))  # made straight into their shards
    def make_inputs(grid: HParams):
        agent = jnp.arange(plan.padded_seeds)  # the padding agents repeat the last grid point
        keys = jax.vmap(partial(jax.random.fold_in, jax.random.key(seed)))(agent % config.num_seeds)
        point = jnp.minimum(agent // config.num_seeds, len(grid.gamma) - 1)
        return keys, jax.tree.map(lambda x: x[point], grid)

    # Each device runs its agents seeds_per_batch at once (vmap), batch after batch (lax.map).
    # shard_map: a vmap over devices left to the partitioner ran at half the speed (README).
    # check_vma=False: train starts from constants, which shard_map would want marked varying.
    def on_devices(fn, in_specs):
        def per_device(*args):
            agents, shared = args[:2], args[2:]  # shared: the same for every agent
            return jax.lax.map(lambda a: fn(*a, *shared), agents, batch_size=plan.seeds_per_batch)

        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=spec,
                                     check_vma=False))  # fmt: skip

    keys, hparams = make_inputs(grid)
    clock, init_all = time.perf_counter(), on_devices(init, (spec, spec))
    shapes = jax.eval_shape(init_all, keys, hparams)[0]  # every agent's carry
    done = 0 if start is None else start[0]
    blocks = [(b, steps) for first, n, steps in config.blocks for b in range(first, first + n)]
    # Compiled one after the other (side by side on two cores: slower); init runs meanwhile.
    if start is None:
        carry, metrics = init_all(keys, hparams)
    else:  # a checkpoint's agents, padded anew (repeating the last real one) for this layout
        _, leaves, metrics = start
        real = len(grid.gamma) * config.num_seeds
        agent = np.minimum(np.arange(plan.padded_seeds), real - 1)
        wanted = shapes._replace(key=jax.eval_shape(jax.random.key_data, shapes.key))
        wanted = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(wanted)]
        if [(x.shape[1:], x.dtype) for x in leaves] != wanted:
            fail("--resume: the checkpoint does not fit its own config")  # bad input, as others
        sharding = NamedSharding(mesh, spec)
        leaves = [x[agent] for x in leaves]
        leaves = [jax.make_array_from_callback(x.shape, sharding, x.__getitem__) for x in leaves]
        carry = jax.tree.unflatten(jax.tree.structure(shapes), leaves)
        carry = carry._replace(key=jax.random.wrap_key_data(carry.key))
        metrics = {name: x[agent] for name, x in metrics.items()}
    run = {}
    for steps in {steps for _, steps in blocks[done:]}:  # a shorter last block: another shape
        block_all = on_devices(partial(run_blocks, steps=steps), (spec, spec, PartitionSpec()))
        run[steps] = block_all.lower(shapes, hparams, np.zeros(1, np.int32)).compile()
    if start is None:
        metrics = with_gaps(gather(metrics))
    timings.update(compile_time_s=time.perf_counter() - clock, train_time_s=0.0)
    for block, steps in blocks[done:]:
        clock = time.perf_counter()
        carry, more = run[steps](carry, hparams, np.array([block], np.int32))
        more = with_gaps(gather(wait(more)))
        timings["train_time_s"] += time.perf_counter() - clock
        metrics = jax.tree.map(lambda a, b: np.concatenate([a, b], axis=1), metrics, more)
        yield block + 1, carry, metrics


def with_gaps(metrics: dict) -> dict:
    """The reference's metrics as the run reports and saves them: train_return and loss NaN (blank
    in curves.csv) where an evaluation block ended no episode or ran no update; no counts."""
    metrics = dict(metrics)
    episodes, updates = metrics.pop("episodes"), metrics.pop("updates")
    metrics["train_return"] = np.where(episodes > 0, metrics["train_return"], np.nan)
    metrics["loss"] = np.where(updates > 0, metrics["loss"], np.nan)
    return metrics


class ClusterLost(SystemExit):
    """gather's one line, exit 1: another process of the cluster stopped. A SystemExit, as its
    sys.exit was, so that no `except Exception` takes it; run_training adds how to go on."""


def gather(out):
    """Every agent's result on every process, also the shards other processes computed. A
    process that died is one line here, not a hang (JAX recovers, see join_cluster)."""
    try:
        return multihost_utils.process_allgather(out, tiled=True)
    except (jax.errors.JaxRuntimeError, ValueError) as error:  # gloo raises the latter
        reason = str(error).splitlines()[0][:160]
        raise ClusterLost(
            f"dqn_cartpole.py: error: another process of the cluster stopped ({reason})"
        ) from None


class Progress:
    """The training's progress after each block: a tqdm bar in a terminal, else a plain line
    every 10% (a log file gets no carriage returns). Process 0 speaks for the cluster."""

    def __init__(self, num_agents: int, first: int, total: int, terminal=None):
        self.agents, self.first, self.total = num_agents, first, total
        self.next_line, self.bar = 0.0, None
        if jax.process_index() == 0 and (sys.stderr.isatty() if terminal is None else terminal):
            self.bar = tqdm(total=total, initial=first, unit="steps", file=sys.stderr)

    def __call__(self, steps: int, seconds: float) -> None:
        """`steps` of every agent done, in `seconds` of training."""
        done = steps / self.total
        if self.bar is not None:
            self.bar.update(steps - self.bar.n)
        elif jax.process_index() == 0 and done >= self.next_line:
            self.next_line = math.floor(10 * done + 1) / 10
            rate = self.agents * (steps - self.first) / max(seconds, 1e-9)
            eta = self.agents * (self.total - steps) / rate
            print(f"  {done:4.0%}  train {seconds:6.1f} s  {rate:,.0f} agent-steps/s  "
                  f"ETA {eta:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

    def say(self, line: str) -> None:
        """A line on stderr, above the bar if one is drawn."""
        (print if self.bar is None else self.bar.write)(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def bootstrap_iqm(values: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interquartile mean (the mean of the middle 50%: Agarwal et al. 2021) over seeds, axis
    0, with a 95% percentile-bootstrap CI that resamples seeds."""
    n = values.shape[0]
    rng = np.random.default_rng(seed % 2**64)  # --seed may be negative, numpy's may not
    resampled = values[rng.integers(0, n, size=(BOOTSTRAP_SAMPLES, n))]
    low, high = np.percentile(iqm(resampled, axis=1), [2.5, 97.5], axis=0)
    return iqm(values, axis=0), low, high


def iqm(values: np.ndarray, axis: int) -> np.ndarray:
    """The mean of the middle half along `axis`: a quarter of the values cut from each end."""
    n = values.shape[axis]
    middle = np.sort(values, axis=axis).take(range(n // 4, n - n // 4), axis=axis)
    return middle.mean(axis=axis)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of a share (Wilson 1927): unlike p +- z sqrt(p (1-p) / n) it
    stays inside [0, 1] and is not zero-wide at 0% or 100%, where a few seeds often land."""
    p, shrink = successes / n, 1 + z**2 / n
    center = (p + z**2 / (2 * n)) / shrink
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / shrink
    return [max(0.0, center - half), min(1.0, center + half)]


def scores(final: np.ndarray, solved: float | None, seed: int) -> dict:
    """One configuration's final greedy returns over its seeds: the solved share with its 95%
    Wilson interval (None without a solved return), the IQM with its bootstrap CI, median, mean."""
    value, low, high = bootstrap_iqm(final, seed)
    hits = None if solved is None else int(np.sum(final >= solved))
    return {
        "final_eval_return": final.tolist(),
        "solved_fraction": None if hits is None else hits / len(final),
        "solved_ci95": None if hits is None else wilson_interval(hits, len(final)),
        "iqm": {"value": float(value), "ci95": [float(low), float(high)]},
        "median": float(np.median(final)),
        "mean": float(np.mean(final)),
    }


def training_scores(returns: np.ndarray, steps: np.ndarray, solved, seed: int) -> dict:
    """scores() of the last evaluation of `returns` [seeds, evals], with the best one along the
    way (beside the final one, never instead of it) and the IQM learning curve."""
    best = returns.max(axis=1)
    curve = zip(("iqm", "ci95_low", "ci95_high"), bootstrap_iqm(returns, seed), strict=True)
    return {
        **scores(returns[:, -1], solved, seed),
        "best_eval_return": best.tolist(),
        "solved_along_the_way": None if solved is None else float(np.mean(best >= solved)),
        "curve": {"step": steps.tolist(), **{name: v.tolist() for name, v in curve}},
    }


def ranked(results: list[dict]) -> list[int]:
    """Grid point indices, best first: by solved share, then by IQM."""
    return sorted(
        range(len(results)),
        key=lambda g: (results[g]["solved_fraction"] or 0.0, results[g]["iqm"]["value"]),
        reverse=True,
    )


XLA_FLAGS = os.environ.get("XLA_FLAGS")  # as this script, imported, set them for JAX


def jax_settings() -> dict:
    """What else gives a run other bits: XLA's flags as JAX started with them (unless it had
    started before this script was imported), and JAX's switches of that kind."""
    names = ("jax_enable_x64", "jax_threefry_partitionable", "jax_default_matmul_precision")
    return {"XLA_FLAGS": XLA_FLAGS} | {name: getattr(jax.config, name) for name in names}


def summarize(config: Config, environment: dict, points: list, results: list, **extra) -> dict:
    """summary.json (or load_summary.json): the run, the machine, the scores; a sweep's scores
    per grid point under "grid", in grid order."""
    names = ("jax", "jaxlib", "flax", "optax", "distrax", "gymnax", "numpy", "matplotlib")
    versions = {name: importlib.metadata.version(name) for name in names}
    summary = {
        "config": dataclasses.asdict(config),
        "environment": environment,
        "versions": {"python": platform.python_version(), **versions},
        "jax_settings": jax_settings(),
        "devices": [str(d) for d in jax.devices()],
        **extra,
    }
    if len(points) == 1:
        return {**summary, **results[0]}
    return {**summary, "grid": [{"hparams": p, **r} for p, r in zip(points, results, strict=True)]}


def score_line(result: dict, solved: float | None) -> str:
    """'solved (>= 475) 60.0% [46.2%, 72.4%], IQM 480.1 [470.3, 490.0], median 482.0'"""
    value, (low, high) = result["iqm"]["value"], result["iqm"]["ci95"]
    text = f"IQM {value:.1f} [{low:.1f}, {high:.1f}], median {result['median']:.1f}"
    if solved is None:
        return text
    share, (share_low, share_high) = result["solved_fraction"], result["solved_ci95"]
    return f"solved (>= {solved:g}) {share:.1%} [{share_low:.1%}, {share_high:.1%}], {text}"


RUN_FILES = ("summary.json", "curves.csv", "params.msgpack")
CHECKPOINT = "checkpoint.npz"  # a run stopped early, or on its way: what --resume reads
LOAD_NAMES = ("load_summary.json", "render.gif")  # what --load writes into a run's folder
# All a run writes: what --overwrite may replace.
RUN_NAMES = (*RUN_FILES, CHECKPOINT, "learning_curves.png", "sweep.png", *LOAD_NAMES)
SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
CURVES = ("step", "eval_return", "train_return", "loss")  # curves.csv's columns after seed


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", fatal: bool = True, together: list | None = None):
    """Write to a temporary name beside path, then rename: no reader sees half a file. Given
    `together`, the rename waits for rename_all(together): the files appear all or none. A failed
    write ends the script with one line (or raises if not `fatal`); no temporary file stays."""
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
        if isinstance(error, OSError) and fatal:
            reason = error.strerror or error  # no file name: the temporary one
            remove_if_empty(path.parent)  # the run's folder, if this was to be its first file
            fail(f"cannot write {path} ({reason})", status=1)
        raise


def rename_all(paths: list[Path]) -> None:
    """Each file written under its temporary name (atomic_open's `together`) to its own."""
    for path in paths:
        os.replace(temporary(path), path)


def temporary(path: Path) -> Path:
    """Where `path` is written before its rename (the suffix last: writers pick formats by it)."""
    return path.with_name(f".{path.stem}.tmp{path.suffix}")


@contextlib.contextmanager
def signals_held():
    """Ctrl-C, SIGTERM and SIGHUP wait until the block is done; yields those that came meanwhile."""
    caught = []
    held = {signum: signal.signal(signum, lambda n, _: caught.append(n)) for signum in catchable()}
    try:
        yield caught
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def written_whole():
    """A run's files are written whole: a Ctrl-C, SIGTERM or SIGHUP that comes meanwhile waits,
    then ends the script, as does one whose exception was dropped earlier (RECEIVED)."""
    with signals_held() as caught:
        yield
    if caught := RECEIVED + caught:  # RECEIVED: stop() took one, yet its exception was dropped
        print(f"dqn_cartpole.py: stopped by {SIGNALS[caught[0]]} once the run was written whole",
              file=sys.stderr)  # fmt: skip
        sys.exit(128 + caught[0])


def catchable() -> list[int]:
    """SIGNALS but those ignored (nohup's SIGHUP, say): those stay ignored."""
    return [signum for signum in SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]


def json_safe(value):
    """NaN and infinities as null, in nested dicts and lists: summaries are strict JSON."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_json(path: Path, summary: dict, together: list | None = None) -> None:
    with atomic_open(path, together=together) as file:
        json.dump(json_safe(summary), file, indent=2, allow_nan=False)


def save_run(output: Path, summary: dict, points: list, out: dict) -> None:
    """RUN_FILES, all three or none: the summary; curves.csv, a row per grid point x seed x
    evaluation (swept hyperparameters first, an empty cell for NaN: no finished episode or no
    update in that block); every agent's final params. The figures come from these."""
    written = []  # renamed together once all are written
    write_json(output / "summary.json", summary, written)
    swept = [name for name in HParams._fields if len({p[name] for p in points}) > 1]
    metrics = {name: np.asarray(out["metrics"][name]) for name in CURVES}  # [agents, evals]
    num_seeds = summary["config"]["num_seeds"]
    with atomic_open(output / "curves.csv", together=written) as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow([*swept, "seed", *CURVES])
        for agent, point in enumerate(p for p in points for _ in range(num_seeds)):
            for values in zip(*(metrics[name][agent] for name in CURVES), strict=True):
                cells = ["" if np.isnan(v) else str(v) for v in values]  # float32 as printed
                writer.writerow([*(point[name] for name in swept), agent % num_seeds, *cells])
    with atomic_open(output / "params.msgpack", "wb", together=written) as file:
        file.write(flax.serialization.to_bytes(out["params"]))
    rename_all(written)


def save_checkpoint(output: Path, run: dict, done: int, carry, metrics) -> None:
    """CHECKPOINT, written atomically: all --resume needs (every agent's training state after
    `done` blocks, the metrics so far, the `run`: config, grid points and settings). A write that
    fails raises its OSError (the caller says whether the run goes on)."""
    carry = gather(carry._replace(key=jax.random.key_data(carry.key)))  # every process joins
    if jax.process_index() > 0:
        return
    real = len(run["points"]) * run["config"]["num_seeds"]  # --resume pads anew for its layout
    arrays = {f"carry_{i}": x[:real] for i, x in enumerate(jax.tree.leaves(carry))}
    arrays |= {f"metrics_{name}": x[:real] for name, x in metrics.items()}
    with atomic_open(output / CHECKPOINT, "wb", fatal=False) as file:
        np.savez(file, run=json.dumps(run), blocks_done=done, **arrays)


def describe(error: Exception) -> str:
    """An error for a line of ours: our own ValueError's words, any other's with its type."""
    return str(error) if type(error) is ValueError else f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def reading(path: Path):
    """Reading a saved file (-> its path): whatever is wrong with it is a ValueError naming it."""
    try:
        yield path
    except FileNotFoundError:  # its own words would spell the whole path, with an [Errno 2]
        raise ValueError(f"{path.name}: no such file") from None
    except Exception as error:
        raise ValueError(f"{path.name}: {describe(error)}") from None


def saved_config(saved: dict) -> Config:
    """The Config of a run's summary.json or checkpoint; ValueError for a setting left out (its
    default may not be the run's) or of another type than its field's (hand-edited: a width of
    16.0). JSON keeps a tuple as a list and may keep a float as an int."""
    defaults = {field.name: field.default for field in dataclasses.fields(Config)}
    for name, value in saved.items():
        if name not in defaults:  # a gridworld run's "layout", say
            raise ValueError(f"its config has {name!r}, not a setting of dqn_cartpole.py")
        default = defaults[name]
        if isinstance(default, tuple):  # hidden_sizes: a list of ints
            ok = isinstance(value, list) and all(type(item) is int for item in value)
        else:  # an int may stand for a float; a bool stands for nothing else
            ok = type(value) is type(default) or (type(default), type(value)) == (float, int)
        if not ok:
            raise ValueError(f"{name} {value!r} is not of the type of its default, {default!r}")
    if missing := [name for name in defaults if name not in saved]:
        raise ValueError(f"its config lacks {missing[0]!r}")
    config = Config(**{name: tuple(v) if type(v) is list else v for name, v in saved.items()})
    gymnax_id(config.env)  # an env we know (ValueError)
    return config


def check_points(points: list, config: Config) -> None:
    """ValueError unless `points` are a saved run's grid points: one number a hyperparameter,
    each valid (grid_points), no two alike, the first its config's own (as parse_command's)."""
    for point in points:
        kinds = {name: type(value) for name, value in point.items()}
        if kinds.keys() != set(HParams._fields) or not set(kinds.values()) <= {int, float}:
            raise ValueError(f"a grid point is not one number a hyperparameter: {point!r:.100}")
        grid_points({name: (point[name],) for name in HParams._fields})
    if len({tuple(point.values()) for point in points}) < len(points):
        raise ValueError("two of its grid points are alike")
    if not points or points[0] != config.hparams()._asdict():
        raise ValueError("its config is not its first grid point")


class SavedCheckpoint(NamedTuple):
    """What --resume reads of a stopped run's checkpoint."""

    config: Config
    points: list  # the grid points
    solved_return: float | None  # None: the env's own
    start: tuple  # (blocks done, carry leaves, metrics)
    checkpoint_every: int
    render: bool  # the run draws render.gif as it ends


def load_checkpoint(folder: str) -> SavedCheckpoint:
    """The checkpoint of a run that saved one; any problem is a one-line ValueError."""
    given = f"--resume {folder}"
    path, summary = Path(folder) / CHECKPOINT, Path(folder) / "summary.json"
    if not Path(folder).is_dir():
        raise ValueError(f"{given}: {'not a' if Path(folder).exists() else 'no such'} folder")
    aside = set_aside(path)  # --overwrite's, killed as it replaced this run
    if not path.exists() and aside.exists():
        raise ValueError(
            f"{given}: no {CHECKPOINT}, but {aside.name}, which a run killed as it "
            "replaced this one set aside: rename it to go on"
        )
    if summary.exists() and not path.exists():
        try:  # another script's run, say
            saved_config(json.loads(summary.read_text())["config"])
        except Exception as error:
            raise ValueError(f"{given}: not a run of dqn_cartpole.py ({describe(error)})") from None
        raise ValueError(f"{given}: its run has ended (only a stopped run has a checkpoint)")
    if not path.exists():
        raise ValueError(f"{given}: no {CHECKPOINT} in it (a stopped run saves one)")
    try:
        if not zipfile.is_zipfile(path):  # np.load would try a pickle
            raise ValueError(f"{CHECKPOINT} is not an .npz archive")
        with np.load(path) as file:
            run = json.loads(str(file["run"]))
            num_leaves = sum(name.startswith("carry_") for name in file.files)
            leaves = [file[f"carry_{i}"] for i in range(num_leaves)]
            metrics = {name: file[f"metrics_{name}"] for name in CURVES}
            done = int(file["blocks_done"])
        config = saved_config(run["config"])
        blocks = sum(count for _, count, _ in config.blocks)
        if not run["points"] or not 0 <= done < blocks:
            raise ValueError(f"{len(run['points'])} grid points, {done} of {blocks} blocks done")
        check_points(run["points"], config)
        agents = {len(x) for x in (*leaves, *metrics.values())}  # of each array
        evals = {m.shape[1:] for m in metrics.values()}  # step 0 and one a block done
        if agents != {len(run["points"]) * config.num_seeds} or evals != {(done + 1,)}:
            raise ValueError("its arrays do not hold the same agents and blocks")
        floats = all(np.issubdtype(metrics[name].dtype, np.floating) for name in CURVES[1:])
        steps = np.arange(done + 1) * config.eval_every  # the blocks done are whole ones
        ints = np.issubdtype(metrics["step"].dtype, np.integer)
        if not (ints and floats) or (metrics["step"] != steps).any():
            raise ValueError("its metrics are not its config's evaluations")
        if not np.isfinite(metrics["eval_return"]).all():  # as curves.csv must (read_curves)
            raise ValueError("an eval_return in it is not a finite number")
        solved = run.get("solved_return")  # None: the env's own (and in older checkpoints)
        if solved is not None and not (type(solved) in (int, float) and abs(solved) < 3.4e38):
            raise ValueError(f"its solved return {solved!r} is not a number below 3.4e38 in size")
        every = run.get("checkpoint_every", 25_000)  # older checkpoints: the default
        if type(every) is not int or every < 0:
            raise ValueError(f"its checkpoint cadence {every!r} is not a whole number >= 0")
        render = run.get("render", False)  # older checkpoints: unsaid
        if type(render) is not bool:
            raise ValueError(f"its render {render!r:.20} is not true or false")
        x64 = run.get("jax_enable_x64", jax.config.jax_enable_x64)  # older checkpoints: unsaid
    except Exception as error:
        raise ValueError(f"{given}: no checkpoint to resume from ({describe(error)})") from None
    if x64 != jax.config.jax_enable_x64:  # float64 arrays where float32 ones are wanted, or back
        setting = "set" if x64 else "unset"
        raise ValueError(f"{given}: its run had JAX_ENABLE_X64 {setting}; so must this")
    return SavedCheckpoint(config, run["points"], solved, (done, leaves, metrics), every, render)


def read_curves(path: Path, points: list, num_seeds: int, steps: np.ndarray) -> dict:
    """curves.csv as arrays [grid points, seeds, evaluations] (NaN for an empty cell): its rows
    the summary's grid points x seeds in order, each at the run's evaluation `steps`, a swept
    hyperparameter's column its grid point's value."""
    shape = (len(points), num_seeds, len(steps))
    # utf-8-sig: no spreadsheet byte-order mark in the first name; blank lines skipped (DictReader)
    with reading(path), open(path, encoding="utf-8-sig") as file:
        numbered = [(number, line) for number, line in enumerate(csv.reader(file), 1) if line]
        header = numbered[0][1] if numbered else []
        if twice := [name for name in header if header.count(name) > 1]:  # the last was drawn
            raise ValueError(f"its header names {twice[0]!r} twice")
        for number, line in numbered[1:]:  # DictReader: None for a value short
            if len(line) != len(header):
                raise ValueError(f"its line {number} has {len(line)} values, not {len(header)}")
        rows = [dict(zip(header, line, strict=True)) for _, line in numbered[1:]]
        if sorted({int(row["seed"]) for row in rows}) != list(range(num_seeds)):  # none, edited
            raise ValueError(f"it does not hold the summary's {num_seeds} seeds")
        if len(rows) != math.prod(shape):
            raise ValueError(f"it has {len(rows):,} rows, not one per grid point, seed and "
                             f"evaluation ({math.prod(shape):,})")  # fmt: skip
        number = lambda text: float(text) if text else np.nan  # noqa: E731
        swept = [name for name in HParams._fields if name in header]
        curves = {
            name: np.array([number(r[name]) for r in rows]).reshape(shape)
            for name in ("seed", *CURVES, *swept)
        }
        if (curves.pop("seed") != np.arange(num_seeds)[:, None]).any():  # [grid, seeds, evals]
            raise ValueError("its rows are not the summary's seeds in order")
        if (curves["step"] != steps).any():  # rows cut off, mixed up or edited
            raise ValueError("its steps are not the run's evaluations, in order, for every seed")
        for name in swept:
            if (curves.pop(name) != np.array([p[name] for p in points])[:, None, None]).any():
                raise ValueError(f"its {name} column is not the summary's grid points in order")
        if not np.isfinite(curves["eval_return"]).all():  # every evaluation is drawn
            raise ValueError("an eval_return in it is not a finite number")
    return curves


def plot_run(output: Path) -> Path:
    """learning_curves.png (one configuration) or sweep.png, from the saved files alone, once
    they agree: the summary's grid points and final returns are curves.csv's."""
    import matplotlib.pyplot as plt

    with reading(output / "summary.json") as path:  # what reading curves.csv needs of it
        summary = json.loads(path.read_text())
        config, done = saved_config(summary["config"]), saved_steps(summary)
        results = summary.get("grid", [summary])  # a sweep's grid points; one configuration: one
        if type(results) is not list or not results:
            raise ValueError(f"its grid {results!r:.40} is not a list of grid points")
        one = config.hparams()._asdict()
        points = [result["hparams"] for result in results] if "grid" in summary else [one]
        check_points(points, config)
    steps = np.array([*range(0, done, config.eval_every), done])  # blocks, the last may be short
    curves = read_curves(output / "curves.csv", points, config.num_seeds, steps)
    with reading(output / "summary.json"):  # the figure reads the rest of it
        for result, final in zip(results, curves["eval_return"][:, :, -1], strict=True):
            if not np.array_equal(np.float32(result["final_eval_return"]), np.float32(final)):
                raise ValueError("its final returns are not curves.csv's last evaluation")
        environment, total = summary["environment"], config.total_timesteps
        steps = f"{total:,} steps" if done == total else f"{done:,} of {total:,} steps (stopped)"
        title = f"DQN on {environment['id']}: {plural(config.num_seeds, 'seed')} x {steps}"
        solved = environment["solved_return"]
        if "grid" in summary:
            fig = plot_sweep(point_labels(points), results, solved, title + " per grid point")
            path = output / "sweep.png"
        else:
            path = output / "learning_curves.png"
            fig = plot_learning_curves(curves, summary, solved, title)
    with atomic_open(path, "wb") as file:
        fig.savefig(file, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def saved_steps(summary: dict) -> int:
    """The steps a saved run's params were trained for: its steps_done (a run written before
    that was recorded had finished); ValueError unless a step count up to its total."""
    total = summary["config"]["total_timesteps"]
    done = summary.get("steps_done", total)
    if type(done) is not int or not 0 <= done <= total:
        raise ValueError(f"its steps_done {done!r} is not a step count up to {total:,}")
    return done


def plot_learning_curves(curves: dict, result: dict, solved, title: str):
    """The solved share over training with its 95% Wilson band (given a solved return); every
    seed's greedy return, with the IQM and its 95% bootstrap CI from 10 seeds on (below, the
    seeds say more); the final returns' histogram, where the seeds that fail are seen."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    returns, steps = curves["eval_return"][0], curves["step"][0, 0]  # [seeds, evals], [evals]
    n, panels = len(returns), 3 if solved is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), layout="constrained")
    if solved is not None:
        share = result["solved_fraction"]
        low, high = result["solved_ci95"]
        title += f"; final: {share:.1%} solved [{low:.1%}, {high:.1%}]"
        hits = (returns >= solved).sum(axis=0)
        band = np.array([wilson_interval(int(h), n) for h in hits])
        axes[0].fill_between(steps, *band.T, color="tab:green", alpha=0.3, label="95% Wilson CI")
        label = f"share of seeds >= {solved:g}"
        axes[0].plot(steps, hits / n, color="tab:green", marker="o", ms=3, label=label)
        axes[0].set(xlabel="environment steps", ylabel="solved share", ylim=(-0.02, 1.02))
        axes[0].legend(loc="upper left")
    ax = axes[-2]
    alpha, width = min(0.6, 20 / n), 1.0 if n < 10 else 0.5
    ax.plot(steps, returns.T, color="tab:blue", alpha=alpha, lw=width)
    ax.plot([], [], color="tab:blue", label=f"each seed ({n})")  # one legend entry for all
    curve = result["curve"]
    if n >= 10:
        band = (steps, curve["ci95_low"], curve["ci95_high"])
        label = f"IQM of {n} seeds, 95% bootstrap CI"
        ax.fill_between(*band, color="tab:orange", alpha=0.35, label=label)
        ax.plot(steps, curve["iqm"], color="tab:orange", lw=2, marker="o", ms=3)
    if solved is not None:
        ax.axhline(solved, color="k", ls="--", lw=1, label=f"solved ({solved:g})")
    ax.set(xlabel="environment steps", ylabel="greedy return (mean of episodes)")
    ax.legend(loc="lower right")
    final = returns[:, -1]
    low, high = min(final.min(), 0.0), max(final.max(), solved if solved is not None else 0.0)
    axes[-1].hist(final, bins=min(40, max(10, n // 4)), range=(low, high), color="tab:blue")
    if n >= 10:  # a log count axis: one failing seed stays visible beside hundreds that solve
        axes[-1].set_yscale("log")
        axes[-1].yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    else:
        axes[-1].yaxis.set_major_locator(MaxNLocator(integer=True))
    if solved is not None:
        fails = int(np.sum(final < solved))
        label = f"solved ({solved:g}); {plural(fails, 'seed')} below"
        axes[-1].axvline(solved, color="k", ls="--", lw=1, label=label)
        axes[-1].legend(loc="upper left")
    axes[-1].set(xlabel="final greedy return", ylabel="seeds")
    for ax in axes[:-1]:  # x ticks as 0, 10k, 20k: readable at any run length
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
    fig.suptitle(title)
    return fig


def apart(values) -> dict[float, str]:
    """Each value as text, with the digits that tell it from the others (6 at least, as `:g`):
    gamma 0.999999 and 0.9999991 are two grid points, and showed as one."""
    values = set(values)
    digits = next(d for d in range(6, 18) if len({f"{v:.{d}g}" for v in values}) == len(values))
    return {value: f"{value:.{digits}g}" for value in values}


def point_labels(points: list[dict]) -> list[str]:
    """'learning_rate 0.001, gamma 0.99' for each grid point: the values that vary."""
    swept = [name for name in HParams._fields if len({p[name] for p in points}) > 1]
    texts = {name: apart(p[name] for p in points) for name in swept}
    return [", ".join(f"{name} {texts[name][p[name]]}" for name in swept) for p in points]


def plot_sweep(labels: list, results: list, solved, title: str):
    """One row per grid point, best on top, labelled with its values: each seed's final greedy
    return a dot, the IQM and its 95% CI a bar. Beyond MOST_ROWS grid points, the best and the
    worst half of that (a row each for 3,000 points: a figure 111,000 pixels tall)."""
    import matplotlib.pyplot as plt

    order, jitter = ranked(results), np.random.default_rng(0)
    if len(order) > MOST_ROWS:
        half = MOST_ROWS // 2
        title += f"\nthe best and the worst {half} of {len(order):,} (summary.json has every one)"
        order = order[:half] + order[-half:]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.4 * len(order)))
    for row, g in enumerate(order):
        final, iqm, first = results[g]["final_eval_return"], results[g]["iqm"], row == 0
        y = row + jitter.uniform(-0.2, 0.2, len(final))
        ax.scatter(final, y, s=8, c="tab:blue", alpha=0.4, label="a seed" if first else None)
        error = [[iqm["value"] - iqm["ci95"][0]], [iqm["ci95"][1] - iqm["value"]]]
        label = "IQM, 95% bootstrap CI" if first else None
        ax.errorbar(iqm["value"], row, xerr=error, fmt="o", c="tab:orange", label=label)
    if solved is not None:  # each row's solved share, the figure's headline, beside its label
        shares = [(r["solved_fraction"], *r["solved_ci95"]) for r in results]
        labels = [f"{label}\n{s:.0%} solved [{lo:.0%}, {hi:.0%}]" for label, (s, lo, hi) in
                  zip(labels, shares, strict=True)]  # fmt: skip
    ax.set_yticks(range(len(order)), [labels[g] for g in order])
    ax.invert_yaxis()  # the best on top
    if len(order) < len(results):  # between the best and the worst
        ax.axhline(len(order) / 2 - 0.5, color="gray", ls=":", lw=1)
    if solved is not None:
        ax.axvline(solved, color="k", ls="--", lw=1, label=f"solved ({solved:g})")
    ax.set(xlabel="final greedy return", title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # outside the rows
    return fig


def render_median(config: Config, env, network, params, returns: np.ndarray, path: Path):
    """GIF of a fresh greedy episode of the median agent, every other 50 Hz step at 25 fps."""
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation, PillowWriter

    median = int(np.argsort(returns)[len(returns) // 2])
    one = jax.tree.map(lambda x: x[median], params)
    episode = partial(greedy_episodes, env=env, network=network, num_episodes=1, keep_obs=True)
    total, (obs, alive) = jax.jit(episode)(jax.random.key(config.seed), one)
    frames = np.asarray(obs[:, 0])[np.asarray(alive[:, 0])][::2]  # [steps / 2, obs]
    pole, limit = 2 * EnvParams().length, EnvParams().x_threshold + 0.3
    fig, ax = plt.subplots(figsize=(4, 2.4))
    ax.set(xlim=(-limit, limit), ylim=(-0.3, 1.3), aspect="equal", yticks=[])
    ax.axhline(0, color="k", lw=1)
    (cart,) = ax.plot([], [], color="tab:blue", lw=12)
    (line,) = ax.plot([], [], color="tab:orange", lw=4)

    def draw(i):
        x, _, theta, _ = frames[i]
        cart.set_data([x - 0.2, x + 0.2], [0, 0])
        line.set_data([x, x + pole * np.sin(theta)], [0, pole * np.cos(theta)])
        ax.set_title(f"agent {median}: return {float(total[0]):.0f}  step {2 * i}")
        return cart, line

    animation = FuncAnimation(fig, draw, frames=len(frames))
    with atomic_open(path, "wb"):  # matplotlib writes the temporary file by its name
        animation.save(temporary(path), writer=PillowWriter(fps=25))
    plt.close(fig)


KNOCK = "jax-cluster-knock"  # what a process sends process 0's probe: then its id and count


def read_knock(connection: socket.socket) -> tuple[int, int] | None:
    """(process id, --num-processes) that a knock on the probe sends within a second, or None
    for any other connection (the JAX client of a process that has knocked, say)."""
    line, end = b"", time.monotonic() + 1  # a second in all, however slowly the bytes come
    with connection, contextlib.suppress(OSError):  # OSError: said nothing more within the second
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
    given = f"--coordinator-address {address}"
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 2**16:
        raise ValueError(f"--coordinator-address {address!r}: expected HOST:PORT, a port 1-65535")
    if ":" in host:  # JAX's client aborts on an IPv6 address, and the probe below is IPv4
        raise ValueError(f"{given}: IPv6; give a host name or IPv4")
    try:  # JAX's client would abort
        socket.getaddrinfo(host, int(port))
    except OSError as error:
        raise ValueError(f"{given}: cannot resolve {host!r} ({error})") from None
    deadline = time.monotonic() + timeout
    if process_id == 0:
        with socket.socket() as probe:
            # As the coordinator will: a port that a run just ended on (TIME_WAIT) is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", int(port)))
            except OSError as error:
                raise ValueError(f"{given}: cannot listen ({error})") from None
            probe.listen()
            # Processes counted by the id they knock with, not by connections: the JAX client
            # of a process that has knocked may connect here too, and is no other process.
            knocked = set()
            while len(knocked) < num_processes - 1:
                probe.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    knock = read_knock(probe.accept()[0])
                except OSError:  # the time-out
                    raise ValueError(
                        f"{given}: {len(knocked)} of the {num_processes - 1} other processes "
                        f"came within {timeout:g} s (--cluster-timeout); are they all running?"
                    ) from None
                if knock is None or not 0 < knock[0] < knock[1]:  # not a process's knock
                    continue
                who, count = knock
                if count != num_processes:  # JAX would start without the processes beyond
                    raise ValueError("--num-processes differs between the processes; give all "
                                     "the same")  # fmt: skip
                if who in knocked:
                    raise ValueError(f"--process-id {who} was given to two processes")
                knocked.add(who)
        return
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1) as knock:
                knock.sendall(f"{KNOCK} {process_id} {num_processes}\n".encode())
            return
        except OSError:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"{given}: nobody answered within {timeout:g} s (--cluster-timeout); is "
                    "process 0 running?"
                ) from None
            time.sleep(0.2)


def join_cluster(args) -> None:
    """Make the processes of a run one JAX cluster before anything touches a device: from the
    flags, or without them by JAX's own detection in a SLURM or Open MPI job of several tasks.
    jax.devices() then lists every process's devices, and the seeds are sharded over all."""
    flags = (args.coordinator_address, args.num_processes, args.process_id)
    if not 1 <= args.cluster_timeout < 2**31:  # False for NaN; JAX takes int32 seconds
        raise ValueError(
            f"--cluster-timeout must be in [1, 2^31) seconds, got {args.cluster_timeout}"
        )
    seconds = int(args.cluster_timeout)
    timeouts = {"initialization_timeout": seconds, "heartbeat_timeout_seconds": seconds}

    def recover():
        """A process that dies is an error where the others next wait for it (the gather of the
        results), not an abort with a C++ stack trace in every other process; and a wait for the
        processes' CPU device lists is --cluster-timeout (JAX's are 2 and 5 minutes)."""
        jax.config.update("jax_enable_recoverability", True)
        minutes = math.ceil(args.cluster_timeout / 60)  # JAX counts these in whole minutes
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
                raise ValueError(
                    f"{tasks[0]}, but JAX finds no cluster to join ({error}); give "
                    "--coordinator-address, --num-processes and --process-id"
                ) from None
        return
    if any(value is None for value in flags):
        raise ValueError("--coordinator-address, --num-processes and --process-id go together")
    if not 1 <= args.num_processes < 2**31:  # what JAX's cluster service takes
        raise ValueError(f"--num-processes must be in [1, 2^31), got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in [0, --num-processes), got {args.process_id}")
    check_coordinator(
        args.coordinator_address, args.process_id, args.num_processes, args.cluster_timeout
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes gather
    recover()
    jax.distributed.initialize(
        args.coordinator_address, args.num_processes, args.process_id, **timeouts
    )


def check_same_flags(config: Config, points: list, modes: dict) -> None:
    """ValueError naming a flag or setting whose value differs between the processes of a
    cluster, where each would train with its own value, abort (shapes, dtypes) or wait for ever
    (`modes`: --resume, --load, --checkpoint-every in some only). First, each process's device
    count: gather lays them out [processes, devices], and no gather runs with other numbers."""
    devices = Counter(device.process_index for device in jax.devices())  # of each process
    if len(set(devices.values())) > 1:
        coordinator_ends_last()  # whose sync fails at once too: what stays is process 0's wait
        counts = ", ".join(f"{devices[i]} on process {i}" for i in sorted(devices))
        raise ValueError(
            f"the processes have other numbers of devices ({counts}); give all the same"
        )
    values = {flag(k): v for k, v in (modes | dataclasses.asdict(config)).items()}
    values.pop("--output-dir")
    values |= {flag(name): [point[name] for point in points] for name in HParams._fields}
    values["JAX_ENABLE_X64"] = jax.config.jax_enable_x64  # float64 arrays against float32
    digests = np.array([[zlib.crc32(repr(v).encode()) for v in values.values()]], np.uint32)
    with gloo_quiet():  # the cluster's first gather: gloo connects
        every = gather(digests)  # [processes, flags]
    if not (same := (every == every[0]).all(axis=0)).all():
        name = list(values)[int(np.argmin(same))]  # the first that differs
        coordinator_ends_last()
        raise ValueError(f"{name} differs between the processes; give all the same")


@contextlib.contextmanager
def gloo_quiet():
    """gloo's C++ prints "[Gloo] Rank N is connected to M peer ranks..." to file descriptor 1 in
    every process as the first gather connects: noise in process 0's report, and the only line
    of the others, which print nothing. Meanwhile that descriptor points to /dev/null."""
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
    """Before every process ends with the same error: JAX aborts a process that its coordinator,
    process 0, ends before, and the watcher would then print its own line instead. A process
    that has ended already (another script, say) is no error here: this one's line follows."""
    with contextlib.suppress(jax.errors.JaxRuntimeError, ValueError):  # gloo raises the latter
        multihost_utils.sync_global_devices("every process ends")
    if jax.process_index() == 0:
        time.sleep(2)  # the others exit meanwhile (a fraction of a second)


def shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def build_parser() -> argparse.ArgumentParser:
    """One --flag per Config field, its help from the field; a flag left out parses as None
    (parse_command fills in the default, or the saved run's own). Its errors are ValueErrors,
    which main prints as one line (argparse's would add the whole usage)."""
    sweep_flags = ", ".join(flag(name) for name in HParams._fields)
    epilog = (
        f"Sweeps: {sweep_flags} each take a comma-separated list. Every combination (the first "
        "of these flags changing slowest) trains --num-seeds seeds, all in one compiled program. "
        "Every grid point uses the same seeds' keys, on purpose: common random numbers, so that "
        "a difference between grid points is not the luck of the draw."
    )
    parser = argparse.ArgumentParser(
        prog="dqn_cartpole.py", description=__doc__.splitlines()[0], epilog=epilog
    )

    def error(message: str):
        raise ValueError(message)

    parser.error = error

    def comma_ints(text: str) -> tuple[int, ...]:  # argparse says "invalid comma_ints value"
        return tuple(int(width) for width in text.split(","))

    def comma_floats(text: str) -> tuple[float, ...]:
        return tuple(float(value) for value in text.split(","))

    def integer(text: str) -> int:
        if "," in text:  # a list here would change a shape or a loop: one compile per value
            raise argparse.ArgumentTypeError(f"takes one value; lists: {sweep_flags}")
        return int(text)

    for f in dataclasses.fields(Config):
        kwargs = {"help": f"{f.metadata['help']} (default: {shown(f.default)})"}
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name in HParams._fields:
            kwargs["type"] = comma_floats
        else:
            kwargs["type"] = {int: integer, str: str}.get(f.type, comma_ints)
        parser.add_argument(flag(f.name), **kwargs)
    thresholds = ", ".join(f"{value:g} on {env_id}" for env_id, value in SOLVED_RETURNS.items())
    solved_help = f"final greedy return that counts as solved (default: Gymnasium's, {thresholds})"
    parser.add_argument("--solved-return", type=float, metavar="R", help=solved_help)
    load_help = "evaluate the params saved in DIR (its env and network; the rest from this command)"
    parser.add_argument("--load", metavar="DIR", help=load_help)
    parser.add_argument("--render", action="store_true", help="GIF of the median agent (CartPole)")
    parser.add_argument("--replot", metavar="DIR", help="redraw a saved run's figure; no training")
    overwrite_help = "replace the run in an --output-dir that holds one"
    parser.add_argument("--overwrite", action="store_true", help=overwrite_help)
    resume_help = "continue the run in DIR from its checkpoint, as it was started"
    parser.add_argument("--resume", metavar="DIR", help=resume_help)
    every_help = "also save a checkpoint every STEPS steps, at the end of a block; 0: only when "
    every_help += "stopped by Ctrl-C, SIGTERM or SIGHUP (default: 25000; --resume: the run's)"
    parser.add_argument("--checkpoint-every", type=int, metavar="STEPS", help=every_help)
    cluster = parser.add_argument_group("several processes, one JAX cluster (see README)")
    cluster.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address")
    cluster.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    cluster.add_argument("--process-id", type=int, metavar="I", help="this process, 0 to N-1")
    timeout_help = "seconds to wait for the cluster to form, or for a silent process (default: 60)"
    cluster.add_argument("--cluster-timeout", type=float, default=60.0, help=timeout_help)
    return parser


class SavedRun(NamedTuple):
    """What --load reads of a run's folder."""

    config: Config
    params: Any
    points: list | None  # the grid points; None: one configuration
    solved_return: float | None  # None: none
    steps_done: int  # the steps its params were trained for (a stopped run's: fewer)


def load_run(folder: str) -> SavedRun:
    """The saved run in a folder; any problem is a one-line ValueError."""
    given = f"--load {folder}"
    if not Path(folder).is_dir():
        raise ValueError(f"{given}: {'not a' if Path(folder).exists() else 'no such'} folder")
    if not (Path(folder) / "summary.json").is_file():
        raise ValueError(f"{given}: not a saved run (it has no summary.json)")
    try:
        with reading(Path(folder) / "summary.json") as path:
            summary = json.loads(path.read_text())
            config = saved_config(summary["config"])  # another script's run: named as such
            grid = [point["hparams"] for point in summary["grid"]] if "grid" in summary else None
            if grid is not None:  # as --resume checks its checkpoint's
                check_points(grid, config)
                grid = [{name: float(value) for name, value in point.items()} for point in grid]
            solved = summary.get("environment", {}).get("solved_return")  # None: the env's
            solved = None if solved is None else float(solved)
            if solved is not None and not abs(solved) < 3.4e38:  # NaN too
                raise ValueError(f"its solved_return {solved} is not below 3.4e38 in size")
            steps = saved_steps(summary)
        with reading(Path(folder) / "params.msgpack") as path:
            params = flax.serialization.msgpack_restore(path.read_bytes())
    except ValueError as error:  # reading's, which names the file
        raise ValueError(f"{given}: cannot read its {error}") from None
    return SavedRun(config, params, grid, solved, steps)


def check_params(params, network: QNetwork, env, folder: str, agents: int) -> None:
    """ValueError unless `params` are one network's per agent (its names, shapes [agents, ...] and
    dtypes), as many as its summary says."""
    obs = jax.eval_shape(env.reset, jax.random.key(0))[0]
    shapes = jax.eval_shape(network.init, jax.random.key(0), obs)
    wanted = jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    saved = None  # where keys of two types (1 and "params") make no pytree: JAX cannot sort them
    with contextlib.suppress(TypeError, ValueError):
        saved = jax.tree.map(lambda x: (np.shape(x)[1:], np.asarray(x).dtype), params)
    if wanted != saved:  # a dict of the same names and (shape, dtype) pairs
        raise ValueError(f"--load {folder}: its params.msgpack is not its own env's and network's")
    if {len(x) for x in jax.tree.leaves(params)} != {agents}:
        raise ValueError(f"--load {folder}: its params.msgpack does not hold its {agents} agents")


def load_evaluation(config: Config, env, network: QNetwork, params):
    """--load's evaluation, compiled, -> a function that runs it, to the mean returns: fresh
    greedy episodes of every agent at once, seed i of each grid point on split(key(seed))[i].
    MemoryError naming --eval-episodes when XLA counts more than half a device's free memory."""
    play = partial(greedy_episodes, env=env, network=network, num_episodes=config.eval_episodes)
    agents = jax.tree.leaves(params)[0].shape[0]  # seed i of every grid point plays key i:
    keys = jax.random.split(jax.random.key(config.seed), config.num_seeds)  # common numbers
    keys = keys[np.arange(agents) % config.num_seeds]
    evaluate = jax.jit(jax.vmap(lambda k, p: play(k, p).mean())).lower(keys, params).compile()
    used = evaluate.memory_analysis()
    need = used.temp_size_in_bytes + used.argument_size_in_bytes + used.output_size_in_bytes
    available = bytes_available(jax.local_devices()[0])
    if need > available // 2:
        raise MemoryError(
            f"--eval-episodes {config.eval_episodes}: evaluating {agents} agents at once needs "
            f"~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB free (half of it usable); "
            "fewer episodes"
        )
    return lambda: np.asarray(wait(evaluate(keys, params)))  # wait: a Ctrl-C is not kept waiting


def check_same_run(saved: Config, given: dict, folder: str) -> None:
    """--load: the env, network and seeds given must be the saved run's, or a ValueError; ours
    and gymnax's CartPole agree (the same task, checked)."""
    for name in ("env", "hidden_sizes", "layer_norm", "num_seeds"):
        theirs = getattr(saved, name)
        mine = given.get(name, theirs)
        same = gymnax_id(mine) == gymnax_id(theirs) if name == "env" else mine == theirs
        if not same:
            raise ValueError(
                f"{flag(name)} {shown(mine)} disagrees with the run in {folder} "
                f"({shown(theirs)}): leave it out to use the run's"
            )


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


class StopRequest:
    """While training, Ctrl-C, SIGTERM or SIGHUP asks to stop: the block in progress ends, the
    run so far is saved with a checkpoint, and the script exits 128 + the signal. A second Ctrl-C
    stops at once, but in a watched process (other than 0 of a cluster): a scheduler's signal
    (Slurm's srun on a Ctrl-C) reaches it twice, directly and passed on, as one request."""

    def __enter__(self):
        self.signum = None
        self.previous = {signum: signal.signal(signum, self.ask) for signum in catchable()}
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def ask(self, signum, frame):
        watched = "DQN_CARTPOLE_WATCHED" in os.environ
        if self.signum is not None:
            # Ctrl-C again: at once, as outside training. SIGTERM or SIGHUP again is the same
            # request (a scheduler's and a watcher's, a hang-up's two): the run is saved.
            if signum == signal.SIGINT and not watched:
                raise KeyboardInterrupt
            return
        self.signum = signum
        then = "the run stops once the block in progress ends, and is saved"
        if signum == signal.SIGINT and not watched:  # someone at the terminal, not a scheduler
            then += " (Ctrl-C again to stop at once, unsaved)"
        print(f"dqn_cartpole.py: {SIGNALS[signum]}: {then}", file=sys.stderr, flush=True)

    def asked(self) -> int:
        """The signal any process of the run was asked to stop by (0: none): every process
        stops, and process 0, which saves the run, says so."""
        signum = np.array([self.signum or 0])
        return int(gather(signum).max()) if jax.process_count() > 1 else int(signum[0])


def checkpoint_or_warn(output: Path, run: dict, done: int, carry, metrics: dict,
                       say: Callable, stopping: bool) -> bool:  # fmt: skip
    """save_checkpoint -> whether it was written. One that cannot be (a full disk) does not end
    the run: the trained agents are worth more, and its final files are far smaller (no replay
    buffers or optimizer states). For a stop, those are written without a checkpoint."""
    try:
        with writing(output):
            save_checkpoint(output, run, done, carry, metrics)
        return True
    except OSError as error:
        then = "the run so far is saved without it" if stopping else "training goes on"
        warning = f"dqn_cartpole.py: warning: cannot write {output / CHECKPOINT} "
        warning += f"({error.strerror or error}); {then}"
        say(warning.translate(ESCAPED))  # one line, as fail's
        return False


def run_training(config, points, env, network, plan, environment, output, checkpoint_every,
                 start=None, render=False):  # fmt: skip
    """Train every agent (grid point x seed), saving a checkpoint every `checkpoint_every` steps
    (0: never) and when asked to stop -> (output, padding dropped; timings; the signal that
    stopped the run early, or None). `render` goes into the checkpoint, for --resume."""
    grid, num_points = hparam_grid(points), len(points)
    num_agents = num_points * config.num_seeds
    devices = plural(plan.num_devices, jax.devices()[0].platform + " device")
    memory = f"~{plan.bytes_per_seed * plan.seeds_per_batch / 2**20:.0f} MiB per device"
    grid_text = f"{plural(num_points, 'grid point')} x " if num_points > 1 else ""
    # The last checkpoint: due for its cadence, and written (the one a run resumed from counts).
    first = due_from = written = 0 if start is None else int(start[2]["step"][0, -1])
    run = {"config": dataclasses.asdict(config), "points": points}
    run |= {"solved_return": environment["solved_return"], "checkpoint_every": checkpoint_every}
    run |= {"render": render, "jax_enable_x64": jax.config.jax_enable_x64}  # x64: arrays' dtypes
    timings = {"checkpoint_time_s": 0.0}
    # Before the first line: a signal stops the run as asked from the moment one can see it run
    # (main holds one that comes before, and stops the run once it is written).
    with StopRequest() as stop:
        print(
            f"{environment['id']}: {grid_text}{plural(config.num_seeds, 'seed')} x "
            f"{config.total_timesteps} steps on {devices}, {plan.seeds_per_batch} at once per "
            f"device (padded to {plan.padded_seeds}, {memory})"
        )
        progress = Progress(num_agents, first, config.total_timesteps)  # a terminal's bar, drawn
        blocks = train_agents(config, env, network, config.seed, grid, plan, start, timings)
        try:
            for done, carry, metrics in blocks:
                steps, signum = int(metrics["step"][0, -1]), stop.asked()
                progress(steps, timings["train_time_s"])
                ended = steps >= config.total_timesteps  # a checkpoint of it has no use
                stopping = signum > 0 and not ended  # a stop asked in the last block: it ended
                due = checkpoint_every and steps - due_from >= checkpoint_every
                if (stopping or due) and not ended:
                    clock = time.perf_counter()
                    if checkpoint_or_warn(
                        output, run, done, carry, metrics, progress.say, stopping
                    ):
                        written = steps
                    timings["checkpoint_time_s"] += time.perf_counter() - clock
                    due_from = steps
                if stopping:
                    break
        except ClusterLost as error:  # process 0 says how to go on from this run's checkpoint
            if jax.process_index() > 0 or not written:
                raise
            raise ClusterLost(f"{error.code}; {stop_hint(output, written)}") from None
    if stop.signum and not stopping:  # asked in the last block: the run ended, and stops written
        signal.raise_signal(stop.signum)  # to the handler of main's written_whole, which holds it
    progress.close()
    speed = num_agents * (steps - first) / max(timings["train_time_s"], 1e-9)
    print(f"compile {timings['compile_time_s']:.1f} s, train {timings['train_time_s']:.1f} s, "
          f"{speed:,.0f} agent-steps/s")  # fmt: skip
    timings |= {
        "seeds_padded_to": plan.padded_seeds,
        "seeds_per_batch_per_device": plan.seeds_per_batch,
        "agent_steps_per_s": speed,
        "timed_from_step": first,  # 0, or where --resume went on: the timings are this command's
    }
    out = {"params": gather(carry.agent.params), "metrics": metrics}
    return jax.tree.map(lambda x: x[:num_agents], out), timings, signum if stopping else None


def parse_command(argv: list[str] | None):
    """(args, Config, grid points, saved params or None, checkpoint or None) from the command
    line; ValueError('--flag problem') for a bad input. --load takes the saved run's config and
    grid points but for how to evaluate; --resume takes the whole run from its checkpoint; a
    sweep's Config holds its first grid point."""
    args = build_parser().parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)}
    given = {name: value for name, value in given.items() if value is not None}
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise ValueError("--checkpoint-every must be >= 0")
    for name in ("load", "replot", "resume"):
        if getattr(args, name) == "":  # would read as not given
            raise ValueError(f"--{name} must name a run's folder")
    if args.solved_return is not None and not abs(args.solved_return) < 3.4e38:  # NaN too
        raise ValueError("--solved-return must be below 3.4e38 in size (a float32)")
    # --replot, --resume and --load take the saved run as it is: only the `free` flags may change.
    parser = build_parser()
    parser.set_defaults(**dict.fromkeys(vars(args)))  # None: left out (a given flag never is)
    others = [flag(name) for name, x in vars(parser.parse_args(argv)).items() if x is not None]
    cluster = ("--coordinator-address", "--num-processes", "--process-id", "--cluster-timeout")
    evaluating = ("seed", "eval_episodes", "env", "output_dir")
    agreeing = ("hidden_sizes", "layer_norm", "num_seeds")  # check_same_run checks them
    loading = (*map(flag, (*evaluating, *agreeing)), "--render", "--solved-return", "--overwrite")
    for name, what, free in (
        ("--replot", "redraws the saved run", ()),
        ("--resume", "continues the run", ("--checkpoint-every", *cluster)),
        ("--load", "evaluates the run", (*loading, *cluster)),
    ):
        if getattr(args, name[2:]) and (rest := [f for f in others if f not in (name, *free)]):
            raise ValueError(f"{name} {what} as it was saved; leave out {rest[0]}")
    if args.load and args.output_dir:  # the loaded run's folder, where --load writes: as if
        with contextlib.suppress(OSError, RuntimeError):  # left out (it asked for --overwrite)
            if Path(args.output_dir).resolve() == Path(args.load).resolve():
                args.output_dir = None
    if args.load and args.overwrite and args.output_dir is None:  # a flag that would do nothing
        raise ValueError("--overwrite: --load writes into the run's folder, and replaces nothing")
    if args.resume:  # the run's own threshold and checkpoint cadence too, unless given
        saved = load_checkpoint(args.resume)
        args.solved_return, args.render = saved.solved_return, saved.render
        if args.checkpoint_every is None:
            args.checkpoint_every = saved.checkpoint_every
        return args, saved.config, saved.points, None, saved.start
    if args.load:  # load_summary.json: the run's config and steps, this command's evaluation
        saved = load_run(args.load)
        check_same_run(saved.config, given, args.load)
        args.steps_done = saved.steps_done
        if args.solved_return is None:  # the run's own threshold, as --resume takes it
            args.solved_return = saved.solved_return
        fresh = {"seed": Config().seed, "eval_episodes": Config().eval_episodes}  # unless given
        fresh |= {name: given[name] for name in evaluating if name in given}
        config = dataclasses.replace(saved.config, **fresh)
        points = saved.points or [saved.config.hparams()._asdict()]
        return args, config, points, saved.params, None
    args.checkpoint_every = 25_000 if args.checkpoint_every is None else args.checkpoint_every
    lists = {
        name: given.pop(name, (value,)) for name, value in Config().hparams()._asdict().items()
    }
    points = grid_points(lists)
    return args, Config(**given, **points[0]), points, None, None


def run_folder(template: str, overwrite: bool) -> str:
    """The run's folder, checked (a `{time}` name is new: make_folder picks it); ValueError for
    one named outright that holds files, unless --overwrite, which replaces a run's files there
    (replacing) and refuses a folder that holds anything else."""
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
    ours = {path.name for path in run_paths(Path())}
    if foreign := [path.name for path in held if path.is_dir() or path.name not in ours]:
        raise ValueError(
            f"{given} holds {foreign[0]}, which no run of this script "
            "writes: name a new or empty folder, or one that holds a run (--overwrite)"
        )
    if held and not overwrite:
        if CHECKPOINT in {path.name for path in held}:  # stopped: the user may want it back
            raise ValueError(f"{given} holds a stopped run: --resume {template} goes on with it, "
                             "--overwrite replaces it")  # fmt: skip
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
RESUMING = []  # the folder a --resume goes on in, from its reading: locked later


def make_folder(folder: str) -> Path:
    """Make the run's folder and lock it. `{time}` becomes the start time, then _2, _3 (mkdir is
    atomic: two runs started in the same second never share one). OSError for a folder named
    outright that a running run has locked, or a run has written in since run_folder looked."""
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


def run_paths(folder: Path, names: tuple[str, ...] = RUN_NAMES) -> list[Path]:
    """Every path a run writes in `folder`: its files, also at their temporary and aside names."""
    return [f(folder / name) for name in names for f in (Path, temporary, set_aside)]


@contextlib.contextmanager
def replacing(folder: Path):
    """Writes a run over a previous run's files (--overwrite), and nothing else: a file put there
    meanwhile stays. The previous files, renamed aside (no space needed), stay until the new
    run is written whole; if a write fails (a full disk, say), they are put back as they were."""
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
        if isinstance(error, OSError) and not started:
            reason, stuck = error.strerror or error, error.filename or stuck  # as the OS names it
            fail(f"--overwrite: cannot set {stuck} aside ({reason}); the run there stays as it "
                 "was, and this one is not written", status=1)  # fmt: skip
        raise
    for path in paths:
        set_aside(path).unlink(missing_ok=True)


TO_REPLACE = set()  # folders whose previous run (--overwrite) this run has not yet written over


@contextlib.contextmanager
def writing(folder: Path):
    """A run's writes into its folder: the first replaces a previous run there (--overwrite),
    which stays until then (a run that ends before it saves anything leaves it)."""
    if folder not in TO_REPLACE:
        yield
        return
    with replacing(folder):
        yield
        TO_REPLACE.discard(folder)  # written: the folder holds this run, whatever comes next


def check_backend() -> None:
    """One line, before any work, where JAX would fail with a traceback at its first use of a
    device (JAX_PLATFORMS naming a platform this machine lacks, XLA_FLAGS asking for no CPU), or
    run for hours (JAX_DISABLE_JIT). That first use loads JAX's plugins, which drop a signal's
    exception: a signal waits until it is done."""
    if jax.config.jax_disable_jit:  # JAX_DISABLE_JIT=1, or main() under jax.disable_jit()
        raise ValueError(
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
                sys.exit(
                    f"dqn_cartpole.py: error: another process of the cluster stopped ({detail})"
                )
            given = [f"{name}={os.environ[name]!r}" for name in ("JAX_PLATFORMS", "XLA_FLAGS") if
                     os.environ.get(name)]  # fmt: skip
            if not given:  # neither: JAX's own error, as it is
                raise
            raise ValueError(f"{', '.join(given)}: no JAX backend ({detail})") from None
    if caught:  # now to the handler in place again, which stops the run as anywhere else
        signal.raise_signal(caught[0])


def remove_if_empty(folder: Path) -> None:
    """A stopped run's folder and the parents made for it, if empty; one there before stays."""
    for path in MADE.get(folder.resolve(), []):
        with contextlib.suppress(OSError):  # rmdir removes only an empty folder
            path.rmdir()


def check_sizes(config: Config) -> None:
    """What Config does not check on its own: the sizes of the run as a whole. ValueError('--flag
    problem'); the benchmarks that run ours check their sizes with it too."""
    if not -(2**63) <= config.seed < 2**63:  # what jax.random.key takes
        raise ValueError(f"--seed must be a 64-bit integer, got {config.seed}")
    for f in dataclasses.fields(config):  # the step counters are int32 (jax's default)
        if f.type is int and f.name != "seed" and getattr(config, f.name) >= 2**31:
            raise ValueError(f"{flag(f.name)} must be below 2^31 (2,147,483,648)")
    if config.learning_starts >= config.total_timesteps:
        raise ValueError("--learning-starts must be below --total-timesteps: at most one update "
                         "would run")  # fmt: skip
    first = -(-max(config.learning_starts, 1) // config.train_frequency) * config.train_frequency
    if first > config.total_timesteps:  # updates come at the multiples of train_frequency
        raise ValueError(f"--train-frequency: the first update would come at step {first:,}, "
                         "after --total-timesteps")  # fmt: skip


def check_run(config: Config, output: Path, named_by: str, writes: tuple[str, ...]):
    """check_sizes, then the output folder, which the flag `named_by` chose, where the run
    `writes` these files. ValueError('--flag problem') before any work."""
    check_sizes(config)
    if jax.process_index() > 0:  # process 0 writes for the cluster
        return
    try:  # the folder, or the nearest parent that exists, must be a writable folder
        existing = next(path for path in (output, *output.absolute().parents) if path.exists())
    except OSError as error:  # a name the OS refuses (too long, say)
        raise ValueError(f"{named_by}: {error}") from None
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ValueError(f"{named_by} {output}: {existing} is not a writable folder")
    # A folder where the run writes a file: --resume's and --load's runs found it only when
    # they wrote, after training (a new run's folder refuses one in run_folder).
    if folders := [path.name for path in run_paths(output, writes) if path.is_dir()]:
        raise ValueError(f"{named_by} {output}: it holds a folder {folders[0]}, where this run "
                         "writes a file")  # fmt: skip


def replot(folder: str) -> None:
    """--replot DIR: the figure again, from the saved files alone."""
    output = Path(folder)
    try:
        if not output.is_dir():
            raise ValueError(f"{'not a' if output.exists() else 'no such'} folder")
        if not all((output / name).is_file() for name in RUN_FILES):
            raise ValueError(f"not a saved run: it needs {', '.join(RUN_FILES)}")
        path = plot_run(output)  # which checks the files as --load does
    except Exception as error:  # a damaged file: one line (main's), not a traceback
        raise ValueError(f"--replot {folder}: cannot redraw ({describe(error)})"[:300]) from None
    print(f"redrew {path} from the saved files (no training)")


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    FOUND_EMPTY.clear()  # an earlier main()'s checks: --load and --resume make none of their own
    TO_REPLACE.clear()  # and an earlier main()'s run to replace, stopped before it wrote
    RESUMING.clear()
    try:
        args, config, points, params, checkpoint = parse_command(argv)
        if args.resume and rank(sys.argv[1:] if argv is None else argv) == 0:  # 0 speaks
            RESUMING.append(Path(args.resume))
        if args.replot:
            return replot(args.replot)
        join_cluster(args)
        check_backend()
        if jax.process_count() > 1:
            modes = {"resume": checkpoint and checkpoint[0], "load": bool(args.load)}
            modes["checkpoint_every"] = args.checkpoint_every
            check_same_flags(config, points, modes)
        if jax.process_index() > 0:  # process 0 reports and writes for the whole cluster
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        env_id, env = gymnax_id(config.env), make_env(config.env)
        if args.render and env_id != "CartPole-v1":
            raise ValueError(f"--render draws CartPole only, not {env_id}")
        name = "cartpole" if config.env == "cartpole" else env_id.lower()
        if args.resume:  # a resumed run goes on in its own folder
            output, named_by = Path(args.resume), "--resume"
        elif args.load and args.output_dir is None:  # a loaded run's results go into that run
            output, named_by = Path(args.load), "--load"
        else:  # process 0 writes for the cluster: the others' folder is not used
            output, named_by = config.output_dir.replace("{env}", name), "--output-dir"
            if jax.process_index() == 0:
                output = run_folder(output, args.overwrite)  # "": a ValueError, not Path's "."
            output = Path(output)
        config = dataclasses.replace(config, output_dir=str(output))
        check_run(config, output, named_by, LOAD_NAMES if args.load else RUN_NAMES)
        network = QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
        if args.load:  # the saved params must be this env's and network's, one per agent
            check_params(params, network, env, args.load, len(points) * config.num_seeds)
            evaluate = load_evaluation(config, env, network, params)
        else:  # --load holds no replay buffer: its run's training sizes do not apply
            terms, held = memory_need(config, env, network)
            plan = check_memory(terms, held, len(points) * config.num_seeds)
        if jax.process_index() == 0:  # last: a refused run leaves nothing behind
            try:
                output = make_folder(str(output))
            except OSError as error:
                raise ValueError(f"{named_by}: {error}") from None
            config = dataclasses.replace(config, output_dir=str(output))
            kept = {Path(run).resolve() for run in (args.load, args.resume) if run}
            held = any(path.exists() for path in run_paths(output))  # or what a crash left
            if args.overwrite and held and output.resolve() not in kept:  # a loaded or resumed
                TO_REPLACE.add(output)  # run keeps its files
            if args.resume:  # killed just after its first checkpoint under --overwrite, it left
                for name in RUN_NAMES:  # the run it replaced set aside: those files go now
                    set_aside(output / name).unlink(missing_ok=True)
    except (ValueError, MemoryError, OSError) as error:
        fail(str(error))
    print(f"output {output}/")
    solved = SOLVED_RETURNS.get(env_id) if args.solved_return is None else args.solved_return
    obs_size = jax.eval_shape(env.reset, jax.random.key(0))[0].size
    environment = {"id": env_id, "obs_size": obs_size, "num_actions": env.num_actions}
    environment["solved_return"] = solved
    stop_if_received()
    if args.load:  # fresh greedy episodes of the saved params
        returns = evaluate()
        extra = {"loaded_from": str(Path(args.load).resolve()), "steps_done": args.steps_done}
        stopped = None
    # From the end of training (run_training handles signals until then), a signal waits until
    # the run is written: no moment between the two where it would lose the trained run.
    with written_whole():
        if args.load:
            results = [scores(r, solved, config.seed) for r in returns.reshape(len(points), -1)]
        else:
            trained = (config, points, env, network, plan, environment, output)
            out, extra, stopped = run_training(
                *trained, args.checkpoint_every, checkpoint, args.render
            )
            extra["steps_done"] = int(out["metrics"]["step"][0, -1])
            params = out["params"]
            curves = out["metrics"]["eval_return"].reshape(len(points), config.num_seeds, -1)
            steps = out["metrics"]["step"][0]  # [evals]
            results = [training_scores(c, steps, solved, config.seed) for c in curves]
            returns = curves[:, :, -1].reshape(-1)
        if jax.process_index() > 0:  # process 0 writes the results of every process
            sys.exit(128 + stopped if stopped else 0)
        summary = summarize(config, environment, points, results, **extra)
        summary["wall_time_s"] = time.perf_counter() - start  # up to the training's end
        with writing(output):  # the data; a figure that cannot be written does not undo it
            if args.load:
                write_json(output / "load_summary.json", summary)
            else:
                save_run(output, summary, points, out)
        if not args.load:
            plot_run(output)
            # --load of a stopped run writes these for its params, which --resume replaces
            stale = [output / name for name in LOAD_NAMES]
            if not stopped:  # a finished run needs no checkpoint
                stale.append(output / CHECKPOINT)
            remove_stale(stale)
        if args.render:
            render_median(config, env, network, params, returns, output / "render.gif")
        name = "load_summary.json" if args.load else "summary.json"
        wall = f"wall {time.perf_counter() - start:.1f} s -> {output / name}"
        if len(points) == 1:
            done, total, seeds = extra["steps_done"], config.total_timesteps, len(returns)
            what = f"greedy return of {plural(seeds, 'seed')}"  # a stopped run's: not final
            what = f"final {what}" if done == total else f"{what} after {done:,} of {total:,} steps"
            print(f"{what}: {score_line(results[0], solved)}; {wall}")
        else:
            print("grid points, best first (by solved share, then IQM):")
            labels = point_labels(points)  # once: each is built from every point
            for place, g in enumerate(ranked(results), start=1):
                print(f"{place:>3}. {labels[g]}: {score_line(results[g], solved)}")
            print(wall)
        if stopped:
            steps = f"{extra['steps_done']:,} of {config.total_timesteps:,} steps"
            then = stop_hint(output, extra["steps_done"])
            line = f"dqn_cartpole.py: stopped by {SIGNALS[stopped]} after {steps}, saved in "
            print(f"{line}{output}/; {then}".translate(ESCAPED), file=sys.stderr)  # one line
            sys.exit(128 + stopped)


def stopped_unfinished(signum: int) -> str:
    """The line of a run stopped before it saved anything, by `signum`: what stays, and how to
    go on from a checkpoint saved before (--checkpoint-every's, the one a --resume started from,
    even before it locked the folder, a replaced run's)."""
    unfinished = "unfinished; no file half-written"
    if any((folder / name).exists() for folder in TO_REPLACE for name in RUN_NAMES):
        unfinished += "; the run it was to replace stays"  # --overwrite: nothing written yet
    if kept := [folder for folder in [*LOCKED, *RESUMING] if (folder / CHECKPOINT).exists()]:
        unfinished += f"; its last checkpoint stays, {resume_hint(kept[0])}"
    return f"dqn_cartpole.py: stopped by {SIGNALS[signum]}, {unfinished}"


def remove_stale(paths: list[Path]) -> None:
    """Files beside the saved run that are not its own: one that cannot be removed is one line,
    exit 1: the run is saved, but the file would belie it (--resume would train the end again)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            reason = error.strerror or error
            fail(f"cannot remove {path} ({reason}): the run is saved; that file is from before", 1)


def stop_hint(output: Path, steps_done: int) -> str:
    """How a stopped run goes on: from its checkpoint, an older one where the stop's own could
    not be written (a full disk; --resume from it trains those steps again), or not at all."""
    if not (output / CHECKPOINT).exists():
        return "no checkpoint to go on from"
    with np.load(output / CHECKPOINT) as saved:  # that array alone is read
        step = int(saved["metrics_step"][0, -1])
    older = "" if step == steps_done else f"its checkpoint is from step {step:,}, before this; "
    return older + resume_hint(output)


def resume_hint(output: Path) -> str:
    """The command that goes on from the run's checkpoint, to paste into a shell: this Python
    (a venv's, say: a bare `python` may be one without jax), this script and the run's folder,
    each by its path from here where it lies below this folder, else absolute."""

    def from_here(path: str) -> str:
        try:
            relative = os.path.relpath(path)
        except OSError:  # this folder was deleted meanwhile
            return path
        return path if relative.split(os.sep)[0] == os.pardir else relative

    python = from_here(sys.executable) if sys.executable else "python"  # "": embedded Python
    if sys.executable and os.sep not in python:  # a bare name would be looked up on PATH
        python = os.path.join(".", python)
    command = [python, from_here(__file__), "--resume", from_here(str(output))]
    hint = f"to go on: {shlex.join(command)}"
    if jax.distributed.is_initialized() and jax.process_count() > 1:  # one process alone has
        count = jax.process_count()  # fewer devices: it would lay out, and train, other bits
        hint += f" (on each of the {count} processes of the cluster, started as before)"
    return hint


# A message's control characters (a newline in a folder's name) shown escaped: still one line.
ESCAPED = {code: repr(chr(code))[1:-1] for code in (*range(32), 127)}


def fail(message: str, status: int = 2):
    """Exit with one line on stderr, status 2 (bad input) unless given."""
    print(f"dqn_cartpole.py: error: {message.translate(ESCAPED)}", file=sys.stderr)
    sys.exit(status)


class BestEffortStream:
    """stdout or stderr, written while it can be: after that (`| head -1`, `> /dev/full`, a
    closed terminal) its lines go to /dev/null, and the run goes on, to be saved whole."""

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
                print(f"dqn_cartpole.py: {why}", file=sys.stderr)


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
    of its MLIR dialects) may have dropped its exception, and the run gone on. Called before
    training; written_whole checks RECEIVED after it."""
    if RECEIVED:
        stop(RECEIVED[0], None)


def ignore(signum, frame):
    """A handler that does nothing. Not SIG_IGN: set while a signal is pending (SIGTERM and
    SIGHUP at once), Python would raise OSError('Signal 15 ignored due to race condition')."""


def send_again(unraisable) -> None:
    """sys.unraisablehook: Python drops an exception raised in a garbage-collector callback (JAX
    has one), a __del__ or a weakref callback, and with it a signal whose handler ran there. Such
    a signal is sent again 10 ms later, from a timer, to whatever handles it then."""
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
    """Processes other than 0 of a cluster work in a child and watch it: JAX aborts a process
    whose coordinator (process 0) died with a C++ stack trace, which this turns into one line.
    The child's stderr (errors only) waits for its end. The child has its own session: each
    Ctrl-C, SIGTERM or SIGHUP reaches it once, passed on from here, however it was sent."""
    child = subprocess.Popen(
        [sys.executable, __file__, *argv],
        env={**os.environ, "DQN_CARTPOLE_WATCHED": "1"},
        stderr=subprocess.PIPE,
        preexec_fn=die_with_parent,
        start_new_session=True,
    )
    for signum in catchable():  # nohup's SIGHUP stays ignored, here and in the child
        signal.signal(signum, lambda signum, frame: child.send_signal(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # one that came as JAX loaded: passed on
    errors = child.communicate()[1]
    if child.returncode == -signal.SIGABRT:  # exit 1
        sys.exit("dqn_cartpole.py: error: process 0 of the cluster stopped; so does this one")
    sys.stderr.buffer.write(errors)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    if "DQN_CARTPOLE_WATCHED" not in os.environ and rank(sys.argv[1:]) > 0:
        sys.exit(watch(sys.argv[1:]))
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
        except BaseException:  # stopped or failed before the run saved anything: no empty folder
            for folder in LOCKED:
                remove_if_empty(folder)
            raise
        finally:  # one that comes from now on waits for the defaults below
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    except (KeyboardInterrupt, Stopped) as interrupt:
        for signum in SIGNALS:  # a second signal (a process group's, say) must not cut this line
            signal.signal(signum, ignore)
        signum = interrupt.args[0] if isinstance(interrupt, Stopped) else signal.SIGINT
        print(stopped_unfinished(signum).translate(ESCAPED), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signum)  # now: not after the compiled call still running in the background
    finally:  # the run has ended: in JAX's clean-up at exit, a signal has its default effect
        signal.setitimer(signal.ITIMER_REAL, 0)  # (it raised there, and was sent again: SIGALRM)
        for signum in catchable():
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
