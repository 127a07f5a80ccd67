"""Speculative decoding benchmark: drafts on/off, side by side in one run.

Two workloads on SmolLM2 (chat template, greedy, EOS honoured):
- **copy**: the answer repeats text from the prompt (rewrite / extract / quote a given passage): lookup
  drafts are often right;
- **open**: open-ended questions, whose answers rarely repeat the prompt: drafts mostly fail, and the
  engine turns speculation off per request once its acceptance stays low.
Each at batch 1 and batch 16; output tokens/s with and without speculation, and acceptance.

Draft sources (`methods`): ``"ngram"`` (prompt lookup), and two draft models, for want of a smaller
SmolLM2 with the same tokenizer: ``"self"`` (SmolLM2 drafting for itself: every draft is accepted, and
the draft costs as much as the target, so the row measures the draft machinery's overhead, not a
speed-up) and ``"early-exit:N"`` (SmolLM2's first N decoder layers with its final norm and LM head, not
trained to exit early: cheap, but a weak predictor).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import hfaccel
from hfaccel.bench.machine import cpu_description

PASSAGE = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "the members agreed to fund the children's reading room, the repair of the roof, and a small cafe "
    "near the entrance. The vote was seven to two, and construction will begin in early spring."
)
COPY_TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following text in the past tense, keeping everything else the same:\n\n{PASSAGE}",
    f"Copy this paragraph, then add one sentence at the end:\n\n{PASSAGE}",
    f"Quote the second sentence of this text exactly:\n\n{PASSAGE}",
]
OPEN_TASKS = [
    "Write a short poem about the ocean.",
    "Give three tips for learning a new language.",
    "Why do leaves change color in autumn?",
    "Describe your ideal weekend.",
]


def draft_source(model: Any, method: str) -> Any:
    """The ``speculative=`` value for a benchmark method: a name, the model itself, or a truncated copy."""
    if method == "self":
        return model
    if method.startswith("early-exit:"):
        layers = int(method.split(":", 1)[1])
        draft = copy.deepcopy(model)
        draft.model.layers = draft.model.layers[:layers]
        draft.config.num_hidden_layers = layers
        return draft
    return method


def _run(model: Any, tokenizer: Any, prompts: list, new_tokens: int, speculative: Any) -> dict:
    hfaccel.patch(
        model, speculative=speculative, num_speculative_tokens=4, max_num_seqs=max(16, len(prompts))
    )
    try:
        hfaccel.generate(model, prompts[:1], tokenizer=tokenizer, max_new_tokens=4, progress=False)  # warm-up
        engine = model._hfaccel.engine
        before = engine.stats()
        start = time.perf_counter()
        out = hfaccel.generate(model, prompts, tokenizer=tokenizer, max_new_tokens=new_tokens, progress=False)
        seconds = time.perf_counter() - start
        after = engine.stats()
    finally:
        hfaccel.unpatch(model)
    tokens = sum(len(c.token_ids) for c in out)
    drafted = after["spec_drafted"] - before["spec_drafted"]
    accepted = after["spec_accepted"] - before["spec_accepted"]
    return {
        "tok_s": tokens / seconds,
        "tokens": [c.token_ids for c in out],
        "acceptance": accepted / drafted if drafted else 0.0,
        "steps": after["steps"] - before["steps"],
    }


def run_speculative_benchmark(
    model: Any,
    tokenizer: Any,
    new_tokens: int = 96,
    methods: tuple[str, ...] = ("ngram",),
    batches: tuple[int, ...] = (1, 16),
) -> list[dict]:
    """Print and return one row per (workload, batch, method): tok/s off and on, speed-up, acceptance."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(
        f"\n== speculative decoding (k=4): {cpu_description()}, dtype={dtype}, "
        f"up to {new_tokens} new tokens, greedy =="
    )
    print(
        f"{'workload':<8} {'batch':>5} {'drafts':<13} | {'off tok/s':>9} | {'on tok/s':>8} | {'speed-up':>8} | "
        f"{'acceptance':>10} | {'steps off/on':>12} | same tokens"
    )
    sources = {method: draft_source(model, method) for method in methods}
    rows = []
    for name, tasks in (("copy", COPY_TASKS), ("open", OPEN_TASKS)):
        for batch in batches:
            prompts = [[{"role": "user", "content": tasks[i % len(tasks)]}] for i in range(batch)]
            off = _run(model, tokenizer, prompts, new_tokens, None)
            for method, source in sources.items():
                on = _run(model, tokenizer, prompts, new_tokens, source)
                row = {
                    "workload": name,
                    "batch": batch,
                    "method": method,
                    "off_tok_s": off["tok_s"],
                    "on_tok_s": on["tok_s"],
                    "speedup": on["tok_s"] / off["tok_s"],
                    "acceptance": on["acceptance"],
                    "same": off["tokens"] == on["tokens"],
                }
                rows.append(row)
                print(
                    f"{name:<8} {batch:>5} {method:<13} | {off['tok_s']:>9.1f} | {on['tok_s']:>8.1f} | "
                    f"{row['speedup']:>7.2f}x | {on['acceptance']:>9.0%} | {off['steps']:>5}/{on['steps']:<6} | "
                    f"{row['same']}"
                )
    return rows
