/* Read bandwidth probe (bench_bandwidth.py builds and runs it): every thread streams its share of a buffer far
 * beyond any cache with the CPU's widest loads into several independent accumulators, prefetching `ahead` bytes in
 * front, the best of a few runs for each distance. Prints "prefetch_bytes GB/s" per distance. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#ifdef __AVX512F__
typedef __m512i vec;
#define LOAD(p) _mm512_load_si512((const void *)(p))
#define XOR(a, b) _mm512_xor_si512(a, b)
#define ZERO() _mm512_setzero_si512()
#else
typedef __m256i vec;
#define LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define XOR(a, b) _mm256_xor_si256(a, b)
#define ZERO() _mm256_setzero_si256()
#endif
#define STEP (8 * (int64_t)sizeof(vec)) /* bytes an iteration: 8 loads, 8 accumulators */

static uint64_t stream(const char *p, int64_t bytes, int64_t ahead) {
    vec acc[8];
    for (int i = 0; i < 8; i++) acc[i] = ZERO();
    for (int64_t at = 0; at < bytes; at += STEP) {
        if (ahead)
            for (int64_t line = 0; line < STEP; line += 64) __builtin_prefetch(p + at + ahead + line);
        for (int i = 0; i < 8; i++) acc[i] = XOR(acc[i], LOAD(p + at + i * sizeof(vec)));
    }
    uint64_t out[sizeof(vec) / 8];
    for (int i = 1; i < 8; i++) acc[0] = XOR(acc[0], acc[i]);
    memcpy(out, &acc[0], sizeof(out));
    return out[0];
}

int main(int argc, char **argv) {
    int64_t bytes = (argc > 1 ? atoll(argv[1]) : 1024) << 20;
    int threads = omp_get_max_threads();
    char *buffer = aligned_alloc(4096, bytes);
    if (getenv("HUGE")) madvise(buffer, bytes, MADV_HUGEPAGE);
    memset(buffer, 1, bytes);
    const int64_t distances[] = {0, 512, 1024, 2048, 4096, 8192};
    uint64_t sink = 0;
    for (int d = 0; d < 6; d++) {
        double best = 1e9;
        for (int run = 0; run < 5; run++) {
            double start = now();
#pragma omp parallel num_threads(threads) reduction(^ : sink)
            {
                int64_t share = bytes / threads / STEP * STEP, t = omp_get_thread_num();
                sink ^= stream(buffer + t * share, share, distances[d]);
            }
            double seconds = now() - start;
            best = seconds < best ? seconds : best;
        }
        printf("%lld %.2f\n", (long long)distances[d], bytes / best / 1e9);
    }
    fprintf(stderr, "(%llu)\n", (unsigned long long)sink);
    free(buffer);
    return 0;
}
