"""Backend selection: "auto" picks what can run here; a named backend that cannot run says why."""

import pytest
import torch

from hfaccel.kernels import BACKEND_NAMES, TorchPagedAttention, get_backend, unavailable_reason


def test_auto_on_cpu_is_the_torch_backend():
    assert isinstance(get_backend("auto", "cpu", torch.float32, 64), TorchPagedAttention)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        get_backend("fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_flashinfer_on_cpu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="attention backend 'flashinfer' cannot run here"):
        get_backend("flashinfer", "cpu", torch.float16, 64)


def test_torch_backend_refuses_integer_kv_dtypes():
    reason = unavailable_reason("torch", torch.device("cpu"), torch.int8, 64)
    assert reason is not None and "int8" in reason
    with pytest.raises(ValueError, match="KV dtype int8 is not supported"):
        get_backend("torch", "cpu", torch.int8, 64)


def test_every_backend_name_is_known():
    assert set(BACKEND_NAMES) == {"auto", "torch", "triton", "flashinfer"}


def test_a_model_with_sliding_windows_never_gets_a_backend_without_them(monkeypatch):
    """FlashInfer plans no per-layer window here: "auto" passes over it for a windowed model (even where
    it would run) and a request for it by name is refused with the reason."""
    from hfaccel.kernels import selection
    from hfaccel.kernels.flashinfer_backend import FlashInferPagedAttention

    assert not FlashInferPagedAttention.capabilities.sliding_window
    assert TorchPagedAttention.capabilities.sliding_window
    reason = unavailable_reason("flashinfer", torch.device("cuda"), torch.float16, 64, sliding_window=True)
    assert reason == "the flashinfer backend does not serve sliding-window attention layers"
    monkeypatch.setattr(FlashInferPagedAttention, "unavailable_reason", classmethod(lambda *a: None))
    chosen = [
        name
        for name in ("flashinfer", "triton", "torch")
        if selection.unavailable_reason(name, torch.device("cuda"), torch.float16, 64, True) is None
    ]
    assert "flashinfer" not in chosen
    assert selection.unavailable_reason("flashinfer", torch.device("cuda"), torch.float16, 64, False) is None
