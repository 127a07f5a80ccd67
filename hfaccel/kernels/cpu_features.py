"""What this CPU computes fast: its ISA, and the dtype whose matmuls it runs natively.

CPUs differ: on one with AVX512-BF16 or AMX, bfloat16 matmuls run about twice as fast as float32
(SmolLM2's decode step 19.5-22.5 ms against 38.5-47 ms at batch 1 on an AVX512+BF16 CPU, 2 threads);
on an AVX2-only CPU bfloat16 is emulated and about 4x slower. No dtype is assumed to be the fast one.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_isa() -> str:
    """torch's CPU capability (``AVX2``, ``AVX512`` ...), with ``+BF16``/``+AMX`` where the CPU has native
    bf16 matmul instructions (torch's capability string does not say)."""
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch or an unusual platform
        isa = "unknown"
    flags = cpu_flags()
    if "amx_bf16" in flags:
        isa += "+AMX"
    elif "avx512_bf16" in flags:
        isa += "+BF16"
    return isa


def native_bf16_cpu() -> bool:
    """Whether this CPU has native bf16 matmul instructions (AVX512-BF16 or AMX)."""
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpu_flags())


def fast_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The weights' dtype that computes fastest on `device`: bfloat16 on a CUDA device that supports it
    and on a CPU with native bf16 matmuls, float32 elsewhere (bf16 emulation makes it the slow one)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if native_bf16_cpu() else torch.float32
