"""EngineConfig: every knob of the engine, validated when it is built."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.kernels.selection import BACKEND_NAMES as BACKENDS

COMPILE_MODES = ("auto", "off", "decode", "all")
SCHEDULING_POLICIES = ("mixed", "prefill_first", "decode_first")
BATCHING_STRATEGIES = ("continuous", "dynamic", "static")
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
        enable_prefix_caching: share the KV blocks of prompt prefixes already computed (hash-chained
            full blocks, LRU eviction).
        chunked_prefill: split prompts longer than the step's remaining budget over several steps. Off,
            a prompt is computed in one step and must fit ``max_num_batched_tokens``.
        long_prefill_token_threshold: most prompt tokens one request computes in one step (``None``:
            bounded by the budget only); small chunks keep the running decodes flowing.
        scheduling_policy: ``"mixed"`` (decodes first, then prefill chunks in the same step),
            ``"prefill_first"`` (a step holds prefills only while any can run: lowest TTFT) or
            ``"decode_first"`` (a step holds decodes only while any request decodes: smoothest
            inter-token latency, new prompts wait for the batch to drain).
        batching: ``"continuous"`` (requests join and leave at every step), ``"dynamic"`` (a batch is
            formed from up to ``max_batch_size`` waiting requests once that many wait or the oldest has
            waited ``max_delay_ms``, and runs to completion before the next) or ``"static"`` (batches of
            exactly ``max_batch_size`` in arrival order, run to completion).
        max_batch_size: batch size of the dynamic and static strategies (``None``: ``max_num_seqs``).
        max_delay_ms: longest wait of the dynamic strategy before it runs a partial batch.
        compile: ``torch.compile`` of the model forward: ``"off"``, ``"decode"`` (pure-decode steps, padded
            to a bucket of ``cuda_graph_sizes``), ``"all"`` (also prefill/mixed steps, with a dynamic token
            dimension), or ``"auto"`` (``"decode"`` on CUDA, ``"off"`` on a CPU: see docs/benchmarks.md).
        cuda_graphs: capture one CUDA graph per decode bucket and replay it (``None``: on where CUDA
            and the backend allow it; never on a CPU).
        cuda_graph_sizes: the decode buckets (batch sizes) steps are padded to; ``None``: 1, 2, 4, 8, then
            every multiple of 8 up to ``max_num_seqs``. A larger decode batch runs eager.
        group_by_length: admit waiting prompts of similar length together (shortest first within a
            window of ``max_num_seqs`` waiting requests).
    """

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | float = 0.1
    backend: str = "auto"
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    scheduling_policy: str = "mixed"
    batching: str = "continuous"
    max_batch_size: int | None = None
    max_delay_ms: float = 50.0
    group_by_length: bool = False
    compile: str = "auto"
    cuda_graphs: bool | None = None
    cuda_graph_sizes: tuple[int, ...] | None = None

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
        if isinstance(self.dtype, torch.dtype):
            if not self.dtype.is_floating_point or self.dtype.itemsize < 2:
                raise ValueError(
                    f"dtype {self.dtype} cannot hold a KV cache: integer and float8 caches would need "
                    "quantisation scales the engine does not keep; use torch.float32, torch.float16, "
                    "torch.bfloat16 or 'auto'"
                )
        elif self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be a torch.dtype or one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None:
            _require_positive_int("max_model_len", self.max_model_len)
        if self.long_prefill_token_threshold is not None:
            _require_positive_int("long_prefill_token_threshold", self.long_prefill_token_threshold)
        if self.max_batch_size is not None:
            _require_positive_int("max_batch_size", self.max_batch_size)
            if self.max_batch_size > self.max_num_seqs:
                raise ValueError(
                    f"max_batch_size ({self.max_batch_size}) cannot exceed max_num_seqs ({self.max_num_seqs})"
                )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.batching not in BATCHING_STRATEGIES:
            raise ValueError(f"batching must be one of {BATCHING_STRATEGIES}, got {self.batching!r}")
        if (
            isinstance(self.max_delay_ms, bool)
            or not isinstance(self.max_delay_ms, (int, float))
            or (self.max_delay_ms < 0)
        ):
            raise ValueError(f"max_delay_ms must be a number >= 0, got {self.max_delay_ms!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None, got {self.cuda_graphs!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if not isinstance(sizes, (tuple, list)) or not sizes:
                raise ValueError(f"cuda_graph_sizes must be a non-empty tuple of batch sizes, got {sizes!r}")
            for size in sizes:
                _require_positive_int("cuda_graph_sizes entries", size)
            if max(sizes) > self.max_num_seqs:
                raise ValueError(
                    f"cuda_graph_sizes {tuple(sizes)} has sizes above max_num_seqs ({self.max_num_seqs})"
                )
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))
        for name in ("enable_prefix_caching", "chunked_prefill", "group_by_length"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """Return a copy with some fields replaced (validated again); unknown names raise ValueError."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            hints = [
                f"{name!r} -> {close[0]!r}"
                for name in unknown
                if (close := difflib.get_close_matches(name, known, n=1, cutoff=0.75))
            ]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise ValueError(f"unknown EngineConfig field(s) {unknown}{hint}; known fields: {sorted(known)}")
        return dataclasses.replace(self, **overrides)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """The batch sizes decode steps are padded to when compiled or graphed."""
        if self.cuda_graph_sizes is not None:
            return self.cuda_graph_sizes
        sizes = [s for s in (1, 2, 4) if s <= self.max_num_seqs]
        sizes += range(8, self.max_num_seqs + 1, 8)
        if sizes[-1] != self.max_num_seqs:
            sizes.append(self.max_num_seqs)
        return tuple(sizes)

    @property
    def batch_size(self) -> int:
        """Seats of one dynamic or static batch."""
        return self.max_batch_size or self.max_num_seqs

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache is stored in."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        return _DTYPES[self.dtype] or model_dtype


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
