/* The SIMD row dots, included by blocks.c once per ISA (EB_SUFFIX names them, EB_VNNI picks the integer dot):
 * AVX2 (maddubs + madd) and AVX-512 VNNI (vpdpbusd on 256-bit vectors). Integer sums inside a block, then the
 * reference's float arithmetic in its order (blocks.h), so the result equals dot_scalar's bit for bit. */

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

EB_INLINE int32_t EB_SUFFIX(hsum)(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

EB_INLINE float EB_SUFFIX(f16)(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes -> 32 values: byte j's low nibble is element j, its high nibble element j + 16. */
EB_INLINE __m256i EB_SUFFIX(nibbles)(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
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

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: a block of 32 against one block of activations. */
EB_INLINE float EB_SUFFIX(legacy_body)(int type, const uint8_t *row, int64_t nb, const int8_t *qx,
                                       const float *dx, const int32_t *s16) {
    const int has_min = type == Q4_1 || type == Q5_1, bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20
                                                              : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 34;
    const int zero = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes;
        __m256i q = _mm256_loadu_si256((const __m256i *)(qx + 32 * b)), p;
        if (type == Q8_0) {  /* signed values: |w| times q with w's sign */
            __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            p = EB_SUFFIX(dot_u8)(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
        } else if (type == Q4_0 || type == Q4_1) {
            p = EB_SUFFIX(dot_u8)(EB_SUFFIX(nibbles)(blk + (type == Q4_0 ? 2 : 4)), q);
        } else {
            const int qh = type == Q5_0 ? 2 : 4;
            __m256i u = _mm256_or_si256(EB_SUFFIX(nibbles)(blk + qh + 4), EB_SUFFIX(fifth_bits)(blk + qh));
            p = EB_SUFFIX(dot_u8)(u, q);
        }
        const int32_t sx = s16[2 * b] + s16[2 * b + 1];
        const int32_t isum = EB_SUFFIX(hsum)(p) - zero * sx;
        float term = (EB_SUFFIX(f16)(blk) * dx[b]) * (float)isum;
        if (has_min) term = term + (EB_SUFFIX(f16)(blk + 2) * dx[b]) * (float)sx;
        acc = acc + term;
    }
    return acc;
}

static float EB_SUFFIX(dot_legacy)(const eb_type *t, const uint8_t *row, int64_t nb, const int8_t *qx,
                                   const float *dx, const int32_t *s16) {
    switch (t->type) {  /* one specialised loop a type */
    case Q4_0: return EB_SUFFIX(legacy_body)(Q4_0, row, nb, qx, dx, s16);
    case Q4_1: return EB_SUFFIX(legacy_body)(Q4_1, row, nb, qx, dx, s16);
    case Q5_0: return EB_SUFFIX(legacy_body)(Q5_0, row, nb, qx, dx, s16);
    case Q5_1: return EB_SUFFIX(legacy_body)(Q5_1, row, nb, qx, dx, s16);
    default: return EB_SUFFIX(legacy_body)(Q8_0, row, nb, qx, dx, s16);
    }
}

/* x's products with sub-scales: sc16 holds each lane's run scale as int16 pairs (AVX2) or int32 (VNNI). */
EB_INLINE __m256i EB_SUFFIX(scaled_dot)(__m256i u, __m256i s, __m256i scale) {
#ifdef EB_VNNI
    return _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), scale);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
#endif
}

EB_INLINE __m256i EB_SUFFIX(lane_scales)(int low, int high) {  /* lanes 0-3: low, 4-7: high */
#ifdef EB_VNNI
    return _mm256_setr_epi32(low, low, low, low, high, high, high, high);
#else
    return _mm256_setr_epi16((short)low, (short)low, (short)low, (short)low, (short)low, (short)low, (short)low,
                             (short)low, (short)high, (short)high, (short)high, (short)high, (short)high,
                             (short)high, (short)high, (short)high);
#endif
}

/* Q4_K, Q5_K: super-blocks of 256, eight runs of 32 with 6-bit scales and minimums. */
EB_INLINE float EB_SUFFIX(k4_body)(int five, const uint8_t *row, int64_t nb, const int8_t *qx, const float *dx,
                                   const int32_t *s16) {
    const int bytes = five ? 176 : 144;
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes, *qs = blk + (five ? 48 : 16);
        const int8_t *q = qx + 256 * b;
        int16_t sc[8], mn[8];
        scale_min_k4(blk + 4, sc, mn);
        __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m256i sums = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * p), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * p + 1), one), 4));
            }
            const __m256i q_lo = _mm256_loadu_si256((const __m256i *)(q + 64 * p));
            const __m256i q_hi = _mm256_loadu_si256((const __m256i *)(q + 64 * p + 32));
            sums = _mm256_add_epi32(sums, EB_SUFFIX(scaled_dot)(lo, q_lo, EB_SUFFIX(lane_scales)(sc[2 * p], sc[2 * p])));
            sums = _mm256_add_epi32(sums, EB_SUFFIX(scaled_dot)(hi, q_hi, EB_SUFFIX(lane_scales)(sc[2 * p + 1], sc[2 * p + 1])));
        }
        int32_t msum = 0;
        for (int j = 0; j < 8; j++) msum += mn[j] * (s16[16 * b + 2 * j] + s16[16 * b + 2 * j + 1]);
        const int32_t isum = EB_SUFFIX(hsum)(sums);
        float term = (EB_SUFFIX(f16)(blk) * dx[b]) * (float)isum;
        term = term + (-EB_SUFFIX(f16)(blk + 2) * dx[b]) * (float)msum;
        acc = acc + term;
    }
    return acc;
}

static float EB_SUFFIX(dot_k4)(const eb_type *t, const uint8_t *row, int64_t nb, const int8_t *qx, const float *dx,
                               const int32_t *s16) {
    return t->type == Q5_K ? EB_SUFFIX(k4_body)(1, row, nb, qx, dx, s16) : EB_SUFFIX(k4_body)(0, row, nb, qx, dx, s16);
}

/* Q6_K: super-blocks of 256, sixteen runs of 16 with int8 scales; values q - 32 as q times x less 32 sum(x). */
static float EB_SUFFIX(dot_q6_k)(const eb_type *t, const uint8_t *row, int64_t nb, const int8_t *qx,
                                 const float *dx, const int32_t *s16) {
    (void)t;
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192), *q = qx + 256 * b;
        __m256i sums = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {  /* elements 32 c .. 32 c + 31: half h, slot t */
            const int h = c / 4, slot = c % 4;
            __m256i low = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (slot % 2)));
            low = _mm256_and_si256(_mm256_srli_epi16(low, 4 * (slot / 2)), low4);
            __m256i high = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            high = _mm256_and_si256(_mm256_srli_epi16(high, 2 * slot), low2);
            const __m256i u = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
            const __m256i x = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            sums = _mm256_add_epi32(sums, EB_SUFFIX(scaled_dot)(u, x, EB_SUFFIX(lane_scales)(sc[2 * c], sc[2 * c + 1])));
        }
        int32_t offset = 0;
        for (int r = 0; r < 16; r++) offset += sc[r] * s16[16 * b + r];
        const int32_t isum = EB_SUFFIX(hsum)(sums) - 32 * offset;
        acc = acc + (EB_SUFFIX(f16)(blk + 208) * dx[b]) * (float)isum;
    }
    return acc;
}
