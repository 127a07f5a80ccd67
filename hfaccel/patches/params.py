"""HF generation arguments -> engine request parameters, through HF's own helpers.

`_prepare_generation_config`, `_prepare_generated_length` and `_get_logits_processor` decide what a
call means, so merging a request's arguments with the model's generation config follows HF's rules
exactly; this module only reshapes the result into `StoppingParams` and `SamplingParams`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import numbers
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation import logits_process
from transformers.generation.configuration_utils import GenerationMode

from hfaccel.engine.request import SamplingParams, StoppingParams
from hfaccel.patches.criteria import RowCriteria
from hfaccel.patches.stop_strings import after, openai_min_tokens, stop_string_check

_SERVED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# transformers 5.23's cache implementations whose numerics are its default dynamic cache's: the KV is kept
# whole and in the model's dtype (static: preallocated to max_length, masked past the tokens written;
# offloaded: moved to the CPU between layers; the deprecated aliases are static caches whose layer types
# come from the model config, as the engine's do). The engine keeps the same KV in its own paged cache,
# so greedy results are the same. Not served: "quantized" (a quantized KV cache: other numerics) and
# "paged" (transformers' own continuous batching, with another output layout).
SERVED_CACHE_IMPLEMENTATIONS = (
    None,
    "dynamic",
    "offloaded",
    "static",
    "offloaded_static",
    "sliding_window",
    "hybrid",
    "hybrid_chunked",
    "offloaded_hybrid",
    "offloaded_hybrid_chunked",
)
_CACHE_REASONS = {
    "quantized": "cache_implementation='quantized' (a quantized KV cache changes the numerics)",
    "paged": "cache_implementation='paged' (transformers' own continuous batching)",
}
# Processors that read only the scores (not the token ids): safe to run on many rows at once.
_SCORE_ONLY = tuple(
    getattr(logits_process, name)
    for name in (
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TopHLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "LogitNormalization",
    )
    if hasattr(logits_process, name)
)


def prepare_config(
    model: torch.nn.Module, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """HF's merge of call arguments, `generation_config` and the model's defaults; validated."""
    generation_config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    check_number_types(generation_config)
    generation_config.validate()
    validate_values(generation_config)
    return generation_config, model_kwargs


def prepare_special_tokens(
    model: torch.nn.Module, config: GenerationConfig, has_attention_mask: bool, device: Any, batch_size: int
) -> None:
    """HF's own filling-in of the config's special-token tensors (EOS, pad, BOS) for a call (its warnings
    about an unset mask are for a batch of several rows only)."""
    model._prepare_special_tokens(config, has_attention_mask, device=device, batch_size=batch_size)


# Numeric fields a call may set. One that is not a number at all (``temperature="0.5"``) makes HF's
# `validate` or a processor fail with a bare TypeError: refused first, named. One that is a number but
# not the integer a field needs (``top_k=2.5``) is refused only where HF reads it (sampling's when
# sampling, beam search's in beam search); elsewhere HF warns, and so runs.
_REALS = (
    "temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
    "encoder_repetition_penalty", "length_penalty", "diversity_penalty", "max_time",
)  # fmt: skip
_INTEGERS = (
    "max_new_tokens", "min_new_tokens", "max_length", "min_length", "num_beams", "num_return_sequences",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
)  # fmt: skip


_LENGTHS = frozenset({"max_new_tokens", "max_length"})  # HF refuses a float min_length itself

# Within `one_default_length_warning`: whether transformers already warned about its default max_length.
_default_length_warned: ContextVar[list[bool] | None] = ContextVar("hfaccel_length_warned", default=None)


@contextmanager
def one_default_length_warning() -> Iterator[None]:
    """Within this block (one call of many prompts, each prepared alone), transformers' warning about its
    default max_length comes once, as one generate call gives it, not once per prompt."""
    token = _default_length_warned.set([False])
    try:
        yield
    finally:
        _default_length_warned.reset(token)


def _integer_scalar(value: Any) -> bool:
    """An integer that is not a Python int: a numpy integer, a one-element integer tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_floating_point() and not value.is_complex()
    return isinstance(value, numbers.Integral) and not isinstance(value, (int, bool))


def check_number_types(config: GenerationConfig) -> None:
    """Raise ValueError naming a numeric field whose value is not a number (before HF's `validate`)."""
    for name in (*_REALS, *_INTEGERS, "top_k", "num_beam_groups"):
        value = getattr(config, name, None)
        if value is not None and not isinstance(value, (numbers.Real, torch.Tensor)):
            raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


def validate_values(config: GenerationConfig) -> None:
    """Raise ValueError naming the parameter for values HF would only reject late (or never)."""
    beams = isinstance(config.num_beams, int) and config.num_beams > 1
    integers = _INTEGERS + (("top_k",) if config.do_sample else ()) + (("num_beam_groups",) if beams else ())
    for name in integers:
        value = getattr(config, name, None)
        if name in _LENGTHS and isinstance(value, float) and value.is_integer():
            # HF compares lengths with it (``max_new_tokens=4.0`` generates 4): the same int, served.
            value = int(value)
            setattr(config, name, value)
        elif _integer_scalar(value) or isinstance(value, bool):
            # numpy's int64, a 0-d integer tensor, a bool: HF computes with them as the ints they are
            # (``num_return_sequences=True`` gives one; as a bool it reached torch's repeat_interleave)
            value = int(value)
            setattr(config, name, value)
        if value is not None and not isinstance(value, (numbers.Integral, torch.Tensor)):
            raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):  # (checked where HF reads them)
        if _integer_scalar(value := getattr(config, name, None)):
            setattr(config, name, int(value))
    if config.num_beams is not None and config.num_beams < 1:  # transformers divides by it
        raise ValueError(f"num_beams must be >= 1, got {config.num_beams}")
    if config.num_return_sequences is not None and config.num_return_sequences < 0:
        # 0 is served as 1, as HF does
        raise ValueError(
            f"num_return_sequences must be >= 1 (0 counts as 1), got {config.num_return_sequences}"
        )
    if config.max_new_tokens is not None and config.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {config.max_new_tokens}")
    if config.do_sample:
        if config.temperature is not None and not config.temperature > 0:
            raise ValueError(f"temperature must be a strictly positive float, got {config.temperature}")
        # 0 keeps the top token, as in HF; 1 or more (or NaN) filters nothing, as HF builds no top-p warper
        if config.top_p is not None and config.top_p < 0:
            raise ValueError(f"top_p must be >= 0, got {config.top_p}")
        if config.top_k is not None and config.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {config.top_k}")
        if config.min_p is not None and not 0 <= config.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {config.min_p}")
    if config.repetition_penalty is not None and not config.repetition_penalty > 0:
        raise ValueError(
            f"repetition_penalty must be a strictly positive float, got {config.repetition_penalty}"
        )


def unsupported_reason(
    config: GenerationConfig, assisted: bool = False, device: torch.device | None = None
) -> str | None:
    """Why the engine cannot serve this (prepared) generation config, or None if it can.

    ``assisted=True``: the caller serves prompt lookup (``prompt_lookup_num_tokens``) on the engine's
    speculative path (`patches/assisted.py`), so the mode is judged without it (greedy or sampling).
    `device`: the model's; transformers' offloaded caches need CUDA (elsewhere its generate raises, and
    so a call there falls back and raises the same)."""
    if assisted:
        for name in ("use_mtp", "assistant_early_exit"):
            if getattr(config, name, None) not in (None, False):
                return f"{name} (assisted decoding)"
        plain = copy.copy(config)
        plain.prompt_lookup_num_tokens = None
        mode = plain.get_generation_mode()
    else:
        mode = config.get_generation_mode()
    if mode not in _SERVED_MODES:
        return f"generation mode {mode.value!r}"
    implementation = config.cache_implementation
    if implementation not in SERVED_CACHE_IMPLEMENTATIONS:
        return _CACHE_REASONS.get(implementation, f"cache_implementation={implementation!r}")
    if implementation and "offloaded" in implementation and device is not None and device.type != "cuda":
        return (
            f"cache_implementation={implementation!r} on {device.type} (transformers offloads to CUDA only)"
        )
    if implementation not in (None, "dynamic", "offloaded") and _compiles_its_forward(config, device):
        return "compile_config with a static cache (the call asks for transformers' own compiled forward)"
    if getattr(config, "token_healing", False):
        return "token_healing"
    if (config.guidance_scale or 1) != 1:
        return "guidance_scale"
    watermark = getattr(config, "watermarking_config", None)
    # The green-list watermark reads each row alone (reseeded from the row's last tokens): served per
    # row. SynthID's keeps a state per batch row across steps, so it stays HF's.
    if watermark is not None and type(watermark).__name__ != "WatermarkingConfig":
        return f"watermarking_config ({type(watermark).__name__})"
    return None


def _compiles_its_forward(config: GenerationConfig, device: torch.device | None) -> bool:
    """An explicit `compile_config` where transformers honours it (an accelerator, or forced on every
    device): with a cache of fixed shape, HF's generate compiles the model's forward for the call."""
    compile_config = getattr(config, "compile_config", None)
    if compile_config is None or getattr(config, "disable_compile", False):
        return False
    accelerator = device is not None and device.type in ("cuda", "xpu", "neuron", "tpu")
    return accelerator or bool(getattr(compile_config, "_compile_all_devices", False))


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


def request_params(
    model: torch.nn.Module,
    config: GenerationConfig,
    input_ids: torch.Tensor,
    has_default_max: bool,
    has_default_min: bool,
    tokenizer: Any = None,
    output_logprobs: bool = False,
    top_logprobs: int | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
) -> tuple[StoppingParams, SamplingParams]:
    """Stopping and sampling parameters for the rows of a ``[B, L]`` (possibly left-padded) input.

    HF counts max/min length on the padded width, so every row gets ``max_length - L`` new tokens at
    most and ``min_length - L`` at least: the same numbers, given to each unpadded row.
    `attention_mask` (``[1, L]``, one row's) is what HF hands its processors as a model kwarg: the
    repetition penalty reads the row's padding length from it.

    `logits_processor` (generate's custom list) is merged into HF's own list by HF's
    `_get_logits_processor`, with its order and replacement rules; the list then runs per row, HF's
    min-length processors included (the engine's batched EOS mask is not used, so a custom processor
    sees the scores HF would show it). `stopping_criteria` (generate's custom list) runs per row after
    each new token (`patches/criteria.py`).
    With `inputs_embeds` (the prompt given as embeddings; `input_ids` are the ids beside them, or
    ``[B, 0]``) HF's length rules for embeddings apply. `prefix_allowed_tokens_fn` puts HF's
    `PrefixConstrainedLogitsProcessor` where HF puts it; `bind_prefix_constraint` then gives each row
    its own, asking with the batch index HF asks that row with.
    """
    config = copy.deepcopy(config)
    width = input_ids.shape[1]
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max,
        has_default_min_length=has_default_min,
        model_input_name="input_ids" if inputs_embeds is None else "inputs_embeds",
        input_ids_length=width,
        inputs_tensor=input_ids if inputs_embeds is None else inputs_embeds,
    )
    warned = _default_length_warned.get()  # (a call of many prompts: transformers warns once)
    warns = has_default_max and config.max_new_tokens is None  # transformers' condition for it
    quiet = warns and warned is not None and warned[0]
    if warns and warned is not None:
        warned[0] = True  # (before: it may warn, then refuse the prompt)
    model._validate_generated_length(config, width, has_default_max and not quiet)
    eos = config._eos_token_tensor
    stop_check = None
    if config.stop_strings is not None:  # "" or []: refused below (HF stops at once on "", raises on [])
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer= to generate")
        strings = [config.stop_strings] if isinstance(config.stop_strings, str) else list(config.stop_strings)
        stop_check = stop_string_check(tokenizer, strings)
        if held := openai_min_tokens():  # vLLM's min_tokens: no stop string ends a row before it
            stop_check = after(held, stop_check)
    custom = list(logits_processor) if logits_processor is not None else []
    in_hf_order = bool(custom) or prefix_allowed_tokens_fn is not None  # every processor runs as HF runs it
    criteria = None
    if stopping_criteria is not None and len(stopping_criteria) > 0:
        criteria = RowCriteria(stopping_criteria, input_ids.device, config)
    stopping = StoppingParams(
        max_new_tokens=config.max_length - width,
        # With custom processors (or a prefix constraint, which HF 5.24 lets force an EOS that the
        # min-length processor masked) HF's own min-length processors run (per row, in HF's order).
        min_new_tokens=0 if in_hf_order else max(0, (config.min_length or 0) - width),
        eos_token_ids=frozenset(eos.flatten().tolist()) if eos is not None else frozenset(),
        stop_check=stop_check,
        criteria=criteria,
        # HF's MaxTimeCriteria, timed from this call's start: every row stops at its next token after it
        deadline=None if config.max_time is None else time.time() + config.max_time,
    )
    if not in_hf_order:
        # min length is applied by the sampler, batched; every other processor HF builds is kept
        config.min_length, config.min_new_tokens = 0, None
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=width,
        encoder_input_ids=input_ids if inputs_embeds is None else inputs_embeds,
        logits_processor=LogitsProcessorList(custom),
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        device=input_ids.device,
        model_kwargs=None if attention_mask is None else {"attention_mask": attention_mask},
    )
    per_row, score_only = split_score_only(processors)
    sampling = SamplingParams(
        do_sample=bool(config.do_sample),
        processors=per_row or None,
        warpers=score_only or None,
        output_scores=bool(config.output_scores),
        output_logits=bool(config.output_logits),
        # Only a dict output carries them (HF ignores the flags otherwise); `planner._states_gate` judged them.
        output_hidden_states=bool(config.return_dict_in_generate and config.output_hidden_states),
        output_attentions=bool(config.return_dict_in_generate and config.output_attentions),
        output_logprobs=output_logprobs or top_logprobs is not None,
        top_logprobs=top_logprobs,
    )
    return stopping, sampling


def bind_prefix_constraint(
    sampling: SamplingParams, function: Callable[[int, torch.Tensor], list[int]], row: int
) -> SamplingParams:
    """`sampling` for row `row` (of the call's expanded batch: prompt i's copies are rows
    ``i * num_return_sequences + c``) of a call with ``prefix_allowed_tokens_fn`` (`function`): HF's
    processor asks the function with each row's batch index, ``row // group``, where the engine runs a
    row's processors on that row alone; so the row gets a processor of its own, at the same place in
    the list, asking with that index. The group is the one HF built its processor with (5.24:
    ``max(num_beams, num_return_sequences)``, so a prompt's copies share its index; 5.17: ``num_beams``,
    so each copy has its own). (HF forces a row whose allowed tokens all score -inf only when every row
    of its group is so, and otherwise samples from no token and fails; here the row alone is forced.)"""
    processors = sampling.processors or []
    bound = [
        logits_process.PrefixConstrainedLogitsProcessor(
            _AskedFor(function, row // max(1, int(getattr(p, "_num_beams", 1)))), 1
        )
        if type(p) is logits_process.PrefixConstrainedLogitsProcessor
        else p
        for p in processors
    ]
    return dataclasses.replace(sampling, processors=LogitsProcessorList(bound))


# Processors HF builds with the whole batch's prompts as "encoder" ids ([B, L], unexpanded) and applies
# to the [B * n, V] scores by row: each engine row runs them as its row of such a batch (`bind_batch_row`).
_BATCH_BUILT = (
    logits_process.EncoderRepetitionPenaltyLogitsProcessor,
    logits_process.EncoderNoRepeatNGramLogitsProcessor,
)


def uses_batch_prompts(config: GenerationConfig) -> bool:
    """Whether HF builds a processor of this call from the batch's prompts (the `encoder_*` options)."""
    return (config.encoder_repetition_penalty or 1.0) != 1.0 or bool(config.encoder_no_repeat_ngram_size)


def bind_batch_row(sampling: SamplingParams, row: int, rows: int) -> SamplingParams:
    """`sampling` for row `row` of a call of `rows` rows (prompt i's copies are rows ``i * n + c``) whose
    processors HF built from the batch's prompts: each such processor is narrowed to the one prompt HF's
    own indexing applies to that row (5.24 repeats the prompts per copy; 5.17's repetition penalty
    reaches the first B rows only and leaves the others alone), so a row pays for its prompt alone."""
    bound = []
    for processor in sampling.processors or []:
        if type(processor) in _BATCH_BUILT:
            prompt = _prompt_of_row(type(processor), _batch_size(processor), rows)[row]
            if prompt is None:
                continue  # HF's processor leaves this row's scores as they are
            processor = _narrowed(processor, prompt)
        bound.append(processor)
    return dataclasses.replace(sampling, processors=LogitsProcessorList(bound))


def _batch_size(processor: Any) -> int:
    if isinstance(processor, logits_process.EncoderNoRepeatNGramLogitsProcessor):
        return int(processor.batch_size)
    return int(processor.encoder_input_ids.shape[0])


def _narrowed(processor: Any, prompt: int) -> Any:
    """A copy of `processor` built from prompt `prompt` of its batch alone (for a one-row batch)."""
    narrowed = copy.copy(processor)
    if isinstance(processor, logits_process.EncoderNoRepeatNGramLogitsProcessor):
        narrowed.generated_ngrams, narrowed.batch_size = [processor.generated_ngrams[prompt]], 1
    else:
        narrowed.encoder_input_ids = processor.encoder_input_ids[prompt : prompt + 1]
    return narrowed


@functools.lru_cache(maxsize=64)
def _prompt_of_row(kind: type, batch: int, rows: int) -> tuple[int | None, ...]:
    """Which of `batch` prompts HF's processor of this `kind` applies to each of `rows` rows (None: none),
    read off the installed transformers by running one built from prompts of one distinct token each
    (token i for prompt i) on `rows` rows of ones: the token a row's scores change at is its prompt's."""
    tokens = torch.arange(batch).unsqueeze(1)
    no_repeat = kind is logits_process.EncoderNoRepeatNGramLogitsProcessor  # 1-grams: bans the token
    probe = kind(1, tokens) if no_repeat else kind(2.0, tokens)
    changed = probe(torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, batch)) != 1
    return tuple(int(hit.nonzero()[0]) if bool(hit.any()) else None for hit in changed)


class _AskedFor:
    """``prefix_allowed_tokens_fn`` with the batch index fixed to the one HF asks the row with."""

    def __init__(self, function: Callable[[int, torch.Tensor], list[int]], batch_id: int) -> None:
        self.function, self.batch_id = function, batch_id

    def __call__(self, _: int, sent: torch.Tensor) -> list[int]:
        allowed = self.function(self.batch_id, sent)
        if len(allowed) == 0:  # HF's error, with the batch ID it asked with (its processor's says 0)
            raise ValueError(
                f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {self.batch_id}."
                "This means that the constraint is unsatisfiable. Please check your implementation"
                "of `prefix_allowed_tokens_fn` "
            )
        return allowed


def split_score_only(processors: LogitsProcessorList) -> tuple[LogitsProcessorList, LogitsProcessorList]:
    """Split off the trailing processors that read scores only (HF puts the sampling warpers last). The
    type must be exactly one of HF's: a subclass (a custom processor) may read the token ids."""
    cut = len(processors)
    while cut > 0 and type(processors[cut - 1]) in _SCORE_ONLY:
        cut -= 1
    return LogitsProcessorList(processors[:cut]), LogitsProcessorList(processors[cut:])
