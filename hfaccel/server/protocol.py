"""The OpenAI request bodies the server takes, as pydantic models, and OpenAI's error JSON.

A field a request sets that is not here is refused (400, naming it), not ignored: a client that asks for
something the server does not do must not get output that silently ignored it. Fields that change
nothing about the output (`user`, `metadata`, ...) are accepted.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class Body(BaseModel):
    """A request body or a part of one: strict types (``"max_tokens": "5"`` is refused, not read as 5),
    finite numbers, unknown fields refused; a field sent as null is not set (OpenAI's fields are nullable,
    and clients that write every field send null for those they leave unset). A required field stays
    required."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(value is None for value in data.values()):
            required = {name for name, info in cls.model_fields.items() if info.is_required()}
            return {key: value for key, value in data.items() if value is not None or key in required}
        return data


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Body):
    """What chat and text completions share: OpenAI's sampling fields and vLLM's extras. Types are strict,
    as OpenAI's are: ``"max_tokens": "5"`` or ``true`` is refused, not read as 5 or 1."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # OpenAI: an int64
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: none, as vLLM reads them
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    # Accepted, and without effect on the output.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):  # `stream` is validated first
            raise ValueError("stream_options is only allowed with stream: true")
        return value


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's, as this server answered it
    # What clients send back of an earlier answer (the openai client sets them to null; its stream
    # helper's message also has parsed).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None
    parsed: None = None


class JSONSchemaFormat(Body):
    """OpenAI's ``response_format.json_schema``: the schema the answer must follow."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's and transformers serve's extra: keyword arguments of the chat template (`enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    # A list of prompts (strings or token lists) is OpenAI's batch: n choices for each, in turn.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)  # 0: the prompt scored (with echo), nothing generated
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


class APIError(Exception):
    """An error answered with OpenAI's error JSON and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.status)


def unreadable(value: Any, path: str = "") -> tuple[str, str] | None:
    """Where the first value of a request body (parsed JSON) that no text or JSON can carry on is, as (a
    field path, what it is), or None: a lone UTF-16 surrogate (JSON carries one, ``"\\ud800"``, but it is
    no text: no encoding or tokenizer takes it) or a number that is not finite (Python's JSON reads
    ``NaN``, which no JSON answer can repeat), in fields of any type (``metadata``, a tool's schema)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body", "surrogate"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path or "body", "number")
    if isinstance(value, dict):
        for key, item in value.items():
            if unreadable(key) is not None:  # the key itself: name the object that holds it
                return path or "body", "surrogate"
            found = unreadable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = unreadable(item, f"{path}[{i}]")
            if found:
                return found
    return None


def check_text(body: BaseModel) -> None:
    """A 400 naming the first field of `body` that holds a lone surrogate or a number that is not finite
    (`unreadable`)."""
    found = unreadable(body.model_dump(by_alias=True, exclude_none=True))
    if found is None:
        return
    where, what = found
    if what == "number":
        raise APIError(400, "a number that is not finite (NaN or infinity), which JSON does not carry", where)
    raise APIError(
        400, "the text holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is no character", where
    )


def field_path(location: Any, others: Any = ()) -> str | None:
    """A pydantic error's location as the client wrote the field: ``stop``, not ``body.stop.str``;
    ``messages[0].content``, not ``messages.0.content``. A union's member (``str``, ``list[int]``) is
    told apart from a field by `others`, the locations of the request's other errors: pydantic reports
    each member's, which agree up to the union and differ at the member."""
    location, others = tuple(location), [tuple(other) for other in others]
    top = 1 if location[:1] == ("body",) else 0  # the request's own fields: never a union's members
    path = ""
    for k, part in enumerate(location):
        member = (
            k > top
            and part not in field_names()
            and any(other[:k] == location[:k] and len(other) > k and other[k] != part for other in others)
        )
        if isinstance(part, int):
            path += f"[{part}]"
        elif not (k == 0 and part == "body") and not member:
            path += f".{part}" if path else str(part)
    return path or None


@functools.cache
def field_names() -> frozenset[str]:
    """Every field name (and alias) of the request models: a location part that is one names a field,
    never a union's member (two errors in sibling fields agree up to them and differ there too)."""
    names: set[str] = set()
    classes = [Body]
    while classes:
        model = classes.pop()
        classes.extend(model.__subclasses__())
        for name, field in model.model_fields.items():
            names.update(n for n in (name, field.alias) if n)
    return frozenset(names)


def error_body(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def message_text(message: ChatMessage, index: int) -> str | None:
    """A message's content as text: a string, or the text parts of a list joined by a space, as
    transformers serve joins them for a text model (other parts are refused)."""
    if message.content is None or isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.get("type") != "text":
            raise APIError(400, f"only text content parts are served, got {part.get('type')!r}", where)
        if not isinstance(part.get("text"), str):
            raise APIError(
                400, f"a text part needs a string 'text', got {part.get('text')!r}", f"{where}.text"
            )
        texts.append(part["text"])
    return " ".join(texts)
