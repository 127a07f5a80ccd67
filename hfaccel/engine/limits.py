"""Default batch limits, chosen when the engine is built (``max_num_seqs`` / ``max_num_batched_tokens``
left as ``None``).

The heuristic of the batching notes (seed 001, section 9): the decode batch is bounded by memory,

    max_num_seqs ~= KV memory / (sequence length x KV bytes per token)

taken at a typical sequence length (the model's context, at most `TYPICAL_LEN` tokens: requests rarely
fill an 8k context, and preemption covers the ones that grow past their share), then capped per device
(a CPU's step time grows with every sequence, so more seats than `CPU_MAX_SEQS` buy latency and no
throughput; a GPU's decode step is flat much longer). The step's token budget is per device too (a CPU
prefill chunk of 2,048 tokens already takes about a second on a 135M model). What the static defaults
cannot know, the machine's actual step times, the step-time model learns online; with a TPOT target the
scheduler then bounds each step by it (`engine/scheduler.py`). Explicit values are always used exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TYPICAL_LEN = 512
MIN_SEQS = 8
CPU_MAX_SEQS = 64
GPU_MAX_SEQS = 256
CPU_TOKENS = 2048
GPU_TOKENS = 8192


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    auto: tuple[str, ...]  # which of them were chosen here (the others were the user's)
    reason: str  # how the automatic ones were chosen

    def describe(self) -> str:
        parts = []
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            tag = " (auto)" if name in self.auto else ""
            parts.append(f"{name}={getattr(self, name)}{tag}")
        return ", ".join(parts)


def resolve_limits(
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    *,
    kv_budget_bytes: int,
    kv_bytes_per_token: int,
    max_model_len: int,
    device: torch.device,
    block_size: int,
    at_least_seqs: int = 1,
) -> Limits:
    """Fill in the limits the user left as None (see the module docstring); `at_least_seqs` is the
    largest batch another setting needs (``max_batch_size``, the CUDA-graph sizes)."""
    gpu = device.type == "cuda"
    auto = []
    kv_tokens = max(1, kv_budget_bytes // max(1, kv_bytes_per_token))
    typical = max(1, min(max_model_len, TYPICAL_LEN))
    held = (
        f"KV memory holds {kv_tokens} tokens = {kv_tokens // typical} sequences of {typical}"
        if kv_bytes_per_token
        else "no layer keeps K/V (a purely recurrent model)"
    )
    reason = (
        f"{held}; "
        f"{'GPU' if gpu else 'CPU'} cap {GPU_MAX_SEQS if gpu else CPU_MAX_SEQS} sequences, "
        f"{GPU_TOKENS if gpu else CPU_TOKENS} tokens a step"
    )
    if max_num_seqs is None:
        cap = GPU_MAX_SEQS if gpu else CPU_MAX_SEQS
        max_num_seqs = max(MIN_SEQS, at_least_seqs, min(cap, kv_tokens // typical))
        auto.append("max_num_seqs")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(GPU_TOKENS if gpu else CPU_TOKENS, block_size, max_num_seqs)
        auto.append("max_num_batched_tokens")
    return Limits(max_num_seqs, max_num_batched_tokens, tuple(auto), reason)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of `device`: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3  # no way to ask: assume a modest 8 GiB
