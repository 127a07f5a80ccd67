"""`compile="background"` (`engine/background_compile.py`): decode steps run eager while their bucket
compiles in another thread, then compiled without a recompile in the engine's thread; a failed compile
leaves them eager. Deadlines guard every wait."""

import logging
import threading

import pytest
import torch

import hfaccel
from hfaccel import EngineConfig
from hfaccel.engine import background_compile
from tests.helpers import hf, left_padded, tiny_model, varied_prompts

needs_support = pytest.mark.skipif(
    background_compile.background_unavailable_reason() is not None,
    reason=str(background_compile.background_unavailable_reason()),
)


def _generate(model, ids, mask, new_tokens=8):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


@needs_support
def test_steps_run_eager_while_the_bucket_compiles_then_compiled_with_no_recompile():
    model = tiny_model()
    ids, mask = left_padded(varied_prompts(4))
    reference = hf(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    hfaccel.patch(model, compile="background", cuda_graph_sizes=(4,), strict=True)
    _generate(model, ids[2:3], mask[2:3], new_tokens=1)  # builds the engine: a 37-token prefill, no decode
    runner = model._hfaccel.engine.runner
    release, compiled_calls = threading.Event(), []
    real_compile = runner.executor.compile

    def gated_compile(dynamic):
        assert release.wait(60), "the test never released the compile"
        compiled = real_compile(dynamic=dynamic)

        def spy(*args):
            compiled_calls.append(threading.current_thread().name)
            return compiled(*args)

        return spy

    runner.executor.compile = gated_compile
    # The compile is held: the whole call runs eager, and no step waits for it.
    assert torch.equal(_generate(model, ids, mask), reference)
    assert runner.background.pending() == 1 and not compiled_calls
    release.set()
    assert runner.background.wait(300), "the background compile did not finish"
    assert compiled_calls == ["hfaccel-compile"]  # its warm-up step, in the compile thread
    with torch.compiler.set_stance("fail_on_recompile"):  # the warm-up's guards hold in this thread
        assert torch.equal(_generate(model, ids, mask), reference)
    assert len(compiled_calls) > 1 and set(compiled_calls[1:]) != {"hfaccel-compile"}
    hfaccel.unpatch(model)


@needs_support
def test_a_failed_background_compile_leaves_the_bucket_eager(caplog):
    model = tiny_model()
    ids, mask = left_padded(varied_prompts(4)[2:])  # two prompts of 37 tokens
    reference = hf(model, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    hfaccel.patch(model, compile="background", cuda_graph_sizes=(2,), strict=True)
    _generate(model, ids[:1], mask[:1], new_tokens=1)  # builds the engine: a prefill, no decode
    runner = model._hfaccel.engine.runner

    def broken(dynamic):
        raise RuntimeError("dynamo says no")

    runner.executor.compile = broken
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        assert torch.equal(_generate(model, ids, mask), reference)
        assert runner.background.wait(60)
        assert torch.equal(_generate(model, ids, mask), reference)
    assert runner.background.ready(2) is None and runner.background.pending() == 0
    assert (
        "compiling decode steps of 2 sequences in the background failed (RuntimeError: dynamo says no)"
        in (caplog.text)
    )
    hfaccel.unpatch(model)


def test_background_compile_refuses_cuda_graphs_and_a_torch_it_crashes(monkeypatch):
    with pytest.raises(ValueError, match="cuda_graphs=True needs compile='decode'"):
        EngineConfig(compile="background", cuda_graphs=True)
    monkeypatch.setattr(background_compile, "_TORCH_VERSION", "2.11.0+cpu")
    with pytest.raises(ValueError, match="compile='background': torch 2.11.0.cpu crashes"):
        hfaccel.patch(tiny_model(), compile="background")


@needs_support
def test_release_stops_the_background_compile_and_installs_nothing():
    """`hfaccel.release` while a bucket compiles: its queue is dropped, the compile in flight is not
    installed, and the thread ends (the old engine is let go)."""
    model = tiny_model()
    ids, mask = left_padded(varied_prompts(4)[2:])
    hfaccel.patch(model, compile="background", cuda_graph_sizes=(2, 4), strict=True)
    _generate(model, ids[:1], mask[:1], new_tokens=1)
    runner = model._hfaccel.engine.runner
    release, started = threading.Event(), threading.Event()

    def held(dynamic):
        started.set()
        assert release.wait(60)
        return lambda *args: None

    runner.executor.compile = held
    runner.warmup()  # queues both buckets
    assert started.wait(60)
    hfaccel.release(model)
    release.set()
    assert runner.background.wait(60) and runner.background.pending() == 0
    assert runner.background.ready(2) is None and runner.background.ready(4) is None
    assert runner.background._thread is None
    hfaccel.unpatch(model)
