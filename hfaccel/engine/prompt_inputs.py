"""Prompts given as more than token ids: embeddings for prompt positions, and imported K/V.

**Embeddings** (`attach_prompt_embeds`): a request may carry ``[n, H]`` embeddings for its first `n`
prompt positions. Every step that computes any of those positions (its prefill chunks, and the
recomputation after a preemption) feeds the model embeddings instead of ids: `pack_step` lists the
runs of embedded tokens, the runner gathers their rows, and the executor builds the step's
``[1, T, H]`` input from the model's own embedding of every packed id with the given rows put in place
(`HFExecutor._model_forward`). Such a step runs eager; decode steps never carry embeddings, so the
compiled and CUDA-graph decode path is untouched.

**Imported K/V** (`attach_kv`): a request may carry K and V per layer (``[m, Hkv, D]``) for its first
`m` positions, computed elsewhere (a `DynamicCache` passed to ``generate``). When the request is admitted
the scheduler counts those `m` tokens as computed, and before the step's forward the engine writes them
into the request's blocks (`ModelRunner.write_kv`, the inverse of `gather_kv`); prefill starts after
them. After a preemption the request is admitted again and they are written again.

Neither may ever be matched in the prefix cache by token ids (an embedded prompt's ids are placeholders
or may disagree with its embeddings; imported K/V was not computed by this engine): both give the request
a cache salt of its own (`isolate`), so its blocks are never shared with another request.
"""

from __future__ import annotations

import itertools
from typing import Any

from hfaccel.engine.request import Request

_salts = itertools.count()


def isolate(request: Request) -> None:
    """Give `request` a prefix-cache salt no other request has: its blocks match nothing, and nothing
    matches them."""
    if not isinstance(request.cache_salt, tuple) or request.cache_salt[:1] != ("isolated",):
        request.cache_salt = ("isolated", next(_salts), request.cache_salt)  # type: ignore[assignment]


def prompt_inputs_reason(engine: Any) -> str | None:
    """Why `engine`'s model cannot take prompt embeddings or imported K/V (None: it can)."""
    return engine.executor.prompt_inputs_reason()


def attach_prompt_embeds(engine: Any, request: Request, embeds: Any, hide_prompt: bool = False) -> None:
    """Feed `embeds` (``[n, H]``, n at most the prompt's length) for the request's first `n` prompt
    positions instead of their ids. `hide_prompt`: the logits processors see only generated tokens (the
    prompt ids are placeholders). Raises ValueError if the engine's model cannot take embeddings."""
    reason = prompt_inputs_reason(engine)
    if reason is not None:
        raise ValueError(f"prompt embeddings are not served for {reason}")
    if embeds.dim() != 2 or not embeds.is_floating_point():
        raise ValueError(
            f"prompt embeddings must be a float tensor [tokens, hidden], got {tuple(embeds.shape)}"
        )
    if not 0 < embeds.shape[0] <= len(request.prompt_token_ids):
        raise ValueError(
            f"{embeds.shape[0]} prompt embeddings for a prompt of {len(request.prompt_token_ids)} tokens"
        )
    request.prompt_embeds = embeds.to(engine.device)
    if hide_prompt:
        request.processor_sees_prompt = False
    request.speculation.enabled = False  # drafts from the ids would not see the embeddings
    isolate(request)


def attach_kv(engine: Any, request: Request, kv: list[tuple[Any, Any]]) -> None:
    """Import K and V (``[m, Hkv, D]`` per layer) for the request's first `m` positions; at least one
    prompt token is left to compute (its logits give the first new token). ``m == 0`` imports nothing.
    Raises ValueError if the shapes do not fit the engine's model."""
    reason = prompt_inputs_reason(engine)
    if reason is not None:
        raise ValueError(f"imported K/V is not served for {reason}")
    executor = engine.executor
    if len(kv) != executor.num_layers:
        raise ValueError(f"K/V for {len(kv)} layers, the model has {executor.num_layers}")
    count = int(kv[0][0].shape[0])
    want = (executor.num_kv_heads, executor.head_dim)
    for k, v in kv:
        if k.dim() != 3 or k.shape != v.shape or k.shape[0] != count or tuple(k.shape[1:]) != want:
            raise ValueError(
                f"imported K/V must be [{count}, {want[0]}, {want[1]}] per layer, got {tuple(k.shape)} "
                f"and {tuple(v.shape)}"
            )
    if count >= len(request.prompt_token_ids):
        raise ValueError(
            f"K/V for {count} tokens of a {len(request.prompt_token_ids)}-token prompt: at least the last "
            "prompt token must be computed"
        )
    if count == 0:
        return
    request.imported_kv = [(k.to(engine.device), v.to(engine.device)) for k, v in kv]
    isolate(request)


def write_imported_kv(runner: Any, requests: list[Request]) -> None:
    """Before a step's forward: write the imported K/V of the requests admitted in it (those whose
    computed tokens are exactly the imported ones: every later step starts past them) into their blocks."""
    for request in requests:
        if request.imported_kv is not None and request.num_computed_tokens == request.num_imported_tokens:
            window = request.window_table
            runner.write_kv(
                request.block_ids, request.imported_kv, None if window is None else window.block_ids
            )
