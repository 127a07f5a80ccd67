"""The engine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from hfaccel.config import EngineConfig, check_latency_target
from hfaccel.engine.async_step import AsyncStepper, resolve_async_scheduling
from hfaccel.engine.batch import pack_step
from hfaccel.engine.beam_search import check_beam_request, snapshot_kv
from hfaccel.engine.block_manager import blocks_for
from hfaccel.engine.cost_model import StepCostModel
from hfaccel.engine.decode_buckets import resolve_compile_mode
from hfaccel.engine.executor import ModelExecutor, make_executor
from hfaccel.engine.limits import Limits, cap_to_blocks, counting_blocks, free_memory_bytes, resolve_limits
from hfaccel.engine.metrics import StepStats
from hfaccel.engine.model_watch import ModelWatch
from hfaccel.engine.prompt_inputs import write_imported_kv
from hfaccel.engine.request import GREEDY, Request, SamplingParams, StoppingParams
from hfaccel.engine.runner import ModelRunner, kv_bytes_per_token
from hfaccel.engine.sampler import next_tokens
from hfaccel.engine.scheduler import Scheduler
from hfaccel.engine.speculative.draft_model import DraftModelProposer, draft_executor
from hfaccel.engine.speculative.drafting import propose_drafts
from hfaccel.engine.speculative.proposer import make_proposer, speculative_stats
from hfaccel.engine.window_blocks import kv_tables, make_block_manager
from hfaccel.kernels import get_backend

logger = logging.getLogger("hfaccel")


class Engine:
    """A paged-KV, continuously batched generator bound to one model.

    Add requests with `add_request`, then call `step` until they finish (or `run` to do both for a set
    of requests). Each step schedules decode tokens and prefill chunks under one token budget, runs one
    packed forward pass, samples, and retires finished requests, freeing their KV blocks.

    `model_state`, if given, returns a hashable fingerprint of the model's weights and adapters; the
    engine calls it before each step that may admit requests and forgets its prefix cache when the value
    changes, so KV computed by an older model is never served (see `check_model_state`).
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig | None = None,
        model_state: Callable[[], Hashable] | None = None,
    ) -> None:
        """Bind an engine to `model`: a transformers causal LM, or any `ModelExecutor`. `model_state`
        defaults to the executor's `state_token` (for an HF model: weights, optimizer steps, adapters)."""
        self.executor: ModelExecutor = make_executor(model)
        self.model = self.executor.model
        self.config = config or EngineConfig()
        self.max_model_len = self.executor.max_model_len(self.config.max_model_len)
        self.device = self.executor.device
        self.vocab_size = self.executor.vocab_size
        self.model_dtype = self.executor.dtype
        kv_dtype = self.config.kv_dtype(self.model_dtype)
        block_size = self.config.block_size
        needs = self.executor.attention_needs
        backend = get_backend(self.config.backend, self.device, kv_dtype, self.executor.head_dim, needs)
        # --- tensor parallel (hfaccel/distributed/sync.py): ranks agree on the block count and the limits,
        # check that each step is the same step on every rank, and take rank 0's sampled tokens.
        self.step_sync = self.executor.step_sync
        if self.step_sync is not None:
            self.step_sync.check_config(self.config)
        token_padding = self.executor.max_token_padding  # sequence-parallel prefill padding
        # ---
        per_token = kv_bytes_per_token(self.executor, kv_dtype, backend)
        draft = draft_executor(self.config.speculative, self.vocab_size, self.device)
        if draft is not None:  # the draft's cache has as many blocks as the target's: budget both
            draft_kv_dtype, needs = self.config.kv_dtype(draft.dtype), draft.attention_needs
            draft_backend = get_backend(
                self.config.backend, self.device, draft_kv_dtype, draft.head_dim, needs
            )
            per_token += kv_bytes_per_token(draft, draft_kv_dtype, draft_backend)
        budget = self._kv_budget()
        if self.step_sync is not None:  # auto limits follow the budget: the same budget on every rank
            budget = self.step_sync.min_int(budget)
        self.limits = self._resolve_limits(budget, per_token)
        self.num_blocks = self._num_blocks(per_token * block_size, budget - self.limits.state_bytes)
        state_slots = self._recurrent_state_slots()
        self.block_manager, window_pool = make_block_manager(
            self.executor, self.config, self.max_model_len, self.num_blocks, state_slots, draft is not None
        )
        self.num_blocks = self.block_manager.num_blocks
        self.config = cap_to_blocks(self.config, self.num_blocks, self.max_model_len)
        self._cost_model = StepCostModel()
        self._cost_model_seen = 0  # the last step the model was fed (step 0 never is)
        self.scheduler = Scheduler(self.block_manager, self.config, self.max_model_len, self._cost_model)
        self.scheduler.kv_window = None if draft is not None else self.block_manager.kv_window
        self.runner = ModelRunner(
            self.executor,
            backend,
            self.num_blocks,
            block_size,
            kv_dtype,
            max_num_seqs=self.config.max_num_seqs,
            max_num_tokens=max(self.config.max_num_batched_tokens, self.config.max_num_seqs) + token_padding,
            max_blocks_per_seq=blocks_for(self.max_model_len, block_size),
            compile_mode=resolve_compile_mode(self.config.compile, self.device),
            cuda_graphs=self._use_cuda_graphs(backend),
            decode_buckets=self.config.decode_buckets,
            num_microbatches=self.config.num_microbatches,
            window_pool=window_pool,
        )
        self.warmup_seconds: float | None = None
        self._requests_bring_proposers = False  # some request has its own draft source: draft every step
        self._imported_kv = False  # some request brought K/V to write into its blocks when admitted
        self._drain_owed = False  # ranks in lock step: held work since the last empty check (`sync_drain`)
        if draft is None:
            self.proposer = make_proposer(self.config)
        else:
            # Its own runner (KV cache, buffers) over the same block ids: requests' block tables index both.
            draft_runner = ModelRunner(
                draft,
                draft_backend,
                self.num_blocks,
                block_size,
                draft_kv_dtype,
                max_num_seqs=self.config.max_num_seqs,
                max_num_tokens=self.runner.max_num_tokens,
                max_blocks_per_seq=self.runner.max_blocks_per_seq,
            )
            self.proposer = DraftModelProposer(
                draft_runner,
                self.block_manager,
                max_model_len=draft.max_model_len(None),
                max_num_tokens=self.runner.max_num_tokens,
            )
        asynchronous = resolve_async_scheduling(self.config.async_scheduling, self.device)
        self._async = AsyncStepper(self) if asynchronous else None
        # The model is watched where something outlives a change: the prefix cache's KV, and captured
        # CUDA graphs (they replay the weights' addresses and the adapters' control flow).
        watched = self.config.enable_prefix_caching or self.runner.cuda_graphs
        sentinel = None if model_state else getattr(self.executor, "state_sentinel", None)
        self._watch = ModelWatch((model_state or self.executor.state_token) if watched else None, sentinel)
        self.block_manager.pause_sharing(self._watch.draws_dropout)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_stats: deque[StepStats] = deque(maxlen=100_000)
        self._next_id = itertools.count()  # next() is atomic: callers in any thread may make requests

    def _recurrent_state_slots(self) -> int:
        """State slots for a model with recurrent layers (one per sequence it may run), else 0. Such a
        sequence cannot resume from its KV alone: the prefix cache is off, and drafts and compile too
        (the per-sequence mixers run eager)."""
        if not getattr(self.executor, "recurrent", False):
            return 0
        if self.config.speculative is not None:
            raise ValueError(
                "speculative: a model with recurrent layers (Mamba and its kin) cannot roll its state back "
                "over rejected drafts; leave speculative unset"
            )
        self.config = self.config.with_overrides(
            enable_prefix_caching=False, compile="off", cuda_graphs=False
        )
        self.executor.reserve_state_slots(self.config.max_num_seqs)
        return self.config.max_num_seqs

    def _use_cuda_graphs(self, backend: Any) -> bool:
        wanted = self.config.cuda_graphs
        reason = ModelRunner._no_graphs_reason(self.executor, backend)
        if wanted and reason is not None:
            logger.info("hfaccel: CUDA graphs skipped: %s", reason)
        # compile="background" compiles without graphs (EngineConfig refuses cuda_graphs=True with it).
        return reason is None and wanted is not False and self.config.compile != "background"

    def warmup(self, progress: bool = True) -> float:
        """Compile (and capture, on CUDA) every decode bucket now instead of at first use; returns seconds.
        Nothing to do (0 s) when neither compile nor CUDA graphs are on."""
        seconds = self.runner.warmup(progress)
        self.warmup_seconds = seconds
        return seconds

    def _kv_budget(self) -> int:
        memory = self.config.kv_cache_memory
        return int(memory * free_memory_bytes(self.device)) if isinstance(memory, float) else memory

    def _resolve_limits(self, budget: int, per_token: int) -> Limits:
        """Choose `max_num_seqs` / `max_num_batched_tokens` where the config leaves them None (auto);
        `self.config` then holds the concrete values."""
        config = self.config
        limits = resolve_limits(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            kv_budget_bytes=budget,
            kv_bytes_per_token=per_token,
            max_model_len=self.max_model_len,
            device=self.device,
            block_size=config.block_size,
            at_least_seqs=max(config.max_batch_size or 1, *(config.cuda_graph_sizes or (1,))),
            state_bytes_per_seq=getattr(self.executor, "state_bytes_per_seq", 0),
        )
        if limits.auto:
            self.config = config.with_overrides(
                max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens
            )
        return limits

    def cost_model(self) -> StepCostModel:
        """The step-time model learnt from this engine's steps: ``coefficients``, ``predict(decode_seqs,
        prefill_tokens, kv_tokens)``, ``num_samples``, ``fit()`` (with R2 and RMSE)."""
        self._feed_cost_model()
        return self._cost_model

    def _feed_cost_model(self) -> None:
        """Give the step-time model the steps it has not seen yet: every step, while latency targets
        need it live; otherwise when asked for (`cost_model`), from `step_stats`. The first step pays
        one-time costs (allocation, lazy imports) and is never fed."""
        new = []
        for stats in reversed(self.step_stats):
            if stats.step <= self._cost_model_seen:
                break
            new.append(stats)
        for stats in reversed(new):
            self._cost_model.observe_step(stats)
        if new:
            self._cost_model_seen = new[0].step

    def _num_blocks(self, bytes_per_block: int, budget: int) -> int:
        useful = self.config.max_num_seqs * blocks_for(self.max_model_len, self.config.block_size)
        num_blocks = min(budget // bytes_per_block, useful) if bytes_per_block else counting_blocks(self)
        if self.step_sync is not None:  # tensor parallel: the same blocks on every rank
            num_blocks = self.step_sync.min_int(num_blocks)
        if num_blocks < 1:
            block = f"one KV block ({bytes_per_block} bytes); the minimum is {bytes_per_block} bytes"
            raise ValueError(f"kv_cache_memory gives {budget} bytes, less than {block}")
        return num_blocks

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        stopping: StoppingParams,
        sampling: SamplingParams = GREEDY,
        request_id: Any = None,
        arrival_time: float | None = None,
        seed: int | None = None,
        adapter: str | None = None,
        **targets: Any,
    ) -> Request:
        """Validate and queue one prompt (at any time, also between steps); returns its `Request`.

        Raises ValueError and queues nothing for a bad prompt. `arrival_time` (``time.perf_counter()``
        seconds) backdates the request's arrival for latency metrics; by default it arrives now.
        `targets`: ``tpot_target_ms``, ``ttft_target_ms``, ``priority`` (see `make_request`). A request
        rejected by admission control comes back finished (``finish_reason="rejected"``).
        """
        request = self.make_request(
            prompt_token_ids, stopping, sampling, request_id, seed, adapter=adapter, **targets
        )
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        self.add(request)
        return request

    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        stopping: StoppingParams,
        sampling: SamplingParams = GREEDY,
        request_id: Any = None,
        seed: int | None = None,
        adapter: str | None = None,
        *,
        tpot_target_ms: float | None = None,
        ttft_target_ms: float | None = None,
        priority: int = 0,
        masked_last: bool = False,
    ) -> Request:
        """Build a validated `Request` without queueing it.

        A sampled request gets its own random stream: from `seed`, or else from a seed drawn from torch's
        global generator now (so ``torch.manual_seed`` before a call reproduces it). `tpot_target_ms` and
        `ttft_target_ms` override the engine's latency targets for this request; `priority` orders
        admission (lower first, first come first served within a level). `adapter` names a LoRA adapter
        the executor applies to this request alone (it must have ``check_adapter``); its prefix-cache
        blocks are shared only with requests of the same adapter. `masked_last`: the prompt's last token
        is HF's masked last column (`Request.masked_last`), fed for its logits and never kept."""
        if tpot_target_ms is not None or ttft_target_ms is not None:
            check_latency_target("tpot_target_ms", tpot_target_ms)
            check_latency_target("ttft_target_ms", ttft_target_ms)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        if (kept := len(ids) - masked_last) >= self.max_model_len:
            raise ValueError(
                f"prompt has {kept} tokens, but the model's context (max_model_len) is {self.max_model_len} "
                "and at least one token must be generated"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if adapter is not None:
            self.executor.check_adapter(adapter)
        if request_id is None:
            request_id = next(self._next_id)
        request = Request(request_id, ids, stopping, sampling=sampling, adapter=adapter, cache_salt=adapter)
        request.tpot_target_ms, request.ttft_target_ms = tpot_target_ms, ttft_target_ms
        request.user_priority = priority
        if masked_last:
            request.feed_masked_last()
        # Per-step scores/logits/logprobs are recorded one token at a time: such requests do not speculate.
        request.speculation.enabled = not (
            sampling.output_scores or sampling.output_logits or sampling.output_logprobs
        )
        if sampling.do_sample:
            request.seed = int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item())
        if sampling.beam is not None:
            check_beam_request(request, self.max_model_len)
        self.scheduler.check(request)
        return request

    def add(self, request: Request) -> None:
        """Queue a request built by `make_request`."""
        self.scheduler.add(request)
        if (
            request.speculation.proposer is not None
        ):  # its own draft source (prompt lookup of one generate call)
            self._requests_bring_proposers = True
        if request.imported_kv is not None:
            self._imported_kv = True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def sync_drain(self) -> None:
        """Ranks in lock step (tensor or pipeline parallel): once this engine has emptied after holding
        work, check an empty plan against the other ranks' (`StepSync.check_drained`): RuntimeError on
        every rank where another still has work, rather than a rank waiting for the others for ever."""
        if self.step_sync is not None and self._drain_owed and not self.scheduler.has_unfinished():
            self._drain_owed = False
            self.step_sync.check_drained()

    def step(self, draining: bool = False) -> list[Request]:
        """Run one iteration; returns the requests that finished in it.

        `draining` tells the scheduler no more requests are coming (static batching then runs its last,
        partial batch).

        Fault safety: if anything raises inside the step (a kernel error, out of memory, a
        KeyboardInterrupt), the requests the step had scheduled finish with ``finish_reason="error"`` and
        the exception in ``Request.error``, their blocks are freed, every other request stays runnable,
        the bookkeeping is made whole again (`_recover`), and the exception propagates. A request whose
        own ``stop_check``, stopping ``criteria`` or logits processors raise (an ``Exception``) fails
        alone, without failing the step: it is returned among the finished requests with its error.
        """
        self.scheduler.finished_in_step = []  # what this step retires fails with it until it is returned
        try:
            return self._step(draining)
        except BaseException as error:
            self._drain_owed = False  # (a divergence raised on every rank: none owes the others a check)
            self._recover(error)
            raise

    def _step(self, draining: bool) -> list[Request]:
        start = time.perf_counter()
        if self.scheduler.waiting or self.scheduler.forming or self._watch.sentinel_moved():
            self.check_model_state()
        mark = self._watch.sentinel
        preemptions_before = self.scheduler.num_preemptions
        hits_before = self.block_manager.stats.hit_tokens
        num_waiting = len(self.scheduler.waiting) + len(self.scheduler.forming)
        step = self.scheduler.schedule(draining)
        rejected = self.scheduler.take_rejected()
        if not step.requests:
            if rejected:
                return rejected
            if self.scheduler.has_unfinished() and (draining or self.config.batching == "continuous"):
                raise RuntimeError(f"the scheduler could not make progress: {self!r}")
            return []
        for request in step.requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = start
        scheduled = time.perf_counter()
        if self._imported_kv:  # K/V given with a prompt (engine/prompt_inputs.py)
            write_imported_kv(self.runner, step.requests)
        packed = pack_step(step, self.config.block_size, self.runner.backend.capabilities.decode_query_len)
        copies = (self.block_manager.take_copies(), self.block_manager.take_window_copies())
        if any(copies):  # copy on write of blocks that forked beams shared (engine/beam_search.py)
            self.runner.copy_blocks(*copies)
        if self.step_sync is not None:  # tensor parallel: every rank runs this very step
            self.step_sync.check_step(step, packed)
            self._drain_owed = True
        packed_at = time.perf_counter()
        logits, tokens, ran_at, overlapped = self._run_and_sample(packed)
        if self.step_sync is not None:  # tensor parallel: rank 0's tokens everywhere
            tokens = self.step_sync.agree_tokens(tokens)
        sampled_at = time.perf_counter()
        kept = {id(r): kv_tables(r) for r in step.requests if r.keep_kv}
        finished = self.scheduler.update(step, packed.sampled_requests, tokens)
        for request in finished:  # freed just now, not reused yet: copy the KV out for the caller
            if id(request) in kept:
                snapshot_kv(request, kept, self.runner.gather_kv)
        if self._watch.moved_during(mark):  # the model changed during the step: its blocks may be either's
            self.block_manager.reset_prefix_cache()
        if self.proposer is not None or self._requests_bring_proposers:
            propose_drafts(self.scheduler, self.proposer, self.config, self.max_model_len, self.cost_model())
        num_decode = sum(1 for n in step.num_tokens if n == 1)
        end = time.perf_counter()
        stats = StepStats(
            step=self.num_steps,
            start_s=start,
            duration_s=end - start,
            num_seqs=len(step),
            num_decode_tokens=num_decode,
            num_prefill_tokens=step.total_tokens - num_decode,
            kv_blocks_used=self.block_manager.num_used_blocks,
            prefix_hit_tokens=self.block_manager.stats.hit_tokens - hits_before,
            num_preemptions=self.scheduler.num_preemptions - preemptions_before,
            num_kv_tokens=sum(packed.layout.seq_lens),
            num_waiting=num_waiting,
            schedule_s=scheduled - start,
            pack_s=packed_at - scheduled,
            run_s=ran_at - packed_at,
            sample_s=sampled_at - ran_at,
            update_s=end - sampled_at,
            overlapped_s=overlapped,
            kv_window_blocks_used=self.block_manager.num_used_window_blocks,
        )
        self.step_stats.append(stats)
        if self.scheduler.latency.targets_used:  # latency targets read the step-time model live
            self._feed_cost_model()
        self.num_steps += 1
        self.num_generated_tokens += sum(len(t) if isinstance(t, list) else 1 for t in tokens)
        self.scheduler.scheduled = []  # the step is done: nothing of it is left to fail
        if self.step_sync is not None:  # (one process: no call on the step's path)
            self.sync_drain()
        return finished + rejected

    def _run_and_sample(self, packed: Any) -> tuple[Any, list, float, float]:
        """The forward and sampling of one packed step: (logits, tokens, when the forward ended, seconds of
        host work overlapped). Asynchronous scheduling runs them on a worker thread (`_prepare_ahead`)."""
        if self._async is None:
            logits = self.runner.run(packed)
            ran_at = time.perf_counter()
            tokens = next_tokens(logits, packed.sampled_requests, packed.rows_per_request)
            return logits, tokens, ran_at, 0.0
        return self._async.run(self, packed)

    def _prepare_ahead(self) -> None:
        """Host work for the next step that does not depend on this step's tokens; asynchronous
        scheduling runs it while the forward runs (`engine/async_step.py`)."""
        if self.scheduler.latency.targets_used:
            self._cost_model.fit()
        self.scheduler.prepare_ahead()

    def check_model_state(self) -> bool:
        """Forget the prefix cache and CUDA graphs if the model changed since the last check (or a change
        was forced); returns whether it did. Running requests never register their KV (`model_watch`)."""
        if (change := self._watch.new_token()) is None:
            return False
        previous, token = change  # graphs survive a change of values only (an optimizer step in place),
        same_structure = getattr(token, "same_structure", None)  # where the token can tell (HFExecutor's)
        self.forget_model_outputs(graphs=same_structure is None or not same_structure(previous))
        self.block_manager.pause_sharing(self._watch.draws_dropout)  # dropout: no prefix is shared
        return True

    def forget_model_outputs(self, graphs: bool = True) -> None:
        """Drop what a change of the model leaves stale: the prefix cache's KV and (with `graphs`) every
        captured CUDA graph (it replays the weights' addresses and the adapters' control flow)."""
        self.block_manager.reset_prefix_cache()
        forget = getattr(self.runner.executor, "forget_outputs", None)  # (optional in the protocol)
        if forget is not None:
            forget(structure=graphs)
        if graphs:
            self.runner.graphs.clear()

    def forget_model_outputs_soon(self) -> None:
        """`forget_model_outputs` at the next step's model check, before it admits (from any thread)."""
        self._watch.force()

    def _recover(self, error: BaseException) -> None:
        """The one recovery path after an exception in a step: fail the requests the step had scheduled
        or retired (never returned), then rebuild the queues and counts from the rest (`Scheduler.repair`)."""
        failed = [*(request for request, _ in self.scheduler.scheduled), *self.scheduler.finished_in_step]
        self.scheduler.repair(failed, error)

    def stream(self, request: Request) -> Iterator[int]:
        """Yield `request`'s tokens as they are generated, stepping the engine (and so every other
        request) as needed. Several streams can be consumed in turn; each step serves them all.

        Raises ValueError at once for a request this engine does not hold (never queued, or another
        engine's), and the request's error if it fails.
        """
        if not request.is_finished and not self.holds(request):
            raise ValueError(
                f"request {request.request_id!r} is not queued on this engine: add it first (add_request / add)"
            )
        if request.sampling.beam is not None:
            raise ValueError("a beam search request cannot be streamed: its beams change until it finishes")
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[int]:
        sent = 0
        while True:
            while sent < len(request.output_token_ids):
                yield request.output_token_ids[sent]
                sent += 1
            if request.is_finished:
                if request.error is not None:
                    raise request.error
                return
            if not self.holds(request):
                raise ValueError(
                    f"request {request.request_id!r} is not queued on this engine: add it with "
                    "engine.add(request) (on the engine that made it) before streaming it"
                )
            self.step(draining=True)  # nothing can arrive while we wait here

    def holds(self, request: Request) -> bool:
        """Whether `request` is queued or running on this engine."""
        return self.scheduler.live.get(id(request)) is request

    def abort(self, request: Request) -> None:
        """Cancel a request and free its KV blocks at once. Idempotent, and safe for a request in any state
        (waiting, running, finished, never queued); if it is interrupted, the bookkeeping is repaired."""
        try:
            self.scheduler.abort(request)
        except BaseException:
            self.scheduler.repair()
            raise

    def run(self, requests: Sequence[Request], progress: bool = False) -> None:
        """Queue `requests` and step until all of them finish.

        If anything goes wrong midway (or the user interrupts), the unfinished ones are aborted so no
        KV block stays held, and the error propagates; a request that failed (its ``stop_check`` raised)
        raises its error the same way.
        """
        remaining = {id(r) for r in requests}
        bar = tqdm(total=len(requests), desc="hfaccel", unit="req", disable=not progress, leave=False)
        tokens_before = self.num_generated_tokens
        self.check_model_state()
        try:
            for request in requests:  # inside the try: a refusal midway must not strand the ones queued
                self.add(request)
                if request.is_finished:  # rejected at once by admission control
                    remaining.discard(id(request))
                    bar.update(1)
            while remaining:
                for request in self.step(draining=True):
                    if id(request) in remaining:
                        if request.error is not None:
                            raise request.error
                        remaining.discard(id(request))
                        bar.update(1)
                if progress:
                    bar.set_postfix(tokens=self.num_generated_tokens - tokens_before, refresh=False)
        except BaseException:
            for request in requests:
                if not request.is_finished:
                    self.abort(request)
            raise
        finally:
            bar.close()

    def stats(self) -> dict[str, Any]:
        """Engine-wide counters as plain data."""
        cache = self.block_manager.stats
        return {
            "steps": self.num_steps,
            "generated_tokens": self.num_generated_tokens,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self.scheduler.forming),
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks": self.num_blocks,
            "kv_blocks_used": self.block_manager.num_used_blocks,
            "prefix_cache_queried_tokens": cache.queried_tokens,
            "prefix_cache_hit_tokens": cache.hit_tokens,
            "prefix_cache_hit_rate": cache.hit_rate,
            "rejected": self.scheduler.num_rejected,
            "warned": self.scheduler.num_warned,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            **speculative_stats(self.scheduler.spec_totals),
        }

    def __repr__(self) -> str:
        s = self.scheduler
        return (
            f"Engine(model={type(self.model).__name__}, backend={self.runner.backend.name!r}, "
            f"blocks={self.block_manager.num_used_blocks}/{self.num_blocks}x{self.config.block_size}, "
            f"running={len(s.running)}, waiting={len(s.waiting) + len(s.forming)}, steps={self.num_steps}, "
            f"generated_tokens={self.num_generated_tokens}, preemptions={s.num_preemptions}, "
            f"prefix_hit_rate={self.block_manager.stats.hit_rate:.2f}, {self.limits.describe()})"
        )
