"""The output items of a Responses API answer: a reasoning item, the assistant message and its function
calls, as transformers serve writes them, each announced and completed by typed stream events as a reply
is read (`OutputStream`); a whole answer's items are the same stream's, its events unsent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hfaccel.patches.reply_parsing import ReplyPart, ToolCall
from hfaccel.server.replies import call_id


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The assistant message; no content part while it is only announced (``text`` None)."""
    parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": parts}


def function_call_item(call_id: str, call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"fc_{call_id.removeprefix('call_')}",
        "call_id": call_id,
        "type": "function_call",
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


class OutputStream:
    """The items of one streamed answer, in order, each announced (``output_item.added``) when its first
    part comes and completed (``output_item.done``) before the next one is announced, as OpenAI's
    stream goes: reasoning, a message, a function call, text after it in a message of its own. A reply
    of function calls only has no message item; one with nothing at all has an empty message.
    `emit(kind, **fields)` makes an event."""

    def __init__(self, response_id: str, emit: Callable[..., bytes]) -> None:
        self.id, self.emit = response_id, emit
        self.items: list[dict[str, Any]] = []  # by output index, as each is completed or announced
        self.reasoning: int | None = None  # the open reasoning item's index
        self.message: int | None = None  # the open message's index
        self.text = ""
        self.reasoning_text = ""

    def part(self, part: ReplyPart) -> list[bytes]:
        if part.reasoning:
            return self._reasoning(part.reasoning)
        if part.tool_call is not None:
            return self._tool_call(part.tool_call)
        return self.text_delta(part.content) if part.content else []

    def text_delta(self, text: str) -> list[bytes]:
        if self.message is None:  # a message after a call starts at its first non-space, as any text does
            text = text.lstrip()
            if not text:
                return []
        events = self._open_message()
        self.text += text
        where = {"item_id": self.items[self.message]["id"], "output_index": self.message, "content_index": 0}
        return [*events, self.emit("response.output_text.delta", **where, delta=text, logprobs=[])]

    def finish(self, status: str) -> list[bytes]:
        """Complete every open item (announcing an empty message if no message or call came); the
        final items are then `items`."""
        events = self._close_reasoning()
        if self.message is None and not any(i["type"] in ("message", "function_call") for i in self.items):
            events += self._open_message()
        return events + self._close_message(status)

    def _reasoning(self, text: str) -> list[bytes]:
        events = self._close_message()
        if self.reasoning is None:
            self.reasoning, self.reasoning_text = len(self.items), ""
            item = reasoning_item(self._next_id("rs", "reasoning"), None, "in_progress")
            self.items.append(item)
            events.append(self.emit("response.output_item.added", output_index=self.reasoning, item=item))
        self.reasoning_text += text
        where = {
            "item_id": self.items[self.reasoning]["id"],
            "output_index": self.reasoning,
            "content_index": 0,
        }
        return [*events, self.emit("response.reasoning_text.delta", **where, delta=text)]

    def _next_id(self, prefix: str, kind: str) -> str:
        """The id of the answer's next item of `kind`: ``{prefix}_{id}``, then ``_1``, ``_2``..."""
        count = sum(item["type"] == kind for item in self.items)
        return f"{prefix}_{self.id}" + (f"_{count}" if count else "")

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning is None:
            return []
        index, self.reasoning = self.reasoning, None
        item = reasoning_item(self.items[index]["id"], self.reasoning_text)
        self.items[index] = item
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self.emit("response.reasoning_text.done", **where, text=self.reasoning_text),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

    def _open_message(self) -> list[bytes]:
        events = self._close_reasoning()
        if self.message is not None:
            return events
        self.message, self.text = len(self.items), ""
        item = message_item(self._next_id("msg", "message"), None, "in_progress")
        self.items.append(item)
        empty = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": item["id"], "output_index": self.message, "content_index": 0}
        return [
            *events,
            self.emit("response.output_item.added", output_index=self.message, item=item),
            self.emit("response.content_part.added", **where, part=empty),
        ]

    def _close_message(self, status: str = "completed") -> list[bytes]:
        if self.message is None:
            return []
        index, self.message = self.message, None
        item = message_item(self.items[index]["id"], self.text, status)
        self.items[index] = item
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return [
            self.emit("response.output_text.done", **where, text=self.text, logprobs=[]),
            self.emit("response.content_part.done", **where, part=part),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

    def _tool_call(self, call: ToolCall) -> list[bytes]:
        events = self._close_reasoning() + self._close_message()
        index, item = len(self.items), function_call_item(call_id(), call)
        self.items.append(item)
        return [
            *events,
            self.emit("response.output_item.added", output_index=index, item=item),
            self.emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]
