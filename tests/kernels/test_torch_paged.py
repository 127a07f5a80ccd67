"""The torch paged backend against plain dense causal attention, on random packed layouts."""

import pytest
import torch
import torch.nn.functional as F

from hfaccel.kernels import AttentionMetadata, TorchPagedAttention, get_backend

BLOCK = 4
HQ, HKV, D = 4, 2, 8


def dense_reference(q, k, v, scale):
    """Causal attention of the last q.shape[0] positions over the full k/v of one sequence."""
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def run_step(seqs, dtype, seed=0):
    """seqs: list of (context_before, new_tokens). Returns packed output and the per-seq references."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BLOCK, HKV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] != 1)
    queries, keys, values, slots, qsl, lens, tables, refs = [], [], [], [], [0], [], [], []
    for i in order:
        before, new = seqs[i]
        total = before + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        full_k = torch.randn(total, HKV, D, generator=g).to(dtype)
        full_v = torch.randn(total, HKV, D, generator=g).to(dtype)
        q = torch.randn(new, HQ, D, generator=g).to(dtype)
        for p in range(before):  # the cached context is already in the cache
            k_cache[blocks[p // BLOCK], p % BLOCK] = full_k[p]
            v_cache[blocks[p // BLOCK], p % BLOCK] = full_v[p]
        queries.append(q)
        keys.append(full_k[before:])
        values.append(full_v[before:])
        slots.extend(blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(before, total))
        qsl.append(qsl[-1] + new)
        lens.append(total)
        tables.append(blocks)
        refs.append(dense_reference(q, full_k, full_v, D**-0.5))
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=sum(1 for s in seqs if s[1] == 1),
        block_size=BLOCK,
        kv_caches=[(k_cache, v_cache)],
    )
    backend = TorchPagedAttention()
    backend.prepare(meta)
    key, value = torch.cat(keys), torch.cat(values)
    backend.write_kv(k_cache, v_cache, key, value, meta)
    out = backend.attend(torch.cat(queries), key, value, k_cache, v_cache, meta, D**-0.5)
    return out, torch.cat(refs)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 1)],  # a one-token prompt
        [(5, 1), (12, 1), (0, 1)],  # decodes of different lengths
        [(0, 7)],  # a fresh prompt longer than a block
        [(9, 6)],  # a prefill chunk continuing a cached context
        [(3, 1), (0, 9), (10, 1), (4, 5), (0, 2)],  # everything mixed in one step
    ],
)
def test_matches_dense_causal_attention(seqs, dtype):
    out, ref = run_step(seqs, dtype)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_write_kv_stores_at_slots_only():
    k_cache = torch.zeros(4, BLOCK, HKV, D)
    v_cache = torch.zeros_like(k_cache)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([6, 13]),
        query_start_loc=[0, 1, 2],
        seq_lens=[1, 1],
        block_tables=torch.tensor([[1], [3]]),
        num_decodes=2,
        block_size=BLOCK,
        kv_caches=[],
    )
    key = torch.randn(2, HKV, D)
    TorchPagedAttention().write_kv(k_cache, v_cache, key, key * 2, meta)
    assert torch.equal(k_cache[1, 2], key[0]) and torch.equal(k_cache[3, 1], key[1])
    assert torch.equal(v_cache[3, 1], key[1] * 2)
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2


def test_backend_lookup():
    assert get_backend("auto").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")
