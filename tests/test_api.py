"""The public API: patch / unpatch / generate."""

import pytest
import torch
from transformers import GenerationConfig

import hfaccel
from hfaccel.config import EngineConfig
from tests.helpers import EOS, assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts


def test_public_names():
    assert sorted(hfaccel.__all__) == ["Completion", "EngineConfig", "generate", "patch", "unpatch"]


def test_patch_is_idempotent_and_unpatch_restores_exactly():
    model = tiny_model()
    original_attn = model.config._attn_implementation
    assert "generate" not in model.__dict__
    assert hfaccel.patch(model) is model
    bound = model.generate
    assert hfaccel.patch(model) is model and model.generate is bound
    hfaccel.patch(model, block_size=32)
    assert model._hfaccel.config.block_size == 32
    hfaccel.unpatch(model)
    assert "generate" not in model.__dict__ and not hasattr(model, "_hfaccel")
    assert model.generate.__func__ is type(model).generate
    assert model.config._attn_implementation == original_attn
    hfaccel.unpatch(model)  # a second unpatch is a no-op


def test_patch_rejects_bad_config_and_non_models():
    model = tiny_model()
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        hfaccel.patch(model, block_size=0)
    assert not hasattr(model, "_hfaccel")
    with pytest.raises(ValueError, match="expects a transformers causal-LM model"):
        hfaccel.patch(torch.nn.Linear(2, 2))


def test_generate_in_prompt_order_with_per_prompt_configs():
    model = tiny_model()
    prompts = varied_prompts(16)
    lengths = [1 + (i * 7) % 13 for i in range(16)]
    configs = [GenerationConfig(max_new_tokens=n, do_sample=False) for n in lengths]
    completions = hfaccel.generate(model, prompts, generation_config=configs, progress=False)
    assert not hasattr(model, "_hfaccel"), "an unpatched model is restored after the call"
    for prompt, n, c in zip(prompts, lengths, completions):
        ref = hf_greedy(model, prompt, n)
        assert c.prompt_token_ids == prompt
        assert_same_or_near_tie(model, prompt, c.token_ids, ref)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
        assert c.text is None
        assert c.metrics["ttft_s"] > 0 and c.metrics["e2e_s"] >= c.metrics["ttft_s"]


def test_generate_on_a_patched_model_keeps_it_patched_and_its_config():
    model = hfaccel.patch(tiny_model(), EngineConfig(block_size=4, kv_cache_memory=1_000_000))
    out = hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=3, progress=False)
    assert len(out[0].token_ids) <= 3 and model._hfaccel.engine.config.block_size == 4


def test_bad_input():
    model = tiny_model()
    assert hfaccel.generate(model, []) == []
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        hfaccel.generate(model, [[5, 6], []], progress=False)
    with pytest.raises(ValueError, match=r"prompts\[0\] is a string: pass tokenizer="):
        hfaccel.generate(model, ["hello"], progress=False)
    with pytest.raises(ValueError, match="prompts must be a list"):
        hfaccel.generate(model, "hello", progress=False)
    with pytest.raises(ValueError, match="generation_config has 1 entries for 2 prompts"):
        hfaccel.generate(model, [[5], [6]], generation_config=[GenerationConfig()], progress=False)
    with pytest.raises(ValueError, match="max_model_len"):
        hfaccel.generate(model, [[5, 6], [5] * 600], max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hfaccel.generate(model, [[5, 6]], max_new_tokens=-1, progress=False)
    assert not hasattr(model, "_hfaccel")
    ok = hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=4, progress=False)[0]
    assert ok.token_ids == hf_greedy(model, [5, 6, 7], 4)


def test_sampling_falls_back_to_hf_with_a_warning():
    model = tiny_model()
    with pytest.warns(UserWarning, match=r"sampling \(do_sample=True\)"):
        out = hfaccel.generate(model, [[5, 6, 7]], do_sample=True, max_new_tokens=4, progress=False)
    assert len(out[0].token_ids) <= 4
