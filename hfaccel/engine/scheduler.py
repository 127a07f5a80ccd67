"""Iteration-level scheduling: which tokens of which requests the next step computes.

Each step has one token budget (`max_num_batched_tokens`) and a cap on sequences (`max_num_seqs`).
Running requests come first, oldest first: a decode costs one token, an unfinished prompt a chunk of
what is left of the budget. Waiting requests are then admitted, in arrival order, while the budget,
the sequence cap and the free KV blocks allow; a prompt longer than the budget left is split into
chunks over several steps. When a running request needs a block and none is free, the newest running
request is preempted: its blocks are freed and it is recomputed later, with the same output.
"""

from __future__ import annotations

from collections import deque

from hfaccel.engine.batch import Batch, ScheduledStep
from hfaccel.engine.block_manager import BlockManager, blocks_for
from hfaccel.engine.request import Request, RequestStatus


class Scheduler:
    """Owns the waiting queue and the running batch."""

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running = Batch()
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a request; raise ValueError if it could never fit the KV cache on its own."""
        longest = min(len(request.prompt_token_ids) + request.stopping.max_new_tokens, self.max_model_len)
        needed = blocks_for(longest, self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"the KV cache holds {self.block_manager.num_blocks} blocks of {self.block_manager.block_size} "
                f"tokens, but request {request.request_id!r} needs {needed} blocks ({longest} tokens); "
                "raise kv_cache_memory or shorten the request"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or len(self.running) > 0

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is, free its blocks at once, and mark it finished."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        if not request.is_finished:
            request.finish("abort")

    def schedule(self) -> ScheduledStep:
        """Choose this step's work. Never exceeds the token budget, the sequence cap or the free blocks."""
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running.requests[index]
            count = min(request.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate(request, count):
                victim = self.running.requests[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chosen.append((request, count))
                budget -= count
                index += 1
        # Admitting while preempting would only thrash: the freed blocks go to the running requests first.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            count = min(request.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate(request, count):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.merge([request])
            chosen.append((request, count))
            budget -= count
        chosen.sort(key=lambda pair: pair[1] != 1)  # one-token sequences first (stable)
        return ScheduledStep([r for r, _ in chosen], [n for _, n in chosen])

    def update(self, step: ScheduledStep, sampled: list[Request], token_ids: list[int]) -> list[Request]:
        """Advance the computed tokens, record sampled tokens, and retire finished requests.

        Returns the requests that finished in this step.
        """
        for request, count in zip(step.requests, step.num_tokens):
            request.num_computed_tokens += count
        for request, token_id in zip(sampled, token_ids):
            request.append_token(token_id, self.max_model_len)
        finished = self.running.filter(lambda r: not r.is_finished)
        for request in finished:
            self.block_manager.free(request)
        return finished

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
