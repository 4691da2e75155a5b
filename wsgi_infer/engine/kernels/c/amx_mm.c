/* A weight tile's passes of 16 rows on AMX's tiles: the same integer sums as packed_mm.c's passes, scaled by the
 * same steps (sub_blocks.h) in the same order, so every output is the same bits as without the tiles.
 *
 * A task decodes its weight tile once, every sub-block into an L2-resident buffer (packed_mm.c decodes it again
 * for every pass, in registers, which suits vpdpbusd). Then, per 16 rows and per CHUNK sub-blocks, a burst of tile
 * multiplies: A, the rows' 32 activation codes (signed bytes; the tile loads them at the rows' distance apart), B,
 * the sub-block's 8 quads as quant_simd.h's registers hold them (a quad a tile row: 16 outputs' 4 codes), which is
 * the layout tdpbsud and tdpbssd take; C, [16 rows][16 outputs] of 32-bit sums, stored to L1. One multiply makes
 * what 128 vpdpbusd make. Where a format offsets its codes (Q4_0 by 8, Q8_0 by 128...), the decoded codes are made
 * signed once (tdpbssd), so the sums need no offset term. The burst's sums are then scaled, row by row: the
 * vector units' work, which the tiles cannot do, and what bounds a pass here.
 */
#include "amx_tiles.h"
#include "amx_k_sums.h"

#if AMX_ROWS
#include <sys/syscall.h>
#include <unistd.h>

int64_t amx_rows(int64_t rows) {
    static int ready = -1;
    int known = __atomic_load_n(&ready, __ATOMIC_ACQUIRE);
    if (known < 0) { /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
        known = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&ready, known, __ATOMIC_RELEASE);
    }
    /* a task decodes its tile once for all its passes, where registers decode it for each: with fewer than 3 passes
     * the registers are as fast or faster (a Sapphire Rapids, 4,096 x 2,048: 32 rows 1.0x, 48 rows 1.1-1.2x) */
    return known && rows >= 3 * AMX_ROWS ? rows / AMX_ROWS * AMX_ROWS : 0;
}

int64_t amx_block_rows(int64_t k, int planes) {
    const int64_t rows = (1024 << 10) / (k / QK * ACT_BYTES(planes)) / AMX_ROWS * AMX_ROWS;
    return rows > AMX_ROWS ? rows : AMX_ROWS;
}

#define CHUNK 8 /* sub-blocks a burst multiplies: a K-quant's super-block, or 8 blocks of 32 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* tiles 0-1 activations (16 rows x 32 codes), 2-3 a sub-block's codes (8 quads), 4-7 sums: two or more, so that one
 * multiply need not wait for the last. GCC's intrinsics take a tile's number as a literal. */
static const tile_config TILE_CONFIG = {
    .palette = 1,
    .bytes_per_row = {QK, QK, 64, 64, 64, 64, 64, 64},
    .rows = {AMX_ROWS, AMX_ROWS, 8, 8, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS},
};
/* amx_k_sums.h's: two sub-blocks a multiply (64 codes a row of activations, 16 quads of the weight's), the whole
 * of a tile multiply's depth where one sub-block takes half */
static const tile_config K_CONFIG = {
    .palette = 1,
    .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS},
};

uint8_t *amx_pair_codes(const uint8_t *act, int64_t rows, int64_t k, int threads) {
    const int64_t blocks = k / QK;
    uint8_t *out = scratch(SCRATCH_PAIR_CODES, rows / AMX_ROWS * group_bytes(k));
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * blocks > 4096)
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *group = out + r / AMX_ROWS * group_bytes(k);
        k_row_head *heads = (k_row_head *)(group + AMX_ROWS * k);
        for (int64_t b = 0; b < blocks; b++) {
            const act_head *head = (const act_head *)(act + act_offset(r, b, blocks, 1));
            memcpy(group + (b / 2 * AMX_ROWS + r % AMX_ROWS) * 64 + b % 2 * QK, head + 1, QK);
            k_row_head *row = heads + b / 8 * AMX_ROWS + r % AMX_ROWS;
            if (b % 2 == 0) row->pair16[b % 8 / 2] = head->pair16;
            if (b % 8 == 7) row->d = head->d;
        }
    }
    return out;
}

const uint8_t *amx_group_codes(const uint8_t *q, int64_t start, int64_t k) {
    return q ? q + start / AMX_ROWS * group_bytes(k) : NULL;
}

typedef int8_t bytes_v __attribute__((vector_size(QL * 4)));
#define SUMS_AT(sums, planes, c, p) ((sums) + ((c) * (planes) + (p)) * AMX_ROWS) /* [sub-block][plane][row] */

/* a sub-block's codes as the tiles take them: less the format's offset, as signed bytes, where it has one */
ALWAYS_INLINE void tile_codes(const int type, decoded *w) {
    const int8_t offset = (int8_t)code_offset(type);
    for (int i = 0; offset && i < 8; i++) w->w[i] = (wvec)((bytes_v)w->w[i] - offset);
}

#define MULTIPLY(C, A, B)                                                                                           \
    do {                                                                                                            \
        if (code_offset(type))                                                                                      \
            _tile_dpbssd(C, A, B);                                                                                  \
        else                                                                                                        \
            _tile_dpbsud(C, A, B);                                                                                  \
    } while (0)

/* the sums of `count` sub-blocks from `first` on with the pass's rows (activation block s's rows at
 * x + s * ACT_ROWS * act, act apart), every plane's */
ALWAYS_INLINE void burst(const int type, const int planes, const decoded *dec, const uint8_t *x, const int64_t act,
                         int64_t first, int count, ivec *sums) {
    for (int c = 0; c < count; c++)
        for (int p = 0; p < planes; p++) {
            const uint8_t *a = x + (first + c) * ACT_ROWS * act + sizeof(act_head) + p * QK;
            const wvec *w = dec[first + c].w;
            if ((c * planes + p) % 2) {
                _tile_loadd(1, a, act);
                _tile_loadd(3, w, 64);
                _tile_zero(5);
                MULTIPLY(5, 1, 3);
                _tile_stored(5, SUMS_AT(sums, planes, c, p), 64);
            } else {
                _tile_loadd(0, a, act);
                _tile_loadd(2, w, 64);
                _tile_zero(4);
                MULTIPLY(4, 0, 2);
                _tile_stored(4, SUMS_AT(sums, planes, c, p), 64);
            }
        }
}

/* row r's sum of sub-block c from a burst: 255 * hi + lo on the exact path */
ALWAYS_INLINE ivec plane_sum(const int planes, const ivec *sums, int c, int r) {
    const ivec hi = SUMS_AT(sums, planes, c, 0)[r];
    return planes == 1 ? hi : two_planes(hi, SUMS_AT(sums, planes, c, 1)[r]);
}

/* one pass: AMX_ROWS rows (x: their group's first block) times a decoded tile, as packed_mm.c's tile_rows: formats
 * whose sub-blocks are scaled one by one (not Q6_K's halves; the K-quants' integer sums are amx_k_sums.h's) */
ALWAYS_INLINE void tiles_pass(const int type, const int planes, const uint8_t *tile, const decoded *dec,
                              int64_t blocks, const uint8_t *x, float *out, int64_t out_stride, int width) {
    const int64_t act = ACT_BYTES(planes), subs = sub_blocks(type), total = blocks * subs;
    /* two bursts' sums: the next burst's tile multiplies run while this one's sums are scaled */
    ivec sums[2][CHUNK * 2 * AMX_ROWS];
    fvec acc[AMX_ROWS], sb[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = sb[r] = (fvec){0};
    burst(type, planes, dec, x, act, 0, total < CHUNK ? (int)total : CHUNK, sums[0]);
    for (int64_t first = 0; first < total; first += CHUNK) {
        const int count = total - first < CHUNK ? (int)(total - first) : CHUNK;
        const ivec *now = sums[first / CHUNK % 2];
        if (first + CHUNK < total) {
            const int64_t next = first + CHUNK, more = total - next < CHUNK ? total - next : CHUNK;
            burst(type, planes, dec, x, act, next, (int)more, sums[next / CHUNK % 2]);
        }
        for (int c = 0; c < count; c++) {
            const int64_t s = first + c;
            const decoded *w = dec + s;
#pragma GCC unroll 16
            for (int r = 0; r < AMX_ROWS; r++) {
                const uint8_t *a = x + (s * ACT_ROWS + r) * act;
                const ivec sum = plane_sum(planes, now, c, r);
                if (is_k(type))
                    sb[r] = k_row_step(type, w, a, sum, (ivec){0}, sb[r]);
                else
                    acc[r] = row_step(type, w, a, sum, acc[r]);
            }
            if (!is_k(type) || s % subs != subs - 1) continue;
            for (int r = 0; r < AMX_ROWS; r++) { /* a super-block's last: its activation scale, as tile_rows's */
                acc[r] = fma_v(sb[r], splat_v(((const act_head *)(x + (s * ACT_ROWS + r) * act))->d), acc[r]);
                sb[r] = (fvec){0};
            }
        }
    }
    store_rows(acc, AMX_ROWS, 0, width, out, out_stride);
}

/* rows / AMX_ROWS passes: the tile decoded once, then each pass on the tiles; the rows done (none where a format
 * is not taken: Q6_K's halves on the exact path) */
ALWAYS_INLINE int64_t tile_passes(const int type, const int planes, const uint8_t *tile, int64_t blocks,
                                  const uint8_t *x, const uint8_t *q, int64_t rows, float *out, int64_t out_stride,
                                  int width) {
    const int64_t subs = sub_blocks(type), bytes = block_bytes(type);
    const int ints = integer_sums(type, planes);
    if (halves_scaled(type) && !ints) return 0;
    uint8_t *dec = scratch(SCRATCH_DECODED, blocks * subs * (ints ? sizeof(split_codes) / 2 : sizeof(decoded)));
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *ahead = tile + (b + (4096 + bytes - 1) / bytes) * bytes;
        for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(ahead + line);
        k_scales ks; /* Q4_K's and Q5_K's */
        if (has_k_scales(type)) ks = k_unpack_scales(tile + b * bytes + 64, 0);
        for (int64_t j = 0; j < subs; j++) {
            decoded w;
            decode(type, tile + b * bytes, (int)j, 0, &ks, &w);
            if (ints) {
                split_scaled(type, &w, (int)(j % 2), (split_codes *)dec + (b * subs + j) / 2);
            } else {
                tile_codes(type, &w);
                ((decoded *)dec)[b * subs + j] = w;
            }
        }
    }
    _tile_loadconfig(ints ? &K_CONFIG : &TILE_CONFIG); /* another library on this thread may have loaded its own */
    const int64_t group = blocks * subs * ACT_ROWS * ACT_BYTES(planes), q_group = group_bytes(blocks * 256);
    for (int64_t g = 0; g < rows / AMX_ROWS;) {
        float *rows_out = out + g * AMX_ROWS * out_stride;
        const int pair = g + 1 < rows / AMX_ROWS; /* K-quants' sums take two groups at once */
        if (ints && pair)
            k_tiles_pass(type, 2, tile, (const split_codes *)dec, blocks, q + g * q_group, rows_out, out_stride, width);
        else if (ints)
            k_tiles_pass(type, 1, tile, (const split_codes *)dec, blocks, q + g * q_group, rows_out, out_stride, width);
        else
            tiles_pass(type, planes, tile, (const decoded *)dec, blocks, x + g * group, rows_out, out_stride, width);
        g += ints && pair ? 2 : 1;
    }
    return rows / AMX_ROWS * AMX_ROWS;
}

#define TYPE_CASE(T)                                                                                                \
    case T:                                                                                                         \
        return planes == 1 ? tile_passes(T, 1, tile, blocks, x, q, rows, out, out_stride, width)                    \
                           : tile_passes(T, 2, tile, blocks, x, q, rows, out, out_stride, width);

int64_t amx_tile_passes(int type, int planes, const uint8_t *tile, int64_t blocks, const uint8_t *x,
                        const uint8_t *q, int64_t rows, float *out, int64_t out_stride, int width) {
    switch (type) {
        TYPE_CASE(Q4_0) TYPE_CASE(Q4_1) TYPE_CASE(Q5_0) TYPE_CASE(Q5_1) TYPE_CASE(Q8_0) TYPE_CASE(Q8_M)
        TYPE_CASE(Q4_K) TYPE_CASE(Q5_K) TYPE_CASE(Q6_K) TYPE_CASE(IQ4_NL) TYPE_CASE(IQ4_XS)
    }
    return 0;
}
#else
int64_t amx_rows(int64_t rows) {
    (void)rows;
    return 0;
}

int64_t amx_block_rows(int64_t k, int planes) {
    (void)k, (void)planes;
    return AMX_ROWS;
}

uint8_t *amx_pair_codes(const uint8_t *act, int64_t rows, int64_t k, int threads) {
    (void)act, (void)rows, (void)k, (void)threads;
    return NULL;
}

const uint8_t *amx_group_codes(const uint8_t *q, int64_t start, int64_t k) {
    (void)q, (void)start, (void)k;
    return NULL;
}

int64_t amx_tile_passes(int type, int planes, const uint8_t *tile, int64_t blocks, const uint8_t *x,
                        const uint8_t *q, int64_t rows, float *out, int64_t out_stride, int width) {
    (void)type, (void)planes, (void)tile, (void)blocks, (void)x, (void)q, (void)rows, (void)out, (void)out_stride;
    (void)width;
    return 0;
}
#endif
