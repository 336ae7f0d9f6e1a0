// Softmax cross-entropy over the vocabulary, one row per token: a stable log-softmax (the row
// maximum is subtracted before exp), threads split the rows.
#include <math.h>
#include <string.h>

#include "ops/ops.h"

// exp(x) in a form gcc vectorises (glibc's expf is only vectorised under -ffast-math): Cody-Waite
// range reduction x = n ln2 + r, Cephes' degree-6 polynomial for exp(r), 2^n from the exponent
// bits. Within 1.5 ulp of exp over [-87, 88]; x is clamped to that range (callers subtract the
// row maximum, so x <= 0, and values below e^-87 are negligible against the row sum >= 1).
static inline float fy_expf_(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  float n = rintf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) * (1 << 23);
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

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
#pragma omp parallel for schedule(static) reduction(+ : count) if (BT * V > (1 << 14))
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
#pragma omp parallel for schedule(static) if (BT * V > (1 << 14))
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
