"""Which attention functions the engine's paged attention stands in for (`attention.implementation_reason`):
transformers' standard ones and a hub flash kernel, not one registered by someone else, which would be
replaced silently (found by a probe: a temperature-scaled attention gave plain attention's tokens, also
under ``strict=True``; then by a review: under "eager", in a modeling file's own mapping, under an
"org/repo" name)."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

import hfaccel
from hfaccel.patches.attention import implementation_reason
from tests.helpers import hf, tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [9, 8, 7, 6, 5, 4, 3]])
ASK = {"attention_mask": torch.ones_like(IDS), "max_new_tokens": 12, "do_sample": False}
NOT_STANDARD = "not one of transformers' standard attention functions"


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
    with pytest.raises(
        ValueError, match=r"attention implementation 'hot' is hot in .*test_attention_functions"
    ):
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
        with pytest.warns(UserWarning, match=NOT_STANDARD):
            assert torch.equal(model.generate(IDS, **ASK), expected)
        hfaccel.unpatch(model)
        model.set_attn_implementation("sdpa")
        hfaccel.patch(model, kv_cache_memory=2_000_000, strict=True)
        model.set_attn_implementation(registered)
        with pytest.raises(ValueError, match=NOT_STANDARD):
            model.generate(IDS, **ASK)
        model.set_attn_implementation("eager")  # transformers' own again: served
        assert torch.equal(model.generate(IDS, **ASK), plain)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("name", ["sdpa", "eager"])  # a model file looks "eager" up before its own
def test_a_transformers_name_registered_again_is_someone_elses_function(name):
    model = tiny_model("llama")
    model.set_attn_implementation(name)
    assert implementation_reason(model) is None
    ALL_ATTENTION_FUNCTIONS[name] = hot  # the mapping the model files read, this one name
    try:
        assert f"'{name}' is hot in" in implementation_reason(model)
        if name == "eager":  # HF runs it: patch must not serve plain attention for it
            with pytest.raises(ValueError, match=NOT_STANDARD):
                hfaccel.patch(model)
    finally:
        del ALL_ATTENTION_FUNCTIONS[name]
    assert implementation_reason(model) is None


def test_a_modeling_files_own_mapping_is_read(monkeypatch):
    """transformers' documented way to change one model file's attention: its own AttentionInterface()."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    own = AttentionInterface()
    own["sdpa"] = hot
    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", own)
    assert "'sdpa' is hot in" in implementation_reason(tiny_model("llama"))


def test_a_wrapper_with_transformers_names_is_named_by_its_own_code():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = functools.wraps(sdpa_attention_forward)(lambda *a, **k: hot(*a, **k))
    try:
        assert "'sdpa' is <lambda> in" in implementation_reason(model)
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


def test_transformers_functions_and_a_hub_flash_kernel_are_standard_and_other_hub_names_are_not(monkeypatch):
    model = tiny_model("llama")
    for name in ("eager", "sdpa", "flex_attention", "flash_attention_2", "paged|sdpa", "paged|eager"):
        model.config._attn_implementation_internal = name
        assert implementation_reason(model) is None, name
    kernel = types.ModuleType("hub_flash_kernel")  # what transformers registers for a flash hub kernel
    kernel.supports_flash_attn = True
    exec("def flash_attn_forward(*args, **kwargs): pass", kernel.__dict__)
    monkeypatch.setitem(sys.modules, "hub_flash_kernel", kernel)
    kernel.flash_attn_forward.__module__ = "hub_flash_kernel"
    for name, function in (("kernels-community/flash", kernel.flash_attn_forward), ("me/hot", hot)):
        AttentionInterface.register(name, function)
        model.config._attn_implementation_internal = name
        try:
            reason = implementation_reason(model)
        finally:
            AttentionInterface._global_mapping.pop(name, None)
        assert (reason is None) == (name == "kernels-community/flash"), reason
