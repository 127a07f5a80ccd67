"""Masks and windows: left padding, masks with holes and sequences past a sliding window are served
with HF's tokens; calls whose result the engine would get wrong go to HF with a warning (right padding,
holes where the output holds prompt positions). Never silently different, never truncated."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, MistralConfig, MistralForCausalLM

import hfaccel
from tests.helpers import left_padded, tiny_model


def test_right_padded_masks_fall_back_and_equal_hf():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    expected = type(model).generate(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False
    )
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="last column is masked"):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)


class BoostColumnOne(LogitsProcessor):
    """Boosts the token the row holds at column 1: reads the row in HF's order, holes included."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(len(scores)), input_ids[:, 1]] += 50.0
        return scores


def _holey(rows, width, seed):
    """Masks with holes anywhere before an attended last token, as transformers' `random_attention_mask`
    makes them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (rows, width), generator=g)
    mask = (torch.rand(rows, width, generator=g) > 0.35).long()
    mask[:, -1] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(
    "options",
    [
        {"do_sample": False},
        # processors that read the row (n-gram bans) and the row's mask (the repetition penalty)
        {"do_sample": False, "repetition_penalty": 1.6, "no_repeat_ngram_size": 2},
        {"do_sample": False, "logits_processor": LogitsProcessorList([BoostColumnOne()])},
        {"do_sample": False, "min_new_tokens": 6, "eos_token_id": 7},
    ],
    ids=["greedy", "processors", "row-order", "min-length"],
)
def test_masks_with_holes_are_served_with_hf_tokens(family, options):
    model = tiny_model(family)
    ids, mask = _holey(4, 11, seed=3)
    assert not bool((mask[:, 1:] >= mask[:, :-1]).all())  # really holes, not left padding
    expected = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, **options)
    hfaccel.patch(model, strict=True)  # strict: a fallback would raise
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **options)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"num_beams": 2}, "holes, with beam search"),
        ({"return_dict_in_generate": True}, "holes, with the cache returned"),
    ],
)
def test_masks_with_holes_fall_back_where_the_output_holds_the_prompt_positions(options, reason):
    model = tiny_model("llama")
    ids, mask = _holey(2, 7, seed=5)
    expected = type(model).generate(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **options
    )
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match=reason):
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **options
            )
    finally:
        hfaccel.unpatch(model)
    sequences = out.sequences if options.get("return_dict_in_generate") else out
    expected = expected.sequences if options.get("return_dict_in_generate") else expected
    assert torch.equal(sequences, expected)


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


def test_sliding_window_models_past_the_window_stay_on_the_engine_with_hf_tokens():
    """A window of 24 tokens, a batch of left-padded prompts of 20-30 tokens and 12 new ones: every
    sequence outgrows the window, on both front-ends, with HF's tokens and no fallback."""
    model = _windowed_model(window=24)
    prompts = [list(range(3, 23)), list(range(40, 70)), [5] * 26]
    ids, mask = left_padded(prompts)
    expected = type(model).generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hfaccel.patch(model, strict=True)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        completions = hfaccel.generate(model, prompts, max_new_tokens=12, progress=False)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)
    for i, completion in enumerate(completions):
        assert completion.token_ids == expected[i, ids.shape[1] :].tolist()
