import pytest
import torch

from hfaccel import EngineConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "block_size must be a positive integer"),
        ("max_num_seqs", -1, "max_num_seqs must be a positive integer"),
        ("max_num_batched_tokens", 0, "max_num_batched_tokens must be a positive integer"),
        ("max_num_batched_tokens", 8, r"max_num_batched_tokens \(8\) must be at least block_size \(16\)"),
        ("kv_cache_memory", 1.5, r"kv_cache_memory as a fraction must be in \(0, 1\]"),
        ("kv_cache_memory", 0.0, r"kv_cache_memory as a fraction must be in \(0, 1\]"),
        ("kv_cache_memory", -5, "kv_cache_memory in bytes must be more than 1"),
        ("kv_cache_memory", "1GB", "kv_cache_memory must be bytes"),
        ("backend", "cuda-magic", "backend must be one of"),
        ("dtype", "float8", "dtype must be a torch.dtype or one of"),
        ("max_model_len", 0, "max_model_len must be a positive integer"),
        ("max_model_len", 1, r"max_model_len must be at least 2 \(a prompt token and a new one\)"),
        ("block_size", True, "block_size must be a positive integer"),
        ("dtype", torch.uint8, r"dtype torch.uint8 cannot hold a KV cache"),
        ("dtype", torch.float8_e4m3fn, r"dtype torch.float8_e4m3fn cannot hold a KV cache"),
        ("dtype", torch.bool, r"dtype torch.bool cannot hold a KV cache"),
    ],
)
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_overrides_are_validated_and_unknown_fields_rejected():
    config = EngineConfig().with_overrides(block_size=32, max_num_batched_tokens=64)
    assert (config.block_size, config.max_num_batched_tokens) == (32, 64)
    with pytest.raises(
        ValueError,
        match=r"unknown EngineConfig field\(s\) \['blocksize'\] \(did you mean 'blocksize' -> 'block_size'",
    ):
        EngineConfig().with_overrides(blocksize=8)
    with pytest.raises(ValueError, match=r"\(did you mean 'kv_cache_dtype' -> 'dtype'\?\)"):  # vLLM's name
        EngineConfig().with_overrides(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig().with_overrides(block_size=-1)


def test_kv_dtype_follows_model_unless_set():
    assert EngineConfig().kv_dtype(torch.bfloat16) is torch.bfloat16
    assert EngineConfig(dtype="float16").kv_dtype(torch.float32) is torch.float16
    assert EngineConfig(dtype=torch.float32).kv_dtype(torch.bfloat16) is torch.float32


def test_parts_and_flat_keywords_are_one_config():
    from hfaccel.config import CacheConfig, SchedulerConfig

    flat = EngineConfig(max_num_seqs=8, block_size=32, tpot_target_ms=50)
    parts = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=8), cache=CacheConfig(block_size=32), tpot_target_ms=50
    )
    assert flat == parts and hash(flat) == hash(parts)
    assert flat.scheduler.max_num_seqs == flat.max_num_seqs == 8 and flat.latency.tpot_target_ms == 50
    # A flat keyword overrides the same knob of a given part; with_overrides takes either.
    assert EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8), max_num_seqs=4).max_num_seqs == 4
    assert flat.with_overrides(cache=CacheConfig(block_size=8)).block_size == 8
    assert flat.with_overrides(block_size=8).scheduler is flat.scheduler  # untouched parts are kept
    assert "max_num_seqs=8" in repr(flat) and set(EngineConfig.field_names()) >= {"block_size", "admission"}


def test_each_part_validates_itself_and_the_config_checks_across_parts():
    from hfaccel.config import CompilationConfig, LatencyConfig, ParallelConfig, SchedulerConfig

    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="admission must be one of"):
        LatencyConfig(admission="maybe")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"cuda_graph_sizes \(4, 8\) has sizes above max_num_seqs \(4\)"):
        EngineConfig(compilation=CompilationConfig(cuda_graph_sizes=(4, 8)), max_num_seqs=4)
    with pytest.raises(ValueError, match="scheduler must be a SchedulerConfig, got LatencyConfig"):
        EngineConfig(scheduler=LatencyConfig())
    with pytest.raises(ValueError, match=r"unknown EngineConfig field\(s\) \['blocksize'\] \(did you mean"):
        EngineConfig(blocksize=8)


def test_a_config_is_immutable_and_copies_whole():
    import copy
    import dataclasses
    import pickle

    config = EngineConfig(max_num_seqs=8, dtype=torch.bfloat16, cuda_graph_sizes=(8, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 4
    assert config.cuda_graph_sizes == (2, 8)
    assert pickle.loads(pickle.dumps(config)) == config == copy.deepcopy(config)


def test_patch_records_the_parallel_layout_and_keeps_it():
    import hfaccel
    from tests.helpers import tiny_model

    model = hfaccel.patch(tiny_model(), num_microbatches=2)
    state = model._hfaccel
    assert state.config.parallel.sizes["tensor_parallel_size"] is None and state.config.num_microbatches == 2
    hfaccel.patch(model, EngineConfig(num_microbatches=1))  # the layout stays, microbatches may change
    assert state.config.num_microbatches == 1
    with pytest.raises(ValueError, match="tensor_parallel_size is set at a model's first patch"):
        hfaccel.patch(model, EngineConfig(tensor_parallel_size=2))
    hfaccel.unpatch(model)
