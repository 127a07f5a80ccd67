"""Accepting drafted tokens so that the output is the target model's own, token for token.

Greedy: a draft is kept while it equals the target's argmax; the first mismatch is replaced by the
argmax, and when every draft is kept the target's next argmax is added (the bonus token) — the same
tokens as decoding one at a time.

Sampled: the token at each position is the target's own sample there, drawn with that position's noise
(`request.position_generator`: an exponential race, ``argmax(p / E)``, exactly a categorical draw); a
draft is kept while it equals it, the first mismatch is replaced by it, and when every draft is kept
the next position's sample is added. So the tokens are exactly those of sampling one at a time with the
same seed, however many drafts a step verified (that number follows the KV cache's pressure and the
step's token budget). A draft model samples its drafts with the same noise, so a draft matches the
target's sample as often as the two distributions let a shared race agree. A draft without
probabilities (n-gram lookup) is kept with probability ``p(draft)``, as the rejection rule of
speculative sampling keeps it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hfaccel.kernels.cpu_argmax import argmax_index, argmax_rows


def accept_greedy(target_probs: torch.Tensor, drafts: list[int]) -> list[int]:
    """Tokens emitted for `drafts` given ``[k + 1, V]`` target scores/probs (argmax decides)."""
    best = argmax_rows(target_probs).tolist()
    out: list[int] = []
    for j, draft in enumerate(drafts):
        if draft != best[j]:
            out.append(best[j])
            return out
        out.append(draft)
    out.append(best[len(drafts)])
    return out


def accept_sampled(
    target_probs: torch.Tensor, drafts: list[int], generator_at: Callable[[int], torch.Generator]
) -> list[int]:
    """Tokens emitted for `drafts` given ``[k + 1, V]`` target probabilities: at each position ``j`` the
    target's sample with the noise of `generator_at(j)`, kept going while it equals the draft."""
    out: list[int] = []
    for j in range(len(drafts) + 1):
        token = draw(target_probs[j], generator_at(j))
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            return out
    return out


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One categorical draw (the exponential race the plain sampler uses)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax_index(probs / noise)
