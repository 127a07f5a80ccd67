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
