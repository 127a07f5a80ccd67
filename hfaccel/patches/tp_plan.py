"""A Hugging Face model's tensor-parallel plan, as torch `parallelize_module` styles.

Every family transformers ships a plan for (``config.base_model_tp_plan``, merged by transformers with
the class's own ``_tp_plan`` for the LM head and the input embeddings into ``model.tp_plan``) is
sharded from that plan: no table of our own per family. HF's style names map to torch's styles:

    colwise, local_colwise                      ColwiseParallel()                 output: the rank's columns
    rowwise, local_rowwise                      RowwiseParallel()                 output: all-reduced
    colwise_rep, colwise_gather_output          ColwiseParallel(output_layouts=Replicate())  (the LM head)
    rowwise_rep, rowwise_split_input            RowwiseParallel(input_layouts=Replicate())
    embedding_rowwise                           RowwiseParallel(input_layouts=Replicate())   (vocab-sharded)
    embedding_colwise                           ColwiseParallel(output_layouts=Replicate())
    replicate, replicated_with_grad_allreduce,  left replicated (inference has no gradients to reduce;
    local_params, local, sequence_parallel      norms see the local token shard in SP steps anyway)

Anything else (packed/fused projections, MoE and expert styles, MLA, ``gather``, ``all_reduce``) is
refused with ValueError naming the module: load such a model with ``from_pretrained(...,
tp_plan="auto")`` instead, which hfaccel serves as transformers sharded it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hfaccel.distributed.layout import parallel_layout, record_layout
from hfaccel.distributed.tp import (
    PrefillGatherInput,
    PrefillGatherOutput,
    PrefillRowwiseParallel,
    ReplicatedKVHead,
    TPState,
    check_world_size,
    forget_dtensor_shardings,
    group_src,
    tp_mesh,
)
from hfaccel.patches.tp_modules import run_locally

_COLWISE = {"colwise", "local_colwise"}
_ROWWISE = {"rowwise", "local_rowwise"}
_COLWISE_GATHERED = {"colwise_rep", "colwise_gather_output", "embedding_colwise"}
_ROWWISE_REPLICATED_INPUT = {"rowwise_rep", "rowwise_split_input", "embedding_rowwise"}
_REPLICATED = {"replicate", "replicated_with_grad_allreduce", "local_params", "local", "sequence_parallel"}
# Sequence parallelism splits the residual stream between a pre-norm and the next layer: checked on these.
SEQUENCE_PARALLEL_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"}
)
MAPPED_STYLES = _COLWISE | _ROWWISE | _COLWISE_GATHERED | _ROWWISE_REPLICATED_INPUT | _REPLICATED


def hf_plan(model: Any) -> dict[str, str]:
    """The model's plan with names relative to `model`: ``model.tp_plan`` (transformers' merge of the
    config's ``base_model_tp_plan``, the LM head's and the embeddings' rules), or the config's own plan
    under the base model's prefix."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    if plan:
        return plan
    config = model.config.get_text_config(decoder=True)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    base_model = getattr(model, prefix, None) if prefix else None
    if base and isinstance(getattr(base_model, "embed_tokens", None), nn.Embedding):
        base = {"embed_tokens": "embedding_rowwise", **base}  # as transformers adds it
    if isinstance(base_model, nn.Module):
        base = {f"{prefix}.{name}": style for name, style in base.items()}
    return {**base, **dict(getattr(type(model), "_tp_plan", None) or {})}


def _geometry(model: Any) -> dict[str, int]:
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    return {
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "intermediate": getattr(config, "intermediate_size", 0) or 0,
        "vocab": model.get_input_embeddings().num_embeddings,
    }


def check_shardable(model: Any, n: int, sequence_parallel: bool) -> dict[str, str]:
    """Raise ValueError if `model` cannot be split N ways (before anything is sharded); returns its plan.

    Heads, intermediate size and vocabulary must divide by N. KV heads may also be fewer than N when N
    is a multiple of them: each rank then keeps a copy of the one KV head its query heads use.
    """
    plan = hf_plan(model)
    name = type(model).__name__
    if not plan:
        raise ValueError(
            f"{name} has no tensor-parallel plan (config.base_model_tp_plan is empty): hfaccel shards a model "
            "from the plan transformers ships for its family"
        )
    refused = {key: style for key, style in plan.items() if style not in MAPPED_STYLES}
    if refused:
        raise ValueError(
            f"{name}'s tensor-parallel plan uses styles hfaccel does not map to torch's: {refused}; "
            f"mapped: {sorted(MAPPED_STYLES)}. Load it with from_pretrained(..., tp_plan='auto') instead "
            "(transformers shards it at load and hfaccel serves it as it is)"
        )
    if not any(_attention_projections(module) for module in model.modules()):
        raise ValueError(
            f"{name}'s attention has no separate q_proj and k_proj (a fused projection): hfaccel counts each "
            "rank's heads from them"
        )
    g = _geometry(model)
    problems = []
    if g["heads"] % n:
        problems.append(f"{g['heads']} attention heads")
    if g["kv_heads"] % n and n % g["kv_heads"]:
        problems.append(f"{g['kv_heads']} KV heads (neither a multiple of {n} nor a divisor of it)")
    sharded = {style for style in plan.values() if style not in _REPLICATED}
    if g["intermediate"] % n and any(".mlp." in key for key in plan):
        problems.append(f"intermediate size {g['intermediate']}")
    if g["vocab"] % n and sharded:
        problems.append(f"vocabulary of {g['vocab']}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={n} does not divide {name}'s "
            + ", ".join(problems)
            + "; choose a size that divides them"
        )
    if sequence_parallel:
        model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if model_type not in SEQUENCE_PARALLEL_MODEL_TYPES or not isinstance(
            getattr(base, "norm", None), nn.Module
        ):
            raise ValueError(
                f"sequence_parallel=True is implemented for {sorted(SEQUENCE_PARALLEL_MODEL_TYPES)} (a pre-norm "
                f"residual stream with the final norm at .norm), not for model_type {model_type!r}"
            )
    return plan


def torch_plan(model: Any, plan: dict[str, str], tp: TPState) -> dict[str, Any]:
    """The `parallelize_module` plan (keys relative to `model`, ``*`` for layer numbers)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    g = _geometry(model)
    sp = tp.sequence_parallel
    rowwise = PrefillRowwiseParallel if sp else RowwiseParallel
    styles: dict[str, Any] = {}
    for key, style in plan.items():
        leaf = key.rsplit(".", 1)[-1]
        if tp.kv_replicated and leaf in ("k_proj", "v_proj") and style in _COLWISE:
            styles[key] = ReplicatedKVHead(g["kv_heads"], g["head_dim"], tp.size, tp.rank, tp.src)
        elif style in _COLWISE:
            styles[key] = ColwiseParallel()
        elif style in _ROWWISE:
            styles[key] = rowwise()
            if sp:  # the block that ends in this projection gathers the token-sharded stream first
                styles[key.rsplit(".", 1)[0]] = PrefillGatherInput()
        elif style in _COLWISE_GATHERED:
            styles[key] = ColwiseParallel(output_layouts=Replicate())
        elif style in _ROWWISE_REPLICATED_INPUT:
            styles[key] = rowwise(input_layouts=Replicate())
    if sp:
        prefix = getattr(model, "base_model_prefix", "")
        styles[f"{prefix}.norm" if prefix else "norm"] = PrefillGatherOutput()
        embed = next((k for k, s in plan.items() if s == "embedding_rowwise"), None)
        if embed is None:  # a replicated embedding: its output is sliced to the rank's tokens
            raise ValueError(
                "sequence_parallel=True needs the input embeddings sharded by 'embedding_rowwise'"
            )
    return styles


def shard_model(
    model: Any,
    tensor_parallel_size: int | None,
    device_mesh: Any,
    sequence_parallel: bool,
    runtime: str = "local",
) -> TPState:
    """Shard `model` in place over `tensor_parallel_size` ranks (or `device_mesh`); returns its `TPState`.

    Every check (sizes, plan, process group) runs before the first parameter is touched. Every rank must
    hold the same weights; rank 0's are the ones distributed (as ``parallelize_module`` does).
    `runtime`: ``"local"`` runs the shards with explicit collectives (`run_locally`, the default: far
    faster on a CPU), ``"dtensor"`` keeps DTensor parameters and torch's hooks (the reference).
    """
    if runtime not in ("local", "dtensor"):
        raise ValueError(f"runtime must be 'local' or 'dtensor', got {runtime!r}")
    from torch.distributed.tensor.parallel import parallelize_module

    n = device_mesh.size() if device_mesh is not None else tensor_parallel_size
    check_world_size(n)
    plan = check_shardable(model, n, sequence_parallel)
    device = next(model.parameters()).device
    mesh = tp_mesh(tensor_parallel_size, device_mesh, device)
    g = _geometry(model)
    tp = TPState(
        mesh=mesh,
        size=n,
        rank=mesh.get_local_rank(),
        src=group_src(mesh),
        sequence_parallel=sequence_parallel,
        sharded_by="hfaccel",
        kv_replicated=g["kv_heads"] % n != 0,
        heads_gathered=_gathers_heads(plan),
    )
    tied = _tied_embeddings(model)
    styles = torch_plan(model, plan, tp)
    # Not inference tensors, even when patched under torch.inference_mode() (they track no version).
    with torch.inference_mode(False), torch.no_grad():
        parallelize_module(model, mesh, styles)
        if runtime == "local":
            run_locally(model, styles, tp)
            forget_dtensor_shardings()  # they would pin the mesh's groups past destroy_process_group
    if tied:  # both sides hold the same vocabulary rows (Shard(0)): keep one copy, tied again
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings().weight
        if getattr(embed, "placements", None) == getattr(head.weight, "placements", None):
            head.weight = embed
    return tp


def _gathers_heads(plan: dict[str, str]) -> bool:
    """Whether the plan gathers the query projection's output (every rank then attends with all heads)."""
    return any(key.endswith("q_proj") and style in _COLWISE_GATHERED for key, style in plan.items())


def _tied_embeddings(model: Any) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def transformers_sharding(model: Any) -> TPState | None:
    """The `TPState` of a model transformers sharded at load (``from_pretrained(..., tp_plan="auto")`` or
    ``distributed_config=DistributedConfig(tp_size=N)``), or None."""
    size = getattr(model, "_tp_size", None) or 1
    mesh = getattr(model, "_device_mesh", None)
    if size <= 1 or mesh is None:
        return None
    if mesh.ndim > 1:
        names = mesh.mesh_dim_names or ()
        if "tp" not in names:
            raise ValueError(f"cannot find the 'tp' dimension of the model's device mesh {mesh}")
        mesh = mesh["tp"]
    return TPState(
        mesh=mesh,
        size=size,
        rank=mesh.get_local_rank(),
        src=group_src(mesh),
        sequence_parallel=False,
        sharded_by="transformers",
        heads_gathered=_gathers_heads(hf_plan(model)),
    )


def has_dtensor_parameters(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _attention_projections(module: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    if hasattr(module, "layer_idx") and isinstance(q, nn.Linear) and isinstance(k, nn.Linear):
        return q, k
    return None


def local_heads(model: Any, head_dim: int, gathered: bool = False) -> tuple[int, int]:
    """(query heads, KV heads) this rank computes: read off the first attention layer's projections, or
    every head where the projections gather their outputs (`gathered`)."""
    if gathered:
        g = _geometry(model)
        return g["heads"], g["kv_heads"]
    for module in model.modules():
        if (projections := _attention_projections(module)) is not None:
            q, k = projections
            return _local_rows(q.weight) // head_dim, _local_rows(k.weight) // head_dim
    raise ValueError("cannot find the attention projections (q_proj, k_proj) to count the rank's heads")


def _local_rows(weight: torch.Tensor) -> int:
    local = getattr(weight, "_local_tensor", weight)
    return local.shape[0]


def setup_tensor_parallel(
    model: Any,
    tensor_parallel_size: int | None,
    device_mesh: Any,
    sequence_parallel: bool | None,
    batching: str,
) -> TPState | None:
    """What `hfaccel.patch` does about tensor parallelism; returns the model's `TPState` (or None).

    A model already sharded (by an earlier patch, or by transformers at load) is served as it is; one
    that is not is sharded here when ``tensor_parallel_size > 1`` or a `device_mesh` is given. Every
    refusal is a ValueError raised before any parameter is touched.
    """
    existing = parallel_layout(model).tp or transformers_sharding(model)
    wanted = (tensor_parallel_size is not None and tensor_parallel_size != 1) or device_mesh is not None
    if tensor_parallel_size is not None:
        check_world_size(tensor_parallel_size)
    if existing is not None:
        if tensor_parallel_size is not None and tensor_parallel_size != existing.size:
            raise ValueError(
                f"the model is already sharded {existing.size} ways (by {existing.sharded_by}); "
                f"tensor_parallel_size={tensor_parallel_size} cannot change that"
            )
        if device_mesh is not None and device_mesh is not existing.mesh:
            raise ValueError(
                f"the model is already sharded over {existing.mesh}; it cannot move to {device_mesh}"
            )
        if sequence_parallel is not None and bool(sequence_parallel) != existing.sequence_parallel:
            how = (
                "sequence parallelism needs hfaccel's own sharding (patch an unsharded model with "
                "tensor_parallel_size=N, sequence_parallel=True)"
                if existing.sharded_by == "transformers"
                else "sequence_parallel is chosen when the model is sharded, at its first patch"
            )
            raise ValueError(
                f"the model is already sharded with sequence_parallel={existing.sequence_parallel}: {how}"
            )
    elif sequence_parallel and not wanted:
        raise ValueError(
            "sequence_parallel=True needs tensor parallelism: pass tensor_parallel_size=N (N > 1)"
        )
    elif not wanted:
        if has_dtensor_parameters(model):
            raise ValueError(
                "the model has DTensor parameters but no tensor-parallel record hfaccel can serve; shard it with "
                "hfaccel.patch(model, tensor_parallel_size=N) or from_pretrained(..., tp_plan='auto')"
            )
        return None
    if batching == "dynamic":
        raise ValueError(
            "batching='dynamic' waits max_delay_ms of wall-clock time before forming a batch, which can differ "
            "between tensor-parallel ranks; use batching='continuous' or 'static' with tensor parallelism"
        )
    if existing is None:
        existing = shard_model(model, tensor_parallel_size, device_mesh, bool(sequence_parallel))
    record_layout(model, tp=existing)
    return existing
