/* What every source of the CPU kernels shares: IEEE half conversions, 16-lane float vectors (GCC's vector
 * extensions: AVX-512 where present, narrower registers elsewhere), e^x in plain arithmetic that vectorizes, and
 * the public functions one source calls in another.
 *
 * The kernels compute as transformers does in float32, up to the order of sums and the packed weights' own
 * arithmetic, and are compiled with -ffp-contract=off so a*b+c stays two roundings wherever it is written (an
 * explicit fma is one). Rows are independent: a row's result never depends on the other rows of its batch.
 *
 * The large loops (tiles of a weight, attention's heads) hand out their tasks dynamically, to whichever thread is
 * free: there are as many threads as cores, and when the OS runs something else on one core (the server's hub, a
 * client), a static share would hold the whole team at the loop's end. A task's result never depends on the
 * thread that computes it.
 */
#ifndef WSGI_INFER_COMMON_H
#define WSGI_INFER_COMMON_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__) || defined(__AVX512BW__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

typedef uint16_t f16; /* IEEE half precision: a GGUF's blocks' scales, and the KV cache */

static inline float half_to_float(f16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, bits = (uint32_t)(h & 0x7fffu) << 13;
    float f;
    if (bits >= 0x0f800000u) { /* infinity or NaN */
        bits |= 0x7f800000u;
    } else { /* the float with the half's exponent field, times 2^(127 - 15): exact, subnormals included */
        memcpy(&f, &bits, 4);
        f *= 0x1p112f;
        memcpy(&bits, &f, 4);
    }
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

/* a float as an IEEE half, rounded to nearest even, as torch's .half() and vcvtps2ph round it: past the largest
 * half (65504) infinity, subnormals kept, a NaN a NaN */
static inline f16 to_half(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (f16)(sign | 0x7e00u);
    if (magnitude >= 0x477ff000u) return (f16)(sign | 0x7c00u); /* 65520 and above round to infinity */
    if (magnitude < 0x38800000u) {                               /* under 2^-14: a subnormal's count of 2^-24 */
        float v;
        memcpy(&v, &magnitude, 4);
        return (f16)(sign | (uint32_t)nearbyintf(v * 0x1p24f));
    }
    uint32_t half = (magnitude - 0x38000000u) >> 13, rest = magnitude & 0x1fffu; /* exponent 127 -> 15 */
    half += rest > 0x1000u || (rest == 0x1000u && (half & 1u));
    return (f16)(sign | half);
}

/* count floats as halves (the KV cache's), each rounded to nearest even */
static inline void store_halves(f16 *out, const float *x, int64_t count) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= count; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < count; i++) out[i] = to_half(x[i]);
}

/* Vectors of the CPU's own width, for code with comparisons: GCC splits wider vectors into registers for
 * arithmetic, but compares them one lane at a time, with a branch each. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float f32v __attribute__((vector_size(LANES * 4)));
typedef int32_t i32v __attribute__((vector_size(LANES * 4)));
typedef uint32_t u32v __attribute__((vector_size(LANES * 4)));
typedef uint16_t u16v __attribute__((vector_size(LANES * 2)));

/* LANES IEEE halves as floats, exactly: vcvtph2ps where the CPU has it */
static inline f32v load_halves(const f16 *p) {
#ifdef __AVX512F__
    return (f32v)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (f32v)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    f32v v;
    for (int i = 0; i < LANES; i++) v[i] = half_to_float(p[i]);
    return v;
#endif
}

static inline f32v select_v(i32v mask, f32v a, f32v b) { return (f32v)(((i32v)a & mask) | ((i32v)b & ~mask)); }

/* a * b + c, each lane rounded once */
static inline f32v fma_v(f32v a, f32v b, f32v c) {
#ifdef __AVX512F__
    return (f32v)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (f32v)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int i = 0; i < LANES; i++) a[i] = fmaf(a[i], b[i], c[i]);
    return a;
#endif
}

static inline f32v splat_v(float x) { /* every lane x (0 + x would be an addition: no -ffast-math) */
#ifdef __AVX512F__
    return (f32v)_mm512_set1_ps(x);
#elif defined(__AVX__)
    return (f32v)_mm256_set1_ps(x);
#else
    f32v v;
    for (int i = 0; i < LANES; i++) v[i] = x;
    return v;
#endif
}

/* e^x in plain arithmetic that vectorizes, where expf would not without -ffast-math: 2^k * e^r with
 * |r| <= ln 2 / 2 (Cephes' expf polynomial, within 2 ulp), x clamped to where floats stay normal. exp_v is
 * exp_approx in every lane, to the bit. (Its multiply-adds fused, as fewer operations, moved the 8-bit path's top-1
 * agreement with the float32 reference by up to 0.3% on the same text: an input an ulp off crosses a rounding
 * boundary of the activations' 8-bit codes now and then.) */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = floorf(x * 1.44269504f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f, r2 = r * r;
    float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
               1.6666665459e-1f) * r + 5.0000001201e-1f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return (p * r2 + r + 1.0f) * two_k;
}

static inline f32v exp_v(f32v x) {
#ifdef __AVX512F__ /* the same values in fewer instructions: a NaN x is max's and min's second operand, returned */
    x = (f32v)_mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), (__m512)x));
    f32v k = (f32v)_mm512_roundscale_ps((__m512)(x * 1.44269504f + 0.5f), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif defined(__AVX__) /* the same with AVX's vminps, vmaxps and vroundps */
    x = (f32v)_mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), (__m256)x));
    f32v k = (f32v)_mm256_floor_ps((__m256)(x * 1.44269504f + 0.5f));
#else
    const f32v zero = {0}, lowest = zero - 87.0f, highest = zero + 88.0f;
    x = select_v(x < lowest, lowest, select_v(x > highest, highest, x));
    f32v scaled = x * 1.44269504f + 0.5f;
    f32v truncated = __builtin_convertvector(__builtin_convertvector(scaled, i32v), f32v);
    f32v k = truncated - select_v(truncated > scaled, zero + 1.0f, zero); /* floor: |scaled| < 2^23 */
#endif
    f32v r = x - k * 0.693359375f + k * 2.12194440e-4f, r2 = r * r;
    f32v p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
              1.6666665459e-1f) * r + 5.0000001201e-1f;
#ifdef __AVX512F__ /* times 2^k, rounded once, as a multiply by the power of two is */
    return (f32v)_mm512_scalef_ps((__m512)(p * r2 + r + 1.0f), (__m512)k);
#else
    i32v bits = (__builtin_convertvector(k, i32v) + 127) << 23;
    return (p * r2 + r + 1.0f) * (f32v)bits;
#endif
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* --- across sources ------------------------------------------------------------------------------------------ */
/* A thread's scratch buffer `which` (one of the SCRATCH_* below) of at least `bytes`, 64-byte aligned: kept, and
 * grown, from call to call (scratch.c). Its contents are whatever the last user left. */
void *scratch(int which, size_t bytes);
enum {
    SCRATCH_ACTIVATIONS, /* packed_mm's quantized rows */
    SCRATCH_SCORES,      /* attention's, per part (its worker threads') */
    SCRATCH_KEYS,
    SCRATCH_VALUES,
    SCRATCH_NORMED, /* decoder_layers' rows */
    SCRATCH_ATTENDED,
    SCRATCH_QKV,
    SCRATCH_GATE_UP,
    SCRATCH_GATED,
    SCRATCH_DECODED,    /* amx_mm.c's decoded weight tile */
    SCRATCH_PAIR_CODES, /* and its activations' codes, two blocks a row */
    SCRATCH_ROTATED,    /* packed_mm's rows rotated (rotated.h) */
};
void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim, float eps,
              int threads);
void head_norm(float *x, int64_t row_stride, const float *q_weight, const float *k_weight, int64_t rows, int64_t heads,
               int64_t kv_heads, int64_t head_dim, float eps, int threads);
void gated_mul(const float *gate_up, float *out, int64_t rows, int64_t width, int gelu, int threads);
void rotate(float *x, int64_t row_stride, const float *cos_rows, const float *sin_rows, int64_t rows, int64_t heads,
            int64_t head_dim, int64_t rotary_dim, int threads);
void paged_attention(const float *q, int64_t q_row_stride, const f16 *cache, const int64_t *block_table,
                     int64_t seqs, int64_t max_blocks, const int64_t *row_seqs, const int64_t *context_lens,
                     int64_t block_size, float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     float scale, int64_t window, int threads);
#endif
