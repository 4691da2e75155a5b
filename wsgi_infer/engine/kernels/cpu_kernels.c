/* Fused kernels for a step on the CPU (built by build.py, called by cpu.py): float32 activations, packed weights
 * (int4 and int8 groups), a bf16 KV cache.
 *
 * Each replaces a chain of small torch ops whose dispatch, not arithmetic, dominated a one-stream step; int4_mm
 * and int8_mm multiply the packed weights, and decoder_layers runs a whole step's layers through them in one call.
 * They compute as transformers does in float32, up to the order of sums, and are compiled with -ffp-contract=off
 * so a*b+c stays two roundings wherever it is written. Rows are independent: a row's result never depends on the
 * other rows of its batch.
 *
 * The large loops (tiles of a weight, attention's heads) hand out their tasks dynamically, to whichever thread is
 * free: there are as many threads as cores, and when the OS runs something else on one core (the server's hub, a
 * client), a static share would hold the whole team at the loop's end. A task's result never depends on the
 * thread that computes it.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__) || defined(__AVX512BW__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline float to_float(bf16 x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

typedef uint16_t f16; /* IEEE half precision: int4 weights' scale and low, as a GGUF's blocks store them */

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

/* 16 halves as floats: vcvtph2ps, where the CPU has it */
static inline void halves_to_floats(const f16 *h, float f[16]) {
#ifdef __F16C__
    for (int i = 0; i < 16; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#else
    for (int i = 0; i < 16; i++) f[i] = half_to_float(h[i]);
#endif
}

/* a packed weight's group (its 16 outputs' scales and lows, from element `at` on) as floats; low NULL: zeros */
static inline void group_scale_low(const f16 *scale, const f16 *low, int64_t at, float s[16], float l[16]) {
    halves_to_floats(scale + at, s);
    if (low)
        halves_to_floats(low + at, l);
    else
        memset(l, 0, 16 * sizeof(float));
}

static inline bf16 to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40);
    return (bf16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* count floats as bf16 (the KV cache's), each rounded to nearest even */
static inline void store_bf16(bf16 *out, const float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = to_bf16(x[i]);
}

/* 16 floats as one vector (GCC's vector extensions: AVX-512 where present, narrower registers elsewhere). */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));

static inline f32x16 load16f(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* 16 bf16 values (the KV cache's) as floats */
static inline f32x16 load16(const bf16 *p) {
    u16x16 half;
    memcpy(&half, p, sizeof(half));
    u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    f32x16 v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

static inline float hsum(f32x16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return v[0] + v[1];
}

/* e^x in plain arithmetic that vectorizes, where expf would not without -ffast-math: 2^k * e^r with
 * |r| <= ln 2 / 2 (Cephes' expf polynomial, within 2 ulp), x clamped to where floats stay normal. */
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

static inline f32v select_v(i32v mask, f32v a, f32v b) { return (f32v)(((i32v)a & mask) | ((i32v)b & ~mask)); }

/* exp_approx of each lane, with exactly exp_approx's operations (GCC does not vectorize its floorf) */
static inline f32v exp_v(f32v x) {
    const f32v zero = {0}, lowest = zero - 87.0f, highest = zero + 88.0f;
    x = select_v(x < lowest, lowest, select_v(x > highest, highest, x));
    f32v scaled = x * 1.44269504f + 0.5f;
    f32v truncated = __builtin_convertvector(__builtin_convertvector(scaled, i32v), f32v);
    f32v k = truncated - select_v(truncated > scaled, zero + 1.0f, zero); /* floor: |scaled| < 2^23 */
    f32v r = x - k * 0.693359375f + k * 2.12194440e-4f, r2 = r * r;
    f32v p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
              1.6666665459e-1f) * r + 5.0000001201e-1f;
    i32v bits = (__builtin_convertvector(k, i32v) + 127) << 23;
    return (p * r2 + r + 1.0f) * (f32v)bits;
}

/* exp_v of 16 lanes, a register's width at a time */
static inline f32x16 exp16(f32x16 x) {
    f32v piece[16 / LANES];
    memcpy(piece, &x, sizeof(x));
    for (int i = 0; i < 16 / LANES; i++) piece[i] = exp_v(piece[i]);
    memcpy(&x, piece, sizeof(x));
    return x;
}

/* out = weight * rms_norm(x) in float32, as transformers computes it (the sum of squares in another order). With
 * a residual, the sum residual + x is normalized, and kept in residual, in place. */
/* dst = weight * (row / rms(row)); dst may be row. */
static inline void norm_row(const float *row, const float *weight, float *dst, int64_t dim, float eps) {
    f32x16 lanes = {0};
    float squares = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        f32x16 v = load16f(row + i);
        lanes += v * v;
    }
    for (; i < dim; i++) squares += row[i] * row[i];
    squares += hsum(lanes);
    float inv = 1.0f / sqrtf(squares / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) dst[i] = weight[i] * (row[i] * inv);
}

void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim, float eps,
              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        if (residual) {
            float *sum = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) sum[i] += row[i];
            row = sum;
        }
        norm_row(row, weight, out + r * dim, dim, eps);
    }
}

/* Per-head RMSNorm (Qwen3's q and k norms), in place: in each row (stride in elements), the first heads vectors
 * of head_dim under q_weight, the next kv_heads under k_weight. */
void head_norm(float *x, int64_t row_stride, const float *q_weight, const float *k_weight, int64_t rows, int64_t heads,
               int64_t kv_heads, int64_t head_dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *v = x + r * row_stride + h * head_dim;
            norm_row(v, h < heads ? q_weight : k_weight, v, head_dim, eps);
        }
}

/* out = act(gate) * up, from gate_up = [gate | up] per row, where act(x) = x / (1 + e^-z): SiLU with z = x, or
 * (gelu) GELU's tanh approximation, Gemma's GeGLU, with z = 2y, y = sqrt(2 / pi) (x + 0.044715 x^3), as
 * 0.5 x (1 + tanh(y)) is. */
static void gated_mul(const float *gate_up, float *out, int64_t rows, int64_t width, int gelu, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        int64_t i = 0;
        for (; i + 16 <= width; i += 16) { /* what the loop below does, 16 at a time */
            f32x16 g = load16f(gate + i), z = gelu ? 2.0f * (0.7978845608f * (g + 0.044715f * g * g * g)) : g;
            f32x16 product = g / (1.0f + exp16(-z)) * load16f(up + i);
            memcpy(out + r * width + i, &product, sizeof(product));
        }
        for (; i < width; i++) {
            float g = gate[i], z = gelu ? 2.0f * (0.7978845608f * (g + 0.044715f * g * g * g)) : g;
            out[r * width + i] = g / (1.0f + exp_approx(-z)) * up[i];
        }
    }
}

void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width, int threads) {
    gated_mul(gate_up, out, rows, width, 0, threads);
}

void gelu_mul(const float *gate_up, float *out, int64_t rows, int64_t width, int threads) {
    gated_mul(gate_up, out, rows, width, 1, threads);
}

/* Rotate heads [rows, heads, D] (row stride in elements) in place: each head's first R dims (R = D, or less for
 * a partial rotary) x * cos + roll(x, R / 2) * sin with each row's table rows [rows, R] (sin signed: see
 * rotary.py); the rest of the head passes unrotated. */
void rotate(float *x, int64_t row_stride, const float *cos_rows, const float *sin_rows, int64_t rows, int64_t heads,
            int64_t head_dim, int64_t rotary_dim, int threads) {
    int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float rotated[rotary_dim];
        const float *c = cos_rows + r * rotary_dim, *s = sin_rows + r * rotary_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * head_dim;
            for (int64_t d = 0; d < half; d++) /* two halves, so that each loop vectorizes */
                rotated[d] = v[d] * c[d] + v[d + half] * s[d];
            for (int64_t d = half; d < rotary_dim; d++) rotated[d] = v[d] * c[d] + v[d - half] * s[d];
            memcpy(v, rotated, rotary_dim * sizeof(float));
        }
    }
}

/* hsum of each of 16 vectors, as one vector (lane t: hsum(v[t])), with every addition hsum makes, in its
 * order: a transposition by halves, 30 shuffles and 15 additions where 16 hsums take 48 and 64. */
#if LANES == 8 /* the same additions on 8-lane halves, whose shuffles GCC keeps in registers */
static inline __attribute__((always_inline)) f32x16 hsum16(const f32x16 v[16]) {
    f32v halves[16], quarters[8], eighths[4], sums[2];
    for (int t = 0; t < 16; t++) { /* lanes i and i + 8 of each vector */
        f32v piece[2];
        memcpy(piece, &v[t], sizeof(v[t]));
        halves[t] = piece[0] + piece[1];
    }
    for (int j = 0; j < 8; j++) /* lanes i and i + 4: two vectors' 4 sums each */
        quarters[j] = __builtin_shufflevector(halves[2 * j], halves[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                      __builtin_shufflevector(halves[2 * j], halves[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int j = 0; j < 4; j++) /* lanes i and i + 2 of each 4 */
        eighths[j] = __builtin_shufflevector(quarters[2 * j], quarters[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(quarters[2 * j], quarters[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    for (int j = 0; j < 2; j++)
        sums[j] = __builtin_shufflevector(eighths[2 * j], eighths[2 * j + 1], 0, 2, 4, 6, 8, 10, 12, 14) +
                  __builtin_shufflevector(eighths[2 * j], eighths[2 * j + 1], 1, 3, 5, 7, 9, 11, 13, 15);
    f32x16 out;
    memcpy(&out, sums, sizeof(out));
    return out;
}
#else
static inline __attribute__((always_inline)) f32x16 hsum16(const f32x16 v[16]) {
    f32x16 halves[8], quarters[4], eighths[2];
    for (int j = 0; j < 8; j++) /* lanes i and i + 8 of two vectors: 8 sums of each */
        halves[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++) /* lanes i and i + 4 of each 8: 4 sums of four vectors */
        quarters[j] = __builtin_shufflevector(halves[2 * j], halves[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                      __builtin_shufflevector(halves[2 * j], halves[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++) /* lanes i and i + 2 of each 4 */
        eighths[j] = __builtin_shufflevector(quarters[2 * j], quarters[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                     __builtin_shufflevector(quarters[2 * j], quarters[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(eighths[0], eighths[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(eighths[0], eighths[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

#define PREFETCH_AHEAD 8 /* tokens */

/* slots are scattered over blocks: fetch a token's key and value ahead of their use */
static inline void prefetch_token(const bf16 *keys, const bf16 *values, const int64_t *offsets, int64_t t,
                                  int64_t len, int64_t head_dim) {
    if (t + PREFETCH_AHEAD < len)
        for (int64_t line = 0; line < head_dim; line += 32) {
            __builtin_prefetch(keys + offsets[t + PREFETCH_AHEAD] + line);
            __builtin_prefetch(values + offsets[t + PREFETCH_AHEAD] + line);
        }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) /* 8-lane registers: 16-lane sums would spill */
/* 8 bf16 as float32 */
static inline __m256 widen8(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* scores [group, stride] of the group's heads for each of len tokens (whole blocks of 16 computed): each key
 * widened once into registers for the group, each head's query read from L1 (aligned), one multiply-add per 8
 * products; a token's sums in two halves of 8 lanes (even and odd runs of 8 dimensions), 16 tokens' sums folded
 * by hsum16 */
static inline __attribute__((always_inline)) void score_tokens(const float *q, const int64_t group, const bf16 *keys,
                                                               const bf16 *values, const int64_t *offsets,
                                                               int64_t len, const int64_t head_dim, float scale,
                                                               int64_t stride, float *scores) {
    const int64_t runs = head_dim / 8; /* even: head_dim is a multiple of 16 (attention_fits) */
    float query[group][head_dim] __attribute__((aligned(32)));
    memcpy(query, q, sizeof(query));
    for (int64_t start = 0; start < len; start += 16) {
        f32x16 sums[group][16];
        for (int64_t i = 0; i < 16; i++) {
            int64_t t = start + i;
            if (t >= len) {
                for (int64_t h = 0; h < group; h++) sums[h][i] = (f32x16){0};
                continue;
            }
            prefetch_token(keys, values, offsets, t, len, head_dim);
            __m256 key[runs];
            for (int64_t c = 0; c < runs; c++) key[c] = widen8(keys + offsets[t] + 8 * c);
            for (int64_t h = 0; h < group; h++) {
                __m256 acc[2] = {_mm256_mul_ps(_mm256_load_ps(query[h]), key[0]),
                                 _mm256_mul_ps(_mm256_load_ps(query[h] + 8), key[1])};
                for (int64_t c = 2; c < runs; c++)
                    acc[c % 2] = _mm256_fmadd_ps(_mm256_load_ps(query[h] + 8 * c), key[c], acc[c % 2]);
                memcpy(&sums[h][i], acc, sizeof(acc));
            }
        }
        for (int64_t h = 0; h < group; h++) {
            f32x16 block = hsum16(sums[h]) * scale;
            memcpy(scores + h * stride + start, &block, sizeof(block));
        }
    }
}

/* weighed [group, D] = sum over each head's tokens (lens) of weights [group, stride] times values (in token
 * order): 16 tokens' values widened at a time into L1, then each head's sums in 8 registers of 8 lanes (16-lane
 * sums would not fit the 16 registers), one multiply-add per value */
static inline __attribute__((always_inline)) void weigh_values(const bf16 *values, const int64_t *offsets,
                                                               int64_t len, const int64_t *lens, const int64_t group,
                                                               const int64_t head_dim, int64_t stride,
                                                               const float *weights, float *weighed) {
    const int64_t chunks = head_dim / 8;
    float value[16][head_dim] __attribute__((aligned(32)));
    for (int64_t d = 0; d < group * head_dim; d++) weighed[d] = 0.0f;
    for (int64_t start = 0; start < len; start += 16) {
        int64_t block = len - start < 16 ? len - start : 16;
        for (int64_t i = 0; i < block; i++)
            for (int64_t d = 0; d < head_dim; d++) value[i][d] = to_float(values[offsets[start + i] + d]);
        for (int64_t h = 0; h < group; h++) {
            int64_t own = lens[h] - start < block ? lens[h] - start : block; /* this head's tokens of the block */
            /* 64 dimensions at a time, in a fixed array that stays in registers (one sized by head_dim was
             * written back to the stack at every token: 8 stores per 8 multiply-adds) */
            for (int64_t c0 = 0; c0 < chunks && own > 0; c0 += 8) {
                const int64_t width = chunks - c0 < 8 ? chunks - c0 : 8;
                float *sums = weighed + h * head_dim + 8 * c0;
                __m256 acc[8];
                for (int64_t c = 0; c < width; c++) acc[c] = _mm256_loadu_ps(sums + 8 * c);
                for (int64_t i = 0; i < own; i++) {
                    __m256 weight = _mm256_broadcast_ss(weights + h * stride + start + i);
                    for (int64_t c = 0; c < width; c++)
                        acc[c] = _mm256_fmadd_ps(weight, _mm256_load_ps(value[i] + 8 * (c0 + c)), acc[c]);
                }
                for (int64_t c = 0; c < width; c++) _mm256_storeu_ps(sums + 8 * c, acc[c]);
            }
        }
    }
}
#else
/* scores [group, stride] of the group's heads for each of len tokens (whole blocks of 16 computed): each key
 * widened once for the group, 16 dimensions at a time, 16 tokens' sums folded into one vector by hsum16 */
static inline __attribute__((always_inline)) void score_tokens(const float *q, const int64_t group, const bf16 *keys,
                                                               const bf16 *values, const int64_t *offsets,
                                                               int64_t len, const int64_t head_dim, float scale,
                                                               int64_t stride, float *scores) {
    const int64_t chunks = head_dim / 16; /* head_dim is a multiple of 16 (attention_fits) */
    f32x16 sums[group][16];
    for (int64_t start = 0; start < len; start += 16) {
        for (int64_t i = 0; i < 16; i++) {
            int64_t t = start + i;
            prefetch_token(keys, values, offsets, t, len, head_dim);
            f32x16 key[chunks];
            for (int64_t c = 0; c < chunks; c++) key[c] = t < len ? load16(keys + offsets[t] + c * 16) : (f32x16){0};
            for (int64_t h = 0; h < group; h++) {
                f32x16 acc = load16f(q + h * head_dim) * key[0];
                for (int64_t c = 1; c < chunks; c++) acc += load16f(q + h * head_dim + c * 16) * key[c];
                sums[h][i] = acc;
            }
        }
        for (int64_t h = 0; h < group; h++) {
            f32x16 block = hsum16(sums[h]) * scale;
            memcpy(scores + h * stride + start, &block, sizeof(block));
        }
    }
}

/* weighed [group, D] = sum over each head's tokens (lens) of weights [group, stride] times values (in token
 * order), each value widened once for the group's heads, their sums a chain per head and 16 dimensions, several
 * in flight */
static inline __attribute__((always_inline)) void weigh_values(const bf16 *values, const int64_t *offsets,
                                                               int64_t len, const int64_t *lens, const int64_t group,
                                                               const int64_t head_dim, int64_t stride,
                                                               const float *weights, float *weighed) {
    const int64_t chunks = head_dim / 16;
    f32x16 acc[group][chunks];
    for (int64_t h = 0; h < group; h++)
        for (int64_t c = 0; c < chunks; c++) acc[h][c] = (f32x16){0};
    for (int64_t t = 0; t < len; t++) {
        f32x16 value[chunks];
        for (int64_t c = 0; c < chunks; c++) value[c] = load16(values + offsets[t] + c * 16);
        for (int64_t h = 0; h < group; h++)
            if (t < lens[h])
                for (int64_t c = 0; c < chunks; c++) acc[h][c] += weights[h * stride + t] * value[c];
    }
    memcpy(weighed, acc, sizeof(acc));
}
#endif

/* scores [0, len) as exp(score - their largest), in place, and their sum; the largest (in *peak) and the sum run
 * per lane, then across the lanes (a serial sum took a dependent addition per score). The padding past len, up to a
 * whole block of 16 (the scores' stride leaves room), is computed, never counted. */
static inline float softmax_numerators(float *scores, int64_t len, float *peak_out) {
    i32v lane;
    for (int l = 0; l < LANES; l++) lane[l] = l;
    f32v most = (f32v){0} - INFINITY, sum = {0};
    for (int64_t t = 0; t < len; t += LANES) {
        f32v v;
        memcpy(&v, scores + t, sizeof(v));
        v = select_v(lane + (int32_t)t < (int32_t)len, v, most);
        most = select_v(v > most, v, most); /* a NaN never wins, as in a scan */
    }
    float peak = -INFINITY, total = 0.0f;
    for (int l = 0; l < LANES; l++) peak = most[l] > peak ? most[l] : peak;
    for (int64_t t = 0; t < len; t += 16) {
        f32x16 block;
        memcpy(&block, scores + t, sizeof(block));
        block = exp16(block - peak);
        memcpy(scores + t, &block, sizeof(block));
        for (int p = 0; p < 16; p += LANES) {
            f32v part;
            memcpy(&part, scores + t + p, sizeof(part));
            sum += select_v(lane + (int32_t)(t + p) < (int32_t)len, part, (f32v){0});
        }
    }
    for (int l = 0; l < LANES; l++) total += sum[l];
    *peak_out = peak;
    return total;
}

/* One part of softmax(q k^T * scale) v for the group query heads that share one key-value head: over the len cached
 * tokens at offsets, each head over its own first lens[h] of them (none, where lens[h] is 0), in float32. Per head:
 * weighed [group, D], the sum of each token's exp(score - peak) times its value; total, the sum of those
 * numerators; peak, the largest score. Each key and value is read once for the whole group, and each head's sums
 * run in the order one head alone would run them (the scores of tokens past its own are computed, never read).
 * Scores fit on the stack (a float per token and head, in whole blocks of 16). q: the group's heads, one after
 * another. */
static inline __attribute__((always_inline)) void attend_part(const float *q, const int64_t group, const bf16 *keys,
                                                              const bf16 *values, const int64_t *offsets, int64_t len,
                                                              const int64_t *lens, const int64_t head_dim, float scale,
                                                              float *peak, float *total, float *weighed) {
    const int64_t stride = len + 15;
    float scores[group][stride];
    score_tokens(q, group, keys, values, offsets, len, head_dim, scale, stride, &scores[0][0]);
    for (int64_t h = 0; h < group; h++) total[h] = softmax_numerators(scores[h], lens[h], peak + h);
    weigh_values(values, offsets, len, lens, group, head_dim, stride, &scores[0][0], weighed);
}

/* attend_part with the common head sizes as constants, so that a head's query stays in registers */
typedef void (*attend_fn)(const float *, int64_t, const bf16 *, const bf16 *, const int64_t *, int64_t,
                          const int64_t *, int64_t, float, float *, float *, float *);
#define ATTEND_HEAD_DIM(D)                                                                                         \
    static void attend_##D(const float *q, int64_t group, const bf16 *keys, const bf16 *values,                   \
                           const int64_t *offsets, int64_t len, const int64_t *lens, int64_t head_dim, float scale, \
                           float *peak, float *total, float *weighed) {                                            \
        (void)head_dim;                                                                                            \
        attend_part(q, group, keys, values, offsets, len, lens, D, scale, peak, total, weighed);                   \
    }
ATTEND_HEAD_DIM(64) ATTEND_HEAD_DIM(128)
static void attend_any(const float *q, int64_t group, const bf16 *keys, const bf16 *values, const int64_t *offsets,
                       int64_t len, const int64_t *lens, int64_t head_dim, float scale, float *peak, float *total,
                       float *weighed) {
    attend_part(q, group, keys, values, offsets, len, lens, head_dim, scale, peak, total, weighed);
}

/* A context is attended in parts of ATTEND_PART tokens (counted from its first token), each with its own peak, then
 * the parts are folded in order (fold_part): a row's result depends on its context alone, whichever thread computed
 * each part. A context of one part is attended as one whole. */
#define ATTEND_PART 256

/* Folds a part (peak, total, weighed) of heads heads into the running one, which it starts where `first`: each
 * side's sums rescaled to the larger peak. */
static void fold_part(int64_t heads, int64_t head_dim, int first, float *peak, float *total, float *weighed,
                      const float *part_peak, const float *part_total, const float *part_weighed) {
    for (int64_t h = 0; h < heads; h++) {
        if (first) {
            peak[h] = part_peak[h], total[h] = part_total[h];
            memcpy(weighed + h * head_dim, part_weighed + h * head_dim, head_dim * sizeof(float));
            continue;
        }
        if (part_total[h] == 0.0f) continue; /* the head has no tokens in this part */
        float most = part_peak[h] > peak[h] ? part_peak[h] : peak[h];
        float before = expf(peak[h] - most), after = expf(part_peak[h] - most);
        peak[h] = most, total[h] = total[h] * before + part_total[h] * after;
        for (int64_t d = 0; d < head_dim; d++)
            weighed[h * head_dim + d] = weighed[h * head_dim + d] * before + part_weighed[h * head_dim + d] * after;
    }
}

/* The rows a task attends at once (see paged_attention): at most RUN_ROWS, and fewer where there would be under
 * two tasks per thread, or where the run's scores would take more than RUN_SCORES bytes of the stack. */
#define RUN_ROWS 8
#define RUN_SCORES (256 * 1024)

/* Runs of consecutive rows of one sequence (a prefill chunk's, a draft's verification), none of them cut by a
 * sliding window, of at most `most` rows: their starting rows and sizes. Returns how many. */
static int64_t row_runs(const int64_t *row_seqs, const int64_t *context_lens, int64_t rows, int64_t window,
                        int64_t most, int64_t *run_start, int64_t *run_rows) {
    int64_t runs = 0;
#define CUT(r) (window > 0 && context_lens[r] > window) /* row r sees only the window's last tokens */
    for (int64_t r = 0; r < rows; r++) {
        int joins = runs > 0 && !CUT(r) && !CUT(r - 1) && run_rows[runs - 1] < most && row_seqs[r] == row_seqs[r - 1];
        if (joins) {
            run_rows[runs - 1]++;
        } else {
            run_start[runs] = r, run_rows[runs] = 1, runs++;
        }
    }
    return runs;
#undef CUT
}

/* What paged_attention's tasks share: a task is one key-value head of one run of rows (row_runs) */
typedef struct {
    const float *q;
    int64_t q_row_stride;
    const bf16 *cache;
    const int64_t *offsets, *starts, *row_seqs, *context_lens, *run_start, *run_rows;
    int64_t heads, kv_heads, head_dim, window;
    float scale;
    attend_fn attend;
} attention_job;

/* A task's first row and rows, its first token (past a sliding window's cut) and the tokens it reads from there */
static void task_span(const attention_job *job, int64_t task, int64_t *r0, int64_t *n, int64_t *first, int64_t *span) {
    int64_t run = task / job->kv_heads, len = 0;
    *r0 = job->run_start[run], *n = job->run_rows[run];
    for (int64_t i = 0; i < *n; i++) len = job->context_lens[*r0 + i] > len ? job->context_lens[*r0 + i] : len;
    *first = *n == 1 && job->window > 0 && len > job->window ? len - job->window : 0; /* runs are never cut */
    *span = len - *first;
}

static int64_t task_parts(const attention_job *job, int64_t task) {
    int64_t r0, n, first, span;
    task_span(job, task, &r0, &n, &first, &span);
    return (span + ATTEND_PART - 1) / ATTEND_PART;
}

/* Part `part` of a task: its heads (each row's query heads of the task's key-value head, row by row) over their
 * tokens in that part, each over its own row's context */
static void attend_task_part(const attention_job *job, int64_t task, int64_t part, float *peak, float *total,
                             float *weighed) {
    int64_t r0, n, first, span, group = job->heads / job->kv_heads, g = task % job->kv_heads, d = job->head_dim;
    task_span(job, task, &r0, &n, &first, &span);
    int64_t start = part * ATTEND_PART, len = span - start < ATTEND_PART ? span - start : ATTEND_PART;
    int64_t own[n * group];
    float run_q[n == 1 ? 1 : n * group * d];
    const float *q = job->q + r0 * job->q_row_stride + g * group * d; /* one row's heads in place */
    for (int64_t i = 0; i < n; i++) {
        int64_t row_len = (n == 1 ? span : job->context_lens[r0 + i]) - start;
        for (int64_t h = 0; h < group; h++) own[i * group + h] = row_len < 0 ? 0 : row_len < len ? row_len : len;
        if (n > 1) memcpy(run_q + i * group * d, q + i * job->q_row_stride, group * d * sizeof(float));
    }
    const int64_t *offsets = job->offsets + job->starts[job->row_seqs[r0]] + first + start;
    const bf16 *keys = job->cache + g * d, *values = job->cache + (job->kv_heads + g) * d;
    job->attend(n == 1 ? q : run_q, n * group, keys, values, offsets, len, own, d, job->scale, peak, total, weighed);
}

/* A task's parts folded in order (each computed here, or found at parts, where not NULL), divided into its rows' out */
static void finish_task(const attention_job *job, int64_t task, const float *parts, float *out) {
    int64_t r0, n, first, span, group = job->heads / job->kv_heads, g = task % job->kv_heads, d = job->head_dim;
    task_span(job, task, &r0, &n, &first, &span);
    int64_t heads = n * group, count = task_parts(job, task), width = heads * (2 + d);
    float peak[heads], total[heads], weighed[heads * d], part[parts ? 1 : width];
    for (int64_t p = 0; p < count; p++) {
        const float *found = parts ? parts + p * width : part;
        if (!parts) attend_task_part(job, task, p, part, part + heads, part + 2 * heads);
        fold_part(heads, d, p == 0, peak, total, weighed, found, found + heads, found + 2 * heads);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < group; h++)
            for (int64_t j = 0; j < d; j++)
                out[((r0 + i) * job->heads + g * group + h) * d + j] = weighed[(i * group + h) * d + j] / total[i * group + h];
}

/* Query rows over their sequences' cached contexts, which already hold the rows' own keys and values: a decode's
 * one token, or each token of a prefill chunk, which sees its sequence up to itself. q: [rows, heads, D] with a
 * row stride; cache: [slots, 2 * kv_heads, D]; block_table: [seqs, max_blocks]; row_seqs: [rows], each row's
 * table row; context_lens: [rows], the tokens each row sees, itself included (of which the last window, where
 * window > 0); out: [rows, heads * D]. A run of one sequence's consecutive rows attends at once, as one group of
 * query heads over the run's longest context with each head over its own row's (attend_part): each key and value
 * is read once for the run instead of once per row, and each row's result is the one it gets alone. Each run's
 * key-value heads are independent tasks, handed out dynamically (see the top); where there are fewer than two a
 * thread (a decode or two, whose contexts grow long), the parts of their contexts are (ATTEND_PART). */
void paged_attention(const float *q, int64_t q_row_stride, const bf16 *cache, const int64_t *block_table,
                     int64_t seqs, int64_t max_blocks, const int64_t *row_seqs, const int64_t *context_lens,
                     int64_t block_size, float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     float scale, int64_t window, int threads) {
    int64_t group = heads / kv_heads, slot_width = 2 * kv_heads * head_dim, total = 0, work = 0;
    int64_t lens[seqs], starts[seqs]; /* a sequence's slots, read by all its rows: as many as its last row sees */
    for (int64_t s = 0; s < seqs; s++) lens[s] = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t *len = lens + row_seqs[r];
        *len = context_lens[r] > *len ? context_lens[r] : *len;
        work += context_lens[r];
    }
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; s++) starts[s] = total, total += lens[s], longest = lens[s] > longest ? lens[s] : longest;
    int64_t *offsets = malloc(total * sizeof(int64_t)); /* each token's slot, as an element offset */
    for (int64_t s = 0; s < seqs; s++)
        for (int64_t t = 0; t < lens[s]; t++)
            offsets[starts[s] + t] = (block_table[s * max_blocks + t / block_size] * block_size + t % block_size) * slot_width;
    int64_t part = longest < ATTEND_PART ? longest : ATTEND_PART;
    int64_t most = rows * kv_heads / (2 * threads), fits = RUN_SCORES / ((part + 15) * group * (int64_t)sizeof(float));
    most = most < RUN_ROWS ? most : RUN_ROWS;
    most = most < fits ? most : fits;
    int64_t *run_start = malloc(2 * rows * sizeof(int64_t)), *run_rows = run_start + rows;
    int64_t runs = row_runs(row_seqs, context_lens, rows, window, most > 1 ? most : 1, run_start, run_rows);
    attention_job job = {q, q_row_stride, cache, offsets, starts, row_seqs, context_lens, run_start, run_rows,
                         heads, kv_heads, head_dim, window, scale,
                         head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any};
    int64_t tasks = runs * kv_heads, parallel = work * heads >= 2048;
    if (tasks >= 2 * threads || !parallel) {
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (parallel)
        for (int64_t task = 0; task < tasks; task++) finish_task(&job, task, NULL, out);
    } else { /* few tasks: their parts spread over the threads, then folded in order */
        int64_t first_item[tasks + 1], width = RUN_ROWS * group * (2 + head_dim);
        first_item[0] = 0;
        for (int64_t task = 0; task < tasks; task++) first_item[task + 1] = first_item[task] + task_parts(&job, task);
        float *parts = malloc(first_item[tasks] * width * sizeof(float));
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < first_item[tasks]; item++) {
                int64_t task = 0;
                while (first_item[task + 1] <= item) task++;
                int64_t r0, n, first, span, heads_of = group;
                task_span(&job, task, &r0, &n, &first, &span);
                heads_of *= n;
                float *at = parts + first_item[task] * width + (item - first_item[task]) * heads_of * (2 + head_dim);
                attend_task_part(&job, task, item - first_item[task], at, at + heads_of, at + 2 * heads_of);
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++) finish_task(&job, task, parts + first_item[task] * width, out);
        }
        free(parts);
    }
    free(run_start);
    free(offsets);
}

/* --- float32 rows as 16-bit integers, for AVX2's integer multiply-adds ---------------------------------------
 * vpmaddwd makes twice as many multiply-adds per instruction as float32's FMA, on as many ports. Each row's group
 * of 32 inputs becomes 16-bit integers once per step, x * 2^e rounded to nearest, with e per group such that the
 * largest magnitude lands in [2^14, 2^15): each input is off by 2^-16 of the group's largest at most (bf16 rows
 * would be off by 2^-9 of each value). vpmaddwd multiplies, per 32-bit lane, one output's two weights (16-bit
 * integers) by a pair of inputs and adds the two products. A group's sum is an exact integer whatever its order;
 * each output's sums over groups run in group order, so a row's result never depends on its batch. A weight's
 * group is unpacked once into L1, as [pair][2] vectors (outputs 0-7, 8-15), and read there 4 rows at a time, 4
 * input pairs per loop turn: GCC then keeps the 8 sums in registers (5 or 6 rows spilled some, 30-40% slower at
 * 16 and 64 rows). With AVX-512 VNNI a row's sums are one 512-bit register, and 8 rows fit (against 4 rows: 16
 * rows 11% faster, 64 rows 18%, on an AMD EPYC Zen 5). */
#define GROUP 32
#define TILE 16 /* outputs per vector lane set */

/* the groups of a row of k inputs, the last one padded with zeros */
static inline int64_t groups_of(int64_t k) { return (k + GROUP - 1) / GROUP; }

#if defined(__AVX2__) && defined(__FMA__) /* the packed weights' path below */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define ROW_BLOCK 8 /* a row's sums are one 512-bit register (row_block) */
#else
#define ROW_BLOCK 4
#endif
typedef struct {
    int16_t q[GROUP]; /* x * 2^e, rounded to nearest even; zeros past a row's last input */
    float scale;      /* 2^-e */
} int16_group;

/* the largest of 8 lanes of 32 bits */
static inline uint32_t max_epu32(__m256i v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_srli_si128(m, 8));
    m = _mm_max_epu32(m, _mm_srli_si128(m, 4));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* count (up to 32) inputs as integers and their scale (a largest magnitude of 2^15 - 1/2 or more, rounded up to
 * 2^15, saturates to 2^15 - 1) */
/* a group's 32 inputs (zeros past count) into v, and the bits of their largest magnitude: float magnitudes order as
 * their bits do, NaN above infinity */
static inline uint32_t load_group(const float *x, int64_t count, __m256 v[4]) {
    float padded[GROUP] = {0};
    if (count < GROUP) x = memcpy(padded, x, count * sizeof(float));
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    __m256i largest = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        largest = _mm256_max_epu32(largest, _mm256_and_si256(_mm256_castps_si256(v[i]), magnitude));
    }
    return max_epu32(largest);
}

static void quantize_group(const float *x, int64_t count, void *out) {
    int16_group *group = out;
    __m256 v[4];
    int exponent = (int)(load_group(x, count, v) >> 23);
    if (exponent < 15) exponent = 15; /* biased: e = 141 - exponent; under 2^-112 as 2^-112, so 2^e stays finite */
    float up, down;                   /* 2^e and 2^-e */
    uint32_t up_bits = (uint32_t)(268 - exponent) << 23, down_bits = (uint32_t)(exponent - 14) << 23;
    memcpy(&up, &up_bits, 4);
    memcpy(&down, &down_bits, 4);
    group->scale = exponent == 255 ? NAN : down; /* an infinity or NaN makes the group's outputs NaN */
    __m256 factor = _mm256_set1_ps(exponent == 255 ? 0.0f : up);
    for (int h = 0; h < 2; h++) { /* 8 + 8 floats, rounded to nearest even, packed to 16 bits (in-lane) */
        __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h], factor));
        __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + 1], factor));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xd8);
        _mm256_storeu_si256((__m256i *)(group->q + 16 * h), packed);
    }
}

/* x [rows, k] as [rows][ceil(k / 32)] groups of `size` bytes, each made by `quantize`, in a new buffer the caller
 * frees */
static void *quantize_rows_with(void (*quantize)(const float *, int64_t, void *), size_t size, const float *x,
                                int64_t rows, int64_t k, int threads) {
    int64_t groups = groups_of(k);
    char *out = malloc(rows * groups * size);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
    for (int64_t i = 0; i < rows * groups; i++) {
        int64_t r = i / groups, g = i % groups, start = g * GROUP;
        quantize(x + r * k + start, k - start < GROUP ? k - start : GROUP, out + i * size);
    }
    return out;
}

static int16_group *quantize_rows(const float *x, int64_t rows, int64_t k, int threads) {
    return quantize_rows_with(quantize_group, sizeof(int16_group), x, rows, k, threads);
}

/* acc [2] += 16 outputs' products with a pair of inputs (two adjacent q of an int16_group). With VNNI one
 * vpdpwssd does what vpmaddwd and vpaddd do (the same sums: no product pair here reaches 2^31) */
static inline void madd_pair(__m256i acc[2], const __m256i w[2], const int16_t *pair) {
    int32_t both;
    memcpy(&both, pair, 4);
    __m256i x = _mm256_set1_epi32(both);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    for (int v = 0; v < 2; v++) acc[v] = _mm256_dpwssd_epi32(acc[v], w[v], x);
#elif defined(__AVXVNNI__)
    for (int v = 0; v < 2; v++) acc[v] = _mm256_dpwssd_avx_epi32(acc[v], w[v], x);
#else
    for (int v = 0; v < 2; v++) acc[v] = _mm256_add_epi32(acc[v], _mm256_madd_epi16(w[v], x));
#endif
}

/* a row's sums [8v, 8v + 8) += a group's 8 integer sums times scale (those outputs') and the row's scale, plus
 * low * the row's group sum where the weight has an offset (low not NULL) */
static inline __attribute__((always_inline)) void add_half(__m256i acc, const int v, const float *scale,
                                                           const float *low, float row_scale, float group_sum,
                                                           float *sums) {
    __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * v), _mm256_set1_ps(row_scale)));
    if (low) dot = _mm256_fmadd_ps(_mm256_loadu_ps(low + 8 * v), _mm256_set1_ps(group_sum), dot);
    _mm256_storeu_ps(sums + 8 * v, _mm256_add_ps(_mm256_loadu_ps(sums + 8 * v), dot));
}

/* sums [rows, 16] += a group's integer sums acc [rows][2] times scale (16 outputs') and the rows' 2^-e, plus
 * low * group_sums where the weight has an offset (low not NULL). x, group_sums: the first row's, rows apart by
 * groups. */
static inline __attribute__((always_inline)) void add_group(__m256i acc[][2], const int rows, const float *scale,
                                                            const float *low, const int16_group *x,
                                                            const float *group_sums, int64_t groups, float *sums) {
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < rows; r++)
            add_half(acc[r][v], v, scale, low, x[r * groups].scale, low ? group_sums[r * groups] : 0.0f, sums + r * TILE);
}

/* sums [rows, 16] += a group's products for up to ROW_BLOCK rows with its unpacked weight w. Inlined with a
 * constant row count, so that the sums stay in registers. With AVX-512 VNNI a pair's 16 outputs (w[pair][0] and
 * [1], adjacent in L1) are one 512-bit register and one vpdpwssd per row: the same sums, half the instructions. */
static inline __attribute__((always_inline)) void row_block(const __m256i (*w)[2], const int16_group *x, const int rows,
                                                            const float *scale, const float *low,
                                                            const float *group_sums, int64_t groups, float *sums) {
    __m256i acc[ROW_BLOCK][2];
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    __m512i wide[ROW_BLOCK];
    for (int r = 0; r < rows; r++) wide[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int pair = 0; pair < GROUP / 2; pair++) {
        __m512i weights = _mm512_loadu_si512(w[pair]);
        for (int r = 0; r < rows; r++) {
            int32_t both;
            memcpy(&both, x[r * groups].q + 2 * pair, 4);
            wide[r] = _mm512_dpwssd_epi32(wide[r], weights, _mm512_set1_epi32(both));
        }
    }
    for (int r = 0; r < rows; r++) {
        acc[r][0] = _mm512_castsi512_si256(wide[r]);
        acc[r][1] = _mm512_extracti64x4_epi64(wide[r], 1);
    }
#else
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int pair = 0; pair < GROUP / 2; pair++)
        for (int r = 0; r < rows; r++) madd_pair(acc[r], w[pair], x[r * groups].q + 2 * pair);
#endif
    add_group(acc, rows, scale, low, x, group_sums, groups, sums);
}

typedef void (*row_block_fn)(const __m256i (*)[2], const int16_group *, const float *, const float *, const float *,
                             int64_t, float *);
#define ROW_BLOCK_OF(R)                                                                                            \
    static void row_block_##R(const __m256i (*w)[2], const int16_group *x, const float *scale, const float *low,   \
                              const float *group_sums, int64_t groups, float *sums) {                              \
        row_block(w, x, R, scale, low, group_sums, groups, sums);                                                  \
    }
ROW_BLOCK_OF(1) ROW_BLOCK_OF(2) ROW_BLOCK_OF(3) ROW_BLOCK_OF(4)
#if ROW_BLOCK == 8
ROW_BLOCK_OF(5) ROW_BLOCK_OF(6) ROW_BLOCK_OF(7) ROW_BLOCK_OF(8)
#endif

/* sums [rows, 16] += one group's products for every row (x: the first row's group, rows apart by groups) */
static void group_times_rows(const __m256i (*w)[2], const int16_group *x, int64_t rows, const float *scale,
                             const float *low, const float *group_sums, int64_t groups, float *sums) {
    static const row_block_fn row_blocks[ROW_BLOCK + 1] = {NULL, row_block_1, row_block_2, row_block_3, row_block_4,
#if ROW_BLOCK == 8
                                                          row_block_5, row_block_6, row_block_7, row_block_8
#endif
    };
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        int64_t block = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
        row_blocks[block](w, x + r0 * groups, scale, low, group_sums ? group_sums + r0 * groups : NULL, groups,
                          sums + r0 * TILE);
    }
}
#endif

/* --- packed weights times bf16 rows: int4 and int8 groups ----------------------------------------------------
 * A weight [n, k] in groups of 32 inputs, w = q * scale + low per group, laid out for 16 outputs at a time
 * (int4_kernel_layout and int8_kernel_layout in cpu.py):
 * - int4, q in 0..15 (GGUF's Q4_0, Q4_1, Q4_K): codes [n / 16, k / 32, 8, 32] bytes; in chunk c of a group, byte j
 *   holds output j / 2's code for input 2c + j % 2 (low nibble) and 2(c + 8) + j % 2 (high nibble);
 * - int8, q in -128..127 (Q8_0, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS, and weights quantized from their values): codes
 *   [n / 16, k / 2, 16, 2]; pair p of a group (inputs 2p and 2p + 1) is one run of 32 bytes, byte j holding output
 *   j / 2's code for input 2p + j % 2.
 * So a tile's group is 8 steps of two input pairs, s and s + 8: a chunk's two nibble halves, or two runs.
 * scale, low: float16 [n / 16, k / 32, 16], a GGUF's own d and m where it has them (int4 always has a low; an int8
 * weight without offsets passes NULL). Per group, y += scale * (q . x) + low * sum(x), each output's sums in one
 * fixed order, whatever the number of rows or threads. */
#define GROUP_BYTES(bits) ((bits) * GROUP * TILE / 8) /* a tile's group of codes: 256 bytes of int4, 512 of int8 */
typedef uint8_t u8x32 __attribute__((vector_size(32)));

/* 32 bytes of codes as 32 words, each still holding both nibbles */
static inline u16x32 widen_codes(const uint8_t *codes) {
#ifdef __AVX512BW__ /* one vpmovzxbw, where GCC's generic widening takes four instructions */
    return (u16x32)_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)codes));
#else
    u8x32 bytes;
    memcpy(&bytes, codes, sizeof(bytes));
    return __builtin_convertvector(bytes, u16x32);
#endif
}

#if !defined(__AVX2__) || !defined(__FMA__)
/* Without AVX2: float32 lanes, each one output's products with one input of a pair (lane j: output j / 2, input
 * j % 2), in plain C that the compiler vectorizes. */
#define ROW_TILE 8 /* rows sharing one unpacking of the codes */
typedef float f32x32 __attribute__((vector_size(128)));
typedef int8_t i8x32 __attribute__((vector_size(32)));
typedef float tile_input; /* the rows as given */

/* step s of a tile's group as floats: pairs s (*a) and s + 8 (*b) */
static inline __attribute__((always_inline)) void unpack_step(const uint8_t *group, const int bits, const int s,
                                                              f32x32 *a, f32x32 *b) {
    if (bits == 4) {
        u16x32 wide = widen_codes(group + s * 32);
        *a = __builtin_convertvector(wide & 15, f32x32);
        *b = __builtin_convertvector(wide >> 4, f32x32);
    } else {
        i8x32 run_a, run_b;
        memcpy(&run_a, group + s * 32, sizeof(run_a));
        memcpy(&run_b, group + (s + 8) * 32, sizeof(run_b));
        *a = __builtin_convertvector(run_a, f32x32);
        *b = __builtin_convertvector(run_b, f32x32);
    }
}

/* a pair of inputs in every lane's parity: lane j holds x_pair[j % 2] */
static inline f32x32 pair_lanes(const float *x_pair) {
    f32x32 v;
    for (int j = 0; j < 32; j++) v[j] = x_pair[j % 2];
    return v;
}

/* 16 outputs (one tile of the weight) for up to ROW_TILE rows of x. Inlined with constant bits and row count
 * (below), so that the rows' accumulators stay in registers where they fit. */
static inline __attribute__((always_inline)) void packed_tile(const float *x, const int64_t rows, const int bits,
                                                              const uint8_t *codes, const f16 *scale, const f16 *low,
                                                              const float *group_sums, float *out, int64_t k) {
    int64_t groups = k / GROUP;
    float acc[ROW_TILE][TILE] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        f32x32 dots[ROW_TILE] = {{0}};
        for (int c = 0; c < 8; c++) {
            f32x32 w_low, w_high;
            unpack_step(codes + g * GROUP_BYTES(bits), bits, c, &w_low, &w_high);
            for (int64_t r = 0; r < rows; r++) {
                const float *xg = x + r * k + g * GROUP;
                dots[r] += w_low * pair_lanes(xg + 2 * c) + w_high * pair_lanes(xg + 2 * (c + 8));
            }
        }
        float group_scale[TILE], group_low[TILE];
        group_scale_low(scale, low, g * TILE, group_scale, group_low);
        for (int64_t r = 0; r < rows; r++)
            for (int o = 0; o < TILE; o++) {
                float dot = (dots[r][2 * o] + dots[r][2 * o + 1]) * group_scale[o];
                acc[r][o] += low ? dot + group_low[o] * group_sums[r * groups + g] : dot;
            }
    }
    memcpy(out, acc, rows * TILE * sizeof(float));
}

static const float *tile_inputs(const float *x, int64_t rows, int64_t k, int threads) { return x; }
static inline int64_t inputs_per_row(int64_t k) { return k; }

typedef void (*packed_tile_fn)(const float *, const uint8_t *, const f16 *, const f16 *, const float *, float *,
                               int64_t);
#define PACKED_TILE(B, R)                                                                                          \
    static void packed_tile_##B##_##R(const float *x, const uint8_t *codes, const f16 *scale, const f16 *low,      \
                                      const float *group_sums, float *out, int64_t k) {                            \
        packed_tile(x, R, B, codes, scale, low, group_sums, out, k);                                               \
    }
#define PACKED_TILES(B)                                                                                            \
    PACKED_TILE(B, 1) PACKED_TILE(B, 2) PACKED_TILE(B, 3) PACKED_TILE(B, 4)                                        \
    PACKED_TILE(B, 5) PACKED_TILE(B, 6) PACKED_TILE(B, 7) PACKED_TILE(B, 8)
PACKED_TILES(4) PACKED_TILES(8)
static const packed_tile_fn packed_tiles[2][ROW_TILE + 1] = {
    {NULL, packed_tile_4_1, packed_tile_4_2, packed_tile_4_3, packed_tile_4_4, packed_tile_4_5, packed_tile_4_6,
     packed_tile_4_7, packed_tile_4_8},
    {NULL, packed_tile_8_1, packed_tile_8_2, packed_tile_8_3, packed_tile_8_4, packed_tile_8_5, packed_tile_8_6,
     packed_tile_8_7, packed_tile_8_8}};

#define TILE_BLOCK 1 /* tiles a task multiplies at once */
static inline int64_t tiles_per_task(int64_t rows) { return 1; }

/* sums [tiles][rows, 16]: each tile of the weight for every row, ROW_TILE rows at a time */
static void tiles_rows(const int bits, const float *x, int64_t rows, int64_t tiles, const uint8_t *codes,
                       const f16 *scale, const f16 *low, const float *group_sums, float *sums, int64_t k) {
    int64_t groups = k / GROUP;
    for (int64_t j = 0; j < tiles; j++)
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            int64_t tile_rows = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            packed_tiles[bits == 8][tile_rows](x + r0 * k, codes + j * groups * GROUP_BYTES(bits),
                                               scale + j * groups * TILE, low ? low + j * groups * TILE : NULL,
                                               low ? group_sums + r0 * groups : NULL, sums + (j * rows + r0) * TILE,
                                               k);
        }
}
#else
/* With AVX2 and FMA: the rows as 16-bit integers (above), each pair of codes widened to 16-bit integers, per
 * 32-bit lane one output's two. A group's sum stays below 32 * 128 * 2^15 = 2^27 in magnitude (2^24 for int4), and
 * is an exact integer. Up to REGISTER_ROWS_MAX rows widen each step into registers as they go, one row for 4 tiles
 * at once, two rows for 2, and blocks of up to 5 rows for one, so that 8 independent sums keep the multiply-adds
 * busy; more rows widen each group of a tile once into L1, for group_times_rows. Against that L1 path, the blocks
 * took (AMD EPYC Zen 3, one 1536 x 1536 int4 weight from L3, one thread) 150 us for 3 rows instead of 189, 192
 * for 4 instead of 223, 263 for 5 instead of 276, and the default model's 120 int4 multiplies of a step 6.5 ms
 * for 4 rows instead of 7.9, 8.7 for 5 instead of 9.6; 16 rows were slower. Five rows in one block (10 sums, the
 * step's 4 widened registers and a row's pair: 15 of AVX2's 16) verify a 4-token draft in one pass over the
 * weights instead of a block of 4 and one of 1: the LM head at 5 rows 1.73 -> 1.29 times its time at 4, and
 * speculation on the same Zen 3 3-4% faster, engine alone. */
#define TILE_BLOCK 4 /* tiles multiplied at once by one row */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WIDE_STEPS          /* a step's 16 outputs in one 512-bit register: few_rows below */
#define ROWS_IN_REGISTERS 8 /* rows multiplied at once by steps widened in registers */
#else
#define ROWS_IN_REGISTERS 5
#endif
#define REGISTER_ROWS_MAX 8
static inline int64_t tiles_per_task(int64_t rows) { return rows == 1 ? TILE_BLOCK : rows == 2 ? TILE_BLOCK / 2 : 1; }
typedef int16_group tile_input;
static inline int64_t inputs_per_row(int64_t k) { return groups_of(k); }
static const tile_input *tile_inputs(const float *x, int64_t rows, int64_t k, int threads) {
    return quantize_rows(x, rows, k, threads);
}

/* a chunk of int4 codes as 16-bit integers, per 32-bit lane one output's two: its low nibbles and its high ones,
 * each as outputs 0-7 ([0]) and 8-15 ([1]); every byte is widened once */
static inline void unpack_chunk(const uint8_t *codes, __m256i low[2], __m256i high[2]) {
    const __m256i nibble = _mm256_set1_epi16(0x000f);
    for (int v = 0; v < 2; v++) {
        __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16 * v)));
        low[v] = _mm256_and_si256(words, nibble);
        high[v] = _mm256_srli_epi16(words, 4); /* nothing lies above a byte's high nibble */
    }
}

/* a run of int8 codes (one input pair) as 16-bit integers: outputs 0-7 ([0]) and 8-15 ([1]) */
static inline void unpack_int8_pair(const uint8_t *run, __m256i w[2]) {
    for (int v = 0; v < 2; v++) w[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(run + 16 * v)));
}

/* step s of a tile's group: pairs s (a) and s + 8 (b) as 16-bit integers */
static inline __attribute__((always_inline)) void unpack_step(const uint8_t *group, const int bits, const int s,
                                                              __m256i a[2], __m256i b[2]) {
    if (bits == 4) {
        unpack_chunk(group + s * 32, a, b);
    } else {
        unpack_int8_pair(group + s * 32, a);
        unpack_int8_pair(group + (s + 8) * 32, b);
    }
}

/* fetch group g of a weight's tiles ahead of its use: each tile is a stream of its own, and a stream's first
 * groups came too late for the hardware's prefetcher (2 groups ahead: one and two rows 3-6% faster over 30
 * layers from memory, 16 rows 6-11%) */
static inline void prefetch_group(const int bits, const uint8_t *codes, const f16 *scale, const f16 *low, int64_t g) {
    for (int line = 0; line < GROUP_BYTES(bits); line += 64) __builtin_prefetch(codes + g * GROUP_BYTES(bits) + line);
    __builtin_prefetch(scale + g * TILE);
    if (low) __builtin_prefetch(low + g * TILE);
}

/* A step's widened codes for one input pair (16 outputs, two codes each), and a row's 16 sums, in STEP_PARTS
 * registers. With AVX-512 VNNI, one 512-bit register (lane i: output i, as the layout lays them): one vpdpwssd per
 * row and pair where 256-bit halves take two, and half the widening, and 32 registers hold 8 rows' sums, so a
 * draft's rows up to 8 take one pass over the weight. Elsewhere, two 256-bit halves. The sums are the same
 * integers, scaled and added in the same order either way. */
#ifdef WIDE_STEPS
#define STEP_PARTS 1
typedef __m512i step_part;

static inline __attribute__((always_inline)) void unpack_codes(const uint8_t *group, const int bits, const int s,
                                                               __m512i a[1], __m512i b[1]) {
    if (bits == 4) {
        __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(group + s * 32)));
        a[0] = _mm512_and_si512(words, _mm512_set1_epi16(0x000f));
        b[0] = _mm512_srli_epi16(words, 4); /* nothing lies above a byte's high nibble */
    } else {
        a[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(group + s * 32)));
        b[0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(group + (s + 8) * 32)));
    }
}

static inline __m512i zero_part(void) { return _mm512_setzero_si512(); }

static inline void madd_codes(__m512i acc[1], const __m512i w[1], const int16_t *pair) {
    int32_t both;
    memcpy(&both, pair, 4);
    acc[0] = _mm512_dpwssd_epi32(acc[0], w[0], _mm512_set1_epi32(both));
}

/* add_group's arithmetic, 16 lanes at once */
static inline __attribute__((always_inline)) void add_sums(__m512i acc[][1], const int rows, const float *scale,
                                                           const float *low, const int16_group *x,
                                                           const float *group_sums, int64_t groups, float *sums) {
    __m512 s = _mm512_loadu_ps(scale);
    for (int r = 0; r < rows; r++) {
        __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(s, _mm512_set1_ps(x[r * groups].scale)));
        if (low) dot = _mm512_fmadd_ps(_mm512_loadu_ps(low), _mm512_set1_ps(group_sums[r * groups]), dot);
        _mm512_storeu_ps(sums + r * TILE, _mm512_add_ps(_mm512_loadu_ps(sums + r * TILE), dot));
    }
}
#else
#define STEP_PARTS 2
typedef __m256i step_part;
#define unpack_codes unpack_step
#define madd_codes madd_pair
#define add_sums add_group

static inline __m256i zero_part(void) { return _mm256_setzero_si256(); }
#endif

/* sums [tiles][rows, 16] for up to ROWS_IN_REGISTERS rows (up to TILE_BLOCK tiles for one row, 2 for two, else
 * one), steps widened in registers. Inlined with constant counts. */
static inline __attribute__((always_inline)) void few_rows(const tile_input *x, const int rows, const int tiles,
                                                           const int bits, const uint8_t *codes, const f16 *scale,
                                                           const f16 *low, const float *group_sums, float *sums,
                                                           int64_t k) {
    int64_t groups = k / GROUP;
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < tiles; j++) prefetch_group(bits, codes, scale, low, j * groups + g + 2);
        step_part acc[TILE_BLOCK][ROWS_IN_REGISTERS][STEP_PARTS];
        for (int j = 0; j < tiles; j++)
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < STEP_PARTS; v++) acc[j][r][v] = zero_part();
        /* a step's two pairs right after each other: fewer registers live than pair by pair over the tiles,
         * which spilled the sums (one row from L3 0.42 -> 0.33 ms, over 30 layers from memory 10-16% faster) */
        for (int c = 0; c < 8; c++)
            for (int j = 0; j < tiles; j++) {
                step_part a[STEP_PARTS], b[STEP_PARTS];
                unpack_codes(codes + (j * groups + g) * GROUP_BYTES(bits), bits, c, a, b);
                for (int r = 0; r < rows; r++) madd_codes(acc[j][r], a, x[r * groups + g].q + 2 * c);
                for (int r = 0; r < rows; r++) madd_codes(acc[j][r], b, x[r * groups + g].q + 2 * (c + 8));
            }
        for (int j = 0; j < tiles; j++) {
            float group_scale[TILE], group_low[TILE];
            group_scale_low(scale, low, (j * groups + g) * TILE, group_scale, group_low);
            add_sums(acc[j], rows, group_scale, low ? group_low : NULL, x + g, low ? group_sums + g : NULL, groups,
                     sums + j * rows * TILE);
        }
    }
}

typedef void (*few_rows_fn)(const tile_input *, const uint8_t *, const f16 *, const f16 *, const float *, float *,
                            int64_t);
#define FEW_ROWS(B, R, T)                                                                                          \
    static void few_rows_##B##_##R##x##T(const tile_input *x, const uint8_t *codes, const f16 *scale,              \
                                         const f16 *low, const float *group_sums, float *sums, int64_t k) {        \
        few_rows(x, R, T, B, codes, scale, low, group_sums, sums, k);                                              \
    }
#ifdef WIDE_STEPS
#define MORE_ROWS(B) FEW_ROWS(B, 6, 1) FEW_ROWS(B, 7, 1) FEW_ROWS(B, 8, 1)
#define MORE_ROWS_OF(B) , {NULL, few_rows_##B##_6x1}, {NULL, few_rows_##B##_7x1}, {NULL, few_rows_##B##_8x1}
#else
#define MORE_ROWS(B)
#define MORE_ROWS_OF(B)
#endif
#define FEW_ROWS_OF(B)                                                                                             \
    FEW_ROWS(B, 1, 1) FEW_ROWS(B, 1, 2) FEW_ROWS(B, 1, 3) FEW_ROWS(B, 1, 4) FEW_ROWS(B, 2, 1) FEW_ROWS(B, 2, 2)        \
    FEW_ROWS(B, 3, 1) FEW_ROWS(B, 4, 1) FEW_ROWS(B, 5, 1) MORE_ROWS(B)
FEW_ROWS_OF(4) FEW_ROWS_OF(8)
#define FEW_ROWS_TABLE(B)                                                                                          \
    {{NULL}, {NULL, few_rows_##B##_1x1, few_rows_##B##_1x2, few_rows_##B##_1x3, few_rows_##B##_1x4},                 \
     {NULL, few_rows_##B##_2x1, few_rows_##B##_2x2}, {NULL, few_rows_##B##_3x1}, {NULL, few_rows_##B##_4x1},           \
     {NULL, few_rows_##B##_5x1} MORE_ROWS_OF(B)}
static const few_rows_fn by_bits_rows_and_tiles[2][ROWS_IN_REGISTERS + 1][TILE_BLOCK + 1] = {FEW_ROWS_TABLE(4),
                                                                                             FEW_ROWS_TABLE(8)};

/* sums [tiles][rows, 16]: up to TILE_BLOCK tiles (one or two rows) or one tile (more rows) of the weight, for
 * every row */
static void tiles_rows(const int bits, const tile_input *x, int64_t rows, int64_t tiles, const uint8_t *codes,
                       const f16 *scale, const f16 *low, const float *group_sums, float *sums, int64_t k) {
    memset(sums, 0, tiles * rows * TILE * sizeof(float));
    int64_t groups = k / GROUP;
    if (rows <= REGISTER_ROWS_MAX) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_IN_REGISTERS) {
            int64_t block = rows - r0 < ROWS_IN_REGISTERS ? rows - r0 : ROWS_IN_REGISTERS;
            by_bits_rows_and_tiles[bits == 8][block][tiles](x + r0 * groups, codes, scale, low,
                                                           low ? group_sums + r0 * groups : NULL, sums + r0 * TILE, k);
        }
        return;
    }
    __m256i w[GROUP / 2][2]; /* step c's pairs are c and c + 8 */
    for (int64_t g = 0; g < groups; g++) {
        float group_scale[TILE], group_low[TILE];
        prefetch_group(bits, codes, scale, low, g + 2);
        for (int c = 0; c < 8; c++) unpack_step(codes + g * GROUP_BYTES(bits), bits, c, w[c], w[c + 8]);
        group_scale_low(scale, low, g * TILE, group_scale, group_low);
        group_times_rows((const __m256i(*)[2])w, x + g, rows, group_scale, low ? group_low : NULL,
                         low ? group_sums + g : NULL, groups, sums);
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* --- 8-bit activations (WSGI_INFER_ACTIVATIONS=int8) ----------------------------------------------------------
 * llama.cpp's trade: each row's group of 32 inputs as 8-bit integers, q = round(x * 127 / max|x|), scale
 * max|x| / 127. vpdpbusd (AVX-512 VNNI) multiplies 4 unsigned codes by 4 signed inputs and adds them per 32-bit
 * lane: twice vpdpwssd's products per instruction; AVX2 gets there with vpmaddubsw and vpmaddwd. Each input is then
 * off by up to 1/254 of its group's largest, not 2^-16: not exact, so never the default. A group's sum is still an
 * exact integer, scaled and added in group order, so a row's result never depends on its batch, nor on the path.
 * Step c of a tile's group multiplies its 16 outputs by 4 inputs, 2c, 2c + 1, 2c + 16 and 2c + 17 (a chunk's low
 * and high nibbles, or int8 runs c and c + 8); a row's group keeps its codes in that order. */
typedef struct {
    int8_t q[GROUP]; /* step c's four inputs at 4c; zeros past a row's last input */
    float scale;     /* max|x| / 127 (NaN where an input is: its outputs are NaN) */
    int32_t sum;     /* of q: int8 weights multiply as unsigned, code + 128, with VNNI */
} int8_group;

static void quantize_group8(const float *x, int64_t count, void *out) {
    int8_group *group = out;
    __m256 v[4];
    uint32_t top = load_group(x, count, v);
    float amax;
    memcpy(&amax, &top, 4);
    memset(group, 0, sizeof(*group));
    if (top >= 0x7f800000u || amax < 1e-30f) { /* an infinity or NaN, or nothing measurable: zeros */
        group->scale = top >= 0x7f800000u ? NAN : 0.0f;
        return;
    }
    /* rounded to nearest (at most 127 in magnitude), packed to bytes (in-lane: inputs 0-3, 8-11, 16-19, 24-27 |
     * 4-7, 12-15, 20-23, 28-31), their 4-byte units moved so each lane holds its steps' inputs, then each step's
     * four put side by side: 2c, 2c + 1, 2c + 16, 2c + 17 */
    const __m256 factor = _mm256_set1_ps(127.0f / amax);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], factor));
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7));
    const __m256i steps = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10,
                                           11, 4, 5, 12, 13, 6, 7, 14, 15);
    _mm256_storeu_si256((__m256i *)group->q, _mm256_shuffle_epi8(bytes, steps));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    half = _mm_add_epi32(half, _mm_srli_si128(half, 8));
    group->sum = _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_srli_si128(half, 4)));
    group->scale = amax / 127.0f;
}

static int8_group *quantize_rows8(const float *x, int64_t rows, int64_t k, int threads) {
    return quantize_rows_with(quantize_group8, sizeof(int8_group), x, rows, k, threads);
}

/* 8-bit groups as 16-bit ones (inputs back in their order, the same scale), for the paths of few rows: a group's
 * integer sum is the same either way, and so is its scaling (add_sums and rows8 do the same operations), so a
 * row's result is too, and one or two rows keep those paths' speed (vpermw-free; 1 row of a 16384 x 2048 int4
 * weight 0.85 ms through rows8, 0.55 ms so, AMD EPYC Zen 4). */
static int16_group *widen_rows8(const int8_group *eight, int64_t count) {
    int16_group *out = malloc(count * sizeof(int16_group));
    for (int64_t i = 0; i < count; i++) {
        for (int c = 0; c < 8; c++) {
            const int8_t *step = eight[i].q + 4 * c;
            out[i].q[2 * c] = step[0], out[i].q[2 * c + 1] = step[1];
            out[i].q[2 * c + 16] = step[2], out[i].q[2 * c + 17] = step[3];
        }
        out[i].scale = eight[i].scale;
    }
    return out;
}

/* a step's 16 outputs' codes (lo: inputs 2c and 2c + 1; hi: 2c + 16 and 2c + 17, as 16-bit pairs per output) */
static inline __attribute__((always_inline)) void step_halves(const uint8_t *group, const int bits, const int c,
                                                              __m256i *lo, __m256i *hi) {
    if (bits == 4) {
        const __m256i nibble = _mm256_set1_epi8(0x0f);
        __m256i b = _mm256_loadu_si256((const __m256i *)(group + 32 * c));
        *lo = _mm256_and_si256(b, nibble);
        *hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
    } else {
        *lo = _mm256_loadu_si256((const __m256i *)(group + 32 * c));
        *hi = _mm256_loadu_si256((const __m256i *)(group + 32 * (c + 8)));
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ACT8_ROWS 8 /* rows whose sums (one register each) a group's 8 steps fill at once */
typedef __m512i act8_step; /* lane o: output o's 4 codes, unsigned (int8 codes + 128) */

static inline __attribute__((always_inline)) void unpack_step8(const uint8_t *group, const int bits, const int c,
                                                               act8_step *step) {
    __m256i lo, hi;
    step_halves(group, bits, c, &lo, &hi);
    if (bits == 8) {
        lo = _mm256_xor_si256(lo, _mm256_set1_epi8((char)0x80));
        hi = _mm256_xor_si256(hi, _mm256_set1_epi8((char)0x80));
    }
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0); /* word 2o: lo's o, 2o + 1: hi's */
    *step = _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

/* sums [rows, 16] += a group's products for up to ACT8_ROWS rows (x: the first row's group, rows apart by groups) */
static inline __attribute__((always_inline)) void rows8(const act8_step w[8], const int8_group *x, const int rows,
                                                        const int bits, const float *scale, const float *low,
                                                        const float *group_sums, int64_t groups, float *sums) {
    __m512i acc[ACT8_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++)
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, x[r * groups].q + 4 * c, 4);
            acc[r] = _mm512_dpbusd_epi32(acc[r], w[c], _mm512_set1_epi32(four));
        }
    __m512 s = _mm512_loadu_ps(scale);
    for (int r = 0; r < rows; r++) {
        if (bits == 8) acc[r] = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * x[r * groups].sum));
        __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(s, _mm512_set1_ps(x[r * groups].scale)));
        if (low) dot = _mm512_fmadd_ps(_mm512_loadu_ps(low), _mm512_set1_ps(group_sums[r * groups]), dot);
        _mm512_storeu_ps(sums + r * TILE, _mm512_add_ps(_mm512_loadu_ps(sums + r * TILE), dot));
    }
}
#else
#define ACT8_ROWS 4
typedef struct {
    __m256i w[2];    /* outputs 0-7 and 8-15, each lane one output's 4 codes: int4 as they are, int8's magnitudes */
    __m256i sign[2]; /* int8 codes themselves, whose signs the inputs take (vpmaddubsw multiplies unsigned codes) */
} act8_step;

static inline __attribute__((always_inline)) void unpack_step8(const uint8_t *group, const int bits, const int c,
                                                               act8_step *step) {
    __m256i lo, hi;
    step_halves(group, bits, c, &lo, &hi);
    __m256i a = _mm256_unpacklo_epi16(lo, hi), b = _mm256_unpackhi_epi16(lo, hi); /* outputs 0-3 | 8-11, 4-7 | 12-15 */
    step->sign[0] = _mm256_permute2x128_si256(a, b, 0x20);
    step->sign[1] = _mm256_permute2x128_si256(a, b, 0x31);
    for (int v = 0; v < 2; v++) step->w[v] = bits == 8 ? _mm256_abs_epi8(step->sign[v]) : step->sign[v];
}

/* rows8 of the VNNI path, in two 256-bit halves. A pair's products stay within 16 bits: 2 * 128 * 127. */
static inline __attribute__((always_inline)) void rows8(const act8_step w[8], const int8_group *x, const int rows,
                                                        const int bits, const float *scale, const float *low,
                                                        const float *group_sums, int64_t groups, float *sums) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[ACT8_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++)
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, x[r * groups].q + 4 * c, 4);
            __m256i in = _mm256_set1_epi32(four);
            for (int v = 0; v < 2; v++) {
                __m256i signed_in = bits == 8 ? _mm256_sign_epi8(in, w[c].sign[v]) : in;
                __m256i pairs = _mm256_maddubs_epi16(w[c].w[v], signed_in);
                acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
            }
        }
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < rows; r++)
            add_half(acc[r][v], v, scale, low, x[r * groups].scale, low ? group_sums[r * groups] : 0.0f, sums + r * TILE);
}
#endif

typedef void (*rows8_fn)(const act8_step *, const int8_group *, const float *, const float *, const float *, int64_t,
                         float *);
#define ROWS8_OF(B, R)                                                                                             \
    static void rows8_##B##_##R(const act8_step *w, const int8_group *x, const float *scale, const float *low,      \
                                const float *group_sums, int64_t groups, float *sums) {                            \
        rows8(w, x, R, B, scale, low, group_sums, groups, sums);                                                   \
    }
#define ROWS8_FOR(B) ROWS8_OF(B, 1) ROWS8_OF(B, 2) ROWS8_OF(B, 3) ROWS8_OF(B, 4) ROWS8_MORE(B)
#if ACT8_ROWS == 8
#define ROWS8_MORE(B) ROWS8_OF(B, 5) ROWS8_OF(B, 6) ROWS8_OF(B, 7) ROWS8_OF(B, 8)
#define ROWS8_MORE_OF(B) , rows8_##B##_5, rows8_##B##_6, rows8_##B##_7, rows8_##B##_8
#else
#define ROWS8_MORE(B)
#define ROWS8_MORE_OF(B)
#endif
ROWS8_FOR(4) ROWS8_FOR(8)
static const rows8_fn rows8_by_bits[2][ACT8_ROWS + 1] = {
    {NULL, rows8_4_1, rows8_4_2, rows8_4_3, rows8_4_4 ROWS8_MORE_OF(4)},
    {NULL, rows8_8_1, rows8_8_2, rows8_8_3, rows8_8_4 ROWS8_MORE_OF(8)}};

/* tiles_rows with 8-bit activations: each group of a tile unpacked once, then every row, ACT8_ROWS at a time */
static void tiles_rows8(const int bits, const int8_group *x, int64_t rows, int64_t tiles, const uint8_t *codes,
                        const f16 *scale, const f16 *low, const float *group_sums, float *sums, int64_t k) {
    memset(sums, 0, tiles * rows * TILE * sizeof(float));
    int64_t groups = k / GROUP;
    for (int64_t j = 0; j < tiles; j++)
        for (int64_t g = 0; g < groups; g++) {
            int64_t at = j * groups + g;
            prefetch_group(bits, codes, scale, low, at + 2);
            act8_step w[8];
            for (int c = 0; c < 8; c++) unpack_step8(codes + at * GROUP_BYTES(bits), bits, c, &w[c]);
            float group_scale[TILE], group_low[TILE];
            group_scale_low(scale, low, at * TILE, group_scale, group_low);
            for (int64_t r0 = 0; r0 < rows; r0 += ACT8_ROWS) {
                int64_t block = rows - r0 < ACT8_ROWS ? rows - r0 : ACT8_ROWS;
                rows8_by_bits[bits == 8][block](w, x + r0 * groups + g, group_scale, low ? group_low : NULL,
                                                low ? group_sums + r0 * groups + g : NULL, groups,
                                                sums + (j * rows + r0) * TILE);
            }
        }
}
#endif

#define ROW_CHUNK 64 /* rows whose inputs the tiles read over and over, while they stay in cache */

/* A packed multiply's operands, and the rows [r0, r0 + chunk) whose tiles its tasks compute */
typedef struct {
    int bits, act8;     /* act8: the inputs are 8-bit groups (int8_group), else tile_inputs' */
    const void *inputs;
    const uint8_t *codes;
    const f16 *scale, *low;
    const float *group_sums;
    float *out;
    int64_t n, k, groups, tiles, per_task, r0, chunk;
} packed_job;

/* the task of tiles [t0, t0 + per_task): its sums, then their outputs */
static void tile_task(const packed_job *job, int64_t t0) {
    float sums[TILE_BLOCK * ROW_CHUNK * TILE];
    int64_t tiles = job->tiles - t0 < job->per_task ? job->tiles - t0 : job->per_task, groups = job->groups;
    int64_t r0 = job->r0, chunk = job->chunk, n = job->n, task_groups = t0 * groups;
    const uint8_t *codes = job->codes + task_groups * GROUP_BYTES(job->bits);
    const f16 *scale = job->scale + task_groups * TILE, *low = job->low ? job->low + task_groups * TILE : NULL;
    const float *group_sums = job->low ? job->group_sums + r0 * groups : NULL;
#if defined(__AVX2__) && defined(__FMA__)
    if (job->act8) {
        const int8_group *x = (const int8_group *)job->inputs + r0 * groups_of(job->k);
        tiles_rows8(job->bits, x, chunk, tiles, codes, scale, low, group_sums, sums, job->k);
    } else
#endif
        tiles_rows(job->bits, (const tile_input *)job->inputs + r0 * inputs_per_row(job->k), chunk, tiles, codes,
                   scale, low, group_sums, sums, job->k);
    for (int64_t t = t0; t < t0 + tiles; t++) {
        int64_t width = n - t * TILE < TILE ? n - t * TILE : TILE; /* a last, partial tile */
        const float *tile_sums = sums + (t - t0) * chunk * TILE;
        for (int64_t r = 0; r < chunk; r++)
            for (int64_t j = 0; j < width; j++) job->out[(r0 + r) * n + t * TILE + j] = tile_sums[r * TILE + j];
    }
}

/* out [rows, n] = x [rows, k] (contiguous) times the packed weight [n, k]^T; tiles of outputs spread over threads.
 * With few rows the weight streams from memory, and a thread reads best long runs (grabs of 4 tiles were 9-13%
 * slower at 2 and 4 rows, single tiles 10-35%), but equal halves ended 7 µs apart on average at one row (of 40 µs
 * a call): guided grabs, half of what is left and then less, keep the long runs and let the thread that ends first
 * take the rest (2-6% a token at one stream). With more rows the multiplies are the bound, and single tasks balance
 * best. */
static void packed_mm(const int bits, int act8, const float *x, int64_t rows, const uint8_t *codes, const f16 *scale,
                      const f16 *low, float *out, int64_t n, int64_t k, int threads) {
    int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE, per_task = tiles_per_task(rows);
    float *group_sums = low ? malloc(rows * groups * sizeof(float)) : NULL;
#if defined(__AVX2__) && defined(__FMA__)
    const void *inputs = act8 ? (const void *)quantize_rows8(x, rows, k, threads) : tile_inputs(x, rows, k, threads);
    if (act8 && rows <= REGISTER_ROWS_MAX) { /* widen_rows8 */
        int8_group *eight = (int8_group *)inputs;
        inputs = widen_rows8(eight, rows * groups_of(k));
        free(eight);
        act8 = 0;
    }
#else
    const void *inputs = tile_inputs(x, rows, k, threads);
    act8 = 0; /* see activations_of_8_bits */
#endif
    if (low) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
        for (int64_t i = 0; i < rows * groups; i++)
            group_sums[i] = hsum(load16f(x + i * GROUP) + load16f(x + i * GROUP + 16));
    }
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
        int64_t chunk = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
        packed_job job = {bits,   act8,  inputs, codes, scale, low,      group_sums,
                          out,    n,     k,      groups, tiles, per_task, r0, chunk};
        if (chunk > 8) {
#pragma omp parallel for schedule(dynamic) num_threads(threads)
            for (int64_t t0 = 0; t0 < tiles; t0 += per_task) tile_task(&job, t0);
        } else {
#pragma omp parallel for schedule(guided) num_threads(threads)
            for (int64_t t0 = 0; t0 < tiles; t0 += per_task) tile_task(&job, t0);
        }
    }
    free(group_sums);
    if (inputs != (const void *)x) free((void *)inputs);
}

/* The most rows a packed multiply computes in one pass over its weight: a step that verifies a draft of one token
 * less costs little more than reading the weights, where one more row would read them again. */
int packed_rows_per_pass(void) {
#if !defined(__AVX2__) || !defined(__FMA__)
    return ROW_TILE;
#else
    return ROWS_IN_REGISTERS;
#endif
}

/* Whether act8 takes 8-bit activations here: with AVX2; elsewhere the rows stay float32 */
int activations_of_8_bits(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

void int4_mm(const float *x, int64_t rows, const uint8_t *codes, const f16 *scale, const f16 *low, float *out,
             int64_t n, int64_t k, int act8, int threads) {
    packed_mm(4, act8, x, rows, codes, scale, low, out, n, k, threads);
}

void int8_mm(const float *x, int64_t rows, const uint8_t *codes, const f16 *scale, const f16 *low, float *out,
             int64_t n, int64_t k, int act8, int threads) {
    packed_mm(8, act8, x, rows, codes, scale, low, out, n, k, threads);
}

/* --- a step's layers, one call ------------------------------------------------------------------------
 * For steps whose every projection is packed on the kernels (decodes, and prefill chunks up to as many rows): the
 * Llama layer (llama.py), or Gemma's (gemma3.py: norms of each block's output, GeGLU, RoPE per kind), op for op, each through the kernel its torch path calls, so a row's result is the same
 * whichever path its step took. What is left of a step in Python is the embedding, the final norm and the LM
 * head. */
typedef struct {
    const uint8_t *codes;
    const f16 *scale, *low; /* low: NULL where an int8 weight has no offsets */
    const float *bias;      /* or NULL */
    int64_t n, k;
    int64_t bits; /* 4 or 8 */
    int64_t act8; /* 8-bit activations (packed_mm) */
} PackedWeight;

typedef struct {
    const float *input_norm, *post_attention_norm;
    const float *q_norm, *k_norm; /* per-head norms of queries and keys (Qwen3), or NULL */
    int64_t rope;                 /* 0: a layer without positions (SmolLM3's NoPE layers) */
    int64_t window;               /* a sliding window's tokens, or 0: the whole context */
    int64_t local_rope;           /* 1: the second RoPE tables (Gemma's sliding-window layers' own base) */
    int64_t gelu;                 /* 1: GeGLU (Gemma), 0: SwiGLU */
    const float *attention_out_norm, *mlp_out_norm; /* Gemma's norms of each block's output, or NULL */
    PackedWeight qkv, o, gate_up, down;
} DecoderLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, intermediate, block_size;
    float eps, scale;
    int threads;
} DecoderShape;

/* out = x w^T (+ bias) */
static void project(const float *x, int64_t rows, const PackedWeight *w, float *out, int threads) {
    packed_mm((int)w->bits, (int)w->act8, x, rows, w->codes, w->scale, w->low, out, w->n, w->k, threads);
    if (w->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < w->n; i++) out[r * w->n + i] += w->bias[i];
}

/* kv_caches: a layer's [slots, 2 * kv_heads, head_dim] each, bf16. x: [rows, hidden], the embeddings in, the
 * last layer's output out; residual: [rows, hidden], the running sum before that output (the final norm adds
 * them). cos_sin: cos, sin, then a second pair for layers with local_rope, each [rows, rotary dims]; slots: [rows]
 * where each row's key and value go; block_table, seqs, max_blocks, row_seqs, context_lens: as paged_attention reads
 * them. window_slots, window_block_table, window_max_blocks: the same for sliding-window layers where they keep
 * blocks of their own (kv_cache_manager.py), or NULL. stop: read before each layer; once set, the remaining layers
 * are skipped (the caller then discards the step). */
void decoder_layers(const DecoderLayer *layers, int64_t num_layers, const DecoderShape *shape, bf16 *const *kv_caches,
                    float *x, float *residual, const float *const *cos_sin, const int64_t *slots,
                    const int64_t *block_table, int64_t seqs, int64_t max_blocks, const int64_t *row_seqs,
                    const int64_t *context_lens, const int64_t *window_slots, const int64_t *window_block_table,
                    int64_t window_max_blocks, int64_t rows, const volatile int *stop) {
    int64_t hidden = shape->hidden, head_dim = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads;
    int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, kv_width = 2 * kv_heads * head_dim;
    float *h = malloc(rows * hidden * sizeof(float)), *attn = malloc(rows * heads * head_dim * sizeof(float));
    float *qkv = malloc(rows * qkv_width * sizeof(float));
    float *gate_up = malloc(rows * 2 * shape->intermediate * sizeof(float));
    float *act = malloc(rows * shape->intermediate * sizeof(float));
    memcpy(residual, x, rows * hidden * sizeof(float)); /* the first norm adds nothing to the embeddings */
    for (int64_t l = 0; l < num_layers && !*stop; l++) { /* stop: set by another thread (step_interrupt.py) */
        const DecoderLayer *layer = layers + l;
        rms_norm(x, l == 0 ? NULL : residual, layer->input_norm, h, rows, hidden, shape->eps, shape->threads);
        project(h, rows, &layer->qkv, qkv, shape->threads);
        if (layer->q_norm)
            head_norm(qkv, qkv_width, layer->q_norm, layer->k_norm, rows, heads, kv_heads, head_dim, shape->eps,
                      shape->threads);
        const float *cos = cos_sin[2 * layer->local_rope], *sin = cos_sin[2 * layer->local_rope + 1];
        if (layer->rope)
            rotate(qkv, qkv_width, cos, sin, rows, heads + kv_heads, head_dim, shape->rotary_dim, shape->threads);
        int own = layer->window && window_block_table;
        const int64_t *layer_slots = own ? window_slots : slots, *table = own ? window_block_table : block_table;
        for (int64_t r = 0; r < rows; r++)
            store_bf16(kv_caches[l] + layer_slots[r] * kv_width, qkv + r * qkv_width + heads * head_dim, kv_width);
        paged_attention(qkv, qkv_width, kv_caches[l], table, seqs, own ? window_max_blocks : max_blocks, row_seqs,
                        context_lens, shape->block_size, attn, rows, heads, kv_heads, head_dim, shape->scale,
                        layer->window, shape->threads);
        project(attn, rows, &layer->o, x, shape->threads);
        if (layer->attention_out_norm)
            rms_norm(x, NULL, layer->attention_out_norm, x, rows, hidden, shape->eps, shape->threads);
        rms_norm(x, residual, layer->post_attention_norm, h, rows, hidden, shape->eps, shape->threads);
        project(h, rows, &layer->gate_up, gate_up, shape->threads);
        gated_mul(gate_up, act, rows, shape->intermediate, (int)layer->gelu, shape->threads);
        project(act, rows, &layer->down, x, shape->threads);
        if (layer->mlp_out_norm) rms_norm(x, NULL, layer->mlp_out_norm, x, rows, hidden, shape->eps, shape->threads);
    }
    free(h), free(attn), free(qkv), free(gate_up), free(act);
}

/* --- the sampler's rows ------------------------------------------------------------------------------------ */

/* Each row's index of its largest value, the first where several are equal, as torch.argmax gives it (a NaN
 * counts as the largest). One pass keeps, per lane, the largest value and where it came first. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int threads) {
    i32v lanes;
    for (int j = 0; j < LANES; j++) lanes[j] = j;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        f32v top = {0};
        i32v at = lanes, nan = {0};
        int64_t i = 0, found = 0;
        for (int j = 0; j < LANES; j++) top[j] = -INFINITY;
        for (; i + LANES <= n; i += LANES) {
            f32v v;
            memcpy(&v, row + i, sizeof(v));
            i32v larger = v > top;
            top = select_v(larger, v, top);
            at = (at & ~larger) | ((lanes + (int32_t)i) & larger);
            nan |= v != v;
        }
        float best = -INFINITY;
        for (int j = 0; j < LANES; j++) /* the lanes' maxima; the earliest index among equals */
            if (top[j] > best || (top[j] == best && at[j] < found)) best = top[j], found = at[j];
        for (int j = 0; j < LANES; j++) nan[0] |= nan[j];
        for (int64_t j = nan[0] ? 0 : i; j < n; j++) { /* the tail, or the first NaN */
            if (row[j] != row[j]) { found = j; break; }
            if (row[j] > best) best = row[j], found = j;
        }
        out[r] = found;
    }
}

/* --- int4 weights back to bf16 ------------------------------------------------------------------------------
 * The weight [n, k] as bf16, q * scale + low rounded to nearest even (the values a GGUF's Q4_1 blocks hold, as
 * gguf-py computes them, then rounded as torch rounds): for steps too large for int4_mm to win, one weight at a
 * time, so that no bf16 copy of the model stays in memory. */

/* 16 codes (lane j: output j / 2, one of two adjacent inputs) -> their values' bf16 bits, as 8 pairs */
static inline u16x16 dequantize_pairs(u16x16 q, f32x16 scale, f32x16 low) {
    f32x16 value = __builtin_convertvector(q, f32x16) * scale + low;
    u32x16 bits = (u32x16)value; /* finite: no NaN case */
    return __builtin_convertvector((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, u16x16);
}

/* chunk c of a group: 32 words (byte j: output j / 2, inputs 2c + j % 2) in two halves of 8 outputs each; the
 * nibble picks inputs 2c or 2(c + 8) (``column``). Each output's pair of values is one 4-byte store. */
static inline void store_pairs(u16x32 q, const f32x16 scale[2], const f32x16 low[2], bf16 *rows, int64_t k,
                               int64_t width, int64_t column) {
    u16x16 half[2];
    memcpy(half, &q, sizeof(half));
    for (int h = 0; h < 2; h++) {
        u16x16 pairs = dequantize_pairs(half[h], scale[h], low[h]);
        for (int64_t o = 0; o < 8 && 8 * h + o < width; o++)
            memcpy(rows + (8 * h + o) * k + column, (uint32_t *)&pairs + o, 4);
    }
}

void int4_dequantize(const uint8_t *codes, const f16 *scale, const f16 *low, bf16 *out, int64_t n, int64_t k,
                     int threads) {
    int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t width = n - t * TILE < TILE ? n - t * TILE : TILE;
        for (int64_t g = 0; g < groups; g++) {
            float s[TILE], l[TILE];
            group_scale_low(scale, low, (t * groups + g) * TILE, s, l);
            f32x16 pair_scale[2], pair_low[2]; /* lane j of half h: output 8h + j / 2's */
            for (int j = 0; j < 16; j++)
                for (int h = 0; h < 2; h++) pair_scale[h][j] = s[8 * h + j / 2], pair_low[h][j] = l[8 * h + j / 2];
            for (int c = 0; c < 8; c++) {
                u16x32 wide = widen_codes(codes + ((t * groups + g) * 8 + c) * 32);
                bf16 *rows = out + t * TILE * k + g * GROUP;
                store_pairs(wide & 15, pair_scale, pair_low, rows, k, width, 2 * c);
                store_pairs(wide >> 4, pair_scale, pair_low, rows, k, width, 2 * (c + 8));
            }
        }
    }
}

/* The int8 weight [n, k] in the kernels' layout as bf16: q * scale + low, two roundings as Int8Groups.dequantize
 * makes them in torch, then rounded to nearest even. */
void int8_dequantize(const int8_t *codes, const f16 *scale, const f16 *low, bf16 *out, int64_t n, int64_t k,
                     int threads) {
    int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t width = n - t * TILE < TILE ? n - t * TILE : TILE;
        for (int64_t g = 0; g < groups; g++) {
            float s[TILE], l[TILE];
            group_scale_low(scale, low, (t * groups + g) * TILE, s, l);
            const int8_t *group = codes + (t * groups + g) * GROUP * TILE;
            for (int64_t o = 0; o < width; o++)
                for (int i = 0; i < GROUP; i++)
                    out[(t * TILE + o) * k + g * GROUP + i] = to_bf16(group[i / 2 * 2 * TILE + 2 * o + i % 2] * s[o] + l[o]);
        }
    }
}
