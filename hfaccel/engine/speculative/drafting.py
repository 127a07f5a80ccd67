"""Drafting: after each step, the next step's drafts for every decoding request that speculates, each
with its own length, chosen so that speculation never slows the batch (seed 001 §6: acceptance varies
across requests).

A request's j-th draft is worth ``a ** j`` expected tokens (``a``: its own acceptance, the chance a draft
is accepted once those before it were, `SpeculationCounts.acceptance`, which starts from the engine's
acceptance so far: a workload whose drafts fail stops drafting new requests too) and costs one more
verified row.
The step-time model (`engine/cost_model.py`, learnt from this engine's own steps) prices the step and
a row: with ``T`` seconds for the batch's ``N`` expected tokens, a draft is worth adding only if its
tokens per second beat the batch's, ``a ** j / row_s > N / T``. Drafts are taken best first, across
requests, while that holds (each one taken raises both ``N`` and ``T``), up to each request's limit. At
batch 1 a row costs little against the weights a step streams, so long drafts pay; in a large
compute-bound batch a row costs as much as a sequence's decode, so only sure drafts do, down to none.
Before the model has seen enough steps, every request drafts its full length. Sampled requests are
priced as greedy ones: their tokens do not depend on how many drafts a step verifies (`rejection.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hfaccel.engine.request import Request

# A request stops speculating once its acceptance stays below the configured rate after this many drafts.
MIN_DRAFTS_JUDGED = 16


@dataclass(frozen=True)
class DraftPrice:
    """What the step-time model says of the next step: its seconds without drafts, the expected tokens
    it emits (one per decoding sequence), and the seconds one more verified row adds."""

    step_s: float
    tokens: float
    row_s: float


def draft_price(cost_model: Any, running: Iterable[Request]) -> DraftPrice | None:
    """The next step's price from the step-time model (None until it has seen enough steps): the
    decoding sequences' step without drafts, and a verified row at the price of a prefill token."""
    fit = cost_model.fit()
    if fit is None:
        return None
    decoding = [r for r in running if r.num_uncomputed_tokens == 1]
    step = fit.predict(len(decoding), 0, sum(r.num_tokens for r in decoding))
    return DraftPrice(step_s=step, tokens=float(len(decoding)), row_s=max(fit.coefficients[2], 1e-6))


def draft_lengths(acceptance: Sequence[float], limits: Sequence[int], price: DraftPrice) -> list[int]:
    """Each request's number of drafts (at most its limit): drafts best first while they raise the
    step's tokens per second (see the module doc)."""
    lengths = [0] * len(acceptance)
    options = sorted(
        ((a**j, -j, i) for i, (a, limit) in enumerate(zip(acceptance, limits)) for j in range(1, limit + 1)),
        reverse=True,
    )
    tokens, seconds = price.tokens, price.step_s
    for gain, minus_j, i in options:
        if gain * seconds <= price.row_s * tokens:  # no later option gains more, and the bar only rises
            break
        if -minus_j == lengths[i] + 1:  # a request's drafts are taken in order
            lengths[i] += 1
            tokens += gain
            seconds += price.row_s
    return lengths


def propose_drafts(
    scheduler: Any, default: Any, config: Any, max_model_len: int, cost_model: Any = None
) -> None:
    """Set ``speculation.drafts`` of every running request that decodes and speculates, from its own draft
    source and length where it has one (`Request.speculation.proposer`, `Request.speculation.num_drafts`), else from
    `default` (the engine's proposer) and ``config.num_speculative_tokens``; the length is a limit that
    `draft_lengths` cuts by the step-time model's price (none before it has seen enough steps, or
    without `cost_model`), each request's acceptance estimated from its own drafts and, before them, the
    scheduler's (``spec_totals``). A request whose acceptance stays below
    ``config.speculative_min_acceptance`` stops speculating. Requests of one source are drafted together."""
    running = scheduler.running
    candidates: list[tuple[Any, Request, int]] = []
    for request in running:
        proposer = request.speculation.proposer if request.speculation.proposer is not None else default
        if proposer is None:
            continue
        if not request.speculation.enabled or request.is_finished or request.num_uncomputed_tokens != 1:
            continue
        k = request.speculation.num_drafts or config.num_speculative_tokens
        drafted = request.speculation.drafted
        if (
            drafted >= MIN_DRAFTS_JUDGED
            and request.speculation.accepted < config.speculative_min_acceptance * drafted
        ):
            request.speculation.enabled = False
            continue
        # The step emits up to k + 1 tokens: never past max_new_tokens or the context.
        room = min(
            request.stopping.max_new_tokens - len(request.output_token_ids),
            max_model_len - request.num_tokens,
        )
        if room - 1 > 0:
            candidates.append((proposer, request, min(k, room - 1)))
    price = None if cost_model is None else draft_price(cost_model, running)
    if price is not None:
        prior = scheduler.spec_totals.acceptance()
        acceptance = [r.speculation.acceptance(prior) for _, r, _ in candidates]
        lengths = draft_lengths(acceptance, [k for *_, k in candidates], price)
        candidates = [(p, r, cut) for (p, r, _), cut in zip(candidates, lengths) if cut > 0]
    groups: dict[int, tuple[Any, list[Request], list[int]]] = {}
    for proposer, request, k in candidates:
        _, requests, budgets = groups.setdefault(id(proposer), (proposer, [], []))
        requests.append(request)
        budgets.append(k)
    for proposer, requests, budgets in groups.values():
        for request, drafts in zip(requests, proposer.propose(requests, budgets)):
            request.speculation.drafts = list(drafts)
