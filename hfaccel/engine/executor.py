"""The narrow interface through which the engine runs a model, whatever framework the model is from.

The engine never imports the Hugging Face adapter: `patches/` registers a factory here
(`register_executor_factory`) when hfaccel is imported, and `make_executor` turns a model object into
an executor with it. An object that already is a `ModelExecutor` is used as it is.
"""

from __future__ import annotations

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
    ) -> torch.Tensor:
        """``[1, T]`` packed ids and positions -> ``[N, V]`` logits at the `logits_indices` positions,
        through `compiled` (a function from `compile`) when given. The caller has set the forward
        context (metadata, KV caches) for the step. `token_adapters` (passed only when some request
        names an adapter, and then never with `compiled`): each packed token's LoRA adapter, None for
        the model as it is. An executor that serves adapters also has ``check_adapter(name)``, which
        raises ValueError for a name it cannot serve. `prompt_embeds` (passed only for a step with
        embedded prompt tokens, and then never with `compiled`): the packed indices ``[n]`` of those
        tokens and their embeddings ``[n, H]``, fed to the model instead of their ids. An executor that
        takes them (and imported K/V, see `engine/prompt_inputs.py`) has ``prompt_inputs_reason()``
        returning None."""

    def compile(self, dynamic: bool) -> Callable[..., torch.Tensor]:
        """A ``torch.compile``d model forward for `forward`'s `compiled` (dynamic token dimension or not)."""

    def state_token(self) -> Hashable:
        """A cheap fingerprint of everything that produced cached KV (weights, adapters)."""


_factory: Callable[[Any], ModelExecutor] | None = None


def register_executor_factory(factory: Callable[[Any], ModelExecutor]) -> None:
    """Set how a model object becomes a `ModelExecutor` (the HF adapter registers itself)."""
    global _factory
    _factory = factory


def make_executor(model: Any) -> ModelExecutor:
    """`model` as a `ModelExecutor` (itself if it already is one)."""
    if isinstance(model, ModelExecutor):
        return model
    if _factory is None:
        raise RuntimeError("no model adapter is registered: import hfaccel (not only hfaccel.engine)")
    return _factory(model)
