"""Prompts as the offline entry points take them: strings, token-id lists or chat message lists (one
prompt or many), encoded to token ids, with one generation config and one adapter per prompt."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from transformers import GenerationConfig

from hfaccel.patches.lora import check_adapter_names
from hfaccel.patches.lora import unsupported_reason as lora_unsupported_reason

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def per_prompt_configs(
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None, count: int
) -> list[GenerationConfig | None]:
    if generation_config is None or isinstance(generation_config, GenerationConfig):
        return [generation_config] * count
    if isinstance(generation_config, Mapping) or not isinstance(generation_config, Sequence):
        raise TypeError(
            f"generation_config must be a GenerationConfig or a list of one per prompt, got "
            f"{type(generation_config).__name__}: pass GenerationConfig(**fields), or the fields as keyword "
            "arguments"
        )
    configs = list(generation_config)
    for i, config in enumerate(configs):
        if config is not None and not isinstance(config, GenerationConfig):
            raise TypeError(f"generation_config[{i}] must be a GenerationConfig, got {type(config).__name__}")
    if len(configs) != count:
        raise ValueError(
            f"generation_config has {len(configs)} entries for {count} prompts; give one per prompt"
        )
    return configs


DICT_PROMPT = (
    "pass prompts=enc['input_ids'] (token-id lists: tokenize without padding and without "
    "return_tensors) or the strings themselves with tokenizer="
)


def prompt_list(prompts: Any) -> list[Any]:
    """The prompts as a list; a single prompt (a string, a token-id list, one conversation) is a batch
    of one. A tokenizer's output (dict / BatchEncoding) and 2-D tensors are refused, saying what to pass."""
    if isinstance(prompts, Mapping):
        raise ValueError(f"prompts is a dict (a tokenizer's output?), not a list of prompts: {DICT_PROMPT}")
    if isinstance(prompts, str):
        return [prompts]
    if _is_array(prompts) and prompts.dtype.kind in "iu":  # a tokenizer's return_tensors="np": a tensor's
        prompts = torch.as_tensor(prompts)
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts.tolist()]
        raise ValueError(
            f"prompts is a {prompts.dim()}-D tensor or array: pass a list of token-id lists (the pad tokens of a "
            "padded batch would become part of the prompts), or call model.generate(input_ids=..., "
            "attention_mask=...)"
        )
    if prompts is None or not isinstance(prompts, Iterable):
        raise ValueError(
            f"prompts must be a string, a list of token ids, a list of chat messages, or a list of these; got "
            f"{type(prompts).__name__}"
        )
    items = list(prompts)
    if items and all(_is_token_id(t) for t in items):
        return [items]  # one token-id list (ints, numpy's, 0-d tensors: a 1-D tensor listed)
    if items and isinstance(items[0], Mapping) and "role" in items[0]:
        return [items]  # one conversation
    return items


def _is_array(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "ndim")


def _is_token_id(value: Any) -> bool:
    """An int (numpy's too) or a 0-d integer tensor or array: one token id."""
    if isinstance(value, numbers.Integral):
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not (value.is_floating_point() or value.is_complex())
    return _is_array(value) and value.ndim == 0 and value.dtype.kind in "iu"


def per_prompt_adapters(adapter: str | Sequence[str | None] | None, count: int) -> list[str | None]:
    if adapter is None or isinstance(adapter, str):
        return [adapter] * count
    if isinstance(adapter, (Mapping, AbstractSet)) or not isinstance(adapter, Iterable):  # (a list, an array)
        raise TypeError(
            f"adapter must be an adapter's name, None, or a list (in prompt order) of one per prompt; got "
            f"{type(adapter).__name__}"
        )
    adapters = list(adapter)
    for i, name in enumerate(adapters):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"adapter[{i}] must be an adapter's name or None, got {type(name).__name__}")
    if len(adapters) != count:
        raise ValueError(f"adapter has {len(adapters)} entries for {count} prompts; give one per prompt")
    return adapters


def adapter_checks(model: Any, adapters: list[str | None]) -> dict[str, ValueError | str | None]:
    """Each adapter named in a call, checked once (a check walks every module): a ValueError (no LoRA
    layer holds it), a reason the engine cannot batch it (PEFT's generate then serves it), or None."""
    checks: dict[str, ValueError | str | None] = {}
    for name in {a for a in adapters if a is not None}:
        try:
            check_adapter_names(model, [name])
        except ValueError as error:
            checks[name] = error
            continue
        checks[name] = lora_unsupported_reason(model, [name])
    return checks


def check_tokenizer(tokenizer: Any) -> None:
    """A tokenizer decodes (`Completion.text`); refused up front, before anything runs, where it cannot."""
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(
            f"tokenizer must be a transformers tokenizer (AutoTokenizer.from_pretrained(...)), got "
            f"{type(tokenizer).__name__}"
        )


def encode_prompt(prompt: Prompt, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs tokenizer= to encode it")
        if not callable(tokenizer):
            raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
        ids = list(tokenizer(prompt)["input_ids"])
        if not ids:  # (the planner would name the tensor it became)
            raise ValueError("the prompt is empty: its text encodes to no token")
        return ids
    if isinstance(prompt, Mapping):
        raise ValueError(f"a prompt is a dict (a tokenizer's output?): {DICT_PROMPT}")
    if _is_array(prompt) and prompt.dtype.kind in "iu":
        prompt = torch.as_tensor(prompt)
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.flatten().tolist() if prompt.dim() <= 1 else prompt
    if isinstance(prompt, numbers.Integral):
        raise ValueError(
            "a prompt must be a string, a list of token ids or a list of chat messages, got an int"
        )
    items = list(prompt)
    if items and isinstance(items[0], dict):
        if tokenizer is None:
            raise ValueError("a chat prompt needs tokenizer= to apply its chat template")
        rendered = tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True)
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        return [int(t) for t in ids]
    if not all(_is_token_id(t) for t in items):
        kinds = sorted({type(t).__name__ for t in items if not _is_token_id(t)})
        raise ValueError(
            "a prompt must be a string, a list of token ids or a list of chat messages; this one holds "
            + ", ".join(kinds)
        )
    if not items:
        raise ValueError("the prompt is empty: a prompt needs at least one token")
    return [int(t) for t in items]
