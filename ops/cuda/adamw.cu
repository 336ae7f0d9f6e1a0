// AdamW on fp32 master weights and state, fused in one pass (grad scale, moments, decay, update,
// and optionally the bf16 compute copy), and the deterministic sum of squares for the global norm.
#include <math.h>

#include "ops/cuda/common.cuh"

// param (n), m (n), v (n) fp32, grad (n) -> param, m, v in place; param_bf16 (n) = bf16(param)
// The operations follow fy_adamw_update (ops/cpu/adamw.c) one for one, with the per-step
// constants computed on the host in double as there, so the two differ only by fused
// multiply-adds.
template <typename G>
__global__ void adamw_kernel(float *__restrict__ param, float *__restrict__ m,
                             float *__restrict__ v, const G *__restrict__ grad,
                             fy_bf16 *__restrict__ param_bf16, int64_t n, float decay, float step,
                             float bc2_sqrt, float b1, float b2, float eps, float gs,
                             const float *__restrict__ scale_skip) {
  if (scale_skip) {  // decided after the launch: the scale, and whether to skip the step
    if (scale_skip[1] != 0.0f) return;
    gs = scale_skip[0];
  }
  const float ob1 = 1.0f - b1, ob2 = 1.0f - b2;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float g = fy_ld(grad + i) * gs;
    float mi = b1 * m[i] + ob1 * g;
    float vi = b2 * v[i] + ob2 * g * g;
    m[i] = mi;
    v[i] = vi;
    float p = param[i] * decay;
    p = p - step * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    param[i] = p;
    if (param_bf16) param_bf16[i] = __float2bfloat16_rn(p);
  }
}

static fy_status adamw_launch(float *param, float *m, float *v, const void *grad, enum fy_dtype grad_dt,
                              uint16_t *param_bf16, int64_t n, float lr, float beta1, float beta2,
                              float eps, float weight_decay, int64_t t, float grad_scale,
                              const float *scale_skip, cudaStream_t st) {
  if (n <= 0) return FY_OK;
  if (t < 1) return fy_error_set(FY_ERR_INVALID, "cuda adamw: step %lld (counts from 1)", (long long)t);
  const double bc1 = 1.0 - pow((double)beta1, (double)t);
  const double bc2 = 1.0 - pow((double)beta2, (double)t);
  const float decay = (float)(1.0 - (double)lr * (double)weight_decay);
  const float step = (float)((double)lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  FY_CUDA_DISPATCH("adamw", grad_dt, G,
                   adamw_kernel<G><<<fy_grid(n, 256), 256, 0, st>>>(
                       param, m, v, (const G *)grad, (fy_bf16 *)param_bf16, n, decay, step,
                       bc2_sqrt, beta1, beta2, eps, grad_scale, scale_skip));
  return fy_cuda_launched("adamw");
}

extern "C" fy_status fy_cuda_adamw_update(float *param, float *m, float *v, const void *grad,
                                          enum fy_dtype grad_dt, uint16_t *param_bf16, int64_t n,
                                          float lr, float beta1, float beta2, float eps,
                                          float weight_decay, int64_t t, float grad_scale,
                                          cudaStream_t st) {
  return adamw_launch(param, m, v, grad, grad_dt, param_bf16, n, lr, beta1, beta2, eps,
                      weight_decay, t, grad_scale, NULL, st);
}

extern "C" fy_status fy_cuda_adamw_update_deferred(float *param, float *m, float *v,
                                                   const void *grad, enum fy_dtype grad_dt,
                                                   uint16_t *param_bf16, int64_t n, float lr,
                                                   float beta1, float beta2, float eps,
                                                   float weight_decay, int64_t t,
                                                   const float *scale_skip, cudaStream_t st) {
  if (!scale_skip) return fy_error_set(FY_ERR_INVALID, "cuda adamw: no scale in device memory");
  return adamw_launch(param, m, v, grad, grad_dt, param_bf16, n, lr, beta1, beta2, eps,
                      weight_decay, t, 1.0f, scale_skip, st);
}

#define SUMSQ_THREADS 256

// Fixed shared-memory tree over the block's threads (a power of two) doubles.
__device__ double sumsq_block_tree(double *sh) {
  for (int w = (int)blockDim.x / 2; w > 0; w /= 2) {
    if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  return sh[0];
}

// x (n) -> part (gridDim.x): block b sums elements b*256 + tid + k*gridDim.x*256
template <typename T>
__global__ void __launch_bounds__(SUMSQ_THREADS)
sumsq_partial_kernel(double *part, const T *x, int64_t n) {
  __shared__ double sh[SUMSQ_THREADS];
  double acc = 0.0;
  const int64_t stride = (int64_t)gridDim.x * SUMSQ_THREADS;
  for (int64_t i = (int64_t)blockIdx.x * SUMSQ_THREADS + threadIdx.x; i < n; i += stride) {
    double e = (double)fy_ld(x + i);
    acc += e * e;
  }
  sh[threadIdx.x] = acc;
  __syncthreads();
  double s = sumsq_block_tree(sh);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// part (parts) -> *out (+)= their sum; blockDim.x: a power of two >= parts
__global__ void __launch_bounds__(FY_CUDA_SUMSQ_PARTS)
sumsq_final_kernel(double *out, const double *part, int parts, bool accumulate) {
  __shared__ double sh[FY_CUDA_SUMSQ_PARTS];
  sh[threadIdx.x] = (int)threadIdx.x < parts ? part[threadIdx.x] : 0.0;
  __syncthreads();
  double s = sumsq_block_tree(sh);
  if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

extern "C" fy_status fy_cuda_sumsq(double *out, const void *x, enum fy_dtype dt, int64_t n,
                                   double *scratch, bool accumulate, cudaStream_t st) {
  if (n < 0) n = 0;
  // One block per SUMSQ_THREADS elements, at most FY_CUDA_SUMSQ_PARTS (a bias is one block, not
  // a thousand idle ones), and the final tree over the next power of two: both depend on n alone,
  // so the summation tree, and with it the result's bits, do too (not the GPU model).
  int64_t want = (n + SUMSQ_THREADS - 1) / SUMSQ_THREADS;
  const int parts = want < 1 ? 1 : want > FY_CUDA_SUMSQ_PARTS ? FY_CUDA_SUMSQ_PARTS : (int)want;
  int fthreads = 32;
  while (fthreads < parts) fthreads *= 2;
  FY_CUDA_DISPATCH("sumsq", dt, T,
                   sumsq_partial_kernel<T><<<parts, SUMSQ_THREADS, 0, st>>>(scratch, (const T *)x, n));
  FY_TRY(fy_cuda_launched("sumsq"));
  sumsq_final_kernel<<<1, fthreads, 0, st>>>(out, scratch, parts, accumulate);
  return fy_cuda_launched("sumsq");
}
