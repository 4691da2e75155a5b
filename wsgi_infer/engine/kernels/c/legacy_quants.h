/* GGUF's blocks of 32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and our own Q8_M, as tiles of 16 rows.
 *
 * A tile's block (tiles.c writes it) holds each row's block, fields side by side: the float16 scale d of the
 * 16 rows, then their minimum m where the format has one, then their high bits (Q5: a 32-bit word a row, laid out
 * so that a shift and a mask give each code's fifth bit in place), then the codes: 4 units of 64 bytes for 4-bit
 * codes (unit u: each row's 4 bytes, low nibbles inputs 4u..4u+3, high nibbles 16 + 4u.., as the file's bytes
 * hold them), or 8 quads of 64 bytes for 8-bit ones. So a tile's block holds its rows' blocks' bits, byte for byte
 * but for their order (and Q8_0's codes shifted by 128, unsigned).
 *
 * w = d * (q - 8) (Q4_0), d * (q - 16) (Q5_0), d * (q - 128) (Q8_0, as stored; packed_mm.c subtracts the offset from
 * the integer sums), or d * q + m with the block's own minimum m (Q4_1, Q5_1, Q8_M). IQ4_NL's 4-bit codes (and
 * IQ4_XS's, k_quants.h) index 16 signed levels (ggml's kvalues_iq4nl): decoded in registers, a code is its level
 * + 128, w = d * (code - 128); without VNNI, Q8_0's and IQ4's codes are decoded signed (the file's own, the
 * level itself) and w = d * code (dot_products.h). Our Q8_M (weights quantized here from float values) is Q8_0 with
 * a minimum: 255 steps between each block's least and largest weight.
 */
#ifndef WSGI_INFER_LEGACY_QUANTS_H
#define WSGI_INFER_LEGACY_QUANTS_H
#include "dot_products.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20, Q8_M = 200 }; /* ggml's ids; Q8_M our own */

#define NIBBLES 0x0F0F0F0Fu
#define FIFTH_BITS 0x10101010u

/* the 4-bit codes of units 0-3 into w[0..7]: unit u's low nibbles are quad u, its high ones quad u + 4 */
ALWAYS_INLINE void unpack_nibbles(const uint8_t *codes, int h, wvec w[8]) {
    for (int u = 0; u < 4; u++) {
        wvec v = load_w(codes + 64 * u + 4 * QL * h);
        w[u] = v & NIBBLES;
        w[u + 4] = (v >> 4) & NIBBLES;
    }
}

/* each code's fifth bit from a row's word: byte b's bit u is input 4u + b's, its bit 4 + u input 16 + 4u + b's */
ALWAYS_INLINE void add_fifth_bits(const uint8_t *bits, int h, wvec w[8]) {
    wvec word = load_w(bits + 4 * QL * h);
    for (int u = 0; u < 4; u++) {
        w[u] |= (word << (4 - u)) & FIFTH_BITS;
        w[u + 4] |= (word >> u) & FIFTH_BITS;
    }
}

/* IQ4's 16 levels (ggml's kvalues_iq4nl), and as unsigned codes (+ 128) */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const uint8_t IQ4_CODES[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* each byte of w (an index, 0-15) as its level (SIGNED_CODES) or code: one byte shuffle where the CPU has it */
ALWAYS_INLINE wvec iq4_levels(wvec w) {
    const void *table = SIGNED_CODES ? (const void *)IQ4_LEVELS : (const void *)IQ4_CODES;
#if QL == 16
    return (wvec)_mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table)), (__m512i)w);
#elif defined(__AVX2__)
    return (wvec)_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)),
                                     (__m256i)w);
#else
    uint8_t bytes[sizeof(w)];
    memcpy(bytes, &w, sizeof(w));
    for (size_t i = 0; i < sizeof(w); i++) bytes[i] = ((const uint8_t *)table)[bytes[i]];
    memcpy(&w, bytes, sizeof(w));
    return w;
#endif
}

/* the 4-bit indices of units 0-3 (unpack_nibbles' layout) as IQ4 codes */
ALWAYS_INLINE void unpack_iq4(const uint8_t *codes, int h, wvec w[8]) {
    unpack_nibbles(codes, h, w);
    for (int i = 0; i < 8; i++) w[i] = iq4_levels(w[i]);
}

ALWAYS_INLINE void unpack_bytes(const uint8_t *codes, int h, wvec w[8]) {
    for (int i = 0; i < 8; i++) w[i] = load_w(codes + 64 * i + 4 * QL * h);
}

/* part h (QL rows) of a tile's block of one of these formats */
ALWAYS_INLINE void decode_legacy(const int type, const uint8_t *block, int h, decoded *out) {
    const f16 *d = (const f16 *)block + QL * h, *m = (const f16 *)(block + 32) + QL * h;
    out->s[0] = load_halves(d);
    switch (type) {
    case Q4_0:
        unpack_nibbles(block + 32, h, out->w);
        break;
    case Q4_1:
        out->m = load_halves(m);
        unpack_nibbles(block + 64, h, out->w);
        break;
    case Q5_0:
        unpack_nibbles(block + 96, h, out->w);
        add_fifth_bits(block + 32, h, out->w);
        break;
    case Q5_1:
        out->m = load_halves(m);
        unpack_nibbles(block + 128, h, out->w);
        add_fifth_bits(block + 64, h, out->w);
        break;
    case Q8_0:
        unpack_bytes(block + 32, h, out->w);
        if (SIGNED_CODES) /* the file's own signed codes again */
            for (int i = 0; i < 8; i++) out->w[i] ^= 0x80808080u;
        break;
    case IQ4_NL:
        unpack_iq4(block + 32, h, out->w);
        break;
    default: /* Q8_M */
        out->m = load_halves(m);
        unpack_bytes(block + 64, h, out->w);
    }
}

/* --- one row's values, as gguf-py dequantizes the file's blocks (float32, in its order of operations) --- */

/* row r's code for input i of a sub-block: 4-bit units at codes, 5-bit words at fifth (or NULL) */
static inline int nibble_code(const uint8_t *codes, const uint8_t *fifth, int r, int i) {
    int high = i >= 16, u = (i % 16) / 4, b = i % 4;
    int code = (codes[64 * u + 4 * r + b] >> (4 * high)) & 15;
    if (fifth) {
        uint32_t word;
        memcpy(&word, fifth + 4 * r, 4);
        code |= (int)((word >> (8 * b + 4 * high + u)) & 1) << 4;
    }
    return code;
}

static void legacy_row(const int type, const uint8_t *block, int r, float *out) {
    float d = half_to_float(((const f16 *)block)[r]), m = half_to_float(((const f16 *)(block + 32))[r]);
    for (int i = 0; i < 32; i++) {
        switch (type) {
        case Q4_0: out[i] = d * (float)(nibble_code(block + 32, NULL, r, i) - 8); break;
        case Q4_1: out[i] = d * (float)nibble_code(block + 64, NULL, r, i) + m; break;
        case Q5_0: out[i] = d * (float)(nibble_code(block + 96, block + 32, r, i) - 16); break;
        case Q5_1: out[i] = d * (float)nibble_code(block + 128, block + 64, r, i) + m; break;
        case Q8_0: out[i] = d * (float)(block[32 + 64 * (i / 4) + 4 * r + i % 4] - 128); break;
        case IQ4_NL: out[i] = d * (float)IQ4_LEVELS[nibble_code(block + 32, NULL, r, i)]; break;
        default: out[i] = d * (float)block[64 + 64 * (i / 4) + 4 * r + i % 4] + m; /* Q8_M */
        }
    }
}
#endif
