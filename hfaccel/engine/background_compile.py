"""``compile="background"``: decode steps compile in a thread of their own while the engine serves eagerly.

A cold ``torch.compile`` of a 30-layer model's decode step costs minutes on a CPU (120-130 s for
SmolLM2, docs/benchmarks.md), and with ``compile="decode"`` the first step of each batch size waits for
it. Here the first decode step of a bucket only queues that bucket: this thread compiles the forward
and runs it once on a step of padding (its own input and metadata buffers of the step's shapes, so the
engine's next call of the same shape finds the graph and recompiles nothing; padding writes only the
scratch block and reads nothing), and from then on the bucket's steps run compiled. Until then they run
eager and unpadded, as with ``compile="off"``. A failed compile leaves its bucket eager, with one
warning. Buckets are compiled on demand, in the order steps ask for them: a workload that only ever
decodes one sequence compiles one graph.

Dynamo installs its frame hook per thread, so the engine's eager forward in another thread is not
traced; the compiled forward reads the step from the thread-local forward context (`kernels/op.py`),
and the model's attention implementation is switched per thread (`patches/attention.py`).

Caveats, measured or read from torch: on a CPU with few cores, the compile slows the eager steps it
runs beside (2.2x on two cores, docs/benchmarks.md); dynamo restores torch's global random state when a
compile ends, so a request that takes its seed from that state while a bucket compiles (no ``seed=``)
may draw a seed an earlier one drew; torch before 2.13 crashed (a segfault in a later compile of the
process) after a compile in another thread, so the mode needs torch 2.13 or later
(`background_unavailable_reason`); model-parallel executors (their steps' collectives must pair up on
every rank) are refused.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

logger = logging.getLogger("hfaccel")


class BackgroundCompiler:
    """Compiles (`compile`: a new static-shape compiled forward) and warms (`warm`) one bucket at a time
    in a daemon thread; `ready` answers without waiting."""

    def __init__(
        self,
        compile: Callable[[], Callable],
        warm: Callable[[Callable, int], None],
    ) -> None:
        self._compile = compile
        self._warm = warm
        self._lock = threading.Lock()
        self._ready: dict[int, Callable] = {}
        self._failed: set[int] = set()
        self._queue: deque[int] = deque()
        self._queued: set[int] = set()
        self._thread: threading.Thread | None = None
        self._closed = False  # `close`d: nothing more starts, nothing more is installed
        self.seconds: dict[int, float] = {}  # each bucket's compile and warm-up, in the background
        self.ready_at: dict[int, float] = {}  # when each bucket became ready (time.perf_counter())

    def ready(self, bucket: int) -> Callable | None:
        """The compiled forward for steps padded to `bucket`, or None (run eager) while it compiles, after
        it failed, or at its first ask (which queues it)."""
        with self._lock:
            compiled = self._ready.get(bucket)
            if compiled is not None or bucket in self._failed or _exiting or self._closed:
                return compiled
            if bucket not in self._queued:
                if self._thread is None:
                    thread = threading.Thread(target=self._run, name="hfaccel-compile", daemon=True)
                    thread.start()  # may raise (no threads at shutdown): nothing is queued then
                    self._thread = thread
                self._queued.add(bucket)
                self._queue.append(bucket)
            return None

    def close(self) -> None:
        """Forget the queue and install nothing more (the engine is being released): a compile in flight
        finishes in its thread and is dropped, and the thread then ends, letting the engine go."""
        with self._lock:
            self._closed = True
            self._queued -= set(self._queue)
            self._queue.clear()

    def pending(self) -> int:
        """Buckets queued or compiling."""
        with self._lock:
            if _exiting or (self._closed and self._thread is None):
                return 0
            return len(self._queued) - len(self._ready) - len(self._failed)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or compiling (True), or `timeout` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _run(self) -> None:
        try:
            self._compile_queued()
        finally:  # whatever ends the thread, a later bucket starts a new one
            with self._lock:
                self._thread = None

    def _compile_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue or _exiting or self._closed:
                    return
                bucket = self._queue.popleft()
            start = time.perf_counter()
            try:
                # A compiled forward (a code object, a dynamo cache) of its own per bucket: the engine's
                # thread runs ready ones while this thread compiles the next, sharing no cache.
                compiled = self._compile()
                self._warm(compiled, bucket)
            except Exception as error:  # a model dynamo cannot compile: its steps stay eager
                logger.warning(
                    "hfaccel: compiling decode steps of %d sequences in the background failed (%s: %s); "
                    "they run eager",
                    bucket,
                    type(error).__name__,
                    error,
                )
                with self._lock:
                    self._failed.add(bucket)
                continue
            seconds = time.perf_counter() - start
            with self._lock:
                if self._closed:
                    return
                self.seconds[bucket] = seconds
                self.ready_at[bucket] = time.perf_counter()
                self._ready[bucket] = compiled
            logger.info(
                "hfaccel: decode steps of %d sequences run compiled from now on (compiled in %.0f s, "
                "in the background)",
                bucket,
                seconds,
            )


_exiting = False


_TORCH_VERSION = torch.__version__


def background_unavailable_reason() -> str | None:
    """Why ``compile="background"`` cannot run with this torch (None: it can)."""
    major, minor = (int(part) for part in _TORCH_VERSION.split(".")[:2])
    if (major, minor) < (2, 13):
        return (
            f"torch {_TORCH_VERSION} crashes in a compile that follows one made in another thread "
            "(measured on 2.11; 2.13 and later do not): use compile='decode', or torch 2.13 or later"
        )
    return None


@atexit.register
def _stop_starting() -> None:
    """At exit no new bucket starts compiling (a compile in flight finishes or is dropped with its
    daemon thread)."""
    global _exiting
    _exiting = True
