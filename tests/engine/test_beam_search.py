"""Beam search in the engine: the search step against transformers' own helpers, whole runs against HF's
beam search, and beam groups preempted, restarted and aborted without leaking a block."""

import inspect

import pytest
import torch
from transformers.generation.utils import GenerationMixin as GM

from hfaccel import EngineConfig
from hfaccel.engine.beam_search import BeamParams, BeamSearch
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import SamplingParams, StoppingParams
from tests.helpers import EOS, PAD, check_consistent, tiny_model

TOP_K_PARAMETERS = inspect.signature(GM._get_top_k_continuations).parameters


class HFBeamSearch:
    """HF's `_beam_search` loop body for a batch of prompts, driven with given log-probabilities."""

    def __init__(self, batch, num_beams, prompt_len, max_new, eos, length_penalty, early_stopping):
        self.b, self.nb, self.prompt_len = batch, num_beams, prompt_len
        self.max_length = prompt_len + max_new
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.lp, self.early = length_penalty, early_stopping
        self.keep = max(2, 1 + len(eos)) * num_beams
        self.top_mask = torch.cat(
            (torch.ones(num_beams, dtype=torch.bool), torch.zeros(self.keep - num_beams, dtype=torch.bool))
        )
        self.running_sequences = torch.full((batch, num_beams, self.max_length), -1, dtype=torch.int64)
        self.running_sequences[:, :, :prompt_len] = 7
        self.sequences = self.running_sequences.clone()
        self.running_scores = torch.zeros((batch, num_beams))
        self.running_scores[:, 1:] = -1e9
        self.beam_scores = torch.full((batch, num_beams), -1e9)
        self.finished = torch.zeros((batch, num_beams), dtype=torch.bool)
        self.heuristic = torch.ones((batch, 1), dtype=torch.bool)
        self.running_indices = torch.full((batch, num_beams, max_new), -1, dtype=torch.int32)
        self.beam_indices = self.running_indices.clone()
        self.cur_len = prompt_len

    def step(self, log_probs):  # [batch * num_beams, V]
        b, nb, cur = self.b, self.nb, self.cur_len
        log_probs = GM._unflatten_beam_dim(log_probs, b, nb) + self.running_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (b, -1))
        sizes = {"num_beams": nb, "batch_size": b}
        if "vocab_size" in TOP_K_PARAMETERS:  # transformers before 5.18 took it too
            sizes["vocab_size"] = log_probs.shape[-1] // nb
        topk_lp, topk_seqs, topk_indices = GM._get_top_k_continuations(
            GM,
            log_probs,
            self.running_sequences,
            self.running_indices,
            cur,
            self.prompt_len,
            False,
            self.keep,
            **sizes,
        )
        last = topk_seqs[:, :, cur]
        hits = torch.isin(last, self.eos) | (cur + 1 >= self.max_length)
        self.running_sequences, self.running_scores, self.running_indices = (
            GM._get_running_beams_for_next_iteration(GM, topk_lp, topk_seqs, topk_indices, hits, nb)
        )
        self.sequences, self.beam_scores, self.beam_indices, self.finished = GM._update_finished_beams(
            GM,
            self.sequences,
            topk_seqs,
            self.beam_scores,
            topk_lp,
            self.beam_indices,
            topk_indices,
            self.heuristic,
            self.finished,
            hits,
            self.top_mask,
            nb,
            cur,
            self.prompt_len,
            self.lp,
            self.early,
        )
        self.cur_len = cur + 1
        self.heuristic = GM._check_early_stop_heuristic(
            self.heuristic,
            self.running_scores,
            self.beam_scores,
            self.finished,
            self.cur_len,
            self.max_length,
            self.prompt_len,
            self.early,
            self.lp,
        )
        return hits

    def row_done(self, i, hits):
        """HF's stopping condition for prompt `i` alone."""
        return not bool(
            GM._beam_search_has_unfinished_sequences(self.heuristic[i], self.finished[i], hits[i], self.early)
        )


@pytest.mark.parametrize("num_beams", [1, 2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 2.0, 0.0, -1.5])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("eos", [[], [3], [3, 5]])
def test_step_equals_hfs_helpers(num_beams, length_penalty, early_stopping, eos):
    """Random log-probabilities (EOS made likely) through our search step and through HF's helpers, for
    two prompts at once: the same running beams, scores, hypotheses and stopping step, bit for bit."""
    g = torch.Generator().manual_seed(num_beams * 31 + len(eos))
    vocab, max_new, batch = 12, 9, 2
    hf = HFBeamSearch(batch, num_beams, 3, max_new, eos, length_penalty, early_stopping)
    params = BeamParams(num_beams, length_penalty, early_stopping, num_return_sequences=num_beams)
    ours = [BeamSearch(params, max_new, eos) for _ in range(batch)]
    beams = [[[] for _ in range(num_beams)] for _ in range(batch)]
    for _ in range(max_new):
        logits = torch.randn((batch * num_beams, vocab), generator=g) * 3
        for token in eos:
            logits[:, token] += 1.5
        log_probs = torch.log_softmax(logits, dim=-1)
        live = [i for i in range(batch) if not ours[i].done]
        choices = {i: ours[i].step(log_probs[i * num_beams : (i + 1) * num_beams], beams[i]) for i in live}
        hits = hf.step(log_probs)
        for i in range(batch):
            if i not in live:  # done earlier in ours; HF keeps it frozen
                continue
            parents, tokens = choices[i]
            beams[i] = [beams[i][p] + [t] for p, t in zip(parents, tokens)]
            assert tokens == hf.running_sequences[i, :, hf.cur_len - 1].tolist()
            step = hf.cur_len - 1 - hf.prompt_len
            assert parents == (hf.running_indices[i, :, step] - i * num_beams).tolist()
            assert torch.equal(ours[i].running_scores, hf.running_scores[i])
            assert torch.equal(ours[i].finished_scores, hf.beam_scores[i])
            assert ours[i].done == hf.row_done(i, hits), "the prompt stops at HF's step"
        if all(s.done for s in ours):
            break
    for i, search in enumerate(ours):  # frozen since it stopped: what HF returns at the end
        assert search.done
        for k, (tokens, score) in enumerate(search.results()):
            generated = hf.sequences[i, k, hf.prompt_len :].tolist()
            length = int((hf.beam_indices[i, k] >= 0).sum())
            assert tokens == generated[:length]
            assert score == float(hf.beam_scores[i, k])


def test_beam_params_are_validated():
    with pytest.raises(ValueError, match="num_return_sequences"):
        BeamParams(2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamParams(2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="num_beams"):
        BeamParams(0)


# ----------------------------------------------------------------- the engine

MODEL = tiny_model("llama")
PROMPTS = [[5, 6, 7], [9] * 12, [11, 12, 13, 14, 15, 16, 17], [20], list(range(30, 67))]


def eos_token():
    """A token the model likes to produce: EOS that is hit early."""
    with torch.no_grad():
        return int(MODEL(torch.tensor([PROMPTS[0]])).logits[0, -1].argmax())


def hf_beams(prompt, max_new, eos, **kwargs):
    with torch.no_grad():
        out = type(MODEL).generate(
            MODEL,
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=PAD,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    return [row[len(prompt) :].tolist() for row in out.sequences], out.sequences_scores.tolist()


def run(engine, requests):
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        check_consistent(engine)
    assert all(r.is_finished for r in requests)
    assert engine.block_manager.num_used_blocks == 0, "KV blocks leaked"


def beam_requests(engine, nb, max_new, eos, prompts=PROMPTS, nrs=2, **kwargs):
    params = SamplingParams(beam=BeamParams(nb, num_return_sequences=nrs, **kwargs))
    stopping = StoppingParams(max_new_tokens=max_new, eos_token_ids=frozenset({eos}))
    return [engine.add_request(p, stopping, params) for p in prompts]


def check_against_hf(requests, prompts, max_new, eos, nb, nrs=2, **kwargs):
    for prompt, request in zip(prompts, requests):
        ref, ref_scores = hf_beams(prompt, max_new, eos, num_beams=nb, num_return_sequences=nrs, **kwargs)
        ours = request.beam_group.results
        width = max(len(t) for t, _ in ours)
        fill = PAD or eos  # HF fills with the first EOS id when the pad id is 0
        assert [t + [fill] * (width - len(t)) for t, _ in ours] == ref
        # Scores are sums of ~100 log-probabilities: the attention kernel's summation order moves them by ulps.
        assert [s for _, s in ours] == pytest.approx(ref_scores, rel=1e-6, abs=1e-5)
        assert request.output_token_ids == ours[0][0]


@pytest.mark.parametrize(
    "nb, kwargs",
    [
        (4, {}),
        (3, {"length_penalty": 2.0, "early_stopping": True}),
        (2, {"early_stopping": "never", "length_penalty": -0.5}),
    ],
)
def test_engine_beams_equal_hf(nb, kwargs):
    eos = eos_token()
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000, max_num_seqs=32))
    requests = beam_requests(engine, nb, 10, eos, **kwargs)
    plain = engine.add_request([40, 41, 42], StoppingParams(max_new_tokens=6))  # beside them in the batch
    run(engine, requests + [plain])
    check_against_hf(requests, PROMPTS, 10, eos, nb, **kwargs)
    assert any(r.finish_reason == "stop" for r in requests), "EOS ended some search early"
    assert len(plain.output_token_ids) == 6


def test_beams_share_the_prompt_blocks():
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000, max_num_seqs=8))
    (request,) = beam_requests(engine, 4, 6, EOS, prompts=[list(range(30, 51))])  # 21 tokens: 5 full blocks
    manager = engine.block_manager
    engine.step()  # the prompt, then the first search step forks it into 4 beams
    slots = request.beam_group.slots
    assert len(slots) == 4 and slots[0] is request
    assert all(s.block_ids == request.block_ids for s in slots) and len(request.block_ids) == 6
    assert all(manager.ref_count(b) == 4 for b in request.block_ids) and manager.num_used_blocks == 6
    engine.step()  # 3 beams copy the partial block before writing; then the beams re-fork
    for index in range(5):  # the prompt's full blocks, shared by every beam
        assert len({s.block_ids[index] for s in slots}) == 1
        assert manager.ref_count(slots[0].block_ids[index]) == 4
    lineages = {s.output_token_ids[0] for s in slots}  # distinct parents of this step
    assert len({s.block_ids[5] for s in slots}) == len(lineages), "beams of one parent share its block"
    assert manager.num_used_blocks == 5 + len(lineages)
    run(engine, [request])


def test_a_beam_group_preempted_restarts_and_gives_the_same_result():
    reference = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000))
    expected = beam_requests(reference, 3, 12, EOS, prompts=PROMPTS[:3])
    run(reference, expected)
    # 16 blocks of 4 tokens: the three groups cannot all run at once.
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=16 * 1024 * 2, max_num_seqs=12))
    assert engine.num_blocks == 16
    requests = beam_requests(engine, 3, 12, EOS, prompts=PROMPTS[:3])
    run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    # The same hypotheses; their scores to float32 rounding: a restart recomputes the sequences as one
    # prefill, whose sums some CPUs' matmul kernels (AVX-512 with AMX) order differently from decode steps.
    got = [r.beam_group.results for r in requests]
    want = [r.beam_group.results for r in expected]
    assert [[tokens for tokens, _ in group] for group in got] == [
        [tokens for tokens, _ in group] for group in want
    ]
    scores = [score for group in got for _, score in group]
    assert scores == pytest.approx([score for group in want for _, score in group], rel=1e-5, abs=1e-5)


def test_preempting_one_beam_preempts_its_group():
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000))
    (request,) = beam_requests(engine, 3, 8, EOS, prompts=[PROMPTS[2]])
    for _ in range(3):
        engine.step()
    group = request.beam_group
    assert group.forked and len(engine.scheduler.running) == 3
    engine.scheduler.preempt(group.slots[2])
    check_consistent(engine)
    assert len(engine.scheduler.running) == 0 and list(engine.scheduler.waiting) == [request]
    assert group.slots == [request] and request.output_token_ids == [] and group.search.generated == 0
    assert engine.block_manager.num_used_blocks == 0
    run(engine, [request])
    assert request.num_preemptions == 1


@pytest.mark.parametrize("steps", [0, 1, 2, 5])
def test_aborting_a_beam_group_midway_frees_every_block(steps):
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000, enable_prefix_caching=True))
    requests = beam_requests(engine, 4, 10, EOS, prompts=PROMPTS[:2])
    for _ in range(steps):
        engine.step()
    engine.abort(requests[0])
    check_consistent(engine)
    assert requests[0].finish_reason == "abort" and requests[0].block_ids == []
    assert all(s.block_ids == [] for s in requests[0].beam_group.slots)
    engine.abort(requests[0])  # idempotent
    run(engine, requests[1:])
    assert engine.block_manager.num_used_blocks == 0


def test_a_group_needs_seats_for_all_its_beams():
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000, max_num_seqs=5))
    requests = beam_requests(engine, 4, 5, EOS, prompts=PROMPTS[:2])
    plain = [engine.add_request([50 + i], StoppingParams(max_new_tokens=3)) for i in range(3)]
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        assert len(engine.scheduler.running) <= 5
    assert all(r.is_finished for r in requests + plain)
    with pytest.raises(ValueError, match="more than max_num_seqs"):
        beam_requests(engine, 6, 5, EOS, prompts=PROMPTS[:1])


def test_beam_requests_that_cannot_be_served_are_refused():
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000, max_model_len=64))
    with pytest.raises(ValueError, match="runs past the model's context"):
        beam_requests(engine, 2, 40, EOS, prompts=[PROMPTS[4]])
    (request,) = beam_requests(engine, 2, 4, EOS, prompts=[PROMPTS[0]])
    with pytest.raises(ValueError, match="cannot be streamed"):
        engine.stream(request)
    sampled = SamplingParams(do_sample=True, beam=BeamParams(2))
    with pytest.raises(ValueError, match="SamplingParams.do_sample must be its BeamParams.do_sample"):
        engine.add_request([5, 6], StoppingParams(max_new_tokens=3), sampled)
    run(engine, [request])


@pytest.mark.parametrize("fault", ["nan", "raise"])
def test_a_beam_groups_own_fault_fails_it_alone(fault):
    """Beam sampling from NaN scores (torch's multinomial raises, as in transformers) or the request's
    own processor raising fails that request alone: the step's other requests (a second beam group, a
    plain one) go on to HF's tokens, and no block leaks."""
    from transformers import LogitsProcessorList

    def faulty(input_ids, scores):
        if input_ids.shape[1] > 2:  # after the group has forked
            if fault == "raise":
                raise ValueError("boom")
            return scores.fill_(float("nan"))
        return scores

    eos = eos_token()
    engine = Engine(MODEL, EngineConfig(block_size=4, kv_cache_memory=2_000_000, max_num_seqs=32))
    beams = BeamParams(2, do_sample=True)
    params = SamplingParams(do_sample=True, beam=beams, processors=LogitsProcessorList([faulty]))
    bad = engine.add_request(PROMPTS[0], StoppingParams(max_new_tokens=8), params)
    good = beam_requests(engine, 2, 8, eos, prompts=PROMPTS[1:2])
    plain = engine.add_request([40, 41, 42], StoppingParams(max_new_tokens=6))
    run(engine, [bad, *good, plain])
    assert bad.finish_reason == "error" and bad.failed_alone
    assert ("boom" if fault == "raise" else "probability tensor contains either") in str(bad.error)
    check_against_hf(good, PROMPTS[1:2], 8, eos, 2)
    assert len(plain.output_token_ids) == 6


def test_a_beam_request_the_cache_cannot_hold_is_refused_naming_its_beams():
    """Its blocks count every beam (the prompt's full blocks shared): the message says so."""
    engine = Engine(MODEL, EngineConfig(block_size=2, kv_cache_memory=48 * 512, max_num_seqs=8))
    assert engine.block_manager.num_blocks < 60
    with pytest.raises(
        ValueError, match=r"needs \d+ blocks \(42 tokens in each of 3 beams, .*or use fewer beams"
    ):
        beam_requests(engine, 3, 20, EOS, prompts=[list(range(30, 52))])
    plain = engine.add_request(list(range(30, 52)), StoppingParams(max_new_tokens=20))  # one sequence fits
    run(engine, [plain])
