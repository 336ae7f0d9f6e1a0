// Elementwise kernels: relu, gelu, add, bias add and dropout-add, forward and backward. Memory-bound grid-stride loops; outputs
// may alias inputs (in-place relu, a residual added in place), so nothing is __restrict__ (each
// element, or 16-byte piece, is read and written by one thread).
#include "ops/cuda/common.cuh"
#include "ops/dropout.h"

// Each kernel first walks whole 16-byte pieces (4 floats or 8 bf16: one load or store per tensor
// and piece) when every buffer is 16-byte aligned (nv = N / piece, else 0), then the rest
// element by element.
template <typename T>
struct ew_vec {
  static constexpr int N = 16 / (int)sizeof(T);
};
static __device__ __forceinline__ void ew_ld(float f[4], const float *p) {
  float4 v = *reinterpret_cast<const float4 *>(p);
  f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
}
static __device__ __forceinline__ void ew_st(float *p, const float f[4]) {
  *reinterpret_cast<float4 *>(p) = make_float4(f[0], f[1], f[2], f[3]);
}
static __device__ __forceinline__ void ew_ld(float f[8], const fy_bf16 *p) {
  uint4 v = *reinterpret_cast<const uint4 *>(p);
  const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&v);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    float2 x = __bfloat1622float2(h[k]);
    f[2 * k] = x.x, f[2 * k + 1] = x.y;
  }
}
static __device__ __forceinline__ void ew_st(fy_bf16 *p, const float f[8]) {
  uint4 v;
  __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&v);
#pragma unroll
  for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
  *reinterpret_cast<uint4 *>(p) = v;
}

#define EW_LOOP(i, from, n) \
  for (int64_t i = (from) + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

// inp (N) -> out (N)
template <typename T>
__global__ void relu_forward_kernel(T *out, const T *inp, int64_t N, int64_t nv) {
  constexpr int V = ew_vec<T>::N;
  EW_LOOP(j, 0, nv) {
    float x[V];
    ew_ld(x, inp + j * V);
#pragma unroll
    for (int k = 0; k < V; k++) x[k] = x[k] < 0.0f ? 0.0f : x[k];  // NaN passes, as in PyTorch
    ew_st(out + j * V, x);
  }
  EW_LOOP(i, nv * V, N) {
    float x = fy_ld(inp + i);
    fy_st(out + i, x < 0.0f ? 0.0f : x);  // NaN passes through, as in PyTorch and the CPU kernel
  }
}

// dout (N), out (N) -> dinp (N) +=, or with acc false = (in place: dinp is dout; then dinp is not read first)
template <typename T>
__global__ void relu_backward_kernel(T *dinp, const T *dout, const T *out, int64_t N, int64_t nv, bool acc) {
  constexpr int V = ew_vec<T>::N;
  EW_LOOP(j, 0, nv) {
    float o[V], g[V], d[V];
    ew_ld(o, out + j * V);
    ew_ld(g, dout + j * V);
    if (acc) ew_ld(d, dinp + j * V);
#pragma unroll
    for (int k = 0; k < V; k++) {
      float x = o[k] > 0.0f ? g[k] : 0.0f;
      d[k] = acc ? d[k] + x : x;
    }
    ew_st(dinp + j * V, d);
  }
  EW_LOOP(i, nv * V, N) {
    float x = fy_ld(out + i) > 0.0f ? fy_ld(dout + i) : 0.0f;
    fy_st(dinp + i, acc ? fy_ld(dinp + i) + x : x);
  }
}

// x * Phi(x) and its derivative Phi(x) + x * phi(x): gelu with erf, as PyTorch's default, Phi(x)
// as erfc(-x/sqrt 2)/2 (as the CPU kernel: no cancellation for negative x).
static __device__ __forceinline__ float gelu(float x) { return 0.5f * x * erfcf(x * -0.70710678118654752f); }
static __device__ __forceinline__ float gelu_grad(float x) {
  return 0.5f * erfcf(x * -0.70710678118654752f) + x * 0.3989422804014327f * expf(-0.5f * x * x);
}

// inp (N) -> out (N)
template <typename T>
__global__ void gelu_forward_kernel(T *out, const T *inp, int64_t N, int64_t nv) {
  constexpr int V = ew_vec<T>::N;
  EW_LOOP(j, 0, nv) {
    float x[V];
    ew_ld(x, inp + j * V);
#pragma unroll
    for (int k = 0; k < V; k++) x[k] = gelu(x[k]);
    ew_st(out + j * V, x);
  }
  EW_LOOP(i, nv * V, N) fy_st(out + i, gelu(fy_ld(inp + i)));
}

// dout (N), inp (N) -> dinp (N) +=, or with acc false = (in place: dinp is dout)
template <typename T>
__global__ void gelu_backward_kernel(T *dinp, const T *dout, const T *inp, int64_t N, int64_t nv, bool acc) {
  constexpr int V = ew_vec<T>::N;
  EW_LOOP(j, 0, nv) {
    float x[V], g[V], d[V];
    ew_ld(x, inp + j * V);
    ew_ld(g, dout + j * V);
    if (acc) ew_ld(d, dinp + j * V);
#pragma unroll
    for (int k = 0; k < V; k++) d[k] = acc ? d[k] + g[k] * gelu_grad(x[k]) : g[k] * gelu_grad(x[k]);
    ew_st(dinp + j * V, d);
  }
  EW_LOOP(i, nv * V, N) {
    float y = fy_ld(dout + i) * gelu_grad(fy_ld(inp + i));
    fy_st(dinp + i, acc ? fy_ld(dinp + i) + y : y);
  }
}

// a (N), b (N) -> out (N)
template <typename T>
__global__ void add_forward_kernel(T *out, const T *a, const T *b, int64_t N, int64_t nv) {
  constexpr int V = ew_vec<T>::N;
  EW_LOOP(j, 0, nv) {
    float x[V], y[V];
    ew_ld(x, a + j * V);
    ew_ld(y, b + j * V);
#pragma unroll
    for (int k = 0; k < V; k++) x[k] += y[k];
    ew_st(out + j * V, x);
  }
  EW_LOOP(i, nv * V, N) fy_st(out + i, fy_ld(a + i) + fy_ld(b + i));
}

// dout (N) -> da (N) +=, db (N) += (either may be NULL)
template <typename T>
__global__ void add_backward_kernel(T *da, T *db, const T *dout, int64_t N, int64_t nv) {
  constexpr int V = ew_vec<T>::N;
  EW_LOOP(j, 0, nv) {
    float g[V], x[V];
    ew_ld(g, dout + j * V);
    if (da) {
      ew_ld(x, da + j * V);
#pragma unroll
      for (int k = 0; k < V; k++) x[k] += g[k];
      ew_st(da + j * V, x);
    }
    if (db) {
      ew_ld(x, db + j * V);
#pragma unroll
      for (int k = 0; k < V; k++) x[k] += g[k];
      ew_st(db + j * V, x);
    }
  }
  EW_LOOP(i, nv * V, N) {
    float g = fy_ld(dout + i);
    if (da) fy_st(da + i, fy_ld(da + i) + g);
    if (db) fy_st(db + i, fy_ld(db + i) + g);
  }
}

// Whole 16-byte pieces of N elements of size es when every given pointer is 16-byte aligned, else 0.
static int64_t ew_pieces(int64_t N, size_t es, const void *a, const void *b, const void *c) {
  if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 != 0) return 0;
  return N / (int64_t)(16 / es);
}
// Blocks for the pieces (or, without them, the elements).
static unsigned ew_grid(int64_t N, int64_t nv) { return fy_grid(nv > 0 ? nv : N, 256); }

extern "C" fy_status fy_cuda_relu_forward(void *out, const void *inp, enum fy_dtype dt, int64_t N,
                                          cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("relu_forward", dt, T, {
    int64_t nv = ew_pieces(N, sizeof(T), out, inp, NULL);
    relu_forward_kernel<T><<<ew_grid(N, nv), 256, 0, st>>>((T *)out, (const T *)inp, N, nv);
  });
  return fy_cuda_launched("relu_forward");
}

extern "C" fy_status fy_cuda_relu_backward(void *dinp, const void *dout, const void *out,
                                           enum fy_dtype dt, int64_t N, cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("relu_backward", dt, T, {
    int64_t nv = ew_pieces(N, sizeof(T), dinp, dout, out);
    relu_backward_kernel<T><<<ew_grid(N, nv), 256, 0, st>>>((T *)dinp, (const T *)dout, (const T *)out, N, nv,
                                                            dinp != dout);
  });
  return fy_cuda_launched("relu_backward");
}

extern "C" fy_status fy_cuda_gelu_forward(void *out, const void *inp, enum fy_dtype dt, int64_t N,
                                          cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("gelu_forward", dt, T, {
    int64_t nv = ew_pieces(N, sizeof(T), out, inp, NULL);
    gelu_forward_kernel<T><<<ew_grid(N, nv), 256, 0, st>>>((T *)out, (const T *)inp, N, nv);
  });
  return fy_cuda_launched("gelu_forward");
}

extern "C" fy_status fy_cuda_gelu_backward(void *dinp, const void *dout, const void *inp,
                                           enum fy_dtype dt, int64_t N, cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("gelu_backward", dt, T, {
    int64_t nv = ew_pieces(N, sizeof(T), dinp, dout, inp);
    gelu_backward_kernel<T><<<ew_grid(N, nv), 256, 0, st>>>((T *)dinp, (const T *)dout, (const T *)inp, N, nv,
                                                            dinp != dout);
  });
  return fy_cuda_launched("gelu_backward");
}

extern "C" fy_status fy_cuda_add_forward(void *out, const void *a, const void *b, enum fy_dtype dt,
                                         int64_t N, cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("add_forward", dt, T, {
    int64_t nv = ew_pieces(N, sizeof(T), out, a, b);
    add_forward_kernel<T><<<ew_grid(N, nv), 256, 0, st>>>((T *)out, (const T *)a, (const T *)b, N, nv);
  });
  return fy_cuda_launched("add_forward");
}

extern "C" fy_status fy_cuda_add_backward(void *da, void *db, const void *dout, enum fy_dtype dt,
                                          int64_t N, cudaStream_t st) {
  if (N <= 0 || (!da && !db)) return FY_OK;
  FY_CUDA_DISPATCH("add_backward", dt, T, {
    int64_t nv = ew_pieces(N, sizeof(T), da, db, dout);
    add_backward_kernel<T><<<ew_grid(N, nv), 256, 0, st>>>((T *)da, (T *)db, (const T *)dout, N, nv);
  });
  return fy_cuda_launched("add_backward");
}

// bias (C) -> out (rows,C) += bias, then max(., 0) with relu. Whole pieces when C is a multiple of
// one (and both buffers aligned: a piece then never crosses a row), else element by element.
template <typename T>
__global__ void bias_add_kernel(T *out, const T *bias, int64_t rows, int64_t C, bool vec, bool relu) {
  constexpr int V = ew_vec<T>::N;
  if (vec) {
    const int64_t cv = C / V;
    EW_LOOP(j, 0, rows * cv) {
      float x[V], b[V];
      ew_ld(x, out + j * V);
      ew_ld(b, bias + (j % cv) * V);
#pragma unroll
      for (int k = 0; k < V; k++) {
        x[k] += b[k];
        if (relu && x[k] < 0.0f) x[k] = 0.0f;  // NaN passes, as in relu_forward_kernel
      }
      ew_st(out + j * V, x);
    }
    return;
  }
  EW_LOOP(i, 0, rows * C) {
    const float x = fy_ld(out + i) + fy_ld(bias + i % C);
    fy_st(out + i, relu && x < 0.0f ? 0.0f : x);
  }
}

extern "C" fy_status fy_cuda_bias_add_relu(void *out, const void *bias, bool relu, enum fy_dtype dt, int64_t rows,
                                           int64_t C, cudaStream_t st) {
  if (rows <= 0 || C <= 0) return FY_OK;
  FY_CUDA_DISPATCH("bias_add", dt, T, {
    constexpr int V = ew_vec<T>::N;
    const bool vec = C % V == 0 && ((uintptr_t)out | (uintptr_t)bias) % 16 == 0;
    const int64_t N = rows * C;
    bias_add_kernel<T><<<ew_grid(N, vec ? N / V : 0), 256, 0, st>>>((T *)out, (const T *)bias, rows, C, vec, relu);
  });
  return fy_cuda_launched("bias_add");
}

extern "C" fy_status fy_cuda_bias_add(void *out, const void *bias, enum fy_dtype dt, int64_t rows, int64_t C,
                                      cudaStream_t st) {
  return fy_cuda_bias_add_relu(out, bias, false, dt, rows, C, st);
}

// base (rows,C), src (rows,C) -> dst (rows,C) = base + src * keep / (1 - p), row r being token
// u0 + r (ops/dropout.h). The dropout-add's forward (dst the output, base the residual, src the
// branch) and its branch gradient (dst = base = the gradient, src = dout). A block walks rows, its
// threads a row's columns in pieces of VW (one token hash per thread and row, no division).
template <typename T, int VW>
__global__ void dropout_add_kernel(T *dst, const T *base, const T *src, int64_t rows, int64_t C, uint64_t key,
                                   int64_t u0, uint32_t thr, float s) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint64_t tk = fy_dropout_token(key, u0 + r);
    const int64_t o = r * C;
    for (int64_t j = (int64_t)threadIdx.x * VW; j < C; j += (int64_t)blockDim.x * VW) {
      float x[VW], y[VW];
      fy_ldv<T, VW>(x, base + o + j);
      fy_ldv<T, VW>(y, src + o + j);
#pragma unroll
      for (int k = 0; k < VW; k++) x[k] += fy_dropout_draw(tk, j + k) >= thr ? y[k] * s : 0.0f;
      fy_stv<T, VW>(dst + o + j, x);
    }
  }
}

static fy_status dropout_add(const char *what, void *dst, const void *base, const void *src, enum fy_dtype dt,
                             int64_t rows, int64_t C, uint64_t key, int64_t u0, float p, cudaStream_t st) {
  if (rows <= 0 || C <= 0) return FY_OK;
  const uint32_t thr = fy_dropout_threshold(p);
  const float s = fy_dropout_scale(p);
  const unsigned grid = (unsigned)(rows < 8192 ? rows : 8192);
  FY_CUDA_DISPATCH(what, dt, T, {
    constexpr int VW = 16 / (int)sizeof(T);
    if (C % VW == 0 && fy_aligned16(dst, base, src, NULL, NULL))
      dropout_add_kernel<T, VW><<<grid, 256, 0, st>>>((T *)dst, (const T *)base, (const T *)src, rows, C, key, u0,
                                                       thr, s);
    else
      dropout_add_kernel<T, 1><<<grid, 256, 0, st>>>((T *)dst, (const T *)base, (const T *)src, rows, C, key, u0,
                                                      thr, s);
  });
  return fy_cuda_launched(what);
}

extern "C" fy_status fy_cuda_dropout_add_forward(void *out, const void *a, const void *b, enum fy_dtype dt,
                                                 int64_t rows, int64_t C, uint64_t key, int64_t u0, float p,
                                                 cudaStream_t st) {
  return dropout_add("dropout_add_forward", out, a, b, dt, rows, C, key, u0, p, st);
}

extern "C" fy_status fy_cuda_dropout_add_backward(void *da, void *db, const void *dout, enum fy_dtype dt,
                                                  int64_t rows, int64_t C, uint64_t key, int64_t u0, float p,
                                                  cudaStream_t st) {
  if (da) FY_TRY(fy_cuda_add_backward(da, NULL, dout, dt, rows * C, st));
  return db ? dropout_add("dropout_add_backward", db, db, dout, dt, rows, C, key, u0, p, st) : FY_OK;
}

// src (N) -> dst (N) fp32 = float(src) (first) or dst + float(src): a sum of gradients over
// micro-batches, widened from the compute dtype on the way (the same bits as widening first)
template <typename S>
__global__ void accumulate_kernel(float *dst, const S *src, int64_t N, bool first) {
  EW_LOOP(i, 0, N) {
    float x = fy_ld(src + i);
    dst[i] = first ? x : dst[i] + x;
  }
}

extern "C" fy_status fy_cuda_accumulate(float *dst, const void *src, enum fy_dtype src_dt, int64_t N, bool first,
                                        cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("accumulate", src_dt, S,
                   accumulate_kernel<S><<<fy_grid(N, 256), 256, 0, st>>>(dst, (const S *)src, N, first));
  return fy_cuda_launched("accumulate");
}

// src (N) of one float type -> dst (N) of another (round to nearest even into bf16)
template <typename D, typename S>
__global__ void convert_kernel(D *dst, const S *src, int64_t N) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x)
    fy_st(dst + i, fy_ld(src + i));
}

extern "C" fy_status fy_cuda_convert(void *dst, enum fy_dtype dst_dt, const void *src, enum fy_dtype src_dt,
                                     int64_t N, cudaStream_t st) {
  if (N <= 0) return FY_OK;
  if (dst_dt == src_dt) {
    size_t bytes = (size_t)N * (dst_dt == FY_F32 ? 4 : 2);
    if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st) != cudaSuccess)
      return fy_error_set(FY_ERR_INTERNAL, "convert: cudaMemcpyAsync: %s", cudaGetErrorString(cudaGetLastError()));
    return FY_OK;
  }
  if (dst_dt == FY_BF16 && src_dt == FY_F32)
    convert_kernel<fy_bf16, float><<<fy_grid(N, 256), 256, 0, st>>>((fy_bf16 *)dst, (const float *)src, N);
  else if (dst_dt == FY_F32 && src_dt == FY_BF16)
    convert_kernel<float, fy_bf16><<<fy_grid(N, 256), 256, 0, st>>>((float *)dst, (const fy_bf16 *)src, N);
  else
    return fy_error_set(FY_ERR_UNSUPPORTED, "convert: %s to %s", fy_dtype_name(src_dt), fy_dtype_name(dst_dt));
  return fy_cuda_launched("convert");
}
