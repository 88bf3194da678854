/*
 * Greedy sampling over the vocabulary: each row's argmax of a float32 matrix and, if
 * asked, a code saying whether the row can be sampled at all (the sampler's
 * _ROW_ERRORS: 0 fine, 1 a NaN, 2 a +inf, 3 every value -inf), in the same pass.
 * Ties go to the lowest index, as torch.argmax does. Rows are spread over OpenMP
 * threads from 4 rows on (one row is ~10 µs: waking a second thread costs more).
 * Within a row, one vector of running maxima with their indices is kept (branch-free
 * blends) and merged at the end.
 *
 * The codes look at the bits, not at float compares: -ffast-math lets the compiler
 * assume there is no NaN or infinity, and fold such compares away.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define LANES RS_VL
#define EXP_BITS 0x7f800000   /* |x| of +-inf; above it, a NaN */
#define NEG_INF_BITS 0xff800000u

static int row_code(int32_t max_abs_bits, float max)
{
    if (max_abs_bits > EXP_BITS)
        return 1;
    uint32_t bits;
    memcpy(&bits, &max, sizeof bits);
    if (bits == EXP_BITS)
        return 2;
    return bits == NEG_INF_BITS ? 3 : 0;
}

void rs_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride,
                    int64_t *out, int64_t *codes)
{
#pragma omp parallel if (rows >= 4)
    {
        RS_FAST_MODES;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *row = x + r * stride;
            int64_t arg = 0;
            float max = row[0];
            int32_t nan_bits = 0;  /* the largest |bits| seen: > EXP_BITS if any NaN */
            int64_t c = 0;
            if (cols >= LANES) {
                rs_vf best = *(const rs_vf *)row;
                rs_vi where;
                for (int l = 0; l < LANES; l++)
                    where[l] = l;
                rs_vi idx = where;
                const rs_vi step = idx * 0 + LANES;
                const rs_vi abs_mask = idx * 0 + 0x7fffffff;
                rs_vi worst = (rs_vi)best & abs_mask;
                for (c = LANES; c + LANES <= cols; c += LANES) {
                    idx += step;
                    const rs_vf v = *(const rs_vf *)(row + c);
                    const rs_vi gt = v > best;  /* -1 where strictly greater */
                    best = (rs_vf)(((rs_vi)v & gt) | ((rs_vi)best & ~gt));
                    where = (idx & gt) | (where & ~gt);
                    const rs_vi a = (rs_vi)v & abs_mask;
                    const rs_vi bigger = a > worst;
                    worst = (a & bigger) | (worst & ~bigger);
                }
                float b[LANES];
                int32_t w[LANES], n[LANES];
                memcpy(b, &best, sizeof b);
                memcpy(w, &where, sizeof w);
                memcpy(n, &worst, sizeof n);
                max = b[0];
                arg = w[0];
                for (int l = 0; l < LANES; l++) {
                    if (b[l] > max || (b[l] == max && w[l] < arg)) {
                        max = b[l];
                        arg = w[l];
                    }
                    nan_bits = n[l] > nan_bits ? n[l] : nan_bits;
                }
            }
            for (; c < cols; c++) {
                if (row[c] > max) {
                    max = row[c];
                    arg = c;
                }
                int32_t bits;
                memcpy(&bits, row + c, sizeof bits);
                bits &= 0x7fffffff;
                nan_bits = bits > nan_bits ? bits : nan_bits;
            }
            out[r] = arg;
            if (codes != NULL)
                codes[r] = row_code(nan_bits, max);
        }
    }
}
