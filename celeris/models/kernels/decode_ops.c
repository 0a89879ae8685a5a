/* The small float32 operators between a decoding pass's matrix products, for models whose linears run on the GGUF
 * block kernel (celeris.models.fast_ops): RMSNorm, SwiGLU's silu(gate) * up, and attention of a few queries over a
 * KV cache. Between products that stream megabytes of weights, PyTorch's many small operator calls run with cold
 * caches (several times their warm cost); these few loops replace them. Built with gguf_blocks.c into one library
 * (celeris/models/kernels/__init__.py). Every function reads float32 rows whose last dimension is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* e^x for float32 x, within 2 ulp of expf over [-87, 88] (below: 0; above: clamped), written without branches
 * so that loops over it vectorize (glibc's expf does not, without -ffast-math): Cody-Waite reduction
 * x = n ln2 + r, |r| <= ln2 / 2, a degree-6 Taylor polynomial of e^r, and 2^n put into the exponent bits. */
static inline float exp_fast(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, r < rows (Zhang & Sennrich, arXiv:1910.07467). */
void celeris_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = xr[i] * inv * w[i];
    }
}

/* out[r] = the index of the largest of x[r * n .. r * n + n), the first one where several are equal, a NaN counting
 * as larger than any number (the first NaN): torch.argmax's rule. Two passes over a row: its largest value (or
 * whether it holds a NaN), then the first index holding it (16 or 8 compared at a time). */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0;
    float top = -INFINITY;
    int nan = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    nan = unordered != 0;
    top = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
#endif
    for (; i < n; i++) {
        nan |= isnan(x[i]);
        top = x[i] > top ? x[i] : top;
    }
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 want = _mm512_set1_ps(top);
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, want, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    const __m256 want = _mm256_set1_ps(top);
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz(hit);
    }
#endif
    for (; j < n; j++)  /* the tail; the whole row without SIMD (x == top: the same rule as the vector compare) */
        if (nan ? isnan(x[j]) : x[j] == top) return j;
    return 0;  /* n == 0 */
}

void celeris_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}

/* y - f * c then - p * (c > 0): apply_penalties' float operations on one entry (f, p: 0 and unused when absent). */
static inline float penalize_entry(float x, float c, int has_f, float f, int has_p, float p) {
    if (has_f) x = x - f * c;
    if (has_p) x = x - p * (c > 0.0f ? 1.0f : 0.0f);
    return x;
}

/* Greedy decoding's commit in one pass over a row: y = x[r] - fp[r] * c[r] (when fp is not NULL), then
 * y -= pp[r] * (c[r] > 0) (when pp is not NULL), the ids banned[0 .. nbanned) set to -inf, out[r] = argmax(y)
 * (argmax_row's rule: torch's) and value[r] = y[out[r]]. The same float operations in the same order as
 * celeris.sampling.step.apply_penalties (OpenAI's frequency and presence penalties) then the banned ids, so the
 * same ids; without the (rows, n) temporaries those make (after a pass, with cold caches, they cost more than
 * the arithmetic). x (rows, n) float32; c's row r at c + r * c_stride (c_stride 0: one row of counts for all);
 * extra (NULL: none) holds rows + 1 offsets, then E = extra[rows] tokens, then their E counts: row r counts token
 * tok[e] cnt[e] more times, e in extra[r] .. extra[r + 1] (verified decoding's verify positions: the row's counts
 * plus the drafts before each, celeris.sampling.verified.penalize_along, whose int64 counts become float32 before
 * the sum, as here); scratch n floats. */
void celeris_penalized_argmax(const float *x, int64_t rows, int64_t n, const float *c, int64_t c_stride,
                              const float *fp, const float *pp, const int64_t *extra, const int64_t *banned,
                              int64_t nbanned, float *scratch, int64_t *out, float *value) {
    const int64_t *tok = extra ? extra + rows + 1 : NULL, *cnt = extra ? tok + extra[rows] : NULL;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n, *cr = c ? c + r * c_stride : NULL;
        const float f = fp ? fp[r] : 0.0f, p = pp ? pp[r] : 0.0f;
        int64_t j = 0;  /* the loops below vectorize as written (gcc -O3; explicit intrinsics measured no faster) */
        if (fp && pp)
            for (; j < n; j++) scratch[j] = (xr[j] - f * cr[j]) - p * (cr[j] > 0.0f ? 1.0f : 0.0f);
        else if (fp)
            for (; j < n; j++) scratch[j] = xr[j] - f * cr[j];
        else if (pp)
            for (; j < n; j++) scratch[j] = xr[j] - p * (cr[j] > 0.0f ? 1.0f : 0.0f);
        else
            memcpy(scratch, xr, (size_t)n * sizeof(float));
        if (extra && cr)
            for (int64_t e = extra[r]; e < extra[r + 1]; e++) {
                const int64_t t = tok[e];
                if (t >= 0 && t < n) scratch[t] = penalize_entry(xr[t], cr[t] + (float)cnt[e], fp != NULL, f,
                                                                 pp != NULL, p);
            }
        for (int64_t k = 0; k < nbanned; k++)
            if (banned[k] >= 0 && banned[k] < n) scratch[banned[k]] = -INFINITY;
        out[r] = argmax_row(scratch, n);
        value[r] = n ? scratch[out[r]] : -INFINITY;
    }
}

/* out[r] = silu(gu[r, :n]) * gu[r, n:] for gu (rows, 2n), out (rows, n) (SwiGLU, Shazeer arXiv:2002.05202). */
void celeris_silu_mul(const float *gu, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        for (int64_t i = 0; i < n; i++) out[r * n + i] = g[i] / (1.0f + exp_fast(-g[i])) * u[i];
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* r[c] = (r[0][c], ..., r[15][c]) for c < 16: a 16 x 16 float32 block transposed in registers (unpack pairs of
 * rows, then pairs of pairs, then 128-bit lanes twice). */
static inline void transpose_16x16(__m512 r[16]) {
    __m512 t[16], s[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  /* s[4g + k], 128-bit lane L: element 4L + k of rows 4g .. 4g + 3 */
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * g + 1]), e = _mm512_castps_pd(t[4 * g + 3]);
        s[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        s[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        s[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
        s[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
    }
    for (int k = 0; k < 4; k++) {
        const __m512 u = _mm512_shuffle_f32x4(s[k], s[4 + k], 0x88), v = _mm512_shuffle_f32x4(s[k], s[4 + k], 0xdd);
        const __m512 u2 = _mm512_shuffle_f32x4(s[8 + k], s[12 + k], 0x88);
        const __m512 v2 = _mm512_shuffle_f32x4(s[8 + k], s[12 + k], 0xdd);
        r[k] = _mm512_shuffle_f32x4(u, u2, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(v, v2, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(u, u2, 0xdd);
        r[12 + k] = _mm512_shuffle_f32x4(v, v2, 0xdd);
    }
}
#endif

#define KEYS_PER_VECTOR 16  /* keys scored at a time, one per lane of a 512-bit vector */
#define HEADS_AT_ONCE 4  /* query heads of one K/V head computed together (their chains interleaved) */

/* sc[e][j] = sum over d in order of q[e][d] * kT[d * 16 + j], j < 16, for nh <= HEADS_AT_ONCE queries: one fused
 * multiply-add chain per query and key (16 keys transposed: dimension d of the 16 is contiguous), the queries'
 * chains interleaved; the AVX-512 loop rounds as the plain one does. */
static inline void score_keys(const float *const *q, int64_t nh, const float *kT, int64_t D, float *sc) {
#if defined(__AVX512F__)
    __m512 acc[HEADS_AT_ONCE];
    for (int e = 0; e < HEADS_AT_ONCE; e++) acc[e] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 keys = _mm512_loadu_ps(kT + d * 16);
        for (int64_t e = 0; e < nh; e++) acc[e] = _mm512_fmadd_ps(_mm512_set1_ps(q[e][d]), keys, acc[e]);
    }
    for (int64_t e = 0; e < nh; e++) _mm512_storeu_ps(sc + e * 16, acc[e]);
#else
    for (int64_t e = 0; e < nh; e++) {
        for (int j = 0; j < 16; j++) sc[e * 16 + j] = 0.0f;
        for (int64_t d = 0; d < D; d++)
            for (int j = 0; j < 16; j++) sc[e * 16 + j] = fmaf(q[e][d], kT[d * 16 + j], sc[e * 16 + j]);
    }
#endif
}

/* The scaled scores of nh queries (q[e], D) over the T keys of one K/V head (kT: blocks of 16 keys transposed)
 * that the mask row keeps (mrow, stride mt; NULL: all): s[e * stride + i] for the i-th kept key, kept[i] its
 * position; then each query's scores replaced by exp(score - its maximum) (the softmax's numerators). Blocks the
 * mask drops whole are not scored. Returns the number of kept keys. */
static int64_t score_heads(const float *const *q, int64_t nh, const float *kT, int64_t D, int64_t T,
                           const uint8_t *mrow, int64_t mt, float scale, float *s, int64_t stride, int64_t *kept) {
    const int64_t V = KEYS_PER_VECTOR;
    float sc[HEADS_AT_ONCE * KEYS_PER_VECTOR], top[HEADS_AT_ONCE];
    for (int e = 0; e < HEADS_AT_ONCE; e++) top[e] = -INFINITY;
    int64_t n = 0;
    for (int64_t t0 = 0; t0 < T; t0 += V) {
        int any = 0, all = t0 + V <= T;
        for (int64_t t = t0; t < t0 + V && t < T; t++) {
            const int keep = !mrow || mrow[t * mt];
            any |= keep;
            all &= keep;
        }
        if (!any) continue;  /* a block the mask drops whole is not scored */
        score_keys(q, nh, kT + t0 * D, D, sc);
        if (all) {  /* every key of the block kept */
            for (int64_t e = 0; e < nh; e++)
                for (int64_t j = 0; j < V; j++) {
                    const float x = sc[e * V + j] * scale;
                    s[e * stride + n + j] = x;
                    top[e] = x > top[e] ? x : top[e];
                }
            for (int64_t j = 0; j < V; j++) kept[n + j] = t0 + j;
            n += V;
            continue;
        }
        for (int64_t t = t0; t < t0 + V && t < T; t++) {
            if (mrow && !mrow[t * mt]) continue;
            for (int64_t e = 0; e < nh; e++) {
                const float x = sc[e * V + t - t0] * scale;
                s[e * stride + n] = x;
                top[e] = x > top[e] ? x : top[e];
            }
            kept[n++] = t;
        }
    }
    for (int64_t e = 0; e < nh; e++)
        for (int64_t j = 0; j < n; j++) s[e * stride + j] = exp_fast(s[e * stride + j] - top[e]);
    return n;
}

/* o[e][d] = (sum over i in order of p[e][i] * v[keys[i] * vt + d]) / (sum over i in order of p[e][i]), d < D, for
 * nh queries' softmax numerators p[e] = s + e * stride over n kept keys: per query and dimension one fused
 * multiply-add chain added key after key (the queries' chains interleaved: 64 dimensions of up to
 * HEADS_AT_ONCE queries in registers at a time); a query with no kept key gets zeros. The AVX-512 loop rounds as
 * the plain one. */
static void weigh_values(const float *s, int64_t stride, int64_t nh, const int64_t *keys, int64_t n,
                         const float *v, int64_t vt, int64_t D, float *const *o) {
    int64_t d0 = 0;
#if defined(__AVX512F__)
    for (; d0 + 64 <= D; d0 += 64) {
        __m512 a[HEADS_AT_ONCE][4];
        for (int e = 0; e < HEADS_AT_ONCE; e++)
            for (int c = 0; c < 4; c++) a[e][c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const float *vv = v + keys[i] * vt + d0;
            const __m512 v0 = _mm512_loadu_ps(vv), v1 = _mm512_loadu_ps(vv + 16), v2 = _mm512_loadu_ps(vv + 32),
                         v3 = _mm512_loadu_ps(vv + 48);
            for (int64_t e = 0; e < nh; e++) {
                const __m512 w = _mm512_set1_ps(s[e * stride + i]);
                a[e][0] = _mm512_fmadd_ps(w, v0, a[e][0]);
                a[e][1] = _mm512_fmadd_ps(w, v1, a[e][1]);
                a[e][2] = _mm512_fmadd_ps(w, v2, a[e][2]);
                a[e][3] = _mm512_fmadd_ps(w, v3, a[e][3]);
            }
        }
        for (int64_t e = 0; e < nh; e++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[e] + d0 + 16 * c, a[e][c]);
    }
#endif
    for (int64_t e = 0; e < nh; e++) {
        for (int64_t d = d0; d < D; d++) o[e][d] = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float *vv = v + keys[i] * vt;
            for (int64_t d = d0; d < D; d++) o[e][d] = fmaf(s[e * stride + i], vv[d], o[e][d]);
        }
        float total = 0.0f;
        for (int64_t i = 0; i < n; i++) total += s[e * stride + i];
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < D; d++) o[e][d] *= inv;
    }
}

/* Scaled dot-product attention (Vaswani et al. 2017) with grouped K/V heads (query head h reads K/V head
 * h / (H / Hkv), Ainslie et al. arXiv:2305.13245): q (B, H, Lq, D), k and v (B, Hkv, T, D), given by element
 * strides (b, head, position; the last dimension contiguous); mask (uint8, 1 = attend) by strides (b, query, key),
 * or NULL for every key; out (B, Lq, H, D) contiguous.
 *
 * The arithmetic of a query is fixed by its own row, its keys and its mask alone, so that its numbers depend
 * neither on the other queries of its pass (the pass's width: a verify pass gives a next-token step's numbers) nor
 * on masked keys (a left-padded row gives the unpadded row's numbers): the score of each key is one fused
 * multiply-add chain over d in order (scored KEYS_PER_VECTOR keys at a time, one key per vector lane, from a
 * transposed copy of the keys made once per K/V head), masked keys are dropped, and the softmax's sum and its
 * weighted values add the kept keys one by one in position order. A block of keys that the mask drops whole is
 * not scored (half the work of a causal prefill). A query with no key to attend gets zeros.
 * Returns 0, or -2 when out of memory. */
int celeris_attention(const float *q, int64_t qb, int64_t qh, int64_t ql, const float *k, int64_t kb, int64_t kh,
                      int64_t kt, const float *v, int64_t vb, int64_t vh, int64_t vt, const uint8_t *mask, int64_t mb,
                      int64_t ml, int64_t mt, int64_t B, int64_t H, int64_t Hkv, int64_t Lq, int64_t T, int64_t D,
                      float scale, float *out, int threads) {
    const int64_t group = H / Hkv, work = B * H * Lq, V = KEYS_PER_VECTOR;
    const int64_t Tp = (T + V - 1) / V * V;  /* keys padded to whole vectors */
    if (threads < 1) threads = 1;
    const int64_t nblk = Tp / V;
    /* (+ 1: never a malloc of 0 bytes, which may give NULL) */
    float *keys_t = (float *)malloc((size_t)(B * Hkv * D * Tp + 1) * sizeof(float));
    uint8_t *wanted = (uint8_t *)calloc((size_t)(B * nblk + 1), 1);  /* a block some query of row b attends */
    /* per thread: the kept keys' indices (Tp), then the scores of HEADS_AT_ONCE heads (Tp each) */
    const size_t scratch_bytes = (size_t)Tp * (sizeof(int64_t) + HEADS_AT_ONCE * sizeof(float)) + 64;
    char *scratch = (char *)malloc(scratch_bytes * (size_t)threads);
    if (!keys_t || !wanted || !scratch) { free(keys_t); free(wanted); free(scratch); return -2; }
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            uint8_t any = !mask;
            for (int64_t l = 0; l < Lq && !any; l++) any = mask[b * mb + l * ml + t * mt] != 0;
            wanted[b * nblk + t / V] |= any;
        }
#pragma omp parallel for num_threads(threads) schedule(static) if (B * Hkv * T * D >= (1 << 16))
    for (int64_t i = 0; i < B * Hkv; i++) {  /* keys_t (B * Hkv, Tp / 16, D, 16): blocks of 16 keys transposed */
        const float *kbase = k + (i / Hkv) * kb + (i % Hkv) * kh;
        float *dst = keys_t + i * D * Tp;
        for (int64_t t0 = 0; t0 < Tp; t0 += V) {
            if (!wanted[(i / Hkv) * nblk + t0 / V]) continue;  /* no query attends it: never read */
            float *blk = dst + (t0 / V) * D * V;
#if defined(__AVX512F__)
            if (D % V == 0) {  /* 16 keys x 16 dimensions at a time, transposed in registers (0 past T) */
                for (int64_t d0 = 0; d0 < D; d0 += V) {
                    __m512 r[16];
                    for (int64_t j = 0; j < V; j++)
                        r[j] = t0 + j < T ? _mm512_loadu_ps(kbase + (t0 + j) * kt + d0) : _mm512_setzero_ps();
                    transpose_16x16(r);
                    for (int64_t c = 0; c < V; c++) _mm512_storeu_ps(blk + (d0 + c) * V, r[c]);
                }
                continue;
            }
#endif
            for (int64_t t = t0; t < t0 + V; t++)
                for (int64_t d = 0; d < D; d++) blk[d * V + t % V] = t < T ? kbase[t * kt + d] : 0.0f;
        }
    }
    /* one work item: a query position of a row and one K/V head's group of query heads, which share the item's
     * kept keys (the mask is per row and query) and its transposed keys and values: their chains interleave */
    const int64_t items = B * Hkv * Lq;
#pragma omp parallel for num_threads(threads) schedule(static) if (work * T * D >= (1 << 18))
    for (int64_t i = 0; i < items; i++) {
#ifdef _OPENMP
        char *mine = scratch + (size_t)omp_get_thread_num() * scratch_bytes;
#else
        char *mine = scratch;
#endif
        int64_t *kept = (int64_t *)mine;
        float *s = (float *)(mine + (size_t)Tp * sizeof(int64_t));  /* (HEADS_AT_ONCE, Tp) scores */
        const int64_t b = i / (Hkv * Lq), g = (i / Lq) % Hkv, l = i % Lq;
        const float *kT = keys_t + (b * Hkv + g) * D * Tp, *vbase = v + b * vb + g * vh;
        const uint8_t *mrow = mask ? mask + b * mb + l * ml : NULL;
        for (int64_t h0 = 0; h0 < group; h0 += HEADS_AT_ONCE) {
            const int64_t nh = group - h0 < HEADS_AT_ONCE ? group - h0 : HEADS_AT_ONCE;
            const float *qv[HEADS_AT_ONCE];
            for (int64_t e = 0; e < nh; e++) qv[e] = q + b * qb + (g * group + h0 + e) * qh + l * ql;
            const int64_t n = score_heads(qv, nh, kT, D, T, mrow, mt, scale, s, Tp, kept);
            float *o[HEADS_AT_ONCE];
            for (int64_t e = 0; e < nh; e++) o[e] = out + ((b * Lq + l) * H + g * group + h0 + e) * D;
            weigh_values(s, Tp, nh, kept, n, vbase, vt, D, o);
        }
    }
    free(keys_t);
    free(wanted);
    free(scratch);
    return 0;
}

/* Llama's half-split RoPE (Su et al. arXiv:2104.09864) of one head x (D) with cos, sin (D): out may not alias x. */
static void rope_head(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * c[i] - x[i + half] * s[i];
        out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
}

/* One attention layer's step after its q/k/v projection, for a KV cache: qkv (B, L, (H + 2 Hkv) * D) contiguous
 * (queries, keys, values stacked per position); cos, sin (D per (b, l), strides cb, cl); the rotated keys and the
 * values are written into the caches kc, vc (B, Hkv, T, D, strides as celeris_attention's) at columns
 * cols (B, L) int64, then the rotated queries attend (celeris_attention) over all T cached positions with mask.
 * out (B, L, H, D). Returns 0, -1 for a column outside [0, T), -2 when out of memory. */
int celeris_rope_cache_attention(const float *qkv, int64_t B, int64_t L, int64_t H, int64_t Hkv, int64_t D,
                                 const float *cos, const float *sin, int64_t cb, int64_t cl, float *kc, int64_t kb,
                                 int64_t kh, int64_t kt, float *vc, int64_t vb, int64_t vh, int64_t vt, int64_t T,
                                 const int64_t *cols, const uint8_t *mask, int64_t mb, int64_t ml, int64_t mt,
                                 float scale, float *out, int threads) {
    const int64_t width = (H + 2 * Hkv) * D;
    for (int64_t i = 0; i < B * L; i++)
        if (cols[i] < 0 || cols[i] >= T) return -1;
    float *q = (float *)malloc((size_t)(B * L * H * D) * sizeof(float));
    if (!q) return -2;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t l = 0; l < L; l++) {
            const float *row = qkv + (b * L + l) * width, *c = cos + b * cb + l * cl, *s = sin + b * cb + l * cl;
            const int64_t col = cols[b * L + l];
            for (int64_t h = 0; h < H; h++) rope_head(row + h * D, c, s, D, q + ((b * L + l) * H + h) * D);
            for (int64_t h = 0; h < Hkv; h++) {
                rope_head(row + (H + h) * D, c, s, D, kc + b * kb + h * kh + col * kt);
                const float *vsrc = row + (H + Hkv + h) * D;
                float *vdst = vc + b * vb + h * vh + col * vt;
                for (int64_t d = 0; d < D; d++) vdst[d] = vsrc[d];
            }
        }
    }
    const int rc = celeris_attention(q, L * H * D, D, H * D, kc, kb, kh, kt, vc, vb, vh, vt, mask, mb, ml, mt, B, H,
                                     Hkv, L, T, D, scale, out, threads);
    free(q);
    return rc;
}

int celeris_packed_matmul(int type, const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
                          float *y, int threads); /* gguf_blocks.c */

/* One pre-norm Llama decoder layer of a block-kernel model for a cached window pass, in one call (the fast pass's
 * layer: a width-1 pass of SmolLM2 otherwise makes about ten Python-level calls a layer):
 *   h = x + o(attention(rope(qkv(rms_norm(x, attn_norm)))))   with the cache written, as
 *                                                             celeris_rope_cache_attention does;
 *   out = h + down(silu(gate) * up)(rms_norm(h, mlp_norm))    gate and up stacked in one weight (2 I rows).
 * x, out (B * L, d) float32 (out may not alias x); the weights repacked by celeris_repack with their GGUF types;
 * cos, sin, the caches, cols, mask and scale as celeris_rope_cache_attention takes them. The same functions in
 * the same order as the layer's modules call them, and the residual adds are single float additions, so out
 * equals the module path's output bit for bit. Returns 0, -1 for a window column outside the cache (nothing
 * written), -2 when out of memory, -3 for a shape a weight's product does not take. */
/* scratch rows of one layer call: h (rows, d), wide (rows, max((H + 2 Hkv) D, 2 I)), mid (rows, max(H D, I)) */
static int64_t layer_scratch_floats(int64_t rows, int64_t d, int64_t H, int64_t Hkv, int64_t D, int64_t I) {
    const int64_t width = (H + 2 * Hkv) * D;
    return rows * (d + (width > 2 * I ? width : 2 * I) + (H * D > I ? H * D : I));
}

static int decoder_layer_into(const float *x, int64_t B, int64_t L, int64_t d, const float *attn_norm,
                              const float *mlp_norm, float eps, int qkv_type, const uint8_t *qkv, int o_type,
                              const uint8_t *o, int gu_type, const uint8_t *gu, int down_type, const uint8_t *down,
                              int64_t H, int64_t Hkv, int64_t D, int64_t I, const float *cos, const float *sin,
                              int64_t cb, int64_t cl, float *kc, int64_t kb, int64_t kh, int64_t kt, float *vc,
                              int64_t vb, int64_t vh, int64_t vt, int64_t T, const int64_t *cols,
                              const uint8_t *mask, int64_t mb, int64_t ml, int64_t mt, float scale, float *out,
                              int threads, float *scratch) {
    const int64_t rows = B * L, width = (H + 2 * Hkv) * D;
    float *h = scratch, *wide = h + rows * d, *mid = wide + rows * (width > 2 * I ? width : 2 * I);
    int rc = 0;
    /* a product refusing its shape is -3 (the caller's bug), not the -1 of a window column outside the cache */
#define PRODUCT(call) do { if (rc == 0) { rc = (call); if (rc == -1) rc = -3; } } while (0)
    celeris_rms_norm(x, attn_norm, rows, d, eps, h);
    PRODUCT(celeris_packed_matmul(qkv_type, h, rows, d, qkv, width, wide, threads));
    if (rc == 0)
        rc = celeris_rope_cache_attention(wide, B, L, H, Hkv, D, cos, sin, cb, cl, kc, kb, kh, kt, vc, vb, vh, vt, T,
                                          cols, mask, mb, ml, mt, scale, mid, threads);
    PRODUCT(celeris_packed_matmul(o_type, mid, rows, H * D, o, d, h, threads));
    if (rc == 0) {
        for (int64_t i = 0; i < rows * d; i++) out[i] = x[i] + h[i];
        celeris_rms_norm(out, mlp_norm, rows, d, eps, h);
    }
    PRODUCT(celeris_packed_matmul(gu_type, h, rows, d, gu, 2 * I, wide, threads));
    if (rc == 0) celeris_silu_mul(wide, rows, I, mid);
    PRODUCT(celeris_packed_matmul(down_type, mid, rows, I, down, d, h, threads));
#undef PRODUCT
    if (rc == 0)
        for (int64_t i = 0; i < rows * d; i++) out[i] += h[i];
    return rc;
}

int celeris_decoder_layer(const float *x, int64_t B, int64_t L, int64_t d, const float *attn_norm,
                          const float *mlp_norm, float eps, int qkv_type, const uint8_t *qkv, int o_type,
                          const uint8_t *o, int gu_type, const uint8_t *gu, int down_type, const uint8_t *down,
                          int64_t H, int64_t Hkv, int64_t D, int64_t I, const float *cos, const float *sin,
                          int64_t cb, int64_t cl, float *kc, int64_t kb, int64_t kh, int64_t kt, float *vc,
                          int64_t vb, int64_t vh, int64_t vt, int64_t T, const int64_t *cols, const uint8_t *mask,
                          int64_t mb, int64_t ml, int64_t mt, float scale, float *out, int threads) {
    float *scratch = (float *)malloc((size_t)layer_scratch_floats(B * L, d, H, Hkv, D, I) * sizeof(float));
    if (!scratch) return -2;
    const int rc = decoder_layer_into(x, B, L, d, attn_norm, mlp_norm, eps, qkv_type, qkv, o_type, o, gu_type, gu,
                                      down_type, down, H, Hkv, D, I, cos, sin, cb, cl, kc, kb, kh, kt, vc, vb, vh,
                                      vt, T, cols, mask, mb, ml, mt, scale, out, threads, scratch);
    free(scratch);
    return rc;
}

/* n decoder layers in one call (celeris_decoder_layer's, one after another), so that a pass makes one call from
 * Python instead of one a layer. Layer i reads row i of `layers` (n, STACK_COLUMNS) int64: its attention and MLP
 * norm weights, the types and repacked tiles of qkv, o, gate_up and down, its key and value caches (all layers'
 * caches with the strides given), and an address (or 0) to copy its output (B * L, d) to (a drafter's captured
 * features). x, out (B * L, d) float32, the rest as celeris_decoder_layer takes them. Returns as it does; -1 or -3
 * stop at the failing layer (the layers before it have written their caches). */
#define STACK_COLUMNS 13
int celeris_decoder_stack(int64_t n, const int64_t *layers, const float *x, int64_t B, int64_t L, int64_t d,
                          float eps, int64_t H, int64_t Hkv, int64_t D, int64_t I, const float *cos, const float *sin,
                          int64_t cb, int64_t cl, int64_t kb, int64_t kh, int64_t kt, int64_t vb, int64_t vh,
                          int64_t vt, int64_t T, const int64_t *cols, const uint8_t *mask, int64_t mb, int64_t ml,
                          int64_t mt, float scale, float *out, int threads) {
    const int64_t rows = B * L;
    float *scratch = (float *)malloc((size_t)(layer_scratch_floats(rows, d, H, Hkv, D, I) + 2 * rows * d) *
                                     sizeof(float));
    if (!scratch) return -2;
    float *ping = scratch + layer_scratch_floats(rows, d, H, Hkv, D, I), *pong = ping + rows * d;
    const float *cur = x;
    int rc = 0;
    for (int64_t i = 0; i < n && rc == 0; i++) {
        const int64_t *row = layers + i * STACK_COLUMNS;
        float *dst = i == n - 1 ? out : (i % 2 ? pong : ping);
        rc = decoder_layer_into(cur, B, L, d, (const float *)row[0], (const float *)row[1], eps, (int)row[2],
                                (const uint8_t *)row[3], (int)row[4], (const uint8_t *)row[5], (int)row[6],
                                (const uint8_t *)row[7], (int)row[8], (const uint8_t *)row[9], H, Hkv, D, I, cos, sin,
                                cb, cl, (float *)row[10], kb, kh, kt, (float *)row[11], vb, vh, vt, T, cols, mask, mb,
                                ml, mt, scale, dst, threads, scratch);
        if (rc == 0 && row[12]) memcpy((float *)row[12], dst, (size_t)(rows * d) * sizeof(float));
        cur = dst;
    }
    free(scratch);
    return rc;
}

/* A DFlash drafter's layers (z-lab/dflash ``DFlashDraftModel``; Qwen3 layers whose keys and values also read the
 * context) for one row's draft block, in one call, as ``celeris.models.dflash.DFlashLayer`` computes them:
 *   hn = rms_norm(x, in_norm); q = rms_norm(q(hn)) per head (q_norm); both = [ctx; hn]
 *   k = rms_norm(k(both)) per head (k_norm); v = v(both); rope on q (the block's positions) and k (all)
 *   the keys and values written into the caches at columns filled .. filled + Lc + Lq - 1
 *   x += o(attention(q, every cached key and value up to there))   (no mask: the block sees all of them)
 *   x += down(silu(gate) * up)(rms_norm(x, post_norm))
 * x (Lq, d) the block's embeddings, ctx (Lc, d) the projected context features (shared by the layers), cos, sin
 * (Lc + Lq, D) contiguous for the context's positions then the block's; layers (n, DRAFT_COLUMNS) int64: the
 * norms' addresses (in, post, q, k), the (type, tiles) of q, k, v, o, gate_up, down, then the layer's key and
 * value caches (Hkv, C, D with strides kh, kt; C columns). The same kernels in the same order as the modules'
 * fast path, so out (Lq, d) equals it bit for bit. Returns 0, -1 when the columns pass C, -2 out of memory,
 * -3 for a shape a weight's product does not take. */
#define DRAFT_COLUMNS 18
int celeris_dflash_stack(int64_t n, const int64_t *layers, const float *x, int64_t Lq, const float *ctx, int64_t Lc,
                         int64_t d, float eps, int64_t H, int64_t Hkv, int64_t D, int64_t I, const float *cos,
                         const float *sin, int64_t filled, int64_t C, int64_t kh, int64_t kt, float scale, float *out,
                         int threads) {
    const int64_t nb = Lc + Lq, T = filled + nb;
    if (filled < 0 || T > C) return -1;
    const int64_t qw = H * D, kw = Hkv * D, wide = 2 * I > qw ? 2 * I : qw;
    const size_t floats = (size_t)(Lq * d + Lq * qw + 2 * nb * kw + nb * d + Lq * qw + Lq * wide + Lq * (I > qw ? I : qw)
                                   + Lq * d);
    float *buf = (float *)malloc((floats + 1) * sizeof(float));
    if (!buf) return -2;
    float *hn = buf, *q = hn + Lq * d, *k = q + Lq * qw, *v = k + nb * kw, *both = v + nb * kw, *qr = both + nb * d,
          *w = qr + Lq * qw, *mid = w + Lq * wide, *h = mid + Lq * (I > qw ? I : qw);
    int rc = 0;
#define PRODUCT(call) do { if (rc == 0) { rc = (call); if (rc == -1) rc = -3; } } while (0)
    memcpy(out, x, (size_t)(Lq * d) * sizeof(float));
    memcpy(both, ctx, (size_t)(Lc * d) * sizeof(float));
    for (int64_t i = 0; i < n && rc == 0; i++) {
        const int64_t *row = layers + i * DRAFT_COLUMNS;
        float *kc = (float *)row[16], *vc = (float *)row[17];
        celeris_rms_norm(out, (const float *)row[0], Lq, d, eps, hn);
        PRODUCT(celeris_packed_matmul((int)row[4], hn, Lq, d, (const uint8_t *)row[5], qw, q, threads));
        if (rc == 0) celeris_rms_norm(q, (const float *)row[2], Lq * H, D, eps, q);
        memcpy(both + Lc * d, hn, (size_t)(Lq * d) * sizeof(float));
        PRODUCT(celeris_packed_matmul((int)row[6], both, nb, d, (const uint8_t *)row[7], kw, k, threads));
        if (rc == 0) celeris_rms_norm(k, (const float *)row[3], nb * Hkv, D, eps, k);
        PRODUCT(celeris_packed_matmul((int)row[8], both, nb, d, (const uint8_t *)row[9], kw, v, threads));
        if (rc != 0) break;
        for (int64_t l = 0; l < Lq; l++)
            for (int64_t hh = 0; hh < H; hh++)
                rope_head(q + (l * H + hh) * D, cos + (Lc + l) * D, sin + (Lc + l) * D, D, qr + (l * H + hh) * D);
        for (int64_t j = 0; j < nb; j++)
            for (int64_t hh = 0; hh < Hkv; hh++) {
                rope_head(k + (j * Hkv + hh) * D, cos + j * D, sin + j * D, D, kc + hh * kh + (filled + j) * kt);
                memcpy(vc + hh * kh + (filled + j) * kt, v + (j * Hkv + hh) * D, (size_t)D * sizeof(float));
            }
        rc = celeris_attention(qr, Lq * qw, D, qw, kc, 0, kh, kt, vc, 0, kh, kt, NULL, 0, 0, 0, 1, H, Hkv, Lq, T, D,
                               scale, mid, threads);
        PRODUCT(celeris_packed_matmul((int)row[10], mid, Lq, qw, (const uint8_t *)row[11], d, h, threads));
        if (rc != 0) break;
        for (int64_t j = 0; j < Lq * d; j++) out[j] += h[j];
        celeris_rms_norm(out, (const float *)row[1], Lq, d, eps, hn);
        PRODUCT(celeris_packed_matmul((int)row[12], hn, Lq, d, (const uint8_t *)row[13], 2 * I, w, threads));
        if (rc == 0) celeris_silu_mul(w, Lq, I, mid);
        PRODUCT(celeris_packed_matmul((int)row[14], mid, Lq, I, (const uint8_t *)row[15], d, h, threads));
        if (rc == 0)
            for (int64_t j = 0; j < Lq * d; j++) out[j] += h[j];
    }
#undef PRODUCT
    free(buf);
    return rc;
}
