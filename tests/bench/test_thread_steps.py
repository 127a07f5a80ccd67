"""`python -m hfaccel bench threads`: one run's measurement, in this process (the benchmark runs each in
a fresh one)."""

import json

from hfaccel.bench.thread_steps import SIZES, _child


def test_a_run_reports_the_median_decode_step_of_each_batch_size(capsys):
    _child(release=True)
    steps = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(map(int, steps)) == sorted(SIZES)
    assert all(0 < ms < 10_000 for ms in steps.values())
