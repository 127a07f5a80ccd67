"""The CPU argmax kernel against ``torch.argmax``: ties, NaNs, infinities, signed zeros, any length."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel.kernels import cpu_argmax

pytestmark = pytest.mark.skipif(
    cpu_argmax.load() is None, reason="no C compiler: the CPU argmax kernel is not built here"
)

# Values that make argmax interesting: ties at the top, NaN, both infinities, both zeros, the extremes.
_SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0, 3.0, -1e38, 1e38, 1.0]


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.integers(1, 70),
    pad=st.integers(0, 3),
    picks=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(_SPECIAL)), max_size=8),
    seed=st.integers(0, 2**31),
    threads=st.sampled_from([1, 2]),
)
def test_equals_torch_argmax(rows, n, pad, picks, seed, threads):
    """Random rows (lengths across and inside the 16-lane vectors) seeded with special values, as a
    view into wider rows (row stride n + pad): the kernel's indices are torch's."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-3, 4, (rows, n + pad), generator=g).float()  # small integers: ties are common
    for where, value in picks:
        base.view(-1)[where % base.numel()] = value
    x = base[:, :n]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    finally:
        torch.set_num_threads(previous)


def test_a_real_vocabulary_row_and_other_inputs():
    """SmolLM2-sized rows; a NaN after the maximum still wins; other dtypes, a 1-D tensor and a
    column-strided view take torch's argmax (same answers)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 49152, generator=g)
    assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    x[3, 40000] = float("nan")
    x[3, 100] = 1e30
    assert int(cpu_argmax.argmax_rows(x)[3]) == 40000 == int(x.argmax(dim=-1)[3])
    for other in (x.bfloat16(), x.double(), x[0], x.t()[:100]):
        assert torch.equal(cpu_argmax.argmax_rows(other), other.argmax(dim=-1))
    assert cpu_argmax.argmax_rows(torch.empty(0, 5)).shape == (0,)
