"""A burst of chat requests under a TPOT target (`python -m hfaccel bench burst`, issue #27 item 7).

Forty chat requests (every fifth with a long shared system context) arrive from separate threads within
3 s on SmolLM2 float32, each asking for `new_tokens` tokens. The TPOT target is twice a lone request's
TPOT, measured first. Side by side, one engine each, in one run:

- **no target**: the defaults;
- **target, warn**: ``tpot_target_ms`` on every request, ``admission="warn"`` (late requests queue);
- **target, reject**: the same with ``admission="reject"``;
- **fixed batch of 8**: no target, ``max_num_seqs=8`` (a hand-picked setting, for comparison).

Printed per system: the burst's wall time, requests admitted, the share of admitted requests whose TPOT
met the target, TPOT p50/p90/max, TTFT p50/max, and the decode-step time by batch size.
"""

from __future__ import annotations

import collections
import random
import statistics
import threading
import time
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.bench.workloads import QUESTIONS

CONTEXT = " ".join(
    ["The committee reviewed the annual budget, the staffing plan and the new building project in detail."]
    * 30
)


def _prompts(tokenizer: Any, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}]
        if i % 5 == 0:
            messages.insert(0, {"role": "system", "content": CONTEXT})
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    return prompts


def _burst(model: Any, prompts: list[list[int]], new_tokens: int, target_ms: float | None, seed: int) -> Any:
    import hfaccel

    rng = random.Random(seed)
    offsets = sorted(rng.uniform(0, 3) for _ in prompts)
    results: list[Any] = [None] * len(prompts)
    start = time.perf_counter()

    def run(i: int) -> None:
        time.sleep(max(0.0, offsets[i] - (time.perf_counter() - start)))
        targets = {} if target_ms is None else {"tpot_target_ms": target_ms}
        results[i] = hfaccel.generate(
            model,
            [prompts[i]],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            progress=False,
            **targets,
        )[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start, start


def run_burst_benchmark(requests: int = 40, new_tokens: int = 48, seed: int = 0) -> list[dict[str, Any]]:
    """Print and return one row per system (see the module doc)."""
    import hfaccel
    from hfaccel.default_model import load_default_model

    print(f"== a burst under a TPOT target: SmolLM2-135M float32, {cpu_description()}")
    systems = [
        ("no target", {}, False),
        ("target, warn", {"admission": "warn"}, True),
        ("target, reject", {"admission": "reject"}, True),
        ("fixed batch of 8", {"max_num_seqs": 8}, False),
    ]
    rows = []
    for name, options, with_target in systems:
        model, tokenizer = load_default_model(torch.float32)
        prompts = _prompts(tokenizer, requests)
        hfaccel.patch(model, progress=False, **options)
        try:
            hfaccel.generate(model, [prompts[1]], max_new_tokens=8, progress=False)  # warm
            lone = hfaccel.generate(
                model, [prompts[1]], max_new_tokens=new_tokens, min_new_tokens=new_tokens, progress=False
            )[0].metrics["tpot_s"]
            target_ms = 2e3 * lone
            results, wall, start = _burst(
                model, prompts, new_tokens, target_ms if with_target else None, seed
            )
            engine = model._hfaccel.get_engine(model)
            steps = [s for s in engine.step_stats if s.start_s >= start and not s.num_prefill_tokens]
        finally:
            hfaccel.unpatch(model)
        admitted = [r for r in results if r.finish_reason not in ("rejected", "error")]
        tpots = sorted(r.metrics["tpot_s"] * 1e3 for r in admitted if r.metrics["tpot_s"])
        ttfts = sorted(r.metrics["ttft_s"] for r in admitted if r.metrics["ttft_s"] is not None)
        met = sum(t <= target_ms for t in tpots)
        by_batch: dict[int, list[float]] = collections.defaultdict(list)
        for s in steps:
            by_batch[s.num_seqs].append(s.duration_s * 1e3)
        row = {
            "system": name,
            "wall_s": wall,
            "admitted": len(admitted),
            "met": met,
            "target_ms": target_ms,
            "decode_ms": {k: statistics.median(v) for k, v in sorted(by_batch.items())},
        }
        rows.append(row)
        print(
            f"{name:>17}: burst {wall:5.1f} s, admitted {len(admitted)}/{requests}, TPOT target "
            f"{target_ms:.0f} ms met by {met}/{len(admitted)} ({100 * met / max(1, len(admitted)):.0f}%), TPOT "
            f"p50 {tpots[len(tpots) // 2]:.0f} p90 {tpots[int(0.9 * (len(tpots) - 1))]:.0f} max {tpots[-1]:.0f} ms, "
            f"TTFT p50 {ttfts[len(ttfts) // 2]:.1f} max {ttfts[-1]:.1f} s",
            flush=True,
        )
        common = sorted(by_batch, key=lambda k: -len(by_batch[k]))[:6]
        print(
            "                   decode step by batch: "
            + ", ".join(
                f"{k}: {statistics.median(by_batch[k]):.0f} ms ({len(by_batch[k])})" for k in sorted(common)
            )
        )
        del model
    return rows
