"""The sliding layers' own block pool (`engine/window_blocks.py`): two tables in lockstep, window blocks
given back as a sequence grows, prefix hits that need both pools, repair, and a whole engine over a
model with full and sliding layers under random operations and faults."""

from hypothesis import settings
from hypothesis.stateful import invariant

from hfaccel.bench.families import family_model
from hfaccel.engine.block_manager import SLID
from hfaccel.engine.request import Request, StoppingParams
from hfaccel.engine.window_blocks import HybridBlockManager, kv_tables, window_pool_blocks, window_table
from tests.engine.test_engine_invariants import EngineMachine, check_cached_blocks_unchanged


def admitted(manager: HybridBlockManager, prompt: list[int], keep_kv: bool = False) -> Request:
    """A request for `prompt` admitted (sharing what both pools hold), its prompt computed, its full
    blocks registered and its blocks before the window given back, as the scheduler does."""
    request = Request(0, list(prompt), StoppingParams(max_new_tokens=4))
    request.keep_kv = keep_kv
    request.num_computed_tokens = manager.match_prefix(request)
    assert manager.allocate(request, len(prompt) - request.num_computed_tokens)
    request.num_computed_tokens = len(prompt)
    manager.cache_full_blocks(request)
    manager.release_before(request, request.num_computed_tokens - manager.kv_window + 1)
    return request


def test_both_tables_grow_together_and_only_the_window_table_gives_blocks_back():
    manager = HybridBlockManager(
        num_blocks=16, num_window_blocks=6, block_size=4, window=6, enable_prefix_caching=True
    )
    request = admitted(manager, list(range(10, 30)))  # 20 tokens, 5 blocks; the next token sees 15-20
    window = window_table(request)
    assert len(request.block_ids) == len(window.block_ids) == 5
    assert SLID not in request.block_ids  # the full layers read every key
    assert window.block_ids[:3] == [SLID] * 3 and window.num_slid_blocks == 3
    assert manager.num_free_blocks == 11 and manager.window.num_free_blocks == 4
    manager.check([request])
    manager.free(request)
    assert request.block_ids == [] and window.block_ids == []
    assert manager.num_free_blocks == 16 and manager.window.num_free_blocks == 6


def test_an_allocation_either_pool_cannot_cover_changes_neither():
    manager = HybridBlockManager(
        num_blocks=16, num_window_blocks=2, block_size=4, window=4, enable_prefix_caching=True
    )
    request = Request(0, list(range(10, 22)), StoppingParams(max_new_tokens=4))
    assert not manager.allocate(request, 12)  # 3 window blocks of 2
    assert request.block_ids == [] and window_table(request).block_ids == []
    assert manager.num_free_blocks == 16 and manager.window.num_free_blocks == 2
    manager.check([request])


def test_a_prefix_hit_takes_the_full_blocks_and_the_window_blocks_its_next_token_sees():
    manager = HybridBlockManager(
        num_blocks=16, num_window_blocks=8, block_size=4, window=6, enable_prefix_caching=True
    )
    prompt = list(range(10, 30))
    first = admitted(manager, prompt)
    second = Request(1, prompt + [40, 41], StoppingParams(max_new_tokens=4))
    assert manager.match_prefix(second) == 20
    # 5 full blocks hit (20 tokens); the next token (20) sees 15-20: window blocks 3 and 4 shared.
    assert second.block_ids == first.block_ids
    window, first_window = window_table(second), window_table(first)
    assert window.block_ids == [SLID] * 3 + first_window.block_ids[3:5] and window.num_slid_blocks == 3
    assert window.num_hashed_blocks == 5
    manager.check([first, second])
    manager.free(first)
    manager.free(second)
    manager.check([first, second])


def test_a_hit_shrinks_to_what_the_window_pool_still_holds():
    """Full blocks stay cached longer than window blocks (their pool is larger): the hit is the longest
    prefix whose window blocks are cached too."""
    manager = HybridBlockManager(
        num_blocks=32, num_window_blocks=8, block_size=4, window=4, enable_prefix_caching=True
    )
    prompt = list(range(10, 29))  # 19 tokens: 4 full blocks; the window gives back 0-3 (ids 0-3)
    running = admitted(manager, prompt)
    assert window_table(running).num_slid_blocks == 4
    # The least recently freed window block, index 3 (the next token's window), is taken and forgotten.
    other = admitted(manager, list(range(100, 116)))
    assert 3 in window_table(other).block_ids
    again = Request(1, prompt[:16] + [50, 51, 52], StoppingParams(max_new_tokens=4))
    # 4 full blocks are cached, but a hit of 4 needs window block 3: 3 blocks (the window of position 12
    # reaches back to 9: block 2, still cached).
    assert manager.match_prefix(again) == 12
    assert again.block_ids == running.block_ids[:3]
    assert window_table(again).block_ids == [SLID, SLID, 2]
    manager.check([running, other, again])
    for request in (running, other, again):
        manager.free(request)
    manager.check([running, other, again])


def test_a_request_whose_kv_is_copied_out_gives_window_blocks_back_too():
    """The cache returned to a caller holds the sliding layers' window only (HF's sliding cache layers
    drop the rest): its window table gives blocks back like any other, its full table keeps them all."""
    manager = HybridBlockManager(
        num_blocks=16, num_window_blocks=16, block_size=4, window=4, enable_prefix_caching=True
    )
    kept = admitted(manager, list(range(10, 30)), keep_kv=True)
    assert SLID not in kept.block_ids and window_table(kept).num_slid_blocks == 4
    manager.check([kept])


def test_repair_puts_two_tables_out_of_lockstep_back_in_it():
    manager = HybridBlockManager(
        num_blocks=16, num_window_blocks=8, block_size=4, window=6, enable_prefix_caching=True
    )
    request = admitted(manager, list(range(10, 22)))
    request.block_ids.append(manager._free.popitem(last=False)[0])  # interrupted before the window grew
    manager.repair([request])
    manager.check([request])
    assert len(request.block_ids) == len(window_table(request).block_ids) == 3


def test_forks_share_both_tables():
    manager = HybridBlockManager(
        num_blocks=16, num_window_blocks=8, block_size=4, window=4, enable_prefix_caching=True
    )
    parent = admitted(manager, list(range(10, 22)))
    child = Request(1, list(range(10, 22)), StoppingParams(max_new_tokens=4))
    manager.fork([parent], [child])
    assert kv_tables(child) == kv_tables(parent)
    manager.check([parent, child])
    assert manager.allocate(child, 1) and manager.allocate(parent, 1)
    manager.check([parent, child])


def test_the_window_pool_covers_every_sequences_window_and_a_steps_tokens():
    # 6 x (2 blocks of window + 1 it straddles) + 4 blocks of 16 new tokens + 1 partial block each
    assert window_pool_blocks(8, 4, max_num_seqs=6, max_num_batched_tokens=16) == 28


# --- A whole engine over a model whose first layer attends in full and second slides (a window of 6
# positions, blocks of 4), under the invariant machine's random operations and faults.
HYBRID = family_model("gemma3_text", num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
HYBRID.config.sliding_window = 6


class HybridEngineMachine(EngineMachine):
    """`EngineMachine` over the hybrid model: both pools keep their invariants (`check_consistent` checks
    both), cached window blocks in use are never overwritten, and neither pool leaks."""

    model = HYBRID
    extra_config = {"kv_cache_memory": 48 * 1024}  # 24 blocks of both layers

    def __init__(self):
        super().__init__()
        manager = self.engine.block_manager
        assert isinstance(manager, HybridBlockManager) and manager.window.num_blocks == 24
        self.window_snapshots = {}

    @invariant()
    def cached_window_blocks_in_use_are_never_overwritten(self):
        pool, k_cache = self.engine.block_manager.window, self.engine.runner.kv_caches[1][0]
        self.window_snapshots = check_cached_blocks_unchanged(pool, k_cache, self.window_snapshots)

    def teardown(self):
        super().teardown()
        pool = self.engine.block_manager.window
        assert pool.num_free_blocks == pool.num_blocks, "window blocks leaked"


TestHybridEngineMachine = HybridEngineMachine.TestCase
TestHybridEngineMachine.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)


def test_a_request_admitted_past_its_start_holds_window_blocks_for_its_window_only():
    """Imported K/V (a continued cache) puts a request's first computed token far past its start: its
    window table skips (-1) the blocks before that token's window instead of taking them all."""
    manager = HybridBlockManager(num_blocks=64, num_window_blocks=4, block_size=4, window=6)
    request = Request(0, list(range(10, 110)), StoppingParams(max_new_tokens=4))
    request.num_computed_tokens = 96  # imported: the window of token 96 reaches back to 91 (block 22)
    assert manager.allocate(request, 4)
    window = window_table(request)
    assert len(window.block_ids) == len(request.block_ids) == 25
    assert window.block_ids[:22] == [SLID] * 22 and window.num_slid_blocks == 22
    assert manager.window.num_used_blocks == 3
    manager.check([request])
    failing = Request(1, list(range(10, 110)), StoppingParams(max_new_tokens=4))
    failing.num_computed_tokens = 80
    assert not manager.allocate(failing, 20)  # 5 window blocks of 4: nothing changes
    assert window_table(failing).block_ids == [] and failing.block_ids == []
    manager.check([request, failing])
