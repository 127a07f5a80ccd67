"""``patch(model, weights=...)``: the weights' precision in one line, for users who ask for speed.

``None`` (the default) leaves the model as it is: exact parity with transformers on the user's own
model. ``"auto"`` casts a float32 model to the dtype this device computes fastest
(`kernels.cpu_features.fast_dtype`: bfloat16 on a CPU with native bf16 matmuls and on CUDA, float32
on an AVX2-only CPU, where bf16 is emulated and about 4x slower); ``"bfloat16"``, ``"float16"`` and
``"float32"`` cast to that dtype. The cast is the model's own ``.to(dtype)``, in place, as torchao's
``quantize_`` works: the model keeps the new dtype after ``unpatch``. ``"int8"`` and ``"int4"`` cast
to bfloat16 and quantize the linear layers through torchao onto PyTorch's packed CPU kernels
(`patches.quantized_linear`), in place too. Its greedy tokens are
transformers' on the cast model, which differ from the float32 model's where two logits are close.
"""

from __future__ import annotations

from typing import Any

import torch

from hfaccel.kernels.cpu_features import fast_dtype
from hfaccel.patches.quantized_linear import ACTIVATION_DTYPE as QUANTIZED_ACTIVATIONS
from hfaccel.patches.quantized_linear import quantize_linears

WEIGHTS = ("auto", "bfloat16", "float16", "float32", "int8", "int4")
QUANTIZED = ("int8", "int4")


def apply_weights(model: Any, weights: str | None) -> torch.dtype | None:
    """Cast `model` as `weights` says (see the module doc); the dtype it now has, None if untouched.
    Raises ValueError, naming the parameter, for an unknown value or a model that cannot be cast."""
    if weights is None:
        return None
    _check_name(weights)
    if weights in QUANTIZED:
        return _quantize(model, weights)
    params = list(model.parameters())
    if weights == "auto" and params[0].dtype != torch.float32:  # reduced precision: the user chose it
        return None
    dtype = _cast_dtype(params[0], weights)
    if params[0].dtype == dtype and all(p.dtype == dtype for p in params if p.is_floating_point()):
        return None
    quantized = next(
        (p for p in params if type(p) is not torch.nn.Parameter or not p.is_floating_point()), None
    )
    if quantized is not None:
        raise ValueError(
            f"weights={weights!r}: the model holds quantized weights ({type(quantized).__name__} of "
            f"{quantized.dtype}), which a cast would not keep; leave weights unset"
        )
    model.to(dtype)
    return dtype


def planned_dtype(model: Any, weights: str | None) -> torch.dtype:
    """The dtype of `model`'s first parameter once `apply_weights(model, weights)` has run, changing
    nothing: what the KV cache's size is checked with before the weights change (a patch refused leaves
    them as they were). Raises ValueError for an unknown `weights`, as `apply_weights` does."""
    first = next(model.parameters())
    if weights is None:
        return first.dtype
    _check_name(weights)
    if weights in QUANTIZED:
        return QUANTIZED_ACTIVATIONS
    return _cast_dtype(first, weights)


def _check_name(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(
            f"weights={weights!r} is not one of {', '.join(map(repr, WEIGHTS))} (or None: as it is)"
        )


def _cast_dtype(first: torch.Tensor, weights: str) -> torch.dtype:
    """The dtype a cast to `weights` ("auto" or a dtype's name) gives a model whose first parameter is
    `first`: "auto" leaves reduced precision as the user chose it."""
    if weights != "auto":
        return getattr(torch, weights)
    return fast_dtype(first.device) if first.dtype == torch.float32 else first.dtype


def _quantize(model: Any, weights: str) -> torch.dtype:
    """``weights`` "int8"/"int4": `quantize_linears`, refusing (before changing anything) weights
    quantized some other way and PEFT adapters; None when an earlier call already quantized it."""
    adapters = next(
        (type(m).__name__ for m in model.modules() if type(m).__module__.startswith("peft.")), None
    )
    if adapters is not None:
        raise ValueError(
            f"weights={weights!r}: the model holds PEFT modules ({adapters}), whose adapter layers would be "
            "quantized too, and PEFT cannot add adapters to hfaccel's quantized layers afterwards: "
            + (
                "quantize the base model with torchao before adding them (torchao.quantization.quantize_("
                "model, Int8WeightOnlyConfig()), then get_peft_model, then hfaccel.patch without weights=)"
                if weights == "int8"
                else "PEFT adapts torchao's int8 weight-only layers only, so LoRA over int4 weights is not "
                "served; use an int8 base (torchao's quantize_ before get_peft_model)"
            )
        )
    for name, param in model.named_parameters():
        plain = type(param) is torch.nn.Parameter and param.is_floating_point()
        # torchao's int8 weight-only, re-packed for the fast kernel; not with activations quantized too
        torchao_int8 = (
            type(param).__name__ == "Int8Tensor" and getattr(param, "act_quant_kwargs", None) is None
        )
        if not plain and not (weights == "int8" and torchao_int8):
            raise ValueError(
                f"weights={weights!r}: {name} is already quantized ({type(param).__name__} of "
                f"{param.dtype}); leave weights unset to serve it as it is"
            )
    return QUANTIZED_ACTIVATIONS if quantize_linears(model, weights) else None
