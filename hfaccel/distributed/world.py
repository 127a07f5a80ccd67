"""The one place the process world is set up: the default process group, started from torchrun's
environment where none exists, checked against the size a kind of parallelism asks for, and split into
groups of consecutive ranks. Tensor, pipeline, expert and data parallelism all start here."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launch(size: int, what: str) -> None:
    """ValueError unless this process can join a world of `size` processes or more that `size` divides:
    a process group, or torchrun's environment to start one from (checked before anything slow runs)."""
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise ValueError(
                f"{what}={size} needs {size} processes: launch with `torchrun --nproc-per-node {size} ...` "
                "or call torch.distributed.init_process_group first (no process group and no torchrun "
                f"environment: {', '.join(missing)} unset)"
            )
        world = int(os.environ["WORLD_SIZE"])
    if size > world:
        raise ValueError(f"{what}={size} is larger than the world ({world} processes)")
    if world % size:
        raise ValueError(f"{what}={size} does not divide the world size {world}")


def init_world(size: int, what: str, device: torch.device) -> int:
    """Start the process group from torchrun's environment if none exists (NCCL on CUDA, each rank on
    its ``LOCAL_RANK`` device; gloo otherwise); the world size. `what` names the argument asking for
    `size` processes in the errors: no process group and no torchrun environment, a world smaller than
    `size`, or one `size` does not divide."""
    check_launch(size, what)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_world_size()


def split_groups(size: int) -> tuple[list[int], Any]:
    """This rank's group of `size` consecutive ranks (every rank creates every group, as torch needs)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine_ranks, mine = None, None
    for lo in range(0, world, size):
        ranks = list(range(lo, lo + size))
        group = dist.new_group(ranks) if size < world else dist.group.WORLD
        if rank in ranks:
            mine_ranks, mine = ranks, group
    return mine_ranks, mine
