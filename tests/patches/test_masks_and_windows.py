"""Masks and windows: left padding, right padding, masks with holes and sequences past a sliding window
are served with HF's tokens; calls whose result the engine would get wrong go to HF with a warning
(padding where the output holds prompt positions). Never silently different, never truncated."""

import logging
import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, MistralConfig, MistralForCausalLM

import hfaccel
from hfaccel.kernels import cpu_decode
from hfaccel.patches.arguments import CACHE_NAME
from tests.helpers import left_padded, tiny_model


class BoostColumnOne(LogitsProcessor):
    """Boosts the token the row holds at column 1: reads the row in HF's order, holes included."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(len(scores)), input_ids[:, 1]] += 50.0
        return scores


def _right_padded(seed=1):
    """Right padding (one and two pad columns) and a masked last column after holes."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (4, 9), generator=g)
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[0, -1:] = 0
    mask[1, -4:] = 0
    mask[2, [2, 5, 8]] = 0  # holes, then a masked last token
    return ids, mask  # row 3: no padding at all


def _patched_and_hf(model, ids, mask, patch_options=None, **options):
    expected = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=10, **options)
    hfaccel.patch(model, strict=True, **(patch_options or {}))  # strict: a fallback would raise
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **options)
    finally:
        hfaccel.unpatch(model)
    return out, expected


@pytest.mark.parametrize(
    "patch_options",
    [
        {"block_size": 4, "long_prefill_token_threshold": 3},  # chunked, the last token a step alone
        {"block_size": 4, "kv_cache_memory": 6 * 2048, "max_model_len": 24},  # 6 blocks: preempted
        {"block_size": 4, "max_num_seqs": 1},  # one row a step: the masked token in a pure decode step
    ],
    ids=["chunked", "preempted", "alone"],
)
@pytest.mark.parametrize("c_kernel", [True, False], ids=["c-kernel", "sdpa"])
def test_right_padding_holds_across_chunks_preemption_and_decode_paths(patch_options, c_kernel, monkeypatch):
    if not c_kernel:
        monkeypatch.setattr(cpu_decode, "supports", lambda *args: False)
    out, expected = _patched_and_hf(
        tiny_model("llama"), *_right_padded(seed=2), patch_options=patch_options, do_sample=False
    )
    assert torch.equal(out, expected)


def test_shifted_tokens_never_reach_another_prompt_through_the_prefix_cache():
    """A right-padded row's new tokens sit one position off their cache index: a later prompt of the
    same tokens, unpadded, must not be served their K/V (nor the other way round)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    hfaccel.patch(model, strict=True, block_size=2)
    try:
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        follow_up = torch.cat([ids[:, :-1], first[:, 9:]], dim=1)  # the kept tokens and the new ones
        served = model.generate(input_ids=follow_up, max_new_tokens=6, do_sample=False)
        again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(
        served, type(model).generate(model, input_ids=follow_up, max_new_tokens=6, do_sample=False)
    )
    assert torch.equal(again, first)


def _holey(rows, width, seed):
    """Masks with holes anywhere before an attended last token, as transformers' `random_attention_mask`
    makes them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (rows, width), generator=g)
    mask = (torch.rand(rows, width, generator=g) > 0.35).long()
    mask[:, -1] = 1
    return ids, mask


@pytest.mark.parametrize("masks", ["holes", "right-padding"])
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
def test_masks_with_holes_and_right_padding_are_served_with_hf_tokens(masks, family, options):
    """Holes: the masked tokens are dropped. Right padding: HF feeds the masked last token at position
    0, seeing the attended tokens but not itself, and numbers the new tokens 1, 2, ...: the engine does
    the same (`Request.masked_last`)."""
    ids, mask = _holey(4, 11, seed=3) if masks == "holes" else _right_padded()
    assert not bool((mask[:, 1:] >= mask[:, :-1]).all())  # really holes or right padding, not left
    out, expected = _patched_and_hf(tiny_model(family), ids, mask, **options)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_a_mask_of_other_values_goes_to_transformers_with_its_tokens(dtype):
    """Segment ids (1, 1, 2, 2): transformers attends to every nonzero and numbers positions by the
    mask's running sum, so its tokens differ from a mask of ones: such a call falls back, warned. A float
    mask of 0.0 and 1.0 is served."""
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [7, 8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1]], dtype=dtype)
    expected = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=6)
    assert not torch.equal(expected, type(model).generate(model, input_ids=ids, max_new_tokens=6))
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="an attention mask with values other than 0 and 1"):
            assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), expected)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # served: no fallback warning
            ones = torch.ones(2, 6, dtype=dtype)
            model.generate(input_ids=ids, attention_mask=ones, max_new_tokens=6)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("masks", ["holes", "right-padding"])
@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 3},
        {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.5},
        # processors that read the row in HF's order, holes included, and its mask
        {"num_beams": 2, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        # a processor that counts the row's length: it sees HF's row, not the prompt beside it
        {"num_beams": 2, "exponential_decay_length_penalty": (1, 3.0)},
    ],
    ids=["beams", "returned", "processors", "row-length"],
)
def test_beam_search_over_holes_and_right_padding_gives_hf_beams(masks, options):
    ids, mask = _holey(3, 9, seed=11) if masks == "holes" else _right_padded(seed=5)
    if "exponential_decay_length_penalty" in options:  # an EOS the beams meet: the penalty boosts it
        options = {**options, "eos_token_id": 10 if masks == "holes" else 9}
    out, expected = _patched_and_hf(tiny_model("llama"), ids, mask, do_sample=False, **options)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("masks", ["holes", "right-padding"])
@pytest.mark.parametrize("with_ids", [True, False], ids=["embeds-and-ids", "embeds-only"])
def test_holes_and_right_padding_with_inputs_embeds_give_hf_tokens(masks, with_ids):
    model = tiny_model("llama")
    ids, mask = _holey(3, 9, seed=11) if masks == "holes" else _right_padded(seed=5)
    embeds = model.get_input_embeddings()(ids).detach()
    kwargs = {"inputs_embeds": embeds, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False}
    kwargs.update({"input_ids": ids} if with_ids else {})
    kwargs.update(repetition_penalty=1.5, no_repeat_ngram_size=2)  # processors that read the row
    expected = type(model).generate(model, **kwargs)
    hfaccel.patch(model, strict=True)  # strict: a fallback would raise
    try:
        out = model.generate(**kwargs)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)


def test_right_padding_with_a_cache_given_falls_back():
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids, mask = _right_padded()
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 4, "do_sample": False}
    expected = type(model).generate(model, **kwargs, **{CACHE_NAME: DynamicCache(config=model.config)})
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match=r"right padding\), with a cache given"):
            out = model.generate(**kwargs, **{CACHE_NAME: DynamicCache(config=model.config)})
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)


def test_right_padding_falls_back_only_where_a_draft_model_drafts():
    """A draft model keeps its own cache, not shifted as the target's: with the engine's draft model the
    call goes to HF; an assistant that is not the engine's drafts nothing, so the row is served."""
    model, draft = tiny_model("llama"), tiny_model("llama", seed=3)
    ids, mask = _right_padded()
    one = {"input_ids": ids[1:2], "attention_mask": mask[1:2], "max_new_tokens": 4, "do_sample": False}
    assert not bool(mask[1, -1])
    expected = type(model).generate(model, **one)
    hfaccel.patch(model, strict=True)
    try:
        with pytest.warns(UserWarning, match="assistant_model is not the engine's draft model"):
            assert torch.equal(model.generate(**one, assistant_model=draft), expected)
    finally:
        hfaccel.unpatch(model)
    hfaccel.patch(model, speculative=draft, strict=True)
    try:
        with pytest.raises(ValueError, match="right padding, with a draft model"):
            model.generate(**one, assistant_model=draft)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("masks", ["holes", "right-padding"])
def test_the_returned_cache_holds_the_kept_tokens_in_their_columns(masks):
    """HF returns K/V at every column; the masked ones are never attended again. The engine's cache
    holds the kept tokens' K/V in their columns and zeros in the masked ones: scores match, and
    generation continued from either cache gives the same tokens."""
    model = tiny_model("llama")
    ids, mask = _holey(3, 9, seed=7) if masks == "holes" else _right_padded(seed=3)
    options = {
        "max_new_tokens": 6,
        "min_new_tokens": 6,  # no row finishes early (the engine does not compute a finished row)
        "do_sample": False,
        "return_dict_in_generate": True,
        "output_scores": True,
    }
    expected = type(model).generate(model, input_ids=ids, attention_mask=mask, **options)
    hfaccel.patch(model, strict=True)  # strict: a fallback would raise
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, **options)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    width = ids.shape[1] + len(out.scores) - 1
    seen = torch.cat([mask, torch.ones(len(ids), len(out.scores) - 1, dtype=mask.dtype)], dim=1).bool()
    for layer in range(len(getattr(expected, CACHE_NAME).layers)):
        ours, theirs = (
            getattr(out, CACHE_NAME).layers[layer].keys,
            getattr(expected, CACHE_NAME).layers[layer].keys,
        )
        assert ours.shape == theirs.shape == (len(ids), 2, width, 16)
        rows, columns = seen.nonzero(as_tuple=True)
        torch.testing.assert_close(ours[rows, :, columns], theirs[rows, :, columns], rtol=1e-4, atol=1e-4)
        assert not ours.permute(0, 2, 1, 3)[~seen].any()  # masked columns: zeros
    follow = torch.cat([out.sequences, torch.full((len(ids), 1), 9)], dim=1)
    follow_mask = torch.cat([seen, torch.ones(len(ids), 2, dtype=torch.bool)], dim=1).long()
    continued = [
        type(model).generate(
            model,
            input_ids=follow,
            attention_mask=follow_mask,
            **{CACHE_NAME: cache},
            max_new_tokens=5,
            do_sample=False,
        )
        for cache in (getattr(out, CACHE_NAME), getattr(expected, CACHE_NAME))
    ]
    assert torch.equal(continued[0], continued[1])


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


def test_holes_on_a_sliding_window_model_are_served_while_no_window_binds():
    """transformers' windows count the masked tokens, the engine's rows drop them: the same tokens as
    long as the padded row and its new tokens fit in the narrowest window; past that, HF serves it."""
    model = _windowed_model(window=24)
    ids, mask = _holey(3, 11, seed=9)
    expected = type(model).generate(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=13, do_sample=False
    )
    hfaccel.patch(model, strict=True)  # strict: a fallback would raise
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=13, do_sample=False)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="holes, with sliding windows or chunks"):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
    finally:
        hfaccel.unpatch(model)
    expected = type(model).generate(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False
    )
    assert torch.equal(out, expected)


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


@pytest.mark.parametrize("options", [{}, {"num_beams": 2}], ids=["greedy", "beams"])
def test_a_masked_last_token_does_not_count_against_the_context(options):
    """It leaves before any new token takes its place: a row that fills the context with it, or whose
    kept tokens plus max_new_tokens reach the context exactly, is served, with no warning."""
    model = tiny_model("llama", max_positions=24)
    ids = torch.randint(3, 200, (1, 17), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False, **options}
    expected = type(model).generate(model, **kwargs)
    full = torch.cat([ids, ids[:, :7]], dim=1)  # 24 columns, the last masked: 23 kept
    full_mask = torch.ones_like(full)
    full_mask[0, -1] = 0
    one = {"input_ids": full, "attention_mask": full_mask, "max_new_tokens": 1, "do_sample": False}
    expected_full = type(model).generate(model, **one)
    hfaccel.patch(model, strict=True)  # strict: a fallback would raise
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not even the past-the-context warning
            out = model.generate(**kwargs)
            out_full = model.generate(**one)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected) and torch.equal(out_full, expected_full)


def test_a_right_padded_batch_gets_transformers_warning(caplog):
    """Served with HF's tokens, a right-padded batch still gets HF's warning that the tokenizer pads on
    the wrong side (through transformers' logger, in its words); a left-padded one does not."""
    from transformers.utils import logging as transformers_logging

    model = hfaccel.patch(tiny_model())
    ids, mask = _right_padded()
    transformers_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="transformers.generation.utils"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
            assert "right-padding was detected" in caplog.text
            caplog.clear()
            left = torch.ones_like(mask)
            left[0, :1], left[1, :4] = 0, 0
            model.generate(input_ids=ids, attention_mask=left, max_new_tokens=3)
            assert "right-padding" not in caplog.text
    finally:
        transformers_logging.disable_propagation()
        hfaccel.unpatch(model)


def test_an_unmasked_single_row_gets_no_batched_input_warning(caplog):
    """transformers warns that an unset mask cannot be inferred only for a batch of several rows (its
    pad id is its EOS id here, as SmolLM2's): one row without a mask is the usual notebook call."""
    from transformers.utils import logging as transformers_logging

    model = tiny_model()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    hfaccel.patch(model)
    transformers_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="transformers.generation.utils"):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
            assert "batched input" not in caplog.text
            model.generate(torch.tensor([[5, 6, 7], [7, 6, 5]]), max_new_tokens=3, do_sample=False)
            assert "batched input" in caplog.text  # as transformers warns for two rows
    finally:
        transformers_logging.disable_propagation()
        hfaccel.unpatch(model)
