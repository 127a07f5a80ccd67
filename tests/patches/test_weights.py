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
