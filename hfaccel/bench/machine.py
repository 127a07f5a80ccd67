"""What machine a benchmark ran on: printed next to every table (CPUs differ: bf16 is 3-5x faster than
fp32 on AVX-512-BF16 and about 4x slower on AVX2, so no dtype is assumed to be the fast one)."""

from __future__ import annotations

import platform

import torch

from hfaccel.kernels.cpu_features import cpu_isa
from hfaccel.kernels.cpu_features import fast_dtype as _fast_dtype


def cpu_description() -> str:
    """One line: device, CPU ISA, threads, torch version."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{device}, CPU {platform.processor() or platform.machine()} ISA {cpu_isa()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )


def fast_dtype() -> torch.dtype:
    """The dtype a benchmark should default to here (`kernels.cpu_features.fast_dtype` of the GPU if
    there is one, else of the CPU)."""
    return _fast_dtype("cuda" if torch.cuda.is_available() else "cpu")
