"""The server tests' shared pieces: a tiny Llama served on 127.0.0.1 (one per test module), the `openai`
client over it, and a plain POST for what the client hides."""

from __future__ import annotations

import http.client
import json

import pytest

import hfaccel
from tests.helpers import tiny_model, tiny_tokenizer

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def served():
    pytest.importorskip("fastapi")
    from hfaccel.server import Limits

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    limits = Limits(max_tokens=512, max_n=4, max_prompt_tokens=200, max_pending=80)
    server = hfaccel.serve(model, tokenizer, port=0, model_id=MODEL, limits=limits, kv_cache_memory=8_000_000)
    yield server, model, tokenizer
    server.stop()
    assert not server.running and getattr(model, "_hfaccel", None) is None  # serve patched it, stop unpatched


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def send(server, method, path, body: bytes | None = None, headers=None):
    """(status, headers, body bytes) of a plain HTTP request with a JSON content type."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def post(server, path, body, headers=None):
    """(status, headers, parsed JSON) of a plain POST."""
    status, answer_headers, data = send(server, "POST", path, json.dumps(body), headers)
    return status, answer_headers, json.loads(data) if data else None
