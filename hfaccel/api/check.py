"""`hfaccel.check(model)`: before the first `generate`, what of this model runs on the engine (per layer
kind and per attention backend), and what will not and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hfaccel.kernels.selection import ATTENTION_NEEDS, BACKEND_NAMES, get_backend, unavailable_reason
from hfaccel.patches.layer_support import attention_needs, kv_layers, kv_window, sliding_layers
from hfaccel.patches.models import attention_dims, max_model_len, model_reason

# Calls that go to transformers' generate whatever the model (patches/planner.py's gates), for the report.
ALWAYS_FALLS_BACK = (
    "diverse and constrained beam search",
    "negative prompts (classifier-free guidance), custom_generate",
)


@dataclass
class ModelCheck:
    """What `check` found. `served`: `patch` accepts the model (else `reason`). `layers`: decoder layers
    by kind. `needs`: what they ask of an attention backend beyond causal attention. `backends`: each
    backend's answer here (None: it serves the model), `backend`: the one ``"auto"`` picks."""

    model: str
    served: bool
    reason: str | None
    layers: dict[str, int] = field(default_factory=dict)
    needs: list[str] = field(default_factory=list)
    backends: dict[str, str | None] = field(default_factory=dict)
    backend: str | None = None
    max_model_len: int | None = None
    kv_memory: str = ""
    attends: bool = True  # False: no layer calls attention (a purely recurrent model)

    def __str__(self) -> str:
        lines = [f"hfaccel.check: {self.model}"]
        if not self.served:
            lines.append(f"  refused at patch: {self.reason}")
            return "\n".join(lines)
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.layers.items())
        lines.append(f"  served on the engine: {kinds}; up to {self.max_model_len} tokens")
        wanted = ", ".join(ATTENTION_NEEDS[n] for n in self.needs) or "plain causal attention"
        wanted = wanted if self.attends else "none (every layer is recurrent)"
        lines.append(f"  attention: {wanted}")
        lines.append(f"  KV memory: {self.kv_memory}")
        for name, answer in self.backends.items():
            mark = "picked by 'auto'" if name == self.backend else ("serves it" if answer is None else answer)
            lines.append(f"    {name:<11} {mark}")
        lines.append(
            "  falls back to transformers' generate (one warning naming the reason), whatever the model:"
        )
        lines.extend(f"    {item}" for item in ALWAYS_FALLS_BACK)
        return "\n".join(lines)


def check(model: Any) -> ModelCheck:
    """Say what of `model` runs on the engine before the first `generate` (runs the guard's 4-token
    probe forward once; nothing is patched)."""
    name = f"{type(model).__name__} ({getattr(getattr(model, 'config', None), 'model_type', '?')})"
    reason = model_reason(model)
    if reason is not None:
        return ModelCheck(name, False, reason)
    text_config = model.config.get_text_config(decoder=True)
    types = list(getattr(text_config, "layer_types", None) or ())[: text_config.num_hidden_layers]
    layers = dict(Counter(types)) if types else {"full_attention": text_config.num_hidden_layers}
    attending = kv_layers(model)
    if attending is not None and not types:  # Mamba's config names no layer types
        counts = {"attention": len(attending), "recurrent": text_config.num_hidden_layers - len(attending)}
        layers = {kind: count for kind, count in counts.items() if count}
    needs = attention_needs(model)
    param = next(model.parameters())
    head_dim = attention_dims(model)[1]
    backends = {
        backend: unavailable_reason(backend, param.device, param.dtype, head_dim, needs)
        for backend in BACKEND_NAMES
        if backend != "auto"
    }
    chosen = get_backend("auto", param.device, param.dtype, head_dim, needs).name
    longest = max_model_len(model, None)
    memory = _kv_memory(model)
    return ModelCheck(
        name, True, None, layers, sorted(needs), backends, chosen, longest, memory, attending != frozenset()
    )


def _kv_memory(model: Any) -> str:
    """How a sequence's KV memory grows on the engine (`layer_support.kv_window`, `sliding_layers`,
    `kv_layers`)."""
    attending = kv_layers(model)
    if attending is not None:
        total = model.config.get_text_config(decoder=True).num_hidden_layers
        state = f"a fixed-size state per sequence in the {total - len(attending)} recurrent layers"
        if not attending:
            return f"none (no layer attends): {state}"
        return f"grows with the sequence in the {len(attending)} attention layers only; {state}"
    window = kv_window(model)
    if window is not None:
        return f"bounded by the window ({window} positions): every layer slides, older blocks are given back"
    sliding = sliding_layers(model)
    if sliding:
        return (
            f"the {len(sliding)} sliding layers' bounded by their window ({max(sliding.values())} positions), "
            "in a pool of their own (window_pool); the full layers' grows with the sequence"
        )
    return "grows with the sequence (every layer reads every key)"
