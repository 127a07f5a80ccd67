"""Sampling, logits processors, multiple sequences, score outputs and streamers against HF."""

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

import hfaccel
from tests.helpers import EOS, hf_greedy, tiny_model, varied_prompts

PROMPT = [17, 45, 99, 3, 120, 7, 64, 31, 200, 11]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4)


def expected_first_token_probs(model, prompt, **sampling):
    config = GenerationConfig(do_sample=True, **sampling)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=len(prompt),
        encoder_input_ids=torch.tensor([prompt]),
        logits_processor=LogitsProcessorList(),
        device="cpu",
    )
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[:, -1].float()
    return torch.softmax(processors(torch.tensor([prompt]), logits), dim=-1)[0]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7, "top_k": 0},
        {"temperature": 1.3, "top_k": 12},
        {"top_p": 0.8, "top_k": 0},
        {"min_p": 0.05, "top_k": 0, "temperature": 1.5},
        {"repetition_penalty": 1.5, "top_k": 30},
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()),
)
def test_first_token_distribution_matches_hf(model, sampling):
    expected = expected_first_token_probs(model, PROMPT, **sampling)
    torch.manual_seed(0)
    n = 3000
    completions = hfaccel.generate(
        model, [PROMPT] * n, max_new_tokens=1, do_sample=True, progress=False, **sampling
    )
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in completions]), minlength=expected.numel())
    # Total variation over the 15 likeliest tokens plus one bin for the rest: over the whole vocabulary
    # the sampling noise would hide a real difference (a temperature of 0.75 instead of 0.7 is caught).
    top = expected.topk(15).indices

    def distance(frequencies):
        binned = torch.cat([frequencies[top], (1 - frequencies[top].sum()).reshape(1)])
        reference = torch.cat([expected[top], (1 - expected[top].sum()).reshape(1)])
        return 0.5 * (binned - reference).abs().sum().item()

    # Its null distribution: n exact draws from HF's probabilities, 300 times over.
    generator = torch.Generator().manual_seed(1)
    null = [
        distance(
            torch.bincount(
                torch.multinomial(expected, n, replacement=True, generator=generator),
                minlength=expected.numel(),
            ).float()
            / n
        )
        for _ in range(300)
    ]
    observed = distance(counts.float() / n)
    assert observed < max(null) * 1.15, (observed, max(null))  # beyond ~the 99.7th percentile of noise
    assert expected[counts > 0].min() > 0, "a token the processors rule out was sampled"


def test_same_seed_same_batch_same_output(model):
    prompts = varied_prompts(6, seed=3)
    kwargs = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.2, "top_k": 50, "progress": False}
    torch.manual_seed(7)
    first = [c.token_ids for c in hfaccel.generate(model, prompts, **kwargs)]
    torch.manual_seed(7)
    again = [c.token_ids for c in hfaccel.generate(model, prompts, **kwargs)]
    torch.manual_seed(8)
    other = [c.token_ids for c in hfaccel.generate(model, prompts, **kwargs)]
    assert first == again and first != other


def test_greedy_and_sampled_requests_share_a_batch(model):
    prompts = varied_prompts(6, seed=5)
    configs = [
        GenerationConfig(max_new_tokens=8, do_sample=i % 2 == 1, temperature=0.9, top_k=20) for i in range(6)
    ]
    model = hfaccel.patch(model, kv_cache_memory=2_000_000)
    try:
        completions = hfaccel.generate(model, prompts, generation_config=configs, progress=False)
        assert max(s.num_seqs for s in model._hfaccel.engine.step_stats) == 6, "all six ran in one batch"
    finally:
        hfaccel.unpatch(model)
    for i in range(0, 6, 2):
        assert completions[i].token_ids == hf_greedy(model, prompts[i], 8)


@pytest.mark.parametrize(
    "processing",
    [
        {"repetition_penalty": 1.8},
        {"no_repeat_ngram_size": 2},
        {"bad_words_ids": [[40], [41, 42]]},
        {"suppress_tokens": [EOS, 60, 61]},
        {"min_new_tokens": 10, "eos_token_id": [EOS, 33]},
    ],
    ids=lambda p: next(iter(p)),
)
def test_greedy_logits_processors_match_hf(model, processing):
    prompts = varied_prompts(8, seed=6)
    completions = hfaccel.generate(model, prompts, max_new_tokens=10, progress=False, **processing)
    for prompt, completion in zip(prompts, completions):
        assert completion.token_ids == hf_greedy(model, prompt, 10, **processing)


def test_num_return_sequences_layout_and_shared_prefix(model):
    model = hfaccel.patch(model, block_size=4, kv_cache_memory=2_000_000)
    try:
        prompts = torch.tensor([PROMPT, PROMPT[::-1]])
        out = model.generate(prompts, do_sample=True, num_return_sequences=3, max_new_tokens=5, top_k=0)
        ref = type(model).generate(
            model, prompts, do_sample=True, num_return_sequences=3, max_new_tokens=5, top_k=0
        )
        assert out.shape == ref.shape == (6, len(PROMPT) + 5)
        assert torch.equal(out[:, : len(PROMPT)], prompts.repeat_interleave(3, dim=0))
        # Copies of a prompt are admitted one step after the first, and reuse its full prompt blocks.
        assert model._hfaccel.engine.stats()["prefix_cache_hit_tokens"] >= 4 * 8
    finally:
        hfaccel.unpatch(model)


def test_scores_and_logits_match_hf(model):
    model = hfaccel.patch(model, kv_cache_memory=2_000_000)
    try:
        kwargs = {
            "max_new_tokens": 6,
            "return_dict_in_generate": True,
            "output_scores": True,
            "output_logits": True,
            "repetition_penalty": 1.3,
        }
        ours = model.generate(torch.tensor([PROMPT]), **kwargs)
        ref = type(model).generate(model, torch.tensor([PROMPT]), **kwargs)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(ours.sequences, ref.sequences)
    assert len(ours.scores) == len(ref.scores) == 6
    for mine, theirs in zip(ours.scores + ours.logits, ref.scores + ref.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_scores_after_a_row_finished_are_minus_inf_with_a_warning(model):
    # HF keeps computing a finished row from the pad tokens it feeds it; the engine stops the row, so
    # its later scores cannot be HF's: -inf, and the call says so.
    prompts = torch.tensor([PROMPT, PROMPT[::-1]])
    plain = type(model).generate(model, prompts, max_new_tokens=6, do_sample=False)
    eos = int(plain[0, len(PROMPT) + 1])  # row 0 stops after 2 tokens; row 1 (likely) runs on
    kwargs = {
        "max_new_tokens": 6,
        "return_dict_in_generate": True,
        "output_scores": True,
        "eos_token_id": eos,
    }
    ref = type(model).generate(model, prompts, **kwargs)
    model = hfaccel.patch(model, kv_cache_memory=2_000_000)
    try:
        with pytest.warns(UserWarning, match="scores of a row after it finished are -inf"):
            ours = model.generate(prompts, **kwargs)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(ours.sequences, ref.sequences) and len(ours.scores) > 2
    for step, (mine, theirs) in enumerate(zip(ours.scores, ref.scores)):
        torch.testing.assert_close(mine[1], theirs[1], atol=1e-4, rtol=1e-4)  # the running row: HF's
        if step < 2:
            torch.testing.assert_close(mine[0], theirs[0], atol=1e-4, rtol=1e-4)
        else:
            assert bool((mine[0] == -float("inf")).all())


def test_logprobs_are_those_of_the_chosen_tokens(model):
    completion = hfaccel.generate(model, [PROMPT], max_new_tokens=5, logprobs=True, progress=False)[0]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + completion.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    expected = expected[torch.arange(5), torch.tensor(completion.token_ids)]
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=1e-4)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_tokens_then_end(model):
    model = hfaccel.patch(model, kv_cache_memory=2_000_000)
    try:
        ours, theirs = Recorder(), Recorder()
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, streamer=ours)
        type(model).generate(model, torch.tensor([PROMPT]), max_new_tokens=6, streamer=theirs)
    finally:
        hfaccel.unpatch(model)
    assert ours.puts == theirs.puts and ours.ended
    assert [p[0] for p in ours.puts[1:]] == out[0, len(PROMPT) :].tolist()
