"""Paged-attention backends. Nothing here imports the engine: a backend sees tensors and metadata only."""

from hfaccel.kernels.metadata import AttentionBackend, AttentionMetadata
from hfaccel.kernels.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "get_backend"]


def get_backend(name: str) -> AttentionBackend:
    """Return the backend called `name` (``"auto"`` picks the best available one)."""
    if name in ("auto", "torch"):
        return TorchPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}")
