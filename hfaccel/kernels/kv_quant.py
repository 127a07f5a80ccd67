"""An int8 KV cache: each (token, KV head) row stored as int8 values with a float32 scale of its own.

A row of ``D`` values becomes ``row_width(D)`` bytes: the ``D`` values rounded to ``round(x / scale)``
(symmetric, ``scale = max|x| / 127``, half to even), zero bytes up to a multiple of 4, then the scale's 4
bytes (at `scale_at`), then zero bytes up to the row alignment the attention backend asks for (4 by
default; Triton's kernels load 16-byte aligned rows as vectors, unaligned ones a byte at a time).
Keeping the scale inside the row keeps a layer's cache one ``[blocks, block_size, Hkv, W]`` tensor per
K and per V, so everything that moves whole blocks or rows (copy on write, exports, tensor parallel
shards) stays unchanged; only what reads values or writes new rows quantizes. The C decode kernel
(`cpu_decode`) computes the same rows bit for bit: both divide in float32 and round half to even. A
float32 model's K/V then take a quarter of their bytes plus 4 per row (SmolLM2, D = 64: 0.27x).
"""

from __future__ import annotations

import torch

QUANTIZED_DTYPE = torch.int8
SCALE_BYTES = 4
_LEVELS = 127.0


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds quantized rows (int8 values and a scale per row)."""
    return dtype == QUANTIZED_DTYPE


def scale_at(head_dim: int) -> int:
    """Where an int8 row's float32 scale starts: its `head_dim` values padded to a multiple of 4 bytes."""
    return -(-head_dim // SCALE_BYTES) * SCALE_BYTES


def row_width(head_dim: int, dtype: torch.dtype, align: int = SCALE_BYTES) -> int:
    """Elements of `dtype` one (token, KV head) row takes in the cache: `head_dim`, or for an int8 cache
    the values padded to a multiple of 4 bytes, the float32 scale, and zeros up to a multiple of `align`
    bytes."""
    if not is_quantized(dtype):
        return head_dim
    return -(-(scale_at(head_dim) + SCALE_BYTES) // align) * align


def row_bytes(head_dim: int, dtype: torch.dtype, align: int = SCALE_BYTES) -> int:
    """Bytes of one (token, KV head) row of K (or of V) in a cache of `dtype` (rows aligned to `align`)."""
    return row_width(head_dim, dtype, align) * torch.empty((), dtype=dtype).element_size()


def quantize(rows: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``[..., D]`` float rows -> ``[..., width]`` int8 rows with their scales (`width`: a cache's row
    width, at least ``row_width(D)``; default that)."""
    head_dim = rows.shape[-1]
    width = row_width(head_dim, QUANTIZED_DTYPE) if width is None else width
    at = scale_at(head_dim)
    if width < at + SCALE_BYTES:
        raise ValueError(f"int8 rows of {width} bytes cannot hold {head_dim} values and a scale")
    x = rows.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / _LEVELS
    # A zero row has scale 0: its values stay 0 (x / 0 would be NaN).
    values = torch.where(scale > 0, torch.round(x / scale), 0.0).clamp_(-_LEVELS, _LEVELS)
    out = torch.zeros(*rows.shape[:-1], width, dtype=QUANTIZED_DTYPE, device=rows.device)
    out[..., :head_dim] = values.to(QUANTIZED_DTYPE)
    out[..., at : at + SCALE_BYTES] = scale.contiguous().view(QUANTIZED_DTYPE)
    return out


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[..., W]`` int8 rows -> ``[..., head_dim]`` values in `dtype` (computed in float32)."""
    at = scale_at(head_dim)
    scale = rows[..., at : at + SCALE_BYTES]
    if not _viewable(scale):
        rows = rows.contiguous()
        scale = rows[..., at : at + SCALE_BYTES]
    return (rows[..., :head_dim].float() * scale.view(torch.float32)).to(dtype)


def roundtrip(rows: torch.Tensor) -> torch.Tensor:
    """What reading `rows` back from an int8 cache gives, in their own dtype."""
    return dequantize(quantize(rows), rows.shape[-1], rows.dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows`` ``[T, Hkv, D]`` at cache `slots` ``[T]`` of ``cache`` ``[blocks, block_size, Hkv,
    W]``, quantized where the cache is int8 (else cast to its dtype)."""
    flat = cache.view(-1, *cache.shape[2:])
    rows = quantize(rows, cache.shape[-1]) if is_quantized(cache.dtype) else rows.to(cache.dtype)
    flat.index_copy_(0, slots, rows.to(cache.device))


def load(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (any leading shape) as values of `dtype`: dequantized from an int8 cache, else cast."""
    if is_quantized(rows.dtype):
        return dequantize(rows, head_dim, dtype)
    return rows.to(dtype)


def _viewable(scale: torch.Tensor) -> bool:
    """Whether the 4 int8 bytes of every row's scale can be viewed as one float32 in place."""
    if scale.stride(-1) != 1:
        return False
    return scale.storage_offset() % SCALE_BYTES == 0 and all(
        s % SCALE_BYTES == 0 for s in scale.stride()[:-1]
    )
