"""Drafts from a smaller model with the same vocabulary, run on its own paged KV cache in the same engine.

The draft model has its own `ModelRunner` (its own KV cache, metadata builder and step buffers) with the
target's ``num_blocks`` and ``block_size``, so a request's block table indexes both caches: no second
block manager, and whatever frees, trims or preempts a request's blocks does so for both. Each request
records how many of its leading tokens the draft's cache holds (`Request.speculation.draft_computed`, reset to 0
whenever its blocks are freed).

Drafting ``k`` tokens for the whole batch takes ``k`` packed draft passes:

- pass 0 catches up on the tokens the draft has not seen, up to and including the request's last token
  (a mixed step: a request that decoded last step feeds one or a few tokens, a fresh one its whole prompt,
  within one token budget; a request that cannot catch up in this step advances as far as it can and gets
  no drafts), and yields ``d1`` from the last position's logits;
- pass ``j`` (1 <= j < k) feeds ``d_j`` and yields ``d_{j+1}``: a pure decode step.

The draft writes K/V at positions up to ``num_tokens + k - 2``, past the request's blocks: the lookahead
blocks (for the ``1 + k`` tokens the target verifies next step) are allocated here, before the draft
writes, and the scheduler's allocation finds them already there; rejected drafts are trimmed as usual.
After verification the draft's cache stays valid for the last token and the accepted drafts it fed:
`Scheduler.update` clamps ``draft_computed`` to the target's computed tokens.

Greedy requests take the draft's argmax; sampled ones draw from the draft's processed distribution with
the noise the target's sample at that position will use (`request.position_generator`), so a draft is the
target's own token as often as a shared race lets the two agree; the target keeps a draft only where it
is its own token (`rejection.py`), so the emitted tokens are the target's whatever the draft is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.config import is_draft_model
from hfaccel.engine.batch import PackedStep, StepPacker
from hfaccel.engine.block_manager import BlockManager
from hfaccel.engine.executor import ModelExecutor, make_executor
from hfaccel.engine.request import Request, position_generator
from hfaccel.engine.runner import ModelRunner
from hfaccel.engine.speculative.rejection import draw
from hfaccel.engine.speculative.verify import process_row
from hfaccel.kernels.cpu_argmax import argmax_index


@dataclass
class _Row:
    """One request in a draft pass: it feeds `tokens` at positions ``start..``."""

    request: Request
    start: int
    tokens: list[int]
    logits: bool  # whether the last position's logits are wanted


@dataclass
class _Drafting:
    """A request drafting this round: `k` tokens wanted, what it has drafted so far."""

    request: Request
    k: int
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Draft tokens from a draft model sharing the target's block tables (see the module docstring)."""

    name = "draft_model"

    def __init__(
        self, runner: ModelRunner, block_manager: BlockManager, max_model_len: int, max_num_tokens: int
    ) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len  # the draft's own context may be shorter than the target's
        self.max_num_tokens = max_num_tokens  # token budget of one draft pass (its runner's buffers)
        self.decode_query_len = runner.backend.capabilities.decode_query_len
        self.num_passes = 0
        self.num_tokens_fed = 0
        self.vocab_size = runner.executor.vocab_size  # the target's too (checked when the engine was built)

    def propose(self, requests: list[Request], budgets: list[int]) -> list[list[int]]:
        """Drafts for each request, at most `budgets[i]` tokens each. Allocates the lookahead blocks of
        the requests it drafts for."""
        out: list[list[int]] = [[] for _ in requests]
        budget = self.max_num_tokens
        pass0: list[_Row] = []
        drafting: list[tuple[int, _Drafting]] = []
        behind: list[Request] = []
        for i, (request, k) in enumerate(zip(requests, budgets)):
            num_tokens = request.num_tokens
            k = min(k, self.max_model_len - num_tokens + 1)  # the draft writes up to num_tokens + k - 2
            if k <= 0:
                continue
            start = request.speculation.draft_computed = min(
                request.speculation.draft_computed, request.num_computed_tokens
            )
            missing = num_tokens - start
            if missing > budget:
                behind.append(request)
                continue
            if not self.block_manager.allocate(request, 1 + k):  # the lookahead the draft writes into
                continue
            pass0.append(_Row(request, start, request.all_token_ids[start:num_tokens], True))
            drafting.append((i, _Drafting(request, k)))
            budget -= missing
        for request in behind:  # what budget is left: catch up part of the way (its blocks exist), no drafts
            if budget <= 0:
                break
            start = request.speculation.draft_computed
            pass0.append(_Row(request, start, request.all_token_ids[start : start + budget], False))
            budget -= len(pass0[-1].tokens)
        if not pass0:
            return out
        logits = self._run(pass0)
        for row, (_, state) in zip(logits, drafting):
            self._choose(state, row)
        for j in range(1, max((s.k for _, s in drafting), default=0)):
            active = [s for _, s in drafting if s.k > j]
            logits = self._run(
                [_Row(s.request, s.request.num_tokens + j - 1, [s.drafts[-1]], True) for s in active]
            )
            for row, state in zip(logits, active):
                self._choose(state, row)
        # Only now (every pass done) does the draft's cache hold these tokens: the catch-up of every
        # request, and for drafting ones the last token plus d1..d_{k-1} (Scheduler.update keeps what the
        # target accepts).
        for row in pass0:
            row.request.speculation.draft_computed = row.start + len(row.tokens)
        for i, state in drafting:
            request = state.request
            request.speculation.draft_computed = request.num_tokens + state.k - 1
            out[i] = state.drafts
        return out

    def _choose(self, state: _Drafting, logits: torch.Tensor) -> None:
        """The next draft of one request from the draft's logits at its last fed position."""
        request = state.request
        row = process_row(logits.to(torch.float32, copy=True).unsqueeze(0), request, state.drafts)[0]
        if request.sampling.do_sample:
            probs = torch.softmax(row, dim=-1)
            position = len(request.output_token_ids) + len(state.drafts)  # of the token this draft guesses
            state.drafts.append(draw(probs, position_generator(request, position, probs.device)))
        else:
            state.drafts.append(argmax_index(row))

    def _run(self, rows: list[_Row]) -> torch.Tensor:
        """One draft pass; the logits of the rows that want them, in `rows` order."""
        packed, order = self._pack(rows)
        self.num_passes += 1
        self.num_tokens_fed += len(packed.input_ids)
        logits = self.runner.run(packed)
        if logits.shape[-1] != self.vocab_size:  # resized since: its tokens would index past the target's
            raise ValueError(
                f"speculative: the draft model's vocabulary now has {logits.shape[-1]} tokens, the model's "
                f"{self.vocab_size}; a draft model must share the model's vocabulary"
            )
        # The runner returns rows in packed order (decodes first): put them back in `rows` order.
        wanted = [i for i in order if rows[i].logits]
        back = sorted(range(len(wanted)), key=lambda r: wanted[r])
        return logits[back] if back != list(range(len(back))) else logits

    def _pack(self, rows: list[_Row]) -> tuple[PackedStep, list[int]]:
        """`rows` as one packed step, sequences the backend decodes first (as `pack_step` orders them)."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens) > self.decode_query_len)
        packer = StepPacker(self.block_size)
        for i in order:
            row = rows[i]
            packer.add(row.tokens, row.start, row.request.block_ids)
            if row.logits:
                packer.logits_indices.append(len(packer.input_ids) - 1)
        layout = packer.layout(self.decode_query_len)
        packed = PackedStep(
            packer.input_ids, packer.positions, packer.logits_indices, [r.request for r in rows], layout
        )
        return packed, order


def draft_executor(speculative: Any, vocab_size: int, device: torch.device) -> ModelExecutor | None:
    """The draft model of ``speculative=<model>`` as an executor, checked against the target's
    vocabulary size and device; None for no speculation or a method name."""
    if not is_draft_model(speculative):
        return None
    draft = make_executor(speculative)
    if getattr(draft, "recurrent", False):  # its mixers would need a state per sequence of their own
        raise ValueError(
            "speculative: a draft model with recurrent layers (Mamba and its kin) is not served: give a "
            "draft model of attention layers only"
        )
    if draft.vocab_size != vocab_size:
        raise ValueError(
            f"speculative: the draft model's vocabulary has {draft.vocab_size} tokens, the model's "
            f"{vocab_size}; a draft model must share the model's tokenizer and vocabulary"
        )
    if draft.device != device:
        raise ValueError(
            f"speculative: the draft model is on {draft.device}, the model on {device}; "
            "put both on the same device"
        )
    return draft
