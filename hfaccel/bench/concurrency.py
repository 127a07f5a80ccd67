"""Many callers benchmark: N threads, each sending chat requests one after another (as a chat UI does),
through HF `generate` per thread vs the patched `generate` per thread, side by side in one run.

With HF each thread runs its own batch-of-one generation loop; with hfaccel every thread's request joins
the model's one engine loop, so concurrent requests share steps. Reported: requests/s and p50/p99
latency (one request, submit to return) for each number of callers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.bench.workloads import QUESTIONS
from hfaccel.engine.metrics import percentile


@dataclass
class ConcurrencyResult:
    """One system's run with `callers` threads."""

    system: str
    callers: int
    seconds: float
    latencies: list[float] = field(repr=False)
    outputs: list[list[int]] = field(repr=False)

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies) / self.seconds

    def latency(self, q: float) -> float:
        return percentile(self.latencies, q) or 0.0


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """Short chat prompts (the workload questions, rendered with the chat template)."""
    prompts = []
    for i in range(count):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append([int(t) for t in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered)])
    return prompts


def run_callers(
    generate: Any, prompts: list[list[int]], callers: int, per_caller: int, max_new_tokens: int, name: str
) -> ConcurrencyResult:
    """`callers` threads, each sending `per_caller` requests one after another through `generate`."""
    latencies: list[float] = []
    outputs: list[list[int]] = [[] for _ in range(callers * per_caller)]
    errors: list[BaseException] = []
    lock = threading.Lock()
    start_gate = threading.Barrier(callers)

    def caller(k: int) -> None:
        try:
            start_gate.wait()
            for j in range(per_caller):
                index = k * per_caller + j
                prompt = prompts[index % len(prompts)]
                began = time.perf_counter()
                ids = torch.tensor([prompt])
                out = generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=max_new_tokens,
                    do_sample=False,
                )
                elapsed = time.perf_counter() - began
                with lock:
                    latencies.append(elapsed)
                outputs[index] = out[0, len(prompt) :].tolist()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    if errors:
        raise errors[0]
    return ConcurrencyResult(name, callers, seconds, latencies, outputs)


def run_concurrency_benchmark(
    model: Any,
    tokenizer: Any,
    callers: tuple[int, ...] = (1, 4, 16),
    requests_per_caller: int = 4,
    max_new_tokens: int = 32,
) -> list[ConcurrencyResult]:
    """HF `generate` per thread vs patched `generate` per thread, for each number of callers; prints a table."""
    import hfaccel

    dtype = next(model.parameters()).dtype
    prompts = chat_prompts(tokenizer, max(callers) * requests_per_caller)
    hf_generate = type(model).generate  # the unpatched method, whatever the instance holds

    def hf(ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            return hf_generate(model, ids, pad_token_id=tokenizer.pad_token_id, **kwargs)

    was_patched = hfaccel.api.is_patched(model)
    hfaccel.patch(model)
    try:
        print(
            f"\nmany callers: each thread sends {requests_per_caller} chat requests one after another, "
            f"{max_new_tokens} new tokens each; dtype={dtype}, CPU ISA "
            f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads"
        )
        ours_generate = model.generate
        warm_ids = torch.tensor([prompts[0]])
        for warm in (hf, ours_generate):
            warm(warm_ids, attention_mask=torch.ones_like(warm_ids), max_new_tokens=4, do_sample=False)
        results = []
        for count in callers:
            pair = []
            for name, generate in (
                ("HF generate per thread", hf),
                ("hfaccel generate per thread", ours_generate),
            ):
                result = run_callers(generate, prompts, count, requests_per_caller, max_new_tokens, name)
                print(f"  done: {count} callers, {name}: {result.seconds:.1f} s")
                pair.append(result)
            results.extend(pair)
        print_table(results)
        return results
    finally:
        if not was_patched:
            hfaccel.unpatch(model)


def print_table(results: list[ConcurrencyResult]) -> None:
    """Requests/s and latency percentiles per system and number of callers, with hfaccel's ratios."""
    print(
        f"\n{'callers':>7}  {'system':<28} {'requests':>8} {'seconds':>8} {'req/s':>7} "
        f"{'p50 lat s':>9} {'p99 lat s':>9} {'req/s x':>8} {'= HF':>6}"
    )
    by_callers: dict[int, list[ConcurrencyResult]] = {}
    for r in results:
        by_callers.setdefault(r.callers, []).append(r)
    for count, rows in by_callers.items():
        hf = rows[0]
        for r in rows:
            same = sum(a == b for a, b in zip(r.outputs, hf.outputs))
            print(
                f"{count:>7}  {r.system:<28} {len(r.latencies):>8} {r.seconds:>8.1f} {r.requests_per_s:>7.2f} "
                f"{r.latency(50):>9.2f} {r.latency(99):>9.2f} {r.requests_per_s / hf.requests_per_s:>7.2f}x "
                f"{same:>3}/{len(hf.outputs)}"
            )
