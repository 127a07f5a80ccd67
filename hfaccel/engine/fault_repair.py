"""Fault repair: the scheduler's queues and the block manager made consistent again after an exception
interrupted a step at any line (the engine calls it from its recovery; `make test-faults` raises at every
line of a step to check it). Functions over the scheduler that holds the queues."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from hfaccel.engine.batch import Batch
from hfaccel.engine.block_manager import blocks_for
from hfaccel.engine.request import Request, RequestStatus, priority_key


def repair(scheduler: Any, failed: Iterable[Request] = (), error: BaseException | None = None) -> None:
    """Make the queues and the block manager consistent again after an exception interrupted the
    scheduler (or anything it called) at any point.

    `failed` (the interrupted step's requests) finish with ``finish_reason="error"`` and `error`.
    Running requests whose state is whole stay running, in arrival order; any other request still
    held (also one caught between two queues) waits, and one that had started computing is queued for
    recomputation like a preempted one. Then every block count is recomputed from the block tables of
    the requests that remain.
    """
    failed = _repair_beams(scheduler, list(failed), error)
    for request in failed:
        request.fail(error if error is not None else RuntimeError("the step failed"))
    held: dict[int, Request] = {}
    for request in (
        *scheduler.live.values(),
        *scheduler.running,
        *scheduler.waiting,
        *scheduler.forming,
        *failed,
    ):
        held.setdefault(id(request), request)
    in_queue = {id(r) for r in (*scheduler.waiting, *scheduler.forming)}
    running: list[Request] = []
    for request in scheduler.running:
        if (
            id(request) in held
            and not request.is_finished
            and request.status is RequestStatus.RUNNING
            and id(request) not in in_queue
            and is_whole(scheduler.block_manager.block_size, request)
        ):
            running.append(request)
            held.pop(id(request))
    running.sort(key=priority_key)
    scheduler.running = Batch(running)
    waiting = [r for r in scheduler.waiting if id(r) in held and not r.is_finished]
    forming = [r for r in scheduler.forming if id(r) in held and not r.is_finished]
    placed = {id(r) for r in (*waiting, *forming)}
    scheduler.waiting = deque(dict.fromkeys(waiting))  # ordered and without duplicates
    scheduler.forming = deque(dict.fromkeys(forming))
    scheduler.live = {id(r): r for r in (*running, *scheduler.waiting, *scheduler.forming)}
    resuming = []
    for request in reversed(held.values()):  # newest arrival first: the oldest ends up in front
        if request.is_finished:
            request.block_ids, request.window_table = [], None  # retired or failed: holds nothing
            continue
        scheduler.live[id(request)] = request
        if request.status is RequestStatus.RUNNING or request.output_token_ids:
            request.num_preemptions = max(request.num_preemptions, 1)  # recomputed, like a preempted one
        request.block_ids, request.window_table = [], None
        request.num_computed_tokens = 0
        request.num_hashed_blocks, request.prefix_hash = 0, 0
        request.speculation.draft_computed = 0
        request.speculation.drafts = []
        request.status = RequestStatus.WAITING
        if id(request) in placed:
            continue
        if request.num_preemptions:
            resuming.append(request)
        else:
            (
                scheduler.waiting if scheduler.config.batching == "continuous" else scheduler.forming
            ).appendleft(request)
    for request in resuming:  # ahead of the requests that have not started
        scheduler.requeue(request)
    scheduler.scheduled, scheduler.finished_in_step = [], []
    scheduler.admission_order.clear()
    scheduler.latency.clear()
    scheduler.block_manager.repair(scheduler.live.values())


def _repair_beams(scheduler: Any, failed: list[Request], error: BaseException | None) -> list[Request]:
    """`repair` for beam groups, which stay whole: a group with a failed beam fails entirely (its
    request carries the error); a group whose beams are not all running and whole restarts from its
    prompt (`BeamGroup.reset`: the request is queued again, its other beams forgotten). Returns
    `failed` with the failed groups' beams added."""
    groups = {}
    for request in (
        *failed,
        *scheduler.live.values(),
        *scheduler.running,
        *scheduler.waiting,
        *scheduler.forming,
    ):
        group = request.beam_group
        if group is None:
            continue
        groups.setdefault(id(group), group)
        if not any(s is request for s in group.slots):  # a beam its group never took in (or let go)
            _forget_beam(scheduler, request)
    failing = {id(r) for r in failed}
    for group in groups.values():
        slots = group.slots
        if any(id(s) in failing for s in slots) or group.handle.is_finished:
            for slot in slots:
                if id(slot) not in failing and not slot.is_finished:
                    failed.append(slot)
                    failing.add(id(slot))
            continue
        queued = {id(r) for r in (*scheduler.waiting, *scheduler.forming)}
        # A copy on write the interrupted step queued but never ran: that beam's block is not filled.
        whole = all(
            not scheduler.block_manager.copy_pending(slot)
            and slot in scheduler.running
            and slot.status is RequestStatus.RUNNING
            and not slot.is_finished
            and id(slot) not in queued
            and is_whole(scheduler.block_manager.block_size, slot)
            for slot in slots
        )
        if whole and (not group.forked or len(slots) == group.params.num_beams):
            continue
        for slot in slots[1:]:
            _forget_beam(scheduler, slot)
        if group.handle in scheduler.running and group.forked:
            scheduler.running.remove(group.handle)  # queued again below, like a preempted request
        group.reset()
    return failed


def _forget_beam(scheduler: Any, beam: Request) -> None:
    """`repair`: a beam leaves every queue and holds nothing (the block counts are rebuilt after)."""
    scheduler.unqueue(beam)
    beam.block_ids, beam.window_table = [], None
    if not beam.is_finished:
        beam.finish("preempted")


def is_whole(block_size: int, request: Request) -> bool:
    """A running request's state is consistent: KV blocks for what it computed, something to compute."""
    computed = request.num_computed_tokens
    window = request.window_table  # a model's sliding layers' table in a pool of their own: in lockstep
    return (
        0 <= computed < request.num_tokens
        and _whole_table(block_size, request, computed)
        and (
            window is None
            or (
                _whole_table(block_size, window, computed) and len(window.block_ids) == len(request.block_ids)
            )
        )
    )


def _whole_table(block_size: int, table: Any, computed: int) -> bool:
    """A block table (a request's or its window table) holds distinct blocks for `computed` tokens."""
    blocks = table.block_ids
    held = blocks[table.num_slid_blocks :]
    return (
        len(blocks) >= blocks_for(computed, block_size)
        and len(set(held)) == len(held)
        and all(b >= 0 for b in held)
        and table.num_hashed_blocks <= min(len(blocks), computed // block_size)
    )
