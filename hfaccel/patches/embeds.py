"""``model.generate(inputs_embeds=E, attention_mask=M)`` (with or without ``input_ids``) on the engine.

What HF's generate does for a decoder-only model, and so what this serves:

- **Embeddings only.** HF's ``input_ids`` start empty (``[B, 0]``): the output holds the new tokens only,
  a streamer is first given the empty prompt, the logits processors see the generated tokens only (HF
  warns that the repetition penalty and n-gram bans then skip the prompt), ``max_new_tokens`` counts
  new tokens and an explicit ``max_length`` counts the embeddings too (``max_length - L`` new tokens).
  Without a mask every position is attended (HF cannot infer padding from embeddings).
- **Embeddings and ids** (``[B, L, H]`` and ``[B, L]``): the prompt is computed from the embeddings; the
  output starts with the ids; processors and lengths see the ids, as for a prompt of ids.

Either way HF turns the cache on (``use_cache=True``), so ``return_dict_in_generate`` returns
``past_key_values`` even under ``use_cache=False``. Each row's unpadded embeddings go to the engine with
placeholder ids (`engine/prompt_inputs.py`): the prefill steps feed the model embeddings, decode steps
ids, and the prefix cache never matches such a prompt by its ids.

Falls back (with the usual warning): embeddings that are not a ``[B, L, H]`` float tensor of the model's
hidden size and dtype, ids whose shape is not ``[B, L]``, and a model run by tensor, pipeline or expert
parallelism.
"""

from __future__ import annotations

from typing import Any

import torch

from hfaccel.engine.prompt_inputs import attach_prompt_embeds
from hfaccel.engine.request import Request


def unsupported_reason(model: Any, embeds: Any, input_ids: Any) -> str | None:
    """Why these ``inputs_embeds`` (and ``input_ids``, or None) are not served on the engine."""
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or not embeds.is_floating_point():
        return "inputs_embeds other than a [batch, length, hidden] float tensor"
    hidden = model.get_input_embeddings().weight.shape[-1]
    if embeds.shape[2] != hidden:
        return f"inputs_embeds of width {embeds.shape[2]} (the model's hidden size is {hidden})"
    dtype = next(model.parameters()).dtype
    if embeds.dtype != dtype:
        return f"inputs_embeds in {embeds.dtype} for a model in {dtype}"
    if embeds.shape[1] == 0:
        return "empty inputs_embeds"
    if input_ids is not None and (
        not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != tuple(embeds.shape[:2])
    ):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        return f"input_ids {shape} beside inputs_embeds {tuple(embeds.shape)} (not one id per embedding)"
    return None


def visible_and_engine_ids(
    embeds: torch.Tensor, input_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``input_ids`` for the call (the given ids, or ``[B, 0]``: what the output starts with and
    what processors see) and the ids the engine's prompts are made of (the given ids, or placeholders)."""
    if input_ids is not None:
        return input_ids, input_ids
    batch, length = embeds.shape[:2]
    visible = torch.ones((batch, 0), dtype=torch.long, device=embeds.device)
    return visible, torch.zeros((batch, length), dtype=torch.long, device=embeds.device)


def attach(
    engine: Any,
    requests: list[Request],
    embeds: torch.Tensor,
    keep: torch.Tensor,
    copies: int,
    ids_given: bool,
) -> None:
    """Give request ``i`` (row ``i // copies`` of the call, copies sharing one tensor) its row's unpadded
    embeddings. Without ids, its processors see only the generated tokens, as HF's do."""
    rows: dict[int, torch.Tensor] = {}
    for i, request in enumerate(requests):
        row = i // copies
        if row not in rows:
            kept = keep[i].clone()
            kept[-1] = True  # a masked last token is fed too (`Request.masked_last`)
            rows[row] = embeds[row][kept.to(embeds.device)].detach()
        attach_prompt_embeds(engine, request, rows[row], hide_prompt=not ids_given)
