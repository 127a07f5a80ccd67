"""The FlashInfer backend.

On the CPU: the host-side plan inputs against hand-computed CSR lists, availability reporting, and the
builder + forward glue against the torch backend, with a stand-in ``flashinfer`` module whose wrappers
implement the documented semantics of ``plan``/``run`` in plain torch (and check what they are fed the
way FlashInfer does). On CUDA with flashinfer-python installed: the real kernels against the torch
backend, CUDA-graph replay included (skipped elsewhere).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from hfaccel.kernels import StepLayout, TorchPagedAttention, get_backend, unavailable_reason
from hfaccel.kernels import flashinfer_backend as fib
from hfaccel.kernels.flashinfer_backend import FlashInferMetadataBuilder, FlashInferPagedAttention
from hfaccel.kernels.flashinfer_plan import decode_plan_inputs, prefill_plan_inputs

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(
    not (HAS_CUDA and HAS_FLASHINFER),
    reason="FlashInfer kernels need a CUDA device and flashinfer-python"
    + ("" if HAS_CUDA else " (no CUDA device here)")
    + ("" if HAS_FLASHINFER else " (flashinfer-python is not installed)"),
)


def tolist(*tensors):
    return [t.tolist() for t in tensors]


# --- plan inputs, hand-computed (block_size 4) -------------------------------------------------------

TABLES = torch.tensor([[3, 7, 0], [5, 0, 0], [9, 2, 4], [1, 6, 0]], dtype=torch.int32)
LENS = [8, 1, 9, 6]  # 8: exactly two full blocks; 1: one token; 9: a third block holding one token


def test_decode_plan_inputs_by_hand():
    indptr, indices, last = decode_plan_inputs(TABLES, LENS, 4)
    assert tolist(indptr, indices, last) == [[0, 2, 3, 6, 8], [3, 7, 5, 9, 2, 4, 1, 6], [4, 1, 1, 2]]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.device.type == "cpu"


def test_decode_exact_multiple_of_block_size_has_a_full_last_page():
    tables = torch.tensor([[4, 2], [8, 0]], dtype=torch.int32)
    assert tolist(*decode_plan_inputs(tables, [4, 8][::-1], 4)) == [[0, 2, 3], [4, 2, 8], [4, 4]]
    assert tolist(*decode_plan_inputs(tables[:1], [4], 4)) == [[0, 1], [4], [4]]


def test_decode_length_one_and_block_size_one():
    tables = torch.tensor([[6, 0, 0]], dtype=torch.int32)
    assert tolist(*decode_plan_inputs(tables, [1], 16)) == [[0, 1], [6], [1]]
    tables = torch.tensor([[6, 3, 5]], dtype=torch.int32)
    assert tolist(*decode_plan_inputs(tables, [3], 1)) == [[0, 3], [6, 3, 5], [1]]


def test_decode_padded_to_a_cuda_graph_bucket():
    indptr, indices, last = decode_plan_inputs(TABLES, LENS, 4, batch_size=6)
    assert tolist(indptr, indices, last) == [
        [0, 2, 3, 6, 8, 8, 8],
        [3, 7, 5, 9, 2, 4, 1, 6],
        [4, 1, 1, 2, 1, 1],
    ]
    # no real sequence at all
    assert tolist(*decode_plan_inputs(TABLES[:0], [], 4, batch_size=2)) == [[0, 0, 0], [], [1, 1]]
    # a padded sequence handed over with length 0 (as build_common leaves it) reads the same
    indptr, indices, last = decode_plan_inputs(TABLES, [8, 1, 0, 0], 4)
    assert tolist(indptr, indices, last) == [[0, 2, 3, 3, 3], [3, 7, 5], [4, 1, 1, 1]]


def test_decode_plan_inputs_refuse_bad_inputs():
    with pytest.raises(ValueError, match="needs 3 blocks"):
        decode_plan_inputs(TABLES[:, :2], LENS, 4)
    with pytest.raises(ValueError, match="smaller than"):
        decode_plan_inputs(TABLES, LENS, 4, batch_size=3)
    with pytest.raises(ValueError, match="do not cover"):
        decode_plan_inputs(TABLES[:2], LENS, 4)


def test_prefill_plan_inputs_with_cached_prefixes_by_hand():
    # (cached 6 + 3 new), a fresh 4-token prompt (exactly one block), (cached 3 + 5 new: two full blocks)
    tables = torch.tensor([[4, 10, 12], [7, 0, 0], [1, 13, 0]], dtype=torch.int32)
    qo, kv_indptr, kv_indices, last = prefill_plan_inputs([3, 4, 5], tables, [9, 4, 8], 4)
    assert tolist(qo, kv_indptr, kv_indices, last) == [
        [0, 3, 7, 12],
        [0, 3, 4, 6],
        [4, 10, 12, 7, 1, 13],
        [1, 4, 4],
    ]
    with pytest.raises(ValueError, match="query lengths"):
        prefill_plan_inputs([5], tables[:1], [4], 4)


# --- availability ------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer-python is installed here")
def test_unavailable_names_the_missing_package():
    reason = FlashInferPagedAttention.unavailable_reason(torch.device("cuda"), torch.float16, 128)
    assert reason == "flashinfer-python is not installed (pip install 'hfaccel[flashinfer]')"
    assert unavailable_reason("flashinfer", torch.device("cuda"), torch.float16, 128) == reason
    with pytest.raises(ValueError, match=r"'flashinfer' cannot run here: flashinfer-python is not installed"):
        get_backend("flashinfer", "cuda", torch.float16, 128)
    assert get_backend("auto", "cuda", torch.float16, 128).name != "flashinfer"


def test_unavailable_reason_order(monkeypatch):
    cls = FlashInferPagedAttention
    cuda = torch.device("cuda")
    monkeypatch.setattr(fib, "installed_version", lambda: "0.1.6")
    assert cls.unavailable_reason(cuda, torch.float16, 128) == (
        "FlashInfer 0.1.6 is not supported (supported: >=0.2.2,<0.8)"
    )
    monkeypatch.setattr(fib, "installed_version", lambda: "0.8.0")
    assert "FlashInfer 0.8.0 is not supported" in cls.unavailable_reason(cuda, torch.float16, 128)
    monkeypatch.setattr(fib, "installed_version", lambda: "0.7.2.post1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cls.unavailable_reason(cuda, torch.float16, 128) == "no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cls.unavailable_reason(cuda, torch.float16, 128) is None
    assert "head_dim 80" in cls.unavailable_reason(cuda, torch.float16, 80)
    assert "KV dtype float32" in cls.unavailable_reason(cuda, torch.float32, 128)
    assert "not cpu" in cls.unavailable_reason(torch.device("cpu"), torch.float16, 128)


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.2.2", True),
        ("0.2.8+cu124torch2.4", True),
        ("0.6.18rc1", True),
        ("0.7.2.post1", True),
        ("0.2.1.post2", False),
        ("0.8.0", False),
        ("0.8.0rc1", False),
        ("garbage", False),
    ],
)
def test_version_range(version, ok):
    assert fib.version_supported(version) is ok


# --- a stand-in flashinfer: FlashInfer's documented wrapper semantics in torch -----------------------


def _paged_lengths(indptr, last_page_len, page_size):
    """FlashInfer's paged_kv_t::get_length: 0 for a sequence that owns no page."""
    pages = indptr[1:] - indptr[:-1]
    return torch.where(pages == 0, 0, (pages - 1).clamp(min=0) * page_size + last_page_len)


def _gather(cache, indices, start, stop, length):
    pages = cache[indices[start:stop].long()]  # [p, page, Hkv, D]
    return pages.reshape(-1, *cache.shape[2:])[:length].float()


def _attend(q, k, v, scale, causal):
    lq, lk = q.shape[0], k.shape[0]
    if lk == 0:  # an empty sequence: 0.2-0.6.17 divide 0 by 0 (0.7.2 returns zeros): be the worst
        return torch.full_like(q, float("nan"), dtype=torch.float32)
    mask = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        mask = mask.tril(diagonal=lk - lq)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(0, 1)


def _check_csr(indptr, indices, last_page_len, page_size):
    for t in (indptr, indices, last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert len(indptr) == len(last_page_len) + 1 and int(indptr[-1]) == len(indices)
    assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all())


def _check_planned_dtypes(planned, q, k_cache):
    """As FlashInfer's ``_check_cached_qkv_data_type``: run() refuses a query or cache dtype other than the
    plan's."""
    q_type, kv_type = planned
    if q.dtype != q_type:
        raise ValueError(
            f"The dtype of q {q.dtype} does not match the q_data_type {q_type} specified in plan"
        )
    if k_cache.dtype != kv_type:
        raise ValueError(f"The dtype of k {k_cache.dtype} does not match the kv_data_type {kv_type}")


class FakeDecodeWrapper:
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
    ):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.workspace = float_workspace_buffer
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.plans = []
        if use_cuda_graph:  # as FlashInfer: the three buffers are mandatory and fix the batch size
            assert all(
                torch.is_tensor(b)
                for b in (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            )
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self.fixed_batch_size + 1
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        q_data_type="float16",
        kv_data_type=None,
        sm_scale=None,
    ):
        _check_csr(indptr, indices, last_page_len, page_size)
        if self.use_cuda_graph:
            assert len(last_page_len) == self.fixed_batch_size and len(indices) <= len(self.bufs[1])
            self.bufs[0].copy_(indptr)
            self.bufs[2].copy_(last_page_len)
            self.bufs[1][: len(indices)].copy_(indices)
            csr = self.bufs
        else:
            csr = (indptr.clone(), indices.clone(), last_page_len.clone())
        self.plans.append(
            dict(
                indptr=indptr.tolist(),
                indices=indices.tolist(),
                last=last_page_len.tolist(),
                heads=(num_qo_heads, num_kv_heads, head_dim),
                page_size=page_size,
                q_data_type=q_data_type,
                kv_data_type=kv_data_type,
                sm_scale=sm_scale,
            )
        )
        self.csr, self.page_size = csr, page_size
        self.scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.dtypes = (q_data_type, kv_data_type or q_data_type)

    def run(self, q, paged_kv_cache, out=None):
        k_cache, v_cache = paged_kv_cache
        _check_planned_dtypes(self.dtypes, q, k_cache)
        indptr, indices, last = self.csr
        lens = _paged_lengths(indptr, last, self.page_size)
        assert q.shape[0] == len(lens) and q.is_contiguous()
        o = torch.stack(
            [
                _attend(
                    q[i : i + 1],
                    _gather(k_cache, indices, indptr[i], indptr[i + 1], lens[i]),
                    _gather(v_cache, indices, indptr[i], indptr[i + 1], lens[i]),
                    self.scale,
                    False,
                )[0]
                for i in range(len(lens))
            ]
        ).to(q.dtype)
        if out is None:
            return o
        out.copy_(o)
        return out


class FakePrefillWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD"):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.workspace = float_workspace_buffer
        self.plans = []

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        causal=False,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
    ):
        _check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        assert qo_indptr.dtype == torch.int32 and len(qo_indptr) == len(paged_kv_indptr)
        self.plans.append(
            dict(
                qo_indptr=qo_indptr.tolist(),
                indptr=paged_kv_indptr.tolist(),
                indices=paged_kv_indices.tolist(),
                last=paged_kv_last_page_len.tolist(),
                heads=(num_qo_heads, num_kv_heads, head_dim_qk),
                page_size=page_size,
                causal=causal,
                sm_scale=sm_scale,
                q_data_type=q_data_type,
                kv_data_type=kv_data_type,
            )
        )
        self.state = (
            qo_indptr.clone(),
            paged_kv_indptr.clone(),
            paged_kv_indices.clone(),
            paged_kv_last_page_len.clone(),
            page_size,
            causal,
            head_dim_qk**-0.5 if sm_scale is None else sm_scale,
        )
        self.dtypes = (q_data_type, kv_data_type or q_data_type)

    def run(self, q, paged_kv_cache, out=None):
        k_cache, v_cache = paged_kv_cache
        _check_planned_dtypes(self.dtypes, q, k_cache)
        qo, indptr, indices, last, page_size, causal, scale = self.state
        lens = _paged_lengths(indptr, last, page_size)
        assert q.shape[0] == int(qo[-1]) and q.is_contiguous()
        parts = []
        for i in range(len(lens)):
            k = _gather(k_cache, indices, indptr[i], indptr[i + 1], lens[i])
            v = _gather(v_cache, indices, indptr[i], indptr[i + 1], lens[i])
            parts.append(_attend(q[qo[i] : qo[i + 1]], k, v, scale, causal))
        o = torch.cat(parts).to(q.dtype)
        if out is None:
            return o
        out.copy_(o)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    module.__version__ = "0.7.2.post1"
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


# --- random paged steps, run on both backends --------------------------------------------------------

BLOCK = 4
NUM_BLOCKS = 48


def make_step(
    seqs, *, hq, hkv, d, dtype, device="cpu", block=BLOCK, num_blocks=NUM_BLOCKS, seed=0, pad_tokens=0
):
    """seqs: (cached_before, new) per sequence, in step order (decodes, new == 1, first).

    Returns the layout, query/key/value ``[T_pad, H, D]`` and a cache pair of ``num_blocks + 1`` blocks
    holding random cached prefixes (and garbage elsewhere: nothing may read it).
    """
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks + 1, block, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks + 1, block, hkv, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    query_lens, seq_lens, tables, slots = [], [], [], []
    for before, new in seqs:
        total = before + new
        tables.append([free.pop() for _ in range(-(-total // block))])
        query_lens.append(new)
        seq_lens.append(total)
        slots.extend(tables[-1][p // block] * block + p % block for p in range(before, total))
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes][1] == 1:
        num_decodes += 1
    layout = StepLayout(query_lens, seq_lens, tables, slots, num_decodes)
    t_pad = len(slots) + pad_tokens

    def rand(h):
        return torch.randn(t_pad, h, d, generator=g).to(dtype).to(device)

    return layout, rand(hq), rand(hkv), rand(hkv), (k_cache.to(device), v_cache.to(device))


def run_backend(backend, layout, q, k, v, caches, *, pad_seqs=0, configure=None, scale=None):
    builder = backend.make_builder(16, 64, 8, BLOCK, q.device, num_blocks=caches[0].shape[0] - 1)
    if configure is not None:
        configure(builder)
    t_pad = q.shape[0]
    meta = builder.build(layout, layout.num_seqs + pad_seqs, t_pad)
    caches = (caches[0].clone(), caches[1].clone())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return backend.forward(q, k, v, caches, meta, scale), caches, builder, meta


MIXED = [(5, 1), (12, 1), (0, 1), (0, 9), (6, 3), (4, 4)]  # decodes (one a 1-token prompt), then extends
CASES = {
    "decodes": [(5, 1), (12, 1), (0, 1), (7, 1)],
    "fresh_prompts": [(0, 7), (0, 4)],
    "cached_prefix_chunk": [(9, 6)],
    "mixed": MIXED,
}


def configured(hq, hkv, d, dtype, **kwargs):
    return lambda builder: builder.configure(hq, hkv, d, dtype, **kwargs)


def assert_same_as_torch(
    case,
    *,
    hq=4,
    hkv=2,
    d=8,
    dtype=torch.float32,
    device="cpu",
    pad_seqs=0,
    pad_tokens=0,
    atol=1e-5,
    cuda_graph_batch_sizes=(),
):
    layout, q, k, v, caches = make_step(
        case, hq=hq, hkv=hkv, d=d, dtype=dtype, device=device, pad_tokens=pad_tokens
    )
    ref, ref_caches, _, _ = run_backend(TorchPagedAttention(), layout, q, k, v, caches, pad_seqs=pad_seqs)
    out, out_caches, builder, meta = run_backend(
        FlashInferPagedAttention(),
        layout,
        q,
        k,
        v,
        caches,
        pad_seqs=pad_seqs,
        configure=configured(hq, hkv, d, dtype, cuda_graph_batch_sizes=cuda_graph_batch_sizes),
    )
    t = layout.num_tokens
    torch.testing.assert_close(out[:t].float(), ref[:t].float(), atol=atol, rtol=atol)
    assert torch.isfinite(out).all()
    if meta.num_decode_rows > layout.num_decodes:
        assert not out[layout.num_decodes : meta.num_decode_rows].any()  # padded decode rows are zero
    for mine, theirs in zip(out_caches, ref_caches):
        assert torch.equal(mine[:-1], theirs[:-1])  # the same K/V written; the scratch block aside
    return builder, meta, out


# --- builder and forward on the CPU, with the stand-in ----------------------------------------------


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_forward_matches_torch_backend_with_stand_in(fake_flashinfer, case):
    assert_same_as_torch(CASES[case])


def test_build_plans_each_wrapper_once_with_hand_computed_inputs(fake_flashinfer):
    builder = FlashInferMetadataBuilder(8, 32, 4, 4, "cpu", workspace_bytes=1024)
    builder.configure(8, 2, 64, torch.bfloat16, scale=0.125)
    # two decodes (5 and 4 tokens), then (cached 6 + 3), a fresh 4-token prompt, (cached 3 + 5)
    tables = [[2, 8], [11], [4, 10, 12], [7], [1, 13]]
    slots = [32, 47, 42, 43, 48, 28, 29, 30, 31, 7, 52, 53, 54, 55]  # block * 4 + offset of each new token
    layout = StepLayout([1, 1, 3, 4, 5], [5, 4, 9, 4, 8], tables, slots, num_decodes=2)
    meta = builder.build(layout)
    decode, prefill = meta.decode_wrapper, meta.prefill_wrapper
    assert decode is builder.decode_wrapper and not decode.use_cuda_graph and not decode.use_tensor_cores
    assert decode.plans == [
        dict(
            indptr=[0, 2, 3],
            indices=[2, 8, 11],
            last=[1, 4],
            heads=(8, 2, 64),
            page_size=4,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
            sm_scale=0.125,
        )
    ]
    assert prefill.plans == [
        dict(
            qo_indptr=[0, 3, 7, 12],
            indptr=[0, 3, 4, 6],
            indices=[4, 10, 12, 7, 1, 13],
            last=[1, 4, 4],
            heads=(8, 2, 64),
            page_size=4,
            causal=True,
            sm_scale=0.125,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )
    ]
    assert (meta.num_decode_rows, meta.prefill_start, meta.prefill_end) == (2, 2, 14)
    assert meta.write_slots.tolist() == slots and not meta.zero_fill and not meta.mask_padded_decodes
    # the next step reuses the same wrappers and workspace
    meta2 = builder.build(StepLayout([1], [6], [[2, 8]], [33], num_decodes=1))
    assert meta2.decode_wrapper is decode and meta2.prefill_wrapper is None
    assert decode.plans[-1]["indptr"] == [0, 2] and decode.plans[-1]["last"] == [2]
    assert decode.workspace is prefill.workspace is builder.workspace


def test_cuda_graph_buckets_get_one_fixed_wrapper_each(fake_flashinfer):
    decodes = [(5, 1), (12, 1), (0, 1)]
    builder, meta, _ = assert_same_as_torch(decodes, pad_seqs=1, pad_tokens=1, cuda_graph_batch_sizes=(4, 8))
    wrapper = meta.decode_wrapper
    assert meta.cuda_graph and meta.num_decode_rows == 4 and meta.mask_padded_decodes
    assert (
        wrapper is builder.decode_wrapper_for(4) and wrapper.use_cuda_graph and wrapper.fixed_batch_size == 4
    )
    indptr_buf, indices_buf, last_buf = wrapper.bufs
    assert (len(indptr_buf), len(indices_buf), len(last_buf)) == (5, 4 * 8, 4)
    # the padded sequence repeats indptr's last value and has last_page_len 1
    assert wrapper.plans[-1]["indptr"] == [0, 2, 6, 7, 7] and wrapper.plans[-1]["last"] == [2, 1, 1, 1]
    assert indptr_buf.tolist() == [0, 2, 6, 7, 7]
    # another step of the same bucket replans the same wrapper into the same buffers
    layout = StepLayout([1, 1], [3, 9], [[1], [2, 3, 4]], [6, 4 * 4], num_decodes=2)
    meta2 = builder.build(layout, 4, 4)
    assert meta2.decode_wrapper is wrapper and meta2.write_slots.data_ptr() == meta.write_slots.data_ptr()
    assert indptr_buf.tolist() == [0, 1, 4, 4, 4] and last_buf.tolist() == [3, 1, 1, 1]
    assert meta2.write_slots.tolist() == [6, 16, 48 * 4, 48 * 4]  # padding goes to the scratch block
    # a size that is no bucket, and a mixed step, use the plain decode wrapper
    assert builder.build(layout, 3, 3).decode_wrapper is builder.decode_wrapper
    assert builder.decode_wrapper_for(8) is not wrapper and set(builder._graph_decode_wrappers) == {4, 8}


def test_padded_mixed_step_zero_fills_the_padding(fake_flashinfer):
    _, meta, out = assert_same_as_torch(MIXED, pad_seqs=2, pad_tokens=3)
    assert meta.zero_fill and not meta.cuda_graph and meta.num_decode_rows == 3
    assert not out[-3:].any()


@pytest.mark.parametrize("case", ["decodes", "mixed"])
def test_a_float32_model_over_a_bf16_cache_gets_float32_back(fake_flashinfer, case):
    # FlashInfer runs only queries of the dtype it was planned for (the cache's): the backend converts
    # the model's query to it and the output back, as the torch backend computes a float32 query.
    layout, q, k, v, caches = make_step(CASES[case], hq=4, hkv=2, d=8, dtype=torch.float32)
    caches = tuple(c.to(torch.bfloat16) for c in caches)
    ref, ref_caches, _, _ = run_backend(TorchPagedAttention(), layout, q, k, v, caches)
    out, out_caches, _, _ = run_backend(
        FlashInferPagedAttention(), layout, q, k, v, caches, configure=configured(4, 2, 8, torch.bfloat16)
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)  # the query rounded to bf16 here only
    for mine, theirs in zip(out_caches, ref_caches):
        assert torch.equal(mine[:-1], theirs[:-1])


def test_large_gqa_groups_use_tensor_cores(fake_flashinfer):
    builder, meta, _ = assert_same_as_torch(CASES["decodes"], hq=16, hkv=2)
    assert meta.decode_wrapper.use_tensor_cores and builder.decode_wrapper_for(2).use_tensor_cores


def test_forward_refuses_a_scale_it_was_not_planned_with(fake_flashinfer):
    layout, q, k, v, caches = make_step(CASES["decodes"], hq=4, hkv=2, d=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="planned with softmax scale"):
        run_backend(
            FlashInferPagedAttention(),
            layout,
            q,
            k,
            v,
            caches,
            configure=configured(4, 2, 8, torch.float32),
            scale=0.5,
        )
    out, _, _, _ = run_backend(
        FlashInferPagedAttention(),
        layout,
        q,
        k,
        v,
        caches,
        configure=configured(4, 2, 8, torch.float32, scale=0.5),
        scale=0.5,
    )
    assert out.shape == q.shape


def test_builder_needs_configure_first(fake_flashinfer):
    builder = FlashInferMetadataBuilder(4, 16, 4, 4, "cpu", workspace_bytes=64)
    with pytest.raises(RuntimeError, match="configure"):
        builder.build(StepLayout([1], [1], [[0]], [0], 1))
    with pytest.raises(ValueError, match="multiple"):
        builder.configure(6, 4, 64, torch.float16)
    with pytest.raises(ValueError, match="CUDA-graph batch sizes"):
        builder.configure(4, 2, 64, torch.float16, cuda_graph_batch_sizes=(8,))
    builder.configure(4, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="already configured"):
        builder.configure(4, 2, 128, torch.float16)


def test_workspace_is_one_zeroed_uint8_buffer():
    builder = FlashInferMetadataBuilder(4, 16, 4, 4, "cpu", workspace_bytes=4096)
    assert builder.workspace.dtype == torch.uint8 and builder.workspace.numel() == 4096
    assert not builder.workspace.any()
    assert fib.WORKSPACE_BYTES == 128 * 1024 * 1024


def test_capabilities():
    caps = FlashInferPagedAttention.capabilities
    assert FlashInferPagedAttention.name == "flashinfer"
    assert caps.dtypes == {torch.float16, torch.bfloat16} and caps.head_dims == {64, 128, 256}
    assert caps.devices == {"cuda"} and caps.cuda_graph_decode and caps.decode_query_len == 1
    assert FlashInferPagedAttention().kv_cache_shape(10, 16, 2, 64) == (11, 16, 2, 64)


# --- the real kernels (CUDA + flashinfer-python) ---------------------------------------------------

GPU_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 128), (16, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernels_match_torch_backend(case, hq, hkv, d, dtype):
    assert_same_as_torch(CASES[case], hq=hq, hkv=hkv, d=d, dtype=dtype, device="cuda", atol=GPU_TOL[dtype])


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernels_padded_steps(dtype):
    assert_same_as_torch(
        [(5, 1), (30, 1), (0, 1)],
        hq=8,
        hkv=2,
        d=128,
        dtype=dtype,
        device="cuda",
        pad_seqs=1,
        pad_tokens=1,
        atol=GPU_TOL[dtype],
        cuda_graph_batch_sizes=(4,),
    )
    assert_same_as_torch(
        MIXED, hq=8, hkv=2, d=128, dtype=dtype, device="cuda", pad_seqs=2, pad_tokens=3, atol=GPU_TOL[dtype]
    )


@needs_gpu
def test_decode_cuda_graph_replays_new_steps():
    """Capture one padded decode step of bucket 4, replay it for steps of other lengths and counts."""
    hq, hkv, d, dtype, bucket = 8, 2, 128, torch.float16, 4
    backend, reference = FlashInferPagedAttention(), TorchPagedAttention()
    builder = backend.make_builder(16, 64, 8, BLOCK, torch.device("cuda"), num_blocks=NUM_BLOCKS)
    builder.configure(hq, hkv, d, dtype, cuda_graph_batch_sizes=(bucket,))
    steps = [[(5, 1), (12, 1), (0, 1)], [(20, 1), (3, 1), (9, 1), (1, 1)], [(30, 1)]]
    layout, q, k, v, caches = make_step(
        steps[0], hq=hq, hkv=hkv, d=d, dtype=dtype, device="cuda", pad_tokens=bucket - len(steps[0])
    )
    static_q, static_k, static_v = q.clone(), k.clone(), v.clone()
    live = (caches[0].clone(), caches[1].clone())
    meta = builder.build(layout, bucket, bucket)
    assert meta.cuda_graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph (kernel loading, lazy allocations)
        backend.forward(static_q, static_k, static_v, (live[0].clone(), live[1].clone()), meta, d**-0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, live, meta, d**-0.5)
    for seed, seqs in enumerate(steps, start=1):
        layout, q, k, v, caches = make_step(
            seqs, hq=hq, hkv=hkv, d=d, dtype=dtype, device="cuda", seed=seed, pad_tokens=bucket - len(seqs)
        )
        live[0].copy_(caches[0])
        live[1].copy_(caches[1])
        static_q.copy_(q)
        static_k.copy_(k)
        static_v.copy_(v)
        builder.build(layout, bucket, bucket)  # plans on the host, into the captured buffers
        graph.replay()
        ref, ref_caches, _, _ = run_backend(reference, layout, q, k, v, caches, pad_seqs=bucket - len(seqs))
        n = len(seqs)
        torch.testing.assert_close(static_out[:n].float(), ref[:n].float(), atol=2e-3, rtol=2e-3)
        assert not static_out[n:].any()
        assert torch.equal(live[0][:-1], ref_caches[0][:-1]) and torch.equal(live[1][:-1], ref_caches[1][:-1])
