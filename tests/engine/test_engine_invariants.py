"""Hypothesis state machine over a real (tiny) engine: random add / step / cancel / preempt sequences."""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import tiny_model

MODEL = tiny_model("llama", layers=1)
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # 24 blocks of 4 tokens: small enough that admission waits and preemption happens.
        config = EngineConfig(
            block_size=4, max_num_seqs=6, max_num_batched_tokens=16, kv_cache_memory=24 * 1024
        )
        self.engine = Engine(MODEL, config)
        assert self.engine.num_blocks == 24
        self.requests = []
        self.finish_events = {}
        self.snapshots = {}  # block id -> K contents when first seen cached and referenced

    @rule(
        prompt_len=st.integers(1, 20),
        max_new=st.integers(1, 12),
        shared=st.booleans(),
        seed=st.integers(0, 10**6),
    )
    def add(self, prompt_len, max_new, shared, seed):
        g = torch.Generator().manual_seed(seed)
        tail = torch.randint(3, 256, (prompt_len,), generator=g).tolist()
        prompt = (SHARED + tail)[:20] if shared else tail
        self.requests.append(self.engine.add_request(prompt, StoppingParams(max_new_tokens=max_new)))

    @rule()
    def step(self):
        for request in self.engine.step():
            self.finish_events[id(request)] = self.finish_events.get(id(request), 0) + 1
        if self.engine.step_stats:
            last = self.engine.step_stats[-1]
            assert last.num_decode_tokens + last.num_prefill_tokens <= 16
            assert last.num_seqs <= 6

    @precondition(lambda self: any(not r.is_finished for r in self.requests))
    @rule(index=st.integers(0, 1000))
    def cancel(self, index):
        live = [r for r in self.requests if not r.is_finished]
        request = live[index % len(live)]
        self.engine.abort(request)
        self.finish_events[id(request)] = self.finish_events.get(id(request), 0) + 1
        assert request.block_ids == []

    @precondition(lambda self: len(self.engine.scheduler.running) > 0)
    @rule(index=st.integers(0, 1000))
    def preempt(self, index):
        running = self.engine.scheduler.running.requests
        self.engine.scheduler.preempt(running[index % len(running)])

    @invariant()
    def blocks_are_accounted_for(self):
        manager = self.engine.block_manager
        held = {}
        for request in self.engine.scheduler.requests():
            for block in request.block_ids:
                held[block] = held.get(block, 0) + 1
        for block in range(manager.num_blocks):
            assert manager.ref_count(block) == held.get(block, 0) >= 0
            assert manager.is_free(block) == (held.get(block, 0) == 0)

    @invariant()
    def cached_blocks_in_use_are_never_overwritten(self):
        manager = self.engine.block_manager
        k_cache = self.engine.runner.kv_caches[0][0]
        live = set()
        for key, block in manager._cached.items():
            if manager.ref_count(block) > 0:
                live.add(block)
                snapshot = self.snapshots.setdefault((block, key), k_cache[block].clone())
                assert torch.equal(k_cache[block], snapshot), f"cached block {block} was overwritten"
        self.snapshots = {k: v for k, v in self.snapshots.items() if k[0] in live}

    @invariant()
    def finished_exactly_once(self):
        for request in self.requests:
            assert self.finish_events.get(id(request), 0) == (1 if request.is_finished else 0)

    def teardown(self):
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            for request in self.engine.step(draining=True):
                self.finish_events[id(request)] = self.finish_events.get(id(request), 0) + 1
        assert all(r.is_finished for r in self.requests)
        self.finished_exactly_once()
        manager = self.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
