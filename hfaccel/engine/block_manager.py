"""KV-cache blocks: who holds which block, and which blocks are free."""

from __future__ import annotations

from collections import deque

from hfaccel.engine.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size KV blocks to requests and takes them back.

    Every block has a reference count; a block is free exactly when its count is zero. Requests grow
    their block table one step at a time, all or nothing, so a failed allocation changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks `request` needs to compute `num_new_tokens` more tokens."""
        total = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request`'s block table to cover `num_new_tokens` more tokens; False (and no change) if
        there are not enough free blocks."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block_id = self._free.popleft()
            self._ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Release every block `request` holds."""
        for block_id in reversed(request.block_ids):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise AssertionError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                self._free.append(block_id)
        request.block_ids = []
