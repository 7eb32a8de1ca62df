/* CPU kernels for the decode-heavy path: what torch runs as dozens of small eager ops per layer,
 * or as a gather of the whole KV cache per layer, done in one pass here.
 *
 * Built at first use by gpu/native/__init__.py (gcc -O3 -march=native -fopenmp) and called
 * through ctypes with raw pointers; the Python side checks shapes, dtypes and contiguity.
 * OpenMP resolves to the libgomp torch has already loaded (same soname), so these loops share
 * torch's thread pool and thread count instead of starting a second one.
 *
 * Activations are float32. KV caches are float32 or bfloat16 (`cache_bf16`). Quantized matmuls
 * take GGUF's own block formats: Q4_1 (32 weights: w = d * q + m, q in 0..15) and Q8_0 (32
 * weights: w = d * q, q in -127..127), against activations quantized per 32 to int8 (as
 * llama.cpp does), with integer dot products (AVX512-VNNI, else AVX2, else scalar).
 */
#define _GNU_SOURCE /* sched_setaffinity's CPU sets, under -std=c11 */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* every x86 branch below guards its own intrinsics by the ISA macros */
#endif

/* The 256-bit branches use FMA throughout: every AVX2 CPU has it, and -mavx2 alone does not
 * enable it, so such a build takes the portable code instead of failing to compile. */
#if defined(__AVX2__) && defined(__FMA__)
#define CPU_AVX2 1
#endif

#define QK 32 /* weights per quantization block */
#define ATTEND_VECTORS 64 /* query vectors one attention work item holds at most (attend_vectors) */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float h2f(uint16_t h) { /* IEEE half -> float */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal half: renormalise */
        int e = 113;
        uint32_t m = man;
        while (!(m & 0x400)) { m <<= 1; e--; }
        u = sign | ((uint32_t)e << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* e^x, 8 lanes at a time, within a few float ulps for x in [-87, 88] (clamped there): glibc's
 * expf only vectorizes under -ffast-math, which would also drop the infinities used here. */
#if defined(CPU_AVX2)
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 kf = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(kf), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* The sum of the 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* dst[i] = e^(src[i] - shift); returns their sum. */
static float exp_shifted(const float *src, float *dst, int64_t n, float shift) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(CPU_AVX2)
    __m256 acc = _mm256_setzero_ps();
    const __m256 s = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(src + i), s));
        _mm256_storeu_ps(dst + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; i < n; i++) {
        dst[i] = expf(src[i] - shift);
        sum += dst[i];
    }
    return sum;
}

/* ---------------------------------------------------------------- norms and activations */

static void rms_norm_row(const float *x, const float *w, float *out, int64_t dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}

/* out[r] = rms_norm(x[r]) * w */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps) {
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * dim, w, out + r * dim, dim, eps);
}

/* residual[r] += x[r]; out[r] = rms_norm(residual[r]) * w */
void add_rms_norm_f32(float *residual, const float *x, const float *w, float *out, int64_t rows,
                      int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * dim;
        const float *xr = x + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) res[i] += xr[i];
        rms_norm_row(res, w, out + r * dim, dim, eps);
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i] */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter;
        const float *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#if defined(CPU_AVX2)
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---------------------------------------------------------------- rotary + KV cache write */

/* qkv: [T, (H + 2 * KVH) * D] rows of [q heads | k heads | v heads]. Rotates q and k in place
 * (rotate-half layout: pairs (i, i + D/2)) by cos/sin [T, D/2], then stores k and v at
 * slot_mapping[t] of the caches ([slots, KVH, D]); a negative slot is skipped. */
void rope_write_kv(float *qkv, int64_t tokens, const float *cos_t, const float *sin_t,
                   int64_t heads, int64_t kv_heads, int64_t dim, const int64_t *slot_mapping,
                   void *k_cache, void *v_cache, int cache_bf16) {
    const int64_t half = dim / 2, row = (heads + 2 * kv_heads) * dim;
#pragma omp parallel for if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_t + t * half, *sn = sin_t + t * half;
        float *x = qkv + t * row;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x1 = x + h * dim, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * cs[i] - b * sn[i];
                x2[i] = b * cs[i] + a * sn[i];
            }
        }
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *k = x + heads * dim, *v = k + kv_heads * dim;
        const int64_t n = kv_heads * dim, base = slot * n;
        if (cache_bf16) {
            uint16_t *kc = (uint16_t *)k_cache + base, *vc = (uint16_t *)v_cache + base;
            for (int64_t i = 0; i < n; i++) {
                kc[i] = f32_to_bf16(k[i]);
                vc[i] = f32_to_bf16(v[i]);
            }
        } else {
            memcpy((float *)k_cache + base, k, (size_t)n * sizeof(float));
            memcpy((float *)v_cache + base, v, (size_t)n * sizeof(float));
        }
    }
}

/* ---------------------------------------------------------------- paged decode attention */

#if defined(CPU_AVX2)
#define KV_PREFETCH 16 /* positions ahead */

/* The prefetch helpers are always inlined: a plain static inline one is, to GCC's IPA pure-const
 * pass, a call without side effects (a prefetch is none to it), which it deletes before inlining,
 * so that no prefetch of them reached any build until this was found. */
static inline __attribute__((always_inline)) void prefetch_row(const void *cache, int64_t index,
                                                               int64_t dim, int bf16) {
    const char *row = (const char *)cache + index * (bf16 ? 2 : 4);
    for (int64_t off = 0; off < dim * (bf16 ? 2 : 4); off += 64)
        _mm_prefetch(row + off, _MM_HINT_T0);
}

#define KV_PREFETCH_FAR 64 /* positions ahead, into L2: DRAM latency needs many lines in flight */
static inline __attribute__((always_inline)) void prefetch_row_l2(const void *cache,
                                                                  int64_t index, int64_t dim,
                                                                  int bf16) {
    const char *row = (const char *)cache + index * (bf16 ? 2 : 4);
    for (int64_t off = 0; off < dim * (bf16 ? 2 : 4); off += 64)
        _mm_prefetch(row + off, _MM_HINT_T1);
}

/* While key j of n is converted: key rows a few positions ahead into L1 (the walk through the
 * block table hides the pattern from the hardware) and further ahead into L2; as the keys end,
 * the first value rows. */
static inline __attribute__((always_inline)) void prefetch_ahead_of_key(
    const void *k_cache, const void *v_cache, int bf16, const int64_t *rows, int64_t j, int64_t n,
    int64_t dim) {
    if (j + KV_PREFETCH < n) prefetch_row(k_cache, rows[j + KV_PREFETCH], dim, bf16);
    if (j + KV_PREFETCH_FAR < n)
        prefetch_row_l2(k_cache, rows[j + KV_PREFETCH_FAR], dim, bf16);
    else if (j + KV_PREFETCH_FAR - n < n)
        prefetch_row_l2(v_cache, rows[j + KV_PREFETCH_FAR - n], dim, bf16);
}

#endif

#if defined(__AVX512F__)
/* 16 cache values at index i as float32. */
static inline __m512 load16(const void *cache, int64_t i, int bf16) {
    if (bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)cache + i);
}

/* acc[g][c] = sum_p probs[g][p] * V[p][c0 + c] for GN query vectors and CN 16-wide chunks of
 * the head dimension; the GN * CN accumulators stay in registers across all positions. Vector
 * g's output row is outs[g]. */
static inline __attribute__((always_inline)) void pv_tile(
    const int GN, const int CN, const float *probs, int64_t probs_stride, const void *v_cache,
    int bf16, const int64_t *rows, int64_t n, int64_t c0, float *const *outs, int64_t dim,
    const float *inv) {
    __m512 acc[4][4];
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (j + KV_PREFETCH < n) prefetch_row(v_cache, rows[j + KV_PREFETCH] + c0, 16 * CN, bf16);
        if (c0 == 0 && j + KV_PREFETCH_FAR < n)
            prefetch_row_l2(v_cache, rows[j + KV_PREFETCH_FAR], dim, bf16);
        __m512 v[4];
        for (int c = 0; c < CN; c++) v[c] = load16(v_cache, rows[j] + c0 + 16 * c, bf16);
        for (int g = 0; g < GN; g++) {
            const __m512 w = _mm512_set1_ps(probs[g * probs_stride + j]);
            for (int c = 0; c < CN; c++) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++)
            _mm512_storeu_ps(outs[g] + c0 + 16 * c,
                             _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

#define PV_CASE(G, C)                                                                         \
    case (G) * 8 + (C):                                                                       \
        pv_tile(G, C, probs + v0 * stride, stride, v_cache, bf16, rows, upto, c0, outs + v0, \
                dim, inv + v0);                                                               \
        break;

/* The sums of 16 vectors as one: lane 4k + m of the result is the sum of a[4m + k] (callers put
 * key p in slot 4 * (p % 4) + p / 4 to get key p in lane p). 15 adds and 30 shuffles instead of
 * 16 horizontal reductions of ~8 dependent steps each. */
static inline __m512 transpose_sum16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xEE));
}

/* Scores of one query vector against 16 keys held as float32 rows in `keys` (CN chunks of 16). */
static inline __attribute__((always_inline)) __m512 scores16(const int CN, const float *qg,
                                                             const float *keys) {
    __m512 qv[8], acc[16];
    for (int c = 0; c < CN; c++) qv[c] = _mm512_loadu_ps(qg + 16 * c);
    for (int r = 0; r < 16; r++) {
        const float *key = keys + r * 16 * CN;
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
        for (int c = 1; c < CN; c++) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(key + 16 * c), a);
        acc[((r & 3) << 2) | (r >> 2)] = a;
    }
    return transpose_sum16(acc);
}

/* One work item: `nv` query vectors of one KV head (its query group at one or more positions
 * of a sequence), vector i attending to the first seen[i] keys of `rows` (the cache element
 * offset of each position's K/V row for this head). Keys are taken 16 at a time: converted once
 * to float32 in `keys` (L1), scored against every vector that sees them, the 16 dot products
 * reduced together; then each vector's softmax, and the values weighted 4 vectors at a time.
 * A vector's arithmetic does not depend on what else the item holds: a position verified with
 * its neighbours gets the bits it gets when decoded alone (positions past seen[i] weigh 0). */
static void attend_avx512(const float *const *qs, float *const *outs, const int64_t *seen,
                          int64_t nv, const void *k_cache, const void *v_cache, int bf16,
                          const int64_t *rows, int64_t dim, float scale, float *probs,
                          int64_t stride, float *keys) {
    const int64_t chunks = dim / 16;
    int64_t n = 0;
    for (int64_t i = 0; i < nv; i++) n = seen[i] > n ? seen[i] : n;
    float inv[ATTEND_VECTORS];
    __m512 top[ATTEND_VECTORS];
    for (int64_t i = 0; i < nv; i++) top[i] = _mm512_set1_ps(-INFINITY);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        for (int64_t r = 0; r < 16; r++) {
            float *dst = keys + r * dim;
            if (r >= m) {
                for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_setzero_ps());
                continue;
            }
            const int64_t j = j0 + r;
            prefetch_ahead_of_key(k_cache, v_cache, bf16, rows, j, n, dim);
            for (int64_t c = 0; c < chunks; c++)
                _mm512_storeu_ps(dst + 16 * c, load16(k_cache, rows[j] + 16 * c, bf16));
        }
        for (int64_t i = 0; i < nv; i++) {
            if (seen[i] <= j0) continue;
            const int64_t mi = seen[i] - j0 < 16 ? seen[i] - j0 : 16;
            const __mmask16 valid = (__mmask16)((1u << mi) - 1u);
            const float *qg = qs[i];
            __m512 sc;
            switch (chunks) {
                case 4: sc = scores16(4, qg, keys); break;
                case 8: sc = scores16(8, qg, keys); break;
                case 2: sc = scores16(2, qg, keys); break;
                case 6: sc = scores16(6, qg, keys); break;
                default: {
                    __m512 acc[16];
                    for (int r = 0; r < 16; r++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int64_t c = 0; c < chunks; c++)
                            a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c),
                                                _mm512_loadu_ps(keys + r * dim + 16 * c), a);
                        acc[((r & 3) << 2) | (r >> 2)] = a;
                    }
                    sc = transpose_sum16(acc);
                }
            }
            sc = _mm512_mul_ps(sc, vscale);
            _mm512_mask_storeu_ps(probs + i * stride + j0, valid, sc);
            top[i] = _mm512_mask_max_ps(top[i], valid, top[i], sc);
        }
    }
    for (int64_t i = 0; i < nv; i++) {
        float *pg = probs + i * stride;
        const float sum = exp_shifted(pg, pg, seen[i], _mm512_reduce_max_ps(top[i]));
        for (int64_t j = seen[i]; j < n; j++) pg[j] = 0.0f;
        inv[i] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    for (int64_t c0 = 0; c0 < chunks * 16; c0 += 64) {
        const int64_t cn = (chunks * 16 - c0) / 16 < 4 ? (chunks * 16 - c0) / 16 : 4;
        for (int64_t v0 = 0; v0 < nv; v0 += 4) {
            const int64_t gn = nv - v0 < 4 ? nv - v0 : 4;
            int64_t upto = 0; /* the values any of these vectors weighs */
            for (int64_t i = v0; i < v0 + gn; i++) upto = seen[i] > upto ? seen[i] : upto;
            switch (gn * 8 + cn) {
                PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(1, 3) PV_CASE(1, 4)
                PV_CASE(2, 1) PV_CASE(2, 2) PV_CASE(2, 3) PV_CASE(2, 4)
                PV_CASE(3, 1) PV_CASE(3, 2) PV_CASE(3, 3) PV_CASE(3, 4)
                PV_CASE(4, 1) PV_CASE(4, 2) PV_CASE(4, 3) PV_CASE(4, 4)
            }
        }
    }
}
#endif

#if defined(CPU_AVX2)
static inline __m256 load8(const void *cache, int64_t i, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)cache + i);
}

/* acc[g][c] = sum_p probs[g][p] * V[p][c0 + c] for GN query vectors and CN 8-wide chunks of
 * the head dimension, as pv_tile with 8 lanes (GN * CN <= 8 accumulators beside the loads). */
static inline __attribute__((always_inline)) void pv_tile8(
    const int GN, const int CN, const float *probs, int64_t probs_stride, const void *v_cache,
    int bf16, const int64_t *rows, int64_t n, int64_t c0, float *const *outs, int64_t dim,
    const float *inv) {
    __m256 acc[4][2];
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++) acc[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (j + KV_PREFETCH < n) prefetch_row(v_cache, rows[j + KV_PREFETCH] + c0, 8 * CN, bf16);
        if (c0 == 0 && j + KV_PREFETCH_FAR < n)
            prefetch_row_l2(v_cache, rows[j + KV_PREFETCH_FAR], dim, bf16);
        __m256 v[2];
        for (int c = 0; c < CN; c++) v[c] = load8(v_cache, rows[j] + c0 + 8 * c, bf16);
        for (int g = 0; g < GN; g++) {
            const __m256 w = _mm256_set1_ps(probs[g * probs_stride + j]);
            for (int c = 0; c < CN; c++) acc[g][c] = _mm256_fmadd_ps(w, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++)
            _mm256_storeu_ps(outs[g] + c0 + 8 * c, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
}

#define PV8_CASE(G, C)                                                                        \
    case (G) * 8 + (C):                                                                       \
        pv_tile8(G, C, probs + v0 * stride, stride, v_cache, bf16, rows, upto, c0, outs + v0, \
                 dim, inv + v0);                                                              \
        break;

/* The sums of 8 vectors as one: lane r of the result is the sum of a[r]'s lanes. */
static inline __m256 transpose_sum8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Scores of one query vector against 8 keys held as float32 rows in `keys` (CN chunks of 8). */
static inline __attribute__((always_inline)) __m256 scores8(const int CN, const float *qg,
                                                            const float *keys) {
    __m256 acc[8];
    for (int r = 0; r < 8; r++) {
        const float *key = keys + r * 8 * CN;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(key));
        for (int c = 1; c < CN; c++)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(key + 8 * c), a);
        acc[r] = a;
    }
    return transpose_sum8(acc);
}

/* One work item on AVX2, for head_dim % 8 == 0: attend_avx512 with 8 lanes. Keys are taken 8
 * at a time, converted once to float32 in `keys` (L1) and scored against every query vector
 * of the item (a KV head's query group, at one or more positions of a sequence): each key block
 * is read once for the group and for a prefill chunk's rows. A vector's arithmetic does not
 * depend on what else the item holds, so a prefilled token gets its decode's bits. */
static void attend_avx2(const float *const *qs, float *const *outs, const int64_t *seen,
                        int64_t nv, const void *k_cache, const void *v_cache, int bf16,
                        const int64_t *rows, int64_t dim, float scale, float *probs,
                        int64_t stride, float *keys) {
    const int64_t chunks = dim / 8;
    int64_t n = 0;
    for (int64_t i = 0; i < nv; i++) n = seen[i] > n ? seen[i] : n;
    float inv[ATTEND_VECTORS];
    __m256 top[ATTEND_VECTORS];
    for (int64_t i = 0; i < nv; i++) top[i] = _mm256_set1_ps(-INFINITY);
    const __m256 vscale = _mm256_set1_ps(scale), lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t m = n - j0 < 8 ? n - j0 : 8;
        for (int64_t r = 0; r < 8; r++) {
            float *dst = keys + r * dim;
            if (r >= m) {
                for (int64_t c = 0; c < chunks; c++) _mm256_storeu_ps(dst + 8 * c, _mm256_setzero_ps());
                continue;
            }
            const int64_t j = j0 + r;
            prefetch_ahead_of_key(k_cache, v_cache, bf16, rows, j, n, dim);
            for (int64_t c = 0; c < chunks; c++)
                _mm256_storeu_ps(dst + 8 * c, load8(k_cache, rows[j] + 8 * c, bf16));
        }
        for (int64_t i = 0; i < nv; i++) {
            if (seen[i] <= j0) continue;
            const int64_t mi = seen[i] - j0 < 8 ? seen[i] - j0 : 8;
            const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)mi), _CMP_LT_OQ);
            const float *qg = qs[i];
            __m256 sc;
            switch (chunks) {
                case 8: sc = scores8(8, qg, keys); break;
                case 16: sc = scores8(16, qg, keys); break;
                case 4: sc = scores8(4, qg, keys); break;
                case 12: sc = scores8(12, qg, keys); break;
                default: {
                    __m256 acc[8];
                    for (int r = 0; r < 8; r++) {
                        __m256 a = _mm256_setzero_ps();
                        for (int64_t c = 0; c < chunks; c++)
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c),
                                                _mm256_loadu_ps(keys + r * dim + 8 * c), a);
                        acc[r] = a;
                    }
                    sc = transpose_sum8(acc);
                }
            }
            sc = _mm256_mul_ps(sc, vscale);
            /* All 8 lanes, past seen[i] too: a row of probs is max_len + 16 wide, and the lanes
             * past seen[i] are zeroed below before anything reads them (vmaskmovps, the masked
             * store, is microcoded on AMD: one of these per 8 keys and vector cost more than
             * the scores' FMAs at prefill on Zen 5). */
            _mm256_storeu_ps(probs + i * stride + j0, sc);
            top[i] = _mm256_max_ps(top[i], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, valid));
        }
    }
    for (int64_t i = 0; i < nv; i++) {
        float *pg = probs + i * stride;
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top[i]), _mm256_extractf128_ps(top[i], 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        const float mx = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
        const float sum = exp_shifted(pg, pg, seen[i], mx);
        for (int64_t j = seen[i]; j < n; j++) pg[j] = 0.0f;
        inv[i] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    for (int64_t c0 = 0; c0 < dim; c0 += 16) {
        const int64_t cn = dim - c0 >= 16 ? 2 : 1;
        for (int64_t v0 = 0; v0 < nv; v0 += 4) {
            const int64_t gn = nv - v0 < 4 ? nv - v0 : 4;
            int64_t upto = 0; /* the values any of these vectors weighs */
            for (int64_t i = v0; i < v0 + gn; i++) upto = seen[i] > upto ? seen[i] : upto;
            switch (gn * 8 + cn) {
                PV8_CASE(1, 1) PV8_CASE(1, 2) PV8_CASE(2, 1) PV8_CASE(2, 2)
                PV8_CASE(3, 1) PV8_CASE(3, 2) PV8_CASE(4, 1) PV8_CASE(4, 2)
            }
        }
    }
}
#endif

/* Portable version of one item. */
static void attend_scalar(const float *q, const void *k_cache, const void *v_cache, int bf16,
                          const int64_t *rows, int64_t n, int64_t group, int64_t dim,
                          float scale, float *probs, int64_t stride, float *out) {
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        float *pg = probs + g * stride, mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < dim; i++)
                dot += qg[i] * (bf16 ? bf16_to_f32(((const uint16_t *)k_cache)[rows[j] + i])
                                     : ((const float *)k_cache)[rows[j] + i]);
            pg[j] = dot * scale;
            mx = pg[j] > mx ? pg[j] : mx;
        }
        const float sum = exp_shifted(pg, pg, n, mx), inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        float *og = out + g * dim;
        for (int64_t i = 0; i < dim; i++) og[i] = 0.0f;
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < dim; i++)
                og[i] += pg[j] * (bf16 ? bf16_to_f32(((const uint16_t *)v_cache)[rows[j] + i])
                                       : ((const float *)v_cache)[rows[j] + i]);
        for (int64_t i = 0; i < dim; i++) og[i] *= inv;
    }
}

/* One query token per row. q rows: q + token_index[s] * q_stride, [H, D]; out likewise. Row s
 * sees cache positions [lo, context_lens[s]) through block_tables[s] (lo > 0 only with a
 * sliding window). Work items are (rows, KV head): its query group is scored against each key;
 * softmax and accumulation in float32.
 *
 * Rows whose keys are a prefix of the next row's (the same blocks for every position the
 * shorter one sees: the positions of a sequence verifying drafts, each attended as a decode)
 * share an item from AVX2 up: their keys are read and converted once for all of them. A run is
 * cut into equal pieces so that the items still keep every thread busy. A table_stride of 0
 * gives every row the one table (a prefill chunk's rows). Returns -1 when out of memory. */
int paged_decode_attention(const float *q, int64_t q_stride, const int64_t *token_index,
                            int64_t num_seqs, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *context_lens, const void *k_cache, const void *v_cache,
                            int cache_bf16, int64_t block_size, int64_t heads, int64_t kv_heads,
                            int64_t dim, float scale, int64_t window, float *out,
                            int64_t out_stride) {
    const int64_t group = heads / kv_heads;
    int64_t max_len = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        if (context_lens[s] > max_len) max_len = context_lens[s];
    const int64_t stride = max_len + 16;
    /* first[p]: the first row of piece p (first[pieces] = num_seqs); a prefill chunk's rows
     * can be thousands, so not on the stack */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!first) return -1;
    int64_t pieces = 0, widest = 1;
#if defined(__AVX512F__)
    const int spans = dim % 16 == 0 && window <= 0;
#elif defined(CPU_AVX2)
    const int spans = dim % 8 == 0 && window <= 0;
#else
    const int spans = 0;
#endif
    if (!spans) {
        for (int64_t s = 0; s <= num_seqs; s++) first[s] = s;
        pieces = num_seqs;
    } else {
        /* rows per piece: ATTEND_VECTORS query vectors, and 2 items per thread where possible */
        const int64_t threads = omp_get_max_threads();
        int64_t cap = num_seqs * kv_heads / (2 * threads);
        if (cap > ATTEND_VECTORS / group) cap = ATTEND_VECTORS / group;
        if (cap < 1) cap = 1;
        for (int64_t s = 0; s < num_seqs;) {
            int64_t e = s + 1;
            while (e < num_seqs && context_lens[e] >= context_lens[e - 1] &&
                   !memcmp(block_tables + e * table_stride, block_tables + (e - 1) * table_stride,
                           sizeof(int32_t) *
                               (size_t)((context_lens[e - 1] + block_size - 1) / block_size)))
                e++;
            const int64_t run = e - s, parts = (run + cap - 1) / cap;
            for (int64_t k = 0; k < parts; k++) first[pieces++] = s + run * k / parts;
            if ((run + parts - 1) / parts > widest) widest = (run + parts - 1) / parts;
            s = e;
        }
        first[pieces] = num_seqs;
    }
#pragma omp parallel
    {
        float *probs = (float *)malloc(sizeof(float) * (size_t)(widest * group * stride));
        int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(max_len + 1));
        float *keys = (float *)malloc(sizeof(float) * (size_t)(16 * dim));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < pieces * kv_heads; item++) {
            const int64_t p = item / kv_heads, kvh = item % kv_heads;
            const int64_t s0 = first[p], s1 = first[p + 1], last = s1 - 1;
            const int64_t len = context_lens[last];
            const int64_t lo = (window > 0 && len > window) ? len - window : 0;
            const int32_t *table = block_tables + last * table_stride;
            for (int64_t pos = lo; pos < len; pos++)
                rows[pos - lo] = ((int64_t)table[pos / block_size] * block_size +
                                  pos % block_size) * kv_heads * dim +
                                 kvh * dim;
#if defined(CPU_AVX2)
            if (dim % 8 == 0) { /* a piece's rows (one, with a sliding window) */
                const float *qv[ATTEND_VECTORS];
                float *ov[ATTEND_VECTORS];
                int64_t seen[ATTEND_VECTORS], nv = 0;
                for (int64_t s = s0; s < s1; s++)
                    for (int64_t g = 0; g < group; g++, nv++) {
                        qv[nv] = q + token_index[s] * q_stride + (kvh * group + g) * dim;
                        ov[nv] = out + token_index[s] * out_stride + (kvh * group + g) * dim;
                        seen[nv] = context_lens[s] - lo;
                    }
#if defined(__AVX512F__)
                if (dim % 16 == 0) {
                    attend_avx512(qv, ov, seen, nv, k_cache, v_cache, cache_bf16, rows, dim,
                                  scale, probs, stride, keys);
                    continue;
                }
#endif
                attend_avx2(qv, ov, seen, nv, k_cache, v_cache, cache_bf16, rows, dim, scale,
                            probs, stride, keys);
                continue;
            }
#endif
            const float *qs = q + token_index[s0] * q_stride + kvh * group * dim;
            float *os = out + token_index[s0] * out_stride + kvh * group * dim;
            attend_scalar(qs, k_cache, v_cache, cache_bf16, rows, len - lo, group, dim, scale,
                          probs, stride, os);
        }
        free(probs);
        free(rows);
        free(keys);
    }
    free(first);
    return 0;
}

/* ---------------------------------------------------------------- quantized matmuls */

/* Activations to Q8: per block of 32, d = max|x| / 127, q = round(x / d); also d * sum(q), the
 * block sum Q4_1's offsets multiply. x: [rows, K]; xq: [rows, K]; xd, xs: [rows, K / 32]. */
void quantize_rows_q8(const float *x, int8_t *xq, float *xd, float *xs, int64_t rows,
                      int64_t k) {
    const int64_t blocks = k / QK;
#pragma omp parallel for schedule(static) if (rows * k >= 32768)
    for (int64_t b = 0; b < rows * blocks; b++) {
        const float *src = x + b * QK;
#if defined(__AVX512F__)
        const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(xq + b * QK), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(xq + b * QK + 16), _mm512_cvtsepi32_epi8(qhi));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#elif defined(CPU_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(src + 8 * i);
        const __m256 m8 = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4]; /* rounded to nearest even, as lrintf */
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        /* the packs interleave 128-bit lanes: 4-byte groups come out as 0 4 1 5 2 6 3 7 */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                 _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * QK),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        const int sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
#else
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(src[i]));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)lrintf(src[i] * inv);
            xq[b * QK + i] = (int8_t)v;
            sum += v;
        }
#endif
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

/* 256-bit vpdpbusd (4 unsigned x signed byte products summed into each int32 lane): AVX-VNNI's
 * VEX form (the avx2_vnni level: Alder Lake and later, Zen 5), or AVX-512 VNNI's VL form, the
 * same instruction. */
#if defined(CPU_AVX2) && defined(__AVXVNNI__)
#define DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(CPU_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif

/* sum over the 32 lanes of (unsigned codes u) * (signed x) as int32, one block. */
#if defined(CPU_AVX2)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(DPBUSD256)
    return DPBUSD256(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif


#define TILE 4 /* rows of x per pass over a weight row: their accumulators stay in registers */

/* Q4_1 weights are repacked at load time (q4_1_pack) so that one load and two masks give the
 * codes of several whole blocks, in x's order. A row of B blocks is stored as segments:
 *  - quads (blocks 4q..4q+3, 64 bytes): byte j's low nibble is weight j of blocks 4q, 4q+1
 *    (j < 32: block 4q), its high nibble weight j of blocks 4q+2, 4q+3;
 *  - then a pair if B % 4 >= 2 (32 bytes: low nibble block b, high nibble block b + 1);
 *  - then a single block if B is odd, as GGUF stores it (low nibble i, high nibble i + 16).
 * Same size as GGUF's nibbles: B * 16 bytes a row. */
void q4_1_pack(const uint8_t *gguf, uint8_t *packed, int64_t rows, int64_t blocks) {
    for (int64_t n = 0; n < rows; n++) {
        const uint8_t *src = gguf + n * blocks * 16;
        uint8_t *dst = packed + n * blocks * 16;
        uint8_t codes[4][32];
        int64_t b = 0;
        for (; b + 4 <= blocks; b += 4, dst += 64) {
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 16; j++) {
                    codes[i][j] = src[(b + i) * 16 + j] & 0x0f;
                    codes[i][j + 16] = src[(b + i) * 16 + j] >> 4;
                }
            for (int j = 0; j < 64; j++)
                dst[j] = (uint8_t)(codes[j / 32][j % 32] | (codes[2 + j / 32][j % 32] << 4));
        }
        if (blocks - b >= 2) {
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 16; j++) {
                    codes[i][j] = src[(b + i) * 16 + j] & 0x0f;
                    codes[i][j + 16] = src[(b + i) * 16 + j] >> 4;
                }
            for (int j = 0; j < 32; j++) dst[j] = (uint8_t)(codes[0][j] | (codes[1][j] << 4));
            b += 2;
            dst += 32;
        }
        if (b < blocks) memcpy(dst, src + b * 16, 16);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#define Q4_ZMM 1
#endif

/* The many-row kernels' 16-channel layout (q4_1_gemm_pack, q8_0_gemm_pack): 512-bit VNNI
 * tiles with AVX-512 VNNI, two 8-channel halves of 256-bit tiles with AVX2. Only the portable
 * build keeps the row layout (q4_1_pack). */
#if defined(Q4_ZMM) || defined(CPU_AVX2)
#define GEMM_LAYOUT 1
#endif

#if defined(CPU_AVX2)
/* One packed weight row against R (<= TILE, a constant once inlined) rows of x. */
static inline __attribute__((always_inline)) void q4_1_tile(
    const int R, const int8_t *xq, const float *xd, const float *xs, int64_t k, int64_t blocks,
    const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, float *out, int64_t out_stride) {
    float offset[TILE];
    __m256 acc[TILE][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = _mm256_setzero_ps();
        acc[r][1] = _mm256_setzero_ps();
        offset[r] = 0.0f;
    }
    int64_t b = 0;
#if defined(Q4_ZMM)
    {
        __m512 acc_z[TILE][2];
        __m128 off4[TILE];
        for (int r = 0; r < R; r++) {
            acc_z[r][0] = _mm512_setzero_ps();
            acc_z[r][1] = _mm512_setzero_ps();
            off4[r] = _mm_setzero_ps();
        }
        const __m512i low = _mm512_set1_epi8(0x0f);
        const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i second = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
        for (; b + 4 <= blocks; b += 4) {
            const __m512i raw = _mm512_loadu_si512((const void *)(wq + b * 16));
            const __m512i c01 = _mm512_and_si512(raw, low);
            const __m512i c23 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(wd + b)));
            const __m128 m4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(wm + b)));
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * k + b * QK;
                const __m512i p01 =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), c01, _mm512_loadu_si512(x));
                const __m512i p23 =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), c23, _mm512_loadu_si512(x + 64));
                const __m512 s4 =
                    _mm512_castps128_ps512(_mm_mul_ps(d4, _mm_loadu_ps(xd + r * (k / QK) + b)));
                acc_z[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p01),
                                              _mm512_permutexvar_ps(first, s4), acc_z[r][0]);
                acc_z[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p23),
                                              _mm512_permutexvar_ps(second, s4), acc_z[r][1]);
                off4[r] = _mm_fmadd_ps(m4, _mm_loadu_ps(xs + r * (k / QK) + b), off4[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            offset[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_z[r][0], acc_z[r][1]));
            __m128 o = _mm_add_ps(off4[r], _mm_movehl_ps(off4[r], off4[r]));
            o = _mm_add_ss(o, _mm_movehdup_ps(o));
            offset[r] += _mm_cvtss_f32(o);
        }
    }
#elif defined(__F16C__)
    {
        /* The four blocks' scales and minimums are converted once per quad for every row, and
         * each row's scale products and minimum terms are 4-lane vector ops: per row and block
         * that leaves the integer dot, its convert, a lane broadcast and one FMA. */
        const __m256i low = _mm256_set1_epi8(0x0f);
        __m128 off4[TILE];
        for (int r = 0; r < R; r++) off4[r] = _mm_setzero_ps();
        for (; b + 4 <= blocks; b += 4) {
            const __m256i raw_a = _mm256_loadu_si256((const __m256i *)(wq + b * 16));
            const __m256i raw_b = _mm256_loadu_si256((const __m256i *)(wq + b * 16 + 32));
            const __m256i c[4] = {
                _mm256_and_si256(raw_a, low), _mm256_and_si256(raw_b, low),
                _mm256_and_si256(_mm256_srli_epi16(raw_a, 4), low),
                _mm256_and_si256(_mm256_srli_epi16(raw_b, 4), low)};
            const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(wd + b)));
            const __m128 m4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(wm + b)));
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * k + b * QK;
                const float *xdr = xd + r * (k / QK) + b, *xsr = xs + r * (k / QK) + b;
                const __m256 s8 = _mm256_castps128_ps256(_mm_mul_ps(d4, _mm_loadu_ps(xdr)));
                off4[r] = _mm_fmadd_ps(m4, _mm_loadu_ps(xsr), off4[r]);
                for (int i = 0; i < 4; i++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i * QK));
                    const __m256 scale = _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(i));
                    acc[r][i & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(c[i], xv)),
                                                    scale, acc[r][i & 1]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            __m128 o = _mm_add_ps(off4[r], _mm_movehl_ps(off4[r], off4[r]));
            o = _mm_add_ss(o, _mm_movehdup_ps(o));
            offset[r] += _mm_cvtss_f32(o);
        }
    }
#else
    {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (; b + 4 <= blocks; b += 4) {
            const __m256i raw_a = _mm256_loadu_si256((const __m256i *)(wq + b * 16));
            const __m256i raw_b = _mm256_loadu_si256((const __m256i *)(wq + b * 16 + 32));
            const __m256i c[4] = {
                _mm256_and_si256(raw_a, low), _mm256_and_si256(raw_b, low),
                _mm256_and_si256(_mm256_srli_epi16(raw_a, 4), low),
                _mm256_and_si256(_mm256_srli_epi16(raw_b, 4), low)};
            for (int r = 0; r < R; r++) {
                const int8_t *x = xq + r * k + b * QK;
                const float *xdr = xd + r * (k / QK) + b, *xsr = xs + r * (k / QK) + b;
                for (int i = 0; i < 4; i++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i * QK));
                    acc[r][i & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(c[i], xv)),
                                                    _mm256_set1_ps(h2f(wd[b + i]) * xdr[i]),
                                                    acc[r][i & 1]);
                    offset[r] += h2f(wm[b + i]) * xsr[i];
                }
            }
        }
    }
#endif
    if (blocks - b >= 2) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(wq + b * 16));
        const __m256i c0 = _mm256_and_si256(raw, low);
        const __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * k + b * QK;
            const float *xdr = xd + r * (k / QK) + b, *xsr = xs + r * (k / QK) + b;
            acc[r][0] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dot_u8s8(c0, _mm256_loadu_si256((const __m256i *)x))),
                _mm256_set1_ps(h2f(wd[b]) * xdr[0]), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dot_u8s8(c1, _mm256_loadu_si256((const __m256i *)(x + QK)))),
                _mm256_set1_ps(h2f(wd[b + 1]) * xdr[1]), acc[r][1]);
            offset[r] += h2f(wm[b]) * xsr[0] + h2f(wm[b + 1]) * xsr[1];
        }
        b += 2;
    }
    if (b < blocks) {
        const __m128i low = _mm_set1_epi8(0x0f);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(wq + b * 16));
        const __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low),
                                           _mm_and_si128(raw, low));
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * QK));
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(c, xv)),
                                        _mm256_set1_ps(h2f(wd[b]) * xd[r * (k / QK) + b]), acc[r][0]);
            offset[r] += h2f(wm[b]) * xs[r * (k / QK) + b];
        }
    }
    for (int r = 0; r < R; r++)
        out[r * out_stride] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + offset[r];
}
#endif

/* The 4-bit code of weight i of block b in a packed row (the portable path). */
static inline int q4_code(const uint8_t *row, int64_t blocks, int64_t b, int i) {
    const int64_t quads = blocks / 4 * 4;
    if (b < quads) {
        const uint8_t byte = row[(b & ~3LL) * 16 + (b & 1) * 32 + i];
        return (b & 2) ? byte >> 4 : byte & 0x0f;
    }
    if (blocks - quads >= 2 && b < quads + 2) {
        const uint8_t byte = row[quads * 16 + i];
        return (b - quads) ? byte >> 4 : byte & 0x0f;
    }
    const uint8_t byte = row[b * 16 + (i & 15)];
    return i < 16 ? byte & 0x0f : byte >> 4;
}

#if defined(CPU_AVX2)
static inline __attribute__((always_inline)) void q8_0_tile(
    const int R, const int8_t *xq, const float *xd, int64_t k, int64_t blocks, const int8_t *w,
    const float *d, float *out, int64_t out_stride) {
    __m256 acc0[TILE], acc1[TILE];
    for (int r = 0; r < R; r++) {
        acc0[r] = _mm256_setzero_ps();
        acc1[r] = _mm256_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + b * QK + QK));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xq + r * k + b * QK;
            const float *xdr = xd + r * blocks + b;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)x);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + QK));
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(a0, _mm256_sign_epi8(x0, w0))),
                                      _mm256_set1_ps(d[b] * xdr[0]), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(a1, _mm256_sign_epi8(x1, w1))),
                                      _mm256_set1_ps(d[b + 1] * xdr[1]), acc1[r]);
        }
    }
    for (; b < blocks; b++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i a0 = _mm256_abs_epi8(w0);
        for (int r = 0; r < R; r++) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * QK));
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(a0, _mm256_sign_epi8(x0, w0))),
                                      _mm256_set1_ps(d[b] * xd[r * blocks + b]), acc0[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * out_stride] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
}
#endif

/* Scratch for the activations' Q8 form, grown as needed; callers are single-threaded. */
static int8_t *scratch_q;
static float *scratch_f;
static int64_t scratch_len;

static int quantize_scratch(const float *x, int64_t rows, int64_t k) {
    if (rows * k > scratch_len) {
        free(scratch_q);
        free(scratch_f);
        scratch_q = (int8_t *)malloc((size_t)(rows * k));
        scratch_f = (float *)malloc(sizeof(float) * (size_t)(2 * rows * k / QK));
        scratch_len = (scratch_q && scratch_f) ? rows * k : 0;
        if (!scratch_len) return -1;
    }
    quantize_rows_q8(x, scratch_q, scratch_f, scratch_f + rows * k / QK, rows, k);
    return 0;
}

/* out[r, n] = sum_k x[r, k] * W[n, k] for x [rows, K] float32, W in Q4_1: qs [N, K/32 * 16]
 * nibbles packed by q4_1_pack, d and m [N, K/32] float16 (as GGUF stores them).
 * x is quantized per 32 to int8 first. Returns -1 when out of memory. */
int q4_1_matmul(const float *x, int64_t rows, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
                int64_t n_out, int64_t k, float *out) {
    if (quantize_scratch(x, rows, k)) return -1;
    const int8_t *xq = scratch_q;
    const int64_t blocks = k / QK;
    const float *xd = scratch_f, *xs = scratch_f + rows * blocks;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *wq = qs + n * blocks * 16;
        const uint16_t *wd = d + n * blocks, *wm = m + n * blocks;
#if defined(CPU_AVX2)
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int64_t left = rows - r0;
            const int8_t *xr = xq + r0 * k;
            const float *dr = xd + r0 * blocks, *sr = xs + r0 * blocks;
            float *o = out + r0 * n_out + n;
            if (left >= 4) q4_1_tile(4, xr, dr, sr, k, blocks, wq, wd, wm, o, n_out);
            else if (left == 3) q4_1_tile(3, xr, dr, sr, k, blocks, wq, wd, wm, o, n_out);
            else if (left == 2) q4_1_tile(2, xr, dr, sr, k, blocks, wq, wd, wm, o, n_out);
            else q4_1_tile(1, xr, dr, sr, k, blocks, wq, wd, wm, o, n_out);
        }
#else
        for (int64_t r = 0; r < rows; r++) {
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *xb = xq + r * k + b * QK;
                int dot = 0;
                for (int i = 0; i < QK; i++) dot += q4_code(wq, blocks, b, i) * xb[i];
                total += h2f(wd[b]) * xd[r * blocks + b] * (float)dot + h2f(wm[b]) * xs[r * blocks + b];
            }
            out[r * n_out + n] = total;
        }
#endif
    }
    return 0;
}

/* out[r, n] = sum_k x[r, k] * W[n, k] for x [rows, K] float32, W in Q8_0: q [N, K] int8,
 * d [N, K/32] float32. Returns -1 when out of memory. */
int q8_0_matmul(const float *x, int64_t rows, const int8_t *wq, const float *wd, int64_t n_out,
                int64_t k, float *out) {
    if (quantize_scratch(x, rows, k)) return -1;
    const int8_t *xq = scratch_q;
    const float *xd = scratch_f;
    const int64_t blocks = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const int8_t *w = wq + n * k;
        const float *d = wd + n * blocks;
#if defined(CPU_AVX2)
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int64_t left = rows - r0;
            const int8_t *xr = xq + r0 * k;
            const float *sr = xd + r0 * blocks;
            float *o = out + r0 * n_out + n;
            if (left >= 4) q8_0_tile(4, xr, sr, k, blocks, w, d, o, n_out);
            else if (left == 3) q8_0_tile(3, xr, sr, k, blocks, w, d, o, n_out);
            else if (left == 2) q8_0_tile(2, xr, sr, k, blocks, w, d, o, n_out);
            else q8_0_tile(1, xr, sr, k, blocks, w, d, o, n_out);
        }
#else
        for (int64_t r = 0; r < rows; r++) {
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int dot = 0;
                for (int i = 0; i < QK; i++) dot += w[b * QK + i] * xq[r * k + b * QK + i];
                total += d[b] * xd[r * blocks + b] * (float)dot;
            }
            out[r * n_out + n] = total;
        }
#endif
    }
    return 0;
}


/* ---------------------------------------------------------------- a whole decoder layer */

/* One Llama-family decoder layer whose four linears are Q4_1, as one call: what a decode step
 * of a few sequences runs 30 times, where per-op overhead from Python would cost more than the
 * arithmetic. Layout and math are those of the single kernels above. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps_attn, eps_mlp, scale;
    int64_t sliding_window; /* 0: none */
    const float *norm_attn, *norm_mlp; /* [hidden] */
    const uint8_t *qkv_q; /* Q4_1 packed [(heads + 2 kv_heads) * head_dim, hidden / 32 * 16] */
    const uint16_t *qkv_d, *qkv_m; /* float16 d and m of each block */
    const float *qkv_bias;          /* NULL: none */
    const uint8_t *o_q;
    const uint16_t *o_d, *o_m;
    const uint8_t *gate_up_q; /* [2 * inter, hidden / 32 * 16]: gate rows, then up rows */
    const uint16_t *gate_up_d, *gate_up_m;
    const uint8_t *down_q;
    const uint16_t *down_d, *down_m;
    /* LoRA adapter slots (gpu/lora.py's LoraSlots), per projection: A transposed
     * [slots, width, in] and B [slots, width, out] float32; NULL: the model has no adapters. */
    const float *qkv_la, *qkv_lb, *o_la, *o_lb, *gate_up_la, *gate_up_lb, *down_la, *down_lb;
    int64_t qkv_lw, o_lw, gate_up_lw, down_lw;
} q4_layer;

typedef struct {
    int64_t tokens; /* one per decoding sequence */
    const float *cos, *sin; /* [tokens, head_dim / 2] */
    const int64_t *slot_mapping; /* [tokens] */
    const int64_t *token_index; /* [tokens]: 0 .. tokens - 1 */
    const int32_t *block_tables; /* [tokens, table_stride] */
    int64_t table_stride;
    const int32_t *context_lens; /* [tokens] */
    int64_t block_size;
    int cache_bf16;
    int64_t lora_n_tiles; /* 0: no row of the step has an adapter */
    const int64_t *lora_tiles; /* [lora_n_tiles + 1]: tiles of <= LORA_TILE rows of one slot */
    const int64_t *lora_rows, *lora_slots; /* [lora_tiles[n]]: each adapter row and its slot */
} decode_step;

#define LORA_MAX_WIDTH 2048 /* parts times rank: the shrunk rows of a tile stay on the stack */
#define LORA_TILE 4          /* rows of one slot per pass over its A and B (lora_add's cases) */

/* The LoRA update's vectors: 16 floats with AVX-512, 8 with AVX2, and how many of A's rows
 * (LORA_WB) one pass over x's tile reads, so that each x load feeds several FMAs. */
#if defined(__AVX512F__)
typedef __m512 lora_vec;
#define LORA_LANES 16
#define LORA_WB 4
#define lora_load _mm512_loadu_ps
#define lora_store _mm512_storeu_ps
#define lora_fma _mm512_fmadd_ps
#define lora_set1 _mm512_set1_ps
#define lora_zero _mm512_setzero_ps
#define lora_sum _mm512_reduce_add_ps
#elif defined(CPU_AVX2)
typedef __m256 lora_vec;
#define LORA_LANES 8
#define LORA_WB 2
#define lora_load _mm256_loadu_ps
#define lora_store _mm256_storeu_ps
#define lora_fma _mm256_fmadd_ps
#define lora_set1 _mm256_set1_ps
#define lora_zero _mm256_setzero_ps
#define lora_sum hsum8
#endif

/* One tile of `count` rows of the same adapter slot: t[j][w] = x[row j] . at[w] (the shrink,
 * `at` the slot's A transposed, [width, in]), then out[row j] += t[j] @ b (the expand, b
 * [width, n_out]). A row of `at` that is zero (past the adapter's rank) gives t = 0, and its
 * row of b is not read. Inlined with a constant `count`, its accumulators stay in registers. */
static inline __attribute__((always_inline)) void lora_tile(
    const int count, const float *at, const float *b, int64_t width, const int64_t *rows,
    const float *x, int64_t in, float *out, int64_t n_out) {
    float t[LORA_TILE][LORA_MAX_WIDTH];
    const float *xr[LORA_TILE];
    for (int j = 0; j < count; j++) xr[j] = x + rows[j] * in;
    int64_t w = 0;
#if defined(LORA_LANES)
    for (; w + LORA_WB <= width; w += LORA_WB) { /* in: a multiple of 32 (the Q4_1 block) */
        lora_vec acc[LORA_TILE][LORA_WB];
        for (int j = 0; j < count; j++)
            for (int q = 0; q < LORA_WB; q++) acc[j][q] = lora_zero();
        for (int64_t i = 0; i < in; i += LORA_LANES) {
            lora_vec a[LORA_WB];
            for (int q = 0; q < LORA_WB; q++) a[q] = lora_load(at + (w + q) * in + i);
            for (int j = 0; j < count; j++) {
                const lora_vec xv = lora_load(xr[j] + i);
                for (int q = 0; q < LORA_WB; q++) acc[j][q] = lora_fma(xv, a[q], acc[j][q]);
            }
        }
        for (int j = 0; j < count; j++)
            for (int q = 0; q < LORA_WB; q++) t[j][w + q] = lora_sum(acc[j][q]);
    }
#endif
    for (; w < width; w++)
        for (int j = 0; j < count; j++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < in; i++) sum += xr[j][i] * at[w * in + i];
            t[j][w] = sum;
        }
    int live[LORA_MAX_WIDTH], n_live = 0; /* the rows of b some row of the tile needs */
    for (int64_t v = 0; v < width; v++) {
        int any = 0;
        for (int j = 0; j < count; j++) any |= t[j][v] != 0.0f;
        if (any) live[n_live++] = (int)v;
    }
    int64_t c = 0;
#if defined(LORA_LANES)
    for (; c + 2 * LORA_LANES <= n_out; c += 2 * LORA_LANES) { /* b's slice stays in L1 */
        lora_vec lo[LORA_TILE], hi[LORA_TILE];
        for (int j = 0; j < count; j++) {
            lo[j] = lora_load(out + rows[j] * n_out + c);
            hi[j] = lora_load(out + rows[j] * n_out + c + LORA_LANES);
        }
        for (int k = 0; k < n_live; k++) {
            const float *bw = b + live[k] * n_out + c;
            const lora_vec b_lo = lora_load(bw), b_hi = lora_load(bw + LORA_LANES);
            for (int j = 0; j < count; j++) {
                const lora_vec tw = lora_set1(t[j][live[k]]);
                lo[j] = lora_fma(tw, b_lo, lo[j]);
                hi[j] = lora_fma(tw, b_hi, hi[j]);
            }
        }
        for (int j = 0; j < count; j++) {
            lora_store(out + rows[j] * n_out + c, lo[j]);
            lora_store(out + rows[j] * n_out + c + LORA_LANES, hi[j]);
        }
    }
#endif
    for (; c < n_out; c++)
        for (int j = 0; j < count; j++) {
            float sum = out[rows[j] * n_out + c];
            for (int k = 0; k < n_live; k++) sum += t[j][live[k]] * b[live[k] * n_out + c];
            out[rows[j] * n_out + c] = sum;
        }
}

/* out[r] += (x[r] @ A[slot]) @ B[slot] for each of the step's adapter rows r (Punica's shrink
 * and expand), x [tokens, in] and out [tokens, n_out], at [slots, width, in] (A transposed)
 * and b [slots, width, n_out]. The rows come grouped by slot, in tiles of up to LORA_TILE rows
 * of one slot (`lora_tiles`: each tile's first row, then the end), so each pass over a slot's
 * weights serves several rows. Base rows cost nothing. */
static void lora_add(const float *at, const float *b, int64_t width, const decode_step *s,
                     const float *x, int64_t in, float *out, int64_t n_out) {
    if (!at || s->lora_n_tiles == 0) return;
#pragma omp parallel for schedule(static) if (s->lora_n_tiles > 1)
    for (int64_t k = 0; k < s->lora_n_tiles; k++) {
        const int64_t first = s->lora_tiles[k], count = s->lora_tiles[k + 1] - first;
        const int64_t slot = s->lora_slots[first];
        const float *as = at + slot * width * in, *bs = b + slot * width * n_out;
        const int64_t *rows = s->lora_rows + first;
        switch (count) { /* a constant count per case: the tile's accumulators in registers */
        case 4: lora_tile(4, as, bs, width, rows, x, in, out, n_out); break;
        case 3: lora_tile(3, as, bs, width, rows, x, in, out, n_out); break;
        case 2: lora_tile(2, as, bs, width, rows, x, in, out, n_out); break;
        default: lora_tile(1, as, bs, width, rows, x, in, out, n_out); break;
        }
    }
}

int q4_1_gemm(const float *x, int64_t rows, const uint8_t *codes, const uint16_t *d,
              const uint16_t *m, int64_t n_out, int64_t k, float *out);

/* The Q4_1 matmul of this build's weight layout: many-row (q4_1_gemm_pack) with AVX2 and up,
 * row-at-a-time (q4_1_pack) in the portable build. */
static int q4_linear(const float *x, int64_t rows, const uint8_t *codes, const uint16_t *d,
                     const uint16_t *m, int64_t n_out, int64_t k, float *out) {
#if defined(GEMM_LAYOUT)
    return q4_1_gemm(x, rows, codes, d, m, n_out, k, out);
#else
    return q4_1_matmul(x, rows, codes, d, m, n_out, k, out);
#endif
}

static float *layer_scratch;
static int64_t layer_scratch_len;

/* x: [tokens, hidden], the previous layer's output (the embeddings when first), replaced by
 * this layer's output; residual: [tokens, hidden], the stream before x is added (set when
 * first). Returns -1 when out of memory. */
static float *grow_scratch(int64_t need) {
    if (need > layer_scratch_len) {
        free(layer_scratch);
        layer_scratch = (float *)malloc(sizeof(float) * (size_t)need);
        layer_scratch_len = layer_scratch ? need : 0;
    }
    return layer_scratch;
}

/* The layer up to attention: norm (with the residual add), qkv (+ bias), RoPE and the KV write.
 * qkv: [tokens, (heads + 2 kv_heads) * head_dim], the caller's. Returns -1 when out of memory. */
int q4_layer_attn_in(const q4_layer *w, const decode_step *s, void *k_cache, void *v_cache,
                     float *x, float *residual, int first, float *qkv) {
    const int64_t t = s->tokens, hidden = w->hidden;
    const int64_t qkv_width = (w->heads + 2 * w->kv_heads) * w->head_dim;
    float *h = grow_scratch(t * (hidden + 3 * w->inter));
    if (!h) return -1;
    if (first) {
        memcpy(residual, x, sizeof(float) * (size_t)(t * hidden));
        rms_norm_f32(residual, w->norm_attn, h, t, hidden, w->eps_attn);
    } else {
        add_rms_norm_f32(residual, x, w->norm_attn, h, t, hidden, w->eps_attn);
    }
    if (q4_linear(h, t, w->qkv_q, w->qkv_d, w->qkv_m, qkv_width, hidden, qkv)) return -1;
    if (w->qkv_bias)
        for (int64_t r = 0; r < t; r++)
            for (int64_t i = 0; i < qkv_width; i++) qkv[r * qkv_width + i] += w->qkv_bias[i];
    lora_add(w->qkv_la, w->qkv_lb, w->qkv_lw, s, h, hidden, qkv, qkv_width);
    rope_write_kv(qkv, t, s->cos, s->sin, w->heads, w->kv_heads, w->head_dim, s->slot_mapping,
                  k_cache, v_cache, s->cache_bf16);
    return 0;
}

/* The layer after attention: o, norm (with the residual add), gate_up, SwiGLU, down.
 * attn: [tokens, heads * head_dim]; x receives the layer's output. */
int q4_layer_attn_out(const q4_layer *w, const decode_step *s, const float *attn, float *x,
                      float *residual) {
    const int64_t t = s->tokens, hidden = w->hidden, q_size = w->heads * w->head_dim;
    const int64_t inter = w->inter;
    float *h = grow_scratch(t * (hidden + 3 * inter));
    if (!h) return -1;
    float *gate_up = h + t * hidden, *act = gate_up + t * 2 * inter;
    if (q4_linear(attn, t, w->o_q, w->o_d, w->o_m, hidden, q_size, x)) return -1;
    lora_add(w->o_la, w->o_lb, w->o_lw, s, attn, q_size, x, hidden);
    add_rms_norm_f32(residual, x, w->norm_mlp, h, t, hidden, w->eps_mlp);
    if (q4_linear(h, t, w->gate_up_q, w->gate_up_d, w->gate_up_m, 2 * inter, hidden, gate_up))
        return -1;
    lora_add(w->gate_up_la, w->gate_up_lb, w->gate_up_lw, s, h, hidden, gate_up, 2 * inter);
    silu_mul_f32(gate_up, act, t, inter);
    if (q4_linear(act, t, w->down_q, w->down_d, w->down_m, hidden, inter, x)) return -1;
    lora_add(w->down_la, w->down_lb, w->down_lw, s, act, inter, x, hidden);
    return 0;
}

/* A whole layer for a step of decodes only (row s of the step is sequence s's one token).
 * qkv and attn: the caller's buffers, as for the two halves. */
int q4_decode_layer(const q4_layer *w, const decode_step *s, void *k_cache, void *v_cache,
                    float *x, float *residual, int first, float *qkv, float *attn) {
    const int64_t q_size = w->heads * w->head_dim;
    const int64_t qkv_width = q_size + 2 * w->kv_heads * w->head_dim;
    if (q4_layer_attn_in(w, s, k_cache, v_cache, x, residual, first, qkv)) return -1;
    if (paged_decode_attention(qkv, qkv_width, s->token_index, s->tokens, s->block_tables,
                               s->table_stride, s->context_lens, k_cache, v_cache, s->cache_bf16,
                               s->block_size, w->heads, w->kv_heads, w->head_dim, w->scale,
                               w->sliding_window, attn, q_size))
        return -1;
    return q4_layer_attn_out(w, s, attn, x, residual);
}

/* ---------------------------------------------------------------- Q4_1 for many rows */

/* For prefill chunks and large decode batches the row-at-a-time kernel above spends most of its
 * work converting each block's integer dot to float. This layout puts 16 output channels in the
 * lanes of a vector instead: per block, 8 VNNI instructions (each 16 channels x 4 weights,
 * against 4 activation bytes broadcast) give 16 integer dots, then one convert and two FMAs
 * apply the 16 scales and minimums. Rows of N are grouped by 16 (the last group padded):
 *   codes [N/16, B, 4, 64] uint8: vector z of block b, byte 4 * l + i: low nibble = weight
 *     (16 g + l, 32 b + 4 z + i), high nibble = weight (16 g + l, 32 b + 4 (z + 4) + i);
 *   d, m [N/16, B, 16] float16. */
void q4_1_gemm_pack(const uint8_t *gguf, const uint16_t *d, const uint16_t *m, int64_t n_out,
                    int64_t blocks, uint8_t *codes, uint16_t *d_out, uint16_t *m_out) {
    const int64_t groups = (n_out + 15) / 16;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = codes + (g * blocks + b) * 256;
            for (int l = 0; l < 16; l++) {
                const int64_t n = g * 16 + l;
                const int valid = n < n_out;
                const uint8_t *src = gguf + (n * blocks + b) * 16;
                uint8_t w[32];
                for (int j = 0; j < 16; j++) {
                    w[j] = valid ? (src[j] & 0x0f) : 0;
                    w[j + 16] = valid ? (src[j] >> 4) : 0;
                }
                for (int z = 0; z < 4; z++)
                    for (int i = 0; i < 4; i++)
                        dst[z * 64 + l * 4 + i] =
                            (uint8_t)(w[4 * z + i] | (w[4 * (z + 4) + i] << 4));
                d_out[(g * blocks + b) * 16 + l] = valid ? d[n * blocks + b] : 0;
                m_out[(g * blocks + b) * 16 + l] = valid ? m[n * blocks + b] : 0;
            }
        }
}

int q4_1_gemm_available(void) { /* 1: the weight layout is q4_1_gemm_pack's */
#if defined(GEMM_LAYOUT)
    return 1;
#else
    return 0;
#endif
}

#if defined(Q4_ZMM)
#define WEIGHT_PREFETCH 16 /* blocks ahead */
#define GEMM_ROWS 8 /* rows per tile: the unpacked weights are reused by 8 rows, 16 VNNI chains */
static inline __attribute__((always_inline)) void q4_gemm_tile(
    const int R, const int8_t *xq, const float *xd, const float *xs, int64_t k, int64_t blocks,
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, float *out, int64_t n_out,
    int64_t n0) {
    __m512 acc[GEMM_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = codes + b * 256;
        /* The weights stream from DRAM once per step: keep more lines in flight than the L1 fill
         * buffers allow by prefetching into L2 (past the group's end is the next group: the
         * thread's next one under static scheduling; prefetches never fault). */
        for (int z = 0; z < 4; z++)
            _mm_prefetch((const char *)(wb + WEIGHT_PREFETCH * 256 + z * 64), _MM_HINT_T1);
        if ((b & 1) == 0) {
            _mm_prefetch((const char *)(d + (b + WEIGHT_PREFETCH) * 16), _MM_HINT_T1);
            _mm_prefetch((const char *)(m + (b + WEIGHT_PREFETCH) * 16), _MM_HINT_T1);
        }
        __m512i c[8];
        for (int z = 0; z < 4; z++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(wb + z * 64));
            c[z] = _mm512_and_si512(raw, low);
            c[z + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * 16)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * 16)));
        for (int r = 0; r < R; r++) {
            const int32_t *x = (const int32_t *)(xq + r * k + b * QK);
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                even = _mm512_dpbusd_epi32(even, c[j], _mm512_set1_epi32(x[j]));
                odd = _mm512_dpbusd_epi32(odd, c[j + 1], _mm512_set1_epi32(x[j + 1]));
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * blocks + b])),
                                     acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * blocks + b]), acc[r]);
        }
    }
    const int64_t left = n_out - n0;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * n_out + n0, mask, acc[r]);
}
#elif defined(CPU_AVX2)
#define WEIGHT_PREFETCH 32 /* blocks ahead: 8 KB, 1.15x over 16 for a GEMV of 47 MB here */
#define GEMM_ROWS 4 /* rows per tile: their 2 x 4 int16 sums and 2 x 4 accumulators */

/* Rows n0 + 8 h .. n0 + 8 h + 7 of out (of those below n_out), from the half's acc. */
static inline __attribute__((always_inline)) void store_half(float *out, int64_t left,
                                                             __m256 acc) {
    if (left >= 8) {
        _mm256_storeu_ps(out, acc);
    } else {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), lanes), acc);
    }
}

/* The AVX2 form of the tile above (with 256-bit VNNI, DPBUSD256, one vpdpbusd per 4 weights
 * instead of the maddubs sums): a 256-bit vector holds 8 of the group's 16 channels (bytes
 * [32 h, 32 h + 32) of each 64-byte vector z are channels 8 h .. 8 h + 7). Each vector z is
 * unpacked once for the tile's rows, and each row's 4 activation bytes, broadcast once, feed
 * both halves. Per block, row and half, 8 vpmaddubsw (8 channels x 4 weights each, codes 0..15
 * against signed bytes) are summed in int16 (|sum| <= 8 * 2 * 15 * 127 = 30480: exact) and
 * widened once by vpmaddwd. The integer dot and the float steps after it are those of the VNNI
 * tile: the same bits at every level. */
static inline __attribute__((always_inline)) void q4_gemm_tile(
    const int R, const int8_t *xq, const float *xd, const float *xs, int64_t k, int64_t blocks,
    const uint8_t *codes, const uint16_t *d, const uint16_t *m, float *out, int64_t n_out,
    int64_t n0) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[GEMM_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = codes + b * 256;
        for (int z = 0; z < 4; z++)
            _mm_prefetch((const char *)(wb + WEIGHT_PREFETCH * 256 + z * 64), _MM_HINT_T1);
        if ((b & 1) == 0) {
            _mm_prefetch((const char *)(d + (b + WEIGHT_PREFETCH) * 16), _MM_HINT_T1);
            _mm_prefetch((const char *)(m + (b + WEIGHT_PREFETCH) * 16), _MM_HINT_T1);
        }
        __m256i sum[GEMM_ROWS][2];
        for (int z = 0; z < 4; z++) {
            const __m256i raw0 = _mm256_loadu_si256((const __m256i *)(wb + z * 64));
            const __m256i raw1 = _mm256_loadu_si256((const __m256i *)(wb + z * 64 + 32));
            const __m256i lo0 = _mm256_and_si256(raw0, low), lo1 = _mm256_and_si256(raw1, low);
            const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low);
            const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low);
            for (int r = 0; r < R; r++) {
                const int32_t *x = (const int32_t *)(xq + r * k + b * QK);
                const __m256i xl = _mm256_set1_epi32(x[z]), xh = _mm256_set1_epi32(x[z + 4]);
#if defined(DPBUSD256) /* int32 sums: the dot itself */
                const __m256i zero = _mm256_setzero_si256();
                sum[r][0] = DPBUSD256(DPBUSD256(z ? sum[r][0] : zero, lo0, xl), hi0, xh);
                sum[r][1] = DPBUSD256(DPBUSD256(z ? sum[r][1] : zero, lo1, xl), hi1, xh);
#else
                const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh));
                const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh));
                sum[r][0] = z ? _mm256_add_epi16(sum[r][0], p0) : p0;
                sum[r][1] = z ? _mm256_add_epi16(sum[r][1], p1) : p1;
#endif
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * 16 + h * 8)));
            const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b * 16 + h * 8)));
            for (int r = 0; r < R; r++) {
#if defined(DPBUSD256)
                const __m256 dot = _mm256_cvtepi32_ps(sum[r][h]);
#else
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][h], ones));
#endif
                acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * blocks + b])), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * blocks + b]), acc[r][h]);
            }
        }
    }
    for (int h = 0; h < 2 && n0 + 8 * h < n_out; h++)
        for (int r = 0; r < R; r++) store_half(out + r * n_out + n0 + 8 * h, n_out - n0 - 8 * h, acc[r][h]);
}
#endif

/* out [rows, N] = x [rows, K] @ W.T with W packed by q4_1_gemm_pack. -1: out of memory or no
 * many-row layout in this build (q4_1_gemm_available). */
int q4_1_gemm(const float *x, int64_t rows, const uint8_t *codes, const uint16_t *d,
              const uint16_t *m, int64_t n_out, int64_t k, float *out) {
#if defined(GEMM_LAYOUT)
    if (quantize_scratch(x, rows, k)) return -1;
    const int64_t blocks = k / QK, groups = (n_out + 15) / 16;
    const int8_t *xq = scratch_q;
    const float *xd = scratch_f, *xs = scratch_f + rows * blocks;
    const int64_t tiles = (rows + GEMM_ROWS - 1) / GEMM_ROWS;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r0 = t * GEMM_ROWS, left = rows - r0;
            const uint8_t *cg = codes + g * blocks * 256;
            const uint16_t *dg = d + g * blocks * 16, *mg = m + g * blocks * 16;
            const int8_t *xr = xq + r0 * k;
            const float *dr = xd + r0 * blocks, *sr = xs + r0 * blocks;
            float *o = out + r0 * n_out;
            switch (left >= GEMM_ROWS ? GEMM_ROWS : left) {
#define Q4_TILE_CASE(R) \
    case R: q4_gemm_tile(R, xr, dr, sr, k, blocks, cg, dg, mg, o, n_out, g * 16); break;
#if GEMM_ROWS == 8
                Q4_TILE_CASE(8) Q4_TILE_CASE(7) Q4_TILE_CASE(6) Q4_TILE_CASE(5)
#endif
                Q4_TILE_CASE(4) Q4_TILE_CASE(3) Q4_TILE_CASE(2) Q4_TILE_CASE(1)
#undef Q4_TILE_CASE
            }
        }
    return 0;
#else
    (void)x, (void)rows, (void)codes, (void)d, (void)m, (void)n_out, (void)k, (void)out;
    return -1;
#endif
}

/* Q8_0 (the LM head's format) in the same 16-channels-per-vector layout:
 *   codes [N/16, B, 8, 64] int8: vector z of block b, byte 4 * l + i = weight (16 g + l, 32 b + 4 z + i);
 *   d [N/16, B, 16] float16; corr [N/16, B, 16] int32 = 128 * (sum of the block's 32 weights).
 * VNNI multiplies unsigned by signed bytes, so activations go in as x + 128 and corr takes the
 * 128 * sum(w) that adds back out. */
void q8_0_gemm_pack(const int8_t *w, const uint16_t *d, int64_t n_out, int64_t blocks,
                    int8_t *codes, uint16_t *d_out, int32_t *corr) {
    const int64_t groups = (n_out + 15) / 16;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < blocks; b++) {
            int8_t *dst = codes + (g * blocks + b) * 512;
            for (int l = 0; l < 16; l++) {
                const int64_t n = g * 16 + l;
                const int valid = n < n_out;
                const int8_t *src = w + (n * blocks + b) * QK;
                int32_t sum = 0;
                for (int z = 0; z < 8; z++)
                    for (int i = 0; i < 4; i++) {
                        const int8_t v = valid ? src[4 * z + i] : 0;
                        dst[z * 64 + l * 4 + i] = v;
                        sum += v;
                    }
                d_out[(g * blocks + b) * 16 + l] = valid ? d[n * blocks + b] : 0;
                corr[(g * blocks + b) * 16 + l] = 128 * sum;
            }
        }
}

#if defined(Q4_ZMM)
static inline __attribute__((always_inline)) void q8_gemm_tile(
    const int R, const int8_t *xq, const float *xd, int64_t k, int64_t blocks,
    const int8_t *codes, const uint16_t *d, const int32_t *corr, float *out, int64_t n_out,
    int64_t n0) {
    __m512 acc[GEMM_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *wb = codes + b * 512;
        for (int z = 0; z < 8; z++)
            _mm_prefetch((const char *)(wb + WEIGHT_PREFETCH * 512 + z * 64), _MM_HINT_T1);
        if ((b & 1) == 0) _mm_prefetch((const char *)(d + (b + WEIGHT_PREFETCH) * 16), _MM_HINT_T1);
        if ((b & 3) == 0) _mm_prefetch((const char *)(corr + (b + WEIGHT_PREFETCH) * 16), _MM_HINT_T1);
        __m512i c[8];
        for (int z = 0; z < 8; z++) c[z] = _mm512_loadu_si512((const void *)(wb + z * 64));
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * 16)));
        const __m512i cv = _mm512_loadu_si512((const void *)(corr + b * 16));
        for (int r = 0; r < R; r++) {
            const int32_t *x = (const int32_t *)(xq + r * k + b * QK);
            const __m512i flip = _mm512_set1_epi32((int32_t)0x80808080u);
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                even = _mm512_dpbusd_epi32(
                    even, _mm512_xor_si512(_mm512_set1_epi32(x[j]), flip), c[j]);
                odd = _mm512_dpbusd_epi32(
                    odd, _mm512_xor_si512(_mm512_set1_epi32(x[j + 1]), flip), c[j + 1]);
            }
            const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(even, odd), cv);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * blocks + b])), acc[r]);
        }
    }
    const int64_t left = n_out - n0;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * n_out + n0, mask, acc[r]);
}
#elif defined(CPU_AVX2)
/* The AVX2 form, in halves as q4_gemm_tile's. vpmaddubsw wants one unsigned operand: the
 * weights' magnitudes, against the activations with the weights' signs (vpsignb), as llama.cpp
 * does; pairs reach 2 * 128 * 127, so each is widened at once and summed in int32. That dot is
 * exactly the VNNI tile's (which subtracts corr), so the bits are the same. With 256-bit VNNI
 * (DPBUSD256) the tile does what the 512-bit one does, in halves. */
static inline __attribute__((always_inline)) void q8_gemm_tile(
    const int R, const int8_t *xq, const float *xd, int64_t k, int64_t blocks,
    const int8_t *codes, const uint16_t *d, const int32_t *corr, float *out, int64_t n_out,
    int64_t n0) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    (void)ones, (void)flip, (void)corr;
    __m256 acc[GEMM_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *wb = codes + b * 512;
        for (int z = 0; z < 8; z++)
            _mm_prefetch((const char *)(wb + WEIGHT_PREFETCH * 512 + z * 64), _MM_HINT_T1);
        if ((b & 1) == 0) _mm_prefetch((const char *)(d + (b + WEIGHT_PREFETCH) * 16), _MM_HINT_T1);
        __m256i sum[GEMM_ROWS][2];
        for (int z = 0; z < 8; z++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + z * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + z * 64 + 32));
#if !defined(DPBUSD256)
            const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#endif
            for (int r = 0; r < R; r++) {
                const __m256i xb = _mm256_set1_epi32(((const int32_t *)(xq + r * k + b * QK))[z]);
#if defined(DPBUSD256) /* the VNNI tile's way: x + 128 unsigned, corr taken off below */
                const __m256i xu = _mm256_xor_si256(xb, flip), zero = _mm256_setzero_si256();
                sum[r][0] = DPBUSD256(z ? sum[r][0] : zero, xu, w0);
                sum[r][1] = DPBUSD256(z ? sum[r][1] : zero, xu, w1);
#else
                const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones);
                const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones);
                sum[r][0] = z ? _mm256_add_epi32(sum[r][0], p0) : p0;
                sum[r][1] = z ? _mm256_add_epi32(sum[r][1], p1) : p1;
#endif
            }
        }
#if defined(DPBUSD256)
        for (int h = 0; h < 2; h++) {
            const __m256i cv = _mm256_loadu_si256((const __m256i *)(corr + b * 16 + h * 8));
            for (int r = 0; r < R; r++) sum[r][h] = _mm256_sub_epi32(sum[r][h], cv);
        }
#endif
        for (int h = 0; h < 2; h++) {
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * 16 + h * 8)));
            for (int r = 0; r < R; r++)
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]),
                                            _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * blocks + b])), acc[r][h]);
        }
    }
    for (int h = 0; h < 2 && n0 + 8 * h < n_out; h++)
        for (int r = 0; r < R; r++) store_half(out + r * n_out + n0 + 8 * h, n_out - n0 - 8 * h, acc[r][h]);
}
#endif

/* out [rows, N] = x [rows, K] @ W.T with W packed by q8_0_gemm_pack. -1: out of memory or no
 * many-row layout in this build. */
int q8_0_gemm(const float *x, int64_t rows, const int8_t *codes, const uint16_t *d,
              const int32_t *corr, int64_t n_out, int64_t k, float *out) {
#if defined(GEMM_LAYOUT)
    if (quantize_scratch(x, rows, k)) return -1;
    const int64_t blocks = k / QK, groups = (n_out + 15) / 16;
    const int8_t *xq = scratch_q;
    const float *xd = scratch_f;
    const int64_t tiles = (rows + GEMM_ROWS - 1) / GEMM_ROWS;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r0 = t * GEMM_ROWS, left = rows - r0;
            const int8_t *cg = codes + g * blocks * 512;
            const uint16_t *dg = d + g * blocks * 16;
            const int32_t *kg = corr + g * blocks * 16;
            const int8_t *xr = xq + r0 * k;
            const float *sr = xd + r0 * blocks;
            float *o = out + r0 * n_out;
            switch (left >= GEMM_ROWS ? GEMM_ROWS : left) {
#define Q8_TILE_CASE(R) \
    case R: q8_gemm_tile(R, xr, sr, k, blocks, cg, dg, kg, o, n_out, g * 16); break;
#if GEMM_ROWS == 8
                Q8_TILE_CASE(8) Q8_TILE_CASE(7) Q8_TILE_CASE(6) Q8_TILE_CASE(5)
#endif
                Q8_TILE_CASE(4) Q8_TILE_CASE(3) Q8_TILE_CASE(2) Q8_TILE_CASE(1)
#undef Q8_TILE_CASE
            }
        }
    return 0;
#else
    (void)x, (void)rows, (void)codes, (void)d, (void)corr, (void)n_out, (void)k, (void)out;
    return -1;
#endif
}

/* ---------------------------------------------------------------- paged prefill attention */

/* Causal attention of one sequence's chunk of `queries` new tokens (the last ones of its
 * `context` positions) over its paged cache: q rows q + r * q_stride, [heads, dim]; out rows
 * likewise with out_stride. Each row is attended as a decode of its position (context_lens of
 * pos + 1, the chunk's rows sharing one block table), through paged_decode_attention: a
 * token's attention has the same bits whether it was prefilled in any chunk, recomputed after
 * a preemption or a restart, or decoded, at every ISA level, so that a prefix-cache hit or a
 * recovered request writes the greedy text an uninterrupted run writes. From AVX2 up the rows'
 * shared keys make them one work item per ATTEND_VECTORS query vectors, each key converted
 * once for all of them. Returns -1 when out of memory. */
int paged_prefill_attention(const float *q, int64_t q_stride, int64_t queries, int64_t context,
                            const int32_t *block_table, const void *k_cache, const void *v_cache,
                            int cache_bf16, int64_t block_size, int64_t heads, int64_t kv_heads,
                            int64_t dim, float scale, int64_t window, float *out,
                            int64_t out_stride) {
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)queries);
    int32_t *lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)queries);
    int status = -1;
    if (rows && lens) {
        for (int64_t r = 0; r < queries; r++) {
            rows[r] = r;
            lens[r] = (int32_t)(context - queries + r + 1);
        }
        status = paged_decode_attention(q, q_stride, rows, queries, block_table, 0, lens, k_cache,
                                        v_cache, cache_bf16, block_size, heads, kv_heads, dim,
                                        scale, window, out, out_stride);
    }
    free(rows);
    free(lens);
    return status;
}

/* ---------------------------------------------------------------- the kernels' bounds */

/* The bounds `pipeline-bench model` measures the kernels against, on this build's threads. */

/* A read of `words` 64-bit words (the packed weights a decode step streams), as STREAM's read
 * test: each thread XORs a contiguous part into four chains, prefetching 8 KB ahead into L2 as
 * the GEMM tiles do (without it a read of cache-resident weights is slower than the kernels
 * reading them). Returns the XOR, so that the reads are not optimized away; the caller times it. */
uint64_t stream_read(const uint64_t *data, int64_t words) {
    uint64_t total = 0;
#pragma omp parallel reduction(^ : total)
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t lo = words * t / n, hi = words * (t + 1) / n;
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        int64_t i = lo;
        for (; i + 8 <= hi; i += 8) { /* one 64-byte line */
            __builtin_prefetch(data + i + 1024, 0, 2);
            a0 ^= data[i] ^ data[i + 4];
            a1 ^= data[i + 1] ^ data[i + 5];
            a2 ^= data[i + 2] ^ data[i + 6];
            a3 ^= data[i + 3] ^ data[i + 7];
        }
        for (; i < hi; i++) a0 ^= data[i];
        total ^= a0 ^ a1 ^ a2 ^ a3;
    }
    return total;
}

/* int8 multiply-adds per second of this build's GEMM instruction with every operand in
 * registers: 512-bit vpdpbusd (64 a instruction) with AVX-512 VNNI, 256-bit vpdpbusd (32) with
 * AVX-VNNI, 256-bit vpmaddubsw (32) with AVX2, 0 in the portable build (no integer dot instruction to bound it). 12 independent
 * chains per thread hide the latency; the loop cannot be folded, each result feeding the next. */
double int8_peak_macs(int64_t iterations) {
#if defined(GEMM_LAYOUT)
    const double start = omp_get_wtime();
    int32_t sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
#if defined(Q4_ZMM)
        __m512i a[12];
        const __m512i c = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
        for (int j = 0; j < 12; j++) a[j] = _mm512_set1_epi32(j);
        for (int64_t i = 0; i < iterations; i++)
            for (int j = 0; j < 12; j++) a[j] = _mm512_dpbusd_epi32(a[j], c, x);
        __m512i r = a[0];
        for (int j = 1; j < 12; j++) r = _mm512_xor_si512(r, a[j]);
        sink += _mm512_reduce_add_epi32(r);
#elif defined(DPBUSD256)
        __m256i a[12];
        const __m256i c = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
        for (int j = 0; j < 12; j++) a[j] = _mm256_set1_epi32(j);
        for (int64_t i = 0; i < iterations; i++)
            for (int j = 0; j < 12; j++) a[j] = DPBUSD256(a[j], c, x);
        __m256i r = a[0];
        for (int j = 1; j < 12; j++) r = _mm256_xor_si256(r, a[j]);
        sink += _mm256_extract_epi32(r, 0);
#else
        __m256i a[12];
        const __m256i x = _mm256_set1_epi8(5);
        for (int j = 0; j < 12; j++) a[j] = _mm256_set1_epi8((char)j);
        for (int64_t i = 0; i < iterations; i++)
            for (int j = 0; j < 12; j++) a[j] = _mm256_maddubs_epi16(a[j], x);
        __m256i r = a[0];
        for (int j = 1; j < 12; j++) r = _mm256_xor_si256(r, a[j]);
        sink += _mm256_extract_epi32(r, 0);
#endif
    }
    const double seconds = omp_get_wtime() - start;
#if defined(Q4_ZMM)
    const double per = 64.0;
#else
    const double per = 32.0;
#endif
    const double total = (double)omp_get_max_threads() * (double)iterations * 12.0 * per;
    (void)sink;
    return seconds > 0.0 ? total / seconds : 0.0;
#else
    (void)iterations;
    return 0.0;
#endif
}

/* Query vectors (query heads per KV head) an attention work item holds at most. */
int attend_vectors(void) { return ATTEND_VECTORS; }

/* Each thread of the OpenMP pool onto one CPU: thread t onto cpus[t % n] (--cpu-threads-bind,
 * as vLLM's CPU backend binds its OpenMP threads). Returns the threads bound; -1 if the OS
 * refused one (a CPU outside the process's mask). */
int bind_threads(const int32_t *cpus, int64_t n) {
#if defined(__linux__)
    int bound = 0, failed = 0;
#pragma omp parallel reduction(+ : bound, failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num() % n], &set);
        if (sched_setaffinity(0, sizeof set, &set) == 0) bound += 1;
        else failed += 1;
    }
    return failed ? -1 : bound;
#else
    (void)cpus, (void)n;
    return 0;
#endif
}
