/* The packed multiplies' registers: a weight tile's rows, one per 32-bit lane.
 *
 * A weight is laid out in tiles of TILE rows (tiles.c): for every 4 inputs of a sub-block, the tile's rows' 4
 * codes side by side, so one register holds QL rows' codes for 4 inputs (16 rows with AVX-512, 8 elsewhere: a
 * tile in HALVES parts), each lane one output row: no horizontal sums, and each decoded register serves every
 * row of activations. Codes are unsigned (a signed format's are shifted up, the shift undone by the offset term),
 * activations signed 8-bit: vpdpbusd's operands. The integer sums are exact; how they are scaled is in
 * packed_mm.c. Everything but the dot products and fused multiply-adds is GCC's vector extensions.
 */
#ifndef WSGI_INFER_QUANT_SIMD_H
#define WSGI_INFER_QUANT_SIMD_H
#include "common.h"

#define TILE 16 /* rows of a weight tile: the layouts' unit, whatever the registers' width */
#define QL LANES /* rows a register holds: 16 with AVX-512 (whose byte ops need BW), else 8 */
#if defined(__AVX512F__) && !defined(__AVX512BW__)
#error "the 16-lane quant kernels need AVX-512 BW as well as F"
#endif
#define HALVES (TILE / QL) /* a tile's parts of QL rows */
#define ROTATED_LINE (2 * 4 * QL) /* a line of rotated activations: a quad of each of a pass's rows, twice (rotated.h) */

typedef uint32_t wvec __attribute__((vector_size(QL * 4))); /* QL rows' 4 codes each, one row a lane */
typedef int32_t ivec __attribute__((vector_size(QL * 4)));
typedef f32v fvec;

static inline wvec load_w(const uint8_t *p) {
    wvec v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline fvec to_f(ivec v) { return __builtin_convertvector(v, fvec); }

/* QL signed bytes as 32-bit integers (GCC's generic conversion of a byte vector went one byte at a time) */
static inline ivec sbytes_i(const uint8_t *p) {
#if QL == 16
    return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    ivec v;
    for (int i = 0; i < QL; i++) v[i] = (int8_t)p[i];
    return v;
#endif
}

/* per 32-bit lane, the products of a's and b's signed 16-bit halves, summed (vpmaddwd): exact */
static inline ivec madd16(ivec a, ivec b) {
#if QL == 16
    return (ivec)_mm512_madd_epi16((__m512i)a, (__m512i)b);
#elif defined(__AVX2__)
    return (ivec)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
    ivec v;
    for (int i = 0; i < QL; i++)
        v[i] = (int16_t)(a[i] & 0xFFFF) * (int16_t)(b[i] & 0xFFFF) + (a[i] >> 16) * (b[i] >> 16);
    return v;
#endif
}

/* acc + madd16(a, b): one instruction (vpdpwssd) where VNNI has it, else two */
#if QL == 16 && defined(__AVX512VNNI__) || QL == 8 && defined(__AVXVNNI__)
#define DOT16_FUSED 1
#endif
static inline ivec dot16_add(ivec acc, ivec a, ivec b) {
#if QL == 16 && defined(__AVX512VNNI__)
    return (ivec)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif QL == 8 && defined(__AVXVNNI__)
    return (ivec)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)a, (__m256i)b);
#else
    return acc + madd16(a, b);
#endif
}

/* signed integers of at most 16 bits, low and high, as one lane's halves (madd16's pairs) */
static inline ivec pair_lanes(ivec low, ivec high) { return (ivec)(((wvec)low & 0xFFFFu) | ((wvec)high << 16)); }

/* Where pairing two sums costs no multiply: pair_lanes in one vpermt2w, a shuffle, which on Zen 4 leaves the
 * multiply pipes that vpdpbusd and vpdpwssd share (scripts/vnni_pipe_probe.c, 8 vpdpbusd a row: 2.92 G a second a
 * core with two vpdpwssd after them, 3.24 with vpermt2w and one; a shift and a blend instead, 2.94). Not in the AMX
 * build: on that Xeon pairing by shift and blend was slower, and a shuffle there was not measured. */
#if QL == 16 && defined(__AVX512VNNI__) && !defined(__AMX_TILE__)
#define PAIR_BY_SHUFFLE 1
static inline ivec pair_words(ivec low, ivec high) {
    const __m512i words = _mm512_set_epi16(62, 30, 60, 28, 58, 26, 56, 24, 54, 22, 52, 20, 50, 18, 48, 16, 46, 14,
                                           44, 12, 42, 10, 40, 8, 38, 6, 36, 4, 34, 2, 32, 0);
    return (ivec)_mm512_permutex2var_epi16((__m512i)low, words, (__m512i)high);
}
#endif

static inline int32_t quad(const int8_t *q) { /* 4 activation codes as one 32-bit word */
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

/* A sub-block of 32 inputs of a tile's QL rows, decoded: the codes w (quad i: inputs 4i..4i+3), and per row the
 * scale s of inputs 0-15 ([0]) and 16-31 ([1]) (formats with one scale per 32 inputs fill [0] only) and the
 * minimum m of formats that have their own. A weight is then w = s * code + m, or s * (code - a fixed offset). */
typedef struct {
    wvec w[8];
    fvec s[2], m;
    ivec sc[2]; /* K-quants but IQ4_XS: the integer sub-block scales (s = d * sc) */
} decoded;
#endif
