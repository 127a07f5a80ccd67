"""Asynchronous scheduling: the forward (and sampling) of step n runs on a worker thread while the engine
thread prepares what step n + 1 needs that does not depend on step n's tokens.

Step n's sampled tokens decide step n + 1's decode inputs, and its update decides which requests are
still running and which blocks are free, so the schedule itself cannot be made ahead without guessing
(vLLM schedules n + 1 assuming every running request gets one token and undoes the guess when one
stops). What is prepared here is the part that never depends on them: the prefix-cache keys of the
waiting requests (admission order, prefix-aware grouping, TTFT estimates) and the step-time model's
refit. Torch releases the GIL inside its kernels, so on a machine with cores to spare the two overlap;
the engine thread always waits for the forward to end before anything reads its results or touches the
KV cache, so the output is the same as the synchronous step's.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch

from hfaccel.engine.sampler import next_tokens


def _forward_and_sample(runner: Any, packed: Any) -> tuple[Any, list, float]:
    logits = runner.run(packed)
    ran_at = time.perf_counter()
    tokens = next_tokens(logits, packed.sampled_requests, packed.rows_per_request)
    return logits, tokens, ran_at


class AsyncStepper:
    """One worker thread per engine for the forward; the engine thread prepares ahead meanwhile."""

    def __init__(self, owner: Any) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfaccel-forward")
        weakref.finalize(owner, self._pool.shutdown, wait=False)

    def run(self, engine: Any, packed: Any) -> tuple[Any, list, float, float]:
        """(logits, tokens, when the forward ended, seconds of host work overlapped with it)."""
        future = self._pool.submit(_forward_and_sample, engine.runner, packed)
        start = time.perf_counter()
        try:
            engine._prepare_ahead()
        finally:
            overlapped = time.perf_counter() - start
            wait([future])  # whatever happened here, the forward ends before anything else runs
        logits, tokens, ran_at = future.result()  # its exception, if it raised
        return logits, tokens, ran_at, overlapped

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def resolve_async_scheduling(setting: bool | None, device: torch.device) -> bool:
    """``None`` (auto): off. On a CPU the host's share of a step is about 1% and overlapping it measured no
    gain (docs/benchmarks.md); on CUDA it is not measured yet, so it stays opt-in (``True``)."""
    del device  # the choice will depend on it once a GPU measurement says where it pays
    return bool(setting)
