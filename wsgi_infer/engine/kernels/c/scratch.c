/* Scratch memory that a thread keeps across calls (common.h: scratch). A step's buffers are large (a 512-row
 * prefill chunk of a 1B model: 32 MB for its gate and up rows), and glibc hands blocks that large to the system
 * when they are freed: every step then took them back page by page, zeroed (6% of a prefill's time). */
#include "common.h"

#define SLOTS 16

typedef struct {
    void *memory;
    size_t bytes;
} slot;

static __thread slot slots[SLOTS];

void *scratch(int which, size_t bytes) {
    slot *s = slots + which;
    if (s->bytes < bytes) {
        free(s->memory);
        s->bytes = (bytes + 4095) / 4096 * 4096;
        s->memory = aligned_alloc(64, s->bytes);
    }
    return s->memory;
}
