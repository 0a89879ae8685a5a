/* Matrix products against a GGUF file's weight blocks (Q4_0, Q4_1, Q8_0), computed as llama.cpp's CPU backend
 * computes them (ggml-quants.c: quantize_row_q8_0 / q8_1, ggml_vec_dot_q4_0_q8_0, ggml_vec_dot_q4_1_q8_1,
 * ggml_vec_dot_q8_0_q8_0): each 32-wide block of an activation row is rounded to int8 with one float scale
 * da = max|x| / 127 (and the integer sum of its codes), each weight block is multiplied with integer dot products,
 * then scaled and summed in float32.
 *
 * The file's blocks (gguf-py's gguf/quants.py, ggml-common.h), 32 weights each, a row = K / 32 blocks:
 *   Q4_0: f16 d, 16 bytes qs            w[j] = ((qs[j] & 15) - 8) * d,  w[j + 16] = ((qs[j] >> 4) - 8) * d
 *   Q4_1: f16 d, f16 m, 16 bytes qs     w[j] = (qs[j] & 15) * d + m,    w[j + 16] = (qs[j] >> 4) * d + m
 *   Q8_0: f16 d, 32 int8 qs             w[j] = qs[j] * d
 * are repacked once, at load, into tiles of R rows (R = 16 with AVX-512 VNNI, else 8), the interleaved layout of
 * llama.cpp's repacked Q4_0 GEMM (ggml-cpu/repack.cpp) in spirit: every weight is written as an unsigned code u
 * with w = u * d + m (Q4_0: m = -8d; Q8_0: u = q + 128 and m = -128d where the dot product takes unsigned weights,
 * else the signed q and m = 0), so that one activation group of 4 bytes, broadcast, meets the same 4 weights of R
 * rows in one vpdpbusd (or vpmaddubsw). A tile's block record:
 *   4-bit: 4 vectors of R x 4 bytes (vector g: group g = weights 4g..4g+3 in the low nibbles, group g+4 in the
 *          high), then R f16 d and R f16 m;
 *   8-bit: 8 vectors of R x 4 bytes (vector j: group j), then R f16 d and R f16 m.
 * y[r] = sum over blocks of d_r * da * sum(u * qa) + m_r * da * sum(qa), the same real number as the block's
 * dequantized weights times the rounded activations.
 *
 * No PyTorch headers: celeris/models/kernels/__init__.py compiles this file with the machine's C compiler at first
 * use and calls it through ctypes. Threads: OpenMP over the tiles (the caller passes the count).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 }; /* ggml's type numbers (gguf.GGMLQuantizationType) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SIMD 2
#define R 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD 1
#define R 8
#else
#define SIMD 0
#define R 8
#endif
#define UNSIGNED_Q8 (SIMD == 2) /* vpdpbusd takes u = q + 128; vpmaddubsw would saturate, so AVX2 keeps q signed */
#define MT 8                    /* activation rows sharing one unpacked weight record (at most) */
/* loops over a tile's rows unrolled before gcc places its arrays: the accumulators then stay in registers (without
 * it gcc kept a copy of them on the stack, stored every block; measured 3-4% of a product of 4 to 64 rows) */
#define UNROLL _Pragma("GCC unroll 8")

typedef struct { float d; int32_t sum; float dsum; int8_t qs[QK]; } block_act; /* dsum = d * sum */ /* one quantized activation block */

int celeris_abi_version(void) { return 9; }
int celeris_simd_level(void) { return SIMD; } /* 2: AVX-512 VNNI, 1: AVX2, 0: plain C */
int celeris_tile_rows(void) { return R; }

static float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal */
        exp = 127 - 15 + 1;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static uint16_t float_to_half(float f) { /* round to nearest even; the values here are exact in f16 */
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, mant = x & 0x7fffff;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = mant >> shift, rem = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
    return (uint16_t)half;
#endif
}

static uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static int64_t file_block_bytes(int type) {
    return type == TYPE_Q4_0 ? 18 : type == TYPE_Q4_1 ? 20 : type == TYPE_Q8_0 ? 34 : 0;
}
static int64_t code_bytes(int type) { return type == TYPE_Q8_0 ? 32 * R : 16 * R; } /* codes of a tile record */
static int64_t record_bytes(int type) { return code_bytes(type) + 4 * R; }           /* + R f16 d, R f16 m */

/* Bytes of the repacked form of N rows of K weights; 0 for an unknown type or a K not a multiple of 32. */
int64_t celeris_packed_bytes(int type, int64_t N, int64_t K) {
    if (!file_block_bytes(type) || K % QK || N < 0) return 0;
    return (N + R - 1) / R * (K / QK) * record_bytes(type);
}

/* One file block as 32 codes u, with w = u * d + m. */
static void read_block(int type, const uint8_t *blk, uint8_t u[QK], float *d, float *m) {
    *d = half_to_float(read_u16(blk));
    if (type == TYPE_Q8_0) {
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int j = 0; j < QK; j++) u[j] = UNSIGNED_Q8 ? (uint8_t)(q[j] + 128) : (uint8_t)q[j];
        *m = UNSIGNED_Q8 ? -128.0f * *d : 0.0f;
        return;
    }
    const uint8_t *qs = blk + (type == TYPE_Q4_1 ? 4 : 2);
    for (int j = 0; j < QK / 2; j++) { u[j] = qs[j] & 15; u[j + QK / 2] = qs[j] >> 4; }
    *m = type == TYPE_Q4_1 ? half_to_float(read_u16(blk + 2)) : -8.0f * *d;
}

/* Repack N rows of K weights in the file's blocks (N x K / 32 blocks of `type`, row-major) into tiles (above), on
 * `threads` threads.
 * Returns 0, -1 for an unknown type or shape, -3 when m = -8d or -128d does not fit a half float. */
int celeris_repack(int type, const uint8_t *raw, int64_t N, int64_t K, uint8_t *out, int threads) {
    if (!celeris_packed_bytes(type, N, K)) return -1;
    const int64_t nb = K / QK, fb = file_block_bytes(type), rec = record_bytes(type), cb = code_bytes(type);
    const int64_t tiles = (N + R - 1) / R;
    int overflow = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : overflow) if (N * K >= (1 << 20))
    for (int64_t t = 0; t < tiles; t++) {  /* tiles are independent: a load repacks ~100 MB (0.5 s on one core) */
        memset(out + t * nb * rec, 0, (size_t)(nb * rec));
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *recp = out + (t * nb + b) * rec;
            uint16_t *dm = (uint16_t *)(recp + cb);
            for (int64_t r = 0; r < R && t * R + r < N; r++) {
                uint8_t u[QK];
                float d, m;
                read_block(type, raw + ((t * R + r) * nb + b) * fb, u, &d, &m);
                if (fabsf(m) > 65504.0f) { overflow = 1; continue; }
                for (int j = 0; j < 8; j++) {
                    for (int e = 0; e < 4; e++) {
                        const uint8_t v = u[4 * j + e];
                        if (type == TYPE_Q8_0) recp[j * R * 4 + r * 4 + e] = v;
                        else recp[(j & 3) * R * 4 + r * 4 + e] |= (uint8_t)(j < 4 ? v : v << 4);
                    }
                }
                uint16_t dh = float_to_half(d), mh = float_to_half(m);
                memcpy(dm + r, &dh, 2);
                memcpy(dm + R + r, &mh, 2);
            }
        }
    }
    return overflow ? -3 : 0;
}

/* out (n_ids, K) float32: rows ids[] of the repacked weight dequantized (w = u * d + m), for an embedding's gather
 * and for reading the weight back. Returns 0, or -1 for an unknown type, a bad shape or an id outside [0, N). */
int celeris_packed_rows(int type, const uint8_t *packed, int64_t N, int64_t K, const int64_t *ids, int64_t n_ids,
                        float *out) {
    if (!celeris_packed_bytes(type, N, K)) return -1;
    const int64_t nb = K / QK, rec = record_bytes(type), cb = code_bytes(type);
    for (int64_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= N) return -1;
        const int64_t t = ids[i] / R, r = ids[i] % R;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *recp = packed + (t * nb + b) * rec;
            const float d = half_to_float(read_u16(recp + cb + 2 * r)), m = half_to_float(read_u16(recp + cb + 2 * (R + r)));
            for (int j = 0; j < 8; j++) {
                for (int e = 0; e < 4; e++) {
                    int v;
                    if (type == TYPE_Q8_0) {
                        const uint8_t c = recp[j * R * 4 + r * 4 + e];
                        v = UNSIGNED_Q8 ? c : (int8_t)c;
                    } else {
                        const uint8_t c = recp[(j & 3) * R * 4 + r * 4 + e];
                        v = j < 4 ? c & 15 : c >> 4;
                    }
                    out[i * K + b * QK + 4 * j + e] = (float)v * d + m;
                }
            }
        }
    }
    return 0;
}

#if SIMD == 2
/* roundf of 16 floats (halves away from zero), exactly: truncate, then step away from zero where the dropped part
 * is at least one half (v - trunc(v) is exact for these |v| <= 127.5) */
static inline __m512i round_away(__m512 v) {
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
    return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, one));
}
#elif SIMD == 1
static inline __m256i round_away(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), sign = _mm256_set1_ps(-0.0f);
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, sign));
    return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, one)));
}
#endif

/* llama.cpp's quantize_row_q8_0 reference (amax, d = amax / 127, q = roundf(x * (1 / d))), with the codes' sum;
 * the vector loops give the same bytes as the plain one (a maximum and roundf are exact in any order). */
static void quantize_row(const float *x, int64_t K, block_act *out, int64_t stride) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
#if SIMD == 2
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        const __m512i q0 = round_away(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        const __m512i q1 = round_away(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)out[b * stride].qs, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(out[b * stride].qs + 16), _mm512_cvtepi32_epi8(q1));
        out[b * stride].d = d;
        out[b * stride].sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        out[b * stride].dsum = d * (float)out[b * stride].sum;
#elif SIMD == 1
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QK; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, m);
        for (int j = 0; j < 8; j++) amax = amax > lanes[j] ? amax : lanes[j];
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        __m256i total = _mm256_setzero_si256();
        for (int j = 0; j < QK; j += 8) {
            const __m256i q = round_away(_mm256_mul_ps(_mm256_loadu_ps(xb + j), _mm256_set1_ps(id)));
            total = _mm256_add_epi32(total, q);
            int32_t codes[8];
            _mm256_storeu_si256((__m256i *)codes, q);
            for (int e = 0; e < 8; e++) out[b * stride].qs[j + e] = (int8_t)codes[e];
        }
        int32_t sums[8], sum = 0;
        _mm256_storeu_si256((__m256i *)sums, total);
        for (int e = 0; e < 8; e++) sum += sums[e];
        out[b * stride].d = d;
        out[b * stride].sum = sum;
        out[b * stride].dsum = d * (float)sum;
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) {
            const int q = (int)roundf(xb[j] * id);
            out[b * stride].qs[j] = (int8_t)q;
            sum += q;
        }
        out[b * stride].d = d;
        out[b * stride].sum = sum;
        out[b * stride].dsum = d * (float)sum;
#endif
    }
}

/* The activation rounding the products use, exported for tests: x (M, K) float32 -> codes (M, K) int8, scales
 * (M, K / 32) float32 and code sums (M, K / 32) int32. Returns 0, or -1 for a K not a multiple of 32. */
int celeris_quantize_activations(const float *x, int64_t M, int64_t K, int8_t *codes, float *scales, int32_t *sums) {
    if (K % QK || M < 0) return -1;
    block_act a[1];
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / QK; b++) {
            quantize_row(x + m * K + b * QK, QK, a, 1);
            memcpy(codes + m * K + b * QK, a->qs, QK);
            scales[m * (K / QK) + b] = a->d;
            sums[m * (K / QK) + b] = a->sum;
        }
    return 0;
}

#if SIMD == 1
static int32_t group(const block_act *a, int j) { int32_t v; memcpy(&v, a->qs + 4 * j, 4); return v; }
#endif

#if SIMD == 2
/* acc += the dot products of w's unsigned bytes with the 4 signed bytes at p, broadcast to every lane, as vpdpbusd
 * with a memory operand broadcast: gcc writes _mm512_set1_epi32 of a load as a separate vpbroadcastd, which costs
 * a vector op each time (measured: 5-7% of a product of 8 or 16 activation rows; the same numbers) */
#define DPBUSD_BCST(acc, w, p) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(p)))
#endif

/* y[m, t*R .. t*R + R - 1] for one tile against activation rows 0 .. mt - 1 of xq (mt <= MT); inlined for each
 * constant mt (tile_dot_n), so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_dot(int type, const uint8_t *tile, int64_t nb, const block_act *xq, int64_t mt, float *acc_out) {
    const int64_t rec = record_bytes(type), cb = code_bytes(type);
    const int q8 = type == TYPE_Q8_0;
#if SIMD == 2
    __m512 acc[MT];
    UNROLL for (int t = 0; t < MT; t++) acc[t] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *recp = tile + b * rec;
        const block_act *a = xq + b * MT;  /* row t's block: a[t] */
        __m512i s[MT];
        UNROLL for (int64_t t = 0; t < mt; t++) s[t] = _mm512_setzero_si512();
        /* group j of every row before group j + 1 of any: the rows' chains interleave in program order */
        if (q8) {
            for (int j = 0; j < 8; j++) {
                const __m512i w = _mm512_loadu_si512((const void *)(recp + 64 * j));
                UNROLL for (int64_t t = 0; t < mt; t++) DPBUSD_BCST(s[t], w, a[t].qs + 4 * j);
            }
        } else {
            for (int g = 0; g < 4; g++) {
                const __m512i v = _mm512_loadu_si512((const void *)(recp + 64 * g));
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                UNROLL for (int64_t t = 0; t < mt; t++) DPBUSD_BCST(s[t], lo, a[t].qs + 4 * g);
                UNROLL for (int64_t t = 0; t < mt; t++) DPBUSD_BCST(s[t], hi, a[t].qs + 4 * g + 16);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(recp + cb)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(recp + cb + 2 * R)));
        UNROLL for (int64_t t = 0; t < mt; t++) {
            const __m512 dot = _mm512_cvtepi32_ps(s[t]);
            acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a[t].d)), acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a[t].dsum), acc[t]);
        }
    }
    UNROLL for (int64_t t = 0; t < mt; t++) _mm512_storeu_ps(acc_out + t * R, acc[t]);
#elif SIMD == 1
    __m256 acc[MT];
    for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *recp = tile + b * rec;
        __m256i w[8];
        if (q8) {
            for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(recp + 32 * j));
        } else {
            for (int g = 0; g < 4; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(recp + 32 * g));
                w[g] = _mm256_and_si256(v, low);
                w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(recp + cb)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(recp + cb + 2 * R)));
        for (int64_t t = 0; t < mt; t++) {
            const block_act *a = xq + b * MT + t;
            __m256i s;
            if (q8) { /* signed weights: |w| times the activation given w's sign (each pair sum fits int16) */
                s = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    const __m256i x = _mm256_set1_epi32(group(a, j));
                    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(x, w[j]));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                }
            } else { /* 4-bit codes: 8 groups of int16 pair sums stay below 2^15 (8 * 2 * 15 * 127) */
                __m256i p = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++)
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(group(a, j))));
                s = _mm256_madd_epi16(p, ones);
            }
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(a->d)), acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->dsum), acc[t]);
        }
    }
    for (int64_t t = 0; t < mt; t++) _mm256_storeu_ps(acc_out + t * R, acc[t]);
#else
    for (int64_t t = 0; t < mt; t++) for (int r = 0; r < R; r++) acc_out[t * R + r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *recp = tile + b * rec;
        for (int r = 0; r < R; r++) {
            const float d = half_to_float(read_u16(recp + cb + 2 * r)), m = half_to_float(read_u16(recp + cb + 2 * (R + r)));
            for (int64_t t = 0; t < mt; t++) {
                const block_act *a = xq + b * MT + t;
                int32_t dot = 0;
                for (int j = 0; j < 8; j++) {
                    for (int e = 0; e < 4; e++) {
                        int v;
                        if (q8) v = UNSIGNED_Q8 ? recp[j * R * 4 + r * 4 + e] : (int8_t)recp[j * R * 4 + r * 4 + e];
                        else v = j < 4 ? recp[(j & 3) * R * 4 + r * 4 + e] & 15 : recp[(j & 3) * R * 4 + r * 4 + e] >> 4;
                        dot += v * a->qs[4 * j + e];
                    }
                }
                acc_out[t * R + r] += d * a->d * (float)dot + m * a->d * (float)a->sum;
            }
        }
    }
#endif
}

#define TILE_DOT_N(n) \
    static void tile_dot_##n(int type, const uint8_t *tile, int64_t nb, const block_act *xq, float *out) { \
        tile_dot(type, tile, nb, xq, n, out); \
    }
TILE_DOT_N(1)
TILE_DOT_N(2)
TILE_DOT_N(3)
TILE_DOT_N(4)
TILE_DOT_N(5)
TILE_DOT_N(6)
TILE_DOT_N(7)
TILE_DOT_N(8)
typedef void (*tile_dot_fn)(int, const uint8_t *, int64_t, const block_act *, float *);
static const tile_dot_fn TILE_DOTS[MT + 1] = {0, tile_dot_1, tile_dot_2, tile_dot_3, tile_dot_4,
                                              tile_dot_5, tile_dot_6, tile_dot_7, tile_dot_8};

/* y (M, N) float32 = x (M, K) float32 @ W^T, W (N, K) repacked by celeris_repack. Returns 0, -1 for an unknown
 * type or shape, -2 when out of memory. */
int celeris_packed_matmul(int type, const float *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
                          float *y, int threads) {
    if (!celeris_packed_bytes(type, N, K) || M < 0) return -1;
    const int64_t nb = K / QK, tiles = (N + R - 1) / R, tile_bytes = nb * record_bytes(type);
    /* rows in chunks of MT, block-major inside a chunk (block b of row t at chunk + b * MT + t): a tile's rows
     * read one block at constant offsets from one address */
    block_act *xq = (block_act *)malloc((size_t)(((M + MT - 1) / MT) * MT * nb + 1) * sizeof(block_act));
    if (!xq) return -2;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + (m / MT) * MT * nb + m % MT, MT);
#pragma omp parallel for num_threads(threads) schedule(static) if (N * M * K >= (1 << 17))
    for (int64_t t = 0; t < tiles; t++) {
        float out[MT * R];
        const int64_t rows = N - t * R < R ? N - t * R : R;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int64_t mt = M - m0 < MT ? M - m0 : MT;
            TILE_DOTS[mt](type, packed + t * tile_bytes, nb, xq + m0 * nb, out);  /* m0 * nb: chunk m0 / MT */
            for (int64_t i = 0; i < mt; i++) memcpy(y + (m0 + i) * N + t * R, out + i * R, (size_t)rows * 4);
        }
    }
    free(xq);
    return 0;
}
