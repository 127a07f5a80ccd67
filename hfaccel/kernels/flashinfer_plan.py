"""What FlashInfer's paged wrappers are planned with, computed on the host from a step's block tables.

Pure functions over CPU int32 tensors; nothing here imports flashinfer, so all of it is tested on the CPU.

FlashInfer describes a batch's paged KV cache in CSR form:

- ``indptr`` ``[n + 1]``: sequence ``i`` owns pages ``indices[indptr[i]:indptr[i + 1]]``;
- ``indices`` ``[indptr[-1]]``: the page (block) ids, sequence after sequence;
- ``last_page_len`` ``[n]``: how many slots of the sequence's last page are filled,
  ``1 <= last_page_len <= page_size`` (a sequence of exactly ``k * page_size`` tokens has a full last
  page: ``page_size``).

A sequence of length 0 (a padded one) owns no page and gets ``last_page_len = 1``, which is how vLLM pads
a decode batch up to a CUDA-graph bucket: ``indptr`` repeats its last value. FlashInfer reads a
sequence with ``indptr[i + 1] == indptr[i]`` as empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _as_int32(values: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device="cpu", dtype=torch.int32).reshape(-1)
    return torch.tensor(list(values), dtype=torch.int32)


def decode_plan_inputs(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[int],
    block_size: int,
    batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indptr [n + 1], indices [nnz], last_page_len [n])`` of the sequences with `seq_lens`.

    Args:
        block_tables: ``[>= len(seq_lens), width]`` block ids per sequence (row ``i`` for sequence ``i``;
            entries past a sequence's blocks are ignored).
        seq_lens: context length of each sequence, this step's tokens included (0: a padded sequence).
        block_size: tokens per block (FlashInfer's ``page_size``).
        batch_size: pad to this many sequences (a CUDA-graph bucket): the extra ones own no page, their
            ``indptr`` repeats the last value and their ``last_page_len`` is 1. Default: no padding.
    """
    lens = _as_int32(seq_lens)
    n = lens.numel()
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if batch_size is None:
        batch_size = n
    if batch_size < n:
        raise ValueError(f"batch_size {batch_size} is smaller than the {n} sequences given")
    if n and int(lens.min()) < 0:
        raise ValueError(f"negative sequence length in {lens.tolist()}")
    tables = block_tables.to(device="cpu", dtype=torch.int32)
    if tables.dim() != 2 or tables.shape[0] < n:
        raise ValueError(f"block_tables of shape {tuple(tables.shape)} do not cover {n} sequences")
    pages = (lens + (block_size - 1)) // block_size
    width = tables.shape[1]
    if n and int(pages.max()) > width:
        raise ValueError(f"a sequence needs {int(pages.max())} blocks but the block tables have {width}")

    indptr = torch.zeros(batch_size + 1, dtype=torch.int32)
    if n:
        indptr[1 : n + 1] = torch.cumsum(pages, dim=0, dtype=torch.int32)
    indptr[n + 1 :] = indptr[n]
    owned = torch.arange(width, dtype=torch.int32)[None, :] < pages[:, None]  # [n, width]
    indices = tables[:n][owned]  # row-major: sequence after sequence, blocks in order
    last_page_len = torch.ones(batch_size, dtype=torch.int32)
    last_page_len[:n] = torch.where(lens > 0, (lens - 1) % block_size + 1, 1)
    return indptr, indices.contiguous(), last_page_len


def prefill_plan_inputs(
    query_lens: torch.Tensor | Sequence[int],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[int],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` of prefill/extend sequences.

    Sequence ``i`` computes its last ``query_lens[i]`` tokens over a context of ``seq_lens[i]`` tokens
    (a cached prefix plus those tokens, already written to the cache); with ``causal=True`` FlashInfer
    aligns the query to the end of the context, so query token ``j`` sees context positions
    ``<= seq_lens[i] - query_lens[i] + j``.
    """
    q = _as_int32(query_lens)
    lens = _as_int32(seq_lens)
    if q.numel() != lens.numel():
        raise ValueError(f"{q.numel()} query lengths for {lens.numel()} sequences")
    if q.numel() and (int(q.min()) < 1 or bool((q > lens).any())):
        raise ValueError(
            f"query lengths {q.tolist()} must be >= 1 and <= the sequence lengths {lens.tolist()}"
        )
    qo_indptr = torch.zeros(q.numel() + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(q, dim=0, dtype=torch.int32)
    kv_indptr, kv_indices, kv_last_page_len = decode_plan_inputs(block_tables, lens, block_size)
    return qo_indptr, kv_indptr, kv_indices, kv_last_page_len
