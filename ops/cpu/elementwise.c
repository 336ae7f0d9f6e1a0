// Elementwise kernels: relu, gelu, add, and dropout fused with an add. Memory-bound; threads only pay off on large arrays.
// Outputs may alias inputs (in-place relu, residual add); `omp simd` vectorises without restrict.
#include "ops/ops.h"

#include <math.h>

#include "fy_config.h"
#include "ops/dropout.h"

#if FY_HAVE_MVEC
// glibc's libmvec holds vector versions of these (meson.build checks that they link): declared
// for `omp simd`, the gelu loops call them on whole vectors.
#pragma omp declare simd notinbranch
extern float erfcf(float);
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

// inp (N) -> out (N)
void fy_relu_forward(float *out, const float *inp, int64_t N) {
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE)
  for (int64_t i = 0; i < N; i++) out[i] = inp[i] < 0.0f ? 0.0f : inp[i];  // NaN passes through, as in PyTorch
}

// dout (N), out (N) -> dinp (N) +=, or = when dinp is dout (in place: an element read, then written)
void fy_relu_backward(float *dinp, const float *dout, const float *out, int64_t N) {
  if (dinp == dout) {
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE)
    for (int64_t i = 0; i < N; i++) dinp[i] = out[i] > 0.0f ? dinp[i] : 0.0f;
    return;
  }
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE)
  for (int64_t i = 0; i < N; i++) dinp[i] += out[i] > 0.0f ? dout[i] : 0.0f;
}

// inp (N) -> out (N) = x * Phi(x), Phi the standard normal's CDF (PyTorch's exact gelu). Phi(x)
// is erfc(-x/sqrt 2) / 2 rather than (1 + erf(x/sqrt 2)) / 2, which cancels for negative x.
void fy_gelu_forward(float *out, const float *inp, int64_t N) {
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE / 8)
  for (int64_t i = 0; i < N; i++) out[i] = 0.5f * inp[i] * erfcf(inp[i] * -(float)M_SQRT1_2);
}

// gelu'(x) = Phi(x) + x * phi(x)
static inline float gelu_grad(float x) {
  const float inv_sqrt_2pi = 0.3989422804014327f;
  return 0.5f * erfcf(x * -(float)M_SQRT1_2) + x * (inv_sqrt_2pi * expf(-0.5f * x * x));
}

// dout (N), inp (N) -> dinp (N) += dout * gelu'(inp), or = when dinp is dout (in place)
void fy_gelu_backward(float *dinp, const float *dout, const float *inp, int64_t N) {
  if (dinp == dout) {
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE / 8)
    for (int64_t i = 0; i < N; i++) dinp[i] *= gelu_grad(inp[i]);
    return;
  }
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE / 8)
  for (int64_t i = 0; i < N; i++) dinp[i] += dout[i] * gelu_grad(inp[i]);
}

// a (N), b (N) -> out (N)
void fy_add_forward(float *out, const float *a, const float *b, int64_t N) {
  // out may alias a or b (a residual added in place), so no restrict here.
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE)
  for (int64_t i = 0; i < N; i++) out[i] = a[i] + b[i];
}

// dout (N) -> da (N) +=, db (N) +=
void fy_add_backward(float *da, float *db, const float *dout, int64_t N) {
  if (da) {
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE)
    for (int64_t i = 0; i < N; i++) da[i] += dout[i];
  }
  if (db) {
#pragma omp parallel for simd schedule(static) if (parallel : N > FY_PAR_ELEMENTWISE)
    for (int64_t i = 0; i < N; i++) db[i] += dout[i];
  }
}

// bias (C) -> out (rows,C) += bias
void fy_bias_add(float *out, const float *restrict bias, int64_t rows, int64_t C) {
#pragma omp parallel for schedule(static) if (parallel : rows * C > FY_PAR_ELEMENTWISE)
  for (int64_t r = 0; r < rows; r++) {
    float *row = out + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) row[c] += bias[c];
  }
}

// base (rows,C), src (rows,C) -> dst (rows,C) = base + src * keep / (1 - p), row r being token u0
// + r of the stream (its mask drawn from key, ops/dropout.h): the dropout-add's forward (dst the
// output, base the residual, src the branch) and its branch gradient (dst = base = db, src =
// dout). dst may alias base or src.
static void dropout_add_rows(float *dst, const float *base, const float *src, int64_t rows, int64_t C, uint64_t key,
                             int64_t u0, float p) {
  const uint32_t thr = fy_dropout_threshold(p);
  const float s = fy_dropout_scale(p);
#pragma omp parallel for schedule(static) if (parallel : rows * C > FY_PAR_ELEMENTWISE)
  for (int64_t r = 0; r < rows; r++) {
    const uint64_t tk = fy_dropout_token(key, u0 + r);
    float *d = dst + r * C;
    const float *x = base + r * C, *y = src + r * C;
#pragma omp simd
    for (int64_t j = 0; j < C; j++) d[j] = x[j] + (fy_dropout_draw(tk, j) >= thr ? y[j] * s : 0.0f);
  }
}

// a (rows,C), b (rows,C) -> out (rows,C) = a + b * keep / (1 - p)
void fy_dropout_add_forward(float *out, const float *a, const float *b, int64_t rows, int64_t C, uint64_t key,
                            int64_t u0, float p) {
  dropout_add_rows(out, a, b, rows, C, key, u0, p);
}

// dout (rows,C) -> da (rows,C) += dout, db (rows,C) += dout * keep / (1 - p) (either may be NULL)
void fy_dropout_add_backward(float *da, float *db, const float *dout, int64_t rows, int64_t C, uint64_t key,
                             int64_t u0, float p) {
  if (da) fy_add_backward(da, NULL, dout, rows * C);
  if (db) dropout_add_rows(db, db, dout, rows, C, key, u0, p);
}
