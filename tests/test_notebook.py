"""Notebook helpers on a tiny model, and the example notebook end to end on SmolLM2."""

import pathlib

import matplotlib
import pytest

import hfaccel
from tests.helpers import tiny_model, varied_prompts

matplotlib.use("Agg")
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_plot_run_and_engine_state(tmp_path):
    model = hfaccel.patch(tiny_model(), kv_cache_memory=1_000_000)
    state = hfaccel.engine_state(model)
    assert "not built yet" in repr(state)
    with pytest.raises(ValueError, match="patched, but has not generated yet"):
        hfaccel.plot_run(model)
    completions = hfaccel.generate(model, varied_prompts(6), max_new_tokens=5, progress=False)
    assert "steps=" in repr(state) and "backend='torch'" in repr(state)
    figure = hfaccel.plot_run(model, completions, path=str(tmp_path / "run.png"))
    assert len(figure.axes) == 2  # no speculation, no third panel
    occupancy, latency = figure.axes[:2]
    assert (
        occupancy.get_title().startswith("batch occupancy") and latency.get_title() == "latency of 6 requests"
    )
    assert (tmp_path / "run.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="not patched"):
        hfaccel.engine_state(tiny_model())


def test_plot_run_shows_speculation(tmp_path):
    model = hfaccel.patch(
        tiny_model(), kv_cache_memory=1_000_000, speculative="ngram", num_speculative_tokens=3
    )
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10]]
    completions = hfaccel.generate(model, prompts, max_new_tokens=12, progress=False)
    totals = model._hfaccel.engine.stats()
    assert totals["spec_drafted"] > 0
    figure = hfaccel.plot_run(model, completions)
    assert len(figure.axes) == 3
    title = figure.axes[2].get_title()
    assert title.startswith(
        f"speculation: {totals['spec_accepted']}/{totals['spec_drafted']} drafts accepted"
    )
    drafted = [c for c in completions if c.metrics.get("spec_drafted")]
    counts = [patch.get_height() for patch in figure.axes[2].patches]
    assert sum(counts) == len(drafted) > 0


@pytest.mark.slow
def test_example_notebook_runs_end_to_end():
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
    outputs = "".join(
        out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert "Paris" in outputs
    assert "engine: Engine(" in outputs
    assert any(
        "image/png" in out.get("data", {}) for cell in notebook.cells for out in cell.get("outputs", [])
    )


def test_plot_cost_model_shows_predicted_against_measured(tmp_path):
    model = hfaccel.patch(tiny_model(), kv_cache_memory=1_000_000)
    hfaccel.generate(model, varied_prompts(4), max_new_tokens=2, progress=False)
    if model._hfaccel.engine.cost_model().num_samples < 12:
        with pytest.raises(ValueError, match="warming up"):
            hfaccel.plot_cost_model(model)
    hfaccel.generate(model, varied_prompts(12), max_new_tokens=12, progress=False)
    figure = hfaccel.plot_cost_model(model, path=str(tmp_path / "cost.png"))
    scatter, series = figure.axes[:2]
    assert "R2" in scatter.get_title() and scatter.get_xlabel() == "predicted step time (ms)"
    assert (tmp_path / "cost.png").stat().st_size > 1000
    hfaccel.unpatch(model)
