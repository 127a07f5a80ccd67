"""`model.generate(input_ids, past_key_values=cache)`: a DynamicCache imported into the paged KV cache."""

import contextlib
import copy
import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hfaccel
from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.prompt_inputs import attach_kv
from hfaccel.engine.request import StoppingParams
from hfaccel.patches.arguments import CACHE_NAME
from tests.helpers import EOS, hf, left_padded, tiny_model, varied_prompts


def served(model, **kwargs):
    """The patched generate, failing if it falls back."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hfaccel: .* falls back")
        return model.generate(**kwargs)


def extended(sequences, mask, more):
    """`sequences` with the tokens `more` (one list per row) appended, and the mask over all of them."""
    ids = torch.cat([sequences, torch.tensor(more, dtype=torch.long).reshape(len(sequences), -1)], dim=1)
    return ids, torch.cat(
        [mask, torch.ones(len(mask), ids.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1
    )


# The first call of a continuation test, and an engine small enough that prompts span several blocks.
FIRST = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True}
SMALL_ENGINE = {"block_size": 8, "kv_cache_memory": 4_000_000, "max_num_batched_tokens": 32}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_continuing_from_the_returned_cache_equals_one_long_generate_and_hf(family):
    model = tiny_model(family)
    ids, mask = left_padded(varied_prompts(6, seed=2)[1:5])  # 1, 37, 37 and 43 tokens
    hf_first = hf(model, input_ids=ids, attention_mask=mask, **FIRST)
    hfaccel.patch(model, **SMALL_ENGINE)
    try:
        first = served(model, input_ids=ids, attention_mask=mask, **FIRST)
        assert torch.equal(first.sequences, hf_first.sequences)
        cache = first.past_key_values
        for more in ([], [[40, 41]] * 4):  # continue right away, and with more tokens appended
            seq, seq_mask = extended(first.sequences, mask, more)
            ours = served(
                model,
                input_ids=seq,
                attention_mask=seq_mask,
                past_key_values=copy.deepcopy(cache),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
            )
            lengths = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
            long = hf(model, input_ids=seq, attention_mask=seq_mask, **lengths)
            theirs = hf(
                model,
                input_ids=seq,
                attention_mask=seq_mask,
                past_key_values=copy.deepcopy(hf_first.past_key_values),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
            )
            assert torch.equal(ours, long), more
            assert torch.equal(ours, theirs), more
            # HF's own cache (pad tokens' K/V in the padding) imported here gives the same continuation.
            from_hf = served(
                model,
                input_ids=seq,
                attention_mask=seq_mask,
                past_key_values=copy.deepcopy(hf_first.past_key_values),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
            )
            assert torch.equal(from_hf, theirs), more
    finally:
        hfaccel.unpatch(model)


def test_the_given_cache_is_extended_in_place_as_hf_extends_it():
    model = tiny_model("llama")
    ids, mask = left_padded([[5, 6, 7], [8, 9, 10, 11, 12, 13]])
    kwargs = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True}
    hf_first = hf(model, input_ids=ids, attention_mask=mask, **kwargs)
    seq, seq_mask = extended(hf_first.sequences, mask, [[30], [31]])
    hf_cache = copy.deepcopy(hf_first.past_key_values)
    theirs = hf(model, input_ids=seq, attention_mask=seq_mask, past_key_values=hf_cache, **kwargs)
    hfaccel.patch(model)
    try:
        our_cache = copy.deepcopy(hf_first.past_key_values)
        before = [layer.keys.clone() for layer in our_cache.layers]
        ours = served(model, input_ids=seq, attention_mask=seq_mask, past_key_values=our_cache, **kwargs)
        plain = copy.deepcopy(hf_first.past_key_values)
        served(  # without return_dict_in_generate the cache is extended all the same
            model,
            input_ids=seq,
            attention_mask=seq_mask,
            past_key_values=plain,
            max_new_tokens=3,
            do_sample=False,
        )
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert ours.past_key_values is our_cache and theirs.past_key_values is hf_cache
    assert (
        our_cache.get_seq_length() == hf_cache.get_seq_length() == plain.get_seq_length() == seq.shape[1] + 2
    )
    length = hf_first.past_key_values.get_seq_length()
    real = torch.cat([seq_mask, torch.ones(2, 2, dtype=mask.dtype)], dim=1).bool()
    for layer, (ours_layer, hf_layer) in enumerate(zip(our_cache.layers, hf_cache.layers)):
        assert torch.equal(ours_layer.keys[:, :, :length], before[layer]), "the given positions stay as given"
        for i in range(2):
            torch.testing.assert_close(ours_layer.keys[i][:, real[i]], hf_layer.keys[i][:, real[i]])
            torch.testing.assert_close(ours_layer.values[i][:, real[i]], hf_layer.values[i][:, real[i]])


def test_a_prompt_cache_reused_for_several_continuations():
    """HF's prompt-reuse recipe: the prefix's cache from a forward call, deep-copied per continuation; and
    an empty DynamicCache, filled in place."""
    model = tiny_model("llama")
    prefix = varied_prompts(4, seed=6)[2]
    with torch.no_grad():
        prompt_cache = model(
            torch.tensor([prefix]), past_key_values=DynamicCache(config=model.config)
        ).past_key_values
    suffixes, five = [[50, 51, 52], [60]], {"max_new_tokens": 5}
    expected = [
        hf(model, input_ids=torch.tensor([prefix + s]), past_key_values=copy.deepcopy(prompt_cache), **five)
        for s in suffixes
    ]
    empty_hf = DynamicCache(config=model.config)
    hf(model, input_ids=torch.tensor([prefix]), past_key_values=empty_hf, max_new_tokens=5)
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000)
    try:
        outs = [
            served(
                model,
                input_ids=torch.tensor([prefix + s]),
                past_key_values=copy.deepcopy(prompt_cache),
                **five,
            )
            for s in suffixes
        ]
        empty = DynamicCache(config=model.config)
        served(model, input_ids=torch.tensor([prefix]), past_key_values=empty, max_new_tokens=5)
    finally:
        hfaccel.unpatch(model)
    for out, ref in zip(outs, expected):
        assert torch.equal(out, ref)
    assert empty.get_seq_length() == empty_hf.get_seq_length() == len(prefix) + 4
    for ours, theirs in zip(empty.layers, empty_hf.layers):
        torch.testing.assert_close(ours.keys, theirs.keys)


def test_imported_kv_never_enters_the_prefix_cache():
    """K/V the engine did not compute (here: noise) is used for its own call, as HF uses it, and never
    served to a later prompt with the same ids."""
    model = tiny_model("llama")
    prompt = varied_prompts(4, seed=8)[2]  # 37 tokens
    ids = torch.tensor([prompt + [70, 71, 72]])
    g = torch.Generator().manual_seed(0)
    noise = DynamicCache(config=model.config)
    for layer in range(2):
        shape = (1, 2, len(prompt), 16)
        noise.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), layer)
    with_noise = hf(model, input_ids=ids, past_key_values=copy.deepcopy(noise), max_new_tokens=5)
    plain_expected = hf(model, input_ids=ids, max_new_tokens=5)
    assert not torch.equal(with_noise, plain_expected), "the noise changes the continuation"
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000)
    try:
        engine = model._hfaccel.get_engine(model)
        ours = served(model, input_ids=ids, past_key_values=copy.deepcopy(noise), max_new_tokens=5)
        again = served(model, input_ids=ids, past_key_values=copy.deepcopy(noise), max_new_tokens=5)
        plain = served(model, input_ids=ids, max_new_tokens=5)
        assert engine.block_manager.stats.hit_tokens == 0
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(ours, with_noise) and torch.equal(again, with_noise)
    assert torch.equal(plain, plain_expected)


def test_a_preempted_request_imports_its_kv_again():
    model = tiny_model("llama")
    prompts = varied_prompts(6, seed=4)[2:6]
    caches, expected = [], []
    for prompt in prompts:
        with torch.no_grad():
            cache = model(torch.tensor([prompt[:-3]]), past_key_values=DynamicCache(config=model.config))
        cache = cache.past_key_values
        caches.append(
            [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]
        )
        out = hf(
            model, input_ids=torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
        expected.append(out[0, len(prompt) :].tolist())
    block_bytes = 2 * 2 * 2 * 16 * 4 * 8  # K and V, 2 layers, 2 KV heads, head dim 16, float32, 8 tokens
    engine = Engine(
        model, EngineConfig(block_size=8, kv_cache_memory=20 * block_bytes, max_num_batched_tokens=32)
    )
    requests = []
    for prompt, kv in zip(prompts, caches):
        request = engine.make_request(prompt, StoppingParams(24, 24, frozenset({EOS})))
        attach_kv(engine, request, kv)
        requests.append(request)
    engine.run(requests)
    assert engine.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in requests] == expected


def _static(model, ids):
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(ids[:, :2], past_key_values=cache)
    return cache


def _legacy(model, ids):
    with torch.no_grad():
        cache = model(ids[:, :2], past_key_values=DynamicCache(config=model.config)).past_key_values
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def _too_long(model, ids):
    with torch.no_grad():
        return model(ids, past_key_values=DynamicCache(config=model.config)).past_key_values


def _other_batch(model, ids):
    with torch.no_grad():
        return model(
            ids[:, :2].repeat(2, 1), past_key_values=DynamicCache(config=model.config)
        ).past_key_values


@pytest.mark.parametrize("make", [_static, _legacy, _too_long, _other_batch])
def test_unserved_caches_fall_back_with_the_warning(make):
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    cache = make(model, ids)
    hfaccel.patch(model)
    try:
        # HF's own generate may refuse the cache: that is its answer
        suppress = contextlib.suppress(ValueError, RuntimeError, IndexError)
        with pytest.warns(UserWarning, match="past_key_values.* falls back"), suppress:
            model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    finally:
        hfaccel.unpatch(model)


def test_strict_mode_refuses_an_unserved_cache():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    hfaccel.patch(model, strict=True)
    try:
        with pytest.raises(ValueError, match="StaticCache"):
            model.generate(input_ids=ids, past_key_values=_static(model, ids), max_new_tokens=2)
    finally:
        hfaccel.unpatch(model)


def _sliding(kind):
    if kind == "mistral":
        from tests.patches.test_masks_and_windows import _windowed_model

        return _windowed_model(window=8)
    from hfaccel.bench.families import family_model

    # sliding and full layers, alternating (given whole: 5.17's config keeps 26 default layer types)
    return family_model("gemma2", sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_cache_with_sliding_window_layers_continues_as_hf_and_is_extended_as_hf_extends_it(kind):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = _sliding(kind)
    ids, mask = left_padded(varied_prompts(6, seed=2)[1:5])  # up to 43 tokens: past the window of 8
    hf_first = hf(model, input_ids=ids, attention_mask=mask, **FIRST)
    assert isinstance(hf_first.past_key_values.layers[0], DynamicSlidingWindowLayer)
    hfaccel.patch(model, **SMALL_ENGINE)
    try:
        first = served(model, input_ids=ids, attention_mask=mask, **FIRST)
        assert torch.equal(first.sequences, hf_first.sequences)
        seq, seq_mask = extended(first.sequences, mask, [[40, 41]] * 4)
        lengths = {
            "max_new_tokens": 6,
            "min_new_tokens": 6,
            "do_sample": False,
            "return_dict_in_generate": True,
        }
        ours_cache, theirs_cache = (
            copy.deepcopy(first.past_key_values),
            copy.deepcopy(hf_first.past_key_values),
        )
        ours = served(model, input_ids=seq, attention_mask=seq_mask, past_key_values=ours_cache, **lengths)
        theirs = hf(model, input_ids=seq, attention_mask=seq_mask, past_key_values=theirs_cache, **lengths)
        assert torch.equal(ours.sequences, theirs.sequences)
        assert torch.equal(
            ours.sequences, hf(model, input_ids=seq, attention_mask=seq_mask, **lengths).sequences
        )
        for mine, hfs in zip(ours_cache.layers, theirs_cache.layers):  # extended in place, as HF extends it
            assert type(mine) is type(hfs) and mine.keys.shape == hfs.keys.shape
            assert getattr(mine, "cumulative_length", 0) == getattr(hfs, "cumulative_length", 0)
            # HF holds the pad tokens' K/V where we hold zeros: compare the real positions held
            everything = torch.cat([seq_mask.bool(), torch.ones(len(seq_mask), 5, dtype=torch.bool)], dim=1)
            real = everything[:, -mine.keys.shape[-2] :][:, None, :, None].expand_as(mine.keys)
            torch.testing.assert_close(mine.keys[real], hfs.keys[real], atol=1e-5, rtol=1e-4)
    finally:
        hfaccel.unpatch(model)


def test_a_cache_given_with_a_cache_implementation_goes_to_hf_which_refuses_it():
    """HF raises for a cache given beside ``cache_implementation``: the call falls back, so it raises too."""
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        first = type(model).generate(
            model, ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True
        )
    hfaccel.patch(model, kv_cache_memory=4_000_000)
    try:
        cache = copy.deepcopy(getattr(first, CACHE_NAME))
        with (
            pytest.warns(UserWarning, match="a cache given with cache_implementation='static'"),
            pytest.raises(ValueError, match="Passing both `cache_implementation`"),
        ):
            model.generate(
                first.sequences, max_new_tokens=3, cache_implementation="static", **{CACHE_NAME: cache}
            )
    finally:
        hfaccel.unpatch(model)
