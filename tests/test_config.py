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
        ("kv_cache_memory", -5, "kv_cache_memory in bytes must be positive"),
        ("kv_cache_memory", "1GB", "kv_cache_memory must be bytes"),
        ("backend", "cuda-magic", "backend must be one of"),
        ("dtype", "float8", "dtype must be a torch.dtype or one of"),
        ("max_model_len", 0, "max_model_len must be a positive integer"),
        ("block_size", True, "block_size must be a positive integer"),
        ("dtype", torch.int8, r"dtype torch.int8 cannot hold a KV cache"),
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
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig().with_overrides(block_size=-1)


def test_kv_dtype_follows_model_unless_set():
    assert EngineConfig().kv_dtype(torch.bfloat16) is torch.bfloat16
    assert EngineConfig(dtype="float16").kv_dtype(torch.float32) is torch.float16
    assert EngineConfig(dtype=torch.float32).kv_dtype(torch.bfloat16) is torch.float32
