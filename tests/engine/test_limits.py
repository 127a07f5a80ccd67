"""`engine/limits.py`: the free memory a KV cache given as a fraction is sized from."""

import gc

import torch

from hfaccel.engine import limits


class _Engine:
    def __init__(self, device):
        self.device = torch.device(device)


def test_on_cuda_the_cycle_collector_runs_before_free_memory_is_read_where_an_engine_may_linger(monkeypatch):
    """A patched model dropped without unpatch holds its engine's KV cache until Python's cycle collector
    runs: on CUDA, where a CUDA engine is alive, it runs (and the allocator's cache is emptied) before
    the free memory is read; where none is, it does not (it costs up to a second)."""
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: calls.append("read") or (123, 456))
    monkeypatch.setattr(limits, "_engines", type(limits._engines)())
    limits.track_engine(_Engine("cpu"))
    assert limits.free_memory_bytes(torch.device("cuda", 0)) == 123
    assert calls == ["read"]
    lingering = _Engine("cuda")
    limits.track_engine(lingering)
    calls.clear()
    assert limits.free_memory_bytes(torch.device("cuda", 0)) == 123
    assert calls == ["collect", "empty_cache", "read"]


def test_on_a_cpu_the_available_memory_is_read_without_collecting(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    assert limits.free_memory_bytes(torch.device("cpu")) > 0
    assert calls == []
