"""Run a function on N gloo ranks (processes on this machine) and collect what each rank returns."""

from __future__ import annotations

import datetime
import gc
import glob
import importlib
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to a gloo process group or its TCP store."""
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(("pt_gloo", "gloo_", "pt_tcpstore")):
            names.append(name)
    return names


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

    # Import the worker (hfaccel, transformers and, through torch._dynamo, torch.distributed.nn.functional)
    # before the group exists: that torch module's `group=group.WORLD` defaults are evaluated at import and
    # would hold the live default group, so destroy_process_group could not free it.
    module_name, fn_name = target.rsplit(":", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    from hfaccel.distributed.tp import forget_dtensor_shardings
    from hfaccel.engine.loop import close_all_loops

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, **kwargs)
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    del result
    # Shutdown order: the engine loops (whose threads keep the engines and the groups their executors
    # hold alive) are joined and the models freed on this thread, then the groups are destroyed. A gloo
    # group left alive past this point is torn down with its threads at interpreter exit, which aborted a
    # rank now and then ("terminate called without an active exception").
    close_all_loops("the rank is done")
    forget_dtensor_shardings()  # what a DTensor runtime or a transformers-sharded model cached
    gc.collect()  # after the caches let go: meshes (and models) are freed in reference cycles
    dist.destroy_process_group()
    deadline = time.monotonic() + 5.0  # joined threads may take a moment to leave /proc
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    left = gloo_threads()
    # torch before 2.13 keeps the group referenced from a DTensor cache `forget_dtensor_shardings` does not
    # know (found by make test-oldest on torch 2.11): there the leak is reported, not failed on.
    if left and TORCH_VERSION < (2, 13):
        print(f"rank {rank}: gloo threads {left} outlived destroy_process_group (torch {torch.__version__})")
    elif left:
        raise RuntimeError(
            f"rank {rank}: gloo threads {left} outlived destroy_process_group (a group is still referenced)"
        )


def run_ranks(target: str, world: int = 2, **kwargs) -> list:
    """`target` (``"module:function"``, called as ``function(rank, **kwargs)``) on `world` ranks; the
    list of their results. A rank that raised fails the caller with its traceback, and so does one whose
    gloo threads outlive ``destroy_process_group``."""
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
