// Helpers shared by the .cu files: element loads and stores in fp32 whatever the storage type,
// warp reductions, launch checks and the dtype dispatch. Device code only; not part of the C API.
#ifndef FY_OPS_CUDA_COMMON_CUH
#define FY_OPS_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "ops/cuda/ops_cuda.h"

typedef __nv_bfloat16 fy_bf16;

// Arithmetic is fp32 for every storage type: a load widens, a store rounds (to nearest even).
__device__ __forceinline__ float fy_ld(const float *p) { return *p; }
__device__ __forceinline__ float fy_ld(const fy_bf16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void fy_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void fy_st(fy_bf16 *p, float v) { *p = __float2bfloat16_rn(v); }

// VW consecutive elements at p as floats, and back: one 16-byte access when VW > 1 (p aligned to
// 16 bytes, VW * sizeof(T) == 16), the element itself when VW == 1.
template <typename T, int VW>
__device__ __forceinline__ void fy_ldv(float *f, const T *p) {
  if constexpr (VW == 1) {
    f[0] = fy_ld(p);
  } else {
    static_assert(VW * sizeof(T) == 16, "16-byte pieces");
    const uint4 raw = *reinterpret_cast<const uint4 *>(p);
    const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
    for (int i = 0; i < VW; i++) f[i] = fy_ld(e + i);
  }
}
template <typename T, int VW>
__device__ __forceinline__ void fy_stv(T *p, const float *f) {
  if constexpr (VW == 1) {
    fy_st(p, f[0]);
  } else {
    static_assert(VW * sizeof(T) == 16, "16-byte pieces");
    uint4 raw;
    T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
    for (int i = 0; i < VW; i++) fy_st(e + i, f[i]);
    *reinterpret_cast<uint4 *>(p) = raw;
  }
}

// Whether every non-NULL pointer is 16-byte aligned (for fy_ldv and fy_stv).
static inline bool fy_aligned16(const void *a, const void *b, const void *c, const void *d, const void *e) {
  return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e) & 15) == 0;
}

// Butterfly reductions: every lane ends with the result, and the order of additions is fixed.
__device__ __forceinline__ float fy_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float fy_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Grid-stride kernels take at most this many blocks: enough to fill any current GPU, and the loop
// covers the rest.
static inline unsigned fy_grid(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return (unsigned)(b < 65536 ? b : 65536);
}

// A launch error (bad configuration, missing kernel image for this GPU) shows up here; errors of
// kernels that already ran show up at the next synchronisation.
static inline fy_status fy_cuda_launched(const char *what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fy_error_set(FY_ERR_INTERNAL, "cuda: %s: %s", what, cudaGetErrorString(e));
  return FY_OK;
}

static inline fy_status fy_cuda_bad_dtype(const char *what, enum fy_dtype dt) {
  return fy_error_set(FY_ERR_UNSUPPORTED, "cuda %s: dtype %s (f32 and bf16 only)", what,
                      fy_dtype_name(dt));
}

// Runs the statement with T the storage type of dt (float or fy_bf16).
#define FY_CUDA_DISPATCH(what, dt, T, ...)                    \
  switch (dt) {                                               \
    case FY_F32: { typedef float T; __VA_ARGS__; } break;     \
    case FY_BF16: { typedef fy_bf16 T; __VA_ARGS__; } break;  \
    default: return fy_cuda_bad_dtype(what, dt);              \
  }

#endif
