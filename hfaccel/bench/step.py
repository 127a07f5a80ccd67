"""Decode-step benchmark: one engine decode step vs HF's own eager decode step vs the matmul floor.

For each batch size B, side by side in one run:
- **hfaccel**: an engine holding B sequences that all decode; the time of one `Engine.step()`
  (scheduling, packing, the forward, sampling: everything a step costs), eager and compiled;
- **HF eager step**: ``model(next_tokens[B, 1], past_key_values=DynamicCache)`` after a prefill of
  the same prompt length, with the argmax of the logits (HF's own decode loop, minus its bookkeeping);
- **matmul floor**: the model's Linear layers alone at B rows (the LM head included), the same
  sequence of matmuls a decode step runs. ``floor / actual`` is how close a step gets to the
  hardware's matmul speed: the hardware-neutral measure of the engine.

Every system is built and warmed up first; then the rounds interleave them (one step of each system
per round, in an order that rotates), so a machine whose load changes during the run slows them all
alike. Each row reports the median step time and the median of the per-round ``floor / step`` ratios
with their interquartile range (the spread).

`run_end_to_end` times whole runs (8 requests, 128 new tokens each) with ``compile="decode"`` against
``compile="off"``, alternated, and checks the greedy outputs are identical. `run_start_benchmark`
times the compile warm-up of a fresh process with an empty inductor cache (cold) and of a second
process reusing that cache (warm).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description

# Enough KV cache for the largest batch of the step table, and no more: a shared machine runs several
# engines side by side here.
_KV_BYTES = 512 * 1024 * 1024


@dataclass
class StepTiming:
    """One system at one batch size: median seconds per step and the floor/step ratio's quartiles."""

    batch_size: int
    system: str
    seconds: float
    floor_ratio: float = 1.0
    ratio_q1: float = 1.0
    ratio_q3: float = 1.0


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def matmul_floor(model: Any, batch_size: int, head_rows: int | None = None) -> Callable[[], None]:
    """A function that applies every Linear of `model` once to ``[batch_size, in_features]`` (the LM head
    to ``[head_rows, in_features]`` where given: a step's head sees only its sampled rows)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    param = next(model.parameters())
    inputs = [
        torch.randn(
            head_rows if head_rows is not None and m is head else batch_size,
            m.in_features,
            dtype=param.dtype,
            device=param.device,
        )
        for m in linears
    ]

    @torch.inference_mode()
    def run() -> None:
        for module, x in zip(linears, inputs):
            module(x)

    run()
    return run


def hf_decode_step(model: Any, batch_size: int, prompt_len: int) -> Callable[[], None]:
    """A function that runs one HF eager decode step with a DynamicCache (prefilled with `prompt_len`
    tokens) and takes the argmax of the logits to the host, as HF's decode loop does."""
    from transformers import DynamicCache

    from hfaccel.patches.arguments import CACHE_NAME

    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch_size, prompt_len), generator=g).to(next(model.parameters()).device)
    state = {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, use_cache=True, **{CACHE_NAME: cache})
        state["tokens"] = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step() -> None:
        out = model(input_ids=state["tokens"], use_cache=True, **{CACHE_NAME: cache})
        state["tokens"] = out.logits[:, -1].argmax(-1, keepdim=True)
        state["tokens"].tolist()  # the host needs the tokens every step, as generate does

    step()
    step()
    return step


def engine_decode_step(
    model: Any, batch_size: int, prompt_len: int, steps: int, compile_dynamic: bool = True, **config: Any
) -> tuple[Callable[[], None], float]:
    """A function that runs one `Engine.step()` while `batch_size` sequences of `prompt_len` tokens
    decode (good for `steps` calls), and the warm-up seconds (compiling, when ``compile`` is given)."""
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
            **{"kv_cache_memory": _KV_BYTES, **config},
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
    return engine.step, warmup


def interleave(systems: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each system's call in each round; the order of the systems rotates every round."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            systems[name]()
            times[name].append(time.perf_counter() - start)
    return times


def run_step_benchmark(
    model: Any,
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    prompt_len: int = 128,
    steps: int = 15,
    compiled: bool = True,
    per_bucket: bool = False,
    bf16_kv: bool = False,
) -> list[StepTiming]:
    """Time every system at each batch size, interleaved; print a table with ratios to the floor (median
    and interquartile range over the rounds) and the CPU ISA.

    `bf16_kv` adds the compiled step of a float32 model over a bfloat16 KV cache (``EngineConfig(dtype=
    "bfloat16")``): half the KV bytes a decode step reads, the part of a step the floor does not have.
    It computes in float32 but stores K/V rounded to bf16, so its tokens may differ from float32's."""
    dtype = next(model.parameters()).dtype
    print(
        f"\n== decode step: {cpu_description()}, dtype={str(dtype).removeprefix('torch.')}, "
        f"prompt {prompt_len} tokens, {steps} interleaved rounds (median; floor/step: median [IQR]) =="
    )
    print(f"{'batch':>5} | {'system':<34} | {'ms/step':>8} | {'floor/step':>18} | {'vs HF':>6} | warm-up s")
    results = []
    for batch in batch_sizes:
        systems: dict[str, Callable[[], None]] = {"matmul floor": matmul_floor(model, batch)}
        warmups = {"matmul floor": 0.0, "HF eager step": 0.0}
        systems["HF eager step"] = hf_decode_step(model, batch, prompt_len)
        systems["hfaccel eager"], warmups["hfaccel eager"] = engine_decode_step(
            model, batch, prompt_len, steps
        )
        if compiled:
            name = "hfaccel compiled (dynamic tokens)"
            systems[name], warmups[name] = engine_decode_step(
                model, batch, prompt_len, steps, compile="decode"
            )
            if per_bucket:
                name = "hfaccel compiled (per bucket)"
                systems[name], warmups[name] = engine_decode_step(
                    model, batch, prompt_len, steps, compile_dynamic=False, compile="decode"
                )
            if bf16_kv and dtype != torch.bfloat16:
                name = "hfaccel compiled, bf16 KV cache"
                systems[name], warmups[name] = engine_decode_step(
                    model, batch, prompt_len, steps, compile="decode", dtype="bfloat16"
                )
        times = interleave(systems, steps)
        floor = times["matmul floor"]
        hf = statistics.median(times["HF eager step"])
        for name, seconds in times.items():
            q1, ratio, q3 = _quartiles([f / s for f, s in zip(floor, seconds)])
            median = statistics.median(seconds)
            results.append(StepTiming(batch, name, median, ratio, q1, q3))
            spread = f"{ratio:>4.0%} [{q1:.0%}-{q3:.0%}]"
            versus = "" if name == "matmul floor" else f"{hf / median:>5.2f}x"
            print(
                f"{batch:>5} | {name:<34} | {median * 1e3:>8.1f} | {spread:>18} | {versus:>6} | "
                f"{warmups[name]:.1f}"
            )
        del systems
    return results


def _prompts(tokenizer_vocab: int, num_requests: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [32 + (i * 131) % 160 for i in range(num_requests)]  # 32..191 tokens, all different
    return [torch.randint(3, tokenizer_vocab, (n,), generator=g).tolist() for n in lengths]


def run_end_to_end(
    model: Any, num_requests: int = 8, new_tokens: int = 128, repeats: int = 3
) -> dict[str, Any]:
    """Wall time of `num_requests` greedy requests of `new_tokens` tokens each (prompts of 32-191
    tokens, admitted together) with ``compile="decode"`` vs ``compile="off"``: each engine is built and
    warmed up once, then the runs alternate; prints the medians, the per-pair speed-ups and whether
    the tokens are identical."""
    from hfaccel.config import EngineConfig
    from hfaccel.engine.engine import Engine
    from hfaccel.engine.request import StoppingParams

    vocab = model.get_input_embeddings().num_embeddings
    prompts = _prompts(vocab, num_requests)
    stopping = StoppingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    engines, warmups = {}, {}
    for mode in ("off", "decode"):
        engines[mode] = Engine(
            model,
            EngineConfig(
                max_num_seqs=num_requests,
                compile=mode,
                kv_cache_memory=_KV_BYTES,
                enable_prefix_caching=False,
            ),
        )
        warmups[mode] = engines[mode].warmup(progress=False)

    def run(mode: str) -> tuple[float, list[list[int]]]:
        engine = engines[mode]
        start = time.perf_counter()
        requests = [engine.add_request(p, stopping) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start, [r.output_token_ids for r in requests]

    walls: dict[str, list[float]] = {"off": [], "decode": []}
    outputs = {}
    for r in range(repeats):
        for mode in ("off", "decode") if r % 2 == 0 else ("decode", "off"):
            seconds, outputs[mode] = run(mode)
            walls[mode].append(seconds)
    speedups = [off / dec for off, dec in zip(walls["off"], walls["decode"])]
    same = outputs["off"] == outputs["decode"]
    tokens = num_requests * new_tokens
    print(
        f"\n== end to end: {cpu_description()}, dtype={str(next(model.parameters()).dtype).removeprefix('torch.')}"
        f", {num_requests} requests x {new_tokens} new tokens (prompts 32-191), {repeats} alternated runs =="
    )
    print(f"{'compile':<8} | {'wall s (median)':>15} | {'tok/s':>7} | {'runs s':<24} | warm-up s")
    for mode in ("off", "decode"):
        median = statistics.median(walls[mode])
        runs = ", ".join(f"{w:.1f}" for w in walls[mode])
        print(f"{mode:<8} | {median:>15.2f} | {tokens / median:>7.1f} | {runs:<24} | {warmups[mode]:.1f}")
    print(
        f"compiled / eager speed-up: median {statistics.median(speedups):.2f}x "
        f"(runs: {', '.join(f'{s:.2f}x' for s in speedups)}); greedy tokens identical: {same}"
    )
    return {"walls": walls, "speedups": speedups, "identical": same, "warmups": warmups}


_START_SCRIPT = """
import json, time, torch
start = time.perf_counter()
from hfaccel.config import EngineConfig
from hfaccel.default_model import load_default_model
from hfaccel.engine.engine import Engine
model, _ = load_default_model(torch.float32)
loaded = time.perf_counter()
engine = Engine(model, EngineConfig(max_num_seqs=32, compile="decode", cuda_graph_sizes=BUCKETS,
                                    kv_cache_memory=256 * 1024 * 1024))
warmup = engine.warmup(progress=False)
print(json.dumps({"load_s": loaded - start, "warmup_s": warmup, "total_s": time.perf_counter() - start}))
"""


def run_start_benchmark(buckets: tuple[int, ...] = (1, 8, 32)) -> list[dict[str, float]]:
    """Cold vs warm start of ``compile="decode"`` on SmolLM2: two fresh processes in a row sharing one
    new, empty inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``); each builds an engine with decode
    buckets `buckets` and compiles them all (`Engine.warmup`)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="hfaccel-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        script = _START_SCRIPT.replace("BUCKETS", repr(tuple(buckets)))
        for _ in ("cold", "warm"):
            done = subprocess.run(
                [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
            )
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"\n== compile start: {cpu_description()}, SmolLM2 float32, compile='decode', buckets {tuple(buckets)}, "
        "a fresh process each, one new inductor cache directory =="
    )
    print(f"{'start':<5} | {'model load s':>12} | {'compile warm-up s':>17} | {'process total s':>15}")
    for name, r in zip(("cold", "warm"), results):
        print(f"{name:<5} | {r['load_s']:>12.1f} | {r['warmup_s']:>17.1f} | {r['total_s']:>15.1f}")
    return results
