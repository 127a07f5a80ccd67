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
    previous, least = torch.get_num_threads(), cpu_argmax.PARALLEL_MIN_VALUES
    torch.set_num_threads(threads)
    cpu_argmax.PARALLEL_MIN_VALUES = 0  # these few values would run on one thread
    try:
        assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    finally:
        torch.set_num_threads(previous)
        cpu_argmax.PARALLEL_MIN_VALUES = least


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


def test_layouts_a_flush_to_zero_caller_and_the_switch(monkeypatch):
    """Expanded rows (row stride 0) and a lazily negated view match torch; under
    ``torch.set_flush_denormal(True)`` (the calling thread's setting) every row compares denormals as
    zero, whichever thread takes it; ``HFACCEL_CPU_DECODE_KERNEL=0`` turns the kernel off."""
    monkeypatch.setattr(cpu_argmax, "PARALLEL_MIN_VALUES", 0)  # every thread takes rows
    row = torch.randn(1, 70)
    for x in (row.expand(6, 70), torch._neg_view(torch.randn(3, 40))):
        assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    tiny = torch.tensor([[1e-45, 2e-45, 3e-45]] * 8)
    cpu_argmax.argmax_rows(torch.randn(8, 100))  # the worker threads exist before the flag is set
    if torch.set_flush_denormal(True):
        try:
            assert torch.equal(cpu_argmax.argmax_rows(tiny), tiny.argmax(dim=-1))
        finally:
            torch.set_flush_denormal(False)
    monkeypatch.setenv("HFACCEL_CPU_DECODE_KERNEL", "0")
    cpu_argmax.load.cache_clear()
    try:
        assert cpu_argmax.load() is None
        assert torch.equal(cpu_argmax.argmax_rows(tiny), tiny.argmax(dim=-1))
    finally:
        monkeypatch.delenv("HFACCEL_CPU_DECODE_KERNEL")
        cpu_argmax.load.cache_clear()


def test_a_tensor_subclass_goes_to_torch(monkeypatch):
    # A subclass such as a DTensor keeps its values elsewhere than data_ptr(): the kernel would read
    # whatever lies there (a tensor-parallel step crashed with SIGSEGV).
    class Wrapped(torch.Tensor):
        pass

    calls = []

    class Library:
        def hfaccel_argmax(self, *args):
            calls.append(args)

    monkeypatch.setattr(cpu_argmax, "load", lambda: Library())
    x = torch.randn(3, 50)
    assert torch.equal(cpu_argmax.argmax_rows(x.as_subclass(Wrapped)), x.argmax(dim=-1)) and not calls
    cpu_argmax.argmax_rows(x)
    assert len(calls) == 1  # a plain tensor takes the kernel


def test_few_logits_run_on_one_thread(monkeypatch):
    """A call on fewer than `PARALLEL_MIN_VALUES` logits asks the kernel for one thread (waking the pool
    costs more than it saves), a larger one for torch's threads."""
    asked = []

    class Library:
        def hfaccel_argmax(self, *args):
            asked.append(args[-1])

    monkeypatch.setattr(cpu_argmax, "load", lambda: Library())
    cpu_argmax.argmax_rows(torch.zeros(4, cpu_argmax.PARALLEL_MIN_VALUES // 4 - 1))
    cpu_argmax.argmax_rows(torch.zeros(4, cpu_argmax.PARALLEL_MIN_VALUES // 4))
    assert asked == [1, torch.get_num_threads()]
