"""A cheap fingerprint of everything in a model that produced its cached KV.

The prefix cache keys blocks by token content only, so KV computed by old weights would be served after
an optimizer step, a ``load_state_dict``, or a LoRA adapter switch. `ModelStateTracker.token` changes
whenever any of these does, and the engine forgets its prefix cache when it sees a new token.

What the token covers:

- every parameter and buffer (a tensor subclass by the plain tensors it holds: a DTensor's local shard,
  a quantized weight's data and scales), by identity (``id``), storage (``data_ptr``), dtype, device,
  shape and ``_version`` counter: replaced tensors (``load_state_dict(assign=True)``, ``p.data = t``,
  ``.to(dtype)``, new ``Parameter`` objects, added or removed modules) and in-place updates through the
  tensor itself (SGD, foreach AdamW, ``load_state_dict`` copy) all change it;
- a process-wide count of optimizer steps (a global ``register_optimizer_step_post_hook``): a fused
  optimizer step (``AdamW(fused=True)``, HF Trainer's default) bumps no ``_version`` counter;
- a sampled checksum: `samples` fixed, evenly strided elements of each tensor, read as raw bytes
  (through views made anew each call: the tracker holds no tensor, so a replaced weight is freed).
  In-place edits through ``.data`` (``p.data.mul_(0.9).add_(q.data, alpha=0.1)``, how TRL syncs a
  reference model) bump no counter either; a dense edit changes sampled elements, but **an edit
  through ``.data`` that misses every sampled element is not seen** (call
  ``hfaccel.reset_prefix_cache(model)`` after one);
- PEFT tuner layers (LoRA...): active adapters, the disabled flag, merged adapters, the adapter names
  each layer holds and their scalar settings (``scaling``, ``r``...);
- the root module's ``training`` flag (dropout makes KV computed in train mode differ), and whether any
  module in train mode draws dropout (`draws_dropout`: then KV is not a function of the tokens, and the
  engine shares no prefix while it is so);
- the model's config, by value (`config_fingerprint`): a config changed in place (``layer_types``, a
  sliding window, rope parameters) changes what the layers compute, as transformers reads it at every
  forward. Settings that change no computed value (``use_cache``, ``output_attentions``, names, the
  ``dtype`` that ``save_pretrained`` writes, the special-token ids generation reads from its own
  config) are left out, so a training loop toggling them, or saving checkpoints, resets nothing.

Any optimizer step anywhere in the process changes every tracker's token (a spurious reset costs
only recomputation, never correctness).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# Sampled elements per tensor: enough to see a dense update; the count barely changes the cost (one
# view per tensor dominates): about 0.7 ms a call on SmolLM2-135M (docs/architecture.md, "Model changes").
DEFAULT_SAMPLES = 16
# Tensors, evenly spread over the model, whose storages `ModelStateTracker.sentinel` reads at every step
# (weights swapped by ``p.data = other``, then back).
SENTINEL_TENSORS = 8

_optimizer_steps = 0
_hook_installed = False


def _count_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _install_optimizer_hook() -> None:
    """Count every optimizer step of the process (fused ones too); installed once."""
    global _hook_installed
    if not _hook_installed:
        register_optimizer_step_post_hook(_count_optimizer_step)
        _hook_installed = True


def optimizer_steps() -> int:
    """Optimizer steps taken in this process since the first `ModelStateTracker` was built."""
    return _optimizer_steps


class ModelToken(NamedTuple):
    """`ModelStateTracker.token`'s value: compared whole, it says whether anything changed."""

    optimizer_steps: int
    training: bool
    layout: tuple  # per tensor: id, data_ptr, dtype, device, shape
    versions: tuple
    adapters: tuple
    checksum: bytes
    config: tuple  # `config_fingerprint` of the model's config
    hooks: tuple  # per module with any: its forward (pre-)hooks' handle ids; torch's global packed ones
    draws_dropout: bool = False  # some module in train mode draws dropout (`draws_dropout`)
    configs: tuple = ()  # ids of the config objects the modules hold (one swapped in: a new attention switch)
    modules: tuple = ()  # per module: id and class (a module without tensors swapped in, `act_fn`)

    def same_structure(self, other: Hashable) -> bool:
        """Whether `other` differs from this token in tensor values only: the same tensors at the same
        addresses, the same adapter state, hooks, training flag and config (what a captured CUDA graph
        bakes in)."""
        mine = (
            self.training,
            self.draws_dropout,
            self.layout,
            self.adapters,
            self.config,
            self.hooks,
            self.configs,
            self.modules,
        )
        return isinstance(other, ModelToken) and mine == (
            other.training,
            other.draws_dropout,
            other.layout,
            other.adapters,
            other.config,
            other.hooks,
            other.configs,
            other.modules,
        )


class ModelStateTracker:
    """Fingerprints `model`'s weights and adapter state; `token()` changes when they do.

    `token()` is cheap enough to call before every engine step that admits requests. Equal tokens mean
    nothing the tracker can see has changed (see the module docstring for what it cannot see). The
    tracker keeps no reference to any tensor between calls: a replaced weight is freed at once.
    """

    def __init__(self, model: torch.nn.Module, samples: int = DEFAULT_SAMPLES) -> None:
        if samples < 1:
            raise ValueError(f"samples must be at least 1, got {samples}")
        _install_optimizer_hook()
        self.model = model
        self.samples = samples
        self._layout: tuple[Hashable, ...] | None = None  # the tensors' structure the plan was made for
        # Per dtype/device group: (tensor index, count, stride, storage offset) of the sampled elements.
        self._plan: list[list[tuple[int, int, int, int]]] = []
        self._first_tuner: weakref.ref | None = None  # `sentinel`'s adapter layer, found by `token`
        self._watched: list[weakref.ref] = []  # `sentinel`'s tensors, whose storages it reads
        self._dropouts: list[weakref.ref] = []  # the modules that may draw dropout (`token`)

    def token(self) -> ModelToken:
        """A hashable fingerprint of the weights, buffers, adapter state and hooks (holds no tensor)."""
        tensors: list[torch.Tensor | None] = []
        adapters: list[Hashable] = []
        hooks: list[Hashable] = []
        first_tuner = None
        # model.modules() without its generator and name bookkeeping: twice as fast on a LoRA model.
        modules = [self.model]
        seen = {id(self.model)}
        configs: dict[int, None] = {}
        kinds: list[tuple[int, type]] = []
        for module in modules:  # grows as it goes: breadth first
            kinds.append((id(module), type(module)))
            tensors += module._parameters.values()
            tensors += module._buffers.values()
            config = module.__dict__.get("config")
            if config is not None:
                configs[id(config)] = None
            if module._forward_hooks or module._forward_pre_hooks:  # a packed hook opted in changes values
                hooks.append((id(module), tuple(module._forward_hooks), tuple(module._forward_pre_hooks)))
            if _is_tuner_layer(type(module)):
                adapters.append(_adapter_state(module))
                first_tuner = first_tuner or module
            for child in module._modules.values():
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    modules.append(child)
        from torch.nn.modules import module as torch_module  # global hooks see every module's forward

        for index, hooks_of in enumerate(
            (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks)
        ):
            # The ones the engine serves (marked packed: the user's steering) change values; a library's
            # (torch's ModuleTracker, registered anew around every call) changes none.
            packed = tuple(key for key, hook in hooks_of.items() if marked_packed(hook))
            if packed:
                hooks.append((-1 - index, packed))
        present = [leaf for t in tensors if t is not None for leaf in _plain_tensors(t)]
        layout = tuple((id(t), t.data_ptr(), t.dtype, t.device, t.shape) for t in present)
        if layout != self._layout:
            self._plan = _sampling_plan(present, self.samples)
            self._layout = layout
            # The modules that may draw dropout (every nn.Dropout, whatever its p now, and those keeping a
            # rate above 0), found once per layout: the token is read before most steps that admit, and
            # checking every module there cost more than the rest of the token on a 30-layer model.
            self._dropouts = [
                weakref.ref(m)
                for m in modules
                if isinstance(m, torch.nn.modules.dropout._DropoutNd) or dropout_rate(m) > 0
            ]
        dropout = any(m is not None and draws_dropout(m) for m in (ref() for ref in self._dropouts))
        token = ModelToken(
            _optimizer_steps,
            self.model.training,
            layout,
            tuple(-1 if t.is_inference() else t._version for t in present),  # inference tensors have none
            tuple(adapters),
            _checksum(present, self._plan),
            config_fingerprint(getattr(self.model, "config", None)),
            tuple(hooks),
            dropout,
            tuple(configs),
            tuple(kinds),
        )
        self._first_tuner = None if first_tuner is None else weakref.ref(first_tuner)
        every = max(1, len(present) // SENTINEL_TENSORS)
        self._watched = [weakref.ref(t) for t in present[::every][:SENTINEL_TENSORS]]
        return token

    def sentinel(self) -> Hashable:
        """What changes with the model-wide changes cheaply seen (a few us, against `token`'s ~1 ms): the
        process's optimizer steps, the training flag, the adapter state of the first adapter layer
        `token` found (PEFT's ``set_adapter``, ``disable_adapter()``, merging act on every layer at
        once), and the storages of `SENTINEL_TENSORS` weights spread over the model. The engine
        compares it at every step, so a change made and undone while requests run (another thread's
        ``with model.disable_adapter(): model(x)``) is seen, where the token, read before and after,
        would be the same."""
        tuner = None if self._first_tuner is None else self._first_tuner()
        storages = tuple(None if (t := ref()) is None else t.data_ptr() for ref in self._watched)
        return (
            _optimizer_steps,
            self.model.training,
            None if tuner is None else _adapter_state(tuner),
            storages,
        )


# Config entries that change no value the model computes: what generation returns (``use_cache``,
# ``output_*``, ``return_dict``), names and provenance, the label maps of heads generation does not run,
# and the attention implementation, which an engine step replaces with its own (`patches/attention.py`).
_NOT_COMPUTED = frozenset(
    {
        "use_cache",
        "output_attentions",
        "_output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "_name_or_path",
        "_model_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "dtype",  # save_pretrained writes it; the parameters' own dtype is what computes (a move rebuilds)
        "torch_dtype",
        "pad_token_id",  # generation reads its special tokens from the generation config
        "bos_token_id",
        "eos_token_id",
        "output_router_logits",  # a MoE's router logits returned beside its outputs
        "_attn_implementation_internal",
        "_attn_implementation_autoset",
        "_post_init_done",
    }
)


# Where transformers' attention modules keep the dropout they pass to the attention function in train
# mode: a rate, or an ``nn.Dropout`` whose ``p`` they pass (Llama's ``attention_dropout``, GPT-2's
# ``attn_dropout``, OPT's ``dropout``, Falcon's ``nn.Dropout`` as ``attention_dropout``, MPT's ``attn_dropout_p``).
ATTENTION_DROPOUT_NAMES = frozenset(
    {
        "attention_dropout",
        "attn_dropout",
        "attn_drop",
        "attn_pdrop",
        "attn_dropout_p",
        "dropout",
        "dropout_p",
        "dropout_prob",
    }
)
# ...and beside ``nn.Dropout`` modules, where other layers keep a rate they pass to ``F.dropout``.
DROPOUT_NAMES = ATTENTION_DROPOUT_NAMES | {"hidden_dropout", "resid_pdrop"}


def dropout_rate(module: torch.nn.Module, names: frozenset[str] = DROPOUT_NAMES) -> float:
    """The largest dropout rate `module` keeps: an ``nn.Dropout``'s own ``p``, or one of `names` set on
    it (a rate, or an ``nn.Dropout`` held under that name); 0 for none. Read from the module's own
    dicts, not through ``getattr`` (a missing name raises inside ``nn.Module.__getattr__``: a few us a
    name, hundreds of modules a check)."""
    rates = [module.p if isinstance(module, torch.nn.modules.dropout._DropoutNd) else 0.0]
    own, children = module.__dict__, module._modules
    for name in names.intersection(own.keys() | children.keys()):
        value = own[name] if name in own else children[name]
        if isinstance(value, torch.nn.modules.dropout._DropoutNd):
            value = value.p
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            rates.append(float(value))
    return max(rates)


def draws_dropout(module: torch.nn.Module) -> bool:
    """Whether `module`, in train mode, draws dropout in its forward (a rate above 0 it applies)."""
    return module.training and dropout_rate(module) > 0


def marked_packed(hook: Any) -> bool:
    """Whether a forward hook is marked ``hfaccel_packed`` (on it, or on the function a partial wraps)."""
    while True:
        if getattr(hook, "hfaccel_packed", False):
            return True
        if not isinstance(hook, functools.partial):
            return False
        hook = hook.func


def config_fingerprint(config: Any) -> tuple:
    """A hashable copy of `config`'s entries by value (sub-configs, lists and dicts included), less
    `_NOT_COMPUTED`: equal fingerprints mean the layers read the same settings. Empty for no config."""
    if config is None:
        return ()
    entries = vars(config)
    return tuple((key, _frozen(entries[key])) for key in sorted(entries) if key not in _NOT_COMPUTED)


def _frozen(value: Any) -> Hashable:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((str(k), _frozen(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, tuple(_frozen(v) for v in items))
    if hasattr(value, "to_dict") and hasattr(value, "__dict__"):  # a sub-config, a quantization config
        return (type(value).__name__, config_fingerprint(value))
    return repr(value)  # a dtype, an enum


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `tensor`'s values, fingerprinted in its place: itself, a DTensor's
    local shard (a tensor-parallel rank's own data), or the inner tensors of a wrapper subclass that
    flattens (torchao's quantized weights: ``__tensor_flatten__``), recursively. Only ops every plain
    tensor has are then called on them (a subclass need not implement ``as_strided``). A subclass that
    does not flatten is left out (its changes are not seen: ``reset_prefix_cache`` after one)."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return [tensor]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return []
    names, _ = flatten()
    return [leaf for name in names for leaf in _plain_tensors(getattr(tensor, name))]


def _sampling_plan(tensors: list[torch.Tensor], samples: int) -> list[list[tuple[int, int, int, int]]]:
    """For each tensor that has elements: `samples` evenly strided positions inside its extent, as
    (index in `tensors`, count, stride, storage offset), grouped by dtype and device for one `cat`."""
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[int, int, int, int]]] = {}
    for index, t in enumerate(tensors):
        try:
            if t.is_meta or t.numel() == 0 or t.layout != torch.strided:
                continue
            extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
            count = min(samples, extent)
            stride = extent // count
            # Start mid-stride (count * stride <= extent keeps it in bounds): element 0 is often
            # special, such as a padding row that never changes.
            groups.setdefault((t.dtype, t.device), []).append(
                (index, count, stride, t.storage_offset() + stride // 2)
            )
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without strides
            continue
    return list(groups.values())


def _checksum(tensors: list[torch.Tensor], plan: list[list[tuple[int, int, int, int]]]) -> bytes:
    """The sampled elements' raw bytes (views are made anew each call, so none outlives it)."""
    chunks = []
    with torch.no_grad():
        for group in plan:
            sample = torch.cat([torch.as_strided(tensors[i], (n,), (s,), o) for i, n, s, o in group])
            chunks.append(sample.view(torch.uint8).cpu().numpy().tobytes())
    return b"".join(chunks)


_TUNER_TYPES: dict[type, bool] = {}


def _is_tuner_layer(cls: type) -> bool:
    """A PEFT tuner layer (``BaseTunerLayer``) or adapter wrapper (``ModulesToSaveWrapper``): both have
    ``active_adapters`` and ``disable_adapters`` properties. (transformers' ``PeftAdapterMixin`` has
    methods of those names; a model using it holds PEFT tuner layers, which are seen themselves.)"""
    known = _TUNER_TYPES.get(cls)
    if known is None:
        known = all(
            isinstance(getattr(cls, name, None), property) for name in ("active_adapters", "disable_adapters")
        )
        _TUNER_TYPES[cls] = known
    return known


def _adapter_state(module: torch.nn.Module) -> Hashable:
    """Active adapters, the disabled flag, merged adapters, and each adapter's settings (LoRA's ``r``,
    ``lora_alpha``, ``scaling``...: plain dicts keyed by adapter name, so they also name the adapters
    the layer holds). The adapters' weights are parameters, tracked as such."""
    settings = []
    for attribute in getattr(module, "other_param_names", ()):
        value = module.__dict__.get(attribute)
        if isinstance(value, dict):
            settings.append((attribute, tuple((key, _scalar(item)) for key, item in value.items())))
    active = module.active_adapters
    return (
        id(module),
        (active,) if isinstance(active, str) else tuple(active),
        bool(module.disable_adapters),
        tuple(getattr(module, "merged_adapters", ())),
        tuple(settings),
    )


def _scalar(value: Any) -> Hashable:
    return value if isinstance(value, (int, float, str, bool)) else None
