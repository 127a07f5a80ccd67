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

import torch

from hfaccel.kernels.cpu_build import load_kernel

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define MAX_ACC 4096 /* rep * D floats of output accumulators per task, on the stack */

/* Element types (the codes the Python side passes). Every function taking a type is inlined with a
   constant one, so each served combination compiles to straight code of its own: float32 loads and
   copies exactly as a float32-only kernel would, bfloat16 a shift on load and a rounding on store. */
enum { F32 = 0, BF16 = 1 };
#define INLINE static inline __attribute__((always_inline))
#define ESIZE(t) ((t) == BF16 ? 2 : 4)
#define AT(p, i, t) ((char *)(p) + (int64_t)(i) * ESIZE(t)) /* &p[i] in elements of type t */

INLINE float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The bits of a float to bfloat16, rounding to nearest even as torch's CPU conversion does (a NaN
   becomes 0xffff, what its vectorised conversion writes). Integer arithmetic only, so
   -ffinite-math-only cannot fold the NaN test away. */
INLINE uint16_t bits_to_bf16(uint32_t u) {
    return (u & 0x7fffffffu) > 0x7f800000u ? 0xffffu : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float load(const void *p, int64_t i, const int t) {
    return t == BF16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store(void *p, int64_t i, float x, const int t) {
    if (t == BF16) {
        uint32_t u;
        memcpy(&u, &x, sizeof u);
        ((uint16_t *)p)[i] = bits_to_bf16(u);
    } else {
        ((float *)p)[i] = x;
    }
}

/* n elements of type st at src to type dt at dst: a copy, or a conversion. */
INLINE void copy_row(void *restrict dst, const int dt, const void *restrict src, const int st, int64_t n) {
    if (dt == st)
        memcpy(dst, src, (size_t)(n * ESIZE(dt)));
    else
        for (int64_t i = 0; i < n; i++) store(dst, i, load(src, i, st), dt);
}

/* A row of n elements of type t as floats: the row itself for float32, else widened into buf. */
INLINE const float *widen(float *restrict buf, const void *row, int64_t n, const int t) {
    if (t == F32) return (const float *)row;
    copy_row(buf, F32, row, t, n);
    return buf;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define MAX_REP16 8 /* query heads per KV head the AVX-512 scoring serves (its partial sums: on the stack) */

/* The 16-lane partial products of a and b summed over n (a multiple of 16): one vector per token. */
INLINE __m512 dot16(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return acc;
}

/* Lane i of the result: the sum of v[i]'s 16 lanes. One transposing reduction of 16 vectors (about 45
   shuffles and adds) instead of 16 horizontal sums: a token's score costs a few instructions, not a
   dozen. Adjacent pairs within 128-bit lanes, then quads, then the four 128-bit lanes. */
INLINE __m512 hsum16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d01, d23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of `count` (<= 16) pending tokens from `first` on, for each of rep heads: part holds 16
   partial-product vectors per head (the unused ones are zeroed here). */
INLINE void flush16(__m512 *part, float *scores, int64_t max_len, int64_t first, int64_t count, int64_t rep,
                    float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rep; r++) {
        for (int64_t i = count; i < 16; i++) part[r * 16 + i] = _mm512_setzero_ps();
        _mm512_mask_storeu_ps(scores + r * max_len + first, (__mmask16)((1u << count) - 1u),
                              _mm512_mul_ps(hsum16(part + r * 16), s));
    }
}
#endif

/* Ask for the n bytes at p ahead of their use: one prefetch per 64-byte cache line, into the L2 cache
   (locality 2: x86's prefetcht1), not L1. Measured on an AVX-512 EPYC with the cache coming from memory,
   the L2 hint made the decode 8-11% faster than L1's at batch 1, 8 and 32, and the hot case no slower:
   the lines a block needs fit in L2 easily, and L1's hint holds the core's few L1 miss buffers. */
INLINE void prefetch(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
}

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

/* One (sequence, KV head): the rep query heads sharing the KV head (qb: their rows in float) attend to
   the sequence's first len tokens; ob gets their rows in type ot, the caches are of type ct. Inlined
   with constant D and rep for the common shapes, so the loops unroll and the output accumulators stay
   in registers. All arithmetic is float32, the cache's rows widened as they are read. */
INLINE void decode_task(
    const float *restrict qb, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict table, int64_t len, int64_t first, void *restrict ob, float *restrict scores,
    int32_t *restrict work, const int64_t D, const int64_t rep, int64_t row, int64_t h, int64_t block_size,
    float scale, int64_t max_len, const int ot, const int ct, float softcap, const float *restrict sinks) {
    /* Positions [first, len) are visible (first > 0: a sliding window or chunk); scores are indexed by
       position. softcap > 0: scores become softcap * tanh(score / softcap) (Gemma 2); sinks (NULL: none):
       the rep heads' attention-sink logits, one more term of each softmax's denominator (gpt-oss). */
    /* A bf16 K or V row widened to float once for the rep query heads that read it (measured faster
       than widening inside each head's dot and axpy). */
    float rowbuf[MAX_ACC];
    /* Scores: each K row is read once for the rep query heads sharing it; blocks are walked in order.
       The cache comes from memory (a step streams the weights between two reads of a layer), and the
       loads would otherwise wait on each block in turn, so while a block's K rows are scored the same
       rows of the next block's K are prefetched (while the last block's are, V's first block), and
       while a block's V rows are summed, the next block's V; for a bf16 cache this block's V rows are
       also asked for during its scoring. Measured on an AVX-512 EPYC, 30 layers' caches cold, batch 1
       / 8 / 32: next-K alone made float32 1.1x faster than no prefetch; V's next block and the L2 hint
       together 1.2-1.35x faster again (a bf16 cache 1.2-1.45x). */
    const int64_t num_blocks = (len + block_size - 1) / block_size, bytes = D * ESIZE(ct);
#if defined(__AVX512F__)
    /* AVX-512: each token's per-head partial products are kept and reduced 16 tokens at a time. */
    __m512 part[MAX_REP16 * 16];
    const int wide = D % 16 == 0 && rep <= MAX_REP16;
    int64_t pending = 0;
#endif
    const int64_t first_block = first / block_size;
    for (int64_t n = first_block, start = n * block_size; start < len; start += block_size, n++) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t t0 = start < first ? first - start : 0;
        const int64_t base = (int64_t)table[n] * block_size * row + h * D + t0 * row;
        const char *k = AT(k_cache, base, ct), *v = AT(v_cache, base, ct);
        const char *k_next =
            n + 1 < num_blocks ? AT(k_cache, (int64_t)table[n + 1] * block_size * row + h * D, ct) : NULL;
        for (int64_t t = t0; t < count; t++, k = AT(k, row, ct), v = AT(v, row, ct)) {
            if (k_next != NULL) prefetch(AT(k_next, t * row, ct), bytes);
            else
                prefetch(AT(v_cache, (int64_t)table[first_block] * block_size * row + h * D + t * row, ct),
                         bytes);
            if (ct == BF16) prefetch(v, bytes);
            const float *kf = widen(rowbuf, k, D, ct);
#if defined(__AVX512F__)
            if (wide) {
                for (int64_t r = 0; r < rep; r++) part[r * 16 + pending] = dot16(qb + r * D, kf, D);
                if (++pending == 16) {
                    flush16(part, scores, max_len, start + t - 15, 16, rep, scale);
                    pending = 0;
                }
                continue;
            }
#endif
            for (int64_t r = 0; r < rep; r++) scores[r * max_len + start + t] = dot(qb + r * D, kf, D) * scale;
        }
    }
#if defined(__AVX512F__)
    if (wide && pending > 0) flush16(part, scores, max_len, len - pending, pending, rep, scale);
#endif
    const int64_t seen = len - first; /* the visible positions' count */
    for (int64_t r = 0; r < rep; r++) {
        float *sr = scores + r * max_len + first;
        if (softcap > 0.0f)
            for (int64_t s = 0; s < seen; s++) sr[s] = softcap * tanhf(sr[s] / softcap);
        float m = sr[0];
        for (int64_t s = 1; s < seen; s++) m = sr[s] > m ? sr[s] : m;
        if (sinks != NULL && sinks[r] > m) m = sinks[r];
        exp_shifted(sr, work, seen, m);
        float lanes[16] = {0};
        int64_t s = 0;
        for (; s + 16 <= seen; s += 16)
            for (int l = 0; l < 16; l++) lanes[l] += sr[s + l];
        float total = sinks != NULL ? expf(sinks[r] - m) : 0.0f;
        for (int l = 0; l < 16; l++) total += lanes[l];
        for (; s < seen; s++) total += sr[s];
        const float inv = 1.0f / total;
        for (s = 0; s < seen; s++) sr[s] *= inv;
    }
    float acc[MAX_ACC];
    for (int64_t i = 0; i < rep * D; i++) acc[i] = 0.0f;
    for (int64_t n = first_block, start = n * block_size; start < len; start += block_size, n++) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t t0 = start < first ? first - start : 0;
        const char *v = AT(v_cache, (int64_t)table[n] * block_size * row + h * D + t0 * row, ct);
        const char *v_next =
            n + 1 < num_blocks ? AT(v_cache, (int64_t)table[n + 1] * block_size * row + h * D, ct) : NULL;
        for (int64_t t = t0; t < count; t++, v = AT(v, row, ct)) {
            if (v_next != NULL) prefetch(AT(v_next, t * row, ct), bytes);
            const float *vf = widen(rowbuf, v, D, ct);
            for (int64_t r = 0; r < rep; r++) {
                const float p = scores[r * max_len + start + t];
                for (int64_t d = 0; d < D; d++) acc[r * D + d] += p * vf[d];
            }
        }
    }
    for (int64_t i = 0; i < rep * D; i++) store(ob, i, acc[i], ot);
}

/* The kernel's arguments (see hfaccel_paged_decode), shared by its tasks. */
struct step {
    const void *q, *key, *value; /* of the query's type */
    int64_t q_st, q_sh, kv_st, kv_sh;
    const int64_t *slots;
    void *k_cache, *v_cache; /* of the cache's type */
    const int32_t *tables, *lens;
    int64_t width;
    void *out; /* of the query's type */
    int64_t Hq, Hkv, D, block_size, max_len, window, chunk;
    float scale, softcap;
    const float *sinks; /* [Hq] float32, or NULL */
};

/* Task (b, h) with query type qt and cache type ct: store sequence b's new K/V row of KV head h, then
   attend with the head's query rows. scores, work, qbuf: the thread's scratch. */
INLINE void run_task(const struct step *s, int64_t b, int64_t h, float *restrict scores,
                     int32_t *restrict work, float *restrict qbuf, const int qt, const int ct) {
    const int64_t D = s->D, rep = s->Hq / s->Hkv, row = s->Hkv * D, len = s->lens[b];
    int64_t first = s->window > 0 && len > s->window ? len - s->window : 0; /* sliding window */
    if (s->chunk > 0 && len > 0 && (len - 1) / s->chunk * s->chunk > first) /* chunked attention */
        first = (len - 1) / s->chunk * s->chunk;
    char *ob = AT(s->out, (b * s->Hq + h * rep) * D, qt);
    if (len <= 0) {
        memset(ob, 0, (size_t)(rep * D * ESIZE(qt)));
        return;
    }
    if (s->slots != NULL && s->slots[b] >= 0) { /* the new rows arrive in qt: stored converted to ct */
        const int64_t at = s->slots[b] * row + h * D, from = b * s->kv_st + h * s->kv_sh;
        copy_row(AT(s->k_cache, at, ct), ct, AT(s->key, from, qt), qt, D);
        copy_row(AT(s->v_cache, at, ct), ct, AT(s->value, from, qt), qt, D);
    }
    for (int64_t r = 0; r < rep; r++) /* the rep query rows of this KV head, contiguous, in float */
        copy_row(qbuf + r * D, F32, AT(s->q, b * s->q_st + (h * rep + r) * s->q_sh, qt), qt, D);
    const float *qb = qbuf;
    const int32_t *table = s->tables + b * s->width;
    const float *sinks = s->sinks != NULL ? s->sinks + h * rep : NULL;
#define TASK(DD, RR) decode_task(qb, s->k_cache, s->v_cache, table, len, first, ob, scores, work, DD, RR, row, h, \
                                 s->block_size, s->scale, s->max_len, qt, ct, s->softcap, sinks)
    if (D == 64 && rep == 3) TASK(64, 3);
    else if (D == 64 && rep == 4) TASK(64, 4);
    else if (D == 128 && rep == 4) TASK(128, 4);
    else if (D == 64) TASK(64, rep);
    else if (D == 128) TASK(128, rep);
    else TASK(D, rep);
#undef TASK
}

/* q: [B, Hq, D] with row stride q_st and head stride q_sh (D contiguous); key, value: this step's
   [B, Hkv, D] rows the same way (kv_st, kv_sh), stored at slots[b] first (a negative slot: padding, not
   stored); out: a contiguous [B, Hq, D]; all four of type q_dtype. k_cache, v_cache: [blocks,
   block_size, Hkv, D] of type kv_dtype; tables: int32 [B, *], rows `width` apart; lens: int32 [B], the
   context length of each sequence with this step's token (0: padding); window > 0: each sequence sees
   its last `window` positions only (a sliding window); chunk > 0: the positions of its last token's
   chunk of `chunk` positions only (chunked attention); softcap > 0: logit soft-capping; sinks: [Hq]
   float32 attention-sink logits (NULL: none). A task is one (sequence, KV
   head): it stores that head's new K/V row and then reads the head's rows, so no task reads what another
   writes. Served types (q_dtype, kv_dtype): (F32, F32), (F32, BF16), (BF16, BF16). Returns 0, or
   (nothing done) -1 when rep * D exceeds MAX_ACC, -2 for types it does not serve. */
int hfaccel_paged_decode(int q_dtype, int kv_dtype, const void *q, int64_t q_st, int64_t q_sh,
                         const void *key, const void *value, int64_t kv_st, int64_t kv_sh, const int64_t *slots,
                         void *k_cache, void *v_cache, const int32_t *tables, int64_t width,
                         const int32_t *lens, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t block_size, float scale, int64_t max_len, int64_t window, int64_t chunk,
                         float softcap, const float *sinks, int num_threads) {
    for (int64_t b = 0; b < B; b++) /* the scratch rows hold the longest context, whatever max_len says */
        max_len = lens[b] > max_len ? lens[b] : max_len;
    const struct step s = {q, key, value, q_st, q_sh, kv_st, kv_sh, slots, k_cache, v_cache, tables, lens,
                           width, out, Hq, Hkv, D, block_size, max_len, window, chunk, scale, softcap, sinks};
    const int64_t rep = Hq / Hkv;
    if (rep * D > MAX_ACC) return -1;
    const int f32 = q_dtype == F32 && kv_dtype == F32, f32_bf16 = q_dtype == F32 && kv_dtype == BF16;
    if (!f32 && !f32_bf16 && !(q_dtype == BF16 && kv_dtype == BF16)) return -2;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(rep * max_len));
        int32_t *work = (int32_t *)malloc(sizeof(int32_t) * (size_t)max_len);
        float *qbuf = (float *)malloc(sizeof(float) * (size_t)(rep * D));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * Hkv; task++) {
            const int64_t b = task / Hkv, h = task % Hkv;
            /* The types are constants inside run_task (OpenMP outlines this body before inlining, so
               the choice is made here, once per task). */
            if (f32) run_task(&s, b, h, scores, work, qbuf, F32, F32);
            else if (f32_bf16) run_task(&s, b, h, scores, work, qbuf, F32, BF16);
            else run_task(&s, b, h, scores, work, qbuf, BF16, BF16);
        }
        free(scores);
        free(work);
        free(qbuf);
    }
    return 0;
}
"""

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
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_SERVED = frozenset(
    {(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)}
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
        self._function = load().hfaccel_paged_decode
        self._checked = False  # the first call's tensors were checked (`_check_call`)

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
        batch, num_heads, head_dim = query.shape
        store = key is not None and self._slots is not None
        if not self._checked:  # every layer of a step has the same shapes and dtypes: check the first
            _check_call(query, k_cache, v_cache, out, key if store else None, value if store else None)
            self._checked = True
        if store:
            # The kernel reads the new rows in the query's dtype, key and value with the same strides.
            if key.dtype != query.dtype:
                key = key.to(query.dtype)
            if value.dtype != query.dtype:
                value = value.to(query.dtype)
            if key.stride(-1) != 1 or key.stride() != value.stride():
                key, value = key.contiguous(), value.contiguous()
        status = self._function(
            _DTYPE_CODES.get(query.dtype, -1),  # -1: not served, the kernel returns -2
            _DTYPE_CODES.get(k_cache.dtype, -1),
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
            window,
            chunk,
            softcap,
            None if sinks is None else self._sinks(sinks),
            torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError(f"no kernel for a {query.dtype} query over a {k_cache.dtype} cache")
        if status != 0:
            raise ValueError(
                f"{num_heads // k_cache.shape[2]} query heads per KV head of dim {head_dim} is too large"
            )
        return out

    def _sinks(self, sinks: torch.Tensor) -> int:
        """The address of `sinks` as contiguous float32, kept alive for the call (and the step)."""
        if sinks.dtype != torch.float32 or not sinks.is_contiguous():
            sinks = sinks.detach().float().contiguous()
        self._keep = sinks
        return sinks.data_ptr()


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
