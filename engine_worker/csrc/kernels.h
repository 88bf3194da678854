/* Shared between the engine's C kernels (one shared object, see kernels.py). */
#ifndef RS_KERNELS_H
#define RS_KERNELS_H

#include <stdint.h>
#include <omp.h>

/* Floats per machine vector: 16 with AVX-512, 8 otherwise (AVX2). Kernels use vectors
   of this size: a wider generic vector on an AVX2 target is split by GCC into register
   pairs, badly (measured: 3-12x slower GEMM tiles, ~2.5x slower attention). */
#ifdef __AVX512F__
#define RS_VL 16
#else
#define RS_VL 8
#endif
typedef float rs_vf __attribute__((vector_size(RS_VL * 4), aligned(4)));   /* unaligned */
typedef int32_t rs_vi __attribute__((vector_size(RS_VL * 4)));
typedef uint16_t rs_vh __attribute__((vector_size(RS_VL * 2), aligned(2)));  /* unaligned */

/* Output features per panel of a packed weight (gemm.c). */
#define RS_PANEL 16
/* Packed weight formats, and the int8 and 4-bit formats' inputs per scale. */
#define RS_F32 0
#define RS_BF16 1
#define RS_INT8 2
#define RS_Q4 3
#define RS_INT8_BLOCK 32

/* float32 -> bfloat16, rounded to nearest even as torch rounds (NaN stays NaN). */
static inline uint16_t rs_to_bf16(float f)
{
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* Threads of the enclosing parallel region (1 outside one). */
static inline int rs_num_threads(void) { return omp_get_num_threads(); }

/* y[M, N] (+)= x[M, K] W^T (+ bias), W packed by rs_pack_weight in `format`, at a
   64-byte aligned address (the tiles load panels with aligned vector loads; torch's CPU
   allocations are 64-byte aligned). A work-sharing loop: inside a parallel region the
   region's threads split it.
   Returns -1 (on the threads that could not get scratch memory) or 0. */
int rs_linear_ws(const float *x, int64_t M, int64_t K, const void *packed, int64_t N,
                 const float *bias, float *y, int accumulate, int format);

/* KV cache element types: float32, or bfloat16 (the upper half of a float32,
   rounded to nearest even when written). */
#define RS_KV_F32 0
#define RS_KV_BF16 1

/* Decode-style attention of one query row over its sequence's first T tokens, read
   through its block table (paged_attention.c): the query heads of KV heads [g0, g1)
   (0, Hkv: all). scores: Hq * T floats. */
void rs_attend_one(const float *q, const void *k_cache, const void *v_cache, int kv_type,
                   const int64_t *table, int64_t T, float *out, float *scores,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t g0,
                   int64_t g1);

/* RoPE on one token's q and k heads (in its fused qkv row), then its k and v into
   cache slot `slot` (layers.c). cn, sn: the token's D / 2 cos and sin. */
void rs_rope_write_kv_row(float *r, const float *cn, const float *sn, void *k_cache,
                          void *v_cache, int kv_type, int64_t slot, int64_t Hq, int64_t Hkv,
                          int64_t D);

#endif
