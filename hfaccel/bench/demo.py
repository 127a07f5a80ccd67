"""`make demo`: SmolLM2 answers chat prompts through `hfaccel.patch(model)` + `model.generate`, then the
same batch runs on unpatched HF generate for a side-by-side speed table."""

from __future__ import annotations

import time

import torch

import hfaccel
from hfaccel.default_model import load_default_model

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about autumn leaves.",
    "Explain what a neural network is in two sentences.",
    "What should I pack for a weekend hiking trip?",
    "Why do cats purr?",
    "Suggest a healthy breakfast.",
    "How does a rainbow form?",
]


def _new_tokens(sequences: torch.Tensor, width: int, eos_id: int, pad_id: int) -> list[list[int]]:
    rows = []
    for row in sequences[:, width:].tolist():
        out = []
        for token in row:
            out.append(token)
            if token == eos_id:
                break
        while out and out[-1] == pad_id and pad_id != eos_id:
            out.pop()
        rows.append(out)
    return rows


def run_demo(
    dtype: torch.dtype = torch.float32, max_new_tokens: int = 64, tensor_parallel_size: int = 1
) -> None:
    """Answer the demo prompts with the patched model and compare tokens/s with HF generate.

    ``tensor_parallel_size=N`` (under ``torchrun --nproc-per-node N``) shards the model N ways when it is
    patched (docs/parallelism.md); the HF baseline runs unsharded on every rank."""
    print("loading SmolLM2-135M-Instruct (embedded GGUF, offline)...")
    model, tokenizer = load_default_model(dtype)
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    batch = tokenizer.apply_chat_template(
        chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
    )
    width = batch["input_ids"].shape[1]
    args = dict(**batch, max_new_tokens=max_new_tokens, do_sample=False)

    timings = {}
    with torch.inference_mode():
        start = time.perf_counter()
        reference = model.generate(**args)
        timings["HF generate (one padded batch)"] = (time.perf_counter() - start, reference)

        hfaccel.patch(model, tensor_parallel_size=tensor_parallel_size if tensor_parallel_size > 1 else None)
        model.generate(**{**args, "max_new_tokens": 2})  # builds the engine and its KV cache once
        start = time.perf_counter()
        ours = model.generate(**args)
        timings["hfaccel (patched model.generate)"] = (time.perf_counter() - start, ours)

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    answers = _new_tokens(ours, width, eos, pad)
    for question, tokens in zip(DEMO_QUESTIONS, answers):
        print(f"\n> {question}\n{tokenizer.decode(tokens, skip_special_tokens=True).strip()}")

    print(f"\n{'system':<36} {'seconds':>8} {'new tokens':>11} {'tok/s':>8}")
    rates = {}
    for name, (seconds, sequences) in timings.items():
        count = sum(map(len, _new_tokens(sequences, width, eos, pad)))
        rates[name] = count / seconds
        print(f"{name:<36} {seconds:>8.2f} {count:>11} {rates[name]:>8.1f}")
    same = torch.equal(reference, ours)
    names = list(rates)
    print(
        f"\nhfaccel / HF: {rates[names[1]] / rates[names[0]]:.2f}x tokens/s; identical output tensors: {same}"
    )
    print(f"engine: {model._hfaccel.engine!r}")
    print("Full benchmark (32 requests, 8-256 tokens each, HF generate_batch too): make bench")
