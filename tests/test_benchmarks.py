"""The benchmarks' command lines (their runs at a tiny size are tested beside each script)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
BAD = {  # benchmark and arguments: the flag its one line must name
    "dqn_cartpole.py --repeats 0": "--repeats",
    "dqn_segments.py --seeds 0": "--seeds",
    "dqn_sweep.py --timesteps -5": "--timesteps",
    "dqn_sweep.py --timesteps 1 --repeats 1": "--train-frequency",  # the DQN's line (it was exit 1)
    "dqn_time_split.py --agents 0": "--agents",
    "q_learning_gridworld.py --timesteps x": "--timesteps",
    # beyond the script's int32: named once (it was "--timesteps: --total-timesteps must be")
    "q_learning_gridworld.py --timesteps 3000000000": "error: --timesteps must be in [1, 2^31)",
    "article_q_learning.py --timesteps 0": "--timesteps",
    "article_q_learning.py --num-agents -1": "--num-agents",
    "article_dqn.py --timesteps 0": "--timesteps",  # it printed steps_per_s=0, exit 0
    "article_dqn.py --num-agents -1": "--num-agents",
    "two_processes.py parallel_q_learning.py --repeats 0": "--repeats",
    # The script's own line (it was two lines, the second the script's, exit 1)
    "two_processes.py parallel_q_learning.py --repeats 1 --num-seeds 0": "--num-seeds",
    "two_processes.py parallel_q_learning.py --output-dir x": "--output-dir",  # was overridden
    # It timed one layout, then a traceback: --load writes no summary.json to read a rate from
    "two_processes.py dqn_cartpole.py --load x": "which --load does not run",
    "two_processes.py dqn_cartpole.py --resume=x": "which --resume=x does not run",
    # ours refuses first, by its own check (it was a memory refusal: a large machine ran it)
    "dqn_cartpole.py --timesteps 2147483648 --repeats 1": "--total-timesteps must be below 2^31",
    "dqn_segments.py --seeds 2147483648 --timesteps 600 --repeats 1": "seeds must be below 2^31",
    # Refused before allocating (8 GB of keys, then a traceback or the machine's memory gone)
    "article_q_learning.py --timesteps 100 --num-agents 1000000000": "--num-agents",
    "article_dqn.py --timesteps 100 --num-agents 1000000000": "--num-agents",
    # More agents than JAX's shapes hold (a C++ abort, exit 134; a traceback at 2^63)
    "article_q_learning.py --timesteps 100 --num-agents 10000000000000000": "from 0 to 2^31 - 1",
    "article_dqn.py --timesteps 100 --num-agents 9223372036854775808": "from 0 to 2^31 - 1",
    # The DQN's refusals, as one line naming our flags (each was a traceback)
    "dqn_segments.py --seeds 2 --timesteps 1 --repeats 1": "--timesteps",
    "dqn_segments.py --seeds 10000000 --timesteps 600 --repeats 1": "--seeds",  # it ran
    "dqn_cartpole.py --ours --num-agents 10000000 --timesteps 600": "--num-agents",
    # Ours pads to whole batches (64 on the session's 2 devices): it trained 64, credited 4
    "dqn_cartpole.py --num-agents 4 --timesteps 500 --repeats 1": "give 64",
    "dqn_cartpole.py --num-agents 10000000 --timesteps 600 --repeats 1": "--num-agents",
    "dqn_time_split.py --agents 2 --steps 3000000000": "--steps",
    # A flag that the other given one ignores (both ran, as if it were not there)
    "dqn_cartpole.py --ours --repeats 2": "--repeats",
    "dqn_time_split.py --profile --repeats 2": "--repeats",
    # A folder no file can be made in, though os.access says root may (it measured, then failed;
    # not root: os.access refuses it)
    "parallel_q_learning.py --max-agents 4 --agent-steps 4000 --numpy-steps 200 --repeats 1 "
    "--yardstick-timesteps 100 --yardstick-agents 4 --output-dir /proc": "--output-dir",
    "parallel_q_learning.py --agent-steps 100000000000000000": "--agent-steps",  # int32 steps
    # In range, but not in whole blocks: the line blamed "got 2147490000", not the value given
    "parallel_q_learning.py --agent-steps 2147483647": "in whole blocks of 10,000 steps it makes",
    "parallel_q_learning.py --max-agents 1": "--max-agents",  # below the session's 2 devices
    # A folder that holds files (benchmark.json was replaced), and y/../{time} (y was left)
    f"parallel_q_learning.py --output-dir {BENCHMARKS}": "--output-dir",
    "parallel_q_learning.py --output-dir y/../{time}": "--output-dir",
    "parallel_q_learning.py --output-dir=": "--output-dir must not be empty",  # "holds files"
}


def test_an_output_dir_through_a_loop_of_links_is_one_line(tmp_path):
    """It was two chained tracebacks: removing the folder the refused run had made resolved the
    path, and Path.resolve raises on a loop of symbolic links."""
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    argv = ["--max-agents", "4", "--agent-steps", "4000", "--numpy-steps", "200", "--repeats", "1"]
    argv += ["--yardstick-timesteps", "100", "--output-dir", str(tmp_path / "a")]
    command = [sys.executable, str(BENCHMARKS / "parallel_q_learning.py"), *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--output-dir" in lines[0], done.stderr


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
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
    try:
        for command, run in runs.items():
            out, err = run.communicate(timeout=120)
            lines = err.strip().splitlines()
            one_line = run.returncode == 2 and len(lines) == 1 and BAD[command] in lines[0]
            assert one_line and not out, (command, err, out)
    finally:  # one that failed to refuse: the others, which may be measuring, end with it
        for run in runs.values():
            with contextlib.suppress(ProcessLookupError):  # its group, yardsticks included
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def test_a_bad_flag_with_stderr_closed_prints_nothing():
    """Started with 2>&-, the one line went to stdout (print with sys.stderr None)."""
    command = [sys.executable, str(BENCHMARKS / "article_q_learning.py"), "--timesteps", "0"]
    closed = ["sh", "-c", 'exec "$@" 2>&-', "sh", *command]
    run = subprocess.run(closed, stdout=subprocess.PIPE, text=True, timeout=120, check=False)
    assert run.returncode == 2 and run.stdout == "", run.stdout


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


def sigint_blocked(pid: int) -> bool:
    """Whether process `pid` holds Ctrl-C blocked (Linux: SigBlk in /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


GRIDWORLD = ["q_learning_gridworld.py", "--timesteps", "2000000", "--repeats", "1"]
TWO_PROCESSES = ["two_processes.py", "parallel_q_learning.py", "--repeats", "1"]
TWO_PROCESSES += ["--num-seeds", "2", "--total-timesteps", "20000000"]  # trains for a while


@pytest.mark.parametrize(
    "argv, when, signum, to",
    [
        (GRIDWORLD, sigint_blocked, signal.SIGINT, "group"),
        (GRIDWORLD, children, signal.SIGINT, "group"),
        (GRIDWORLD, children, signal.SIGINT, "child"),
        (GRIDWORLD, children, signal.SIGTERM, "benchmark"),
        (TWO_PROCESSES, children, signal.SIGHUP, "benchmark"),
    ],
    ids=[
        "ctrl-c while jax loads",
        "ctrl-c to the yardstick too",
        "ctrl-c to the yardstick first",
        "sigterm",
        "sighup",
    ],
)
def test_a_stop_is_one_line(argv, when, signum, to):
    """Ctrl-C to a benchmark's process group, as a terminal sends it, or SIGTERM or SIGHUP to
    the benchmark alone, as `kill` or a closed terminal does: one line, exit 128 + the signal, no
    traceback (a Ctrl-C was Python's traceback from wherever it landed; SIGTERM and SIGHUP ended
    it silently and left the yardstick or the scripts it runs going). While the imports load
    jax the signal waits for the handler; the subprocesses a benchmark runs end with it, also
    one that the signal caught as it started (it was left running, in most tries). A group's
    Ctrl-C can end the yardstick before the benchmark's own handler runs (the yardstick's end
    was then reported as its failure, exit 1): the yardstick's alone stops the benchmark too."""
    command = [sys.executable, str(BENCHMARKS / argv[0]), *argv[1:]]
    pipe = subprocess.PIPE
    process = subprocess.Popen(command, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not when(process.pid) and process.poll() is None and time.monotonic() < deadline:
        pass  # no sleep: the signal lands as a child starts, in subprocess.Popen, often
    assert process.poll() is None, process.communicate()
    running = children(process.pid)
    if to == "group":
        os.killpg(process.pid, signum)
    else:
        os.kill(running[0] if to == "child" else process.pid, signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, (out, err)
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}[signum]
    assert err.strip().splitlines() == [f"benchmarks/{argv[0]}: stopped by {name}"], err
    assert not [child for child in running if Path(f"/proc/{child}").exists()], running


def test_a_benchmark_killed_takes_its_children_with_it():
    """SIGKILL (the OOM killer, `timeout -s KILL`), which no handler sees: the yardstick or script
    that the benchmark was running went on alone (a cluster's child wrote a whole run into a
    temporary folder that nothing removed). Linux kills them now (PR_SET_PDEATHSIG)."""
    command = [sys.executable, str(BENCHMARKS / GRIDWORLD[0]), *GRIDWORLD[1:]]
    devnull = subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=devnull, stderr=devnull, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (running := children(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # the child has run its own imports a while
    process.kill()
    process.wait()
    deadline = time.monotonic() + 5  # left alone, the child ran on for 10 s or more
    while any(Path(f"/proc/{child}").exists() for child in running):
        assert time.monotonic() < deadline, running
        time.sleep(0.05)
    assert running


def test_ctrl_c_stops_a_benchmark_that_runs_the_dqn_in_process():
    """dqn_sweep.py runs dqn_cartpole.main() in this process: a Ctrl-C ends the benchmark at
    once, one line, exit 130 (the DQN's own stop waited for the block to end, which is the whole
    run here, wrote that temporary run, and then exited 1 with the DQN's line)."""
    argv = [str(BENCHMARKS / "dqn_sweep.py"), "--seeds", "1", "--timesteps", "2000"]
    pipe = subprocess.PIPE
    process = subprocess.Popen([sys.executable, *argv, "--repeats", "2"], stdout=pipe,
                               stderr=pipe, text=True, start_new_session=True)  # fmt: skip
    first = process.stdout.readline()  # round 1's first side: the second side trains now
    assert first.startswith("round 1/2"), (first, process.communicate())
    time.sleep(1)
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["benchmarks/dqn_sweep.py: stopped by Ctrl-C"], err


def test_a_signal_after_the_benchmark_has_ended_has_its_default_effect(tmp_path):
    """Once main() has returned (JAX's atexit clean-up runs for about half a second), a SIGTERM
    ends the process as it would without handlers: it raised in the atexit callback, where
    Python printed it, and the resend that followed killed the process with SIGALRM."""
    script = tmp_path / "ended.py"
    script.write_text(
        f"import atexit, sys, time\nsys.path.insert(0, {str(BENCHMARKS)!r})\nimport cli\n"
        "atexit.register(lambda: (print('exiting', flush=True), time.sleep(30)))\n"
        "cli.run(lambda: None)\n"
    )
    pipe = subprocess.PIPE
    process = subprocess.Popen([sys.executable, str(script)], stdout=pipe, stderr=pipe, text=True)
    assert process.stdout.readline() == "exiting\n", process.communicate()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=20)
    assert process.returncode == -signal.SIGTERM and not err, (process.returncode, err)


def test_a_signal_whose_exception_was_dropped_still_stops_a_benchmark(tmp_path):
    """C code that clears errors drops the exception a signal's handler raised while it ran
    (JAX's first import of its MLIR dialects does): the benchmark went on to its end, exit 0.
    Now it ends with the signal's one line, exit 143. Here main() drops it itself."""
    script = tmp_path / "dropped.py"
    script.write_text(
        f"import os, signal, sys\nsys.path.insert(0, {str(BENCHMARKS)!r})\nimport cli\n\n\n"
        "def main():\n    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    except BaseException:\n        pass\n    print('ended', flush=True)\n\n\n"
        "cli.run(main)\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.stdout == "ended\n" and result.returncode == 128 + signal.SIGTERM, result
    err = result.stderr.strip().splitlines()
    assert err == ["benchmarks/dropped.py: stopped by SIGTERM"], result


IN_PROCESS = ["article_dqn.py", "article_q_learning.py", "dqn_segments.py", "dqn_time_split.py",
              "parallel_q_learning.py", "q_learning_gridworld.py"]  # fmt: skip


def test_a_jax_setting_this_machine_cannot_run_is_one_line():
    """The benchmarks that run JAX in their own process, under a platform JAX cannot start, no
    CPU device, or JAX_DISABLE_JIT: a traceback (or runs that never ended, uncompiled), where
    the scripts say it in one line. Now they do too, naming the setting, before any run."""
    settings = {
        "JAX_PLATFORMS": "nosuchplatform",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=0",
        "JAX_DISABLE_JIT": "1",
    }
    runs = {}
    for script in IN_PROCESS:
        for name, value in settings.items():
            runs[script, name] = subprocess.Popen(
                [sys.executable, str(BENCHMARKS / script)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, name: value}, start_new_session=True,
            )  # fmt: skip
    try:
        for (script, name), run in runs.items():
            out, err = run.communicate(timeout=120)
            lines = err.strip().splitlines()
            one_line = run.returncode == 2 and len(lines) == 1 and f"{name}" in lines[0]
            assert one_line and lines[0].startswith(f"benchmarks/{script}: error: "), (name, err)
    finally:  # one that went on to measure ends with the test
        for run in runs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)


def test_a_closed_stdout_does_not_stop_a_benchmark():
    """Its reader gone (`| head -1`): the lines go nowhere, the benchmark runs to its end, exit
    0, where the first print ended it with a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    argv = [sys.executable, str(BENCHMARKS / "article_q_learning.py"), "--timesteps", "1000"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the print itself fails, not the exit's flush
    run = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, env=env)
    os.close(write)
    assert run.returncode == 0 and not run.stderr, (run.returncode, run.stderr)


def test_the_yardsticks_memory_is_the_tightest_cgroups_limit(fake_cgroups, monkeypatch, capsys):
    """A yardstick refuses agents that need more than half the memory: in a container or a Slurm
    job (--mem), half the cgroup's limit, not of the machine's RAM."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cli

    assert cli.cgroup_limit(*fake_cgroups) == 5 * 2**30  # v1's job, below v2's 6 GiB
    cli.check_fits(2**29 + 1, "--num-agents")  # half a GiB and a byte: this machine's RAM holds it
    monkeypatch.setattr(cli, "cgroup_limit", lambda: 2**30)
    with pytest.raises(SystemExit) as exit_info:
        cli.check_fits(2**29 + 1, "--num-agents")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--num-agents: about 0.5 GiB" in err[0]


def test_agents_whose_outputs_cannot_fit_are_refused_before_compiling(monkeypatch, capsys):
    """On an H200, the yardstick's 10^9 agents (1.5 TB of Q-tables) were compiled before the
    check, and XLA's GPU compiler logged two error lines of its own above the refusal. Arguments
    and outputs are now counted from their shapes first; temporaries after compiling."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cli
    import jax
    import jax.numpy as jnp

    lowered = []

    class Jitted:  # a jitted function that records each compile
        def __init__(self, size):
            self.jitted = jax.jit(lambda key: jnp.zeros(size) + jax.random.uniform(key))

        def __call__(self, key):
            return self.jitted(key)

        def lower(self, key):
            lowered.append(key)
            return self.jitted.lower(key)

    key = jax.random.key(0)
    with pytest.raises(SystemExit) as exit_info:
        cli.compile_if_fits(Jitted(2**45), key, "--num-agents")  # 128 TiB of float32
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--num-agents: about" in err[0], err
    assert not lowered
    compiled = cli.compile_if_fits(Jitted(3), key, "--num-agents")
    assert lowered and compiled(key).shape == (3,)
