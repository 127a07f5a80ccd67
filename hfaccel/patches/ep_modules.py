"""Expert parallelism (its modules) for transformers' fused MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE, ...).

In transformers 5 a sparse MoE block holds a router (``gate``) and one ``experts`` module whose weights
are 3-D: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; the block calls
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. ``expert_parallel_size=N`` keeps
experts ``[r E/N, (r + 1) E/N)`` on rank r (the expert dim of both tensors is sliced in place) and
replaces that call, on every such module, with `ep_experts_forward`:

1. **token shard**: every rank of the group runs the same step (attention and router replicated, the
   ranks in lock step as under TP), and rank r takes the r-th contiguous 1/N of the tokens;
2. **dispatch**: its (token, expert) pairs are sorted by the rank owning the expert and sent there with
   an all-to-all (``all_to_all_single``: counts first, then the hidden rows and the expert ids);
3. each rank runs its local experts on the rows it received (per microbatch: the engine calls the
   model once per microbatch, so routing happens per microbatch);
4. **combine**: the outputs go back by the reverse all-to-all, are weighted by the router weights and
   summed per token on the token's owner;
5. the token shards are all-gathered so that every rank again holds the whole residual stream.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfaccel.distributed.ep import EPState, all_to_all, expert_group
from hfaccel.distributed.layout import parallel_layout, record_layout


def expert_modules(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(m, "down_proj", None), torch.Tensor)
        and m.gate_up_proj.dim() == 3
    ]


def _routed_experts(module: nn.Module, hidden_size: int) -> bool:
    """Whether `module` is experts of the layout `ep_experts_forward` replaces: called with the routing
    (its forward takes hidden_states, top_k_index, top_k_weights), gate_up_proj ``[E, 2I, H]``."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(parameters) >= 4 and module.gate_up_proj.shape[2] == hidden_size


def setup_expert_parallel(model: Any, size: int | None) -> EPState | None:
    existing = parallel_layout(model).ep
    if size is None:
        return existing
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"expert_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return existing
    if existing is not None:
        if existing.size != size:
            raise ValueError(f"the model's experts are already split {existing.size} ways")
        return existing
    modules = expert_modules(model)
    if not modules:
        raise ValueError(
            "expert_parallel_size needs a MoE model with fused 3-D experts (gate_up_proj, down_proj)"
        )
    num_experts = modules[0].gate_up_proj.shape[0]
    if num_experts % size:
        raise ValueError(f"expert_parallel_size={size} does not divide the {num_experts} experts")
    for module in modules:
        extra = [
            n for n, _ in module.named_parameters(recurse=False) if n not in ("gate_up_proj", "down_proj")
        ]
        if extra:
            raise ValueError(
                f"experts with parameters {extra} (biases) are not supported by expert parallelism"
            )
        if not _routed_experts(module, model.config.get_text_config(decoder=True).hidden_size):
            raise ValueError(
                "expert parallelism splits experts called with (hidden_states, top_k_index, top_k_weights) "
                "that hold gate_up_proj as [experts, 2 x intermediate, hidden] (Mixtral's layout); "
                f"{type(module).__name__} is not such experts"
            )
    if parallel_layout(model).tp is not None or parallel_layout(model).pp is not None:
        raise ValueError(
            "expert parallelism combined with tensor or pipeline parallelism is not supported yet"
        )
    state = expert_group(size, num_experts, next(model.parameters()).device)
    per = num_experts // size
    lo = state.rank * per
    for module in modules:
        with torch.no_grad():
            module.gate_up_proj = nn.Parameter(
                module.gate_up_proj[lo : lo + per].clone(), requires_grad=False
            )
            module.down_proj = nn.Parameter(module.down_proj[lo : lo + per].clone(), requires_grad=False)
        module.ep = state
        module.forward = types.MethodType(ep_experts_forward, module)
    record_layout(model, ep=state)
    return state


def ep_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    ep: EPState = self.ep
    ep.num_dispatches += 1
    n, rank = ep.size, ep.rank
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[1]
    chunk = -(-tokens // n)
    lo, hi = min(rank * chunk, tokens), min((rank + 1) * chunk, tokens)
    # 1. this rank's token shard and its (token, expert) pairs, sorted by the expert's rank.
    experts = top_k_index[lo:hi].reshape(-1)
    weights = top_k_weights[lo:hi].reshape(-1)
    token_of = torch.arange(hi - lo, device=hidden_states.device).repeat_interleave(k)
    per = ep.num_experts // n
    dest = torch.div(experts, per, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    # 2. dispatch.
    rows = all_to_all(hidden_states[lo:hi][token_of[order]], send, recv, ep.group)
    ids = all_to_all(experts[order], send, recv, ep.group) - rank * per
    # 3. the local experts.
    out = torch.zeros_like(rows)
    for e in torch.unique(ids).tolist():
        where = (ids == e).nonzero().squeeze(1)
        gate, up = nn.functional.linear(rows[where], self.gate_up_proj[e]).chunk(2, dim=-1)
        out[where] = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
    # 4. combine on the token's owner.
    back = all_to_all(out, recv, send, ep.group)
    mine = torch.zeros((chunk, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
    mine.index_add_(0, token_of[order], (back * weights[order, None]).to(mine.dtype))
    # 5. every rank gets every token back.
    shards = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(shards, mine, group=ep.group)
    return torch.cat(shards)[:tokens]
