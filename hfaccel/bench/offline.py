"""Offline-throughput benchmark: the same chat workload through every system, one run, ratios."""

from __future__ import annotations

import json
import platform
from typing import Any

import torch

from hfaccel.bench.systems import SystemResult, run_hf_generate_batch, run_hf_static, run_hfaccel
from hfaccel.bench.workloads import Workload, chat_workload

SYSTEMS = ("hf_static", "hf_generate_batch", "hfaccel")


def run_offline_benchmark(
    model: Any,
    tokenizer: Any,
    num_requests: int = 32,
    min_len: int = 8,
    max_len: int = 256,
    static_batch_size: int = 8,
    systems: tuple[str, ...] = SYSTEMS,
    json_path: str | None = None,
) -> list[SystemResult]:
    """Run the workload through `systems`, print a table with ratios, optionally save JSON."""
    torch.manual_seed(0)
    dtype = next(model.parameters()).dtype
    workload = chat_workload(tokenizer, num_requests, min_len, max_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    warmup = Workload("warmup", workload.prompts[:2], [4, 4])
    runners = {
        "hf_static": lambda w: run_hf_static(model, w, static_batch_size, pad_id),
        "hf_generate_batch": lambda w: run_hf_generate_batch(model, w),
        "hfaccel": lambda w: run_hfaccel(model, w),
    }
    print(
        f"workload: {workload.name}, {workload.total_output_tokens} output tokens, dtype={dtype}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    results = []
    for name in systems:
        runners[name](warmup)
        result = runners[name](workload)
        print(f"  done: {result.system}: {result.seconds:.1f} s")
        results.append(result)
    print_table(results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([_as_dict(r) for r in results], f, indent=2)
    return results


def print_table(results: list[SystemResult]) -> None:
    """Tokens/s of each system and the ratio of the last one (hfaccel) to each."""
    ours = results[-1]
    reference = results[0].outputs
    print(f"\n{'system':<40} {'seconds':>8} {'out tok/s':>10} {'hfaccel x':>10} {'= HF static':>12}")
    for r in results:
        same = sum(a == b for a, b in zip(r.outputs, reference))
        print(
            f"{r.system:<40} {r.seconds:>8.1f} {r.tokens_per_s:>10.1f} "
            f"{ours.tokens_per_s / r.tokens_per_s:>9.2f}x {same:>5}/{len(reference)}"
        )


def _as_dict(result: SystemResult) -> dict[str, Any]:
    return {
        "system": result.system,
        "seconds": result.seconds,
        "output_tokens": result.output_tokens,
        "tokens_per_s": result.tokens_per_s,
        **result.extra,
    }
