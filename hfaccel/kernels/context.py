"""The forward context: what the attention op of every layer needs for the step being run.

The runner sets it around one model forward (`forward_context`); the "hfaccel" attention function of
each decoder layer reads it (`current_forward_context`) instead of receiving Python objects through
HF's ``**kwargs``. It is thread-local: a plain ``model(...)`` call in another thread while the engine
steps sees no context at all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_local = threading.local()


@dataclass
class ForwardContext:
    """The step's attention backend, its metadata, and every layer's ``(k_cache, v_cache)``."""

    backend: Any  # AttentionBackend
    metadata: Any  # the backend's metadata for this step
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make `context` the current one in this thread for the block."""
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


def current_forward_context() -> ForwardContext | None:
    """The context set by the enclosing `forward_context` in this thread, or None."""
    return getattr(_local, "context", None)
