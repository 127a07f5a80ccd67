"""The demo's parity check: where two greedy continuations part, and how close the two tokens were."""

import torch

from hfaccel.bench.demo import first_difference_gap
from tests.helpers import tiny_model


def test_first_difference_gap_measures_the_two_chosen_tokens_where_they_part():
    model = tiny_model("llama")
    prompt = [5, 9, 2, 7]
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1]
        top = first.topk(2)
        ref_token = int(top.indices[0])
        second = model(torch.tensor([prompt + [ref_token]])).logits[0, -1]
    runner_up = int(second.topk(2).indices[1])
    ref = [ref_token, int(second.argmax()), 3]
    ours = [ref_token, runner_up, 4]  # parts at token 1, with the runner-up there
    position, gap, size = first_difference_gap(model, prompt, ours, ref)
    top2 = second.topk(2).values
    assert position == 1
    assert gap == float(top2[0] - top2[1])
    assert size == float(top2.abs().max())
