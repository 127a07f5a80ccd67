"""Checks and constants the Triton attention kernels share."""

from __future__ import annotations

import math

import torch

from hfaccel.kernels import kv_quant

LOG2E = math.log2(math.e)  # the kernels use exp2: exp(x * scale) == exp2(x * scale * LOG2E)


def check_head_dim(head_dim: int) -> None:
    """Head dims are ``tl.arange`` extents, so they must be powers of two; 16..256 is the tested range."""
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not supported: it must be a power of two in 16..256")


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> tuple[int, int]:
    """Validate an NHD cache pair ``[num_blocks, block_size, Hkv, W]`` (W: ``head_dim``, or an int8
    cache's row width, `kv_quant.row_width` at any alignment); return ``(Hkv, block_size)``."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match (4-D, one dtype)"
        )
    width = kv_quant.row_width(head_dim, k_cache.dtype)
    aligned = kv_quant.is_quantized(k_cache.dtype) and k_cache.shape[3] > width and k_cache.shape[3] % 4 == 0
    if k_cache.shape[3] != width and not aligned:
        raise ValueError(
            f"cache rows of {k_cache.shape[3]} elements != {width} for query head_dim {head_dim}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dimension")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two")
    return k_cache.shape[2], block_size


def scale_at(k_cache: torch.Tensor, head_dim: int) -> int:
    """Where a row's float32 scale starts, in elements, for an int8 cache (`kv_quant`); 0 otherwise."""
    if not kv_quant.is_quantized(k_cache.dtype):
        return 0
    return kv_quant.scale_at(head_dim)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision after the fp32 upcast.

    fp16/bf16 cache values are exact in TF32 (10-bit mantissa), but the operands the kernels multiply
    are not all cache values: the query is scaled before the dot and the softmax weights ``p`` are fp32,
    so both are rounded to TF32, an error of fp16's order, which fp16/bf16 serving accepts. fp32 inputs
    get full IEEE fp32 (slow, but fp32 serving is for testing).
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with unit stride; copy only when it is not."""
    return x if x.stride(-1) == 1 else x.contiguous()
