"""Llama's decoder layers run op for op without ``nn.Module``'s call machinery, for the lean forward.

An eager decode step of a small model is mostly Python: each Llama layer calls 13 modules through
``Module.__call__`` (hook checks, the ``_wrapped_call_impl`` / ``_call_impl`` pair) and two forwards
through transformers' ``deprecate_kwarg`` wrapper, about 30 us a layer on the two-core CPU of
docs/benchmarks.md, a tenth of a four-layer model's step. `run_layer` computes a layer as transformers'
Llama code does, the same torch ops on the same tensors in the same order (so the same bits), and
calls what it does not write out (the linear layers, the activation) by their class's ``forward``.

It writes out a module only where calling it would run nothing else: the module is exactly
transformers' Llama class, whose ``forward`` is still transformers' own (not replaced on the class,
as Liger or the kernels hub do, nor on the instance, as accelerate's hooks do), with no forward hooks
and not compiled in place; the attention's config is one the engine's attention serves in this
thread, and transformers' module still looks up the same rotary and attention functions. Each is
checked at every call, module by module: a hook added to one linear layer sends only that layer
through ``Module.__call__``, and a module of another class (a LoRA layer, a quantized linear) is
called as the model would call it. The lean forward that calls this is itself checked once against the
model's own forward, bit for bit (`layer_loop.LeanForward`). Backward hooks are not looked at: an
engine step runs without gradients, where they change nothing.

Other families copy Llama's layer with changes (a sliding window, q/k norms, biases); they keep
``Module.__call__`` until each is written out here and checked.
"""

from __future__ import annotations

import functools
import inspect
import sys
from types import ModuleType
from typing import Any

import torch
from torch.nn.modules import module as torch_module

from hfaccel.patches.arguments import CACHE_NAME
from hfaccel.patches.attention import paged_attention_forward, serves_config

_LLAMA = "transformers.models.llama.modeling_llama"


def _plain(module: Any) -> bool:
    """Whether calling `module` runs exactly its class's ``forward`` (global hooks: checked by the caller)."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._compiled_call_impl is not None
        or "forward" in module.__dict__
    )


def _call(module: Any, *args: Any) -> Any:
    """``module(*args)``, through its class's ``forward`` where that is all the call would run."""
    if _plain(module):
        return type(module).forward(module, *args)
    return module(*args)


def _tensor(module: Any, name: str) -> Any:
    """``module.<name>`` for a parameter, without ``Module.__getattr__`` where it is a registered one."""
    parameters = module._parameters
    return parameters[name] if name in parameters else getattr(module, name)


class _Llama:
    """transformers' Llama classes and the functions their forwards look up, as first seen; None where
    one of them was already someone else's code then."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.layer, self.attention = module.LlamaDecoderLayer, module.LlamaAttention
        self.mlp, self.norm = module.LlamaMLP, module.LlamaRMSNorm
        self.forwards = {cls: cls.forward for cls in (self.layer, self.attention, self.mlp, self.norm)}
        self.rotary = module.apply_rotary_pos_emb
        self.rotate_half = module.rotate_half

    def own_code(self) -> bool:
        """Whether every forward and function here is transformers' Llama code (read once)."""
        functions = [*self.forwards.values(), self.rotary, self.rotate_half]
        return all(
            inspect.unwrap(function).__module__ == _LLAMA
            and inspect.unwrap(function).__qualname__.split(".")[0] in _LLAMA_NAMES
            for function in functions
        )

    def intact(self) -> bool:
        """Whether the classes' forwards and the module's functions are still the ones first seen, and the
        attention a served config gets is still the engine's (a few identity checks a step)."""
        module = self.module
        return (
            all(cls.forward is forward for cls, forward in self.forwards.items())
            and module.apply_rotary_pos_emb is self.rotary
            and module.rotate_half is self.rotate_half
            and module.ALL_ATTENTION_FUNCTIONS.get("hfaccel") is paged_attention_forward
        )


_LLAMA_NAMES = {
    "LlamaDecoderLayer",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaRMSNorm",
    "apply_rotary_pos_emb",
    "rotate_half",
}


@functools.cache
def _llama(module: ModuleType) -> _Llama | None:
    llama = _Llama(module)
    return llama if llama.own_code() else None


def step_layers() -> _Llama | None:
    """What `run_layer` needs for this step, or None where no layer can be written out now (Llama's code
    not loaded, replaced, or global hooks that every module call would run)."""
    module = sys.modules.get(_LLAMA)
    if module is None or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return None
    llama = _llama(module)
    return llama if llama is not None and llama.intact() else None


def run_layer(
    llama: _Llama,
    layer: Any,
    hidden: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    positions: Any,
) -> torch.Tensor | None:
    """`layer`'s output for `hidden`, as ``layer(hidden, attention_mask=None, position_embeddings=cos_sin,
    position_ids=positions, cache=None, use_cache=False)`` computes it; None where `layer` is not a plain
    Llama decoder layer (call it then)."""
    if type(layer) is not llama.layer or not _plain(layer):
        return None
    modules = layer._modules
    residual = hidden
    hidden = _norm(llama, modules["input_layernorm"], hidden)
    hidden = residual + _attention(llama, modules["self_attn"], hidden, cos_sin, positions)
    residual = hidden
    hidden = _norm(llama, modules["post_attention_layernorm"], hidden)
    return residual + _mlp(llama, modules["mlp"], hidden)


def _norm(llama: _Llama, norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``."""
    if type(norm) is not llama.norm or not _plain(norm):
        return norm(hidden)
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return _tensor(norm, "weight") * hidden.to(input_dtype)


def _mlp(llama: _Llama, mlp: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP.forward``."""
    if type(mlp) is not llama.mlp or not _plain(mlp):
        return mlp(hidden)
    modules = mlp._modules
    gate = _call(modules["act_fn"], _call(modules["gate_proj"], hidden))
    return _call(modules["down_proj"], gate * _call(modules["up_proj"], hidden))


def _attention(
    llama: _Llama,
    attention: Any,
    hidden: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    positions: Any,
) -> torch.Tensor:
    """``LlamaAttention.forward`` without a cache, its attention function the engine's, and its first
    output (the layer drops the weights)."""
    if type(attention) is not llama.attention or not _plain(attention) or not serves_config(attention.config):
        return attention(
            hidden_states=hidden,
            attention_mask=None,
            position_ids=positions,
            **{CACHE_NAME: None},
            use_cache=False,
            position_embeddings=cos_sin,
        )[0]
    modules = attention._modules
    input_shape = hidden.shape[:-1]
    hidden_shape = (*input_shape, -1, attention.head_dim)
    query = _call(modules["q_proj"], hidden).view(hidden_shape).transpose(1, 2)
    key = _call(modules["k_proj"], hidden).view(hidden_shape).transpose(1, 2)
    value = _call(modules["v_proj"], hidden).view(hidden_shape).transpose(1, 2)
    cos, sin = cos_sin
    query, key = _rotary(llama, query, key, cos, sin)
    output, _ = paged_attention_forward(
        attention,
        query,
        key,
        value,
        None,
        dropout=0.0 if not attention.training else attention.attention_dropout,
        scaling=attention.scaling,
        position_ids=positions,
        use_cache=False,
    )
    output = output.reshape(*input_shape, -1).contiguous()
    return _call(modules["o_proj"], output)


def _rotary(
    llama: _Llama, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` (transformers' ``rotate_half`` inlined)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (query * cos) + (_rotate_half(query) * sin), (key * cos) + (_rotate_half(key) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
