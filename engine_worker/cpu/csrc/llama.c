/*
 * A whole Llama-family forward pass in one call: embedding, every decoder layer, the
 * final norm and the logits of the rows that sample. At decode batch sizes a step is
 * a few milliseconds of weight streaming; dispatching ~15 operations per layer from
 * Python would cost as much again, so the step runs here, inside one OpenMP parallel
 * region whose threads meet at a barrier after each operation.
 *
 * Every token is a query of its own: token n belongs to sequence seq[n] and attends
 * to that sequence's first ctx_lens[n] tokens (its own included) through the
 * sequence's block table. Decodes and prefill chunks mix freely in one step. All of a
 * layer's keys and values are written before any query reads, so a request may read
 * blocks that another request of the same step fills (in-batch prefix sharing).
 *
 * The residual stream lives in `x`; o_proj and down_proj add into it directly (the
 * GEMM's accumulate mode), so each residual add costs nothing. The arithmetic order
 * of each operation is Hugging Face's: (x W^T + b) + residual, RMSNorm in float32 as
 * w * (h * 1 / sqrt(mean(h^2) + eps)) (each head of q and k too, for Qwen3), rotate-half
 * RoPE from the caller's cos/sin.
 *
 * A layer's MLP may be a mixture of experts (Mixtral, Qwen2/3-MoE, gpt-oss): the
 * router's top k experts of each token, each chosen expert run once on its tokens'
 * rows, in the experts' order and each expert's rows in theirs, the outputs weighted
 * and summed as transformers sums them (engine_worker/models/llama.py, MoE).
 *
 * LoRA adapters (models/layers/lora.py) add each token row's own adapter's low-rank
 * product to the linear layers they target, inside the same call: x A^T into a few
 * floats a row, then those times B^T added to the layer's output (before its bias-free
 * residual add, its activation or its norm, where the module adds it too). A token's
 * adapter is its slot (0: none); a layer's adapters are every slot's A and B, zero-padded
 * to the layer's rank, a fused layer's (q, k and v; gate and up) part by part.
 *
 * With a profile array, the first thread adds the wall time of each kind of work to it
 * (each ends at a barrier, so the time is the slowest thread's): linear layers,
 * attention, the rest (embedding, norms, RoPE and KV writes, SiLU); a mixture of
 * experts counts whole as linear layers.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* A mixture of experts in place of a layer's MLP. */
struct rs_moe {
    int64_t num_experts, top_k, intermediate;   /* each expert's I */
    /* 0: a softmax over every expert's logit, then the top k; 1: those k renormalized
       to sum to 1; 2: the top k logits, then a softmax over them (gpt-oss) */
    int64_t routing;
    int64_t act;                            /* 0 SiLU, 1 GELU (tanh), 2 gpt-oss's clamped SwiGLU */
    float alpha, limit;                     /* the clamped SwiGLU's */
    const void *router;                     /* packed [E, C] */
    const float *router_bias;
    int64_t router_format;
    const void *const *gate_up;             /* [E] packed [2 I, C]: gate rows, then up */
    const void *const *down;                /* [E] packed [C, I] */
    const float *const *gate_up_bias;       /* [E] or NULL, as down_bias */
    const float *const *down_bias;
    int64_t gate_up_format, down_format;
    /* Qwen2-MoE's shared expert is the layer's gate_up and down (of shared_intermediate),
       its output scaled by the sigmoid of this packed [1, C] gate; NULL: none */
    const void *shared_gate;
    int64_t shared_gate_format, shared_intermediate;
};

/* A linear layer's LoRA adapters, by slot (1 first): A [slots, parts x rank, K], each
   part's rank rows in turn; B [slots, O, rank], each output row reading its part's
   (row_part [O]); B scaled. */
struct rs_lora {
    const float *a, *b;
    const int32_t *row_part;
    int64_t rank, parts, slots;
};

struct rs_llama_layer {
    const float *attn_norm;                 /* [C] */
    const void *qkv;                        /* packed [(Hq + 2 Hkv) D, C] */
    const float *qkv_bias;                  /* or NULL, as every bias */
    const float *q_norm, *k_norm;           /* [D] each head's RMSNorm (Qwen3), or NULL */
    const void *o;                          /* packed [C, Hq D] */
    const float *o_bias;
    const float *mlp_norm;                  /* [C] */
    const void *gate_up;                    /* packed [2 I, C]: gate rows, then up */
    const float *gate_up_bias;
    const void *down;                       /* packed [C, I] */
    const float *down_bias;
    void *k_cache, *v_cache;                /* [slots, Hkv, D] of the model's kv_type */
    int64_t qkv_format, o_format, gate_up_format, down_format;   /* RS_F32 ... RS_MXFP4 */
    /* RoPE from the step's cos and sin (1), its local ones (2: Gemma 3's sliding
       layers), or none (0: SmolLM3's NoPE layers) */
    int64_t rope;
    int64_t window;                         /* > 0: a sliding window of that many keys */
    /* Gemma's norms of the attention's and the MLP's outputs before they join the
       residual stream ([C]), or NULL */
    const float *attn_out_norm, *mlp_out_norm;
    const struct rs_moe *moe;               /* the MLP a mixture of experts, or NULL */
    const float *sinks;                     /* [Hq] each head's sink logit (gpt-oss), or NULL */
    /* LoRA adapters on qkv, o, gate_up and down (a dense MLP's), each or NULL */
    const struct rs_lora *lora_qkv, *lora_o, *lora_gate_up, *lora_down;
};

struct rs_llama {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
    int64_t block_size;
    float eps, scale;
    int64_t lm_head_format;  /* RS_F32, RS_BF16, RS_INT8 or RS_Q4, as each layer's */
    int64_t kv_type;         /* RS_KV_F32 or RS_KV_BF16 */
    const float *embed;      /* [V, C] */
    const void *lm_head;     /* packed [V, C] */
    const float *norm;       /* [C] */
    const struct rs_llama_layer *layers;
    int64_t gelu;            /* the MLP's gate: GELU (tanh form) rather than SiLU */
    float softcap;           /* > 0: attention scores soft-capped (Gemma 2) */
    /* The largest of the layers' mixtures (0 without any): experts, experts a token,
       and intermediate size (each expert's or a shared expert's), for the scratch */
    int64_t moe_experts, moe_top_k, moe_intermediate;
    int64_t lora_width;      /* the layers' largest LoRA parts x rank (0: no adapters) */
};

struct rs_step {
    int64_t num_tokens;
    const int64_t *ids, *slots, *seq, *ctx_lens;   /* [N] */
    const float *cos, *sin;                        /* [N, D / 2] */
    const int64_t *block_tables;                   /* [num_seqs, max_blocks] */
    int64_t max_blocks, max_ctx;
    int64_t num_samples;
    const int64_t *sample_rows;                    /* [S] rows whose logits are wanted */
    int64_t num_threads;
    float *scratch;                                /* rs_llama_scratch_floats() */
    float *logits;                                 /* [S, V] */
    double *profile;                               /* [3] seconds added, or NULL */
    const float *cos_local, *sin_local;            /* [N, D / 2] or NULL: layers' rope 2 */
    /* The sliding layers' own slots [N] and block tables [num_seqs, max_blocks] where
       their blocks are a pool of their own (window_blocks.py), or NULL */
    const int64_t *local_slots, *local_block_tables;
    const int64_t *lora_slots;                     /* [N] each token's adapter, or NULL */
};

enum { PROFILE_LINEAR, PROFILE_ATTENTION, PROFILE_OTHER };

#define PHASE(kind)                                        \
    do {                                                   \
        if (profile != NULL) {                             \
            const double now_ = omp_get_wtime();           \
            profile[kind] += now_ - since;                 \
            since = now_;                                  \
        }                                                  \
    } while (0)

/* The attention's tiles (N + 1 int64) in floats, one more to align them: after them in
   the scratch, only a mixture's and the LoRA products' own. */
static inline int64_t tile_floats(int64_t N) { return 2 * (N + 1) + 1; }

/* A thread's attention scratch, rounded up to 16 floats (each starts aligned). */
static inline int64_t attention_floats(const struct rs_llama *m, int64_t max_ctx)
{
    return (rs_attention_scratch_floats(m->num_heads, m->num_kv_heads, m->head_dim, max_ctx)
            + 15) / 16 * 16;
}

/* The MLP's intermediate size the scratch holds: the dense layers' or a mixture's. */
static inline int64_t scratch_intermediate(const struct rs_llama *m)
{
    return m->intermediate > m->moe_intermediate ? m->intermediate : m->moe_intermediate;
}

/* A mixture's scratch (after the attention's tiles): each token's router logits and
   its choices' weights, the mixture's output, an expert's input rows and output rows,
   then (int32) each choice's expert, the choices in experts' order and where each
   expert's run of them starts. */
static inline int64_t moe_floats(const struct rs_llama *m, int64_t N)
{
    const int64_t E = m->moe_experts, k = m->moe_top_k;
    return E ? N * (E + k + 3 * m->hidden + 2 * k) + E + 1 : 0;
}

int64_t rs_llama_scratch_floats(const struct rs_llama *m, int64_t N, int64_t S,
                                int64_t max_ctx, int64_t threads)
{
    const int64_t C = m->hidden, D = m->head_dim, I = scratch_intermediate(m);
    const int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * D;
    return N * (2 * C + qkv + m->num_heads * D + 3 * I) + S * C
           + threads * attention_floats(m, max_ctx)
           + rs_attention_partial_floats(m->num_heads, m->num_kv_heads, D, threads)
           + tile_floats(N) + moe_floats(m, N) + N * m->lora_width;
}

/* y [N, O] += each token row's adapter's (x A^T) B^T, x [N, K]; rows of slot 0 (or of a
   slot the layer has no adapter in) add nothing. t: [N, parts x rank] scratch. Inside
   the forward's parallel region: A's rows, then B's, split over the threads, each read
   once for all the rows of its slot. */
static void lora_add(const struct rs_lora *L, const int64_t *slots, const float *x,
                     int64_t N, int64_t K, float *y, int64_t O, float *t)
{
    if (L == NULL || slots == NULL)
        return;
    const int64_t R = L->rank, PR = L->parts * R;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < L->slots * PR; j++) {
        const int64_t slot = j / PR + 1;
        const float *a = L->a + j * K;
        for (int64_t n = 0; n < N; n++) {
            if (slots[n] != slot)
                continue;
            const float *xn = x + n * K;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++)
                acc += xn[k] * a[k];
            t[n * PR + j % PR] = acc;
        }
    }
#pragma omp for schedule(static)
    for (int64_t o = 0; o < O; o++) {
        const int64_t part = L->row_part[o] * R;
        for (int64_t n = 0; n < N; n++) {
            const int64_t slot = slots[n];
            if (slot < 1 || slot > L->slots)
                continue;
            const float *b = L->b + ((slot - 1) * O + o) * R, *tn = t + n * PR + part;
            float acc = 0.0f;
            for (int64_t r = 0; r < R; r++)
                acc += b[r] * tn[r];
            y[n * O + o] += acc;
        }
    }
}

/* out = RMSNorm(h) * w, a row. */
static inline void rms_norm_row(const float *h, const float *w, float *out, int64_t C,
                                float eps)
{
    float sumsq = 0.0f;
    for (int64_t c = 0; c < C; c++)
        sumsq += h[c] * h[c];
    const float inv = 1.0f / sqrtf(sumsq / (float)C + eps);
    for (int64_t c = 0; c < C; c++)
        out[c] = w[c] * (h[c] * inv);
}

/* x += in W^T (+ bias) (+ the rows' adapters' products), [N, C]: the GEMM accumulates
   into the residual stream, or with a norm (Gemma's), writes tmp, whose normed rows are
   then added. Inside the forward's parallel region (work-sharing loops, each ending at
   a barrier). */
static int out_to_residual(const float *in, int64_t N, int64_t K, const void *w,
                           const float *bias, int format, const float *norm, float *tmp,
                           float *x, int64_t C, float eps, const struct rs_lora *lora,
                           const int64_t *slots, float *t)
{
    if (norm == NULL) {
        const int bad = rs_linear_ws(in, N, K, w, C, bias, x, 1, format);
        lora_add(lora, slots, in, N, K, x, C, t);
        return bad;
    }
    const int bad = rs_linear_ws(in, N, K, w, C, bias, tmp, 0, format);
    lora_add(lora, slots, in, N, K, tmp, C, t);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        rms_norm_row(tmp + n * C, norm, tmp + n * C, C, eps);
        for (int64_t c = 0; c < C; c++)
            x[n * C + c] += tmp[n * C + c];
    }
    return bad;
}

struct moe_scratch {
    float *logits, *weight, *out, *rows, *y;   /* [N, E], [N, k], [N, C] x 3 */
    int32_t *chosen, *order, *start;           /* [N, k], [N, k], [E + 1] */
};

/* One token's top k experts, largest logit first (ties to the lower index), and
   their weights by the mixture's routing (as MoE.forward computes them). */
static void route_row(const float *logit, int64_t E, int64_t k, int routing,
                      int32_t *chosen, float *weight)
{
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++)
                taken |= chosen[i] == e;
            if (!taken && (best < 0 || logit[e] > logit[best]))
                best = e;   /* a NaN logit is never larger: its row's output is NaN anyway */
        }
        chosen[j] = (int32_t)best;
    }
    /* softmax over all E (0, 1) or over the k chosen (2): the largest is subtracted */
    float top = logit[chosen[0]], total = 0.0f;
    if (routing == 2) {
        for (int64_t j = 0; j < k; j++)
            total += expf(logit[chosen[j]] - top);
    } else {
        for (int64_t e = 0; e < E; e++)
            top = logit[e] > top ? logit[e] : top;
        for (int64_t e = 0; e < E; e++)
            total += expf(logit[e] - top);
    }
    float chosen_total = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        weight[j] = expf(logit[chosen[j]] - top) / total;
        chosen_total += weight[j];
    }
    if (routing == 1)
        for (int64_t j = 0; j < k; j++)
            weight[j] /= chosen_total;
}

/* An expert's gate: act(gate) * up of one row (gate then up, I each); act 2 is
   gpt-oss's (clamp(up, -limit, limit) + 1) g sigmoid(alpha g), g = min(gate, limit). */
static void expert_act_row(const float *g, float *o, int64_t I, int act, float alpha,
                           float limit)
{
    if (act != 2) {
        rs_act_mul_row(g, o, I, act);
        return;
    }
    const float *u = g + I;
    for (int64_t i = 0; i < I; i++) {
        const float gate = g[i] < limit ? g[i] : limit;
        const float up = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        o[i] = (up + 1.0f) * (gate / (1.0f + expf(-gate * alpha)));
    }
}

/* The expert's MLP on rows [n, C] of `in`: gate_up into gu, its gate into act, down
   into y. */
static int expert_mlp(const float *in, int64_t n, int64_t C, int64_t I, const void *gate_up,
                      const float *gate_up_bias, int gate_up_format, const void *down,
                      const float *down_bias, int down_format, const struct rs_moe *M,
                      float *gu, float *act, float *y)
{
    int bad = rs_linear_ws(in, n, C, gate_up, 2 * I, gate_up_bias, gu, 0, gate_up_format);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++)
        expert_act_row(gu + j * 2 * I, act + j * I, I, (int)M->act, M->alpha, M->limit);
    return bad | rs_linear_ws(act, n, I, down, C, down_bias, y, 0, down_format);
}

/* x += the mixture of experts of h [N, C] (and the shared expert's part), as
   out_to_residual adds a dense MLP's. Inside the forward's parallel region. */
static int mixture(const struct rs_llama_layer *L, const float *h, int64_t N, int64_t C,
                   const struct moe_scratch *w, float *gu, float *act, float *x, float eps)
{
    const struct rs_moe *M = L->moe;
    const int64_t E = M->num_experts, k = M->top_k, I = M->intermediate;
    int bad = rs_linear_ws(h, N, C, M->router, E, M->router_bias, w->logits, 0,
                           (int)M->router_format);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        route_row(w->logits + n * E, E, k, (int)M->routing, w->chosen + n * k,
                  w->weight + n * k);
        memset(w->out + n * C, 0, sizeof(float) * (size_t)C);
    }
#pragma omp single
    {   /* the choices by expert, each expert's in token order: a counting sort */
        int32_t *start = w->start;
        memset(start, 0, sizeof(int32_t) * (size_t)(E + 1));
        for (int64_t i = 0; i < N * k; i++)
            start[w->chosen[i] + 1]++;
        for (int64_t e = 0; e < E; e++)
            start[e + 1] += start[e];
        for (int64_t i = 0; i < N * k; i++)   /* start[e] ends where e + 1's run starts */
            w->order[start[w->chosen[i]]++] = (int32_t)i;
        for (int64_t e = E; e > 0; e--)
            start[e] = start[e - 1];
        start[0] = 0;
    }
    for (int64_t e = 0; e < E; e++) {
        const int32_t *mine = w->order + w->start[e];
        const int64_t n = w->start[e + 1] - w->start[e];
        if (n == 0)
            continue;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++)
            memcpy(w->rows + j * C, h + mine[j] / k * C, sizeof(float) * (size_t)C);
        bad |= expert_mlp(w->rows, n, C, I, M->gate_up[e],
                          M->gate_up_bias ? M->gate_up_bias[e] : NULL, (int)M->gate_up_format,
                          M->down[e], M->down_bias ? M->down_bias[e] : NULL,
                          (int)M->down_format, M, gu, act, w->y);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {   /* a token chooses an expert once: rows differ */
            const float weight = w->weight[mine[j]];
            float *o = w->out + mine[j] / k * C;
            const float *y = w->y + j * C;
            for (int64_t c = 0; c < C; c++)
                o[c] += y[c] * weight;
        }
    }
    if (M->shared_gate != NULL) {   /* out += sigmoid(h . gate) * shared expert(h) */
        bad |= expert_mlp(h, N, C, M->shared_intermediate, L->gate_up, L->gate_up_bias,
                          (int)L->gate_up_format, L->down, L->down_bias, (int)L->down_format,
                          M, gu, act, w->y);
        bad |= rs_linear_ws(h, N, C, M->shared_gate, 1, NULL, w->logits, 0,
                            (int)M->shared_gate_format);
    }
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *o = w->out + n * C;
        if (M->shared_gate != NULL) {
            const float gate = 1.0f / (1.0f + expf(-w->logits[n]));
            for (int64_t c = 0; c < C; c++)
                o[c] += gate * w->y[n * C + c];
        }
        if (L->mlp_out_norm != NULL)
            rms_norm_row(o, L->mlp_out_norm, o, C, eps);
        for (int64_t c = 0; c < C; c++)
            x[n * C + c] += o[c];
    }
    return bad;
}

int rs_llama_forward(const struct rs_llama *m, const struct rs_step *s)
{
    const int64_t N = s->num_tokens, S = s->num_samples;
    const int64_t C = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads;
    const int64_t D = m->head_dim, I = m->intermediate, half = D / 2;
    const int64_t Is = scratch_intermediate(m);   /* >= I: a mixture's may be larger */
    const int64_t QKV = (Hq + 2 * Hkv) * D, QD = Hq * D;
    if (D % 16 != 0 || D > 256)
        return -2;
    int failed = 0;
    float *x = s->scratch;             /* [N, C] the residual stream */
    float *h = x + N * C;              /* [N, C] normed */
    float *qkv = h + N * C;            /* [N, QKV] */
    float *attn = qkv + N * QKV;       /* [N, QD] */
    float *gu = attn + N * QD;         /* [N, 2 Is] */
    float *act = gu + N * 2 * Is;      /* [N, Is] */
    float *final = act + N * Is;       /* [S, C] */
    const int64_t per_thread = attention_floats(m, s->max_ctx);
    float *scratch = final + S * C;    /* [threads, per_thread] the attention's */
    float *partial = scratch + s->num_threads * per_thread;   /* shared by the threads */
    float *after = partial + rs_attention_partial_floats(Hq, Hkv, D, s->num_threads);
    int64_t *tiles = (int64_t *)(after + ((uintptr_t)after & 4) / 4);   /* [N + 1], aligned */
    const int64_t num_tiles = rs_attention_tiles(N, s->seq, s->ctx_lens, Hq, Hkv, tiles);
    const int64_t E = m->moe_experts, K = m->moe_top_k;
    struct moe_scratch moe = {.logits = (float *)(tiles + N + 1)};
    moe.weight = moe.logits + N * E;
    moe.out = moe.weight + N * K;
    moe.rows = moe.out + N * C;
    moe.y = moe.rows + N * C;
    moe.chosen = (int32_t *)(moe.y + N * C);
    moe.order = moe.chosen + N * K;
    moe.start = moe.order + N * K;
    float *lora_t = (float *)(tiles + N + 1) + moe_floats(m, N);   /* [N, lora_width] */
    const int64_t *lora_slots = m->lora_width ? s->lora_slots : NULL;

#pragma omp parallel num_threads(s->num_threads)
    {
        RS_FAST_MODES;
        float *my_scratch = scratch + (int64_t)omp_get_thread_num() * per_thread;
        double *profile = omp_get_thread_num() == 0 ? s->profile : NULL;
        double since = profile != NULL ? omp_get_wtime() : 0.0;
        int bad = 0;   /* this thread's linear layers could not get scratch memory */

#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++)
            memcpy(x + n * C, m->embed + s->ids[n] * C, sizeof(float) * (size_t)C);
        PHASE(PROFILE_OTHER);

        for (int64_t l = 0; l < m->num_layers; l++) {
            const struct rs_llama_layer *L = &m->layers[l];
            const int own_pool = L->window > 0 && s->local_slots != NULL;
            const int64_t *slots = own_pool ? s->local_slots : s->slots;
            const int64_t *tables = own_pool ? s->local_block_tables : s->block_tables;

#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++)
                rms_norm_row(x + n * C, L->attn_norm, h + n * C, C, m->eps);
            PHASE(PROFILE_OTHER);
            bad |= rs_linear_ws(h, N, C, L->qkv, QKV, L->qkv_bias, qkv, 0,
                                 (int)L->qkv_format);
            lora_add(L->lora_qkv, lora_slots, h, N, C, qkv, QKV, lora_t);
            PHASE(PROFILE_LINEAR);

            /* Each head of q and k RMS-normed (Qwen3), RoPE on q and k (unless the
               layer has none), then k and v into their cache slots. */
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                float *row = qkv + n * QKV;
                if (L->q_norm != NULL)
                    for (int64_t j = 0; j < Hq + Hkv; j++)
                        rms_norm_row(row + j * D, j < Hq ? L->q_norm : L->k_norm, row + j * D,
                                     D, m->eps);
                const int local = L->rope == 2;
                rs_rope_write_kv_row(qkv + n * QKV,
                                     L->rope ? (local ? s->cos_local : s->cos) + n * half : NULL,
                                     (local ? s->sin_local : s->sin) + n * half,
                                     L->k_cache, L->v_cache, (int)m->kv_type, slots[n],
                                     Hq, Hkv, D);
            }
            PHASE(PROFILE_OTHER);

            rs_attention_ws(qkv, QKV, L->k_cache, L->v_cache, (int)m->kv_type, s->seq,
                            s->ctx_lens, tables, s->max_blocks, tiles, num_tiles,
                            attn, QD, Hq, Hkv, D, m->block_size, m->scale, m->softcap,
                            L->sinks, L->window, my_scratch, partial);
            PHASE(PROFILE_ATTENTION);
            bad |= out_to_residual(attn, N, QD, L->o, L->o_bias, (int)L->o_format,
                                   L->attn_out_norm, h, x, C, m->eps, L->lora_o, lora_slots,
                                   lora_t);
            PHASE(PROFILE_LINEAR);

#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++)
                rms_norm_row(x + n * C, L->mlp_norm, h + n * C, C, m->eps);
            PHASE(PROFILE_OTHER);
            if (L->moe != NULL) {
                bad |= mixture(L, h, N, C, &moe, gu, act, x, m->eps);
                PHASE(PROFILE_LINEAR);
                continue;
            }
            bad |= rs_linear_ws(h, N, C, L->gate_up, 2 * I, L->gate_up_bias, gu, 0,
                                 (int)L->gate_up_format);
            lora_add(L->lora_gate_up, lora_slots, h, N, C, gu, 2 * I, lora_t);
            PHASE(PROFILE_LINEAR);

#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++)
                rs_act_mul_row(gu + n * 2 * I, act + n * I, I, (int)m->gelu);
            PHASE(PROFILE_OTHER);
            bad |= out_to_residual(act, N, I, L->down, L->down_bias, (int)L->down_format,
                                   L->mlp_out_norm, h, x, C, m->eps, L->lora_down, lora_slots,
                                   lora_t);
            PHASE(PROFILE_LINEAR);
        }

#pragma omp for schedule(static)
        for (int64_t j = 0; j < S; j++)
            rms_norm_row(x + s->sample_rows[j] * C, m->norm, final + j * C, C, m->eps);
        PHASE(PROFILE_OTHER);
        bad |= rs_linear_ws(final, S, C, m->lm_head, m->vocab, NULL, s->logits, 0,
                              (int)m->lm_head_format);
        PHASE(PROFILE_LINEAR);
        if (bad) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}
