/* Activations quantized once per multiply (activations.h). Generic vector code: every build rounds alike. */
#include "activations.h"

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f32x8 round_even(f32x8 v) { /* to the nearest integer, ties to even: |v| < 2^22 here */
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* the block's largest magnitude, as bits: floats' magnitudes order as their bits do, an infinity above every number
 * and a NaN above that (fmaxf, a library call that drops NaNs, took 1.4% of a prefill) */
static inline uint32_t largest_magnitude(const float *x) {
    u32x8 top = {0};
    for (int c = 0; c < QK; c += 8) {
        u32x8 bits;
        memcpy(&bits, x + c, sizeof(bits));
        bits &= 0x7fffffffu;
        u32x8 greater = (u32x8)(top > bits);
        top = (top & greater) | (bits & ~greater);
    }
    uint32_t largest = 0;
    for (int i = 0; i < 8; i++) largest = top[i] > largest ? top[i] : largest;
    return largest;
}

static int32_t pair16(int32_t low, int32_t high) { /* two sums of at most 16 bits in one word */
    return (int32_t)(((uint32_t)low & 0xFFFFu) | ((uint32_t)high << 16));
}

/* a block of 32 inputs at x as codes of the scale d (planes: activations.h) */
static void quantize_block(const float *x, int planes, float d, uint8_t *out) {
    act_head *head = (act_head *)out;
    int8_t *hi = (int8_t *)(out + sizeof(act_head)), *lo = hi + QK;
    if (isnan(d)) { /* an infinity or a NaN in the span */
        memset(out, 0, ACT_BYTES(planes));
        head->d = head->s = NAN;
        return;
    }
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t halves[2] = {0, 0}; /* indexed by constants: summed at c / 16, GCC kept the sums in memory and read
                                 * them back as one vector before their stores had landed (a store-forwarding stall) */
    for (int c = 0; c < QK; c += 8) {
        f32x8 v;
        memcpy(&v, x + c, sizeof(v));
        i32x8 q = __builtin_convertvector(round_even(v * id), i32x8);
        if (planes == 2) { /* q = 255 hi + lo, both within -127..127: hi = round(q / 255), never a tie */
            i32x8 h = __builtin_convertvector(round_even(__builtin_convertvector(q, f32x8) * (1.0f / 255.0f)), i32x8);
            i32x8 l = q - 255 * h;
            for (int i = 0; i < 8; i++) hi[c + i] = (int8_t)h[i], lo[c + i] = (int8_t)l[i];
        } else {
            for (int i = 0; i < 8; i++) hi[c + i] = (int8_t)q[i];
        }
        int32_t eight = 0;
        for (int i = 0; i < 8; i++) eight += q[i];
        if (c < 16)
            halves[0] += eight;
        else
            halves[1] += eight;
    }
    head->d = d;
    head->sum = halves[0] + halves[1];
    head->sum_half[0] = halves[0], head->sum_half[1] = halves[1];
    head->sum_f = (float)head->sum; /* exact: at most 32 * 32512 */
    head->s = d * head->sum_f;
    head->halves16 = planes == 1 ? pair16(halves[0], halves[1]) : 0;
    head->pair16 = 0;
}

/* the scale of a span of inputs at x: its largest magnitude over the largest code, NaN where one is not finite */
static float span_scale(const float *x, int span, int planes) {
    uint32_t largest = 0;
    for (int b = 0; b < span; b += QK) {
        uint32_t block = largest_magnitude(x + b);
        largest = block > largest ? block : largest;
    }
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
