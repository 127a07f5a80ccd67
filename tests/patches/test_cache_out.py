"""return_dict_in_generate returns past_key_values as HF does; continuing from it equals one long generate."""

import torch

import hfaccel
from tests.helpers import tiny_model


def test_past_key_values_round_trip_equals_one_long_generate():
    model = tiny_model("llama")
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    generate = type(model).generate
    expected = generate(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False
    )
    hf_first = generate(
        model,
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
    )
    hfaccel.patch(model)
    try:
        first = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            return_dict_in_generate=True,
        )
        assert first.past_key_values is not None
        # Real (unmasked) positions hold the KV HF computed.
        for layer in range(2):
            ours_k = first.past_key_values.layers[layer].keys
            hf_k = hf_first.past_key_values.layers[layer].keys
            assert ours_k.shape == hf_k.shape
            real = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1).bool()
            torch.testing.assert_close(ours_k[0][:, real[0]], hf_k[0][:, real[0]], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours_k[1], hf_k[1], atol=1e-5, rtol=1e-5)
        full_mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
        second = model.generate(
            input_ids=first.sequences,
            attention_mask=full_mask,
            past_key_values=first.past_key_values,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
        )
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(second, expected)


def test_a_returned_cache_is_in_the_models_dtype_whatever_the_kv_cache_holds():
    """A bfloat16 KV cache under a float32 model: the returned past_key_values hold float32 (as HF's do),
    and the engine serves a call continuing from it (it came back in bfloat16, which the engine then
    refused as another dtype's cache)."""
    import warnings

    model = hfaccel.patch(tiny_model("llama"), dtype="bfloat16")
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        first = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert first.past_key_values.layers[0].keys.dtype == torch.float32
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # served, no fallback
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 renames it `cache`
            model.generate(
                first.sequences, past_key_values=first.past_key_values, max_new_tokens=2, do_sample=False
            )
    finally:
        hfaccel.unpatch(model)
