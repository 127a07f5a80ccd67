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
import stat
import subprocess
import tempfile
import threading

logger = logging.getLogger(__name__)

_BUILD_LOCK = threading.Lock()  # threads asking at once build once (the others load the result)


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "".join(lines)


def build_library(name: str, source: str, flags: list[str]) -> ctypes.CDLL | None:
    """`source` compiled with `flags` (plus ``-shared -fPIC``) and loaded; None where it cannot be
    built, or where the cache directory is not the user's own (see `_private_folder`). `name` names the
    cached file (``<name>_<key>.so``)."""
    with _BUILD_LOCK:
        return _build_library(name, source, flags)


def _private_folder(folder: str) -> bool:
    """Whether `folder` (made here if missing) is a directory that only this user can write to: a
    library found there is loaded into the process, and its name is predictable, so a folder another
    user made (or can write to) must not be trusted."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if not hasattr(os, "getuid"):
        return True
    info = os.lstat(folder)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def _build_library(name: str, source: str, flags: list[str]) -> ctypes.CDLL | None:
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
        if not _private_folder(folder):
            logger.warning(
                "hfaccel: %s is not a directory of this user's that only it can write to: the CPU kernels "
                "are not built or loaded from it (the torch paths run)",
                folder,
            )
            return None
        if not os.path.exists(path):
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


def load_kernel(
    name: str, source: str, flags: list[str], function: str, argtypes: list, restype: object
) -> ctypes.CDLL | None:
    """The library of a CPU kernel, built on first use (`build_library`) with `function`'s signature
    set; None where it cannot be built or ``HFACCEL_CPU_DECODE_KERNEL=0`` turns the CPU kernels off
    (the torch paths run)."""
    if os.environ.get("HFACCEL_CPU_DECODE_KERNEL", "1") == "0":
        return None
    library = build_library(name, source, flags)
    if library is not None:
        entry = getattr(library, function)
        entry.argtypes = argtypes
        entry.restype = restype
    return library
