"""Speed of q_learning_gridworld.py against the article-style yardstick, side by side.

    .venv/bin/python benchmarks/q_learning_gridworld.py                  # 1M steps, 3 repeats
    .venv/bin/python benchmarks/q_learning_gridworld.py --timesteps 20000 --repeats 1  # quick

Both train ONE agent on the default 8x12 map for the same number of steps, compile excluded.
The yardstick, article_q_learning.py beside this file (the approach of the article it
names), runs in its own process and prints its own steps/s; ours is
`jax.jit(make_train(config))`, timed here. The two alternate, `--repeats` times each, so that
a busy machine slows both alike; the medians and their ratio are printed. Absolute numbers
depend on the machine; the ratio is the figure to quote.
"""

import re
import statistics
import sys
import time
from pathlib import Path

import cli  # next to this file: the benchmarks' flags

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the scripts live at the repository root

import jax  # noqa: E402

import q_learning_gridworld as qlg  # noqa: E402

YARDSTICK = HERE / "article_q_learning.py"
RUNS_PER_REPEAT = 5  # timed calls of our compiled train per repeat: each is short


def yardstick_steps_per_s(timesteps: int) -> float:
    command = [sys.executable, str(YARDSTICK), "--timesteps", str(timesteps)]
    result = cli.captured(command)
    if result.returncode != 0:
        cli.failed(result)
    return float(re.search(r"steps_per_s=([0-9.]+)", result.stdout).group(1))


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--timesteps", type=cli.count, default=1_000_000, help="steps per run")
    parser.add_argument(
        "--repeats", type=cli.count, default=3, help="yardstick runs (ours: 5 each)"
    )
    args = parser.parse_args()

    try:  # the script's default block: a shorter last one takes what is left
        config = qlg.Config(total_timesteps=args.timesteps)
    except ValueError as error:  # the script's own limits, under this command's flag
        parser.error(str(error).replace("--total-timesteps", "--timesteps"))  # one flag named
    cli.check_backend()
    train = jax.jit(qlg.make_train(config))
    key = jax.random.key(0)
    start = time.perf_counter()
    jax.block_until_ready(train(key))  # compile and warm up
    print(f"ours: compile + first run {time.perf_counter() - start:.2f} s")

    yardstick, ours = [], []
    for repeat in range(args.repeats):
        yardstick.append(yardstick_steps_per_s(args.timesteps))
        for run in range(RUNS_PER_REPEAT):
            run_key = jax.random.fold_in(key, repeat * RUNS_PER_REPEAT + run)
            start = time.perf_counter()
            jax.block_until_ready(train(run_key))
            ours.append(args.timesteps / (time.perf_counter() - start))
        print(
            f"repeat {repeat + 1}/{args.repeats}: yardstick {yardstick[-1] / 1e6:.2f}M "
            f"steps/s, ours {statistics.median(ours[-RUNS_PER_REPEAT:]) / 1e6:.1f}M steps/s"
        )

    slow, fast = statistics.median(yardstick), statistics.median(ours)
    print(f"yardstick ({YARDSTICK.name}): {slow / 1e6:.2f}M steps/s (median)")
    print(f"q_learning_gridworld.py, one agent: {fast / 1e6:.2f}M steps/s (median)")
    print(
        f"ratio: {fast / slow:.0f}x  ({args.timesteps} steps in blocks of "
        f"{min(config.steps_per_block, args.timesteps)}, one agent, compile excluded, "
        f"jax {jax.__version__}, {jax.devices()[0].device_kind})"
    )


if __name__ == "__main__":
    cli.run(main)
