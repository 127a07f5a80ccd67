"""PP=2 prefill with 1 vs 4 microbatches, DP=2 against one replica, on the default model (SmolLM2-135M).

    torchrun --nproc-per-node 2 -m hfaccel.bench.pp_dp pp1      # PP=2, 1 microbatch, prefill only
    torchrun --nproc-per-node 2 -m hfaccel.bench.pp_dp pp4      # PP=2, 4 microbatches, prefill only
    python -m hfaccel.bench.pp_dp single_prefill                # one process, prefill only
    torchrun --nproc-per-node 2 -m hfaccel.bench.pp_dp dp2      # DP=2, 32 new tokens each
    python -m hfaccel.bench.pp_dp single_decode                 # one process, 32 new tokens each

16 prompts of 96 random tokens, a 512-token step budget, greedy; rank 0 prints one JSON line (wall time
of the timed call after a warm-up call). Results: docs/parallelism.md.
"""

import json
import sys
import time

import torch
import torch.distributed as dist

import hfaccel
from hfaccel.default_model import load_default_model


def main(mode: str) -> None:
    model, tok = load_default_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (96,), generator=g).tolist() for _ in range(16)]
    kw = dict(max_num_batched_tokens=512)
    if mode.startswith("pp"):
        hfaccel.patch(model, pipeline_parallel_size=2, num_microbatches=int(mode[2:]), **kw)
    elif mode == "dp2":
        hfaccel.patch(model, data_parallel_size=2, **kw)
    else:
        hfaccel.patch(model, **kw)
    new = 1 if (mode.startswith("pp") or mode == "single_prefill") else 32
    hfaccel.generate(model, prompts[:2], max_new_tokens=2, do_sample=False, progress=False)  # warm-up
    if dist.is_initialized():
        dist.barrier()
    t = time.perf_counter()
    out = hfaccel.generate(model, prompts, max_new_tokens=new, do_sample=False, progress=False)
    wall = time.perf_counter() - t
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "mode": mode,
                    "wall_s": round(wall, 2),
                    "prompt_tok_s": round(16 * 96 / wall, 1),
                    "out_tok_s": round(sum(len(c.token_ids) for c in out) / wall, 1),
                    "tokens_head": [c.token_ids[:4] for c in out[:2]],
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1])  # pp1 pp4 dp2 single_prefill single_decode
