// Causal multi-head attention with a padding mask, as in llm.c. The score and value products run
// through oneDNN (fy_matmul_batched, one call covering all heads of a batch row: q, k, v are read
// in place from qkv through the row stride 3C and the head stride HS); the masked softmax and its
// backward are row loops split over threads.
//
// Causality halves the useful work, so the products are cut into tiles of ATT_TILE query rows:
// the tile of rows [r0, r1) only meets keys [0, r1). The work done is (1 + ATT_TILE/T) times the
// useful work instead of twice it; T <= ATT_TILE is one full product. Inside a tile, the entries
// above the diagonal are computed and then overwritten with exact zeros by the softmax, and
// padded keys get exact zeros, so the zero probabilities flow through the later products.
#include <math.h>
#include <string.h>

#include "ops/cpu/vexp.h"
#include "ops/ops.h"

#define ATT_TILE 128

static fy_status att_check(int64_t C, int64_t NH) {
  if (NH <= 0 || C % NH != 0)
    return fy_error_set(FY_ERR_INVALID, "attention: C=%lld is not a multiple of NH=%lld",
                        (long long)C, (long long)NH);
  return FY_OK;
}

int64_t fy_attention_kernel_calls(int64_t B, int64_t T, bool backward) {
  int64_t tiles = (T + ATT_TILE - 1) / ATT_TILE;  // per batch row: two products each (four backward)
  return (backward ? 4 : 2) * B * tiles + 1;      // and the softmax (or its backward) loop
}

// row[0, seen) /= sum, row[seen, width) = 0: the end of a causal softmax row.
static void normalise_prefix(float *row, float sum, int64_t seen, int64_t width) {
  float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t s = 0; s < seen; s++) row[s] *= inv;
  for (int64_t s = seen; s < width; s++) row[s] = 0.0f;
}

// row[0, seen) = softmax(row[0, seen)), row[seen, width) = 0: a causal row of attention weights.
static void softmax_prefix(float *row, int64_t seen, int64_t width) {
  float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
  for (int64_t s = 0; s < seen; s++) mx = row[s] > mx ? row[s] : mx;
#pragma omp simd reduction(+ : sum)
  for (int64_t s = 0; s < seen; s++) {
    float e = fy_expf_(row[s] - mx);
    row[s] = e;
    sum += e;
  }
  normalise_prefix(row, sum, seen, width);
}

// qkv (B,T,3C), mask (B,T) -> out (B,T,C), att (B,NH,T,T)
fy_status fy_attention_forward(float *out, float *att, const float *qkv, const int32_t *mask,
                               int64_t B, int64_t T, int64_t C, int64_t NH, float scale) {
  FY_TRY(att_check(C, NH));
  const int64_t HS = C / NH, C3 = 3 * C, TT = T * T;
  // att[b,h][r0:r1, 0:r1] = scale * q[b,h][r0:r1] (R,HS) @ k[b,h][0:r1]^T (HS,r1)
  for (int64_t b = 0; b < B; b++)
    for (int64_t r0 = 0; r0 < T; r0 += ATT_TILE) {
      int64_t r1 = r0 + ATT_TILE < T ? r0 + ATT_TILE : T;
      const float *q = qkv + b * T * C3;
      FY_TRY(fy_matmul_batched(att + b * NH * TT + r0 * T, q + r0 * C3, q + C, NH, r1 - r0, r1,
                               HS, false, true, scale, 0.0f, C3, C3, T, HS, HS, TT));
    }
  // Masked softmax per (b, h, t) row; keys s > t and padded keys get exactly 0.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bh = 0; bh < B * NH; bh++) {
    for (int64_t t = 0; t < T; t++) {
      const int32_t *mk = mask ? mask + (bh / NH) * T : NULL;
      float *row = att + bh * TT + t * T;
      float mx = -INFINITY, sum = 0.0f;
      if (mk) {
#pragma omp simd reduction(max : mx)
        for (int64_t s = 0; s <= t; s++) mx = mk[s] && row[s] > mx ? row[s] : mx;
        if (mx == -INFINITY) {
          // No key to attend to (left padding): a zero row, hence a zero output and gradient.
          for (int64_t s = 0; s < T; s++) row[s] = 0.0f;
          continue;
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s <= t; s++) {
          float e = mk[s] ? fy_expf_(row[s] - mx) : 0.0f;
          row[s] = e;
          sum += e;
        }
        normalise_prefix(row, sum, t + 1, T);
      } else {
        softmax_prefix(row, t + 1, T);
      }
    }
  }
  // out[b,h][r0:r1] (R,HS) = att[b,h][r0:r1, 0:r1] (R,r1) @ v[b,h][0:r1] (r1,HS)
  for (int64_t b = 0; b < B; b++)
    for (int64_t r0 = 0; r0 < T; r0 += ATT_TILE) {
      int64_t r1 = r0 + ATT_TILE < T ? r0 + ATT_TILE : T;
      const float *v = qkv + b * T * C3 + 2 * C;
      FY_TRY(fy_matmul_batched(out + (b * T + r0) * C, att + b * NH * TT + r0 * T, v, NH, r1 - r0,
                               HS, r1, false, false, 1.0f, 0.0f, T, C3, C, TT, HS, HS));
    }
  return FY_OK;
}

fy_status fy_attention_decode(float *out, float *kcache, float *vcache, float *att, const float *qkv, int64_t len,
                              int64_t n, int64_t cap, int64_t C, int64_t NH, float scale) {
  FY_TRY(att_check(C, NH));
  if (len < 0 || n < 1 || len + n > cap)
    return fy_error_set(FY_ERR_INVALID, "attention decode: positions %lld to %lld outside a cache of %lld",
                        (long long)len, (long long)(len + n - 1), (long long)cap);
  const int64_t HS = C / NH, C3 = 3 * C, keys = len + n;
  for (int64_t t = 0; t < n; t++) {
    memcpy(kcache + (len + t) * C, qkv + t * 3 * C + C, (size_t)C * sizeof(float));
    memcpy(vcache + (len + t) * C, qkv + t * 3 * C + 2 * C, (size_t)C * sizeof(float));
  }
  if (n > 1) {  // several tokens (a prompt): products over all of them, as the forward's
    // att[h] (n, keys) = scale * q[h] (n,HS) @ k[h][0:keys]^T (HS,keys)
    FY_TRY(fy_matmul_batched(att, qkv, kcache, NH, n, keys, HS, false, true, scale, 0.0f, C3, C, keys, HS, HS,
                             n * keys));
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t t = 0; t < n; t++) softmax_prefix(att + (h * n + t) * keys, len + t + 1, keys);  // keys 0..len+t
    // out[h] (n,HS) = att[h] (n,keys) @ v[h][0:keys] (keys,HS)
    return fy_matmul_batched(out, att, vcache, NH, n, HS, keys, false, false, 1.0f, 0.0f, keys, C, C, n * keys, HS, HS);
  }
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < NH; h++)
    for (int64_t t = 0; t < n; t++) {  // token t (position len + t) sees cache rows 0 .. len + t
      const float *q = qkv + t * 3 * C + h * HS;
      float *row = att + h * cap, mx = -INFINITY, sum = 0.0f;
      const int64_t keys = len + t + 1;
      for (int64_t s = 0; s < keys; s++) {  // row (keys) = scale * q (HS) . k[s] (HS)
        const float *k = kcache + s * C + h * HS;
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int64_t i = 0; i < HS; i++) d += q[i] * k[i];
        row[s] = d * scale;
        mx = row[s] > mx ? row[s] : mx;
      }
      for (int64_t s = 0; s < keys; s++) {
        row[s] = fy_expf_(row[s] - mx);
        sum += row[s];
      }
      const float inv = 1.0f / sum;
      float *o = out + t * C + h * HS;  // o (HS) = sum over s of row[s] / sum * v[s] (HS)
      for (int64_t i = 0; i < HS; i++) o[i] = 0.0f;
      for (int64_t s = 0; s < keys; s++) {
        const float p = row[s] * inv, *v = vcache + s * C + h * HS;
#pragma omp simd
        for (int64_t i = 0; i < HS; i++) o[i] += p * v[i];
      }
    }
  return FY_OK;
}

// dout (B,T,C), qkv (B,T,3C), att (B,NH,T,T) -> dqkv (B,T,3C) +=; scratch (B,NH,T,T)
fy_status fy_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                                const float *att, int64_t B, int64_t T, int64_t C, int64_t NH,
                                float scale) {
  FY_TRY(att_check(C, NH));
  const int64_t HS = C / NH, C3 = 3 * C, TT = T * T;
  for (int64_t b = 0; b < B; b++) {
    const float *v = qkv + b * T * C3 + 2 * C;
    const float *p = att + b * NH * TT, *dO = dout + b * T * C;
    float *dv = dqkv + b * T * C3 + 2 * C, *dp = scratch + b * NH * TT;
    for (int64_t r0 = 0; r0 < T; r0 += ATT_TILE) {
      int64_t r1 = r0 + ATT_TILE < T ? r0 + ATT_TILE : T;
      // Keys [r0, r1) are only seen by queries [r0, T):
      // dv[r0:r1] (R,HS) += att[r0:T, r0:r1]^T (R,T-r0) @ dout[r0:T] (T-r0,HS)
      FY_TRY(fy_matmul_batched(dv + r0 * C3, p + r0 * T + r0, dO + r0 * C, NH, r1 - r0, HS,
                               T - r0, true, false, 1.0f, 1.0f, T, C, C3, TT, HS, HS));
      // datt[r0:r1, 0:r1] (R,r1) = dout[r0:r1] (R,HS) @ v[0:r1]^T (HS,r1)
      FY_TRY(fy_matmul_batched(dp + r0 * T, dO + r0 * C, v, NH, r1 - r0, r1, HS, false, true,
                               1.0f, 0.0f, C, C3, T, HS, HS, TT));
    }
  }
  // Softmax backward: dscore = att * (datt - sum_s att * datt), in place in scratch. Zero
  // probabilities (masked, above the diagonal, empty rows) give zero dscore.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bh = 0; bh < B * NH; bh++) {
    for (int64_t t = 0; t < T; t++) {
      const float *p = att + bh * TT + t * T;
      float *d = scratch + bh * TT + t * T;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t s = 0; s <= t; s++) dot += p[s] * d[s];
#pragma omp simd
      for (int64_t s = 0; s <= t; s++) d[s] = p[s] * (d[s] - dot);
      for (int64_t s = t + 1; s < T; s++) d[s] = 0.0f;
    }
  }
  for (int64_t b = 0; b < B; b++) {
    const float *q = qkv + b * T * C3, *k = q + C;
    const float *ds = scratch + b * NH * TT;
    float *dq = dqkv + b * T * C3, *dk = dq + C;
    for (int64_t r0 = 0; r0 < T; r0 += ATT_TILE) {
      int64_t r1 = r0 + ATT_TILE < T ? r0 + ATT_TILE : T;
      // dq[r0:r1] (R,HS) += scale * dscore[r0:r1, 0:r1] (R,r1) @ k[0:r1] (r1,HS)
      FY_TRY(fy_matmul_batched(dq + r0 * C3, ds + r0 * T, k, NH, r1 - r0, HS, r1, false, false,
                               scale, 1.0f, T, C3, C3, TT, HS, HS));
      // dk[r0:r1] (R,HS) += scale * dscore[r0:T, r0:r1]^T (R,T-r0) @ q[r0:T] (T-r0,HS)
      FY_TRY(fy_matmul_batched(dk + r0 * C3, ds + r0 * T + r0, q + r0 * C3, NH, r1 - r0, HS,
                               T - r0, true, false, scale, 1.0f, T, C3, C3, TT, HS, HS));
    }
  }
  return FY_OK;
}
