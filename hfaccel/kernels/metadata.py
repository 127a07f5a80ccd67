"""What one engine step tells the attention backend, and the interface every backend implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Layout of one packed step: B sequences, T tokens in all, sequences with one query token first.

    Attributes:
        slot_mapping: ``[T]`` cache slot (``block * block_size + offset``) each new token's K/V goes to.
        query_start_loc: ``B + 1`` offsets of each sequence's tokens in the packed step (cu_seqlens_q).
        seq_lens: ``B`` context lengths, this step's tokens included.
        block_tables: ``[B, max_blocks]`` block ids of each sequence, padded with 0.
        num_decodes: how many leading sequences have exactly one query token.
        block_size: tokens per block.
        kv_caches: per layer, ``(k_cache, v_cache)`` of shape ``[num_blocks, block_size, Hkv, D]``.
        backend: the backend that serves this step.
        backend_state: what the backend derives once per step in ``prepare`` (gather indices, masks, plans).
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    num_decodes: int
    block_size: int
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend | None = None
    backend_state: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


class AttentionBackend(Protocol):
    """A paged-attention implementation. Tensors use the packed layout ``[T, heads, head_dim]``."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Derive per-step state (shared by every layer) into ``meta.backend_state``."""

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's ``key``/``value`` ``[T, Hkv, D]`` at ``meta.slot_mapping``."""

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, Hq, D]`` over each sequence's context; returns ``[T, Hq, D]``."""
