"""What a decode step costs on the host (`python -m hfaccel bench host`): the model is a tiny Llama (4
layers, hidden 64), so a step is almost all host work, the cost a GPU user pays on every step.

For each batch size B and context length C, side by side in one run:
- **HF eager step**: ``model(next_tokens[B, 1], past_key_values=DynamicCache)`` after a prefill of C
  tokens, with the argmax taken to the host (`bench/step.py`);
- **Engine.step**: one engine step while B sequences of C tokens decode, called directly;
- **model.generate**: the patched model's `generate` on B prompts of C tokens; a step is the wall time
  between the first and the last all-decode step over their count, so the loop's hand-offs between
  steps count too;
- **HF generate**: a step of unpatched HF `generate` on the same prompts, its whole loop (forward,
  logits processors, stopping criteria, cache and mask updates): what a user of HF's `generate` pays a
  step (HF's bare steps leave that loop out);
- **HF steps in a row**: HF's eager step again, `steps` of them back to back from a fresh cache of C
  tokens (the contexts `model.generate`'s run sees), timed as `model.generate`'s step is (the run's wall
  time over its count), the two alternating round by round (`rounds`): timed like for like
  (`gen/row`). The single-step median above times each HF step right after an `Engine.step` (each evicts
  the other's code and data from the caches), while `model.generate`'s steps follow one another; issue
  #27's target (at most HF's step) is read on both.

Each single-step figure is the median of `steps` steps; a run's figure is the median of `rounds` runs;
the ratios are to HF's step. HF's step and `Engine.step` run interleaved, a round of each at a time, so a
machine whose load changes slows both alike.

On a machine with CUDA the model runs there in bfloat16 and the engine with its defaults (decode steps
compiled and replayed as CUDA graphs, one bucket: the batch size), HF eager with SDPA's best backend
(`_hf_sdpa`): the host cost a GPU user pays on every step, over contexts up to 4,096.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.bench.step import _KV_BYTES, engine_decode_step, hf_decode_step, interleave


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


def _hf_sdpa(device: str) -> Any:
    """HF's step at its best on CUDA: SDPA without the cuDNN backend, which torch 2.11 picks for bf16 and
    which built a plan for every new context length there (38 ms a step on an H200, 2026-11-26)."""
    from contextlib import nullcontext

    if device == "cpu":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _kv_bytes(model: Any, batch_size: int, context: int, steps: int) -> int:
    """A KV budget for `batch_size` sequences of `context` + `steps` tokens, with room to spare."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    return max(_KV_BYTES, 2 * batch_size * (context + steps + 64) * per_token)


def generate_step_ms(model: Any, batch_size: int, context: int, steps: int) -> float:
    """The wall time of one all-decode step of `model.generate` on `batch_size` prompts of `context`
    tokens (the loop's gaps between steps included), in ms."""
    import hfaccel

    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    ids = torch.randint(3, 256, (batch_size, context), generator=g).to(device)
    hfaccel.patch(
        model,
        max_num_seqs=batch_size,
        max_num_batched_tokens=max(2048, batch_size * context),
        enable_prefix_caching=False,
        kv_cache_memory=_kv_bytes(model, batch_size, context, steps),
        cuda_graph_sizes=(batch_size,),
        progress=False,
    )
    try:
        mask = torch.ones_like(ids)
        # A first call compiles and captures the decode bucket where the engine does (CUDA): not timed.
        model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        seen = len(model._hfaccel.get_engine(model).step_stats)
        model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        stats = list(model._hfaccel.get_engine(model).step_stats)[seen:]
        stats = [s for s in stats if s.num_prefill_tokens == 0]
        stats = [s for s in stats if s.num_seqs == batch_size]
    finally:
        hfaccel.unpatch(model)
    span = stats[-1].start_s + stats[-1].duration_s - stats[0].start_s
    return span / len(stats) * 1e3


def hf_generate_step_ms(model: Any, batch_size: int, context: int, steps: int) -> float:
    """The wall time of one decode step of unpatched HF `generate` (its whole loop: forward, logits
    processors, stopping criteria, the cache and mask updates) on `batch_size` prompts of `context`
    tokens, in ms: the mean gap between its logits processor's calls after the first (the prefill's)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamps(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            self.times.append(time.perf_counter())
            return scores

    g = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    ids = torch.randint(3, 256, (batch_size, context), generator=g).to(device)
    stamps = Stamps()
    kwargs = {
        "attention_mask": torch.ones_like(ids),
        "do_sample": False,
        "logits_processor": LogitsProcessorList([stamps]),
    }
    with _hf_sdpa(device.type):
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, **kwargs)  # warm-up
        stamps.times.clear()
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
    times = stamps.times[1:]
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def hf_steps_in_a_row_ms(step: Any, steps: int) -> float:
    """The wall time of `steps` calls of HF's `step` run back to back, over their count, in ms."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def run_host_benchmark(
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128),
    contexts: tuple[int, ...] | None = None,
    steps: int = 24,
    device: str | None = None,
    rounds: int = 3,
) -> list[dict[str, float]]:
    """Print and return one row per (batch, context): the three systems' step times and ratios.

    `device`: ``"cuda"`` where CUDA is available, else ``"cpu"``; `contexts`: 128 and 1,024 on a CPU
    (HF's prefill of 128 x 4,096 tokens takes minutes on two cores), up to 4,096 on CUDA."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if contexts is None:
        contexts = (128, 1024) if device == "cpu" else (128, 1024, 4096)
    # On CUDA in bfloat16, as GPU users serve (a float32 model there runs the kernels' slow fp32 path).
    model = tiny_llama().to(device, torch.float32 if device == "cpu" else torch.bfloat16)
    engine_mode = "compile off" if device == "cpu" else "defaults: compiled decode, CUDA graphs"
    print(
        f"== host cost of a decode step: tiny Llama (4 layers, hidden 64) on {device}, "
        f"engine {engine_mode}; {cpu_description()}"
    )
    print(
        f"{'batch':>6} {'context':>8} {'HF step':>9} {'Engine.step':>12} {'generate':>9} {'gen/HF':>7} "
        f"{'step/HF':>8} {'HF in a row':>12} {'gen/row':>8} {'HF generate':>12} {'gen/HF gen':>11}"
    )
    rows = []
    for context in contexts:
        for batch_size in batch_sizes:
            with _hf_sdpa(device):
                hf_step = hf_decode_step(model, batch_size, context)
            engine_config = {"compile": "off"} if device == "cpu" else {}
            direct_step, _ = engine_decode_step(
                model,
                batch_size,
                context,
                steps,
                kv_cache_memory=_kv_bytes(model, batch_size, context, steps),
                **engine_config,
            )

            def hf_call(step: Any = hf_step) -> None:
                with _hf_sdpa(device):
                    step()

            # Interleaved round by round: a machine whose load changes slows both alike.
            times = interleave({"hf": hf_call, "step": direct_step}, steps)
            hf, direct = (statistics.median(times[n]) * 1e3 for n in ("hf", "step"))
            in_a_row, runs = [], []
            for _ in range(rounds):  # alternating: a machine whose load changes slows both alike
                with _hf_sdpa(device):  # a cache of `context` tokens again: the contexts generate's run sees
                    in_a_row.append(hf_steps_in_a_row_ms(hf_decode_step(model, batch_size, context), steps))
                runs.append(generate_step_ms(model, batch_size, context, steps))
            hf_row, through = statistics.median(in_a_row), statistics.median(runs)
            hf_generate = hf_generate_step_ms(model, batch_size, context, steps)
            row = {
                "batch": batch_size,
                "context": context,
                "hf_ms": hf,
                "step_ms": direct,
                "generate_ms": through,
                "hf_row_ms": hf_row,
                "hf_generate_ms": hf_generate,
            }
            rows.append(row)
            print(
                f"{batch_size:>6} {context:>8} {hf:>8.2f}ms {direct:>10.2f}ms {through:>7.2f}ms "
                f"{through / hf:>6.2f}x {direct / hf:>7.2f}x {hf_row:>10.2f}ms {through / hf_row:>7.2f}x "
                f"{hf_generate:>10.2f}ms {through / hf_generate:>10.2f}x",
                flush=True,
            )
    return rows
