"""`python -m hfaccel bench host` (`bench/host.py`): a small grid runs all four systems."""

from hfaccel.bench.host import _kv_bytes, run_host_benchmark, tiny_llama


def test_host_bench_times_the_four_systems_on_a_small_grid(capsys):
    rows = run_host_benchmark(batch_sizes=(1, 2), contexts=(16,), steps=4, device="cpu", rounds=2)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 16), (2, 16)]
    assert all(r["hf_ms"] > 0 and r["step_ms"] > 0 and r["generate_ms"] > 0 for r in rows)
    assert all(r["hf_row_ms"] > 0 for r in rows)  # HF's steps back to back, timed as generate's are
    assert all(r["hf_generate_ms"] > 0 for r in rows)  # HF generate's own loop, step by step
    assert "on cpu, engine compile off" in capsys.readouterr().out


def test_the_kv_budget_holds_the_largest_cell():
    """128 sequences of 4,096 tokens and the decode steps: more than the fixed 512 MiB once the model's
    K/V rows need it (4 layers x 2 KV heads of 16, float32: 1 KiB a token)."""
    model = tiny_llama()
    per_token = 2 * 4 * 2 * 16 * 4
    assert _kv_bytes(model, 128, 4096, 24) >= 128 * (4096 + 24) * per_token
    assert _kv_bytes(model, 1, 128, 24) == 512 * 1024 * 1024
