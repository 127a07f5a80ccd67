"""Expert parallelism: EP=2 on 2 gloo ranks (experts sharded, tokens routed by all-to-all)."""

from __future__ import annotations

import os

import pytest

from tests.distributed.launch import run_ranks

FULL = os.environ.get("HFACCEL_FULL_DIST_TESTS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="full distributed matrix: HFACCEL_FULL_DIST_TESTS=1")


def check(results: list[dict]) -> None:
    first, second = results
    assert first["tokens"] == second["tokens"]
    assert first["plans"] == second["plans"]
    assert first["local_experts"] * 2 == first["all_experts"]
    assert first["microbatch_log"]  # steps were split into microbatches, each routed on its own
    assert first["dispatches"] == second["dispatches"] > 0


def test_ep2_mixtral():
    check(run_ranks("tests.distributed.pp_workers:ep_parity"))


@full_only
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_ep2_families(family):
    check(run_ranks("tests.distributed.pp_workers:ep_parity", family=family))


def test_ep_on_a_dense_model_is_refused():
    import hfaccel
    from tests.helpers import tiny_model

    with pytest.raises(ValueError, match="MoE model"):
        hfaccel.patch(tiny_model("llama"), expert_parallel_size=2)


def test_experts_of_another_layout_are_refused_before_any_is_split():
    """Llama 4's experts are called without the routing and hold gate_up_proj as [E, H, 2I]."""
    import torch

    import hfaccel
    from hfaccel.bench.families import family_model

    model = family_model("llama4_text")
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Llama4TextExperts is not such experts"):
        hfaccel.patch(model, expert_parallel_size=2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
