"""Verifying one request's drafted tokens against the target's logits at its 1 + k positions.

Position ``j`` of the row block scores the token after ``all_token_ids + drafts[:j]``: the request's
logits processors see exactly that history, after its `processor_prefix` (as they would decoding one
token at a time), EOS is
masked while the request is below ``min_new_tokens``, and the score-only warpers run last. Greedy
requests keep drafts while they are the argmax; sampled ones while they are the target's own sample at
their position (`rejection.py`).
"""

from __future__ import annotations

import torch

from hfaccel.engine.request import NOT_FINITE, Request, position_generator
from hfaccel.engine.speculative.rejection import accept_greedy, accept_sampled, draw
from hfaccel.kernels.cpu_argmax import argmax_index


def process_row(row: torch.Tensor, request: Request, drafts: list[int]) -> torch.Tensor:
    """The request's processed fp32 scores (``[1, V]``) for the token after ``all_token_ids + drafts``:
    EOS masked below ``min_new_tokens``, its logits processors, then its score-only warpers. `row` may
    be changed in place; use the returned tensor."""
    params = request.sampling
    stopping = request.stopping
    if len(request.output_token_ids) + len(drafts) < stopping.min_new_tokens:
        for eos in stopping.eos_token_ids:
            if 0 <= eos < row.shape[-1]:
                row[0, eos] = -float("inf")
    if params.processors or params.warpers:
        history = request.processor_ids() + drafts  # the padded row, as in `sample`
        ids = torch.tensor([history], dtype=torch.long, device=row.device)
        if params.processors:
            row = params.processors(ids, row)
        if params.warpers:
            row = params.warpers(ids, row)
    return row


def verify_drafts(logits: torch.Tensor, request: Request, drafts: list[int]) -> list[int]:
    """Tokens to emit for `request` given ``[len(drafts) + 1, V]`` target logits (`rejection.py`: the
    target's own tokens, greedy or sampled with each position's noise)."""
    scores = logits.to(dtype=torch.float32, copy=True)
    if request.sampling.processors or request.sampling.warpers:
        return _verify_in_order(scores, request, drafts)
    try:
        for j in range(len(drafts) + 1):
            scores[j : j + 1] = process_row(scores[j : j + 1], request, drafts[:j])
    except Exception as error:  # the request's own processors raised: it fails alone (as in `sample`)
        request.fail(error, alone=True)
        return [argmax_index(scores[0])]
    if not request.sampling.do_sample:
        return accept_greedy(scores, drafts)
    probs = torch.softmax(scores, dim=-1)
    if not bool(probs[:, 0].isfinite().all()):  # NaN scores make a whole row NaN: as `sample` fails it
        request.fail(RuntimeError(NOT_FINITE), alone=True)
        return [0]
    first = len(request.output_token_ids)  # the output position of the row block's first token
    return accept_sampled(probs, drafts, lambda j: position_generator(request, first + j, probs.device))


def _verify_in_order(scores: torch.Tensor, request: Request, drafts: list[int]) -> list[int]:
    """`verify_drafts` for a request with logits processors: one position at a time, stopping at the
    first draft the target does not keep, so the processors only ever see histories of kept tokens (as
    decoding one token at a time shows them; a processor may raise on a history it forbids, and HF's
    prompt lookup never drafts a token the processors forbid)."""
    first = len(request.output_token_ids)  # the output position of the row block's first token
    out: list[int] = []
    for j in range(len(drafts) + 1):
        try:
            row = process_row(scores[j : j + 1], request, drafts[:j])
        except Exception as error:  # the request's own processors raised: it fails alone (as in `sample`)
            request.fail(error, alone=True)
            return [0]  # (a failed request keeps none of its tokens)
        if request.sampling.do_sample:
            probs = torch.softmax(row[0], dim=-1)
            if not bool(probs[0].isfinite()):  # NaN scores make the whole row NaN: as `sample` fails it
                request.fail(RuntimeError(NOT_FINITE), alone=True)
                return [0]
            token = draw(probs, position_generator(request, first + j, probs.device))
        else:
            token = argmax_index(row[0])
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return out
