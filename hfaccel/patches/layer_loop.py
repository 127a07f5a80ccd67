"""A decoder's forward as a loop over its layers, for what cannot or should not call the model's own forward.

`AroundLayers` is what the model computes outside its decoder layers: the token embeddings, the rotary
position embeddings every layer is given, and the logits from the final norm's output. A pipeline stage
runs a slice of the layers between them (checked at patch time: `unsupported_reason`); an eager engine
step runs them all, without the wrappers of transformers' top-level forward (`LeanForward`, checked at
its first step).

Both are written out as Llama's shape, with the model-level scales some families add (Granite's
embedding multiplier and logits scaling, Cohere's logit scale, the final soft-capping of Gemma 2's
kind); a family whose forward does anything else is found by each one's check and keeps its own
forward (a pipeline of it is refused before any process group is touched).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.modules import module as torch_module
from transformers import PreTrainedModel

from hfaccel.patches.arguments import CACHE_NAME
from hfaccel.patches.direct_layers import run_layer, step_family
from hfaccel.patches.model_state import marked_packed
from hfaccel.patches.models import all_modules

logger = logging.getLogger("hfaccel")

# The keyword arguments a stage gives each layer, and those transformers also passes that change nothing
# in a forward without a cache (`output_router_logits`: the router logits are recorded by hooks).
LAYER_KEYWORDS = {"attention_mask", "position_embeddings", "position_ids", CACHE_NAME, "use_cache"}
IGNORED_KEYWORDS = {"output_router_logits", "cache_position"}


LLAMA_PARTS = ("embed_tokens", "rotary_emb", "layers", "norm")


def _missing_parts(base: Any) -> list[str]:
    """The Llama-style parts (`LLAMA_PARTS`) decoder `base` lacks."""
    return [name for name in LLAMA_PARTS if not hasattr(base, name)]


def decoder_of(model: Any) -> Any:
    """The module holding `model`'s decoder layers (None: none found)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)


class AroundLayers:
    """The parts of `model`'s forward around its decoder layers."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.base = decoder_of(model)
        self.embedding_multiplier, self.logits_scaling, self.logit_scale, self.softcap = self.scales()

    def scales(self) -> tuple[Any, Any, Any, Any]:
        """The embedding multiplier, logits scaling, logit scale and final soft-cap, read now where
        transformers' forwards read them: Granite's multiplier from its decoder (copied from the config at
        init), Cohere's logit scale from the model, the others from the config (None: not applied)."""
        config = self.model.config.get_text_config(decoder=True)
        multiplier = getattr(self.base, "embedding_multiplier", None)
        scale = getattr(self.model, "logit_scale", None)
        return (
            getattr(config, "embedding_multiplier", None) if multiplier is None else multiplier,
            getattr(config, "logits_scaling", None),  # Granite: logits divided by it
            getattr(config, "logit_scale", None) if scale is None else scale,  # Cohere: multiplied
            getattr(config, "final_logit_softcapping", None),
        )

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
    `AroundLayers`'s embeddings, position embeddings and logits."""
    base = decoder_of(model)
    if missing := _missing_parts(base):
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
    stage = AroundLayers(model)
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


class LeanForward:
    """An eager step's forward as the layer loop, without transformers' top-level forward around it.

    An eager step of a small model spends as much time in the wrappers of that forward (output capture,
    argument checks, mask functions that return None under the engine's attention, output dataclasses)
    as in its attention: about 0.2 ms a step for a four-layer model, 15% of it. This calls the same
    modules in the same order, so each module's hooks, adapters and quantized weights still apply.

    It serves only once shown to compute the model's own logits (`verified`): the first step it could
    serve runs this forward and then the model's over the same inputs (the model's K/V, stored last at
    the same slots, are the ones the cache keeps) and compares the logits bit for bit. Equal, it serves
    the steps that follow; different or raising, the model's forward keeps them, until the model's
    modules change (`forget`; not its tensors' values: the same modules compute the same way). Hooks on
    the two top-level modules, global hooks or a replaced ``forward`` would be skipped by it: a step
    with any of them runs the model's forward (`usable`); a model holding a user's hook or a module of
    the user's own class anywhere is not checked (it would see the check's step twice).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.stage = AroundLayers(model)
        self._base_name = _child_name(model, self.base)
        # Whether the family scales at all: most do not, and their steps read no scale.
        self._scaled = any(value is not None for value in self.stage.scales())
        self.verified: bool | None = None  # None: not checked since the last change of the model
        self._checked_as = self._shape()

    @property
    def base(self) -> Any:
        """The decoder whose layers this forward loops over (the one its last check saw)."""
        return self.stage.base

    @staticmethod
    def unavailable_reason(model: Any) -> str | None:
        """Why `model` has no layer loop this forward can run (None: it has one)."""
        if not isinstance(model, PreTrainedModel):
            return f"{type(model).__name__} is not a transformers model"
        base = decoder_of(model)
        if missing := _missing_parts(base):
            return f"its decoder lacks {', '.join(missing)}"
        if _child_name(model, base) is None:
            return "its decoder is not one of its modules' children"
        return None

    def _shape(self) -> tuple:
        """What a check holds for: the two forwards' code, the decoder module, the config and its scales
        (read again each step: an edit of any makes the next step check again)."""
        model, base = self.model, self.model._modules.get(self._base_name)
        scales = self.stage.scales() if self._scaled else ()  # (none to read for most families)
        # Most decoders run `layers[: config.num_hidden_layers]`, read at every forward: a change of
        # either during a call (early exit) is seen at the next step, not at the next call.
        # (Read with defaults: a decoder swapped for a module without them is checked, and fails.)
        layers = getattr(base, "_modules", {}).get("layers")  # (a submodule: no Module.__getattr__)
        if layers is None:
            layers = getattr(base, "layers", None)
        count = len(layers) if isinstance(layers, torch.nn.ModuleList) else None
        depth = (count, getattr(getattr(base, "config", None), "num_hidden_layers", None))
        return type(model).forward, base, getattr(type(base), "forward", None), model.config, scales, depth

    def usable(self) -> bool:
        """Whether this step may run the lean forward (a check's first if none holds): nothing of the user's
        or a library's wraps the two top-level modules, and they are what the last check saw (a few
        dictionary reads a step)."""
        shape = self._shape()
        if shape != self._checked_as:  # a forward patched, the decoder swapped, a scale edited
            self.forget()
        for module in (self.model, self.base):
            if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
                return False
            if module._compiled_call_impl is not None:
                return False
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        if self.verified is None and _runs_users_code(self.model):
            # A check runs the step's layers twice: a user's hook or module (steering, activation
            # capture, a counter) would see that step twice. No check, so no lean forward, while the
            # model holds one.
            self.verified = False
        return self.verified is not False

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor | None
    ) -> torch.Tensor:
        """The logits ``[len(logits_indices), vocab]`` of a packed ``[1, T]`` step (None: of every token,
        in order)."""
        hidden = self.stage.embed(input_ids)
        position_embeddings = self.stage.position_embeddings(hidden, positions)
        layers = self.base.layers
        # Llama-style layers written out, op for op, without Module.__call__ (`direct_layers`).
        family = step_family(layers)
        for layer in layers:
            out = None if family is None else run_layer(family, layer, hidden, position_embeddings, positions)
            hidden = (
                out if out is not None else self._call_layer(layer, hidden, position_embeddings, positions)
            )
        hidden = self.base.norm(hidden)
        return self.stage.logits(hidden if logits_indices is None else hidden[:, logits_indices])[0]

    @staticmethod
    def _call_layer(
        layer: Any, hidden: torch.Tensor, position_embeddings: Any, positions: torch.Tensor
    ) -> Any:
        return layer(
            hidden,
            attention_mask=None,  # what the model's mask functions return under the engine's attention
            position_embeddings=position_embeddings,
            position_ids=positions,
            **{CACHE_NAME: None},
            use_cache=False,
        )

    def attempt(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor | None
    ) -> torch.Tensor | None:
        """This forward's logits on a step it is being checked on (None: it raised). Run it before the
        model's forward of the same step: each layer's K/V it stores is then overwritten by the model's,
        which the cache must keep when the two differ."""
        try:
            return self(input_ids, positions, logits_indices)
        except Exception as error:  # a layer that wants other arguments: the model's forward serves
            logger.debug("hfaccel: the lean forward raised (%r); the model's forward serves", error)
            return None

    def judge(self, ours: torch.Tensor | None, logits: torch.Tensor) -> None:
        """Compare `attempt`'s logits with the model's own `logits` of the same step."""
        same = ours is not None and (ours.shape, ours.dtype) == (logits.shape, logits.dtype)
        self.verified = same and bool(torch.equal(ours, logits))
        if ours is not None and not self.verified:
            logger.debug("hfaccel: the lean forward differs from the model's; the model's forward serves")

    def forget(self) -> None:
        """Check again at the next step it could serve (the model changed)."""
        self.stage = AroundLayers(self.model)
        self._checked_as = self._shape()
        self.verified = None


# Libraries whose modules keep no state in their forward (torch.ao's observers do: not among them).
_STATELESS_MODULES = ("torch.nn.", "transformers.", "peft.", "torchao.", "bitsandbytes.", "hfaccel.")


def _runs_users_code(model: Any) -> bool:
    """Whether a forward of `model` runs code of the user's that may keep state: a module of a class of
    their own (or of a library not known to keep none), or a forward hook they marked ``hfaccel_packed``
    (the engine serves calls with such hooks; library hooks change no value)."""
    for module in all_modules(model):
        if not type(module).__module__.startswith(_STATELESS_MODULES):
            return True
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            if any(marked_packed(hook) for hook in hooks.values()):
                return True
    return False


def _child_name(model: Any, module: Any) -> str | None:
    """The name `module` has among `model`'s direct children (None: it is not one)."""
    return next((name for name, child in model._modules.items() if child is module), None)
