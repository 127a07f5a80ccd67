"""Latency targets in scheduling: the TPOT time budget, the batch check and TTFT admission control.

All of it is off unless asked for (a TPOT or TTFT target), so the schedule is exactly the scheduler's
own. With a TPOT target and a learnt step-time model (`engine/cost_model.py`), each step takes every
running decode, then prompt chunks sized by the time the running requests' mean time per output token
still allows (a TPOT is a mean: a step may spend what earlier steps saved; at least one chunk of
`block_size` tokens, so running prompts always progress), and a waiting request is admitted only while
the decode batch it would join is predicted to meet the tightest target (the batch grows while the queue
is deep and shrinks, by admitting less, when targets tighten; nothing is preempted for time). A request
whose TTFT target cannot be met given the queue (an estimate calibrated online against observed TTFTs)
is rejected or warned at once (`admission`), a never-started request whose TTFT deadline passes while it
waits is too, and one that could no longer start in time is rejected when its turn comes, before any
work is spent on it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from hfaccel.engine.cost_model import RatioCalibration
from hfaccel.engine.request import Request
from hfaccel.engine.scheduler_state import SchedulerState

logger = logging.getLogger("hfaccel")
# Aim below the target: the step-time model is a fit, and a shared machine is noisy.
HEADROOM = 0.85
# The mean time per output token is kept within this share of the TPOT target (steps are measured as
# they happen, so only the last steps' noise is left uncorrected), and one step lasts at most this many
# targets.
MEAN_HEADROOM = 0.95
MAX_STEP_TARGETS = 2.0


class LatencyPolicy:
    """The latency-target decisions of one scheduler, which holds it and whose queues, clock and
    step-time model it reads (both are read live: a test may swap the clock or the model)."""

    def __init__(self, scheduler: SchedulerState) -> None:
        self.scheduler = scheduler
        self.targets_used = scheduler.config.has_latency_targets  # some request may carry a latency target
        self.num_rejected = self.num_warned = 0
        # TTFT estimates at arrival, corrected online by what the requests then took: id(request) ->
        # (request, when it was estimated, the raw seconds estimated from then to its first token).
        self.ttft_calibration = RatioCalibration()
        self._ttft_predicted: dict[int, tuple[Request, float, float]] = {}

    def forget(self, request: Request) -> None:
        """`request` left the scheduler: its arrival estimate teaches nothing any more."""
        self._ttft_predicted.pop(id(request), None)

    def clear(self) -> None:
        self._ttft_predicted.clear()

    def fit(self) -> Any:
        cost_model = self.scheduler.cost_model
        return cost_model.fit() if cost_model is not None else None

    def tpot_target(self, request: Request) -> float | None:
        """The request's TPOT target in seconds (its own, else the engine's), or None."""
        config = self.scheduler.config
        ms = request.tpot_target_ms if request.tpot_target_ms is not None else config.tpot_target_ms
        return None if ms is None else ms / 1000.0

    def ttft_target(self, request: Request) -> float | None:
        """The request's TTFT target in seconds (its own, else the engine's), or None."""
        config = self.scheduler.config
        ms = request.ttft_target_ms if request.ttft_target_ms is not None else config.ttft_target_ms
        return None if ms is None else ms / 1000.0

    def tpot_limit(self, requests: Iterable[Request]) -> float | None:
        """The step time the tightest TPOT target among `requests` allows (with headroom), or None."""
        targets = [t for t in map(self.tpot_target, requests) if t is not None]
        return HEADROOM * min(targets) if targets else None

    # ----------------------------------------------------------------- TPOT: the step and the batch

    def time_budget(self) -> TimeBudget | None:
        """This step's time budget, when a request already producing tokens has a TPOT target and the
        step-time model is ready: the least that any such request allows (`step_allowance`)."""
        if not self.targets_used:
            return None
        now = self.scheduler.clock()
        limit = None
        for request in self.scheduler.running:
            if not request.output_token_ids:
                continue
            target = self.tpot_target(request)
            if target is not None:
                allowance = self.step_allowance(request, target, now)
                limit = allowance if limit is None else min(limit, allowance)
        if limit is None:
            return None
        fit = self.fit()
        return None if fit is None else TimeBudget(fit, limit)

    @staticmethod
    def step_allowance(request: Request, target_s: float, now: float) -> float:
        """How long the next step may take for `request` to keep its mean time per output token within
        `MEAN_HEADROOM` x its target: a TPOT is a mean over the request's life, so a step may spend the
        time the earlier steps saved (a pure-decode step that took 100 ms of a 150 ms target leaves 50 ms
        for a longer step with prompt chunks later), but never time that later steps would have to save
        (the request may stop at any token). At most `MAX_STEP_TARGETS` targets, so one stall stays
        bounded."""
        times = request.metrics.token_times
        intervals = len(request.output_token_ids)  # after this step's token
        if not times or intervals < 1:
            return HEADROOM * target_s
        allowance = MEAN_HEADROOM * target_s * intervals - (now - times[0])
        return min(allowance, MAX_STEP_TARGETS * target_s)

    def batch_check(self) -> BatchCheck | None:
        if not self.targets_used:
            return None
        fit = self.fit()
        if fit is None:
            return None
        running = self.scheduler.running
        kv = sum(r.num_tokens for r in running)
        return BatchCheck(self.scheduler.cost_model, fit, self.tpot_limit(running), kv, self)

    # ----------------------------------------------------------------- TTFT: estimate and admission

    def estimate_ttft(self, request: Request) -> float | None:
        """Seconds from `request`'s arrival to its first token if it joined the queue now (behind the
        requests that go first: resuming ones and those of its priority level or better): the time it
        has waited plus the time still ahead (`_ttft_ahead`, by the step-time model) corrected by what
        such estimates turned out to be (`ttft_calibration`, learnt online). None before the model is
        ready."""
        ahead = self._ttft_ahead(request)
        if ahead is None:
            return None
        return self.scheduler.clock() - request.metrics.arrival_time + ahead * self.ttft_calibration.factor

    def _ttft_ahead(self, request: Request) -> float | None:
        """The raw estimate of the seconds until `request`'s first token if it joined the queue now: the
        prompt tokens ahead of it (running prompts, the waiting requests that go first, its own) at the
        chunk size the TPOT target allows per step, and, when the batch is full (by `max_num_seqs` or by
        what the target allows), the decode steps until enough running requests end (output lengths at
        their maximum). A picture of the queue as it is now, corrected online by `estimate_ttft`."""
        fit = self.fit()
        if fit is None:
            return None
        scheduler = self.scheduler
        block = scheduler.block_manager.block_size
        running = list(scheduler.running)
        ahead = [
            w
            for w in scheduler.waiting
            if w is not request and (w.num_preemptions or w.user_priority <= request.user_priority)
        ]
        kv = sum(r.num_tokens for r in running)
        prompts_ahead = sum(r.num_uncomputed_tokens for r in running if r.num_uncomputed_tokens > 1)
        prompts_ahead += sum(w.num_tokens for w in ahead)
        own = max(1, request.num_tokens - block * scheduler.admission_order.cached_blocks(request))
        per_step, step_s = self._prefill_pace(fit, request, prompts_ahead + own)
        limit = self.tpot_limit([*running, request])
        seats = scheduler.max_num_seqs
        if limit is not None:  # the largest batch the target allows, its context at today's mean
            per_seq_kv = (kv + request.num_tokens) / (len(running) + 1)
            fits = (
                n
                for n in range(2, seats + 1)
                if scheduler.cost_model.predict_decode(n, per_seq_kv * n) > limit
            )
            seats = next(fits, seats + 1) - 1
        seats -= len(running)
        position = len(ahead) + 1
        wait_steps = 0
        if position > seats:
            left = sorted(max(1, r.stopping.max_new_tokens - len(r.output_token_ids)) for r in running) or [1]
            rounds, rest = divmod(position - max(seats, 0) - 1, len(left))
            wait_steps = left[rest] + rounds * left[-1]
        steps = max(wait_steps + math.ceil(own / per_step), math.ceil((prompts_ahead + own) / per_step))
        return steps * step_s

    def admission_check(self, request: Request) -> bool:
        """Admission control at arrival: False if `request` was rejected (its TTFT target cannot be met
        given the queue), True if it may queue (possibly with a warning). A request that would be first
        in line is never rejected here (it waits, and is rejected if its deadline passes before it
        starts): so requests keep being served and measured even when the calibrated estimate runs high,
        and the estimate comes back down."""
        if request.num_preemptions or request.output_token_ids:
            return True
        target = self.ttft_target(request)
        ahead = self._ttft_ahead(request)
        if target is None or ahead is None:
            return True
        scheduler = self.scheduler
        now = scheduler.clock()
        estimate = now - request.metrics.arrival_time + ahead * self.ttft_calibration.factor
        first_in_line = not any(
            w.num_preemptions or w.user_priority <= request.user_priority for w in scheduler.waiting
        )
        if estimate <= target or first_in_line:
            self._ttft_predicted[id(request)] = (request, now, ahead)
            return True
        reason = (
            f"TTFT target {target * 1000:.0f} ms cannot be met: about {estimate * 1000:.0f} ms expected "
            f"with {len(scheduler.waiting)} requests waiting and {len(scheduler.running)} running"
        )
        if self._refuse(request, reason):  # warned and queued: it still teaches the estimate
            self._ttft_predicted[id(request)] = (request, now, ahead)
            return True
        return False

    def too_late_to_start(self, request: Request) -> bool:
        """With `admission="reject"`: whether a request that has not started would miss its TTFT target
        even if it started now (the time it waited plus its own prompt at the chunk size the TPOT target
        allows); if so it is rejected here, before any work is spent on it, and its place goes to the
        requests behind it (the caller takes it out of its queue)."""
        scheduler = self.scheduler
        if scheduler.config.admission != "reject" or request.num_preemptions or request.output_token_ids:
            return False
        target = self.ttft_target(request)
        fit = self.fit() if target is not None else None
        if fit is None:
            return False
        cached = scheduler.admission_order.cached_blocks(request)
        own = max(1, request.num_tokens - scheduler.block_manager.block_size * cached)
        per_step, step_s = self._prefill_pace(fit, request, own)
        now = scheduler.clock()
        if now - request.metrics.arrival_time + math.ceil(own / per_step) * step_s <= target:
            return False
        entry = self._ttft_predicted.pop(id(request), None)
        if entry is not None and entry[0] is request:
            self.ttft_calibration.observe(entry[2], now - entry[1])  # a lower bound, as for a late one
        self._refuse(
            request,
            f"TTFT target {target * 1000:.0f} ms cannot be met: the prompt would start after "
            f"{(now - request.metrics.arrival_time) * 1000:.0f} ms in the queue",
        )
        scheduler.retire_rejected(request)
        return True

    def _prefill_pace(self, fit: Any, request: Request, tokens: int) -> tuple[int, float]:
        """(prompt tokens a step computes, seconds a step takes) while the running batch decodes and
        `tokens` prompt tokens wait: chunks of what the tightest TPOT target among the batch and `request`
        leaves after the decodes (at least a block), else the step's token budget."""
        scheduler = self.scheduler
        _, _, c2, c3 = fit.coefficients
        per_token = c2 + c3
        kv = sum(r.num_tokens for r in scheduler.running)
        decodes = sum(1 for r in scheduler.running if r.num_uncomputed_tokens == 1)
        decode_s = fit.predict(decodes, 0, kv)
        limit = self.tpot_limit([*scheduler.running, request])
        if limit is not None and per_token > 0:
            per_step = max(scheduler.block_manager.block_size, int((limit - decode_s) / per_token))
        else:
            per_step = scheduler.max_num_batched_tokens - decodes
        per_step = max(1, min(per_step, scheduler.max_num_batched_tokens))
        filled = min(per_step, tokens)  # a step with less prompt work costs less
        return per_step, fit.predict(decodes, filled, kv + filled)

    def observe_first_tokens(self, sampled: list[Request]) -> None:
        """Teach the TTFT calibration from the requests that produced their first token in this step."""
        if not self._ttft_predicted:
            return
        for request in sampled:
            entry = self._ttft_predicted.get(id(request))
            if entry is None or entry[0] is not request or request.metrics.first_token_time is None:
                continue
            del self._ttft_predicted[id(request)]
            _, at, ahead = entry
            self.ttft_calibration.observe(ahead, request.metrics.first_token_time - at)

    def _refuse(self, request: Request, reason: str) -> bool:
        """Reject (returns False) or warn (returns True) per `admission`."""
        if self.scheduler.config.admission == "reject":
            request.rejected_reason = reason
            request.finish("rejected")
            self.num_rejected += 1
            return False
        request.warnings.append(reason)
        self.num_warned += 1
        level = logging.WARNING if self.num_warned == 1 else logging.DEBUG
        logger.log(
            level, "hfaccel: request %r: %s (queued anyway: admission='warn')", request.request_id, reason
        )
        return True

    def reject_late(self) -> None:
        """A request that has not started and whose TTFT deadline has passed while it waited is told so:
        rejected (returned by the next step among the finished) or warned, once. What it waited is a
        lower bound of its TTFT, and teaches the calibration as such."""
        scheduler = self.scheduler
        if not self.targets_used or not scheduler.waiting:
            return
        now = scheduler.clock()
        late = []
        for request in scheduler.waiting:
            target = self.ttft_target(request)
            if target is None or request.num_preemptions or now - request.metrics.arrival_time <= target:
                continue
            if scheduler.config.admission == "warn" and any(
                w.startswith("TTFT deadline") for w in request.warnings
            ):
                continue
            late.append(request)
        for request in late:
            waited = now - request.metrics.arrival_time
            target_ms = self.ttft_target(request) * 1000
            entry = self._ttft_predicted.get(id(request))
            if entry is not None and entry[0] is request:
                del self._ttft_predicted[id(request)]
                self.ttft_calibration.observe(entry[2], now - entry[1])
            reason = (
                f"TTFT deadline passed: waited {waited * 1000:.0f} ms in the queue, target {target_ms:.0f} ms"
            )
            if not self._refuse(request, reason):  # finished first, then out of the queues
                scheduler.waiting.remove(request)
                scheduler.retire_rejected(request)


class TimeBudget:
    """The step time a TPOT target leaves, spent as a step is filled (by the step-time model)."""

    def __init__(self, fit: Any, limit_s: float) -> None:
        self.coefficients = fit.coefficients
        self.limit = limit_s
        self.used = self.coefficients[0] + getattr(fit, "bias_s", 0.0)  # the step's fixed cost
        self.prefilled = False

    def room(self, start: int) -> int:
        """Prompt tokens a chunk starting at position `start` may compute in the time left."""
        _, _, c2, c3 = self.coefficients
        if c2 + c3 <= 0:
            return 1 << 30
        return max(0, int((self.limit - self.used - c3 * start) / (c2 + c3)))

    def take(self, request: Request, count: int, decode: bool, block_size: int) -> int:
        """A running request's tokens: a decode always runs (its drafts cost like prompt tokens); a prompt
        chunk is cut to the time left, but the first chunk of the step gets at least `block_size` tokens,
        so a running prompt always progresses."""
        _, c1, c2, c3 = self.coefficients
        start = request.num_computed_tokens
        if decode:
            self.used += c1 + c2 * (count - 1) + c3 * (start + count)
            return count
        room = self.room(start)
        if room < count:
            count = min(count, max(room, 0 if self.prefilled else block_size))
        if count:
            self.used += (c2 + c3) * count + c3 * start
            self.prefilled = True
        return count

    def take_admission(self, request: Request, count: int, block_size: int) -> int:
        """A new request's first chunk: cut to the time left in whole blocks, or 0 (not this step) if less
        than a block is left and the prompt does not fit."""
        _, _, c2, c3 = self.coefficients
        start = request.num_computed_tokens
        room = self.room(start)
        if room < count:
            count = room - room % block_size
        if count:
            self.used += (c2 + c3) * count + c3 * start
            self.prefilled = True
        return count


class BatchCheck:
    """Admit a request only while the decode step of the batch it joins is predicted to meet the tightest
    TPOT target among the batch and itself (the first request is always admitted), and the batch stays
    within twice the largest decode batch the step-time model has seen: a prediction for a batch size
    never run is a guess, so the batch grows by doublings, each measured before the next."""

    def __init__(
        self, cost_model: Any, fit: Any, limit_s: float | None, kv_tokens: int, policy: LatencyPolicy
    ) -> None:
        self.cost_model, self.fit, self.limit, self.kv, self.policy = (
            cost_model,
            fit,
            limit_s,
            kv_tokens,
            policy,
        )
        self.largest = max(2, 2 * cost_model.largest_decode_seen)

    def admits(self, request: Request, num_running: int) -> bool:
        own = self.policy.tpot_target(request)
        limit = self.limit
        if own is not None:
            limit = HEADROOM * own if limit is None else min(limit, HEADROOM * own)
        kv = self.kv + request.num_tokens
        if (
            limit is not None
            and num_running > 0
            and (
                num_running + 1 > self.largest or self.cost_model.predict_decode(num_running + 1, kv) > limit
            )
        ):
            return False
        self.kv, self.limit = kv, limit
        return True
