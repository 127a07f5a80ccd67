"""The inner loop both attention kernels share: one tile of cached K/V rows, looked up through the block
table, and the online-softmax update of the running max, sum and output with it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    table,
    k_cache_ptr,
    v_cache_ptr,
    pos,
    valid,
    dims,
    kv_head,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_head,
    BLOCK_SIZE: tl.constexpr,
    SCALE_AT: tl.constexpr = 0,
):
    """K and V (fp32, ``[TILE, HEAD_DIM]``) of positions `pos` of one KV head; rows not `valid` are 0.
    `SCALE_AT` > 0: an int8 cache (`kv_quant`), each row's values times the float32 scale stored at that
    element of the row."""
    # Per-token block lookup: a tile may span several cache blocks, so any block size works.
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    k_rows = block * stride_kc_blk + offset * stride_kc_off + kv_head * stride_kc_head
    v_rows = block * stride_vc_blk + offset * stride_vc_off + kv_head * stride_vc_head
    k = tl.load(k_cache_ptr + k_rows[:, None] + dims[None, :], mask=valid[:, None], other=0).to(tl.float32)
    v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :], mask=valid[:, None], other=0).to(tl.float32)
    if SCALE_AT > 0:  # the float32 scale follows the values (4-byte aligned; rows 16-byte aligned)
        k_scale = tl.load(
            (k_cache_ptr + k_rows + SCALE_AT).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0
        )
        v_scale = tl.load(
            (v_cache_ptr + v_rows + SCALE_AT).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0
        )
        k = k * k_scale[:, None]
        v = v * v_scale[:, None]
    return k, v


@triton.jit
def online_softmax_update(q, k, v, allowed, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running (max, sum, output) of each query row; `allowed` masks the scores
    (``[rows, TILE]``). Scores are in log2 units (the query is scaled by ``scale * log2(e)``)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows with nothing allowed yet keep m = -inf; shift them by 0 to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
