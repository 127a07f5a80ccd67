"""torch.compile of the decode step (and of every step under compile="all"): the eager tokens, and no
recompilation once warmed up. One family in `make test`; every family and SmolLM2 in `make
test-compile` (HFACCEL_FULL_COMPILE_TESTS=1): a cold compile costs 10-30 s per graph on a CPU."""

import os

import pytest
import torch

from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import FAMILIES, tiny_model

FULL = os.environ.get("HFACCEL_FULL_COMPILE_TESTS") == "1"
full_only = pytest.mark.skipif(
    not FULL, reason="every family: HFACCEL_FULL_COMPILE_TESTS=1 (make test-compile)"
)

# Output lengths that differ, so the decode batch shrinks through every size from 5 down to 1.
PROMPTS = [[3 + i for i in range(n)] for n in (5, 19, 1, 33, 8)]
LENGTHS = [3, 5, 7, 9, 11]


def run(model, **config):
    engine = Engine(model, EngineConfig(**{"max_num_seqs": 8, "kv_cache_memory": 4_000_000, **config}))
    warmup = engine.warmup(progress=False)
    requests = [
        engine.add_request(p, StoppingParams(max_new_tokens=n, min_new_tokens=n))
        for p, n in zip(PROMPTS, LENGTHS)
    ]
    sizes = set()
    with torch.compiler.set_stance("fail_on_recompile") if warmup else _nothing():
        while engine.has_unfinished_requests():
            engine.step()
            sizes.add(engine.step_stats[-1].num_seqs)
    return [r.output_token_ids for r in requests], sizes, engine


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_family(family):
    model = tiny_model(family)
    eager, _, _ = run(model, compile="off")
    compiled, sizes, engine = run(model, compile="decode", cuda_graph_sizes=(2, 8))
    assert compiled == eager
    assert sizes >= {1, 2, 3, 4, 5}  # every decode batch size ran on a compiled bucket, none recompiled
    assert engine.warmup_seconds > 0


def test_compiled_decode_matches_eager_and_never_recompiles_after_warmup():
    check_family("llama")


@full_only
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_compiled_decode_matches_eager_for_every_family(family):
    check_family(family)


@full_only
def test_compiled_decode_over_a_bf16_kv_cache_matches_eager():
    """A float32 model over a bf16 KV cache (the C kernel widens the rows it reads, rounds the rows it
    stores): compiled and eager decode the same tokens, and the warmed-up buckets never recompile."""
    model = tiny_model("llama")
    eager, _, _ = run(model, compile="off", dtype="bfloat16")
    compiled, sizes, _ = run(model, compile="decode", cuda_graph_sizes=(2, 8), dtype="bfloat16")
    assert compiled == eager
    assert sizes >= {1, 2, 3, 4, 5}


def test_compile_all_matches_eager_on_mixed_steps():
    model = tiny_model("qwen2")
    eager, _, _ = run(model, compile="off", max_num_batched_tokens=16)
    compiled, _, engine = run(model, compile="all", cuda_graph_sizes=(8,), max_num_batched_tokens=16)
    assert compiled == eager
    assert "dynamic" in engine.runner._compiled  # mixed/prefill steps went through the dynamic graph


@full_only
@pytest.mark.slow
def test_compiled_decode_matches_eager_on_smollm2(smollm2):
    model, _ = smollm2
    eager, _, _ = run(model, compile="off")
    # SmolLM2's KV is 46 KB a token: 4 MB held five sequences, and buckets above that are refused.
    compiled, _, _ = run(model, compile="decode", cuda_graph_sizes=(2, 8), kv_cache_memory=64_000_000)
    assert compiled == eager
