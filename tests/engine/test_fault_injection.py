"""Fault injection: an exception raised at every line of an engine step leaves a consistent engine.

`sys.settrace` counts the 'line' events of frames whose code lives in ``hfaccel/engine/`` (the engine,
scheduler, block manager, batch packing, runner, sampler and request code a step runs) and raises at
the N-th one. After the fault: the bookkeeping matches the requests (`check_consistent`), the requests
that survived finish with HF's greedy tokens, no block stays held once the engine is idle, and the next
generate on the same engine matches HF greedy.

By default every reference step is swept with a stride (well under 30 s); ``HFACCEL_FULL_FAULT_TESTS=1``
raises at every line event of every reference step (``make test-faults``).
"""

from __future__ import annotations

import os
from functools import cache

import pytest

from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import (
    Fault,
    assert_same_or_near_tie,
    check_consistent,
    hf_greedy,
    tiny_model,
    untraced_forward,
)

FULL = os.environ.get("HFACCEL_FULL_FAULT_TESTS") == "1"
MODEL = tiny_model("llama", layers=1)
MAX_NEW = 8
SHARED = list(range(10, 22))
PROMPTS = [
    SHARED + [30, 31],
    SHARED + [40],
    list(range(50, 59)),
    [60],
    SHARED + [70, 71, 72, 73, 74],
    list(range(80, 87)),
]
NEXT_PROMPT = SHARED + [90, 91]  # after the fault: shares cached blocks with the requests before it
# 12 blocks of 4 tokens, chunks of at most 6 tokens: the reference run admits with prefix hits, chunks
# prompts, preempts, and finishes requests; these are its steps that do each (see `test_reference`).
CONFIG = EngineConfig(
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    kv_cache_memory=12 * 1024,
    long_prefill_token_threshold=6,
)
STEPS = {
    1: "chunked prompts; two copies of a prefix being computed wait (matched, then given back)",
    2: "admit with a prefix hit",
    6: "preempt",
    9: "admit with prefix hits, finish one",
}
STRIDE = 1 if FULL else 61  # about 40 of the ~2,400 line events by default


@cache
def hf_reference(prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(MODEL, list(prompt), MAX_NEW)


def never_stops(prompt: list[int], ids: list[int]) -> bool:
    return False


def start(engine: Engine) -> list:
    """Queue the reference workload (every other request with a stop check, run per token)."""
    return [
        engine.add_request(
            p, StoppingParams(max_new_tokens=MAX_NEW, stop_check=never_stops if i % 2 else None)
        )
        for i, p in enumerate(PROMPTS)
    ]


def drain(engine: Engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step(draining=True)
    raise AssertionError(f"the engine did not drain: {engine!r}")


def reference_line_counts() -> dict[int, int]:
    engine = Engine(MODEL, CONFIG)
    untraced_forward(engine)
    start(engine)
    counts = {}
    for k in range(max(STEPS) + 1):
        with Fault() as fault:
            engine.step(draining=True)
        counts[k] = fault.lines
    return counts


LINES = reference_line_counts()
CASES = [(k, n) for k in sorted(STEPS) for n in range(1 + k % STRIDE, LINES[k] + 1, STRIDE)]


def test_reference_workload_covers_the_cases_it_claims():
    engine = Engine(MODEL, CONFIG)
    requests = start(engine)
    stats = []
    while engine.has_unfinished_requests():
        finished = engine.step(draining=True)
        stats.append((engine.step_stats[-1], len(finished)))
    assert stats[1][0].num_prefill_tokens > 0 and stats[1][0].num_seqs == 3  # two copies wait
    assert stats[2][0].prefix_hit_tokens > 0 and stats[2][0].num_prefill_tokens > 0
    assert stats[6][0].num_preemptions > 0
    assert stats[9][0].prefix_hit_tokens > 0 and stats[9][1] == 1
    for prompt, request in zip(PROMPTS, requests):
        assert_same_or_near_tie(MODEL, prompt, request.output_token_ids, hf_reference(tuple(prompt)))


def run_with_fault(step_index: int, at: int, error: type[BaseException]) -> None:
    engine = Engine(MODEL, CONFIG)
    untraced_forward(engine)
    requests = start(engine)
    for _ in range(step_index):
        engine.step(draining=True)
    before = {id(r) for r in requests if r.is_finished}
    raised = None
    with Fault(at, error) as fault:
        try:
            engine.step(draining=True)
        except BaseException as exc:  # noqa: BLE001 - the injected fault, checked below
            raised = exc
    assert fault.fired, f"step {step_index} has fewer than {at} line events"
    if raised is not None:
        assert isinstance(raised, error)
    check_consistent(engine)
    for request in requests:
        if request.finish_reason == "error":
            assert id(request) not in before and request.block_ids == []
            assert isinstance(request.error, error)
    drain(engine)
    check_consistent(engine)
    manager = engine.block_manager
    assert manager.num_used_blocks == 0
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))
    for prompt, request in zip(PROMPTS, requests):
        assert request.is_finished
        if request.finish_reason != "error":
            assert_same_or_near_tie(MODEL, prompt, request.output_token_ids, hf_reference(tuple(prompt)))
    following = engine.make_request(NEXT_PROMPT, StoppingParams(max_new_tokens=MAX_NEW))
    engine.run([following])
    assert_same_or_near_tie(MODEL, NEXT_PROMPT, following.output_token_ids, hf_reference(tuple(NEXT_PROMPT)))
    assert manager.num_used_blocks == 0


@pytest.mark.parametrize(("step_index", "at"), CASES, ids=[f"step{k}-line{n}" for k, n in CASES])
def test_keyboard_interrupt_at_any_line_of_a_step(step_index, at):
    run_with_fault(step_index, at, KeyboardInterrupt)


ERROR_CASES = CASES if FULL else CASES[3::8]


@pytest.mark.parametrize(("step_index", "at"), ERROR_CASES, ids=[f"step{k}-line{n}" for k, n in ERROR_CASES])
def test_runtime_error_at_any_line_of_a_step(step_index, at):
    run_with_fault(step_index, at, RuntimeError)


def test_an_interrupt_as_a_step_returns_fails_what_it_retired_instead_of_losing_it():
    """A Ctrl-C on the step's last line (its requests retired, its schedule cleared, the list not yet
    returned): the caller never gets them from `step`, so they fail with the interrupt, as the step's
    other requests do, instead of staying finished unannounced (a hypothesis machine found it). The
    engine then serves the next request."""
    import linecache
    import sys

    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=400_000, max_num_seqs=6))
    request = engine.add_request([5, 6, 7], StoppingParams(max_new_tokens=1))

    def at_the_return(frame, event, arg):
        if frame.f_code.co_name != "_step":
            return None
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and line.startswith("return finished") and request.is_finished:
            raise KeyboardInterrupt("as the step returns")
        return at_the_return

    sys.settrace(at_the_return)
    try:
        with pytest.raises(KeyboardInterrupt):
            while not request.is_finished:
                engine.step()
    finally:
        sys.settrace(None)
    assert request.finish_reason == "error" and isinstance(request.error, KeyboardInterrupt)
    check_consistent(engine)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    again = engine.make_request([5, 6, 7], StoppingParams(max_new_tokens=3))
    engine.run([again])
    assert again.output_token_ids == hf_greedy(MODEL, [5, 6, 7], 3)
