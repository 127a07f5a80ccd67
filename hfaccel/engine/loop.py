"""One stepping loop per engine: callers in any thread or event loop submit requests and wait for their
own results, while one thread at a time adds, aborts and steps for all of them.

Callers never touch the engine's state. They put commands (submit, cancel, close) into a thread-safe
inbox; the loop thread drains the inbox between steps, so requests from different callers share steps,
and a cancelled request's blocks are freed before the next step. After each step the loop hands every
caller an `Update` per request that progressed (new tokens, finished) through the caller's own channel:
a `queue.SimpleQueue` for threads, an `asyncio.Queue` fed with ``call_soon_threadsafe`` for coroutines.

Which thread steps: a caller blocked in a thread on its own submission, while it is the only one,
steps the engine itself ("drives" it); every other case starts the loop's background thread, which
steps for everyone, and waiting callers give their OpenMP pools back (docs/architecture.md, "Who
steps"). One lock (the baton) keeps one stepper at a time; a caller never steps another's requests, so
a Ctrl-C in a driving caller fails only its own. The thread is a daemon and exits after `idle_timeout`
idle seconds. `close` (unpatch, an engine rebuilt, interpreter exit) fails whatever is still running
with the reason and stops it.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hfaccel.engine.engine import Engine
from hfaccel.engine.request import Request
from hfaccel.engine.submission import LoopClosed, Submission, Update
from hfaccel.engine.submission import this_thread as _this_thread

logger = logging.getLogger("hfaccel")

_loops: weakref.WeakSet[EngineLoop] = weakref.WeakSet()
_THREAD_NAME = "hfaccel-engine-loop"
# Which loop each stepping thread waits on from inside its step (a callback
# calling another model's generate): a call closing a cycle of such waits is refused at once.
_waits_lock = threading.Lock()
_waits: dict[int, EngineLoop] = {}  # id(waiting loop) -> the loop it waits on


@dataclass(frozen=True)
class LoopStep:
    """Who one engine step served: the submissions (and their callers' threads) that got a token in it."""

    step: int
    num_seqs: int  # sequences that got a token
    submissions: frozenset[int]
    threads: frozenset[int]


class EngineLoop:
    """The one thread that steps `engine` for every caller. See the module docstring.

    Once a loop serves an engine, drive that engine only through the loop.
    """

    def __init__(self, engine: Engine, idle_timeout: float = 1.0, step_log_size: int = 4096) -> None:
        self.engine = engine
        self.idle_timeout = idle_timeout
        self.step_log: deque[LoopStep] = deque(maxlen=step_log_size)  # who each step served (debug)
        # Entered through the lock itself (`with self._lock`), whose __enter__ is C: a Ctrl-C arriving as
        # it is taken is raised inside the with block, which then releases it. Through the condition, a
        # Python __enter__ returned the taken lock into a frame the interrupt had already left, held for
        # good (every later caller hung).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._inbox: list[tuple[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._baton = threading.Lock()  # held by the thread applying the inbox and stepping
        self._stepper: threading.Thread | None = None  # a caller's thread while it drives the loop
        self._idle = True
        self._closed: BaseException | None = None
        # Loop-thread state.
        self._live: dict[int, Submission] = {}
        self._owner: dict[int, tuple[Submission, int]] = {}  # id(request) -> (submission, index)
        # Updates for coroutines held while the inbox is applied and a step runs, by event loop.
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[Submission, Update]]] | None = None
        _loops.add(self)

    # ----------------------------------------------------------------- callers (any thread)

    def submit(
        self, requests: Sequence[Request], *, stream: bool = False, raise_errors: bool = True
    ) -> Submission:
        """Queue `requests` (built by ``engine.make_request``) for this caller's thread to consume.

        `stream=True` delivers every new token; otherwise only each request's end is reported.
        `raise_errors=False`: a request that fails finishes as an error, the others go on.
        """
        self._refuse_reentry()
        return self._submitted(lambda: Submission(self, requests, stream, raise_errors=raise_errors))

    def reentry_reason(self) -> str | None:
        """Why a call submitted from this thread would wait forever, or None (`patches/planner.py`)."""
        if threading.current_thread() in (self._thread, self._stepper):  # a callback of its own requests
            return "generate was called on a model from inside its own engine step: it would wait for itself"
        waiter = getattr(_this_thread, "loop", None)  # a callback inside another model's step
        with _waits_lock:
            target: EngineLoop | None = self if waiter is not None else None
            while target is not None and target is not waiter:
                target = _waits.get(id(target))
        if target is None:
            return None
        return (
            "generate was called from inside a model's engine step on a model whose step waits for this one"
        )

    def _refuse_reentry(self) -> None:
        if (reason := self.reentry_reason()) is not None:
            raise RuntimeError(f"{reason}; call it from another thread, or after the outer call returns")
        if (waiter := getattr(_this_thread, "loop", None)) is not None:
            with _waits_lock:
                _waits[id(waiter)] = self  # until this wait ends (`Submission._wait_ended`)

    @staticmethod
    def _wait_ended() -> None:
        waiter = getattr(_this_thread, "loop", None)
        if waiter is not None:
            with _waits_lock:
                _waits.pop(id(waiter), None)

    def submit_async(
        self, requests: Sequence[Request], *, stream: bool = False, raise_errors: bool = True
    ) -> Submission:
        """`submit` for the running event loop: consume with ``Submission.aupdates``."""
        self._refuse_reentry()
        return self._submitted(
            lambda: Submission(self, requests, stream, asyncio.get_running_loop(), raise_errors)
        )

    def _submitted(self, make: Callable[[], Submission]) -> Submission:
        """Post the submission `make` builds; if either raises (a closed loop), the wait `_refuse_reentry`
        noted ends here: no submission will end it, and a stale wait refuses later calls as a cycle."""
        try:
            submission = make()
            self._post("submit", submission)
        except BaseException:
            self._wait_ended()
            raise
        return submission

    def run(self, requests: Sequence[Request], progress: bool = False, raise_errors: bool = True) -> None:
        """Submit `requests` and block until all finish (the blocking counterpart of `Engine.run`)."""
        self.submit(requests, raise_errors=raise_errors).wait(progress)

    def close(self, reason: BaseException | None = None, timeout: float | None = 10.0) -> bool:
        """Stop the loop for good: requests in flight fail with `reason` (their callers get it raised),
        their blocks are freed, and the thread exits (joined up to `timeout` seconds). Returns whether no
        step of the loop runs any more (False: one still ran when the time was up, or runs in this very
        thread)."""
        reason = reason or LoopClosed("the engine loop was closed")
        with self._lock:
            if self._closed is None:
                self._closed = reason
                self._inbox.append(("close", reason))
                self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread.is_alive():
            if thread is threading.current_thread():
                return False
            thread.join(timeout)
            return not thread.is_alive()
        # No loop thread: applied here once a driver's step is over (from inside it, by the driver next).
        if self._stepper is threading.current_thread():
            return False
        if not self._baton.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self._work()
        finally:
            self._baton.release()
        return True

    def step_here(self, until: Callable[[], bool], poll_s: float = 0.1) -> None:
        """Make the calling thread this loop's stepping thread, for every caller, until `until()` is true
        (checked every `poll_s` seconds) or the loop closes: for a main thread with nothing else to do
        (``hfaccel serve``), whose OpenMP pool is then the process's only one."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError("this loop already has a stepping thread")
            self._thread = threading.current_thread()
            self._cond.notify_all()
        _this_thread.loop = self
        try:
            while (not until() and self._closed is None) or self._close_pending():
                with self._baton:
                    with self._lock:
                        if not self._inbox and not self._busy():
                            self._idle = True
                            self._cond.notify_all()
                            if not self._cond.wait_for(lambda: bool(self._inbox), poll_s):
                                continue
                            self._idle = False
                    self._work()
        finally:
            _this_thread.loop = None
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the loop has nothing queued or running; returns False on timeout."""
        with self._lock:
            return self._cond.wait_for(lambda: self._idle and not self._inbox, timeout)

    def forget_model_outputs(self) -> None:
        """The engine's `forget_model_outputs`, never beside one of its steps: at once if no thread steps
        the engine now, else by the stepping thread at its next step's model check, before that step
        admits anything (`Engine.forget_model_outputs_soon`). Never waits: a processor, an async
        step's worker or another loop's step may call it while this loop's step waits on them."""
        if self._baton.acquire(blocking=False):
            try:
                self.engine.forget_model_outputs()
            finally:
                self._baton.release()
        else:
            self.engine.forget_model_outputs_soon()

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive (it exits when idle and restarts on the next submit)."""
        return self._thread is not None and self._thread.is_alive()

    def _post(self, kind: str, item: Any) -> None:
        with self._lock:
            if self._closed is not None:
                if kind == "submit":
                    raise LoopClosed(f"the engine loop is closed: {self._closed}")
                return  # a cancel after close: everything was already failed
            self._inbox.append((kind, item))
            self._idle = False
            # A thread's own submission is stepped by its caller while it waits (`_drive_for`).
            if kind == "submit" and item._event_loop is None:
                self._cond.notify_all()
            else:
                self._ensure_thread_locked()

    def _ensure_thread_locked(self) -> None:
        """Start the loop's background thread unless it runs (or the loop is closed); wake it."""
        if self.is_running:
            self._cond.notify_all()
        elif self._closed is None:
            self._thread = threading.Thread(target=self._main, name=_THREAD_NAME, daemon=True)
            self._thread.start()

    def _serving(self, submission: Submission) -> bool:
        """Whether `submission` can still hear from the loop (a thread steps it, or its updates were sent)."""
        return submission._open == 0 or self.is_running or self._stepper is not None

    def _drive_for(self, submission: Submission) -> bool:
        """Apply the inbox and step once in this (the consuming) thread if `submission` (a thread's) is
        alone in the loop (`_work`); True if that did something. Else make sure the loop thread runs."""
        if submission._event_loop is not None or not self._baton.acquire(blocking=False):
            with self._lock:  # a coroutine's submission, or another thread steps now
                self._ensure_thread_locked()
            return False
        try:
            waiter = getattr(_this_thread, "loop", None)
            _this_thread.loop, self._stepper = self, threading.current_thread()
            try:
                return self._work(driver=submission)
            finally:
                _this_thread.loop, self._stepper = waiter, None
        finally:
            self._baton.release()

    # ----------------------------------------------------------------- the loop thread

    def _main(self) -> None:
        _this_thread.loop = self
        try:
            while True:
                with self._baton:
                    if not self._serve_once():
                        break
        except BaseException as error:  # a bug in the loop itself: fail every caller rather than hang them
            with self._lock:
                commands, self._inbox = self._inbox, []
            for kind, item in commands:
                if kind == "submit":
                    self._adopt(item)
            self._fail_all(error)
            with self._lock:
                self._thread = None
                self._idle = True
                self._cond.notify_all()
            raise
        finally:  # thread-locals are cleared after a join returns: never hold the engine in one
            _this_thread.loop = None

    def _serve_once(self) -> bool:
        """Wait for work, apply the inbox and run one step; False when the thread should exit."""
        with self._lock:
            if not self._inbox and not self._busy():
                self._idle = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: bool(self._inbox), self.idle_timeout)
                if not self._inbox:
                    self._thread = None
                    return False
                self._idle = False
        self._work()
        return self._closed is None or self._close_pending()  # exits once a close is applied

    def _work(self, driver: Submission | None = None) -> bool:
        """Apply the inbox and run one step (the baton held); True if there was anything to do. A close
        fails everything in flight, and makes the thread exit. A `driver` (a caller stepping for its own
        submission) steps nothing else: if another submission is in the loop or its inbox, or a loop
        thread runs, it hands over to the loop thread instead (checked with the inbox taken, under one
        lock, so no submission slips in between)."""
        with self._lock:
            if driver is not None and self._closed is None:
                thread_alive = self.is_running
                # (counted, not searched: this runs before every step a lone caller takes)
                others = len(self._live) > (1 if driver.id in self._live else 0) or any(
                    kind == "submit" and item is not driver for kind, item in self._inbox
                )
                if thread_alive or others:
                    self._ensure_thread_locked()
                    return False
            commands, self._inbox = self._inbox, []
        if not commands and not self._busy():
            return False
        # Hold the updates for coroutines until the step ends, then hand each event loop all of its
        # updates in one ``call_soon_threadsafe``. Each such call writes the event loop's wake-up pipe
        # and then waits to take the GIL back from that loop's thread: py-spy found one such call a step
        # to be a fifth of a serving process's stepping thread (one stream, a tiny model), paid once per
        # stream a step before (docs/serve.md). `_send_held` sends what is held so far (a cancel's or a
        # rejection's news before the step runs, not one step late). (Not a context manager: a
        # generator's enter and exit cost a small model's step a few microseconds.)
        self._outbox = {}
        try:
            return self._apply_and_step(commands)
        finally:
            self._send_held()
            self._outbox = None

    def _apply_and_step(self, commands: list[tuple[str, Any]]) -> bool:
        for kind, item in commands:
            if kind == "submit":
                self._admit(item)
            elif kind == "cancel":
                self._abort(item, error=None)
            elif kind == "close":
                self._fail_all(item)
                with self._lock:
                    if self._thread is threading.current_thread():
                        self._thread = None
                    self._idle = True
                    self._inbox.clear()
                    self._cond.notify_all()
                return True
        if self._busy():
            self._send_held()
            self._step()
        elif any(kind == "cancel" for kind, _ in commands):
            self._check_drained()
        with self._lock:
            if not self._busy() and not self._inbox:
                self._idle = True
                self._cond.notify_all()
        return True

    def _close_pending(self) -> bool:
        """A close posted while a step ran (after the inbox was taken): the stepping thread applies it
        before it leaves, or its callers would wait for ever (a coroutine has no liveness poll)."""
        with self._lock:
            return any(kind == "close" for kind, _ in self._inbox)

    def _busy(self) -> bool:
        return bool(self._live)  # steps serve everything the engine holds, but only for a caller's sake

    def _adopt(self, submission: Submission) -> None:
        self._live[submission.id] = submission
        for index, request in enumerate(submission.requests):
            self._owner[id(request)] = (submission, index)

    def _admit(self, submission: Submission) -> None:
        self._adopt(submission)
        try:
            for index, request in enumerate(submission.requests):
                self.engine.add(request)
                if request.is_finished:  # rejected at once by admission control: tell the caller now
                    self._report(submission, index, request)
        except Exception as error:
            self._abort(submission, error)

    def _abort(self, submission: Submission, error: BaseException | None) -> None:
        """Abort a submission's unfinished requests (failing them with `error` if given) and report them."""
        for index, request in enumerate(submission.requests):
            if submission._sent[index] < 0:
                continue
            if not request.is_finished:
                self.engine.abort(request)
                if error is not None:
                    request.error, request.finish_reason = error, "error"
            self._report(submission, index, request)

    def _fail_all(self, error: BaseException) -> None:
        for submission in list(self._live.values()):
            self._abort(submission, error)

    def _step(self) -> None:
        engine = self.engine
        step_number = engine.num_steps
        try:
            finished = engine.step(draining=True)  # no caller ever waits for more to arrive
        except Exception as error:
            self._after_failed_step(error)
            return
        served: dict[int, Submission] = {}
        num_seqs = 0
        for request in itertools.chain(engine.scheduler.running, finished):
            owner = self._owner.get(id(request))
            if owner is None:
                continue
            submission, index = owner
            if request.is_finished or (
                submission.stream and len(request.output_token_ids) > submission._sent[index]
            ):
                self._report(submission, index, request)
            served[submission.id] = submission
            num_seqs += 1
        if served:
            threads = frozenset(s.thread for s in served.values())
            self.step_log.append(LoopStep(step_number, num_seqs, frozenset(served), threads))

    def _check_drained(self) -> None:
        """Cancels emptied the engine: ranks in lock step check that they all did (`Engine.sync_drain`).
        Its callers are gone; the other ranks' calls get the divergence."""
        try:
            self.engine.sync_drain()
        except RuntimeError as error:
            logger.warning("hfaccel: %s", error)

    def _after_failed_step(self, error: Exception) -> None:
        """A step raised. The engine fails that step's requests (finish_reason "error", `request.error`);
        report those. If it failed none of ours, fail the running ones (or, with none running, every
        request in flight) so that no caller waits on an engine that cannot progress."""
        failed = False
        for submission in list(self._live.values()):
            for index, request in enumerate(submission.requests):
                if submission._sent[index] >= 0 and request.is_finished:
                    if request.finish_reason == "error" and request.error is None:
                        request.error = error
                    self._report(submission, index, request)
                    failed = True
        if failed:
            return
        victims = [self._owner[id(r)] for r in self.engine.scheduler.running if id(r) in self._owner]
        if not victims:
            victims = [(s, i) for s in self._live.values() for i in range(len(s.requests)) if s._sent[i] >= 0]
        for submission, index in victims:
            request = submission.requests[index]
            self.engine.abort(request)
            request.error, request.finish_reason = error, "error"
            self._report(submission, index, request)

    def _report(self, submission: Submission, index: int, request: Request) -> None:
        """Send one request's news to its caller; a finished request is reported once, then forgotten."""
        sent = submission._sent[index]
        if sent < 0:
            return
        finished = request.is_finished
        tokens = tuple(request.output_token_ids[sent:]) if submission.stream else ()
        if finished:
            submission._sent[index] = -1
            submission._open -= 1
            self._owner.pop(id(request), None)
            if submission._open == 0:
                self._live.pop(submission.id, None)
        else:
            submission._sent[index] = sent + len(tokens)
        if submission._deaf:
            return
        update = Update(index, tokens, finished)
        if submission._event_loop is not None and self._outbox is not None:
            self._outbox.setdefault(submission._event_loop, []).append((submission, update))
            return
        try:
            submission._notify(update)
        except Exception:  # the caller's event loop is gone: nobody is listening any more
            submission._deaf = True
            self._abort(submission, error=None)

    def _send_held(self) -> None:
        outbox, self._outbox = self._outbox or {}, {}
        for event_loop, updates in outbox.items():
            try:
                event_loop.call_soon_threadsafe(_deliver, updates)
            except Exception:  # that event loop is closed: nobody is listening any more
                for submission, _ in updates:
                    submission._deaf = True  # so the abort below reports nothing to it
                    self._abort(submission, error=None)


def _deliver(updates: list[tuple[Submission, Update]]) -> None:
    """On a caller's event loop: each update into its submission's queue, in the loop's order."""
    for submission, update in updates:
        submission._queue.put_nowait(update)


def close_all_loops(reason: str = "every engine loop was closed", timeout: float | None = 10.0) -> None:
    """Stop every engine loop of this process and join its thread (see `EngineLoop.close`). A loop thread
    keeps its engine, and the engine's process groups, alive: call this before
    ``torch.distributed.destroy_process_group()`` (a gloo group torn down with its threads at interpreter
    exit can abort the process, docs/parallelism.md)."""
    for loop in list(_loops):
        loop.close(LoopClosed(reason), timeout=timeout)


@atexit.register
def _close_all_loops() -> None:
    """At interpreter exit, stop every loop thread before its engine is torn down."""
    close_all_loops("the interpreter is exiting", timeout=2.0)
    for thread in threading.enumerate():  # one leaving on its own may still free its engine: let it finish
        if thread.name == _THREAD_NAME and thread is not threading.current_thread():
            thread.join(2.0)
