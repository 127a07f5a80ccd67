"""`hfaccel.generate` and `hfaccel.agenerate`: many prompts in one continuous batch, results in prompt
order."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import aclosing, contextmanager
from typing import Any

from transformers import GenerationConfig

from hfaccel.api.patching import patched_for_call
from hfaccel.api.planning import check_top_k, latency_targets, plan_call
from hfaccel.api.prompts import Prompt
from hfaccel.api.results import (
    Call,
    Completion,
    add_prompt_logprobs,
    build_completion,
    build_completions,
    raise_or_return,
)
from hfaccel.distributed import dp as data_parallel
from hfaccel.distributed.layout import parallel_layout
from hfaccel.engine.request import Request
from hfaccel.patches.patch_state import PatchState


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
    seed: int | Sequence[int] | None = None,
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
            (`Completion.prompt_logprobs`; computed with one extra forward of the model per prompt,
            under the prompt's `adapter`).
        errors: a refused prompt (empty, longer than the context, an invalid generation argument) never
            stops the others; they complete, then ``"raise"`` raises `RequestError` (a ValueError that
            names every refused prompt and carries all completions), ``"return"`` returns them with
            ``finish_reason="error"`` (``num_return_sequences`` of them, in the prompt's place). A
            request whose own logits processors or criteria raise fails alone: ``"raise"`` raises that
            error (the call's other requests are cancelled), ``"return"`` returns it as an error
            completion beside the others.
        seed: the random stream of sampled requests: request ``i`` (in result order) draws from its own
            generator seeded with ``seed + i``, so its samples are the same whatever else runs beside it.
            A list, one seed per prompt: prompt p's r-th request draws from ``seed[p] + r`` (each prompt
            samples as it would alone). ``None``: seeds are drawn from torch's global generator
            (``torch.manual_seed`` reproduces them).
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
    targets = latency_targets(tpot_target_ms, ttft_target_ms, priority)
    with planned_call(
        model, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.generate", logprobs,
        prompt_logprobs, errors, seed, targets, adapter,
    ) as (state, call):  # fmt: skip
        dp = parallel_layout(model).dp
        if dp is not None:  # data parallel: this replica runs its share, every rank returns all
            completions = run_data_parallel(model, state, dp, call, tokenizer, progress)
        else:
            if call.runnable:
                state.get_loop(model).run(call.runnable, progress=progress, raise_errors=errors == "raise")
            completions = build_completions(call, tokenizer)
        if prompt_logprobs is not None:
            add_prompt_logprobs(model, completions, int(prompt_logprobs), call.adapters)
    return raise_or_return(completions, errors)


def run_data_parallel(
    model: Any, state: PatchState, dp: Any, call: Any, tokenizer: Any, progress: bool
) -> list:
    """Data parallelism: spread the call's requests over the replicas by load, run this replica's share,
    and gather every completion on every rank (in request order)."""
    plans = call.plans
    indices = [i for i, plan in enumerate(plans) if isinstance(plan, Request)]
    owner = data_parallel.spread(
        dp,
        state.get_engine(model),
        [len(plans[i].prompt_token_ids) for i in indices],
        call_fingerprint(plans),
    )
    mine = [i for i, o in zip(indices, owner) if o == dp.replica]
    if mine:  # an error of its own comes back as an error completion: every rank reaches the gather
        state.get_loop(model).run([plans[i] for i in mine], progress=progress, raise_errors=False)
    index_of = call.prompt_indexes
    done = data_parallel.gather(dp, {i: build_completion(plans[i], tokenizer, index_of[i]) for i in mine})
    return [
        done[i] if i in done else build_completion(plan, tokenizer, index_of[i])
        for i, plan in enumerate(plans)
    ]


def call_fingerprint(plans: list) -> str:
    """A digest of what a call asks: each result's kind, prompt and (for an engine request) its length
    limits and whether it samples; data-parallel ranks compare it (`data_parallel.spread`)."""
    parts = []
    for plan in plans:
        request = plan if isinstance(plan, Request) else getattr(plan, "request", None)  # (a beam's)
        limits = None
        if request is not None:
            stopping, sampling = request.stopping, request.sampling
            limits = (stopping.max_new_tokens, stopping.min_new_tokens, sampling.do_sample)
        parts.append((type(plan).__name__, list((request or plan).prompt_token_ids), limits))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


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
    seed: int | Sequence[int] | None = None,
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
    targets = latency_targets(tpot_target_ms, ttft_target_ms, priority)
    with planned_call(
        model, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.agenerate", logprobs,
        prompt_logprobs, errors, seed, targets, adapter,
    ) as (state, call):  # fmt: skip
        if call.runnable:
            submission = state.get_loop(model).submit_async(call.runnable, raise_errors=errors == "raise")
            if progress:
                from tqdm.auto import tqdm

                with tqdm(total=len(call.runnable), desc="hfaccel", unit="req", leave=False) as bar:
                    async with aclosing(submission.aupdates()) as updates:
                        async for update in updates:
                            bar.update(int(update.finished))
            else:
                await submission.await_all()
        completions = build_completions(call, tokenizer)
        if prompt_logprobs is not None:
            await asyncio.to_thread(
                add_prompt_logprobs, model, completions, int(prompt_logprobs), call.adapters
            )
    return raise_or_return(completions, errors)


@contextmanager
def planned_call(
    model: Any,
    prompts: Any,
    tokenizer: Any,
    generation_config: Any,
    kwargs: dict[str, Any],
    where: str,
    logprobs: bool | int,
    prompt_logprobs: int | None,
    errors: str,
    seed: int | Sequence[int] | None,
    targets: dict[str, Any],
    adapter: Any,
) -> Iterator[tuple[PatchState, Call]]:
    """What `generate` and `agenerate` share: the call's own arguments checked, the model patched for the
    call if it is not, and the prompts planned; the block runs (or awaits) the call's requests."""
    check_errors(errors)
    check_top_k("prompt_logprobs", prompt_logprobs, allow_none=True)
    with patched_for_call(model) as state:
        yield (
            state,
            plan_call(
                model,
                state,
                prompts,
                tokenizer,
                generation_config,
                kwargs,
                where,
                logprobs,
                seed,
                targets,
                adapter,
            ),
        )


def check_errors(errors: str) -> None:
    if errors not in ("raise", "return"):
        raise ValueError(f"errors must be 'raise' or 'return', got {errors!r}")
