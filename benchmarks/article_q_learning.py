"""Yardstick: tabular Q-learning on the 8x12 GridWorld, the way the article writes it.

The article is Ryan Pegoud, "Vectorize and Parallelize RL Environments with JAX:
Q-learning at the speed of light" (Towards Data Science, 2023). Its approach, reproduced
here for this repository: one PRNG split per step, `lax.cond` for the epsilon-greedy
choice and for the reset, `random.choice` for tie-breaks, the whole run in one
`lax.fori_loop`, and `jax.vmap` over agents. Same map, same hyperparameters (epsilon 0.1,
learning rate 0.1, gamma 0.9) and same Q-learning as ours, so steps/s compare like for like.

It is not part of the scripts. It exists so that a speed-up is a ratio measured side by side
on the same machine in the same run, by the benchmarks beside it:

    python benchmarks/article_q_learning.py --timesteps 1000000
    python benchmarks/article_q_learning.py --timesteps 20000 --num-agents 1024

It prints one line: `article steps_per_s=<agent-steps per second, compile excluded> ...`.
"""

import time

import cli  # next to this file: the benchmarks' flags
import jax
import jax.numpy as jnp
from jax import lax, random

cli.check_backend()  # before the article's constants below go to a device
ROWS, COLS, N_ACTIONS = 8, 12, 4
START = jnp.array([7, 11])
GOAL = jnp.array([0, 0])
MOVES = jnp.array([[0, 1], [1, 0], [0, -1], [-1, 0]])  # right, down, left, up
EPSILON, LEARNING_RATE, GAMMA = 0.1, 0.1, 0.9


def env_step(state, action):
    new_state = jnp.clip(state + MOVES[action], 0, jnp.array([ROWS - 1, COLS - 1]))
    done = jnp.all(new_state == GOAL)
    reward = done.astype(jnp.float32)
    obs = lax.cond(done, lambda: START, lambda: new_state)
    return obs, new_state, reward, done


def policy(key, state, q_values):
    def random_action(subkey):
        return random.choice(subkey, jnp.arange(N_ACTIONS))

    def greedy_action(subkey):
        q = q_values[state[0], state[1]]
        best = (q == q.max()).astype(jnp.float32)
        return random.choice(subkey, jnp.arange(N_ACTIONS), p=best / best.sum())

    explore = random.uniform(key) < EPSILON
    key, subkey = random.split(key)
    return lax.cond(explore, random_action, greedy_action, subkey), key


def q_update(q_values, state, action, reward, done, next_state):
    target = reward + GAMMA * (1.0 - done) * q_values[next_state[0], next_state[1]].max()
    old = q_values[state[0], state[1], action]
    return q_values.at[state[0], state[1], action].set(old + LEARNING_RATE * (target - old))


def make_train(timesteps):
    def train(key):
        def body(_, carry):
            state, key, q_values, episodes = carry
            action, key = policy(key, state, q_values)
            obs, next_state, reward, done = env_step(state, action)
            q_values = q_update(q_values, state, action, reward, done, next_state)
            return obs, key, q_values, episodes + done

        init = (START, key, jnp.zeros((ROWS, COLS, N_ACTIONS)), jnp.int32(0))
        _, _, q_values, episodes = lax.fori_loop(0, timesteps, body, init)
        return q_values, episodes

    return train


def main():
    parser = cli.parser(__doc__)
    parser.add_argument("--timesteps", type=cli.count, default=1_000_000)
    parser.add_argument("--num-agents", type=int, default=0, help="0: one agent, no vmap")
    args = parser.parse_args()
    if args.timesteps >= 2**31:  # the loop counter is int32
        parser.error(f"--timesteps: must be below 2^31, got {args.timesteps}")
    if not 0 <= args.num_agents < 2**31:  # a count JAX's shapes hold
        parser.error(f"--num-agents: must be from 0 to 2^31 - 1, got {args.num_agents}")

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
