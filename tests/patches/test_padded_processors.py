"""Logits processors see what HF's generate shows them on a left-padded batch: the padded row (its
length and its pad ids), so length-dependent processors fire at the same step as in HF."""

import warnings

import pytest
import torch

import hfaccel
from tests.helpers import left_padded, tiny_model, varied_prompts

PROMPTS = [[5, 6, 7], [9] * 12, [11, 12, 13, 14, 15, 16, 17], [20]]


def first_tokens(model):
    ids, mask = left_padded(PROMPTS)
    out = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    return sorted(set(out[:, -1].tolist()))


CASES = {
    "forced_eos_token_id": lambda model: {"forced_eos_token_id": 7, "max_new_tokens": 6},
    "begin_suppress_tokens": lambda model: {
        "begin_suppress_tokens": first_tokens(model),
        "max_new_tokens": 4,
    },
    "exponential_decay_length_penalty": lambda model: {
        "exponential_decay_length_penalty": (2, 3.0),
        "eos_token_id": 9,
        "max_new_tokens": 10,
    },
    "repetition_penalty": lambda model: {"repetition_penalty": 5.0, "max_new_tokens": 8},
    "no_repeat_ngram_size": lambda model: {"no_repeat_ngram_size": 1, "max_new_tokens": 8},
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("case", CASES)
def test_processors_count_the_padded_row_as_hf_does(family, case):
    model = tiny_model(family)
    kwargs = {"do_sample": False, **CASES[case](model)}
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        reference = type(model).generate(model, input_ids=ids, attention_mask=mask, **kwargs)
    hfaccel.patch(model, kv_cache_memory=1_000_000)
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(out, reference)


def test_forced_eos_lands_where_hf_puts_it_on_every_row():
    model = tiny_model()
    ids, mask = left_padded(PROMPTS)
    hfaccel.patch(model, kv_cache_memory=1_000_000)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, forced_eos_token_id=7)
    assert out.shape[1] == ids.shape[1] + 5
    assert out[:, -1].tolist() == [7] * len(PROMPTS), "forced at max_length - 1 for every row"


def test_a_prompt_running_past_the_context_warns():
    model = tiny_model()  # 512 positions
    prompt = [5 + (i * 7) % 200 for i in range(511)]
    hfaccel.patch(model, kv_cache_memory=1_000_000)
    with pytest.warns(
        UserWarning, match=r"row 0 has 511 prompt tokens; with max_new_tokens=10 it would run past"
    ):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10)
    assert out.shape[1] == 512
    with pytest.warns(UserWarning, match=r"prompts\[1\] has 511 prompt tokens.*1 new token\(s\)"):
        completions = hfaccel.generate(model, [[5, 6], prompt], max_new_tokens=10, progress=False)
    assert [len(c.token_ids) for c in completions] == [10, 1]
    assert completions[1].finish_reason == "length"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hfaccel.generate(model, varied_prompts(3), max_new_tokens=10, progress=False)
