"""`hfaccel.serve` against a real server on 127.0.0.1, through the real `openai` client (and plain HTTP
where the client hides what is checked): outputs equal to `hfaccel.generate`, streams, errors, limits,
cancellation, a load of concurrent streaming clients, live weight changes and shutdown."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import hfaccel  # noqa: E402
from hfaccel.api import prompt_logprobs_of  # noqa: E402
from hfaccel.server import Limits  # noqa: E402
from tests.helpers import tiny_model, tiny_tokenizer  # noqa: E402
from tests.server.conftest import CHAT, MODEL, post, send  # noqa: E402


def engine_idle(model):
    stats = model._hfaccel.engine.stats()
    return stats["running"] == 0 and stats["waiting"] == 0


def engine_running(model):
    engine = model._hfaccel.engine
    return engine is not None and engine.stats()["running"] > 0


def test_greedy_chat_equals_hfaccel_generate_with_the_same_template(served, client):
    server, model, tokenizer = served
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    expected = hfaccel.generate(model, [CHAT], tokenizer=tokenizer, max_new_tokens=12, do_sample=False)[0]
    assert answer.choices[0].message.content == expected.text
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == expected.finish_reason
    prompt = len(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))
    assert answer.usage.prompt_tokens == prompt  # one character, one token
    assert answer.usage.completion_tokens == len(expected.token_ids)
    assert answer.usage.total_tokens == prompt + len(expected.token_ids)


def test_streamed_deltas_join_to_the_whole_answer(served, client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    # OpenAI: with include_usage every chunk has the field, null but on the last
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True}
    raw = send(
        served[0],
        "POST",
        "/v1/chat/completions",
        json.dumps({**body, "stream_options": {"include_usage": True}}),
    )
    events = [json.loads(line[6:]) for line in raw[2].decode().splitlines() if line.startswith("data: {")]
    assert all("usage" in e and e["usage"] is None for e in events[:-1]) and events[-1]["usage"]
    raw = send(served[0], "POST", "/v1/chat/completions", json.dumps(body))
    assert '"usage"' not in raw[2].decode()  # not asked: no field


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_matches_the_generated_text_only(served, client, stream):
    """OpenAI's ``stop`` looks at the output: a string made of the prompt's last character and the
    answer's first does not stop it (transformers' stop_strings would: they match across the prompt)."""
    plain = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    text = plain.choices[0].text
    stop = "c" + text[0]
    assert stop not in text, "the stop string must not be in the answer for this test to mean anything"

    def ask() -> tuple[str, str]:
        kwargs = dict(
            model=MODEL,
            prompt="abc",
            max_tokens=8,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        if not stream:
            choice = client.completions.create(**kwargs).choices[0]
            return choice.text, choice.finish_reason
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    assert ask() == (text, "length")


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_stop_strings_as_vllm_does(served, client, stream):
    """vLLM's ``min_tokens`` holds stop strings too (transformers' ``min_new_tokens`` holds EOS only): a
    stop string in the answer's first tokens ends it without min_tokens, and not with it."""
    kwargs = dict(model=MODEL, prompt="abc", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[1]  # ends the answer at its second character, in its first tokens

    def ask(min_tokens: int) -> tuple[str, str]:
        body = dict(kwargs, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": min_tokens})
        if not stream:
            choice = client.completions.create(**body).choices[0]
            return choice.text, choice.finish_reason
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **body) if c.choices]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    assert ask(0) == (text[: text.index(stop)], "stop")
    held, finish = ask(8)
    assert len(held) > text.index(stop) and text.startswith(held)  # the early stop did not end it
    assert held == text or finish == "stop"  # (a stop string in its last token may still end it)


def test_text_completions_with_echo_and_logprobs(served, client):
    server, model, tokenizer = served
    answer = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0, logprobs=2, echo=True
    )
    expected = hfaccel.generate(
        model, ["abc"], tokenizer=tokenizer, max_new_tokens=6, do_sample=False, logprobs=2
    )[0]
    choice = answer.choices[0]
    assert choice.text == "abc" + expected.text
    # Echoed, the prompt's tokens come first with the model's own logprobs (the first has none), as in
    # OpenAI's legacy completions, which eval harnesses score texts with.
    ids = tokenizer("abc")["input_ids"]
    prompt = prompt_logprobs_of(model, ids, 2)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == len(ids) + len(expected.token_ids)
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx([p[t] for p, t in zip(prompt[1:], ids[1:])])
    assert logprobs.token_logprobs[len(ids) :] == pytest.approx(expected.logprobs)
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    # Keyed by token text (OpenAI's legacy layout): tokens that decode alike share a key. The 2 most
    # likely and the chosen token, as OpenAI documents ("up to logprobs+1 elements").
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
    for token, chosen, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]
    ):
        assert top[token] == chosen
    stream = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0, logprobs=2, echo=True, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    echoed = chunks[0]  # the echo comes first, with the prompt's logprobs
    assert echoed.text == "abc" and echoed.logprobs.token_logprobs == logprobs.token_logprobs[: len(ids)]
    streamed = [offset for chunk in chunks if chunk.logprobs for offset in chunk.logprobs.text_offset]
    assert streamed == logprobs.text_offset  # counted from the start of the whole text, as not streamed


def test_text_offset_counts_only_the_text_a_special_token_leaves_out(served, client):
    """A generated special token (here <s>, pushed up by logit_bias) is not in the choice's text, so it
    moves no later token's text_offset, streamed or not."""
    server, model, tokenizer = served
    kwargs = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    choice = client.completions.create(logit_bias={"1": 2.5}, **kwargs).choices[0]
    ids = [tokenizer.convert_tokens_to_ids(token) for token in choice.logprobs.tokens]
    assert 1 in ids and any(i != 1 for i in ids), "the bias must give a mix of <s> and other tokens"
    expected = [len(tokenizer.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids))]
    assert choice.logprobs.text_offset == expected
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, logit_bias={"1": 2.5}, **kwargs)]
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == expected


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(served, client):
    """What eval harnesses send to score a text (lm-eval's loglikelihood): the prompt's own logprobs, no
    new token; without echo a 400 naming max_tokens."""
    server, model, tokenizer = served
    ids = tokenizer("abc def")["input_ids"]
    prompt = prompt_logprobs_of(model, ids, 1)
    for stream in (False, True):
        ask = {"model": MODEL, "prompt": ["abc def", "abc def"], "max_tokens": 0, "logprobs": 1, "echo": True}
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
            texts = {i: "".join(c.text for c in chunks if c.index == i) for i in (0, 1)}
            scored = [lp for c in chunks if c.index == 1 and c.logprobs for lp in c.logprobs.token_logprobs]
            finish = [c.finish_reason for c in chunks if c.finish_reason]
        else:
            answer = client.completions.create(**ask)
            texts = {c.index: c.text for c in answer.choices}
            scored = answer.choices[1].logprobs.token_logprobs
            finish = [c.finish_reason for c in answer.choices]
            assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == 2 * len(ids)
        assert texts == {0: "abc def", 1: "abc def"} and finish == ["length", "length"]
        assert scored[0] is None
        assert scored[1:] == pytest.approx([p[t] for p, t in zip(prompt[1:], ids[1:])])
    code, _, error = post(server, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 0})
    assert code == 400 and error["error"]["param"] == "max_tokens"


def test_echoed_logprobs_of_n_choices_take_one_forward(served, client, monkeypatch):
    import hfaccel.server.logprob_items as logprob_items

    forwards = []
    original = logprob_items.prompt_logprobs_of
    monkeypatch.setattr(logprob_items, "prompt_logprobs_of", lambda *a: forwards.append(1) or original(*a))
    answer = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=2, temperature=1.0, n=3, logprobs=1, echo=True, seed=1
    )
    assert len(answer.choices) == 3 and len(forwards) == 1
    assert len({tuple(c.logprobs.token_logprobs[1:3]) for c in answer.choices}) == 1  # the same prompt


def test_n_choices_and_a_seed_reproduce(served, client):
    ask = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, n=3, seed=7)
    first, second = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1  # three samples, seeded seed, seed + 1, seed + 2


def test_chat_logprobs_match_hfaccel_generate(served, client):
    server, model, tokenizer = served
    answer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    expected = hfaccel.generate(
        model, [CHAT], tokenizer=tokenizer, max_new_tokens=5, do_sample=False, logprobs=3
    )[0]
    content = answer.choices[0].logprobs.content
    assert [item.logprob for item in content] == pytest.approx(expected.logprobs)
    assert all(len(item.top_logprobs) == 3 for item in content)
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in expected.token_ids]


def test_a_stop_string_ends_the_answer_and_is_left_out(served, client):
    ask = dict(model=MODEL, prompt="abcdef", max_tokens=20, temperature=0)
    full = client.completions.create(**ask).choices[0].text
    stop = full[1:3]
    assert len(stop) == 2 and full.find(stop) == 1, full
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**ask, stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            answer = client.completions.create(**ask, stop=[stop])
            text, finish = answer.choices[0].text, [answer.choices[0].finish_reason]
        assert text == full[:1] and finish == ["stop"], (stream, text)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"temperature": 5}, 400, "temperature"),
        ({"logit_bias": {"five": 1.0}}, 400, "logit_bias"),
        ({"logit_bias": {"\u00b2": 1.0}}, 400, "logit_bias"),  # a digit to str.isdigit, not to int()
        ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, 400, "logit_bias"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"max_tokens": 513}, 400, "max_tokens"),
        ({"n": 5}, 400, "n"),
        ({"top_k": -5}, 400, "top_k"),
        ({"temperature": float("nan")}, 400, "temperature"),
        ({"logit_bias": {"5": float("inf")}}, 400, "logit_bias.5"),
        ({"model": None}, 400, "model"),
        ({"metadata": {"a": float("nan")}}, 400, "metadata.a"),  # any field: no JSON answer repeats it
        ({"model": "gpt-4"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "x" * 300}]}, 413, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
            400,
            "messages[0].content[0].text",
        ),
    ],
)
def test_each_mistake_gets_its_status_and_names_its_field(served, body, status, param):
    request = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **body}
    code, _, answer = post(served[0], "/v1/chat/completions", request)
    assert code == status, answer
    assert answer["error"]["param"] == param and answer["error"]["message"]


def test_unknown_routes_are_404_in_openai_form(served):
    code, _, answer = post(served[0], "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert code == 404 and answer["error"]["type"] == "not_found_error"


def test_models_health_tokenize_detokenize_and_metrics(served, client):
    server, model, tokenizer = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    code, _, tokens = post(server, "/tokenize", {"prompt": "hi!", "add_special_tokens": False})
    assert code == 200 and tokens["tokens"] == tokenizer("hi!", add_special_tokens=False)["input_ids"]
    code, _, text = post(server, "/detokenize", {"tokens": tokens["tokens"]})
    assert code == 200 and text["prompt"] == "hi!"
    assert post(server, "/detokenize", {"tokens": [10**6]})[0] == 400
    code, _, answer = post(server, "/tokenize", {"messages": []})  # was a 500 (2026-11-26)
    assert code == 400 and answer["error"]["param"] == "messages", answer
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", "/metrics")
    metrics = connection.getresponse().read().decode()
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    connection.close()
    for name in (
        "hfaccel_requests_total",
        "hfaccel_time_to_first_token_seconds_bucket",
        "hfaccel_kv_blocks_used",
    ):
        assert name in metrics
    assert 'outcome="ok"' in metrics


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_killed_mid_request_frees_its_blocks_and_the_next_request_completes(stream):
    """A request of 3,000 tokens (about 2 s here) whose client goes while it runs (streamed: after the
    first event): it is cancelled (far fewer tokens generated), its blocks freed, and the server serves
    the next one."""
    model, tokenizer = tiny_model("llama", max_positions=4096), tiny_tokenizer()
    limits = Limits(max_tokens=4000)
    with hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, limits=limits, kv_cache_memory=8_000_000
    ) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, temperature=0
        )  # engine built
        engine = model._hfaccel.engine
        used_before, generated_before = (
            engine.block_manager.num_used_blocks,
            engine.stats()["generated_tokens"],
        )
        host, port = server.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a long one"}], "max_tokens": 3000,
                "temperature": 0, "min_tokens": 3000, "stream": True}  # fmt: skip
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event has come: the request runs
        connection.sock.shutdown(socket.SHUT_RDWR)  # killed
        response.close()
        connection.close()
        deadline = time.monotonic() + 20
        while not engine_idle(model) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine_idle(model)
        assert engine.stats()["generated_tokens"] - generated_before < 2000  # cancelled, not run to its end
        assert engine.block_manager.num_used_blocks <= used_before + 1  # prefix-cached blocks may stay
        assert 'outcome="cancelled"' in server._server.config.app.state.metrics.render().decode()
        answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_while_its_request_waits_is_cancelled_before_it_runs(stream):
    """One sequence at a time: B waits behind A, and its client leaves. B never runs (A's tokens are all
    that is generated) and counts as cancelled. (Non-streamed, B used to run to its end: the body-size
    middleware hid the disconnect, 2026-11-26.)"""
    model, tokenizer = tiny_model("llama", max_positions=4096), tiny_tokenizer()
    errors = ErrorLog()
    with hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, limits=Limits(max_tokens=4000), kv_cache_memory=8_000_000,
        max_num_seqs=1,
    ) as server:  # fmt: skip
        logging.getLogger("uvicorn.error").addHandler(errors)  # (uvicorn configures its loggers at start)
        assert post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200
        engine = model._hfaccel.engine
        generated = engine.stats()["generated_tokens"]
        long = {
            "model": MODEL,
            "prompt": "a long one",
            "max_tokens": 1200,
            "min_tokens": 1200,
            "temperature": 0,
        }
        first = threading.Thread(target=post, args=(server, "/v1/completions", long))
        first.start()
        deadline = time.monotonic() + 20
        while not engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        host, port = server.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {**long, "prompt": "queued", "stream": stream}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        while not engine.scheduler.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.scheduler.waiting, "B must wait behind A"
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        first.join()
        time.sleep(1.0)  # B would be running by now
        assert engine_idle(model) and engine.stats()["generated_tokens"] - generated == 1200
        metrics = server._server.config.app.state.metrics.render().decode()
        assert 'outcome="cancelled"} 1.0' in metrics
        assert 'outcome="rejected"' not in metrics  # counted once: the route's "cancelled"
    logging.getLogger("uvicorn.error").removeHandler(errors)
    assert not errors.records, errors.records  # the server raised nothing on the way


class ErrorLog(logging.Handler):
    """The ERROR records a logger emits (uvicorn's loggers do not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage() + (str(record.exc_info[1]) if record.exc_info else ""))


def test_sixty_four_concurrent_streaming_clients_all_complete_and_nothing_leaks(served):
    server, model, _ = served
    results, errors = [None] * 64, []

    def one(i):
        try:
            local = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            messages = [{"role": "user", "content": f"client {i} asks"}]
            stream = local.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
            )
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors and all(r is not None for r in results)
    # A client has its last chunk before the server's stream runs its cleanup: wait for it, briefly.
    admission = server._server.config.app.state.admission
    deadline = time.monotonic() + 5
    while (admission.pending or not engine_idle(model)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_idle(model)
    assert admission.pending == 0


def test_the_live_model_is_served_as_it_is_now(served, client):
    """Weights changed between requests (a training step): the next answer is the new model's, with no
    KV computed from the old weights."""
    server, model, tokenizer = served
    ask = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    before = client.chat.completions.create(**ask).choices[0].message.content
    saved = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        after = client.chat.completions.create(**ask).choices[0].message.content
        expected = hfaccel.generate(model, [CHAT], tokenizer=tokenizer, max_new_tokens=8, do_sample=False)[
            0
        ].text
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
    assert after == expected and after != before


def test_an_api_key_is_required_when_set_and_compared_whole():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    with hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, api_key="sesame", kv_cache_memory=4_000_000
    ) as server:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        assert post(server, "/v1/chat/completions", body)[0] == 401
        assert post(server, "/v1/chat/completions", body, {"Authorization": "Bearer sesam"})[0] == 401
        assert post(server, "/v1/chat/completions", body, {"Authorization": "Bearer sesame"})[0] == 200
        assert post(server, "/v1/chat/completions", body, {"Authorization": "bearer sesame"})[0] == 200
        for wrong in ("Basic sesame", "sesame", "Bearer", "Bearer sesame2", "Bearersesame"):
            assert post(server, "/v1/chat/completions", body, {"Authorization": wrong})[0] == 401, wrong
        assert post(server, "/tokenize", {"prompt": "x"})[0] == 401


def test_allowed_origins_get_cors_headers_on_answers_errors_and_preflights(served):
    page = {"Origin": "http://localhost:3000"}
    # By default no origin is allowed: a browser page elsewhere cannot read the answers.
    assert "access-control-allow-origin" not in send(served[0], "GET", "/v1/models", None, page)[1]
    assert send(served[0], "HEAD", "/v1/models")[0] == 200  # a load balancer's check
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    with hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, api_key="sesame", kv_cache_memory=4_000_000,
        allowed_origins=("http://localhost:3000",),
    ) as server:  # fmt: skip
        preflight = {
            **page,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, headers, _ = send(server, "OPTIONS", "/v1/chat/completions", None, preflight)
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in headers["access-control-allow-methods"]
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        status, headers, _ = post(server, "/v1/chat/completions", body, page)  # no key: a 401 it can read
        assert status == 401 and headers["access-control-allow-origin"] == "http://localhost:3000"
        status, headers, _ = post(
            server, "/v1/chat/completions", body, {**page, "Authorization": "Bearer sesame"}
        )
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        other = send(server, "GET", "/health", None, {"Origin": "http://evil.example"})[1]
        assert "access-control-allow-origin" not in other
    # One origin given as a string is that origin (not its characters); a malformed one is refused.
    with hfaccel.serve(
        model,
        tokenizer,
        port=0,
        model_id=MODEL,
        kv_cache_memory=4_000_000,
        allowed_origins="http://localhost:3000",
    ) as server:
        headers = send(server, "GET", "/v1/models", None, page)[1]
        assert headers["access-control-allow-origin"] == "http://localhost:3000"
    with pytest.raises(ValueError, match="allowed_origins: 'localhost:3000' is not"):
        hfaccel.serve(model, tokenizer, port=0, allowed_origins=["localhost:3000"])


def test_a_full_queue_answers_429_with_retry_after():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    limits = Limits(max_pending=2)
    with hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, limits=limits, kv_cache_memory=4_000_000
    ) as server:
        local = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = local.chat.completions.create(
            model=MODEL, messages=CHAT, n=2, max_tokens=40, stream=True, extra_body={"min_tokens": 40}
        )
        chunks = iter(stream)
        next(chunks)  # its two choices are in flight
        code, headers, answer = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT})
        assert (
            code == 429
            and headers.get("retry-after") == "1"
            and answer["error"]["type"] == "rate_limit_error"
        )
        list(chunks)
        ok = {"model": MODEL, "messages": CHAT, "n": 2, "max_tokens": 2}
        assert post(server, "/v1/chat/completions", ok)[0] == 200
        # More choices than may ever be in flight: no retry would help, so not a 429.
        code, _, answer = post(server, "/v1/chat/completions", {**ok, "n": 3})
        assert code == 400 and answer["error"]["param"] == "n", answer


def test_requests_being_prepared_hold_their_seats(monkeypatch):
    """Tokenizing runs in worker threads; a request holds a seat while it waits for one, so a flood of
    requests beyond the limit is a 429 at once, not a queue of tokenizations."""
    import hfaccel.server.app as app_module

    release, entered = threading.Event(), threading.Semaphore(0)
    real = app_module.prepare_call

    def slow_prepare(*args):
        entered.release()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(app_module, "prepare_call", slow_prepare)
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    with hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, limits=Limits(max_pending=2), kv_cache_memory=4_000_000
    ) as server:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        codes = []
        waiting = [
            threading.Thread(target=lambda: codes.append(post(server, "/v1/chat/completions", body)[0]))
        ]
        waiting.append(threading.Thread(target=waiting[0]._target))
        for thread in waiting:
            thread.start()
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)  # both are being prepared
        start = time.monotonic()
        assert post(server, "/v1/chat/completions", body)[0] == 429
        assert time.monotonic() - start < 5
        release.set()
        for thread in waiting:
            thread.join(60)
        assert codes == [200, 200]
        assert server._server.config.app.state.admission.pending == 0


def test_stop_lets_a_stream_in_flight_end_and_unpatches():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    server = hfaccel.serve(model, tokenizer, port=0, model_id=MODEL, kv_cache_memory=4_000_000)
    local = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = local.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"min_tokens": 40},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    rest = list(chunks)
    stopper.join(30)
    assert rest[-1].usage.completion_tokens == 40  # the stream in flight ran to its end
    assert not server.running and getattr(model, "_hfaccel", None) is None


MALFORMED = [
    b"{not json",
    b"[1, 2, 3]",
    b'{"model": "tiny-llama", "messages": "hello"}',
    b'{"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "n": 0}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_k": "many"}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stop": [""]}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "seed": 1180591620717411303424}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_p": 0}',
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stream_options": {"x": 1}}',
    b'{"model": "tiny-llama", "prompt": [999999999]}',
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_request_gets_a_4xx_and_the_server_keeps_serving(served, client, body):
    server = served[0]
    host, port = server.url.removeprefix("http://").split(":")
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert 400 <= response.status < 500 and answer["error"]["message"], answer
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0).choices


def test_logit_bias_is_added_to_the_tokens_logits(served, client):
    """OpenAI's logit_bias as transformers' sequence_bias: +100 makes a token the greedy choice every
    step; -100 on the greedy first token makes the answer start otherwise."""
    tokenizer = served[2]
    ask = dict(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    forced = client.completions.create(**ask, logit_bias={"10": 100}).choices[0].text
    assert forced == tokenizer.decode([10]) * 4
    plain = client.completions.create(**ask, logprobs=0).choices[0]
    first = tokenizer.convert_tokens_to_ids(plain.logprobs.tokens[0])
    other = client.completions.create(**ask, logit_bias={str(first): -100}).choices[0].text
    assert other[:1] != plain.text[:1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"])
def test_a_slow_prompt_to_tokenize_does_not_stall_the_other_requests(served, monkeypatch, path):
    """Tokenizing runs in a worker thread (a 4 MB prompt takes seconds): while one request's prompt is
    tokenized, the server answers another."""
    import threading

    tokenizer = served[2]
    tokenizing, release = threading.Event(), threading.Event()
    encode, template = type(tokenizer).__call__, type(tokenizer).apply_chat_template

    def held(real):
        def call(self, text, *args, **kwargs):
            if "SLOW" in str(text):
                tokenizing.set()
                assert release.wait(30)
            return real(self, text, *args, **kwargs)

        return call

    monkeypatch.setattr(type(tokenizer), "__call__", held(encode))
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", held(template))
    bodies = {
        "/v1/completions": lambda text: {"model": MODEL, "prompt": text, "max_tokens": 2},
        "/v1/chat/completions": lambda text: {
            "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2
        },
        "/v1/responses": lambda text: {"model": MODEL, "input": text, "max_output_tokens": 2},
        "/tokenize": lambda text: {"model": MODEL, "prompt": text},
    }  # fmt: skip
    answers = {}
    slow = threading.Thread(
        target=lambda: answers.update(slow=post(served[0], path, bodies[path]("SLOW one")))
    )
    slow.start()
    try:
        assert tokenizing.wait(30)
        status, _, _ = post(
            served[0], "/v1/completions", {"model": MODEL, "prompt": "quick", "max_tokens": 2}
        )
        assert status == 200
    finally:
        release.set()
        slow.join(60)
    assert answers["slow"][0] == 200, answers["slow"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": CHAT, "n": None, "stream": None, "logprobs": None, "ignore_eos": None,
             "top_logprobs": None, "seed": None, "stop": None, "response_format": None},
        ),
        (
            "/v1/completions",
            {"prompt": "Hello", "n": None, "stream": None, "echo": None, "suffix": None, "best_of": None,
             "logprobs": None},
        ),
        (
            "/v1/responses",
            {"input": "Hello", "stream": None, "previous_response_id": None, "reasoning": None,
             "include": None, "text": {"format": None}},
        ),
    ],
)  # fmt: skip
def test_a_field_sent_as_null_is_not_set(served, path, body):
    """Clients that write every field send null for the ones they leave unset (OpenAI's are nullable)."""
    limit = {"max_output_tokens": 3} if "responses" in path else {"max_tokens": 3}
    status, _, answer = post(served[0], path, {"model": MODEL, **limit, **body})
    assert status == 200, answer


def test_logprobs_of_tokens_ruled_out_are_finite_json(served):
    """top_k=1 leaves one token with a finite logprob; the others' -inf is written as vLLM writes it,
    -9999.0, whole and streamed (JSON has no infinity)."""
    ask = {
        "model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 1.0, "top_k": 1, "seed": 0,
        "logprobs": True, "top_logprobs": 3,
    }  # fmt: skip

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))

    status, _, data = send(served[0], "POST", "/v1/chat/completions", json.dumps(ask))
    assert status == 200, data
    items = strict(data)["choices"][0]["logprobs"]["content"]
    alternatives = [t["logprob"] for item in items for t in item["top_logprobs"]]
    assert all(item["logprob"] == 0.0 for item in items) and -9999.0 in alternatives
    status, _, data = send(served[0], "POST", "/v1/chat/completions", json.dumps({**ask, "stream": True}))
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and all(strict(event) for event in events)


def test_a_temperature_too_small_to_divide_by_is_greedy(served, client):
    ask = {"model": MODEL, "messages": CHAT, "max_tokens": 8}
    greedy = client.chat.completions.create(**ask, temperature=0).choices[0].message.content
    assert client.chat.completions.create(**ask, temperature=1e-45).choices[0].message.content == greedy


def test_a_choice_that_ends_with_no_token_still_gets_its_finish(served, monkeypatch):
    """`hfaccel.stream` closes a request that ended with no new token (a latency target rejected it)
    with an event of its own, token None: its streamed choice still ends with that finish_reason."""
    import hfaccel.server.completions as completions
    from hfaccel.api.results import StreamEvent

    async def astream(model, prompts, **kwargs):
        yield StreamEvent(0, 40, "F", False, None)
        yield StreamEvent(1, None, None, True, "rejected")
        yield StreamEvent(0, 41, "G", True, "length")

    monkeypatch.setattr(completions, "astream", astream)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "n": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    status, _, data = send(served[0], "POST", "/v1/completions", json.dumps(body))
    assert status == 200
    events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finishes == {0: "length", 1: "rejected"}
    texts = ["".join(c["text"] for e in events for c in e["choices"] if c["index"] == i) for i in (0, 1)]
    assert texts == ["FG", ""]
    assert events[-1]["usage"]["completion_tokens"] == 2, "a closing event is no token"


def test_requests_cancelled_by_a_stop_are_told_the_server_is_shutting_down(monkeypatch):
    """Past the graceful period, uvicorn cancels what still runs: a whole answer is a 503 in OpenAI's
    error JSON, a stream under way ends with an error event (uvicorn answered a bare 500, cut the
    stream and logged a traceback per request), and the server logs no traceback."""
    monkeypatch.setattr("hfaccel.server.server.GRACEFUL_SHUTDOWN_S", 1)
    model, tokenizer = tiny_model("llama", max_positions=4096), tiny_tokenizer()
    server = hfaccel.serve(
        model, tokenizer, port=0, model_id=MODEL, limits=Limits(max_tokens=4000),
        kv_cache_memory=8_000_000, max_num_seqs=1,
    )  # fmt: skip
    errors = ErrorLog()
    logging.getLogger("uvicorn.error").addHandler(errors)
    host, port = server.url.removeprefix("http://").split(":")
    answers: dict[bool, tuple[int, str]] = {}

    def ask(stream: bool) -> None:
        body = {"model": MODEL, "prompt": "q", "max_tokens": 3000, "min_tokens": 3000, "stream": stream}
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        answers[stream] = (response.status, response.read().decode())
        connection.close()

    try:
        streamed = threading.Thread(target=ask, args=(True,))
        streamed.start()
        while not engine_running(model):  # the stream runs first; the whole answer waits behind it
            time.sleep(0.01)
        whole = threading.Thread(target=ask, args=(False,))
        whole.start()
        time.sleep(0.3)
    finally:
        server.stop()
        logging.getLogger("uvicorn.error").removeHandler(errors)
    streamed.join(30)
    whole.join(30)
    status, text = answers[False]
    assert status == 503 and json.loads(text)["error"]["message"].startswith("the server is shutting down")
    status, text = answers[True]
    last = text.strip().split("\n\n")[-1]
    assert status == 200 and last.startswith("data: {") and "the server is shutting down" in last, last
    # uvicorn's one line that it cancels them, and no "Exception in ASGI application" per request
    assert [r for r in errors.records if "Cancel" not in r] == [], errors.records
