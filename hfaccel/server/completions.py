"""Chat and text completions: a request's prompt ids and `generate` arguments (`prepare_call`), its
answer as one JSON body (`run_call`) or as OpenAI's stream of chunks (`stream_call`). The two flavours
differ only in how the prompt is made and how a choice is written."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fastapi.sse import format_sse_event

from hfaccel.api import agenerate, astream
from hfaccel.api.detokenize import Detokenizer, special_tokens
from hfaccel.patches.patch_state import strict_calls
from hfaccel.patches.reply_parsing import response_template
from hfaccel.patches.stop_strings import openai_stops
from hfaccel.server.chat_prompt import chat_prompt_ids
from hfaccel.server.logprob_items import echoed_prompt_items, legacy_logprobs, logprob_items, shown_bytes
from hfaccel.server.protocol import APIError, ChatMessage
from hfaccel.server.replies import (
    ReplyReading,
    cut_plain,
    cut_raw,
    raw_pieces,
    read_piece,
    reply_choice,
    token_pieces,
)
from hfaccel.server.sampling import (
    cleaned_stops,
    cut_at_stop,
    generate_kwargs,
    grammar_job,
    penalties_processor,
    stop_strings,
)


class ChatFlavour:
    """``/v1/chat/completions``: the chat template over the messages (and tools), choices of messages."""

    endpoint, object, chunk_object, id_prefix = "chat", "chat.completion", "chat.completion.chunk", "chatcmpl"

    @staticmethod
    def prompt_ids(
        tokenizer: Any,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return chat_prompt_ids(tokenizer, messages, tools, template_kwargs)

    @staticmethod
    def prompts(tokenizer: Any, body: Any) -> list[list[int]]:
        # tool_choice "none": the model is not shown the tools (vLLM's default), so it does not call them.
        tools = None if body.tool_choice == "none" else body.tools
        return [ChatFlavour.prompt_ids(tokenizer, body.messages, tools, body.chat_template_kwargs)]

    @staticmethod
    def max_tokens(body: Any) -> int | None:
        return body.max_completion_tokens or body.max_tokens

    @staticmethod
    def logprobs(body: Any) -> bool | int:
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return (body.top_logprobs or True) if body.logprobs else False

    @staticmethod
    def choice(
        index: int,
        text: str,
        finish: str | None,
        logprobs: list[dict[str, Any]] | None,
        shown: list[bytes] | None = None,
    ) -> dict[str, Any]:
        lp = None if logprobs is None else {"content": logprobs}
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}

    @staticmethod
    def delta(
        index: int,
        text: str | None,
        finish: str | None,
        logprobs: list[dict[str, Any]] | None,
        before: bytes = b"",
        shown: list[bytes] | None = None,
    ) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        lp = None if logprobs is None else {"content": logprobs}
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}


class TextFlavour:
    """``/v1/completions``: a text (or token-id) prompt, choices of text (``echo`` puts the prompt first)."""

    endpoint, object, chunk_object, id_prefix = "completions", "text_completion", "text_completion", "cmpl"

    @staticmethod
    def prompts(tokenizer: Any, body: Any) -> list[list[int]]:
        """One prompt (text or token ids), or OpenAI's batch: a list of them, each prompt's `n` choices in
        turn (choice ``i * n + j`` is prompt i's j-th)."""
        prompt = body.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [TextFlavour._ids(tokenizer, prompt, "prompt")]
        return [TextFlavour._ids(tokenizer, p, f"prompt[{i}]") for i, p in enumerate(prompt)]

    @staticmethod
    def _ids(tokenizer: Any, prompt: str | list[int], param: str) -> list[int]:
        ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        if not ids:
            raise APIError(400, "the prompt has no tokens", param)
        if isinstance(prompt, str):
            return ids
        bad = next((t for t in prompt if not 0 <= t < len(tokenizer)), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary", param)
        return list(prompt)

    @staticmethod
    def max_tokens(body: Any) -> int | None:
        return body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default for completions

    @staticmethod
    def logprobs(body: Any) -> bool | int:
        return False if body.logprobs is None else (body.logprobs or True)

    @staticmethod
    def choice(
        index: int,
        text: str,
        finish: str | None,
        logprobs: list[dict[str, Any]] | None,
        before: bytes = b"",
        shown: list[bytes] | None = None,
    ) -> dict[str, Any]:
        lp = legacy_logprobs(logprobs, before, shown)
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": lp}

    @staticmethod
    def delta(
        index: int,
        text: str | None,
        finish: str | None,
        logprobs: list[dict[str, Any]] | None,
        before: bytes = b"",
        shown: list[bytes] | None = None,
    ) -> dict[str, Any]:
        """A chunk; `before`: the bytes of the choice's text already streamed (its offsets count from the
        start of that text, as OpenAI's and vLLM's streams do)."""
        return TextFlavour.choice(index, text or "", finish, logprobs, before, shown)


@dataclass
class CompletionCall:
    """One HTTP request made ready: its prompts' ids, `generate` arguments, n and stop strings."""

    flavour: Any
    body: Any
    prompts: list[list[int]]  # one, or a completions batch
    kwargs: dict[str, Any]
    logprobs: bool | int
    stops: list[str]
    reading: ReplyReading | None = None  # chat: its reply read into content, reasoning and tool calls
    cleaned: list[str] | None = None  # the stops as a tokenizer's clean-up shows them (`cleaned_stops`)
    grammar: Callable[[], Any] | None = None  # makes the response_format's processor (`compile_grammar`)
    replies: list[Any] = field(default_factory=list)  # each choice's reply read whole (`run_call`)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    generated: int = 0  # tokens streamed so far
    streamed: bool = False  # the stream ran to its end (not cut by a client that went)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def scores_only(self) -> bool:
        """``max_tokens=0`` with echo: the prompt is scored, nothing is generated."""
        return self.kwargs["max_new_tokens"] == 0

    @property
    def count(self) -> int:
        """The choices: `n` per prompt."""
        return self.body.n * len(self.prompts)

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt of a one-prompt call (chat, Responses)."""
        (prompt,) = self.prompts
        return prompt

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def choice_prompts(self) -> list[list[int]]:
        """Each choice's prompt, in choice order: prompt i's n copies, then prompt i + 1's."""
        return [p for p in self.prompts for _ in range(self.body.n)]

    @property
    def seed(self) -> list[int] | None:
        """The request's seed in the engine's range (OpenAI's seed is any int64, negative ones included),
        one per choice: choice j of every prompt draws from seed + j, so that each prompt's choices sample
        as that prompt's alone do (also where seed + j passes the range's end)."""
        if self.body.seed is None:
            return None
        seed = self.body.seed % 2**63  # (each choice's wrapped alike, one prompt or many)
        return [(seed + j) % 2**63 for _ in self.prompts for j in range(self.body.n)]

    def envelope(self, choices: list[dict[str, Any]], chunk: bool = False) -> dict[str, Any]:
        kind = self.flavour.chunk_object if chunk else self.flavour.object
        return {
            "id": f"{self.flavour.id_prefix}-{self.id}",
            "object": kind,
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
        }

    def usage(self, generated: int) -> dict[str, int]:
        prompt = self.prompt_tokens  # each prompt once, however many choices it has (vLLM's count)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def echo(self, tokenizer: Any, choice: int) -> str:
        """The text a choice starts with: its prompt's, with ``echo``."""
        if not getattr(self.body, "echo", False):
            return ""
        return tokenizer.decode(self.prompts[choice // self.body.n])

    @property
    def min_tokens(self) -> int:
        """The tokens before which no stop string ends a choice (vLLM's ``min_tokens``; 0: none)."""
        return getattr(self.body, "min_tokens", None) or 0

    def prompt_logprobs(self) -> int | None:
        """With ``echo`` and ``logprobs``, the prompt's tokens get logprobs too, as in OpenAI's legacy
        completions (what eval harnesses score a text with): k alternatives each, else None."""
        if not getattr(self.body, "echo", False) or self.logprobs is False:
            return None
        return 0 if self.logprobs is True else int(self.logprobs)


def prepare_call(served: Any, body: Any, flavour: Any) -> CompletionCall:
    prompts = flavour.prompts(served.tokenizer, body)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    vocab = len(served.tokenizer)
    try:
        kwargs = generate_kwargs(
            body,
            flavour.max_tokens(body),
            len(prompts[longest]),
            served.max_model_len(),
            served.limits,
            vocab,
        )
    except APIError as error:
        if len(prompts) > 1 and error.param == "prompt":  # a batch: name the prompt
            raise APIError(
                error.status, f"prompt {longest}: {error.message}", f"prompt[{longest}]"
            ) from error
        raise
    if kwargs["max_new_tokens"] == 0 and not getattr(body, "echo", False):
        raise APIError(
            400, "max_tokens=0 is served with echo only (the prompt scored, nothing generated)", "max_tokens"
        )
    penalties = penalties_processor(body, prompts)
    if penalties is not None:
        kwargs["logits_processor"] = [penalties]
    call = CompletionCall(flavour, body, prompts, kwargs, flavour.logprobs(body), stop_strings(body))
    call.grammar = grammar_job(served, body, prompts, kwargs)
    call.cleaned = cleaned_stops(served.tokenizer, call.stops)
    if call.count > served.limits.max_pending:  # it could never be admitted: not a 429 to retry
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={body.n} are {call.count} choices, above this server's limit of "
            f"{served.limits.max_pending} in flight",
            "prompt" if len(prompts) > 1 else "n",
        )
    chat = isinstance(flavour, type) and issubclass(flavour, ChatFlavour)  # chat and the Responses API
    template = response_template(served.tokenizer, served.model) if chat else None
    if template is not None:
        prompt = served.tokenizer.decode(call.prompt_ids)
        offered = None if body.tool_choice == "none" else body.tools  # calls are read only when offered
        one_call = body.parallel_tool_calls is False
        call.reading = ReplyReading.check(served.tokenizer, template, prompt, offered, one_call)
    return call


async def compile_grammar(call: CompletionCall) -> None:
    """Compile the call's ``response_format`` in a worker thread and add its processor to the call. On the
    event loop it would stall every stream: a tokenizer's first schema takes about 0.5 s (xgrammar reads
    the vocabulary), a large schema tens of ms."""
    if call.grammar is None:
        return
    processor = await asyncio.to_thread(call.grammar)
    call.grammar = None
    call.kwargs.setdefault("logits_processor", []).append(processor)


async def run_call(served: Any, call: CompletionCall, metrics: Any) -> dict[str, Any]:
    """The whole answer: every choice, usage, OpenAI's body."""
    tokenizer, endpoint = served.tokenizer, call.flavour.endpoint
    try:
        if call.scores_only:
            completions = [_NOTHING_GENERATED] * call.count
        else:
            with strict_calls(), openai_stops(call.min_tokens):  # a call the engine does not serve: 400
                completions = await agenerate(
                    served.model, call.choice_prompts(), tokenizer=tokenizer, seed=call.seed,
                    logprobs=call.logprobs, **call.kwargs,
                )  # fmt: skip
        prompts = await echoed_prompt_items(served, call)
    except ValueError as error:  # refused: counted with the other 4xx (`RefusalCounter`)
        raise APIError(400, str(error)) from error
    except BaseException as error:
        metrics.finished(endpoint, _outcome(error), call.prompt_tokens, 0, {})
        raise
    choices, generated = [], 0
    for i, completion in enumerate(completions):
        text = completion.text or ""
        stopped = completion.finish_reason == "stop" and call.stops
        if stopped:  # where the engine found it: in the text with special tokens
            text = _cut_plain(tokenizer, call, completion.token_ids, text)
        items = logprob_items(
            tokenizer, completion.token_ids, completion.logprobs, completion.top_logprobs, call
        )
        # The bytes each item adds to the text: an echoed prompt's own (decoded with its special tokens),
        # none for a generated special token, which the plain text leaves out.
        shown = None if items is None else shown_bytes(tokenizer, completion.token_ids)
        if prompts is not None and items is not None:
            items = prompts[i // call.body.n] + items
            shown = [bytes(item["bytes"]) for item in prompts[i // call.body.n]] + shown
        if call.reading is not None:  # read with its special tokens, which mark tool calls and turn ends
            reply = call.reading.parse(
                raw_pieces(
                    tokenizer,
                    completion.token_ids,
                    call.stops if stopped else None,
                    call.cleaned,
                    call.min_tokens,
                )
            )
            call.replies.append(reply)
            choices.append(reply_choice(i, reply, completion.finish_reason, items))
        else:
            choices.append(
                call.flavour.choice(
                    i, call.echo(tokenizer, i) + text, completion.finish_reason, items, shown=shown
                )
            )
        generated += len(completion.token_ids)
    metrics.finished(endpoint, "ok", call.prompt_tokens, generated, completions[0].metrics)
    return {**call.envelope(choices), "usage": call.usage(generated)}


# A choice of ``max_tokens=0`` (the prompt echoed and scored): no token, ended by its length.
_NOTHING_GENERATED = SimpleNamespace(
    text="", token_ids=[], finish_reason="length", logprobs=[], top_logprobs=[], metrics={}
)


def _cut_plain(tokenizer: Any, call: CompletionCall, token_ids: list[int], text: str) -> str:
    """A plain answer cut where the engine's check found its stop string (`replies.cut_plain`); for a
    tokenizer that cleans up spaces, whose pieces do not align, at the stop string in its text."""
    if call.cleaned is None:
        return cut_plain(token_pieces(tokenizer, token_ids), call.stops, call.min_tokens)
    held = call.min_tokens - 1  # the text of the tokens min_tokens held, where no stop ended the answer
    after = len(tokenizer.decode(token_ids[:held], skip_special_tokens=True)) if held > 0 else 0
    return cut_at_stop(text, call.stops, call.cleaned, after)


def _outcome(error: BaseException) -> str:
    """A request's outcome in the metrics when it ends by `error`: cancelled (its client went, the server
    stops) or an error (the engine failed it)."""
    return "cancelled" if isinstance(error, (asyncio.CancelledError, KeyboardInterrupt)) else "error"


@dataclass
class Piece:
    """A stretch of one choice's text to send: `delta` (possibly empty), its `finish` reason when the
    choice ends, and its logprob items."""

    index: int
    delta: str
    finish: str | None
    items: list[dict[str, Any]] | None
    shown: list[bytes] | None = None  # the bytes each item adds to the text (`shown_bytes`)


async def stream_pieces(
    served: Any, call: CompletionCall, metrics: Any, gone: Callable[[], Awaitable[bool]]
) -> AsyncIterator[Piece | None]:
    """The text of a streamed call as it comes, for any endpoint's framing: None first, once the first
    token is known (a request the engine refuses raises `APIError` before it), then `Piece`s (a stop
    string's possible start is held back until it is known not to be one). A client that disconnects
    (`gone`, asked at least every `CHECK_S`) or a closed generator cancels the requests; the pieces then
    just stop, and `call.streamed` stays False. `call.generated` counts the tokens."""
    tokenizer, endpoint = served.tokenizer, call.flavour.endpoint
    if call.scores_only:  # the echo is the whole answer: each choice just ends
        yield None
        for i in range(call.count):
            yield Piece(i, "", "length", [] if call.logprobs is not False else None)
        call.streamed = True
        metrics.finished(endpoint, "ok", call.prompt_tokens, 0, {})
        return
    start = time.perf_counter()
    events = astream(
        served.model, call.choice_prompts(), tokenizer=tokenizer, seed=call.seed,
        logprobs=call.logprobs, **call.kwargs,
    )  # fmt: skip
    try:
        with strict_calls(), openai_stops(call.min_tokens):  # planning runs here, at the first step
            first = await anext(events, None)
    except ValueError as error:  # refused: counted with the other 4xx (`RefusalCounter`)
        await events.aclose()
        raise APIError(400, str(error)) from error
    except BaseException as error:  # the client left while the request waited (`_until_disconnected`)
        await events.aclose()
        metrics.finished(endpoint, _outcome(error), call.prompt_tokens, 0, {})
        raise
    hold = max((len(s) for s in call.stops), default=1) - 1
    texts, sent = [""] * call.count, [0] * call.count
    # A reply read by its template is streamed with its special tokens, which the reader needs; a plain
    # one keeps them beside its text only to cut a stop string where the engine found it (`cut_plain`);
    # a tokenizer that cleans up spaces is cut on its own text, so it needs no second decode per token.
    raw = (
        [Detokenizer(tokenizer, skip_special_tokens=False) for _ in range(call.count)]
        if call.reading or (call.stops and call.cleaned is None)
        else None
    )
    pairs: list[list[tuple[str, str]]] = [[] for _ in range(call.count)]
    specials: list[list[tuple[int, int]]] = [[] for _ in range(call.count)]  # special tokens' raw spans
    ids: list[list[int]] = [[] for _ in range(call.count)]
    held_text = [0] * call.count  # the length of the text min_tokens held, as `_cut_plain` counts it
    skipped = special_tokens(tokenizer) if call.logprobs is not False else frozenset()
    first_token, outcome = time.perf_counter(), "cancelled"
    try:
        yield None
        pending = [] if first is None else [first]
        async for event in _chain(pending, _while_connected(events, gone)):
            i = event.index
            if event.token_id is None:  # the choice ended with no new token: its finish alone
                texts[i] += "" if call.reading else event.text or ""
                delta, sent[i] = texts[i][sent[i] :], len(texts[i])
                yield Piece(i, delta, event.finish_reason, None if call.logprobs is False else [])
                continue
            call.generated += 1
            if raw is not None:
                piece = (raw[i].add(event.token_id, done=event.finished), event.text or "")
                if call.reading and piece[0] and not piece[1]:
                    specials[i].append((len(texts[i]), len(texts[i]) + len(piece[0])))
                pairs[i].append(piece)
            texts[i] += pairs[i][-1][0] if call.reading else event.text or ""
            ids[i].append(event.token_id)
            if len(ids[i]) == call.min_tokens - 1 and call.cleaned is not None:  # (the text streamed so far
                # may hold back a few characters for the tokenizer's clean-up of spaces)
                held_text[i] = len(tokenizer.decode(ids[i], skip_special_tokens=True))
            if event.finished:
                final = texts[i]
                if event.finish_reason == "stop" and call.stops:
                    if call.reading:
                        final = "".join(cut_raw(pairs[i], call.stops, call.cleaned, call.min_tokens))
                    elif call.cleaned is None:
                        final = cut_plain(pairs[i], call.stops, call.min_tokens)
                    else:
                        final = cut_at_stop(final, call.stops, call.cleaned, held_text[i])
                delta, sent[i] = final[sent[i] :], len(final)
            else:
                safe = max(sent[i], len(texts[i]) - hold)
                # A stop string may begin inside a special token, which the cut then leaves out whole.
                span = next(((a, b) for a, b in reversed(specials[i]) if a < safe < b), None)
                safe = safe if span is None else max(sent[i], span[0])
                delta, sent[i] = texts[i][sent[i] : safe], safe
            logprob = None if event.logprob is None else [event.logprob]
            top = None if event.top_logprobs is None else [event.top_logprobs]
            items = logprob_items(tokenizer, [event.token_id], logprob, top, call)
            shown = None if items is None else shown_bytes(tokenizer, [event.token_id], skipped)
            if delta or event.finished or items:
                yield Piece(i, delta, event.finish_reason if event.finished else None, items, shown)
        outcome, call.streamed = "ok", True
    except ClientGone:  # its requests are cancelled: nothing more to send
        return
    finally:
        await events.aclose()
        times: dict[str, Any] = {"e2e_s": time.perf_counter() - start, "ttft_s": first_token - start}
        if call.generated > call.count:
            times["tpot_s"] = (time.perf_counter() - first_token) / (call.generated - call.count)
        metrics.finished(endpoint, outcome, call.prompt_tokens, call.generated, times)


async def stream_call(
    served: Any, call: CompletionCall, metrics: Any, gone: Callable[[], Awaitable[bool]]
) -> AsyncIterator[bytes]:
    """OpenAI's stream of chunks: the role first (chat), then text deltas as tokens come
    (`stream_pieces`), a finish_reason per choice, usage if asked, and ``[DONE]``. Nothing is sent
    before the first token is known, so a refused request is still a plain error."""
    flavour, pieces = call.flavour, stream_pieces(served, call, metrics, gone)
    options = call.body.stream_options
    continuous = options is not None and options.continuous_usage_stats

    usage_asked = options is not None and options.include_usage

    def chunk(choice: dict[str, Any]) -> bytes:
        body = call.envelope([choice], chunk=True)
        if continuous:  # vLLM's extra: every chunk carries the usage so far
            body["usage"] = call.usage(call.generated)
        elif usage_asked:  # OpenAI's: null on every chunk but the last, which carries it
            body["usage"] = None
        return _sse(body)

    try:
        await anext(pieces)
        if flavour is ChatFlavour:
            for i in range(call.count):
                yield chunk(flavour.delta(i, None, None, None))
        prompts = await echoed_prompt_items(served, call)
        sent = [b""] * call.count  # the bytes of each choice's logprob tokens so far (echo's included)

        def delta(
            index: int, text: str | None, finish: str | None, items: Any, shown: Any = None
        ) -> dict[str, Any]:
            part = flavour.delta(index, text, finish, items, sent[index], shown)
            if shown is None:
                shown = [bytes(item["bytes"]) for item in items or ()]
            sent[index] += b"".join(shown)
            return part

        for i in range(call.count if getattr(call.body, "echo", False) else 0):
            items = None if prompts is None else prompts[i // call.body.n]
            yield chunk(delta(i, call.echo(served.tokenizer, i), None, items))
        readers = [call.reading.stream() for _ in range(call.count)] if call.reading else None
        calls = [0] * call.count  # tool calls streamed per choice
        async for piece in pieces:
            assert piece is not None
            if readers is None:
                yield chunk(delta(piece.index, piece.delta, piece.finish, piece.items, piece.shown))
                continue
            for choice in read_piece(readers[piece.index], piece, calls):
                yield chunk(choice)
        if not call.streamed:
            return  # the client went: no closing chunks
        if usage_asked:
            yield _sse({**call.envelope([], chunk=True), "usage": call.usage(call.generated)})
        yield format_sse_event(data_str="[DONE]")
    finally:
        await pieces.aclose()


CHECK_S = 0.25  # how often a stream asks whether its client is still there


async def _while_connected(
    events: AsyncIterator[Any], gone: Callable[[], Awaitable[bool]]
) -> AsyncIterator[Any]:
    """`events` until they end or the client goes: asked every `CHECK_S` whether or not events come (a
    token that adds no text sends nothing, so a closed socket would not be noticed by a failed send).
    Going cancels the pending wait, which cancels the requests (`astream`), and raises `ClientGone`."""
    checked = time.monotonic()
    while True:
        step = asyncio.ensure_future(anext(events, _END))
        try:
            while not step.done():
                await asyncio.wait({step}, timeout=CHECK_S)
                if time.monotonic() - checked >= CHECK_S:
                    checked = time.monotonic()
                    if await gone():
                        raise ClientGone
        finally:
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
        item = step.result()
        if item is _END:
            return
        yield item


_END = object()


class ClientGone(Exception):
    """The client of a stream disconnected: the stream ends without its closing chunks."""


async def _chain(head: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in head:
        yield item
    async for item in rest:
        yield item


def _sse(payload: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, separators=(",", ":")))
