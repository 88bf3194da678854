/*
 * y = x W^T for the engine's linear layers, from a weight packed once at load time.
 *
 * Packed layout: the N output features are cut into panels of 16; panel p holds
 * W[16p .. 16p+15][0 .. K-1] transposed, K rows of 16 floats, contiguous (the last
 * panel is zero-padded). A step streams each panel once, front to back, which is all
 * a small batch needs: at 1-8 rows the layer is bound by reading the weight.
 *
 * Register tiles: MR rows of x times NP panels, accumulated over all of K in MR x NP
 * vector registers (a 16-float vector is one AVX-512 register, or two AVX2 ones:
 * GCC splits it). With -march=native the tile is sized for the machine at hand:
 * 4 x 4 with AVX-512's 32 registers, 4 x 2 with AVX2's 16. Threads split the panels,
 * so each streams its own share of the weight.
 *
 * The work-sharing loops are orphaned `omp for`s: called inside a parallel region
 * (the fused forward, llama.c) they share that region's threads; called outside one
 * they run on the calling thread, so rs_linear opens a region of its own.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

typedef float vf __attribute__((vector_size(64)));                /* aligned: packed */
typedef float vfu __attribute__((vector_size(64), aligned(4)));   /* unaligned rows */

#ifdef __AVX512F__
#define NP_MAX 4
#else
#define NP_MAX 2
#endif
#define MR_MAX 4

void rs_pack_weight(const float *w, int64_t N, int64_t K, float *packed)
{
    const int64_t panels = (N + RS_PANEL - 1) / RS_PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * K * RS_PANEL;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < RS_PANEL; j++) {
                const int64_t n = p * RS_PANEL + j;
                dst[k * RS_PANEL + j] = n < N ? w[n * K + k] : 0.0f;
            }
    }
}

/* One tile: rows x[0..MR) against panels [p0, p0 + NP). `n_left` is how many output
   columns remain from the tile's first one (the last panel may be partial). */
static inline __attribute__((always_inline)) void
tile(const int MR, const int NP, const float *x, int64_t ldx, const float *panel0,
     int64_t K, const float *bias, float *y, int64_t ldy, int64_t n_left, int accumulate)
{
    vf acc[MR_MAX][NP_MAX];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < NP; p++)
            acc[m][p] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf w[NP_MAX];
        for (int p = 0; p < NP; p++)
            w[p] = *(const vf *)(panel0 + (p * K + k) * RS_PANEL);
        for (int m = 0; m < MR; m++) {
            const float xm = x[m * ldx + k];
            for (int p = 0; p < NP; p++)
                acc[m][p] += xm * w[p];
        }
    }
    for (int p = 0; p < NP; p++) {
        const int64_t cols = n_left - p * RS_PANEL;
        if (cols <= 0)
            break;
        vf b = {0};
        if (bias != NULL) {
            if (cols >= RS_PANEL)
                b = *(const vfu *)(bias + p * RS_PANEL);
            else
                for (int64_t j = 0; j < cols; j++)
                    b[j] = bias[p * RS_PANEL + j];
        }
        for (int m = 0; m < MR; m++) {
            float *dst = y + m * ldy + p * RS_PANEL;
            vf v = acc[m][p] + b;
            if (cols >= RS_PANEL) {
                if (accumulate)
                    v += *(vfu *)dst;
                *(vfu *)dst = v;
            } else {
                for (int64_t j = 0; j < cols; j++)
                    dst[j] = accumulate ? dst[j] + v[j] : v[j];
            }
        }
    }
}

/* The tile shapes, instantiated with compile-time sizes so that the accumulators
   stay in registers. */
#define TILE(name, mr, np) \
    static void name(const float *x, int64_t ldx, const float *w, int64_t K, \
                                 const float *bias, float *y, int64_t ldy, int64_t n_left, \
                                 int acc) \
    { tile(mr, np, x, ldx, w, K, bias, y, ldy, n_left, acc); }
TILE(tile_1_wide, 1, NP_MAX) TILE(tile_2_wide, 2, NP_MAX)
TILE(tile_3_wide, 3, NP_MAX) TILE(tile_4_wide, 4, NP_MAX)
TILE(tile_1_one, 1, 1) TILE(tile_2_one, 2, 1) TILE(tile_3_one, 3, 1) TILE(tile_4_one, 4, 1)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const float *,
                        float *, int64_t, int64_t, int);
static const tile_fn TILES_WIDE[MR_MAX + 1] = {NULL, tile_1_wide, tile_2_wide, tile_3_wide,
                                                tile_4_wide};
static const tile_fn TILES_ONE[MR_MAX + 1] = {NULL, tile_1_one, tile_2_one, tile_3_one,
                                               tile_4_one};

void rs_linear_ws(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                  const float *bias, float *y, int accumulate)
{
    const int64_t panels = (N + RS_PANEL - 1) / RS_PANEL;
    const int nthreads = rs_num_threads();
    /* Contiguous panel ranges, one per thread, balanced to a panel. */
#pragma omp for schedule(static, 1)
    for (int t = 0; t < nthreads; t++) {
        const int64_t p_begin = panels * t / nthreads, p_end = panels * (t + 1) / nthreads;
        for (int64_t p = p_begin; p < p_end;) {
            const int np = p_end - p >= NP_MAX ? NP_MAX : 1;
            const tile_fn *tiles = np == NP_MAX ? TILES_WIDE : TILES_ONE;
            const float *w = packed + p * K * RS_PANEL;
            const int64_t n0 = p * RS_PANEL;
            for (int64_t m = 0; m < M; m += MR_MAX) {
                const int mr = M - m >= MR_MAX ? MR_MAX : (int)(M - m);
                tiles[mr](x + m * K, K, w, K, bias == NULL ? NULL : bias + n0,
                          y + m * N + n0, N, N - n0, accumulate);
            }
            p += np;
        }
    }
}

void rs_linear(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
               const float *bias, float *y, int accumulate)
{
#pragma omp parallel
    rs_linear_ws(x, M, K, packed, N, bias, y, accumulate);
}
