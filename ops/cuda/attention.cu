// Causal multi-head attention, flash style: scores live only in a 64 x 64 tile in shared memory,
// never as a T x T matrix. Forward keeps, per query, a running maximum and sum (online softmax)
// and rescales its output accumulator when the maximum grows; it saves the log-sum-exp of each
// query's scores, from which backward recomputes every probability exactly.
//
// Work split (256 threads, one (batch, head) and one 64-row tile per block):
// - score tile S = Q K^T: thread (ty, tx) = (tid/16, tid%16) computes rows ty+16i, columns tx+16j
//   (i, j < 4), so a warp reads 2 rows of Q (broadcast) and 16 rows of K; row strides in shared
//   memory are odd (HSP = HS|1), so those 16 rows fall in distinct banks;
// - per-row work (softmax, output accumulator): thread tid owns row tid/4 and every 4th column
//   starting at tid%4, so the 4 threads of a row are adjacent lanes and reduce with 2 shuffles.
// Arithmetic is fp32 with expf/logf; bf16 inputs are widened as tiles are loaded.
//
// Backward runs the softmax gradient dS = P * (dP - D), with D = rowsum(dO * O) precomputed per
// query, in two kernels so that nothing is added with atomics: kernel "kv" owns a key tile and
// walks the query tiles at and after it, accumulating dK and dV in registers; kernel "q" owns a
// query tile and walks the key tiles at and before it, accumulating dQ. Each recomputes P and dP
// (twice the score work of an atomic version, and deterministic).
//
// These fp32-arithmetic kernels take every call the tensor-core ones cannot: fp32, and bf16 with a
// head size that is not a multiple of 16, on a GPU before sm_80 or on unaligned buffers (tc_usable).
// The bf16 tensor-core kernels are apart: what they share in attention.cuh, the basic set in
// attention_basic.cu, the pipelined set (wide and narrow, narrow the default) in
// attention_pipelined.cu. This file chooses among them (fy_cuda_attention_set_variant), checks shapes
// and shared memory, launches, and holds incremental decoding.
#include "ops/cuda/attention.cuh"

#include <stdlib.h>
#include <string.h>

#include <atomic>

extern "C" {
#include "core/log.h"
}

#define ATT_TILE 64
#define ATT_THREADS 256
#define ATT_SP 65  // row stride of the score tile: odd, so column walks hit distinct banks

static __host__ __device__ inline int att_hsp(int HS) { return HS | 1; }

// rows [row0, row0+64) of one head's q, k, v (or dout) -> dst (64, HSP) fp32; rows past T are 0
template <typename T>
__device__ __forceinline__ void att_load_tile(float *dst, const T *base, int64_t rstride,
                                              int row0, int Tn, int HS, int HSP) {
  for (int idx = threadIdx.x; idx < ATT_TILE * HS; idx += ATT_THREADS) {
    int r = idx / HS, d = idx - r * HS;
    int t = row0 + r;
    dst[r * HSP + d] = t < Tn ? fy_ld(base + (int64_t)t * rstride + d) : 0.0f;
  }
}

// keys [k0, k0+64) -> ok (64): the key exists and is not padding
__device__ __forceinline__ void att_load_keys_ok(int *ok, const int32_t *mask, int b, int k0,
                                                 int Tn) {
  if (threadIdx.x < ATT_TILE) {
    int s = k0 + threadIdx.x;
    ok[threadIdx.x] = s < Tn && (!mask || mask[(int64_t)b * Tn + s] != 0);
  }
}

// qkv (B,T,3C), mask (B,T) -> out (B,T,C), lse (B,NH,T)
template <typename T, int J>
__global__ void __launch_bounds__(ATT_THREADS)
attention_forward_kernel(T *out, float *lse, const T *qkv, const int32_t *mask, int Tn, int C,
                         int NH, float scale, int nq) {
  extern __shared__ float smem[];
  const int HS = C / NH, HSP = att_hsp(HS);
  // Blocks of one (b, h) take the longest (last) query tiles first: the tail of the grid is short.
  const int bh = blockIdx.x / nq, qt = nq - 1 - (int)(blockIdx.x % nq);
  const int b = bh / NH, h = bh % NH;
  float *sQ = smem, *sK = sQ + ATT_TILE * HSP, *sV = sK + ATT_TILE * HSP;
  float *sS = sV + ATT_TILE * HSP;
  int *sOk = (int *)(sS + ATT_TILE * ATT_SP);
  const int64_t C3 = 3 * (int64_t)C;
  const T *base = qkv + (int64_t)b * Tn * C3 + (int64_t)h * HS;
  const int q0 = qt * ATT_TILE, tid = threadIdx.x;
  const int ty = tid / 16, tx = tid % 16;  // score micro-tile
  const int r = tid / 4, qq = tid % 4;     // owned row and column phase
  att_load_tile(sQ, base, C3, q0, Tn, HS, HSP);

  float o[J];
#pragma unroll
  for (int j = 0; j < J; j++) o[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  for (int kt = 0; kt <= qt; kt++) {
    const int k0 = kt * ATT_TILE;
    __syncthreads();  // the previous tile's K, V and P are consumed
    att_load_tile(sK, base + C, C3, k0, Tn, HS, HSP);
    att_load_tile(sV, base + 2 * C, C3, k0, Tn, HS, HSP);
    att_load_keys_ok(sOk, mask, b, k0, Tn);
    __syncthreads();

    float acc[4][4] = {};
    for (int d = 0; d < HS; d++) {
      float qv[4], kv[4];
#pragma unroll
      for (int i = 0; i < 4; i++) qv[i] = sQ[(ty + 16 * i) * HSP + d];
#pragma unroll
      for (int j = 0; j < 4; j++) kv[j] = sK[(tx + 16 * j) * HSP + d];
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] += qv[i] * kv[j];
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++) {
        int qi = ty + 16 * i, kj = tx + 16 * j;
        bool ok = sOk[kj] && k0 + kj <= q0 + qi;  // causal and not padding
        sS[qi * ATT_SP + kj] = ok ? acc[i][j] * scale : -INFINITY;
      }
    __syncthreads();

    // Online softmax of row r over this tile.
    float mx = -INFINITY;
#pragma unroll
    for (int cc = 0; cc < 16; cc++) mx = fmaxf(mx, sS[r * ATT_SP + qq + 4 * cc]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(m, mx);
    float alpha = 1.0f, ps = 0.0f;
    if (mnew == -INFINITY) {  // no key for this query yet: nothing to add, avoid inf - inf
#pragma unroll
      for (int cc = 0; cc < 16; cc++) sS[r * ATT_SP + qq + 4 * cc] = 0.0f;
    } else {
      alpha = expf(m - mnew);  // 0 when m was -inf (o and l are 0 then anyway)
#pragma unroll
      for (int cc = 0; cc < 16; cc++) {
        float p = expf(sS[r * ATT_SP + qq + 4 * cc] - mnew);
        sS[r * ATT_SP + qq + 4 * cc] = p;
        ps += p;
      }
    }
    ps += __shfl_xor_sync(0xffffffffu, ps, 1);
    ps += __shfl_xor_sync(0xffffffffu, ps, 2);
    l = l * alpha + ps;
    m = mnew;
#pragma unroll
    for (int j = 0; j < J; j++) o[j] *= alpha;
    __syncthreads();  // P of the whole tile is written

    for (int s = 0; s < ATT_TILE; s++) {
      float p = sS[r * ATT_SP + s];
#pragma unroll
      for (int j = 0; j < J; j++) {
        int c = qq + 4 * j;
        if (c < HS) o[j] += p * sV[s * HSP + c];
      }
    }
  }

  const int t = q0 + r;
  if (t < Tn) {
    // A query with no key (l = 0) gets zeros, as the CPU kernel gives it.
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    T *orow = out + ((int64_t)b * Tn + t) * C + (int64_t)h * HS;
#pragma unroll
    for (int j = 0; j < J; j++) {
      int c = qq + 4 * j;
      if (c < HS) fy_st(orow + c, o[j] * inv);
    }
    if (qq == 0) lse[(int64_t)bh * Tn + t] = l > 0.0f ? m + logf(l) : -INFINITY;
  }
}

// dout (B,T,C), out (B,T,C) -> D (B,NH,T) = sum over the head's channels of dout * out
template <typename T>
__global__ void attention_backward_dot_kernel(float *D, const T *dout, const T *out, int64_t B,
                                              int Tn, int C, int NH) {
  const int HS = C / NH;
  int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (w >= B * Tn * NH) return;
  int h = (int)(w % NH);
  int64_t bt = w / NH, b = bt / Tn;
  int t = (int)(bt % Tn);
  const T *g = dout + bt * C + (int64_t)h * HS, *o = out + bt * C + (int64_t)h * HS;
  float s = 0.0f;
  for (int c = lane; c < HS; c += 32) s += fy_ld(g + c) * fy_ld(o + c);
  s = fy_warp_sum(s);
  if (lane == 0) D[(b * NH + h) * Tn + t] = s;
}

// Shared-memory layout of both backward kernels: four (64, HSP) tiles (Q, dO, K, V), the score
// tile, and per-row lse, D and key validity.
struct att_bwd_smem {
  float *sQ, *sdO, *sK, *sV, *sS, *sLse, *sD;
  int *sOk;
};
__device__ __forceinline__ att_bwd_smem att_bwd_layout(float *smem, int HSP) {
  att_bwd_smem s;
  s.sQ = smem;
  s.sdO = s.sQ + ATT_TILE * HSP;
  s.sK = s.sdO + ATT_TILE * HSP;
  s.sV = s.sK + ATT_TILE * HSP;
  s.sS = s.sV + ATT_TILE * HSP;
  s.sLse = s.sS + ATT_TILE * ATT_SP;
  s.sD = s.sLse + ATT_TILE;
  s.sOk = (int *)(s.sD + ATT_TILE);
  return s;
}
static size_t att_bwd_smem_bytes(int HSP) {
  return (size_t)(4 * ATT_TILE * HSP + ATT_TILE * ATT_SP + 3 * ATT_TILE) * sizeof(float);
}
static size_t att_fwd_smem_bytes(int HSP) {
  return (size_t)(3 * ATT_TILE * HSP + ATT_TILE * ATT_SP + ATT_TILE) * sizeof(float);
}

// queries [q0, q0+64) -> sLse, sD (rows past T: lse -inf, so their probabilities are 0)
__device__ __forceinline__ void att_load_rows(float *sLse, float *sD, const float *lse,
                                              const float *D, int64_t bh, int q0, int Tn) {
  if (threadIdx.x < ATT_TILE) {
    int t = q0 + threadIdx.x;
    sLse[threadIdx.x] = t < Tn ? lse[bh * Tn + t] : -INFINITY;
    sD[threadIdx.x] = t < Tn ? D[bh * Tn + t] : 0.0f;
  }
}

// The tile's probabilities and dS = P * (dP - D) for micro-tile (ty, tx): P into p, dS into sS.
// Returns with P in p[][] and dS written; the caller orders the shared-memory accesses.
__device__ __forceinline__ void att_bwd_scores(float p[4][4], float dp[4][4],
                                               const att_bwd_smem &s, int HS, int HSP, int q0,
                                               int k0, float scale) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) p[i][j] = dp[i][j] = 0.0f;
  for (int d = 0; d < HS; d++) {
    float qv[4], gv[4], kv[4], vv[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      qv[i] = s.sQ[(ty + 16 * i) * HSP + d];
      gv[i] = s.sdO[(ty + 16 * i) * HSP + d];
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
      kv[j] = s.sK[(tx + 16 * j) * HSP + d];
      vv[j] = s.sV[(tx + 16 * j) * HSP + d];
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++) {
        p[i][j] += qv[i] * kv[j];
        dp[i][j] += gv[i] * vv[j];
      }
  }
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) {
      int qi = ty + 16 * i, kj = tx + 16 * j;
      float l = s.sLse[qi];
      bool ok = s.sOk[kj] && k0 + kj <= q0 + qi && l != -INFINITY;
      p[i][j] = ok ? expf(p[i][j] * scale - l) : 0.0f;
    }
}

// p, dp (this thread's 4x4 of the tile), D -> sS = dS = P * (dP - D), the softmax backward
__device__ __forceinline__ void att_store_ds(const att_bwd_smem &s, const float p[4][4],
                                             const float dp[4][4]) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) {
      int qi = ty + 16 * i;
      s.sS[qi * ATT_SP + tx + 16 * j] = p[i][j] * (dp[i][j] - s.sD[qi]);
    }
}

// acc[j] += sum over n < ATT_TILE of w[n * wstride] * x[n * HSP + qq + 4j]: thread (r, qq)
// accumulates columns qq, qq+4, ... of one row of (a row or column of sS) @ (a tile in smem).
template <int J>
__device__ __forceinline__ void att_accumulate(float *acc, const float *w, int wstride,
                                               const float *x, int HS, int HSP) {
  const int qq = threadIdx.x % 4;
  for (int n = 0; n < ATT_TILE; n++) {
    float wn = w[n * wstride];
#pragma unroll
    for (int j = 0; j < J; j++) {
      int c = qq + 4 * j;
      if (c < HS) acc[j] += wn * x[n * HSP + c];
    }
  }
}

// row[qq + 4j] += acc[j] * mul for the columns below HS
template <typename T, int J>
__device__ __forceinline__ void att_add_cols(T *row, const float *acc, float mul, int HS) {
  const int qq = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < J; j++) {
    int c = qq + 4 * j;
    if (c < HS) fy_st(row + c, fy_ld(row + c) + acc[j] * mul);
  }
}

// dout, qkv, lse, D -> dqkv (B,T,3C) += (the k and v parts)
template <typename T, int J>
__global__ void __launch_bounds__(ATT_THREADS)
attention_backward_kv_kernel(T *dqkv, const T *dout, const T *qkv, const float *lse,
                             const float *D, const int32_t *mask, int Tn, int C, int NH,
                             float scale, int nq) {
  extern __shared__ float smem[];
  const int HS = C / NH, HSP = att_hsp(HS);
  const int bh = blockIdx.x / nq, kt = (int)(blockIdx.x % nq);  // key tile 0 has the most work
  const int b = bh / NH, h = bh % NH;
  att_bwd_smem s = att_bwd_layout(smem, HSP);
  const int64_t C3 = 3 * (int64_t)C;
  const T *base = qkv + (int64_t)b * Tn * C3 + (int64_t)h * HS;
  const T *gbase = dout + (int64_t)b * Tn * C + (int64_t)h * HS;
  const int k0 = kt * ATT_TILE, tid = threadIdx.x;
  const int ty = tid / 16, tx = tid % 16, r = tid / 4;
  att_load_tile(s.sK, base + C, C3, k0, Tn, HS, HSP);
  att_load_tile(s.sV, base + 2 * C, C3, k0, Tn, HS, HSP);
  att_load_keys_ok(s.sOk, mask, b, k0, Tn);

  float dk[J], dv[J];
#pragma unroll
  for (int j = 0; j < J; j++) dk[j] = dv[j] = 0.0f;

  for (int qt = kt; qt < nq; qt++) {
    const int q0 = qt * ATT_TILE;
    __syncthreads();  // the previous query tile and dS are consumed
    att_load_tile(s.sQ, base, C3, q0, Tn, HS, HSP);
    att_load_tile(s.sdO, gbase, (int64_t)C, q0, Tn, HS, HSP);
    att_load_rows(s.sLse, s.sD, lse, D, bh, q0, Tn);
    __syncthreads();
    float p[4][4], dp[4][4];
    att_bwd_scores(p, dp, s, HS, HSP, q0, k0, scale);
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++) s.sS[(ty + 16 * i) * ATT_SP + tx + 16 * j] = p[i][j];
    __syncthreads();
    // dV[key r] += sum over queries q of P[q][r] * dO[q]
    att_accumulate<J>(dv, s.sS + r, ATT_SP, s.sdO, HS, HSP);
    __syncthreads();  // P is read; dS goes over it
    att_store_ds(s, p, dp);
    __syncthreads();
    // dK[key r] += sum over queries q of dS[q][r] * Q[q] (times scale, at the end)
    att_accumulate<J>(dk, s.sS + r, ATT_SP, s.sQ, HS, HSP);
  }

  const int t = k0 + r;
  if (t < Tn) {
    T *row = dqkv + ((int64_t)b * Tn + t) * C3 + (int64_t)h * HS;
    att_add_cols<T, J>(row + C, dk, scale, HS);
    att_add_cols<T, J>(row + 2 * C, dv, 1.0f, HS);
  }
}

// dout, qkv, lse, D -> dqkv (B,T,3C) += (the q part)
template <typename T, int J>
__global__ void __launch_bounds__(ATT_THREADS)
attention_backward_q_kernel(T *dqkv, const T *dout, const T *qkv, const float *lse,
                            const float *D, const int32_t *mask, int Tn, int C, int NH,
                            float scale, int nq) {
  extern __shared__ float smem[];
  const int HS = C / NH, HSP = att_hsp(HS);
  const int bh = blockIdx.x / nq, qt = nq - 1 - (int)(blockIdx.x % nq);
  const int b = bh / NH, h = bh % NH;
  att_bwd_smem s = att_bwd_layout(smem, HSP);
  const int64_t C3 = 3 * (int64_t)C;
  const T *base = qkv + (int64_t)b * Tn * C3 + (int64_t)h * HS;
  const T *gbase = dout + (int64_t)b * Tn * C + (int64_t)h * HS;
  const int q0 = qt * ATT_TILE, tid = threadIdx.x;
  const int r = tid / 4;  // the query row this thread accumulates
  att_load_tile(s.sQ, base, C3, q0, Tn, HS, HSP);
  att_load_tile(s.sdO, gbase, (int64_t)C, q0, Tn, HS, HSP);
  att_load_rows(s.sLse, s.sD, lse, D, bh, q0, Tn);

  float dq[J];
#pragma unroll
  for (int j = 0; j < J; j++) dq[j] = 0.0f;

  for (int kt = 0; kt <= qt; kt++) {
    const int k0 = kt * ATT_TILE;
    __syncthreads();  // the previous key tile and dS are consumed
    att_load_tile(s.sK, base + C, C3, k0, Tn, HS, HSP);
    att_load_tile(s.sV, base + 2 * C, C3, k0, Tn, HS, HSP);
    att_load_keys_ok(s.sOk, mask, b, k0, Tn);
    __syncthreads();
    float p[4][4], dp[4][4];
    att_bwd_scores(p, dp, s, HS, HSP, q0, k0, scale);
    att_store_ds(s, p, dp);
    __syncthreads();
    // dQ[query r] += sum over keys k of dS[r][k] * K[k] (times scale, at the end)
    att_accumulate<J>(dq, s.sS + r * ATT_SP, 1, s.sK, HS, HSP);
  }

  const int t = q0 + r;
  if (t < Tn) att_add_cols<T, J>(dqkv + ((int64_t)b * Tn + t) * C3 + (int64_t)h * HS, dq, scale, HS);
}

// Whether the tensor-core kernels take this call: bf16, a head size that is a multiple of 16 up
// to 128, rows of whole 16-byte pieces, 16-byte aligned buffers, and a GPU of compute capability 8+.
static bool tc_usable(enum fy_dtype dt, int64_t C, int64_t NH, const void *a, const void *b, const void *c) {
  if (dt != FY_BF16 || C % NH != 0) return false;
  const int64_t HS = C / NH;
  if (HS % 16 != 0 || HS > 128 || C % 8 != 0) return false;
  if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 != 0) return false;
  static int major = -1;
  if (major < 0) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      major = 0;
  }
  return major >= 8;
}

// Which bf16 tensor-core kernels run, for forward and for backward apart: basic, pipelined (wide)
// or narrow; auto is narrow. Set by fy_cuda_attention_set_variant, else from FERRY_CUDA_ATTENTION
// at the first call. Every forward writes the same out and lse, which any backward reads. Measured
// on an H200 (bench/gpu_attention, batch 8 x 2048, ms a layer forward / backward):
//   OPT-1.3B (HS 64):  basic 1.21 / 3.12, pipelined 0.86 / 2.47, narrow 0.80 / 2.31
//   OPT-2.7B (HS 80):  basic 1.64 / 4.31, pipelined = narrow 0.94 / 3.36
//   OPT-6.7B (HS 128): basic 2.59 / 6.11, pipelined = narrow 1.50 / 4.69
enum tc_kind { TC_BASIC, TC_PIPELINED, TC_NARROW, TC_AUTO };
static const char *const tc_kind_names[] = {"basic", "pipelined", "narrow", "auto"};
static int tc_kinds[2] = {-1, -1};  // forward, backward; -1: not chosen yet

static int tc_kind_parse(const char *s, size_t n) {
  for (int k = 0; k <= TC_AUTO; k++)
    if (strlen(tc_kind_names[k]) == n && strncmp(s, tc_kind_names[k], n) == 0) return k;
  return -1;
}

extern "C" fy_status fy_cuda_attention_set_variant(const char *name) {
  int f = TC_AUTO, b = TC_AUTO;
  if (name && *name) {
    const char *comma = strchr(name, ',');
    f = tc_kind_parse(name, comma ? (size_t)(comma - name) : strlen(name));
    b = comma ? tc_kind_parse(comma + 1, strlen(comma + 1)) : f;
    if (f < 0 || b < 0)
      return fy_error_set(FY_ERR_INVALID,
                          "unknown attention kernels '%s' (auto, basic, pipelined or narrow; or FORWARD,BACKWARD "
                          "such as pipelined,basic)",
                          name);
  }
  tc_kinds[0] = f, tc_kinds[1] = b;
  return FY_OK;
}

// The kernels pass (0 forward, 1 backward) takes: TC_BASIC, TC_PIPELINED or TC_NARROW (auto: narrow,
// the fastest at every head size measured).
static int tc_kind(int pass) {
  if (tc_kinds[pass] < 0 && fy_cuda_attention_set_variant(getenv("FERRY_CUDA_ATTENTION")) != FY_OK) {
    fy_log_warn("FERRY_CUDA_ATTENTION: %s; using auto", fy_error_msg());
    tc_kinds[0] = tc_kinds[1] = TC_AUTO;
  }
  return tc_kinds[pass] == TC_AUTO ? TC_NARROW : tc_kinds[pass];
}

// The dynamic shared memory a block of the tensor-core kernels takes, the largest of the forward
// kind fk's and the backward kind bk's.
static size_t tc_smem_need(int HS, int fk, int bk) {
  const size_t f = fk == TC_BASIC ? fy_cuda_attention_basic_smem(HS, false)
                                  : fy_cuda_attention_pipelined_smem(fk == TC_NARROW, HS, false);
  const size_t b = bk == TC_BASIC ? fy_cuda_attention_basic_smem(HS, true)
                                  : fy_cuda_attention_pipelined_smem(bk == TC_NARROW, HS, true);
  return f > b ? f : b;
}

// The dynamic shared memory a block of the attention kernels takes for this dtype and head size,
// the largest of forward and backward, as the launches below choose them (tc: the tensor-core
// kernels take the call).
static size_t att_smem_need(int HS, bool tc) {
  if (tc) return tc_smem_need(HS, tc_kind(0), tc_kind(1));
  const size_t b = att_bwd_smem_bytes(att_hsp(HS)), f = att_fwd_smem_bytes(att_hsp(HS));
  return f > b ? f : b;
}

// What the current GPU allows a block (cudaFuncSetAttribute's ceiling), against `need`. Every
// attention launch asks: the ceiling is read once per GPU (0 until then), the rest only to refuse.
static fy_status att_smem_fits(const char *what, enum fy_dtype dt, int HS, size_t need) {
  static std::atomic<int> ceiling[64];
  int dev = 0, limit = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return FY_OK;  // the launch itself will say what is wrong
  }
  if ((limit = ceiling[dev].load(std::memory_order_relaxed)) == 0) {
    if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return FY_OK;
    }
    ceiling[dev].store(limit, std::memory_order_relaxed);
  }
  if (need <= (size_t)limit) return FY_OK;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    (void)cudaGetLastError();
  if (dt == FY_BF16 || HS % 16 != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED,
                        "cuda %s: %s attention with head size %d takes %.1f KiB of shared memory a block; GPU %d "
                        "(sm_%d%d) allows %.1f KiB",
                        what, fy_dtype_name(dt), HS, need / 1024.0, dev, major, minor, limit / 1024.0);
  return fy_error_set(FY_ERR_UNSUPPORTED,
                      "cuda %s: fp32 attention with head size %d takes %.1f KiB of shared memory a block; GPU %d "
                      "(sm_%d%d) allows %.1f KiB: use bf16 (--precision bf16, the default on cuda; %.1f KiB)",
                      what, HS, need / 1024.0, dev, major, minor, limit / 1024.0, att_smem_need(HS, true) / 1024.0);
}

static fy_status att_check(const char *what, int64_t B, int64_t T, int64_t C, int64_t NH,
                           int64_t *nblocks) {
  if (NH <= 0 || C <= 0 || C % NH != 0)
    return fy_error_set(FY_ERR_INVALID, "cuda %s: C=%lld is not a multiple of NH=%lld", what,
                        (long long)C, (long long)NH);
  if (C / NH > 128)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda %s: head size %lld (at most 128)", what,
                        (long long)(C / NH));
  int64_t nq = (T + ATT_TILE - 1) / ATT_TILE;
  if (T > 0x7fffffff || 3 * C > 0x7fffffff || B * NH * nq > 0x7fffffff)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda %s: B=%lld T=%lld C=%lld too large", what,
                        (long long)B, (long long)T, (long long)C);
  *nblocks = B * NH * nq;
  return FY_OK;
}

// Launches kernel K<T, J> with the J that covers HS (columns per thread: HS/4 rounded up to 8,
// 16 or 32), after raising its dynamic shared memory limit (over 48 KiB for large heads).
#define ATT_LAUNCH(KERNEL, T, HS, grid, smem, st, ...)                                       \
  do {                                                                                      \
    if ((HS) <= 32) {                                                                       \
      cudaFuncSetAttribute(KERNEL<T, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(smem)); \
      KERNEL<T, 8><<<grid, ATT_THREADS, smem, st>>>(__VA_ARGS__);                           \
    } else if ((HS) <= 64) {                                                                \
      cudaFuncSetAttribute(KERNEL<T, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(smem)); \
      KERNEL<T, 16><<<grid, ATT_THREADS, smem, st>>>(__VA_ARGS__);                          \
    } else {                                                                                \
      cudaFuncSetAttribute(KERNEL<T, 32>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(smem)); \
      KERNEL<T, 32><<<grid, ATT_THREADS, smem, st>>>(__VA_ARGS__);                          \
    }                                                                                       \
  } while (0)

extern "C" fy_status fy_cuda_attention_forward(void *out, float *lse, const void *qkv,
                                               const int32_t *mask, enum fy_dtype dt, int64_t B,
                                               int64_t T, int64_t C, int64_t NH, float scale,
                                               cudaStream_t st) {
  int64_t nblocks = 0;
  FY_TRY(att_check("attention_forward", B, T, C, NH, &nblocks));
  if (nblocks == 0) return FY_OK;
  const int HS = (int)(C / NH), nq = (int)((T + ATT_TILE - 1) / ATT_TILE);
  const bool tc = tc_usable(dt, C, NH, out, qkv, qkv);
  FY_TRY(att_smem_fits("attention_forward", dt, HS, att_smem_need(HS, tc)));
  if (tc) {
    const int k = tc_kind(0);
    if (k == TC_BASIC)
      return fy_cuda_attention_basic_forward(out, lse, qkv, mask, T, C, NH, scale, (unsigned)nblocks, nq, st);
    return fy_cuda_attention_pipelined_forward(k == TC_NARROW, out, lse, qkv, mask, B, T, C, NH, scale, st);
  }
  size_t smem = att_fwd_smem_bytes(att_hsp(HS));
  FY_CUDA_DISPATCH("attention_forward", dt, E,
                   ATT_LAUNCH(attention_forward_kernel, E, HS, (unsigned)nblocks, smem, st,
                              (E *)out, lse, (const E *)qkv, mask, (int)T, (int)C, (int)NH, scale,
                              nq));
  return fy_cuda_launched("attention_forward");
}

extern "C" fy_status fy_cuda_attention_backward(void *dqkv, float *scratch, const void *dout,
                                                const void *qkv, const void *out,
                                                const float *lse, const int32_t *mask,
                                                enum fy_dtype dt, int64_t B, int64_t T, int64_t C,
                                                int64_t NH, float scale, cudaStream_t st) {
  int64_t nblocks = 0;
  FY_TRY(att_check("attention_backward", B, T, C, NH, &nblocks));
  if (nblocks == 0) return FY_OK;
  const int HS = (int)(C / NH), nq = (int)((T + ATT_TILE - 1) / ATT_TILE);
  size_t smem = att_bwd_smem_bytes(att_hsp(HS));
  int64_t rows = B * T * NH;
  unsigned dgrid = (unsigned)((rows + 7) / 8);
  const bool tc = tc_usable(dt, C, NH, dqkv, dout, qkv);
  FY_TRY(att_smem_fits("attention_backward", dt, HS, att_smem_need(HS, tc)));
  if (tc) {
    attention_backward_dot_kernel<fy_bf16><<<dgrid, 256, 0, st>>>(scratch, (const fy_bf16 *)dout, (const fy_bf16 *)out,
                                                                  B, (int)T, (int)C, (int)NH);
    FY_TRY(fy_cuda_launched("attention_backward (row dots)"));
    const int k = tc_kind(1);
    if (k != TC_BASIC)
      return fy_cuda_attention_pipelined_backward(k == TC_NARROW, dqkv, scratch, dout, qkv, lse, mask, B, T, C, NH,
                                                  scale, st);
    return fy_cuda_attention_basic_backward(dqkv, scratch, dout, qkv, lse, mask, T, C, NH, scale, (unsigned)nblocks, nq,
                                            st);
  }
  FY_CUDA_DISPATCH("attention_backward", dt, E,
                   attention_backward_dot_kernel<E><<<dgrid, 256, 0, st>>>(
                       scratch, (const E *)dout, (const E *)out, B, (int)T, (int)C, (int)NH);
                   ATT_LAUNCH(attention_backward_kv_kernel, E, HS, (unsigned)nblocks, smem, st,
                              (E *)dqkv, (const E *)dout, (const E *)qkv, lse, scratch, mask,
                              (int)T, (int)C, (int)NH, scale, nq);
                   ATT_LAUNCH(attention_backward_q_kernel, E, HS, (unsigned)nblocks, smem, st,
                              (E *)dqkv, (const E *)dout, (const E *)qkv, lse, scratch, mask,
                              (int)T, (int)C, (int)NH, scale, nq));
  return fy_cuda_launched("attention_backward");
}

extern "C" fy_status fy_cuda_attention_check(enum fy_dtype dt, int64_t C, int64_t NH) {
  int64_t nblocks = 0;
  FY_TRY(att_check("attention", 1, 1, C, NH, &nblocks));
  const int HS = (int)(C / NH);
  return att_smem_fits("attention", dt, HS, att_smem_need(HS, tc_usable(dt, C, NH, NULL, NULL, NULL)));
}

// ---- incremental decoding ----

#define DEC_THREADS 32  // one warp a head: fy_warp_max and fy_warp_sum take its reductions

// qkv (n,3C) at positions len .. len+n-1 -> rows len .. len+n-1 of kcache and vcache (cap,C).
template <typename T>
__global__ void attention_append_kernel(T *kcache, T *vcache, const T *qkv, int64_t len, int n, int C) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)n * C) return;
  const int64_t t = i / C, c = i % C;
  kcache[(len + t) * C + c] = qkv[t * 3 * C + C + c];
  vcache[(len + t) * C + c] = qkv[t * 3 * C + 2 * C + c];
}

// qkv (n,3C) -> out (n,C): block (h, t) owns head h of token t, at position len + t, against cache
// rows 0 .. len+t (its key and value appended there before). The lanes score the keys strided by
// lane (a dot over HS each), take the maximum and the sum across the warp, and lane i sums column i
// (and i + 32, ...) of the weighted values in key order (one owner: the same bits every run).
template <typename T>
__global__ void __launch_bounds__(DEC_THREADS)
attention_decode_kernel(T *out, const T *kcache, const T *vcache, const T *qkv, int len, int C, int HS, float scale) {
  extern __shared__ float dec_scores[];  // (len + t + 1)
  const int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x, keys = len + t + 1;
  const T *q = qkv + (int64_t)t * 3 * C + h * HS;
  float mx = -INFINITY;
  for (int s = lane; s < keys; s += DEC_THREADS) {
    const T *k = kcache + (int64_t)s * C + h * HS;
    float d = 0.0f;
    for (int i = 0; i < HS; i++) d += fy_ld(q + i) * fy_ld(k + i);
    dec_scores[s] = d * scale;
    mx = fmaxf(mx, dec_scores[s]);
  }
  mx = fy_warp_max(mx);
  float sum = 0.0f;
  for (int s = lane; s < keys; s += DEC_THREADS) {
    dec_scores[s] = expf(dec_scores[s] - mx);
    sum += dec_scores[s];
  }
  const float inv = 1.0f / fy_warp_sum(sum);
  __syncthreads();  // (the block is the warp) every lane's scores are written before any lane reads them all
  for (int i = lane; i < HS; i += DEC_THREADS) {
    float o = 0.0f;
    for (int s = 0; s < keys; s++) o += dec_scores[s] * fy_ld(vcache + (int64_t)s * C + h * HS + i);
    fy_st(out + (int64_t)t * C + h * HS + i, o * inv);
  }
}

extern "C" fy_status fy_cuda_attention_decode(void *out, void *kcache, void *vcache, const void *qkv, enum fy_dtype dt,
                                              int64_t len, int64_t n, int64_t cap, int64_t C, int64_t NH, float scale,
                                              cudaStream_t st) {
  int64_t nb = 0;
  FY_TRY(att_check("attention_decode", 1, 1, C, NH, &nb));
  if (len < 0 || n < 1 || len + n > cap)
    return fy_error_set(FY_ERR_INVALID, "cuda attention_decode: positions %lld to %lld outside a cache of %lld",
                        (long long)len, (long long)(len + n - 1), (long long)cap);
  if (cap > 12000)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda attention_decode: a cache of %lld tokens (at most 12000)",
                        (long long)cap);
  if (n > 65535)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda attention_decode: %lld tokens at once (at most 65535)", (long long)n);
  const size_t smem = (size_t)(len + n) * sizeof(float);
  const unsigned append_blocks = (unsigned)((n * C + 255) / 256);
  FY_CUDA_DISPATCH("attention_decode", dt, E,
                   attention_append_kernel<E><<<append_blocks, 256, 0, st>>>((E *)kcache, (E *)vcache, (const E *)qkv,
                                                                             len, (int)n, (int)C));
  FY_TRY(fy_cuda_launched("attention_decode"));
  FY_CUDA_DISPATCH("attention_decode", dt, E,
                   attention_decode_kernel<E><<<dim3((unsigned)NH, (unsigned)n), DEC_THREADS, smem, st>>>(
                       (E *)out, (const E *)kcache, (const E *)vcache, (const E *)qkv, (int)len, (int)C,
                       (int)(C / NH), scale));
  return fy_cuda_launched("attention_decode");
}
