"""The request-level (online) API: add at any time, step, stream, cancel, metrics."""

import time

from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import EOS, hf_greedy, tiny_model, varied_prompts

MODEL = tiny_model("llama")
STOP = StoppingParams(max_new_tokens=10, eos_token_ids=frozenset({EOS}))


def engine():
    return Engine(MODEL, EngineConfig(block_size=8, kv_cache_memory=2_000_000))


def test_requests_join_a_running_batch_and_stream_their_tokens():
    e = engine()
    prompts = varied_prompts(4, seed=2)
    first = e.add_request(prompts[0], STOP)
    e.step()
    e.step()
    late = e.add_request(prompts[1], STOP, arrival_time=time.perf_counter())
    streamed_late = list(e.stream(late))
    streamed_first = list(e.stream(first))
    assert streamed_late == late.output_token_ids == hf_greedy(MODEL, prompts[1], 10)
    assert streamed_first == first.output_token_ids == hf_greedy(MODEL, prompts[0], 10)
    assert late.metrics.first_scheduled_time >= late.metrics.arrival_time
    assert e.block_manager.num_free_blocks == e.num_blocks


def test_cancel_mid_stream_frees_blocks_at_once_and_others_continue():
    e = engine()
    prompts = varied_prompts(4, seed=4)
    doomed, kept = (e.add_request(p, StoppingParams(max_new_tokens=30)) for p in prompts[2:4])
    stream = e.stream(doomed)
    next(stream)
    assert doomed.block_ids
    used = e.block_manager.num_used_blocks
    e.abort(doomed)
    assert doomed.finish_reason == "abort" and doomed.block_ids == []
    assert e.block_manager.num_used_blocks < used
    assert list(stream) == doomed.output_token_ids[1:]  # the stream ends at the cancellation
    assert list(e.stream(kept)) == hf_greedy(MODEL, prompts[3], 30, eos_token_id=None)
    assert e.block_manager.num_free_blocks == e.num_blocks


def test_metrics_are_plain_data():
    e = engine()
    requests = [e.add_request(p, StoppingParams(max_new_tokens=6)) for p in varied_prompts(3)]
    while e.has_unfinished_requests():
        e.step()
    for r in requests:
        m = r.metrics.as_dict()
        assert set(m) == {"queue_s", "ttft_s", "tpot_s", "itl_max_s", "e2e_s"}
        assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["e2e_s"]
        assert len(r.metrics.itl_s) == 5 and m["tpot_s"] > 0
    first = e.step_stats[0].as_dict()
    # One-token prompts run in the one-token (decode-shaped) part of the step.
    assert first["num_seqs"] == 3
    assert first["num_prefill_tokens"] == sum(len(p) for p in varied_prompts(3) if len(p) > 1)
    assert first["num_decode_tokens"] == sum(1 for p in varied_prompts(3) if len(p) == 1)
    assert sum(s.num_decode_tokens for s in e.step_stats) >= 5 * 3
    stats = e.stats()
    assert stats["steps"] == len(e.step_stats) and stats["generated_tokens"] == 18


def test_stream_under_static_batching_runs_a_partial_batch():
    e = Engine(
        MODEL, EngineConfig(block_size=8, kv_cache_memory=2_000_000, batching="static", max_batch_size=4)
    )
    prompt = varied_prompts(3)[2]
    request = e.add_request(prompt, STOP)
    assert list(e.stream(request)) == hf_greedy(MODEL, prompt, 10)
