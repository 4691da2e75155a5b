/* A row of activations as the packed multiplies read it: per 32 inputs, integer codes and their scale.
 *
 * planes 1 (8-bit activations, llama.cpp's Q8_0 and Q8_K rows): x = d * q, q = round(x / d) in -127..127,
 * d = max|x| / 127 over a span of the row: 32 inputs, or 256 for weights with K-quant parts (whose sub-block scales
 * are then applied to integer sums under one activation scale, and d once per super-block, as llama.cpp's Q8_K is).
 * planes 2 (the exact path): x = d * (255 * hi + lo), hi and lo in -127..127, d = max|x| / 32512: each input
 * within 2^-16 of its span's largest, as 16-bit integers would hold it; the integer sums are the same sums of
 * 16-bit products, made of two 8-bit passes (255, not 256, so that every plane stays within -127..127).
 * Each block also keeps the sum of its codes, and of each half's 16: a weight's offsets (w = s * code + m)
 * multiply the activations' sum, not each input.
 */
#ifndef WSGI_INFER_ACTIVATIONS_H
#define WSGI_INFER_ACTIVATIONS_H
#include "common.h"

#define QK 32 /* inputs per block */

typedef struct {
    float d;           /* the scale; NaN where an input of the span is infinite or NaN (its outputs are NaN) */
    float s;           /* d * sum */
    float sum_f;       /* sum, as a float */
    int32_t sum;       /* the sum of the block's codes as integers (255 * hi + lo on the exact path) */
    int32_t sum_half[2]; /* the same over inputs 0-15 and 16-31 */
    /* with 8-bit codes (planes 1), whose sums fit 16 bits: the halves' sums in a word's low and high 16 bits, and
     * (a K span's even blocks) this block's sum and the next one's, as vpmaddwd reads pairs (0 otherwise) */
    int32_t halves16, pair16;
} act_head; /* then the planes: 32 signed codes each (hi first) */

#define ACT_BYTES(planes) ((int64_t)sizeof(act_head) + QK * (planes))
/* Rows in groups of ACT_ROWS, each group's rows side by side for every block: [group][block][row of the group], so
 * that the rows a multiply takes at once lie at fixed distances from one pointer (a tail group padded). A group is
 * as small as a pass's rows allow (packed_mm.c: 16 with AVX-512, 8 with AVX2), so that a pass reads in order */
#define ACT_ROWS (LANES == 16 ? 16 : 8)

/* where row r's block b lies (blocks: a row's) */
static inline int64_t act_offset(int64_t r, int64_t b, int64_t blocks, int planes) {
    return ((r / ACT_ROWS * blocks + b) * ACT_ROWS + r % ACT_ROWS) * ACT_BYTES(planes);
}

/* x [rows, k] (k a multiple of span, 32 or 256) as k / 32 blocks a row, laid out as above, in the thread's scratch
 * buffer */
uint8_t *quantize_activations(const float *x, int64_t rows, int64_t k, int planes, int span, int threads);
#endif
