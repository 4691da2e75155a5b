/* A step's element-wise work: RMSNorm (with its residual add), per-head norms, gated activations, rotary
 * positions, and the sampler's argmax and grammar masks. */
#include "common.h"

/* out = weight * rms_norm(x) in float32, as transformers computes it (the sum of squares in another order). With
 * a residual, the sum residual + x is normalized, and kept in residual, in place. */
/* dst = weight * (row / rms(row)); dst may be row. */
static inline void norm_row(const float *row, const float *weight, float *dst, int64_t dim, float eps) {
    /* 16 lanes of sums, lane j of part[j / LANES] (one vector of 16 went through the stack on AVX2: half of the
     * norm's time), then summed as a tree: lanes j and j + 8, j and j + 4, j and j + 2, the last two */
    f32v part[16 / LANES] = {{0}};
    float squares = 0.0f, lane[16];
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16)
        for (int p = 0; p < 16 / LANES; p++) {
            f32v v;
            memcpy(&v, row + i + p * LANES, sizeof(v));
            part[p] += v * v;
        }
    for (; i < dim; i++) squares += row[i] * row[i];
    memcpy(lane, part, sizeof(lane));
    for (int half = 8; half >= 1; half /= 2)
        for (int j = 0; j < half; j++) lane[j] += lane[j + half];
    squares += lane[0];
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
void gated_mul(const float *gate_up, float *out, int64_t rows, int64_t width, int gelu, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        int64_t i = 0;
        /* what the loop below does, a register at a time: 16 lanes at a time on AVX2 went through the stack (exp
         * in two halves), each half written and read back whole: 2.8% of a prefill (1B Q4_K_M, Zen 4), now 1.0% */
        for (; i + LANES <= width; i += LANES) {
            f32v g, u;
            memcpy(&g, gate + i, sizeof(g));
            memcpy(&u, up + i, sizeof(u));
            f32v z = gelu ? 2.0f * (0.7978845608f * (g + 0.044715f * g * g * g)) : g;
            f32v product = g / (1.0f + exp_v(-z)) * u;
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

/* Grammar masks, in place: row rows[i] of x [.., n] keeps the tokens that bitmask row i allows (llguidance's words:
 * token t is bit t % 32 of word t / 32) and the others become -inf, as torch's masked_fill makes them. A constraint
 * allows few tokens, so most words are 0: 32 tokens barred at once. */
void mask_rows(float *x, int64_t n, const int64_t *rows, int64_t count, const uint32_t *bitmask, int threads) {
    const int64_t words = (n + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(threads) if (count > 1)
    for (int64_t i = 0; i < count; i++) {
        float *row = x + rows[i] * n;
        const uint32_t *bits = bitmask + i * words;
        for (int64_t w = 0; w < words; w++) {
            const uint32_t word = bits[w];
            const int64_t first = 32 * w, end = first + 32 < n ? first + 32 : n;
            if (word == 0xFFFFFFFFu) continue;
            if (word == 0) {
                for (int64_t t = first; t < end; t++) row[t] = -INFINITY;
                continue;
            }
            for (int64_t t = first; t < end; t++)
                if (!(word >> (t - first) & 1)) row[t] = -INFINITY;
        }
    }
}

/* Grammar masks filled, a row per call of llguidance's llg_matcher_compute_mask_into (fill), on the steps' own
 * threads: theirs wait spinning after a step, so a pool beside them shared their cores and gained nothing. Each
 * matcher is its own, so rows fill independently; status[i] is row i's call's result (0, or -1 where the
 * matcher is in error and the row unwritten). */
typedef int32_t (*mask_fill)(void *matcher, uint32_t *mask, size_t bytes);
void fill_masks(mask_fill fill, void *const *matchers, int64_t count, uint32_t *bitmask, int64_t words,
                int32_t *status, int threads) {
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (count > 1)
    for (int64_t i = 0; i < count; i++) status[i] = fill(matchers[i], bitmask + i * words, (size_t)words * 4);
}
