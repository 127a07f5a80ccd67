"""Which waiting request the scheduler admits next: user priority and prefix-aware admission.

Off unless asked for, so admission stays first come, first served. `user_priority` orders admission
(lower first, FCFS within a level); `prefix_aware_admission` prefers requests whose prefix is cached,
and holds one back while a running prefill computes blocks of its prefix, within `max_passed_over`: a
request overtaken that often goes first and is never held back again. Preempted requests (at the front
of the queue) always resume first.
"""

from __future__ import annotations

from collections import deque

from hfaccel.engine.request import Request
from hfaccel.engine.scheduler_state import SchedulerState


class AdmissionOrder:
    """The admission order of one scheduler's waiting requests, which it reads from the scheduler that
    holds it, and the prefix-cache keys of those requests (computed once per request)."""

    def __init__(self, scheduler: SchedulerState) -> None:
        self.scheduler = scheduler
        self._prefix_keys: dict[int, tuple[Request, list]] = {}  # id(request) -> (it, its prefix-cache keys)

    def keys(self, request: Request) -> list:
        entry = self._prefix_keys.get(id(request))
        if entry is None or entry[0] is not request:
            entry = (request, self.scheduler.block_manager.prefix_keys(request))
            self._prefix_keys[id(request)] = entry
        return entry[1]

    def forget(self, request: Request) -> None:
        """`request` is no longer waiting: its keys are not needed any more."""
        self._prefix_keys.pop(id(request), None)

    def clear(self) -> None:
        self._prefix_keys.clear()

    def cached_blocks(self, request: Request) -> int:
        """Leading blocks of `request` the prefix cache holds now (nothing is taken)."""
        if not self.scheduler.block_manager.enable_prefix_caching:
            return 0
        return self.scheduler.block_manager.count_cached(self.keys(request))

    def prepare_ahead(self) -> None:
        """Work for the next admission that does not depend on the running step's tokens: the prefix
        keys of the waiting requests (asynchronous scheduling does it while the forward runs)."""
        scheduler = self.scheduler
        if scheduler.block_manager.enable_prefix_caching and (
            scheduler.config.prefix_aware_admission or scheduler.latency.targets_used
        ):
            window = max(64, 4 * scheduler.max_num_seqs)
            for i, request in enumerate(scheduler.waiting):
                if i >= window:
                    break
                self.keys(request)

    def order_waiting(self) -> None:
        """Admission order of the requests that have not started (preempted ones stay in front): user
        priority (lower first), then requests passed over `max_passed_over` times (oldest first), then,
        with prefix-aware admission, the longest cached prefix first, then (group_by_length) shorter
        first, then arrival."""
        scheduler = self.scheduler
        waiting = scheduler.waiting
        resuming = num_resuming(waiting)
        window = min(len(waiting) - resuming, max(64, 4 * scheduler.max_num_seqs))
        if window <= 1:
            return
        limit = scheduler.config.max_passed_over
        prefix = scheduler.config.prefix_aware_admission and scheduler.block_manager.enable_prefix_caching
        by_length = scheduler.config.group_by_length

        def key(request: Request) -> tuple:
            overdue = request.passed_over >= limit
            cached = self.cached_blocks(request) if prefix and not overdue else 0
            length = request.num_tokens if by_length and not overdue else 0
            return (request.user_priority, not overdue, -cached, length, request.arrival_seq)

        head = sorted((waiting[resuming + i] for i in range(window)), key=key)
        for i, request in enumerate(head):
            waiting[resuming + i] = request

    def running_prefill_keys(self) -> list[list]:
        """Prefix keys of the running requests still computing their prompt."""
        return [
            self.keys(r)
            for r in self.scheduler.running
            if r.num_computed_tokens < len(r.prompt_token_ids) and not r.output_token_ids
        ]

    def hold_for_shared_prefix(self, request: Request, shared: list[list]) -> bool:
        """Whether to hold `request` back one step because a running prefill is computing blocks of its
        prefix that are not cached yet (it takes them from the cache once they are): never a resuming
        request, never one passed over `max_passed_over` times."""
        if (
            not shared
            or request.num_preemptions
            or request.passed_over >= self.scheduler.config.max_passed_over
        ):
            return False
        mine = self.keys(request)
        if not mine:
            return False
        cached = self.scheduler.block_manager.count_cached(mine)
        for theirs in shared:
            common = 0
            for a, b in zip(mine, theirs):
                if a != b:
                    break
                common += 1
            if common > cached:
                return True
        return False


def count_passed_over(admitted: list[Request], queue: deque[Request]) -> None:
    """Every waiting request that a later arrival of its priority level overtook in this step."""
    latest: dict[int, int] = {}
    for request in admitted:
        if not request.num_preemptions:
            level = request.user_priority
            latest[level] = max(latest.get(level, -1), request.arrival_seq)
    for request in queue:
        if not request.num_preemptions and request.arrival_seq < latest.get(request.user_priority, -1):
            request.passed_over += 1


def num_resuming(queue: deque[Request]) -> int:
    """How many requests at the front of `queue` were preempted (they resume before any other)."""
    count = 0
    while count < len(queue) and queue[count].num_preemptions:
        count += 1
    return count
