"""The int8 KV cache's rows (`kernels/kv_quant.py`): layout, rounding, error bound, zero rows, views."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel.kernels import kv_quant


def test_row_layout_values_padding_then_the_scale():
    assert kv_quant.row_width(64, torch.int8) == 68
    assert kv_quant.row_width(6, torch.int8) == 12  # 6 values, 2 zero bytes, 4 bytes of scale
    assert kv_quant.row_width(64, torch.float32) == 64
    assert kv_quant.row_bytes(64, torch.int8) == 68 and kv_quant.row_bytes(64, torch.bfloat16) == 128
    rows = torch.tensor([[[-2.0, 1.0, 0.5, 0.0, 0.25, 1.0]]])
    q = kv_quant.quantize(rows)
    scale = q[..., -4:].contiguous().view(torch.float32)
    assert scale.item() == torch.tensor(2.0 / 127).item()
    assert q[0, 0, :6].tolist() == [-127, 64, 32, 0, 16, 64]  # 63.5 -> 64, 31.75 -> 32, 15.875 -> 16
    assert q[0, 0, 6:8].tolist() == [0, 0]


def test_rows_aligned_to_16_bytes_keep_the_scale_after_the_values_and_zeros_after_it():
    assert kv_quant.row_width(128, torch.int8, align=16) == 144  # 128 values, the scale, 12 zero bytes
    assert kv_quant.row_width(64, torch.int8, align=16) == 80 and kv_quant.row_width(6, torch.int8, 16) == 16
    assert kv_quant.row_width(64, torch.float32, align=16) == 64  # a float cache has no padding
    assert kv_quant.row_bytes(128, torch.int8, align=16) == 144 and kv_quant.scale_at(6) == 8
    rows = torch.randn(3, 2, 6)
    q = kv_quant.quantize(rows, 16)
    assert q.shape == (3, 2, 16) and torch.equal(q[..., :12], kv_quant.quantize(rows))
    assert not q[..., 12:].any()
    assert torch.equal(kv_quant.dequantize(q, 6, torch.float32), kv_quant.roundtrip(rows))
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.int8)
    kv_quant.store(cache, torch.tensor([5, 0, 2]), rows)
    torch.testing.assert_close(
        kv_quant.load(cache.view(-1, 2, 16)[[5, 0, 2]], 6, torch.float32), kv_quant.roundtrip(rows)
    )
    with pytest.raises(ValueError, match="int8 rows of 8 bytes cannot hold 6 values and a scale"):
        kv_quant.quantize(rows, 8)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.sampled_from([1, 5, 8, 64]),
    st.floats(1e-3, 1e3),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**31 - 1),
)
def test_dequantized_values_are_within_half_a_step_of_the_originals(rows, head_dim, magnitude, dtype, seed):
    x = (torch.randn(rows, 3, head_dim, generator=torch.Generator().manual_seed(seed)) * magnitude).to(dtype)
    back = kv_quant.dequantize(kv_quant.quantize(x), head_dim, torch.float32)
    step = x.float().abs().amax(-1, keepdim=True) / 127
    assert ((back - x.float()).abs() <= step / 2 * (1 + 1e-5)).all()
    torch.testing.assert_close(back.abs().amax(-1), x.float().abs().amax(-1), rtol=1e-6, atol=0)


def test_a_zero_row_stays_zero_and_is_never_nan():
    back = kv_quant.roundtrip(torch.zeros(2, 3, 8))
    assert torch.equal(back, torch.zeros(2, 3, 8))


def test_store_and_load_through_a_paged_cache_and_strided_views():
    cache = torch.zeros(4, 2, 3, kv_quant.row_width(8, torch.int8), dtype=torch.int8)
    rows = torch.randn(5, 3, 8)
    slots = torch.tensor([7, 0, 3, 4, 1])
    kv_quant.store(cache, slots, rows)
    flat = cache.view(-1, 3, cache.shape[-1])
    torch.testing.assert_close(kv_quant.load(flat[slots], 8, torch.float32), kv_quant.roundtrip(rows))
    # A strided selection (one head of every row) reads the same values as a contiguous copy.
    head = flat[slots][:, 1]
    torch.testing.assert_close(kv_quant.load(head, 8, torch.float32), kv_quant.roundtrip(rows)[:, 1])
    torch.testing.assert_close(kv_quant.load(flat[slots].transpose(0, 1), 8, torch.float32),
                               kv_quant.roundtrip(rows).transpose(0, 1))  # fmt: skip
    # A float cache is written and read as before: a cast.
    floats = torch.zeros(4, 2, 3, 8, dtype=torch.bfloat16)
    kv_quant.store(floats, slots, rows)
    assert torch.equal(floats.view(-1, 3, 8)[slots], rows.to(torch.bfloat16))
