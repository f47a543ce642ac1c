"""Side-by-side speed: dqn_cartpole.py against the article-style yardstick, in the same run.

    .venv/bin/python benchmarks/dqn_cartpole.py                 # 64 agents, 5000 steps, 3 rounds
    .venv/bin/python benchmarks/dqn_cartpole.py --timesteps 500 --num-agents 64 --repeats 1

The yardstick is benchmarks/article_dqn.py, the approach of Ryan Pegoud's article "A Gentle
Introduction to Deep Reinforcement Learning in JAX" (2023) written for this repository. Ours
trains at the article's settings: MLP 64-64-64, batch 32, buffer 512, one update per env step
from the first step, target copy every 10 steps, gamma 0.9, Adam 1e-3 without annealing,
plain DQN, no LayerNorm; it keeps its Huber loss and gradient clipping, which cost next to
nothing. The yardstick runs `jit(vmap)` on one device, as written; ours runs the script's own
sharded `jit(vmap)` over 2 CPU devices, and over 1 for reference. Compile time is left out of
both; ours includes one final greedy evaluation (1 episode, <= 500 steps). Every run is its
own process, so that XLA_FLAGS can differ, and the three alternate, so that a machine that
slows down for a while slows all of them. Prints each run, the medians and the ratios.
"""

import dataclasses
import os
import re
import statistics
import sys
from pathlib import Path

import cli  # next to this file: the benchmarks' flags

HERE = Path(__file__).resolve().parent
YARDSTICK = HERE / "article_dqn.py"


def article_run(timesteps: int, num_agents: int):
    """dqn_cartpole.py at the article's settings -> (module, config, env, network, plan); a size
    the DQN refuses (its memory check too) is one line naming our flags."""
    sys.path.insert(0, str(HERE.parent))
    import dqn_cartpole as dqn

    env = dqn.CartPole()
    try:
        config = dataclasses.replace(
            dqn.Config(), total_timesteps=timesteps, eval_every=timesteps, num_seeds=num_agents,
            **cli.ARTICLE_DQN,
        )  # fmt: skip
        dqn.check_sizes(config)
        network = dqn.QNetwork(config.hidden_sizes, env.num_actions, config.layer_norm)
        plan = dqn.check_memory(*dqn.memory_need(config, env, network), num_agents)
    except (ValueError, MemoryError) as error:
        cli.fail(f"--num-agents {num_agents}, --timesteps {timesteps}: the DQN's {error}")
    if plan.padded_seeds != num_agents:  # it would train more agents than it is credited with
        cli.fail(
            f"--num-agents {num_agents}: ours trains whole batches, {plan.padded_seeds} agents "
            f"on {plan.num_devices} device(s), and the yardstick {num_agents}: give "
            f"{plan.padded_seeds}, or another count that needs no padding"
        )
    return dqn, config, env, network, plan


def train_ours(timesteps: int, num_agents: int) -> None:
    """One timed run of dqn_cartpole.py at the article's settings; prints steps_per_s=..."""
    dqn, config, env, network, plan = article_run(timesteps, num_agents)
    grid = dqn.hparam_grid([config.hparams()._asdict()])
    timings = {}
    for _ in dqn.train_agents(config, env, network, 0, grid, plan, timings=timings):
        pass  # one evaluation block: one compiled call
    train_s = timings["train_time_s"]
    print(
        f"ours steps_per_s={timesteps * num_agents / train_s:.0f} devices={plan.num_devices} "
        f"compile_s={timings['compile_time_s']:.1f} seconds={train_s:.3f}"
    )


def timed(command: list[str], devices: int, one_core: bool) -> tuple[float, str]:
    """Run one side in a fresh process on `devices` CPU devices, on one core only if
    `one_core` (Linux); (steps per s, its line)."""
    flags = f"--xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    # Pinned by this process's own affinity, which the child inherits: a preexec_fn would fork
    # this process, JAX's threads and all (JAX warns of a deadlock).
    cores = os.sched_getaffinity(0) if one_core else None
    if one_core:
        os.sched_setaffinity(0, {min(cores)})
    try:
        result = cli.captured(command, env=env)
    finally:
        if one_core:
            os.sched_setaffinity(0, cores)
    lines = [line for line in result.stdout.splitlines() if "steps_per_s=" in line]
    if result.returncode or not lines:
        cli.failed(result)
    return float(re.search(r"steps_per_s=([\d.]+)", lines[-1]).group(1)), lines[-1]


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--timesteps", type=cli.count, default=5_000, help="environment steps")
    parser.add_argument("--num-agents", type=cli.count, default=64, help="agents trained at once")
    parser.add_argument("--repeats", type=cli.count, default=3, help="alternating rounds; medians")
    parser.add_argument("--one-core", action="store_true", help="also both sides on one core")
    ours_help = "only ours, once, at the given size, in this process (as each measured run starts)"
    parser.add_argument("--ours", action="store_true", help=ours_help)
    args = parser.parse_args()
    parser.set_defaults(repeats=None, one_core=None)  # parsed again: None for a flag left out
    given = parser.parse_args()
    if args.ours and (given.repeats, given.one_core) != (None, None):
        parser.error("--ours runs once, in this process; leave out --repeats and --one-core")
    size = ["--timesteps", str(args.timesteps), "--num-agents", str(args.num_agents)]
    if args.ours:
        return train_ours(args.timesteps, args.num_agents)
    # A size ours refuses: one line before any run. Checked for 2 CPU devices, as ours runs there.
    os.environ |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    article_run(args.timesteps, args.num_agents)

    yardstick, ours = [sys.executable, str(YARDSTICK), *size], [sys.executable, __file__, "--ours"]
    sides = {  # name: (command, devices, on one core)
        "yardstick": (yardstick, 1, False),
        "ours on 2 devices": ([*ours, *size], 2, False),
        "ours on 1 device": ([*ours, *size], 1, False),
    }
    # One device still runs some of XLA's work on the other core: pinned, it gets one core.
    if args.one_core and hasattr(os, "sched_setaffinity"):
        sides["yardstick on 1 core"] = (yardstick, 1, True)
        sides["ours on 1 device, 1 core"] = ([*ours, *size], 1, True)
    speeds = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name, (command, devices, one_core) in sides.items():
            speed, line = timed(command, devices, one_core)
            speeds[name].append(speed)
            print(f"round {repeat + 1}/{args.repeats}, {name}: {line}", flush=True)
    median = {name: statistics.median(speeds[name]) for name in sides}
    print("medians (agent-steps/s): " + ", ".join(f"{n} {v:.0f}" for n, v in median.items()))
    base = median["yardstick"]
    print(
        f"speed-up vs yardstick: {median['ours on 2 devices'] / base:.2f}x sharded over 2 CPU "
        f"devices, {median['ours on 1 device'] / base:.2f}x on 1 device"
    )
    if "yardstick on 1 core" in median:
        base = median["yardstick on 1 core"]
        print(
            f"on one core each: ours {median['ours on 1 device, 1 core'] / base:.2f}x the "
            f"yardstick; ours on 2 devices {median['ours on 2 devices'] / base:.2f}x the "
            "yardstick on 1 core"
        )


if __name__ == "__main__":
    cli.run(main)
