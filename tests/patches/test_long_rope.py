"""Phi-3's "longrope" rotary embeddings (`patches/models.long_rope_context`): within the original context
the engine serves HF's tokens; a call that may pass it goes to transformers, with a warning, since there
transformers rotates every position of a forward with the long factors (chosen from the forward's largest
position, which a packed step shares with other requests) and Phi-3 recomputes its cache."""

import warnings

import pytest
import torch
import transformers

import hfaccel
from hfaccel.patches.models import long_rope_context, max_model_len
from tests.helpers import EOS, PAD, VOCAB

ORIGINAL = 16


def phi3_longrope():
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
        "original_max_position_embeddings": ORIGINAL,
    }
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
        bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, rope_parameters=rope,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


def test_the_context_is_the_original_one_and_beyond_it_is_refused_by_name():
    model = phi3_longrope()
    assert long_rope_context(model.config) == ORIGINAL and max_model_len(model, None) == ORIGINAL
    with pytest.raises(ValueError, match="longrope original context"):
        max_model_len(model, ORIGINAL + 1)


def test_calls_within_the_original_context_are_served_and_longer_ones_go_to_transformers():
    model = phi3_longrope()
    short, long = torch.tensor([[68, 76, 191, 105]]), torch.tensor([[68, 76, 191, 105, 154, 28, 117, 25]])
    expected = {n: model.generate(input_ids=ids, max_new_tokens=n) for ids, n in ((short, 8), (long, 20))}
    hfaccel.patch(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # served by the engine: no fallback warning
            assert torch.equal(model.generate(input_ids=short, max_new_tokens=8), expected[8])
        with pytest.warns(UserWarning, match="past its original context"):
            assert torch.equal(model.generate(input_ids=long, max_new_tokens=20), expected[20])
        # A short request's tokens never depend on a long one beside it (HF's factors are chosen per forward).
        alone = hfaccel.generate(model, [[87, 87, 5, 9]], max_new_tokens=8, progress=False)[0].token_ids
        model._hfaccel.warned.clear()  # (a reason warns once per model, its numbers aside)
        with pytest.warns(UserWarning, match="longrope"):
            both = hfaccel.generate(
                model, [[87, 87, 5, 9], list(range(3, 33))], max_new_tokens=8, progress=False
            )
        assert both[0].token_ids == alone
    finally:
        hfaccel.unpatch(model)
    reference = model.generate(input_ids=torch.tensor([[87, 87, 5, 9]]), max_new_tokens=8)[0, 4:].tolist()
    assert alone == reference


def test_per_layer_type_and_legacy_rope_settings_are_read():
    config = transformers.LlamaConfig()
    config.rope_parameters = {
        "full_attention": {"rope_type": "longrope", "original_max_position_embeddings": 32},
        "sliding_attention": {"rope_type": "default"},
    }
    assert long_rope_context(config) == 32
    config.rope_parameters = {"rope_type": "default"}
    assert long_rope_context(config) is None
