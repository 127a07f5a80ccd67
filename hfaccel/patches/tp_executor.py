"""`TPExecutor`: the HF executor of a tensor-parallel (sharded) model.

What changes against `HFExecutor`: the head counts are the rank's own (the paged KV cache holds only the
rank's KV heads), each forward is marked sequence-parallel or not from the step's metadata (SP only in
steps with prefill tokens, padded to a multiple of N), the model-state fingerprint is agreed across
ranks, and the engine finds the collectives that keep ranks in lock step in `step_sync`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import torch

from hfaccel.distributed.sync import StepSync
from hfaccel.distributed.tp import TPState, sequence_parallel_step
from hfaccel.kernels.metadata import StepLayout
from hfaccel.kernels.op import current_forward_context
from hfaccel.patches.executor import HFExecutor
from hfaccel.patches.tp_plan import local_heads

logger = logging.getLogger("hfaccel")


def has_prefill(layout: StepLayout) -> bool:
    """Whether a step holds prefill tokens: a sequence beyond the leading decode-path ones."""
    return layout.num_decodes < layout.num_seqs


class TPExecutor(HFExecutor):
    """Runs one rank's shard of a tensor-parallel model on a packed step."""

    def __init__(self, model: Any, tp: TPState) -> None:
        super().__init__(model)
        self.tp = tp
        self.num_q_heads, self.num_kv_heads = local_heads(model, self.head_dim, tp.heads_gathered)
        self.sequence_parallel = tp.sequence_parallel
        self.step_sync = StepSync(tp.group, tp.src, tp.size)
        # A prefill step grows by at most N - 1 padded tokens: the runner sizes its buffers with this.
        self.max_token_padding = tp.size - 1 if tp.sequence_parallel else 0
        # (tokens, padded tokens, had prefill, ran sequence-parallel) per forward, for tests.
        self.forward_log: deque[tuple[int, int, bool, bool]] = deque(maxlen=100_000)
        self._warned_compile = False

    def pad_tokens(self, layout: StepLayout, tokens: int) -> int:
        """The step's packed token count after padding: a multiple of N for a sequence-parallel step."""
        if not self.sequence_parallel or not has_prefill(layout):
            return tokens
        n = self.tp.size
        return -(-tokens // n) * n

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        compiled: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        context = current_forward_context()
        metadata = getattr(context.metadata, "common", context.metadata)
        prefill = metadata.num_decodes < metadata.num_seqs
        # The seed's rule, enforced here: sequence parallelism only in steps with prefill tokens.
        sp = self.sequence_parallel and prefill
        padded = input_ids.shape[1]
        if sp and padded % self.tp.size:
            raise RuntimeError(
                f"a sequence-parallel step of {padded} tokens is not padded to a multiple of {self.tp.size}"
            )
        self.forward_log.append((metadata.num_tokens, padded, prefill, sp))
        with sequence_parallel_step(sp):
            return super().forward(input_ids, positions, logits_indices, compiled=None)

    def compile(self, dynamic: bool) -> Callable[..., torch.Tensor]:
        """Eager: compiling DTensor-sharded models with collectives is not verified here."""
        if not self._warned_compile:
            self._warned_compile = True
            logger.info("hfaccel: torch.compile is skipped under tensor parallelism (steps run eager)")
        return self._model_forward

    def state_token(self) -> Hashable:
        """Every rank's fingerprint of its own shard, all-gathered: a change on any rank is seen on all,
        so every rank resets its prefix cache at the same step (a collective: called in lock step)."""
        return self.step_sync.agree_token(super().state_token())
