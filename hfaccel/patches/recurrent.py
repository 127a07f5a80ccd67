"""Recurrent and convolutional token mixers on the engine (Jamba's Mamba layers and their kin).

An engine step packs many sequences into one ``[1, T]`` row. Attention layers keep them apart through
the paged metadata; a recurrent mixer (a causal convolution and a state-space or linear-attention scan)
would run them through one scan. Each such mixer is wrapped (`install_mixers`) so that in an engine step
it runs once per group of sequences, each group reading and writing its sequences' own state rows:

- sequences decoding one token, all in one batched call (transformers' recurrent form);
- a sequence starting (its first tokens), alone, from no state (transformers' full-sequence form);
- a later prefill chunk of a sequence, token by token from its state (transformers' full-sequence form
  starts from a zero state, so a chunk cannot continue one in one call).

The mixer reads its state through transformers' cache API for linear-attention layers
(``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``,
``has_previous_state``, ``is_recording_past``), which `StateView` implements over the rows of the
step's sequences (`SlotStates`; a request holds its row, ``Request.state_slot``, with its KV blocks).
Outside an engine step the wrapper calls the mixer as it was. Whether a mixer keeps its state only
there is checked at `patch` (`round_trip_reason`): a prompt in one call must give what the same prompt
gives split into a start and tokens continued from the state, else the model is refused.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from hfaccel.kernels.op import current_forward_context

CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values")
_ORIGINAL = "_hfaccel_original_forward"


def recurrent_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that convolve over the sequence (own a ``torch.nn.Conv1d``): Mamba, Mamba 2, gated
    delta nets, short convolutions. transformers' ``Conv1D`` (GPT-2's projection) is a linear layer."""
    found = []
    for name, module in model.named_modules():
        if any(isinstance(child, nn.Conv1d) for child in module.children()):
            found.append((name, module))
    return found


def mixer_reason(name: str, module: nn.Module) -> str | None:
    """Why the engine cannot run this mixer per sequence (None: it can, if its state round-trips)."""
    forward = getattr(module, _ORIGINAL, module.forward)
    parameters = inspect.signature(forward).parameters
    if getattr(module, "layer_idx", None) is None:
        return f"{name} ({type(module).__name__}) convolves over the sequence and has no layer_idx"
    if not any(argument in parameters for argument in CACHE_ARGUMENTS):
        return (
            f"{name} ({type(module).__name__}) convolves over the sequence and takes no cache argument: "
            "it keeps no per-sequence state the engine can hold"
        )
    return None


class SlotStates:
    """Every recurrent layer's states, one row per state slot: ``[num_slots, ...]`` per (kind, layer,
    state index), made at the first write with the shape and dtype transformers' cache would give."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.tensors: dict[tuple[str, int, int], torch.Tensor] = {}

    def rows(self, key: tuple[str, int, int], slots: torch.Tensor) -> torch.Tensor | None:
        stored = self.tensors.get(key)
        return None if stored is None else stored.index_select(0, slots)

    def write(self, key: tuple[str, int, int], slots: torch.Tensor, values: torch.Tensor) -> None:
        stored = self.tensors.get(key)
        if stored is None:
            stored = values.new_zeros((self.num_slots, *values.shape[1:]))
            self.tensors[key] = stored
        elif stored.shape[1:] != values.shape[1:]:  # remaking the rows would wipe every other sequence's
            raise RuntimeError(
                f"a recurrent state of layer {key[1]} changed shape ({tuple(stored.shape[1:])} to "
                f"{tuple(values.shape[1:])}): the engine holds one shape per layer"
            )
        stored.index_copy_(0, slots, values.to(stored.dtype))


class StateView:
    """transformers' linear-attention cache API, as a mixer calls it, over the rows of a few sequences.

    `previous`: whether the sequences have state (False: they start now). The mixer may update the
    tensors it was given in place (transformers' recurrent form does) or hand new ones to ``update_*``;
    `write_back` stores either into the sequences' rows."""

    def __init__(self, states: SlotStates, layer: int, slots: torch.Tensor, previous: bool) -> None:
        self.states, self.layer, self.slots, self.previous = states, layer, slots, previous
        self._held: dict[tuple[str, int, int], torch.Tensor] = {}

    def _get(self, kind: str, state_idx: int) -> torch.Tensor | None:
        key = (kind, self.layer, state_idx)
        if key not in self._held:
            rows = self.states.rows(key, self.slots) if self.previous else None
            if rows is None:
                return None
            self._held[key] = rows
        return self._held[key]

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.previous

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get("conv", state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get("recurrent", state_idx)

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """As transformers' ``LinearAttentionLayer.update_conv_state``: returns the inputs with the state
        before them (a start: zero-padded to the kernel), and keeps the last kernel-width of them."""
        previous = self._get("conv", state_idx)
        kernel = conv_kernel_size or (previous.shape[-1] if previous is not None else conv_states.shape[-1])
        if previous is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self._held[("conv", self.layer, state_idx)] = full[..., -kernel:].clone()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        held = self._get("recurrent", state_idx)
        if held is not None and held.shape == recurrent_states.shape:
            held.copy_(recurrent_states)
            return held
        self._held[("recurrent", self.layer, state_idx)] = recurrent_states
        return recurrent_states

    def write_back(self) -> None:
        for key, tensor in self._held.items():
            self.states.write(key, self.slots, tensor)


def install_mixers(model: nn.Module, states: SlotStates) -> int:
    """Wrap every recurrent mixer of `model` to run per sequence in engine steps (see the module doc);
    returns how many. Installed again over an earlier install, it takes the new `states`."""
    mixers = recurrent_mixers(model)
    for _, module in mixers:
        original = getattr(module, _ORIGINAL, None) or module.forward
        setattr(module, _ORIGINAL, original)
        module.forward = partial(_engine_forward, weakref.ref(module), original, states)
    return len(mixers)


def restore_mixers(model: nn.Module, states: SlotStates | None = None) -> None:
    """Undo `install_mixers` (for ``unpatch``); with `states`, only where the wrapper holds those (an
    engine released: its rows go, a newer engine's wrappers stay)."""
    for _, module in recurrent_mixers(model):
        wrapper = module.__dict__.get("forward")
        if states is not None and not (isinstance(wrapper, partial) and wrapper.args[2] is states):
            continue
        original = module.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            module.__dict__.pop("forward", None)


def _engine_forward(
    module_ref: Callable[[], nn.Module | None],
    original: Callable,
    states: SlotStates,
    *args: Any,
    **kwargs: Any,
) -> Any:
    context = current_forward_context()
    layout = None if context is None else context.layout
    if layout is None or layout.state_slots is None:  # not an engine step: the mixer as it was
        return original(*args, **kwargs)
    hidden, run = _group_runner(original, module_ref().layer_idx, states, args, kwargs)
    return split_by_sequence(hidden, layout, run)


def _group_runner(
    original: Callable, layer: int, states: SlotStates, args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]]:
    """The packed hidden states of a mixer call, and a function running the mixer on some sequences'
    rows of them with a `StateView` of their state rows as its cache."""
    signature = inspect.signature(original)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind == parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    hidden_name = next(iter(signature.parameters))
    hidden = arguments.pop(hidden_name)
    cache_name = next(name for name in CACHE_ARGUMENTS if name in signature.parameters)
    arguments.pop(cache_name, None)
    # Per-token arguments of the packed row that no group shares: the row has no padding, and a
    # group's positions are its own (the view says whether it starts or continues).
    arguments.pop("attention_mask", None)
    arguments.pop("cache_position", None)
    return hidden, partial(_run_group, original, layer, states, hidden_name, cache_name, arguments)


def _run_group(
    original: Callable,
    layer: int,
    states: SlotStates,
    hidden_name: str,
    cache_name: str,
    arguments: dict[str, Any],
    hidden: torch.Tensor,
    slots: torch.Tensor,
    previous: bool,
) -> torch.Tensor:
    view = StateView(states, layer, slots, previous)
    out = original(**{hidden_name: hidden, cache_name: view}, **arguments)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"a recurrent mixer returned {type(out).__name__}, not a tensor")
    view.write_back()
    return out


def split_by_sequence(
    hidden: torch.Tensor,
    layout: Any,
    run: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
) -> torch.Tensor:
    """Run `run(hidden_rows, slots, previous)` over the step's sequences (packed in `hidden`'s dim 1 as
    `layout` says) and put the outputs back in place: every one-token continuation in one batched call,
    every start alone, every later chunk token by token."""
    device = hidden.device
    starts, offset = [], 0
    for count in layout.query_lens:
        starts.append(offset)
        offset += count
    decodes = [i for i, (q, s) in enumerate(zip(layout.query_lens, layout.seq_lens)) if q == 1 and s > 1]
    out: torch.Tensor | None = None

    def place(position: torch.Tensor | slice, values: torch.Tensor) -> None:
        nonlocal out
        if out is None:
            out = values.new_empty((1, hidden.shape[1], *values.shape[2:]))
        out[0, position] = values.reshape(-1, *values.shape[2:])

    if decodes:
        positions = torch.tensor([starts[i] for i in decodes], device=device)
        slots = torch.tensor([layout.state_slots[i] for i in decodes], device=device)
        rows = hidden[0].index_select(0, positions).unsqueeze(1)  # [n, 1, H]: one row per sequence
        place(positions, run(rows, slots, True))
    for i, (count, length) in enumerate(zip(layout.query_lens, layout.seq_lens)):
        if i in decodes:
            continue
        slot = torch.tensor([layout.state_slots[i]], device=device)
        start = starts[i]
        if length == count:  # the sequence starts in this step
            place(slice(start, start + count), run(hidden[:, start : start + count], slot, False))
            continue
        for t in range(start, start + count):
            place(slice(t, t + 1), run(hidden[:, t : t + 1], slot, True))
    assert out is not None
    return out


def round_trip_reason(
    name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any], state_bytes: list[int] | None = None
) -> str | None:
    """Why this mixer cannot be served per sequence (None: it can), from one call of it (the patch-time
    probe's, a few tokens, no cache): the tokens in one start must give what the mixer gives them with
    no cache, and so must a start of one token, a chunk continued from its state and one decoded token
    (transformers' three forms), with another sequence's state beside it. A mixer that keeps its state
    anywhere but the cache it is handed, or reads the cache some other way, fails here. The bytes one
    sequence's state takes in this mixer are appended to `state_bytes`, when given."""
    original = getattr(module, _ORIGINAL, module.forward)
    try:
        with torch.no_grad():
            expected = original(*args, **kwargs)
            if not isinstance(expected, torch.Tensor):
                return f"{name} ({type(module).__name__}) returns {type(expected).__name__}, not a tensor"
            states = SlotStates(2)
            hidden, run = _group_runner(original, module.layer_idx, states, args, kwargs)
            length = hidden.shape[1]
            if length < 4:
                return f"{name}: the probe's {length} tokens are too few to check its state"

            def step(
                query_lens: list[int], seq_lens: list[int], slots: list[int], rows: torch.Tensor
            ) -> torch.Tensor:
                layout = _Layout(query_lens, seq_lens, slots)
                return split_by_sequence(rows, layout, run)

            whole = step([length], [length], [0], hidden)
            parts = [step([1], [1], [1], hidden[:, :1])]
            parts.append(step([length - 2], [length - 1], [1], hidden[:, 1 : length - 1]))
            parts.append(step([1], [length], [1], hidden[:, length - 1 :]))
            split = torch.cat(parts, dim=1)
    except Exception as error:  # noqa: BLE001 - what it raised is the reason
        return (
            f"{name} ({type(module).__name__}) failed when run per sequence through transformers' "
            f"linear-attention cache API ({type(error).__name__}: {error})"
        )
    tolerance = (1e-4 if expected.dtype == torch.float32 else 3e-2) * max(1.0, float(expected.abs().max()))
    for form, got in (("in one call", whole), ("split into a start, a chunk and a decoded token", split)):
        if got.shape != expected.shape:
            return (
                f"{name} ({type(module).__name__}) gives outputs of shape {tuple(got.shape)} {form} from "
                f"its state, {tuple(expected.shape)} over the whole sequence"
            )
        difference = float((got - expected).abs().max())
        if difference > tolerance:
            return (
                f"{name} ({type(module).__name__}) gives other outputs {form} from its state than over the "
                f"whole sequence (by up to {difference:.2g}, tolerance {tolerance:.2g}): it keeps or reads its "
                "recurrent state outside transformers' cache API, or its chunked and step-by-step kernels "
                "round that differently"
            )
    if state_bytes is not None:  # each state tensor holds the probe's 2 sequences' rows
        state_bytes.append(sum(t[0].numel() * t.element_size() for t in states.tensors.values()))
    return None


class _Layout:
    """The part of a step layout `split_by_sequence` reads."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], state_slots: list[int]) -> None:
        self.query_lens, self.seq_lens, self.state_slots = query_lens, seq_lens, state_slots
