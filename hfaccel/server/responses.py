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

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from fastapi.sse import format_sse_event
from pydantic import ConfigDict, Field, ValidationError

from hfaccel.server.chat_prompt import parse_arguments
from hfaccel.server.completions import (
    ChatFlavour,
    CompletionCall,
    compile_grammar,
    prepare_call,
    stream_pieces,
)
from hfaccel.server.protocol import (
    APIError,
    Body,
    ChatCompletionRequest,
    ChatMessage,
    JSONSchemaFormat,
    ResponseFormat,
)
from hfaccel.server.response_items import OutputStream, message_item

# Chat's field names in errors, as this endpoint's.
_FIELDS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}


class TextFormat(Body):
    """The Responses API's ``text.format``: chat's ``response_format`` with the schema's fields flat."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_chat(self) -> ResponseFormat:
        """Chat's ``response_format`` (a mistake in the schema's fields a 400 naming them here)."""
        if self.type != "json_schema":
            for name in ("name", "description", "json_schema", "strict"):
                if getattr(self, name) is not None:
                    field = "schema" if name == "json_schema" else name
                    raise APIError(
                        400, f"{field} is given with type json_schema only", f"text.format.{field}"
                    )
            return ResponseFormat(type=self.type)
        try:
            spec = JSONSchemaFormat(
                name=self.name,
                description=self.description,
                schema={} if self.json_schema is None else self.json_schema,
                strict=self.strict,
            )
        except ValidationError as error:
            where = error.errors()[0]["loc"]
            field = str(where[0]) if where else "name"
            raise APIError(400, error.errors()[0]["msg"], f"text.format.{field}") from error
        return ResponseFormat(type="json_schema", json_schema=spec)


class TextOptions(Body):
    format: TextFormat | None = None


class ResponsesRequest(Body):
    """The Responses API fields the server serves; any other is refused (400, naming it)."""

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
    """The chat messages of `instructions` and `input`: message items, and a tool conversation's items as
    transformers serve reads them (a ``function_call`` joins the assistant message before it as a tool
    call, a ``function_call_output`` is a ``tool`` message, a ``reasoning`` item goes to the next
    assistant message)."""
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    reasoning = None
    for i, item in enumerate(body.input):
        where, kind = f"input[{i}]", item.get("type", "message")
        if not isinstance(kind, str):
            raise APIError(400, f"an item's type is a string, got {kind!r}", f"{where}.type")
        if kind in _TOOL_ITEMS:
            _fields(item, where, _TOOL_ITEMS[kind])
        if kind == "reasoning":
            reasoning = "".join(_texts(item.get("content") or item.get("summary") or [], f"{where}.content"))
        elif kind == "function_call":
            parse_arguments(
                item["arguments"], f"{where}.arguments"
            )  # a mistake named by this endpoint's field
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not messages or messages[-1].role != "assistant":
                messages.append(ChatMessage(role="assistant", tool_calls=[], reasoning_content=reasoning))
            elif reasoning is not None:  # reasoning between the message and its call: the message's too
                before = messages[-1].reasoning_content
                messages[-1].reasoning_content = reasoning if before is None else f"{before}\n{reasoning}"
            reasoning = None
            messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
        elif kind == "message" and "role" not in item:
            raise APIError(
                400, "a message item needs a role (system, developer, user, assistant)", f"{where}.role"
            )
        elif kind == "message":
            _fields(item, where, ({"role"}, {"type", "content", "id", "status"}))
            content = item.get("content")
            if isinstance(content, list):
                content = " ".join(_texts(content, f"{where}.content"))
            if item["role"] not in ("system", "developer", "user", "assistant") or not isinstance(
                content, str
            ):
                raise APIError(
                    400, "a message needs a role (system, developer, user, assistant) and text", where
                )
            assistant = item["role"] == "assistant"
            if assistant and messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                # Text after a call in the same turn (a message item of its own in the output): the turn
                # is one assistant message, as the model wrote it.
                turn = messages[-1]
                turn.content = (turn.content or "") + content
                if reasoning is not None:
                    turn.reasoning_content = (
                        reasoning
                        if turn.reasoning_content is None
                        else f"{turn.reasoning_content}\n{reasoning}"
                    )
            else:
                messages.append(
                    ChatMessage(
                        role=item["role"], content=content, reasoning_content=reasoning if assistant else None
                    )
                )
            reasoning = None if assistant else reasoning
        else:
            raise APIError(
                400,
                f"only message, function_call, function_call_output and reasoning items are served, got {kind!r}",
                where,
            )
    if not messages:
        raise APIError(400, "the input holds no message", "input")
    return messages


# Each tool-conversation item's fields: those it needs, and those it may have.
_TOOL_ITEMS = {
    "function_call": ({"call_id", "name", "arguments"}, {"type", "id", "status"}),
    "function_call_output": ({"call_id", "output"}, {"type", "id", "status"}),
    "reasoning": (set(), {"type", "id", "status", "content", "summary", "encrypted_content"}),
}


def _fields(item: dict[str, Any], where: str, fields: tuple[set[str], set[str]]) -> None:
    needed, allowed = fields
    missing, extra = needed - set(item), set(item) - needed - allowed
    if missing or extra:
        what = f"needs {sorted(missing)}" if missing else f"fields {sorted(extra)} are not served"
        raise APIError(400, f"a {item.get('type', 'message')} item {what}", where)
    for name in needed:
        if not isinstance(item[name], str):
            raise APIError(400, f"{name} must be a string", f"{where}.{name}")


def _texts(parts: list[Any], where: str) -> list[str]:
    """The text of content parts (``input_text``, ``output_text``, ``reasoning_text``, ``summary_text``)."""
    if not isinstance(parts, list):
        raise APIError(400, f"content is a list of parts, got {type(parts).__name__}", where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"only text content parts are served, got {kind!r}", f"{where}[{j}]")
        texts.append(part["text"])
    return texts


_TEXT_PARTS = ("input_text", "output_text", "reasoning_text", "summary_text")


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as the chat template's (``{"type": "function", "function": ...}``)."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"only function tools are served, got {tool.get('type')!r}", f"tools[{i}]")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, "a function tool needs a name", f"tools[{i}].name")
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters")}
        converted.append({"type": "function", "function": function})
    return converted


async def prepare_response(served: Any, body: ResponsesRequest) -> CompletionCall:
    """The chat call a Responses request is, its ``text.format`` compiled: its errors name this
    endpoint's fields."""
    chat = ChatCompletionRequest(
        model=body.model,
        messages=_messages(body),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=_tools(body.tools),
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=None if body.text is None or body.text.format is None else body.text.format.as_chat(),
    )
    try:
        call = await asyncio.to_thread(prepare_call, served, chat, ResponsesFlavour)
        await compile_grammar(call)
    except APIError as error:
        name = _FIELDS.get(error.param or "", error.param)
        if name is not None:  # Responses' tools are flat: chat's tools[i].function.name is its tools[i].name
            name = re.sub(r"^(tools\[\d+\])\.function\.", r"\1.", name)
        message = error.message.replace(error.param or "\0", name or "")
        raise APIError(error.status, message, name, error.kind, error.headers) from error
    return call


def _format_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's ``text.format`` as the response object repeats it."""
    if body.text is None or body.text.format is None:
        return {"type": "text"}
    return body.text.format.model_dump(by_alias=True, exclude_none=True)


def response_object(
    body: ResponsesRequest,
    call: CompletionCall,
    output: list[dict[str, Any]] | None,
    status: str,
    generated: int,
) -> dict[str, Any]:
    """OpenAI's ``response`` object: in progress (``output`` None), completed, or incomplete at the length."""
    prompt = len(call.prompt_ids)
    return {
        "id": f"resp_{call.id}",
        "object": "response",
        "created_at": call.created,
        "status": status,
        "model": body.model,
        "output": output or [],
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "text": {"format": _format_echo(body)},
        "truncation": "disabled",
        "store": False,
        "metadata": body.metadata or {},
        "usage": None
        if output is None
        else {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated,
        },
    }


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def from_chat(body: ResponsesRequest, call: CompletionCall, chat: dict[str, Any]) -> dict[str, Any]:
    """The ``response`` object of a finished chat body (`completions.run_call`'s). A reply read by its
    template gives the items a stream of it gives (`OutputStream` over the same parts): reasoning, the
    message, function calls."""
    choice = chat["choices"][0]
    status = _status(choice["finish_reason"])
    if call.replies:
        out = OutputStream(call.id, lambda kind, **fields: b"")
        for part in call.replies[0].parts:
            out.part(part)
        out.finish(status)
        output = out.items
    else:
        output = [message_item(f"msg_{call.id}", choice["message"]["content"], status)]
    return response_object(body, call, output, status, chat["usage"]["completion_tokens"])


async def stream_response(
    served: Any,
    body: ResponsesRequest,
    call: CompletionCall,
    metrics: Any,
    gone: Callable[[], Awaitable[bool]],
) -> AsyncIterator[bytes]:
    """The Responses API's typed events around `completions.stream_pieces`, each output item announced
    when its first part comes (`response_items.OutputStream`); nothing is sent before the first token
    is known (a refused request stays a plain error); a client that goes gets no more."""
    pieces = stream_pieces(served, call, metrics, gone)
    number = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        number += 1
        data = json.dumps({"type": kind, "sequence_number": number - 1, **fields}, separators=(",", ":"))
        return format_sse_event(data_str=data, event=kind)

    out, reader = OutputStream(call.id, event), call.reading.stream() if call.reading else None
    try:
        await anext(pieces)
        yield event("response.created", response=response_object(body, call, None, "in_progress", 0))
        yield event("response.in_progress", response=response_object(body, call, None, "in_progress", 0))
        finish = None
        async for piece in pieces:
            assert piece is not None
            finish = piece.finish or finish
            if reader is None:
                events = out.text_delta(piece.delta) if piece.delta else []
            else:
                parts = reader.feed(piece.delta) + (reader.finish() if piece.finish else [])
                events = [e for part in parts for e in out.part(part)]
            for chunk in events:
                yield chunk
        if not call.streamed:
            return  # the client went
        for chunk in out.finish(_status(finish)):
            yield chunk
        final = response_object(body, call, out.items, _status(finish), call.generated)
        yield event(f"response.{final['status']}", response=final)
    finally:
        await pieces.aclose()
