/*
 * AMX's tile instructions in plain C, for tests (built with -DRS_AMX_EMULATE): the AMX
 * paths of gemm.c then run on any CPU, so their layouts, strides, tile shapes and
 * bookkeeping are checked where no AMX hardware is at hand. It follows the
 * architecture's rules as the hardware enforces them: a tile is usable only once
 * configured (palette 1), a load or store moves rows x colsb bytes at the given stride
 * and zeroes the rest of the register, and a product's shapes must agree (A: M x K
 * bytes, B: K/4 rows x N*4 bytes, C: M x N*4 bytes); any other use aborts, where the
 * hardware would fault. Each thread has its own tile registers, as each core does.
 * Slow, and only for tests. -DRS_AMX_EMULATE_FAULT makes every product off by one, as
 * tiles a machine mishandles would be.
 */
#ifndef RS_AMX_EMULATE_H
#define RS_AMX_EMULATE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int rows, colsb;
    uint8_t data[16][64];
} rs_tile_reg;

static __thread rs_tile_reg rs_tmm[8];

static inline void rs_tile_fault(const char *what, int t)
{
    fprintf(stderr, "emulated AMX: %s (tmm%d)\n", what, t);
    abort();
}

static inline rs_tile_reg *rs_tile_get(int t)
{
    if (t < 0 || t >= 8 || rs_tmm[t].rows == 0)
        rs_tile_fault("tile used without being configured", t);
    return &rs_tmm[t];
}

/* The 64-byte configuration: palette, start row, 14 reserved bytes, then colsb as 16
   little-endian uint16 and rows as 16 bytes; palette 1 has 8 tiles of at most 16 rows
   of 64 bytes. */
static inline void rs_tile_loadconfig(const void *config)
{
    const uint8_t *c = config;
    if (c[0] != 1)
        rs_tile_fault("palette other than 1", 0);
    for (int t = 0; t < 8; t++) {
        const int colsb = c[16 + 2 * t] | c[17 + 2 * t] << 8, rows = c[48 + t];
        if (rows > 16 || colsb > 64 || (rows == 0) != (colsb == 0))
            rs_tile_fault("a tile's shape is out of range", t);
        rs_tmm[t].rows = rows;
        rs_tmm[t].colsb = colsb;
        memset(rs_tmm[t].data, 0, sizeof rs_tmm[t].data);
    }
}

static inline void rs_tile_release(void)
{
    memset(rs_tmm, 0, sizeof rs_tmm);
}

static inline void rs_tile_zero(int t)
{
    memset(rs_tile_get(t)->data, 0, sizeof rs_tmm[t].data);
}

static inline void rs_tile_loadd(int t, const void *base, int64_t stride)
{
    rs_tile_reg *r = rs_tile_get(t);
    memset(r->data, 0, sizeof r->data);
    for (int row = 0; row < r->rows; row++)
        memcpy(r->data[row], (const char *)base + row * stride, r->colsb);
}

static inline void rs_tile_stored(int t, void *base, int64_t stride)
{
    const rs_tile_reg *r = rs_tile_get(t);
    for (int row = 0; row < r->rows; row++)
        memcpy((char *)base + row * stride, r->data[row], r->colsb);
}

/* The shapes a product of c += a b needs. */
static inline void rs_tile_check(const rs_tile_reg *c, const rs_tile_reg *a, const rs_tile_reg *b,
                          int t)
{
    if (c->rows != a->rows || c->colsb != b->colsb || b->rows != a->colsb / 4 ||
        a->colsb % 4)
        rs_tile_fault("the product's tile shapes do not agree", t);
}

/* tdpbsud: signed bytes of a times unsigned bytes of b, 4 at a time into int32. */
static inline void rs_tile_dpbsud(int tc, int ta, int tb)
{
    rs_tile_reg *c = rs_tile_get(tc);
    const rs_tile_reg *a = rs_tile_get(ta), *b = rs_tile_get(tb);
    rs_tile_check(c, a, b, tc);
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            int32_t sum;
            memcpy(&sum, c->data[m] + 4 * n, 4);
            for (int k = 0; k < a->colsb / 4; k++)
                for (int i = 0; i < 4; i++)
                    sum += (int8_t)a->data[m][4 * k + i] * (int32_t)b->data[k][4 * n + i];
#ifdef RS_AMX_EMULATE_FAULT
            sum += 1;
#endif
            memcpy(c->data[m] + 4 * n, &sum, 4);
        }
}

static inline float rs_tile_bf16(const uint8_t *p)
{
    const uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* tdpbf16ps: pairs of bfloat16 of a times pairs of b, into float32. */
static inline void rs_tile_dpbf16ps(int tc, int ta, int tb)
{
    rs_tile_reg *c = rs_tile_get(tc);
    const rs_tile_reg *a = rs_tile_get(ta), *b = rs_tile_get(tb);
    rs_tile_check(c, a, b, tc);
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            float sum;
            memcpy(&sum, c->data[m] + 4 * n, 4);
            for (int k = 0; k < a->colsb / 4; k++)
                for (int i = 0; i < 2; i++)
                    sum += rs_tile_bf16(a->data[m] + 4 * k + 2 * i) *
                           rs_tile_bf16(b->data[k] + 4 * n + 2 * i);
#ifdef RS_AMX_EMULATE_FAULT
            sum += 1.0f;
#endif
            memcpy(c->data[m] + 4 * n, &sum, 4);
        }
}

/* In place of immintrin.h's (which exist, compiled for AMX, whatever the flags). */
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbsud
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) rs_tile_loadconfig(config)
#define _tile_release() rs_tile_release()
#define _tile_zero(t) rs_tile_zero(t)
#define _tile_loadd(t, base, stride) rs_tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) rs_tile_stored(t, base, stride)
#define _tile_dpbsud(c, a, b) rs_tile_dpbsud(c, a, b)
#define _tile_dpbf16ps(c, a, b) rs_tile_dpbf16ps(c, a, b)

#endif
