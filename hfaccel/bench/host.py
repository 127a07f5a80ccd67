"""What a decode step costs on the host (`python -m hfaccel bench host`): the model is a tiny Llama (4
layers, hidden 64), so a step is almost all host work, the cost a GPU user pays on every step.

For each batch size B and context length C, side by side in one run:
- **HF eager step**: ``model(next_tokens[B, 1], past_key_values=DynamicCache)`` after a prefill of C
  tokens, with the argmax taken to the host (`bench/step.py`);
- **Engine.step**: one engine step while B sequences of C tokens decode, called directly;
- **model.generate**: the patched model's `generate` on B prompts of C tokens; a step is the wall time
  between the first and the last all-decode step over their count, so the loop's hand-offs between
  steps count too.

Each figure is the median of `steps` steps; the ratios are to HF's step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.bench.step import _KV_BYTES, engine_decode_step, hf_decode_step


def tiny_llama() -> Any:
    """A random Llama of 4 layers, hidden 64, 4 query and 2 KV heads, vocabulary 256 (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _median_ms(step: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def generate_step_ms(model: Any, batch_size: int, context: int, steps: int) -> float:
    """The wall time of one all-decode step of `model.generate` on `batch_size` prompts of `context`
    tokens (the loop's gaps between steps included), in ms."""
    import hfaccel

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (batch_size, context), generator=g)
    hfaccel.patch(
        model,
        max_num_seqs=batch_size,
        max_num_batched_tokens=max(2048, batch_size * context),
        enable_prefix_caching=False,
        kv_cache_memory=_KV_BYTES,
        progress=False,
    )
    try:
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        stats = [s for s in model._hfaccel.get_engine(model).step_stats if s.num_prefill_tokens == 0]
        stats = [s for s in stats if s.num_seqs == batch_size]
    finally:
        hfaccel.unpatch(model)
    span = stats[-1].start_s + stats[-1].duration_s - stats[0].start_s
    return span / len(stats) * 1e3


def run_host_benchmark(
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128),
    contexts: tuple[int, ...] = (128, 1024),
    steps: int = 24,
) -> list[dict[str, float]]:
    """Print and return one row per (batch, context): the three systems' step times and ratios."""
    model = tiny_llama()
    print(f"== host cost of a decode step: tiny Llama (4 layers, hidden 64), {cpu_description()}")
    print(
        f"{'batch':>6} {'context':>8} {'HF step':>9} {'Engine.step':>12} {'generate':>9} {'gen/HF':>7} {'step/HF':>8}"
    )
    rows = []
    for context in contexts:
        for batch_size in batch_sizes:
            hf = _median_ms(hf_decode_step(model, batch_size, context), steps)
            direct_step, _ = engine_decode_step(model, batch_size, context, steps, compile="off")
            direct = _median_ms(direct_step, steps)
            through = generate_step_ms(model, batch_size, context, steps)
            row = {
                "batch": batch_size,
                "context": context,
                "hf_ms": hf,
                "step_ms": direct,
                "generate_ms": through,
            }
            rows.append(row)
            print(
                f"{batch_size:>6} {context:>8} {hf:>8.2f}ms {direct:>10.2f}ms {through:>7.2f}ms "
                f"{through / hf:>6.2f}x {direct / hf:>7.2f}x",
                flush=True,
            )
    return rows
