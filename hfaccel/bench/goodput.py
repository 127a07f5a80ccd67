"""Goodput under latency targets: Poisson arrivals at several rates, requests/s that meet both a TPOT and a
TTFT target, for fixed engine settings (today's defaults, the best hand-tuned fixed setting), the
adaptive scheduler (targets given to the engine, admission control rejecting what cannot be met, prefix-
aware admission) and HF's own continuous batching (`generate_batch`'s manager), side by side.

Goodput at a rate = rate x the share of requests that meet both targets (a rejected request meets none).
Requests are chat-like: half share a 100-token system prompt (plus 10-40 tokens of their own), the rest
have their own 20-100 tokens; 16 output tokens each (EOS ignored). Every hfaccel engine is warmed by the
same short burst first, so the step-time model has steps to learn from (the fixed settings get it too).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams

OUTPUT_LEN = 16


@dataclass
class Arrival:
    prompt: list[int]
    arrival_s: float


@dataclass
class GoodputResult:
    system: str
    rate: float
    ttft_s: list[float | None] = field(default_factory=list)  # None: rejected / never produced a token
    tpot_s: list[float | None] = field(default_factory=list)
    rejected: int = 0
    seconds: float = 0.0
    max_running: int = 0

    def met(self, ttft_target_s: float, tpot_target_s: float) -> int:
        return sum(
            1
            for ttft, tpot in zip(self.ttft_s, self.tpot_s)
            if ttft is not None and tpot is not None and ttft <= ttft_target_s and tpot <= tpot_target_s
        )


def workload(vocab: int, rate: float, num_requests: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(100)]
    clock, items = 0.0, []
    for _ in range(num_requests):
        clock += rng.expovariate(rate)
        if rng.random() < 0.5:
            prompt = system + [rng.randrange(100, vocab) for _ in range(rng.randint(10, 40))]
        else:
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(20, 100))]
        items.append(Arrival(prompt, clock))
    return items


def _warm(engine: Engine, vocab: int) -> None:
    """A short burst of varied prompts: both kinds of step for the step-time model (and warm caches)."""
    rng = random.Random(123)
    stop = StoppingParams(max_new_tokens=12, min_new_tokens=12)
    requests = [
        engine.make_request([rng.randrange(100, vocab) for _ in range(n)], stop)
        for n in (8, 40, 120, 250, 16, 60, 200, 30, 90, 10, 150, 20)
    ]
    for i, request in enumerate(requests):  # staggered: mixed steps of every size
        engine.add(request)
        engine.step(draining=False)
        if i % 3 == 2:
            engine.step(draining=False)
    while engine.has_unfinished_requests():
        engine.step(draining=True)
    engine.block_manager.reset_prefix_cache()  # the timed run starts with a cold cache, as the others do


def run_hfaccel(
    model: Any, config: EngineConfig, arrivals: list[Arrival], name: str, rate: float
) -> GoodputResult:
    vocab = model.get_input_embeddings().num_embeddings
    engine = Engine(model, config)
    _warm(engine, vocab)
    stop = StoppingParams(max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN)
    requests, next_index, max_running = [], 0, 0
    start = time.perf_counter()
    while next_index < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(arrivals) and arrivals[next_index].arrival_s <= now:
            item = arrivals[next_index]
            requests.append(engine.add_request(item.prompt, stop, arrival_time=start + item.arrival_s))
            next_index += 1
        if engine.has_unfinished_requests():
            engine.step(draining=next_index == len(arrivals))
            max_running = max(max_running, len(engine.scheduler.running))
        elif next_index < len(arrivals):
            time.sleep(max(0.0, arrivals[next_index].arrival_s - (time.perf_counter() - start)))
    result = GoodputResult(name, rate, seconds=time.perf_counter() - start, max_running=max_running)
    for r in requests:
        result.ttft_s.append(r.metrics.ttft_s if r.finish_reason != "rejected" else None)
        result.tpot_s.append(r.metrics.tpot_s if r.finish_reason != "rejected" else None)
        result.rejected += r.finish_reason == "rejected"
    return result


def run_hf_generate_batch(model: Any, arrivals: list[Arrival], rate: float) -> GoodputResult:
    """HF's continuous batching manager, requests added at their arrival times, token timestamps kept."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=OUTPUT_LEN, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    results: dict[str, Any] = {}
    try:
        warm = [manager.add_request(a.prompt[:40], max_new_tokens=4, eos_token_id=-1) for a in arrivals[:4]]
        while len(results) < len(warm):
            out = manager.get_result(timeout=5)
            if out is not None and out.is_finished():
                results[out.request_id] = out
        results.clear()
        start = time.perf_counter()
        ids, created = [], {}
        for i, item in enumerate(arrivals):
            time.sleep(max(0.0, item.arrival_s - (time.perf_counter() - start)))
            rid = f"g{i}"
            created[rid] = start + item.arrival_s
            ids.append(
                manager.add_request(
                    item.prompt,
                    request_id=rid,
                    max_new_tokens=OUTPUT_LEN,
                    eos_token_id=-1,
                    record_timestamps=True,
                )
            )
            while True:  # collect what finished meanwhile
                out = manager.get_result(timeout=0)
                if out is None:
                    break
                if out.is_finished():
                    results[out.request_id] = out
        while len(results) < len(ids):
            out = manager.get_result(timeout=5)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing the workload")
                continue
            if out.is_finished():
                results[out.request_id] = out
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    result = GoodputResult("HF generate_batch", rate, seconds=seconds)
    for rid in ids:
        stamps = results[rid].timestamps or []
        result.ttft_s.append(stamps[0] - created[rid] if stamps else None)
        result.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None)
    return result


def run_goodput_benchmark(
    model: Any,
    dtype: torch.dtype,
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0),
    num_requests: int = 20,
    tpot_target_ms: float = 250.0,
    ttft_target_ms: float = 2000.0,
    threads: int | None = 1,
    best_fixed: dict[str, Any] | None = None,
    systems: tuple[str, ...] = ("defaults", "best fixed", "adaptive", "hf"),
) -> list[GoodputResult]:
    """Run every system at every rate; print the table (goodput req/s, share meeting both targets)."""
    base = EngineConfig(kv_cache_memory=2 * 1024**3)
    best_fixed = best_fixed or {"max_num_seqs": 24, "max_num_batched_tokens": 64}
    before = torch.get_num_threads()
    if threads is not None:
        # HF's manager runs its forward on a thread of its own; on a busy machine a non-main thread's
        # kernels behave like 1 OpenMP thread, which there is 3-4x faster than 2 in the main thread:
        # the same thread count for every system keeps the comparison fair (docs/benchmarks.md).
        torch.set_num_threads(threads)
    try:
        return _run_all(
            model, dtype, rates, num_requests, tpot_target_ms, ttft_target_ms, best_fixed, systems, base
        )
    finally:
        torch.set_num_threads(before)


def _run_all(model, dtype, rates, num_requests, tpot_target_ms, ttft_target_ms, best_fixed, systems, base):
    vocab = model.get_input_embeddings().num_embeddings
    configs = {
        "defaults": base.with_overrides(max_num_seqs=64, max_num_batched_tokens=2048),
        "best fixed": base.with_overrides(**best_fixed),
        "adaptive": base.with_overrides(
            tpot_target_ms=tpot_target_ms,
            ttft_target_ms=ttft_target_ms,
            admission="reject",
            prefix_aware_admission=True,
        ),
    }
    print(f"\ngoodput benchmark: {cpu_description()}, dtype={dtype}")
    print(
        f"targets: TPOT <= {tpot_target_ms:.0f} ms, TTFT <= {ttft_target_ms:.0f} ms; {num_requests} requests per rate, "
        f"{OUTPUT_LEN} output tokens; best fixed = {best_fixed}"
    )
    results = []
    for rate in rates:
        arrivals = workload(vocab, rate, num_requests)
        for system in systems:
            if system == "hf":
                result = run_hf_generate_batch(model, arrivals, rate)
            else:
                result = run_hfaccel(model, configs[system], arrivals, system, rate)
            results.append(result)
            print(_row(result, num_requests, ttft_target_ms / 1000, tpot_target_ms / 1000), flush=True)
    return results


def _row(r: GoodputResult, n: int, ttft_s: float, tpot_s: float) -> str:
    met = r.met(ttft_s, tpot_s)
    return (
        f"rate {r.rate:>4.1f}/s  {r.system:<18} goodput {r.rate * met / n:>5.2f} req/s  met {met:>3}/{n}  "
        f"rejected {r.rejected:>3}  max running {r.max_running:>3}  {r.seconds:>5.1f} s"
    )
