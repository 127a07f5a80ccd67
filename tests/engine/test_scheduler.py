import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel import EngineConfig
from hfaccel.engine.block_manager import BlockManager
from hfaccel.engine.request import Request, StoppingParams
from hfaccel.engine.scheduler import Scheduler


def make(rid, prompt_len, max_new=4, token=5):
    return Request(rid, [token] * prompt_len, StoppingParams(max_new_tokens=max_new))


def scheduler(num_blocks=64, block_size=4, max_model_len=256, prefix=False, **config):
    config.setdefault("max_num_batched_tokens", max(block_size, 32))
    engine_config = EngineConfig(block_size=block_size, enable_prefix_caching=prefix, **config)
    return Scheduler(BlockManager(num_blocks, block_size, prefix), engine_config, max_model_len)


def run_step(sched, draining=True):
    step = sched.schedule(draining)
    sampled = [r for r, n in zip(step.requests, step.num_tokens) if r.num_computed_tokens + n == r.num_tokens]
    sched.update(step, sampled, [7] * len(sampled))
    return step


def simulate(sched, requests, max_steps=500):
    """Drive the scheduler as the engine would, sampling token 7; check invariants at every step."""
    for r in requests:
        sched.add(r)
    steps = []
    while sched.has_unfinished():
        step = run_step(sched)
        assert step.requests, "no progress"
        assert step.total_tokens <= sched.max_num_batched_tokens
        assert len(step) <= sched.max_num_seqs
        assert all(n >= 1 for n in step.num_tokens)
        steps.append(step)
        assert len(steps) < max_steps
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return steps


def test_decodes_and_new_prefills_share_a_step():
    sched = scheduler(max_num_batched_tokens=32)
    a = make("a", 3, max_new=5)
    sched.add(a)
    run_step(sched)
    sched.add(make("b", 6))
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == ["a", "b"]
    assert step.num_tokens == [1, 6]


def test_long_prompt_is_chunked_under_the_budget():
    sched = scheduler(max_num_batched_tokens=8)
    long = make("long", 20, max_new=2)
    steps = simulate(sched, [long])
    assert [s.num_tokens for s in steps[:3]] == [[8], [8], [4]]
    assert long.output_token_ids == [7, 7] and long.finish_reason == "length"


def test_long_prefill_threshold_caps_chunks_and_decodes_keep_flowing():
    sched = scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    chat = make("chat", 3, max_new=6)
    sched.add(chat)
    run_step(sched)
    sched.add(make("long", 20, max_new=1))
    sizes = []
    while not chat.is_finished:
        step = run_step(sched)
        assert chat in step.requests, "a long prompt never stalls a running decode"
        sizes.append(dict(zip((r.request_id for r in step.requests), step.num_tokens)).get("long"))
    assert sizes[:4] == [6, 6, 6, 2]


@pytest.mark.parametrize("chunked", [True, False])
def test_a_masked_last_token_gets_a_step_of_its_own_and_leaves_the_prompt(chunked):
    """Beside the tokens before it, a decode kernel that stores and attends row by row could read
    them unwritten; afterwards it leaves the prompt and the cache (`Request.drop_masked_last`)."""
    sched = scheduler(max_num_batched_tokens=32, chunked_prefill=chunked, prefix=True, block_size=2)
    right = Request("right", [5, 6, 8, 9, 11], StoppingParams(max_new_tokens=3))
    right.feed_masked_last()
    steps = simulate(sched, [right])
    assert [s.num_tokens for s in steps] == [[4], [1], [1], [1]]
    assert right.prompt_token_ids == [5, 6, 8, 9] and right.output_token_ids == [7, 7, 7]
    # Its blocks are registered under a salt of their own: the shifted tokens reach no other prompt.
    plain = make("plain", 6, max_new=1)
    plain.prompt_token_ids = [5, 6, 8, 9, 7, 7]
    assert sched.block_manager.match_prefix(plain) == 0


def test_without_chunking_a_prompt_runs_whole_or_waits():
    sched = scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    steps = simulate(sched, [make("a", 10, max_new=2), make("b", 10, max_new=2)])
    assert steps[0].num_tokens == [10]  # b does not fit next to a: it waits, unsplit
    assert 10 in steps[1].num_tokens
    with pytest.raises(ValueError, match=r"more than max_num_batched_tokens \(16\); enable chunked_prefill"):
        sched.add(make("too-long", 15, max_new=4))


@pytest.mark.parametrize("policy", ["prefill_first", "decode_first"])
def test_separated_policies_never_mix_kinds(policy):
    sched = scheduler(max_num_batched_tokens=32, scheduling_policy=policy)
    first = make("first", 3, max_new=6)
    sched.add(first)
    run_step(sched)
    sched.add(make("second", 5, max_new=2))
    step = run_step(sched)
    kinds = {n == 1 for n in step.num_tokens}
    assert len(kinds) == 1
    if policy == "prefill_first":
        assert [r.request_id for r in step.requests] == ["second"]
    else:
        assert [r.request_id for r in step.requests] == ["first"]
    simulate(sched, [])


def test_max_num_seqs_caps_the_running_batch():
    sched = scheduler(max_num_seqs=2)
    steps = simulate(sched, [make(i, 3) for i in range(5)])
    assert max(len(s) for s in steps) == 2


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_batch_strategies_run_each_batch_to_completion(batching):
    sched = scheduler(batching=batching, max_num_seqs=8, max_batch_size=2, max_delay_ms=1e9)
    lengths = [2, 6, 3, 3, 5]
    requests = [make(i, 3, max_new=n) for i, n in enumerate(lengths)]
    steps = simulate(sched, requests)
    admitted = [[r.request_id for r, n in zip(s.requests, s.num_tokens) if n > 1] for s in steps]
    admitted = [a for a in admitted if a]
    assert admitted == [[0, 1], [2, 3], [4]]
    # The second batch starts only after the slower request of the first (6 tokens) is done.
    second = next(i for i, s in enumerate(steps) if any(r.request_id == 2 for r in s.requests))
    assert second == 6


def test_static_waits_for_a_full_batch_unless_draining():
    sched = scheduler(batching="static", max_batch_size=3)
    sched.add(make("a", 3))
    assert not sched.schedule(draining=False).requests
    assert sched.schedule(draining=True).num_tokens == [3]


def test_dynamic_runs_a_partial_batch_after_the_delay():
    sched = scheduler(batching="dynamic", max_batch_size=3, max_delay_ms=0.0)
    sched.add(make("a", 3))
    assert sched.schedule(draining=False).num_tokens == [3]


def test_preemption_when_blocks_run_out_loses_nothing():
    # 6 blocks of 4 tokens; four requests of 5 + 8 tokens cannot all be resident.
    sched = scheduler(num_blocks=6)
    requests = [make(i, 5, max_new=8) for i in range(4)]
    simulate(sched, requests)
    assert sched.num_preemptions > 0
    assert all(r.output_token_ids == [7] * 8 and r.finish_reason == "length" for r in requests)


def test_prefix_cache_is_shared_at_admission_and_kept_after_free():
    sched = scheduler(prefix=True)
    first = Request("first", list(range(10, 23)), StoppingParams(max_new_tokens=1))
    simulate(sched, [first])
    assert sched.block_manager.num_cached_blocks == 3  # 13 prompt tokens: 3 full blocks of 4
    second = Request("second", list(range(10, 22)) + [99, 98], StoppingParams(max_new_tokens=1))
    sched.add(second)
    step = sched.schedule()
    assert second.num_cached_prompt_tokens == 12
    assert step.num_tokens == [2]
    assert sched.block_manager.stats.hit_tokens == 12
    # A prompt that is all cached still computes its last token.
    third = Request("third", list(range(10, 22)), StoppingParams(max_new_tokens=1))
    sched.add(third)
    step = sched.schedule()
    assert third.num_cached_prompt_tokens == 8 and dict(zip(step.requests, step.num_tokens))[third] == 4


def test_copies_after_a_cached_instruction_wait_a_step_and_share_their_own_blocks():
    """GRPO's shape: prompts behind a cached instruction, each repeated. The first copy of each prompt
    computes its own blocks; the others wait one step and share them (they computed the same blocks
    side by side before: only a copy whose first block was being computed waited), and another prompt's
    first copy is not held back behind them (before, it waited a step too)."""
    sched = scheduler(prefix=True, max_num_batched_tokens=64)
    instruction = list(range(10, 18))  # two full blocks of 4
    simulate(sched, [Request("warm", instruction + [1], StoppingParams(max_new_tokens=1))])
    prompts = {
        name: instruction + suffix
        for name, suffix in (("p", [20, 21, 22, 23, 24]), ("q", [30, 31, 32, 33, 34]))
    }
    copies = [
        Request(f"{name}{i}", tokens, StoppingParams(max_new_tokens=2))
        for name, tokens in prompts.items()
        for i in range(3)
    ]
    for request in copies:
        sched.add(request)
    hits = sched.block_manager.stats.hit_tokens
    first = run_step(sched)
    assert [r.request_id for r in first.requests] == ["p0", "q0"]  # each computes its third block once
    assert sched.block_manager.stats.hit_tokens - hits == 2 * 8
    second = run_step(sched)
    assert {r.request_id for r in second.requests} == {"p0", "q0", "p1", "p2", "q1", "q2"}
    assert all(r.num_cached_prompt_tokens == 12 for r in copies if r.request_id[1] != "0")
    assert sched.block_manager.stats.hit_tokens - hits == 2 * 8 + 4 * 12
    while sched.has_unfinished():
        run_step(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_waiting_copy_keeps_its_seat_for_the_next_step():
    """Found by a review: the seat a waiting copy left was taken by a later request, and the copy then
    waited for a whole generation (a priority-0 copy behind a priority-5 request, FCFS broken)."""
    sched = scheduler(prefix=True, max_num_seqs=2)
    a0, a1 = (Request(f"a{i}", list(range(10, 22)), StoppingParams(max_new_tokens=30)) for i in range(2))
    later = Request("later", list(range(40, 52)), StoppingParams(max_new_tokens=30))
    for request in (a0, a1, later):
        sched.add(request)
    assert [r.request_id for r in run_step(sched).requests] == ["a0"]
    assert [r.request_id for r in run_step(sched).requests] == ["a0", "a1"]
    assert a1.num_cached_prompt_tokens == 8 and later in sched.waiting


def test_a_prompt_chunked_over_steps_is_shared_by_a_request_admitted_meanwhile():
    """Found by a review: a request admitted while another still computed their common prefix chunk by
    chunk took what was cached so far, then computed the rest beside it."""
    sched = scheduler(prefix=True, long_prefill_token_threshold=8)
    shared = list(range(10, 34))  # 6 full blocks, computed 8 tokens a step
    first = Request("first", shared + [1, 2], StoppingParams(max_new_tokens=2))
    second = Request("second", shared + [3, 4], StoppingParams(max_new_tokens=2))
    sched.add(first)
    run_step(sched)
    manager = sched.block_manager  # what its next chunk computes: blocks 2 and 3, chained from its own
    assert manager.chunk_keys(first, 8) == manager.prefix_keys(first)[2:4]
    sched.add(second)
    simulate(sched, [])
    assert second.num_cached_prompt_tokens == 24


def test_request_larger_than_the_cache_is_refused_with_the_need():
    sched = scheduler(num_blocks=2)
    with pytest.raises(
        ValueError, match=r"holds 2 blocks of 4 tokens, but request 'big' needs 3 blocks \(12 tokens\)"
    ):
        sched.add(make("big", 8, max_new=4))
    assert not sched.has_unfinished()


def test_abort_frees_blocks_at_once():
    sched = scheduler(num_blocks=8)
    a, b = make("a", 6), make("b", 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.block_manager.num_used_blocks == 3
    sched.abort(a)
    assert a.finish_reason == "abort" and a.block_ids == []
    assert sched.block_manager.num_used_blocks == 1
    sched.abort(b)
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()


@settings(max_examples=150, deadline=None)
@given(
    workload=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 20), st.integers(1, 24)), min_size=1, max_size=14
    ),
    num_blocks=st.integers(6, 14),
    max_num_seqs=st.integers(1, 5),
    prefix=st.booleans(),
    policy=st.sampled_from(["mixed", "prefill_first", "decode_first"]),
)
def test_no_starvation_every_request_finishes_preempted_at_most_once(
    workload, num_blocks, max_num_seqs, prefix, policy
):
    # Short chunks, grouping by length and a small cache once made one request lose its blocks 181 times.
    sched = scheduler(
        num_blocks=num_blocks,
        prefix=prefix,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=5,
        group_by_length=True,
        scheduling_policy=policy,
    )
    arrivals = []
    for i, (arrival, prompt_len, max_new) in enumerate(workload):
        max_new = min(max_new, num_blocks * 4 - prompt_len)  # fits the cache alone
        arrivals.append((arrival, make(i, prompt_len, max_new=max_new, token=3 + i % 2)))
    arrivals.sort(key=lambda pair: pair[0])
    pending = list(arrivals)
    for t in range(2000):
        while pending and pending[0][0] <= t:
            sched.add(pending.pop(0)[1])
        if not pending and not sched.has_unfinished():
            break
        run_step(sched)
    requests = [r for _, r in arrivals]
    assert all(r.is_finished and r.finish_reason == "length" for r in requests), "a request starved"
    assert all(r.output_token_ids == [7] * r.stopping.max_new_tokens for r in requests)
    assert max(r.num_preemptions for r in requests) <= 1
    assert sched.block_manager.num_free_blocks == num_blocks
