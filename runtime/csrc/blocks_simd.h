/* The SIMD row dots, included by blocks.c once per ISA (EB_SUFFIX names them, EB_VNNI picks the integer dots):
 * AVX2 (maddubs + madd) and AVX-512 VNNI (vpdpbusd / vpdpwssd on 256-bit vectors). Integer sums inside a block,
 * then the reference's float arithmetic in its order (blocks.h): the legacy types eight blocks at a time in the
 * eight lanes of one float vector, the K-quants one super-block at a time into the same lanes. So the result
 * equals dot_scalar's bit for bit. Two loops a type: a single row of x (decode) sums each group's vector
 * horizontally; a tile of 2 to EB_ROWS rows (a prompt) transposes the eight groups' values once (transpose8) and
 * reads the activations interleaved (eb_xrow.qi), so each row's eight group sums are vertical adds (lane_dots).
 * Little-endian hosts (the x86 ones these paths are for). */

#define EB_INLINE static inline __attribute__((always_inline))

/* 32 unsigned 8-bit values times 32 signed 8-bit ones: eight int32 sums of four products each, lane l holding
 * elements 4 l .. 4 l + 3 (so lanes 0-3 are elements 0-15). Products of u <= 128 and |s| <= 127 fit exactly. */
EB_INLINE __m256i EB_SUFFIX(dot_u8)(__m256i u, __m256i s) {
#ifdef EB_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* acc + the products of u and s times `scale` (int16 per pair of elements): AVX2's maddubs then madd, VNNI's
 * maddubs then vpdpwssd. The pair sums (|u s| <= 2 * 63 * 127) and their products with a 6- or 8-bit scale fit. */
EB_INLINE __m256i EB_SUFFIX(scaled_dot)(__m256i acc, __m256i u, __m256i s, __m256i scale) {
#ifdef EB_VNNI
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), scale);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale));
#endif
}

/* The tile kernels' integer sums: vectors u[first] .. u[first + count - 1] times the activations' vectors of the
 * same index (four products a lane), times `scale` (int32 lanes; scaled = 0: no scale). AVX2 adds `chunk`
 * maddubs' int16 pair sums before one madd by the scale (chunk times the largest pair sum must fit int16: the
 * caller's bound from its values' range), VNNI sums with vpdpbusd and multiplies once. `signs` (AVX2, Q8_0): u is
 * |w| and each activation vector takes the sign of signs[c] (values_dot). */
EB_INLINE __m256i EB_SUFFIX(lane_dots)(const __m256i *u, const __m256i *signs, const int8_t *q, int first, int count,
                                       int chunk, __m256i scale, int scaled) {
    __m256i sum = _mm256_setzero_si256();
#ifdef EB_VNNI
    (void)signs, (void)chunk;
#pragma GCC unroll 8
    for (int c = first; c < first + count; c++)
        sum = _mm256_dpbusd_epi32(sum, u[c], _mm256_loadu_si256((const __m256i *)(q + 32 * c)));
    return scaled ? _mm256_mullo_epi32(sum, scale) : sum;
#else
    /* each lane's scale (|scale| < 2^15) as both int16 halves: the low half as it is, the high half shifted up */
    const __m256i scale16 = scaled ? _mm256_blend_epi16(scale, _mm256_slli_epi32(scale, 16), 0xaa) : _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int c = first; c < first + count; c += chunk) {
        __m256i pairs = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int i = c; i < c + chunk; i++) {
            __m256i qc = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
            if (signs != NULL) qc = _mm256_sign_epi8(qc, signs[i]);
            pairs = i == c ? _mm256_maddubs_epi16(u[i], qc) : _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[i], qc));
        }
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, scale16));
    }
    return sum;
#endif
}

/* Eight vectors of eight 32-bit lanes transposed in place: lane l of vector c becomes lane c of vector l. So eight
 * groups of 32 values, a vector each, become the interleaved order of eb_xrow.qi: vector c, lane l = values
 * 4 c .. 4 c + 3 of group l. 24 shuffles, paid once a block for all the rows of a tile. */
EB_INLINE void EB_SUFFIX(transpose8)(__m256i *v) {
    __m256i a[8], b[8];
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);     /* v_i.0 v_i+1.0 v_i.1 v_i+1.1 | the same of 4, 5 */
        a[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]); /* lanes 2, 3 | 6, 7 */
    }
#pragma GCC unroll 2
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);         /* lane 0 of v_i .. v_i+3 | lane 4 */
        b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);     /* lane 1 | 5 */
        b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]); /* lane 2 | 6 */
        b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]); /* lane 3 | 7 */
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        v[c] = _mm256_permute2x128_si256(b[c], b[c + 4], 0x20);
        v[c + 4] = _mm256_permute2x128_si256(b[c], b[c + 4], 0x31);
    }
}

EB_INLINE int32_t EB_SUFFIX(hsum)(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Eight vectors of eight int32 -> their eight sums, in order. */
EB_INLINE __m256i EB_SUFFIX(hsum8)(const __m256i *p) {
    __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    __m128i s0123 = _mm_add_epi32(_mm256_castsi256_si128(h0123), _mm256_extracti128_si256(h0123, 1));
    __m128i s4567 = _mm_add_epi32(_mm256_castsi256_si128(h4567), _mm256_extracti128_si256(h4567, 1));
    return _mm256_set_m128i(s4567, s0123);
}

EB_INLINE float EB_SUFFIX(f16)(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* float16 halves of eight 32-bit words -> float32: the low halves (high = 0) or the high ones (high = 1). */
EB_INLINE __m256 EB_SUFFIX(halves)(__m256i words, int high) {
    const __m256i pick = high ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                                 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                              : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, pick), 0x08); /* qwords 0, 2 */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

/* 16 bytes -> 32 values: byte j's low nibble is element j, its high nibble element j + 16. */
EB_INLINE __m256i EB_SUFFIX(nibbles)(const uint8_t *qs) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xf0), _mm256_set1_epi8(0x0f));
}

/* 32 bits (little-endian) -> 32 bytes of 16 where the bit is set, 0 where not. */
EB_INLINE __m256i EB_SUFFIX(fifth_bits)(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
}

/* A legacy block's 32 values as bytes: unsigned (Q4, Q5: before the zero point) or, Q8_0, signed (AVX2) or
 * made unsigned by + 128 (VNNI). */
EB_INLINE __m256i EB_SUFFIX(legacy_values)(int type, const uint8_t *blk) {
#ifdef EB_VNNI /* vpdpbusd sums u8 x s8 products without saturating: Q8_0's w + 128, less 128 sum(q) after */
    if (type == Q8_0) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8(-128));
#else
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
#endif
    if (type == Q4_0 || type == Q4_1) return EB_SUFFIX(nibbles)(blk + (type == Q4_0 ? 2 : 4));
    const int qh = type == Q5_0 ? 2 : 4;
    return _mm256_or_si256(EB_SUFFIX(nibbles)(blk + qh + 4), EB_SUFFIX(fifth_bits)(blk + qh));
}

/* Those values times 32 activations: eight int32 lanes (Q8_0's signed values as |w| times q with w's sign). */
EB_INLINE __m256i EB_SUFFIX(values_dot)(int type, __m256i u, const int8_t *qx) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)qx);
#ifndef EB_VNNI /* maddubs' int16 pair sums would saturate on w + 128: |w| times q with w's sign */
    if (type == Q8_0) return EB_SUFFIX(dot_u8)(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u));
#endif
    return EB_SUFFIX(dot_u8)(u, q);
}

/* The bytes of one block of a legacy type (ggml-common.h's block_q4_0 ... block_q8_0). */
EB_INLINE int EB_SUFFIX(legacy_bytes)(int type) {
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 34;
}

/* The first four bytes of `count` blocks (d, and m where the block has one) as eight words; none read past the
 * blocks there are. Scalar loads, not a gather: AMD's gathers are microcoded and slow. */
EB_INLINE __m256i EB_SUFFIX(heads)(const uint8_t *blk, int bytes, int count, int has_min) {
    int32_t w[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        w[j] = 0;
        if (j < count) memcpy(&w[j], blk + j * bytes, 4);
    }
    if (!has_min) return _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
    /* Q4_1, Q5_1 (both halves read): GCC 12 builds the setr above from scalar shifts and ors whose registers
     * crowded their single-row loop (Q4_1 1.66 M instructions a call became 2.07 M); vector moves instead */
    __m128i v[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) v[j] = _mm_cvtsi32_si128(w[j]);
    const __m256i pairs0 = _mm256_set_m128i(_mm_unpacklo_epi32(v[4], v[5]), _mm_unpacklo_epi32(v[0], v[1]));
    const __m256i pairs1 = _mm256_set_m128i(_mm_unpacklo_epi32(v[6], v[7]), _mm_unpacklo_epi32(v[2], v[3]));
    return _mm256_unpacklo_epi64(pairs0, pairs1); /* words 0-3 | 4-7 */
}

/* The eight lanes of each row's sums to its y (blocks.h's order). */
EB_INLINE void EB_SUFFIX(totals)(const __m256 *acc, int rows, float *out) {
    for (int r = 0; r < rows; r++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[r]);
        out[r] = lanes_total(lanes);
    }
}

/* acc + blocks b .. b + count - 1's terms for one row of x, from their integer sums isum (before the zero point):
 * blocks.h's float arithmetic, lanes past count masked to d = dx = 0. */
EB_INLINE __m256 EB_SUFFIX(legacy_term)(__m256 acc, __m256i isum, const eb_xrow *x, int64_t b, int count, __m256i mask,
                                        int zero, int has_min, __m256 d, __m256 m) {
    const __m256i sx = count == 8 ? _mm256_loadu_si256((const __m256i *)(x->s32 + b))
                                  : _mm256_maskload_epi32((const int *)(x->s32 + b), mask);
    if (zero) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(sx, zero == 8 ? 3 : zero == 16 ? 4 : 7)); /* zero sx */
    const __m256 dxv = count == 8 ? _mm256_loadu_ps(x->d + b) : _mm256_maskload_ps(x->d + b, mask);
    __m256 term = _mm256_mul_ps(_mm256_mul_ps(d, dxv), _mm256_cvtepi32_ps(isum));
    if (has_min) term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(m, dxv), _mm256_cvtepi32_ps(sx)));
    return _mm256_add_ps(acc, term);
}

/* Blocks b .. b + count - 1 (count <= 8) against `rows` rows of activations, each block unpacked once for all
 * rows, into the rows' lanes. Called with count = 8 for every whole step, so that loop has no conditions, and once
 * with the rest: its other lanes get d = dx = 0 and no products, so they add +0.0, which leaves a lane as it is
 * (a lane starts at +0.0 and so is never -0.0). */
EB_INLINE void EB_SUFFIX(legacy_step)(int type, const uint8_t *blk, int64_t b, int count, const eb_xrow *x, int rows,
                                      __m256 *acc) {
    const int has_min = type == Q4_1 || type == Q5_1;
    const int bytes = EB_SUFFIX(legacy_bytes)(type);
#ifdef EB_VNNI
    const int zero = type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0;
#else
    const int zero = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
#endif
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i u[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) u[j] = j < count ? EB_SUFFIX(legacy_values)(type, blk + j * bytes) : _mm256_setzero_si256();
    const __m256i heads = EB_SUFFIX(heads)(blk, bytes, count, has_min);
    const __m256 d = EB_SUFFIX(halves)(heads, 0), m = has_min ? EB_SUFFIX(halves)(heads, 1) : d;
    for (int r = 0; r < rows; r++) {
        __m256i p[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            p[j] = j < count ? EB_SUFFIX(values_dot)(type, u[j], x[r].q + 32 * (b + j)) : _mm256_setzero_si256();
        acc[r] = EB_SUFFIX(legacy_term)(acc[r], EB_SUFFIX(hsum8)(p), &x[r], b, count, mask, zero, has_min, d, m);
    }
}

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32 against `rows` rows of activations, eight blocks a step. */
EB_INLINE void EB_SUFFIX(legacy_body)(int type, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                                      float *out) {
    const int bytes = EB_SUFFIX(legacy_bytes)(type);
    __m256 acc[1]; /* rows = 1 (EB_LOOPS): an array that small stays in a register */
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) EB_SUFFIX(legacy_step)(type, row + b * bytes, b, 8, x, rows, acc);
    if (b < nb) EB_SUFFIX(legacy_step)(type, row + b * bytes, b, (int)(nb - b), x, rows, acc);
    EB_SUFFIX(totals)(acc, rows, out);
}

/* legacy_step for a tile of rows >= 2: the eight blocks' values transposed once (transpose8), so each row's eight
 * block sums come out of vertical adds against its interleaved activations (eb_xrow.qi), not a horizontal sum. */
EB_INLINE void EB_SUFFIX(legacy_tile_step)(int type, const uint8_t *blk, int64_t b, int count, const eb_xrow *x,
                                           int rows, __m256 *acc) {
    const int has_min = type == Q4_1 || type == Q5_1;
    const int bytes = EB_SUFFIX(legacy_bytes)(type);
#ifdef EB_VNNI
    const int zero = type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0;
    const int sign = 0;
#else
    const int zero = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
    const int sign = type == Q8_0; /* maddubs on |w|, and q with w's sign (values_dot) */
#endif
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    /* maddubs' pair sums that add within int16: 8 of Q4's (<= 2 * 15 * 127), 4 of Q5's, 1 of Q8_0's */
    const int chunk = type == Q8_0 ? 1 : type == Q4_0 || type == Q4_1 ? 8 : 4;
    __m256i u[8], w[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) u[j] = j < count ? EB_SUFFIX(legacy_values)(type, blk + j * bytes) : _mm256_setzero_si256();
    EB_SUFFIX(transpose8)(u);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        w[c] = u[c];
        if (sign) u[c] = _mm256_sign_epi8(u[c], u[c]);
    }
    const __m256i heads = EB_SUFFIX(heads)(blk, bytes, count, has_min);
    const __m256 d = EB_SUFFIX(halves)(heads, 0), m = has_min ? EB_SUFFIX(halves)(heads, 1) : d;
    for (int r = 0; r < rows; r++) {
        /* b is a multiple of 8: the run of 256 interleaved values of blocks b .. b + 7 */
        const __m256i isum = EB_SUFFIX(lane_dots)(u, sign ? w : NULL, x[r].qi + 32 * b, 0, 8, chunk, u[0], 0);
        acc[r] = EB_SUFFIX(legacy_term)(acc[r], isum, &x[r], b, count, mask, zero, has_min, d, m);
    }
}

/* legacy_body for a tile of 2 to EB_ROWS rows. */
EB_INLINE void EB_SUFFIX(legacy_tile)(int type, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                                      float *out) {
    const int bytes = EB_SUFFIX(legacy_bytes)(type);
    __m256 acc[EB_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) EB_SUFFIX(legacy_tile_step)(type, row + b * bytes, b, 8, x, rows, acc);
    if (b < nb) EB_SUFFIX(legacy_tile_step)(type, row + b * bytes, b, (int)(nb - b), x, rows, acc);
    EB_SUFFIX(totals)(acc, rows, out);
}

/* One specialised loop a type and a way: a row at a time (decode: the blocks as they are, horizontal sums) or a
 * tile of 2 to EB_ROWS rows (prompts: the blocks transposed once for all the tile's rows); each its own function, so
 * the compiler allocates one loop's registers without the other's (together, Q4_1's single row spilled). */
#define EB_LOOPS(name, body, tile, first)                                                                        \
    static __attribute__((noinline)) void EB_SUFFIX(name##_decode)(const uint8_t *row, int64_t nb, const eb_xrow *x, \
                                                                float *out) {                                  \
        body(first, row, nb, x, 1, out);                                                                        \
    }                                                                                                           \
    static __attribute__((noinline)) void EB_SUFFIX(name##_prompt)(const uint8_t *row, int64_t nb, const eb_xrow *x, \
                                                                 int rows, float *out) {                        \
        tile(first, row, nb, x, rows, out);                                                                     \
    }
#define EB_BY_ROWS(name, row, nb, x, rows, out) \
    if (rows == 1)                               \
        EB_SUFFIX(name##_decode)(row, nb, x, out);  \
    else                                         \
        EB_SUFFIX(name##_prompt)(row, nb, x, rows, out);

EB_LOOPS(q4_0, EB_SUFFIX(legacy_body), EB_SUFFIX(legacy_tile), Q4_0)
EB_LOOPS(q4_1, EB_SUFFIX(legacy_body), EB_SUFFIX(legacy_tile), Q4_1)
EB_LOOPS(q5_0, EB_SUFFIX(legacy_body), EB_SUFFIX(legacy_tile), Q5_0)
EB_LOOPS(q5_1, EB_SUFFIX(legacy_body), EB_SUFFIX(legacy_tile), Q5_1)
EB_LOOPS(q8_0, EB_SUFFIX(legacy_body), EB_SUFFIX(legacy_tile), Q8_0)

static void EB_SUFFIX(dot_legacy)(const eb_type *t, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                                  float *out) {
    switch (t->type) {
    case Q4_0: EB_BY_ROWS(q4_0, row, nb, x, rows, out) break;
    case Q4_1: EB_BY_ROWS(q4_1, row, nb, x, rows, out) break;
    case Q5_0: EB_BY_ROWS(q5_0, row, nb, x, rows, out) break;
    case Q5_1: EB_BY_ROWS(q5_1, row, nb, x, rows, out) break;
    default: EB_BY_ROWS(q8_0, row, nb, x, rows, out) break;
    }
}

/* One super-block's eight groups of 32 into the eight lanes: the float arithmetic of blocks.h. */
EB_INLINE __m256 EB_SUFFIX(k_term)(__m256i isum, __m256i msum, float d, float mf, int has_min, const float *dx) {
    const __m256 dxv = _mm256_loadu_ps(dx);
    __m256 term = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), dxv), _mm256_cvtepi32_ps(isum));
    if (has_min) term = _mm256_add_ps(term, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(mf), dxv), _mm256_cvtepi32_ps(msum)));
    return term;
}

/* A Q4_K / Q5_K super-block's eight groups of 32 values as bytes (u[j]: group j), its scales and minimums (int32
 * lanes 0-7). */
EB_INLINE void EB_SUFFIX(k4_values)(int five, const uint8_t *blk, __m256i *u, __m256i *scales, __m256i *mins) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    const uint8_t *qs = blk + (five ? 48 : 16);
    uint32_t words[4];
    scale_words(blk + 4, words);
    const __m128i packed = _mm_setr_epi32((int)words[0], (int)words[1], (int)words[2], (int)words[3]);
    *scales = _mm256_cvtepu8_epi32(packed);                  /* sc 0-7 */
    *mins = _mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)); /* mn 0-7 */
    const __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; pair++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * pair));
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if (five) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * pair), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * pair + 1), one), 4));
        }
        u[2 * pair] = lo;
        u[2 * pair + 1] = hi;
    }
}

/* Q4_K, Q5_K: super-blocks of 256, eight runs of 32 with 6-bit scales and minimums: group j is run j. */
EB_INLINE void EB_SUFFIX(k4_body)(int five, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows, float *out) {
    const int bytes = five ? 176 : 144;
    __m256 acc[1]; /* rows = 1 (EB_LOOPS): an array that small stays in a register */
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes;
        __m256i u[8], scales, mins;
        EB_SUFFIX(k4_values)(five, blk, u, &scales, &mins);
        const float d = EB_SUFFIX(f16)(blk), mf = -EB_SUFFIX(f16)(blk + 2);
        for (int r = 0; r < rows; r++) {
            const int8_t *q = x[r].q + 256 * b;
            __m256i p[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) p[j] = EB_SUFFIX(dot_u8)(u[j], _mm256_loadu_si256((const __m256i *)(q + 32 * j)));
            const __m256i isum = _mm256_mullo_epi32(EB_SUFFIX(hsum8)(p), scales);
            const __m256i msum = _mm256_mullo_epi32(mins, _mm256_loadu_si256((const __m256i *)(x[r].s32 + 8 * b)));
            acc[r] = _mm256_add_ps(acc[r], EB_SUFFIX(k_term)(isum, msum, d, mf, 1, x[r].d + 8 * b));
        }
    }
    EB_SUFFIX(totals)(acc, rows, out);
}

/* k4_body for a tile of 2 to EB_ROWS rows: the groups transposed once (transpose8), each lane's run scale folded
 * into the sums (lane_dots), so a row's eight scaled sums are vertical adds. */
EB_INLINE void EB_SUFFIX(k4_tile)(int five, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows, float *out) {
    const int bytes = five ? 176 : 144;
    __m256 acc[EB_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes;
        __m256i u[8], scales, mins;
        EB_SUFFIX(k4_values)(five, blk, u, &scales, &mins);
        EB_SUFFIX(transpose8)(u);
        const float d = EB_SUFFIX(f16)(blk), mf = -EB_SUFFIX(f16)(blk + 2);
        for (int r = 0; r < rows; r++) {
            /* pair sums <= 2 * 15 * 127 (Q4_K: 8 add within int16) or 2 * 31 * 127 (Q5_K: 4) */
            const __m256i isum = EB_SUFFIX(lane_dots)(u, NULL, x[r].qi + 256 * b, 0, 8, five ? 4 : 8, scales, 1);
            const __m256i msum = _mm256_mullo_epi32(mins, _mm256_loadu_si256((const __m256i *)(x[r].s32 + 8 * b)));
            acc[r] = _mm256_add_ps(acc[r], EB_SUFFIX(k_term)(isum, msum, d, mf, 1, x[r].d + 8 * b));
        }
    }
    EB_SUFFIX(totals)(acc, rows, out);
}

/* A Q6_K super-block's eight groups of 32 values q (u[c]: group c, before the - 32) as bytes. */
EB_INLINE void EB_SUFFIX(q6_k_values)(const uint8_t *blk, __m256i *u) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
#pragma GCC unroll 4
        for (int slot = 0; slot < 4; slot++) { /* group 4 h + slot: elements 128 h + 32 slot .. + 31 */
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(slot % 2 ? l1 : l0, 4 * (slot / 2)), low4);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * slot), low2);
            u[4 * h + slot] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
        }
    }
}

/* 32 sum(x) of each group's two runs times their scales (the - 32 of the values): lane g for group g. scales: the
 * int16 scales 0-15 in order; s16: the row's int16 sums of 16 for this super-block. */
EB_INLINE __m256i EB_SUFFIX(q6_k_offsets)(__m256i scales, const int16_t *s16) {
    return _mm256_slli_epi32(_mm256_madd_epi16(scales, _mm256_loadu_si256((const __m256i *)s16)), 5);
}

/* Q6_K: super-blocks of 256, sixteen runs of 16 with int8 scales, two runs a group of 32; values q - 32 as q times
 * x less 32 sum(x). */
EB_INLINE void EB_SUFFIX(q6_k_body)(int unused, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                                    float *out) {
    (void)unused;
    const __m256i split = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    __m256 acc[1]; /* rows = 1 (EB_LOOPS): an array that small stays in a register */
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))); /* int16 0-15 */
        __m256i u[8], scale[8];
        EB_SUFFIX(q6_k_values)(blk, u);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) /* runs 2 c (lanes 0-3) and 2 c + 1 (lanes 4-7): word c of the scales, halved */
            scale[c] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(scales, _mm256_set1_epi32(c)), split);
        const float d = EB_SUFFIX(f16)(blk + 208);
        for (int r = 0; r < rows; r++) {
            const int8_t *q = x[r].q + 256 * b;
            __m256i p[8];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                p[c] = EB_SUFFIX(scaled_dot)(_mm256_setzero_si256(), u[c], _mm256_loadu_si256((const __m256i *)(q + 32 * c)),
                                             scale[c]);
            const __m256i isum = _mm256_sub_epi32(EB_SUFFIX(hsum8)(p), EB_SUFFIX(q6_k_offsets)(scales, x[r].s16 + 16 * b));
            acc[r] = _mm256_add_ps(acc[r], EB_SUFFIX(k_term)(isum, isum, d, 0.0f, 0, x[r].d + 8 * b));
        }
    }
    EB_SUFFIX(totals)(acc, rows, out);
}

/* q6_k_body for a tile of 2 to EB_ROWS rows: the groups transposed once; vectors 0-3 of a group are its first run
 * of 16 (values 0-15), 4-7 its second, so two scale vectors (lane l: run 2 l's scale, or 2 l + 1's) fold the
 * scales into the pair sums. */
EB_INLINE void EB_SUFFIX(q6_k_tile)(int unused, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                                    float *out) {
    (void)unused;
    __m256 acc[EB_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))); /* int16 0-15 */
        /* lane l: run 2 l's scale (the group's values 0-15), run 2 l + 1's (16-31), as int32 */
        const __m256i scale0 = _mm256_srai_epi32(_mm256_slli_epi32(scales, 16), 16), scale1 = _mm256_srai_epi32(scales, 16);
        __m256i u[8];
        EB_SUFFIX(q6_k_values)(blk, u);
        EB_SUFFIX(transpose8)(u);
        const float d = EB_SUFFIX(f16)(blk + 208);
        for (int r = 0; r < rows; r++) {
            const int8_t *q = x[r].qi + 256 * b;
            /* pair sums <= 2 * 63 * 127: 2 add within int16 */
            __m256i isum = _mm256_add_epi32(EB_SUFFIX(lane_dots)(u, NULL, q, 0, 4, 2, scale0, 1),
                                            EB_SUFFIX(lane_dots)(u, NULL, q, 4, 4, 2, scale1, 1));
            isum = _mm256_sub_epi32(isum, EB_SUFFIX(q6_k_offsets)(scales, x[r].s16 + 16 * b));
            acc[r] = _mm256_add_ps(acc[r], EB_SUFFIX(k_term)(isum, isum, d, 0.0f, 0, x[r].d + 8 * b));
        }
    }
    EB_SUFFIX(totals)(acc, rows, out);
}

EB_LOOPS(q4_k, EB_SUFFIX(k4_body), EB_SUFFIX(k4_tile), 0)
EB_LOOPS(q5_k, EB_SUFFIX(k4_body), EB_SUFFIX(k4_tile), 1)
EB_LOOPS(q6_k, EB_SUFFIX(q6_k_body), EB_SUFFIX(q6_k_tile), 0)

static void EB_SUFFIX(dot_k4)(const eb_type *t, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                              float *out) {
    if (t->type == Q5_K) {
        EB_BY_ROWS(q5_k, row, nb, x, rows, out)
    } else {
        EB_BY_ROWS(q4_k, row, nb, x, rows, out)
    }
}

static void EB_SUFFIX(dot_q6_k)(const eb_type *t, const uint8_t *row, int64_t nb, const eb_xrow *x, int rows,
                                float *out) {
    (void)t;
    EB_BY_ROWS(q6_k, row, nb, x, rows, out)
}
