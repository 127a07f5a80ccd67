"""A small C kernel for paged decode attention on a CPU, compiled at first use.

Why: the torch backend's decode path gathers every sequence's KV blocks into a padded copy per layer
and runs batched SDPA on it. On a CPU that costs more than the attention itself: the copy writes and
rereads every K/V byte, and SDPA's CPU flash kernel runs two tiny GEMMs per (sequence, KV head) with a
fixed cost each. Measured on SmolLM2 at batch 32 (about 140 tokens of context), that path cost about
40% of the step's matmul floor (1 thread, shared machine); this kernel reads each needed K and V row
once, straight from the cache through the block table, with the query heads of a KV head sharing the
read, and needs no mask: a sequence's length bounds its loop (a padded sequence, length 0, gets a zero
row).

It serves a float32 query over a float32 or a bfloat16 KV cache (a float32 model with a bf16 cache: half
the KV bytes a decode step reads, its memory-bandwidth bound at large batch) and a bfloat16 query over a
bfloat16 cache (a bf16 model on a CPU); float16 and other combinations take the torch backend's SDPA
path. All arithmetic is float32 whatever the dtypes: bf16 K/V rows are widened as they are read, and a
bf16 output is rounded from the float32 result. The new K/V rows it stores arrive in the query's dtype
and are rounded to the cache's bf16 (to nearest even) exactly as ``tensor.to(torch.bfloat16)`` rounds
them on a CPU, so the cache holds the same bits as after the torch path's ``index_copy_``. The float32
path is the float32-only kernel's code, arithmetic order included (bit-identical results).

It is plain C99 with OpenMP, built with the system C compiler the first time a process needs it (see
`cpu_build`: cached per source, flags and CPU; torch's OpenMP threads). Where no compiler works the
torch path runs instead; ``HFACCEL_CPU_DECODE_KERNEL=0`` turns the CPU kernels off (this one and
`cpu_argmax`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from hfaccel.kernels.cpu_build import load_kernel

# The C source beside this file (package data; `pyproject.toml`).
_SOURCE = (Path(__file__).parent / "cpu_decode.c").read_text()

# The scores are finite (no masks: lengths bound the loops), so the vectoriser may assume finite math
# (a clamp and a max need it); nothing is reassociated (no -ffast-math). The bf16 rounding is integer
# arithmetic, so its NaN test survives -ffinite-math-only.
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-trapping-math",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-std=gnu99",
]
# The element type codes of the C source (F32, BF16), and the (query, KV cache) dtypes it serves.
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_SERVED = frozenset(
    {
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.int8),  # an int8 cache (`kv_quant`): rows dequantized as they are read
        (torch.bfloat16, torch.int8),
    }
)
_ARGTYPES = [
    ctypes.c_int,  # query (and key, value, out) dtype code
    ctypes.c_int,  # KV cache dtype code
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q row stride
    ctypes.c_int64,  # q head stride
    ctypes.c_void_p,  # key (this step's rows; NULL: nothing to store)
    ctypes.c_void_p,  # value
    ctypes.c_int64,  # key/value row stride
    ctypes.c_int64,  # key/value head stride
    ctypes.c_void_p,  # slots (int64; NULL: nothing to store)
    ctypes.c_void_p,  # k_cache
    ctypes.c_void_p,  # v_cache
    ctypes.c_void_p,  # tables
    ctypes.c_int64,  # width
    ctypes.c_void_p,  # lens
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # B
    ctypes.c_int64,  # Hq
    ctypes.c_int64,  # Hkv
    ctypes.c_int64,  # D
    ctypes.c_int64,  # W (a cache row's elements)
    ctypes.c_int64,  # block_size
    ctypes.c_float,  # scale
    ctypes.c_int64,  # max_len
    ctypes.c_int64,  # window (0: none)
    ctypes.c_int64,  # chunk (0: none)
    ctypes.c_float,  # softcap (0: none)
    ctypes.c_void_p,  # sinks (float32 [Hq]; NULL: none)
    ctypes.c_int,  # num_threads
]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel's library, built on first use; None where it cannot be built or is off."""
    return load_kernel("paged_decode", _SOURCE, _FLAGS, "hfaccel_paged_decode", _ARGTYPES, ctypes.c_int)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel serves this layer's decode rows: on a CPU, a float32 query over a float32 or
    bfloat16 cache or a bfloat16 query over a bfloat16 cache, contiguous query and cache (the kernel
    writes a contiguous output, the layout the attention op's fake implementation promises for such a
    query)."""
    return (
        type(query) is torch.Tensor  # not a subclass (a DTensor): the kernel reads data_ptr() directly
        and type(k_cache) is torch.Tensor
        and query.device.type == "cpu"
        and (query.dtype, k_cache.dtype) in _SERVED
        and query.is_contiguous()
        and query.shape[1] // k_cache.shape[2] * query.shape[2] <= 4096  # the kernel's MAX_ACC
        and k_cache.is_contiguous()
        and load() is not None
    )


class DecodeCall:
    """One step's decode rows, bound once: the block tables, lengths and slots are the same for every
    layer, so a layer's call only adds its query, new K/V, caches and output (each layer's Python work is
    a few pointer reads; 30 layers a step)."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        slots: torch.Tensor | None = None,
    ) -> None:
        # The C side reads int32 tables and lengths and int64 slots, rows of the table `stride(0)` apart.
        tables = block_tables.to(torch.int32)
        self._tables = tables if tables.stride(1) == 1 else tables.contiguous()
        self._lens = seq_lens.to(torch.int32).contiguous()
        self._slots = None if slots is None else slots.to(torch.int64).contiguous()
        self._max_len = max(max_seq_len, 1)
        # What every layer's call passes alike, read once (the tensors above keep the addresses valid).
        self._tables_at = (self._tables.data_ptr(), self._tables.stride(0))
        self._lens_at = self._lens.data_ptr()
        self._slots_at = None if self._slots is None else self._slots.data_ptr()
        self._function = load().hfaccel_paged_decode
        self._checked = False  # the first call's tensors were checked (`_check_call`)
        self._thread_key: tuple[int, ...] | None = None  # `_threads_for`
        self._threads = 1

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``query`` ``[B, Hq, D]`` (head rows contiguous) into ``out`` (a contiguous
        ``[B, Hq, D]`` in the query's dtype), first storing ``key``/``value`` ``[B, Hkv, D]`` at the
        bound slots when given (the kernel rounds them to a bf16 cache itself). `window` > 0: each
        sequence attends to its last `window` positions only; `chunk` > 0: to its last token's chunk;
        `softcap` > 0: scores soft-capped; `sinks` ``[Hq]``: attention-sink logits."""
        store = key is not None and self._slots is not None
        if not self._checked:  # every layer of a step has the same shapes and dtypes: check the first
            _check_call(query, k_cache, v_cache, out, key if store else None, value if store else None)
            self._checked = True
        local = (window, chunk, softcap, sinks)
        if not store:
            return self._launch(
                query, query.stride()[:2], None, None, (0, 0), k_cache, v_cache, out, scale, *local
            )
        key, value = _rows_like(query, key, value)
        return self._launch(
            query, query.stride()[:2], key, value, key.stride()[:2], k_cache, v_cache, out, scale, *local
        )

    def heads_first(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the call that stores the step's K/V, over transformers' head-first layout: ``query``
        ``[1, Hq, B, D]``, ``key``/``value`` ``[1, Hkv, B, D]``, with contiguous head rows and any other
        strides (the kernel reads them: no transposed views to make, 30 layers a step) -> a new
        contiguous ``[1, B, Hq, D]``, the layout transformers' attention functions return."""
        _, num_heads, batch, head_dim = query.shape
        out = query.new_empty((1, batch, num_heads, head_dim))
        if not self._checked:
            _check_call(
                query[0].transpose(0, 1),
                k_cache,
                v_cache,
                out[0],
                key[0].transpose(0, 1),
                value[0].transpose(0, 1),
            )
            if self._slots is None:
                raise ValueError("heads_first stores the step's K/V: bind the slots")
            self._checked = True
        key, value = _rows_like(query, key, value)
        q_strides, kv_strides = (query.stride(2), query.stride(1)), (key.stride(2), key.stride(1))
        local = (window, chunk, softcap, sinks)
        return self._launch(query, q_strides, key, value, kv_strides, k_cache, v_cache, out, scale, *local)

    def _launch(
        self,
        query: torch.Tensor,
        q_strides: tuple[int, int],
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_strides: tuple[int, int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int,
        chunk: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """The C call into contiguous `out` (``[..., rows, query heads, head dim]``); `q_strides` and
        `kv_strides`: (row, head) strides in elements; `key` None: nothing to store."""
        batch, num_heads, head_dim = out.shape[-3:]
        store = key is not None
        status = self._function(
            _DTYPE_CODES.get(query.dtype, -1),  # -1: not served, the kernel returns -2
            _DTYPE_CODES.get(k_cache.dtype, -1),
            query.data_ptr(),
            *q_strides,
            key.data_ptr() if store else None,
            value.data_ptr() if store else None,
            *kv_strides,
            self._slots_at if store else None,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            *self._tables_at,
            self._lens_at,
            out.data_ptr(),
            batch,
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[3],
            k_cache.shape[1],
            scale,
            self._max_len,
            window,
            chunk,
            softcap,
            None if sinks is None else self._sinks(sinks),
            self._threads_for(batch, k_cache.shape[2], num_heads, head_dim),
        )
        if status == -2:
            raise ValueError(f"no kernel for a {query.dtype} query over a {k_cache.dtype} cache")
        if status == -3:
            raise ValueError(
                f"a {k_cache.dtype} cache's rows of {k_cache.shape[3]} do not hold head_dim {head_dim}"
            )
        if status != 0:
            raise ValueError(
                f"{num_heads // k_cache.shape[2]} query heads per KV head of dim {head_dim} is too large"
            )
        return out

    def _threads_for(self, batch: int, kv_heads: int, heads: int, head_dim: int) -> int:
        """`decode_threads` of this step's calls, worked out once (every layer of a step asks alike)."""
        key = (batch, kv_heads, heads, head_dim, torch.get_num_threads())
        if key != self._thread_key:
            self._thread_key = key
            self._threads = decode_threads(batch * kv_heads, batch * self._max_len * heads * head_dim)
        return self._threads

    def _sinks(self, sinks: torch.Tensor) -> int:
        """The address of `sinks` as contiguous float32, kept alive for the call (and the step)."""
        if sinks.dtype != torch.float32 or not sinks.is_contiguous():
            sinks = sinks.detach().float().contiguous()
        self._keep = sinks
        return sinks.data_ptr()


def _rows_like(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`key` and `value` as the kernel reads the new rows: in the query's dtype, with contiguous head rows
    and the same strides."""
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
    if value.dtype != query.dtype:
        value = value.to(query.dtype)
    if key.stride(-1) != 1 or key.stride() != value.stride():
        key, value = key.contiguous(), value.contiguous()
    return key, value


# Below this much work (query rows x context x head dim) a call runs on one thread: two only tie there
# while the pool is awake, and where other processes share the cores its sleeping thread took 46 us to
# wake (docs/benchmarks.md, "One thread for a small attention call").
PARALLEL_MIN_WORK = 1 << 14


def decode_threads(tasks: int, work: int) -> int:
    """The threads a kernel call runs on: torch's, but one for a call of less than `PARALLEL_MIN_WORK`
    and never more than its `tasks` (one per sequence and KV head: a thread beyond them only waits)."""
    if work < PARALLEL_MIN_WORK:
        return 1
    return max(1, min(torch.get_num_threads(), tasks))


def _check_call(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the kernel can read these tensors as it assumes (the C side gets raw
    pointers and strides, so a wrong layout would be read wrongly, not refused)."""
    batch, _, head_dim = query.shape
    if query.stride(2) != 1:
        raise ValueError("query must have contiguous head rows (stride 1 in its last dimension)")
    if not (out.is_contiguous() and out.shape == query.shape and out.dtype == query.dtype):
        raise ValueError(f"out must be a contiguous {tuple(query.shape)} {query.dtype} tensor")
    if not (v_cache.dtype == k_cache.dtype and v_cache.shape == k_cache.shape and v_cache.is_contiguous()):
        raise ValueError("v_cache must be a contiguous tensor of k_cache's shape and dtype")
    if key is not None:
        rows = (batch, k_cache.shape[2], head_dim)
        if key.shape != rows or value is None or value.shape != rows:
            raise ValueError(f"key and value must both be {rows} tensors")


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``query`` ``[B, Hq, D]`` attends to the first ``seq_lens[b]``
    tokens of sequence ``b``'s blocks (``block_tables`` int32 ``[B, width]``, rows may be strided; the
    last `window` of them only, where > 0); writes ``out`` (a contiguous ``[B, Hq, D]`` in the query's
    dtype; zero rows where ``seq_lens`` is 0) and returns it."""
    call = DecodeCall(block_tables, seq_lens, max_seq_len)
    return call(query, k_cache, v_cache, scale, out, None, None, window, chunk, softcap, sinks)
