"""`layer_loop`: what a pipeline stage computes around its layers, checked against the model's own forward
at patch (one process: the check needs no process group); the eager step's lean forward, checked against
the model's forward before it serves, and never used where it would skip something of the user's."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

import hfaccel
from hfaccel.bench.families import family_model
from hfaccel.patches import layer_loop
from tests.helpers import FAMILIES, MOE_FAMILIES, hf, tiny_model

# The model-level scales a stage applies, set away from 1 so that leaving one out shows.
SCALED = {
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "cohere": {"logit_scale": 0.0625},
    "gemma2": {"final_logit_softcapping": 3.0},
    "llama": {},
}


@pytest.mark.parametrize("model_type", list(SCALED))
def test_stages_compute_the_models_own_forward(model_type):
    assert layer_loop.unsupported_reason(family_model(model_type, **SCALED[model_type])) is None


@pytest.mark.parametrize(
    ("model_type", "part", "message"),
    [
        ("granite", "embedding_multiplier", "first layer's input other than from the token embeddings"),
        ("granite", "logits_scaling", "logits other than from its final norm and LM head"),
        ("cohere", "logit_scale", "logits other than from its final norm and LM head"),
    ],
)
def test_a_scale_a_stage_left_out_is_found(model_type, part, message, monkeypatch):
    model = family_model(model_type, **SCALED[model_type])
    init = layer_loop.AroundLayers.__init__

    def forgetful(self, model):
        init(self, model)
        setattr(self, part, None)

    monkeypatch.setattr(layer_loop.AroundLayers, "__init__", forgetful)
    assert message in layer_loop.unsupported_reason(model)


def test_a_rotary_embedding_that_wants_the_layer_type_is_refused_before_any_process_group():
    model = family_model("gemma3_text")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not possible: .*layer_type"):
        hfaccel.patch(model, pipeline_parallel_size=2)
    assert getattr(model, "_hfaccel", None) is None


IDS = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [3, 4, 5, 3, 4]])
KWARGS = {"max_new_tokens": 6, "do_sample": False}


def _lean(model):
    return model._hfaccel.get_engine(model).runner.executor._lean


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_FAMILIES])
def test_the_lean_forward_serves_once_it_computed_the_models_own_logits(family):
    model = tiny_model(family, seed=4)
    expected = hf(model, input_ids=IDS, **KWARGS)
    hfaccel.patch(model, progress=False)
    try:
        assert _lean(model).verified is None  # not checked before a decode step
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert _lean(model).verified is True
        assert torch.equal(model.generate(IDS, **KWARGS), expected)  # served by it now
    finally:
        hfaccel.unpatch(model)


class BiasedLlama(LlamaForCausalLM):
    """A family whose top-level forward does more than its layers: it favours token 5."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits[..., 5] += 3.0
        return output


def test_a_model_whose_forward_differs_keeps_its_own_forward():
    source = tiny_model("llama", seed=4)
    model = BiasedLlama(source.config).eval()
    model.load_state_dict(source.state_dict())
    expected = hf(model, input_ids=IDS, **KWARGS)
    assert (expected[:, 5:] == 5).any() and not (expected[:, 5:] == 5).all()  # the bias shows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unchecked family
        hfaccel.patch(model, progress=False)
    try:
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert _lean(model).verified is False
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
    finally:
        hfaccel.unpatch(model)


def test_a_packed_hook_on_the_top_level_model_is_never_skipped():
    """A hook marked ``hfaccel_packed`` on the model itself keeps the call on the engine, and runs on
    every step: those steps take the model's forward."""
    model = tiny_model("llama", seed=4)

    def favour_five(module, args, output):
        output.logits[..., 5] += 3.0
        return output

    favour_five.hfaccel_packed = True
    hfaccel.patch(model, progress=False)
    try:
        model.generate(IDS, **KWARGS)
        assert _lean(model).verified is True  # checked before the hook came
        handle = model.register_forward_hook(favour_five)
        expected = hf(model, input_ids=IDS, **KWARGS)
        assert (expected[:, 5:] == 5).any()
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        handle.remove()
        assert torch.equal(model.generate(IDS, **KWARGS), hf(model, input_ids=IDS, **KWARGS))
    finally:
        hfaccel.unpatch(model)


def test_a_change_of_the_model_checks_it_again(monkeypatch):
    checks = []
    verify = layer_loop.LeanForward.verify

    def counted(self, *args):
        verify(self, *args)
        checks.append(self.verified)

    monkeypatch.setattr(layer_loop.LeanForward, "verify", counted)
    model = tiny_model("llama", seed=4)
    hfaccel.patch(model, progress=False)
    try:
        model.generate(IDS, **KWARGS)
        model.generate(IDS, **KWARGS)
        assert checks == [True]
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)  # the engine sees the change at its next call
        assert torch.equal(model.generate(IDS, **KWARGS), hf(model, input_ids=IDS, **KWARGS))
        assert checks == [True, True]  # checked again after the change
        model.generate(IDS, **KWARGS)
        assert checks == [True, True]
    finally:
        hfaccel.unpatch(model)
