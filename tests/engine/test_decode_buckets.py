"""Decode buckets and the CUDA-graph key: the parts of the compiled/graphed decode path a CPU can check."""

import pytest
import torch

from hfaccel.config import EngineConfig
from hfaccel.engine.decode_buckets import CapturedDecodeGraphs, GraphKey, choose_bucket, warmup_layout
from hfaccel.kernels import StepLayout, TorchPagedAttention


def decode_layout(n: int) -> StepLayout:
    return StepLayout([1] * n, [5] * n, [[i] for i in range(n)], [i * 16 + 4 for i in range(n)], n)


def test_default_buckets_follow_powers_of_two_then_multiples_of_eight():
    assert EngineConfig().decode_buckets == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert EngineConfig(max_num_seqs=12).decode_buckets == (1, 2, 4, 8, 12)
    assert EngineConfig(max_num_seqs=8, cuda_graph_sizes=(4, 2, 2)).decode_buckets == (2, 4)


def test_bad_bucket_sizes_are_refused():
    with pytest.raises(ValueError, match="cuda_graph_sizes .* above max_num_seqs"):
        EngineConfig(max_num_seqs=8, cuda_graph_sizes=(4, 16))
    with pytest.raises(ValueError, match="compile must be one of"):
        EngineConfig(compile="yes")


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_a_decode_step_takes_the_smallest_bucket_it_fits(n, bucket):
    assert choose_bucket(decode_layout(n), (1, 2, 4, 8)) == bucket


def test_steps_with_prefill_tokens_never_take_a_bucket():
    mixed = StepLayout([1, 3], [5, 3], [[0], [1]], [4, 16, 17, 18], 1)
    assert choose_bucket(mixed, (1, 2, 4, 8)) is None
    assert choose_bucket(warmup_layout(), (1, 2)) is None


def test_padding_to_a_bucket_reuses_the_buffers_and_writes_nowhere():
    backend = TorchPagedAttention()
    builder = backend.make_builder(8, 8, 4, 16, torch.device("cpu"), num_blocks=8)
    a = builder.build(decode_layout(3), 4, 4).common
    b = builder.build(decode_layout(1), 4, 4).common
    assert a.slot_mapping.data_ptr() == b.slot_mapping.data_ptr() and b.slot_mapping.shape == (4,)
    assert b.slot_mapping.tolist() == [4, -1, -1, -1] and b.seq_lens.tolist() == [5, 0, 0, 0]
    assert b.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_fixed_width_keeps_the_block_table_shape_a_graph_baked_in():
    builder = TorchPagedAttention().make_builder(8, 8, 6, 16, torch.device("cpu"), num_blocks=8)
    builder.fixed_width = 6
    assert builder.build(decode_layout(2), 4, 4).common.block_tables.shape == (4, 6)


def test_graph_key_names_every_baked_value():
    base = GraphKey(8, 64, "triton", torch.float16)
    assert base == GraphKey(8, 64, "triton", torch.float16)
    for other in (
        GraphKey(16, 64, "triton", torch.float16),
        GraphKey(8, 32, "triton", torch.float16),
        GraphKey(8, 64, "flashinfer", torch.float16),
        GraphKey(8, 64, "triton", torch.bfloat16),
    ):
        assert other != base


def test_replaying_a_key_never_captured_is_an_error_not_a_wrong_graph():
    graphs = CapturedDecodeGraphs()
    assert GraphKey(8, 64, "triton", torch.float16) not in graphs
    with pytest.raises(KeyError):
        graphs.replay(GraphKey(8, 64, "triton", torch.float16))


def test_cuda_graphs_on_a_cpu_are_skipped_not_an_error(llama):
    from hfaccel.engine.engine import Engine

    engine = Engine(llama, EngineConfig(cuda_graphs=True, kv_cache_memory=1_000_000))
    assert engine.runner.cuda_graphs is False


def test_a_graphed_runner_plans_flashinfer_buckets_on_fixed_buffer_wrappers(monkeypatch):
    # A graph replays the buffers its bucket's plan wrote: the runner must hand its buckets to the
    # builder, or every step is planned on the shared wrapper, whose plan() rebinds fresh tensors.
    import sys
    import types

    from hfaccel.engine.runner import ModelRunner
    from hfaccel.kernels.flashinfer_backend import FlashInferPagedAttention
    from tests.kernels.test_flashinfer_backend import FakeDecodeWrapper, FakePrefillWrapper

    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(ModelRunner, "_no_graphs_reason", staticmethod(lambda executor, backend: None))
    executor = types.SimpleNamespace(
        device=torch.device("cpu"),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_layers=1,
        attention_scale=0.25,
    )
    runner = ModelRunner(
        executor, FlashInferPagedAttention(), 16, 16, torch.bfloat16, 8, 64, 4,
        cuda_graphs=True, decode_buckets=(1, 2, 4, 8),
    )  # fmt: skip
    assert runner.builder.cuda_graph_batch_sizes == {1, 2, 4, 8}
    meta = runner.builder.build(decode_layout(3), 4, 4)
    assert meta.cuda_graph and meta.decode_wrapper is runner.builder.decode_wrapper_for(4)
    assert meta.decode_wrapper.use_cuda_graph and meta.mask_padded_decodes


def test_a_model_change_drops_captured_graphs_even_without_prefix_caching(monkeypatch):
    # A graph replays the weights' addresses and the adapters' control flow as they were at capture:
    # once the model changes (here a weight replaced, as load_state_dict(assign=True) does), none may
    # replay. Graphs cannot be captured on a CPU: the engine is told graphs are possible, and the test
    # plants a stand-in graph where a capture would have put one.
    from hfaccel.engine.engine import Engine
    from hfaccel.engine.runner import ModelRunner
    from tests.helpers import tiny_model

    monkeypatch.setattr(ModelRunner, "_no_graphs_reason", staticmethod(lambda executor, backend: None))
    model = tiny_model("llama")
    engine = Engine(
        model, EngineConfig(cuda_graphs=True, enable_prefix_caching=False, kv_cache_memory=1_000_000)
    )
    assert engine.runner.cuda_graphs
    key = GraphKey(1, engine.runner.max_blocks_per_seq, engine.runner.backend.name, torch.float32)
    engine.runner.graphs._graphs[key] = ("graph", torch.zeros(1))
    assert not engine.check_model_state() and key in engine.runner.graphs  # nothing changed: kept
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(0.5)  # an optimizer step in place: the same tensors at the same addresses
    assert engine.check_model_state() and key in engine.runner.graphs  # a graph reads the new values
    weight.data = weight.data.clone()
    assert engine.check_model_state() and len(engine.runner.graphs) == 0
    engine.runner.graphs._graphs[key] = ("graph", torch.zeros(1))
    model.train()  # dropout: another forward
    assert engine.check_model_state() and len(engine.runner.graphs) == 0
    model.eval()
    engine.check_model_state()
    engine.runner.graphs._graphs[key] = ("graph", torch.zeros(1))
    engine.forget_model_outputs()  # what hfaccel.reset_prefix_cache(model) calls
    assert len(engine.runner.graphs) == 0


class _FakeCuda:
    """torch.cuda's graph API as a CPU can run it: a capture runs its body once, a replay does nothing
    (enough to check which tensors a capture keeps, not what a replay computes)."""

    class CUDAGraph:
        def replay(self):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

    @staticmethod
    def graph_pool_handle():
        return object()

    @staticmethod
    def current_stream():
        return _FakeCuda.Stream()

    class stream:  # noqa: N801 (torch.cuda.stream is a class)
        def __init__(self, s):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class graph(stream):  # noqa: N801
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            assert capture_error_mode == "thread_local"


def test_every_graph_writes_its_logits_into_one_shared_buffer(monkeypatch):
    # A graph's own output, kept alive, would pin its memory in the pool: all graphs copy into the
    # first rows of one buffer made outside the captures, and only those views are kept.
    for name in ("CUDAGraph", "Stream", "graph_pool_handle", "current_stream", "stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(_FakeCuda, name))
    graphs = CapturedDecodeGraphs(max_rows=8)
    made = []

    def logits(rows):
        def run():
            made.append(torch.full((rows, 5), float(rows)))
            return made[-1]

        return run

    for bucket in (8, 2, 4):
        graphs.capture(GraphKey(bucket, 4, "triton", torch.float32), logits(bucket))
    views = [graphs.replay(GraphKey(b, 4, "triton", torch.float32)) for b in (8, 2, 4)]
    assert [v.shape for v in views] == [(8, 5), (2, 5), (4, 5)]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one buffer
    assert all(
        not any(v.untyped_storage().data_ptr() == m.untyped_storage().data_ptr() for m in made) for v in views
    )
    assert torch.equal(views[2], torch.full((4, 5), 4.0))  # the last capture's copy
    # a wider output (another vocabulary) gets a buffer of its own; older graphs keep theirs
    graphs.capture(GraphKey(16, 4, "triton", torch.float32), lambda: torch.ones(16, 7))
    wide = graphs.replay(GraphKey(16, 4, "triton", torch.float32))
    assert (
        wide.shape == (16, 7) and wide.untyped_storage().data_ptr() != views[0].untyped_storage().data_ptr()
    )
    graphs.clear()
    assert len(graphs) == 0 and graphs._output is None


def test_a_step_that_cannot_be_captured_turns_graphs_off_and_runs_without(monkeypatch, caplog):
    # A host sync or a data-dependent shape makes CUDA refuse a capture: the engine warns once and goes
    # on without graphs (the same tokens), rather than failing every decode step.
    import logging

    from hfaccel.engine.engine import Engine
    from hfaccel.engine.request import StoppingParams
    from hfaccel.engine.runner import ModelRunner
    from tests.helpers import hf_greedy, tiny_model

    class RefusingGraph(_FakeCuda.graph):
        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    for name in ("CUDAGraph", "Stream", "graph_pool_handle", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(_FakeCuda, name))
    monkeypatch.setattr(torch.cuda, "graph", RefusingGraph)
    monkeypatch.setattr(ModelRunner, "_no_graphs_reason", staticmethod(lambda executor, backend: None))
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(cuda_graphs=True, max_num_seqs=4, kv_cache_memory=2_000_000))
    prompts = [[5, 17, 33], [7, 8]]
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        requests = [engine.add_request(p, StoppingParams(max_new_tokens=5)) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
    assert [r.output_token_ids for r in requests] == [hf_greedy(model, p, 5) for p in prompts]
    assert not engine.runner.cuda_graphs and len(engine.runner.graphs) == 0
    assert sum("CUDA graphs turned off" in r.getMessage() for r in caplog.records) == 1
