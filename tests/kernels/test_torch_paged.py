"""The torch paged backend against plain dense causal attention, on random packed layouts."""

import pytest
import torch
import torch.nn.functional as F

from hfaccel.kernels import StepLayout, TorchPagedAttention, cpu_decode, kv_quant

BLOCK = 4
HQ, HKV, D = 4, 2, 8


def dense_reference(q, k, v, scale, window=0, chunk=0, softcap=0.0, sinks=None):
    """Causal attention of the last q.shape[0] positions over the full k/v of one sequence (within a
    sliding `window` of positions, and within each query's `chunk`, where > 0; soft-capped scores and
    attention sinks written out as transformers' eager Gemma 2 and gpt-oss attention do)."""
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    if window > 0:
        mask &= ~torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq - window)
    if chunk > 0:
        queries, keys = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
        mask &= keys // chunk == queries // chunk
    if softcap or sinks is not None:
        rep = q.shape[1] // k.shape[1]
        qf, kf = q.transpose(0, 1).float(), k.transpose(0, 1).float().repeat_interleave(rep, 0)
        scores = qf @ kf.transpose(-1, -2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, lq, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :lk]
        return (probs @ v.transpose(0, 1).float().repeat_interleave(rep, 0)).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def run_step(
    seqs, dtype, seed=0, decode_query_len=1, window=0, chunk=0, softcap=0.0, sinks=None, kv_dtype=None
):
    """seqs: list of (context_before, new_tokens). Returns packed output and the per-seq references.
    `kv_dtype` torch.int8: an int8 cache, the references over the K/V values it gives back."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    kv_dtype = kv_dtype or dtype
    k_cache = torch.zeros(num_blocks, BLOCK, HKV, kv_quant.row_width(D, kv_dtype), dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] > decode_query_len)
    queries, keys, values, slots, qsl, lens, tables, refs = [], [], [], [], [0], [], [], []
    for i in order:
        before, new = seqs[i]
        total = before + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        full_k = torch.randn(total, HKV, D, generator=g).to(dtype)
        full_v = torch.randn(total, HKV, D, generator=g).to(dtype)
        q = torch.randn(new, HQ, D, generator=g).to(dtype)
        context = torch.tensor(
            [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(before)], dtype=torch.long
        )
        kv_quant.store(k_cache, context, full_k[:before])  # the cached context is already in the cache
        kv_quant.store(v_cache, context, full_v[:before])
        if kv_quant.is_quantized(kv_dtype):  # every key and value is read back from int8 rows
            full_k, full_v = kv_quant.roundtrip(full_k), kv_quant.roundtrip(full_v)
        queries.append(q)
        keys.append(full_k[before:])
        values.append(full_v[before:])
        slots.extend(blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(before, total))
        qsl.append(qsl[-1] + new)
        lens.append(total)
        tables.append(blocks)
        refs.append(dense_reference(q, full_k, full_v, D**-0.5, window, chunk, softcap, sinks))
    layout = StepLayout(
        query_lens=[seqs[i][1] for i in order],
        seq_lens=lens,
        block_tables=tables,
        slot_mapping=slots,
        num_decodes=sum(1 for s in seqs if s[1] <= decode_query_len),
    )
    backend = TorchPagedAttention()
    builder = backend.make_builder(8, 64, 16, BLOCK, torch.device("cpu"), num_blocks=num_blocks)
    meta = builder.build(layout)
    key, value = torch.cat(keys), torch.cat(values)
    out = backend.forward(
        torch.cat(queries), key, value, (k_cache, v_cache), meta, D**-0.5, window, chunk, softcap, sinks
    )
    return out, torch.cat(refs)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(params=["kernel", "sdpa"])
def decode_path(request, monkeypatch):
    """float32 and bfloat16 decodes on a CPU run the C kernel where a compiler builds it; "sdpa" forces
    the gathered batched-SDPA path (what float16 and other devices take)."""
    if request.param == "kernel" and cpu_decode.load() is None:
        pytest.skip("no C compiler: the CPU decode kernel is not built here")
    if request.param == "sdpa":
        monkeypatch.setattr(cpu_decode, "supports", lambda *args: False)
    return request.param


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
def test_matches_dense_causal_attention(seqs, dtype, decode_path):
    out, ref = run_step(seqs, dtype)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("seqs", "decode_query_len"),
    [
        ([(5, 1), (12, 1), (0, 1)], 1),  # decodes only: the C kernel stores and attends in one call
        ([(3, 1), (0, 9), (10, 1), (4, 5), (0, 2)], 1),  # fresh prompts, continued chunks and decodes
        ([(10, 3), (20, 5), (4, 1), (0, 7)], 8),  # verification rows
    ],
)
def test_int8_cache_matches_attention_over_its_dequantized_rows(seqs, decode_query_len, dtype, decode_path):
    """An int8 cache: every path (the C kernel's stores and reads, the gathered SDPA, a fresh prompt's
    own K/V) attends over exactly the values the quantized rows give back, so a prompt attends the same
    whether its K/V come from the cache or from this step."""
    out, ref = run_step(seqs, dtype, decode_query_len=decode_query_len, kv_dtype=torch.int8)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("window", "softcap", "with_sinks"), [(3, 0.0, False), (0, 0.5, True)])
def test_int8_cache_serves_windows_softcapping_and_sinks(window, softcap, with_sinks, decode_path):
    seqs = [(9, 1), (0, 6), (5, 4), (14, 1)]
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(3)) if with_sinks else None
    out, ref = run_step(seqs, torch.float32, window=window, softcap=softcap, sinks=sinks, kv_dtype=torch.int8)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_query_decode_rows_match_dense_causal_attention(dtype, decode_path):
    """Verification rows (1 + k queries continuing a context) on the batched decode path, mixed with
    one-query decodes, a short fresh prompt and a long prefill."""
    seqs = [(10, 3), (20, 5), (4, 1), (0, 2), (7, 12)]
    out, ref = run_step(seqs, dtype, decode_query_len=8)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("decode_query_len", [1, 8])
def test_sliding_windows_match_dense_windowed_attention(window, decode_query_len, decode_path):
    """Every path within a sliding window: one-query decodes (the kernel, or the gathered SDPA),
    verification rows, a fresh prompt longer than the window, a chunk continuing a cached context."""
    seqs = [(10, 3), (20, 1), (4, 1), (0, 9), (7, 12)]
    out, ref = run_step(seqs, torch.float32, decode_query_len=decode_query_len, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    decodes_only = [(10, 1), (20, 1), (2, 1)]  # a step of decodes only: the kernel stores and attends
    out, ref = run_step(decodes_only, torch.float32, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "chunk"), [(0, 4), (0, 5), (3, 4)])
@pytest.mark.parametrize("decode_query_len", [1, 8])
def test_chunked_attention_matches_dense_chunked_attention(window, chunk, decode_query_len, decode_path):
    """Each query sees its own chunk only (and, with both, the later of its window's and chunk's
    starts): on every path, chunks starting inside blocks (5 over blocks of 4)."""
    seqs = [(10, 3), (20, 1), (4, 1), (0, 9), (7, 12)]
    out, ref = run_step(seqs, torch.float32, decode_query_len=decode_query_len, window=window, chunk=chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out, ref = run_step([(10, 1), (20, 1), (2, 1), (7, 1)], torch.float32, window=window, chunk=chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("softcap", "with_sinks"), [(0.5, False), (0.0, True), (0.5, True)])
@pytest.mark.parametrize("decode_query_len", [1, 8])
def test_softcapping_and_sinks_match_the_written_out_attention(
    softcap, with_sinks, decode_query_len, decode_path
):
    """Gemma 2's soft-capped scores and gpt-oss's attention sinks (one logit per query head, large), on
    every path (the C kernel, the batched decode, verification rows, fresh and continued prefill), with
    a sliding window too."""
    sinks = torch.tensor([1.5, -0.5, 3.0, 0.0]) if with_sinks else None
    seqs = [(10, 3), (20, 1), (4, 1), (0, 9), (7, 12)]
    for window in (0, 5):
        out, ref = run_step(
            seqs,
            torch.float32,
            decode_query_len=decode_query_len,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        out, ref = run_step(
            [(10, 1), (20, 1), (2, 1)], torch.float32, window=window, softcap=softcap, sinks=sinks
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _one_step(slots, padded_seqs=None, padded_tokens=None, num_blocks=4):
    backend = TorchPagedAttention()
    k_cache = torch.zeros(backend.kv_cache_shape(num_blocks, BLOCK, HKV, D))
    v_cache = torch.zeros_like(k_cache)
    layout = StepLayout(
        query_lens=[1] * len(slots),
        seq_lens=[s % BLOCK + 1 for s in slots],
        block_tables=[[s // BLOCK] for s in slots],
        slot_mapping=slots,
        num_decodes=len(slots),
    )
    builder = backend.make_builder(4, 8, 2, BLOCK, torch.device("cpu"), num_blocks=num_blocks)
    meta = builder.build(layout, padded_seqs, padded_tokens)
    t = meta.common.num_padded_tokens
    key = torch.randn(t, HKV, D)
    out = backend.forward(torch.randn(t, HQ, D), key, key * 2, (k_cache, v_cache), meta, D**-0.5)
    return k_cache, v_cache, key, out, meta


def test_forward_stores_kv_at_slots_only():
    k_cache, v_cache, key, _, _ = _one_step([6, 13])
    assert torch.equal(k_cache[1, 2], key[0]) and torch.equal(k_cache[3, 1], key[1])
    assert torch.equal(v_cache[3, 1], key[1] * 2)
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2


def test_padded_slots_write_no_usable_block_and_padded_rows_are_zero(decode_path):
    k_cache, _, key, out, meta = _one_step([6, 13], padded_seqs=4, padded_tokens=4)
    common = meta.common
    assert common.slot_mapping.tolist() == [6, 13, -1, -1]
    assert common.seq_lens.tolist() == [3, 2, 0, 0]
    assert common.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    usable = k_cache[:4]  # the 5th block is the scratch block
    assert int((usable != 0).any(dim=(2, 3)).sum()) == 2
    assert torch.equal(out[2:], torch.zeros_like(out[2:])) and torch.isfinite(out).all()


def test_builder_fills_the_same_buffers_every_step():
    backend = TorchPagedAttention()
    builder = backend.make_builder(4, 8, 2, BLOCK, torch.device("cpu"), num_blocks=4)
    first = builder.build(StepLayout([1], [3], [[1]], [6], 1)).common
    second = builder.build(StepLayout([1, 1], [3, 2], [[1], [2]], [6, 9], 2)).common
    assert first.slot_mapping.data_ptr() == second.slot_mapping.data_ptr()
    assert first.block_tables.data_ptr() == second.block_tables.data_ptr()
    assert second.slot_mapping.tolist() == [6, 9] and second.block_tables.tolist() == [[1], [2]]


def test_builder_refuses_a_step_larger_than_its_buffers():
    builder = TorchPagedAttention().make_builder(2, 4, 2, BLOCK, torch.device("cpu"), num_blocks=4)
    with pytest.raises(ValueError, match="does not fit the buffers"):
        builder.build(StepLayout([1, 1, 1], [1, 1, 1], [[0], [1], [2]], [0, 4, 8], 3))


def test_custom_op_has_a_fake_implementation_for_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hfaccel.kernels.op  # noqa: F401

    with FakeTensorMode():
        q, k = torch.empty(5, HQ, D), torch.empty(5, HKV, D)
        out = torch.ops.hfaccel.paged_attention_v2(q, k, k, 0, 0.1)
    assert out.shape == (5, HQ, D)


def test_custom_op_outside_an_engine_step_raises():
    import hfaccel.kernels.op  # noqa: F401

    with pytest.raises(RuntimeError, match="only inside an hfaccel engine step"):
        torch.ops.hfaccel.paged_attention_v2(
            torch.randn(1, HQ, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D), 0, 0.1
        )


def test_decode_bias_is_built_once_per_step_and_is_the_additive_mask():
    """Every layer of a step shares one additive bias (no boolean mask converted per layer)."""
    backend = TorchPagedAttention()
    builder = backend.make_builder(4, 8, 4, BLOCK, torch.device("cpu"), num_blocks=8)
    meta = builder.build(StepLayout([1, 1], [3, 9], [[1], [2, 3, 4]], [6, 16], 2))
    bias = meta.decode_bias(torch.float32, 2)
    assert meta.decode_bias(torch.float32, 2) is bias  # the second layer reuses it
    assert bias.shape == (2, 1, 1, 3 * BLOCK)
    assert torch.equal(bias == 0, meta.decode_mask) and torch.isneginf(bias[~meta.decode_mask]).all()
    assert meta.decode_bias(torch.bfloat16, 2).dtype == torch.bfloat16
    again = builder.build(StepLayout([1], [2], [[1]], [5], 1))  # the next step builds its own
    assert again.decode_bias(torch.float32, 2).shape == (1, 1, 1, BLOCK)


def test_decode_bias_rows_follow_the_query_heads_of_multi_query_rows():
    backend = TorchPagedAttention()
    builder = backend.make_builder(4, 16, 4, BLOCK, torch.device("cpu"), num_blocks=8)
    meta = builder.build(StepLayout([3, 1], [7, 5], [[1, 2], [3, 4]], [8, 9, 10, 12], 2))
    bias = meta.decode_bias(torch.float32, 2)  # 2 query heads per KV head, 3 queries per sequence
    assert bias.shape == (2, 1, 2 * 3, 2 * BLOCK)
    visible = (bias == 0).sum(-1)[:, 0]  # rows ordered (head in group, query)
    assert visible[0].tolist() == [5, 6, 7, 5, 6, 7]


def test_all_decode_step_returns_a_contiguous_result_matching_the_reference(decode_path):
    """A step of one-token decodes only, unpadded, returns SDPA's output itself (the op's fake
    implementation promises a contiguous [T, Hq, D] to a compiled graph)."""
    out, ref = run_step([(5, 1), (12, 1), (7, 1)], torch.float32)
    assert out.is_contiguous() and out.shape == (3, HQ, D)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
