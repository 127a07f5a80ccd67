"""FlashInfer paged attention: ``BatchDecodeWithPagedKVCacheWrapper`` for decodes,
``BatchPrefillWithPagedKVCacheWrapper`` for prefill chunks (a cached prefix plus new tokens).

This module imports without flashinfer (``flashinfer`` is imported lazily, where a wrapper is made), so
`FlashInferPagedAttention.unavailable_reason` can say what is missing and the host-side planning is
tested on the CPU.

One step, host side (`FlashInferMetadataBuilder.build`, outside any graph): the common buffers are
filled, the plan inputs are computed from the host mirrors (`hfaccel.kernels.flashinfer_plan`), and each
wrapper's ``plan`` runs once; every layer then reuses the plan. Device side (`FlashInferPagedAttention
.forward`, graph-safe): a fixed-shape ``index_copy_`` writes this step's K/V, then ``run`` of the decode
wrapper on the first rows and of the prefill wrapper on the rest.

CUDA graphs: a wrapper made with ``use_cuda_graph=True`` owns fixed ``indptr`` / ``indices`` /
``last_page_len`` buffers sized for one batch size, which its ``plan`` rewrites in place; so there is
one such decode wrapper per captured batch size (`FlashInferMetadataBuilder.decode_wrapper_for`), as
in vLLM and SGLang, all sharing one workspace. Declare the captured sizes with ``configure``.

Versions: the calls here were checked against flashinfer-python 0.2.2 to 0.7.2.post1 (see
``docs/flashinfer.md``); others are refused by `FlashInferPagedAttention.unavailable_reason`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.kernels.flashinfer_plan import decode_plan_inputs, prefill_plan_inputs
from hfaccel.kernels.metadata import (
    AttentionBackend,
    AttentionMetadata,
    BackendCapabilities,
    MetadataBuilder,
    StepLayout,
)
from hfaccel.kernels.torch_paged import write_kv

# The flashinfer-python releases whose wrapper API this backend was checked against.
SUPPORTED_VERSIONS = ">=0.2.2,<0.8"
INSTALL_HINT = "pip install 'hfaccel[flashinfer]'"
WORKSPACE_BYTES = 128 * 1024 * 1024
KV_LAYOUT = "NHD"  # [num_blocks, block_size, Hkv, D]: the cache layout every hfaccel backend uses
# FlashInfer's CUDA-core decode kernels are compiled for GQA group sizes 1, 2, 3, 4 and 8 only; larger
# groups run the tensor-core (prefill) kernels, which are also the faster ones there (vLLM's rule).
MAX_CUDA_CORE_GROUP = 4


def installed_version() -> str | None:
    """The installed flashinfer-python version, or None when ``flashinfer`` cannot be found."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(getattr(importlib.import_module("flashinfer"), "__version__", "0+unknown"))


def version_supported(version: str) -> bool:
    """Whether flashinfer-python `version` is within `SUPPORTED_VERSIONS` (pre-releases included)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED_VERSIONS).contains(parsed, prereleases=True)


def _flashinfer() -> Any:
    return importlib.import_module("flashinfer")


@dataclass(frozen=True)
class PlanConfig:
    """What every ``plan`` call needs besides the step's layout (set once by ``configure``)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float

    @property
    def use_tensor_cores(self) -> bool:
        return self.num_qo_heads // self.num_kv_heads > MAX_CUDA_CORE_GROUP


@dataclass
class FlashInferMetadata:
    """The common metadata plus the planned wrappers of one step.

    Attributes:
        common: the step's layout in the persistent buffers.
        decode_wrapper: planned for the first ``num_decode_rows`` query rows (None: no decode rows).
        prefill_wrapper: planned for rows ``prefill_start:prefill_end`` (None: no prefill rows).
        num_decode_rows: decode sequences this step, padded ones included when a pure-decode step is
            padded to a bucket (one query row each).
        prefill_start, prefill_end: the packed rows of the prefill/extend sequences.
        write_slots: ``[T_pad]`` int64 cache slots to write K/V to (a view of a persistent buffer);
            padding goes to the scratch block past the usable ones.
        sm_scale: the softmax scale the wrappers were planned with.
        mask_padded_decodes: zero the decode rows of padded sequences (length 0) after ``run``.
        cuda_graph: the decode wrapper is the fixed-size one of a CUDA-graph bucket.
        zero_fill: some output rows are computed by neither wrapper (padding): start from zeros.
    """

    common: AttentionMetadata
    decode_wrapper: Any
    prefill_wrapper: Any
    num_decode_rows: int
    prefill_start: int
    prefill_end: int
    write_slots: torch.Tensor
    sm_scale: float
    mask_padded_decodes: bool = False
    cuda_graph: bool = False
    zero_fill: bool = False


class FlashInferMetadataBuilder(MetadataBuilder):
    """Plans FlashInfer's wrappers once per step; made once per engine (it owns the workspace).

    Call `configure` once, before the first `build`, with the model's attention shape and scale (the
    runner does it, for builders that have the method): FlashInfer bakes the heads, head_dim, dtypes
    and softmax scale into ``plan``.
    """

    def __init__(
        self,
        *args: Any,
        workspace_bytes: int = WORKSPACE_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # FlashInfer wants the float workspace zeroed before its first use; all wrappers share it (one
        # runs at a time on the stream), each wrapper adds its own small int workspace.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.config: PlanConfig | None = None
        self.cuda_graph_batch_sizes: frozenset[int] = frozenset()
        self._decode_wrapper: Any = None
        self._prefill_wrapper: Any = None
        self._graph_decode_wrappers: dict[int, Any] = {}

    def configure(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
        cuda_graph_batch_sizes: tuple[int, ...] | list[int] | frozenset[int] = (),
    ) -> None:
        """Set the model's attention shape, once, before the first `build`.

        Args:
            num_qo_heads, num_kv_heads, head_dim: per-layer attention shape (on this rank).
            dtype: query and KV cache dtype.
            scale: softmax scale every layer's ``forward`` will pass (default ``head_dim ** -0.5``);
                FlashInfer takes it at plan time, so ``forward`` refuses any other.
            cuda_graph_batch_sizes: decode batch sizes captured in CUDA graphs; a pure-decode step
                padded to one of them is planned on that size's fixed-buffer wrapper.
        """
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{num_qo_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        config = PlanConfig(
            num_qo_heads, num_kv_heads, head_dim, dtype, head_dim**-0.5 if scale is None else float(scale)
        )
        if self.config is not None and config != self.config:
            raise ValueError(f"builder already configured with {self.config}, not {config}")
        sizes = frozenset(int(s) for s in cuda_graph_batch_sizes)
        if any(not 1 <= s <= self.max_num_seqs for s in sizes):
            raise ValueError(f"CUDA-graph batch sizes {sorted(sizes)} must lie in 1..{self.max_num_seqs}")
        self.config = config
        self.cuda_graph_batch_sizes = sizes

    def _require_config(self) -> PlanConfig:
        if self.config is None:
            raise RuntimeError("FlashInferMetadataBuilder.configure(...) must be called before build()")
        return self.config

    @property
    def prefill_wrapper(self) -> Any:
        """The prefill/extend wrapper (made on first use)."""
        if self._prefill_wrapper is None:
            self._prefill_wrapper = _flashinfer().BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, KV_LAYOUT
            )
        return self._prefill_wrapper

    @property
    def decode_wrapper(self) -> Any:
        """The decode wrapper for steps run outside CUDA graphs (any batch size; made on first use)."""
        if self._decode_wrapper is None:
            self._decode_wrapper = _flashinfer().BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, KV_LAYOUT, use_tensor_cores=self._require_config().use_tensor_cores
            )
        return self._decode_wrapper

    def decode_wrapper_for(self, batch_size: int) -> Any:
        """The CUDA-graph decode wrapper of `batch_size` (made once, with its fixed buffers on the device).

        Its ``plan`` copies each step's ``indptr`` / ``indices`` / ``last_page_len`` into those buffers,
        which the captured graph reads; ``batch_size`` can never change for it.
        """
        if not 1 <= batch_size <= self.max_num_seqs:
            raise ValueError(f"CUDA-graph batch size {batch_size} outside 1..{self.max_num_seqs}")
        wrapper = self._graph_decode_wrappers.get(batch_size)
        if wrapper is None:
            device = self.device
            wrapper = _flashinfer().BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                KV_LAYOUT,
                use_cuda_graph=True,
                use_tensor_cores=self._require_config().use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(
                    batch_size * self.max_blocks_per_seq, dtype=torch.int32, device=device
                ),
                paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=device),
            )
            self._graph_decode_wrappers[batch_size] = wrapper
        return wrapper

    def build(
        self, layout: StepLayout, num_padded_seqs: int | None = None, num_padded_tokens: int | None = None
    ) -> FlashInferMetadata:
        config = self._require_config()
        common = self.build_common(layout, num_padded_seqs, num_padded_tokens)
        b, b_pad = common.num_seqs, common.num_padded_seqs
        t, t_pad = common.num_tokens, common.num_padded_tokens
        nd = common.num_decodes
        if common.num_decode_tokens != nd:
            raise ValueError("FlashInfer's decode path takes one query token per sequence")

        # K/V write slots: one fixed-shape index_copy_ per layer, padding sent to the scratch block.
        write_slots = self.write_slots(common)

        # Padded sequences ride the decode path of a pure-decode step (a CUDA-graph bucket), one row each.
        pure_decode = nd == b
        num_decode_rows = b_pad if pure_decode and t_pad - t >= b_pad - b else nd
        cuda_graph = pure_decode and num_decode_rows in self.cuda_graph_batch_sizes
        block_size = self.block_size
        decode_wrapper = None
        if num_decode_rows:
            indptr, indices, last_page_len = decode_plan_inputs(
                common.block_tables_cpu[:nd], common.seq_lens_cpu[:nd], block_size, batch_size=num_decode_rows
            )
            decode_wrapper = self.decode_wrapper_for(num_decode_rows) if cuda_graph else self.decode_wrapper
            decode_wrapper.plan(
                indptr,
                indices,
                last_page_len,
                config.num_qo_heads,
                config.num_kv_heads,
                config.head_dim,
                block_size,
                q_data_type=config.dtype,
                kv_data_type=config.dtype,
                sm_scale=config.scale,
            )
        prefill_wrapper = None
        if b > nd:
            qo_indptr, kv_indptr, kv_indices, kv_last_page_len = prefill_plan_inputs(
                layout.query_lens[nd:], common.block_tables_cpu[nd:b], common.seq_lens_cpu[nd:b], block_size
            )
            prefill_wrapper = self.prefill_wrapper
            prefill_wrapper.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                kv_last_page_len,
                config.num_qo_heads,
                config.num_kv_heads,
                config.head_dim,
                block_size,
                causal=True,  # FlashInfer's default is False
                sm_scale=config.scale,
                q_data_type=config.dtype,
                kv_data_type=config.dtype,
            )
        covered = num_decode_rows if pure_decode else t
        return FlashInferMetadata(
            common=common,
            decode_wrapper=decode_wrapper,
            prefill_wrapper=prefill_wrapper,
            num_decode_rows=num_decode_rows,
            prefill_start=common.num_decode_tokens,
            prefill_end=t,
            write_slots=write_slots,
            sm_scale=config.scale,
            # A captured graph must mask whatever padding a later replay brings.
            mask_padded_decodes=cuda_graph or num_decode_rows > nd,
            cuda_graph=cuda_graph,
            zero_fill=covered < t_pad,
        )


class FlashInferPagedAttention(AttentionBackend):
    """Paged attention on FlashInfer's batch decode and batch prefill wrappers (CUDA, fp16/bf16)."""

    name = "flashinfer"
    capabilities = BackendCapabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=frozenset({64, 128, 256}),
        devices=frozenset({"cuda"}),
        cuda_graph_decode=True,
        decode_query_len=1,
    )
    builder_class = FlashInferMetadataBuilder
    uses_scratch_block = True  # the K/V store is a fixed-shape index_copy_

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        version = installed_version()
        if version is None:
            return f"flashinfer-python is not installed ({INSTALL_HINT})"
        if not version_supported(version):
            return f"FlashInfer {version} is not supported (supported: {SUPPORTED_VERSIONS})"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return super().unavailable_reason(device, dtype, head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: FlashInferMetadata,
        scale: float,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            window > 0 or chunk > 0 or softcap > 0 or sinks is not None
        ):  # never given: not in its capabilities
            raise ValueError(
                "the flashinfer backend serves no sliding-window or chunked layers; use 'triton'"
            )
        if not math.isclose(scale, meta.sm_scale, rel_tol=1e-6):
            raise ValueError(
                f"FlashInfer was planned with softmax scale {meta.sm_scale}, not {scale}: pass the model's "
                "scale to FlashInferMetadataBuilder.configure"
            )
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, key, value, meta.write_slots)
        # Planned for queries in the cache's dtype (FlashInfer refuses others): a model computing in
        # another dtype (float32 over a bfloat16 cache) gets its output back in its own.
        model_dtype = query.dtype
        query = query.to(k_cache.dtype).contiguous()
        out = torch.zeros_like(query) if meta.zero_fill else torch.empty_like(query)
        n = meta.num_decode_rows
        if meta.decode_wrapper is not None:
            decoded = out[:n]
            meta.decode_wrapper.run(query[:n], (k_cache, v_cache), out=decoded)
            if meta.mask_padded_decodes:
                # A padded sequence has no page: releases up to 0.6.17 divide 0 by 0 there (NaN).
                decoded.masked_fill_((meta.common.seq_lens[:n] == 0)[:, None, None], 0)
        if meta.prefill_wrapper is not None:
            rows = slice(meta.prefill_start, meta.prefill_end)
            meta.prefill_wrapper.run(query[rows], (k_cache, v_cache), out=out[rows])
        return out.to(model_dtype)
