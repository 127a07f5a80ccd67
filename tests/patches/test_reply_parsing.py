"""A reply read into content, reasoning and tool calls with transformers' parser, as transformers serve
reads it: the template chosen, the whole reply and the streamed one agreeing (also where the reply stops
being readable), and a reply the template cannot read served as text from the field that failed on, with
a warning, nothing of it lost."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from hfaccel.patches.reply_parsing import (
    REASONING_FIELDS,
    ReplyStream,
    ToolCall,
    parse_reply,
    response_template,
)
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
    reply = parse_reply(response_template(tokenizer, model), PROMPT, [REPLY], TOOLS)
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
    reply = parse_reply(response_template(tokenizer, model), PROMPT, ["Sunny.", "<|im_end|>"], TOOLS)
    assert (reply.content, reply.reasoning, reply.tool_calls) == ("Sunny.", None, [])


SPECIAL = ("<|im_end|>",)


def streamed(template, text, piece=1, tools=TOOLS):
    stream = ReplyStream(template, PROMPT, tools, SPECIAL)
    parts = []
    for start in range(0, len(text), piece):
        parts += stream.feed(text[start : start + piece])
    return parts + stream.finish()


@pytest.mark.parametrize(
    ("text", "content"),
    [
        # a tool call cut by the token limit
        (
            'Let me see. <tool_call>\n{"name": "get_weather", "argu',
            'Let me see. <tool_call>\n{"name": "get_weather", "argu',
        ),
        # JSON that does not parse, closed, and text after it
        (
            "Hello <tool_call>{not json}</tool_call> bye<|im_end|>",
            "Hello <tool_call>{not json}</tool_call> bye",
        ),
        # a call without a function name: its JSON as text
        (
            'Hi<tool_call>{"arguments": {}}</tool_call><|im_end|>',
            'Hi<tool_call>{"arguments": {}}</tool_call>',
        ),
        # arguments that are not a JSON object (a client sending the call back would be refused)
        (
            'Hi<tool_call>{"name": "get_weather", "arguments": ["Paris"]}</tool_call><|im_end|>',
            'Hi<tool_call>{"name": "get_weather", "arguments": ["Paris"]}</tool_call>',
        ),
        (
            'Hi<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call><|im_end|>',
            'Hi<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
        ),
    ],
)
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_a_reply_that_stops_being_readable_is_text_from_the_failed_field_on_whole_and_streamed(
    caplog, text, content, piece
):
    model, tokenizer = qwen()
    template = response_template(tokenizer, model)
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        parts = streamed(template, text, piece)
        reply = parse_reply(template, PROMPT, list(text), TOOLS, SPECIAL)
    assert "".join(p.content for p in parts) == content and not any(p.tool_call for p in parts)
    assert (reply.content, reply.tool_calls) == (content.strip(), [])
    assert "served as text" in caplog.text


def test_a_field_that_opens_twice_keeps_both_whole_and_streamed():
    """transformers' parse_response keeps a field's last region; read as a stream, nothing is dropped."""
    model, tokenizer = qwen()
    template = response_template(tokenizer, model)
    text = 'Let me add.<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>Done.<|im_end|>'
    reply = parse_reply(template, PROMPT, list(text), TOOLS)
    assert reply.content == "Let me add.Done." and len(reply.tool_calls) == 1
    assert "".join(p.content for p in streamed(template, text, 3)) == reply.content


def test_a_tool_schema_the_parser_cannot_use_falls_back_to_text(caplog):
    model, tokenizer = qwen()
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"properties": {"city": {"anyOf": 5}}}},
        }
    ]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        reply = parse_reply(response_template(tokenizer, model), PROMPT, list(text), tools)
    assert reply.content == text.strip() and reply.tool_calls == []


def test_a_template_the_parser_refuses_raises_before_any_text():
    with pytest.raises(Exception, match="start_anchor"):
        ReplyStream({"fields": {"content": {"content": "text"}}}, PROMPT, None)


@pytest.mark.parametrize(
    ("pieces", "content", "reasoning"),
    [
        # no reasoning text: the fallback starts at the call's marker, not at the reply's start
        (["<think></think>", "<tool_call>{bad}</tool_call>"], "<tool_call>{bad}</tool_call>", ""),
        # reasoning text that is also inside a marker ("k" of "<think>")
        (["<think>", "k", "</think><tool_call>{bad}</tool_call>"], "<tool_call>{bad}</tool_call>", "k"),
        # the whole failing call in one piece after content: the content is not sent twice
        (["Hello world. <tool_call>{bad}</tool_call>"], "Hello world. <tool_call>{bad}</tool_call>", ""),
    ],
)
def test_the_fallback_starts_at_the_failed_fields_marker_however_the_text_comes(pieces, content, reasoning):
    model, tokenizer = qwen()
    stream = ReplyStream(response_template(tokenizer, model), PROMPT, TOOLS, SPECIAL)
    parts = [part for piece in pieces for part in stream.feed(piece)] + stream.finish()
    assert "".join(p.content for p in parts) == content
    assert "".join(p.reasoning for p in parts) == reasoning


def test_a_required_field_missing_at_the_end_sends_nothing_again():
    model, tokenizer = qwen()
    template = response_template(tokenizer, model)
    reasoning = next(f for f in template["fields"] if f in REASONING_FIELDS)  # "thinking" in 5.17
    fields = {**template["fields"], reasoning: {**template["fields"][reasoning], "optional": False}}
    parts = streamed({**template, "fields": fields}, "Hello world<|im_end|>", 3)
    assert "".join(p.content for p in parts) == "Hello world"


@pytest.mark.parametrize("piece", [1, 1000])
def test_a_markup_tool_call_cut_by_the_end_is_text_not_a_call_without_its_cut_parameter(caplog, piece):
    """Qwen 3.5's calls carry their parameters as markup: the parser, finalized inside one, keeps the
    parameters it has read, a call without the one cut (``{"city": "Paris"}``, its "days" gone); such a
    reply is text from the call's marker on. The whole call is read as one."""
    model = SimpleNamespace(config=SimpleNamespace(model_type="qwen3_5"))
    template = response_template(tiny_tokenizer(), model)
    call = (
        "Ok.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    cut = call[: call.index("3\n</parameter>")]
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        parts = streamed(template, cut, piece)
    assert not any(p.tool_call for p in parts) and "".join(p.content for p in parts) == cut.rstrip()
    whole = streamed(template, call + "<|im_end|>", piece)
    assert [p.tool_call for p in whole if p.tool_call] == [
        ToolCall("get_weather", '{"city": "Paris", "days": 3}')
    ]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_special_tokens_texts_stay_out_of_reasoning_and_content_however_the_text_comes(piece):
    """An end of turn inside an unclosed <think> (a reply cut there), or one after the content: the texts
    of special tokens are left out, as a plain decode leaves them out (transformers serve keeps them);
    the start of one's text at a piece's end waits for the next piece."""
    model, tokenizer = qwen()
    template = response_template(tokenizer, model)
    parts = streamed(template, "<think>Paris, then<|im_end|>", piece)
    assert "".join(p.reasoning for p in parts) == "Paris, then"
    assert "".join(p.content for p in parts) == ""
    parts = streamed(template, "<think>a</think>Sunny.<|im_end|> And <|im_end", piece)
    assert "".join(p.content for p in parts) == "Sunny. And <|im_end"  # a start that never came whole
    assert parse_reply(template, PROMPT, ["<think>x<|im_end|>"], TOOLS, SPECIAL).reasoning == "x"


@pytest.mark.parametrize("pieces", [["Ok.", "<tool_call>"], ["Ok.<tool_call>"], ["Ok. ", "<tool_call>"]])
def test_a_reply_cut_right_after_a_call_marker_keeps_the_marker(pieces, caplog):
    """The parser holds "<tool_call>" back until it knows the marker is whole, and opens the call only
    when finalized, where the empty call fails: the marker is served as text, not lost."""
    model, tokenizer = qwen()
    template = response_template(tokenizer, model)
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        stream = ReplyStream(template, PROMPT, TOOLS, SPECIAL)
        parts = [part for piece in pieces for part in stream.feed(piece)] + stream.finish()
    assert "".join(p.content for p in parts) == "".join(pieces)
    assert parse_reply(template, PROMPT, pieces, TOOLS, SPECIAL).content == "".join(pieces)


def test_arguments_written_as_json_text_of_an_object_are_a_call():
    model, tokenizer = qwen()
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call><|im_end|>'
    )
    reply = parse_reply(response_template(tokenizer, model), PROMPT, [text], TOOLS, SPECIAL)
    assert reply.tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("piece", [1, 1000])
def test_text_held_back_before_a_call_comes_before_it(piece):
    """ "<" could begin a special token's text, so it waits for the next text; a tool call next means it
    did not: it comes before the call, not after (a review)."""
    model, tokenizer = qwen()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parts = streamed(response_template(tokenizer, model), "Is a <" + call + "b?<|im_end|>", piece)
    at = next(i for i, p in enumerate(parts) if p.tool_call)
    assert "".join(p.content for p in parts[:at]) == "Is a <"
    assert "".join(p.content for p in parts[at + 1 :]) == "b?"
