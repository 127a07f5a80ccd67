"""What a pipeline stage computes outside its decoder layers, as the model's own forward computes it:
the token embeddings (the first stage), the rotary position embeddings every layer is given, and the
logits from the final norm's output (the last stage); and the patch-time check that these are what the
model computes (`unsupported_reason`).

A stage cannot call the model's own forward (it runs a slice of the layers), so these are written out:
Llama's shape, with the model-level scales some families add (Granite's embedding multiplier and logits
scaling, Cohere's logit scale, the final soft-capping of Gemma 2's kind). A family whose forward does
anything else is found by the check, on a forward of four tokens of the whole model at patch time
(every rank still holds it), and refused before any process group is touched.
"""

from __future__ import annotations

from typing import Any

import torch

from hfaccel.patches.arguments import CACHE_NAME

# The keyword arguments a stage gives each layer, and those transformers also passes that change nothing
# in a forward without a cache (`output_router_logits`: the router logits are recorded by hooks).
LAYER_KEYWORDS = {"attention_mask", "position_embeddings", "position_ids", CACHE_NAME, "use_cache"}
IGNORED_KEYWORDS = {"output_router_logits", "cache_position"}


class StageModel:
    """The parts of `model`'s forward around its decoder layers."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        config = model.config.get_text_config(decoder=True)
        self.embedding_multiplier = getattr(config, "embedding_multiplier", None)  # Granite
        self.logits_scaling = getattr(config, "logits_scaling", None)  # Granite: logits divided by it
        self.logit_scale = getattr(config, "logit_scale", None)  # Cohere: logits multiplied by it
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.base.embed_tokens(input_ids)
        return hidden if self.embedding_multiplier is None else hidden * self.embedding_multiplier

    def position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        return self.base.rotary_emb(hidden, position_ids=positions)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The logits of the final norm's output `normed`."""
        logits = self.model.get_output_embeddings()(normed)
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def unsupported_reason(model: Any) -> str | None:
    """Why pipeline stages would compute other than `model`'s own forward (None: they compute the same):
    a forward of four tokens, its layer 0 inputs and final norm output caught by hooks, against
    `StageModel`'s embeddings, position embeddings and logits."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    missing = [n for n in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(base, n)]
    if missing:
        return (
            f"pipeline stages run Llama-style decoders (embed_tokens, rotary_emb, layers, norm); "
            f"{type(model).__name__} lacks {', '.join(missing)}"
        )
    parameter = next(model.parameters())
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(4, device=parameter.device) % vocab)[None]
    positions = torch.arange(4, device=parameter.device)[None]
    seen: dict[str, Any] = {}

    def layer_inputs(module: Any, args: tuple, kwargs: dict) -> None:
        seen.setdefault("hidden", args[0] if args else kwargs.get("hidden_states"))
        seen.setdefault("kwargs", kwargs)

    def norm_output(module: Any, args: tuple, output: torch.Tensor) -> None:
        seen["normed"] = output

    hooks = [
        base.layers[0].register_forward_pre_hook(layer_inputs, with_kwargs=True),
        base.norm.register_forward_hook(norm_output),
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    stage = StageModel(model)
    name = type(model).__name__
    with torch.no_grad():
        hidden = stage.embed(ids)
        if seen.get("hidden") is None or not torch.equal(hidden, seen["hidden"]):
            return f"{name}'s forward computes its first layer's input other than from the token embeddings"
        extra = sorted(set(seen["kwargs"]) - LAYER_KEYWORDS - IGNORED_KEYWORDS)
        if extra:
            return f"{name}'s decoder layers are given {', '.join(extra)}, which a stage does not pass"
        try:
            position_embeddings = stage.position_embeddings(hidden, positions)
        except TypeError as error:  # Gemma 3's rotary embedding asks for each layer's type
            return f"{name}'s rotary embedding takes arguments a stage does not pass ({error})"
        if not _same(position_embeddings, seen["kwargs"].get("position_embeddings")):
            return f"{name}'s layers are given other position embeddings than its rotary_emb's"
        if "normed" not in seen or not torch.allclose(
            stage.logits(seen["normed"]), logits, rtol=1e-5, atol=1e-5
        ):
            return f"{name}'s forward computes its logits other than from its final norm and LM head"
    return None


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
        return ours.shape == theirs.shape and torch.equal(ours, theirs)
    if isinstance(ours, (tuple, list)) and isinstance(theirs, (tuple, list)):
        return len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs))
    return False
