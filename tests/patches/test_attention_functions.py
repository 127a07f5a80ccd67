"""Which attention functions the engine's paged attention stands in for: transformers' own and the kernels
hub's, not one registered by someone else, which would be replaced silently (found by a probe: a
temperature-scaled attention gave plain attention's tokens, also under ``strict=True``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hfaccel
from hfaccel.patches import attention
from tests.helpers import hf, tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [9, 8, 7, 6, 5, 4, 3]])
ASK = {"attention_mask": torch.ones_like(IDS), "max_new_tokens": 12, "do_sample": False}


def hot(module, query, key, value, mask, scaling=None, **kwargs):
    """Attention at four times the temperature: not what standard attention computes."""
    scaling = (scaling or query.shape[-1] ** -0.5) * 4.0
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)


@pytest.fixture
def registered():
    """`hot` registered as "hot" (and nothing left registered afterwards)."""
    AttentionInterface.register("hot", hot)
    yield "hot"
    AttentionInterface._global_mapping.pop("hot", None)


def test_patch_refuses_a_model_on_an_attention_function_registered_outside_transformers(registered):
    model = tiny_model("llama")
    model.set_attn_implementation(registered)
    with pytest.raises(ValueError, match=r"attention implementation 'hot' is a function registered outside"):
        hfaccel.patch(model)
    assert not hasattr(model, "_hfaccel")


def test_one_set_after_patch_falls_back_with_its_tokens_and_strict_raises(registered):
    model = tiny_model("llama")
    hfaccel.patch(model, kv_cache_memory=2_000_000)
    try:
        plain = model.generate(IDS, **ASK)
        model.set_attn_implementation(registered)
        expected = hf(model, input_ids=IDS, **ASK)
        assert not torch.equal(expected, plain)  # the function matters for these tokens
        with pytest.warns(UserWarning, match="registered outside transformers"):
            assert torch.equal(model.generate(IDS, **ASK), expected)
        hfaccel.unpatch(model)
        model.set_attn_implementation("sdpa")
        hfaccel.patch(model, kv_cache_memory=2_000_000, strict=True)
        model.set_attn_implementation(registered)
        with pytest.raises(ValueError, match="registered outside transformers"):
            model.generate(IDS, **ASK)
        model.set_attn_implementation("eager")  # transformers' own again: served
        assert torch.equal(model.generate(IDS, **ASK), plain)
    finally:
        hfaccel.unpatch(model)


def test_a_transformers_name_registered_again_is_someone_elses_function():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    assert attention.implementation_reason(model) is None
    ALL_ATTENTION_FUNCTIONS["sdpa"] = hot  # the mapping the model files read, this one name
    try:
        reason = attention.implementation_reason(model)
        assert "'sdpa' is a function registered outside transformers" in reason
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert attention.implementation_reason(model) is None


def test_transformers_and_hub_kernels_are_standard_attention(registered):
    model = tiny_model("llama")
    for name in ("eager", "sdpa", "flex_attention", "paged|sdpa"):
        model.config._attn_implementation_internal = name
        assert attention.implementation_reason(model) is None, name
    AttentionInterface.register("kernels-community/flash-attn", hot)  # a hub kernel: flash attention
    try:
        model.config._attn_implementation_internal = "kernels-community/flash-attn"
        assert attention.implementation_reason(model) is None
    finally:
        AttentionInterface._global_mapping.pop("kernels-community/flash-attn", None)
