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


# ----------------------------------------------------------------- forks and copy on write (beam search)


def test_fork_shares_the_table_and_a_write_copies_the_shared_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent = make_request(6)  # 6 tokens: one full block, one holding 2 slots
    assert manager.allocate(parent, 6)
    parent.num_computed_tokens = 6
    children = [make_request(6) for _ in range(2)]
    manager.fork([parent, parent], children)
    full, partial = parent.block_ids
    assert all(c.block_ids == [full, partial] for c in children)
    assert manager.ref_count(full) == manager.ref_count(partial) == 3 and manager.num_free_blocks == 6
    for child in children:
        child.num_computed_tokens = 6
    assert manager.blocks_needed(children[0], 1) == 1, "a write into the shared partial block needs a copy"
    assert manager.allocate(children[0], 1)
    copy = children[0].block_ids[1]
    assert children[0].block_ids[0] == full and copy != partial
    assert manager.take_copies() == [(partial, copy)] and manager.take_copies() == []
    assert manager.ref_count(partial) == 2 and manager.ref_count(copy) == 1
    assert manager.allocate(children[1], 1) and manager.allocate(parent, 1)
    assert parent.block_ids[1] == partial, "the last holder writes in place"
    assert len(manager.take_copies()) == 1
    assert manager.ref_count(full) == 3, "full blocks are never written: they stay shared"
    for request in (parent, *children):
        manager.free(request)
    assert manager.num_free_blocks == 8 and all(manager.ref_count(b) == 0 for b in range(8))


def test_a_fork_at_a_block_boundary_copies_nothing_and_forks_replace_tables():
    manager = BlockManager(num_blocks=8, block_size=4)
    a, b = make_request(8), make_request(8)
    assert manager.allocate(a, 8) and manager.allocate(b, 8)
    a.num_computed_tokens = b.num_computed_tokens = 8
    old_b = list(b.block_ids)
    manager.fork([a, a], [a, b])  # b becomes a fork of a; a forks itself (a no-op)
    assert b.block_ids == a.block_ids and all(manager.ref_count(x) == 2 for x in a.block_ids)
    assert all(manager.is_free(x) for x in old_b), "the table b had is released"
    assert manager.allocate(b, 1) and manager.take_copies() == []
    assert b.block_ids[:2] == a.block_ids and len(b.block_ids) == 3


def test_a_failed_copy_on_write_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4)
    parent, child = make_request(2), make_request(2)
    assert manager.allocate(parent, 2)
    parent.num_computed_tokens = child.num_computed_tokens = 2
    manager.fork([parent], [child])
    filler = make_request(1)
    assert manager.allocate(filler, 1)  # the last free block
    table = list(child.block_ids)
    assert not manager.allocate(child, 1)
    assert child.block_ids == table and manager.ref_count(table[0]) == 2 and manager.take_copies() == []


def test_forked_prompt_blocks_stay_in_the_prefix_cache():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(3, 13))  # 2 full blocks and a partial one
    root = computed(manager, prompt)
    beams = [Request(i, list(prompt), StoppingParams(max_new_tokens=4)) for i in range(1, 4)]
    manager.fork([root] * 3, beams)
    manager.free(root)  # the prompt's own sequence lets go (in the engine it is the first beam)
    for beam in beams:
        beam.num_computed_tokens = len(prompt)
        beam.output_token_ids = [40 + beam.request_id]
        assert manager.allocate(beam, 1)
    assert len(manager.take_copies()) == 2, "the last holder of the partial block writes in place"
    cached = manager.num_cached_blocks
    assert cached == 2
    for beam in beams:  # each beam fills its own third block: registered under its own tokens
        beam.num_computed_tokens += 1
        beam.output_token_ids.append(50)
        assert manager.allocate(beam, 1)
        beam.num_computed_tokens += 1
        manager.cache_full_blocks(beam)
    assert manager.num_cached_blocks == cached + 3
    for beam in beams:
        manager.free(beam)
    assert manager.num_free_blocks == 16
    again = Request(9, prompt + [7], StoppingParams(max_new_tokens=4))
    assert manager.match_prefix(again) == 8 and again.block_ids == root_blocks(prompt, manager)


def root_blocks(prompt, manager):
    probe = Request(10, list(prompt), StoppingParams(max_new_tokens=4))
    manager.match_prefix(probe)
    blocks = list(probe.block_ids)
    manager.free(probe)
    return blocks


def test_repair_drops_pending_copies():
    manager = BlockManager(num_blocks=4, block_size=4)
    parent, child = make_request(2), make_request(2)
    assert manager.allocate(parent, 2)
    parent.num_computed_tokens = child.num_computed_tokens = 2
    manager.fork([parent], [child])
    assert manager.allocate(child, 1)
    manager.repair([parent, child])
    assert manager.pending_copies == []
    manager.check([parent, child])


class ForkMachine(RuleBasedStateMachine):
    """Random allocate / write / fork / free with a model of the KV contents: every request always reads
    back its own tokens (a shared block is never written), counts are exact, nothing leaks."""

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(num_blocks=24, block_size=4)
        self.store: dict[int, list] = {b: [None] * 4 for b in range(24)}
        self.requests: list[Request] = []
        self.tokens: dict[int, list[int]] = {}
        self.next_token = 0

    def _write(self, request, count):
        if not self.manager.allocate(request, count):
            assert self.manager.take_copies() == []
            return
        for src, dst in self.manager.take_copies():
            self.store[dst] = list(self.store[src])
        for position in range(request.num_computed_tokens, request.num_computed_tokens + count):
            block = request.block_ids[position // 4]
            assert self.manager.ref_count(block) == 1, "a write into a shared block"
            self.store[block][position % 4] = self.next_token
            self.tokens[id(request)].append(self.next_token)
            self.next_token += 1
        request.num_computed_tokens += count

    @rule(tokens=st.integers(1, 10))
    def add(self, tokens):
        request = make_request()
        self.requests.append(request)
        self.tokens[id(request)] = []
        self._write(request, tokens)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100), tokens=st.integers(1, 6))
    def write(self, index, tokens):
        self._write(self.requests[index % len(self.requests)], tokens)

    @precondition(lambda self: self.requests)
    @rule(parents=st.lists(st.integers(0, 100), min_size=1, max_size=4), fresh=st.integers(0, 2))
    def fork(self, parents, fresh):
        """Some existing requests (and `fresh` new ones) become forks of chosen parents, as a beam step."""
        sources = [self.requests[i % len(self.requests)] for i in parents]
        targets = list(dict.fromkeys(self.requests[(i * 7 + 1) % len(self.requests)] for i in parents))
        new = [make_request() for _ in range(fresh)]
        targets = (targets + new)[: len(sources)]
        sources = sources[: len(targets)]
        snapshot = [(list(self.tokens[id(s)]), s.num_computed_tokens) for s in sources]
        self.manager.fork(sources, targets)
        for target, (tokens, computed) in zip(targets, snapshot):
            self.tokens[id(target)] = tokens
            target.num_computed_tokens = computed
        self.requests.extend(r for r in new if r in targets)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def free(self, index):
        request = self.requests.pop(index % len(self.requests))
        self.manager.free(request)

    @invariant()
    def contents_and_counts(self):
        for request in self.requests:
            read = [self.store[request.block_ids[p // 4]][p % 4] for p in range(request.num_computed_tokens)]
            assert read == self.tokens[id(request)], "a request's KV was overwritten"
        self.manager.check(self.requests)

    def teardown(self):
        for request in self.requests:
            self.manager.free(request)
        assert self.manager.num_free_blocks == 24


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_state_slots_go_with_the_first_block_and_come_back_with_the_blocks():
    """A recurrent model's per-sequence state row: taken with the first block (all or nothing with it),
    given back by free, one per request, and what is left after an interruption is repaired."""
    manager = BlockManager(num_blocks=8, block_size=4, num_state_slots=2)
    a, b, c = make_request(), make_request(), make_request()
    assert manager.allocate(a, 5) and manager.allocate(b, 4)
    assert {a.state_slot, b.state_slot} == {0, 1} and manager.num_free_state_slots == 0
    a.num_computed_tokens = 5
    slot = a.state_slot
    assert manager.allocate(a, 4) and a.state_slot == slot  # growing keeps it
    assert not manager.allocate(c, 4)  # blocks are free, slots are not: nothing changes
    assert c.block_ids == [] and c.state_slot is None and manager.num_free_blocks == 4
    manager.check([a, b, c])
    manager.free(b)
    assert b.state_slot is None and manager.num_free_state_slots == 1
    assert manager.allocate(c, 4) and c.state_slot is not None
    manager.check([a, b, c])
    with pytest.raises(NotImplementedError, match="recurrent-layer state"):
        manager.fork([a], [b])
    # An interruption between taking a slot and listing the blocks: repair gives back what no table holds.
    c.block_ids = []
    manager.repair([a, b, c])
    assert c.state_slot is None and manager.num_free_state_slots == 1
    manager.check([a, b, c])
    a.state_slot = None  # a slot nobody holds any more is found by check
    with pytest.raises(AssertionError, match="blocks without a state slot"):
        manager.check([a, b, c])


def test_blocks_out_of_every_window_are_given_back_and_the_table_stays_positional():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(n_prompt=14)
    assert manager.allocate(request, 14)  # 4 blocks
    first = list(request.block_ids)
    request.num_computed_tokens = 14
    manager.release_before(request, 9)  # positions 0-7 (blocks 0 and 1) are never attended again
    assert request.block_ids == [-1, -1, *first[2:]] and request.num_slid_blocks == 2
    assert manager.num_free_blocks == 6 and all(manager.is_free(b) for b in first[:2])
    manager.release_before(request, 8)  # never taken back, never released twice
    assert request.num_slid_blocks == 2 and manager.num_free_blocks == 6
    manager.check([request])
    other = make_request()
    manager.fork([request], [other])  # a fork shares the held blocks and the slid entries
    assert other.block_ids == request.block_ids and other.num_slid_blocks == 2
    assert all(manager.ref_count(b) == 2 for b in first[2:])
    manager.check([request, other])
    manager.repair([request, other])
    manager.check([request, other])
    manager.free(other)
    manager.free(request)
    assert manager.num_free_blocks == 8 and request.num_slid_blocks == 0
    manager.check([request, other])


def test_given_back_generated_blocks_are_evicted_before_prompt_blocks():
    """A long generation gives back a block every few tokens: its prompt's blocks keep their place in the
    eviction order (a prompt sent again hits them), its generated tokens' blocks go first."""
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    request = make_request(n_prompt=8)  # prompt blocks 0-1; tokens 8-15 generated (blocks 2-3)
    request.output_token_ids = list(range(50, 58))
    assert manager.allocate(request, 16)
    blocks = list(request.block_ids)
    request.num_computed_tokens = 16
    manager.cache_full_blocks(request)
    manager.release_before(request, 16)
    # The generated ones first, then the never used ones, then the prompt's (its later block first, as
    # `free` orders them: a shared prefix's first blocks are evicted last).
    assert list(manager._free) == [blocks[2], blocks[3], *range(4, 8), blocks[1], blocks[0]]
    manager.check([request])
