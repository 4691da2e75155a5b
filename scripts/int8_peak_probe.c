/* The CPU's int8 multiply ceiling without VNNI: vpmaddubsw (32 byte pairs multiplied and summed into 16 bits) and
 * vfmadd231ps, each as 10 independent chains in registers, on THREADS threads. What an AVX2 int8 GEMM could reach at
 * most (docs/benchmarks/sizes.md); then the packed multiply's inner loop as it runs (each product added to a row's
 * 16-bit sums with vpaddw): an activation quad broadcast from memory for each multiply, for every two, or none, or
 * each spread by a shuffle from 16 bytes loaded once for four, or each read whole from memory as the multiply's operand
 * (activations stored already broadcast: 32 bytes a quad, 8 times a quad's bytes), or read rotated: 8 rows' quads
 * stored twice in a 64-byte line, each multiply's operand the 32 bytes from the line's k-th quad on (twice a quad's
 * bytes; lane l then meets row (l + k) mod 8, and the sums are diagonals); then the Q4_K pass's whole inner loop;
 * last, attention's float tiles with their broadcasts and without.
 * Kept out of CI:
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

/* The AVX2 Q4_K pass's inner loop alone (register_passes.h, rotated.h), what it costs with nothing around it (no
 * prefetches, no scales to unpack, no super-block totals): a sub-block of 8 weight rows, its 4 words of codes loaded
 * and split into 8 quads of nibbles, times 8 rows of rotated activations (line i at 64i), each row's 8 products
 * summed in 16 bits and widened by the scales (vpmaddwd) into its 32-bit sums in memory. 64 sub-blocks of codes and
 * of activations (16 and 44 KB: L1 and L2, as a pass over 2,048 inputs reads them). */
static void q4_k_loop(void) {
    enum { SUBS = 64 };
    static unsigned char codes[SUBS * 256] __attribute__((aligned(64)));
    static signed char lines[SUBS * 704] __attribute__((aligned(64)));
    static int sums[THREADS][64] __attribute__((aligned(64)));
    const long iterations = ITERATIONS / 50;
    double start = omp_get_wtime();
#pragma omp parallel num_threads(THREADS)
    {
        const __m256i mask = _mm256_set1_epi8(15), by = _mm256_set1_epi32(0x00030003);
        int *lo = sums[omp_get_thread_num()];
        for (long it = 0; it < iterations; it++)
            for (int j = 0; j < SUBS; j++)
                __asm__ volatile(".irp u,0,1,2,3\n"
                                 "vmovdqu 64*\\u(%[codes]), %%ymm9\n"
                                 "vpand %%ymm9, %[mask], %%ymm8\n"
                                 "vpsrlw $4, %%ymm9, %%ymm9\n"
                                 "vpand %%ymm9, %[mask], %%ymm9\n"
                                 ".irp r,0,1,2,3,4,5,6,7\n"
                                 ".if \\u == 0\n"
                                 "vpmaddubsw 4*\\r(%[q]), %%ymm8, %%ymm\\r\n"
                                 ".else\n"
                                 "vpmaddubsw 64*\\u+4*\\r(%[q]), %%ymm8, %%ymm10\n"
                                 "vpaddw %%ymm10, %%ymm\\r, %%ymm\\r\n"
                                 ".endif\n"
                                 "vpmaddubsw 256+64*\\u+4*\\r(%[q]), %%ymm9, %%ymm10\n"
                                 "vpaddw %%ymm10, %%ymm\\r, %%ymm\\r\n"
                                 ".endr\n"
                                 ".endr\n"
                                 ".irp r,0,1,2,3,4,5,6,7\n"
                                 "vpmaddwd %[by], %%ymm\\r, %%ymm\\r\n"
                                 "vpaddd 32*\\r(%[lo]), %%ymm\\r, %%ymm\\r\n"
                                 "vmovdqu %%ymm\\r, 32*\\r(%[lo])\n"
                                 ".endr\n"
                                 :
                                 : [codes] "r"(codes + 256 * j), [q] "r"(lines + 704 * j), [mask] "x"(mask),
                                   [by] "x"(by), [lo] "r"(lo)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                                   "xmm10", "memory");
    }
    double seconds = omp_get_wtime() - start;
    printf("%d threads: the Q4_K pass's loop alone (8 rows by 8 of a sub-block, decoded and widened): %.2f G "
           "multiplies a second a thread\n", THREADS, iterations * SUBS * 64.0 / seconds / 1e9);
}

/* Attention's float tiles on AVX2 (attention_part.h's score_tile and weigh_pass): 12 sums of vfmadd231ps, each
 * broadcast float (a query's dimension, a token's weight) feeding 2 of them, against the same multiply-adds with
 * their operands in registers, and with a broadcast each. Whether a CPU spends its multiply-add slots on
 * broadcasts from memory, as the Zen 3 did on vpbroadcastd beside vpmaddubsw. */
static void float_tiles(void) {
    static float weights[64] __attribute__((aligned(64)));
    const char *names[3] = {"operands in registers", "a broadcast for two (attention's tiles)", "a broadcast each"};
#define F2(A, B, X) "vfmadd231ps %%ymm12, %%ymm" #X ", %%ymm" #A "\n vfmadd231ps %%ymm13, %%ymm" #X ", %%ymm" #B "\n"
#define BC(AT) "vbroadcastss " #AT "(%0), %%ymm14\n"
#define F1(A, AT) "vbroadcastss " #AT "(%0), %%ymm14\n vfmadd231ps %%ymm12, %%ymm14, %%ymm" #A "\n"
    for (int shape = 0; shape < 3; shape++) {
        double start = omp_get_wtime();
#pragma omp parallel num_threads(THREADS)
        for (long it = 0; it < ITERATIONS / 10; it++) {
            if (shape == 0)
                __asm__ volatile(F2(0, 1, 15) F2(2, 3, 15) F2(4, 5, 15) F2(6, 7, 15) F2(8, 9, 15) F2(10, 11, 15)::"r"(
                                     weights)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                                   "xmm10", "xmm11");
            else if (shape == 1)
                __asm__ volatile(BC(0) F2(0, 1, 14) BC(4) F2(2, 3, 14) BC(8) F2(4, 5, 14) BC(12) F2(6, 7, 14) BC(16)
                                     F2(8, 9, 14) BC(20) F2(10, 11, 14)::"r"(weights)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                                   "xmm10", "xmm11", "xmm14", "memory");
            else
                __asm__ volatile(F1(0, 0) F1(1, 4) F1(2, 8) F1(3, 12) F1(4, 16) F1(5, 20) F1(6, 24) F1(7, 28)
                                     F1(8, 32) F1(9, 36) F1(10, 40) F1(11, 44)::"r"(weights)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                                   "xmm10", "xmm11", "xmm14", "memory");
        }
        double seconds = omp_get_wtime() - start;
        printf("%d threads: vfmadd231ps into 12 sums, %s: %.2f G a second a thread\n", THREADS, names[shape],
               12 * (ITERATIONS / 10) / seconds / 1e9);
    }
}

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
    static int quads[64] __attribute__((aligned(64)));
/* a multiply of weight register W by activations B added to row R's 16-bit sums (ymm0-7), in asm: GCC's own
 * allocation spilled the sums */
#define MUL(R, W, B) "vpmaddubsw %%ymm" #B ", %%ymm" #W ", %%ymm15\n vpaddw %%ymm15, %%ymm" #R ", %%ymm" #R "\n"
#define CAST(B, AT) "vpbroadcastd " #AT "(%0), %%ymm" #B "\n"
/* four quads loaded into both halves of ymm14 at once, then each spread over the register by a shuffle */
#define LOAD4(AT) "vbroadcasti128 " #AT "(%0), %%ymm14\n"
#define SPREAD(B, IMM) "vpshufd $" #IMM ", %%ymm14, %%ymm" #B "\n"
/* the multiply's signed operand read from memory: a quad stored broadcast, with no shuffle at all */
#define MUL_AT(R, W, AT) "vpmaddubsw " #AT "(%0), %%ymm" #W ", %%ymm15\n vpaddw %%ymm15, %%ymm" #R ", %%ymm" #R "\n"
    const char *names[6] = {"no broadcast", "a broadcast each", "a broadcast for two (two weights)",
                            "a shuffle each, 16 bytes loaded for four", "each read whole, stored broadcast",
                            "each read rotated, 4k bytes into a line"};
    for (int shape = 0; shape < 6; shape++) {
        start = omp_get_wtime();
#pragma omp parallel num_threads(THREADS)
        for (long it = 0; it < ITERATIONS / 10; it++) {
            if (shape == 0)
                __asm__ volatile(MUL(0, 8, 9) MUL(1, 8, 10) MUL(2, 8, 11) MUL(3, 8, 12) MUL(4, 8, 9) MUL(5, 8, 10)
                                 MUL(6, 8, 11) MUL(7, 8, 12)::"r"(quads)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm15");
            else if (shape == 1)
                __asm__ volatile(CAST(9, 0) MUL(0, 8, 9) CAST(10, 4) MUL(1, 8, 10) CAST(11, 8) MUL(2, 8, 11)
                                 CAST(12, 12) MUL(3, 8, 12) CAST(9, 16) MUL(4, 8, 9) CAST(10, 20) MUL(5, 8, 10)
                                 CAST(11, 24) MUL(6, 8, 11) CAST(12, 28) MUL(7, 8, 12)::"r"(quads)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm9", "xmm10",
                                   "xmm11", "xmm12", "xmm15", "memory");
            else if (shape == 4)
                __asm__ volatile(MUL_AT(0, 8, 0) MUL_AT(1, 8, 32) MUL_AT(2, 8, 64) MUL_AT(3, 8, 96) MUL_AT(4, 8, 128)
                                 MUL_AT(5, 8, 160) MUL_AT(6, 8, 192) MUL_AT(7, 8, 224)::"r"(quads)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm15", "memory");
            else if (shape == 5)
                __asm__ volatile(MUL_AT(0, 8, 0) MUL_AT(1, 8, 4) MUL_AT(2, 8, 8) MUL_AT(3, 8, 12) MUL_AT(4, 8, 16)
                                 MUL_AT(5, 8, 20) MUL_AT(6, 8, 24) MUL_AT(7, 8, 28)::"r"(quads)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm15", "memory");
            else if (shape == 3)
                __asm__ volatile(LOAD4(0) SPREAD(9, 0x00) MUL(0, 8, 9) SPREAD(10, 0x55) MUL(1, 8, 10) SPREAD(11, 0xAA)
                                 MUL(2, 8, 11) SPREAD(12, 0xFF) MUL(3, 8, 12) LOAD4(16) SPREAD(9, 0x00) MUL(4, 8, 9)
                                 SPREAD(10, 0x55) MUL(5, 8, 10) SPREAD(11, 0xAA) MUL(6, 8, 11) SPREAD(12, 0xFF)
                                 MUL(7, 8, 12)::"r"(quads)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm9", "xmm10",
                                   "xmm11", "xmm12", "xmm14", "xmm15", "memory");
            else
                __asm__ volatile(CAST(9, 0) MUL(0, 8, 9) MUL(1, 13, 9) CAST(10, 4) MUL(2, 8, 10) MUL(3, 13, 10)
                                 CAST(11, 8) MUL(4, 8, 11) MUL(5, 13, 11) CAST(12, 12) MUL(6, 8, 12) MUL(7, 13, 12)::"r"(quads)
                                 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm9", "xmm10",
                                   "xmm11", "xmm12", "xmm15", "memory");
        }
        seconds = omp_get_wtime() - start;
        printf("%d threads: vpmaddubsw + vpaddw into 8 sums, %s: %.2f G multiplies a second a thread\n", THREADS,
               names[shape], 8 * (ITERATIONS / 10) / seconds / 1e9);
    }
    q4_k_loop();
    float_tiles();
    return 0;
}
