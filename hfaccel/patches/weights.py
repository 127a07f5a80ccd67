"""``patch(model, weights=...)``: the weights' precision in one line, for users who ask for speed.

``None`` (the default) leaves the model as it is: exact parity with transformers on the user's own
model. ``"auto"`` casts a float32 model to the dtype this device computes fastest
(`kernels.cpu_features.fast_dtype`: bfloat16 on a CPU with native bf16 matmuls and on CUDA, float32
on an AVX2-only CPU, where bf16 is emulated and about 4x slower); ``"bfloat16"``, ``"float16"`` and
``"float32"`` cast to that dtype. The cast is the model's own ``.to(dtype)``, in place, as torchao's
``quantize_`` works: the model keeps the new dtype after ``unpatch``. Its greedy tokens are
transformers' on the cast model, which differ from the float32 model's where two logits are close.
"""

from __future__ import annotations

from typing import Any

import torch

from hfaccel.kernels.cpu_features import fast_dtype

WEIGHTS = ("auto", "bfloat16", "float16", "float32")
# Asked for, measured, and not offered yet: why (shown in the error).
NOT_YET = {
    "int8": (
        "torchao's int8 weight-only layers run slower than float32 in an eager step on a CPU (SmolLM2's "
        "decode step 58.9 ms against 40.4 ms, AVX512+BF16): not offered until the compiled step fuses "
        "them; a model you quantize with torchao yourself is served, with transformers' tokens"
    ),
    "int4": (
        "torchao 0.18's int4 CPU layouts need packages that do not install here (mslk, the opaque "
        "packing format): not offered yet"
    ),
}


def apply_weights(model: Any, weights: str | None) -> torch.dtype | None:
    """Cast `model` as `weights` says (see the module doc); the dtype it now has, None if untouched.
    Raises ValueError, naming the parameter, for an unknown value or a model that cannot be cast."""
    if weights is None:
        return None
    if weights in NOT_YET:
        raise ValueError(f"weights={weights!r}: {NOT_YET[weights]}")
    if weights not in WEIGHTS:
        raise ValueError(
            f"weights={weights!r} is not one of {', '.join(map(repr, WEIGHTS))} (or None: as it is)"
        )
    params = list(model.parameters())
    current = params[0].dtype
    if weights == "auto":
        if current != torch.float32:  # already reduced precision: the user chose it
            return None
        dtype = fast_dtype(params[0].device)
    else:
        dtype = getattr(torch, weights)
    if current == dtype and all(p.dtype == dtype for p in params if p.is_floating_point()):
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
