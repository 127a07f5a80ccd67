"""Speculative decoding inside the continuous batch: greedy output identical to decoding one token at a
time, sampled output distributed as the target's, drafts rolled back without a leaked block."""

import pytest
import torch

import hfaccel
from tests.helpers import FAMILIES, hf_greedy, tiny_model, varied_prompts


def copy_prompts(count=8, seed=3):
    """Prompts that repeat themselves: their continuations copy earlier text, so lookup drafts hit."""
    return [(p * 4)[:96] for p in varied_prompts(count, seed=seed)]


def run(model, prompts, **kwargs):
    config = {
        k: kwargs.pop(k) for k in list(kwargs) if k in ("speculative", "num_speculative_tokens", "block_size")
    }
    hfaccel.patch(model, **config)
    try:
        out = hfaccel.generate(model, prompts, progress=False, **kwargs)
        return out, model._hfaccel.engine.stats()
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_ngram_speculation_equals_hf(family):
    model = tiny_model(family)
    prompts = copy_prompts()
    out, stats = run(model, prompts, speculative="ngram", num_speculative_tokens=4, max_new_tokens=20)
    for completion, prompt in zip(out, prompts):
        assert completion.token_ids == hf_greedy(model, prompt, 20)
    assert stats["spec_drafted"] > 0 and stats["spec_accepted"] > 0
    assert stats["kv_blocks_used"] == 0
    drafted = [c for c in out if "spec_drafted" in c.metrics]
    assert drafted and all(0 <= c.metrics["spec_acceptance_rate"] <= 1 for c in drafted)


def test_speculation_respects_eos_and_max_new_tokens():
    model = tiny_model("llama")
    prompts = copy_prompts(6, seed=9)
    plain, _ = run(model, prompts, max_new_tokens=7, eos_token_id=[5, 9, 17, 200])
    spec, _ = run(
        model,
        prompts,
        speculative="ngram",
        num_speculative_tokens=4,
        max_new_tokens=7,
        eos_token_id=[5, 9, 17, 200],
    )
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
    assert all(len(c.token_ids) <= 7 for c in spec)


@pytest.mark.slow
def test_greedy_with_speculation_equals_hf_on_smollm2(smollm2):
    model, tokenizer = smollm2
    text = "The quick brown fox jumps over the lazy dog. " * 3
    prompts = [[{"role": "user", "content": f"Repeat exactly: {text}"}]]
    plain = hfaccel.generate(model, prompts, tokenizer=tokenizer, max_new_tokens=40, progress=False)
    spec, stats = run(model, [list(plain[0].prompt_token_ids)], speculative="ngram", max_new_tokens=40)
    assert spec[0].token_ids == plain[0].token_ids
    assert stats["spec_accepted"] > 0


def _warped_probs(model, ids, top_k):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    cut = logits.topk(top_k).values[-1]
    return torch.softmax(logits.masked_fill(logits < cut, -float("inf")), dim=-1)


def test_sampled_speculation_follows_the_target_distribution():
    """The second sampled token (the first that goes through verification) against its exact marginal
    distribution under the target: total variation, against the null distribution of that distance for
    the same number of exact draws (as the plain sampler's test does)."""
    model = tiny_model("llama", seed=4)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]  # lookup proposes 9, 7, 8 ...
    top_k = 6
    first = _warped_probs(model, prompt, top_k)
    exact = torch.zeros_like(first)
    for token in first.nonzero().flatten().tolist():
        exact += first[token] * _warped_probs(model, prompt + [token], top_k)
    n = 2000
    # Draft the token with the largest marginal mass (often accepted, often not): the acceptance rule,
    # not the draft source, is what decides the distribution here.
    likely = int(exact.argmax())

    class FixedProposer:
        def propose(self, requests, budgets):
            return [[likely] * min(k, 2) for k in budgets]

    hfaccel.patch(model, speculative="ngram", num_speculative_tokens=3)
    try:
        model._hfaccel.get_engine(model).proposer = FixedProposer()
        spec = hfaccel.generate(
            model,
            [prompt] * n,
            seed=7,
            progress=False,
            do_sample=True,
            top_k=top_k,
            max_new_tokens=4,
            min_new_tokens=4,
        )
        stats = model._hfaccel.engine.stats()
    finally:
        hfaccel.unpatch(model)
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95, stats

    def distance(counts):
        return 0.5 * float((counts / n - exact).abs().sum())

    observed = distance(torch.bincount(torch.tensor([c.token_ids[1] for c in spec]), minlength=len(exact)))
    g = torch.Generator().manual_seed(0)
    null = [
        distance(
            torch.bincount(torch.multinomial(exact, n, replacement=True, generator=g), minlength=len(exact))
        )
        for _ in range(200)
    ]
    assert observed < max(null) * 1.15, (observed, max(null))


def test_low_acceptance_turns_speculation_off_for_that_request():
    from hfaccel import EngineConfig
    from hfaccel.engine.engine import Engine
    from hfaccel.engine.request import StoppingParams

    model = tiny_model("llama")
    config = EngineConfig(speculative="ngram", num_speculative_tokens=4, speculative_min_acceptance=0.99)
    engine = Engine(model, config)
    prompts = [(p * 3)[:60] for p in varied_prompts(4, seed=5)]
    requests = [engine.make_request(p, StoppingParams(max_new_tokens=60, min_new_tokens=60)) for p in prompts]
    engine.run(requests)
    stopped = [r for r in requests if not r.speculation.enabled]
    assert stopped, "no request stopped speculating"
    for request in stopped:
        assert (
            request.speculation.drafted >= 16
            and request.speculation.accepted < 0.99 * request.speculation.drafted
        )
        assert request.speculation.drafted <= 16 + 4 * 2  # it stopped soon after the threshold was reached
    assert engine.block_manager.num_used_blocks == 0


def test_a_seeded_sampled_call_reproduces_its_samples_with_speculation():
    """Draft lengths follow measured step times for greedy requests only: a sampled request verifies its
    full length, so the draws its random stream gives, and its samples, do not depend on timings."""
    model = hfaccel.patch(tiny_model("llama", seed=5), speculative="ngram")
    prompts = copy_prompts(4, seed=12)
    try:
        runs = [
            [
                c.token_ids
                for c in hfaccel.generate(
                    model,
                    prompts,
                    max_new_tokens=40,
                    do_sample=True,
                    temperature=0.8,
                    seed=21,
                    progress=False,
                )
            ]
            for _ in range(3)
        ]
        assert model._hfaccel.get_engine(model).cost_model().ready  # the price was there to cut drafts
    finally:
        hfaccel.unpatch(model)
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("speculative", ["ngram", "draft_model"])
def test_a_seeded_request_samples_its_tokens_whatever_its_drafts_under_a_tight_cache(speculative):
    """Under a KV cache so small that requests are preempted and drafts dropped, how many drafts a step
    verifies changes with the batch: a seeded request still samples the tokens it samples alone, and those
    of sampling without speculation (each position's token drawn with that position's noise). They
    changed with the batch before (a helper's probe)."""
    from transformers import GenerationConfig

    model = tiny_model("llama", max_positions=96)
    g = torch.Generator().manual_seed(2)
    prompts = [[5, 6, 7, 8, 9] * 3] + [
        torch.randint(3, 256, (n,), generator=g).tolist() for n in (28, 20, 35, 30)
    ]
    sampled = GenerationConfig(
        do_sample=True, max_new_tokens=30, temperature=1.0, top_k=20, eos_token_id=None
    )
    configs = [sampled] * len(prompts)
    seeds = [1001 + i for i in range(len(prompts))]
    memory = 49157 if speculative == "ngram" else 110_000  # a draft model's cache shares the budget
    engine = {"block_size": 2, "kv_cache_memory": memory, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    engine |= {"max_model_len": 96, "enable_prefix_caching": False}
    draft = (
        {"speculative": tiny_model("llama", seed=3, max_positions=96)} if speculative == "draft_model" else {}
    )
    plain = hfaccel.generate(
        model, prompts[:1], generation_config=configs[:1], seed=seeds[:1], progress=False
    )
    hfaccel.patch(model, speculative=draft.get("speculative", speculative), **engine)
    try:
        batch = hfaccel.generate(model, prompts, generation_config=configs, seed=seeds, progress=False)
        assert model._hfaccel.engine.scheduler.num_preemptions > 0, "the cache must be tight for this test"
        alone = hfaccel.generate(
            model, prompts[:1], generation_config=configs[:1], seed=seeds[:1], progress=False
        )
    finally:
        hfaccel.unpatch(model)
    assert batch[0].token_ids == alone[0].token_ids == plain[0].token_ids


def test_a_sampled_request_drafting_with_the_target_itself_keeps_every_draft():
    """The draft model draws each position's draft with the noise the target's sample there uses: with
    the target as its own draft every draft is that sample, so a misplaced position would show as a
    rejection (it never changes the tokens, only the acceptance)."""
    model = tiny_model("llama")
    hfaccel.patch(model, speculative=model, num_speculative_tokens=3)
    try:
        completions = hfaccel.generate(
            model, varied_prompts(3, seed=8), max_new_tokens=24, do_sample=True, temperature=1.0, seed=5,
            min_new_tokens=24, progress=False,
        )  # fmt: skip
        totals = model._hfaccel.engine.scheduler.spec_totals
    finally:
        hfaccel.unpatch(model)
    assert all(len(c.token_ids) == 24 for c in completions)
    assert totals.drafted > 0 and totals.rejections == 0 and totals.accepted == totals.drafted, totals


def test_processors_only_see_histories_of_kept_tokens():
    """Drafts are verified one position at a time where the request has processors: a processor that
    raises on a history it forbids (a parser, a grammar) never sees a rejected draft, as in HF, whose
    prompt lookup drafts no forbidden token. Every token >= 100 is followed by 5 in the prompt, and the
    processor forbids ids below 100."""
    from transformers import LogitsProcessor, LogitsProcessorList

    prompt = [x for t in range(100, 256) for x in (t, 5)]

    class OnlyHigh(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if (input_ids[0, len(prompt) :] < 100).any():
                raise ValueError(f"a forbidden history: {input_ids[0, len(prompt) :].tolist()}")
            scores = scores.clone()
            scores[:, :100] = -float("inf")
            return scores

    model = tiny_model("llama")
    ask = dict(max_new_tokens=12, logits_processor=LogitsProcessorList([OnlyHigh()]))
    expected = hf_greedy(model, prompt, **ask)
    lookup = dict(ask, prompt_lookup_num_tokens=3, max_matching_ngram_size=1)
    hfaccel.patch(model)
    assert (
        model.generate(torch.tensor([prompt]), do_sample=False, **lookup)[0, len(prompt) :].tolist()
        == expected
    )
    hfaccel.patch(model, speculative="ngram", num_speculative_tokens=3)
    ids = torch.tensor([prompt])
    assert model.generate(ids, do_sample=False, **ask)[0, len(prompt) :].tolist() == expected
    torch.manual_seed(0)
    plain = hfaccel.generate(model, [prompt], do_sample=True, seed=4, progress=False, **ask)[0]
    assert plain.finish_reason == "length" and min(plain.token_ids) >= 100
    hfaccel.unpatch(model)
