"""The attention probabilities of a packed step, for callers that ask to see them (HF's
``output_attentions``): each query's softmax over its own sequence's keys, read back from the paged
cache after the step's K/V were stored. Written as transformers' eager attention computes them (scaled
scores, soft-capped, masked, a float32 softmax whose denominator also holds the head's attention-sink
logit, cast to the query's dtype), so a step that records them runs this beside its attention kernel;
no step that does not record runs any of it.
"""

from __future__ import annotations

import torch

from hfaccel.kernels import kv_quant
from hfaccel.kernels.metadata import StepLayout


def attention_probs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    layout: StepLayout,
    scale: float,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query`` ``[T, Hq, D]`` (the packed step's) -> ``[1, Hq, T, S]``: row t holds its query's
    probabilities over the keys of its own sequence at positions ``0 .. S_t - 1`` (zero past them and
    where a window or chunk hides a key), S the longest sequence of the step. A sequence's queries sit
    at its last ``query_lens[i]`` positions."""
    block_size, num_kv_heads, width = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    tokens, num_heads, head_dim = query.shape
    longest = max(layout.seq_lens, default=0)
    probs = query.new_zeros((1, num_heads, tokens, longest))
    flat_k = k_cache.view(-1, num_kv_heads, width)
    start = 0
    for query_len, seq_len, table in zip(layout.query_lens, layout.seq_lens, layout.block_tables):
        rows = slice(start, start + query_len)
        start += query_len
        if seq_len == 0:
            continue
        place = torch.arange(seq_len, device=query.device)
        blocks = torch.tensor(table, dtype=torch.long, device=query.device)
        keys = flat_k[blocks[place // block_size] * block_size + place % block_size]  # [S, Hkv, W]
        if keys.dtype == kv_quant.QUANTIZED_DTYPE:
            keys = kv_quant.dequantize(keys, head_dim, query.dtype)
        keys = keys[..., :head_dim].to(query.dtype).repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[rows].transpose(0, 1)  # [Hq, Q, D]
        scores = torch.matmul(q, keys.permute(1, 2, 0)) * scale  # [Hq, Q, S]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        # Query j sees the keys up to position seq_len - query_len + j: its own key, or for a query-only
        # token (whose seq_len stops before it) the last key before it.
        last = seq_len - query_len + torch.arange(query_len, device=query.device)
        visible = place[None, :] <= last[:, None]
        if window > 0:
            visible &= place[None, :] > last[:, None] - window
        if chunk > 0:
            visible &= place[None, :] // chunk == last[:, None] // chunk
        scores = scores.float().masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, query_len, 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1)[..., :seq_len]
        probs[0, :, rows, :seq_len] = weights.to(query.dtype)
    return probs
