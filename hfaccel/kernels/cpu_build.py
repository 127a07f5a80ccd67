"""Builds a small C source into a shared library with the system C compiler, once per source, flags,
compiler and CPU, into a per-user cache directory (the CPU kernels: `cpu_decode`, `cpu_argmax`).

A build uses ``-march=native``, so the CPU's model and flags are part of the cache key; OpenMP sources
link ``libgomp.so.1``, which resolves to the OpenMP runtime torch already loaded (torch's thread pool
size and threads). Where no compiler works the caller gets None and keeps its torch path (a debug line
says why)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "".join(lines)


def build_library(name: str, source: str, flags: list[str]) -> ctypes.CDLL | None:
    """`source` compiled with `flags` (plus ``-shared -fPIC``) and loaded; None where it cannot be
    built. `name` names the cached file (``<name>_<key>.so``)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.debug("no C compiler found: %s is not built (its torch path runs)", name)
        return None
    flags = [*flags, "-shared", "-fPIC"]
    key = hashlib.sha256("\0".join([source, compiler, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    user = os.getuid() if hasattr(os, "getuid") else "user"
    folder = os.path.join(tempfile.gettempdir(), f"hfaccel-kernels-{user}")
    path = os.path.join(folder, f"{name}_{key}.so")
    try:
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as work:
                source_path = os.path.join(work, f"{name}.c")
                with open(source_path, "w") as f:
                    f.write(source)
                built = os.path.join(work, f"{name}.so")
                subprocess.run(
                    [compiler, *flags, "-o", built, source_path, "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, path)  # atomic: a concurrent process loads a whole file or builds its own
        return ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as error:
        logger.debug("%s could not be built (%s): its torch path runs", name, error)
        return None


def kernels_enabled() -> bool:
    """False when ``HFACCEL_CPU_DECODE_KERNEL=0`` turns the CPU kernels off (the torch paths run)."""
    return os.environ.get("HFACCEL_CPU_DECODE_KERNEL", "1") != "0"
