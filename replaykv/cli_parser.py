"""The argument parser every `replaykv` subcommand uses: a usage error is one line on stderr,
``error: <what is wrong, naming the argument> (see `PROG --help`)``, and exit status 2.

Not for: parsing itself (each entry point declares its own arguments).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class UsageError(Exception):
    """A command-line value that is well-formed but unusable; the message names the argument."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (argparse prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def usage_error(message: str) -> int:
    """Print `message` as the one ``error:`` line and return exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def whole_number(text: str) -> int:
    """argparse type: an integer ≥ 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
