"""An assistant's reply read into content, reasoning and tool calls, as `transformers serve` reads it.

How to read it is a `response_template` (where reasoning and tool calls open and close, how their content
parses): the tokenizer's own, else the one transformers serve falls back to for the model type (Qwen 2
and 3, Qwen 3.5 and Gemma 4 in transformers 5.24). A model with neither gets its text as generated, as
transformers serve gives it. The reading itself is transformers' (`parse_response`, `ResponseParser`),
on the text decoded with its special tokens, which mark a tool call or the end of a turn.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("hfaccel")

# The names templates give the reasoning field (transformers 5.17's fallbacks say "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class ToolCall:
    """One function call the reply makes; `arguments` is JSON text, as OpenAI's API carries it."""

    name: str
    arguments: str


@dataclass
class Reply:
    """A whole reply: its content (without reasoning or tool calls), reasoning, and tool calls; `parts`,
    the stream of it, in order."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    parts: list[ReplyPart] = field(default_factory=list)


@dataclass(frozen=True)
class ReplyPart:
    """A piece of a streamed reply: content text, reasoning text, or one whole tool call."""

    content: str = ""
    reasoning: str = ""
    tool_call: ToolCall | None = None


def response_template(tokenizer: Any, model: Any) -> dict[str, Any] | None:
    """The template a reply of `model` is read with, or None (the text is served as it is)."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return next((t for types, t in _fallbacks().items() if model_type in types), None)


def check_template(template: Any) -> None:
    """Raise ValueError, saying why, when transformers' parser refuses `template`."""
    from transformers.utils.chat_parsing import ResponseParser

    try:
        ResponseParser(template, prefix="")
    except Exception as error:  # its loader raises ValueError, KeyError, TypeError, re.error...
        raise ValueError(f"not a response template transformers can read: {error}") from error


@functools.cache
def _fallbacks() -> dict[tuple[str, ...], dict[str, Any]]:
    """transformers serve's own templates by model type (a table of its CLI, absent before 5.17)."""
    try:
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    except ImportError:
        return {}
    return _RESPONSE_TEMPLATE_FALLBACKS


def parse_reply(
    template: dict[str, Any],
    prompt: str,
    pieces: list[str],
    tools: list[dict[str, Any]] | None,
    special: tuple[str, ...] = (),
) -> Reply:
    """The whole reply, as the text each of its tokens adds (decoded with special tokens), read after
    `prompt` (the prompt's text, which may open a field such as ``<think>``) exactly as its stream is
    read (`ReplyStream`, fed the same pieces), so a streamed answer and a whole one agree."""
    stream = ReplyStream(template, prompt, tools, special)
    parts = [part for piece in pieces for part in stream.feed(piece)] + stream.finish()
    reasoning = [p.reasoning for p in parts if p.reasoning]
    return Reply(
        "".join(p.content for p in parts),
        "".join(reasoning) if reasoning else None,
        [p.tool_call for p in parts if p.tool_call is not None],
        parts,
    )


class ReplyStream:
    """One reply read as it comes: `feed` the text each token adds, then `finish`; each returns the parts
    read.

    - Content and reasoning come without the whitespace around them (leading whitespace dropped, trailing
      whitespace held until more text follows), as transformers' `parse_response` strips them.
    - Tool calls are read only when the request offered tools: otherwise their markup stays content, as
      OpenAI never answers with a call it did not offer.
    - A reply that stops being readable (a tool call's JSON that does not parse, a call cut by the token
      limit, a parser error) is served as text from the start of the field that failed on, with a
      warning: nothing of it is lost but the `special` tokens' texts (an end of turn), as a plain decode
      leaves them out.
    - A template the parser refuses raises here, before any text.
    """

    def __init__(
        self,
        template: dict[str, Any],
        prompt: str,
        tools: list[dict[str, Any]] | None,
        special: tuple[str, ...] = (),
    ) -> None:
        from transformers.utils.chat_parsing import ResponseParser

        if not tools:
            template = {
                **template,
                "fields": {k: v for k, v in template.get("fields", {}).items() if k != "tool_calls"},
            }
        self._special = special
        self._trims = {"content": _Trim(), "reasoning": _Trim()}
        self._parser = ResponseParser(template, prefix=prompt, tools=tools)
        self._closes = {
            name: field.get("close")
            for name, field in template.get("fields", {}).items()
            if isinstance(field, dict)
        }
        self._raw = ""  # the reply's text fed so far
        self._cursor = 0  # where the text read into parts ends, in `_raw`
        self._field_start = 0  # where the open field begins (its marker included)
        self._failed = False
        self._pending = self._parts(self._parser.initial_events, in_reply=False)  # fields the prompt opened

    def feed(self, text: str) -> list[ReplyPart]:
        return self._trimmed(self._feed(text))

    def finish(self) -> list[ReplyPart]:
        """What is left at the reply's end (a field closed by the end of the text)."""
        return self._trimmed(self._finish())

    def _trimmed(self, parts: list[ReplyPart]) -> list[ReplyPart]:
        out = []
        for part in parts:
            if part.tool_call is not None:
                out.append(part)
            elif part.reasoning and (text := self._trims["reasoning"].add(part.reasoning)):
                out.append(ReplyPart(reasoning=text))
            elif part.content and (text := self._trims["content"].add(part.content)):
                out.append(ReplyPart(content=text))
        return out

    def _feed(self, text: str) -> list[ReplyPart]:
        parts, self._pending = self._pending, []
        if not text:
            return parts
        self._raw += text
        if self._failed:
            return [*parts, *self._text(text)]
        try:
            events = self._parser.feed(text)
        except Exception as error:  # a third-party parser on a model's text: any failure falls back
            return parts + self._fail(error)
        return parts + self._parts(events)

    def _finish(self) -> list[ReplyPart]:
        parts, self._pending = self._pending, []
        if self._failed:
            return parts + self._text("", end=True)
        try:
            _, events = self._parser.finalize()
        except Exception as error:
            return parts + self._fail(error)
        return parts + self._parts(events)

    def _fail(self, error: Exception) -> list[ReplyPart]:
        logger.warning(
            "a reply stopped being readable as its response template says (%s): served as text from "
            "the field that failed on",
            error,
        )
        self._failed, self._held = True, ""
        return self._text(self._raw[self._field_start :])

    def _text(self, text: str, end: bool = False) -> list[ReplyPart]:
        """Text served as it is, but for the special tokens' texts (the start of one at the end waits for
        the next text)."""
        text, self._held = self._held + text, ""
        for token in self._special:
            text = text.replace(token, "")
        if not end:
            cut = max((k for t in self._special for k in range(1, len(t)) if text.endswith(t[:k])), default=0)
            text, self._held = text[: len(text) - cut], text[len(text) - cut :]
        return [ReplyPart(content=text)] if text else []

    def _parts(self, events: list[dict[str, Any]], in_reply: bool = True) -> list[ReplyPart]:
        """transformers' parser events as reply parts (as transformers serve's `response_events_to_chunks`:
        a structured field's raw text, its "dirty" chunks, shows only once it closes, parsed), keeping
        track of where in the reply each field begins."""
        parts = []
        for event in events:
            kind, name, text = event["type"], event.get("field"), event.get("text") or ""
            if kind == "region_open" and in_reply:
                self._field_start = self._cursor
            elif kind == "region_chunk" and text:
                if in_reply and (at := self._raw.find(text, self._cursor)) >= 0:
                    self._cursor = at + len(text)
                if event.get("dirty"):
                    continue
                if name in REASONING_FIELDS:
                    parts.append(ReplyPart(reasoning=text))
                elif name == "content":
                    parts.append(ReplyPart(content=text))
            elif kind == "region_close":
                close = self._closes.get(name)
                if in_reply and isinstance(close, str) and self._raw.startswith(close, self._cursor):
                    self._cursor += len(close)
                if name == "tool_calls":
                    call = _tool_call(event.get("value"))
                    if call is None:  # no function name: served as its text, not dropped
                        logger.warning("a tool call without a function name is served as text")
                        text = self._raw[self._field_start : self._cursor] if in_reply else ""
                        parts.append(ReplyPart(content=text or json.dumps(event.get("value"))))
                    else:
                        parts.append(ReplyPart(tool_call=call))
        return parts


class _Trim:
    """One kind of streamed text without the whitespace around it: leading whitespace dropped, trailing
    whitespace held until more text follows it (and so dropped at the end)."""

    def __init__(self) -> None:
        self.started, self.held = False, ""

    def add(self, text: str) -> str:
        text = self.held + (text if self.started else text.lstrip())
        body = text.rstrip()
        self.held = text[len(body) :]
        self.started = self.started or bool(body)
        return body


def _tool_call(value: Any) -> ToolCall | None:
    """``{"type": "function", "function": {"name", "arguments"}}`` (or the function alone) as a call."""
    if not isinstance(value, dict):
        return None
    function = value.get("function", value)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get("arguments", {})
    return ToolCall(function["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
