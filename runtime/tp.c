#include "runtime/tp.h"

#include <stdlib.h>
#include <string.h>

// Copies between a rank's slice (R, Cl) and the whole (R', C') for a parameter split by rows
// (dim 0: rows [r*R, (r+1)*R) of the whole, contiguous) or by columns (dim 1: columns
// [r*Cl, (r+1)*Cl) of every row). to_whole: slice -> whole, else whole -> slice.
static void copy_slice(const struct fy_param *p, int r, float *slice, float *whole, bool to_whole) {
  if (p->split_dim == 0 || p->rank == 1) {
    float *w = whole + (int64_t)r * p->numel;
    if (to_whole) memcpy(w, slice, (size_t)p->numel * 4);
    else memcpy(slice, w, (size_t)p->numel * 4);
    return;
  }
  int64_t R = p->shape[0], Cl = p->shape[1], C = p->full_shape[1];
  for (int64_t i = 0; i < R; i++) {
    float *w = whole + i * C + (int64_t)r * Cl, *s = slice + i * Cl;
    if (to_whole) memcpy(w, s, (size_t)Cl * 4);
    else memcpy(s, w, (size_t)Cl * 4);
  }
}

void fy_tp_take(const struct fy_graph *part, float *local, const struct fy_graph *whole, const float *full) {
  FY_ASSERT(part->n_params == whole->n_params);
  for (int i = 0; i < part->n_params; i++) {
    const struct fy_param *p = &part->params[i], *q = &whole->params[i];
    FY_ASSERT(strcmp(p->name, q->name) == 0);
    if (p->split_dim < 0) memcpy(local + p->offset, full + q->offset, (size_t)p->numel * 4);
    else copy_slice(p, part->tp_rank, local + p->offset, (float *)full + q->offset, false);
  }
}

fy_status fy_tp_gather(const struct fy_graph *part, const float *local, const struct fy_graph *whole, float *full,
                       struct fy_comm *tp_comm) {
  FY_ASSERT(part->n_params == whole->n_params);
  int64_t most = 0;
  for (int i = 0; i < part->n_params; i++)
    if (part->params[i].split_dim >= 0 && part->params[i].numel > most) most = part->params[i].numel;
  float *all = most ? malloc((size_t)(most * part->tp) * 4) : NULL;
  if (most && !all) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a buffer to gather the tensor-parallel slices");
  fy_status st = FY_OK;
  for (int i = 0; i < part->n_params && st == FY_OK; i++) {
    const struct fy_param *p = &part->params[i], *q = &whole->params[i];
    FY_ASSERT(strcmp(p->name, q->name) == 0);
    if (p->split_dim < 0) {
      if (full) memcpy(full + q->offset, local + p->offset, (size_t)p->numel * 4);
      continue;
    }
    st = fy_comm_all_gather(tp_comm, local + p->offset, all, (size_t)p->numel, FY_COMM_F32, NULL);
    for (int r = 0; st == FY_OK && full && r < part->tp; r++) copy_slice(p, r, all + r * p->numel, full + q->offset, true);
  }
  free(all);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "gathering the tensor-parallel slices");
}
