"""A chat reply as transformers serve writes it: content, ``reasoning_content`` and ``tool_calls``, read by
the model's response template (`patches.reply_parsing`), whole or as stream chunks."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from hfaccel.api.detokenize import Detokenizer, special_texts
from hfaccel.patches.reply_parsing import Reply, ReplyPart, ReplyStream, parse_reply
from hfaccel.server.sampling import cut_at_stop

logger = logging.getLogger("hfaccel")


@dataclass
class ReplyReading:
    """How one request's reply is read: the response template, the prompt's text (it may open a field,
    such as ``<think>``) and the request's tools (their schemas type the arguments)."""

    template: dict[str, Any]
    prompt: str
    tools: list[dict[str, Any]] | None
    special: tuple[str, ...] = ()  # the special tokens' texts, left out of a reply served as text
    one_call: bool = False  # ``parallel_tool_calls: false``: the first tool call only, as vLLM serves it

    @classmethod
    def check(
        cls, tokenizer: Any, template: dict[str, Any], prompt: str, tools: Any, one_call: bool = False
    ) -> ReplyReading | None:
        """The reading of a request, or None (its reply served as text, with a warning) when the parser
        refuses the template: found before anything is generated or sent, whole or streamed alike."""
        special = special_texts(tokenizer)  # what a plain decode leaves out
        try:
            ReplyStream(template, prompt, tools, special)
        except Exception as error:  # transformers' template loader: ValueError, KeyError, re.error...
            logger.warning("the response template cannot be read (%s): replies are served as text", error)
            return None
        return cls(template, prompt, tools, special, one_call)

    def parse(self, pieces: list[str]) -> Reply:
        """The whole reply, as the text each token adds decoded with special tokens (`raw_pieces`)."""
        reply = parse_reply(self.template, self.prompt, pieces, self.tools, self.special)
        if self.one_call and len(reply.tool_calls) > 1:
            reply.tool_calls = reply.tool_calls[:1]
            reply.parts = _first_call_only(reply.parts, [0])
        return reply

    def stream(self) -> ReplyStream | FirstCallStream:
        stream = ReplyStream(self.template, self.prompt, self.tools, self.special)
        return FirstCallStream(stream) if self.one_call else stream


class FirstCallStream:
    """A `ReplyStream` that passes on its first tool call and drops the later ones (the model may still
    write them: the request asked for one, and gets one, as vLLM does with ``parallel_tool_calls:
    false``)."""

    def __init__(self, stream: ReplyStream) -> None:
        self._stream = stream
        self._calls = [0]

    def feed(self, text: str) -> list[ReplyPart]:
        return _first_call_only(self._stream.feed(text), self._calls)

    def finish(self) -> list[ReplyPart]:
        return _first_call_only(self._stream.finish(), self._calls)


def _first_call_only(parts: list[ReplyPart], seen: list[int]) -> list[ReplyPart]:
    """`parts` without the tool calls after the first (`seen[0]`: calls passed so far)."""
    kept = []
    for part in parts:
        if part.tool_call is not None:
            seen[0] += 1
            if seen[0] > 1:
                continue
        kept.append(part)
    return kept


def token_pieces(tokenizer: Any, token_ids: list[int]) -> list[tuple[str, str]]:
    """The text each token adds, with and without special tokens, as a stream reads it."""
    raw, plain = Detokenizer(tokenizer, skip_special_tokens=False), Detokenizer(tokenizer)
    last = len(token_ids) - 1
    return [(raw.add(t, done=k == last), plain.add(t, done=k == last)) for k, t in enumerate(token_ids)]


def raw_pieces(
    tokenizer: Any,
    token_ids: list[int],
    stops: list[str] | None = None,
    cleaned: list[str] | None = None,
    held: int = 0,
) -> list[str]:
    """The text each token adds, decoded with special tokens, as a stream reads it; with `stops` (a stop
    string ended the reply), cut where the first one begins (`cut_raw`)."""
    pieces = token_pieces(tokenizer, token_ids)
    return cut_raw(pieces, stops, cleaned, held) if stops else [r for r, _ in pieces]


def cut_raw(
    pieces: list[tuple[str, str]], stops: list[str], cleaned: list[str] | None = None, held: int = 0
) -> list[str]:
    """The raw pieces of `pieces` (each token's text with and without special tokens) up to where the
    first stop string begins in the raw text, as the engine's stop check (a decode that keeps special
    tokens, as transformers' `StopStringCriteria` reads token strings) found it; never inside a special
    token's text, which is then left out whole. `held`: ``min_tokens``, before which no stop string ended
    the reply (one that ends in the first ``held - 1`` tokens' text is not a stop)."""
    after = sum(len(r) for r, _ in pieces[: max(0, held - 1)])
    cut = len(cut_at_stop("".join(r for r, _ in pieces), stops, cleaned or (), after))
    out, seen = [], 0
    for raw, plain in pieces:
        if seen + len(raw) > cut:
            if plain:  # a text token: cut in it; a special token (no plain text) is left out
                out.append(raw[: cut - seen])
            break
        out.append(raw)
        seen += len(raw)
    return out


def cut_plain(pieces: list[tuple[str, str]], stops: list[str], held: int = 0) -> str:
    """The text without special tokens of `pieces` up to where the engine's stop check found the first
    stop string (`cut_raw`): where a stop string spans a special token, the plain text holds it earlier
    than the engine saw it, and cutting there would cut a whole answer short of its stream. Only for a
    tokenizer that does not clean up spaces, whose raw and plain pieces align token by token."""
    kept = cut_raw(pieces, stops, held=held)
    plain = [p for _, p in pieces[: len(kept)]]
    if kept and plain[-1] and len(kept[-1]) < len(pieces[len(kept) - 1][0]):
        plain[-1] = kept[-1]  # cut inside a text token, whose raw text is its plain text
    return "".join(plain)


def reply_choice(
    index: int, reply: Reply, finish: str | None, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """A chat choice of a read reply; finish_reason ``"tool_calls"`` when it calls any."""
    # With tool calls and no text, content is null, as OpenAI's and vLLM's are.
    content = None if reply.tool_calls and not reply.content else reply.content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call(None, call) for call in reply.tool_calls]
        finish = "tool_calls" if finish == "stop" else finish  # "length": the reply was cut
    lp = None if logprobs is None else {"content": logprobs}
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}


def read_piece(reader: ReplyStream | FirstCallStream, piece: Any, calls: list[int]) -> list[dict[str, Any]]:
    """A streamed piece (`completions.Piece`) read by its reply's template: one chunk choice per part
    (content, reasoning, a whole tool call), the piece's logprobs on the first, its finish on the last
    (``"tool_calls"`` when the choice called any); one empty delta when the piece completes no part but
    carries either. `calls` counts each choice's tool calls so far."""
    i = piece.index
    parts = reader.feed(piece.delta) + (reader.finish() if piece.finish else [])
    deltas = []
    for part in parts:
        deltas.append(_part_delta(part, calls[i]))
        calls[i] += part.tool_call is not None
    if not deltas and (piece.items or piece.finish):
        deltas.append({})
    finish = "tool_calls" if piece.finish == "stop" and calls[i] else piece.finish
    lp = None if piece.items is None else {"content": piece.items}
    last = len(deltas) - 1
    return [
        {
            "index": i,
            "delta": d,
            "finish_reason": finish if k == last else None,
            "logprobs": lp if k == 0 else None,
        }
        for k, d in enumerate(deltas)
    ]


def _part_delta(part: ReplyPart, calls_before: int) -> dict[str, Any]:
    if part.tool_call is not None:
        return {"tool_calls": [_tool_call(calls_before, part.tool_call)]}
    return {"reasoning_content": part.reasoning} if part.reasoning else {"content": part.content}


def call_id() -> str:
    """A new tool call's id, as OpenAI's look."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(index: int | None, call: Any) -> dict[str, Any]:
    """OpenAI's tool call; a stream's calls are numbered within their choice (`index`), a message's not."""
    function = {"name": call.name, "arguments": call.arguments}
    numbered = {} if index is None else {"index": index}
    return {**numbered, "id": call_id(), "type": "function", "function": function}
