"""Greedy outputs do not depend on how the scheduler slices and orders the work."""

import pytest

from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import EOS, assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts

MODEL = tiny_model("llama")
PROMPTS = varied_prompts(16, seed=11)
MAX_NEW = 14
REFERENCE = [hf_greedy(MODEL, p, MAX_NEW) for p in PROMPTS]
ROOMY = 4_000_000
TIGHT = 14 * 2 * 2 * 2 * 16 * 4 * 8  # 14 blocks of 8 tokens: preemption guaranteed


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"chunked_prefill": False},
        {"enable_prefix_caching": False},
        {"long_prefill_token_threshold": 5},
        {"max_num_batched_tokens": 8},
        {"scheduling_policy": "prefill_first"},
        {"scheduling_policy": "decode_first"},
        {"batching": "dynamic", "max_batch_size": 5},
        {"batching": "static", "max_batch_size": 4},
        {"group_by_length": True},
        {"kv_cache_memory": TIGHT},
        {"kv_cache_memory": TIGHT, "enable_prefix_caching": False, "max_num_batched_tokens": 16},
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults",
)
def test_outputs_match_hf_under_every_setting(settings):
    config = {"block_size": 8, "max_num_batched_tokens": 128, "kv_cache_memory": ROOMY, **settings}
    engine = Engine(MODEL, EngineConfig(**config))
    stop = StoppingParams(max_new_tokens=MAX_NEW, eos_token_ids=frozenset({EOS}))
    requests = [engine.make_request(p, stop) for p in PROMPTS]
    engine.run(requests)
    for prompt, request, ref in zip(PROMPTS, requests, REFERENCE):
        assert_same_or_near_tie(MODEL, prompt, request.output_token_ids, ref)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    if config["kv_cache_memory"] == TIGHT:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_on_shared_prompts_and_outputs_stay_equal():
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=ROOMY))
    stop = StoppingParams(max_new_tokens=6)
    system = varied_prompts(8)[4][:36]
    prompts = [system + [100 + i, 101 + i] for i in range(6)]
    first = engine.make_request(prompts[0], stop)
    engine.run([first])
    rest = [engine.make_request(p, stop) for p in prompts[1:]]
    engine.run(rest)
    assert all(r.num_cached_prompt_tokens == 36 for r in rest)
    assert engine.stats()["prefix_cache_hit_tokens"] == 5 * 36
    for prompt, request in zip(prompts, [first, *rest]):
        assert_same_or_near_tie(MODEL, prompt, request.output_token_ids, hf_greedy(MODEL, prompt, 6))
