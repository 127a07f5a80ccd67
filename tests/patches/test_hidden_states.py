"""`generate(..., return_dict_in_generate=True, output_hidden_states=True, output_attentions=True)` on the
engine: every step's hidden states and attention probabilities equal transformers' eager ones wherever HF
computes them from kept tokens (left padding, holes, right padding; soft-capping, attention sinks,
windows and chunks that do not bind; chunked prefill and preemption; prompts as embeddings). Masked
positions and a finished row's later steps are zeros, with a warning; what is not served falls back."""

import warnings

import pytest
import torch

import hfaccel
from hfaccel.bench.families import family_model
from tests.helpers import EOS, left_padded, tiny_model

STATES = {
    "return_dict_in_generate": True,
    "output_hidden_states": True,
    "output_attentions": True,
    "do_sample": False,
}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24]]


def _masks(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_padded(PROMPTS)
    if kind == "holes":
        mask[1, 2] = mask[2, 4] = 0
    elif kind == "right":
        mask[1, -1] = mask[2, -2:] = 0  # [2]: a hole, then a masked last token
    return ids, mask


def _run(
    model, ids, mask, new=5, use_cache=True, num_beams=1, num_return_sequences=1, eos_token_id=EOS, **patch
):
    kwargs = {"attention_mask": mask, "max_new_tokens": new, "use_cache": use_cache, **STATES}
    if num_beams > 1:
        kwargs.update(
            num_beams=num_beams, num_return_sequences=num_return_sequences, eos_token_id=eos_token_id
        )
    with torch.no_grad():
        reference = type(model).generate(model, ids, **kwargs)
    options = {"kv_cache_memory": 4_000_000, **patch}
    hfaccel.patch(model, block_size=4, strict=True, **options)  # strict: a fallback would raise
    try:
        out = model.generate(ids, **kwargs)
        engine = model._hfaccel.engine
        assert engine.block_manager.num_used_blocks == 0 and engine.scheduler.live == {}
        out.preemptions = engine.scheduler.num_preemptions
    finally:
        hfaccel.unpatch(model)
    return reference, out


def _assert_same_where_computed(out, reference, mask, finished_at=None):
    """Each step's tensors equal HF's at every kept query position and at a masked last one, which HF
    and the engine both feed (a row's steps before it finished); zeros elsewhere."""
    assert torch.equal(out.sequences, reference.sequences)
    kept = mask.bool().clone()
    kept[:, -1] = True
    rows = torch.ones(mask.shape[0], dtype=torch.bool)
    for step in range(len(reference.attentions)):
        if finished_at is not None:
            rows = torch.tensor([step < n for n in finished_at])
        queries = kept if step == 0 else torch.ones(mask.shape[0], 1, dtype=torch.bool)
        queries = queries & rows[:, None]
        for mine, theirs in zip(out.attentions[step], reference.attentions[step]):
            assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
            torch.testing.assert_close(mine.transpose(1, 2)[queries], theirs.transpose(1, 2)[queries])
            assert not mine.transpose(1, 2)[~queries].any()
        for mine, theirs in zip(out.hidden_states[step], reference.hidden_states[step], strict=True):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine[queries], theirs[queries], rtol=1e-4, atol=1e-5)
            assert not mine[~queries].any()


@pytest.mark.parametrize("kind", ["left", "holes", "right"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_states_equal_hf_eager_at_every_kept_position(family, kind):
    model = tiny_model(family)
    model.set_attn_implementation("eager")  # HF's reference: the only one that returns probabilities
    ids, mask = _masks(kind)
    with pytest.warns(UserWarning, match="masked prompt positions"):
        reference, out = _run(model, ids, mask)
    assert len(out.attentions) == len(out.hidden_states) == 5
    assert len(out.hidden_states[0]) == model.config.num_hidden_layers + 1
    _assert_same_where_computed(out, reference, mask)


@pytest.mark.parametrize(
    ("model_type", "changes"),
    [
        ("gemma2", {"sliding_window": 64}),  # soft-capped scores
        ("gpt_oss", {"sliding_window": 64}),  # attention sinks
        ("llama4_text", {"attention_chunk_size": 64}),  # chunked layers (no chunk binds here)
    ],
)
def test_states_of_capped_sunk_and_chunked_attention_equal_hf(model_type, changes):
    model = family_model(model_type, **changes)
    ids, mask = _masks("left")
    ids = ids.clamp(max=model.config.vocab_size - 1)
    with pytest.warns(UserWarning, match="masked prompt positions"):
        reference, out = _run(model, ids, mask, new=4)
    _assert_same_where_computed(out, reference, mask)


def test_states_survive_chunked_prefill_and_preemption_and_rows_that_finish_early():
    """A prompt computed over several steps (a budget of 4 tokens), requests preempted for blocks, and
    rows that hit EOS at different steps: every recorded token is HF's; a finished row's later steps
    are zeros."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        greedy = type(model).generate(model, ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    eos = int(greedy[0, ids.shape[1] + 2])  # row 0 stops after 3 tokens
    model.generation_config.eos_token_id = eos
    with pytest.warns(UserWarning, match="after it finished"):
        reference, out = _run(
            model, ids, mask, new=8, max_num_batched_tokens=4, kv_cache_memory=12_300, max_model_len=24
        )
    lengths = [
        next((k + 1 for k, t in enumerate(row) if t == eos), 8)
        for row in out.sequences[:, ids.shape[1] :].tolist()
    ]
    assert min(lengths) < max(lengths) and out.preemptions > 0
    _assert_same_where_computed(out, reference, mask, finished_at=lengths)


def test_without_a_cache_every_step_shows_every_token_so_far():
    """HF without a cache recomputes the whole sequence at every step: step s covers all W + s tokens,
    each row over the keys it saw (the same values as with a cache, to rounding)."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no padding, no early finish: nothing to warn about
        reference, out = _run(model, ids, torch.ones_like(ids), new=4, use_cache=False)
    assert torch.equal(out.sequences, reference.sequences)
    for step in range(4):
        for mine, theirs in zip(
            out.attentions[step] + out.hidden_states[step],
            reference.attentions[step] + reference.hidden_states[step],
        ):
            assert mine.shape == theirs.shape and mine.shape[-2] == 4 + step
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_search_states_are_its_running_beams(use_cache):
    """Beam search: each step's rows are the running beams (step 0 the prompt, once per beam); without a
    cache, each beam's whole history as the beams that fed it computed it."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    ids, mask = _masks("holes")
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "eos_token_id": None}
    with pytest.warns(UserWarning, match="masked prompt positions"):
        reference, out = _run(model, ids, mask, new=4, use_cache=use_cache, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.beam_indices, reference.beam_indices)
    kept = mask.bool().repeat_interleave(3, dim=0)
    for step in range(4):
        if step == 0 or not use_cache:
            queries = torch.cat([kept, torch.ones(len(kept), step, dtype=torch.bool)], dim=1)
        else:
            queries = torch.ones(len(kept), 1, dtype=torch.bool)
        for mine, theirs in zip(out.attentions[step], reference.attentions[step]):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine.transpose(1, 2)[queries], theirs.transpose(1, 2)[queries])
        for mine, theirs in zip(out.hidden_states[step], reference.hidden_states[step], strict=True):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine[queries], theirs[queries], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("assist", ["prompt_lookup", "draft_model"])
def test_speculative_decoding_states_are_those_of_decoding_one_token_at_a_time(assist):
    """Drafts verified several at a time: the engine records one step per token, a rejected draft's
    record replaced by the token fed in its place, as HF's plain decoding gives them. HF's assisted
    decoding (an assistant or prompt lookup asked for in the call) goes to HF with these outputs: its
    first iteration's kept drafts get the prompt's first position's states there."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # repeats: prompt lookup drafts
    draft = tiny_model(seed=3)  # a random draft: most of its drafts are rejected
    kwargs = {"max_new_tokens": 8, **STATES}
    with torch.no_grad():
        reference = type(model).generate(model, ids, **kwargs)
    speculative = "ngram" if assist == "prompt_lookup" else draft
    hfaccel.patch(model, kv_cache_memory=4_000_000, strict=True, speculative=speculative)
    try:
        out = model.generate(ids, **kwargs)
        drafted = model._hfaccel.engine.scheduler.spec_totals
        extra = {"prompt_lookup_num_tokens": 3} if assist == "prompt_lookup" else {"assistant_model": draft}
        with pytest.raises(ValueError, match="output_hidden_states or output_attentions"):
            model.generate(ids, **kwargs, **extra)  # strict: what would fall back raises
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out.sequences, reference.sequences)
    assert len(out.attentions) == len(reference.attentions) == 8
    for step in range(8):
        for mine, theirs in zip(
            out.attentions[step] + out.hidden_states[step],
            reference.attentions[step] + reference.hidden_states[step],
        ):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    assert drafted.drafted > 0
    assert assist == "prompt_lookup" or drafted.rejections > 0  # the random draft: rejected ones replaced


@pytest.mark.parametrize("use_cache", [True, False])
def test_states_of_a_prompt_given_as_embeddings_equal_hf(use_cache):
    """HF keeps a cache for a prompt of embeddings whatever use_cache says: one token a step."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    embeds = model.get_input_embeddings()(ids).detach() * 1.5  # not any token's embedding
    kwargs = {"inputs_embeds": embeds, "max_new_tokens": 4, "use_cache": use_cache, **STATES}
    with torch.no_grad():
        reference = type(model).generate(model, **kwargs)
    hfaccel.patch(model, kv_cache_memory=4_000_000, strict=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no padding, no early finish: nothing to warn about
            out = model.generate(**kwargs)
    finally:
        hfaccel.unpatch(model)
    _assert_same_where_computed(out, reference, torch.ones(1, 5))


def test_flags_without_a_dict_output_are_served_without_recording():
    """HF returns the sequences alone: the flags change nothing, and the engine records nothing."""
    model = tiny_model()
    ids, mask = left_padded(PROMPTS)
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "output_attentions": True, "do_sample": False}
    with torch.no_grad():
        reference = type(model).generate(model, ids, **kwargs)
    hfaccel.patch(model, kv_cache_memory=4_000_000, strict=True)
    try:
        assert torch.equal(model.generate(ids, **kwargs), reference)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"cache_implementation": "quantized"}, "cache_implementation='quantized'"),
        ({"cache_implementation": "static"}, "output_attentions=True with cache_implementation='static'"),
    ],
)
def test_what_is_not_recorded_falls_back(kwargs, reason):
    model = tiny_model()
    model.set_attn_implementation("eager")
    ids = torch.tensor([[5, 6, 7, 8]])
    hfaccel.patch(model, kv_cache_memory=4_000_000, strict=True)
    try:
        with pytest.raises(ValueError, match=reason):
            model.generate(ids, max_new_tokens=3, **STATES, **kwargs)
    finally:
        hfaccel.unpatch(model)


def test_attentions_of_a_model_on_sdpa_go_to_hf():
    """HF's sdpa attention returns no probabilities (an empty tuple a step): the call goes to HF; hidden
    states alone are served."""
    model = tiny_model()  # sdpa
    ids = torch.tensor([[5, 6, 7, 8]])
    hfaccel.patch(model, kv_cache_memory=4_000_000, strict=True)
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            model.generate(ids, max_new_tokens=3, **STATES)
        hidden = {**STATES, "output_attentions": False}
        assert len(model.generate(ids, max_new_tokens=3, **hidden).hidden_states) == 3
    finally:
        hfaccel.unpatch(model)


def test_a_window_that_binds_falls_back():
    model = family_model("gemma2", sliding_window=8)
    ids = torch.tensor([list(range(3, 13))])
    hfaccel.patch(model, kv_cache_memory=4_000_000, strict=True)
    try:
        with pytest.raises(ValueError, match="past a sliding window or chunk"):
            model.generate(ids, max_new_tokens=3, **STATES)
    finally:
        hfaccel.unpatch(model)


def test_hfaccel_generate_falls_back_for_states():
    """Its completions carry no hidden states: the call goes to HF, saying why."""
    model = tiny_model()
    with pytest.warns(UserWarning, match="output_hidden_states=True"):
        hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=3, output_hidden_states=True, progress=False)
