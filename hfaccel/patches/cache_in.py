"""``model.generate(input_ids, past_key_values=cache)``: a `DynamicCache` imported into the paged KV cache.

HF's continuation pattern: generate with ``return_dict_in_generate=True``, then call generate again with
``out.sequences`` (possibly with more tokens appended), the mask over all of them and
``past_key_values=out.past_key_values``; or reuse a prompt's cache (``model(prompt,
past_key_values=DynamicCache())``) for several continuations. HF computes only the positions past the
cache's length `P`, attends to the cached positions the mask keeps, and extends the cache object it was
given, in place.

Here each row's unpadded prompt goes to the engine with the K/V of its cached real positions
(``[padding, P)`` of the padded layout; K/V is stored after rotary, at the positions HF gives them, which
are the engine's positions of the unpadded row) imported into its blocks (`engine/prompt_inputs.py`):
prefill starts after them. The imported K/V never enters the prefix cache. When the call ends, the given
cache is extended in place as HF extends it: its first `P` positions stay as they were, then the K/V of
the computed and generated positions (zeros where HF holds K/V of padding, which the mask hides), and
with ``return_dict_in_generate`` it is the returned ``past_key_values``. An empty `DynamicCache` is served
the same way (nothing imported, filled in place).

A sliding-window layer (`DynamicSlidingWindowLayer`, what `DynamicCache(config=...)` makes for Mistral,
Gemma 2/3 and the like) holds only its last ``window - 1`` positions: the earlier ones are imported as
zeros, which no later query attends, and the layer is extended as HF extends it (it keeps its tail).

Falls back (with the usual warning): any other cache type (`StaticCache`, quantized, offloaded, a
sliding layer recording its past, a legacy tuple), a cache whose shape does not fit the inputs or the
model (batch, layers, heads, a length not below the inputs' width), a cache in another dtype or device
than the model, and a non-empty cache with ``num_return_sequences > 1``, with ``inputs_embeds`` or with
``use_cache=False``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.engine.prompt_inputs import attach_kv
from hfaccel.engine.request import Request
from hfaccel.patches.arguments import CACHE_NAME


def type_reason(cache: Any) -> str | None:
    """Why a ``past_key_values`` of this type is not served (None: a plain `DynamicCache`)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if isinstance(cache, (tuple, list)):
        return "past_key_values as a legacy tuple"
    if type(cache) is not DynamicCache:
        return f"past_key_values of type {type(cache).__name__}"
    from transformers.cache_utils import DynamicSlidingWindowLayer

    served = (DynamicLayer, DynamicSlidingWindowLayer)
    odd = next((layer for layer in cache.layers if type(layer) not in served), None)
    if odd is not None:
        return f"a DynamicCache with {type(odd).__name__} layers"
    if any(getattr(layer, "record_past", False) for layer in cache.layers):
        return "a DynamicCache recording its sliding layers' past (assisted decoding's)"
    if getattr(cache, "offloading", False):
        return "an offloaded DynamicCache"
    return None


def full_length(layer: Any, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's K and V over all its `length` positions, ``[B, Hkv, length, D]``. A sliding
    layer (`DynamicSlidingWindowLayer`) holds only its last ``window - 1``: the positions before them
    are zeros, which no later query attends (each attends only its window)."""
    keys, values = layer.keys, layer.values
    held = keys.shape[-2]
    if held == length:
        return keys, values
    shape = (*keys.shape[:-2], length - held, keys.shape[-1])
    return (
        torch.cat([keys.new_zeros(shape), keys], dim=-2),
        torch.cat([values.new_zeros(shape), values], dim=-2),
    )


def _held(layer: Any, length: int) -> int:
    """How many of `length` positions a layer of a well-formed cache holds."""
    window = getattr(layer, "sliding_window", None)
    return length if window is None else min(length, window - 1)


@dataclass
class CacheImport:
    """A call's imported cache: the user's object, its length, and each (unexpanded) row's K/V."""

    cache: Any
    length: int
    rows: list[list[tuple[torch.Tensor, torch.Tensor]] | None]

    def attach(self, engine: Any, requests: list[Request], copies: int) -> None:
        """Import row ``i // copies``'s K/V into request ``i``; every request keeps its K/V at the end
        (the cache is extended in place)."""
        for i, request in enumerate(requests):
            kv = self.rows[i // copies]
            if kv is not None:
                attach_kv(engine, request, kv)
            request.keep_kv = True

    def finish(self, output: Any, built: Any) -> Any:
        """Extend the user's cache in place with the positions past its length (from `built`, the cache
        the engine's K/V makes, ``[B, Hkv, width, D]``) and return `output` holding the user's object."""
        for index, layer in enumerate(built.layers):
            total = getattr(layer, "cumulative_length", layer.keys.shape[-2])
            keys, values = (t[:, :, self.length :] for t in full_length(layer, total))
            if index < len(self.cache.layers) and self.cache.layers[index].is_initialized:
                given = self.cache.layers[index].keys
                keys, values = keys.to(given.device, given.dtype), values.to(given.device, given.dtype)
            self.cache.update(keys, values, index)
        if hasattr(output, CACHE_NAME):  # a GenerateDecoderOnlyOutput (not the plain tensor)
            setattr(output, CACHE_NAME, self.cache)
        return output


def plan(
    engine: Any,
    cache: Any,
    attention_mask: torch.Tensor,
    copies: int,
    config: Any,
    has_embeds: bool,
    model_dtype: torch.dtype,
) -> tuple[CacheImport | None, str | None]:
    """The import of `cache` for left-padded inputs with `attention_mask` ``[B, W]``; or a fallback
    reason."""
    length = cache.get_seq_length()
    batch, width = attention_mask.shape
    if length == 0:
        return CacheImport(cache, 0, [None] * batch), None
    if copies > 1:
        return None, "num_return_sequences > 1 with a non-empty past_key_values"
    if config.use_cache is False:
        return None, "use_cache=False with past_key_values"
    if length >= width:
        return None, f"a past_key_values of {length} tokens for inputs of {width} (it must be shorter)"
    executor = engine.executor
    if len(cache.layers) != executor.num_layers:
        return None, f"a past_key_values of {len(cache.layers)} layers (the model has {executor.num_layers})"
    for layer in cache.layers:
        want = (batch, executor.num_kv_heads, _held(layer, length), executor.head_dim)
        for tensor in (layer.keys, layer.values):
            if tuple(tensor.shape) != want:
                return (
                    None,
                    f"a past_key_values of shape {tuple(tensor.shape)} (inputs and model need {want})",
                )
            if tensor.dtype != model_dtype or tensor.device != engine.device:
                return (
                    None,
                    f"a past_key_values in {tensor.dtype} on {tensor.device} (the model: {model_dtype})",
                )
    padding = (attention_mask.shape[1] - attention_mask.bool().sum(dim=1)).tolist()
    rows: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
    for i, pad in enumerate(padding):
        if pad >= length:  # only padding is cached for this row: nothing to import
            rows.append(None)
            continue
        full = [full_length(layer, length) for layer in cache.layers]
        rows.append(
            [
                (
                    keys[i, :, pad:length].detach().transpose(0, 1),
                    values[i, :, pad:length].detach().transpose(0, 1),
                )
                for keys, values in full
            ]
        )
    return CacheImport(cache, length, rows), None
