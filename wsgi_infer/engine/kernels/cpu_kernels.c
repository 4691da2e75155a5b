/* Fused bf16 kernels for a decode step on the CPU (built by build.py, called by cpu.py).
 *
 * Each replaces a chain of small torch ops whose dispatch, not arithmetic, dominated a one-stream step.
 * They round where the torch ops they replace round (bf16 at each op's output, float32 inside), and are
 * compiled with -ffp-contract=off so a*b+c stays two roundings, as in torch. Rows are independent: a row's
 * result never depends on the other rows of its batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline float to_float(bf16 x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline bf16 to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40);
    return (bf16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* 16 floats as one vector (GCC's vector extensions: AVX-512 where present, narrower registers elsewhere). */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

static inline f32x16 load16(const bf16 *p) {
    u16x16 half;
    memcpy(&half, p, sizeof(half));
    u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    f32x16 v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

static inline float hsum(f32x16 v) {
    v += __builtin_shuffle(v, (i32x16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (i32x16){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (i32x16){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
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

/* out = weight * bf16(rms_norm(float(x))): RMSNorm as transformers rounds it. With a residual, the sum
 * residual + x (rounded to bf16, as torch adds) is normalized, and kept in residual, in place. */
void rms_norm(const bf16 *x, bf16 *residual, const bf16 *weight, bf16 *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *row = x + r * dim;
        bf16 *dst = out + r * dim;
        if (residual) {
            bf16 *sum = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) sum[i] = to_bf16(to_float(sum[i]) + to_float(row[i]));
            row = sum;
        }
        f32x16 lanes = {0};
        float squares = 0.0f;
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) lanes += load16(row + i) * load16(row + i);
        for (; i < dim; i++) squares += to_float(row[i]) * to_float(row[i]);
        squares += hsum(lanes);
        float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) dst[i] = to_bf16(to_float(weight[i]) * to_float(to_bf16(to_float(row[i]) * inv)));
    }
}

/* out = bf16(silu(gate)) * up, from gate_up = [gate | up] per row. */
void silu_mul(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *gate = gate_up + r * 2 * width, *up = gate + width;
        for (int64_t i = 0; i < width; i++) {
            float g = to_float(gate[i]);
            float silu = to_float(to_bf16(g / (1.0f + exp_approx(-g))));
            out[r * width + i] = to_bf16(silu * to_float(up[i]));
        }
    }
}

/* Rotate heads [rows, heads, D] (row stride in elements) in place: x * cos + roll(x, D / 2) * sin with each
 * row's table rows [rows, D] (sin signed: see rotary.py), computed in float32, rounded once. */
void rotate(bf16 *x, int64_t row_stride, const float *cos_rows, const float *sin_rows, int64_t rows, int64_t heads,
            int64_t head_dim) {
    int64_t half = head_dim / 2;
    float rotated[head_dim];
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_rows + r * head_dim, *s = sin_rows + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            bf16 *v = x + r * row_stride + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                float a = to_float(v[d]) * c[d], b = to_float(v[(d + half) % head_dim]) * s[d];
                rotated[d] = a + b;
            }
            for (int64_t d = 0; d < head_dim; d++) v[d] = to_bf16(rotated[d]);
        }
    }
}

/* softmax(q k^T * scale) v for one query head over len cached tokens, in float32. The head's scores fit
 * on the stack (a float per token); keys and values are read once per query head, from cache after the
 * first head of a group. head_dim is a multiple of 16 (checked by cpu.py). */
static void attend_head(const bf16 *q, const bf16 *keys, const bf16 *values, const int64_t *offsets, int64_t len,
                        int64_t head_dim, float scale, bf16 *out) {
    int64_t chunks = head_dim / 16;
    f32x16 query[chunks];
    float scores[len], peak = -INFINITY, total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) query[c] = load16(q + c * 16) * scale;
    for (int64_t t = 0; t < len; t++) {
        const bf16 *key = keys + offsets[t];
        f32x16 sum = query[0] * load16(key);
        for (int64_t c = 1; c < chunks; c++) sum += query[c] * load16(key + c * 16);
        scores[t] = hsum(sum);
        peak = scores[t] > peak ? scores[t] : peak;
    }
    for (int64_t t = 0; t < len; t++) scores[t] = exp_approx(scores[t] - peak);
    for (int64_t t = 0; t < len; t++) total += scores[t];
    for (int64_t c = 0; c < chunks; c++) {
        f32x16 acc = {0};
        for (int64_t t = 0; t < len; t++) acc += scores[t] * load16(values + offsets[t] + c * 16);
        for (int j = 0; j < 16; j++) out[c * 16 + j] = to_bf16(acc[j] / total);
    }
}

/* One query token per sequence over its cached context (which already holds this token's key and value).
 * q: [rows, heads, D] with a row stride; cache: [slots, 2 * kv_heads, D]; block_table: [rows, max_blocks];
 * out: [rows, heads * D]. Query heads are independent tasks, spread over threads. */
void decode_attention(const bf16 *q, int64_t q_row_stride, const bf16 *cache, const int64_t *block_table,
                      int64_t max_blocks, const int64_t *context_lens, int64_t block_size, bf16 *out, int64_t rows,
                      int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int threads) {
    int64_t group = heads / kv_heads, slot_width = 2 * kv_heads * head_dim, total = 0;
    int64_t starts[rows];
    for (int64_t r = 0; r < rows; r++) {
        starts[r] = total;
        total += context_lens[r];
    }
    int64_t *offsets = malloc(total * sizeof(int64_t)); /* each token's slot, as an element offset */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < context_lens[r]; t++)
            offsets[starts[r] + t] = (block_table[r * max_blocks + t / block_size] * block_size + t % block_size) * slot_width;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++)
            attend_head(q + r * q_row_stride + h * head_dim, cache + (h / group) * head_dim,
                        cache + (kv_heads + h / group) * head_dim, offsets + starts[r], context_lens[r], head_dim, scale,
                        out + (r * heads + h) * head_dim);
    free(offsets);
}
