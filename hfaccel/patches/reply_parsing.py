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
    """A whole reply: its content (without reasoning or tool calls), reasoning, and tool calls."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


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


@functools.cache
def _fallbacks() -> dict[tuple[str, ...], dict[str, Any]]:
    """transformers serve's own templates by model type (a table of its CLI, absent before 5.17)."""
    try:
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    except ImportError:
        return {}
    return _RESPONSE_TEMPLATE_FALLBACKS


def parse_reply(
    tokenizer: Any,
    template: dict[str, Any],
    prompt: str,
    text: str,
    plain: str,
    tools: list[dict[str, Any]] | None,
) -> Reply:
    """`text` (the reply decoded with special tokens) read after `prompt` (the prompt's text, which may
    open a field such as ``<think>``). A reply the template cannot read (a tool call cut by the token
    limit, JSON that does not parse) is served as `plain` (its text without special tokens), with a
    warning."""
    try:
        parsed = tokenizer.parse_response(text, template, prefix=prompt, tools=tools)
    except (ValueError, RuntimeError, KeyError) as error:
        logger.warning(
            "the reply could not be read as its response template says (%s): served as text", error
        )
        return Reply(plain)
    reasoning = next((parsed[f] for f in REASONING_FIELDS if parsed.get(f) is not None), None)
    calls = [_tool_call(value) for value in parsed.get("tool_calls") or []]
    return Reply(parsed.get("content") or "", reasoning, [c for c in calls if c is not None])


class ReplyStream:
    """One streamed reply read as it comes: `feed` the text each token adds, then `finish`."""

    def __init__(self, template: dict[str, Any], prompt: str, tools: list[dict[str, Any]] | None) -> None:
        from transformers.utils.chat_parsing import ResponseParser

        self._parser = ResponseParser(template, prefix=prompt, tools=tools)
        self._pending = _parts(self._parser.initial_events)  # fields the prompt opened and wrote

    def feed(self, text: str) -> list[ReplyPart]:
        parts, self._pending = self._pending, []
        return parts + (_parts(self._parser.feed(text)) if text else [])

    def finish(self) -> list[ReplyPart]:
        """What is left at the reply's end (a field closed by the end of the text)."""
        try:
            _, events = self._parser.finalize()
        except (ValueError, RuntimeError) as error:  # ended inside a field: a tool call cut by the limit
            logger.warning("a streamed reply ended inside a field of its response template (%s)", error)
            events = []
        parts, self._pending = self._pending, []
        return parts + _parts(events)


def _parts(events: list[dict[str, Any]]) -> list[ReplyPart]:
    """transformers' parser events as reply parts (as transformers serve's `response_events_to_chunks`):
    a structured field's raw text ("dirty" chunks) shows only once it closes, parsed."""
    parts = []
    for event in events:
        name = event.get("field")
        if event["type"] == "region_chunk" and not event.get("dirty") and event.get("text"):
            if name in REASONING_FIELDS:
                parts.append(ReplyPart(reasoning=event["text"]))
            elif name == "content":
                parts.append(ReplyPart(content=event["text"]))
        elif event["type"] == "region_close" and name == "tool_calls":
            call = _tool_call(event.get("value"))
            if call is not None:
                parts.append(ReplyPart(tool_call=call))
    return parts


def _tool_call(value: Any) -> ToolCall | None:
    """``{"type": "function", "function": {"name", "arguments"}}`` (or the function alone) as a call."""
    if not isinstance(value, dict):
        return None
    function = value.get("function", value)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get("arguments", {})
    return ToolCall(function["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
