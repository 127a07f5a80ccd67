"""HF's per-step ``hidden_states`` and ``attentions`` (``output_hidden_states`` / ``output_attentions``
with ``return_dict_in_generate``), laid out from the tokens the engine recorded
(`engine/recorded_states.py`).

HF's step 0 feeds the padded prompt (hidden states ``[B, W, H]``, attentions ``[B, Hq, W, W]``), and step
s the token chosen at step s - 1 (``[B, 1, H]``, ``[B, Hq, 1, W + s]``); without a cache it recomputes
every token at every step, so step s covers all ``W + s`` of them. Each row's kept prompt tokens sit at
their mask's columns, a masked last token (right padding) at the last column, and each token's
probabilities at the columns of the keys it saw. A beam search's rows are its running beams: at step 0
the prompt (HF computes it once per beam), at step s each beam's own last token, and without a cache
its whole history, each token as the beam that fed it computed it (`BeamGroup.lineage`).

Masked prompt positions and a row's steps after it finished hold zeros, with a warning: HF computes
them from masked or pad tokens, which no kept token attends to.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.engine.request import Request


@dataclass
class RowRecords:
    """Where one output row's recorded tokens are: `prompt` (``("prompt", p)`` keys), and
    `output(step, k)`: the record of generated token k as HF's step `step` shows it (None if the row
    had finished); `places` the kept prompt tokens' columns, `steps` how many steps the row ran."""

    prompt: dict[tuple[str, int], Any]
    output: Callable[[int, int], Any]
    places: list[int]
    steps: int


def request_rows(
    requests: list[Request], prompt_width: int, columns: list[torch.Tensor] | None
) -> list[RowRecords]:
    """One row per request (sampling and greedy search)."""
    return [
        RowRecords(
            request.recorded,
            lambda step, k, recorded=request.recorded: recorded.get(("output", k)),
            _places(request, prompt_width, None if columns is None else columns[i]),
            len(request.output_token_ids),
        )
        for i, request in enumerate(requests)
    ]


def beam_rows(groups: list[Any], prompt_width: int, columns: list[torch.Tensor] | None) -> list[RowRecords]:
    """``num_beams`` rows per prompt (its `BeamGroup`): beam j's tokens as its lineage fed them."""
    rows = []
    for i, group in enumerate(groups):
        places = _places(group.handle, prompt_width, None if columns is None else columns[i])
        for j in range(group.params.num_beams):

            def output(step: int, k: int, group: Any = group, j: int = j) -> Any:
                if step >= len(group.lineage) or j >= len(group.slots):
                    return None
                return group.slots[group.lineage[step][j][k]].recorded.get(("output", k))

            rows.append(RowRecords(group.handle.recorded, output, places, len(group.lineage) - 1))
    return rows


def state_fields(
    sampling: Any, rows: Callable[[], list[RowRecords]], prompt_width: int, steps: int, recompute: bool
) -> dict[str, Any]:
    """The output's ``attentions`` / ``hidden_states`` fields the call's `sampling` asks for, from the
    `rows` it builds (sampling or beam search); empty when it asks for neither."""
    wanted = [
        name
        for name, flag in (("attentions", "output_attentions"), ("hidden_states", "output_hidden_states"))
        if getattr(sampling, flag)
    ]
    if not wanted:
        return {}
    built = rows()
    return {name: recorded_steps(built, name, prompt_width, steps, recompute) for name in wanted}


def recorded_steps(
    rows: list[RowRecords], name: str, prompt_width: int, steps: int, whole: bool = False
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """HF's per-step `name` (``"hidden_states"`` or ``"attentions"``) for `rows`; `whole`: HF ran
    without a cache (see the module docstring)."""
    attentions = name == "attentions"
    sample = next(iter(rows[0].prompt.values()))
    layers = sample.attentions if attentions else sample.hidden_states
    out = []
    for step in range(steps):
        count = prompt_width + step if whole else (prompt_width if step == 0 else 1)
        per_layer = []
        for layer, like in enumerate(layers):
            shape = (
                (len(rows), like.shape[0], count, prompt_width + step)
                if attentions
                else (len(rows), count, like.shape[-1])
            )
            tensor = like.new_zeros(shape)
            for i, row_records in enumerate(rows):
                for row, keys, record in _step_tokens(row_records, prompt_width, step, whole):
                    values = (record.attentions if attentions else record.hidden_states)[layer]
                    if attentions:
                        tensor[i, :, row, keys] = values
                    else:
                        tensor[i, row] = values
            per_layer.append(tensor)
        out.append(tuple(per_layer))
    fed = [len(r.places) + (("prompt", len(r.places)) in r.prompt) for r in rows]  # a masked last is fed
    if any(count < prompt_width or r.steps < steps for count, r in zip(fed, rows)):
        warnings.warn(
            f"hfaccel: {name} at masked prompt positions (padding) and of a row's steps after it finished "
            "are zeros; transformers computes them from the masked or pad tokens, which no kept token "
            "attends to",
            UserWarning,
            stacklevel=4,
        )
    return tuple(out)


def _places(request: Request, prompt_width: int, columns: torch.Tensor | None) -> list[int]:
    kept = len(request.prompt_token_ids)
    where = torch.arange(prompt_width - kept, prompt_width) if columns is None else columns
    return where[:kept].tolist()


def _step_tokens(rows: RowRecords, width: int, step: int, whole: bool) -> list[tuple[int, list[int], Any]]:
    """The tokens HF's step `step` fed for one row: (row in the step, key columns, record); with
    `whole`, every token up to that step (generated token k at row ``W + k``)."""
    places, prompt = rows.places, rows.prompt
    tokens = []
    if step == 0 or whole:
        tokens = [(places[p], places[: p + 1], prompt[("prompt", p)]) for p in range(len(places))]
        masked_last = prompt.get(("prompt", len(places)))  # right padding: fed last, seeing the kept ones
        if masked_last is not None:
            tokens.append((width - 1, places, masked_last))
    for k in range(0 if whole else max(step - 1, 0), step):
        record = rows.output(step, k)
        if record is not None:
            tokens.append((width + k if whole else 0, places + list(range(width, width + k + 1)), record))
    return tokens
