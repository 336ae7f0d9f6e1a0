// Softmax cross-entropy over the vocabulary, one row per block. The row's maximum and sum of
// exponentials come from one online pass (each thread keeps a running max m and a sum s rescaled
// whenever m grows, as in flash attention), so a row is read once for its statistics and the
// probabilities are never stored: backward recomputes each one from the logit and the row's
// log-sum-exp as it writes the gradient.
#include "ops/cuda/common.cuh"

#define CE_THREADS 512

// Merges two (max, sum of exp(x - max)) pairs. A side with no elements has max -inf and sum 0.
__device__ __forceinline__ void ce_merge(float &m, float &s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

// The row's log(sum(exp(x))), reduced in a fixed tree (warp butterflies, then warp 0 over the
// warps' results), so every thread gets the same bits on every run.
template <typename T>
__device__ float ce_row_lse(const T *x, int64_t V) {
  __shared__ float sm[32], ss[32];
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    float v = fy_ld(x + j);
    if (v > m) {
      s = (m == -INFINITY ? 0.0f : s * expf(m - v)) + 1.0f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    ce_merge(m, s, m2, s2);
  }
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < nw ? sm[lane] : -INFINITY;
    s = lane < nw ? ss[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) {
      float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      ce_merge(m, s, m2, s2);
    }
    if (lane == 0) {
      sm[0] = m;
      ss[0] = s;
    }
  }
  __syncthreads();
  float lse = sm[0] + logf(ss[0]);
  __syncthreads();  // sm/ss may be reused by a next call in the same block
  return lse;
}

// logits (BT,V), targets (BT) -> losses (BT), lse (BT)
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
crossentropy_forward_kernel(float *losses, float *lse, const T *logits, const int32_t *targets,
                            int64_t BT, int64_t V) {
  for (int64_t i = blockIdx.x; i < BT; i += gridDim.x) {
    int32_t t = targets[i];
    if (t == -100) {  // uniform across the block: no thread reaches the barriers below
      if (threadIdx.x == 0) {
        losses[i] = 0.0f;
        if (lse) lse[i] = 0.0f;
      }
      continue;
    }
    const T *x = logits + i * V;
    float l = ce_row_lse(x, V);
    if (threadIdx.x == 0) {
      losses[i] = l - fy_ld(x + t);
      if (lse) lse[i] = l;
    }
  }
}

// logits (BT,V), targets (BT), lse (BT) or NULL -> dlogits (BT,V) = dloss * (softmax - onehot)
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
crossentropy_backward_kernel(T *dlogits, const T *logits, const int32_t *targets,
                             const float *lse, int64_t BT, int64_t V, float dloss) {
  for (int64_t i = blockIdx.x; i < BT; i += gridDim.x) {
    const T *x = logits + i * V;
    T *d = dlogits + i * V;
    int32_t t = targets[i];
    if (t == -100) {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) fy_st(d + j, 0.0f);
      continue;
    }
    float l = lse ? lse[i] : ce_row_lse(x, V);
    // Each element is read before it is written by the same thread, so d == x is safe.
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float p = expf(fy_ld(x + j) - l);
      fy_st(d + j, dloss * p - (j == t ? dloss : 0.0f));
    }
  }
}

static unsigned ce_grid(int64_t BT) { return (unsigned)(BT < 65536 ? BT : 65536); }

extern "C" fy_status fy_cuda_crossentropy_forward(float *losses, float *lse, const void *logits,
                                                  const int32_t *targets, enum fy_dtype dt,
                                                  int64_t BT, int64_t V, cudaStream_t st) {
  if (BT <= 0) return FY_OK;
  if (V <= 0) return fy_error_set(FY_ERR_INVALID, "cuda crossentropy_forward: V=%lld", (long long)V);
  FY_CUDA_DISPATCH("crossentropy_forward", dt, T,
                   crossentropy_forward_kernel<T><<<ce_grid(BT), CE_THREADS, 0, st>>>(
                       losses, lse, (const T *)logits, targets, BT, V));
  return fy_cuda_launched("crossentropy_forward");
}

extern "C" fy_status fy_cuda_crossentropy_backward(void *dlogits, const void *logits,
                                                   const int32_t *targets, const float *lse,
                                                   enum fy_dtype dt, int64_t BT, int64_t V,
                                                   float dloss, cudaStream_t st) {
  if (BT <= 0) return FY_OK;
  if (V <= 0) return fy_error_set(FY_ERR_INVALID, "cuda crossentropy_backward: V=%lld", (long long)V);
  FY_CUDA_DISPATCH("crossentropy_backward", dt, T,
                   crossentropy_backward_kernel<T><<<ce_grid(BT), CE_THREADS, 0, st>>>(
                       (T *)dlogits, (const T *)logits, targets, lse, BT, V, dloss));
  return fy_cuda_launched("crossentropy_backward");
}
