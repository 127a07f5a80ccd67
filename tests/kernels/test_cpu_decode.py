"""The CPU decode kernel (`kernels/cpu_decode.py`) against float32 SDPA over each sequence's own
context, its stores against torch's, and its wrapper's checks."""

import pytest
import torch
import torch.nn.functional as F

from hfaccel.kernels import cpu_decode, kv_quant


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
@pytest.mark.parametrize("heads", [(4, 2, 8), (6, 3, 64), (8, 8, 80), (9, 3, 64), (16, 2, 64), (18, 2, 64)])
@pytest.mark.parametrize("block", [16, 5])
@pytest.mark.parametrize(("window", "chunk"), [(0, 0), (7, 0), (20, 0), (0, 8), (0, 13), (7, 13)])
def test_cpu_decode_kernel_matches_sdpa(heads, block, window, chunk):
    """The kernel against SDPA over each sequence's own context: GQA ratios (8 query heads per KV head:
    the most the AVX-512 scoring takes; 9: the generic loop), head dims that are not a multiple of 16
    (the generic loop), lengths across and inside blocks, blocks of 5 tokens (the AVX-512 scoring's
    groups of 16 tokens span blocks), a strided block table and a padded sequence; with a sliding
    `window`, only each sequence's last `window` positions (starting inside a block); with a `chunk`,
    only its last token's chunk."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(1)
    blocks = 40 * 16 // block
    k_cache = torch.randn(blocks, block, hkv, d, generator=g)
    v_cache = torch.randn(blocks, block, hkv, d, generator=g)
    lens = [1, 16, 17, 100, 0, 33]
    table = torch.zeros(len(lens), 12 * 16 // block, dtype=torch.int32)  # wider than used: strided rows
    order = torch.randperm(blocks, generator=g).tolist()
    for i, n in enumerate(lens):
        for j in range(-(-n // block)):
            table[i, j] = order.pop()
    query = torch.randn(len(lens), hq, d, generator=g)
    out = torch.full_like(query, float("nan"))
    used = -(-max(lens) // block)
    cpu_decode.paged_decode(
        query,
        k_cache,
        v_cache,
        table[:, :used],
        torch.tensor(lens, dtype=torch.int32),
        max(lens),
        d**-0.5,
        out,
        window,
        chunk,
    )
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        first = max(0, n - window) if window else 0
        first = max(first, (n - 1) // chunk * chunk) if chunk else first
        slots = [int(table[i, p // block]) * block + p % block for p in range(first, n)]
        k = k_cache.view(-1, hkv, d)[slots].transpose(0, 1)[None]
        v = v_cache.view(-1, hkv, d)[slots].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(query[i][None, :, None], k, v, scale=d**-0.5, enable_gqa=True)
        torch.testing.assert_close(out[i], ref[0, :, 0], atol=2e-6, rtol=2e-6)


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
def test_cpu_decode_kernel_stores_the_new_rows_from_strided_views():
    """As the attention op gets them from HF (``[1, H, T, D]`` transposed to ``[T, H, D]``): the kernel
    stores each sequence's new K/V row at its slot before attending (the new token sees itself), skips
    a padded sequence (slot -1, length 0), and leaves every other cache row as it was."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, block = 6, 2, 16, 4
    k_cache = torch.randn(10, block, hkv, d, generator=g)
    v_cache = torch.randn(10, block, hkv, d, generator=g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    table = torch.tensor([[3, 7, 0], [5, 0, 0], [0, 0, 0]], dtype=torch.int32)
    lens = [6, 3, 0]  # the new token of sequence 0 at position 5 (block 7, offset 1); of 1 at 2
    slots = torch.tensor([7 * block + 1, 5 * block + 2, -1])
    query = torch.randn(hq, 3, d, generator=g).transpose(0, 1)  # [3, hq, d], strided rows
    key = torch.randn(1, hkv, 3, d, generator=g)[0].transpose(0, 1)
    value = torch.randn(1, hkv, 3, d, generator=g)[0].transpose(0, 1)
    out = torch.full((3, hq, d), float("nan"))
    call = cpu_decode.DecodeCall(table, torch.tensor(lens, dtype=torch.int32), max(lens), slots)
    call(query, k_cache, v_cache, d**-0.5, out, key, value)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    for i in range(2):
        assert torch.equal(flat_k[slots[i]], key[i]) and torch.equal(flat_v[slots[i]], value[i])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots[:2]] = True
    assert torch.equal(flat_k[~written], before_k.view(-1, hkv, d)[~written])
    assert torch.equal(flat_v[~written], before_v.view(-1, hkv, d)[~written])
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for i, n in enumerate(lens[:2]):
        positions = [int(table[i, p // block]) * block + p % block for p in range(n)]
        k = flat_k[positions].transpose(0, 1)[None]
        v = flat_v[positions].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(query[i][None, :, None], k, v, scale=d**-0.5, enable_gqa=True)
        torch.testing.assert_close(out[i], ref[0, :, 0], atol=2e-6, rtol=2e-6)


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.int8)],
)
def test_heads_first_reads_transformers_layout_in_place_as_the_packed_call_does(query_dtype, cache_dtype):
    """`DecodeCall.heads_first` over HF's ``[1, H, B, D]`` tensors (as a decoder layer hands them: views of
    ``[1, B, H, D]`` memory, value a view of its projection) gives the packed call's output bits, as
    ``[1, B, Hq, D]``, and stores the same cache bytes; a query whose head rows are not contiguous is
    refused, naming it."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, block = 6, 2, 16, 4
    width = kv_quant.row_width(d, cache_dtype)
    base = torch.randn(10, block, hkv, width, generator=g)
    k_cache = (
        base.to(cache_dtype)
        if cache_dtype != torch.int8
        else torch.zeros(10, block, hkv, width, dtype=torch.int8)
    )
    v_cache = k_cache.clone()
    table = torch.tensor([[3, 7, 0], [5, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    slots = torch.tensor([7 * block + 1, 5 * block + 2])
    query = torch.randn(1, 2, hq, d, generator=g).to(query_dtype).transpose(1, 2)
    key = torch.randn(1, 2, hkv, d, generator=g).to(query_dtype).transpose(1, 2)
    value = torch.randn(1, 2, hkv * d, generator=g).to(query_dtype).view(1, 2, hkv, d).transpose(1, 2)
    packed_k, packed_v = k_cache.clone(), v_cache.clone()
    expected = torch.empty(2, hq, d, dtype=query_dtype)
    cpu_decode.DecodeCall(table, lens, 6, slots)(
        query[0].transpose(0, 1),
        packed_k,
        packed_v,
        d**-0.5,
        expected,
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
    )
    out = cpu_decode.DecodeCall(table, lens, 6, slots).heads_first(
        query, key, value, k_cache, v_cache, d**-0.5
    )
    assert out.shape == (1, 2, hq, d) and out.is_contiguous()
    assert torch.equal(out[0], expected)
    assert torch.equal(k_cache, packed_k) and torch.equal(v_cache, packed_v)
    strided = torch.randn(1, hq, 2, 2 * d, generator=g).to(query_dtype)[..., ::2]
    with pytest.raises(ValueError, match="query must have contiguous head rows"):
        cpu_decode.DecodeCall(table, lens, 6, slots).heads_first(strided, key, value, k_cache, v_cache, 0.25)


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 6])  # 6: values padded to 8 bytes before the scale
def test_cpu_decode_kernel_quantizes_and_reads_an_int8_cache_as_kv_quant_does(query_dtype, head_dim):
    """Over an int8 cache the kernel stores each new row bit for bit as `kv_quant.store` does (rows with
    an all-zero head too), and attends over the values `kv_quant` reads back."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, block = 6, 2, 4
    width = kv_quant.row_width(head_dim, torch.int8)
    context = torch.randn(9 * block, hkv, head_dim, generator=g)
    k_cache = torch.zeros(10, block, hkv, width, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    kv_quant.store(k_cache, torch.arange(9 * block), context * 3)
    kv_quant.store(v_cache, torch.arange(9 * block), context)
    table = torch.tensor([[3, 7, 0], [5, 1, 8], [0, 0, 0]], dtype=torch.int32)
    lens = [6, 11, 0]
    slots = torch.tensor([7 * block + 1, 8 * block + 2, -1])
    query = torch.randn(3, hq, head_dim, generator=g).to(query_dtype)
    key = torch.randn(3, hkv, head_dim, generator=g).to(query_dtype)
    key[1, 0] = 0  # a zero row: scale 0, values 0
    value = torch.randn(3, hkv, head_dim, generator=g).to(query_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv_quant.store(expected_k, slots[:2], key[:2])
    kv_quant.store(expected_v, slots[:2], value[:2])
    out = torch.full((3, hq, head_dim), float("nan"), dtype=query_dtype)
    call = cpu_decode.DecodeCall(table, torch.tensor(lens, dtype=torch.int32), max(lens), slots)
    call(query, k_cache, v_cache, head_dim**-0.5, out, key, value)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    flat_k = kv_quant.load(k_cache.view(-1, hkv, width), head_dim, torch.float32)
    flat_v = kv_quant.load(v_cache.view(-1, hkv, width), head_dim, torch.float32)
    for i, n in enumerate(lens[:2]):
        positions = [int(table[i, p // block]) * block + p % block for p in range(n)]
        k, v = flat_k[positions].transpose(0, 1)[None], flat_v[positions].transpose(0, 1)[None]
        q = query[i].float()[None, :, None]
        ref = F.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, enable_gqa=True)[0, :, 0]
        tolerance = 2e-6 if query_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[i].float(), ref, atol=tolerance, rtol=tolerance)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_cpu_decode_kernel_is_off_for_other_dtypes_and_by_switch(monkeypatch):
    f32, bf16, f16, i8 = torch.float32, torch.bfloat16, torch.float16, torch.int8
    served = {(f32, f32), (f32, bf16), (bf16, bf16), (f32, i8), (bf16, i8)}
    for query_dtype in (f32, bf16, f16):
        for cache_dtype in (f32, bf16, f16, i8):
            query, cache = torch.zeros(1, 2, 8, dtype=query_dtype), torch.zeros(1, 4, 1, 8, dtype=cache_dtype)
            expected = (query_dtype, cache_dtype) in served and cpu_decode.load() is not None
            assert cpu_decode.supports(query, cache) == expected, (query_dtype, cache_dtype)
    assert not cpu_decode.supports(torch.zeros(3, 2, 8).transpose(0, 1), torch.zeros(1, 4, 1, 8))
    monkeypatch.setenv("HFACCEL_CPU_DECODE_KERNEL", "0")
    cpu_decode.load.cache_clear()
    try:
        assert cpu_decode.load() is None
    finally:
        monkeypatch.delenv("HFACCEL_CPU_DECODE_KERNEL")
        cpu_decode.load.cache_clear()


def _random_paged_case(g, heads, lens, dtype, block=16):
    """Caches of `dtype` with each sequence's blocks in random order, its table's rows strided."""
    hq, hkv, d = heads
    width = max(-(-n // block) for n in lens) + 2
    blocks = sum(-(-n // block) for n in lens) + 4
    k_cache = torch.randn(blocks, block, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(lens), width + 3, dtype=torch.int32)
    order = torch.randperm(blocks, generator=g).tolist()
    for i, n in enumerate(lens):
        for j in range(-(-n // block)):
            table[i, j] = order.pop()
    return k_cache, v_cache, table[:, :width]


def _sdpa_float32(query, k_cache, v_cache, table, lens, scale):
    """Each sequence's attention in float32 SDPA over its own context (the cache's values, widened)."""
    block, hkv, d = k_cache.shape[1:]
    out = torch.zeros(query.shape)
    for i, n in enumerate(lens):
        if n:
            slots = [int(table[i, p // block]) * block + p % block for p in range(n)]
            k = k_cache.view(-1, hkv, d)[slots].float().transpose(0, 1)[None]
            v = v_cache.view(-1, hkv, d)[slots].float().transpose(0, 1)[None]
            q = query[i].float()[None, :, None]
            out[i] = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[0, :, 0]
    return out


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 64), (8, 2, 64), (8, 2, 128), (6, 2, 24)])
@pytest.mark.parametrize("lens", [[17], [1, 16, 0, 33], [145, 3, 0, 64, 65, 16, 100, 31] * 4])
def test_cpu_decode_kernel_over_a_bf16_cache_matches_float32_sdpa(dtypes, heads, lens):
    """A float32 or bfloat16 query over a bfloat16 cache against float32 SDPA on the cache's (already
    bf16-rounded) contents: GQA ratios 3 (SmolLM2's shape), 1 and 4, head dims 64, 128 and 24 (the
    generic loop), batches of 1, 4 and 32, lengths inside and across blocks, padded sequences (zero
    rows). A float32 output differs by summation order only; a bf16 one by its rounding (half an ulp,
    2^-8 relative) on top."""
    query_dtype, cache_dtype = dtypes
    g = torch.Generator().manual_seed(len(lens) * heads[2])
    k_cache, v_cache, table = _random_paged_case(g, heads, lens, cache_dtype)
    query = torch.randn(len(lens), heads[0], heads[2], generator=g).to(query_dtype)
    out = torch.full_like(query, float("nan"))
    scale = heads[2] ** -0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cpu_decode.paged_decode(query, k_cache, v_cache, table, seq_lens, max(lens), scale, out)
    assert out.dtype == query_dtype
    ref = _sdpa_float32(query, k_cache, v_cache, table, lens, scale)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if query_dtype == torch.float32 else {"atol": 1e-5, "rtol": 2**-8}
    )
    torch.testing.assert_close(out.float(), ref, **tolerance)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))


# float32 bit patterns the bf16 rounding must get right: ties to even (down and up, both signs), just
# above and below a tie, the largest finite float (rounds to inf), subnormals, signed zeros, infinities.
_ROUNDING_BITS = [
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF,
    0x00000001, 0x80008000, 0x00018000, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7F8000,
    0x501502F9, 0x2F8E9E1B, 0xC7C35000, 0x3EAAAAAB,
]  # fmt: skip


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_stores_what_torch_stores_in_a_bf16_cache(query_dtype):
    """The new K/V rows arrive in the query's dtype; into a bf16 cache the kernel stores exactly what
    the torch path's ``index_copy_(..., key.to(torch.bfloat16))`` stores, bit for bit (round to nearest
    even: ties, overflow to inf, subnormals, -0.0, inf; NaN stays NaN), at the slots only: a padded
    sequence (slot -1) writes nothing and every other row keeps its bits."""
    from hfaccel.kernels.torch_paged import write_kv

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, block = 6, 2, 32, 4
    k_cache = torch.randn(10, block, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(10, block, hkv, d, generator=g).to(torch.bfloat16)
    table = torch.tensor([[3, 7, 0], [5, 0, 0], [0, 0, 0], [2, 9, 0]], dtype=torch.int32)
    lens = [6, 3, 0, 8]
    slots = torch.tensor([7 * block + 1, 5 * block + 2, -1, 9 * block + 3])
    key = torch.randn(1, hkv, 4, d, generator=g)[0].transpose(0, 1)  # strided, as from HF
    value = torch.randn(1, hkv, 4, d, generator=g)[0].transpose(0, 1)
    special = torch.tensor(_ROUNDING_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    key[0, 0, : len(special)] = special
    value[0, 1, : len(special)] = -special
    # NaNs whose payload is in the low bits only, or whose rounding would carry out of 32 bits
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0xFF800001], dtype=torch.int64)
    key[3, 1, :4] = nans.to(torch.int32).view(torch.float32)
    key, value = key.to(query_dtype), value.to(query_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    write_kv(expected_k, expected_v, key[real], value[real], slots[real])
    query = torch.randn(4, hq, d, generator=g).to(query_dtype)
    out = torch.empty_like(query)
    call = cpu_decode.DecodeCall(table, torch.tensor(lens, dtype=torch.int32), max(lens), slots)
    call(query, k_cache, v_cache, d**-0.5, out, key, value)
    for cache, expected in ((k_cache, expected_k), (v_cache, expected_v)):
        nan = expected.isnan()
        assert torch.equal(cache.isnan(), nan) and int(nan.sum()) == (4 if cache is k_cache else 0)
        assert torch.equal(cache.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
def test_cpu_decode_kernel_refuses_dtypes_it_does_not_serve():
    """Called directly (past `supports`), the kernel does nothing for other dtypes and says why."""
    call = cpu_decode.DecodeCall(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1)
    for query_dtype, cache_dtype in [(torch.float16, torch.float16), (torch.bfloat16, torch.float32)]:
        query = torch.ones(1, 2, 8, dtype=query_dtype)
        cache = torch.ones(1, 4, 1, 8, dtype=cache_dtype)
        out = torch.full_like(query, 7.0)
        with pytest.raises(ValueError, match="no kernel for"):
            call(query, cache, cache, 0.5, out)
        assert (out == 7).all()


@pytest.mark.skipif(
    cpu_decode.load() is None, reason="no C compiler: the CPU decode kernel is not built here"
)
def test_cpu_decode_call_converts_index_dtypes_and_refuses_inconsistent_tensors():
    """What a direct caller may hand the wrapper: int64 tables and lengths, int32 slots, a value of
    another dtype than the key, and a `max_seq_len` below the longest length are converted or made safe
    (the result equals the engine-shaped call); a mismatched V cache, key/value shapes or a query with
    strided head rows are refused with a ValueError rather than read wrongly."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, block = 9, 3, 64, 16
    lens = [5, 40, 17]
    k_cache, v_cache, table = _random_paged_case(g, (hq, hkv, d), lens, torch.float32)
    query = torch.randn(len(lens), hq, d, generator=g)
    key = torch.randn(len(lens), hkv, d, generator=g)
    value = torch.randn(len(lens), hkv, d, generator=g)
    slots = torch.tensor(
        [int(table[i, (n - 1) // block]) * block + (n - 1) % block for i, n in enumerate(lens)]
    )
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def attend(call, key, value):
        k, v, out = k_cache.clone(), v_cache.clone(), torch.empty_like(query)
        call(query, k, v, d**-0.5, out, key, value)
        return out, k, v

    expected = attend(cpu_decode.DecodeCall(table, seq_lens, max(lens), slots), key, value)
    loose = cpu_decode.DecodeCall(table.long(), seq_lens.long(), 1, slots.int())
    for got, want in zip(attend(loose, key, value.double()), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    call = cpu_decode.DecodeCall(table, seq_lens, max(lens), slots)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="v_cache"):
        call(query, k_cache, v_cache.bfloat16(), d**-0.5, out)
    with pytest.raises(ValueError, match="key and value"):
        call(query, k_cache.clone(), v_cache.clone(), d**-0.5, out, key, value[:, :1])
    strided = torch.randn(len(lens), hq, 2 * d, generator=g)[..., ::2]
    with pytest.raises(ValueError, match="contiguous head rows"):
        call(strided, k_cache, v_cache, d**-0.5, out)


def test_the_decode_kernel_refuses_a_tensor_subclass():
    class Wrapped(torch.Tensor):
        pass

    query, cache = torch.randn(2, 4, 8), torch.zeros(4, 16, 2, 8)
    if cpu_decode.load() is None:
        pytest.skip("no C compiler: the kernel is off")
    assert cpu_decode.supports(query, cache)
    assert not cpu_decode.supports(query.as_subclass(Wrapped), cache)
    assert not cpu_decode.supports(query, cache.as_subclass(Wrapped))


def test_small_calls_run_on_one_thread_and_threads_never_outnumber_tasks(monkeypatch):
    """`decode_threads`: one thread below `PARALLEL_MIN_WORK`, else torch's, at most one per task; and
    the kernel's result is the same bits on one thread as on two (each task is one thread's alone)."""
    least = cpu_decode.PARALLEL_MIN_WORK
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert cpu_decode.decode_threads(tasks=64, work=least - 1) == 1
    assert cpu_decode.decode_threads(tasks=64, work=least) == 8
    assert cpu_decode.decode_threads(tasks=3, work=10 * least) == 3
    monkeypatch.undo()
    if cpu_decode.load() is None:
        pytest.skip("no C compiler: the CPU decode kernel is not built here")
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 64, 16, 2, 64, generator=g).unbind(0)
    table = torch.arange(64, dtype=torch.int32).view(4, 16)
    lens = torch.tensor([200, 1, 256, 77], dtype=torch.int32)
    query = torch.randn(4, 8, 64, generator=g)
    outs = []
    for threads in (1, 2):
        monkeypatch.setattr(cpu_decode, "decode_threads", lambda tasks, work, n=threads: n)
        outs.append(
            cpu_decode.paged_decode(query, k_cache, v_cache, table, lens, 256, 0.125, torch.empty_like(query))
        )
    assert torch.equal(outs[0], outs[1])
