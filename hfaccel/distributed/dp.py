"""Data parallelism: D engine replicas, each on its own group of ranks, requests spread by load.

``hfaccel.patch(model, data_parallel_size=D)`` splits the world into D replicas of ``world // D``
consecutive ranks (each replica one process, or a tensor- or pipeline-parallel group of them). Every
replica has its own engine: its own scheduler and paged KV cache. `hfaccel.generate` then:

1. all-gathers each replica's load: the tokens its scheduler still has to compute (waiting and running
   requests) and its free KV blocks (`replica_load`);
2. assigns the call's requests to replicas, longest prompt first, each to the replica whose queued
   tokens (with what it was given so far) fill the smallest share of its free KV cache
   (`assign_requests`) — a deterministic function of gathered numbers, so every rank computes the same
   assignment without another message;
3. runs its replica's requests only (the ranks of a tensor-parallel replica run the same ones, in lock
   step);
4. all-gathers the completions and returns all of them, in request order, on every rank.

``model.generate`` (HF's call) is not spread: each replica runs the batch it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from hfaccel.distributed.layout import parallel_layout, record_layout
from hfaccel.distributed.world import init_world


@dataclass
class DPState:
    size: int
    replica: int
    ranks_per_replica: int
    # Per generate call: the replica each runnable request went to, and the loads it was decided on.
    assignments: list[tuple[list[int], list[tuple[int, int]]]] = field(default_factory=list)


def setup_data_parallel(model: Any, size: int | None) -> DPState | None:
    existing = parallel_layout(model).dp
    if size is None:
        return existing
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return existing
    if existing is not None:
        if existing.size != size:
            raise ValueError(f"the model already has {existing.size} data-parallel replicas")
        return existing
    world = init_world(size, "data_parallel_size", next(model.parameters()).device)
    per = world // size
    inner = parallel_layout(model).replica_size
    if inner != per:
        raise ValueError(
            f"data_parallel_size={size} over {world} processes gives replicas of {per} ranks, but each replica "
            f"is {inner} rank(s) (tensor_parallel_size x pipeline_parallel_size): the world must be their product"
        )
    state = DPState(size=size, replica=dist.get_rank() // per, ranks_per_replica=per)
    record_layout(model, dp=state)
    return state


def replica_load(engine: Any) -> tuple[int, int]:
    """(tokens still to compute, free KV tokens) of an engine."""
    scheduler = engine.scheduler
    queued = sum(r.num_uncomputed_tokens for r in scheduler.waiting)
    queued += sum(r.num_uncomputed_tokens for r in getattr(scheduler, "forming", ()) or ())
    queued += sum(r.num_uncomputed_tokens for r in scheduler.running)
    free = engine.block_manager.num_free_blocks * engine.config.block_size
    return queued, free


def assign_requests(costs: list[int], loads: list[tuple[int, int]]) -> list[int]:
    """The replica of each request (`costs`: its tokens), given each replica's (queued tokens, free KV
    tokens): longest first, each to the replica where (queued + assigned + this) / free is smallest;
    ties go to the lower replica. Not round robin: a busy or cache-starved replica gets less."""
    queued = [q for q, _ in loads]
    free = [max(f, 1) for _, f in loads]
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        best = min(range(len(loads)), key=lambda r: ((queued[r] + costs[i]) / free[r], r))
        owner[i] = best
        queued[best] += costs[i]
    return owner


def spread(dp: DPState, engine: Any, costs: list[int], call: str = "") -> list[int]:
    """Every replica's load gathered (a collective over the world), then `assign_requests`. `call`
    fingerprints the rank's call: every rank must have made the same one (each returns all the
    completions), so ranks that did not all raise, at once."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (replica_load(engine), call))
    calls = [c for _, c in gathered]
    if any(c != calls[0] for c in calls):
        differ = [r for r, c in enumerate(calls) if c != calls[0]]
        raise ValueError(
            "data parallelism: every rank must call hfaccel.generate with the same prompts and arguments "
            f"(each returns all the completions); rank(s) {differ} called with others than rank 0"
        )
    loads = [load for load, _ in gathered]
    per_replica = [loads[r * dp.ranks_per_replica] for r in range(dp.size)]
    owner = assign_requests(costs, per_replica)
    dp.assignments.append((owner, per_replica))
    return owner


def gather(dp: DPState, mine: dict[int, Any]) -> dict[int, Any]:
    """Every replica's `mine` (index -> completion) merged, on every rank (a collective)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: dict[int, Any] = {}
    for r in range(dp.size):
        merged.update(gathered[r * dp.ranks_per_replica])
    return merged
