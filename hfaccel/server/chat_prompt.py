"""A chat request's prompt: the tokenizer's chat template over its messages, tools and
``chat_template_kwargs``, each mistake a 400 naming its field (a template that refuses the conversation
too, as Mistral's and Gemma's do when roles do not alternate)."""

from __future__ import annotations

import inspect
import json
from typing import Any

from jinja2 import TemplateError

from hfaccel.server.protocol import APIError, ChatMessage, message_text

# What the render takes besides apply_chat_template's own parameters (those are read off its signature).
_RENDER_ARGUMENTS = frozenset({"messages", "conversations", "tools", "documents", "add_generation_prompt"})


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids. Tools, or an assistant message's tool calls, that the template never shows
    the model are refused (rendered with and without them, the same text): the request would silently
    ignore them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "the model's tokenizer has no chat template: use /v1/completions", "messages")
    conversation = []
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":  # an assistant's may be tool calls
            raise APIError(400, f"a {message.role} message needs content", f"messages[{i}].content")
        entry = message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "parsed"})
        entry["content"] = message_text(message, i) or ""
        if message.tool_calls:
            entry["tool_calls"] = _template_tool_calls(message.tool_calls, f"messages[{i}].tool_calls")
        conversation.append(entry)
    if tools:
        _check_tools(tools)
    extra = dict(template_kwargs or {})
    taken = next((k for k in extra if k in _reserved(tokenizer)), None)
    if taken is not None:
        raise APIError(400, f"{taken!r} is set by the request itself", f"chat_template_kwargs.{taken}")
    text = _render(tokenizer, conversation, tools, extra)
    if tools and _render(tokenizer, conversation, None, extra) == text:
        raise APIError(400, "this model's chat template does not show tools to the model", "tools")
    called = next((i for i, entry in enumerate(conversation) if entry.get("tool_calls")), None)
    if called is not None:  # the same for the calls an assistant made: dropped silently, they are refused
        plain = [{k: v for k, v in entry.items() if k != "tool_calls"} for entry in conversation]
        if _render(tokenizer, plain, tools, extra) == text:
            raise APIError(
                400,
                "this model's chat template does not show an assistant message's tool calls to the model",
                f"messages[{called}].tool_calls",
            )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer: Any, conversation: list[dict[str, Any]], tools: Any, extra: dict[str, Any]) -> str:
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=True, tokenize=False, **extra
        )
    except TemplateError as error:  # the template's raise_exception: a conversation it does not take
        raise APIError(400, f"the chat template refused the conversation: {error}", "messages") from error
    except (TypeError, ValueError) as error:  # a keyword that collides with the renderer's own
        if extra:
            raise APIError(
                400, f"the chat template cannot take these: {error}", "chat_template_kwargs"
            ) from error
        if isinstance(error, TypeError):
            raise
        raise APIError(400, f"the chat template refused the conversation: {error}", "messages") from error


def _reserved(tokenizer: Any) -> frozenset[str]:
    """The keywords a request's own fields set: apply_chat_template's parameters and the render's."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(named) | _RENDER_ARGUMENTS


def _template_tool_calls(calls: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them: OpenAI's ``function.arguments`` JSON
    text parsed into the mapping templates iterate (as transformers serve does)."""
    converted = []
    for j, call in enumerate(calls):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, "a tool call needs a function with a name", f"{where}[{j}].function")
        arguments = parse_arguments(function.get("arguments", {}), f"{where}[{j}].function.arguments")
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return converted


def parse_arguments(arguments: Any, param: str) -> dict[str, Any]:
    """A tool call's arguments (OpenAI's JSON text, or already a mapping) as the mapping chat templates
    iterate; anything else is a 400 naming `param`."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            raise APIError(400, f"the arguments are not JSON ({error})", param) from error
    if not isinstance(arguments, dict):
        raise APIError(400, "the arguments must be a JSON object", param)
    return arguments


def _check_tools(tools: list[dict[str, Any]]) -> None:
    """Each tool is OpenAI's ``{"type": "function", "function": {"name": ..., ...}}``."""
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, f"only function tools are served, got {tool.get('type')!r}", f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(400, "a function tool needs a name", f"tools[{i}].function.name")
