"""Llama-style decoder layers run op for op without ``nn.Module``'s call machinery, for the lean forward.

An eager decode step of a small model is mostly Python: each Llama layer calls 13 modules through
``Module.__call__`` (hook checks, the ``_wrapped_call_impl`` / ``_call_impl`` pair) and two forwards
through transformers' ``deprecate_kwarg`` wrapper, about 30 us a layer on the two-core CPU of
docs/benchmarks.md, a tenth of a four-layer model's step. `run_layer` computes a layer as transformers'
code does, the same torch ops on the same tensors in the same order (so the same bits): a plain
``nn.Linear`` as ``F.linear`` of its registered weight and bias, the activation by its class's
``forward``. Four families share the code (transformers 5.17 to 5.24; `_SPECS`): Llama (and SmolLM2),
Mistral, Qwen2 and Qwen3, which differ in the sliding window their attention passes and Qwen3's per-head
q/k norms.

It writes out a module only where calling it would run nothing else, checked at every call, module by
module: the module is exactly the family's class, whose ``forward`` and ``__call__`` are still
transformers' and torch's own (judged by their code's file along the ``__wrapped__`` chain: a
``functools.wraps`` wrapper copies names, not code; not replaced on the class, as Liger or the kernels
hub do, nor on the instance, as accelerate's hooks do), with no forward hooks, not compiled in place, its
children still submodules; the attention's config is one the engine's attention serves in this thread;
the family's module still looks up the same rotary and attention functions, and torch's module call and
``Linear.forward`` are torch's. A hook added to one linear layer sends only that layer through
``Module.__call__``, also when it comes between two steps of one call (which the model watch sees only
at the next admission), and a module of another class (a LoRA layer, a quantized linear) is called as
the model would call it. The lean forward that calls this is itself checked once against the model's
own forward, bit for bit (`layer_loop.LeanForward`). Backward hooks are not looked at: an engine step
runs without gradients, where they change nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import transformers
from torch.nn.modules import module as torch_module

from hfaccel.patches.arguments import CACHE_NAME
from hfaccel.patches.attention import paged_attention_forward, serves_config


@dataclass(frozen=True)
class _Spec:
    """How a family's layer code differs from Llama's (read from transformers 5.17 and 5.24)."""

    prefix: str  # its classes' names: <prefix>DecoderLayer, <prefix>Attention, <prefix>MLP, <prefix>RMSNorm
    window: str | None  # the attention's `sliding_window` argument: None (not passed), "attribute"
    # (``self.sliding_window``) or "config" (``getattr(self.config, "sliding_window", None)``)
    qk_norm: bool = False  # RMS norms of each head's query and key before the rotary embedding


_SPECS = {
    "transformers.models.llama.modeling_llama": _Spec("Llama", None),
    "transformers.models.mistral.modeling_mistral": _Spec("Mistral", "config"),
    "transformers.models.qwen2.modeling_qwen2": _Spec("Qwen2", "attribute"),
    "transformers.models.qwen3.modeling_qwen3": _Spec("Qwen3", "attribute", qk_norm=True),
}

# What calling a module runs, as torch defines it: `run_layer` stands in for these, so it writes nothing
# out while someone replaced either (a library instrumenting every module call).
_MODULE_CALL, _CALL_IMPL = torch.nn.Module.__call__, torch.nn.Module._call_impl
_LINEAR_FORWARD = torch.nn.Linear.forward
_TORCH_MODULE_FILE = torch_module.__file__
_TRANSFORMERS_DIR = os.path.dirname(transformers.__file__) + os.sep


def _defined_in(function: Any, file: str, name: str) -> bool:
    """Whether `function` is `name` as written in `file`, or transformers' own wrappers around it: every
    function of its ``__wrapped__`` chain has its code in transformers (a ``functools.wraps`` wrapper of
    someone else's copies the wrapped function's names, not its code), the innermost one `name` in `file`."""
    while True:
        code = getattr(function, "__code__", None)
        inner = getattr(function, "__wrapped__", None)
        if code is None:
            return False
        if inner is None:
            return code.co_filename == file and code.co_name == name
        if not code.co_filename.startswith(_TRANSFORMERS_DIR):
            return False
        function = inner


def _torch_calls() -> bool:
    """Whether a module call still runs torch's own ``__call__`` and ``_call_impl``, and a linear layer
    torch's ``forward``."""
    return (
        torch.nn.Module.__call__ is _MODULE_CALL
        and torch.nn.Module._call_impl is _CALL_IMPL
        and torch.nn.Linear.forward is _LINEAR_FORWARD
    )


def _plain(module: Any, call: Any = _MODULE_CALL) -> bool:
    """Whether calling `module` runs exactly its class's ``forward``: its class calls as torch's modules do
    (`call`: what it should be for its class), no forward hooks (global ones: checked by `step_family`),
    not compiled in place, no ``forward`` of the instance's own."""
    return not (
        type(module).__call__ is not call
        or module._forward_hooks
        or module._forward_pre_hooks
        or module._compiled_call_impl is not None
        or "forward" in module.__dict__
    )


def _call(module: Any, *args: Any) -> Any:
    """``module(*args)``, through its class's ``forward`` where that is all the call would run (a plain
    ``nn.Linear``'s: ``F.linear`` of its weight and bias, read without ``Module.__getattr__``)."""
    if not _plain(module):
        return module(*args)
    if type(module) is torch.nn.Linear:
        return torch.nn.functional.linear(*args, _tensor(module, "weight"), _tensor(module, "bias"))
    return type(module).forward(module, *args)


def _children(module: Any, names: tuple[str, ...]) -> list[Any] | None:
    """`module`'s submodules `names`, read before anything runs (None: one is not a submodule now)."""
    modules = module._modules
    children = [modules.get(name) for name in names]
    return None if None in children else children


def _tensor(module: Any, name: str) -> Any:
    """``module.<name>`` for a parameter, without ``Module.__getattr__`` where it is a registered one (and
    no attribute of the instance's own shadows it, as it would the attribute's lookup)."""
    parameters = module._parameters
    if name in parameters and name not in module.__dict__:
        return parameters[name]
    return getattr(module, name)


class Family:
    """A family's classes and the functions their forwards look up, as first seen."""

    def __init__(self, module: ModuleType, spec: _Spec) -> None:
        self.module, self.spec = module, spec
        prefix = spec.prefix
        self.layer = getattr(module, f"{prefix}DecoderLayer")
        self.attention = getattr(module, f"{prefix}Attention")
        self.mlp, self.norm = getattr(module, f"{prefix}MLP"), getattr(module, f"{prefix}RMSNorm")
        self.forwards = {cls: cls.forward for cls in (self.layer, self.attention, self.mlp, self.norm)}
        # Transformers 5.17's layers call through GradientCheckpointingLayer.__call__ (its checkpointing
        # runs only with gradients), 5.24's through torch's.
        self.layer_call = self.layer.__call__
        self.rotary, self.rotate_half = module.apply_rotary_pos_emb, module.rotate_half
        self.attention_names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if spec.qk_norm:
            self.attention_names += ("q_norm", "k_norm")

    def own_code(self) -> bool:
        """Whether every forward and function here is the family's own transformers code, and module calls
        torch's (read once)."""
        file = self.module.__file__
        # (5.17's GradientCheckpointingLayer.__call__, transformers' own, or torch's)
        checkpointing = sys.modules["transformers.modeling_layers"].__file__
        layer_call = self.layer_call is _MODULE_CALL or _defined_in(
            self.layer_call, checkpointing, "__call__"
        )
        return (
            _torch_calls()
            and _defined_in(_MODULE_CALL, _TORCH_MODULE_FILE, "_wrapped_call_impl")
            and _defined_in(_CALL_IMPL, _TORCH_MODULE_FILE, "_call_impl")
            and _defined_in(_LINEAR_FORWARD, sys.modules[torch.nn.Linear.__module__].__file__, "forward")
            and layer_call
            and all(_defined_in(forward, file, "forward") for forward in self.forwards.values())
            and _defined_in(self.rotary, file, "apply_rotary_pos_emb")
            and _defined_in(self.rotate_half, file, "rotate_half")
        )

    def intact(self) -> bool:
        """Whether the classes' forwards and the module's functions are still the ones first seen, module
        calls torch's, and the attention a served config gets is still the engine's (identity checks)."""
        module = self.module
        return (
            _torch_calls()
            and self.layer.__call__ is self.layer_call
            and all(cls.forward is forward for cls, forward in self.forwards.items())
            and module.apply_rotary_pos_emb is self.rotary
            and module.rotate_half is self.rotate_half
            and module.ALL_ATTENTION_FUNCTIONS.get("hfaccel") is paged_attention_forward
        )


_families: dict[str, Family] = {}  # a family's classes and functions as first seen to be transformers' own


def _family(name: str) -> Family | None:
    """`name`'s family, where it is one written out here and its code is transformers' own (None: not).
    Only a yes is kept: code replaced when first asked and put back later is written out from then on."""
    family = _families.get(name)
    if family is not None:
        return family
    spec, module = _SPECS.get(name), sys.modules.get(name)
    if spec is None or module is None:
        return None
    family = Family(module, spec)
    if not family.own_code():
        return None
    return _families.setdefault(name, family)


def step_family(layers: Any) -> Family | None:
    """The family whose layers `run_layer` writes out in this step, from the class of `layers`' first
    (None: none can be now: a family not written out, its code replaced, or global hooks, which every
    module call would run)."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks or not len(layers):
        return None
    family = _family(type(layers[0]).__module__)
    return family if family is not None and family.intact() else None


_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def run_layer(
    family: Family,
    layer: Any,
    hidden: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    positions: Any,
) -> torch.Tensor | None:
    """`layer`'s output for `hidden`, as ``layer(hidden, attention_mask=None, position_embeddings=cos_sin,
    position_ids=positions, cache=None, use_cache=False)`` computes it; None where `layer` is not a plain
    decoder layer of `family` (call it then)."""
    if type(layer) is not family.layer or not _plain(layer, family.layer_call):
        return None
    if layer.gradient_checkpointing and layer.training:  # transformers' checkpointing wrapper decides
        return None
    if (parts := _children(layer, _LAYER_PARTS)) is None:
        return None
    input_norm, attention, post_norm, mlp = parts
    residual = hidden
    hidden = _norm(family, input_norm, hidden)
    hidden = residual + _attention(family, attention, hidden, cos_sin, positions)
    residual = hidden
    hidden = _norm(family, post_norm, hidden)
    return residual + _mlp(family, mlp, hidden)


def _norm(family: Family, norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``."""
    if type(norm) is not family.norm or not _plain(norm):
        return norm(hidden)
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return _tensor(norm, "weight") * hidden.to(input_dtype)


def _mlp(family: Family, mlp: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP.forward``."""
    if type(mlp) is not family.mlp or not _plain(mlp) or (parts := _children(mlp, _MLP_PARTS)) is None:
        return mlp(hidden)
    gate_proj, up_proj, down_proj, act_fn = parts
    return _call(down_proj, _call(act_fn, _call(gate_proj, hidden)) * _call(up_proj, hidden))


def _attention(
    family: Family,
    attention: Any,
    hidden: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    positions: Any,
) -> torch.Tensor:
    """``LlamaAttention.forward`` (with the family's differences) without a cache, its attention function
    the engine's, and its first output (the layer drops the weights)."""
    if (
        type(attention) is not family.attention
        or not _plain(attention)
        or not serves_config(attention.config)
        or (parts := _children(attention, family.attention_names)) is None
    ):
        return attention(
            hidden_states=hidden,
            attention_mask=None,
            position_ids=positions,
            **{CACHE_NAME: None},
            use_cache=False,
            position_embeddings=cos_sin,
        )[0]
    spec, (q_proj, k_proj, v_proj, o_proj, *qk_norms) = family.spec, parts
    input_shape = hidden.shape[:-1]
    hidden_shape = (*input_shape, -1, attention.head_dim)
    query = _call(q_proj, hidden).view(hidden_shape)
    if qk_norms:  # Qwen3: each head's query and key normed before the rotary embedding
        query = _norm(family, qk_norms[0], query)
    key = _call(k_proj, hidden).view(hidden_shape)
    if qk_norms:
        key = _norm(family, qk_norms[1], key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = _call(v_proj, hidden).view(hidden_shape).transpose(1, 2)
    cos, sin = cos_sin
    query, key = _rotary(query, key, cos, sin)
    window = {}
    if spec.window == "attribute":
        window["sliding_window"] = attention.sliding_window
    elif spec.window == "config":
        window["sliding_window"] = getattr(attention.config, "sliding_window", None)
    output, _ = paged_attention_forward(
        attention,
        query,
        key,
        value,
        None,
        dropout=0.0 if not attention.training else attention.attention_dropout,
        scaling=attention.scaling,
        **window,
        position_ids=positions,
        use_cache=False,
    )
    output = output.reshape(*input_shape, -1).contiguous()
    return _call(o_proj, output)


def _rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` (transformers' ``rotate_half`` inlined)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (query * cos) + (_rotate_half(query) * sin), (key * cos) + (_rotate_half(key) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
