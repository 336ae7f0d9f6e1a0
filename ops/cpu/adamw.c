// AdamW (torch.optim.AdamW semantics) and the sum of squares used for the gradient norm.
#include <math.h>
#include <stdlib.h>

#include "ops/ops.h"

// param (n), m (n), v (n), grad (n) -> param, m, v updated in place
// The per-step constants are computed once in double; the loop is branch-free float arithmetic
// with sqrtf, so gcc vectorises it (-O3 -march=native -fno-math-errno). The operations follow
// PyTorch's order (sqrt(v) / sqrt(bc2) + eps, then step * m / denom) to stay close to its bits.
void fy_adamw_update(float *restrict param, float *restrict m, float *restrict v,
                     const float *restrict grad, int64_t n, float lr, float beta1, float beta2,
                     float eps, float weight_decay, int64_t t, float grad_scale) {
  const double bc1 = 1.0 - pow((double)beta1, (double)t);
  const double bc2 = 1.0 - pow((double)beta2, (double)t);
  const float decay = (float)(1.0 - (double)lr * (double)weight_decay);
  const float step = (float)((double)lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  const float b1 = beta1, b2 = beta2, ob1 = 1.0f - beta1, ob2 = 1.0f - beta2, gs = grad_scale;
#pragma omp parallel for simd schedule(static) if (parallel : n > (1 << 16))
  for (int64_t i = 0; i < n; i++) {
    float g = grad[i] * gs;
    float mi = b1 * m[i] + ob1 * g;
    float vi = b2 * v[i] + ob2 * g * g;
    m[i] = mi;
    v[i] = vi;
    float p = param[i] * decay;
    param[i] = p - step * (mi / (sqrtf(vi) / bc2_sqrt + eps));
  }
}

// x (n) -> sum of x^2, in double
// The sum is split into fixed blocks whatever the thread count, each block summed with eight
// interleaved accumulators (one AVX-512 register of doubles), then the block sums are added in
// order: the result is bit-identical for any OMP_NUM_THREADS.
#define FY_SUMSQ_BLOCK 65536

static double sumsq_block(const float *restrict x, int64_t n) {
  double acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
  for (; i < n; i++) acc[i & 7] += (double)x[i] * (double)x[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

double fy_sumsq(const float *x, int64_t n) {
  if (n <= 0) return 0.0;
  int64_t nblk = (n + FY_SUMSQ_BLOCK - 1) / FY_SUMSQ_BLOCK;
  if (nblk == 1) return sumsq_block(x, n);
  double stack[256];
  double *part = nblk <= 256 ? stack : malloc((size_t)nblk * sizeof(double));
  if (!part) {
    // Out of memory for the partials: the same blocks, summed on this thread.
    double s = 0.0;
    for (int64_t b = 0; b < nblk; b++) {
      int64_t lo = b * FY_SUMSQ_BLOCK, hi = lo + FY_SUMSQ_BLOCK < n ? lo + FY_SUMSQ_BLOCK : n;
      s += sumsq_block(x + lo, hi - lo);
    }
    return s;
  }
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblk; b++) {
    int64_t lo = b * FY_SUMSQ_BLOCK, hi = lo + FY_SUMSQ_BLOCK < n ? lo + FY_SUMSQ_BLOCK : n;
    part[b] = sumsq_block(x + lo, hi - lo);
  }
  double s = 0.0;
  for (int64_t b = 0; b < nblk; b++) s += part[b];
  if (part != stack) free(part);
  return s;
}
