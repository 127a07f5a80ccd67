"""Hypothesis state machine over a real (tiny) engine: random add / step / cancel / preempt sequences, and
steps interrupted by an exception at a random line of engine code."""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hfaccel import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import Fault, check_consistent, tiny_model, untraced_forward

MODEL = tiny_model("llama", layers=1)
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def check_cached_blocks_unchanged(manager, k_cache, snapshots: dict) -> dict:
    """Every cached block some request holds has the K contents it had when first seen so; returns the
    snapshots of those still held."""
    live = set()
    for key, block in manager._cached.items():
        if manager.ref_count(block) > 0:
            live.add(block)
            snapshot = snapshots.setdefault((block, key), k_cache[block].clone())
            assert torch.equal(k_cache[block], snapshot), f"cached block {block} was overwritten"
    return {k: v for k, v in snapshots.items() if k[0] in live}


class EngineMachine(RuleBasedStateMachine):
    extra_config: dict = {}
    model = MODEL
    num_blocks = 24

    def __init__(self):
        super().__init__()
        # 24 blocks of 4 tokens: small enough that admission waits and preemption happens.
        config = EngineConfig(
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=16,
            kv_cache_memory=24 * 1024,
        ).with_overrides(**self.extra_config)
        self.engine = Engine(self.model, config)
        assert self.engine.num_blocks == self.num_blocks
        untraced_forward(self.engine)  # faults are injected in engine code only: the model runs untraced
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

    @rule(at=st.integers(1, 800), error=st.sampled_from([KeyboardInterrupt, RuntimeError, MemoryError]))
    def faulty_step(self, at, error):
        """The next step raises at its `at`-th line event of engine code (if it has that many)."""
        finished, raised = [], None
        with Fault(at, error) as fault:
            try:
                finished = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - the injected fault, checked below
                raised = exc
        if raised is not None:
            assert fault.fired and isinstance(raised, error), raised
        for request in finished:
            self.finish_events[id(request)] = self.finish_events.get(id(request), 0) + 1
        for request in self.requests:  # the interrupted step's requests failed: not returned, but finished
            if request.is_finished and id(request) not in self.finish_events:
                assert raised is not None and request.finish_reason == "error"
                assert request.error is raised and request.block_ids == []
                self.finish_events[id(request)] = 1

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
    def bookkeeping_is_consistent(self):
        check_consistent(self.engine)

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
        manager, k_cache = self.engine.block_manager, self.engine.runner.kv_caches[0][0]
        self.snapshots = check_cached_blocks_unchanged(manager, k_cache, self.snapshots)

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


class SpeculativeEngineMachine(EngineMachine):
    """The same machine with n-gram speculation on, plus a rule that plants random drafts (mostly
    rejected): lookahead allocation and rollback must keep every invariant."""

    extra_config = {"speculative": "ngram", "num_speculative_tokens": 3}

    @rule(seed=st.integers(0, 10**6), k=st.integers(1, 3))
    def plant_drafts(self, seed, k):
        g = torch.Generator().manual_seed(seed)
        for request in self.engine.scheduler.running:
            if request.num_uncomputed_tokens == 1 and not request.is_finished:
                request.speculation.drafts = torch.randint(3, 256, (k,), generator=g).tolist()


TestSpeculativeEngineMachine = SpeculativeEngineMachine.TestCase
TestSpeculativeEngineMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)


class DraftModelEngineMachine(EngineMachine):
    """The same machine with the model as its own draft model: the draft's cache rides the same block
    tables through admission, prefix hits, preemption, cancellation and interrupted steps. Its greedy
    drafts are the model's own tokens, so stale draft K/V would show as rejected drafts."""

    # The draft's cache costs as much as the model's: twice the memory for the same 24 blocks.
    extra_config = {"speculative": MODEL, "num_speculative_tokens": 3, "kv_cache_memory": 48 * 1024}

    @invariant()
    def draft_kv_is_within_the_blocks(self):
        size = self.engine.block_manager.block_size
        for request in self.engine.scheduler.requests():
            assert 0 <= request.speculation.draft_computed <= len(request.block_ids) * size
            assert request.speculation.draft_computed <= request.num_tokens + 3
            if not request.block_ids:
                assert request.speculation.draft_computed == 0

    def teardown(self):
        super().teardown()
        stats = self.engine.stats()
        # Stale draft K/V rejects most drafts. A few rejections are near-ties of this tiny random model
        # (the draft scores one query a step, verification several: the last bits differ): hypothesis
        # found 17 of 20 accepted with nothing stale (and the same on the commit before), so 0.75.
        if stats["spec_drafted"] >= 20:
            assert stats["spec_accepted"] >= 0.75 * stats["spec_drafted"], stats


TestDraftModelEngineMachine = DraftModelEngineMachine.TestCase
TestDraftModelEngineMachine.settings = settings(max_examples=20, stateful_step_count=40, deadline=None)


class BeamEngineMachine(EngineMachine):
    """The same machine with beam search requests among the others: groups forked, re-forked, copied on
    write, preempted (restarted), cancelled and interrupted by faults keep every invariant, and no forward
    ever writes into a block that more than one sequence holds."""

    def __init__(self):
        super().__init__()
        runner, manager, size = self.engine.runner, self.engine.block_manager, self.engine.config.block_size
        run = runner.run

        def checked_run(packed, *args, **kwargs):
            for slot in packed.layout.slot_mapping:
                if slot >= 0:
                    assert manager.ref_count(slot // size) == 1, f"a write into shared block {slot // size}"
            return run(packed, *args, **kwargs)

        runner.run = checked_run

    @rule(
        prompt_len=st.integers(1, 12),
        max_new=st.integers(1, 8),
        num_beams=st.integers(2, 3),
        early_stopping=st.sampled_from([True, False, "never"]),
        seed=st.integers(0, 10**6),
    )
    def add_beams(self, prompt_len, max_new, num_beams, early_stopping, seed):
        from hfaccel.engine.beam_search import BeamParams
        from hfaccel.engine.request import SamplingParams

        g = torch.Generator().manual_seed(seed)
        prompt = (SHARED + torch.randint(3, 256, (prompt_len,), generator=g).tolist())[: prompt_len + 4]
        params = SamplingParams(beam=BeamParams(num_beams, early_stopping=early_stopping))
        stopping = StoppingParams(max_new_tokens=max_new, eos_token_ids=frozenset({int(seed % 256)}))
        self.requests.append(self.engine.add_request(prompt, stopping, params))


TestBeamEngineMachine = BeamEngineMachine.TestCase
TestBeamEngineMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
