"""Misuse is caught early, with a message that says what to do instead."""

import asyncio

import pytest
import torch
from transformers import DynamicCache

import hfaccel
from hfaccel.config import EngineConfig
from hfaccel.patches.arguments import CACHE_NAME
from tests.helpers import hf_greedy, tiny_model, tiny_tokenizer


def _generate(model, prompts, **kwargs):
    return hfaccel.generate(model, prompts, progress=False, **kwargs)


def _stream(model, prompts, **kwargs):
    return list(hfaccel.stream(model, prompts, **kwargs))


def _agenerate(model, prompts, **kwargs):
    return asyncio.run(hfaccel.agenerate(model, prompts, **kwargs))


def _astream(model, prompts, **kwargs):
    async def collect():
        return [event async for event in hfaccel.astream(model, prompts, **kwargs)]

    return asyncio.run(collect())


ENTRY_POINTS = {
    "hfaccel.generate": _generate,
    "hfaccel.stream": _stream,
    "hfaccel.agenerate": _agenerate,
    "hfaccel.astream": _astream,
}

# (argument, the name suggested in the message)
OTHER_NAMES = [
    ("max_tokens", "max_new_tokens"),
    ("stop", "stop_strings"),
    ("n", "num_return_sequences"),
    ("max_new_token", "max_new_tokens"),  # a typo: a close match
    ("temprature", "temperature"),
]


@pytest.mark.parametrize("where", ENTRY_POINTS)
@pytest.mark.parametrize(("name", "hint"), OTHER_NAMES, ids=[n for n, _ in OTHER_NAMES])
def test_unknown_arguments_raise_with_a_suggestion(where, name, hint):
    model = tiny_model()
    with pytest.raises(ValueError) as info:
        ENTRY_POINTS[where](model, [[5, 6, 7]], **{name: 4})
    message = str(info.value)
    assert f"{where} got unknown keyword argument(s) {name!r} (did you mean {hint}?)" in message
    assert "GenerationConfig fields" in message
    assert not hasattr(model, "_hfaccel"), "nothing was left patched"


def test_every_unknown_name_is_listed_and_nothing_runs():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=1_000_000)
    with pytest.raises(ValueError, match=r"'max_tokens' \(did you mean max_new_tokens\?\), 'colour'"):
        _generate(model, [[5, 6]], max_tokens=3, colour="red")
    assert model._hfaccel.engine is None, "refused before the engine was built"


@pytest.mark.parametrize(("name", "hint"), OTHER_NAMES, ids=[n for n, _ in OTHER_NAMES])
def test_patched_model_generate_refuses_what_hf_refuses(name, hint):
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="not used by the model"):  # HF's own refusal
        type(model).generate(model, ids, max_new_tokens=2, **{name: 4})
    hfaccel.patch(model, kv_cache_memory=1_000_000)
    with pytest.raises(ValueError, match=rf"model.generate got unknown keyword argument\(s\) '{name}' "):
        model.generate(ids, max_new_tokens=2, **{name: 4})
    assert model._hfaccel.engine is None


# Names transformers' generate takes (config fields, its own parameters, the model's inputs, None
# values) and names it refuses, on a Llama: the patched generate must agree on every one.
HF_NAMES = [
    ("use_cache", True),
    ("renormalize_logits", True),
    ("position_ids", None),
    ("token_type_ids", torch.zeros(1, 3, dtype=torch.long)),
    ("output_router_logits", False),
    ("synced_gpus", False),
    ("trust_remote_code", False),
    ("tokenizer", None),
    ("my_custom_flag", None),
    ("my_custom_flag", 1),
    ("max_tokens", 3),
    ("logprobs", True),
]


@pytest.mark.parametrize(("name", "value"), HF_NAMES, ids=[f"{n}={v!r}"[:30] for n, v in HF_NAMES])
def test_acceptance_set_is_hfs(name, value):
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7]])

    def refused(generate):
        try:
            generate(ids, max_new_tokens=2, do_sample=False, **{name: value})
        except ValueError as error:
            return "not used by the model" in str(error) or "unknown keyword argument" in str(error)
        return False

    hf = refused(lambda *a, **k: type(model).generate(model, *a, **k))
    hfaccel.patch(model, kv_cache_memory=1_000_000)
    assert refused(model.generate) == hf


def test_custom_entries_of_the_models_generation_config_are_accepted():
    model = tiny_model()
    model.generation_config.my_option = 3  # HF carries custom entries over, so may a call
    assert len(_generate(model, [[5, 6]], max_new_tokens=2, my_option=4)[0].token_ids) == 2


def test_model_inputs_are_refused_by_the_list_api():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"takes prompts as lists, not model inputs: \['attention_mask'\]"):
        _generate(model, [[5, 6]], attention_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match=rf"not model inputs: \['{CACHE_NAME}'\]"):  # either of its names
        _generate(model, [[5, 6]], past_key_values=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="hfaccel.generate does not take inputs=: pass the prompts"):
        _generate(model, [[5, 6]], inputs=torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match="hfaccel.stream does not take streamer=: iterate hfaccel.stream"):
        _stream(model, [[5, 6]], streamer=object())


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_tokenizer_output_is_refused_saying_what_to_pass(where):
    import numpy as np

    model, tokenizer = tiny_model(), tiny_tokenizer()
    encoding = tokenizer(["hi", "there"])
    for prompts in (encoding, dict(encoding)):
        with pytest.raises(ValueError, match=r"prompts is a dict .*pass prompts=enc\['input_ids'\]"):
            ENTRY_POINTS[where](model, prompts, tokenizer=tokenizer, max_new_tokens=2)
    padded = tokenizer(["hi", "there"], padding=True, return_tensors="pt")["input_ids"]
    texts = ENTRY_POINTS[where](model, np.array(["hi", "there"]), tokenizer=tokenizer, max_new_tokens=2)
    assert {getattr(r, "prompt_index", getattr(r, "index", None)) for r in texts} == {0, 1}  # strings
    for batch in (padded, padded.numpy()):  # return_tensors="pt" or "np"
        with pytest.raises(
            ValueError, match="prompts is a 2-D tensor or array: pass a list of token-id lists"
        ):
            ENTRY_POINTS[where](model, batch, max_new_tokens=2)
    # enc["input_ids"] as lists is what to pass
    ids = encoding["input_ids"]
    results = ENTRY_POINTS[where](model, ids, max_new_tokens=2)
    assert {getattr(r, "prompt_index", None) for r in results} == {0, 1}


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_a_single_prompt_is_a_batch_of_one(where):
    model, tokenizer = tiny_model(), tiny_tokenizer()
    conversation = [{"role": "user", "content": "hi"}]
    expected = hf_greedy(
        model, tokenizer.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"], 3
    )
    import numpy as np

    ones = ([5, 6, 7], torch.tensor([5, 6, 7]), np.array([5, 6, 7]), list(np.array([5, 6, 7])))
    for prompt in ("hello", conversation, *ones, list(torch.tensor([5, 6, 7]))):
        results = ENTRY_POINTS[where](model, prompt, tokenizer=tokenizer, max_new_tokens=3)
        if where.endswith("generate"):
            assert len(results) == 1 and results[0].prompt_index == 0
            tokens = results[0].token_ids
        else:
            assert {e.index for e in results} == {0}
            tokens = [e.token_id for e in results]
        if prompt is conversation:
            assert tokens == expected
        if not isinstance(prompt, str) and prompt is not conversation:  # one prompt of ids, however given
            assert tokens == hf_greedy(model, [5, 6, 7], 3)


def test_a_draft_models_kv_counts_in_the_budget_patch_checks():
    """The draft model's cache has as many blocks as the model's, paid from the same kv_cache_memory:
    patch counts both (it counted the model's alone, and generate refused the prompts later)."""
    import copy

    model = tiny_model()  # 512 B a token (8,192 a block of 16); with its copy as the draft, 16,384 a block
    hfaccel.patch(copy.deepcopy(model), kv_cache_memory=200_000, max_model_len=256)  # alone: 24 of 16 blocks
    with pytest.raises(
        ValueError,
        match=r"holds 12 KV blocks of 16 tokens \(16,384 bytes each for this model and its draft model in "
        r"torch.float32\), but one request of max_model_len=256 tokens needs 16",
    ):
        hfaccel.patch(model, kv_cache_memory=200_000, max_model_len=256, speculative=copy.deepcopy(model))


def test_kv_cache_too_small_for_one_full_request_raises_at_patch():
    model = tiny_model()  # 512 positions; 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 512 B/token
    with pytest.raises(
        ValueError,
        match=r"kv_cache_memory \(100,000 bytes\) holds 12 KV blocks of 16 tokens \(8,192 bytes each .*\), "
        r"but one request of max_model_len=512 tokens needs 32: raise kv_cache_memory to at least "
        r"262,144 bytes, or set max_model_len to at most 192",
    ):
        hfaccel.patch(model, kv_cache_memory=100_000)
    assert not hasattr(model, "_hfaccel")
    hfaccel.patch(model, kv_cache_memory=100_000, max_model_len=192)  # what the message says works
    assert len(_generate(model, [[5, 6]], max_new_tokens=3)[0].token_ids) == 3
    with pytest.raises(ValueError, match="kv_cache_memory"):  # a re-patch is checked too, and changes nothing
        hfaccel.patch(model, max_model_len=512)
    assert model._hfaccel.config.max_model_len == 192


def test_other_engine_config_errors_raise_at_patch():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"max_model_len \(1024\) exceeds what the model supports \(512\)"):
        hfaccel.patch(model, max_model_len=1024)
    with pytest.raises(ValueError, match="dtype torch.int16 cannot hold a KV cache"):
        hfaccel.patch(model, dtype=torch.int16)
    with pytest.raises(ValueError, match="dtype torch.float8_e5m2 cannot hold a KV cache"):
        hfaccel.patch(model, EngineConfig(dtype=torch.float8_e5m2))
    if not torch.cuda.is_available():  # under TRITON_INTERPRET (set for tests) Triton runs on a CPU
        with pytest.raises(ValueError, match="backend 'flashinfer' cannot serve this model here"):
            hfaccel.patch(model, backend="flashinfer")
    assert not hasattr(model, "_hfaccel")


def test_patch_again_changes_only_the_fields_given():
    model = hfaccel.patch(tiny_model(), block_size=8, kv_cache_memory=1_000_000, strict=True)
    _generate(model, [[5, 6]], max_new_tokens=2)
    engine = model._hfaccel.engine
    hfaccel.patch(model, max_num_seqs=4)
    config = model._hfaccel.config
    assert (config.block_size, config.kv_cache_memory, config.max_num_seqs) == (8, 1_000_000, 4)
    assert model._hfaccel.strict, "strict stays unless given"
    assert model._hfaccel.engine is None, "a changed config rebuilds the engine"
    _generate(model, [[5, 6]], max_new_tokens=2)
    engine = model._hfaccel.engine
    hfaccel.patch(model, max_num_seqs=4, progress=False)  # the same values: nothing to rebuild
    hfaccel.patch(model)
    assert model._hfaccel.engine is engine and model._hfaccel.strict
    hfaccel.patch(model, EngineConfig(kv_cache_memory=2_000_000))  # a whole config replaces the config
    assert model._hfaccel.config == EngineConfig(kv_cache_memory=2_000_000)
    hfaccel.patch(model, strict=False)
    assert not model._hfaccel.strict and model._hfaccel.config.kv_cache_memory == 2_000_000


def test_others_completed_is_said_only_when_others_exist():
    model = tiny_model()
    with pytest.raises(hfaccel.RequestError) as info:
        _generate(model, [[], [5] * 600], max_new_tokens=2)
    message = str(info.value)
    assert message.startswith("2 of 2 requests refused (see .completions): prompts[0]: ")
    assert "others" not in message and "prompts[1]: prompt has 600 tokens" in message
    with pytest.raises(hfaccel.RequestError, match=r"^1 of 2 requests refused, the others completed"):
        _generate(model, [[], [5, 6]], max_new_tokens=2)


def test_bad_logprobs_values_raise():
    model = tiny_model()
    with pytest.raises(ValueError, match="logprobs must be True, False, or an int k >= 0"):
        _generate(model, [[5]], logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs must be an int k >= 0"):
        _generate(model, [[5]], prompt_logprobs="all")


@pytest.mark.parametrize("seed", ["1", 1.5, 2**64, -1, True])
def test_a_seed_that_is_not_an_int_in_range_is_refused_naming_it(seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        _generate(tiny_model(), [[5, 6]], seed=seed, max_new_tokens=2, do_sample=True)


@pytest.mark.parametrize("name", ["errors", "progress", "prompt_logprobs"])
def test_a_stream_says_which_of_generates_parameters_it_does_not_take(name):
    with pytest.raises(
        ValueError, match=rf"hfaccel.stream does not take {name}= \(hfaccel.generate's parameter\)"
    ):
        next(iter(hfaccel.stream(tiny_model(), [[5, 6]], max_new_tokens=2, **{name: 1})))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"prompts": 5}, ValueError, "prompts must be a string, a list of token ids, .*got int"),
        (
            {"adapter": 3},
            TypeError,
            r"adapter must be an adapter's name, None, or a list \(in prompt order\)",
        ),
        ({"adapter": ["a", 3]}, TypeError, r"adapter\[1\] must be an adapter's name or None"),
        ({"adapter": {"a", "b"}}, TypeError, r"adapter must be .* a list \(in prompt order\)"),
        ({"tokenizer": "gpt2"}, TypeError, "tokenizer must be a transformers tokenizer"),
        (
            {"generation_config": {"max_new_tokens": 2}},
            TypeError,
            "generation_config must be a GenerationConfig",
        ),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_naming_them(kwargs, error, message):
    """Before anything runs (a tokenizer that cannot decode raised only once everything had run)."""
    model = tiny_model()
    prompts = kwargs.pop("prompts", [[5, 6], [7]])
    for call in ENTRY_POINTS.values():
        with pytest.raises(error, match=message):
            call(model, prompts, max_new_tokens=2, **kwargs)


def test_integer_scalars_are_taken_for_seed_and_logprobs():
    import numpy as np

    model = tiny_model()
    plain = _generate(model, [[5, 6]], seed=3, logprobs=2, max_new_tokens=3, do_sample=True)[0]
    for seed, k in ((torch.tensor(3), np.int64(2)), (np.int64(3), torch.tensor(2).item())):
        again = _generate(model, [[5, 6]], seed=seed, logprobs=k, max_new_tokens=3, do_sample=True)[0]
        assert again.token_ids == plain.token_ids and len(again.top_logprobs[0]) >= 2


def test_patch_and_unpatch_name_their_wrong_arguments():
    model = tiny_model()
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        hfaccel.patch(model, config={"max_num_seqs": 2})
    with pytest.raises(TypeError, match="strict must be True or False, got 'no'"):
        hfaccel.patch(model, strict="no")
    with pytest.raises(TypeError, match="progress must be True or False"):
        hfaccel.patch(model, progress=1)
    import numpy as np

    hfaccel.patch(model, strict=np.True_, progress=np.False_)  # numpy's booleans are booleans
    assert model._hfaccel.strict is True and model._hfaccel.progress is False
    hfaccel.unpatch(model)
    with pytest.raises(TypeError, match="unpatch takes the model hfaccel.patch was given, got NoneType"):
        hfaccel.unpatch(None)
    assert getattr(model, "_hfaccel", None) is None


def test_notebook_plots_say_the_model_has_not_generated():
    from hfaccel.notebook import plot_cost_model, plot_run

    pytest.importorskip("matplotlib")
    model = tiny_model()
    with pytest.raises(ValueError, match="plot_cost_model takes an Engine or .* is not patched"):
        plot_cost_model(model)
    hfaccel.patch(model)
    with pytest.raises(ValueError, match="plot_run takes an Engine or .* has not generated yet"):
        plot_run(model)
    hfaccel.unpatch(model)
