// fy_tensor: a view of memory with a dtype, a shape and strides. It does not own its data.
#ifndef FY_TENSOR_H
#define FY_TENSOR_H

#include <stdbool.h>
#include <stdint.h>

#include "core/dtype.h"

#define FY_MAX_RANK 6

struct fy_device;

struct fy_tensor {
  enum fy_dtype dtype;
  int rank;
  int64_t shape[FY_MAX_RANK];
  int64_t strides[FY_MAX_RANK];  // in elements
  void *data;
  struct fy_device *device;      // NULL means host memory
};

// A contiguous (row-major) view.
static inline struct fy_tensor fy_tensor_make(enum fy_dtype dt, int rank, const int64_t *shape,
                                              void *data, struct fy_device *dev) {
  struct fy_tensor t = {.dtype = dt, .rank = rank, .data = data, .device = dev};
  int64_t s = 1;
  for (int i = rank - 1; i >= 0; i--) {
    t.shape[i] = shape[i];
    t.strides[i] = s;
    s *= shape[i];
  }
  return t;
}

static inline int64_t fy_tensor_numel(const struct fy_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) n *= t->shape[i];
  return n;
}

static inline bool fy_tensor_is_contiguous(const struct fy_tensor *t) {
  int64_t s = 1;
  for (int i = t->rank - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->strides[i] != s) return false;
    s *= t->shape[i];
  }
  return true;
}

#endif
