"""Draft sources: who proposes the k tokens a speculating request verifies next step.

`NgramProposer` looks the continuation up in the request's own tokens (no second model);
`DraftModelProposer` (draft_model.py) runs a smaller model with the same vocabulary. A proposer never
changes what is emitted (verification does), only how many tokens a step yields.
"""

from __future__ import annotations

from typing import Any

from hfaccel.engine.request import Request, SpeculationCounts
from hfaccel.engine.speculative.ngram import propose_ngram


class NgramProposer:
    """Prompt lookup: the tokens after the latest earlier occurrence of the context's suffix."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, requests: list[Request], budgets: list[int]) -> list[list[int]]:
        """Drafts for each request, at most `budgets[i]` tokens each."""
        return [
            propose_ngram(r.all_token_ids, k, self.max_n, self.min_n) if k > 0 else []
            for r, k in zip(requests, budgets)
        ]


def make_proposer(config: Any) -> NgramProposer | None:
    """The draft source an `EngineConfig` names (None: no speculation). A draft model (``speculative``
    set to a model object) needs the engine's cache geometry: the engine builds its
    `DraftModelProposer` itself."""
    if config.speculative is None:
        return None
    if config.speculative == "ngram":
        return NgramProposer()
    raise ValueError(f"unknown speculative method {config.speculative!r}")


def speculative_stats(source: SpeculationCounts) -> dict[str, float]:
    """Drafted / accepted counters of a request or an engine, with the acceptance rate and the mean
    number of drafts kept per verification step."""
    drafted, accepted, steps = source.drafted, source.accepted, source.steps
    return {
        "spec_drafted": drafted,
        "spec_accepted": accepted,
        "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
        "spec_mean_accepted_length": accepted / steps if steps else 0.0,
    }
