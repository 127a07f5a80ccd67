"""Attention-kernel timings: each backend that really runs on this device, on the same paged cases.

Interpreter timings are not speed: a backend that can only run under the Triton interpreter here is
listed as skipped, never timed.
"""

from __future__ import annotations

import statistics
import time

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.kernels import StepLayout, get_backend, unavailable_reason
from hfaccel.kernels.selection import triton_interpreting

# SmolLM2-135M's attention geometry: 9 query heads, 3 KV heads, head_dim 64.
HQ, HKV, D, BLOCK = 9, 3, 64, 16
CASES = {
    "decode b=32 ctx=512": [(511, 1)] * 32,
    "decode b=8 ctx=2048": [(2047, 1)] * 8,
    "prefill 2048 tokens": [(0, 2048)],
    "chunk 512 after 1536 cached": [(1536, 512)],
}


def _case(backend, seqs, dtype, device):
    total_blocks = sum(-(-(b + n) // BLOCK) for b, n in seqs)
    perm = torch.randperm(total_blocks).tolist()
    tables, slots = [], []
    for before, new in seqs:
        blocks = [perm.pop() for _ in range(-(-(before + new) // BLOCK))]
        tables.append(blocks)
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(before, before + new)]
    qlens = [n for _, n in seqs]
    layout = StepLayout(qlens, [b + n for b, n in seqs], tables, slots, sum(1 for q in qlens if q == 1))
    shape = backend.kv_cache_shape(total_blocks, BLOCK, HKV, D)
    cache = (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))
    builder = backend.make_builder(64, 4096, 256, BLOCK, device, num_blocks=total_blocks)
    if hasattr(builder, "configure"):
        builder.configure(HQ, HKV, D, dtype, D**-0.5)
    meta = builder.build(layout)
    t = len(slots)
    qkv = [torch.randn(t, h, D, dtype=dtype, device=device) for h in (HQ, HKV, HKV)]
    return lambda: backend.forward(*qkv, cache, meta, D**-0.5)


def run_kernel_benchmark(
    dtype: torch.dtype = torch.float32, repeats: int = 20
) -> dict[str, dict[str, float]]:
    """Median milliseconds per attention call (one layer) for every backend that runs natively here."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"\n== attention kernels (one layer, SmolLM2 geometry): {cpu_description()}, "
        f"dtype={str(dtype).removeprefix('torch.')} =="
    )
    results: dict[str, dict[str, float]] = {}
    for name in ("torch", "triton", "flashinfer"):
        reason = unavailable_reason(name, device, dtype, D)
        if reason is None and name == "triton" and device.type == "cpu" and triton_interpreting():
            reason = "runs only under the interpreter here: not timed (not a speed)"
        if reason is not None:
            print(f"  {name}: skipped ({reason})")
            continue
        backend = get_backend(name, device, dtype, D)
        results[name] = {}
        for label, seqs in CASES.items():
            call = _case(backend, seqs, dtype, device)
            call()
            times = []
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            results[name][label] = statistics.median(times) * 1e3
            print(f"  {name:<10} {label:<28} {results[name][label]:8.2f} ms")
    return results
