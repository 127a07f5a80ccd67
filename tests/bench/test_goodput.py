"""The goodput benchmark, at toy size: every system sees the same arrivals, repeats alternate the order,
the summary compares adaptive with the fixed settings, and the host-share measurement runs."""

import torch

from hfaccel.bench.goodput import GoodputResult, run_goodput_benchmark, run_host_share, summarize, workload
from tests.helpers import tiny_model


def test_the_same_arrivals_for_every_system_and_rate_and_seed():
    assert [a.arrival_s for a in workload(1000, 4.0, 10)] == [a.arrival_s for a in workload(1000, 4.0, 10)]
    assert workload(1000, 4.0, 10)[3].prompt == workload(1000, 4.0, 10)[3].prompt


def test_the_benchmark_runs_and_repeats_in_alternating_order(capsys, tmp_path):
    results = run_goodput_benchmark(
        tiny_model(),
        torch.float32,
        rates=(4.0,),
        num_requests=4,
        tpot_target_ms=1000,
        ttft_target_ms=5000,
        systems=("defaults", "adaptive"),
        repeats=2,
        plot_path=str(tmp_path / "goodput.png"),
    )
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert [(r.system, r.repeat) for r in results] == [
        ("defaults", 0),
        ("adaptive", 0),
        ("adaptive", 1),
        ("defaults", 1),
    ]
    assert all(len(r.ttft_s) == 4 for r in results)
    assert all(r.step_error is not None and r.fit_r2 is not None for r in results)
    assert results[1].ttft_factor is not None and results[0].ttft_factor is None
    printed = capsys.readouterr().out
    assert " ISA " in printed and "adaptive/defaults" in printed and "step model: median error" in printed


def test_summary_counts_a_rejected_request_as_missed():
    met = GoodputResult("defaults", 2.0, ttft_s=[0.1, 0.2], tpot_s=[0.01, 0.01])
    half = GoodputResult("adaptive", 2.0, ttft_s=[0.1, None], tpot_s=[0.01, None], rejected=1)
    table = summarize([met, half], 2, ttft_s=1.0, tpot_s=0.1)
    row = table.splitlines()[-1].split()
    assert row[0] == "2.0" and row[1] == "2.00" and row[3] == "1.00" and row[5] == "0.50x"


def test_host_share_runs_both_settings(capsys):
    rows = run_host_share(tiny_model(), repeats=1)
    assert [r["async_scheduling"] for r in rows] == [False, True]
    assert all(0 <= r["host_share"] <= 1 and r["steps"] >= 24 for r in rows)
    assert rows[1]["overlapped_s"] > 0 and rows[0]["overlapped_s"] == 0
