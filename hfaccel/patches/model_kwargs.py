"""Model inputs of generate that the engine serves besides ``input_ids`` and ``attention_mask``.

transformers 5.23's generate builds ``position_ids`` from the attention mask when none are given
(``attention_mask.cumsum(-1) - 1``, padding set to 0) and extends given ones by one per new token (the
last position + 1, + 2, ...). The engine numbers each row's tokens 0, 1, 2, ... after stripping its left
padding, which is the same numbering on every real token (padding positions are masked, so their
values change nothing): given ``position_ids`` that agree on every real token are served, others (an
offset, packed documents, 3-D rope positions) fall back. ``logits_to_keep`` only chooses which
positions' logits the forward returns; generate reads the last one, so an int is served (the engine
computes the logits it samples from, whatever the value). A tensor of indices falls back.
"""

from __future__ import annotations

from typing import Any

import torch

SERVED = frozenset({"position_ids", "logits_to_keep"})  # checked here, beside input_ids / attention_mask


def unsupported_reason(
    model_kwargs: dict[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> str | None:
    """Why the engine cannot serve these `position_ids` / `logits_to_keep` as HF would, or None.
    `attention_mask`: the call's ``[B, L]`` mask (or the one HF would make)."""
    keep = model_kwargs.get("logits_to_keep")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        return f"logits_to_keep={_short(keep)} (only an int is served)"
    positions = model_kwargs.get("position_ids")
    if positions is None:
        return None
    reason = (
        "position_ids other than the attention mask's (attention_mask.cumsum(-1) - 1 on each row's tokens)"
    )
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.is_floating_point():
        return reason
    try:
        positions = positions.to(attention_mask.device).expand(input_ids.shape)
    except RuntimeError:
        return reason
    mask = attention_mask.bool()
    expected = attention_mask.long().cumsum(-1) - 1
    return None if torch.equal(positions[mask].long(), expected[mask]) else reason


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)
