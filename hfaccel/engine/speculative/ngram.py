"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of the
context's suffix (the longest suffix of `max_n` down to `min_n` tokens that occurred before).

No second model: outputs that copy from the prompt (edits, extraction, summaries quoting the text,
code) are drafted for free. vLLM's n-gram proposer does the same over the request's own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to `k` draft tokens for the continuation of `tokens` (empty if no suffix recurs)."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        # Windows that start before the suffix itself and have at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # the latest occurrence: the most local context
            return arr[start : start + k].tolist()
    return []
