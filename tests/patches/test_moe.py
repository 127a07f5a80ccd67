"""Mixture-of-experts families on the single-process engine: greedy tokens equal unpatched HF's."""

import warnings

import pytest

import hfaccel
from tests.helpers import MOE_FAMILIES, hf_greedy, tiny_model, varied_prompts


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_matches_hf_greedy(family):
    model = tiny_model(family)
    prompts = varied_prompts(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tested family: no "untested model_type" warning
        completions = hfaccel.generate(model, prompts, max_new_tokens=10, progress=False)
    for completion, prompt in zip(completions, prompts):
        assert completion.token_ids == hf_greedy(model, prompt, 10)
