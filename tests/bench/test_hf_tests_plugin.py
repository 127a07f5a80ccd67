"""The plugin that counts transformers' own generation tests' calls: its summary of a log."""

from __future__ import annotations

import json

from hfaccel.bench.hf_tests_plugin import summarize


def test_summary_counts_served_calls_fallbacks_and_refusals(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [
        {"test": "a", "outcome": "passed", "calls": 3, "fallbacks": {"output_attentions": 1}, "refused": {}},
        {"test": "b", "outcome": "failed", "calls": 2, "fallbacks": {}, "refused": {"no attention": 2}},
        {"test": "c", "outcome": "passed", "calls": 1, "fallbacks": {"output_attentions": 1}, "refused": {}},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = summarize(str(log))
    assert summary["outcomes"] == {"passed": 2, "failed": 1}
    assert summary["calls"] == 6 and summary["served"] == 2
    assert summary["fallbacks"] == [("output_attentions", 2)]
    assert summary["refused"] == [("no attention", 2)]
