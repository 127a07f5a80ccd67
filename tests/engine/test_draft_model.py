"""Speculative decoding with a draft model: greedy output identical to decoding without speculation (and
to HF), sampled output distributed as the target's, the draft's KV cache riding the target's block tables
through chunked prefill and preemption without a leaked block, and a draft of another vocabulary refused.

The target used as its own draft is the plumbing check: its drafts are exactly the target's greedy
tokens, so any stale or misplaced draft K/V (a block table, a catch-up position, a reset missed after a
preemption) shows up as rejected drafts."""

import copy

import pytest
import torch

import hfaccel
from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import EOS, hf_greedy, tiny_model, varied_prompts


def run(model, prompts, draft, **kwargs):
    config = {k: kwargs.pop(k) for k in list(kwargs) if k in EngineConfig.field_names()}
    hfaccel.patch(model, speculative=draft, **config)
    try:
        out = hfaccel.generate(model, prompts, progress=False, **kwargs)
        return out, model._hfaccel.engine.stats()
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("which", ["self", "small"])
def test_greedy_with_a_draft_model_equals_hf(family, which):
    model = tiny_model(family)
    draft = model if which == "self" else tiny_model(family, seed=1, layers=1)
    prompts = varied_prompts(8, seed=3)
    out, stats = run(model, prompts, draft, num_speculative_tokens=4, max_new_tokens=20)
    plain, _ = run(model, prompts, None, max_new_tokens=20)
    for completion, reference, prompt in zip(out, plain, prompts):
        assert completion.token_ids == reference.token_ids == hf_greedy(model, prompt, 20)
    assert stats["spec_drafted"] > 0
    assert stats["kv_blocks_used"] == 0
    if which == "self":  # the target drafts its own greedy tokens: every draft is accepted
        assert stats["spec_acceptance_rate"] > 0.95, stats


def test_draft_model_through_chunked_prefill_and_preemption():
    """Prompts longer than the step budget (the target prefills in chunks, the draft catches up over
    several passes) and a cache so small that requests are preempted (their draft KV is gone with their
    blocks and recomputed): greedy tokens unchanged, drafts still all accepted, no block leaked."""
    model = tiny_model("llama")
    prompts = [p * 3 for p in varied_prompts(8, seed=5)]
    # 16 KiB a block (target + draft: 2 x 512 bytes a token x 16 tokens); 12 blocks for 8 requests.
    config = EngineConfig(
        speculative=model,
        num_speculative_tokens=3,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        kv_cache_memory=12 * 16 * 1024,
    )
    engine = Engine(model, config)
    assert engine.num_blocks == 12
    stopping = StoppingParams(max_new_tokens=24, eos_token_ids=frozenset({EOS}))
    requests = [engine.make_request(p, stopping) for p in prompts]
    engine.run(requests)
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == hf_greedy(model, prompt, 24)
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert any(len(p) > 16 for p in prompts)  # the draft caught up over several passes
    assert stats["spec_drafted"] > 0 and stats["spec_acceptance_rate"] > 0.95, stats
    assert engine.block_manager.num_used_blocks == 0
    assert all(r.speculation.draft_computed == 0 for r in requests)


def test_draft_catch_up_is_incremental():
    """After the first drafts, a request feeds the draft only what it has not seen: the last token and,
    when every draft was kept, the last draft (1 or 2 tokens a step), not its whole context."""
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(speculative=model, num_speculative_tokens=4))
    prompt = varied_prompts(3, seed=1)[2]
    request = engine.make_request(prompt, StoppingParams(max_new_tokens=30, eos_token_ids=frozenset({EOS})))
    engine.add(request)
    engine.step()  # prefill, then the draft catches up on the whole prompt and the first token
    proposer = engine.proposer
    assert proposer.num_tokens_fed == len(prompt) + 1 + 3  # catch-up, then d1..d3 fed
    assert (
        request.speculation.draft_computed == request.num_tokens + 3 and len(request.speculation.drafts) == 4
    )
    fed = proposer.num_tokens_fed
    engine.step()  # verifies 4 drafts (all kept: the draft is the target), emits 5 tokens
    assert request.speculation.accepted == 4
    assert proposer.num_tokens_fed - fed == 2 + 3  # d4 and the bonus token, then 3 drafts
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_token_ids == hf_greedy(model, prompt, 30)
    assert engine.block_manager.num_used_blocks == 0


def test_drafts_are_the_draft_models_own_greedy_continuation():
    """With a draft that differs from the target (other weights, one layer), each step's drafts are
    exactly what HF greedy decoding of the draft model alone continues the context with: the draft's
    cache, caught up after rejections, holds the right K/V at the right slots."""
    model = tiny_model("qwen2")
    draft = tiny_model("qwen2", seed=1, layers=1)
    config = EngineConfig(speculative=draft, num_speculative_tokens=3, speculative_min_acceptance=0.0)
    engine = Engine(model, config)
    prompts = varied_prompts(4, seed=2)[2:]
    requests = [engine.make_request(p, StoppingParams(max_new_tokens=16)) for p in prompts]
    for request in requests:
        engine.add(request)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in requests:
            drafts = request.speculation.drafts
            if drafts and not request.is_finished:
                assert drafts == hf_greedy(draft, request.all_token_ids, len(drafts))
                checked += 1
    assert checked >= 8
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == hf_greedy(model, prompt, 16)
    assert engine.block_manager.num_used_blocks == 0


def _warped_probs(model, ids, top_k):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    cut = logits.topk(top_k).values[-1]
    return torch.softmax(logits.masked_fill(logits < cut, -float("inf")), dim=-1)


def test_sampled_speculation_with_a_draft_model_follows_the_target_distribution():
    """The second sampled token (the first verified against the draft's probabilities) against its exact
    marginal under the target: total variation, against the null distribution of that distance for the
    same number of exact draws. The draft is the target with noisy weights: close enough that many drafts
    are kept, different enough that many are not (the residual distribution matters)."""
    model = tiny_model("llama", seed=4)
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    top_k = 6
    first = _warped_probs(model, prompt, top_k)
    exact = torch.zeros_like(first)
    for token in first.nonzero().flatten().tolist():
        exact += first[token] * _warped_probs(model, prompt + [token], top_k)
    n = 2000
    spec, stats = run(
        model,
        [prompt] * n,
        draft,
        num_speculative_tokens=2,
        seed=7,
        do_sample=True,
        top_k=top_k,
        max_new_tokens=4,
        min_new_tokens=4,
    )
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95, stats
    assert stats["kv_blocks_used"] == 0

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


def test_a_draft_model_with_another_vocabulary_is_refused():
    model = tiny_model("llama")
    draft = tiny_model("llama", seed=1, layers=1)
    draft.resize_token_embeddings(300)
    with pytest.raises(ValueError, match="speculative.*vocabulary"):
        hfaccel.patch(model, speculative=draft)
    assert not hfaccel.api.is_patched(model)
    with pytest.raises(ValueError, match="speculative.*vocabulary"):
        Engine(model, EngineConfig(speculative=draft))


@pytest.mark.parametrize("value", ["medusa", 3, object()])
def test_speculative_must_be_none_ngram_or_a_model(value):
    with pytest.raises(ValueError, match="speculative must be None, 'ngram' or a draft model"):
        EngineConfig(speculative=value)


def test_config_repr_names_the_draft_model_without_printing_it():
    draft = tiny_model("llama", layers=1)
    text = repr(EngineConfig(speculative=draft))
    assert "speculative=<LlamaForCausalLM>" in text and "Embedding" not in text


def test_a_draft_model_resized_after_the_engine_was_built_is_refused_naming_it():
    model = tiny_model("llama")
    draft = copy.deepcopy(model)
    hfaccel.patch(model, speculative=draft, num_speculative_tokens=4)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model.generate(ids, max_new_tokens=3, do_sample=False)  # the engine is built, the draft checked
    draft.resize_token_embeddings(300, mean_resizing=False)
    with pytest.raises(ValueError, match="the draft model's vocabulary now has 300 tokens, the model's 256"):
        model.generate(ids, max_new_tokens=6, do_sample=False)
    assert model._hfaccel.engine.block_manager.num_used_blocks == 0
    hfaccel.unpatch(model)
