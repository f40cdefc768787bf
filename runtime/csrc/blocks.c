/* edgelm's native kernels: one table of GGUF block types, the scalar reference of blocks.h's arithmetic (also the
 * fallback on every CPU), the activations' int8 quantization (one function that every path uses), and the ISA
 * picked once at run time. Block layouts: ggml-common.h (block_q4_0 ... block_q6_K) in llama.cpp. */
#include "blocks.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  /* ggml numbers */

/* One block unpacked: centred integer values c, the runs' integer scales sc (and minimums mn), and the float
 * factors: w = (d * sc) * c [+ mf * mn], mf = m (Q4_1, Q5_1) or -dmin (Q4_K, Q5_K). */
typedef struct {
    float d, mf;
    int16_t c[256];
    int16_t sc[16], mn[16];
} eb_block;

/* One row of quantized activations: int8 values, the same values interleaved (below), a scale a group of 32, the
 * sums of each 16 values (int16: |sum| <= 16 * 127) and of each 32. Interleaved: in each run of 256 values (8 groups
 * of 32), 32-byte vector v holds 4 values of every group, its 32-bit lane l values 4 v .. 4 v + 3 of group l, so a
 * vector's lanes sum eight groups apart, with no horizontal sums; a row's last run is padded with zeros. */
typedef struct {
    const int8_t *q, *qi;
    const float *d;
    const int16_t *s16;
    const int32_t *s32;
} eb_xrow;

#define EB_ROWS 16 /* rows of x a weight row is read for at once (its blocks unpacked once for all of them) */

struct eb_type;
/* out[r] = row · x[r] for r < rows (1 to EB_ROWS). */
typedef void (*eb_dot_fn)(const struct eb_type *t, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                          float *out);

typedef struct eb_type {
    int type;
    int elems, bytes;  /* a block's weights and bytes; also the activations' quantization block */
    int run;           /* weights sharing one sub-scale: 32 or 16 */
    int has_min;       /* w has an offset term mf * mn */
    void (*unpack)(const uint8_t *block, eb_block *out);
    eb_dot_fn dot[EB_ISA_COUNT];  /* NULL: that ISA runs the scalar reference */
} eb_type;

static float half(const uint8_t *p) {  /* IEEE binary16, little-endian, to float32 (exact) */
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        float v = (float)mant * 5.9604644775390625e-8f;  /* mant * 2^-24: zero or subnormal */
        return sign ? -v : v;
    }
    bits = exp == 31 ? sign | 0x7f800000u | mant << 13 : sign | (exp + 112) << 23 | mant << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline __attribute__((always_inline)) uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Q4_K / Q5_K's 12 scale bytes: 8 six-bit scales and minimums (ggml's get_scale_min_k4 layout). Runs 0-3: the
 * low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); runs 4-7: the nibbles of bytes 8-11 (low: scale, high:
 * minimum) under the top 2 bits of bytes 0-3 (scales) and 4-7 (minimums). Computed four bytes a word: the
 * scales of runs 0-3, 4-7, then the minimums, a byte a run, little end first. */
static inline __attribute__((always_inline)) void scale_words(const uint8_t *q, uint32_t *words) {
    const uint32_t w0 = le32(q), w1 = le32(q + 4), w2 = le32(q + 8);
    words[0] = w0 & 0x3f3f3f3fu;                                 /* scales of runs 0-3, a byte each */
    words[1] = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);   /* scales of runs 4-7 */
    words[2] = w1 & 0x3f3f3f3fu;                                 /* minimums of runs 0-3 */
    words[3] = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u); /* minimums of runs 4-7 */
}

static void scale_min_k4(const uint8_t *q, int16_t *sc, int16_t *mn) {
    uint32_t words[4];
    scale_words(q, words);
    for (int i = 0; i < 8; i++) {
        sc[i] = (int16_t)((words[i / 4] >> (8 * (i % 4))) & 0xff);
        mn[i] = (int16_t)((words[2 + i / 4] >> (8 * (i % 4))) & 0xff);
    }
}

/* Legacy blocks of 32: element j in byte j's low nibble, j + 16 in its high; Q5's fifth bit j in qh's bit j. */
static void unpack_legacy(const uint8_t *b, eb_block *o, int qs, int qh, int zero, int has_min) {
    uint32_t high = 0;
    if (qh >= 0) high = le32(b + qh);
    for (int j = 0; j < 16; j++) {
        int lo = b[qs + j] & 15, hi = b[qs + j] >> 4;
        if (qh >= 0) {
            lo |= (int)((high >> j) & 1) << 4;
            hi |= (int)((high >> (j + 16)) & 1) << 4;
        }
        o->c[j] = (int16_t)(lo - zero);
        o->c[j + 16] = (int16_t)(hi - zero);
    }
    o->d = half(b);
    o->mf = has_min ? half(b + 2) : 0.0f;
    o->sc[0] = o->mn[0] = 1;
}
static void unpack_q4_0(const uint8_t *b, eb_block *o) { unpack_legacy(b, o, 2, -1, 8, 0); }
static void unpack_q4_1(const uint8_t *b, eb_block *o) { unpack_legacy(b, o, 4, -1, 0, 1); }
static void unpack_q5_0(const uint8_t *b, eb_block *o) { unpack_legacy(b, o, 6, 2, 16, 0); }
static void unpack_q5_1(const uint8_t *b, eb_block *o) { unpack_legacy(b, o, 8, 4, 0, 1); }
static void unpack_q8_0(const uint8_t *b, eb_block *o) {
    for (int j = 0; j < 32; j++) o->c[j] = (int8_t)b[2 + j];
    o->d = half(b);
    o->mf = 0.0f;
    o->sc[0] = o->mn[0] = 1;
}

/* Q4_K: d | dmin | scales[12] | qs[128]; Q5_K: the same with qh[32] before qs. Values 64 p + i in byte 32 p + i's
 * low nibble, 64 p + 32 + i in its high; Q5_K's fifth bit of sub-block j's element i is qh[i]'s bit j. */
static void unpack_k4(const uint8_t *b, eb_block *o, int five) {
    const uint8_t *qs = b + (five ? 48 : 16), *qh = b + 16;
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 32; i++) {
            int lo = qs[32 * p + i] & 15, hi = qs[32 * p + i] >> 4;
            if (five) {
                lo |= ((qh[i] >> (2 * p)) & 1) << 4;
                hi |= ((qh[i] >> (2 * p + 1)) & 1) << 4;
            }
            o->c[64 * p + i] = (int16_t)lo;
            o->c[64 * p + 32 + i] = (int16_t)hi;
        }
    scale_min_k4(b + 4, o->sc, o->mn);
    o->d = half(b);
    o->mf = -half(b + 2);
}
static void unpack_q4_k(const uint8_t *b, eb_block *o) { unpack_k4(b, o, 0); }
static void unpack_q5_k(const uint8_t *b, eb_block *o) { unpack_k4(b, o, 1); }

/* Q6_K: ql[128] | qh[64] | scales[16] (int8, runs of 16) | d. Element 128 h + 64 s + i (i < 64): ql[64 h + i]'s
 * nibble s; its top two bits: element 128 h + 32 t + i (i < 32) in bits 2 t of qh[32 h + i]. c = q - 32. */
static void unpack_q6_k(const uint8_t *b, eb_block *o) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int e = 0; e < 256; e++) {
        int h = e / 128, r = e % 128;
        int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
        int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        o->c[e] = (int16_t)((low | high << 4) - 32);
    }
    for (int r = 0; r < 16; r++) {
        o->sc[r] = (int8_t)b[192 + r];
        o->mn[r] = 0;
    }
    o->d = half(b + 208);
    o->mf = 0.0f;
}

/* The eight partial sums' total, as a vector's halves are added (blocks.h). */
static inline __attribute__((always_inline)) float lanes_total(const float *acc) {
    float s4[4];
    for (int i = 0; i < 4; i++) s4[i] = acc[i] + acc[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* The reference: blocks.h's arithmetic, block after block, for one row of x. */
static float dot_scalar_row(const eb_type *t, const uint8_t *row, int64_t nb, const int8_t *qx, const float *dx) {
    float acc[8] = {0};
    eb_block blk;
    const int groups = t->elems / 32;
    for (int64_t b = 0; b < nb; b++) {
        t->unpack(row + b * t->bytes, &blk);
        for (int g = 0; g < groups; g++) {
            const int64_t at = b * groups + g; /* the group's index in the row */
            const int8_t *q = qx + 32 * at;
            int32_t isum = 0, msum = 0;
            for (int r = 0; r < 32 / t->run; r++) {
                const int run = g * (32 / t->run) + r;
                int32_t s = 0, sq = 0;
                for (int i = 0; i < t->run; i++) {
                    s += blk.c[run * t->run + i] * q[r * t->run + i];
                    sq += q[r * t->run + i];
                }
                isum += blk.sc[run] * s;
                msum += blk.mn[run] * sq;
            }
            float term = (blk.d * dx[at]) * (float)isum;
            if (t->has_min) term = term + (blk.mf * dx[at]) * (float)msum;
            acc[at & 7] = acc[at & 7] + term;
        }
    }
    return lanes_total(acc);
}

static void dot_scalar(const eb_type *t, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows, float *out) {
    for (int r = 0; r < rows; r++) out[r] = dot_scalar_row(t, row, nb, x[r].q, x[r].d);
}

#if (defined(__x86_64__) || defined(__i386__)) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define EB_X86 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#define EB_SUFFIX(name) name##_avx2
#include "blocks_simd.h"
#undef EB_SUFFIX
#pragma GCC pop_options
#pragma GCC push_options
#ifdef EB_EMULATED_VNNI
/* Tests only (native.emulated_vnni_library): the VNNI source compiled for AVX2, its two VNNI instructions computed
 * exactly from AVX2 ones, so that a CPU without AVX-512 checks that source against the reference too. vpdpbusd: the
 * even and the odd bytes' u8 x s8 products in two int16 madds (each pair sum fits int32); vpdpwssd: one madd. */
#pragma GCC target("avx2,f16c")
static inline __attribute__((always_inline)) __m256i eb_emulated_dpbusd(__m256i acc, __m256i u, __m256i s) {
    const __m256i even = _mm256_and_si256(u, _mm256_set1_epi16(0x00ff)), odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(even, s_even), _mm256_madd_epi16(odd, s_odd)));
}
#undef _mm256_dpbusd_epi32 /* a macro in some compilers' headers */
#undef _mm256_dpwssd_epi32
#define _mm256_dpbusd_epi32 eb_emulated_dpbusd
#define _mm256_dpwssd_epi32(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#else
#pragma GCC target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif
#define EB_VNNI 1
#define EB_SUFFIX(name) name##_vnni
#include "blocks_simd.h"
#undef EB_SUFFIX
#undef EB_VNNI
#ifdef EB_EMULATED_VNNI
#undef _mm256_dpbusd_epi32
#undef _mm256_dpwssd_epi32
#endif
#undef EB_BY_ROWS
#undef EB_LOOPS
#pragma GCC pop_options
#define EB_SIMD(name) {dot_scalar, name##_avx2, name##_vnni}
#else
#define EB_SIMD(name) {dot_scalar, NULL, NULL}
#endif

/* The one table of block types: a row each, the SIMD kernels parameterised by it. */
static const eb_type TYPES[] = {
    {Q4_0, 32, 18, 32, 0, unpack_q4_0, EB_SIMD(dot_legacy)},
    {Q4_1, 32, 20, 32, 1, unpack_q4_1, EB_SIMD(dot_legacy)},
    {Q5_0, 32, 22, 32, 0, unpack_q5_0, EB_SIMD(dot_legacy)},
    {Q5_1, 32, 24, 32, 1, unpack_q5_1, EB_SIMD(dot_legacy)},
    {Q8_0, 32, 34, 32, 0, unpack_q8_0, EB_SIMD(dot_legacy)},
    {Q4_K, 256, 144, 32, 1, unpack_q4_k, EB_SIMD(dot_k4)},
    {Q5_K, 256, 176, 32, 1, unpack_q5_k, EB_SIMD(dot_k4)},
    {Q6_K, 256, 210, 16, 0, unpack_q6_k, EB_SIMD(dot_q6_k)},
};

static const eb_type *find_type(int type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

int eb_block_shape(int type, int *block_elems, int *block_bytes) {
    const eb_type *t = find_type(type);
    if (t == NULL) return -1;
    *block_elems = t->elems;
    *block_bytes = t->bytes;
    return 0;
}

const char *eb_isa_name(int isa) {
    static const char *names[EB_ISA_COUNT] = {"scalar", "avx2", "avx512vnni"};
    return isa >= 0 && isa < EB_ISA_COUNT ? names[isa] : "unknown";
}

int eb_isa_supported(int isa) {
    if (isa == EB_SCALAR) return 1;
#ifdef EB_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == EB_AVX2) return avx2;
#ifdef EB_EMULATED_VNNI
    if (isa == EB_AVX512VNNI) return avx2;
#endif
    if (isa == EB_AVX512VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

int eb_best_isa(void) {
    static int chosen = -1;  /* a race only writes the same value twice */
    if (chosen < 0) {
        int cap = EB_ISA_COUNT - 1;
        const char *env = getenv("EDGELM_NATIVE_ISA");
        if (env != NULL)
            for (int i = 0; i < EB_ISA_COUNT; i++)
                if (strcmp(env, eb_isa_name(i)) == 0) cap = i;
        int best = EB_SCALAR;
        for (int i = 1; i <= cap; i++)
            if (eb_isa_supported(i)) best = i;
        chosen = best;
    }
    return chosen;
}

/* The workspace: int8 values (M, K) | interleaved int8 values (M, K rounded up to 256; none where M = 1, which the
 * row path reads without them) | float scales (M, K / 32) | int16 sums of 16 values (M, K / 16) | int32 sums of 32
 * (M, K / 32), each part on a cache line of its own. */
typedef struct {
    int8_t *q, *qi;
    float *d;
    int16_t *s16;
    int32_t *s32;
} eb_work;

static size_t line(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static int64_t padded(int64_t k) { return (k + 255) / 256 * 256; } /* a row's interleaved values */

/* The parts' sizes, in order, and their total. */
static size_t work_sizes(int64_t m, int64_t k, size_t *sizes) {
    sizes[0] = line((size_t)(m * k));
    sizes[1] = m > 1 ? line((size_t)(m * padded(k))) : 0;
    sizes[2] = line((size_t)(m * (k / 32)) * sizeof(float));
    sizes[3] = line((size_t)(m * (k / 16)) * sizeof(int16_t));
    sizes[4] = (size_t)(m * (k / 32)) * sizeof(int32_t);
    return sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4];
}

static eb_work work_parts(const void *workspace, int64_t m, int64_t k) {
    uint8_t *base = (uint8_t *)workspace;
    size_t sizes[5];
    work_sizes(m, k, sizes);
    eb_work w = {(int8_t *)base, (int8_t *)(base + sizes[0]), (float *)(base + sizes[0] + sizes[1]),
                 (int16_t *)(base + sizes[0] + sizes[1] + sizes[2]),
                 (int32_t *)(base + sizes[0] + sizes[1] + sizes[2] + sizes[3])};
    return w;
}

size_t eb_workspace_bytes(int type, int64_t m, int64_t k) {
    const eb_type *t = find_type(type);
    if (t == NULL || k <= 0 || k % t->elems != 0 || m <= 0) return 0;
    size_t sizes[5];
    return work_sizes(m, k, sizes);
}

/* x to int8 per group of 32: d = amax / 127, q = round_half_even(x * (1 / d)) within +-127; NaN counts as 0. */
int eb_quantize_rows(int type, const float *x, int64_t m, int64_t k, void *workspace, int64_t row_start,
                     int64_t row_stop) {
    const eb_type *t = find_type(type);
    if (t == NULL || k <= 0 || k % t->elems != 0 || m <= 0 || row_start < 0 || row_stop > m) return -1;
    eb_work w = work_parts(workspace, m, k);
    for (int64_t b = row_start * (k / 32); b < row_stop * (k / 32); b++) {
        const float *xb = x + b * 32;
        int8_t *qb = w.q + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) { /* fmaxf's answer (a NaN is passed over) without a libm call */
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) {
            /* round half to even as nearbyintf does in the default mode, without a libm call: |v| <= 127 here,
             * and adding then subtracting 1.5 * 2^23 leaves v rounded to an integer (NaN stays NaN) */
            const float scaled = xb[i] * id;
            const float v = scaled != scaled ? 0.0f : scaled < -127.0f ? -127.0f : scaled > 127.0f ? 127.0f : scaled;
            qb[i] = (int8_t)(int)((v + 12582912.0f) - 12582912.0f);
        }
        w.d[b] = d;
    }
    for (int64_t g = row_start * (k / 16); g < row_stop * (k / 16); g++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += w.q[g * 16 + i];
        w.s16[g] = (int16_t)s;
    }
    for (int64_t g = row_start * (k / 32); g < row_stop * (k / 32); g++) w.s32[g] = w.s16[2 * g] + w.s16[2 * g + 1];
    /* the interleaved copy (eb_xrow.qi), read by prompt tiles only: a single row (decode) takes the row path */
    for (int64_t r = row_start; m > 1 && r < row_stop; r++) {
        const int8_t *q = w.q + r * k;
        int8_t *qi = w.qi + r * padded(k);
        for (int64_t run = 0; run < padded(k); run += 256)
            for (int v = 0; v < 8; v++)
                for (int l = 0; l < 8; l++)
                    for (int i = 0; i < 4; i++) {
                        const int64_t from = run + 32 * l + 4 * v + i; /* group l's value 4 v + i */
                        qi[run + 32 * v + 4 * l + i] = from < k ? q[from] : 0;
                    }
    }
    return 0;
}

int eb_quantize(int type, const float *x, int64_t m, int64_t k, void *workspace) {
    return eb_quantize_rows(type, x, m, k, workspace, 0, m);
}

void eb_matmul_rows(int type, int isa, const void *workspace, int64_t m, int64_t k, const uint8_t *w,
                    int64_t n_start, int64_t n_stop, float *y, int64_t ldy) {
    const eb_type *t = find_type(type);
    if (t == NULL) return;
    eb_dot_fn dot = isa >= 0 && isa < EB_ISA_COUNT && t->dot[isa] != NULL ? t->dot[isa] : dot_scalar;
    eb_work x = work_parts(workspace, m, k);
    const int64_t nb = k / t->elems, row_bytes = nb * t->bytes;
    eb_xrow rows[EB_ROWS];
    float out[EB_ROWS];
    for (int64_t i = 0; i < m; i += EB_ROWS) { /* a tile of x rows; the weight rows stay in L2 across tiles */
        const int count = m - i < EB_ROWS ? (int)(m - i) : EB_ROWS;
        for (int r = 0; r < count; r++) {
            const int64_t at = i + r;
            rows[r] = (eb_xrow){x.q + at * k, x.qi + at * padded(k), x.d + at * (k / 32), x.s16 + at * (k / 16),
                                x.s32 + at * (k / 32)};
        }
        for (int64_t n = n_start; n < n_stop; n++) {
            dot(t, w + n * row_bytes, nb, rows, count, out);
            for (int r = 0; r < count; r++) y[(i + r) * ldy + n] = out[r];
        }
    }
}

int eb_matmul(int type, int isa, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) {
    size_t bytes = eb_workspace_bytes(type, m, k);
    if (bytes == 0 || isa < 0 || isa >= EB_ISA_COUNT || !eb_isa_supported(isa)) return -1;
    void *work = malloc(bytes);
    if (work == NULL) return -1;
    eb_quantize(type, x, m, k, work);
    eb_matmul_rows(type, isa, work, m, k, w, 0, n, y, n);
    free(work);
    return 0;
}

int eb_dequantize_row(int type, const uint8_t *row, int64_t k, float *out) {
    const eb_type *t = find_type(type);
    if (t == NULL || k <= 0 || k % t->elems != 0) return -1;
    eb_block blk;
    for (int64_t b = 0; b < k / t->elems; b++) {
        t->unpack(row + b * t->bytes, &blk);
        for (int i = 0; i < t->elems; i++) {
            int r = i / t->run;
            float w = (blk.d * (float)blk.sc[r]) * (float)blk.c[i];
            if (t->has_min) w = w + blk.mf * (float)blk.mn[r];
            out[b * t->elems + i] = w;
        }
    }
    return 0;
}
