"""Giving back a thread's OpenMP pool (`engine/openmp.py`): the pool's workers really exit, torch keeps
working after it, and the loop gives the pool back where another thread steps or a driver returns."""

import os
import threading

import pytest
import torch

import hfaccel
import hfaccel.engine.submission as submission_module
from hfaccel.engine.openmp import pause_function, release_thread_pool
from tests.helpers import tiny_model

needs_libgomp = pytest.mark.skipif(
    pause_function() is None or torch.get_num_threads() < 2,
    reason="needs GNU OpenMP (torch's Linux wheels) and at least two torch threads",
)


def threads_in_process() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_op() -> torch.Tensor:
    a = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) / 1e5
    return a @ a  # large enough for every torch thread to take part


@needs_libgomp
def test_the_pool_s_workers_exit_and_come_back_when_needed():
    expected = parallel_op()
    with_pool = threads_in_process()
    assert release_thread_pool()
    assert threads_in_process() == with_pool - (torch.get_num_threads() - 1)
    assert torch.equal(parallel_op(), expected)  # a new pool, the same result
    assert threads_in_process() == with_pool


def test_a_waiting_caller_and_a_returning_driver_give_their_pools_back(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(
        submission_module, "pause_function", lambda: lambda kind: calls.append(threading.get_ident())
    )
    model = hfaccel.patch(tiny_model("llama"), progress=False)
    try:
        hfaccel.generate(
            model, [[1, 2, 3]], max_new_tokens=4, progress=False
        )  # drives: one release at the end
        assert calls == [threading.get_ident()]
        calls.clear()
        threads = [
            threading.Thread(
                target=hfaccel.generate,
                args=(model, [[1, 2, 3 + i]]),
                kwargs={"max_new_tokens": 24, "min_new_tokens": 24, "progress": False},
            )
            for i in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        # Each caller gives its pool back: while another thread steps, or when it drove and returns.
        assert set(calls) == {thread.ident for thread in threads}
    finally:
        hfaccel.unpatch(model)
