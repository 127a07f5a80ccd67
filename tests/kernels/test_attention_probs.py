"""`attention_probs`: each packed query's probabilities over its own sequence's keys, read from the paged
cache, equal a dense reference written out per sequence (causal, windows, chunks, soft-capping, sinks,
GQA, a query-only token, blocks out of order)."""

import pytest
import torch

from hfaccel.kernels.attention_probs import attention_probs
from hfaccel.kernels.metadata import StepLayout


def _reference(q, keys, positions, scale, window, chunk, softcap, sinks):
    """q ``[Q, Hq, D]`` at `positions`, keys ``[S, Hq, D]`` -> ``[Hq, Q, S]``."""
    scores = torch.einsum("qhd,shd->hqs", q, keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    s = torch.arange(keys.shape[0])
    visible = s[None, :] <= positions[:, None]
    if window:
        visible &= s[None, :] > positions[:, None] - window
    if chunk:
        visible &= s[None, :] // chunk == positions[:, None] // chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., : keys.shape[0]]


@pytest.mark.parametrize(
    ("window", "chunk", "softcap", "sinks"),
    [(0, 0, 0.0, False), (3, 0, 0.0, False), (0, 4, 0.0, False), (0, 0, 0.5, True)],
)
def test_probs_equal_a_dense_reference(window, chunk, softcap, sinks):
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    k_cache = torch.randn(10, block_size, kv_heads, dim)
    # A decode (1 of 6), a prefill chunk (3 of 9, blocks out of order), a query-only token (seq_len 5
    # stops before it: it sees positions 0-4).
    query_lens, seq_lens = [1, 3, 1], [6, 9, 5]
    tables = [[7, 2], [4, 9, 0], [5, 1]]
    layout = StepLayout(query_lens, seq_lens, tables, [0] * 5, num_decodes=1)
    query = torch.randn(5, heads, dim)
    sink_logits = torch.randn(heads) if sinks else None
    probs = attention_probs(query, k_cache, layout, 0.3, window, chunk, softcap, sink_logits)
    assert probs.shape == (1, heads, 5, 9)
    start = 0
    for count, length, table in zip(query_lens, seq_lens, tables):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        keys = k_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        positions = torch.arange(length - count, length)
        expected = _reference(
            query[start : start + count], keys, positions, 0.3, window, chunk, softcap, sink_logits
        )
        torch.testing.assert_close(probs[0, :, start : start + count, :length], expected)
        assert not probs[0, :, start : start + count, length:].any()
        start += count
