// The CUDA kernels' fixed partitions and the scratch they need, in plain C: the cuda engine
// allocates that scratch from the device, and the planner (built without CUDA) counts it in a
// GPU's memory.
#ifndef FY_OPS_CUDA_PARTS_H
#define FY_OPS_CUDA_PARTS_H

#include <stddef.h>
#include <stdint.h>

#include "core/device.h"  // (fy_device_round, FY_CUDA_ALLOC_GRANULE)

// Row ranges layernorm's parameter gradients are split into (fy_cuda_layernorm_backward).
#define FY_CUDA_LN_PARTS 16
// Blocks of the first pass of the sum of squares (fy_cuda_sumsq).
#define FY_CUDA_SUMSQ_PARTS 1024
// The share of a GPU's free memory ferry takes when --device-mem is not given (the rest is left
// for CUDA's own and NCCL's buffers); ferry probe --device cuda reports the same.
#define FY_CUDA_FREE_PERCENT 95
// cuBLASLt's workspace (fy_cuda_blas_create).
#define FY_CUDA_GEMM_WORKSPACE ((size_t)32 << 20)

// The scratch buffers of a model of n_params parameters whose widest op is C: the GEMM workspace,
// an embedding row, the per-parameter sums of squares, their first pass, layernorm's partial
// parameter gradients.
enum { FY_CUDA_SCRATCH_BUFS = 5 };
static inline void fy_cuda_scratch_sizes(size_t bytes[FY_CUDA_SCRATCH_BUFS], int64_t n_params, int64_t C) {
  bytes[0] = FY_CUDA_GEMM_WORKSPACE;
  bytes[1] = (size_t)C * 4;
  bytes[2] = (size_t)(n_params > 0 ? n_params : 1) * sizeof(double);
  bytes[3] = FY_CUDA_SUMSQ_PARTS * sizeof(double);
  bytes[4] = (size_t)(2 * FY_CUDA_LN_PARTS * C) * sizeof(float);
}

// Their total as the device takes them (each rounded up to cudaMalloc's granule).
static inline size_t fy_cuda_scratch_bytes(int64_t n_params, int64_t C) {
  size_t b[FY_CUDA_SCRATCH_BUFS], n = 0;
  fy_cuda_scratch_sizes(b, n_params, C);
  for (int i = 0; i < FY_CUDA_SCRATCH_BUFS; i++) n += fy_device_round(b[i], FY_CUDA_ALLOC_GRANULE);
  return n;
}

#endif
