"""OpenAI's ``presence_penalty`` and ``frequency_penalty`` as a transformers logits processor.

OpenAI defines them on the logits before sampling: ``logit[j] -= c[j] * frequency + (c[j] > 0) *
presence``, where ``c[j]`` counts token ``j`` among the tokens generated so far (the prompt's are not
counted; vLLM counts the same way). transformers has no such processor, so this one runs as a custom
``logits_processor``, which transformers' ``generate`` (and the engine, which keeps its order) applies
after its own processors (``repetition_penalty``, ``logit_bias``) and before its sampling warpers
(temperature, top-k, top-p, min-p): the penalty is in logit units, as OpenAI's.

Each row's generated tokens are found after the prompt it began with (`prompt_rows.PromptRows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from hfaccel.server.prompt_rows import PromptRows


class OutputTokenPenalties(LogitsProcessor):
    """Subtract ``frequency * count + presence * (count > 0)`` from each token's score, counting the
    tokens each row generated after its prompt (one of `prompts`, none beginning with another)."""

    def __init__(self, prompts: Sequence[Sequence[int]], presence: float, frequency: float) -> None:
        self.rows = PromptRows(prompts)
        self.presence = float(presence)
        self.frequency = float(frequency)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        penalties = torch.zeros_like(scores)
        for i, row in enumerate(input_ids):
            generated = self.rows.generated(row)
            if generated.numel() == 0:
                continue
            counts = torch.bincount(generated[generated < vocab], minlength=vocab).to(scores.dtype)
            penalties[i] = self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores - penalties
