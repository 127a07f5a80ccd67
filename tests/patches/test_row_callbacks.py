"""A user's own logits processors and stopping criteria on the engine, where they could differ from HF:
a batched call warns that they run once per row, and a processor that edits its input in place shows
in ``output_logits`` as it does in HF's."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
)

import hfaccel
from hfaccel.patches import generate as generate_module
from tests.helpers import hf, left_padded, tiny_model

PROMPTS = [[5, 6, 7], [9] * 6, [11, 12, 13, 14]]


class AllowedPerRow(LogitsProcessor):
    """Indexes batch rows: row i may only emit `allowed[i]` (HF's rows differ; per row, all get row 0's)."""

    def __init__(self, allowed):
        self.allowed = allowed

    def __call__(self, input_ids, scores):
        keep = torch.full_like(scores, -float("inf"))
        for i in range(input_ids.shape[0]):
            keep[i, self.allowed[i]] = 0.0
        return scores + keep


class StopWhenRowZeroEnds(StoppingCriteria):
    """One bool for the whole batch, from row 0's last token (a common tutorial criterion)."""

    def __call__(self, input_ids, scores, **kwargs):
        return bool(input_ids[0, -1].item() == 84)


class PenaliseInPlace(LogitsProcessor):
    """Edits the scores it is given in place (HF records that very tensor as the raw logits)."""

    def __call__(self, input_ids, scores):
        scores[:, 84] -= 100.0
        return scores


@pytest.fixture(autouse=True)
def _forget_warned_types():
    generate_module._WARNED_ROW_CALLBACKS.clear()
    yield
    generate_module._WARNED_ROW_CALLBACKS.clear()


def _row_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "runs once per row" in r.getMessage()]


def test_a_batched_call_with_a_custom_processor_warns_once_per_type(caplog):
    model = hfaccel.patch(tiny_model("llama"), kv_cache_memory=4_000_000, block_size=8)
    ids, mask = left_padded(PROMPTS)
    processors = LogitsProcessorList([AllowedPerRow([[10, 11], [20, 21], [30, 31]])])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        model.generate(logits_processor=processors, **kwargs)
        model.generate(logits_processor=processors, **kwargs)
        model.generate(stopping_criteria=[StopWhenRowZeroEnds()], **kwargs)
    messages = _row_warnings(caplog)
    assert len(messages) == 2, messages
    assert "logits_processor AllowedPerRow" in messages[0]
    assert "stopping_criteria StopWhenRowZeroEnds" in messages[1]


def test_one_row_and_transformers_own_processors_do_not_warn(caplog):
    model = hfaccel.patch(tiny_model("llama"), kv_cache_memory=4_000_000, block_size=8)
    ids, mask = left_padded(PROMPTS)
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        model.generate(  # one row: per row is the batch
            input_ids=torch.tensor([PROMPTS[0]]),
            logits_processor=LogitsProcessorList([AllowedPerRow([[10, 11]])]),
            max_new_tokens=3,
            do_sample=False,
        )
        model.generate(  # transformers' own type: a per-row computation
            input_ids=ids,
            attention_mask=mask,
            logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)]),
            max_new_tokens=3,
            do_sample=False,
        )
    assert _row_warnings(caplog) == []


def test_output_logits_show_a_processors_in_place_edit_as_hfs_do():
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=True,
    )
    reference = hf(model, logits_processor=LogitsProcessorList([PenaliseInPlace()]), **kwargs)
    assert float(reference.logits[0][0, 84]) < -50, "HF's raw logits carry the in-place edit"
    hfaccel.patch(model, kv_cache_memory=4_000_000, block_size=8)
    out = model.generate(logits_processor=LogitsProcessorList([PenaliseInPlace()]), **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    for ours, theirs in zip(out.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(out.scores, reference.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_plain_function_processors_warn_each_under_their_own_name(caplog):
    def boost_ten(input_ids, scores):
        return scores + 5.0 * (torch.arange(scores.shape[-1]) == 10)

    def boost_twenty(input_ids, scores):
        return scores + 5.0 * (torch.arange(scores.shape[-1]) == 20)

    model = hfaccel.patch(tiny_model("llama"), kv_cache_memory=4_000_000, block_size=8)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        for function in (boost_ten, boost_twenty, boost_ten):
            model.generate(logits_processor=LogitsProcessorList([function]), **kwargs)
    messages = _row_warnings(caplog)
    assert len(messages) == 2 and "boost_ten" in messages[0] and "boost_twenty" in messages[1], messages
