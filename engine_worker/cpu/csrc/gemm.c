/*
 * y = x W^T for the engine's linear layers, from a weight packed once at load time.
 *
 * Packed layout: the N output features are cut into panels of 16; panel p holds
 * W[16p .. 16p+15][0 .. K-1] transposed, K rows of 16 floats, contiguous (the last
 * panel is zero-padded). A step streams each panel once, front to back, which is all
 * a small batch needs: at 1-8 rows the layer is bound by reading the weight.
 *
 * Register tiles: MR rows of x times NP panels, accumulated over all of K in
 * registers. With -march=native the tile is sized for the machine at hand: up to 4
 * rows x 4 panels at 4 rows or fewer and 8 x 1 above on AVX-512 (32 registers), or 6
 * rows x 1 panel (12 of AVX2's 16, a panel being two 8-float registers). Threads
 * split the panels, so each streams its own share of the weight, and a tile of one
 * panel fetches the next panel into the cache as it goes.
 *
 * Weight formats: float32 panels are read in place. bfloat16 panels store two
 * consecutive inputs of an output together (K/2 pairs x 16 outputs x 2 bf16), the
 * layout the bf16 dot-product instructions take: with AMX (Intel Xeon, 4th generation
 * on) rows of x are rounded to bfloat16 and multiplied in 16 x 32 tiles (tdpbf16ps,
 * float32 accumulation); with AVX-512-BF16 alone (AMD Zen 4/5) each vdpbf16ps adds two
 * products per lane, twice the float32 FMA rate (Intel's cores without AMX widen
 * instead, which is faster there: BF16_DOT_TILES); elsewhere the pairs are widened to
 * float32 in registers at up to DIRECT_MAX_ROWS rows, and above that expanded, NP
 * panels at a time, into a per-thread float32 buffer that stays in L2, on which the
 * float32 tiles run (x stays float32 on that path). rs_bf16_path says which one runs.
 * int8 panels (GGUF Q8_0's blocking: one float scale per 32 inputs of an output
 * feature) are computed with integer dot products, as llama.cpp does: each row of x
 * is quantized the same way (int8, a scale per 32 inputs), four int8 products at a
 * time are summed into int32 lanes (AVX-512 VNNI's vpdpbusd, or vpmaddubsw + vpmaddwd
 * on AVX2; from 16 rows AMX's tdpbsud, one block of 32 inputs per tile product, 4-bit
 * weights too; rs_int8_path says which), and each block's sum is scaled into float32.
 * The panel stores four consecutive inputs of an output together for that, block by
 * block: each block of 32 inputs is 8 groups of 16 outputs x 4 bytes, then the
 * block's 16 float scales (576 bytes; 1.125 bytes per weight), so a tile reads one
 * stream per panel, the scales beside the weights they scale (with the scales K/32 x
 * 16 after the weights, a tile of NP panels read 2 NP streams; this layout measured
 * 1.05x at one row, 1.2x at 8 and 1.2-1.4x at 64 on an AVX2 Zen 3, results bit for
 * bit the same). Each weight byte holds w + 128 (0..255): vpdpbusd multiplies
 * unsigned bytes by signed ones, so x stays signed and a block's sum starts at -128
 * times the sum of x's block instead of 0, which makes it exactly the signed one (one
 * instruction per 4 products, where signed times signed takes three). Without VNNI,
 * vpmaddubsw's 16-bit pair sums would overflow with such bytes: there the weight is
 * flipped back to signed and multiplied as |x| times w with x's sign, as before.
 * 4-bit panels (GGUF Q4_0 and Q4_1, packed from the file's blocks as they are) hold,
 * block by block, 4 groups of 16 outputs x 4 bytes, each byte two weights (low nibble:
 * input t of the group, high: input t + 4), then the block's 16 half-precision scales d
 * and 16 offsets c (a weight is q * d + c, q in 0..15: Q4_0's c is -8 d, Q4_1's its m):
 * 320 bytes a block, 0.625 bytes per weight. x is quantized as for int8; unsigned
 * nibbles times signed x are what vpdpbusd and vpmaddubsw take, and the offset adds c
 * times x's block sum.
 * IQ4 panels (GGUF IQ4_NL and IQ4_XS, packed from the file's blocks) hold nibbles in
 * the 4-bit layout, each an index into 16 fixed int8 levels (IQ4_LEVELS), then the
 * block's 16 float scales (exactly IQ4_XS's d times a 6-bit factor): the tiles look the
 * levels up with one byte shuffle (vpshufb) and go on as int8's, the levels stored + 128.
 * MXFP4 panels (gpt-oss's experts, GGUF MXFP4) are IQ4 panels of other levels: FP4's
 * values doubled (MXFP4_LEVELS, int8), the block's power-of-two scale halved as a float.
 *
 * The work-sharing loops are orphaned `omp for`s: called inside a parallel region
 * (the fused forward, llama.c) they share that region's threads; called outside one
 * they run on the calling thread, so rs_linear opens a region of its own.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
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
/* 4 panels a tile up to 4 rows, one panel above: a block of 8 rows x 4 panels spills
   accumulators, and one panel that fetches the next one keeps memory busy while the
   block computes (the default model's layers alone, old and new builds alternating,
   AMD EPYC Zen 5: float32 1.04-1.07x at 5-8 rows; widened bfloat16 1.12-1.23x). */
#ifndef WIDE_MAX_ROWS
#define WIDE_MAX_ROWS 4
#endif
/* Up to 8 rows in one block: a batch of 8 reads the weight once, its FMAs overlapping
   the stream (measured: 1.21x at 8 rows over two blocks of 4, which left memory idle
   while the second computed from cache; 1.05x at 64 rows, 8 x 1 panel). */
#ifndef MR_MAX
#define MR_MAX 8
#endif
/* On Intel cores (RS_INTEL) float tiles take 4 panels at every row count instead, in
   blocks of up to 6 rows (24 accumulators, 4 weight vectors and a broadcast fill the 32
   registers): one panel of 8 rows loads 9 vectors for every 8 FMAs, and Intel's two
   vector load ports then bound the FMAs' two; 6 x 4 loads 10 for 24. The default model's
   layers alone (a loop over its 121 weights, both builds, alternating rounds, medians;
   Intel Xeon, family 6 model 207): float32 0.97-1.05x at 6-8 rows (the same, within
   this machine's noise: bound by memory), 1.12x at 12, 1.20x at 24, 1.22x at 64 (6 x 4
   against 4 x 4: 1.08x), 1.30x at 256; bfloat16 1.26x at 12 rows (widened in
   registers), 1.19x at 64 (widened into float32 panels), but 0.85x at 8, where two
   blocks of 4 rows widen each weight twice: up to 8 rows it keeps one panel.
   FLOAT_WIDE_TILES=0 or 1 builds either way. */
#ifndef FLOAT_WIDE_TILES
#ifdef RS_INTEL
#define FLOAT_WIDE_TILES 1
#else
#define FLOAT_WIDE_TILES 0
#endif
#endif
#else
#undef FLOAT_WIDE_TILES
#define FLOAT_WIDE_TILES 0   /* AVX2's 16 registers hold 3 rows x 2 panels at most */
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
#define FLOAT_WIDE_MR 6   /* FLOAT_WIDE_TILES' rows: 6 x 4 panels, 24 accumulators */
#define BF16_MR_MAX 6   /* vdpbf16ps tiles: 6 rows x 4 panels at most */

typedef uint32_t vu32 __attribute__((vector_size(VL * 4), aligned(4)));

/* int8 and 4-bit panels are stored block by block: each block of 32 inputs holds the
   16 outputs' weights, then their scales, so a tile reads one stream per panel. */
#define Q8_WEIGHT_BYTES (RS_INT8_BLOCK * RS_PANEL)       /* 512: 8 groups of 4 inputs */
#define Q8_BLOCK_BYTES (Q8_WEIGHT_BYTES + RS_PANEL * 4)  /* + 16 float scales */
#define Q4_WEIGHT_BYTES (RS_INT8_BLOCK * RS_PANEL / 2)   /* 256: 4 groups of 8 inputs */
#define Q4_BLOCK_BYTES (Q4_WEIGHT_BYTES + RS_PANEL * 4)  /* + 16 half d, then 16 half c */

/* Bytes of one packed panel of K inputs. */
static int64_t panel_bytes(int64_t K, int format)
{
    switch (format) {
    case RS_BF16: return K * RS_PANEL * 2;
    case RS_INT8: return K / RS_INT8_BLOCK * Q8_BLOCK_BYTES;
    case RS_Q4:
    case RS_IQ4:
    case RS_MXFP4: return K / RS_INT8_BLOCK * Q4_BLOCK_BYTES;
    default: return K * RS_PANEL * 4;
    }
}

int64_t rs_packed_bytes(int64_t N, int64_t K, int format)
{
    return (N + RS_PANEL - 1) / RS_PANEL * panel_bytes(K, format);
}

/* Where input k of output j of a panel is in an int8 panel (groups of 4 inputs), whose
   bytes hold w + 128. */
static inline int64_t int8_index(int64_t k, int64_t j)
{
    return k / RS_INT8_BLOCK * Q8_BLOCK_BYTES + (k % RS_INT8_BLOCK & ~3) * RS_PANEL + j * 4 +
           (k & 3);
}

/* Block g's scales of an int8 panel. */
static inline float *int8_scales(char *panel, int64_t g)
{
    return (float *)(panel + g * Q8_BLOCK_BYTES + Q8_WEIGHT_BYTES);
}

/* Where input k of output j of a panel is in a bfloat16 panel (pairs of inputs). */
static inline int64_t bf16_index(int64_t k, int64_t j)
{
    return (k & ~(int64_t)1) * RS_PANEL + j * 2 + (k & 1);
}

/* The byte of a 4-bit panel that holds input k of output j (groups of 8 inputs: k & 4
   says which nibble). */
static inline int64_t q4_index(int64_t k, int64_t j)
{
    return k / RS_INT8_BLOCK * Q4_BLOCK_BYTES + (k % RS_INT8_BLOCK >> 3) * RS_PANEL * 4 +
           j * 4 + (k & 3);
}

/* Block g's 16 scales d of a 4-bit panel, followed by its 16 offsets c. */
static inline uint16_t *q4_scales(char *panel, int64_t g)
{
    return (uint16_t *)(panel + g * Q4_BLOCK_BYTES + Q4_WEIGHT_BYTES);
}

/* IEEE half precision <-> float (GGUF's scales), by the compiler's _Float16. */
static float half_to_float(uint16_t h)
{
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

static uint16_t float_to_half(float f)   /* round to nearest even */
{
    const _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

/* GGUF block types this packs as they are (ggml's type ids). */
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define GGML_IQ4_NL 20
#define GGML_IQ4_XS 23
#define GGML_MXFP4 39

/* The weights an IQ4 nibble stands for, times its block's scale (ggml's kvalues_iq4nl). */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113};
/* The levels + 128, as int8 panels hold their weights (the bytes after the 16 are 0:
   the portable build's IV_TABLE loads a whole vector). */
static const uint8_t IQ4_BYTES[64] = {1, 24, 45, 63, 79, 93, 106, 118,
                                      129, 141, 153, 166, 181, 197, 217, 241};

/* MXFP4's (gpt-oss's experts') FP4 values doubled, by code (ggml's kvalues_mxfp4): int8
   levels of half the block's power-of-two scale, 2^(e - 128). */
static const int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const uint8_t MXFP4_BYTES[64] = {128, 129, 130, 131, 132, 134, 136, 140,
                                        128, 127, 126, 125, 124, 122, 120, 116};

/* MXFP4's scale byte e as the float 2^(e - 128) its doubled levels take, bit for bit
   as ggml makes it (2^-128 and 2^-127 are subnormal: not left to a library's ldexpf,
   which flushes them under -ffast-math's modes). */
static float mxfp4_half_scale(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The int8 levels a nibble indexes in a format of levels (IQ4, MXFP4), and the levels
   + 128 (as int8 panels hold their weights); NULL for other formats. */
static const int8_t *format_levels(int format)
{
    return format == RS_IQ4 ? IQ4_LEVELS : format == RS_MXFP4 ? MXFP4_LEVELS : NULL;
}

static const uint8_t *format_level_bytes(int format)
{
    return format == RS_IQ4 ? IQ4_BYTES : format == RS_MXFP4 ? MXFP4_BYTES : NULL;
}

/* Block g's 16 float scales of an IQ4 or MXFP4 panel. */
static inline float *iq4_scales(char *panel, int64_t g)
{
    return (float *)(panel + g * Q4_BLOCK_BYTES + Q4_WEIGHT_BYTES);
}

/* Nibble q of input k of output j of a 4-bit or IQ4 panel, over what it held. */
static inline void put_nibble(char *panel, int64_t k, int64_t j, int q)
{
    uint8_t *b = (uint8_t *)panel + q4_index(k, j);
    *b = k & 4 ? (uint8_t)((*b & 15) | q << 4) : (uint8_t)((*b & 0xf0) | q);
}

/* Bytes of one GGUF block of `type` (0: not one of ours), and its weights. */
int64_t rs_gguf_block_bytes(int type)
{
    return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q8_0 ? 34
         : type == GGML_IQ4_NL ? 18 : type == GGML_IQ4_XS ? 136 : type == GGML_MXFP4 ? 17 : 0;
}

static int64_t gguf_block_weights(int type)
{
    return type == GGML_IQ4_XS ? 256 : 32;
}

/* IQ4_XS super-block `sb`'s sub-block i (of 8) as its scale and nibbles: d (s - 32),
   s 6 bits, its low 4 in byte 4 + i / 2, its high 2 in the uint16 at byte 2. */
static float iq4_xs_scale(const uint8_t *sb, int i, const uint8_t **qs)
{
    uint16_t d, high;
    memcpy(&d, sb, 2);
    memcpy(&high, sb + 2, 2);
    const int s = ((sb[4 + i / 2] >> 4 * (i % 2)) & 15) | (((high >> 2 * i) & 3) << 4);
    *qs = sb + 8 + 16 * i;
    return half_to_float(d) * (float)(s - 32);
}

/* N rows of K weights in GGUF blocks of `type` (each row K / its block's weights
   blocks) -> packed panels: Q8_0 as RS_INT8, Q4_0 and Q4_1 as RS_Q4, IQ4_NL and
   IQ4_XS as RS_IQ4, MXFP4 as RS_MXFP4 (its scale byte e as the float 2^(e - 128), as
   ggml reads it for its doubled levels). Nothing is requantized: every weight unpacks
   to what the file's dequantization gives. Returns -1 for another type or K not a
   multiple of its blocks. */
int rs_pack_gguf(const uint8_t *raw, int64_t N, int64_t K, int type, void *packed)
{
    const int64_t bb = rs_gguf_block_bytes(type), blocks = K / RS_INT8_BLOCK;
    if (bb == 0 || K % gguf_block_weights(type) != 0)
        return -1;
    const int iq4 = type == GGML_IQ4_NL || type == GGML_IQ4_XS, mxfp4 = type == GGML_MXFP4;
    const int format = type == GGML_Q8_0 ? RS_INT8 : iq4 ? RS_IQ4 : mxfp4 ? RS_MXFP4 : RS_Q4;
    const int64_t panels = (N + RS_PANEL - 1) / RS_PANEL, pb = panel_bytes(K, format);
#pragma omp parallel
    {
        RS_FAST_MODES;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            char *dst = (char *)packed + p * pb;
            memset(dst, 0, pb);   /* the last panel's padding rows: weight 0 */
            for (int64_t g = 0; format == RS_INT8 && g < blocks; g++)
                memset(dst + g * Q8_BLOCK_BYTES, 128, Q8_WEIGHT_BYTES);
            for (int64_t j = 0; j < RS_PANEL && p * RS_PANEL + j < N; j++) {
                const uint8_t *row = raw + (p * RS_PANEL + j) * (K / gguf_block_weights(type)) * bb;
                for (int64_t g = 0; g < blocks; g++) {
                    const uint8_t *blk = row + (type == GGML_IQ4_XS ? g / 8 : g) * bb;
                    uint16_t d;
                    memcpy(&d, blk, 2);
                    if (iq4 || mxfp4) {   /* ggml: byte i holds weights i (low) and i + 16 */
                        const uint8_t *qs = blk + (mxfp4 ? 1 : 2);
                        iq4_scales(dst, g)[j] = mxfp4 ? mxfp4_half_scale(blk[0])
                            : type == GGML_IQ4_XS ? iq4_xs_scale(blk, (int)(g % 8), &qs)
                            : half_to_float(d);
                        for (int t = 0; t < 32; t++)
                            put_nibble(dst, g * 32 + t, j, t < 16 ? qs[t] & 15 : qs[t - 16] >> 4);
                        continue;
                    }
                    if (format == RS_INT8) {
                        int8_scales(dst, g)[j] = half_to_float(d);
                        for (int t = 0; t < 32; t++)
                            ((uint8_t *)dst)[int8_index(g * 32 + t, j)] = blk[2 + t] ^ 0x80;
                        continue;
                    }
                    uint16_t c;
                    if (type == GGML_Q4_1)
                        memcpy(&c, blk + 2, 2);
                    else
                        c = float_to_half(-8.0f * half_to_float(d));
                    q4_scales(dst, g)[j] = d;
                    q4_scales(dst, g)[RS_PANEL + j] = c;
                    const uint8_t *qs = blk + (type == GGML_Q4_1 ? 4 : 2);
                    for (int t = 0; t < 32; t++)   /* ggml: byte i holds i (low), i + 16 */
                        put_nibble(dst, g * 32 + t, j, t < 16 ? qs[t] & 15 : qs[t - 16] >> 4);
                }
            }
        }
    }
    return 0;
}

/* The index of the level nearest w / d (0 for d 0). */
static int nearest_level(const int8_t *levels, float w, float d)
{
    int best = 0;
    for (int q = 1; d != 0.0f && q < 16; q++)
        best = fabsf(w - d * levels[q]) < fabsf(w - d * levels[best]) ? q : best;
    return best;
}

/* A block of 32 weights' MXFP4 scale byte, as the OCP MX format chooses it: the power
   of two 2^(e - 127) that puts its largest weight in [4, 8) times it (FP4's largest
   value is 6, so the largest weights round to 6 or are clamped there). */
static int mxfp4_scale_byte(const float *w)
{
    float top = 0.0f;
    for (int t = 0; t < RS_INT8_BLOCK; t++)
        top = fabsf(w[t]) > top ? fabsf(w[t]) : top;
    int exp2;
    frexpf(top, &exp2);   /* top = f 2^exp2, f in [0.5, 1) */
    const int e = top > 0.0f ? exp2 - 1 - 2 + 127 : 0;
    return e < 0 ? 0 : e > 254 ? 254 : e;
}

/* A block of 32 weights' IQ4 scale, as ggml chooses IQ4_NL's: its largest weight put
   at each of 15 places around the outermost level, each weight given its nearest level,
   and the least-squares scale of the try with the smallest squared error. */
static float iq4_scale(const float *w)
{
    float top = 0.0f;
    for (int t = 0; t < RS_INT8_BLOCK; t++)
        top = fabsf(w[t]) > fabsf(top) ? w[t] : top;
    if (top == 0.0f)
        return 0.0f;
    float best = top / IQ4_LEVELS[0], least = INFINITY;
    for (int step = -7; step <= 7; step++) {
        const float d0 = top / (IQ4_LEVELS[0] + step);
        float wl = 0.0f, ll = 0.0f, l[RS_INT8_BLOCK];
        for (int t = 0; t < RS_INT8_BLOCK; t++) {
            l[t] = IQ4_LEVELS[nearest_level(IQ4_LEVELS, w[t], d0)];
            wl += w[t] * l[t];
            ll += l[t] * l[t];
        }
        const float d = wl / ll;
        float err = 0.0f;
        for (int t = 0; t < RS_INT8_BLOCK; t++) {
            const float e = w[t] - d * l[t];
            err += e * e;
        }
        if (err < least) {
            least = err;
            best = d;
        }
    }
    return best;
}

/* w [N, K] float32 -> packed panels in `format`. Returns -1 if int8 is asked for
   with K not a multiple of its block, or bfloat16 with K odd. */
int rs_pack_weight(const float *w, int64_t N, int64_t K, int format, void *packed)
{
    if (((format == RS_INT8 || format == RS_Q4 || format_levels(format)) &&
         K % RS_INT8_BLOCK != 0)
        || (format == RS_BF16 && K % 2 != 0))
        return -1;
    const int64_t panels = (N + RS_PANEL - 1) / RS_PANEL;
    const int64_t pb = panel_bytes(K, format);
#pragma omp parallel
    {
        RS_FAST_MODES;
#pragma omp for schedule(static)
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
                            ((uint16_t *)dst)[bf16_index(k, j)] = rs_to_bf16(v);
                    }
                    continue;
                }
                if (format_levels(format)) {   /* IQ4 as ggml's IQ4_NL (iq4_scale); MXFP4 */
                    for (int64_t g = 0; g < K / RS_INT8_BLOCK; g++) {
                        const float *blk = row ? row + g * RS_INT8_BLOCK : NULL;
                        const float d = blk == NULL ? 0.0f : format == RS_IQ4 ? iq4_scale(blk)
                                      : mxfp4_half_scale((uint8_t)mxfp4_scale_byte(blk));
                        iq4_scales(dst, g)[j] = d;
                        for (int t = 0; t < RS_INT8_BLOCK; t++)
                            put_nibble(dst, g * RS_INT8_BLOCK + t, j,
                                       blk ? nearest_level(format_levels(format), blk[t], d) : 0);
                    }
                    continue;
                }
                if (format == RS_Q4) {   /* as GGUF's Q4_1: q * d + min, q in 0..15 */
                    for (int64_t g = 0; g < K / RS_INT8_BLOCK; g++) {
                        float lo = 0.0f, hi = 0.0f;
                        for (int64_t k = g * RS_INT8_BLOCK; row && k < (g + 1) * RS_INT8_BLOCK; k++) {
                            lo = k == g * RS_INT8_BLOCK || row[k] < lo ? row[k] : lo;
                            hi = k == g * RS_INT8_BLOCK || row[k] > hi ? row[k] : hi;
                        }
                        const uint16_t dh = float_to_half((hi - lo) / 15.0f), mh = float_to_half(lo);
                        const float d = half_to_float(dh), m = half_to_float(mh);
                        q4_scales(dst, g)[j] = dh;
                        q4_scales(dst, g)[RS_PANEL + j] = mh;
                        for (int64_t k = g * RS_INT8_BLOCK; k < (g + 1) * RS_INT8_BLOCK; k++) {
                            const long q = row && d > 0.0f ? lrintf((row[k] - m) / d) : 0;
                            put_nibble(dst, k, j, (int)(q < 0 ? 0 : q > 15 ? 15 : q));
                        }
                    }
                    continue;
                }
                uint8_t *q = (uint8_t *)dst;
                for (int64_t g = 0; g < K / RS_INT8_BLOCK; g++) {
                    float amax = 0.0f;
                    for (int64_t k = g * RS_INT8_BLOCK; row && k < (g + 1) * RS_INT8_BLOCK; k++)
                        amax = fabsf(row[k]) > amax ? fabsf(row[k]) : amax;
                    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                    int8_scales(dst, g)[j] = scale;
                    for (int64_t k = g * RS_INT8_BLOCK; k < (g + 1) * RS_INT8_BLOCK; k++)
                        q[int8_index(k, j)] = (uint8_t)(128 + (row ? lrintf(row[k] * inv) : 0));
                }
            }
        }
    }
    return 0;
}

/* VL outputs' input k of a bfloat16 panel, as floats, from its pair at `pair` (the
   pair's first input is the low half of each 32-bit lane). */
static inline vf bf16_pair_to_float(const uint16_t *pair, int odd)
{
    const vu32 u = *(const vu32 *)pair;
    return (vf)(odd ? u & 0xffff0000u : u << 16);
}

/* Panels [p, p + np) of a bf16 weight as float32 panels in `out`. */
static void expand_panels(const char *packed, int64_t p, int np, int64_t K, float *out)
{
    const int64_t pb = panel_bytes(K, RS_BF16);
    for (int q = 0; q < np; q++) {
        const uint16_t *src = (const uint16_t *)(packed + (p + q) * pb);
        vf *dst = (vf *)(out + q * K * RS_PANEL);   /* K x PV vectors */
        for (int64_t i = 0; i < K / 2; i++)
            for (int h = 0; h < PV; h++) {
                const uint16_t *pair = src + i * 2 * RS_PANEL + h * VL * 2;
                dst[2 * i * PV + h] = bf16_pair_to_float(pair, 0);
                dst[(2 * i + 1) * PV + h] = bf16_pair_to_float(pair, 1);
            }
    }
}

/* The float32 weight [N, K] a packed one stands for (tests check the formats with it). */
int rs_unpack_weight(const void *packed, int64_t N, int64_t K, int format, float *w)
{
    const int64_t pb = panel_bytes(K, format);
    for (int64_t n = 0; n < N; n++) {
        const char *panel = (const char *)packed + n / RS_PANEL * pb;
        const int64_t j = n % RS_PANEL;
        for (int64_t k = 0; k < K; k++) {
            const int64_t at = k * RS_PANEL + j;
            float v;
            if (format == RS_F32) {
                v = ((const float *)panel)[at];
            } else if (format == RS_BF16) {
                const uint32_t bits = (uint32_t)((const uint16_t *)panel)[bf16_index(k, j)] << 16;
                memcpy(&v, &bits, 4);
            } else if (format_levels(format)) {
                const uint8_t byte = ((const uint8_t *)panel)[q4_index(k, j)];
                v = format_levels(format)[k & 4 ? byte >> 4 : byte & 15] *
                    iq4_scales((char *)panel, k / RS_INT8_BLOCK)[j];
            } else if (format == RS_Q4) {
                const uint8_t byte = ((const uint8_t *)panel)[q4_index(k, j)];
                const uint16_t *dc = q4_scales((char *)panel, k / RS_INT8_BLOCK);
                v = (k & 4 ? byte >> 4 : byte & 15) * half_to_float(dc[j]) +
                    half_to_float(dc[RS_PANEL + j]);
            } else {
                v = (((const uint8_t *)panel)[int8_index(k, j)] - 128) *
                    int8_scales((char *)panel, k / RS_INT8_BLOCK)[j];
            }
            w[n * K + k] = v;
        }
    }
    return 0;
}

/* A buffer per thread (expanded panels, or quantized rows of x), grown as needed and
   kept. */
static void *thread_buffer(int64_t bytes)
{
    static __thread void *buf = NULL;
    static __thread int64_t cap = 0;
    if (bytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        cap = buf ? bytes : 0;
    }
    return buf;
}

/* Weight vector v of a tile (panel v / PV, vector v % PV) at input k, as floats: read in
   place (float32) or widened (bfloat16). */
static inline __attribute__((always_inline)) vf
weight_vector(const int FORMAT, const char *panel0, int64_t pb, int v, int64_t k)
{
    const char *panel = panel0 + (v / PV) * pb;
    if (FORMAT == RS_BF16)
        return bf16_pair_to_float((const uint16_t *)panel + (k & ~(int64_t)1) * RS_PANEL +
                                      (v % PV) * VL * 2, (int)(k & 1));
    return *(const vf *)((const float *)panel + k * RS_PANEL + (v % PV) * VL);
}

/* A tile's float32 results into y (+ bias, + y if accumulating). */
static inline __attribute__((always_inline)) void
store_tile(const int MR, const int NP, vf acc[][NP_MAX * PV], const float *bias, float *y,
           int64_t ldy, int64_t n_left, int accumulate)
{
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

/* Where a float tile's fetches of the next panel go: L1, or on Intel cores (RS_INTEL,
   set by kernels.py from the CPU's vendor) L2. The default model's layers alone, an
   Intel Xeon (family 6 model 207), builds alternating, float32 L2 / L1: 1.18x at 5 rows,
   1.08-1.12x at 8, 1.09x at 16, 1.08x at 64 (4-panel tiles of 1-4 rows fetch nothing).
   Integer tiles there, bound by their products, gain nothing from it (0.93-1.01x) and
   fetch into L1 everywhere; on AMD Zen 5 L1 was measured alone. */
#ifdef RS_INTEL
#define FLOAT_AHEAD_HINT _MM_HINT_T1
#else
#define FLOAT_AHEAD_HINT _MM_HINT_T0
#endif

/* One float tile: rows x[0..MR) against the NP panels at panel0, pb bytes apart, in
   FORMAT (float32 or bfloat16), accumulated over all of K in registers. `n_left` is how
   many output columns remain from the tile's first one (the last panel may be
   partial). Inputs [ahead_lo, ahead_hi) of the next NP panels are fetched into the
   cache as it goes. */
static inline __attribute__((always_inline)) void
tile(const int MR, const int NP, const int FORMAT, const float *x, int64_t ldx,
     const char *panel0, int64_t pb, int64_t K, const float *bias, float *y, int64_t ldy,
     int64_t n_left, int accumulate, int64_t ahead_lo, int64_t ahead_hi)
{
    vf acc[8][NP_MAX * PV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NP * PV; v++)
            acc[m][v] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf w[NP_MAX * PV];
        for (int v = 0; v < NP * PV; v++)
            w[v] = weight_vector(FORMAT, panel0, pb, v, k);
        /* one line per panel */
        if (k >= ahead_lo && k < ahead_hi && (FORMAT == RS_F32 || (k & 1) == 0))
            for (int q = 0; q < NP; q++)
                _mm_prefetch(panel0 + (NP + q) * pb + k * RS_PANEL * (FORMAT == RS_F32 ? 4 : 2),
                             FLOAT_AHEAD_HINT);
        for (int m = 0; m < MR; m++) {
            const float xm = x[m * ldx + k];
            for (int v = 0; v < NP * PV; v++)
                acc[m][v] += xm * w[v];
        }
    }
    store_tile(MR, NP, acc, bias, y, ldy, n_left, accumulate);
}

/* Byte dot products, 4 at a time into each int32 lane, for lanes of 4 bytes (x: one
   row's 4 inputs, broadcast): dot4u takes unsigned bytes times signed ones (weights
   as stored, times x: what vpdpbusd and vpmaddubsw multiply); dot4 signed times
   signed, as |x| times w with x's sign. VNNI: dot4u is vpdpbusd. U8_EXACT: dot4u is
   exact for any unsigned byte (VNNI, portable); without it (vpmaddubsw's saturating
   16-bit pair sums) only for small ones (4-bit weights), and int8 weights are flipped
   back to signed (IV_SIGNED) for dot4. IV_LO, IV_HI: the low and high nibbles of each
   byte; IV_LOOKUP: each byte (0..15) replaced by that byte of a table of 16 (IV_TABLE,
   the same 16 in every 128 bits). */
#if defined(__AVX512BW__)
typedef __m512i iv;
#define IV_ZERO _mm512_setzero_si512()
#define IV_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define IV_BROADCAST(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define IV_TO_FLOAT(a) ((vf)_mm512_cvtepi32_ps(a))
#define IV_LO(w) _mm512_and_si512(w, _mm512_set1_epi8(15))
#define IV_HI(w) _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15))
#define IV_SIGNED(w) _mm512_xor_si512(w, _mm512_set1_epi8(-128))
#define IV_TABLE(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#define IV_LOOKUP(table, w) _mm512_shuffle_epi8(table, w)
#if defined(__AVX512VNNI__)
#define VNNI 1
#else
#define VNNI 0
#endif
#define U8_EXACT VNNI
static inline iv dot4u(iv acc, iv u, iv s)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
#endif
}
static inline iv dot4(iv acc, iv x, iv w)
{
    return dot4u(acc, _mm512_abs_epi8(x),
                 _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), IV_ZERO, w));
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
typedef __m256i iv;
#define IV_ZERO _mm256_setzero_si256()
#define IV_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define IV_BROADCAST(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define IV_TO_FLOAT(a) ((vf)_mm256_cvtepi32_ps(a))
#define IV_LO(w) _mm256_and_si256(w, _mm256_set1_epi8(15))
#define IV_HI(w) _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15))
#define IV_SIGNED(w) _mm256_xor_si256(w, _mm256_set1_epi8(-128))
#define IV_TABLE(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define IV_LOOKUP(table, w) _mm256_shuffle_epi8(table, w)
#if defined(__AVXVNNI__)
#define VNNI 1
#else
#define VNNI 0
#endif
#define U8_EXACT VNNI
static inline iv dot4u(iv acc, iv u, iv s)
{
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}
static inline iv dot4(iv acc, iv x, iv w)
{
    return dot4u(acc, _mm256_abs_epi8(x), _mm256_sign_epi8(w, x));
}
#else   /* portable: GCC vectors, lane by lane */
typedef int32_t iv __attribute__((vector_size(VL * 4)));
typedef int8_t iv8 __attribute__((vector_size(VL * 4)));
typedef uint8_t iv8u __attribute__((vector_size(VL * 4)));
#define IV_ZERO ((iv){0})
static inline iv IV_LOAD(const void *p) { iv r; memcpy(&r, p, sizeof r); return r; }
static inline iv IV_BROADCAST(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return (iv){0} + v;
}
#define IV_TO_FLOAT(a) __builtin_convertvector(a, vf)
#define IV_LO(w) ((iv)((iv8u)(w) & 15))
#define IV_HI(w) ((iv)((iv8u)(w) >> 4))
#define IV_SIGNED(w) ((iv)((iv8u)(w) ^ 0x80))
#define IV_TABLE(p) IV_LOAD(p)   /* its first 16 bytes */
static inline iv IV_LOOKUP(iv table, iv w)
{
    iv8u b = (iv8u)w;
    for (unsigned i = 0; i < sizeof b; i++)
        b[i] = ((iv8u)table)[b[i]];
    return (iv)b;
}
#define VNNI 0
#define U8_EXACT 1
/* Bytes of a times bytes of b, unsigned or signed as a_unsigned says; b signed. */
static inline iv dot4_bytes(iv acc, iv a, iv b, int a_unsigned)
{
    const iv8u au = (iv8u)a;
    const iv8 as = (iv8)a, bs = (iv8)b;
    for (int l = 0; l < VL; l++)
        for (int t = 0; t < 4; t++)
            acc[l] += (a_unsigned ? au[4 * l + t] : as[4 * l + t]) * bs[4 * l + t];
    return acc;
}
static inline iv dot4u(iv acc, iv u, iv s) { return dot4_bytes(acc, u, s, 1); }
static inline iv dot4(iv acc, iv x, iv w) { return dot4_bytes(acc, x, w, 0); }
#endif

/* a b + c, one rounding where the CPU has FMA */
static inline vf vf_fma(vf a, vf b, vf c)
{
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline vf halves_to_float(const uint16_t *h)
{
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    vf r;
    for (int l = 0; l < VL; l++)
        r[l] = half_to_float(h[l]);
    return r;
#endif
}

/* 4-bit panels unpacked (expand_q4) for the integer tiles: a byte a weight (0..15) in
   int8's layout, each block's 16 scales d and 16 offsets c after its 512 bytes as in
   4-bit panels. From Q4X_MIN_ROWS rows a thread unpacks a group of panels once, into
   L2, where each row block unpacked the nibbles again: the default model's layers
   alone (AVX-512, Intel Xeon, builds alternating) 1.06 / 1.12 / 1.07x at 40 / 64 / 128
   rows, and 1.13x at 64 on AVX2; at 8-32 rows 0.6-0.97x, the tiles then no longer
   fetching the next panels while they compute. */
#define RS_Q4X 6
#ifndef Q4X_MIN_ROWS
#define Q4X_MIN_ROWS 33
#endif

/* Panels [p, p + np) of a 4-bit weight (pb bytes each) into out, as RS_Q4X; of one of
   levels (IQ4, MXFP4: level_bytes, its levels + 128) as int8 panels (RS_INT8: each
   level + 128, the float scales as they are), on which the int8 tiles run. Both keep
   64 bytes of scales a block. */
static void expand_q4(const uint8_t *level_bytes, const char *packed, int64_t pb, int64_t p,
                      int np, int64_t K, char *out)
{
    const int64_t blocks = K / RS_INT8_BLOCK;
    const int levels = level_bytes != NULL;
    const iv table = levels ? IV_TABLE(level_bytes) : IV_ZERO;
    for (int q = 0; q < np; q++)
        for (int64_t b = 0; b < blocks; b++) {
            const char *src = packed + (p + q) * pb + b * Q4_BLOCK_BYTES;
            char *dst = out + (q * blocks + b) * Q8_BLOCK_BYTES;
            /* 4-bit group g (inputs 8g..8g+7) holds int8's groups 2g (low nibbles) and
               2g + 1 (high) */
            for (int g = 0; g < RS_INT8_BLOCK / 8; g++)
                for (int h = 0; h < RS_PANEL * 4; h += VL * 4) {
                    const iv raw = IV_LOAD(src + g * RS_PANEL * 4 + h);
                    const iv lo = levels ? IV_LOOKUP(table, IV_LO(raw)) : IV_LO(raw),
                             hi = levels ? IV_LOOKUP(table, IV_HI(raw)) : IV_HI(raw);
                    memcpy(dst + 2 * g * RS_PANEL * 4 + h, &lo, sizeof lo);
                    memcpy(dst + (2 * g + 1) * RS_PANEL * 4 + h, &hi, sizeof hi);
                }
            memcpy(dst + Q8_WEIGHT_BYTES, src + Q4_WEIGHT_BYTES, RS_PANEL * 4);
        }
}

/* One integer tile: rows [0..MR) of the quantized x (xq: int8, K per row; xs: a scale
   per block of 32; for 4-bit weights xsum: xs times the block's sum of int8 values,
   for int8 ones xoff: -128 times that sum, as an int32) against the NP panels at
   panel0, int8 (FORMAT RS_INT8) or 4-bit (RS_Q4, or unpacked: RS_Q4X). Block sums
   in int32 lanes, scaled into float32 once per block of 32. The blocks of inputs
   [ahead_lo, ahead_hi) of the next NP panels are fetched as it goes. */
static inline __attribute__((always_inline)) void
tile_int(const int MR, const int NP, const int FORMAT, const int8_t *xq, const float *xs,
         const float *xsum, const int32_t *xoff, const char *panel0, int64_t pb, int64_t K,
         const float *bias, float *y, int64_t ldy, int64_t n_left, int accumulate,
         int64_t ahead_lo, int64_t ahead_hi)
{
    const int64_t blocks = K / RS_INT8_BLOCK;
    /* nibbles: packed two a byte (4-bit, IQ4, MXFP4); q4: weights q d + c (4-bit,
       unpacked or not); levels: nibbles that index IQ4's or MXFP4's levels */
    const int levels = FORMAT == RS_IQ4 || FORMAT == RS_MXFP4,
              nibbles = FORMAT == RS_Q4 || levels,
              q4 = FORMAT == RS_Q4 || FORMAT == RS_Q4X;
    const int step = nibbles ? 8 : 4;   /* inputs per 64-byte load */
    const int64_t block_bytes = nibbles ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES,
                  weight_bytes = nibbles ? Q4_WEIGHT_BYTES : Q8_WEIGHT_BYTES;   /* then scales */
    const int unsigned_w = q4 || U8_EXACT;   /* dot4u on the bytes as stored */
    const iv table = levels ? IV_TABLE(format_level_bytes(FORMAT)) : IV_ZERO;
    vf acc[8][NP_MAX * PV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NP * PV; v++)
            acc[m][v] = (vf){0};
    for (int64_t b = 0; b < blocks; b++) {
        const char *block = panel0 + b * block_bytes;
        const int ahead = b * RS_INT8_BLOCK >= ahead_lo && b * RS_INT8_BLOCK < ahead_hi;
        iv sums[8][NP_MAX * PV];
        for (int m = 0; m < MR; m++) {
            /* int8 bytes hold w + 128: from -128 sum(x), the sum is w x's exactly */
            const iv start = !q4 && unsigned_w ? IV_BROADCAST(xoff + m * blocks + b)
                                               : IV_ZERO;
            for (int v = 0; v < NP * PV; v++)
                sums[m][v] = start;
        }
#pragma GCC unroll 8
        for (int g = 0; g < RS_INT8_BLOCK / step; g++) {
            const int64_t k = b * RS_INT8_BLOCK + g * step;
            const int64_t at = g * RS_PANEL * 4;   /* byte of k's group in the block */
            /* VL outputs x 4 inputs (int8) or 8 (4-bit) per vector */
            iv raw[NP_MAX * PV], w[NP_MAX * PV];
            for (int v = 0; v < NP * PV; v++) {
                raw[v] = IV_LOAD(block + (v / PV) * pb + at + (v % PV) * VL * 4);
                /* the levels + 128, as int8's bytes: signed again without U8_EXACT */
                w[v] = levels ? IV_LOOKUP(table, IV_LO(raw[v]))
                     : nibbles ? IV_LO(raw[v]) : raw[v];
                w[v] = unsigned_w ? w[v] : IV_SIGNED(w[v]);
            }
            /* as in tile(); the scales' line, right after, is left to the hardware
               (fetching it too measured 0.87x at one row, AVX2 Zen 3) */
            for (int q = 0; ahead && q < NP; q++)
                _mm_prefetch(block + (NP + q) * pb + at, _MM_HINT_T0);
            for (int m = 0; m < MR; m++) {
                const iv x = IV_BROADCAST(xq + m * K + k);
                for (int v = 0; v < NP * PV; v++)
                    sums[m][v] = unsigned_w ? dot4u(sums[m][v], w[v], x)
                                            : dot4(sums[m][v], x, w[v]);
            }
            if (!nibbles)
                continue;
            for (int v = 0; v < NP * PV; v++) {
                w[v] = levels ? IV_LOOKUP(table, IV_HI(raw[v])) : IV_HI(raw[v]);
                w[v] = unsigned_w ? w[v] : IV_SIGNED(w[v]);
            }
            for (int m = 0; m < MR; m++) {
                const iv x = IV_BROADCAST(xq + m * K + k + 4);
                for (int v = 0; v < NP * PV; v++)
                    sums[m][v] = unsigned_w ? dot4u(sums[m][v], w[v], x)
                                            : dot4(sums[m][v], x, w[v]);
            }
        }
        for (int v = 0; v < NP * PV; v++) {
            const char *scales = block + (v / PV) * pb + weight_bytes;
            if (q4) {
                const uint16_t *dc = (const uint16_t *)scales + (v % PV) * VL;
                const vf d = halves_to_float(dc), c = halves_to_float(dc + RS_PANEL);
                /* two FMAs: written as one sum, -ffast-math made it two products, an
                   FMA and an add (4-bit layers alone 1.035-1.04x at 8-32 rows,
                   1.04-1.18x at 64; Intel Xeon) */
                for (int m = 0; m < MR; m++)
                    acc[m][v] = vf_fma(c, (vf){0} + xsum[m * blocks + b],
                                       vf_fma(IV_TO_FLOAT(sums[m][v]),
                                              d * xs[m * blocks + b], acc[m][v]));
            } else {
                const vf ws = *(const vf *)((const float *)scales + (v % PV) * VL);
                for (int m = 0; m < MR; m++)
                    acc[m][v] += IV_TO_FLOAT(sums[m][v]) * (ws * xs[m * blocks + b]);
            }
        }
    }
    store_tile(MR, NP, acc, bias, y, ldy, n_left, accumulate);
}

/* bfloat16 products. Rows of x are rounded to bfloat16 (to nearest even) into a
   per-thread buffer, K per row, then multiplied with the weight's pairs. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_DOT 1
static void bf16_rows(const float *x, int64_t M, int64_t K, uint16_t *xb)
{
    int64_t i = 0;
    for (; i + 16 <= M * K; i += 16)
        _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < M * K; i++)
        xb[i] = rs_to_bf16(x[i]);
}

/* One vdpbf16ps tile: rows [0..MR) of the bf16 x against NP panels (one vector each:
   16 outputs x a pair of inputs), two products per lane per instruction. */
static inline __attribute__((always_inline)) void
tile_bf16(const int MR, const int NP, const uint16_t *xb, int64_t K, const char *panel0,
          int64_t pb, const float *bias, float *y, int64_t ldy, int64_t n_left,
          int accumulate, int64_t ahead_lo, int64_t ahead_hi)
{
    vf acc[8][NP_MAX * PV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NP; v++)
            acc[m][v] = (vf){0};
    for (int64_t k = 0; k < K; k += 2) {
        __m512i w[NP_MAX];
        for (int v = 0; v < NP; v++)
            w[v] = _mm512_load_si512((const void *)(panel0 + v * pb + k * RS_PANEL * 2));
        for (int q = 0; k >= ahead_lo && k < ahead_hi && q < NP; q++)   /* a line a panel */
            _mm_prefetch(panel0 + (NP + q) * pb + k * RS_PANEL * 2, _MM_HINT_T0);
        for (int m = 0; m < MR; m++) {
            const __m512i xm = _mm512_set1_epi32(*(const int32_t *)(xb + m * K + k));
            for (int v = 0; v < NP; v++)
                acc[m][v] = (vf)_mm512_dpbf16_ps((__m512)acc[m][v], (__m512bh)xm,
                                                 (__m512bh)w[v]);
        }
    }
    store_tile(MR, NP, acc, bias, y, ldy, n_left, accumulate);
}
#else
#define BF16_DOT 0
#endif

/* Whether bfloat16 tiles use vdpbf16ps where the CPU has it. Not on Intel: its cores
   (Xeon, family 6 model 207, 2026-11-27) run vdpbf16ps at the rate of float32 FMAs for
   the same products, and the weights widened to float32 (in registers, or expanded in
   L2 above DIRECT_MAX_ROWS rows) were faster at every batch: the default model's layers
   alone, builds alternating, 1.08 / 1.02 / 1.01 / 1.18 / 1.24 / 1.09 / 1.24x at 1 / 2 /
   4 / 8 / 16 / 32 / 64 rows. Where AMX runs (from AMX_MIN_ROWS rows), the rows below
   keep vdpbf16ps: x is rounded to bfloat16 at every batch size then, as AMX's tiles
   round it, and a sequence's numbers do not depend on its batch's size.
   -DBF16_DOT_TILES=1 builds the vdpbf16ps tiles on Intel too (the tests check them on
   every CPU that has the instruction). */
#ifndef BF16_DOT_TILES
#ifdef RS_INTEL
#define BF16_DOT_TILES 0
#else
#define BF16_DOT_TILES BF16_DOT
#endif
#endif
/* The same, set once AMX is known usable (amx_init). */
static int bf16_dot_tiles = BF16_DOT_TILES;

/* AMX: tile registers of up to 16 rows x 64 bytes, multiplied by the tile matrix unit.
   Linux hands a process the tile registers only once it asks (arch_prctl
   ARCH_REQ_XCOMP_PERM): rs_init does. Built with -DRS_AMX_EMULATE (tests), the tile
   instructions are plain C (amx_emulate.h) and these paths run on any CPU. */
#if defined(RS_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__x86_64__))
#define AMX_TILES 1
#ifdef RS_AMX_EMULATE
#include "amx_emulate.h"
#endif
#if defined(RS_AMX_EMULATE) || defined(__AMX_BF16__)
#define AMX_BF16 BF16_DOT
#else
#define AMX_BF16 0
#endif
#if defined(RS_AMX_EMULATE) || defined(__AMX_INT8__)
#define AMX_INT8 U8_EXACT
#else
#define AMX_INT8 0
#endif
#else
#define AMX_TILES 0
#define AMX_BF16 0
#define AMX_INT8 0
#endif

#if AMX_TILES
static int amx_usable = 0;
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 16
#endif

/* Tiles 0-3 hold results (16 rows x 16 int32 or float32), 4-5 x (16 rows x a_colsb
   bytes), 6-7 the weight (b_rows x 64 bytes). */
static __attribute__((unused)) void amx_configure(int a_colsb, int b_rows)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = t == 4 || t == 5 ? a_colsb : 64;
        cfg.rows[t] = t >= 6 ? b_rows : 16;
    }
    _tile_loadconfig(&cfg);
}
#endif

#if AMX_BF16
/* bfloat16: 16 x 32 tiles of x times 32 x 16 tiles of the weight (a panel's 16 pairs of
   rows, 1 KB, contiguous) into 16 x 16 float32 tiles, 2 x 2 of them at a time. */

/* y rows [0, rows) x columns [0, cols) of a 16 x 16 result tile c (+ bias, + y). */
static void store_result(const float *c, int64_t rows, int64_t cols, const float *bias,
                         float *y, int64_t ldy, int accumulate)
{
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < cols; j++) {
            const float r = c[m * 16 + j] + (bias ? bias[j] : 0.0f);
            y[m * ldy + j] = accumulate ? y[m * ldy + j] + r : r;
        }
}

/* Panels [p_begin, p_end) for all M rows of xb (bf16, K per row, zero rows up to a
   multiple of 16 after them). c: 4 x 256 floats of scratch. */
static void amx_panels(const uint16_t *xb, int64_t M, int64_t K, const char *packed,
                       int64_t pb, int64_t p_begin, int64_t p_end, const float *bias,
                       float *y, int64_t N, int accumulate, float *c)
{
    const int64_t Mp = (M + 15) / 16 * 16;
    amx_configure(64, 16);
    for (int64_t p = p_begin; p < p_end; p += 2) {
        const int two = p + 1 < p_end;
        const char *w0 = packed + p * pb, *w1 = packed + (p + two) * pb;
        for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
            const int tall = m0 + 16 < Mp;
            const uint16_t *x0 = xb + m0 * K, *x1 = xb + (m0 + 16 * tall) * K;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < K; k += 32) {
                _tile_loadd(4, x0 + k, K * 2);
                _tile_loadd(6, w0 + k * RS_PANEL * 2, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(7, w1 + k * RS_PANEL * 2, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (tall) {
                    _tile_loadd(5, x1 + k, K * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two)
                        _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c, 64);
            _tile_stored(1, c + 256, 64);
            _tile_stored(2, c + 512, 64);
            _tile_stored(3, c + 768, 64);
            for (int t = 0; t < 4; t++) {
                const int64_t row = m0 + 16 * (t / 2), col = (p + t % 2) * RS_PANEL;
                if ((t % 2 && !two) || (t / 2 && !tall) || row >= M || col >= N)
                    continue;
                const int64_t rows = M - row < 16 ? M - row : 16;
                const int64_t cols = N - col < 16 ? N - col : 16;
                store_result(c + 256 * t, rows, cols, bias ? bias + col : NULL,
                             y + row * N + col, N, accumulate);
            }
        }
    }
    _tile_release();
}
#endif

#if AMX_INT8
/* int8 and 4-bit weights: 16 rows of x (int8, as quantize_rows makes them) times one
   block of a panel, a 32 x 16 tile of unsigned bytes, into 16 x 16 int32 sums (tdpbsud:
   signed x times unsigned weights), one block of 32 inputs per product: each block has
   its own scales. An int8 block's 8 groups of 4 inputs x 16 outputs (512 contiguous
   bytes, w + 128) are that tile as they are stored; a 4-bit block's 4 groups of 8
   inputs hold it in nibbles (a group's low nibbles are inputs 0-3 of its 8, its high
   ones 4-7), spread into bytes first. Two blocks at a time (tiles 0-1), so that the
   second's product runs while the first's sums are scaled. The sums are scaled into
   float32 as tile_int does: int8's results are the VNNI tiles' bit for bit, 4-bit's
   within a rounding (the compiler orders its two products' sum otherwise here). xq
   holds whole tiles of 16 rows (the rows after M are never scaled). c: 2 x 256 int32,
   then 2 x 512 bytes of scratch. */
typedef int32_t vi32u __attribute__((vector_size(VL * 4), aligned(4)));

/* acc += a block's int32 sums (c: 16 x 16), scaled: ROWS rows of x (their scales, and
   int32 offsets (int8) or float sums (4-bit), every blocks-th of xs and xo) against the
   block's 16 outputs. */
static inline __attribute__((always_inline)) void
amx_int_scale(const int ROWS, const int Q4, vf *acc, const int32_t *c, const char *block,
              const float *xs, const int32_t *xo, int64_t blocks)
{
    const char *scales = block + (Q4 ? Q4_WEIGHT_BYTES : Q8_WEIGHT_BYTES);
    for (int v = 0; v < PV; v++) {
        if (Q4) {
            const uint16_t *dc = (const uint16_t *)scales + v * VL;
            const vf d = halves_to_float(dc), cc = halves_to_float(dc + RS_PANEL);
            const float *xsum = (const float *)(const void *)xo;
#pragma GCC unroll 16
            for (int m = 0; m < ROWS; m++) {
                const vi32u sums = *(const vi32u *)(c + 16 * m + VL * v);
                acc[m * PV + v] += __builtin_convertvector(sums, vf) * (d * xs[m * blocks]) +
                                   cc * xsum[m * blocks];
            }
        } else {
            const vf ws = *(const vf *)((const float *)scales + VL * v);
#pragma GCC unroll 16
            for (int m = 0; m < ROWS; m++) {
                /* the bytes hold w + 128: from -128 sum(x), w x's exactly */
                const vi32u sums = *(const vi32u *)(c + 16 * m + VL * v) + xo[m * blocks];
                acc[m * PV + v] += __builtin_convertvector(sums, vf) * (ws * xs[m * blocks]);
            }
        }
    }
}

/* A 4-bit block's weights as the 32 x 16 byte tile tdpbsud takes (512 bytes at b). */
static inline void amx_q4_bytes(const char *block, uint8_t *b)
{
    for (int g = 0; g < 4; g++)
        for (int j = 0; j < 64; j += (int)sizeof(iv)) {
            const iv raw = IV_LOAD(block + 64 * g + j), lo = IV_LO(raw), hi = IV_HI(raw);
            memcpy(b + 128 * g + j, &lo, sizeof lo);
            memcpy(b + 128 * g + 64 + j, &hi, sizeof hi);
        }
}

/* One tile of ROWS rows (16, or the rest; a constant, so that a whole tile's 16
   accumulators stay in registers) of x from xq (K per row) against one panel. */
static inline __attribute__((always_inline)) void
amx_int_tile(const int ROWS, const int Q4, const int8_t *xq, const float *xs,
             const int32_t *xo, int64_t K, const char *panel, const float *bias, float *y,
             int64_t ldy, int64_t n_left, int accumulate, int32_t *c)
{
    const int64_t blocks = K / RS_INT8_BLOCK;
    const int64_t block_bytes = Q4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    uint8_t *bytes = (uint8_t *)(c + 512);
    vf acc[16 * PV], out[16][NP_MAX * PV];   /* acc: small enough to stay in registers */
#pragma GCC unroll 16
    for (int m = 0; m < 16 * PV; m++)
        acc[m] = (vf){0};
    for (int64_t b = 0; b < blocks; b += 2) {
        const int two = b + 1 < blocks;
        const char *block = panel + b * block_bytes;
        if (Q4) {
            amx_q4_bytes(block, bytes);
            if (two)
                amx_q4_bytes(block + block_bytes, bytes + 512);
        }
        _tile_zero(0);
        _tile_loadd(4, xq + b * RS_INT8_BLOCK, K);
        _tile_loadd(6, Q4 ? (const void *)bytes : block, 64);
        _tile_dpbsud(0, 4, 6);
        if (two) {
            _tile_zero(1);
            _tile_loadd(5, xq + (b + 1) * RS_INT8_BLOCK, K);
            _tile_loadd(7, Q4 ? (const void *)(bytes + 512) : block + block_bytes, 64);
            _tile_dpbsud(1, 5, 7);
        }
        _tile_stored(0, c, 64);
        amx_int_scale(ROWS, Q4, acc, c, block, xs + b, xo + b, blocks);
        if (two) {   /* its product ran meanwhile */
            _tile_stored(1, c + 256, 64);
            amx_int_scale(ROWS, Q4, acc, c + 256, block + block_bytes, xs + b + 1,
                          xo + b + 1, blocks);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < ROWS; m++)
        for (int v = 0; v < PV; v++)
            out[m][v] = acc[m * PV + v];
    store_tile(ROWS, 1, out, bias, y, ldy, n_left, accumulate);
}

/* Panels [p_begin, p_end) for all M rows, int8 (xo: x's offsets) or 4-bit (xo: x's
   block sums); xq holds whole tiles of 16 rows. Panels of levels (IQ4, MXFP4:
   level_bytes) are unpacked one at a time into stage as int8 panels, and run as int8. */
static void amx_int_panels(const int Q4, const int8_t *xq, const float *xs, const void *xo,
                           int64_t M, int64_t K, const char *packed, int64_t pb,
                           int64_t p_begin, int64_t p_end, const float *bias, float *y,
                           int64_t N, int accumulate, int32_t *c, const uint8_t *level_bytes,
                           char *stage)
{
    const int64_t blocks = K / RS_INT8_BLOCK;
    amx_configure(RS_INT8_BLOCK, RS_INT8_BLOCK / 4);
    for (int64_t p = p_begin; p < p_end; p++) {
        const char *panel = packed + p * pb;
        if (level_bytes != NULL) {
            expand_q4(level_bytes, packed, pb, p, 1, K, stage);
            panel = stage;
        }
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int64_t n0 = p * RS_PANEL, at = m0 * blocks;
            const float *bias_n = bias ? bias + n0 : NULL;
            const int32_t *xo_m = (const int32_t *)xo + at;
            if (M - m0 >= 16 && Q4)
                amx_int_tile(16, 1, xq + m0 * K, xs + at, xo_m, K, panel, bias_n,
                             y + m0 * N + n0, N, N - n0, accumulate, c);
            else if (M - m0 >= 16)
                amx_int_tile(16, 0, xq + m0 * K, xs + at, xo_m, K, panel, bias_n,
                             y + m0 * N + n0, N, N - n0, accumulate, c);
            else
                amx_int_tile((int)(M - m0), Q4, xq + m0 * K, xs + at, xo_m, K, panel,
                             bias_n, y + m0 * N + n0, N, N - n0, accumulate, c);
        }
    }
    _tile_release();
}
#endif

#if AMX_TILES
int rs_linear(const float *x, int64_t M, int64_t K, const void *packed, int64_t N,
              const float *bias, float *y, int accumulate, int format);
/* 1: AMX in use; -1: the tiles gave other results than the other paths at load and are
   not used; 0: no AMX (not built with it, or the OS refused). */
static int amx_status = 0;

/* Whether the AMX paths give what the others give on a small layer of 17 rows (a whole
   tile and one row of another; 40 outputs: a partial panel): int8 the same floats,
   4-bit and bfloat16 within float32 rounding (their float sums go in another order). Run once, at load:
   a CPU, kernel or virtual machine that mishandles the tiles costs speed, not answers. */
static int amx_agrees(void)
{
    enum { M = 17, N = 40, K = 96 };
    float x[M * K], w[N * K], want[M * N], got[M * N];
    uint32_t r = 12345;   /* values in [-1, 1) */
    for (int i = 0; i < M * K + N * K; i++) {
        r = r * 1664525u + 1013904223u;
        const float v = (float)((int32_t)(r >> 8) - (1 << 23)) / (1 << 23);
        if (i < M * K)
            x[i] = v;
        else
            w[i - M * K] = v;
    }
    const int formats[3] = {AMX_INT8 ? RS_INT8 : -1, AMX_INT8 ? RS_Q4 : -1,
                            AMX_BF16 ? RS_BF16 : -1};
    int agrees = 1;
    for (int f = 0; f < 3 && agrees; f++) {
        if (formats[f] < 0)
            continue;
        void *packed = aligned_alloc(64, (rs_packed_bytes(N, K, formats[f]) + 63) / 64 * 64);
        agrees = packed != NULL && rs_pack_weight(w, N, K, formats[f], packed) == 0;
        bf16_dot_tiles = 1;   /* AMX's bfloat16 tiles give what vdpbf16ps' give */
        for (int amx = 0; amx < 2 && agrees; amx++) {
            amx_usable = amx;
            agrees = rs_linear(x, M, K, packed, N, NULL, amx ? got : want, 0, formats[f]) == 0;
        }
        for (int i = 0; i < M * N && agrees; i++)
            agrees = formats[f] == RS_INT8 ? got[i] == want[i]
                   : formats[f] == RS_Q4 ? fabsf(got[i] - want[i]) <= 1e-5f * (fabsf(want[i]) + 1)
                   : fabsf(got[i] - want[i]) <= 1e-4f * K;
        free(packed);
    }
    return agrees;
}
#endif

/* Asks the OS for what the kernels use (AMX's tile registers, where built with them),
   and checks the tiles. Returns rs_bf16_path(). Call once, before the first linear
   layer. */
int rs_bf16_path(void);
#if AMX_TILES
static void amx_init(void)
{
#ifdef RS_AMX_EMULATE
    amx_usable = 1;
#else
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: refused where the CPU or the kernel
       lacks AMX, and then the vdpbf16ps and VNNI tiles run. */
    amx_usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
    if (amx_usable && (AMX_INT8 || AMX_BF16))
        amx_status = amx_agrees() ? 1 : -1;
    amx_usable = amx_status == 1;
    bf16_dot_tiles = amx_usable || BF16_DOT_TILES;
}
#endif

int rs_init(void)
{
#if AMX_TILES
    static pthread_once_t once = PTHREAD_ONCE_INIT;   /* loading twice checks once */
    pthread_once(&once, amx_init);
#endif
    return rs_bf16_path();
}

/* See amx_status. */
int rs_amx_status(void)
{
#if AMX_TILES
    return amx_status;
#else
    return 0;
#endif
}

/* How bfloat16 weights are multiplied: 2 AMX tiles (from AMX_MIN_ROWS rows; vdpbf16ps
   below), 1 vdpbf16ps, 0 widened to float32. */
int rs_bf16_path(void)
{
#if AMX_BF16
    if (amx_usable)
        return 2;
#endif
    return BF16_DOT && bf16_dot_tiles;
}

/* How int8 and 4-bit weights are multiplied: 2 AMX tiles (from AMX_MIN_ROWS rows; VNNI
   below), 1 VNNI's byte dot products (vpdpbusd), 0 without them (vpmaddubsw, or lane by
   lane). */
int rs_int8_path(void)
{
#if AMX_INT8
    if (amx_usable)
        return 2;
#endif
    return VNNI;
}

/* Rows of x quantized as int8 weights are: a scale per 32 inputs (amax / 127); with
   xsum, also each block's scale times the sum of its int8 values; with xoff, -128 times
   that sum (where int8 weights are multiplied as stored, w + 128). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs,
                          float *xsum, int32_t *xoff)
{
    for (int64_t i = 0; i < M * K / RS_INT8_BLOCK; i++) {
        const float *src = x + i * RS_INT8_BLOCK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        /* Two vectors a block, the same values as the loops below: the conversion
           rounds to nearest even, as nearbyintf does (both follow MXCSR's mode). */
        const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo),
                                                               _mm512_abs_ps(hi)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xs[i] = amax / 127.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv)),
                      qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
        _mm_storeu_si128((__m128i *)(xq + i * RS_INT8_BLOCK), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(xq + i * RS_INT8_BLOCK + 16), _mm512_cvtepi32_epi8(qhi));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
        float amax = 0.0f;
        for (int j = 0; j < RS_INT8_BLOCK; j++)
            amax = fmaxf(amax, fabsf(src[j]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        xs[i] = amax / 127.0f;
        int32_t sum = 0;
        for (int j = 0; j < RS_INT8_BLOCK; j++) {
            xq[i * RS_INT8_BLOCK + j] = (int8_t)nearbyintf(src[j] * inv);
            sum += xq[i * RS_INT8_BLOCK + j];
        }
#endif
        if (xsum != NULL)
            xsum[i] = xs[i] * (float)sum;
        if (xoff != NULL)
            xoff[i] = -128 * sum;
    }
}

/* The tile shapes, instantiated with compile-time sizes and format so that the
   accumulators stay in registers: TILES[format][wide][rows], TILES_INT[4-bit][wide][rows]. */
typedef void (*tile_fn)(const float *, int64_t, const char *, int64_t, int64_t, const float *,
                        float *, int64_t, int64_t, int, int64_t, int64_t);
#define TILE(mr, np, f, name) \
    static void tile_##mr##_##name(const float *x, int64_t ldx, const char *w, int64_t pb, \
                                   int64_t K, const float *bias, float *y, int64_t ldy, \
                                   int64_t n_left, int acc, int64_t lo, int64_t hi) \
    { tile(mr, np, f, x, ldx, w, pb, K, bias, y, ldy, n_left, acc, lo, hi); }
#define TILES_ROWS(np, f, name) \
    TILE(1, np, f, name) TILE(2, np, f, name) TILE(3, np, f, name) TILE(4, np, f, name) \
    TILE(5, np, f, name) TILE(6, np, f, name) TILE(7, np, f, name) TILE(8, np, f, name)
TILES_ROWS(1, RS_F32, f32_one) TILES_ROWS(NP_MAX, RS_F32, f32_wide)
TILES_ROWS(1, RS_BF16, bf16_one) TILES_ROWS(NP_MAX, RS_BF16, bf16_wide)
#define ROW(name) {NULL, tile_1_##name, tile_2_##name, tile_3_##name, tile_4_##name, \
                   tile_5_##name, tile_6_##name, tile_7_##name, tile_8_##name}
static const tile_fn TILES[2][2][9] = {{ROW(f32_one), ROW(f32_wide)},
                                       {ROW(bf16_one), ROW(bf16_wide)}};
#if BF16_DOT
#define TILE_BF(mr, np, name) \
    static void tile_bf_##mr##_##name(const uint16_t *xb, int64_t K, const char *w, \
                                      int64_t pb, const float *bias, float *y, int64_t ldy, \
                                      int64_t n_left, int acc, int64_t lo, int64_t hi) \
    { tile_bf16(mr, np, xb, K, w, pb, bias, y, ldy, n_left, acc, lo, hi); }
#define TILES_BF(np, name) TILE_BF(1, np, name) TILE_BF(2, np, name) TILE_BF(3, np, name) \
    TILE_BF(4, np, name) TILE_BF(5, np, name) TILE_BF(6, np, name)
TILES_BF(1, one) TILES_BF(NP_MAX, wide) TILE_BF(7, 1, one) TILE_BF(8, 1, one)
typedef void (*tile_bf_fn)(const uint16_t *, int64_t, const char *, int64_t, const float *,
                           float *, int64_t, int64_t, int, int64_t, int64_t);
static const tile_bf_fn TILES_BF[2][9] = {
    {NULL, tile_bf_1_one, tile_bf_2_one, tile_bf_3_one, tile_bf_4_one, tile_bf_5_one,
     tile_bf_6_one, tile_bf_7_one, tile_bf_8_one},
    {NULL, tile_bf_1_wide, tile_bf_2_wide, tile_bf_3_wide, tile_bf_4_wide, tile_bf_5_wide,
     tile_bf_6_wide}};
#endif
#define TILE_INT(mr, np, f, name) \
    static void tile_int_##mr##_##name(const int8_t *xq, const float *xs, const float *xsum, \
                                       const int32_t *xoff, const char *w, int64_t pb, \
                                       int64_t K, const float *bias, float *y, int64_t ldy, \
                                       int64_t n_left, int acc, int64_t lo, int64_t hi) \
    { tile_int(mr, np, f, xq, xs, xsum, xoff, w, pb, K, bias, y, ldy, n_left, acc, lo, hi); }
#define TILES_INT_ROWS(np, f, name) \
    TILE_INT(1, np, f, name) TILE_INT(2, np, f, name) TILE_INT(3, np, f, name)
#define TILES_INT_ROWS8(np, f, name) TILES_INT_ROWS(np, f, name) \
    TILE_INT(4, np, f, name) TILE_INT(5, np, f, name) TILE_INT(6, np, f, name) \
    TILE_INT(7, np, f, name) TILE_INT(8, np, f, name)
TILES_INT_ROWS8(1, RS_INT8, q8_one) TILES_INT_ROWS(NP_MAX, RS_INT8, q8_wide)
TILES_INT_ROWS8(1, RS_Q4, q4_one) TILES_INT_ROWS(NP_MAX, RS_Q4, q4_wide)
TILES_INT_ROWS8(1, RS_Q4X, q4x_one) TILES_INT_ROWS(NP_MAX, RS_Q4X, q4x_wide)
TILES_INT_ROWS8(1, RS_IQ4, iq4_one) TILES_INT_ROWS(NP_MAX, RS_IQ4, iq4_wide)
TILES_INT_ROWS8(1, RS_MXFP4, mx4_one) TILES_INT_ROWS(NP_MAX, RS_MXFP4, mx4_wide)
typedef void (*tile_int_fn)(const int8_t *, const float *, const float *, const int32_t *,
                            const char *, int64_t, int64_t, const float *, float *, int64_t,
                            int64_t, int, int64_t, int64_t);
#define INT_ROW(name) {NULL, tile_int_1_##name, tile_int_2_##name, tile_int_3_##name}
#define INT_ROW8(name) {NULL, tile_int_1_##name, tile_int_2_##name, tile_int_3_##name, \
                        tile_int_4_##name, tile_int_5_##name, tile_int_6_##name, \
                        tile_int_7_##name, tile_int_8_##name}
/* TILES_INT[int8, 4-bit, unpacked 4-bit, IQ4, MXFP4][wide][rows] */
static const tile_int_fn TILES_INT[5][2][9] = {{INT_ROW8(q8_one), INT_ROW(q8_wide)},
                                               {INT_ROW8(q4_one), INT_ROW(q4_wide)},
                                               {INT_ROW8(q4x_one), INT_ROW(q4x_wide)},
                                               {INT_ROW8(iq4_one), INT_ROW(iq4_wide)},
                                               {INT_ROW8(mx4_one), INT_ROW(mx4_wide)}};

/* Rows per integer tile: two sets of accumulators (int32 block sums, float totals) must
   fit the registers. On AVX-512, a batch of up to Q8_NARROW_MAX_ROWS rows
   (Q4_NARROW_MAX_ROWS for 4-bit weights) takes one panel at a time, up to 8 rows a
   block, and more rows take 3 rows x 4 panels: with one panel a thread reads one stream
   of weights where 4 panels are 4 (the default model's layers alone, alternating rounds,
   AMD EPYC Zen 5: int8 1.06-1.09x at 1-3 rows, 1.20-1.24x at 8, 1.29-1.35x at 12-16,
   1.17x at 20-24, 0.98x at 28, 0.86x at 64, where 4 panels share each row's broadcast;
   4-bit 1.14-1.38x at 1-2 rows, 1.08-1.19x at 8, 1.12-1.17x at 12-16, 1.04x at 32,
   0.95-1.0x at 64). */
#ifdef __AVX512F__
#define Q8_MR_MAX 3
#define Q8_WIDE_MAX_ROWS (1 << 30)   /* above the narrow rows: 3 rows x 4 panels fit */
#define NARROW_MR_MAX 8
#define Q8_NARROW_MAX_ROWS 24
#define Q4_NARROW_MAX_ROWS 32
/* vdpbf16ps tiles, too, take one panel up to 24 rows, each row block fetching the next
   panel (same measurement: 1.02-1.04x at 1-2 rows, 1.14-1.18x at 4, 1.25-1.27x at 8,
   1.1-1.23x at 12-16, 1.03-1.06x at 24; 0.99x at 32 and 0.80x at 64, where 4 panels
   share each row's broadcast). The 4-panel tiles of 2 x 4 rows had left memory idle
   while the second block computed from cache. */
#define BF16_NARROW_MAX_ROWS 24
#else   /* AVX2: NP_MAX panels at one row, one panel of 2 rows above */
#define Q8_MR_MAX 2
#define Q8_WIDE_MAX_ROWS 1
#define NARROW_MR_MAX 2
#define Q8_NARROW_MAX_ROWS 0
#define Q4_NARROW_MAX_ROWS 0
#define BF16_NARROW_MAX_ROWS 0
#endif

/* Whether every row block of a float tile of 4 panels fetches ahead, a single one too:
   on AVX2, whose narrow tiles leave the hardware prefetchers too many short streams,
   yes (1.5x at 1-8 rows); AVX-512's prefetchers do better alone with 4 panels of 1-4
   rows (measured: 12% slower at 1 row with it), and there only the first of several
   such blocks fetches. Tiles of one panel, and integer tiles, fetch in every block. */
#ifndef AHEAD_ONE_BLOCK
#ifdef __AVX512F__
#define AHEAD_ONE_BLOCK 0
#else
#define AHEAD_ONE_BLOCK 1
#endif
#endif

/* From this many row blocks on, the row blocks of an int8 tile (AVX-512: 3 rows x 4
   panels) or a vdpbf16ps one (6 x 4) share the fetching of the next panels, each its
   own stretch of K, instead of each fetching all of it (int8) or the first alone
   (bf16): 4 int8 panels of K = 576 are 41 KiB, so a second group fetched whole while 22
   row blocks computed from the first evicted the first from L1 (48 KiB on Zen 5), and
   32 fetches per block of 32 inputs in every row block cost issue slots the dot
   products need. The default model's layers at 64 rows (AMD EPYC Zen 5): int8 1.15x,
   bf16 1.04-1.06x (1.07x at 128, even at 24-32). At 8 rows (3 blocks) each int8 block
   fetching all of it is faster (0.92x shared); 4-bit panels (23 KiB a group) and
   float32 ones (8 x 1 tiles) gain nothing from it. */
#ifndef SHARED_AHEAD_BLOCKS
#ifdef __AVX512F__
#define SHARED_AHEAD_BLOCKS 4
#else
#define SHARED_AHEAD_BLOCKS (1 << 30)   /* never: AVX2 int8 tiles take one panel */
#endif
#endif

/* Up to this many rows, bfloat16 tiles widen the weight in registers; at more, row
   blocks would widen it again each, and expanding a group of panels into float32 once
   (in L2) is cheaper. */
#ifndef DIRECT_MAX_ROWS
#define DIRECT_MAX_ROWS 16
#endif

int rs_linear_ws(const float *x, int64_t M, int64_t K, const void *packed, int64_t N,
                 const float *bias, float *y, int accumulate, int format)
{
    const int64_t panels = (N + RS_PANEL - 1) / RS_PANEL;
    const int nthreads = rs_num_threads();
    const int bf16 = format == RS_BF16, q4 = format == RS_Q4;
    const int levels = format_levels(format) != NULL;   /* IQ4, MXFP4 */
    const int int8 = format == RS_INT8 || q4 || levels;   /* x quantized: integer tiles */
#if AMX_BF16
    const int amx = bf16 && amx_usable && M >= AMX_MIN_ROWS && K % 32 == 0;
#else
    const int amx = 0;
#endif
#if AMX_INT8
    const int amx8 = int8 && amx_usable && M >= AMX_MIN_ROWS;   /* levels: unpacked */
#else
    const int amx8 = 0;
#endif
    const int dot = bf16 && BF16_DOT && bf16_dot_tiles && !amx;
    const int expand = bf16 && !dot && !amx && M > DIRECT_MAX_ROWS;
    const int64_t Mp = amx || amx8 ? (M + 15) / 16 * 16 : M;   /* AMX: whole tiles of rows */
    /* Scratch, by every thread for itself: expanded panels, or x as int8 (with its
       scales) or as bfloat16 (and AMX's result tiles). */
    int64_t bytes = 0;
    if (expand)
        bytes = NP_MAX * K * RS_PANEL * 4;
    else if (int8)   /* xq, xs, and xsum (4-bit) or xoff (int8); AMX's block sums */
        bytes = Mp * K + M * (K / RS_INT8_BLOCK) * 4 * 2 + (amx8 ? 2 * 256 * 4 + 1024 : 0);
    else if (dot || amx)
        bytes = Mp * K * 2 + (amx ? 4 * 256 * 4 : 0);
    const int q4x = (q4 || levels) && !amx8 && M >= Q4X_MIN_ROWS;   /* a group unpacked */
    const int amx_stage = amx8 && levels;   /* AMX's panel of levels, unpacked */
    /* TILES_INT's first index: levels unpacked are int8 */
    const int int_tiles = q4x ? (levels ? 0 : 2) : format == RS_IQ4 ? 3
                        : format == RS_MXFP4 ? 4 : q4;
    const int staged = expand || q4x;   /* tiles read panels from this thread's buffer */
    const int64_t q4x_at = (bytes + 63) / 64 * 64;
    if (q4x || amx_stage)
        bytes = q4x_at + (q4x ? NP_MAX : 1) * (K / RS_INT8_BLOCK) * Q8_BLOCK_BYTES;
    void *buf = bytes ? thread_buffer(bytes) : NULL;
    int failed = bytes && buf == NULL;
    int8_t *xq = buf;
    float *xs = int8 && buf ? (float *)((char *)buf + Mp * K) : NULL;   /* Mp K % 32 == 0 */
    float *xsum = q4 && buf ? xs + M * (K / RS_INT8_BLOCK) : NULL;
    int32_t *xoff = int8 && !q4 && U8_EXACT && buf ? (int32_t *)(xs + M * (K / RS_INT8_BLOCK))
                                                   : NULL;
    uint16_t *xb = buf;
    (void)xb;   /* unused where the CPU has no bf16 products */
    if (int8 && !failed) {
        quantize_rows(x, M, K, xq, xs, xsum, xoff);
        memset(xq + M * K, 0, (Mp - M) * K);   /* AMX's last tile of rows */
    }
#if BF16_DOT
    if ((dot || amx) && !failed) {
        bf16_rows(x, M, K, xb);
        memset(xb + M * K, 0, (Mp - M) * K * 2);
    }
#endif
    const int64_t pb = panel_bytes(K, format);
    const int narrow = int8 ? M <= (q4 || levels ? Q4_NARROW_MAX_ROWS : Q8_NARROW_MAX_ROWS)
                     : dot && M <= BF16_NARROW_MAX_ROWS;
    /* 4 panels at any M in float32; bfloat16 widened in registers keeps one block of
       one panel up to MR_MAX rows, which widens each weight once */
    const int fwide = FLOAT_WIDE_TILES && !int8 && !dot && !amx &&
                      (format == RS_F32 || M > MR_MAX);
    const int64_t mr_max = narrow ? NARROW_MR_MAX : int8 ? Q8_MR_MAX
                         : dot ? BF16_MR_MAX : fwide ? FLOAT_WIDE_MR : MR_MAX;
    const int64_t blocks = (M + mr_max - 1) / mr_max;
    /* Contiguous panel ranges, one per thread, balanced to a panel. */
#pragma omp for schedule(static, 1)
    for (int t = 0; t < nthreads; t++) {
        const int64_t p_begin = panels * t / nthreads, p_end = panels * (t + 1) / nthreads;
#if AMX_BF16
        if (amx && !failed) {
            amx_panels(xb, M, K, packed, pb, p_begin, p_end, bias, y, N, accumulate,
                       (float *)(xb + Mp * K));
            continue;
        }
#endif
#if AMX_INT8
        if (amx8 && !failed) {
            amx_int_panels(q4, xq, xs, q4 ? (const void *)xsum : xoff, M, K, packed, pb,
                           p_begin, p_end, bias, y, N, accumulate,
                           (int32_t *)(xs + 2 * M * (K / RS_INT8_BLOCK)),
                           levels ? format_level_bytes(format) : NULL,
                           (char *)buf + q4x_at);
            continue;
        }
#endif
        for (int64_t p = p_begin; p < p_end && !failed;) {
            /* bf16 products take NP_MAX panels at every row count (measured: 1.13x
               at 64 rows; float32 panels did better one at a time there on Zen 5),
               and so do float tiles on Intel (FLOAT_WIDE_TILES). */
            const int wide = !narrow &&
                             (dot || fwide || M <= (int8 ? Q8_WIDE_MAX_ROWS : WIDE_MAX_ROWS)) &&
                             p_end - p >= NP_MAX;
            const char *w = (const char *)packed + p * pb;
            int64_t w_pb = pb;
            int w_format = format;
            if (expand) {
                expand_panels(packed, p, wide ? NP_MAX : 1, K, buf);
                w = (const char *)buf;
                w_pb = K * RS_PANEL * 4;
                w_format = RS_F32;
            } else if (q4x) {
                expand_q4(format_level_bytes(format), packed, pb, p, wide ? NP_MAX : 1, K,
                          (char *)buf + q4x_at);
                w = (const char *)buf + q4x_at;
                w_pb = K / RS_INT8_BLOCK * Q8_BLOCK_BYTES;
            }
            const int64_t n0 = p * RS_PANEL;
            /* Row blocks of near-equal size (8 rows: 4 + 4, not 6 + 2): a thin
               block has too few accumulators to hide the FMA latency. */
            for (int64_t b = 0, m = 0; b < blocks; b++) {
                const int mr = (int)((M * (b + 1)) / blocks - m);
                const float *bias_n = bias == NULL ? NULL : bias + n0;
                float *y_n = y + m * N + n0;
                /* Of a float tile of 4 panels, the first row block fetches the next
                   panels while the others compute from cache: memory and FMAs
                   overlap (a staged group is not where the next one is). Tiles of
                   one panel fetch in every row block, and so do int8 tiles (10-16%
                   faster at 1-8 rows): with one fetching block, memory sat idle
                   while the others computed (AVX2 float32: 1.10x at 8 rows, 1.20x
                   at 16 on a Zen 3; AVX-512: 1.09x at 12-16 on a Zen 5). From
                   SHARED_AHEAD_BLOCKS blocks on, int8 and vdpbf16ps row blocks each
                   fetch their own stretch of K instead. */
                int64_t ahead_lo = 0, ahead_hi =
                    !staged && (int8 || !wide || AHEAD_ONE_BLOCK || (b == 0 && blocks > 1)) ? K : 0;
                if ((format == RS_INT8 || dot) && blocks >= SHARED_AHEAD_BLOCKS) {
                    /* this block's share, in whole blocks of 32 inputs */
                    const int64_t kb = K / RS_INT8_BLOCK;
                    ahead_lo = kb * b / blocks * RS_INT8_BLOCK;
                    ahead_hi = kb * (b + 1) / blocks * RS_INT8_BLOCK;
                }
                if (int8)
                    TILES_INT[int_tiles][wide][mr](xq + m * K, xs + m * (K / RS_INT8_BLOCK),
                                            xsum ? xsum + m * (K / RS_INT8_BLOCK) : NULL,
                                            xoff ? xoff + m * (K / RS_INT8_BLOCK) : NULL, w,
                                            w_pb, K, bias_n, y_n, N, N - n0, accumulate,
                                            ahead_lo, ahead_hi);
#if BF16_DOT
                else if (dot)
                    TILES_BF[wide][mr](xb + m * K, K, w, w_pb, bias_n, y_n, N, N - n0,
                                       accumulate, ahead_lo, ahead_hi);
#endif
                else
                    TILES[w_format][wide][mr](x + m * K, K, w, w_pb, K, bias_n, y_n, N,
                                              N - n0, accumulate, ahead_lo, ahead_hi);
                m += mr;
            }
            p += wide ? NP_MAX : 1;
        }
    }
    return failed ? -1 : 0;
}

int rs_linear(const float *x, int64_t M, int64_t K, const void *packed, int64_t N,
              const float *bias, float *y, int accumulate, int format)
{
    int failed = 0;
#pragma omp parallel reduction(|| : failed)
    {
        RS_FAST_MODES;
        failed = rs_linear_ws(x, M, K, packed, N, bias, y, accumulate, format) != 0;
    }
    return failed ? -1 : 0;
}

/* Sum of n floats (n % 64 == 0), read once with all threads: what the roofline in
   benchmarks/engine.py takes as this machine's memory read bandwidth. */
float rs_read_all(const float *x, int64_t n)
{
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
        RS_FAST_MODES;
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
