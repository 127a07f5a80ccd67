"""An offline call's prompts turned into engine requests (or into results that need no engine: refused,
no room to generate, or served by transformers' own generate)."""

from __future__ import annotations

import copy
import numbers
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from hfaccel.api.prompts import (
    adapter_checks,
    check_tokenizer,
    encode_prompt,
    per_prompt_adapters,
    per_prompt_configs,
    prompt_list,
)
from hfaccel.api.results import Call, Done, Hypothesis, no_metrics
from hfaccel.engine.request import Request
from hfaccel.engine.sampler import top_logprobs as most_likely
from hfaccel.patches.arguments import check_generate_kwargs, normalize_cache_argument
from hfaccel.patches.generate import warn_past_context
from hfaccel.patches.lora import is_peft_model
from hfaccel.patches.models import reasons_held, reasons_suspended
from hfaccel.patches.params import one_default_length_warning
from hfaccel.patches.patch_state import PatchState, fall_back
from hfaccel.patches.planner import GenerateCall, beam_requests, make_requests
from hfaccel.patches.stop_strings import stop_string_check

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


# `hfaccel.generate`'s (and `agenerate`'s) own parameters that a stream does not take.
GENERATE_ONLY = {
    "progress": "a stream has no progress bar: count its events",
    "prompt_logprobs": "call hfaccel.generate for prompt log-probabilities",
    "errors": "a stream raises ValueError for a refused prompt before anything runs",
}
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
    seed: int | Sequence[int] | None = None,
    targets: dict[str, Any] | None = None,
    adapter: str | Sequence[str | None] | None = None,
    beams: bool = True,
) -> Call:
    """Every prompt turned into engine requests (n per prompt for num_return_sequences) or `Done`s (a
    refused prompt gives n error results, in its place); with `seed`, the i-th request's random stream
    is seeded with ``seed + i`` (a list of seeds, one per prompt: prompt p's r-th request's with
    ``seed[p] + r``). A beam-search prompt is one request whose hypotheses are its results
    (`beams`; False, for the streams: it falls back). Call-level mistakes (unknown arguments, prompts
    of the wrong shape) raise ValueError before anything is planned."""
    prompts = prompt_list(prompts)
    check_tokenizer(tokenizer)
    configs = per_prompt_configs(generation_config, len(prompts))
    for name, hint in NOT_FOR_PROMPT_LISTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{where} does not take {name}=: {hint}")
    for name, hint in GENERATE_ONLY.items():  # (a stream's call: generate's own parameters arrive as kwargs)
        if name in kwargs:
            raise ValueError(f"{where} does not take {name}= (hfaccel.generate's parameter): {hint}")
    seeds = _seeds(seed, len(prompts))
    kwargs = normalize_cache_argument(kwargs, where)  # past_key_values: a model input, refused as such
    check_generate_kwargs(model, kwargs, where, configs, model_inputs=False, own=OWN_PARAMETERS)
    check_top_k("logprobs", logprobs)
    top = None if isinstance(logprobs, bool) else int(logprobs)
    adapters = per_prompt_adapters(adapter, len(prompts))
    checks = adapter_checks(model, adapters)
    plans: list[Request | Hypothesis | Done] = []
    indexes: list[int] = []
    with reasons_held(model), one_default_length_warning():  # (the model's reasons: once for all prompts)
        for index, (prompt, config, name) in enumerate(zip(prompts, configs, adapters)):
            try:
                first = (
                    None
                    if seeds is None
                    else (seeds[index] if isinstance(seeds, list) else seeds + len(plans))
                )
                check = checks.get(name) if name is not None else None
                if isinstance(check, ValueError):
                    raise check
                ids = encode_prompt(prompt, tokenizer)
                planned = plan_prompt(
                    model, state, ids, config, kwargs, tokenizer, bool(logprobs is not False), top, first,
                    targets, name, check, beams, first_row=len(plans),
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
    return Call(plans, indexes, adapters)


def refused_copies(model: Any, config: GenerationConfig | None, kwargs: dict[str, Any]) -> int:
    """How many results a refused prompt takes: the num_return_sequences it asked for (1 if invalid)."""
    for source in (kwargs, vars(config) if config is not None else {}, vars(model.generation_config)):
        n = source.get("num_return_sequences")
        if n is not None:
            return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    return 1


def _seeds(seed: Any, count: int) -> int | list[int] | None:
    """`seed` checked: an int (numpy's too, never a float rounded down) in [0, 2**63), or a list of one
    such int per prompt."""

    def check(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < 2**63:
            raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")
        return int(value)

    if seed is None:
        return None
    if isinstance(seed, torch.Tensor) and seed.dim() == 0 and not seed.is_floating_point():
        seed = int(seed)  # a 0-d integer tensor, as numpy's integers are taken
    if not isinstance(seed, (numbers.Integral, str)) and hasattr(seed, "__len__"):  # a list, an array
        if len(seed) != count:
            raise ValueError(f"seed: a list of {len(seed)} seeds for {count} prompts (one per prompt)")
        return [check(s, f"seed[{i}]") for i, s in enumerate(list(seed))]
    return check(seed, "seed")


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
    first_row: int = 0,
) -> list[Request | Hypothesis | Done]:
    """One prompt through the planner `model.generate` uses (`patches/planner.py`): its requests, its
    hypotheses (beam search), or its results from transformers' generate when a gate sends it there.
    `first_row`: its first row in the call's batch (the rows of the prompts before it), what
    ``prefix_allowed_tokens_fn`` is asked as in one batched generate (a prompt sent to transformers'
    generate alone is asked as its batch's first)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    call = GenerateCall(
        model,
        state,
        config,
        kwargs,
        input_ids,
        tokenizer=tokenizer,
        given_mask=torch.ones_like(input_ids),  # one unpadded row: never a mask inferred from pad ids
        output_logprobs=logprobs,
        top_logprobs=top_logprobs,
        adapter_names=None if adapter is None else [adapter],
        adapters_checked=True,
        adapter_reason=adapter_fallback,
        states_allowed=False,  # a Completion carries no hidden states or attentions
        beams_allowed=beams,
        first_row=first_row,
    )
    reason = call.first_reason()
    if reason is not None:
        if adapter is not None and not is_peft_model(model):
            # transformers' generate takes PEFT's adapter_names only through a PeftModel's generate
            raise ValueError(
                f"adapter {adapter!r}: this call goes to transformers' generate ({reason}), which applies "
                "a per-request adapter only through PEFT's PeftModel (get_peft_model, PeftModel."
                "from_pretrained): patch a PeftModel, not its base model"
            )
        fall_back(state, reason)
        start = time.perf_counter()
        # The caller's own config and arguments, not the prepared ones: HF's preparation has filled in
        # lengths (max_length=20), which HF would no longer treat as defaults.
        extra = dict(kwargs) if adapter is None else dict(kwargs, adapter_names=[adapter])  # PEFT's generate
        if config is not None:
            extra["generation_config"] = copy.deepcopy(config)
        scored = logprobs and (call.config.num_beams or 1) == 1  # (beams: none, as the engine's beams)
        if scored:  # the processed scores HF samples from: the log-probabilities asked for
            extra.update(output_scores=True, return_dict_in_generate=True)
        with reasons_suspended():  # the user's code it runs may generate, in another state of the model
            output = state.run_original(input_ids, tokenizer=tokenizer, seed=seed, **extra)
        seconds = time.perf_counter() - start
        sequences = output.sequences if hasattr(output, "sequences") else output
        done = [
            Done(ids, new, stopped, metrics=no_metrics(seconds))
            for new, stopped in unpadded_copies(sequences, len(ids), call.config, tokenizer)
        ]
        if scored:
            for row, plan in enumerate(done):
                add_scored_logprobs(plan, [step[row] for step in output.scores], top_logprobs)
        return done
    if call.stopping.max_new_tokens <= 0:
        return [Done(ids, metrics=no_metrics(0.0)) for _ in range(call.copies)]
    engine = state.get_engine(model)
    if call.beam:
        request = beam_requests(call, engine, targets, seed)[0]
        return [Hypothesis(request, rank) for rank in range(call.copies)]
    return make_requests(call, engine, seed, targets)


def add_scored_logprobs(plan: Done, scores: list[torch.Tensor], top: int | None) -> None:
    """`plan`'s logprobs (and `top` most likely tokens) from the ``[V]`` scores HF chose each token from,
    as the engine's sampler records them (log-softmax in float32)."""
    plan.logprobs, plan.top_logprobs = [], None if top is None else []
    for token, row in zip(plan.token_ids, scores):
        logprobs = torch.log_softmax(row.float(), dim=-1).cpu()
        plan.logprobs.append(float(logprobs[token]))
        if plan.top_logprobs is not None:
            plan.top_logprobs.append(most_likely(logprobs, token, top))


def unpadded_copies(
    sequences: torch.Tensor, prompt_len: int, config: GenerationConfig, tokenizer: Any
) -> list[tuple[list[int], str]]:
    """Each row's new tokens and finish reason from HF's output, without the padding HF puts after a
    copy that stopped before the longest one. A row ends at its first EOS or its first stop string
    (HF stops it there, and pads the rest, with EOS where the pad id is EOS); else, where rows were padded
    (more than one), trailing pad ids are dropped (a criterion stopped it; a row that really generated
    pad ids last reads the same in HF's output). One row is never padded: its tokens are all its own."""
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = config.pad_token_id if sequences.shape[0] > 1 else None
    strings = config.stop_strings
    stop_check = (
        stop_string_check(tokenizer, [strings] if isinstance(strings, str) else list(strings))
        if strings and tokenizer is not None
        else None
    )
    copies = []
    for row in sequences:
        prompt, new = row[:prompt_len].tolist(), row[prompt_len:].tolist()
        end = next(
            (
                k + 1
                for k, token in enumerate(new)
                if token in eos_ids or (stop_check is not None and stop_check(prompt, new[: k + 1]))
            ),
            None,
        )
        stopped = end is not None
        if end is None:
            end = len(new)
            while pad is not None and end and new[end - 1] == pad:
                end, stopped = end - 1, True
        copies.append((new[:end], "stop" if stopped else "length"))
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
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return  # (numpy's integers too: the callers take int(value))
    wanted = "an int k >= 0 (the most likely tokens to list per position) or None"
    if not allow_none:
        wanted = "True, False, or an int k >= 0 (the most likely tokens to list per token)"
    raise ValueError(f"{name} must be {wanted}, got {value!r}")
