"""The "hfaccel" attention function: which path an eager layer call takes, and that both give HF's tokens."""

import pytest
import torch

import hfaccel
from hfaccel.kernels import cpu_decode
from hfaccel.kernels.torch_paged import TorchPagedAttention
from hfaccel.patches import attention
from tests.helpers import hf_greedy, tiny_model, varied_prompts

pytestmark = pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)


def _count_paths(monkeypatch) -> dict[str, int]:
    """Count the layer calls the kernel served in place (head-first) and those that took the op (which
    calls the backend's packed `forward`)."""
    counts = {"heads_first": 0, "op": 0}
    heads_first, packed = cpu_decode.DecodeCall.heads_first, TorchPagedAttention.forward

    def counted_heads_first(*args, **kwargs):
        counts["heads_first"] += 1
        return heads_first(*args, **kwargs)

    def counted_op(*args, **kwargs):
        counts["op"] += 1
        return packed(*args, **kwargs)

    monkeypatch.setattr(cpu_decode.DecodeCall, "heads_first", counted_heads_first)
    monkeypatch.setattr(TorchPagedAttention, "forward", counted_op)
    return counts


def test_eager_cpu_decode_layers_are_served_in_place_and_prefill_takes_the_op(monkeypatch):
    """Every layer of an eager CPU decode step goes to the kernel over transformers' head-first tensors
    (no transposed views, no op); prefill layers take the op; the tokens are HF's."""
    model = tiny_model("llama", layers=2)
    prompts = varied_prompts(3, seed=11)
    expected = [hf_greedy(model, p, 6, min_new_tokens=6) for p in prompts]
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000, compile="off")
    try:
        counts = _count_paths(monkeypatch)
        got = hfaccel.generate(model, prompts, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    finally:
        hfaccel.unpatch(model)
    assert [c.token_ids for c in got] == expected
    # Five decode steps at least (a step of decodes only: one call per layer), two layers each; the
    # prefill's layers took the op.
    assert counts["heads_first"] >= 5 * 2 and counts["heads_first"] % 2 == 0
    assert counts["op"] >= 2 and counts["op"] % 2 == 0


def test_attention_recording_and_autocast_steps_take_the_op(monkeypatch):
    """A step that records attention probabilities, and one under CPU autocast, never take the in-place
    path (it returns no probabilities and does not cast)."""
    model = tiny_model("llama", layers=2)
    model.set_attn_implementation("eager")  # the attention HF returns probabilities from
    ids = torch.tensor(varied_prompts(1, seed=12))
    kwargs = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000, compile="off", strict=True)
    forward = model.forward
    try:
        counts = _count_paths(monkeypatch)
        out = model.generate(ids, output_attentions=True, return_dict_in_generate=True, **kwargs)
        assert len(out.attentions) == 4 and counts["heads_first"] == 0 and counts["op"] == 4 * 2
        # As accelerate runs a bf16 trainer's forward (served: `test_rl`).
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(forward)
        model.generate(ids, **kwargs)
        assert counts["heads_first"] == 0 and counts["op"] == 2 * 4 * 2
    finally:
        model.forward = forward
        hfaccel.unpatch(model)


def test_under_autocast_the_kernel_is_bound_for_the_dtypes_the_op_casts_to(monkeypatch):
    """A bf16 model over a float32 cache, its forward under bf16 autocast (as accelerate runs it): the op
    casts the query to float32 and the kernel serves that. The in-place path steps aside before binding
    the step's kernel (bound for the bf16 query, every layer lost the kernel, and the torch path's float32
    sums differ in the last bits): the kernel serves as many calls as with no in-place path at all."""
    model = tiny_model("llama", layers=2).to(torch.bfloat16)
    ids = torch.tensor(varied_prompts(2, seed=13))
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000, compile="off", dtype="float32")
    forward = model.forward
    kernel_calls = []
    packed_call = cpu_decode.DecodeCall.__call__

    def counted(*args, **kwargs):
        kernel_calls.append(1)
        return packed_call(*args, **kwargs)

    monkeypatch.setattr(cpu_decode.DecodeCall, "__call__", counted)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(forward)
    try:
        runs = []
        for in_place in (True, False):
            if not in_place:
                monkeypatch.setattr(attention, "paged_attention_heads_first", lambda *args: None)
            kernel_calls.clear()
            out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            runs.append((out, len(kernel_calls)))
    finally:
        model.forward = forward
        hfaccel.unpatch(model)
    (served, calls), (reference, reference_calls) = runs
    assert torch.equal(served, reference) and calls == reference_calls >= 3 * 2


def test_layer_chunk_reads_the_config_as_transformers_reads_it():
    """A layer's chunk comes from ``config.layer_types`` however the config holds it: an instance
    attribute, a property of its class, a name its ``attribute_map`` renames; none: 0 (the fast miss)."""
    from transformers import LlamaConfig

    class Layer(torch.nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.config, self.layer_idx = config, layer_idx

    plain = LlamaConfig()
    assert attention.layer_chunk(Layer(plain, 0)) == 0
    chunked = LlamaConfig(attention_chunk_size=8)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    assert [attention.layer_chunk(Layer(chunked, i)) for i in range(3)] == [8, 0, 0]

    class PropertyConfig(LlamaConfig):
        @property
        def layer_types(self):
            return ["full_attention", "chunked_attention"]

    assert attention.layer_chunk(Layer(PropertyConfig(attention_chunk_size=4), 1)) == 4

    class MappedConfig(LlamaConfig):
        attribute_map = {**LlamaConfig.attribute_map, "layer_types": "kinds"}

    mapped = MappedConfig(attention_chunk_size=2)
    mapped.kinds = ["chunked_attention"]
    assert attention.layer_chunk(Layer(mapped, 0)) == 2
    assert attention.layer_chunk(Layer(None, 0)) == 0

    class AnsweringConfig:  # a config of its own that answers attributes itself
        attention_chunk_size = 3

        def __getattr__(self, name):
            if name == "layer_types":
                return ["chunked_attention"]
            raise AttributeError(name)

    assert attention.layer_chunk(Layer(AnsweringConfig(), 0)) == 3
