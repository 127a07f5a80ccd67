"""Write one step's new K/V into the paged cache (Triton).

The cache of a layer is ``[num_blocks, block_size, Hkv, D]`` (NHD). Token ``t`` of the packed step goes to
flat slot ``slot_mapping[t] = block * block_size + offset``; a slot of ``-1`` marks a padded token (a CUDA
graph bucket larger than the real batch) and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hfaccel.kernels import kv_quant
from hfaccel.kernels.triton.common import last_dim_contiguous


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: all its heads at once, one [BLOCK_H, BLOCK_D] tile per tensor.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padded token: leave the cache untouched
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_blk + offset * stride_kc_off
    v_dst = v_cache_ptr + block * stride_vc_blk + offset * stride_vc_off
    # Cast in registers: the cache may hold a different dtype than the projections.
    tl.store(
        k_dst + heads[:, None] * stride_kc_head + dims[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + heads[:, None] * stride_vc_head + dims[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into ``k_cache``/``v_cache`` at ``slot_mapping`` ``[T]``.

    Slots equal to ``-1`` are skipped. ``key``/``value`` may be strided views (e.g. slices of a fused QKV
    projection) as long as their last dimension is contiguous; the caches must have a contiguous last dim.
    An int8 cache gets the rows quantized first (`kv_quant.quantize`: fixed-shape torch ops, so a CUDA
    graph captures them), then copied as they are.
    """
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if kv_quant.is_quantized(k_cache.dtype):
        width = k_cache.shape[-1]
        key, value = kv_quant.quantize(key, width), kv_quant.quantize(value, width)
    num_tokens, num_kv_heads, head_dim = key.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match (4-D)"
        )
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key's {(num_kv_heads, head_dim)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dimension")
    if num_tokens == 0:
        return
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
