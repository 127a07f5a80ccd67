import pytest

from hfaccel.engine.batch import Batch, ScheduledStep, pack_step
from hfaccel.engine.request import Request, StoppingParams


def req(rid, prompt, out=(), computed=0, blocks=()):
    r = Request(rid, list(prompt), StoppingParams(max_new_tokens=10))
    r.output_token_ids = list(out)
    r.num_computed_tokens = computed
    r.block_ids = list(blocks)
    return r


def test_merge_appends_in_order_and_rejects_duplicates():
    a, b, c = req("a", [5]), req("b", [6]), req("c", [7])
    batch = Batch([a]).merge([b, c])
    assert [r.request_id for r in batch] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="request 'b' is already in the batch"):
        batch.merge([b])
    assert len(batch) == 3


def test_filter_keeps_order_and_returns_removed():
    a, b, c, d = (req(x, [5]) for x in "abcd")
    batch = Batch([a, b, c, d])
    removed = batch.filter(lambda r: r.request_id in ("a", "c"))
    assert [r.request_id for r in batch] == ["a", "c"]
    assert [r.request_id for r in removed] == ["b", "d"]
    assert b not in batch and a in batch


def test_pack_step_puts_decode_path_sequences_first_in_scheduler_order():
    decode = req("d", [10, 11, 12, 13, 14], out=[15, 16], computed=6, blocks=[7, 2])
    fresh = req("f", [20, 21, 22], blocks=[5])
    other = req("o", [40, 41], out=[42], computed=2, blocks=[4])
    packed = pack_step(ScheduledStep([fresh, decode, other], [3, 1, 1]), block_size=4)
    assert packed.layout.query_lens == [1, 1, 3] and packed.layout.num_decodes == 2
    assert packed.input_ids == [16, 42, 20, 21, 22]
    # A backend whose decode path takes up to 3 query tokens serves all three there.
    assert pack_step(ScheduledStep([fresh, decode], [3, 1]), 4, decode_query_len=3).layout.num_decodes == 2


def test_pack_step_tokens_positions_slots_and_sampling():
    decode = req("d", [10, 11, 12, 13, 14], out=[15, 16], computed=6, blocks=[7, 2])
    fresh = req("f", [20, 21, 22], blocks=[5])
    chunk = req("c", [30, 31, 32, 33, 34, 35], computed=2, blocks=[1, 3])
    packed = pack_step(ScheduledStep([decode, fresh, chunk], [1, 3, 2]), block_size=4)
    assert packed.input_ids == [16, 20, 21, 22, 32, 33]
    assert packed.positions == [6, 0, 1, 2, 2, 3]
    layout = packed.layout
    assert layout.slot_mapping == [2 * 4 + 2, 20, 21, 22, 1 * 4 + 2, 1 * 4 + 3]
    assert layout.query_lens == [1, 3, 2]
    assert layout.seq_lens == [7, 3, 4]
    assert layout.num_decodes == 1
    assert layout.block_tables == [[7, 2], [5], [1, 3]]
    # The chunk stops before the prompt's end: no logits for it this step.
    assert packed.logits_indices == [0, 3]
    assert [r.request_id for r in packed.sampled_requests] == ["d", "f"]


def test_a_masked_last_token_is_a_query_at_hf_position_zero_that_sees_the_tokens_before_it():
    """HF's right padding: the last prompt token sits at position 0, sees the attended tokens and not
    itself, and leaves no K/V; the generated tokens take its cache index and positions 1, 2, ..."""
    r = req("r", [30, 31, 32, 99], blocks=[1, 3])
    r.feed_masked_last()
    assert list(r.positions(0, 4)) == [0, 1, 2, 0]
    r.num_computed_tokens = 3  # the three attended tokens are cached (the scheduler feeds them first)
    packed = pack_step(ScheduledStep([r], [1]), block_size=4)
    assert packed.input_ids == [99] and packed.positions == [0]
    layout = packed.layout
    assert layout.query_lens == [1] and layout.seq_lens == [3]  # not itself
    assert layout.slot_mapping == [1 * 4 + 3]  # its own slot, overwritten by the first new token
    assert packed.logits_indices == [0] and packed.sampled_requests == [r]
    r.num_computed_tokens = 4
    r.drop_masked_last()
    r.output_token_ids = [50]
    assert r.prompt_token_ids == [30, 31, 32] and r.num_computed_tokens == 3 and not r.masked_last
    packed = pack_step(ScheduledStep([r], [1]), block_size=4)
    assert packed.input_ids == [50] and packed.positions == [1]
    assert packed.layout.seq_lens == [4] and packed.layout.slot_mapping == [1 * 4 + 3]
    assert list(r.positions(0, 5)) == [0, 1, 2, 1, 2]


def test_a_masked_last_token_needs_a_token_before_it():
    with pytest.raises(ValueError, match="at least one attended token"):
        req("r", [99]).feed_masked_last()
