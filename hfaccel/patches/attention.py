"""The "hfaccel" attention function: HF decoder layers hand it Q/K/V, it runs paged attention.

The function is registered once in ``transformers.AttentionInterface``. A patched model keeps its own
attention implementation for ordinary forward calls (so scoring and training code sees exactly the
model it had, masks and all); the engine points the model at "hfaccel" only for the duration of its
own forward passes (`engine_attention`). No mask function is registered for the name, so transformers
builds no ``[T, S]`` mask for an engine step: causality and sequence boundaries come from the paged
metadata, which the runner hands over in a forward context (not through HF's ``**kwargs``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

import hfaccel.kernels.op  # noqa: F401  (registers torch.ops.hfaccel.paged_attention)
from hfaccel.kernels.context import current_forward_context

ATTENTION_NAME = "hfaccel"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface entry: ``query`` ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``
    (packed, not GQA-repeated) -> ``([1, T, Hq, D], None)``, through the ``hfaccel::paged_attention``
    op, which reads the step from the forward context the runner set."""
    if current_forward_context() is None:
        raise RuntimeError(
            "the 'hfaccel' attention implementation only runs inside the hfaccel engine; "
            "call model.generate(...) or hfaccel.generate(...) instead of forward()"
        )
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = torch.ops.hfaccel.paged_attention(q, k, v, module.layer_idx, float(scale))
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Register the "hfaccel" attention function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextmanager
def engine_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's attention layers on the paged "hfaccel" function inside this block."""
    config = model.config
    previous = config._attn_implementation
    if previous == ATTENTION_NAME:
        yield
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
