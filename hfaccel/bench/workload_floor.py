"""The demo's mixed workload against the matmul floor (`python -m hfaccel bench floor`): how close
`hfaccel.generate` with the defaults gets to what the hardware's matrix multiplies allow.

The workload is `make demo`'s (24 chat prompts on SmolLM2 float32, 16-128 new tokens each, a third behind
one shared system prompt), served by one `hfaccel.generate` call. Every engine step is recorded
(`Engine.step_stats`); its **floor** is the time of the model's Linear layers alone at that step's shape:
every Linear but the LM head at the step's computed tokens (prefill and decode, prefix-cache hits left
out), the LM head at its sequences' rows. ``floor / wall`` is the share of the call's time the matmuls
would take on their own: the rest is attention, norms, rotary, sampling and the host's Python.

The floor of each distinct shape is timed after the workload ran, the median of a few runs; the
workload and the floors alternate for ``rounds`` rounds, so a machine whose load drifts moves both.
Each ``compile`` mode given runs in the same rounds (a compiled mode's warm-up is left out of its
time, as once compiling costs the user no wait).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.bench.step import matmul_floor


class FloorTimer:
    """Times the matmul floor of a step shape (computed tokens, sampled rows), once per shape a round."""

    def __init__(self, model: Any, repeats: int = 3) -> None:
        self.model, self.repeats = model, repeats
        self.seconds: dict[tuple[int, int], float] = {}

    def _time(self, tokens: int, rows: int) -> float:
        run = matmul_floor(self.model, tokens, head_rows=rows)  # (runs once: the allocator and caches warm)
        runs = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            run()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    def measure(self, shapes: set[tuple[int, int]]) -> None:
        """(Re)time the floor of every shape given, replacing earlier times."""
        for tokens, rows in sorted(shapes):
            self.seconds[(tokens, rows)] = self._time(tokens, rows)


def _shape(step: Any) -> tuple[int, int]:
    """A step's computed tokens and LM-head rows. Every sequence of the step counts as a head row: one
    whose prompt chunk does not end its prompt has none, so with chunked prompts the floor is a little
    high (in the demo's workload no step has such a chunk)."""
    return step.num_decode_tokens + step.num_prefill_tokens, step.num_seqs


def _serve(model: Any, tokenizer: Any, requests: Sequence[Any]) -> tuple[float, list[Any], list[list[int]]]:
    """One `hfaccel.generate` call over the workload from an empty prefix cache: wall seconds, the steps it
    took and the tokens it gave."""
    import hfaccel
    from hfaccel.bench.demo import run_hfaccel

    hfaccel.reset_prefix_cache(model)
    engine = model._hfaccel.get_engine(model)
    seen = len(engine.step_stats)
    start = time.perf_counter()
    completions = run_hfaccel(model, tokenizer, list(requests))
    wall = time.perf_counter() - start
    steps = list(engine.step_stats)[seen:]
    return wall, steps, [list(c.token_ids) for c in completions]


def run_floor_benchmark(
    compile_modes: Sequence[str] = ("auto",),
    rounds: int = 3,
    num_prompts: int = 24,
    max_new_tokens: int = 128,
    threads: int | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Serve the demo's workload under each ``compile`` mode (``"auto"``: the defaults) for ``rounds``
    alternating rounds; print and return each run's wall time, the sum of its steps' floors, and the
    ratios of the floor to the wall time and to the steps' own time."""
    import hfaccel
    from hfaccel.bench.demo import DemoRequest, demo_requests
    from hfaccel.default_model import load_default_model

    if threads is not None:
        torch.set_num_threads(threads)
    print(
        f"== the demo's workload against the matmul floor: {cpu_description()}, {torch.get_num_threads()} threads =="
    )
    models = {}
    for mode in compile_modes:
        model, tokenizer = load_default_model(torch.float32)
        hfaccel.patch(model, compile=mode, progress=False)
        requests = demo_requests(tokenizer, num_prompts, min(16, max_new_tokens), max_new_tokens)
        warm_up = time.perf_counter()
        with torch.inference_mode():  # builds the engine, and for a compiled mode its graphs
            _serve(model, tokenizer, [DemoRequest(r.chat, r.prompt_ids, 4) for r in requests])
            _serve(model, tokenizer, requests)
        print(f"compile={mode!r}: warm-up {time.perf_counter() - warm_up:.1f} s (left out)")
        models[mode] = model
    floor = FloorTimer(next(iter(models.values())))
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in compile_modes}
    outputs: dict[str, list[list[int]]] = {}
    print(
        f"{'round':>5} | {'compile':<10} | {'wall s':>7} | {'steps s':>7} | {'floor s':>7} | floor/wall | floor/steps"
    )
    for index in range(rounds):
        runs = {}
        for mode, model in models.items():
            with torch.inference_mode():
                runs[mode] = _serve(model, tokenizer, requests)
            outputs.setdefault(mode, runs[mode][2])
        floor.measure({_shape(s) for _, steps, _ in runs.values() for s in steps})
        for mode, (wall, steps, _) in runs.items():
            floor_s = sum(floor.seconds[_shape(s)] for s in steps)
            steps_s = sum(s.duration_s for s in steps)
            row = {"wall_s": wall, "steps_s": steps_s, "floor_s": floor_s, "steps": len(steps)}
            row |= {"floor_over_wall": floor_s / wall, "floor_over_steps": floor_s / steps_s}
            results[mode].append(row)
            print(
                f"{index + 1:>5} | {mode:<10} | {wall:>7.2f} | {steps_s:>7.2f} | {floor_s:>7.2f} | "
                f"{row['floor_over_wall']:>9.0%} | {row['floor_over_steps']:>10.0%}"
            )
    for mode, rows in results.items():
        median = statistics.median(r["floor_over_wall"] for r in rows)
        print(f"compile={mode!r}: median floor/wall {median:.0%} over {len(rows)} rounds")
    reference = outputs[compile_modes[0]]
    for mode, tokens in outputs.items():
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"compile={mode!r}: {same} of {len(reference)} requests give {compile_modes[0]!r}'s tokens")
    return results
