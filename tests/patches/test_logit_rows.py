"""`LogitRows`: the LM head runs on more rows where that is faster on this CPU, and the tokens are the
same."""

from __future__ import annotations

import time

import torch

import hfaccel
from hfaccel.patches.executor import LogitRows, padded_indices
from tests.helpers import hf_greedy, tiny_model, varied_prompts


class SlowRows(torch.nn.Module):
    """A head whose time depends on its row count as a table says (ms)."""

    def __init__(self, times_ms: dict[int, float]) -> None:
        super().__init__()
        self.times_ms = times_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.times_ms[x.shape[0]] / 1e3)
        return x


def test_rows_are_padded_to_a_multiple_of_four_only_where_that_was_faster():
    rows = LogitRows(SlowRows({3: 6.0, 4: 2.0, 5: 3.0, 8: 3.0, 1: 9.0, 13: 9.0}), 8, torch.float32)
    assert rows.rows(3) == 4  # a third of the time
    assert rows.rows(5) == 5  # no faster: left alone
    assert rows.rows(1) == 1 and rows.rows(4) == 4 and rows.rows(13) == 13  # never timed
    assert rows.choice == {3: 4, 5: 5}


def test_a_head_that_cannot_be_timed_is_never_padded():
    rows = LogitRows(torch.nn.Linear(16, 4), 8, torch.float32)  # not the hidden size it takes
    assert rows.rows(3) == 3


def test_padded_indices_repeat_the_last_one():
    assert padded_indices(torch.tensor([4, 9, 11]), 4).tolist() == [4, 9, 11, 11]
    assert padded_indices(torch.tensor([4]), 1).tolist() == [4]


def test_padded_head_rows_give_the_same_tokens():
    model = tiny_model()
    prompts = varied_prompts(7, seed=9)
    hfaccel.patch(model, strict=True)
    try:
        executor = model._hfaccel.get_engine(model).runner.executor
        executor._logit_rows.choice = {n: -(-n // 4) * 4 for n in range(2, 13)}  # always pad
        completions = hfaccel.generate(model, prompts, max_new_tokens=6, progress=False)
    finally:
        hfaccel.unpatch(model)
    assert [c.token_ids for c in completions] == [hf_greedy(model, p, 6) for p in prompts]


def test_two_engines_of_one_head_shape_share_the_choice_and_the_global_random_state_is_untouched():
    """A second engine over a model of the same head shape takes the first one's choices (no timing of
    its own that noise could send elsewhere: equal logits bits), and timing draws no random numbers."""
    first = LogitRows(torch.nn.Linear(8, 32), 8, torch.float32)
    state = torch.random.get_rng_state()
    first.rows(3)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = LogitRows(torch.nn.Linear(8, 32), 8, torch.float32)
    assert second.choice is first.choice and 3 in second.choice
    assert LogitRows(torch.nn.Linear(8, 48), 8, torch.float32).choice is not first.choice
