"""`pp_stages`: what a pipeline stage computes around its layers, checked against the model's own forward
at patch (one process: the check needs no process group)."""

from __future__ import annotations

import pytest

import hfaccel
from hfaccel.bench.families import family_model
from hfaccel.patches import pp_stages

# The model-level scales a stage applies, set away from 1 so that leaving one out shows.
SCALED = {
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "cohere": {"logit_scale": 0.0625},
    "gemma2": {"final_logit_softcapping": 3.0},
    "llama": {},
}


@pytest.mark.parametrize("model_type", list(SCALED))
def test_stages_compute_the_models_own_forward(model_type):
    assert pp_stages.unsupported_reason(family_model(model_type, **SCALED[model_type])) is None


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
    init = pp_stages.StageModel.__init__

    def forgetful(self, model):
        init(self, model)
        setattr(self, part, None)

    monkeypatch.setattr(pp_stages.StageModel, "__init__", forgetful)
    assert message in pp_stages.unsupported_reason(model)


def test_a_rotary_embedding_that_wants_the_layer_type_is_refused_before_any_process_group():
    model = family_model("gemma3_text")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not possible: .*layer_type"):
        hfaccel.patch(model, pipeline_parallel_size=2)
    assert getattr(model, "_hfaccel", None) is None
