// Elementwise kernels: relu and add, forward and backward. Memory-bound grid-stride loops; outputs
// may alias inputs (in-place relu, a residual added in place), so nothing is __restrict__.
#include "ops/cuda/common.cuh"

// inp (N) -> out (N)
template <typename T>
__global__ void relu_forward_kernel(T *out, const T *inp, int64_t N) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x) {
    float x = fy_ld(inp + i);
    fy_st(out + i, x < 0.0f ? 0.0f : x);  // NaN passes through, as in PyTorch and the CPU kernel
  }
}

// dout (N), out (N) -> dinp (N) +=
template <typename T>
__global__ void relu_backward_kernel(T *dinp, const T *dout, const T *out, int64_t N) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x)
    if (fy_ld(out + i) > 0.0f) fy_st(dinp + i, fy_ld(dinp + i) + fy_ld(dout + i));
}

// a (N), b (N) -> out (N)
template <typename T>
__global__ void add_forward_kernel(T *out, const T *a, const T *b, int64_t N) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x)
    fy_st(out + i, fy_ld(a + i) + fy_ld(b + i));
}

// dout (N) -> da (N) +=, db (N) += (either may be NULL)
template <typename T>
__global__ void add_backward_kernel(T *da, T *db, const T *dout, int64_t N) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N;
       i += (int64_t)gridDim.x * blockDim.x) {
    float g = fy_ld(dout + i);
    if (da) fy_st(da + i, fy_ld(da + i) + g);
    if (db) fy_st(db + i, fy_ld(db + i) + g);
  }
}

extern "C" fy_status fy_cuda_relu_forward(void *out, const void *inp, enum fy_dtype dt, int64_t N,
                                          cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("relu_forward", dt, T,
                   relu_forward_kernel<T><<<fy_grid(N, 256), 256, 0, st>>>((T *)out, (const T *)inp, N));
  return fy_cuda_launched("relu_forward");
}

extern "C" fy_status fy_cuda_relu_backward(void *dinp, const void *dout, const void *out,
                                           enum fy_dtype dt, int64_t N, cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("relu_backward", dt, T,
                   relu_backward_kernel<T><<<fy_grid(N, 256), 256, 0, st>>>(
                       (T *)dinp, (const T *)dout, (const T *)out, N));
  return fy_cuda_launched("relu_backward");
}

extern "C" fy_status fy_cuda_add_forward(void *out, const void *a, const void *b, enum fy_dtype dt,
                                         int64_t N, cudaStream_t st) {
  if (N <= 0) return FY_OK;
  FY_CUDA_DISPATCH("add_forward", dt, T,
                   add_forward_kernel<T><<<fy_grid(N, 256), 256, 0, st>>>(
                       (T *)out, (const T *)a, (const T *)b, N));
  return fy_cuda_launched("add_forward");
}

extern "C" fy_status fy_cuda_add_backward(void *da, void *db, const void *dout, enum fy_dtype dt,
                                          int64_t N, cudaStream_t st) {
  if (N <= 0 || (!da && !db)) return FY_OK;
  FY_CUDA_DISPATCH("add_backward", dt, T,
                   add_backward_kernel<T><<<fy_grid(N, 256), 256, 0, st>>>(
                       (T *)da, (T *)db, (const T *)dout, N));
  return fy_cuda_launched("add_backward");
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
