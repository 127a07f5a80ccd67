"""The OpenAI-compatible FastAPI app over one model: every client's requests join the model's one
continuous batch through `hfaccel.agenerate` / `hfaccel.astream`.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models``, ``/health``, ``/tokenize``,
``/detokenize`` and ``/metrics``. Errors are OpenAI's error JSON with the status that fits (400 naming
the field, 401, 404, 413, 429 with Retry-After). A request the engine does not serve is refused (400
with the reason) rather than run on transformers' generate, which would block the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hfaccel.server.completions import (
    ChatFlavour,
    CompletionCall,
    TextFlavour,
    compile_grammar,
    prepare_call,
    run_call,
    stream_call,
)
from hfaccel.server.metrics import ServerMetrics
from hfaccel.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_text,
    error_body,
    field_path,
)
from hfaccel.server.responses import (
    ResponsesFlavour,
    ResponsesRequest,
    from_chat,
    prepare_response,
    stream_response,
)
from hfaccel.server.sampling import Limits

logger = logging.getLogger("hfaccel")


@dataclass
class ServedModel:
    """What one server serves: the model object (patched, or patched by the first request), its
    tokenizer, the id clients name it by, the limits, the API key (None: no key needed) and the origins
    whose browser pages may call it (CORS; none by default, as a browser's same-origin rule wants)."""

    model: Any
    tokenizer: Any
    model_id: str
    limits: Limits
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser origins answered with CORS headers ("*": any)

    def engine_stats(self) -> dict[str, Any] | None:
        state = getattr(self.model, "_hfaccel", None)
        engine = getattr(state, "engine", None)
        return engine.stats() if engine is not None else None

    def max_model_len(self) -> int:
        state = getattr(self.model, "_hfaccel", None)
        if state is not None:
            return state.get_engine(self.model).max_model_len
        from hfaccel.patches.models import max_model_len

        return max_model_len(self.model, None)


class Admission:
    """The bound on requests admitted and not yet finished: beyond `limit`, 429 with Retry-After."""

    def __init__(self, limit: int) -> None:
        self.limit, self.pending = limit, 0

    def enter(self, count: int) -> None:
        if self.pending + count > self.limit:
            raise APIError(
                429,
                f"the server has {self.pending} requests in flight (its limit is {self.limit}); retry shortly",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        self.pending += count

    def leave(self, count: int) -> None:
        self.pending -= count


class BodyLimit:
    """A body over `max_bytes` is a 413: one announced so (``Content-Length``) before it is read, one sent
    in chunks (no length announced) once its bytes pass the limit, as the route reads them. A plain ASGI
    middleware: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware``) wraps the app's ``receive`` so
    that ``request.is_disconnected()`` never sees a client that leaves while its request waits (found
    2026-11-26: a queued non-streamed request then ran to its end)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"the body is over {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            body = error_body(too_large, "invalid_request_error", None, 413)
            await JSONResponse(body, status_code=413)(scope, receive, send)
            return
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # the app's handler answers it (FastAPI passes it on)
                    raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)


SHUTTING_DOWN = "the server is shutting down: this request was cancelled before it finished"
CLIENT_LEFT = 499  # (nginx's status for a client that closed its connection: never sent)


class RefusalCounter:
    """Counts each generation request answered 4xx (refused before it ran: a bad body, a call the engine
    does not serve, no API key, too large, too many waiting; not a client that left, "cancelled") as
    outcome "rejected" in ``hfaccel_requests_total``, under the endpoint name the routes count those
    that ran by. A plain ASGI middleware, as `BodyLimit` (whose 413s it sees)."""

    ENDPOINTS: ClassVar[dict[str, str]] = {
        "/v1/chat/completions": ChatFlavour.endpoint,
        "/v1/completions": TextFlavour.endpoint,
        "/v1/responses": ResponsesFlavour.endpoint,
    }

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        endpoint = self.ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return

        async def counting(message: dict) -> None:
            status = message.get("status", 0) if message["type"] == "http.response.start" else 0
            if 400 <= status < 500 and status != CLIENT_LEFT:  # (a client gone: the route counted it)
                self.metrics.finished(endpoint, "rejected", 0, 0, {})
            await send(message)

        await self.app(scope, receive, counting)


class FailuresAsJSON:
    """A request whose route fails unexpectedly is answered with OpenAI's error JSON (500), its traceback
    logged, and its connection kept. Starlette's own handler for ``Exception`` re-raises after its
    answer, and uvicorn then drops the connection: a client's next request on it failed (found by a
    probe, 2026-11-27). A failure after the answer started (a stream) is re-raised.

    A request still running when the server stops, past its graceful period, is cancelled by uvicorn
    (nothing else cancels a request's task: a client that leaves is told by ``http.disconnect``). It is
    answered 503 in the same JSON, or, streamed, ends with an error event; uvicorn answered a bare 500
    or cut the stream, and logged a traceback per request (found by a probe, 2026-11-27)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def sending(message: dict) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body"))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:  # the server stops: the request's task is the one cancelled
            if ended:
                return
            body = error_body(SHUTTING_DOWN, "server_error", None, 503)
            if not started:
                await JSONResponse(body, status_code=503)(scope, receive, send)
                return
            # A stream under way (server-sent events): its last event says why it ends.
            event = f"data: {json.dumps(body)}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": False})
        except Exception as error:  # a Ctrl-C is not answered: it propagates
            if started:
                raise
            logger.exception("hfaccel serve: %s %s failed", scope.get("method"), scope.get("path"))
            message = f"the server failed on this request ({type(error).__name__}: {error})"
            await JSONResponse(error_body(message, "server_error", None, 500), status_code=500)(
                scope, receive, send
            )


def make_app(served: ServedModel) -> FastAPI:
    """The FastAPI app serving `served`."""
    app = FastAPI(title="hfaccel", summary=f"OpenAI-compatible server for {served.model_id}")
    metrics = ServerMetrics(served.engine_stats)
    admission = Admission(served.limits.max_pending)
    app.state.served, app.state.metrics, app.state.admission = served, metrics, admission

    async def authorized(request: Request) -> None:
        if served.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # The scheme is case-insensitive (RFC 9110 11.1); the key is compared in constant time.
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            given.strip().encode(), served.api_key.encode()
        ):
            raise APIError(
                401, "a valid API key is needed: Authorization: Bearer KEY", kind="authentication_error"
            )

    app.add_middleware(BodyLimit, max_bytes=served.limits.max_body_bytes)
    app.add_middleware(FailuresAsJSON)
    app.add_middleware(RefusalCounter, metrics=metrics)
    if served.allowed_origins:  # outermost: a preflight, and every answer (errors too), gets its headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(served.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # its location is a position in the body, not a field
            message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'a decode error')})"
            return JSONResponse(error_body(message, "invalid_request_error", None, 400), status_code=400)
        param = field_path(first.get("loc", ()), [e.get("loc", ()) for e in error.errors()])
        reason = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if param is None and "json" not in request.headers.get("content-type", ""):
            reason = "the body must be a JSON object, sent with Content-Type: application/json"
        message = f"{param}: {reason}" if param else reason
        return JSONResponse(error_body(message, "invalid_request_error", param, 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = (
            f"no route {request.method} {request.url.path}" if error.status_code == 404 else str(error.detail)
        )
        return JSONResponse(error_body(message, kind, None, error.status_code), status_code=error.status_code)

    def check_model(name: str | None) -> None:
        if name is not None and name != served.model_id:
            text = f"the model {name!r} does not exist here; this server serves {served.model_id!r}"
            raise APIError(404, text, "model", "not_found_error")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    def model_card() -> dict[str, Any]:
        card = {"id": served.model_id, "object": "model", "created": int(time.time()), "owned_by": "hfaccel"}
        return {**card, "max_model_len": served.max_model_len()}

    @app.api_route("/v1/models", methods=["GET", "HEAD"], dependencies=[Depends(authorized)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"], dependencies=[Depends(authorized)])
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        check_text(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            tokens = await asyncio.to_thread(ChatFlavour.prompt_ids, served.tokenizer, body.messages, None)
        else:
            encoded = await asyncio.to_thread(
                served.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens
            )
            tokens = encoded["input_ids"]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": served.max_model_len()}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = len(served.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": served.tokenizer.decode(body.tokens)}

    async def complete(
        request: Request,
        body: Any,
        call: CompletionCall,
        streamed: Callable[[], AsyncIterator[bytes]],
        answer: Callable[[dict[str, Any]], dict[str, Any]] = lambda result: result,
    ) -> Response:
        """Answer `call`, admitted (`prepared`): `streamed()`'s events, or `run_call`'s body through
        `answer`."""
        if body.stream:
            chunks = streamed()
            try:  # the first chunk once the first token is known: a refusal is still a plain error
                head = await _until_disconnected(request, anext(chunks))
            except BaseException:
                admission.leave(call.count)
                await chunks.aclose()
                raise
            return EventSourceResponse(_admitted_stream(head, chunks, admission, call))
        try:
            result = await _until_disconnected(request, run_call(served, call, metrics))
        finally:
            admission.leave(call.count)
        return JSONResponse(answer(result))

    async def prepared(prepare: Callable[[], Awaitable[CompletionCall]]) -> CompletionCall:
        """`prepare()`'s call, admitted: a request holds a seat while it is prepared (tokenized, its
        schema compiled), so a flood of them is answered 429 at once instead of queueing for the worker
        threads, and its choices hold theirs once it is (a 429 too beyond the limit)."""
        admission.enter(1)
        try:
            call = await prepare()
            admission.enter(call.count - 1)
        except BaseException:
            admission.leave(1)
            raise
        return call

    async def completion(request: Request, body: Any, flavour: Any) -> Response:
        check_model(body.model)
        check_text(body)

        async def prepare() -> CompletionCall:
            # Off the event loop, as every step that grows with the body: tokenizing (a 4 MB prompt takes
            # 2 s; the tokenizer lets go of the GIL) and the schema's compile.
            call = await asyncio.to_thread(prepare_call, served, body, flavour)
            await compile_grammar(call)
            return call

        call = await prepared(prepare)
        return await complete(
            request, body, call, lambda: stream_call(served, call, metrics, request.is_disconnected)
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await completion(request, body, ChatFlavour)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await completion(request, body, TextFlavour)

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def responses(request: Request, body: ResponsesRequest) -> Response:
        check_model(body.model)
        check_text(body)
        call = await prepared(lambda: prepare_response(served, body))
        return await complete(
            request,
            body,
            call,
            lambda: stream_response(served, body, call, metrics, request.is_disconnected),
            lambda chat: from_chat(body, call, chat),
        )

    return app


async def _admitted_stream(
    head: bytes, chunks: AsyncIterator[bytes], admission: Admission, call: CompletionCall
) -> AsyncIterator[bytes]:
    """The stream's chunks; its requests leave the admission count when it ends, however it ends (a
    client that disconnects cancels the stream, and with it the requests: `stream_call`)."""
    try:
        yield head
        async for chunk in chunks:
            yield chunk
    finally:
        admission.leave(call.count)
        await chunks.aclose()


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (and so its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                break
    finally:
        if not task.done():
            task.cancel()
            # Wait until it has unwound: a stream's generator must leave `anext` before anyone closes it.
            await asyncio.gather(task, return_exceptions=True)
    raise APIError(CLIENT_LEFT, "the client disconnected")
