import pytest

from hfaccel.engine.block_manager import BlockManager
from hfaccel.engine.request import Request, StoppingParams
from hfaccel.engine.scheduler import Scheduler


def make(rid, prompt_len, max_new=4):
    return Request(rid, [5] * prompt_len, StoppingParams(max_new_tokens=max_new))


def simulate(scheduler, requests, max_steps=500):
    """Drive the scheduler as the engine would, sampling token 7; check invariants at every step."""
    for r in requests:
        scheduler.add(r)
    steps = []
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        assert step.requests, "no progress"
        assert step.total_tokens <= scheduler.max_num_batched_tokens
        assert len(step) <= scheduler.max_num_seqs
        assert all(n >= 1 for n in step.num_tokens)
        sampled = [
            r for r, n in zip(step.requests, step.num_tokens) if r.num_computed_tokens + n == r.num_tokens
        ]
        scheduler.update(step, sampled, [7] * len(sampled))
        steps.append(step)
        assert len(steps) < max_steps
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    return steps


def test_decodes_and_new_prefills_share_a_step():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    a = make("a", 3, max_new=5)
    scheduler.add(a)
    first = scheduler.schedule()
    scheduler.update(first, [a], [7])
    scheduler.add(make("b", 6))
    step = scheduler.schedule()
    assert [r.request_id for r in step.requests] == ["a", "b"]
    assert step.num_tokens == [1, 6]


def test_long_prompt_is_chunked_under_the_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8, max_model_len=256)
    long = make("long", 20, max_new=2)
    steps = simulate(scheduler, [long])
    assert [s.num_tokens for s in steps[:3]] == [[8], [8], [4]]
    assert long.output_token_ids == [7, 7] and long.finish_reason == "length"


def test_max_num_seqs_caps_the_running_batch():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
    steps = simulate(scheduler, [make(i, 3) for i in range(5)])
    assert max(len(s) for s in steps) == 2


def test_preemption_when_blocks_run_out_loses_nothing():
    # 6 blocks of 4 tokens; four requests of 5 + 8 tokens cannot all be resident.
    scheduler = Scheduler(BlockManager(6, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    requests = [make(i, 5, max_new=8) for i in range(4)]
    simulate(scheduler, requests)
    assert scheduler.num_preemptions > 0
    assert all(r.output_token_ids == [7] * 8 and r.finish_reason == "length" for r in requests)


def test_request_larger_than_the_cache_is_refused_with_the_need():
    scheduler = Scheduler(BlockManager(2, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    with pytest.raises(
        ValueError, match=r"holds 2 blocks of 4 tokens, but request 'big' needs 3 blocks \(12 tokens\)"
    ):
        scheduler.add(make("big", 8, max_new=4))
    assert not scheduler.has_unfinished()


def test_abort_frees_blocks_at_once():
    scheduler = Scheduler(BlockManager(8, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    a, b = make("a", 6), make("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    assert scheduler.block_manager.num_used_blocks == 3
    scheduler.abort(a)
    assert a.finish_reason == "abort" and a.block_ids == []
    assert scheduler.block_manager.num_used_blocks == 1
    scheduler.abort(b)
    assert scheduler.block_manager.num_free_blocks == 8 and not scheduler.has_unfinished()
