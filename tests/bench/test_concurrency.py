"""The many-callers benchmark, at toy size."""

import hfaccel
from hfaccel.bench.concurrency import run_concurrency_benchmark
from tests.helpers import tiny_model, tiny_tokenizer


def test_the_benchmark_runs_both_systems_side_by_side(capsys):
    model = tiny_model()
    results = run_concurrency_benchmark(
        model, tiny_tokenizer(), callers=(1, 3), requests_per_caller=2, max_new_tokens=4
    )
    assert [(r.callers, r.system.split()[0]) for r in results] == [
        (1, "HF"),
        (1, "hfaccel"),
        (3, "HF"),
        (3, "hfaccel"),
    ]
    assert all(len(r.latencies) == r.callers * 2 and r.requests_per_s > 0 for r in results)
    assert results[2].outputs == results[3].outputs  # greedy, float32: the same tokens
    assert not hfaccel.api.is_patched(model), "an unpatched model is left unpatched"
    printed = capsys.readouterr().out
    assert "CPU ISA" in printed and "p99 lat s" in printed
