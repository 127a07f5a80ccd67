/* Paged decode attention on a CPU: the C side of cpu_decode.py (its docstring says why and how), built
   at first use by cpu_build.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define MAX_ACC 4096 /* rep * D floats of output accumulators per task, on the stack */

/* Element types (the codes the Python side passes). Every function taking a type is inlined with a
   constant one, so each served combination compiles to straight code of its own: float32 loads and
   copies exactly as a float32-only kernel would, bfloat16 a shift on load and a rounding on store. */
enum { F32 = 0, BF16 = 1, I8 = 2 };
#define INLINE static inline __attribute__((always_inline))
#define ESIZE(t) ((t) == BF16 ? 2 : (t) == I8 ? 1 : 4)
/* An int8 cache row (kv_quant.py): D int8 values, zero bytes up to a multiple of 4, its float32 scale. */
#define SCALE_AT(D) (((D) + 3) & ~(int64_t)3)
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

/* A row of n elements of type t as floats: the row itself for float32, else widened into buf (an int8
   row: each value times the row's scale, in float32 as kv_quant.dequantize computes it). */
INLINE const float *widen(float *restrict buf, const void *row, int64_t n, const int t) {
    if (t == F32) return (const float *)row;
    if (t == I8) {
        float scale;
        memcpy(&scale, (const char *)row + SCALE_AT(n), sizeof scale);
        const int8_t *q = (const int8_t *)row;
        for (int64_t i = 0; i < n; i++) buf[i] = (float)q[i] * scale;
        return buf;
    }
    copy_row(buf, F32, row, t, n);
    return buf;
}

/* n values of type st at src into an int8 cache row at dst, as kv_quant.quantize rounds them: scale =
   max|x| / 127, each value round(x / scale) half to even (0 where the row is all zeros). */
INLINE void quantize_row(void *restrict dst, const void *restrict src, const int st, int64_t n) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float x = fabsf(load(src, i, st));
        absmax = x > absmax ? x : absmax;
    }
    const float scale = absmax / 127.0f;
    int8_t *q = (int8_t *)dst;
    for (int64_t i = 0; i < n; i++) {
        float v = scale > 0.0f ? nearbyintf(load(src, i, st) / scale) : 0.0f;
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (int8_t)v;
    }
    for (int64_t i = n; i < SCALE_AT(n); i++) q[i] = 0;
    memcpy((char *)dst + SCALE_AT(n), &scale, sizeof scale);
}

/* A new row of type st into a cache row of type dt: quantized for an int8 cache, else copied. */
INLINE void store_row(void *restrict dst, const int dt, const void *restrict src, const int st, int64_t n) {
    if (dt == I8) quantize_row(dst, src, st, n);
    else copy_row(dst, dt, src, st, n);
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
    int32_t *restrict work, const int64_t D, const int64_t rep, int64_t W, int64_t row, int64_t h,
    int64_t block_size, float scale, int64_t max_len, const int ot, const int ct, float softcap,
    const float *restrict sinks) {
    /* Positions [first, len) are visible (first > 0: a sliding window or chunk); scores are indexed by
       position; a cache row is W elements of type ct (D, or an int8 row's values and scale). softcap > 0:
       scores become softcap * tanh(score / softcap) (Gemma 2); sinks (NULL: none):
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
    const int64_t num_blocks = (len + block_size - 1) / block_size, bytes = W * ESIZE(ct);
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
        const int64_t base = (int64_t)table[n] * block_size * row + h * W + t0 * row;
        const char *k = AT(k_cache, base, ct), *v = AT(v_cache, base, ct);
        const char *k_next =
            n + 1 < num_blocks ? AT(k_cache, (int64_t)table[n + 1] * block_size * row + h * W, ct) : NULL;
        for (int64_t t = t0; t < count; t++, k = AT(k, row, ct), v = AT(v, row, ct)) {
            if (k_next != NULL) prefetch(AT(k_next, t * row, ct), bytes);
            else
                prefetch(AT(v_cache, (int64_t)table[first_block] * block_size * row + h * W + t * row, ct),
                         bytes);
            if (ct != F32) prefetch(v, bytes);
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
        const char *v = AT(v_cache, (int64_t)table[n] * block_size * row + h * W + t0 * row, ct);
        const char *v_next =
            n + 1 < num_blocks ? AT(v_cache, (int64_t)table[n + 1] * block_size * row + h * W, ct) : NULL;
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
    int64_t Hq, Hkv, D, W, block_size, max_len, window, chunk; /* W: a cache row's elements */
    float scale, softcap;
    const float *sinks; /* [Hq] float32, or NULL */
};

/* Task (b, h) with query type qt and cache type ct: store sequence b's new K/V row of KV head h, then
   attend with the head's query rows. scores, work, qbuf: the thread's scratch. */
INLINE void run_task(const struct step *s, int64_t b, int64_t h, float *restrict scores,
                     int32_t *restrict work, float *restrict qbuf, const int qt, const int ct) {
    const int64_t D = s->D, W = s->W, rep = s->Hq / s->Hkv, row = s->Hkv * W, len = s->lens[b];
    int64_t first = s->window > 0 && len > s->window ? len - s->window : 0; /* sliding window */
    if (s->chunk > 0 && len > 0 && (len - 1) / s->chunk * s->chunk > first) /* chunked attention */
        first = (len - 1) / s->chunk * s->chunk;
    char *ob = AT(s->out, (b * s->Hq + h * rep) * D, qt);
    if (len <= 0) {
        memset(ob, 0, (size_t)(rep * D * ESIZE(qt)));
        return;
    }
    if (s->slots != NULL && s->slots[b] >= 0) { /* the new rows arrive in qt: stored converted to ct */
        const int64_t at = s->slots[b] * row + h * W, from = b * s->kv_st + h * s->kv_sh;
        store_row(AT(s->k_cache, at, ct), ct, AT(s->key, from, qt), qt, D);
        store_row(AT(s->v_cache, at, ct), ct, AT(s->value, from, qt), qt, D);
    }
    for (int64_t r = 0; r < rep; r++) /* the rep query rows of this KV head, contiguous, in float */
        copy_row(qbuf + r * D, F32, AT(s->q, b * s->q_st + (h * rep + r) * s->q_sh, qt), qt, D);
    const float *qb = qbuf;
    const int32_t *table = s->tables + b * s->width;
    const float *sinks = s->sinks != NULL ? s->sinks + h * rep : NULL;
#define TASK(DD, RR) decode_task(qb, s->k_cache, s->v_cache, table, len, first, ob, scores, work, DD, RR, W, row, \
                                 h, s->block_size, s->scale, s->max_len, qt, ct, s->softcap, sinks)
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
   block_size, Hkv, W] of type kv_dtype (W = D, or an int8 row's values and scale); tables: int32
   [B, *], rows `width` apart; lens: int32 [B], the context length of each sequence with this step's
   token (0: padding); window > 0: each sequence sees its last `window` positions only (a sliding
   window); chunk > 0: the positions of its last token's chunk of `chunk` positions only (chunked
   attention); softcap > 0: logit soft-capping; sinks: [Hq] float32 attention-sink logits (NULL: none).
   A task is one (sequence, KV head): it stores that head's new K/V row and then reads the head's rows,
   so no task reads what another writes. Served types (q_dtype, kv_dtype): (F32, F32), (F32, BF16),
   (BF16, BF16), (F32, I8), (BF16, I8). Returns 0, or (nothing done) -1 when rep * D exceeds MAX_ACC,
   -2 for types it does not serve, -3 for a row width W that does not fit D and the cache's type. */
int hfaccel_paged_decode(int q_dtype, int kv_dtype, const void *q, int64_t q_st, int64_t q_sh,
                         const void *key, const void *value, int64_t kv_st, int64_t kv_sh, const int64_t *slots,
                         void *k_cache, void *v_cache, const int32_t *tables, int64_t width,
                         const int32_t *lens, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t W, int64_t block_size, float scale, int64_t max_len, int64_t window, int64_t chunk,
                         float softcap, const float *sinks, int num_threads) {
    for (int64_t b = 0; b < B; b++) /* the scratch rows hold the longest context, whatever max_len says */
        max_len = lens[b] > max_len ? lens[b] : max_len;
    const struct step s = {q, key, value, q_st, q_sh, kv_st, kv_sh, slots, k_cache, v_cache, tables, lens,
                           width, out, Hq, Hkv, D, W, block_size, max_len, window, chunk, scale, softcap, sinks};
    const int64_t rep = Hq / Hkv;
    if (rep * D > MAX_ACC) return -1;
    const int f32 = q_dtype == F32 && kv_dtype == F32, f32_bf16 = q_dtype == F32 && kv_dtype == BF16;
    const int bf16 = q_dtype == BF16 && kv_dtype == BF16;
    const int f32_i8 = q_dtype == F32 && kv_dtype == I8, bf16_i8 = q_dtype == BF16 && kv_dtype == I8;
    if (!f32 && !f32_bf16 && !bf16 && !f32_i8 && !bf16_i8) return -2;
    if (kv_dtype == I8 ? W != SCALE_AT(D) + 4 : W != D) return -3;
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
            else if (bf16) run_task(&s, b, h, scores, work, qbuf, BF16, BF16);
            else if (f32_i8) run_task(&s, b, h, scores, work, qbuf, F32, I8);
            else run_task(&s, b, h, scores, work, qbuf, BF16, I8);
        }
        free(scores);
        free(work);
        free(qbuf);
    }
    return 0;
}
