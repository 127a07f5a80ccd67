"""Shared test helpers: tiny random models of each family and the greedy-parity oracle."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 256
EOS = 2
PAD = 0

_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
}
FAMILIES = tuple(_FAMILIES)


def tiny_model(family: str = "llama", seed: int = 0, layers: int = 2, max_positions: int = 512):
    """A small random decoder (GQA: 4 query heads, 2 KV heads) in float32, eval mode."""
    config_cls, model_cls, extra = _FAMILIES[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Larger weights than the default init: logits with clear winners, so greedy paths are not all ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model


def varied_prompts(count: int = 16, seed: int = 0) -> list[list[int]]:
    """Prompts covering the cases that matter: 1 token, longer than a block, identical, shared prefix."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    shared = rand(40)
    prompts = [rand(1), rand(1), rand(37), rand(37), shared + rand(3), shared + rand(9), shared[:]]
    prompts.append(list(prompts[2]))  # identical to an earlier one
    while len(prompts) < count:
        prompts.append(rand(int(torch.randint(2, 60, (1,), generator=g))))
    return prompts[:count]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """Unpatched HF greedy generate on one unpadded prompt; returns the new tokens."""
    generate = type(model).generate
    with torch.no_grad():
        out = generate(
            model, torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def assert_same_or_near_tie(
    model, prompt: list[int], ours: list[int], ref: list[int], eps: float = 1e-4
) -> None:
    """Greedy parity: equal tokens, or a first difference where HF's own top two logits were within
    `eps` (packed and padded batches are not bit-identical, so a near-tie may go either way)."""
    if ours == ref:
        return
    diff = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if diff == min(len(ours), len(ref)):
        raise AssertionError(f"lengths differ with no token difference: {len(ours)} vs {len(ref)}")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:diff]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < eps, f"tokens differ at {diff} ({ours[diff]} vs {ref[diff]}) but the top-2 gap is {gap:.2e}"


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


def tiny_tokenizer():
    """A character-level fast tokenizer over printable ASCII (ids 3..97) with a chat template, matching
    `tiny_model`'s special ids (pad 0, bos 1, eos 2); left padding, as generation wants."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": 1, "</s>": EOS}
    vocab.update({chr(c): 3 + i for i, c in enumerate(range(32, 127))})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="?"
    )
    tokenizer.padding_side = "left"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
