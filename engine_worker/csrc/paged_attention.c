/*
 * Paged attention for single-token queries (decode), on the CPU.
 *
 * Every query head of sequence b attends to the sequence's first context_lens[b]
 * keys, read in place through the block table: no gather copy. Query head i uses KV
 * head i / (Hq / Hkv) (grouped-query attention). Per sequence, two passes:
 *   1. scores: each token's keys (all heads: one contiguous row) are loaded once
 *      and dotted with every query head;
 *   2. softmax over the scores, then per head the probability-weighted sum of value
 *      rows, a block at a time (the block stays in L1 across heads).
 * Sequences are spread over OpenMP threads (torch's runtime: one pool). The fused
 * forward (llama.c) also gives each KV head its own thread when a step has fewer
 * tokens than threads (rs_attend_one takes a range of KV heads).
 *
 * Layout (row-major; float32, the cache float32 or bfloat16, kv_type):
 *   q            [B, Hq, D]
 *   k/v cache    [num_blocks, block_size, Hkv, D]
 *   block_tables [B, max_blocks] int64
 *   context_lens [B] int64
 *   out          [B, Hq, D]
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MAX_DIM 256

/* 16 floats: one AVX-512 register (GCC splits it on narrower targets). aligned(4)
   makes dereferences unaligned loads, since rows are only float-aligned. */
typedef rs_vf vfl;   /* one machine vector (kernels.h) */
#define LANES RS_VL

/* Pass 1 fetches key rows this many bytes ahead (16 tokens of SmolLM2's 3 x 64 keys),
   and each token's value row for pass 2, where a token's row is at most
   PREFETCH_MAX_ROW_BYTES: a sequence's keys are cold (the step's weights went through
   the cache since the last step read them) and its blocks scattered, and a block of
   short rows is too few lines for the hardware prefetchers to get going. Measured in
   a loop over many layers' caches (AMD EPYC, float32, batch 64 unless said): 1.16-1.22x
   less time with rows of 768 bytes (SmolLM2, 48 and 128 tokens of context), 1.28x with
   512 (2 x 64), 1.34x with 1 KiB (2 x 128); 0.97x with 2 KiB (4 x 128, batch 32) and
   0.88-0.93x with 4 KiB (8 x 128, batch 16-32), where the hardware does better alone.
   In the engine (benchmarks/engine.py --roofline, batch 64 over 96-128 tokens, runs
   with and without it alternating), attention took 16.1-19.4 ms a step against
   17.4-20.9, medians 16.8 and 19.9 (1.18x). */
#ifndef ATTN_AHEAD_BYTES
#define ATTN_AHEAD_BYTES 12288
#endif
#define PREFETCH_MAX_ROW_BYTES 1024

static inline void prefetch_row(const char *row, int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch(row + b, 0, 3);
}

/* Vector i of a cache row: float32 as it is, bfloat16 widened (its bits are the upper
   half of a float32's). kv_type is a constant where it is called, so each caller's
   loop is compiled for one type. */
static inline vfl kv_vec(const char *row, int64_t i, int kv_type)
{
    if (kv_type == RS_KV_BF16) {
        const rs_vi w = __builtin_convertvector(((const rs_vh *)row)[i], rs_vi) << 16;
        return (vfl)w;
    }
    return ((const vfl *)row)[i];
}

/* One sequence: the query heads of KV heads [g0, g1) against its first T tokens.
   D % 16 == 0. */
static inline __attribute__((always_inline)) void
attend_one(const float *q, const void *k_cache, const void *v_cache, int kv_type,
           const int64_t *table, int64_t T, float *out, float *scores, int64_t Hq,
           int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t g0, int64_t g1)
{
    const int64_t G = Hq / Hkv, i0 = g0 * G, i1 = g1 * G;
    const int64_t elem = kv_type == RS_KV_BF16 ? 2 : 4;
    const int64_t row_bytes = Hkv * D * elem;   /* a token's keys (or values), all heads */
    const int64_t head_bytes = D * elem;
    const int64_t used_bytes = (g1 - g0) * head_bytes;   /* of a row, from g0's head */
    const int64_t nv = D / LANES;
    /* Pass 1: scores[i][t] = scale * <q_i, k_t> for query head i (KV head i / G); the
       token's keys for all heads are one contiguous row. */
    const int fetch = ATTN_AHEAD_BYTES > 0 && row_bytes <= PREFETCH_MAX_ROW_BYTES;
    const int64_t ahead = ATTN_AHEAD_BYTES / row_bytes + 1;
#define ROW(cache, t) ((const char *)(cache) + (table[(t) / bs] * bs + (t) % bs) * row_bytes)
    for (int64_t t = 0; fetch && t < T && t < ahead; t++)
        prefetch_row(ROW(k_cache, t) + g0 * head_bytes, used_bytes);
    for (int64_t t = 0; t < T; t++) {
        const char *kt = ROW(k_cache, t);
        if (fetch) {
            if (t + ahead < T)
                prefetch_row(ROW(k_cache, t + ahead) + g0 * head_bytes, used_bytes);
            prefetch_row(ROW(v_cache, t) + g0 * head_bytes, used_bytes);
        }
        for (int64_t i = i0; i < i1; i++) {
            const vfl *qi = (const vfl *)(q + i * D);
            const char *ki = kt + (i / G) * head_bytes;
            vfl acc = qi[0] * kv_vec(ki, 0, kv_type);
            for (int64_t v = 1; v < nv; v++)
                acc += qi[v] * kv_vec(ki, v, kv_type);
            float dot = 0.0f;
            for (int l = 0; l < LANES; l++)
                dot += acc[l];
            scores[i * T + t] = dot * scale;
        }
    }
#undef ROW
    /* Softmax over t, per query head. */
    for (int64_t i = i0; i < i1; i++) {
        float *s = scores + i * T;
        float m = s[0];
        for (int64_t t = 1; t < T; t++)
            m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
        for (int64_t t = 0; t < T; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < T; t++)
            s[t] *= inv;
    }
    /* Pass 2: out_i = sum_t p[i][t] * v_t, one block of tokens at a time so that
       the block's value rows stay in L1 across the query heads; each head's sum is
       accumulated in registers within a block. */
    for (int64_t start = 0; start < T; start += bs) {
        const int64_t n = T - start < bs ? T - start : bs;
        const char *vb = (const char *)v_cache + table[start / bs] * bs * row_bytes;
        for (int64_t i = i0; i < i1; i++) {
            vfl *oi = (vfl *)(out + i * D);
            vfl acc[MAX_DIM / LANES];
            for (int64_t v = 0; v < nv; v++)
                acc[v] = start == 0 ? (vfl){0} : oi[v];
            const float *p = scores + i * T + start;
            const char *vi = vb + (i / G) * head_bytes;
            for (int64_t j = 0; j < n; j++) {
                const char *vt = vi + j * row_bytes;
                const float pj = p[j];
                for (int64_t v = 0; v < nv; v++)
                    acc[v] += pj * kv_vec(vt, v, kv_type);
            }
            for (int64_t v = 0; v < nv; v++)
                oi[v] = acc[v];
        }
    }
}

void rs_attend_one(const float *q, const void *k_cache, const void *v_cache, int kv_type,
                   const int64_t *table, int64_t T, float *out, float *scores,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t g0,
                   int64_t g1)
{
    /* The common shapes get compile-time sizes and cache types, so loops vectorize
       fully. */
#define ATTEND(type, d, b) attend_one(q, k_cache, v_cache, type, table, T, out, scores, \
                                      Hq, Hkv, d, b, scale, g0, g1)
    if (kv_type == RS_KV_BF16) {
        if (bs == 16 && D == 64)
            ATTEND(RS_KV_BF16, 64, 16);
        else if (bs == 16 && D == 128)
            ATTEND(RS_KV_BF16, 128, 16);
        else
            ATTEND(RS_KV_BF16, D, bs);
    } else if (bs == 16 && D == 64) {
        ATTEND(RS_KV_F32, 64, 16);
    } else if (bs == 16 && D == 128) {
        ATTEND(RS_KV_F32, 128, 16);
    } else {
        ATTEND(RS_KV_F32, D, bs);
    }
#undef ATTEND
}

int rs_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                              int kv_type, const int64_t *block_tables,
                              const int64_t *context_lens, float *out, int64_t B, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks,
                              float scale)
{
    if (D > MAX_DIM || D % LANES != 0)
        return -2;
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const int64_t T = context_lens[b];
        float *scores = (float *)malloc(sizeof(float) * (size_t)(Hq * T));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        rs_attend_one(q + b * Hq * D, k_cache, v_cache, kv_type, block_tables + b * max_blocks,
                      T, out + b * Hq * D, scores, Hq, Hkv, D, block_size, scale, 0, Hkv);
        free(scores);
    }
    return failed ? -1 : 0;
}
