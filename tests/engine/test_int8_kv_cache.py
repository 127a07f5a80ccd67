"""An int8 KV cache (`EngineConfig(dtype="int8")`, `kernels/kv_quant.py`) end to end on a patched model:
logits within quantization error of the model's own, the same tokens however a prompt is scheduled
(chunked, from a warm prefix cache, preempted), a quarter of the bytes, and what it cannot serve refused."""

import pytest
import torch

import hfaccel
from hfaccel import EngineConfig
from tests.helpers import left_padded, tiny_model, varied_prompts


def _generate(model, prompts, new_tokens=12, scores=False):
    ids, mask = left_padded(prompts)
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # every row's scores are real ones
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=scores,  # raw logits (min_new_tokens masks EOS in the scores)
    )


def test_int8_cache_logits_are_the_models_own_within_quantization_error():
    """Teacher-forced on the engine's own tokens: each step's logits against one plain forward of the
    model over the same sequence (no cache), and every token the model's argmax wherever its two best
    logits are further apart than that error."""
    model = tiny_model(layers=3)
    prompts = varied_prompts(6)
    hfaccel.patch(model, dtype="int8", strict=True)
    out = _generate(model, prompts, scores=True)
    assert model._hfaccel.engine.runner.kv_caches[0][0].dtype == torch.int8
    hfaccel.unpatch(model)
    width = out.sequences.shape[1] - len(out.logits)
    ids, mask = left_padded(prompts)
    full_mask = torch.cat([mask, torch.ones(len(prompts), len(out.logits), dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=full_mask).logits[:, width - 1 : -1]
    ours = torch.stack(out.logits, dim=1)
    error = (ours - logits).abs().max().item()
    assert 0 < error < 0.03 * logits.abs().max().item()  # quantized (not float K/V), and close (0.9% here)
    top2 = logits.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * error
    assert clear.float().mean() > 0.5
    assert torch.equal(out.sequences[:, width:][clear], logits.argmax(-1)[clear])


def test_int8_cache_gives_the_same_tokens_chunked_cached_or_preempted():
    """A prompt attends over the values its int8 rows give back whether they come from this step or
    the cache, so scheduling changes no token: 8-token prefill chunks, a second run from a warm prefix
    cache, and a cache so small that requests are preempted and recomputed."""
    prompts = varied_prompts(8)
    model = tiny_model()
    hfaccel.patch(model, dtype="int8", enable_prefix_caching=False, strict=True)
    reference = _generate(model, prompts).sequences
    hfaccel.unpatch(model)
    for options in (
        {"long_prefill_token_threshold": 8},
        {"enable_prefix_caching": True},
        # 48 blocks of 4 tokens (2 layers, K and V, 2 heads, 16 + 4 bytes a row) for 8 requests of 18
        {"kv_cache_memory": 48 * 2 * 2 * 2 * 20 * 4, "block_size": 4, "max_model_len": 96},
    ):
        hfaccel.patch(model, EngineConfig(dtype="int8", **options), strict=True)
        for _ in range(2):  # the second run hits the prefix cache where it is on
            assert torch.equal(_generate(model, prompts).sequences, reference), options
        stats = model._hfaccel.engine.stats()
        hfaccel.unpatch(model)
        if "enable_prefix_caching" in options:
            assert stats["prefix_cache_hit_tokens"] > 0
        if "kv_cache_memory" in options:
            assert stats["preemptions"] > 0


def test_int8_cache_holds_about_four_times_the_tokens_of_float32():
    """At the same kv_cache_memory: head_dim 16 in float32 is 64 bytes a row, in int8 16 + 4."""
    blocks = {}
    for dtype in ("float32", "int8"):
        model = tiny_model()
        hfaccel.patch(model, dtype=dtype, kv_cache_memory=4 << 20)
        _generate(model, [[5, 6, 7]], new_tokens=1)
        blocks[dtype] = model._hfaccel.engine.block_manager.num_blocks
        hfaccel.unpatch(model)
    assert blocks["int8"] == pytest.approx(blocks["float32"] * 64 / 20, rel=0.01)


def test_triton_serves_an_int8_cache_as_the_torch_backend_does():
    """The Triton kernels (under the interpreter here) read the int8 rows through their scales and store
    new ones quantized as `kv_quant` does: the same tokens as the torch backend's int8 cache, in chunked
    prefill, decode and from prefix-cache hits. FlashInfer reads no int8 rows: its capabilities say so,
    and a model asking for it with an int8 cache is refused (`selection`)."""
    from hfaccel.kernels.flashinfer_backend import FlashInferPagedAttention

    prompts = varied_prompts(5)
    prompts.append(prompts[0][:20] + [9, 9, 9])  # shares a prefix with the first
    tokens, blocks = {}, {}
    for backend in ("torch", "triton"):
        model = tiny_model()
        hfaccel.patch(
            model,
            dtype="int8",
            backend=backend,
            max_num_batched_tokens=16,
            block_size=8,
            kv_cache_memory=1 << 18,
        )
        tokens[backend] = _generate(model, prompts, new_tokens=8).sequences.tolist()
        engine = model._hfaccel.engine
        cache = engine.runner.kv_caches[0][0]
        assert cache.dtype == torch.int8
        # Triton's rows are padded to 16 bytes (it loads them as vectors), the torch backend's to 4; the
        # budget counts the padding: fewer blocks in the same memory.
        assert cache.shape[-1] == (32 if backend == "triton" else 20)  # head_dim 16
        blocks[backend] = engine.block_manager.num_blocks
        hfaccel.unpatch(model)
    assert tokens["triton"] == tokens["torch"]
    assert blocks["triton"] == pytest.approx(blocks["torch"] * 20 / 32, rel=0.02)
    assert torch.int8 not in FlashInferPagedAttention.capabilities.dtypes


def test_patch_counts_the_row_padding_of_the_backend_it_will_get():
    """The budget check at `patch` counts Triton's 16-byte int8 rows (here 32 bytes against the torch
    backend's 20): a memory that holds one request of max_model_len in torch's rows is refused for
    Triton's at `patch`, not later by the engine."""
    pytest.importorskip("triton")
    options = {"dtype": "int8", "kv_cache_memory": 5 * 2560, "max_model_len": 80}  # 5 blocks of torch's
    model = tiny_model()
    hfaccel.patch(model, backend="torch", **options)
    assert _generate(model, [list(range(3, 60))], new_tokens=4).sequences.shape == (1, 61)
    hfaccel.unpatch(model)
    with pytest.raises(ValueError, match="max_model_len to at most 48"):
        hfaccel.patch(model, backend="triton", **options)


def test_int8_cache_under_autocast_attends_in_one_dtype():
    """Under autocast (accelerate's mixed precision wraps the model's forward in it) rotary leaves q and k
    in float32 and the value projection comes out in bfloat16: the op gets all three in the query's
    dtype. HF's own generate over the same forward is the reference for the first token, which every row
    must share. (An autocast around the call instead sends it to transformers: `models.autocast_reason`.)"""
    prompts = varied_prompts(6)
    ids, mask = left_padded(prompts)
    model = tiny_model()
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    hfaccel.patch(model, dtype="int8", strict=True)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    hfaccel.unpatch(model)
    assert out.shape == reference.shape
    assert torch.equal(out[:, ids.shape[1]], reference[:, ids.shape[1]])
