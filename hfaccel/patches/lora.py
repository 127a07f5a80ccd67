"""Many LoRA adapters in one continuous batch: each packed token gets its own request's adapter.

PEFT's mixed-adapter batches (``generate(adapter_names=[...])``) split a padded batch by row: each LoRA
layer adds ``lora_B(lora_A(dropout(x[rows]))) * scaling`` to the rows of each adapter. An engine step
is one packed ``[1, T]`` row holding every request's tokens, so the split has to be by token. During an
engine step whose requests name adapters, the executor puts the step's token groups (adapter name ->
packed token indices, computed once per step) in a thread-local (`adapter_step`); PEFT's LoRA
``Linear.forward``, wrapped once on its class, then computes the base output once and adds each
adapter's delta to its own tokens, the way multi-LoRA servers batch it (S-LoRA, Punica's SGMV, vLLM):

    out = base(x);  for each adapter a in the step:  out[idx_a] += B_a(A_a(dropout_a(x[idx_a]))) * s_a

``"__base__"`` tokens get no delta; tokens of requests that name no adapter (None) get PEFT's own
forward (the model's active adapters, whatever their kind). Outside an engine step (no thread-local, or
another thread) the wrapper calls PEFT's forward unchanged: training, scoring and PEFT's own
``adapter_names`` path are untouched. This is a torch reference: one gather, two small matmuls and one
``index_add_`` per adapter per layer; a grouped kernel (SGMV/BGMV) would fuse them on a GPU.

The engine batches plain LoRA on ``nn.Linear`` layers (biases from ``lora_bias`` included, since the
``lora_B`` module is called). It refuses what it would compute differently from PEFT — LoRA variants
(DoRA, aLoRA...), LoRA on embeddings or convolutions, other PEFT methods, ``modules_to_save`` copies
per adapter, merged adapters — and `patched_generate` sends those calls to PEFT with one warning.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hfaccel.patches.layer_support import has_recurrent_layers

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names
# Why a call goes to PEFT while its per-row hooks sit on the LoRA layers (`peft_row_hooks`).
ROW_HOOKS_REASON = (
    "PEFT's per-row hooks on the LoRA layers (adapter_names or aLoRA offsets: a PeftModel over the patched "
    "base handing them in, or left by a PEFT generate that raised)"
)
# The pre-forward hooks by which PEFT hands each LoRA layer what varies by row.
_ROW_HOOKS = frozenset({"_adapter_names_pre_forward_hook", "_alora_offsets_pre_forward_hook"})


class _ThreadState(threading.local):
    """This thread's engine step's adapter groups, a class default for every thread: a compiled
    forward's guard on it then holds in any thread (`compile="background"` compiles in another)."""

    step: tuple | None = None  # ([(name, index)], num_tokens, head, head's groups) while `adapter_step` runs


_local = _ThreadState()
_install_lock = threading.Lock()
_WRAPPED = "__hfaccel_token_adapters__"


def _lora_module() -> Any:
    try:
        from peft.tuners.lora import layer
    except ImportError:  # peft not installed: no model can hold LoRA layers
        return None
    return layer


def is_lora_layer(module: Any) -> bool:
    """Whether `module` is a PEFT LoRA layer (False without PEFT)."""
    layer = _lora_module()
    return layer is not None and isinstance(module, layer.LoraLayer)


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a PEFT ``PeftModel`` (or a subclass), whose generate takes ``adapter_names``."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def lora_layers(model: torch.nn.Module) -> list[Any]:
    """The PEFT LoRA layers of `model` (any kind: Linear, Embedding, Conv, quantised...)."""
    layer = _lora_module()
    if layer is None:
        return []
    return [m for m in model.modules() if isinstance(m, layer.LoraLayer)]


def adapter_names(model: torch.nn.Module) -> set[str]:
    """Every adapter name some PEFT tuner layer of `model` holds (LoRA's, and other methods': a call
    naming an IA3 adapter is PEFT's to serve, not an unknown name)."""
    if _lora_module() is None:
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer

    names: set[str] = set()
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            names |= _held(module)
    return names


def _held(module: Any) -> set[str]:
    """The adapters a PEFT tuner layer holds (`adapter_layer_names`: its per-adapter module dicts)."""
    held: set[str] = set()
    for attribute in getattr(module, "adapter_layer_names", ()):
        held |= set(getattr(module, attribute, None) or {})
    return held


def _applied_by_default(module: Any, held: set[str]) -> set[str]:
    """The adapters a PEFT module's own forward applies to every token (its active ones it holds)."""
    if getattr(module, "disable_adapters", False):
        return set()
    active = getattr(module, "active_adapters", ())
    return held & set([active] if isinstance(active, str) else active)


def peft_row_hooks(model: torch.nn.Module) -> bool:
    """Whether PEFT's per-row hooks are on this model's LoRA layers: a `PeftModel` wrapping the patched
    base model, called with ``adapter_names`` or with an aLoRA adapter active, takes the batch's names or
    each row's aLoRA offsets out of the call and hands them to each layer through a forward pre-hook
    (`_ROW_HOOKS`), which a packed engine step (one row of many requests) cannot satisfy."""
    for layer in lora_layers(model):
        for hook in layer._forward_pre_hooks.values():
            if getattr(getattr(hook, "func", None), "__name__", "") in _ROW_HOOKS:
                return True
    return False


def row_offsets_reason(model: torch.nn.Module) -> str | None:
    """Why a call whose adapters apply by default goes to PEFT: an aLoRA adapter among them turns on at
    each row's invocation tokens, whose offsets PEFT's generate finds per row and hands each layer (an
    engine step packs many rows into one, and PEFT's forward would look for them in it). None: no such
    adapter is active."""
    for module in lora_layers(model):
        variants = getattr(module, "lora_variant", {})
        for name in sorted(_applied_by_default(module, set(variants))):
            if type(variants[name]).__name__ == "ALoraLinearVariant":
                return f"the aLoRA adapter {name!r} (it turns on at each row's invocation tokens)"
    return None


def check_adapter_names(model: torch.nn.Module, names: Iterable[str | None]) -> None:
    """Raise ValueError for a name no LoRA layer of `model` holds (``"__base__"`` and None always pass),
    with PEFT's message."""
    wanted = {n for n in names if n is not None and n != BASE}
    if not wanted:
        return
    for name in wanted:
        if not isinstance(name, str):
            raise ValueError(f"an adapter name must be a string, got {name!r}")
    unknown = wanted - adapter_names(model)
    if unknown:
        raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}")


def unsupported_reason(model: torch.nn.Module, names: Iterable[str | None]) -> str | None:
    """Why the engine cannot batch the adapters `names` per token on `model` (None: it can).

    Checked on every module that holds one of the named adapters; with any adapter named (``"__base__"``
    included), merged adapters are refused as PEFT refuses them. A module the engine does not route per
    token (LoRA on an embedding, ``modules_to_save`` copies) runs PEFT's own forward, which applies its
    active adapters to every token: refused where it holds a named adapter or applies an active one
    (``"__base__"`` rows, or rows of an adapter it does not hold, would get the active one)."""
    wanted = {n for n in names if n is not None}
    if not wanted:
        return None
    if has_recurrent_layers(
        model
    ):  # a recurrent mixer runs per sequence; per-token LoRA needs the whole step
        return "adapters per request on a model with recurrent layers"
    layer = _lora_module()
    if layer is None:
        return "adapters on a model without PEFT"
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    for module in model.modules():
        if isinstance(module, layer.LoraLayer):
            if module.merged:
                return "adapters with merged LoRA weights (unmerge_adapter first)"
            holds = set(module.lora_A.keys()) | set(module.lora_embedding_A.keys())
            if type(module) is not layer.Linear:
                # Not routed per token: PEFT's own forward runs, its active adapters on every token. Served
                # only where it applies nothing and holds no named adapter (PEFT's mixed batch refuses some
                # such layers outright: DoRA, LoRA on parameters).
                if wanted & holds or _applied_by_default(module, holds):
                    return (
                        f"LoRA on a {type(module).__name__} layer (the engine batches LoRA per request on "
                        "Linear layers only)"
                    )
                continue
            held = wanted & holds
            if not held:
                continue
            for name in sorted(held):
                variant = module.lora_variant.get(name) if hasattr(module, "lora_variant") else None
                if module.use_dora.get(name, False) or variant is not None:
                    kind = "DoRA" if module.use_dora.get(name, False) else type(variant).__name__
                    return f"the LoRA variant {kind} of adapter {name!r}"
        elif isinstance(module, AuxiliaryTrainingWrapper):
            holds = set(getattr(module, "_adapters", ()) or ()) | set(
                getattr(module, "modules_to_save", {}) or {}
            )
            in_play = (wanted & holds) | _applied_by_default(module, holds)  # its active copy: every token
            if in_play:
                return f"modules_to_save of adapter {sorted(in_play)[0]!r}"
        elif isinstance(module, BaseTunerLayer):  # another PEFT method: PEFT's adapter_names skips it too
            parts = type(module).__module__.split(".")  # peft.tuners.<method>.layer
            method = parts[2] if len(parts) > 2 and parts[:2] == ["peft", "tuners"] else type(module).__name__
            return f"{method} adapters (the engine batches LoRA only)"
    return None


@contextmanager
def adapter_step(
    token_adapters: Sequence[str | None],
    device: torch.device,
    rows: Sequence[int] | None = None,
    head: torch.nn.Module | None = None,
) -> Iterator[None]:
    """Inside this block, in this thread, LoRA ``Linear`` layers add each token's own adapter delta.

    `token_adapters` names the adapter of each packed token. Tokens are grouped by adapter once here
    (a contiguous run becomes a slice, anything else one index tensor), and every layer reuses the
    groups. The output embeddings (`head`) see only the step's logit rows, the tokens at `rows`: a LoRA
    there is grouped by those."""
    _install()
    by_row = None if rows is None else (_groups([token_adapters[i] for i in rows], device), len(rows))
    previous = getattr(_local, "step", None)
    _local.step = (_groups(token_adapters, device), len(token_adapters), head, by_row)
    try:
        yield
    finally:
        _local.step = previous


def _groups(
    names: Sequence[str | None], device: torch.device
) -> list[tuple[str | None, slice | torch.Tensor]]:
    """(adapter, its tokens) for each adapter in `names` but ``"__base__"``: a slice or an index tensor."""
    positions: dict[str | None, list[int]] = {}
    for i, name in enumerate(names):
        positions.setdefault(name, []).append(i)
    groups: list[tuple[str | None, slice | torch.Tensor]] = []
    for name, idx in positions.items():
        if name == BASE:
            continue
        if idx[-1] - idx[0] + 1 == len(idx):
            groups.append((name, slice(idx[0], idx[-1] + 1)))
        else:
            groups.append((name, torch.tensor(idx, dtype=torch.long, device=device)))
    return groups


def _install() -> None:
    """Wrap PEFT's LoRA ``Linear.forward`` once (idempotent)."""
    linear = _lora_module().Linear
    if getattr(linear.__dict__["forward"], _WRAPPED, False):
        return
    with _install_lock:
        original = linear.__dict__["forward"]
        if getattr(original, _WRAPPED, False):
            return

        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            step = getattr(_local, "step", None)
            if step is None:
                return original(self, x, *args, **kwargs)
            # PEFT's adapter_names hooks are registered on the modules themselves, so a PEFT generate in
            # another thread (or one that raised: PEFT then leaves them in place) injects its names here
            # too; inside an engine step each token's adapter comes from the step alone.
            kwargs.pop("adapter_names", None)
            return _per_token_forward(self, original, step, x, *args, **kwargs)

        setattr(forward, _WRAPPED, True)
        forward.__wrapped__ = original  # type: ignore[attr-defined]
        forward.__doc__ = original.__doc__
        linear.forward = forward


def _per_token_forward(
    self: Any,
    original: Any,
    step: tuple[list[tuple[str | None, slice | torch.Tensor]], int, Any, Any],
    x: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """PEFT's ``_mixed_batch_forward`` with tokens in place of rows."""
    if self.disable_adapters or self.merged:  # PEFT ignores adapter_names here too
        return original(self, x, *args, **kwargs)
    groups, num_tokens, head, by_row = step
    if self is head and by_row is not None:  # the logit rows only
        groups, num_tokens = by_row
    result = self.base_layer(x, *args, **kwargs)
    out_dtype = result.dtype
    flat_x = x.reshape(-1, x.shape[-1])
    flat = result.view(-1, result.shape[-1])
    if flat_x.shape[0] != num_tokens:
        raise RuntimeError(
            f"hfaccel: a LoRA layer saw {flat_x.shape[0]} tokens in a step of {num_tokens}: "
            "per-token adapters need the packed [1, T] layout"
        )
    lora_a = self.lora_A
    for name, index in groups:
        tokens = flat_x[index]
        if name is None:  # the model as it is: PEFT's own forward on these tokens (active adapters)
            out = original(self, tokens, *args, **kwargs).to(out_dtype)
            if isinstance(index, slice):
                flat[index] = out
            else:
                flat.index_copy_(0, index, out)
            continue
        if name not in lora_a:  # this layer does not hold the adapter: base output, as in PEFT
            continue
        a = lora_a[name]
        delta = self.lora_B[name](a(self.lora_dropout[name](tokens.to(a.weight.dtype)))) * self.scaling[name]
        if isinstance(index, slice):
            flat[index] += delta.to(out_dtype)
        else:
            flat.index_add_(0, index, delta.to(out_dtype))
    return result


def check_call_adapter_names(model: torch.nn.Module, names: Any, rows: int) -> None:
    """PEFT's own checks of ``adapter_names``, with its messages (it raises them before generating)."""
    if not isinstance(names, (list, tuple)):
        raise TypeError(f"Got adapter names of type {type(names)}, expected a list of str.")
    if len(names) != rows:
        raise ValueError(
            "Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(names)} and {rows} respectively."
        )
    if model.training:
        raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
    check_adapter_names(model, names)
