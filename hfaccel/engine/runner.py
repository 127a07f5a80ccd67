"""Runs one packed step: persistent input buffers, the paged KV cache, the backend's metadata, the model.

Everything a step needs on the device lives in buffers allocated once per engine (a pinned host
mirror plus a device copy on CUDA) and filled in place: token ids, positions, the sampled positions,
and, through the backend's builder, the attention metadata. The model is reached only through the
`ModelExecutor` interface, inside a forward context that tells every layer's attention op the step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from hfaccel.engine import recorded_states
from hfaccel.engine.background_compile import BackgroundCompiler, background_unavailable_reason
from hfaccel.engine.batch import PackedStep
from hfaccel.engine.decode_buckets import CapturedDecodeGraphs, GraphKey, choose_bucket, warmup_layout
from hfaccel.engine.executor import ModelExecutor
from hfaccel.engine.microbatch import split_microbatches
from hfaccel.kernels import kv_quant
from hfaccel.kernels.metadata import AttentionBackend, StepLayout
from hfaccel.kernels.op import ForwardContext, forward_context

logger = logging.getLogger("hfaccel")


class ModelRunner:
    """Owns the KV cache (one ``(k_cache, v_cache)`` pair per layer), the step buffers and the forward."""

    def __init__(
        self,
        executor: ModelExecutor,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        compile_mode: str = "off",
        cuda_graphs: bool = False,
        decode_buckets: tuple[int, ...] = (),
        compile_dynamic: bool = True,
        num_microbatches: int = 1,
        window_pool: tuple[frozenset[int], int] | None = None,
    ) -> None:
        if compile_mode not in ("off", "decode", "all", "background"):
            raise ValueError(
                f"compile_mode must be 'off', 'decode', 'all' or 'background', got {compile_mode!r}"
            )
        if compile_mode == "background":
            if cuda_graphs:
                raise ValueError("compile='background' runs decode steps without CUDA graphs: use 'decode'")
            if executor.step_sync is not None or executor.pipelined:  # its ranks' collectives must pair up
                raise ValueError(
                    "compile='background' runs in one process: use compile='decode' with parallelism"
                )
            reason = background_unavailable_reason()
            if reason is not None:
                raise ValueError(f"compile='background': {reason}")
        if cuda_graphs and (self._no_graphs_reason(executor, backend) is not None):
            raise ValueError(
                f"cuda_graphs=True is not possible here: {self._no_graphs_reason(executor, backend)}"
            )
        self.executor = executor
        self.num_microbatches = num_microbatches
        self.microbatch_log: deque[list[int]] = deque(maxlen=1000)  # sequences per microbatch, per split step
        self.compile_mode = compile_mode
        self.cuda_graphs = cuda_graphs
        self.compile_dynamic = compile_dynamic
        self.kv_dtype = kv_dtype
        # Buckets only matter when decode steps are compiled or graphed.
        self.decode_buckets = decode_buckets if (compile_mode != "off" or cuda_graphs) else ()
        self.max_blocks_per_seq = max_blocks_per_seq
        self._compiled: dict[object, Callable[..., torch.Tensor]] = {}
        self.graphs = CapturedDecodeGraphs(max(self.decode_buckets, default=1))
        self.backend = backend
        self.block_size = block_size
        self.device = executor.device
        self.max_num_tokens = max_num_tokens
        # The sliding layers of a model with full ones keep K/V in a pool of their own, of
        # `num_window_blocks` blocks (`engine/window_blocks.py`): their caches are that much smaller.
        self.window_layers, num_window_blocks = window_pool or (frozenset(), 0)
        geometry = (block_size, executor.num_kv_heads, executor.head_dim, kv_dtype)
        # A recurrent layer (beside attention layers, or in a model of them alone) keeps no K/V: its
        # cache has no blocks, so the layer indices stay the model's.
        kept = self._kv_layers = kv_layer_indices(executor)
        shapes = {
            "full": backend.kv_cache_shape(num_blocks, *geometry),
            "window": backend.kv_cache_shape(num_window_blocks, *geometry),
            "none": backend.kv_cache_shape(0, *geometry),
        }
        pools = [
            "none" if i not in kept else "window" if i in self.window_layers else "full"
            for i in range(executor.num_layers)
        ]
        # Zeroed, not empty: masked-out slots may still be read, and NaN garbage would leak through.
        self.kv_caches = [
            (
                torch.zeros(shapes[pool], dtype=kv_dtype, device=self.device),
                torch.zeros(shapes[pool], dtype=kv_dtype, device=self.device),
            )
            for pool in pools
        ]
        self._builder_args = (max_num_seqs, max_num_tokens, max_blocks_per_seq, block_size, self.device)
        self._num_blocks = num_blocks
        self._num_window_blocks = num_window_blocks
        self._geometry = (
            executor.num_q_heads,
            executor.num_kv_heads,
            executor.head_dim,
            kv_dtype,
            executor.attention_scale,
        )
        # A bucket captured in a graph is planned on its own fixed-buffer wrapper (backends that plan on
        # the host): a plan on the shared one would rebind the buffers a graph replays.
        graph_sizes = self.decode_buckets if cuda_graphs else ()
        self.builder = self._make_builder(graph_sizes)
        self.window_builder = (
            self._make_builder(graph_sizes, num_window_blocks) if self.window_layers else None
        )
        self._warm_inputs: tuple | None = None  # the background compile's buffers and builder, kept
        # compile="background": decode buckets compile in a thread of their own, eager until ready.
        self.background = (
            BackgroundCompiler(lambda: executor.compile(dynamic=False), self._warm_bucket)
            if compile_mode == "background"
            else None
        )
        pin = self.device.type == "cuda"
        # One column more than a step uses: a step's [1, T] view then always has T below its row stride, so
        # a compiled forward never specialises on T == stride (transformers 5.17's rotary made dynamo
        # guard on it, and the full bucket recompiled).
        self._host = {
            "input_ids": torch.zeros((1, max_num_tokens + 1), dtype=torch.long, pin_memory=pin),
            "positions": torch.zeros((1, max_num_tokens + 1), dtype=torch.long, pin_memory=pin),
            # Sampled rows: one per sequence, or 1 + k for a sequence verifying k drafts.
            "logits_indices": torch.zeros((max_num_tokens,), dtype=torch.long, pin_memory=pin),
        }
        self._host_arrays = {n: t.view(-1).numpy() for n, t in self._host.items()}  # what `_stage` fills
        self._dev = (
            self._host
            if self.device.type == "cpu"
            else {n: torch.zeros_like(t, device=self.device) for n, t in self._host.items()}
        )
        # The host buffers are pinned and copied asynchronously: the next step may rewrite them only once
        # the previous step's copies have left them.
        self._copied: torch.cuda.Event | None = None
        if cuda_graphs:  # a graph bakes in the block-table width: keep it fixed
            for builder in (self.builder, self.window_builder):
                if builder is not None:
                    builder.fixed_width = max_blocks_per_seq

    @staticmethod
    def _no_graphs_reason(executor: ModelExecutor, backend: AttentionBackend) -> str | None:
        if executor.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if not backend.capabilities.cuda_graph_decode:
            return f"the {backend.name!r} attention backend cannot be captured in a CUDA graph"
        return None

    def _stage(self, name: str, values: list[int], size: int | None = None) -> torch.Tensor:
        """Copy `values` into buffer `name` in place; the device view of its first `size` entries."""
        size = len(values) if size is None else size
        host = self._host[name]
        flat = self._host_arrays[name]
        flat[: len(values)] = values
        flat[len(values) : size] = 0  # padding: a valid token id / position, its output is ignored
        host_view = host[:, :size] if host.dim() == 2 else host[:size]
        if self._dev is self._host:  # a CPU: the host buffer is the device's
            return host_view
        dev_view = self._dev[name][:, :size] if host.dim() == 2 else self._dev[name][:size]
        dev_view.copy_(host_view, non_blocking=True)
        return dev_view

    @torch.inference_mode()
    def run(self, packed: PackedStep, bucket: int | None = None) -> torch.Tensor:
        """Forward one packed step; returns the ``[N, V]`` logits of the sampled positions.

        A pure-decode step that fits a bucket is padded to it and runs compiled (and on CUDA, as a
        replayed graph); any other step runs eager, or compiled with a dynamic token count under
        ``compile="all"``. `bucket` forces the padding (warm-up).
        """
        if self.executor.pipelined:  # pipeline parallel: the stage streams the microbatches itself
            parts = [packed]
            if self.num_microbatches > 1 and packed.layout.num_seqs > 1:
                parts = split_microbatches(
                    packed, self.num_microbatches, self.backend.capabilities.decode_query_len
                )
                if len(parts) > 1:
                    self.microbatch_log.append([len(p.layout.query_lens) for p in parts])
            return self.executor.run_pipeline(parts, self._prepare)[: len(packed.logits_indices)]
        # A step that feeds prompt embeddings runs whole (microbatches carry token ids only).
        if (
            self.num_microbatches > 1
            and bucket is None
            and packed.layout.num_seqs > 1
            and packed.prompt_embeds is None
            and packed.recorded is None
        ):
            parts = split_microbatches(
                packed, self.num_microbatches, self.backend.capabilities.decode_query_len
            )
            if len(parts) > 1:
                self.microbatch_log.append([len(p.layout.query_lens) for p in parts])
                # Each part runs alone; clone: a replayed graph's output buffer is reused by the next part.
                return torch.cat([self._run_one(part, None).clone() for part in parts])
        return self._run_one(packed, bucket)

    def _prepare(self, packed: PackedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardContext]:
        """Stage one (eager, unpadded) step's inputs and build its metadata: what a pipeline stage runs."""
        tokens = len(packed.input_ids)
        input_ids = self._stage("input_ids", packed.input_ids, tokens)
        positions = self._stage("positions", packed.positions, tokens)
        logits_indices = self._stage("logits_indices", packed.logits_indices, len(packed.logits_indices))
        return input_ids, positions, logits_indices, self._context(packed.layout, None, tokens)

    def _run_one(self, packed: PackedStep, bucket: int | None) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        adapters = packed.token_adapters  # per-token LoRA adapters: such a step runs eager
        embeds = packed.prompt_embeds  # prompt embeddings: only in prefill steps, which run eager
        recorded = packed.recorded  # requests that see what the model computes: such a step runs eager
        eager = adapters is not None or embeds is not None or recorded is not None
        if bucket is None and self.decode_buckets and not eager:
            bucket = choose_bucket(packed.layout, self.decode_buckets)
        compiled = self._compiled_for(bucket) if not eager else None
        if compiled is None and self.background is not None:
            bucket = None  # its graph is compiling in the background: eager, unpadded
        # A dynamic-shape graph specialises sizes 0 and 1: pad its token and sampled-row counts to 2+.
        floor = 2 if compiled is not None and bucket is None else 0
        tokens = bucket or max(len(packed.input_ids), floor)
        # Sequence parallel (hfaccel/patches/tp_executor.py): a step with prefill tokens is padded to a
        # multiple of the TP size; padded tokens have slot -1 and belong to no sequence.
        if bucket is None and self.executor.max_token_padding:
            tokens = self.executor.pad_tokens(packed.layout, tokens)
        input_ids = self._stage("input_ids", packed.input_ids, tokens)
        positions = self._stage("positions", packed.positions, tokens)
        sampled = len(packed.logits_indices)
        rows = bucket or max(sampled, floor)
        logits_indices = self._stage("logits_indices", packed.logits_indices, rows)
        context = self._context(packed.layout, bucket, tokens)
        # (`pack_step`'s sampled indices strictly increase: as many as the tokens, they are all of them)
        context.samples_every_token = tokens == len(packed.input_ids) == sampled == rows
        metadata = context.metadata
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if recorded is not None:
            return self._run_recorded(packed, context, input_ids, positions, logits_indices)
        key = self._graph_key(bucket, metadata) if bucket is not None and self.cuda_graphs else None
        if key is not None and key not in self.graphs:
            self._capture(key, context, input_ids, positions, logits_indices)
        if key is not None and key in self.graphs:  # a failed capture turned graphs off
            logits = self.graphs.replay(key)
        else:
            extra = {} if adapters is None else {"token_adapters": adapters}
            if embeds is not None:
                extra["prompt_embeds"] = self._prompt_embeds(embeds)
            with forward_context(context):
                logits = self.executor.forward(
                    input_ids, positions, logits_indices, compiled=compiled, **extra
                )
        return logits[: len(packed.logits_indices)]

    def _run_recorded(
        self, packed: PackedStep, context: ForwardContext, *inputs: torch.Tensor
    ) -> torch.Tensor:
        """An eager step whose recording requests keep their tokens' hidden states and attention
        probabilities (`recorded_states`)."""
        requests = [entry[1] for entry in packed.recorded]
        context.record_attentions = any(r.sampling.output_attentions for r in requests)
        extra: dict[str, Any] = {"record": True}
        if packed.token_adapters is not None:
            extra["token_adapters"] = packed.token_adapters
        if packed.prompt_embeds is not None:
            extra["prompt_embeds"] = self._prompt_embeds(packed.prompt_embeds)
        with forward_context(context):
            logits = self.executor.forward(*inputs, **extra)
        hidden_states, attentions = self.executor.recorded
        self.executor.recorded = None
        recorded_states.store(packed.recorded, hidden_states, attentions)
        return logits[: len(packed.logits_indices)]

    def _context(
        self, layout: StepLayout, bucket: int | None, tokens: int, builders: tuple | None = None
    ) -> ForwardContext:
        """The step's forward context: its metadata built in the builders' buffers (the window pool's
        too, for a model whose sliding layers have one)."""
        builder, window_builder = builders or (self.builder, self.window_builder)
        context = ForwardContext(self.backend, builder.build(layout, bucket, tokens), self.kv_caches, layout)
        if window_builder is not None:
            context.window_layers = self.window_layers
            context.window_metadata = window_builder.build(layout.window_view(), bucket, tokens)
        return context

    def _prompt_embeds(self, runs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed indices of the step's embedded prompt tokens and their embedding rows, ``[n, H]``."""
        index = torch.cat([torch.arange(at, at + end - start) for at, _, start, end in runs])
        rows = torch.cat([request.prompt_embeds[start:end] for _, request, start, end in runs])
        return index.to(self.device), rows.to(self.device)

    def _compiled_for(self, bucket: int | None) -> Callable[..., torch.Tensor] | None:
        """The compiled forward for a bucketed decode step (or, under "all", any step); None: eager."""
        if self.compile_mode == "off" or (bucket is None and self.compile_mode != "all"):
            return None
        if self.background is not None:
            return self.background.ready(bucket)
        dynamic = bucket is None or self.compile_dynamic
        # One compiled function for every shape (dynamic tokens; dynamo still specialises size 1), or one
        # per bucket (static shapes). Each is compiled over its own copy of the forward's code, so each
        # has its own dynamo cache and recompile budget (`patches/compiled_forward.py`).
        slot = "dynamic" if dynamic else bucket
        if slot not in self._compiled:
            self._compiled[slot] = self.executor.compile(dynamic=dynamic)
        return self._compiled[slot]

    def _graph_key(self, bucket: int, metadata: object) -> GraphKey:
        common = getattr(metadata, "common", metadata)
        return GraphKey(bucket, common.block_tables.shape[1], self.backend.name, self.kv_dtype)

    def _capture(self, key, context, input_ids, positions, logits_indices) -> None:
        compiled = self._compiled_for(key.bucket)

        def run() -> torch.Tensor:
            with forward_context(context):
                return self.executor.forward(input_ids, positions, logits_indices, compiled=compiled)

        try:
            self.graphs.capture(key, run)
        except Exception as error:  # not a Ctrl-C: that propagates
            # A model whose step cannot be captured (a host sync, a data-dependent shape) runs without
            # graphs from now on, compiled or eager as configured, rather than failing every decode step.
            logger.warning(
                "hfaccel: CUDA graphs turned off: capturing a decode step of bucket %d failed (%s: %s)",
                key.bucket,
                type(error).__name__,
                error,
            )
            self.cuda_graphs = False
            self.graphs.clear()

    def warmup(self, progress: bool = True) -> float:
        """Compile (and on CUDA capture) every decode bucket now, largest first; returns the seconds.

        Each bucket runs a step with no real sequence (it writes nowhere, reads nothing)."""
        start = time.perf_counter()
        if self.background is not None:  # queue every bucket, smallest (the likeliest) first; nothing waits
            for bucket in sorted(self.decode_buckets):
                self.background.ready(bucket)
            return 0.0
        buckets = (
            sorted(self.decode_buckets, reverse=True)
            if self.compile_mode != "off" or self.cuda_graphs
            else []
        )
        steps = buckets + ([None] if self.compile_mode == "all" else [])  # None: a dynamic-shape step
        for bucket in tqdm(steps, desc="hfaccel warm-up", unit="graph", disable=not progress, leave=False):
            # A mixed step has more tokens than sampled rows (3 padded tokens, 2 rows): warming it with equal
            # counts would let dynamo's duck sizing assume they are always equal, and recompile later.
            ids = [] if bucket is not None else [0, 0, 0]
            self.run(PackedStep(ids, [0] * len(ids), [], [], warmup_layout()), bucket=bucket)
        return time.perf_counter() - start

    def _make_builder(self, graph_sizes: tuple[int, ...], num_blocks: int | None = None) -> Any:
        """A metadata builder over buffers of its own (for a cache of `num_blocks`, by default the
        engine's), told the attention geometry where it plans."""
        count = self._num_blocks if num_blocks is None else num_blocks
        builder = self.backend.make_builder(*self._builder_args, num_blocks=count)
        configure = getattr(builder, "configure", None)
        if configure is not None:  # backends that plan on the host need the attention geometry once
            configure(*self._geometry, cuda_graph_batch_sizes=graph_sizes)
        return builder

    def close(self) -> None:
        """The engine is being released: no more background compiles (`BackgroundCompiler.close`)."""
        if self.background is not None:
            self.background.close()

    def _warm_bucket(self, compiled: Callable[..., torch.Tensor], bucket: int) -> None:
        """Run `compiled` once on a decode step of `bucket` padded sequences, from the background compile
        thread: buffers of its own like the engine's (shapes, strides, and made outside inference mode as
        they were, so the engine's calls pass the graph's guards), made once and kept with its builder,
        and a step of padding (it writes only the scratch block, reads nothing)."""
        if self._warm_inputs is None:
            buffers = {name: torch.zeros_like(buffer) for name, buffer in self._dev.items()}
            window = None if self.window_builder is None else self._make_builder((), self._num_window_blocks)
            self._warm_inputs = (buffers, (self._make_builder(()), window))
        buffers, builders = self._warm_inputs
        context = self._context(warmup_layout(), bucket, bucket, builders)
        with torch.inference_mode(), forward_context(context):
            self.executor.forward(
                buffers["input_ids"][:, :bucket],
                buffers["positions"][:, :bucket],
                buffers["logits_indices"][:bucket],
                compiled=compiled,
            )

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]] = ()) -> None:
        """Copy whole KV blocks, ``(source, destination)`` pairs, in every layer (copy on write of a block
        beams shared: `BlockManager.allocate`); `window_copies` are the window pool's, for the layers
        that keep K/V there. Runs before the step's forward."""
        for pairs, window in ((copies, False), (window_copies, True)):
            if not pairs:
                continue
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
            for layer, (k, v) in enumerate(self.kv_caches):
                if (layer in self.window_layers) == window and layer in self._kv_layers:  # not recurrent
                    k.index_copy_(0, dst, k.index_select(0, src))
                    v.index_copy_(0, dst, v.index_select(0, src))

    def _slots(
        self, block_ids: list[int], window_ids: list[int] | None, num_tokens: int
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each layer's cache slots of positions ``[0, num_tokens)`` from its pool's table, and which of
        them lie in blocks given back (outside every window: their slots point at block 0; None where
        none does)."""
        positions = torch.arange(num_tokens, device=self.device)
        per_table = []
        for table in [block_ids] if window_ids is None else [block_ids, window_ids]:
            ids = torch.tensor(table, dtype=torch.long, device=self.device)[positions // self.block_size]
            given_back = ids < 0
            slots = ids.clamp(min=0) * self.block_size + positions % self.block_size
            per_table.append((slots, given_back if bool(given_back.any()) else None))
        return [
            per_table[-1] if layer in self.window_layers else per_table[0]
            for layer in range(len(self.kv_caches))
        ]

    def gather_kv(
        self, block_ids: list[int], num_tokens: int, window_ids: list[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first `num_tokens` tokens' K and V, ``[num_tokens, Hkv, D]`` per layer (the
        sliding layers' from `window_ids`, where they have a pool of their own). Positions whose blocks
        were given back (before a sliding layer's window) come out as zeros: no later token reads them,
        and HF's sliding cache layers drop them."""
        self._check_every_layer_keeps_kv()
        head_dim, dtype = self.executor.head_dim, self._values_dtype()
        layers = []
        for (k, v), (slots, given_back) in zip(
            self.kv_caches, self._slots(block_ids, window_ids, num_tokens)
        ):
            keys = kv_quant.load(k.view(-1, *k.shape[2:]).index_select(0, slots), head_dim, dtype)
            values = kv_quant.load(v.view(-1, *v.shape[2:]).index_select(0, slots), head_dim, dtype)
            if given_back is not None:
                keys[given_back], values[given_back] = 0, 0
            layers.append((keys, values))
        return layers

    def _check_every_layer_keeps_kv(self) -> None:
        if len(self._kv_layers) != len(self.kv_caches):  # the planner sends such calls to transformers
            raise ValueError("K/V in or out of a model with recurrent layers: they keep a state, not K/V")

    def _values_dtype(self) -> torch.dtype:
        """The dtype K/V values leave the cache in: the model's, whatever the cache holds (a returned
        `past_key_values` is fed back to the model, as HF's is; a float16 cache's under a bfloat16 model
        made its attention fail on mixed dtypes)."""
        return self.executor.dtype

    def write_kv(
        self,
        block_ids: list[int],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        window_ids: list[int] | None = None,
    ) -> None:
        """Write K and V (``[n, Hkv, D]`` per layer) into the slots of positions ``[0, n)`` of `block_ids`
        (and of `window_ids` for the sliding layers that have a pool of their own, less the positions
        whose blocks were given back): the inverse of `gather_kv`."""
        self._check_every_layer_keeps_kv()
        num_tokens = int(kv[0][0].shape[0])
        if num_tokens == 0:
            return
        layer_slots = self._slots(block_ids, window_ids, num_tokens)
        with torch.no_grad():
            for (k_cache, v_cache), (k, v), (slots, given_back) in zip(
                self.kv_caches, kv, layer_slots, strict=True
            ):
                k, v = k.to(k_cache.device), v.to(v_cache.device)
                if given_back is not None:  # before the window (a prefix hit's): never read, not written
                    kept = ~given_back
                    slots, k, v = slots[kept], k[kept], v[kept]
                kv_quant.store(k_cache, slots, k)
                kv_quant.store(v_cache, slots, v)


def kv_bytes_per_token(executor: ModelExecutor, dtype: torch.dtype, backend: AttentionBackend) -> int:
    """Bytes of K and V one token takes across all layers in `backend`'s cache (an int8 cache's scales
    included, its rows padded as the backend asks)."""
    row = kv_quant.row_bytes(executor.head_dim, dtype, backend.capabilities.quantized_row_align)
    return 2 * len(kv_layer_indices(executor)) * executor.num_kv_heads * row


def kv_layer_indices(executor: ModelExecutor) -> range | frozenset[int]:
    """The layers whose K/V the cache keeps: every layer, or those the executor names (`kv_layers`: a
    model with recurrent layers keeps their state instead)."""
    kept = getattr(executor, "kv_layers", None)
    return range(executor.num_layers) if kept is None else kept
