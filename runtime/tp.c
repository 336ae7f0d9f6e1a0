#include "runtime/tp.h"

#include <string.h>

// Rank r's slice of a parameter split by rows (dim 0, or a vector: elements [r*n, (r+1)*n) of
// the whole, contiguous; in split_blocks blocks, a mixture's experts: run k is its part of block
// k) or by columns (dim 1: columns [r*Cl, (r+1)*Cl) of every row), as *rows runs of *len
// elements: run k is whole elements [first + k*stride, first + k*stride + len). r is the rank in
// the parameter's group (split_ranks): with experts split over ep and each over tp, r = ep_rank *
// tp + tp_rank, and the runs are those of tp rank r % tp within the experts of ep rank r / tp.
static void slice_rows(const struct fy_graph *part, const struct fy_param *p, int r, int64_t *rows, int64_t *first,
                       int64_t *stride, int64_t *len) {
  if (p->expert && fy_param_split_tp(part, p)) {
    const int64_t er = r / part->tp, tr = r % part->tp;
    if (p->split_dim == 0) {  // El blocks of this rank's experts, each its n of an expert's n*tp
      const int64_t nb = p->split_blocks / part->ep, n = p->numel / nb;
      *rows = nb, *stride = n * part->tp, *first = er * nb * *stride + tr * n, *len = n;
    } else {  // the experts' rows [er shape[0], +shape[0]), columns [tr shape[1], +shape[1]) of each
      *rows = p->shape[0], *stride = p->full_shape[1], *len = p->shape[1];
      *first = er * p->shape[0] * p->full_shape[1] + tr * p->shape[1];
    }
  } else if (p->split_dim == 0 && p->split_blocks > 1) {
    const int64_t n = p->numel / p->split_blocks;  // (a block's elements on one rank)
    *rows = p->split_blocks, *first = (int64_t)r * n, *stride = n * (p->full_shape[0] / p->shape[0]), *len = n;
  } else if (p->split_dim == 0 || p->rank == 1) {
    *rows = 1, *first = (int64_t)r * p->numel, *stride = 0, *len = p->numel;
  } else {
    *rows = p->shape[0], *first = (int64_t)r * p->shape[1], *stride = p->full_shape[1], *len = p->shape[1];
  }
}

// The group a split parameter is split over: a mixture's experts over the expert-parallel ranks
// (fy_param.expert; with tp too, over ep x tp: fy_tp_gather_param's group), the others over the
// tensor-parallel ones. Its size and this rank's place.
static int split_ranks(const struct fy_graph *part, const struct fy_param *p) {
  return p->expert ? part->ep * (fy_param_split_tp(part, p) ? part->tp : 1) : part->tp;
}
static int split_rank(const struct fy_graph *part, const struct fy_param *p) {
  return p->expert ? part->ep_rank * (fy_param_split_tp(part, p) ? part->tp : 1) +
                         (fy_param_split_tp(part, p) ? part->tp_rank : 0)
                   : part->tp_rank;
}

void fy_tp_read_part(const struct fy_graph *part, int i, int64_t a, int64_t b, fy_tp_read_fn read, void *ctx,
                     float *dst) {
  const struct fy_param *p = &part->params[i];
  if (p->split_dim < 0) {
    read(ctx, i, a, b, dst);
    return;
  }
  int64_t rows, first, stride, len;
  slice_rows(part, p, split_rank(part, p), &rows, &first, &stride, &len);
  for (int64_t e = a; e < b;) {  // slice element e is element c of run k
    const int64_t k = e / len, c = e - k * len, n = len - c < b - e ? len - c : b - e;
    read(ctx, i, first + k * stride + c, first + k * stride + c + n, dst + (e - a));
    e += n;
  }
}

void fy_tp_take(const struct fy_graph *part, float *local, const struct fy_graph *whole, fy_tp_read_fn read,
                void *ctx) {
  FY_ASSERT(part->n_params == whole->n_params);
  for (int i = 0; i < part->n_params; i++) {
    FY_ASSERT(strcmp(part->params[i].name, whole->params[i].name) == 0);
    if (part->params[i].absent) continue;  // (another pipeline stage's)
    fy_tp_read_part(part, i, 0, part->params[i].numel, read, ctx, local + part->params[i].offset);
  }
}

void fy_tp_fill(const struct fy_graph *part, int64_t lo, int64_t hi, fy_tp_read_fn read, void *ctx, float *dst) {
  memset(dst, 0, (size_t)(hi - lo) * 4);
  for (int i = 0; i < part->n_params; i++) {
    int64_t a, b;
    if (fy_param_part(&part->params[i], lo, hi, &a, &b))
      fy_tp_read_part(part, i, a, b, read, ctx, dst + (part->params[i].offset + a - lo));
  }
}

int64_t fy_tp_gather_floats(const struct fy_graph *part) {
  int64_t most = 0;
  for (int i = 0; i < part->n_params; i++)
    if (part->params[i].split_dim >= 0 && part->params[i].numel * split_ranks(part, &part->params[i]) > most)
      most = part->params[i].numel * split_ranks(part, &part->params[i]);
  return most;
}

fy_status fy_tp_gather_param(const struct fy_graph *part, const float *slice, const struct fy_graph *whole, int i,
                             float *dst, float *buf, struct fy_comm *tp_comm) {
  const struct fy_param *p = &part->params[i];
  FY_ASSERT(part->n_params == whole->n_params && strcmp(p->name, whole->params[i].name) == 0);
  if (p->split_dim < 0) {
    if (dst) memcpy(dst, slice, (size_t)p->numel * 4);
    return FY_OK;
  }
  fy_status st = fy_comm_all_gather(tp_comm, slice, buf, (size_t)p->numel, FY_COMM_F32, NULL);
  if (st != FY_OK) return fy_error_wrap(st, "gathering the tensor-parallel slices of %s", whole->params[i].name);
  for (int r = 0; dst && r < split_ranks(part, p); r++) {
    int64_t rows, first, stride, len;
    slice_rows(part, p, r, &rows, &first, &stride, &len);
    for (int64_t k = 0; k < rows; k++) memcpy(dst + first + k * stride, buf + r * p->numel + k * len, (size_t)len * 4);
  }
  return FY_OK;
}
