"""Each supported family through hfaccel.generate, and the model checks."""

import warnings

import pytest
import torch

import hfaccel
from hfaccel.patches.models import max_model_len
from tests.helpers import FAMILIES, assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_offline_generate_matches_hf(family):
    model = tiny_model(family, seed=2)
    prompts = varied_prompts(16, seed=8)
    completions = hfaccel.generate(model, prompts, max_new_tokens=9, progress=False)
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 9))


def test_a_sliding_window_does_not_cap_the_served_length():
    """The kernels attend within each layer's window: the engine serves the model's whole context."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=128,
    )
    model = MistralForCausalLM(config)
    assert max_model_len(model, None) == 512
    assert max_model_len(model, 256) == 256
    with pytest.raises(ValueError, match=r"max_model_len \(600\) exceeds what the model supports \(512\)"):
        max_model_len(model, 600)


def test_unchecked_families_warn_and_encoder_decoders_are_refused():
    """A family the family matrix checks (GPT-2) patches silently; one it does not (Arcee) is served with
    a warning saying its outputs are not tested."""
    from transformers import (
        ArceeConfig,
        ArceeForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hfaccel.patch(gpt2)
    hfaccel.unpatch(gpt2)
    arcee = ArceeForCausalLM(
        ArceeConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=2, vocab_size=64)
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"model_type 'arcee' is not among the \d+ families .* not tested"):
        hfaccel.patch(arcee)
    hfaccel.unpatch(arcee)
    t5 = T5ForConditionalGeneration(
        T5Config(num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=64)
    )
    with pytest.raises(ValueError, match="encoder-decoder model"):
        hfaccel.patch(t5)
    assert not hasattr(t5, "_hfaccel")


def test_activations_quantized_on_the_fly_go_to_transformers_with_the_reason():
    """torchao's dynamic int8 activations round each activation by float noise: transformers' own sdpa
    and eager attention give different tokens on such a model, so no kernel could match; calls fall back."""
    quantization = pytest.importorskip("torchao.quantization")
    model = tiny_model("llama", layers=2)
    quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig())
    prompt = [5, 6, 7, 8, 9, 10]
    expected = hf_greedy(model, prompt, 8)
    hfaccel.patch(model)
    try:
        with pytest.warns(
            UserWarning,
            match=r"activations quantized on the fly \(\S+\.weight is a Int8Tensor with act_quant_kwargs",
        ):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    finally:
        hfaccel.unpatch(model)
    assert out[0, len(prompt) :].tolist() == expected


def test_a_model_with_offloaded_weights_is_refused_naming_one():
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("llama", layers=2)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"model.embed_tokens.weight is on the meta device \(weights offloaded"
    ):
        hfaccel.patch(model)


def _qwen2_with_attention_dropout() -> torch.nn.Module:
    model = tiny_model("qwen2")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    return model


def test_train_mode_with_attention_dropout_goes_to_transformers():
    """transformers applies attention dropout in train mode; the engine's kernels do not: such a call
    falls back (in eval mode, or without dropout, it is served)."""
    model = _qwen2_with_attention_dropout()
    hfaccel.patch(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        model.train()
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match=r"attention dropout \(0.5\)"):
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        torch.manual_seed(0)
        assert torch.equal(out, type(model).generate(model, ids, max_new_tokens=6, do_sample=False))
        model.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.generate(ids, max_new_tokens=6, do_sample=False)
    finally:
        hfaccel.unpatch(model)


def test_a_decoder_in_train_mode_under_an_eval_root_goes_to_transformers():
    """Each attention module's own mode counts: the decoder put in train mode under a root left in eval
    mode applies its attention dropout in transformers, so the call falls back (it raised before)."""
    model = _qwen2_with_attention_dropout()
    hfaccel.patch(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        model.model.train()
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match=r"attention dropout \(0.5\)"):
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        torch.manual_seed(0)
        assert torch.equal(out, type(model).generate(model, ids, max_new_tokens=6, do_sample=False))
    finally:
        hfaccel.unpatch(model)


def _dropout_model(family: str) -> torch.nn.Module:
    """A tiny model whose attention keeps its dropout, 0.5, under the family's own name; nothing else drops."""
    import transformers

    configs = {
        "gpt2": (
            "GPT2Config",
            "GPT2LMHeadModel",
            {"n_embd": 32, "n_layer": 2, "attn_pdrop": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
        ),
        "opt": (
            "OPTConfig",
            "OPTForCausalLM",
            {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "ffn_dim": 64,
                "word_embed_proj_dim": 32,
                "attention_dropout": 0.5,
                "dropout": 0.0,
            },
        ),  # fmt: skip
        "gpt_bigcode": (
            "GPTBigCodeConfig",
            "GPTBigCodeForCausalLM",
            {"n_embd": 32, "n_layer": 2, "attn_pdrop": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
        ),
    }
    config_name, model_name, extra = configs[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=64, num_attention_heads=4, **extra)
    return getattr(transformers, model_name)(config).eval()


@pytest.mark.parametrize("family", ["gpt2", "opt", "gpt_bigcode"])
def test_attention_dropout_under_each_familys_name_goes_to_transformers(family):
    """GPT-2 keeps it as an ``nn.Dropout`` named ``attn_dropout``, OPT as a rate named ``dropout``, GPTBigCode
    as a rate named ``attn_dropout``: each is found, and the call is transformers' own."""
    model = hfaccel.patch(_dropout_model(family))
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        model.train()
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match=r"attention dropout \(0.5\)"):
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        torch.manual_seed(0)
        hf = type(model).generate(model, ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out, hf)
    finally:
        hfaccel.unpatch(model)


def test_a_dropout_the_check_misses_is_refused_by_the_attention_not_skipped(monkeypatch):
    """An attention module whose rate hides under a name the check does not know still hands the rate to
    the attention function, which refuses it: an error, never tokens without the dropout."""
    monkeypatch.setattr("hfaccel.patches.models.ATTENTION_DROPOUT_NAMES", frozenset())
    model = _qwen2_with_attention_dropout()
    hfaccel.patch(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        model.train()
        with pytest.raises(RuntimeError, match=r"Qwen2Attention passes attention dropout \(0.5\)"):
            model.generate(ids, max_new_tokens=3, do_sample=False)
        model.eval()  # the engine stays usable
        assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 7)
    finally:
        hfaccel.unpatch(model)


def test_a_users_forward_hook_sends_the_call_to_transformers_until_removed():
    """A hook that steers the last position (``h[:, -1]``) would see the engine's packed step, one row of
    every request's tokens: such a call is transformers' own, with a warning; once the hook is removed,
    the engine serves again, and nothing it cached while the hook was on is reused."""
    model = tiny_model("llama", seed=3)
    hfaccel.patch(model)
    vector = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 2.0

    def steer_last(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        hidden[:, -1] += vector
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [3, 4, 5, 3, 4]])
    kwargs = {"max_new_tokens": 5, "do_sample": False}
    hf = type(model).generate
    try:
        handle = model.model.layers[0].register_forward_hook(steer_last)
        with pytest.warns(UserWarning, match=r"a forward hook on model\.layers\.0"):
            out = model.generate(ids, **kwargs)
        assert torch.equal(out, hf(model, ids, **kwargs))
        handle.remove()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = model.generate(ids, **kwargs)
        assert torch.equal(out, hf(model, ids, **kwargs))
    finally:
        hfaccel.unpatch(model)


def test_library_hooks_and_hooks_said_to_read_packed_steps_keep_the_call_on_the_engine():
    """transformers' own hooks (``enable_input_require_grads``, output capture) change no value; a user's
    hook marked ``hfaccel_packed`` acts on each token alone, as its author says."""
    model = tiny_model("llama")
    model.enable_input_require_grads()
    vector = torch.full((64,), 0.5)

    def steer_every_token(module, args, output):
        return output + vector

    model.model.layers[0].mlp.register_forward_hook(steer_every_token)
    steer_every_token.hfaccel_packed = True  # marked after registering: read at each call
    ids = torch.tensor([[5, 6, 7], [7, 3, 4]])
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    hfaccel.patch(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
    finally:
        hfaccel.unpatch(model)


def test_a_model_made_in_inference_mode_is_served():
    """Its tensors keep no version counter, which the model-state check read (a RuntimeError)."""
    with torch.inference_mode():
        model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=5, do_sample=False)
    hfaccel.patch(model)
    try:
        with torch.inference_mode():
            assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), expected)
    finally:
        hfaccel.unpatch(model)


def test_neftunes_noise_is_not_taken_for_a_library_hook_that_changes_nothing():
    """transformers' NEFTune hook scales its noise by the embeddings' [B, L] size, which a packed step is
    not: in train mode, where it adds noise, the call goes to transformers."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    model = tiny_model("llama")
    embeddings = model.get_input_embeddings()
    embeddings.neftune_noise_alpha = 5.0
    embeddings.register_forward_hook(neftune_post_forward_hook)
    hfaccel.patch(model)
    try:
        with warnings.catch_warnings():  # in eval mode it adds nothing: served
            warnings.simplefilter("error")
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
        model.train()
        with pytest.warns(UserWarning, match=r"a forward hook on model\.embed_tokens"):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    finally:
        hfaccel.unpatch(model)
