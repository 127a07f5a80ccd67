"""What each rank runs in the distributed tests (imported by the spawned processes)."""

from __future__ import annotations

import copy

import torch

import hfaccel
import hfaccel.api
from hfaccel.distributed.layout import parallel_layout, record_layout
from tests.helpers import assert_same_or_near_tie, tiny_model, varied_prompts

MAX_NEW = 10
# Per rank: with TP=2 a rank holds 1 of the 2 KV heads, 256 bytes a token over 2 layers (fp32, head_dim 16):
# 8 blocks of 16 tokens, too few for the 12 prompts at once, so requests are preempted.
SMALL_KV = 8 * 16 * 256


def _greedy_reference(model, prompts):
    reference = hfaccel.generate(
        copy.deepcopy(model), prompts, max_new_tokens=MAX_NEW, do_sample=False, progress=False
    )
    return [c.token_ids for c in reference]


def _layer0_tokens(model):
    """Record the token count layer 0 sees at each forward (the residual stream's width)."""
    seen: list[int] = []
    layer = model.model.layers[0]

    def record(module, args):
        seen.append(args[0].shape[1])

    record.hfaccel_packed = True  # it reads the packed steps, as it means to: the engine keeps the call
    layer.register_forward_pre_hook(record)
    return seen


def parity(
    rank: int,
    family: str = "llama",
    sequence_parallel: bool = False,
    kv_heads: int | None = None,
    runtime: str = "local",
    check_divergence: bool = False,
    model_type: str | None = None,
) -> dict:
    """Greedy parity of a TP=2 model with the single-process engine: chunked prefill (16-token budget),
    prefix-cache hits and preemption (a small KV cache); then a seeded sampled run, the step plans, and
    what the residual stream looked like at each step."""
    if model_type is not None:  # another family, from `bench.families` (2 layers, as tiny_model's)
        from hfaccel.bench.families import family_model

        model = family_model(model_type, num_hidden_layers=2)
    else:
        model = tiny_model(family) if kv_heads is None else _tiny_with_kv_heads(family, kv_heads)
    unsharded = copy.deepcopy(model)
    prompts = varied_prompts(12)
    reference = _greedy_reference(unsharded, prompts)
    if runtime == "local":
        # Under inference_mode (as the demo patches): the shards must not become inference tensors.
        with torch.inference_mode(sequence_parallel):
            hfaccel.patch(
                model,
                tensor_parallel_size=2,
                sequence_parallel=sequence_parallel,
                max_num_batched_tokens=16,
                kv_cache_memory=SMALL_KV,
                max_model_len=128,  # the small cache holds one request of 128 tokens (checked at patch)
            )
    else:
        from hfaccel.patches.tp_plan import shard_model

        record_layout(model, tp=shard_model(model, 2, None, sequence_parallel, runtime=runtime))
        hfaccel.patch(model, max_num_batched_tokens=16, kv_cache_memory=SMALL_KV, max_model_len=128)
    seen = _layer0_tokens(model)
    out = hfaccel.generate(model, prompts, max_new_tokens=MAX_NEW, do_sample=False, progress=False)
    tokens = [c.token_ids for c in out]
    for prompt, ours, ref in zip(prompts, tokens, reference):
        assert_same_or_near_tie(unsharded, prompt, ours, ref)
    engine = model._hfaccel.engine
    executor = engine.executor
    stats = engine.stats()
    greedy_plans = list(executor.step_sync.plans)
    forward_log = list(executor.forward_log)
    sampled = hfaccel.generate(
        model, prompts[:6], max_new_tokens=MAX_NEW, do_sample=True, temperature=1.5, seed=1234, progress=False
    )
    result = {
        "tokens": tokens,
        "reference": reference,
        "plans": greedy_plans,
        "forward_log": forward_log,
        "layer0_tokens": seen[: len(forward_log)],
        "stats": stats,
        "heads": (executor.num_q_heads, executor.num_kv_heads),
        "num_blocks": engine.num_blocks,
        "sampled": [c.token_ids for c in sampled],
    }
    if check_divergence:
        result["divergence"] = _diverge(model, rank)
    return result


def parity_tp_and_sp(rank: int, check_divergence: bool = False) -> tuple[dict, dict]:
    """`parity` without, then with, sequence parallelism (fresh models), in one process start-up; the
    second is ``{"refused": message}`` when patch refuses it (the test says when that is right)."""
    tp = parity(rank, check_divergence=check_divergence)
    try:
        sp = parity(rank, sequence_parallel=True)
    except ValueError as error:
        sp = {"refused": str(error)}
    return tp, sp


def _diverge(model, rank: int) -> str:
    """Rank 1 submits a different prompt: both ranks must raise at the same step, not hang."""
    prompt = [5, 6, 7, 8] if rank == 0 else [5, 6, 7, 9]
    try:
        hfaccel.generate(model, [prompt], max_new_tokens=2, do_sample=False, progress=False)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _tiny_with_kv_heads(family: str, kv_heads: int):
    model = tiny_model(family)
    config = copy.deepcopy(model.config)
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    fresh = type(model)(config).eval()
    with torch.no_grad():
        for p in fresh.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return fresh


def transformers_sharded(rank: int, path: str) -> dict:
    """A model transformers sharded at load (tp_plan="auto") is served as it is."""
    from transformers import AutoModelForCausalLM

    unsharded = AutoModelForCausalLM.from_pretrained(path).eval()
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    prompts = varied_prompts(6)
    reference = _greedy_reference(unsharded, prompts)
    hfaccel.patch(model, max_num_batched_tokens=16)
    out = hfaccel.generate(model, prompts, max_new_tokens=MAX_NEW, do_sample=False, progress=False)
    for prompt, ours, ref in zip(prompts, (c.token_ids for c in out), reference):
        assert_same_or_near_tie(unsharded, prompt, ours, ref)
    executor = model._hfaccel.engine.executor
    return {
        "sharded_by": parallel_layout(model).tp.sharded_by,
        "heads": (executor.num_q_heads, executor.num_kv_heads),
    }


def bad_sizes(rank: int) -> dict:
    """Refusals inside a real process group: before anything is sharded."""
    errors = {}
    model = tiny_model("llama")
    before = [p.clone() for p in model.parameters()]
    for name, kwargs in {
        "larger_than_world": {"tensor_parallel_size": 4},
        "dynamic_batching": {"tensor_parallel_size": 2, "batching": "dynamic"},
    }.items():
        try:
            hfaccel.patch(model, **kwargs)
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    errors["untouched"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    errors["patched"] = hfaccel.api.is_patched(model)
    from hfaccel.bench.families import family_model

    fused = family_model("phi3", num_hidden_layers=2)  # one qkv_proj: its heads cannot be counted
    before = [p.clone() for p in fused.parameters()]
    try:
        hfaccel.patch(fused, tensor_parallel_size=2)
        errors["fused"] = None
    except ValueError as error:
        errors["fused"] = str(error)
    errors["untouched"] &= all(torch.equal(a, b) for a, b in zip(before, fused.parameters()))
    return errors


def dropout_pause(rank: int) -> dict:
    """A tensor-parallel engine shares no prefix while the model draws dropout (the ranks' agreed token
    says so: `StepSync.agree_token`), and shares again in eval mode."""
    model = tiny_model("llama")
    model.model.layers[0].mlp.dropout = torch.nn.Dropout(0.1)  # a module that may draw dropout
    hfaccel.patch(model, tensor_parallel_size=2)
    sharing = {}
    for mode in ("train", "eval"):
        getattr(model, mode)()
        model.generate(torch.tensor([list(range(5, 40))]), max_new_tokens=2, do_sample=False)
        sharing[mode] = model._hfaccel.engine.block_manager.enable_prefix_caching
    return sharing


def one_rank_ends_alone(rank: int) -> dict:
    """TP=2 calls that end on one rank only: a logits processor that raises on rank 1 (errors="raise":
    rank 1's call cancels its other request), then other max_new_tokens per rank (rank 0 empties first).
    Every rank must raise, none wait for the other for ever; then the same call on both succeeds."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class RaisesOnRankOne(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if rank == 1 and input_ids.shape[-1] >= 8:
                raise ValueError("a processor failed on rank 1")
            return scores

    model = hfaccel.patch(tiny_model("llama"), tensor_parallel_size=2)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    errors = []
    for kwargs in (
        {"logits_processor": LogitsProcessorList([RaisesOnRankOne()]), "max_new_tokens": 8},
        {"max_new_tokens": 4 + 4 * rank},
    ):
        try:
            hfaccel.generate(model, prompts, do_sample=False, progress=False, **kwargs)
            errors.append(None)
        except (RuntimeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    after = hfaccel.generate(model, prompts, max_new_tokens=4, do_sample=False, progress=False)
    return {"errors": errors, "after": [c.token_ids for c in after]}
