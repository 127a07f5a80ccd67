"""Paged-attention backends. Nothing here imports the engine: a backend sees tensors and metadata only."""

from hfaccel.kernels.metadata import (
    PAD_SLOT,
    AttentionBackend,
    AttentionMetadata,
    BackendCapabilities,
    MetadataBuilder,
    StepLayout,
)
from hfaccel.kernels.selection import BACKEND_NAMES, get_backend, unavailable_reason
from hfaccel.kernels.torch_paged import TorchPagedAttention

__all__ = [
    "BACKEND_NAMES",
    "PAD_SLOT",
    "AttentionBackend",
    "AttentionMetadata",
    "BackendCapabilities",
    "MetadataBuilder",
    "StepLayout",
    "TorchPagedAttention",
    "get_backend",
    "unavailable_reason",
]
