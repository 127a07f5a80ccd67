"""Errors a client sees (`server/protocol.py`, `server/app.py`): each names the field as the client wrote
it, in OpenAI's error JSON, whatever went wrong, and the server keeps serving on the same connection."""

import http.client
import json

import pytest

from tests.server.conftest import CHAT, MODEL, post, send

pytest.importorskip("fastapi")

USER = {"role": "user", "content": "hi"}
SURROGATE = '"a\\ud800b"'  # JSON's escape of a lone surrogate: valid JSON, no text

CASES = [
    # a lone surrogate anywhere a text goes: 400 naming it, never the tokenizer's 500
    (
        "/v1/chat/completions",
        f'{{"messages": [{{"role": "user", "content": {SURROGATE}}}]}}',
        "messages[0].content",
    ),
    ("/v1/chat/completions", f'{{"messages": [{json.dumps(USER)}], "stop": [{SURROGATE}]}}', "stop[0]"),
    ("/v1/completions", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ("/v1/responses", f'{{"input": {SURROGATE}}}', "input"),
    ("/v1/responses", f'{{"input": [{{"role": "user", "content": {SURROGATE}}}]}}', "input[0].content"),
    ("/tokenize", f'{{"prompt": {SURROGATE}}}', "prompt"),
    # types are strict in the Responses API too
    ("/v1/responses", '{"input": "hi", "temperature": "0.5"}', "temperature"),
    ("/v1/responses", '{"input": "hi", "stream": "yes"}', "stream"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": "3"}', "max_output_tokens"),
    ("/detokenize", '{"tokens": [true]}', "tokens[0]"),
    # a field that takes several types is named as written, not by the type pydantic tried
    ("/v1/chat/completions", f'{{"messages": [{json.dumps(USER)}], "stop": 5}}', "stop"),
    ("/v1/completions", '{"prompt": [1.5]}', "prompt"),
    ("/v1/responses", '{"input": 5}', "input"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (
        "/v1/chat/completions",
        f'{{"messages": [{json.dumps(USER)}], "stream_options": {{}}}}',
        "stream_options",
    ),
    ("/v1/responses", '{"input": [{"type": "message", "content": "hi"}]}', "input[0].role"),
    # a field named like a type or a class is still named
    ("/v1/chat/completions", f'{{"messages": [{json.dumps(USER)}], "Temperature": 0.5}}', "Temperature"),
    ("/v1/chat/completions", f'{{"messages": [{json.dumps(USER)}], "str": 1}}', "str"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x", "Name": "y"}]}',
        "messages[0].Name",
    ),
    # a schema of false is no schema: refused in both endpoints
    (
        "/v1/responses",
        '{"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": false}}}',
        "text.format.schema",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[c[2] + c[0] for c in CASES])
def test_each_mistake_is_a_400_naming_the_field_as_written(served, path, body, param):
    server = served[0]
    head = '{"model": "' + MODEL + '", ' if "tokenize" not in path else "{"
    status, _, data = send(server, "POST", path, (head + body.lstrip("{")).encode())
    answer = json.loads(data)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert not answer["error"]["message"].startswith(("Value error", "body")), answer


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            {"model": MODEL, "messages": [USER], "max_tokens": "5", "temperature": "x"},
            {"max_tokens", "temperature"},
        ),
        ({"messages": [USER], "max_tokens": "5"}, {"model", "max_tokens"}),  # no model, and a bad field
        (
            {"model": MODEL, "messages": [{"role": 5, "content": 5}]},
            {"messages[0].role", "messages[0].content"},
        ),
    ],
)
def test_several_mistakes_name_one_of_the_fields(served, body, named):
    """Two bad fields side by side: the 400 names one of them (sibling fields were read as a union's
    members, and the error named none)."""
    status, _, data = send(served[0], "POST", "/v1/chat/completions", json.dumps(body).encode())
    answer = json.loads(data)
    assert status == 400 and answer["error"]["param"] in named, answer


def test_a_body_sent_without_the_json_content_type_is_told_so(served):
    body = json.dumps({"model": MODEL, "messages": CHAT}).encode()
    status, _, data = send(served[0], "POST", "/v1/chat/completions", body, {"Content-Type": "text/plain"})
    assert status == 400 and "Content-Type: application/json" in json.loads(data)["error"]["message"]


def test_an_unexpected_failure_is_a_json_500_and_the_connection_keeps_serving(served, monkeypatch):
    import hfaccel.server.app as app

    def broken(*args, **kwargs):
        raise RuntimeError("a failure no route expected")

    monkeypatch.setattr(app, "prepare_call", broken)
    host, port = served[0].url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2})
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    assert response.status == 500 and answer["error"]["type"] == "server_error"
    assert "RuntimeError: a failure no route expected" in answer["error"]["message"]
    monkeypatch.undo()
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    again = connection.getresponse()
    assert again.status == 200 and json.loads(again.read())["choices"]
    connection.close()


def test_serving_on_a_busy_port_raises_instead_of_returning():
    """uvicorn's bind failure ends only its own thread (its sys.exit); `python -m hfaccel serve` then
    returned as if it had served (exit status 0). It raises, which the command turns into status 2."""
    import socket

    import hfaccel
    from hfaccel.server import Limits
    from hfaccel.server.server import run_forever
    from tests.helpers import tiny_model, tiny_tokenizer

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    model = tiny_model()
    try:
        with pytest.raises(OSError, match="could not start on 127.0.0.1"):
            run_forever(
                model, tiny_tokenizer(), host="127.0.0.1", port=busy.getsockname()[1], api_key=None,
                model_id="m", limits=Limits(), log_level="critical", kv_cache_memory=8_000_000,
            )  # fmt: skip
    finally:
        busy.close()
        hfaccel.unpatch(model)


def test_a_body_over_the_limit_is_a_413_announced_or_sent_in_chunks():
    """A client that announces no length (chunked transfer) is held to the limit as its bytes come."""
    import hfaccel
    from hfaccel.server import Limits
    from tests.helpers import tiny_model, tiny_tokenizer

    limits = Limits(max_body_bytes=4000)
    server = hfaccel.serve(tiny_model(), tiny_tokenizer(), port=0, model_id=MODEL, limits=limits)
    host, port = server.url.removeprefix("http://").split(":")

    def post(body: bytes, chunked: bool) -> tuple[int, dict]:
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        headers = {"Content-Type": "application/json"}
        if chunked:  # pieces of 1,000 bytes, no Content-Length
            pieces = (body[i : i + 1000] for i in range(0, len(body), 1000))
            connection.request("POST", "/v1/chat/completions", pieces, headers, encode_chunked=True)
        else:
            connection.request("POST", "/v1/chat/completions", body, headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        return response.status, answer

    small = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2}).encode()
    large = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 9000}]}).encode()
    try:
        for chunked in (False, True):
            status, answer = post(large, chunked)
            assert status == 413 and "over 4000 bytes" in answer["error"]["message"], answer
            assert post(small, chunked)[0] == 200
    finally:
        server.stop()


def _requests_total(server, endpoint: str, outcome: str) -> float:
    _, _, data = send(server, "GET", "/metrics")
    line = f'hfaccel_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} '
    found = [row for row in data.decode().splitlines() if row.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


def test_refused_requests_are_counted_as_rejected_once(served, monkeypatch):
    """Every 4xx a generation route answers counts once, as outcome "rejected": a bad body, a model
    this server does not serve, a call the engine refuses (a ValueError of the front-end), whether the
    answer would have streamed or not."""
    server = served[0]
    kinds = [("chat", o) for o in ("rejected", "ok", "error")] + [("completions", "rejected")]
    before = {kind: _requests_total(server, *kind) for kind in kinds}
    assert post(server, "/v1/chat/completions", {"messages": [USER], "max_tokens": -1})[0] == 400
    assert post(server, "/v1/chat/completions", {"model": "other", "messages": [USER]})[0] == 404
    assert post(server, "/v1/completions", {"prompt": []})[0] == 400

    async def refuse(*args, **kwargs):
        raise ValueError("the engine does not serve this call")

    async def refuse_stream(*args, **kwargs):
        raise ValueError("the engine does not serve this call")
        yield  # (an async generator, as astream)

    monkeypatch.setattr("hfaccel.server.completions.agenerate", refuse)
    monkeypatch.setattr("hfaccel.server.completions.astream", refuse_stream)
    assert post(server, "/v1/chat/completions", {"messages": [USER], "max_tokens": 2})[0] == 400
    streamed = {"messages": [USER], "max_tokens": 2, "stream": True}
    assert post(server, "/v1/chat/completions", streamed)[0] == 400
    grown = {kind: _requests_total(server, *kind) - before[kind] for kind in kinds}
    assert grown == {
        ("chat", "rejected"): 4,
        ("chat", "ok"): 0,
        ("chat", "error"): 0,
        ("completions", "rejected"): 1,
    }
