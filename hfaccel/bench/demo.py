"""`make demo` / `python -m hfaccel demo`: what hfaccel is for, on SmolLM2-135M-Instruct.

A realistic mixed workload: 24 chat prompts, a third of them behind one long shared system prompt,
each wanting its own number of new tokens (16 to 128, enforced with ``min_new_tokens =
max_new_tokens``). Written the way a user writes it for HF: static left-padded batches of 8 through
``model.generate``, each batch running until its longest request is done. Then the same requests
through ``hfaccel.generate`` with one GenerationConfig per prompt: one continuous batch (finished
requests leave, waiting ones join at every step; the shared system prompt is computed once). Every
request's tokens are compared with HF's; the demo prints a few answers, both timings and the speed-up.

It runs in float32 by default: the parity check compares tokens exactly, and bf16 rounds differently
in a padded batch than in a packed one (on AVX2 CPUs bf16 is also about 4x slower than float32).
``--dtype auto`` picks the fast dtype of this CPU instead (`hfaccel.bench.machine.fast_dtype`).
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

import hfaccel
from hfaccel.bench.machine import cpu_description, fast_dtype
from hfaccel.bench.workloads import QUESTIONS
from hfaccel.default_model import load_default_model
from hfaccel.distributed.world import check_launch

print = functools.partial(print, flush=True)  # lines show at once when piped (under make, tee)

SYSTEM_PROMPT = (
    "You are the assistant of a small public library. Be friendly and precise. The library opens at nine "
    "in the morning and closes at six in the evening from Monday to Friday, and opens from ten to two on "
    "Saturdays; it is closed on Sundays and public holidays. Members may borrow up to eight books and two "
    "films for three weeks, and renew them twice online unless someone else has reserved them. Late "
    "returns cost twenty cents a day per item. The reading room on the first floor is silent; group work "
    "happens in the two study rooms, which can be booked at the front desk for up to three hours. Children "
    "under twelve must be accompanied. Printing costs ten cents a page. When you do not know an answer, "
    "say so and suggest asking at the front desk."
)
LIBRARY_QUESTIONS = [
    "Can I borrow ten books at once?",
    "Are you open on Sunday?",
    "How much do I pay if I return a film four days late?",
    "Where can my study group meet?",
    "Can my eight-year-old come to the library alone?",
    "How do I renew a book?",
    "What time do you close on Saturday?",
    "How much would printing twenty pages cost?",
]


@dataclass
class DemoRequest:
    chat: list[dict[str, str]]
    prompt_ids: list[int]
    new_tokens: int  # exactly this many (min_new_tokens = max_new_tokens)


def demo_requests(
    tokenizer: Any, count: int = 24, min_new: int = 16, max_new: int = 128, seed: int = 0
) -> list[DemoRequest]:
    """`count` chat prompts, every third one behind the shared system prompt, with output lengths drawn
    uniformly from [min_new, max_new]."""
    rng = random.Random(seed)
    requests = []
    library = iter(LIBRARY_QUESTIONS * (count // len(LIBRARY_QUESTIONS) + 1))
    general = iter(QUESTIONS * (count // len(QUESTIONS) + 1))
    for i in range(count):
        if i % 3 == 1:
            chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": next(library)}]
        else:
            chat = [{"role": "user", "content": next(general)}]
        rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        requests.append(DemoRequest(chat, [int(t) for t in ids], rng.randint(min_new, max_new)))
    return requests


def run_hf_static(
    model: Any, tokenizer: Any, requests: list[DemoRequest], batch_size: int
) -> list[list[int]]:
    """What a user writes with plain HF: left-padded batches in order, each run to its longest request
    (then each row cut to what its request asked for)."""
    outputs = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        longest = max(r.new_tokens for r in batch)
        encoded = tokenizer.pad({"input_ids": [r.prompt_ids for r in batch]}, return_tensors="pt")
        sequences = model.generate(
            **encoded,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        width = encoded["input_ids"].shape[1]
        outputs += [row[width : width + r.new_tokens].tolist() for row, r in zip(sequences, batch)]
    return outputs


def run_hfaccel(model: Any, tokenizer: Any, requests: list[DemoRequest]) -> list[hfaccel.Completion]:
    """The same requests as one call, one GenerationConfig per prompt."""
    configs = [
        GenerationConfig(max_new_tokens=r.new_tokens, min_new_tokens=r.new_tokens, do_sample=False)
        for r in requests
    ]
    return hfaccel.generate(
        model,
        [r.prompt_ids for r in requests],
        tokenizer=tokenizer,
        generation_config=configs,
        progress=False,
    )


def first_difference_gap(
    model: Any, prompt: list[int], ours: list[int], ref: list[int]
) -> tuple[int, float, float]:
    """Where two greedy continuations first differ, the gap between the logits of the two tokens chosen
    there (an unpadded forward of `model`), and the larger of those two logits: a gap near 0 is a near-tie
    that rounding in a padded vs a packed batch may flip."""
    diff = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:diff]])).logits[0, -1].float()
    pair = logits[[ref[diff], ours[diff]]]
    return diff, float((pair[0] - pair[1]).abs()), float(pair.abs().max())


def float32_twin(model: Any) -> Any:
    """SmolLM2 in float32 holding exactly `model`'s (bf16 or fp16) weights: it scores a difference without
    the low precision's rounding, so a near-tie of the weights themselves is told apart from a bug."""
    twin, _ = load_default_model(torch.float32)
    with torch.no_grad():
        for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
            whole = theirs.full_tensor() if hasattr(theirs, "full_tensor") else theirs  # a TP shard: gathered
            mine.copy_(whole.float())
    return twin


def run_demo(
    dtype: torch.dtype | None = torch.float32,
    num_prompts: int = 24,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    show: int = 3,
    tensor_parallel_size: int = 1,
) -> dict[str, float]:
    """Run the demo; returns the measured numbers (seconds, tokens/s, speed-up, requests identical).

    ``tensor_parallel_size=N`` (under ``torchrun --nproc-per-node N``) shards the model N ways when it is
    patched (docs/parallelism.md); the HF baseline runs first, unsharded, on every rank."""
    if tensor_parallel_size > 1:  # before minutes of HF baseline, not after
        check_launch(tensor_parallel_size, "tensor_parallel_size")
    if dtype is None:
        dtype = fast_dtype()
        print(f"dtype: {dtype} (the fast one for this CPU; exact parity with HF is only expected in float32)")
    elif dtype == torch.float32:
        print(
            "dtype: float32 (the parity check compares tokens exactly; --dtype auto picks "
            f"{fast_dtype()} for this CPU)"
        )
    print(f"machine: {cpu_description()}")
    print("loading SmolLM2-135M-Instruct (embedded GGUF, offline)...")
    model, tokenizer = load_default_model(dtype)
    tokenizer.padding_side = "left"
    requests = demo_requests(tokenizer, num_prompts, min(16, max_new_tokens), max_new_tokens)
    wanted = sum(r.new_tokens for r in requests)
    shared = sum(1 for r in requests if len(r.chat) == 2)
    print(
        f"workload: {len(requests)} chat prompts ({shared} share a system prompt), "
        f"{min(r.new_tokens for r in requests)}-{max(r.new_tokens for r in requests)} new tokens "
        f"each, {wanted} in all"
    )

    with torch.inference_mode():
        warm = [DemoRequest(r.chat, r.prompt_ids, 2) for r in requests[:2]]
        run_hf_static(model, tokenizer, warm, batch_size)  # warm-up: a few tokens
        start = time.perf_counter()
        reference = run_hf_static(model, tokenizer, requests, batch_size)
        hf_seconds = time.perf_counter() - start
        print(f"HF generate, static batches of {batch_size}: {hf_seconds:.1f} s")

        hfaccel.patch(model, tensor_parallel_size=tensor_parallel_size if tensor_parallel_size > 1 else None)
        hfaccel.generate(
            model, [requests[0].prompt_ids], max_new_tokens=2, progress=False
        )  # builds the engine
        hfaccel.reset_prefix_cache(model)
        start = time.perf_counter()
        completions = run_hfaccel(model, tokenizer, requests)
        ours_seconds = time.perf_counter() - start
        print(f"hfaccel.generate, one continuous batch: {ours_seconds:.1f} s")

    # In float32 a flip needs a gap below 1e-3. In bf16 (or fp16) padded and packed batches round every
    # layer differently: the gap is measured on the same weights in float32, and a flip within 4 ulps of
    # the logit (eps x |logit| each: the two logits' own rounding plus that of the hidden state the LM
    # head reads, 0.4 at a logit of 12 in bf16) is rounding; a wider one is reported as a bug.
    same, near_ties, differ = 0, [], []
    scorer = model if dtype == torch.float32 else None
    for i, (request, completion, ref) in enumerate(zip(requests, completions, reference)):
        if completion.token_ids == ref:
            same += 1
            continue
        if scorer is None:
            scorer = float32_twin(model)
        position, gap, size = first_difference_gap(scorer, request.prompt_ids, completion.token_ids, ref)
        tie = 1e-3 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * size
        (near_ties if gap < tie else differ).append((i, position, gap))

    for request, completion in list(zip(requests, completions))[:show]:
        answer = completion.text.strip().replace("\n", " ")
        answer = answer if len(answer) <= 240 else answer[:240] + "..."
        print(f"\n> {request.chat[-1]['content']}  [{request.new_tokens} tokens]\n{answer}")

    hf_rate, ours_rate = wanted / hf_seconds, wanted / ours_seconds
    speedup = hf_seconds / ours_seconds
    print(f"\n{'system':<42} {'seconds':>8} {'tokens':>7} {'tok/s':>7}")
    print(
        f"{f'HF generate (static batches of {batch_size})':<42} {hf_seconds:>8.1f} {wanted:>7} {hf_rate:>7.1f}"
    )
    print(
        f"{'hfaccel.generate (continuous batching)':<42} {ours_seconds:>8.1f} {wanted:>7} {ours_rate:>7.1f}"
    )
    print(f"\nspeed-up: {speedup:.2f}x on {cpu_description()}")
    parity = f"identical outputs: {same} of {len(requests)} requests"
    if near_ties:
        where = ", ".join(f"#{i} at token {p} (gap {g:.1e})" for i, p, g in near_ties)
        kind = (
            "HF's own logits" if dtype == torch.float32 else f"the float32 logits (within {dtype} rounding)"
        )
        parity += f"; {len(near_ties)} differ after a near-tie of {kind}: {where}"
    if differ:
        where = ", ".join(f"#{i} at token {p} (gap {g:.2f})" for i, p, g in differ)
        parity += f"; {len(differ)} DIFFER with a clear winner (a bug: please report): {where}"
    print(parity)
    engine = model._hfaccel.engine
    print(f"prefix cache: {engine.block_manager.stats.hit_tokens} prompt tokens reused")
    print("More: make bench (offline throughput, prefix caching, chunked prefill, batching strategies)")
    return {
        "hf_seconds": hf_seconds,
        "hfaccel_seconds": ours_seconds,
        "speedup": speedup,
        "identical": same,
        "near_ties": len(near_ties),
        "differ": len(differ),
    }
