"""An offline call's prompts turned into engine requests (or into results that need no engine: refused,
no room to generate, or served by transformers' own generate)."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from hfaccel.api.prompts import (
    adapter_checks,
    encode_prompt,
    per_prompt_adapters,
    per_prompt_configs,
    prompt_list,
)
from hfaccel.api.results import Call, Done, Hypothesis, no_metrics
from hfaccel.engine.beam_search import BeamParams
from hfaccel.engine.request import Request
from hfaccel.patches.arguments import check_generate_kwargs
from hfaccel.patches.beam import beam_limits_reason, beam_unsupported_reason, is_beam_search
from hfaccel.patches.cache_names import normalize_cache_argument
from hfaccel.patches.generate import (
    PER_ROW_ARGUMENTS,
    UNSUPPORTED_ARGUMENTS,
    PatchState,
    attach_prompt_lookup,
    fall_back,
    given,
    options_reason,
    warn_past_context,
)
from hfaccel.patches.models import window_reason
from hfaccel.patches.params import (
    has_default_lengths,
    prepare_config,
    prepare_special_tokens,
    request_params,
    stop_string_check,
    unsupported_reason,
)

# Names hfaccel.generate & co. take themselves (offered as suggestions for misspelt arguments).
OWN_PARAMETERS = (
    "tokenizer",
    "generation_config",
    "progress",
    "logprobs",
    "prompt_logprobs",
    "errors",
    "seed",
    "tpot_target_ms",
    "ttft_target_ms",
    "priority",
    "adapter",
)


# Parameters of HF's generate that make no sense for a list of prompts.
NOT_FOR_PROMPT_LISTS = {
    "inputs": "pass the prompts as the second argument",
    "streamer": "iterate hfaccel.stream(...) to get tokens as they come",
}


def plan_call(
    model: Any,
    state: PatchState,
    prompts: Any,
    tokenizer: Any,
    generation_config: Any,
    kwargs: dict[str, Any],
    where: str,
    logprobs: bool | int = False,
    seed: int | None = None,
    targets: dict[str, Any] | None = None,
    adapter: str | Sequence[str | None] | None = None,
    beams: bool = True,
) -> Call:
    """Every prompt turned into engine requests (n per prompt for num_return_sequences) or `Done`s (a
    refused prompt gives n error results, in its place); with `seed`, the i-th request's random stream
    is seeded with ``seed + i``. A beam-search prompt is one request whose hypotheses are its results
    (`beams`; False, for the streams: it falls back). Call-level mistakes (unknown arguments, prompts
    of the wrong shape) raise ValueError before anything is planned."""
    prompts = prompt_list(prompts)
    configs = per_prompt_configs(generation_config, len(prompts))
    for name, hint in NOT_FOR_PROMPT_LISTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{where} does not take {name}=: {hint}")
    kwargs = normalize_cache_argument(kwargs, where)  # past_key_values: a model input, refused as such
    check_generate_kwargs(model, kwargs, where, configs, model_inputs=False, own=OWN_PARAMETERS)
    check_top_k("logprobs", logprobs)
    top = None if isinstance(logprobs, bool) else int(logprobs)
    adapters = per_prompt_adapters(adapter, len(prompts))
    checks = adapter_checks(model, adapters)
    plans: list[Request | Hypothesis | Done] = []
    indexes: list[int] = []
    for index, (prompt, config, name) in enumerate(zip(prompts, configs, adapters)):
        try:
            first = None if seed is None else seed + len(plans)
            check = checks.get(name) if name is not None else None
            if isinstance(check, ValueError):
                raise check
            ids = encode_prompt(prompt, tokenizer)
            planned = plan_prompt(
                model, state, ids, config, kwargs, tokenizer, bool(logprobs is not False), top, first,
                targets, name, check, beams,
            )  # fmt: skip
        except ValueError as error:
            copies = refused_copies(model, config, kwargs)
            planned = [Done([], finish_reason="error", error=str(error)) for _ in range(copies)]
        plans.extend(planned)
        indexes.extend([index] * len(planned))
    live = [(i, plan) for i, plan in enumerate(plans) if isinstance(plan, Request)]
    if live:
        names = [f"prompts[{indexes[i]}]" for i, _ in live]
        warn_past_context([plan for _, plan in live], state.get_engine(model).max_model_len, names)
    return Call(plans, indexes)


def refused_copies(model: Any, config: GenerationConfig | None, kwargs: dict[str, Any]) -> int:
    """How many results a refused prompt takes: the num_return_sequences it asked for (1 if invalid)."""
    for source in (kwargs, vars(config) if config is not None else {}, vars(model.generation_config)):
        n = source.get("num_return_sequences")
        if n is not None:
            return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    return 1


def plan_prompt(
    model: Any,
    state: PatchState,
    ids: list[int],
    config: GenerationConfig | None,
    kwargs: dict[str, Any],
    tokenizer: Any,
    logprobs: bool,
    top_logprobs: int | None = None,
    seed: int | None = None,
    targets: dict[str, Any] | None = None,
    adapter: str | None = None,
    adapter_fallback: str | None = None,
    beams: bool = True,
) -> list[Request | Hypothesis | Done]:
    has_default_max, has_default_min = has_default_lengths(model, config, kwargs)
    prepared, _ = prepare_config(model, config, dict(kwargs))
    copies = prepared.num_return_sequences or 1
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    # generate's own objects are served per prompt (as model.generate serves them per row); the
    # arguments in UNSUPPORTED_ARGUMENTS send the prompt to transformers' generate.
    custom = {name: kwargs.get(name) for name in PER_ROW_ARGUMENTS}
    hf_only = {name: kwargs[name] for name in UNSUPPORTED_ARGUMENTS if given(kwargs.get(name))}
    beam = (prepared.num_beams or 1) > 1 and is_beam_search(prepared)  # one request, its hypotheses
    if beam and not beams:
        reason = "beam search in a stream"
    elif beam:
        given_custom = [name for name, value in custom.items() if given(value)]
        names = None if adapter is None else [adapter]  # the engine's beams take no adapter
        reason = beam_unsupported_reason(model, prepared, [], None, names, device) or (
            f"beam search with {given_custom[0]}" if given_custom else None
        )
    else:
        reason = unsupported_reason(prepared, True, device)
    reason = reason or next((UNSUPPORTED_ARGUMENTS[name] for name in hf_only), None)
    if adapter is not None:
        reason = reason or adapter_fallback
        hf_only["adapter_names"] = [adapter]  # for PEFT's own generate, if it falls back
    if reason is None:
        prepare_special_tokens(model, prepared, True, device)  # one unpadded row: no mask needed
        mask = torch.ones_like(input_ids)
        if not beam:
            reason = options_reason(model, state, prepared, custom, input_ids, mask, {})
    if reason is None:
        stopping, sampling = request_params(
            model,
            prepared,
            input_ids,
            has_default_max,
            has_default_min,
            tokenizer,
            output_logprobs=logprobs,
            top_logprobs=top_logprobs,
            logits_processor=custom["logits_processor"],
            stopping_criteria=custom["stopping_criteria"],
        )
        reason = window_reason(model, len(ids) + stopping.max_new_tokens)
        if reason is None and beam:
            reason = beam_limits_reason(state.get_engine(model), prepared.num_beams, len(ids), stopping)
    if reason is not None:
        fall_back(state, reason)
        start = time.perf_counter()
        # The caller's own config and arguments, not `prepared`: HF's preparation has filled in lengths
        # (max_length=20), which HF would no longer treat as defaults.
        extra = dict(kwargs, **hf_only)
        if config is not None:
            extra["generation_config"] = copy.deepcopy(config)
        output = state.run_original(input_ids, tokenizer=tokenizer, **extra)
        seconds = time.perf_counter() - start
        sequences = output.sequences if hasattr(output, "sequences") else output
        return [
            Done(ids, new, stopped, metrics=no_metrics(seconds))
            for new, stopped in unpadded_copies(sequences, len(ids), prepared, tokenizer)
        ]
    if stopping.max_new_tokens <= 0:
        return [Done(ids, metrics=no_metrics(0.0)) for _ in range(copies)]
    engine = state.get_engine(model)
    if beam:
        params = BeamParams(
            num_beams=prepared.num_beams,
            length_penalty=prepared.length_penalty,
            early_stopping=prepared.early_stopping,
            num_return_sequences=copies,
        )
        sampling = dataclasses.replace(sampling, beam=params)
        request = engine.make_request(ids, stopping, sampling, **(targets or {}))
        return [Hypothesis(request, rank) for rank in range(copies)]
    seeds = [None if seed is None else seed + i for i in range(copies)]
    requests = [
        engine.make_request(ids, stopping, sampling, seed=s, adapter=adapter, **(targets or {}))
        for s in seeds
    ]
    attach_prompt_lookup(requests, prepared)
    return requests


def unpadded_copies(
    sequences: torch.Tensor, prompt_len: int, config: GenerationConfig, tokenizer: Any
) -> list[tuple[list[int], str]]:
    """Each row's new tokens and finish reason from HF's output, without the padding HF puts after a
    copy that stopped before the longest one: cut after its first EOS, else trailing pad ids dropped (a
    stop string or criterion stopped it; a row that really generated pad ids last reads the same in
    HF's output). A copy that ends in EOS or a stop string, or was padded, stopped; the rest ran out."""
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = config.pad_token_id
    strings = config.stop_strings
    stop_check = (
        stop_string_check(tokenizer, [strings] if isinstance(strings, str) else list(strings))
        if strings and tokenizer is not None
        else None
    )
    copies = []
    for row in sequences:
        prompt, new = row[:prompt_len].tolist(), row[prompt_len:].tolist()
        stopped = False
        if any(t in eos_ids for t in new):
            new, stopped = new[: next(k for k, t in enumerate(new) if t in eos_ids) + 1], True
        elif pad is not None and new and new[-1] == pad:
            while new and new[-1] == pad:
                new.pop()
            stopped = True
        stopped = stopped or (stop_check is not None and bool(new) and stop_check(prompt, new))
        copies.append((new, "stop" if stopped else "length"))
    return copies


def latency_targets(
    tpot_target_ms: float | None, ttft_target_ms: float | None, priority: int
) -> dict[str, Any]:
    return {"tpot_target_ms": tpot_target_ms, "ttft_target_ms": ttft_target_ms, "priority": priority}


def check_top_k(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) and not allow_none:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return
    wanted = "an int k >= 0 (the most likely tokens to list per position) or None"
    if not allow_none:
        wanted = "True, False, or an int k >= 0 (the most likely tokens to list per token)"
    raise ValueError(f"{name} must be {wanted}, got {value!r}")
