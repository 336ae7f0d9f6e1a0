// Softmax cross-entropy over the vocabulary, one row per token: a stable log-softmax (the row
// maximum is subtracted before exp), threads split the rows.
#include <math.h>
#include <string.h>

#include "ops/cpu/vexp.h"
#include "ops/ops.h"

// The row's maximum and sum of exp(x - max).
static inline void ce_row_stats(const float *x, int64_t V, float *max_out, float *sum_out) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < V; j++) mx = x[j] > mx ? x[j] : mx;
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < V; j++) s += fy_expf_(x[j] - mx);
  *max_out = mx;
  *sum_out = s;
}

// logits (BT,V), targets (BT) -> losses (BT); returns the count of targets that are not -100
int64_t fy_crossentropy_forward(float *losses, const float *logits, const int32_t *targets,
                                int64_t BT, int64_t V) {
  int64_t count = 0;
#pragma omp parallel for schedule(static) reduction(+ : count) if (BT * V > FY_PAR_ROWS)
  for (int64_t i = 0; i < BT; i++) {
    int32_t t = targets[i];
    if (t == -100) {
      losses[i] = 0.0f;
      continue;
    }
    const float *x = logits + i * V;
    float mx, s;
    ce_row_stats(x, V, &mx, &s);
    // -log softmax(x)[t] = log(sum exp(x - mx)) - (x[t] - mx)
    losses[i] = logf(s) - (x[t] - mx);
    count++;
  }
  return count;
}

// logits (BT,V), targets (BT) -> dlogits (BT,V) = dloss * (softmax - onehot); may be in place
void fy_crossentropy_backward(float *dlogits, const float *logits, const int32_t *targets,
                              int64_t BT, int64_t V, float dloss) {
#pragma omp parallel for schedule(static) if (BT * V > FY_PAR_ROWS)
  for (int64_t i = 0; i < BT; i++) {
    const float *x = logits + i * V;
    float *d = dlogits + i * V;
    int32_t t = targets[i];
    if (t == -100) {
      for (int64_t j = 0; j < V; j++) d[j] = 0.0f;
      continue;
    }
    float mx, s;
    ce_row_stats(x, V, &mx, &s);
    float k = dloss / s;
    // Each element is read before it is written, so d == x is safe.
#pragma omp simd
    for (int64_t j = 0; j < V; j++) d[j] = k * fy_expf_(x[j] - mx);
    d[t] -= dloss;
  }
}
