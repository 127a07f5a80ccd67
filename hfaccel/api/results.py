"""What `hfaccel.generate` and `hfaccel.stream` give back: `Completion`, `StreamEvent`, `RequestError`,
the grouping of copies per prompt, and prompt log-probabilities."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.engine.request import Request
from hfaccel.engine.sampler import top_logprobs
from hfaccel.engine.speculative.proposer import speculative_stats


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
    """A new token of one request in `hfaccel.stream`; or, for a request that ended with no new token
    (rejected by its latency target before it ran, no room left to generate), its closing event alone:
    ``token_id`` None, ``finished`` True and the ``finish_reason``."""

    index: int  # the request's position in the prompts given (times num_return_sequences)
    token_id: int | None
    text: str | None  # the text this token adds, when a tokenizer is known
    finished: bool
    finish_reason: str | None
    logprob: float | None = None  # with logprobs=: the token's log-probability (processed distribution)
    top_logprobs: dict[int, float] | None = None  # with logprobs=k: the k most likely tokens and this one
    prompt_index: int = 0  # the position of its prompt in the prompts given


def no_metrics(e2e_s: float | None = None) -> dict[str, float | None]:
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
class Done:
    """A prompt completed without the engine: refused, given no room to generate, or run by HF."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    error: str | None = None
    metrics: dict[str, float | None] = field(default_factory=no_metrics)
    logprobs: list[float] | None = None  # asked for, of a run by HF: from its processed scores
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class Hypothesis:
    """The `rank`-th hypothesis (best first) of a beam-search request: one result of `generate`."""

    request: Request
    rank: int


@dataclass
class Call:
    """One call's plan: per result, an engine `Request`, a beam `Hypothesis` or a `Done`, and the index
    of its prompt; per prompt, the adapter it named (None: the model as it is)."""

    plans: list[Request | Hypothesis | Done]
    prompt_indexes: list[int]
    adapters: list[str | None] = field(default_factory=list)

    @property
    def runnable(self) -> list[Request]:
        """The requests to run: the plain ones and each beam request once."""
        return [
            plan if isinstance(plan, Request) else plan.request
            for plan in self.plans
            if isinstance(plan, Request) or (isinstance(plan, Hypothesis) and plan.rank == 0)
        ]


def build_completions(call: Call, tokenizer: Any) -> list[Completion]:
    return [build_completion(plan, tokenizer, index) for plan, index in zip(call.plans, call.prompt_indexes)]


def build_completion(plan: Request | Hypothesis | Done, tokenizer: Any, prompt_index: int) -> Completion:
    if isinstance(plan, Hypothesis):
        return _hypothesis_completion(plan, tokenizer, prompt_index)
    if isinstance(plan, Done):
        text = tokenizer.decode(plan.token_ids, skip_special_tokens=True) if tokenizer is not None else None
        return Completion(
            plan.prompt_token_ids,
            plan.token_ids,
            text,
            plan.finish_reason,
            dict(plan.metrics),
            plan.logprobs,
            error=plan.error,
            top_logprobs=plan.top_logprobs,
            prompt_index=prompt_index,
        )
    metrics = {
        **plan.metrics.as_dict(),
        "num_cached_prompt_tokens": plan.num_cached_prompt_tokens,
        "num_preemptions": plan.num_preemptions,
    }
    if plan.speculation.drafted:
        metrics.update(speculative_stats(plan.speculation))
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


def raise_or_return(completions: list[Completion], errors: str) -> list[Completion]:
    refused = [c for c in completions if c.finish_reason == "error"]
    if not refused or errors == "return":
        return completions
    raise RequestError(
        f"{len(refused)} of {len(completions)} requests refused"
        + (", the others completed" if len(refused) < len(completions) else "")
        + f" (see .completions): {describe_refusals(refused)}",
        completions,
    )


def describe_refusals(refused: Sequence[Completion | tuple[int, str]]) -> str:
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


def _hypothesis_completion(plan: Hypothesis, tokenizer: Any, prompt_index: int) -> Completion:
    """A beam hypothesis as a `Completion`: its tokens (the EOS that ended it included, as HF returns
    them), ``"stop"`` when it ends in EOS; the request's metrics. A failed search gives its error."""
    completion = build_completion(plan.request, tokenizer, prompt_index)
    results = plan.request.beam_group.results if plan.request.beam_group is not None else None
    if results is None or plan.request.error is not None:
        return completion
    tokens = list(results[plan.rank][0])
    stopped = bool(tokens) and tokens[-1] in plan.request.stopping.eos_token_ids
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    return dataclasses.replace(
        completion,
        token_ids=tokens,
        text=text,
        finish_reason="stop" if stopped else "length",
        logprobs=None,
        top_logprobs=None,
    )


# The most bytes of logits a prompt's forward may hold at once; a longer prompt's are computed a slice of
# positions at a time (`logits_to_keep`), each slice a forward of its own.
LOGITS_BUDGET_BYTES = 1 << 28


def output_rows(model: Any) -> int:
    """The rows of `model`'s logits: its output head's features (a quantized head has no float weight)."""
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None)
    return int(rows) if rows is not None else int(head.weight.shape[0])


def prompt_logprobs_of(
    model: Any, ids: list[int], k: int, adapter: str | None = None
) -> list[dict[int, float] | None]:
    """Per prompt token: None for the first, then ``{token id: log-probability}`` of that token and the
    `k` most likely ones, from a plain forward of `model` (its own attention, the raw distribution; with
    PEFT's ``adapter_names`` where the prompt named an adapter, as its tokens were generated). A
    prompt whose ``[L, V]`` logits pass `LOGITS_BUDGET_BYTES` takes one forward per slice of positions
    (transformers' ``logits_to_keep``), so the logits held stay bounded."""
    device = next(model.parameters()).device
    result: list[dict[int, float] | None] = [None]
    if len(ids) < 2:
        return result
    vocab = output_rows(model)
    width = max(1, min(len(ids) - 1, LOGITS_BUDGET_BYTES // (4 * vocab)))  # float32 rows per slice
    inputs = torch.tensor([ids], device=device)
    extra = {} if adapter is None else {"adapter_names": [adapter]}
    with torch.no_grad():
        for start in range(0, len(ids) - 1, width):
            end = min(start + width, len(ids) - 1)
            if width >= len(ids) - 1:
                logits = model(inputs, **extra).logits[0, start:end]
            else:
                keep = torch.arange(start, end, device=device)
                logits = model(inputs, logits_to_keep=keep, **extra).logits[0]
            for first in range(0, logits.shape[0], 512):  # log-softmax in slices: one float copy at most
                rows = torch.log_softmax(logits[first : first + 512].float(), dim=-1).cpu()
                for j, row in enumerate(rows):
                    result.append(top_logprobs(row, ids[start + first + j + 1], k))
    return result


def add_prompt_logprobs(
    model: Any, completions: list[Completion], k: int, adapters: Sequence[str | None] = ()
) -> None:
    """`Completion.prompt_logprobs` for every completion with a prompt; one forward per prompt (the
    copies of a prompt share it), under the adapter the prompt named (`adapters`, one per prompt)."""
    done: dict[int, list[dict[int, float] | None]] = {}
    for completion in completions:
        if not completion.prompt_token_ids:
            continue
        if completion.prompt_index not in done:
            index = completion.prompt_index
            adapter = adapters[index] if index < len(adapters) else None
            done[index] = prompt_logprobs_of(model, completion.prompt_token_ids, k, adapter)
        completion.prompt_logprobs = done[completion.prompt_index]
