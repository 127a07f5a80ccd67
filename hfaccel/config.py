"""EngineConfig: every knob of the engine, in parts (cache, scheduler, compilation, speculation, latency,
parallel), each validating itself.

Every knob is also a flat keyword and attribute, as it always was: ``EngineConfig(max_num_seqs=8)`` sets
``config.scheduler.max_num_seqs`` and ``config.max_num_seqs`` reads it; ``EngineConfig(scheduler=
SchedulerConfig(max_num_seqs=8))`` is the same config.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.kernels.selection import BACKEND_NAMES as BACKENDS

COMPILE_MODES = ("auto", "off", "decode", "all", "background")
SPECULATIVE_METHODS = (None, "ngram")
SCHEDULING_POLICIES = ("mixed", "prefill_first", "decode_first")
BATCHING_STRATEGIES = ("continuous", "dynamic", "static")
ADMISSION_MODES = ("warn", "reject")
# What "auto" (None) resolves to when memory does not bound it (see `engine/limits.py`).
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,  # quantized rows, a float32 scale each (`kernels/kv_quant.py`)
}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, memory, dtype, the longest sequence, prefix caching."""

    block_size: int = 16
    kv_cache_memory: int | float = 0.1
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    window_pool: bool = True

    def __post_init__(self) -> None:
        _require_positive_int("block_size", self.block_size)
        memory = self.kv_cache_memory
        if isinstance(memory, bool) or not isinstance(memory, (int, float)):
            raise ValueError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {memory!r}")
        if isinstance(memory, float) and not 0.0 < memory <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {memory}")
        if isinstance(memory, int) and memory <= 1:  # (1 as a fraction is the float 1.0)
            raise ValueError(
                f"kv_cache_memory in bytes must be more than 1, got {memory} (all of the free memory: 1.0)"
            )
        if isinstance(self.dtype, torch.dtype):
            floating = self.dtype.is_floating_point and self.dtype.itemsize >= 2
            if not floating and self.dtype != torch.int8:
                raise ValueError(
                    f"dtype {self.dtype} cannot hold a KV cache: use torch.float32, torch.float16, "
                    "torch.bfloat16, torch.int8 (quantized rows with a scale each) or 'auto'"
                )
        elif self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be a torch.dtype or one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None:
            _require_positive_int("max_model_len", self.max_model_len)
            if self.max_model_len < 2:  # a sequence of one token has no room for a new one
                raise ValueError("max_model_len must be at least 2 (a prompt token and a new one), got 1")
        _require_bool("enable_prefix_caching", self.enable_prefix_caching)
        _require_bool("window_pool", self.window_pool)


@dataclass(frozen=True)
class SchedulerConfig:
    """What a step holds and which requests are admitted: batch limits, chunking, policies, batching."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    scheduling_policy: str = "mixed"
    batching: str = "continuous"
    max_batch_size: int | None = None
    max_delay_ms: float = 50.0
    group_by_length: bool = False
    prefix_aware_admission: bool = False
    max_passed_over: int = 8
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None:
            _require_positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _require_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.long_prefill_token_threshold is not None:
            _require_positive_int("long_prefill_token_threshold", self.long_prefill_token_threshold)
        if self.max_batch_size is not None:
            _require_positive_int("max_batch_size", self.max_batch_size)
            if self.max_num_seqs is not None and self.max_batch_size > self.max_num_seqs:
                raise ValueError(
                    f"max_batch_size ({self.max_batch_size}) cannot exceed max_num_seqs ({self.max_num_seqs})"
                )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.batching not in BATCHING_STRATEGIES:
            raise ValueError(f"batching must be one of {BATCHING_STRATEGIES}, got {self.batching!r}")
        delay = self.max_delay_ms
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ValueError(f"max_delay_ms must be a number >= 0, got {delay!r}")
        _require_positive_int("max_passed_over", self.max_passed_over)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        for name in ("chunked_prefill", "group_by_length", "prefix_aware_admission"):
            _require_bool(name, getattr(self, name))


@dataclass(frozen=True)
class CompilationConfig:
    """How a step runs: the attention backend, torch.compile, CUDA graphs and their decode buckets."""

    backend: str = "auto"
    compile: str = "auto"
    cuda_graphs: bool | None = None
    cuda_graph_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None, got {self.cuda_graphs!r}")
        if self.compile == "background" and self.cuda_graphs:
            raise ValueError(
                "cuda_graphs=True needs compile='decode': compile='background' runs decode steps compiled "
                "without CUDA graphs"
            )
        sizes = self.cuda_graph_sizes
        if sizes is not None:
            if not isinstance(sizes, (tuple, list)) or not sizes:
                raise ValueError(f"cuda_graph_sizes must be a non-empty tuple of batch sizes, got {sizes!r}")
            for size in sizes:
                _require_positive_int("cuda_graph_sizes entries", size)
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: the draft source (a method name or a draft model) and how much it drafts."""

    speculative: str | Any | None = None
    num_speculative_tokens: int = 4
    speculative_min_acceptance: float = 0.25

    def __post_init__(self) -> None:
        if not is_draft_model(self.speculative) and (
            not isinstance(self.speculative, (str, type(None))) or self.speculative not in SPECULATIVE_METHODS
        ):
            raise ValueError(
                "speculative must be None, 'ngram' or a draft model (a causal LM with .config and .forward), "
                f"got {_short(self.speculative)}"
            )
        _require_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        minimum = self.speculative_min_acceptance
        if isinstance(minimum, bool) or not isinstance(minimum, (int, float)) or not 0 <= minimum <= 1:
            raise ValueError(f"speculative_min_acceptance must be in [0, 1], got {minimum!r}")

    def __repr__(self) -> str:  # a draft model is named by its class, not printed whole
        return f"SpeculativeConfig({_flat_repr(self)})"


@dataclass(frozen=True)
class LatencyConfig:
    """Latency targets (TPOT, TTFT) and what happens to a request whose target cannot be met."""

    tpot_target_ms: float | None = None
    ttft_target_ms: float | None = None
    admission: str = "warn"

    def __post_init__(self) -> None:
        for name in ("tpot_target_ms", "ttft_target_ms"):
            check_latency_target(name, getattr(self, name))
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")


def check_latency_target(name: str, value: Any) -> None:
    """A latency target is a positive number of milliseconds or None (NaN is none of these)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ValueError(f"{name} must be a positive number of milliseconds or None, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallelism: microbatches per step, and the sizes `hfaccel.patch` set the model up with (tensor,
    sequence, pipeline, expert and data parallel; None: not parallel). The sizes are fixed at a model's
    first patch (`patch(model, tensor_parallel_size=N)` records them here)."""

    num_microbatches: int = 1
    tensor_parallel_size: int | None = None
    sequence_parallel: bool | None = None
    pipeline_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    data_parallel_size: int | None = None

    def __post_init__(self) -> None:
        _require_positive_int("num_microbatches", self.num_microbatches)
        for name in SIZES:
            value = getattr(self, name)
            if value is not None:
                _require_positive_int(name, value)
        if self.sequence_parallel is not None:
            _require_bool("sequence_parallel", self.sequence_parallel)

    @property
    def sizes(self) -> dict[str, Any]:
        """The parallel layout (every field but `num_microbatches`)."""
        return {name: getattr(self, name) for name in (*SIZES, "sequence_parallel")}


SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "data_parallel_size")
PARTS: dict[str, type] = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "compilation": CompilationConfig,
    "speculation": SpeculativeConfig,
    "latency": LatencyConfig,
    "parallel": ParallelConfig,
}
# Every flat knob and the part that holds it.
FIELD_PART = {f.name: part for part, cls in PARTS.items() for f in dataclasses.fields(cls)}


class EngineConfig:
    """Configuration of the paged-KV continuous-batching engine, in parts: `cache` (`CacheConfig`),
    `scheduler` (`SchedulerConfig`), `compilation` (`CompilationConfig`), `speculation`
    (`SpeculativeConfig`), `latency` (`LatencyConfig`) and `parallel` (`ParallelConfig`). Give a part, or
    its knobs as flat keywords (a flat keyword overrides the same knob of a given part); every knob
    reads as a flat attribute too. Immutable: `with_overrides` makes a changed copy.

    Attributes (flat names):
        block_size: tokens per KV-cache block.
        max_num_seqs: most sequences in one running batch; ``None`` (auto): chosen when the engine is
            built from the KV memory, the model and the device (`engine/limits.py`; shown in the engine's
            repr and by ``python -m hfaccel doctor``). An explicit value is used exactly.
        max_num_batched_tokens: token budget of one step (decode tokens plus prefill chunks); ``None``
            (auto): chosen with ``max_num_seqs``.
        kv_cache_memory: KV-cache size, in bytes (an int > 1) or as a fraction of the free memory of the
            model's device (a float in (0, 1]); on a model with recurrent layers it holds the recurrent
            state of ``max_num_seqs`` sequences too (taken first).
        backend: paged-attention backend: ``"auto"`` picks the best one available, ``"torch"`` is the
            pure-PyTorch reference.
        dtype: KV-cache dtype (``"auto"`` follows the model's dtype, or ``"float32"``, ``"float16"``,
            ``"bfloat16"``, ``"int8"``, or such a ``torch.dtype``). ``"int8"`` stores each token's K and V
            row of each head as int8 values with a float32 scale (absmax / 127): about a quarter of a
            float32 cache's bytes, at a measured quality cost (docs/benchmarks.md); served by the torch
            backend (its C decode kernel reads the rows in place) and the Triton one, not FlashInfer.
        max_model_len: longest sequence (prompt plus generated tokens); ``None`` takes the model's
            ``max_position_embeddings``.
        enable_prefix_caching: share the KV blocks of prompt prefixes already computed (hash-chained
            full blocks, LRU eviction).
        window_pool: where sliding-window layers sit beside full-attention ones (Gemma 2/3, gpt-oss,
            Cohere 2), keep the sliding layers' K/V in a pool of their own whose blocks are given back
            as the window moves past them, so their memory stays bounded by the window. Off, every
            layer keeps every block (one pool, as for a model without sliding layers).
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
            dimension), ``"background"`` (as ``"decode"``, but each bucket compiles in a thread of its own
            at its first step while its steps run eager until it is ready: no step waits for a compile;
            no CUDA graphs), or ``"auto"`` (``"decode"`` on CUDA, ``"off"`` on a CPU: see
            docs/benchmarks.md).
        cuda_graphs: capture one CUDA graph per decode bucket and replay it (``None``: on where CUDA
            and the backend allow it; never on a CPU).
        cuda_graph_sizes: the decode buckets (batch sizes) steps are padded to; ``None``: 1, 2, 4, 8, then
            every multiple of 8 up to ``max_num_seqs``. A larger decode batch runs eager.
        speculative: speculative decoding: ``None`` (off), ``"ngram"`` (prompt lookup: drafts copied from
            the request's own context, no second model), or a draft model: a smaller causal LM with the
            same vocabulary (tokenizer) as the model, run on its own paged KV cache in the same engine.
        num_speculative_tokens: drafted tokens verified per request per step (k).
        speculative_min_acceptance: a request stops speculating once it has had 16+ drafts and accepted
            less than this share of them (drafts that keep failing only cost compute).
        num_microbatches: split each step into up to this many microbatches of whole sequences, each
            run through the model on its own (pipeline parallelism overlaps them across stages; on one
            process they run in turn).
        group_by_length: admit waiting prompts of similar length together (shortest first within a
            window of ``max_num_seqs`` waiting requests).
        tpot_target_ms: time-per-output-token target, kept as a mean over each request's tokens. When
            set, each step takes the decodes and as many prefill tokens as the engine's learnt step-time
            model says fit in the time the running requests' means still allow (SplitFuse: the chunk size
            follows the budget the target leaves), and a request is admitted only while the decode batch
            it joins still meets it. A request may carry its own. ``None``: no time-based limit (the
            schedule is exactly the token/sequence-budget one).
        ttft_target_ms: time-to-first-token target: a request whose target cannot be met given the queue
            (an estimate calibrated online against the TTFTs observed) is told so at once (see
            `admission`). A request may carry its own.
        admission: what happens to a request whose TTFT target cannot be met: ``"warn"`` (it is queued,
            with the reason in ``Request.warnings`` and one log line) or ``"reject"`` (it finishes at once
            with ``finish_reason="rejected"`` and the reason in ``Request.rejected_reason``).
        prefix_aware_admission: among waiting requests, admit first those whose prompt prefix is already
            cached (longest first), hold back one whose first block a running prefill is computing (it
            takes those blocks from the cache once they exist), within the fairness bound
            ``max_passed_over``.
        max_passed_over: a waiting request that later arrivals have overtaken this many times (prefix-aware
            order, or holding back for a shared prefix) goes first: bounded waiting.
        async_scheduling: prepare the next step's host work that does not depend on this step's tokens
            (prefix lookups of the waiting queue, the step-time model's refit) on this thread while the
            forward runs on a worker thread. ``None`` (auto): off (on a CPU the host's share of a step is
            about 1% and the measured gain nil, docs/benchmarks.md; not yet measured on CUDA).
        tensor_parallel_size, sequence_parallel, pipeline_parallel_size, expert_parallel_size,
            data_parallel_size: the parallel layout the model was set up with at its first `patch`.
    """

    cache: CacheConfig
    scheduler: SchedulerConfig
    compilation: CompilationConfig
    speculation: SpeculativeConfig
    latency: LatencyConfig
    parallel: ParallelConfig

    def __init__(
        self,
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        compilation: CompilationConfig | None = None,
        speculation: SpeculativeConfig | None = None,
        latency: LatencyConfig | None = None,
        parallel: ParallelConfig | None = None,
        **fields: Any,
    ) -> None:
        given = {
            "cache": cache,
            "scheduler": scheduler,
            "compilation": compilation,
            "speculation": speculation,
            "latency": latency,
            "parallel": parallel,
        }
        unknown = sorted(set(fields) - set(FIELD_PART))
        if unknown:
            raise ValueError(_unknown_message(unknown))
        for name, cls in PARTS.items():
            part = given[name]
            if part is not None and not isinstance(part, cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {type(part).__name__}")
            mine = {key: value for key, value in fields.items() if FIELD_PART[key] == name}
            part = part if part is not None else cls()
            part = dataclasses.replace(part, **mine) if mine else part
            object.__setattr__(self, name, part)
            for f in dataclasses.fields(part):  # flat reads are plain attributes (read every step)
                object.__setattr__(self, f.name, getattr(part, f.name))
        self._check_across_parts()

    def _check_across_parts(self) -> None:
        tokens = self.max_num_batched_tokens
        if tokens is not None and tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({tokens}) must be at least block_size ({self.block_size})"
            )
        sizes = self.cuda_graph_sizes
        if sizes is not None and self.max_num_seqs is not None and max(sizes) > self.max_num_seqs:
            raise ValueError(
                f"cuda_graph_sizes {tuple(sizes)} has sizes above max_num_seqs ({self.max_num_seqs})"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: use with_overrides")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def _parts(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in PARTS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and self._parts() == other._parts()

    def __hash__(self) -> int:
        return hash(self._parts())

    def __repr__(self) -> str:
        return f"EngineConfig({', '.join(_flat_repr(part) for part in self._parts())})"

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Every flat knob's name."""
        return tuple(FIELD_PART)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with some knobs (flat names) or whole parts replaced, validated again; unknown names
        raise ValueError."""
        unknown = sorted(set(overrides) - set(FIELD_PART) - set(PARTS))
        if unknown:
            raise ValueError(_unknown_message(unknown))
        parts = {name: overrides.pop(name, getattr(self, name)) for name in PARTS}
        return EngineConfig(**parts, **overrides)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """The batch sizes decode steps are padded to when compiled or graphed."""
        if self.cuda_graph_sizes is not None:
            return self.cuda_graph_sizes
        most = self.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        sizes = [s for s in (1, 2, 4) if s <= most]
        sizes += range(8, most + 1, 8)
        if sizes[-1] != most:
            sizes.append(most)
        return tuple(sizes)

    @property
    def batch_size(self) -> int:
        """Seats of one dynamic or static batch."""
        return self.max_batch_size or self.max_num_seqs or DEFAULT_MAX_NUM_SEQS

    @property
    def has_latency_targets(self) -> bool:
        return self.tpot_target_ms is not None or self.ttft_target_ms is not None

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache is stored in."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        return _DTYPES[self.dtype] or model_dtype


# Names users bring from elsewhere (vLLM, the CLI's --kv-cache-dtype) for a field named otherwise here.
_OTHER_NAMES = {"kv_cache_dtype": "dtype", "gpu_memory_utilization": "kv_cache_memory"}


def _unknown_message(unknown: list[str]) -> str:
    known = sorted(FIELD_PART)
    hints = [
        f"{name!r} -> {close[0]!r}"
        for name in unknown
        if (
            close := [_OTHER_NAMES[name]]
            if name in _OTHER_NAMES
            else difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        )
    ]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return f"unknown EngineConfig field(s) {unknown}{hint}; known fields: {known}"


def _flat_repr(part: Any) -> str:
    """``name=value`` for every knob of a part; a draft model is named by its class."""
    items = []
    for f in dataclasses.fields(part):
        value = getattr(part, f.name)
        text = (
            f"<{type(value).__name__}>" if f.name == "speculative" and is_draft_model(value) else repr(value)
        )
        items.append(f"{f.name}={text}")
    return ", ".join(items)


def is_draft_model(value: Any) -> bool:
    """Whether `value` is a draft model for ``speculative`` (an object with ``.config`` and a callable
    ``.forward``: a transformers causal LM), as opposed to a method name."""
    return (
        not isinstance(value, str) and hasattr(value, "config") and callable(getattr(value, "forward", None))
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{type(value).__name__} object"


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
