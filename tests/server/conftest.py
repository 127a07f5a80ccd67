"""The server tests' shared pieces: a tiny Llama served on 127.0.0.1 (one per test module), the `openai`
client over it, a plain POST for what the client hides, and a response template with a scripted reply
(reasoning, two tool calls) for the tests of how replies are read."""

from __future__ import annotations

import http.client
import json

import pytest

import hfaccel
from hfaccel.api.results import Completion, StreamEvent, no_metrics
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


# The tiny chat template's generation prompt is "<a>"; its EOS "</s>" is a special token.
TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<a>",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*</s>", "content": "text"},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
SCRIPT = (
    "<think>sum it</think>On it."
    '<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 4, "b": 5}}</tool_call>'
)


@pytest.fixture
def reading(served, monkeypatch):
    """The served tokenizer given `TEMPLATE`, and a chat template that shows tools to the model."""
    _, _, tokenizer = served
    monkeypatch.setattr(tokenizer, "response_template", TEMPLATE, raising=False)
    shown = "{% if tools %}<t>{{ tools | tojson }}{% endif %}" + tokenizer.chat_template
    monkeypatch.setattr(tokenizer, "chat_template", shown)
    return tokenizer


@pytest.fixture
def scripted(reading, monkeypatch):
    """The engine's output replaced by `SCRIPT` and EOS, to test how the server writes a tool call;
    ``scripted(text)`` replaces it by another text."""
    import hfaccel.server.completions as completions

    def use(script: str, finish: str = "stop", eos: bool = True) -> None:
        """`script`, then EOS (finish "stop"; without `eos`, as a stop string ends it), or cut there by the
        length (finish "length")."""
        end = [reading.eos_token_id] if finish == "stop" and eos else []
        ids = reading.encode(script, add_special_tokens=False) + end
        text = reading.decode(ids, skip_special_tokens=True)

        async def agenerate(model, prompts, **kwargs):
            return [Completion(prompts[0], ids, text, finish, no_metrics()) for _ in prompts]

        async def astream(model, prompts, **kwargs):
            for k, token in enumerate(ids):
                done = k == len(ids) - 1
                text = reading.decode([token], skip_special_tokens=True)
                yield StreamEvent(0, token, text, done, finish if done else None)

        monkeypatch.setattr(completions, "agenerate", agenerate)
        monkeypatch.setattr(completions, "astream", astream)

    use(SCRIPT)
    return use
