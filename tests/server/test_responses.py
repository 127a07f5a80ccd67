"""``/v1/responses`` against a real server through the real `openai` client: the answer equals chat's
(and so `hfaccel.generate`'s), the typed event stream joins to it, a length cut is "incomplete", and
what is not served is a 400 naming its field."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import hfaccel  # noqa: E402
from tests.helpers import tiny_model, tiny_tokenizer  # noqa: E402
from tests.server.test_server import post  # noqa: E402

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def served():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    server = hfaccel.serve(model, tokenizer, port=0, model_id=MODEL, kv_cache_memory=8_000_000)
    yield server, model, tokenizer
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_chat_answer_of_its_input_and_instructions(served, client):
    _, model, tokenizer = served
    answer = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hello there!", max_output_tokens=10, temperature=0
    )
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    expected = hfaccel.generate(model, [chat], tokenizer=tokenizer, max_new_tokens=10, do_sample=False)[0]
    assert answer.output_text == expected.text
    assert answer.object == "response" and answer.output[0].role == "assistant"
    assert answer.usage.output_tokens == len(expected.token_ids)
    cut = expected.finish_reason == "length"
    assert answer.status == ("incomplete" if cut else "completed")
    assert (answer.incomplete_details.reason if cut else answer.incomplete_details) == (
        "max_output_tokens" if cut else None
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there!"}]},
    ]
    same = client.responses.create(model=MODEL, input=messages, max_output_tokens=10, temperature=0)
    assert same.output_text == answer.output_text


def test_the_event_stream_joins_to_the_whole_response(served, client):
    whole = client.responses.create(
        model=MODEL, input="Tell me a story.", max_output_tokens=14, temperature=0
    )
    events = list(
        client.responses.create(
            model=MODEL, input="Tell me a story.", max_output_tokens=14, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == f"response.{whole.status}" and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"type": "function_call_output", "call_id": "1", "output": "x"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format.type"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"role": "user", "content": ["hi"]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [None]}]}, "input[0].content[0]"),
    ],
)
def test_what_is_not_served_is_a_400_naming_its_field(served, body, param):
    status, _, error = post(served[0], "/v1/responses", {"model": MODEL, **body})
    assert status == 400 and error["error"]["param"] == param, error
