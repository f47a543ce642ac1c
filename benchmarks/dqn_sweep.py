"""What a sweep costs: a grid of G points x N seeds against one configuration with G x N seeds.

    .venv/bin/python benchmarks/dqn_sweep.py                  # G = 4, N = 32, 10k steps, 3 rounds
    .venv/bin/python benchmarks/dqn_sweep.py --seeds 1 --timesteps 200 --repeats 1

Both sides run dqn_cartpole.py's own main() with its defaults otherwise and the same number of
agents, 4 N: the sweep is 2 learning rates x 2 discount factors x N seeds in one compiled call,
the single configuration --num-seeds 4N. Each run compiles afresh, as a new command does; the
two alternate, so that a machine that slows down for a while slows both. Training time
(compile left out) comes from the run's summary.json; end to end is main()'s wall time from
parsing to the written summary, compile and figure included (the interpreter and jax's import,
the same on both sides, left out). Prints each run, the medians and the ratios.
"""

import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import cli  # next to this file: the benchmarks' flags

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dqn_cartpole as dqn  # noqa: E402  (found next to this folder, from a clone)

GRID = ["--learning-rate", "1e-3,2.5e-3", "--gamma", "0.99,0.995"]  # 4 grid points


def timed(argv: list[str], output: Path) -> tuple[float, float]:
    """One quiet run of dqn_cartpole.main; (training s, end-to-end s). It takes no signal for
    itself (its stop-and-save on Ctrl-C): the run is temporary, and a Ctrl-C ends the benchmark."""
    start, quiet = time.perf_counter(), io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(quiet),
            mock.patch.object(dqn, "catchable", lambda: []),
        ):
            dqn.main([*argv, "--output-dir", str(output)])
    except SystemExit as stop:  # a size the script refuses: its own line and exit code
        if (lines := quiet.getvalue().strip().splitlines()) and sys.stderr is not None:
            print(lines[-1], file=sys.stderr)  # (None: started with 2>&-; not on stdout)
        sys.exit(stop.code)
    wall = time.perf_counter() - start
    return json.loads((output / "summary.json").read_text())["train_time_s"], wall


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--seeds", type=cli.count, default=32, help="seeds per grid point (N)")
    parser.add_argument("--timesteps", type=cli.count, default=10_000, help="environment steps")
    parser.add_argument("--repeats", type=cli.count, default=3, help="alternating rounds; medians")
    args = parser.parse_args()
    steps = ["--total-timesteps", str(args.timesteps), "--eval-every", str(args.timesteps)]
    steps += ["--learning-starts", str(min(1_000, args.timesteps // 2))]  # the default, or half
    sides = {
        f"sweep 4 x {args.seeds} seeds": [*steps, *GRID, "--num-seeds", str(args.seeds)],
        f"one config of {4 * args.seeds} seeds": [*steps, "--num-seeds", str(4 * args.seeds)],
    }
    times = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for side, (name, argv) in enumerate(sides.items()):
                train_s, wall_s = timed(argv, Path(folder) / f"{side}_{repeat}")
                times[name].append((train_s, wall_s))
                line = f"train {train_s:.2f} s, end to end {wall_s:.2f} s"
                print(f"round {repeat + 1}/{args.repeats}, {name}: {line}", flush=True)
    medians = {
        name: [statistics.median(c) for c in zip(*runs, strict=True)]
        for name, runs in times.items()
    }
    for name, (train_s, wall_s) in medians.items():
        print(f"median, {name}: train {train_s:.2f} s, end to end {wall_s:.2f} s")
    (sweep_train, sweep_wall), (one_train, one_wall) = medians.values()
    print(
        f"sweep / single: train {sweep_train / one_train:.2f}x, "
        f"end to end {sweep_wall / one_wall:.2f}x"
    )


if __name__ == "__main__":
    cli.run(main)
