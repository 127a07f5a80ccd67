"""``patch(weights="int8" | "int4")``: torchao's quantization on PyTorch's packed CPU kernels. The layers
compute torchao's dequantized product, the engine gives transformers' tokens on the quantized model,
and what cannot be quantized this way raises, naming it."""

from __future__ import annotations

import warnings

import pytest
import torch

import hfaccel
from hfaccel.patches.quantized_linear import (
    INT4_GROUP,
    Int4Linear,
    Int8Linear,
    _int4_parameters,
    quantize_linears,
)
from tests.helpers import assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts

quantization = pytest.importorskip("torchao.quantization")


def _linear(in_features: int = 96, out_features: int = 48, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias).bfloat16()


def test_int8_layer_computes_torchaos_dequantized_product():
    wrapper = torch.nn.Sequential(_linear())
    reference = torch.nn.Sequential(_linear())
    quantization.quantize_(reference, quantization.Int8WeightOnlyConfig())
    assert quantize_linears(wrapper, "int8") == 1
    assert isinstance(wrapper[0], Int8Linear)
    weight = reference[0].weight
    dequantized = weight.qdata.float() * weight.scale.float().reshape(-1, 1)
    x = torch.randn(3, 5, 96).bfloat16()
    expected = torch.nn.functional.linear(x.float(), dequantized, reference[0].bias.float())
    torch.testing.assert_close(wrapper(x).float(), expected, rtol=2e-2, atol=2e-2)
    assert wrapper(x).shape == (3, 5, 48) and wrapper(x).dtype == torch.bfloat16


def _dequantize_int4(values: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    scales, zeros = scales_and_zeros.float().unbind(-1)  # each [groups, out]
    groups = values.float().reshape(values.shape[0], -1, INT4_GROUP)
    return ((groups - 8) * scales.t().unsqueeze(-1) + zeros.t().unsqueeze(-1)).reshape(values.shape)


def test_int4_layer_computes_its_groupwise_product_no_coarser_than_torchaos_grid():
    from torchao.quantization.utils import (
        groupwise_affine_dequantize_tensor,
        groupwise_affine_quantize_tensor,
    )

    linear = _linear()
    weight = linear.weight.detach().float()
    values, scales_and_zeros = _int4_parameters(linear.weight.detach())
    ours = _dequantize_int4(values, scales_and_zeros)
    theirs = groupwise_affine_dequantize_tensor(
        *groupwise_affine_quantize_tensor(weight, n_bit=4, groupsize=INT4_GROUP, dtype=torch.bfloat16),
        4,
        INT4_GROUP,
    ).float()
    assert (ours - weight).abs().mean() <= (theirs - weight).abs().mean()  # the refit zero
    assert (ours - weight).abs().max() < 0.05  # 4 bits: a coarse but faithful grid
    wrapper = torch.nn.Sequential(linear)
    assert quantize_linears(wrapper, "int4") == 1 and isinstance(wrapper[0], Int4Linear)
    x = torch.randn(7, 96).bfloat16()
    expected = torch.nn.functional.linear(x.float(), ours, linear.bias.float())
    torch.testing.assert_close(wrapper(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_a_shape_the_int4_kernel_does_not_take_stays_bfloat16():
    model = torch.nn.Sequential(_linear(96, 48), _linear(48, 40))  # 40 rows: not a multiple of 16
    assert quantize_linears(model, "int4") == 1
    assert isinstance(model[0], Int4Linear) and isinstance(model[1], torch.nn.Linear)
    assert model[1].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_engine_gives_transformers_tokens_on_the_quantized_model(weights):
    model = hfaccel.patch(tiny_model(), weights=weights)
    prompts = varied_prompts(4, seed=6)
    try:
        kind = Int8Linear if weights == "int8" else Int4Linear
        assert isinstance(model.model.layers[0].mlp.down_proj, kind)
        assert isinstance(model.lm_head, Int8Linear)  # int4 keeps the head at 8 bits
        completions = hfaccel.generate(model, prompts, max_new_tokens=6, progress=False)
    finally:
        hfaccel.unpatch(model)
    assert isinstance(
        model.model.layers[1].self_attn.q_proj, kind
    )  # quantized in place, as torchao's quantize_ is
    # bfloat16 activations: a first difference must be a near-tie at bf16's resolution (as weights="bfloat16").
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 6), eps=0.0625)


def test_a_model_torchao_quantized_keeps_its_exact_path_unless_int8_is_asked_for():
    model = tiny_model()
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    with pytest.raises(
        ValueError,
        match=r"weights='int4': model\.layers\.0\.self_attn\.q_proj\.weight is already quantized \(Int8Tensor",
    ):
        hfaccel.patch(model, weights="int4")
    assert not hasattr(model, "_hfaccel")
    hfaccel.patch(model, weights="int8")  # the same int8 numbers, moved onto the packed kernel
    try:
        assert isinstance(model.model.layers[1].self_attn.o_proj, Int8Linear)
    finally:
        hfaccel.unpatch(model)


def test_a_model_off_the_cpu_is_refused_naming_the_device():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(
        ValueError, match=r"weights='int8' runs PyTorch's packed CPU kernels, and the model is on meta"
    ):
        quantize_linears(model, "int8")


def test_a_width_the_int8_kernel_cannot_read_stays_bfloat16_and_serves():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hfaccel.patch(transformers.LlamaForCausalLM(config).eval(), weights="int8")
    try:
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp.gate_proj, Int8Linear)  # 64 columns
        assert type(mlp.down_proj) is torch.nn.Linear and mlp.down_proj.weight.dtype == torch.bfloat16  # 40
        out = hfaccel.generate(model, [[5, 6, 7, 8]], max_new_tokens=4, progress=False)[0]
    finally:
        hfaccel.unpatch(model)
    assert out.token_ids == hf_greedy(model, [5, 6, 7, 8], 4)


@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_a_strided_input_is_multiplied_as_a_contiguous_one(kind):
    model = torch.nn.Sequential(_linear(64, 48))
    quantize_linears(model, "int8" if kind is Int8Linear else "int4")
    x = torch.randn(64, 5).bfloat16()
    assert isinstance(model[0], kind)
    torch.testing.assert_close(model[0](x.t()), model[0](x.t().contiguous()))


def test_what_cannot_be_quantized_is_refused_before_anything_changes():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    peft_model = get_peft_model(tiny_model(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"weights='int8': the model holds PEFT modules \(Peft"):
        hfaccel.patch(peft_model, weights="int8")
    with pytest.raises(ValueError, match=r"LoRA over int4 weights is not served"):
        hfaccel.patch(peft_model, weights="int4")
    assert all(p.dtype == torch.float32 for p in peft_model.parameters())
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128)).eval()
    with pytest.raises(
        ValueError, match=r"weights='int4' quantizes nn.Linear layers, and this model has none"
    ):
        hfaccel.patch(gpt2, weights="int4")
    assert all(p.dtype == torch.float32 for p in gpt2.parameters()) and not hasattr(gpt2, "_hfaccel")
    dynamic = tiny_model()
    quantization.quantize_(dynamic, quantization.Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(
        ValueError, match=r"weights='int8': model\.layers\.0\.self_attn\.q_proj\.weight is already"
    ):
        hfaccel.patch(dynamic, weights="int8")
    assert dynamic.model.embed_tokens.weight.dtype == torch.float32


def test_asking_for_the_same_quantization_again_changes_nothing():
    model = hfaccel.patch(tiny_model(), weights="int4")
    try:
        layer = model.model.layers[0].mlp.up_proj
        hfaccel.patch(model, weights="int4")
        assert model.model.layers[0].mlp.up_proj is layer
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("cast", ["float", "half"])
def test_quantized_layers_follow_the_model_cast_to_another_dtype(cast):
    """`model.float()` / `.half()` cast the layers' scales; both kinds then compute in that dtype (the int4
    one took bfloat16 activations whatever its scales were, and failed)."""
    for weights in ("int8", "int4"):
        model = hfaccel.patch(tiny_model(), weights=weights)
        try:
            getattr(model, cast)()
            prompt = varied_prompts(1, seed=2)[0]
            expected = hf_greedy(model, prompt, 4)  # transformers' generate on the same layers
            tokens = hfaccel.generate(model, [prompt], max_new_tokens=4, progress=False)[0].token_ids
        finally:
            hfaccel.unpatch(model)
        assert_same_or_near_tie(model, prompt, tokens, expected, eps=0.0625)


def test_another_quantization_or_a_mistaken_patch_leaves_the_layers_as_they_are():
    """Asking for int4 over hfaccel's int8 layers was ignored, silently; a patch refused for a mistaken
    argument quantized the model anyway."""
    model = tiny_model()
    with pytest.raises(ValueError, match="max_num_seq"):
        hfaccel.patch(model, weights="int8", max_num_seq=4)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    hfaccel.patch(model, weights="int8")
    with pytest.raises(ValueError, match=r"weights='int4': the model's linear layers are already int8"):
        hfaccel.patch(model, weights="int4")
    hfaccel.unpatch(model)


def test_the_route_the_lora_refusal_advises_serves_transformers_tokens():
    """torchao's int8 weight-only first, then PEFT's LoRA, then a patch without weights=."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    quantization.quantize_(base, quantization.Int8WeightOnlyConfig())
    with warnings.catch_warnings():  # PEFT's note that merging such layers needs TorchAoConfig
        warnings.simplefilter("ignore")
        model = get_peft_model(
            base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    prompt = varied_prompts(1, seed=3)[0]
    expected = hf_greedy(model, prompt, 8)
    hfaccel.patch(model)
    try:
        assert hfaccel.generate(model, [prompt], max_new_tokens=8, progress=False)[0].token_ids == expected
    finally:
        hfaccel.unpatch(model)


def test_an_int8_layer_passes_gradients_to_its_input():
    """The weights are frozen, but what lies before a layer (embeddings, norms, adapters) still trains:
    the input's gradient is that of the product with the dequantized weight, one matmul (its operation
    had no derivative: any backward through a patched model failed). int4's packed weights are the
    kernel's alone: its backward says so."""
    model = torch.nn.Sequential(_linear(64, 48))
    quantize_linears(model, "int8")
    layer = model[0]
    weight = layer.qdata.float() * layer.scale.float().reshape(-1, 1)
    x = torch.randn(5, 64).bfloat16().requires_grad_()
    grad = torch.randn(5, 48)
    model(x).float().backward(grad)
    torch.testing.assert_close(x.grad.float(), grad @ weight, rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        assert not model(x).requires_grad

    lm = tiny_model("llama")
    hfaccel.patch(lm, weights="int8")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    lm(ids, labels=ids).loss.backward()
    assert lm.get_input_embeddings().weight.grad.abs().sum() > 0
    hfaccel.unpatch(lm)
    four = torch.nn.Sequential(_linear(64, 48))
    quantize_linears(four, "int4")
    with pytest.raises(RuntimeError, match="weights='int4' layers pass no gradient to their input"):
        four(x).float().sum().backward()


def test_prompt_logprobs_of_a_quantized_model():
    """Their vocabulary is read off the head's features: a quantized head has no float weight."""
    model = hfaccel.patch(tiny_model("llama"), weights="int8")
    done = hfaccel.generate(model, [[5, 6, 7, 8]], max_new_tokens=2, prompt_logprobs=1, progress=False)[0]
    assert len(done.prompt_logprobs) == 4 and done.prompt_logprobs[0] is None
    hfaccel.unpatch(model)


def test_resizing_a_quantized_head_says_why_it_cannot():
    """transformers' resize and tie read the head's float weight: a quantized head has none (a bare
    AttributeError, or a resize after tie_weights that left the quantized rows behind and then failed on
    every call)."""
    for tied in (False, True):
        model = tiny_model("llama")
        if tied:
            model.config.tie_word_embeddings = True
        hfaccel.patch(model, weights="int8")
        if tied:  # it would attach a float weight the quantized head never reads
            with pytest.raises(AttributeError, match="Int8Linear holds quantized weights"):
                model.tie_weights()
        assert getattr(model.get_output_embeddings(), "weight", None) is None
        with pytest.raises(AttributeError, match="Int8Linear, which holds quantized weights .* reload the"):
            model.resize_token_embeddings(300)
        # refused before anything changed: the input embeddings were resized, then the head failed
        assert model.get_input_embeddings().num_embeddings == 256 and model.config.vocab_size == 256
        assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
        hfaccel.unpatch(model)
    # A float head put back: the model resizes as transformers' own method does.
    model.set_output_embeddings(torch.nn.Linear(64, 256, bias=False))
    model.resize_token_embeddings(300)
    assert model.get_output_embeddings().out_features == 300
