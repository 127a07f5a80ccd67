"""`python -m hfaccel bench tp`: tensor parallelism on this CPU, side by side.

The same work three ways: one process with 2 threads (TP=1), two gloo processes with 1 thread each
(TP=2), and TP=2 with sequence parallelism in prefill steps. The model is SmolLM2-sized (hidden 576, 30
layers, intermediate 1536, vocabulary 49152, tied embeddings) with 12 query / 4 KV heads instead of
SmolLM2's 9 / 3, which do not divide by 2; random weights, float32. Every system runs the same requests
(greedy, EOS ignored) after a warm-up, and reports wall time, output tokens/s, median prefill-step and
decode-step times, and, for TP, the share of step time spent inside collectives (gloo all-reduce /
reduce-scatter / all-gather, waiting for the other rank included). On a CPU, communication goes through
gloo over loopback TCP and both ranks share the same cores and memory bandwidth: do not read a GPU
figure into these numbers.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from hfaccel.bench.machine import cpu_description

SYSTEMS = (
    ("TP=1, 2 threads", 1, 2, False),
    ("TP=2, 1 thread each", 2, 1, False),
    ("TP=2 + SP, 1 thread each", 2, 1, True),
)


def smollm2_sized_config(layers: int = 30):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _workload(num_requests: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (prompt_len,), generator=g).tolist() for _ in range(num_requests)]


def _run_system(rank: int, world: int, port: int, threads: int, sp: bool, work: dict, out_dir: str) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
        )
    from transformers import LlamaForCausalLM

    import hfaccel
    from hfaccel.distributed import tp as tp_module
    from hfaccel.engine.loop import close_all_loops

    torch.manual_seed(0)
    model = LlamaForCausalLM(smollm2_sized_config(work["layers"])).eval()
    kwargs: dict[str, Any] = {"max_num_batched_tokens": work["budget"], "enable_prefix_caching": False}
    if world > 1:
        kwargs.update(tensor_parallel_size=world, sequence_parallel=sp)
    hfaccel.patch(model, **kwargs)
    prompts = _workload(work["num_requests"], work["prompt_len"])
    gen = {"max_new_tokens": work["new_tokens"], "min_new_tokens": work["new_tokens"], "do_sample": False}
    hfaccel.generate(model, _workload(2, 16), progress=False, **gen)  # warm-up: engine, allocations
    engine = model._hfaccel.engine
    first_step = len(engine.step_stats)
    tp_module.comm_stats.update(calls=0, seconds=0.0)
    start = time.perf_counter()
    out = hfaccel.generate(model, prompts, progress=False, **gen)
    wall = time.perf_counter() - start
    steps = list(engine.step_stats)[first_step:]
    prefill = [s.duration_s for s in steps if s.num_prefill_tokens]
    decode = [s.duration_s for s in steps if not s.num_prefill_tokens]
    result = {
        "wall_s": wall,
        "tokens": [c.token_ids for c in out],
        "prefill_ms": 1000 * statistics.median(prefill) if prefill else float("nan"),
        "decode_ms": 1000 * statistics.median(decode) if decode else float("nan"),
        "comm_share": tp_module.comm_stats["seconds"] / sum(s.duration_s for s in steps)
        if world > 1
        else 0.0,
        "comm_calls_per_step": tp_module.comm_stats["calls"] / max(len(steps), 1),
        "steps": len(steps),
    }
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if world > 1:
        # The loop thread and the model hold the TP group: free them first, or the group outlives
        # destroy_process_group and gloo tears it down at exit (docs/parallelism.md).
        close_all_loops("the benchmark is done")
        del model, engine, out
        gc.collect()
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_parallel_benchmark(
    num_requests: int = 16, prompt_len: int = 96, new_tokens: int = 32, layers: int = 30, budget: int = 512
) -> list[dict[str, Any]]:
    """Run every system in fresh processes, one after another; print and return the table rows."""
    work = {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "layers": layers,
        "budget": budget,
    }
    print(f"\n## Tensor parallelism on this CPU ({cpu_description()})")
    print(
        f"SmolLM2-sized Llama (hidden 576, {layers} layers, 12/4 heads), float32, random weights; {num_requests} "
        f"requests x {prompt_len} prompt tokens, {new_tokens} new tokens each, token budget {budget}, gloo"
    )
    rows = []
    for name, world, threads, sp in SYSTEMS:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(
                _run_system, args=(world, _free_port(), threads, sp, work, out_dir), nprocs=world, join=True
            )
            with open(os.path.join(out_dir, "rank0.pkl"), "rb") as f:
                result = pickle.load(f)
        result["name"] = name
        rows.append(result)
    base = rows[0]
    print(
        f"\n| {'system':<26} | wall s | out tok/s | vs TP=1 | prefill step ms | decode step ms | "
        "in collectives | collectives/step | same tokens |"
    )
    print(
        f"|{'-' * 28}|-------:|----------:|--------:|----------------:|---------------:|---------------:|"
        "-----------------:|:-----------:|"
    )
    for r in rows:
        rate = num_requests * new_tokens / r["wall_s"]
        share = f"{100 * r['comm_share']:.0f}%" if r["comm_share"] else "-"
        calls = f"{r['comm_calls_per_step']:.0f}" if r["comm_share"] else "-"
        print(
            f"| {r['name']:<26} | {r['wall_s']:6.2f} | {rate:9.1f} | {base['wall_s'] / r['wall_s']:6.2f}x | "
            f"{r['prefill_ms']:15.1f} | {r['decode_ms']:14.1f} | {share:>14} | {calls:>16} | "
            f"{'yes' if r['tokens'] == base['tokens'] else 'no':^11} |"
        )
    print(
        "\nOn a CPU, gloo communication (loopback TCP, both ranks on the same cores) dominates a tensor-parallel "
        "step; no GPU figure is claimed here."
    )
    return rows
