/*
 * Row-wise argmax of a float32 matrix (greedy sampling over the vocabulary).
 * Ties go to the lowest index, as torch.argmax does. Rows are spread over OpenMP
 * threads; within a row, one vector of running maxima with their indices are kept in vectors
 * (branch-free blends) and merged at the end.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define LANES RS_VL

void rs_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride,
                    int64_t *out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        int64_t arg = 0;
        float max = row[0];
        int64_t c = 0;
        if (cols >= LANES) {
            rs_vf best = *(const rs_vf *)row;
            rs_vi where;
            for (int l = 0; l < LANES; l++)
                where[l] = l;
            rs_vi idx = where;
            const rs_vi step = idx * 0 + LANES;
            for (c = LANES; c + LANES <= cols; c += LANES) {
                idx += step;
                const rs_vf v = *(const rs_vf *)(row + c);
                const rs_vi gt = v > best;  /* -1 where strictly greater */
                best = (rs_vf)(((rs_vi)v & gt) | ((rs_vi)best & ~gt));
                where = (idx & gt) | (where & ~gt);
            }
            float b[LANES];
            int32_t w[LANES];
            memcpy(b, &best, sizeof b);
            memcpy(w, &where, sizeof w);
            max = b[0];
            arg = w[0];
            for (int l = 1; l < LANES; l++)
                if (b[l] > max || (b[l] == max && w[l] < arg)) {
                    max = b[l];
                    arg = w[l];
                }
        }
        for (; c < cols; c++)
            if (row[c] > max) {
                max = row[c];
                arg = c;
            }
        out[r] = arg;
    }
}
