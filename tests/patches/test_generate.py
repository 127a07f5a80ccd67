"""The patched `model.generate` against unpatched HF generate, on padded batches."""

import warnings

import pytest
import torch
from transformers import GenerationConfig, SynthIDTextWatermarkingConfig

import hfaccel
from hfaccel.patches.patch_state import fall_back
from tests.helpers import (
    FAMILIES,
    PAD,
    assert_same_or_near_tie,
    hf,
    hf_greedy,
    left_padded,
    tiny_model,
    varied_prompts,
)


@pytest.fixture
def patched():
    model = hfaccel.patch(tiny_model("llama"), block_size=8, kv_cache_memory=4_000_000)
    yield model
    hfaccel.unpatch(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_hf_per_prompt(family):
    model = tiny_model(family)
    prompts = varied_prompts(16)
    refs = [hf_greedy(model, p, 10) for p in prompts]
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000)
    ids, mask = left_padded(prompts)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    width = ids.shape[1]
    assert torch.equal(out[:, :width], ids), "the left-padded prompt must come back untouched"
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        row = out[i, width:].tolist()
        ours = row[: len(ref)] if len(ref) < 10 else row
        assert_same_or_near_tie(model, prompt, ours, ref)
        assert all(t == PAD for t in row[len(ref) :]), "finished rows are right-padded with pad_token_id"
    assert out.shape[1] == width + max(len(r) for r in refs)


def test_same_tensor_as_unpatched_hf_on_a_padded_batch(patched):
    prompts = varied_prompts(8, seed=5)
    ids, mask = left_padded(prompts)
    ref = type(patched).generate(
        patched, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False
    )
    out = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert out.shape == ref.shape
    for i, prompt in enumerate(prompts):
        assert_same_or_near_tie(
            patched, prompt, out[i, ids.shape[1] :].tolist(), ref[i, ids.shape[1] :].tolist()
        )


def test_max_length_and_min_new_tokens_follow_hf_rules(patched):
    prompts = varied_prompts(4, seed=7)
    ids, mask = left_padded(prompts)
    unpatched = type(patched).generate
    for kwargs in ({"max_length": ids.shape[1] + 5}, {"max_new_tokens": 6, "min_new_tokens": 6}, {}):
        ref = unpatched(patched, input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)
        out = patched.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)
        assert out.shape == ref.shape, kwargs


def test_generation_config_object_and_return_dict(patched):
    ids, mask = left_padded(varied_prompts(3))
    config = GenerationConfig(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    out = patched.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    ref = type(patched).generate(patched, input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(out.sequences, ref.sequences)


def test_positional_inputs_without_mask(patched):
    prompt = varied_prompts(3)[2]
    out = patched.generate(torch.tensor([prompt]), max_new_tokens=6)
    assert out[0, len(prompt) :].tolist() == hf_greedy(patched, prompt, 6)


def test_arguments_after_the_generation_config_may_come_by_position(patched):
    """transformers' `generate` takes ``logits_processor``, ``stopping_criteria`` and the rest by
    position too: the patched one binds them as it does, and refuses what Python refuses."""
    from transformers import (
        LogitsProcessorList,
        MaxLengthCriteria,
        RepetitionPenaltyLogitsProcessor,
        StoppingCriteriaList,
    )

    prompt = torch.tensor([varied_prompts(3)[2]])
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    criteria = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + 3)])
    for args in [
        (prompt, None, processors),
        (prompt, None, None, criteria),
        (prompt, None, processors, criteria),
    ]:
        expected = type(patched).generate(patched, *args, max_new_tokens=6)
        assert torch.equal(patched.generate(*args, max_new_tokens=6), expected)
    with pytest.raises(TypeError, match="multiple values for argument 'logits_processor'"):
        patched.generate(prompt, None, processors, logits_processor=processors)
    with pytest.raises(TypeError, match="positional arguments"):
        patched.generate(prompt, None, *([None] * 20))


def test_a_call_without_inputs_starts_from_bos_as_hf_does():
    """HF starts each row from the BOS token (transformers' `test_generate_without_input_ids`); with no
    BOS token HF raises, and so does the patched model (through HF)."""
    model = tiny_model("llama")
    model.generation_config.bos_token_id = 1
    expected = type(model).generate(model, do_sample=False, max_new_tokens=6)
    hfaccel.patch(model, strict=True)  # strict: a fallback would raise
    try:
        out = model.generate(do_sample=False, max_new_tokens=6)
        assert torch.equal(out, expected) and out[0, 0] == 1
    finally:
        hfaccel.unpatch(model)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # HF takes any mask beside its BOS rows, unchecked
    expected = type(model).generate(model, attention_mask=mask, do_sample=False, max_new_tokens=6)
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="inputs other than"):
            out = model.generate(attention_mask=mask, do_sample=False, max_new_tokens=6)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)
    model.generation_config.bos_token_id = model.config.bos_token_id = None
    hfaccel.patch(model)
    try:
        with (
            pytest.warns(UserWarning, match="inputs other than"),
            pytest.raises(ValueError, match="bos_token_id"),
        ):
            model.generate(do_sample=False, max_new_tokens=6)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"guidance_scale": 1.5}, "guidance_scale"),
        ({"watermarking_config": SynthIDTextWatermarkingConfig(keys=[3, 5, 7], ngram_len=2)}, "SynthID"),
        # transformers builds a cache for None, then feeds every token each step: tokens of its own
        ({"use_cache": None}, "use_cache=None"),
        ({"generation_config": GenerationConfig(use_cache=0, max_new_tokens=4)}, "use_cache=0"),
    ],
)
def test_unsupported_options_fall_back_with_one_warning(patched, kwargs, reason):
    ids, mask = left_padded(varied_prompts(2))
    with pytest.warns(UserWarning, match=reason):
        out = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **kwargs)
    ref = type(patched).generate(patched, input_ids=ids, attention_mask=mask, max_new_tokens=4, **kwargs)
    sequences = out.sequences if hasattr(out, "sequences") else out
    ref_sequences = ref.sequences if hasattr(ref, "sequences") else ref
    if not kwargs.get("do_sample"):
        assert torch.equal(sequences, ref_sequences)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason does not warn twice
        patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **kwargs)


def test_a_reason_warns_once_whatever_its_numbers():
    """Prompts over max_model_len fall back with one warning, not one per prompt length (the per-model
    set of warned reasons grew with each: a probe found it)."""
    model = hfaccel.patch(tiny_model(max_positions=64), kv_cache_memory=1_000_000)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for length in range(64, 72):
                model.generate(torch.randint(3, 200, (1, length)), max_new_tokens=1, do_sample=False)
        assert sum("hfaccel:" in str(w.message) for w in caught) == 1
        assert len(model._hfaccel.warned) == 1
        with warnings.catch_warnings(record=True) as caught:  # digits of a name are no number
            warnings.simplefilter("always")
            for name in ("torch.float32", "torch.float16", "torch.float16", "adapter a1", "adapter a2"):
                fall_back(model._hfaccel, f"a reason naming {name}")
        assert len(caught) == 4
    finally:
        hfaccel.unpatch(model)


def test_strict_mode_turns_the_fallback_into_an_error():
    model = hfaccel.patch(tiny_model(), strict=True, kv_cache_memory=1_000_000)
    with pytest.raises(
        ValueError, match=r"hfaccel \(strict=True\) does not serve generation mode 'group_beam_search'"
    ):
        model.generate(
            torch.tensor([[5, 6, 7]]), num_beams=2, num_beam_groups=2, diversity_penalty=1.0, max_new_tokens=3
        )
    with pytest.raises(ValueError, match="does not serve guidance_scale"):
        model.generate(torch.tensor([[5, 6, 7]]), guidance_scale=1.5, max_new_tokens=3)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)
    assert out[0, 3:].tolist() == hf_greedy(model, [5, 6, 7], 3)


def test_bad_input_raises_and_model_still_generates(patched):
    prompt = varied_prompts(3)[2]
    with pytest.raises(ValueError, match="max_length"):
        patched.generate(torch.tensor([prompt]), max_length=len(prompt))
    # A prompt over the context: transformers generates from it (RoPE has no hard end), so it serves it.
    with pytest.warns(
        UserWarning, match=r"a prompt of 600 tokens, at or over the engine's max_model_len \(512\)"
    ):
        out = patched.generate(torch.tensor([[5] * 600]), max_new_tokens=2)
    assert out[0, 600:].tolist() == hf_greedy(patched, [5] * 600, 2)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        patched.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, 2, dtype=torch.long))
    engine = patched._hfaccel.get_engine(patched)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert patched.generate(torch.tensor([prompt]), max_new_tokens=6)[0, len(prompt) :].tolist() == hf_greedy(
        patched, prompt, 6
    )


def test_plain_forward_keeps_the_models_own_attention(patched):
    ids, mask = left_padded(varied_prompts(3))
    with torch.no_grad():
        before = patched(input_ids=ids, attention_mask=mask).logits
    patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    with torch.no_grad():
        after = patched(input_ids=ids, attention_mask=mask).logits
    assert patched.config._attn_implementation != "hfaccel"
    torch.testing.assert_close(before, after)


class ShapeRecorder:
    """A streamer that keeps what each `put` got: its shape and its tokens."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append((tuple(value.shape), value.flatten().tolist()))

    def end(self):
        self.ended = True


@pytest.mark.parametrize("assisted", [False, True])
def test_a_streamer_gets_the_shapes_hfs_loop_puts(assisted):
    """HF's greedy loop puts each token as ``[1]``; its assisted loop (prompt lookup) a step's tokens as
    ``[1, n]``. The same tokens, in the same shapes (not the same grouping: the engine picks its own
    draft lengths)."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    kwargs = dict(max_new_tokens=8, do_sample=False)
    if assisted:
        kwargs["prompt_lookup_num_tokens"] = 3
    theirs, ours = ShapeRecorder(), ShapeRecorder()
    hf(model, input_ids=ids, streamer=theirs, **kwargs)
    hfaccel.patch(model, kv_cache_memory=4_000_000, block_size=8)
    model.generate(input_ids=ids, streamer=ours, **kwargs)
    assert ours.ended and ours.puts[0] == theirs.puts[0]  # the prompt first
    tokens = [t for _, values in ours.puts[1:] for t in values]
    assert tokens == [t for _, values in theirs.puts[1:] for t in values]
    dims = {len(shape) for shape, _ in ours.puts[1:]}
    assert dims == {len(shape) for shape, _ in theirs.puts[1:]} == ({2} if assisted else {1})
