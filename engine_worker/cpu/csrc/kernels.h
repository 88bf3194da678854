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
#define RS_IQ4 4
#define RS_MXFP4 5
#define RS_INT8_BLOCK 32

/* float32 -> bfloat16, rounded to nearest even as torch rounds (NaN stays NaN). */
static inline uint16_t rs_to_bf16(float f)
{
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* Flush-to-zero and denormals-are-zero for one thread's part of a parallel region, and
   its own modes back when the region's scope ends: the kernels compute with subnormals
   as zeros (as -ffast-math builds assume), and the process that loads them keeps IEEE
   arithmetic in its own code (torch's, numpy's). The library is linked without
   -ffast-math, whose start-up code would set those modes for the whole process. Every
   parallel region of the kernels begins with RS_FAST_MODES. */
#if defined(__SSE__)
#include <xmmintrin.h>
#define RS_FTZ_DAZ 0x8040u
static inline void rs_restore_modes(const unsigned *csr) { _mm_setcsr(*csr); }
static inline unsigned rs_fast_modes(void)
{
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | RS_FTZ_DAZ);
    return csr;
}
#define RS_FAST_MODES \
    const unsigned rs_modes_ __attribute__((cleanup(rs_restore_modes))) = rs_fast_modes()
#else
#define RS_FAST_MODES do { } while (0)
#endif

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

/* Floats of per-thread scratch a step's attention needs (rs_attention_ws). */
int64_t rs_attention_scratch_floats(int64_t Hq, int64_t Hkv, int64_t D, int64_t max_ctx);

/* Floats of the buffer (shared by a parallel region's threads) where rs_attention_ws
   keeps the parts of decode rows whose keys it splits across threads. */
int64_t rs_attention_partial_floats(int64_t Hq, int64_t Hkv, int64_t D, int64_t threads);

/* Splits a step's N tokens into query tiles (paged_attention.c): runs of a sequence's
   consecutive tokens (a prompt chunk), each token alone otherwise. starts: N + 1
   entries, tile i is tokens [starts[i], starts[i + 1]). Returns the number of tiles. */
int64_t rs_attention_tiles(int64_t N, const int64_t *seq, const int64_t *ctx_lens, int64_t Hq,
                           int64_t Hkv, int64_t *starts);

/* Attention of a step's tokens (token n: its q row at q + n q_stride, its output row
   at out + n out_stride, the block table row seq[n], ctx_lens[n] keys, or the last W
   of them where W > 0: a sliding window; scores soft-capped, cap tanh(s / cap), where
   cap > 0; sinks, where not NULL: each query head's sink logit, in its softmax beside
   the scores (gpt-oss)), tiled by rs_attention_tiles. A work-sharing
   loop, as rs_linear_ws; scratch: this thread's rs_attention_scratch_floats; partial:
   rs_attention_partial_floats, shared. */
void rs_attention_ws(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                     int kv_type, const int64_t *seq, const int64_t *ctx_lens,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *starts,
                     int64_t tiles, float *out, int64_t out_stride, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t bs, float scale, float cap, const float *sinks,
                     int64_t W, float *scratch, float *partial);

/* act(gate) * up for one row of gate then up (I each): silu, or gelu (its tanh form)
   (layers.c). */
void rs_act_mul_row(const float *g, float *o, int64_t I, int gelu);

/* RoPE on one token's q and k heads (in its fused qkv row), then its k and v into
   cache slot `slot` (layers.c). cn, sn: the token's D / 2 cos and sin. */
void rs_rope_write_kv_row(float *r, const float *cn, const float *sn, void *k_cache,
                          void *v_cache, int kv_type, int64_t slot, int64_t Hq, int64_t Hkv,
                          int64_t D);

#endif
