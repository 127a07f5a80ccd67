"""OpenAI's ``presence_penalty`` and ``frequency_penalty`` as a transformers logits processor.

OpenAI defines them on the logits before sampling: ``logit[j] -= c[j] * frequency + (c[j] > 0) *
presence``, where ``c[j]`` counts token ``j`` among the tokens generated so far (the prompt's are not
counted; vLLM counts the same way). transformers has no such processor, so this one runs as a custom
``logits_processor``, which transformers' ``generate`` (and the engine, which keeps its order) applies
after its own processors (``repetition_penalty``, ``logit_bias``) and before its sampling warpers
(temperature, top-k, top-p, min-p): the penalty is in logit units, as OpenAI's.

A processor sees each row as its prompt followed by what was generated, so it must know where the
prompt ends. A call's rows come from one prompt (chat) or a list of prompts (legacy completions); a row
is matched to the prompt it begins with, which is unambiguous as long as no prompt of the list begins
with another (`prefix_clash` finds the pair that makes it ambiguous, which the server refuses).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor


def prefix_clash(prompts: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """``(i, j)`` with prompt ``i`` beginning with prompt ``j`` and longer than it, or None (equal
    prompts are no clash: their rows count alike)."""
    order = sorted(range(len(prompts)), key=lambda k: list(prompts[k]))
    # Sorted, the prompts that begin with a prompt P follow P (and its copies) directly.
    for before, after in zip(order, order[1:]):
        shorter, longer = list(prompts[before]), list(prompts[after])
        if len(longer) > len(shorter) and longer[: len(shorter)] == shorter:
            return after, before
    return None


class OutputTokenPenalties(LogitsProcessor):
    """Subtract ``frequency * count + presence * (count > 0)`` from each token's score, counting the
    tokens each row generated after its prompt (one of `prompts`, none beginning with another)."""

    def __init__(self, prompts: Sequence[Sequence[int]], presence: float, frequency: float) -> None:
        if not prompts:
            raise ValueError("OutputTokenPenalties needs the call's prompts")
        clash = prefix_clash(prompts) if len(prompts) > 1 else None
        if clash is not None:
            raise ValueError(
                f"prompt {clash[0]} begins with prompt {clash[1]}: their rows cannot be told apart"
            )
        self.presence = float(presence)
        self.frequency = float(frequency)
        self._prompts: dict[int, set[tuple[int, ...]]] = {}
        for prompt in prompts:
            self._prompts.setdefault(len(prompt), set()).add(tuple(prompt))

    def prompt_length(self, row: torch.Tensor) -> int:
        """The length of the prompt `row` (``[L]`` token ids) begins with."""
        if len(self._prompts) == 1 and len(next(iter(self._prompts.values()))) == 1:
            return next(iter(self._prompts))  # one prompt: every row begins with it
        ids = row.tolist()
        for length, prompts in self._prompts.items():
            if tuple(ids[:length]) in prompts:
                return length
        raise ValueError("a row begins with none of the call's prompts")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        penalties = torch.zeros_like(scores)
        for i, row in enumerate(input_ids):
            generated = row[self.prompt_length(row) :]
            if generated.numel() == 0:
                continue
            counts = torch.bincount(generated[generated < vocab], minlength=vocab).to(scores.dtype)
            penalties[i] = self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores - penalties
