"""Give back the calling thread's OpenMP worker pool while it waits on another thread's steps.

With GNU OpenMP (libgomp, which torch's Linux wheels ship), every thread that runs a parallel region
keeps its own pool of worker threads. Once the pools together hold more threads than there are cores,
libgomp stops spinning between parallel regions, and every op of the thread that steps the engine pays a
futex wake-up (on 2 cores, 2026-11-26: `silu(x @ w)` on `[32, 64] x [64, 256]` 41 us in the main thread,
69-89 us in a second thread while the main thread's pool lives, 31-45 us once it is given back). So a
caller that waits while another thread steps, and a caller that stepped its own requests and returns to
its own code, give their pools back (`omp_pause_resource_all`, OpenMP 5.0): the next parallel region in
that thread builds a new one (one thread start, tens of microseconds).

Other OpenMP runtimes (Intel's, LLVM's) are left alone: this only acts where libgomp is loaded.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

logger = logging.getLogger("hfaccel")
OMP_PAUSE_SOFT = 1


@functools.cache
def pause_function() -> Any:
    """libgomp's `omp_pause_resource_all` (call it with `OMP_PAUSE_SOFT`), from the copy this process
    has loaded, or None. Cached: after the first call no Python code of this file runs to get it."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a libgomp older than GCC 9 has no pause
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        return function
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's libgomp worker pool (a no-op inside a parallel region, or without
    libgomp); True if a libgomp took the request."""
    pause = pause_function()
    if pause is None:
        return False
    try:
        return pause(OMP_PAUSE_SOFT) == 0
    except Exception as error:  # never let a threading optimisation fail a call
        logger.debug("hfaccel: omp_pause_resource_all failed: %s", error)
        return False
