"""Pipeline parallelism: PP=2 on 2 gloo ranks against the single-process engine.

`make test` runs PP=2 with 2 microbatches; 1 and 4 microbatches (and Qwen3) run with
``HFACCEL_FULL_DIST_TESTS=1``.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.launch import run_ranks

FULL = os.environ.get("HFACCEL_FULL_DIST_TESTS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="full distributed matrix: HFACCEL_FULL_DIST_TESTS=1")


def check(results: list[dict], microbatches: int) -> None:
    first, last = results
    assert first["tokens"] == last["tokens"]
    assert first["sampled"] == last["sampled"]
    assert first["plans"] == last["plans"]
    # Logprobs: the last stage's logits are shared in steps that record them, so every stage (rank 0
    # among them) reports the single-process engine's values.
    assert first["logits_broadcasts"] == last["logits_broadcasts"] > 0
    for result in results:
        for ours, ref in zip(result["logprobs"], first["logprobs_reference"]):
            assert ours == pytest.approx(ref, abs=1e-4)
    # Each stage holds and caches only its layers.
    assert first["layers"] == (0, 2) and last["layers"] == (2, 4)
    assert first["num_layers"] == last["num_layers"] == first["kv_caches"] == 2
    if microbatches == 1:
        assert not first["microbatch_log"]
        return
    assert any(len(split) == microbatches for split in first["microbatch_log"])
    # Prefill overlap: while the last stage is slowed (50 ms a microbatch), stage 0 started microbatch
    # m + 1 before stage 1 finished microbatch m in some split prefill step (the stages worked at the
    # same time; a schedule that waited for the last stage would never do so).
    end_of = {(s, m): end for s, st, m, phase, start, end in last["slow_trace"] if phase == "prefill"}
    overlapped = [
        (s, m)
        for s, st, m, phase, start, end in first["slow_trace"]
        if phase == "prefill" and m > 0 and (s, m - 1) in end_of and start < end_of[(s, m - 1)]
    ]
    assert overlapped, "no prefill microbatch overlapped between the stages"
    # Decode: every microbatch of a step ran on the last stage in order, each after the first stage's.
    first_end = {(s, m): end for s, st, m, phase, start, end in first["trace"] if phase == "decode"}
    for s, _st, m, phase, start, _end in last["trace"]:
        if phase == "decode":
            assert start >= first_end[(s, m)] - 0.05  # clocks of two processes on one machine


def test_pp2_two_microbatches():
    check(run_ranks("tests.distributed.pp_workers:pp_parity", microbatches=2), 2)


@full_only
@pytest.mark.parametrize("microbatches", [1, 4])
def test_pp2_microbatches(microbatches):
    check(run_ranks("tests.distributed.pp_workers:pp_parity", microbatches=microbatches), microbatches)


@full_only
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_pp2_families(family):
    check(run_ranks("tests.distributed.pp_workers:pp_parity", family=family), 2)


@full_only
@pytest.mark.parametrize(
    ("family", "scales"),
    [("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}), ("cohere", {"logit_scale": 0.0625})],
)
def test_pp2_model_level_scales(family, scales):
    """Granite scales the embeddings and the logits, Cohere the logits: the stages do as the model does
    (greedy and, through the logprobs, the distribution)."""
    check(run_ranks("tests.distributed.pp_workers:pp_parity", family=family, scales=scales), 2)


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_bad_pipeline_sizes_are_refused(bad):
    import hfaccel
    from tests.helpers import tiny_model

    with pytest.raises(ValueError, match="positive integer"):
        hfaccel.patch(tiny_model("llama"), pipeline_parallel_size=bad)


def test_more_stages_than_layers_is_refused():
    import hfaccel
    from tests.helpers import tiny_model

    with pytest.raises(ValueError, match="larger than the 2 decoder layers"):
        hfaccel.patch(tiny_model("llama"), pipeline_parallel_size=3)


def test_stage_layers_split_evenly():
    from hfaccel.distributed.pp import stage_layers

    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(4, 4, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
