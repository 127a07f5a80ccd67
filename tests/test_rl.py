"""RL rollouts with TRL: GRPOTrainer (and RLOOTrainer) generate on the engine with a patched model.

The model is patched with ``strict=True``: a fallback to HF's generate would raise. After training, the
patched greedy generate must equal HF's on the trained weights (the engine saw the weights change and
never served a stale prefix).
"""

import warnings

import pytest
import torch

import hfaccel
from tests.helpers import hf_greedy, tiny_model, tiny_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

BLOCK = 16
PROMPT_CHARS = 40  # the tiny tokenizer is one token per character: two full blocks of prompt
NUM_GENERATIONS = 4


def dataset(count: int = 4):
    """Prompts of exactly PROMPT_CHARS characters, each with its own first character (no prefix shared
    across prompts, so the engine's prefix hits count only the copies of one prompt)."""
    body = "Count the letters of the word and reply: "
    texts = [(chr(ord("A") + i) + body)[:PROMPT_CHARS] for i in range(count)]
    return datasets.Dataset.from_dict({"prompt": texts})


def reward_a(completions, **kwargs):
    """A toy reward: how many 'a' the completion holds (varies across samples: non-zero advantages)."""
    return [float(c.count("a")) + 0.1 * len(set(c)) for c in completions]


def patched_tiny():
    model = tiny_model("llama")
    model.generation_config.pad_token_id = 0
    return hfaccel.patch(model, strict=True, block_size=BLOCK, kv_cache_memory=8_000_000)


def trainer_for(kind: str, model, tmp_path, **extra):
    common = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=NUM_GENERATIONS,  # one prompt x its generations per step
        num_generations=NUM_GENERATIONS,
        max_completion_length=8,
        learning_rate=0.05,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=True,
        seed=0,
        beta=0.0,  # no reference model (RLOO's default would load one from the hub)
    )
    tok = tiny_tokenizer()
    if kind == "grpo":
        args = trl.GRPOConfig(**common)
        return trl.GRPOTrainer(
            model=model,
            reward_funcs=reward_a,
            args=args,
            train_dataset=dataset(),
            processing_class=tok,
            **extra,
        )
    args = trl.RLOOConfig(**common)
    return trl.RLOOTrainer(
        model=model, reward_funcs=reward_a, args=args, train_dataset=dataset(), processing_class=tok, **extra
    )


def greedy_parity(model) -> None:
    model.eval()
    tok = tiny_tokenizer()
    for text in ["Count the letters of the word", "A second prompt, longer than one block of KV"]:
        ids = tok(text)["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        assert out[0, len(ids) :].tolist() == hf_greedy(model, ids, 8)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainer_rollouts_on_the_engine(kind, tmp_path):
    if kind == "rloo" and not hasattr(trl, "RLOOTrainer"):
        pytest.skip("this TRL has no RLOOTrainer")
    model = patched_tiny()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trainer_for(kind, model, tmp_path)
    trainer.train()  # strict patch: any fallback to HF's generate raises
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "the weights must move"
    engine = model._hfaccel.engine
    stats = engine.stats()
    assert stats["generated_tokens"] == 2 * NUM_GENERATIONS * 8, "both steps' rollouts ran on the engine"
    # Each step: one prompt, its copies share its full prompt blocks; the weights changed in between, so
    # nothing of step 1 is served in step 2 (and the prompts differ anyway).
    full_blocks = (PROMPT_CHARS - 1) // BLOCK
    assert stats["prefix_cache_hit_tokens"] == 2 * (NUM_GENERATIONS - 1) * full_blocks * BLOCK
    greedy_parity(model)


def test_grpo_with_a_lora_adapter_from_the_trainer(tmp_path):
    """TRL wraps the patched model with PEFT itself (peft_config): its PeftModel.generate reaches the
    patched base model's generate, and the LoRA layers run inside the engine's forward."""
    peft = pytest.importorskip("peft")
    model = patched_tiny()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = trainer_for("grpo", model, tmp_path, peft_config=config)
    trainer.train()
    assert model._hfaccel.engine.stats()["generated_tokens"] == 2 * NUM_GENERATIONS * 8
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "the adapter trained"
    greedy_parity(model)


def test_train_mode_and_gradient_checkpointing_do_not_change_generation():
    """HF's generate ignores gradient checkpointing (it only turns the KV cache off) and runs the model in
    whatever mode it is; with no dropout, train mode gives eval's tokens. The patched generate serves it
    on the engine (strict: no fallback), with use_cache disabled too."""
    model = patched_tiny()
    tok = tiny_tokenizer()
    ids = tok("Count the letters of the word and reply: ")["input_ids"]
    expected = hf_greedy(model, ids, 8)
    model.gradient_checkpointing_enable()
    model.train()
    model.config.use_cache = False
    for kwargs in ({}, {"use_cache": False}):
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, **kwargs)
        assert out[0, len(ids) :].tolist() == expected
    assert model.training and model.is_gradient_checkpointing, "generate leaves both as they were"
    # Under autocast wrapping the forward (how accelerate runs a bf16 trainer's forward, and so HF's
    # generate): attention runs in the KV cache's dtype, autocast off; the rest of the model as autocast
    # says. Served on the engine, in whichever thread steps it.
    forward = model.forward
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(forward)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = model.generate(torch.tensor([ids] * 3), max_new_tokens=8, do_sample=False)
        # HF's generate under the same autocast, in eval mode (no dropout: the same tokens; transformers
        # 5.17's own train mode without a cache gave other ones under autocast)
        model.eval()
        expected = hf_greedy(model, ids, 8)
    finally:
        model.forward = forward
    # Attention runs in float32 from the bf16 projections (HF's SDPA in bf16): tokens are HF's up to bf16
    # near ties (docs/rl.md); this prompt has none.
    assert all(row[len(ids) :] == expected for row in out.tolist())
