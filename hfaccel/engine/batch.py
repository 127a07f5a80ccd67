"""The running batch, and how one scheduled step of it is packed into model inputs.

`Batch.merge` and `Batch.filter` are the two operations continuous batching is made of: at every step
finished requests leave the batch and admitted ones join it, so the batch never waits for its slowest
member.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from hfaccel.engine.request import Request
from hfaccel.kernels.metadata import AttentionMetadata


class Batch:
    """An ordered set of running requests."""

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self.requests: list[Request] = []
        self.merge(requests)

    def merge(self, requests: Iterable[Request]) -> Batch:
        """Append `requests` (in order) to the batch; a request already in it raises ValueError."""
        present = {id(r) for r in self.requests}
        for request in requests:
            if id(request) in present:
                raise ValueError(f"request {request.request_id!r} is already in the batch")
            present.add(id(request))
            self.requests.append(request)
        return self

    def filter(self, keep: Callable[[Request], bool]) -> list[Request]:
        """Keep the requests for which `keep` is true (order preserved); return the ones removed."""
        kept, removed = [], []
        for request in self.requests:
            (kept if keep(request) else removed).append(request)
        self.requests = kept
        return removed

    def remove(self, request: Request) -> None:
        """Take one request out of the batch."""
        self.requests.remove(request)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self.requests)


@dataclass
class ScheduledStep:
    """What one step computes: `num_tokens[i]` new tokens of `requests[i]`, one-token entries first."""

    requests: list[Request]
    num_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class StepInputs:
    """A packed step, ready for the model."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [N] packed positions whose logits are sampled
    sampled_requests: list[Request]  # the N requests that get a token this step
    metadata: AttentionMetadata


def pack_step(step: ScheduledStep, block_size: int, device: torch.device) -> StepInputs:
    """Pack `step` into one ``[1, T]`` row: no padding, positions restarting per sequence."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    num_decodes = 0
    for request, count in zip(step.requests, step.num_tokens):
        start = request.num_computed_tokens
        end = start + count
        if count == 1:
            num_decodes += 1
            input_ids.append(request.token_at(start))
        else:
            input_ids.extend(request.all_token_ids[start:end])
        positions.extend(range(start, end))
        blocks = request.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(query_start_loc[-1] + count)
        seq_lens.append(end)
        if end == request.num_tokens:  # the step reaches the sequence's end: its last logits are sampled
            logits_indices.append(query_start_loc[-1] - 1)
            sampled.append(request)
    if any(c == 1 for c in step.num_tokens[num_decodes:]):
        raise AssertionError("one-token sequences must come first in a scheduled step")
    max_blocks = max(len(r.block_ids) for r in step.requests)
    block_tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in step.requests]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=torch.tensor(block_tables, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        block_size=block_size,
        kv_caches=(),
    )
    return StepInputs(
        input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        sampled_requests=sampled,
        metadata=metadata,
    )
