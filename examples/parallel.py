"""Pipeline, data, expert and tensor parallelism with hfaccel: every rank runs this same script.

    torchrun --nproc-per-node 2 examples/parallel.py --pp 2 --microbatches 4   # 2 pipeline stages
    torchrun --nproc-per-node 2 examples/parallel.py --dp 2                    # 2 engine replicas
    torchrun --nproc-per-node 6 examples/parallel.py --dp 2 --tp 3             # 2 replicas of TP=3
    torchrun --nproc-per-node 4 examples/parallel.py --dp 2 --pp 2             # 2 replicas of 2 stages
    torchrun --nproc-per-node 2 examples/parallel.py --ep 2 --model <a Mixtral / Qwen-MoE path>

The world must be the product of the sizes (dp x tp, dp x pp or dp x ep). SmolLM2-135M (the default
model) has 30 layers (any --pp up to 30) and 9 query / 3 KV heads (--tp 3); --ep needs a MoE model.
Only rank 0 prints. See docs/parallelism.md.
"""

import argparse

import torch.distributed as dist

import hfaccel
from hfaccel.default_model import load_default_model

parser = argparse.ArgumentParser()
for name in ("tp", "pp", "dp", "ep"):
    parser.add_argument(f"--{name}", type=int, default=None)
parser.add_argument("--microbatches", type=int, default=1)
parser.add_argument("--model", default=None, help="a transformers causal LM path (default: SmolLM2-135M)")
args = parser.parse_args()

if args.model is None:
    model, tokenizer = load_default_model()
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
hfaccel.patch(
    model,
    tensor_parallel_size=args.tp,
    pipeline_parallel_size=args.pp,
    expert_parallel_size=args.ep,
    data_parallel_size=args.dp,
    num_microbatches=args.microbatches,
)
questions = ("What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello.")
chats = [[{"role": "user", "content": q}] for q in questions]
completions = hfaccel.generate(model, chats, tokenizer=tokenizer, max_new_tokens=32, progress=False, seed=0)

if not dist.is_initialized() or dist.get_rank() == 0:
    for chat, completion in zip(chats, completions):
        print(f"> {chat[0]['content']}\n{completion.text.strip()}\n")
