"""Runs the model on one packed step against the paged KV cache."""

from __future__ import annotations

import torch

from hfaccel.engine.batch import StepInputs
from hfaccel.kernels.metadata import AttentionBackend
from hfaccel.patches.attention import METADATA_KWARG, engine_attention, register_attention


class ModelRunner:
    """Owns the KV cache (one ``[num_blocks, block_size, Hkv, D]`` pair per layer) and the forward call."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
    ) -> None:
        register_attention()
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = next(model.parameters()).device
        num_layers, num_kv_heads, head_dim = kv_shape(model)
        # Zeroed, not empty: masked-out slots are still read by SDPA, and NaN garbage would leak through.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
            )
            for _ in range(num_layers)
        ]

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Forward one packed step; returns the ``[N, V]`` logits of the sampled positions."""
        meta = inputs.metadata
        meta.kv_caches = self.kv_caches
        meta.backend = self.backend
        self.backend.prepare(meta)
        with engine_attention(self.model):
            output = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.position_ids,
                use_cache=False,
                logits_to_keep=inputs.logits_indices,
                **{METADATA_KWARG: meta},
            )
        return output.logits[0]


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder: GQA-aware, so the cache holds only the KV heads."""
    config = model.config.get_text_config(decoder=True)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers."""
    num_layers, num_kv_heads, head_dim = kv_shape(model)
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
