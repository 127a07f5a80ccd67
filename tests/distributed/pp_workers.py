"""What each rank runs in the pipeline, data and expert parallel tests."""

from __future__ import annotations

import copy
import time

import hfaccel
from hfaccel.distributed.layout import parallel_layout
from tests.distributed.workers import MAX_NEW, _greedy_reference
from tests.helpers import assert_same_or_near_tie, tiny_model, varied_prompts


def pp_parity(
    rank: int, microbatches: int = 2, layers: int = 4, family: str = "llama", scales: dict | None = None
) -> dict:
    """Greedy parity of PP=2 (tiny model, `layers` decoder layers) with the single-process engine, with
    chunked prefill (a 32-token budget) and `microbatches` microbatches per step. With `scales`, a
    `bench.families` model of `family` with those model-level scales in its config."""
    if scales is None:
        model = tiny_model(family, layers=layers)
    else:
        from hfaccel.bench.families import family_model

        model = family_model(family, num_hidden_layers=layers, **scales)
    whole = copy.deepcopy(model)
    prompts = varied_prompts(8)
    reference = _greedy_reference(whole, prompts)
    hfaccel.patch(model, pipeline_parallel_size=2, num_microbatches=microbatches, max_num_batched_tokens=64)
    out = hfaccel.generate(model, prompts, max_new_tokens=MAX_NEW, do_sample=False, progress=False)
    tokens = [c.token_ids for c in out]
    for prompt, ours, ref in zip(prompts, tokens, reference):
        assert_same_or_near_tie(whole, prompt, ours, ref)
    engine = model._hfaccel.engine
    executor = engine.executor
    sampled = hfaccel.generate(
        model, prompts[:4], max_new_tokens=MAX_NEW, do_sample=True, temperature=1.5, seed=7, progress=False
    )
    with_logprobs = hfaccel.generate(
        model, prompts[:3], max_new_tokens=4, do_sample=False, logprobs=True, progress=False
    )
    logprobs_reference = hfaccel.generate(
        copy.deepcopy(whole), prompts[:3], max_new_tokens=4, do_sample=False, logprobs=True, progress=False
    )
    slow_trace = _trace_with_a_slow_last_stage(model, executor)
    return {
        "tokens": tokens,
        "reference": reference,
        "slow_trace": slow_trace,
        "logprobs": [c.logprobs for c in with_logprobs],
        "logprobs_reference": [c.logprobs for c in logprobs_reference],
        "logits_broadcasts": executor.num_logits_broadcasts,
        "num_layers": executor.num_layers,
        "layers": (executor.pp.layer_start, executor.pp.layer_end),
        "kv_caches": len(engine.runner.kv_caches),
        "trace": list(executor.trace),
        "microbatch_log": list(engine.runner.microbatch_log),
        "plans": list(executor.step_sync.plans),
        "sampled": [c.token_ids for c in sampled],
    }


def _trace_with_a_slow_last_stage(model, executor) -> list:
    """The trace of fresh prompts' prefill while the last stage takes 50 ms more per microbatch: if the
    schedule lets stage 0 run microbatch m + 1 while stage 1 works on m, the two certainly overlap then
    (without the delay, a tiny model's microbatches take well under a millisecond, and whether they
    overlap depends on how the OS schedules two processes on two cores)."""
    mark = len(executor.trace)
    layers = executor._layers
    if executor.pp.last:

        def slow_layers(*args):
            time.sleep(0.05)
            return layers(*args)

        executor._layers = slow_layers
    try:
        fresh = varied_prompts(4, seed=11)
        hfaccel.generate(
            model, [p + [5] * 20 for p in fresh], max_new_tokens=1, do_sample=False, progress=False
        )
    finally:
        executor._layers = layers
    return list(executor.trace)[mark:]


def dp_parity(
    rank: int, tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None
) -> dict:
    """Greedy parity of DP=2 replicas (each TP=`tensor_parallel_size` inside, or one process) with the
    single-process engine; then a seeded sampled run, the same on every rank as in one process."""
    model = tiny_model("llama")
    whole = copy.deepcopy(model)
    prompts = varied_prompts(10)
    reference = _greedy_reference(whole, prompts)
    sampled_reference = hfaccel.generate(
        copy.deepcopy(whole), prompts[:6], max_new_tokens=MAX_NEW, do_sample=True, seed=3, progress=False
    )
    hfaccel.patch(
        model,
        data_parallel_size=2,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        num_microbatches=2,
        max_num_batched_tokens=64,
    )
    out = hfaccel.generate(model, prompts, max_new_tokens=MAX_NEW, do_sample=False, progress=False)
    tokens = [c.token_ids for c in out]
    for prompt, ours, ref in zip(prompts, tokens, reference):
        assert_same_or_near_tie(whole, prompt, ours, ref)
    sampled = hfaccel.generate(
        model, prompts[:6], max_new_tokens=MAX_NEW, do_sample=True, seed=3, progress=False
    )
    engine = model._hfaccel.engine
    dp = parallel_layout(model).dp
    return {
        "tokens": tokens,
        "sampled": [c.token_ids for c in sampled],
        "sampled_reference": [c.token_ids for c in sampled_reference],
        "replica": dp.replica,
        "assignment": dp.assignments[0][0],
        "prompt_tokens": [len(p) for p in prompts],
        "engine_requests": engine.stats().get("requests"),
        "stats": engine.stats(),
    }


def dp_different_calls(rank: int) -> dict:
    """Each rank of DP=2 calls with its own prompts, then its own max_new_tokens: both raise, the same
    error at once (each would have got the other's completions), and the replicas stay usable."""
    model = hfaccel.patch(tiny_model("llama"), data_parallel_size=2)
    errors = []
    for kwargs in (
        {"prompts": [[5, 6, 7], [8 + rank, 9]], "max_new_tokens": 3},
        {"prompts": [[5, 6, 7], [8, 9]], "max_new_tokens": 3 + rank},
        {"prompts": [[5, 6, 7]] * (1 + rank), "max_new_tokens": 3},
    ):
        prompts = kwargs.pop("prompts")
        try:
            hfaccel.generate(model, prompts, do_sample=False, progress=False, **kwargs)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    same = hfaccel.generate(model, [[5, 6, 7], [8, 9]], max_new_tokens=3, do_sample=False, progress=False)
    return {"errors": errors, "after": [c.token_ids for c in same]}


def ep_parity(rank: int, family: str = "mixtral", microbatches: int = 2) -> dict:
    """Greedy parity of EP=2 (half the experts per rank, all-to-all routing) with the single-process
    engine, with `microbatches` microbatches per step."""
    from hfaccel.patches.ep_modules import expert_modules

    model = tiny_model(family)
    whole = copy.deepcopy(model)
    prompts = varied_prompts(8)
    reference = _greedy_reference(whole, prompts)
    hfaccel.patch(model, expert_parallel_size=2, num_microbatches=microbatches, max_num_batched_tokens=64)
    out = hfaccel.generate(model, prompts, max_new_tokens=MAX_NEW, do_sample=False, progress=False)
    tokens = [c.token_ids for c in out]
    for prompt, ours, ref in zip(prompts, tokens, reference):
        assert_same_or_near_tie(whole, prompt, ours, ref)
    module = expert_modules(model)[0]
    return {
        "tokens": tokens,
        "local_experts": module.gate_up_proj.shape[0],
        "dispatches": parallel_layout(model).ep.num_dispatches,
        "all_experts": expert_modules(whole)[0].gate_up_proj.shape[0],
        "plans": list(model._hfaccel.engine.executor.step_sync.plans),
        "microbatch_log": list(model._hfaccel.engine.runner.microbatch_log),
    }
