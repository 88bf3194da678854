/*
 * Paged attention on the CPU: every query token of a step attends to the first
 * context_lens[n] keys of its sequence (seq[n]), or with a sliding window W to the
 * last W of them, read in place through the sequence's block table (no gather copy). Query head i uses KV head i / (Hq / Hkv) (grouped-
 * query attention). A step's tokens are split into tiles (rs_attention_tiles):
 *
 * - A token alone (a decode row): attend_one, two passes. 1. scores, 4 tokens at a
 *   time: each KV head's keys are widened once for its query heads, and each head's
 *   4 dot products summed across their vectors together; 2. softmax over the scores,
 *   then the probability-weighted sum of value rows, a block at a time, each KV head's
 *   values widened once for up to 4 of its query heads.
 * - A run of a sequence's consecutive tokens (a prompt chunk): attend_tile, up to
 *   TILE_ROWS (token, head) rows of a KV head at once, below.
 *
 * Tiles are spread over OpenMP threads (torch's runtime: one pool) by rs_attention_ws:
 * a chunk's tiles a KV head apiece, decode rows whole (a KV head apiece when there are
 * fewer tiles than threads), and a few decode rows over long contexts in parts.
 *
 * Layout (row-major; float32, the cache float32 or bfloat16, kv_type):
 *   q, out       [N, Hq, D] (rows q_stride, out_stride floats apart in the fused forward)
 *   k/v cache    [num_blocks, block_size, Hkv, D]
 *   block_tables [num_seqs, max_blocks] int64
 *   seq, context_lens [N] int64
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

#define MAX_DIM 256
/* A score that no key of a row may have: exp of it less any real maximum is 0. */
#define MASKED (-1e30f)

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
        /* One zero-extending load. GCC lowers the generic conversion below to two
           half-width ones and an insert: decode attention over a bfloat16 cache
           measured 1.27-1.34x slower with it (AVX-512, Zen 5). */
#if defined(__AVX512F__)
        return (vfl)_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row + i)), 16);
#elif defined(__AVX2__)
        return (vfl)_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)row + i)), 16);
#else
        const rs_vi w = __builtin_convertvector(((const rs_vh *)row)[i], rs_vi) << 16;
        return (vfl)w;
#endif
    }
    return ((const vfl *)row)[i];
}

/* f(NG, ...) for NG = ng (1 to 4), a constant in each call, so that f's accumulators
   stay in registers. */
#define FOR_HEADS(ng, f, ...) \
    ((ng) == 4 ? f(4, __VA_ARGS__) : (ng) == 3 ? f(3, __VA_ARGS__) \
                                   : (ng) == 2 ? f(2, __VA_ARGS__) : f(1, __VA_ARGS__))

#if defined(__AVX2__)
/* The sums of the lanes of a, b, c and d, in that order. */
static inline __m128 sum4(vfl a, vfl b, vfl c, vfl d)
{
#if defined(__AVX512F__)
#define HALVES(x) _mm256_add_ps(_mm512_castps512_ps256((__m512)(x)), _mm256_castpd_ps( \
                      _mm512_extractf64x4_pd(_mm512_castps_pd((__m512)(x)), 1)))
    const __m256 a8 = HALVES(a), b8 = HALVES(b), c8 = HALVES(c), d8 = HALVES(d);
#undef HALVES
#else
    const __m256 a8 = (__m256)a, b8 = (__m256)b, c8 = (__m256)c, d8 = (__m256)d;
#endif
    /* each 128-bit half: a's, b's, c's and d's sums of its 4 lanes */
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of NG query heads (q: the first, D floats apart) against 4 tokens' keys of
   their KV head (k[j]: token j's), times scale, into s[g * T + j]: each key vector
   widened once for the NG heads, and each head's 4 sums taken together (sum4), not
   one across a vector at a time. */
static inline __attribute__((always_inline)) void
scores_of_4(const int NG, const float *q, const char *const k[4], int kv_type, int64_t D,
            float scale, float *s, int64_t T)
{
    vfl acc[4][4];
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < 4; j++)
            acc[g][j] = (vfl){0};
    for (int64_t v = 0; v < D / LANES; v++)
        for (int j = 0; j < 4; j++) {
            const vfl kv = kv_vec(k[j], v, kv_type);
            for (int g = 0; g < NG; g++)
                acc[g][j] += ((const vfl *)(q + g * D))[v] * kv;
        }
    for (int g = 0; g < NG; g++)
        _mm_storeu_ps(s + g * T, _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]),
                                            _mm_set1_ps(scale)));
}
#endif

/* out[g * D ...] (+)= sum_j p[g * T + j] v_j for NG query heads of one KV head over
   n tokens' value rows (v_j at vh + j row_bytes), each value vector widened once for
   the NG heads; each head's sum taken in the order of j, as one head at a time would. */
static inline __attribute__((always_inline)) void
values_of(const int NG, float *out, const float *p, int64_t T, const char *vh,
          int64_t row_bytes, int64_t n, int kv_type, int64_t D, int first)
{
    const int64_t nv = D / LANES;
    vfl acc[4][MAX_DIM / LANES];
    for (int g = 0; g < NG; g++)
        for (int64_t v = 0; v < nv; v++)
            acc[g][v] = first ? (vfl){0} : ((const vfl *)(out + g * D))[v];
    for (int64_t j = 0; j < n; j++) {
        const char *vt = vh + j * row_bytes;
        for (int64_t v = 0; v < nv; v++) {
            const vfl vv = kv_vec(vt, v, kv_type);
            for (int g = 0; g < NG; g++)
                acc[g][v] += p[g * T + j] * vv;
        }
    }
    for (int g = 0; g < NG; g++)
        for (int64_t v = 0; v < nv; v++)
            ((vfl *)(out + g * D))[v] = acc[g][v];
}

/* One query row: the query heads of KV heads [g0, g1) against its sequence's tokens
   [t0, t1) (t0 a multiple of bs), those below lo (a sliding window's first) masked.
   ml NULL: out is the attention over them (with head i's sink logit sinks[i] in its
   softmax, where sinks is given); else out is the unnormalized sum and ml[2 i],
   ml[2 i + 1] head i's largest score and sum of exponentials (for merge_parts, which
   adds the sink). D % 16 == 0. */
static inline __attribute__((always_inline)) void
attend_one(const float *q, const void *k_cache, const void *v_cache, int kv_type,
           const int64_t *table, int64_t t0, int64_t t1, int64_t lo, float *out, float *ml,
           float *scores, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
           float cap, const float *sinks, int64_t g0, int64_t g1)
{
    const int64_t T = t1 - t0;
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
        prefetch_row(ROW(k_cache, t0 + t) + g0 * head_bytes, used_bytes);
#define FETCH(t) do { \
        if (fetch) { \
            if ((t) + ahead < T) \
                prefetch_row(ROW(k_cache, t0 + (t) + ahead) + g0 * head_bytes, used_bytes); \
            prefetch_row(ROW(v_cache, t0 + (t)) + g0 * head_bytes, used_bytes); \
        } \
    } while (0)
    int64_t t = 0;
#if defined(__AVX2__)
    for (; t + 4 <= T; t += 4) {
        const char *rows[4];
        for (int j = 0; j < 4; j++) {
            rows[j] = ROW(k_cache, t0 + t + j);
            FETCH(t + j);
        }
        for (int64_t h = g0; h < g1; h++) {
            const char *k[4];
            for (int j = 0; j < 4; j++)
                k[j] = rows[j] + h * head_bytes;
            for (int64_t i = h * G; i < (h + 1) * G; i += 4) {
                const int64_t ng = (h + 1) * G - i < 4 ? (h + 1) * G - i : 4;
                FOR_HEADS(ng, scores_of_4, q + i * D, k, kv_type, D, scale,
                          scores + i * T + t, T);
            }
        }
    }
#endif
    for (; t < T; t++) {   /* one token at a time: the last few */
        const char *kt = ROW(k_cache, t0 + t);
        FETCH(t);
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
#undef FETCH
#undef ROW
    /* Softmax over t, per query head (keys below the window's first at 0), of the
       scores soft-capped first where cap > 0 (Gemma 2: cap tanh(s / cap)). */
    for (int64_t i = i0; i < i1; i++) {
        float *s = scores + i * T;
        if (cap > 0.0f)
            for (int64_t t = 0; t < T; t++)
                s[t] = cap * tanhf(s[t] / cap);
        for (int64_t t = 0; t < lo - t0 && t < T; t++)
            s[t] = MASKED;
        float m = s[0];
        for (int64_t t = 1; t < T; t++)
            m = s[t] > m ? s[t] : m;
        /* gpt-oss: head i's sink logit in the softmax (a split row's, where the parts
           merge) */
        const int sink = sinks != NULL && ml == NULL;
        m = sink && sinks[i] > m ? sinks[i] : m;
        float sum = sink ? expf(sinks[i] - m) : 0.0f;
        for (int64_t t = 0; t < T; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        if (ml != NULL) {
            ml[2 * i] = m;
            ml[2 * i + 1] = sum;
            continue;
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
        const char *vb = (const char *)v_cache + table[(t0 + start) / bs] * bs * row_bytes;
        /* a KV head's value vectors widened once for up to 4 of its query heads (as
           many as 16 accumulators hold) */
        const int64_t most = nv <= 4 ? 4 : nv <= 8 ? 2 : 1;
        for (int64_t h = g0; h < g1; h++)
            for (int64_t i = h * G; i < (h + 1) * G; i += most) {
                const int64_t ng = (h + 1) * G - i < most ? (h + 1) * G - i : most;
                FOR_HEADS(ng, values_of, out + i * D, scores + i * T + start, T,
                          vb + h * head_bytes, row_bytes, n, kv_type, D, start == 0);
            }
    }
}

/* attend_one for the model's shapes. scores: Hq * (t1 - t0) floats. Out of line, as it
   was before query tiles came: inlined into rs_attention_ws, batch-64 decode attention
   measured 2-5% slower (alternating runs, AMD EPYC Zen 5). */
static __attribute__((noinline)) void
attend_row(const float *q, const void *k_cache, const void *v_cache, int kv_type,
           const int64_t *table, int64_t t0, int64_t t1, int64_t lo, float *out, float *ml,
           float *scores, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
           float cap, const float *sinks, int64_t g0, int64_t g1)
{
    /* The common shapes get compile-time sizes and cache types, so loops vectorize
       fully. */
#define ATTEND(type, d, b) attend_one(q, k_cache, v_cache, type, table, t0, t1, lo, out, \
                                      ml, scores, Hq, Hkv, d, b, scale, cap, sinks, \
                                      g0, g1)
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

/* ---- Prompt chunks: query tiles ------------------------------------------------------
 *
 * A prompt chunk's tokens are queries of one sequence with consecutive context lengths.
 * Attending them one at a time (attend_one) reads every key and value once per query,
 * and sums each score across a vector: a 4,096-token prompt spent 85% of its prefill
 * there. attend_tile takes up to TILE_ROWS (query token, head) rows of one KV head at
 * once, one row per vector lane ("rows as lanes"): each key is read once for the tile,
 * broadcast against the rows' transposed queries, and the softmax runs online (a
 * running maximum and sum per lane, flash-attention style) over groups of TILE_KEYS
 * keys, with no sum across lanes anywhere. */

/* Row vectors of a tile: 4 with AVX-512 (64 rows; 16 accumulators of 32 registers),
   2 with AVX2 (16 rows: its 16 registers; 4 measured 1.17x slower, spilling). */
#ifdef __AVX512F__
#define TILE_RV 4
#else
#define TILE_RV 2
#endif
#define TILE_ROWS (TILE_RV * LANES)
/* Keys per online-softmax update. */
#define TILE_KEYS 16
/* Query tokens per tile for G query heads per KV head (0: tiles do not apply, the
   tokens are attended one at a time). */
static inline int64_t tile_tokens(int64_t G)
{
    return G <= TILE_ROWS ? TILE_ROWS / G : 0;
}

int64_t rs_attention_scratch_floats(int64_t Hq, int64_t Hkv, int64_t D, int64_t max_ctx)
{
    (void)Hkv;
    const int64_t one = Hq * max_ctx;   /* attend_one's scores */
    /* attend_tile: transposed queries and outputs, scores, widened keys and values,
       running maxima and sums */
    const int64_t tile = 2 * D * TILE_ROWS + TILE_KEYS * TILE_ROWS + 2 * TILE_KEYS * D
                         + 2 * TILE_ROWS + LANES;
    return one > tile ? one : tile;
}

/* Loads the vector into a register once for all its uses (GCC would fold the load
   into each multiply-add that reads it: two loads an FMA, more than the load ports
   feed). */
#define IN_REGISTER(x) __asm__("" : "+v"(x))

static inline vfl vexp(vfl x)
{
    vfl r;
    for (int l = 0; l < LANES; l++)
        r[l] = expf(x[l]);
    return r;
}

/* a where the mask (a comparison's result) is set, else b */
static inline vfl vselect(rs_vi mask, vfl a, vfl b)
{
    return (vfl)(((rs_vi)a & mask) | ((rs_vi)b & ~mask));
}

static inline vfl vmax(vfl a, vfl b) { return vselect(a > b, a, b); }

/* Scores S[t][v] = <q_row, k_t> (the queries already scaled) for keys [0, n) of the
   group, rows as lanes: QT [D][RV] vectors, keys rows of D floats. */
static inline __attribute__((always_inline)) void
tile_scores(const int RV, const vfl *QT, const float *const *keys, int64_t n, int64_t D,
            vfl *S)
{
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        vfl acc[TILE_RV][4];
        for (int v = 0; v < RV; v++)
            for (int j = 0; j < 4; j++)
                acc[v][j] = (vfl){0};
        for (int64_t d = 0; d < D; d++) {
            vfl kd[4];
            for (int j = 0; j < 4; j++)
                kd[j] = (vfl){0} + keys[t + j][d];
            for (int v = 0; v < RV; v++) {
                vfl q = QT[d * TILE_RV + v];
                IN_REGISTER(q);
                for (int j = 0; j < 4; j++)
                    acc[v][j] += q * kd[j];
            }
        }
        for (int j = 0; j < 4; j++)
            for (int v = 0; v < RV; v++)
                S[(t + j) * TILE_RV + v] = acc[v][j];
    }
    for (; t < n; t++) {
        vfl acc[TILE_RV];
        for (int v = 0; v < RV; v++)
            acc[v] = (vfl){0};
        for (int64_t d = 0; d < D; d++)
            for (int v = 0; v < RV; v++)
                acc[v] += QT[d * TILE_RV + v] * keys[t][d];
        for (int v = 0; v < RV; v++)
            S[t * TILE_RV + v] = acc[v];
    }
}

/* OT[d][v] = OT[d][v] * alpha[v] + sum_t P[t][v] * values[t][d], for keys [0, n). */
static inline __attribute__((always_inline)) void
tile_values(const int RV, vfl *OT, const vfl *alpha, const vfl *P,
            const float *const *values, int64_t n, int64_t D)
{
    for (int64_t d = 0; d < D; d += 4) {   /* D % 16 == 0 */
        vfl acc[TILE_RV][4];
        for (int v = 0; v < RV; v++)
            for (int j = 0; j < 4; j++)
                acc[v][j] = OT[(d + j) * TILE_RV + v] * alpha[v];
        for (int64_t t = 0; t < n; t++) {
            vfl vt[4];
            for (int j = 0; j < 4; j++)
                vt[j] = (vfl){0} + values[t][d + j];
            for (int v = 0; v < RV; v++) {
                vfl p = P[t * TILE_RV + v];
                IN_REGISTER(p);
                for (int j = 0; j < 4; j++)
                    acc[v][j] += p * vt[j];
            }
        }
        for (int v = 0; v < RV; v++)
            for (int j = 0; j < 4; j++)
                OT[(d + j) * TILE_RV + v] = acc[v][j];
    }
}

/* Query tokens [0, nq) of one sequence (token j attends to its first c0 + j tokens,
   or with a window W > 0 to the last W of them), the G query heads of KV head g: row
   r is token r / G, head g G + r % G. q and out are the tokens' rows (q_stride,
   out_stride floats apart, heads D apart). nq * G <= TILE_ROWS. */
static inline __attribute__((always_inline)) void
attend_tile(const int RV, const float *q, int64_t q_stride, int64_t nq, const void *k_cache,
            const void *v_cache, int kv_type, const int64_t *table, int64_t c0, int64_t W,
            float *out, int64_t out_stride, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
            float scale, float cap, const float *sinks, int64_t g, float *scratch)
{
    const int64_t G = Hq / Hkv, R = nq * G;
    const int64_t elem = kv_type == RS_KV_BF16 ? 2 : 4;
    const int64_t row_bytes = Hkv * D * elem, head = g * D * elem;
    vfl *QT = (vfl *)scratch;                   /* [D][TILE_RV] */
    vfl *OT = QT + D * TILE_RV;                 /* [D][TILE_RV] */
    vfl *S = OT + D * TILE_RV;                  /* [TILE_KEYS][TILE_RV]: scores, then p */
    float *wide = (float *)(S + TILE_KEYS * TILE_RV);   /* [2][TILE_KEYS][D] */
    vfl *m = (vfl *)(wide + 2 * TILE_KEYS * D); /* [TILE_RV] running maxima */
    vfl *l = m + TILE_RV;                       /* [TILE_RV] running sums */
    vfl ctx[TILE_RV], low[TILE_RV];             /* keys each row sees: [low, ctx) */
    for (int v = 0; v < RV; v++) {
        for (int i = 0; i < LANES; i++) {
            const int64_t r = v * LANES + i;
            ctx[v][i] = r < R ? (float)(c0 + r / G) : (float)(c0 + nq);
            low[v][i] = W > 0 ? ctx[v][i] - (float)W : -1.0f;
        }
        m[v] = (vfl){0} + MASKED;
        l[v] = (vfl){0};
    }
    for (int64_t d = 0; d < D; d++)
        for (int v = 0; v < RV; v++) {
            vfl x = {0};
            for (int i = 0; i < LANES; i++) {
                const int64_t r = v * LANES + i;
                x[i] = r < R ? q[r / G * q_stride + (g * G + r % G) * D + d] * scale : 0.0f;
            }
            QT[d * TILE_RV + v] = x;
            OT[d * TILE_RV + v] = (vfl){0};
        }
    const int64_t end = c0 + nq - 1;   /* the last row's context */
    /* the first row's first key; the rows after it see none before */
    const int64_t first = W > 0 && c0 > W ? c0 - W : 0;
    for (int64_t k0 = first; k0 < end; k0 += TILE_KEYS) {
        const int64_t n = end - k0 < TILE_KEYS ? end - k0 : TILE_KEYS;
        const float *keys[TILE_KEYS], *values[TILE_KEYS];
        for (int64_t t = 0; t < n; t++) {
            const int64_t tok = k0 + t;
            const int64_t at = (table[tok / bs] * bs + tok % bs) * row_bytes + head;
            if (kv_type == RS_KV_BF16) {
                float *kw = wide + t * D, *vw = wide + (TILE_KEYS + t) * D;
                for (int64_t v = 0; v < D / LANES; v++) {
                    ((vfl *)kw)[v] = kv_vec((const char *)k_cache + at, v, kv_type);
                    ((vfl *)vw)[v] = kv_vec((const char *)v_cache + at, v, kv_type);
                }
                keys[t] = kw;
                values[t] = vw;
            } else {
                keys[t] = (const float *)((const char *)k_cache + at);
                values[t] = (const float *)((const char *)v_cache + at);
            }
        }
        tile_scores(RV, QT, keys, n, D, S);
        if (cap > 0.0f)   /* soft-capped scores (Gemma 2) */
            for (int64_t t = 0; t < n; t++)
                for (int v = 0; v < RV; v++)
                    for (int i = 0; i < LANES; i++)
                        S[t * TILE_RV + v][i] = cap * tanhf(S[t * TILE_RV + v][i] / cap);
        /* rows whose context ends inside the group see only its first keys, and with
           a window, rows whose window starts inside it only its last */
        if (k0 + n > c0 || (W > 0 && k0 < end - W))
            for (int64_t t = 0; t < n; t++)
                for (int v = 0; v < RV; v++)
                    S[t * TILE_RV + v] = vselect(
                        ((float)(k0 + t) < ctx[v]) & ((float)(k0 + t) >= low[v]),
                        S[t * TILE_RV + v], (vfl){0} + MASKED);
        vfl alpha[TILE_RV];
        for (int v = 0; v < RV; v++) {
            vfl top = m[v];
            for (int64_t t = 0; t < n; t++)
                top = vmax(top, S[t * TILE_RV + v]);
            alpha[v] = vexp(m[v] - top);
            vfl sum = l[v] * alpha[v];
            for (int64_t t = 0; t < n; t++) {
                const vfl p = vexp(S[t * TILE_RV + v] - top);
                S[t * TILE_RV + v] = p;
                sum += p;
            }
            m[v] = top;
            l[v] = sum;
        }
        tile_values(RV, OT, alpha, S, values, n, D);
    }
    for (int v = 0; v < RV; v++) {
        vfl inv = 1.0f / l[v];
        if (sinks != NULL)   /* gpt-oss: each row's head's sink logit joins its sum */
            for (int i = 0; i < LANES; i++) {
                const int64_t r = v * LANES + i;
                const float sink = sinks[g * G + (r < R ? r : 0) % G];
                const float top = sink > m[v][i] ? sink : m[v][i];
                const float keep = expf(m[v][i] - top);
                inv[i] = keep / (l[v][i] * keep + expf(sink - top));
            }
        for (int64_t d = 0; d < D; d++) {
            const vfl o = OT[d * TILE_RV + v] * inv;
            for (int i = 0; i < LANES; i++) {
                const int64_t r = v * LANES + i;
                if (r < R)
                    out[r / G * out_stride + (g * G + r % G) * D + d] = o[i];
            }
        }
    }
}

/* attend_tile for the model's shapes and the tile's rows. */
static void attend_chunk(const float *q, int64_t q_stride, int64_t nq, const void *k_cache,
                         const void *v_cache, int kv_type, const int64_t *table, int64_t c0,
                         int64_t W, float *out, int64_t out_stride, int64_t Hq, int64_t Hkv,
                         int64_t D, int64_t bs, float scale, float cap,
                         const float *sinks, int64_t g,
                         float *scratch)
{
    const int64_t rows = nq * (Hq / Hkv);
    const int RV = (int)((rows + LANES - 1) / LANES);
#define TILE(rv, type, d) attend_tile(rv, q, q_stride, nq, k_cache, v_cache, type, table, c0, \
                                      W, out, out_stride, Hq, Hkv, d, bs, scale, cap, sinks, g, \
                                      scratch)
#if TILE_RV == 4
#define TILE_RVS(type, d)                \
    switch (RV) {                        \
    case 1: TILE(1, type, d); break;     \
    case 2: TILE(2, type, d); break;     \
    case 3: TILE(3, type, d); break;     \
    default: TILE(4, type, d); break;    \
    }
#else
#define TILE_RVS(type, d)                \
    switch (RV) {                        \
    case 1: TILE(1, type, d); break;     \
    default: TILE(2, type, d); break;    \
    }
#endif
    if (kv_type == RS_KV_BF16) {
        if (D == 64)
            TILE_RVS(RS_KV_BF16, 64)
        else
            TILE_RVS(RS_KV_BF16, D)
    } else if (D == 64) {
        TILE_RVS(RS_KV_F32, 64)
    } else if (D == 128) {
        TILE_RVS(RS_KV_F32, 128)
    } else {
        TILE_RVS(RS_KV_F32, D)
    }
#undef TILE_RVS
#undef TILE
}

/* ---- A step's attention ------------------------------------------------------------ */

int64_t rs_attention_tiles(int64_t N, const int64_t *seq, const int64_t *ctx_lens, int64_t Hq,
                           int64_t Hkv, int64_t *starts)
{
    const int64_t most = tile_tokens(Hq / Hkv);
    int64_t tiles = 0;
    for (int64_t n = 0; n < N; n++) {
        const int64_t len = tiles > 0 ? n - starts[tiles - 1] : 0;
        if (tiles == 0 || len >= most || most == 0 || seq[n] != seq[n - 1]
            || ctx_lens[n] != ctx_lens[n - 1] + 1)
            starts[tiles++] = n;
    }
    starts[tiles] = N;
    return tiles;
}

/* A step of a few decode rows over long contexts splits each row's keys into parts,
   each a work item of its own (all heads: whole key rows, read in order), merged after
   (split-K, "flash decoding"): with one row of 3 KV heads on 2 threads, one thread
   read two thirds of the keys while the other waited. Parts hold PART_MIN_KEYS keys
   at least. One row of 4,096 keys (SmolLM2, AMD EPYC Zen 5, 2 threads): attention
   8.2 ms a step before, 6.1 with parts of one KV head, 5.1 with whole rows. */
#define PART_MIN_KEYS 256
#define PARTS_MAX 16

/* How many parts each row's keys are split into (1: none): enough for 8 work items a
   thread, when the step is decode rows alone. */
static int64_t context_parts(int64_t N, int64_t tiles, const int64_t *ctx_lens, int64_t threads,
                             int64_t W)
{
    if (tiles < N || N >= 8 * threads)
        return 1;   /* a prompt chunk (its tiles are the step's bulk), or items enough */
    int64_t longest = 0;
    for (int64_t n = 0; n < N; n++)
        longest = ctx_lens[n] > longest ? ctx_lens[n] : longest;
    longest = W > 0 && longest > W ? W : longest;
    int64_t parts = (8 * threads + N - 1) / N;
    parts = parts < longest / PART_MIN_KEYS ? parts : longest / PART_MIN_KEYS;
    parts = parts < PARTS_MAX ? parts : PARTS_MAX;
    return parts < 2 ? 1 : parts;
}

int64_t rs_attention_partial_floats(int64_t Hq, int64_t Hkv, int64_t D, int64_t threads)
{
    (void)Hkv;
    /* parts > 1 only when N < 8 threads, so N parts < 16 threads */
    return 16 * threads * Hq * (D + 2);
}

/* out[n] from the parts of row n: each part's sum rescaled to the largest maximum. */
static void merge_parts(const float *partial, int64_t parts, int64_t n, int64_t i, float *out,
                        int64_t Hq, int64_t D, const float *sinks)
{
    const int64_t entry = Hq * (D + 2);   /* a part: [Hq][D] sums, then [Hq][2] m, l */
    const float *first = partial + n * parts * entry;
    float top = MASKED;
    for (int64_t p = 0; p < parts; p++) {
        const float m = first[p * entry + Hq * D + 2 * i];
        top = m > top ? m : top;
    }
    if (sinks != NULL)   /* gpt-oss: head i's sink logit, one more term of the sum */
        top = sinks[i] > top ? sinks[i] : top;
    float sum = sinks != NULL ? expf(sinks[i] - top) : 0.0f, w[PARTS_MAX];
    for (int64_t p = 0; p < parts; p++) {
        const float *ml = first + p * entry + Hq * D + 2 * i;
        w[p] = expf(ml[0] - top);
        sum += ml[1] * w[p];
    }
    for (int64_t d = 0; d < D; d++) {
        float o = 0.0f;
        for (int64_t p = 0; p < parts; p++)
            o += first[p * entry + i * D + d] * w[p];
        out[i * D + d] = o / sum;
    }
}

/* A decode row's first key: the window's, else 0. */
static inline int64_t window_start(int64_t T, int64_t W)
{
    return W > 0 && T > W ? T - W : 0;
}

void rs_attention_ws(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                     int kv_type, const int64_t *seq, const int64_t *ctx_lens,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *starts,
                     int64_t tiles, float *out, int64_t out_stride, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t bs, float scale, float cap, const float *sinks,
                     int64_t W, float *scratch, float *partial)
{
    const int64_t N = starts[tiles], threads = rs_num_threads();
    const int64_t parts = context_parts(N, tiles, ctx_lens, threads, W);
    if (parts > 1) {
        const int64_t entry = Hq * (D + 2);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < N * parts; item++) {
            const int64_t n = item / parts, p = item % parts;
            const int64_t T = ctx_lens[n], lo = window_start(T, W), base = lo / bs * bs;
            const int64_t len = ((T - base + parts - 1) / parts + bs - 1) / bs * bs;
            const int64_t t0 = base + p * len, t1 = t0 + len < T ? t0 + len : T;
            float *sums = partial + (n * parts + p) * entry, *ml = sums + Hq * D;
            if (t0 >= T) {   /* nothing left for this part */
                for (int64_t i = 0; i < Hq; i++) {
                    memset(sums + i * D, 0, sizeof(float) * (size_t)D);
                    ml[2 * i] = MASKED;
                    ml[2 * i + 1] = 0.0f;
                }
                continue;
            }
            attend_row(q + n * q_stride, k_cache, v_cache, kv_type,
                       block_tables + seq[n] * max_blocks, t0, t1, lo, sums, ml, scratch, Hq,
                       Hkv, D, bs, scale, cap, sinks, 0, Hkv);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < N * Hq; item++)
            merge_parts(partial, parts, item / Hq, item % Hq, out + item / Hq * out_stride, Hq,
                        D, sinks);
        return;
    }
    /* Prompt chunks' tiles a KV head apiece, and so every tile when there are fewer
       than threads (one token would keep one thread busy, the others waiting) ... */
    const int few = tiles < threads, chunks = tiles < N;
    if (few || chunks) {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t item = 0; item < tiles * Hkv; item++) {
            const int64_t tile = item / Hkv, g = item % Hkv;
            const int64_t n0 = starts[tile], nq = starts[tile + 1] - n0;
            const int64_t *table = block_tables + seq[n0] * max_blocks;
            const int64_t lo = window_start(ctx_lens[n0], W);
            if (nq > 1)
                attend_chunk(q + n0 * q_stride, q_stride, nq, k_cache, v_cache, kv_type,
                             table, ctx_lens[n0], W, out + n0 * out_stride, out_stride, Hq,
                             Hkv, D, bs, scale, cap, sinks, g, scratch);
            else if (few)
                attend_row(q + n0 * q_stride, k_cache, v_cache, kv_type, table, lo / bs * bs,
                           ctx_lens[n0], lo, out + n0 * out_stride, NULL, scratch, Hq, Hkv, D,
                           bs, scale, cap, sinks, g, g + 1);
        }
    }
    /* ... else decode rows whole: a row's keys of all heads are one contiguous row. */
    if (!few) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = starts[tile], lo = window_start(ctx_lens[n0], W);
            if (starts[tile + 1] - n0 == 1)
                attend_row(q + n0 * q_stride, k_cache, v_cache, kv_type,
                           block_tables + seq[n0] * max_blocks, lo / bs * bs, ctx_lens[n0], lo,
                           out + n0 * out_stride, NULL, scratch, Hq, Hkv, D, bs, scale, cap,
                           sinks, 0, Hkv);
        }
    } else {
#pragma omp barrier
    }
}

int rs_paged_attention(const float *q, const void *k_cache, const void *v_cache, int kv_type,
                       const int64_t *seq, const int64_t *ctx_lens, const int64_t *block_tables,
                       float *out, int64_t N, int64_t Hq, int64_t Hkv, int64_t D,
                       int64_t block_size, int64_t max_blocks, float scale, float cap,
                       int64_t window, const float *sinks)
{
    if (D > MAX_DIM || D % LANES != 0)
        return -2;
    int64_t max_ctx = 1;
    for (int64_t n = 0; n < N; n++)
        max_ctx = ctx_lens[n] > max_ctx ? ctx_lens[n] : max_ctx;
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(N + 1));
    if (starts == NULL)
        return -1;
    const int64_t tiles = rs_attention_tiles(N, seq, ctx_lens, Hq, Hkv, starts);
    const int64_t floats = rs_attention_scratch_floats(Hq, Hkv, D, max_ctx);
    float *partial = (float *)malloc(
        sizeof(float) * (size_t)rs_attention_partial_floats(Hq, Hkv, D, omp_get_max_threads()));
    int failed = partial == NULL;
#pragma omp parallel
    {
        RS_FAST_MODES;
        float *scratch = (float *)aligned_alloc(64, sizeof(float)
                                                        * (size_t)((floats + 15) / 16 * 16));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed)
            rs_attention_ws(q, Hq * D, k_cache, v_cache, kv_type, seq, ctx_lens, block_tables,
                            max_blocks, starts, tiles, out, Hq * D, Hq, Hkv, D, block_size,
                            scale, cap, sinks, window, scratch, partial);
        free(scratch);
    }
    free(partial);
    free(starts);
    return failed ? -1 : 0;
}
