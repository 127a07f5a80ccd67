"""One generation request: its tokens, its stopping rules, and the scheduling state it carries."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StoppingParams:
    """When a request stops: ``max_new_tokens``, EOS ids (never before ``min_new_tokens``), when
    `stop_check` (given the prompt's ids and the generated ones) says a stop string has appeared, or
    when `criteria` (given
    the request, after each new token) says so. As in HF's generate, only EOS waits for
    ``min_new_tokens``: stop strings and custom criteria may stop a request before it."""

    max_new_tokens: int
    min_new_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop_check: Callable[[list[int], list[int]], bool] | None = None
    criteria: Callable[[Request], bool] | None = None  # e.g. HF's custom stopping criteria, run per row
    deadline: float | None = None  # a `time.time()` after which the next token is the last (max_time)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")


@dataclass(eq=False)
class SamplingParams:
    """How a request's next token is chosen from its logits; shared by the requests of one call.

    `processors` need the request's token ids and run per row; `warpers` look at scores only and run
    once on all the rows that share this object (HF builds both from a GenerationConfig). Greedy
    takes the argmax; sampling draws from the softmax with the request's own random stream (see
    `Request.seed`), so a request's samples do not depend on what else is in the batch.
    """

    do_sample: bool = False
    processors: Any = None  # an HF LogitsProcessorList, or None
    warpers: Any = None  # an HF LogitsProcessorList of score-only processors, or None
    output_scores: bool = False  # keep each step's processed scores
    output_logits: bool = False  # keep each step's raw logits
    output_logprobs: bool = False  # keep the log-probability of each chosen token
    top_logprobs: int | None = None  # also keep the k most likely tokens' log-probabilities per step
    beam: Any = None  # a `beam_search.BeamParams`: beam search instead of one token per step
    # Keep each computed token's hidden states / attention probabilities (`engine/recorded_states.py`)
    output_hidden_states: bool = False
    output_attentions: bool = False


GREEDY = SamplingParams()


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of a request's life."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was produced

    @property
    def queue_s(self) -> float | None:
        """Arrival to first scheduled step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        """Arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    def as_dict(self) -> dict[str, float | None]:
        """Plain-data summary (seconds)."""
        itl = self.itl_s
        return {
            "queue_s": self.queue_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "itl_max_s": max(itl) if itl else None,
            "e2e_s": self.e2e_s,
        }


@dataclass
class SpeculationCounts:
    """Drafted and accepted tokens, and verification steps: of one request, or an engine's totals."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    rejections: int = 0  # verification steps that rejected a draft (at most one each)

    def record(self, drafts: int, accepted: int) -> None:
        """One verification of `drafts` drafts, `accepted` of them accepted."""
        self.drafted += drafts
        self.accepted += accepted
        self.steps += 1
        self.rejections += accepted < drafts

    def acceptance(self, prior: float = 0.5, weight: float = 2.0) -> float:
        """The chance that a draft is accepted once the drafts before it were: accepted drafts over
        accepted plus rejected ones (each verification stops at its first rejection), starting from
        `prior` as if seen `weight` times (a request: the engine's own acceptance so far), at most 0.95."""
        return min(0.95, (self.accepted + weight * prior) / (self.accepted + self.rejections + weight))


@dataclass
class SpeculationState(SpeculationCounts):
    """A request's speculative decoding (`engine/speculative/`): the drafts the next step verifies (not
    part of the tokens yet), whether it still speculates (opt-out, or turned off for low acceptance),
    its own draft source, and its counters."""

    drafts: list[int] = field(default_factory=list)
    enabled: bool = True
    # This request's own draft source and draft length (e.g. HF's prompt_lookup_num_tokens), used instead
    # of the engine's (`EngineConfig.speculative` / `num_speculative_tokens`); None: the engine's.
    proposer: Any = field(default=None, repr=False)
    num_drafts: int | None = None
    # Draft-model speculation: how many of the request's leading tokens the draft model's KV cache holds
    # (0 whenever the request's blocks are freed: the draft recomputes them).
    draft_computed: int = 0


@dataclass(eq=False)
class Request:
    """A prompt being completed.

    ``num_computed_tokens`` counts the tokens whose K/V sits in the cache; the scheduler feeds the rest.
    After a preemption it drops to zero and the prompt plus the tokens generated so far are recomputed.
    """

    request_id: Any
    prompt_token_ids: list[int]
    stopping: StoppingParams
    sampling: SamplingParams = GREEDY
    output_token_ids: list[int] = field(default_factory=list)
    scores: list[Any] = field(default_factory=list)  # per token, when sampling.output_scores
    logits: list[Any] = field(default_factory=list)  # per token, when sampling.output_logits
    logprobs: list[float] = field(default_factory=list)  # per token, when sampling.output_logprobs
    # per token, when sampling.top_logprobs is set: {token id: log-probability} of the k most likely
    # tokens and the chosen one
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Token ids the logits processors (and custom stopping criteria) see before the prompt: the left
    # padding the row had in an HF batch, so processors that count the row's length (forced EOS,
    # begin-suppress, length penalty) or read its tokens (repetition penalty, n-gram bans) see what HF's
    # generate shows them.
    processor_prefix: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_slid_blocks: int = 0  # leading table entries given back as out of every layer's window (-1)
    # Its table in the sliding layers' own pool, for a model with full and sliding layers
    # (`window_blocks.WindowTable`); None otherwise.
    window_table: Any = None
    # The row of the model's recurrent-layer state it holds (models with recurrent layers only): taken
    # with its first block, given back with its blocks.
    state_slot: int | None = None
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    prefix_hash: int = 0  # hash chain value after those blocks
    cache_epoch: int = 0  # the block manager's prefix-cache epoch when the request was admitted
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    finish_reason: str | None = None
    error: BaseException | None = None  # why it failed (finish_reason "error"): the step's fault, or its own
    failed_alone: bool = False  # the error is its own (`fail(alone=True)`), not the step's
    num_preemptions: int = 0
    # A LoRA adapter the executor applies to this request's tokens (None: the model as it is), and the
    # prefix-cache salt: requests with different salts never share KV blocks (set to the adapter).
    adapter: str | None = None
    cache_salt: str | None = None
    priority: int | None = None  # order in which requests first started running (lower runs first)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Sampled requests draw from their own generator, reseeded for each position (`position_generator`):
    # the same seed and logits give the same tokens whatever the batch, the prefix cache, a preemption
    # (recomputation draws nothing) or how many drafts a step verified.
    seed: int | None = None
    generator: Any = field(default=None, repr=False)
    # return_dict_in_generate with a cache: the request's K/V per layer, ``[tokens, Hkv, D]``, copied out
    # of its blocks when it finishes (before they can be reused).
    keep_kv: bool = False
    kv_snapshot: list[tuple[Any, Any]] | None = field(default=None, repr=False)
    # Prompt inputs other than token ids (engine/prompt_inputs.py): embeddings ``[n, H]`` fed to the model
    # instead of the ids at prompt positions ``[0, n)`` (whenever they are computed: after a preemption
    # too), and K/V per layer ``[m, Hkv, D]`` of positions ``[0, m)`` written into the request's blocks
    # when it is admitted instead of being computed. Such requests have a cache salt of their own: their
    # blocks never match another prompt's by token ids. `processor_sees_prompt` False: the logits
    # processors see the generated tokens only (HF's ``inputs_embeds`` without ``input_ids``).
    prompt_embeds: Any = field(default=None, repr=False)
    # With sampling.output_hidden_states / output_attentions: what the model computed for each token,
    # by (kind, index) ("prompt" / "output"), recorded by the steps that computed it (recorded_states.py)
    recorded: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False)
    imported_kv: list[tuple[Any, Any]] | None = field(default=None, repr=False)
    processor_sees_prompt: bool = True
    # HF's right padding (an attention mask whose last column is masked): the prompt's last token is
    # fed once for the first token's logits, at HF's position 0 (`position_shift`), seeing the tokens
    # before it and not itself, and its K/V is never kept: the first generated token takes its cache
    # index (`drop_masked_last`) and the generated tokens take HF's positions 1, 2, ... That token gets a
    # step of its own (`Scheduler._chunk`): beside the tokens before it, a decode kernel that stores and
    # attends row by row (the C kernel's threads) could read their slots before they are written.
    masked_last: bool = False
    position_shift: int = 0  # added to the position of every token from cache index `shift_from` on
    shift_from: int = 0
    speculation: SpeculationState = field(default_factory=lambda: SpeculationState())
    # Adaptive scheduling: the request's own latency targets (None: the engine's), its user priority
    # (lower is admitted first, FCFS within a level; `priority` above is the engine's arrival order),
    # what admission control said, and how often later arrivals were admitted ahead of it.
    tpot_target_ms: float | None = None
    ttft_target_ms: float | None = None
    user_priority: int = 0
    rejected_reason: str | None = None  # finish_reason "rejected": why its TTFT target could not be met
    warnings: list[str] = field(default_factory=list)
    passed_over: int = 0
    arrival_seq: int = -1  # order of arrival at the scheduler
    # Beam search: the group of sequences this one belongs to (a `beam_search.BeamGroup`; the request a
    # caller holds is its first slot), None for other requests.
    beam_group: Any = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_imported_tokens(self) -> int:
        """Leading tokens whose K/V is imported (`imported_kv`) rather than computed."""
        return 0 if self.imported_kv is None else int(self.imported_kv[0][0].shape[0])

    def processor_ids(self) -> list[int]:
        """The token ids the logits processors see: `processor_prefix`, the prompt (unless hidden) and the
        generated tokens."""
        body = self.all_token_ids if self.processor_sees_prompt else self.output_token_ids
        return self.processor_prefix + body

    def positions(self, start: int, end: int) -> list[int] | range:
        """The model positions of the tokens at cache indices ``[start, end)``."""
        shift, since = self.position_shift, self.shift_from
        if not shift or end <= since:
            return range(start, end)
        return [p + shift if p >= since else p for p in range(start, end)]

    def feed_masked_last(self) -> None:
        """Treat the prompt's last token as HF's masked last column (see `masked_last`)."""
        if len(self.prompt_token_ids) < 2:
            raise ValueError("a masked last prompt token needs at least one attended token before it")
        self.masked_last = True
        self.shift_from = len(self.prompt_token_ids) - 1
        self.position_shift = -self.shift_from  # that token sits at HF's position 0
        # Its generated tokens' K/V hold shifted positions: shared only with requests shifted alike.
        self.cache_salt = ("masked last", self.shift_from, self.cache_salt)  # type: ignore[assignment]

    def drop_masked_last(self) -> None:
        """Once the masked last token gave its logits: it leaves the prompt and the cache, and the
        tokens after it sit one position later than their cache index says."""
        self.prompt_token_ids = self.prompt_token_ids[:-1]
        if self.prompt_embeds is not None and len(self.prompt_embeds) > len(self.prompt_token_ids):
            self.prompt_embeds = self.prompt_embeds[: len(self.prompt_token_ids)]
        self.num_computed_tokens -= 1
        self.masked_last = False
        self.position_shift += 1

    def token_at(self, position: int) -> int:
        prompt_len = len(self.prompt_token_ids)
        if position < prompt_len:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - prompt_len]

    def append_token(self, token_id: int, max_model_len: int, now: float | None = None) -> None:
        """Record a generated token and finish the request if a stopping rule fires. Nothing for a request
        already finished (one that failed while its token was chosen: its own logits processor raised)."""
        if self.is_finished:
            return
        self.output_token_ids.append(token_id)
        now = time.perf_counter() if now is None else now
        self.metrics.token_times.append(now)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        num_new = len(self.output_token_ids)
        stopping = self.stopping
        if num_new >= stopping.min_new_tokens and token_id in stopping.eos_token_ids:
            self.finish("stop")
            return
        checks = (
            (stopping.stop_check, (self.prompt_token_ids, self.output_token_ids)),
            (stopping.criteria, (self,)),
        )
        for check, arguments in checks:
            if check is None:
                continue
            try:
                stop = check(*arguments)
            except BaseException as error:  # the request's own callback: it fails alone
                if not fails_alone(error):
                    raise
                self.fail(error, alone=True)
                return
            if stop:
                self.finish("stop")
                return
        out_of_time = stopping.deadline is not None and time.time() > stopping.deadline
        if num_new >= stopping.max_new_tokens or self.num_tokens >= max_model_len or out_of_time:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.finish_time = time.perf_counter()
        self.status = RequestStatus.FINISHED  # last: a request is finished only with its reason set

    def fail(self, error: BaseException, alone: bool = False) -> None:
        """Finish with ``finish_reason="error"`` and keep `error` (the first one, if it fails twice).
        `alone`: the request's own doing (its processors or criteria raised, its scores were NaN), which
        ``hfaccel.generate(errors="return")`` returns beside the others; a step's fault is raised."""
        if self.is_finished and self.finish_reason == "error":
            return
        self.error = error
        self.failed_alone = alone
        self.finish("error")


# What transformers' torch.multinomial raises for probabilities that are not finite, and the engine with it.
NOT_FINITE = "probability tensor contains either `inf`, `nan` or element < 0"


def fails_alone(error: BaseException) -> bool:
    """Whether an exception from a request's own callback (a stop check, criterion or logits processor)
    fails that request alone: any `Exception`, and off the main thread any other (a KeyboardInterrupt,
    SystemExit or CancelledError raised there is the callback's doing: Ctrl-C lands on the main thread
    only). On the main thread those stop the step, as a Ctrl-C should."""
    return isinstance(error, Exception) or threading.current_thread() is not threading.main_thread()


def priority_key(request: Request) -> int:
    """A running request's scheduling priority (the order it first started in; -1 before it starts):
    blocks go to the lowest first, and preemption takes the highest."""
    return -1 if request.priority is None else request.priority


def request_generator(request: Request, device: torch.device) -> torch.Generator:
    """The request's own generator on `device`, made from its seed at first use."""
    generator = request.generator
    if generator is None or generator.device != device:
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, ()).item())
        request.seed = seed
        generator = request.generator = torch.Generator(device=device).manual_seed(seed)
    return generator


def position_generator(request: Request, position: int, device: torch.device) -> torch.Generator:
    """The request's generator reseeded for its token at output `position` (0: the first new token):
    the plain sampler, speculative verification and a draft model draw a position's token from this
    noise alone (an exponential race, ``argmax(p / E)``), so the request's tokens are the same however
    many drafts its steps verified, which the KV cache's pressure decides."""
    generator = request_generator(request, device)
    return generator.manual_seed(_mixed(request.seed, position))


def _mixed(seed: int, position: int) -> int:
    """A 63-bit seed for (`seed`, `position`): the request's seed scrambled (splitmix64), plus the position
    in its low 32 bits. A CPU generator seeds its Mersenne Twister from those 32 bits only, so two
    positions of one request never share a stream (scrambled whole, 1 request in 2,000 of 2,000 tokens
    had two that did, a review found); CUDA's Philox takes all 64."""
    x = (seed + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return ((x >> 32) << 32 | ((x + position) & 0xFFFFFFFF)) & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1
