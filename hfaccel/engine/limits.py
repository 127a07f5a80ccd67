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
scheduler then bounds each step by it (`engine/scheduler.py`). Explicit values are used exactly, except a
`max_num_seqs` beyond the KV cache's blocks (`cap_to_blocks`).
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.engine.block_manager import blocks_for

TYPICAL_LEN = 512
MIN_SEQS = 8
CPU_MAX_SEQS = 64
GPU_MAX_SEQS = 256
CPU_TOKENS = 2048
GPU_TOKENS = 8192

logger = logging.getLogger("hfaccel")


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    auto: tuple[str, ...]  # which of them were chosen here (the others were the user's)
    reason: str  # how the automatic ones were chosen
    state_bytes: int = 0  # the recurrent state of max_num_seqs sequences, taken from the KV budget

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
    state_bytes_per_seq: int = 0,
) -> Limits:
    """Fill in the limits the user left as None (see the module docstring); `at_least_seqs` is the
    largest batch another setting needs (``max_batch_size``, the CUDA-graph sizes). A model with
    recurrent layers keeps `state_bytes_per_seq` for each of its ``max_num_seqs`` sequences out of the
    same budget: a sequence then costs its state beside its K/V."""
    gpu = device.type == "cuda"
    auto = []
    typical = max(1, min(max_model_len, TYPICAL_LEN))
    per_seq = typical * kv_bytes_per_token + state_bytes_per_seq
    fit = kv_budget_bytes // max(1, per_seq)
    held = (
        "KV memory"
        if not state_bytes_per_seq
        else f"KV and recurrent state ({state_bytes_per_seq} bytes a sequence)"
    )
    reason = (
        f"{held} holds {fit} sequences of {typical} tokens; "
        f"{'GPU' if gpu else 'CPU'} cap {GPU_MAX_SEQS if gpu else CPU_MAX_SEQS} sequences, "
        f"{GPU_TOKENS if gpu else CPU_TOKENS} tokens a step"
    )
    if not kv_bytes_per_token:
        reason = f"no layer keeps K/V (a purely recurrent model); {reason}"
    if max_num_seqs is None:
        cap = GPU_MAX_SEQS if gpu else CPU_MAX_SEQS
        # Preemption covers K/V that outgrows its share; a state is held whole from the first token.
        floor = 1 if state_bytes_per_seq else MIN_SEQS
        max_num_seqs = max(floor, at_least_seqs, min(cap, fit))
        if state_bytes_per_seq:  # the seats' state leaves K/V room for one sequence of max_model_len
            longest = blocks_for(max_model_len, block_size) * block_size * kv_bytes_per_token
            room = (kv_budget_bytes - longest) // state_bytes_per_seq
            max_num_seqs = max(1, at_least_seqs, min(max_num_seqs, room))
        auto.append("max_num_seqs")
    state_bytes = state_bytes_per_seq * max_num_seqs
    if state_bytes >= kv_budget_bytes:
        raise ValueError(
            f"kv_cache_memory gives {kv_budget_bytes:,} bytes, and the recurrent state of max_num_seqs="
            f"{max_num_seqs} sequences alone takes {state_bytes:,} ({state_bytes_per_seq:,} bytes each): "
            "raise kv_cache_memory or lower max_num_seqs"
        )
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(GPU_TOKENS if gpu else CPU_TOKENS, block_size, max_num_seqs)
        auto.append("max_num_batched_tokens")
    return Limits(max_num_seqs, max_num_batched_tokens, tuple(auto), reason, state_bytes)


# Tokens the blocks of a model that keeps no K/V (every layer recurrent) count across its sequences, at
# most: such blocks cost nothing but the block manager's bookkeeping, which grows with their number.
COUNTED_TOKENS = 1 << 21


def counting_blocks(engine: Any) -> int:
    """Blocks for a model that keeps no K/V: every seat at full length, at most `COUNTED_TOKENS` tokens'
    worth, never fewer than one sequence of ``max_model_len`` needs (more sequences than fit are
    preempted, as K/V would make them)."""
    size, longest = engine.config.block_size, engine.max_model_len
    useful = engine.config.max_num_seqs * blocks_for(longest, size)
    return min(useful, max(blocks_for(COUNTED_TOKENS, size), blocks_for(longest, size)))


# The engines of patched models, weakly: one a dropped model held lingers here until Python's cycle
# collector runs (the model holds its engine, which holds the model).
_engines: weakref.WeakSet = weakref.WeakSet()


def track_engine(engine: Any) -> None:
    """Count `engine` (with a ``device``), a patched model's, among those `free_memory_bytes` may have
    to collect."""
    _engines.add(engine)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of `device`: CUDA's free memory, or the host's available memory.

    On CUDA, where a patched model's engine on CUDA is alive, Python's cycle collector runs first: a
    patched model dropped without ``unpatch`` keeps its engine's KV cache until it does, so a notebook
    cell run again would size its cache from what the old one still holds (where none is alive, nothing
    can be freed: no collection, which costs up to a second in a large process)."""
    if device.type == "cuda":
        if any(engine.device.type == "cuda" for engine in list(_engines)):
            gc.collect()
            torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3  # no way to ask: assume a modest 8 GiB


def cap_to_blocks(config: Any, num_blocks: int, max_model_len: int) -> Any:
    """`config` with `max_num_seqs` no more than the KV cache's blocks (a running sequence holds one at
    least) and then a step's token budget no more than their slots (each token computed takes one):
    `max_num_seqs=10**8` sized the step buffers for that many (a server was killed for memory)."""
    if not 0 < num_blocks < config.max_num_seqs:
        return config
    logger.warning(
        "hfaccel: max_num_seqs=%d is more than the KV cache's %d blocks: at most %d sequences run at once",
        config.max_num_seqs, num_blocks, num_blocks,
    )  # fmt: skip
    slots = num_blocks * config.block_size
    budget = min(config.max_num_batched_tokens, max(slots, max_model_len))
    changes = {"max_num_seqs": num_blocks, "max_num_batched_tokens": budget}
    sizes = config.cuda_graph_sizes
    if sizes is not None and max(sizes) > num_blocks:  # batch sizes that cannot occur: not compiled
        kept = tuple(size for size in sizes if size <= num_blocks)
        logger.warning("hfaccel: cuda_graph_sizes %s above %d are left out", tuple(sizes), num_blocks)
        changes["cuda_graph_sizes"] = kept or None
    return config.with_overrides(**changes)
