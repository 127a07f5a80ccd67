"""Iteration-level scheduling: which tokens of which requests the next step computes.

Each step has one token budget (`max_num_batched_tokens`) and a cap on sequences (`max_num_seqs`).
Running requests come first, oldest first: a decode costs one token, an unfinished prompt a chunk of
what is left of the budget (at most `long_prefill_token_threshold`). Waiting requests are then admitted
while the batching strategy, the budget, the sequence cap and the free KV blocks allow; an admitted
prompt first takes whatever prefix the prefix cache holds. When a running request needs a block and
none is free, the newest running request is preempted: its blocks are freed and it is recomputed later
(the prefix cache usually hands most of them back), with the same output.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from hfaccel.config import EngineConfig
from hfaccel.engine.batch import Batch, ScheduledStep
from hfaccel.engine.block_manager import BlockManager, blocks_for
from hfaccel.engine.request import Request, RequestStatus


class Scheduler:
    """Owns the waiting queue, the running batch, and (for dynamic/static batching) the forming batch."""

    def __init__(self, block_manager: BlockManager, config: EngineConfig, max_model_len: int) -> None:
        self.block_manager = block_manager
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        # Dynamic/static batching: requests chosen for the current batch, not yet admitted.
        self.forming: deque[Request] = deque()
        self.running = Batch()
        self.num_preemptions = 0

    # ----------------------------------------------------------------- requests in and out

    def add(self, request: Request) -> None:
        """Queue a request; raise ValueError (queueing nothing) if it could never be served."""
        self.check(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raise ValueError if `request` could never be served on its own by this cache and budget."""
        longest = min(len(request.prompt_token_ids) + request.stopping.max_new_tokens, self.max_model_len)
        needed = blocks_for(longest, self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"the KV cache holds {self.block_manager.num_blocks} blocks of {self.block_manager.block_size} "
                f"tokens, but request {request.request_id!r} needs {needed} blocks ({longest} tokens); "
                "raise kv_cache_memory or shorten the request"
            )
        if not self.config.chunked_prefill and longest > self.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id!r} may need {longest} tokens in one step, more than "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}); enable chunked_prefill or raise "
                "max_num_batched_tokens"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.forming) or len(self.running) > 0

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is, free its blocks at once, and mark it finished."""
        if request in self.running:
            self.running.remove(request)
        for queue in (self.waiting, self.forming):
            if any(r is request for r in queue):
                queue.remove(request)
        self.block_manager.free(request)
        if not request.is_finished:
            request.finish("abort")

    # ----------------------------------------------------------------- one step

    def schedule(self, draining: bool = False) -> ScheduledStep:
        """Choose this step's work; never exceeds the token budget, the sequence cap or the free blocks.

        `draining` says no more requests will arrive (an offline run): static batching may then run a
        last, partial batch.
        """
        policy = self.config.scheduling_policy
        kinds = {"decode", "prefill"}
        if policy != "mixed":  # a step of one kind: the preferred one if it has work, else the other
            has_work = {
                "decode": any(r.num_uncomputed_tokens == 1 for r in self.running),
                "prefill": any(r.num_uncomputed_tokens > 1 for r in self.running)
                or self._can_admit(draining),
            }
            preferred, other = ("prefill", "decode") if policy == "prefill_first" else ("decode", "prefill")
            kinds = {preferred} if has_work[preferred] else {other}
        step = self._fill(kinds, draining)
        if not step.requests and kinds != {"decode", "prefill"}:
            step = self._fill({"decode", "prefill"} - kinds, draining)  # the preferred kind could not run
        return step

    def _fill(self, kinds: set[str], draining: bool) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted = False
        for kind in ("decode", "prefill"):  # decodes are placed first within the running batch
            if kind in kinds:
                budget, preempted = self._schedule_running(kind, budget, chosen, preempted)
        # Admitting while preempting would only thrash: freed blocks go to the running requests first.
        if "prefill" in kinds and not preempted:
            self._admit(budget, chosen, draining)
        chosen.sort(key=lambda pair: pair[1] != 1)  # one-token sequences first (stable)
        return ScheduledStep([r for r, _ in chosen], [n for _, n in chosen])

    def update(self, step: ScheduledStep, sampled: list[Request], token_ids: list[int]) -> list[Request]:
        """Advance the computed tokens, record sampled tokens, and retire finished requests.

        Returns the requests that finished in this step.
        """
        for request, count in zip(step.requests, step.num_tokens):
            request.num_computed_tokens += count
            self.block_manager.cache_full_blocks(request)
        now = time.perf_counter()
        for request, token_id in zip(sampled, token_ids):
            request.append_token(token_id, self.max_model_len, now)
        finished = self.running.filter(lambda r: not r.is_finished)
        for request in finished:
            self.block_manager.free(request)
        return finished

    # ----------------------------------------------------------------- internals

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens `request` may compute this step within `budget` (0: not this step)."""
        remaining = request.num_uncomputed_tokens
        if remaining == 1:
            return 1 if budget >= 1 else 0
        if not self.config.chunked_prefill:
            return remaining if remaining <= budget else 0
        cap = self.config.long_prefill_token_threshold or remaining
        return min(remaining, budget, cap)

    def _schedule_running(
        self, kind: str, budget: int, chosen: list[tuple[Request, int]], preempted: bool
    ) -> tuple[int, bool]:
        scheduled = {id(r) for r, _ in chosen}
        for request in list(self.running):
            if budget <= 0:
                break
            if id(request) in scheduled or request.status is not RequestStatus.RUNNING:  # done, or preempted
                continue
            if (request.num_uncomputed_tokens == 1) != (kind == "decode"):
                continue
            count = self._chunk(request, budget)
            if count == 0:
                continue
            while not self.block_manager.allocate(request, count):
                victim = self._newest_unscheduled(chosen)
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chosen.append((request, count))
                scheduled.add(id(request))
                budget -= count
        return budget, preempted

    def _newest_unscheduled(self, chosen: list[tuple[Request, int]]) -> Request:
        scheduled = {id(r) for r, _ in chosen}
        return next(r for r in reversed(self.running.requests) if id(r) not in scheduled)

    def _can_admit(self, draining: bool) -> bool:
        if self.config.batching == "continuous":
            return bool(self.waiting) and len(self.running) < self.max_num_seqs
        return bool(self.forming) or (len(self.running) == 0 and self._batch_ready(draining))

    def _batch_ready(self, draining: bool) -> bool:
        if not self.waiting:
            return False
        if len(self.waiting) >= self.config.batch_size or draining:
            return True
        if self.config.batching == "dynamic":
            waited = time.perf_counter() - self.waiting[0].metrics.arrival_time
            return waited * 1000.0 >= self.config.max_delay_ms
        return False

    def _admission_queue(self, draining: bool) -> deque[Request]:
        """Where admissions come from: the waiting queue, or the forming dynamic/static batch."""
        if self.config.batching == "continuous":
            if self.config.group_by_length and len(self.waiting) > 1:
                window = min(len(self.waiting), self.max_num_seqs)
                head = sorted((self.waiting.popleft() for _ in range(window)), key=lambda r: r.num_tokens)
                self.waiting.extendleft(reversed(head))
            return self.waiting
        if not self.forming and len(self.running) == 0 and self._batch_ready(draining):
            size = min(self.config.batch_size, len(self.waiting))
            batch = [self.waiting.popleft() for _ in range(size)]
            if self.config.group_by_length:
                batch.sort(key=lambda r: r.num_tokens)
            self.forming.extend(batch)
        return self.forming

    def _admit(self, budget: int, chosen: list[tuple[Request, int]], draining: bool) -> None:
        queue = self._admission_queue(draining)
        computing: set = set()  # first blocks of prompts admitted uncached in this step
        while queue and budget > 0 and len(self.running) < self.max_num_seqs:
            request = queue[0]
            cached = self.block_manager.match_prefix(request)
            first = self.block_manager.first_block_key(request) if cached == 0 else None
            if first is not None and first in computing:
                # Its prefix is being computed right now: admitted next step, it shares those blocks
                # (copies of one prompt, num_return_sequences) instead of computing them again.
                break
            request.num_computed_tokens = cached
            count = self._chunk(request, budget)
            if count == 0 or not self.block_manager.allocate(request, count):
                self.block_manager.free(request)  # give the matched prefix back: nothing changed
                request.num_computed_tokens = 0
                break
            if first is not None:
                computing.add(first)
            self.block_manager.stats.record(request.num_tokens, cached)
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = cached
            queue.popleft()
            request.status = RequestStatus.RUNNING
            self.running.merge([request])
            chosen.append((request, count))
            budget -= count

    def preempt(self, request: Request) -> None:
        """Evict a running request: free its blocks and queue it first for recomputation."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        queue = self.waiting if self.config.batching == "continuous" else self.forming
        queue.appendleft(request)

    def requests(self) -> Iterable[Request]:
        """Every request the scheduler holds, running first."""
        yield from self.running
        yield from self.forming
        yield from self.waiting
