"""The systems a benchmark compares, each run on the same workload: HF static batches, HF
`generate_batch` (its continuous batching), and hfaccel."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.bench.workloads import Workload


@dataclass
class SystemResult:
    """One system's run of a workload."""

    system: str
    seconds: float
    output_tokens: int
    outputs: list[list[int]] = field(repr=False, default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_hf_static(model: Any, workload: Workload, batch_size: int, pad_id: int) -> SystemResult:
    """HF `generate` on fixed batches in arrival order, left-padded. A batch runs until its longest
    request is done (EOS ignored); each row keeps only its own tokens, the rest is the waste of
    static batching."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lens = workload.output_lens[first : first + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(lens)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
        outputs.extend(out[i, width : width + n].tolist() for i, n in enumerate(lens))
    seconds = time.perf_counter() - start
    return SystemResult(
        f"HF generate (static batches of {batch_size})", seconds, sum(map(len, outputs)), outputs
    )


def run_hf_generate_batch(model: Any, workload: Workload) -> SystemResult:
    """HF's own continuous batching (`init_continuous_batching`, the manager behind `generate_batch`),
    given each request's output length; ``eos_token_id=-1`` makes it ignore EOS like the others."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    results: dict[str, list[int]] = {}
    start = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        ids = [
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))
        ]
        while len(results) < len(ids):
            result = manager.get_result(timeout=5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing the workload")
                continue
            if result.is_finished():
                results[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True)
    seconds = time.perf_counter() - start
    outputs = [results[f"r{i}"] for i in range(len(workload.prompts))]
    return SystemResult("HF generate_batch (continuous)", seconds, sum(map(len, outputs)), outputs)


def run_hfaccel(
    model: Any, workload: Workload, name: str = "hfaccel", **engine_overrides: Any
) -> SystemResult:
    """hfaccel.generate with one GenerationConfig per request (min == max new tokens: EOS ignored)."""
    from transformers import GenerationConfig

    import hfaccel

    configs = [
        GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False) for n in workload.output_lens
    ]
    hfaccel.patch(model, **engine_overrides)
    engine = model._hfaccel.get_engine(model)
    steps_before = engine.num_steps
    start = time.perf_counter()
    completions = hfaccel.generate(model, workload.prompts, generation_config=configs, progress=False)
    seconds = time.perf_counter() - start
    outputs = [c.token_ids for c in completions]
    ttft = sorted(c.metrics["ttft_s"] for c in completions)
    extra = {"steps": engine.num_steps - steps_before, "median_ttft_s": ttft[len(ttft) // 2]}
    return SystemResult(name, seconds, sum(map(len, outputs)), outputs, extra)
