"""GRPO with TRL, rollouts on the hfaccel engine: patch the policy once, train as usual.

python examples/grpo_rollouts.py                 # a tiny random Llama, a character tokenizer: seconds
python examples/grpo_rollouts.py --smollm2       # the embedded SmolLM2-135M-Instruct (slower)
python examples/grpo_rollouts.py --lora          # train a LoRA adapter (TRL wraps the model with PEFT)

TRL's GRPOTrainer (without vLLM) calls ``model.generate(input_ids, attention_mask, generation_config)``
on the policy for every generation batch. With ``hfaccel.patch(model)`` those calls run on the paged,
continuously batched engine: the ``num_generations`` samples of a prompt share its KV blocks, and the
prefix cache forgets everything when the optimizer changes the weights (nothing to reset by hand).
``strict=True`` turns any fallback to HF's own generate into an error, so a silent slow path cannot hide.
"""

import argparse

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

import hfaccel

INSTRUCTION = "Answer in one short sentence, then stop. Question: "
QUESTIONS = ["What color is the sky?", "Name a fruit.", "What is two plus two?", "Where do fish live?"]


def tiny_model_and_tokenizer():
    """A 2-layer random Llama and a character-level tokenizer (printable ASCII) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(c): 3 + i for i, c in enumerate(range(32, 127))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="?"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config), tokenizer


def reward_short_and_lively(completions, **kwargs):
    """A toy reward: exclamation marks are good, long answers are not."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [t.count("!") - 0.05 * len(t) for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smollm2", action="store_true", help="use the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of all weights")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    if args.smollm2:
        from hfaccel.default_model import load_default_model

        model, tokenizer = load_default_model(torch.float32)
    else:
        model, tokenizer = tiny_model_and_tokenizer()
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    model = hfaccel.patch(model, strict=True)  # the one line: TRL's generate calls now run on the engine

    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": INSTRUCTION + q}] for q in QUESTIONS]}
    )
    config = GRPOConfig(
        output_dir="/tmp/hfaccel-grpo-example",
        max_steps=args.steps,
        per_device_train_batch_size=8,  # completions per step: 2 prompts x 4 generations
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-4 if args.lora else 1e-5,
        beta=0.0,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=True,  # generation ignores it, as HF's generate does
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_short_and_lively,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()

    stats = model._hfaccel.engine.stats()
    print(
        f"rollouts on the engine: {stats['generated_tokens']} tokens in {stats['steps']} engine steps, "
        f"prefix-cache hit rate {stats['prefix_cache_hit_rate']:.2f} (the copies of a prompt share its blocks)"
    )
    # Between rollouts and a memory-hungry phase (evaluation, a big backward): free the KV cache now;
    # the next generate builds the engine again (see docs/rl.md for what that costs).
    hfaccel.release(model)

    # The trained policy, served greedily on a fresh engine: the same tokens as HF's own generate.
    policy = trainer.model.eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": INSTRUCTION + QUESTIONS[0]}], add_generation_prompt=True, tokenize=True
    )
    ids = torch.tensor([prompt["input_ids"] if hasattr(prompt, "keys") else prompt], device=policy.device)
    ours = policy.generate(ids, max_new_tokens=16, do_sample=False)
    hf = type(model).generate(model, ids, max_new_tokens=16, do_sample=False)
    print("trained policy:", repr(tokenizer.decode(ours[0, ids.shape[1] :], skip_special_tokens=True)))
    print("same tokens as HF generate:", torch.equal(ours, hf))


if __name__ == "__main__":
    main()
