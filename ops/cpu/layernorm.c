// LayerNorm as PyTorch's nn.LayerNorm: biased variance, eps inside the square root. mean and rstd
// are saved per row for backward. Statistics are computed in float, in two passes (mean, then the
// centred sum of squares), which is as accurate as Welford here and vectorises. The `omp simd`
// reductions fix a summation order at compile time, so results stay bit-reproducible.
#include <math.h>

#include "ops/ops.h"

// inp (BT,C), weight (C), bias (C) -> out (BT,C), mean (BT), rstd (BT)
void fy_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                          const float *weight, const float *bias, int64_t BT, int64_t C,
                          float eps) {
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
  for (int64_t i = 0; i < BT; i++) {
    const float *x = inp + i * C;
    float *y = out + i * C;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < C; c++) s += x[c];
    float m = s / (float)C;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int64_t c = 0; c < C; c++) {
      float d = x[c] - m;
      v += d * d;
    }
    float r = 1.0f / sqrtf(v / (float)C + eps);
    if (weight && bias) {
      for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m) * r * weight[c] + bias[c];
    } else {
      for (int64_t c = 0; c < C; c++) {
        float n = (x[c] - m) * r;
        if (weight) n *= weight[c];
        if (bias) n += bias[c];
        y[c] = n;
      }
    }
    mean[i] = m;
    rstd[i] = r;
  }
}

// dout (BT,C), inp (BT,C), weight (C), mean (BT), rstd (BT) -> dinp (BT,C) +=, dweight (C) +=,
// dbias (C) +=
// dinp is a per-row computation (threads split rows); dweight and dbias are sums over rows, so
// threads split the channels and each walks the rows in order: no atomics, and the result does
// not depend on the thread count.
void fy_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                           const float *inp, const float *weight, const float *mean,
                           const float *rstd, int64_t BT, int64_t C) {
  if (dinp) {
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
    for (int64_t i = 0; i < BT; i++) {
      const float *x = inp + i * C, *g = dout + i * C;
      float *dx = dinp + i * C;
      float m = mean[i], r = rstd[i];
      // dnorm = dout * weight; dx = r * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
      float sd = 0.0f, sdn = 0.0f;
#pragma omp simd reduction(+ : sd, sdn)
      for (int64_t c = 0; c < C; c++) {
        float dn = weight ? g[c] * weight[c] : g[c];
        float n = (x[c] - m) * r;
        sd += dn;
        sdn += dn * n;
      }
      sd /= (float)C;
      sdn /= (float)C;
      for (int64_t c = 0; c < C; c++) {
        float dn = weight ? g[c] * weight[c] : g[c];
        float n = (x[c] - m) * r;
        dx[c] += (dn - sd - n * sdn) * r;
      }
    }
  }
  fy_layernorm_backward_params(dweight, dbias, dout, inp, mean, rstd, BT, C, true);}

// dout (BT,C), inp, mean, rstd -> dweight (C) (+)=, dbias (C) (+)=
void fy_layernorm_backward_params(float *dweight, float *dbias, const float *dout,
                                  const float *inp, const float *mean, const float *rstd,
                                  int64_t BT, int64_t C, bool accumulate) {
  if (!dweight && !dbias) return;
  const int64_t blk = 64;
  int64_t nblk = (C + blk - 1) / blk;
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
  for (int64_t cb = 0; cb < nblk; cb++) {
    int64_t c0 = cb * blk, c1 = c0 + blk < C ? c0 + blk : C;
    float accw[64] = {0}, accb[64] = {0};
    for (int64_t i = 0; i < BT; i++) {
      const float *x = inp + i * C + c0, *g = dout + i * C + c0;
      float m = mean[i], r = rstd[i];
      for (int64_t c = 0; c < c1 - c0; c++) {
        accw[c] += (x[c] - m) * r * g[c];
        accb[c] += g[c];
      }
    }
    for (int64_t c = c0; c < c1; c++) {
      if (dweight) dweight[c] = accumulate ? dweight[c] + accw[c - c0] : accw[c - c0];
      if (dbias) dbias[c] = accumulate ? dbias[c] + accb[c - c0] : accb[c - c0];
    }
  }
}
