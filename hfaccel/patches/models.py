"""Which model families the engine serves, and what each one's limits are."""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hfaccel.config import is_draft_model
from hfaccel.distributed.layout import parallel_layout
from hfaccel.engine.limits import COUNTED_TOKENS
from hfaccel.kernels import kv_quant
from hfaccel.patches.attention import implementation_reason
from hfaccel.patches.layer_support import (
    attention_needs,
    attention_shape,
    has_recurrent_layers,
    kv_layers,
    state_bytes_per_sequence,
    unsupported_reason,
)
from hfaccel.patches.model_state import ATTENTION_DROPOUT_NAMES, dropout_rate, marked_packed

# A purely recurrent model (Mamba's) keeps no K/V: its cache has no layers, and these (KV heads, head dim),
# which every backend takes, only size the step metadata nothing reads.
NO_ATTENTION_DIMS = (1, 64)
RECURRENT_MAX_MODEL_LEN = 32768  # a purely recurrent model's default max_model_len (block counts only)
# The families whose greedy tokens the family matrix (bench/families.py, docs/coverage.md) checks against
# HF's on every run; its test keeps this set equal to what it serves.
CHECKED_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo", "olmo2",
    "granite", "cohere", "cohere2", "starcoder2", "stablelm", "gpt2", "gpt_neox", "opt", "mixtral",
    "qwen2_moe", "qwen3_moe", "glm4", "smollm3", "exaone4", "gpt_oss", "llama4_text", "jamba", "qwen3_next",
    "lfm2", "falcon_h1", "bamba", "granitemoehybrid", "nemotron_h", "kimi_linear", "olmo_hybrid", "mamba",
    "falcon_mamba", "mamba2", "deepseek_v3", "deepseek_v2", "gptj",
})  # fmt: skip


def check_model(model: torch.nn.Module) -> None:
    """Raise ValueError for a model the engine cannot serve; warn once for an untested family."""
    reason = model_reason(model)
    if reason is not None:
        raise ValueError(reason)
    model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
    if model_type not in CHECKED_MODEL_TYPES:
        warnings.warn(
            f"model_type {model_type!r} is not among the {len(CHECKED_MODEL_TYPES)} families whose tokens "
            "hfaccel checks against transformers' (docs/coverage.md): its layers passed patch's checks, "
            "but its outputs are not tested",
            stacklevel=3,
        )


def model_reason(model: torch.nn.Module) -> str | None:
    """Why `patch` refuses this model (None: the engine serves it)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        return "hfaccel.patch expects a transformers causal-LM model (with .config and .generate)"
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model; hfaccel serves decoder-only models"
    learning = [
        n
        for n, c in (getattr(model, "peft_config", None) or {}).items()
        if getattr(c, "is_prompt_learning", False)
    ]
    if learning:
        return (
            f"PEFT's prompt learning (adapter {learning[0]!r}) adds virtual tokens to every sequence, which the "
            "engine does not serve: call the PeftModel's generate unpatched"
        )
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return (
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so hfaccel cannot serve it"
        )
    if (reason := implementation_reason(model)) is not None:
        return (
            f"hfaccel cannot serve {type(model).__name__}: {reason}; set one of transformers' own to serve it"
        )
    offloaded = next((name for name, p in model.named_parameters() if p.device.type == "meta"), None)
    if offloaded is not None:
        return (
            f"hfaccel cannot serve {type(model).__name__}: {offloaded} is on the meta device (weights offloaded "
            "by accelerate: a device_map with 'cpu' or 'disk' entries, or cpu_offload); the engine runs a model "
            "whose weights live on one device: load it without offload, or call transformers' generate"
        )
    reason = unsupported_reason(model)
    return None if reason is None else f"hfaccel cannot serve {type(model).__name__}: {reason}"


def all_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model` and its submodules, breadth first: ``model.modules()`` without its names and generators
    (3x faster; the checks below are asked on every call)."""
    modules = [model]
    for module in modules:
        modules.extend(child for child in module._modules.values() if child is not None)
    return modules


def quantized_activations_reason(
    model: torch.nn.Module, modules: list[torch.nn.Module] | None = None
) -> str | None:
    """Why calls on this model go to transformers: weights that quantize their input activations on the
    fly (torchao's ``act_quant_kwargs``: ``Int8DynamicActivationInt8WeightConfig`` and kin). Each
    activation's rounding follows float noise, so no attention kernel reproduces transformers' tokens
    (its own sdpa and eager attention disagree on such a model: measured on a tiny Llama)."""
    for module in modules or all_modules(model):
        for param in module._parameters.values():
            if type(param) is torch.nn.Parameter or getattr(param, "act_quant_kwargs", None) is None:
                continue
            name = next(n for n, p in model.named_parameters() if p is param)
            return (
                f"activations quantized on the fly ({name} is a {type(param).__name__} with act_quant_kwargs), "
                "whose rounding follows float noise: no kernel reproduces transformers' tokens"
            )
    return None


_held = threading.local()  # (model, its reason) while `reasons_held` runs in this thread


def reasons_held(model: torch.nn.Module) -> Any:
    """Inside this block, in this thread, `weights_and_mode_reason(model)` is worked out once (a call that
    plans many prompts asks it for each; it walks every module)."""
    return _holding((model, _UNKNOWN))


def reasons_suspended() -> Any:
    """Inside this block, in this thread, no reason is held (`reasons_held`): transformers' generate of a
    prompt that fell back runs the user's code, which may call the model's generate under another
    autocast, or with PEFT's method swapped in."""
    return _holding(None)


_UNKNOWN = object()


@contextmanager
def _holding(entry: tuple[torch.nn.Module, Any] | None) -> Iterator[None]:
    previous = getattr(_held, "entry", None)
    _held.entry = entry
    try:
        yield
    finally:
        _held.entry = previous


def weights_and_mode_reason(model: torch.nn.Module) -> str | None:
    """Why a call on `model` goes to transformers, as the model and the calling thread are now: a replaced
    ``prepare_inputs_for_generation``, ``torch.autocast`` around the call, an attention function
    registered outside transformers (set after `patch`), activations quantized on the fly, attention
    dropout in train mode, or a user's forward hooks."""
    entry = getattr(_held, "entry", None)
    if entry is None or entry[0] is not model:
        return _weights_and_mode_reason(model)
    if entry[1] is _UNKNOWN:
        _held.entry = (model, _weights_and_mode_reason(model))
    return _held.entry[1]


def _weights_and_mode_reason(model: torch.nn.Module) -> str | None:
    own = vars(model).get("prepare_inputs_for_generation")
    if own is not None and not _prepares_the_models_inputs(model, own):
        # PEFT's prompt learning puts its own there for its generate (its virtual tokens), as may a user;
        # after its call it puts back the class's own, bound to the model: that one is the model's.
        return "prepare_inputs_for_generation replaced on the model (PEFT's prompt learning adds its tokens there)"
    reason = autocast_reason(model) or implementation_reason(model)
    if reason is not None:
        return reason
    modules = all_modules(model)
    return (
        quantized_activations_reason(model, modules)
        or attention_dropout_reason(model, modules)
        or user_hooks_reason(model, modules)
    )


def _prepares_the_models_inputs(model: torch.nn.Module, own: Any) -> bool:
    """Whether `own`, a ``prepare_inputs_for_generation`` set on `model` itself, prepares what the model's
    own would: its class's, bound to it; the one a PEFT tuner (a patched ``peft_model.base_model``)
    reaches through its ``__getattr__``, which PEFT's generate puts back there after each call, bound to
    the wrapped model; or PEFT's own wrapper, put there for the call, for an adapter that adds no tokens
    (not prompt learning, no task ids: it passes the wrapped model's inputs through)."""
    function, bound = getattr(own, "__func__", None), getattr(own, "__self__", None)
    if function is None:
        return False
    if bound is model:
        return function is getattr(type(model), "prepare_inputs_for_generation", None)
    inner = model._modules.get("model")
    if inner is None or not type(model).__module__.startswith("peft."):
        return False
    # A tuner's generate is the wrapped model's, which calls the wrapped model's own method: that one must
    # be its class's too (a user's there is what PEFT's generate runs, whatever PEFT set on the tuner).
    inner_own = vars(inner).get("prepare_inputs_for_generation")
    if inner_own is not None and not _prepares_the_models_inputs(inner, inner_own):
        return False
    if bound is inner:
        return function is getattr(type(inner), "prepare_inputs_for_generation", None)
    peft_model = sys.modules.get("peft.peft_model")
    wrapper = getattr(
        getattr(peft_model, "PeftModelForCausalLM", None), "prepare_inputs_for_generation", None
    )
    if wrapper is not None and function is wrapper and getattr(bound, "base_model", None) is model:
        config = getattr(bound, "active_peft_config", None)
        return (
            config is not None
            and not config.is_prompt_learning
            and getattr(config.peft_type, "value", config.peft_type) != "POLY"
        )
    return False


def autocast_reason(model: torch.nn.Module) -> str | None:
    """Why a call goes to transformers: it is made inside ``torch.autocast`` for the model's device. The
    state is the calling thread's, and the engine's steps may run in another (its loop thread), outside
    it; and a step the caller runs itself would put other callers' requests under it. An autocast that
    wraps the model's forward (accelerate's mixed precision) applies in any thread and is served."""
    device = next(model.parameters()).device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know
        enabled = False
    if enabled:
        return f"torch.autocast({device!r}, {torch.get_autocast_dtype(device)}) around the call"
    return None


# Where the forward hooks of libraries come from that change no value a module computes (transformers'
# output capture, FSDP's and DeepSpeed's parameter gathering, PEFT's adapter names, which the adapters
# gate judges, TRL's dtype casts, the engine's own).
_LIBRARY_HOOKS = ("torch.", "transformers.", "accelerate.", "peft.", "deepspeed.", "trl.", "hfaccel.")
# ...but for these: NEFTune's noise (transformers, train mode) is scaled by the embeddings' [B, L] size,
# which an engine step's [1, T] is not.
_VALUE_CHANGING_LIBRARY_HOOKS = frozenset({"neftune_post_forward_hook"})


def user_hooks_reason(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> str | None:
    """Why a call goes to transformers: a forward hook of the user's (activation steering, probes) on one
    of the model's modules, or a global one. A hook sees an engine step's tensors packed as one row of
    all its requests' tokens, ``[1, T]``, not HF's ``[B, L]``: one that reads or edits positions
    (``h[:, -1]``) would act on other tokens, silently. A hook that acts on each token alone (adding a
    steering vector everywhere) keeps the engine when its function says so: ``hook.hfaccel_packed =
    True``."""
    from torch.nn.modules import module as torch_module

    global_hooks = (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks)
    for hooks in global_hooks:
        if not all(_library_hook(hook, None) for hook in hooks.values()):
            return "a global forward hook (it would see the engine's packed steps)"
    for module in modules or all_modules(model):
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            if hooks and not all(_library_hook(hook, module) for hook in hooks.values()):
                name = next(n for n, m in model.named_modules() if m is module) or "the model"
                return f"a forward hook on {name} (it would see the engine's packed steps)"
    return None


def _library_hook(hook: Any, module: torch.nn.Module | None) -> bool:
    """Whether `hook` is a library's that changes no value, or one its author marked ``hfaccel_packed``
    (on the hook or on the function a partial wraps). Asked afresh each call: a few attribute reads."""
    if marked_packed(hook):
        return True
    target = hook
    while isinstance(target, functools.partial):
        target = target.func
    if getattr(target, "__name__", "") in _VALUE_CHANGING_LIBRARY_HOOKS:
        return module is not None and not module.training  # NEFTune adds its noise in train mode only
    origin = getattr(target, "__module__", None) or type(target).__module__
    return isinstance(origin, str) and origin.startswith(_LIBRARY_HOOKS)


def attention_dropout_reason(
    model: torch.nn.Module, modules: list[torch.nn.Module] | None = None
) -> str | None:
    """Why a call on `model` goes to transformers now: it is in train mode with attention dropout, which
    transformers applies to the attention probabilities and the engine's kernels do not (in eval mode
    transformers passes no dropout). Asked on every call, as `model.train()` may come at any time; an
    attention module keeping its rate under another name is caught by the attention function itself,
    which refuses a dropout it is handed. Each module's own flag counts (a decoder put in train mode under
    a root left in eval mode applies its dropout as well)."""
    attention = (m for m in modules or all_modules(model) if m.training and "Attention" in type(m).__name__)
    rate = max((dropout_rate(m, ATTENTION_DROPOUT_NAMES) for m in attention), default=0.0)
    if rate <= 0:
        return None
    return f"train mode with attention dropout ({rate}), which the engine's attention does not apply"


def max_model_len(model: torch.nn.Module, requested: int | None) -> int:
    """Longest sequence the engine serves for this model: its context (``max_position_embeddings``), or
    `requested` where it fits; up to `COUNTED_TOKENS` (else `RECURRENT_MAX_MODEL_LEN`) for a purely
    recurrent model that declares none. Sliding windows do not shorten it: the kernels attend within
    each layer's window."""
    config = model.config.get_text_config(decoder=True)
    declared = getattr(config, "max_position_embeddings", None)
    if declared is None and kv_layers(model) == frozenset():
        # A purely recurrent model (Mamba's) declares no context and keeps no K/V: the blocks it holds
        # only count tokens, up to the bookkeeping's bound.
        if requested is not None and requested > COUNTED_TOKENS:
            raise ValueError(
                f"max_model_len ({requested}) exceeds {COUNTED_TOKENS}, the most tokens the engine counts for "
                "a model without K/V (its blocks' bookkeeping grows with them)"
            )
        return requested or RECURRENT_MAX_MODEL_LEN
    limit = declared or 2048
    original = long_rope_context(config)
    if original is not None and original < limit:
        limit = original  # past it transformers changes every position's rotation (`long_rope_reason`)
    if requested is not None:
        if requested > limit:
            longrope = "" if original is None else f" within its longrope original context ({original})"
            raise ValueError(
                f"max_model_len ({requested}) exceeds what the model supports{longrope} ({limit})"
            )
        return requested
    return limit


def long_rope_context(config: Any) -> int | None:
    """The original context of a model with "longrope" rotary embeddings (Phi-3 and Phi-3.5 long-context
    models), or None. Past it transformers rotates every position of a forward with the long factors
    (chosen from the forward's largest position) and Phi-3 recomputes its whole cache: a packed step of
    many requests cannot follow that, so the engine serves sequences within it and a longer call goes to
    transformers (`long_rope_reason`)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    # One set of parameters, or one per layer type ({"full_attention": {...}, ...}).
    sets = [params] if "rope_type" in params or "type" in params else list(params.values())
    limits = [
        p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        for p in sets
        if isinstance(p, dict) and (p.get("rope_type") or p.get("type")) == "longrope"
    ]
    return min((int(n) for n in limits if n), default=None)


def long_rope_reason(model: torch.nn.Module, longest: int) -> str | None:
    """Why a call whose longest row may reach `longest` tokens goes to transformers: past a longrope
    model's original context (`long_rope_context`). None: within it, where the engine's tokens are
    transformers'."""
    original = long_rope_context(model.config.get_text_config(decoder=True))
    if original is None or longest <= original:
        return None
    return (
        f"a sequence of up to {longest} tokens on a longrope model, past its original context ({original}), "
        "where transformers rotates every position with the long factors and recomputes the cache"
    )


def kv_bytes_per_token(model: torch.nn.Module, kv_dtype: torch.dtype, align: int = 4) -> int:
    """Bytes of K and V one token takes across the layers that keep them (the same count the engine's
    runner makes; an int8 cache's rows padded to `align` bytes). 0 for a purely recurrent model."""
    num_kv_heads, head_dim = attention_dims(model)
    return 2 * num_kv_layers(model) * num_kv_heads * kv_quant.row_bytes(head_dim, kv_dtype, align)


def num_kv_layers(model: torch.nn.Module) -> int:
    """How many layers keep K/V: every decoder layer, or on a model with recurrent layers those that
    call attention."""
    attending = kv_layers(model)
    if attending is not None:
        return len(attending)
    return model.config.get_text_config(decoder=True).num_hidden_layers


def attention_dims(model: torch.nn.Module) -> tuple[int, int]:
    """(KV heads, head dim) of the whole model's K/V, as the patch-time probe (run before any sharding)
    saw the layers hand them to attention, else from the config. The config is not always right:
    DeepSeek-V3's ``head_dim`` is its rotary part, and its layers expand K and V to every query head."""
    shape = attention_shape(model)
    if shape is not None:
        return shape.num_kv_heads, shape.head_dim
    if kv_layers(model) == frozenset():  # purely recurrent: a nominal geometry for the backend's metadata
        return NO_ATTENTION_DIMS
    config = model.config.get_text_config(decoder=True)
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
    return num_kv_heads, getattr(config, "head_dim", None) or config.hidden_size // num_q_heads


def check_engine_config(model: torch.nn.Module, config: Any, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError, at patch time, for an `EngineConfig` that cannot serve this model: what can be
    known without building the engine (context length, a named backend's availability, and whether the
    KV cache holds one request of ``max_model_len`` tokens).

    `dtype`: the model's dtype as it will be once `patch` has cast it (default: as it is now), so the
    check can run before the weights change."""
    from hfaccel.engine.limits import free_memory_bytes
    from hfaccel.kernels.selection import get_backend, unavailable_reason

    context = max_model_len(model, config.max_model_len)
    if has_recurrent_layers(model):
        if config.speculative is not None:
            raise ValueError(
                "speculative: a model with recurrent layers cannot roll their state back over rejected "
                "drafts; leave speculative unset"
            )
        if parallel_layout(model).model_parallel:
            raise ValueError(
                "a model with recurrent layers is served in one process: tensor, pipeline and expert "
                "parallelism are not implemented for its per-sequence state"
            )
    if config.compile == "background":
        from hfaccel.engine import background_compile

        if parallel_layout(model).model_parallel:  # every rank's step collectives must pair up
            raise ValueError(
                "compile='background' runs in one process: use compile='decode' with parallelism"
            )
        reason = background_compile.background_unavailable_reason()
        if reason is not None:
            raise ValueError(f"compile='background': {reason}")
    param = next(model.parameters())
    kv_dtype = config.kv_dtype(dtype or param.dtype)
    head_dim = attention_dims(model)[1]
    if config.backend != "auto":
        reason = unavailable_reason(config.backend, param.device, kv_dtype, head_dim)
        if reason is not None:
            raise ValueError(f"backend {config.backend!r} cannot serve this model here: {reason}")
    align = 4  # an int8 cache's rows are padded as the backend the engine will pick asks (Triton: 16)
    if kv_quant.is_quantized(kv_dtype):
        backend = get_backend(config.backend, param.device, kv_dtype, head_dim, attention_needs(model))
        align = backend.capabilities.quantized_row_align
    block_bytes = kv_bytes_per_token(model, kv_dtype, align) * config.block_size
    tp_size = getattr(parallel_layout(model).tp, "size", 1)
    if tp_size > 1:  # a rank holds its share of the KV heads
        kv_heads = attention_dims(model)[0]
        block_bytes = block_bytes * max(1, kv_heads // tp_size) // kv_heads
    draft = config.speculative
    if is_draft_model(draft):  # its cache has as many blocks as the model's: the budget pays both
        draft_dtype = config.kv_dtype(next(draft.parameters()).dtype)
        block_bytes += kv_bytes_per_token(draft, draft_dtype, align) * config.block_size
    memory = config.kv_cache_memory
    budget = int(memory * free_memory_bytes(param.device)) if isinstance(memory, float) else memory
    state = state_bytes_per_sequence(model) * (config.max_num_seqs or 1)  # held whole for every seat
    if state >= budget:
        seats = f"max_num_seqs={config.max_num_seqs}" if config.max_num_seqs else "one"
        raise ValueError(
            f"kv_cache_memory gives {budget:,} bytes, less than the recurrent state of {seats} sequences "
            f"({state:,} bytes): raise kv_cache_memory or lower max_num_seqs"
        )
    if block_bytes == 0:  # no layer keeps K/V: the state is all the budget holds
        return
    budget -= state
    blocks = budget // block_bytes
    needed = -(-context // config.block_size)
    if blocks < needed:
        given = (
            f"{memory} of the free memory = {budget:,} bytes"
            if isinstance(memory, float)
            else f"{budget:,} bytes"
        )
        fits = f", or set max_model_len to at most {blocks * config.block_size}" if blocks > 0 else ""
        raise ValueError(
            f"kv_cache_memory ({given}) holds {blocks} KV blocks of {config.block_size} tokens "
            f"({block_bytes:,} bytes each for this model{' and its draft model' if is_draft_model(draft) else ''} "
            f"in {kv_dtype}), but one request of max_model_len="
            f"{context} tokens needs {needed}: raise kv_cache_memory to at least {needed * block_bytes:,} "
            f"bytes{fits}"
        )
