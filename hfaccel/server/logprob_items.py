"""OpenAI's log-probability items: chat's ``content`` items per token (its text, bytes and the k most
likely alternatives), the completions endpoint's legacy layout with ``text_offset``, and the echoed
prompt's items."""

from __future__ import annotations

import asyncio
import codecs
from typing import Any

from hfaccel.api import prompt_logprobs_of
from hfaccel.api.detokenize import special_tokens, token_bytes


def logprob_items(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float] | None,
    top: list[dict[int, float]] | None,
    call: Any,
) -> list[dict[str, Any]] | None:
    """OpenAI's per-token logprobs (chat's ``content`` items), or None when not asked for."""
    if call.logprobs is False or logprobs is None:
        return None
    k = 0 if call.logprobs is True else int(call.logprobs)
    items = []
    for j, (token, logprob) in enumerate(zip(token_ids, logprobs)):
        ranked = sorted((top[j] if top else {}).items(), key=lambda kv: -kv[1])[:k]
        items.append(
            {
                **token_item(tokenizer, token, logprob),
                "top_logprobs": [token_item(tokenizer, t, lp) for t, lp in ranked],
            }
        )
    return items


async def echoed_prompt_items(served: Any, call: Any) -> list[list[dict[str, Any]]] | None:
    """Each prompt's logprob items when ``echo`` and ``logprobs`` ask for them, else None: one forward per
    prompt for its n choices, off the event loop (`api.results.prompt_logprobs_of`: the model's own
    distribution; the first token has none, OpenAI's null)."""
    if (k := call.prompt_logprobs()) is None:
        return None
    items = []
    for ids in call.prompts:
        prompt = await asyncio.to_thread(prompt_logprobs_of, served.model, ids, k)
        logprobs = [None if top is None else top[token] for token, top in zip(ids, prompt)]
        items.append(
            logprob_items(served.tokenizer, ids, logprobs, [top or {} for top in prompt], call) or []
        )
    return items


# The logprob written for a token its sampling ruled out (-inf after top_k, top_p, min_p or a grammar's
# mask): JSON has no infinity, and vLLM writes this.
LOWEST_LOGPROB = -9999.0


def token_item(tokenizer: Any, token: int, logprob: float | None) -> dict[str, Any]:
    """One logprob entry: the token's text alone (U+FFFD for part of a character) and its own bytes, which
    joined with the other tokens' make the text's UTF-8 (OpenAI's ``bytes``)."""
    if logprob is not None and not logprob >= LOWEST_LOGPROB:  # -inf (or NaN)
        logprob = LOWEST_LOGPROB
    return {
        "token": tokenizer.decode([token]),
        "logprob": logprob,
        "bytes": list(token_bytes(tokenizer, token)),
    }


def shown_bytes(tokenizer: Any, token_ids: list[int], skipped: frozenset[int] | None = None) -> list[bytes]:
    """The bytes each generated token adds to a plain reply's text: its own, none for a special token,
    which the text leaves out (`skipped`: the tokenizer's special ids, when the caller has them)."""
    skipped = special_tokens(tokenizer) if skipped is None else skipped
    return [b"" if token in skipped else token_bytes(tokenizer, token) for token in token_ids]


def legacy_logprobs(
    items: list[dict[str, Any]] | None, before: bytes = b"", shown: list[bytes] | None = None
) -> dict[str, Any] | None:
    """The completions endpoint's logprobs layout, from the chat items; ``text_offset`` counts characters
    from the start of the choice's text, whose first `before` bytes came earlier. `shown`: the bytes each
    item adds to the text (`shown_bytes`; default: the item's own)."""
    if items is None:
        return None
    if shown is None:
        shown = [bytes(item["bytes"]) for item in items]
    # Characters counted as the tokenizer decodes: an invalid byte is one U+FFFD, and only a character
    # still unfinished at the end waits (a token inside a character starts where that character does).
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, at = [], len(decoder.decode(before))
    for piece in shown:
        offsets.append(at)
        at += len(decoder.decode(piece))
    return {
        "tokens": [item["token"] for item in items],
        "token_logprobs": [item["logprob"] for item in items],
        # The k most likely and the chosen token: up to k + 1 entries, as OpenAI documents (and vLLM).
        "top_logprobs": [
            None
            if item["logprob"] is None
            else {t["token"]: t["logprob"] for t in item["top_logprobs"]} | {item["token"]: item["logprob"]}
            for item in items
        ],
        "text_offset": offsets,
    }
