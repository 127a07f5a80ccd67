"""Microbatches of whole sequences: same greedy tokens, sequences never split, rows in order."""

import pytest

import hfaccel
from hfaccel.engine.batch import ScheduledStep, pack_step
from hfaccel.engine.microbatch import split_microbatches
from hfaccel.engine.request import Request, StoppingParams
from tests.helpers import tiny_model, varied_prompts


def _request(rid, prompt, out=(), computed=0, blocks=()):
    request = Request(rid, list(prompt), StoppingParams(max_new_tokens=8))
    request.output_token_ids = list(out)
    request.num_computed_tokens = computed
    request.block_ids = list(blocks)
    return request


def test_split_keeps_sequences_whole_and_sampled_rows_in_order():
    a = _request("a", [1, 2, 3, 4, 5], out=[6], computed=5, blocks=[0, 1])
    b = _request("b", [7, 8, 9], out=[10], computed=3, blocks=[2])
    c = _request("c", list(range(20, 32)), blocks=[3, 4, 5])
    d = _request("d", list(range(40, 46)), computed=2, blocks=[6, 7])
    packed = pack_step(ScheduledStep([a, b, c, d], [1, 1, 12, 4]), block_size=4)
    parts = split_microbatches(packed, 2)
    assert [p.layout.query_lens for p in parts] == [[1, 1, 12], [4]]  # 18 tokens: split after 14
    assert sum(len(p.input_ids) for p in parts) == len(packed.input_ids)
    assert [r for p in parts for r in p.sampled_requests] == packed.sampled_requests
    offset = 0
    for part in parts:  # each part's tokens are a contiguous run of whole sequences
        n = len(part.input_ids)
        assert part.input_ids == packed.input_ids[offset : offset + n]
        assert part.layout.slot_mapping == packed.layout.slot_mapping[offset : offset + n]
        assert sum(part.layout.query_lens) == n
        offset += n
    assert split_microbatches(packed, 1) == [packed]
    assert len(split_microbatches(packed, 10)) <= 4


@pytest.mark.parametrize("count", [2, 4])
def test_microbatched_steps_give_the_same_greedy_tokens(count):
    model = tiny_model("llama")
    prompts = varied_prompts(10)
    reference = [c.token_ids for c in hfaccel.generate(model, prompts, max_new_tokens=8, progress=False)]
    hfaccel.patch(model, num_microbatches=count, max_num_batched_tokens=64)
    try:
        ours = [c.token_ids for c in hfaccel.generate(model, prompts, max_new_tokens=8, progress=False)]
        log = model._hfaccel.engine.runner.microbatch_log
    finally:
        hfaccel.unpatch(model)
    assert ours == reference
    assert log and all(1 < len(split) <= count for split in log)
