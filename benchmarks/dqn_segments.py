"""What training a block at a time costs: dqn_cartpole.py's blocks against one compiled call.

    .venv/bin/python benchmarks/dqn_segments.py                  # 128 seeds, 50k steps, 3 rounds
    .venv/bin/python benchmarks/dqn_segments.py --seeds 2 --timesteps 1000 --repeats 1

The command line trains through the reference's init and run_blocks, one evaluation block per
compiled call, so that it can save a checkpoint between blocks and stop there (Ctrl-C,
SIGTERM); here with its default config and checkpoint cadence (--checkpoint-every 25000). The
other side is the same training as one compiled call, jit(vmap(train)) in the same layout
(each device runs its seeds 16 at a time), as the script ran before it had blocks. Both run
in this process and alternate, so that a machine that slows down for a while slows both.
Prints each run's compile and training seconds, the medians and the ratio of their sums.
"""

import dataclasses
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import cli  # next to this file: the benchmarks' flags

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

import dqn_cartpole as dqn  # noqa: E402  (found next to this folder, from a clone)


def in_blocks(config, env, network, grid, plan, output: Path, every: int) -> tuple[float, float]:
    """The command line's way, a checkpoint every `every` steps -> (compile s, train s)."""
    timings, saved = {}, 0
    run = {"config": dataclasses.asdict(config), "points": [config.hparams()._asdict()]}
    for done, carry, metrics in dqn.train_agents(
        config, env, network, 0, grid, plan, None, timings
    ):
        steps = int(metrics["step"][0, -1])
        if steps - saved >= every and steps < config.total_timesteps:
            start = time.perf_counter()
            dqn.save_checkpoint(output, run, done, carry, metrics)
            timings["train_time_s"] += time.perf_counter() - start
            saved = steps
    return timings["compile_time_s"], timings["train_time_s"]


def in_one_call(config, env, network, grid, plan) -> tuple[float, float]:
    """The whole training as one compiled call, in the same layout -> (compile s, train s)."""
    mesh, spec = Mesh(np.array(jax.devices()), ("seeds",)), PartitionSpec("seeds")
    train = dqn.make_train(config, env, network)
    agents = jnp.arange(plan.padded_seeds)
    keys = jax.vmap(partial(jax.random.fold_in, jax.random.key(0)))(agents % config.num_seeds)
    hparams = jax.tree.map(lambda x: jnp.broadcast_to(x[0], agents.shape), grid)

    def per_device(keys, hparams):
        pairs = (keys, hparams)
        return jax.lax.map(lambda pair: train(*pair), pairs, batch_size=plan.seeds_per_batch)

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    start = time.perf_counter()
    compiled = jax.jit(sharded).lower(keys, hparams).compile()
    compile_s, start = time.perf_counter() - start, time.perf_counter()
    jax.block_until_ready(compiled(keys, hparams))
    return compile_s, time.perf_counter() - start


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--seeds", type=cli.count, default=128, help="seeds trained at once")
    parser.add_argument("--timesteps", type=cli.count, default=50_000, help="environment steps")
    parser.add_argument("--repeats", type=cli.count, default=3, help="alternating rounds; medians")
    every_help = "steps between the blocks' checkpoints (the command line's default)"
    parser.add_argument("--checkpoint-every", type=cli.count, default=25_000, help=every_help)
    args = parser.parse_args()
    cli.check_backend()
    env = dqn.CartPole()
    try:  # what the DQN refuses (its flags are ours here), before any run
        config = dataclasses.replace(
            dqn.Config(), num_seeds=args.seeds, total_timesteps=args.timesteps,
            eval_every=min(dqn.Config().eval_every, args.timesteps // 2),  # two blocks or more
            learning_starts=min(dqn.Config().learning_starts, args.timesteps // 2),
        )  # fmt: skip
        dqn.check_sizes(config)
        network = dqn.QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
        plan = dqn.check_memory(*dqn.memory_need(config, env, network), args.seeds)
    except (ValueError, MemoryError) as error:
        cli.fail(f"--seeds {args.seeds}, --timesteps {args.timesteps}: the DQN's {error}")
    grid = dqn.hparam_grid([config.hparams()._asdict()])
    times = {"blocks": [], "one call": []}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for name in times:
                if name == "blocks":
                    compile_s, train_s = in_blocks(
                        config, env, network, grid, plan, Path(folder), args.checkpoint_every
                    )
                else:
                    compile_s, train_s = in_one_call(config, env, network, grid, plan)
                times[name].append((compile_s, train_s))
                line = f"compile {compile_s:.1f} s, train {train_s:.1f} s"
                print(f"round {repeat + 1}/{args.repeats}, {name}: {line}", flush=True)
    medians = {
        name: [statistics.median(c) for c in zip(*runs, strict=True)]
        for name, runs in times.items()
    }
    for name, (compile_s, train_s) in medians.items():
        print(f"median, {name}: compile {compile_s:.1f} s, train {train_s:.1f} s")
    (blocks_c, blocks_t), (one_c, one_t) = medians.values()
    print(
        f"blocks / one call: train {blocks_t / one_t:.3f}x, "
        f"compile and train {(blocks_c + blocks_t) / (one_c + one_t):.3f}x"
    )


if __name__ == "__main__":
    cli.run(main)
