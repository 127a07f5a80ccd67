"""The public entry points: `patch`, `unpatch`, offline `generate` and `stream`, their asyncio forms
`agenerate` and `astream`, and cache control. Every call is served by the model's one engine loop, from
any thread."""

from __future__ import annotations

import copy
import gc
import threading
import types
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, closing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from hfaccel.config import EngineConfig
from hfaccel.distributed import dp as data_parallel
from hfaccel.distributed.dp import setup_data_parallel
from hfaccel.distributed.ep import setup_expert_parallel
from hfaccel.distributed.pp import setup_pipeline_parallel
from hfaccel.engine.loop import Submission, Update
from hfaccel.engine.request import Request
from hfaccel.engine.speculative.proposer import speculative_stats
from hfaccel.patches.attention import register_attention, restore_attention
from hfaccel.patches.generate import PatchState, fall_back, patched_generate
from hfaccel.patches.models import check_model, window_reason
from hfaccel.patches.params import has_default_lengths, prepare_config, request_params, unsupported_reason
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
        logprobs: log-probability of each generated token under the processed distribution, when
            ``logprobs=True`` was asked.
        error: why the request was refused, for ``finish_reason == "error"``.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: list[float] | None = None
    error: str | None = None


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
    ``progress=True`` shows a progress bar inside ``model.generate``. Calling it again on a patched
    model updates only what is given. Unknown or invalid config values raise ValueError.

    Tensor parallelism (docs/parallelism.md): ``tensor_parallel_size=N`` (or ``device_mesh=`` a 1-D
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
            state.release("hfaccel.patch changed the engine config: its engine was rebuilt")
            state.config = new_config
        state.temporary = False  # patched on purpose now: it stays patched after temporary users end
        state.strict = state.strict if strict is None else strict
        state.progress = state.progress if progress is None else progress
        return model
    check_model(model)
    engine_config = (config or EngineConfig()).with_overrides(**overrides)
    setup_tensor_parallel(model, *parallel, engine_config.batching)  # shards the model when N > 1
    setup_pipeline_parallel(model, pipeline_parallel_size)  # splits the layers into stages when P > 1
    setup_expert_parallel(model, expert_parallel_size)  # shards the experts when E > 1
    setup_data_parallel(model, data_parallel_size)  # D engine replicas when D > 1
    register_attention()
    model._hfaccel = PatchState(
        config=engine_config,
        original_generate=model.generate,
        instance_generate=model.__dict__.get("generate"),
        strict=bool(strict),
        progress=bool(progress),
    )
    model.generate = types.MethodType(patched_generate, model)
    install_pipeline_batching()
    return model


def unpatch(model: Any) -> Any:
    """Undo `patch`: the original `generate` comes back exactly, the engine loop stops and the KV cache
    is released (requests still in flight fail with `LoopClosed`)."""
    state: PatchState | None = model.__dict__.pop("_hfaccel", None)
    if state is None:
        return model
    if state.instance_generate is None:
        del model.generate
    else:
        model.generate = state.instance_generate
    state.release("hfaccel.unpatch released the engine")
    restore_attention(model)
    return model


def reset_prefix_cache(model: Any) -> None:
    """Forget every KV block the prefix cache holds for `model`, so the next requests recompute them.

    Weight updates, ``load_state_dict``, dtype or device moves and PEFT adapter switches are detected
    by themselves; call this after a change the engine cannot see (an edit through ``.data`` that
    touches few elements, a custom layer's own state). Requests running at the time finish on the KV
    they hold but never share it. A no-op on an unpatched model or one whose engine is not built yet.
    """
    state: PatchState | None = getattr(model, "__dict__", {}).get("_hfaccel")
    if state is not None and state.engine is not None:
        state.engine.block_manager.reset_prefix_cache()


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
    prompts: Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    progress: bool = True,
    logprobs: bool = False,
    errors: str = "raise",
    seed: int | None = None,
    **generate_kwargs: Any,
) -> list[Completion]:
    """Complete many prompts in one continuous batch; results come back in prompt order.

    Args:
        model: a transformers causal LM, patched or not (an unpatched one is patched for this call only).
        prompts: strings (need `tokenizer`), token-id lists, or chat message lists (need `tokenizer`,
            rendered with its chat template and the generation prompt).
        tokenizer: encodes string/chat prompts, decodes `Completion.text`, and checks stop strings.
        generation_config: one config for all prompts, or a list with one per prompt.
        progress: show a progress bar over requests and generated tokens.
        logprobs: also return each generated token's log-probability.
        errors: a refused prompt (empty, longer than the context, an invalid generation argument) never
            stops the others; they complete, then ``"raise"`` raises `RequestError` (a ValueError that
            names every refused prompt and carries all completions), ``"return"`` returns them with
            ``finish_reason="error"``.
        seed: the random stream of sampled requests: request ``i`` (in result order) draws from its own
            generator seeded with ``seed + i``, so its samples are the same whatever else runs beside it.
            ``None``: seeds are drawn from torch's global generator (``torch.manual_seed`` reproduces them).
        **generate_kwargs: generation arguments for every prompt (``max_new_tokens=64``, ``do_sample=True``...).

    With ``num_return_sequences=n`` each prompt gives n consecutive completions (HF's order).
    """
    _check_errors(errors)
    with _patched(model) as state:
        plans = _plan_all(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, logprobs, seed
        )
        runnable = [plan for plan in plans if isinstance(plan, Request)]
        dp = model.__dict__.get("_hfaccel_dp")
        if dp is not None:  # data parallel: this replica runs its share, every rank returns all
            return _data_parallel(model, state, dp, plans, tokenizer, errors, progress)
        if runnable:
            state.get_loop(model).run(runnable, progress=progress)
    return _results(plans, tokenizer, errors)


def _data_parallel(
    model: Any, state: PatchState, dp: Any, plans: list, tokenizer: Any, errors: str, progress: bool
) -> list[Completion]:
    indices = [i for i, plan in enumerate(plans) if isinstance(plan, Request)]
    owner = data_parallel.spread(
        dp, state.get_engine(model), [len(plans[i].prompt_token_ids) for i in indices]
    )
    mine = [i for i, o in zip(indices, owner) if o == dp.replica]
    if mine:
        state.get_loop(model).run([plans[i] for i in mine], progress=progress)
    done = data_parallel.gather(dp, {i: _completion(plans[i], tokenizer) for i in mine})
    completions = [done[i] if i in done else _completion(plan, tokenizer) for i, plan in enumerate(plans)]
    return _raise_or_return(completions, errors)


async def agenerate(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    progress: bool = False,
    logprobs: bool = False,
    errors: str = "raise",
    seed: int | None = None,
    **generate_kwargs: Any,
) -> list[Completion]:
    """`generate` for asyncio: ``await hfaccel.agenerate(model, prompts, ...)``.

    Same arguments and results (the progress bar is off by default: many calls usually run at once).
    The requests join the model's one engine loop, so concurrent calls share its steps; the event loop
    is never blocked while they run. Cancelling the awaiting task cancels its requests.
    """
    _check_errors(errors)
    with _patched(model) as state:
        plans = _plan_all(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, logprobs, seed
        )
        runnable = [plan for plan in plans if isinstance(plan, Request)]
        if runnable:
            submission = state.get_loop(model).submit_async(runnable)
            if progress:
                from tqdm.auto import tqdm

                with tqdm(total=len(runnable), desc="hfaccel", unit="req", leave=False) as bar:
                    async with aclosing(submission.aupdates()) as updates:
                        async for update in updates:
                            bar.update(int(update.finished))
            else:
                await submission.await_all()
    return _results(plans, tokenizer, errors)


def _check_errors(errors: str) -> None:
    if errors not in ("raise", "return"):
        raise ValueError(f"errors must be 'raise' or 'return', got {errors!r}")


def _results(plans: list[Request | _Done], tokenizer: Any, errors: str) -> list[Completion]:
    return _raise_or_return([_completion(plan, tokenizer) for plan in plans], errors)


def _raise_or_return(completions: list[Completion], errors: str) -> list[Completion]:
    failed = [(i, c.error) for i, c in enumerate(completions) if c.finish_reason == "error"]
    if failed and errors == "raise":
        details = "; ".join(f"prompts[{i}]: {error}" for i, error in failed[:5])
        more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
        raise RequestError(
            f"{len(failed)} of {len(completions)} requests refused, the others completed "
            f"(see .completions): {details}{more}",
            completions,
        )
    return completions


def stream(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> Iterator[StreamEvent]:
    """Like `generate`, but yield every token of every request as soon as its step ends.

    All prompts run in one continuous batch (shared with every other caller of the model); events
    interleave across requests. A refused prompt raises ValueError before anything runs. Closing the
    iterator early cancels what is left (freeing its KV blocks).
    """
    with _patched(model) as state:
        live, submission = _start_stream(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, seed=seed
        )
        if submission is None:
            return
        events = _StreamEvents(live, tokenizer)
        with closing(submission.updates()) as updates:  # closing this generator cancels what is left
            for update in updates:
                yield from events.of(update)


async def astream(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> AsyncIterator[StreamEvent]:
    """`stream` for asyncio: ``async for event in hfaccel.astream(model, prompts, ...)``, the same events.

    Leaving the loop early (or cancelling the task) cancels what is left.
    """
    with _patched(model) as state:
        live, submission = _start_stream(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, asynchronous=True, seed=seed
        )
        if submission is None:
            return
        events = _StreamEvents(live, tokenizer)
        async with aclosing(submission.aupdates()) as updates:
            async for update in updates:
                for event in events.of(update):
                    yield event


def _start_stream(
    model: Any,
    state: PatchState,
    prompts: Sequence[Prompt],
    tokenizer: Any,
    generation_config: Any,
    kwargs: dict[str, Any],
    asynchronous: bool = False,
    seed: int | None = None,
) -> tuple[list[tuple[int, Request]], Submission | None]:
    """Plan the prompts (raising for a refused one) and submit the runnable ones as one stream."""
    plans = _plan_all(model, state, prompts, tokenizer, generation_config, kwargs, False, seed)
    refused = [(i, p.error) for i, p in enumerate(plans) if isinstance(p, _Done) and p.error]
    if refused:
        raise ValueError("; ".join(f"prompts[{i}]: {e}" for i, e in refused))
    live = [(i, plan) for i, plan in enumerate(plans) if isinstance(plan, Request)]
    if not live:
        return live, None
    loop = state.get_loop(model)
    requests = [request for _, request in live]
    submission = (
        loop.submit_async(requests, stream=True) if asynchronous else loop.submit(requests, stream=True)
    )
    return live, submission


class _StreamEvents:
    """Turns the loop's per-request updates into `StreamEvent`s (with incremental text)."""

    def __init__(self, live: list[tuple[int, Request]], tokenizer: Any) -> None:
        self.live = live
        self.tokenizer = tokenizer
        self.tokens: list[list[int]] = [[] for _ in live]
        self.texts = [""] * len(live)

    def of(self, update: Update) -> Iterator[StreamEvent]:
        index, request = self.live[update.index]
        tokens = self.tokens[update.index]
        for k, token in enumerate(update.token_ids):
            tokens.append(token)
            done = update.finished and k == len(update.token_ids) - 1
            delta = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                delta, self.texts[update.index] = text[len(self.texts[update.index]) :], text
            yield StreamEvent(index, token, delta, done, request.finish_reason if done else None)


_temporary_patch_lock = threading.Lock()


@contextmanager
def _patched(model: Any) -> Iterator[PatchState]:
    """The model's patch state; an unpatched model is patched for the block and restored after the last
    of the calls that patched it this way ends (concurrent calls share one engine)."""
    with _temporary_patch_lock:
        if not is_patched(model):
            patch(model)
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


def _encode(prompt: Prompt, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs tokenizer= to encode it")
        return list(tokenizer(prompt)["input_ids"])
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


@dataclass
class _Done:
    """A prompt completed without the engine: refused, given no room to generate, or run by HF."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    error: str | None = None


def _plan_all(
    model: Any,
    state: PatchState,
    prompts: Sequence[Prompt],
    tokenizer: Any,
    generation_config: Any,
    kwargs: dict[str, Any],
    logprobs: bool,
    seed: int | None = None,
) -> list[Request | _Done]:
    """Every prompt turned into engine requests (n per prompt for num_return_sequences) or a `_Done`;
    with `seed`, the i-th request's random stream is seeded with ``seed + i``."""
    if isinstance(prompts, (str, torch.Tensor)):
        raise ValueError("prompts must be a list (of strings, token-id lists or chat message lists)")
    configs = _per_prompt_configs(generation_config, len(prompts))
    plans: list[Request | _Done] = []
    for prompt, config in zip(prompts, configs):
        try:
            first = None if seed is None else seed + len(plans)
            plans.extend(
                _plan(model, state, _encode(prompt, tokenizer), config, kwargs, tokenizer, logprobs, first)
            )
        except ValueError as error:
            plans.append(_Done([], finish_reason="error", error=str(error)))
    return plans


def _plan(
    model: Any,
    state: PatchState,
    ids: list[int],
    config: GenerationConfig | None,
    kwargs: dict[str, Any],
    tokenizer: Any,
    logprobs: bool,
    seed: int | None = None,
) -> list[Request | _Done]:
    has_default_max, has_default_min = has_default_lengths(model, config, kwargs)
    prepared, _ = prepare_config(model, config, dict(kwargs))
    copies = prepared.num_return_sequences or 1
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    reason = unsupported_reason(prepared)
    if reason is None:
        model._prepare_special_tokens(prepared, True, device=device)  # one unpadded row: no mask needed
        stopping, sampling = request_params(
            model, prepared, input_ids, has_default_max, has_default_min, tokenizer, output_logprobs=logprobs
        )
        reason = window_reason(model, len(ids) + stopping.max_new_tokens)
    if reason is not None:
        fall_back(state, reason)
        output = state.run_original(input_ids, generation_config=copy.deepcopy(prepared), tokenizer=tokenizer)
        eos = prepared.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        rows = [row[len(ids) :].tolist() for row in output]
        return [_Done(ids, new, "stop" if new and new[-1] in eos_ids else "length") for new in rows]
    if stopping.max_new_tokens <= 0:
        return [_Done(ids) for _ in range(copies)]
    engine = state.get_engine(model)
    seeds = [None if seed is None else seed + i for i in range(copies)]
    return [engine.make_request(ids, stopping, sampling, seed=s) for s in seeds]


def _completion(plan: Request | _Done, tokenizer: Any) -> Completion:
    if isinstance(plan, _Done):
        text = tokenizer.decode(plan.token_ids, skip_special_tokens=True) if tokenizer is not None else None
        return Completion(plan.prompt_token_ids, plan.token_ids, text, plan.finish_reason, error=plan.error)
    metrics = {
        **plan.metrics.as_dict(),
        "num_cached_prompt_tokens": plan.num_cached_prompt_tokens,
        "num_preemptions": plan.num_preemptions,
    }
    if plan.spec_drafted:
        metrics.update(speculative_stats(plan))
    tokens = list(plan.output_token_ids)
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    logprobs = list(plan.logprobs) if plan.sampling.output_logprobs else None
    return Completion(
        list(plan.prompt_token_ids), tokens, text, plan.finish_reason or "length", metrics, logprobs
    )
