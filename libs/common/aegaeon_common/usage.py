"""Command-line mistakes in one line: the project's argparse parser.

argparse answers a bad argument with its whole usage and then the error; with
many options the line that matters scrolls away. Every ``aegaeon`` command (and
every script's own parser) answers with one line on stderr naming what is wrong,
and exit code 2; ``--help`` still shows the usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (its subparsers are too: argparse
    makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text} (see {self.prog} --help)\n")


def fail(prog: str, problem: object) -> int:
    """Say ``problem`` in one line on stderr, after ``prog``; the exit code (2)."""
    print(f"{prog}: {' '.join(str(problem).split())}", file=sys.stderr)
    return 2


def parsed_by(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type that reads its text with ``parse``, whose ValueError is the one-line
    error (argparse would say only that the value is invalid)."""

    def read(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def at_least_one(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    return _whole_number(text, 1)


def at_least_zero(text: str) -> int:
    """An argparse type: a whole number >= 0 (a count that may be none)."""
    return _whole_number(text, 0)


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 (and finite), got {text}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value
