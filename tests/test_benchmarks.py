"""The benchmarks' command lines (their runs at a tiny size are tested beside each script)."""

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
BAD = {  # benchmark and arguments: the flag its one line must name
    "dqn_cartpole.py --repeats 0": "--repeats",
    "dqn_segments.py --seeds 0": "--seeds",
    "dqn_sweep.py --timesteps -5": "--timesteps",
    "dqn_time_split.py --agents 0": "--agents",
    "q_learning_gridworld.py --timesteps x": "--timesteps",
    "q_learning_gridworld.py --timesteps 3000000000": "--timesteps",  # beyond the script's int32
    "article_q_learning.py --timesteps 0": "--timesteps",
    "article_q_learning.py --num-agents -1": "--num-agents",
    "article_dqn.py --timesteps 0": "--timesteps",  # it printed steps_per_s=0, exit 0
    "article_dqn.py --num-agents -1": "--num-agents",
    "two_processes.py parallel_q_learning.py --repeats 0": "--repeats",
    "parallel_q_learning.py --agent-steps 100000000000000000": "--agent-steps",  # int32 steps
    "parallel_q_learning.py --max-agents 1": "--max-agents",  # below the session's 2 devices
}


def test_a_bad_count_is_one_line_naming_its_flag():
    """A count below 1 (or not a number) used to end in a traceback after the runs (a median
    of nothing), or in meaningless numbers; now one line, exit 2, before any run. They run side
    by side: each pays for importing jax, and nothing more."""
    runs = {}
    for command in BAD:
        if "--max-agents 1" in command and os.environ.get("JAX_PLATFORMS", "cpu") != "cpu":
            continue  # a session on one GPU: one agent is a run, which it would start
        script, *argv = command.split()
        runs[command] = subprocess.Popen(
            [sys.executable, str(BENCHMARKS / script), *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    for command, run in runs.items():
        out, err = run.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and BAD[command] in lines[0], (command, err)
        assert not out, (command, out)


def test_a_yardstick_that_cannot_run_is_one_line_before_ours_compile(tmp_path):
    """Too many agents for the article-style yardstick (80 GB of keys): one line naming the flag,
    not its traceback after our measurements compiled, and no empty output folder left."""
    output = tmp_path / "bench"
    argv = ["--max-agents", "4", "--agent-steps", "1000", "--numpy-steps", "100", "--repeats", "1"]
    argv += ["--yardstick-timesteps", "100", "--yardstick-agents", str(10**10)]
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "parallel_q_learning.py"), *argv, "--output-dir",
         str(output)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "--yardstick-agents" in lines[0], lines
    assert "compiling" not in run.stdout and not output.exists()
