"""EngineConfig: every knob of the engine, validated when it is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("auto", "torch")
_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of the paged-KV continuous-batching engine.

    Attributes:
        block_size: tokens per KV-cache block.
        max_num_seqs: most sequences in one running batch.
        max_num_batched_tokens: token budget of one step (decode tokens plus prefill chunks).
        kv_cache_memory: KV-cache size, in bytes (an int > 1) or as a fraction of the free memory of the
            model's device (a float in (0, 1]).
        backend: paged-attention backend: ``"auto"`` picks the best one available, ``"torch"`` is the
            pure-PyTorch reference.
        dtype: KV-cache dtype (``"auto"`` follows the model's dtype, or ``"float32"``, ``"float16"``,
            ``"bfloat16"``, or a ``torch.dtype``).
        max_model_len: longest sequence (prompt plus generated tokens); ``None`` takes the model's
            ``max_position_embeddings``.
    """

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | float = 0.1
    backend: str = "auto"
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _require_positive_int("block_size", self.block_size)
        _require_positive_int("max_num_seqs", self.max_num_seqs)
        _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size "
                f"({self.block_size})"
            )
        memory = self.kv_cache_memory
        if isinstance(memory, bool) or not isinstance(memory, (int, float)):
            raise ValueError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {memory!r}")
        if isinstance(memory, float) and not 0.0 < memory <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {memory}")
        if isinstance(memory, int) and memory <= 1:
            raise ValueError(f"kv_cache_memory in bytes must be positive, got {memory}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.dtype, torch.dtype) and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be a torch.dtype or one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None:
            _require_positive_int("max_model_len", self.max_model_len)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """Return a copy with some fields replaced (validated again); unknown names raise ValueError."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown EngineConfig field(s) {unknown}; known fields: {sorted(known)}")
        return dataclasses.replace(self, **overrides)

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache is stored in."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        return _DTYPES[self.dtype] or model_dtype


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
