/*
 * y = x W^T for the engine's linear layers, from a weight packed once at load time.
 *
 * Packed layout: the N output features are cut into panels of 16; panel p holds
 * W[16p .. 16p+15][0 .. K-1] transposed, K rows of 16 floats, contiguous (the last
 * panel is zero-padded). A step streams each panel once, front to back, which is all
 * a small batch needs: at 1-8 rows the layer is bound by reading the weight.
 *
 * Register tiles: MR rows of x times NP panels, accumulated over all of K in
 * registers. With -march=native the tile is sized for the machine at hand: 6 rows x 4
 * panels (24 of AVX-512's 32 registers), or 6 rows x 1 panel (12 of AVX2's 16, a
 * panel being two 8-float registers). Threads split the panels, so each streams its
 * own share of the weight.
 *
 * Weight formats: float32 panels are read in place. bfloat16 panels (K x 16 x 2 bytes)
 * and int8 panels (K x 16 bytes, then K/32 x 16 float scales: one per 32 inputs of an
 * output feature, GGUF Q8_0's blocking) are expanded, NP panels at a time, into a
 * per-thread float32 buffer that stays in L2, and the same tiles run on it: the
 * weight crosses the memory bus at 2 or ~1.1 bytes per element instead of 4.
 *
 * The work-sharing loops are orphaned `omp for`s: called inside a parallel region
 * (the fused forward, llama.c) they share that region's threads; called outside one
 * they run on the calling thread, so rs_linear opens a region of its own.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* A panel is PV machine vectors (kernels.h). */
#define VL RS_VL
#define PV (RS_PANEL / VL)
typedef float vf __attribute__((vector_size(VL * 4)));                /* aligned: packed */
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));   /* unaligned rows */

#ifdef __AVX512F__
#ifndef NP_MAX
#define NP_MAX 4
#endif
#ifndef WIDE_MAX_ROWS
#define WIDE_MAX_ROWS 8
#endif
#else
#ifndef NP_MAX
#define NP_MAX 2
#endif
#ifndef WIDE_MAX_ROWS
#define WIDE_MAX_ROWS 3
#endif
#endif
#ifndef MR_MAX
#define MR_MAX 6
#endif

typedef uint16_t vu16 __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));
typedef int8_t vi8 __attribute__((vector_size(VL), aligned(1)));

/* Bytes of one packed panel of K inputs. */
static int64_t panel_bytes(int64_t K, int format)
{
    switch (format) {
    case RS_BF16: return K * RS_PANEL * 2;
    case RS_INT8: return K * RS_PANEL + K / RS_INT8_BLOCK * RS_PANEL * 4;
    default: return K * RS_PANEL * 4;
    }
}

int64_t rs_packed_bytes(int64_t N, int64_t K, int format)
{
    return (N + RS_PANEL - 1) / RS_PANEL * panel_bytes(K, format);
}

static uint16_t to_bf16(float f)   /* round to nearest even */
{
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000)
        return (uint16_t)((bits >> 16) | 0x40);   /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* w [N, K] float32 -> packed panels in `format`. Returns -1 if int8 is asked for
   with K not a multiple of its block. */
int rs_pack_weight(const float *w, int64_t N, int64_t K, int format, void *packed)
{
    if (format == RS_INT8 && K % RS_INT8_BLOCK != 0)
        return -1;
    const int64_t panels = (N + RS_PANEL - 1) / RS_PANEL;
    const int64_t pb = panel_bytes(K, format);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        char *dst = (char *)packed + p * pb;
        for (int64_t j = 0; j < RS_PANEL; j++) {
            const int64_t n = p * RS_PANEL + j;
            const float *row = n < N ? w + n * K : NULL;
            if (format == RS_F32 || format == RS_BF16) {
                for (int64_t k = 0; k < K; k++) {
                    const float v = row ? row[k] : 0.0f;
                    if (format == RS_F32)
                        ((float *)dst)[k * RS_PANEL + j] = v;
                    else
                        ((uint16_t *)dst)[k * RS_PANEL + j] = to_bf16(v);
                }
                continue;
            }
            int8_t *q = (int8_t *)dst;
            float *scales = (float *)(dst + K * RS_PANEL);
            for (int64_t g = 0; g < K / RS_INT8_BLOCK; g++) {
                float amax = 0.0f;
                for (int64_t k = g * RS_INT8_BLOCK; row && k < (g + 1) * RS_INT8_BLOCK; k++)
                    amax = fabsf(row[k]) > amax ? fabsf(row[k]) : amax;
                const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                scales[g * RS_PANEL + j] = scale;
                for (int64_t k = g * RS_INT8_BLOCK; k < (g + 1) * RS_INT8_BLOCK; k++)
                    q[k * RS_PANEL + j] = row ? (int8_t)lrintf(row[k] * inv) : 0;
            }
        }
    }
    return 0;
}

/* VL int8 -> VL floats. GCC's __builtin_convertvector does this one element at a
   time (measured: int8 weights slower than float32), so the sign extension is an
   intrinsic where the ISA has one. */
static inline vf int8_to_float(const vi8 *src)
{
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
#else
    return __builtin_convertvector(__builtin_convertvector(*src, rs_vi), vf);
#endif
}

/* VL bfloat16 -> VL floats (the same: an intrinsic, not GCC's generic conversion). */
static inline vf bf16_to_float(const uint16_t *src)
{
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)),
                                 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16);
#else
    return (vf)(__builtin_convertvector(*(const vu16 *)src, vu32) << 16);
#endif
}

/* Panels [p, p + np) of a bf16 or int8 weight as float32 panels in `out`. */
static void expand_panels(const char *packed, int64_t p, int np, int64_t K, int format,
                          float *out)
{
    const int64_t pb = panel_bytes(K, format);
    for (int q = 0; q < np; q++) {
        const char *src = packed + (p + q) * pb;
        vf *dst = (vf *)(out + q * K * RS_PANEL);   /* K x PV vectors */
        if (format == RS_BF16) {
            for (int64_t i = 0; i < K * PV; i++)
                dst[i] = bf16_to_float((const uint16_t *)src + i * VL);
        } else {
            const vi8 *w8 = (const vi8 *)src;
            const vfu *scales = (const vfu *)(src + K * RS_PANEL);   /* PV per block */
            for (int64_t g = 0; g < K / RS_INT8_BLOCK; g++) {
                vf sc[PV];
                for (int v = 0; v < PV; v++)
                    sc[v] = scales[g * PV + v];
                const int64_t i0 = g * RS_INT8_BLOCK * PV;
                for (int64_t k = 0; k < RS_INT8_BLOCK; k++)
                    for (int v = 0; v < PV; v++)
                        dst[i0 + k * PV + v] = sc[v] * int8_to_float(w8 + i0 + k * PV + v);
            }
        }
    }
}

/* The float32 weight [N, K] a packed one stands for (tests check the formats with it). */
int rs_unpack_weight(const void *packed, int64_t N, int64_t K, int format, float *w)
{
    float *panel = aligned_alloc(64, (size_t)(K * RS_PANEL) * sizeof(float));
    if (panel == NULL)
        return -1;
    for (int64_t p = 0; p * RS_PANEL < N; p++) {
        const float *src = (const float *)packed + p * K * RS_PANEL;
        if (format != RS_F32) {
            expand_panels(packed, p, 1, K, format, panel);
            src = panel;
        }
        for (int64_t j = 0; j < RS_PANEL && p * RS_PANEL + j < N; j++)
            for (int64_t k = 0; k < K; k++)
                w[(p * RS_PANEL + j) * K + k] = src[k * RS_PANEL + j];
    }
    free(panel);
    return 0;
}

/* A float32 buffer per thread for expanded panels, grown as needed (kept). */
static float *expand_buffer(int64_t floats)
{
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (floats > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)floats * sizeof(float));
        cap = buf ? floats : 0;
    }
    return buf;
}

/* Weight vector v of a tile (panel v / PV, vector v % PV) at input k, as floats: read in
   place (float32), widened (bfloat16), or sign-extended and scaled (int8; `sc` holds
   the tile's scales for k's block). */
static inline __attribute__((always_inline)) vf
weight_vector(const int FORMAT, const char *panel0, int64_t pb, int v, int64_t k, const vf *sc)
{
    const int64_t at = k * RS_PANEL + (v % PV) * VL;   /* element index in its panel */
    const char *panel = panel0 + (v / PV) * pb;
    if (FORMAT == RS_BF16)
        return bf16_to_float((const uint16_t *)panel + at);
    if (FORMAT == RS_INT8)
        return sc[v] * int8_to_float((const vi8 *)(panel + at));
    return *(const vf *)((const float *)panel + at);
}

/* One tile: rows x[0..MR) against the NP panels at panel0, pb bytes apart, in FORMAT,
   accumulated over all of K in registers. `n_left` is how many output columns remain
   from the tile's first one (the last panel may be partial). */
static inline __attribute__((always_inline)) void
tile(const int MR, const int NP, const int FORMAT, const float *x, int64_t ldx,
     const char *panel0, int64_t pb, int64_t K, const float *bias, float *y, int64_t ldy,
     int64_t n_left, int accumulate)
{
    vf acc[8][NP_MAX * PV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NP * PV; v++)
            acc[m][v] = (vf){0};
    /* int8 runs block by block, loading the block's scales; the others in one go. */
    const int64_t kb = FORMAT == RS_INT8 ? RS_INT8_BLOCK : K;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        vf sc[NP_MAX * PV];
        if (FORMAT == RS_INT8)
            for (int v = 0; v < NP * PV; v++)
                sc[v] = *(const vfu *)(panel0 + (v / PV) * pb + K * RS_PANEL +
                                       ((k0 / RS_INT8_BLOCK) * RS_PANEL + (v % PV) * VL) * 4);
        for (int64_t k = k0; k < k0 + kb; k++) {
            vf w[NP_MAX * PV];
            for (int v = 0; v < NP * PV; v++)
                w[v] = weight_vector(FORMAT, panel0, pb, v, k, sc);
            for (int m = 0; m < MR; m++) {
                const float xm = x[m * ldx + k];
                for (int v = 0; v < NP * PV; v++)
                    acc[m][v] += xm * w[v];
            }
        }
    }
    for (int v = 0; v < NP * PV; v++) {
        const int64_t col = (v / PV) * RS_PANEL + (v % PV) * VL;  /* first column of v */
        const int64_t cols = n_left - col;
        if (cols <= 0)
            break;
        vf b = {0};
        if (bias != NULL) {
            if (cols >= VL)
                b = *(const vfu *)(bias + col);
            else
                for (int64_t j = 0; j < cols; j++)
                    b[j] = bias[col + j];
        }
        for (int m = 0; m < MR; m++) {
            float *dst = y + m * ldy + col;
            vf r = acc[m][v] + b;
            if (cols >= VL) {
                if (accumulate)
                    r += *(vfu *)dst;
                *(vfu *)dst = r;
            } else {
                for (int64_t j = 0; j < cols; j++)
                    dst[j] = accumulate ? dst[j] + r[j] : r[j];
            }
        }
    }
}

/* The tile shapes, instantiated with compile-time sizes and format so that the
   accumulators stay in registers: tiles[format][wide][rows]. */
typedef void (*tile_fn)(const float *, int64_t, const char *, int64_t, int64_t, const float *,
                        float *, int64_t, int64_t, int);
#define TILE(mr, np, f, name) \
    static void tile_##mr##_##name(const float *x, int64_t ldx, const char *w, int64_t pb, \
                                   int64_t K, const float *bias, float *y, int64_t ldy, \
                                   int64_t n_left, int acc) \
    { tile(mr, np, f, x, ldx, w, pb, K, bias, y, ldy, n_left, acc); }
#define TILES_ROWS(np, f, name) \
    TILE(1, np, f, name) TILE(2, np, f, name) TILE(3, np, f, name) TILE(4, np, f, name) \
    TILE(5, np, f, name) TILE(6, np, f, name) TILE(7, np, f, name) TILE(8, np, f, name)
TILES_ROWS(1, RS_F32, f32_one) TILES_ROWS(NP_MAX, RS_F32, f32_wide)
TILES_ROWS(1, RS_BF16, bf16_one) TILES_ROWS(NP_MAX, RS_BF16, bf16_wide)
TILES_ROWS(1, RS_INT8, int8_one) TILES_ROWS(NP_MAX, RS_INT8, int8_wide)
#define ROW(name) {NULL, tile_1_##name, tile_2_##name, tile_3_##name, tile_4_##name, \
                   tile_5_##name, tile_6_##name, tile_7_##name, tile_8_##name}
static const tile_fn TILES[3][2][9] = {{ROW(f32_one), ROW(f32_wide)},
                                       {ROW(bf16_one), ROW(bf16_wide)},
                                       {ROW(int8_one), ROW(int8_wide)}};

/* Up to this many rows, bfloat16 and int8 tiles convert the weight in registers; at
   more, row blocks would convert it again each, and expanding a group of panels into
   float32 once (in L2) is cheaper. */
#ifndef DIRECT_MAX_ROWS
#define DIRECT_MAX_ROWS 16
#endif

int rs_linear_ws(const float *x, int64_t M, int64_t K, const void *packed, int64_t N,
                 const float *bias, float *y, int accumulate, int format)
{
    const int64_t panels = (N + RS_PANEL - 1) / RS_PANEL;
    const int nthreads = rs_num_threads();
    const int expand = format != RS_F32 && M > DIRECT_MAX_ROWS;
    float *buf = expand ? expand_buffer(NP_MAX * K * RS_PANEL) : NULL;
    int failed = expand && buf == NULL;
    const int64_t pb = panel_bytes(K, format);
    /* Contiguous panel ranges, one per thread, balanced to a panel. */
#pragma omp for schedule(static, 1)
    for (int t = 0; t < nthreads; t++) {
        const int64_t p_begin = panels * t / nthreads, p_end = panels * (t + 1) / nthreads;
        for (int64_t p = p_begin; p < p_end && !failed;) {
            const int np = M <= WIDE_MAX_ROWS && p_end - p >= NP_MAX ? NP_MAX : 1;
            const char *w = (const char *)packed + p * pb;
            int64_t w_pb = pb;
            int w_format = format;
            if (expand) {
                expand_panels(packed, p, np, K, format, buf);
                w = (const char *)buf;
                w_pb = K * RS_PANEL * 4;
                w_format = RS_F32;
            }
            const tile_fn *tiles = TILES[w_format][np == NP_MAX];
            const int64_t n0 = p * RS_PANEL;
            /* Row blocks of near-equal size (8 rows: 4 + 4, not 6 + 2): a thin
               block has too few accumulators to hide the FMA latency. */
            const int64_t blocks = (M + MR_MAX - 1) / MR_MAX;
            for (int64_t b = 0, m = 0; b < blocks; b++) {
                const int mr = (int)((M * (b + 1)) / blocks - m);
                tiles[mr](x + m * K, K, w, w_pb, K, bias == NULL ? NULL : bias + n0,
                          y + m * N + n0, N, N - n0, accumulate);
                m += mr;
            }
            p += np;
        }
    }
    return failed ? -1 : 0;
}

int rs_linear(const float *x, int64_t M, int64_t K, const void *packed, int64_t N,
              const float *bias, float *y, int accumulate, int format)
{
    int failed = 0;
#pragma omp parallel reduction(|| : failed)
    failed = rs_linear_ws(x, M, K, packed, N, bias, y, accumulate, format) != 0;
    return failed ? -1 : 0;
}

/* Sum of n floats (n % 64 == 0), read once with all threads: what the roofline in
   benchmarks/engine.py takes as this machine's memory read bandwidth. */
float rs_read_all(const float *x, int64_t n)
{
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
        vf acc[64 / VL] = {{0}};
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 64)
            for (int j = 0; j < 64 / VL; j++)
                acc[j] += *(const vf *)(x + i + VL * j);
        for (int j = 0; j < 64 / VL; j++)
            for (int l = 0; l < VL; l++)
                total += acc[j][l];
    }
    return total;
}
