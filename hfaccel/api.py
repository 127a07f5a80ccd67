"""The public entry points: `patch`, `unpatch` and offline `generate`."""

from __future__ import annotations

import copy
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from hfaccel.config import EngineConfig
from hfaccel.engine.request import Request
from hfaccel.patches.attention import register_attention
from hfaccel.patches.generate import (
    PatchState,
    has_default_lengths,
    patched_generate,
    prepare_config,
    row_rules,
    unsupported_reason,
    warn_fallback,
)
from hfaccel.patches.models import check_model

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@dataclass
class Completion:
    """One prompt's result from `hfaccel.generate`.

    Attributes:
        prompt_token_ids: the prompt as token ids.
        token_ids: generated token ids only (an EOS that ended it included, as HF returns it).
        text: the generated text (special tokens skipped), when a tokenizer is known.
        finish_reason: ``"stop"`` (an EOS token) or ``"length"`` (max_new_tokens / max_length / context).
        metrics: seconds: ``queue_s`` (arrival to first scheduled), ``ttft_s`` (time to first token),
            ``tpot_s`` (mean time per output token after the first), ``itl_max_s`` (longest gap between
            two tokens), ``e2e_s`` (arrival to finish); and ``num_cached_prompt_tokens`` (prefix-cache
            hits), ``num_preemptions``.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict[str, float] = field(default_factory=dict)


def patch(model: Any, config: EngineConfig | None = None, **overrides: Any) -> Any:
    """Make `model.generate` run on the hfaccel engine; returns the same model object.

    Registers the "hfaccel" attention function with transformers' ``AttentionInterface`` and binds a
    drop-in ``generate`` on this instance (other instances of the class are untouched). Ordinary
    ``model(...)`` forward calls keep the model's own attention. Calling it again on a patched model
    only updates the engine config (given fields). Unknown or invalid config values raise ValueError.
    """
    state: PatchState | None = getattr(model, "_hfaccel", None)
    if state is not None:
        if config is not None or overrides:
            state.config = (config or state.config).with_overrides(**overrides)
            state.engine = None
        return model
    check_model(model)
    engine_config = (config or EngineConfig()).with_overrides(**overrides)
    register_attention()
    instance_generate = model.__dict__.get("generate")
    model._hfaccel = PatchState(
        config=engine_config, original_generate=model.generate, instance_generate=instance_generate
    )
    model.generate = types.MethodType(patched_generate, model)
    return model


def unpatch(model: Any) -> Any:
    """Undo `patch`: the original `generate` comes back exactly and the KV cache is released."""
    state: PatchState | None = model.__dict__.pop("_hfaccel", None)
    if state is None:
        return model
    if state.instance_generate is None:
        del model.generate
    else:
        model.generate = state.instance_generate
    state.engine = None
    return model


def is_patched(model: Any) -> bool:
    """Whether `patch` has been applied to this model instance."""
    return "_hfaccel" in getattr(model, "__dict__", {})


def generate(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    progress: bool = True,
    **generate_kwargs: Any,
) -> list[Completion]:
    """Complete many prompts in one continuous batch; results come back in prompt order.

    Args:
        model: a transformers causal LM, patched or not (an unpatched one is patched for this call only).
        prompts: strings (need `tokenizer`), token-id lists, or chat message lists (need `tokenizer`,
            rendered with its chat template and the generation prompt).
        tokenizer: used to encode string/chat prompts and to decode `Completion.text`.
        generation_config: one config for all prompts, or a list with one per prompt.
        progress: show a progress bar over requests.
        **generate_kwargs: generation arguments applied to every prompt (e.g. ``max_new_tokens=64``).

    Every prompt is checked before any runs: an empty prompt, one longer than the model's context, or
    a bad generation argument raises ValueError and nothing is queued.
    """
    if isinstance(prompts, (str, torch.Tensor)):
        raise ValueError("prompts must be a list (of strings, token-id lists or chat message lists)")
    if not prompts:
        return []
    configs = _per_prompt_configs(generation_config, len(prompts))
    if was_patched := is_patched(model):
        state: PatchState = model._hfaccel
    else:
        patch(model)
        state = model._hfaccel
    try:
        encoded = [_encode(p, tokenizer, i) for i, p in enumerate(prompts)]
        plans = [_plan(model, state, ids, cfg, generate_kwargs) for ids, cfg in zip(encoded, configs)]
        engine_rows = [plan for plan in plans if isinstance(plan, Request)]
        if engine_rows:
            state.get_engine(model).run(engine_rows, progress=progress)
        return [_completion(plan, tokenizer) for plan in plans]
    finally:
        if not was_patched:
            unpatch(model)


def _per_prompt_configs(
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None, count: int
) -> list[GenerationConfig | None]:
    if generation_config is None or isinstance(generation_config, GenerationConfig):
        return [generation_config] * count
    configs = list(generation_config)
    if len(configs) != count:
        raise ValueError(
            f"generation_config has {len(configs)} entries for {count} prompts; give one per prompt"
        )
    return configs


def _encode(prompt: Prompt, tokenizer: Any, index: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompts[{index}] is a string: pass tokenizer= to encode it")
        return list(tokenizer(prompt)["input_ids"])
    items = list(prompt)
    if items and isinstance(items[0], dict):
        if tokenizer is None:
            raise ValueError(f"prompts[{index}] is a chat: pass tokenizer= to apply its chat template")
        rendered = tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True)
        ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
        return [int(t) for t in ids]
    if not all(isinstance(t, int) or (isinstance(t, torch.Tensor) and t.numel() == 1) for t in items):
        raise ValueError(f"prompts[{index}] must be a string, a list of token ids or a list of chat messages")
    if not items:
        raise ValueError(f"prompts[{index}] is empty: a prompt needs at least one token")
    return [int(t) for t in items]


@dataclass
class _Fallback:
    """A prompt the engine cannot serve, completed by transformers' own generate."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str


def _plan(
    model: Any, state: PatchState, ids: list[int], config: GenerationConfig | None, kwargs: dict[str, Any]
) -> Request | _Fallback:
    has_default_max, has_default_min = has_default_lengths(model, config, kwargs)
    prepared, _ = prepare_config(model, config, dict(kwargs))
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    reason = unsupported_reason(prepared)
    if reason is not None:
        warn_fallback(state, reason)
        output = state.original_generate(input_ids, generation_config=copy.deepcopy(prepared))
        new = output[0, len(ids) :].tolist()
        eos = prepared.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return _Fallback(ids, new, "stop" if new and new[-1] in eos_ids else "length")
    model._prepare_special_tokens(prepared, True, device=device)  # one unpadded row: no mask needed
    stopping, processors = row_rules(model, prepared, input_ids, has_default_max, has_default_min)
    if stopping.max_new_tokens <= 0:
        return _Fallback(ids, [], "length")
    return state.get_engine(model).make_request(ids, stopping, processors)


def _completion(plan: Request | _Fallback, tokenizer: Any) -> Completion:
    if isinstance(plan, _Fallback):
        prompt, tokens, reason, metrics = plan.prompt_token_ids, plan.token_ids, plan.finish_reason, {}
    else:
        prompt, tokens, reason = plan.prompt_token_ids, plan.output_token_ids, plan.finish_reason
        metrics = {
            **plan.metrics.as_dict(),
            "num_cached_prompt_tokens": plan.num_cached_prompt_tokens,
            "num_preemptions": plan.num_preemptions,
        }
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    return Completion(list(prompt), list(tokens), text, reason or "length", metrics)
