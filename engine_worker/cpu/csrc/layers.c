/*
 * Fused elementwise layers for the Llama family on the CPU. Each replaces several
 * torch ops (and their per-op dispatch cost, which dominates at decode batch sizes)
 * with one pass over the step's tokens, spread over OpenMP threads by token.
 * All tensors are row-major float32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/*
 * residual = x + residual (or x when residual_in is NULL); out = RMSNorm(residual) * w.
 * x, residual_in, residual_out, out: [N, C]. residual_out may alias residual_in.
 */
void rs_add_rms_norm(const float *x, const float *residual_in, float *residual_out,
                     float *out, const float *weight, int64_t N, int64_t C, float eps)
{
#pragma omp parallel
    {
        RS_FAST_MODES;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *xr = x + n * C;
            float *rr = residual_out + n * C;
            float *orow = out + n * C;
            float sumsq = 0.0f;
            if (residual_in != NULL) {
                const float *ri = residual_in + n * C;
                for (int64_t c = 0; c < C; c++) {
                    const float h = xr[c] + ri[c];
                    rr[c] = h;
                    sumsq += h * h;
                }
            } else {
                for (int64_t c = 0; c < C; c++) {
                    rr[c] = xr[c];
                    sumsq += xr[c] * xr[c];
                }
            }
            const float inv = 1.0f / sqrtf(sumsq / (float)C + eps);
            for (int64_t c = 0; c < C; c++)
                orow[c] = weight[c] * (rr[c] * inv);
        }
    }
}

static inline void store_kv(void *cache, int kv_type, int64_t at, const float *src, int64_t n)
{
    if (kv_type == RS_KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++)
            dst[i] = rs_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)n);
    }
}

/* One token's row of a fused qkv projection: RoPE (rotate-half) on its q and k heads
   in place, then its k and v into cache slot `slot`. */
void rs_rope_write_kv_row(float *r, const float *cn, const float *sn, void *k_cache,
                          void *v_cache, int kv_type, int64_t slot, int64_t Hq, int64_t Hkv,
                          int64_t D)
{
    const int64_t half = D / 2;
    for (int64_t h = 0; cn != NULL && h < Hq + Hkv; h++) {   /* NULL: a layer without RoPE */
        float *x = r + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cn[i] - x2 * sn[i];
            x[i + half] = x2 * cn[i] + x1 * sn[i];
        }
    }
    store_kv(k_cache, kv_type, slot * Hkv * D, r + Hq * D, Hkv * D);
    store_kv(v_cache, kv_type, slot * Hkv * D, r + (Hq + Hkv) * D, Hkv * D);
}

/*
 * Rotary embedding (rotate-half convention) applied in place to the q and k heads of
 * a fused qkv projection, then k and v written into the paged cache.
 *   qkv      [N, (Hq + 2 Hkv) * D], q heads, then k heads, then v heads
 *   cos, sin [N, D / 2]
 *   k_cache, v_cache: [num_slots, Hkv, D] of kv_type (RS_KV_F32, RS_KV_BF16); slots [N]
 */
void rs_rope_write_kv(float *qkv, const float *cos, const float *sin,
                      void *k_cache, void *v_cache, int kv_type, const int64_t *slots,
                      int64_t N, int64_t Hq, int64_t Hkv, int64_t D)
{
    const int64_t half = D / 2;
    const int64_t row = (Hq + 2 * Hkv) * D;
#pragma omp parallel
    {
        RS_FAST_MODES;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++)
            rs_rope_write_kv_row(qkv + n * row, cos + n * half, sin + n * half, k_cache, v_cache,
                                 kv_type, slots[n], Hq, Hkv, D);
    }
}

/* out = act(gate) * up for one row (gate then up, I each): act silu, or with gelu
   GELU's tanh form, x sigmoid(2 y) with y = sqrt(2 / pi) (x + 0.044715 x^3). */
void rs_act_mul_row(const float *g, float *o, int64_t I, int gelu)
{
    const float *u = g + I;
    if (gelu)
        for (int64_t i = 0; i < I; i++)
            o[i] = g[i] / (1.0f + expf(-1.5957691216057308f
                                        * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
    else
        for (int64_t i = 0; i < I; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* out = silu(gate) * up (gelu: GELU's), where gate_up [N, 2 I] holds gate then up per
   row. */
void rs_silu_mul(const float *gate_up, float *out, int64_t N, int64_t I, int gelu)
{
#pragma omp parallel
    {
        RS_FAST_MODES;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++)
            rs_act_mul_row(gate_up + n * 2 * I, out + n * I, I, gelu);
    }
}
