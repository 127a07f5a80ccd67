"""Scheduler benchmarks: each compares engine settings side by side on one workload, in one run.

- prefix caching on vs off, on requests sharing a long system prompt (TTFT, throughput);
- chunked prefill on vs off, on chat traffic with long prompts mixed in, Poisson arrivals (inter-token
  latency of the running requests);
- static vs dynamic vs continuous batching, on varied output lengths (throughput, mean latency).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.metrics import summarize
from hfaccel.engine.request import Request, StoppingParams


@dataclass
class TimedRequest:
    """A prompt, how many tokens it must produce (EOS ignored), and when it arrives (seconds from start)."""

    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0


@dataclass
class ServingResult:
    """One engine setting's run of a workload."""

    name: str
    seconds: float
    requests: list[Request] = field(repr=False)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_token_ids) for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def ttft(self) -> dict[str, float | None]:
        return summarize(r.metrics.ttft_s for r in self.requests)

    def e2e(self) -> dict[str, float | None]:
        return summarize(r.metrics.e2e_s for r in self.requests)

    def itl(self, requests: list[Request] | None = None) -> dict[str, float | None]:
        return summarize(gap for r in (requests or self.requests) for gap in r.metrics.itl_s)


def replay(model: Any, config: EngineConfig, workload: list[TimedRequest], name: str) -> ServingResult:
    """Feed `workload` to a fresh engine at its arrival times (wall clock) and step until all finish."""
    engine = Engine(model, config)
    warm = engine.add_request(workload[0].prompt[:8], StoppingParams(max_new_tokens=2))
    while not warm.is_finished:
        engine.step(draining=True)
    engine.block_manager.stats.queried_tokens = engine.block_manager.stats.hit_tokens = 0
    pending = sorted(workload, key=lambda w: w.arrival_s)
    requests: list[Request] = []
    start = time.perf_counter()
    next_index = 0
    while next_index < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(pending) and pending[next_index].arrival_s <= now:
            item = pending[next_index]
            stop = StoppingParams(max_new_tokens=item.output_len, min_new_tokens=item.output_len)
            requests.append(engine.add_request(item.prompt, stop, arrival_time=start + item.arrival_s))
            next_index += 1
        if engine.has_unfinished_requests():
            engine.step(draining=next_index == len(pending))
        elif next_index < len(pending):
            time.sleep(max(0.0, pending[next_index].arrival_s - (time.perf_counter() - start)))
    seconds = time.perf_counter() - start
    return ServingResult(name, seconds, requests, engine.stats())


def _random_ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(count)]


def shared_prefix_workload(
    vocab: int, num_requests: int = 64, prefix_len: int = 1000, output_len: int = 16, seed: int = 0
) -> list[TimedRequest]:
    """`num_requests` prompts: one `prefix_len`-token system prompt plus a short question each."""
    rng = random.Random(seed)
    system = _random_ids(rng, prefix_len, vocab)
    return [
        TimedRequest(system + _random_ids(rng, rng.randint(8, 24), vocab), output_len)
        for _ in range(num_requests)
    ]


def mixed_long_workload(
    vocab: int,
    num_chat: int = 24,
    num_long: int = 3,
    long_len: int = 2000,
    rate_per_s: float = 2.0,
    seed: int = 0,
) -> list[TimedRequest]:
    """Chat requests (short prompt, 48 tokens out) and a few long prompts, Poisson arrivals."""
    rng = random.Random(seed)
    items = [TimedRequest(_random_ids(rng, rng.randint(20, 60), vocab), 48) for _ in range(num_chat)]
    for k in range(num_long):
        items.insert((k + 1) * num_chat // (num_long + 1), TimedRequest(_random_ids(rng, long_len, vocab), 8))
    clock = 0.0
    for item in items:
        clock += rng.expovariate(rate_per_s)
        item.arrival_s = clock
    return items


def varied_length_workload(vocab: int, num_requests: int = 32, seed: int = 0) -> list[TimedRequest]:
    """Short prompts, output lengths 8-256, all arriving at once."""
    rng = random.Random(seed)
    return [
        TimedRequest(_random_ids(rng, rng.randint(20, 60), vocab), rng.randint(8, 256))
        for _ in range(num_requests)
    ]


def _fmt(value: float | None, scale: float = 1000.0) -> str:
    return "-" if value is None else f"{value * scale:.0f}"


def bench_prefix_caching(model: Any, base: EngineConfig, vocab: int) -> list[ServingResult]:
    workload = shared_prefix_workload(vocab)
    results = [
        replay(model, base.with_overrides(enable_prefix_caching=flag), workload, f"prefix caching {label}")
        for flag, label in ((False, "off"), (True, "on"))
    ]
    print(f"\nshared 1,000-token system prompt, {len(workload)} requests x 16 tokens")
    print(
        f"{'setting':<22} {'seconds':>8} {'out tok/s':>10} {'TTFT mean ms':>13} {'TTFT p50 ms':>12} {'hit rate':>9}"
    )
    for r in results:
        ttft = r.ttft()
        print(
            f"{r.name:<22} {r.seconds:>8.1f} {r.tokens_per_s:>10.1f} {_fmt(ttft['mean']):>13} "
            f"{_fmt(ttft['p50']):>12} {r.stats['prefix_cache_hit_rate']:>9.2f}"
        )
    off, on = results
    print(
        f"caching: TTFT {off.ttft()['mean'] / on.ttft()['mean']:.1f}x lower, "
        f"throughput {on.tokens_per_s / off.tokens_per_s:.1f}x higher"
    )
    return results


def bench_chunked_prefill(model: Any, base: EngineConfig, vocab: int) -> list[ServingResult]:
    workload = mixed_long_workload(vocab)
    settings = [
        ("no chunking", base.with_overrides(chunked_prefill=False, max_num_batched_tokens=2048)),
        ("chunked (256/step)", base.with_overrides(chunked_prefill=True, max_num_batched_tokens=256)),
    ]
    results = [replay(model, config, workload, name) for name, config in settings]
    print(
        f"\nchat traffic + {sum(1 for w in workload if len(w.prompt) > 1000)} prompts of 2,000 tokens, "
        f"Poisson arrivals ({len(workload)} requests)"
    )
    print(
        f"{'setting':<22} {'seconds':>8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'ITL max ms':>11} {'TTFT p50 ms':>12}"
    )
    for r in results:
        chats = [q for q in r.requests if len(q.prompt_token_ids) < 1000]
        itl = r.itl(chats)
        gaps = [g for q in chats for g in q.metrics.itl_s]
        print(
            f"{r.name:<22} {r.seconds:>8.1f} {_fmt(itl['p50']):>11} {_fmt(itl['p99']):>11} "
            f"{_fmt(max(gaps) if gaps else None):>11} {_fmt(r.ttft()['p50']):>12}"
        )
    chat = [[q for q in r.requests if len(q.prompt_token_ids) < 1000] for r in results]
    ratio = results[0].itl(chat[0])["p99"] / results[1].itl(chat[1])["p99"]
    print(f"chunking: p99 inter-token latency of running chats {ratio:.1f}x lower")
    return results


def bench_batching(model: Any, base: EngineConfig, vocab: int) -> list[ServingResult]:
    workload = varied_length_workload(vocab)
    size = 16
    settings = [
        (f"static (batches of {size})", base.with_overrides(batching="static", max_batch_size=size)),
        (f"dynamic (<= {size}, 50 ms)", base.with_overrides(batching="dynamic", max_batch_size=size)),
        (f"continuous (<= {size} seqs)", base.with_overrides(batching="continuous", max_num_seqs=size)),
    ]
    results = [replay(model, config, workload, name) for name, config in settings]
    print(f"\nvaried output lengths (8-256 tokens), {len(workload)} requests at once, at most {size} running")
    print(f"{'setting':<26} {'seconds':>8} {'out tok/s':>10} {'mean latency s':>15}")
    for r in results:
        print(f"{r.name:<26} {r.seconds:>8.1f} {r.tokens_per_s:>10.1f} {r.e2e()['mean']:>15.2f}")
    cont = results[-1]
    for r in results[:-1]:
        print(
            f"continuous vs {r.name}: {cont.tokens_per_s / r.tokens_per_s:.2f}x tokens/s, "
            f"{r.e2e()['mean'] / cont.e2e()['mean']:.2f}x lower mean latency"
        )
    return results


def run_serving_benchmarks(model: Any, suites: tuple[str, ...], dtype: torch.dtype) -> dict[str, list]:
    """Run the named suites (`prefix`, `chunked`, `batching`) on `model`."""
    vocab = model.get_input_embeddings().num_embeddings
    base = EngineConfig(kv_cache_memory=2 * 1024**3)
    runners = {"prefix": bench_prefix_caching, "chunked": bench_chunked_prefill, "batching": bench_batching}
    print(f"\nscheduler benchmarks, dtype={dtype}")
    return {name: runners[name](model, base, vocab) for name in suites}
