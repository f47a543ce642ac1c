r"""One process with 2 CPU devices against 2 processes with 1 each (one JAX cluster), side by side.

    .venv/bin/python benchmarks/two_processes.py dqn_cartpole.py --num-seeds 128 \
        --total-timesteps 20000
    .venv/bin/python benchmarks/two_processes.py parallel_q_learning.py --num-seeds 4096
    .venv/bin/python benchmarks/two_processes.py parallel_q_learning.py --repeats 1 \
        --num-seeds 4 --total-timesteps 1000

The script's own arguments follow its name. The two layouts alternate, so that a machine that
slows down for a while slows both; each run is a fresh process (or two), and the medians of the
training rate (the compiled call alone, as the script prints it) and of the wall time are
printed, with their ratios. The 2-process runs use the script's --coordinator-address,
--num-processes and --process-id on 127.0.0.1, as README's "More than one machine" shows.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cli  # next to this file: the benchmarks' flags

ROOT = Path(__file__).resolve().parent.parent
OURS = ("--output-dir", "--coordinator-address", "--num-processes", "--process-id")
NOT_TRAINING = ("--load", "--resume", "--replot")  # the script's modes that time no training


def abbreviates(arg: str, flags: tuple[str, ...]) -> bool:
    """Whether `arg` is one of `flags`, or an abbreviation of one that argparse would take."""
    name = arg.split("=")[0]
    return name.startswith("--") and len(name) > 2 and any(f.startswith(name) for f in flags)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(script: str, args: list[str], processes: int, output: str) -> tuple[float, float]:
    """One run on `processes` processes of 2 // processes CPU devices -> (agent-steps/s, wall s)."""
    flags = f"--xla_force_host_platform_device_count={2 // processes}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(ROOT / script), *args, "--output-dir", output]
    if processes > 1:
        command += ["--coordinator-address", f"127.0.0.1:{free_port()}"]
        command += ["--num-processes", str(processes)]
    start = time.perf_counter()
    commands = [
        command + (["--process-id", str(i)] if processes > 1 else []) for i in range(processes)
    ]
    pipe = subprocess.PIPE
    with cli.started(commands, stdout=pipe, stderr=pipe, text=True, env=env) as children:
        results = [child.communicate() for child in children]
    wall = time.perf_counter() - start
    for command, child, (out, err) in zip(commands, children, results, strict=True):
        if child.returncode:
            cli.failed(subprocess.CompletedProcess(command, child.returncode, out, err))
    # The run's own rate, unrounded (the parallel script prints "0.0M agent-steps/s" for a small
    # one, which read as 0 and ended in a ZeroDivisionError).
    summary = json.loads((Path(output) / "summary.json").read_text())
    return summary["agent_steps_per_s"], wall


def main() -> None:
    parser = cli.parser(__doc__)
    script_help = "the script to run; its own arguments follow its name"
    parser.add_argument("script", choices=["dqn_cartpole.py", "parallel_q_learning.py"],
                        help=script_help)  # fmt: skip
    parser.add_argument("--repeats", type=cli.count, default=3, help="alternating rounds; medians")
    known, script_args = parser.parse_known_args()
    for arg in script_args:
        if abbreviates(arg, OURS):  # set for each layout
            cli.fail(
                f"the script's {', '.join(OURS)} are set here, for each layout; leave out {arg}"
            )
        if abbreviates(arg, NOT_TRAINING):
            cli.fail(f"this times training, which {arg} does not run; leave it out")
    layouts = {"1 process x 2 devices": 1, "2 processes x 1 device": 2}
    rates = {name: [] for name in layouts}
    walls = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(known.repeats):
            for name, processes in layouts.items():
                output = os.path.join(folder, f"{processes}_{repeat}")
                rate, wall = run(known.script, script_args, processes, output)
                rates[name].append(rate)
                walls[name].append(wall)
                print(f"round {repeat + 1}/{known.repeats}, {name}: {rate:,.0f} agent-steps/s, "
                      f"wall {wall:.1f} s", flush=True)  # fmt: skip
    one, two = (statistics.median(rates[name]) for name in layouts)
    one_wall, two_wall = (statistics.median(walls[name]) for name in layouts)
    print(
        f"medians: 1 process {one:,.0f} agent-steps/s, wall {one_wall:.1f} s; "
        f"2 processes {two:,.0f} agent-steps/s, wall {two_wall:.1f} s"
    )
    ratios = f"training rate {two / one:.2f}x, wall {two_wall / one_wall:.2f}x"
    print(f"2 processes / 1 process: {ratios}")


if __name__ == "__main__":
    cli.run(main)
