"""A step's compiled forward: its own dynamo cache per compile, eager past the recompile limit, and the
attention op's own exceptions through inductor's C++ wrapper."""

import logging

import pytest
import torch

from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from hfaccel.kernels.torch_paged import TorchPagedAttention
from hfaccel.patches.compiled_forward import CompiledForward, own_code
from tests.helpers import hf_greedy, tiny_model


class Scaled:
    """A callable whose Python attribute dynamo guards on: each new `factor` is a new graph."""

    def __init__(self) -> None:
        self.factor = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor + 1


def test_own_code_is_a_copy_with_its_own_cache():
    copy = own_code(Scaled.forward)
    assert copy.__code__ is not Scaled.forward.__code__
    assert copy.__code__.co_code == Scaled.forward.__code__.co_code and copy.__qualname__ == "Scaled.forward"
    # One graph allowed per code object: two compiles over copies of the same code each get theirs.
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        a, b = Scaled(), Scaled()
        b.factor = 3
        x = torch.arange(4.0)
        for owner in (a, b):
            compiled = torch.compile(own_code(Scaled.forward).__get__(owner), fullgraph=True, backend="eager")
            assert torch.equal(compiled(x), owner.forward(x))


def test_past_the_recompile_limit_the_forward_runs_eager_with_one_warning(caplog):
    torch._dynamo.reset()
    owner = Scaled()
    compiled = torch.compile(own_code(Scaled.forward).__get__(owner), fullgraph=True, backend="eager")
    forward = CompiledForward(compiled, owner.forward)
    x = torch.arange(4.0)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING, logger="hfaccel"):
        assert torch.equal(forward(x), x + 1) and not forward.exhausted
        for factor in (2, 5, 1):  # a second state: no room for its graph
            owner.factor = factor
            assert torch.equal(forward(x), x * factor + 1) and forward.exhausted
    assert sum("run eager from now on" in r.getMessage() for r in caplog.records) == 1


def test_more_models_than_the_recompile_limit_all_compile():
    # Every engine compiled the same code object: the 9th model of a process failed for good.
    torch._dynamo.reset()
    prompt = [5, 17, 33, 9]
    with torch._dynamo.config.patch(recompile_limit=2):  # reached sooner: 3 models show it
        for seed in range(3):
            model = tiny_model("llama", seed=seed, layers=1)
            engine = Engine(model, EngineConfig(compile="decode", max_num_seqs=2, kv_cache_memory=2_000_000))
            request = engine.add_request(prompt, StoppingParams(max_new_tokens=4))
            while engine.has_unfinished_requests():
                engine.step()
            assert request.output_token_ids == hf_greedy(model, prompt, 4)
            assert not engine.runner._compiled["dynamic"].exhausted


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt("Ctrl-C"), ValueError("scale: a message naming the parameter")], ids=repr
)
def test_an_error_inside_the_compiled_attention_op_reaches_the_caller_as_raised(monkeypatch, error):
    # On a CPU the compiled graph calls the op from C++ (cpp_wrapper), which replaced the op's exception
    # by its own RuntimeError: a Ctrl-C escaped `except KeyboardInterrupt`.
    model = tiny_model("llama", layers=1)
    engine = Engine(model, EngineConfig(compile="decode", max_num_seqs=2, kv_cache_memory=2_000_000))
    prompt = [5, 6, 7]
    request = engine.add_request(prompt, StoppingParams(max_new_tokens=4))
    engine.step()  # the prefill: eager
    real = TorchPagedAttention.forward

    def failing(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(TorchPagedAttention, "forward", failing)
    with pytest.raises(type(error), match=str(error)):
        engine.step()  # a decode step: the compiled graph
    assert request.is_finished and engine.block_manager.num_used_blocks == 0
    monkeypatch.setattr(TorchPagedAttention, "forward", real)
    again = engine.add_request(prompt, StoppingParams(max_new_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert again.output_token_ids == hf_greedy(model, prompt, 4)


def test_the_op_keeps_no_error_outside_a_compiled_graph():
    # A kept exception holds its frames (the step's tensors, the KV cache): only a compiled call keeps one.
    from hfaccel.kernels import op

    with pytest.raises(RuntimeError, match="only inside an hfaccel engine step"):
        op.paged_attention(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), 0, 1.0)
    assert op.take_error() is None
