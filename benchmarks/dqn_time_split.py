"""Where a DQN step's time goes, at the article's settings, on one CPU device.

    .venv/bin/python benchmarks/dqn_time_split.py                 # 64 agents, 2000 steps
    .venv/bin/python benchmarks/dqn_time_split.py --agents 4 --steps 100 --repeats 1
    .venv/bin/python benchmarks/dqn_time_split.py --profile       # the update's XLA ops by time

Times, per environment step of all agents, compile excluded, medians of alternating runs:
the whole of dqn_cartpole.py's train (acting, environment, buffer, one update per step, target
copies, one final evaluation) and its parts run alone, each in its own `lax.scan` of the same
length under `jax.vmap` over the agents: the gradient update (Huber loss, grads, clipping,
Adam) on a batch of 32, the forward pass that picks an action, the CartPole step. Beside
them, the same for the yardstick (benchmarks/article_dqn.py): its whole train and its update
alone (squared error, Adam, no clipping) on the same batch. Then our update split: the
gradient alone (forward and backward passes, no clipping or Adam) and its two forward passes
alone; and the three matrix products of one 64x64 layer on a batch of 32 (forward, input
gradient, weight gradient, the last also on a copy of x^T as dqn_cartpole.matmul runs it) with
their GFLOP/s: where the backward pass's time goes. The settings are benchmarks/dqn_cartpole.py's
(MLP 64-64-64, batch 32, buffer 512, no LayerNorm).

--profile: instead, the update's compiled XLA ops, the slowest first, timed by XLA's own trace
events (jax.profiler), each with its output shape and the JAX operation it comes from.
"""

import collections
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cli  # next to this file: the benchmarks' flags

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
if "--profile" in sys.argv:  # XLA's CPU ops then emit trace events, one per op run
    os.environ["XLA_FLAGS"] += " --xla_cpu_enable_xprof_traceme=true"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import article_dqn as article  # noqa: E402  (the yardstick, next to this file)
import distrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import dqn_cartpole as dqn  # noqa: E402


def parts(steps: int) -> dict:
    """name -> function of one key, each running `steps` steps of one agent."""
    config = dataclasses.replace(
        dqn.Config(), total_timesteps=steps, eval_every=steps, **cli.ARTICLE_DQN
    )
    env, network = dqn.CartPole(), dqn.QNetwork(config.hidden_sizes, 2, False)
    clip, adam = optax.clip_by_global_norm(config.max_grad_norm), optax.adam(config.learning_rate)
    optimizer, size, gamma = optax.chain(clip, adam), config.batch_size, config.gamma
    ones = jnp.ones((size, 4))  # one batch, made noisy by each step's key
    batch = dqn.Transition(ones, jnp.zeros(size, jnp.int32), ones[:, 0], ones, ones[:, 0] < 0)

    def update_only(key):
        params = network.init(key, jnp.zeros(4))

        def body(carry, key):
            params, opt_state = carry
            noisy = batch._replace(obs=batch.obs + jax.random.normal(key, (size, 4)))
            grads = jax.grad(dqn.dqn_loss)(params, params, network.apply, noisy, gamma, False)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        carry = (params, optimizer.init(params))
        return jax.lax.scan(body, carry, jax.random.split(key, steps))[0]

    def gradient_only(key):  # the update without clipping and Adam: a plain SGD step
        params = network.init(key, jnp.zeros(4))

        def body(params, key):
            noisy = batch._replace(obs=batch.obs + jax.random.normal(key, (size, 4)))
            grads = jax.grad(dqn.dqn_loss)(params, params, network.apply, noisy, gamma, False)
            return jax.tree.map(lambda p, g: p - config.learning_rate * g, params, grads), None

        return jax.lax.scan(body, params, jax.random.split(key, steps))[0]

    def forwards_only(key):  # the loss's two forward passes (online on s, target on s')
        params = network.init(key, jnp.zeros(4))

        def body(total, key):
            obs = jax.random.normal(key, (2, size, 4))
            return total + network.apply(params, obs).sum(), None  # [2, batch, actions]

        return jax.lax.scan(body, 0.0, jax.random.split(key, steps))[0]

    def product(equation: str):  # one 64x64 layer's matrix product on a batch of 32
        def run(key):
            x, w = jax.random.normal(key, (size, 64)), jax.random.normal(key, (64, 64))

            def body(x, _):  # x changes every step: XLA cannot hoist the product out
                if equation == "ib,bj->ij":  # x^T dy on a copy of x^T, as dqn_cartpole.matmul
                    y = jnp.einsum(equation, jax.lax.optimization_barrier(x.T), x)
                else:
                    y = jnp.einsum(equation, x, w if equation != "bi,bj->ij" else x)
                return x + 1e-3 * y.mean(), None

            return jax.lax.scan(body, x, None, length=steps)[0]

        return run

    def act_only(key):
        params = network.init(key, jnp.zeros(4))

        def body(total, key):
            q_values = network.apply(params, jax.random.normal(key, (4,)))
            return total + distrax.EpsilonGreedy(q_values, 0.1).sample(seed=key), None

        return jax.lax.scan(body, 0, jax.random.split(key, steps))[0]

    def env_only(key):
        def body(state, key):  # the observations are summed: no step can be optimized away
            action = jax.random.bernoulli(key).astype(jnp.int32)
            obs, state, *_ = env.step(key, state, action)
            return state, obs.sum()

        return jax.lax.scan(body, env.reset(key)[1], jax.random.split(key, steps))[1].sum()

    def yardstick_update_only(key):  # the same batch through the yardstick's update
        params = article.model.init(key, jnp.zeros(4))

        def body(carry, key):
            params, opt_state = carry
            noisy = ones + jax.random.normal(key, (size, 4))
            batch = (noisy, jnp.zeros(size, jnp.int32), ones[:, 0], ones, jnp.zeros(size))
            params, opt_state, _ = article.update(params, params, opt_state, batch)
            return (params, opt_state), None

        carry = (params, article.optimizer.init(params))
        return jax.lax.scan(body, carry, jax.random.split(key, steps))[0]

    return {
        "whole train": dqn.make_train(config, env, network),
        "update": update_only,
        "  its gradient alone (no clipping, Adam)": gradient_only,
        "  its two forward passes": forwards_only,
        "yardstick's whole train": article.make_train(steps),
        "yardstick's update": yardstick_update_only,
        "act (forward + epsilon-greedy)": act_only,
        "environment step": env_only,
        "a 64x64 layer, forward x W": product("bi,ij->bj"),
        "a 64x64 layer, input gradient dy W^T": product("bj,ij->bi"),
        "a 64x64 layer, weight gradient x^T dy": product("bi,bj->ij"),
        "  a 64x64 layer, the same on a copy of x^T": product("ib,bj->ij"),
    }


def profile(compiled, keys, steps: int, top: int = 16) -> None:
    """Print a compiled function's XLA ops that took the most time in one traced call, per step."""
    jax.block_until_ready(compiled(keys))  # warm up
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        jax.block_until_ready(compiled(keys))
        jax.profiler.stop_trace()
        trace = jax.profiler.ProfileData.from_file(str(next(Path(folder).rglob("*.xplane.pb"))))
    # '%dot.18 = f32[64,64,64]{2,1,0} dot(...), ..., op_name="jit(update_only)/.../Dense_1/..."'
    pattern = r'^\s*(?:ROOT )?%?([\w.-]+) = (\w+\[[\d,]*\]).*?op_name="([^"]*)"'
    ops = {m[1]: (m[2], m[3]) for m in re.finditer(pattern, compiled.as_text(), re.MULTILINE)}
    spent, runs = collections.Counter(), collections.Counter()
    for plane in trace.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in ops:
                    spent[event.name] += event.duration_ns
                    runs[event.name] += 1
    total = sum(spent.values())
    print(f"the update's XLA ops, {keys.shape[0]} agents: {total / steps / 1e3:.0f} us a step")
    for name, nanoseconds in spent.most_common(top):
        shape, source = ops[name]
        source = re.sub(r"^jit\(\w+\)/(vmap\(\)/)?(while/body/)?(closed_call/)?", "", source)
        print(
            f"  {nanoseconds / steps / 1e3:7.1f} us  x{runs[name] / steps:<4g} {name:24s} "
            f"{shape:16s} {source[:60]}"
        )


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--agents", type=cli.count, default=64, help="agents under jax.vmap")
    parser.add_argument("--steps", type=cli.count, default=2_000, help="environment steps")
    parser.add_argument("--repeats", type=cli.count, default=3, help="alternating rounds; medians")
    parser.add_argument("--profile", action="store_true", help="the update's XLA ops by time")
    args = parser.parse_args()
    for name in ("agents", "steps"):
        if getattr(args, name) >= 2**31:  # the scans' counters, the agents' indices: int32
            parser.error(f"--{name}: must be below 2^31, got {getattr(args, name)}")
    parser.set_defaults(repeats=None)  # parsed again: None if --repeats was left out
    if args.profile and parser.parse_args().repeats is not None:
        parser.error("--profile times one traced call; leave out --repeats")
    cli.check_backend()
    shape = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), args.agents))
    functions = {}
    for name, f in parts(args.steps).items():
        if name == "update" or not args.profile:
            functions[name] = cli.compile_if_fits(jax.jit(jax.vmap(f)), shape, "--agents, --steps")
    keys = jax.random.split(jax.random.key(0), args.agents)
    if args.profile:
        return profile(functions["update"], keys, args.steps)
    for f in functions.values():
        jax.block_until_ready(f(keys))  # warm up
    times = {name: [] for name in functions}
    for _ in range(args.repeats):
        for name, f in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(f(keys))
            times[name].append((time.perf_counter() - start) / args.steps)
    whole = statistics.median(times["whole train"])
    print(f"{args.agents} agents, {args.steps} steps, 1 device; per step of all agents:")
    for name, samples in times.items():
        seconds = statistics.median(samples)
        line = f"  {name:38s} {seconds * 1e6:8.1f} us  {seconds / whole:6.1%} of the whole"
        if "layer" in name:  # 2 flops a multiply-add, 32 x 64 x 64 of them per agent
            line += f"  {2 * 32 * 64 * 64 * args.agents / seconds / 1e9:5.0f} GFLOP/s"
        print(line)


if __name__ == "__main__":
    cli.run(main)
