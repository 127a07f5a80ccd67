"""Goodput under latency targets: Poisson arrivals at several rates, requests/s that meet both a TPOT and a
TTFT target, for fixed engine settings (today's defaults, the best hand-tuned fixed setting), the
adaptive scheduler (targets given to the engine, admission control rejecting what cannot be met, prefix-
aware admission) and HF's own continuous batching (`generate_batch`'s manager), side by side.

Goodput at a rate = rate x the share of requests that meet both targets (a rejected request meets none).
Requests are chat-like: half share a 100-token system prompt (plus 10-40 tokens of their own), the rest
have their own 20-100 tokens; 16 output tokens each (EOS ignored). Every hfaccel engine is warmed by the
same short burst first, so the step-time model has steps to learn from (the fixed settings get it too).

Every system sees the same arrivals (they depend only on the rate and the seed) and the same targets. On
a shared machine the step time drifts from minute to minute, so `repeats` runs the whole sweep again
with the systems in the reverse order each time, and the summary gives the median and the range of each
cell. For each hfaccel run the step-time model's fit to that run's steps is printed (median error of the
prediction made when the step was recorded, R2 of the last fit), and for the adaptive run the TTFT
calibration factor it ended with (observed / raw estimate). `run_host_share` measures the host's share of
a step with asynchronous scheduling off and on.
"""

from __future__ import annotations

import random
import statistics
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
    repeat: int = 0
    # The step-time model on the timed steps: median |predicted / observed - 1|, median observed /
    # predicted, R2 of the last fit; the TTFT calibration factor at the end (adaptive). None: not known.
    step_error: float | None = None
    step_ratio: float | None = None
    fit_r2: float | None = None
    ttft_factor: float | None = None

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
    errors, ratios = [], []
    start = time.perf_counter()
    while next_index < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(arrivals) and arrivals[next_index].arrival_s <= now:
            item = arrivals[next_index]
            requests.append(engine.add_request(item.prompt, stop, arrival_time=start + item.arrival_s))
            next_index += 1
        if engine.has_unfinished_requests():
            before = engine.num_steps
            engine.step(draining=next_index == len(arrivals))
            max_running = max(max_running, len(engine.scheduler.running))
            if engine.num_steps > before:  # the model's prediction for the step just recorded
                stats = engine.step_stats[-1]
                predicted = engine.cost_model().predict(
                    stats.num_decode_tokens, stats.num_prefill_tokens, stats.num_kv_tokens
                )
                if predicted and stats.duration_s > 0:
                    errors.append(abs(predicted / stats.duration_s - 1))
                    ratios.append(stats.duration_s / predicted)
        elif next_index < len(arrivals):
            time.sleep(max(0.0, arrivals[next_index].arrival_s - (time.perf_counter() - start)))
    result = GoodputResult(name, rate, seconds=time.perf_counter() - start, max_running=max_running)
    for r in requests:
        result.ttft_s.append(r.metrics.ttft_s if r.finish_reason != "rejected" else None)
        result.tpot_s.append(r.metrics.tpot_s if r.finish_reason != "rejected" else None)
        result.rejected += r.finish_reason == "rejected"
    if errors:
        result.step_error = statistics.median(errors)
        result.step_ratio = statistics.median(ratios)
    fit = engine.cost_model().fit()
    result.fit_r2 = None if fit is None else fit.r2
    if config.ttft_target_ms is not None:
        result.ttft_factor = engine.scheduler.ttft_calibration.factor
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
    repeats: int = 1,
    plot_path: str | None = None,
) -> list[GoodputResult]:
    """Run every system at every rate (`repeats` times, alternating the order of the systems); print a
    row per run and a summary (median goodput and range per cell, adaptive against the fixed settings)."""
    base = EngineConfig(kv_cache_memory=2 * 1024**3)
    best_fixed = best_fixed or dict(BEST_FIXED)
    before = torch.get_num_threads()
    if threads is not None:
        # HF's manager runs its forward on a thread of its own; on a busy machine a non-main thread's
        # kernels behave like 1 OpenMP thread, which there is 3-4x faster than 2 in the main thread:
        # the same thread count for every system keeps the comparison fair (docs/benchmarks.md).
        torch.set_num_threads(threads)
    try:
        results = _run_all(
            model,
            dtype,
            rates,
            num_requests,
            tpot_target_ms,
            ttft_target_ms,
            best_fixed,
            systems,
            base,
            repeats,
        )
    finally:
        torch.set_num_threads(before)
    print(summarize(results, num_requests, ttft_target_ms / 1000, tpot_target_ms / 1000))
    if plot_path:
        plot_goodput(results, num_requests, ttft_target_ms / 1000, tpot_target_ms / 1000, plot_path)
        print(f"plot: {plot_path}")
    return results


# The fixed setting tuned by hand beforehand (small steps for TPOT); see docs/benchmarks.md.
BEST_FIXED = {"max_num_seqs": 24, "max_num_batched_tokens": 64}


def _run_all(
    model, dtype, rates, num_requests, tpot_target_ms, ttft_target_ms, best_fixed, systems, base, repeats
):
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
        f"{OUTPUT_LEN} output tokens; best fixed = {best_fixed}; {repeats} repeat(s)"
    )
    results = []
    for repeat in range(repeats):
        order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
        for rate in rates:
            arrivals = workload(vocab, rate, num_requests)
            for system in order:
                if system == "hf":
                    result = run_hf_generate_batch(model, arrivals, rate)
                else:
                    result = run_hfaccel(model, configs[system], arrivals, system, rate)
                result.repeat = repeat
                results.append(result)
                print(_row(result, num_requests, ttft_target_ms / 1000, tpot_target_ms / 1000), flush=True)
    return results


def _row(r: GoodputResult, n: int, ttft_s: float, tpot_s: float) -> str:
    met = r.met(ttft_s, tpot_s)
    served = [(a, b) for a, b in zip(r.ttft_s, r.tpot_s) if a is not None and b is not None]
    ttft_miss = sum(1 for a, _ in served if a > ttft_s)
    tpot_miss = sum(1 for _, b in served if b > tpot_s)
    line = (
        f"rate {r.rate:>4.1f}/s  {r.system:<18} goodput {r.rate * met / n:>5.2f} req/s  met {met:>3}/{n}  "
        f"rejected {r.rejected:>3}  missed TTFT {ttft_miss:>3} TPOT {tpot_miss:>3}  max running {r.max_running:>3}  "
        f"{r.seconds:>5.1f} s"
    )
    if r.step_error is not None:
        line += f"  step model: median error {r.step_error:.0%}, observed/predicted {r.step_ratio:.2f}"
        if r.fit_r2 is not None:
            line += f", R2 {r.fit_r2:.2f}"
    if r.ttft_factor is not None:
        line += f"  TTFT calibration x{r.ttft_factor:.2f}"
    return line


def summarize(results: list[GoodputResult], n: int, ttft_s: float, tpot_s: float) -> str:
    """Median goodput (and range over the repeats) per rate and system, and adaptive's ratio to the
    defaults and to the best fixed setting at that rate (the better of the two fixed ones)."""
    cells: dict[tuple[float, str], list[float]] = {}
    for r in results:
        cells.setdefault((r.rate, r.system), []).append(r.rate * r.met(ttft_s, tpot_s) / n)
    systems = list(dict.fromkeys(r.system for r in results))
    rates = sorted({r.rate for r in results})
    lines = ["", "goodput (req/s): median [min-max] over repeats"]
    header = f"{'rate':>6}  " + "  ".join(f"{s:>20}" for s in systems)
    if "adaptive" in systems and "defaults" in systems:
        header += "  adaptive/defaults  adaptive/best fixed"
    lines.append(header)
    for rate in rates:
        medians = {}
        row = f"{rate:>6.1f}  "
        for system in systems:
            values = cells.get((rate, system), [])
            if not values:
                row += f"{'-':>20}  "
                continue
            medians[system] = statistics.median(values)
            row += f"{medians[system]:>6.2f} [{min(values):.2f}-{max(values):.2f}]".rjust(20) + "  "
        if "adaptive" in medians and "defaults" in medians:
            fixed = max(medians[s] for s in ("defaults", "best fixed") if s in medians)
            row += f"{_ratio(medians['adaptive'], medians['defaults']):>17}  {_ratio(medians['adaptive'], fixed):>19}"
        lines.append(row.rstrip())
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    if b > 0:
        return f"{a / b:.2f}x"
    return "inf" if a > 0 else "-"


def run_host_share(model: Any, repeats: int = 2, threads: int | None = 1) -> list[dict[str, Any]]:
    """The host's share of a step (scheduling, packing, sampling, bookkeeping: the step's time outside the
    forward) with asynchronous scheduling off and on: 16 requests of 20-80 prompt tokens x 24 new tokens,
    the settings run alternately `repeats` times each. Prints one row per run."""
    vocab = model.get_input_embeddings().num_embeddings
    rng = random.Random(7)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(20, 80))] for _ in range(16)]
    stop = StoppingParams(max_new_tokens=24, min_new_tokens=24)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    try:
        print(f"\nhost share of a step: {cpu_description()}")
        for repeat in range(repeats):
            for setting in (False, True) if repeat % 2 == 0 else (True, False):
                engine = Engine(model, EngineConfig(kv_cache_memory=2 * 1024**3, async_scheduling=setting))
                engine.run(
                    [engine.make_request(p[:8], StoppingParams(max_new_tokens=2)) for p in prompts[:4]]
                )
                engine.step_stats.clear()
                start = time.perf_counter()
                engine.run([engine.make_request(p, stop) for p in prompts])
                wall = time.perf_counter() - start
                steps = list(engine.step_stats)
                total = sum(s.duration_s for s in steps)
                row = {
                    "async_scheduling": setting,
                    "wall_s": wall,
                    "steps": len(steps),
                    "host_share": sum(s.host_s for s in steps) / total,
                    **{
                        f"{part}_share": sum(getattr(s, f"{part}_s") for s in steps) / total
                        for part in ("schedule", "pack", "sample", "update")
                    },
                    "overlapped_s": sum(s.overlapped_s for s in steps),
                }
                rows.append(row)
                print(
                    f"async_scheduling={str(setting):<5}  wall {wall:5.2f} s  {len(steps)} steps  host share "
                    f"{row['host_share']:.2%} (schedule {row['schedule_share']:.2%}, pack {row['pack_share']:.2%}, "
                    f"sample {row['sample_share']:.2%}, update {row['update_share']:.2%})  overlapped "
                    f"{row['overlapped_s'] * 1000:.1f} ms",
                    flush=True,
                )
    finally:
        torch.set_num_threads(before)
    return rows


def plot_goodput(
    results: list[GoodputResult], n: int, ttft_s: float, tpot_s: float, path: str, title: str = ""
) -> None:
    """Goodput against arrival rate per system (median over repeats, the range as error bars), saved to
    `path` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: dict[str, dict[float, list[float]]] = {}
    for r in results:
        cells.setdefault(r.system, {}).setdefault(r.rate, []).append(r.rate * r.met(ttft_s, tpot_s) / n)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = max(r.rate for r in results)
    ax.plot([0, top], [0, top], color="0.8", linestyle=":", label="every request meets both")
    for system, by_rate in cells.items():
        rates = sorted(by_rate)
        medians = [statistics.median(by_rate[rate]) for rate in rates]
        low = [m - min(by_rate[rate]) for m, rate in zip(medians, rates)]
        high = [max(by_rate[rate]) - m for m, rate in zip(medians, rates)]
        ax.errorbar(rates, medians, yerr=[low, high], marker="o", capsize=3, label=system)
    ax.set_xlabel("arrival rate (requests/s, Poisson)")
    ax.set_ylabel("goodput (requests/s meeting both targets)")
    ax.set_title(title or f"TTFT <= {ttft_s:g} s, TPOT <= {tpot_s * 1000:g} ms")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
