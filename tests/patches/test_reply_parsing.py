"""A reply read into content, reasoning and tool calls with transformers' parser, as transformers serve
reads it: the template chosen, the whole reply and the streamed one agreeing, and a reply the template
cannot read served as text with a warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from hfaccel.patches.reply_parsing import ReplyStream, ToolCall, parse_reply, response_template
from tests.helpers import tiny_tokenizer

PROMPT = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
REPLY = (
    "<think>\nParis, so a lookup.\n</think>\n\nLet me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "days": 1}}\n</tool_call><|im_end|>'
)
CALLS = [
    ToolCall("get_weather", '{"city": "Paris", "days": 3}'),  # "3" typed by the tool's schema
    ToolCall("get_weather", '{"city": "Lyon", "days": 1}'),
]


def qwen(tokenizer=None):
    return SimpleNamespace(config=SimpleNamespace(model_type="qwen3")), tokenizer or tiny_tokenizer()


def test_the_template_is_the_tokenizers_own_else_transformers_serves_fallback_for_the_model_type():
    model, tokenizer = qwen()
    fallback = response_template(tokenizer, model)
    assert fallback is not None and "tool_calls" in fallback["fields"]  # transformers serve's Qwen template
    assert response_template(tokenizer, SimpleNamespace(config=SimpleNamespace(model_type="llama"))) is None
    own = {"fields": {"content": {"content": "text"}}}
    tokenizer.response_template = own
    assert response_template(tokenizer, model) is own


def test_a_whole_reply_gives_content_reasoning_and_typed_tool_calls():
    model, tokenizer = qwen()
    reply = parse_reply(tokenizer, response_template(tokenizer, model), PROMPT, REPLY, "plain", TOOLS)
    assert reply.content == "Let me look."
    assert reply.reasoning.strip() == "Paris, so a lookup."
    assert reply.tool_calls == CALLS


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_a_streamed_reply_gives_the_same_calls_and_reasoning_whatever_the_pieces(piece):
    model, tokenizer = qwen()
    stream = ReplyStream(response_template(tokenizer, model), PROMPT, TOOLS)
    parts = []
    for start in range(0, len(REPLY), piece):
        parts += stream.feed(REPLY[start : start + piece])
    parts += stream.finish()
    assert [p.tool_call for p in parts if p.tool_call] == CALLS
    assert "".join(p.reasoning for p in parts).strip() == "Paris, so a lookup."
    assert "".join(p.content for p in parts).strip() == "Let me look."


def test_plain_text_stays_content():
    model, tokenizer = qwen()
    reply = parse_reply(
        tokenizer, response_template(tokenizer, model), PROMPT, "Sunny.<|im_end|>", "x", TOOLS
    )
    assert (reply.content, reply.reasoning, reply.tool_calls) == ("Sunny.", None, [])


def test_a_tool_call_cut_by_the_token_limit_is_served_as_plain_text_with_a_warning(caplog):
    model, tokenizer = qwen()
    template = response_template(tokenizer, model)
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        reply = parse_reply(tokenizer, template, PROMPT, cut, "the plain text", TOOLS)
    assert (reply.content, reply.tool_calls) == ("the plain text", [])
    assert "could not be read" in caplog.text
    stream = ReplyStream(template, PROMPT, TOOLS)
    assert stream.feed(cut) == []
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        assert stream.finish() == []
    assert "ended inside a field" in caplog.text
