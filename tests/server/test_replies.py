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


def test_a_reply_of_tool_calls_only_has_null_content(client, scripted):
    scripted('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    message = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS).choices[0].message
    assert message.content is None and message.tool_calls[0].function.name == "add"
    scripted("Just text.")
    message = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS).choices[0].message
    assert message.content == "Just text." and not message.tool_calls


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


def test_a_template_the_parser_refuses_serves_replies_as_text_whole_and_streamed(
    client, served, monkeypatch, caplog
):
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
    assert caplog.text.count("the response template cannot be read") == 2  # refused, not read as content


def read_both(client, **ask):
    """The whole answer's choice and the stream's joined (content, reasoning, calls, finish)."""
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **ask).choices[0]
    chunks = [
        c for c in client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **ask) if c.choices
    ]
    deltas = [c.choices[0].delta for c in chunks]
    streamed = (
        "".join(d.content or "" for d in deltas),
        "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) or None,
        [(c.function.name, c.function.arguments) for d in deltas for c in d.tool_calls or ()],
        chunks[-1].choices[0].finish_reason,
    )
    message = whole.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return (
        message.content,
        message.model_extra.get("reasoning_content"),
        calls,
        whole.finish_reason,
    ), streamed


@pytest.mark.parametrize(
    ("script", "content", "reasoning", "calls"),
    [
        # reasoning kept, the failed call and what follows it as text
        (
            "<think>sum it</think>On it.<tool_call>{bad json</tool_call>",
            "On it.<tool_call>{bad json</tool_call>",
            "sum it",
            0,
        ),
        # a good call kept before a bad one
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{bad</tool_call>',
            "<tool_call>{bad</tool_call>",
            None,
            1,
        ),
        # a thinking block left empty (Qwen 3 with thinking off): no reasoning, no whitespace
        ("<think>  </think>  Hi there", "Hi there", None, 0),
    ],
)
def test_whole_and_streamed_answers_agree_where_the_reply_stops_being_readable(
    client, scripted, script, content, reasoning, calls
):
    scripted(script)
    whole, streamed = read_both(client, tools=TOOLS)
    assert whole == streamed
    assert (whole[0], whole[1], len(whole[2])) == (content, reasoning, calls)
    assert whole[3] == ("tool_calls" if calls else "stop")


def test_a_reply_cut_by_the_length_after_a_call_says_length(client, scripted):
    scripted('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>More', finish="length")
    whole, streamed = read_both(client, tools=TOOLS)
    assert whole == streamed and whole[3] == "length" and len(whole[2]) == 1


def test_tool_calls_are_read_only_when_the_request_offers_tools(client, scripted):
    markup = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    scripted("<think>hm</think>" + markup)
    for ask in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        whole, streamed = read_both(client, **ask)
        assert whole == streamed == (markup, "hm", [], "stop")


def test_a_long_stop_string_holding_back_a_failing_call_sends_nothing_twice(client, scripted):
    scripted("Hello world, here is a longer answer text. <tool_call>{bad}</tool_call>")
    whole, streamed = read_both(client, tools=TOOLS, stop=["Q" * 40])
    assert whole == streamed
    assert whole[0] == "Hello world, here is a longer answer text. <tool_call>{bad}</tool_call>"


def test_a_stop_string_after_a_special_token_cuts_whole_and_streamed_alike(client, scripted):
    """The engine's stop check reads special tokens' texts (as transformers' StopStringCriteria does)."""
    scripted("Hi <s> a")
    whole, streamed = read_both(client, stop=[" a"])
    assert whole == streamed


def test_a_stop_string_beginning_inside_a_special_token_is_held_back_in_the_stream(client, scripted):
    """The cut leaves out a special token a stop string begins in; the stream never sent part of it."""
    scripted("Hi <s> a", eos=False)  # the engine stops where the stop string ends
    whole, streamed = read_both(client, stop=["> a"])
    assert whole == streamed == ("Hi", None, [], "stop")


def test_a_stop_string_never_cuts_into_a_special_tokens_text(client, scripted):
    """The stop string is found in the plain text (the engine's); the raw text is cut there, not at a
    match inside the EOS's "</s>"."""
    scripted("On it.")
    whole, streamed = read_both(client, stop=["s>"])
    assert whole == streamed == ("On it.", None, [], "stop")


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

    def plain(text):  # without the special tokens' texts (the tiny tokenizer's unknown token is "?")
        for special in tokenizer.all_special_tokens:
            text = text.replace(special, "")
        return text.strip()

    reasoning, content = plain(raw[2:j]), plain(raw[j + 2 :])
    message = client.chat.completions.create(**ask).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content


def test_a_completions_stop_string_is_cut_where_the_engine_found_it_whole_and_streamed(client, scripted):
    """Plain text (no template reading): "Hi a<s>b" reads "Hi ab" without its special token, but the
    engine's stop check (special tokens' texts kept) first sees "ab" at the end: the answer is cut there,
    whole and streamed, not at the earlier "ab" the plain text shows."""
    scripted("Hi a<s>b xab", eos=False)
    ask = {"model": MODEL, "prompt": "Hello", "max_tokens": 20, "stop": ["ab"]}
    whole = client.completions.create(**ask).choices[0]
    chunks = [c for c in client.completions.create(**ask, stream=True) if c.choices]
    streamed = "".join(c.choices[0].text for c in chunks)
    assert (whole.text, whole.finish_reason) == ("Hi ab x", "stop")
    assert (streamed, chunks[-1].choices[0].finish_reason) == ("Hi ab x", "stop")


def test_parallel_tool_calls_false_gives_the_first_call_only_whole_and_streamed(client, scripted):
    """vLLM's reading of OpenAI's ``parallel_tool_calls: false``: the model wrote two calls, the answer
    has the first (the second is dropped, not served as text)."""
    ask = {"tools": TOOLS, "parallel_tool_calls": False}
    whole, streamed = read_both(client, **ask)
    assert whole == streamed == ("On it.", "sum it", [("add", '{"a": 2, "b": 3}')], "tool_calls")
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **ask)
    assert [
        c.index for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()
    ] == [0]
    assert len(read_both(client, tools=TOOLS, parallel_tool_calls=True)[0][2]) == 2


@pytest.mark.parametrize(
    ("script", "stop", "text"),
    [
        ("Hi ab .", [" ."], "Hi ab"),  # the engine stopped at " ."; the cleaned text shows "."
        ("Done<s> .x", ["x"], "Done."),  # a special token beside a cleaned space: nothing garbled
        ("a . b . c", [" c"], "a. b."),
    ],
)
def test_a_tokenizer_that_cleans_up_spaces_gets_its_stop_cut_in_its_own_text(
    client, scripted, served, monkeypatch, script, stop, text
):
    """transformers cleans up " ." to "." in such a tokenizer's decode, while the engine's stop check reads
    the tokens' own strings (as HF's StopStringCriteria does): the answer is cut at the stop string as
    the text shows it."""
    tokenizer = served[2]
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)  # probed again, cleaning
    scripted(script, eos=False)
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, stop=stop).choices[0]
    assert (answer.text, answer.finish_reason) == (text, "stop")
