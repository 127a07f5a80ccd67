"""The name transformers gives a model's KV cache, across the versions hfaccel admits.

Up to 5.23 it is ``past_key_values`` (in ``forward``, ``generate`` and their outputs). From 5.24 it is
``cache``: ``generate`` and ``forward`` still take ``past_key_values`` (and ``cache_params``), renamed
to ``cache`` with a FutureWarning, and outputs answer the old attribute names. Everything here that
passes or reads the cache goes through these names, so one code path serves both.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from transformers.generation.utils import GenerateDecoderOnlyOutput

CACHE_NAME = (
    "cache"
    if "cache" in {field.name for field in dataclasses.fields(GenerateDecoderOnlyOutput)}
    else "past_key_values"
)
# The names generate renames to CACHE_NAME (none where the old name is still the name).
DEPRECATED_CACHE_NAMES = ("past_key_values", "cache_params") if CACHE_NAME == "cache" else ()


def normalize_cache_argument(kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`kwargs` with a deprecated cache name renamed to `CACHE_NAME`, with the FutureWarning and the
    both-names error transformers' own ``generate`` gives (`where` names the function)."""
    renamed = dict(kwargs)
    for old in DEPRECATED_CACHE_NAMES:
        if old not in renamed:
            continue
        if CACHE_NAME in renamed:
            raise ValueError(f"{where} got both `{CACHE_NAME}` and `{old}`: pass `{CACHE_NAME}` only")
        warnings.warn(
            f"`{old}` is deprecated in transformers and will be removed in version 6.0.0 for {where}. "
            f"Use `{CACHE_NAME}` instead.",
            FutureWarning,
            stacklevel=3,
        )
        renamed[CACHE_NAME] = renamed.pop(old)
    return renamed


def output_cache(output: Any) -> Any:
    """The cache a model or generate output holds (None when it holds none)."""
    return getattr(output, CACHE_NAME, None)
