"""Decode-step benchmark: one engine decode step vs HF's own eager decode step vs the matmul floor.

For each batch size B, side by side in one run:
- **hfaccel**: an engine holding B sequences that all decode; the median time of `Engine.step()`
  (scheduling, packing, the forward, sampling: everything a step costs);
- **HF eager step**: ``model(next_tokens[B, 1], past_key_values=DynamicCache)`` after a prefill of
  the same prompt length, with the argmax of the logits (HF's own decode loop, minus its bookkeeping);
- **matmul floor**: the model's Linear layers alone at B rows (the LM head included), the same
  sequence of matmuls a decode step runs, timed in the same run. ``floor / actual`` is how close a step
  gets to the hardware's matmul speed: the hardware-neutral measure of the engine.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description


@dataclass
class StepTiming:
    """Median seconds per decode step at one batch size."""

    batch_size: int
    system: str
    seconds: float


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_floor(model: Any, batch_size: int, repeats: int = 10) -> float:
    """Median seconds for every Linear of `model` applied once to ``[batch_size, in_features]``."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    param = next(model.parameters())
    inputs = [torch.randn(batch_size, m.in_features, dtype=param.dtype, device=param.device) for m in linears]

    @torch.inference_mode()
    def run() -> None:
        for module, x in zip(linears, inputs):
            module(x)

    run()
    return _median_time(run, repeats)


def hf_decode_step(model: Any, batch_size: int, prompt_len: int, steps: int) -> float:
    """Median seconds of HF's eager decode step with a DynamicCache at `batch_size` x `prompt_len`."""
    from transformers import DynamicCache

    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch_size, prompt_len), generator=g).to(next(model.parameters()).device)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.tolist()  # the host needs the tokens every step, as generate does
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def engine_decode_step(
    model: Any, batch_size: int, prompt_len: int, steps: int, compile_dynamic: bool = True, **config: Any
) -> tuple[float, float]:
    """Median seconds of `Engine.step()` while `batch_size` sequences of `prompt_len` tokens decode, and
    the warm-up seconds (compiling, when ``compile`` is given in `config`)."""
    from hfaccel.config import EngineConfig
    from hfaccel.engine.engine import Engine
    from hfaccel.engine.request import StoppingParams

    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    new = steps + 4
    engine = Engine(
        model,
        EngineConfig(
            max_num_seqs=batch_size,
            max_num_batched_tokens=max(2048, batch_size * prompt_len),
            enable_prefix_caching=False,
            cuda_graph_sizes=(batch_size,),
            **config,
        ),
    )
    engine.runner.compile_dynamic = compile_dynamic
    warmup = engine.warmup(progress=False)
    stopping = StoppingParams(max_new_tokens=new, min_new_tokens=new)
    for _ in range(batch_size):
        engine.add_request(torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), stopping)
    while any(r.num_uncomputed_tokens > 1 for r in engine.scheduler.requests()):
        engine.step()
    engine.step()
    engine.step()  # warm-up decodes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times), warmup


def run_step_benchmark(
    model: Any,
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    prompt_len: int = 128,
    steps: int = 10,
    compiled: bool = True,
) -> list[StepTiming]:
    """Time every system at each batch size; print a table with ratios to the floor and the CPU ISA."""
    dtype = next(model.parameters()).dtype
    print(
        f"\n== decode step: {cpu_description()}, dtype={str(dtype).removeprefix('torch.')}, "
        f"prompt {prompt_len} tokens, median of {steps} steps =="
    )
    systems = ["HF eager step", "hfaccel eager"]
    if compiled:
        systems += ["hfaccel compiled (dynamic tokens)", "hfaccel compiled (per bucket)"]
    print(f"{'batch':>5} | {'system':<34} | {'ms/step':>8} | {'floor/step':>10} | {'vs HF':>6} | warm-up s")
    results = []
    for batch in batch_sizes:
        floor = matmul_floor(model, batch)
        timings = {"HF eager step": (hf_decode_step(model, batch, prompt_len, steps), 0.0)}
        timings["hfaccel eager"] = engine_decode_step(model, batch, prompt_len, steps)
        if compiled:
            timings["hfaccel compiled (dynamic tokens)"] = engine_decode_step(
                model, batch, prompt_len, steps, compile="decode"
            )
            timings["hfaccel compiled (per bucket)"] = engine_decode_step(
                model, batch, prompt_len, steps, compile_dynamic=False, compile="decode"
            )
        hf = timings["HF eager step"][0]
        print(f"{batch:>5} | {'matmul floor':<34} | {floor * 1e3:>8.1f} | {'100%':>10} | {'':>6} |")
        results.append(StepTiming(batch, "matmul floor", floor))
        for name in systems:
            seconds, warm = timings[name]
            results.append(StepTiming(batch, name, seconds))
            print(
                f"{batch:>5} | {name:<34} | {seconds * 1e3:>8.1f} | {floor / seconds:>9.0%} | "
                f"{hf / seconds:>5.2f}x | {warm:.1f}"
            )
    return results
