"""Yardstick: DQN on CartPole, the way the article writes it.

The article is Ryan Pegoud, "A Gentle Introduction to Deep Reinforcement Learning in JAX:
solving the CartPole environment in less than a second" (Towards Data Science, 2023). Its
approach, reproduced here for this repository: one agent, one update per environment step,
a per-sample loss under `vmap`, `lax.cond` for exploration, resets and target copies, the
whole run in one `lax.fori_loop`, and `jax.vmap` over agents. The article's settings: MLP
64-64-64, batch 32, buffer 512, target copy every 10 steps, Adam 1e-3, gamma 0.9, epsilon
0.3 -> 0 by inverse scaling. benchmarks/dqn_cartpole.py runs our DQN at the same settings.

It is not part of the scripts. It exists so that a speed-up is a ratio measured side by side
on the same machine in the same run:

    python benchmarks/article_dqn.py --timesteps 20000
    python benchmarks/article_dqn.py --timesteps 5000 --num-agents 64

It prints one line: `article steps_per_s=<agent-steps per second, compile excluded> ...`.
"""

import math
import time

import cli  # next to this file: the benchmarks' flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax, random

GRAVITY, MASSCART, MASSPOLE, LENGTH, FORCE_MAG, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS, POLEMASS_LENGTH = MASSCART + MASSPOLE, MASSPOLE * LENGTH
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * math.pi / 360
BUFFER_SIZE, BATCH_SIZE, TARGET_EVERY = 512, 32, 10
DISCOUNT, LEARNING_RATE = 0.9, 1e-3
EPS_START, EPS_END, DECAY_RATE = 0.3, 0.0, 1e-3


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (64, 64, 64):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(2)(x)


model = MLP()
optimizer = optax.adam(LEARNING_RATE)


def env_reset(key):
    return random.uniform(key, (4,), minval=-0.05, maxval=0.05)


def env_step(state, action, key):
    x, x_dot, theta, theta_dot = state
    force = lax.select(action == 1, FORCE_MAG, -FORCE_MAG)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + POLEMASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (
        LENGTH * (4.0 / 3.0 - MASSPOLE * cos**2 / TOTAL_MASS)
    )
    x_acc = temp - POLEMASS_LENGTH * theta_acc * cos / TOTAL_MASS
    new_state = jnp.array(
        [x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc]
    )
    done = (jnp.abs(new_state[0]) > X_LIMIT) | (jnp.abs(new_state[2]) > THETA_LIMIT)
    reward = jnp.float32(jnp.invert(done))
    obs = lax.cond(done, lambda: env_reset(key), lambda: new_state)
    return obs, new_state, reward, done


def act(key, params, state, epsilon):
    explore = random.uniform(key) < epsilon
    key, subkey = random.split(key)
    action = lax.cond(
        explore,
        lambda k: random.choice(k, jnp.arange(2)),
        lambda _: jnp.argmax(model.apply(params, state)),
        subkey,
    )
    return action, key


def update(params, target_params, opt_state, batch):
    def batch_loss(params):
        def sample_loss(state, action, reward, next_state, done):
            target = reward + (1.0 - done) * DISCOUNT * jnp.max(
                model.apply(target_params, next_state)
            )
            return jnp.square(target - model.apply(params, state)[action])

        return jnp.mean(jax.vmap(sample_loss)(*batch))

    loss, grads = jax.value_and_grad(batch_loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss


def make_train(timesteps):
    def train(key):
        key, init_key, reset_key = random.split(key, 3)
        params = model.init(init_key, jnp.zeros(4))
        buffer = (
            jnp.zeros((BUFFER_SIZE, 4)),
            jnp.zeros(BUFFER_SIZE, jnp.int32),
            jnp.zeros(BUFFER_SIZE),
            jnp.zeros((BUFFER_SIZE, 4)),
            jnp.zeros(BUFFER_SIZE),
        )

        def body(i, carry):
            params, target_params, opt_state, buffer, state, key, episodes = carry
            key, act_key, env_key, sample_key = random.split(key, 4)
            epsilon = EPS_END + (EPS_START - EPS_END) / (1 + DECAY_RATE * i)
            action, _ = act(act_key, params, state, epsilon)
            obs, next_state, reward, done = env_step(state, action, env_key)
            slot = i % BUFFER_SIZE
            buffer = tuple(
                b.at[slot].set(v)
                for b, v in zip(
                    buffer, (state, action, reward, next_state, jnp.float32(done)), strict=True
                )
            )
            idx = random.randint(sample_key, (BATCH_SIZE,), 0, jnp.minimum(i + 1, BUFFER_SIZE))
            params, opt_state, _ = update(
                params, target_params, opt_state, tuple(b[idx] for b in buffer)
            )
            target_params = lax.cond(i % TARGET_EVERY == 0, lambda: params, lambda: target_params)
            return params, target_params, opt_state, buffer, obs, key, episodes + done

        init = (
            params,
            params,
            optimizer.init(params),
            buffer,
            env_reset(reset_key),
            key,
            jnp.int32(0),
        )
        carry = lax.fori_loop(0, timesteps, body, init)
        return carry[0], carry[-1]

    return train


def main():
    parser = cli.parser(__doc__)
    parser.add_argument("--timesteps", type=cli.count, default=20_000)
    parser.add_argument("--num-agents", type=int, default=0, help="0: one agent, no vmap")
    args = parser.parse_args()
    if args.timesteps >= 2**31:  # the loop counter is int32
        parser.error(f"--timesteps: must be below 2^31, got {args.timesteps}")
    if not 0 <= args.num_agents < 2**31:  # a count JAX's shapes hold
        parser.error(f"--num-agents: must be from 0 to 2^31 - 1, got {args.num_agents}")
    cli.check_backend()

    train = make_train(args.timesteps)
    fn = jax.jit(jax.vmap(train) if args.num_agents else train)

    def make_keys():  # 0 agents: one key, no vmap
        return random.split(random.key(0), args.num_agents) if args.num_agents else random.key(0)

    fn = cli.compile_if_fits(fn, jax.eval_shape(make_keys), "--num-agents, --timesteps")
    keys = make_keys()
    jax.block_until_ready(fn(keys))  # warm up
    start = time.perf_counter()
    _, episodes = jax.block_until_ready(fn(keys))
    seconds = time.perf_counter() - start
    agents = max(args.num_agents, 1)
    print(
        f"article steps_per_s={args.timesteps * agents / seconds:.0f} "
        f"episodes={int(jnp.sum(episodes))} seconds={seconds:.3f}"
    )


if __name__ == "__main__":
    cli.run(main)
