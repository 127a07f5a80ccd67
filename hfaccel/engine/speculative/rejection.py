"""Accepting drafted tokens so that the output follows the target model exactly.

Greedy: a draft is kept while it equals the target's argmax; the first mismatch is replaced by the
argmax, and when every draft is kept the target's next argmax is added (the bonus token) — the same
tokens as decoding one at a time. Sampled: draft ``d`` at position ``j`` is kept with probability
``min(1, p_j(d) / q_j(d))``; on the first rejection a token is drawn from the residual
``max(p_j - q_j, 0)`` normalised, and when all are kept the bonus is drawn from ``p_k``. This is the
standard speculative-sampling rule: the emitted tokens are distributed as the target's. Drafts without
probabilities (n-gram lookup) have ``q`` one-hot on the draft.
"""

from __future__ import annotations

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
    target_probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Tokens emitted for `drafts` given ``[k + 1, V]`` target probabilities, drawing from `generator`.

    `draft_probs` is ``[k, V]`` (None: one-hot on each draft). One uniform per examined draft, then one
    categorical draw, all from the request's own generator."""
    out: list[int] = []
    device = target_probs.device
    for j, draft in enumerate(drafts):
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        p_d = float(p[draft])
        u = float(torch.rand((), generator=generator, device=device))
        if q_d > 0 and u * q_d <= p_d:  # u < p/q, without dividing
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(target_probs[len(drafts)], generator))
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One categorical draw (the exponential race the plain sampler uses)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax_index(probs / noise)
