"""bitsandbytes 8-bit and 4-bit models (loaded by transformers on the CPU) are served with transformers'
tokens. Their layers cast activations to 16 bits, so a first difference must be a near tie at that
resolution, as for a bf16 model."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import hfaccel
from tests.helpers import assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model().save_pretrained(path)
    return path


@pytest.mark.parametrize("bits", [8, 4])
def test_a_bitsandbytes_model_gives_transformers_tokens(folder, bits, caplog):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (
        BitsAndBytesConfig(load_in_8bit=True)
        if bits == 8
        else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    )
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cpu")
    kind = "Linear8bitLt" if bits == 8 else "Linear4bit"
    assert type(model.model.layers[0].mlp.down_proj).__name__ == kind
    prompts = varied_prompts(4, seed=3)
    with caplog.at_level(logging.ERROR), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes warns of its fp16 cast on every call
        expected = [hf_greedy(model, prompt, 8) for prompt in prompts]
        hfaccel.patch(model, strict=True, progress=False)  # strict: a fallback would raise
        try:
            completions = hfaccel.generate(model, prompts, max_new_tokens=8, progress=False)
        finally:
            hfaccel.unpatch(model)
        for prompt, completion, ref in zip(prompts, completions, expected):
            assert_same_or_near_tie(model, prompt, completion.token_ids, ref, eps=0.0625)
