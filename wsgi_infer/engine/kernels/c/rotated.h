/* Activations rotated, for the passes that sum in 16 bits (AVX2 without VNNI: 8 rows a pass, a weight row a lane).
 *
 * Such a pass multiplies each quad of the weight (8 rows' 4 codes) by each of its 8 rows' quad of activations in
 * every lane: a broadcast from memory beside each vpmaddubsw, which cost an AMD Zen 3 a third of its multiplies
 * (scripts/int8_peak_probe.c). Rotated, a group of 8 rows' block of 32 codes is 8 lines of 64 bytes, line i holding
 * quad i of rows 0-7 and again of rows 0-7; the 32 bytes from a line's r-th quad on hold row (l + r) mod 8's quad
 * in lane l, and the multiply reads them whole (one 32-byte load, within the line). So a pass's sum "r" is a
 * diagonal: lane l is weight row l times activation row (l + r) mod 8. The rows' per-block numbers that a
 * K-quant's totals take (k_sums.h) follow as lines of their own, rotated the same way, and at the pass's end the
 * diagonals are turned back into rows. Each lane sums and rounds the same integers in the same order as a
 * broadcast pass: the same bits. The K-quants (Q4_K, Q5_K, Q6_K) with 8-bit activations take their passes of 8
 * rows this way; the other formats, the exact path and the rows past a multiply's last whole group read
 * activations.h's layout, as before (the 32-input formats rotated gained 3% on Q4_0 and cost Q4_K 6% beside them:
 * their two more lines a block, and GCC's registers, AMD Zen 4's AVX2 build).
 */
#ifndef WSGI_INFER_ROTATED_H
#define WSGI_INFER_ROTATED_H
#include "activations.h"
#include "dot_products.h"

#define ROTATED (QL == 8 && SUMS_IN_16_BITS && ACT_ROWS == QL) /* builds whose passes of QL rows read rotations */
enum { ROT_HALVES16 = 8, ROT_PAIR16, ROT_D, ROT_LINES }; /* a block's lines after its codes' 8: act_head's fields */
#define ROT_BYTES ((int64_t)ROT_LINES * ROTATED_LINE)     /* a group's block */

/* the first rows / ACT_ROWS groups of a multiply's activations (activations.h's layout, 8-bit), rotated into the
 * thread's scratch buffer: [group][block][line] */
uint8_t *rotate_activations(const uint8_t *act, int64_t rows, int64_t k, int threads);

/* line `line`'s words of a block's lines as rotation r: lane l holds row (l + r) mod QL's */
ALWAYS_INLINE ivec rotated_words(const uint8_t *lines, const int line, const int r) {
    ivec v;
    memcpy(&v, lines + line * ROTATED_LINE + 4 * r, sizeof(v));
    return v;
}

/* diagonals d (d[r] lane l: output l of row (l + r) mod QL) turned into rows, in place: lane l of row j is
 * d[(j - l) mod QL]'s */
ALWAYS_INLINE void diagonals_to_rows(fvec d[QL]) {
    const ivec lane = {0, 1, 2, 3, 4, 5, 6, 7};
    fvec rows[QL];
#pragma GCC unroll 8
    for (int j = 0; j < QL; j++) {
        ivec row = (ivec)d[j];
#pragma GCC unroll 8
        for (int l = 1; l < QL; l++) {
            const ivec here = lane == l; /* all ones in lane l */
            row = (row & ~here) | ((ivec)d[(j - l + QL) % QL] & here);
        }
        rows[j] = (fvec)row;
    }
    memcpy(d, rows, sizeof(rows));
}
#endif
