"""OpenAI's request rules at the edges (found by a probe, 2026-11-27): strict types, options that would be
silently ignored, batched prompts, negative seeds, the error of a body that is not JSON, and the routes
clients call besides completions."""

from __future__ import annotations

import json
import os

import pytest

from tests.server.conftest import CHAT, MODEL, post, send

pytest.importorskip("fastapi")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),  # pydantic's lax mode read these as 5 and 1
        ({"max_tokens": True}, "max_tokens"),
        ({"stream_options": {"include_usage": True}}, None),  # OpenAI: only with stream: true
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"tools": [{"type": "bogus"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        # the tiny chat template never renders tools: the request would silently ignore them
        ({"tools": [{"type": "function", "function": {"name": "lookup"}}]}, "tools"),
        ({"max_tokens": 3, "min_tokens": 5}, "min_tokens"),  # vLLM refuses it; it was cut to 3
        ({"min_tokens": 100_000}, "min_tokens"),  # above what the context leaves: cut silently too
    ],
)
def test_a_request_that_would_be_misread_or_ignored_is_refused(served, body, param):
    code, _, answer = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **body})
    assert code == 400, answer
    assert answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param, answer


def test_a_body_that_is_not_json_names_no_field(served):
    code, _, data = send(served[0], "POST", "/v1/chat/completions", b"{not json")
    answer = json.loads(data)
    assert code == 400 and answer["error"]["param"] is None
    assert "not valid JSON" in answer["error"]["message"]


def test_a_negative_seed_is_served_and_reproduces(client):
    ask = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=-5)
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert first and client.chat.completions.create(**ask).choices[0].message.content == first


def test_a_list_of_one_prompt_is_that_prompt(served, client):
    ask = dict(model=MODEL, max_tokens=6, temperature=0)
    text = client.completions.create(prompt="Hello", **ask).choices[0].text
    assert client.completions.create(prompt=["Hello"], **ask).choices[0].text == text
    ids = served[2]("Hello")["input_ids"]
    assert client.completions.create(prompt=[ids], **ask).choices[0].text == text


def test_a_batch_of_prompts_gives_each_its_n_choices_in_turn(served, client):
    """OpenAI's batch: choice i * n + j is prompt i's j-th, each as that prompt alone would give it; the
    usage counts each prompt once; echo and prompt logprobs are each choice's own prompt's."""
    tokenizer = served[2]
    prompts = ["Hello", "Good day to you"]
    ask = dict(model=MODEL, max_tokens=6, temperature=0)
    alone = [client.completions.create(prompt=p, **ask).choices[0].text for p in prompts]
    answer = client.completions.create(prompt=prompts, n=2, **ask)
    assert [(c.index, c.text) for c in answer.choices] == [
        (0, alone[0]),
        (1, alone[0]),
        (2, alone[1]),
        (3, alone[1]),
    ]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert answer.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert [c.text for c in client.completions.create(prompt=ids, **ask).choices] == alone
    echoed = client.completions.create(prompt=prompts, echo=True, logprobs=1, **ask).choices
    for choice, prompt, own, text in zip(echoed, prompts, ids, alone):
        assert choice.text == prompt + text
        assert choice.logprobs.tokens[: len(own)] == [tokenizer.decode([t]) for t in own]
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(own) + 6
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [alone[0], alone[0], alone[1], alone[1]]


def test_a_batch_that_could_never_be_admitted_is_a_400_naming_prompt(served):
    body = {"model": MODEL, "prompt": ["a"] * 41, "n": 2, "max_tokens": 2}  # 82 choices, 80 in flight at most
    code, _, answer = post(served[0], "/v1/completions", body)
    assert code == 400 and answer["error"]["param"] == "prompt", answer
    code, _, answer = post(served[0], "/v1/completions", {**body, "prompt": ["a", ""]})
    assert code == 400 and answer["error"]["param"] == "prompt[1]", answer
    code, _, answer = post(served[0], "/v1/completions", {**body, "n": 1, "prompt": ["a", "b" * 300, "c"]})
    assert code == 413 and answer["error"]["param"] == "prompt[1]", answer


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert chunks and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5


def test_health_answers_head_and_a_model_is_retrieved_by_its_id(served, client):
    assert send(served[0], "HEAD", "/health")[0] == 200
    assert client.models.retrieve(MODEL).id == MODEL
    code, _, data = send(served[0], "GET", "/v1/models/other-model")
    assert code == 404 and json.loads(data)["error"]["param"] == "model"


def test_logprob_bytes_and_offsets_follow_characters_split_over_tokens(smollm2):
    """SmolLM2 splits '🎉' over three tokens, each decoding alone to U+FFFD: their ``bytes`` join to the
    text's UTF-8, and ``text_offset`` counts the text's characters (a token inside a character starts
    at that character), also when a stream sends the tokens over several chunks."""
    from hfaccel.server.logprob_items import legacy_logprobs, token_item

    _, tokenizer = smollm2
    text = "The emoji 🎉 means joy"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    items = [{**token_item(tokenizer, i, -1.0), "top_logprobs": []} for i in ids]
    assert b"".join(bytes(item["bytes"]) for item in items) == text.encode()
    expected = [len(os.path.commonprefix([tokenizer.decode(ids[:j]), text])) for j in range(len(ids))]
    assert legacy_logprobs(items)["text_offset"] == expected
    assert expected[-2:] == [text.index(" means"), text.index(" joy")]
    for cut in range(1, len(items)):  # streamed: the chunks' offsets count from the choice's start
        before = b"".join(bytes(item["bytes"]) for item in items[:cut])
        assert legacy_logprobs(items[cut:], before)["text_offset"] == expected[cut:]


def test_an_invalid_byte_mid_text_counts_as_one_character(smollm2):
    """A stray continuation byte decodes to one U+FFFD in the text, as the tokenizer decodes it; the
    offsets after it count it once (they dropped it before)."""
    from hfaccel.server.logprob_items import legacy_logprobs, token_item

    _, tokenizer = smollm2
    ids = tokenizer.convert_tokens_to_ids(["a", "İ", "b", "b"])  # 'İ' is byte 0x8E alone
    items = [{**token_item(tokenizer, i, -1.0), "top_logprobs": []} for i in ids]
    assert tokenizer.decode(ids) == "a\ufffdbb"
    assert legacy_logprobs(items)["text_offset"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [""]}, "prompt[0]"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "stream": True, "stream_options": {"include_usage": 1}},
            None,
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None),
        ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ],
)
def test_nested_fields_and_empty_prompts_are_refused_by_their_own_names(served, path, body, param):
    code, _, answer = post(served[0], path, {"model": MODEL, **body})
    assert code == 400, answer
    if param is not None:
        assert answer["error"]["param"] == param, answer


def test_chat_template_kwargs_reach_the_template(served, monkeypatch):
    """vLLM's and transformers serve's extra (Qwen 3's `enable_thinking`); the request's own arguments
    cannot be overridden through it."""
    tokenizer = served[2]
    template = "{% if greeting is defined %}{{ greeting }}{% endif %}" + tokenizer.chat_template
    monkeypatch.setattr(tokenizer, "chat_template", template)
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    plain = post(served[0], "/v1/chat/completions", ask)[2]["usage"]["prompt_tokens"]
    code, _, answer = post(
        served[0], "/v1/chat/completions", {**ask, "chat_template_kwargs": {"greeting": "Hey"}}
    )
    assert code == 200 and answer["usage"]["prompt_tokens"] == plain + 3  # a character a token
    code, _, answer = post(
        served[0], "/v1/chat/completions", {**ask, "chat_template_kwargs": {"tokenize": True}}
    )
    assert code == 400 and answer["error"]["param"] == "chat_template_kwargs.tokenize", answer


def test_tool_choice_none_does_not_show_the_tools_to_the_model(served, monkeypatch):
    tokenizer = served[2]
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    plain = post(served[0], "/v1/chat/completions", ask)[2]["usage"]["prompt_tokens"]
    # The tiny template never shows tools: refused with "auto", served with "none" (nothing to hide).
    assert post(served[0], "/v1/chat/completions", {**ask, "tools": tools})[0] == 400
    code, _, answer = post(served[0], "/v1/chat/completions", {**ask, "tools": tools, "tool_choice": "none"})
    assert code == 200 and answer["usage"]["prompt_tokens"] == plain
    shown = "{% if tools %}<t>{{ tools | tojson }}{% endif %}" + tokenizer.chat_template
    monkeypatch.setattr(tokenizer, "chat_template", shown)
    code, _, answer = post(served[0], "/v1/chat/completions", {**ask, "tools": tools})
    assert code == 200 and answer["usage"]["prompt_tokens"] > plain
    code, _, answer = post(served[0], "/v1/chat/completions", {**ask, "tools": tools, "tool_choice": "none"})
    assert code == 200 and answer["usage"]["prompt_tokens"] == plain


def test_a_tool_calling_conversation_goes_back_to_the_template_as_templates_read_it(served, monkeypatch):
    """An assistant's tool calls come back with OpenAI's arguments as JSON text: the template iterates
    them as a mapping (as transformers serve passes them); its reasoning_content is accepted too."""
    tokenizer = served[2]
    template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }}:"
        "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}]{% endfor %}"
        "{% if m.get('reasoning_content') %}({{ m['reasoning_content'] }}){% endif %}{% endfor %}<a>"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "add them"},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
    ]
    code, _, answer = post(served[0], "/tokenize", {"model": MODEL, "messages": messages})
    assert code == 200, answer
    assert tokenizer.decode(answer["tokens"]) == "<u>2+3?<a>[add:a=2;b=3;](add them)<t>5<a>"
    # A template that never shows an assistant's tool calls would drop them silently: a 400 naming them.
    monkeypatch.setattr(
        tokenizer,
        "chat_template",
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}<a>",
    )
    code, _, answer = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert code == 400 and answer["error"]["param"] == "messages[1].tool_calls", answer
    assert "does not show an assistant message's tool calls" in answer["error"]["message"]
    monkeypatch.setattr(tokenizer, "chat_template", template)
    bad = {**call, "function": {"name": "add", "arguments": "{not json"}}
    messages[1]["tool_calls"] = [bad]
    code, _, answer = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert code == 400 and answer["error"]["param"] == "messages[1].tool_calls[0].function.arguments", answer


@pytest.mark.parametrize("seed", [1234, -1, 2**63 - 1])  # choice 1 of -1 passes the engine's range's end
def test_each_prompt_of_a_seeded_batch_samples_as_it_does_alone(client, seed):
    ask = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=seed, n=2)
    prompts = ["Hello", "World wide"]
    alone = [[c.text for c in client.completions.create(prompt=p, **ask).choices] for p in prompts]
    batch = [c.text for c in client.completions.create(prompt=prompts, **ask).choices]
    assert batch == alone[0] + alone[1]


@pytest.mark.parametrize(
    ("template", "extra", "param"),
    [
        (None, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        (None, {"chat_template_kwargs": {"conversations": []}}, "chat_template_kwargs.conversations"),
        ("{{ raise_exception('roles must alternate') }}", {}, "messages"),
    ],
)
def test_a_template_that_refuses_the_request_is_a_400(served, monkeypatch, template, extra, param):
    if template is not None:
        monkeypatch.setattr(served[2], "chat_template", template)
    code, _, answer = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **extra})
    assert code == 400 and answer["error"]["param"] == param, answer


def test_tool_call_arguments_must_be_a_json_object(served):
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}}
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}]
    code, _, answer = post(served[0], "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert code == 400 and answer["error"]["param"] == "messages[1].tool_calls[0].function.arguments", answer


def test_an_answer_sent_back_as_the_openai_client_gives_it_is_taken(served, client):
    """The client's message sets refusal, annotations, audio and function_call to null (its stream
    helper's also parsed): the usual agent loop sends it back as it is."""
    message = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4).choices[0].message
    sent_back = {**message.model_dump(), "parsed": None}
    assert {"refusal", "annotations", "audio", "function_call"} <= set(sent_back)
    messages = [*CHAT, sent_back, {"role": "user", "content": "And?"}]
    code, _, answer = post(
        served[0], "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}
    )
    assert code == 200, answer


@pytest.mark.parametrize(
    ("top_k", "temperature", "expected"), [(-1, 0.7, 0), (0, 0.7, 0), (5, 0.7, 5), (None, 1e-45, None)]
)
def test_sampling_fields_as_generate_arguments(top_k, temperature, expected):
    """vLLM's top_k of -1 or 0 is no top-k: transformers' 0, not left out (the model's generation config,
    Qwen3's top_k=20, would then apply); a temperature too small to divide by is greedy."""
    from hfaccel.server.protocol import ChatCompletionRequest
    from hfaccel.server.sampling import Limits, generate_kwargs

    request = ChatCompletionRequest(model=MODEL, messages=CHAT, top_k=top_k, temperature=temperature)
    kwargs = generate_kwargs(request, 4, 10, 512, Limits(), 256)
    assert kwargs.get("top_k") == expected
    assert kwargs["do_sample"] is (temperature >= 1e-5)


def test_a_messages_text_parts_are_joined_by_a_space_as_transformers_serve_joins_them(served):
    """Parts glued together merged the words at their edges ("morning" + "Hello")."""

    def ask(content):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            "temperature": 0,
        }
        code, _, answer = post(served[0], "/v1/chat/completions", body)
        assert code == 200, answer
        return answer["usage"]["prompt_tokens"], answer["choices"][0]["message"]["content"]

    parts = [{"type": "text", "text": "Good morning"}, {"type": "text", "text": "Hello"}]
    assert ask(parts) == ask("Good morning Hello") != ask("Good morningHello")
