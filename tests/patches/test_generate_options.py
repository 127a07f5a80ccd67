"""generate's options served on the engine (issue #11 item 3): custom logits processors and stopping
criteria run per row, cache implementations and compile configs, position_ids / logits_to_keep, and
assisted decoding (prompt lookup, a draft model) on the speculative path. Each against unpatched HF
generate; each option that still falls back warns (or raises under strict=True)."""

from __future__ import annotations

import contextlib
import threading
import warnings

import numpy as np
import pytest
import torch
from transformers import (
    CompileConfig,
    EosTokenCriteria,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)

import hfaccel
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import SamplingParams, StoppingParams
from tests.helpers import EOS, hf, left_padded, tiny_model, tiny_tokenizer, varied_prompts

FAMILIES = ("llama", "qwen2", "mistral")
PROMPTS = [[5, 6, 7], [9] * 12, [11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 30, 31, 30]]


def patch(model, **config):
    return hfaccel.patch(model, kv_cache_memory=4_000_000, block_size=8, **config)


class BanAfterLast(LogitsProcessor):
    """Stateless: bans a token chosen by the row's last id."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        rows = torch.arange(input_ids.shape[0])
        scores[rows, (input_ids[:, -1] * 7 + 3) % scores.shape[-1]] = -float("inf")
        return scores


class BoostByLength(LogitsProcessor):
    """Reads cur_len = input_ids.shape[-1] (the padded width plus the tokens generated so far)."""

    def __call__(self, input_ids, scores):
        cur_len = input_ids.shape[-1]
        scores = scores.clone()
        scores[:, 3 + cur_len % 40] += 4.0
        return scores


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class StopAtLength(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[-1] >= self.length


class Recorder(StoppingCriteria):
    """Records the rows it was shown (as tuples) and what `scores` was."""

    def __init__(self):
        self.rows, self.scores = set(), []

    def __call__(self, input_ids, scores, **kwargs):
        self.rows.update(tuple(row) for row in input_ids.tolist())
        self.scores.append(None if scores is None else (len(scores), tuple(scores[-1].shape)))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@contextlib.contextmanager
def no_fallback():
    """A context in which any hfaccel warning (a fallback) is an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hfaccel")
        yield


# ----------------------------------------------------------------- 1. custom logits processors


@pytest.mark.parametrize("family", FAMILIES)
def test_custom_logits_processors_run_per_row_as_hf(family):
    model = tiny_model(family)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    processors = LogitsProcessorList([BanAfterLast(), BoostByLength()])
    reference = hf(model, logits_processor=processors, **kwargs)
    assert not torch.equal(reference, hf(model, **kwargs)), "the processors must change the result"
    patch(model)
    with no_fallback():
        out = model.generate(logits_processor=processors, **kwargs)
    assert torch.equal(out, reference)


def test_custom_processors_merge_with_hfs_own_as_hf_does():
    """HF's merge: a custom processor of a type it builds takes that one's place (here the repetition
    penalty); the others come after its own; min_new_tokens' processor runs in HF's order."""
    model = tiny_model("qwen2")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=9,
        min_new_tokens=4,
        repetition_penalty=1.2,
        no_repeat_ngram_size=2,
        do_sample=False,
    )
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0), BoostByLength()])
    reference = hf(model, logits_processor=processors, **kwargs)
    patch(model)
    with no_fallback():
        out = model.generate(logits_processor=processors, **kwargs)
    assert torch.equal(out, reference)


def test_custom_processor_that_allows_eos_before_min_new_tokens_stops_as_in_hf():
    """HF's min-length processor runs before the custom ones; a custom one that puts EOS back in play
    can end the row early (HF's EOS criterion does not wait for min_new_tokens)."""

    class ForceEos(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            if input_ids.shape[-1] >= 6:
                scores[:, EOS] = 1e4
            return scores

    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    kwargs = dict(input_ids=ids, max_new_tokens=10, min_new_tokens=8, do_sample=False)
    processors = LogitsProcessorList([ForceEos()])
    reference = hf(model, logits_processor=processors, **kwargs)
    patch(model)
    out = model.generate(logits_processor=processors, **kwargs)
    assert torch.equal(out, reference) and out[0, -1].item() == EOS


def test_sampling_runs_the_custom_processor_on_every_row():
    class OnlyTwo(LogitsProcessor):
        def __call__(self, input_ids, scores):
            keep = torch.full_like(scores, -float("inf"))
            keep[:, [40, 41]] = 0.0
            return scores + keep

    model = patch(tiny_model("llama"))
    ids, mask = left_padded(PROMPTS)
    with no_fallback():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=True,
            logits_processor=LogitsProcessorList([OnlyTwo()]),
        )
    assert set(out[:, ids.shape[1] :].flatten().tolist()) <= {40, 41}


def by_prompt(batch_id, sent):
    """A constraint per prompt and history: prompt 0 only even ids, the others ids below 60; after an
    id divisible by 5, only that id + 1 (every rule reads the row HF shows, padding included)."""
    last = int(sent[-1])
    if last % 5 == 0:
        return [last + 1]
    return list(range(4, 100, 2)) if batch_id == 0 else list(range(3, 60))


@pytest.mark.parametrize("prompt_lookup", [None, 2])
def test_prefix_allowed_tokens_fn_is_served_per_row_as_hf(prompt_lookup):
    """Constrained decoding on a left-padded batch (with prompt lookup: each draft checked under the
    constraint too): HF's tokens, the function asked with each row's own batch index."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        kwargs["input_ids"], kwargs["attention_mask"] = ids[:1], mask[:1]  # HF's lookup takes one row
    reference = hf(model, prefix_allowed_tokens_fn=by_prompt, **kwargs)
    assert not torch.equal(reference, hf(model, **kwargs)), "the constraint must change the result"
    asked = set()

    def recording(batch_id, sent):
        asked.add(batch_id)
        return by_prompt(batch_id, sent)

    patch(model, strict=True)
    out = model.generate(prefix_allowed_tokens_fn=recording, **kwargs)
    assert torch.equal(out, reference)
    assert asked == set(range(kwargs["input_ids"].shape[0]))
    assert (model._hfaccel.engine.stats()["spec_drafted"] > 0) == bool(prompt_lookup)


def test_prefix_allowed_tokens_fn_that_allows_only_eos_below_min_new_tokens_stops_as_hf():
    """HF's min-length processor masks EOS, and 5.24's prefix processor then forces the allowed EOS,
    which ends the row (5.17 does not force: every score is -inf). Either way, HF's tokens."""
    model = tiny_model("llama")
    kwargs = dict(input_ids=torch.tensor([[7, 8, 9]]), max_new_tokens=5, min_new_tokens=3, do_sample=False)
    reference = hf(model, prefix_allowed_tokens_fn=lambda b, sent: [EOS], **kwargs)
    patch(model, strict=True)
    assert torch.equal(model.generate(prefix_allowed_tokens_fn=lambda b, sent: [EOS], **kwargs), reference)


def test_an_empty_prefix_allowed_list_raises_hfs_error_naming_the_row():
    """The function allows nothing for one row: HF's ValueError, naming that row's batch ID (the
    engine's per-row processor alone would say 0)."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:3])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)

    def unsatisfiable(batch_id, sent):
        return [] if batch_id == 2 else [7, 8]

    with pytest.raises(ValueError) as reference:
        hf(model, prefix_allowed_tokens_fn=unsatisfiable, **kwargs)
    assert "batch ID 2" in str(reference.value)
    patch(model, strict=True)
    with pytest.raises(ValueError) as served:
        model.generate(prefix_allowed_tokens_fn=unsatisfiable, **kwargs)
    assert str(served.value) == str(reference.value)


def test_prefix_allowed_tokens_fn_with_copies_asks_each_row_as_hf_asks():
    """num_return_sequences copies: each row is asked with the batch index HF asks it with (5.24: its
    prompt's; 5.17: its own row's), and samples only what its answer allows."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:2])
    kwargs = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, num_return_sequences=3
    )

    def recorder(asked):
        def only(batch_id, sent):
            asked.add(batch_id)
            return [40 + batch_id, 50 + batch_id]

        return only

    by_hf, by_engine = set(), set()
    hf(model, prefix_allowed_tokens_fn=recorder(by_hf), **kwargs)
    patch(model, strict=True)
    out = model.generate(prefix_allowed_tokens_fn=recorder(by_engine), **kwargs)
    assert by_engine == by_hf and len(by_hf) in (2, 6)
    group = 6 // len(by_hf)
    for row, tokens in enumerate(out[:, ids.shape[1] :].tolist()):
        assert set(tokens) <= {40 + row // group, 50 + row // group}


def test_prefix_allowed_tokens_fn_on_a_prompt_list_asks_each_prompt_with_its_index():
    """hfaccel.generate's prompts are asked as the rows of one batched generate: prompt i with i, each
    constrained as that batch's row i would be (HF's greedy tokens for the batch)."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:3])
    reference = hf(model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                   prefix_allowed_tokens_fn=by_prompt)  # fmt: skip
    patch(model, strict=True)
    asked = set()

    def recording(batch_id, sent):
        asked.add(batch_id)
        return by_prompt(batch_id, sent)

    completions = hfaccel.generate(
        model,
        PROMPTS[:3],
        max_new_tokens=6,
        do_sample=False,
        prefix_allowed_tokens_fn=recording,
        progress=False,
    )
    assert asked == {0, 1, 2}
    assert [c.token_ids for c in completions] == reference[:, ids.shape[1] :].tolist()


def test_prefix_allowed_tokens_fn_with_beams_falls_back():
    model = patch(tiny_model("llama"))
    with pytest.warns(UserWarning, match="beam search with prefix_allowed_tokens_fn"):
        model.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=3, num_beams=2, prefix_allowed_tokens_fn=by_prompt
        )


def test_a_raising_custom_processor_fails_its_own_request_only():
    class Boom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise RuntimeError("boom")

    model = tiny_model("llama")
    engine = Engine(model, hfaccel.EngineConfig(kv_cache_memory=2_000_000, block_size=8))
    bad = engine.add_request(
        [5, 6, 7], StoppingParams(5), SamplingParams(processors=LogitsProcessorList([Boom()]))
    )
    good = engine.add_request([8, 9, 10], StoppingParams(5))
    engine.step()
    assert bad.is_finished and bad.finish_reason == "error" and str(bad.error) == "boom"
    while not good.is_finished:
        engine.step()
    assert good.finish_reason == "length" and len(good.output_token_ids) == 5
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    # Through model.generate, the call raises the processor's error and the model goes on generating.
    patch(model)
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, logits_processor=[Boom()])
    prompt = [5, 6, 7]
    assert torch.equal(
        model.generate(torch.tensor([prompt]), max_new_tokens=4),
        hf(model, inputs=torch.tensor([prompt]), max_new_tokens=4),
    )


@pytest.mark.parametrize("scheme", ["lefthash", "selfhash"])
def test_a_green_list_watermark_is_served_per_row_as_hf(scheme):
    """HF's WatermarkLogitsProcessor seeds each row's green list from that row's last tokens alone: run
    per row (left padding restored), it gives HF's tokens; SynthID's keeps per-batch state: HF's."""
    from transformers import SynthIDTextWatermarkingConfig

    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    watermark = {"bias": 2.5, "seeding_scheme": scheme, "context_width": 2}
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    expected = hf(model, watermarking_config=watermark, **kwargs)
    assert not torch.equal(expected, hf(model, **kwargs))  # the bias moves some argmax
    patch(model, strict=True)
    assert torch.equal(model.generate(watermarking_config=watermark, **kwargs), expected)
    synth_id = SynthIDTextWatermarkingConfig(keys=[3, 5, 7, 11], ngram_len=3)
    with pytest.raises(
        ValueError, match=r"does not serve watermarking_config \(SynthIDTextWatermarkingConfig\)"
    ):
        model.generate(watermarking_config=synth_id, **kwargs)


@pytest.mark.parametrize("option", [{"encoder_repetition_penalty": 3.0}, {"encoder_no_repeat_ngram_size": 1}])
def test_options_hf_builds_from_the_batch_prompts_run_as_each_row_of_that_batch(option):
    """HF builds the `encoder_*` processors from the padded batch's prompts and indexes them by row (5.24
    repeats them per copy; 5.17 reaches the first rows only): each engine row runs them as its row of
    that batch, so greedy rows and the copies of sampling at top_k=1 are HF's."""
    model = tiny_model("llama")
    ids, mask = left_padded([*PROMPTS[:4], [30, 31, 30, 31, 30, 142, 41]])  # greedy repeats 142 next
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10)
    modes = [dict(do_sample=False), dict(do_sample=True, top_k=1, num_return_sequences=2)]
    expected = [hf(model, **option, **kwargs, **mode) for mode in modes]
    assert not torch.equal(expected[0], hf(model, **kwargs, **modes[0]))  # the option moves some argmax
    patch(model, strict=True)
    for mode, reference in zip(modes, expected):
        assert torch.equal(model.generate(**option, **kwargs, **mode), reference), mode
    with pytest.raises(ValueError, match="encoder_no_repeat_ngram_size with beam search"):
        model.generate(**option, **kwargs, num_beams=2)


# ----------------------------------------------------------------- 2. custom stopping criteria


@pytest.mark.parametrize("family", FAMILIES)
def test_custom_stopping_criteria_stop_rows_as_hf(family):
    model = tiny_model(family)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    plain = hf(model, **kwargs)
    token = plain[1, ids.shape[1] + 3].item()  # a token row 1 produces after 4 steps
    cases = [
        StoppingCriteriaList([StopOnToken(token)]),
        [StopAtLength(ids.shape[1] + 5)],  # counts the padded width, as HF does
        StoppingCriteriaList([StopOnToken(token), StopAtLength(ids.shape[1] + 9)]),
    ]
    references = [hf(model, stopping_criteria=c, **kwargs) for c in cases]
    assert references[0].shape[1] < plain.shape[1] or not torch.equal(references[0], plain)
    patch(model)
    for criteria, reference in zip(cases, references):
        with no_fallback():
            out = model.generate(stopping_criteria=criteria, **kwargs)
        assert torch.equal(out, reference), criteria


def test_criteria_see_each_row_as_hf_shows_it_and_scores_only_when_kept():
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    theirs, ours = Recorder(), Recorder()
    hf(model, stopping_criteria=[theirs], **kwargs)
    patch(model)
    model.generate(stopping_criteria=[ours], **kwargs)
    assert ours.rows == theirs.rows  # the padded rows, prompt and tokens so far, at every step
    assert set(ours.scores) == {None} == set(theirs.scores)
    theirs, ours = Recorder(), Recorder()
    scored = dict(kwargs, return_dict_in_generate=True, output_scores=True)
    hf(model, stopping_criteria=[theirs], **scored)
    model.generate(stopping_criteria=[ours], **scored)
    vocab = model.config.vocab_size
    # HF's tuple holds every step's scores so far, [B, V] each; a row's call gets its own, [1, V] each.
    assert {n for n, _ in ours.scores} == {n for n, _ in theirs.scores} == set(range(1, 7))
    assert {shape for _, shape in theirs.scores} == {(len(PROMPTS), vocab)}
    assert {shape for _, shape in ours.scores} == {(1, vocab)}


def test_criteria_and_stop_strings_are_not_held_back_by_min_new_tokens():
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = hf(model, inputs=ids, max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    at = next(i for i, t in enumerate(plain) if 3 <= t < 98 and i >= 1)
    stop = tokenizer.decode([plain[at]])
    cases = [
        dict(stop_strings=[stop], tokenizer=tokenizer),
        dict(stopping_criteria=[StopOnToken(plain[at])]),
    ]
    references = [
        hf(model, inputs=ids, max_new_tokens=12, min_new_tokens=at + 3, do_sample=False, **c) for c in cases
    ]
    patch(model)
    for case, reference in zip(cases, references):
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=at + 3, do_sample=False, **case)
        assert torch.equal(out, reference), case
        assert out.shape[1] == 4 + at + 1


def test_a_stop_string_may_begin_in_the_prompt():
    # HF's StopStringCriteria matches over the whole row: a stop string the first new token completes,
    # begun by the prompt's last character, stops there.
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama")
    for text in ("Hello world", "abc", "stop here", "xyz", "0123"):  # a first new token that is a character
        ids = torch.tensor([tokenizer(text).input_ids])
        first = hf(model, inputs=ids, max_new_tokens=1, do_sample=False)[0, -1:].tolist()
        if 3 <= first[0] < 98:
            break
    stop = text[-1] + tokenizer.decode(first)
    kwargs = dict(max_new_tokens=10, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    reference = hf(model, inputs=ids, **kwargs)
    assert reference.shape[1] == ids.shape[1] + 1
    patch(model)
    assert torch.equal(model.generate(ids, **kwargs), reference)


def test_a_raising_criterion_raises_from_generate():
    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise ValueError("criterion boom")

    model = patch(tiny_model("llama"))
    with pytest.raises(ValueError, match="criterion boom"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, stopping_criteria=[Boom()])
    engine = model._hfaccel.engine
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_criteria_fall_back_where_hf_applies_them_otherwise():
    model = patch(tiny_model("llama"))
    ids, mask = left_padded(PROMPTS[:2])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    # A custom criterion of a type HF builds itself: HF uses it in place of its own.
    custom_eos = [EosTokenCriteria(eos_token_id=7)]
    with pytest.warns(UserWarning, match="a custom EosTokenCriteria in stopping_criteria"):
        out = model.generate(stopping_criteria=custom_eos, **kwargs)
    assert torch.equal(out, hf(model, stopping_criteria=custom_eos, **kwargs))
    # No EOS id: HF keeps generating a stopped row's tokens while another row runs.
    model.generation_config.eos_token_id = None
    plain = hf(model, **kwargs)
    criteria = [StopOnToken(plain[0, ids.shape[1] + 1].item())]
    with pytest.warns(UserWarning, match="stopping_criteria on a batch without an eos_token_id"):
        out = model.generate(stopping_criteria=criteria, **kwargs)
    assert torch.equal(out, hf(model, stopping_criteria=criteria, **kwargs))
    with pytest.warns(UserWarning, match="stop_strings on a batch without an eos_token_id"):
        model.generate(stop_strings=["x"], tokenizer=tiny_tokenizer(), **kwargs)
    # One row without EOS: stopping it stops the call, as in HF; served.
    with no_fallback():
        out = model.generate(
            stopping_criteria=criteria, input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=8
        )
    assert torch.equal(
        out,
        hf(model, stopping_criteria=criteria, input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=8),
    )


def test_max_time_is_served_and_stops_every_row_once_it_has_passed():
    """HF's MaxTimeCriteria, timed from the call's start, checked after each row's new token: with time
    to spare the tokens are HF's; with none left at the first check, every row stops after one token,
    as in HF; a call whose steps are slow stops early, every row, whatever max_new_tokens says."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    spare, spent = hf(model, max_time=600.0, **kwargs), hf(model, max_time=1e-9, **kwargs)
    assert spent.shape[1] == ids.shape[1] + 1 < spare.shape[1]
    patch(model, strict=True)
    assert torch.equal(model.generate(max_time=600.0, **kwargs), spare)
    assert torch.equal(model.generate(max_time=1e-9, **kwargs), spent)

    class Slow(LogitsProcessor):
        def __call__(self, input_ids, scores):
            threading.Event().wait(0.01)
            return scores

    prompts = [p for p in PROMPTS if p]
    completions = hfaccel.generate(
        model, prompts, max_new_tokens=200, max_time=0.3, logits_processor=[Slow()], progress=False
    )
    assert all(1 <= len(c.token_ids) < 200 for c in completions)
    engine = model._hfaccel.engine
    assert engine.block_manager.num_free_blocks == engine.num_blocks


# ----------------------------------------------------------------- 3. cache implementations, compile config


@pytest.mark.parametrize(
    "implementation", ["static", "sliding_window", "hybrid", "hybrid_chunked", "dynamic"]
)
def test_cache_implementations_with_the_default_numerics_are_served(implementation):
    model = tiny_model("qwen2")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    reference = hf(model, cache_implementation=implementation, **kwargs)
    assert torch.equal(reference, hf(model, **kwargs))
    patch(model)
    with no_fallback():
        out = model.generate(cache_implementation=implementation, **kwargs)
    assert torch.equal(out, reference)


def test_compile_config_is_served_with_the_engines_own_compile_settings():
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    reference = hf(model, **kwargs)
    patch(model)
    with no_fallback():
        out = model.generate(
            cache_implementation="static", compile_config=CompileConfig(fullgraph=False), **kwargs
        )
    assert torch.equal(out, reference)


def _stub_original(model):
    """Replace the original generate by a recorder: for fallbacks whose HF run is slow (paged) or needs
    what this machine lacks (optimum-quanto, CUDA)."""
    calls = []
    model._hfaccel.original_generate = lambda *args, **kwargs: calls.append(kwargs) or "hf"
    return calls


@pytest.mark.parametrize(
    ("implementation", "reason"),
    [
        ("quantized", r"cache_implementation='quantized' \(a quantized KV cache changes the numerics\)"),
        ("paged", r"cache_implementation='paged' \(transformers' own continuous batching\)"),
        ("offloaded", r"cache_implementation='offloaded' on cpu \(transformers offloads to CUDA only\)"),
        ("offloaded_static", r"cache_implementation='offloaded_static' on cpu"),
    ],
)
def test_cache_implementations_that_differ_fall_back(implementation, reason):
    model = patch(tiny_model("llama"))
    calls = _stub_original(model)
    with pytest.warns(UserWarning, match=reason):
        assert (
            model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, cache_implementation=implementation)
            == "hf"
        )
    assert calls[0]["cache_implementation"] == implementation


# ----------------------------------------------------------------- 4. position_ids, logits_to_keep


def test_position_ids_that_hf_would_compute_are_served():
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    reference = hf(model, **kwargs)
    cumsum = mask.long().cumsum(-1) - 1
    patch(model)
    for positions in (cumsum.masked_fill(mask == 0, 0), cumsum.masked_fill(mask == 0, 1), cumsum):
        assert torch.equal(hf(model, position_ids=positions, **kwargs), reference)
        with no_fallback():
            out = model.generate(position_ids=positions, **kwargs)
        assert torch.equal(out, reference)
    one = torch.tensor([[5, 6, 7, 8]])
    with no_fallback():
        out = model.generate(one, position_ids=torch.arange(4)[None], max_new_tokens=5)
    assert torch.equal(out, hf(model, inputs=one, max_new_tokens=5))


def test_other_position_ids_fall_back_naming_them():
    model = patch(tiny_model("llama"))
    ids, mask = left_padded(PROMPTS[:2])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0) + 5
    with pytest.warns(UserWarning, match=r"position_ids other than the attention mask's"):
        out = model.generate(position_ids=positions, **kwargs)
    assert torch.equal(out, hf(model, position_ids=positions, **kwargs))


def test_logits_to_keep_does_not_change_the_result():
    model = tiny_model("mistral")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    reference = hf(model, **kwargs)
    patch(model)
    for keep in (0, 1, 3):
        assert torch.equal(hf(model, logits_to_keep=keep, **kwargs), reference)
        with no_fallback():
            assert torch.equal(model.generate(logits_to_keep=keep, **kwargs), reference)
    calls = _stub_original(model)
    with pytest.warns(
        UserWarning, match=r"logits_to_keep=a tensor of shape \(1,\) \(only an int is served\)"
    ):
        model.generate(logits_to_keep=torch.tensor([0]), **kwargs)
    assert len(calls) == 1


# ----------------------------------------------------------------- 5. assisted decoding

REPEATS = [5, 6, 7, 8, 9, 10] * 3 + [5, 6]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_runs_on_the_engine_with_hfs_greedy_tokens(family):
    model = tiny_model(family)
    ids = torch.tensor([REPEATS])
    reference = hf(model, inputs=ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(
        hf(model, inputs=ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3), reference
    )
    patch(model)
    with no_fallback():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(out, reference)
    stats = model._hfaccel.engine.stats()
    assert stats["spec_drafted"] > 0
    # The engine itself does not speculate: the next call without prompt lookup drafts nothing.
    model.generate(ids, max_new_tokens=10, do_sample=False)
    assert model._hfaccel.engine.stats()["spec_drafted"] == stats["spec_drafted"]


def test_prompt_lookup_with_sampling_keeps_its_processors():
    model = patch(tiny_model("llama"))
    ids = torch.tensor([REPEATS])
    with no_fallback():
        out = model.generate(
            ids,
            max_new_tokens=12,
            do_sample=True,
            top_k=2,
            prompt_lookup_num_tokens=2,
            return_dict_in_generate=True,
        )
    assert out.sequences.shape == (1, len(REPEATS) + 12)


def test_the_engines_draft_model_serves_assistant_model():
    model = tiny_model("qwen2")
    draft = tiny_model("qwen2", layers=1, seed=3)
    ids = torch.tensor([REPEATS])
    reference = hf(model, inputs=ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(
        hf(model, inputs=ids, max_new_tokens=16, do_sample=False, assistant_model=draft), reference
    )
    patch(model, speculative=draft, num_speculative_tokens=3)
    with no_fallback():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft)
    assert torch.equal(out, reference)
    assert model._hfaccel.engine.stats()["spec_drafted"] > 0
    # Another assistant (the model itself, as in transformers' tests) does not draft: the engine serves
    # the call with its own speculation, HF's tokens, one warning per model.
    drafted = model._hfaccel.engine.stats()["spec_drafted"]
    patch(model)  # no draft model: nothing drafts
    for other in (tiny_model("qwen2", layers=1, seed=4), model):
        with pytest.warns(UserWarning, match=r"assistant_model is not the engine's draft model"):
            out = model.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=other)
        assert torch.equal(out, reference)
        model._hfaccel.warned.clear()
    assert drafted > 0


def test_assisted_decoding_falls_back_where_hf_refuses_or_differs():
    model = patch(tiny_model("llama"))
    ids, mask = left_padded(PROMPTS[:2])
    with (
        pytest.warns(
            UserWarning, match=r"assisted decoding \(prompt_lookup_num_tokens\) on a batch of 2 rows"
        ),
        pytest.raises(ValueError, match="batch_size = 1"),
    ):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, prompt_lookup_num_tokens=2)
    one = torch.tensor([REPEATS])
    with (
        pytest.warns(UserWarning, match=r"with num_return_sequences > 1 \(transformers refuses it\)"),
        pytest.raises(ValueError, match="num_return_sequences has to be 1"),
    ):
        model.generate(
            one, max_new_tokens=4, prompt_lookup_num_tokens=2, num_return_sequences=2, do_sample=True
        )
    with pytest.warns(UserWarning, match=r"with stop_strings, stopping_criteria or max_time"):
        out = model.generate(
            one, max_new_tokens=6, prompt_lookup_num_tokens=2, stopping_criteria=[StopAtLength(30)]
        )
    assert torch.equal(
        out,
        hf(
            model,
            inputs=one,
            max_new_tokens=6,
            prompt_lookup_num_tokens=2,
            stopping_criteria=[StopAtLength(30)],
        ),
    )
    calls = _stub_original(model)
    with pytest.warns(
        UserWarning, match=r"assisted decoding \(prompt_lookup_num_tokens\) with use_cache=False"
    ):
        model.generate(one, max_new_tokens=4, prompt_lookup_num_tokens=2, use_cache=False)
    with pytest.warns(UserWarning, match=r"with cache_implementation='static' \(transformers refuses it\)"):
        model.generate(one, max_new_tokens=4, prompt_lookup_num_tokens=2, cache_implementation="static")
    with pytest.warns(UserWarning, match=r"assistant_ensemble_weight \(assisted decoding\)"):
        model.generate(one, max_new_tokens=4, prompt_lookup_num_tokens=2, assistant_ensemble_weight=0.5)
    other_vocab = tiny_model("llama", layers=1)
    other_vocab.resize_token_embeddings(300)
    with pytest.warns(UserWarning, match=r"assistant_model with another vocabulary"):
        model.generate(one, max_new_tokens=4, assistant_model=other_vocab)
    with pytest.warns(UserWarning, match=r"max_matching_ngram_size=-1 \(transformers refuses it\)"):
        model.generate(one, max_new_tokens=4, prompt_lookup_num_tokens=2, max_matching_ngram_size=-1)
    assert len(calls) == 5


def test_assisted_decoding_of_embeddings_or_over_a_given_cache_is_hfs():
    """transformers' assisted path gives other tokens than its plain decoding for a prompt given as
    inputs_embeds (it re-embeds the ids) and over a cache passed in (it feeds the prompt again): such
    calls run there, for its results."""
    from transformers import DynamicCache

    model = patch(tiny_model("llama"))
    one = torch.tensor([REPEATS])
    embeds = model.get_input_embeddings()(one).detach()

    def cache():
        given = DynamicCache(config=model.config)
        with torch.no_grad():
            model(one[:, :-1], past_key_values=given, use_cache=True)
        return given

    for given, reason in (
        (lambda: {"inputs_embeds": embeds}, "of a prompt given as inputs_embeds"),
        (lambda: {"past_key_values": cache()}, "with a cache given"),
    ):
        ask = dict(max_new_tokens=6, prompt_lookup_num_tokens=2)
        expected = hf(model, inputs=one, **ask, **given())
        with pytest.warns(UserWarning, match=f"assisted decoding \\(prompt_lookup_num_tokens\\) {reason}"):
            assert torch.equal(model.generate(one, **ask, **given()), expected)


def test_speculation_on_a_padded_batch_shows_processors_the_padded_row():
    """With the engine speculating (patch(speculative="ngram")), verification runs the processors on
    each draft position with the row's left padding before it, as decoding one token at a time does."""
    model = tiny_model("llama")
    prompts = [REPEATS, REPEATS[:9], [30, 31, 30, 31, 30, 31]]
    ids, mask = left_padded(prompts)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    cases = [
        dict(no_repeat_ngram_size=3),
        dict(logits_processor=LogitsProcessorList([BoostByLength()])),
        dict(exponential_decay_length_penalty=(2, 1.5)),
    ]
    references = [hf(model, **kwargs, **c) for c in cases]
    patch(model, speculative="ngram", num_speculative_tokens=3)
    for case, reference in zip(cases, references):
        assert torch.equal(model.generate(**kwargs, **case), reference), case
    assert model._hfaccel.engine.stats()["spec_drafted"] > 0


# ----------------------------------------------------------------- concurrency


def test_concurrent_callers_keep_their_own_options():
    """Calls with their own processors, criteria and prompt lookup share the engine's steps; each gets
    HF's result for its own options."""
    model = tiny_model("llama")
    prompts = varied_prompts(4, seed=11)
    calls = [
        dict(logits_processor=[BanAfterLast()]),
        dict(stopping_criteria=[StopAtLength(len(prompts[1]) + 3)]),
        dict(prompt_lookup_num_tokens=2),
        dict(),
    ]
    references = [
        hf(model, inputs=torch.tensor([p]), max_new_tokens=10, do_sample=False, **c)
        for p, c in zip(prompts, calls)
    ]
    patch(model)
    results = [None] * 4
    barrier = threading.Barrier(4)

    def run(i):
        barrier.wait()
        results[i] = model.generate(
            torch.tensor([prompts[i]]), max_new_tokens=10, do_sample=False, **calls[i]
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result, reference in zip(results, references):
        assert torch.equal(result, reference)


def test_values_hf_accepts_at_the_edge_are_served_as_hf_serves_them():
    # top_p=0 keeps the top token (HF's warper keeps at least one); num_return_sequences=0 is one copy.
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    greedy = hf(model, inputs=ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(hf(model, inputs=ids, max_new_tokens=5, do_sample=True, top_p=0.0), greedy)
    assert torch.equal(
        hf(model, inputs=ids, max_new_tokens=5, do_sample=False, num_return_sequences=0), greedy
    )
    patch(model)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=True, top_p=0.0), greedy)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, num_return_sequences=0), greedy)


@pytest.mark.parametrize("shape", [(1, 0), (0, 4)])
def test_an_empty_input_is_refused_naming_it(shape):
    model = patch(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"input_ids has shape .*at least one prompt of at least one token"):
        model.generate(torch.zeros(shape, dtype=torch.long), max_new_tokens=3)


def test_a_call_asking_transformers_to_compile_its_forward_goes_to_transformers():
    """An explicit `compile_config` with a static cache, where HF honours it (an accelerator, or forced
    on every device as transformers' own tests do), asks for HF's compiled forward: HF serves it."""
    from transformers import CompileConfig, GenerationConfig

    from hfaccel.patches.params import unsupported_reason

    forced = CompileConfig()
    forced._compile_all_devices = True
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    static = {"cache_implementation": "static"}
    reason = "compile_config with a static cache"
    assert reason in unsupported_reason(GenerationConfig(compile_config=forced, **static), device=cpu)
    assert reason in unsupported_reason(
        GenerationConfig(compile_config=CompileConfig(), **static), device=cuda
    )
    # HF compiles nothing here: a CPU without the flag, a dynamic cache, or compiling turned off
    assert unsupported_reason(GenerationConfig(compile_config=CompileConfig(), **static), device=cpu) is None
    assert unsupported_reason(GenerationConfig(compile_config=forced), device=cpu) is None
    off = GenerationConfig(compile_config=forced, disable_compile=True, **static)
    assert unsupported_reason(off, device=cpu) is None


def test_a_static_cache_returned_is_hfs_class_and_size_sliding_layers_included():
    """HF returns a `StaticCache` sized by its max_length, `max_cache_len` and the size of the model's
    previous static cache (kept on the model): the engine returns the same. A sliding layer rolls its
    window as tokens come in; the engine's keys go in as HF's generate puts them, so the window holds
    the same tokens in the same places (a prompt and new tokens longer than the window of 8)."""
    from transformers import StaticCache

    from hfaccel.patches.arguments import CACHE_NAME
    from tests.patches.test_masks_and_windows import _windowed_model

    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, min_new_tokens=4, do_sample=False)
    kwargs.update(cache_implementation="static", return_dict_in_generate=True)
    calls = [{"max_new_tokens": 6}, {"max_new_tokens": 3}, {"max_new_tokens": 3, "max_cache_len": 40}]
    expected = [hf(model, **kwargs, **extra) for extra in calls]
    del model._previous_max_cache_length  # HF's state between calls: the engine keeps it the same way
    patch(model)
    with no_fallback():
        out = [model.generate(**kwargs, **extra) for extra in calls]
    for ours, theirs in zip(out, expected):
        assert torch.equal(ours.sequences, theirs.sequences)
        ours, theirs = getattr(ours, CACHE_NAME), getattr(theirs, CACHE_NAME)
        assert isinstance(ours, StaticCache)
        assert [layer.keys.shape for layer in ours.layers] == [layer.keys.shape for layer in theirs.layers]
        width = ids.shape[1] + 2  # row 1 has no padding: the prompt's positions and the new tokens'
        torch.testing.assert_close(ours.layers[0].keys[1, :, :width], theirs.layers[0].keys[1, :, :width])
    windowed = _windowed_model(window=8)
    expected = hf(windowed, **kwargs, max_new_tokens=6)
    del windowed._previous_max_cache_length
    patch(windowed)
    with no_fallback():
        out = windowed.generate(**kwargs, max_new_tokens=6)
    assert torch.equal(out.sequences, expected.sequences)
    ours, theirs = getattr(out, CACHE_NAME), getattr(expected, CACHE_NAME)
    assert isinstance(ours, StaticCache) and ours.is_sliding == theirs.is_sliding == [True, True]
    for mine, hfs in zip(ours.layers, theirs.layers):
        assert mine.keys.shape == hfs.keys.shape and mine.cumulative_length_int == hfs.cumulative_length_int
        torch.testing.assert_close(mine.keys[1], hfs.keys[1])  # row 1: no padding
        torch.testing.assert_close(mine.values[1], hfs.values[1])


def test_a_stopping_criterion_answering_for_more_rows_than_it_was_given_is_an_error():
    """HF's contract is one bool per row; a criterion that answers for a fixed batch (here 5 rows) was
    read as "any of them", for each row alone, silently. HF's generate fails on it too."""

    class FiveRows(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([False, False, True, False, False])

    model = hfaccel.patch(tiny_model())
    try:
        with pytest.raises(ValueError, match=r"a stopping criterion returned a tensor of shape \(5,\)"):
            model.generate(
                torch.tensor([[5, 6, 7]]),
                max_new_tokens=4,
                stopping_criteria=StoppingCriteriaList([FiveRows()]),
            )
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("lengths", [{"max_new_tokens": 4.0}, {"max_length": 16.0}])
def test_whole_float_lengths_are_served_as_hf_serves_them(lengths):
    """``max_new_tokens=4.0`` (a length computed in floats): HF generates 4 tokens, and so does the
    engine; a fractional one is refused, naming it (HF's result there is an accident of comparing)."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:2])
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    reference = hf(model, **lengths, **kwargs)
    patch(model, strict=True)
    assert torch.equal(model.generate(**lengths, **kwargs), reference)
    name = next(iter(lengths))
    with pytest.raises(ValueError, match=f"{name} must be an integer, got 4.5"):
        model.generate(**{name: 4.5}, **kwargs)


@pytest.mark.parametrize("as_given", [np.int64, torch.tensor], ids=["numpy", "tensor"])
def test_integer_scalars_of_numpy_and_torch_are_served_as_ints(as_given):
    """``num_beams=np.int64(3)`` (a value read from an array): HF takes it, so does the engine (its beam
    search refused it as not a positive integer)."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:2])
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    given = dict(num_beams=as_given(3), max_new_tokens=as_given(4))
    reference = hf(model, **given, **kwargs)
    patch(model, strict=True)
    assert torch.equal(model.generate(**given, **kwargs), reference)
    one = torch.tensor([REPEATS])  # prompt lookup's integers too (it fell back: "transformers refuses it")
    lookup = dict(max_new_tokens=6, prompt_lookup_num_tokens=as_given(2), max_matching_ngram_size=as_given(2))
    assert torch.equal(model.generate(one, **lookup), hf(model, inputs=one, **lookup))


def test_a_bool_for_an_integer_is_the_int_it_is_for_transformers():
    """``num_return_sequences=True`` gives HF one sequence (it reached torch's repeat_interleave as a
    bool: a TypeError)."""
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS[:2])
    kwargs = dict(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, num_return_sequences=True
    )
    reference = hf(model, **kwargs)
    patch(model, strict=True)
    assert torch.equal(model.generate(**kwargs), reference)
    results = hfaccel.generate(
        model, PROMPTS[:1], max_new_tokens=3, num_return_sequences=True, progress=False
    )
    assert len(results) == 1 and len(results[0].token_ids) == 3
