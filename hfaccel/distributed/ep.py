"""Expert parallelism's runtime: the state of a group of ranks that share a MoE model's experts, the
group's set-up, and the all-to-all that moves token rows between them. Which modules hold experts, how
they are sliced and their replaced forward are the HF adapter's: `patches/ep_modules.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hfaccel.distributed.world import init_world, split_groups


@dataclass
class EPState:
    size: int
    rank: int  # index in the group
    ranks: list[int]
    group: Any
    num_experts: int
    num_dispatches: int = 0  # expert-module calls routed by all-to-all (for tests)

    @property
    def src(self) -> int:
        return self.ranks[0]


def expert_group(size: int, num_experts: int, device: torch.device) -> EPState:
    """This rank's expert-parallel group of `size` ranks (the world set up if it is not yet)."""
    init_world(size, "expert_parallel_size", device)
    ranks, group = split_groups(size)
    return EPState(size, ranks.index(dist.get_rank()), ranks, group, num_experts)


def all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out
