/* Q4_K, Q5_K and Q6_K with 8-bit activations on AMX's tiles: a super-block's integer sum (k_sums.h's I) made whole
 * in the tiles, with no sub-block's sums stored and scaled apart.
 *
 * I = sum over sub-blocks j of sc_j times the codes' products with the activations (Q6_K: sc per 16 inputs, codes
 * less 32) = the sum over the super-block's inputs of (sc * code) times the activation. Each weight's sc * code
 * (at most 63 * 31; Q6_K's between -4,096 and 4,064) is held as two bytes, sc * code = 256 * hi + lo with lo
 * unsigned: the tiles sum lo's and hi's products over all 8 sub-blocks, and I = 256 * HI + LO, the very integer
 * the registers' path makes. A tile multiply takes two sub-blocks (64 codes a row: the rows' codes are laid out in
 * pairs of blocks once per multiply, amx_pair_codes, the whole of a multiply's depth where a sub-block is half), so
 * a super-block of 16 rows takes 8 multiplies into 4 tiles of sums, 4 stores, and 16 rows' sums added, where the
 * sub-block route (amx_mm.c) stores and scales 8 tiles of sums; the totals' activation sums and scale lie beside
 * the codes (k_row_head), not across 5 blocks' heads. The codes times their scales are made once per task
 * (split_codes), as that route's decoding is. (4,096 x 2,048 Q4_K, 512 rows: 549-564 G multiply-adds a second with
 * one sub-block a multiply and the heads read where quantize_activations wrote them, 701-759 now.)
 */
#ifndef WSGI_INFER_AMX_K_SUMS_H
#define WSGI_INFER_AMX_K_SUMS_H
#include "sub_blocks.h"

typedef struct {
    wvec lo[16], hi[16]; /* two sub-blocks' quads (quant_simd.h's layout), as the two bytes of sc * code */
} split_codes;

/* a row's super-block, beside its group's codes (amx_pair_codes): act_head's pair16 of its blocks 0, 2, 4 and 6, and
 * the span's scale: the totals read them from a few lines, not from 5 blocks' heads across the activations */
typedef struct {
    int32_t pair16[4];
    float d;
} k_row_head;

/* a group of AMX_ROWS rows of k inputs in amx_pair_codes's layout: [pair of blocks][row][64 codes], then
 * [super-block][row] of k_row_head */
static inline int64_t group_bytes(int64_t k) { return AMX_ROWS * k + k / 256 * AMX_ROWS * (int64_t)sizeof(k_row_head); }

typedef uint16_t u16_lanes __attribute__((vector_size(QL * 4)));
typedef int16_t i16_lanes __attribute__((vector_size(QL * 4)));

/* a decoded sub-block's codes times their integer scales (less Q6_K's offset of 32 codes), as the first (`second`
 * 0) or second half of a pair's split_codes */
ALWAYS_INLINE void split_scaled(const int type, const decoded *w, const int second, split_codes *pair) {
    wvec *lo = pair->lo + 8 * second, *hi = pair->hi + 8 * second;
    for (int i = 0; i < 8; i++) {
        const i16_lanes scale = (i16_lanes)pair_lanes(w->sc[i / 4], w->sc[i / 4]); /* each lane's in both halves */
        i16_lanes even = (i16_lanes)(w->w[i] & 0x00FF00FFu) * scale;
        i16_lanes odd = (i16_lanes)((w->w[i] >> 8) & 0x00FF00FFu) * scale;
        if (type == Q6_K) even -= 32 * scale, odd -= 32 * scale;
        lo[i] = (wvec)(((u16_lanes)even & 0xFF) | (((u16_lanes)odd & 0xFF) << 8));
        hi[i] = (wvec)(((u16_lanes)even >> 8) | ((u16_lanes)odd & 0xFF00));
    }
}

/* the tiles (amx_mm.c's K_CONFIG): 0-1 activations (16 rows x 64 codes: two sub-blocks, amx_pair_codes's layout),
 * 2 and 3 two sub-blocks' lo and hi bytes (16 quads), 4-7 sums. One group of 16 rows: LO and HI of even and odd
 * pairs apart (4-5, 6-7), so that a multiply need not wait for the last. Two groups (32 rows, from q and q + apart):
 * LO of each (4, 5) and HI of each (6, 7), each pair's codes loaded once for both: oneDNN's 2 x 2 blocking. */
#define K_MULTIPLY_HI(C, A, B)                                                                                      \
    do {                                                                                                            \
        if (type == Q6_K)                                                                                           \
            _tile_dpbssd(C, A, B);                                                                                  \
        else                                                                                                        \
            _tile_dpbsud(C, A, B);                                                                                  \
    } while (0)

/* the pass's groups' I of super-block b (pair p's 16 rows of codes at q + p * 1,024) into sums: [4][rows], whose HI
 * and LO parts k_total adds */
ALWAYS_INLINE void k_burst(const int type, const int groups, const split_codes *codes, const uint8_t *q,
                           const int64_t apart, int64_t b, ivec *sums) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int p = 0; p < 4; p += 3 - groups) {
        const uint8_t *a = q + (b * 4 + p) * AMX_ROWS * 64;
        const split_codes *w = codes + b * 4 + p;
        _tile_loadd(0, a, 64);
        _tile_loadd(2, w->lo, 64);
        _tile_loadd(3, w->hi, 64);
        if (groups == 2) {
            _tile_loadd(1, a + apart, 64);
            _tile_dpbsud(4, 0, 2);
            _tile_dpbsud(5, 1, 2);
            K_MULTIPLY_HI(6, 0, 3);
            K_MULTIPLY_HI(7, 1, 3);
            continue;
        }
        _tile_dpbsud(4, 0, 2);
        K_MULTIPLY_HI(6, 0, 3);
        _tile_loadd(1, a + AMX_ROWS * 64, 64);
        _tile_loadd(2, w[1].lo, 64);
        _tile_loadd(3, w[1].hi, 64);
        _tile_dpbsud(5, 1, 2);
        K_MULTIPLY_HI(7, 1, 3);
    }
    _tile_stored(4, sums, 64);
    _tile_stored(5, sums + AMX_ROWS, 64);
    _tile_stored(6, sums + 2 * AMX_ROWS, 64);
    _tile_stored(7, sums + 3 * AMX_ROWS, 64);
}

/* group g's I of row r from a burst's sums: 256 * HI + LO */
ALWAYS_INLINE ivec k_total(const int groups, const ivec *s, int g, int r) {
    const ivec lo = groups == 2 ? s[g * AMX_ROWS + r] : s[r] + s[AMX_ROWS + r];
    const ivec hi = groups == 2 ? s[(2 + g) * AMX_ROWS + r] : s[2 * AMX_ROWS + r] + s[3 * AMX_ROWS + r];
    return (ivec)((wvec)hi << 8) + lo;
}

/* one pass of `groups` groups of AMX_ROWS rows (q and the next group's: amx_pair_codes's layout) times a tile's
 * codes, as packed_mm.c's tile_rows */
ALWAYS_INLINE void k_tiles_pass(const int type, const int groups, const uint8_t *tile, const split_codes *codes,
                                int64_t blocks, const uint8_t *q, float *out, int64_t out_stride, int width) {
    const int64_t apart = group_bytes(blocks * 256);
    ivec sums[2][4 * AMX_ROWS]; /* two super-blocks': the next one's multiplies run while this one's are added */
    fvec acc[2][AMX_ROWS];
    for (int g = 0; g < groups; g++)
        for (int r = 0; r < AMX_ROWS; r++) acc[g][r] = (fvec){0};
    k_burst(type, groups, codes, q, apart, 0, sums[0]);
    for (int64_t b = 0; b < blocks; b++) {
        if (b + 1 < blocks) k_burst(type, groups, codes, q, apart, b + 1, sums[(b + 1) % 2]);
        const k_weight_terms t = k_terms(type, tile + b * block_bytes(type), 0);
        for (int g = 0; g < groups; g++) {
            const k_row_head *heads = (const k_row_head *)(q + g * apart + AMX_ROWS * blocks * 256) + b * AMX_ROWS;
            for (int r = 0; r < AMX_ROWS; r++) {
                const ivec pair16[4] = {(ivec){0} + heads[r].pair16[0], (ivec){0} + heads[r].pair16[1],
                                        (ivec){0} + heads[r].pair16[2], (ivec){0} + heads[r].pair16[3]};
                acc[g][r] = k_row_total(type, &t, k_total(groups, sums[b % 2], g, r), pair16, splat_v(heads[r].d),
                                        acc[g][r]);
            }
        }
    }
    for (int g = 0; g < groups; g++)
        store_rows(acc[g], AMX_ROWS, 0, width, out + g * AMX_ROWS * out_stride, out_stride);
}
#endif
