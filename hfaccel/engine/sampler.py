"""Turns each sequence's last logits into its next token."""

from __future__ import annotations

import torch

from hfaccel.engine.request import Request


def greedy_sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Greedy next tokens, after each request's logits processing.

    `logits` is ``[N, V]``, one row per request. As in HF ``generate``, scores are processed in float32;
    EOS is masked while a request is below its ``min_new_tokens`` (done here, batched, because every
    benchmark request uses it), then each request's own HF ``LogitsProcessorList`` runs on its row.
    """
    scores = logits.to(dtype=torch.float32, copy=True)
    rows, cols = [], []
    for i, request in enumerate(requests):
        if len(request.output_token_ids) < request.stopping.min_new_tokens:
            for eos in request.stopping.eos_token_ids:
                if 0 <= eos < scores.shape[-1]:
                    rows.append(i)
                    cols.append(eos)
    if rows:
        scores[rows, cols] = -float("inf")
    for i, request in enumerate(requests):
        if request.logits_processor:
            ids = torch.tensor([request.all_token_ids], dtype=torch.long, device=scores.device)
            scores[i : i + 1] = request.logits_processor(ids, scores[i : i + 1])
    return scores.argmax(dim=-1).tolist()
