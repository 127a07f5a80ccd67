"""Drafting: after each step, the next step's drafts for every decoding request that speculates."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hfaccel.engine.request import Request

# A request stops speculating once its acceptance stays below the configured rate after this many drafts.
MIN_DRAFTS_JUDGED = 16


def propose_drafts(running: Iterable[Request], default: Any, config: Any, max_model_len: int) -> None:
    """Set ``speculation.drafts`` of every running request that decodes and speculates, from its own draft
    source and length where it has one (`Request.speculation.proposer`, `Request.speculation.num_drafts`), else from
    `default` (the engine's proposer) and ``config.num_speculative_tokens``. A request whose acceptance
    stays below ``config.speculative_min_acceptance`` stops speculating. Requests of one source are
    drafted together."""
    groups: dict[int, tuple[Any, list[Request], list[int]]] = {}
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
            _, candidates, budgets = groups.setdefault(id(proposer), (proposer, [], []))
            candidates.append(request)
            budgets.append(min(k, room - 1))
    for proposer, candidates, budgets in groups.values():
        for request, drafts in zip(candidates, proposer.propose(candidates, budgets)):
            request.speculation.drafts = list(drafts)
