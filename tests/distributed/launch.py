"""Run a function on N gloo ranks (processes on this machine) and collect what each rank returns."""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target: str, kwargs: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    module_name, fn_name = target.rsplit(":", 1)
    try:
        result = getattr(importlib.import_module(module_name), fn_name)(rank, **kwargs)
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run_ranks(target: str, world: int = 2, **kwargs) -> list:
    """`target` (``"module:function"``, called as ``function(rank, **kwargs)``) on `world` ranks; the
    list of their results. A rank that raised fails the caller with its traceback."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, free_port(), target, kwargs, out_dir), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "error" in result:
            raise AssertionError(f"rank {rank} failed:\n{result['error']}")
    return results
