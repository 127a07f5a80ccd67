"""The kernel benchmark times only what runs natively: never the Triton interpreter."""

import torch

from hfaccel.bench import kernels


def test_kernel_benchmark_times_torch_and_never_the_interpreter(monkeypatch, capsys):
    monkeypatch.setattr(kernels, "CASES", {"decode b=2 ctx=40": [(39, 1), (20, 1)], "prefill 20": [(0, 20)]})
    results = kernels.run_kernel_benchmark(torch.float32, repeats=2)
    out = capsys.readouterr().out
    assert set(results["torch"]) == set(results["torch build"]) == {"decode b=2 ctx=40", "prefill 20"}
    assert all(ms > 0 for ms in results["torch build"].values())
    assert "step build" in out
    if not torch.cuda.is_available():
        assert "triton" not in results and "triton: skipped" in out
