"""Structured output (`server/structured.py`): OpenAI's ``response_format`` and the Responses API's
``text.format`` through xgrammar, on the tiny served model, whose unconstrained replies are no JSON."""

import json

import pytest
import torch

from tests.server.conftest import CHAT, MODEL, post

pytest.importorskip("fastapi")
xgrammar = pytest.importorskip("xgrammar")

# A schema the tiny model can only complete: a choice of two strings; whitespace is capped per gap.
CHOICE = {
    "type": "object",
    "properties": {"c": {"enum": ["yes", "no"]}},
    "required": ["c"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "choice", "schema": CHOICE, "strict": True}}


def test_a_schema_is_followed_to_a_complete_answer_whole_and_streamed(client):
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "temperature": 0}
    plain = client.chat.completions.create(**ask).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(plain)  # the tiny model's own reply is no JSON: the grammar makes the difference
    whole = client.chat.completions.create(**ask, response_format=FORMAT).choices[0]
    assert whole.finish_reason == "stop" and json.loads(whole.message.content) in ({"c": "yes"}, {"c": "no"})
    chunks = client.chat.completions.create(**ask, response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content


def test_sampled_choices_each_follow_the_schema(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=200, temperature=1.0, seed=3, n=3, response_format=FORMAT
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop" and json.loads(choice.message.content)["c"] in ("yes", "no")


def test_json_object_mode_opens_an_object(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=30, temperature=0, response_format={"type": "json_object"}
    ).choices[0]
    assert answer.message.content.startswith("{")  # cut by max_tokens or complete, an object either way
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)


def test_the_responses_api_follows_text_format_and_repeats_it(client):
    text = {"format": {"type": "json_schema", "name": "choice", "schema": CHOICE, "strict": True}}
    answer = client.responses.create(model=MODEL, input="yes or no?", max_output_tokens=200, text=text)
    assert answer.status == "completed" and json.loads(answer.output_text)["c"] in ("yes", "no")
    assert answer.text.format.type == "json_schema" and answer.text.format.name == "choice"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "ignore_eos": True},
            "ignore_eos",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#"}},
                }
            },
            "response_format.json_schema.schema",
        ),  # no value satisfies it
        ("/v1/responses", {"text": {"format": {"type": "json_object", "name": "x"}}}, "text.format.name"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "a b"}}}, "text.format.name"),
        (
            "/v1/responses",
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format.schema",
        ),
    ],
)
def test_each_mistake_is_a_400_naming_its_field(served, path, body, param):
    base = (
        {"model": MODEL, "messages": CHAT, "max_tokens": 4}
        if "chat" in path
        else {"model": MODEL, "input": "hi"}
    )
    status, _, answer = post(served[0], path, {**base, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert "[" not in answer["error"]["message"][:2]  # xgrammar's C++ log prefix is not shown


def test_rows_with_the_same_tokens_get_the_same_mask_and_the_matchers_stay_bounded(served):
    from hfaccel.server.protocol import ResponseFormat
    from hfaccel.server.structured import GrammarProcessor, compile_format

    _, model, tokenizer = served
    vocab = model.get_output_embeddings().weight.shape[0]
    grammar = compile_format(
        ResponseFormat.model_validate(FORMAT), tokenizer, vocab, [tokenizer.eos_token_id]
    )
    prompt = [5, 6, 7]
    processor = GrammarProcessor(grammar, [prompt])
    brace = tokenizer.convert_tokens_to_ids("{")
    rows = torch.tensor([prompt + [brace], prompt + [brace]])
    first = processor(rows[:1], torch.zeros(1, vocab))
    opening = processor(torch.tensor([prompt]), torch.zeros(1, vocab))[0]
    assert torch.isfinite(opening[brace]) and torch.isinf(opening[tokenizer.convert_tokens_to_ids("a")])
    both = processor(rows, torch.zeros(2, vocab))  # the second row finds the first one's
    assert torch.equal(both[0], first[0]) and torch.equal(both[1], first[0])
    allowed = torch.isfinite(first[0]).nonzero().flatten().tolist()
    assert tokenizer.convert_tokens_to_ids('"') in allowed and brace not in allowed
    # Tokens that leave the grammar (a draft speculation verifies): unmasked, for verification to discard.
    assert torch.isfinite(processor(torch.tensor([prompt + [brace, brace]]), torch.zeros(1, vocab))).all()
    # Both in one call, in the scores' own dtype; the scores given are left as they were.
    quote = tokenizer.convert_tokens_to_ids('"')
    alone = processor(torch.tensor([prompt + [brace, quote]]), torch.zeros(1, vocab))[0]
    scores = torch.zeros(2, vocab, dtype=torch.bfloat16)
    mixed = processor(torch.tensor([prompt + [brace, quote], prompt + [brace, brace]]), scores)
    assert mixed.dtype == torch.bfloat16 and torch.equal(torch.isfinite(mixed[0]), torch.isfinite(alone))
    assert not torch.isfinite(alone).all()
    assert torch.isfinite(mixed[1]).all() and not scores.any()
    for step in range(3 * processor.MAX_MATCHERS):  # drafts never extended: the kept matchers stay bounded
        processor(
            torch.tensor([prompt + [brace, tokenizer.convert_tokens_to_ids(" ")] * (1 + step % 2)]), first
        )
    assert len(processor._matchers) <= processor.MAX_MATCHERS


def test_a_schema_is_followed_with_speculative_drafts(served):
    """Prompt lookup proposes drafts copied from a prompt full of non-JSON text; the drafts that break
    the grammar are masked out and rejected, never an error."""
    import hfaccel
    from hfaccel.server import Limits

    openai = pytest.importorskip("openai")
    _, model, tokenizer = served
    limits = Limits(max_tokens=512, max_n=4, max_prompt_tokens=400, max_pending=8)
    server = hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, limits=limits, kv_cache_memory=8_000_000,
        speculative="ngram", num_speculative_tokens=4,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        text = 'Say {"c": "yes"} or {"c": "no"}. abc abc abc {"c": "yes"} {{{{ ]]]] {"c": "no"}'
        for temperature in (0, 1.0):
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=200,
                temperature=temperature, seed=1, response_format=FORMAT,
            ).choices[0]  # fmt: skip
            assert answer.finish_reason == "stop" and json.loads(answer.message.content)["c"] in ("yes", "no")
    finally:
        server.stop()


def test_a_model_without_eos_in_its_config_ends_a_structured_answer_at_the_tokenizers(
    client, served, monkeypatch
):
    """The completed grammar leaves only EOS open; a model whose generation config declares none would
    decode past it (xgrammar raised on the terminated matcher: a 500)."""
    monkeypatch.setattr(served[1].generation_config, "eos_token_id", None)
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=200, temperature=0, response_format=FORMAT
    ).choices[0]
    assert answer.finish_reason == "stop" and json.loads(answer.message.content)["c"] in ("yes", "no")


def test_a_slow_schema_compile_does_not_stall_the_other_requests(served, monkeypatch):
    """xgrammar's compile runs in a worker thread: while one request's schema compiles, the server
    answers another; the compiled request is then answered in its schema."""
    import threading

    from hfaccel.server import structured

    compiling, release, threads = threading.Event(), threading.Event(), []
    real = structured.compile_format

    def slow(*args, **kwargs):
        threads.append(threading.current_thread())
        compiling.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(structured, "compile_format", slow)
    monkeypatch.setattr("hfaccel.server.sampling.compile_format", slow)
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 200, "temperature": 0}
    answers = {}
    first = threading.Thread(
        target=lambda: answers.update(
            slow=post(served[0], "/v1/chat/completions", {**ask, "response_format": FORMAT})
        )
    )
    first.start()
    try:
        assert compiling.wait(30)
        status, _, other = post(served[0], "/v1/chat/completions", {**ask, "max_tokens": 4})
        assert status == 200 and other["choices"][0]["finish_reason"] == "length"
    finally:
        release.set()
        first.join(60)
    status, _, answer = answers["slow"]
    assert status == 200 and json.loads(answer["choices"][0]["message"]["content"])["c"] in ("yes", "no")
    assert threads and threads[0] is not threading.main_thread() and threads[0].name.startswith("asyncio")


def test_a_schema_with_a_dead_end_past_its_start_is_a_400_not_free_text(client, served):
    """``{"a": <a recursive $ref>}`` opens (``{``) but no token can follow ``{"a":``: the answer fails
    with the reason, never goes on unconstrained."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    body = {
        "model": MODEL, "messages": CHAT, "max_tokens": 200, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }  # fmt: skip
    status, _, answer = post(served[0], "/v1/chat/completions", body)
    assert status == 400 and "no token can continue" in answer["error"]["message"], answer


# Each validation keyword with an instance that breaks it, by what xgrammar (0.2) does with it: a
# REFUSED schema's grammar accepts its instance (so the server refuses the schema), a SERVED one's refuses
# it. If a later xgrammar changes either, its row here fails: move it.
INTEGER = {"type": "integer"}
TWO = {"type": "object", "properties": {"a": INTEGER, "b": INTEGER}}
REFUSED = [
    ({"type": "integer", "not": {"const": 3}}, "3", "uses not"),
    ({"type": "array", "items": INTEGER, "uniqueItems": True}, "[1, 1]", "uses uniqueItems"),
    ({"type": "array", "items": INTEGER, "contains": {"const": 5}}, "[1, 2]", "uses contains"),
    (
        {"type": "array", "items": INTEGER, "contains": {"const": 5}, "maxContains": 1},
        "[5, 5]",
        "uses contains, maxContains",
    ),
    ({**TWO, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "uses dependentRequired"),
    ({**TWO, "dependencies": {"a": ["b"]}}, '{"a": 1}', "uses dependencies"),
    ({**TWO, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}', "uses dependentSchemas"),
    ({**TWO, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}', "uses if/then/else"),
    (
        {"allOf": [{**TWO, "required": ["a"]}, {**TWO, "required": ["b"]}]},
        '{"a": 1}',
        "allOf of more than one schema",
    ),
    ({"type": "object", "required": ["zz"]}, "{}", "requires 'zz'"),
    (  # deep inside: the path says where
        {"type": "object", "properties": {"tags": {"type": "array", "items": {}, "uniqueItems": True}}},
        '{"tags":[1,1]}',
        r"schema.properties.tags uses uniqueItems",
    ),
]
# Not strict: xgrammar's strict mode enforces this one.
LOOSE_ONLY = (
    {"type": "object", "properties": {"a": INTEGER}, "unevaluatedProperties": False},
    '{"a": 1, "z": 2}',
)
SERVED = [
    ({"type": "integer", "multipleOf": 7}, "8"),
    ({"type": "integer", "exclusiveMaximum": 3}, "3"),
    ({"type": "string", "pattern": "^a+$"}, '"b"'),
    ({"type": "string", "format": "date"}, '"x"'),
    ({"type": "array", "items": INTEGER, "minItems": 2}, "[1]"),
    ({"type": "array", "prefixItems": [INTEGER], "unevaluatedItems": False}, "[1, 2]"),
    ({"type": "object", "additionalProperties": INTEGER, "maxProperties": 1}, '{"a": 1, "b": 2}'),
    ({"type": "object", "additionalProperties": INTEGER, "propertyNames": {"pattern": "^a"}}, '{"b": 1}'),
    ({**TWO, "required": ["a"]}, "{}"),
    ({"oneOf": [{"type": "string"}, INTEGER]}, "true"),
    ({"allOf": [{**TWO, "required": ["a"]}]}, "{}"),
    # names that are keywords only as property names
    ({"type": "object", "properties": {"not": INTEGER, "allOf": INTEGER}, "required": ["not"]}, "{}"),
]


def _tiny_compiler():
    from tests.helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )
    return xgrammar.GrammarCompiler(info)


def _accepts(compiler, schema, instance, strict):
    grammar = compiler.compile_json_schema(schema, strict_mode=strict)
    matcher = xgrammar.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return matcher.accept_string(instance) and matcher.is_terminated()


@pytest.mark.parametrize(("schema", "instance", "message"), REFUSED, ids=[u[2] for u in REFUSED])
def test_a_schema_the_grammar_would_not_enforce_is_refused(schema, instance, message):
    from hfaccel.server.schema_checks import check_schema

    assert _accepts(_tiny_compiler(), schema, instance, strict=True), "xgrammar enforces it now"
    for strict in (True, False):
        with pytest.raises(ValueError, match=message):
            check_schema(schema, strict)


def test_unevaluated_properties_are_refused_only_without_strict():
    from hfaccel.server.schema_checks import check_schema

    schema, instance = LOOSE_ONLY
    compiler = _tiny_compiler()
    assert _accepts(compiler, schema, instance, strict=False) and not _accepts(
        compiler, schema, instance, True
    )
    with pytest.raises(ValueError, match=r"unevaluatedProperties \(without strict\)"):
        check_schema(schema, strict=False)
    check_schema(schema, strict=True)


@pytest.mark.parametrize(("schema", "instance"), SERVED)
def test_keywords_the_grammar_enforces_are_served(schema, instance):
    from hfaccel.server.schema_checks import check_schema

    compiler = _tiny_compiler()
    for strict in (True, False):
        assert not _accepts(compiler, schema, instance, strict), "xgrammar does not enforce it"
        check_schema(schema, strict)


def test_schemas_over_openais_limits_are_refused_before_they_compile(served):
    big_enum = {"enum": [f"value {i}" for i in range(1001)]}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5001)}}
    long_const = {"anyOf": [{"const": "x" * 60_001}, {"const": "y" * 60_000}]}

    for schema, message in [
        (big_enum, "1,001 enum values, over OpenAI's structured-output limit of 1,000"),
        (wide, "5,001 properties"),
        (long_const, "120,001 characters"),
        (True, "must be a JSON object"),
    ]:
        body = {
            "model": MODEL, "messages": CHAT, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }  # fmt: skip
        status, _, answer = post(served[0], "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["param"] == "response_format.json_schema.schema", answer
        assert message in answer["error"]["message"]


@pytest.mark.parametrize("depth", [65, 5000])
def test_a_schema_nested_too_deeply_is_a_400_at_once(served, depth):
    """xgrammar's compile grows steeply with depth (34 s at 900 levels): over 64 is refused before it."""
    from tests.server.conftest import send

    schema = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    format_ = f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}}}}}'
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "response_format": {format_}}}'
    status, _, answer = send(served[0], "POST", "/v1/chat/completions", body.encode())
    assert status == 400, (status, answer[:300])
    # (5,000 levels are past what the JSON parser takes: "an error parsing the body")
    assert b"over 64 levels deep" in answer if depth == 65 else b"parsing the body" in answer, answer[:300]


def test_a_schema_that_takes_only_the_empty_answer_is_a_400(served):
    body = {
        "model": MODEL, "messages": CHAT, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": []}}},
    }  # fmt: skip
    status, _, answer = post(served[0], "/v1/chat/completions", body)
    assert status == 400 and "no JSON value satisfies it" in answer["error"]["message"], answer
