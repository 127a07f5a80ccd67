"""Which attention backend serves a model: by name, or ``"auto"`` (the fastest one that can run here)."""

from __future__ import annotations

import importlib
import os

import torch

from hfaccel.kernels.metadata import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton", "flashinfer")
_MODULES = {
    "torch": ("hfaccel.kernels.torch_paged", "TorchPagedAttention"),
    "triton": ("hfaccel.kernels.triton_backend", "TritonPagedAttention"),
    "flashinfer": ("hfaccel.kernels.flashinfer_backend", "FlashInferPagedAttention"),
}


def triton_interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of backend `name`; ValueError naming what is missing if its package cannot load."""
    if name not in _MODULES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKEND_NAMES}")
    module, cls = _MODULES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as error:
        package = {
            "triton": "triton (pip install 'hfaccel[triton]')",
            "flashinfer": "flashinfer-python (pip install 'hfaccel[flashinfer]')",
        }.get(name, name)
        raise ValueError(f"attention backend {name!r} needs {package}: {error}") from error


# What a model's layers may need of a backend beyond causal attention (`BackendCapabilities` fields).
ATTENTION_NEEDS = {
    "sliding_window": "sliding-window attention layers",
    "chunked_attention": "chunked attention layers",
    "logit_softcap": "attention logit soft-capping",
    "attention_sinks": "attention sinks",
}


def unavailable_reason(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    needs: frozenset[str] = frozenset(),
) -> str | None:
    """Why backend `name` cannot serve this model here (None: it can). `needs`: what the model's layers
    ask beyond causal attention (`ATTENTION_NEEDS` names)."""
    try:
        cls = backend_class(name)
    except ValueError as error:
        return str(error)
    for need in sorted(needs):
        if not getattr(cls.capabilities, need):
            return f"the {name} backend does not serve {ATTENTION_NEEDS[need]}"
    return cls.unavailable_reason(torch.device(device), dtype, head_dim)


def get_backend(
    name: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    head_dim: int = 64,
    needs: frozenset[str] = frozenset(),
) -> AttentionBackend:
    """The backend called `name` for a model on `device` with KV `dtype` and `head_dim` whose layers need
    `needs` (`ATTENTION_NEEDS`: windows, chunks, soft-capping, sinks).

    ``"auto"`` picks FlashInfer on CUDA where it imports and supports the model, else Triton on CUDA,
    else torch. A named backend that cannot run here raises ValueError saying why.
    """
    device = torch.device(device)
    if name == "auto":
        candidates = ("flashinfer", "triton", "torch") if device.type == "cuda" else ("torch",)
        for candidate in candidates:
            if unavailable_reason(candidate, device, dtype, head_dim, needs) is None:
                return backend_class(candidate)()
        name = "torch"
    reason = unavailable_reason(name, device, dtype, head_dim, needs)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    return backend_class(name)()
