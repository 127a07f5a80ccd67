"""Running the app under uvicorn: `serve` in the background of a notebook or training script (a handle
to stop it), or `run_forever` for ``python -m hfaccel serve`` (Ctrl-C and SIGTERM shut it down)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn

from hfaccel.api import patch, unpatch
from hfaccel.engine.openmp import release_thread_pool
from hfaccel.server.app import ServedModel, make_app
from hfaccel.server.sampling import Limits

GRACEFUL_SHUTDOWN_S = 10  # in-flight requests get this long to finish at shutdown, then are cancelled


class ServerHandle:
    """A server running in a background thread: `url`, `stop()`, and a context manager that stops it."""

    def __init__(
        self, server: uvicorn.Server, thread: threading.Thread, model: Any, patched_here: bool
    ) -> None:
        self._server, self._thread, self._model, self._patched_here = server, thread, model, patched_here
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.port = port

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = GRACEFUL_SHUTDOWN_S + 5) -> None:
        """Stop accepting requests, let in-flight ones finish (cancelled after the graceful period), and
        unpatch the model if `serve` patched it."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)
        if self._patched_here and getattr(self._model, "_hfaccel", None) is not None:
            unpatch(self._model)
            self._patched_here = False

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"hfaccel server at {self.url} ({'running' if self.running else 'stopped'})"


def serve(
    model: Any,
    tokenizer: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_id: str | None = None,
    limits: Limits | None = None,
    log_level: str = "warning",
    allowed_origins: str | Sequence[str] = (),
    **patch_options: Any,
) -> ServerHandle:
    """Serve the live `model` object over an OpenAI-compatible HTTP API, from a background thread, and
    return at once with a handle (``.url``, ``.stop()``, a context manager).

    The model keeps being yours: train it between requests, and the engine notices changed weights
    itself (no KV computed from old weights is served). It is patched for the server's lifetime if it
    was not (`patch_options` go to `hfaccel.patch`), and unpatched by ``stop()``. ``port=0`` picks a
    free port. `api_key` (default: ``HFACCEL_API_KEY``) makes every ``/v1`` call need
    ``Authorization: Bearer KEY``. `model_id` is the name clients pass as ``model`` (default: the
    model's ``name_or_path``). `allowed_origins`: the origins whose browser pages may call the server
    (CORS headers; ``("*",)``: any; none by default).
    """
    origins = allowed_origin_list(allowed_origins)
    served, patched_here = served_model(model, tokenizer, api_key, model_id, limits, patch_options)
    served.allowed_origins = origins
    config = uvicorn.Config(
        make_app(served),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="hfaccel-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            if patched_here:
                unpatch(model)
            raise OSError(
                f"the server could not start on {host}:{port} (the port in use? not this machine's address?)"
            )
        time.sleep(0.02)
    # The caller (a notebook's main thread, say) goes back to its own code or idles: the engine's loop
    # thread steps faster without this thread's OpenMP pool alive beside its own.
    release_thread_pool()
    return ServerHandle(server, thread, model, patched_here)


def run_forever(
    model: Any, tokenizer: Any, *, host: str, port: int, api_key: str | None, model_id: str | None,
    limits: Limits, log_level: str = "info", allowed_origins: str | Sequence[str] = (), **patch_options: Any,
) -> None:  # fmt: skip
    """Serve until Ctrl-C or SIGTERM (then uvicorn's graceful shutdown; a second one forces it). uvicorn
    runs in a thread of its own and this (main) thread steps the engine for every request: a torch op
    runs several times slower in a second thread while the main thread's OpenMP pool lives
    (`engine/loop.py`), and a server's main thread has nothing else to do."""
    origins = allowed_origin_list(allowed_origins)
    served, _ = served_model(model, tokenizer, api_key, model_id, limits, patch_options)
    served.allowed_origins = origins
    config = uvicorn.Config(
        make_app(served),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="hfaccel-serve", daemon=True)

    def shut_down(signum: int, frame: Any) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, shut_down) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread.start()
    try:
        model._hfaccel.get_loop(model).step_here(until=lambda: not thread.is_alive())
    finally:
        asked = server.should_exit  # a signal, not a failure, ended it
        server.should_exit = True
        thread.join(GRACEFUL_SHUTDOWN_S + 5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started and not asked:  # uvicorn's sys.exit(1) on a bind failure ends only its thread
        raise OSError(
            f"the server could not start on {host}:{port} (the port in use? not this machine's address?)"
        )


def allowed_origin_list(origins: str | Sequence[str]) -> tuple[str, ...]:
    """`allowed_origins` as a tuple ("*" or origins such as ``http://localhost:3000``, as a browser sends
    them: a scheme, no path); a single string is one origin. Raises ValueError naming a malformed one."""
    origins = (origins,) if isinstance(origins, str) else tuple(origins)
    for origin in origins:
        if origin != "*" and (
            not isinstance(origin, str) or "://" not in origin or "/" in origin.split("://", 1)[1]
        ):
            raise ValueError(
                f"allowed_origins: {origin!r} is not '*' or an origin such as http://localhost:3000 "
                "(a scheme and a host, no path)"
            )
    return origins


def served_model(
    model: Any,
    tokenizer: Any,
    api_key: str | None,
    model_id: str | None,
    limits: Limits | None,
    patch_options: dict[str, Any],
) -> tuple[ServedModel, bool]:
    """What the app serves, the model patched (True: patched here)."""
    if tokenizer is None:
        raise ValueError("serve needs the model's tokenizer (tokenizer=...): the server speaks text")
    patched_here = getattr(model, "_hfaccel", None) is None
    if patched_here or patch_options:
        patch(model, **patch_options)
    name = model_id or getattr(model.config, "name_or_path", None) or type(model).__name__
    key = api_key if api_key is not None else os.environ.get("HFACCEL_API_KEY") or None
    return ServedModel(model, tokenizer, str(name), limits or Limits(), key), patched_here
