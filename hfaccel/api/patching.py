"""A model's patch lifecycle: `patch`, `unpatch`, `release`, `reset_prefix_cache`, and the temporary
patch an unpatched model gets for one `hfaccel.generate` call."""

from __future__ import annotations

import gc
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hfaccel.config import EngineConfig, is_draft_model
from hfaccel.distributed.dp import setup_data_parallel
from hfaccel.distributed.layout import parallel_layout
from hfaccel.distributed.pp import check_pipeline_size, setup_pipeline_parallel
from hfaccel.patches import layer_loop
from hfaccel.patches.attention import register_attention, restore_attention
from hfaccel.patches.ep_modules import setup_expert_parallel
from hfaccel.patches.generate import patched_generate
from hfaccel.patches.models import check_engine_config, check_model
from hfaccel.patches.patch_state import PatchState
from hfaccel.patches.pipeline import install_pipeline_batching
from hfaccel.patches.recurrent import restore_mixers
from hfaccel.patches.tp_plan import setup_tensor_parallel
from hfaccel.patches.weights import apply_weights, planned_dtype


def patch(
    model: Any,
    config: EngineConfig | None = None,
    *,
    strict: bool | None = None,
    progress: bool | None = None,
    tensor_parallel_size: int | None = None,
    device_mesh: Any = None,
    sequence_parallel: bool | None = None,
    pipeline_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
    weights: str | None = None,
    **overrides: Any,
) -> Any:
    """Make `model.generate` run on the hfaccel engine; returns the same model object.

    Registers the "hfaccel" attention function with transformers' ``AttentionInterface`` and binds a
    drop-in ``generate`` on this instance (other instances of the class are untouched). Ordinary
    ``model(...)`` forward calls keep the model's own attention. Options the engine does not serve fall
    back to the original ``generate`` with one warning, or raise ValueError with ``strict=True``.
    ``progress=True`` shows a progress bar inside ``model.generate``.

    Calling it again on a patched model changes only what is given: keyword overrides change only the
    fields they name (``patch(model, max_num_seqs=8)`` keeps an earlier ``block_size``), an
    `EngineConfig` replaces the whole config, and ``strict`` / ``progress`` stay as they were unless
    given. The engine is rebuilt only if the config actually changed.

    Unknown or invalid config values raise ValueError here, as do configs that cannot serve this model:
    a ``max_model_len`` beyond the model's context, a named ``backend`` that cannot run here, or a
    ``kv_cache_memory`` too small for one request of ``max_model_len`` tokens (the message says how
    much is needed, or which ``max_model_len`` fits).

    ``weights="auto"`` casts a float32 model, in place, to the dtype this device computes fastest
    (bfloat16 on a CPU with native bf16 matmuls, about twice float32's speed there, and on CUDA; left as
    it is on an AVX2-only CPU); ``"bfloat16"``, ``"float16"`` or ``"float32"`` cast to that dtype. The
    default (None) leaves the weights as they are: transformers' exact tokens on the user's own model.

    Parallelism (docs/parallelism.md): ``tensor_parallel_size=N`` (or ``device_mesh=`` a 1-D
    ``DeviceMesh``) shards the model in place over N processes from its transformers TP plan; every rank
    runs the same script and makes the same calls. ``sequence_parallel=True`` also shards the tokens of
    steps that hold prefill tokens. A model transformers sharded at load (``tp_plan="auto"``) is served
    as it is. Refusals (sizes that do not divide the heads, no process group) raise ValueError before
    anything is sharded.

    Pipeline parallelism: ``pipeline_parallel_size=P`` splits the decoder layers into P stages over P
    processes (``EngineConfig.num_microbatches`` microbatches pipelined through them in prefill).
    Expert parallelism: ``expert_parallel_size=E`` shards a MoE model's experts over E processes
    (tokens dispatched to them by all-to-all). Data parallelism: ``data_parallel_size=D`` makes D engine
    replicas (of world // D ranks each, TP, PP or EP inside); `generate` spreads its requests over them
    by load and returns every completion on every rank. See docs/parallelism.md.
    """
    # One patch of a model at a time (two threads patching it at once recorded the first one's
    # patched generate as "the original"), and never during a temporary patch's setup or teardown.
    _check_patch_arguments(config, strict, progress)
    with _temporary_patch_lock:
        state: PatchState | None = getattr(model, "_hfaccel", None)
        parallel = (tensor_parallel_size, device_mesh, sequence_parallel)
        if state is not None:
            dtype = planned_dtype(model, weights)  # checked with the dtype the weights will have
            if pipeline_parallel_size not in (None, 1) and parallel_layout(model).pp is None:
                raise ValueError("pipeline parallelism is set at a model's first patch: unpatch it first")
            if expert_parallel_size not in (None, 1) and parallel_layout(model).ep is None:
                raise ValueError("expert parallelism is set at a model's first patch: unpatch it first")
            if data_parallel_size not in (None, 1) and parallel_layout(model).dp is None:
                raise ValueError("data parallelism is set at a model's first patch: unpatch it first")
            if any(p is not None for p in parallel):  # tensor parallelism is fixed at the first patch
                if parallel_layout(model).tp is None:
                    raise ValueError("tensor parallelism is set at a model's first patch: unpatch it first")
                setup_tensor_parallel(
                    model, *parallel, (config or state.config).with_overrides(**overrides).batching
                )
                again = {"tensor_parallel_size": tensor_parallel_size, "sequence_parallel": sequence_parallel}
                state.config = state.config.with_overrides(
                    **{k: v for k, v in again.items() if v is not None}
                )
            if config is not None or overrides or weights is not None:
                new_config = _keep_parallel_layout(
                    state.config, (config or state.config).with_overrides(**overrides)
                )
                _check_draft_model(model, new_config)
                check_engine_config(model, new_config, dtype=dtype)
                if new_config != state.config:
                    # The new config first: a call that rebuilds the engine after the release (it joins the
                    # loop thread) builds it from the new one.
                    state.config = new_config
                    state.release("hfaccel.patch changed the engine config: its engine was rebuilt")
            apply_weights(model, weights)  # after the checks: a patch refused leaves the weights as they were
            if state.temporary:  # patched on purpose now: it stays patched after temporary users end,
                state.temporary = False  # and its generate runs on the engine from now on
                model.generate = types.MethodType(patched_generate, model)
            state.strict = state.strict if strict is None else bool(strict)
            state.progress = state.progress if progress is None else bool(progress)
            return model
        check_model(model)
        engine_config = (config or EngineConfig()).with_overrides(**overrides)
        # The parallel layout: the arguments given here, else the config's; recorded in the config.
        given = {
            "tensor_parallel_size": tensor_parallel_size,
            "sequence_parallel": sequence_parallel,
            "pipeline_parallel_size": pipeline_parallel_size,
            "expert_parallel_size": expert_parallel_size,
            "data_parallel_size": data_parallel_size,
        }
        layout = {
            name: given[name] if given[name] is not None else value
            for name, value in engine_config.parallel.sizes.items()
        }
        engine_config = engine_config.with_overrides(**layout)
        _check_draft_model(model, engine_config)
        sizes = [size for name, size in layout.items() if name.endswith("_size")]
        one_process = all(size in (None, 1) for size in sizes) and device_mesh is None
        if one_process:
            # The served model's checks, with the dtype its weights will have, before they change (a
            # patch refused leaves them as they were). A parallel layout is checked once set up.
            check_engine_config(model, engine_config, dtype=planned_dtype(model, weights))
        check_pipeline_stages(model, layout["pipeline_parallel_size"])
        apply_weights(model, weights)
        tp_args = (layout["tensor_parallel_size"], device_mesh, layout["sequence_parallel"])
        setup_tensor_parallel(model, *tp_args, engine_config.batching)  # shards the model when N > 1
        setup_pipeline_parallel(
            model, layout["pipeline_parallel_size"]
        )  # splits the layers into stages (P > 1)
        setup_expert_parallel(model, layout["expert_parallel_size"])  # shards the experts when E > 1
        setup_data_parallel(model, layout["data_parallel_size"])  # D engine replicas when D > 1
        if not one_process:
            check_engine_config(model, engine_config)
        register_attention()
        model._hfaccel = PatchState(
            config=engine_config,
            original_generate=model.generate,
            instance_generate=model.__dict__.get("generate"),
            strict=bool(strict),
            progress=bool(progress),
        )
        if not _temporary.patching:  # a temporary patch leaves the model's own generate alone
            model.generate = types.MethodType(patched_generate, model)
        install_pipeline_batching()
        return model


def _keep_parallel_layout(first: EngineConfig, new: EngineConfig) -> EngineConfig:
    """`new` with the parallel layout of the model's first patch (only `num_microbatches` may change);
    a config that asks for another layout raises ValueError."""
    changed = sorted(
        name
        for name, value in new.parallel.sizes.items()
        if value is not None and value != first.parallel.sizes[name]
    )
    if changed:
        raise ValueError(f"{', '.join(changed)} is set at a model's first patch: unpatch it first")
    return new.with_overrides(**first.parallel.sizes)


def _check_draft_model(model: Any, config: EngineConfig) -> None:
    """Refuse a ``speculative`` draft model whose vocabulary differs from `model`'s at `patch` time, not
    at the first ``generate`` (the engine checks again, with the device, when it is built)."""
    draft = config.speculative
    if not is_draft_model(draft) or draft is model:
        return
    try:
        ours, theirs = (m.get_input_embeddings().num_embeddings for m in (model, draft))
    except (AttributeError, NotImplementedError):
        return  # not a transformers model: the engine's executor decides
    if ours != theirs:
        raise ValueError(
            f"speculative: the draft model's vocabulary has {theirs} tokens, the model's {ours}; a draft "
            "model must share the model's tokenizer and vocabulary"
        )


def unpatch(model: Any) -> Any:
    """Undo `patch`: the original `generate` comes back exactly, the engine loop stops and the KV cache
    is released (requests still in flight fail with `LoopClosed`)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"unpatch takes the model hfaccel.patch was given, got {type(model).__name__}")
    with _temporary_patch_lock:
        state: PatchState | None = model.__dict__.pop("_hfaccel", None)
        if state is None:
            return model
        if state.instance_generate is None:
            model.__dict__.pop("generate", None)  # none bound by a temporary patch
        else:
            model.generate = state.instance_generate
    state.release("hfaccel.unpatch released the engine")
    restore_attention(model)
    restore_mixers(model)
    return model


def reset_prefix_cache(model: Any) -> None:
    """Forget every KV block the prefix cache holds for `model`, so the next requests recompute them,
    and every captured CUDA graph, so the next decode steps capture the model as it is now.

    Weight updates, ``load_state_dict``, dtype or device moves and PEFT adapter switches are detected
    by themselves; call this after a change the engine cannot see (an edit through ``.data`` that
    touches few elements, a custom layer's own state). Requests running at the time finish on the KV
    they hold but never share it. A no-op on an unpatched model or one whose engine is not built yet.
    """
    state: PatchState | None = getattr(model, "__dict__", {}).get("_hfaccel")
    if state is None or state.engine is None:
        return
    engine, loop = state.engine, state.loop
    if loop is not None and loop.engine is engine:  # never beside a step another thread runs
        loop.forget_model_outputs()
    else:
        engine.forget_model_outputs()


def release(model: Any) -> None:
    """Free `model`'s KV cache (and prefix cache) now; the model stays patched.

    Drops the engine, collects garbage and, on CUDA, returns cached blocks to the driver
    (``torch.cuda.empty_cache``). The next ``generate`` builds a new engine. A stream still being read
    fails with `LoopClosed`, as do requests still in flight. A no-op on an unpatched model or one with no engine yet.
    """
    state: PatchState | None = getattr(model, "__dict__", {}).get("_hfaccel")
    if state is None or state.engine is None:
        return
    on_cuda = state.engine.device.type == "cuda"
    state.release("hfaccel.release freed the engine")  # stops its loop: nothing may step a freed cache
    gc.collect()
    if on_cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_patched(model: Any) -> bool:
    """Whether `patch` has been applied to this model instance."""
    return "_hfaccel" in getattr(model, "__dict__", {})


# Re-entrant: an abandoned stream's cleanup (a `patched_for_call` block's `finally`) may run from the garbage
# collector in a thread that already holds it, in the middle of another call's patch.
_temporary_patch_lock = threading.RLock()


class _TemporaryPatching(threading.local):
    patching = False  # this thread's `patch` call makes a temporary patch (under the lock)


_temporary = _TemporaryPatching()


@contextmanager
def patched_for_call(model: Any) -> Iterator[PatchState]:
    """The model's patch state; an unpatched model is patched for the block and restored after the last
    of the calls that patched it this way ends (concurrent calls share one engine)."""
    with _temporary_patch_lock:
        if not is_patched(model):
            # It serves the hfaccel calls that made it (they reach the engine through the state): the
            # model's own generate stays transformers' for every other thread, whose plain calls a
            # temporary engine ending under them would otherwise fail.
            _temporary.patching = True
            try:
                patch(model)
            finally:
                _temporary.patching = False
            model._hfaccel.temporary = True
        state: PatchState = model._hfaccel
        temporary = state.temporary
        if temporary:
            state.temporary_users += 1
    try:
        yield state
    finally:
        if temporary:
            with _temporary_patch_lock:
                state.temporary_users -= 1
                if state.temporary and state.temporary_users == 0 and model.__dict__.get("_hfaccel") is state:
                    unpatch(model)


def check_pipeline_stages(model: Any, size: int | None) -> None:
    """Refuse pipeline parallelism (before anything is set up) where the stages would compute other than
    the model's own forward (`layer_loop.unsupported_reason`)."""
    if size is None or size == 1 or parallel_layout(model).pp is not None:
        return
    check_pipeline_size(size, model.config.get_text_config(decoder=True).num_hidden_layers)
    reason = layer_loop.unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"pipeline_parallel_size={size} is not possible: {reason}")


def _check_patch_arguments(config: Any, strict: Any, progress: Any) -> None:
    """`patch`'s own arguments, named where they are wrong (the model: `check_model`)."""
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(
            f"config must be an EngineConfig, got {type(config).__name__}: pass EngineConfig(**fields), or "
            "the fields themselves as keyword arguments (patch(model, max_num_seqs=8))"
        )
    for name, value in (("strict", strict), ("progress", progress)):
        numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
        if value is not None and not isinstance(value, bool) and not numpy_bool:
            raise TypeError(f"{name} must be True or False, got {value!r}")
