/* GGUF's K-quants (Q4_K, Q5_K, Q6_K) and IQ4_XS: super-blocks of 256 weights in 8 sub-blocks of 32, as tiles of 16
 * rows.
 *
 * A tile's super-block (tiles.c writes it): the float16 d of the 16 rows (and dmin: Q4_K, Q5_K), then their
 * sub-block scales (Q4_K and Q5_K: each row's 6-bit scales and mins in the file's 12 bytes, as 3 words of the 16
 * rows side by side; Q6_K: its 16 signed scales, one per 16 weights, a byte of each row side by side), then the
 * high bits of the codes, then the 4-bit codes, each sub-block as the legacy formats lay theirs out
 * (legacy_quants.h): the file's bytes, no more. Q6_K's two high bits of a row's 8 codes of two units are one byte:
 * bits 0-1 the low quad of the first unit, 2-3 the second's, 4-5 and 6-7 their high quads. IQ4_XS: d, the rows'
 * 16 bits of scales' high pairs (as halves are laid out), their 4 bytes of scales' low nibbles (a word a row), then
 * each sub-block's 4-bit level indices as IQ4_NL's (legacy_quants.h).
 *
 * Per sub-block, w = (d * sc) * q - dmin * mn (Q4_K, Q5_K), and (d * sc) * (q - 32) per 16 weights (Q6_K): the
 * products d * sc are exact in float32 (an 11-bit significand times a 6- or 8-bit integer). IQ4_XS: (d * (sc - 32))
 * * (code - 128), sc of 6 bits.
 */
#ifndef WSGI_INFER_K_QUANTS_H
#define WSGI_INFER_K_QUANTS_H
#include "legacy_quants.h"

enum { Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23 };

/* formats of 256-input super-blocks (whose activations take a scale per super-block) */
static inline int is_k(const int type) { return type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS; }
static inline int is_iq4(const int type) { return type == IQ4_NL || type == IQ4_XS; }
static inline int has_k_scales(const int type) { return type == Q4_K || type == Q5_K; } /* k_scales */
static inline int block_inputs(const int type) { return is_k(type) ? 256 : 32; }

/* a block's bytes as the file holds it (our Q8_M: d, m and 32 codes); 0: not a format the kernels read */
static inline int64_t file_block_bytes(const int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case IQ4_NL: return 18;
    case Q8_M: return 36;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ4_XS: return 136;
    default: return 0;
    }
}

/* a tile's block: its rows' blocks, field by field (tiles.c lays them out) */
static inline int64_t block_bytes(const int type) { return TILE * file_block_bytes(type); }

#define SIXTH_BITS 0x30303030u

/* a unit pair's two high bits (legacy_quants.h's layout, as above) into quads u, u + 1, u + 4 and u + 5 */
ALWAYS_INLINE void add_high_pairs(wvec bits, int u, wvec w[8]) {
    w[u] |= (bits << 4) & SIXTH_BITS;
    w[u + 1] |= (bits << 2) & SIXTH_BITS;
    w[u + 4] |= bits & SIXTH_BITS;
    w[u + 5] |= (bits >> 2) & SIXTH_BITS;
}

/* each lane's byte b (0-3), zero-extended */
ALWAYS_INLINE wvec lane_byte(const wvec v, const int b) { return (v >> (8 * b)) & 0xFFu; }

/* each lane's bytes b and b + 1 (b: 0-2) as its low and high 16 bits */
ALWAYS_INLINE wvec lane_byte_pair(const wvec v, const int b) {
    const wvec t = v >> (8 * b);
    return (t & 0xFFu) | ((t & 0xFF00u) << 8);
}

/* a super-block's 6-bit sub-block scales and minimums of QL rows, from the file's 12 bytes a row (ggml's
 * get_scale_min_k4), unpacked once for its 8 sub-blocks: a byte a sub-block, 0-3 in [0] and 4-7 in [1] (each
 * sub-block unpacking its own, the AVX2 build on a Zen 4 ran 512 rows of Q4_K at 241 G MAC/s, now 249; one row 100,
 * now 107) */
typedef struct {
    wvec scale[2], low[2];
} k_scales;

/* part h's rows' scales and minimums: the 3 words at `words` ([word][16 rows]) */
ALWAYS_INLINE k_scales k_unpack_scales(const uint8_t *words, int h) {
    const wvec first = load_w(words + 4 * QL * h), second = load_w(words + 64 + 4 * QL * h);
    const wvec third = load_w(words + 128 + 4 * QL * h);
    return (k_scales){{first & 0x3F3F3F3Fu, (third & 0x0F0F0F0Fu) | ((first >> 2) & 0x30303030u)},
                      {second & 0x3F3F3F3Fu, ((third >> 4) & 0x0F0F0F0Fu) | ((second >> 2) & 0x30303030u)}};
}

/* sub-block j's scale and minimum of each row */
ALWAYS_INLINE void k_scale_min(const k_scales *s, int j, wvec *scale, wvec *low) {
    *scale = lane_byte(s->scale[j / 4], j % 4), *low = lane_byte(s->low[j / 4], j % 4);
}

/* QL rows' 16-bit fields at p, a row a lane */
ALWAYS_INLINE wvec load_u16_lanes(const uint8_t *p) {
#if QL == 16
    return (wvec)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    return (wvec)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    uint16_t fields[QL];
    memcpy(fields, p, sizeof(fields));
    wvec v;
    for (int i = 0; i < QL; i++) v[i] = fields[i];
    return v;
#endif
}

/* sub-block j's 6-bit scale of IQ4_XS's rows (part h): its low nibble from the rows' words at 64, its high pair from
 * their 16 bits at 32 */
ALWAYS_INLINE wvec iq4_xs_scale(const uint8_t *block, int j, int h) {
    wvec low_nibbles = load_w(block + 64 + 4 * QL * h), high_pairs = load_u16_lanes(block + 32 + 2 * QL * h);
    return ((low_nibbles >> (4 * j)) & 15) | (((high_pairs >> (2 * j)) & 3) << 4);
}

/* sub-block j of part h (QL rows) of a tile's super-block; ks: its scales unpacked (read by Q4_K and Q5_K) */
ALWAYS_INLINE void decode_k(const int type, const uint8_t *block, int j, int h, const k_scales *ks, decoded *out) {
    fvec d = load_halves((const f16 *)block + QL * h);
    if (type == Q6_K) {
        const uint8_t *scales = block + 32 + 2 * TILE * j + QL * h, *high = block + 288 + 128 * j;
        out->sc[0] = sbytes_i(scales), out->sc[1] = sbytes_i(scales + TILE);
        out->s[0] = d * to_f(out->sc[0]);
        out->s[1] = d * to_f(out->sc[1]);
        unpack_nibbles(block + 1312 + 256 * j, h, out->w);
        add_high_pairs(load_w(high + 4 * QL * h), 0, out->w);
        add_high_pairs(load_w(high + 64 + 4 * QL * h), 2, out->w);
        return;
    }
    if (type == IQ4_XS) {
        out->s[0] = d * to_f((ivec)iq4_xs_scale(block, j, h) - 32);
        unpack_iq4(block + 128 + 256 * j, h, out->w);
        return;
    }
    fvec dmin = load_halves((const f16 *)(block + 32) + QL * h);
    wvec scale, low;
    k_scale_min(ks, j, &scale, &low);
    out->sc[0] = out->sc[1] = (ivec)scale;
    out->s[0] = d * to_f((ivec)scale); /* 6 bits: as signed, one instruction without AVX-512 too */
    out->m = dmin * to_f(-(ivec)low);
    if (type == Q4_K) {
        unpack_nibbles(block + 256 + 256 * j, h, out->w);
    } else {
        unpack_nibbles(block + 768 + 256 * j, h, out->w);
        add_fifth_bits(block + 256 + 64 * j, h, out->w);
    }
}

/* row r's values of a tile's super-block, as gguf-py dequantizes them */
static void k_row(const int type, const uint8_t *block, int r, float *out) {
    float d = half_to_float(((const f16 *)block)[r]), dmin = half_to_float(((const f16 *)(block + 32))[r]);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 32; i++) {
            float *value = out + 32 * j + i;
            if (type == Q6_K) {
                const uint8_t *high = block + 288 + 128 * j + 64 * ((i % 16) / 8) + 4 * r;
                int u = (i % 16) / 4, bits = (high[i % 4] >> (4 * (i >= 16) + 2 * (u % 2))) & 3;
                float scale = d * (float)(int8_t)block[32 + TILE * (2 * j + i / 16) + r];
                *value = scale * (float)(nibble_code(block + 1312 + 256 * j, NULL, r, i) + 16 * bits - 32);
                continue;
            }
            if (type == IQ4_XS) {
                uint32_t low_nibbles;
                memcpy(&low_nibbles, block + 64 + 4 * r, 4);
                int high_pairs = ((const uint16_t *)(block + 32))[r];
                int sc = (int)((low_nibbles >> (4 * j)) & 15) | (((high_pairs >> (2 * j)) & 3) << 4);
                *value = d * (float)(sc - 32) * (float)IQ4_LEVELS[nibble_code(block + 128 + 256 * j, NULL, r, i)];
                continue;
            }
            uint8_t bytes[12]; /* the row's 12 bytes of scales and mins, as the file holds them */
            for (int w = 0; w < 3; w++) memcpy(bytes + 4 * w, block + 64 + 64 * w + 4 * r, 4);
            int sc = j < 4 ? bytes[j] & 63 : (bytes[j + 4] & 15) | ((bytes[j - 4] >> 6) << 4);
            int mn = j < 4 ? bytes[j + 4] & 63 : (bytes[j + 4] >> 4) | ((bytes[j] >> 6) << 4);
            float scale = d * (float)sc, low = dmin * (float)mn;
            const uint8_t *fifth = type == Q5_K ? block + 256 + 64 * j : NULL;
            int code = nibble_code(block + (type == Q5_K ? 768 : 256) + 256 * j, fifth, r, i);
            *value = scale * (float)code - low;
        }
}
#endif
