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


def test_sampled_acceptance_follows_the_target_distribution_for_one_hot_drafts():
    # Target at position 0: [0.5, 0.3, 0.2]; the n-gram draft proposes token 2 (q one-hot).
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    draws = 20000
    for _ in range(draws):
        counts[accept_sampled(p, [2], g)[0]] += 1
    freq = counts / draws
    # 4 standard deviations of a binomial at n=20000 is about 0.014.
    assert torch.allclose(freq, p[0], atol=0.015), freq


def test_sampled_acceptance_with_draft_probabilities_follows_the_target():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.1, 0.2, 0.7]])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    draws = 20000
    for _ in range(draws):
        draft = int(torch.multinomial(q[0], 1, generator=g))
        counts[accept_sampled(p, [draft], g, draft_probs=q)[0]] += 1
    assert torch.allclose(counts / draws, p[0], atol=0.015), counts / draws
