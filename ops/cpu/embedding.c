// Embedding: a row lookup (tokens, learned positions) and its scatter-add backward.
#include <string.h>

#include "ops/ops.h"

// ids (BT) int32, table (V,C) -> out (BT,C)
void fy_embedding_forward(float *out, const int32_t *ids, const float *table, int64_t BT,
                          int64_t C) {
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_EMBEDDING)
  for (int64_t i = 0; i < BT; i++)
    memcpy(out + i * C, table + (int64_t)ids[i] * C, (size_t)C * sizeof(float));
}

// dout (BT,C), ids (BT) -> dtable (V,C) +=
// Two rows with the same id add into the same table row, so threads split the channels instead of
// the rows: each thread owns a column slice of the whole table and visits the rows in order. No
// atomics, and the sum order (row 0, 1, ...) is the same whatever the thread count.
void fy_embedding_backward(float *dtable, const float *dout, const int32_t *ids, int64_t BT,
                           int64_t C, int64_t V) {
  const int64_t blk = 64;  // channels per work item: whole cache lines, no false sharing
  int64_t nblk = (C + blk - 1) / blk;
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_EMBEDDING)
  for (int64_t cb = 0; cb < nblk; cb++) {
    int64_t c0 = cb * blk, c1 = c0 + blk < C ? c0 + blk : C;
    for (int64_t i = 0; i < BT; i++) {
      float *restrict d = dtable + (int64_t)ids[i] * C;
      const float *restrict g = dout + i * C;
      for (int64_t c = c0; c < c1; c++) d[c] += g[c];
    }
  }
}
