"""What `hfaccel.patch` keeps on a model (`PatchState`), and how a call falls back to transformers'
original `generate`: one warning per reason, or an error under ``strict=True``."""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.limits import track_engine
from hfaccel.engine.loop import EngineLoop, LoopClosed
from hfaccel.patches.model_state import config_fingerprint
from hfaccel.patches.models import model_reason

# A seed for the sampled rows of the `generate` calls made in this context (row i gets seed + i), set by
# callers that run generate in worker threads and must not let the threads race for torch's global
# generator (a pipeline over a list: `patches/pipeline.py`); None: each row draws its own seed.
_call_seed: ContextVar[int | None] = ContextVar("hfaccel_call_seed", default=None)


@contextmanager
def seeded_calls(seed: int | None) -> Iterator[None]:
    """Within this block (in this thread), patched ``generate`` seeds its sampled rows from `seed`."""
    token = _call_seed.set(seed)
    try:
        yield
    finally:
        _call_seed.reset(token)


_strict_calls: ContextVar[bool] = ContextVar("hfaccel_strict_calls", default=False)


@contextmanager
def strict_calls() -> Iterator[None]:
    """Within this block (this thread or asyncio task), a call the engine does not serve raises
    ValueError with the reason instead of falling back to transformers' generate (as under
    ``patch(model, strict=True)``, for these calls only): a server must not run HF's generate on its
    event loop."""
    token = _strict_calls.set(True)
    try:
        yield
    finally:
        _strict_calls.reset(token)


@contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Torch's global generators (the CPU's and the CUDA devices' in use) seeded with `seed` inside the
    block and given back as they were after it; nothing where `seed` is None."""
    if seed is None:
        yield
        return
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
        if cuda:
            torch.manual_seed(seed)
        else:  # torch.manual_seed would also queue a seed for CUDA's first use, which fork_rng never undoes
            torch.default_generator.manual_seed(seed)
        yield


def call_seed() -> int | None:
    """The seed `seeded_calls` set for this context (None: rows draw their own)."""
    return _call_seed.get()


@dataclass
class PatchState:
    """What `hfaccel.patch` keeps on a model: the engine config, the engine and the loop that steps it
    for every caller, and what to restore."""

    config: EngineConfig
    original_generate: Callable[..., Any]
    instance_generate: Any  # `generate` from the instance __dict__ before patching, or None
    strict: bool = False  # unsupported options raise instead of falling back
    progress: bool = False  # progress bar inside model.generate
    engine: Engine | None = None
    engine_config: tuple | None = None  # `config_fingerprint` of the model's config the engine was built for
    loop: EngineLoop | None = None
    warned: set[str] = field(default_factory=set)
    temporary: bool = False  # patched by hfaccel.generate/stream for their own duration only
    temporary_users: int = 0  # such calls still running (the last one unpatches)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # Re-entrant: a fallback may call the same model's generate again in its own thread (HF's assisted
    # decoding with the model as its own assistant, a processor or criterion that generates).
    fallback_lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # Per thread: how deep it is in the original generate now (`inside_fallback`).
    _fallback_depth: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> PatchState:
        """A copy of the patched model (`copy.deepcopy`; TRL's `create_reference_model`) is patched as
        this one is, with an engine of its own, built at its first call: the engine, its loop and the
        locks are not copied. Its generate methods are bound to the copy (deepcopy rebinds them)."""
        import copy

        return PatchState(
            config=self.config,
            original_generate=copy.deepcopy(self.original_generate, memo),
            instance_generate=copy.deepcopy(self.instance_generate, memo),
            strict=self.strict,
            progress=self.progress,
            warned=set(self.warned),
            temporary=self.temporary,  # a copy made during a temporary patch ends with its first call
        )

    def __reduce__(self) -> Any:
        raise TypeError(
            "a model patched by hfaccel cannot be pickled (its engine runs a thread): call "
            "hfaccel.unpatch(model) first, or save its state_dict or save_pretrained"
        )

    def get_engine(self, model: torch.nn.Module) -> Engine:
        """The model's engine, (re)built if absent, if the model moved to another device or dtype, or if
        its config changed in place (`config_fingerprint`: the layers' kinds, windows and what else the
        engine was laid out for are checked again; for a config the engine cannot serve now it raises
        ValueError, where a call has already fallen back: `config_reason`).

        The engine watches the model's weights, adapters and config (`HFExecutor.state_token`) and
        forgets its prefix cache when they change. A rebuild closes the old engine's loop: requests still
        running there fail with `LoopClosed` (their callers get it raised) rather than wait on a cache the
        model no longer matches.
        """
        param = next(model.parameters())
        with self.lock:
            # The config is read under the lock: a thread that read it before another rebuilt must not
            # undo that rebuild.
            config = config_fingerprint(getattr(model, "config", None))
            engine = self.engine
            moved = engine is not None and (
                engine.device != param.device or engine.model_dtype != param.dtype
            )
            if moved:
                self.release(f"the model moved to {param.device} / {param.dtype}: its engine was rebuilt")
            elif engine is not None and config != self.engine_config:
                self.release("the model's config changed in place: its engine was rebuilt")
            if self.engine is None:
                if self.engine_config is not None and config != self.engine_config:
                    reason = model_reason(model)  # what `patch` checked, for the config as it is now
                    if reason is not None:
                        raise ValueError(f"the model's config changed after hfaccel.patch: {reason}")
                self.engine = Engine(model, self.config)
                track_engine(self.engine)  # held by the model it serves: a dropped model's lingers
                self.engine_config = config
            return self.engine

    def config_reason(self, model: torch.nn.Module) -> str | None:
        """Why the engine cannot serve `model` since its config changed in place after its engine was
        built (None: unchanged, or served): a call then falls back to transformers (or raises under
        strict), as `patch` would have refused it."""
        with self.lock:
            if (
                self.engine_config is None
                or config_fingerprint(getattr(model, "config", None)) == self.engine_config
            ):
                return None
        reason = model_reason(model)
        return None if reason is None else f"a config changed after hfaccel.patch ({reason})"

    def get_loop(self, model: torch.nn.Module) -> EngineLoop:
        """The loop that steps the model's (current) engine for every caller."""
        with self.lock:
            engine = self.get_engine(model)
            if self.loop is None or self.loop.engine is not engine:
                self.loop = EngineLoop(engine)
            return self.loop

    def run_original(self, *args: Any, seed: int | None = None, **kwargs: Any) -> Any:
        """The original `generate`, one call at a time: HF's generate is not documented as thread-safe
        (a static cache, for one, lives on the model), and concurrent callers of a patched model —
        pipeline workers included — may all fall back at once. With `seed` (default: the one
        `seeded_calls` set here), its draws come from torch's generators seeded with it, the caller's
        random state kept: a sampled call is reproducible whichever worker falls back first."""
        seed = call_seed() if seed is None else seed
        with self.fallback_lock, _seeded(seed):
            depth = self._fallback_depth
            depth.value = getattr(depth, "value", 0) + 1
            try:
                return self.original_generate(*args, **kwargs)
            finally:
                depth.value -= 1

    def inside_fallback(self) -> bool:
        """Whether this thread is running the original generate (a call from its processor or criterion
        then runs there too: waiting on the engine while holding `fallback_lock` would deadlock with an
        engine step whose own processor falls back)."""
        return getattr(self._fallback_depth, "value", 0) > 0

    def release(self, reason: str) -> None:
        """Drop the engine (and its KV cache); requests in flight on its loop fail with `reason`."""
        with self.lock:
            engine, loop, self.loop, self.engine = self.engine, self.loop, None, None
        if engine is not None:  # a background compile stops here and lets the engine go
            engine.runner.close()
        stopped = loop is None or loop.close(LoopClosed(reason))
        release = None if engine is None else getattr(engine.executor, "release_state_slots", None)
        # Its recurrent state rows go once no step of it runs (one still running keeps them until the next
        # engine's replace them), under the lock, so that no new engine installs its own meanwhile.
        if release is not None and stopped:
            with self.lock:
                release()

    def __repr__(self) -> str:
        engine = repr(self.engine) if self.engine is not None else "not built yet (built on first generate)"
        return f"hfaccel patch (strict={self.strict}): {self.config}\n  engine: {engine}"


def fall_back(state: PatchState, reason: str) -> None:
    """Raise under strict mode; otherwise warn once per kind of reason per model, its numbers aside (the
    call then runs on HF)."""
    if _strict_calls.get():
        raise ValueError(f"hfaccel does not serve {reason} here")
    if state.strict:
        raise ValueError(f"hfaccel (strict=True) does not serve {reason}; patch without strict to fall back")
    # Once per kind: prompts of 100 and of 101 tokens alike (numbers standing alone, not float32's or
    # an adapter's "a1").
    kind = re.sub(r"(?<![\w.])\d+(?!\w)", "#", reason)
    if kind in state.warned:
        return
    state.warned.add(kind)
    warnings.warn(
        f"hfaccel: {reason} is not served by the engine - this call falls back to transformers' original "
        "generate (no speed-up)",
        UserWarning,
        stacklevel=4,
    )
