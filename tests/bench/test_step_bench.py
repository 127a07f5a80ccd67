"""The decode-step benchmark's harness on a tiny model: interleaved rounds, the table's ratios, and the
end-to-end comparison (eager only here: a compile costs minutes on a CPU)."""

import torch

from hfaccel.bench import step
from tests.helpers import tiny_model


def test_interleave_rotates_the_order_and_times_every_system_each_round():
    calls = []
    systems = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = step.interleave(systems, rounds=3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(t) == 3 for t in times.values())


def test_step_table_on_a_tiny_model(capsys):
    results = step.run_step_benchmark(
        tiny_model("llama"), batch_sizes=(2,), prompt_len=8, steps=3, compiled=False
    )
    names = [r.system for r in results]
    assert names == ["matmul floor", "HF eager step", "hfaccel eager"]
    floor = results[0]
    assert floor.floor_ratio == 1.0 and all(r.seconds > 0 for r in results)
    assert all(r.ratio_q1 <= r.floor_ratio <= r.ratio_q3 for r in results)
    assert "ISA" in capsys.readouterr().out


def test_end_to_end_compares_identical_greedy_tokens(monkeypatch):
    model = tiny_model("llama")
    # Both modes eager: the harness's bookkeeping, not a compile, is what this checks.
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    result = step.run_end_to_end(model, num_requests=3, new_tokens=4, repeats=2)
    assert result["identical"] and len(result["speedups"]) == 2


def test_step_table_adds_the_bf16_kv_row_for_a_float32_model(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the harness, not a compile
    results = step.run_step_benchmark(
        tiny_model("llama"), batch_sizes=(2,), prompt_len=8, steps=2, compiled=True, bf16_kv=True
    )
    assert [r.system for r in results][3:] == [
        "hfaccel compiled (dynamic tokens)",
        "hfaccel compiled, bf16 KV cache",
    ]
