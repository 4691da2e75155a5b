/* A packed weight as the multiplies take it (packed_mm.c; kernels/packed.py lays it out). */
#ifndef WSGI_INFER_PACKED_MM_H
#define WSGI_INFER_PACKED_MM_H
#include <stdint.h>

#define MAX_PARTS 4
typedef struct {
    int64_t type;         /* a format above */
    const uint8_t *tiles; /* [ceil(n / 16)][k / block inputs][block_bytes(type)] */
    int64_t n;            /* its rows (outputs) */
} packed_part;

typedef struct { /* a weight [n, k]: parts of its rows, stacked (a fused projection's), each in its own format */
    packed_part parts[MAX_PARTS];
    int64_t count, n, k;
    const float *bias; /* [n], or NULL */
} packed_weight;

void packed_mm(const float *x, int64_t rows, const packed_weight *w, float *out, int planes, int threads);
#endif
