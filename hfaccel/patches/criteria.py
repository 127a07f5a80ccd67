"""generate's custom ``stopping_criteria``, run per row on the engine.

HF calls its merged `StoppingCriteriaList` once per step with the whole batch, ``criteria(input_ids,
scores)``: ``input_ids`` ``[B, L]`` (each row's left padding, prompt and generated tokens so far) and
``scores`` the tuple of the processed scores of every step so far when ``return_dict_in_generate`` and
``output_scores`` are set, else None; a row stops when any criterion returns True for it. The engine
calls the custom criteria for one row after each of its new tokens, with that row's ids ``[1, L]``
(its left padding restored from `Request.processor_prefix`) and its own scores ``[1, V]`` per step, and
stops the row (``finish_reason="stop"``) when the result is True. HF's built-in criteria (max length,
EOS, stop strings) stay the engine's own rules; a custom criterion is never held back by
``min_new_tokens`` (HF's is not either).

What is not served, and why (`unsupported_reason`): a custom criterion of a type HF builds itself for
this call (HF puts it in place of its own, e.g. an `EosTokenCriteria` with other ids), and a batch
without an EOS criterion (HF keeps generating real tokens for a row a criterion stopped, padding it only
when some criterion knows an EOS id; the engine's row stops there).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, StopStringCriteria


class RowCriteria:
    """One call's custom stopping criteria as a per-request check (`StoppingParams.criteria`)."""

    def __init__(self, criteria: Any, device: torch.device, config: GenerationConfig) -> None:
        self.criteria = StoppingCriteriaList(list(criteria))
        self.device = device
        # HF hands the criteria its `scores` tuple, which exists only with both flags set.
        self.with_scores = bool(config.return_dict_in_generate and config.output_scores)
        self._scores: dict[int, list[torch.Tensor]] = {}  # per request: its scores so far, [1, V] each

    def __call__(self, request: Any) -> bool:
        ids = torch.tensor([request.processor_ids()], dtype=torch.long, device=self.device)
        scores = None
        if self.with_scores:
            kept = self._scores.setdefault(id(request), [])
            kept.extend(s[None].to(self.device) for s in request.scores[len(kept) :])
            scores = tuple(kept)
        done = torch.as_tensor(self.criteria(ids, scores))
        if done.numel() != 1:  # HF's contract: one bool per row (its generate fails on another shape too)
            raise ValueError(
                f"a stopping criterion returned a tensor of shape {tuple(done.shape)} for a batch of 1 row "
                "(the engine asks each row alone): return one bool per row of input_ids"
            )
        return bool(done.any())


def builtin_types(model: Any, config: GenerationConfig) -> set[type]:
    """The types of the criteria HF's `_get_stopping_criteria` builds from `config` (a prepared config;
    the stop-string criterion by type only: building it indexes the whole vocabulary)."""
    plain = copy.copy(config)
    plain.stop_strings = None
    types = {type(c) for c in model._get_stopping_criteria(plain, StoppingCriteriaList())}
    if config.stop_strings:
        types.add(StopStringCriteria)
    return types


def unsupported_reason(model: Any, config: GenerationConfig, criteria: Any, rows: int) -> str | None:
    """Why the engine cannot serve this call's stopping rules as HF applies them, or None.

    `config`: the prepared config, special tokens included (`_prepare_special_tokens`); `criteria`:
    generate's custom ``stopping_criteria`` (or None); `rows`: sequences in the batch (num_return_sequences
    copies included)."""
    custom = list(criteria) if criteria is not None else []
    if not custom and not config.stop_strings:
        return None
    builtin = builtin_types(model, config)
    replaced = sorted({type(c).__name__ for c in custom if type(c) in builtin})
    if replaced:
        return (
            f"a custom {', '.join(replaced)} in stopping_criteria (transformers uses it in place of the one "
            "it builds from the generation config)"
        )
    # HF pads a stopped row only when some criterion has an `eos_token_id` (of its own ones, EOS's).
    has_eos = EosTokenCriteria in builtin or any(hasattr(c, "eos_token_id") for c in custom)
    if rows > 1 and not has_eos and (custom or config.stop_strings):
        what = "stopping_criteria" if custom else "stop_strings"
        return (
            f"{what} on a batch without an eos_token_id (transformers keeps generating the tokens of a "
            "row that stopped, until every row has)"
        )
    return None
