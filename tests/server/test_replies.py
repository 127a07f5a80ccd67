"""Chat replies read by the model's response template, as transformers serve reads them: reasoning apart
from the content, tool calls as OpenAI's ``tool_calls`` (finish_reason ``"tool_calls"``), whole and
streamed, through the `openai` client. A model without a template gets its text as generated (every other
server test)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import CHAT, MODEL, TOOLS

pytest.importorskip("fastapi")


def test_a_reply_with_tool_calls_gives_openais_tool_calls(client, scripted):
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "On it."
    assert choice.message.model_extra["reasoning_content"] == "sum it"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "add", {"a": 2, "b": 3}),  # "2" typed by the tool's schema
        ("function", "add", {"a": 4, "b": 5}),
    ]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


def test_a_streamed_reply_with_tool_calls_gives_them_whole_and_numbered(client, scripted):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "On it."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "sum it"
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "add", {"a": 2, "b": 3}),
        (1, "add", {"a": 4, "b": 5}),
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_reply_that_stops_being_readable_is_the_same_text_whole_and_streamed(client, scripted, caplog):
    """Bad JSON in a tool call: the stream goes on to its end as text from that call on (it was cut off
    there), and the whole answer gives the same text."""
    scripted("Hello <tool_call>{not json}</tool_call> bye")
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS).choices[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, stream=True))
    assert (
        whole.message.content == "Hello <tool_call>{not json}</tool_call> bye"
        and not whole.message.tool_calls
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"
    assert "served as text" in caplog.text


def test_a_template_the_parser_refuses_serves_replies_as_text_whole_and_streamed(client, served, monkeypatch):
    _, _, tokenizer = served
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    monkeypatch.setattr(tokenizer, "response_template", None, raising=False)
    plain = client.chat.completions.create(**ask).choices[0].message.content
    monkeypatch.setattr(
        tokenizer, "response_template", {"fields": {"content": {"content": "text"}}}, raising=False
    )
    assert client.chat.completions.create(**ask).choices[0].message.content == plain
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain


def test_the_engines_own_reply_is_split_where_the_template_says(client, served, monkeypatch):
    """The real engine: the tiny model's greedy reply (its tokens' raw text, special tokens kept, as the
    reader sees it), with a template whose reasoning opens and closes at two-character literals taken
    from that text; reasoning and content come apart there, whole and streamed."""
    _, _, tokenizer = served
    ask = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"min_tokens": 40},
    }
    items = client.chat.completions.create(**ask, logprobs=True).choices[0].logprobs.content
    raw = "".join(item.token for item in items)
    opening = raw[:2]
    j = next(
        j
        for j in range(4, len(raw) - 2)
        if raw[j : j + 2] not in raw[: j + 1] and opening not in raw[j + 2 :] and raw[j + 2 :].strip()
    )
    template = {
        "start_anchor": "<a>",
        "fields": {
            "reasoning_content": {"open": opening, "close": raw[j : j + 2], "content": "text"},
            "content": {"close_pattern": r"</s>", "content": "text"},
        },
    }
    monkeypatch.setattr(tokenizer, "response_template", template, raising=False)
    message = client.chat.completions.create(**ask).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (raw[2:j], raw[j + 2 :].strip())
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == raw[2:j]
    assert "".join(d.content or "" for d in deltas) == raw[j + 2 :]
