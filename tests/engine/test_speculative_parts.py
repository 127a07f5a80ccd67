"""The pieces of speculative decoding on their own: n-gram lookup and the acceptance rule."""

import torch

from hfaccel.engine.speculative.ngram import propose_ngram
from hfaccel.engine.speculative.rejection import accept_greedy, accept_sampled


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurred twice before; the latest is followed by 7, 7, 1, 2
    assert propose_ngram(tokens, k=4, max_n=3) == [7, 7, 1, 2]
    assert propose_ngram(tokens, k=2, max_n=3) == [7, 7]


def test_ngram_falls_back_to_shorter_suffixes_and_may_propose_nothing():
    assert propose_ngram([5, 6, 8, 1, 6], k=3, max_n=4) == [8, 1, 6]  # only "6" recurs
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([4, 4], k=3) == [4]
    assert propose_ngram([], k=3) == [] and propose_ngram([1, 1, 1], k=0) == []


def test_greedy_acceptance_keeps_drafts_while_they_are_the_argmax_then_corrects():
    probs = torch.eye(6)[[3, 1, 4, 0]]  # argmax per position: 3, 1, 4, 0
    assert accept_greedy(probs, [3, 1, 4]) == [3, 1, 4, 0]  # all kept, plus the bonus
    assert accept_greedy(probs, [3, 2, 4]) == [3, 1]  # the second is replaced by the argmax
    assert accept_greedy(probs[:1], []) == [3]


def _position_generators(seed):
    """Each position's generator reseeded from (`seed`, position), as `request.position_generator` does."""
    return lambda j: torch.Generator().manual_seed(seed * 1000 + j)


def test_sampled_acceptance_emits_the_targets_own_samples_whatever_the_drafts():
    """Each emitted token is the target's sample with its position's noise: drafts decide only how many
    positions a call emits, never which tokens (so a seeded request's tokens do not depend on them)."""
    from hfaccel.engine.speculative.rejection import draw

    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(4, 7, generator=g), dim=-1)
    for seed in range(50):
        noise = _position_generators(seed)
        own = [draw(p[j], noise(j)) for j in range(4)]  # sampling one position at a time
        assert accept_sampled(p, own[:3], noise) == own  # all kept, plus the bonus
        wrong = (own[1] + 1) % 7
        assert accept_sampled(p, [own[0], wrong, own[2]], noise) == own[:2]  # corrected at the mismatch
        assert accept_sampled(p[:1], [], noise) == own[:1]


def test_sampled_acceptance_follows_the_target_distribution_and_keeps_a_draft_with_its_probability():
    # Target at position 0: [0.5, 0.3, 0.2]; the n-gram draft proposes token 2 (certain).
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    counts, kept = torch.zeros(3), 0
    draws = 20000
    for seed in range(draws):
        out = accept_sampled(p, [2], _position_generators(seed))
        counts[out[0]] += 1
        kept += len(out) == 2
    # 4 standard deviations of a binomial at n=20000 is about 0.014.
    assert torch.allclose(counts / draws, p[0], atol=0.015), counts / draws
    assert abs(kept / draws - 0.2) < 0.015  # kept with probability p(draft), as the rejection rule keeps it


def test_draft_lengths_follow_each_requests_acceptance_and_the_price_of_a_row():
    from hfaccel.engine.request import SpeculationCounts
    from hfaccel.engine.speculative.drafting import DraftPrice, draft_lengths

    # Batch 1, a row nearly free against the step (the weights a step streams): a good drafter drafts
    # its whole limit; a poor one while a ** j beats the batch's rate, which its good drafts raised
    # (0.3 ** 2 = 0.09 > 0.0004 s x 4.1 tokens / 0.0416 s = 0.039 > 0.3 ** 3).
    assert draft_lengths([0.9, 0.3], [4, 4], DraftPrice(step_s=0.040, tokens=1, row_s=0.0004)) == [4, 2]
    # A compute-bound batch of 8 where a row costs what a sequence's decode does: only sure drafts pay
    # (a ** j must beat 8 x 5 ms / 40 ms = 1), so none; at half the price, the 0.9 drafter's first two.
    price = DraftPrice(step_s=0.040, tokens=8, row_s=0.005)
    assert draft_lengths([0.9] * 2 + [0.5] * 6, [4] * 8, price) == [0] * 8
    cheaper = DraftPrice(step_s=0.040, tokens=8, row_s=0.0025)
    assert (
        draft_lengths([0.9, 0.5], [4, 4], cheaper)[1] == 0
        and draft_lengths([0.9, 0.5], [4, 4], cheaper)[0] >= 1
    )
    # Never past a request's limit; drafts are taken in order (no j-th without the (j-1)-th).
    assert draft_lengths([0.95, 0.95], [1, 3], DraftPrice(0.04, 1, 1e-5)) == [1, 3]
    # The acceptance estimate: 0.5 before any draft; accepted over accepted plus rejections.
    assert SpeculationCounts().acceptance() == 0.5
    assert SpeculationCounts(drafted=40, accepted=30, steps=10, rejections=10).acceptance() == 31 / 42
    assert SpeculationCounts(drafted=400, accepted=400, steps=100).acceptance() == 0.95
    # A new request starts from the engine's acceptance (a workload whose drafts fail: it does not draft).
    assert SpeculationCounts().acceptance(prior=0.15) == 0.15
