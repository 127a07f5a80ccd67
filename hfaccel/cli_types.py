"""The command line's argument types: each value checked as argparse reads it, so a mistake is a one-line
usage error naming the option, before any model loads."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The dtypes a command's --dtype names (besides "auto": the checkpoint's own). Names only: torch is
# imported once a command runs, not to print `--help`.
DTYPES = ("float32", "bfloat16", "float16")


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype one of `DTYPES` names."""
    import torch

    return getattr(torch, name)


def _number(text: str, convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Any:
    """`text` read by `convert` and accepted by `ok`, else argparse's error saying what was `expected`."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def _seed(text: str) -> int:
    return _number(text, int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v > 0, "a positive integer")


def _count(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a number > 0")


def _model_len(text: str) -> int:
    return _number(text, int, lambda v: v >= 2, "an integer >= 2 (a prompt token and a new one)")


def _port(text: str) -> int:
    return _number(text, int, lambda v: 0 <= v <= 65535, "a port in 0-65535 (0: any free one)")


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
    if value == 1:  # "1": all of the free memory, not one byte
        return 1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(problem)
    return value


def _positive_ints(text: str) -> str:
    """A comma-separated list of positive integers (checked here, read where it is used)."""
    return _each(text, int, "a positive integer", "comma-separated positive integers")


def _positive_numbers(text: str) -> str:
    """A comma-separated list of numbers > 0."""
    return _each(text, float, "comma-separated numbers > 0", "comma-separated numbers > 0")


def _each(text: str, convert: Callable[[str], Any], each: str, whole: str) -> tuple:
    """`text`'s comma-separated pieces, each read by `convert` as a number > 0 (`each` says what a piece
    is)."""
    pieces = [p.strip() for p in text.split(",") if p.strip()]
    if not pieces:
        raise argparse.ArgumentTypeError(f"expected {whole}, got nothing")
    return tuple(_number(piece, convert, lambda v: v > 0, each) for piece in pieces)


def _names_from(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of some of `choices`, as a tuple."""

    def check(text: str) -> tuple[str, ...]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated names from {', '.join(choices)}, got {text!r}"
            )
        return tuple(names)

    return check


def _host(text: str) -> str:
    if not text.strip():  # `--host "$HOST"` with HOST unset would bind every interface
        raise argparse.ArgumentTypeError("the address is empty (0.0.0.0 binds every interface)")
    return text


def _key(text: str) -> str:
    if not text:  # `--api-key "$KEY"` with KEY unset would serve with no key at all
        raise argparse.ArgumentTypeError("the key is empty (to serve without one, leave --api-key out)")
    return text


def _origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: "*" or comma-separated origins (scheme://host[:port], as a browser sends)."""
    origins = tuple(p.strip() for p in text.split(",") if p.strip())
    # (the rule `hfaccel.server.server.allowed_origin_list` checks again: a scheme and a host, no path)
    bad = next((o for o in origins if o != "*" and ("://" not in o or "/" in o.split("://", 1)[1])), None)
    if not origins or bad is not None:
        raise argparse.ArgumentTypeError(
            f"expected '*' or comma-separated origins such as http://localhost:3000, got {bad or text!r}"
        )
    return origins


def _non_negative_float(text: str) -> float:
    return _number(text, float, lambda v: v >= 0, "a number >= 0")
