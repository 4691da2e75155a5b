/* Intel's tile unit (AMX-INT8: Sapphire Rapids and later Xeons): the packed multiply's passes of 16 rows
 * (amx_mm.c). Linux lends a process the tiles' state only when asked (arch_prctl); where it refuses, or in a build
 * without the tiles, every pass is packed_mm.c's, in registers.
 */
#ifndef WSGI_INFER_AMX_TILES_H
#define WSGI_INFER_AMX_TILES_H
#include "quant_simd.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && QL == 16
#define AMX_ROWS 16 /* rows a pass on the tiles takes: a whole tile of activations */
#else
#define AMX_ROWS 0
#endif

/* the first of a multiply's rows that take the tiles: whole passes of AMX_ROWS, where this process may use them
 * (asked of the kernel once), else none */
int64_t amx_rows(int64_t rows);

/* rows a task takes to the tiles, a multiple of AMX_ROWS: as many as let their activations (k inputs) stay in L2
 * while the task's weight tile is multiplied by them, and the next tile's task reads them again */
int64_t amx_block_rows(int64_t k, int planes);

/* the 8-bit codes of the first `rows` (whole groups of AMX_ROWS) of a multiply's activations (activations.h's
 * layout), laid out for K-quants' passes on the tiles (amx_k_sums.h's group_bytes), in the thread's scratch buffer;
 * and where the group of row `start` begins in them (NULL for NULL) */
uint8_t *amx_pair_codes(const uint8_t *act, int64_t rows, int64_t k, int threads);
const uint8_t *amx_group_codes(const uint8_t *q, int64_t start, int64_t k);

/* the first rows / AMX_ROWS * AMX_ROWS rows of activations x (activations.h's groups; q: their codes in pairs where
 * the weight has K-quant parts and they are 8-bit) times one tile of `blocks` blocks of a weight: their first
 * `width` outputs into out, as packed_mm.c's passes compute them, to the bit. Returns the rows done: those, or none
 * where the tiles do not take the format (Q6_K on the exact path). */
int64_t amx_tile_passes(int type, int planes, const uint8_t *tile, int64_t blocks, const uint8_t *x,
                        const uint8_t *q, int64_t rows, float *out, int64_t out_stride, int width);
#endif
