"""Which keyword arguments `generate` takes, checked before anything runs.

The acceptance set is transformers' own, not a list kept here: a name is accepted if it is a parameter
of ``GenerationMixin.generate`` (``streamer``, ``logits_processor``, ..., plus ``tokenizer``,
``assistant_tokenizer`` and ``trust_remote_code`` that it pops from its kwargs), an attribute of the
generation config the call would use (``GenerationConfig`` fields and custom entries of the model's
``generation_config``), or a model input that HF's ``_validate_model_kwargs`` lets through (the
parameters of ``prepare_inputs_for_generation`` / ``forward``, transformers' common kwargs, and any
name whose value is None). HF raises ValueError for everything else; so does hfaccel, earlier, with
suggestions for the names other engines use.

The KV cache's name differs across the versions hfaccel admits. Up to transformers 5.23 it is
``past_key_values`` (in ``forward``, ``generate`` and their outputs). From 5.24 it is ``cache``:
``generate`` and ``forward`` still take ``past_key_values`` (and ``cache_params``), renamed to ``cache``
with a FutureWarning, and outputs answer the old attribute names. Everything that passes or reads the
cache goes through `CACHE_NAME`, so one code path serves both.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

CACHE_NAME = (
    "cache"
    if "cache" in {field.name for field in dataclasses.fields(GenerateDecoderOnlyOutput)}
    else "past_key_values"
)
# The names generate renames to CACHE_NAME (none where the old name is still the name).
DEPRECATED_CACHE_NAMES = ("past_key_values", "cache_params") if CACHE_NAME == "cache" else ()


def normalize_cache_argument(kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`kwargs` with a deprecated cache name renamed to `CACHE_NAME`, with the FutureWarning and the
    both-names error transformers' own ``generate`` gives (`where` names the function)."""
    renamed = dict(kwargs)
    for old in DEPRECATED_CACHE_NAMES:
        if old not in renamed:
            continue
        if CACHE_NAME in renamed:
            raise ValueError(f"{where} got both `{CACHE_NAME}` and `{old}`: pass `{CACHE_NAME}` only")
        warnings.warn(
            f"`{old}` is deprecated in transformers and will be removed in version 6.0.0 for {where}. "
            f"Use `{CACHE_NAME}` instead.",
            FutureWarning,
            stacklevel=3,
        )
        renamed[CACHE_NAME] = renamed.pop(old)
    return renamed


def output_cache(output: Any) -> Any:
    """The cache a model or generate output holds (None when it holds none)."""
    return getattr(output, CACHE_NAME, None)


# Parameters of HF's generate, and the names it pops from **kwargs before reading the config.
GENERATE_PARAMETERS = frozenset(
    name for name in inspect.signature(GenerationMixin.generate).parameters if name not in ("self", "kwargs")
) | {"tokenizer", "assistant_tokenizer", "trust_remote_code"}

# Names from vLLM, OpenAI, TGI and llama.cpp, with what to write instead.
OTHER_ENGINES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "n": "num_return_sequences",
    "best_of": "num_return_sequences",
    "stop": "stop_strings",
    "stop_sequences": "stop_strings",
    "stop_token_ids": "eos_token_id",
    "ignore_eos": "min_new_tokens=max_new_tokens",
    "presence_penalty": "repetition_penalty (HF's penalty is multiplicative)",
    "frequency_penalty": "repetition_penalty (HF's penalty is multiplicative)",
    "repeat_penalty": "repetition_penalty",
    "top_logprobs": "hfaccel.generate(logprobs=k)",
    "echo": "hfaccel.generate(prompt_logprobs=k)",
    "random_seed": "seed",
}


# Arguments of HF generate that the engine does not serve, with the reason shown to the user.
UNSUPPORTED_ARGUMENTS = {
    "negative_prompt_ids": "negative_prompt_ids (classifier-free guidance)",
    "negative_prompt_attention_mask": "negative_prompt_attention_mask",
    "custom_generate": "custom_generate",
    "synced_gpus": "synced_gpus",
    "assistant_tokenizer": "assistant_tokenizer",
}


def unserved_argument(kwargs: Mapping[str, Any], config: GenerationConfig) -> str | None:
    """Why a call's arguments or its prepared `config` go to transformers' generate (None: the engine
    serves them)."""
    reason = next((text for name, text in UNSUPPORTED_ARGUMENTS.items() if given(kwargs.get(name))), None)
    # use_cache neither True nor False once prepared (a call's None, a config's 0; a config's None is
    # its default, True): transformers (5.24) builds a cache unless it is False, then feeds the whole
    # sequence each step unless it is truthy; its tokens match neither True's nor False's.
    if reason is None and not isinstance(config.use_cache, bool):
        reason = f"use_cache={config.use_cache!r} (neither True nor False)"
    return reason


def given(value: Any) -> bool:
    """Whether an argument asks for something: not None, False or an empty list (their defaults)."""
    return value is not None and value is not False and not (isinstance(value, list) and len(value) == 0)


@functools.lru_cache(maxsize=1)
def _default_config() -> GenerationConfig:
    return GenerationConfig()


def _config_fields() -> list[str]:
    return sorted(_default_config().to_dict())


def is_config_name(model: Any, name: str, generation_configs: Iterable[Any] = ()) -> bool:
    """Whether `name` sets an attribute of the generation config HF would merge for this call."""
    configs = [_default_config(), getattr(model, "generation_config", None), *generation_configs]
    return any(config is not None and hasattr(config, name) for config in configs)


def is_model_input(model: Any, name: str, value: Any) -> bool:
    """Whether HF's `_validate_model_kwargs` lets `name` through (it names the model's inputs)."""
    validate = getattr(model, "_validate_model_kwargs", None)
    if validate is None:
        return value is None
    try:
        validate({name: value})
    except ValueError:
        return False
    return True


def suggestion(name: str, candidates: Iterable[str]) -> str | None:
    """What to write instead of `name`: another engine's equivalent, or a close spelling."""
    if name in OTHER_ENGINES:
        return OTHER_ENGINES[name]
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return close[0] if close else None


def check_generate_kwargs(
    model: Any,
    kwargs: Mapping[str, Any],
    where: str,
    generation_configs: Iterable[Any] = (),
    model_inputs: bool = True,
    own: Iterable[str] = (),
) -> None:
    """Raise ValueError listing every keyword argument HF's generate would not accept.

    `where` names the function in the message. ``model_inputs=False`` (hfaccel.generate and its
    siblings, whose prompts are lists) refuses model inputs such as ``attention_mask`` too, saying so.
    `own` are the caller's own parameter names (offered as suggestions).
    """
    configs = [c for c in generation_configs if c is not None]
    unknown, inputs = [], []
    for name, value in kwargs.items():
        if name in GENERATE_PARAMETERS or is_config_name(model, name, configs):
            continue
        if is_model_input(model, name, value):
            if not model_inputs and value is not None:
                inputs.append(name)
            continue
        unknown.append(name)
    if not unknown and not inputs:
        return
    candidates = [*_config_fields(), *GENERATE_PARAMETERS, *own]
    parts = []
    if unknown:
        described = []
        for name in unknown:
            hint = suggestion(name, candidates)
            described.append(f"{name!r} (did you mean {hint}?)" if hint else repr(name))
        parts.append(
            f"{where} got unknown keyword argument(s) {', '.join(described)}: it takes GenerationConfig "
            f"fields (max_new_tokens, do_sample, temperature, top_p, stop_strings, num_return_sequences, "
            f"...) and generate's own parameters"
            + (" and the model's inputs" if model_inputs else "")
            + " (transformers' generate refuses these names too)"
        )
    if inputs:
        parts.append(
            f"{where} takes prompts as lists, not model inputs: {inputs} cannot apply (prompts are not "
            "padded); pass tensors to model.generate instead"
        )
    raise ValueError("; ".join(parts))
