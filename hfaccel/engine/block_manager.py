"""KV-cache blocks: who holds which block, which are free, and which hold a cached prefix.

Automatic prefix caching (as in vLLM v1): every full block of a sequence is named by a hash chained over
its parent block's hash and its own tokens. When a request is admitted, the longest run of its leading
full blocks already in the cache is shared by reference count instead of recomputed. A freed block keeps
its contents and its hash while it waits in the free queue, least recently used first, so a later request
can still hit it; it is forgotten only when the queue hands it out again.

Keys name token content, so when the model that computed the blocks changes (new weights, another active
adapter), `reset_prefix_cache` must forget them all; it also starts a new epoch, so that requests already
running, whose KV mixes both models, never register their blocks afterwards. A request's `cache_salt`
(its LoRA adapter) is folded into its first block's parent hash: requests served by different adapters in
the same batch never share a block, requests of the same adapter do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from hfaccel.engine.request import Request


def _root(request: Request) -> int:
    """The parent hash of a request's first block: 0, or a value derived from its `cache_salt`."""
    salt = request.cache_salt
    return 0 if salt is None else hash(("cache_salt", salt))


SLID = -1  # a table entry whose block a sliding-window model no longer attends to (`release_before`)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found there."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def record(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit


class BlockManager:
    """Hands out fixed-size KV blocks to requests and takes them back.

    A block is free exactly when its reference count is zero; only free blocks are ever handed out (and
    so overwritten). Requests grow their block table all or nothing: a failed allocation changes nothing.
    """

    # The window before which a sequence's blocks are given back as it grows (`release_before`): set
    # where every attention layer slides, or by a window pool (`window_blocks`); None: kept.
    kv_window: int | None = None

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        num_state_slots: int = 0,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._sharing_configured = enable_prefix_caching  # `pause_sharing` turns it off and back
        self._ref_counts = [0] * num_blocks
        # Free blocks in eviction order (least recently freed first); a dict for O(1) removal on a hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent hash, tokens) -> block id
        self.epoch = 0  # bumped by reset_prefix_cache; a request admitted in an older one never registers
        self.stats = PrefixCacheStats()
        # Copy-on-write: (source, destination) block copies the next forward must be preceded by.
        self.pending_copies: list[tuple[int, int]] = []
        # Rows of a recurrent model's per-sequence state (`patches/recurrent.py`): a request takes one
        # with its first block and gives it back with its blocks, so a slot outlives no request and a
        # request that holds blocks always holds one. 0: the model has no recurrent layers.
        self.num_state_slots = num_state_slots
        self._free_slots: list[int] = list(reversed(range(num_state_slots)))

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks `request` needs to compute `num_new_tokens` more tokens (copies of shared blocks
        it would write into included)."""
        total = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids)) + len(self._shared_writes(request, num_new_tokens))

    def _shared_writes(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices in `request`'s table of blocks that computing `num_new_tokens` more tokens writes into
        while another request holds them too (a beam forked from its parent shares its last, partly
        filled block). Only a fork creates them: prefix-cache hits are full blocks, never written."""
        if num_new_tokens <= 0:
            return []
        start = request.num_computed_tokens
        first = start // self.block_size
        last = min((start + num_new_tokens - 1) // self.block_size, len(request.block_ids) - 1)
        return [i for i in range(first, last + 1) if self._ref_counts[request.block_ids[i]] > 1]

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request`'s block table to cover `num_new_tokens` more tokens; False (and no change) if
        there are not enough free blocks.

        Copy on write: a block the new tokens would be written into that other requests also hold is
        replaced by a fresh block, and the copy of its contents is queued in `pending_copies` (the engine
        runs it before the forward), so a shared block is never written."""
        shared = self._shared_writes(request, num_new_tokens)
        total = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
        grow = max(0, total - len(request.block_ids))
        if grow + len(shared) > len(self._free):
            return False
        if self.num_state_slots and request.state_slot is None:
            if not self._free_slots:
                return False
            request.state_slot = self._free_slots.pop()
        blocks = list(islice(self._free, grow + len(shared)))
        for block_id in blocks:  # counted before the request lists them: never held uncounted
            self._ref_counts[block_id] = 1
            del self._free[block_id]
            self._forget(block_id)
        for index, block_id in zip(shared, blocks[grow:]):
            old = request.block_ids[index]
            self.pending_copies.append((old, block_id))
            request.block_ids[index] = block_id  # listed, then the shared one loses a holder (still >= 1)
            self._ref_counts[old] -= 1
        request.block_ids.extend(blocks[:grow])
        return True

    def fork(self, parents: Sequence[Request], children: Sequence[Request]) -> None:
        """Make each of `children` a copy-on-write fork of the matching one of `parents`: it shares every
        block of its parent's table (one reference more each) and lets go of the table it had (one
        reference less each). Parents may repeat and may be among the children: every parent's table is
        read before any child's is replaced. The children's tokens are the caller's business.

        Counted before listed, unlisted before uncounted: an interruption leaves blocks counted too high
        (a leak `repair` reclaims), never a block held but counted free."""
        if self.num_state_slots:  # the planner sends beams of recurrent models to transformers
            raise NotImplementedError("forking a sequence with recurrent-layer state is not implemented")
        tables = [(list(p.block_ids), p.num_hashed_blocks, p.prefix_hash, p.cache_epoch) for p in parents]
        for blocks, *_ in tables:
            for block_id in blocks:
                if block_id != SLID:
                    self._ref_counts[block_id] += 1
        released = []
        slid = {id(child): parent.num_slid_blocks for parent, child in zip(parents, children)}
        for child, (blocks, hashed, prefix_hash, epoch) in zip(children, tables):
            released.append(child.block_ids[child.num_slid_blocks :])
            child.block_ids, child.num_slid_blocks = blocks, slid[id(child)]
            child.num_hashed_blocks, child.prefix_hash, child.cache_epoch = hashed, prefix_hash, epoch
        for blocks in released:
            self._release(blocks)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies queued by copy on write since the last call (the engine runs them)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def copy_pending(self, request: Request) -> bool:
        """Whether a queued copy on write (not run yet) fills one of `request`'s blocks."""
        return any(dst in request.block_ids for _, dst in self.pending_copies)

    def take_window_copies(self) -> list[tuple[int, int]]:
        """The same for a window pool's blocks (`window_blocks.HybridBlockManager`; none here)."""
        return []

    @property
    def num_used_window_blocks(self) -> int:
        """Blocks in use in a window pool (`window_blocks.HybridBlockManager`; none here)."""
        return 0

    def pause_sharing(self, paused: bool) -> None:
        """Share and register no blocks while `paused` (the model draws dropout in its forward: KV is not a
        function of the tokens, so each request computes its own, as transformers' rows do). Requests
        admitted meanwhile never register theirs later: the change that ends the pause also resets the
        cache (a new epoch)."""
        self.enable_prefix_caching = self._sharing_configured and not paused

    def match_prefix(self, request: Request, limit: int | None = None) -> int:
        """Share the cached blocks of `request`'s leading full blocks (at most `limit` of them); returns
        the tokens they cover.

        Call on a request that holds no blocks, when admitting it (this records the cache epoch it runs
        in). At least one token is always left to compute, so the step that admits the request produces
        logits for its last position.
        """
        request.cache_epoch = self.epoch
        if not self.enable_prefix_caching or request.block_ids:
            return 0
        tokens = request.all_token_ids
        limit = min((len(tokens) - 1) // self.block_size, len(tokens) if limit is None else limit)
        parent = _root(request)
        blocks: list[int] = []
        for index in range(limit):  # look up first, change nothing
            key = self._key(parent, tokens, index)
            block_id = self._cached.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
            parent = hash(key)
        for block_id in blocks:  # then count, then list: never held uncounted
            self._ref_counts[block_id] += 1
            self._free.pop(block_id, None)
        request.block_ids.extend(blocks)
        request.num_hashed_blocks, request.prefix_hash = len(blocks), parent
        return len(blocks) * self.block_size

    def share(self, request: Any, keys: list[tuple[int, tuple[int, ...]]], first: int, count: int) -> None:
        """Give `request` (holding no blocks) the cached blocks of `keys[first:count]` (all cached: see
        `holds`) at those table positions, its entries before `first` given back (`SLID`) as a
        sliding-window model's are once the window moved past them."""
        blocks = [self._cached[key] for key in keys[first:count]]
        for block_id in blocks:  # counted, then listed
            self._ref_counts[block_id] += 1
            self._free.pop(block_id, None)
        request.block_ids.extend([SLID] * first + blocks)
        request.num_slid_blocks = first
        request.num_hashed_blocks = count
        request.prefix_hash = hash(keys[count - 1]) if count else _root(request)

    def holds(self, keys: Iterable[tuple[int, tuple[int, ...]]]) -> bool:
        """Whether every one of `keys` names a cached block."""
        return all(key in self._cached for key in keys)

    def next_block_key(self, request: Request) -> tuple[int, tuple[int, ...]] | None:
        """The cache key of the first block `request` computes, after `match_prefix` shared what was
        cached, if that block could ever be shared (a full block before its last token)."""
        tokens, index = request.all_token_ids, request.num_hashed_blocks
        if not self.enable_prefix_caching or index >= (len(tokens) - 1) // self.block_size:
            return None
        return self._key(request.prefix_hash, tokens, index)

    def chunk_keys(self, request: Request, count: int) -> list[tuple[int, tuple[int, ...]]]:
        """The cache keys of the shareable blocks that `count` tokens of `request` from its computed ones
        write this step (the last one maybe in part): a request admitted beside it that would compute
        one of them waits a step and shares it."""
        start, size = request.num_computed_tokens, self.block_size
        if not self.enable_prefix_caching or count < 2 or start >= len(request.prompt_token_ids):
            return []  # (decode rows write no block another prompt may share)
        tokens, keys = request.all_token_ids, []
        end = min(-(-(start + count) // size), (len(tokens) - 1) // size)
        parent = request.prefix_hash if request.num_hashed_blocks else _root(request)
        for index in range(request.num_hashed_blocks, end):  # the chain from where the request got to
            key = self._key(parent, tokens, index)
            parent = hash(key)
            if index >= start // size:
                keys.append(key)
        return keys

    def prefix_keys(self, request: Request) -> list[tuple[int, tuple[int, ...]]]:
        """The cache keys of `request`'s leading full blocks that `match_prefix` may share (a pure
        function of its tokens: callers may keep it)."""
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        keys, parent = [], _root(request)
        for index in range((len(tokens) - 1) // self.block_size):
            key = self._key(parent, tokens, index)
            keys.append(key)
            parent = hash(key)
        return keys

    def count_cached(self, keys: list[tuple[int, tuple[int, ...]]]) -> int:
        """How many of `keys` (from `prefix_keys`) are cached, from the first: what `match_prefix` would
        share now, in blocks. Changes nothing."""
        count = 0
        for key in keys:
            if key not in self._cached:
                break
            count += 1
        return count

    def cache_full_blocks(self, request: Request) -> None:
        """Register `request`'s blocks that are now full of computed tokens, so later requests can share
        them. Incremental: the request carries how far its hash chain got. A request admitted before the
        last `reset_prefix_cache` registers nothing: its KV was (partly) computed by the old model."""
        if not self.enable_prefix_caching or request.cache_epoch != self.epoch:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if full <= request.num_hashed_blocks:
            return
        tokens = request.all_token_ids
        parent = request.prefix_hash if request.num_hashed_blocks else _root(request)
        for index in range(request.num_hashed_blocks, full):
            block_id = request.block_ids[index]
            key = self._key(parent, tokens, index)
            if (
                key not in self._cached and block_id != SLID
            ):  # the same content may sit in another block already
                self._cached[key] = block_id
                self._block_key[block_id] = key
            parent = hash(key)
        request.num_hashed_blocks, request.prefix_hash = full, parent

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, free or in use: the contents stay (requests holding the blocks keep
        using them) but no later request can match them. Starts a new epoch, so requests admitted before
        the reset never register their blocks either. Call when the model that computed them changed."""
        self._cached.clear()
        self._block_key = [None] * self.num_blocks
        self.epoch += 1

    def free(self, request: Request) -> None:
        """Release every block `request` holds (cached ones stay findable until they are reused).

        The request lets go of its table first, then the counts drop: an interruption midway leaves
        blocks counted too high (a leak `repair` reclaims), never a block counted below its holders, and
        a retry never frees a block twice.
        """
        blocks = request.block_ids[request.num_slid_blocks :]
        request.block_ids, request.num_slid_blocks = [], 0
        slot, request.state_slot = request.state_slot, None
        if slot is not None:
            self._free_slots.append(slot)
        request.num_hashed_blocks, request.prefix_hash = 0, 0
        request.speculation.draft_computed = (
            0  # a draft model's KV lives in the same block ids: gone with them
        )
        self._release(blocks)

    def _release(self, blocks: list[int], evict_first: bool = False) -> None:
        """One holder fewer for each of `blocks` (already unlisted by their holder); those freed join the
        free queue's end, or with `evict_first` its front (the first to be handed out again)."""
        # Tail blocks first: under LRU eviction they go before the prefix blocks others may share.
        for block_id in reversed(blocks):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise AssertionError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                self._free[block_id] = None
                if evict_first:
                    self._free.move_to_end(block_id, last=False)

    def release_before(self, request: Request, position: int) -> None:
        """Give back `request`'s blocks wholly before `position`: a model whose every attention layer
        slides never attends to them again. Their table entries become -1 (`SLID`; the table stays
        positional) and stay so until the request lets go of its table. Not a request whose K/V is copied
        out whole when it finishes (`keep_kv`).

        Blocks of prompt tokens keep their place in the eviction order (a prompt sent again hits them);
        blocks with generated tokens go to the front of the free queue. A long generation gives back a
        block every `block_size` tokens, and behind them its prompt's blocks would soon be evicted."""
        if request.keep_kv:  # its K/V is copied out whole when it finishes
            return
        count = min(position // self.block_size, len(request.block_ids))
        start = request.num_slid_blocks
        if count <= start:
            return
        released = request.block_ids[start:count]
        request.block_ids[start:count] = [SLID] * (count - start)
        request.num_slid_blocks = count
        prompt = max(start, min(count, len(request.prompt_token_ids) // self.block_size))
        self._release(released[: prompt - start])
        self._release(released[prompt - start :], evict_first=True)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks of `request` past what `num_tokens` tokens need (the lookahead blocks of
        rejected drafts). Same order as `free`: the table shrinks first, then the counts drop."""
        keep = max(blocks_for(num_tokens, self.block_size), request.num_hashed_blocks)
        if len(request.block_ids) <= keep:
            return
        tail = request.block_ids[keep:]
        request.block_ids = request.block_ids[:keep]
        self._release(tail)

    def repair(self, holders: Iterable[Request]) -> None:
        """Rebuild the reference counts, the free queue and the prefix-cache index from the block tables
        of `holders` (every request that may hold blocks), after an exception interrupted an update.

        Free blocks keep their LRU order; blocks that nobody holds any more join the end of the queue.
        A cache entry survives only if the block and the index agree on its key.
        """
        counts = [0] * self.num_blocks
        holders = list(holders)
        for request in holders:
            for block_id in request.block_ids[request.num_slid_blocks :]:
                counts[block_id] += 1
        # State slots: a holder without blocks gives its slot back; every slot nobody holds is free.
        held = set()
        for request in holders:
            if request.state_slot is not None and (not request.block_ids or request.state_slot in held):
                request.state_slot = None
            if request.state_slot is not None:
                held.add(request.state_slot)
        self._free_slots = [s for s in reversed(range(self.num_state_slots)) if s not in held]
        free = OrderedDict((b, None) for b in self._free if counts[b] == 0)
        free.update((b, None) for b in range(self.num_blocks) if counts[b] == 0 and b not in free)
        cached = {key: b for key, b in self._cached.items() if self._block_key[b] == key}
        block_key = [None] * self.num_blocks
        for key, b in cached.items():
            block_key[b] = key
        self._ref_counts, self._free, self._cached, self._block_key = counts, free, cached, block_key
        self.pending_copies = []  # the step they were for failed

    def check(self, holders: Iterable[Request]) -> None:
        """Raise AssertionError unless the counts, the free queue, the cache index and the state slots
        match `holders`."""
        holders = list(holders)
        counts = [0] * self.num_blocks
        for request in holders:
            for block_id in request.block_ids[request.num_slid_blocks :]:
                counts[block_id] += 1
        assert self._ref_counts == counts, "reference counts differ from the requests' block tables"
        if self.num_state_slots:
            held = [r.state_slot for r in holders if r.state_slot is not None]
            assert len(held) == len(set(held)), "a state slot is held twice"
            assert all(r.state_slot is not None for r in holders if r.block_ids), (
                "blocks without a state slot"
            )
            assert sorted(held + self._free_slots) == list(range(self.num_state_slots)), "state slots leak"
        assert set(self._free) == {b for b in range(self.num_blocks) if counts[b] == 0}, "free queue is off"
        for key, b in self._cached.items():
            assert self._block_key[b] == key, f"cache index and block {b} disagree"

    def _key(self, parent: int, tokens: list[int], index: int) -> tuple[int, tuple[int, ...]]:
        # The tokens themselves are part of the key, so two different blocks can never collide.
        return parent, tuple(tokens[index * self.block_size : (index + 1) * self.block_size])

    def _forget(self, block_id: int) -> None:
        key = self._block_key[block_id]
        if key is not None:
            self._block_key[block_id] = None
            if self._cached.get(key) == block_id:
                del self._cached[key]
