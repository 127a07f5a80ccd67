"""HF's output layouts beyond plain sampling's (`generate.generate_output`), built from the engine's
finished requests: the cache ``return_dict_in_generate`` returns (a `DynamicCache`, or the `StaticCache`
HF returns for ``cache_implementation="static"``) gathered from the requests' paged KV, and beam
search's output (its hypotheses as ``sequences``, and for ``return_dict_in_generate`` its
``sequences_scores``, ``beam_indices`` and per-step ``scores`` / ``logits``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from hfaccel.engine.request import Request
from hfaccel.patches.arguments import CACHE_NAME
from hfaccel.patches.state_outputs import beam_rows, state_fields


def dynamic_cache(
    model: Any,
    requests: list[Request],
    prompt_width: int,
    width: int,
    device: Any,
    columns: list[torch.Tensor] | None = None,
    layered: bool = True,
) -> Any:
    """The `DynamicCache` HF's generate would return, gathered from the requests' paged KV (`layered`:
    with the model's layer types, whose sliding layers keep their window's tokens only; else every layer
    whole, what `static_cache` replays): per layer ``[B, Hkv, prompt_width + width - 1, D]``, each row's
    kept prompt tokens at its `columns` (default: right-aligned, as left padding leaves them) and its
    generated tokens after the prompt width. Masked positions hold zeros: HF holds the K/V of the masked
    tokens there, which no later token attends to (and for a row that finished before the longest one,
    the K/V of the pad tokens it kept generating)."""
    from transformers import DynamicCache

    length = prompt_width + width - 1
    places = []
    for i, request in enumerate(requests):
        prompt_len = len(request.prompt_token_ids)
        kept = torch.arange(prompt_width - prompt_len, prompt_width) if columns is None else columns[i]
        places.append(torch.cat([kept, torch.arange(prompt_width, length)]))
    cache = DynamicCache(config=model.config) if layered else DynamicCache()
    for layer in range(len(requests[0].kv_snapshot)):
        k0 = requests[0].kv_snapshot[layer][0]
        keys = torch.zeros(
            (len(requests), k0.shape[1], length, k0.shape[2]), dtype=k0.dtype, device=k0.device
        )
        values = torch.zeros_like(keys)
        for i, request in enumerate(requests):
            k, v = request.kv_snapshot[layer]
            place = places[i][: k.shape[0]].to(k.device)
            keys[i, :, place] = k[: len(place)].transpose(0, 1)
            values[i, :, place] = v[: len(place)].transpose(0, 1)
        cache.update(keys.to(device), values.to(device), layer)
    for request in requests:
        request.kv_snapshot = None
    return cache


def static_cache(
    model: Any, max_length: int, max_cache_len: int | None, built: Any, prefill: int, extra: int = 0
) -> Any:
    """The `StaticCache` HF's generate returns for ``cache_implementation="static"``, holding `built`'s
    keys and values (every layer whole). Sized as HF sizes it: its ``max_length - 1`` (plus `extra`, the
    embeddings' width for a prompt of embeddings only), at least ``max_cache_len`` and the size of the
    model's previous static cache, which HF keeps on the model (to avoid recompiles) and so does this.
    A sliding layer's keys go in as HF's generate puts them, the first `prefill` columns at once and then
    one token at a time, so its window rolls to the state HF's does; a full layer's go in at once."""
    from transformers import StaticCache

    length = max(max_length - 1 + extra, max_cache_len or 0, getattr(model, "_previous_max_cache_length", -1))
    model._previous_max_cache_length = length
    cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
    for index, layer in enumerate(built.layers):
        if not getattr(cache.layers[index], "is_sliding", True):  # a full layer: positions in order, at once
            cache.update(layer.keys, layer.values, index)
            continue
        cache.update(layer.keys[:, :, :prefill], layer.values[:, :, :prefill], index)
        for t in range(prefill, layer.keys.shape[-2]):
            cache.update(layer.keys[:, :, t : t + 1], layer.values[:, :, t : t + 1], index)
    return cache


def beam_output(
    config: GenerationConfig, prompts: torch.Tensor, results: list[list[tuple[list[int], float]]]
) -> torch.Tensor:
    """HF's `sequences` for beam search: per prompt its hypotheses (best first), each the prompt row as
    given then its tokens, cut to the longest returned one and filled past each one's end with HF's
    fill value (the pad id if it is non-zero, else the first EOS id; -1 without EOS)."""
    pad, eos = config._pad_token_tensor, config._eos_token_tensor
    fill = pad or eos[0] if eos is not None else -1  # HF's own expression, zero pad id included
    fill = int(fill)
    width = max((len(tokens) for hyps in results for tokens, _ in hyps), default=0)
    count = sum(len(hyps) for hyps in results)
    out = torch.full((count, prompts.shape[1] + width), fill, dtype=torch.long)
    row = 0
    for prompt, hyps in zip(prompts.cpu(), results):
        for tokens, _ in hyps:
            out[row, : prompts.shape[1]] = prompt
            out[row, prompts.shape[1] : prompts.shape[1] + len(tokens)] = torch.tensor(
                tokens, dtype=torch.long
            )
            row += 1
    return out.to(prompts.device)


def beam_dict_output(
    config: GenerationConfig,
    prompts: torch.Tensor,
    requests: list[Request],
    model: Any,
    columns: list[torch.Tensor] | None = None,
    prompt_width: int | None = None,
    recompute: bool = False,
) -> GenerateBeamDecoderOnlyOutput:
    """HF's `GenerateBeamDecoderOnlyOutput` for beam search requests (one per prompt): the hypotheses
    (`beam_output`), ``sequences_scores`` (with ``output_scores``, as HF), ``beam_indices`` (per
    hypothesis, the flat running beam ``prompt * num_beams + beam`` each token continued, -1 past its
    end), per-step ``scores`` / ``logits`` ``[B * num_beams, V]`` (and hidden states / attentions,
    `state_outputs`), and the cache HF holds after its last
    reorder: the final running beams, each without its last token (`columns`: each prompt's kept
    columns, for masks that are not left padding; `prompt_width`: the prompt's width in the cache and
    the states, when `prompts` are not as wide: embeddings without ids; `recompute`: HF ran without a
    cache). HF goes on stepping a prompt
    whose search has ended until every prompt's has; the engine stops it, so its later rows differ
    (warned)."""
    groups = [r.beam_group for r in requests]
    sequences = beam_output(config, prompts, [g.results for g in groups])
    kv_width = prompts.shape[1] if prompt_width is None else prompt_width
    nb = config.num_beams
    width = sequences.shape[1] - prompts.shape[1]
    indices = torch.full((sequences.shape[0], width), -1, dtype=torch.int32)
    row = 0
    for p, group in enumerate(groups):
        for hypothesis in group.search.result_beam_indices():
            indices[row, : len(hypothesis)] = torch.tensor(hypothesis, dtype=torch.int32) + p * nb
            row += 1
    steps = max(g.search.generated for g in groups)
    if any(g.search.generated < steps for g in groups):
        warnings.warn(
            "hfaccel: in a beam search whose prompts finished at different steps, transformers goes on "
            "stepping the finished prompts' running beams until the last one finishes; hfaccel stops them, "
            "so their later scores/logits are -inf and their rows of the returned cache hold the beams as "
            "they stood when their search ended (sequences, sequences_scores and beam_indices are HF's)",
            UserWarning,
            stacklevel=4,
        )
    cache = None
    slots = [slot for g in groups for slot in g.slots]
    if all(slot.kv_snapshot is not None for slot in slots) and len(slots) == nb * len(groups):
        places = None if columns is None else [c for c in columns for _ in range(nb)]
        layered = config.cache_implementation != "static"  # a static one is built from it (`static_cache`)
        cache = dynamic_cache(model, slots, kv_width, steps, prompts.device, places, layered)
    rows = functools.partial(beam_rows, groups, kv_width, columns)
    states = state_fields(requests[0].sampling, rows, kv_width, steps, recompute)
    scores = [g.step_scores for g in groups] if config.output_scores else None
    logits = [g.step_logits for g in groups] if config.output_logits else None
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=(
            torch.tensor([s for g in groups for _, s in g.results], device=prompts.device)
            if config.output_scores
            else None
        ),
        scores=_beam_steps(scores, steps, nb) if scores is not None else None,
        logits=_beam_steps(logits, steps, nb) if logits is not None else None,
        beam_indices=indices.to(prompts.device),
        **states,
        **{CACHE_NAME: cache},
    )


def _beam_steps(per_group: list[list[torch.Tensor]], steps: int, nb: int) -> tuple[torch.Tensor, ...]:
    """Per step, every group's ``[nb, V]`` rows stacked; -inf for a group whose search had ended."""
    sample = next(t for rows in per_group for t in rows)
    filler = torch.full((nb, sample.shape[-1]), -float("inf"), device=sample.device)
    return tuple(
        torch.cat([rows[t] if t < len(rows) else filler for rows in per_group]) for t in range(steps)
    )
