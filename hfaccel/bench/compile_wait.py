"""Compile without the wait (`python -m hfaccel bench compile`): a lone user's chat session on SmolLM2
float32 under ``compile="off"``, ``"decode"`` and ``"background"``, each in a fresh process with an empty
inductor cache (a cold compile), for the same wall-clock window; then ``"background"`` again over the
cache the cold run left (a second process starts warm).

A session is chat prompts answered one after another, 64 tokens each (EOS suppressed), until the window
closes. Reported per mode: the first answer's latency (what ``"decode"`` makes a user wait), tokens
served in the window, and the decode step's median before and after the compiled graph took over, so
the cost of compiling beside serving on this machine's cores shows against the eager steps of
``"off"``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from hfaccel.bench.machine import cpu_description

MODES = ("off", "background", "decode")


def _session(mode: str, seconds: float, new_tokens: int) -> dict[str, Any]:
    """Run in a child process: one chat session under `mode` for `seconds` (see the module doc)."""
    import torch

    import hfaccel
    from hfaccel.bench.workloads import chat_workload
    from hfaccel.default_model import load_default_model

    model, tokenizer = load_default_model(torch.float32)
    prompts = chat_workload(tokenizer, num_requests=64).prompts
    hfaccel.patch(model, compile=mode, progress=False)
    start = time.perf_counter()
    answers = []
    while time.perf_counter() - start < seconds:
        prompt = prompts[len(answers) % len(prompts)]
        done = hfaccel.generate(
            model, [prompt], max_new_tokens=new_tokens, min_new_tokens=new_tokens, progress=False
        )[0]
        answers.append((time.perf_counter() - start, len(done.token_ids)))
    runner = model._hfaccel.engine.runner
    ready_at = None  # when the bucket of one sequence began to run compiled, from the session's start
    if runner.background is not None and 1 in runner.background.ready_at:
        ready_at = runner.background.ready_at[1] - start
    steps = [
        (s.start_s - start, s.duration_s)
        for s in model._hfaccel.engine.step_stats
        if s.num_prefill_tokens == 0 and s.num_seqs == 1
    ]
    return {"answers": answers, "ready_s": ready_at, "steps": steps}


def _run_child(mode: str, seconds: float, new_tokens: int, cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    code = (
        "import json, sys; from hfaccel.bench.compile_wait import _session; "
        f"print('RESULT ' + json.dumps(_session({mode!r}, {seconds}, {new_tokens})))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _median_ms(
    steps: list[list[float]], after: float | None = None, before: float | None = None
) -> float | None:
    picked = [d for t, d in steps if (after is None or t >= after) and (before is None or t < before)]
    return 1000 * statistics.median(picked) if picked else None


def run_compile_wait_benchmark(
    seconds: float = 240.0, new_tokens: int = 64, warm_seconds: float = 60.0
) -> dict:
    """Print and return each mode's figures (see the module doc)."""
    print(f"== compile without the wait: SmolLM2-135M float32, one chat session, {cpu_description()}")
    print(f"answers of {new_tokens} tokens one after another for {seconds:.0f} s; a cold inductor cache each")
    results = {}
    with tempfile.TemporaryDirectory() as root:
        runs = [(mode, seconds, os.path.join(root, mode)) for mode in MODES]
        runs.append(("background", warm_seconds, os.path.join(root, "background")))  # warm: the cache left
        for mode, window, cache in runs:
            name = mode if (mode, window) != ("background", warm_seconds) else "background, warm cache"
            result = _run_child(mode, window, new_tokens, cache)
            results[name] = result
            answers, steps = result["answers"], result["steps"]
            first = answers[0][0]
            served = sum(n for t, n in answers if t <= window)
            switch = None
            if mode == "background" and result["ready_s"] is not None:
                switch = f"compiled from about {result['ready_s']:.0f} s on"
            elif mode == "decode":
                switch = "compiled from its first decode step on (the first answer waits)"
            before = _median_ms(steps, before=result["ready_s"]) if mode == "background" else None
            after = _median_ms(steps, after=(result["ready_s"] or 0) + 1) if mode != "off" else None
            eager = _median_ms(steps) if mode == "off" else before
            print(
                f"{name:>22}: first answer {first:6.1f} s, {served / window:5.1f} tok/s over {window:.0f} s "
                f"({len(answers)} answers); decode step eager {_fmt(eager)}, compiled {_fmt(after)}"
                + (f"; {switch}" if switch else ""),
                flush=True,
            )
    return results


def _fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.1f} ms"
