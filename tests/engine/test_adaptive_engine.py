"""Adaptive scheduling through the engine and the API: greedy outputs unchanged under every policy,
automatic batch limits, admission control seen by `hfaccel.generate`, asynchronous scheduling."""

import pytest

import hfaccel
from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.engine.test_adaptive_scheduler import FakeCostModel
from tests.helpers import EOS, assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts

MODEL = tiny_model("llama")
PROMPTS = varied_prompts(16, seed=5)
MAX_NEW = 12
REFERENCE = [hf_greedy(MODEL, p, MAX_NEW) for p in PROMPTS]


def with_fake_model(engine, *coefficients):
    fake = FakeCostModel(*coefficients)
    engine.scheduler.cost_model = fake  # the engine still records its steps in its own model
    return fake


@pytest.mark.parametrize(
    "settings",
    [
        {"tpot_target_ms": 25},  # 10 ms + 1 ms per decode: at most 12 sequences, chunks of ~100 tokens
        {"tpot_target_ms": 12},  # a single decode fits, a handful of prompt tokens per step
        {"tpot_target_ms": 30, "ttft_target_ms": 1e7, "prefix_aware_admission": True, "max_passed_over": 2},
        {"prefix_aware_admission": True},
        {"tpot_target_ms": 25, "async_scheduling": True},
        {"async_scheduling": True, "prefix_aware_admission": True},
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()),
)
def test_greedy_outputs_are_unchanged_under_every_policy(settings):
    engine = Engine(MODEL, EngineConfig(block_size=8, kv_cache_memory=4_000_000, **settings))
    with_fake_model(engine)
    stop = StoppingParams(max_new_tokens=MAX_NEW, eos_token_ids=frozenset({EOS}))
    requests = [engine.make_request(p, stop, priority=i % 3) for i, p in enumerate(PROMPTS)]
    engine.run(requests)
    for prompt, request, ref in zip(PROMPTS, requests, REFERENCE):
        assert_same_or_near_tie(MODEL, prompt, request.output_token_ids, ref)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    if settings.get("async_scheduling"):
        assert engine._async is not None and all(s.overlapped_s > 0 for s in engine.step_stats)


def test_prefix_aware_admission_keeps_no_keys_of_finished_requests():
    """A running prefill's prefix keys (read at every admission) go when the request finishes: a long
    session of chunked prompts kept every request, and everything it held, alive (a probe found it)."""
    engine = Engine(
        MODEL,
        EngineConfig(
            block_size=8, kv_cache_memory=4_000_000, prefix_aware_admission=True, max_num_batched_tokens=32
        ),
    )
    stop = StoppingParams(max_new_tokens=2)
    prompts = [p * 3 for p in PROMPTS[:6]]  # several chunks each, admitted while others prefill
    for _ in range(3):
        engine.run([engine.make_request(p, stop) for p in prompts])
    assert engine.scheduler.admission_order._prefix_keys == {}
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_a_tight_target_slices_the_work_without_changing_it():
    engine = Engine(MODEL, EngineConfig(block_size=8, kv_cache_memory=4_000_000, tpot_target_ms=12))
    with_fake_model(engine)
    stop = StoppingParams(max_new_tokens=MAX_NEW)
    engine.run([engine.make_request(p, stop) for p in PROMPTS])
    steps = list(engine.step_stats)
    decoding = [s for s in steps if s.num_decode_tokens]
    # 10.2 ms (0.85 x 12): 10 ms + 1 ms a decode leaves no room for a second decode.
    assert max(s.num_decode_tokens for s in decoding) <= 1


def test_auto_limits_are_resolved_at_build_and_explicit_ones_kept_exactly():
    engine = Engine(MODEL, EngineConfig(kv_cache_memory=4_000_000))
    assert engine.limits.auto == ("max_num_seqs", "max_num_batched_tokens")
    assert isinstance(engine.config.max_num_seqs, int) and engine.config.max_num_batched_tokens == 2048
    assert "max_num_seqs=" in repr(engine) and "(auto)" in repr(engine)
    # 4 MB of KV at 512 bytes a token (K and V x 2 layers x 2 heads x 16 x 4 bytes): 7812 tokens, 15
    # sequences of 512.
    assert engine.config.max_num_seqs == 15
    exact = Engine(MODEL, EngineConfig(kv_cache_memory=4_000_000, max_num_seqs=3, max_num_batched_tokens=40))
    assert (exact.config.max_num_seqs, exact.config.max_num_batched_tokens, exact.limits.auto) == (3, 40, ())
    assert "(auto)" not in repr(exact)
    roomy = Engine(MODEL, EngineConfig(kv_cache_memory=400_000_000))
    assert roomy.config.max_num_seqs == 64  # the CPU cap
    batch = Engine(MODEL, EngineConfig(kv_cache_memory=4_000_000, batching="static", max_batch_size=20))
    assert batch.config.max_num_seqs == 20  # at least what the batch size needs


def test_generate_reports_rejected_requests_and_serves_the_rest():
    model = hfaccel.patch(
        tiny_model(), kv_cache_memory=4_000_000, admission="reject", max_num_batched_tokens=64
    )
    engine = model._hfaccel.get_engine(model)
    with_fake_model(engine, 0.050, 0.001, 0.001)  # 50 ms a step, 1 ms a prompt token
    prompts = [[5 + i] * 60 for i in range(4)]
    completions = hfaccel.generate(model, prompts, max_new_tokens=3, ttft_target_ms=200, progress=False)
    reasons = [c.finish_reason for c in completions]
    assert reasons[0] == "length" and "rejected" in reasons
    rejected = [c for c in completions if c.finish_reason == "rejected"]
    assert all("TTFT target 200 ms cannot be met" in c.error and c.token_ids == [] for c in rejected)
    assert engine.stats()["rejected"] == len(rejected)
    # A stream closes every request, a rejected one with an event of its own (no token, its reason).
    events = list(hfaccel.stream(model, prompts, max_new_tokens=3, ttft_target_ms=200))
    closing = {e.index: e for e in events if e.finished}
    assert sorted(closing) == [0, 1, 2, 3], "every request's stream ends"
    assert "rejected" in {e.finish_reason for e in closing.values()}
    for index, event in closing.items():
        tokens = [e.token_id for e in events if e.index == index]
        if event.finish_reason == "rejected":
            assert tokens == [None] and event.text is None
        else:
            assert len(tokens) == 3 and None not in tokens
    # Without a target nothing is refused, and a warned request still completes.
    assert all(
        c.finish_reason == "length"
        for c in hfaccel.generate(model, prompts, max_new_tokens=3, progress=False)
    )
    hfaccel.patch(model, admission="warn")
    engine = model._hfaccel.get_engine(model)
    with_fake_model(engine, 0.050, 0.001, 0.001)
    completions = hfaccel.generate(model, prompts, max_new_tokens=3, ttft_target_ms=200, progress=False)
    assert all(c.finish_reason == "length" for c in completions)
    assert any("cannot be met" in w for c in completions for w in c.metrics.get("warnings", []))
    hfaccel.unpatch(model)


def test_invalid_targets_are_refused_with_the_field_named():
    engine = Engine(MODEL, EngineConfig(kv_cache_memory=4_000_000))
    with pytest.raises(ValueError, match="tpot_target_ms must be a positive number"):
        engine.make_request([5, 6], StoppingParams(max_new_tokens=2), tpot_target_ms=0)
    for value in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="ttft_target_ms must be a positive number"):
            engine.make_request([5, 6], StoppingParams(max_new_tokens=2), ttft_target_ms=value)
        with pytest.raises(ValueError, match="tpot_target_ms must be a positive number"):
            EngineConfig(tpot_target_ms=value)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.make_request([5, 6], StoppingParams(max_new_tokens=2), priority=1.5)
    with pytest.raises(ValueError, match="admission must be one of"):
        EngineConfig(admission="drop")
