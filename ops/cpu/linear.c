// nn.Linear through the oneDNN matmul (ops/cpu/matmul.c); the bias is fused into the forward
// product as a oneDNN bias argument.
#include "ops/ops.h"

// inp (BT,C), weight (OC,C), bias (OC) -> out (BT,OC)
fy_status fy_linear_forward(float *out, const float *inp, const float *weight, const float *bias,
                            int64_t BT, int64_t C, int64_t OC, bool bf16) {
  // out (BT,OC) = inp (BT,C) @ weight^T (C,OC) + bias
  if (bf16) return fy_matmul16(out, inp, weight, bias, BT, OC, C, false, true, 0.0f);
  return fy_matmul_bias(out, inp, weight, bias, 1, BT, OC, C, false, true, 1.0f, 0.0f, 0, 0, 0,
                        0, 0, 0);
}

// dout (BT,OC), inp (BT,C), weight (OC,C) -> dinp (BT,C) +=, dweight (OC,C) +=, dbias (OC) +=
fy_status fy_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                             const float *inp, const float *weight, int64_t BT, int64_t C,
                             int64_t OC, bool bf16) {
  // dinp (BT,C) += dout (BT,OC) @ weight (OC,C)
  if (dinp)
    FY_TRY(bf16 ? fy_matmul16(dinp, dout, weight, NULL, BT, C, OC, false, false, 1.0f)
                : fy_matmul(dinp, dout, weight, BT, C, OC, false, false, 1.0f, 1.0f));
  return fy_linear_backward_params(dweight, dbias, dout, inp, BT, C, OC, true, bf16);
}

// dout (BT,OC), inp (BT,C) -> dweight (OC,C) (+)=, dbias (OC) (+)=
fy_status fy_linear_backward_params(float *dweight, float *dbias, const float *dout,
                                    const float *inp, int64_t BT, int64_t C, int64_t OC,
                                    bool accumulate, bool bf16) {
  // dweight (OC,C) (+)= dout^T (OC,BT) @ inp (BT,C)
  const float beta = accumulate ? 1.0f : 0.0f;
  if (dweight)
    FY_TRY(bf16 ? fy_matmul16(dweight, dout, inp, NULL, OC, C, BT, true, false, beta)
                : fy_matmul(dweight, dout, inp, OC, C, BT, true, false, 1.0f, beta));
  if (dbias) {
    // Column sums: threads split the columns and walk the rows in order (deterministic).
    const int64_t blk = 64;
    int64_t nblk = (OC + blk - 1) / blk;
#pragma omp parallel for schedule(static) if (BT * OC > FY_PAR_ROWS)
    for (int64_t ob = 0; ob < nblk; ob++) {
      int64_t o0 = ob * blk, o1 = o0 + blk < OC ? o0 + blk : OC;
      float acc[64] = {0};
      for (int64_t i = 0; i < BT; i++) {
        const float *g = dout + i * OC + o0;
        for (int64_t o = 0; o < o1 - o0; o++) acc[o] += g[o];
      }
      for (int64_t o = o0; o < o1; o++) dbias[o] = accumulate ? dbias[o] + acc[o - o0] : acc[o - o0];
    }
  }
  return FY_OK;
}
