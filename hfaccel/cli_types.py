"""The command line's argument types: each value checked as argparse reads it, so a mistake is a one-line
usage error naming the option, before any model loads."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0-65535 (0: any free one), got {value}")
    return value


def _memory(text: str) -> int | float:
    """`--kv-cache-memory`: bytes (an integer), or a fraction of the free memory in (0, 1]."""
    problem = f"expected bytes (an integer > 0) or a fraction in (0, 1], got {text!r}"
    try:
        value: int | float = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(problem) from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(problem) from None
        return value
    if value <= 0:
        raise argparse.ArgumentTypeError(problem)
    return value


def _positive_ints(text: str) -> str:
    """A comma-separated list of positive integers (checked here, read where it is used)."""
    for piece in (p.strip() for p in text.split(",")):
        if piece:
            _positive_int(piece)
    if not text.strip(", "):
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, got nothing")
    return text


def _positive_numbers(text: str) -> str:
    """A comma-separated list of numbers > 0."""
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        try:
            value = float(piece)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {piece!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {piece}")
    if not text.strip(", "):
        raise argparse.ArgumentTypeError("expected comma-separated numbers > 0, got nothing")
    return text


def _names_from(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A comma-separated list of some of `choices`."""

    def check(text: str) -> str:
        names = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated names from {', '.join(choices)}, got {text!r}"
            )
        return text

    return check


def _key(text: str) -> str:
    if not text:  # `--api-key "$KEY"` with KEY unset would serve with no key at all
        raise argparse.ArgumentTypeError("the key is empty (to serve without one, leave --api-key out)")
    return text


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value
