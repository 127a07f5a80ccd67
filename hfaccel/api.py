"""The public entry points: `patch`, `unpatch`, offline `generate` and `stream`, their asyncio forms
`agenerate` and `astream`, and cache control. Every call is served by the model's one engine loop, from
any thread."""

from __future__ import annotations

import asyncio
import copy
import gc
import numbers
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, closing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from hfaccel.config import EngineConfig, is_draft_model
from hfaccel.distributed import dp as data_parallel
from hfaccel.distributed.dp import setup_data_parallel
from hfaccel.distributed.ep import setup_expert_parallel
from hfaccel.distributed.pp import setup_pipeline_parallel
from hfaccel.engine.loop import Submission, Update
from hfaccel.engine.request import Request
from hfaccel.engine.sampler import top_logprobs
from hfaccel.engine.speculative.proposer import speculative_stats
from hfaccel.patches.arguments import check_generate_kwargs
from hfaccel.patches.attention import register_attention, restore_attention
from hfaccel.patches.generate import (
    PER_ROW_ARGUMENTS,
    UNSUPPORTED_ARGUMENTS,
    PatchState,
    fall_back,
    given,
    patched_generate,
    warn_past_context,
)
from hfaccel.patches.lora import check_adapter_names
from hfaccel.patches.lora import unsupported_reason as lora_unsupported_reason
from hfaccel.patches.models import check_engine_config, check_model, window_reason
from hfaccel.patches.params import (
    has_default_lengths,
    prepare_config,
    request_params,
    stop_string_check,
    unsupported_reason,
)
from hfaccel.patches.pipeline import install_pipeline_batching
from hfaccel.patches.tp_plan import setup_tensor_parallel

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@dataclass
class Completion:
    """One sequence's result from `hfaccel.generate`.

    Attributes:
        prompt_token_ids: the prompt as token ids.
        token_ids: generated token ids only (an EOS that ended it included, as HF returns it).
        text: the generated text (special tokens skipped), when a tokenizer is known.
        finish_reason: ``"stop"`` (EOS or a stop string), ``"length"`` (max_new_tokens / max_length /
            context), or ``"error"`` (the request was refused; see `error`).
        metrics: seconds: ``queue_s`` (arrival to first scheduled), ``ttft_s`` (time to first token),
            ``tpot_s`` (mean time per output token after the first), ``itl_max_s`` (longest gap between
            two tokens), ``e2e_s`` (arrival to finish); and ``num_cached_prompt_tokens`` (prefix-cache
            hits), ``num_preemptions``.
            Every completion has every key; what is not known is None (a refused request has no
            times; one served by transformers' own generate has ``e2e_s`` only).
        logprobs: log-probability of each generated token under the processed distribution (after
            the logits processors and sampling warpers, which is what the token was drawn from), when
            ``logprobs`` was asked.
        error: why the request was refused, for ``finish_reason == "error"``.
        top_logprobs: with ``logprobs=k``: per generated token, ``{token id: log-probability}`` of the
            k most likely tokens and the chosen one (vLLM's layout).
        prompt_logprobs: with ``prompt_logprobs=k``: per prompt token, ``None`` for the first, then
            ``{token id: log-probability}`` with that prompt token and the k most likely ones, under the
            model's raw distribution (one extra forward of the model per prompt, after generation).
        prompt_index: the position of its prompt in the prompts given; the ``num_return_sequences``
            copies of one prompt share it (see `group_by_prompt`).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict[str, float | None] = field(default_factory=dict)
    logprobs: list[float] | None = None
    error: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_index: int = 0


def group_by_prompt(completions: Sequence[Completion]) -> list[list[Completion]]:
    """The flat result of `generate` grouped per prompt: ``groups[i]`` holds the
    ``num_return_sequences`` completions of ``prompts[i]``, in order."""
    groups: dict[int, list[Completion]] = {}
    for completion in completions:
        groups.setdefault(completion.prompt_index, []).append(completion)
    return [groups[i] for i in sorted(groups)]


class RequestError(ValueError):
    """Some requests of an `hfaccel.generate` call were refused; the others completed.

    `completions` holds every result in prompt order; refused ones have ``finish_reason == "error"``.
    """

    def __init__(self, message: str, completions: list[Completion]) -> None:
        super().__init__(message)
        self.completions = completions


@dataclass
class StreamEvent:
    """A new token of one request in `hfaccel.stream`."""

    index: int  # the request's position in the prompts given (times num_return_sequences)
    token_id: int
    text: str | None  # the text this token adds, when a tokenizer is known
    finished: bool
    finish_reason: str | None
    logprob: float | None = None  # with logprobs=: the token's log-probability (processed distribution)
    top_logprobs: dict[int, float] | None = None  # with logprobs=k: the k most likely tokens and this one
    prompt_index: int = 0  # the position of its prompt in the prompts given


def patch(
    model: Any,
    config: EngineConfig | None = None,
    *,
    strict: bool | None = None,
    progress: bool | None = None,
    tensor_parallel_size: int | None = None,
    device_mesh: Any = None,
    sequence_parallel: bool | None = None,
    pipeline_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
    **overrides: Any,
) -> Any:
    """Make `model.generate` run on the hfaccel engine; returns the same model object.

    Registers the "hfaccel" attention function with transformers' ``AttentionInterface`` and binds a
    drop-in ``generate`` on this instance (other instances of the class are untouched). Ordinary
    ``model(...)`` forward calls keep the model's own attention. Options the engine does not serve fall
    back to the original ``generate`` with one warning, or raise ValueError with ``strict=True``.
    ``progress=True`` shows a progress bar inside ``model.generate``.

    Calling it again on a patched model changes only what is given: keyword overrides change only the
    fields they name (``patch(model, max_num_seqs=8)`` keeps an earlier ``block_size``), an
    `EngineConfig` replaces the whole config, and ``strict`` / ``progress`` stay as they were unless
    given. The engine is rebuilt only if the config actually changed.

    Unknown or invalid config values raise ValueError here, as do configs that cannot serve this model:
    a ``max_model_len`` beyond the model's context, a named ``backend`` that cannot run here, or a
    ``kv_cache_memory`` too small for one request of ``max_model_len`` tokens (the message says how
    much is needed, or which ``max_model_len`` fits).

    Parallelism (docs/parallelism.md): ``tensor_parallel_size=N`` (or ``device_mesh=`` a 1-D
    ``DeviceMesh``) shards the model in place over N processes from its transformers TP plan; every rank
    runs the same script and makes the same calls. ``sequence_parallel=True`` also shards the tokens of
    steps that hold prefill tokens. A model transformers sharded at load (``tp_plan="auto"``) is served
    as it is. Refusals (sizes that do not divide the heads, no process group) raise ValueError before
    anything is sharded.

    Pipeline parallelism: ``pipeline_parallel_size=P`` splits the decoder layers into P stages over P
    processes (``EngineConfig.num_microbatches`` microbatches pipelined through them in prefill).
    Expert parallelism: ``expert_parallel_size=E`` shards a MoE model's experts over E processes
    (tokens dispatched to them by all-to-all). Data parallelism: ``data_parallel_size=D`` makes D engine
    replicas (of world // D ranks each, TP, PP or EP inside); `generate` spreads its requests over them
    by load and returns every completion on every rank. See docs/parallelism.md.
    """
    # One patch of a model at a time (two threads patching it at once recorded the first one's
    # patched generate as "the original"), and never during a temporary patch's setup or teardown.
    with _temporary_patch_lock:
        state: PatchState | None = getattr(model, "_hfaccel", None)
        parallel = (tensor_parallel_size, device_mesh, sequence_parallel)
        if state is not None:
            if pipeline_parallel_size not in (None, 1) and model.__dict__.get("_hfaccel_pp") is None:
                raise ValueError("pipeline parallelism is set at a model's first patch: unpatch it first")
            if expert_parallel_size not in (None, 1) and model.__dict__.get("_hfaccel_ep") is None:
                raise ValueError("expert parallelism is set at a model's first patch: unpatch it first")
            if data_parallel_size not in (None, 1) and model.__dict__.get("_hfaccel_dp") is None:
                raise ValueError("data parallelism is set at a model's first patch: unpatch it first")
            if any(p is not None for p in parallel):  # tensor parallelism is fixed at the first patch
                if model.__dict__.get("_hfaccel_tp") is None:
                    raise ValueError("tensor parallelism is set at a model's first patch: unpatch it first")
                setup_tensor_parallel(
                    model, *parallel, (config or state.config).with_overrides(**overrides).batching
                )
            if config is not None or overrides:
                new_config = (config or state.config).with_overrides(**overrides)
                _check_draft_model(model, new_config)
                check_engine_config(model, new_config)
                if new_config != state.config:
                    # The new config first: a call that rebuilds the engine after the release (it joins the
                    # loop thread) builds it from the new one.
                    state.config = new_config
                    state.release("hfaccel.patch changed the engine config: its engine was rebuilt")
            if state.temporary:  # patched on purpose now: it stays patched after temporary users end,
                state.temporary = False  # and its generate runs on the engine from now on
                model.generate = types.MethodType(patched_generate, model)
            state.strict = state.strict if strict is None else strict
            state.progress = state.progress if progress is None else progress
            return model
        check_model(model)
        engine_config = (config or EngineConfig()).with_overrides(**overrides)
        _check_draft_model(model, engine_config)
        setup_tensor_parallel(model, *parallel, engine_config.batching)  # shards the model when N > 1
        setup_pipeline_parallel(model, pipeline_parallel_size)  # splits the layers into stages when P > 1
        setup_expert_parallel(model, expert_parallel_size)  # shards the experts when E > 1
        setup_data_parallel(model, data_parallel_size)  # D engine replicas when D > 1
        check_engine_config(model, engine_config)
        register_attention()
        model._hfaccel = PatchState(
            config=engine_config,
            original_generate=model.generate,
            instance_generate=model.__dict__.get("generate"),
            strict=bool(strict),
            progress=bool(progress),
        )
        if not _temporary.patching:  # a temporary patch leaves the model's own generate alone
            model.generate = types.MethodType(patched_generate, model)
        install_pipeline_batching()
        return model


def _check_draft_model(model: Any, config: EngineConfig) -> None:
    """Refuse a ``speculative`` draft model whose vocabulary differs from `model`'s at `patch` time, not
    at the first ``generate`` (the engine checks again, with the device, when it is built)."""
    draft = config.speculative
    if not is_draft_model(draft) or draft is model:
        return
    try:
        ours, theirs = (m.get_input_embeddings().num_embeddings for m in (model, draft))
    except (AttributeError, NotImplementedError):
        return  # not a transformers model: the engine's executor decides
    if ours != theirs:
        raise ValueError(
            f"speculative: the draft model's vocabulary has {theirs} tokens, the model's {ours}; a draft "
            "model must share the model's tokenizer and vocabulary"
        )


def unpatch(model: Any) -> Any:
    """Undo `patch`: the original `generate` comes back exactly, the engine loop stops and the KV cache
    is released (requests still in flight fail with `LoopClosed`)."""
    with _temporary_patch_lock:
        state: PatchState | None = model.__dict__.pop("_hfaccel", None)
        if state is None:
            return model
        if state.instance_generate is None:
            model.__dict__.pop("generate", None)  # none bound by a temporary patch
        else:
            model.generate = state.instance_generate
    state.release("hfaccel.unpatch released the engine")
    restore_attention(model)
    return model


def reset_prefix_cache(model: Any) -> None:
    """Forget every KV block the prefix cache holds for `model`, so the next requests recompute them,
    and every captured CUDA graph, so the next decode steps capture the model as it is now.

    Weight updates, ``load_state_dict``, dtype or device moves and PEFT adapter switches are detected
    by themselves; call this after a change the engine cannot see (an edit through ``.data`` that
    touches few elements, a custom layer's own state). Requests running at the time finish on the KV
    they hold but never share it. A no-op on an unpatched model or one whose engine is not built yet.
    """
    state: PatchState | None = getattr(model, "__dict__", {}).get("_hfaccel")
    if state is not None and state.engine is not None:
        state.engine.forget_model_outputs()


def release(model: Any) -> None:
    """Free `model`'s KV cache (and prefix cache) now; the model stays patched.

    Drops the engine, collects garbage and, on CUDA, returns cached blocks to the driver
    (``torch.cuda.empty_cache``). The next ``generate`` builds a new engine. A stream still being read
    fails with `LoopClosed`, as do requests still in flight. A no-op on an unpatched model or one with no engine yet.
    """
    state: PatchState | None = getattr(model, "__dict__", {}).get("_hfaccel")
    if state is None or state.engine is None:
        return
    on_cuda = state.engine.device.type == "cuda"
    state.release("hfaccel.release freed the engine")  # stops its loop: nothing may step a freed cache
    gc.collect()
    if on_cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_patched(model: Any) -> bool:
    """Whether `patch` has been applied to this model instance."""
    return "_hfaccel" in getattr(model, "__dict__", {})


def generate(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    progress: bool = True,
    logprobs: bool | int = False,
    prompt_logprobs: int | None = None,
    errors: str = "raise",
    seed: int | None = None,
    tpot_target_ms: float | None = None,
    ttft_target_ms: float | None = None,
    priority: int = 0,
    adapter: str | Sequence[str | None] | None = None,
    **generate_kwargs: Any,
) -> list[Completion]:
    """Complete many prompts in one continuous batch; results come back in prompt order.

    Args:
        model: a transformers causal LM, patched or not (an unpatched one is patched for this call only).
        prompts: a list of prompts: strings (need `tokenizer`), token-id lists, or chat message lists
            (need `tokenizer`, rendered with its chat template and the generation prompt). A single
            prompt (one string, one token-id list or one conversation) is a batch of one: the result
            is still a list, of one completion (per return sequence). A tokenizer's output (a dict /
            ``BatchEncoding``) or a 2-D tensor is refused: pass ``enc["input_ids"]`` as lists, or strings.
        tokenizer: encodes string/chat prompts, decodes `Completion.text`, and checks stop strings.
        generation_config: one config for all prompts, or a list with one per prompt.
        progress: show a progress bar over requests and generated tokens.
        logprobs: ``True``: each generated token's log-probability (`Completion.logprobs`); an int k:
            also the k most likely tokens per step (`Completion.top_logprobs`, vLLM's layout).
        prompt_logprobs: an int k: per prompt token its log-probability and the k most likely tokens
            (`Completion.prompt_logprobs`; computed with one extra forward of the model per prompt).
        errors: a refused prompt (empty, longer than the context, an invalid generation argument) never
            stops the others; they complete, then ``"raise"`` raises `RequestError` (a ValueError that
            names every refused prompt and carries all completions), ``"return"`` returns them with
            ``finish_reason="error"`` (``num_return_sequences`` of them, in the prompt's place).
        seed: the random stream of sampled requests: request ``i`` (in result order) draws from its own
            generator seeded with ``seed + i``, so its samples are the same whatever else runs beside it.
            ``None``: seeds are drawn from torch's global generator (``torch.manual_seed`` reproduces them).
        **generate_kwargs: generation arguments for every prompt (``max_new_tokens=64``, ``do_sample=True``...):
            the names transformers' generate takes; any other name raises ValueError listing it.
        tpot_target_ms, ttft_target_ms: latency targets of these requests (default: the engine's
            `EngineConfig` targets). A request whose TTFT target cannot be met given the queue comes back
            with ``finish_reason="rejected"`` and the reason in ``error`` under ``admission="reject"``.
        priority: admission order against other callers' requests (lower first; FCFS within a level).
        adapter: a PEFT LoRA adapter name for every prompt, or a list with one per prompt (None: the
            model as it is, with its active adapters; ``"__base__"``: no adapter). Prompts of different
            adapters run in the same continuous batch, each token with its own adapter's LoRA delta;
            prefix-cache blocks are shared only between requests of the same adapter.

    With ``num_return_sequences=n`` each prompt gives n consecutive completions (HF's order); they share
    `Completion.prompt_index`, and `group_by_prompt` groups them.
    """
    _check_errors(errors)
    _check_top_k("prompt_logprobs", prompt_logprobs, allow_none=True)
    with _patched(model) as state:
        call = _plan_all(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.generate",
            logprobs, seed, _targets(tpot_target_ms, ttft_target_ms, priority), adapter,
        )  # fmt: skip
        dp = model.__dict__.get("_hfaccel_dp")
        if dp is not None:  # data parallel: this replica runs its share, every rank returns all
            completions = _data_parallel(model, state, dp, call, tokenizer, progress)
        else:
            if call.runnable:
                state.get_loop(model).run(call.runnable, progress=progress)
            completions = _completions(call, tokenizer)
        if prompt_logprobs is not None:
            _add_prompt_logprobs(model, completions, int(prompt_logprobs))
    return _raise_or_return(completions, errors)


def _data_parallel(model: Any, state: PatchState, dp: Any, call: Any, tokenizer: Any, progress: bool) -> list:
    """Data parallelism: spread the call's requests over the replicas by load, run this replica's share,
    and gather every completion on every rank (in request order)."""
    plans = call.plans
    indices = [i for i, plan in enumerate(plans) if isinstance(plan, Request)]
    owner = data_parallel.spread(
        dp, state.get_engine(model), [len(plans[i].prompt_token_ids) for i in indices]
    )
    mine = [i for i, o in zip(indices, owner) if o == dp.replica]
    if mine:
        state.get_loop(model).run([plans[i] for i in mine], progress=progress)
    index_of = call.prompt_indexes
    done = data_parallel.gather(dp, {i: _completion(plans[i], tokenizer, index_of[i]) for i in mine})
    return [
        done[i] if i in done else _completion(plan, tokenizer, index_of[i]) for i, plan in enumerate(plans)
    ]


async def agenerate(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    progress: bool = False,
    logprobs: bool | int = False,
    prompt_logprobs: int | None = None,
    errors: str = "raise",
    seed: int | None = None,
    tpot_target_ms: float | None = None,
    ttft_target_ms: float | None = None,
    priority: int = 0,
    adapter: str | Sequence[str | None] | None = None,
    **generate_kwargs: Any,
) -> list[Completion]:
    """`generate` for asyncio: ``await hfaccel.agenerate(model, prompts, ...)``.

    Same arguments and results (the progress bar is off by default: many calls usually run at once).
    The requests join the model's one engine loop, so concurrent calls share its steps; the event loop
    is never blocked while they run. Cancelling the awaiting task cancels its requests.
    """
    _check_errors(errors)
    _check_top_k("prompt_logprobs", prompt_logprobs, allow_none=True)
    with _patched(model) as state:
        call = _plan_all(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.agenerate",
            logprobs, seed, _targets(tpot_target_ms, ttft_target_ms, priority), adapter,
        )  # fmt: skip
        if call.runnable:
            submission = state.get_loop(model).submit_async(call.runnable)
            if progress:
                from tqdm.auto import tqdm

                with tqdm(total=len(call.runnable), desc="hfaccel", unit="req", leave=False) as bar:
                    async with aclosing(submission.aupdates()) as updates:
                        async for update in updates:
                            bar.update(int(update.finished))
            else:
                await submission.await_all()
        completions = _completions(call, tokenizer)
        if prompt_logprobs is not None:
            await asyncio.to_thread(_add_prompt_logprobs, model, completions, int(prompt_logprobs))
    return _raise_or_return(completions, errors)


def _check_errors(errors: str) -> None:
    if errors not in ("raise", "return"):
        raise ValueError(f"errors must be 'raise' or 'return', got {errors!r}")


def _check_top_k(name: str, value: Any, allow_none: bool = False) -> None:
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


def _raise_or_return(completions: list[Completion], errors: str) -> list[Completion]:
    refused = [c for c in completions if c.finish_reason == "error"]
    if not refused or errors == "return":
        return completions
    raise RequestError(
        f"{len(refused)} of {len(completions)} requests refused"
        + (", the others completed" if len(refused) < len(completions) else "")
        + f" (see .completions): {_refusals(refused)}",
        completions,
    )


def _refusals(refused: Sequence[Completion | tuple[int, str]]) -> str:
    """``prompts[i]: why`` per refused prompt (its copies once), prompts refused for the same reason together."""
    reasons: dict[str, list[int]] = {}
    for item in refused:
        index, error = (item.prompt_index, item.error) if isinstance(item, Completion) else item
        indexes = reasons.setdefault(str(error), [])
        if index not in indexes:
            indexes.append(index)
    parts = []
    for error, indexes in list(reasons.items())[:5]:
        names = ", ".join(f"prompts[{i}]" for i in indexes[:3])
        if len(indexes) > 3:
            names += f" (and {len(indexes) - 3} more)"
        parts.append(f"{names}: {error}")
    if len(reasons) > 5:
        parts.append(f"and {len(reasons) - 5} more reasons")
    return "; ".join(parts)


def stream(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    logprobs: bool | int = False,
    seed: int | None = None,
    tpot_target_ms: float | None = None,
    ttft_target_ms: float | None = None,
    priority: int = 0,
    adapter: str | Sequence[str | None] | None = None,
    **generate_kwargs: Any,
) -> Iterator[StreamEvent]:
    """Like `generate`, but yield every token of every request as soon as its step ends.

    All prompts run in one continuous batch (shared with every other caller of the model); events
    interleave across requests. Prompts are given as to `generate` (a single prompt is a batch of
    one). A refused prompt raises ValueError before anything runs. With ``logprobs`` each event
    carries its token's `StreamEvent.logprob` (and with an int k, `StreamEvent.top_logprobs`).
    Closing the iterator early cancels what is left (freeing its KV blocks).
    """
    with _patched(model) as state:
        call, submission = _start_stream(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.stream", logprobs,
            seed=seed, targets=_targets(tpot_target_ms, ttft_target_ms, priority), adapter=adapter,
        )  # fmt: skip
        events = _StreamEvents(call, tokenizer)
        try:
            yield from events.completed()  # prompts transformers served first
        except BaseException:  # closed or interrupted meanwhile: the engine's prompts are cancelled too
            if submission is not None:
                submission.cancel()
            raise
        if submission is None:
            return
        with closing(submission.updates()) as updates:  # closing this generator cancels what is left
            for update in updates:
                yield from events.of(update)


async def astream(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    logprobs: bool | int = False,
    seed: int | None = None,
    tpot_target_ms: float | None = None,
    ttft_target_ms: float | None = None,
    priority: int = 0,
    adapter: str | Sequence[str | None] | None = None,
    **generate_kwargs: Any,
) -> AsyncIterator[StreamEvent]:
    """`stream` for asyncio: ``async for event in hfaccel.astream(model, prompts, ...)``, the same events.

    Leaving the loop early (or cancelling the task) cancels what is left.
    """
    with _patched(model) as state:
        call, submission = _start_stream(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.astream", logprobs,
            asynchronous=True, seed=seed, targets=_targets(tpot_target_ms, ttft_target_ms, priority),
            adapter=adapter,
        )  # fmt: skip
        events = _StreamEvents(call, tokenizer)
        try:
            for event in events.completed():  # prompts transformers served first
                yield event
        except BaseException:  # closed or cancelled meanwhile: the engine's prompts are cancelled too
            if submission is not None:
                submission.cancel()
            raise
        if submission is None:
            return
        async with aclosing(submission.aupdates()) as updates:
            async for update in updates:
                for event in events.of(update):
                    yield event


def _start_stream(
    model: Any,
    state: PatchState,
    prompts: Any,
    tokenizer: Any,
    generation_config: Any,
    kwargs: dict[str, Any],
    where: str,
    logprobs: bool | int,
    asynchronous: bool = False,
    seed: int | None = None,
    targets: dict[str, Any] | None = None,
    adapter: str | Sequence[str | None] | None = None,
) -> tuple[_Call, Submission | None]:
    """Plan the prompts (raising for a refused one) and submit the runnable ones as one stream."""
    call = _plan_all(
        model, state, prompts, tokenizer, generation_config, kwargs, where, logprobs, seed, targets, adapter
    )
    refused = [
        (index, plan.error)
        for plan, index in zip(call.plans, call.prompt_indexes)
        if isinstance(plan, _Done) and plan.error
    ]
    if refused:
        raise ValueError(_refusals(refused))
    if not call.runnable:
        return call, None
    loop = state.get_loop(model)
    submission = (
        loop.submit_async(call.runnable, stream=True)
        if asynchronous
        else loop.submit(call.runnable, stream=True)
    )
    return call, submission


class _StreamEvents:
    """Turns the loop's per-request updates into `StreamEvent`s (with incremental text)."""

    def __init__(self, call: _Call, tokenizer: Any) -> None:
        self.call = call
        self.live = [(i, plan) for i, plan in enumerate(call.plans) if isinstance(plan, Request)]
        self.tokenizer = tokenizer
        self.tokens: dict[int, list[int]] = {}
        self.texts: dict[int, str] = {}

    def completed(self) -> Iterator[StreamEvent]:
        """Events of the results that needed no engine (served by transformers' generate), up front."""
        for index, plan in enumerate(self.call.plans):
            if isinstance(plan, _Done):
                for k, token in enumerate(plan.token_ids):
                    done = k == len(plan.token_ids) - 1
                    yield self._event(index, token, done, plan.finish_reason if done else None)

    def of(self, update: Update) -> Iterator[StreamEvent]:
        index, request = self.live[update.index]
        for k, token in enumerate(update.token_ids):
            done = update.finished and k == len(update.token_ids) - 1
            yield self._event(index, token, done, request.finish_reason if done else None, request)

    def _event(
        self, index: int, token: int, done: bool, reason: str | None, request: Request | None = None
    ) -> StreamEvent:
        tokens = self.tokens.setdefault(index, [])
        tokens.append(token)
        delta = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            delta, self.texts[index] = text[len(self.texts.get(index, "")) :], text
        logprob = top = None
        if request is not None and request.sampling.output_logprobs:
            position = len(tokens) - 1  # the sampler records before the token reaches the caller
            logprob = request.logprobs[position]
            if request.sampling.top_logprobs is not None:
                top = request.top_logprobs[position]
        return StreamEvent(index, token, delta, done, reason, logprob, top, self.call.prompt_indexes[index])


# Re-entrant: an abandoned stream's cleanup (a `_patched` block's `finally`) may run from the garbage
# collector in a thread that already holds it, in the middle of another call's patch.
_temporary_patch_lock = threading.RLock()


class _TemporaryPatching(threading.local):
    patching = False  # this thread's `patch` call makes a temporary patch (under the lock)


_temporary = _TemporaryPatching()


@contextmanager
def _patched(model: Any) -> Iterator[PatchState]:
    """The model's patch state; an unpatched model is patched for the block and restored after the last
    of the calls that patched it this way ends (concurrent calls share one engine)."""
    with _temporary_patch_lock:
        if not is_patched(model):
            # It serves the hfaccel calls that made it (they reach the engine through the state): the
            # model's own generate stays transformers' for every other thread, whose plain calls a
            # temporary engine ending under them would otherwise fail.
            _temporary.patching = True
            try:
                patch(model)
            finally:
                _temporary.patching = False
            model._hfaccel.temporary = True
        state: PatchState = model._hfaccel
        temporary = state.temporary
        if temporary:
            state.temporary_users += 1
    try:
        yield state
    finally:
        if temporary:
            with _temporary_patch_lock:
                state.temporary_users -= 1
                if state.temporary and state.temporary_users == 0 and model.__dict__.get("_hfaccel") is state:
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


_DICT_PROMPT = (
    "pass prompts=enc['input_ids'] (token-id lists: tokenize without padding and without "
    "return_tensors) or the strings themselves with tokenizer="
)


def _prompt_list(prompts: Any) -> list[Any]:
    """The prompts as a list; a single prompt (a string, a token-id list, one conversation) is a batch
    of one. A tokenizer's output (dict / BatchEncoding) and 2-D tensors are refused, saying what to pass."""
    if isinstance(prompts, Mapping):
        raise ValueError(f"prompts is a dict (a tokenizer's output?), not a list of prompts: {_DICT_PROMPT}")
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts.tolist()]
        raise ValueError(
            f"prompts is a {prompts.dim()}-D tensor: pass a list of token-id lists (the pad tokens of a "
            "padded batch would become part of the prompts), or call model.generate(input_ids=..., "
            "attention_mask=...)"
        )
    if prompts is None:
        raise ValueError("prompts is None: pass a list of strings, token-id lists or chat message lists")
    items = list(prompts)
    if items and all(isinstance(t, numbers.Integral) for t in items):
        return [items]  # one token-id list
    if items and isinstance(items[0], Mapping) and "role" in items[0]:
        return [items]  # one conversation
    return items


def _per_prompt_adapters(adapter: str | Sequence[str | None] | None, count: int) -> list[str | None]:
    if adapter is None or isinstance(adapter, str):
        return [adapter] * count
    adapters = list(adapter)
    if len(adapters) != count:
        raise ValueError(f"adapter has {len(adapters)} entries for {count} prompts; give one per prompt")
    return adapters


def _adapter_checks(model: Any, adapters: list[str | None]) -> dict[str, ValueError | str | None]:
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


def _encode(prompt: Prompt, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs tokenizer= to encode it")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, Mapping):
        raise ValueError(f"a prompt is a dict (a tokenizer's output?): {_DICT_PROMPT}")
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
    if not all(isinstance(t, int) or (isinstance(t, torch.Tensor) and t.numel() == 1) for t in items):
        raise ValueError("a prompt must be a string, a list of token ids or a list of chat messages")
    if not items:
        raise ValueError("the prompt is empty: a prompt needs at least one token")
    return [int(t) for t in items]


def _no_metrics(e2e_s: float | None = None) -> dict[str, float | None]:
    """The metric keys every `Completion` has, for one the engine did not run."""
    return {
        "queue_s": None,
        "ttft_s": None,
        "tpot_s": None,
        "itl_max_s": None,
        "e2e_s": e2e_s,
        "num_cached_prompt_tokens": None,
        "num_preemptions": None,
    }


@dataclass
class _Done:
    """A prompt completed without the engine: refused, given no room to generate, or run by HF."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    error: str | None = None
    metrics: dict[str, float | None] = field(default_factory=_no_metrics)


@dataclass
class _Call:
    """One call's plan: per result, an engine `Request` or a `_Done`, and the index of its prompt."""

    plans: list[Request | _Done]
    prompt_indexes: list[int]

    @property
    def runnable(self) -> list[Request]:
        return [plan for plan in self.plans if isinstance(plan, Request)]


# Names hfaccel.generate & co. take themselves (offered as suggestions for misspelt arguments).
_OWN_PARAMETERS = (
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
_NOT_FOR_PROMPT_LISTS = {
    "inputs": "pass the prompts as the second argument",
    "streamer": "iterate hfaccel.stream(...) to get tokens as they come",
}


def _plan_all(
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
) -> _Call:
    """Every prompt turned into engine requests (n per prompt for num_return_sequences) or `_Done`s (a
    refused prompt gives n error results, in its place); with `seed`, the i-th request's random stream
    is seeded with ``seed + i``. Call-level mistakes (unknown arguments, prompts of the wrong shape)
    raise ValueError before anything is planned."""
    prompts = _prompt_list(prompts)
    configs = _per_prompt_configs(generation_config, len(prompts))
    for name, hint in _NOT_FOR_PROMPT_LISTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{where} does not take {name}=: {hint}")
    check_generate_kwargs(model, kwargs, where, configs, model_inputs=False, own=_OWN_PARAMETERS)
    _check_top_k("logprobs", logprobs)
    top = None if isinstance(logprobs, bool) else int(logprobs)
    adapters = _per_prompt_adapters(adapter, len(prompts))
    checks = _adapter_checks(model, adapters)
    plans: list[Request | _Done] = []
    indexes: list[int] = []
    for index, (prompt, config, name) in enumerate(zip(prompts, configs, adapters)):
        try:
            first = None if seed is None else seed + len(plans)
            check = checks.get(name) if name is not None else None
            if isinstance(check, ValueError):
                raise check
            ids = _encode(prompt, tokenizer)
            planned = _plan(
                model, state, ids, config, kwargs, tokenizer, bool(logprobs is not False), top, first,
                targets, name, check,
            )  # fmt: skip
        except ValueError as error:
            copies = _copies(model, config, kwargs)
            planned = [_Done([], finish_reason="error", error=str(error)) for _ in range(copies)]
        plans.extend(planned)
        indexes.extend([index] * len(planned))
    live = [(i, plan) for i, plan in enumerate(plans) if isinstance(plan, Request)]
    if live:
        names = [f"prompts[{indexes[i]}]" for i, _ in live]
        warn_past_context([plan for _, plan in live], state.get_engine(model).max_model_len, names)
    return _Call(plans, indexes)


def _copies(model: Any, config: GenerationConfig | None, kwargs: dict[str, Any]) -> int:
    """How many results a refused prompt takes: the num_return_sequences it asked for (1 if invalid)."""
    for source in (kwargs, vars(config) if config is not None else {}, vars(model.generation_config)):
        n = source.get("num_return_sequences")
        if n is not None:
            return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    return 1


def _plan(
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
) -> list[Request | _Done]:
    has_default_max, has_default_min = has_default_lengths(model, config, kwargs)
    prepared, _ = prepare_config(model, config, dict(kwargs))
    copies = prepared.num_return_sequences or 1
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    fallbacks = {**UNSUPPORTED_ARGUMENTS, **PER_ROW_ARGUMENTS}  # per-row ones: model.generate serves them
    hf_only = {name: kwargs[name] for name in fallbacks if given(kwargs.get(name))}
    reason = unsupported_reason(prepared, device=device) or next((fallbacks[name] for name in hf_only), None)
    if adapter is not None:
        reason = reason or adapter_fallback
        hf_only["adapter_names"] = [adapter]  # for PEFT's own generate, if it falls back
    if reason is None:
        model._prepare_special_tokens(prepared, True, device=device)  # one unpadded row: no mask needed
        stopping, sampling = request_params(
            model,
            prepared,
            input_ids,
            has_default_max,
            has_default_min,
            tokenizer,
            output_logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        reason = window_reason(model, len(ids) + stopping.max_new_tokens)
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
            _Done(ids, new, stopped, metrics=_no_metrics(seconds))
            for new, stopped in _unpadded_copies(sequences, len(ids), prepared, tokenizer)
        ]
    if stopping.max_new_tokens <= 0:
        return [_Done(ids, metrics=_no_metrics(0.0)) for _ in range(copies)]
    engine = state.get_engine(model)
    seeds = [None if seed is None else seed + i for i in range(copies)]
    return [
        engine.make_request(ids, stopping, sampling, seed=s, adapter=adapter, **(targets or {}))
        for s in seeds
    ]


def _unpadded_copies(
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


def _targets(tpot_target_ms: float | None, ttft_target_ms: float | None, priority: int) -> dict[str, Any]:
    return {"tpot_target_ms": tpot_target_ms, "ttft_target_ms": ttft_target_ms, "priority": priority}


def _completions(call: _Call, tokenizer: Any) -> list[Completion]:
    return [_completion(plan, tokenizer, index) for plan, index in zip(call.plans, call.prompt_indexes)]


def _completion(plan: Request | _Done, tokenizer: Any, prompt_index: int) -> Completion:
    if isinstance(plan, _Done):
        text = tokenizer.decode(plan.token_ids, skip_special_tokens=True) if tokenizer is not None else None
        return Completion(
            plan.prompt_token_ids,
            plan.token_ids,
            text,
            plan.finish_reason,
            dict(plan.metrics),
            error=plan.error,
            prompt_index=prompt_index,
        )
    metrics = {
        **plan.metrics.as_dict(),
        "num_cached_prompt_tokens": plan.num_cached_prompt_tokens,
        "num_preemptions": plan.num_preemptions,
    }
    if plan.spec_drafted:
        metrics.update(speculative_stats(plan))
    if plan.warnings:
        metrics["warnings"] = list(plan.warnings)
    tokens = list(plan.output_token_ids)
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    sampling = plan.sampling
    logprobs = list(plan.logprobs) if sampling.output_logprobs else None
    top = list(plan.top_logprobs) if sampling.top_logprobs is not None else None
    error = (
        plan.rejected_reason if plan.rejected_reason else (None if plan.error is None else str(plan.error))
    )
    return Completion(
        list(plan.prompt_token_ids),
        tokens,
        text,
        plan.finish_reason or "length",
        metrics,
        logprobs,
        error=error,
        top_logprobs=top,
        prompt_index=prompt_index,
    )


def prompt_logprobs_of(model: Any, ids: list[int], k: int) -> list[dict[int, float] | None]:
    """Per prompt token: None for the first, then ``{token id: log-probability}`` of that token and the
    `k` most likely ones, from one plain forward of `model` (its own attention, the raw distribution)."""
    device = next(model.parameters()).device
    result: list[dict[int, float] | None] = [None]
    if len(ids) < 2:
        return result
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0, :-1]
        for start in range(0, logits.shape[0], 512):  # log-softmax in slices: one [L, V] float copy at most
            rows = torch.log_softmax(logits[start : start + 512].float(), dim=-1).cpu()
            for j, row in enumerate(rows):
                result.append(top_logprobs(row, ids[start + j + 1], k))
    return result


def _add_prompt_logprobs(model: Any, completions: list[Completion], k: int) -> None:
    """`Completion.prompt_logprobs` for every completion with a prompt; one forward per prompt (the
    copies of a prompt share it)."""
    done: dict[int, list[dict[int, float] | None]] = {}
    for completion in completions:
        if not completion.prompt_token_ids:
            continue
        if completion.prompt_index not in done:
            done[completion.prompt_index] = prompt_logprobs_of(model, completion.prompt_token_ids, k)
        completion.prompt_logprobs = done[completion.prompt_index]
