"""The drop-in `generate`: HF's arguments and output layout, the hfaccel engine underneath.

HF's own helpers (`_prepare_generation_config`, `_prepare_special_tokens`, `_prepare_generated_length`,
`_get_logits_processor`) turn the call into per-row stopping rules and logits processors, so merging
a request's arguments with the model's generation config follows HF's rules exactly. What the engine
does not serve yet goes to the original `generate`, with one warning that names the reason.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import Request, StoppingParams

# Arguments of HF generate that the engine does not serve yet, with the reason shown to the user.
_UNSUPPORTED_ARGUMENTS = {
    "stopping_criteria": "custom stopping_criteria",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn (constrained decoding)",
    "assistant_model": "assistant_model (assisted decoding)",
    "streamer": "streamer",
    "negative_prompt_ids": "negative_prompt_ids (classifier-free guidance)",
    "negative_prompt_attention_mask": "negative_prompt_attention_mask",
    "custom_generate": "custom_generate",
    "logits_processor": "custom logits_processor",
    "synced_gpus": "synced_gpus",
}
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
_SERVED_MODEL_KWARGS = {"input_ids", "attention_mask"}


@dataclass
class PatchState:
    """What `hfaccel.patch` keeps on a model: the engine config, the engine, and what to restore."""

    config: EngineConfig
    original_generate: Callable[..., Any]
    instance_generate: Any  # `generate` from the instance __dict__ before patching, or None
    engine: Engine | None = None
    warned: set[str] = field(default_factory=set)

    def get_engine(self, model: torch.nn.Module) -> Engine:
        """The model's engine, (re)built if absent or if the model moved to another device or dtype."""
        param = next(model.parameters())
        engine = self.engine
        if engine is None or engine.device != param.device or engine.model_dtype != param.dtype:
            self.engine = None  # let the old cache go before allocating a new one
            self.engine = Engine(model, self.config)
        return self.engine


def unsupported_reason(generation_config: GenerationConfig) -> str | None:
    """Why the engine cannot serve this (prepared) generation config, or None if it can."""
    mode = generation_config.get_generation_mode()
    if mode is GenerationMode.SAMPLE:
        return "sampling (do_sample=True) is not served by the engine yet"
    if mode is not GenerationMode.GREEDY_SEARCH:
        return f"generation mode {mode.value!r}"
    if (generation_config.num_return_sequences or 1) > 1:
        return "num_return_sequences > 1"
    for name in _UNSUPPORTED_OUTPUTS:
        if getattr(generation_config, name, False):
            return f"{name}=True"
    if generation_config.stop_strings:
        return "stop_strings"
    if generation_config.max_time is not None:
        return "max_time"
    if generation_config.cache_implementation not in (None, "dynamic"):
        return f"cache_implementation={generation_config.cache_implementation!r}"
    if getattr(generation_config, "token_healing", False):
        return "token_healing"
    if (generation_config.guidance_scale or 1) != 1:
        return "guidance_scale"
    if getattr(generation_config, "watermarking_config", None) is not None:
        return "watermarking_config"
    return None


def warn_fallback(state: PatchState, reason: str) -> None:
    """One warning per reason per model: the call runs on transformers' own generate."""
    if reason in state.warned:
        return
    state.warned.add(reason)
    warnings.warn(
        f"hfaccel: {reason} - this call falls back to transformers' original generate (no speed-up)",
        UserWarning,
        stacklevel=4,
    )


def prepare_config(
    model: torch.nn.Module, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """HF's merge of call arguments, `generation_config` and the model's defaults; validated."""
    generation_config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    generation_config.validate()
    return generation_config, model_kwargs


def has_default_lengths(
    model: torch.nn.Module, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[bool, bool]:
    """HF's test of whether max_length / min_length come from nobody (so its defaults apply)."""
    flags = []
    for name in ("max_length", "min_length"):
        flags.append(
            kwargs.get(name) is None
            and (generation_config is None or getattr(generation_config, name) is None)
            and getattr(model.generation_config, name) is None
        )
    return flags[0], flags[1]


def row_rules(
    model: torch.nn.Module,
    generation_config: GenerationConfig,
    input_ids: torch.Tensor,
    has_default_max: bool,
    has_default_min: bool,
) -> tuple[StoppingParams, LogitsProcessorList | None]:
    """Stopping rules and logits processors for rows of a ``[B, L]`` (possibly left-padded) input.

    HF counts max/min length on the padded width, so every row gets ``max_length - L`` new tokens at
    most and ``min_length - L`` at least: the same numbers, given to each unpadded row.
    """
    config = copy.deepcopy(generation_config)
    width = input_ids.shape[1]
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max,
        has_default_min_length=has_default_min,
        model_input_name="input_ids",
        input_ids_length=width,
        inputs_tensor=input_ids,
    )
    model._validate_generated_length(config, width, has_default_max)
    eos = config._eos_token_tensor
    eos_ids = frozenset(eos.flatten().tolist()) if eos is not None else frozenset()
    stopping = StoppingParams(
        max_new_tokens=config.max_length - width,
        min_new_tokens=max(0, (config.min_length or 0) - width),
        eos_token_ids=eos_ids,
    )
    # min length is applied by the sampler; every other processor HF would build runs per row.
    config.min_length, config.min_new_tokens = 0, None
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=width,
        encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(),
        device=input_ids.device,
    )
    return stopping, (processors if len(processors) else None)


def patched_generate(
    self: torch.nn.Module,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    **kwargs: Any,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Drop-in replacement for `model.generate`, bound on a patched instance."""
    state: PatchState = self._hfaccel
    reason = next((text for name, text in _UNSUPPORTED_ARGUMENTS.items() if _given(kwargs.get(name))), None)
    if reason is None and inputs is not None and kwargs.get("input_ids") is not None:
        reason = "both inputs and input_ids"
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if reason is None and (input_ids is None or input_ids.dim() != 2 or input_ids.dtype != torch.long):
        reason = "inputs other than a 2-D tensor of token ids"
    if reason is not None:
        warn_fallback(state, reason)
        return state.original_generate(inputs=inputs, generation_config=generation_config, **kwargs)

    call_kwargs = {k: v for k, v in kwargs.items() if k != "input_ids"}
    has_default_max, has_default_min = has_default_lengths(self, generation_config, call_kwargs)
    config, model_kwargs = prepare_config(self, generation_config, call_kwargs)
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _SERVED_MODEL_KWARGS)
    reason = unsupported_reason(config) or (f"model kwargs {extra}" if extra else None)
    if reason is not None:
        warn_fallback(state, reason)
        return state.original_generate(inputs=inputs, generation_config=generation_config, **kwargs)

    attention_mask = model_kwargs.get("attention_mask")
    self._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device)
    if attention_mask is None:
        attention_mask = self._prepare_attention_mask_for_generation(input_ids, config, model_kwargs)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}"
        )
    stopping, processors = row_rules(self, config, input_ids, has_default_max, has_default_min)
    sequences = input_ids
    if stopping.max_new_tokens > 0:
        engine = state.get_engine(self)
        keep = attention_mask.bool().cpu()
        rows = input_ids.cpu()
        requests = [
            engine.make_request(rows[i][keep[i]].tolist(), stopping, processors) for i in range(len(rows))
        ]
        engine.run(requests)
        sequences = _right_padded(input_ids, requests, _pad_id(config))
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _given(value: Any) -> bool:
    return value is not None and not (isinstance(value, list) and len(value) == 0)


def _pad_id(config: GenerationConfig) -> int:
    pad = config._pad_token_tensor
    return int(pad.flatten()[0]) if pad is not None else 0


def _right_padded(input_ids: torch.Tensor, requests: list[Request], pad_id: int) -> torch.Tensor:
    """HF's layout: the prompt as given, then each row's new tokens, right-padded with `pad_id`."""
    width = max(len(r.output_token_ids) for r in requests)
    out = torch.full((input_ids.shape[0], input_ids.shape[1] + width), pad_id, dtype=torch.long)
    out[:, : input_ids.shape[1]] = input_ids.cpu()
    for i, request in enumerate(requests):
        out[i, input_ids.shape[1] : input_ids.shape[1] + len(request.output_token_ids)] = torch.tensor(
            request.output_token_ids, dtype=torch.long
        )
    return out.to(input_ids.device)
