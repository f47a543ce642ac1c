"""DQN on CartPole-v1 for many seeds at once, in one compiled call (PureJaxRL style).

    python dqn_cartpole.py --num-seeds 512                     # train 512 independent agents
    python dqn_cartpole.py --load runs/dqn_cartpole --render   # re-evaluate them, write a GIF

The whole experiment (acting, replay buffer, updates, target network, greedy evaluation) is
one pure function from a key to params and metrics. Seed i trains on fold_in(key(seed), i):

    train = make_train(Config())
    keys = jax.vmap(partial(jax.random.fold_in, jax.random.key(0)))(jnp.arange(512))
    out = jax.jit(jax.vmap(train))(keys)  # {"params": [512, ...], "metrics": [512, evals]}

Above the appendix line: that reference, complete on its own. Below: running it sharded, reports.
"""

import dataclasses
import math
import os
from functools import partial
from typing import Any, NamedTuple

# Show every CPU core to JAX as its own device, so the seeds are sharded over all cores. Only
# when the user has not set XLA_FLAGS, and before jax is imported; a GPU run is unaffected.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={os.cpu_count() or 1}"

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


ENVS = ("cartpole", "gymnax")
MAX_EVAL_POINTS = 1_000  # bounds the metrics memory: points per learning curve


@dataclasses.dataclass(frozen=True)
class Config:
    total_timesteps: int = option(50_000, "environment steps per seed")
    num_seeds: int = option(1, "independent agents trained at once (vmapped, sharded)")
    seed: int = option(0, "base seed; seed i of a run uses fold_in(key(seed), i)")
    learning_rate: float = option(2.5e-3, "Adam step size at the start of training")
    anneal_lr: bool = option(True, "decay the step size linearly to 0: freezes a good policy")
    # 0.995, not 0.99: a policy that keeps the pole up can still let the cart drift off the
    # track hundreds of steps later, which 0.99 hardly sees (0.99^300 = 0.05).
    gamma: float = option(0.995, "discount factor")
    # Small on purpose: fresh data beat old data here (measured: see README).
    buffer_size: int = option(5_000, "replay buffer capacity (transitions per seed)")
    batch_size: int = option(32, "transitions per gradient update")
    hidden_sizes: tuple[int, ...] = option((64, 64), "MLP hidden widths, e.g. 64,64")
    layer_norm: bool = option(True, "LayerNorm after each hidden Dense: keeps Q from diverging")
    train_frequency: int = option(4, "environment steps per gradient update")
    learning_starts: int = option(1_000, "environment steps before the first update")
    target_update_interval: int = option(4, "environment steps between target updates")
    tau: float = option(0.1, "target update weight: 1 copies the online net, <1 is Polyak")
    max_grad_norm: float = option(10.0, "clip gradients to this global norm")
    epsilon_start: float = option(1.0, "exploration rate at step 0")
    epsilon_end: float = option(0.05, "exploration rate after the linear decay")
    exploration_fraction: float = option(0.1, "share of total_timesteps the decay lasts")
    double_dqn: bool = option(True, "Double DQN target: online net picks, target net rates")
    eval_every: int = option(5_000, "environment steps between greedy evaluations")
    eval_episodes: int = option(10, "fresh episodes per greedy evaluation (epsilon 0)")
    env: str = option("cartpole", "cartpole (ours) or gymnax (gymnax.make('CartPole-v1'))")
    output_dir: str = option("runs/dqn_cartpole", "where summary, figures and params go")

    @property
    def block_steps(self) -> int:
        """Environment steps between evaluations (a small budget gets one block)."""
        return min(self.eval_every, self.total_timesteps)

    def __post_init__(self):
        """Raise ValueError('--flag problem') for the first bad value."""
        positive = ("total_timesteps", "num_seeds", "buffer_size", "batch_size")
        positive += ("train_frequency", "target_update_interval", "eval_every", "eval_episodes")
        checks = [(name, getattr(self, name) >= 1, "must be >= 1") for name in positive]
        widths_ok = len(self.hidden_sizes) > 0 and min(self.hidden_sizes) >= 1
        # max(1, ...): no division by a bad value before that value's own check fails.
        steps, block = self.total_timesteps, max(1, self.block_steps)
        updates_fit = block % max(1, self.train_frequency) == 0
        few_evals = steps // block <= MAX_EVAL_POINTS
        checks += [
            ("hidden_sizes", widths_ok, "needs one or more widths >= 1, e.g. 64,64"),
            ("learning_starts", self.learning_starts >= 0, "must be >= 0"),
            ("learning_rate", self.learning_rate > 0, "must be > 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "must be > 0"),
            ("tau", 0 < self.tau <= 1, "must be in (0, 1]"),
            ("gamma", 0 <= self.gamma < 1, "must be in [0, 1)"),
            ("epsilon_start", 0 <= self.epsilon_start <= 1, "must be in [0, 1]"),
            ("epsilon_end", 0 <= self.epsilon_end <= 1, "must be in [0, 1]"),
            ("exploration_fraction", 0 < self.exploration_fraction <= 1, "must be in (0, 1]"),
            ("batch_size", self.batch_size <= self.buffer_size, "must be <= --buffer-size"),
            ("env", self.env in ENVS, f"unknown env {self.env!r}; choose from {ENVS}"),
            ("total_timesteps", steps % block == 0, "must be a multiple of --eval-every"),
            ("eval_every", updates_fit, "must be a multiple of --train-frequency"),
            ("eval_every", few_evals, f"is too small: more than {MAX_EVAL_POINTS} evaluations"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} {problem}")


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
    # Gymnasium's classic_control/cartpole.py constants (the derived ones derived in step).
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


class CartPole:
    """Gymnasium's CartPole-v1 in JAX with gymnax 1.0's API.

    `step` returns (obs, state, reward, terminated, truncated, info) and resets by
    itself when the episode ends; the observation that ended the episode is in
    info["final_observation"]. Terminated (the pole fell or the cart left) and
    truncated (500 steps) stay apart: only the first one is a terminal state.
    """

    num_actions = 2
    default_params = EnvParams()

    def reset(self, key: jax.Array, params: EnvParams | None = None):
        p = self.default_params if params is None else params
        bound = p.reset_bound
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
        theta_acc = (p.gravity * sin - cos * temp) / (
            p.length * (4.0 / 3.0 - p.masspole * cos**2 / total_mass)
        )
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
    """Write one transition over the oldest slot."""
    capacity = buffer.data.reward.shape[0]
    data = jax.tree.map(lambda d, x: d.at[buffer.pointer].set(x), buffer.data, transition)
    pointer = (buffer.pointer + 1) % capacity
    return Buffer(data=data, pointer=pointer, size=jnp.minimum(buffer.size + 1, capacity))


def buffer_sample(buffer: Buffer, key: jax.Array, batch_size: int) -> Transition:
    """Uniform over the filled slots only (the zeros beyond `size` are not data)."""
    idx = jax.random.randint(key, (batch_size,), 0, jnp.maximum(buffer.size, 1))
    return jax.tree.map(lambda d: d[idx], buffer.data)  # [batch, ...]


# ---- Agent: act, target, loss, greedy episodes ---------------------------------------------
class AgentState(NamedTuple):
    params: Any
    target_params: Any
    opt_state: Any


def epsilon_greedy(key: jax.Array, q_values: jax.Array, epsilon: jax.Array) -> jax.Array:
    """With probability epsilon a uniform action, else the greedy one (ties at random)."""
    return distrax.EpsilonGreedy(q_values, epsilon).sample(seed=key)


def td_target(reward, terminated, next_q_target, next_q_online, gamma: float, double_dqn: bool):
    """r + gamma * Q(s', a') unless s' is terminal. A truncated s' still bootstraps:
    the time limit is not part of the task, the pole was still up."""
    if double_dqn:  # van Hasselt et al. 2016: the online net picks, the target net rates
        best = jnp.argmax(next_q_online, axis=-1)
        next_value = jnp.take_along_axis(next_q_target, best[..., None], axis=-1)[..., 0]
    else:
        next_value = jnp.max(next_q_target, axis=-1)
    return reward + gamma * (1.0 - terminated) * next_value


def dqn_loss(params, target_params, apply_fn, batch: Transition, gamma: float, double_dqn: bool):
    """Huber loss between Q(s, a) and the (constant) TD target, over the batch."""
    q = apply_fn(params, batch.obs)  # [batch, actions]
    q_taken = jnp.take_along_axis(q, batch.action[:, None], axis=-1)[:, 0]  # [batch]
    next_q_online = apply_fn(params, batch.next_obs) if double_dqn else None
    next_q_target = apply_fn(target_params, batch.next_obs)
    target = td_target(
        batch.reward, batch.terminated, next_q_target, next_q_online, gamma, double_dqn
    )
    # Huber, not squared error: a few large TD errors early on do not blow up the net.
    return jnp.mean(optax.huber_loss(q_taken, jax.lax.stop_gradient(target)))


def greedy_episodes(key, params, env, network: QNetwork, num_episodes: int, keep_obs=False):
    """Returns [episodes] of fresh greedy (epsilon 0) episodes run side by side, each for the
    full time limit with the steps after its end masked; `keep_obs`: also (obs, alive), each
    [steps, episodes, ...], to draw them."""
    obs, state = jax.vmap(env.reset)(jax.random.split(key, num_episodes))  # [episodes, obs]
    # One key for every episode's step: it only seeds the auto-resets after an episode's
    # end, which we never look at.
    step = jax.vmap(env.step, in_axes=(None, 0, 0))

    def eval_step(carry, _):
        obs, state, alive, total = carry
        action = jnp.argmax(network.apply(params, obs), axis=-1)  # [episodes]
        next_obs, state, reward, terminated, truncated, _ = step(key, state, action)
        total = total + reward * alive
        carry = (next_obs, state, alive & ~(terminated | truncated), total)
        return carry, (obs, alive) if keep_obs else None

    init = (obs, state, jnp.ones(num_episodes, bool), jnp.zeros(num_episodes, jnp.float32))
    max_steps = env.default_params.max_steps_in_episode
    (_, _, _, total), seen = jax.lax.scan(eval_step, init, None, length=max_steps)
    return (total, seen) if keep_obs else total


# ---- Train: one pure function from a key to params and metrics -----------------------------
class Carry(NamedTuple):
    agent: AgentState
    buffer: Buffer
    env_state: Any
    obs: jax.Array  # [obs]
    episode_return: jax.Array  # return of the running training episode
    key: jax.Array


def make_train(config: Config, env=None, network=None, progress_callback=None):
    """Returns train(key) -> {"params", "metrics"}: the whole experiment for one seed.

    Time is nested: blocks of `eval_every` steps, each ending in a greedy evaluation, made of
    iterations of `train_frequency` env steps and one update. `env` defaults to our CartPole;
    `progress_callback(env_steps_done)` is called from inside the loop ~200 times per run.
    """
    env = CartPole() if env is None else env
    if network is None:
        network = QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
    block = config.block_steps
    num_blocks = config.total_timesteps // block
    iters_per_block = block // config.train_frequency
    # The step size decays over the updates that will actually happen.
    num_updates = (config.total_timesteps - config.learning_starts) // config.train_frequency
    lr = config.learning_rate
    if config.anneal_lr:
        lr = optax.linear_schedule(config.learning_rate, 0.0, max(1, num_updates))
    optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr))
    decay_steps = max(1, int(config.exploration_fraction * config.total_timesteps))
    epsilon_at = optax.linear_schedule(config.epsilon_start, config.epsilon_end, decay_steps)
    # Report progress ~200 times: often enough for a smooth ETA, rare enough to be free.
    report_every = max(1, num_blocks * iters_per_block // 200)

    def env_step(carry: Carry, xs) -> tuple[Carry, dict]:
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
        # An episode's return is reported on its last step only.
        return carry, {"finished_return": jnp.where(done, episode_return, 0.0), "done": done}

    def update(agent: AgentState, batch: Transition):
        loss, grads = jax.value_and_grad(dqn_loss)(
            agent.params, agent.target_params, network.apply, batch, config.gamma, config.double_dqn
        )
        updates, opt_state = optimizer.update(grads, agent.opt_state, agent.params)
        params = optax.apply_updates(agent.params, updates)
        return agent._replace(params=params, opt_state=opt_state), loss

    def iteration(carry: Carry, xs) -> tuple[Carry, dict]:
        it, act_keys, env_keys, sample_key = xs  # it: global iteration index (not per seed)
        first_step = it * config.train_frequency
        steps = first_step + jnp.arange(config.train_frequency)
        carry, steps_info = jax.lax.scan(env_step, carry, (steps, act_keys, env_keys))
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
        interval = config.target_update_interval
        cross = steps_done // interval > first_step // interval
        target = jax.lax.cond(
            learn & cross,
            lambda a: optax.incremental_update(a.params, a.target_params, config.tau),
            lambda a: a.target_params,
            agent,
        )
        carry = carry._replace(agent=agent._replace(target_params=target))

        if progress_callback is not None:
            report = partial(jax.debug.callback, progress_callback, steps_done)
            jax.lax.cond((it + 1) % report_every == 0, report, lambda: None)
        return carry, {"loss": loss, "updated": learn, **steps_info}  # loss 0 if no update

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
        returns = greedy_episodes(eval_key, carry.agent.params, env, network, config.eval_episodes)
        episodes, updates = info["done"].sum(), info["updated"].sum()
        train_return = info["finished_return"].sum() / episodes
        loss = info["loss"].sum() / updates
        metrics = {
            "step": (block_index + 1) * block,
            "eval_return": returns.mean(),
            # NaN where the block had no finished episode / no update, not a fake 0.
            "train_return": jnp.where(episodes > 0, train_return, jnp.nan),
            "loss": jnp.where(updates > 0, loss, jnp.nan),
        }
        return carry, metrics

    def train(key: jax.Array) -> dict:
        key, init_key, reset_key = jax.random.split(key, 3)
        obs, env_state = env.reset(reset_key)
        params = network.init(init_key, obs)
        carry = Carry(
            agent=AgentState(params=params, target_params=params, opt_state=optimizer.init(params)),
            buffer=buffer_init(config.buffer_size, obs.shape[-1]),
            env_state=env_state,
            obs=obs,
            episode_return=jnp.float32(0.0),
            key=key,
        )
        carry, metrics = jax.lax.scan(train_block, carry, jnp.arange(num_blocks))
        return {"params": carry.agent.params, "metrics": metrics}  # metrics: [blocks]

    return train


# ===== Appendix: running it at scale and reporting =====
# ruff: noqa: E402  (the reference above runs on its own imports; these serve the machinery)
import argparse
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

import flax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

SOLVED_RETURN = 475.0  # Gymnasium's reward_threshold for CartPole-v1
BOOTSTRAP_SAMPLES = 2_000
# On a CPU, seeds vmapped 16 at a time, batch after batch, stay in cache: faster than all
# of a device's seeds at once (measured: see README). A GPU wants every seed at once.
CPU_SEEDS_PER_BATCH = 16


def make_env(name: str):
    """Our CartPole, or gymnax's, which steps with the same API (gymnax 1.0)."""
    if name != "gymnax":
        return CartPole()
    import gymnax  # imported here: it takes a second or two, and only `--env gymnax` needs it

    return gymnax.make("CartPole-v1")[0]


class SeedPlan(NamedTuple):
    num_devices: int
    padded_seeds: int  # num_seeds rounded up to a multiple of num_devices
    seeds_per_batch: int  # per device: seeds vmapped at once (lax.map runs the batches)
    bytes_per_seed: int


def bytes_per_seed(config: Config, env, network: QNetwork) -> int:
    """A generous estimate of the device memory one seed's `train` needs."""
    obs = jax.eval_shape(env.reset, jax.random.key(0))[0]
    params = jax.tree.leaves(jax.eval_shape(network.init, jax.random.key(0), obs))
    block, widths = config.block_steps, config.hidden_sizes
    words = 6 * sum(x.size for x in params)  # params, target, Adam's two moments, grads, updates
    words += config.buffer_size * (2 * obs.size + 3)  # the replay buffer
    words += 2 * (2 * block + block // config.train_frequency + 5)  # one block's keys
    words += 6 * config.batch_size * sum(widths)  # an update's activations
    words += 4 * config.eval_episodes * (max(widths) + 16)  # the greedy evaluation
    words += 4 * (config.total_timesteps // block)  # the metrics
    return 2 * 4 * words  # 4-byte words; x2 for the temporaries XLA keeps beside the loop


def bytes_available(device) -> int:
    """Free memory of one device; CPU devices share the host RAM."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // jax.device_count()


def plan_seeds(config: Config, need: int, memory_fraction: float = 0.5) -> SeedPlan:
    """Pad the seeds to a multiple of the device count; batch them when they do not fit
    (on a CPU, at most CPU_SEEDS_PER_BATCH). MemoryError when not even one seed fits."""
    devices = jax.devices()
    padded = -(-config.num_seeds // len(devices)) * len(devices)
    available = bytes_available(devices[0])
    fits = int(memory_fraction * available) // need
    if fits < 1:
        raise MemoryError(
            f"one seed needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB free per "
            "device: lower --buffer-size, --eval-every or --batch-size"
        )
    if devices[0].platform == "cpu":
        fits = min(fits, CPU_SEEDS_PER_BATCH)
    per_device = padded // len(devices)  # the largest batch that fits and divides it evenly:
    batch = max(b for b in range(1, fits + 1) if per_device % b == 0)
    return SeedPlan(len(devices), padded, batch, need)


def train_seeds(train, seed: int, plan: SeedPlan):
    """jax.jit(jax.vmap(train)) over seeds 0..padded_seeds-1, sharded over every device; seed
    i's key, fold_in(key(seed), i), is made inside jit straight into its shard. With fewer seeds
    per batch than a device holds, each device vmaps a batch at a time, batch after batch
    (lax.map). Returns (output, padding seeds included; compile s; train s)."""
    mesh = Mesh(np.array(jax.devices()), ("seeds",))
    sharding = NamedSharding(mesh, PartitionSpec("seeds"))

    @partial(jax.jit, out_shardings=sharding)
    def make_keys():
        base = jax.random.key(seed)
        return jax.vmap(partial(jax.random.fold_in, base))(jnp.arange(plan.padded_seeds))

    def train_all(keys):
        if plan.seeds_per_batch * plan.num_devices == plan.padded_seeds:
            return jax.vmap(train)(keys)
        per_device = keys.reshape(plan.num_devices, -1)  # [devices, seeds per device]
        out = jax.vmap(partial(jax.lax.map, train, batch_size=plan.seeds_per_batch))(per_device)
        return jax.tree.map(lambda x: x.reshape(plan.padded_seeds, *x.shape[2:]), out)

    keys = make_keys()
    start = time.perf_counter()
    compiled = jax.jit(train_all, out_shardings=sharding).lower(keys).compile()
    compile_s, start = time.perf_counter() - start, time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    train_s = time.perf_counter() - start
    return jax.device_get(out), compile_s, train_s


class Progress:
    """One tqdm bar for all seeds, fed by `jax.debug.callback` from inside the compiled loop.
    XLA calls it once per report, not per seed or device (the step count is the same for
    every seed); a count that goes down means the next batch of seeds began (lax.map)."""

    def __init__(self, config: Config, plan: SeedPlan):
        batches = plan.padded_seeds // plan.num_devices // plan.seeds_per_batch
        self.seeds_per_step = config.num_seeds / batches  # padding seeds not counted
        self.total, self.last, self.bar = config.num_seeds * config.total_timesteps, 0, None

    def __call__(self, steps_done) -> None:
        steps = int(steps_done)
        if self.bar is None:  # opened at the first report: its ETA leaves compiling out
            self.bar = tqdm(total=self.total, unit="agent-steps", unit_scale=True, file=sys.stderr)
        self.bar.update((steps - self.last if steps > self.last else steps) * self.seeds_per_step)
        self.last = steps

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.total - self.bar.n)
            self.bar.close()


def bootstrap_iqm(values: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interquartile mean (the mean of the middle 50%: Agarwal et al. 2021) over seeds, axis
    0, with a 95% percentile-bootstrap CI that resamples seeds."""
    n = values.shape[0]
    resampled = values[np.random.default_rng(seed).integers(0, n, size=(BOOTSTRAP_SAMPLES, n))]
    low, high = np.percentile(iqm(resampled, axis=1), [2.5, 97.5], axis=0)
    return iqm(values, axis=0), low, high


def iqm(values: np.ndarray, axis: int) -> np.ndarray:
    """The mean of the middle half along `axis`: a quarter of the values cut from each end."""
    n = values.shape[axis]
    middle = np.sort(values, axis=axis).take(range(n // 4, n - n // 4), axis=axis)
    return middle.mean(axis=axis)


def summarize(config: Config, returns: np.ndarray, **extra) -> dict:
    """summary.json (or load_summary.json): the run, the machine, the final scores."""
    names = ("jax", "jaxlib", "flax", "optax", "distrax", "gymnax", "numpy", "matplotlib")
    versions = {name: importlib.metadata.version(name) for name in names}
    value, low, high = bootstrap_iqm(returns, config.seed)
    return {
        "config": dataclasses.asdict(config),
        "versions": {"python": platform.python_version(), **versions},
        "devices": [str(d) for d in jax.devices()],
        **extra,
        "final_eval_return": returns.tolist(),
        "solved_fraction": float(np.mean(returns >= SOLVED_RETURN)),
        "iqm": {"value": float(value), "ci95": [float(low), float(high)]},
        "median": float(np.median(returns)),
        "mean": float(np.mean(returns)),
    }


def plot_learning_curves(steps: np.ndarray, returns: np.ndarray, seed: int, path: Path) -> None:
    import matplotlib.pyplot as plt  # here: only a run that plots pays for the import

    value, low, high = bootstrap_iqm(returns, seed)  # returns: [seeds, evals]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, returns.T, color="tab:blue", alpha=min(0.3, 5 / len(returns)), lw=0.6)
    ax.fill_between(steps, low, high, color="tab:orange", alpha=0.35, label="95% bootstrap CI")
    ax.plot(steps, value, color="tab:orange", lw=2, marker="o", ms=3, label="IQM over seeds")
    ax.axhline(SOLVED_RETURN, color="k", ls="--", lw=1, label=f"solved ({SOLVED_RETURN:.0f})")
    ax.set(xlabel="environment steps", ylabel="greedy return", ylim=(0, 520))
    ax.set_title(f"DQN on CartPole-v1, {len(returns)} seeds")
    ax.legend(loc="lower right")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def render_median(config: Config, env, network, params, returns: np.ndarray, path: Path):
    """GIF of a fresh greedy episode of the median seed, every other 50 Hz step at 25 fps."""
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
        ax.set_title(f"seed {median}: return {float(total[0]):.0f}  step {2 * i}")
        return cart, line

    FuncAnimation(fig, draw, frames=len(frames)).save(path, writer=PillowWriter(fps=25))
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """One --flag per Config field, its help from the field, its default shown as typed.
    exit_on_error=False: main prints a bad input as one line (argparse prints two)."""
    parser = argparse.ArgumentParser(
        prog="dqn_cartpole.py", description=__doc__.splitlines()[0], exit_on_error=False
    )

    def comma_ints(text: str) -> tuple[int, ...]:  # argparse says "invalid comma_ints value"
        return tuple(int(width) for width in text.split(","))

    for f in dataclasses.fields(Config):
        shown = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
        kwargs = {"default": f.default, "help": f"{f.metadata['help']} (default: {shown})"}
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = comma_ints if isinstance(f.default, tuple) else f.type
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    load_help = "evaluate the params saved in DIR (its network; the rest from this command)"
    parser.add_argument("--load", metavar="DIR", help=load_help)
    parser.add_argument("--render", action="store_true", help="GIF of the median seed")
    return parser


def load_run(folder: str) -> tuple[Config, Any]:
    """Saved config and params of a run folder; any problem is a one-line ValueError."""
    try:
        saved = json.loads((Path(folder) / "summary.json").read_text())["config"]
        config = Config(**{**saved, "hidden_sizes": tuple(saved["hidden_sizes"])})
        params = flax.serialization.msgpack_restore((Path(folder) / "params.msgpack").read_bytes())
    except Exception as error:
        raise ValueError(f"--load {folder}: cannot read a saved run ({error})") from None
    return config, params


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def run_training(config: Config, env, network, plan: SeedPlan, output: Path):
    """Train every seed, save params and learning curves; (params, final returns, extra)."""
    devices = plural(plan.num_devices, jax.devices()[0].platform + " device")
    memory = f"~{plan.bytes_per_seed * plan.padded_seeds / 2**20:.0f} MiB"
    print(
        f"{plural(config.num_seeds, 'seed')} x {config.total_timesteps} steps on {devices}, "
        f"{plan.seeds_per_batch} at once per device (padded to {plan.padded_seeds}, {memory})"
    )
    progress = Progress(config, plan)
    train = make_train(config, env, network, progress)
    out, compile_s, train_s = train_seeds(train, config.seed, plan)
    progress.close()
    out = jax.tree.map(lambda x: x[: config.num_seeds], out)  # drop the padding seeds
    (output / "params.msgpack").write_bytes(flax.serialization.to_bytes(out["params"]))
    steps, returns = out["metrics"]["step"][0], out["metrics"]["eval_return"]  # [seeds, evals]
    plot_learning_curves(steps, returns, config.seed, output / "learning_curves.png")
    speed = config.num_seeds * config.total_timesteps / train_s
    print(f"compile {compile_s:.1f} s, train {train_s:.1f} s, {speed:,.0f} agent-steps/s")
    curve = zip(("iqm", "ci95_low", "ci95_high"), bootstrap_iqm(returns, config.seed), strict=True)
    extra = {
        "seeds_padded_to": plan.padded_seeds,
        "seeds_per_batch_per_device": plan.seeds_per_batch,
        "compile_time_s": compile_s,
        "train_time_s": train_s,
        "agent_steps_per_s": speed,
        # The best evaluation along the way, beside the final one (never instead of it).
        "best_eval_return": returns.max(axis=1).tolist(),
        "curve": {"step": steps.tolist(), **{name: v.tolist() for name, v in curve}},
    }
    return out["params"], returns[:, -1], extra


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    try:
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:
            raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
        config = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
        if args.load:  # the network must match the saved params; the rest is this command's
            saved, params = load_run(args.load)
            shape = {"hidden_sizes": saved.hidden_sizes, "layer_norm": saved.layer_norm}
            config = dataclasses.replace(config, **shape)
        output = Path(config.output_dir)
        if output.exists() and not output.is_dir():
            raise ValueError(f"--output-dir {output} exists and is not a folder")
        env = make_env(config.env)
        network = QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
        plan = None if args.load else plan_seeds(config, bytes_per_seed(config, env, network))
    except (argparse.ArgumentError, ValueError, MemoryError) as error:
        print(f"dqn_cartpole.py: error: {error}", file=sys.stderr)
        sys.exit(2)

    output.mkdir(parents=True, exist_ok=True)
    if args.load:  # fresh greedy episodes of the saved params; seed i plays split(key)[i]
        play = partial(greedy_episodes, env=env, network=network, num_episodes=config.eval_episodes)
        keys = jax.random.split(jax.random.key(config.seed), jax.tree.leaves(params)[0].shape[0])
        returns = np.asarray(jax.jit(jax.vmap(lambda k, p: play(k, p).mean()))(keys, params))
        extra = {}
    else:
        params, returns, extra = run_training(config, env, network, plan, output)
    summary = summarize(config, returns, **extra)
    if args.render:
        render_median(config, env, network, params, returns, output / "render.gif")
    summary["wall_time_s"] = time.perf_counter() - start
    name = "load_summary.json" if args.load else "summary.json"
    (output / name).write_text(json.dumps(summary, indent=2))
    value, (low, high) = summary["iqm"]["value"], summary["iqm"]["ci95"]
    print(
        f"final greedy return of {plural(len(returns), 'seed')}: solved (>= {SOLVED_RETURN:.0f}) "
        f"{summary['solved_fraction']:.1%}, IQM {value:.1f} [{low:.1f}, {high:.1f}], median "
        f"{summary['median']:.1f}; wall {summary['wall_time_s']:.1f} s -> {output / name}"
    )


if __name__ == "__main__":
    main()
