"""Steps of a thread other than the caller's, with the callers' OpenMP pools given back or kept
(`python -m hfaccel bench threads`; `engine/openmp.py`).

The tiny random Llama of `bench host` (4 layers, hidden 64), whose steps are nearly all host work: the per-op cost a
second OpenMP pool adds shows there first (on SmolLM2 float32 on 2 AVX2 cores it was within this
machine's run-to-run noise). In a fresh process per run: one lone call in the main thread (it steps for
itself), then 1 and then 8 callers in threads of their own, 64 tokens each, while the main thread waits
on them; the median pure-decode step by batch size is printed (the engine's step, hand-offs aside).
*kept* disables the pool release (the callers' pools stay alive, as before it), *given back* is the
default. Runs alternate, so that a machine's drift falls on both.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

_CHILD_FLAG = "--thread-steps-child"
SIZES = (1, 8)


def _child(release: bool) -> None:
    import hfaccel
    import hfaccel.engine.submission as submission_module
    from hfaccel.bench.host import tiny_llama

    if not release:
        submission_module.pause_function = lambda: None
    model = hfaccel.patch(tiny_llama(), progress=False)
    options = {"max_new_tokens": 64, "min_new_tokens": 64, "progress": False}
    hfaccel.generate(model, [[1, 2, 3, 4]], **options)  # the main thread steps its own call
    engine = model._hfaccel.get_engine(model)
    result: dict[str, float] = {}
    for callers in SIZES:
        start = time.perf_counter()
        threads = [
            threading.Thread(target=hfaccel.generate, args=(model, [[1, 2, 3, 4 + i]]), kwargs=options)
            for i in range(callers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        steps = [
            s.duration_s * 1e3
            for s in engine.step_stats
            if s.start_s >= start and not s.num_prefill_tokens and s.num_seqs == callers
        ]
        result[str(callers)] = statistics.median(steps)
    print(json.dumps(result), flush=True)


def run_thread_steps_benchmark(rounds: int = 6) -> list[dict[str, Any]]:
    """Print and return the median decode step (ms) by batch size, pools kept vs given back."""
    from hfaccel.bench.machine import cpu_description

    print(
        f"== steps stepped by another thread, OpenMP pools kept vs given back: a tiny Llama, {cpu_description()}"
    )
    rows = []
    for round_index in range(rounds):
        for release in (False, True):
            completed = subprocess.run(
                [sys.executable, "-m", "hfaccel.bench.thread_steps", _CHILD_FLAG, str(int(release))],
                capture_output=True,
                text=True,
                check=True,
            )
            steps = json.loads(completed.stdout.strip().splitlines()[-1])
            name = "given back" if release else "kept"
            rows.append({"round": round_index, "pools": name, **steps})
            sizes = ", ".join(f"{n} sequences {steps[str(n)]:.2f} ms" for n in SIZES)
            print(f"  round {round_index + 1}, pools {name:>10}: decode step of {sizes}", flush=True)
    for size in map(str, SIZES):
        kept = statistics.median(r[size] for r in rows if r["pools"] == "kept")
        back = statistics.median(r[size] for r in rows if r["pools"] == "given back")
        print(f"  batch {size}: {back:.2f} ms given back vs {kept:.2f} ms kept ({kept / back:.2f}x faster)")
    return rows


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == _CHILD_FLAG:
    _child(sys.argv[2] == "1")
