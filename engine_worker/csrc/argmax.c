/*
 * Row-wise argmax of a float32 matrix (greedy sampling over the vocabulary).
 * Ties go to the lowest index, as torch.argmax does. Rows are spread over OpenMP
 * threads; within a row, 16 running maxima with their indices are kept in vectors
 * (branch-free blends) and merged at the end.
 */
#include <stdint.h>
#include <string.h>

typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64)));

void rs_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride,
                    int64_t *out)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        int64_t arg = 0;
        float max = row[0];
        int64_t c = 0;
        if (cols >= 16) {
            vf16 best = *(const vf16 *)row;
            vi16 where = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            vi16 idx = where;
            const vi16 step = idx * 0 + 16;
            for (c = 16; c + 16 <= cols; c += 16) {
                idx += step;
                const vf16 v = *(const vf16 *)(row + c);
                const vi16 gt = v > best;  /* -1 where strictly greater */
                best = (vf16)(((vi16)v & gt) | ((vi16)best & ~gt));
                where = (idx & gt) | (where & ~gt);
            }
            float b[16];
            int32_t w[16];
            memcpy(b, &best, sizeof b);
            memcpy(w, &where, sizeof w);
            max = b[0];
            arg = w[0];
            for (int l = 1; l < 16; l++)
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
