"""Decode buckets: pure-decode steps padded to a few fixed batch sizes, each compiled (and on CUDA,
captured as a graph) once and replayed.

A captured graph bakes in every shape and every host value it saw, so its key names all of them: the
bucket (tokens = sequences = bucket), the block-table width, the backend and the KV dtype. A step is
replayed on a graph only if its own key is equal (the bug HF's continuous batching once shipped: a
graph reused for a step whose shape it did not fit).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hfaccel.kernels.metadata import StepLayout


@dataclass(frozen=True)
class GraphKey:
    """Everything a captured decode graph depends on."""

    bucket: int  # padded sequences = padded tokens
    block_table_width: int
    backend: str
    kv_dtype: torch.dtype


def choose_bucket(layout: StepLayout, buckets: Sequence[int]) -> int | None:
    """The smallest bucket a pure one-token-per-sequence step fits, or None (run it eager)."""
    if layout.num_seqs == 0 or layout.num_decodes != layout.num_seqs:
        return None
    if any(q != 1 for q in layout.query_lens):
        return None
    index = bisect.bisect_left(buckets, layout.num_seqs)
    return buckets[index] if index < len(buckets) else None


def warmup_layout() -> StepLayout:
    """A step with no real sequence: padded to a bucket, it writes nowhere and reads nothing."""
    return StepLayout(query_lens=[], seq_lens=[], block_tables=[], slot_mapping=[], num_decodes=0)


class CapturedDecodeGraphs:
    """One CUDA graph per `GraphKey`, sharing one memory pool, replayed on the runner's buffers.

    `capture(key, run)` records `run()` (which must read only persistent buffers) after one warm-up
    call; `replay(key)` returns the output tensor the graph writes. Only on CUDA.

    Every graph ends by copying its logits into one shared output buffer (rows for the largest bucket,
    made outside any capture), and only that view is kept: a graph's own output, left alive, would pin
    its memory in the pool for good (every bucket's ``[bucket, vocab]``: over a GB for 35 buckets up to
    256 sequences and a 152k vocabulary), while freed at the end of its capture it is pool memory the
    next capture reuses. A step uses its logits before the next replay (the engine copies what it keeps).
    """

    def __init__(self, max_rows: int = 1) -> None:
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.max_rows = max_rows
        self._output: torch.Tensor | None = None

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, key: GraphKey, run: Callable[[], torch.Tensor]) -> None:
        """Warm `run` up on a side stream, then capture it under `key`."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = run()
        torch.cuda.current_stream().wait_stream(stream)
        output = self.output_view(warm)
        del warm
        graph = torch.cuda.CUDAGraph()
        # "thread_local": the user's own CUDA work in other threads (a plain forward, a training step)
        # may go on during a capture; only this thread's unsafe calls would spoil it.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output.copy_(run())
        self._graphs[key] = (graph, output)

    def output_view(self, like: torch.Tensor) -> torch.Tensor:
        """The shared output buffer's first rows, shaped and typed as `like` (a ``[rows, vocab]`` output);
        a new buffer where the current one does not fit (graphs captured on the old one keep it)."""
        rows, width = like.shape
        out = self._output
        fits = out is not None and out.shape[0] >= rows and out.shape[1] == width
        if not (fits and out.dtype == like.dtype and out.device == like.device):
            out = torch.empty((max(rows, self.max_rows), width), dtype=like.dtype, device=like.device)
            self._output = out
        return out[:rows]

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Replay the graph captured under exactly `key`; KeyError if there is none."""
        graph, output = self._graphs[key]
        graph.replay()
        return output

    def clear(self) -> None:
        """Drop every graph, the pool and the output buffer (frees their memory)."""
        self._graphs.clear()
        self._pool = None
        self._output = None


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """``"auto"``: compile decode steps on CUDA (with graphs, where the win is large); stay eager on a
    CPU, where a cold compile of a 30-layer model costs minutes for a modest gain (docs/benchmarks.md)."""
    if mode != "auto":
        return mode
    return "decode" if device.type == "cuda" else "off"
