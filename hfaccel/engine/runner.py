"""Runs one packed step: persistent input buffers, the paged KV cache, the backend's metadata, the model.

Everything a step needs on the device lives in buffers allocated once per engine (a pinned host
mirror plus a device copy on CUDA) and filled in place: token ids, positions, the sampled positions,
and, through the backend's builder, the attention metadata. The model is reached only through the
`ModelExecutor` interface, inside a forward context that tells every layer's attention op the step.
"""

from __future__ import annotations

import torch

from hfaccel.engine.batch import PackedStep
from hfaccel.engine.executor import ModelExecutor
from hfaccel.kernels.context import ForwardContext, forward_context
from hfaccel.kernels.metadata import AttentionBackend


class ModelRunner:
    """Owns the KV cache (one ``(k_cache, v_cache)`` pair per layer), the step buffers and the forward."""

    def __init__(
        self,
        executor: ModelExecutor,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.executor = executor
        self.backend = backend
        self.block_size = block_size
        self.device = executor.device
        self.max_num_tokens = max_num_tokens
        shape = backend.kv_cache_shape(num_blocks, block_size, executor.num_kv_heads, executor.head_dim)
        # Zeroed, not empty: masked-out slots may still be read, and NaN garbage would leak through.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
            )
            for _ in range(executor.num_layers)
        ]
        self.builder = backend.make_builder(
            max_num_seqs, max_num_tokens, max_blocks_per_seq, block_size, self.device, num_blocks=num_blocks
        )
        configure = getattr(self.builder, "configure", None)
        if configure is not None:  # backends that plan on the host need the attention geometry once
            configure(
                executor.num_q_heads,
                executor.num_kv_heads,
                executor.head_dim,
                kv_dtype,
                executor.attention_scale,
            )
        pin = self.device.type == "cuda"
        self._host = {
            "input_ids": torch.zeros((1, max_num_tokens), dtype=torch.long, pin_memory=pin),
            "positions": torch.zeros((1, max_num_tokens), dtype=torch.long, pin_memory=pin),
            "logits_indices": torch.zeros((max_num_seqs,), dtype=torch.long, pin_memory=pin),
        }
        self._dev = (
            self._host
            if self.device.type == "cpu"
            else {n: torch.zeros_like(t, device=self.device) for n, t in self._host.items()}
        )
        # The host buffers are pinned and copied asynchronously: the next step may rewrite them only once
        # the previous step's copies have left them.
        self._copied: torch.cuda.Event | None = None

    def _stage(self, name: str, values: list[int], size: int | None = None) -> torch.Tensor:
        """Copy `values` into buffer `name` in place; the device view of its first `size` entries."""
        size = len(values) if size is None else size
        host = self._host[name]
        flat = host.view(-1).numpy()
        flat[: len(values)] = values
        flat[len(values) : size] = 0  # padding: a valid token id / position, its output is ignored
        if host.dim() == 2:
            host_view, dev_view = host[:, :size], self._dev[name][:, :size]
        else:
            host_view, dev_view = host[:size], self._dev[name][:size]
        if dev_view is not host_view:
            dev_view.copy_(host_view, non_blocking=True)
        return dev_view

    @torch.inference_mode()
    def run(self, packed: PackedStep) -> torch.Tensor:
        """Forward one packed step; returns the ``[N, V]`` logits of the sampled positions."""
        if self._copied is not None:
            self._copied.synchronize()
        input_ids = self._stage("input_ids", packed.input_ids)
        positions = self._stage("positions", packed.positions)
        logits_indices = self._stage("logits_indices", packed.logits_indices)
        metadata = self.builder.build(packed.layout)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        with forward_context(ForwardContext(self.backend, metadata, self.kv_caches)):
            return self.executor.forward(input_ids, positions, logits_indices)


def kv_bytes_per_token(executor: ModelExecutor, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers."""
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * executor.num_layers * executor.num_kv_heads * executor.head_dim * size
