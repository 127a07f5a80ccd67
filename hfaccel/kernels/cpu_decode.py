"""A small C kernel for float32 paged decode attention on a CPU, compiled at first use.

Why: the torch backend's decode path gathers every sequence's KV blocks into a padded copy per layer
and runs batched SDPA on it. On a CPU that costs more than the attention itself: the copy writes and
rereads every K/V byte, and SDPA's CPU flash kernel runs two tiny GEMMs per (sequence, KV head) with a
fixed cost each. Measured on SmolLM2 at batch 32 (about 140 tokens of context), that path cost about
40% of the step's matmul floor (1 thread, shared machine); this kernel reads each needed K and V row
once, straight from the cache through the block table, with the query heads of a KV head sharing the
read, and needs no mask: a sequence's length bounds its loop (a padded sequence, length 0, gets a zero
row).

It is plain C99 with OpenMP, built with the system C compiler (``$CC``, else ``cc``) the first time a
process needs it, into a per-user cache directory keyed by the source, the flags and the CPU (the
build uses ``-march=native``). The shared object links ``libgomp.so.1``, which resolves to the OpenMP
runtime torch already loaded, so the kernel uses torch's thread pool size and threads. Where no
compiler works the torch path runs instead (a debug line says why); ``HFACCEL_CPU_DECODE_KERNEL=0``
turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ACC 4096 /* rep * D floats of output accumulators per task, on the stack */

/* 16 independent lanes: vectorised without letting the compiler reassociate a float sum. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    const int64_t full = n - n % 16;
    int64_t i = 0;
    for (; i < full; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    /* A fixed pairwise tree over the lanes: a few vector adds instead of 16 dependent scalar ones. */
    for (int l = 0; l < 8; l++) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; l++) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; l++) acc[l] += acc[l + 2];
    float s = acc[0] + acc[1];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* row[s] = exp(row[s] - m) for row[s] <= m: Cephes' expf polynomial (about 1 ulp) as plain arithmetic in
   two loops that vectorise (glibc's vector expf needs -ffast-math; inlined, gcc 12 leaves it scalar);
   work: int32 scratch of len. */
__attribute__((noinline)) static void exp_shifted(float *restrict row, int32_t *restrict work, int64_t len, float m) {
    for (int64_t s = 0; s < len; s++) {
        const float x = fmaxf(row[s] - m, -87.0f);
        const int32_t n = (int32_t)(x * 1.44269504088896341f - 0.5f); /* round to nearest, x <= 0 */
        const float fn = (float)n;
        const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        row[s] = p * r * r + r + 1.0f;
        work[s] = (n + 127) << 23; /* the bits of 2^n */
    }
    for (int64_t s = 0; s < len; s++) {
        float scale;
        memcpy(&scale, &work[s], sizeof scale);
        row[s] *= scale;
    }
}

/* One (sequence, KV head): the rep query heads sharing the KV head attend to the sequence's first len
   tokens. Inlined with constant D and rep for the common shapes, so the loops unroll and the output
   accumulators stay in registers. */
static inline __attribute__((always_inline)) void decode_task(
    const float *restrict qb, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int64_t len, float *restrict ob, float *restrict scores,
    int32_t *restrict work, const int64_t D, const int64_t rep, int64_t row, int64_t h, int64_t block_size,
    float scale, int64_t max_len) {
    /* Scores: each K row is read once for the rep query heads sharing it; blocks are walked in order. */
    for (int64_t start = 0, n = 0; start < len; start += block_size, n++) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const float *k = k_cache + (int64_t)table[n] * block_size * row + h * D;
        for (int64_t t = 0; t < count; t++, k += row)
            for (int64_t r = 0; r < rep; r++) scores[r * max_len + start + t] = dot(qb + r * D, k, D) * scale;
    }
    for (int64_t r = 0; r < rep; r++) {
        float *sr = scores + r * max_len;
        float m = sr[0];
        for (int64_t s = 1; s < len; s++) m = sr[s] > m ? sr[s] : m;
        exp_shifted(sr, work, len, m);
        float lanes[16] = {0};
        int64_t s = 0;
        for (; s + 16 <= len; s += 16)
            for (int l = 0; l < 16; l++) lanes[l] += sr[s + l];
        float total = 0.0f;
        for (int l = 0; l < 16; l++) total += lanes[l];
        for (; s < len; s++) total += sr[s];
        const float inv = 1.0f / total;
        for (s = 0; s < len; s++) sr[s] *= inv;
    }
    float acc[MAX_ACC];
    for (int64_t i = 0; i < rep * D; i++) acc[i] = 0.0f;
    for (int64_t start = 0, n = 0; start < len; start += block_size, n++) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const float *v = v_cache + (int64_t)table[n] * block_size * row + h * D;
        for (int64_t t = 0; t < count; t++, v += row)
            for (int64_t r = 0; r < rep; r++) {
                const float p = scores[r * max_len + start + t];
                for (int64_t d = 0; d < D; d++) acc[r * D + d] += p * v[d];
            }
    }
    for (int64_t i = 0; i < rep * D; i++) ob[i] = acc[i];
}

/* q: [B, Hq, D] with row stride q_st and head stride q_sh (D contiguous); key, value: this step's
   [B, Hkv, D] rows the same way (kv_st, kv_sh), stored at slots[b] first (a negative slot: padding, not
   stored); out: a contiguous [B, Hq, D]; k_cache, v_cache: [blocks, block_size, Hkv, D]; tables: int32
   [B, *], rows `width` apart; lens: int32 [B], the context length of each sequence with this step's
   token (0: padding). A task is one (sequence, KV head): it stores that head's new K/V row and then
   reads the head's rows, so no task reads what another writes. Returns 0, or -1 (nothing done) when
   rep * D exceeds MAX_ACC. */
int hfaccel_paged_decode_f32(const float *q, int64_t q_st, int64_t q_sh, const float *key, const float *value,
                             int64_t kv_st, int64_t kv_sh, const int64_t *slots, float *k_cache, float *v_cache,
                             const int32_t *tables, int64_t width, const int32_t *lens, float *out, int64_t B,
                             int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                             int64_t max_len, int num_threads) {
    const int64_t rep = Hq / Hkv;
    const int64_t row = Hkv * D;
    if (rep * D > MAX_ACC) return -1;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(rep * max_len));
        int32_t *work = (int32_t *)malloc(sizeof(int32_t) * (size_t)max_len);
        float *qbuf = (float *)malloc(sizeof(float) * (size_t)(rep * D));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * Hkv; task++) {
            const int64_t b = task / Hkv, h = task % Hkv;
            const int64_t len = lens[b];
            float *ob = out + (b * Hq + h * rep) * D;
            if (len <= 0) {
                memset(ob, 0, sizeof(float) * (size_t)(rep * D));
                continue;
            }
            if (slots != NULL && slots[b] >= 0) {
                const int64_t at = slots[b] * row + h * D;
                memcpy(k_cache + at, key + b * kv_st + h * kv_sh, sizeof(float) * (size_t)D);
                memcpy(v_cache + at, value + b * kv_st + h * kv_sh, sizeof(float) * (size_t)D);
            }
            for (int64_t r = 0; r < rep; r++)  /* the rep query rows of this KV head, contiguous */
                memcpy(qbuf + r * D, q + b * q_st + (h * rep + r) * q_sh, sizeof(float) * (size_t)D);
            const float *qb = qbuf;
        const int32_t *table = tables + b * width;
#define TASK(DD, RR) decode_task(qb, k_cache, v_cache, table, len, ob, scores, work, DD, RR, row, h, \
                                 block_size, scale, max_len)
            if (D == 64 && rep == 3) TASK(64, 3);
            else if (D == 64 && rep == 4) TASK(64, 4);
            else if (D == 128 && rep == 4) TASK(128, 4);
            else if (D == 64) TASK(64, rep);
            else if (D == 128) TASK(128, rep);
            else TASK(D, rep);
#undef TASK
        }
        free(scores);
        free(work);
        free(qbuf);
    }
    return 0;
}
"""

# The scores are finite (no masks: lengths bound the loops), so the vectoriser may assume finite math
# (a clamp and a max need it); nothing is reassociated (no -ffast-math).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-trapping-math",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-shared",
    "-fPIC",
    "-std=gnu99",
]
_ARGTYPES = [
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
    ctypes.c_int64,  # block_size
    ctypes.c_float,  # scale
    ctypes.c_int64,  # max_len
    ctypes.c_int,  # num_threads
]


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "".join(lines)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel's library, built on first use; None where it cannot be built or is off."""
    if os.environ.get("HFACCEL_CPU_DECODE_KERNEL", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.debug("no C compiler found: the torch backend's decode path stays on SDPA")
        return None
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, _cpu_key()]).encode()).hexdigest()[:16]
    user = os.getuid() if hasattr(os, "getuid") else "user"
    folder = os.path.join(tempfile.gettempdir(), f"hfaccel-kernels-{user}")
    path = os.path.join(folder, f"paged_decode_{key}.so")
    try:
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as work:
                source = os.path.join(work, "paged_decode.c")
                with open(source, "w") as f:
                    f.write(_SOURCE)
                built = os.path.join(work, "paged_decode.so")
                subprocess.run(
                    [compiler, *_FLAGS, "-o", built, source, "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, path)  # atomic: a concurrent process loads a whole file or builds its own
        library = ctypes.CDLL(path)
        function = library.hfaccel_paged_decode_f32
        function.argtypes = _ARGTYPES
        function.restype = ctypes.c_int
        return library
    except (OSError, subprocess.SubprocessError) as error:
        logger.debug("the CPU decode kernel could not be built (%s): the decode path stays on SDPA", error)
        return None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel serves this layer's decode rows (float32 on a CPU, contiguous query and cache:
    the kernel writes a contiguous output, the layout the attention op's fake implementation promises
    for such a query)."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and query.is_contiguous()
        and query.shape[1] // k_cache.shape[2] * query.shape[2] <= 4096  # the kernel's MAX_ACC
        and k_cache.dtype == torch.float32
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
        self._tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
        self._lens = seq_lens.contiguous()
        self._slots = None if slots is None else slots.contiguous()
        self._max_len = max(max_seq_len, 1)
        self._function = load().hfaccel_paged_decode_f32

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``query`` ``[B, Hq, D]`` (head rows contiguous) into ``out`` (a contiguous
        ``[B, Hq, D]``), first storing ``key``/``value`` ``[B, Hkv, D]`` at the bound slots when given."""
        batch, num_heads, head_dim = query.shape
        if not (out.is_contiguous() and out.shape == query.shape):
            raise ValueError(f"out must be a contiguous {tuple(query.shape)} tensor")
        store = key is not None and self._slots is not None
        if store:
            if key.stride(-1) != 1 or key.stride() != value.stride():
                key, value = key.contiguous(), value.contiguous()
            if key.dtype != k_cache.dtype:
                key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
        status = self._function(
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            key.data_ptr() if store else None,
            value.data_ptr() if store else None,
            key.stride(0) if store else 0,
            key.stride(1) if store else 0,
            self._slots.data_ptr() if store else None,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            self._tables.data_ptr(),
            self._tables.stride(0),
            self._lens.data_ptr(),
            out.data_ptr(),
            batch,
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            scale,
            self._max_len,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(
                f"{num_heads // k_cache.shape[2]} query heads per KV head of dim {head_dim} is too large"
            )
        return out


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """One query token per sequence: ``query`` ``[B, Hq, D]`` attends to the first ``seq_lens[b]``
    tokens of sequence ``b``'s blocks (``block_tables`` int32 ``[B, width]``, rows may be strided);
    writes ``out`` (a contiguous ``[B, Hq, D]``; zero rows where ``seq_lens`` is 0) and returns it."""
    return DecodeCall(block_tables, seq_lens, max_seq_len)(query, k_cache, v_cache, scale, out)
