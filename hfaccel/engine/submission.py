"""A caller's side of the engine loop (`engine/loop.py`): the `Submission` a caller iterates, waits on or
cancels, and the `Update`s the loop thread sends it after each step through the caller's own channel (a
`queue.SimpleQueue` for a thread, an `asyncio.Queue` for a coroutine)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from hfaccel.engine.openmp import OMP_PAUSE_SOFT, pause_function
from hfaccel.engine.request import Request

_POLL_S = 0.25  # a waiting caller wakes this often to check the loop is alive (and to take a Ctrl-C anywhere)
_submission_ids = itertools.count()
# Which loop this thread steps (`loop`), if any: set by the loop while a thread steps it.
this_thread = threading.local()


class LoopClosed(RuntimeError):
    """The loop stopped (unpatch, engine rebuilt, interpreter exit) while a request was in flight."""


@dataclass(frozen=True)
class Update:
    """What the loop tells a caller about one of its requests after a step."""

    index: int  # the request's position in its submission
    token_ids: tuple[int, ...]  # tokens generated since the last update (streaming submissions only)
    finished: bool


class Submission:
    """One caller's requests on the loop: iterate their updates, wait for them, or cancel them.

    Made by `EngineLoop.submit`. Consume it from the thread (or event loop) that submitted it.
    """

    def __init__(
        self,
        loop: Any,  # its EngineLoop (engine/loop.py imports this module)
        requests: Sequence[Request],
        stream: bool,
        event_loop: asyncio.AbstractEventLoop | None = None,
        raise_errors: bool = True,
    ) -> None:
        self.id = next(_submission_ids)
        # False: a request that fails alone (its own processors raised: `Request.fail(alone=True)`)
        # finishes as an error and the others go on (`hfaccel.generate(errors="return")`); a step's fault
        # or an interruption still raises.
        self.raise_errors = raise_errors
        self.loop = loop
        self.requests = list(requests)
        self.stream = stream
        self.thread = threading.get_ident()
        self._event_loop = event_loop
        if event_loop is None:
            self._queue: Any = queue.SimpleQueue()
            self._notify: Callable[[Update], None] = self._queue.put
        else:
            self._queue = asyncio.Queue()
            self._notify = lambda update: event_loop.call_soon_threadsafe(self._queue.put_nowait, update)
        self._pending = len(self.requests)  # caller side: finished updates not yet received
        # Loop-thread side.
        self._sent = [0] * len(self.requests)  # tokens reported per request; -1 once its end is reported
        self._open = len(self.requests)
        self._deaf = False  # its channel failed (event loop closed): stop notifying
        self._drove = self._pool_released = False  # caller side: stepped for itself; gave its pool back

    @property
    def done(self) -> bool:
        """Whether the caller has received the last update."""
        return self._pending == 0

    def cancel(self, wait: bool = False) -> None:
        """Abort this submission's unfinished requests; their KV blocks are freed before the next step.

        `wait=True` (threads only) blocks until the loop has done it (at most about one step).
        """
        if self._pending and self._open:
            self.loop._post("cancel", self)
        if wait and self._event_loop is None:
            while self._pending:
                if self._get().finished:
                    self._pending -= 1

    def updates(self) -> Iterator[Update]:
        """Yield updates until every request has finished. A failed request raises its error.

        If the consumer stops early, or anything interrupts the wait (KeyboardInterrupt included), the
        unfinished requests are cancelled and the interruption propagates.
        """
        if self._event_loop is not None:
            raise RuntimeError("this submission was made for an event loop: iterate aupdates()")
        complete = False
        try:
            while self._pending:
                yield self._received(self._get())
            complete = True
            if self._drove:  # back to the caller's own code: another thread may step next
                self._release_pool()
        finally:
            self.loop._wait_ended()
            if not complete:
                # Wait for the cancellation to take effect (its blocks freed when this returns), except on
                # KeyboardInterrupt (the caller gets control back at once) and on the loop thread itself:
                # an abandoned stream's cleanup may run there (the garbage collector closes it wherever it
                # collects), and the loop cannot wait for itself.
                # Nor where this thread holds the loop's lock: the collector may run the cleanup inside any
                # allocation, one in the loop's own locked sections included, and the loop needs the lock.
                self.cancel(
                    wait=not isinstance(sys.exc_info()[1], KeyboardInterrupt)
                    and threading.current_thread() not in (self.loop._thread, self.loop._stepper)
                    and not self.loop._cond._is_owned()
                )

    async def aupdates(self) -> AsyncIterator[Update]:
        """`updates` for a coroutine; cancelling the task cancels the requests."""
        if self._event_loop is None:
            raise RuntimeError("this submission was made for a thread: iterate updates()")
        complete = False
        try:
            while self._pending:
                yield self._received(await self._queue.get())
            complete = True
        finally:
            if not complete:
                self.cancel()

    def wait(self, progress: bool = False) -> None:
        """Block until every request has finished (see `updates`); `progress` shows a bar."""
        try:
            self._wait(progress)
        except BaseException:
            self.cancel()  # a Ctrl-C before the updates began (after, they cancelled: a no-op)
            raise

    def _wait(self, progress: bool) -> None:
        engine = self.loop.engine
        bar = tqdm(total=len(self.requests), desc="hfaccel", unit="req", disable=not progress, leave=False)
        tokens_before = engine.num_generated_tokens
        try:
            for update in self.updates():
                if update.finished:
                    bar.update(1)
                    if progress:
                        bar.set_postfix(tokens=engine.num_generated_tokens - tokens_before, refresh=False)
        finally:
            bar.close()

    async def await_all(self) -> None:
        """`wait` for a coroutine."""
        async with contextlib.aclosing(self.aupdates()) as updates:
            async for _ in updates:
                pass

    def _get(self) -> Update:
        while True:
            if not self._queue.empty():  # (no exception raised on the common path: the queue is empty)
                try:  # (another thread may take it first: a cancel's wait, a collected stream's cleanup)
                    return self._queue.get_nowait()
                except queue.Empty:
                    pass
            if self.loop._drive_for(self):  # stepped in this thread: look again
                self._drove = True
                continue
            if not self._pool_released:  # another thread steps while this one waits
                self._release_pool()
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.loop._serving(self):
                    raise LoopClosed(f"the engine loop stopped without finishing {self!r}") from None

    def _release_pool(self) -> None:
        """Give back this thread's OpenMP pool (`engine/openmp.py`), unless it steps some loop."""
        self._pool_released, pause = True, pause_function()
        if pause is not None and getattr(this_thread, "loop", None) is None:
            pause(OMP_PAUSE_SOFT)

    def _received(self, update: Update) -> Update:
        if update.finished:
            self._pending -= 1
            request = self.requests[update.index]
            if request.finish_reason == "error" and (self.raise_errors or not request.failed_alone):
                raise request.error or RuntimeError(f"request {request.request_id!r} failed")
        return update

    def __repr__(self) -> str:
        return f"Submission(id={self.id}, requests={len(self.requests)}, pending={self._pending})"
