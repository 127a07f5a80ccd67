"""Per-request random streams: a seeded request samples the same tokens whatever runs beside it, whether
its prefix came from the cache, and whether it was preempted."""

import pytest
import torch

import hfaccel
from tests.helpers import VOCAB, tiny_model, varied_prompts

SAMPLING = {"do_sample": True, "temperature": 1.3, "top_k": 0, "max_new_tokens": 12, "min_new_tokens": 12}


def sample(model, prompts, seed, **config):
    hfaccel.patch(model, **config)
    try:
        completions = hfaccel.generate(model, prompts, seed=seed, progress=False, **SAMPLING)
        return [c.token_ids for c in completions], model._hfaccel.engine.stats()
    finally:
        hfaccel.unpatch(model)


def test_a_seeded_request_samples_the_same_alone_in_a_batch_cached_and_preempted():
    model = tiny_model("llama")
    prompt = varied_prompts(8, seed=5)[4]  # 40+ tokens: two full blocks to cache
    alone, _ = sample(model, [prompt], seed=123)
    others = [
        torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in range(5, 36)
    ]
    in_batch, _ = sample(model, [prompt] + others, seed=123)
    assert in_batch[0] == alone[0]

    hfaccel.patch(model)
    first = hfaccel.generate(model, [prompt], seed=123, progress=False, **SAMPLING)
    second = hfaccel.generate(model, [prompt], seed=123, progress=False, **SAMPLING)
    assert model._hfaccel.engine.stats()["prefix_cache_hit_tokens"] >= 32  # the second one hit the cache
    hfaccel.unpatch(model)
    assert first[0].token_ids == second[0].token_ids == alone[0]

    tight = {
        "kv_cache_memory": 2 * 2 * 2 * 16 * 4 * 4 * 24,
        "block_size": 4,
        "max_num_batched_tokens": 32,
        "max_model_len": 96,  # what 24 blocks of 4 hold: patch refuses a cache too small for one full request
    }
    preempted, stats = sample(model, [prompt] + others[:7], seed=123, **tight)
    assert stats["preemptions"] > 0
    assert preempted[0] == alone[0]


def test_different_seeds_give_different_samples_and_seed_plus_index_per_request():
    model = tiny_model("llama")
    prompt = varied_prompts(4, seed=1)[2]
    a, _ = sample(model, [prompt, prompt], seed=7)
    b, _ = sample(model, [prompt], seed=8)
    assert a[0] != a[1]  # each request has its own stream (seed + i)
    assert a[1] == b[0]


def test_torch_manual_seed_reproduces_model_generate_with_a_warm_cache():
    model = hfaccel.patch(tiny_model("llama"))
    ids = torch.tensor([varied_prompts(4, seed=2)[2]])
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(model.generate(ids, do_sample=True, max_new_tokens=10, min_new_tokens=10)[0].tolist())
    assert model._hfaccel.engine.stats()["prefix_cache_hit_tokens"] > 0
    assert runs[0] == runs[1]


def test_one_seed_per_prompt_samples_each_prompt_as_it_does_alone():
    """`seed=[s0, s1]`: prompt p's r-th request draws from seed[p] + r (a server's batch of prompts, each
    sampling as that prompt alone)."""
    model = tiny_model("llama")
    prompts = varied_prompts(4, seed=3)[:2]
    hfaccel.patch(model)
    try:
        both = hfaccel.generate(
            model, prompts, seed=[11, 11], num_return_sequences=2, progress=False, **SAMPLING
        )
        alone = [
            hfaccel.generate(model, [p], seed=11, num_return_sequences=2, progress=False, **SAMPLING)
            for p in prompts
        ]
        assert [c.token_ids for c in both] == [c.token_ids for group in alone for c in group]
        with pytest.raises(ValueError, match=r"seed: a list of 1 seeds for 2 prompts"):
            hfaccel.generate(model, prompts, seed=[1], progress=False, **SAMPLING)
        with pytest.raises(ValueError, match=r"seed\[1\] must be an int"):
            hfaccel.generate(model, prompts, seed=[1, -1], progress=False, **SAMPLING)
    finally:
        hfaccel.unpatch(model)
