"""The one planner (patches/planner.py): both front-ends go through the same ordered table of gates, so
the same call falls back for the same reason from `model.generate` and from `hfaccel.generate`, and the
first gate in the table decides."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LogitsProcessor

import hfaccel
from hfaccel.patches.planner import GATES
from tests.helpers import tiny_model


def fallback_reasons(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message).split(" is not served")[0] for w in caught if "falls back" in str(w.message)]


class Identity(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


# (arguments, the reason both front-ends give): one per kind of gate the front-ends share.
CALLS = [
    (
        {"negative_prompt_ids": torch.tensor([[5, 6]]), "guidance_scale": 1.5},
        "negative_prompt_ids (classifier-free guidance)",
    ),
    ({"num_beams": 2, "logits_processor": [Identity()]}, "beam search with logits_processor"),
    (
        {"output_attentions": True, "return_dict_in_generate": True, "guidance_scale": 1.5},
        "guidance_scale",
    ),
]


@pytest.mark.parametrize(("arguments", "reason"), CALLS, ids=[r for _, r in CALLS])
def test_both_front_ends_fall_back_for_the_same_reason(arguments, reason):
    model = hfaccel.patch(tiny_model("llama"), kv_cache_memory=4_000_000)
    try:
        via_generate = fallback_reasons(
            lambda: model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, **arguments)
        )
        model._hfaccel.warned.clear()
        via_api = fallback_reasons(
            lambda: hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=3, **arguments)
        )
    finally:
        hfaccel.unpatch(model)
    assert len(via_generate) == 1 and reason in via_generate[0], via_generate
    assert via_api == via_generate


def test_the_first_gate_in_the_table_decides():
    """A call that several gates would send to HF gives the reason of the earliest: an argument the
    engine does not take comes before beam search's own refusals and the padding gate."""
    names = [name for name, _ in GATES]
    assert names.index("arguments the engine does not take") < names.index("generation mode and options")
    assert names.index("generation mode and options") < names.index("padding")
    model = hfaccel.patch(tiny_model("llama"), kv_cache_memory=4_000_000)
    try:
        reasons = fallback_reasons(
            lambda: model.generate(
                torch.tensor([[5, 6, 7], [0, 8, 9]]),
                attention_mask=torch.tensor([[1, 1, 1], [1, 0, 1]]),
                num_beams=2,
                do_sample=True,
                negative_prompt_ids=torch.tensor([[1]]),
                max_new_tokens=3,
            )
        )
    finally:
        hfaccel.unpatch(model)
    assert len(reasons) == 1 and "negative_prompt_ids" in reasons[0], reasons


def test_every_gate_is_named_once():
    names = [name for name, _ in GATES]
    assert len(names) == len(set(names)) and all(callable(gate) for _, gate in GATES)
