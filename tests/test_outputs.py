"""What `hfaccel.generate` returns besides tokens: log-probabilities, prompt log-probabilities, metrics on
every completion, and the grouping of num_return_sequences copies."""

import asyncio
import math
import warnings

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import hfaccel
from tests.helpers import EOS, FAMILIES, assert_same_or_near_tie, hf, hf_greedy, tiny_model, varied_prompts

METRIC_KEYS = {
    "queue_s",
    "ttft_s",
    "tpot_s",
    "itl_max_s",
    "e2e_s",
    "num_cached_prompt_tokens",
    "num_preemptions",
}


def hf_scores(model, prompt, max_new_tokens, **kwargs):
    """Unpatched HF greedy: the new tokens and each step's processed scores."""
    with torch.no_grad():
        out = type(model).generate(
            model,
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences[0, len(prompt) :].tolist(), [s[0] for s in out.scores]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_top_logprobs_match_hf_scores(family):
    model = tiny_model(family)
    prompts = varied_prompts(4, seed=3)
    kwargs = {"max_new_tokens": 6, "repetition_penalty": 1.3}
    completions = hfaccel.generate(model, prompts, logprobs=3, progress=False, **kwargs)
    for prompt, completion in zip(prompts, completions):
        tokens, scores = hf_scores(model, prompt, **kwargs)
        assert completion.token_ids == tokens
        assert len(completion.top_logprobs) == len(tokens) == len(completion.logprobs)
        for token, lp, top, score in zip(tokens, completion.logprobs, completion.top_logprobs, scores):
            reference = torch.log_softmax(score.float(), dim=-1)
            values, ids = reference.topk(3)
            assert list(top)[:3] == ids.tolist(), "most likely first"
            assert token in top and top[token] == lp, "the chosen token is always there"
            for token_id, value in top.items():
                assert math.isclose(value, float(reference[token_id]), abs_tol=1e-4)
            assert len(top) == 3 + (token not in ids.tolist())


def test_a_call_that_falls_back_still_gives_the_logprobs_asked_for():
    """A call transformers serves (a forward hook here) gives its tokens' logprobs from HF's processed
    scores, as the engine gives them; a stream too. Beam results carry none, like the engine's."""
    model = hfaccel.patch(tiny_model("llama"))
    prompts = varied_prompts(2, seed=5)
    kwargs = {"max_new_tokens": 5, "repetition_penalty": 1.3}
    served = hfaccel.generate(model, prompts, logprobs=2, progress=False, **kwargs)
    hook = model.model.layers[0].register_forward_hook(lambda *args: None)
    try:
        with pytest.warns(UserWarning, match="falls back"):
            fallen = hfaccel.generate(model, prompts, logprobs=2, progress=False, **kwargs)
        events = list(hfaccel.stream(model, prompts[:1], logprobs=True, **kwargs))
    finally:
        hook.remove()
    for engine, hf_run in zip(served, fallen):
        assert hf_run.token_ids == engine.token_ids
        assert hf_run.logprobs == pytest.approx(engine.logprobs, abs=1e-4)
        assert [list(t) for t in hf_run.top_logprobs] == [list(t) for t in engine.top_logprobs]
    assert [e.logprob for e in events] == pytest.approx(served[0].logprobs, abs=1e-4)
    beams = hfaccel.generate(model, prompts[:1], logprobs=2, num_beams=2, progress=False, max_new_tokens=3)
    assert beams[0].logprobs is None and beams[0].top_logprobs is None
    hfaccel.unpatch(model)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_prompt_logprobs_of_a_long_prompt_are_computed_a_slice_at_a_time(family, monkeypatch):
    """Past the logits budget a prompt's logprobs come a slice of positions per forward (`logits_to_keep`):
    the same values as one forward (Gemma 2: its final soft-capping applies to every slice)."""
    from hfaccel.api import results
    from hfaccel.bench.families import family_model

    model = tiny_model("llama") if family == "llama" else family_model("gemma2")
    prompt = max(varied_prompts(16, seed=5), key=len)[:23]
    assert len(prompt) > 10, "the prompt must take several slices"
    whole = results.prompt_logprobs_of(model, prompt, 2)
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(results, "LOGITS_BUDGET_BYTES", 4 * vocab * 5)  # 5 positions a forward
    sliced = results.prompt_logprobs_of(model, prompt, 2)
    assert len(sliced) == len(whole) == len(prompt) and sliced[0] is None
    for a, b in zip(whole[1:], sliced[1:]):
        assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=1e-5) for t in a)


def test_logprobs_true_keeps_the_chosen_token_only_and_zero_gives_dicts_of_one():
    model = tiny_model()
    plain = hfaccel.generate(model, [[5, 6, 7]], logprobs=True, max_new_tokens=4, progress=False)[0]
    assert plain.top_logprobs is None and len(plain.logprobs) == 4
    zero = hfaccel.generate(model, [[5, 6, 7]], logprobs=0, max_new_tokens=4, progress=False)[0]
    assert zero.top_logprobs == [{t: lp} for t, lp in zip(zero.token_ids, zero.logprobs)]
    assert zero.logprobs == plain.logprobs
    off = hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=4, progress=False)[0]
    assert off.logprobs is None and off.top_logprobs is None and off.prompt_logprobs is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prompt_logprobs_match_a_plain_forward(family):
    model = tiny_model(family)
    prompts = varied_prompts(5, seed=4)
    completions = hfaccel.generate(
        model,
        prompts,
        prompt_logprobs=2,
        max_new_tokens=2,
        num_return_sequences=2,
        do_sample=True,
        progress=False,
    )
    for c in completions:
        prompt = prompts[c.prompt_index]
        assert len(c.prompt_logprobs) == len(prompt) and c.prompt_logprobs[0] is None
        with torch.no_grad():
            reference = torch.log_softmax(
                type(model).forward(model, torch.tensor([prompt])).logits[0].float(), -1
            )
        for position in range(1, len(prompt)):
            entry = c.prompt_logprobs[position]
            token = prompt[position]
            assert token in entry and len(entry) in (2, 3)
            assert math.isclose(entry[token], float(reference[position - 1, token]), abs_tol=1e-4)
            assert set(reference[position - 1].topk(2).indices.tolist()) <= set(entry)
    copies = hfaccel.group_by_prompt(completions)
    assert all(group[0].prompt_logprobs is group[1].prompt_logprobs for group in copies), (
        "one forward per prompt"
    )


def test_stream_events_carry_logprobs():
    model = tiny_model()
    prompts = varied_prompts(3, seed=5)
    reference = hfaccel.generate(model, prompts, logprobs=2, max_new_tokens=5, progress=False)
    events = list(hfaccel.stream(model, prompts, logprobs=2, max_new_tokens=5))

    async def collect():
        return [e async for e in hfaccel.astream(model, prompts, logprobs=True, max_new_tokens=5)]

    async_events = asyncio.run(collect())
    for index, completion in enumerate(reference):
        mine = [e for e in events if e.index == index]
        assert [e.logprob for e in mine] == completion.logprobs
        assert [e.top_logprobs for e in mine] == completion.top_logprobs
        assert {e.prompt_index for e in mine} == {index}
        theirs = [e for e in async_events if e.index == index]
        assert [e.logprob for e in theirs] == completion.logprobs and theirs[0].top_logprobs is None
    assert all(e.logprob is None for e in hfaccel.stream(model, prompts, max_new_tokens=2))


def test_every_completion_has_metrics_fallbacks_and_refusals_included():
    model = tiny_model()
    prompts = [[5, 6, 7], [], [8, 9]]
    completions = hfaccel.generate(model, prompts, max_new_tokens=3, errors="return", progress=False)
    served, refused, _ = completions
    assert all(set(c.metrics) == METRIC_KEYS for c in completions)
    assert served.metrics["e2e_s"] > 0 and served.metrics["num_preemptions"] == 0
    assert all(v is None for v in refused.metrics.values())
    with pytest.warns(UserWarning, match="output_attentions"):
        sampled_beams = hfaccel.generate(
            model,
            [[5, 6, 7]],
            output_attentions=True,
            return_dict_in_generate=True,
            max_new_tokens=3,
            progress=False,
        )
    assert set(sampled_beams[0].metrics) == METRIC_KEYS and sampled_beams[0].metrics["e2e_s"] > 0
    assert sampled_beams[0].metrics["ttft_s"] is None, "transformers' generate does not say"
    beams = hfaccel.generate(
        model, [[5, 6, 7]], num_beams=2, max_new_tokens=3, progress=False
    )  # the engine's
    assert set(beams[0].metrics) == METRIC_KEYS and beams[0].metrics["ttft_s"] is not None


def test_group_by_prompt_groups_the_copies_in_order():
    model = tiny_model()
    prompts = varied_prompts(4, seed=6)
    completions = hfaccel.generate(
        model, prompts, num_return_sequences=3, do_sample=True, max_new_tokens=4, seed=1, progress=False
    )
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    groups = hfaccel.group_by_prompt(completions)
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    for prompt, group in zip(prompts, groups):
        assert all(c.prompt_token_ids == prompt for c in group)
    assert hfaccel.group_by_prompt([]) == []


@pytest.mark.parametrize("copies", [1, 3])
def test_a_refused_prompt_gives_n_error_results_in_its_place(copies):
    model = tiny_model()
    prompts = [[5, 6, 7], [5] * 600, [8, 9]]
    kwargs = {"num_return_sequences": copies, "do_sample": True, "max_new_tokens": 3, "seed": 0}
    returned = hfaccel.generate(model, prompts, errors="return", progress=False, **kwargs)
    assert len(returned) == 3 * copies
    assert [c.prompt_index for c in returned] == [i for i in range(3) for _ in range(copies)]
    assert [c.finish_reason == "error" for c in returned] == [i == 1 for i in range(3) for _ in range(copies)]
    for c in returned:
        if c.prompt_index != 1:
            assert c.prompt_token_ids == prompts[c.prompt_index]
    with pytest.raises(hfaccel.RequestError) as info:
        hfaccel.generate(model, prompts, progress=False, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{copies} of {3 * copies} requests refused, the others completed")
    assert "prompts[1]: prompt has 600 tokens" in message and message.count("prompts[") == 1
    # an invalid generation argument in one prompt's config, too
    configs = [
        GenerationConfig(max_new_tokens=2, num_return_sequences=copies, do_sample=True) for _ in range(2)
    ]
    configs[0].temperature = -1.0
    mixed = hfaccel.generate(
        model, [[5, 6], [7, 8]], generation_config=configs, errors="return", progress=False
    )
    assert [c.finish_reason == "error" for c in mixed] == [True] * copies + [False] * copies


def test_generates_own_objects_run_on_the_engine_in_hfaccel_generate():
    """Custom logits processors, stopping criteria and prompt lookup: served per prompt by hfaccel.generate
    (as model.generate serves them per row), with HF's tokens and no fallback."""

    class BanFive:
        def __call__(self, input_ids, scores):
            scores[:, 5] = -float("inf")
            return scores

    class StopAfterSeven(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == 7

    model = tiny_model()
    prompts = varied_prompts(3, seed=11)
    processors = LogitsProcessorList([BanFive()])
    criteria = StoppingCriteriaList([StopAfterSeven()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        banned = hfaccel.generate(
            model, prompts, logits_processor=processors, max_new_tokens=8, progress=False
        )
        stopped = hfaccel.generate(
            model, prompts, stopping_criteria=criteria, max_new_tokens=8, progress=False
        )
        looked_up = hfaccel.generate(
            model, prompts, prompt_lookup_num_tokens=2, max_new_tokens=8, progress=False
        )
    for i, prompt in enumerate(prompts):
        assert banned[i].token_ids == hf_greedy(model, prompt, 8, logits_processor=processors)
        assert stopped[i].token_ids == hf_greedy(model, prompt, 8, stopping_criteria=criteria)
        assert_same_or_near_tie(model, prompt, looked_up[i].token_ids, hf_greedy(model, prompt, 8))
    assert sum(c.metrics.get("spec_drafted", 0) for c in looked_up) > 0  # prompt lookup drafted


def test_hf_only_generate_arguments_fall_back_with_them():
    model = tiny_model()
    prompt = [7, 8, 9]
    other = tiny_model(seed=5)  # an assistant that is not the engine's draft model
    with pytest.warns(UserWarning, match="assistant_model"):
        out = hfaccel.generate(model, [prompt], assistant_model=other, max_new_tokens=5, progress=False)
    assert out[0].token_ids == hf_greedy(model, prompt, 5)


@pytest.mark.parametrize("family", FAMILIES[:2])
def test_fallback_copies_are_cut_at_their_eos(family):
    model = tiny_model(family)
    prompt = [5, 6, 7]
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="output_hidden_states"):  # transformers' generate
        out = hfaccel.generate(
            model,
            [prompt],
            num_beams=3,
            return_dict_in_generate=True,
            output_hidden_states=True,
            num_return_sequences=3,
            max_new_tokens=12,
            progress=False,
        )
    for c in out:
        assert 2 not in c.token_ids[:-1], "nothing after EOS"


def test_beam_search_runs_on_the_engine_in_hfaccel_generate():
    """Each prompt's hypotheses, best first, are its completions: HF's beam search sequences."""
    model = tiny_model()
    prompts = varied_prompts(3, seed=13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        out = hfaccel.generate(
            model, prompts, num_beams=3, num_return_sequences=2, max_new_tokens=10, progress=False
        )
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    for i, prompt in enumerate(prompts):
        expected = hf(
            model,
            input_ids=torch.tensor([prompt]),
            num_beams=3,
            num_return_sequences=2,
            max_new_tokens=10,
            do_sample=False,
        )
        for rank in range(2):
            row, ours = expected[rank, len(prompt) :].tolist(), out[2 * i + rank]
            assert row[: len(ours.token_ids)] == ours.token_ids
            assert all(t == EOS for t in row[len(ours.token_ids) :])  # HF's fill after a shorter one
            assert ours.finish_reason == ("stop" if ours.token_ids[-1] == EOS else "length")
    with pytest.warns(UserWarning, match="beam search in a stream"):
        events = list(hfaccel.stream(model, prompts[:1], num_beams=3, max_new_tokens=4))
    assert events[-1].finished
