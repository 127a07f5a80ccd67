"""Fixed scheduler workloads whose schedules were recorded with the scheduler before adaptive scheduling
(`data/schedules_before_adaptive.json`): with no latency target, no priority and FCFS admission, the
scheduler must produce exactly those schedules."""

from __future__ import annotations

import random

from hfaccel import EngineConfig
from hfaccel.engine.block_manager import BlockManager
from hfaccel.engine.request import Request, StoppingParams

CONFIGS = {
    "defaults": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "small-budget": {"max_num_seqs": 6, "max_num_batched_tokens": 16, "long_prefill_token_threshold": 7},
    "prefix": {"max_num_seqs": 8, "max_num_batched_tokens": 32, "enable_prefix_caching": True},
    "tight-blocks": {"max_num_seqs": 5, "max_num_batched_tokens": 24, "num_blocks": 12},
    "by-length": {"max_num_seqs": 4, "max_num_batched_tokens": 32, "group_by_length": True},
    "prefill-first": {"max_num_seqs": 8, "max_num_batched_tokens": 32, "scheduling_policy": "prefill_first"},
}


def workload(seed: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_new_tokens) for 24 requests; some share a 12-token system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 50) for _ in range(12)]
    items = []
    for _ in range(24):
        own = [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]
        prompt = system + own if rng.random() < 0.5 else own
        items.append((rng.randint(0, 30), prompt, rng.randint(1, 12)))
    return items


def record(scheduler_cls, name: str, seed: int, cost_model=None, **extra) -> list[list[tuple[int, int]]]:
    """Drive a scheduler (the engine's way, sampling token 7) and return every step's (request, tokens)."""
    settings = dict(CONFIGS[name])
    num_blocks = settings.pop("num_blocks", 64)
    prefix = settings.pop("enable_prefix_caching", False)
    config = EngineConfig(block_size=4, enable_prefix_caching=prefix, **settings, **extra)
    manager = BlockManager(num_blocks, 4, prefix)
    args = (manager, config, 256) if cost_model is None else (manager, config, 256, cost_model)
    sched = scheduler_cls(*args)
    pending = sorted(
        ((t, Request(i, p, StoppingParams(max_new_tokens=n))) for i, (t, p, n) in enumerate(workload(seed))),
        key=lambda pair: pair[0],
    )
    steps = []
    for t in range(3000):
        while pending and pending[0][0] <= t:
            sched.add(pending.pop(0)[1])
        if not pending and not sched.has_unfinished():
            break
        step = sched.schedule(True)
        sampled = [
            r for r, n in zip(step.requests, step.num_tokens) if r.num_computed_tokens + n == r.num_tokens
        ]
        sched.update(step, sampled, [7] * len(sampled))
        steps.append([(r.request_id, n) for r, n in zip(step.requests, step.num_tokens)])
    return steps
