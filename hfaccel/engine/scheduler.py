"""Iteration-level scheduling: which tokens of which requests the next step computes.

Each step has one token budget (`max_num_batched_tokens`) and a cap on sequences (`max_num_seqs`).
Running requests come first, oldest first: a decode costs one token, an unfinished prompt a chunk of
what is left of the budget (at most `long_prefill_token_threshold`). Waiting requests are then admitted
while the batching strategy, the budget, the sequence cap and the free KV blocks allow; an admitted
prompt first takes whatever prefix the prefix cache holds. When a running request needs a block and
none is free, the newest running request (by arrival) is preempted: its blocks are freed and it is
recomputed later (the prefix cache usually hands most of them back), with the same output.

No starvation. A request's priority is the order in which it first started running: blocks go to the
oldest running requests first, and a request short of blocks preempts the newest running requests (never
an older one), so the oldest running request is never preempted and always finishes. A preempted request
resumes before any request that has not started, and only once the free blocks cover what it and every
older running request may still need (their prompt plus ``max_new_tokens``): from then on the older
requests and it always find blocks by preempting newer ones, so the scheduler preempts a request at most
once.

Adaptive scheduling, off unless asked for: `engine/latency.py` and `engine/admission_order.py`.

Fault safety: every request the scheduler holds is also in `live`, and the block manager never counts a
block below its holders, so after an exception at any point `repair` rebuilds a consistent state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from hfaccel.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineConfig
from hfaccel.engine import fault_repair
from hfaccel.engine.admission_order import AdmissionOrder, count_passed_over, num_resuming
from hfaccel.engine.batch import Batch, ScheduledStep
from hfaccel.engine.beam_search import attach as attach_beams
from hfaccel.engine.block_manager import BlockManager, blocks_for
from hfaccel.engine.cost_model import RatioCalibration
from hfaccel.engine.latency import LatencyPolicy, TimeBudget
from hfaccel.engine.request import Request, RequestStatus, SpeculationCounts, priority_key


class Scheduler:
    """Owns the waiting queue, the running batch, and (for dynamic/static batching) the forming batch."""

    def __init__(
        self, block_manager: BlockManager, config: EngineConfig, max_model_len: int, cost_model: Any = None
    ) -> None:
        self.block_manager = block_manager
        self.config = config
        # The engine resolves "auto" limits before building the scheduler; a scheduler built alone takes
        # the defaults.
        self.max_num_seqs = config.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        self.max_num_batched_tokens = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.max_model_len = max_model_len
        # Every attention layer slides within at most this many positions: blocks before every window are
        # given back as sequences grow (`BlockManager.release_before`). None: keep them.
        self.kv_window: int | None = None
        self.waiting: deque[Request] = deque()
        # Dynamic/static batching: requests chosen for the current batch, not yet admitted.
        self.forming: deque[Request] = deque()
        self.running = Batch()  # in arrival order
        self.num_preemptions = 0
        # Every request queued and not yet retired, by id: what `repair` rebuilds the queues from.
        self.live: dict[int, Request] = {}
        # The current step's choices so far (request, tokens); the engine clears it when the step is done.
        self.scheduled: list[tuple[Request, int]] = []
        self.finished_in_step: list[Request] = []  # what `update` retired, until the step returns them
        self._next_priority = 0
        self.spec_totals = SpeculationCounts()  # speculative totals
        # Adaptive scheduling: the step-time model (anything with `fit()` returning an object with
        # `coefficients` and `predict`, or None), requests rejected since the engine last asked.
        self.cost_model = cost_model
        self.rejected: list[Request] = []
        self._next_arrival = 0
        self._time: TimeBudget | None = None  # this step's time budget, when a TPOT target applies
        self._priorities_used = False  # some request has a non-zero user priority
        self.clock = time.perf_counter  # the time source (a test may put a fake clock here)
        self.latency = LatencyPolicy(self)  # TPOT/TTFT targets: step budget, batch check, admission control
        self.admission_order = AdmissionOrder(self)  # user priority, prefix-aware admission

    # ----------------------------------------------------------------- requests in and out

    def add(self, request: Request) -> None:
        """Queue a request; raise ValueError (queueing nothing) if it could never be served."""
        if request.sampling.beam is not None:
            attach_beams(request)
        self.check(request)
        if request.arrival_seq < 0:
            request.arrival_seq = self._next_arrival
            self._next_arrival += 1
        if request.tpot_target_ms is not None or request.ttft_target_ms is not None:
            self.latency.targets_used = True
        if request.user_priority:
            self._priorities_used = True
        if (
            self.latency.targets_used
            and self.latency.ttft_target(request) is not None
            and not self.latency.admission_check(request)
        ):
            self._forget(request, estimate=False)
            return
        request.status = RequestStatus.WAITING
        self.live[id(request)] = request
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raise ValueError if `request` could never be served on its own by this cache and budget."""
        longest = min(len(request.prompt_token_ids) + request.stopping.max_new_tokens, self.max_model_len)
        needed = self._most_blocks(request)
        beams = request.beam_group.params.num_beams if request.beam_group is not None else 1
        if beams > min(self.max_num_seqs, self.max_num_batched_tokens):  # a group steps whole
            raise ValueError(
                f"request {request.request_id!r} searches {beams} beams, more than max_num_seqs "
                f"({self.max_num_seqs}) or max_num_batched_tokens ({self.max_num_batched_tokens}) allow in "
                "one step; raise them"
            )
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"the KV cache holds {self.block_manager.num_blocks} blocks of {self.block_manager.block_size} "
                f"tokens, but request {request.request_id!r} needs {needed} blocks ({longest} tokens"
                + (f" in each of {beams} beams, the prompt's full blocks shared" if beams > 1 else "")
                + "); raise kv_cache_memory or shorten the request"
                + (" or use fewer beams" if beams > 1 else "")
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
        """Drop a request wherever it is, free its blocks at once, and mark it finished.

        Idempotent, and safe in any state: a finished request is left as it is; one this scheduler never
        queued is only marked finished (or refused with ValueError if it holds another cache's blocks).
        """
        group = request.beam_group
        if group is not None and self.live.get(id(group.handle)) is group.handle:
            for slot in group.slots[1:]:  # a beam group goes as a whole: its other beams first
                self._drop(slot)
                if not slot.is_finished:
                    slot.finish("abort")
            request = group.handle
        if self.live.get(id(request)) is not request:
            if request.is_finished:
                return
            if request.block_ids:
                raise ValueError(f"request {request.request_id!r} holds KV blocks of another engine")
            request.finish("abort")
            return
        if request in self.running:
            self.running.remove(request)
        for queue in (self.waiting, self.forming):
            if any(r is request for r in queue):
                queue.remove(request)
        self.block_manager.free(request)
        if not request.is_finished:
            request.finish("abort")
        self.live.pop(id(request), None)
        self._forget(request)

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
        chosen = self.scheduled = []
        self._time = None
        if self.latency.targets_used:  # latency targets: the policy's file runs only when they are on
            self.latency.reject_late()
            self._time = self.latency.time_budget()
        budget, preempted = self._schedule_running(kinds, budget, chosen)
        # Admitting while preempting would only thrash: freed blocks go to the running requests first.
        if "prefill" in kinds and not preempted:
            self._admit(budget, chosen, draining)
        chosen.sort(key=lambda pair: pair[1] != 1)  # one-token sequences first (stable)
        return ScheduledStep([r for r, _ in chosen], [n for _, n in chosen])

    def update(
        self, step: ScheduledStep, sampled: list[Request], token_ids: list[int] | list[list[int]]
    ) -> list[Request]:
        """Advance the computed tokens, record sampled tokens, and retire finished requests.

        `token_ids` has one token per sampled request, or a list per request: the tokens a verification
        emitted (its accepted drafts, then one more). Rejected drafts are rolled back: their KV is not
        counted as computed, and the lookahead blocks past what the request now needs are freed.
        Returns the requests that finished in this step.
        """
        emitted = {id(r): t if isinstance(t, list) else [t] for r, t in zip(sampled, token_ids)}
        for request, count in zip(step.requests, step.num_tokens):
            drafts = len(request.speculation.drafts)
            if drafts and count == 1 + drafts:  # a verification: keep the accepted drafts' KV only
                accepted = len(emitted.get(id(request), [None])) - 1
                count = 1 + accepted
                request.speculation.record(drafts, accepted)
                self.spec_totals.record(drafts, accepted)
            request.speculation.drafts = []
            request.num_computed_tokens += count
            if request.masked_last and request.num_computed_tokens == request.num_tokens:
                request.drop_masked_last()  # before its block can be registered in the prefix cache
            # A draft model fed the last token and its drafts: its KV stays valid up to the accepted ones.
            request.speculation.draft_computed = min(
                request.speculation.draft_computed, request.num_computed_tokens
            )
            self.block_manager.trim(request, request.num_computed_tokens)
            self.block_manager.cache_full_blocks(request)
            if self.kv_window:
                self.block_manager.release_before(request, request.num_computed_tokens - self.kv_window + 1)
        now = self.clock()
        groups = {}
        for request, tokens in zip(sampled, (emitted[id(r)] for r in sampled)):
            if request.beam_group is not None:  # a beam: its group re-forks below
                groups[id(request.beam_group)] = request.beam_group
                continue
            for token_id in tokens:
                request.append_token(token_id, self.max_model_len, now)
                if request.is_finished:  # a stop inside the accepted drafts: the rest is dropped
                    break
        for group in (g for g in groups.values() if g.pending is not None):  # None: failed (`BeamGroup.fail`)
            created = group.new_slots()
            for beam in created:  # the first step forks the prompt into num_beams sequences
                self.live[id(beam)] = beam
            if created:
                self.running.merge(created)
                self.running.requests.sort(key=priority_key)  # next to their request (stable)
            group.advance(self.block_manager, created, now)
        if self.latency.targets_used:
            self.latency.observe_first_tokens(sampled)
        finished = self.running.filter(lambda r: not r.is_finished)
        for request in finished:
            self.block_manager.free(request)
            self.live.pop(id(request), None)
            self._forget(request)  # its keys too: a running prefill's came back (`running_prefill_keys`)
        # A beam group's other sequences are internal: the caller holds (and hears of) the request.
        self.finished_in_step = [r for r in finished if r.beam_group is None or r.beam_group.handle is r]
        return self.finished_in_step

    def _drop(self, request: Request) -> None:
        """Take a request out of every queue and free its blocks (a beam leaving its group)."""
        self.unqueue(request)
        self.block_manager.free(request)

    def unqueue(self, request: Request) -> None:
        """Take a request out of the running batch, the queues and the live set."""
        if request in self.running:
            self.running.remove(request)
        for queue in (self.waiting, self.forming):
            if any(r is request for r in queue):
                queue.remove(request)
        self.live.pop(id(request), None)

    # ----------------------------------------------------------------- internals

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens `request` may compute this step within `budget` (0: not this step). A decoding request
        computes its last token plus its drafts (as many as the budget leaves room for)."""
        remaining = request.num_uncomputed_tokens
        if request.masked_last:  # its query-only last token: a step of its own, no drafts (see Request)
            request.speculation.drafts.clear()
            remaining -= remaining > 1
        if remaining == 1:
            if budget < 1:
                return 0
            del request.speculation.drafts[budget - 1 :]
            return 1 + len(request.speculation.drafts)
        if not self.config.chunked_prefill:
            return remaining if remaining <= budget else 0
        cap = self.config.long_prefill_token_threshold or remaining
        return min(remaining, budget, cap)

    def _schedule_running(
        self, kinds: set[str], budget: int, chosen: list[tuple[Request, int]]
    ) -> tuple[int, bool]:
        """Schedule running requests: the budget goes to decodes first, then to prompt chunks; blocks go
        to the oldest requests first. A request short of blocks preempts the newest running requests that
        arrived after it (scheduled this step or not), or, if there are none, yields its own."""
        planned: list[tuple[Request, int]] = []
        timed = self._time
        for kind in ("decode", "prefill"):
            if kind not in kinds:
                continue
            for request in self.running:
                if budget <= 0:
                    break
                if (request.num_uncomputed_tokens == 1) != (kind == "decode"):
                    continue
                count = self._chunk(request, budget)
                if count and timed is not None:
                    count = timed.take(request, count, kind == "decode", self.block_manager.block_size)
                if count:
                    planned.append((request, count))
                    budget -= count
        planned, budget = _whole_groups(planned, budget)
        preempted = False
        granted: set[int] = set()
        slot = {id(r): i for i, (r, _) in enumerate(planned)}
        for request, count in sorted(planned, key=lambda pair: priority_key(pair[0])):
            if request.status is not RequestStatus.RUNNING:  # preempted for an older request
                continue
            while not self.block_manager.allocate(request, count):
                if request.speculation.drafts:  # drop the drafts before preempting anyone for their lookahead
                    request.speculation.drafts.clear()
                    budget += count - 1
                    count = 1
                    planned[slot[id(request)]] = (request, 1)
                    continue
                victim = self.running.requests[-1]  # the newest: never older than `request`
                self.preempt(victim)  # a beam's whole group
                preempted = True
                if request.status is not RequestStatus.RUNNING:  # itself (or its beam group)
                    break
            else:
                granted.add(id(request))
        for request, count in planned:
            if id(request) in granted and request.status is RequestStatus.RUNNING:
                chosen.append((request, count))
            else:
                budget += count
        return budget, preempted

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
            waited = self.clock() - self.waiting[0].metrics.arrival_time
            return waited * 1000.0 >= self.config.max_delay_ms
        return False

    def _admission_queue(self, draining: bool) -> deque[Request]:
        """Where admissions come from: the waiting queue, or the forming dynamic/static batch."""
        if self.config.batching == "continuous":
            if (self._priorities_used or self.config.prefix_aware_admission) and len(self.waiting) > 1:
                self.admission_order.order_waiting()
            elif self.config.group_by_length and len(self.waiting) > 1:
                # Shortest first among the requests that have not started; preempted ones (at the
                # front, oldest first) resume before any of them.
                resuming = num_resuming(self.waiting)
                window = min(len(self.waiting) - resuming, self.max_num_seqs)
                if window > 1:
                    head = [self.waiting[resuming + i] for i in range(window)]
                    head.sort(key=lambda r: r.num_tokens)
                    for i, request in enumerate(head):
                        self.waiting[resuming + i] = request
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
        computing = {key for r, n in chosen for key in self.block_manager.chunk_keys(r, n)}  # grows below
        timed, adaptive = self._time, self._adaptive_admission()
        batch = self.latency.batch_check() if adaptive else None
        prefix_aware = (
            adaptive and self.config.prefix_aware_admission and self.block_manager.enable_prefix_caching
        )
        shared = self.admission_order.running_prefill_keys() if prefix_aware else []
        admitted: list[Request] = []
        index = 0  # past the requests held back this step (a block they need is being computed)
        # A beam request (one sequence until its prompt is computed) holds seats for all its beams.
        seats = len(self.running) + sum(_seats(r) - 1 for r in self.running if r.beam_group is not None)
        while index < len(queue) and budget > 0 and seats < self.max_num_seqs:
            request = queue[index]
            if seats + _seats(request) > self.max_num_seqs:
                break  # a beam group waits for seats for all its beams
            if prefix_aware and self.admission_order.hold_for_shared_prefix(request, shared):
                index += 1
                continue
            if adaptive and self.latency.too_late_to_start(request):
                del queue[index]  # its first token cannot come in time: rejected before any work
                continue
            if batch is not None and not batch.admits(request, len(self.running)):
                break  # the decode batch it would join is predicted to miss a TPOT target
            cached = self.block_manager.match_prefix(request)
            if (first := self.block_manager.next_block_key(request)) is not None and first in computing:
                # What it would compute next is being computed now (copies of a prompt, also past a
                # cached instruction): next step it shares those blocks. Those behind it go on, but not
                # past a preempted request, nor one passed over too often (prefix-aware admission).
                self.block_manager.free(request)  # the matched prefix back: shared again next step
                passed = prefix_aware and request.passed_over >= self.config.max_passed_over
                if request.num_preemptions == 0 and not passed:
                    index, seats = index + 1, seats + _seats(request)  # its seat kept for next step
                    continue
                break
            # Imported K/V (engine/prompt_inputs.py) counts as computed; the engine writes it this step.
            request.num_computed_tokens = max(cached, request.num_imported_tokens)
            count = self._chunk(request, budget)
            if count and timed is not None:
                count = timed.take_admission(request, count, self.block_manager.block_size)
            if count == 0 or not self._may_resume(request) or not self.block_manager.allocate(request, count):
                self.block_manager.free(request)  # give the matched prefix back: nothing changed
                request.num_computed_tokens = 0
                break
            if first is not None:
                computing.add(first)
            self.block_manager.stats.record(request.num_tokens, cached)
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = cached
            del queue[index]
            self._forget(request, estimate=False)
            if request.priority is None:
                request.priority = self._next_priority
                self._next_priority += 1
            request.status = RequestStatus.RUNNING
            self.running.merge([request])
            if len(self.running) > 1 and priority_key(self.running.requests[-2]) > priority_key(request):
                self.running.requests.sort(key=priority_key)  # a resumed request: back to its place
            chosen.append((request, count))
            admitted.append(request)
            budget -= count
            seats += _seats(request)
        if adaptive and admitted:
            count_passed_over(admitted, queue)

    def _may_resume(self, request: Request) -> bool:
        """A request that has not started may always try; a preempted one (behind which nothing has started,
        so every running request is older) only when the free blocks cover the most that it and every
        running request may still need. Lower-priority requests admitted later only borrow blocks: they
        are preempted first when an older one needs them."""
        if not request.num_preemptions:
            return True
        need = self._blocks_to_come([request, *self.running])
        return need <= self.block_manager.num_free_blocks

    def _most_blocks(self, request: Request) -> int:
        group = request.beam_group
        if group is not None:  # all its beams, the prompt's full blocks shared
            return group.max_blocks(self.max_model_len, self.block_manager.block_size)
        longest = min(len(request.prompt_token_ids) + request.stopping.max_new_tokens, self.max_model_len)
        return blocks_for(longest, self.block_manager.block_size)

    def _blocks_to_come(self, requests: Iterable[Request]) -> int:
        """The most blocks `requests` may still take: each one's most less what it holds (a beam group
        counted once, less the distinct blocks its beams hold)."""
        need, seen = 0, set()
        for request in requests:
            group = request.beam_group
            if group is None:
                need += self._most_blocks(request) - len(request.block_ids)
            elif id(group) not in seen:
                seen.add(id(group))
                held = {b for slot in group.slots for b in slot.block_ids}
                need += self._most_blocks(group.handle) - len(held)
        return need

    def preempt(self, request: Request) -> None:
        """Evict a running request: free its blocks and queue it for recomputation, ahead of every request
        that has not started and behind the preempted ones that arrived before it. A beam preempts its
        whole group, which restarts from its prompt (`BeamGroup.reset`)."""
        group = request.beam_group
        if group is not None:
            for slot in group.slots[1:]:
                self._drop(slot)
                slot.finish("preempted")
            request = group.handle
            group.reset()
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.speculation.drafts = []
        request.speculation.draft_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.requeue(request)

    def requeue(self, request: Request) -> None:
        """Queue a preempted request again: ahead of those not started, behind older preempted ones."""
        queue = self.waiting if self.config.batching == "continuous" else self.forming
        position = 0
        while (
            position < len(queue)
            and queue[position].num_preemptions
            and priority_key(queue[position]) < priority_key(request)
        ):
            position += 1
        queue.insert(position, request)

    # ----------------------------------------------------------------- adaptive scheduling

    def _forget(self, request: Request, keys: bool = True, estimate: bool = True) -> None:
        """`request` left the queue (`keys`: its prefix keys go) or the scheduler (`estimate`: its TTFT
        estimate goes too). The policies keep either only under adaptive admission, which once on stays on."""
        if not self._adaptive_admission():
            return
        if keys:
            self.admission_order.forget(request)
        if estimate:
            self.latency.forget(request)

    def _adaptive_admission(self) -> bool:
        return self.latency.targets_used or self._priorities_used or self.config.prefix_aware_admission

    def estimate_ttft(self, request: Request) -> float | None:
        """`LatencyPolicy.estimate_ttft`: seconds from `request`'s arrival to its first token if it joined
        the queue now, or None before the step-time model is ready."""
        return self.latency.estimate_ttft(request)

    @property
    def ttft_calibration(self) -> RatioCalibration:
        return self.latency.ttft_calibration

    @property
    def num_rejected(self) -> int:
        return self.latency.num_rejected

    @property
    def num_warned(self) -> int:
        return self.latency.num_warned

    def retire_rejected(self, request: Request) -> None:
        """A queued request that was just rejected (finished) leaves the scheduler; the caller has taken
        it out of its queue. The engine hears of it from `take_rejected`."""
        self._forget(request, estimate=False)
        self.live.pop(id(request), None)
        self.rejected.append(request)

    def take_rejected(self) -> list[Request]:
        """Requests rejected from the queue since the last call (the engine returns them as finished)."""
        rejected, self.rejected = self.rejected, []
        return rejected

    def prepare_ahead(self) -> None:
        """`AdmissionOrder.prepare_ahead`: the waiting requests' prefix keys, while a forward runs."""
        self.admission_order.prepare_ahead()

    def repair(self, failed: Iterable[Request] = (), error: BaseException | None = None) -> None:
        """Make the queues and the block manager consistent again after an exception interrupted the
        scheduler at any point (`engine/fault_repair.py`); `failed` finish with `error`."""
        fault_repair.repair(self, failed, error)

    def requests(self) -> Iterable[Request]:
        """Every request the scheduler holds, running first."""
        yield from self.running
        yield from self.forming
        yield from self.waiting


def _seats(request: Request) -> int:
    """Sequences `request` takes in the batch: a beam group's first slot stands for all its beams (one
    each, once it forks); any other request takes one."""
    group = request.beam_group
    if group is None:
        return 1
    return group.params.num_beams if request is group.handle and not group.forked else 1


def _whole_groups(planned: list[tuple[Request, int]], budget: int) -> tuple[list[tuple[Request, int]], int]:
    """Drop the beams of groups not planned whole (the budget ran out among them): a beam group steps
    together or not at all. Returns the plan and the budget with their tokens given back."""
    counts: dict[int, int] = {}
    for request, _ in planned:
        if request.beam_group is not None:
            counts[id(request.beam_group)] = counts.get(id(request.beam_group), 0) + 1
    if not counts:
        return planned, budget
    kept = []
    for request, count in planned:
        group = request.beam_group
        if group is not None and counts[id(group)] < len(group.slots):
            budget += count
        else:
            kept.append((request, count))
    return kept, budget
