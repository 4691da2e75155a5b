/* One part of a context's attention (attention.c): its keys transposed and values widened, each query's scores,
 * their softmax numerators and the values they weigh, in float32, each query's arithmetic the same whichever
 * queries share its pass. */
#ifndef WSGI_INFER_ATTENTION_PART_H
#define WSGI_INFER_ATTENTION_PART_H
#include "common.h"

/* Vectors of the CPU's width (LANES tokens or dimensions): AVX2's 16 registers then hold what AVX-512's 32 do. */

/* LANES vectors of LANES transposed: v[i][j] and v[j][i] swap. A stage per halving B of the block size, each
 * swapping the off-diagonal blocks of size B between pairs of vectors: two two-input shuffles a pair. */
#define SWAP_BLOCKS(B, LOW, HIGH)                                                                                  \
    for (int i = 0; i < LANES; i++)                                                                                \
        if (!(i & B)) {                                                                                            \
            f32v a = v[i], b = v[i + B];                                                                           \
            v[i] = __builtin_shufflevector(a, b, LOW);                                                             \
            v[i + B] = __builtin_shufflevector(a, b, HIGH);                                                        \
        }
#if LANES == 16
#define LOW_8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HIGH_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LOW_4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HIGH_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LOW_2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HIGH_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LOW_1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HIGH_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline __attribute__((always_inline)) void transpose_v(f32v v[LANES]) {
    SWAP_BLOCKS(8, LOW_8, HIGH_8) SWAP_BLOCKS(4, LOW_4, HIGH_4) SWAP_BLOCKS(2, LOW_2, HIGH_2) SWAP_BLOCKS(1, LOW_1, HIGH_1)
}
#else
#define LOW_4 0, 1, 2, 3, 8, 9, 10, 11
#define HIGH_4 4, 5, 6, 7, 12, 13, 14, 15
#define LOW_2 0, 1, 8, 9, 4, 5, 12, 13
#define HIGH_2 2, 3, 10, 11, 6, 7, 14, 15
#define LOW_1 0, 8, 2, 10, 4, 12, 6, 14
#define HIGH_1 1, 9, 3, 11, 5, 13, 7, 15
static inline __attribute__((always_inline)) void transpose_v(f32v v[LANES]) {
    SWAP_BLOCKS(4, LOW_4, HIGH_4) SWAP_BLOCKS(2, LOW_2, HIGH_2) SWAP_BLOCKS(1, LOW_1, HIGH_1)
}
#endif

/* tokens: a decode reads its keys and values from memory (a decode after 4,000 tokens, 16 layers of the 1B shape:
 * 17.4 ms 8 tokens ahead, 13.3 ms 32 ahead, more beyond; Xeon) */
#define PREFETCH_AHEAD 32
/* ...into L2, not L1: a head's keys (or values) are 128 bytes of each 2 KB slot, so a block's 16 tokens fall in two
 * of L1's sets, and L1 prefetches 32 tokens ahead evicted the lines of the tokens being read (one row over 2,000
 * tokens, 32 heads over 8, a layer: 247-252 -> 236-239 us with the cache warm, 361-368 -> 329-333 cold; a 512-row
 * chunk's unchanged; Zen 4) */
#define PREFETCH_KV(p) __builtin_prefetch(p, 0, 2)

/* the part's keys, each block of LANES tokens transposed: keys_t[block][d] holds dimension d of the block's tokens
 * (zeros from len to the next multiple of 16), so that a query's scores are vectors of multiply-adds, no sums across
 * lanes */
static inline __attribute__((always_inline)) void transposed_keys(const f16 *keys, const int64_t *offsets,
                                                                  int64_t len, const int64_t head_dim, f32v *keys_t) {
    for (int64_t start = 0; start < len; start += 16)
        for (int64_t c = 0; c < head_dim / LANES; c++)
            for (int64_t at = start; at < start + 16; at += LANES) {
                f32v v[LANES];
                for (int64_t i = 0; i < LANES; i++) {
                    int64_t t = at + i;
                    if (t + PREFETCH_AHEAD < len) PREFETCH_KV(keys + offsets[t + PREFETCH_AHEAD] + LANES * c);
                    v[i] = t < len ? load_halves(keys + offsets[t] + LANES * c) : (f32v){0};
                }
                transpose_v(v);
                memcpy(keys_t + (at / LANES) * head_dim + LANES * c, v, sizeof(v));
            }
}

#define SCORE_SPAN (16 / LANES) /* key blocks a tile of scores covers: 16 tokens */
#ifdef __AVX512F__
#define SCORE_QUERIES 16 /* queries a tile covers: 16 independent chains of multiply-adds */
#else
#define SCORE_QUERIES 6 /* 12 chains; each key load feeds 6 multiply-adds, each query's broadcast 2 */
#endif

/* the scores of `count` queries from q over SCORE_SPAN blocks of transposed keys from k (both constants: the
 * sums stay in registers), scaled, into scores (a query's row stride apart): one chain of multiply-adds a query
 * and token, over the dimensions in order */
static inline __attribute__((always_inline)) void score_tile(const float *q, const int count, const f32v *k,
                                                             const int64_t head_dim, float scale, int64_t stride,
                                                             float *scores) {
    f32v acc[SCORE_QUERIES * SCORE_SPAN] = {{0}};
    for (int64_t d = 0; d < head_dim; d++) {
        f32v key[SCORE_SPAN];
        for (int b = 0; b < SCORE_SPAN; b++) key[b] = k[b * head_dim + d];
        for (int m = 0; m < count; m++) {
            f32v query = splat_v(q[m * head_dim + d]);
            for (int b = 0; b < SCORE_SPAN; b++) acc[m * SCORE_SPAN + b] = fma_v(query, key[b], acc[m * SCORE_SPAN + b]);
        }
    }
    for (int m = 0; m < count; m++)
        for (int b = 0; b < SCORE_SPAN; b++) {
            f32v scaled = acc[m * SCORE_SPAN + b] * scale;
            memcpy(scores + m * stride + b * LANES, &scaled, sizeof(scaled));
        }
}

/* scores [group, stride] of each query over the part's tokens (whole blocks of 16): each query's arithmetic the
 * same whichever queries share its tile */
static inline __attribute__((always_inline)) void score_tokens(const float *q, const int64_t group, const f32v *keys_t,
                                                               int64_t len, const int64_t head_dim, float scale,
                                                               int64_t stride, float *scores) {
    for (int64_t start = 0; start < len; start += 16) {
        const f32v *k = keys_t + start / LANES * head_dim;
        float *at = scores + start;
        int64_t m0 = 0;
        for (; m0 + SCORE_QUERIES <= group; m0 += SCORE_QUERIES)
            score_tile(q + m0 * head_dim, SCORE_QUERIES, k, head_dim, scale, stride, at + m0 * stride);
        switch (group - m0) { /* the rest as one tile of their own count */
#define REST(N)                                                                                                    \
    case N: score_tile(q + m0 * head_dim, N, k, head_dim, scale, stride, at + m0 * stride); break;
            REST(1) REST(2) REST(3) REST(4) REST(5)
#if SCORE_QUERIES > 6
            REST(6) REST(7) REST(8) REST(9) REST(10) REST(11) REST(12) REST(13) REST(14) REST(15)
#endif
#undef REST
        }
    }
}

#ifdef __AVX512F__
#define VALUE_SUMS 16  /* a pass's sums held in registers */
#define VALUE_WIDTH 16 /* the most chunks of a head a pass of several queries sums */
#else
#define VALUE_SUMS 12
#define VALUE_WIDTH 2 /* 6 queries share each value load, and a pass's values (16 KB of 256 tokens) stay in L1:
                       * 8 chunks of one query read 64 KB from L2 a query, twice the multiply-adds' time */
#endif

/* the largest count of chunks at most `most` that divides a head's: a pass never runs past the head */
static inline int64_t pass_width(int64_t chunks, int64_t most) {
    int64_t width = chunks < most ? chunks : most;
    while (chunks % width) width--;
    return width;
}

/* weighed [block, D]'s chunks [c0, c0 + width) for `block` queries (block and width constants: the sums stay in
 * registers): each query's sum over its own tokens (lens) of its weights (stride apart) times the tokens' values,
 * in token order. The tokens all of them see run without a check. */
static inline __attribute__((always_inline)) void weigh_pass(const float *values_f, int64_t len, const int64_t *lens,
                                                             const int64_t block, const int64_t width, int64_t c0,
                                                             const int64_t head_dim, int64_t stride,
                                                             const float *weights, float *weighed) {
    int64_t shortest = len, t = 0;
    for (int64_t m = 0; m < block; m++) shortest = lens[m] < shortest ? lens[m] : shortest;
    f32v acc[VALUE_SUMS] = {{0}};
    for (; t < shortest; t++) {
        const f32v *value = (const f32v *)(values_f + t * head_dim) + c0;
        for (int64_t m = 0; m < block; m++) {
            f32v weight = splat_v(weights[m * stride + t]);
            for (int64_t c = 0; c < width; c++) acc[m * width + c] = fma_v(weight, value[c], acc[m * width + c]);
        }
    }
    for (; t < len; t++) {
        const f32v *value = (const f32v *)(values_f + t * head_dim) + c0;
        for (int64_t m = 0; m < block; m++) {
            if (t >= lens[m]) continue; /* past its own context */
            f32v weight = splat_v(weights[m * stride + t]);
            for (int64_t c = 0; c < width; c++) acc[m * width + c] = fma_v(weight, value[c], acc[m * width + c]);
        }
    }
    for (int64_t m = 0; m < block; m++) memcpy(weighed + m * head_dim + c0 * LANES, acc + m * width, width * sizeof(f32v));
}

/* weighed [group, D] = sum over each query's own tokens (lens) of weights [group, stride] times the tokens' values
 * (widened once into values_f), in token order: per query and dimension one chain, whichever queries share a
 * pass. Blocks of VALUE_SUMS / width queries, a slice of the values at a time; the rest in pairs, then alone. */
static inline __attribute__((always_inline)) void weigh_values(const float *values_f, int64_t len, const int64_t *lens,
                                                               const int64_t group, const int64_t head_dim,
                                                               int64_t stride, const float *weights, float *weighed) {
    const int64_t chunks = head_dim / LANES, width = pass_width(chunks, VALUE_WIDTH), block = VALUE_SUMS / width;
    const int64_t blocked = group / block * block, pair = pass_width(chunks, VALUE_SUMS / 2);
    const int64_t alone = pass_width(chunks, VALUE_SUMS);
    for (int64_t c0 = 0; c0 < chunks; c0 += width)
        for (int64_t m0 = 0; m0 < blocked; m0 += block)
            weigh_pass(values_f, len, lens + m0, block, width, c0, head_dim, stride, weights + m0 * stride,
                       weighed + m0 * head_dim);
    int64_t m0 = blocked;
    for (; m0 + 2 <= group; m0 += 2)
        for (int64_t c0 = 0; c0 < chunks; c0 += pair)
            weigh_pass(values_f, len, lens + m0, 2, pair, c0, head_dim, stride, weights + m0 * stride,
                       weighed + m0 * head_dim);
    for (; m0 < group; m0++)
        for (int64_t c0 = 0; c0 < chunks; c0 += alone)
            weigh_pass(values_f, len, lens + m0, 1, alone, c0, head_dim, stride, weights + m0 * stride,
                       weighed + m0 * head_dim);
}

/* lane i takes lane i xor K: a vector folded onto itself in halves */
#if LANES == 16
#define XOR_8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define XOR_4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define XOR_2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define XOR_1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#else
#define XOR_4 4, 5, 6, 7, 0, 1, 2, 3
#define XOR_2 2, 3, 0, 1, 6, 7, 4, 5
#define XOR_1 1, 0, 3, 2, 5, 4, 7, 6
#endif
/* a vector's largest lane in log2(LANES) folds, where a scan waited on each lane (a NaN never wins, as in a scan) */
static inline float largest_lane(f32v v) {
#define KEEP_LARGER(PAIRS)                                                                                         \
    {                                                                                                              \
        f32v other = __builtin_shufflevector(v, v, PAIRS);                                                         \
        v = select_v(other > v, other, v);                                                                         \
    }
#if LANES == 16
    KEEP_LARGER(XOR_8)
#endif
    KEEP_LARGER(XOR_4) KEEP_LARGER(XOR_2) KEEP_LARGER(XOR_1)
#undef KEEP_LARGER
    return v[0];
}

/* lanes [0, n) of a register (every lane where n >= LANES) */
static inline i32v lanes_below(int64_t n) {
    i32v lane;
    for (int l = 0; l < LANES; l++) lane[l] = l;
    return lane < (int32_t)(n < LANES ? n : LANES);
}

/* the largest of scores [0, len). The padding past len, up to a whole register, is read, never counted. */
static inline float scores_peak(const float *scores, int64_t len) {
    f32v most = (f32v){0} - INFINITY, v;
    int64_t t = 0;
    for (; t + LANES <= len; t += LANES) { /* whole registers, no mask */
        memcpy(&v, scores + t, sizeof(v));
        most = select_v(v > most, v, most); /* a NaN never wins, as in a scan */
    }
    if (t < len) {
        memcpy(&v, scores + t, sizeof(v));
        v = select_v(lanes_below(len - t), v, most);
        most = select_v(v > most, v, most);
    }
    return largest_lane(most);
}

/* a register of scores at `at` as exp(score - peak), in place */
static inline f32v numerators_at(float *at, float peak) {
    f32v v;
    memcpy(&v, at, sizeof(v));
    v = exp_v(v - peak);
    memcpy(at, &v, sizeof(v));
    return v;
}

/* scores [0, len) as exp(score - peak), in place, and their sum, per lane and then across the lanes (a serial sum
 * took a dependent addition per score). The padding past len is computed, never counted. */
static inline float softmax_numerators(float *scores, int64_t len, float peak) {
    f32v sum = {0};
    int64_t t = 0;
#pragma GCC unroll 4 /* four exponentials at once, the sum's order kept: a prefill +1.0% on AVX2, +0.6% on VNNI */
    for (; t + LANES <= len; t += LANES) sum += numerators_at(scores + t, peak);
    if (t < len) sum += select_v(lanes_below(len - t), numerators_at(scores + t, peak), (f32v){0});
    float total = 0.0f;
    for (int l = 0; l < LANES; l++) total += sum[l]; /* in lane order: a head's runs overlap the next head's */
    return total;
}

/* One part of softmax(q k^T * scale) v for the group query heads that share one key-value head: over the len cached
 * tokens at offsets, each head over its own first lens[h] of them (none, where lens[h] is 0), in float32. Per head:
 * weighed [group, D], the sum of each token's exp(score - peak) times its value; total, the sum of those
 * numerators; peak, the largest score. The part's keys are transposed and its values widened once for the whole
 * group, and each head's sums run in the order one head alone would run them (the scores of tokens past its own
 * are computed, never read), so a row's result never depends on the rows beside it. q: the group's heads, one after
 * another. */
static inline __attribute__((always_inline)) void attend_part(const float *q, const int64_t group, const f16 *keys,
                                                              const f16 *values, const int64_t *offsets, int64_t len,
                                                              const int64_t *lens, const int64_t head_dim, float scale,
                                                              float *peak, float *total, float *weighed) {
    const int64_t stride = (len + 15) / 16 * 16;
    float *scores = scratch(SCRATCH_SCORES, group * stride * sizeof(float));
    f32v *keys_t = scratch(SCRATCH_KEYS, stride * head_dim * sizeof(float));
    float *values_f = scratch(SCRATCH_VALUES, len * head_dim * sizeof(float));
    transposed_keys(keys, offsets, len, head_dim, keys_t);
    score_tokens(q, group, keys_t, len, head_dim, scale, stride, scores);
    /* every head's peak, then every head's numerators: one head's folds across lanes overlap the next's scan */
    for (int64_t h = 0; h < group; h++) peak[h] = scores_peak(scores + h * stride, lens[h]);
    for (int64_t h = 0; h < group; h++) total[h] = softmax_numerators(scores + h * stride, lens[h], peak[h]);
    for (int64_t t = 0; t < len; t++)
        for (int64_t c = 0; c < head_dim / LANES; c++) {
            if (t + PREFETCH_AHEAD < len) PREFETCH_KV(values + offsets[t + PREFETCH_AHEAD] + LANES * c);
            f32v v = load_halves(values + offsets[t] + LANES * c);
            memcpy(values_f + t * head_dim + LANES * c, &v, sizeof(v));
        }
    weigh_values(values_f, len, lens, group, head_dim, stride, scores, weighed);
}

#endif
