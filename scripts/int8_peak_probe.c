/* The CPU's int8 multiply ceiling without VNNI: vpmaddubsw (32 byte pairs multiplied and summed into 16 bits) and
 * vfmadd231ps, each as 10 independent chains in registers, on THREADS threads. What an AVX2 int8 GEMM could reach at
 * most (docs/benchmarks/sizes.md). Kept out of CI:
 *
 *     gcc -O2 -mavx2 -mfma -fopenmp -DTHREADS=2 scripts/int8_peak_probe.c -o /tmp/int8_peak && /tmp/int8_peak
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#ifndef THREADS
#define THREADS 2
#endif
#define TIMES_10(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define ITERATIONS 100000000L

int main(void) {
    double start = omp_get_wtime(), sink = 0;
#pragma omp parallel num_threads(THREADS) reduction(+ : sink)
    {
        __m256i q = _mm256_set1_epi8(5);
#define DECLARE(i) __m256i a##i = _mm256_set1_epi16(i);
        TIMES_10(DECLARE)
        for (long it = 0; it < ITERATIONS; it++) {
            /* the empty asm keeps each chain in its register and its multiply in the loop */
#define MULTIPLY(i) a##i = _mm256_maddubs_epi16(a##i, q); __asm__("" : "+x"(a##i));
            TIMES_10(MULTIPLY)
        }
#define SINK(i) sink += _mm256_extract_epi16(a##i, 0);
        TIMES_10(SINK)
    }
    double seconds = omp_get_wtime() - start;
    printf("%d threads: vpmaddubsw %.2f G a second a thread, %.1f G int8 multiply-adds a second in all\n", THREADS,
           10 * ITERATIONS / seconds / 1e9, THREADS * 320 * ITERATIONS / seconds / 1e9);
    start = omp_get_wtime();
#pragma omp parallel num_threads(THREADS) reduction(+ : sink)
    {
        __m256 w = _mm256_set1_ps(1.0001f), x = _mm256_set1_ps(0.5f);
#define DECLARE_F(i) __m256 f##i = _mm256_set1_ps(i);
        TIMES_10(DECLARE_F)
        for (long it = 0; it < ITERATIONS; it++) {
#define FMA(i) f##i = _mm256_fmadd_ps(w, x, f##i); __asm__("" : "+x"(f##i));
            TIMES_10(FMA)
        }
#define SINK_F(i) sink += f##i[0];
        TIMES_10(SINK_F)
    }
    seconds = omp_get_wtime() - start;
    printf("%d threads: vfmadd231ps %.2f G a second a thread, %.1f G float32 multiply-adds a second in all (%g)\n",
           THREADS, 10 * ITERATIONS / seconds / 1e9, THREADS * 80 * ITERATIONS / seconds / 1e9, sink);
    return 0;
}
