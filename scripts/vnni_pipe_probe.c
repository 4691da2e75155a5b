/* What a K-quant sub-block's row costs the multiply pipes with AVX-512 VNNI (quant_simd.h's dot_rows): 8 vpdpbusd
 * of a row (an activation quad broadcast from memory each, two chains of 4), then its two half sums scaled into the
 * row's sum in one of seven ways, for 8 rows a round. Prints vpdpbusd a second a core: where what follows
 * them takes a multiply pipe's slot, fewer. On an AMD EPYC Zen 4 (2026-12-04): nothing after them 3.53-3.67 G (one
 * a cycle), two vpdpwssd 2.86-2.93, the halves paired by vpermt2w and one vpdpwssd 3.15-3.25 (as one vpaddd and one
 * vpdpwssd: the shuffle takes no multiply slot), paired by a shift and a blend 2.84-3.01, two vpmulld (Q6_K's halves,
 * which do not fit 16 bits) 2.83-2.90: a slot each, as a vpdpwssd; a 32-input block's float scaling (Q4_0's: the
 * sum converted, the scales' product, a multiply-add) 2.86-2.93, two slots, the conversion alone taking none (3.60-3.66).
 * Kept out of CI:
 *
 *     gcc -O2 -mavx512f -mavx512bw -mavx512vnni scripts/vnni_pipe_probe.c -o /tmp/vnni_pipes && taskset -c 1 /tmp/vnni_pipes
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ROUNDS 20000000L
#define ASM __asm__ volatile

static int quads[64] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* row R: its two chains a and b over the sub-block's 8 weight registers, then SCALE(R) */
#define DOT(R, acc, w, i) ASM("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(quads[8 * (R) + (i)]), "v"(w));
#define ROW(R, SCALE)                                                                                               \
    {                                                                                                               \
        __m512i a, b;                                                                                               \
        ASM("vpxord %0, %0, %0" : "=v"(a));                                                                         \
        ASM("vpxord %0, %0, %0" : "=v"(b));                                                                         \
        DOT(R, a, w[0], 0) DOT(R, a, w[1], 1) DOT(R, a, w[2], 2) DOT(R, a, w[3], 3)                                 \
        DOT(R, b, w[4], 4) DOT(R, b, w[5], 5) DOT(R, b, w[6], 6) DOT(R, b, w[7], 7) SCALE(R)                        \
    }
#define NOTHING(R) ASM("vpaddd %1, %0, %0" : "+v"(a) : "v"(b)); ASM("vpaddd %1, %0, %0" : "+v"(sum[R]) : "v"(a));
#define TWO_DPWSSD(R)                                                                                               \
    ASM("vpdpwssd %1, %2, %0" : "+v"(sum[R]) : "v"(a), "v"(scale));                                                 \
    ASM("vpdpwssd %1, %2, %0" : "+v"(sum[R]) : "v"(b), "v"(scale));
#define PAIRED_BY_SHUFFLE(R)                                                                                        \
    ASM("vpermt2w %1, %2, %0" : "+v"(a) : "v"(words), "v"(b));                                                      \
    ASM("vpdpwssd %1, %2, %0" : "+v"(sum[R]) : "v"(a), "v"(scale));
#define PAIRED_BY_BLEND(R)                                                                                          \
    ASM("vpslld $16, %0, %0" : "+v"(b));                                                                            \
    ASM("vpblendmw %1, %0, %0%{%%k1%}" : "+v"(a) : "v"(b));                                                         \
    ASM("vpdpwssd %1, %2, %0" : "+v"(sum[R]) : "v"(a), "v"(scale));
#define TWO_PMULLD(R)                                                                                               \
    ASM("vpmulld %1, %0, %0" : "+v"(a) : "v"(scale));                                                               \
    ASM("vpmulld %1, %0, %0" : "+v"(b) : "v"(scale));                                                               \
    ASM("vpaddd %1, %0, %0" : "+v"(a) : "v"(b));                                                                    \
    ASM("vpaddd %1, %0, %0" : "+v"(sum[R]) : "v"(a));
/* a 32-input format's row and block (Q4_0): its sum converted, the two scales' product, a multiply-add */
#define FLOATS(R)                                                                                                   \
    ASM("vpaddd %1, %0, %0" : "+v"(a) : "v"(b));                                                                    \
    ASM("vcvtdq2ps %0, %0" : "+v"(a));                                                                              \
    ASM("vmulps %1, %2, %0" : "=v"(b) : "v"(scale), "v"(scale));                                                    \
    ASM("vfmadd231ps %1, %2, %0" : "+v"(sum[R]) : "v"(a), "v"(b));
#define CONVERSION(R)                                                                                               \
    ASM("vpaddd %1, %0, %0" : "+v"(a) : "v"(b));                                                                    \
    ASM("vcvtdq2ps %0, %0" : "+v"(a));                                                                              \
    ASM("vpaddd %1, %0, %0" : "+v"(sum[R]) : "v"(a));
#define RUN(NAME, SCALE)                                                                                            \
    start = now();                                                                                                  \
    for (long i = 0; i < ROUNDS; i++) {                                                                             \
        ROW(0, SCALE) ROW(1, SCALE) ROW(2, SCALE) ROW(3, SCALE) ROW(4, SCALE) ROW(5, SCALE) ROW(6, SCALE)           \
        ROW(7, SCALE)                                                                                               \
    }                                                                                                               \
    printf("%-45s %.2f G vpdpbusd a second\n", NAME, 64.0 * ROUNDS / (now() - start) / 1e9);

int main(void) {
    __m512i w[8], sum[8], scale = _mm512_set1_epi32(0x00030003);
    /* vpermt2w's words: lane i's low word from a, its high word from b (index 32 on) */
    __m512i words = _mm512_set_epi16(62, 30, 60, 28, 58, 26, 56, 24, 54, 22, 52, 20, 50, 18, 48, 16, 46, 14, 44, 12,
                                     42, 10, 40, 8, 38, 6, 36, 4, 34, 2, 32, 0);
    for (int i = 0; i < 8; i++) w[i] = _mm512_set1_epi8((char)(i + 1)), sum[i] = _mm512_setzero_si512();
    for (int i = 0; i < 64; i++) quads[i] = i;
    ASM("kmovd %0, %%k1" ::"r"(0xAAAAAAAA) : "k1");
    double start;
    RUN("nothing after them (a vpaddd, twice)", NOTHING)
    RUN("two vpdpwssd", TWO_DPWSSD)
    RUN("paired by vpermt2w, one vpdpwssd", PAIRED_BY_SHUFFLE)
    RUN("paired by vpslld and vpblendmw, one vpdpwssd", PAIRED_BY_BLEND)
    RUN("two vpmulld", TWO_PMULLD)
    RUN("converted, scaled and added in float32", FLOATS)
    RUN("converted alone", CONVERSION)
    int out[16];
    __m512i all = sum[0];
    for (int i = 1; i < 8; i++) all = _mm512_add_epi32(all, sum[i]);
    _mm512_storeu_si512(out, all);
    return out[0] == 42; /* the sums are used: nothing above is dead */
}
