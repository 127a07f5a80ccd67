"""KV blocks for models whose full-attention layers sit beside sliding-window ones (Gemma 2/3, gpt-oss,
Cohere 2): the sliding layers keep their K/V in a pool of their own.

A full layer reads every key a sequence has, a sliding layer only its last window. With one pool, every
block stays while a sequence grows, so the sliding layers' share of the cache grows with it. Here the
sliding layers' blocks come from a second, smaller `BlockManager` (the window pool), each request holding
a second table in it (`WindowTable`, positional like the first, in lockstep with it: the same length,
grown and trimmed together). Blocks wholly before the window go back to the window pool as the sequence
grows (`release_before`), so a sliding layer's memory stays bounded by its window; the full layers' table
keeps every block.

Prefix caching works in both pools. Both register each full block under the same key (its token
content chained over its parents'), and a window block given back keeps its key while it waits in the
free queue. A prompt then hits `k` leading blocks when the full pool holds all `k` and the window pool
holds those of them the first uncomputed token's window reaches back to (`match_prefix`): the window
table's entries before them are -1, as after a release.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hfaccel.engine.block_manager import SLID, BlockManager, blocks_for
from hfaccel.engine.request import Request


class WindowTable:
    """A request's table in the window pool: what `BlockManager` reads and writes of a request, its own
    table and hash chain, the request's tokens and progress read through."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.block_ids: list[int] = []
        self.num_slid_blocks = 0
        self.num_hashed_blocks = 0
        self.prefix_hash = 0
        self.cache_epoch = 0
        self.state_slot: int | None = None  # the window pool has no state slots
        # Given back even when the request's K/V is copied out (`Request.keep_kv`): the cache returned
        # holds the sliding layers' window only, as HF's sliding cache layers do (`ModelRunner.gather_kv`).
        self.keep_kv = False

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def cache_salt(self) -> Any:
        return self.request.cache_salt

    @property
    def speculation(self) -> Any:
        return self.request.speculation


def window_table(request: Request) -> WindowTable:
    """`request`'s table in the window pool (made empty on first use)."""
    table = request.window_table
    if table is None:
        table = request.window_table = WindowTable(request)
    return table


class HybridBlockManager(BlockManager):
    """The full layers' pool (this `BlockManager`: its counts, statistics and `num_blocks` are those the
    scheduler sees) and the sliding layers' pool (`window`), moved together request by request."""

    def __init__(
        self,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = BlockManager(num_window_blocks, block_size, enable_prefix_caching)
        self.kv_window = window  # the widest sliding window: what a query reaches back to

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Both tables grow, or neither does. The window table first gives back what lies before the
        next token's window and skips (-1 entries) what it does not reach yet: a request admitted with
        imported K/V, or past a prefix hit, holds window blocks for its window only."""
        view = window_table(request)
        first = max(0, request.num_computed_tokens - self.kv_window + 1) // self.block_size
        self.window.release_before(view, first * self.block_size)
        skipped = max(0, first - len(view.block_ids))
        view.block_ids.extend([SLID] * skipped)
        view.num_slid_blocks += skipped
        if self.window.blocks_needed(view, num_new_tokens) > self.window.num_free_blocks or not (
            super().allocate(request, num_new_tokens)
        ):
            del view.block_ids[len(view.block_ids) - skipped :]
            view.num_slid_blocks -= skipped
            return False
        if not self.window.allocate(view, num_new_tokens):  # checked above: cannot fail
            raise AssertionError("the window pool refused blocks it had")
        return True

    def take_window_copies(self) -> list[tuple[int, int]]:
        return self.window.take_copies()

    def copy_pending(self, request: Request) -> bool:
        return super().copy_pending(request) or self.window.copy_pending(window_table(request))

    @property
    def num_used_window_blocks(self) -> int:
        return self.window.num_used_blocks

    def fork(self, parents: Sequence[Request], children: Sequence[Request]) -> None:
        super().fork(parents, children)
        self.window.fork([window_table(p) for p in parents], [window_table(c) for c in children])

    def match_prefix(self, request: Request, limit: int | None = None) -> int:
        """Share the leading blocks both pools hold (see the module docstring); returns the tokens."""
        view = window_table(request)
        view.cache_epoch = self.window.epoch
        if not self.enable_prefix_caching or request.block_ids:
            return super().match_prefix(request, limit)
        keys = self.prefix_keys(request)
        hit = self.count_cached(keys)
        if limit is not None:
            hit = min(hit, limit)
        while hit > 0 and not self.window.holds(keys[self._first_kept(request, hit) : hit]):
            hit -= 1
        cached = super().match_prefix(request, hit)
        count = cached // self.block_size
        self.window.share(view, keys, self._first_kept(request, count), count)
        return cached

    def _first_kept(self, request: Request, count: int) -> int:
        """The first of `count` computed blocks `request` needs in the window pool: the first the next
        token's window reaches back to."""
        position = count * self.block_size  # the first uncomputed token
        return max(0, position - self.kv_window + 1) // self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        super().cache_full_blocks(request)
        self.window.cache_full_blocks(window_table(request))

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.window.reset_prefix_cache()

    def pause_sharing(self, paused: bool) -> None:
        super().pause_sharing(paused)
        self.window.pause_sharing(paused)

    def free(self, request: Request) -> None:
        view = request.window_table
        super().free(request)
        if view is not None:
            self.window.free(view)

    def release_before(self, request: Request, position: int) -> None:
        """Only the window pool gives blocks back: the full layers read every key."""
        self.window.release_before(window_table(request), position)

    def trim(self, request: Request, num_tokens: int) -> None:
        super().trim(request, num_tokens)
        self.window.trim(window_table(request), num_tokens)

    def repair(self, holders: Iterable[Request]) -> None:
        """Rebuild both pools; a request whose two tables left lockstep (an interruption between the two
        updates) has the longer one trimmed to the shorter."""
        holders = list(holders)
        for request in holders:
            view = window_table(request)
            length = min(len(request.block_ids), len(view.block_ids))
            del request.block_ids[length:]
            del view.block_ids[length:]
            request.num_hashed_blocks = min(request.num_hashed_blocks, length)
            view.num_hashed_blocks = min(view.num_hashed_blocks, length)
            view.num_slid_blocks = min(view.num_slid_blocks, length)
        super().repair(holders)
        self.window.repair(window_table(r) for r in holders)

    def check(self, holders: Iterable[Request]) -> None:
        holders = list(holders)
        super().check(holders)
        self.window.check(window_table(r) for r in holders)
        for request in holders:
            assert len(window_table(request).block_ids) == len(request.block_ids), "tables out of lockstep"


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Window-pool blocks enough for every running sequence's window and a step's new tokens (a sequence
    holds a window's blocks and one more, which a window straddles, and those of the step's new tokens)."""
    per_sequence = blocks_for(window, block_size) + 1
    return max_num_seqs * per_sequence + blocks_for(max_num_batched_tokens, block_size) + max_num_seqs


def make_block_manager(
    executor: Any,
    config: Any,
    max_model_len: int,
    num_blocks: int,
    state_slots: int,
    has_draft: bool,
) -> tuple[BlockManager, tuple[frozenset[int], int] | None]:
    """The engine's block manager over `num_blocks` blocks' worth of every layer, and the window pool the
    runner allocates (its sliding layers and blocks; None without one).

    A model whose sliding layers sit beside full ones gets a window pool of `window_pool_blocks` blocks
    (never more than `num_blocks`) and the full layers the rest of the budget. Not where the config
    turns it off (`window_pool`), with a draft model (its cache shares the target's block ids),
    recurrent state, or ranks that step together."""
    sliding = getattr(executor, "sliding_layers", {})
    off = not config.window_pool or has_draft or state_slots
    simple = not sliding or off or executor.step_sync is not None or executor.pipelined
    if simple:
        manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, state_slots)
        manager.kv_window = getattr(executor, "kv_window", None)  # every layer slides: blocks given back
        return manager, None
    window = max(sliding.values())
    size = config.block_size
    # The window pool holds every running sequence's window; the full layers get the rest of the budget
    # (never fewer blocks than one pool gives them), and what they cannot use goes back to the window
    # pool, where it keeps given-back blocks cached for prefix hits.
    layer_blocks, full_layers = num_blocks * executor.num_layers, executor.num_layers - len(sliding)
    steady = window_pool_blocks(window, size, config.max_num_seqs, config.max_num_batched_tokens)
    window_blocks = min(num_blocks, steady)
    full_blocks = (layer_blocks - window_blocks * len(sliding)) // full_layers
    full_blocks = min(full_blocks, config.max_num_seqs * blocks_for(max_model_len, size))
    window_blocks = min(num_blocks, (layer_blocks - full_blocks * full_layers) // len(sliding))
    manager = HybridBlockManager(full_blocks, window_blocks, size, window, config.enable_prefix_caching)
    return manager, (frozenset(sliding), window_blocks)


def kv_tables(request: Request) -> tuple[list[int], list[int] | None]:
    """Copies of `request`'s block tables: the full layers' and the window pool's (None without one)."""
    window = request.window_table
    return list(request.block_ids), None if window is None else list(window.block_ids)
