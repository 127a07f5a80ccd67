"""Which prompt a logits processor's row began with, so that a processor reads only what was generated.

A processor sees each row as its prompt followed by the tokens generated so far. A call's rows come from
one prompt (chat, n choices) or a list of prompts (legacy completions); a row is matched to the prompt it
begins with, which is unambiguous as long as no prompt of the list begins with another, different one
(`prefix_clash` finds such a pair, which the server refuses for the processors that need it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def prefix_clash(prompts: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """``(i, j)`` with prompt ``i`` beginning with prompt ``j`` and longer than it, or None (equal
    prompts are no clash: their rows read alike)."""
    order = sorted(range(len(prompts)), key=lambda k: list(prompts[k]))
    # Sorted, the prompts that begin with a prompt P follow P (and its copies) directly.
    for before, after in zip(order, order[1:]):
        shorter, longer = list(prompts[before]), list(prompts[after])
        if len(longer) > len(shorter) and longer[: len(shorter)] == shorter:
            return after, before
    return None


class PromptRows:
    """The prompts of one call, to find where a row's generated tokens begin."""

    def __init__(self, prompts: Sequence[Sequence[int]]) -> None:
        if not prompts:
            raise ValueError("a processor that reads generated tokens needs the call's prompts")
        clash = prefix_clash(prompts) if len(prompts) > 1 else None
        if clash is not None:
            raise ValueError(
                f"prompt {clash[0]} begins with prompt {clash[1]}: their rows cannot be told apart"
            )
        self._by_length: dict[int, set[tuple[int, ...]]] = {}
        for prompt in prompts:
            self._by_length.setdefault(len(prompt), set()).add(tuple(prompt))
        only = len(self._by_length) == 1 and len(next(iter(self._by_length.values()))) == 1
        self._only_length = next(iter(self._by_length)) if only else None

    def prompt_length(self, row: torch.Tensor) -> int:
        """The length of the prompt `row` (``[L]`` token ids) begins with."""
        if self._only_length is not None:
            return self._only_length  # one prompt: every row begins with it
        ids = row.tolist()
        for length, prompts in self._by_length.items():
            if tuple(ids[:length]) in prompts:
                return length
        raise ValueError("a row begins with none of the call's prompts")

    def generated(self, row: torch.Tensor) -> torch.Tensor:
        """The tokens `row` generated after its prompt."""
        return row[self.prompt_length(row) :]
