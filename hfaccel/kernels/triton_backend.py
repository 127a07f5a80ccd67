"""The Triton backend: the kernels of `hfaccel.kernels.triton` on the shared paged cache layout.

A step whose sequences all decode runs the split-KV decode kernel (its grid depends only on the batch
bucket, so a captured CUDA graph replays it); any other step runs the prefill/extend kernel once over
every sequence, decodes included. K/V are stored first by the slot-mapping kernel, which skips padded
slots (``-1``), so no scratch block is needed.

Triton needs a CUDA device, or its CPU interpreter (``TRITON_INTERPRET=1`` set before import), which
the tests use: correct, and far too slow to be a speed path.
"""

from __future__ import annotations

import importlib.util

import torch

from hfaccel.kernels.metadata import AttentionBackend, AttentionMetadata, BackendCapabilities
from hfaccel.kernels.selection import triton_interpreting


class TritonPagedAttention(AttentionBackend):
    """Paged attention in Triton kernels (fp32 accumulation for every input dtype)."""

    name = "triton"
    capabilities = BackendCapabilities(
        # int8: quantized rows with a scale each (`kv_quant`), dequantized as the kernels load them.
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int8}),
        head_dims=frozenset({16, 32, 64, 128, 256}),
        devices=frozenset({"cuda", "cpu"}),  # cpu only under the interpreter
        cuda_graph_decode=True,
        decode_query_len=1,
        sliding_window=True,
        chunked_attention=True,
        # An int8 row padded to 16 bytes loads as vectors: the decode kernel at D = 128 took 92 us against
        # fp16's 115 us on an H200, and 595 us with rows of 132 bytes, read a byte at a time (2026-11-26).
        quantized_row_align=16,
    )

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'hfaccel[triton]')"
        if device.type == "cpu" and not triton_interpreting():
            return (
                "Triton kernels need a CUDA device (on a CPU they only run under the interpreter, "
                "TRITON_INTERPRET=1, which is for tests)"
            )
        return super().unavailable_reason(device, dtype, head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if softcap > 0 or sinks is not None:  # never given: its capabilities say it serves neither
            raise ValueError(
                "the triton backend serves no logit soft-capping or attention sinks; use 'torch'"
            )
        from hfaccel.kernels.triton import paged_decode, paged_prefill, store_kv

        k_cache, v_cache = kv_cache
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.num_decodes == meta.num_seqs:  # a pure decode step: one token per (padded) sequence
            rows = meta.num_padded_seqs
            out = torch.zeros_like(query) if meta.num_padded_tokens > rows else torch.empty_like(query)
            paged_decode(
                query[:rows],
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                out=out[:rows],
                window=window,
                chunk=chunk,
            )
            return out
        out = torch.zeros_like(query) if meta.num_padded_tokens > meta.num_tokens else torch.empty_like(query)
        return paged_prefill(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            out=out,
            window=window,
            chunk=chunk,
        )
