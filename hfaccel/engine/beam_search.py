"""Beam search in the continuous batch: a prompt's beams are sequences that share KV blocks.

A beam request starts as one sequence, its prompt (admitted, prefix-cached and chunked like any other).
The step that computes the prompt's last token gives one logits row; the search step treats it as
`num_beams` identical beams (HF starts the same way: every beam holds the prompt, all but the first
scored -1e9), and the request becomes a *beam group* of `num_beams` sequences, the request itself being
the first. Every later step decodes the group's beams together, one token each, and the search step
returns, for each new beam, its parent beam and its token. Each beam is then re-forked from its parent
(`BlockManager.fork`): it takes the parent's block table by reference count, and a block that more than
one beam holds is copied before anyone writes into it (`BlockManager.allocate`, copy on write), so the
beams share the prompt and every common prefix, and a shared block is never written. The finished
hypotheses, the running scores and the stopping rule live in `BeamSearch`, pure tensor code that follows
transformers' `_beam_search` step by step (`_get_top_k_continuations`, `_get_running_beams_for_next_
iteration`, `_update_finished_beams`, `_check_early_stop_heuristic`, `_beam_search_has_unfinished_
sequences`), one prompt at a time: HF's batch is a set of independent rows, and a prompt whose own rule
says it is done keeps its finished hypotheses frozen in HF while the others go on, so stopping it at
once gives the same hypotheses.

The scheduler keeps a group whole: its beams are scheduled in the same step or not at all, and
preempting one beam preempts the group, which restarts from its prompt (the search is deterministic;
the prefix cache usually hands the prompt back), so the group never needs its beams recomputed one by
one, and its blocks stay shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hfaccel.engine.block_manager import blocks_for
from hfaccel.engine.request import Request, RequestStatus, fails_alone, request_generator

if TYPE_CHECKING:
    from hfaccel.engine.block_manager import BlockManager

NEG = -1.0e9  # HF's "impossible" score


@dataclass(frozen=True)
class BeamParams:
    """Beam search settings (HF's meaning): `num_beams` beams per prompt; finished hypotheses are scored
    ``sum of log-probabilities / generated_length ** length_penalty``; `early_stopping` is True (stop
    once `num_beams` hypotheses are finished), False (stop when the heuristic says no running beam can
    beat the worst finished one) or ``"never"`` (the canonical rule); `num_return_sequences` best
    hypotheses are returned."""

    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    do_sample: bool = False  # beam sampling: candidates drawn (HF's multinomial), not the top ones

    def __post_init__(self) -> None:
        if isinstance(self.num_beams, bool) or not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise ValueError(f"num_beams must be a positive integer, got {self.num_beams!r}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(
                f"num_return_sequences must be between 1 and num_beams ({self.num_beams}), "
                f"got {self.num_return_sequences}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


class BeamSearch:
    """The search state of one prompt: running beam scores, the `num_beams` best finished hypotheses, the
    early-stop heuristic. `step` is one iteration of HF's `_beam_search` for a batch of one prompt."""

    def __init__(
        self,
        params: BeamParams,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.eos = sorted(set(eos_token_ids))
        self.device = torch.device(device)
        nb = params.num_beams
        # As HF: K = max(2, 1 + number of EOS ids) * num_beams candidates a step, so that at least
        # num_beams of them do not end in EOS.
        self.beams_to_keep = max(2, 1 + len(self.eos)) * nb
        self.top_mask = torch.arange(self.beams_to_keep, device=self.device) < nb
        self._eos = torch.tensor(self.eos, dtype=torch.long, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Back to the start (the prompt alone): what a restarted group needs."""
        nb = self.params.num_beams
        self.running_scores = torch.zeros(nb, dtype=torch.float32, device=self.device)
        self.running_scores[1:] = NEG
        self.finished_scores = torch.full((nb,), NEG, dtype=torch.float32, device=self.device)
        self.finished = torch.zeros(nb, dtype=torch.bool, device=self.device)
        self.finished_tokens: list[list[int]] = [[] for _ in range(nb)]
        # HF's beam_indices: for each beam, the running beam each of its tokens continued (best first).
        self.running_indices: list[list[int]] = [[] for _ in range(nb)]
        self.finished_indices: list[list[int]] = [[] for _ in range(nb)]
        self.improvable = torch.ones((), dtype=torch.bool, device=self.device)
        self.generated = 0  # tokens generated so far (HF: cur_len - decoder_prompt_len)
        self.done = False

    def move_to(self, device: torch.device) -> None:
        """Keep the search's tensors on `device` (where the logits are)."""
        self.device = torch.device(device)
        for name in ("top_mask", "_eos", "running_scores", "finished_scores", "finished", "improvable"):
            setattr(self, name, getattr(self, name).to(self.device))

    def step(
        self, log_probs: torch.Tensor, beams: Sequence[list[int]], generator: torch.Generator | None = None
    ) -> tuple[list[int], list[int]]:
        """One search step. `log_probs` (``[num_beams, V]`` float32) are the processed log-probabilities of
        the next token after each running beam, whose generated tokens are `beams`. Returns the new
        running beams as (parent beam, token) pairs, best first; `done` says whether the prompt is
        finished (its hypotheses are then final)."""
        p = self.params
        nb, vocab = log_probs.shape
        lp, early = p.length_penalty, p.early_stopping
        # _get_top_k_continuations: the K best (beam, token) by accumulated log-probability, or (beam
        # sampling) K drawn without replacement from their softmax, sorted best first.
        accumulated = (log_probs + self.running_scores[:, None]).reshape(1, -1)
        if p.do_sample:
            probs = torch.softmax(accumulated, dim=-1)
            topk_indices = torch.multinomial(probs, num_samples=self.beams_to_keep, generator=generator)
            topk_log_probs = accumulated.gather(1, topk_indices)
            topk_log_probs, order = topk_log_probs.sort(dim=-1, descending=True)
            topk_indices = topk_indices.gather(-1, order)
        else:
            topk_log_probs, topk_indices = torch.topk(accumulated, k=self.beams_to_keep)
        parents = topk_indices // vocab
        tokens = topk_indices % vocab
        # Stopping criteria on each candidate: EOS, or max length reached with this token.
        hits = torch.isin(tokens, self._eos) if self.eos else torch.zeros_like(tokens, dtype=torch.bool)
        if self.generated + 1 >= self.max_new_tokens:
            hits = torch.ones_like(hits)
        # _get_running_beams_for_next_iteration
        running_log_probs = topk_log_probs + hits.to(torch.float32) * NEG
        next_indices = torch.topk(running_log_probs, k=nb)[1]
        self.running_scores = running_log_probs.gather(1, next_indices)[0]
        # _update_finished_beams
        just_finished = hits & self.top_mask[None, :]
        candidates = topk_log_probs / ((self.generated + 1) ** lp)
        full = torch.all(self.finished) & (early is True)
        candidates += full.to(torch.float32) * NEG
        candidates += (~self.improvable).to(torch.float32) * NEG
        candidates += (~just_finished) * NEG
        merged_scores = torch.cat((self.finished_scores[None, :], candidates), dim=1)
        merged_finished = torch.cat((self.finished[None, :], just_finished), dim=1)
        keep = torch.topk(merged_scores, k=nb)[1]
        self.finished_scores = merged_scores.gather(1, keep)[0]
        self.finished = merged_finished.gather(1, keep)[0]
        parent_list, token_list = parents[0].tolist(), tokens[0].tolist()
        candidate_tokens = [list(beams[b]) + [t] for b, t in zip(parent_list, token_list)]
        merged_tokens = self.finished_tokens + candidate_tokens
        self.finished_tokens = [merged_tokens[k] for k in keep[0].tolist()]
        candidate_indices = [self.running_indices[b] + [b] for b in parent_list]
        merged_indices = self.finished_indices + candidate_indices
        self.finished_indices = [merged_indices[k] for k in keep[0].tolist()]
        # _check_early_stop_heuristic, after cur_len += 1
        self.generated += 1
        best_length = self.max_new_tokens if early == "never" and lp > 0.0 else self.generated
        best_running = self.running_scores[:1] / (best_length**lp)
        worst_finished = torch.where(self.finished, torch.min(self.finished_scores), NEG)
        self.improvable = self.improvable & torch.any(best_running > worst_finished)
        # _beam_search_has_unfinished_sequences, for this prompt alone
        all_full = bool(torch.all(self.finished)) and early is True
        self.done = (not bool(self.improvable)) or all_full or bool(torch.all(hits))
        chosen = next_indices[0].tolist()
        self.running_indices = [candidate_indices[i] for i in chosen]
        return [parent_list[i] for i in chosen], [token_list[i] for i in chosen]

    def results(self) -> list[tuple[list[int], float]]:
        """The `num_return_sequences` best hypotheses, best first: (generated tokens, score)."""
        n = self.params.num_return_sequences
        scores = self.finished_scores[:n].tolist()
        return [(list(self.finished_tokens[i]), scores[i]) for i in range(n)]

    def result_beam_indices(self) -> list[list[int]]:
        """For each of `results`, HF's ``beam_indices`` within this prompt: at each generated token, the
        running beam (0 = best) that the hypothesis continued there."""
        return [list(self.finished_indices[i]) for i in range(self.params.num_return_sequences)]


class BeamGroup:
    """The sequences of one beam request: `slots[0]` is the request itself (the one callers hold); before
    the first search step it is the only one (the prompt), afterwards there are `num_beams`."""

    def __init__(self, handle: Request, params: BeamParams) -> None:
        self.handle = handle
        self.params = params
        eos = sorted(handle.stopping.eos_token_ids)
        self.search = BeamSearch(params, handle.stopping.max_new_tokens, eos)
        self.slots: list[Request] = [handle]
        self.pending: tuple[list[int], list[int]] | None = None  # the last search step's choice
        self.results: list[tuple[list[int], float]] | None = None  # when finished
        # HF's per-step outputs, when the caller asked (``output_scores`` / ``output_logits``): one
        # ``[num_beams, V]`` float32 tensor a step, the processed log-probabilities / the raw logits.
        self.step_scores: list[torch.Tensor] = []
        self.step_logits: list[torch.Tensor] = []
        self.sources: list[Request] = []  # at the last step, the beam each slot continued
        # Recording requests (HF's output_hidden_states / output_attentions): for each step s and running
        # beam j, the slot that fed each of its generated tokens (token k at step k + 1), from which HF's
        # output without a cache (every token recomputed each step) is rebuilt.
        self.lineage: list[list[list[int]]] = [[[] for _ in range(params.num_beams)]]

    @property
    def forked(self) -> bool:
        return len(self.slots) > 1

    def reset(self) -> None:
        """Back to the prompt alone (a preempted group restarts): the other slots are dropped."""
        self.slots = [self.handle]
        self.pending = None
        self.search.reset()
        self.handle.output_token_ids = []
        self.handle.generator = None  # beam sampling draws again from its seed
        self.step_scores, self.step_logits, self.sources = [], [], []
        self.lineage = [[[] for _ in range(self.params.num_beams)]]

    def log_probs(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
        """HF's processed scores for this step: log-softmax of the float32 logits (``[slots, V]``), then
        the request's processors on the padded rows; before the first step the prompt's row stands for
        all `num_beams` beams. Also returns each beam's generated tokens."""
        nb = self.params.num_beams
        log_probs = torch.log_softmax(rows.to(torch.float32), dim=-1)
        slots = self.slots
        if not self.forked:
            log_probs = log_probs.expand(nb, -1).clone()
            slots = [self.handle] * nb
        handle = self.handle
        stopping = handle.stopping
        if self.search.generated < stopping.min_new_tokens:
            eos = [t for t in stopping.eos_token_ids if 0 <= t < log_probs.shape[-1]]
            if eos:
                log_probs[:, eos] = -float("inf")
        params = handle.sampling
        if params.processors or params.warpers:
            ids = torch.tensor(
                [
                    handle.processor_prefix
                    + (s.all_token_ids if s.processor_sees_prompt else s.output_token_ids)
                    for s in slots
                ],
                dtype=torch.long,
                device=rows.device,
            )
            if params.processors:
                log_probs = params.processors(ids, log_probs)
            if params.warpers:
                log_probs = params.warpers(ids, log_probs)
        return log_probs, [s.output_token_ids for s in slots]

    def choose(self, rows: torch.Tensor) -> None:
        """Run the search step on this step's logits rows (one per slot, in slot order)."""
        log_probs, beams = self.log_probs(rows)
        sampling = self.handle.sampling
        if sampling.output_logits:
            self.step_logits.append(rows.to(torch.float32, copy=True).expand(len(log_probs), -1))
        if sampling.output_scores:
            self.step_scores.append(log_probs.clone())
        if self.search.device != log_probs.device:
            self.search.move_to(log_probs.device)
        generator = request_generator(self.handle, log_probs.device) if self.params.do_sample else None
        self.pending = self.search.step(log_probs, beams, generator)

    def new_slots(self) -> list[Request]:
        """Before the first fork: the `num_beams - 1` sequences that join the request (no blocks yet)."""
        if self.forked or self.params.num_beams == 1:
            return []
        h = self.handle
        created = []
        for j in range(1, self.params.num_beams):
            slot = Request(
                (h.request_id, "beam", j),
                list(h.prompt_token_ids),
                h.stopping,
                sampling=h.sampling,
                processor_prefix=h.processor_prefix,
                processor_sees_prompt=h.processor_sees_prompt,
                position_shift=h.position_shift,  # a masked last token (dropped by now) shifted them
                shift_from=h.shift_from,
                status=RequestStatus.RUNNING,
                adapter=h.adapter,
                cache_salt=h.cache_salt,
                priority=h.priority,
                arrival_seq=h.arrival_seq,
                user_priority=h.user_priority,
                tpot_target_ms=h.tpot_target_ms,
                ttft_target_ms=h.ttft_target_ms,
            )
            slot.speculation.enabled = False
            slot.beam_group = self
            slot.keep_kv = h.keep_kv
            slot.cache_epoch = h.cache_epoch
            created.append(slot)
        return created

    def advance(self, block_manager: BlockManager, created: list[Request], now: float) -> None:
        """Apply the last search step: every slot becomes a fork of its parent beam plus its new token
        (`created`: the slots joining at the first step, already registered by the scheduler). If the
        search is done, every slot finishes and `results` holds the hypotheses."""
        parents, tokens = self.pending
        self.pending = None
        old = list(self.slots)
        slots = old + created
        # The first step: every beam is the prompt (HF's copies, all but one scored -1e9), and a processor
        # that leaves fewer tokens than beams makes the search continue from those copies too.
        sources = [old[0]] * len(parents) if len(old) == 1 else [old[p] for p in parents]
        histories = [list(s.output_token_ids) for s in sources]
        computed = [s.num_computed_tokens for s in sources]
        block_manager.fork(sources, slots)  # tables first (read before any is replaced)
        for slot, history, count, token in zip(slots, histories, computed, tokens):
            slot.num_computed_tokens = count
            slot.output_token_ids = history + [token]
        self.slots = slots
        self.sources = sources
        sampling = self.handle.sampling
        if sampling.output_hidden_states or sampling.output_attentions:
            self.lineage.append([self.lineage[-1][p] + [j] for j, p in enumerate(parents)])
        metrics = self.handle.metrics
        metrics.token_times.append(now)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if self.search.done:
            self.finish()

    def fail(self, error: BaseException) -> None:
        """The request's own doing (its processors raised, its sampled scores were NaN): the request fails
        alone with `error` and every slot finishes; nothing is pending."""
        self.pending = None
        self.handle.fail(error, alone=True)
        for slot in self.slots:
            if not slot.is_finished:
                slot.finish("error")

    def finish(self) -> None:
        """The search is over: the request carries the best hypothesis; every slot finishes."""
        self.results = self.search.results()
        best = self.results[0][0]
        eos = self.handle.stopping.eos_token_ids
        reason = "stop" if best and best[-1] in eos else "length"
        self.handle.output_token_ids = list(best)
        for slot in self.slots:
            slot.finish(reason)

    def max_blocks(self, max_model_len: int, block_size: int) -> int:
        """The most blocks the group can hold at once: every beam's own blocks, the prompt's full blocks
        shared by all."""
        h = self.handle
        prompt = len(h.prompt_token_ids)
        longest = min(prompt + h.stopping.max_new_tokens, max_model_len)
        shared = prompt // block_size
        nb = self.params.num_beams
        return nb * blocks_for(longest, block_size) - (nb - 1) * shared


def check_beam_request(request: Request, max_model_len: int) -> None:
    """Check a beam search request for an engine of `max_model_len` (unstreamed, within the context) and
    attach its group."""
    if request.sampling.do_sample != request.sampling.beam.do_sample:
        raise ValueError("beam search: SamplingParams.do_sample must be its BeamParams.do_sample")
    prompt = len(request.prompt_token_ids) - request.masked_last  # a masked last token is not kept
    if prompt + request.stopping.max_new_tokens > max_model_len:
        raise ValueError(
            f"beam search: the prompt ({prompt} tokens) plus max_new_tokens "
            f"({request.stopping.max_new_tokens}) runs past the model's context (max_model_len="
            f"{max_model_len}); lower max_new_tokens"
        )
    if request.stopping.stop_check is not None:
        raise ValueError("beam search with stop strings is not served by the engine")
    attach(request)


def attach(request: Request) -> BeamGroup | None:
    """Give a beam request (``sampling.beam`` set) its group, once; None for other requests."""
    params = getattr(request.sampling, "beam", None)
    if params is None:
        return None
    if request.beam_group is None:
        request.beam_group = BeamGroup(request, params)
        request.speculation.enabled = False
    return request.beam_group


def snapshot_kv(request: Request, kept: dict[int, tuple[list[int], Any]], gather: Any) -> None:
    """Copy out the KV of a request that finished this step and whose caller asked for it (`keep_kv`),
    from the blocks it held (`kept`: each stepped request's id -> its block table before the step's
    forks, and its window-pool table or None: `window_blocks.kv_tables`; the blocks were freed just now
    and not reused yet). A beam group's slots each get the KV of the beam they continued: HF's cache
    after its last reorder. `gather(block_ids, count, window_ids)` reads it."""
    group = request.beam_group
    if group is None:
        blocks, window = kept[id(request)]
        request.kv_snapshot = gather(blocks, request.num_computed_tokens, window)
        return
    for slot, source in zip(group.slots, group.sources):
        blocks, window = kept[id(source)]
        slot.kv_snapshot = gather(blocks, slot.num_computed_tokens, window)


def choose_group_tokens(
    logits: torch.Tensor, requests: list[Request], offsets: list[int], result: list[Any], nested: bool
) -> None:
    """Each beam group's search step over its slots' rows (``logits[offsets[i]]`` for `requests[i]`):
    a slot's entry of `result` becomes the token its new beam gets (the group's `pending` choice says
    which parent it continues); a list of one token when `nested` (other requests verify drafts)."""
    groups: dict[int, BeamGroup] = {}
    where: dict[int, int] = {}  # id(slot) -> its position in `requests`
    for i, request in enumerate(requests):
        if request.beam_group is not None:
            groups[id(request.beam_group)] = request.beam_group
            where[id(request)] = i
    for group in groups.values():
        # The scheduler runs a group's beams together: every slot has its row in this step.
        positions = [where[id(s)] for s in group.slots]
        index = torch.tensor([offsets[i] for i in positions], device=logits.device)
        try:
            group.choose(logits.index_select(0, index))
        except BaseException as error:  # its processors raised, or beam sampling drew from NaN
            if not fails_alone(error):
                raise
            group.fail(error)  # the group fails alone; the step's other requests go on
            for i in positions:
                result[i] = [0] if nested else 0  # ignored: a failed group is not advanced
            continue
        for i, token in zip(positions, group.pending[1]):
            result[i] = [token] if nested else token
