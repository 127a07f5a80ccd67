"""Quantized weights side by side with llama.cpp (`python -m hfaccel bench --suite quant`).

The embedded SmolLM2 ships as a Q4_1 GGUF, so llama.cpp (through ``llama-cpp-python``, optional) runs
the very weights that transformers dequantizes to float32. In one run, on the same chat prompts:

- **single stream**: 4 chat prompts x `new_tokens` tokens, one after another (EOS suppressed so every
  system writes the same count), output tokens/s, for hfaccel with float32, bfloat16, int8 and int4
  weights (``patch(weights=...)``), eager and with ``compile="decode"`` (its cold compile untimed and
  reported), HF ``generate`` on the same models, and llama.cpp Q4_1;
- **32 streams**: 32 chat prompts at once through hfaccel (eager), against llama.cpp's single stream;
- **quality**: greedy agreement with float32 (the share of each prompt's tokens before the first
  difference) and perplexity on a fixed text (`bench/quant_text.py`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.bench.quant_text import PERPLEXITY_TEXT
from hfaccel.bench.workloads import chat_workload

WEIGHTS = ("float32", "bfloat16", "int8", "int4")


def _load(weights: str) -> tuple[Any, Any]:
    from hfaccel.default_model import load_default_model
    from hfaccel.patches.weights import apply_weights

    model, tokenizer = load_default_model(torch.float32)
    apply_weights(model, None if weights == "float32" else weights)
    return model, tokenizer


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The mean share of each output's tokens before its first difference from the reference."""
    shares = []
    for out, ref in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        shares.append(same / max(len(ref), 1))
    return sum(shares) / len(shares)


@torch.no_grad()
def torch_perplexity(model: Any, ids: list[int]) -> float:
    """exp of the mean next-token loss of `model` over `ids` (one forward, the model's own modules)."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())


@torch.no_grad()
def engine_perplexity(model: Any, ids: list[int], kv_dtype: str = "auto", chunk: int = 64) -> float:
    """exp of the mean next-token loss over `ids` as the engine computes it: `ids` fed as one sequence
    in prompt chunks of `chunk` tokens, each attending over the paged KV cache (of `kv_dtype`) that the
    earlier chunks wrote, every position's logits kept. A KV cache's precision shows here, where
    `torch_perplexity` (the model's own forward, no cache) cannot see it."""
    from hfaccel.config import EngineConfig
    from hfaccel.engine.batch import PackedStep
    from hfaccel.engine.engine import Engine
    from hfaccel.kernels.metadata import StepLayout

    engine = Engine(model, EngineConfig(dtype=kv_dtype, enable_prefix_caching=False, max_model_len=len(ids)))
    block_size = engine.config.block_size
    # A fresh engine with nothing admitted: the sequence takes blocks 0, 1, ... (slot = position).
    table = list(range(-(-len(ids) // block_size)))
    losses = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        positions = list(range(start, end))
        layout = StepLayout([end - start], [end], [table], positions, 0)
        step = PackedStep(ids[start:end], positions, list(range(end - start)), [], layout)
        logits = engine.runner.run(step).float()
        target = torch.tensor(ids[start + 1 : end + 1], device=logits.device)
        losses.append(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
    return math.exp(torch.stack(losses).sum().item() / (len(ids) - 1))


def _one_by_one(generate: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = [generate(prompt, new_tokens) for prompt in prompts]
    seconds = time.perf_counter() - start
    return sum(map(len, outputs)) / seconds, outputs


def _hf_generate(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def _llama_cpp(gguf: str, eos: int) -> Any:
    """llama.cpp on the GGUF, as a (generate, perplexity) pair; None if llama-cpp-python is missing."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None

    def load(logits_all: bool) -> Any:  # every position's logits only where perplexity needs them
        return Llama(
            model_path=gguf,
            n_ctx=2048,
            n_threads=torch.get_num_threads(),
            logits_all=logits_all,
            verbose=False,
        )

    llm = load(False)

    def generate(prompt: list[int], new_tokens: int) -> list[int]:
        llm.reset()
        out = []
        for token in llm.generate(
            prompt,
            temp=0.0,
            top_k=1,
            repeat_penalty=1.0,
            reset=True,
            logits_processor=[lambda _ids, scores: _no_eos(scores, eos)],
        ):
            out.append(int(token))
            if len(out) == new_tokens:
                break
        return out

    def perplexity(ids: list[int]) -> float:
        import numpy as np

        scorer = load(True)
        scorer.eval(ids)
        scores = torch.from_numpy(np.asarray(scorer.scores[: len(ids) - 1], dtype=np.float32))
        return math.exp(torch.nn.functional.cross_entropy(scores, torch.tensor(ids[1:])).item())

    return generate, perplexity


def _no_eos(scores: Any, eos: int) -> Any:
    scores[eos] = -float("inf")
    return scores


def _hfaccel_row(weights: str, compile: str, new_tokens: int, streams: int) -> dict[str, Any]:
    """One system's figures: HF generate and hfaccel on one loaded model (see the module doc)."""
    import hfaccel

    model, tokenizer = _load(weights)
    prompts = chat_workload(tokenizer, num_requests=4).prompts
    row: dict[str, Any] = {"system": f"hfaccel {weights}" + (" compiled" if compile != "off" else "")}
    row["perplexity"] = torch_perplexity(model, tokenizer(PERPLEXITY_TEXT)["input_ids"])
    if compile == "off":
        row["hf_single"], row["hf_out"] = _one_by_one(
            lambda p, n: _hf_generate(model, p, n), prompts, new_tokens
        )
    hfaccel.patch(model, compile=compile, progress=False)
    try:
        if compile != "off":  # the cold compile of the one-sequence decode step, not timed
            start = time.perf_counter()
            _hf_generate(model, prompts[0], 4)
            row["compile_s"] = time.perf_counter() - start
        row["single"], row["out"] = _one_by_one(lambda p, n: _hf_generate(model, p, n), prompts, new_tokens)
        if compile == "off":
            many = chat_workload(tokenizer, num_requests=streams).prompts
            start = time.perf_counter()
            results = hfaccel.generate(
                model, many, max_new_tokens=new_tokens, min_new_tokens=new_tokens, progress=False
            )
            row["streams"] = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    finally:
        hfaccel.unpatch(model)
    return row


def run_quant_benchmark(new_tokens: int = 128, streams: int = 32) -> list[dict[str, Any]]:
    """Print and return one row per system (see the module doc)."""
    import glob

    from hfaccel.default_model import default_model_folder

    print(f"== quantized weights vs llama.cpp: SmolLM2-135M, {cpu_description()}")
    print(f"single stream: 4 chat prompts x {new_tokens} tokens one after another; {streams} streams at once")
    systems = [(w, "off") for w in WEIGHTS] + [("int8", "decode"), ("int4", "decode")]
    rows: list[dict[str, Any]] = []
    for weights, compile in systems:
        row = _hfaccel_row(weights, compile, new_tokens, streams)
        rows.append(row)
        reference = rows[0]["out"]
        row["agreement"] = _agreement(row["out"], reference)
        hf = f" (HF generate {row['hf_single']:6.1f})" if "hf_single" in row else ""
        many = f", {row['streams']:6.1f} tok/s x{streams}" if "streams" in row else ""
        cold = f", cold compile {row['compile_s']:.0f} s" if "compile_s" in row else ""
        print(
            f"{row['system']:>24}: {row['single']:6.1f} tok/s single{hf}{many}, agreement with float32 "
            f"{row['agreement']:.2f}, perplexity {row['perplexity']:.3f}{cold}",
            flush=True,
        )
    _, tokenizer = _load("float32")
    gguf = glob.glob(f"{default_model_folder()}/*.gguf")[0]
    llama = _llama_cpp(gguf, tokenizer.eos_token_id)
    if llama is None:
        print("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python): column skipped")
    else:
        generate, perplexity = llama
        prompts = chat_workload(tokenizer, num_requests=4).prompts
        rate, out = _one_by_one(generate, prompts, new_tokens)
        row = {"system": "llama.cpp Q4_1", "single": rate, "agreement": _agreement(out, rows[0]["out"])}
        row["perplexity"] = perplexity(tokenizer(PERPLEXITY_TEXT)["input_ids"])
        rows.append(row)
        print(
            f"{row['system']:>24}: {rate:6.1f} tok/s single, agreement with float32 {row['agreement']:.2f}, "
            f"perplexity {row['perplexity']:.3f}"
        )
    _print_ratios(rows, streams)
    return rows


def _print_ratios(rows: list[dict[str, Any]], streams: int) -> None:
    by = {row["system"]: row for row in rows}
    f32 = by["hfaccel float32"]
    for name in (
        "hfaccel bfloat16",
        "hfaccel int8",
        "hfaccel int4",
        "hfaccel int8 compiled",
        "hfaccel int4 compiled",
    ):
        print(
            f"{name} single stream / hfaccel float32: {by[name]['single'] / f32['single']:.2f}x; "
            f"perplexity {100 * (by[name]['perplexity'] / f32['perplexity'] - 1):+.2f}% vs float32"
        )
    llama = by.get("llama.cpp Q4_1")
    if llama:
        for name in ("hfaccel int4", "hfaccel int4 compiled"):
            print(f"{name} single stream / llama.cpp Q4_1: {by[name]['single'] / llama['single']:.2f}x")
        best = max((row for row in rows if "streams" in row), key=lambda row: row["streams"])
        print(
            f"{best['system']} x{streams} streams / llama.cpp single stream: "
            f"{best['streams'] / llama['single']:.2f}x"
        )
