"""Tensor parallelism with hfaccel: every rank runs this same script.

    torchrun --nproc-per-node 3 examples/tensor_parallel.py

SmolLM2-135M has 9 query and 3 KV heads, so it splits 3 ways (not 2). Every rank loads the same weights,
patches with the same options and calls `generate` with the same inputs; the completions are the same on
every rank, and only rank 0 prints them. See docs/parallelism.md.
"""

import os

import torch.distributed as dist

import hfaccel
from hfaccel.default_model import load_default_model

model, tokenizer = load_default_model()
world = int(os.environ.get("WORLD_SIZE", "1"))
# Shards the model in place from its transformers TP plan (and starts the gloo/NCCL process group from
# torchrun's environment); sequence parallelism shards the tokens of prefill steps only.
hfaccel.patch(model, tensor_parallel_size=world, sequence_parallel=world > 1)

chats = [
    [{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a primary colour.")
]
completions = hfaccel.generate(model, chats, tokenizer=tokenizer, max_new_tokens=32, progress=False, seed=0)

if not dist.is_initialized() or dist.get_rank() == 0:
    for chat, completion in zip(chats, completions):
        print(f"> {chat[0]['content']}\n{completion.text.strip()}\n")
