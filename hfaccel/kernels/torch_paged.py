"""Pure-PyTorch paged attention: the reference backend and the CPU fast path.

Decodes (one query token per sequence) run as one batched SDPA call over K/V gathered from the cache and
padded to the longest context. Multi-token sequences (prefill chunks) run one SDPA call each: a fresh
prompt attends to its own K/V with ``is_causal``; a chunk that continues a cached context gathers that
context and uses an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hfaccel.kernels.metadata import AttentionMetadata


@dataclass
class _PrefillSpan:
    start: int  # first packed token of this sequence
    length: int  # its query tokens this step
    context_slots: torch.Tensor | None  # [ctx] cache slots when it continues a cached context
    mask: torch.Tensor | None  # [length, ctx] True where attention is allowed


@dataclass
class _TorchState:
    decode_blocks: torch.Tensor | None = (
        None  # [num_decodes * nb] block ids, nb = blocks of the longest context
    )
    decode_mask: torch.Tensor | None = (
        None  # [num_decodes, 1, 1, nb * block_size] True where a slot is context
    )
    prefills: list[_PrefillSpan] = field(default_factory=list)


def context_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of token `positions` for a block table (works batched: ``[B, nb]`` with ``[S]``)."""
    return block_table[..., positions // block_size] * block_size + positions % block_size


class TorchPagedAttention:
    """Paged attention written with ``torch`` ops only (any device, any dtype)."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build the gather indices and masks every layer of this step shares."""
        state = _TorchState()
        device = meta.slot_mapping.device
        block_tables = meta.block_tables.to(device=device, dtype=torch.long)
        num_decodes = meta.num_decodes
        if num_decodes:
            # Gather whole blocks (contiguous rows of block_size * Hkv * D), not single slots: far faster.
            lens = torch.tensor(meta.seq_lens[:num_decodes], device=device)
            num_blocks = -(-max(meta.seq_lens[:num_decodes]) // meta.block_size)
            state.decode_blocks = block_tables[:num_decodes, :num_blocks].reshape(-1)
            positions = torch.arange(num_blocks * meta.block_size, device=device)
            state.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        for i in range(num_decodes, meta.num_seqs):
            start = meta.query_start_loc[i]
            length = meta.query_start_loc[i + 1] - start
            context = meta.seq_lens[i]
            if context == length:
                state.prefills.append(_PrefillSpan(start, length, None, None))
                continue
            positions = torch.arange(context, device=device)
            slots = context_slots(block_tables[i], positions, meta.block_size)
            query_positions = torch.arange(context - length, context, device=device)
            mask = positions[None, :] <= query_positions[:, None]
            state.prefills.append(_PrefillSpan(start, length, slots, mask))
        meta.backend_state = state

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Scatter this step's K/V ``[T, Hkv, D]`` into the paged cache."""
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal paged attention; ``query`` ``[T, Hq, D]`` -> ``[T, Hq, D]``."""
        state: _TorchState = meta.backend_state
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(query)
        d = meta.num_decodes
        if d:
            out[:d] = _decode(query[:d], k_cache, v_cache, state, scale)
        for span in state.prefills:
            # 4-D inputs: CPU SDPA sends 3-D ones to its slow math path (25x slower at 2k tokens).
            rows = slice(span.start, span.start + span.length)
            q = query[rows].transpose(0, 1)[None]  # [1, Hq, L, D]
            if span.context_slots is None:
                k, v = key[rows].transpose(0, 1)[None], value[rows].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                k = flat_k[span.context_slots].transpose(0, 1)[None].to(q.dtype)
                v = flat_v[span.context_slots].transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out


def _decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, state: _TorchState, scale: float
) -> torch.Tensor:
    # Query heads sharing a KV head become rows of one [Hkv, rep] group: no repeat of K/V is needed.
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    shape = (num_seqs, -1, num_kv_heads, head_dim)
    k = (
        k_cache.index_select(0, state.decode_blocks).view(shape).permute(0, 2, 1, 3).to(q.dtype)
    )  # [B, Hkv, S, D]
    v = v_cache.index_select(0, state.decode_blocks).view(shape).permute(0, 2, 1, 3).to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=state.decode_mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)
