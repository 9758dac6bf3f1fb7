/* Magnitude's CPU kernels for low-bit weights (built and loaded by lowbit.py).

   A decode step multiplies a few activation rows by every weight once, so its cost is decoding
   the weights, not the arithmetic: these kernels unpack each weight block once and apply it to up
   to 8 activation rows in fp32 (torch's int4/int8 CPU kernels decode the weights again for every
   row and round activations to bf16 on their fast path). More rows go through in passes of 8.

   Layouts (row-major, n = output channel, k = input channel):
   - int4: codes [n][k/2] bytes; per group of 32 inputs 16 bytes, low nibbles are inputs 0..15 and
     high nibbles 16..31 (GGUF Q4_1's order); w = code * scale[n][k/32] + min[n][k/32].
   - int8: codes [n][k] signed bytes; w = code * scale[n].
   - int8g: codes [n][k] signed bytes; w = code * scale[n][k/32] (GGUF Q8_0's blocks: a token
     embedding stored as Q8_0 and tied to the LM head is multiplied exactly as stored).
   k is a multiple of 32 for all (lowbit.py's wrappers and fused_decode.py check).
   - bf16 (the fused step of a bfloat16 model only): w [n][k] bf16, any k; widened to fp32 exactly.

   int4 weights also multiply int8 activations (w4a8, GGUF's Q4_1 x Q8_1 dot product): each row is
   quantized per group of 32 inputs, q = round(x * (1 / d)) with d = max|x| / 127, and a group's product is
   scale * d * sum(code * q) + min * d * sum(q), the integer sums exact (AVX2: maddubs/madd). No
   fp32 conversion of the weights, so a step reads them at near memory speed where the fp32 path
   is bound by converting them (30 layers at one row: 7.3-7.9 ms against 12.5-12.8 ms, two EPYC
   cores, a C harness over these functions). w4a16-int16's decode rows take the same products with
   int16 activations (d = max|x| / 32767, `pmaddwd`), its prompt rows w4a16's fp32 products, and
   its LM head (int8g codes) every row in int16.

   Threads: OpenMP,
   the runtime torch already loaded (gcc's libgomp), so the pools are shared. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS_PER_PASS 8
/* How far ahead (in output channels) the one- and two-row passes ask for the codes they will read:
   the hardware prefetcher alone leaves a batch-1 step waiting on memory. 30 layers' int4 products
   at one row over distinct weights (66 MB, as a step reads them): 8.3-8.9 ms against 8.8-10.3
   without, four alternating runs each, 2 AVX2 EPYC cores; no gain at 2 or 8 rows, and asking in
   the 8-row pass measured slower (`bench/lowbit_bench.py --cold` times the same step through torch,
   noisier). */
#ifndef PREFETCH_CHANNELS
#define PREFETCH_CHANNELS 8
#endif

const char *magnitude_lowbit_isa(void) {
#if defined(__AVX512F__) && defined(__AVX2__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "generic";
#endif
}

typedef void (*rows_fn)(const float *x, int m, int64_t k, const void *codes, const float *scales,
                        const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1);

/* This thread's number and its team's size (0 and 1 without OpenMP). */
static void team(int *t, int *nt) {
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *nt = omp_get_num_threads();
#else
    *t = 0;
    *nt = 1;
#endif
}

/* Thread t's share [a, b) of n output channels, in multiples of 8 (whole AVX2 vectors of output). */
static void share(int64_t n, int t, int nt, int64_t *a, int64_t *b) {
    int64_t per = ((n + nt - 1) / nt + 7) / 8 * 8;
    *a = t * per < n ? t * per : n;
    *b = *a + per < n ? *a + per : n;
}

/* Splits output channels over the threads; each thread runs `fn` on its share for all m rows. */
static void split_rows(rows_fn fn, const float *x, int64_t m, int64_t k, int64_t n, const void *codes,
                       const float *scales, const float *mins, float *y, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int t, nt;
        int64_t a, b;
        team(&t, &nt);
        share(n, t, nt, &a, &b);
        if (a < b) fn(x, (int)m, k, codes, scales, mins, y, n, a, b);  /* fn takes the rows in passes */
    }
}


/* The minimums' share of a channel's product with one row: sum over groups of min * d * sum(q). */
static inline float min_term(const float *mins, const float *s, int64_t groups) {
    float t = 0.f;
    for (int64_t g = 0; g < groups; g++) t += mins[g] * s[g];
    return t;
}

#ifdef __AVX2__
static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

/* One group of 32 activations as integers for the w4a8 (largest 127: int8) and w4a16-int16
   (largest 32767: int16) products: q = round-half-even(x * (1 / d)) with d = max|x| / largest (0
   for a group that is zero, or so small that 1 / d would overflow: d < FLT_MIN), in q[j] (int32,
   inputs in order), and s = d * sum(q). A non-finite input makes the group's d and s NaN (its q 0:
   rounding it would be undefined), so the products carry it on as fp32's would.
   The AVX2 and portable code compute the same figures (max and integer sums do not depend on
   order; the conversion rounds to nearest even as lrintf does), and so do lowbit.py's
   `q8_activations` and `q16_activations`. */
static void quantize_group(const float *xg, float largest, int32_t q[32], float *dg, float *sg) {
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(FLT_MAX);
    __m256 v[4], amax = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(xg + 8 * j);
        const __m256 a = _mm256_andnot_ps(sign, v[j]);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, top, _CMP_LE_OQ));  /* false for NaN, inf */
        amax = _mm256_max_ps(amax, a);
    }
    if (finite != 0xFF) {
        memset(q, 0, 32 * sizeof(int32_t));
        *dg = *sg = NAN;
        return;
    }
    /* a group below FLT_MIN * largest counts as zero: 1 / d would overflow */
    const float d0 = hmax(amax) / largest, d = d0 >= FLT_MIN ? d0 : 0.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i iv = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
        _mm256_storeu_si256((__m256i *)(q + 8 * j), iv);
        sum = _mm256_add_epi32(sum, iv);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *dg = d;
    *sg = d * (float)_mm_cvtsi128_si32(s4);
#else
    float amax = 0.f;
    int finite = 1;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(xg[j]);
        finite &= a <= FLT_MAX;
        amax = a > amax ? a : amax;
    }
    if (!finite) {
        memset(q, 0, 32 * sizeof(int32_t));
        *dg = *sg = NAN;
        return;
    }
    const float d0 = amax / largest, d = d0 >= FLT_MIN ? d0 : 0.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; j++) {
        q[j] = (int32_t)lrintf(xg[j] * inv);
        sum += q[j];
    }
    *dg = d;
    *sg = d * (float)sum;
#endif
}

/* Rows x [m][k] (row stride ldx) as integers per group (quantize_group): int8 (bits 8) or int16
   (bits 16) q [m][k], d and s [m][k/32]. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int bits, void *q, float *d, float *s) {
    const int64_t G = k / 32;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < G; g++) {
            int32_t qg[32];
            const int64_t at = r * k + g * 32;
            quantize_group(x + r * ldx + g * 32, bits == 16 ? 32767.f : 127.f, qg, d + r * G + g, s + r * G + g);
            if (bits == 16)
                for (int j = 0; j < 32; j++) ((int16_t *)q)[at + j] = (int16_t)qg[j];
            else
                for (int j = 0; j < 32; j++) ((int8_t *)q)[at + j] = (int8_t)qg[j];
        }
}


#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

/* The vector the fp32-weight passes below work in: 16 lanes where the compiler targets AVX-512
   (`-march=native` on such a CPU), 8 otherwise. A group of 32 weights is VECS vectors. Where the
   CPU decodes 512-bit operations at full width, a one-row int4 product converts twice the weights
   per instruction, and that conversion, not memory, bounds it. Results differ between the two widths
   in the last bits (another summation order), never between batches or thread counts on one CPU. */
#ifdef __AVX512F__
typedef __m512 vecf;
#define VECS 2
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VSET1(v) _mm512_set1_ps(v)
#define VSUM(v) _mm512_reduce_add_ps(v)
/* 16 bytes -> 16 fp32 (unsigned / signed) */
#define U8_TO_F32(b) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
#define S8_TO_F32(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#else
typedef __m256 vecf;
#define VECS 4
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VSET1(v) _mm256_set1_ps(v)
#define VSUM(v) hsum(v)
#define S8_TO_F32(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif
#define VLANES (32 / VECS)

/* Channels [n0, n1) for exactly M activation rows, NB channels at a time. Every row's sum is
   formed in the same order whatever M and NB are (one accumulator, the group's VECS vectors in
   turn), so a row's result does not depend on which rows share its batch; NB independent channels
   keep the FMA units busy when M is small. */
#define DEFINE_PASS(NAME, M, NB, DECODE, SCALE_END)                                                \
static void NAME##_##M##_##NB(const float *x, int64_t k, const void *codes_, const float *scales, \
                              const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) {  \
    (void)mins;                                                                                    \
    enum { PASS_ROWS = M };  /* for DECODE */                                                      \
    int64_t n = n0;                                                                                \
    for (; n + NB <= n1; n += NB) {                                                                \
        vecf acc[M][NB];                                                                           \
        for (int r = 0; r < M; r++)                                                                \
            for (int q = 0; q < NB; q++) acc[r][q] = VZERO();                          \
        for (int64_t g = 0; g < k / 32; g++) {                                                     \
            const float *xg = x + g * 32;                                                          \
            for (int q = 0; q < NB; q++) {                                                         \
                vecf w[VECS];                                                                      \
                const int64_t ch = n + q;                                                          \
                DECODE                                                                             \
                for (int r = 0; r < M; r++)                                                        \
                    for (int j = 0; j < VECS; j++)                                                 \
                        acc[r][q] = VFMA(w[j], VLOAD(xg + r * k + VLANES * j), acc[r][q]);         \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < M; r++)                                                                \
            for (int q = 0; q < NB; q++) {                                                         \
                const int64_t ch = n + q;                                                          \
                y[r * ldy + ch] = VSUM(acc[r][q]) SCALE_END;                                       \
            }                                                                                      \
    }                                                                                              \
    if (n < n1 && NB > 1) NAME##_##M##_1(x, k, codes_, scales, mins, y, ldy, n, n1);              \
}

/* A group's nibbles lo (inputs 0..15) and hi (16..31) as weights, code * scale + min. */
#ifdef __AVX512F__
#define DEQUANT_NIBBLES                                                                            \
    w[0] = VFMA(U8_TO_F32(lo), sc, mi);                                                            \
    w[1] = VFMA(U8_TO_F32(hi), sc, mi);
#else
#define DEQUANT_NIBBLES                                                                            \
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sc, mi);                  \
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sc, mi); \
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sc, mi);                  \
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sc, mi);
#endif

/* 16 bytes of nibbles -> 32 weights, dequantized with the group's scale and minimum. */
#define DECODE_INT4                                                                                \
    const uint8_t *c = (const uint8_t *)codes_ + ch * (k / 2) + g * 16;                             \
    if (PASS_ROWS <= 2 && ch + PREFETCH_CHANNELS < n1) {                                                   \
        _mm_prefetch((const char *)(c + PREFETCH_CHANNELS * (k / 2)), _MM_HINT_T0);                \
        if (!(g & 15)) {                                                                           \
            _mm_prefetch((const char *)(scales + (ch + PREFETCH_CHANNELS) * (k / 32) + g), _MM_HINT_T0); \
            _mm_prefetch((const char *)(mins + (ch + PREFETCH_CHANNELS) * (k / 32) + g), _MM_HINT_T0); \
        }                                                                                          \
    }                                                                                              \
    const __m128i mask = _mm_set1_epi8(0x0F);                                                      \
    __m128i b = _mm_loadu_si128((const __m128i *)c);                                               \
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);           \
    const vecf sc = VSET1(scales[ch * (k / 32) + g]), mi = VSET1(mins[ch * (k / 32) + g]);        \
    DEQUANT_NIBBLES

/* 32 signed bytes -> 32 weights; the channel's scale is applied once, to the sum. */
#define DECODE_INT8                                                                                \
    const int8_t *c = (const int8_t *)codes_ + ch * k + g * 32;                                     \
    if (PASS_ROWS <= 2 && ch + PREFETCH_CHANNELS < n1) _mm_prefetch((const char *)(c + PREFETCH_CHANNELS * k), _MM_HINT_T0); \
    for (int j = 0; j < VECS; j++) w[j] = S8_TO_F32(c + VLANES * j);

/* 32 signed bytes -> 32 weights times their group's scale (each product exact in fp32). */
#define DECODE_INT8G                                                                               \
    const int8_t *c = (const int8_t *)codes_ + ch * k + g * 32;                                     \
    if (PASS_ROWS <= 2 && ch + PREFETCH_CHANNELS < n1) _mm_prefetch((const char *)(c + PREFETCH_CHANNELS * k), _MM_HINT_T0); \
    const vecf sc = VSET1(scales[ch * (k / 32) + g]);                                               \
    for (int j = 0; j < VECS; j++) w[j] = VMUL(S8_TO_F32(c + VLANES * j), sc);

DEFINE_PASS(int4_pass, 1, 1, DECODE_INT4, )
DEFINE_PASS(int4_pass, 1, 4, DECODE_INT4, )
DEFINE_PASS(int4_pass, 2, 1, DECODE_INT4, )
DEFINE_PASS(int4_pass, 2, 2, DECODE_INT4, )
DEFINE_PASS(int4_pass, 4, 1, DECODE_INT4, )
DEFINE_PASS(int4_pass, 8, 1, DECODE_INT4, )
DEFINE_PASS(int4_pass, 8, 2, DECODE_INT4, )
DEFINE_PASS(int4_pass, 4, 2, DECODE_INT4, )
DEFINE_PASS(int8_pass, 1, 1, DECODE_INT8, * scales[ch])
DEFINE_PASS(int8_pass, 2, 1, DECODE_INT8, * scales[ch])
DEFINE_PASS(int8_pass, 4, 1, DECODE_INT8, * scales[ch])
DEFINE_PASS(int8_pass, 8, 1, DECODE_INT8, * scales[ch])
DEFINE_PASS(int8g_pass, 1, 1, DECODE_INT8G, )
DEFINE_PASS(int8g_pass, 2, 1, DECODE_INT8G, )
DEFINE_PASS(int8g_pass, 4, 1, DECODE_INT8G, )
DEFINE_PASS(int8g_pass, 8, 1, DECODE_INT8G, )

/* Up to 8 rows as passes of 8, 4, 2 and 1 (each pass re-reads the weights, from cache; on AVX2
   BLOCKED_ROWS, below, gives 8 rows to the tiles instead). NB1, NB2,
   NB4 and NB8: channels at a time for one, two, four and eight rows, measured per layout
   (bench/lowbit_bench.py): int4 gains from four channels in flight at one row, the int8 LM head
   loses (its rows stream from memory). With 8 rows and 2 channels each activation vector loaded
   serves two products: 8 rows of a 1,536-input down projection (48 KiB) do not stay in a 32 KiB
   L1, and one channel at a time re-read them from L2 for every channel (AVX-512, Zen 4, 2
   threads: that projection 0.67x of the time at 8-64 rows, a layer's four 0.88x, same bits).
   With AVX2's 16 vector registers the 16 accumulators of 8 x 2 spill (1.2-1.3x slower there), and
   4 rows x 2 channels is what fits (a layer at 4 rows 0.87x). */
#define DEFINE_ROWS(NAME, NB1, NB2, NB4, NB8)                                                      \
static void NAME##_rows(const float *x, int m, int64_t k, const void *codes, const float *scales, \
                        const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) {        \
    while (m > 0) {                                                                                \
        int step = m >= 8 ? 8 : m >= 4 ? 4 : m >= 2 ? 2 : 1;                                       \
        if (step == 8) NAME##_pass_8_##NB8(x, k, codes, scales, mins, y, ldy, n0, n1);             \
        else if (step == 4) NAME##_pass_4_##NB4(x, k, codes, scales, mins, y, ldy, n0, n1);        \
        else if (step == 2) NAME##_pass_2_##NB2(x, k, codes, scales, mins, y, ldy, n0, n1);        \
        else NAME##_pass_1_##NB1(x, k, codes, scales, mins, y, ldy, n0, n1);                       \
        x += step * k;                                                                             \
        y += step * ldy;                                                                           \
        m -= step;                                                                                 \
    }                                                                                              \
}
#ifndef INT4_NB8  /* -DINT4_NB8=.. -DINT4_NB4=.. (both) override them, for measuring */
#ifdef __AVX512F__
#define INT4_NB8 2
#define INT4_NB4 1
#else
#define INT4_NB8 1
#define INT4_NB4 2
#endif
#endif
/* One level of indirection: DEFINE_ROWS pastes its arguments, so INT4_NB4/INT4_NB8 are expanded here first. */
#define INT4_ROWS(NB4, NB8) DEFINE_ROWS(int4, 4, 2, NB4, NB8)
INT4_ROWS(INT4_NB4, INT4_NB8)
DEFINE_ROWS(int8, 1, 1, 1, 1)
DEFINE_ROWS(int8g, 1, 1, 1, 1)

/* Many rows at once (a prompt chunk's; the LM head's rows when many sequences decode): the passes
   above turn every weight into fp32 again for each pass of up to 8 rows, and at 8 rows that
   conversion and the activations' loads are as many instructions as the multiply-adds (the int8
   head's 28 MB are also read from memory again by every pass). Here, for each layout (int4, int8,
   int8g), each channel's weights are converted once for up to
   TILE_ROWS rows, TILE_KC inputs at a time, into a small fp32 block, and register tiles of TILE_R
   rows x TILE_C channels multiply it (TILE_R + TILE_C loads for TILE_R x TILE_C multiply-adds).
   Every (row, channel) sum is the passes' own: one VLANES-lane accumulator taking the inputs in
   order (lane l the inputs l, l + VLANES, ...), the weights converted by the same DECODE, then VSUM
   (and the channel's scale, int8). Between input blocks the accumulators wait in memory, which does
   not round them; the first block's tiles start them at zero in registers (`fresh`) rather than
   reading a cleared block (64 rows x 6 channels: 12 KiB cleared for each 6 channels, 1.4% of a
   24-request burst's samples in memset, perf, AVX2 EPYC). So the result is bit for bit the
   passes', and a row's result still depends on nothing but its own input. */
#ifndef TILE_R  /* -DTILE_R=.. -DTILE_C=.. (both), -DTILE_KC, -DTILE_ROWS override them, for measuring */
#ifdef __AVX512F__
#define TILE_R 4  /* 24 accumulators + 4 rows + 1 weight vector of AVX-512's 32 registers */
#define TILE_C 6
#else
#define TILE_R 2  /* 12 accumulators + 2 rows + 1 weight vector: AVX2's 16 registers */
#define TILE_C 6
#endif
#endif
#ifndef TILE_KC
#define TILE_KC 512  /* inputs per converted block (TILE_C x 512 fp32: 12 KiB) */
#endif
#ifndef TILE_ROWS
#define TILE_ROWS 64
#endif
/* Blocked where the passes would take more than one pass over the weights (3, 5, 6, 7 or more than
   8 rows) and, on AVX2, at 8 rows too. 1, 2 and 4 rows are one pass, which reads each weight once
   as well (AVX2, 4 rows: the tiles 1.02-1.05x the pass's time, the int8 head 1.16x; 2 rows: the
   four int4 shapes 0.95x in the harness, but whole 2-decode steps 1.04-1.08x, the head included).
   AVX2's 8-row pass loads every activation vector for each multiply-add (32 loads and 32 FMAs a
   group), where the tiles load R + C vectors for R x C: there the four int4 shapes took 0.78x the
   pass's time and the head 0.86x, same bits (2026-12-06, AVX2 EPYC, a C harness timing both paths
   over the same operands, 1 and 2 threads). AVX-512's 8-row pass (two channels in flight, 32
   registers) was measured as fast or faster in whole decode steps (bench/kernel_ab.py
   --decode-batches) and keeps it. */
#ifndef BLOCKED_ROWS
#ifdef __AVX512F__
#define BLOCKED_ROWS(m) ((m) > ROWS_PER_PASS || ((m) > 2 && ((m) & ((m) - 1))))
#else
#define BLOCKED_ROWS(m) ((m) > 4 || (m) == 3)
#endif
#endif

/* With AVX2's 16 registers (a 2 x 6 tile's 12 accumulators, 2 rows, 1 weight vector) compilers
   fold the weight vector's load into each of the R multiply-adds as a memory operand: 14 loads for
   12 FMAs, and the load ports, not the FMAs, set the pace. An empty asm that takes and gives the
   vector back keeps it in a register: R + C loads. The multiply-adds and their order are the
   same, so are the bits. (AVX-512's 32 registers: compilers keep it there already.) The four int4
   shapes at 16-64 rows took 0.78-0.89x the time without it (bench/int4_product_ab.py, 2026-12-06,
   AVX2 EPYC). */
#ifdef __AVX512F__
#define IN_REGISTER(v) ((void)0)
#else
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#endif
#define DEFINE_TILE(R, C)                                                                          \
static void tile_##R##_##C(const float *x, int64_t k, const float *w, int64_t kc, vecf *acc, int fresh) { \
    vecf a[R][C];                                                                                  \
    for (int r = 0; r < R; r++)                                                                    \
        for (int c = 0; c < C; c++) a[r][c] = fresh ? VZERO() : acc[r * TILE_C + c];               \
    for (int64_t v = 0; v < kc; v += VLANES) {                                                     \
        vecf xr[R];                                                                                \
        for (int r = 0; r < R; r++) xr[r] = VLOAD(x + r * k + v);                                  \
        for (int c = 0; c < C; c++) {                                                              \
            vecf wc = VLOAD(w + c * TILE_KC + v);                                                  \
            IN_REGISTER(wc);                                                                       \
            for (int r = 0; r < R; r++) a[r][c] = VFMA(wc, xr[r], a[r][c]);                        \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++)                                                                    \
        for (int c = 0; c < C; c++) acc[r * TILE_C + c] = a[r][c];                                 \
}
#define DEFINE_TILES_R(R) DEFINE_TILE(R, 1) DEFINE_TILE(R, 2) DEFINE_TILE(R, 3) DEFINE_TILE(R, 4) \
    DEFINE_TILE(R, 5) DEFINE_TILE(R, 6)
#define TILES_R(R) {tile_##R##_1, tile_##R##_2, tile_##R##_3, tile_##R##_4, tile_##R##_5, tile_##R##_6}
DEFINE_TILES_R(1)
DEFINE_TILES_R(2)
DEFINE_TILES_R(3)
DEFINE_TILES_R(4)
typedef void (*tile_fn)(const float *x, int64_t k, const float *w, int64_t kc, vecf *acc, int fresh);
static tile_fn const tiles[4][6] = {TILES_R(1), TILES_R(2), TILES_R(3), TILES_R(4)};
_Static_assert(TILE_R <= 4 && TILE_C <= 6, "tiles holds tiles of up to 4 x 6");
_Static_assert(TILE_KC % 32 == 0, "a converted block is whole groups");

#define DEFINE_BLOCKED(NAME, DECODE, SCALE_END)                                                    \
static void NAME##_blocked_rows(const float *x, int m, int64_t k, const void *codes_, const float *scales, \
                                const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) { \
    (void)mins;                                                                                    \
    enum { PASS_ROWS = TILE_ROWS };  /* DECODE's prefetch is the narrow passes' */                 \
    float wbuf[TILE_C * TILE_KC] __attribute__((aligned(64)));                                     \
    vecf acc[TILE_ROWS * TILE_C];                                                                  \
    for (int r0 = 0; r0 < m; r0 += TILE_ROWS) {                                                    \
        const int rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;                                  \
        const float *xr = x + (int64_t)r0 * k;                                                     \
        for (int64_t n = n0; n < n1; n += TILE_C) {                                                \
            const int C = n1 - n < TILE_C ? (int)(n1 - n) : TILE_C;                                \
            for (int64_t k0 = 0; k0 < k; k0 += TILE_KC) {                                          \
                const int64_t kc = k - k0 < TILE_KC ? k - k0 : TILE_KC;                            \
                for (int q = 0; q < C; q++) {                                                      \
                    const int64_t ch = n + q;                                                      \
                    for (int64_t g = k0 / 32; g < (k0 + kc) / 32; g++) {                           \
                        vecf w[VECS];                                                              \
                        DECODE                                                                     \
                        for (int j = 0; j < VECS; j++)                                             \
                            VSTORE(wbuf + q * TILE_KC + (g * 32 - k0) + VLANES * j, w[j]);         \
                    }                                                                              \
                }                                                                                  \
                for (int rr = 0; rr < rows; rr += TILE_R) {                                        \
                    const int R = rows - rr < TILE_R ? rows - rr : TILE_R;                         \
                    tiles[R - 1][C - 1](xr + (int64_t)rr * k + k0, k, wbuf, kc, acc + rr * TILE_C, k0 == 0); \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < rows; r++)                                                         \
                for (int q = 0; q < C; q++) {                                                      \
                    const int64_t ch = n + q;                                                      \
                    y[(int64_t)(r0 + r) * ldy + ch] = VSUM(acc[r * TILE_C + q]) SCALE_END;         \
                }                                                                                  \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
/* x [m][k] @ W^T for channels [n0, n1): rows blocked or through the passes (BLOCKED_ROWS); the   \
   same bits either way. */                                                                        \
static void NAME##_product_rows(const float *x, int m, int64_t k, const void *codes, const float *scales, \
                                const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) { \
    if (BLOCKED_ROWS(m)) NAME##_blocked_rows(x, m, k, codes, scales, mins, y, ldy, n0, n1);         \
    else NAME##_rows(x, m, k, codes, scales, mins, y, ldy, n0, n1);                                \
}

DEFINE_BLOCKED(int4, DECODE_INT4, )
DEFINE_BLOCKED(int8, DECODE_INT8, * scales[ch])
DEFINE_BLOCKED(int8g, DECODE_INT8G, )

/* min_term for the integer passes: the groups 8 at a time in 8 lanes, then hsum and the rest in
   order. min_term's one chain of dependent additions per (row, channel), 18 to 48 groups long,
   made whole w4a16-int16 decode steps of 4-24 rows 1.04-1.32x w4a16's time where this takes
   0.89-1.13x (SmolLM2, context 100, 2 threads, AVX2 EPYC, the two builds' steps interleaved in
   one process, 2026-12-06). */
static inline float min_term_vec(const float *mins, const float *s, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(s + g), acc);
    float t = hsum(acc);
    for (; g < groups; g++) t = fmaf(mins[g], s[g], t);
    return t;
}

/* Channels [n0, n1) for exactly M rows of integer activations, NB channels at a time: int8 (w4a8,
   quantize_rows) or int16 (w4a16-int16) times int4 codes, and int16 times int8g codes (w4a16-int16's
   LM head). A group's product with a row is CODES (the group's CODE_BYTES code bytes at cp as
   integer vectors) and ROW_SUM (p: 8 int32 lanes of code * q sums, exact) from the row's group qg,
   then scale * d times p into the row's accumulator; MINS adds int4's min * d * sum(q) term. As in
   DEFINE_PASS, a row's sums run in the same order whatever M and NB are.
   - int8: the 32 codes as bytes in input order and `pmaddubsw` (unsigned codes times signed q in
     pairs) then `pmaddwd` by ones: GGUF's Q4_1 x Q8_1 dot product.
   - int16: the codes widened to 16-bit lanes (low nibbles, then high; int8g: its first 16 bytes,
     then the next 16) and `pmaddwd` against q: lane l holds inputs 2l, 2l + 1, 16 + 2l and 17 + 2l.
     No conversion of each weight to fp32: at one row about half the instructions of the fp32 pass,
     at 8 rows as many (AVX-512 builds run this AVX2 code too, so the two compute the same bits).
     The int8g head's codes need only a widening, no masks or shifts: its int16 passes took
     0.58-0.77x the fp32 product's time at 1-8 rows, 0.86-0.97x at 16-24 and 1.00-1.13x at 24-128
     (the fp32 one blocked there; 576 x 49,152, 2 threads, AVX2 EPYC, C harnesses, 2026-12-07). */
#define Q8_CODES()                                                                                 \
    const __m128i b = _mm_loadu_si128((const __m128i *)cp);                                        \
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
#define Q8_ROW_SUM()                                                                               \
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)qg)), \
                                        _mm256_set1_epi16(1));
#define Q16_CODES()                                                                                \
    const __m256i b16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)cp)),                \
                  lo = _mm256_and_si256(b16, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(b16, 4);
#define G8_Q16_CODES()                                                                             \
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)cp)),                 \
                  hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(cp + 16)));
#define INT4_MINS(ch, r) + min_term_vec(mins + (ch) * G, s + (r) * G, G)
#define NO_MINS(ch, r)
#define Q16_ROW_SUM()                                                                              \
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)qg)), \
                                       _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(qg + 16))));
#define DEFINE_QA_PASS(NAME, QT, CODES, ROW_SUM, CODE_BYTES, MINS, M, NB)                          \
static void NAME##_pass_##M##_##NB(const QT *q, const float *d, const float *s, int64_t k,          \
                                   const uint8_t *codes, const float *scales, const float *mins,   \
                                   float *y, int64_t ldy, int64_t n0, int64_t n1) {                \
    const int64_t G = k / 32;                                                                      \
    int64_t n = n0;                                                                                \
    for (; n + NB <= n1; n += NB) {                                                                \
        __m256 acc[M][NB];                                                                         \
        for (int r = 0; r < M; r++)                                                                \
            for (int c = 0; c < NB; c++) acc[r][c] = _mm256_setzero_ps();                          \
        for (int64_t g = 0; g < G; g++) {                                                          \
            for (int c = 0; c < NB; c++) {                                                         \
                const int64_t ch = n + c;                                                          \
                const uint8_t *cp = codes + ch * (G * CODE_BYTES) + g * CODE_BYTES;                \
                if (M <= 2 && ch + PREFETCH_CHANNELS < n1)                                         \
                    _mm_prefetch((const char *)(cp + PREFETCH_CHANNELS * (G * CODE_BYTES)), _MM_HINT_T0); \
                CODES()                                                                            \
                const float sc = scales[ch * G + g];                                               \
                for (int r = 0; r < M; r++) {                                                      \
                    const QT *qg = q + r * k + g * 32;                                             \
                    ROW_SUM()                                                                      \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc * d[r * G + g]), \
                                                acc[r][c]);                                        \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < M; r++)                                                                \
            for (int c = 0; c < NB; c++) {                                                         \
                const int64_t ch = n + c;                                                          \
                y[r * ldy + ch] = hsum(acc[r][c]) MINS(ch, r);                                     \
            }                                                                                      \
    }                                                                                              \
    if (n < n1 && NB > 1) NAME##_pass_##M##_1(q, d, s, k, codes, scales, mins, y, ldy, n, n1);     \
}
/* The integer rows q (with d and s) times the int4 (int8g) weights, in passes of 8, 4, 2 and 1 rows.
   Over 8 rows the channels go in blocks of QA_BLOCK_CHANNELS, every pass over one block before the
   next: a block's codes (SmolLM2's head: 256 x 576 bytes) stay in L2 for the passes after the first,
   where a pass over a thread's whole share of a 28 MB head reads it again from L3 or memory
   (with the head in a 32 MB L3, `bench/int4_product_ab.py --head --activations int16`: 0.89-1.00x at
   24-128 rows, 2026-12-07). A channel's sums do not depend on which channels share its pass, so
   the bits are the same. */
#define QA_BLOCK_CHANNELS 256
#define DEFINE_QA_ROWS(NAME, QT)                                                                   \
static void NAME##_row_passes(const QT *q, const float *d, const float *s, int m, int64_t k, const uint8_t *codes, \
                              const float *scales, const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) { \
    while (m > 0) {                                                                                \
        int step = m >= 8 ? 8 : m >= 4 ? 4 : m >= 2 ? 2 : 1;                                       \
        if (step == 8) NAME##_pass_8_1(q, d, s, k, codes, scales, mins, y, ldy, n0, n1);           \
        else if (step == 4) NAME##_pass_4_1(q, d, s, k, codes, scales, mins, y, ldy, n0, n1);      \
        else if (step == 2) NAME##_pass_2_2(q, d, s, k, codes, scales, mins, y, ldy, n0, n1);      \
        else NAME##_pass_1_4(q, d, s, k, codes, scales, mins, y, ldy, n0, n1);                     \
        q += step * k;                                                                             \
        d += step * (k / 32);                                                                      \
        s += step * (k / 32);                                                                      \
        y += step * ldy;                                                                           \
        m -= step;                                                                                 \
    }                                                                                              \
}                                                                                                  \
static void NAME##_rows(const QT *q, const float *d, const float *s, int m, int64_t k, const uint8_t *codes, \
                        const float *scales, const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) { \
    const int64_t block = m > ROWS_PER_PASS ? QA_BLOCK_CHANNELS : n1 - n0;                         \
    for (int64_t c0 = n0; c0 < n1; c0 += block)                                                    \
        NAME##_row_passes(q, d, s, m, k, codes, scales, mins, y, ldy, c0, n1 - c0 < block ? n1 : c0 + block); \
}
#define DEFINE_QA(NAME, QT, ...)                                                                   \
    DEFINE_QA_PASS(NAME, QT, __VA_ARGS__, 1, 1) DEFINE_QA_PASS(NAME, QT, __VA_ARGS__, 1, 4)        \
    DEFINE_QA_PASS(NAME, QT, __VA_ARGS__, 2, 1) DEFINE_QA_PASS(NAME, QT, __VA_ARGS__, 2, 2)        \
    DEFINE_QA_PASS(NAME, QT, __VA_ARGS__, 4, 1) DEFINE_QA_PASS(NAME, QT, __VA_ARGS__, 8, 1)        \
    DEFINE_QA_ROWS(NAME, QT)
DEFINE_QA(int4q8, int8_t, Q8_CODES, Q8_ROW_SUM, 16, INT4_MINS)
DEFINE_QA(int4q16, int16_t, Q16_CODES, Q16_ROW_SUM, 16, INT4_MINS)
DEFINE_QA(int8gq16, int16_t, G8_Q16_CODES, Q16_ROW_SUM, 32, NO_MINS)

#else
/* Portable C for CPUs without AVX2 (the compiler vectorises it for the target it builds for). */
static void int4_pass(const float *x, int m, int64_t k, const void *codes_, const float *scales,
                      const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *c = (const uint8_t *)codes_ + n * (k / 2);
        float acc[ROWS_PER_PASS] = {0};  /* m <= ROWS_PER_PASS: int4_rows passes at most that many */
        for (int64_t g = 0; g < k / 32; g++) {
            float w[32], s = scales[n * (k / 32) + g], mn = mins[n * (k / 32) + g];
            for (int j = 0; j < 16; j++) {
                w[j] = (float)(c[g * 16 + j] & 0x0F) * s + mn;
                w[j + 16] = (float)(c[g * 16 + j] >> 4) * s + mn;
            }
            for (int r = 0; r < m; r++) {
                float a = 0.f;
                for (int j = 0; j < 32; j++) a += w[j] * x[r * k + g * 32 + j];
                acc[r] += a;
            }
        }
        for (int r = 0; r < m; r++) y[r * ldy + n] = acc[r];
    }
}

static void int4_rows(const float *x, int m, int64_t k, const void *codes, const float *scales,
                      const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    for (int r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
        int rows = m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS;
        int4_pass(x + (int64_t)r0 * k, rows, k, codes, scales, mins, y + (int64_t)r0 * ldy, ldy, n0, n1);
    }
}

/* int8 codes with one scale per `group` inputs of a channel (group = k: one per channel). */
static void int8_scaled_rows(const float *x, int m, int64_t k, int64_t group, const int8_t *codes,
                             const float *scales, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *c = codes + n * k;
        for (int r = 0; r < m; r++) {
            float a = 0.f;
            for (int64_t g = 0; g < k / group; g++) {
                float part = 0.f;
                for (int64_t j = g * group; j < (g + 1) * group; j++) part += (float)c[j] * x[r * k + j];
                a += part * scales[n * (k / group) + g];
            }
            y[r * ldy + n] = a;
        }
    }
}

static void int8_rows(const float *x, int m, int64_t k, const void *codes, const float *scales,
                      const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    (void)mins;
    int8_scaled_rows(x, m, k, k, (const int8_t *)codes, scales, y, ldy, n0, n1);
}

static void int8g_rows(const float *x, int m, int64_t k, const void *codes, const float *scales,
                       const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    (void)mins;
    int8_scaled_rows(x, m, k, 32, (const int8_t *)codes, scales, y, ldy, n0, n1);
}

/* The integer rows q (with d and s) times the int4 weights (w4a8: int8, w4a16-int16: int16). */
#define DEFINE_QA_ROWS_PORTABLE(NAME, QT)                                                                   \
static void NAME##_rows(const QT *q, const float *d, const float *s, int m, int64_t k, const uint8_t *codes, \
                        const float *scales, const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) { \
    const int64_t G = k / 32;                                                                      \
    for (int64_t n = n0; n < n1; n++) {                                                            \
        const uint8_t *c = codes + n * (k / 2);                                                    \
        for (int r = 0; r < m; r++) {                                                              \
            const QT *qr = q + (int64_t)r * k;                                                     \
            float acc = 0.f;                                                                       \
            for (int64_t g = 0; g < G; g++) {                                                      \
                int32_t sum = 0;                                                                   \
                for (int j = 0; j < 16; j++)                                                       \
                    sum += (c[g * 16 + j] & 0x0F) * qr[g * 32 + j] + (c[g * 16 + j] >> 4) * qr[g * 32 + 16 + j]; \
                acc += (float)sum * (scales[n * G + g] * d[r * G + g]);                            \
            }                                                                                      \
            y[r * ldy + n] = acc + min_term(mins + n * G, s + r * G, G);                           \
        }                                                                                          \
    }                                                                                              \
}
DEFINE_QA_ROWS_PORTABLE(int4q8, int8_t)
DEFINE_QA_ROWS_PORTABLE(int4q16, int16_t)

/* The int16 rows q (with d) times int8g weights (codes as bytes; s and mins unused). */
static void int8gq16_rows(const int16_t *q, const float *d, const float *s, int m, int64_t k, const uint8_t *codes,
                          const float *scales, const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    (void)s;
    (void)mins;
    const int64_t G = k / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *c = (const int8_t *)codes + n * k;
        for (int r = 0; r < m; r++) {
            const int16_t *qr = q + (int64_t)r * k;
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                int32_t sum = 0;
                for (int j = 0; j < 32; j++) sum += c[g * 32 + j] * qr[g * 32 + j];
                acc += (float)sum * (scales[n * G + g] * d[r * G + g]);
            }
            y[r * ldy + n] = acc;
        }
    }
}
#define int4_product_rows int4_rows  /* portable: the passes take any number of rows */
#define int8_product_rows int8_rows
#define int8g_product_rows int8g_rows
#endif


/* ---------------------------------------------------------------------------------------------
   bf16 products for prompt rows (w4a16-bf16prefill). A prefill chunk multiplies many rows by each
   weight, so its cost is arithmetic, not reading weights: where the CPU has AVX512-BF16, a block of
   BF16_CHANNELS output channels is decoded once into a bf16 tile, and every prompt row (rounded to
   bf16 once per product) is multiplied by it with VDPBF16PS, two products summed into an fp32 lane
   per instruction: twice fp32's multiply-adds per instruction and no weight decoding per row (64
   rows of SmolLM2's shapes, one EPYC Zen 4 thread, a C harness: 177-191 GFLOP/s against 60 for the
   fp32 pass, relative error of the sums 2.2e-3 on random data). Each (row, channel) sum runs over the
   groups in order in one accumulator, then _mm512_reduce_add_ps: a row's result depends on its own
   input only, not on which rows share its pass, its step or the thread count. Where the CPU also has
   AMX and lowbit.py turned it on, int4_bf16_rows_amx (below) multiplies the same operands on tiles
   instead; only the order of the fp32 sums differs. Rows not marked go through int4_rows, exact as
   in w4a16. */
#define BF16_CHANNELS 16
#define BF16_ROWS 8

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define MAGNITUDE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* AMX (Intel's tile unit: TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16
   fp32 sums) for the marked rows, where the build has it, Linux grants the tile state and
   lowbit.py turned it on (MAGNITUDE_LOWBIT_AMX, default on): the same operands as VDPBF16PS's (x
   and the weights rounded to bf16, fp32 sums), several times the multiply-adds per instruction.
   Process-wide, set once at load, so a row's result still depends on its own input only: every
   marked row of every product takes the same path. */
static int amx_on = 0;

int magnitude_lowbit_set_amx(int want) {
#ifdef MAGNITUDE_AMX
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): the kernel's permission to use
       the tile registers, once per process (torch's oneDNN asks the same). */
    __atomic_store_n(&amx_on, want && syscall(SYS_arch_prctl, 0x1023, 18) == 0, __ATOMIC_RELEASE);
#else
    (void)want;
    __atomic_store_n(&amx_on, 0, __ATOMIC_RELEASE);
#endif
    return __atomic_load_n(&amx_on, __ATOMIC_ACQUIRE);
}

int magnitude_lowbit_amx(void) { return __atomic_load_n(&amx_on, __ATOMIC_ACQUIRE); }

int magnitude_lowbit_bf16(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
/* Channels [c0, c0 + nc) as bf16, tile[c][g] the 32 weights of group g (code * scale + min, rounded). */
static void int4_bf16_tile(int64_t k, const uint8_t *codes, const float *scales, const float *mins, int64_t c0,
                           int nc, __m512bh *tile) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const int64_t G = k / 32;
    for (int c = 0; c < nc; c++) {
        const int64_t ch = c0 + c;
        for (int64_t g = 0; g < G; g++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(codes + ch * (k / 2) + g * 16));
            __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
            __m512 sc = _mm512_set1_ps(scales[ch * G + g]), mi = _mm512_set1_ps(mins[ch * G + g]);
            __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), sc, mi);
            __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), sc, mi);
            tile[c * G + g] = _mm512_cvtne2ps_pbh(w1, w0);  /* element i: input i of the group */
        }
    }
}

/* y[rows[i]][n0..n1) = xb[i] @ W^T for the m bf16 rows xb [m][k/32 vectors]; tile: BF16_CHANNELS * k/32 vectors. */
static void int4_bf16_rows(const __m512bh *xb, const int64_t *rows, int64_t m, int64_t k, const uint8_t *codes,
                           const float *scales, const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1,
                           __m512bh *tile) {
    const int64_t G = k / 32;
    for (int64_t c0 = n0; c0 < n1; c0 += BF16_CHANNELS) {
        const int nc = (int)(n1 - c0 < BF16_CHANNELS ? n1 - c0 : BF16_CHANNELS);
        int4_bf16_tile(k, codes, scales, mins, c0, nc, tile);
        for (int64_t r0 = 0; r0 < m; r0 += BF16_ROWS) {
            const __m512bh *xr[BF16_ROWS];  /* a short last pass repeats its last row, stored once */
            for (int r = 0; r < BF16_ROWS; r++) xr[r] = xb + (r0 + r < m ? r0 + r : m - 1) * G;
            for (int c = 0; c < nc; c += 2) {
                const int c1 = c + 1 < nc ? c + 1 : c;
                __m512 acc[BF16_ROWS][2];
                for (int r = 0; r < BF16_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
                for (int64_t g = 0; g < G; g++) {
                    const __m512bh w0 = tile[c * G + g], w1 = tile[c1 * G + g];
                    for (int r = 0; r < BF16_ROWS; r++) {
                        const __m512bh xv = xr[r][g];
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
                    }
                }
                for (int r = 0; r < BF16_ROWS && r0 + r < m; r++) {
                    float *yr = y + rows[r0 + r] * ldy + c0;
                    yr[c] = _mm512_reduce_add_ps(acc[r][0]);
                    if (c1 != c) yr[c1] = _mm512_reduce_add_ps(acc[r][1]);
                }
            }
        }
    }
}

#ifdef MAGNITUDE_AMX
#define AMX_ROWS 16  /* rows of an activation tile; a product's marked rows are padded to a multiple */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* r[i] <- the i-th column of the 16 x 16 matrix of 32-bit elements r holds (row i = r[i]). */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* y[rows[i]][n0..n1) = xb[i] @ W^T with AMX: xb [m padded to AMX_ROWS][k/32 vectors] (the padding
   rows are zeroed here), tile as for int4_bf16_rows, pairs its VNNI copy (the layout TDPBF16PS
   takes a weight tile in: per group, 16 rows of input pairs x 16 channels). Per block of 16
   channels and 64 rows, four accumulator tiles run over the groups in order. */
static void int4_bf16_rows_amx(__m512bh *xb, const int64_t *rows, int64_t m, int64_t k, const uint8_t *codes,
                               const float *scales, const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1,
                               __m512bh *tile, __m512i *pairs) {
    const int64_t G = k / 32, padded = (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    memset(xb + m * G, 0, (size_t)((padded - m) * G) * sizeof(__m512bh));
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 7; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    float out[4][AMX_ROWS][16] __attribute__((aligned(64)));
    const long stride = (long)(G * sizeof(__m512bh));
    for (int64_t c0 = n0; c0 < n1; c0 += BF16_CHANNELS) {
        const int nc = (int)(n1 - c0 < BF16_CHANNELS ? n1 - c0 : BF16_CHANNELS);
        int4_bf16_tile(k, codes, scales, mins, c0, nc, tile);
        for (int64_t g = 0; g < G; g++) {
            __m512i r[16];
            for (int c = 0; c < 16; c++)  /* channels past nc: any finite value, their sums are not stored */
                r[c] = c < nc ? (__m512i)tile[c * G + g] : _mm512_setzero_si512();
            transpose16_epi32(r);
            for (int p = 0; p < 16; p++) pairs[g * 16 + p] = r[p];
        }
        for (int64_t r0 = 0; r0 < padded; r0 += 4 * AMX_ROWS) {
            const int blocks = (int)((padded - r0) / AMX_ROWS < 4 ? (padded - r0) / AMX_ROWS : 4);
            const char *a = (const char *)(xb + r0 * G);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t g = 0; g < G; g++) {
                _tile_loadd(6, pairs + g * 16, 64);
                _tile_loadd(4, a + g * 64, stride);
                _tile_dpbf16ps(0, 4, 6);
                if (blocks > 1) {
                    _tile_loadd(5, a + AMX_ROWS * stride + g * 64, stride);
                    _tile_dpbf16ps(1, 5, 6);
                }
                if (blocks > 2) {
                    _tile_loadd(4, a + 2 * AMX_ROWS * stride + g * 64, stride);
                    _tile_dpbf16ps(2, 4, 6);
                }
                if (blocks > 3) {
                    _tile_loadd(5, a + 3 * AMX_ROWS * stride + g * 64, stride);
                    _tile_dpbf16ps(3, 5, 6);
                }
            }
            _tile_stored(0, out[0], 64);
            _tile_stored(1, out[1], 64);
            _tile_stored(2, out[2], 64);
            _tile_stored(3, out[3], 64);
            const __mmask16 keep = (__mmask16)((1u << nc) - 1u);
            for (int64_t i = 0; i < blocks * AMX_ROWS && r0 + i < m; i++)
                _mm512_mask_storeu_ps(y + rows[r0 + i] * ldy + c0, keep, _mm512_load_ps(out[i / AMX_ROWS][i % AMX_ROWS]));
        }
    }
    _tile_release();
}
#endif

/* A thread's scratch for bf16 products: its bf16 copy of the marked rows and its weight tile. */
typedef struct {
    __m512bh *xb, *tile;
    __m512i *pairs;  /* with AMX: the tile in TDPBF16PS's layout */
    int64_t *rows;
} bf16_scratch;

static int bf16_scratch_alloc(bf16_scratch *s, int64_t m, int64_t widest) {
    /* One read: the sizes and the pairs pointer must agree even if the switch moves meanwhile. */
    const int amx = __atomic_load_n(&amx_on, __ATOMIC_ACQUIRE);
    const int64_t G = widest / 32, tiles = amx ? 2 : 1;
#ifdef MAGNITUDE_AMX
    const int64_t held = amx ? (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : m;
#else
    const int64_t held = m;
#endif
    s->xb = aligned_alloc(64, (size_t)(held * G + tiles * BF16_CHANNELS * G) * sizeof(__m512bh));
    s->tile = s->xb ? s->xb + held * G : 0;
    s->pairs = s->tile && amx ? (__m512i *)(s->tile + BF16_CHANNELS * G) : 0;
    s->rows = malloc((size_t)(m > 0 ? m : 1) * sizeof(int64_t));
    return s->xb && s->rows;
}

static void bf16_scratch_free(bf16_scratch *s) {
    free(s->xb);
    free(s->rows);
}
#else
typedef struct { int unused; } bf16_scratch;
static int bf16_scratch_alloc(bf16_scratch *s, int64_t m, int64_t widest) { (void)s; (void)m; (void)widest; return 0; }
static void bf16_scratch_free(bf16_scratch *s) { (void)s; }
#endif

/* Channels [n0, n1) of x [m][k] @ W^T into y: rows with bf16_rows[r] set through the bf16 tile
   (only where built with AVX512-BF16 and given a scratch), every other row through int4_rows, in
   passes over each run of them. Each thread converts the marked rows itself: microseconds, against
   a barrier more per product to share them. */
static void int4_mixed_rows(const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scales,
                            const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1,
                            const uint8_t *bf16_rows, bf16_scratch *bf16) {
    if (!bf16) bf16_rows = 0;
    int64_t marked = 0;
    for (int64_t r = 0; r < m;) {
        if (bf16_rows && bf16_rows[r]) {
#ifdef __AVX512BF16__
            const float *xr = x + r * k;
            __m512bh *dst = bf16->xb + marked * (k / 32);
            for (int64_t g = 0; g < k / 32; g++)
                dst[g] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 32 * g + 16), _mm512_loadu_ps(xr + 32 * g));
            bf16->rows[marked] = r;
#endif
            marked++;
            r++;
            continue;
        }
        const int64_t e0 = r;
        while (r < m && !(bf16_rows && bf16_rows[r])) r++;
        int4_product_rows(x + e0 * k, (int)(r - e0), k, codes, scales, mins, y + e0 * ldy, ldy, n0, n1);
    }
#ifdef MAGNITUDE_AMX
    if (marked && bf16->pairs) {
        int4_bf16_rows_amx(bf16->xb, bf16->rows, marked, k, codes, scales, mins, y, ldy, n0, n1, bf16->tile,
                           bf16->pairs);
        return;
    }
#endif
#ifdef __AVX512BF16__
    if (marked) int4_bf16_rows(bf16->xb, bf16->rows, marked, k, codes, scales, mins, y, ldy, n0, n1, bf16->tile);
#endif
}

/* y [m][n] = x [m][k] @ W^T, W in the int4 layout above, rows with bf16_rows[r] set in bf16
   (int4_mixed_rows). Returns 0; -1 when out of memory, -2 when not built with AVX512-BF16 (y
   untouched either way). */
int magnitude_int4_bf16_matmul(const float *x, int64_t m, int64_t k, int64_t n, const uint8_t *codes,
                               const float *scales, const float *mins, float *y, const uint8_t *bf16_rows,
                               int threads) {
#ifndef __AVX512BF16__
    (void)x; (void)m; (void)k; (void)n; (void)codes; (void)scales; (void)mins; (void)y; (void)bf16_rows;
    (void)threads;
    return -2;
#else
    int failed = 0;
    if (m <= 0 || n <= 0) return 0;
    #pragma omp parallel num_threads(threads)
    {
        int t, nt;
        int64_t a, b;
        team(&t, &nt);
        share(n, t, nt, &a, &b);
        bf16_scratch s;
        const int ok = bf16_scratch_alloc(&s, m, k);
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed && a < b) int4_mixed_rows(x, m, k, codes, scales, mins, y, n, a, b, bf16_rows, &s);
        bf16_scratch_free(&s);
    }
    return failed ? -1 : 0;
#endif
}

/* y [m][n] = x [m][k] @ W^T, W in the int4 layout above. */
void magnitude_int4_matmul(const float *x, int64_t m, int64_t k, int64_t n, const uint8_t *codes,
                           const float *scales, const float *mins, float *y, int threads) {
    split_rows(int4_product_rows, x, m, k, n, codes, scales, mins, y, threads);
}

/* y [m][n] = x [m][k] @ W^T, W in the int8 layout above. */
void magnitude_int8_matmul(const float *x, int64_t m, int64_t k, int64_t n, const int8_t *codes,
                           const float *scales, float *y, int threads) {
    split_rows(int8_product_rows, x, m, k, n, codes, scales, 0, y, threads);
}

/* y [m][n] = x [m][k] @ W^T, W in the int8g layout above. */
void magnitude_int8g_matmul(const float *x, int64_t m, int64_t k, int64_t n, const int8_t *codes,
                            const float *scales, float *y, int threads) {
    split_rows(int8g_product_rows, x, m, k, n, codes, scales, 0, y, threads);
}

/* Which integer product quantized_matmul runs: int4 codes times int8 or int16 rows, or int8g codes
   times int16 rows. */
enum { QA_INT4_Q8, QA_INT4_Q16, QA_INT8G_Q16 };

/* y [m][n] = qa(x) [m][k] @ W^T, W in the int4 (int8g) layout above, x quantized per group of 32
   inputs to int8 or int16 by quantize_rows. Returns 0, or -1 when out of memory (y untouched). */
static int quantized_matmul(int product, const float *x, int64_t m, int64_t k, int64_t n, const uint8_t *codes,
                            const float *scales, const float *mins, float *y, int threads) {
    if (m <= 0 || n <= 0) return 0;
    const int bits = product == QA_INT4_Q8 ? 8 : 16;
    void *q = malloc((size_t)(m * k * (bits / 8)));
    float *ds = malloc((size_t)(2 * m * (k / 32)) * sizeof(float));
    if (!q || !ds) {
        free(q);
        free(ds);
        return -1;
    }
    float *d = ds, *s = ds + m * (k / 32);
    quantize_rows(x, m, k, k, bits, q, d, s);
    #pragma omp parallel num_threads(threads)
    {
        int t, nt;
        int64_t a, b;
        team(&t, &nt);
        share(n, t, nt, &a, &b);
        if (a < b) {
            if (product == QA_INT4_Q16) int4q16_rows(q, d, s, (int)m, k, codes, scales, mins, y, n, a, b);
            else if (product == QA_INT8G_Q16) int8gq16_rows(q, d, s, (int)m, k, codes, scales, mins, y, n, a, b);
            else int4q8_rows(q, d, s, (int)m, k, codes, scales, mins, y, n, a, b);
        }
    }
    free(q);
    free(ds);
    return 0;
}

/* w4a8's product: int8 activations. */
int magnitude_int4q8_matmul(const float *x, int64_t m, int64_t k, int64_t n, const uint8_t *codes,
                            const float *scales, const float *mins, float *y, int threads) {
    return quantized_matmul(QA_INT4_Q8, x, m, k, n, codes, scales, mins, y, threads);
}

/* w4a16-int16's product: int16 activations. */
int magnitude_int4q16_matmul(const float *x, int64_t m, int64_t k, int64_t n, const uint8_t *codes,
                             const float *scales, const float *mins, float *y, int threads) {
    return quantized_matmul(QA_INT4_Q16, x, m, k, n, codes, scales, mins, y, threads);
}

/* w4a16-int16's LM head: int16 activations times the int8g layout's codes. */
int magnitude_int8gq16_matmul(const float *x, int64_t m, int64_t k, int64_t n, const int8_t *codes,
                              const float *scales, float *y, int threads) {
    return quantized_matmul(QA_INT8G_Q16, x, m, k, n, (const uint8_t *)codes, scales, 0, y, threads);
}

/* ---------------------------------------------------------------------------------------------
   A whole decode step's decoder layers in one call (fused_decode.py): for steps where every row is
   one sequence's next token, on a Llama-shaped model (RMSNorm, RoPE, grouped-query attention over
   the paged KV pool, SiLU-gated MLP) whose projections are int4 in the layout above. The torch
   path runs about a hundred framework operations per layer, each a few microseconds of Python and
   dispatch; here a layer is a handful of loops in one OpenMP region, its threads meeting at a
   spinning barrier between the phases that need every thread's output. */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *in_norm, *post_norm;                 /* [hidden] */
    const uint8_t *qkv_codes; const float *qkv_scales, *qkv_mins, *qkv_bias;    /* q, k, v stacked */
    const uint8_t *o_codes; const float *o_scales, *o_mins, *o_bias;
    const uint8_t *gu_codes; const float *gu_scales, *gu_mins, *gu_bias;        /* gate, up stacked */
    const uint8_t *down_codes; const float *down_scales, *down_mins, *down_bias;
    void *k_cache, *v_cache;                           /* [slots][kv_heads][head_dim], fp32 or fp16 */
    int64_t window;                                    /* keys with pos - key_pos < window; 0: all */
    /* bf16 weights [n][k] (dims.dense_bf16), each projection its own matrix; then the *_codes,
       scales and mins above are unused, and qkv_bias and gu_bias are the stacked fp32 biases */
    const uint16_t *q_w, *k_w, *v_w, *o_w, *gate_w, *up_w, *down_w;
} magnitude_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, table_width;
    float eps, scaling;
    int64_t act_int8;                                  /* 1: int8 activations (w4a8), 2: int16 (w4a16-int16) */
    int64_t kv_f16;                                    /* 1: the pool holds IEEE half floats, else fp32 */
    const uint8_t *prompt_rows;                        /* [m] or null: a prompt chunk's rows (bf16 in w4a16-bf16prefill, fp32 in w4a16-int16) */
    int64_t dense_bf16;                                /* 1: the layers' weights are bf16 (q_w ... down_w) */
} magnitude_dims;

/* A thread's integer copy of the rows it multiplies (w4a8: int8, w4a16-int16: int16, `bits`):
   q [m][k], d and s [m][k/32]. */
typedef struct {
    void *q;
    float *d, *s;
    int bits;
} q8_scratch;

typedef struct {
    atomic_int count;
    atomic_int sense;
    int n;
} spin_barrier;

/* Spins (the phases are microseconds apart), yielding the CPU if a partner is long descheduled. */
static void barrier_wait(spin_barrier *b, int *local_sense) {
    *local_sense = !*local_sense;
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->sense, *local_sense, memory_order_release);
    } else {
        unsigned spins = 0;
        while (atomic_load_explicit(&b->sense, memory_order_acquire) != *local_sense)
            if (++spins % 4096 == 0) sched_yield();
    }
}

/* y[r][n0..n1) = out[r][n0..n1) + bias, or added into y when accumulate (the residual stream). */
static void finish_product(const float *out, float *y, int64_t ldy, int64_t m, int64_t n0, int64_t n1,
                           const float *bias, int accumulate) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t n = n0; n < n1; n++) {
            float v = out[r * ldy + n] + (bias ? bias[n] : 0.f);
            y[r * ldy + n] = accumulate ? y[r * ldy + n] + v : v;
        }
}

/* w4a16-int16's products over rows x [m][k]: the rows prompt_rows marks (a prompt chunk's, the
   runner says) in fp32 exactly as w4a16 multiplies them, the others in int16 (int4q16_rows),
   quantized into q8 first unless `quantized`. A row's result depends on its own input and mark only. */
static void int4q16_mixed_rows(const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scales,
                               const float *mins, float *y, int64_t ldy, int64_t n0, int64_t n1,
                               const q8_scratch *q8, int quantized, const uint8_t *prompt_rows) {
    const int64_t G = k / 32;
    for (int64_t r = 0; r < m;) {
        const int marked = prompt_rows && prompt_rows[r];
        const int64_t e0 = r;
        while (r < m && (prompt_rows && prompt_rows[r]) == marked) r++;
        if (marked) {
            int4_product_rows(x + e0 * k, (int)(r - e0), k, codes, scales, mins, y + e0 * ldy, ldy, n0, n1);
            continue;
        }
        int16_t *q = (int16_t *)q8->q + e0 * k;
        float *d = q8->d + e0 * G, *s = q8->s + e0 * G;
        if (!quantized) quantize_rows(x + e0 * k, r - e0, k, k, 16, q, d, s);
        int4q16_rows(q, d, s, (int)(r - e0), k, codes, scales, mins, y + e0 * ldy, ldy, n0, n1);
    }
}

/* y[r][n0..n1) = x[r] @ W^T (+ bias) (+= into y when accumulate: the residual stream). With q8,
   x is taken in int8 or int16 (q8->bits) from it, quantized first unless `quantized` says this
   thread already holds x there (gate and up share their input); each thread quantizes every row
   itself: a few microseconds at the rows a fused step has, against a barrier more per product to
   share it. The rows prompt_rows marks run in bf16 without q8 when bf16 is given
   (int4_mixed_rows), in fp32 with int16's q8 (int4q16_mixed_rows). */
static void int4_share(const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scales,
                       const float *mins, const float *bias, float *y, int64_t ldy, int64_t n0, int64_t n1,
                       int accumulate, float *tmp, const q8_scratch *q8, int quantized,
                       const uint8_t *prompt_rows, bf16_scratch *bf16) {
    if (n0 >= n1) return;
    float *out = accumulate ? tmp : y;
    if (q8) {
        if (q8->bits == 16) {
            int4q16_mixed_rows(x, m, k, codes, scales, mins, out, ldy, n0, n1, q8, quantized, prompt_rows);
        } else {
            if (!quantized) quantize_rows(x, m, k, k, 8, q8->q, q8->d, q8->s);
            int4q8_rows(q8->q, q8->d, q8->s, (int)m, k, codes, scales, mins, out, ldy, n0, n1);
        }
    } else {
        int4_mixed_rows(x, m, k, codes, scales, mins, out, ldy, n0, n1, prompt_rows, bf16);
    }
    finish_product(out, y, ldy, m, n0, n1, bias, accumulate);
}

/* bf16 weights (a bfloat16 model's projections): out[r][n] = x[r] . w[n - off] for channels
   [n0, n1), w [.][k] bf16 widened to fp32 in registers (exact), fp32 activations and sums. A decode
   row reads half the bytes of fp32 weights and none of torch's per-call work. Channels go in blocks
   whose weights stay in cache while every pass of up to DENSE_ROWS rows reads them, two channels at a
   time; each row's sum is formed in one order whatever the rows beside it (one accumulator of VLANES
   lanes, then the tail), so a row's result does not depend on its batch or the thread count. */
static inline float bf16_value(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define DENSE_ROWS 4
#define DENSE_BLOCK 32
#ifdef __AVX2__
#ifdef __AVX512F__
#define BF16_LOAD(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define BF16_LOAD(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
static inline __attribute__((always_inline)) void bf16_pass(const int M, const float *x, int64_t k, const uint16_t *w,
                                                            int64_t off, float *out, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t kv = k / VLANES * VLANES;
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const uint16_t *w0 = w + (n - off) * k, *w1 = w0 + k;
        vecf a0[DENSE_ROWS], a1[DENSE_ROWS];
        for (int r = 0; r < M; r++) a0[r] = a1[r] = VZERO();
        for (int64_t i = 0; i < kv; i += VLANES) {
            const vecf b0 = BF16_LOAD(w0 + i), b1 = BF16_LOAD(w1 + i);
            for (int r = 0; r < M; r++) {
                const vecf xv = VLOAD(x + r * k + i);
                a0[r] = VFMA(xv, b0, a0[r]);
                a1[r] = VFMA(xv, b1, a1[r]);
            }
        }
        for (int r = 0; r < M; r++) {
            float s0 = VSUM(a0[r]), s1 = VSUM(a1[r]);
            for (int64_t i = kv; i < k; i++) {
                s0 += x[r * k + i] * bf16_value(w0[i]);
                s1 += x[r * k + i] * bf16_value(w1[i]);
            }
            out[r * ldy + n] = s0;
            out[r * ldy + n + 1] = s1;
        }
    }
    for (; n < n1; n++) {
        const uint16_t *w0 = w + (n - off) * k;
        vecf a0[DENSE_ROWS];
        for (int r = 0; r < M; r++) a0[r] = VZERO();
        for (int64_t i = 0; i < kv; i += VLANES) {
            const vecf b0 = BF16_LOAD(w0 + i);
            for (int r = 0; r < M; r++) a0[r] = VFMA(VLOAD(x + r * k + i), b0, a0[r]);
        }
        for (int r = 0; r < M; r++) {
            float s0 = VSUM(a0[r]);
            for (int64_t i = kv; i < k; i++) s0 += x[r * k + i] * bf16_value(w0[i]);
            out[r * ldy + n] = s0;
        }
    }
}

static void bf16_rows(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t off, float *out, int64_t ldy,
                      int64_t n0, int64_t n1) {
    for (int64_t c = n0; c < n1; c += DENSE_BLOCK) {
        const int64_t c1 = c + DENSE_BLOCK < n1 ? c + DENSE_BLOCK : n1;
        for (int64_t r0 = 0; r0 < m; r0 += DENSE_ROWS) {
            const float *xr = x + r0 * k;
            float *o = out + r0 * ldy;
            switch (m - r0 < DENSE_ROWS ? (int)(m - r0) : DENSE_ROWS) {
                case 1: bf16_pass(1, xr, k, w, off, o, ldy, c, c1); break;
                case 2: bf16_pass(2, xr, k, w, off, o, ldy, c, c1); break;
                case 3: bf16_pass(3, xr, k, w, off, o, ldy, c, c1); break;
                default: bf16_pass(4, xr, k, w, off, o, ldy, c, c1); break;
            }
        }
    }
}

/* As int4_share, for bf16 weights stacked from `nseg` matrices of rows[s] channels each (q, k, v;
   gate, up), the bias stacked the same way. */
static void bf16_share(const float *x, int64_t m, int64_t k, const uint16_t *const *w, const int64_t *rows, int nseg,
                       const float *bias, float *y, int64_t ldy, int64_t n0, int64_t n1, int accumulate, float *tmp) {
    if (n0 >= n1) return;
    float *out = accumulate ? tmp : y;
    int64_t off = 0;
    for (int s = 0; s < nseg; off += rows[s], s++) {
        const int64_t lo = n0 > off ? n0 : off, hi = n1 < off + rows[s] ? n1 : off + rows[s];
        if (lo < hi) bf16_rows(x, m, k, w[s], off, out, ldy, lo, hi);
    }
    finish_product(out, y, ldy, m, n0, n1, bias, accumulate);
}
#define BF16_SHARE(...) bf16_share(__VA_ARGS__)
#else
/* Without AVX2 there are no bf16 products: magnitude_decode_layers declines bf16 steps (fused_decode.py
   never asks for them on such a build). */
#define BF16_SHARE(x, m, k, w, rows, ...) ((void)(w), (void)(rows))
#endif

static void rms_norm_rows(const float *h, const float *w, float *out, int64_t m, int64_t hidden, float eps,
                          int t, int nt) {
    for (int64_t r = t; r < m; r += nt) {
        const float *x = h + r * hidden;
        float ss = 0.f;
        for (int64_t i = 0; i < hidden; i++) ss += x[i] * x[i];
        float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) out[r * hidden + i] = w[i] * (x[i] * inv);
    }
}

/* x * cos + rotate_half(x) * sin for one head (rotate_half(x) = [-x2, x1]). */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    float tmp[512];
    for (int64_t i = 0; i < d; i++) tmp[i] = x[i];
    for (int64_t i = 0; i < half; i++) {
        x[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
        x[i + half] = tmp[i + half] * cos[i + half] + tmp[i] * sin[i + half];
    }
}

/* IEEE half <-> fp32 for a KV pool kept in float16 (kvCache.dtype). Rounding to nearest even, with
   subnormals and infinities, bit for bit what torch's `.to(torch.float16)` and F16C's vcvtps2ph
   give for every finite or infinite fp32 (a NaN keeps its sign and payload's top bits, quieted): the lean forward writes the same pool through torch, and a sequence's K/V must
   not depend on which forward wrote it. Integer arithmetic only, so no compiler contraction or
   flush-to-zero setting can change a result. */
static inline uint16_t fp16_from_fp32(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  /* NaN, quieted */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);      /* 65520 and up round to infinity */
    if (ax >= 0x38800000u)                                         /* a normal half: 2^-14 and up */
        return (uint16_t)(sign | ((ax + 0x0fffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13));
    if (ax < 0x33000000u) return (uint16_t)sign;                   /* at most 2^-25: zero */
    const uint32_t shift = 126u - (ax >> 23), mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;                                    /* a subnormal half: q * 2^-24 */
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static inline float fp32_from_fp16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t x;
    if (e == 0x1fu) x = sign | 0x7f800000u | (m << 13);
    else if (e) x = sign | ((e + 112u) << 23) | (m << 13);
    else {
        float v = (float)m * 5.9604644775390625e-8f;               /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* n values from fp32 into the pool's element type. */
static void store_kv(void *dst, const float *src, int64_t n, int f16) {
    if (!f16) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = dst;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) h[i] = fp16_from_fp32(src[i]);
}

/* For tests: n fp32 values to half floats as the fused step stores K/V. */
void magnitude_to_f16(const float *src, uint16_t *dst, int64_t n) { store_kv(dst, src, n, 1); }

/* One row's KV head: RoPE on its k and on the query heads that read it, then k and v into the
   row's slot of the pool. */
static void rope_and_store(const magnitude_dims *d, const magnitude_layer *L, float *qkv_row, int64_t pos,
                           const int64_t *table, const float *cos, const float *sin, int64_t kvh) {
    const int64_t D = d->head_dim, rep = d->heads / d->kv_heads, bs = d->block_size;
    float *q0 = qkv_row + kvh * rep * D;
    float *k = qkv_row + d->heads * D + kvh * D;
    float *v = qkv_row + (d->heads + d->kv_heads) * D + kvh * D;
    for (int64_t j = 0; j < rep; j++) rope(q0 + j * D, cos, sin, D);
    rope(k, cos, sin, D);
    const int64_t at = (table[pos / bs] * bs + pos % bs) * d->kv_heads + kvh, esize = d->kv_f16 ? 2 : 4;
    store_kv((char *)L->k_cache + at * D * esize, k, D, (int)d->kv_f16);
    store_kv((char *)L->v_cache + at * D * esize, v, D, (int)d->kv_f16);
}

/* The first key a query at `pos` reads: its sliding window's start, else 0. */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* The keys [*lo, *hi) of the pool segment [p, p + n) that a query at `pos` reads (empty when
   *lo >= *hi); returns the query's first key. */
static inline int64_t keys_in_segment(int64_t p, int64_t n, int64_t pos, int64_t window, int64_t *lo, int64_t *hi) {
    const int64_t fi = first_key(pos, window);
    *lo = p > fi ? p : fi;
    *hi = p + n < pos + 1 ? p + n : pos + 1;
    return fi;
}

/* softmax(q K^T * scaling) V for one query head over the row's keys (positions first..pos), read
   from the pool block by block, its elements of type T read as CVT(x). DIM is the head size when
   known at compile time (0: d->head_dim), so that q and the output stay in registers. */
#define AS_FLOAT(x) (x)
#define DEFINE_ATTEND(NAME, DIM, T, CVT)                                                           \
static void NAME(const magnitude_dims *d, const magnitude_layer *L, const float *q, float *out,   \
                 int64_t first, int64_t pos, const int64_t *table, int64_t kvh, float *scores) {   \
    const int64_t D = DIM ? DIM : d->head_dim, bs = d->block_size, stride = d->kv_heads * D;      \
    const float scaling = d->scaling;                                                              \
    float mx = -INFINITY;                                                                          \
    for (int64_t p = first; p <= pos;) {                                                           \
        int64_t blk = p / bs, in = p % bs, n = bs - in < pos + 1 - p ? bs - in : pos + 1 - p;      \
        const T *kt = (const T *)L->k_cache + (table[blk] * bs + in) * stride + kvh * D;          \
        for (int64_t i = 0; i < n; i++, kt += stride) {                                            \
            float acc = 0.f;                                                                       \
            _Pragma("omp simd reduction(+:acc)")                                                   \
            for (int64_t e = 0; e < D; e++) acc += q[e] * CVT(kt[e]);                              \
            acc *= scaling;                                                                        \
            scores[p - first + i] = acc;                                                           \
            mx = acc > mx ? acc : mx;                                                              \
        }                                                                                          \
        p += n;                                                                                    \
    }                                                                                              \
    float sum = 0.f, o[DIM ? DIM : 512];                                                           \
    for (int64_t t = 0; t <= pos - first; t++) {                                                   \
        scores[t] = expf(scores[t] - mx);                                                          \
        sum += scores[t];                                                                          \
    }                                                                                              \
    for (int64_t e = 0; e < D; e++) o[e] = 0.f;                                                    \
    for (int64_t p = first; p <= pos;) {                                                           \
        int64_t blk = p / bs, in = p % bs, n = bs - in < pos + 1 - p ? bs - in : pos + 1 - p;      \
        const T *vt = (const T *)L->v_cache + (table[blk] * bs + in) * stride + kvh * D;          \
        for (int64_t i = 0; i < n; i++, vt += stride) {                                            \
            float w = scores[p - first + i];                                                       \
            _Pragma("omp simd")                                                                    \
            for (int64_t e = 0; e < D; e++) o[e] += w * CVT(vt[e]);                                \
        }                                                                                          \
        p += n;                                                                                    \
    }                                                                                              \
    float inv = 1.0f / sum;                                                                        \
    for (int64_t e = 0; e < D; e++) out[e] = o[e] * inv;                                           \
}
#ifndef __AVX2__
DEFINE_ATTEND(attend_64, 64, float, AS_FLOAT)
DEFINE_ATTEND(attend_128, 128, float, AS_FLOAT)
#endif
DEFINE_ATTEND(attend_any, 0, float, AS_FLOAT)
/* A float16 pool: the generic loop, converting in C (an AVX2 build with F16C takes the vector one
   at head sizes 64 and 128). */
DEFINE_ATTEND(attend_any_f16, 0, uint16_t, fp32_from_fp16)

#ifdef __AVX2__
/* e^x for x <= 0 (scores minus their maximum), 8 lanes: Cephes' expf polynomial (within 2 ulp of
   expf); lanes below -87 give about 1e-38 rather than 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* SiLU(g) * u, 8 lanes: g * sigmoid(g), the sigmoid from t = e^-|g| (exp_nonpositive, which cannot
   overflow): 1 / (1 + t) for g >= 0, t / (1 + t) below; within 3.1e-7 of libm's (relative). libm's
   expf one lane at a time took 0.40-0.58 ms a SmolLM2 layer of 64 rows (1,536 channels, one
   thread), this 0.055-0.067 ms: 30 layers' 12-17 ms against 1.6-2.0 ms, a few percent of a
   64-token prompt step (a C harness over both, AVX2 EPYC, 2026-12-07). */
static inline __m256 silu_times(__m256 g, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = exp_nonpositive(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, t, g), _mm256_add_ps(one, t));
    return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

/* act[r][a..b) = SiLU(gate) * up for rows [0, m): gu's rows hold gate (the first I) then up. Every
   channel goes through silu_times (the last few through masked lanes), so a channel's value does
   not depend on where a thread's share starts or ends. */
static void silu_rows(const float *gu, float *act, int64_t m, int64_t I, int64_t a, int64_t b) {
    for (int64_t r = 0; r < m; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *out = act + r * I;
        int64_t j = a;
        for (; j + 8 <= b; j += 8)
            _mm256_storeu_ps(out + j, silu_times(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
        if (j < b) {
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(b - j)),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            _mm256_maskstore_ps(out + j, mask, silu_times(_mm256_maskload_ps(g + j, mask),
                                                          _mm256_maskload_ps(u + j, mask)));
        }
    }
}
#else
static void silu_rows(const float *gu, float *act, int64_t m, int64_t I, int64_t a, int64_t b) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = a; j < b; j++) {
            const float g = gu[r * 2 * I + j];
            act[r * I + j] = g / (1.0f + expf(-g)) * gu[r * 2 * I + I + j];
        }
}
#endif
#ifdef __AVX2__

/* DEFINE_ATTEND's computation for R rows at positions p0..p0+R-1 over one block table (a
   sequence's prefill chunk, or one decode: R = 1) and nh consecutive query heads from h0 (row i's
   head h0+j: q + i*ldq + j*DIM, out likewise with ldo; head h reads KV head h / rep). It walks the
   pool a block at a time and applies each block to every row and head while it is in cache (its
   rows are contiguous, so it streams from memory once, not once per query): q.k for four keys at
   once (independent accumulators, so the FMAs do not wait on each other, one horizontal add for all
   four), the exponentials 8 at a time, and the weighted sum of V with the output in registers.
   Every (row, head)'s sums run over the same keys in the same groups and order as they would alone
   (set by its own position and the block boundaries), so its result is the same whichever rows and
   heads share the call, the batch or the thread. scores: R * nh * ld_s floats, ld_s >= the last
   row's key count (p0 + R). out's first lane holds each query's running maximum until the weighted
   sum. The pool's elements are of type T, read as rows of type S (LOAD8(p): the 8 floats at p):
   SEGMENT gives a block segment's keys (or values) of one KV head, the pool's own rows
   (SEGMENT_KEEP) or, for a chunk over a float16 pool, an fp32 copy widened once per call (exactly:
   every float16 is a float), which the call's rows then read: a chunk's call is a run of up to 16
   rows and one query head (attention_items), so each element is converted once per run and query
   head instead of once per row. A 128-token chunk 1,000 positions deep took 0.82-0.83x the time,
   2,000 deep 0.79-0.81x (SmolLM2 w4a16-bf16prefill, two AMX Xeon cores, both builds in one process:
   bench/results/runner_llama.md S49-A). An fp32 pool's rows packed the same way gained nothing
   (0.97-1.00x), nor did a decode's one row (see attend). */
#define SEGMENT_KEEP(src, n, stride, dim, seg, widened, kvh) ((void)(seg), (void)(widened), (src))
#define DEFINE_ATTEND_AVX2(NAME, DIM, T, S, SEGMENT, LOAD8)                                        \
static void NAME(const magnitude_dims *d, const magnitude_layer *L, const float *q, int64_t ldq,  \
                 float *out, int64_t ldo, int64_t R, int64_t p0, const int64_t *table, int64_t h0, \
                 int64_t nh, int64_t rep, float *scores, int64_t ld_s) {                           \
    enum { NV = DIM / 8 };                                                                         \
    const int64_t bs = d->block_size, stride = d->kv_heads * DIM, last = p0 + R - 1;              \
    const __m128 scaling = _mm_set1_ps(d->scaling);                                                \
    float seg[sizeof(S) != sizeof(T) ? bs * DIM : 1];  /* SEGMENT's copy, where rows are widened */ \
    for (int64_t i = 0; i < R; i++)                                                                \
        for (int64_t j = 0; j < nh; j++) out[i * ldo + j * DIM] = -INFINITY;                       \
    for (int64_t p = first_key(p0, L->window); p <= last;) {                                       \
        int64_t blk = p / bs, in = p % bs, n = bs - in < last + 1 - p ? bs - in : last + 1 - p;    \
        const T *k0 = (const T *)L->k_cache + (table[blk] * bs + in) * stride;                    \
        for (int64_t j = 0, widened = -1; j < nh; j++) {                                           \
            const int64_t kvh = (h0 + j) / rep;                                                    \
            const S *kseg = SEGMENT(k0 + kvh * DIM, n, stride, DIM, seg, &widened, kvh);           \
            const int64_t kst = sizeof(S) != sizeof(T) ? DIM : stride;                             \
            for (int64_t i = 0; i < R; i++) {                                                      \
                int64_t lo, hi;                                                                    \
                const int64_t fi = keys_in_segment(p, n, p0 + i, L->window, &lo, &hi);             \
                if (lo >= hi) continue;                                                            \
                const float *qj = q + i * ldq + j * DIM;                                           \
                const S *kt = kseg + (lo - p) * kst;                                               \
                float *sj = scores + (i * nh + j) * ld_s, *oj = out + i * ldo + j * DIM;           \
                __m128 mx4 = _mm_set1_ps(oj[0]);                                                   \
                int64_t key = lo;                                                                  \
                for (; key + 4 <= hi; key += 4, kt += 4 * kst) {                                   \
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                    \
                    for (int e = 0; e < NV; e++) {                                                 \
                        __m256 qe = _mm256_loadu_ps(qj + 8 * e);                                   \
                        a0 = _mm256_fmadd_ps(qe, LOAD8(kt + 8 * e), a0);                           \
                        a1 = _mm256_fmadd_ps(qe, LOAD8(kt + kst + 8 * e), a1);                     \
                        a2 = _mm256_fmadd_ps(qe, LOAD8(kt + 2 * kst + 8 * e), a2);                 \
                        a3 = _mm256_fmadd_ps(qe, LOAD8(kt + 3 * kst + 8 * e), a3);                 \
                    }                                                                              \
                    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));     \
                    __m128 s = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), scaling); \
                    _mm_storeu_ps(sj + (key - fi), s);                                             \
                    mx4 = _mm_max_ps(mx4, s);                                                      \
                }                                                                                  \
                for (; key < hi; key++, kt += kst) {                                               \
                    __m256 acc = _mm256_setzero_ps();                                              \
                    for (int e = 0; e < NV; e++)                                                   \
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8 * e), LOAD8(kt + 8 * e), acc); \
                    __m128 s = _mm_mul_ss(_mm_set_ss(hsum(acc)), scaling);                         \
                    sj[key - fi] = _mm_cvtss_f32(s);                                               \
                    mx4 = _mm_max_ps(mx4, _mm_shuffle_ps(s, s, 0));                                \
                }                                                                                  \
                mx4 = _mm_max_ps(mx4, _mm_movehl_ps(mx4, mx4));                                    \
                mx4 = _mm_max_ps(mx4, _mm_shuffle_ps(mx4, mx4, 1));                                \
                oj[0] = _mm_cvtss_f32(mx4);                                                        \
            }                                                                                      \
        }                                                                                          \
        p += n;                                                                                    \
    }                                                                                              \
    float inv[R * nh];                                                                             \
    for (int64_t i = 0; i < R; i++)                                                                \
        for (int64_t j = 0; j < nh; j++) {                                                         \
            const int64_t count = p0 + i + 1 - first_key(p0 + i, L->window);                       \
            float *sj = scores + (i * nh + j) * ld_s, *oj = out + i * ldo + j * DIM;               \
            const __m256 mx = _mm256_set1_ps(oj[0]);                                               \
            __m256 sum = _mm256_setzero_ps();                                                      \
            for (int64_t t = 0; t < count; t += 8) {                                               \
                int64_t left = count - t;                                                          \
                __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)),  \
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));      \
                __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(sj + t, mask), mx));  \
                e = _mm256_and_ps(e, _mm256_castsi256_ps(mask));                                   \
                _mm256_maskstore_ps(sj + t, mask, e);                                              \
                sum = _mm256_add_ps(sum, e);                                                       \
            }                                                                                      \
            inv[i * nh + j] = 1.0f / hsum(sum);                                                    \
            for (int e = 0; e < NV; e++) _mm256_storeu_ps(oj + 8 * e, _mm256_setzero_ps());        \
        }                                                                                          \
    for (int64_t p = first_key(p0, L->window); p <= last;) {                                       \
        int64_t blk = p / bs, in = p % bs, n = bs - in < last + 1 - p ? bs - in : last + 1 - p;    \
        const T *v0 = (const T *)L->v_cache + (table[blk] * bs + in) * stride;                    \
        for (int64_t j = 0, widened = -1; j < nh; j++) {                                           \
            const int64_t kvh = (h0 + j) / rep;                                                    \
            const S *vseg = SEGMENT(v0 + kvh * DIM, n, stride, DIM, seg, &widened, kvh);           \
            const int64_t vst = sizeof(S) != sizeof(T) ? DIM : stride;                             \
            for (int64_t i = 0; i < R; i++) {                                                      \
                int64_t lo, hi;                                                                    \
                const int64_t fi = keys_in_segment(p, n, p0 + i, L->window, &lo, &hi);             \
                if (lo >= hi) continue;                                                            \
                const S *vt = vseg + (lo - p) * vst;                                               \
                const float *sj = scores + (i * nh + j) * ld_s;                                    \
                float *oj = out + i * ldo + j * DIM;                                               \
                __m256 o[NV];                                                                      \
                for (int e = 0; e < NV; e++) o[e] = _mm256_loadu_ps(oj + 8 * e);                   \
                for (int64_t key = lo; key < hi; key++, vt += vst) {                               \
                    __m256 w = _mm256_broadcast_ss(sj + (key - fi));                               \
                    for (int e = 0; e < NV; e++) o[e] = _mm256_fmadd_ps(w, LOAD8(vt + 8 * e), o[e]); \
                }                                                                                  \
                for (int e = 0; e < NV; e++) _mm256_storeu_ps(oj + 8 * e, o[e]);                   \
            }                                                                                      \
        }                                                                                          \
        p += n;                                                                                    \
    }                                                                                              \
    for (int64_t i = 0; i < R; i++)                                                                \
        for (int64_t j = 0; j < nh; j++)                                                           \
            for (int e = 0; e < NV; e++) {                                                         \
                float *oj = out + i * ldo + j * DIM + 8 * e;                                       \
                _mm256_storeu_ps(oj, _mm256_mul_ps(_mm256_loadu_ps(oj), _mm256_set1_ps(inv[i * nh + j]))); \
            }                                                                                      \
}
#define LOAD8_F32(p) _mm256_loadu_ps(p)
#define LOAD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
DEFINE_ATTEND_AVX2(attend_64_avx2, 64, float, float, SEGMENT_KEEP, LOAD8_F32)
DEFINE_ATTEND_AVX2(attend_128_avx2, 128, float, float, SEGMENT_KEEP, LOAD8_F32)
#ifdef __F16C__
/* The n rows of dim float16 values (stride elements apart) as floats in seg, unless seg already
   holds KV head kvh's (*widened). */
static inline const float *segment_widen_f16(const uint16_t *src, int64_t n, int64_t stride, int64_t dim, float *seg,
                                             int64_t *widened, int64_t kvh) {
    if (*widened != kvh) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t e = 0; e < dim; e += 8) _mm256_storeu_ps(seg + t * dim + e, LOAD8_F16(src + t * stride + e));
        *widened = kvh;
    }
    return seg;
}
DEFINE_ATTEND_AVX2(attend_64_avx2_f16, 64, uint16_t, uint16_t, SEGMENT_KEEP, LOAD8_F16)
DEFINE_ATTEND_AVX2(attend_128_avx2_f16, 128, uint16_t, uint16_t, SEGMENT_KEEP, LOAD8_F16)
DEFINE_ATTEND_AVX2(attend_64_avx2_f16_rows, 64, uint16_t, float, segment_widen_f16, LOAD8_F32)
DEFINE_ATTEND_AVX2(attend_128_avx2_f16_rows, 128, uint16_t, float, segment_widen_f16, LOAD8_F32)
#endif
#endif

/* Query heads [h0, h1) of R rows at positions p0.. over one block table (row i's q/k/v at
   qkv + i * ldq, its output at out + i * ldo). scores: R * (h1 - h0) * ld_s floats, ld_s at least
   p0 + R (the last row's keys). */
static void attend(const magnitude_dims *d, const magnitude_layer *L, const float *qkv, int64_t ldq, float *out,
                   int64_t ldo, int64_t R, int64_t p0, const int64_t *table, int64_t h0, int64_t h1, float *scores,
                   int64_t ld_s) {
    const int64_t D = d->head_dim, rep = d->heads / d->kv_heads;
#ifdef __AVX2__
    /* Over a float16 pool a chunk's rows read widened copies of each block (DEFINE_ATTEND_AVX2); a
       decode's one row reads the pool itself, converting as it goes: copying first cost it more. */
    void (*fn)(const magnitude_dims *, const magnitude_layer *, const float *, int64_t, float *, int64_t, int64_t,
               int64_t, const int64_t *, int64_t, int64_t, int64_t, float *, int64_t) = 0;
    if (!d->kv_f16)
        fn = D == 64 ? attend_64_avx2 : D == 128 ? attend_128_avx2 : 0;
#ifdef __F16C__
    else
        fn = D == 64 ? (R > 1 ? attend_64_avx2_f16_rows : attend_64_avx2_f16)
           : D == 128 ? (R > 1 ? attend_128_avx2_f16_rows : attend_128_avx2_f16) : 0;
#endif
    if (fn) {
        fn(d, L, qkv + h0 * D, ldq, out + h0 * D, ldo, R, p0, table, h0, h1 - h0, rep, scores, ld_s);
        return;
    }
#endif
    (void)ld_s;
    for (int64_t i = 0; i < R; i++)
        for (int64_t head = h0; head < h1; head++) {
            const int64_t pos = p0 + i, first = first_key(pos, L->window);
            const float *q = qkv + i * ldq + head * D;
            float *o = out + i * ldo + head * D;
            if (d->kv_f16) { attend_any_f16(d, L, q, o, first, pos, table, head / rep, scores); continue; }
#ifndef __AVX2__
            if (D == 64) { attend_64(d, L, q, o, first, pos, table, head / rep, scores); continue; }
            if (D == 128) { attend_128(d, L, q, o, first, pos, table, head / rep, scores); continue; }
#endif
            attend_any(d, L, q, o, first, pos, table, head / rep, scores);
        }
}

/* Attention work items: rows r0..r0+rows-1 (one block table, consecutive positions), heads [h0, h1). */
typedef struct { int64_t r0, rows, h0, h1; } attend_item;

/* Rows that share a block table at consecutive positions (a prefill chunk) go together, up to
   RUN_ROWS, one item per head: each pool block is then read once for all of them. A lone row (a
   decode) takes its heads in `parts` ranges, the fewest that give each thread about four items.
   Returns the item count; *units: the most (row, head) pairs one item holds. */
#define RUN_ROWS 16
static int64_t attention_items(const magnitude_dims *d, int64_t m, const int64_t *positions, const int64_t *tables,
                               int threads, attend_item *items, int64_t *units) {
    const int64_t want = (4 * (int64_t)threads + m - 1) / m, parts = want < d->heads ? want : d->heads;
    const size_t row_bytes = (size_t)d->table_width * sizeof(int64_t);
    int64_t n = 0;
    *units = (d->heads + parts - 1) / parts;
    for (int64_t r = 0, rows; r < m; r += rows) {
        for (rows = 1; r + rows < m && rows < RUN_ROWS && positions[r + rows] == positions[r] + rows
                       && !memcmp(tables + (r + rows) * d->table_width, tables + r * d->table_width, row_bytes);
             rows++) {}
        const int64_t k = rows > 1 ? d->heads : parts;
        for (int64_t p = 0; p < k; p++)
            items[n++] = (attend_item){r, rows, p * d->heads / k, (p + 1) * d->heads / k};
        if (rows > *units) *units = rows;
    }
    return n;
}

/* h [m][hidden] (the embeddings in, the last layer's residual stream out) through n_layers layers,
   then, with final_norm, the model's final RMSNorm (weight [hidden], final_eps) on every row.
   positions [m], tables [m][table_width] (block ids, checked by the caller), cos/sin [m][head_dim].
   Returns 0; -1 when out of memory, -2 for shapes it does not take (h and the pool are then
   unchanged, so the caller can run the step another way). */
int magnitude_decode_layers(const magnitude_dims *d, const magnitude_layer *layers, int64_t n_layers, float *h,
                            int64_t m, const int64_t *positions, const int64_t *tables, const float *cos,
                            const float *sin, const float *final_norm, float final_eps, int threads) {
    const int64_t H = d->hidden, D = d->head_dim, I = d->intermediate;
    const int64_t nqkv = (d->heads + 2 * d->kv_heads) * D, nattn = d->heads * D;
    const int64_t qkv_rows[3] = {d->heads * D, d->kv_heads * D, d->kv_heads * D}, gu_rows[2] = {I, I};
    int64_t max_len = 1;
    for (int64_t r = 0; r < m; r++) max_len = positions[r] + 1 > max_len ? positions[r] + 1 : max_len;
    /* Shared buffers: normed input, q/k/v, attention output, gate/up, the activation, and a
       scratch row set for products added into the residual stream. */
    size_t shared = (size_t)m * (H + nqkv + nattn + 2 * I + I + (H > I ? H : I));
    if (m <= 0 || D > 512 || D % 2) return -2;  /* nothing to do, or a head rope() cannot hold */
#ifndef __AVX2__
    if (d->dense_bf16) return -2;  /* no bf16 products in this build */
#endif
    float *buf = malloc(shared * sizeof(float));
    if (!buf) return -1;
    float *xn = buf, *qkv = xn + m * H, *attn = qkv + m * nqkv, *gu = attn + m * nattn, *act = gu + m * 2 * I,
          *tmp = act + m * I;
    spin_barrier bar = {0, 0, 1};
    attend_item *items = malloc((size_t)m * (size_t)d->heads * sizeof(attend_item));
    if (!items) {
        free(buf);
        return -1;
    }
    int64_t units;
    const int64_t n_items = attention_items(d, m, positions, tables, threads, items, &units);
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        int t, nt, sense = 0;
        team(&t, &nt);
        float *scores = malloc((size_t)max_len * (size_t)units * sizeof(float));
        /* integer rows for w4a8 and w4a16-int16: the widest product input is the MLP's (I) or
           attention's (nattn) */
        const int64_t widest = I > H ? (I > nattn ? I : nattn) : (H > nattn ? H : nattn);
        q8_scratch q8s = {0, 0, 0, 8}, *q8 = 0;
        if (d->act_int8) {
            q8s.bits = d->act_int8 == 2 ? 16 : 8;
            q8s.q = malloc((size_t)(m * widest * (q8s.bits / 8)));
            q8s.d = malloc((size_t)(2 * m * (widest / 32)) * sizeof(float));
            q8s.s = q8s.d ? q8s.d + m * (widest / 32) : 0;
            q8 = &q8s;
        }
        /* bf16 copies of the marked rows and a weight tile, where built for it (else every row exact);
           w4a16-int16 (q8) takes its marked rows in fp32 */
        bf16_scratch bf16s, *bf16 = 0;
        int64_t marked = 0;
        for (int64_t r = 0; !q8 && d->prompt_rows && r < m; r++) marked += d->prompt_rows[r] != 0;
        if (marked && magnitude_lowbit_bf16()) {
            if (bf16_scratch_alloc(&bf16s, marked, widest)) bf16 = &bf16s;
            else {
                bf16_scratch_free(&bf16s);
                #pragma omp atomic write
                failed = 1;
            }
        }
        if (!scores || (q8 && (!q8s.q || !q8s.d))) {
            #pragma omp atomic write
            failed = 1;
        }
        int64_t a, b;
        #pragma omp single
        bar.n = nt;  /* the team OpenMP gave, which may be smaller than asked */
        /* (the single's implicit barrier publishes bar.n and any failure) */
        if (!failed) {
            for (int64_t l = 0; l < n_layers; l++) {
                const magnitude_layer *L = layers + l;
                const uint16_t *const qkv_w[3] = {L->q_w, L->k_w, L->v_w}, *const gu_w[2] = {L->gate_w, L->up_w};
                rms_norm_rows(h, L->in_norm, xn, m, H, d->eps, t, nt);
                barrier_wait(&bar, &sense);
                share(nqkv, t, nt, &a, &b);
                if (d->dense_bf16) BF16_SHARE(xn, m, H, qkv_w, qkv_rows, 3, L->qkv_bias, qkv, nqkv, a, b, 0, 0);
                else int4_share(xn, m, H, L->qkv_codes, L->qkv_scales, L->qkv_mins, L->qkv_bias, qkv, nqkv, a, b, 0, 0, q8, 0, d->prompt_rows, bf16);
                barrier_wait(&bar, &sense);
                for (int64_t item = t; item < m * d->kv_heads; item += nt) {
                    int64_t r = item / d->kv_heads;
                    rope_and_store(d, L, qkv + r * nqkv, positions[r], tables + r * d->table_width, cos + r * D,
                                   sin + r * D, item % d->kv_heads);
                }
                barrier_wait(&bar, &sense);
                for (int64_t k = t; k < n_items; k += nt) {
                    const attend_item *it = items + k;
                    attend(d, L, qkv + it->r0 * nqkv, nqkv, attn + it->r0 * nattn, nattn, it->rows, positions[it->r0],
                           tables + it->r0 * d->table_width, it->h0, it->h1, scores, max_len);
                }
                barrier_wait(&bar, &sense);
                share(H, t, nt, &a, &b);
                if (d->dense_bf16) BF16_SHARE(attn, m, nattn, &L->o_w, &H, 1, L->o_bias, h, H, a, b, 1, tmp);
                else int4_share(attn, m, nattn, L->o_codes, L->o_scales, L->o_mins, L->o_bias, h, H, a, b, 1, tmp, q8, 0, d->prompt_rows, bf16);
                barrier_wait(&bar, &sense);
                rms_norm_rows(h, L->post_norm, xn, m, H, d->eps, t, nt);
                barrier_wait(&bar, &sense);
                /* Gate channel j and up channel j in the same thread, so the activation needs no barrier. */
                share(I, t, nt, &a, &b);
                if (d->dense_bf16) {
                    BF16_SHARE(xn, m, H, gu_w, gu_rows, 2, L->gu_bias, gu, 2 * I, a, b, 0, 0);
                    BF16_SHARE(xn, m, H, gu_w, gu_rows, 2, L->gu_bias, gu, 2 * I, I + a, I + b, 0, 0);
                } else {
                    int4_share(xn, m, H, L->gu_codes, L->gu_scales, L->gu_mins, L->gu_bias, gu, 2 * I, a, b, 0, 0, q8, 0, d->prompt_rows, bf16);
                    int4_share(xn, m, H, L->gu_codes, L->gu_scales, L->gu_mins, L->gu_bias, gu, 2 * I, I + a, I + b, 0, 0, q8, a < b, d->prompt_rows, bf16);
                }
                silu_rows(gu, act, m, I, a, b);
                barrier_wait(&bar, &sense);
                share(H, t, nt, &a, &b);
                if (d->dense_bf16) BF16_SHARE(act, m, I, &L->down_w, &H, 1, L->down_bias, h, H, a, b, 1, tmp);
                else int4_share(act, m, I, L->down_codes, L->down_scales, L->down_mins, L->down_bias, h, H, a, b, 1, tmp, q8, 0, d->prompt_rows, bf16);
                barrier_wait(&bar, &sense);
            }
            /* in place: a row's sum of squares is taken before any of it is written */
            if (final_norm) rms_norm_rows(h, final_norm, h, m, H, final_eps, t, nt);
        }
        free(scores);
        if (bf16) bf16_scratch_free(bf16);
        free(q8s.q);
        free(q8s.d);
    }
    free(items);
    free(buf);
    return failed ? -1 : 0;
}
