"""The Triton backend end to end, under the CPU interpreter: the torch backend's greedy tokens."""

import pytest
import torch

import hfaccel
from hfaccel.kernels import get_backend, unavailable_reason
from tests.helpers import tiny_model, varied_prompts

pytest.importorskip("triton")


def _tokens(model, prompts, max_new_tokens=6, **config):
    hfaccel.patch(model, **config)
    try:
        completions = hfaccel.generate(model, prompts, max_new_tokens=max_new_tokens, progress=False)
        engine = model._hfaccel.engine
        return [c.token_ids for c in completions], engine.stats()
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize(
    "config",
    [
        {},  # mixed steps: decodes + fresh prompts, prefix-cache hits on shared prefixes
        {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16},  # chunked prefill
        {
            "kv_cache_memory": 2 * 2 * 2 * 16 * 4 * 4 * 16,
            "block_size": 4,
            "max_num_batched_tokens": 16,
            "max_model_len": 64,  # what 16 blocks of 4 hold (patch refuses less than one full request)
        },  # preempts
    ],
    ids=["mixed", "chunked", "preemption"],
)
def test_triton_backend_gives_the_torch_backends_greedy_tokens(config):
    model = tiny_model("llama")
    prompts = varied_prompts(8)
    reference, _ = _tokens(model, prompts, backend="torch", **config)
    ours, stats = _tokens(model, prompts, backend="triton", **config)
    assert ours == reference
    if "kv_cache_memory" in config:
        assert stats["preemptions"] > 0
    else:
        assert stats["prefix_cache_hit_tokens"] > 0


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = unavailable_reason("triton", torch.device("cpu"), torch.float32, 64)
    assert reason is not None and "need a CUDA device" in reason
    with pytest.raises(ValueError, match="attention backend 'triton' cannot run here"):
        get_backend("triton", "cpu", torch.float32, 64)


def test_triton_refuses_an_unsupported_head_dim():
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        get_backend("triton", "cpu", torch.float32, 48)


MIXED = {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


@pytest.mark.parametrize(
    ("model_type", "changes"),
    [("mistral", {}), ("llama4_text", {}), ("gemma3_text", MIXED)],
    ids=["mistral", "llama4_text", "gemma3-full-and-sliding"],
)
def test_triton_backend_serves_windows_and_chunks_as_the_torch_backend_does(model_type, changes):
    """The family matrix's tiny Mistral (a window of 8 positions), Llama 4 (chunks of 8) and a Gemma 3
    whose sliding layers keep K/V in a pool of their own beside a full layer, chunked prefill: the Triton
    kernels attend within each layer's window or chunk, over its pool's tables, as the torch backend does
    (which is checked against HF in patches/)."""
    from hfaccel.bench.families import family_model

    model = family_model(model_type, **changes)
    prompts = varied_prompts(6, seed=3)
    chunked = {"max_num_batched_tokens": 16, "kv_cache_memory": 4_000_000}
    reference, _ = _tokens(model, prompts, max_new_tokens=10, backend="torch", **chunked)
    ours, _ = _tokens(model, prompts, max_new_tokens=10, backend="triton", **chunked)
    assert ours == reference
