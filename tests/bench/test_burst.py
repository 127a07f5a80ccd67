"""`bench burst`'s workload: every fifth request carries the long shared context."""

from __future__ import annotations

from hfaccel.bench.burst import CONTEXT, _prompts
from tests.helpers import tiny_tokenizer


def test_every_fifth_prompt_has_the_long_shared_context():
    tokenizer = tiny_tokenizer()
    prompts = _prompts(tokenizer, 10)
    long = [i for i, p in enumerate(prompts) if len(p) > len(CONTEXT)]
    assert long == [0, 5]
    assert len({tuple(p) for p in prompts}) == 10  # every request its own question
