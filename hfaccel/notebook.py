"""Notebook helpers: a picture of a run (batch occupancy over time, latency distribution, speculation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def plot_run(engine: Any, completions: Sequence[Any] | None = None, path: str | None = None) -> Any:
    """Draw an engine's recent steps and, if given, the latency of `completions`.

    Left: sequences per step and prefill/decode tokens per step over time (how full the continuous batch
    was). Middle: histograms of time to first token and end-to-end latency. Right, when the engine
    speculates: each request's draft acceptance rate, with the engine's acceptance rate and mean accepted
    length in the title. `engine` is an `Engine` or a patched model. Needs matplotlib (``pip install
    hfaccel[plot]``). Returns the figure; saves it to `path` when given.
    """
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plot_run needs matplotlib: pip install matplotlib") from error
    engine = _engine_of(engine, "plot_run")
    steps = list(getattr(engine, "step_stats", ()))
    if not steps:
        raise ValueError("the engine has run no step yet: generate something first")
    start = steps[0].start_s
    times = [s.start_s - start for s in steps]
    totals = engine.stats()
    speculated = totals.get("spec_drafted", 0) > 0
    figure, axes = plt.subplots(1, 3 if speculated else 2, figsize=(18 if speculated else 12, 4))
    occupancy, latency = axes[0], axes[1]
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
    if speculated:
        _plot_speculation(axes[2], metrics, totals)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path)
    return figure


def _plot_speculation(axis: Any, metrics: list[dict[str, Any]], totals: dict[str, Any]) -> None:
    """Per-request acceptance rates (of the given completions that drafted), run-level figures on top."""
    rates = [m["spec_acceptance_rate"] for m in metrics if m.get("spec_drafted")]
    title = (
        f"speculation: {totals['spec_accepted']}/{totals['spec_drafted']} drafts accepted "
        f"({totals['spec_acceptance_rate']:.0%}), {totals['spec_mean_accepted_length']:.2f} kept per step"
    )
    axis.set_title(title, fontsize=9)
    if rates:
        axis.hist(rates, bins=20, range=(0, 1))
        axis.set_xlabel(f"acceptance rate of each request ({len(rates)} that drafted)")
        axis.set_ylabel("requests")
    else:
        axis.set_axis_off()
        axis.text(0.5, 0.5, "pass completions= to see each request's acceptance", ha="center")


def plot_cost_model(engine: Any, path: str | None = None) -> Any:
    """Predicted vs measured step time, from the engine's learnt step-time model (`engine.cost_model()`).

    Left: every recent step, measured against predicted seconds (the diagonal is a perfect fit; steps
    with prompt tokens and pure-decode steps in two colours). Right: measured and predicted step time
    over the steps. The title gives the coefficients and R2. `engine` is an `Engine` or a patched
    model. Returns the figure; saves it to `path` when given.
    """
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plot_cost_model needs matplotlib: pip install matplotlib") from error
    engine = _engine_of(engine, "plot_cost_model")
    model = engine.cost_model()
    fit = model.fit(force=True)
    if fit is None:
        raise ValueError(
            f"the step-time model is still warming up ({model.num_samples} steps): run more first"
        )
    steps = list(engine.step_stats)[1:]
    measured = [s.duration_s * 1000 for s in steps]
    predicted = [
        fit.predict(s.num_decode_tokens, s.num_prefill_tokens, s.num_kv_tokens) * 1000 for s in steps
    ]
    prefill = [s.num_prefill_tokens > 0 for s in steps]
    figure, (scatter, series) = plt.subplots(1, 2, figsize=(12, 4))
    for flag, label in ((True, "steps with prompt tokens"), (False, "decode-only steps")):
        xs = [p for p, f in zip(predicted, prefill) if f is flag]
        ys = [m for m, f in zip(measured, prefill) if f is flag]
        scatter.scatter(xs, ys, s=10, alpha=0.6, label=label)
    top = max(max(measured), max(predicted))
    scatter.plot([0, top], [0, top], color="grey", linewidth=1)
    scatter.set_xlabel("predicted step time (ms)")
    scatter.set_ylabel("measured step time (ms)")
    c0, c1, c2, c3 = fit.coefficients
    scatter.set_title(
        f"{c0 * 1e3:.1f} ms + {c1 * 1e3:.2f}/decode + {c2 * 1e3:.3f}/prompt token + {c3 * 1e6:.2f} us/KV token"
        f"  (R2 {fit.r2:.2f})",
        fontsize=9,
    )
    scatter.legend()
    series.plot(measured, label="measured", linewidth=1)
    series.plot(predicted, label="predicted", linewidth=1)
    series.set_xlabel("step")
    series.set_ylabel("ms")
    series.set_title(f"step time over {len(steps)} steps")
    series.legend()
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


def _engine_of(given: Any, where: str) -> Any:
    """The engine `given` is, or a patched model's (built at its first generate); else ValueError."""
    engine = getattr(getattr(given, "_hfaccel", None), "engine", None) or given
    if not hasattr(engine, "step_stats"):
        state = "patched, but has not generated yet" if hasattr(given, "_hfaccel") else "not patched"
        raise ValueError(
            f"{where} takes an Engine or a patched model that has generated; this {type(given).__name__} is "
            f"{state}"
        )
    return engine
