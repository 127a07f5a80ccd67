import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hfaccel.engine.block_manager import BlockManager, blocks_for
from hfaccel.engine.request import Request, StoppingParams


def make_request(n_prompt: int = 5) -> Request:
    return Request(0, list(range(3, 3 + n_prompt)), StoppingParams(max_new_tokens=4))


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_table_and_free_returns_everything():
    manager = BlockManager(num_blocks=4, block_size=4)
    request = make_request()
    assert manager.allocate(request, 5)
    assert len(request.block_ids) == 2 and manager.num_free_blocks == 2
    request.num_computed_tokens = 5
    assert manager.allocate(request, 3)  # 8 tokens still fit in 2 blocks
    assert len(request.block_ids) == 2
    assert manager.allocate(request, 4)  # 9 tokens need a third block
    assert len(request.block_ids) == 3
    manager.free(request)
    assert request.block_ids == [] and manager.num_free_blocks == 4
    assert all(manager.ref_count(b) == 0 for b in range(4))


def test_failed_allocation_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request()
    assert not manager.allocate(request, 9)
    assert request.block_ids == [] and manager.num_free_blocks == 2


def test_double_free_is_detected():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request()
    manager.allocate(request, 4)
    blocks = list(request.block_ids)
    manager.free(request)
    request.block_ids = blocks
    with pytest.raises(AssertionError, match="freed more often than allocated"):
        manager.free(request)


def computed(manager: BlockManager, prompt: list[int], request_id: int = 0) -> Request:
    """A request admitted for `prompt` (sharing what the cache holds) with its whole prompt computed
    and its full blocks registered."""
    request = Request(request_id, list(prompt), StoppingParams(max_new_tokens=4))
    request.num_computed_tokens = manager.match_prefix(request)
    assert manager.allocate(request, len(prompt) - request.num_computed_tokens)
    request.num_computed_tokens = len(prompt)
    manager.cache_full_blocks(request)
    return request


def test_reset_prefix_cache_forgets_free_and_used_blocks():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    held = computed(manager, list(range(3, 12)))  # 2 full blocks, in use
    freed = computed(manager, list(range(20, 29)), request_id=1)  # 2 full blocks, freed but cached
    manager.free(freed)
    assert manager.num_cached_blocks == 4
    blocks, free_before = list(held.block_ids), manager.num_free_blocks

    manager.reset_prefix_cache()
    assert manager.num_cached_blocks == 0 and manager.epoch == 1
    assert held.block_ids == blocks and all(manager.ref_count(b) == 1 for b in blocks), "in-use blocks stay"
    assert manager.num_free_blocks == free_before
    for prompt in (list(range(3, 12)), list(range(20, 29))):
        again = Request(2, prompt, StoppingParams(max_new_tokens=4))
        assert manager.match_prefix(again) == 0, "no block computed before the reset is matched"


def test_request_admitted_before_a_reset_never_registers_its_blocks():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(3, 16))
    running = Request(0, prompt, StoppingParams(max_new_tokens=4))
    manager.match_prefix(running)
    assert manager.allocate(running, 6)
    running.num_computed_tokens = 6
    manager.cache_full_blocks(running)
    assert manager.num_cached_blocks == 1

    manager.reset_prefix_cache()  # the model changed while `running` was half computed
    assert manager.allocate(running, 7)
    running.num_computed_tokens = 13
    manager.cache_full_blocks(running)
    assert manager.num_cached_blocks == 0, "KV mixing both models is never shared"

    fresh = computed(manager, prompt, request_id=1)  # admitted after the reset: registers as usual
    assert manager.num_cached_blocks == 3
    assert computed(manager, prompt, request_id=2).block_ids[:3] == fresh.block_ids[:3]

    manager.free(running)  # preempted, then admitted again: now in the new epoch
    readmitted = Request(0, prompt, StoppingParams(max_new_tokens=4))
    assert manager.match_prefix(readmitted) == 12 and readmitted.cache_epoch == manager.epoch


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/grow/free sequences: blocks are never shared, never leak, counts stay 0/1."""

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(num_blocks=16, block_size=4)
        self.requests: list[Request] = []

    @rule(tokens=st.integers(1, 30))
    def add(self, tokens):
        request = make_request()
        if self.manager.allocate(request, tokens):
            request.num_computed_tokens = tokens
            self.requests.append(request)
        else:
            assert request.block_ids == []

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100), tokens=st.integers(1, 12))
    def grow(self, index, tokens):
        request = self.requests[index % len(self.requests)]
        before = list(request.block_ids)
        if self.manager.allocate(request, tokens):
            request.num_computed_tokens += tokens
            assert request.block_ids[: len(before)] == before
        else:
            assert request.block_ids == before

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def free(self, index):
        request = self.requests.pop(index % len(self.requests))
        self.manager.free(request)

    @invariant()
    def accounting_is_exact(self):
        held = [b for r in self.requests for b in r.block_ids]
        assert len(held) == len(set(held)), "a block is held twice"
        assert self.manager.num_used_blocks == len(held)
        for request in self.requests:
            assert len(request.block_ids) == blocks_for(request.num_computed_tokens, 4)
        assert all(self.manager.ref_count(b) in (0, 1) for b in range(16))

    def teardown(self):
        for request in self.requests:
            self.manager.free(request)
        assert self.manager.num_free_blocks == 16


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
