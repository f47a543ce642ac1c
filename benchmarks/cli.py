"""What the benchmarks' command lines share: counts that must be at least 1, and a bad one is
one line naming its flag (as in the three scripts), not a traceback after minutes of runs; and
a Ctrl-C that is one line, exit 130, wherever it lands (run)."""

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path

# Run as a benchmark (not imported by a test): a Ctrl-C while the imports after this one load
# jax waits for run(), as in the three scripts. A Ctrl-C that was ignored stays ignored.
if Path(sys.argv[0]).resolve().parent == Path(__file__).resolve().parent:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def run(main: Callable[[], None]) -> None:
    """main(), a Ctrl-C one line and exit 130 instead of a traceback. A yardstick or script it
    runs as a subprocess gets the Ctrl-C too (the same process group) and stops on its own."""
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one that came raises here
        main()
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: stopped by Ctrl-C", file=sys.stderr)
        sys.exit(130)


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
