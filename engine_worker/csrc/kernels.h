/* Shared between the engine's C kernels (one shared object, see kernels.py). */
#ifndef RS_KERNELS_H
#define RS_KERNELS_H

#include <stdint.h>
#include <omp.h>

/* Output features per panel of a packed weight (gemm.c). */
#define RS_PANEL 16

/* Threads of the enclosing parallel region (1 outside one). */
static inline int rs_num_threads(void) { return omp_get_num_threads(); }

/* y[M, N] (+)= x[M, K] W^T (+ bias), W packed by rs_pack_weight. A work-sharing
   loop: inside a parallel region the region's threads split it. */
void rs_linear_ws(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                  const float *bias, float *y, int accumulate);

/* Decode-style attention of one query row (all heads) over its sequence's first T
   tokens, read through its block table (paged_attention.c). scores: Hq * T floats. */
void rs_attend_one(const float *q, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t T, float *out, float *scores,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale);

#endif
