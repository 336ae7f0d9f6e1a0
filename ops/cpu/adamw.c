// AdamW (torch.optim.AdamW semantics) and the sum of squares used for the gradient norm.
#include <math.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "ops/ops.h"

// The per-step constants, computed once in double.
struct adamw_k {
  float decay, step, bc2_sqrt, b1, b2, ob1, ob2, eps, gs;
};

static struct adamw_k adamw_consts(float lr, float beta1, float beta2, float eps, float weight_decay,
                                   int64_t t, float grad_scale) {
  const double bc1 = 1.0 - pow((double)beta1, (double)t);
  const double bc2 = 1.0 - pow((double)beta2, (double)t);
  return (struct adamw_k){.decay = (float)(1.0 - (double)lr * (double)weight_decay),
                          .step = (float)((double)lr / bc1), .bc2_sqrt = (float)sqrt(bc2), .b1 = beta1,
                          .b2 = beta2, .ob1 = 1.0f - beta1, .ob2 = 1.0f - beta2, .eps = eps, .gs = grad_scale};
}

// One element: branch-free float arithmetic with sqrtf, so gcc vectorises the loops that call it
// (-O3 -march=native -fno-math-errno). The operations follow PyTorch's order (sqrt(v) / sqrt(bc2)
// + eps, then step * m / denom) to stay close to its bits.
static inline float adamw_elem(float p, float *m, float *v, float g, struct adamw_k k) {
  float mi = k.b1 * *m + k.ob1 * g;
  float vi = k.b2 * *v + k.ob2 * g * g;
  *m = mi;
  *v = vi;
  p = p * k.decay;
  return p - k.step * (mi / (sqrtf(vi) / k.bc2_sqrt + k.eps));
}

// param (n), m (n), v (n), grad (n) -> param, m, v updated in place
void fy_adamw_update(float *restrict param, float *restrict m, float *restrict v,
                     const float *restrict grad, int64_t n, float lr, float beta1, float beta2,
                     float eps, float weight_decay, int64_t t, float grad_scale) {
  const struct adamw_k k = adamw_consts(lr, beta1, beta2, eps, weight_decay, t, grad_scale);
#pragma omp parallel for simd schedule(static) if (parallel : n > (1 << 16))
  for (int64_t i = 0; i < n; i++) param[i] = adamw_elem(param[i], m + i, v + i, grad[i] * k.gs, k);
}

// param (n), m (n), v (n), gw (n) bf16 gradients -> param, m, v updated, gw = the new weights in bf16
void fy_adamw_update_bf16(float *restrict param, float *restrict m, float *restrict v, uint16_t *restrict gw,
                          int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                          int64_t t, float grad_scale) {
  const struct adamw_k k = adamw_consts(lr, beta1, beta2, eps, weight_decay, t, grad_scale);
#pragma omp parallel for simd schedule(static) if (parallel : n > (1 << 16))
  for (int64_t i = 0; i < n; i++) {
    float p = adamw_elem(param[i], m + i, v + i, fy_bf16_to_f32(gw[i]) * k.gs, k);
    param[i] = p;
    gw[i] = fy_f32_to_bf16(p);
  }
}

// x (n) -> sum of x^2, in double
// The sum is split into fixed blocks whatever the thread count, each block summed with
// FY_SUMSQ_LANES interleaved accumulators, then the block sums are added in order: the result is
// bit-identical for any OMP_NUM_THREADS.
#define FY_SUMSQ_BLOCK 65536
#define FY_SUMSQ_LANES 32

// One block of f32 (xf) or bf16 (xh) elements, the other NULL. Accumulator j takes the elements
// i with i % FY_SUMSQ_LANES == j: four vectors of 8 doubles, one multiply-add per element, and
// enough independent sums that the adds do not wait on one another; separate loops for the two
// types so that the compiler sees plain loads and vectorises them (one loop with a choice inside
// stayed scalar: 9 GB/s).
static double sumsq_block(const float *restrict xf, const uint16_t *restrict xh, int64_t n) {
  double acc[FY_SUMSQ_LANES] = {0};
  int64_t i = 0;
  if (xf) {
    for (; i + FY_SUMSQ_LANES <= n; i += FY_SUMSQ_LANES)
      for (int j = 0; j < FY_SUMSQ_LANES; j++) acc[j] += (double)xf[i + j] * (double)xf[i + j];
  } else {
    for (; i + FY_SUMSQ_LANES <= n; i += FY_SUMSQ_LANES)
      for (int j = 0; j < FY_SUMSQ_LANES; j++) {
        double x = (double)fy_bf16_to_f32(xh[i + j]);
        acc[j] += x * x;
      }
  }
  for (; i < n; i++) {
    double x = xh ? (double)fy_bf16_to_f32(xh[i]) : (double)xf[i];
    acc[i % FY_SUMSQ_LANES] += x * x;
  }
  // Pairwise, in a fixed order.
  for (int w = FY_SUMSQ_LANES / 2; w > 0; w /= 2)
    for (int j = 0; j < w; j++) acc[j] += acc[j + w];
  return acc[0];
}

static double sumsq(const float *xf, const uint16_t *xh, int64_t n) {
  if (n <= 0) return 0.0;
  int64_t nblk = (n + FY_SUMSQ_BLOCK - 1) / FY_SUMSQ_BLOCK;
  if (nblk == 1) return sumsq_block(xf, xh, n);
  double stack[256];
  double *part = nblk <= 256 ? stack : malloc((size_t)nblk * sizeof(double));
  if (!part) {
    // Out of memory for the partials: the same blocks, summed on this thread.
    double s = 0.0;
    for (int64_t b = 0; b < nblk; b++) {
      int64_t lo = b * FY_SUMSQ_BLOCK, hi = lo + FY_SUMSQ_BLOCK < n ? lo + FY_SUMSQ_BLOCK : n;
      s += sumsq_block(xf ? xf + lo : NULL, xh ? xh + lo : NULL, hi - lo);
    }
    return s;
  }
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblk; b++) {
    int64_t lo = b * FY_SUMSQ_BLOCK, hi = lo + FY_SUMSQ_BLOCK < n ? lo + FY_SUMSQ_BLOCK : n;
    part[b] = sumsq_block(xf ? xf + lo : NULL, xh ? xh + lo : NULL, hi - lo);
  }
  double s = 0.0;
  for (int64_t b = 0; b < nblk; b++) s += part[b];
  if (part != stack) free(part);
  return s;
}

double fy_sumsq(const float *x, int64_t n) { return sumsq(x, NULL, n); }

double fy_sumsq_bf16(const uint16_t *x, int64_t n) { return sumsq(NULL, x, n); }
