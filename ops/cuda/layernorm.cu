// LayerNorm as nn.LayerNorm (biased variance, eps inside the square root), fp32 statistics.
// Forward and the input gradient take one row per warp: the row's reductions are warp shuffles,
// with no shared memory and no block barrier; a lane reads and writes 16-byte pieces of the row
// (VW elements) when the row length and the buffers allow it, single elements otherwise. The statistics are two passes over the row (mean,
// then the centred sum of squares), as the CPU kernel, rather than E[x^2] - mean^2, which loses
// digits when the mean is large. The parameter gradients are sums over rows, done by a second
// kernel in which each block owns 32 channels (and, given scratch, one of FY_CUDA_LN_PARTS row
// ranges, whose sums a third kernel adds in order): deterministic, no atomics.
#include "ops/cuda/common.cuh"

#define LN_WARPS 8  // rows per block

// inp (BT,C), weight (C), bias (C) -> out (BT,C), mean (BT), rstd (BT)
template <typename T, int VW>
__global__ void __launch_bounds__(LN_WARPS * 32)
layernorm_forward_kernel(T *out, float *mean, float *rstd, const T *inp, const T *weight,
                         const T *bias, int64_t BT, int C, float eps) {
  int64_t row = (int64_t)blockIdx.x * LN_WARPS + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= BT) return;
  const T *x = inp + row * C;
  float s = 0.0f, f[VW];
  for (int c = lane * VW; c < C; c += 32 * VW) {
    fy_ldv<T, VW>(f, x + c);
#pragma unroll
    for (int i = 0; i < VW; i++) s += f[i];
  }
  float m = fy_warp_sum(s) / (float)C;
  float v = 0.0f;
  for (int c = lane * VW; c < C; c += 32 * VW) {
    fy_ldv<T, VW>(f, x + c);
#pragma unroll
    for (int i = 0; i < VW; i++) v += (f[i] - m) * (f[i] - m);
  }
  float r = 1.0f / sqrtf(fy_warp_sum(v) / (float)C + eps);
  T *y = out + row * C;
  for (int c = lane * VW; c < C; c += 32 * VW) {
    float w[VW], b[VW];
    fy_ldv<T, VW>(f, x + c);
    if (weight) fy_ldv<T, VW>(w, weight + c);
    if (bias) fy_ldv<T, VW>(b, bias + c);
#pragma unroll
    for (int i = 0; i < VW; i++) {
      f[i] = (f[i] - m) * r;
      if (weight) f[i] *= w[i];
      if (bias) f[i] += b[i];
    }
    fy_stv<T, VW>(y + c, f);
  }
  if (lane == 0) {
    if (mean) mean[row] = m;
    if (rstd) rstd[row] = r;
  }
}

// dout (BT,C), inp (BT,C), weight (C), mean (BT), rstd (BT) -> dinp (BT,C) +=
// dnorm = dout * weight; dinp += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
// __restrict__ matters here: without it the compiler must assume that the += store may change
// what the next iteration loads, keeps every load behind the previous store, and the kernel runs
// ten times slower (405 us against 38 us for 16384 x 768 bf16 on an H200).
template <typename T, int VW>
__global__ void __launch_bounds__(LN_WARPS * 32)
layernorm_backward_input_kernel(T *__restrict__ dinp, const T *__restrict__ dout,
                                const T *__restrict__ inp, const T *__restrict__ weight,
                                const float *__restrict__ mean, const float *__restrict__ rstd,
                                int64_t BT, int C) {
  int64_t row = (int64_t)blockIdx.x * LN_WARPS + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= BT) return;
  const T *x = inp + row * C, *g = dout + row * C;
  float m = mean[row], r = rstd[row];
  float sd = 0.0f, sdn = 0.0f, dn[VW], xv[VW], w[VW];
  for (int c = lane * VW; c < C; c += 32 * VW) {
    fy_ldv<T, VW>(dn, g + c);
    fy_ldv<T, VW>(xv, x + c);
    if (weight) fy_ldv<T, VW>(w, weight + c);
#pragma unroll
    for (int i = 0; i < VW; i++) {
      if (weight) dn[i] *= w[i];
      sd += dn[i];
      sdn += dn[i] * ((xv[i] - m) * r);
    }
  }
  sd = fy_warp_sum(sd) / (float)C;
  sdn = fy_warp_sum(sdn) / (float)C;
  T *dx = dinp + row * C;
  for (int c = lane * VW; c < C; c += 32 * VW) {
    float acc[VW];
    fy_ldv<T, VW>(dn, g + c);
    fy_ldv<T, VW>(xv, x + c);
    if (weight) fy_ldv<T, VW>(w, weight + c);
    fy_ldv<T, VW>(acc, dx + c);
#pragma unroll
    for (int i = 0; i < VW; i++) {
      if (weight) dn[i] *= w[i];
      acc[i] += (dn[i] - sd - ((xv[i] - m) * r) * sdn) * r;
    }
    fy_stv<T, VW>(dx + c, acc);
  }
}

// Rows [i0, i1) of dout (BT,C), inp (BT,C), mean, rstd -> *sw, *sb: the sums over those rows of
// channel 32*blockIdx.x + tx of the weight gradient (x - mean) * rstd * dout and of dout.
// Thread (tx, ty) sums rows i0+ty, i0+ty+32, ... of its channel (a warp reads 32 consecutive
// channels of one row: coalesced), then the 32 partial sums of each channel are added in a fixed
// order. Every thread of the block must call it; true for the threads (ty = 0, a channel < C)
// that hold a channel's sums.
template <typename T>
__device__ bool ln_params_rows(float *sw, float *sb, const T *dout, const T *inp, const float *mean,
                               const float *rstd, int64_t i0, int64_t i1, int C) {
  __shared__ float pw[32][33], pb[32][33];  // +1: the column reads below hit distinct banks
  int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  int c = blockIdx.x * 32 + tx;
  float aw = 0.0f, ab = 0.0f;
  if (c < C)
    for (int64_t i = i0 + ty; i < i1; i += 32) {
      float g = fy_ld(dout + i * C + c);
      aw += (fy_ld(inp + i * C + c) - mean[i]) * rstd[i] * g;
      ab += g;
    }
  pw[ty][tx] = aw;
  pb[ty][tx] = ab;
  __syncthreads();
  if (ty != 0 || c >= C) return false;
  float w = 0.0f, b = 0.0f;
  for (int k = 0; k < 32; k++) {
    w += pw[k][tx];
    b += pb[k][tx];
  }
  *sw = w;
  *sb = b;
  return true;
}

// dout (BT,C), inp (BT,C), mean (BT), rstd (BT) -> dweight (C) (+)=, dbias (C) (+)=
// Block b owns channels [32b, 32b+32), all rows.
template <typename T>
__global__ void __launch_bounds__(1024)
layernorm_backward_params_kernel(T *dweight, T *dbias, const T *dout, const T *inp,
                                 const float *mean, const float *rstd, int64_t BT, int C,
                                 bool accumulate) {
  float sw, sb;
  if (!ln_params_rows(&sw, &sb, dout, inp, mean, rstd, 0, BT, C)) return;
  int c = blockIdx.x * 32 + threadIdx.x % 32;
  if (dweight) fy_st(dweight + c, accumulate ? fy_ld(dweight + c) + sw : sw);
  if (dbias) fy_st(dbias + c, accumulate ? fy_ld(dbias + c) + sb : sb);
}

// The same sums split over FY_CUDA_LN_PARTS row ranges as well as 32-channel groups, so that a
// narrow layer (C = 768: 24 channel groups) still fills the GPU: block (g, p) writes the sums of
// rows [p*R, (p+1)*R) to scratch, and ln_params_final adds the parts in order.
template <typename T>
__global__ void __launch_bounds__(1024)
layernorm_backward_params_part_kernel(float *scratch, const T *dout, const T *inp,
                                      const float *mean, const float *rstd, int64_t BT, int C) {
  int p = blockIdx.y;
  int64_t per = (BT + FY_CUDA_LN_PARTS - 1) / FY_CUDA_LN_PARTS;
  int64_t i0 = p * per, i1 = i0 + per < BT ? i0 + per : BT;
  float sw, sb;
  if (!ln_params_rows(&sw, &sb, dout, inp, mean, rstd, i0, i1, C)) return;
  int c = blockIdx.x * 32 + threadIdx.x % 32;
  scratch[(int64_t)(2 * p) * C + c] = sw;
  scratch[(int64_t)(2 * p + 1) * C + c] = sb;
}

// scratch (FY_CUDA_LN_PARTS, 2, C) -> dweight (C) (+)=, dbias (C) (+)=
template <typename T>
__global__ void layernorm_backward_params_final_kernel(T *dweight, T *dbias, const float *scratch,
                                                       int C, bool accumulate) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sw = 0.0f, sb = 0.0f;
  for (int p = 0; p < FY_CUDA_LN_PARTS; p++) {
    sw += scratch[(int64_t)(2 * p) * C + c];
    sb += scratch[(int64_t)(2 * p + 1) * C + c];
  }
  if (dweight) fy_st(dweight + c, accumulate ? fy_ld(dweight + c) + sw : sw);
  if (dbias) fy_st(dbias + c, accumulate ? fy_ld(dbias + c) + sb : sb);
}

static fy_status ln_check(const char *what, int64_t C) {
  if (C <= 0 || C > 0x7fffffff)
    return fy_error_set(FY_ERR_INVALID, "cuda %s: C=%lld", what, (long long)C);
  return FY_OK;
}

extern "C" fy_status fy_cuda_layernorm_forward(void *out, float *mean, float *rstd,
                                               const void *inp, const void *weight,
                                               const void *bias, enum fy_dtype dt, int64_t BT,
                                               int64_t C, float eps, cudaStream_t st) {
  FY_TRY(ln_check("layernorm_forward", C));
  if (BT <= 0) return FY_OK;
  unsigned grid = (unsigned)((BT + LN_WARPS - 1) / LN_WARPS);
  const bool vec = C % (16 / (int64_t)fy_dtype_size(dt)) == 0 && fy_aligned16(out, inp, weight, bias, NULL);
  FY_CUDA_DISPATCH("layernorm_forward", dt, T, {
    constexpr int VW = 16 / sizeof(T);
    if (vec)
      layernorm_forward_kernel<T, VW><<<grid, LN_WARPS * 32, 0, st>>>(
          (T *)out, mean, rstd, (const T *)inp, (const T *)weight, (const T *)bias, BT, (int)C, eps);
    else
      layernorm_forward_kernel<T, 1><<<grid, LN_WARPS * 32, 0, st>>>(
          (T *)out, mean, rstd, (const T *)inp, (const T *)weight, (const T *)bias, BT, (int)C, eps);
  });
  return fy_cuda_launched("layernorm_forward");
}

extern "C" fy_status fy_cuda_layernorm_backward_params(void *dweight, void *dbias,
                                                       const void *dout, const void *inp,
                                                       const float *mean, const float *rstd,
                                                       enum fy_dtype dt, int64_t BT, int64_t C,
                                                       bool accumulate, float *scratch,
                                                       cudaStream_t st) {
  FY_TRY(ln_check("layernorm_backward_params", C));
  if (!dweight && !dbias) return FY_OK;
  unsigned grid = (unsigned)((C + 31) / 32);
  if (scratch && BT > 0) {
    dim3 pgrid(grid, FY_CUDA_LN_PARTS);
    unsigned fgrid = (unsigned)((C + 255) / 256);
    FY_CUDA_DISPATCH("layernorm_backward_params", dt, T,
                     layernorm_backward_params_part_kernel<T><<<pgrid, 1024, 0, st>>>(
                         scratch, (const T *)dout, (const T *)inp, mean, rstd, BT, (int)C);
                     layernorm_backward_params_final_kernel<T><<<fgrid, 256, 0, st>>>(
                         (T *)dweight, (T *)dbias, scratch, (int)C, accumulate));
    return fy_cuda_launched("layernorm_backward_params");
  }
  // BT = 0 still runs: with accumulate off the gradients must become zeros.
  FY_CUDA_DISPATCH("layernorm_backward_params", dt, T,
                   layernorm_backward_params_kernel<T><<<grid, 1024, 0, st>>>(
                       (T *)dweight, (T *)dbias, (const T *)dout, (const T *)inp, mean, rstd,
                       BT < 0 ? 0 : BT, (int)C, accumulate));
  return fy_cuda_launched("layernorm_backward_params");
}

extern "C" fy_status fy_cuda_layernorm_backward(void *dinp, void *dweight, void *dbias,
                                                const void *dout, const void *inp,
                                                const void *weight, const float *mean,
                                                const float *rstd, enum fy_dtype dt, int64_t BT,
                                                int64_t C, float *scratch, cudaStream_t st) {
  FY_TRY(ln_check("layernorm_backward", C));
  if (dinp && BT > 0) {
    unsigned grid = (unsigned)((BT + LN_WARPS - 1) / LN_WARPS);
    const bool vec = C % (16 / (int64_t)fy_dtype_size(dt)) == 0 && fy_aligned16(dinp, dout, inp, weight, NULL);
    FY_CUDA_DISPATCH("layernorm_backward", dt, T, {
      constexpr int VW = 16 / sizeof(T);
      if (vec)
        layernorm_backward_input_kernel<T, VW><<<grid, LN_WARPS * 32, 0, st>>>(
            (T *)dinp, (const T *)dout, (const T *)inp, (const T *)weight, mean, rstd, BT, (int)C);
      else
        layernorm_backward_input_kernel<T, 1><<<grid, LN_WARPS * 32, 0, st>>>(
            (T *)dinp, (const T *)dout, (const T *)inp, (const T *)weight, mean, rstd, BT, (int)C);
    });
    FY_TRY(fy_cuda_launched("layernorm_backward"));
  }
  return fy_cuda_layernorm_backward_params(dweight, dbias, dout, inp, mean, rstd, dt, BT, C, true,
                                           scratch, st);
}
