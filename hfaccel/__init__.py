"""hfaccel: paged-KV continuous batching for Hugging Face transformers, in one line.

import hfaccel
model = hfaccel.patch(model)      # model.generate(...) and pipelines now run on the engine
hfaccel.generate(model, prompts, tokenizer=tok, max_new_tokens=64)   # many prompts at once
hfaccel.release(model)            # free the KV cache (rebuilt by the next generate)
print(hfaccel.check(model))       # before patching: what of this model runs on the engine, and why not
await hfaccel.agenerate(model, prompts, tokenizer=tok)                 # the same, from asyncio
server = hfaccel.serve(model, tok, port=8000)   # an OpenAI-compatible server over the live model

Any number of threads and coroutines may call these at once: one engine loop per model serves them all,
in shared steps.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hfaccel.api import (
        Completion,
        RequestError,
        StreamEvent,
        agenerate,
        astream,
        check,
        generate,
        group_by_prompt,
        patch,
        release,
        reset_prefix_cache,
        stream,
        unpatch,
    )
    from hfaccel.config import EngineConfig
    from hfaccel.engine.loop import LoopClosed
    from hfaccel.notebook import engine_state, plot_cost_model, plot_run
    from hfaccel.server import serve

# Where each public name lives: imported at its first use, so that `import hfaccel` and the command
# line's `--help` do not wait for torch and transformers (about 3 s).
_HOMES = {
    **dict.fromkeys(
        (
            "Completion",
            "RequestError",
            "StreamEvent",
            "agenerate",
            "astream",
            "check",
            "generate",
            "group_by_prompt",
            "patch",
            "release",
            "reset_prefix_cache",
            "stream",
            "unpatch",
        ),
        "hfaccel.api",
    ),
    "EngineConfig": "hfaccel.config",
    "LoopClosed": "hfaccel.engine.loop",
    **dict.fromkeys(("engine_state", "plot_cost_model", "plot_run"), "hfaccel.notebook"),
}

__all__ = [
    "Completion",
    "EngineConfig",
    "LoopClosed",
    "RequestError",
    "StreamEvent",
    "agenerate",
    "astream",
    "check",
    "engine_state",
    "generate",
    "group_by_prompt",
    "patch",
    "plot_cost_model",
    "plot_run",
    "release",
    "reset_prefix_cache",
    "serve",
    "stream",
    "unpatch",
]
__version__ = "0.1.0"


# The parts a name of the package reaches (never `__main__`: importing it runs the command line).
_SUBPACKAGES = frozenset(
    {"api", "bench", "config", "distributed", "engine", "kernels", "notebook", "patches", "server"}
)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value  # found directly from now on
        return value
    # `serve` needs the serve extra (FastAPI, uvicorn, prometheus-client): imported when first used.
    if name == "serve":
        try:
            from hfaccel.server import serve
        except ImportError as error:
            raise ImportError(
                f"hfaccel.serve needs the serve extra: pip install 'hfaccel[serve]' ({error})"
            ) from error
        return serve
    if name in _SUBPACKAGES:  # what `import hfaccel` used to import, first (`hfaccel.engine.loop`, ...)
        importlib.import_module("hfaccel.api")
        return importlib.import_module(f"hfaccel.{name}")
    raise AttributeError(f"module 'hfaccel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
