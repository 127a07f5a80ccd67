"""Paged decode attention (Triton): one query token per sequence, flash-decoding in two stages.

Stage 1 runs one program per (sequence, KV head, split). A program holds every query head that shares the
KV head (GQA group, padded to a power of two >= 16 so ``tl.dot`` accepts it), so each K/V tile is read once
for the whole group. It walks its split's share of the context tile by tile through the block table with an
online softmax and writes a partial output plus its log-sum-exp. Stage 2 merges the splits by their LSE.

The grid depends only on ``(B, Hkv, num_splits)``, never on the sequence lengths, so a CUDA graph captured
for a batch bucket replays it for any lengths: each program derives its KV range from ``seq_lens`` on the
device. A split whose range is empty writes LSE = -inf and weighs nothing in the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfaccel.kernels.triton.common import (
    LOG2E,
    check_caches,
    check_head_dim,
    dot_precision,
    last_dim_contiguous,
    scale_at,
)
from hfaccel.kernels.triton.tile import load_kv_tile, online_softmax_update

# Splitting below this many context tokens per split costs more in the merge than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16
# Enough (sequence, KV head, split) programs to keep a large GPU busy; more splits than that only add merges.
TARGET_PROGRAMS = 256


def default_num_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Splits per (sequence, KV head) for a batch whose contexts are at most ``max_context`` tokens.

    ``min(cdiv(max_context, 256), cdiv(256, batch * num_kv_heads))`` clamped to ``[1, 16]``: split only
    when the context is long enough to share out and the batch alone does not fill the GPU. Every input is
    a static bound (batch bucket, model shape, block-table width), so the result is stable under CUDA graphs.
    """
    by_length = triton.cdiv(max(max_context, 1), MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(batch * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,  # [B, Hq, NUM_SPLITS, HEAD_DIM] fp32
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32, log2 domain
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    window,  # > 0: a sliding window, the last `window` positions only
    chunk,  # > 0: chunked attention, the positions of the last token's chunk only
    stride_qb,
    stride_qh,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_head,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALE_AT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # first visible position
    chunk_first = (tl.maximum(seq_len, 1) - 1) // tl.maximum(chunk, 1) * chunk
    first = tl.where(chunk > 0, tl.maximum(first, chunk_first), first)
    # Share the sequence's visible tiles evenly among the splits; trailing splits may get none.
    first_tile = first // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(tl.float32)
    q = q * qk_scale

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cols = tl.arange(0, TILE_N)
    for tile in range(tile_start, tile_end):
        pos = tile * TILE_N + cols
        valid = (pos < seq_len) & (pos >= first)
        k, v = load_kv_tile(
            table, k_cache_ptr, v_cache_ptr, pos, valid, dims, kv_head,
            stride_kc_blk, stride_kc_off, stride_kc_head, stride_vc_blk, stride_vc_off, stride_vc_head,
            BLOCK_SIZE, SCALE_AT,
        )  # fmt: skip
        # Every tile in range holds a valid position, so the max is finite and nothing is NaN.
        m_i, l_i, acc = online_softmax_update(q, k, v, valid[None, :], m_i, l_i, acc, DOT_PRECISION)

    has_any = l_i > 0.0  # False for an empty split (and for every split of a seq_len-0 padded row)
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    part_row = (seq.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
    tl.store(part_lse_ptr + part_row, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    base = (seq.to(tl.int64) * num_q_heads + head) * NUM_SPLITS

    lse = tl.load(part_lse_ptr + base + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # All splits empty (padded seq with seq_len 0): weights 0, output 0 rather than exp2(-inf + inf) = NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # empty splits: exp2(-inf) = 0
    total = tl.sum(weight, axis=0)
    part = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=(splits < NUM_SPLITS)[:, None],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
    )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int = 0,
    chunk: int = 0,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole paged context (its last `window`
    positions, where `window` > 0: a sliding window; its own chunk of `chunk` positions, where > 0).

    Args:
        query: ``[B, Hq, D]``, the token at position ``seq_lens[b] - 1`` of each sequence.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, this step's K/V already written.
        block_tables: ``[B, max_blocks]`` int32 block ids (padding entries are never read).
        seq_lens: ``[B]`` int32 context lengths including this token; 0 marks a padded row (output 0).
        scale: softmax scale.
        out: optional ``[B, Hq, D]`` tensor to write into (e.g. a CUDA-graph static buffer).
        num_splits: KV splits per (sequence, KV head); default ``default_num_splits`` from the batch size,
            the KV heads and ``block_tables.shape[1] * block_size`` -- never from ``seq_lens`` values.

    Returns:
        ``[B, Hq, D]`` in ``query``'s dtype (``out`` when given).
    """
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = check_caches(k_cache, v_cache, head_dim)
    check_head_dim(head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not match B={batch}"
        )
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} must be [B, Hq, D] = {tuple(query.shape)}, last dim contiguous"
        )
    if batch == 0:
        return out
    query = last_dim_contiguous(query)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()

    group = num_q_heads // num_kv_heads
    part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        scale * LOG2E,
        window,
        chunk,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=64 if head_dim <= 128 else 32,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(query.dtype),
        SCALE_AT=scale_at(k_cache, head_dim),
        num_warps=4,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),  # no size-1 aranges
        num_warps=4,
    )
    return out
