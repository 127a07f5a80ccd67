"""``/v1/responses`` against a real server through the real `openai` client: the answer equals chat's
(and so `hfaccel.generate`'s), the typed event stream joins to it, a length cut is "incomplete", and
what is not served is a 400 naming its field."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import hfaccel  # noqa: E402
from hfaccel.server.protocol import ChatMessage  # noqa: E402
from hfaccel.server.responses import ResponsesRequest, _messages  # noqa: E402
from tests.helpers import tiny_model, tiny_tokenizer  # noqa: E402
from tests.server.conftest import TOOLS  # noqa: E402
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
        ({"input": [{"type": "web_search_call", "id": "1"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "1", "arguments": "{}"}]}, "input[0]"),  # no name
        ({"input": [{"type": "function_call_output", "call_id": 1, "output": "x"}]}, "input[0].call_id"),
        (
            {"input": [{"type": "function_call", "call_id": "1", "name": "add", "arguments": "[1]"}]},
            "input[0].arguments",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "1", "name": "f", "arguments": "{x"},
                ]
            },
            "input[1].arguments",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": [{"role": "user", "content": ["hi"]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [None]}]}, "input[0].content[0]"),
    ],
)
def test_what_is_not_served_is_a_400_naming_its_field(served, body, param):
    status, _, error = post(served[0], "/v1/responses", {"model": MODEL, **body})
    assert status == 400 and error["error"]["param"] == param, error


FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def test_a_reply_with_reasoning_and_tool_calls_gives_those_output_items(client, scripted):
    answer = client.responses.create(model=MODEL, input="2+3 and 4+5?", tools=FLAT_TOOLS)
    assert [item.type for item in answer.output] == ["reasoning", "message", "function_call", "function_call"]
    assert answer.output[0].content[0].text == "sum it" and answer.output_text == "On it."
    calls = answer.output[2:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 2, "b": 3}),
        ("add", {"a": 4, "b": 5}),
    ]
    assert calls[0].call_id.startswith("call_") and calls[0].call_id != calls[1].call_id
    assert answer.status == "completed"


def test_the_event_stream_announces_each_item_and_ends_with_the_whole_response(client, scripted):
    events = list(client.responses.create(model=MODEL, input="2+3 and 4+5?", tools=FLAT_TOOLS, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call"), (3, "function_call")]
    # Each item is completed before the next is announced, as OpenAI's stream goes.
    lifecycle = [e.output_index for e in events if e.type.startswith("response.output_item.")]
    assert lifecycle == [0, 0, 1, 1, 2, 2, 3, 3] and done == added
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "sum it"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "On it."
    calls = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 2, "b": 3}),
        ("add", {"a": 4, "b": 5}),
    ]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == "On it."
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]


def test_a_tool_conversations_items_become_the_chat_messages_transformers_serve_makes():
    body = ResponsesRequest(
        model=MODEL,
        input=[
            {"role": "user", "content": "2+3?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "add"}],
            },
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
            {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 0, "b": 0}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "5"},
            {"type": "function_call_output", "call_id": "call_2", "output": "0"},
        ],
    )
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}, "id": "call_1"}
    second = {
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 0, "b": 0}'},
        "id": "call_2",
    }
    assert _messages(body) == [
        ChatMessage(role="user", content="2+3?"),
        ChatMessage(role="assistant", tool_calls=[call, second], reasoning_content="add"),
        ChatMessage(role="tool", content="5", tool_call_id="call_1"),
        ChatMessage(role="tool", content="0", tool_call_id="call_2"),
    ]


def test_a_reasoning_item_between_a_message_and_its_call_stays_with_that_message():
    """The server's own output of a reply that reasons after its text ([message, reasoning, call]) sent
    back as input: the reasoning joins the assistant message its call joins (it was dropped)."""
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "add"}],
    }
    body = ResponsesRequest(
        model=MODEL,
        input=[
            {"role": "user", "content": "2+3?"},
            {"type": "message", "role": "assistant", "content": "let me"},
            reasoning,
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        ],
    )
    assistant = _messages(body)[1]
    assert (assistant.role, assistant.content, assistant.reasoning_content) == ("assistant", "let me", "add")
    assert [c["id"] for c in assistant.tool_calls] == ["call_1"]


def response_both(client, **ask):
    whole = client.responses.create(model=MODEL, input="2+3?", tools=FLAT_TOOLS, **ask)
    events = list(client.responses.create(model=MODEL, input="2+3?", tools=FLAT_TOOLS, stream=True, **ask))
    return whole, events[-1].response


def shape(response):
    items = []
    for item in response.output:
        if item.type == "reasoning":
            items.append(("reasoning", item.content[0].text))
        elif item.type == "message":
            items.append(("message", item.content[0].text if item.content else ""))
        else:
            items.append((item.type, item.name, item.arguments))
    return response.status, items


@pytest.mark.parametrize(
    "script",
    [
        '<think>first</think><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<think>second</think><tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
        "<think>  </think>  Hi",
        "<think>r</think>On it.<tool_call>{bad json</tool_call>",
    ],
)
def test_whole_and_streamed_responses_have_the_same_items(client, scripted, script):
    scripted(script)
    whole, streamed = response_both(client)
    assert shape(whole) == shape(streamed)


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_of_calls_only_has_no_message_item_and_text_after_a_call_has_its_own(
    client, scripted, stream
):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    for script, types in [
        (call, ["function_call"]),
        ("Sure." + call + "  Done.", ["message", "function_call", "message"]),
    ]:
        scripted(script)
        kwargs = {"model": MODEL, "input": "1+2?", "tools": FLAT_TOOLS}
        if stream:
            answer = list(client.responses.create(stream=True, **kwargs))[-1].response
        else:
            answer = client.responses.create(**kwargs)
        assert [item.type for item in answer.output] == types
        messages = [item for item in answer.output if item.type == "message"]
        assert len({m.id for m in messages}) == len(messages), "each message has its own id"
        assert answer.output_text == ("" if len(types) == 1 else "Sure.Done.")  # each message trimmed


def test_text_after_a_call_sent_back_joins_the_turn_it_came_in():
    """The server's own output of "Sure.<call>Done." ([message, function_call, message]) sent back as input
    with the call's output: one assistant turn, its text and its call, then the tool message."""
    body = ResponsesRequest(
        model=MODEL,
        input=[
            {"role": "user", "content": "1+2?"},
            {"type": "message", "role": "assistant", "content": "Sure."},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
            {"type": "message", "role": "assistant", "content": "Done."},
            {"type": "function_call_output", "call_id": "call_1", "output": "3"},
        ],
    )
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}, "id": "call_1"}
    assert _messages(body) == [
        ChatMessage(role="user", content="1+2?"),
        ChatMessage(role="assistant", content="Sure.Done.", tool_calls=[call]),
        ChatMessage(role="tool", content="3", tool_call_id="call_1"),
    ]


def test_a_response_cut_by_the_length_after_a_call_is_incomplete(client, scripted):
    scripted('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>More', finish="length")
    whole, streamed = response_both(client)
    assert whole.status == streamed.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("input_", "param"),
    [
        ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}], "input"),
        ([{"type": ["message"], "role": "user", "content": "hi"}], "input[0].type"),
        ([{"role": "user", "content": "hi"}, {"type": "reasoning", "content": 5}], "input[1].content"),
    ],
)
def test_inputs_without_a_message_or_with_odd_types_are_400s(served, input_, param):
    status, _, error = post(served[0], "/v1/responses", {"model": MODEL, "input": input_})
    assert status == 400 and error["error"]["param"] == param, error


def test_parallel_tool_calls_false_gives_one_function_call_item(client, scripted):
    for stream in (False, True):
        ask = {"model": MODEL, "input": "2+3 and 4+5?", "tools": FLAT_TOOLS, "parallel_tool_calls": False}
        if stream:
            events = list(client.responses.create(**ask, stream=True))
            answer = next(e.response for e in events if e.type == "response.completed")
            added = [e.item.type for e in events if e.type == "response.output_item.added"]
            assert added == ["reasoning", "message", "function_call"]
        else:
            answer = client.responses.create(**ask)
        assert [item.type for item in answer.output] == ["reasoning", "message", "function_call"], stream
        assert json.loads(answer.output[2].arguments) == {"a": 2, "b": 3}
        assert answer.parallel_tool_calls is False


def test_a_message_items_text_parts_are_joined_by_a_space():
    """As chat's parts are, and as transformers serve joins them (glued, "morning" + "Hello" merged)."""
    parts = [{"type": "input_text", "text": "Good morning"}, {"type": "input_text", "text": "Hello"}]
    body = ResponsesRequest(model=MODEL, input=[{"type": "message", "role": "user", "content": parts}])
    assert _messages(body) == [ChatMessage(role="user", content="Good morning Hello")]
