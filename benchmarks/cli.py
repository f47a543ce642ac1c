"""What the benchmarks' command lines share: counts that must be at least 1, and a bad one is
one line naming its flag (as in the three scripts), not a traceback after minutes of runs."""

import argparse
import sys


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
