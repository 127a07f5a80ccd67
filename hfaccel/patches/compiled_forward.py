"""Calling a step's compiled forward: its own dynamo cache, eager when dynamo refuses, original errors.

- **A code object of its own.** Dynamo keeps its graphs on the code object it compiled and allows
  ``recompile_limit`` (default 8) of them per code object; every new model, and every state of one that
  dynamo guards on (train/eval, which LoRA adapter is active, which parameters require grad), adds one.
  Had every executor compiled `HFExecutor._model_forward` itself, a process would stop compiling after
  its 8th model or state, freed models included. `own_code` gives each compile a copy of the code, whose
  graphs are freed with it.
- **Eager past the limit.** A model that goes through more states than the limit allows runs eager
  from then on (one warning), not into dynamo's hard error (``fullgraph=True`` turns the limit into
  `FailOnRecompileLimitHit`, raised before anything ran, so running eager instead is safe). Eager for
  every state, not only the new ones: each further call of the compiled function would evaluate every
  graph's guards and log dynamo's warning again, every step.
- **The op's own errors.** On a CPU the compiled graph's C++ wrapper calls ``hfaccel::paged_attention``
  through the dispatcher, which replaces whatever the op raised (a KeyboardInterrupt from Ctrl-C, a
  ValueError naming a parameter) by its own RuntimeError; while a compiled graph runs, the op keeps
  its error (`kernels.op.keep_errors`, `take_error`), and `call_compiled` raises that instead.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.exc

from hfaccel.kernels import op

logger = logging.getLogger("hfaccel")

# The exception dynamo raises under fullgraph=True when a frame has used up its recompile limit.
RECOMPILE_LIMIT_ERRORS: tuple[type[BaseException], ...] = tuple(
    error
    for error in (
        getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None),
        getattr(torch._dynamo.exc, "FailOnCacheLimitHit", None),  # its name before torch 2.6
    )
    if error is not None
)


def own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (a plain function) over a fresh copy of its code object: dynamo caches graphs per code
    object, so a compile of the copy shares no cache entry (and no recompile budget) with another."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    return copy


class CompiledForward:
    """A step's compiled forward and its eager twin: `__call__` runs the compiled one until dynamo has no
    room left for another graph, then the eager one for good (`exhausted`)."""

    def __init__(self, compiled: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor]) -> None:
        self.compiled = compiled
        self.eager = eager
        self.exhausted = False

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.exhausted:
            return self.eager(*args)
        try:
            return call_compiled(self.compiled, *args)
        except RECOMPILE_LIMIT_ERRORS as error:
            self.exhausted = True
            logger.warning(
                "hfaccel: the model's steps run eager from now on: torch.compile has compiled as many "
                "graphs of the step as torch._dynamo.config.recompile_limit (%d) allows, one per model "
                "state it met (adapters, train/eval, parameters requiring grad); raise that limit before "
                "patching to compile more (%s)",
                torch._dynamo.config.recompile_limit,
                type(error).__name__,
            )
            return self.eager(*args)


def call_compiled(compiled: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``compiled(*args)``, raising the attention op's own exception where the compiled graph masked it."""
    op.keep_errors(True)
    try:
        return compiled(*args)
    except RuntimeError as error:
        original = op.take_error()
        if original is None or original is error:
            raise
        raise original.with_traceback(original.__traceback__) from error
    finally:
        op.keep_errors(False)
