"""What the benchmarks' command lines share: counts that must be at least 1, and a bad one is
one line naming its flag (as in the three scripts), not a traceback after minutes of runs; and
a Ctrl-C, SIGTERM or SIGHUP that is one line, exit 128 + the signal, wherever it lands (run).
Also the article's DQN settings, at which two benchmarks run ours (ARTICLE_DQN)."""

import argparse
import contextlib
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
# dqn_cartpole.py's Config at the yardstick's settings (benchmarks/dqn_cartpole.py says which):
# benchmarks/dqn_cartpole.py times ours there, dqn_time_split.py splits its step.
ARTICLE_DQN = {
    "hidden_sizes": (64, 64, 64), "batch_size": 32, "buffer_size": 512, "train_frequency": 1,
    "learning_starts": 0, "target_update_interval": 10, "tau": 1.0, "gamma": 0.9,
    "learning_rate": 1e-3, "anneal_lr": False, "double_dqn": False, "layer_norm": False,
    "eval_episodes": 1,
}  # fmt: skip
# The name in every line a benchmark prints about itself: benchmarks/dqn_cartpole.py is not the
# script dqn_cartpole.py.
NAME = f"benchmarks/{Path(sys.argv[0]).name}"

# A benchmark run as a script (not a module imported by a test or a notebook): a signal while
# the imports after this one load jax waits for run(), as in the three scripts. One that was
# ignored (nohup's SIGHUP, a job started with & by a script) stays ignored.
MAIN_FILE = getattr(sys.modules["__main__"], "__file__", None)
if MAIN_FILE and Path(MAIN_FILE).resolve().parent == Path(__file__).resolve().parent:
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


class Stopped(BaseException):
    """A signal, raised where it lands as Ctrl-C raises KeyboardInterrupt, so that `finally`
    and `with` run on the way out: a temporary file goes, `started` ends its subprocesses.
    args[0] is the signal. A BaseException: an `except Exception` (JAX has some) must not
    swallow it."""


RECEIVED: list[int] = []  # the signals stop() was called for


def stop(signum, frame):
    RECEIVED.append(signum)  # C code that clears errors may drop its exception: run() looks
    for other in SIGNALS:  # a second one (a process group's, a hang-up's two) must not cut the
        if signal.getsignal(other) is stop:  # way out short
            signal.signal(other, ignore)
    raise Stopped(signum)


def ignore(signum, frame):
    """A handler that does nothing. Not SIG_IGN: set while a signal is pending, Python would drop
    it with an "Exception ignored" OSError('Signal 15 ignored due to race condition')."""


def send_again(unraisable) -> None:
    """sys.unraisablehook: Python prints and drops an exception raised in a garbage-collector
    callback (JAX has one), so a stop whose handler ran there would be lost and the benchmark go
    on. The signal is sent again 10 ms later, from a timer."""
    if not isinstance(unraisable.exc_value, Stopped):
        return sys.__unraisablehook__(unraisable)
    for other in SIGNALS:
        if signal.getsignal(other) is ignore:
            signal.signal(other, stop)
    signum = unraisable.exc_value.args[0]
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signum))
    signal.setitimer(signal.ITIMER_REAL, 0.01)


class BestEffortStdout:
    """stdout, written while it can be: once it cannot (its reader left, `| head -1`; closed,
    `>&-`), its lines go to /dev/null and the benchmark runs on to write its files."""

    def __init__(self, stream):
        self.stream = stream or open(os.devnull, "w")  # noqa: SIM115  (None: closed at start)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        return self.best_effort(self.stream.write, text) or len(text)

    def flush(self) -> None:
        self.best_effort(self.stream.flush)

    def best_effort(self, method, *args):
        try:
            return method(*args)
        except OSError:  # a BrokenPipeError, say: from now on, /dev/null
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)


def run(main: Callable[[], None]) -> None:
    """main(); a Ctrl-C, SIGTERM or SIGHUP one line and exit 128 + the signal instead of a
    traceback or a silent end. A terminal's Ctrl-C reaches the yardstick or script a benchmark
    runs as a subprocess too (the same process group); a SIGTERM to the benchmark alone ends
    that one on the way out (started). Once main() has ended, a signal has its default effect."""
    sys.stdout = BestEffortStdout(sys.stdout)
    sys.unraisablehook = send_again
    for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop)
    try:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # one that came raises here
            main()
            if RECEIVED:  # its exception was dropped (JAX's first import of its MLIR dialects
                raise Stopped(RECEIVED[0])  # drops one), and main() went on to its end
        finally:  # ended or failed: one that comes from now on waits for the defaults below
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    except Stopped as stopped:
        sys.stdout.flush()
        with contextlib.suppress(OSError):  # a stderr gone: the exit status says it alone
            if sys.stderr is not None:  # None: closed from the start (2>&-)
                print(f"{NAME}: stopped by {SIGNALS[stopped.args[0]]}", file=sys.stderr, flush=True)
        os._exit(128 + stopped.args[0])  # now: not after the compiled call still running
    finally:  # not in the interpreter's shutdown (JAX's atexit): no line there, no traceback
        for signum in SIGNALS:
            if signal.getsignal(signum) in (stop, ignore):
                signal.signal(signum, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, 0)  # a signal still to be sent again is dropped
        sys.unraisablehook = sys.__unraisablehook__
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # one that came: its default effect


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A Ctrl-C, SIGTERM or SIGHUP that comes during the block (run's handlers in place) waits
    for its end, then stops the benchmark as anywhere else."""
    caught = []
    ours = [signum for signum in SIGNALS if signal.getsignal(signum) is stop]
    previous = {signum: signal.signal(signum, lambda n, _: caught.append(n)) for signum in ours}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if caught:
        signal.raise_signal(caught[0])


# Starts a command so that Linux kills it when this process dies, by SIGKILL too (the OOM killer,
# `timeout -s KILL`), which no handler sees: PR_SET_PDEATHSIG outlives exec. A preexec_fn would
# fork this process, JAX's threads and all, and run Python in the copy.
DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):  # the benchmark died before that\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


@contextlib.contextmanager
def started(commands: list[list[str]], **kwargs) -> Iterator[list[subprocess.Popen]]:
    """subprocess.Popen(command, **kwargs) of each command, ended with the block: one still
    running then (the benchmark stopped by a signal to it alone, or failed) is killed, and on
    Linux one ends with the benchmark however it ends. A stop while they start waits until each
    has started, so none is left running unseen."""
    children = []
    try:
        with held():
            for command in commands:
                if sys.platform == "linux":
                    command = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *command]
                children.append(subprocess.Popen(command, **kwargs))
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def captured(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, **kwargs), ended as started's."""
    pipe = subprocess.PIPE
    with started([command], stdout=pipe, stderr=pipe, text=True, **kwargs) as [child]:
        out, err = child.communicate()
    stop_if_stopped(child.returncode)
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def stop_if_stopped(returncode: int) -> None:
    """A child ended by Ctrl-C, SIGTERM or SIGHUP (killed by it, or its own one line and exit
    128 + it) stops the benchmark as that signal does: a terminal's Ctrl-C reaches both, and the
    child can end before this process's handler has run (which then finds stop's `ignore`)."""
    for signum in SIGNALS:
        if returncode in (-signum, 128 + signum):
            stop(signum, None)


# A message's control characters (a newline in a folder's name) shown escaped: still one line.
ESCAPED = {code: repr(chr(code))[1:-1] for code in (*range(32), 127)}


def fail(message: str, status: int = 2) -> None:
    """One line on stderr (none if it is closed: not on stdout), exit `status` (2: a bad flag)."""
    if sys.stderr is not None:  # None: started with 2>&- (print would write to stdout)
        print(f"{NAME}: error: {message.translate(ESCAPED)}", file=sys.stderr)
    sys.exit(status)


def failed(result: subprocess.CompletedProcess) -> None:
    """A yardstick or script this benchmark ran has failed: one line, its own last (a refused
    flag's line, a traceback's end), exit 2 if it refused its arguments, else 1."""
    stop_if_stopped(result.returncode)
    last = (result.stderr.strip().splitlines() or ["no message"])[-1]
    fail(f"{Path(result.args[1]).name} failed: {last}"[:300], 2 if result.returncode == 2 else 1)


def compile_if_fits(fn, shapes, flags: str):
    """`fn`, a jitted function, compiled for arguments of `shapes`, unless its arguments, outputs
    and temporaries need more than half this machine's memory: too many agents, one line naming
    `flags` before they are allocated. Arguments and outputs are counted before it compiles too:
    for a program far beyond its memory, XLA's GPU compiler logs errors of its own (an H200)."""
    import jax

    leaves = jax.tree.leaves((shapes, jax.eval_shape(fn, shapes)))
    check_fits(sum(leaf.size * leaf.dtype.itemsize for leaf in leaves), flags)
    compiled = fn.lower(shapes).compile()
    stats = compiled.memory_analysis()
    need = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    check_fits(need, flags)
    return compiled


def check_fits(need: float, flags: str) -> None:
    """One line naming `flags` unless `need` bytes fit in half of this machine's memory (the
    tightest of its RAM and its cgroups' limits)."""
    half = min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), cgroup_limit()) / 2
    if need > half:
        fail(f"{flags}: about {need / 2**30:,.1f} GiB, more than half the memory")


CGROUP_LIMITS = {"": "memory.max", "memory": "memory.limit_in_bytes"}  # cgroup v2, v1


def cgroup_limit(proc=Path("/proc/self/cgroup"), root=Path("/sys/fs/cgroup")) -> float:
    """The tightest memory limit, in bytes, of the cgroups holding this process and of their
    parents (cgroup v2 or v1); inf where none is set ("max", no such files, not Linux)."""
    limit = math.inf
    for folder, name in cgroup_folders(proc, root):
        with contextlib.suppress(OSError, ValueError):  # no such file; "max"
            limit = min(limit, int((folder / CGROUP_LIMITS[name]).read_text()))
    return limit


def cgroup_folders(proc: Path, root: Path):
    """Yields (folder, "" for cgroup v2 or "memory" for v1) of each memory cgroup holding this
    process, then of each of its parents up to the root, where a limit may be set instead."""
    try:
        lines = proc.read_text().splitlines()  # "id:controllers:/path", v2's controllers ""
    except OSError:  # not Linux
        return
    for _, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        for name in {"", "memory"} & set(controllers.split(",")):
            for folder in (PurePosixPath(path), *PurePosixPath(path).parents):
                yield root / name / str(folder).lstrip("/"), name


def check_backend() -> None:
    """One line, before any measurement, as in the three scripts: JAX_PLATFORMS naming a platform
    this machine lacks or XLA_FLAGS asking for no CPU device (a traceback at JAX's first use of a
    device), and JAX_DISABLE_JIT (the benchmarks measure compiled code). For the benchmarks that
    run JAX in their own process; JAX's plugins load here, and drop a signal's exception: held."""
    import jax

    if jax.config.jax_disable_jit:
        fail("JAX_DISABLE_JIT: the benchmarks measure compiled code; unset it")
    with held():
        try:
            jax.devices()
        except Exception as error:  # a RuntimeError, or an AssertionError for a missing cuda
            given = [f"{name}={os.environ[name]!r}" for name in ("JAX_PLATFORMS", "XLA_FLAGS")
                     if os.environ.get(name)]  # fmt: skip
            if not given:  # neither: JAX's own error, as it is
                raise
            detail = str(error).splitlines()[0][:200] if str(error) else "no platform started"
            fail(f"{', '.join(given)}: no JAX backend ({detail})")


def parser(doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first line of `doc`, defaults in --help; its errors
    are one line, exit 2."""
    parser = argparse.ArgumentParser(
        prog=NAME,
        description=doc.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.error = fail
    return parser


def count(text: str) -> int:
    """A whole number, at least 1: argparse's type for --repeats, --timesteps and the like."""
    value = int(text)  # not a number: argparse says "invalid count value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
