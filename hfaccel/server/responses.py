"""``/v1/responses``: OpenAI's Responses API over the chat path.

A request's ``input`` (a string, or messages with text content) and ``instructions`` become chat
messages, so the prompt, the sampling arguments and the engine call are exactly chat's
(`completions.prepare_call`); only the answer's shape differs: a ``response`` object with one output
message, or its stream of typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it). Nothing is
stored (``store`` is accepted, and every response says ``"store": false``), so
``previous_response_id`` is refused, not ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi.sse import format_sse_event
from pydantic import BaseModel, ConfigDict, Field

from hfaccel.server.completions import ChatFlavour, CompletionCall, prepare_call, stream_pieces
from hfaccel.server.protocol import APIError, ChatCompletionRequest, ChatMessage

# Chat's field names in errors, as this endpoint's.
_FIELDS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The Responses API fields the server serves; any other is refused (400, naming it)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None
    # Accepted, and without effect on the output (nothing is stored either way).
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None


class ResponsesFlavour(ChatFlavour):
    """Chat's prompt and sampling; counted under its own endpoint in the metrics."""

    endpoint = "responses"


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.get("type", "message") != "message" or "role" not in item:
            raise APIError(400, f"only message items are served, got {item.get('type')!r}", where)
        extra = set(item) - {"type", "role", "content", "id", "status"}
        if extra:
            raise APIError(400, f"message fields {sorted(extra)} are not served", where)
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                    raise APIError(
                        400, f"only text content parts are served, got {kind!r}", f"{where}.content[{j}]"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if item["role"] not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
            raise APIError(400, "a message needs a role (system, developer, user, assistant) and text", where)
        messages.append(ChatMessage(role=item["role"], content=content))
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as the chat template's (``{"type": "function", "function": ...}``)."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or "name" not in tool:
            raise APIError(400, f"only function tools are served, got {tool.get('type')!r}", f"tools[{i}]")
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters")}
        converted.append({"type": "function", "function": function})
    return converted


def prepare_response(served: Any, body: ResponsesRequest) -> CompletionCall:
    """The chat call a Responses request is: its errors name this endpoint's fields."""
    chat = ChatCompletionRequest(
        model=body.model,
        messages=_messages(body),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=_tools(body.tools),
        tool_choice=body.tool_choice,
    )
    try:
        call = prepare_call(served, chat, ResponsesFlavour)
    except APIError as error:
        name = _FIELDS.get(error.param or "", error.param)
        if name is not None:  # Responses' tools are flat: chat's tools[i].function.name is its tools[i].name
            name = re.sub(r"^(tools\[\d+\])\.function\.", r"\1.", name)
        message = error.message.replace(error.param or "\0", name or "")
        raise APIError(error.status, message, name, error.kind, error.headers) from error
    return call


def response_object(
    body: ResponsesRequest, call: CompletionCall, text: str | None, finish: str | None, generated: int
) -> dict[str, Any]:
    """OpenAI's ``response`` object: in progress (``text`` None), completed, or incomplete at the length."""
    status = "in_progress" if text is None else ("incomplete" if finish == "length" else "completed")
    output = [] if text is None else [_message(call, text, status)]
    prompt = len(call.prompt_ids)
    return {
        "id": f"resp_{call.id}",
        "object": "response",
        "created_at": call.created,
        "status": status,
        "model": body.model,
        "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "store": False,
        "metadata": body.metadata or {},
        "usage": None
        if text is None
        else {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated,
        },
    }


def _message(call: CompletionCall, text: str | None, status: str) -> dict[str, Any]:
    """The output message; no content part while it is only announced (``text`` None)."""
    parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "id": f"msg_{call.id}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def from_chat(body: ResponsesRequest, call: CompletionCall, chat: dict[str, Any]) -> dict[str, Any]:
    """The ``response`` object of a finished chat body (`completions.run_call`'s)."""
    choice = chat["choices"][0]
    text, generated = choice["message"]["content"], chat["usage"]["completion_tokens"]
    return response_object(body, call, text, choice["finish_reason"], generated)


async def stream_response(
    served: Any,
    body: ResponsesRequest,
    call: CompletionCall,
    metrics: Any,
    gone: Callable[[], Awaitable[bool]],
) -> AsyncIterator[bytes]:
    """The Responses API's typed events around `completions.stream_pieces`; nothing is sent before the
    first token is known (a refused request stays a plain error); a client that goes gets no more."""
    pieces = stream_pieces(served, call, metrics, gone)
    number = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        number += 1
        data = json.dumps({"type": kind, "sequence_number": number - 1, **fields}, separators=(",", ":"))
        return format_sse_event(data_str=data, event=kind)

    item = {"item_id": f"msg_{call.id}", "output_index": 0}
    try:
        await anext(pieces)
        yield event("response.created", response=response_object(body, call, None, None, 0))
        yield event("response.in_progress", response=response_object(body, call, None, None, 0))
        yield event("response.output_item.added", output_index=0, item=_message(call, None, "in_progress"))
        empty = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.content_part.added", **item, content_index=0, part=empty)
        text, finish = "", None
        async for piece in pieces:
            assert piece is not None
            text, finish = text + piece.delta, piece.finish or finish
            if piece.delta:
                yield event(
                    "response.output_text.delta", **item, content_index=0, delta=piece.delta, logprobs=[]
                )
        if not call.streamed:
            return  # the client went
        final = response_object(body, call, text, finish, call.generated)
        yield event("response.output_text.done", **item, content_index=0, text=text, logprobs=[])
        part = {"type": "output_text", "text": text, "annotations": []}
        yield event("response.content_part.done", **item, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=final["output"][0])
        yield event(f"response.{final['status']}", response=final)
    finally:
        await pieces.aclose()
