"""The running batch, and how one scheduled step of it is packed into model inputs.

`Batch.merge` and `Batch.filter` are the two operations continuous batching is made of: at every step
finished requests leave the batch and admitted ones join it, so the batch never waits for its slowest
member.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

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
    # Requests that record what the model computes (`recorded_states.py`): (packed index of the first
    # token, request, first position, token count, sequence length); None when the step has none.
    recorded: list[tuple[int, Request, int, int, int]] | None = None


class StepPacker:
    """Sequences appended one after another into one packed ``[1, T]`` row: token ids, positions, KV
    slots, and the lists of the step's `StepLayout` (`pack_step` and the draft model's passes)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.query_lens: list[int] = []
        self.seq_lens: list[int] = []
        self.tables: list[list[int]] = []
        # The sliding layers' tables and slots, for a model that keeps them in a pool of their own.
        self.window_tables: list[list[int]] = []
        self.window_slots: list[int] = []
        self.logits_indices: list[int] = []
        self.state_slots: list[int] = []

    def add(
        self,
        tokens: list[int],
        start: int,
        blocks: list[int],
        state_slot: int | None = None,
        positions: list[int] | range | None = None,
        window_blocks: list[int] | None = None,
    ) -> None:
        """One sequence's `tokens` at cache indices ``start..`` (and model `positions`, by default the
        same), its K/V written into `blocks` (and the sliding layers' into `window_blocks`, where they
        have a pool of their own; its recurrent state into row `state_slot`, for a model with recurrent
        layers)."""
        end = start + len(tokens)
        size = self.block_size
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, end) if positions is None else positions)
        self.slots.extend(blocks[p // size] * size + p % size for p in range(start, end))
        self.query_lens.append(len(tokens))
        self.seq_lens.append(end)
        self.tables.append(blocks)
        if window_blocks is not None:
            self.window_slots.extend(window_blocks[p // size] * size + p % size for p in range(start, end))
            self.window_tables.append(window_blocks)
        if state_slot is not None:
            self.state_slots.append(state_slot)

    def add_query_only(
        self, token: int, position: int, index: int, blocks: list[int], window_blocks: list[int] | None = None
    ) -> None:
        """A token fed for its logits alone (`Request.masked_last`): it sees the `index` tokens before
        it and not itself (its sequence ends before it), and its K/V goes to its own slot, `index`, which
        the next token fed there overwrites before anything reads it."""
        size = self.block_size
        self.input_ids.append(token)
        self.positions.append(position)
        self.slots.append(blocks[index // size] * size + index % size)
        self.query_lens.append(1)
        self.seq_lens.append(index)
        self.tables.append(blocks)
        if window_blocks is not None:
            self.window_slots.append(window_blocks[index // size] * size + index % size)
            self.window_tables.append(window_blocks)

    def layout(self, decode_query_len: int) -> StepLayout:
        return StepLayout(
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
            block_tables=self.tables,
            slot_mapping=self.slots,
            num_decodes=num_leading_decodes(self.query_lens, decode_query_len),
            state_slots=self.state_slots if len(self.state_slots) == len(self.tables) else None,
            window_block_tables=self.window_tables if self.window_tables else None,
            window_slot_mapping=self.window_slots if self.window_tables else None,
        )


def readable_table(table: Any) -> list[int]:
    """A block table (a request's or its `WindowTable`) as the kernels take it: entries given back
    (outside every window, never read) name block 0, any valid id."""
    if not table.num_slid_blocks:
        return table.block_ids
    return [0] * table.num_slid_blocks + table.block_ids[table.num_slid_blocks :]


def pack_step(step: ScheduledStep, block_size: int, decode_query_len: int = 1) -> PackedStep:
    """Pack `step`; sequences the backend serves on its decode path (at most `decode_query_len` new
    tokens) go first, in the scheduler's order."""
    order = sorted(range(len(step)), key=lambda i: step.num_tokens[i] > decode_query_len)
    packer = StepPacker(block_size)
    logits_indices = packer.logits_indices
    sampled: list[Request] = []
    rows: list[int] = []
    adapters: list[str | None] | None = [] if any(r.adapter is not None for r in step.requests) else None
    embedded: list[tuple[int, Request, int, int]] = []
    recorded: list[tuple[int, Request, int, int, int]] = []
    for i in order:
        request, count = step.requests[i], step.num_tokens[i]
        start = request.num_computed_tokens
        end = start + count
        drafts = request.speculation.drafts
        if request.prompt_embeds is not None and start < len(request.prompt_embeds):
            embedded.append((len(packer.input_ids), request, start, min(end, len(request.prompt_embeds))))
        verifying = bool(drafts) and request.num_uncomputed_tokens == 1 and count == 1 + len(drafts)
        if count == 1:
            tokens = [request.token_at(start)]
        elif verifying:  # the last token, then the drafts: logits at every one of them
            tokens = [request.token_at(start), *drafts]
        else:
            tokens = request.all_token_ids[start:end]
        blocks = readable_table(request)
        window = None if request.window_table is None else readable_table(request.window_table)
        if request.masked_last and end == request.num_tokens:  # its query-only last token, alone
            packer.add_query_only(tokens[0], request.positions(start, end)[0], start, blocks, window)
        else:
            positions = request.positions(start, end)
            packer.add(tokens, start, blocks, request.state_slot, positions, window)
        if request.sampling.output_hidden_states or request.sampling.output_attentions:
            first = len(packer.input_ids) - count
            recorded.append((first, request, start, count, packer.seq_lens[-1]))
        if adapters is not None:
            adapters.extend([request.adapter] * count)
        if verifying:
            logits_indices.extend(range(len(packer.input_ids) - count, len(packer.input_ids)))
            sampled.append(request)
            rows.append(count)
        elif end == request.num_tokens:  # the step reaches the sequence's end: its last logits are sampled
            logits_indices.append(len(packer.input_ids) - 1)
            sampled.append(request)
            rows.append(1)
    layout = packer.layout(decode_query_len)
    return PackedStep(
        packer.input_ids,
        packer.positions,
        logits_indices,
        sampled,
        layout,
        rows,
        adapters,
        embedded or None,
        recorded or None,
    )
