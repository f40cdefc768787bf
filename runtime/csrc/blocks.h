/* y = x · Wᵀ on a tensor's GGUF blocks exactly as the file stores them (edgelm's native kernels).
 *
 * W is N rows of `row_bytes` bytes, each row K / block_elems blocks of one ggml block type (ggml-common.h's
 * block_q4_0 ... block_q6_K). x (M rows of K floats) is quantized to int8 per group of 32 first, for every type
 * (llama.cpp's Q8_0; finer than its Q8_K for the K-quants): dx = amax / 127, q = round half to even (x / dx).
 * Every path computes the same numbers: inside a group of 32 weights integer sums (exact: the runs' integer scales
 * times their dot products, and the minimums times the sums of q), then per group g, in float32 and in this order,
 *   term = (d * dx[g]) * isum  [+ (mf * dx[g]) * msum]   (d, mf: the block's float16 scale and offset factor)
 * added into one of eight partial sums, acc[g % 8] = acc[g % 8] + term (groups in order), and
 *   y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)):
 * eight lanes of a float32 vector, summed as a vector's halves are. blocks.c's scalar path is the reference; the
 * SIMD paths (blocks_simd.h) equal it bit for bit. */
#ifndef EDGELM_BLOCKS_H
#define EDGELM_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#define EB_API __attribute__((visibility("default")))

enum eb_isa { EB_SCALAR = 0, EB_AVX2 = 1, EB_AVX512VNNI = 2, EB_ISA_COUNT = 3 };

/* The bytes and elements of one block of ggml type `type`; -1 for a type these kernels do not read. */
EB_API int eb_block_shape(int type, int *block_elems, int *block_bytes);
/* The ISA this CPU runs best (picked once, on the first call; EDGELM_NATIVE_ISA=scalar|avx2|avx512vnni caps it). */
EB_API int eb_best_isa(void);
/* Whether this CPU can run `isa`. */
EB_API int eb_isa_supported(int isa);
EB_API const char *eb_isa_name(int isa);

/* Bytes of the workspace that holds M rows of K activations quantized for `type`. */
EB_API size_t eb_workspace_bytes(int type, int64_t m, int64_t k);
/* Quantize x (M, K) for `type` into `workspace` (eb_workspace_bytes of it); 0, or -1 for a bad type or K. */
EB_API int eb_quantize(int type, const float *x, int64_t m, int64_t k, void *workspace);
/* The same for rows [row_start, row_stop) of x only (the custom op quantizes rows on several threads). */
EB_API int eb_quantize_rows(int type, const float *x, int64_t m, int64_t k, void *workspace, int64_t row_start,
                            int64_t row_stop);
/* y[i, n] for every row i < M and n_start <= n < n_stop (y: M rows of `ldy` floats) from quantized activations. */
EB_API void eb_matmul_rows(int type, int isa, const void *workspace, int64_t m, int64_t k, const uint8_t *w,
                           int64_t n_start, int64_t n_stop, float *y, int64_t ldy);
/* Both steps on one thread (tests and ctypes); 0, or -1 for a bad type, K or ISA. */
EB_API int eb_matmul(int type, int isa, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y);
/* One row of K weights as float32 (the embedding gather): w = d * sc * c + offset, in float32. 0 or -1. */
EB_API int eb_dequantize_row(int type, const uint8_t *row, int64_t k, float *out);

#endif
