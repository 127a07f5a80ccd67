"""What the scheduler's policies (`admission_order`, `latency`) read of the scheduler that holds them.

The policies take the scheduler as a `SchedulerState`, this protocol, not as the `Scheduler` class: the
scheduler imports its policies, and nothing here imports the scheduler, so the imports run one way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from hfaccel.config import EngineConfig
from hfaccel.engine.batch import Batch
from hfaccel.engine.block_manager import BlockManager
from hfaccel.engine.request import Request


class CachedBlockCount(Protocol):
    def cached_blocks(self, request: Request) -> int:
        """How many of the request's prompt blocks the prefix cache holds now."""


class TargetsInUse(Protocol):
    targets_used: bool  # some request may carry a latency target


class SchedulerState(Protocol):
    """The queues, limits, clock and step-time model of one scheduler (read live: a test may swap the
    clock or the step-time model)."""

    config: EngineConfig
    block_manager: BlockManager
    waiting: deque[Request]
    running: Batch
    max_num_seqs: int
    max_num_batched_tokens: int
    cost_model: Any
    clock: Callable[[], float]
    admission_order: CachedBlockCount
    latency: TargetsInUse

    def retire_rejected(self, request: Request) -> None:
        """Finish a request that latency admission rejected (its blocks freed, its caller told)."""
