"""Tensor parallelism (TP) and sequence parallelism (SP) for serving, on torch's DTensor.

The model is sharded with ``torch.distributed.tensor.parallel.parallelize_module`` and torch's own
styles (`ColwiseParallel`, `RowwiseParallel`, `PrepareModuleInput`, `PrepareModuleOutput`); which module
gets which style comes from the model's Hugging Face plan (`hfaccel/patches/tp_plan.py`). Every style
hands on local tensors (``use_local_output=True``), so an attention layer sees only its rank's heads and
the paged KV cache holds only the rank's KV heads.

Sequence parallelism shards the token dimension of the residual stream (the norms, the residual adds)
between the attention and MLP blocks, and only in steps that hold prefill tokens: the seed's rule is
that SP is invalid for single-token decode. So the SP styles here are *gated per step*: the executor
decides, from the step's metadata, whether the step is a sequence-parallel one (`sequence_parallel_step`)
and the styles consult that flag at every call (`sequence_parallel_active`). In a decode-only step they
are pass-throughs and the model runs plain TP; in a prefill step the layouts change:

    embed_tokens (vocab-sharded)   all-reduce -> Replicate        | reduce-scatter -> Shard(1) (tokens)
    self_attn / mlp inputs         (already replicated)           | all-gather Shard(1) -> Replicate
    o_proj / down_proj (rowwise)   all-reduce -> Replicate        | reduce-scatter -> Shard(1)
    final norm output              (already replicated)           | all-gather Shard(1) -> Replicate

(an all-reduce is a reduce-scatter plus an all-gather: SP moves the same bytes as TP, and the norms and
residual adds run on 1/N of the tokens). A prefill step's packed tokens are padded to a multiple of N by
the runner (padded tokens have slot -1: they write no KV and are read by nobody).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from hfaccel.distributed.world import init_world

_local = threading.local()


@dataclass
class TPState:
    """How a model is sharded: kept in the model's layout (``parallel_layout(model).tp``) while it is
    sharded.

    Attributes:
        mesh: the 1-D device mesh of the tensor-parallel group.
        size: ranks in the group (N).
        rank: this process's rank within the group.
        src: the global rank of the group's rank 0 (it samples for everyone).
        sequence_parallel: shard the token dimension in prefill steps.
        sharded_by: ``"hfaccel"`` (`parallelize_module` at patch time) or ``"transformers"`` (at load).
        kv_replicated: KV heads fewer than N: each rank holds a copy of the KV head its query heads use.
        heads_gathered: the attention projections gather their outputs (OLMo 2's plan, which norms q and
            k across all heads): every rank's attention runs every head.
    """

    mesh: Any
    size: int
    rank: int
    src: int
    sequence_parallel: bool
    sharded_by: str
    kv_replicated: bool = False
    heads_gathered: bool = False

    @property
    def group(self) -> Any:
        return self.mesh.get_group()


# ----------------------------------------------------------------------------------- process group / mesh


def tp_mesh(tensor_parallel_size: int | None, device_mesh: Any, device: torch.device) -> Any:
    """The 1-D mesh to shard over: `device_mesh` itself, or one of `tensor_parallel_size` ranks.

    Without a process group, one is started from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``); with neither, ValueError. A world larger than N is split into groups of N
    consecutive ranks (each group serves independently: data parallel replicas).
    """
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"device_mesh must be a 1-D DeviceMesh (the tensor-parallel dimension), got {device_mesh.ndim}-D; "
                "pass mesh['tp']"
            )
        if tensor_parallel_size is not None and tensor_parallel_size != device_mesh.size():
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} disagrees with the device_mesh of size "
                f"{device_mesh.size()}"
            )
        return device_mesh
    n = tensor_parallel_size
    world = init_world(n, "tensor_parallel_size", device)
    from torch.distributed.device_mesh import init_device_mesh

    if n == world:
        return init_device_mesh(device.type, (n,), mesh_dim_names=("tp",))
    return init_device_mesh(device.type, (world // n, n), mesh_dim_names=("dp", "tp"))["tp"]


def check_world_size(tensor_parallel_size: Any) -> None:
    """A usable ``tensor_parallel_size`` (an int >= 1), or ValueError."""
    n = tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    if dist.is_initialized() and n > dist.get_world_size():
        raise ValueError(
            f"tensor_parallel_size={n} is larger than the world ({dist.get_world_size()} processes)"
        )
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ and n > int(os.environ["WORLD_SIZE"]):
        raise ValueError(
            f"tensor_parallel_size={n} is larger than the world ({os.environ['WORLD_SIZE']} processes)"
        )


def group_src(mesh: Any) -> int:
    """The global rank of the mesh's first rank."""
    return int(mesh.mesh.flatten()[0])


# ----------------------------------------------------------------------------------- the per-step SP flag


@contextmanager
def sequence_parallel_step(active: bool) -> Iterator[None]:
    """Within the block (one model forward), the gated SP styles shard tokens iff `active`."""
    previous = getattr(_local, "sp", False)
    _local.sp = active
    try:
        yield
    finally:
        _local.sp = previous


def sequence_parallel_active() -> bool:
    """Whether the forward running in this thread is a sequence-parallel (prefill) step."""
    return getattr(_local, "sp", False)


# ----------------------------------------------------------------------------------- the styles

_REPLICATE, _TOKENS = Replicate(), Shard(1)  # the packed step is [1, T, hidden]: tokens are dimension 1


class PrefillRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` whose partial output is all-reduced (Replicate) in a TP step and
    reduce-scattered over the tokens (Shard(1)) in a sequence-parallel step."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if sequence_parallel_active():
            output_layouts = (_TOKENS,)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class PrefillGatherInput(PrepareModuleInput):
    """`PrepareModuleInput` Shard(1) -> Replicate of a block's ``hidden_states`` (positional or keyword),
    in sequence-parallel steps only: the attention and MLP blocks see every token of the step."""

    def __init__(self) -> None:
        super().__init__(input_layouts=(_TOKENS,), desired_input_layouts=(_REPLICATE,), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.register_forward_pre_hook(partial(self._gate, device_mesh), with_kwargs=True)
        return module

    def _gate(self, mesh: Any, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if not sequence_parallel_active():
            return None
        if args:
            args = (self._prepare_input_arg(args[0], mesh, _TOKENS, _REPLICATE), *args[1:])
        else:
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = self._prepare_input_arg(
                kwargs["hidden_states"], mesh, _TOKENS, _REPLICATE
            )
        return args, kwargs


class PrefillGatherOutput(PrepareModuleOutput):
    """`PrepareModuleOutput` Shard(1) -> Replicate, in sequence-parallel steps only (after the final norm:
    the LM head picks the sampled rows by their packed positions)."""

    def __init__(self) -> None:
        super().__init__(
            output_layouts=(_TOKENS,), desired_output_layouts=(_REPLICATE,), use_local_output=True
        )

    def _prepare_out_fn(self, outputs: Any, device_mesh: Any) -> Any:
        if not sequence_parallel_active():
            return outputs
        return super()._prepare_out_fn(outputs, device_mesh)


class ReplicatedKVHead(ParallelStyle):
    """For KV heads fewer than N (N a multiple of them): the rank keeps the one KV head its query heads
    attend with, as serving engines do (rank r holds KV head ``r // (N / Hkv)``), in plain tensors: the
    projection's output stays on the rank, so no communication is needed."""

    def __init__(self, num_kv_heads: int, head_dim: int, size: int, rank: int, src: int) -> None:
        super().__init__()
        self.head = rank // (size // num_kv_heads)
        self.head_dim = head_dim
        self.src = src

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        rows = slice(self.head * self.head_dim, (self.head + 1) * self.head_dim)
        with torch.no_grad():
            for name in ("weight", "bias"):
                param = getattr(module, name, None)
                if param is None:
                    continue
                full = param.detach().clone()
                # Rank 0's weights, as parallelize_module's styles take them.
                dist.broadcast(full, src=self.src, group=device_mesh.get_group())
                setattr(module, name, nn.Parameter(full[rows].clone(), requires_grad=param.requires_grad))
        module.out_features = self.head_dim
        return module


# ----------------------------------------------------------------------------------- the local runtime


def forget_dtensor_shardings() -> None:
    """Empty the DTensor caches that `parallelize_module` filled: sharding propagation (this thread's, in
    Python and in C++, and the tensor-meta one), redistribution plans and planners, and mesh topology.

    Their entries hold DTensorSpecs or the DeviceMesh itself, and a DeviceMesh holds its process groups:
    cached, they outlive ``destroy_process_group``, and gloo then tears them down with their threads at
    interpreter exit, which could abort the process (docs/parallelism.md). Once `run_locally`
    (`patches/tp_modules.py`) has switched
    the shards to local tensors no DTensor op needs them.
    """
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    topology = getattr(_collective_utils, "MeshTopoInfo", None)
    for cache in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(type(propagator), "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(topology, "build_from_mesh", None),
    ):
        clear = getattr(cache, "cache_clear", None)
        if clear is not None:  # private torch internals: where one is absent, it pins nothing
            clear()
    for clear in (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ fast path's
        getattr(_redistribute, "clear_redistribute_planner_cache", None),  # planners hold the mesh
    ):
        if clear is not None:
            clear()


# Collective calls and seconds spent in them (waiting for the other ranks included), for benchmarks.
comm_stats = {"calls": 0, "seconds": 0.0}


@contextmanager
def _timed() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        comm_stats["calls"] += 1
        comm_stats["seconds"] += time.perf_counter() - start


def all_reduce(y: torch.Tensor, tp: TPState) -> torch.Tensor:
    y = y.contiguous()
    with _timed():
        dist.all_reduce(y, group=tp.group)
    return y


def reduce_scatter_tokens(y: torch.Tensor, tp: TPState) -> torch.Tensor:
    """``[1, T, H]`` partial sums -> this rank's ``[1, T/N, H]`` token rows, summed."""
    batch, tokens, *rest = y.shape
    full = y.reshape(batch * tokens, *rest).contiguous()
    out = full.new_empty((full.shape[0] // tp.size, *rest))
    with _timed():
        dist.reduce_scatter_tensor(out, full, group=tp.group)
    return out.view(batch, tokens // tp.size, *rest)


def gather_last(y: torch.Tensor, tp: TPState) -> torch.Tensor:
    """Every rank's last-dimension shard, concatenated in rank order."""
    y = y.contiguous()
    out = y.new_empty((tp.size * y.shape[0], *y.shape[1:]))  # ranks' tensors stacked on dimension 0
    with _timed():
        dist.all_gather_into_tensor(out, y, group=tp.group)
    return torch.cat(out.chunk(tp.size, dim=0), dim=-1)
