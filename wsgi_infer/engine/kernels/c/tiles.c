/* A weight's blocks, as a GGUF file holds them, laid out in the kernels' tiles of 16 rows (legacy_quants.h and
 * k_quants.h say what each field of a tile's block is): each row's block's bytes moved, and only Q6_K's and the
 * fifth bits' regrouped. A load lays out a 1B model's 700 MB in a fraction of a second, where torch's reshapes
 * took 5 s. Our Q8_M comes as blocks of its own: d, m (float16) and 32 codes, 36 bytes. A tile's rows are read back
 * as values here too (a tied embedding's lookups).
 */
#include "k_quants.h"
#include "packed_mm.h"

/* row r's 2-byte field (a float16) of a tile's block, at `at` */
static void put_half(uint8_t *tile, int at, int r, const uint8_t *from) { memcpy(tile + at + 2 * r, from, 2); }

/* row r's 16 bytes of 4-bit codes (byte t: input t low, t + 16 high) as the tile's 4 units of 64 bytes at `at` */
static void put_units(uint8_t *tile, int at, int r, const uint8_t *bytes, int units) {
    for (int u = 0; u < units; u++) memcpy(tile + at + 64 * u + 4 * r, bytes + 4 * u, 4);
}

/* row r's fifth bits (bit i: input i's) as its word at `at`: byte b's bit u is input 4u + b's, its bit 4 + u input
 * 16 + 4u + b's (legacy_quants.h: add_fifth_bits) */
static void put_fifth_word(uint8_t *tile, int at, int r, uint32_t bits) {
    uint8_t word[4] = {0};
    for (int half = 0; half < 2; half++)
        for (int u = 0; u < 4; u++)
            for (int b = 0; b < 4; b++) word[b] |= ((bits >> (16 * half + 4 * u + b)) & 1) << (u + 4 * half);
    memcpy(tile + at + 4 * r, word, 4);
}

static uint32_t word_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* row r of a tile's block from its block in the file, f: a format of 32 inputs */
static void legacy_block(int type, const uint8_t *f, uint8_t *tile, int r) {
    put_half(tile, 0, r, f);
    switch (type) {
    case Q4_0:
    case IQ4_NL: put_units(tile, 32, r, f + 2, 4); break;
    case Q4_1: put_half(tile, 32, r, f + 2), put_units(tile, 64, r, f + 4, 4); break;
    case Q5_0: put_fifth_word(tile, 32, r, word_at(f + 2)), put_units(tile, 96, r, f + 6, 4); break;
    case Q5_1:
        put_half(tile, 32, r, f + 2), put_fifth_word(tile, 64, r, word_at(f + 4)), put_units(tile, 128, r, f + 8, 4);
        break;
    case Q8_0: {
        uint8_t codes[32]; /* unsigned: shifted by 128 */
        for (int i = 0; i < 32; i++) codes[i] = f[2 + i] ^ 0x80;
        put_units(tile, 32, r, codes, 8);
        break;
    }
    default: put_half(tile, 32, r, f + 2), put_units(tile, 64, r, f + 4, 8); /* Q8_M */
    }
}

/* Q4_K, Q5_K: d, dmin, 12 bytes of scales and mins (as 3 words), then per sub-block j its codes (qs: 32 bytes a
 * pair of sub-blocks, low nibbles the even one) and Q5_K's fifth bits (qh: byte t's bit j, sub-block j's input t) */
static void k_block(int type, const uint8_t *f, uint8_t *tile, int r) {
    put_half(tile, 0, r, f), put_half(tile, 32, r, f + 2);
    for (int w = 0; w < 3; w++) memcpy(tile + 64 + 64 * w + 4 * r, f + 4 + 4 * w, 4);
    const uint8_t *qh = f + 16, *qs = f + (type == Q5_K ? 48 : 16);
    const int codes = type == Q5_K ? 768 : 256;
    for (int p = 0; p < 4; p++) { /* sub-blocks 2p (low nibbles) and 2p + 1: constant shifts, so one vector each */
        const uint8_t *pair = qs + 32 * p;
        uint8_t even[16], odd[16];
        for (int t = 0; t < 16; t++) {
            even[t] = (uint8_t)((pair[t] & 15) | (pair[t + 16] << 4));
            odd[t] = (uint8_t)((pair[t] >> 4) | (pair[t + 16] & 0xF0));
        }
        put_units(tile, codes + 512 * p, r, even, 4);
        put_units(tile, codes + 512 * p + 256, r, odd, 4);
    }
    if (type == Q5_K)
        for (int j = 0; j < 8; j++) {
            uint32_t bits = 0;
            for (int t = 0; t < 32; t++) bits |= (uint32_t)((qh[t] >> j) & 1) << t;
            put_fifth_word(tile, 256 + 64 * j, r, bits);
        }
}

/* Q6_K: ql (128 bytes), qh (64), 16 signed scales, d. Sub-block j's input i: low nibble of ql[64 (j / 4) + 32 (j % 2)
 * + i] (the high one where j % 4 >= 2), high pair (qh[32 (j / 4) + i] >> 2 (j % 4)) & 3 (k_quants.h: the tile's
 * pairs of units in a byte) */
static void q6_k_block(const uint8_t *f, uint8_t *tile, int r) {
    put_half(tile, 0, r, f + 208);
    for (int s = 0; s < 16; s++) tile[32 + 16 * s + r] = f[192 + s];
#pragma GCC unroll 8 /* each sub-block's shifts constants */
    for (int j = 0; j < 8; j++) {
        const uint8_t *low = f + 64 * (j / 4) + 32 * (j % 2), *high = f + 128 + 32 * (j / 4);
        const int low_shift = 4 * ((j % 4) / 2), high_shift = 2 * (j % 4);
#define LOW(i) ((low[i] >> low_shift) & 15)
        uint8_t nibbles[16], pairs[8];
        for (int t = 0; t < 16; t++) nibbles[t] = LOW(t) | (LOW(t + 16) << 4);
#undef LOW
        for (int w = 0; w < 2; w++) { /* the 4 bytes' high pairs of inputs 8w + b, + 4, + 16 and + 20, a word at once */
            const uint32_t m = 0x03030303u;
            uint32_t word = (word_at(high + 8 * w) >> high_shift) & m;
            word |= ((word_at(high + 8 * w + 4) >> high_shift) & m) << 2;
            word |= ((word_at(high + 8 * w + 16) >> high_shift) & m) << 4;
            word |= ((word_at(high + 8 * w + 20) >> high_shift) & m) << 6;
            memcpy(pairs + 4 * w, &word, 4);
        }
        put_units(tile, 288 + 128 * j, r, pairs, 2);
        put_units(tile, 1312 + 256 * j, r, nibbles, 4);
    }
}

/* IQ4_XS: d, scales_h (16 bits: sub-block j's high pair at bit 2j), scales_l (4 bytes: j's low nibble at bit 4j of
 * their word), then each sub-block's 16 bytes of level indices as IQ4_NL's */
static void iq4_xs_block(const uint8_t *f, uint8_t *tile, int r) {
    put_half(tile, 0, r, f), put_half(tile, 32, r, f + 2);
    memcpy(tile + 64 + 4 * r, f + 4, 4);
    for (int j = 0; j < 8; j++) put_units(tile, 128 + 256 * j, r, f + 8 + 16 * j, 4);
}

static inline __attribute__((always_inline)) void block_into(int t, const uint8_t *f, uint8_t *tile, int r) {
    if (t == Q6_K)
        q6_k_block(f, tile, r);
    else if (t == IQ4_XS)
        iq4_xs_block(f, tile, r);
    else if (t == Q4_K || t == Q5_K)
        k_block(t, f, tile, r);
    else
        legacy_block(t, f, tile, r);
}

/* One tile's rows from raw's rows first.. (held of them): a row's blocks read in order, a span of blocks at a time
 * whose tile blocks stay in L1 (16 rows' blocks read side by side missed the cache at every row's block) */
static inline __attribute__((always_inline)) void tile_rows(int t, const uint8_t *raw, int64_t first, int64_t held,
                                                            int64_t blocks, uint8_t *out) {
    const int64_t file_bytes = file_block_bytes(t), tile_bytes = block_bytes(t), span = 1 + (8 << 10) / tile_bytes;
    if (held < 16) memset(out, 0, blocks * tile_bytes);
    for (int64_t from = 0; from < blocks; from += span) {
        const int64_t to = from + span < blocks ? from + span : blocks;
        for (int64_t r = 0; r < held; r++) {
            const uint8_t *f = raw + (first + r) * blocks * file_bytes;
            for (int64_t b = from; b < to; b++) block_into(t, f + b * file_bytes, out + b * tile_bytes, (int)r);
        }
    }
}

/* tiles [ceil(rows / 16)][k / block inputs][a tile's block] from raw [rows][k / block inputs][a file's block]: rows
 * past the last, up to a whole tile, are zeros. Returns 0, or -1 for a format not laid out here. */
int tile_blocks(int64_t type, const uint8_t *raw, int64_t rows, int64_t k, uint8_t *tiles, int threads) {
    const int t = (int)type;
    if (!file_block_bytes(t)) return -1;
    const int64_t blocks = k / block_inputs(t), count = (rows + 15) / 16, tile_bytes = block_bytes(t);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < count; tile++) {
        uint8_t *out = tiles + tile * blocks * tile_bytes;
        const int64_t first = 16 * tile, held = rows - first < 16 ? rows - first : 16;
        switch (t) { /* the formats most files hold most of, each with its constants */
        case Q4_K: tile_rows(Q4_K, raw, first, held, blocks, out); break;
        case Q6_K: tile_rows(Q6_K, raw, first, held, blocks, out); break;
        case Q4_0: tile_rows(Q4_0, raw, first, held, blocks, out); break;
        case Q8_0: tile_rows(Q8_0, raw, first, held, blocks, out); break;
        default: tile_rows(t, raw, first, held, blocks, out);
        }
    }
    return 0;
}

/* Rows ids of the weight (a tied embedding's lookups), each value as gguf-py dequantizes the file's blocks */
void packed_rows(const packed_weight *w, const int64_t *ids, int64_t count, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (count > 1)
    for (int64_t i = 0; i < count; i++) {
        int64_t row = ids[i];
        int p = 0;
        while (row >= w->parts[p].n) row -= w->parts[p].n, p++;
        const int type = (int)w->parts[p].type;
        int64_t inputs = block_inputs(type), blocks = w->k / inputs, bytes = block_bytes(type);
        const uint8_t *tile = w->parts[p].tiles + row / TILE * blocks * bytes;
        for (int64_t b = 0; b < blocks; b++) {
            if (is_k(type))
                k_row(type, tile + b * bytes, (int)(row % TILE), out + i * w->k + b * inputs);
            else
                legacy_row(type, tile + b * bytes, (int)(row % TILE), out + i * w->k + b * inputs);
        }
    }
}

/* The bytes of a tile's block of a format (0: not a format here), for block_fields.py to check against its own */
int64_t packed_block_bytes(int type) { return block_bytes(type); }
