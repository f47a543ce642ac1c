"""What the benchmarks' command lines share: counts that must be at least 1, and a bad one is
one line naming its flag (as in the three scripts), not a traceback after minutes of runs; and
a Ctrl-C, SIGTERM or SIGHUP that is one line, exit 128 + the signal, wherever it lands (run)."""

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
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
    and `with` run on the way out: a temporary file goes, subprocess.run ends its child. args[0]
    is the signal. A BaseException: an `except Exception` (JAX has some) must not swallow it."""


def stop(signum, frame):
    for other in SIGNALS:  # a second one (a process group's, a hang-up's two) must not cut the
        if signal.getsignal(other) is stop:  # way out short
            signal.signal(other, ignore)
    raise Stopped(signum)


def ignore(signum, frame):
    """A handler that does nothing. Not SIG_IGN: set while a signal is pending, Python would
    raise OSError('Signal 15 ignored due to race condition')."""


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


def run(main: Callable[[], None]) -> None:
    """main(); a Ctrl-C, SIGTERM or SIGHUP one line and exit 128 + the signal instead of a
    traceback or a silent end. A terminal's Ctrl-C reaches the yardstick or script a benchmark
    runs as a subprocess too (the same process group); a SIGTERM to the benchmark alone ends
    that one on the way out."""
    sys.unraisablehook = send_again
    for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # one that came raises here
        main()
    except Stopped as stopped:
        print(f"{NAME}: stopped by {SIGNALS[stopped.args[0]]}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + stopped.args[0])  # now: not after the compiled call still running
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)  # ended: a signal still to be sent is dropped


def fail(message: str) -> None:
    """One line, exit 2: a bad flag."""
    print(f"{NAME}: error: {message}", file=sys.stderr)
    sys.exit(2)


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
