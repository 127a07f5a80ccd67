"""OpenAI's presence and frequency penalties (`server/penalties.py`): the formula on generated tokens only,
each row matched to its own prompt, and the ambiguous batches refused."""

import pytest
import torch

pytest.importorskip("transformers")

from hfaccel.server.penalties import OutputTokenPenalties  # noqa: E402


def test_generated_tokens_are_penalised_by_count_and_presence_and_the_prompt_is_not():
    prompt = [1, 2, 2, 3]
    penalties = OutputTokenPenalties([prompt], presence=0.5, frequency=0.25)
    ids = torch.tensor([prompt + [4, 4, 4, 2]])
    scores = torch.zeros(1, 6)
    out = penalties(ids, scores.clone())
    # token 4 three times, token 2 once after the prompt (its two prompt copies are not counted)
    assert out.tolist() == [[0.0, 0.0, -0.75, 0.0, -1.25, 0.0]]
    assert torch.equal(penalties(torch.tensor([prompt]), scores), scores)  # nothing generated yet


def test_each_row_counts_after_its_own_prompt():
    prompts = [[7, 8], [5, 6, 7]]
    penalties = OutputTokenPenalties(prompts, presence=0.0, frequency=1.0)
    rows = [[5, 6, 7, 8, 8], [7, 8, 5, 5, 5]]
    out = penalties(torch.tensor(rows), torch.zeros(2, 10))
    assert out[0, 8] == -2 and out[0, 7] == 0  # 7 is the first prompt's last token
    assert out[1, 5] == -3 and out[1, 8] == 0
    with pytest.raises(ValueError, match="none of the call's prompts"):
        penalties(torch.tensor([[9, 9, 9]]), torch.zeros(1, 10))


def test_negative_penalties_raise_the_scores():
    penalties = OutputTokenPenalties([[1]], presence=-1.0, frequency=-0.5)
    assert penalties(torch.tensor([[1, 3, 3]]), torch.zeros(1, 4))[0, 3] == 2.0


def _token_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_served_penalties_equal_generate_with_the_processor_whole_and_streamed(served, client):
    import hfaccel
    from tests.server.conftest import MODEL

    server, model, tokenizer = served
    prompt = "Hello there, how are you?"
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    ask["extra_body"] = {"ignore_eos": True}
    plain = client.completions.create(**ask).choices[0].text
    ids = _token_ids(tokenizer, plain)
    assert len(set(ids)) < len(ids), plain  # a repeat: a frequency penalty changes it
    processor = OutputTokenPenalties([tokenizer(prompt)["input_ids"]], presence=0.5, frequency=1.5)
    expected = hfaccel.generate(
        model, [prompt], tokenizer=tokenizer, max_new_tokens=24, min_new_tokens=24, do_sample=False,
        logits_processor=[processor],
    )[0]  # fmt: skip
    whole = client.completions.create(**ask, presence_penalty=0.5, frequency_penalty=1.5)
    assert whole.choices[0].text == expected.text != plain
    chunks = client.completions.create(**ask, presence_penalty=0.5, frequency_penalty=1.5, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text


def test_a_penalised_completions_batch_answers_each_prompt_as_alone(served, client):
    from tests.server.conftest import MODEL, post

    ask = {"model": MODEL, "max_tokens": 12, "temperature": 0, "frequency_penalty": 2.0}
    ask["extra_body"] = {"ignore_eos": True}
    prompts = ["Hello there", "The cat sat on"]
    alone = [client.completions.create(**ask, prompt=p).choices[0].text for p in prompts]
    batch = client.completions.create(**ask, prompt=prompts)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    extra = ask.pop("extra_body")
    body = {**ask, **extra, "prompt": ["Hello", "Hello there"]}
    code, _, answer = post(served[0], "/v1/completions", body)
    assert code == 400 and answer["error"]["param"] == "frequency_penalty", answer
    assert "prompt 1 begins with prompt 0" in answer["error"]["message"]
