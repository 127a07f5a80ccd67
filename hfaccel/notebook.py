"""Notebook helpers: a picture of a run (batch occupancy over time, latency distribution)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def plot_run(engine: Any, completions: Sequence[Any] | None = None, path: str | None = None) -> Any:
    """Draw an engine's recent steps and, if given, the latency of `completions`.

    Left: sequences per step and prefill/decode tokens per step over time (how full the continuous batch
    was). Right: histograms of time to first token and end-to-end latency. `engine` is an `Engine` or a
    patched model. Needs matplotlib (``pip install hfaccel[plot]``). Returns the figure; saves it to
    `path` when given.
    """
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plot_run needs matplotlib: pip install matplotlib") from error
    engine = getattr(getattr(engine, "_hfaccel", None), "engine", None) or engine
    steps = list(getattr(engine, "step_stats", ()))
    if not steps:
        raise ValueError("the engine has run no step yet: generate something first")
    start = steps[0].start_s
    times = [s.start_s - start for s in steps]
    figure, (occupancy, latency) = plt.subplots(1, 2, figsize=(12, 4))
    occupancy.step(times, [s.num_seqs for s in steps], where="post", label="sequences in the step")
    occupancy.fill_between(
        times, [s.num_prefill_tokens for s in steps], step="post", alpha=0.3, label="prefill tokens"
    )
    occupancy.plot(times, [s.num_decode_tokens for s in steps], drawstyle="steps-post", label="decode tokens")
    occupancy.set_xlabel("seconds since the first step")
    occupancy.set_title(f"batch occupancy ({len(steps)} steps)")
    occupancy.legend()
    metrics = [c.metrics for c in completions or () if getattr(c, "metrics", None)]
    ttft = [m["ttft_s"] for m in metrics if m.get("ttft_s") is not None]
    e2e = [m["e2e_s"] for m in metrics if m.get("e2e_s") is not None]
    if ttft:
        latency.hist(ttft, bins=20, alpha=0.6, label="time to first token")
        latency.hist(e2e, bins=20, alpha=0.6, label="end to end")
        latency.set_xlabel("seconds")
        latency.set_title(f"latency of {len(metrics)} requests")
        latency.legend()
    else:
        latency.set_axis_off()
        latency.text(0.5, 0.5, "pass completions= to see latencies", ha="center")
    figure.tight_layout()
    if path is not None:
        figure.savefig(path)
    return figure


def engine_state(model: Any) -> Any:
    """The patch state of a patched model (its repr shows the config and the engine's counters)."""
    state = getattr(model, "_hfaccel", None)
    if state is None:
        raise ValueError("this model is not patched: call hfaccel.patch(model) first")
    return state
