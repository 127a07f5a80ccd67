"""`python -m hfaccel bench floor` (`bench/workload_floor.py`): the demo's workload against the floor."""

import torch

from hfaccel.bench.host import tiny_llama
from hfaccel.bench.workload_floor import FloorTimer, _shape, run_floor_benchmark
from hfaccel.engine.metrics import StepStats


def test_a_step_shape_counts_computed_tokens_and_head_rows():
    step = StepStats(0, 0.0, 0.01, num_seqs=3, num_decode_tokens=2, num_prefill_tokens=40, kv_blocks_used=1,
                     prefix_hit_tokens=16, num_preemptions=0)  # fmt: skip
    assert _shape(step) == (42, 3)  # prefix-cache hits computed nothing


def test_the_floor_times_every_linear_once_per_shape(monkeypatch):
    model = tiny_llama()
    timer = FloorTimer(model, repeats=1)
    head = model.get_output_embeddings()
    rows_seen = []
    forward = torch.nn.Linear.forward
    monkeypatch.setattr(
        torch.nn.Linear, "forward", lambda m, x: rows_seen.append((m is head, len(x))) or forward(m, x)
    )
    timer.measure({(5, 2)})
    assert set(timer.seconds) == {(5, 2)} and timer.seconds[(5, 2)] > 0
    assert set(rows_seen) == {(False, 5), (True, 2)}  # the body at the step's tokens, the head at its rows
    assert rows_seen.count((False, 5)) == 2 * 7 * model.config.num_hidden_layers  # warm-up and one timed run


def test_the_smollm2_workload_takes_longer_than_its_floor(capsys):
    results = run_floor_benchmark(rounds=1, num_prompts=3, max_new_tokens=4)
    (row,) = results["auto"]
    assert row["steps"] >= 4 and 0 < row["floor_s"] < row["steps_s"] <= row["wall_s"]
    assert row["floor_over_wall"] == row["floor_s"] / row["wall_s"]
    assert "median floor/wall" in capsys.readouterr().out
