/* Activations quantized once per multiply (activations.h). Generic vector code: every build rounds alike. */
#include "activations.h"

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f32x8 round_even(f32x8 v) { /* to the nearest integer, ties to even: |v| < 2^22 here */
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

/* across a vector's lanes, by halving: the largest, and the sum (exact integers: any order) */
static inline uint32_t lanes_largest(u32x8 v) {
    u32x8 other = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3), greater;
#define KEEP_LARGER greater = (u32x8)(v > other), v = (v & greater) | (other & ~greater)
    KEEP_LARGER;
    other = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    KEEP_LARGER;
    other = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    KEEP_LARGER;
#undef KEEP_LARGER
    return v[0];
}

static inline int32_t lanes_sum(i32x8 v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}

static int32_t pair16(int32_t low, int32_t high) { /* two sums of at most 16 bits in one word */
    return (int32_t)(((uint32_t)low & 0xFFFFu) | ((uint32_t)high << 16));
}

/* 32 integers within -127..127, 8 a vector, as bytes at out. AVX2's packs and one permute, where GCC's
 * conversion took each lane out alone (quantizing 1.6% of the AVX2 build's prefill, 1B Q4_K_M, Zen 4: now 1.0%) */
static inline void store_codes(const i32x8 v[QK / 8], int8_t *out) {
#ifdef __AVX2__
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32((__m256i)v[0], (__m256i)v[1]),
                                             _mm256_packs_epi32((__m256i)v[2], (__m256i)v[3]));
    /* each 128-bit half packs by itself: quads of v[0], v[1], v[2], v[3] low lanes, then their high lanes */
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int j = 0; j < QK / 8; j++) {
        i8x8 codes = __builtin_convertvector(v[j], i8x8);
        memcpy(out + 8 * j, &codes, sizeof(codes));
    }
#endif
}

/* a block of 32 inputs at x as codes of the scale d (planes: activations.h), in vectors of 8: the codes' sums
 * across lanes once a half, where a scalar sum of every 8 codes took most of a quantization */
static void quantize_block(const float *x, int planes, float d, uint8_t *out) {
    act_head *head = (act_head *)out;
    int8_t *hi = (int8_t *)(out + sizeof(act_head)), *lo = hi + QK;
    if (isnan(d)) { /* an infinity or a NaN in the span */
        memset(out, 0, ACT_BYTES(planes));
        head->d = head->s = NAN;
        return;
    }
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    i32x8 q[QK / 8], high[QK / 8], low[QK / 8];
    for (int j = 0; j < QK / 8; j++) {
        f32x8 v;
        memcpy(&v, x + 8 * j, sizeof(v));
        q[j] = __builtin_convertvector(round_even(v * id), i32x8);
        if (planes == 2) { /* q = 255 hi + lo, both within -127..127: hi = round(q / 255), never a tie */
            high[j] = __builtin_convertvector(round_even(__builtin_convertvector(q[j], f32x8) * (1.0f / 255.0f)), i32x8);
            low[j] = q[j] - 255 * high[j];
        }
    }
    store_codes(planes == 2 ? high : q, hi);
    if (planes == 2) store_codes(low, lo);
    const int32_t first = lanes_sum(q[0] + q[1]), second = lanes_sum(q[2] + q[3]);
    head->d = d;
    head->sum = first + second;
    head->sum_half[0] = first, head->sum_half[1] = second;
    head->sum_f = (float)head->sum; /* exact: at most 32 * 32512 */
    head->s = d * head->sum_f;
    head->halves16 = planes == 1 ? pair16(first, second) : 0;
    head->pair16 = 0;
}

/* the scale of a span of inputs at x: its largest magnitude over the largest code, NaN where one is not finite.
 * Magnitudes compare as their bits do, an infinity above every number and a NaN above that (fmaxf, a library call
 * that drops NaNs, took 1.4% of a prefill). */
static float span_scale(const float *x, int span, int planes) {
    u32x8 top = {0};
    for (int c = 0; c < span; c += 8) {
        u32x8 bits;
        memcpy(&bits, x + c, sizeof(bits));
        bits &= 0x7fffffffu;
        u32x8 greater = (u32x8)(top > bits);
        top = (top & greater) | (bits & ~greater);
    }
    uint32_t largest = lanes_largest(top);
    if (largest >= 0x7f800000u) return NAN;
    float amax;
    memcpy(&amax, &largest, 4);
    return amax / (planes == 1 ? 127.0f : 32512.0f);
}

uint8_t *quantize_activations(const float *x, int64_t rows, int64_t k, int planes, int span, int threads) {
    int64_t blocks = k / QK, spans = k / span, per_span = span / QK, padded = (rows + ACT_ROWS - 1) / ACT_ROWS * ACT_ROWS;
    uint8_t *out = scratch(SCRATCH_ACTIVATIONS, padded * blocks * ACT_BYTES(planes));
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * blocks > 256)
    for (int64_t i = 0; i < rows * spans; i++) {
        int64_t row = i / spans, first = i % spans * per_span;
        const float *at = x + row * k + first * QK;
        float d = span_scale(at, span, planes);
        for (int64_t b = 0; b < per_span; b++)
            quantize_block(at + b * QK, planes, d, out + act_offset(row, first + b, blocks, planes));
        for (int64_t b = 0; planes == 1 && b + 1 < per_span; b += 2) {
            act_head *even = (act_head *)(out + act_offset(row, first + b, blocks, planes));
            const act_head *odd = (const act_head *)(out + act_offset(row, first + b + 1, blocks, planes));
            even->pair16 = pair16(even->sum, odd->sum);
        }
    }
    return out;
}
