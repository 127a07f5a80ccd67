"""EngineLoop: one background thread steps an engine for callers in many threads and event loops."""

import asyncio
import threading
import time

import pytest

from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.loop import EngineLoop, LoopClosed
from hfaccel.engine.request import StoppingParams
from tests.helpers import EOS, assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_loop(model, idle_timeout=1.0, **config):
    config = {"block_size": 8, "max_num_batched_tokens": 64, "kv_cache_memory": 2_000_000, **config}
    return EngineLoop(Engine(model, EngineConfig(**config)), idle_timeout=idle_timeout)


def requests_for(loop, prompts, max_new=12, eos=True):
    stop = StoppingParams(max_new_tokens=max_new, eos_token_ids=frozenset({EOS} if eos else ()))
    return [loop.engine.make_request(p, stop) for p in prompts]


def test_callers_in_many_threads_share_steps_and_get_their_own_results(model):
    loop = make_loop(model)
    prompts = varied_prompts(12)
    results, errors = {}, []

    def caller(k):
        try:
            mine = requests_for(loop, prompts[k::4], max_new=16)
            loop.run(mine)
            results[k] = mine
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for k, mine in results.items():
        for prompt, request in zip(prompts[k::4], mine):
            assert request.finish_reason in ("stop", "length")
            assert_same_or_near_tie(model, prompt, request.output_token_ids, hf_greedy(model, prompt, 16))
    assert any(len(step.threads) >= 2 for step in loop.step_log), "callers never shared a step"
    assert loop.wait_idle(5)
    assert loop.engine.block_manager.num_used_blocks == 0
    loop.close()


def test_a_late_caller_joins_the_running_batch(model):
    loop = make_loop(model)
    first = loop.submit(requests_for(loop, [[5, 6, 7]], max_new=40, eos=False), stream=True)
    updates = first.updates()
    next(updates)  # the first request is generating
    late = requests_for(loop, [[9, 10, 11, 12]], max_new=4, eos=False)
    loop.run(late)
    assert len(late[0].output_token_ids) == 4
    assert not first.requests[0].is_finished, "the late caller did not wait for the first one to finish"
    assert any(len(step.submissions) == 2 for step in loop.step_log)
    for _ in updates:
        pass
    assert len(first.requests[0].output_token_ids) == 40
    loop.close()


def test_streaming_updates_carry_every_token_once(model):
    loop = make_loop(model)
    requests = requests_for(loop, varied_prompts(3), max_new=10, eos=False)
    received = [[] for _ in requests]
    finished = []
    for update in loop.submit(requests, stream=True).updates():
        received[update.index].extend(update.token_ids)
        if update.finished:
            finished.append(update.index)
    assert sorted(finished) == [0, 1, 2]
    assert received == [r.output_token_ids for r in requests]
    loop.close()


def test_cancel_frees_blocks_before_the_next_step_and_others_go_on(model):
    loop = make_loop(model)
    stay = requests_for(loop, [[3, 4, 5]], max_new=30, eos=False)
    staying = loop.submit(stay)
    leaving = loop.submit(requests_for(loop, [list(range(3, 40))], max_new=30, eos=False), stream=True)
    updates = leaving.updates()
    next(updates)
    updates.close()  # the consumer stops: its request is cancelled, and close() waits for it
    request = leaving.requests[0]
    assert request.finish_reason == "abort" and not request.block_ids
    assert not loop.engine.holds(request)
    staying.wait()
    assert len(stay[0].output_token_ids) == 30
    assert loop.wait_idle(5) and loop.engine.block_manager.num_used_blocks == 0
    loop.close()


def test_a_failing_step_fails_only_its_requests(model, monkeypatch):
    loop = make_loop(model, max_num_seqs=2)
    engine = loop.engine
    real_run = engine.runner.run
    calls = []

    def run_once_failing(packed):
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real_run(packed)

    monkeypatch.setattr(engine.runner, "run", run_once_failing)
    doomed = loop.submit(requests_for(loop, [[3, 4, 5], [6, 7, 8]], max_new=8))  # fills the first step
    spared_requests = requests_for(loop, [[9, 10], [11, 12, 13]], max_new=8)
    spared = loop.submit(spared_requests)  # waits: max_num_seqs=2
    with pytest.raises(RuntimeError, match="injected step failure"):
        doomed.wait()
    assert {r.finish_reason for r in doomed.requests} == {"error"}
    assert all(isinstance(r.error, RuntimeError) for r in doomed.requests)
    spared.wait()
    for prompt, request in zip([[9, 10], [11, 12, 13]], spared_requests):
        assert_same_or_near_tie(model, prompt, request.output_token_ids, hf_greedy(model, prompt, 8))
    later = requests_for(loop, [[3, 4, 5]], max_new=8)
    loop.run(later)
    assert later[0].finish_reason in ("stop", "length")
    assert loop.wait_idle(5) and engine.block_manager.num_used_blocks == 0
    loop.close()


def test_the_thread_exits_when_idle_and_restarts_on_the_next_submit(model):
    loop = make_loop(model, idle_timeout=0.1)
    assert not loop.is_running
    loop.run(requests_for(loop, [[3, 4, 5]], max_new=3))
    assert loop.is_running or loop.wait_idle(1)
    deadline = time.monotonic() + 5
    while loop.is_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not loop.is_running, "the idle loop thread did not exit"
    again = requests_for(loop, [[3, 4, 5]], max_new=3)
    loop.run(again)
    assert len(again[0].output_token_ids) == 3
    loop.close()


def test_close_fails_requests_in_flight_and_refuses_new_ones(model):
    loop = make_loop(model)
    submission = loop.submit(requests_for(loop, [[3, 4, 5]], max_new=200, eos=False), stream=True)
    updates = submission.updates()
    next(updates)
    loop.close(LoopClosed("released for the test"))
    with pytest.raises(LoopClosed, match="released for the test"):
        for _ in updates:
            pass
    assert not loop.is_running
    assert loop.engine.block_manager.num_used_blocks == 0
    with pytest.raises(LoopClosed):
        loop.submit(requests_for(loop, [[3, 4]], max_new=2))


def test_close_says_whether_a_step_of_the_loop_may_still_run(model):
    """True once no step runs (what a release waits for before it unwraps a recurrent model's mixers);
    False when asked from inside one of the loop's own steps."""
    loop = make_loop(model)
    inside = []

    def closing(prompt, output):  # a stop check: runs inside the step
        return inside.append(loop.close()) or False

    stop = StoppingParams(max_new_tokens=3, stop_check=closing)
    with pytest.raises(LoopClosed):
        loop.submit([loop.engine.make_request([3, 4, 5], stop)]).wait()
    assert inside == [False]
    assert make_loop(model).close() is True


def test_coroutines_are_served_by_the_same_loop(model):
    loop = make_loop(model)
    prompts = varied_prompts(6)

    async def one(prompt):
        requests = requests_for(loop, [prompt], max_new=10)
        await loop.submit_async(requests).await_all()
        return requests[0].output_token_ids

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    outputs = asyncio.run(main())
    for prompt, output in zip(prompts, outputs):
        assert_same_or_near_tie(model, prompt, output, hf_greedy(model, prompt, 10))
    loop.close()


def test_one_wakeup_per_event_loop_and_step_however_many_streams_it_holds(model):
    """Eight streaming coroutines on one event loop: the loop thread hands their updates over in one
    ``call_soon_threadsafe`` a step (a call per stream cost a wake-up and a GIL hand-off each), in
    order, and every stream gets each of its tokens."""
    loop = make_loop(model, max_num_seqs=8)
    prompts = varied_prompts(8)
    calls = []

    async def main():
        event_loop = asyncio.get_running_loop()
        original = event_loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            calls.append(threading.get_ident())
            return original(callback, *args, **kwargs)

        event_loop.call_soon_threadsafe = counted

        async def one(prompt):
            requests = requests_for(loop, [prompt], max_new=10)
            tokens = []
            async for update in loop.submit_async(requests, stream=True).aupdates():
                tokens += update.token_ids
            assert tokens == requests[0].output_token_ids
            return tokens

        return await asyncio.gather(*(one(p) for p in prompts))

    outputs = asyncio.run(main())
    for prompt, output in zip(prompts, outputs):
        assert_same_or_near_tie(model, prompt, output, hf_greedy(model, prompt, 10))
    steps = len(loop.step_log)
    loop_calls = [c for c in calls if c != threading.get_ident()]
    assert steps >= 10 and len(loop_calls) <= steps + 1, (steps, len(loop_calls))  # it was 8 a step
    loop.close()


def test_a_coroutines_cancel_is_answered_before_the_next_step_runs(model):
    """Updates held for the step's one wake-up do not hold back a cancel's: the cancelled stream hears
    its end at most one step after it asked (the step running then), not after the next one too."""
    loop = make_loop(model)
    steps_done = []
    step = loop.engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.2)
        result = step(*args, **kwargs)
        steps_done.append(time.monotonic())
        return result

    loop.engine.step = slow_step

    async def main():
        streams = [
            loop.submit_async(requests_for(loop, [[3, 4, 5 + i]], max_new=40, eos=False), stream=True)
            for i in range(2)
        ]
        other = asyncio.ensure_future(streams[1].await_all())
        updates = streams[0].aupdates()
        await anext(updates)  # the stream runs
        streams[0].cancel()
        before = len(steps_done)
        async for update in updates:
            if update.finished:
                break
        after = len(steps_done)
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        return after - before

    steps_between = asyncio.run(main())
    assert steps_between <= 1, steps_between  # 2 when a cancel's news waited for the next step's end
    assert loop.wait_idle(5)
    assert loop.engine.block_manager.num_used_blocks == 0
    loop.close()


def test_a_close_during_a_step_fails_a_coroutines_stream_instead_of_leaving_it_waiting(model):
    """The close lands while the loop thread is inside a step (after it took the inbox): the thread
    applies it before leaving, so the coroutine gets LoopClosed and the blocks come back (it waited for
    ever: a coroutine has no liveness poll, found by a probe)."""
    loop = make_loop(model)
    step = loop.engine.step
    in_step = threading.Event()

    def slow_step(*args, **kwargs):
        in_step.set()
        time.sleep(0.2)
        return step(*args, **kwargs)

    loop.engine.step = slow_step

    async def main():
        requests = requests_for(loop, [[3, 4, 5]], max_new=40, eos=False)
        updates = loop.submit_async(requests, stream=True).aupdates()
        await anext(updates)
        in_step.clear()
        await asyncio.to_thread(in_step.wait, 5)
        closer = threading.Thread(target=loop.close)
        closer.start()
        with pytest.raises(LoopClosed):
            async with asyncio.timeout(10):
                async for _ in updates:
                    pass
        closer.join(10)

    asyncio.run(main())
    assert not loop.is_running
    assert loop.engine.block_manager.num_used_blocks == 0


def test_a_caller_whose_event_loop_is_gone_is_cancelled(model):
    loop = make_loop(model)
    requests = requests_for(loop, [[3, 4, 5]], max_new=200, eos=False)
    event_loop = asyncio.new_event_loop()

    async def start():
        return loop.submit_async(requests, stream=True)

    event_loop.run_until_complete(start())
    event_loop.close()  # nobody will ever read its updates
    assert loop.wait_idle(5)
    assert requests[0].finish_reason == "abort"
    assert loop.engine.block_manager.num_used_blocks == 0
    loop.close()


def test_engine_stream_refuses_a_request_it_does_not_hold(model):
    engine = Engine(model, EngineConfig(kv_cache_memory=1_000_000))
    other = Engine(model, EngineConfig(kv_cache_memory=1_000_000))
    stop = StoppingParams(max_new_tokens=3)
    never_queued = engine.make_request([3, 4, 5], stop)
    with pytest.raises(ValueError, match="not queued on this engine"):
        next(engine.stream(never_queued))
    elsewhere = other.add_request([3, 4, 5], stop)
    with pytest.raises(ValueError, match="not queued on this engine"):
        next(engine.stream(elsewhere))
    assert len(list(other.stream(elsewhere))) == 3


def test_a_lone_caller_steps_in_its_own_thread_and_a_second_caller_hands_over_to_the_loop_thread(model):
    """A torch op costs several times more in a second thread running parallel regions (two OpenMP
    pools on few cores stop spinning): a caller alone steps its requests itself, and no loop thread
    starts; once another caller's requests join, the loop thread steps for both, and both finish."""
    stepping = []
    hook = model.register_forward_hook(lambda *args: stepping.append(threading.current_thread()))
    try:
        loop = make_loop(model)
        mine = requests_for(loop, varied_prompts(3, seed=2), max_new=8)
        loop.run(mine)
        assert set(stepping) == {threading.current_thread()} and not loop.is_running
        assert all(r.finish_reason in ("stop", "length") for r in mine)
        stepping.clear()
        first = loop.submit(requests_for(loop, varied_prompts(2, seed=3), max_new=40, eos=False))
        second = loop.submit(requests_for(loop, varied_prompts(2, seed=4), max_new=8))
        first.wait()
        second.wait()
        assert {t.name for t in stepping} == {"hfaccel-engine-loop"}
        assert not loop.engine.has_unfinished_requests()
        assert loop.engine.block_manager.num_used_blocks == 0  # no block leaks
    finally:
        hook.remove()


def test_step_here_makes_the_calling_thread_step_for_every_caller(model):
    """`hfaccel serve`'s main thread steps for the HTTP server's callers (`EngineLoop.step_here`): a
    coroutine's and a thread's submissions are stepped by it, and it returns when told to."""
    loop = make_loop(model)
    stepping, done = set(), threading.Event()
    hook = model.register_forward_hook(lambda *args: stepping.add(threading.current_thread().name))
    results = {}

    def callers():
        async def coroutine():
            mine = requests_for(loop, varied_prompts(2, seed=7), max_new=6)
            await loop.submit_async(mine).await_all()
            return mine

        results["async"] = asyncio.run(coroutine())
        mine = requests_for(loop, varied_prompts(2, seed=8), max_new=6)
        loop.run(mine)
        results["thread"] = mine
        done.set()

    worker = threading.Thread(target=callers, name="caller")
    try:
        stepper = threading.Thread(target=loop.step_here, args=(done.is_set,), name="stepper")
        stepper.start()
        deadline = time.monotonic() + 10
        while loop._thread is not stepper and time.monotonic() < deadline:  # registered before callers come
            time.sleep(0.01)
        worker.start()
        worker.join(60)
        stepper.join(10)
    finally:
        hook.remove()
    assert not stepper.is_alive() and not worker.is_alive()
    assert stepping == {"stepper"}
    assert all(r.finish_reason in ("stop", "length") for rs in results.values() for r in rs)
    with pytest.raises(RuntimeError, match="already has a stepping thread"):
        loop._thread = threading.current_thread()
        loop.step_here(lambda: True)


def test_a_stream_read_on_in_another_thread_completes(model):
    """A streamed submission read partly in one thread and on in another (Starlette's threadpool does
    that): the second thread steps it (or has the loop thread step it), and it completes at once."""
    loop = make_loop(model)
    [request] = requests_for(loop, varied_prompts(3, seed=9)[2:], max_new=12, eos=False)
    updates = loop.submit([request], stream=True).updates()
    first = next(updates)
    box = {}
    reader = threading.Thread(target=lambda: box.setdefault("rest", list(updates)))
    start = time.monotonic()
    reader.start()
    reader.join(30)
    assert not reader.is_alive() and time.monotonic() - start < 5
    tokens = [t for u in [first, *box["rest"]] for t in u.token_ids]
    assert tokens == request.output_token_ids and len(tokens) == 12


def test_a_driver_never_steps_a_submission_that_arrived_before_its_step(model):
    """The check that a driving caller is alone and its taking of the inbox are one: a second caller's
    submission posted before the driver's next step makes it hand over to the loop thread instead."""
    loop = make_loop(model)
    mine = loop.submit(requests_for(loop, varied_prompts(2, seed=10), max_new=6))
    theirs = loop.submit(requests_for(loop, varied_prompts(2, seed=11), max_new=6))
    with loop._baton:
        assert loop._work(driver=mine) is False  # handed over: nothing applied, nothing stepped
        assert len(loop._inbox) == 2 and loop.engine.num_steps == 0
    mine.wait()
    theirs.wait()
    assert loop.is_running or loop.engine.num_steps > 0
    assert not loop.engine.has_unfinished_requests() and loop.engine.block_manager.num_used_blocks == 0


_COLLECTED_INSIDE_THE_LOCK = """
import asyncio, gc, threading
import hfaccel
from tests.helpers import tiny_model

model = hfaccel.patch(tiny_model())
busy = threading.Thread(
    target=lambda: asyncio.run(hfaccel.agenerate(model, [[9] * 10], max_new_tokens=300, min_new_tokens=300))
)
busy.start()  # a coroutine caller: the loop's own thread steps
stream = hfaccel.stream(model, [[5] * 10], max_new_tokens=300, min_new_tokens=300)
next(stream)
cycle = {"stream": stream}
cycle["self"] = cycle  # only the collector frees it
del stream, cycle
loop = model._hfaccel.loop
with loop._cond:
    gc.collect()
busy.join(60)
assert loop.wait_idle(10) and model._hfaccel.engine.block_manager.num_used_blocks == 0
hfaccel.unpatch(model)
print("done")
"""


def test_an_abandoned_stream_collected_inside_the_loops_lock_does_not_wait_for_the_loop():
    """The garbage collector may close an abandoned stream inside any allocation, one in the loop's own
    locked sections included: its cleanup then cancels without waiting (the loop needs that lock). In a
    process of its own: the deadlock this guards against would hang the interpreter's exit."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    try:
        result = subprocess.run(
            [sys.executable, "-c", _COLLECTED_INSIDE_THE_LOCK],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the collector's thread waited for the loop while holding its lock")
    assert result.returncode == 0 and "done" in result.stdout, result.stderr[-2000:]


def test_a_ctrl_c_as_a_caller_takes_the_loops_lock_leaves_it_free():
    """A KeyboardInterrupt raised in the main thread just as it takes the loop's lock (another thread held
    it, then the signal came): the lock is released with the exception, and a later call from another
    thread completes (the lock was held for good, every later caller hung)."""
    import _thread

    import torch

    import hfaccel

    model = hfaccel.patch(tiny_model())
    ids = torch.tensor([[5, 6, 7, 8]])
    model.generate(ids, max_new_tokens=2, do_sample=False)  # the engine and its loop
    loop = model._hfaccel.loop

    def hold_then_interrupt() -> None:
        with loop._lock:  # as the loop thread holds it around a step's bookkeeping
            time.sleep(0.3)  # the main thread now waits for it in its submission
        _thread.interrupt_main()

    threading.Thread(target=hold_then_interrupt).start()
    time.sleep(0.05)
    with pytest.raises(KeyboardInterrupt):
        model.generate(ids, max_new_tokens=200, min_new_tokens=200, do_sample=False)
        time.sleep(5)  # (the interrupt may land after the call: it must still land here)
    later: dict = {}
    thread = threading.Thread(
        target=lambda: later.update(out=model.generate(ids, max_new_tokens=3)), daemon=True
    )
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "a later caller hangs on the loop's lock"
    assert later["out"].shape == (1, 7)
    hfaccel.unpatch(model)


def test_a_prefix_cache_reset_never_runs_beside_a_step_and_never_waits(monkeypatch):
    """`hfaccel.reset_prefix_cache` while a step registers blocks (from another thread) is applied by
    the stepping thread at its next step's check, before that step admits: the request admitted before
    it registers nothing (it reset the cache in the middle of a registration, which went on into the new
    cache). It never waits for a step: from a logits processor, sync or with asynchronous scheduling
    (the processor then runs on the step's worker thread), the call completes."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    import hfaccel
    from hfaccel.engine.block_manager import BlockManager

    model = hfaccel.patch(tiny_model())
    prompt = torch.tensor([varied_prompts(1)[0][:8] * 5])
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)  # the engine
    engine, original, resets = model._hfaccel.engine, BlockManager.cache_full_blocks, []

    def registering(self, request) -> None:
        if not resets:
            resets.append(threading.Thread(target=hfaccel.reset_prefix_cache, args=(model,)))
            resets[0].start()
            resets[0].join(10)
            assert not resets[0].is_alive(), "the reset must not wait for the step"
            assert engine.block_manager.epoch == 0, "nor run beside it"
        original(self, request)

    monkeypatch.setattr(BlockManager, "cache_full_blocks", registering)
    model.generate(prompt, max_new_tokens=4, do_sample=False)
    monkeypatch.undo()
    assert engine.block_manager.epoch == 1 and engine.block_manager.num_cached_blocks == 0

    class Resetting(LogitsProcessor):
        def __call__(self, input_ids, scores):
            hfaccel.reset_prefix_cache(model)
            return scores

    for asynchronous in (False, True):
        hfaccel.patch(model, async_scheduling=asynchronous)
        done: dict = {}
        processors = LogitsProcessorList([Resetting()])
        thread = threading.Thread(
            target=lambda box=done, processors=processors: box.update(
                out=model.generate(prompt, max_new_tokens=3, logits_processor=processors)
            ),
            daemon=True,
        )
        thread.start()
        thread.join(30)
        assert not thread.is_alive() and done["out"].shape == (1, prompt.shape[1] + 3), asynchronous
    hfaccel.unpatch(model)


def test_a_submit_refused_inside_another_loops_step_leaves_no_wait_behind(model):
    """A call from inside a step of loop A to a closed loop B raises; the wait on B noted for cycle
    detection goes with it (a stale one would refuse a later call from inside B's step to A as a cycle)."""
    from hfaccel.engine import loop as loop_module
    from hfaccel.engine.submission import this_thread

    stepping, closed = make_loop(model), make_loop(model)
    closed.close(LoopClosed("closed for the test"))
    this_thread.loop = stepping  # as inside `stepping`'s step
    try:
        with pytest.raises(LoopClosed):
            closed.submit(requests_for(closed, [[3, 4]], max_new=2))
        assert id(stepping) not in loop_module._waits
        this_thread.loop = closed  # inside `closed`'s step: calling `stepping` is no cycle
        assert stepping.reentry_reason() is None
    finally:
        this_thread.loop = None
