"""Calls whose result the engine would get wrong go to HF with a warning: masks that are not left
padding, and sequences past a sliding window. Never silently different, never truncated."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import hfaccel
from tests.helpers import tiny_model


def test_right_padded_and_holey_masks_fall_back_and_equal_hf():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    for mask in (
        torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),  # right padding
        torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),  # a hole
    ):
        expected = type(model).generate(
            model, input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False
        )
        hfaccel.patch(model)
        try:
            with pytest.warns(UserWarning, match="attention mask that is not left padding"):
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        finally:
            hfaccel.unpatch(model)
        assert torch.equal(out, expected)


def test_left_padding_stays_on_the_engine():
    model = hfaccel.patch(tiny_model("llama"), strict=True)  # strict: a fallback would raise
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)


def _windowed_model(window=24):
    config = MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=window,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model


def test_sliding_window_models_past_the_window_fall_back_never_truncate():
    model = _windowed_model(window=24)
    prompt = list(range(3, 23))  # 20 tokens + 12 new > 24
    expected = type(model).generate(model, torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="sliding window"):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        completions = hfaccel.generate(
            model, [prompt], max_new_tokens=12, progress=False
        )  # warned once already
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)
    assert completions[0].token_ids == expected[0, 20:].tolist() and len(completions[0].token_ids) == 12


def test_sliding_window_models_within_the_window_stay_on_the_engine():
    model = hfaccel.patch(_windowed_model(window=64), strict=True)
    out = model.generate(torch.tensor([list(range(3, 23))]), max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 28)
