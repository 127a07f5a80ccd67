"""The local tensor-parallel runtime: the sharded Linear and Embedding modules of a model that
`parallelize_module` sharded, switched to run on their local shards with one explicit collective each
(`distributed/tp.py` holds the collectives and the DTensor styles; this file rewrites the modules)."""

from __future__ import annotations

import fnmatch
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from hfaccel.distributed.tp import (
    TPState,
    all_reduce,
    gather_last,
    reduce_scatter_tokens,
    sequence_parallel_active,
)

REPLICATE = Replicate()


def matching_modules(model: nn.Module, pattern: str) -> list[nn.Module]:
    """The modules a `parallelize_module` plan key names (``*`` matches one name component)."""
    parts = pattern.split(".")
    found = []
    for name, module in model.named_modules():
        names = name.split(".") if name else []
        if len(names) == len(parts) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts)):
            found.append(module)
    return found


def run_locally(model: nn.Module, styles: dict[str, Any], tp: TPState) -> int:
    """After `parallelize_module`: run each sharded Linear and Embedding on its local shard with one
    explicit collective, instead of DTensor dispatch; returns how many modules were switched.

    DTensor computes the right thing but, on a CPU, dispatch costs about a millisecond per sharded op,
    and each new token count misses its sharding-propagation cache (about 200 ms for a 2-layer model): a
    serving engine sees a new token count at almost every step. The local runtime does exactly what the
    placements say — colwise: a local matmul (gathered on the last dimension where the output is
    Replicate); rowwise: a local matmul of the rank's input columns, then an all-reduce (a
    reduce-scatter over the tokens in a sequence-parallel step), then the bias; a vocab-sharded
    embedding: a masked local lookup, reduced the same way. Parameters become the local shards (plain
    tensors). The block-level SP styles (`PrefillGatherInput`, `PrefillGatherOutput`) stay as they are.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    switched = 0
    for pattern, style in styles.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        for module in matching_modules(model, pattern):
            if not isinstance(getattr(module, "weight", None), DTensor):
                continue
            module._forward_pre_hooks.clear()  # DTensor's input/output redistribution hooks
            module._forward_hooks.clear()
            for name, param in list(module.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    local = param.to_local().detach().clone()
                    setattr(module, name, nn.Parameter(local, requires_grad=False))
            for name, buffer in list(module.named_buffers(recurse=False)):  # (Gemma's embed_scale)
                if isinstance(buffer, DTensor) and all(p.is_replicate() for p in buffer.placements):
                    module.register_buffer(
                        name,
                        buffer.to_local().clone(),
                        persistent=name not in module._non_persistent_buffers_set,
                    )
            if isinstance(module, nn.Embedding):
                # Its class's own forward runs on the shard (`_lookup`), where a global padding row may
                # lie outside the local rows; the padding row only matters to gradients.
                module.padding_idx = None
            if isinstance(style, ColwiseParallel):
                gather = style.output_layouts[0] == REPLICATE
                module.forward = partial(_colwise_forward, module, gather, tp)
            else:
                split = style.input_layouts[0] == REPLICATE and isinstance(module, nn.Linear)
                module.forward = partial(_rowwise_forward, module, split, tp)
            switched += 1
    return switched


def _lookup(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The embedding's own forward on its local shard: a subclass's too (Gemma's scales the rows by the
    square root of the hidden size), which works row by row and column by column, so a shard of the
    table gives the shard of its output exactly."""
    return type(module).forward(module, ids)


def _colwise_forward(module: nn.Module, gather: bool, tp: TPState, x: torch.Tensor) -> torch.Tensor:
    embedding = isinstance(module, nn.Embedding)
    y = _lookup(module, x) if embedding else F.linear(x, module.weight, module.bias)
    return gather_last(y, tp) if gather else y


def _rowwise_forward(module: nn.Module, split: bool, tp: TPState, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, nn.Embedding):  # vocabulary rows [rank * V/N, (rank + 1) * V/N) live here
        rows = module.weight.shape[0]
        local = x - tp.rank * rows
        outside = (local < 0) | (local >= rows)
        y = _lookup(module, local.masked_fill(outside, 0))
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        bias = None
    else:
        if split:  # a replicated input: take this rank's columns
            x = x.chunk(tp.size, dim=-1)[tp.rank]
        y = F.linear(x, module.weight)
        bias = module.bias
    y = reduce_scatter_tokens(y, tp) if sequence_parallel_active() else all_reduce(y, tp)
    return y if bias is None else y + bias
