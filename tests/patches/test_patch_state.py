"""What `patch` keeps on a model (`patches/patch_state.py`): a deep copy of a patched model is patched with
an engine of its own; pickling one says how to save it instead."""

import copy
import pickle

import pytest
import torch

import hfaccel
from tests.helpers import tiny_model


def test_a_deep_copy_is_patched_with_an_engine_of_its_own():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=8_000_000)
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = model.generate(ids, max_new_tokens=6)
    twin = copy.deepcopy(model)  # TRL's create_reference_model does this
    try:
        assert twin.generate.__self__ is twin and twin._hfaccel.engine is None
        assert torch.equal(twin.generate(ids, max_new_tokens=6), expected)
        assert twin._hfaccel.engine is not model._hfaccel.engine
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
        assert torch.equal(model.generate(ids, max_new_tokens=6), expected)  # the original is its own
        unpatched = tiny_model()
        unpatched.load_state_dict(twin.state_dict())
        assert torch.equal(twin.generate(ids, max_new_tokens=6), unpatched.generate(ids, max_new_tokens=6))
    finally:
        hfaccel.unpatch(twin)
        hfaccel.unpatch(model)


def test_pickling_a_patched_model_says_what_to_do():
    model = hfaccel.patch(tiny_model())
    try:
        with pytest.raises(TypeError, match="hfaccel.unpatch"):
            pickle.dumps(model)
    finally:
        hfaccel.unpatch(model)
    pickle.dumps(model)
