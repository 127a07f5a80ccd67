"""Many callers on one patched model: threads, streamers, asyncio, interrupts, failures, rebuilds."""

import asyncio
import random
import signal
import threading
import time
import warnings

import pytest
import torch
from transformers import TextIteratorStreamer

import hfaccel
from hfaccel.engine.loop import LoopClosed
from tests.helpers import (
    PAD,
    assert_same_or_near_tie,
    hf,
    hf_greedy,
    tiny_model,
    tiny_tokenizer,
    varied_prompts,
)

MAX_NEW = 12


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, width


def run_threads(targets):
    """Run each callable in its own thread; return the exceptions they raised."""
    errors = []

    def guard(target):
        try:
            target()
        except BaseException as error:  # noqa: BLE001 - collected and asserted on
            errors.append(error)

    threads = [threading.Thread(target=guard, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a caller thread hung"
    return errors


def assert_idle_and_clean(model):
    loop = model._hfaccel.loop
    assert loop.wait_idle(10), "the loop never went idle"
    engine = loop.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0, "a KV block leaked"


def test_eight_threads_of_mixed_calls_match_their_solo_results():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    tokenizer = tiny_tokenizer()
    prompts = varied_prompts(24, seed=5)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    checks = []  # (prompt, ours, ref)
    sampled_shapes = []

    def caller(k):
        mine = list(range(k * 3, k * 3 + 3))
        # 1. model.generate on a left-padded batch of two prompts (greedy).
        ids, mask, width = left_pad([prompts[mine[0]], prompts[mine[1]]])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
        for row, i in enumerate(mine[:2]):
            new = out[row, width:].tolist()
            checks.append((prompts[i], new[: len(refs[i])], refs[i]))
        # 2. hfaccel.generate (greedy).
        completion = hfaccel.generate(model, [prompts[mine[2]]], max_new_tokens=MAX_NEW, progress=False)[0]
        checks.append((prompts[mine[2]], completion.token_ids, refs[mine[2]]))
        # 3. A TextIteratorStreamer fed by its own generate thread (greedy), read here.
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        prompt = prompts[mine[0]]
        producer = threading.Thread(
            target=model.generate,
            kwargs={"inputs": torch.tensor([prompt]), "max_new_tokens": MAX_NEW, "streamer": streamer},
        )
        producer.start()
        text = "".join(streamer)
        producer.join()
        checks.append(("text", text, tokenizer.decode(refs[mine[0]])))
        # 4. Sampled calls, through both entry points.
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=True, top_k=20)
        sampled_shapes.append(out.shape[1] - len(prompt))
        hfaccel.generate(
            model, [prompt], max_new_tokens=MAX_NEW, do_sample=True, temperature=0.7, progress=False
        )

    errors = run_threads([lambda k=k: caller(k) for k in range(8)])
    assert not errors, errors
    for prompt, ours, ref in checks:
        if prompt == "text":
            assert ours == ref
        else:
            assert_same_or_near_tie(model, prompt, ours, ref)
    assert all(0 < n <= MAX_NEW for n in sampled_shapes)
    loop = model._hfaccel.loop
    shared = [step for step in loop.step_log if len(step.threads) >= 2]
    assert shared, "requests of different threads never shared a step"
    assert max(step.num_seqs for step in loop.step_log) > 3, "no step served more than one caller's call"
    assert_idle_and_clean(model)


def test_thirty_two_coroutines_arriving_at_random_times_match_greedy():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    prompts = varied_prompts(32, seed=11)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.2) for _ in prompts]

    async def one(prompt, delay):
        await asyncio.sleep(delay)
        return (await hfaccel.agenerate(model, [prompt], max_new_tokens=MAX_NEW))[0]

    async def main():
        return await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays)))

    completions = asyncio.run(main())
    for prompt, completion, ref in zip(prompts, completions, refs):
        assert_same_or_near_tie(model, prompt, completion.token_ids, ref)
    assert any(len(step.submissions) >= 2 for step in model._hfaccel.loop.step_log)
    assert_idle_and_clean(model)


def test_astream_gives_the_events_of_stream_and_a_cancelled_task_cancels_its_requests():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    prompts = varied_prompts(3, seed=2)
    expected = [(e.index, e.token_id, e.finished) for e in hfaccel.stream(model, prompts, max_new_tokens=6)]

    async def collect():
        return [
            (e.index, e.token_id, e.finished) async for e in hfaccel.astream(model, prompts, max_new_tokens=6)
        ]

    got = asyncio.run(collect())
    assert sorted(got) == sorted(expected)

    async def cancelled():
        task = asyncio.create_task(
            hfaccel.agenerate(model, [[5] * 20], max_new_tokens=400, min_new_tokens=400)
        )
        while not model._hfaccel.loop.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert_idle_and_clean(model)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_ctrl_c_in_a_waiting_caller_cancels_only_its_requests():
    # Python's own Ctrl-C handler, whatever this process inherited (a shell starts background jobs with
    # SIGINT ignored, and Python then leaves it ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_in_a_waiting_caller()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_in_a_waiting_caller():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    prompts = varied_prompts(6, seed=7)
    refs = [hf_greedy(model, p, 30) for p in prompts]
    outputs = {}

    def other(i):
        out = model.generate(torch.tensor([prompts[i]]), max_new_tokens=30, do_sample=False)
        outputs[i] = out[0, len(prompts[i]) :].tolist()

    long_prompt = [7] * 30
    state = model._hfaccel

    def long_one_running():
        loop = state.loop
        try:
            return loop is not None and any(
                r.prompt_token_ids == long_prompt for r in list(loop.engine.scheduler.running)
            )
        except RuntimeError:  # the batch changed while it was read: look again
            return long_one_running()

    def interrupt_when_running():
        # Once it runs, Ctrl-C; again if it still runs a second later (the first was not taken: a loaded
        # machine once let the whole request finish around it), at most three times.
        deadline, sent = time.monotonic() + 30, 0
        while time.monotonic() < deadline and sent < 3:
            if long_one_running():
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                sent += 1
                time.sleep(1.0)
            elif sent:  # taken: the request is cancelled
                return
            time.sleep(0.005)

    workers = [threading.Thread(target=other, args=(i,)) for i in range(len(prompts))]
    interrupter = threading.Thread(target=interrupt_when_running)
    interrupter.start()
    for worker in workers:
        worker.start()
    with pytest.raises(KeyboardInterrupt):  # a notebook cell interrupt is this, in the kernel's main thread
        model.generate(torch.tensor([long_prompt]), max_new_tokens=450, min_new_tokens=450)
    interrupter.join()
    for worker in workers:
        worker.join(60)
    for i, prompt in enumerate(prompts):
        assert_same_or_near_tie(model, prompt, outputs[i], refs[i])
    assert_idle_and_clean(model)
    out = model.generate(torch.tensor([prompts[0]]), max_new_tokens=30, do_sample=False)  # still serving
    assert_same_or_near_tie(model, prompts[0], out[0, len(prompts[0]) :].tolist(), refs[0])


def test_a_streamer_that_raises_cancels_its_request_and_the_others_finish():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    prompts = varied_prompts(4, seed=9)
    refs = [hf_greedy(model, p, 20) for p in prompts]
    outputs = {}

    class StopAfterThree:
        def __init__(self):
            self.tokens = 0
            self.ended = False

        def put(self, value):
            if value.dim() == 1:
                self.tokens += 1
                if self.tokens == 3:
                    raise KeyboardInterrupt  # the consumer gives up while the caller waits for tokens

        def end(self):
            self.ended = True

    streamer = StopAfterThree()

    def stopping():
        with pytest.raises(KeyboardInterrupt):
            model.generate(
                torch.tensor([[9] * 12]), max_new_tokens=300, min_new_tokens=300, streamer=streamer
            )

    def other(i):
        out = model.generate(torch.tensor([prompts[i]]), max_new_tokens=20, do_sample=False)
        outputs[i] = out[0, len(prompts[i]) :].tolist()

    errors = run_threads([stopping] + [lambda i=i: other(i) for i in range(len(prompts))])
    assert not errors, errors
    assert streamer.ended and streamer.tokens == 3
    engine = model._hfaccel.engine
    assert engine.num_generated_tokens < 300, "the abandoned request ran to the end"
    for i, prompt in enumerate(prompts):
        assert_same_or_near_tie(model, prompt, outputs[i], refs[i])
    assert_idle_and_clean(model)


def test_a_failing_step_raises_in_its_caller_and_the_model_keeps_serving(monkeypatch):
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    engine = model._hfaccel.get_engine(model)
    real_run = engine.runner.run
    failures = [RuntimeError("injected: the device fell over")]

    def run(packed):
        if failures:
            raise failures.pop()
        return real_run(packed)

    monkeypatch.setattr(engine.runner, "run", run)
    with pytest.raises(RuntimeError, match="the device fell over"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    assert out[0, 3:].tolist() == hf_greedy(model, [5, 6, 7], 5)
    assert_idle_and_clean(model)


def test_a_rebuilt_engine_does_not_leave_its_callers_hanging():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    model.generate(torch.tensor([[5, 6]]), max_new_tokens=2)  # build the float32 engine
    old_loop = model._hfaccel.loop
    raised = []

    def long_call():
        try:
            model.generate(torch.tensor([[5] * 10]), max_new_tokens=450, min_new_tokens=450)
        except Exception as error:  # noqa: BLE001 - asserted below
            raised.append(error)

    caller = threading.Thread(target=long_call)
    caller.start()
    while not old_loop.engine.has_unfinished_requests():
        time.sleep(0.005)
    model.to(torch.float64)  # the next call rebuilds the engine for float64
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    caller.join(30)
    assert not caller.is_alive(), "the caller of the old engine hangs"
    # The old loop is closed (LoopClosed), or, where it stepped between `to` and the rebuild, that step
    # failed on the new dtype (the kernel's ValueError, seen once on a busy machine): either way it raised.
    assert len(raised) == 1 and isinstance(raised[0], (LoopClosed, RuntimeError, ValueError)), raised
    assert model._hfaccel.engine.model_dtype == torch.float64 and out.shape == (1, 7)
    assert old_loop.engine.block_manager.num_used_blocks == 0 and not old_loop.is_running


def test_concurrent_generate_calls_on_an_unpatched_model_share_one_temporary_patch():
    model = tiny_model()
    prompts = varied_prompts(6, seed=4)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    results = {}

    def call(i):
        results[i] = hfaccel.generate(model, [prompts[i]], max_new_tokens=MAX_NEW, progress=False)[
            0
        ].token_ids

    errors = run_threads([lambda i=i: call(i) for i in range(len(prompts))])
    assert not errors, errors
    for i, prompt in enumerate(prompts):
        assert_same_or_near_tie(model, prompt, results[i], refs[i])
    assert not hfaccel.api.is_patched(model) and "generate" not in model.__dict__


def test_unpatch_stops_the_loop_and_fails_what_is_in_flight():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    raised = []

    def long_call():
        try:
            hfaccel.generate(model, [[5] * 10], max_new_tokens=450, min_new_tokens=450, progress=False)
        except LoopClosed as error:
            raised.append(error)

    caller = threading.Thread(target=long_call)
    caller.start()
    while model._hfaccel.loop is None or not model._hfaccel.loop.engine.has_unfinished_requests():
        time.sleep(0.005)
    loop = model._hfaccel.loop
    hfaccel.unpatch(model)
    caller.join(30)
    assert not caller.is_alive() and len(raised) == 1
    assert "unpatch" in str(raised[0])
    assert not loop.is_running and loop.engine.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_threads_on_smollm2_match_hf_greedy(smollm2):
    model, tokenizer = smollm2
    questions = ["What is 2+2?", "Name a fruit.", "Say hello.", "What colour is the sky?"]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in questions
    ]
    refs = [hf_greedy(model, p, 8) for p in prompts]
    outputs = {}
    hfaccel.patch(model)
    try:

        def call(i):
            if i % 2:
                outputs[i] = hfaccel.generate(model, [prompts[i]], max_new_tokens=8, progress=False)[
                    0
                ].token_ids
            else:
                out = model.generate(torch.tensor([prompts[i]]), max_new_tokens=8, do_sample=False)
                outputs[i] = out[0, len(prompts[i]) :].tolist()

        errors = run_threads([lambda i=i: call(i) for i in range(len(prompts))])
        assert not errors, errors
        for i, prompt in enumerate(prompts):
            assert_same_or_near_tie(model, prompt, outputs[i], refs[i], eps=1e-3)
        assert any(len(step.threads) >= 2 for step in model._hfaccel.loop.step_log)
        assert_idle_and_clean(model)
    finally:
        hfaccel.unpatch(model)


def test_the_interpreter_exits_cleanly_with_a_request_in_flight():
    script = """
import threading, time, torch
import hfaccel
from tests.helpers import tiny_model
model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
def call():
    try:
        model.generate(torch.tensor([[5] * 10]), max_new_tokens=450, min_new_tokens=450)
    except hfaccel.LoopClosed:
        print("caller released")
threading.Thread(target=call, daemon=True).start()
while model._hfaccel.loop is None or not model._hfaccel.loop.engine.has_unfinished_requests():
    time.sleep(0.01)
loop = model._hfaccel.loop
print("exiting")
"""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout
    assert "Fatal" not in done.stderr and "Traceback" not in done.stderr, done.stderr


class _CallsGenerate:
    """A stopping criterion that runs `action` once, on the engine loop thread, then never stops."""

    def __init__(self, action):
        self.action, self.result = action, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.result is None:
            try:
                self.result = ("ok", self.action())
            except BaseException as error:
                self.result = ("raised", error)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _joined(target, timeout=60):
    """Run `target` in a thread; its (status, value), or ("hung", None) after `timeout` seconds."""
    box = {}

    def run():
        try:
            box["value"] = ("ok", target())
        except BaseException as error:
            box["value"] = ("raised", error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return box.get("value", ("hung", None))


def test_generate_from_inside_the_models_own_step_completes_on_transformers():
    """A criterion that generates on its own model: the inner call would wait for the step waiting for it,
    so it runs on transformers (HF's tokens, a warning), and both complete; the loop then still serves."""
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    ids = torch.tensor([[5, 6, 7]])
    inner = _CallsGenerate(lambda: model.generate(ids, max_new_tokens=2, do_sample=False))
    with pytest.warns(UserWarning, match="a generate call from inside an engine step"):
        status, _ = _joined(
            lambda: model.generate(ids, max_new_tokens=4, do_sample=False, stopping_criteria=[inner])
        )
    assert status == "ok"
    assert inner.result[0] == "ok" and inner.result[1][0, 3:].tolist() == hf_greedy(model, [5, 6, 7], 2)
    assert _joined(lambda: model.generate(ids, max_new_tokens=3, do_sample=False))[0] == "ok"
    direct = _CallsGenerate(lambda: model._hfaccel.loop.submit([]))  # the loop itself refuses such a call
    assert (
        _joined(lambda: model.generate(ids, max_new_tokens=2, do_sample=False, stopping_criteria=[direct]))[0]
        == "ok"
    )
    assert direct.result[0] == "raised" and "from inside its own engine step" in str(direct.result[1])


def test_two_models_whose_callbacks_generate_on_each_other_all_complete():
    """A's criterion calls B.generate from A's step; B's criterion then calls A.generate from B's step,
    which would wait on A's step, which waits on B's: that call runs on transformers, and everything
    returns within the deadline. A call that closes no cycle (B's first criterion) is served."""
    a = hfaccel.patch(tiny_model(seed=1), kv_cache_memory=4_000_000)
    b = hfaccel.patch(tiny_model(seed=2), kv_cache_memory=4_000_000)
    ids = torch.tensor([[5, 6, 7]])
    back_to_a = _CallsGenerate(lambda: a.generate(ids, max_new_tokens=2, do_sample=False))
    to_b = _CallsGenerate(
        lambda: b.generate(ids, max_new_tokens=3, do_sample=False, stopping_criteria=[back_to_a])
    )
    status, _ = _joined(lambda: a.generate(ids, max_new_tokens=4, do_sample=False, stopping_criteria=[to_b]))
    assert status == "ok"
    assert to_b.result[0] == "ok"  # B served A's callback
    # The loops would wait on each other (a loop thread steps A), or, where the caller's own thread steps
    # A and then B within A's step, it is a call from inside A's own step: transformers serves it.
    assert back_to_a.result[0] == "ok" and back_to_a.result[1][0, 3:].tolist() == hf_greedy(a, [5, 6, 7], 2)
    for model in (a, b):  # both loops still serve
        assert _joined(lambda m=model: m.generate(ids, max_new_tokens=3, do_sample=False))[0] == "ok"


def test_a_stream_closed_on_the_loop_thread_does_not_wait_for_the_loop():
    # The garbage collector closes an abandoned stream (in a reference cycle) on whichever thread it
    # collects, the engine loop's included: its cleanup must not wait for the loop, which is itself.
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    stream = hfaccel.stream(model, [[5] * 8], max_new_tokens=300, min_new_tokens=300)
    next(stream)
    closer = _CallsGenerate(stream.close)
    ids = torch.tensor([[4, 4, 4]])
    status, _ = _joined(
        lambda: model.generate(ids, max_new_tokens=6, do_sample=False, stopping_criteria=[closer])
    )
    assert status == "ok" and closer.result[0] == "ok"
    assert model._hfaccel.loop.wait_idle(10) and model._hfaccel.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_a_base_exception_from_one_callers_criterion_fails_that_caller_alone(error):
    # Off the main thread no Ctrl-C lands: a KeyboardInterrupt there is the callback's own doing.
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    prompts = varied_prompts(4)

    def bad(input_ids, scores, **kwargs):
        if input_ids.shape[1] > 6:
            raise error("from a criterion")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    results = {}
    threads = [
        threading.Thread(
            target=lambda i=i, p=p: results.__setitem__(
                i, _joined(lambda: model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False))
            )
        )
        for i, p in enumerate(prompts)
    ]
    for thread in threads:
        thread.start()
    status, raised = _joined(
        lambda: model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=MAX_NEW, stopping_criteria=[bad])
    )
    for thread in threads:
        thread.join(60)
    assert status == "raised" and isinstance(raised, error)
    for i, prompt in enumerate(prompts):
        got = results[i]
        assert got[0] == "ok", got
        assert_same_or_near_tie(
            model, prompt, got[1][0, len(prompt) :].tolist(), hf_greedy(model, prompt, MAX_NEW)
        )
    assert model._hfaccel.loop.wait_idle(10) and model._hfaccel.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("line", [0, 1, 2])
def test_ctrl_c_before_the_wait_begins_cancels_the_submission(line):
    # A KeyboardInterrupt between submitting and the first update (the bar, the counters) reached the
    # caller while its request ran to the end, holding its blocks.
    import sys

    from hfaccel.engine.loop import Submission

    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    code = getattr(Submission, "_wait", Submission.wait).__code__
    target = code.co_firstlineno + 1 + line  # the body's first lines
    fired = []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == target and not fired:
                fired.append(target)
                raise KeyboardInterrupt
            return local

        return local

    engine = model._hfaccel.engine
    before = engine.num_generated_tokens
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate(torch.tensor([[7] * 10]), max_new_tokens=400, min_new_tokens=400, do_sample=False)
    finally:
        sys.settrace(None)
    assert fired and model._hfaccel.loop.wait_idle(30)
    assert engine.num_generated_tokens - before < 400 and engine.block_manager.num_used_blocks == 0


def test_two_threads_patching_one_model_leave_hf_generate_behind_after_unpatch():
    for _ in range(40):  # the race showed in about half the trials
        model = tiny_model()
        original = model.generate
        barrier = threading.Barrier(2)

        def patch_it(model=model, barrier=barrier):
            barrier.wait()
            hfaccel.patch(model)

        threads = [threading.Thread(target=patch_it) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        hfaccel.unpatch(model)
        assert (
            "generate" not in model.__dict__
            and model.generate == original
            and "_hfaccel" not in model.__dict__
        )
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)


def test_closing_a_stream_while_it_yields_fallen_back_prompts_cancels_the_engines():
    import warnings

    from transformers import GenerationConfig

    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    configs = [
        GenerationConfig(
            max_new_tokens=5, guidance_scale=1.5, do_sample=False
        ),  # guidance_scale: transformers serves it
        GenerationConfig(max_new_tokens=400, min_new_tokens=400, do_sample=False),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        events = hfaccel.stream(model, [[5, 6, 7], [8] * 10], generation_config=configs)
        assert next(events).index == 0  # the fallen-back prompt's events come first
        events.close()
    engine = model._hfaccel.engine
    assert model._hfaccel.loop.wait_idle(30)
    assert engine.num_generated_tokens < 400 and engine.block_manager.num_used_blocks == 0


def test_a_temporary_patch_leaves_the_models_own_generate_to_other_threads():
    # hfaccel.generate on an unpatched model patches it for the call: a thread calling the model's
    # plain generate meanwhile must get transformers' own, not an engine the call then closes under it.
    model = tiny_model()
    seen = []

    def look(input_ids, scores, **kwargs):
        seen.append((hfaccel.api.is_patched(model), "generate" in model.__dict__))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    prompt = [5, 6, 7]
    (completion,) = hfaccel.generate(
        model, [prompt], max_new_tokens=3, stopping_criteria=[look], progress=False
    )
    assert seen and all(seen_now == (True, False) for seen_now in seen)
    assert completion.token_ids == hf_greedy(model, prompt, 3) and not hfaccel.api.is_patched(model)


def test_a_fallback_that_reenters_the_same_models_generate_completes():
    """HF's assisted decoding with the model as its own assistant calls the model's generate from inside
    the fallback (in the same thread): it completes, with HF's tokens, instead of waiting on itself."""
    model = tiny_model()
    model.set_attn_implementation("eager")  # output_attentions: the call falls back
    hfaccel.patch(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    kwargs = {"assistant_model": model, "output_attentions": True, "return_dict_in_generate": True}
    kwargs |= {"max_new_tokens": 5, "do_sample": False}
    outputs = {}

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs["ours"] = model.generate(ids, **kwargs).sequences

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(60)
    assert "ours" in outputs, "the re-entrant fallback hung"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = hf(model, input_ids=ids, **kwargs).sequences
    assert outputs["ours"].tolist() == expected.tolist()
    hfaccel.unpatch(model)


def test_a_fallback_and_an_engine_step_whose_processors_generate_do_not_wait_on_each_other():
    """Thread 1's call falls back (transformers' beam search with its own processor, holding the fallback
    lock), and its processor generates; thread 2's call runs on the engine, and its processor
    generates from inside the step (which falls back, so needs that lock). A call from inside a
    fallback runs on transformers too, so neither waits on the other (it deadlocked)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = hfaccel.patch(tiny_model())
    prompts = varied_prompts(4)
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=2)  # the engine is built
    first_in, second_in = threading.Event(), threading.Event()

    def generating(mine: threading.Event, other: threading.Event, prompt: list[int]):
        class Generating(LogitsProcessor):
            done = False

            def __call__(self, input_ids, scores):
                if not Generating.done:
                    Generating.done = True
                    mine.set()
                    other.wait(10)
                    model.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False)
                return scores

        return LogitsProcessorList([Generating()])

    results = {}

    def first():
        processors = generating(first_in, second_in, prompts[1])
        results["first"] = model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=4, num_beams=2, logits_processor=processors
        )

    def second():
        processors = generating(second_in, first_in, prompts[2])
        results["second"] = model.generate(
            torch.tensor([prompts[3]]), max_new_tokens=4, logits_processor=processors
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=target, daemon=True) for target in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert set(results) == {"first", "second"}, "the two calls waited on each other"
    assert results["second"][0, len(prompts[3]) :].tolist() == hf_greedy(model, prompts[3], 4)
    hfaccel.unpatch(model)
