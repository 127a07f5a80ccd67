"""`PPExecutor`: one pipeline stage of an HF decoder, run on the microbatches of a packed step.

The stage calls its own decoder layers the way HF's ``LlamaModel.forward`` does (rotary position
embeddings from ``model.model.rotary_emb`` and the step's ``position_ids``; no mask: the paged metadata
carries causality), the first stage embeds the tokens, the last applies the final norm and the LM head
at the sampled positions, with the model-level scales of its family (`layer_loop.AroundLayers`, checked
against the model's own forward at patch). Activations ``[1, T_m, hidden]`` travel between stages by point-to-point
ops; every rank knows each microbatch's token count T_m (the ranks schedule in lock step), so every
receive is posted with its shape before the data arrives.

The seed's rules (shared/seeds/000, "Microbatching"), where they are enforced:

- **Prefill** (a step holding prefill tokens): every receive of the step is posted at once
  (``irecv``, one tag per microbatch) and every send is asynchronous (``isend``), so stage s computes
  microbatch m + 1 while stage s + 1 computes m; the sends are waited for only at the end of the step.
- **Decode** (a step of decode tokens only): blocking ``send``/``recv`` at each stage boundary,
  microbatch by microbatch; every microbatch of a step finishes on the last stage before any token is
  sampled, so a sequence's next token never starts before its previous one finished.
- Each microbatch holds whole sequences (`split_microbatches`), so KV writes stay in their microbatch;
  each stage's paged cache holds its own layers only (``num_layers`` is the stage's count and the
  attention op's global ``layer_idx`` is mapped to the local slot, `StageCaches`).

Only the last stage has logits: the others return zeros of the right shape, sample from them, and
take the last stage's tokens (`StepSync` with ``src`` the last stage's rank). A step holding a request
that records scores, logits or logprobs broadcasts the last stage's logits to every stage instead.
Every rank records which microbatch its stage ran when in `trace`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hfaccel.distributed.pp import PPState
from hfaccel.distributed.sync import StepSync
from hfaccel.kernels.op import ForwardContext, forward_context
from hfaccel.patches.arguments import CACHE_NAME
from hfaccel.patches.attention import engine_attention
from hfaccel.patches.executor import HFExecutor
from hfaccel.patches.layer_loop import AroundLayers


class StageCaches(Sequence):
    """The stage's ``(k_cache, v_cache)`` pairs, indexed by global layer id."""

    def __init__(self, local: Sequence[tuple[torch.Tensor, torch.Tensor]], offset: int) -> None:
        self.local, self.offset = local, offset

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        index = layer_idx - self.offset
        if not 0 <= index < len(self.local):
            raise IndexError(f"layer {layer_idx} is not on this pipeline stage")
        return self.local[index]

    def __len__(self) -> int:
        return self.offset + len(self.local)


class PPExecutor(HFExecutor):
    """Runs one pipeline stage of a transformers causal LM."""

    pipelined = True

    def __init__(self, model: Any, pp: PPState) -> None:
        super().__init__(model)
        self.pp = pp
        self.num_layers = pp.layer_end - pp.layer_start
        self.step_sync = StepSync(pp.group, pp.ranks[-1], pp.size)
        self.stage_model = AroundLayers(model)  # the forward around the layers (checked at patch)
        self.base = self.stage_model.base
        self.layers = list(self.base.layers[pp.layer_start : pp.layer_end])
        self.hidden_size = model.config.get_text_config(decoder=True).hidden_size
        # (step, stage, microbatch, phase, start_s, end_s) per microbatch this stage ran, for tests.
        self.trace: deque[tuple[int, int, str, float, float]] = deque(maxlen=100_000)
        self.num_steps = 0
        self.num_logits_broadcasts = 0

    def compile(self, dynamic: bool) -> Callable[..., torch.Tensor]:
        raise ValueError("torch.compile is not supported with pipeline parallelism: use compile='off'")

    def forward(self, input_ids, positions, logits_indices, compiled=None) -> torch.Tensor:
        raise RuntimeError("a pipeline stage runs through run_pipeline, not forward")

    def run_pipeline(
        self,
        parts: list[Any],
        prepare: Callable[[Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardContext]],
    ) -> torch.Tensor:
        """Run the step's microbatches `parts` through this stage; ``[N, V]`` logits (zeros off the
        last stage). `prepare(part)` stages a part's inputs and returns (ids, positions, sampled
        positions, forward context)."""
        pp = self.pp
        prefill = any(p.layout.num_decodes < p.layout.num_seqs for p in parts)
        phase = "prefill" if prefill else "decode"
        shapes = [(1, len(p.input_ids), self.hidden_size) for p in parts]
        received: list[torch.Tensor] = []
        recv_works: list[Any] = []
        if not pp.first:
            received = [torch.empty(s, dtype=self.dtype, device=self.device) for s in shapes]
            if prefill:  # all receives posted at once: the data arrives while this stage computes
                recv_works = [
                    dist.irecv(buf, src=pp.prev_rank, group=pp.group, tag=m) for m, buf in enumerate(received)
                ]
        send_works: list[Any] = []
        outputs: list[torch.Tensor] = []
        step = self.num_steps
        self.num_steps += 1
        for m, part in enumerate(parts):
            input_ids, positions, logits_indices, context = prepare(part)
            if pp.first:
                hidden = self.stage_model.embed(input_ids)
            else:
                if prefill:
                    recv_works[m].wait()
                else:  # decode: a synchronous stage boundary
                    dist.recv(received[m], src=pp.prev_rank, group=pp.group, tag=m)
                hidden = received[m]
            start = time.perf_counter()
            hidden = self._layers(hidden, positions, context)
            if pp.last:
                hidden = self.base.norm(hidden)
                outputs.append(self.stage_model.logits(hidden[:, logits_indices])[0])
            # The stage's work ends before its send: a blocking send returns only once the next stage
            # took the data, so a timestamp after it could fall after that stage started.
            self.trace.append((step, pp.stage, m, phase, start, time.perf_counter()))
            if not pp.last:
                hidden = hidden.contiguous()
                if prefill:
                    send_works.append(dist.isend(hidden, dst=pp.next_rank, group=pp.group, tag=m))
                else:
                    dist.send(hidden, dst=pp.next_rank, group=pp.group, tag=m)
        for work in send_works:
            work.wait()
        if pp.last:
            logits = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        else:
            rows = sum(len(p.logits_indices) for p in parts)
            logits = torch.zeros((rows, self.vocab_size), dtype=self.dtype, device=self.device)
        if any(_wants_outputs(r) for p in parts for r in p.sampled_requests):
            # Scores, logits or logprobs are recorded from the logits on every rank: share the last
            # stage's (only in steps that hold such a request; otherwise its tokens are enough).
            logits = logits.contiguous()
            dist.broadcast(logits, src=pp.ranks[-1], group=pp.group)
            self.num_logits_broadcasts += 1
        return logits

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        stage_context = ForwardContext(
            context.backend, context.metadata, StageCaches(context.kv_caches, self.pp.layer_start)
        )
        position_embeddings = self.stage_model.position_embeddings(hidden, positions)
        with engine_attention(self.model), forward_context(stage_context):
            for layer in self.layers:
                hidden = layer(
                    hidden,
                    attention_mask=None,
                    position_embeddings=position_embeddings,
                    position_ids=positions,
                    **{CACHE_NAME: None},
                    use_cache=False,
                )
        return hidden

    def state_token(self) -> Hashable:
        return self.step_sync.agree_token(super().state_token())


def _wants_outputs(request: Any) -> bool:
    sampling = request.sampling
    return bool(sampling.output_scores or sampling.output_logits or sampling.output_logprobs)
