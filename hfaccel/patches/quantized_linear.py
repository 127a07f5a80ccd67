"""``weights="int8"`` and ``weights="int4"``: linear layers that read 1 or half a byte per weight.

On a CPU a decode step reads every weight once, so bytes per weight set a single stream's speed.
torchao quantizes (its int8 weight-only config; its tinygemm groupwise int4 scales), and the
matmul is PyTorch's own packed CPU kernel, which dequantizes inside the product instead of
materialising a float copy of the weight on every call as torchao's eager int8 path does:

- int8: one scale per output row, ``aten._weight_int8pack_mm``;
- int4: asymmetric groups of `INT4_GROUP` input columns (llama.cpp's Q4_1 blocks are 32 wide too),
  ``aten._weight_int4pack_mm_for_cpu``; the output projection (the LM head) stays int8.

Both kernels are vectorised for bfloat16 activations on AVX-512 (float32 activations take a scalar
path, 10x slower), so the model is cast to bfloat16 first. Measured speed and quality are in
docs/benchmarks.md ("Quantized weights"). A layer whose shape a kernel does not take stays bfloat16.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

INT4_GROUP = 32
ACTIVATION_DTYPE = torch.bfloat16


class _FrozenProduct(torch.autograd.Function):
    """A quantized layer's product, differentiable in its input (its weights are frozen), so what lies
    before it (embeddings, norms, LoRA adapters) can still be trained: `layer.input_grad`."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        return layer.product(flat)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.layer.input_grad(grad), None


class _NoFloatWeight:
    """A quantized layer has no float ``weight`` to read, tie or resize: saying so where transformers
    reaches for it (`resize_token_embeddings`, `tie_weights`), rather than a bare AttributeError or a
    resize that leaves the quantized rows behind."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # transformers' tie_weights: a float weight the layer would never read
            self.__getattr__(name)
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name == "weight":  # (still an AttributeError: getattr(layer, "weight", None) gives None)
            raise AttributeError(
                f"{type(self).__name__} holds quantized weights (hfaccel.patch(weights=...)): there is no "
                "float weight to read, tie or resize; reload the model (or resize it before quantizing) to "
                "change its vocabulary"
            )
        return super().__getattr__(name)


def _product(layer: nn.Module, flat: torch.Tensor) -> torch.Tensor:
    """The packed kernel's product, through `_FrozenProduct` where a gradient is wanted."""
    if flat.requires_grad and torch.is_grad_enabled():
        return _FrozenProduct.apply(flat, layer)
    return layer.product(flat)


class Int8Linear(_NoFloatWeight, nn.Module):
    """``y = x @ (q * scale).T + bias`` with ``q`` int8 [out, in] and one scale per output row."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = qdata.shape[1], qdata.shape[0]
        self.register_buffer("qdata", qdata.contiguous())
        self.register_buffer("scale", scale.reshape(-1).to(ACTIVATION_DTYPE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.scale.dtype

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.qdata, self.scale)

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad @ (q * scale)``: the product's gradient in its input, one matmul."""
        dtype = self.activation_dtype
        return (grad.to(dtype) * self.scale) @ self.qdata.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scale.dtype).contiguous()
        out = _product(self, flat)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int4Linear(_NoFloatWeight, nn.Module):
    """``y = x @ W.T + bias`` with W in groups of `INT4_GROUP` columns, each ``(q - 8) * s + z``:
    torchao's tinygemm parameters, packed for PyTorch's CPU int4 kernel."""

    def __init__(
        self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, shape: torch.Size, bias: Any
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(ACTIVATION_DTYPE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, INT4_GROUP, self.scales_and_zeros
        )

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        # The packed layout is the kernel's own: reading the weight back would cost in^2 x out a layer.
        raise RuntimeError(
            "weights='int4' layers pass no gradient to their input (their packed weights are the kernel's "
            "alone): train over weights='int8' or unquantized weights"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In the scales' dtype: `model.float()` / `.half()` cast them, and the kernel takes the two alike.
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        out = _product(self, flat)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP}"
        )


def _torchao() -> Any:
    try:
        import torchao.quantization as quantization
    except ImportError as error:  # an optional extra
        raise ValueError(
            "weights='int8'/'int4' quantize through torchao, which is not installed: "
            "pip install 'hfaccel[quant]'"
        ) from error
    return quantization


def _int8_from_torchao(linear: nn.Linear) -> Int8Linear | None:
    """An `Int8Linear` from a Linear whose weight torchao quantized per row; None if it is not."""
    weight = linear.weight
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if qdata is None or scale is None or qdata.dtype != torch.int8 or qdata.dim() != 2:
        return None
    if tuple(getattr(weight, "block_size", ())) != (1, qdata.shape[1]):
        return None  # per-group or per-tensor: not this kernel's layout
    zero_point = getattr(weight, "zero_point", None)
    if zero_point is not None and bool(zero_point.any()):
        return None
    if getattr(weight, "act_quant_kwargs", None) is not None or qdata.shape[1] % 16:
        return None  # activations quantized too (a different product), or a width the kernel cannot read
    return Int8Linear(qdata.detach(), scale.detach(), linear.bias)


def _int4_parameters(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit values [out, in] (int32, 0..15) and tinygemm's packed bf16 scales and zeros of `weight`.

    torchao's min-max scale per group, rounded to bfloat16 as the kernel reads it; then the zero is
    refit as the group's mean residual and the values requantized against it: measured on SmolLM2,
    perplexity +1.5% over float32 with torchao's own zeros, -0.2% with refit ones."""
    from torchao.quantization.utils import get_groupwise_affine_qparams, pack_tinygemm_scales_and_zeros

    scales, _ = get_groupwise_affine_qparams(
        weight.float(), n_bit=4, groupsize=INT4_GROUP, dtype=ACTIVATION_DTYPE
    )
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // INT4_GROUP, INT4_GROUP)
    step = scales.float().unsqueeze(-1)
    values = torch.round((groups - groups.amin(-1, keepdim=True)) / step).clamp(0, 15)
    zeros = (groups - (values - 8) * step).mean(-1).to(ACTIVATION_DTYPE)
    values = torch.round((groups - zeros.float().unsqueeze(-1)) / step + 8).clamp(0, 15)
    packed_scales = pack_tinygemm_scales_and_zeros(scales, zeros, ACTIVATION_DTYPE)
    return values.reshape(rows, columns).to(torch.int32), packed_scales


def _int4_from_linear(linear: nn.Linear) -> Int4Linear | None:
    """An `Int4Linear` of a float Linear; None if the kernel cannot take its shape."""
    weight = linear.weight.detach()
    if weight.dim() != 2 or weight.shape[1] % INT4_GROUP or weight.shape[0] % 16:
        return None
    values, scales_and_zeros = _int4_parameters(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    return Int4Linear(packed, scales_and_zeros, weight.shape, linear.bias)


def _replace(model: nn.Module, convert: Any) -> int:
    """Swap every Linear for ``convert(linear)`` where that is not None; how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                replacement = convert(child)
                if replacement is not None:
                    setattr(parent, name, replacement)
                    swapped += 1
    return swapped


def _int8_takes(linear: nn.Linear) -> bool:
    """The int8 kernel reads its input in 16-column strips (other widths crash it, or read garbage)."""
    return linear.in_features % 16 == 0


def _int4_takes(linear: nn.Linear) -> bool:
    return linear.in_features % INT4_GROUP == 0 and linear.out_features % 16 == 0


def _plain(linear: nn.Module) -> bool:
    return isinstance(linear, nn.Linear) and type(linear.weight) is nn.Parameter


def _torchao_weight_only_int8(linear: nn.Module) -> bool:
    weight = getattr(linear, "weight", None)
    return type(weight).__name__ == "Int8Tensor" and getattr(weight, "act_quant_kwargs", None) is None


def quantize_linears(model: nn.Module, weights: str) -> int:
    """Quantize `model`'s Linear layers in place (``weights`` "int8" or "int4"; the model is cast to
    bfloat16 first); how many layers now read quantized weights (0: it already did, nothing changed).
    Raises ValueError, before changing anything, when torchao is missing, the model is not on a CPU
    (the kernels are CPU ones) or it has no linear layer the kernel takes besides its output head."""
    quantization = _torchao()
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(
            f"weights={weights!r} runs PyTorch's packed CPU kernels, and the model is on {device}: "
            "quantize it with torchao's own configs instead (a model you quantize is served as it is)"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    other = Int4Linear if weights == "int8" else Int8Linear
    if (
        weights == "int8"
        and any(isinstance(m, Int4Linear) for m in model.modules())
        or (weights == "int4" and any(isinstance(m, Int8Linear) and m is not head for m in model.modules()))
    ):
        kind = "int4" if other is Int4Linear else "int8"
        raise ValueError(
            f"weights={weights!r}: the model's linear layers are already {kind} (an earlier "
            f"patch(weights={kind!r})); requantizing quantized weights is not served: load it again"
        )
    takes = _int8_takes if weights == "int8" else _int4_takes
    quantizable = any(
        m is not head and (_plain(m) or (weights == "int8" and _torchao_weight_only_int8(m))) and takes(m)
        for m in model.modules()
    )
    if not quantizable:
        if any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules()):
            return 0  # quantized by an earlier call
        raise ValueError(
            f"weights={weights!r} quantizes nn.Linear layers, and this model has none the {weights} kernel "
            "takes (its layers may be another type, e.g. GPT-2's Conv1D): leave weights unset"
        )
    for parameter in model.parameters():
        if parameter.is_floating_point() and type(parameter) is nn.Parameter:
            parameter.data = parameter.data.to(ACTIVATION_DTYPE)
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point() and buffer.dtype != ACTIVATION_DTYPE:
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            owner._buffers[name.rpartition(".")[2]] = buffer.to(ACTIVATION_DTYPE)

    def int8_here(module: nn.Module, fqn: str) -> bool:
        # int4 keeps the output projection in int8: SmolLM2's perplexity over float32 goes from +9%
        # (4-bit head) to -0.2%, for 0.2 ms a token (llama.cpp's Q4_K mixes keep theirs at 6 bits).
        return _plain(module) and _int8_takes(module) and (weights == "int8" or module is head)

    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(), filter_fn=int8_here)
    convert = _int8_from_torchao if weights == "int8" else _int8_or_int4
    swapped = _replace(model, convert)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, _NoFloatWeight) and "resize_token_embeddings" not in model.__dict__:
        # transformers resizes the input embeddings first and fails at the head: refuse before either.
        model.resize_token_embeddings = functools.partial(_resize_unless_quantized, model)
    return swapped


def _resize_unless_quantized(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`model`'s own ``resize_token_embeddings``, refused while its LM head holds quantized weights."""
    head = model.get_output_embeddings()
    if isinstance(head, _NoFloatWeight):
        raise AttributeError(
            f"the LM head is an {type(head).__name__}, which holds quantized weights (hfaccel.patch("
            "weights=...)): there is no float weight to resize; reload the model (or resize it before "
            "quantizing) to change its vocabulary"
        )
    return type(model).resize_token_embeddings(model, *args, **kwargs)


def _int8_or_int4(linear: nn.Linear) -> nn.Module | None:
    if type(linear.weight) is not nn.Parameter:
        return _int8_from_torchao(linear)
    return _int4_from_linear(linear)
