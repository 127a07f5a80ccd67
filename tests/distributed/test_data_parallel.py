"""Data parallelism: 2 engine replicas on 2 gloo ranks (4 with TP=2 inside, full matrix only)."""

from __future__ import annotations

import os

import pytest

from hfaccel.distributed.dp import assign_requests
from tests.distributed.launch import run_ranks

FULL = os.environ.get("HFACCEL_FULL_DIST_TESTS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="full distributed matrix: HFACCEL_FULL_DIST_TESTS=1")


def check(results: list[dict], per_replica: int) -> None:
    first = results[0]
    for result in results:
        # The same completions, in request order, on every rank; sampling as in one process.
        assert result["tokens"] == first["tokens"]
        assert result["sampled"] == result["sampled_reference"]
        assert result["assignment"] == first["assignment"]
    assert [r["replica"] for r in results] == [i // per_replica for i in range(len(results))]
    owner, sizes = first["assignment"], first["prompt_tokens"]
    assert set(owner) == {0, 1}
    load = [sum(n for n, o in zip(sizes, owner) if o == r) for r in (0, 1)]
    assert abs(load[0] - load[1]) <= max(sizes)  # balanced by tokens, not by count


def test_dp2_parity():
    check(run_ranks("tests.distributed.pp_workers:dp_parity"), 1)


def test_ranks_that_call_with_different_prompts_or_arguments_all_raise():
    results = run_ranks("tests.distributed.pp_workers:dp_different_calls")
    for result in results:
        assert all(
            e is not None and "rank(s) [1] called with others than rank 0" in e for e in result["errors"]
        )
    assert results[0]["after"] == results[1]["after"] and all(results[0]["after"])


@full_only
def test_dp2_with_tp2_inside():
    check(run_ranks("tests.distributed.pp_workers:dp_parity", world=4, tensor_parallel_size=2), 2)


@full_only
def test_dp2_with_pp2_inside():
    check(run_ranks("tests.distributed.pp_workers:dp_parity", world=4, pipeline_parallel_size=2), 2)


def test_assignment_follows_load_not_round_robin():
    # Equal replicas: longest first, balanced by tokens.
    assert assign_requests([10, 10, 10, 10], [(0, 1000), (0, 1000)]) == [0, 1, 0, 1]
    assert assign_requests([30, 10, 10, 10], [(0, 1000), (0, 1000)]) == [0, 1, 1, 1]
    # A replica with queued work, or with less free KV cache, gets less.
    assert assign_requests([10, 10, 10, 10], [(40, 1000), (0, 1000)]) == [1, 1, 1, 1]
    assert assign_requests([10] * 6, [(0, 100), (0, 400)]).count(1) >= 4


def test_bad_dp_size_is_refused():
    import hfaccel
    from tests.helpers import tiny_model

    with pytest.raises(ValueError, match="positive integer"):
        hfaccel.patch(tiny_model("llama"), data_parallel_size=0)
