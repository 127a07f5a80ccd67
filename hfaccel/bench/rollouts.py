"""RL rollout benchmarks: GRPO-style sampling, many LoRA adapters in one batch, and release/rebuild.

1. **GRPO rollout**: N prompts that share an instruction prefix, G sampled generations each (the
   shape of a GRPO/RLOO generation batch: TRL sends the N x G rows to ``model.generate`` in one call),
   through HF ``generate`` (one padded batch), HF ``generate_batch`` (its continuous batching) and
   hfaccel (the patched ``generate``: the G copies of a prompt, and the shared instruction, share KV
   blocks). Every system generates exactly ``new_tokens`` per row (EOS ignored).
2. **Four LoRA adapters**: SmolLM2 with 4 random LoRA adapters, requests spread over them; one mixed
   continuous batch (``hfaccel.generate(adapter=[...])``) vs the same requests run adapter by adapter
   on the same engine, next to PEFT's own mixed batch (HF ``generate(adapter_names=...)``) and the
   base model without adapters. Greedy, so the mixed and per-adapter runs can be compared token by
   token.
3. **Release and rebuild**: what ``hfaccel.release`` frees (RSS; CUDA memory where there is CUDA) and
   what the next ``generate`` pays to build the engine and allocate its KV cache again.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

import hfaccel
from hfaccel.bench.machine import cpu_description

INSTRUCTION = (
    "You are a careful math tutor. Solve the problem step by step, explain each step in one short "
    "sentence, check the result, and put the final answer on the last line after 'Answer:'. "
    "Use plain words, no formulas unless needed."
)
PROBLEMS = [
    "A train travels 60 km in 45 minutes. What is its speed in km/h?",
    "What is 17 times 23?",
    "A shirt costs 40 dollars after a 20 percent discount. What was the original price?",
    "How many minutes are there in three and a half hours?",
    "The sum of two numbers is 30 and their difference is 4. What are the numbers?",
    "A rectangle has a perimeter of 26 cm and a width of 5 cm. What is its area?",
    "What is the next prime number after 89?",
    "If 3 pencils cost 75 cents, how much do 8 pencils cost?",
]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _dtype_name(model: Any) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def grpo_prompts(tokenizer: Any, num_prompts: int) -> list[list[int]]:
    prompts = []
    for i in range(num_prompts):
        messages = [
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": PROBLEMS[i % len(PROBLEMS)]},
        ]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        prompts.append([int(t) for t in ids])
    return prompts


# ------------------------------------------------------------------ 1. GRPO rollout


def _hf_generate(model: Any, prompts: list[list[int]], copies: int, new_tokens: int, pad_id: int) -> int:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.repeat_interleave(copies, 0),  # TRL repeats each prompt G times
            attention_mask=mask.repeat_interleave(copies, 0),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            pad_token_id=pad_id,
        )
    return (out.shape[1] - width) * out.shape[0]


def _hf_generate_batch(model: Any, prompts: list[list[int]], copies: int, new_tokens: int) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    tokens, finished, total = 0, 0, len(prompts) * copies
    try:
        for i, prompt in enumerate(p for p in prompts for _ in range(copies)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new_tokens, eos_token_id=-1)
        while finished < total:
            result = manager.get_result(timeout=5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing the workload")
                continue
            if result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
    finally:
        manager.stop(block=True)
    return tokens


def _hfaccel_generate(model: Any, prompts: list[list[int]], copies: int, new_tokens: int, pad_id: int) -> int:
    """The patched ``model.generate`` on the same padded batch HF gets (TRL's call); strict: no fallback."""
    hfaccel.patch(model, strict=True, max_num_seqs=max(64, len(prompts) * copies))
    return _hf_generate(model, prompts, copies, new_tokens, pad_id)


def run_grpo_rollout(
    model: Any, tokenizer: Any, num_prompts: int = 8, generations: int = 4, new_tokens: int = 32
) -> list[dict]:
    prompts = grpo_prompts(tokenizer, num_prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    shared = len(os.path.commonprefix(prompts))
    print(
        f"\n== GRPO-style rollout: {num_prompts} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens, the first {shared} shared) x {generations} "
        f"samples, {new_tokens} new tokens each (EOS ignored), temperature 1: {cpu_description()}, "
        f"dtype={_dtype_name(model)} =="
    )
    hfaccel.unpatch(model)
    systems = [
        (
            "HF generate (one padded batch)",
            lambda: _hf_generate(model, prompts, generations, new_tokens, pad_id),
        ),
        (
            "HF generate_batch (continuous)",
            lambda: _hf_generate_batch(model, prompts, generations, new_tokens),
        ),
        (
            "hfaccel (patched generate)",
            lambda: _hfaccel_generate(model, prompts, generations, new_tokens, pad_id),
        ),
    ]
    _hf_generate(model, prompts[:1], 1, 2, pad_id)  # warm-up
    rows = []
    print(
        f"{'system':<32} | {'seconds':>7} | {'tokens':>6} | {'tok/s':>7} | vs HF generate | prefix hit rate"
    )
    for name, run in systems:
        start = time.perf_counter()
        tokens = run()
        seconds = time.perf_counter() - start
        hits = ""
        if name.startswith("hfaccel"):
            hits = f"{model._hfaccel.engine.stats()['prefix_cache_hit_rate']:.2f}"
            hfaccel.unpatch(model)
        rows.append(
            {"system": name, "seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "hits": hits}
        )
        base = rows[0]["tok_s"]
        print(
            f"{name:<32} | {seconds:7.1f} | {tokens:6d} | {tokens / seconds:7.1f} | "
            f"{tokens / seconds / base:13.2f}x | {hits}"
        )
    return rows


# ------------------------------------------------------------------ 2. four LoRA adapters


def add_random_adapters(model: Any, count: int = 4, seed: int = 0) -> tuple[Any, list[str]]:
    """Wrap `model` with PEFT and add `count` random LoRA adapters (ranks 8, 16, 8, 16...) on the
    attention and MLP projections; returns the PEFT model (eval mode) and the adapter names."""
    import peft

    names = [f"adapter{i}" for i in range(count)]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(seed)
    peft_model = None
    for i, name in enumerate(names):
        r = 8 if i % 2 == 0 else 16
        config = peft.LoraConfig(r=r, lora_alpha=r, target_modules=targets, task_type="CAUSAL_LM")
        if peft_model is None:
            peft_model = peft.get_peft_model(model, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:  # PEFT starts B at zero: give every adapter a real (small) delta
                p.normal_(0.0, 0.02)
    peft_model.to(dtype)
    return peft_model.eval(), names


def run_lora_mix(model: Any, tokenizer: Any, per_adapter: int = 8, new_tokens: int = 32) -> list[dict]:
    from hfaccel.bench.workloads import chat_workload

    peft_model, names = add_random_adapters(model)
    count = per_adapter * len(names)
    prompts = chat_workload(tokenizer, num_requests=count).prompts
    adapters = [names[i % len(names)] for i in range(count)]
    print(
        f"\n== {len(names)} LoRA adapters (r=8/16 on q,k,v,o,gate,up,down): {count} chat requests, "
        f"{new_tokens} new tokens each (EOS ignored), greedy: {cpu_description()}, "
        f"dtype={_dtype_name(peft_model)} =="
    )
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, progress=False)
    rows = []

    def record(name: str, seconds: float, outputs: list[list[int]], steps: int | None = None) -> None:
        tokens = sum(map(len, outputs))
        rows.append({"system": name, "seconds": seconds, "tok_s": tokens / seconds, "outputs": outputs})
        print(
            f"{name:<44} | {seconds:7.1f} | {tokens:6d} | {tokens / seconds:7.1f} | "
            f"{'' if steps is None else steps}"
        )

    print(f"{'system':<44} | {'seconds':>7} | {'tokens':>6} | {'tok/s':>7} | engine steps")
    # PEFT's own mixed batch: HF generate(adapter_names=...) on one padded batch.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = peft_model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            adapter_names=adapters,
            pad_token_id=pad_id,
        )
    record(
        "PEFT mixed batch (HF generate, adapter_names)", time.perf_counter() - start, out[:, width:].tolist()
    )

    hfaccel.patch(peft_model, strict=True, max_num_seqs=max(64, count))
    engine = peft_model._hfaccel.get_engine(peft_model)
    hfaccel.generate(peft_model, prompts[:2], adapter=names[:2], max_new_tokens=2, progress=False)  # warm-up
    steps = engine.num_steps
    start = time.perf_counter()
    done = hfaccel.generate(peft_model, prompts, adapter=adapters, **kwargs)
    record(
        "hfaccel, one mixed batch",
        time.perf_counter() - start,
        [c.token_ids for c in done],
        engine.num_steps - steps,
    )
    mixed = [c.token_ids for c in done]

    steps = engine.num_steps
    start = time.perf_counter()
    by_adapter: list[list[int]] = [[] for _ in prompts]
    for name in names:
        rows_of = [i for i, a in enumerate(adapters) if a == name]
        part = hfaccel.generate(peft_model, [prompts[i] for i in rows_of], adapter=name, **kwargs)
        for i, c in zip(rows_of, part):
            by_adapter[i] = c.token_ids
    record(
        "hfaccel, adapter by adapter (4 batches)",
        time.perf_counter() - start,
        by_adapter,
        engine.num_steps - steps,
    )

    steps = engine.num_steps
    start = time.perf_counter()
    with peft_model.disable_adapter():
        base = hfaccel.generate(peft_model, prompts, **kwargs)
    record(
        "hfaccel, base model (adapters off)",
        time.perf_counter() - start,
        [c.token_ids for c in base],
        engine.num_steps - steps,
    )
    same = sum(a == b for a, b in zip(mixed, by_adapter))
    same_peft = sum(a == b for a, b in zip(mixed, rows[0]["outputs"]))
    print(
        f"mixed vs adapter by adapter: {rows[1]['tok_s'] / rows[2]['tok_s']:.2f}x tok/s; identical tokens "
        f"{same}/{count} (mixed vs by adapter), {same_peft}/{count} (mixed vs PEFT's batch)"
    )
    hfaccel.unpatch(peft_model)
    peft_model.unload()  # the base model without its LoRA layers, for the next suites
    return rows


# ------------------------------------------------------------------ 3. release and rebuild


def run_release(
    model: Any, tokenizer: Any, num_prompts: int = 8, generations: int = 4, new_tokens: int = 16
) -> dict:
    """Time a rollout, `hfaccel.release`, then the next rollout (which rebuilds the engine)."""
    prompts = grpo_prompts(tokenizer, num_prompts)
    kwargs = dict(num_return_sequences=generations, do_sample=True, max_new_tokens=new_tokens, progress=False)
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    hfaccel.unpatch(model)
    gc.collect()

    def memory() -> str:
        text = f"RSS {_rss_bytes() / 2**30:.2f} GiB"
        if cuda:
            text += f", CUDA allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB"
        return text

    print(f"\n== release between rollouts: {cpu_description()}, dtype={_dtype_name(model)} ==")
    print(f"before the engine: {memory()}")
    hfaccel.patch(model)
    start = time.perf_counter()
    engine = model._hfaccel.get_engine(model)
    build = time.perf_counter() - start
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
    print(
        f"engine built in {build:.2f} s ({engine.num_blocks} KV blocks, {kv_bytes / 2**30:.2f} GiB): {memory()}"
    )
    del engine
    start = time.perf_counter()
    hfaccel.generate(model, prompts, tokenizer=tokenizer, **kwargs)
    warm = time.perf_counter() - start
    print(f"rollout 1 ({num_prompts}x{generations} samples, {new_tokens} tokens): {warm:.2f} s: {memory()}")
    start = time.perf_counter()
    hfaccel.generate(model, prompts, tokenizer=tokenizer, **kwargs)
    again = time.perf_counter() - start
    print(f"rollout 2 on the same engine: {again:.2f} s")
    start = time.perf_counter()
    hfaccel.release(model)
    released = time.perf_counter() - start
    print(f"hfaccel.release: {released * 1000:.0f} ms: {memory()}")
    start = time.perf_counter()
    hfaccel.generate(model, prompts, tokenizer=tokenizer, **kwargs)
    rebuilt = time.perf_counter() - start
    print(
        f"rollout 3 after release (engine rebuilt, KV allocated again): {rebuilt:.2f} s "
        f"(+{rebuilt - again:.2f} s over rollout 2): {memory()}"
    )
    hfaccel.unpatch(model)
    return {
        "build_s": build,
        "kv_gib": kv_bytes / 2**30,
        "release_s": released,
        "rebuild_extra_s": rebuilt - again,
    }


def run_rollout_benchmarks(model: Any, tokenizer: Any) -> None:
    run_grpo_rollout(model, tokenizer)
    run_lora_mix(model, tokenizer)
    run_release(model, tokenizer)
