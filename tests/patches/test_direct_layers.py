"""`direct_layers`: Llama's decoder layers written out for the lean forward give the model's own tokens,
serve its decode steps, and give way, module by module, to whatever a call of the module would run
beyond its class's forward, also when that changes in the middle of a call."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.models.llama import modeling_llama

import hfaccel
from hfaccel.patches import direct_layers, layer_loop
from tests.helpers import EOS, FAMILIES, PAD, hf, tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [3, 4, 5, 3, 4]])
ASK = {"max_new_tokens": 8, "do_sample": False}


def _count_direct(monkeypatch) -> list[bool]:
    """Each layer call of the lean forward: True where `run_layer` wrote it out."""
    seen: list[bool] = []
    run = layer_loop.run_layer

    def counted(*args):
        out = run(*args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(layer_loop, "run_layer", counted)
    return seen


def _layer_calls_of_a_checked_call(model, ask, monkeypatch) -> list[bool]:
    """The lean forward's layer calls in a patched `generate` after the first (which checks it), each
    True where `run_layer` wrote it out; both calls give HF's tokens."""
    expected = hf(model, input_ids=IDS, **ask)
    seen = _count_direct(monkeypatch)
    hfaccel.patch(model, progress=False)
    try:
        assert torch.equal(model.generate(IDS, **ask), expected)
        seen.clear()
        assert torch.equal(model.generate(IDS, **ask), expected)
    finally:
        hfaccel.unpatch(model)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_style_layers_are_written_out_and_give_the_models_tokens(family, monkeypatch):
    model = tiny_model(family, seed=4)
    seen = _layer_calls_of_a_checked_call(model, ASK, monkeypatch)
    assert seen and all(seen) and len(seen) == model.config.num_hidden_layers * ASK["max_new_tokens"]


def _scale_output(module, args, output):
    return output * 1.5


def _hook_linear(model):
    handle = model.model.layers[1].self_attn.q_proj.register_forward_hook(_scale_output)
    return handle.remove


def _hook_norm(model):
    handle = model.model.layers[0].post_attention_layernorm.register_forward_pre_hook(
        lambda module, args: (args[0] + 1.0,)
    )
    return handle.remove


def _instance_forward(model):
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: type(mlp).forward(mlp, x) * -1.0  # as accelerate's hooks replace it

    def undo():
        del mlp.forward

    return undo


def _swap_child(model):
    class Shifted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.5

    attention = model.model.layers[0].self_attn
    old = attention.o_proj
    new = Shifted(old.in_features, old.out_features, bias=False)
    new.load_state_dict(old.state_dict())
    attention.o_proj = new

    def undo():
        attention.o_proj = old

    return undo


def _class_forward(model):
    original = modeling_llama.LlamaRMSNorm.forward
    modeling_llama.LlamaRMSNorm.forward = lambda self, x: original(self, x) * 0.5  # as Liger replaces it

    def undo():
        modeling_llama.LlamaRMSNorm.forward = original

    return undo


def _module_function(model):
    original = modeling_llama.apply_rotary_pos_emb

    def flipped(q, k, cos, sin, unsqueeze_dim=1):
        q, k = original(q, k, cos, sin, unsqueeze_dim)
        return q.flip(-1), k

    modeling_llama.apply_rotary_pos_emb = flipped

    def undo():
        modeling_llama.apply_rotary_pos_emb = original

    return undo


def _module_call(model):
    original = torch.nn.Module.__call__

    def call(self, *args, **kwargs):  # a library instrumenting every module call
        out = original(self, *args, **kwargs)
        return out * 1.5 if isinstance(self, torch.nn.Linear) else out

    torch.nn.Module.__call__ = call

    def undo():
        torch.nn.Module.__call__ = original

    return undo


class ScaledCall(torch.nn.Linear):
    def __call__(self, x):
        return super().__call__(x) * 1.5


def _class_call(model):
    up = model.model.layers[0].mlp.up_proj
    up.__class__ = ScaledCall

    def undo():
        up.__class__ = torch.nn.Linear

    return undo


def _function_child(model):
    mlp = model.model.layers[0].mlp
    act = mlp.act_fn
    del mlp.act_fn
    mlp.act_fn = torch.nn.functional.gelu  # a plain function now, not a submodule

    def undo():
        del mlp.act_fn
        mlp.act_fn = act

    return undo


class EditAt(LogitsProcessor):
    """Makes `edit` once a row holds `at` new tokens' worth of ids (the engine calls a request's processors
    on its own row): the steps after it run the edited model."""

    def __init__(self, model, edit, at=3):
        self.model, self.edit, self.length, self.undo = model, edit, IDS.shape[1] + at, None

    def __call__(self, input_ids, scores):
        if self.undo is None and input_ids.shape[-1] == self.length:
            self.undo = self.edit(self.model)
        return scores


@pytest.mark.parametrize(
    "edit",
    [
        _hook_linear,
        _hook_norm,
        _instance_forward,
        _swap_child,
        _class_forward,
        _module_function,
        _module_call,
        _class_call,
        _function_child,
    ],
)
def test_a_change_in_the_middle_of_a_call_is_honoured_at_the_next_step(edit, monkeypatch):
    """The model watch reads hooks and modules at admissions only: a change between two steps of one
    call is seen by `run_layer`'s own checks, at every module call."""
    outputs = []
    for patched in (False, True):
        model = tiny_model("llama", seed=4)
        processor = EditAt(model, edit)
        if patched:
            hfaccel.patch(model, progress=False)
            model.generate(IDS, **ASK)  # the lean forward checked, before the edit
            assert model._hfaccel.get_engine(model).runner.executor._lean.verified is True
        try:
            processors = LogitsProcessorList([processor])
            if patched:
                outputs.append(model.generate(IDS, logits_processor=processors, **ASK))
            else:
                outputs.append(hf(model, input_ids=IDS, logits_processor=processors, **ASK))
        finally:
            if processor.undo is not None:
                processor.undo()
            if patched:
                hfaccel.unpatch(model)
    unedited = hf(tiny_model("llama", seed=4), input_ids=IDS, **ASK)
    assert not torch.equal(outputs[0], unedited)  # the edit shows in HF's tokens
    assert torch.equal(outputs[1], outputs[0])


def _steered(function):
    @functools.wraps(function)  # names copied from transformers' function: its code is not
    def steered(*args, **kwargs):
        return function(*args, **kwargs)

    return steered


@pytest.mark.parametrize(
    ("owner", "name", "replacement"),
    [
        (modeling_llama.LlamaMLP, "forward", lambda function: lambda self, x: x),
        (modeling_llama.LlamaMLP, "forward", _steered),
        (modeling_llama, "apply_rotary_pos_emb", _steered),
        (torch.nn.Module, "__call__", _steered),
        (torch.nn.Module, "_call_impl", _steered),
    ],
)
def test_code_replaced_before_it_was_first_seen_is_never_written_out(owner, name, replacement, monkeypatch):
    """Also by a wrapper that keeps the function's names (a steering vector toggled later, a capture); once
    put back, the layers are written out again (the first answer was kept for good before)."""
    layers = tiny_model("llama").model.layers
    monkeypatch.setattr(direct_layers, "_families", {})  # never asked before
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, replacement(original))
    assert direct_layers._family(modeling_llama.__name__) is None
    assert direct_layers.step_family(layers) is None
    setattr(owner, name, original)  # put back (the families asked meanwhile still this test's)
    assert direct_layers.step_family(layers) is not None


def test_a_global_hook_or_a_family_not_written_out_writes_nothing():
    layers = tiny_model("llama").model.layers
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        assert direct_layers.step_family(layers) is None
    finally:
        handle.remove()
    assert direct_layers.step_family(layers) is not None
    assert direct_layers.step_family(tiny_model("mixtral").model.layers) is None


def _windowed(family: str, window: int = 4):
    """A tiny model whose layers attend to their last `window` positions only."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    sizes |= {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": window}
    sizes |= {"bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": PAD}  # as `tiny_model`'s
    if family == "mistral":
        config = MistralConfig(**sizes)
        model_class = MistralForCausalLM
    else:
        config = Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=0)
        model_class = Qwen2ForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.08)
    return model


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_written_out_attention_passes_its_sliding_window(family, monkeypatch):
    model = _windowed(family)
    ask = {"max_new_tokens": 12, "do_sample": False}
    windowless = hf(_windowed(family, 512), input_ids=IDS, **ask)
    assert not torch.equal(windowless, hf(model, input_ids=IDS, **ask))  # the window shows
    seen = _layer_calls_of_a_checked_call(model, ask, monkeypatch)
    assert seen and all(seen)


def test_an_instance_attribute_shadowing_a_weight_is_the_one_used():
    """``module.weight`` reads the instance's own attribute before the registered parameter."""
    model = tiny_model("llama", seed=4)
    ids = IDS[:1]
    hfaccel.patch(model, progress=False)
    try:
        model.generate(ids, **ASK)  # checked
        linear = model.model.layers[1].mlp.gate_proj
        linear.__dict__["weight"] = linear.weight.detach() * 2
        out = model.generate(ids, **ASK)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, hf(model, input_ids=ids, **ASK))
