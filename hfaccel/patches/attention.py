"""The "hfaccel" attention function: HF decoder layers hand it Q/K/V, it runs paged attention.

The function is registered once in ``transformers.AttentionInterface``. A patched model keeps its own
attention implementation for ordinary forward calls (so scoring and training code sees exactly the
model it had, masks and all), in every thread, also while the engine steps: the model's configs report
"hfaccel" as their ``_attn_implementation`` only to the thread running an engine forward, and only for
its length (`engine_attention`). No mask function is registered for the name, so transformers builds no
``[T, S]`` mask for an engine step: causality and sequence boundaries come from the paged metadata,
which the runner hands over in a forward context (not through HF's ``**kwargs``).

How the switch stays per thread: transformers reads ``config._attn_implementation`` (a property over
``_attn_implementation_internal``) in every attention layer and mask builder at every forward. We wrap
that property once, on the transformers class that defines it, with a getter that answers "hfaccel"
when the config is one of the configs of the model the current thread is running an engine step of
(a thread-local set of config ids), and the stored value otherwise. Nothing is written to the config,
the config keeps its class (``type``, ``==``, pickling, ``save_pretrained`` and the Auto classes are
untouched), and a plain ``model(...)`` in any other thread takes exactly the path it took before.

Which functions it may stand in for (`implementation_reason`): standard attention only. Transformers' own
(eager, sdpa, flash, flex and their paged variants) and a kernels-hub flash kernel compute it; a function
someone registered (``AttentionInterface.register``, an item set on ``ALL_ATTENTION_FUNCTIONS`` or on a
modeling file's own ``AttentionInterface()``, under a new name or one of transformers') may compute
anything, so such a model is refused at `patch` and a call after ``set_attn_implementation`` falls
back. A function is judged by the module its code belongs to (``__globals__``, which ``functools.wraps``
does not copy) along its ``__wrapped__`` chain.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedConfig, modeling_utils

import hfaccel.kernels.op  # noqa: F401  (registers torch.ops.hfaccel.paged_attention_v2)
from hfaccel.kernels.attention_probs import attention_probs
from hfaccel.kernels.op import current_forward_context, paged_attention, paged_attention_heads_first

ATTENTION_NAME = "hfaccel"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface entry: ``query`` ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``
    (packed, not GQA-repeated) -> ``([1, T, Hq, D], None)``, through the ``hfaccel::paged_attention``
    op, which reads the step from the forward context the runner set."""
    calls = getattr(_local, "recorded_calls", None)
    if calls is not None:  # `recording_attention` (the patch-time check of what layers pass)
        return _record_call(calls, module, query, key, value, attention_mask, scaling, kwargs)
    context = current_forward_context()
    if context is None:
        raise RuntimeError(
            "the 'hfaccel' attention implementation only runs inside the hfaccel engine; "
            "call model.generate(...) or hfaccel.generate(...) instead of forward()"
        )
    if dropout:  # train mode: a call on such a model goes to transformers (`attention_dropout_reason`)
        raise RuntimeError(
            f"{type(module).__name__} passes attention dropout ({dropout}), which the engine's attention "
            "does not apply: its model is in train mode (put there before or while this call ran); "
            "generate in eval mode, or set its attention dropout to 0"
        )
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    # The layer's sliding window, as transformers passes it (None for a full-attention layer), and its
    # chunk (chunked attention is told by the config only: transformers builds it into the mask).
    window = int(kwargs.get("sliding_window") or 0)
    chunk = layer_chunk(module)
    # Logit soft-capping (Gemma 2) and attention sinks (gpt-oss's s_aux, one logit per query head).
    softcap, sinks = float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux")
    local = (window, chunk, softcap, sinks)
    if (
        type(query) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not context.record_attentions
        and value.shape[-1] == key.shape[-1]
    ):
        # Eager, where the backend reads transformers' head-first tensors in place (an eager CPU decode
        # step): no transposed views, no op round trip (30 layers a step).
        out = paged_attention_heads_first(context, query, key, value, module.layer_idx, scale, *local)
        if out is not None:
            return out, None
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    value_dim = v.shape[-1]
    if value_dim < k.shape[-1]:  # multi-head latent attention: the cache holds values padded to K's width
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - value_dim))
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        if type(q) is torch.Tensor and not torch.compiler.is_compiling():
            # Eager on plain tensors: the op's own function, without the dispatcher's round trip (a
            # quarter of a small layer's attention call); a graph or a tensor subclass gets the op.
            out = paged_attention(q, k, v, module.layer_idx, scale, *local)
        else:
            out = torch.ops.hfaccel.paged_attention_v2(q, k, v, module.layer_idx, scale, *local)
        if value_dim < out.shape[-1]:
            out = out[..., :value_dim]
        return out.unsqueeze(0), _probs(context, module, q, scale, local)
    # Under autocast (accelerate wraps a trainer's model.forward in it, and HF's generate runs inside it)
    # the projections come out in the autocast dtype: attend in the KV cache's dtype (an int8 cache: in
    # the query's, which rotary leaves in the model's), autocast off.
    cache_dtype = context.kv_caches[module.layer_idx][0].dtype
    compute = cache_dtype if cache_dtype.is_floating_point and cache_dtype.itemsize >= 2 else q.dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    with torch.autocast(device, enabled=False):
        out = torch.ops.hfaccel.paged_attention_v2(q, k, v, module.layer_idx, scale, *local)
    return out[..., :value_dim].unsqueeze(0).to(query.dtype), _probs(context, module, q, scale, local)


def _probs(context: Any, module: torch.nn.Module, q: torch.Tensor, scale: float, local: tuple) -> Any:
    """The layer's attention probabilities when the step records them (HF's ``output_attentions``),
    read from the cache the op has just written; else None, as the fast path returns."""
    if not context.record_attentions:
        return None
    layout = context.layout_for(module.layer_idx)
    return attention_probs(q, context.kv_caches[module.layer_idx][0], layout, scale, *local)


def layer_chunk(module: torch.nn.Module) -> int:
    """The chunk of a chunked-attention layer (``layer_types[i] == "chunked_attention"``, of
    ``attention_chunk_size`` positions, as Llama 4's), else 0. Read from the config at every call, as
    transformers reads it: a config changed in place changes the chunks at once."""
    config = getattr(module, "config", None)
    # Most configs have no layer types: eager, asked without the miss's exception (a layer a step);
    # dynamo traces the plain getattr (not `_may_have`'s read of the instance dictionary).
    if not torch.compiler.is_compiling() and not _may_have(config, "layer_types"):
        return 0
    types = getattr(config, "layer_types", None)
    if not types or module.layer_idx >= len(types) or types[module.layer_idx] != "chunked_attention":
        return 0
    return int(config.attention_chunk_size)


def _may_have(config: Any, name: str) -> bool:
    """Whether ``getattr(config, name)`` may find something: an instance attribute, one of its class (a
    property) or one its ``attribute_map`` renames; answered without the miss's exception."""
    if config is None:
        return False
    cls = type(config)
    if hasattr(cls, name) or hasattr(cls, "__getattr__") or name in getattr(cls, "attribute_map", ()):
        return True  # (a class that answers attributes itself: asked)
    try:  # (past PreTrainedConfig's own __getattribute__, which costs as much as the miss)
        return name in object.__getattribute__(config, "__dict__")
    except AttributeError:  # no instance dictionary
        return False


@dataclass(frozen=True)
class AttentionCall:
    """What one attention layer handed the attention function: its index, Q/K/V shapes
    (``[1, heads, T, D]``) and the keyword arguments beyond HF's common ones; the mask it was handed
    (transformers builds none for the engine's attention: one there is the layer's own) and its module's
    ``is_causal`` (None: the module has none)."""

    layer_idx: Any
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    kwargs: dict[str, Any]
    mask: Any = None
    module_causal: bool | None = None


@contextmanager
def recording_attention(model: torch.nn.Module) -> Iterator[list[AttentionCall]]:
    """Inside this block, in this thread, the model's attention layers call the "hfaccel" function,
    which records each call and answers with plain causal attention (one sequence, no cache)."""
    register_attention()
    restore_attention(model)  # the model's configs found afresh: modules may have been swapped in
    calls: list[AttentionCall] = []
    previous = getattr(_local, "recorded_calls", None)
    _local.recorded_calls = calls
    try:
        with engine_attention(model):
            yield calls
    finally:
        _local.recorded_calls = previous


def _record_call(
    calls: list[AttentionCall],
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    calls.append(
        AttentionCall(
            getattr(module, "layer_idx", None),
            tuple(query.shape),
            tuple(key.shape),
            tuple(value.shape),
            kwargs,
            attention_mask.detach() if isinstance(attention_mask, torch.Tensor) else attention_mask,
            getattr(module, "is_causal", None),
        )
    )
    groups = query.shape[1] // max(1, key.shape[1])
    if key.shape[1] * groups != query.shape[1] or key.shape[-1] != query.shape[-1]:
        shape = (
            *query.shape[:3],
            value.shape[-1],
        )  # shapes the engine refuses: only the output's shape matters
        return query.new_zeros(shape).transpose(1, 2), None
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


def register_attention() -> None:
    """Register the "hfaccel" attention function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


class _ThreadState(threading.local):
    """Per-thread state, with class defaults: every thread has both attributes, so a compiled forward's
    guards on them hold in any thread (a graph compiled in one thread, `compile="background"`, runs in
    another)."""

    configs: frozenset[int] | None = None  # ids of the configs that report "hfaccel" to this thread
    recorded_calls: list | None = None  # `recording_attention`'s list while it records


_local = _ThreadState()
_install_lock = threading.Lock()
_WRAPPED = "__hfaccel_thread_local__"
# model -> (its config, every config object its modules read, by id): found once per model.
_model_configs: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, dict[int, PreTrainedConfig]]] = (
    weakref.WeakKeyDictionary()
)


@contextmanager
def engine_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's attention layers on the paged "hfaccel" function inside this block, in this
    thread only: other threads calling the same model meanwhile see its own attention implementation."""
    configs = _configs_of(model)
    previous = getattr(_local, "configs", None)
    _local.configs = configs if previous is None else previous | configs
    try:
        yield
    finally:
        _local.configs = previous


def serves_config(config: Any) -> bool:
    """Whether `config` answers "hfaccel" as its ``_attn_implementation`` in this thread now (inside
    `engine_attention` of a model it belongs to), as the property's getter decides it."""
    configs = _local.configs
    return configs is not None and id(config) in configs


def restore_attention(model: torch.nn.Module) -> None:
    """Undo what `engine_attention` prepared for `model` (for ``unpatch``).

    Nothing is stored on the model or its configs; this forgets the model's config list. The property
    wrapper on the transformers config class stays: outside an engine forward it returns exactly the
    stored value, for every config of every model.
    """
    _model_configs.pop(model, None)


def _configs_of(model: torch.nn.Module) -> frozenset[int]:
    return frozenset(config_objects(model))


def config_objects(model: torch.nn.Module) -> dict[int, PreTrainedConfig]:
    """Every config object `model` and its modules read, by id (found once per model)."""
    root = model.config
    cached = _model_configs.get(model)
    if cached is not None and cached[0] is root:
        return cached[1]
    found: dict[int, PreTrainedConfig] = {}

    def visit(config: Any) -> None:
        if not isinstance(config, PreTrainedConfig) or id(config) in found:
            return
        found[id(config)] = config
        for key in getattr(config, "sub_configs", None) or {}:
            visit(getattr(config, key, None))

    visit(root)
    for module in model.modules():  # a module may hold its own (text, vision) config object
        visit(getattr(module, "config", None))
    for config in found.values():
        _install(type(config))
    _model_configs[model] = (root, found)
    return found


def stored_implementation(config: Any) -> Any:
    """`config`'s ``_attn_implementation`` as a forward outside an engine step reads it (the stored one)."""
    owner = next(c for c in type(config).__mro__ if "_attn_implementation" in c.__dict__)
    getter = owner.__dict__["_attn_implementation"].fget
    stored = getter.__wrapped__ if getattr(getter, _WRAPPED, False) else getter  # (not this thread's view)
    return stored(config)


# The transformers modules whose attention functions compute standard attention (transformers 5.17 to
# 5.24). Another module's function of transformers (a block-sparse hub wrapper, `msa_attention`) is not
# taken for standard attention: a call falls back rather than be served different.
STANDARD_MODULES = frozenset(
    {
        "transformers.integrations.sdpa_attention",
        "transformers.integrations.flash_attention",
        "transformers.integrations.flex_attention",
        "transformers.integrations.sdpa_paged",
        "transformers.integrations.flash_paged",
        "transformers.integrations.eager_paged",
        "transformers.integrations.npu_flash_attention",
        "transformers.modeling_flash_attention_utils",
    }
)
_PAGED = "paged|"

# model -> (its config, the attention mappings its modules' files look names up in)
_mappings: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, tuple[Any, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _module_of(function: Any) -> str:
    globals_ = getattr(function, "__globals__", None)
    return globals_.get("__name__", "") if isinstance(globals_, dict) else ""


def _standard(function: Any) -> bool:
    """Whether `function` computes standard attention: transformers' own of `STANDARD_MODULES` (through
    any wrapper of transformers' own), or a hub kernel's ``flash_attn_forward`` (transformers registers
    it for a kernel that says ``supports_flash_attn``)."""
    if getattr(function, "__name__", None) == "flash_attn_forward":
        kernel = sys.modules.get(getattr(function, "__module__", "") or "")
        if kernel is not None and getattr(kernel, "supports_flash_attn", False):
            return True
    while True:
        module = _module_of(function)
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            return module in STANDARD_MODULES
        if not module.startswith("transformers."):
            return False
        function = inner


def _where(function: Any) -> str:
    """Where `function`'s own code is (a wrapper copies the wrapped function's names, not its code)."""
    code = getattr(function, "__code__", None)
    if code is None:
        return repr(function)
    return f"{code.co_name} in {code.co_filename}:{code.co_firstlineno}"


def _attention_mappings(model: torch.nn.Module) -> tuple[Any, ...]:
    """transformers' mapping and every modeling file's own one that `model`'s modules come from."""
    root = model.config
    cached = _mappings.get(model)
    if cached is not None and cached[0] is root:
        return cached[1]
    found = {id(modeling_utils.ALL_ATTENTION_FUNCTIONS): modeling_utils.ALL_ATTENTION_FUNCTIONS}
    for name in {type(module).__module__ for module in model.modules()}:
        mapping = getattr(sys.modules.get(name), "ALL_ATTENTION_FUNCTIONS", None)
        if mapping is not None and hasattr(mapping, "get"):
            found.setdefault(id(mapping), mapping)
    mappings = tuple(found.values())
    _mappings[model] = (root, mappings)
    return mappings


def implementation_reason(model: torch.nn.Module) -> str | None:
    """Why the engine's attention would not compute what `model`'s own attention does: a config names a
    function that is not standard attention (None: every config's is). Read as a plain forward reads it:
    the stored name, looked up in the mappings the model's files use (with transformers 5.24's reading
    of a ``paged|`` name as the name after it); "eager" with nothing registered under it is the modeling
    file's own eager attention."""
    mappings = _attention_mappings(model)
    for config in config_objects(model).values():
        name = stored_implementation(config)
        if not isinstance(name, str) or name == ATTENTION_NAME:
            continue
        for mapping in mappings:
            for key in dict.fromkeys((name, name.removeprefix(_PAGED))):
                function = mapping.get(key)
                if function is not None and not _standard(function):
                    return (
                        f"the model's attention implementation {name!r} is {_where(function)}, not one of "
                        "transformers' standard attention functions: the engine's paged attention would "
                        "replace it with standard attention"
                    )
    return None


def _install(config_class: type) -> None:
    """Wrap the ``_attn_implementation`` property of the class that defines it for `config_class` (once)."""
    owner = next((c for c in config_class.__mro__ if "_attn_implementation" in c.__dict__), None)
    if owner is None:
        raise TypeError(f"{config_class.__name__} has no _attn_implementation: not a transformers config")
    prop = owner.__dict__["_attn_implementation"]
    if getattr(prop.fget, _WRAPPED, False):
        return
    if not isinstance(prop, property):
        raise TypeError(
            f"{owner.__name__}._attn_implementation is not a property: cannot switch it per thread"
        )
    with _install_lock:
        prop = owner.__dict__["_attn_implementation"]
        if getattr(prop.fget, _WRAPPED, False):
            return
        stored = prop.fget

        def get(self: Any) -> Any:
            configs = getattr(_local, "configs", None)
            if configs is not None and id(self) in configs:
                return ATTENTION_NAME
            return stored(self)

        setattr(get, _WRAPPED, True)
        get.__wrapped__ = stored  # type: ignore[attr-defined]
        get.__doc__ = stored.__doc__
        owner._attn_implementation = property(get, prop.fset, prop.fdel, prop.__doc__)
