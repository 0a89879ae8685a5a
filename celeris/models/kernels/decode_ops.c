/* The small float32 operators between a decoding pass's matrix products, for models whose linears run on the GGUF
 * block kernel (celeris.models.fast_ops): RMSNorm, SwiGLU's silu(gate) * up, and attention of a few queries over a
 * KV cache. Between products that stream megabytes of weights, PyTorch's many small operator calls run with cold
 * caches (several times their warm cost); these few loops replace them. Built with gguf_blocks.c into one library
 * (celeris/models/kernels/__init__.py). Every function reads float32 rows whose last dimension is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* out[r] = silu(gu[r, :n]) * gu[r, n:] for gu (rows, 2n), out (rows, n) (SwiGLU, Shazeer arXiv:2002.05202). */
void celeris_silu_mul(const float *gu, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        for (int64_t i = 0; i < n; i++) out[r * n + i] = g[i] / (1.0f + exp_fast(-g[i])) * u[i];
    }
}

/* x . y over n floats, in 16 partial sums that the compiler keeps in vector lanes, added as a tree of halves (a
 * single running sum is one chain of dependent additions, which it may not reorder). */
static float dot(const float *x, const float *y, int64_t n) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += x[i + j] * y[i + j];
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) part[j] += part[j + w];
    float total = part[0];
    for (; i < n; i++) total += x[i] * y[i];
    return total;
}

/* Scaled dot-product attention (Vaswani et al. 2017) with grouped K/V heads (query head h reads K/V head
 * h / (H / Hkv), Ainslie et al. arXiv:2305.13245): q (B, H, Lq, D), k and v (B, Hkv, T, D), given by element
 * strides (b, head, position; the last dimension contiguous); mask (uint8, 1 = attend) by strides (b, query, key),
 * or NULL for every key; out (B, Lq, H, D) contiguous. Each query is computed alone over its keys in position
 * order, a masked key skipped: its numbers depend on nothing but its own row, its keys and its mask, not on the
 * other queries of the pass (its width), nor on masked keys (a left-padded row gives the unpadded row's numbers).
 * A query with no key to attend gets zeros. Returns 0, or -2 when out of memory. */
int celeris_attention(const float *q, int64_t qb, int64_t qh, int64_t ql, const float *k, int64_t kb, int64_t kh,
                      int64_t kt, const float *v, int64_t vb, int64_t vh, int64_t vt, const uint8_t *mask, int64_t mb,
                      int64_t ml, int64_t mt, int64_t B, int64_t H, int64_t Hkv, int64_t Lq, int64_t T, int64_t D,
                      float scale, float *out, int threads) {
    const int64_t group = H / Hkv, work = B * H * Lq;
    if (threads < 1) threads = 1;
    float *scratch = (float *)malloc((size_t)(T + D) * (size_t)threads * sizeof(float));
    if (!scratch) return -2;
#pragma omp parallel for num_threads(threads) schedule(static) if (work * T * D >= (1 << 18))
    for (int64_t i = 0; i < work; i++) {
#ifdef _OPENMP
        float *s = scratch + (size_t)omp_get_thread_num() * (size_t)(T + D);
#else
        float *s = scratch;
#endif
        float *acc = s + T;
        const int64_t b = i / (H * Lq), h = (i / Lq) % H, l = i % Lq, g = h / group;
        const float *qv = q + b * qb + h * qh + l * ql;
        const float *kbase = k + b * kb + g * kh, *vbase = v + b * vb + g * vh;
        const uint8_t *mrow = mask ? mask + b * mb + l * ml : NULL;
        float top = -INFINITY;
        for (int64_t t = 0; t < T; t++) {
            if (mrow && !mrow[t * mt]) { s[t] = -INFINITY; continue; }
            s[t] = dot(qv, kbase + t * kt, D) * scale;
            if (s[t] > top) top = s[t];
        }
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        float total = 0.0f;
        if (top != -INFINITY) {
            for (int64_t t = 0; t < T; t++) s[t] = s[t] == -INFINITY ? 0.0f : exp_fast(s[t] - top);
            for (int64_t t = 0; t < T; t++) {
                if (s[t] == 0.0f) continue;  /* masked keys (and underflows) add nothing */
                total += s[t];
                const float *vv = vbase + t * vt;
                for (int64_t d = 0; d < D; d++) acc[d] += s[t] * vv[d];
            }
        }
        float *o = out + ((b * Lq + l) * H + h) * D;
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = acc[d] * inv;
    }
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
