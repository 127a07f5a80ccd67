"""The running batch, and how one scheduled step of it is packed into model inputs.

`Batch.merge` and `Batch.filter` are the two operations continuous batching is made of: at every step
finished requests leave the batch and admitted ones join it, so the batch never waits for its slowest
member.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from hfaccel.engine.request import Request
from hfaccel.kernels.metadata import StepLayout, num_leading_decodes


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
    """What one step computes: `num_tokens[i]` new tokens of `requests[i]`."""

    requests: list[Request]
    num_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class PackedStep:
    """A scheduled step packed into one ``[1, T]`` row: no padding, positions restarting per sequence.

    Host-side lists only; the runner copies them into its persistent buffers.
    """

    input_ids: list[int]
    positions: list[int]
    logits_indices: list[int]  # packed positions whose logits are sampled
    sampled_requests: list[Request]  # the requests that get tokens this step
    layout: StepLayout
    # Logits rows of each sampled request, in order: 1, or 1 + k for a request verifying k drafts.
    rows_per_request: list[int] | None = None
    # The adapter of each packed token (its request's `adapter`), or None when no request has one.
    token_adapters: list[str | None] | None = None
    # Prompt positions fed as embeddings (`Request.prompt_embeds`): (packed index of the first token,
    # request, first prompt position, end position) per run; None when the step has none.
    prompt_embeds: list[tuple[int, Request, int, int]] | None = None


def pack_step(step: ScheduledStep, block_size: int, decode_query_len: int = 1) -> PackedStep:
    """Pack `step`; sequences the backend serves on its decode path (at most `decode_query_len` new
    tokens) go first, in the scheduler's order."""
    order = sorted(range(len(step)), key=lambda i: step.num_tokens[i] > decode_query_len)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    rows: list[int] = []
    adapters: list[str | None] | None = [] if any(r.adapter is not None for r in step.requests) else None
    embedded: list[tuple[int, Request, int, int]] = []
    for i in order:
        request, count = step.requests[i], step.num_tokens[i]
        start = request.num_computed_tokens
        end = start + count
        drafts = request.spec_token_ids
        if request.prompt_embeds is not None and start < len(request.prompt_embeds):
            embedded.append((len(input_ids), request, start, min(end, len(request.prompt_embeds))))
        verifying = bool(drafts) and request.num_uncomputed_tokens == 1 and count == 1 + len(drafts)
        if count == 1:
            input_ids.append(request.token_at(start))
        elif verifying:  # the last token, then the drafts: logits at every one of them
            input_ids.append(request.token_at(start))
            input_ids.extend(drafts)
        else:
            input_ids.extend(request.all_token_ids[start:end])
        positions.extend(range(start, end))
        if adapters is not None:
            adapters.extend([request.adapter] * count)
        blocks = request.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_lens.append(count)
        seq_lens.append(end)
        tables.append(blocks)
        if verifying:
            logits_indices.extend(range(len(input_ids) - count, len(input_ids)))
            sampled.append(request)
            rows.append(count)
        elif end == request.num_tokens:  # the step reaches the sequence's end: its last logits are sampled
            logits_indices.append(len(input_ids) - 1)
            sampled.append(request)
            rows.append(1)
    layout = StepLayout(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots,
        num_decodes=num_leading_decodes(query_lens, decode_query_len),
    )
    return PackedStep(input_ids, positions, logits_indices, sampled, layout, rows, adapters, embedded or None)
