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


def check_device(name: str) -> None:
    """UsageError unless `name` is a torch device this machine has."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available on this machine (use --device cpu)")


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
