/* A sub-block's integer dot products, per ISA: a weight tile's decoded codes (quant_simd.h's registers, one row a
 * lane) times rows of 8-bit activations. vpdpbusd where VNNI has it; without, vpmaddubsw's 16-bit pairs, summed in
 * 16 bits as long as they fit before each widening (SUMS_IN_16_BITS), and Q8_0's and IQ4's codes signed
 * (SIGNED_CODES); elsewhere plain C. The sums are exact integers on every path.
 */
#ifndef WSGI_INFER_DOT_PRODUCTS_H
#define WSGI_INFER_DOT_PRODUCTS_H
#include "quant_simd.h"

/* A sub-block's products with one row's 32 activation codes q: per lane, the sum over quads 0-3 (inputs 0-15) in
 * *lo and over quads 4-7 in *hi, of the lane's 4 codes (w[i]: inputs 4i..4i+3) times q's: two chains of
 * multiply-adds (a 16-row step ran 1.2 times slower with one, AMD EPYC Zen 4). `codes`: CODES_4BIT, _5BIT and
 * _6BIT up to 15, 31 and 63; CODES_BYTES up to 255 (8-bit formats), which vpmaddubsw's 16-bit pairs cannot hold:
 * without VNNI those are split into nibbles; CODES_SIGNED, signed bytes (Q8_0's and IQ4's where SIGNED_CODES,
 * without VNNI, multiplied as llama.cpp's are: |w| times q with w's sign, a pair at most 2 * 128 * 127). Exact
 * integers. */
enum { CODES_4BIT, CODES_5BIT, CODES_6BIT, CODES_BYTES, CODES_SIGNED };
#if defined(__AVX512VNNI__) && QL == 16
/* acc + vpdpbusd(w, the 4 codes at q in every lane), the codes read by the instruction's own broadcast: GCC loads
 * them with a vpbroadcastd of its own first, an extra instruction per multiply-add */
ALWAYS_INLINE __m512i dpbusd_at(__m512i acc, __m512i w, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)q));
    return acc;
}

/* a zeroed register: vpxord, which needs no execution unit, where GCC copied one zero register into each */
ALWAYS_INLINE __m512i zero_512(void) {
    __m512i z;
    __asm__ volatile("vpxord %0, %0, %0" : "=v"(z)); /* volatile: or GCC made one and copied it */
    return z;
}

ALWAYS_INLINE void dot_sub(const wvec w[8], const int8_t *q, const int codes, ivec *lo, ivec *hi) {
    (void)codes;
    __m512i a = zero_512(), b = zero_512();
    for (int i = 0; i < 4; i++) a = dpbusd_at(a, (__m512i)w[i], q + 4 * i);
    for (int i = 4; i < 8; i++) b = dpbusd_at(b, (__m512i)w[i], q + 4 * i);
    *lo = (ivec)a, *hi = (ivec)b;
}
#elif defined(__AVXVNNI__) && QL == 8
ALWAYS_INLINE void dot_sub(const wvec w[8], const int8_t *q, const int codes, ivec *lo, ivec *hi) {
    (void)codes;
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) a = _mm256_dpbusd_avx_epi32(a, (__m256i)w[i], _mm256_set1_epi32(quad(q + 4 * i)));
    for (int i = 4; i < 8; i++) b = _mm256_dpbusd_avx_epi32(b, (__m256i)w[i], _mm256_set1_epi32(quad(q + 4 * i)));
    *lo = (ivec)a, *hi = (ivec)b;
}
#elif defined(__AVX2__)
/* vpmaddubsw: pairs of u8 x s8 products in 16 bits, each at most 2 * c * 127 for codes up to c, so that 16 bits
 * hold the sum of 8 (c = 15), 4 (31) or 2 (63) of them; then vpmaddwd by ones into 32 bits: the fewer of those, the
 * fewer multiplies (a 4-bit sub-block's 12 are 9: the multiply pipes are what an AVX2 prefill waits on) */
#if QL == 16
#define MADDUBS _mm512_maddubs_epi16
#define SET1_16 _mm512_set1_epi16
#define SET1_32 _mm512_set1_epi32
typedef __m512i mvec;
#else
#define MADDUBS _mm256_maddubs_epi16
#define SET1_16 _mm256_set1_epi16
#define SET1_32 _mm256_set1_epi32
typedef __m256i mvec;
#endif
typedef int16_t h16 __attribute__((vector_size(QL * 4)));
ALWAYS_INLINE h16 pairs_of(wvec w, mvec q) { return (h16)MADDUBS((mvec)w, q); }
ALWAYS_INLINE ivec widen(h16 pairs) { return madd16((ivec)pairs, (ivec)SET1_16(1)); }
ALWAYS_INLINE ivec pair_sum(wvec w0, wvec w1, const int8_t *q0, const int8_t *q1) {
    return widen(pairs_of(w0, SET1_32(quad(q0))) + pairs_of(w1, SET1_32(quad(q1))));
}

/* dot_rows' activations for its row r and the weight's quad i, as vpmaddubsw's operand: row r's quad (at q + r *
 * stride + 4i) in every lane; or, `rotated` (rotated.h: q a block's lines), the 32 bytes of line i from its r-th
 * quad on, whose lane l holds row (l + r) mod 8's quad, read whole by the multiply: no broadcast */
ALWAYS_INLINE mvec act_quads(const int8_t *q, const int64_t stride, const int r, const int i, const int rotated) {
    if (!rotated) return SET1_32(quad(q + r * stride + 4 * i));
    mvec v;
    memcpy(&v, q + ROTATED_LINE * i + 4 * r, sizeof(v));
    return v;
}

#if QL == 16 /* q with the sign of w's bytes (AVX-512 has no vpsignb; where w is 0, so is |w|) */
#define SIGN_OF(q, w) _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(w), _mm512_setzero_si512(), q)
#define ABS_8 _mm512_abs_epi8
#else
#define SIGN_OF(q, w) _mm256_sign_epi8(q, w)
#define ABS_8 _mm256_abs_epi8
#endif
#define SIGNED_CODES 1
#define SUMS_IN_16_BITS 1
/* 8-bit codes (small ones: dot_rows) */
ALWAYS_INLINE void dot_sub(const wvec w[8], const int8_t *q, const int codes, ivec *lo, ivec *hi) {
    if (codes == CODES_SIGNED) {
        ivec part[2] = {{0}, {0}};
        for (int i = 0; i < 8; i++)
            part[i / 4] += widen((h16)MADDUBS(ABS_8((mvec)w[i]), SIGN_OF(SET1_32(quad(q + 4 * i)), (mvec)w[i])));
        *lo = part[0], *hi = part[1];
        return;
    }
    ivec part[2]; /* each byte as 16 * high nibble + low nibble */
    for (int half = 0; half < 2; half++) {
        const wvec *v = w + 4 * half;
        const int8_t *x = q + 16 * half;
        ivec low = {0}, high = {0};
        for (int i = 0; i < 4; i += 2) {
            low += pair_sum(v[i] & 0x0F0F0F0Fu, v[i + 1] & 0x0F0F0F0Fu, x + 4 * i, x + 4 * i + 4);
            high += pair_sum((v[i] >> 4) & 0x0F0F0F0Fu, (v[i + 1] >> 4) & 0x0F0F0F0Fu, x + 4 * i, x + 4 * i + 4);
        }
        part[half] = low + (ivec)((wvec)high << 4);
    }
    *lo = part[0], *hi = part[1];
}
#else
ALWAYS_INLINE void dot_sub(const wvec w[8], const int8_t *q, const int codes, ivec *lo, ivec *hi) {
    (void)codes;
    ivec part[2] = {{0}, {0}};
    for (int i = 0; i < 8; i++)
        for (int lane = 0; lane < QL; lane++) {
            uint32_t codes = w[i][lane];
            int32_t sum = 0;
            for (int b = 0; b < 4; b++) sum += (int32_t)((codes >> (8 * b)) & 0xFF) * q[4 * i + b];
            part[i / 4][lane] += sum;
        }
    *lo = part[0], *hi = part[1];
}
#endif
#ifndef SIGNED_CODES
#define SIGNED_CODES 0 /* Q8_0's and IQ4's codes as unsigned bytes, + 128 */
#endif
#ifndef SUMS_IN_16_BITS
#define SUMS_IN_16_BITS 0
#endif

#if SUMS_IN_16_BITS
/* dot_rows of K-quants whose sums widen more than once a sub-block (Q5_K, Q6_K), in a whole pass: a row at a time,
 * the quads in registers, so that each row's 32-bit sum is read and written once a sub-block rather than at each
 * widening, where the 8 rows' sums beside their 16-bit ones were the stack's (AVX2 build, Zen 4, 512 rows of 4,096
 * x 2,048: Q6_K 183 -> 187 G MAC/s, Q5_K 209 -> 217). Fewer rows keep the quads outer (1 and 4 rows were slower
 * this way). The same integers as quads_outer_16, added in another order. `n` quads summed before each widening. */
ALWAYS_INLINE void rows_outer_16(const wvec w[8], const int8_t *q, const int64_t stride, const int rows, const int n,
                                 const ivec by[2], const int rotated, ivec lo[]) {
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        ivec acc = lo[r];
#pragma GCC unroll 4
        for (int first = 0; first < 8; first += n) {
            h16 sum = pairs_of(w[first], act_quads(q, stride, r, first, rotated));
#pragma GCC unroll 8
            for (int i = first + 1; i < first + n; i++) sum += pairs_of(w[i], act_quads(q, stride, r, i, rotated));
            acc += madd16((ivec)sum, by[first / 4]);
        }
        lo[r] = acc;
    }
}

/* dot_rows with the quads outer and the rows inner: each row's 16-bit sums stay in registers while the weight's
 * quads are read one at a time (a sub-block's 8 quads beside 4 rows' sums were more than AVX2's 16 registers: they
 * spilled), `n` quads summed before each widening (by[half]: ones, or the scales) */
ALWAYS_INLINE void quads_outer_16(const wvec w[8], const int8_t *q, const int64_t stride, const int rows, const int n,
                                  const ivec by[2], const int scaled, const int rotated, ivec lo[], ivec hi[]) {
#pragma GCC unroll 16
    for (int r = 0; r < rows && !scaled; r++) lo[r] = hi[r] = (ivec){0};
#pragma GCC unroll 4 /* or the rows' lo and hi lived on the stack: Q6_K's 4 rounds (Zen 3, 512 rows, before their
                      * whole passes took rows_outer_16) 49-83 -> 66-88 G MAC/s in 4 alternations, Q5_K's 2 rounds
                      * 83-86 -> 103-106 */
    for (int first = 0; first < 8; first += n) {
        h16 sum[16];
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) sum[r] = pairs_of(w[first], act_quads(q, stride, r, first, rotated));
#pragma GCC unroll 8
        for (int i = first + 1; i < first + n; i++)
#pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                sum[r] += pairs_of(w[i], act_quads(q, stride, r, i, rotated));
                __asm__("" : "+v"(sum[r])); /* in a register now: GCC otherwise reassociated the sums into
                                             * trees of all 64 products, stored to the stack and read back */
            }
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            if (first < 4 || scaled)
                lo[r] += madd16((ivec)sum[r], by[first / 4]);
            else
                hi[r] += madd16((ivec)sum[r], by[1]);
        }
    }
}
#endif

/* dot_sub for `rows` rows, row r's codes at q + r * stride. Where vpmaddubsw's 16-bit sums serve (no VNNI), small
 * codes take rows_outer_16 or quads_outer_16: 8 (codes up to 15), 4 (31) or 2 (63) quads summed before each
 * widening. `split`: whether the halves are wanted apart; if not, lo may hold the whole sum and hi zero. With
 * `scale` (a K-quant's sub-block scales per half, integers of at most 8 bits), each half's sum times its scale is
 * added to lo instead (hi unused): where the sums are 16-bit, the widening vpmaddwd multiplies by the scales rather
 * than by ones. Exact integers either way. */
ALWAYS_INLINE void dot_rows(const wvec w[8], const int8_t *q, const int64_t stride, const int rows, const int codes,
                            const int split, const ivec *scale, const int rotated, ivec lo[], ivec hi[]) {
#if SUMS_IN_16_BITS
    if (codes <= CODES_6BIT) {
        const int n = codes == CODES_4BIT && !split ? 8 : codes == CODES_6BIT ? 2 : 4;
        const ivec ones = (ivec)SET1_16(1), by[2] = {scale ? pair_lanes(scale[0], scale[0]) : ones,
                                                     scale ? pair_lanes(scale[1], scale[1]) : ones};
        if (scale && n < 8 && rows >= 8)
            rows_outer_16(w, q, stride, rows, n, by, rotated, lo);
        else
            quads_outer_16(w, q, stride, rows, n, by, scale != NULL, rotated, lo, hi);
        return;
    }
#endif
    (void)rotated; /* only where the sums are 16-bit (rotated.h) */
#ifdef PAIR_BY_SHUFFLE
    const ivec both = scale ? pair_lanes(scale[0], scale[0]) : (ivec){0};
#endif
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        if (!scale) {
            dot_sub(w, q + r * stride, codes, lo + r, hi + r);
            continue;
        }
        ivec low, high;
        dot_sub(w, q + r * stride, codes, &low, &high);
#ifdef DOT16_FUSED
        if (codes == CODES_4BIT) { /* each half's sum fits its lane's low 16 bits (16 codes of 15 times activations
                                    * of 128), the scale's high 16 bits are 0: a vpdpwssd a half, where vpmulld
                                    * took two uops and the additions two more */
#ifdef PAIR_BY_SHUFFLE
            if (!split) { /* or both halves at once, the scale in both words */
                lo[r] = dot16_add(lo[r], pair_words(low, high), both);
                continue;
            }
#endif
            lo[r] = dot16_add(dot16_add(lo[r], low, scale[0]), high, scale[split]);
            continue;
        }
#endif
        lo[r] += split ? low * scale[0] + high * scale[1] : (low + high) * scale[0];
    }
}
#endif
