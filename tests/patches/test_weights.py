"""``patch(model, weights=...)``: the weights' dtype in one line, the fast one on this device for
"auto", and clear errors for what is not offered."""

from __future__ import annotations

import pytest
import torch

import hfaccel
from hfaccel.kernels import cpu_features
from hfaccel.patches import weights as weights_module
from tests.helpers import assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts


def test_no_weights_leaves_the_model_as_it_is():
    model = hfaccel.patch(tiny_model(), weights=None)
    try:
        assert next(model.parameters()).dtype == torch.float32
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_takes_the_dtype_this_cpu_computes_fastest(monkeypatch, native_bf16):
    flags = frozenset({"avx512_bf16"} if native_bf16 else {"avx2"})
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    model = hfaccel.patch(tiny_model(), weights="auto")
    try:
        assert next(model.parameters()).dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    finally:
        hfaccel.unpatch(model)


def test_a_cast_model_gives_transformers_tokens_for_the_cast_model():
    model = hfaccel.patch(tiny_model(), weights="bfloat16")
    prompts = varied_prompts(4, seed=6)
    try:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        completions = hfaccel.generate(model, prompts, max_new_tokens=6, progress=False)
    finally:
        hfaccel.unpatch(model)
    assert next(model.parameters()).dtype == torch.bfloat16  # the cast stays, as quantize_'s does
    # bfloat16 logits are rounded to 8 bits of mantissa, and the kernels accumulate in float32 where
    # transformers' bf16 sdpa does not: a first difference must be a near-tie at bf16's resolution.
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 6), eps=0.0625)


def test_what_is_not_offered_raises_saying_why():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"weights='fp8' is not one of 'auto', 'bfloat16'"):
        hfaccel.patch(model, weights="fp8")
    assert not hasattr(model, "_hfaccel")
    quantization = pytest.importorskip("torchao.quantization")
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match=r"holds quantized weights \(Int8Tensor"):
        weights_module.apply_weights(model, "bfloat16")


def test_a_patch_refused_by_its_kv_or_context_checks_leaves_the_weights_as_they_were():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_model_len"):
        hfaccel.patch(model, weights="bfloat16", max_model_len=10**7)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        hfaccel.patch(model, weights="bfloat16", kv_cache_memory=1000)
    assert not hasattr(model, "_hfaccel")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_kv_check_reads_the_dtype_the_weights_will_have():
    model = tiny_model().to(torch.bfloat16)
    # A cache that holds one request's KV in bfloat16 but not in float32.
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads
    per_token *= model.config.hidden_size // model.config.num_attention_heads
    context = model.config.max_position_embeddings
    memory = per_token * 2 * (context + 64)
    hfaccel.patch(model, kv_cache_memory=memory)  # bfloat16: it fits
    try:
        with pytest.raises(ValueError, match="kv_cache_memory"):
            hfaccel.patch(model, weights="float32")  # a float32 cache would not: refused, nothing cast
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        with pytest.raises(ValueError, match="weights='fp8'"):
            hfaccel.patch(model, max_num_seqs=3, weights="fp8")  # refused before the config changes
        assert model._hfaccel.config.max_num_seqs != 3
    finally:
        hfaccel.unpatch(model)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        hfaccel.patch(model, weights="float32", kv_cache_memory=memory)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
