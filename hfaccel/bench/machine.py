"""What machine a benchmark ran on: printed next to every table (CPUs differ: bf16 is 3-5x faster than
fp32 on AVX-512-BF16 and about 4x slower on AVX2, so no dtype is assumed to be the fast one)."""

from __future__ import annotations

import platform

import torch


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa() -> str:
    """torch's CPU capability (``AVX2``, ``AVX512`` ...), with ``+BF16``/``+AMX`` where the CPU has native
    bf16 matmul instructions (torch's capability string does not say)."""
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch or an unusual platform
        isa = "unknown"
    flags = _cpu_flags()
    if "amx_bf16" in flags:
        isa += "+AMX"
    elif "avx512_bf16" in flags:
        isa += "+BF16"
    return isa


def cpu_description() -> str:
    """One line: device, CPU ISA, threads, torch version."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{device}, CPU {platform.processor() or platform.machine()} ISA {cpu_isa()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )


def fast_dtype() -> torch.dtype:
    """The dtype a CPU benchmark should default to here: bfloat16 where the ISA has native bf16 matmuls,
    float32 elsewhere (on AVX2, bf16 emulation makes it the slow one)."""
    if torch.cuda.is_available():
        return torch.bfloat16
    isa = cpu_isa()
    return torch.bfloat16 if "+BF16" in isa or "+AMX" in isa else torch.float32
