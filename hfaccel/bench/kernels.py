"""Attention-kernel timings: each backend that really runs on this device, on the same paged cases.

Two figures per case: the step's metadata build (host work once per step, FlashInfer's ``plan``
included; a decode case is built as its CUDA-graph bucket, as the engine does) and one layer's call.
Interpreter timings are not speed: a backend that can only run under the Triton interpreter here is
listed as skipped, never timed.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.kernels import StepLayout, get_backend, unavailable_reason
from hfaccel.kernels.selection import triton_interpreting

# SmolLM2-135M's attention geometry: 9 query heads, 3 KV heads, head_dim 64.
HQ, HKV, D, BLOCK = 9, 3, 64, 16
_rng = random.Random(0)
# (tokens cached before the step, tokens this step) per sequence
CASES = {
    "decode b=32 ctx=512": [(511, 1)] * 32,
    "decode b=8 ctx=2048": [(2047, 1)] * 8,
    "decode b=64 ctx=50-500": [(_rng.randint(50, 500), 1) for _ in range(64)],
    "decode b=64 ctx=1.5k-3k": [(_rng.randint(1500, 3000), 1) for _ in range(64)],
    "prefill 2048 tokens": [(0, 2048)],
    "chunk 512 after 1536 cached": [(1536, 512)],
}
MAX_SEQS, MAX_TOKENS, MAX_BLOCKS = 64, 4096, 256


def _case(backend, seqs, dtype, device) -> tuple[Callable[[], object], Callable[[object], object]]:
    """``(build, call)``: build the step's metadata; run one layer's attention on it."""
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
    builder = backend.make_builder(MAX_SEQS, MAX_TOKENS, MAX_BLOCKS, BLOCK, device, num_blocks=total_blocks)
    # A pure-decode step is built as the engine builds it for a captured bucket (its own batch size).
    bucket = len(seqs) if all(n == 1 for _, n in seqs) and device.type == "cuda" else None
    if hasattr(builder, "configure"):
        builder.configure(HQ, HKV, D, dtype, D**-0.5, cuda_graph_batch_sizes=(bucket,) if bucket else ())
    t = len(slots)
    qkv = [torch.randn(t, h, D, dtype=dtype, device=device) for h in (HQ, HKV, HKV)]
    return lambda: builder.build(layout, bucket, bucket), lambda meta: backend.forward(
        *qkv, cache, meta, D**-0.5
    )


def _median_ms(run: Callable[[], object], repeats: int, cuda: bool) -> float:
    """The median wall time of `run`, synchronized on both sides on CUDA (launch costs in it)."""
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_kernel_benchmark(
    dtype: torch.dtype = torch.float32, repeats: int = 20
) -> dict[str, dict[str, float]]:
    """Median milliseconds per attention call (one layer) for every backend that runs natively here;
    the step's metadata build (once per step, not per layer) is printed beside it and returned under
    ``"<backend> build"``."""
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
        results[name], results[f"{name} build"] = {}, {}
        cuda = device.type == "cuda"
        for label, seqs in CASES.items():
            build, call = _case(backend, seqs, dtype, device)
            meta = build()
            call(meta)
            results[f"{name} build"][label] = _median_ms(build, repeats, cuda)
            meta = build()
            results[name][label] = _median_ms(functools.partial(call, meta), repeats, cuda)
            print(
                f"  {name:<10} {label:<28} call {results[name][label]:8.2f} ms"
                f"   step build {results[f'{name} build'][label]:6.2f} ms"
            )
    return results
