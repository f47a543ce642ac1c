"""What the benchmarks' command lines share: counts that must be at least 1, and a bad one is
one line naming its flag (as in the three scripts), not a traceback after minutes of runs; and
a Ctrl-C that is one line, exit 130, wherever it lands (run)."""

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

# A benchmark run as a script (not a module imported by a test or a notebook): a Ctrl-C while
# the imports after this one load jax waits for run(), as in the three scripts. One that was
# ignored (a job started with & by a script) stays ignored.
MAIN_FILE = getattr(sys.modules["__main__"], "__file__", None)
if MAIN_FILE and Path(MAIN_FILE).resolve().parent == Path(__file__).resolve().parent:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def run(main: Callable[[], None]) -> None:
    """main(), a Ctrl-C one line and exit 130 instead of a traceback. A terminal's Ctrl-C
    reaches the yardstick or script it runs as a subprocess too (the same process group), and
    subprocess.run ends that one."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one that came raises here
        main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not cut this line
        print(f"{Path(sys.argv[0]).name}: stopped by Ctrl-C", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)  # now: not after the compiled call still running in the background


def parser(doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first line of `doc`; its errors are one line, exit 2."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])

    def error(message: str):
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = error
    return parser


def count(text: str) -> int:
    """A whole number, at least 1: argparse's type for --repeats, --timesteps and the like."""
    value = int(text)  # not a number: argparse says "invalid count value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
