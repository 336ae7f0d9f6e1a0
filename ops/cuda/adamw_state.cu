// AdamW with m and v stored in bf16 or block-wise 8-bit on the GPU: the CPU kernels of
// ops/cpu/adamw_state.c (ops/ops.h "AdamW with compressed state") to the last bit and the last
// code. Every float operation is an explicit round-to-nearest intrinsic, so that nvcc does not
// fuse a multiply and an add (it does by default, -fmad=true) where the CPU rounds twice;
// nvcc's default division and sqrtf are IEEE (no -use_fast_math, -prec-div and -prec-sqrt
// default to true), and the intrinsics say so in the code as well.
#include <math.h>
#include <string.h>

#include "ops/cuda/common.cuh"

#ifdef FY_CUDA_EMU
// The emulator compiles this as ISO C++ (-std=c++17: no contraction), so plain operators round
// each operation as the intrinsics do.
static inline float rn_add(float a, float b) { return a + b; }
static inline float rn_sub(float a, float b) { return a - b; }
static inline float rn_mul(float a, float b) { return a * b; }
static inline float rn_div(float a, float b) { return a / b; }
static inline float rn_sqrt(float a) { return sqrtf(a); }
static inline double rn_dmul(double a, double b) { return a * b; }
static inline double rn_dsub(double a, double b) { return a - b; }
#else
#define rn_add __fadd_rn
#define rn_sub __fsub_rn
#define rn_mul __fmul_rn
#define rn_div __fdiv_rn
#define rn_sqrt __fsqrt_rn
#define rn_dmul __dmul_rn
#define rn_dsub __dsub_rn
#endif

#define QB FY_Q8_BLOCK  // threads of the 8-bit kernel's block: one element each

struct step_k {
  float lr, step, bc2_sqrt, b1, b2, ob1, ob2, eps, gs;
};

// The range holding element i (ranges sorted and disjoint), or -1.
__device__ __forceinline__ int range_of(const struct fy_adamw_range *r, int nr, int64_t i) {
  int lo = 0, hi = nr;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (r[mid].off + r[mid].n > i) hi = mid;
    else lo = mid + 1;
  }
  return lo < nr && r[lo].off <= i ? lo : -1;
}

// The AdamW element of ops/cpu/adamw.c, operation for operation: mo, vo the moments read back,
// g the widened gradient -> *mi, *vi, the new weight
__device__ __forceinline__ float adamw_elem(float p, float mo, float vo, float g, float decay, const step_k &k,
                                            float *mi, float *vi) {
  g = rn_mul(g, k.gs);
  *mi = rn_add(rn_mul(k.b1, mo), rn_mul(k.ob1, g));
  *vi = rn_add(rn_mul(k.b2, vo), rn_mul(rn_mul(k.ob2, g), g));
  p = rn_mul(p, decay);
  return rn_sub(p, rn_mul(k.step, rn_div(*mi, rn_add(rn_div(rn_sqrt(*vi), k.bc2_sqrt), k.eps))));
}

// (float)(1 - (double)lr * wd), as the CPU computes it
__device__ __forceinline__ float range_decay(float lr, float wd) {
  return (float)rn_dsub(1.0, rn_dmul((double)lr, (double)wd));
}

// The 8-bit codes of ops/cpu/adamw_state.c (ops/ops.h): magnitude k = 8 e + f, value f 2^-S
// (e = 0) or (8 + f) 2^(e-1-S); S = 17 for m, 33 for v.
#define S_M 17
#define S_V 33

__device__ __forceinline__ uint32_t q8_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

__device__ __forceinline__ float q8_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// r in [0, 1 + 2^-23] -> the nearest magnitude, ties to even (ops/cpu/adamw_state.c q8_mag):
// the float sum 2^(E+20) + r, E r's binade clamped to 3 - S, rounds r to the step 2^(E-3).
__device__ __forceinline__ uint32_t q8_mag(float r, int S) {
  const uint32_t emin = (uint32_t)(130 - S) << 23, e0 = q8_bits(r) & 0x7f800000u;
  const uint32_t e = e0 > emin ? e0 : emin;
  const uint32_t magic = e + (20u << 23);
  return q8_bits(rn_add(r, q8_float(magic))) - magic + ((e - emin) >> 20);
}

// k -> its value: k << 20 as float bits (a float32 subnormal for k < 8) times 2^(129-S), exact.
__device__ __forceinline__ float q8_val(uint32_t k, int S) {
  return rn_mul(q8_float(k << 20), q8_float((uint32_t)(256 - S) << 23));
}

__device__ __forceinline__ float q8_val_m(int8_t c) {
  const int32_t s = c;
  const float a = q8_val((uint32_t)(s < 0 ? -s : s), S_M);
  return q8_float(q8_bits(a) | ((uint32_t)s & 0x80000000u));
}

// The block's largest |x| (NaN and infinities as +inf), on every thread; red holds QB / 32 floats.
__device__ __forceinline__ float block_absmax(float x, float *red) {
  float a = fabsf(x);
  a = a <= 3.402823466e38f ? a : INFINITY;
  a = fy_warp_max(a);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = a;
  __syncthreads();
  float b = red[0];
  for (int w = 1; w < QB / 32; w++) b = fmaxf(b, red[w]);
  return b;
}

// param (n), m and v 8-bit buffers (ops/ops.h layout), grad (n) of type G -> updated; p16 (n) the
// new weights in bf16 when not NULL (may be grad itself: each thread reads its gradient first).
// One thread block a quantisation block, one thread an element.
template <typename G>
__global__ void __launch_bounds__(QB)
adamw_q8_kernel(float *__restrict__ param, int8_t *cm, uint8_t *cv, float *sm, float *sv, const G *grad,
                fy_bf16 *p16, int64_t n, const struct fy_adamw_range *__restrict__ r, int nr, step_k k,
                const float *__restrict__ scale_skip) {
  __shared__ float red[2][QB / 32];
  if (scale_skip) {
    if (scale_skip[1] != 0.0f) return;  // the same on every thread: no barrier is left waiting
    k.gs = scale_skip[0];
  }
  const int64_t b = blockIdx.x, i = b * QB + threadIdx.x;
  const bool in = i < n;
  float mi = 0.0f, vi = 0.0f;
  if (in) {
    const float mo = rn_mul(q8_val_m(cm[i]), sm[b]), vo = rn_mul(q8_val(cv[i], S_V), sv[b]);
    const int ri = range_of(r, nr, i);
    if (ri >= 0) {
      const float p = adamw_elem(param[i], mo, vo, fy_ld(grad + i), range_decay(k.lr, r[ri].weight_decay), k, &mi, &vi);
      param[i] = p;
      if (p16) p16[i] = __float2bfloat16_rn(p);
    } else {
      mi = mo;
      vi = vo;
    }
  }
  const float am = block_absmax(mi, red[0]), av = block_absmax(vi, red[1]);
  __syncthreads();  // every thread has read the old scales and codes
  const bool bad_m = !(am <= 3.402823466e38f), bad_v = !(av <= 3.402823466e38f);
  if (threadIdx.x == 0) {
    sm[b] = bad_m ? NAN : am;
    sv[b] = bad_v ? NAN : av;
  }
  if (!in) return;
  // The ratio r = |x| * (1 / absmax), both rounded, as if float's exponent had no bounds: a block
  // whose absmax is subnormal or >= 2^126 scales its values by adj = 2^64 or 2^-64 first (exact),
  // as the CPU does.
  int km = 0, kv = 0;
  if (!bad_m && am > 0.0f) {
    const uint32_t ab = q8_bits(am);
    const float adj = ab < 0x00800000u ? 0x1p64f : ab >= (253u << 23) ? 0x1p-64f : 1.0f;
    const float inv = rn_div(1.0f, rn_mul(am, adj));
    km = (int)q8_mag(rn_mul(fabsf(rn_mul(mi, adj)), inv), S_M);
    km = mi < 0.0f ? -km : km;
  }
  if (!bad_v && av > 0.0f && vi > 0.0f) {
    const uint32_t ab = q8_bits(av);
    const float adj = ab < 0x00800000u ? 0x1p64f : ab >= (253u << 23) ? 0x1p-64f : 1.0f;
    const float inv = rn_div(1.0f, rn_mul(av, adj));
    kv = (int)q8_mag(rn_mul(rn_mul(vi, adj), inv), S_V);
    kv += kv == 0;
  }
  cm[i] = (int8_t)km;
  cv[i] = (uint8_t)kv;
}

// The same with bf16 m and v: elementwise, grid-stride.
template <typename G>
__global__ void adamw_bf16_state_kernel(float *__restrict__ param, fy_bf16 *__restrict__ m, fy_bf16 *__restrict__ v,
                                        const G *grad, fy_bf16 *p16, int64_t n,
                                        const struct fy_adamw_range *__restrict__ r, int nr, step_k k,
                                        const float *__restrict__ scale_skip) {
  if (scale_skip) {
    if (scale_skip[1] != 0.0f) return;
    k.gs = scale_skip[0];
  }
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int ri = range_of(r, nr, i);
    if (ri < 0) continue;
    float mi, vi;
    const float p = adamw_elem(param[i], __bfloat162float(m[i]), __bfloat162float(v[i]), fy_ld(grad + i),
                               range_decay(k.lr, r[ri].weight_decay), k, &mi, &vi);
    m[i] = __float2bfloat16_rn(mi);
    v[i] = __float2bfloat16_rn(vi);
    param[i] = p;
    if (p16) p16[i] = __float2bfloat16_rn(p);
  }
}

extern "C" fy_status fy_cuda_adamw_state_update(enum fy_state_format f, float *param, void *m, void *v,
                                                const void *grad, enum fy_dtype grad_dt, uint16_t *param_bf16,
                                                int64_t n, const struct fy_adamw_range *ranges, int n_ranges,
                                                float lr, float beta1, float beta2, float eps, int64_t t,
                                                float grad_scale, const float *scale_skip, cudaStream_t st) {
  if (f != FY_STATE_BF16 && f != FY_STATE_Q8)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda adamw state: format %s (fp32 state: fy_cuda_adamw_update)",
                        fy_state_format_name(f));
  if (t < 1) return fy_error_set(FY_ERR_INVALID, "cuda adamw state: step %lld (counts from 1)", (long long)t);
  if (n <= 0 || n_ranges <= 0) return FY_OK;
  if (!ranges) return fy_error_set(FY_ERR_INVALID, "cuda adamw state: %d ranges at NULL", n_ranges);
  const double bc1 = 1.0 - pow((double)beta1, (double)t);
  const double bc2 = 1.0 - pow((double)beta2, (double)t);
  const step_k k = {lr, (float)((double)lr / bc1), (float)sqrt(bc2), beta1, beta2, 1.0f - beta1, 1.0f - beta2, eps,
                    grad_scale};
  if (f == FY_STATE_BF16) {
    FY_CUDA_DISPATCH("adamw state", grad_dt, G,
                     adamw_bf16_state_kernel<G><<<fy_grid(n, 256), 256, 0, st>>>(
                         param, (fy_bf16 *)m, (fy_bf16 *)v, (const G *)grad, (fy_bf16 *)param_bf16, n, ranges,
                         n_ranges, k, scale_skip));
    return fy_cuda_launched("adamw bf16 state");
  }
  const int64_t nb = fy_q8_blocks(n);
  float *sm = (float *)((char *)m + fy_q8_scales_offset(n)), *sv = (float *)((char *)v + fy_q8_scales_offset(n));
  FY_CUDA_DISPATCH("adamw state", grad_dt, G,
                   adamw_q8_kernel<G><<<(unsigned)nb, QB, 0, st>>>(
                       param, (int8_t *)m, (uint8_t *)v, sm, sv, (const G *)grad, (fy_bf16 *)param_bf16, n, ranges,
                       n_ranges, k, scale_skip));
  return fy_cuda_launched("adamw 8-bit state");
}
