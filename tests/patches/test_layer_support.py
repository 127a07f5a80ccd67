"""The guard at `patch`: a layer kind, an attention argument or a module the engine does not implement
is refused with the reason, never run with wrong tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

import hfaccel
from hfaccel.patches.attention import AttentionCall
from hfaccel.patches.layer_support import arguments_reason, calls_reason
from tests.helpers import assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts

# Small values in the spirit of transformers' model testers (hidden sizes kept at multiples of 16: the
# MoE kernels need aligned strides), two or four layers so a hybrid has both kinds.
SMALL = {
    "vocab_size": 99,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def family_model(model_type: str, **extra):
    """A tiny random model of `model_type` from its default config with SMALL's values (where the config
    has them and lets them be set) and `extra`."""
    config = transformers.AutoConfig.for_model(model_type)
    for key, value in {**SMALL, **extra}.items():
        if key in extra or hasattr(config, key):
            with contextlib.suppress(AttributeError):  # a derived property (Jamba's layer_types, for one)
                setattr(config, key, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


REFUSED = {
    "llama4_text": (  # chunked layers without a chunk size
        {"head_dim": 16, "num_local_experts": 2, "intermediate_size_mlp": 64, "attention_chunk_size": None},
        "chunked attention layers without an attention_chunk_size",
    ),
    "jamba": ({"num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1}, "recurrent"),
    "mamba2": ({"num_heads": 4, "head_dim": 32, "n_groups": 1, "state_size": 16}, "recurrent"),
    "qwen3_next": (
        {"head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32, "linear_num_value_heads": 4},
        "linear-attention",
    ),
    "falcon_h1": ({"head_dim": 16, "mamba_d_head": 16, "mamba_n_heads": 8}, "recurrent"),
    "lfm2": ({"layer_types": ["conv", "full_attention", "conv", "full_attention"]}, "'conv'"),
    "deepseek_v3": (
        {
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "head_dim": 8,
            "v_head_dim": 16,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
        "multi-head latent attention",
    ),
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_families_the_engine_would_run_wrong_are_refused_at_patch(model_type):
    extra, reason = REFUSED[model_type]
    model = family_model(model_type, **extra)
    original = model.generate
    with pytest.raises(ValueError, match=f"hfaccel cannot serve .*{reason}"):
        hfaccel.patch(model)
    assert not hasattr(model, "_hfaccel") and model.generate == original  # nothing was patched


def test_a_made_up_layer_type_is_refused():
    model = tiny_model("llama", layers=2)
    model.config.layer_types = ["full_attention", "telepathic_attention"]
    with pytest.raises(ValueError, match=r"layers of type 'telepathic_attention' .*layer_types\[1\]"):
        hfaccel.patch(model)


def test_a_sequence_convolution_anywhere_is_refused():
    model = tiny_model("llama", layers=2)
    model.model.layers[1].mixer = torch.nn.Conv1d(64, 64, 4, groups=64)  # never called: it is there
    with pytest.raises(ValueError, match=r"model.layers.1.mixer \(Conv1d\) convolves over the sequence"):
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


def test_layer_shapes_one_paged_cache_cannot_hold_are_refused():
    assert calls_reason([call(0), call(1)], 2, None) is None
    assert "decoder layers [1] never call" in calls_reason([call(0)], 2, None)
    assert "layers [1, 2, 3, 4, 5, 6] (and 2 more) never call" in calls_reason([call(0)], 9, None)
    assert "more than once" in calls_reason([call(0), call(0), call(1)], 2, None)
    assert "without a layer_idx" in calls_reason([call(None)], 1, None)
    mla = calls_reason([call(0, q=(1, 4, 4, 24), k=(1, 4, 4, 24), v=(1, 4, 4, 16))], 1, None)
    assert "multi-head latent attention" in mla
    mixed = calls_reason([call(0), call(1, k=(1, 4, 4, 16), v=(1, 4, 4, 16))], 2, None)
    assert "one paged cache holds one shape" in mixed


WINDOWED = {
    "gemma3_text": {"head_dim": 16},  # sliding and full layers (layer_types)
    "cohere2": {"head_dim": 16},
    "mistral": {},  # one window, every layer, no layer_types
    # chunked layers (of 8 positions) and a full one, MoE, no rope on the full layers
    "llama4_text": {
        "head_dim": 16,
        "num_local_experts": 2,
        "intermediate_size_mlp": 64,
        "attention_chunk_size": 8,
    },
    # soft-capped scores (a cap of 0.3: the scores of these weights are capped hard), sliding and full layers
    "gemma2": {"head_dim": 16, "attn_logit_softcapping": 0.3},
    # attention sinks (one logit per query head, set large below), sliding and full layers, MoE
    "gpt_oss": {"num_local_experts": 4, "head_dim": 16},
    "qwen2": {  # sliding from layer 1 on
        "use_sliding_window": True,
        "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
    },
}


@pytest.mark.parametrize("model_type", sorted(WINDOWED))
def test_window_families_give_hf_tokens_past_the_window(model_type):
    """Sliding-window and chunked-attention families (with soft-capping, Gemma 2, and attention sinks,
    gpt-oss) are served on the engine (strict: no fallback) past their window or chunk: 8 positions,
    prompts of 5-40 tokens and 12 new ones, so most sequences outgrow it in prefill, in chunked prefill (a
    budget of 16 tokens a step) and while decoding."""
    model = family_model(model_type, sliding_window=8, vocab_size=256, **WINDOWED[model_type])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            if name.endswith(".sinks"):  # large enough to take much of each softmax
                p.normal_(0.0, 2.0)
    prompts = varied_prompts(6, seed=3)
    assert max(map(len, prompts)) > 20
    hfaccel.patch(model, strict=True, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        completions = hfaccel.generate(model, prompts, max_new_tokens=12, progress=False)
    finally:
        hfaccel.unpatch(model)
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 12))
