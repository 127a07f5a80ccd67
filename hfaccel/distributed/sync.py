"""What keeps tensor-parallel ranks' engines in lock step.

Every rank runs the same engine code on the same requests: the same scheduler, block manager and prefix
cache, fed the same inputs in the same order (every rank calls ``generate`` with the same arguments).
Their decisions are then identical by construction — provided nothing they decide on differs between
processes. Three things could, and each is closed here:

- **Memory.** Each rank measures its own free memory; the KV block count is all-reduced to the minimum
  (`min_int`), so every rank has the same blocks and preempts at the same moment.
- **Wall clock.** ``batching="dynamic"`` forms a batch once the oldest request has waited
  ``max_delay_ms``: a wall-clock decision that could differ between ranks. It is refused under TP
  (`check_config`). Time otherwise only feeds metrics, never a decision.
- **Floating point.** Logits are gathered to every rank, but sampling from them on each rank could, in
  principle, round differently: rank 0's sampled tokens are broadcast and used everywhere
  (`agree_tokens`), so a float difference can never fork the ranks' sequences.

And it is checked, not only argued: before each forward, every rank's packed step (token ids,
positions, KV slots, sampled rows, query and sequence lengths) is hashed and the hashes all-gathered
(`check_step`); ranks that diverge (say, requests submitted in a different order, or a cancel that
reached one rank a step late) raise RuntimeError together instead of computing garbage. The model-state
fingerprint that resets the prefix cache is agreed too (`agree_token`). Each rank records its step plans
(request ids and token counts) in `plans`, for tests.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class AgreedToken(NamedTuple):
    """The model-state token of a parallel model, the same on every rank (`StepSync.agree_token`)."""

    hashes: tuple[int, ...]  # every rank's hash of its own token
    draws_dropout: bool  # some rank's layers draw dropout


class StepSync:
    """The collectives a tensor-parallel engine makes outside the model: one small all-gather before
    each forward and one broadcast of the sampled tokens after it (plus two at engine start)."""

    def __init__(self, group: Any, src: int, size: int, max_plans: int = 100_000) -> None:
        self.group = group
        self.src = src
        self.size = size
        self.plans: deque[tuple[tuple[Any, ...], tuple[int, ...]]] = deque(maxlen=max_plans)
        self.num_checked = 0

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def check_config(self, config: Any) -> None:
        """Refuse engine settings whose decisions depend on something other than the inputs."""
        if config.batching == "dynamic":
            raise ValueError(
                "batching='dynamic' waits max_delay_ms of wall-clock time before forming a batch, which can "
                "differ between tensor-parallel ranks; use batching='continuous' or 'static' with tensor "
                "parallelism"
            )

    def check_step(self, step: Any, packed: Any) -> None:
        """Record this rank's step plan and raise RuntimeError (on every rank) unless all ranks are about
        to run the very same packed step."""
        layout = packed.layout
        fields = (
            packed.input_ids,
            packed.positions,
            layout.slot_mapping,
            packed.logits_indices,
            layout.query_lens,
            layout.seq_lens,
        )
        self._check((tuple(r.request_id for r in step.requests), tuple(step.num_tokens)), fields)

    def check_drained(self) -> None:
        """This rank's engine has just emptied (its requests finished, failed or were cancelled): an empty
        plan checked against the others', which empty at the same step when they ran the same calls, so
        a rank whose call ended alone (a processor that raised on it only, other length limits) raises
        on every rank instead of leaving the others waiting at their next step for ever."""
        self._check(((), ()), ())

    def _check(self, plan: tuple[tuple[Any, ...], tuple[int, ...]], fields: tuple) -> None:
        self.plans.append(plan)
        digest = hashlib.blake2b(digest_size=8)
        for values in fields:
            digest.update(array("q", values).tobytes())
            digest.update(b"|")
        mine = int.from_bytes(digest.digest(), "little", signed=True)
        hashes = [row[0] for row in self._all_gather(mine)]
        self.num_checked += 1
        if len(set(hashes)) > 1:
            raise RuntimeError(
                f"tensor-parallel ranks diverged at checked step {self.num_checked}: their packed steps differ "
                f"(this rank's plan: {self.plans[-1]}). Every rank must submit the same requests in the same "
                "order (one caller per rank, the same generate arguments) and cancel none midway"
            )

    def agree_tokens(self, tokens: list[int] | list[list[int]]) -> list[int] | list[list[int]]:
        """Rank 0's sampled tokens, on every rank: one per request, or (speculative verification) a list
        per request whose lengths may differ between ranks until rank 0's are taken."""
        if not tokens:
            return tokens
        if not isinstance(tokens[0], list):
            t = torch.tensor(tokens, dtype=torch.int64)
            dist.broadcast(t, src=self.src, group=self.group)
            return t.tolist()
        lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
        dist.broadcast(lengths, src=self.src, group=self.group)
        flat = torch.zeros(int(lengths.sum()), dtype=torch.int64)
        if dist.get_rank() == self.src:  # src is a global rank
            flat.copy_(torch.tensor([token for row in tokens for token in row], dtype=torch.int64))
        dist.broadcast(flat, src=self.src, group=self.group)
        out, offset = [], 0
        for n in lengths.tolist():
            out.append(flat[offset : offset + n].tolist())
            offset += n
        return out

    def agree_token(self, local: Any) -> AgreedToken:
        """A fingerprint that changes on every rank when `local` (this rank's model-state token) changes
        on any rank: every rank's hash of its own token, and whether any rank's model draws dropout (its
        layers' KV is then no function of the tokens anywhere: `ModelWatch.draws_dropout`)."""
        rows = self._all_gather(hash(local), int(bool(getattr(local, "draws_dropout", False))))
        return AgreedToken(tuple(row[0] for row in rows), any(row[1] for row in rows))

    def _all_gather(self, *values: int) -> list[list[int]]:
        """Every rank's `values`, in rank order."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.zeros(len(values), dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]
