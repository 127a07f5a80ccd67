"""``hfaccel::paged_attention``: paged attention as one opaque custom op.

`torch.compile` traces a whole HF model with attention as a single node (no graph break): the op
reads the step's metadata and KV caches from the forward context, which holds persistent buffers, so
the same compiled graph (or captured CUDA graph) serves every step of its shape. The fake
implementation only states the output's shape.

The op is defined with `torch.library.Library` (schema, one ``CompositeExplicitAutograd`` kernel,
a registered fake) rather than the `torch.library.custom_op` decorator: the decorator wraps every call
in a dynamo-disable frame and an output-aliasing check, which cost more than the op's own Python
(about 20-30 us a call, measured; 30 layers a step). The op has no autograd formula: the engine runs
its steps under ``torch.inference_mode``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# --- The forward context: what the op of every layer needs for the step being run. The runner sets it
# around one model forward (`forward_context`); the op reads it (`current_forward_context`) instead of
# receiving Python objects through HF's ``**kwargs``. It is thread-local: a plain ``model(...)`` call in
# another thread while the engine steps sees no context at all.


_local = threading.local()


@dataclass
class ForwardContext:
    """The step's attention backend, its metadata, every layer's ``(k_cache, v_cache)``, and its host
    layout (what a recurrent layer splits the packed tokens by)."""

    backend: Any  # AttentionBackend
    metadata: Any  # the backend's metadata for this step
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    layout: Any = None  # StepLayout
    record_attentions: bool = False  # the attention layers return their probabilities (`attention_probs`)
    # Every packed token's logits are sampled, in order, and nothing is padded: the model's head may take
    # the final norm's output as it is (set by the runner for the step it stages; False otherwise).
    samples_every_token: bool = False
    # Layers whose K/V live in a pool of their own (the sliding layers of a model with full ones:
    # `engine/window_blocks.py`), and the step's metadata over that pool's tables.
    window_layers: frozenset[int] = frozenset()
    window_metadata: Any = None

    def layout_for(self, layer_idx: int) -> Any:
        """The host layout over the block tables that `layer_idx`'s cache is indexed by."""
        return self.layout.window_view() if layer_idx in self.window_layers else self.layout


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


# --- The op.

_LIBRARY = torch.library.Library("hfaccel", "FRAGMENT")
# The op's name carries its schema's version: inductor's on-disk cache keys a graph by its text, which
# leaves out default arguments, so a schema grown under the same name would replay compiled code that
# calls the op the old way (a segfault in the C++ wrapper). Bump it with every schema change.
OP_NAME = "paged_attention_v2"
_LIBRARY.define(
    OP_NAME
    + "(Tensor query, Tensor key, Tensor value, int layer_idx, float scale, int window=0, int chunk=0,"
    " float softcap=0., Tensor? sinks=None) -> Tensor"
)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store ``key``/``value`` ``[T, Hkv, D]`` of layer `layer_idx` in the paged cache and return causal
    paged attention of ``query`` ``[T, Hq, D]`` (within the layer's sliding `window`, or its `chunk`,
    where > 0; its scores soft-capped at `softcap` where > 0; with per-head attention `sinks`), as the
    current forward context describes the step."""
    try:
        context = current_forward_context()
        if context is None:
            raise RuntimeError("hfaccel::paged_attention runs only inside an hfaccel engine step")
        kv_cache = context.kv_caches[layer_idx]
        metadata = context.window_metadata if layer_idx in context.window_layers else context.metadata
        if softcap > 0 or sinks is not None:
            local = (window, chunk, softcap, sinks)
            return context.backend.forward(query, key, value, kv_cache, metadata, scale, *local)
        return context.backend.forward(query, key, value, kv_cache, metadata, scale, window, chunk)
    except BaseException as error:
        # A compiled graph's C++ wrapper replaces this by its own RuntimeError: keep the original for
        # the caller of the graph (`keep_errors`, `take_error`).
        if getattr(_errors, "keep", False):
            _errors.last = error
        raise


def paged_attention_heads_first(
    context: ForwardContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`paged_attention` over transformers' head-first layout, eager only, in the step's `context` (the
    caller has it at hand: one thread-local read a layer less): ``query`` ``[1, Hq, T, D]``,
    ``key``/``value`` ``[1, Hkv, T, D]`` -> ``[1, T, Hq, D]``, where the step's backend serves it in
    place (`AttentionBackend.forward_heads_first`); None where it does not (take `paged_attention`)."""
    if layer_idx in context.window_layers:
        return None
    kv_cache, local = context.kv_caches[layer_idx], (window, chunk, softcap, sinks)
    return context.backend.forward_heads_first(query, key, value, kv_cache, context.metadata, scale, *local)


_errors = threading.local()


def keep_errors(keep: bool) -> None:
    """Whether the op keeps what it raises in this thread for `take_error` (only while a compiled graph
    runs: a kept exception holds its frames, and with them the step's tensors); either way, forget any
    kept one."""
    _errors.keep = keep
    _errors.last = None


def take_error() -> BaseException | None:
    """The exception the op last raised in this thread while keeping errors, if any (and forget it)."""
    error = getattr(_errors, "last", None)
    _errors.last = None
    return error


_LIBRARY.impl(OP_NAME, paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("hfaccel::" + OP_NAME, lib=_LIBRARY)
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(query)
