"""Draft sources: who proposes the k tokens a speculating request verifies next step.

`NgramProposer` looks the continuation up in the request's own tokens (no second model). A proposer
never changes what is emitted (verification does), only how many tokens a step yields.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfaccel.engine.request import Request
from hfaccel.engine.speculative.ngram import propose_ngram


@dataclass
class SpeculativeStats:
    """Drafting counters of one request (or a whole run)."""

    steps: int = 0  # verification steps with at least one draft
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean drafts kept per verification step."""
        return self.accepted / self.steps if self.steps else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.steps += 1
            self.drafted += drafted
            self.accepted += accepted

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_drafted": self.drafted,
            "spec_accepted": self.accepted,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_accepted_length": self.mean_accepted_length,
        }


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
