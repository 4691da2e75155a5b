/* K-quants' super-blocks summed as integers, with 8-bit activations (one plane): Q4_K, Q5_K and Q6_K.
 *
 * A row's products with a super-block are d_a * (d * I - dmin * M), d_a the activations' scale, d and dmin the
 * weight row's, and two integers made exactly in 32 bits:
 *     I = sum over sub-blocks (Q6_K: halves) of the integer scale sc times (the codes' sum with the activations
 *         less Q6_K's offset of 32 codes times the activations' sum): |I| < 2^29;
 *     M = sum over sub-blocks of the 6-bit minimum times the activations' sum (Q4_K, Q5_K): < 2^21.
 * Each is rounded once, where the float path (the exact path's two planes, whose sums do not fit) rounds every
 * sub-block's product. With vpmaddubsw's 16-bit sums, the widening vpmaddwd multiplies them by the scales rather
 * than by ones, and M is 4 vpmaddwd of minimums' pairs with the activations' (activations.h's pair16): llama.cpp's
 * AVX2 Q4_K does the same. Where 32-bit sums come first (VNNI, plain C), sc multiplies them: the same integers.
 */
#ifndef WSGI_INFER_K_SUMS_H
#define WSGI_INFER_K_SUMS_H
#include "activations.h"
#include "k_quants.h"
#include "rotated.h"

#define K_SUB_BLOCKS 8 /* blocks of 32 activations a super-block */

static inline int integer_sums(const int type, const int planes) {
    return planes == 1 && (type == Q4_K || type == Q5_K || type == Q6_K);
}

static inline const act_head *head_at(const uint8_t *a) { return (const act_head *)a; }

/* sums[r] + row r's I over a decoded sub-block (row r's activation block at a + r * act); `rotated`: diagonal r's
 * (rotated.h: a, the group's block's lines) */
ALWAYS_INLINE void k_rows_sums(const int type, const decoded *w, const uint8_t *a, const int64_t act, const int rows,
                               const int rotated, ivec sums[]) {
    const int codes = type == Q4_K ? CODES_4BIT : type == Q5_K ? CODES_5BIT : CODES_6BIT;
    const int8_t *q = (const int8_t *)(rotated ? a : a + sizeof(act_head));
    dot_rows(w->w, q, act, rows, codes, type == Q6_K, w->sc, rotated, sums, NULL);
    if (type != Q6_K) return;
    /* less 32 codes times each half's activations: the halves' scales times -32 (at most 2^12 in magnitude) with
     * their activations' sums, one multiply-add (vpdpwssd, where a shift and a subtraction followed a vpmaddwd) */
    const ivec less = pair_lanes(w->sc[0] * -32, w->sc[1] * -32);
    for (int r = 0; r < rows; r++) {
        const ivec halves = rotated ? rotated_words(a, ROT_HALVES16, r) : (ivec){0} + head_at(a + r * act)->halves16;
        sums[r] = dot16_add(sums[r], less, halves);
    }
}

/* a super-block's weight side of the totals (part h of a tile's block): d, -dmin and the minimums of sub-blocks 2p
 * and 2p + 1 in a lane's halves */
typedef struct {
    fvec d, less;
    ivec pairs[4];
} k_weight_terms;

ALWAYS_INLINE k_weight_terms k_terms(const int type, const uint8_t *block, const int h) {
    k_weight_terms t = {load_halves((const f16 *)block + QL * h), {0}, {{0}}};
    if (type == Q6_K) return t;
    t.less = -load_halves((const f16 *)(block + 32) + QL * h);
    const k_scales s = k_unpack_scales(block + 64, h);
    for (int p = 0; p < 4; p++) t.pairs[p] = (ivec)lane_byte_pair(s.low[p / 2], 2 * p % 4);
    return t;
}

/* acc + one row's products with the super-block (per lane: a diagonal's rows, rotated.h): its I, its activations'
 * pair sums of blocks 2p and 2p + 1 (act_head's pair16) and the span's scale d_a */
ALWAYS_INLINE fvec k_row_total(const int type, const k_weight_terms *t, const ivec sum, const ivec pair16[4],
                               const fvec d_a, const fvec acc) {
    fvec total = t->d * to_f(sum);
    if (type != Q6_K) {
        ivec m = {0};
        for (int p = 0; p < 4; p++) m = dot16_add(m, t->pairs[p], pair16[p]);
        total = fma_v(to_f(m), t->less, total);
    }
    return fma_v(total, d_a, acc);
}

/* acc[r] + row r's products with a super-block of a tile (part h), its I in sums[r]; row r's activation block j of
 * the super-block at x + (j * ACT_ROWS + r) * act, or `rotated`, diagonal r's, block j's lines at x + j * ROT_BYTES */
ALWAYS_INLINE void k_add_totals(const int type, const uint8_t *block, const int h, const int rows, const uint8_t *x,
                                const int64_t act, const int rotated, const ivec sums[], fvec acc[]) {
    const k_weight_terms t = k_terms(type, block, h);
    /* unrolled, so that the sums stay registers: a rolled loop indexed them in memory, and GCC stored every row's
     * sum there after each sub-block (Zen 4, 512 rows of 4,096 x 2,048 Q4_K: 309 -> 319 G MAC/s; AVX2 unchanged) */
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        ivec pair16[4];
        fvec d_a; /* the span's scale, as its last block holds it */
        if (rotated) {
            for (int p = 0; p < 4; p++) pair16[p] = rotated_words(x + 2 * p * ROT_BYTES, ROT_PAIR16, r);
            d_a = (fvec)rotated_words(x + (K_SUB_BLOCKS - 1) * ROT_BYTES, ROT_D, r);
        } else {
            for (int p = 0; p < 4; p++) pair16[p] = (ivec){0} + head_at(x + (2 * p * ACT_ROWS + r) * act)->pair16;
            d_a = splat_v(head_at(x + ((K_SUB_BLOCKS - 1) * ACT_ROWS + r) * act)->d);
        }
        acc[r] = k_row_total(type, &t, sums[r], pair16, d_a, acc[r]);
    }
}
#endif
