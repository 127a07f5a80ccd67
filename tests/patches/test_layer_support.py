"""The guard at `patch`: a layer kind, an attention argument or a module the engine does not implement
is refused with the reason, never run with wrong tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

import hfaccel
from hfaccel.bench.families import family_model
from hfaccel.patches.attention import AttentionCall
from hfaccel.patches.layer_support import arguments_reason, calls_reason
from tests.helpers import assert_same_or_near_tie, hf_greedy, left_padded, tiny_model, varied_prompts

# Tiny random models of each family (transformers' testers' sizes, weights large enough that every
# layer matters): the family matrix's own (`bench/families.py`), with a test's changes on top.
REFUSED = {
    "llama4_text": (
        {"attention_chunk_size": None},
        "chunked attention layers without an attention_chunk_size",
    ),
    "minimax": ({}, "linear-attention or recurrent layers"),  # lightning attention: no state API
    "lfm2": ({"layer_types": ["conv", "full_attention", "telepathy", "full_attention"]}, "'telepathy'"),
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_families_the_engine_would_run_wrong_are_refused_at_patch(model_type):
    extra, reason = REFUSED[model_type]
    model = family_model(model_type, **extra)
    original = model.generate
    with pytest.raises(ValueError, match=f"hfaccel cannot serve .*{reason}"):
        hfaccel.patch(model)
    assert not hasattr(model, "_hfaccel") and model.generate == original  # nothing was patched


def test_soft_capping_under_transformers_sdpa_attention_is_refused():
    """transformers' sdpa attention ignores `softcap` (5.17 runs Gemma 2 on it; 5.24 forces eager): its
    own output is not soft-capped, so the engine, which caps, would differ. Refused, saying what to do."""
    model = family_model("gemma2")
    model.config._attn_implementation = "sdpa"
    with pytest.raises(
        ValueError, match="sdpa attention, which ignores soft-capping.*attn_implementation='eager'"
    ):
        hfaccel.patch(model)
    hfaccel.unpatch(hfaccel.patch(family_model("gemma2")))  # eager: served


def test_a_made_up_layer_type_is_refused():
    model = tiny_model("llama", layers=2)
    model.config.layer_types = ["full_attention", "telepathic_attention"]
    with pytest.raises(ValueError, match=r"layers of type 'telepathic_attention' .*layer_types\[1\]"):
        hfaccel.patch(model)


def test_a_sequence_convolution_anywhere_is_refused():
    model = tiny_model("llama", layers=2)
    model.model.layers[1].mixer = torch.nn.Conv1d(64, 64, 4, groups=64)  # never called: it is there
    with pytest.raises(ValueError, match=r"model.layers.1 \(LlamaDecoderLayer\) convolves over the sequence"):
        hfaccel.patch(model)


def test_a_layer_that_skips_attention_is_refused():
    model = tiny_model("llama", layers=3)
    layer = model.model.layers[1]
    layer.self_attn.forward = lambda hidden_states, *args, **kwargs: (hidden_states.cumsum(1), None)
    with pytest.raises(ValueError, match=r"decoder layers \[1\] never call the attention function"):
        hfaccel.patch(model)


def call(layer=0, q=(1, 4, 4, 16), k=(1, 2, 4, 16), v=(1, 2, 4, 16), **kwargs):
    return AttentionCall(layer, q, k, v, kwargs)


def test_unknown_attention_arguments_are_refused_and_neutral_ones_pass():
    assert arguments_reason(call(position_ids=torch.zeros(1, 4), use_cache=False, softcap=None), None) is None
    assert arguments_reason(call(s_aux=torch.zeros(4), softcap=30.0), None) is None  # served
    assert "not one logit per query head" in arguments_reason(call(s_aux=torch.zeros(2)), None)
    assert "passes mystery_bias=1.5" in arguments_reason(call(mystery_bias=1.5), None)
    assert "is_causal=False" in arguments_reason(call(is_causal=False), None)


def _doge_with_a_learned_bias() -> Any:
    model = family_model("doge", sliding_window=None)  # its mask slides only where the config says
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.normal_(0, 1.0)  # trained: its dynamic mask biases every key
    return model


NOT_CAUSAL = {
    # Doge adds a learned per-key bias into the mask it hands attention (tokens differed from the first).
    "doge": (_doge_with_a_learned_bias, "builds an attention mask of its own"),
    # AutoModelForCausalLM over a BERT checkpoint (is_decoder=False): bidirectional layers.
    "bert": (lambda: family_model("bert"), "attention is not causal"),
    # EmbeddingGemma's: a bidirectional mask, said by the module's is_causal and no keyword.
    "gemma3_text": (
        lambda: family_model("gemma3_text", use_bidirectional_attention=True),
        "attention is not causal",
    ),
}


@pytest.mark.parametrize("model_type", sorted(NOT_CAUSAL))
def test_layers_that_attend_other_than_causally_without_saying_so_are_refused(model_type):
    """Layers whose attention is not plain causal though they pass no keyword saying so (this session's
    family probe found each giving other tokens than HF, silently)."""
    build, reason = NOT_CAUSAL[model_type]
    model = build()
    if model_type != "doge":  # the bidirectional ones: a token's logits see the tokens after it
        ids = torch.tensor([list(range(40, 59))])
        with torch.no_grad():
            assert not torch.equal(model(ids).logits[0, 3], model(ids[:, :4]).logits[0, 3])
    with pytest.raises(ValueError, match=f"hfaccel cannot serve .*{reason}"):
        hfaccel.patch(model)
    assert not hasattr(model, "_hfaccel")


def test_a_mask_a_layer_hands_attention_must_be_causal_within_its_window():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert arguments_reason(call(), None) is None
    assert (
        arguments_reason(AttentionCall(0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, causal), None)
        is None
    )
    additive = torch.zeros(1, 1, 4, 4).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert (
        arguments_reason(AttentionCall(0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, additive), None)
        is None
    )
    windowed = causal & torch.ones(4, 4, dtype=torch.bool).triu(-1)
    windowed_call = AttentionCall(
        0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {"sliding_window": 2}, windowed
    )
    assert arguments_reason(windowed_call, 2) is None
    assert "not a causal one" in arguments_reason(
        AttentionCall(0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, windowed), None
    )
    biased = additive + torch.randn(1, 4, 4, 4).tril()  # a learned bias on the visible keys
    assert "builds an attention mask of its own" in arguments_reason(
        AttentionCall(0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, biased), None
    )
    # -1e9 (a layer's own causal mask) leaves no weight as the dtype's minimum does; a one-row mask
    # broadcast over the 4 queries that hides nothing is bidirectional
    finite = torch.zeros(1, 1, 4, 4).masked_fill(~causal, -1e9)
    assert (
        arguments_reason(AttentionCall(0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, finite), None)
        is None
    )
    everything = torch.zeros(1, 1, 1, 4)
    assert "not a causal one" in arguments_reason(
        AttentionCall(0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, everything), None
    )
    bidirectional = AttentionCall(0, (1, 4, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), {}, None, False)
    assert "is_causal is False" in arguments_reason(bidirectional, None)


def test_each_layer_must_hand_attention_the_window_its_mask_uses():
    """The kernels attend within the window a layer hands them, so it must be its mask's."""
    assert arguments_reason(call(sliding_window=128), 128) is None
    assert arguments_reason(call(sliding_window=None), None) is None
    assert "sliding_window=64 while its mask is a window of 128" in arguments_reason(
        call(sliding_window=64), 128
    )
    assert "sliding_window=None while its mask is a window of 128" in arguments_reason(call(), 128)
    assert "sliding_window=64 while its mask is full attention" in arguments_reason(
        call(sliding_window=64), None
    )
    assert calls_reason([call(0, sliding_window=8), call(1)], 2, [8, None]) is None
    assert "layer 1 hands" in calls_reason([call(0, sliding_window=8), call(1)], 2, [8, 8])


def test_a_window_as_long_as_the_context_reads_as_full_attention():
    """Phi-3.5-MoE's config sets its sliding window to its context, and its layers hand attention none:
    the window never hides a key of a sequence the engine serves, so it is served, with HF's tokens; a
    window shorter than the context is still refused there."""
    assert arguments_reason(call(), 512, context=512) is None
    assert arguments_reason(call(sliding_window=4096), None, context=512) is None
    assert "sliding_window=None while its mask is a window of 511" in arguments_reason(
        call(), 511, context=512
    )
    model = family_model("phimoe", max_position_embeddings=64, sliding_window=64)
    ids, mask = left_padded(varied_prompts(2, seed=14))
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    hfaccel.patch(model, kv_cache_memory=4_000_000)
    try:
        assert torch.equal(model.generate(ids, **kwargs), expected)
    finally:
        hfaccel.unpatch(model)
    model.config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding_window=None while its mask is a window of 8"):
        hfaccel.patch(model)


def test_layer_shapes_one_paged_cache_cannot_hold_are_refused():
    assert calls_reason([call(0), call(1)], 2, None) is None
    assert "decoder layers [1] never call" in calls_reason([call(0)], 2, None)
    assert "layers [1, 2, 3, 4, 5, 6] (and 2 more) never call" in calls_reason([call(0)], 9, None)
    assert "more than once" in calls_reason([call(0), call(0), call(1)], 2, None)
    assert "layer_idx [-1], outside the 2 decoder layers" in calls_reason([call(0), call(1), call(-1)], 2)
    assert "without a layer_idx" in calls_reason([call(None)], 1, None)
    # Multi-head latent attention's values, narrower than its keys, are served (padded in the cache)
    assert calls_reason([call(0, q=(1, 4, 4, 24), k=(1, 4, 4, 24), v=(1, 4, 4, 16))], 1, None) is None
    wide = calls_reason([call(0, q=(1, 4, 4, 16), k=(1, 2, 4, 16), v=(1, 2, 4, 24))], 1, None)
    assert "head dims 16, 16, 24: the kernels need queries as wide as keys, and values no wider" in wide
    assert "queries as wide as keys" in calls_reason([call(0, q=(1, 4, 4, 8))], 1, None)
    values = calls_reason([call(0), call(1, v=(1, 2, 4, 8))], 2, None)
    assert "one paged cache holds one shape" in values
    mixed = calls_reason([call(0), call(1, k=(1, 4, 4, 16), v=(1, 4, 4, 16))], 2, None)
    assert "one paged cache holds one shape" in mixed


# Windows and chunks of 8 positions (the family matrix's sizes); what each family brings besides:
WINDOWED = (
    "gemma3_text",  # sliding and full layers (layer_types)
    "cohere2",
    "mistral",  # one window, every layer, no layer_types
    "llama4_text",  # chunked layers and a full one, MoE, no rope on the full layers
    "gemma2",  # soft-capped scores (a cap of 0.3: the scores of these weights are capped hard)
    "gpt_oss",  # attention sinks (one logit per query head, large), sliding and full layers, MoE
    "qwen2",  # sliding from layer 1 on
)


@pytest.mark.parametrize("model_type", WINDOWED)
def test_window_families_give_hf_tokens_past_the_window(model_type):
    """Sliding-window and chunked-attention families (with soft-capping, Gemma 2, and attention sinks,
    gpt-oss) are served on the engine (strict: no fallback) past their window or chunk: 8 positions,
    prompts of 5-40 tokens and 12 new ones, so most sequences outgrow it in prefill, in chunked prefill (a
    budget of 16 tokens a step) and while decoding."""
    model = family_model(model_type)  # eager attention, weights N(0, 0.08), sinks N(0, 2)
    prompts = varied_prompts(6, seed=3)
    assert max(map(len, prompts)) > 20
    hfaccel.patch(model, strict=True, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        completions = hfaccel.generate(model, prompts, max_new_tokens=12, progress=False)
    finally:
        hfaccel.unpatch(model)
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 12))


def test_a_config_changed_in_place_changes_the_chunks_at_once():
    """transformers reads ``layer_types`` at every forward, and so does the engine: Llama 4's chunked
    layers made full ones on the same config object, the next call attends in full; the prefix cache
    serves no KV computed under the old layer types (the prompts repeat)."""
    model = family_model("llama4_text")
    prompts = varied_prompts(6, seed=3)[2:5]
    hfaccel.patch(model, strict=True, max_num_batched_tokens=64, max_num_seqs=4, block_size=8)
    try:
        for _ in range(2):
            completions = hfaccel.generate(model, prompts, max_new_tokens=10, progress=False)
            for prompt, completion in zip(prompts, completions):
                assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 10))
            model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_families_give_hf_tokens(model_type):
    """Multi-head latent attention (DeepSeek-V2/V3): keys of 24 dims (16 without rope, 8 with), values of
    16, K and V expanded to every head; the config's head_dim (8, the rotary part) is not the cache's.
    Served strictly, in chunked prefill, with prefix-cache hits on a shared start."""
    model = family_model(model_type)
    assert hfaccel.check(model).served
    prompts = varied_prompts(8, seed=3)  # a 40-token start shared by prompts 4-6, the second call's hits
    hfaccel.patch(model, strict=True, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        completions = hfaccel.generate(model, prompts[:5], max_new_tokens=12, progress=False)
        completions += hfaccel.generate(model, prompts[5:], max_new_tokens=12, progress=False)
        engine = model._hfaccel.get_engine(model)
        assert engine.executor.head_dim == 24 and engine.executor.num_kv_heads == 4
        assert engine.block_manager.stats.hit_tokens > 0
    finally:
        hfaccel.unpatch(model)
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 12))


def test_latent_attention_returns_transformers_own_cache():
    """DeepSeek's transformers cache holds compressed latents, the engine's expanded K and padded V: a
    call returning the cache falls back (with the reason), so the cache returned is transformers' own."""
    model = family_model("deepseek_v3")
    ids = torch.tensor([varied_prompts(3, seed=3)[2]])
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="multi-head latent attention"):
            out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out.sequences, expected.sequences)
    assert type(out.past_key_values) is type(expected.past_key_values)


@pytest.mark.skipif(hasattr(DynamicCache, "get_conv_state"), reason="this transformers has the state API")
@pytest.mark.parametrize("model_type", ["jamba", "mamba2"])
def test_hybrids_are_refused_where_transformers_has_no_state_api(model_type):
    """transformers 5.17's recurrent mixers keep their state in model-specific caches the engine cannot
    hand them per sequence: refused, naming the version."""
    with pytest.raises(
        ValueError, match=r"Mamba.*linear-attention cache API, which transformers .* does not have"
    ):
        hfaccel.patch(family_model(model_type))


def _long_windowed_run(model: Any, new: int) -> tuple[list, set[int]]:
    """Three prompts of 20+ tokens x `new` tokens on a window of 8 positions (blocks of 8), then the
    first prompt again: HF's tokens both times, and the repeat hits the prefix cache. Returns the
    engine's step stats of the first call."""
    prompts = [p for p in varied_prompts(8, seed=3) if len(p) > 20][:3]
    hfaccel.patch(model, strict=True, block_size=8, max_num_seqs=4)
    try:
        completions = hfaccel.generate(model, prompts, max_new_tokens=new, min_new_tokens=new, progress=False)
        engine = model._hfaccel.get_engine(model)
        assert engine.scheduler.kv_window == 8
        stats = list(engine.step_stats)
        hits = engine.block_manager.stats.hit_tokens
        again = hfaccel.generate(model, prompts[:1], max_new_tokens=new, min_new_tokens=new, progress=False)
        assert engine.block_manager.stats.hit_tokens > hits
        window_layers = engine.runner.window_layers
    finally:
        hfaccel.unpatch(model)
    for prompt, completion in zip(prompts, completions):
        expected = hf_greedy(model, prompt, new, min_new_tokens=new)
        assert_same_or_near_tie(model, prompt, completion.token_ids, expected)
    assert again[0].token_ids == completions[0].token_ids
    return stats, window_layers


def test_a_model_whose_every_layer_slides_holds_only_its_windows_blocks():
    """Mistral (every layer a window of 8 positions): blocks wholly before every window are given back
    as the sequences grow, so KV memory stays bounded over a long generation, with HF's tokens; the
    prefix cache still serves a repeated prompt."""
    stats, _ = _long_windowed_run(family_model("mistral"), new=120)
    peak = max(s.kv_blocks_used for s in stats)
    # At most the blocks of a window and a step's tokens per sequence (unbounded: 20 blocks each).
    assert peak <= 3 * 4, peak


MIXED = {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_a_model_with_full_and_sliding_layers_bounds_its_sliding_layers_blocks(model_type):
    """Full layers beside sliding ones (a window of 8): the sliding layers keep their K/V in a pool of their
    own whose blocks are given back as the window moves on, so it stays bounded while the full layers'
    pool grows with the sequences; a repeated prompt still hits the prefix cache (both pools), with HF's
    tokens. gpt-oss brings attention sinks and MoE."""
    stats, window_layers = _long_windowed_run(family_model(model_type, **MIXED), new=160)
    assert window_layers == {0, 2}
    window_peak = max(s.kv_window_blocks_used for s in stats)
    full_peak = max(s.kv_blocks_used for s in stats)
    # At most a window and a step's tokens per sequence; the full layers hold every block (> 20 each).
    assert window_peak <= 3 * 4 < 60 <= full_peak, (window_peak, full_peak)


def test_the_window_pool_can_be_turned_off():
    """``window_pool=False``: one pool, every layer keeps every block (the scheduler gives none back)."""
    model = hfaccel.patch(family_model("gpt_oss", **MIXED), window_pool=False)
    try:
        hfaccel.generate(model, [[5, 6, 7] * 8], max_new_tokens=12, progress=False)
        engine = model._hfaccel.get_engine(model)
        assert engine.scheduler.kv_window is None and not engine.runner.window_layers
        assert all(s.kv_window_blocks_used == 0 for s in engine.step_stats)
    finally:
        hfaccel.unpatch(model)


def test_calls_returning_or_continuing_a_cache_keep_the_window_pool_bounded_and_exact():
    """With the sliding layers' window pool smaller than the sequences: beams that return their cache
    give window blocks back too (the cache's sliding layers keep the window only, equal to HF's), and a
    generation continued from a given cache is preempted, hits its own prefix on resuming and writes the
    imported K/V only where the window needs it; a cache longer than the window pool is continued. All
    three found stalling or raising by an adversarial probe."""
    import copy

    model = family_model("gemma3_text", **MIXED)
    ids = torch.randint(3, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    beams = {"num_beams": 3, "max_new_tokens": 40, "min_new_tokens": 40, "do_sample": False}
    expected = model.generate(ids, return_dict_in_generate=True, **beams)
    first = torch.randint(3, 256, (3, 80), generator=torch.Generator().manual_seed(1))
    longer = torch.cat([first, first[:, :6]], 1)
    cache = model.generate(first, max_new_tokens=1, return_dict_in_generate=True).past_key_values
    continued = {"max_new_tokens": 70, "min_new_tokens": 70, "do_sample": False}
    expected_continued = model.generate(longer, past_key_values=copy.deepcopy(cache), **continued)
    # A cache longer than the window pool holds (200 tokens, the pool 160): its window table skips the
    # blocks before the window at admission.
    long = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    long_cache = model.generate(long, max_new_tokens=1, return_dict_in_generate=True).past_key_values
    long_more = torch.cat([long, long[:, :4]], 1)
    expected_long = model.generate(long_more, past_key_values=copy.deepcopy(long_cache), max_new_tokens=8)
    config = {"block_size": 8, "max_num_seqs": 6, "max_num_batched_tokens": 16, "max_model_len": 256}
    results = []
    for memory, call in ((60 * 6144, "beams"), (32 * 6144, "continued")):
        hfaccel.patch(model, strict=True, kv_cache_memory=memory, **config)
        try:
            engine = model._hfaccel.get_engine(model)
            bm = engine.block_manager
            # 6 sequences' windows and a step's tokens: 20 blocks (160 tokens); the full pool the rest
            assert (bm.window.num_blocks, bm.num_blocks) == ((20, 140) if call == "beams" else (20, 56))
            if call == "beams":
                results.append(model.generate(ids, return_dict_in_generate=True, **beams))
            else:
                results.append(model.generate(longer, past_key_values=copy.deepcopy(cache), **continued))
                assert sum(s.num_preemptions for s in engine.step_stats) > 0
                results.append(
                    model.generate(long_more, past_key_values=copy.deepcopy(long_cache), max_new_tokens=8)
                )
            assert bm.num_free_blocks == bm.num_blocks and bm.window.num_free_blocks == bm.window.num_blocks
        finally:
            hfaccel.unpatch(model)
    out, got, got_long = results
    assert torch.equal(out.sequences, expected.sequences)
    assert torch.equal(got_long, expected_long)
    for layer in range(3):
        torch.testing.assert_close(
            out.past_key_values.layers[layer].keys, expected.past_key_values.layers[layer].keys
        )
    assert torch.equal(got, expected_continued)
