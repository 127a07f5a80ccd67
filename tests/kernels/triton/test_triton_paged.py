"""Triton paged kernels against dense torch attention, on random non-contiguous block tables.

Caches start full of NaN, so a kernel that reads a slot it should not (past a sequence's length, a padded
row, a padding block-table entry) turns its output NaN and fails. K/V are written with plain torch indexing
here; ``store_kv`` is checked on its own against the same indexing.

Tolerances: max abs error vs the fp32 reference on inputs already rounded to the test dtype (values ~N(0,1),
outputs up to ~3), measured under the Triton interpreter over random sweeps: fp32 2.1e-6, fp16 8.7e-4 (the
final rounding to fp16 dominates), bf16 1.3e-2 (the interpreter truncates fp32 -> bf16 instead of rounding,
so up to 1 bf16 ulp = 2^-7 relative). Asserted: fp32 atol/rtol 1e-4, fp16 2e-3, bf16 atol 1e-2 rtol 1.6e-2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel.kernels import kv_quant
from hfaccel.kernels.triton import default_num_splits, paged_decode, paged_prefill, store_kv

interpreting = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting else "cpu"
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}
QUICK = settings(max_examples=8, deadline=None, derandomize=True)
FULL = settings(max_examples=60, deadline=None)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0, chunk: int = 0
) -> torch.Tensor:
    """fp32 causal attention of the last ``q.shape[0]`` positions of one sequence over its ``k``/``v``
    (within a sliding `window` of positions where > 0, as transformers' masks have it).

    q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``; query i sits at position ``Lk - Lq + i``.
    """
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    if window > 0:
        mask &= ~torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq - window)
    if chunk > 0:
        queries, keys = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
        mask &= keys // chunk == queries // chunk
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@dataclass
class Step:
    """One packed step: the kernels' inputs plus each sequence's dense K/V and queries."""

    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for padded tokens
    max_query_len: int
    full_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    full_v: list[torch.Tensor]
    scale: float
    window: int = 0
    chunk: int = 0

    def expected(self) -> list[torch.Tensor | None]:
        """Per sequence the reference output rows (None for a padded sequence)."""
        refs = []
        for b, (k, v) in enumerate(zip(self.full_k, self.full_v)):
            start, end = self.query_start_loc[b].item(), self.query_start_loc[b + 1].item()
            query = self.query[start:end].cpu()
            refs.append(dense_reference(query, k, v, self.scale, self.window, self.chunk) if len(k) else None)
        return refs


def make_step(
    seqs: list[tuple[int, int]],
    *,
    num_padded: int = 0,
    num_empty: int = 0,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Step:
    """``seqs``: (cached prefix, new tokens) per sequence, then ``num_padded`` padded sequences (seq_len 0,
    q_len 1, slot -1) and ``num_empty`` ones (seq_len 0, q_len 0).

    Blocks come from a random permutation, so a sequence's blocks are scattered through the cache; block-table
    padding points at a spare block that stays NaN, so reading through it poisons the output.
    """
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(prefix + new) // block_size) for prefix, new in seqs]
    num_blocks = sum(needed) + 3  # spare blocks stay NaN
    free = torch.randperm(num_blocks, generator=g).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = max(needed + [1])
    spare = free[0]  # blocks are popped from the end: the first 3 stay free
    tables, lens, qsl, slots, queries, full_k, full_v = [], [], [0], [], [], [], []
    for (prefix, new), count in zip(seqs, needed):
        total = prefix + new
        blocks = [free.pop() for _ in range(count)]
        k = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
        seq_slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(total)]
        )
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = k  # the reference write: prefix and new tokens
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = v
        tables.append(blocks + [spare] * (width - count))
        lens.append(total)
        qsl.append(qsl[-1] + new)
        slots.extend(seq_slots[prefix:].tolist())
        queries.append(torch.randn(new, num_kv_heads * group, head_dim, generator=g).to(dtype))
        full_k.append(k)
        full_v.append(v)
    for q_len in [1] * num_padded + [0] * num_empty:  # CUDA-graph padding: no context, writes nothing
        tables.append([spare] * width)
        lens.append(0)
        qsl.append(qsl[-1] + q_len)
        slots.extend([-1] * q_len)
        queries.append(torch.randn(q_len, num_kv_heads * group, head_dim, generator=g).to(dtype))
        full_k.append(k_cache.new_empty(0, num_kv_heads, head_dim))
        full_v.append(k_cache.new_empty(0, num_kv_heads, head_dim))
    return Step(
        query=torch.cat(queries).to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max([new for _, new in seqs] + [1]),
        full_k=full_k,
        full_v=full_v,
        scale=head_dim**-0.5,
    )


def assert_rows(out: torch.Tensor, step: Step, dtype: torch.dtype) -> None:
    out = out.cpu()
    assert out.dtype == dtype
    for b, ref in enumerate(step.expected()):
        rows = out[step.query_start_loc[b].item() : step.query_start_loc[b + 1].item()].float()
        if ref is None:  # padded sequence: finite (zero) output
            assert torch.all(rows == 0), f"padded seq {b}"
        else:
            torch.testing.assert_close(rows, ref, **TOL[dtype], msg=lambda m, b=b: f"seq {b}: {m}")


def check_prefill(step: Step, dtype: torch.dtype) -> None:
    out = paged_prefill(
        step.query,
        step.k_cache,
        step.v_cache,
        step.block_tables,
        step.seq_lens,
        step.query_start_loc,
        step.max_query_len,
        step.scale,
        window=step.window,
        chunk=step.chunk,
    )
    assert_rows(out, step, dtype)


def check_decode(step: Step, dtype: torch.dtype, num_splits: int | None = None) -> None:
    out = paged_decode(
        step.query,
        step.k_cache,
        step.v_cache,
        step.block_tables,
        step.seq_lens,
        step.scale,
        num_splits=num_splits,
        window=step.window,
        chunk=step.chunk,
    )
    assert_rows(out, step, dtype)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_slots_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, d, t = 6, 16, 3, 64, 9
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    # key/value as strided slices of one fused projection, like a real QKV output
    fused = torch.randn(t, 2 * hkv + 1, d, generator=g).to(dtype)
    key, value = fused[:, :hkv], fused[:, hkv : 2 * hkv]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[[2, 5, 8]] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    want_k.view(-1, hkv, d)[slots[real]] = key[real]
    want_v.view(-1, hkv, d)[slots[real]] = value[real]

    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    store_kv(key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    assert torch.equal(k_dev.cpu(), want_k)  # padded slots: the rest of the cache is untouched
    assert torch.equal(v_dev.cpu(), want_v)


def test_store_kv_then_prefill_end_to_end():
    """The new tokens' K/V written by store_kv (not the reference) give the same attention."""
    step = make_step([(5, 20), (0, 3)], num_padded=1, num_empty=1, block_size=16, group=2)
    hkv, d = step.k_cache.shape[2:]
    real = step.slot_mapping >= 0
    flat_k = step.k_cache.view(-1, hkv, d)
    new_k = torch.zeros(len(step.slot_mapping), hkv, d, dtype=step.k_cache.dtype, device=DEVICE)
    new_k[real] = flat_k[step.slot_mapping[real]]
    new_v = torch.zeros_like(new_k)
    new_v[real] = step.v_cache.view(-1, hkv, d)[step.slot_mapping[real]]
    flat_k[step.slot_mapping[real]] = float("nan")  # forget them, then store them again
    step.v_cache.view(-1, hkv, d)[step.slot_mapping[real]] = float("nan")
    store_kv(new_k, new_v, step.k_cache, step.v_cache, step.slot_mapping)
    check_prefill(step, torch.float32)


# ---------------------------------------------------------------- representative cases (default run)


@pytest.mark.parametrize(
    "block_size,group,head_dim,dtype",
    [(16, 1, 64, torch.float32), (32, 4, 128, torch.float16), (16, 3, 64, torch.bfloat16)],
)
def test_prefill_mixed_step(block_size, group, head_dim, dtype):
    # A fresh prompt, a chunk continuing a cached prefix across block boundaries, a decode, a padded slot.
    seqs = [(0, 19), (37, 14), (50, 1)]
    step = make_step(seqs, num_padded=1, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype)
    check_prefill(step, dtype)


@pytest.mark.parametrize(
    "block_size,group,head_dim,dtype,num_splits",
    [(16, 4, 64, torch.float32, None), (32, 8, 128, torch.float16, 3), (16, 1, 64, torch.float32, 16)],
)
def test_decode(block_size, group, head_dim, dtype, num_splits):
    # Lengths on, before and after block boundaries; 16 splits leave most of them empty.
    seqs = [(0, 1), (15, 1), (31, 1), (76, 1), (200, 1)]
    step = make_step(seqs, num_padded=1, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype)
    check_decode(step, dtype, num_splits)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_prefill_within_a_sliding_window(window):
    """A fresh prompt, a chunk continuing a cached prefix and a decode, each query seeing its last
    `window` positions (starting inside a block and a tile); padding still reads nothing."""
    step = make_step([(0, 19), (37, 14), (50, 1)], num_padded=1, group=2)
    step.window = window
    check_prefill(step, torch.float32)


@pytest.mark.parametrize(("window", "num_splits"), [(1, None), (9, 3), (70, 4), (300, None)])
def test_decode_within_a_sliding_window(window, num_splits):
    """Splits share only the visible tiles; a window longer than the context sees all of it."""
    step = make_step([(0, 1), (15, 1), (31, 1), (76, 1), (200, 1)], num_padded=1, group=4)
    step.window = window
    check_decode(step, torch.float32, num_splits)


@pytest.mark.parametrize(
    ("window", "chunk", "num_splits"), [(0, 16, None), (0, 20, 3), (9, 20, 4), (0, 300, None)]
)
def test_chunked_attention_in_prefill_and_decode(window, chunk, num_splits):
    """Each query sees its own chunk only (chunks starting inside blocks and tiles; with a window too,
    the later start); prefill rows of one query block may span two chunks."""
    step = make_step([(0, 19), (37, 14), (50, 1)], num_padded=1, group=2)
    step.window, step.chunk = window, chunk
    check_prefill(step, torch.float32)
    step = make_step([(0, 1), (15, 1), (31, 1), (76, 1), (200, 1)], num_padded=1, group=4)
    step.window, step.chunk = window, chunk
    check_decode(step, torch.float32, num_splits)


def quantized(step: Step, align: int = 4) -> Step:
    """`step` over an int8 cache (`kv_quant`: int8 rows with a float32 scale each, padded to `align`
    bytes), its reference K/V what that cache gives back. The spare blocks' NaN rows keep a NaN scale:
    reading them still poisons."""
    width = kv_quant.row_width(step.k_cache.shape[-1], torch.int8, align)
    step.k_cache, step.v_cache = (
        kv_quant.quantize(step.k_cache, width),
        kv_quant.quantize(step.v_cache, width),
    )
    step.full_k = [kv_quant.roundtrip(k) for k in step.full_k]
    step.full_v = [kv_quant.roundtrip(v) for v in step.full_v]
    return step


@pytest.mark.parametrize(("head_dim", "align"), [(64, 4), (16, 4), (64, 16), (16, 16)])
def test_an_int8_cache_is_read_through_its_scales(head_dim, align):
    """Prefill (a fresh prompt, a continued chunk, a decode, a padded row) and decode (split and not,
    within a window) over int8 rows, 4-byte aligned and 16-byte aligned as the backend lays them out:
    attention over the values the cache holds, at fp32 tolerance."""
    step = make_step([(0, 19), (37, 14), (50, 1)], num_padded=1, group=2, head_dim=head_dim)
    check_prefill(quantized(step, align), torch.float32)
    for window, num_splits in ((0, None), (0, 4), (9, 3)):
        step = quantized(
            make_step([(0, 1), (15, 1), (76, 1), (200, 1)], num_padded=1, group=4, head_dim=head_dim), align
        )
        step.window = window
        check_decode(step, torch.float32, num_splits)


@pytest.mark.parametrize("align", [4, 16])
def test_store_kv_quantizes_into_an_int8_cache_as_kv_quant_stores(align):
    g = torch.Generator().manual_seed(2)
    hkv, d, t = 2, 64, 7
    cache = kv_quant.quantize(
        torch.randn(4, 16, hkv, d, generator=g), kv_quant.row_width(d, torch.int8, align)
    )
    key, value = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    slots = torch.randperm(64, generator=g)[:t]
    slots[3] = -1
    want_k, want_v = cache.clone(), cache.clone()
    real = slots >= 0
    kv_quant.store(want_k, slots[real], key[real])
    kv_quant.store(want_v, slots[real], value[real])
    k_dev, v_dev = cache.clone().to(DEVICE), cache.clone().to(DEVICE)
    store_kv(key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    assert torch.equal(k_dev.cpu(), want_k) and torch.equal(v_dev.cpu(), want_v)


def test_decode_matches_prefill_and_out_buffer():
    step = make_step([(40, 1), (3, 1), (0, 1)], num_padded=2, group=2)
    buf = torch.full_like(step.query, float("nan"))
    got = paged_decode(
        step.query, step.k_cache, step.v_cache, step.block_tables, step.seq_lens, step.scale, out=buf
    )
    assert got is buf
    ref = paged_prefill(
        step.query,
        step.k_cache,
        step.v_cache,
        step.block_tables,
        step.seq_lens,
        step.query_start_loc,
        1,
        step.scale,
    )
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_default_num_splits_ignores_lengths():
    assert default_num_splits(1, 8, 100) == 1  # short context: nothing to split
    assert default_num_splits(1, 8, 8192) == 16  # one long sequence: split it up, at most 16 ways
    assert default_num_splits(1, 1, 1024) == 4
    assert default_num_splits(256, 8, 8192) == 1  # a big batch fills the GPU by itself
    assert default_num_splits(4, 8, 8192) == 8


@pytest.mark.parametrize("head_dim", [8, 96, 512])
def test_unsupported_head_dim(head_dim):
    cache = torch.zeros(2, 16, 1, head_dim)
    q = torch.zeros(1, 1, head_dim)
    lens, table = torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode(q, cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill(q, cache, cache, table, lens, torch.tensor([0, 1], dtype=torch.int32), 1, 1.0)


# ---------------------------------------------------------------- hypothesis


@st.composite
def layouts(
    draw,
    max_seqs: int,
    max_prefix: int,
    max_new: int,
    block_sizes: tuple[int, ...] = (16, 32),
    head_dims: tuple[int, ...] = (64, 128),
):
    """A random step: ragged prefixes and new tokens (``max_new=1``: a decode step), padding, GQA, dtype."""
    seqs = draw(
        st.lists(
            st.tuples(st.integers(0, max_prefix), st.integers(1, max_new)), min_size=1, max_size=max_seqs
        )
    )
    return dict(
        seqs=seqs,
        num_padded=draw(st.integers(0, 2)),
        num_empty=0 if max_new == 1 else draw(st.integers(0, 1)),
        block_size=draw(st.sampled_from(block_sizes)),
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 3, 4, 8])),
        head_dim=draw(st.sampled_from(head_dims)),
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
    )


@QUICK
@given(layouts(max_seqs=3, max_prefix=40, max_new=20))
def test_prefill_random(case):
    check_prefill(make_step(**case), case["dtype"])


@QUICK
@given(layouts(max_seqs=3, max_prefix=80, max_new=1), st.sampled_from([None, 1, 2, 5]))
def test_decode_random(case, num_splits):
    check_decode(make_step(**case), case["dtype"], num_splits)


@pytest.mark.kernels_full
@FULL
@given(
    layouts(max_seqs=5, max_prefix=160, max_new=70, block_sizes=(8, 16, 32, 64), head_dims=(16, 64, 128, 256))
)
def test_prefill_random_full(case):
    check_prefill(make_step(**case), case["dtype"])


@pytest.mark.kernels_full
@FULL
@given(
    layouts(max_seqs=6, max_prefix=400, max_new=1, block_sizes=(8, 16, 32, 64), head_dims=(16, 64, 128, 256)),
    st.sampled_from([None, 1, 2, 3, 7, 16]),
)
def test_decode_random_full(case, num_splits):
    check_decode(make_step(**case), case["dtype"], num_splits)
