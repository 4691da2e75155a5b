/* Activations rotated for the passes that sum in 16 bits (rotated.h). */
#include "rotated.h"

uint8_t *rotate_activations(const uint8_t *act, int64_t rows, int64_t k, int threads) {
    const int64_t blocks = k / QK, count = rows / ACT_ROWS * blocks; /* groups' blocks, in the same order */
    uint8_t *out = scratch(SCRATCH_ROTATED, count * ROT_BYTES);
#pragma omp parallel for schedule(static) num_threads(threads) if (count > 64)
    for (int64_t i = 0; i < count; i++) {
        uint8_t *lines = out + i * ROT_BYTES;
        for (int r = 0; r < ACT_ROWS; r++) {
            const act_head *head = (const act_head *)(act + (i * ACT_ROWS + r) * ACT_BYTES(1));
            for (int word = 4 * r; word < ROTATED_LINE; word += 4 * ACT_ROWS) { /* the row's word, twice a line */
                for (int quad = 0; quad < QK / 4; quad++)
                    memcpy(lines + quad * ROTATED_LINE + word, (const uint8_t *)(head + 1) + 4 * quad, 4);
                memcpy(lines + ROT_HALVES16 * ROTATED_LINE + word, &head->halves16, 4);
                memcpy(lines + ROT_PAIR16 * ROTATED_LINE + word, &head->pair16, 4);
                memcpy(lines + ROT_D * ROTATED_LINE + word, &head->d, 4);
            }
        }
    }
    return out;
}
