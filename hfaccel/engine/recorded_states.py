"""What the model computed for each token of the requests that ask (HF's ``output_hidden_states`` and
``output_attentions``): a step with such a request runs eager, asks the model for its hidden states,
and has the attention layers return their probabilities (`kernels/attention_probs.py`); this module
keeps each recorded request's share, token by token.

A token is keyed by what it is to the caller, not by its place in the cache: ``("prompt", i)`` for the
request's i-th prompt token (a masked last token included, while it is one), ``("output", k)`` for its
k-th generated token fed back. A recomputed token (after a preemption) overwrites its record with the
same values, and a rejected draft's record is overwritten by the token fed in its place (a position
past the last token fed is never read). Recording requests take no prefix-cache hits: their prompt
must be computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hfaccel.engine.request import Request


@dataclass
class TokenStates:
    """One token's record: per layer its hidden state ``[H]`` (the embeddings first, HF's
    ``hidden_states``), and per attention layer its probabilities ``[Hq, S]`` over the first S keys of
    its sequence (``attentions``); None for what the request did not ask."""

    hidden_states: tuple[torch.Tensor, ...] | None
    attentions: tuple[torch.Tensor, ...] | None


def store(
    recorded: list[tuple[int, Request, int, int, int]],
    hidden_states: tuple[torch.Tensor, ...] | None,
    attentions: tuple[torch.Tensor, ...] | None,
) -> None:
    """Keep each recorded request's tokens of one step: `recorded` holds (packed index of its first
    token, request, first position, token count, its sequence's length in the step's layout);
    `hidden_states` per layer ``[1, T, H]``, `attentions` per layer ``[1, Hq, T, S]``."""
    for first, request, start, count, seq_len in recorded:
        sampling = request.sampling
        prompt_len = len(request.prompt_token_ids)
        for j in range(count):
            row = first + j
            position = start + j
            key = ("prompt", position) if position < prompt_len else ("output", position - prompt_len)
            visible = seq_len - count + j + 1  # keys up to its own (a query-only token: up to the one before)
            hidden = (
                tuple(layer[0, row].clone() for layer in hidden_states)
                if sampling.output_hidden_states and hidden_states is not None
                else None
            )
            probs = (
                tuple(layer[0, :, row, :visible].clone() for layer in attentions)
                if sampling.output_attentions and attentions is not None
                else None
            )
            request.recorded[key] = TokenStates(hidden, probs)
