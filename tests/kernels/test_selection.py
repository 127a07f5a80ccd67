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


def test_torch_and_triton_take_an_int8_kv_cache_and_flashinfer_does_not():
    """An int8 cache holds quantized rows (`kv_quant`): the torch and Triton backends read them; FlashInfer
    does not (its capabilities lack int8), so "auto" picks Triton on CUDA (its int8 rows padded to 16
    bytes decode faster than fp16 ones on an H200)."""
    from hfaccel.kernels.flashinfer_backend import FlashInferPagedAttention

    assert unavailable_reason("torch", torch.device("cpu"), torch.int8, 64) is None
    assert unavailable_reason("triton", torch.device("cuda"), torch.int8, 64) is None
    assert torch.int8 not in FlashInferPagedAttention.capabilities.dtypes
    assert get_backend("auto", "cuda", torch.int8, 64).name == "triton"
    assert get_backend("auto", "cuda", torch.float16, 64).name == "triton"  # FlashInfer is not installed
    assert get_backend("triton", "cuda", torch.int8, 64).name == "triton"
    assert unavailable_reason("torch", torch.device("cpu"), torch.int16, 64) is not None


def test_every_backend_name_is_known():
    assert set(BACKEND_NAMES) == {"auto", "torch", "triton", "flashinfer"}


def test_a_model_gets_only_a_backend_that_serves_what_its_layers_need(monkeypatch):
    """Windows, chunks, soft-capping and sinks (what the guard's probe records, `attention_needs`): a
    backend whose capabilities lack one is passed over by "auto" (FlashInfer, even where it would run;
    Triton, for soft-capping and sinks) and refused by name with the reason."""
    from hfaccel.kernels.flashinfer_backend import FlashInferPagedAttention
    from hfaccel.kernels.triton_backend import TritonPagedAttention

    cuda, half = torch.device("cuda"), torch.float16
    window = frozenset({"sliding_window"})
    assert not FlashInferPagedAttention.capabilities.sliding_window
    reason = unavailable_reason("flashinfer", cuda, half, 64, window)
    assert reason == "the flashinfer backend does not serve sliding-window attention layers"
    monkeypatch.setattr(FlashInferPagedAttention, "unavailable_reason", classmethod(lambda *a: None))
    monkeypatch.setattr(TritonPagedAttention, "unavailable_reason", classmethod(lambda *a: None))
    assert unavailable_reason("flashinfer", cuda, half, 64) is None
    assert get_backend("auto", cuda, half, 64, window).name == "triton"
    assert get_backend("auto", cuda, half, 64, frozenset({"chunked_attention"})).name == "triton"
    for need in ("logit_softcap", "attention_sinks"):
        assert get_backend("auto", cuda, half, 64, frozenset({need, "sliding_window"})).name == "torch"
        assert "does not serve" in unavailable_reason("triton", cuda, half, 64, frozenset({need}))
