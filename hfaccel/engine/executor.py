"""The narrow interface through which the engine runs a model, whatever framework the model is from.

The engine never imports the Hugging Face adapter: `patches/` registers a factory here
(`register_executor_factory`) when it is imported (by `make_executor` itself, by name, if nothing
registered one before), and `make_executor` turns a model object into an executor with it. An object
that already is a `ModelExecutor` is used as it is (subclass `ExecutorBase` for the defaults of the
optional parts: one process, no adapters, no pipeline).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelExecutor(Protocol):
    """Runs one packed step of a model whose attention layers call ``hfaccel::paged_attention``."""

    model: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    attention_scale: float

    def max_model_len(self, requested: int | None) -> int:
        """The longest sequence served (the model's context, or `requested` if it fits)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        compiled: Callable[..., torch.Tensor] | None = None,
        token_adapters: list[str | None] | None = None,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        record: bool = False,
    ) -> torch.Tensor:
        """``[1, T]`` packed ids and positions -> ``[N, V]`` logits at the `logits_indices` positions,
        through `compiled` (a function from `compile`) when given. The caller has set the forward
        context (metadata, KV caches) for the step. `token_adapters` (passed only when some request
        names an adapter, and then never with `compiled`): each packed token's LoRA adapter, None for
        the model as it is (`check_adapter(name)` raises ValueError for a name the executor cannot
        serve). `prompt_embeds` (passed only for a step with embedded prompt tokens, and then never with
        `compiled`): the packed indices ``[n]`` of those tokens and their embeddings ``[n, H]``, fed to
        the model instead of their ids (an executor that takes them, and imported K/V, see
        `engine/prompt_inputs.py`, returns None from `prompt_inputs_reason`). `record` (eager only, for
        a step with requests that keep what the model computes, `engine/recorded_states.py`): the model's
        per-layer hidden states ``[1, T, H]`` and attention probabilities ``[1, Hq, T, S]`` are left in
        `recorded`, and the executor's attention layers return probabilities (the forward context's
        ``record_attentions``); only the one-process HF executor takes it."""

    def compile(self, dynamic: bool) -> Callable[..., torch.Tensor]:
        """A ``torch.compile``d model forward for `forward`'s `compiled` (dynamic token dimension or not)."""

    def state_token(self) -> Hashable:
        """A cheap fingerprint of everything that produced cached KV (weights, adapters)."""

    # The parts below have defaults in `ExecutorBase` (one process, no adapters, no pipeline).
    step_sync: Any
    max_token_padding: int
    pipelined: bool
    # What the layers ask of an attention backend beyond causal attention (`kernels.selection`'s
    # ATTENTION_NEEDS: sliding windows, chunks, soft-capping, sinks); its backend must serve all of it.
    attention_needs: frozenset[str]

    def check_adapter(self, name: str) -> None:
        """Raise ValueError unless the executor can apply LoRA adapter `name` per request."""

    def prompt_inputs_reason(self) -> str | None:
        """Why the executor cannot take prompt embeddings or imported K/V (None: it can)."""

    def pad_tokens(self, layout: Any, tokens: int) -> int:
        """The token count a step of `tokens` tokens runs at (at most `max_token_padding` more)."""

    def run_pipeline(self, parts: list[Any], prepare: Callable[[Any], Any]) -> torch.Tensor:
        """A pipeline stage's step over its microbatches (`pipelined` executors only)."""

    # The largest sliding window when every attention layer slides (their K/V before it is never read
    # again: the engine gives those blocks back); None otherwise.
    kv_window: int | None
    # Each sliding layer's index and window where full-attention layers sit beside them: the engine
    # keeps the sliding layers' K/V in a pool of their own (`window_blocks.py`); empty otherwise.
    sliding_layers: dict[int, int]
    # Layers with a per-sequence recurrent state (Mamba and its kin) beside the paged KV: the engine
    # gives each running request a state slot (`Request.state_slot`, in the step layout's
    # ``state_slots``), and never resumes a sequence from KV alone (no prefix-cache hits, no drafts to
    # roll back, no forked beams).
    recurrent: bool

    def reserve_state_slots(self, num_slots: int) -> None:
        """Hold recurrent state for `num_slots` sequences (`recurrent` executors only)."""


class ExecutorBase:
    """The defaults of `ModelExecutor`'s optional parts, for an executor that runs the whole model in one
    process: no collectives, no padding, no adapters, no prompt embeddings, no pipeline."""

    step_sync: Any = None  # the collectives that keep ranks in lock step (`distributed/sync.py`)
    max_token_padding: int = 0  # the most tokens `pad_tokens` adds to a step
    pipelined: bool = False  # a pipeline stage: steps go through `run_pipeline`, not `forward`
    attention_needs: frozenset[str] = frozenset()  # plain causal attention
    recurrent: bool = False  # no recurrent layers
    # The layers that keep K/V, where recurrent ones keep a state instead (none at all: Mamba's). None:
    # every layer. Read with `getattr`, so a protocol executor without it keeps K/V in every layer.
    kv_layers: frozenset[int] | None = None
    state_bytes_per_seq: int = 0  # one sequence's recurrent state, budgeted beside the K/V (`getattr` too)
    kv_window: int | None = None  # every attention layer slides within this many positions (None: not)
    sliding_layers: dict[int, int] = {}  # noqa: RUF012 (read only) no sliding layers beside full ones

    def reserve_state_slots(self, num_slots: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no recurrent layers")

    def release_state_slots(self) -> None:
        """The engine is released: let go of what `reserve_state_slots` holds (nothing here)."""

    def check_adapter(self, name: str) -> None:
        raise ValueError(f"adapter {name!r}: this model's executor serves no adapters")

    def prompt_inputs_reason(self) -> str | None:
        return f"a model run by {type(self).__name__}"

    def pad_tokens(self, layout: Any, tokens: int) -> int:
        return tokens

    def forget_outputs(self, structure: bool = True) -> None:
        """The model changed (`Engine.forget_model_outputs`): drop what the executor keeps of it.
        `structure` False: its tensors' values only (an optimizer step in place)."""

    def run_pipeline(self, parts: list[Any], prepare: Callable[[Any], Any]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is not a pipeline stage")


_factory: Callable[[Any], ModelExecutor] | None = None


def register_executor_factory(factory: Callable[[Any], ModelExecutor]) -> None:
    """Set how a model object becomes a `ModelExecutor` (the HF adapter registers itself)."""
    global _factory
    _factory = factory


# The adapter that registers itself when imported: transformers' models (`hfaccel/patches`). Named, not
# imported: the engine imports nothing of transformers, and `import hfaccel` imports it at first use.
DEFAULT_ADAPTER = "hfaccel.patches.executors"


def make_executor(model: Any) -> ModelExecutor:
    """`model` as a `ModelExecutor` (itself if it already is one; else through the registered adapter,
    the default one imported if none is)."""
    if isinstance(model, ModelExecutor):
        return model
    if _factory is None:
        importlib.import_module(DEFAULT_ADAPTER)
    if _factory is None:
        raise RuntimeError(f"no model adapter is registered (importing {DEFAULT_ADAPTER} registered none)")
    return _factory(model)
