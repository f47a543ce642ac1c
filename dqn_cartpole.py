"""DQN on CartPole-v1 for many seeds at once, in one compiled call (PureJaxRL style).

    python dqn_cartpole.py --num-seeds 512          # train 512 independent agents
    python dqn_cartpole.py --load runs/dqn_cartpole --render   # re-evaluate, GIF

The whole experiment (acting, replay buffer, updates, target network, greedy
evaluation) is one pure function `train(key)`; `jax.vmap` runs it for every seed
and `jax.sharding` spreads the seeds over every device. The file reads top to bottom:
config, environment, network, replay buffer, agent, train, evaluation, reporting,
command line.
"""

from __future__ import annotations

import os
import sys

# Before jax is imported: show every CPU core to XLA as its own device, so the
# seed axis is sharded over all cores (a CPU runs one device on one core for this
# workload). It only shapes the CPU platform; a user-set XLA_FLAGS wins.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={os.cpu_count() or 1}"

import argparse
import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import distrax
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------


def param(default: Any, help: str) -> Any:
    """A config field whose help text becomes its --flag's help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Config:
    total_timesteps: int = param(50_000, "environment steps per seed")
    num_seeds: int = param(1, "independent agents trained at once (vmapped, sharded)")
    seed: int = param(0, "base seed; seed i of a run uses fold_in(key(seed), i)")
    learning_rate: float = param(2.5e-3, "Adam step size at the start of training")
    anneal_lr: bool = param(True, "decay the step size linearly to 0: freezes a good policy")
    # 0.995, not 0.99: a policy that keeps the pole up can still let the cart drift off the
    # track hundreds of steps later, which 0.99 hardly sees (0.99^300 = 0.05). Swept in README.
    gamma: float = param(0.995, "discount factor")
    # Small on purpose: fresh data beat old data here. 512 seeds solved 92% with 5000 and
    # 81% with 10000; 20000 and 25000 did worse still in smaller sweeps (README).
    buffer_size: int = param(5_000, "replay buffer capacity (transitions per seed)")
    batch_size: int = param(32, "transitions per gradient update")
    hidden_sizes: tuple[int, ...] = param((64, 64), "MLP hidden widths, e.g. 64,64")
    layer_norm: bool = param(True, "LayerNorm after each hidden Dense: keeps Q from diverging")
    train_frequency: int = param(4, "environment steps per gradient update")
    learning_starts: int = param(1_000, "environment steps before the first update")
    target_update_interval: int = param(4, "environment steps between target updates")
    tau: float = param(0.1, "target update weight: 1 copies the online net, <1 is Polyak")
    max_grad_norm: float = param(10.0, "clip gradients to this global norm")
    epsilon_start: float = param(1.0, "exploration rate at step 0")
    epsilon_end: float = param(0.05, "exploration rate after the linear decay")
    exploration_fraction: float = param(0.1, "share of total_timesteps the decay lasts")
    double_dqn: bool = param(True, "Double DQN target: online net picks, target net rates")
    eval_every: int = param(5_000, "environment steps between greedy evaluations")
    eval_episodes: int = param(10, "fresh episodes per greedy evaluation (epsilon 0)")
    env: str = param("cartpole", "cartpole (ours) or gymnax (gymnax.make('CartPole-v1'))")
    output_dir: str = param("runs/dqn_cartpole", "where summary, figures and params go")


ENVS = ("cartpole", "gymnax")
SOLVED_RETURN = 475.0  # Gymnasium's reward_threshold for CartPole-v1
MAX_EVAL_POINTS = 1_000  # bounds the metrics memory: points per learning curve


def block_steps(config: Config) -> int:
    """Environment steps between evaluations (a small budget gets one block)."""
    return min(config.eval_every, config.total_timesteps)


def validate(config: Config) -> None:
    """Raise ValueError('--flag: problem') for the first bad value."""
    positive_ints = ("total_timesteps", "num_seeds", "buffer_size", "batch_size")
    positive_ints += ("train_frequency", "target_update_interval", "eval_every")
    positive_ints += ("eval_episodes",)
    checks = [
        (f"--{n.replace('_', '-')}", getattr(config, n) >= 1, "must be >= 1") for n in positive_ints
    ]
    checks += [
        (
            "--hidden-sizes",
            len(config.hidden_sizes) > 0 and min(config.hidden_sizes) >= 1,
            "needs one or more widths >= 1, e.g. 64,64",
        ),
        ("--learning-starts", config.learning_starts >= 0, "must be >= 0"),
        ("--learning-rate", config.learning_rate > 0, "must be > 0"),
        ("--max-grad-norm", config.max_grad_norm > 0, "must be > 0"),
        ("--tau", 0 < config.tau <= 1, "must be in (0, 1]"),
        ("--gamma", 0 <= config.gamma < 1, "must be in [0, 1)"),
        ("--epsilon-start", 0 <= config.epsilon_start <= 1, "must be in [0, 1]"),
        ("--epsilon-end", 0 <= config.epsilon_end <= 1, "must be in [0, 1]"),
        ("--exploration-fraction", 0 < config.exploration_fraction <= 1, "must be in (0, 1]"),
        (
            "--batch-size",
            config.batch_size <= config.buffer_size,
            f"({config.batch_size}) must be <= --buffer-size ({config.buffer_size})",
        ),
        ("--env", config.env in ENVS, f"unknown env {config.env!r}; choose from {ENVS}"),
    ]
    for flag, ok, problem in checks:
        if not ok:
            raise ValueError(f"{flag} {problem}")
    block = block_steps(config)
    if config.total_timesteps % block:
        raise ValueError(
            f"--total-timesteps ({config.total_timesteps}) must be a multiple "
            f"of --eval-every ({config.eval_every})"
        )
    if block % config.train_frequency:
        raise ValueError(
            f"--eval-every ({block}) must be a multiple of --train-frequency "
            f"({config.train_frequency})"
        )
    if config.total_timesteps // block > MAX_EVAL_POINTS:
        raise ValueError(
            f"--eval-every is too small: at most {MAX_EVAL_POINTS} evaluations per run"
        )
    output = Path(config.output_dir)
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output-dir {output} exists and is not a folder")


# ----------------------------------------------------------------------------------------
# Environment: CartPole-v1, as Gymnasium defines it, with gymnax 1.0's API
# ----------------------------------------------------------------------------------------


@struct.dataclass
class EnvState:
    x: jax.Array  # cart position (m)
    x_dot: jax.Array  # cart velocity
    theta: jax.Array  # pole angle (rad), 0 is upright
    theta_dot: jax.Array  # pole angular velocity
    time: jax.Array  # steps taken in this episode


@struct.dataclass
class EnvParams:
    # Gymnasium's classic_control/cartpole.py constants; derived ones are derived.
    gravity: float = 9.8
    masscart: float = 1.0
    masspole: float = 0.1
    length: float = 0.5  # half the pole's length
    force_mag: float = 10.0
    tau: float = 0.02  # seconds per step (Euler integration)
    theta_threshold_radians: float = 12 * 2 * math.pi / 360
    x_threshold: float = 2.4
    max_steps_in_episode: int = 500  # the TimeLimit of CartPole-v1
    reset_bound: float = 0.05  # reset draws every state variable from U(-0.05, 0.05)

    @property
    def total_mass(self) -> float:
        return self.masspole + self.masscart

    @property
    def polemass_length(self) -> float:
        return self.masspole * self.length


class CartPole:
    """Gymnasium's CartPole-v1 in JAX with gymnax 1.0's API.

    `step` returns (obs, state, reward, terminated, truncated, info) and resets by
    itself when the episode ends; the observation that ended the episode is in
    info["final_observation"]. Terminated (the pole fell or the cart left) and
    truncated (500 steps) stay apart: only the first one is a terminal state.
    """

    num_actions = 2
    obs_size = 4

    @property
    def default_params(self) -> EnvParams:
        return EnvParams()

    def reset(self, key: jax.Array, params: EnvParams | None = None):
        params = self.default_params if params is None else params
        x, x_dot, theta, theta_dot = jax.random.uniform(
            key, (self.obs_size,), minval=-params.reset_bound, maxval=params.reset_bound
        )
        state = EnvState(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot, time=jnp.int32(0))
        return self.observe(state), state

    def observe(self, state: EnvState) -> jax.Array:
        return jnp.stack([state.x, state.x_dot, state.theta, state.theta_dot])

    def step(
        self, key: jax.Array, state: EnvState, action: jax.Array, params: EnvParams | None = None
    ):
        params = self.default_params if params is None else params
        p = params
        force = jnp.where(action == 1, p.force_mag, -p.force_mag)
        cos, sin = jnp.cos(state.theta), jnp.sin(state.theta)
        temp = (force + p.polemass_length * state.theta_dot**2 * sin) / p.total_mass
        theta_acc = (p.gravity * sin - cos * temp) / (
            p.length * (4.0 / 3.0 - p.masspole * cos**2 / p.total_mass)
        )
        x_acc = temp - p.polemass_length * theta_acc * cos / p.total_mass
        # Euler: positions move with the old velocities (Gymnasium's default integrator).
        stepped = EnvState(
            x=state.x + p.tau * state.x_dot,
            x_dot=state.x_dot + p.tau * x_acc,
            theta=state.theta + p.tau * state.theta_dot,
            theta_dot=state.theta_dot + p.tau * theta_acc,
            time=state.time + 1,
        )
        terminated = (jnp.abs(stepped.x) > p.x_threshold) | (
            jnp.abs(stepped.theta) > p.theta_threshold_radians
        )
        truncated = stepped.time >= p.max_steps_in_episode
        reward = jnp.float32(1.0)  # Gymnasium pays 1 on every step, the terminating one too

        final_obs = self.observe(stepped)
        reset_obs, reset_state = self.reset(key, params)
        done = terminated | truncated
        state = jax.tree.map(lambda r, s: jnp.where(done, r, s), reset_state, stepped)
        obs = jnp.where(done, reset_obs, final_obs)
        info = {"final_observation": final_obs}
        return obs, state, reward, terminated, truncated, info


class GymnaxCartPole:
    """gymnax.make('CartPole-v1') behind the same API as `CartPole`.

    gymnax 1.0.1 already returns (obs, state, reward, terminated, truncated, info)
    with auto-reset and info["final_observation"]; it only wants its params passed
    explicitly, and its reward is 1.0 on every step like Gymnasium's.
    """

    num_actions = 2
    obs_size = 4

    def __init__(self):
        import gymnax  # imported here: only `--env gymnax` needs it

        self.env, self.env_params = gymnax.make("CartPole-v1")

    @property
    def default_params(self):
        return self.env_params

    def reset(self, key: jax.Array, params=None):
        return self.env.reset(key, self.env_params if params is None else params)

    def step(self, key: jax.Array, state, action: jax.Array, params=None):
        params = self.env_params if params is None else params
        obs, state, reward, terminated, truncated, info = self.env.step(key, state, action, params)
        info = {"final_observation": info["final_observation"]}
        return obs, state, reward.astype(jnp.float32), terminated, truncated, info


def make_env(name: str) -> CartPole | GymnaxCartPole:
    return GymnaxCartPole() if name == "gymnax" else CartPole()


# ----------------------------------------------------------------------------------------
# Network
# ----------------------------------------------------------------------------------------


class QNetwork(nn.Module):
    """MLP from an observation to one Q-value per action."""

    hidden_sizes: tuple[int, ...]
    num_actions: int
    layer_norm: bool = False

    @nn.compact
    def __call__(self, obs: jax.Array) -> jax.Array:  # [..., obs] -> [..., actions]
        x = obs
        for width in self.hidden_sizes:
            x = nn.Dense(width)(x)
            if self.layer_norm:
                x = nn.LayerNorm()(x)
            x = nn.relu(x)
        return nn.Dense(self.num_actions)(x)


# ----------------------------------------------------------------------------------------
# Replay buffer: pure functions over fixed-size arrays
# ----------------------------------------------------------------------------------------


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
    """Write one transition over the oldest slot."""
    capacity = buffer.data.reward.shape[0]
    data = jax.tree.map(lambda d, x: d.at[buffer.pointer].set(x), buffer.data, transition)
    return Buffer(
        data=data,
        pointer=(buffer.pointer + 1) % capacity,
        size=jnp.minimum(buffer.size + 1, capacity),
    )


def buffer_sample(buffer: Buffer, key: jax.Array, batch_size: int) -> Transition:
    """Uniform over the filled slots only (the zeros beyond `size` are not data)."""
    idx = jax.random.randint(key, (batch_size,), 0, jnp.maximum(buffer.size, 1))
    return jax.tree.map(lambda d: d[idx], buffer.data)  # [batch, ...]


# ----------------------------------------------------------------------------------------
# Agent: act, target, loss, update
# ----------------------------------------------------------------------------------------


class AgentState(NamedTuple):
    params: Any
    target_params: Any
    opt_state: Any


def epsilon_greedy(key: jax.Array, q_values: jax.Array, epsilon: jax.Array) -> jax.Array:
    """With probability epsilon a uniform action, else the greedy one (ties at random)."""
    return distrax.EpsilonGreedy(q_values, epsilon).sample(seed=key)


def td_target(
    reward, terminated, next_q_target, next_q_online, gamma: float, double_dqn: bool
) -> jax.Array:
    """r + gamma * Q(s', a') unless s' is terminal. A truncated s' still bootstraps:
    the time limit is not part of the task, the pole was still up."""
    if double_dqn:  # van Hasselt et al. 2016: the online net picks, the target net rates
        best = jnp.argmax(next_q_online, axis=-1)
        next_value = jnp.take_along_axis(next_q_target, best[..., None], axis=-1)[..., 0]
    else:
        next_value = jnp.max(next_q_target, axis=-1)
    return reward + gamma * (1.0 - terminated) * next_value


def dqn_loss(
    params, target_params, apply_fn, batch: Transition, gamma: float, double_dqn: bool
) -> jax.Array:
    """Huber loss between Q(s, a) and the (constant) TD target, over the batch."""
    q = apply_fn(params, batch.obs)  # [batch, actions]
    q_taken = jnp.take_along_axis(q, batch.action[:, None], axis=-1)[:, 0]  # [batch]
    next_q_online = apply_fn(params, batch.next_obs) if double_dqn else None
    target = td_target(
        batch.reward,
        batch.terminated,
        apply_fn(target_params, batch.next_obs),
        next_q_online,
        gamma,
        double_dqn,
    )
    # Huber, not squared error: a few large TD errors early on do not blow up the net.
    return jnp.mean(optax.huber_loss(q_taken, jax.lax.stop_gradient(target)))


def evaluate(key: jax.Array, params, env, network: QNetwork, num_episodes: int) -> jax.Array:
    """Mean return of `num_episodes` fresh greedy (epsilon 0) episodes, run side by side.

    Every episode runs the full time limit; steps after an episode's end are masked.
    """
    obs, state = jax.vmap(env.reset)(jax.random.split(key, num_episodes))  # [episodes, obs]

    def eval_step(carry, _):
        obs, state, alive, total = carry
        action = jnp.argmax(network.apply(params, obs), axis=-1)  # [episodes]
        # The env auto-resets with this key; we never look past an episode's end,
        # so sharing one key between those discarded resets is harmless.
        obs, state, reward, terminated, truncated, _ = jax.vmap(env.step, in_axes=(None, 0, 0))(
            key, state, action
        )
        total = total + reward * alive
        alive = alive & ~(terminated | truncated)
        return (obs, state, alive, total), None

    init = (obs, state, jnp.ones(num_episodes, bool), jnp.zeros(num_episodes, jnp.float32))
    max_steps = env.default_params.max_steps_in_episode
    (_, _, _, total), _ = jax.lax.scan(eval_step, init, None, length=max_steps)
    return total.mean()


# ----------------------------------------------------------------------------------------
# Train: one pure function from a key to params and metrics
# ----------------------------------------------------------------------------------------


class Carry(NamedTuple):
    agent: AgentState
    buffer: Buffer
    env_state: Any
    obs: jax.Array  # [obs]
    episode_return: jax.Array  # return of the running training episode
    key: jax.Array


class StepInfo(NamedTuple):
    finished_return: jax.Array  # the episode's return on its last step, else 0
    done: jax.Array


class IterInfo(NamedTuple):
    loss: jax.Array  # 0 while no update ran
    updated: jax.Array
    finished_return_sum: jax.Array
    episodes: jax.Array


def make_train(config: Config, progress_callback=None):
    """Returns train(key) -> {"params", "metrics"}: the whole experiment for one seed.

    Time is nested: blocks of `eval_every` steps (greedy evaluation after each), made
    of iterations of `train_frequency` env steps followed by one gradient update.
    `progress_callback(env_steps_done)` is called from inside the compiled loop a few
    hundred times per run (pass None in tests).
    """
    env = make_env(config.env)
    network = QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    block = block_steps(config)
    num_blocks = config.total_timesteps // block
    iters_per_block = block // config.train_frequency
    num_iters = num_blocks * iters_per_block
    # The step size decays over the updates that will actually happen.
    num_updates = max(
        1, (config.total_timesteps - config.learning_starts) // config.train_frequency
    )
    lr = (
        optax.linear_schedule(config.learning_rate, 0.0, num_updates)
        if config.anneal_lr
        else config.learning_rate
    )
    optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr))
    epsilon_at = optax.linear_schedule(
        config.epsilon_start,
        config.epsilon_end,
        max(1, int(config.exploration_fraction * config.total_timesteps)),
    )
    # Report progress ~200 times: often enough for a smooth ETA, rare enough to be free.
    report_every = max(1, num_iters // 200)

    def env_step(carry: Carry, xs) -> tuple[Carry, StepInfo]:
        step, act_key, env_key = xs
        q_values = network.apply(carry.agent.params, carry.obs)  # [actions]
        action = epsilon_greedy(act_key, q_values, epsilon_at(step))
        obs, env_state, reward, terminated, truncated, info = env.step(
            env_key, carry.env_state, action
        )
        transition = Transition(
            obs=carry.obs,
            action=action,
            reward=reward,
            next_obs=info["final_observation"],
            terminated=terminated,
        )
        episode_return = carry.episode_return + reward
        done = terminated | truncated
        carry = carry._replace(
            buffer=buffer_add(carry.buffer, transition),
            env_state=env_state,
            obs=obs,
            episode_return=jnp.where(done, 0.0, episode_return),
        )
        return carry, StepInfo(finished_return=jnp.where(done, episode_return, 0.0), done=done)

    def update(agent: AgentState, batch: Transition):
        loss, grads = jax.value_and_grad(dqn_loss)(
            agent.params, agent.target_params, network.apply, batch, config.gamma, config.double_dqn
        )
        updates, opt_state = optimizer.update(grads, agent.opt_state, agent.params)
        return agent._replace(
            params=optax.apply_updates(agent.params, updates), opt_state=opt_state
        ), loss

    def iteration(carry: Carry, xs) -> tuple[Carry, IterInfo]:
        it, act_keys, env_keys, sample_key = xs  # it: global iteration index (not per seed)
        first_step = it * config.train_frequency
        steps = first_step + jnp.arange(config.train_frequency)
        carry, info = jax.lax.scan(env_step, carry, (steps, act_keys, env_keys))
        steps_done = first_step + config.train_frequency

        # The predicates below depend on the step count only, which is the same for
        # every seed, so under vmap they stay real branches: no wasted updates.
        learn = steps_done >= config.learning_starts
        # Sampled outside the branch so that the branch takes the small batch, not
        # the whole buffer, as its operand.
        batch = buffer_sample(carry.buffer, sample_key, config.batch_size)
        agent, loss = jax.lax.cond(
            learn, update, lambda agent, batch: (agent, jnp.float32(0.0)), carry.agent, batch
        )
        # A target update whenever this iteration crossed a multiple of the interval.
        cross = steps_done // config.target_update_interval > (
            first_step // config.target_update_interval
        )
        target = jax.lax.cond(
            learn & cross,
            lambda a: optax.incremental_update(a.params, a.target_params, config.tau),
            lambda a: a.target_params,
            agent,
        )
        carry = carry._replace(agent=agent._replace(target_params=target))

        if progress_callback is not None:
            jax.lax.cond(
                (it + 1) % report_every == 0,
                lambda: jax.debug.callback(progress_callback, steps_done),
                lambda: None,
            )
        return carry, IterInfo(
            loss=loss,
            updated=learn,
            finished_return_sum=info.finished_return.sum(),
            episodes=info.done.sum(),
        )

    def train_block(carry: Carry, block_index) -> tuple[Carry, dict]:
        # One split per block: all the randomness of `eval_every` steps drawn at once.
        key, act_key, env_key, sample_key, eval_key = jax.random.split(carry.key, 5)
        shape = (iters_per_block, config.train_frequency)
        xs = (
            block_index * iters_per_block + jnp.arange(iters_per_block),
            jax.random.split(act_key, shape),
            jax.random.split(env_key, shape),
            jax.random.split(sample_key, iters_per_block),
        )
        carry, info = jax.lax.scan(iteration, carry._replace(key=key), xs)
        episodes = info.episodes.sum()
        metrics = {
            "step": (block_index + 1) * block,
            "eval_return": evaluate(
                eval_key, carry.agent.params, env, network, config.eval_episodes
            ),
            # NaN where the block had no finished episode / no update, not a fake 0.
            "train_return": jnp.where(
                episodes > 0, info.finished_return_sum.sum() / episodes, jnp.nan
            ),
            "loss": jnp.where(
                info.updated.any(), info.loss.sum() / jnp.maximum(info.updated.sum(), 1), jnp.nan
            ),
        }
        return carry, metrics

    def train(key: jax.Array) -> dict:
        key, init_key, reset_key = jax.random.split(key, 3)
        obs, env_state = env.reset(reset_key)
        params = network.init(init_key, obs)
        carry = Carry(
            agent=AgentState(params=params, target_params=params, opt_state=optimizer.init(params)),
            buffer=buffer_init(config.buffer_size, env.obs_size),
            env_state=env_state,
            obs=obs,
            episode_return=jnp.float32(0.0),
            key=key,
        )
        carry, metrics = jax.lax.scan(train_block, carry, jnp.arange(num_blocks))
        return {"params": carry.agent.params, "metrics": metrics}  # metrics: [blocks]

    return train


# ----------------------------------------------------------------------------------------
# Running many seeds: keys, sharding, memory
# ----------------------------------------------------------------------------------------


class SeedPlan(NamedTuple):
    num_devices: int
    padded_seeds: int  # num_seeds rounded up to a multiple of num_devices
    seeds_per_batch: int  # per device: seeds vmapped at once (lax.map runs the batches)
    bytes_per_seed: int
    bytes_available: int  # per device


def count_params(config: Config) -> int:
    widths = (CartPole.obs_size, *config.hidden_sizes, CartPole.num_actions)
    dense = sum(a * b + b for a, b in zip(widths[:-1], widths[1:], strict=False))
    return dense + (2 * sum(config.hidden_sizes) if config.layer_norm else 0)


def bytes_per_seed(config: Config) -> int:
    """A generous estimate of the device memory one seed's `train` needs."""
    float_size, key_size = 4, 8
    agent = 6 * count_params(config) * float_size  # params, target, Adam mu/nu, grads, updates
    buffer = config.buffer_size * (2 * CartPole.obs_size + 3) * float_size
    block = block_steps(config)
    keys = (2 * block + block // config.train_frequency + 5) * key_size  # one block's keys
    activations = 6 * config.batch_size * sum(config.hidden_sizes) * float_size
    evaluation = 4 * config.eval_episodes * (max(config.hidden_sizes) + 16) * float_size
    metrics = 4 * (config.total_timesteps // block) * float_size
    # x2 for the temporaries XLA keeps beside the loop state.
    return 2 * (agent + buffer + keys + activations + evaluation + metrics)


def bytes_available(device) -> int:
    """Free memory of one device; CPU devices share the host RAM."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return host // len(jax.devices())


# On a CPU, vmapping a few seeds at a time and running those batches one after another
# (lax.map) beats vmapping all of a device's seeds at once: each batch's buffers and
# activations stay in cache. Measured here (512 seeds, 2 CPU devices, 10k steps, training
# only): 256 seeds at once per device 57 s, batches of 64 43 s, 16 34 s, 8 36 s, 4 38 s.
# A GPU wants every seed at once.
CPU_SEEDS_PER_BATCH = 16


def plan_seeds(config: Config, memory_fraction: float = 0.5) -> SeedPlan:
    """Pad the seeds to a multiple of the device count; batch them if they do not fit
    (and, on a CPU, in batches of at most CPU_SEEDS_PER_BATCH, which runs faster).

    Raises MemoryError (with what to change) when not even one seed fits.
    """
    num_devices = len(jax.devices())
    padded = -(-config.num_seeds // num_devices) * num_devices
    per_device = padded // num_devices
    need = bytes_per_seed(config)
    available = bytes_available(jax.devices()[0])
    fits = int(memory_fraction * available) // need
    if fits < 1:
        raise MemoryError(
            f"one seed needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB free per "
            "device: lower --buffer-size, --eval-every or --batch-size"
        )
    if jax.devices()[0].platform == "cpu":
        fits = min(fits, CPU_SEEDS_PER_BATCH)
    # The largest batch that fits and divides the per-device seeds evenly.
    batch = max(b for b in range(1, per_device + 1) if per_device % b == 0 and b <= fits)
    return SeedPlan(
        num_devices=num_devices,
        padded_seeds=padded,
        seeds_per_batch=batch,
        bytes_per_seed=need,
        bytes_available=available,
    )


def make_keys(seed: int, plan: SeedPlan, sharding: NamedSharding) -> jax.Array:
    """Keys made inside jit straight into their shards (no host-side copy per device).

    Seed i gets fold_in(key(seed), i): the same agent whatever --num-seeds is.
    """
    shape = (plan.num_devices, plan.padded_seeds // plan.num_devices)

    @partial(jax.jit, out_shardings=sharding)
    def keys():
        base = jax.random.key(seed)
        return jax.vmap(partial(jax.random.fold_in, base))(jnp.arange(plan.padded_seeds)).reshape(
            shape
        )

    return keys()  # [devices, seeds per device]


class Progress:
    """One tqdm bar for all seeds, fed by a callback from inside the compiled loop.

    The callback gets the step count, which is the same for every seed, so it runs
    once per report, not once per seed or per device. Batches of seeds (when memory
    is short) run one after another: a step count that goes down marks the next one.
    """

    def __init__(self, config: Config, plan: SeedPlan):
        self.steps = config.total_timesteps
        self.batches = (plan.padded_seeds // plan.num_devices) // plan.seeds_per_batch
        self.total = config.num_seeds * config.total_timesteps  # padding seeds not counted
        self.batches_done, self.last, self.bar = 0, 0, None

    def start(self) -> None:  # after compiling, so the ETA measures training only
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, unit="agent-steps", unit_scale=True, file=sys.stderr)

    def __call__(self, steps_done) -> None:
        steps = int(steps_done)
        if steps < self.last:
            self.batches_done += 1
        self.last = steps
        done = (self.batches_done * self.steps + steps) / (self.batches * self.steps)
        n = int(done * self.total)
        if self.bar is not None and n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()


def train_seeds(config: Config, plan: SeedPlan, progress: Progress | None = None):
    """Train every seed; returns (output trimmed to num_seeds, compile s, train s)."""
    mesh = Mesh(np.array(jax.devices()), ("seeds",))
    sharding = NamedSharding(mesh, PartitionSpec("seeds"))  # the device axis is split
    train = make_train(config, progress)
    per_device = plan.padded_seeds // plan.num_devices
    if plan.seeds_per_batch == per_device:
        per_device_fn = jax.vmap(train)
    else:  # vmap batches of seeds, one after another (memory, or CPU cache: plan_seeds)
        per_device_fn = partial(jax.lax.map, train, batch_size=plan.seeds_per_batch)
    run = jax.jit(jax.vmap(per_device_fn), in_shardings=sharding, out_shardings=sharding)

    keys = make_keys(config.seed, plan, sharding)
    start = time.perf_counter()
    compiled = run.lower(keys).compile()
    compile_s = time.perf_counter() - start
    if progress is not None:
        progress.start()
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    train_s = time.perf_counter() - start
    # [devices, per device, ...] -> [seeds, ...], dropping the padding seeds.
    out = jax.tree.map(
        lambda x: np.asarray(x).reshape(-1, *x.shape[2:])[: config.num_seeds], jax.device_get(out)
    )
    return out, compile_s, train_s


# ----------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------

BOOTSTRAP_SAMPLES = 2_000
CI_LEVEL = 0.95


def iqm(values: np.ndarray, axis: int = -1) -> np.ndarray:
    """Interquartile mean: the mean of the middle 50% (Agarwal et al. 2021)."""
    values = np.sort(values, axis=axis)
    n = values.shape[axis]
    lo, hi = n // 4, n - n // 4
    return np.take(values, np.arange(lo, max(hi, lo + 1)), axis=axis).mean(axis=axis)


def bootstrap_iqm(values: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQM over seeds (axis 0) with a percentile-bootstrap CI, resampling seeds."""
    rng = np.random.default_rng(seed)
    n = values.shape[0]
    samples = values[rng.integers(0, n, size=(BOOTSTRAP_SAMPLES, n))]  # [boot, seeds, ...]
    boot = iqm(samples, axis=1)
    tail = 100 * (1 - CI_LEVEL) / 2
    return (
        iqm(values, axis=0),
        np.percentile(boot, tail, axis=0),
        np.percentile(boot, 100 - tail, axis=0),
    )


def versions() -> dict:
    import importlib.metadata as md

    names = ("jax", "jaxlib", "flax", "optax", "distrax", "gymnax", "numpy", "matplotlib")
    return {"python": platform.python_version(), **{n: md.version(n) for n in names}}


def score_summary(returns: np.ndarray, seed: int) -> dict:
    value, lo, hi = bootstrap_iqm(returns, seed)
    return {
        "final_eval_return": [float(r) for r in returns],
        "solved_fraction": float(np.mean(returns >= SOLVED_RETURN)),
        "iqm": {"value": float(value), "ci95": [float(lo), float(hi)]},
        "median": float(np.median(returns)),
        "mean": float(np.mean(returns)),
    }


def plot_learning_curves(metrics: dict, seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = metrics["step"][0]
    returns = metrics["eval_return"]  # [seeds, evals]
    value, lo, hi = bootstrap_iqm(returns, seed)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, returns.T, color="tab:blue", alpha=min(0.3, 5 / len(returns)), lw=0.6)
    ax.fill_between(steps, lo, hi, color="tab:orange", alpha=0.35, label="95% bootstrap CI")
    ax.plot(steps, value, color="tab:orange", lw=2, marker="o", ms=3, label="IQM over seeds")
    ax.axhline(SOLVED_RETURN, color="k", ls="--", lw=1, label=f"solved ({SOLVED_RETURN:.0f})")
    ax.set(
        xlabel="environment steps",
        ylabel="greedy return",
        title=f"DQN on CartPole-v1, {len(returns)} seeds",
        ylim=(0, 520),
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rollout(key: jax.Array, params, env, network: QNetwork) -> tuple[np.ndarray, int]:
    """One greedy episode: the states seen and its length."""

    @jax.jit
    def run(key):
        obs, state = env.reset(key)

        def one_step(carry, _):
            obs, state, alive = carry
            action = jnp.argmax(network.apply(params, obs))
            next_obs, state, _, terminated, truncated, info = env.step(key, state, action)
            return (next_obs, state, alive & ~(terminated | truncated)), (obs, alive)

        _, (frames, alive) = jax.lax.scan(
            one_step,
            (obs, state, jnp.bool_(True)),
            None,
            length=env.default_params.max_steps_in_episode,
        )
        return frames, alive.sum()

    frames, length = run(key)
    return np.asarray(frames)[: int(length)], int(length)


def render_gif(frames: np.ndarray, title: str, path: Path, fps: int = 25) -> None:
    """Cart and pole drawn with matplotlib, every other 50 Hz frame (fps 25 = real time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation, PillowWriter

    params = EnvParams()
    pole = 2 * params.length
    fig, ax = plt.subplots(figsize=(4, 2.4))
    ax.set(
        xlim=(-params.x_threshold - 0.3, params.x_threshold + 0.3),
        ylim=(-0.3, 1.3),
        aspect="equal",
        yticks=[],
    )
    ax.axhline(0, color="k", lw=1)
    cart = plt.Rectangle((0, -0.1), 0.4, 0.2, color="tab:blue")
    ax.add_patch(cart)
    (line,) = ax.plot([], [], color="tab:orange", lw=4)
    text = ax.set_title("")
    shown = frames[::2]

    def draw(i):
        x, _, theta, _ = shown[i]
        cart.set_x(x - 0.2)
        line.set_data([x, x + pole * np.sin(theta)], [0, pole * np.cos(theta)])
        text.set_text(f"{title}  step {2 * i}")
        return cart, line, text

    FuncAnimation(fig, draw, frames=len(shown), blit=True).save(path, writer=PillowWriter(fps=fps))
    plt.close(fig)


def save_params(params, path: Path) -> None:
    path.write_bytes(flax.serialization.to_bytes(params))  # every leaf: [seeds, ...]


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error on two lines; we print one line and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_hidden_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints like 64,64, got {text!r}"
        ) from None


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="dqn_cartpole.py",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float, "str": str}.get(f.type)
        if f.type == "bool":
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f.metadata["help"],
            )
        elif f.name == "hidden_sizes":
            parser.add_argument(
                flag, type=parse_hidden_sizes, default=f.default, help=f.metadata["help"]
            )
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    parser.add_argument(
        "--load",
        metavar="DIR",
        help="evaluate the params saved in DIR "
        "(its network shape; env, seed, eval-episodes from this command line)",
    )
    parser.add_argument(
        "--render", action="store_true", help="write render.gif: the median seed's greedy episode"
    )
    return parser


def load_run(folder: str) -> tuple[Config, Any]:
    """Saved config and params of a run folder; ValueError naming the problem."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"--load {folder}: not a folder")
    for name in ("params.msgpack", "summary.json"):
        if not (path / name).is_file():
            raise ValueError(f"--load {folder}: no {name} in it")
    try:
        saved = json.loads((path / "summary.json").read_text())["config"]
        saved["hidden_sizes"] = tuple(saved["hidden_sizes"])
        config = Config(**saved)
        params = flax.serialization.msgpack_restore((path / "params.msgpack").read_bytes())
    except Exception as error:  # any unreadable file is one line, not a traceback
        raise ValueError(f"--load {folder}: cannot read the saved run ({error})") from None
    return config, params


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)}
    config = Config(**fields)
    try:
        validate(config)
        if args.load:
            saved, params = load_run(args.load)
            # The network must match the saved params; everything else is this command's.
            config = dataclasses.replace(
                config, hidden_sizes=saved.hidden_sizes, layer_norm=saved.layer_norm
            )
            return evaluate_saved(config, params, args.render, start)
        plan = plan_seeds(config)
    except (ValueError, MemoryError) as error:
        print(f"dqn_cartpole.py: error: {error}", file=sys.stderr)
        sys.exit(2)

    devices = jax.devices()
    print(
        f"{config.num_seeds} seeds x {config.total_timesteps} steps on {len(devices)} "
        f"{devices[0].platform} device(s); padded to {plan.padded_seeds}; memory "
        f"~{plan.bytes_per_seed * plan.padded_seeds / 2**20:.0f} MiB, "
        f"{plan.seeds_per_batch} seeds at once per device"
    )
    progress = Progress(config, plan)
    out, compile_s, train_s = train_seeds(config, plan, progress)
    progress.close()
    agent_steps = config.num_seeds * config.total_timesteps
    metrics = out["metrics"]
    returns = metrics["eval_return"][:, -1]  # final params, fresh greedy episodes

    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    save_params(out["params"], output / "params.msgpack")
    plot_learning_curves(metrics, config.seed, output / "learning_curves.png")
    curve, curve_lo, curve_hi = bootstrap_iqm(metrics["eval_return"], config.seed)
    summary = {
        "config": dataclasses.asdict(config),
        "versions": versions(),
        "devices": [str(d) for d in devices],
        "seeds_padded_to": plan.padded_seeds,
        "seeds_per_batch_per_device": plan.seeds_per_batch,
        "compile_time_s": compile_s,
        "train_time_s": train_s,
        "agent_steps_per_s": agent_steps / train_s,
        **score_summary(returns, config.seed),
        # The best evaluation along the way, beside the final one (never instead of it).
        "best_eval_return": [float(r) for r in metrics["eval_return"].max(axis=1)],
        "curve": {
            "step": metrics["step"][0].tolist(),
            "iqm": curve.tolist(),
            "ci95_low": curve_lo.tolist(),
            "ci95_high": curve_hi.tolist(),
        },
    }
    if args.render:
        render_median(config, out["params"], returns, output / "render.gif")
    summary["wall_time_s"] = time.perf_counter() - start
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"compile {compile_s:.1f} s, train {train_s:.1f} s, wall {summary['wall_time_s']:.1f} s,"
        f" {summary['agent_steps_per_s']:,.0f} agent-steps/s"
    )
    print(
        f"final greedy return: solved (>= {SOLVED_RETURN:.0f}) "
        f"{summary['solved_fraction']:.1%} of {config.num_seeds} seeds, IQM "
        f"{summary['iqm']['value']:.1f} [{summary['iqm']['ci95'][0]:.1f}, "
        f"{summary['iqm']['ci95'][1]:.1f}], median {summary['median']:.1f} -> {output}"
    )


def render_median(config: Config, params, returns: np.ndarray, path: Path) -> None:
    env = make_env(config.env)
    network = QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    median_seed = int(np.argsort(returns)[len(returns) // 2])
    one = jax.tree.map(lambda x: x[median_seed], params)
    frames, length = rollout(jax.random.key(config.seed), one, env, network)
    render_gif(frames, f"seed {median_seed}: return {length}", path)


def evaluate_saved(config: Config, params, render: bool, start: float) -> None:
    env = make_env(config.env)
    network = QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    num_seeds = jax.tree.leaves(params)[0].shape[0]
    keys = jax.random.split(jax.random.key(config.seed), num_seeds)
    run = jax.jit(
        jax.vmap(partial(evaluate, env=env, network=network, num_episodes=config.eval_episodes))
    )
    returns = np.asarray(run(keys, params))
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": dataclasses.asdict(config),
        "versions": versions(),
        "devices": [str(d) for d in jax.devices()],
        **score_summary(returns, config.seed),
    }
    if render:
        render_median(config, params, returns, output / "render.gif")
    summary["wall_time_s"] = time.perf_counter() - start
    (output / "load_summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{num_seeds} saved seeds, {config.eval_episodes} fresh greedy episodes each: solved "
        f"{summary['solved_fraction']:.1%}, IQM {summary['iqm']['value']:.1f} -> {output}"
    )


if __name__ == "__main__":
    main()
