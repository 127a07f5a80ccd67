import contextlib

import pytest
import torch

from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from hfaccel.kernels import cpu_decode
from tests.helpers import (
    EOS,
    Fault,
    assert_same_or_near_tie,
    check_consistent,
    hf_greedy,
    tiny_model,
    varied_prompts,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def run(engine, prompts, max_new=12):
    stop = StoppingParams(max_new_tokens=max_new, eos_token_ids=frozenset({EOS}))
    requests = [engine.make_request(p, stop) for p in prompts]
    engine.run(requests)
    return requests


def test_greedy_parity_with_hf(model):
    engine = Engine(model, EngineConfig(block_size=8, max_num_batched_tokens=64, kv_cache_memory=2_000_000))
    prompts = varied_prompts(16)
    for prompt, request in zip(prompts, run(engine, prompts)):
        assert_same_or_near_tie(model, prompt, request.output_token_ids, hf_greedy(model, prompt, 12))
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_more_prompts_than_the_cache_holds_all_complete_identically(model):
    # 12 blocks of 8 tokens (~96 tokens) for 16 prompts of up to 71 tokens: admission waits and
    # running requests get preempted, and the outputs do not change.
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 8
    small = Engine(
        model, EngineConfig(block_size=8, max_num_batched_tokens=64, kv_cache_memory=12 * bytes_per_block)
    )
    assert small.num_blocks == 12
    big = Engine(model, EngineConfig(block_size=8, max_num_batched_tokens=64, kv_cache_memory=4_000_000))
    prompts = varied_prompts(16, seed=3)
    tight, roomy = run(small, prompts, 20), run(big, prompts, 20)
    assert small.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in tight] == [r.output_token_ids for r in roomy]
    assert small.block_manager.num_free_blocks == small.num_blocks


def test_bad_prompts_are_refused_before_anything_runs(model):
    engine = Engine(model, EngineConfig(kv_cache_memory=1_000_000, max_model_len=64))
    stop = StoppingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], stop)
    with pytest.raises(
        ValueError, match=r"prompt has 64 tokens, but the model's context \(max_model_len\) is 64"
    ):
        engine.add_request([5] * 64, stop)
    with pytest.raises(ValueError, match=r"prompt token ids \[999\] are outside the vocabulary \[0, 256\)"):
        engine.add_request([5, 999], stop)
    assert not engine.has_unfinished_requests()
    assert run(engine, [[5, 6, 7]], 4)[0].finish_reason == "length"


def test_too_small_kv_budget_names_the_minimum(model):
    with pytest.raises(ValueError, match=r"less than one KV block \(8192 bytes\); the minimum is 8192 bytes"):
        Engine(model, EngineConfig(kv_cache_memory=100))


def test_error_midway_aborts_and_frees_every_block(model, monkeypatch):
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=2_000_000))
    calls = {"n": 0}
    real_run = engine.runner.run

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_run(inputs)

    monkeypatch.setattr(engine.runner, "run", flaky)
    requests = [engine.make_request(p, StoppingParams(max_new_tokens=10)) for p in varied_prompts(4)]
    with pytest.raises(KeyboardInterrupt):
        engine.run(requests)
    # The interrupted step's requests failed with the interrupt; the run aborted the others.
    assert {r.finish_reason for r in requests} <= {"error", "abort"}
    assert all(isinstance(r.error, KeyboardInterrupt) for r in requests if r.finish_reason == "error")
    assert any(r.finish_reason == "error" for r in requests)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()
    monkeypatch.setattr(engine.runner, "run", real_run)
    again = run(engine, [varied_prompts(4)[0]], 10)[0]
    assert again.output_token_ids == hf_greedy(model, varied_prompts(4)[0], 10)


def test_eos_and_min_new_tokens(model):
    engine = Engine(model, EngineConfig(kv_cache_memory=1_000_000))
    prompt = varied_prompts(4)[2]
    free_run = hf_greedy(model, prompt, 8, eos_token_id=None)
    eos = free_run[2]  # pretend the third generated token is EOS
    stopped = engine.make_request(prompt, StoppingParams(max_new_tokens=8, eos_token_ids=frozenset({eos})))
    held = engine.make_request(
        prompt, StoppingParams(max_new_tokens=8, min_new_tokens=8, eos_token_ids=frozenset({eos}))
    )
    engine.run([stopped, held])
    assert stopped.output_token_ids == free_run[:3] and stopped.finish_reason == "stop"
    assert len(held.output_token_ids) == 8 and eos not in held.output_token_ids
    ref = hf_greedy(model, prompt, 8, min_new_tokens=8, eos_token_id=eos)
    assert held.output_token_ids == ref


def test_repr_shows_state(model):
    engine = Engine(model, EngineConfig(kv_cache_memory=1_000_000))
    text = repr(engine)
    assert "backend='torch'" in text and "running=0" in text and f"/{engine.num_blocks}x16" in text


def test_kv_cache_is_gqa_sized(model):
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=1_000_000))
    k_cache, v_cache = engine.runner.kv_caches[0]
    # 2 KV heads, not the 4 query heads; the torch backend adds one scratch block for padded slots
    assert k_cache.shape == (engine.num_blocks + 1, 8, 2, 16)
    assert len(engine.runner.kv_caches) == 2 and k_cache.dtype == torch.float32


def test_request_too_large_for_the_cache_is_refused_when_made(model):
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 8
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=4 * bytes_per_block))
    ok = engine.make_request([5, 6], StoppingParams(max_new_tokens=4))
    with pytest.raises(
        ValueError, match=r"holds 4 blocks of 8 tokens, but request .* needs 5 blocks \(40 tokens\)"
    ):
        engine.make_request([5] * 30, StoppingParams(max_new_tokens=10))
    engine.run([ok])
    assert ok.is_finished and engine.block_manager.num_free_blocks == 4


def test_run_refusing_a_request_midway_leaves_nothing_queued(model):
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 8
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=4 * bytes_per_block))
    roomy = Engine(model, EngineConfig(block_size=8, kv_cache_memory=2_000_000))
    ok = engine.make_request([5, 6], StoppingParams(max_new_tokens=4))
    too_big = roomy.make_request([5] * 30, StoppingParams(max_new_tokens=10))  # fine there, not here
    with pytest.raises(ValueError, match=r"holds 4 blocks of 8 tokens, but request .* needs 5 blocks"):
        engine.run([ok, too_big])
    assert not engine.has_unfinished_requests() and ok.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == 4


def test_a_raising_stop_check_fails_only_its_request(model):
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=2_000_000))
    prompts = varied_prompts(4)

    def broken(prompt, ids):
        if len(ids) == 3:
            raise ValueError("stop check bug")
        return False

    bad = engine.add_request(prompts[0], StoppingParams(max_new_tokens=10, stop_check=broken))
    stop = StoppingParams(max_new_tokens=10, eos_token_ids=frozenset({EOS}))
    good = [engine.add_request(p, stop) for p in prompts[1:]]
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert bad in finished and bad.finish_reason == "error" and isinstance(bad.error, ValueError)
    assert len(bad.output_token_ids) == 3 and bad.block_ids == []
    for prompt, request in zip(prompts[1:], good):
        assert request.finish_reason in ("length", "stop") and request.error is None
        assert_same_or_near_tie(model, prompt, request.output_token_ids, hf_greedy(model, prompt, 10))
    assert engine.block_manager.num_used_blocks == 0
    # Engine.run raises the request's error (and aborts the rest of its own requests).
    again = engine.make_request(prompts[0], StoppingParams(max_new_tokens=10, stop_check=broken))
    with pytest.raises(ValueError, match="stop check bug"):
        engine.run([again])
    assert engine.block_manager.num_used_blocks == 0


def test_stream_refuses_a_request_it_does_not_hold(model):
    engine = Engine(model, EngineConfig(kv_cache_memory=1_000_000))
    other = Engine(model, EngineConfig(kv_cache_memory=1_000_000))
    never_queued = engine.make_request([5, 6, 7], StoppingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="not queued on this engine"):
        engine.stream(never_queued)
    elsewhere = other.add_request([5, 6, 7], StoppingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="not queued on this engine"):
        engine.stream(elsewhere)
    assert list(other.stream(elsewhere)) == elsewhere.output_token_ids


def test_abort_is_idempotent_in_every_state(model):
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=1_000_000))
    never_queued = engine.make_request([5, 6, 7], StoppingParams(max_new_tokens=3))
    running = engine.add_request(list(range(3, 40)), StoppingParams(max_new_tokens=5))
    engine.step()
    waiting = engine.add_request([9, 9, 9], StoppingParams(max_new_tokens=5))
    done = engine.add_request([8], StoppingParams(max_new_tokens=1))
    while not done.is_finished:
        engine.step()
    for request in (never_queued, running, waiting, done):
        for _ in range(2):
            engine.abort(request)
        assert request.is_finished and request.block_ids == []
    assert done.finish_reason == "length" and running.finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_interrupted_abort_leaves_the_engine_consistent(model):
    for at in range(1, 200):  # a KeyboardInterrupt at each line event of `abort` in turn
        engine = Engine(model, EngineConfig(block_size=4, kv_cache_memory=1_000_000))
        requests = [engine.add_request(p, StoppingParams(max_new_tokens=4)) for p in varied_prompts(4)]
        engine.step()
        victim = max(requests, key=lambda r: len(r.block_ids))
        with Fault(at) as fault, contextlib.suppress(KeyboardInterrupt):
            engine.abort(victim)
        check_consistent(engine)
        engine.abort(victim)  # again: completes the abort, or does nothing
        assert victim.finish_reason == "abort" and victim.block_ids == []
        check_consistent(engine)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.block_manager.num_used_blocks == 0
        if not fault.fired:
            break
    assert not fault.fired, "abort has more line events than the sweep covers"


def test_greedy_fast_path_masks_eos_only_below_min_new_tokens():
    """The greedy fast path takes one argmax over the logits as they are; a row whose argmax is an EOS
    id while its request is below min_new_tokens is redone with the EOS ids masked."""
    from hfaccel.engine.request import Request, SamplingParams
    from hfaccel.engine.sampler import sample

    logits = torch.tensor(
        [[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0], [0.0, 1.0, 4.0, 5.0]], dtype=torch.bfloat16
    )
    young = StoppingParams(max_new_tokens=8, min_new_tokens=4, eos_token_ids=frozenset({1, 9}))
    grown = StoppingParams(max_new_tokens=8, min_new_tokens=0, eos_token_ids=frozenset({1}))
    requests = [Request(0, [1, 2], young), Request(1, [1, 2], grown), Request(2, [1, 2], young)]
    assert sample(logits, requests) == [2, 1, 3]
    # The general path (a request that records its scores) gives the same tokens.
    recorded = Request(3, [1, 2], grown, SamplingParams(output_scores=True))
    assert sample(torch.cat([logits, logits[:1]]), requests + [recorded]) == [2, 1, 3, 1]


def _greedy_through(model, kernel: bool, monkeypatch, **config) -> tuple[list[list[int]], set]:
    """Greedy tokens of `varied_prompts` with the CPU decode kernel on or off, and what the kernel saw:
    (query dtype, cache dtype, whether it stored the new K/V) per call."""
    seen = set()
    real = cpu_decode.DecodeCall.__call__

    def spy(self, query, k_cache, v_cache, scale, out, key=None, value=None, *local, **by_name):
        seen.add((query.dtype, k_cache.dtype, key is not None))
        return real(self, query, k_cache, v_cache, scale, out, key, value, *local, **by_name)

    heads_first = cpu_decode.DecodeCall.heads_first

    def spy_heads_first(self, query, key, value, k_cache, *rest, **by_name):  # a step of decodes only
        seen.add((query.dtype, k_cache.dtype, True))
        return heads_first(self, query, key, value, k_cache, *rest, **by_name)

    monkeypatch.setattr(cpu_decode.DecodeCall, "__call__", spy)
    monkeypatch.setattr(cpu_decode.DecodeCall, "heads_first", spy_heads_first)
    monkeypatch.setenv("HFACCEL_CPU_DECODE_KERNEL", "1" if kernel else "0")
    cpu_decode.load.cache_clear()
    try:
        engine = Engine(
            model, EngineConfig(block_size=8, max_num_batched_tokens=64, kv_cache_memory=2_000_000, **config)
        )
        tokens = [r.output_token_ids for r in run(engine, varied_prompts(16), max_new=16)]
    finally:
        monkeypatch.delenv("HFACCEL_CPU_DECODE_KERNEL")
        cpu_decode.load.cache_clear()
    return tokens, seen


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
def test_bf16_kv_cache_decodes_the_same_tokens_through_the_cpu_kernel_as_through_sdpa(model, monkeypatch):
    """A float32 model over a bfloat16 KV cache: the kernel stores the new rows rounded as the torch path
    rounds them and attends in float32 over the same bf16 values as the SDPA path (which widens the
    gathered blocks to float32), so only the summation order differs (about 1e-7, far below this
    model's top-2 logit gaps): the same greedy tokens, in pure decode steps (the kernel stores) and
    mixed ones (write_kv stores) alike."""
    ours, seen = _greedy_through(model, True, monkeypatch, dtype="bfloat16")
    reference, none = _greedy_through(model, False, monkeypatch, dtype="bfloat16")
    f32, bf16 = torch.float32, torch.bfloat16
    assert seen == {(f32, bf16, True), (f32, bf16, False)} and none == set()
    assert ours == reference


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
def test_a_bf16_model_decodes_through_the_cpu_kernel(monkeypatch):
    """A bfloat16 model on a CPU (bf16 cache) now takes the kernel. Its tokens are not compared with the
    SDPA path's: that path computes in bf16 and the kernel in float32, so near-ties may go either way
    (the kernel's accuracy is tested against float32 SDPA in tests/kernels)."""
    bf16_model = tiny_model("llama").to(torch.bfloat16)
    tokens, seen = _greedy_through(bf16_model, True, monkeypatch)
    assert {(q, c) for q, c, _ in seen} == {(torch.bfloat16, torch.bfloat16)}
    assert all(len(t) == 16 or t[-1] == EOS for t in tokens)


class RecordingSync:
    """A stand-in for `StepSync` (ranks in lock step) in one process: records the checks, and makes the
    step check raise when asked, as a divergence does on every rank."""

    def __init__(self) -> None:
        self.checks: list[str] = []
        self.diverge_at: int | None = None  # raise at this many step checks

    def check_step(self, step, packed) -> None:
        self.checks.append("step")
        if self.checks.count("step") == self.diverge_at:
            raise RuntimeError("tensor-parallel ranks diverged (stand-in)")

    def check_drained(self) -> None:
        self.checks.append("drained")

    def agree_tokens(self, tokens):
        return tokens


def test_an_engine_in_lock_step_checks_once_when_it_empties(model):
    """Ranks in lock step: one empty-plan check at the step that empties the engine (not per step, not
    when it was already empty), and none owed after a step that raised (every rank raised)."""
    engine = Engine(model, EngineConfig(kv_cache_memory=4_000_000))
    sync = engine.step_sync = RecordingSync()
    run(engine, [[5, 6, 7], [8, 9]], max_new=3)
    assert sync.checks.count("drained") == 1 and sync.checks[-1] == "drained"
    assert sync.checks.count("step") >= 3
    engine.sync_drain()  # already checked: nothing more
    assert sync.checks.count("drained") == 1
    sync.diverge_at = sync.checks.count("step") + 2  # the second step of the next call
    with pytest.raises(RuntimeError, match="diverged"):
        run(engine, [[5, 6, 7]], max_new=3)
    engine.sync_drain()  # the divergence was raised on every rank: no rank owes the others a check
    assert sync.checks.count("drained") == 1
    assert engine.block_manager.num_used_blocks == 0


def test_max_num_seqs_beyond_the_blocks_is_capped_at_them(model, caplog):
    """max_num_seqs=10**8 sized the step buffers for 10**8 sequences (a server was killed for memory);
    a running sequence holds a block at least, so no more than the blocks run at once."""
    engine = Engine(model, EngineConfig(kv_cache_memory=4_000_000, max_num_seqs=10**8))
    assert engine.config.max_num_seqs == engine.num_blocks < 10**8
    assert "at most" in caplog.text and "sequences run at once" in caplog.text
    requests = run(engine, [[5, 6, 7], [8, 9]], max_new=3)
    assert all(len(r.output_token_ids) == 3 for r in requests)


def test_decode_buckets_above_the_capped_max_num_seqs_are_left_out(model, caplog):
    """A `cuda_graph_sizes` that fits the asked `max_num_seqs` but not the KV cache's blocks: the sizes that
    cannot occur are left out with a warning (the config refused them, naming a max_num_seqs the caller
    never set)."""
    blocks = Engine(model, EngineConfig(kv_cache_memory=200_000)).num_blocks
    engine = Engine(
        model,
        EngineConfig(kv_cache_memory=200_000, max_num_seqs=blocks + 8, cuda_graph_sizes=(1, blocks + 8)),
    )
    assert engine.config.max_num_seqs == blocks
    assert engine.config.cuda_graph_sizes == (1,)
    assert "are left out" in caplog.text


def test_an_engine_over_a_transformers_model_needs_no_import_of_the_adapter():
    """`import hfaccel` imports its parts at first use: an engine built from `hfaccel.engine` alone finds
    the transformers adapter by itself (the fault-injection tests, run alone, could not build one)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from hfaccel.engine.engine import Engine\n"
        "from hfaccel.config import EngineConfig\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()\n"
        "print(type(Engine(model, EngineConfig(kv_cache_memory=1_000_000)).executor).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["HFExecutor"]
