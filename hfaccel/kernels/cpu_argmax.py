"""``torch.argmax(x, dim=-1)`` of float32 rows on a CPU, as a small C kernel (built like `cpu_decode`).

Why: greedy decoding takes the argmax of every row of a step's logits, and torch's CPU argmax is a
scalar reduction: on SmolLM2's 49,152-token vocabulary it measured 40 us a row (1.2 ms a step at batch
32, 2 threads, AVX-512 EPYC), while the same rows' ``amax`` took 47 us for all 32. Here each row takes
two vector passes over data the LM head has just written (its maximum, then the first index holding
it), rows in parallel on torch's OpenMP threads.

The result is torch's exactly: the first index of the largest value, a NaN counting as larger than
everything (the first NaN wins), -0.0 equal to 0.0. Built without ``-ffinite-math-only`` (NaNs are
tested). Other dtypes, devices and layouts use torch's argmax; so does everything when
``HFACCEL_CPU_DECODE_KERNEL=0``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from hfaccel.kernels.cpu_build import load_kernel

_SOURCE = r"""
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

/* The first index of x[0..n)'s largest value (n >= 1); a NaN is the largest (the first NaN). */
static int64_t argmax_row(const float *x, int64_t n) {
    float m = x[0];
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 top = _mm512_loadu_ps(x);
        __mmask16 unordered = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            top = _mm512_max_ps(top, v); /* a NaN here: caught by `unordered` */
        }
        nan = unordered != 0;
        m = _mm512_reduce_max_ps(top);
    }
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (nan) {
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    }
    i = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0; /* not reached: m is one of the values */
}

/* out[r] = argmax of row r (n floats, rows `stride` floats apart), rows across the threads. Each thread
   compares under the caller's floating-point control word (torch.set_flush_denormal sets it for the
   calling thread only: a denormal counts as zero on every row or on none). */
void hfaccel_argmax(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int num_threads) {
#if defined(__SSE__)
    const unsigned int csr = _mm_getcsr();
#endif
#pragma omp parallel num_threads(rows > 1 ? num_threads : 1)
    {
#if defined(__SSE__)
        const unsigned int own = _mm_getcsr();
        _mm_setcsr(csr);
#endif
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
#if defined(__SSE__)
        _mm_setcsr(own);
#endif
    }
}
"""

# Below this many logits a call runs on one thread (docs/benchmarks.md, "One thread for a small attention
# call").
PARALLEL_MIN_VALUES = 1 << 16

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=gnu99"]
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel's library, built on first use; None where it cannot be built or is off."""
    return load_kernel("argmax", _SOURCE, _FLAGS, "hfaccel_argmax", _ARGTYPES, None)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D ``x``: by the C kernel for CPU float32 rows with unit stride (the
    logits of a step), by torch otherwise. Returns int64 ``[rows]`` on `x`'s device."""
    if (
        type(x) is not torch.Tensor  # a subclass (a DTensor) keeps its values elsewhere than data_ptr()
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[1] == 0
        or x.stride(1) != 1
        or x.requires_grad
        or x.is_neg()  # a lazily negated view: its memory holds the values un-negated
        or (library := load()) is None
    ):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    # One thread for few logits: waking OpenMP's other threads costs more than they save.
    threads = 1 if x.shape[0] * x.shape[1] < PARALLEL_MIN_VALUES else torch.get_num_threads()
    library.hfaccel_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), threads)
    return out


def argmax_index(row: torch.Tensor) -> int:
    """``int(row.argmax())`` of a 1-D ``row``, through `argmax_rows`."""
    return int(argmax_rows(row.unsqueeze(0))[0])
