/* A pass's sub-block: how each format's codes are read (their offset, their minimums, their halves), its decoding,
 * and how one row's integer sums with it become floats (packed_mm.c's comment has the arithmetic). Shared by the
 * passes in registers (packed_mm.c) and on AMX's tiles (amx_mm.c), so that both round alike. */
#ifndef WSGI_INFER_SUB_BLOCKS_H
#define WSGI_INFER_SUB_BLOCKS_H
#include "activations.h"
#include "k_sums.h"

/* the exact path's integer sum from its two planes' sums: 255 * hi + lo, in 32 bits (at most 2^28) */
static inline ivec two_planes(const ivec hi, const ivec lo) { return (ivec)(((wvec)hi << 8) - (wvec)hi) + lo; }

static inline int sub_blocks(const int type) { return is_k(type) ? 8 : 1; } /* 32-input sub-blocks a block */
static inline int halves_scaled(const int type) { return type == Q6_K; }   /* a scale per 16 inputs */
static inline int code_offset(const int type) { /* codes a format's weights are offset by (0: none) */
    if (is_iq4(type) || type == Q8_0) return SIGNED_CODES ? 0 : 128;
    return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : 0;
}
static inline int own_minimums(const int type) { /* w = s * code + m, m a block's own */
    return type == Q4_1 || type == Q5_1 || type == Q8_M || type == Q4_K || type == Q5_K;
}
static inline int code_kind(const int type) { /* dot_products.h's dot_sub */
    if (is_iq4(type) || type == Q8_0) return SIGNED_CODES ? CODES_SIGNED : CODES_BYTES;
    if (type == Q8_M) return CODES_BYTES;
    if (type == Q6_K) return CODES_6BIT;
    return type == Q5_0 || type == Q5_1 || type == Q5_K ? CODES_5BIT : CODES_4BIT;
}

ALWAYS_INLINE void decode(const int type, const uint8_t *block, int j, int h, const k_scales *ks, decoded *out) {
    if (is_k(type))
        decode_k(type, block, j, h, ks, out);
    else
        decode_legacy(type, block, h, out);
}

/* acc + one row's products with a decoded sub-block of a 32-input format (d: the block's), sum its integer sum */
ALWAYS_INLINE fvec row_step(const int type, const decoded *w, const uint8_t *a, ivec sum, fvec acc) {
    const act_head *head = (const act_head *)a;
    acc = fma_v(to_f(sum), w->s[0] * splat_v(head->d), acc);
    return own_minimums(type) ? fma_v(w->m, splat_v(head->s), acc) : acc;
}

/* sb + one row's products with a decoded sub-block of a K-quant, before the super-block's activation scale */
ALWAYS_INLINE fvec k_row_step(const int type, const decoded *w, const uint8_t *a, ivec lo, ivec hi, fvec sb) {
    if (halves_scaled(type)) return fma_v(to_f(hi), w->s[1], fma_v(to_f(lo), w->s[0], sb));
    if (!own_minimums(type)) return fma_v(to_f(lo), w->s[0], sb);
    return fma_v(w->m, splat_v(((const act_head *)a)->sum_f), fma_v(to_f(lo), w->s[0], sb));
}

/* AVX-512: the rows unrolled and each row's register copied whole, so that a pass's sums stay registers. Lanes read
 * from acc kept them in memory, stored after every block (Zen 4, 512 rows of 4,096 x 2,048: Q4_0 318 -> 335 G MAC/s,
 * Q8_0 316 -> 327). With AVX2's 16 registers the rolled loop made the faster code (Q4_0 218 against 176). */
ALWAYS_INLINE void store_rows(const fvec *acc, int rows, int h, int width, float *out, int64_t out_stride) {
#if QL == 16
#pragma GCC unroll 16
#endif
    for (int r = 0; r < rows; r++) {
#if QL == 16
        const fvec copied = acc[r];
        const float *row = (const float *)&copied;
#else
        const float *row = (const float *)(acc + r);
#endif
        if (width >= (h + 1) * QL) { /* a whole register's outputs: one store (lane by lane, 7% of a pass on tiles) */
            memcpy(out + r * out_stride + h * QL, row, sizeof(fvec));
            continue;
        }
        for (int lane = 0; lane < QL && h * QL + lane < width; lane++) out[r * out_stride + h * QL + lane] = row[lane];
    }
}
#endif
