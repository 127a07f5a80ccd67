"""`hfaccel.stream` and `hfaccel.astream`: every token of every request as soon as its step ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, closing
from typing import Any

from transformers import GenerationConfig

from hfaccel.api.detokenize import Detokenizer
from hfaccel.api.patching import patched_for_call
from hfaccel.api.planning import latency_targets, plan_call
from hfaccel.api.prompts import Prompt
from hfaccel.api.results import Call, Done, StreamEvent, describe_refusals
from hfaccel.engine.loop import Submission, Update
from hfaccel.engine.request import Request
from hfaccel.patches.patch_state import PatchState


def stream(
    model: Any,
    prompts: Prompt | Sequence[Prompt],
    *,
    tokenizer: Any = None,
    generation_config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    logprobs: bool | int = False,
    seed: int | Sequence[int] | None = None,
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
    with patched_for_call(model) as state:
        call, submission = start_stream(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.stream", logprobs,
            seed=seed, targets=latency_targets(tpot_target_ms, ttft_target_ms, priority), adapter=adapter,
        )  # fmt: skip
        events = StreamEvents(call, tokenizer)
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
    seed: int | Sequence[int] | None = None,
    tpot_target_ms: float | None = None,
    ttft_target_ms: float | None = None,
    priority: int = 0,
    adapter: str | Sequence[str | None] | None = None,
    **generate_kwargs: Any,
) -> AsyncIterator[StreamEvent]:
    """`stream` for asyncio: ``async for event in hfaccel.astream(model, prompts, ...)``, the same events.

    Closing it early cancels what is left (freeing its KV blocks): ``await events.aclose()``, or iterate
    inside ``async with contextlib.aclosing(hfaccel.astream(...)) as events``; so does cancelling the
    task. An async generator left by ``break`` is closed only when it is garbage-collected, so one still
    referenced keeps its requests running until then.
    """
    with patched_for_call(model) as state:
        call, submission = start_stream(
            model, state, prompts, tokenizer, generation_config, generate_kwargs, "hfaccel.astream", logprobs,
            asynchronous=True, seed=seed, targets=latency_targets(tpot_target_ms, ttft_target_ms, priority),
            adapter=adapter,
        )  # fmt: skip
        events = StreamEvents(call, tokenizer)
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


def start_stream(
    model: Any,
    state: PatchState,
    prompts: Any,
    tokenizer: Any,
    generation_config: Any,
    kwargs: dict[str, Any],
    where: str,
    logprobs: bool | int,
    asynchronous: bool = False,
    seed: int | Sequence[int] | None = None,
    targets: dict[str, Any] | None = None,
    adapter: str | Sequence[str | None] | None = None,
) -> tuple[Call, Submission | None]:
    """Plan the prompts (raising for a refused one) and submit the runnable ones as one stream."""
    call = plan_call(
        model, state, prompts, tokenizer, generation_config, kwargs, where, logprobs, seed, targets, adapter,
        beams=False,
    )  # fmt: skip
    refused = [
        (index, plan.error)
        for plan, index in zip(call.plans, call.prompt_indexes)
        if isinstance(plan, Done) and plan.error
    ]
    if refused:
        raise ValueError(describe_refusals(refused))
    if not call.runnable:
        return call, None
    loop = state.get_loop(model)
    submission = (
        loop.submit_async(call.runnable, stream=True)
        if asynchronous
        else loop.submit(call.runnable, stream=True)
    )
    return call, submission


class StreamEvents:
    """Turns the loop's per-request updates into `StreamEvent`s (with incremental text)."""

    def __init__(self, call: Call, tokenizer: Any) -> None:
        self.call = call
        self.live = [(i, plan) for i, plan in enumerate(call.plans) if isinstance(plan, Request)]
        self.tokenizer = tokenizer
        self.counts: dict[int, int] = {}  # tokens seen per prompt index
        self.detokenizers: dict[int, Detokenizer] = {}

    def completed(self) -> Iterator[StreamEvent]:
        """Events of the results that needed no engine (served by transformers' generate), up front."""
        for index, plan in enumerate(self.call.plans):
            if isinstance(plan, Done):
                for k, token in enumerate(plan.token_ids):
                    done = k == len(plan.token_ids) - 1
                    event = self._event(index, token, done, plan.finish_reason if done else None)
                    if plan.logprobs is not None:  # asked for: from HF's scores (`add_scored_logprobs`)
                        event.logprob = plan.logprobs[k]
                        event.top_logprobs = None if plan.top_logprobs is None else plan.top_logprobs[k]
                    yield event
                if not plan.token_ids:
                    yield self._event(index, None, True, plan.finish_reason)

    def of(self, update: Update) -> Iterator[StreamEvent]:
        index, request = self.live[update.index]
        for k, token in enumerate(update.token_ids):
            done = update.finished and k == len(update.token_ids) - 1
            yield self._event(index, token, done, request.finish_reason if done else None, request)
        if update.finished and not update.token_ids:  # it ended with no new token: its closing event
            yield self._event(index, None, True, request.finish_reason)

    def _event(
        self, index: int, token: int | None, done: bool, reason: str | None, request: Request | None = None
    ) -> StreamEvent:
        if token is None:  # a closing event: the text still held back, if any
            held = self.detokenizers.get(index)
            text = None if self.tokenizer is None else held.flush() if held is not None else ""
            return StreamEvent(index, None, text, True, reason, prompt_index=self.call.prompt_indexes[index])
        position = self.counts[index] = self.counts.get(index, -1) + 1
        delta = None
        if self.tokenizer is not None:
            if index not in self.detokenizers:
                self.detokenizers[index] = Detokenizer(self.tokenizer)
            delta = self.detokenizers[index].add(token, done)
        logprob = top = None
        if request is not None and request.sampling.output_logprobs:
            logprob = request.logprobs[position]  # the sampler records before the token reaches us
            if request.sampling.top_logprobs is not None:
                top = request.top_logprobs[position]
        return StreamEvent(index, token, delta, done, reason, logprob, top, self.call.prompt_indexes[index])
