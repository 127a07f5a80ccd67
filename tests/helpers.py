"""Shared test helpers: tiny random models of each family and the greedy-parity oracle."""

from __future__ import annotations

import os
import sys

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

import hfaccel.engine.engine
from hfaccel.engine.engine import Engine
from hfaccel.engine.fault_repair import is_whole
from hfaccel.engine.request import RequestStatus

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

# Mixture-of-experts families: 4 experts, 2 per token (Qwen2-MoE with a shared expert too).
_MOE_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    ),
}
MOE_FAMILIES = tuple(_MOE_FAMILIES)


def tiny_model(family: str = "llama", seed: int = 0, layers: int = 2, max_positions: int = 512):
    """A small random decoder (GQA: 4 query heads, 2 KV heads) in float32, eval mode."""
    if family in _MOE_FAMILIES:
        import transformers

        config_name, model_name, extra = _MOE_FAMILIES[family]
        config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    else:
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
            if p.dim() >= 2:  # MoE experts are stored as 3-D tensors
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


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch (pad id PAD) and its attention mask, as a tokenizer pads them."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf(model, **kwargs):
    """Unpatched transformers generate on a (possibly patched) model."""
    with torch.no_grad():
        return type(model).generate(model, **kwargs)


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
    `eps` (packed and padded batches are not bit-identical, so a near-tie may go either way); the
    doctor's rule (`hfaccel.doctor.first_difference_is_a_near_tie`)."""
    from hfaccel.doctor import first_difference_is_a_near_tie

    assert first_difference_is_a_near_tie(model, prompt, ours, ref, eps), (
        f"greedy tokens differ beyond a near-tie of {eps:.0e} (or in length): {ours} vs HF's {ref}"
    )


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


# ----------------------------------------------------------------- fault injection

ENGINE_DIR = os.path.dirname(hfaccel.engine.engine.__file__) + os.sep


class Fault:
    """Raise `error` at the `at`-th line event of engine code in this thread (0: never; count them)."""

    def __init__(self, at: int = 0, error: type[BaseException] = KeyboardInterrupt) -> None:
        self.at, self.error, self.lines, self.fired = at, error, 0, False

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename.startswith(ENGINE_DIR) else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.fired = True
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
                raise self.error(f"injected at line event {self.at} ({where})")
        return self._local

    def __enter__(self) -> Fault:
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


def untraced_forward(engine: Engine) -> None:
    """The model's own Python frames need no tracing (they are not engine code): skip them for speed
    (the draft model's too, when there is one)."""
    draft_runner = getattr(engine.proposer, "runner", None)
    if draft_runner is not None:
        _untrace(draft_runner)
    _untrace(engine.runner)


def _untrace(runner) -> None:
    real = runner.executor.forward

    def forward(*args, **kwargs):
        tracer = sys.gettrace()
        sys.settrace(None)
        try:
            return real(*args, **kwargs)
        finally:
            sys.settrace(tracer)

    runner.executor = _Wrapped(runner.executor, forward)


class _Wrapped:
    def __init__(self, inner, forward):
        self._inner, self.forward = inner, forward

    def __getattr__(self, name):
        return getattr(self._inner, name)


def check_consistent(engine: Engine) -> None:
    """The bookkeeping between steps: queues, statuses and block counts agree with the requests."""
    scheduler, manager = engine.scheduler, engine.block_manager
    running, waiting, forming = list(scheduler.running), list(scheduler.waiting), list(scheduler.forming)
    queued = running + waiting + forming
    assert len({id(r) for r in queued}) == len(queued), "a request sits in two places"
    assert {id(r) for r in queued} == set(scheduler.live), "live and the queues disagree"
    assert scheduler.scheduled == []
    for request in running:
        assert request.status is RequestStatus.RUNNING and is_whole(manager.block_size, request)
    for request in waiting + forming:
        assert request.status is RequestStatus.WAITING and request.block_ids == []
        assert request.num_computed_tokens == 0
    assert [r.priority for r in running] == sorted(r.priority for r in running)
    manager.check(queued)
