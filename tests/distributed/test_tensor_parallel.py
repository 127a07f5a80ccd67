"""Tensor and sequence parallelism: 2 gloo ranks on this machine against the single-process engine.

`make test` runs a representative subset (Llama: TP, TP + SP with the invariants, refusals); the full
matrix (Qwen2, Mistral, replicated KV heads, a model transformers sharded at load, the DTensor runtime)
runs with ``HFACCEL_FULL_DIST_TESTS=1`` (``make test-dist``).
"""

from __future__ import annotations

import os

import pytest
import torch

import hfaccel
import hfaccel.api
from hfaccel.distributed.layout import parallel_layout
from tests.distributed.launch import run_ranks
from tests.helpers import tiny_model

FULL = os.environ.get("HFACCEL_FULL_DIST_TESTS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="full distributed matrix: HFACCEL_FULL_DIST_TESTS=1")


def check_parity_results(results: list[dict], sequence_parallel: bool) -> None:
    first, second = results
    # Greedy parity was asserted on each rank (equal tokens or a near-tie); every rank returned the same.
    assert first["tokens"] == second["tokens"]
    # Chunked prefill, prefix hits and preemption all happened.
    stats = first["stats"]
    assert stats["preemptions"] > 0, stats
    assert stats["prefix_cache_hit_tokens"] > 0, stats
    assert any(n > 1 and n < 37 for _, counts in first["plans"] for n in counts)  # a chunk of a longer prompt
    # Every rank took exactly the same steps, and sampled the same tokens.
    assert first["plans"] == second["plans"]
    assert first["num_blocks"] == second["num_blocks"]
    assert first["sampled"] == second["sampled"]
    # Sequence parallelism: only in steps holding prefill tokens, never in decode-only ones.
    log, widths = first["forward_log"], first["layer0_tokens"]
    assert len(log) == len(widths) > 0
    decode_only = [(entry, w) for entry, w in zip(log, widths) if not entry[2]]
    assert decode_only, "no decode-only step was run"
    for (tokens, padded, _, sp), width in decode_only:
        assert not sp and width == tokens == padded  # the full residual stream, no padding
    for (tokens, padded, _, sp), width in ((e, w) for e, w in zip(log, widths) if e[2]):
        assert sp == sequence_parallel
        if sequence_parallel:
            assert padded % 2 == 0 and padded - tokens < 2 and width == padded // 2
        else:
            assert width == tokens == padded


def embeddings_in_tp_plan() -> bool:
    """Whether the installed transformers' Llama plan shards the input embeddings (sequence parallelism
    slices their output to each rank's tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, vocab_size=32, num_attention_heads=2
    )
    return "embedding_rowwise" in (LlamaForCausalLM(config)._tp_plan or {}).values()


def test_llama_parity_and_invariants():
    """TP=2, then TP=2 + SP on a fresh copy, in one pair of processes (one start-up for both)."""
    tp, sp = zip(*run_ranks("tests.distributed.workers:parity_tp_and_sp", check_divergence=True))
    check_parity_results(list(tp), sequence_parallel=False)
    if embeddings_in_tp_plan():
        check_parity_results(list(sp), sequence_parallel=True)
    else:  # transformers before 5.18 plans no sharded embedding: sequence parallelism is refused at patch
        assert all("needs the input embeddings sharded by 'embedding_rowwise'" in r["refused"] for r in sp)
    assert tp[0]["heads"] == (2, 1)  # the rank's own heads: the KV cache holds 1 of the 2 KV heads
    for result in tp:
        assert "diverged" in result["divergence"]


@full_only
@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_family_parity(family, sequence_parallel):
    check_parity_results(
        run_ranks("tests.distributed.workers:parity", family=family, sequence_parallel=sequence_parallel),
        sequence_parallel,
    )


def test_a_call_that_ends_on_one_rank_raises_on_every_rank():
    first, second = run_ranks("tests.distributed.workers:one_rank_ends_alone")
    assert first["errors"][0].startswith("RuntimeError: tensor-parallel ranks diverged")
    assert second["errors"][0] == "ValueError: a processor failed on rank 1"
    for result in (first, second):  # rank 0 emptied first, rank 1 still had work: both see it
        assert result["errors"][1].startswith("RuntimeError: tensor-parallel ranks diverged")
    assert first["after"] == second["after"] and all(len(t) == 4 for t in first["after"])


@full_only
def test_gathered_attention_projections_run_every_head():
    """OLMo 2's plan gathers q, k and v (its norms span all heads): every rank attends with all heads."""
    check_parity_results(run_ranks("tests.distributed.workers:parity", model_type="olmo2"), False)


@full_only
def test_scaled_embeddings_keep_their_scale():
    """Gemma's embedding module scales its rows by sqrt(hidden): the local runtime's vocab-sharded lookup
    runs the module's own forward on its shard."""
    check_parity_results(run_ranks("tests.distributed.workers:parity", model_type="gemma"), False)


@full_only
def test_kv_heads_fewer_than_ranks_are_replicated():
    results = run_ranks("tests.distributed.workers:parity", kv_heads=1, sequence_parallel=True)
    check_parity_results(results, True)
    assert results[0]["heads"] == results[1]["heads"] == (2, 1)


# The DTensor runtime without sequence parallelism runs in `make test` (a C kernel fed a DTensor's
# data_ptr() once crashed it, unseen there); with sequence parallelism in the full matrix.
@pytest.mark.parametrize(
    "sequence_parallel", [False, pytest.param(True, marks=full_only)], ids=["tp2", "tp2-sp"]
)
def test_dtensor_runtime_parity(sequence_parallel):
    check_parity_results(
        run_ranks("tests.distributed.workers:parity", runtime="dtensor", sequence_parallel=sequence_parallel),
        sequence_parallel,
    )


@full_only
def test_model_sharded_by_transformers_is_served_as_is(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    results = run_ranks("tests.distributed.workers:transformers_sharded", path=str(tmp_path))
    assert results[0] == results[1] == {"sharded_by": "transformers", "heads": (2, 1)}


@full_only
def test_refusals_in_a_process_group():
    for result in run_ranks("tests.distributed.workers:bad_sizes"):
        assert "larger than the world" in result["larger_than_world"]
        assert "batching='dynamic'" in result["dynamic_batching"]
        assert "no separate q_proj and k_proj (a fused projection)" in result["fused"]
        assert result["untouched"] and not result["patched"]


def test_no_prefix_is_shared_while_a_rank_draws_dropout():
    for result in run_ranks("tests.distributed.workers:dropout_pause"):
        assert result == {"train": False, "eval": True}


# ------------------------------------------------------------------------------- refusals, one process


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _untouched(model, before) -> bool:
    return not hfaccel.api.is_patched(model) and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters())
    )


def test_heads_not_divisible_is_refused_before_sharding(no_torchrun):
    model = tiny_model("llama")
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="does not divide .*4 attention heads"):
        hfaccel.patch(model, tensor_parallel_size=3)
    assert _untouched(model, before)


def test_no_process_group_is_refused(no_torchrun):
    model = tiny_model("llama")
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        hfaccel.patch(model, tensor_parallel_size=2)
    assert _untouched(model, before)


def test_larger_than_the_world_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="larger than the world"):
        hfaccel.patch(model, tensor_parallel_size=4)
    assert not hfaccel.api.is_patched(model)


def test_dynamic_batching_is_refused(no_torchrun):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="batching='dynamic'"):
        hfaccel.patch(model, tensor_parallel_size=2, batching="dynamic")
    assert not hfaccel.api.is_patched(model)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="positive integer"):
        hfaccel.patch(tiny_model("llama"), tensor_parallel_size=bad)


def test_sequence_parallel_needs_tensor_parallel():
    with pytest.raises(ValueError, match="needs tensor parallelism"):
        hfaccel.patch(tiny_model("llama"), sequence_parallel=True)


def test_plan_styles_are_mapped_or_refused():
    from hfaccel.patches.tp_plan import check_shardable

    model = tiny_model("llama")
    assert check_shardable(model, 2, True)["model.layers.*.self_attn.o_proj"] == "rowwise"
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    model._tp_plan = {}
    with pytest.raises(ValueError, match="packed_colwise"):
        check_shardable(model, 2, False)


def test_tensor_parallel_size_one_is_plain(llama):
    model = hfaccel.patch(tiny_model("llama"), tensor_parallel_size=1)
    try:
        assert parallel_layout(model).tp is None
    finally:
        hfaccel.unpatch(model)
