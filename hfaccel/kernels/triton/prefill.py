"""Paged prefill attention (Triton): packed query tokens of many sequences over their paged contexts.

Each query token attends causally to its sequence's cached prefix and to the new tokens up to itself, all
read from the cache through the block table (this step's K/V are written first), so chunked prefill and
prefix-cache hits need no special case, and q_len 1 rows make one call serve a mixed decode+prefill step.

Grid ``(B, Hkv, cdiv(max_query_len, BLOCK_Q))``. A program's ``BLOCK_M`` rows are ``BLOCK_Q`` query tokens
times the ``GROUP`` query heads that share one KV head (row ``r`` is token ``r // GROUP``, head
``r % GROUP``), so each K/V tile is loaded once for the whole GQA group. Programs past a sequence's q_len
return at once.
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

TILE_N = 32  # KV positions per inner step (independent of the cache block size)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    window,  # > 0: a sliding window, keys within `window` positions of the query only
    chunk,  # > 0: chunked attention, keys of the query's chunk only
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_head,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALE_AT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of this sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    q_pos = first_pos + q_tok
    dims = tl.arange(0, HEAD_DIM)
    token = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(tl.float32)
    q = q * qk_scale

    # Causal: the block's last token sees positions up to its own; nothing beyond that is read.
    last_tok = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    kv_end = tl.maximum(tl.minimum(first_pos + last_tok + 1, seq_len), 0)  # 0 for a seq_len-0 padded row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cols = tl.arange(0, TILE)
    # Windowed: the block's first token sees nothing before its own position - window + 1.
    block_first = first_pos + q_block * BLOCK_Q
    kv_start = tl.where(window > 0, tl.maximum(block_first - window + 1, 0), 0)
    kv_start = tl.where(
        chunk > 0, tl.maximum(kv_start, block_first // tl.maximum(chunk, 1) * chunk), kv_start
    )
    for tile in range(kv_start // TILE, tl.cdiv(kv_end, TILE)):
        pos = tile * TILE + cols
        valid = pos < kv_end
        k, v = load_kv_tile(
            table, k_cache_ptr, v_cache_ptr, pos, valid, dims, kv_head,
            stride_kc_blk, stride_kc_off, stride_kc_head, stride_vc_blk, stride_vc_off, stride_vc_head,
            BLOCK_SIZE, SCALE_AT,
        )  # fmt: skip
        allowed = row_ok[:, None] & valid[None, :] & (pos[None, :] <= q_pos[:, None])
        allowed = allowed & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        q_chunk_start = q_pos // tl.maximum(chunk, 1) * chunk
        allowed = allowed & ((chunk <= 0) | (pos[None, :] >= q_chunk_start[:, None]))
        m_i, l_i, acc = online_softmax_update(q, k, v, allowed, m_i, l_i, acc, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # rows with no context (padding) come out 0
    tl.store(
        out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    chunk: int = 0,
) -> torch.Tensor:
    """Causal attention of packed query tokens over their paged contexts (within a sliding `window`
    of positions, and within each query's chunk of `chunk` positions, where > 0).

    Args:
        query: ``[T, Hq, D]``, the tokens of B sequences concatenated.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, this step's K/V already written.
        block_tables: ``[B, max_blocks]`` int32 block ids (padding entries are never read).
        seq_lens: ``[B]`` int32 context lengths including this step's tokens; 0 marks a padded sequence.
        query_start_loc: ``[B + 1]`` int32 offsets of each sequence's tokens in ``query``.
        max_query_len: an upper bound on the query tokens of any sequence (it sizes the grid).
        scale: softmax scale.
        out: optional ``[T, Hq, D]`` tensor to write into. Rows of tokens no sequence owns are not written.

    Returns:
        ``[T, Hq, D]`` in ``query``'s dtype (``out`` when given).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = check_caches(k_cache, v_cache, head_dim)
    check_head_dim(head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    batch = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or query_start_loc.shape != (batch + 1,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / query_start_loc {tuple(query_start_loc.shape)} "
            f"do not match B={batch}"
        )
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} must be [T, Hq, D] = {tuple(query.shape)}, last dim contiguous"
        )
    if batch == 0 or num_tokens == 0 or max_query_len <= 0:
        return out
    query = last_dim_contiguous(query)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()

    group = num_q_heads // num_kv_heads
    # Rows = query tokens x GQA group; at least 16 for tl.dot, fewer for big heads to bound registers.
    block_m = max(64 if head_dim <= 128 else 32, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        window,
        chunk,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE=TILE_N,
        DOT_PRECISION=dot_precision(query.dtype),
        SCALE_AT=scale_at(k_cache, head_dim),
        num_warps=4,
    )
    return out
