"""`model.generate(inputs_embeds=...)` on the engine: prompts prefilled from embeddings equal HF's generate."""

import contextlib
import warnings

import pytest
import torch

import hfaccel
from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.prompt_inputs import attach_prompt_embeds
from hfaccel.engine.request import StoppingParams
from tests.helpers import EOS, hf, left_padded, tiny_model, varied_prompts


def embeddings(model, ids, seed=0):
    """The model's embeddings of `ids`, moved off them a little: a prompt no id sequence gives."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        base = model.get_input_embeddings()(ids)
    return base + 0.05 * torch.randn(base.shape, generator=g)


def served(model, **kwargs):
    """The patched generate, failing if it falls back."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hfaccel: .* falls back")
        return model.generate(**kwargs)


@pytest.fixture
def prompts():
    return varied_prompts(8, seed=3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_embeddings_only_left_padded_batch_equals_hf(family, prompts):
    model = tiny_model(family)
    ids, mask = left_padded(prompts)
    embeds = embeddings(model, ids)
    kwargs = {"inputs_embeds": embeds, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False}
    expected = hf(model, **kwargs)
    # A small token budget: the longer prompts prefill in chunks, each chunk from its embeddings.
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000, max_num_batched_tokens=24)
    try:
        out = served(model, **kwargs)
    finally:
        hfaccel.unpatch(model)
    assert out.shape == expected.shape == (len(prompts), 8), "only the new tokens come back"
    assert torch.equal(out, expected)


def test_ids_and_embeddings_equal_hf(prompts):
    model = tiny_model("llama")
    ids, mask = left_padded(prompts)
    kwargs = {
        "input_ids": ids,
        "inputs_embeds": embeddings(model, ids),
        "attention_mask": mask,
        "max_new_tokens": 6,
        "do_sample": False,
    }
    expected = hf(model, **kwargs)
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000)
    try:
        out = served(model, **kwargs)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out[:, : ids.shape[1]], ids), "the output starts with the ids"
    assert torch.equal(out, expected)


@pytest.mark.parametrize("with_ids", [False, True])
def test_beam_search_from_embeddings_equals_hf(prompts, with_ids):
    """Beams over embedded prompts (left padded, a hole in one): HF's hypotheses, and with a dict output
    its scores, beam indices and the cache of the final beams, the prompt part as wide as the
    embeddings."""
    model = tiny_model("llama")
    ids, mask = left_padded(prompts[:3])
    mask[1, -3] = 0
    kwargs = {
        "inputs_embeds": embeddings(model, ids),
        "attention_mask": mask,
        "max_new_tokens": 5,
        "num_beams": 3,
        "num_return_sequences": 2,
        "do_sample": False,
        "eos_token_id": None,
        "return_dict_in_generate": True,
        "output_scores": True,
    }
    if with_ids:
        kwargs["input_ids"] = ids
    expected = hf(model, **kwargs)
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000, strict=True)  # a fallback would raise
    try:
        out = served(model, **kwargs)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.sequences.shape[1] == 5 + (ids.shape[1] if with_ids else 0)
    assert torch.equal(out.beam_indices, expected.beam_indices)
    torch.testing.assert_close(out.sequences_scores, expected.sequences_scores)
    for mine, theirs in zip(out.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    mine, theirs = out.past_key_values.layers[0].keys, expected.past_key_values.layers[0].keys
    assert mine.shape == theirs.shape
    torch.testing.assert_close(mine[:, :, ids.shape[1] :], theirs[:, :, ids.shape[1] :])


def test_lengths_processors_copies_and_cache_follow_hf(prompts):
    model = tiny_model("llama")
    ids, mask = left_padded(prompts[:4])
    embeds = embeddings(model, ids, seed=1)
    calls = [
        {"max_length": ids.shape[1] + 3},  # HF: max_length counts the embeddings
        {},  # HF's default max_length: 20 new tokens
        {"max_new_tokens": 6, "repetition_penalty": 1.5},  # processors see the new tokens only
        {"max_new_tokens": 5, "num_return_sequences": 2, "do_sample": True, "top_k": 1},  # copies
        {"max_new_tokens": 4, "return_dict_in_generate": True, "use_cache": False},  # HF turns the cache on
    ]
    calls = [{"do_sample": False, **extra} for extra in calls]
    expected = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's notes on max_length and on the penalty without ids
        for extra in calls:
            expected.append(hf(model, inputs_embeds=embeds, attention_mask=mask, **extra))
        hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000)
        try:
            outs = [served(model, inputs_embeds=embeds, attention_mask=mask, **extra) for extra in calls]
        finally:
            hfaccel.unpatch(model)
    for extra, out, ref in zip(calls[:4], outs, expected):
        assert torch.equal(out, ref), extra
    out, ref = outs[4], expected[4]
    assert torch.equal(out.sequences, ref.sequences)
    assert out.past_key_values is not None and ref.past_key_values is not None
    real = torch.cat([mask, torch.ones(len(mask), 3, dtype=mask.dtype)], dim=1).bool()
    for ours, theirs in zip(out.past_key_values.layers, ref.past_key_values.layers):
        assert ours.keys.shape == theirs.keys.shape == (4, 2, ids.shape[1] + 3, 16)
        for i in range(4):
            torch.testing.assert_close(ours.keys[i][:, real[i]], theirs.keys[i][:, real[i]])
            torch.testing.assert_close(ours.values[i][:, real[i]], theirs.values[i][:, real[i]])


def test_prefix_cache_never_matches_an_embedded_prompt_by_its_ids():
    model = tiny_model("llama")
    prompt = varied_prompts(4, seed=9)[2]  # 37 tokens: four full blocks of 8
    ids = torch.tensor([prompt])
    embeds = embeddings(model, ids, seed=2)
    placeholders = torch.zeros_like(ids)  # what an embeddings-only prompt's ids are made of
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000)
    try:
        engine = model._hfaccel.get_engine(model)
        for cached in (ids, placeholders):  # put both id sequences' blocks in the prefix cache
            served(
                model,
                input_ids=cached,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=2,
                do_sample=False,
            )
        hits = engine.block_manager.stats.hit_tokens
        both = served(model, input_ids=ids, inputs_embeds=embeds, max_new_tokens=6, do_sample=False)
        only = served(model, inputs_embeds=embeds, max_new_tokens=6, do_sample=False)
        again = served(model, inputs_embeds=embeds, max_new_tokens=6, do_sample=False)
        assert engine.block_manager.stats.hit_tokens == hits, "no embedded prompt hit the prefix cache"
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(
        both, hf(model, input_ids=ids, inputs_embeds=embeds, max_new_tokens=6, do_sample=False)
    )
    assert torch.equal(only, hf(model, inputs_embeds=embeds, max_new_tokens=6, do_sample=False))
    assert torch.equal(again, only)


def test_a_preempted_embedded_prompt_is_recomputed_from_its_embeddings():
    model = tiny_model("llama")
    prompts = varied_prompts(6, seed=4)[2:6]
    embeds = [embeddings(model, torch.tensor([p]), seed=i)[0] for i, p in enumerate(prompts)]
    expected = [
        hf(model, inputs_embeds=e[None], max_new_tokens=24, min_new_tokens=24, do_sample=False)[0].tolist()
        for e in embeds
    ]
    # Room for about two of the four requests at their full length: the newest ones are preempted.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 8  # K and V, 2 layers, 2 KV heads, head dim 16, float32, 8 tokens
    config = EngineConfig(block_size=8, kv_cache_memory=20 * block_bytes, max_num_batched_tokens=32)
    engine = Engine(model, config)
    requests = []
    for e in embeds:
        request = engine.make_request([0] * len(e), StoppingParams(24, 24, frozenset({EOS})))
        attach_prompt_embeds(engine, request, e, hide_prompt=True)
        requests.append(request)
    engine.run(requests)
    assert engine.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in requests] == expected


def test_embedded_prefill_never_runs_through_the_compiled_decode_path():
    """A one-token embedded prompt is scheduled like a decode (one token): it must still run eager."""
    model = tiny_model("llama")
    embeds = embeddings(model, torch.tensor([[7]]), seed=5)
    expected = hf(model, inputs_embeds=embeds, max_new_tokens=5, do_sample=False)[0].tolist()
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=4_000_000, compile="decode"))
    compiled_steps = []

    def fake_compile(dynamic):  # records what the compiled path gets; runs it eager
        def run(input_ids, positions, logits_indices):
            compiled_steps.append(input_ids.shape)
            return engine.executor._model_forward(input_ids, positions, logits_indices)

        return run

    engine.executor.compile = fake_compile
    request = engine.make_request([0], StoppingParams(max_new_tokens=5))
    attach_prompt_embeds(engine, request, embeds[0], hide_prompt=True)
    engine.run([request])
    assert request.output_token_ids == expected
    assert len(compiled_steps) == 4, "the four decode steps ran compiled, the embedded prefill eager"


@pytest.mark.parametrize(
    "case",
    ["dtype", "shape", "width"],
)
def test_unserved_embeddings_fall_back_with_the_warning(case):
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    embeds = embeddings(model, ids)
    kwargs = {"inputs_embeds": embeds, "max_new_tokens": 3, "do_sample": False}
    if case == "dtype":
        kwargs["inputs_embeds"] = embeds.double()
    elif case == "shape":
        kwargs["input_ids"] = torch.tensor([[5, 6]])
    else:
        kwargs["inputs_embeds"] = torch.cat([embeds, embeds], dim=-1)
    hfaccel.patch(model)
    try:
        # HF's own generate may refuse these inputs: that is its answer
        suppress = contextlib.suppress(RuntimeError, ValueError, IndexError)
        with pytest.warns(UserWarning, match="falls back"), suppress:
            model.generate(**kwargs)
    finally:
        hfaccel.unpatch(model)


def test_a_streamer_sees_what_hf_shows_it():
    """Embeddings only: HF first puts the empty prompt ([1, 0]), then each new token."""

    class Collect:
        def __init__(self):
            self.puts, self.ended = [], 0

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended += 1

    model = tiny_model("llama")
    embeds = embeddings(model, torch.tensor([[5, 6, 7, 8]]), seed=6)
    theirs, ours = Collect(), Collect()
    hf(model, inputs_embeds=embeds, max_new_tokens=5, do_sample=False, streamer=theirs)
    hfaccel.patch(model)
    try:
        served(model, inputs_embeds=embeds, max_new_tokens=5, do_sample=False, streamer=ours)
    finally:
        hfaccel.unpatch(model)
    assert ours.puts == theirs.puts and ours.puts[0] == [[]]
    assert ours.ended == theirs.ended == 1


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padded"])
def test_generation_continues_from_embeddings_and_the_cache_it_returned(padded):
    """transformers' `test_generate_continue_from_inputs_embeds`: the embeddings of the whole sequence
    with the cache of all but its last positions; the engine imports the cache and feeds the rest."""
    from hfaccel.patches.arguments import CACHE_NAME

    model = tiny_model("llama")
    ids, mask = left_padded([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]])
    embeds = embeddings(model, ids)
    dict_out = {"return_dict_in_generate": True, "do_sample": False}

    def flow(generate):
        first_mask = {"attention_mask": mask} if padded else {}
        first = generate(inputs_embeds=embeds, max_new_tokens=3, **first_mask, **dict_out)
        with torch.no_grad():
            more = torch.cat([embeds, model.get_input_embeddings()(first.sequences)], dim=1)
        more_mask = {"attention_mask": torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)}
        cache = {CACHE_NAME: getattr(first, CACHE_NAME)}
        return first, generate(
            inputs_embeds=more, max_new_tokens=4, **(more_mask if padded else {}), **cache, **dict_out
        )

    expected = flow(lambda **kwargs: type(model).generate(model, **kwargs))
    hfaccel.patch(model)
    try:
        out = flow(lambda **kwargs: served(model, **kwargs))
    finally:
        hfaccel.unpatch(model)
    for ours, theirs in zip(out, expected):
        assert torch.equal(ours.sequences, theirs.sequences)
    layers = zip(getattr(out[1], CACHE_NAME).layers, getattr(expected[1], CACHE_NAME).layers)
    for ours, theirs in layers:  # the attended columns (HF keeps the pad tokens' K/V in the others)
        seen = torch.ones(ours.keys.shape[0], ours.keys.shape[2], dtype=torch.bool)
        seen[:, : mask.shape[1]] = mask.bool() if padded else True
        rows, columns = seen.nonzero(as_tuple=True)
        torch.testing.assert_close(
            ours.keys[rows, :, columns], theirs.keys[rows, :, columns], rtol=1e-4, atol=1e-4
        )
