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

Fault safety: every request the scheduler holds is also in `live`, and the block manager never counts a
block below its holders, so after an exception at any point `repair` rebuilds a consistent state.
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
        self.running = Batch()  # in arrival order
        self.num_preemptions = 0
        # Every request queued and not yet retired, by id: what `repair` rebuilds the queues from.
        self.live: dict[int, Request] = {}
        # The current step's choices so far (request, tokens); the engine clears it when the step is done.
        self.scheduled: list[tuple[Request, int]] = []
        self._next_priority = 0
        self.spec_drafted = self.spec_accepted = self.spec_steps = 0  # speculative totals

    # ----------------------------------------------------------------- requests in and out

    def add(self, request: Request) -> None:
        """Queue a request; raise ValueError (queueing nothing) if it could never be served."""
        self.check(request)
        request.status = RequestStatus.WAITING
        self.live[id(request)] = request
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
        """Drop a request wherever it is, free its blocks at once, and mark it finished.

        Idempotent, and safe in any state: a finished request is left as it is; one this scheduler never
        queued is only marked finished (or refused with ValueError if it holds another cache's blocks).
        """
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
            drafts = len(request.spec_token_ids)
            if drafts and count == 1 + drafts:  # a verification: keep the accepted drafts' KV only
                accepted = len(emitted.get(id(request), [None])) - 1
                count = 1 + accepted
                request.spec_drafted += drafts
                request.spec_accepted += accepted
                request.spec_steps += 1
                self.spec_drafted += drafts
                self.spec_accepted += accepted
                self.spec_steps += 1
            request.spec_token_ids = []
            request.spec_draft_probs = None
            request.num_computed_tokens += count
            # A draft model fed the last token and its drafts: its KV stays valid up to the accepted ones.
            request.draft_computed = min(request.draft_computed, request.num_computed_tokens)
            self.block_manager.trim(request, request.num_computed_tokens)
            self.block_manager.cache_full_blocks(request)
        now = time.perf_counter()
        for request, tokens in zip(sampled, (emitted[id(r)] for r in sampled)):
            for token_id in tokens:
                request.append_token(token_id, self.max_model_len, now)
                if request.is_finished:  # a stop inside the accepted drafts: the rest is dropped
                    break
        finished = self.running.filter(lambda r: not r.is_finished)
        for request in finished:
            self.block_manager.free(request)
            self.live.pop(id(request), None)
        return finished

    # ----------------------------------------------------------------- internals

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens `request` may compute this step within `budget` (0: not this step). A decoding request
        computes its last token plus its drafts (as many as the budget leaves room for)."""
        remaining = request.num_uncomputed_tokens
        if remaining == 1:
            if budget < 1:
                return 0
            del request.spec_token_ids[budget - 1 :]
            return 1 + len(request.spec_token_ids)
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
        for kind in ("decode", "prefill"):
            if kind not in kinds:
                continue
            for request in self.running:
                if budget <= 0:
                    break
                if (request.num_uncomputed_tokens == 1) != (kind == "decode"):
                    continue
                count = self._chunk(request, budget)
                if count:
                    planned.append((request, count))
                    budget -= count
        preempted = False
        granted: set[int] = set()
        slot = {id(r): i for i, (r, _) in enumerate(planned)}
        for request, count in sorted(planned, key=lambda pair: _priority(pair[0])):
            if request.status is not RequestStatus.RUNNING:  # preempted for an older request
                continue
            while not self.block_manager.allocate(request, count):
                if request.spec_token_ids:  # drop the drafts before preempting anyone for their lookahead
                    request.spec_token_ids.clear()
                    budget += count - 1
                    count = 1
                    planned[slot[id(request)]] = (request, 1)
                    continue
                victim = self.running.requests[-1]  # the newest: never older than `request`
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                granted.add(id(request))
        for request, count in planned:
            if id(request) in granted:
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
            waited = time.perf_counter() - self.waiting[0].metrics.arrival_time
            return waited * 1000.0 >= self.config.max_delay_ms
        return False

    def _admission_queue(self, draining: bool) -> deque[Request]:
        """Where admissions come from: the waiting queue, or the forming dynamic/static batch."""
        if self.config.batching == "continuous":
            if self.config.group_by_length and len(self.waiting) > 1:
                # Shortest first among the requests that have not started; preempted ones (at the
                # front, oldest first) resume before any of them.
                resuming = self._num_resuming(self.waiting)
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
            if count == 0 or not self._may_resume(request) or not self.block_manager.allocate(request, count):
                self.block_manager.free(request)  # give the matched prefix back: nothing changed
                request.num_computed_tokens = 0
                break
            if first is not None:
                computing.add(first)
            self.block_manager.stats.record(request.num_tokens, cached)
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = cached
            queue.popleft()
            if request.priority is None:
                request.priority = self._next_priority
                self._next_priority += 1
            request.status = RequestStatus.RUNNING
            self.running.merge([request])
            if len(self.running) > 1 and _priority(self.running.requests[-2]) > _priority(request):
                self.running.requests.sort(key=_priority)  # a resumed request: back to its place
            chosen.append((request, count))
            budget -= count

    def _may_resume(self, request: Request) -> bool:
        """A request that has not started may always try; a preempted one (behind which nothing has started,
        so every running request is older) only when the free blocks cover the most that it and every
        running request may still need. Lower-priority requests admitted later only borrow blocks: they
        are preempted first when an older one needs them."""
        if not request.num_preemptions:
            return True
        need = self._most_blocks(request) - len(request.block_ids)
        need += sum(self._most_blocks(r) - len(r.block_ids) for r in self.running)
        return need <= self.block_manager.num_free_blocks

    def _most_blocks(self, request: Request) -> int:
        longest = min(len(request.prompt_token_ids) + request.stopping.max_new_tokens, self.max_model_len)
        return blocks_for(longest, self.block_manager.block_size)

    def preempt(self, request: Request) -> None:
        """Evict a running request: free its blocks and queue it for recomputation, ahead of every request
        that has not started and behind the preempted ones that arrived before it."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.spec_draft_probs = None
        request.draft_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        queue = self.waiting if self.config.batching == "continuous" else self.forming
        position = 0
        while (
            position < len(queue)
            and queue[position].num_preemptions
            and _priority(queue[position]) < _priority(request)
        ):
            position += 1
        queue.insert(position, request)

    @staticmethod
    def _num_resuming(queue: deque[Request]) -> int:
        count = 0
        while count < len(queue) and queue[count].num_preemptions:
            count += 1
        return count

    def repair(self, failed: Iterable[Request] = (), error: BaseException | None = None) -> None:
        """Make the queues and the block manager consistent again after an exception interrupted the
        scheduler (or anything it called) at any point.

        `failed` (the interrupted step's requests) finish with ``finish_reason="error"`` and `error`.
        Running requests whose state is whole stay running, in arrival order; any other request still
        held (also one caught between two queues) waits, and one that had started computing is queued for
        recomputation like a preempted one. Then every block count is recomputed from the block tables of
        the requests that remain.
        """
        for request in failed:
            request.fail(error if error is not None else RuntimeError("the step failed"))
        held: dict[int, Request] = {}
        for request in (*self.live.values(), *self.running, *self.waiting, *self.forming, *failed):
            held.setdefault(id(request), request)
        in_queue = {id(r) for r in (*self.waiting, *self.forming)}
        running: list[Request] = []
        for request in self.running:
            if (
                id(request) in held
                and not request.is_finished
                and request.status is RequestStatus.RUNNING
                and id(request) not in in_queue
                and self._is_whole(request)
            ):
                running.append(request)
                held.pop(id(request))
        running.sort(key=_priority)
        self.running = Batch(running)
        waiting = [r for r in self.waiting if id(r) in held and not r.is_finished]
        forming = [r for r in self.forming if id(r) in held and not r.is_finished]
        placed = {id(r) for r in (*waiting, *forming)}
        self.waiting = deque(dict.fromkeys(waiting))  # ordered and without duplicates
        self.forming = deque(dict.fromkeys(forming))
        self.live = {id(r): r for r in (*running, *self.waiting, *self.forming)}
        resuming = []
        for request in reversed(held.values()):  # newest arrival first: the oldest ends up in front
            if request.is_finished:
                request.block_ids = []  # retired or failed: holds nothing
                continue
            self.live[id(request)] = request
            if request.status is RequestStatus.RUNNING or request.output_token_ids:
                request.num_preemptions = max(request.num_preemptions, 1)  # recomputed, like a preempted one
            request.block_ids = []
            request.num_computed_tokens = 0
            request.num_hashed_blocks, request.prefix_hash = 0, 0
            request.draft_computed = 0
            request.spec_token_ids, request.spec_draft_probs = [], None
            request.status = RequestStatus.WAITING
            if id(request) in placed:
                continue
            if request.num_preemptions:
                resuming.append(request)
            else:
                (self.waiting if self.config.batching == "continuous" else self.forming).appendleft(request)
        for request in resuming:  # ahead of the requests that have not started
            self._requeue(request)
        self.scheduled = []
        self.block_manager.repair(self.live.values())

    def _is_whole(self, request: Request) -> bool:
        """A running request's state is consistent: KV blocks for what it computed, something to compute."""
        computed = request.num_computed_tokens
        blocks = request.block_ids
        return (
            0 <= computed < request.num_tokens
            and len(blocks) >= blocks_for(computed, self.block_manager.block_size)
            and len(set(blocks)) == len(blocks)
            and request.num_hashed_blocks <= min(len(blocks), computed // self.block_manager.block_size)
        )

    def requests(self) -> Iterable[Request]:
        """Every request the scheduler holds, running first."""
        yield from self.running
        yield from self.forming
        yield from self.waiting


def _priority(request: Request) -> int:
    return -1 if request.priority is None else request.priority
