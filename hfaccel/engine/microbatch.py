"""Splitting a packed step into microbatches of whole sequences (seed 000).

Each microbatch passes through the model on its own: its own tokens, positions, sampled rows and
attention layout. A sequence's tokens of a step never straddle two microbatches, so its KV writes stay
in its microbatch, and no microbatch reads KV another one writes in the same step (a prompt whose next
block is being computed in a step is never admitted beside it: the scheduler defers it). Pipeline
parallelism streams these microbatches through its stages; on one process they simply run in turn.
"""

from __future__ import annotations

from hfaccel.engine.batch import PackedStep
from hfaccel.kernels.metadata import StepLayout, num_leading_decodes


def split_microbatches(packed: PackedStep, count: int, decode_query_len: int = 1) -> list[PackedStep]:
    """Split `packed` into at most `count` microbatches of whole sequences with balanced token counts
    (contiguous in pack order, so sampled rows keep their order when the logits are concatenated)."""
    layout = packed.layout
    num_seqs = layout.num_seqs
    count = max(1, min(count, num_seqs))
    if count == 1:
        return [packed]
    target = layout.num_tokens / count
    bounds = [0]
    tokens = 0
    for i, q in enumerate(layout.query_lens):
        tokens += q
        remaining_groups = count - len(bounds)
        if tokens >= target * len(bounds) and i + 1 < num_seqs and remaining_groups > 0:
            bounds.append(i + 1)
    bounds.append(num_seqs)
    starts = [0]
    for q in layout.query_lens:
        starts.append(starts[-1] + q)
    rows = packed.rows_per_request or [1] * len(packed.sampled_requests)
    sampled_by_end = _sampled_rows_by_token(packed, rows)
    micro = []
    windowed = layout.window_block_tables
    for lo, hi in zip(bounds, bounds[1:]):
        t0, t1 = starts[lo], starts[hi]
        query_lens = layout.query_lens[lo:hi]
        sub_layout = StepLayout(
            query_lens=query_lens,
            seq_lens=layout.seq_lens[lo:hi],
            block_tables=layout.block_tables[lo:hi],
            slot_mapping=layout.slot_mapping[t0:t1],
            num_decodes=num_leading_decodes(query_lens, decode_query_len),
            state_slots=None if layout.state_slots is None else layout.state_slots[lo:hi],
            window_block_tables=None if windowed is None else windowed[lo:hi],
            window_slot_mapping=None if windowed is None else layout.window_slot_mapping[t0:t1],
        )
        indices, requests, sub_rows = [], [], []
        for position, request, n in sampled_by_end:
            if t0 <= position < t1:
                indices.extend(range(position - t0 - n + 1, position - t0 + 1))
                requests.append(request)
                sub_rows.append(n)
        micro.append(
            PackedStep(
                input_ids=packed.input_ids[t0:t1],
                positions=packed.positions[t0:t1],
                logits_indices=indices,
                sampled_requests=requests,
                layout=sub_layout,
                rows_per_request=sub_rows,
            )
        )
    return micro


def _sampled_rows_by_token(packed: PackedStep, rows: list[int]) -> list[tuple[int, object, int]]:
    """(last sampled token position, request, rows) per sampled request, in order."""
    out, offset = [], 0
    for request, n in zip(packed.sampled_requests, rows):
        out.append((packed.logits_indices[offset + n - 1], request, n))
        offset += n
    return out
