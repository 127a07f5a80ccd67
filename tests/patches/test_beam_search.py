"""`model.generate(num_beams=n)` on the engine equals unpatched HF beam search (float32 tiny models, left
padded batches of different lengths, EOS hit early, length penalties, early stopping variants,
num_return_sequences, processors); what the engine does not serve falls back with one warning."""

import warnings

import pytest
import torch

import hfaccel
from tests.helpers import hf, left_padded, tiny_model, varied_prompts

PROMPTS = [[5, 6, 7], [9] * 12, [11, 12, 13, 14, 15, 16, 17], [20], list(range(30, 67))]


def likely_tokens(model, ids, mask):
    """The first greedy tokens of the batch: EOS ids that end searches early."""
    with torch.no_grad():
        out = type(model).generate(
            model, input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False
        )
    return sorted(set(out[:, -1].tolist()))


CASES = {
    "plain": lambda t: {"num_beams": 4, "max_new_tokens": 10},
    "eos_three_returned": lambda t: {
        "num_beams": 3,
        "max_new_tokens": 12,
        "eos_token_id": t[0],
        "num_return_sequences": 3,
    },
    "early_true_penalty_2": lambda t: {
        "num_beams": 4,
        "max_new_tokens": 12,
        "eos_token_id": t[-1],
        "length_penalty": 2.0,
        "early_stopping": True,
        "num_return_sequences": 2,
    },
    "never_negative_penalty": lambda t: {
        "num_beams": 2,
        "max_new_tokens": 9,
        "eos_token_id": t[0],
        "early_stopping": "never",
        "length_penalty": -0.5,
    },
    "never_zero_penalty": lambda t: {
        "num_beams": 3,
        "max_new_tokens": 8,
        "eos_token_id": t[1],
        "early_stopping": "never",
        "length_penalty": 0.0,
        "num_return_sequences": 3,
    },
    "processors_min_new_tokens": lambda t: {
        "num_beams": 3,
        "max_new_tokens": 8,
        "repetition_penalty": 3.0,
        "no_repeat_ngram_size": 2,
        "min_new_tokens": 3,
        "eos_token_id": t[0],
    },
    "two_eos_ids": lambda t: {"num_beams": 2, "max_new_tokens": 10, "eos_token_id": [t[0], t[1]]},
    # Fewer allowed tokens than beams at the first step: the search continues from HF's -1e9 copies of
    # the prompt (the engine raised IndexError there).
    "forced_eos_first_step": lambda t: {"num_beams": 2, "max_new_tokens": 1, "forced_eos_token_id": t[0]},
    "fewer_tokens_than_beams": lambda t: {
        "num_beams": 5,
        "max_new_tokens": 4,
        "suppress_tokens": list(range(3, 256)),
    },
}


HITS_EOS = {"eos_three_returned", "never_zero_penalty", "two_eos_ids"}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("case", CASES)
def test_beam_search_equals_hf(family, case):
    model = tiny_model(family)
    ids, mask = left_padded(PROMPTS)
    kwargs = {"do_sample": False, **CASES[case](likely_tokens(model, ids, mask))}
    with torch.no_grad():
        reference = type(model).generate(model, input_ids=ids, attention_mask=mask, **kwargs)
    hfaccel.patch(model, kv_cache_memory=2_000_000, block_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served: no fallback warning
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert out.shape == reference.shape and torch.equal(out, reference)
    eos = kwargs.get("eos_token_id")
    if case in HITS_EOS:  # hypotheses that end in EOS, shorter than max_new_tokens: early stops served
        eos_ids = eos if isinstance(eos, list) else [eos]
        assert bool(torch.isin(out[:, ids.shape[1] : -1], torch.tensor(eos_ids)).any())
    engine = model._hfaccel.engine
    assert engine.block_manager.num_used_blocks == 0 and engine.scheduler.live == {}


def test_beams_run_beside_other_calls_and_share_the_cache():
    """Beam calls in threads beside greedy ones: every result is its own call's HF result."""
    import threading

    model = tiny_model()
    ids, mask = left_padded(PROMPTS[:3])
    beam_kwargs = {"num_beams": 3, "max_new_tokens": 8, "num_return_sequences": 2, "do_sample": False}
    with torch.no_grad():
        ref_beams = type(model).generate(model, input_ids=ids, attention_mask=mask, **beam_kwargs)
        ref_greedy = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=8)
    hfaccel.patch(model, kv_cache_memory=2_000_000, block_size=4)
    results = {}

    def call(name, kwargs):
        results[name] = model.generate(input_ids=ids, attention_mask=mask, **kwargs)

    threads = [
        threading.Thread(target=call, args=("beams", beam_kwargs)),
        threading.Thread(target=call, args=("greedy", {"max_new_tokens": 8})),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(results["beams"], ref_beams) and torch.equal(results["greedy"], ref_greedy)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"num_beam_groups": 2, "diversity_penalty": 1.0}, "group_beam_search"),
        ({"force_words_ids": [[7]]}, "constrained_beam_search"),
        ({"max_time": 5.0}, "max_time"),
    ],
)
def test_what_the_engine_does_not_serve_falls_back_with_a_warning(kwargs, reason):
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7]])
    hfaccel.patch(model, kv_cache_memory=2_000_000, strict=True)
    with pytest.raises(ValueError, match=reason):
        model.generate(ids, num_beams=2, max_new_tokens=3, **kwargs)
    hfaccel.patch(model, strict=False)
    calls = []
    model._hfaccel.original_generate = lambda *a, **k: calls.append(k) or "HF's result"
    with pytest.warns(UserWarning, match=reason):
        assert model.generate(ids, num_beams=2, max_new_tokens=3, **kwargs) == "HF's result"
    assert calls and calls[0]["num_beams"] == 2


DICT = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True, "do_sample": False}


def _hf_and_patched(model, ids, mask, kwargs):
    with torch.no_grad():
        reference = type(model).generate(model, input_ids=ids, attention_mask=mask, **kwargs)
    hfaccel.patch(model, kv_cache_memory=2_000_000, block_size=4, strict=True)  # a fallback would raise
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        engine = model._hfaccel.engine
        assert engine.block_manager.num_used_blocks == 0 and engine.scheduler.live == {}
    finally:
        hfaccel.unpatch(model)
    return reference, out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("holes", [False, True])
def test_beam_search_dict_output_equals_hf(family, holes):
    """``return_dict_in_generate`` with beams: sequences, sequences_scores, beam_indices, every step's
    scores and logits, and the cache of the final running beams are HF's (no EOS: every prompt's search
    runs to max_new_tokens, as HF's does). With holes in the mask, each prompt's kept tokens sit in their
    columns of the cache."""
    model = tiny_model(family)
    ids, mask = left_padded(PROMPTS[:3])
    if holes:
        mask[0, -2] = 0
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 6, "eos_token_id": None, **DICT}
    reference, out = _hf_and_patched(model, ids, mask, kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.beam_indices, reference.beam_indices)
    assert out.beam_indices.dtype == reference.beam_indices.dtype
    torch.testing.assert_close(out.sequences_scores, reference.sequences_scores, rtol=1e-4, atol=1e-4)
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == len(getattr(reference, name)) == 6
        for mine, theirs in zip(getattr(out, name), getattr(reference, name)):
            assert mine.shape == theirs.shape == (9, model.config.vocab_size)
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    mine, theirs = out.past_key_values, reference.past_key_values
    kept = mask.repeat_interleave(3, dim=0).bool()
    for layer in range(model.config.num_hidden_layers):
        for a, b in (
            (mine.layers[layer].keys, theirs.layers[layer].keys),
            (mine.layers[layer].values, theirs.layers[layer].values),
        ):
            assert a.shape == b.shape
            torch.testing.assert_close(
                a[:, :, : ids.shape[1]][kept[:, None, :].expand(-1, a.shape[1], -1)],
                b[:, :, : ids.shape[1]][kept[:, None, :].expand(-1, a.shape[1], -1)],
                rtol=1e-4,
                atol=1e-4,
            )
            torch.testing.assert_close(a[:, :, ids.shape[1] :], b[:, :, ids.shape[1] :], rtol=1e-4, atol=1e-4)


def test_beam_search_dict_output_with_prompts_ending_apart():
    """Prompts whose searches end at different steps (EOS): sequences, sequences_scores and beam_indices
    are HF's; each prompt's scores are HF's until its search ended, -inf after it (HF goes on stepping
    it), with a warning saying so."""
    model = tiny_model()
    ids, mask = left_padded(PROMPTS)
    eos = likely_tokens(model, ids, mask)[0]
    kwargs = {"num_beams": 3, "max_new_tokens": 12, "eos_token_id": eos, "use_cache": False, **DICT}
    with pytest.warns(UserWarning, match="finished at different steps"):
        reference, out = _hf_and_patched(model, ids, mask, kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.beam_indices, reference.beam_indices)
    torch.testing.assert_close(out.sequences_scores, reference.sequences_scores, rtol=1e-4, atol=1e-4)
    assert len(out.scores) == len(reference.scores) and out.past_key_values is None
    stopped = 0
    for mine, theirs in zip(out.scores, reference.scores):
        ran = ~torch.isinf(mine).all(dim=-1)
        stopped += int((~ran).sum())
        torch.testing.assert_close(mine[ran], theirs[ran], rtol=1e-4, atol=1e-4)
    assert stopped > 0  # some prompt's search did end early


def test_beam_sampling_runs_on_the_engine_reproducibly():
    """HF's beam sampling: K candidates drawn from the softmax of the accumulated scores (after the
    warpers), sorted. Cold (temperature 0.01) it is beam search; seeded, it reproduces; it samples."""
    model = tiny_model()
    ids, mask = left_padded(varied_prompts(3, seed=4))
    beams = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 8}
    search = hf(model, input_ids=ids, attention_mask=mask, do_sample=False, **beams)
    hfaccel.patch(model, kv_cache_memory=2_000_000, strict=True)  # strict: a fallback would raise
    try:
        cold = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.01, **beams)
        assert torch.equal(cold, search)
        draws = []
        for seed in (5, 5, 6):
            torch.manual_seed(seed)
            draws.append(model.generate(input_ids=ids, attention_mask=mask, do_sample=True, **beams))
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert not torch.equal(draws[0], search)


def test_a_beam_search_past_the_context_falls_back():
    model = tiny_model(max_positions=64)
    ids = torch.tensor([list(range(3, 60))])
    with torch.no_grad():
        reference = type(model).generate(model, ids, num_beams=2, max_new_tokens=10, do_sample=False)
    hfaccel.patch(model, kv_cache_memory=2_000_000)
    with pytest.warns(UserWarning, match="beam search past the model's context"):
        out = model.generate(ids, num_beams=2, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, reference)


def test_hfaccel_generate_runs_beam_search_on_the_engine():
    """`hfaccel.generate` plans a beam-search prompt as one engine request whose hypotheses, best first,
    are its completions: HF's hypotheses, no fallback."""
    model = tiny_model()
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 5}
    with torch.no_grad():
        reference = type(model).generate(model, torch.tensor([[5, 6, 7]]), do_sample=False, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        completions = hfaccel.generate(model, [[5, 6, 7]], progress=False, **kwargs)
    assert [c.token_ids for c in completions] == [row[3:].tolist() for row in reference]
