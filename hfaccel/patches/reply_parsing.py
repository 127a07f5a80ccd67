"""An assistant's reply read into content, reasoning and tool calls, as `transformers serve` reads it.

How to read it is a `response_template` (where reasoning and tool calls open and close, how their content
parses): the tokenizer's own, else the one transformers serve falls back to for the model type (Qwen 2
and 3, Qwen 3.5 and Gemma 4 in transformers 5.24). A model with neither gets its text as generated, as
transformers serve gives it. The reading itself is transformers' `ResponseParser`, on the text decoded
with its special tokens, which mark a tool call or the end of a turn; a whole reply is read as its stream
is, so the two agree (docs/serve.md, "Reasoning and tool calls", says where this differs from
transformers' own reading of a whole reply).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import regex

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
        # Each kind of text without the special tokens' texts (a plain decode leaves them out), then
        # without the whitespace around it.
        self._filters = {"content": _SpecialTexts(special), "reasoning": _SpecialTexts(special)}
        self._trims = {"content": _Trim(), "reasoning": _Trim()}
        self._parser = ResponseParser(template, prefix=prompt, tools=tools)
        self._fields = {k: v for k, v in template.get("fields", {}).items() if isinstance(v, dict)}
        self._raw = ""  # the reply's text fed so far
        self._floor = 0  # where the last field closed, in `_raw`: a later field's marker starts past it
        self._field_start = 0  # where the open field begins (its marker included)
        self._open: str | None = None  # the field open now, in the reply
        self._failed = False
        self._pending = self._parts(self._parser.initial_events, in_reply=False)  # fields the prompt opened
        anchor = template.get("start_anchor")
        if anchor and anchor not in prompt:  # another chat format's template: the prompt is no reply
            self._pending = []

    def feed(self, text: str) -> list[ReplyPart]:
        return self._trimmed(self._feed(text))

    def finish(self) -> list[ReplyPart]:
        """What is left at the reply's end (a field closed by the end of the text)."""
        return self._trimmed(self._finish(), end=True)

    def _trimmed(self, parts: list[ReplyPart], end: bool = False) -> list[ReplyPart]:
        """The parts without special tokens' texts, trimmed, and those of one kind that follow each other
        joined (one a token). At the `end`, what the filters held back comes out too."""
        out: list[ReplyPart] = []

        def add(kind: str, text: str, last: bool = False, filtered: bool = False) -> None:
            text = self._trims[kind].add(text if filtered else self._filters[kind].add(text, end=last))
            if text and out and getattr(out[-1], kind):
                out[-1] = ReplyPart(**{kind: getattr(out[-1], kind) + text})
            elif text:
                out.append(ReplyPart(**{kind: text}))

        for part in parts:
            if part.tool_call is not None:
                for kind in ("reasoning", "content"):  # text held back before the call comes before it
                    add(kind, self._filters[kind].flush(), filtered=True)
                out.append(part)
            else:
                kind = "reasoning" if part.reasoning else "content"
                add(kind, getattr(part, kind))
        if end:
            for kind in ("reasoning", "content"):
                add(kind, "", last=True)
        return out

    def _feed(self, text: str) -> list[ReplyPart]:
        """A token's text goes to the parser whole; a longer text (a stream's held-back text) a character
        at a time, so that an error loses no event that came before it in the text (a field's opening)."""
        parts, self._pending = self._pending, []
        chunks = [text] if len(text) <= _WHOLE else list(text)
        for k, chunk in enumerate(chunks):
            if self._failed:
                rest = "".join(chunks[k:])
                self._raw += rest
                return [*parts, *self._text(rest)]
            self._raw += chunk
            try:
                events = self._parser.feed(chunk)
            except Exception as error:  # a third-party parser on a model's text: any failure falls back
                parts += self._fail(error)
                continue
            parts += self._parts(events)
        return parts

    def _finish(self) -> list[ReplyPart]:
        parts, self._pending = self._pending, []
        if self._failed:
            return parts
        calls = self._fields.get("tool_calls", {})
        if self._open == "tool_calls" and calls.get("content") != "json":
            # The reply ended inside a call whose parameters are markup (Qwen 3.5's XML): the parser would
            # keep the parameters it read, a call without the one cut. (A JSON call either parses whole,
            # served as vLLM's parser serves it, or fails.)
            return parts + self._fail(ValueError("the reply ended inside a tool call"), at_end=True)
        try:
            _, events = self._parser.finalize()
        except Exception as error:
            return parts + self._fail(error, at_end=True)
        return parts + self._parts(events)

    def _fail(self, error: Exception, at_end: bool = False) -> list[ReplyPart]:
        """Serve the open field (its marker included) and the rest as text. An error with no field open
        (a required field missing, at the end) leaves nothing unserved."""
        logger.warning(
            "a reply stopped being readable as its response template says (%s): served as text from "
            "the field that failed on",
            error,
        )
        self._failed = True
        if self._open is None or self._open in REASONING_FIELDS or self._open == "content":
            # What it read was served as it came, but for a marker the parser held back at the end (a
            # reply cut right after "<tool_call>": the field opens, and fails, only when finalized).
            return self._text(self._raw[self._held_marker() :]) if at_end else []
        return self._text(self._raw[self._field_start :])

    def _held_marker(self) -> int:
        """Where an opening marker the parser still holds begins (the reply's length: none). Outside any
        explicit field the parser watches every field's opening marker and opens a field only once its
        marker can grow no more, so a whole marker past where the last field closed is still held."""
        content = self._fields.get("content", {})
        explicit_content = "open" in content or "open_pattern" in content
        if self._open in REASONING_FIELDS or (self._open == "content" and explicit_content):
            return len(self._raw)  # inside an explicit field: only its close is watched
        starts = [
            start
            for name in self._fields
            if name != "content"
            for start, _ in self._markers(name, "open", self._floor)
        ]
        return min(starts, default=len(self._raw))

    def _marker_start(self, name: str, floor: int) -> int:
        """Where field `name`'s opening marker, which has just ended, begins: its latest match past `floor`
        (where the field before it ended)."""
        return max((start for start, _ in self._markers(name, "open", floor)), default=len(self._raw))

    def _close_end(self, name: str) -> int:
        """Where the open field `name`'s closing marker ends: its first match past the field's start."""
        return min(
            (end for _, end in self._markers(name, "close", self._field_start)), default=len(self._raw)
        )

    def _markers(self, name: str, kind: str, start: int) -> list[tuple[int, int]]:
        """The spans in the reply, past `start`, of field `name`'s ``open`` or ``close`` marker: its literals
        and its ``*_pattern``, as the template gives them."""
        spec = self._fields.get(name, {})
        literals = spec.get(kind)
        patterns = [regex.escape(t) for t in ([literals] if isinstance(literals, str) else literals or [])]
        if isinstance(spec.get(f"{kind}_pattern"), str):
            patterns.append(spec[f"{kind}_pattern"])
        text = self._raw[start:]
        return [(start + m.start(), start + m.end()) for p in patterns for m in regex.finditer(p, text)]

    def _text(self, text: str) -> list[ReplyPart]:
        """Text served as it is (only a reply that failed comes here; `_trimmed` leaves out the special
        tokens' texts, as from any content)."""
        return [ReplyPart(content=text)] if text else []

    def _parts(self, events: list[dict[str, Any]], in_reply: bool = True) -> list[ReplyPart]:
        """transformers' parser events as reply parts (as transformers serve's `response_events_to_chunks`:
        a structured field's raw text, its "dirty" chunks, shows only once it closes, parsed), keeping
        track of where in the reply the open field begins."""
        parts, floor = [], self._floor  # a field the next one's marker closes ends where that marker begins
        for event in events:
            kind, name, text = event["type"], event.get("field"), event.get("text") or ""
            if kind == "region_open" and in_reply:
                self._open, self._field_start = name, self._marker_start(name, floor)
            elif kind == "region_chunk" and text and not event.get("dirty"):
                if name in REASONING_FIELDS:
                    parts.append(ReplyPart(reasoning=text))
                elif name == "content":
                    parts.append(ReplyPart(content=text))
            elif kind == "region_close":
                if name == "tool_calls":
                    call = _tool_call(event.get("value"))
                    if call is None:  # no function name, or arguments not an object: its text, not dropped
                        logger.warning(
                            "a tool call without a function name, or whose arguments are not a JSON object, "
                            "is served as text"
                        )
                        text = self._raw[self._field_start : self._close_end(name)] if in_reply else ""
                        parts.append(ReplyPart(content=text or json.dumps(event.get("value"))))
                    else:
                        parts.append(ReplyPart(tool_call=call))
                if in_reply:
                    floor, self._open, self._floor = self._floor, None, len(self._raw)
        return parts


_WHOLE = 8  # characters fed to the parser at once: no field opens, fails and closes within them


class _SpecialTexts:
    """One kind of streamed text without the special tokens' texts (an end of turn inside an unclosed
    ``<think>``), as a plain decode leaves them out; the start of one at the end of a text waits for the
    next text, or the end."""

    def __init__(self, special: tuple[str, ...]) -> None:
        texts = sorted((t for t in special if t), key=len, reverse=True)
        self._pattern = regex.compile("|".join(map(regex.escape, texts))) if texts else None
        self._prefixes = {t[:k] for t in texts for k in range(1, len(t))}
        self._longest = max(map(len, self._prefixes), default=0)
        self._held = ""

    def flush(self) -> str:
        """What is held back, given up (the text that follows is not a special token's end)."""
        held, self._held = self._held, ""
        return held

    def add(self, text: str, end: bool = False) -> str:
        if self._pattern is None:
            return text
        text, self._held = self._pattern.sub("", self._held + text), ""
        if not end:
            cut = next(
                (k for k in range(min(self._longest, len(text)), 0, -1) if text[-k:] in self._prefixes), 0
            )
            text, self._held = text[: len(text) - cut], text[len(text) - cut :]
        return text


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
    """``{"type": "function", "function": {"name", "arguments"}}`` (or the function alone) as a call; None
    without a function name, or with arguments that are not a JSON object (as OpenAI's always are, and
    as a chat template reads them when the conversation goes on: such a call would be refused then)."""
    if not isinstance(value, dict):
        return None
    function = value.get("function", value)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # JSON text already (some models write the arguments as a string)
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(function["name"], arguments) if isinstance(parsed, dict) else None
    return ToolCall(function["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None
