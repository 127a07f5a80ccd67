"""The next-tokens stage of a step: the logits of the sampled rows -> each request's new tokens.

Plain decoding samples one token per request, greedy or sampled, in one batch (`sample`). A request
that verifies drafts (``rows[i] = 1 + k`` rows) gets the tokens its verification keeps
(`speculative/verify.py`), and then every entry is a list. The slots of a beam group get the group's
search step (`beam_search.py`). Speculation and beam search run only in steps that hold such requests.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from hfaccel.engine.beam_search import choose_group_tokens
from hfaccel.engine.request import NOT_FINITE, Request, fails_alone, position_generator
from hfaccel.engine.speculative.verify import verify_drafts
from hfaccel.kernels.cpu_argmax import argmax_index, argmax_rows


def next_tokens(logits: torch.Tensor, requests: list[Request], rows: list[int] | None) -> list[Any]:
    """One entry per request: its token, or (when some request verifies drafts) its list of tokens."""
    beams = [i for i, request in enumerate(requests) if request.beam_group is not None]
    if not beams:
        return _sampled(logits, requests, rows)
    counts = rows if rows is not None else [1] * len(requests)
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    result: list[Any] = [None] * len(requests)
    in_beams = set(beams)
    others = [i for i in range(len(requests)) if i not in in_beams]
    if others:
        index = torch.tensor([offsets[i] + k for i in others for k in range(counts[i])], device=logits.device)
        tokens = _sampled(
            logits.index_select(0, index),
            [requests[i] for i in others],
            None if rows is None else [counts[i] for i in others],
        )
        for i, token in zip(others, tokens):
            result[i] = token
    nested = any(isinstance(t, list) for t in result if t is not None)
    choose_group_tokens(logits, requests, offsets, result, nested)
    return result


def _sampled(
    logits: torch.Tensor, requests: list[Request], rows: list[int] | None
) -> list[int] | list[list[int]]:
    """Plain sampling, batched; when some requests verify drafts (``rows[i] > 1``), a list per request:
    the verified ones' emitted tokens, ``[token]`` for the rest."""
    if rows is None or all(n == 1 for n in rows):
        return sample(logits, requests)
    results: list[list[int]] = [[] for _ in requests]
    single_rows, single_requests = [], []
    offset = 0
    for i, (request, count) in enumerate(zip(requests, rows)):
        if count == 1:
            single_rows.append(offset)
            single_requests.append(i)
        else:
            results[i] = verify_drafts(logits[offset : offset + count], request, request.speculation.drafts)
        offset += count
    if single_rows:
        index = torch.tensor(single_rows, device=logits.device)
        tokens = sample(logits.index_select(0, index), [requests[i] for i in single_requests])
        for i, token in zip(single_requests, tokens):
            results[i] = [token]
    return results


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Next tokens for ``[N, V]`` `logits`, one row per request, each with its own `SamplingParams`.

    As in HF ``generate``: scores are processed in float32; EOS is masked while a request is below its
    ``min_new_tokens`` (batched here, since every benchmark request uses it); each request's
    id-dependent processors run on its row (a request whose processors raise fails alone, with that
    error; its token is ignored); score-only warpers run once per group of rows sharing them;
    then greedy rows take the argmax and each sampled row draws from its softmax with its own generator
    (an exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)``: exactly a categorical draw), one copy of
    the chosen tokens to the host per step.
    """
    if all(_plain_greedy(r) for r in requests):
        return _greedy(logits, requests)
    scores = logits.to(dtype=torch.float32, copy=True)
    masked = _mask_eos_below_min_tokens(scores, requests)
    groups: dict[int, list[int]] = defaultdict(list)
    raw: dict[int, torch.Tensor] = {}  # rows whose recorded logits are what their processors were given
    for i, request in enumerate(requests):
        params = request.sampling
        if params.processors:
            ids = torch.tensor([request.processor_ids()], dtype=torch.long, device=scores.device)
            row = scores[i : i + 1]
            try:
                processed = params.processors(ids, row)
                if not isinstance(processed, torch.Tensor) or processed.numel() != row.numel():
                    # (a [V] row for a batch of one is taken, as transformers' greedy search takes it)
                    shape = tuple(processed.shape) if isinstance(processed, torch.Tensor) else type(processed)
                    raise ValueError(
                        f"a logits processor returned {shape}, not scores of shape {tuple(row.shape)}"
                    )
                processed = processed.reshape(row.shape)
                if params.output_logits and i not in masked:
                    # HF records the very tensor its processors were given as the raw logits, so a processor
                    # that edits its input in place shows in them: the same here (an unmasked row is it).
                    raw[i] = row[0].to(device="cpu", copy=True)
                scores[i : i + 1] = processed
            except BaseException as error:  # the request's own processors (a caller's): it fails alone
                if not fails_alone(error):
                    raise
                request.fail(error, alone=True)
                continue
        if params.warpers:
            groups[id(params)].append(i)
    for rows in groups.values():
        warpers = requests[rows[0]].sampling.warpers
        index = torch.tensor(rows, device=scores.device)
        dummy_ids = torch.zeros((len(rows), 1), dtype=torch.long, device=scores.device)
        scores[index] = warpers(dummy_ids, scores[index])
    tokens = argmax_rows(scores)
    sampled_rows = [i for i, r in enumerate(requests) if r.sampling.do_sample]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=scores.device)
        probs = torch.softmax(scores[index], dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(sampled_rows):
            position = len(requests[i].output_token_ids)
            noise[row].exponential_(generator=position_generator(requests[i], position, scores.device))
        # A row whose probabilities hold NaN (scores of NaN or +inf, or all -inf) draws no token: -1,
        # read with the others in the one copy to the host below.
        # (softmax makes such a row NaN throughout: its first column says it)
        drawn = argmax_rows(probs / noise)
        tokens[index] = torch.where(probs[:, 0].isfinite(), drawn, torch.full_like(drawn, -1))
    chosen = tokens.tolist()
    for i, token in enumerate(chosen):
        if token < 0:  # as HF's torch.multinomial raises for them; the draw would pick token 0, silently
            requests[i].fail(RuntimeError(NOT_FINITE), alone=True)
            chosen[i] = 0
    _record_outputs(logits, scores, chosen, requests, raw)
    return chosen


def _plain_greedy(request: Request) -> bool:
    params = request.sampling
    return not (
        params.do_sample
        or params.processors
        or params.warpers
        or params.output_scores
        or params.output_logits
        or params.output_logprobs
    )


def _greedy(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """The fast path of a step whose requests all decode greedily with no processors and record nothing:
    one argmax over the logits as they are (no float32 copy: widening is exact, so the argmax is the
    same; float32 rows on a CPU by `argmax_rows`' vector kernel) and one copy of the tokens to the
    host. A request still below ``min_new_tokens`` must not emit EOS; its masked argmax differs from
    the plain one only when the plain one is an EOS token, so only such a row (rare) is redone with its
    EOS ids masked."""
    chosen = argmax_rows(logits).tolist()
    vocab = logits.shape[-1]
    for i, request in enumerate(requests):
        stopping = request.stopping
        if chosen[i] in stopping.eos_token_ids and len(request.output_token_ids) < stopping.min_new_tokens:
            row = logits[i].to(dtype=torch.float32, copy=True)
            row[[eos for eos in stopping.eos_token_ids if 0 <= eos < vocab]] = -float("inf")
            chosen[i] = argmax_index(row)
    return chosen


def _mask_eos_below_min_tokens(scores: torch.Tensor, requests: list[Request]) -> set[int]:
    """Mask the EOS ids of the rows still below their ``min_new_tokens``; returns those rows."""
    rows, cols = [], []
    for i, request in enumerate(requests):
        if len(request.output_token_ids) < request.stopping.min_new_tokens:
            for eos in request.stopping.eos_token_ids:
                if 0 <= eos < scores.shape[-1]:
                    rows.append(i)
                    cols.append(eos)
    if rows:
        scores[rows, cols] = -float("inf")
    return set(rows)


def _record_outputs(
    logits: torch.Tensor,
    scores: torch.Tensor,
    chosen: list[int],
    requests: list[Request],
    raw: dict[int, torch.Tensor] | None = None,
) -> None:
    if not any(
        r.sampling.output_scores or r.sampling.output_logits or r.sampling.output_logprobs for r in requests
    ):
        return
    logprobs = None
    for i, request in enumerate(requests):
        params = request.sampling
        if request.finish_reason == "error":  # failed in this step: it emits no token to record
            continue
        if params.output_scores:
            request.scores.append(scores[i].to(device="cpu", copy=True))
        if params.output_logits:
            kept = raw.get(i) if raw else None
            request.logits.append(
                kept if kept is not None else logits[i].to(dtype=torch.float32, device="cpu", copy=True)
            )
        if params.output_logprobs:
            if logprobs is None:
                logprobs = torch.log_softmax(scores, dim=-1)
            request.logprobs.append(float(logprobs[i, chosen[i]]))
            if params.top_logprobs is not None:
                request.top_logprobs.append(top_logprobs(logprobs[i], chosen[i], params.top_logprobs))


def top_logprobs(row: torch.Tensor, chosen: int, k: int) -> dict[int, float]:
    """``{token id: log-probability}`` of the `k` most likely tokens of a ``[V]`` log-softmax row, and of
    the chosen token (vLLM's layout: k or k + 1 entries, most likely first, the chosen one last if it is
    not among them)."""
    values, ids = row.topk(min(k, row.shape[-1]))
    top = dict(zip(ids.tolist(), values.tolist()))
    top.setdefault(chosen, float(row[chosen]))
    return top
