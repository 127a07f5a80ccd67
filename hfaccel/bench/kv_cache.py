"""KV-cache dtypes side by side (`python -m hfaccel bench kvcache`): float32, bfloat16 and int8 caches
of SmolLM2 float32, on long contexts where the cache is what limits a CPU.

In one run, for each cache dtype:

- **plenty of memory**: 32 requests of about 450 prompt tokens (the perplexity text rotated, so no two
  share a prefix block) x 64 new tokens at once: output tokens/s, and the median decode step of 32
  sequences (each step reads every sequence's whole cache);
- **a fixed KV budget**: the same requests under the memory a float32 cache needs for 8 of them, which
  is what a user with a given amount of memory feels: how many sequences run at once, preemptions, and
  output tokens/s;
- **quality**: greedy agreement with the float32 cache (each request's share of tokens before its first
  difference) and perplexity through the engine (`engine_perplexity`: the text fed in chunks over the
  paged cache, every position's logits), against the float32 cache's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.bench.quant import _agreement, engine_perplexity
from hfaccel.bench.quant_text import PERPLEXITY_TEXT

KV_DTYPES = ("float32", "bfloat16", "int8")


def _prompts(ids: list[int], count: int) -> list[list[int]]:
    """`count` rotations of `ids`, each starting 11 tokens later: the same length, no shared prefix."""
    return [ids[11 * i :] + ids[: 11 * i] for i in range(count)]


def _run(model: Any, prompts: list[list[int]], new_tokens: int, **config: Any) -> dict[str, Any]:
    import hfaccel

    hfaccel.patch(model, progress=False, **config)
    try:
        start = time.perf_counter()
        results = hfaccel.generate(
            model, prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, progress=False
        )
        seconds = time.perf_counter() - start
        engine = model._hfaccel.engine
        steps = list(engine.step_stats)
        full = [s.duration_s for s in steps if s.num_prefill_tokens == 0 and s.num_seqs == len(prompts)]
        return {
            "tok_s": sum(len(r.token_ids) for r in results) / seconds,
            "out": [list(r.token_ids) for r in results],
            "peak_seqs": max(s.num_seqs for s in steps),
            "preemptions": engine.stats()["preemptions"],
            "kv_blocks": engine.num_blocks,
            "step_ms": 1000 * statistics.median(full) if full else None,
        }
    finally:
        hfaccel.unpatch(model)


def run_kv_cache_benchmark(requests: int = 32, new_tokens: int = 64, budget_requests: int = 8) -> list[dict]:
    """Print and return one row per KV-cache dtype (see the module doc)."""
    from hfaccel.default_model import load_default_model
    from hfaccel.patches.models import kv_bytes_per_token

    model, tokenizer = load_default_model(torch.float32)
    ids = tokenizer(PERPLEXITY_TEXT)["input_ids"]
    prompts = _prompts(ids, requests)
    context = len(ids) + new_tokens + 16  # a request's longest sequence, rounded up to a block
    budget = budget_requests * context * kv_bytes_per_token(model, torch.float32)
    print(f"== KV cache dtypes: SmolLM2-135M float32, {cpu_description()}")
    print(
        f"{requests} requests x {len(ids)} prompt tokens x {new_tokens} new; fixed budget: "
        f"{budget / 2**20:.0f} MiB (a float32 cache's for {budget_requests} of them)"
    )
    rows = []
    for name in KV_DTYPES:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[name]
        row: dict[str, Any] = {"kv": name, "bytes_per_token": kv_bytes_per_token(model, dtype)}
        row["perplexity"] = engine_perplexity(model, ids, name)
        row["plenty"] = _run(
            model, prompts, new_tokens, dtype=name, max_num_seqs=requests, max_model_len=context
        )
        row["budget"] = _run(
            model, prompts, new_tokens, dtype=name, kv_cache_memory=budget, max_model_len=context
        )
        reference = rows[0] if rows else row
        row["agreement"] = _agreement(row["plenty"]["out"], reference["plenty"]["out"])
        rows.append(row)
        plenty, fixed = row["plenty"], row["budget"]
        step = f"{plenty['step_ms']:.0f} ms" if plenty["step_ms"] is not None else "n/a"
        print(
            f"{name:>9}: {row['bytes_per_token']:,} KV bytes/token | plenty: {plenty['tok_s']:6.1f} tok/s, "
            f"decode step x{requests} {step} | budget: {fixed['tok_s']:6.1f} tok/s, {fixed['kv_blocks']} blocks, "
            f"peak {fixed['peak_seqs']} seqs, {fixed['preemptions']} preemptions | agreement with float32 "
            f"{row['agreement']:.2f}, perplexity {row['perplexity']:.3f} "
            f"({100 * (row['perplexity'] / rows[0]['perplexity'] - 1):+.2f}%)",
            flush=True,
        )
    base = rows[0]
    for row in rows[1:]:
        print(
            f"{row['kv']} / float32: bytes {row['bytes_per_token'] / base['bytes_per_token']:.2f}x, "
            f"plenty {row['plenty']['tok_s'] / base['plenty']['tok_s']:.2f}x, "
            f"fixed budget {row['budget']['tok_s'] / base['budget']['tok_s']:.2f}x"
        )
    return rows
