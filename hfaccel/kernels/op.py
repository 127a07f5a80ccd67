"""``hfaccel::paged_attention``: paged attention as one opaque custom op.

`torch.compile` traces a whole HF model with attention as a single node (no graph break): the op
reads the step's metadata and KV caches from the forward context, which holds persistent buffers, so
the same compiled graph (or captured CUDA graph) serves every step of its shape. The fake
implementation only states the output's shape.
"""

from __future__ import annotations

import torch

from hfaccel.kernels.context import current_forward_context


@torch.library.custom_op("hfaccel::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    """Store ``key``/``value`` ``[T, Hkv, D]`` of layer `layer_idx` in the paged cache and return causal
    paged attention of ``query`` ``[T, Hq, D]``, as the current forward context describes the step."""
    context = current_forward_context()
    if context is None:
        raise RuntimeError("hfaccel::paged_attention runs only inside an hfaccel engine step")
    return context.backend.forward(query, key, value, context.kv_caches[layer_idx], context.metadata, scale)


@paged_attention.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    return torch.empty_like(query)
