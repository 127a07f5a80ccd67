"""`recorded_states.store`: each recorded request's tokens of a step, keyed by what they are to the caller
(prompt or output index), with the probabilities over the keys each one saw; other requests untouched."""

import torch

from hfaccel.engine.recorded_states import store
from hfaccel.engine.request import Request, SamplingParams, StoppingParams


def _request(prompt_len, hidden=True, attentions=True):
    sampling = SamplingParams(output_hidden_states=hidden, output_attentions=attentions)
    return Request("r", list(range(3, 3 + prompt_len)), StoppingParams(max_new_tokens=4), sampling)


def test_tokens_are_keyed_by_prompt_and_output_index_with_the_keys_they_saw():
    layers, heads, tokens, longest = 2, 3, 6, 7
    hidden = tuple(torch.randn(1, tokens, 5) for _ in range(layers + 1))
    probs = tuple(torch.rand(1, heads, tokens, longest) for _ in range(layers))
    prompt = _request(4)  # its last 2 prompt tokens and its first output token: positions 2-4 of 5
    chunk = _request(3, attentions=False)  # hidden states only: its 3 prompt tokens, a chunk of 3 of 3
    store([(0, prompt, 2, 3, 5), (3, chunk, 0, 3, 3)], hidden, probs)
    assert sorted(prompt.recorded) == [("output", 0), ("prompt", 2), ("prompt", 3)]
    first = prompt.recorded[("prompt", 2)]
    assert [a.shape for a in first.attentions] == [(heads, 3)] * layers  # positions 0-2
    assert prompt.recorded[("output", 0)].attentions[0].shape == (heads, 5)
    torch.testing.assert_close(prompt.recorded[("output", 0)].attentions[1], probs[1][0, :, 2, :5])
    torch.testing.assert_close(first.hidden_states[0], hidden[0][0, 0])
    assert sorted(chunk.recorded) == [("prompt", 0), ("prompt", 1), ("prompt", 2)]
    assert chunk.recorded[("prompt", 2)].attentions is None
    torch.testing.assert_close(chunk.recorded[("prompt", 1)].hidden_states[2], hidden[2][0, 4])


def test_a_query_only_token_sees_the_keys_before_it_and_a_recomputed_token_overwrites():
    """A masked last token is packed with its sequence ending before it (seq_len = its index): it sees
    every key before it. Recording the same position again replaces the record."""
    probs = (torch.rand(1, 2, 1, 4),)
    request = _request(5, hidden=False)
    store([(0, request, 4, 1, 4)], None, probs)
    assert request.recorded[("prompt", 4)].attentions[0].shape == (2, 4)
    again = (torch.zeros(1, 2, 1, 4),)
    store([(0, request, 4, 1, 4)], None, again)
    assert not request.recorded[("prompt", 4)].attentions[0].any()
