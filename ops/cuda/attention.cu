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
#include "ops/cuda/common.cuh"

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

// ---- bf16 on tensor cores (sm_80+: mma.sync m16n8k16, fp32 accumulation) ----
//
// The same algorithm and the same outputs (out, lse; dqkv +=) as the kernels above, for bf16 with
// a head size that is a multiple of 16 (every public OPT size: 64, 80 or 128): the score and
// output products run as warp-level matrix multiply-adds instead of fp32 FMAs. Four warps per
// block; a warp owns 16 rows of the block's 64-row tile (queries in forward and in the dq kernel,
// keys in the dk/dv kernel) and keeps its scores, probabilities and accumulators in registers.
// Tiles are bf16 in shared memory with rows padded by 8 elements (16 bytes), so the fragment loads
// of a warp fall in distinct banks. Probabilities and dS enter the second product rounded to bf16
// (as FlashAttention does); sums, the softmax and the accumulators are fp32. Scores are handled in
// base 2 (exp2f on scores times scale * log2 e); lse is stored natural, as the CPU's.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): lane = 4 g + t. A (16 x 16, row-major): reg 0 holds
// row g, columns 2t and 2t+1; reg 1 row g+8; regs 2 and 3 the same rows, columns + 8. B (16 x 8):
// reg 0 holds rows (k) 2t and 2t+1 of column (n) g; reg 1 rows + 8. C (16 x 8, fp32): c0, c1 row g,
// columns 2t, 2t+1; c2, c3 row g+8. So the C fragments of two adjacent 8-column tiles of scores
// are, packed to bf16, the A fragment of the next product: no shuffles.

#define TC_ROWS 64    // rows of a block's own tile (4 warps x 16)
#define TC_THREADS 128
#define TC_LOG2E 1.4426950408889634f
#define TC_LN2 0.6931471805599453f

static __device__ __forceinline__ uint32_t tc_pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half
  return *reinterpret_cast<uint32_t *>(&v);
}

// c (16x8) += a (16x16) b (16x8)
static __device__ __forceinline__ void tc_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#ifdef FY_CUDA_EMU  // test/cudaemu: the instruction emulated on the CPU
  fy_emu_mma_m16n8k16_bf16(c, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ldmatrix .x4: lane l gives the address p of row l % 8 of matrix l / 8 (8 bf16, 16-byte
// aligned); r[i] gets matrix i in the A/C layout (lane 4 g + t: row g, columns 2t and 2t+1), or
// with T (.trans) transposed (rows 2t and 2t+1, column g). Rows HS + 8 elements apart fall in
// distinct banks for any HS a multiple of 16.
template <bool T>
static __device__ __forceinline__ void tc_ldsm(uint32_t r[4], const fy_bf16 *p) {
#ifdef FY_CUDA_EMU
  if (T) fy_emu_ldmatrix_x4_trans(r, p);
  else fy_emu_ldmatrix_x4(r, p);
#else
  unsigned addr = (unsigned)__cvta_generic_to_shared(p);
  if (T)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

// A fragment: rows [m0, m0+16), columns [k0, k0+16) of a row-major tile (row stride ld elements):
// matrices (rows + 0, columns + 0), (+8, +0), (+0, +8), (+8, +8)
static __device__ __forceinline__ void tc_ld_a(uint32_t a[4], const fy_bf16 *tile, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  tc_ldsm<false>(a, tile + (m0 + (lane & 7) + (mi & 1) * 8) * ld + k0 + (mi >> 1) * 8);
}

// B fragments of B = X^T for a row-major X (ld), for the two column tiles n0 and n0+8 and rows
// (k) [k0, k0+16): B's column n is X's row n0+n, B's rows k are X's columns (scores Q K^T: X = K).
// b[0], b[1] for n0 and b[2], b[3] for n0+8: matrices (X rows + 0, columns + 0), (+0, +8), (+8,
// +0), (+8, +8).
static __device__ __forceinline__ void tc_ld_bt2(uint32_t b[4], const fy_bf16 *tile, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  tc_ldsm<false>(b, tile + (n0 + (lane & 7) + (mi >> 1) * 8) * ld + k0 + (mi & 1) * 8);
}

// B fragments of B = X (row-major, ld) for rows [k0, k0+16) and the two column tiles n0 and n0+8:
// b[0], b[1] for n0 and b[2], b[3] for n0+8, by ldmatrix with transposition (P V: X = V).
static __device__ __forceinline__ void tc_ld_b2(uint32_t b[4], const fy_bf16 *tile, int ld, int k0, int n0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  tc_ldsm<true>(b, tile + (k0 + (lane & 7) + (mi & 1) * 8) * ld + n0 + (mi >> 1) * 8);
}

// rows [row0, row0+R) of one head (HS columns at base, row stride rstride) -> dst (R, HS+8) bf16;
// rows past T are zero. 16-byte loads and stores.
template <int HS, int R>
static __device__ __forceinline__ void tc_load(fy_bf16 *dst, const fy_bf16 *base, int64_t rstride, int row0, int Tn) {
  constexpr int V = HS / 8;  // 16-byte pieces per row
  for (int idx = threadIdx.x; idx < R * V; idx += TC_THREADS) {
    const int r = idx / V, c = (idx - r * V) * 8, t = row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (t < Tn) v = *reinterpret_cast<const uint4 *>(base + (int64_t)t * rstride + c);
    *reinterpret_cast<uint4 *>(dst + r * (HS + 8) + c) = v;
  }
}

// keys [k0, k0+n) -> ok (n), as att_load_keys_ok
static __device__ __forceinline__ void tc_keys_ok(int *ok, const int32_t *mask, int b, int k0, int n, int Tn) {
  for (int i = threadIdx.x; i < n; i += TC_THREADS) {
    const int s = k0 + i;
    ok[i] = s < Tn && (!mask || mask[(int64_t)b * Tn + s] != 0);
  }
}

// queries [q0, q0+n) -> lse2 (lse in base 2; -inf past T), D (0 past T)
static __device__ __forceinline__ void tc_rows(float *lse2, float *sD, const float *lse, const float *D, int64_t bh,
                                               int q0, int n, int Tn) {
  for (int i = threadIdx.x; i < n; i += TC_THREADS) {
    const int t = q0 + i;
    lse2[i] = t < Tn ? lse[bh * Tn + t] * TC_LOG2E : -INFINITY;
    sD[i] = t < Tn ? D[bh * Tn + t] : 0.0f;
  }
}

// row[c], row[c+1] += v0 * mul, v1 * mul (bf16, one owner per element)
static __device__ __forceinline__ void tc_add2(fy_bf16 *row, float v0, float v1, float mul) {
  __nv_bfloat162 *p = reinterpret_cast<__nv_bfloat162 *>(row);
  float2 o = __bfloat1622float2(*p);
  *p = __floats2bfloat162_rn(o.x + v0 * mul, o.y + v1 * mul);
}

// acc[mt] (16 x HS) += W[mt] (16 x NC, from score-layout registers, rounded to bf16) X (NC x HS,
// tile x) for MT row blocks, each X fragment loaded once for all of them: the second product of
// every kernel (P V, P^T dO, dS^T Q, dS K); X enters by transposed loads.
template <int HS, int NC, int MT>
static __device__ __forceinline__ void tc_accumulate_mt(float acc[MT][HS / 8][4], const float w[MT][NC / 8][4],
                                                        const fy_bf16 *x) {
#pragma unroll
  for (int j = 0; j < NC / 16; j++) {
    uint32_t wa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      wa[mt][0] = tc_pack(w[mt][2 * j][0], w[mt][2 * j][1]);
      wa[mt][1] = tc_pack(w[mt][2 * j][2], w[mt][2 * j][3]);
      wa[mt][2] = tc_pack(w[mt][2 * j + 1][0], w[mt][2 * j + 1][1]);
      wa[mt][3] = tc_pack(w[mt][2 * j + 1][2], w[mt][2 * j + 1][3]);
    }
#pragma unroll
    for (int dn = 0; dn < HS / 16; dn++) {
      uint32_t xb[4];
      tc_ld_b2(xb, x, HS + 8, 16 * j, 16 * dn);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        tc_mma(acc[mt][2 * dn], wa[mt], xb[0], xb[1]);
        tc_mma(acc[mt][2 * dn + 1], wa[mt], xb[2], xb[3]);
      }
    }
  }
}

// tc_accumulate_mt for one row block
template <int HS, int NC>
static __device__ __forceinline__ void tc_accumulate(float acc[HS / 8][4], const float w[NC / 8][4], const fy_bf16 *x) {
  tc_accumulate_mt<HS, NC, 1>(reinterpret_cast<float(*)[HS / 8][4]>(acc),
                              reinterpret_cast<const float(*)[NC / 8][4]>(w), x);
}

// sc[mt] (16 x NC) = Q K^T for MT row blocks of queries held as A fragments (qa) against NC keys
// (rows of the tile k), each K fragment loaded once for all of them: both forwards' scores.
template <int HS, int NC, int MT>
static __device__ __forceinline__ void tc_qk_mt(float sc[MT][NC / 8][4], const uint32_t qa[MT][HS / 16][4],
                                                const fy_bf16 *k) {
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int n = 0; n < NC / 8; n++) sc[mt][n][0] = sc[mt][n][1] = sc[mt][n][2] = sc[mt][n][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < HS / 16; kk++)
#pragma unroll
    for (int n = 0; n < NC / 8; n += 2) {
      uint32_t kb[4];
      tc_ld_bt2(kb, k, HS + 8, 8 * n, 16 * kk);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        tc_mma(sc[mt][n], qa[mt][kk], kb[0], kb[1]);
        tc_mma(sc[mt][n + 1], qa[mt][kk], kb[2], kb[3]);
      }
    }
}

// Where head h = bh % NH of batch row b = bh / NH starts in a (B, T, stride) tensor (q, k and v of
// qkv are then at + 0, C and 2C; dout's and out's heads at + 0).
static __device__ __forceinline__ const fy_bf16 *tc_head(const fy_bf16 *x, int bh, int NH, int Tn, int64_t stride,
                                                        int HS) {
  return x + (int64_t)(bh / NH) * Tn * stride + (int64_t)(bh % NH) * HS;
}

// The online softmax of one warp's 16 query rows over a tile of NC keys (both forward kernels):
// scores s scaled to base 2 and masked (key k0 + k exists and is not after the row's query tq),
// the rows' running maximum m and sum l (this thread's part) and the accumulator o rescaled by the
// new maximum; s becomes the tile's probabilities. M false: a tile every one of whose keys every
// row sees (no padding mask, all keys at or before the rows' first query), the same arithmetic
// without the mask's tests.
template <int HS, int NC, bool M = true>
static __device__ __forceinline__ void tc_online_softmax(float s[NC / 8][4], float m[2], float l[2], float o[HS / 8][4],
                                                         const int *ok, int k0, const int tq[2], float sl) {
  const int t = threadIdx.x & 3;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < NC / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = 8 * n + 2 * t + (e & 1), row = e >> 1;
      const bool keep = !M || (ok[key] && k0 + key <= tq[row]);
      s[n][e] = keep ? s[n][e] * sl : -INFINITY;
      mx[row] = fmaxf(mx[row], s[n][e]);
    }
  float alpha[2];
#pragma unroll
  for (int row = 0; row < 2; row++) {
    mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 1));
    mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 2));
    const float mnew = fmaxf(m[row], mx[row]);
    // No key for this row yet: nothing to add (avoid -inf - -inf).
    alpha[row] = mnew == -INFINITY ? 1.0f : exp2f(m[row] - mnew);
    mx[row] = mnew;  // the reference point of this tile's probabilities
    m[row] = mnew;
  }
  float ps[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < NC / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int row = e >> 1;
      const float p = M && mx[row] == -INFINITY ? 0.0f : exp2f(s[n][e] - mx[row]);
      s[n][e] = p;
      ps[row] += p;
    }
#pragma unroll
  for (int row = 0; row < 2; row++) l[row] = l[row] * alpha[row] + ps[row];
#pragma unroll
  for (int j = 0; j < HS / 8; j++) {
    o[j][0] *= alpha[0], o[j][1] *= alpha[0];
    o[j][2] *= alpha[1], o[j][3] *= alpha[1];
  }
}

// The end of a warp's 16 query rows tq (rows past T skipped): out = o / l, lse (natural log).
template <int HS>
static __device__ __forceinline__ void tc_store_rows(fy_bf16 *out, float *lse, const float o[HS / 8][4],
                                                     const float m[2], const float lpart[2], int bh, int NH,
                                                     const int tq[2], int Tn, int C) {
  const int t = threadIdx.x & 3;
  float ls[2];
#pragma unroll
  for (int row = 0; row < 2; row++) {
    ls[row] = lpart[row] + __shfl_xor_sync(0xffffffffu, lpart[row], 1);
    ls[row] += __shfl_xor_sync(0xffffffffu, ls[row], 2);
  }
#pragma unroll
  for (int row = 0; row < 2; row++) {
    const float l = ls[row];
    if (tq[row] >= Tn) continue;
    // A query with no key (l = 0) gets zeros, as the CPU kernel gives it.
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    fy_bf16 *orow = out + ((int64_t)(bh / NH) * Tn + tq[row]) * C + (int64_t)(bh % NH) * HS;
#pragma unroll
    for (int j = 0; j < HS / 8; j++)
      *reinterpret_cast<uint32_t *>(orow + 8 * j + 2 * t) = tc_pack(o[j][2 * row] * inv, o[j][2 * row + 1] * inv);
    if (t == 0) lse[(int64_t)bh * Tn + tq[row]] = l > 0.0f ? (m[row] + log2f(l)) * TC_LN2 : -INFINITY;
  }
}

// dk/dv kernels: a warp's 16 key rows (ok: those keys' flags, tk: their positions) against NC
// queries from q0 (lse2 in base 2, D): p = P^T, ds = dS^T from the raw scores and dP^T. M false:
// every query sees every key (no padding mask, the queries before T and at or after the keys).
template <int NC, bool M = true>
static __device__ __forceinline__ void tc_probs_kv(float p[NC / 8][4], float ds[NC / 8][4], const int *ok,
                                                   const int tk[2], int q0, const float *lse2, const float *D,
                                                   float sl) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < NC / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int qc = 8 * n + 2 * t + (e & 1), row = e >> 1;
      const float l2 = lse2[qc];
      const bool keep = !M || (ok[g + 8 * row] && tk[row] <= q0 + qc && l2 != -INFINITY);
      const float pv = keep ? exp2f(p[n][e] * sl - l2) : 0.0f;
      p[n][e] = pv;
      ds[n][e] = pv * (ds[n][e] - D[qc]);
    }
}

// dq kernels: a warp's 16 query rows (tq; lse2 and D of those rows) against NC keys from k0 (ok:
// their flags): ds = dS from the raw scores p and dP. M false: every query sees every key.
template <int NC, bool M = true>
static __device__ __forceinline__ void tc_probs_q(const float p[NC / 8][4], float ds[NC / 8][4], const int *ok,
                                                  int k0, const int tq[2], const float *lse2, const float *D,
                                                  float sl) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < NC / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int kc = 8 * n + 2 * t + (e & 1), row = e >> 1;
      const float l2 = lse2[g + 8 * row];
      const bool keep = !M || (ok[kc] && k0 + kc <= tq[row] && l2 != -INFINITY);
      const float pv = keep ? exp2f(p[n][e] * sl - l2) : 0.0f;
      ds[n][e] = pv * (ds[n][e] - D[g + 8 * row]);
    }
}

template <int HS>
static size_t tc_fwd_smem() { return (size_t)(3 * TC_ROWS * (HS + 8)) * sizeof(fy_bf16) + TC_ROWS * sizeof(int); }

// qkv (B,T,3C), mask -> out (B,T,C), lse (B,NH,T): one (b, h, 64-query tile) per block
template <int HS>
__global__ void __launch_bounds__(TC_THREADS)
attention_forward_tc_kernel(fy_bf16 *out, float *lse, const fy_bf16 *qkv, const int32_t *mask, int Tn, int C,
                            int NH, float scale, int nq) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  constexpr int LD = HS + 8, NT = TC_ROWS / 8, DT = HS / 8;
  fy_bf16 *sQ = reinterpret_cast<fy_bf16 *>(tc_smem), *sK = sQ + TC_ROWS * LD, *sV = sK + TC_ROWS * LD;
  int *sOk = reinterpret_cast<int *>(sV + TC_ROWS * LD);
  const int bh = blockIdx.x / nq, qt = nq - 1 - (int)(blockIdx.x % nq);
  const int b = bh / NH;
  const int64_t C3 = 3 * (int64_t)C;
  const fy_bf16 *base = tc_head(qkv, bh, NH, Tn, C3, HS);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int q0 = qt * TC_ROWS, r0 = warp * 16;  // the warp's rows r0 + g and r0 + g + 8
  const float sl = scale * TC_LOG2E;
  tc_load<HS, TC_ROWS>(sQ, base, C3, q0, Tn);
  __syncthreads();
  uint32_t qa[HS / 16][4];
#pragma unroll
  for (int kk = 0; kk < HS / 16; kk++) tc_ld_a(qa[kk], sQ, LD, r0, 16 * kk);

  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g+8; l is this thread's part
  const int tq[2] = {q0 + r0 + g, q0 + r0 + g + 8};

  for (int kt = 0; kt <= qt; kt++) {
    const int k0 = kt * TC_ROWS;
    __syncthreads();  // the previous K and V are consumed
    tc_load<HS, TC_ROWS>(sK, base + C, C3, k0, Tn);
    tc_load<HS, TC_ROWS>(sV, base + 2 * C, C3, k0, Tn);
    tc_keys_ok(sOk, mask, b, k0, TC_ROWS, Tn);
    __syncthreads();

    float sc[NT][4];
    tc_qk_mt<HS, TC_ROWS, 1>(reinterpret_cast<float(*)[NT][4]>(sc), reinterpret_cast<const uint32_t(*)[HS / 16][4]>(qa),
                             sK);
    tc_online_softmax<HS, TC_ROWS>(sc, m, l, o, sOk, k0, tq, sl);
    tc_accumulate<HS, TC_ROWS>(o, sc, sV);  // O += P V
  }

  tc_store_rows<HS>(out, lse, o, m, l, bh, NH, tq, Tn, C);
}

// The score-side work every backward kernel shares, for a warp's MT blocks of 16 rows (rows a0 +
// 16 mt of tiles a and da) against the NC rows of tiles x and dx: s[mt] = A X^T, dp[mt] = dA dX^T
// (fp32, unscaled), each X fragment loaded once for all of them.
template <int HS, int NC, int MT>
static __device__ __forceinline__ void tc_scores_mt(float s[MT][NC / 8][4], float dp[MT][NC / 8][4], const fy_bf16 *a,
                                                    const fy_bf16 *da, int a0, const fy_bf16 *x, const fy_bf16 *dx) {
  constexpr int LD = HS + 8;
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int n = 0; n < NC / 8; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[mt][n][e] = dp[mt][n][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < HS / 16; kk++) {
    uint32_t fa[MT][4], fd[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      tc_ld_a(fa[mt], a, LD, a0 + 16 * mt, 16 * kk);
      tc_ld_a(fd[mt], da, LD, a0 + 16 * mt, 16 * kk);
    }
#pragma unroll
    for (int n = 0; n < NC / 8; n += 2) {
      uint32_t xb[4];
      tc_ld_bt2(xb, x, LD, 8 * n, 16 * kk);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        tc_mma(s[mt][n], fa[mt], xb[0], xb[1]);
        tc_mma(s[mt][n + 1], fa[mt], xb[2], xb[3]);
      }
      tc_ld_bt2(xb, dx, LD, 8 * n, 16 * kk);
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        tc_mma(dp[mt][n], fd[mt], xb[0], xb[1]);
        tc_mma(dp[mt][n + 1], fd[mt], xb[2], xb[3]);
      }
    }
  }
}

// tc_scores_mt for one row block
template <int HS, int NC>
static __device__ __forceinline__ void tc_scores(float s[NC / 8][4], float dp[NC / 8][4], const fy_bf16 *a,
                                                 const fy_bf16 *da, int a0, const fy_bf16 *x, const fy_bf16 *dx) {
  tc_scores_mt<HS, NC, 1>(reinterpret_cast<float(*)[NC / 8][4]>(s), reinterpret_cast<float(*)[NC / 8][4]>(dp), a, da,
                          a0, x, dx);
}

// Query tiles of the dk/dv kernel: 64 queries, 32 for the largest heads (fewer registers).
template <int HS>
struct tc_kv { static constexpr int QT = HS > 64 ? 32 : 64; };
template <int HS>
static size_t tc_kv_smem() {
  constexpr int QT = tc_kv<HS>::QT;
  return (size_t)(2 * TC_ROWS + 2 * QT) * (HS + 8) * sizeof(fy_bf16) + (size_t)(2 * QT) * sizeof(float) +
         TC_ROWS * sizeof(int);
}
template <int HS>
static size_t tc_q_smem() {
  return (size_t)(4 * TC_ROWS) * (HS + 8) * sizeof(fy_bf16) + (size_t)(2 * TC_ROWS) * sizeof(float) +
         TC_ROWS * sizeof(int);
}

// dout, qkv, lse, D -> dqkv += (k and v): one (b, h, 64-key tile) per block, a warp per 16 keys
template <int HS>
__global__ void __launch_bounds__(TC_THREADS)
attention_backward_kv_tc_kernel(fy_bf16 *dqkv, const fy_bf16 *dout, const fy_bf16 *qkv, const float *lse,
                                const float *D, const int32_t *mask, int Tn, int C, int NH, float scale, int nk) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  constexpr int LD = HS + 8, QT = tc_kv<HS>::QT, DT = HS / 8;
  fy_bf16 *sK = reinterpret_cast<fy_bf16 *>(tc_smem), *sV = sK + TC_ROWS * LD, *sQ = sV + TC_ROWS * LD,
          *sdO = sQ + QT * LD;
  float *sLse = reinterpret_cast<float *>(sdO + QT * LD), *sD = sLse + QT;
  int *sOk = reinterpret_cast<int *>(sD + QT);
  const int bh = blockIdx.x / nk, kt = (int)(blockIdx.x % nk);  // key tile 0 has the most work
  const int b = bh / NH, h = bh % NH;
  const int64_t C3 = 3 * (int64_t)C;
  const fy_bf16 *base = tc_head(qkv, bh, NH, Tn, C3, HS), *gbase = tc_head(dout, bh, NH, Tn, C, HS);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int k0 = kt * TC_ROWS, r0 = warp * 16;
  const float sl = scale * TC_LOG2E;
  tc_load<HS, TC_ROWS>(sK, base + C, C3, k0, Tn);
  tc_load<HS, TC_ROWS>(sV, base + 2 * C, C3, k0, Tn);
  tc_keys_ok(sOk, mask, b, k0, TC_ROWS, Tn);

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int j = 0; j < DT; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[j][e] = dv[j][e] = 0.0f;
  const int tk[2] = {k0 + r0 + g, k0 + r0 + g + 8};

  for (int q0 = k0; q0 < Tn; q0 += QT) {
    __syncthreads();  // the previous query tile is consumed
    tc_load<HS, QT>(sQ, base, C3, q0, Tn);
    tc_load<HS, QT>(sdO, gbase, (int64_t)C, q0, Tn);
    tc_rows(sLse, sD, lse, D, bh, q0, QT, Tn);
    __syncthreads();
    // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys.
    float p[QT / 8][4], ds[QT / 8][4];
    tc_scores<HS, QT>(p, ds, sK, sV, r0, sQ, sdO);
    tc_probs_kv<QT>(p, ds, sOk + r0, tk, q0, sLse, sD, sl);
    tc_accumulate<HS, QT>(dv, p, sdO);  // dV += P^T dO
    tc_accumulate<HS, QT>(dk, ds, sQ);  // dK += dS^T Q (times scale below)
  }

#pragma unroll
  for (int row = 0; row < 2; row++) {
    if (tk[row] >= Tn) continue;
    fy_bf16 *drow = dqkv + ((int64_t)b * Tn + tk[row]) * C3 + (int64_t)h * HS;
#pragma unroll
    for (int j = 0; j < DT; j++) {
      tc_add2(drow + C + 8 * j + 2 * t, dk[j][2 * row], dk[j][2 * row + 1], scale);
      tc_add2(drow + 2 * C + 8 * j + 2 * t, dv[j][2 * row], dv[j][2 * row + 1], 1.0f);
    }
  }
}

// dout, qkv, lse, D -> dqkv += (q): one (b, h, 64-query tile) per block, a warp per 16 queries
template <int HS>
__global__ void __launch_bounds__(TC_THREADS)
attention_backward_q_tc_kernel(fy_bf16 *dqkv, const fy_bf16 *dout, const fy_bf16 *qkv, const float *lse,
                               const float *D, const int32_t *mask, int Tn, int C, int NH, float scale, int nq) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  constexpr int LD = HS + 8, DT = HS / 8, NT = TC_ROWS / 8;
  fy_bf16 *sQ = reinterpret_cast<fy_bf16 *>(tc_smem), *sdO = sQ + TC_ROWS * LD, *sK = sdO + TC_ROWS * LD,
          *sV = sK + TC_ROWS * LD;
  float *sLse = reinterpret_cast<float *>(sV + TC_ROWS * LD), *sD = sLse + TC_ROWS;
  int *sOk = reinterpret_cast<int *>(sD + TC_ROWS);
  const int bh = blockIdx.x / nq, qt = nq - 1 - (int)(blockIdx.x % nq);
  const int b = bh / NH, h = bh % NH;
  const int64_t C3 = 3 * (int64_t)C;
  const fy_bf16 *base = tc_head(qkv, bh, NH, Tn, C3, HS), *gbase = tc_head(dout, bh, NH, Tn, C, HS);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int q0 = qt * TC_ROWS, r0 = warp * 16;
  const float sl = scale * TC_LOG2E;
  tc_load<HS, TC_ROWS>(sQ, base, C3, q0, Tn);
  tc_load<HS, TC_ROWS>(sdO, gbase, (int64_t)C, q0, Tn);
  tc_rows(sLse, sD, lse, D, bh, q0, TC_ROWS, Tn);

  float dq[DT][4];
#pragma unroll
  for (int j = 0; j < DT; j++) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;
  const int tq[2] = {q0 + r0 + g, q0 + r0 + g + 8};

  for (int kt = 0; kt <= qt; kt++) {
    const int k0 = kt * TC_ROWS;
    __syncthreads();  // the previous key tile is consumed
    tc_load<HS, TC_ROWS>(sK, base + C, C3, k0, Tn);
    tc_load<HS, TC_ROWS>(sV, base + 2 * C, C3, k0, Tn);
    tc_keys_ok(sOk, mask, b, k0, TC_ROWS, Tn);
    __syncthreads();
    // S = Q K^T and dP = dO V^T for the warp's 16 queries.
    float p[NT][4], ds[NT][4];
    tc_scores<HS, TC_ROWS>(p, ds, sQ, sdO, r0, sK, sV);
    tc_probs_q<TC_ROWS>(p, ds, sOk, k0, tq, sLse + r0, sD + r0, sl);
    tc_accumulate<HS, TC_ROWS>(dq, ds, sK);  // dQ += dS K (times scale below)
  }

#pragma unroll
  for (int row = 0; row < 2; row++) {
    if (tq[row] >= Tn) continue;
    fy_bf16 *drow = dqkv + ((int64_t)b * Tn + tq[row]) * C3 + (int64_t)h * HS;
#pragma unroll
    for (int j = 0; j < DT; j++) tc_add2(drow + 8 * j + 2 * t, dq[j][2 * row], dq[j][2 * row + 1], scale);
  }
}

// ---- bf16 on tensor cores, pipelined ("pipelined" and "narrow": fy_cuda_attention_set_variant) ----
//
// The same algorithm and outputs as the tensor-core kernels above, with two changes aimed at what
// bounds them: a warp there reads a whole 64-row tile from shared memory for only 16 rows of its
// own, about as many shared-memory bytes per tensor-core FLOP as the SM can serve. Here a warp
// owns MT row blocks of 16 (MT = 2 for heads up to 64 in the wide, "pipelined" shape), and each
// fragment it reads from a shared tile serves all of them; and the tiles a block walks are
// double-buffered and filled with cp.async (16-byte copies straight to shared memory, zero-filled
// past T), the next tile loading while the current one is used. One barrier per tile: after it,
// every warp is done with the previous tile, whose buffers the next copy takes. The narrow shape
// keeps MT = 1 with the double buffering: fewer registers a thread, so more blocks on an SM.

#ifdef FY_CUDA_EMU
static __device__ __forceinline__ void tc_cp16(void *dst, const void *src, bool ok) { fy_emu_cp_async16(dst, src, ok); }
static __device__ __forceinline__ void tc_cp_commit() {}
static __device__ __forceinline__ void tc_cp_wait() { fy_emu_cp_async_wait_all(); }
#else
static __device__ __forceinline__ void tc_cp16(void *dst, const void *src, bool ok) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}
static __device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
static __device__ __forceinline__ void tc_cp_wait() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
#endif

// tc_load by cp.async: rows [row0, row0+R) of one head -> dst (R, HS+8); rows past T are zero
template <int HS, int R>
static __device__ __forceinline__ void tc_load_async(fy_bf16 *dst, const fy_bf16 *base, int64_t rstride, int row0,
                                                     int Tn) {
  constexpr int V = HS / 8;
  for (int idx = threadIdx.x; idx < R * V; idx += TC_THREADS) {
    const int r = idx / V, c = (idx - r * V) * 8, t = row0 + r;
    tc_cp16(dst + r * (HS + 8) + c, t < Tn ? base + (int64_t)t * rstride + c : base, t < Tn);
  }
}

// Double buffering: keys [k0, k0+R) of one head into buffer `buf` of sK and sV (R rows of HS+8
// each) by cp.async, committed as one group (with any copies issued before it), and their flags
// into sOk's buffer (plain stores: visible after the next barrier).
template <int HS, int R>
static __device__ __forceinline__ void tc_load_keys(fy_bf16 *sK, fy_bf16 *sV, int *sOk, int buf, const fy_bf16 *base,
                                                    int C, int64_t C3, const int32_t *mask, int b, int k0, int Tn) {
  tc_load_async<HS, R>(sK + buf * R * (HS + 8), base + C, C3, k0, Tn);
  tc_load_async<HS, R>(sV + buf * R * (HS + 8), base + 2 * C, C3, k0, Tn);
  tc_cp_commit();
  tc_keys_ok(sOk + buf * R, mask, b, k0, R, Tn);
}

// The same for queries [q0, q0+R): q into sQ's buffer, dout into sdO's, their lse and D.
template <int HS, int R>
static __device__ __forceinline__ void tc_load_queries(fy_bf16 *sQ, fy_bf16 *sdO, float *sLse, float *sD, int buf,
                                                       const fy_bf16 *base, const fy_bf16 *gbase, int C, int64_t C3,
                                                       const float *lse, const float *D, int bh, int q0, int Tn) {
  tc_load_async<HS, R>(sQ + buf * R * (HS + 8), base, C3, q0, Tn);
  tc_load_async<HS, R>(sdO + buf * R * (HS + 8), gbase, (int64_t)C, q0, Tn);
  tc_cp_commit();
  tc_rows(sLse + buf * R, sD + buf * R, lse, D, bh, q0, R, Tn);
}

// The pipelined kernels' shapes. Wide (N false): row blocks per warp MT = 2 for heads up to 64,
// else 1 (the accumulators would not fit the registers), walking 32-row tiles in backward. Narrow
// (N true): one row block a warp, as the basic kernels, walking 64-row tiles for heads up to 64
// (fewer registers, so more blocks to an SM, each reading more shared memory per product); for
// larger heads the narrow kernels are the wide ones (launched as N false: tc2_n).
template <int HS, bool N>
struct tc2 {
  static constexpr int MT = !N && HS <= 64 ? 2 : 1;
  static constexpr int ROWS = 64 * MT;                 // a block's own rows (queries, or keys in dk/dv)
  static constexpr int WALK = N && HS <= 64 ? 64 : 32;  // rows of the tiles the backward kernels walk
};
// The N a narrow launch takes for head size HS (one instantiation where both shapes agree).
static constexpr bool tc2_n(int HS) { return HS <= 64; }

template <int HS, bool N>
static size_t tc2_fwd_smem() {
  return (size_t)(tc2<HS, N>::ROWS + 4 * TC_ROWS) * (HS + 8) * sizeof(fy_bf16) + 2 * TC_ROWS * sizeof(int);
}
template <int HS, bool N>
static size_t tc2_kv_smem() {
  constexpr int R = tc2<HS, N>::ROWS, W = tc2<HS, N>::WALK;
  return (size_t)(2 * R + 4 * W) * (HS + 8) * sizeof(fy_bf16) + (size_t)(4 * W) * sizeof(float) + R * sizeof(int);
}
template <int HS, bool N>
static size_t tc2_q_smem() {
  constexpr int R = tc2<HS, N>::ROWS, W = tc2<HS, N>::WALK;
  return (size_t)(2 * R + 4 * W) * (HS + 8) * sizeof(fy_bf16) + (size_t)(2 * R) * sizeof(float) + 2 * W * sizeof(int);
}

// qkv (B,T,3C), mask -> out (B,T,C), lse (B,NH,T): one (b, h, ROWS-query tile) per block, a warp
// per 16 MT queries, walking 64-key tiles
template <int HS, bool N>
__global__ void __launch_bounds__(TC_THREADS)
attention_forward_tc2_kernel(fy_bf16 *out, float *lse, const fy_bf16 *qkv, const int32_t *mask, int Tn, int C,
                             int NH, float scale, int nq) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  constexpr int LD = HS + 8, NT = TC_ROWS / 8, DT = HS / 8, MT = tc2<HS, N>::MT, QR = tc2<HS, N>::ROWS;
  fy_bf16 *sQ = reinterpret_cast<fy_bf16 *>(tc_smem), *sK = sQ + QR * LD, *sV = sK + 2 * TC_ROWS * LD;
  int *sOk = reinterpret_cast<int *>(sV + 2 * TC_ROWS * LD);
  const int bh = blockIdx.x / nq, qt = nq - 1 - (int)(blockIdx.x % nq);
  const int b = bh / NH;
  const int64_t C3 = 3 * (int64_t)C;
  const fy_bf16 *base = tc_head(qkv, bh, NH, Tn, C3, HS);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int q0 = qt * QR, r0 = warp * 16 * MT, wlast = q0 + r0 + 16 * MT - 1;  // the warp's rows r0 ..
  const int nkt = ((q0 + QR < Tn ? q0 + QR : Tn) - 1) / TC_ROWS + 1;  // key tiles up to the last query
  const float sl = scale * TC_LOG2E;
  tc_load_async<HS, QR>(sQ, base, C3, q0, Tn);
  tc_load_keys<HS, TC_ROWS>(sK, sV, sOk, 0, base, C, C3, mask, b, 0, Tn);

  uint32_t qa[MT][HS / 16][4];
  float o[MT][DT][4], m[MT][2], l[MT][2];
  int tq[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
#pragma unroll
    for (int j = 0; j < DT; j++) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
    tq[mt][0] = q0 + r0 + 16 * mt + g;
    tq[mt][1] = tq[mt][0] + 8;
  }

  for (int kt = 0; kt < nkt; kt++) {
    const int k0 = kt * TC_ROWS, cur = kt & 1;
    tc_cp_wait();
    __syncthreads();  // tile kt is in; every warp is done with tile kt - 1
    if (kt == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) tc_ld_a(qa[mt][kk], sQ, LD, r0 + 16 * mt, 16 * kk);
    }
    if (kt + 1 < nkt)  // the next tile into the buffers tile kt - 1 used
      tc_load_keys<HS, TC_ROWS>(sK, sV, sOk, cur ^ 1, base, C, C3, mask, b, k0 + TC_ROWS, Tn);
    if (k0 > wlast) continue;  // every key of the tile comes after every query of the warp
    const fy_bf16 *cK = sK + cur * TC_ROWS * LD, *cV = sV + cur * TC_ROWS * LD;
    const int *ok = sOk + cur * TC_ROWS;

    float sc[MT][NT][4];
    tc_qk_mt<HS, TC_ROWS, MT>(sc, qa, cK);
    if (!mask && k0 + TC_ROWS - 1 <= q0 + r0) {  // no key after the warp's first query (nor padding)
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
        tc_online_softmax<HS, TC_ROWS, false>(sc[mt], m[mt], l[mt], o[mt], ok, k0, tq[mt], sl);
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; mt++) tc_online_softmax<HS, TC_ROWS>(sc[mt], m[mt], l[mt], o[mt], ok, k0, tq[mt], sl);
    }
    tc_accumulate_mt<HS, TC_ROWS, MT>(o, sc, cV);  // O += P V
  }

#pragma unroll
  for (int mt = 0; mt < MT; mt++) tc_store_rows<HS>(out, lse, o[mt], m[mt], l[mt], bh, NH, tq[mt], Tn, C);
}

// dout, qkv, lse, D -> dqkv += (k and v): one (b, h, ROWS-key tile) per block, a warp per 16 MT
// keys, walking WALK-query tiles from the block's first key on
template <int HS, bool N>
__global__ void __launch_bounds__(TC_THREADS, N && HS <= 64 ? 3 : 1)
attention_backward_kv_tc2_kernel(fy_bf16 *dqkv, const fy_bf16 *dout, const fy_bf16 *qkv, const float *lse,
                                 const float *D, const int32_t *mask, int Tn, int C, int NH, float scale, int nk) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  constexpr int LD = HS + 8, DT = HS / 8, MT = tc2<HS, N>::MT, KR = tc2<HS, N>::ROWS, QT = tc2<HS, N>::WALK;
  fy_bf16 *sK = reinterpret_cast<fy_bf16 *>(tc_smem), *sV = sK + KR * LD, *sQ = sV + KR * LD, *sdO = sQ + 2 * QT * LD;
  float *sLse = reinterpret_cast<float *>(sdO + 2 * QT * LD), *sD = sLse + 2 * QT;
  int *sOk = reinterpret_cast<int *>(sD + 2 * QT);
  const int bh = blockIdx.x / nk, kt = (int)(blockIdx.x % nk);  // key tile 0 has the most work
  const int b = bh / NH, h = bh % NH;
  const int64_t C3 = 3 * (int64_t)C;
  const fy_bf16 *base = tc_head(qkv, bh, NH, Tn, C3, HS), *gbase = tc_head(dout, bh, NH, Tn, C, HS);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int k0 = kt * KR, r0 = warp * 16 * MT, wfirst = k0 + r0;  // the warp's keys r0 ..
  const float sl = scale * TC_LOG2E;
  tc_load_async<HS, KR>(sK, base + C, C3, k0, Tn);
  tc_load_async<HS, KR>(sV, base + 2 * C, C3, k0, Tn);
  tc_load_queries<HS, QT>(sQ, sdO, sLse, sD, 0, base, gbase, C, C3, lse, D, bh, k0, Tn);
  tc_keys_ok(sOk, mask, b, k0, KR, Tn);

  float dk[MT][DT][4], dv[MT][DT][4];
  int tk[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
#pragma unroll
    for (int j = 0; j < DT; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) dk[mt][j][e] = dv[mt][j][e] = 0.0f;
    tk[mt][0] = wfirst + 16 * mt + g;
    tk[mt][1] = tk[mt][0] + 8;
  }

  for (int i = 0, q0 = k0; q0 < Tn; i++, q0 += QT) {
    const int cur = i & 1;
    tc_cp_wait();
    __syncthreads();  // query tile i is in; every warp is done with tile i - 1
    if (q0 + QT < Tn)
      tc_load_queries<HS, QT>(sQ, sdO, sLse, sD, cur ^ 1, base, gbase, C, C3, lse, D, bh, q0 + QT, Tn);
    if (q0 + QT - 1 < wfirst) continue;  // every query of the tile comes before every key of the warp
    const fy_bf16 *cQ = sQ + cur * QT * LD, *cdO = sdO + cur * QT * LD;
    const float *cL = sLse + cur * QT, *cD = sD + cur * QT;
    // S^T = K Q^T and dP^T = V dO^T for the warp's keys.
    float p[MT][QT / 8][4], ds[MT][QT / 8][4];
    tc_scores_mt<HS, QT, MT>(p, ds, sK, sV, r0, cQ, cdO);
    if (!mask && wfirst + 16 * MT - 1 <= q0 && q0 + QT <= Tn) {  // every query sees every key of the warp
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
        tc_probs_kv<QT, false>(p[mt], ds[mt], sOk + r0 + 16 * mt, tk[mt], q0, cL, cD, sl);
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; mt++) tc_probs_kv<QT>(p[mt], ds[mt], sOk + r0 + 16 * mt, tk[mt], q0, cL, cD, sl);
    }
    tc_accumulate_mt<HS, QT, MT>(dv, p, cdO);  // dV += P^T dO
    tc_accumulate_mt<HS, QT, MT>(dk, ds, cQ);  // dK += dS^T Q (times scale below)
  }

#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int row = 0; row < 2; row++) {
      if (tk[mt][row] >= Tn) continue;
      fy_bf16 *drow = dqkv + ((int64_t)b * Tn + tk[mt][row]) * C3 + (int64_t)h * HS;
#pragma unroll
      for (int j = 0; j < DT; j++) {
        tc_add2(drow + C + 8 * j + 2 * t, dk[mt][j][2 * row], dk[mt][j][2 * row + 1], scale);
        tc_add2(drow + 2 * C + 8 * j + 2 * t, dv[mt][j][2 * row], dv[mt][j][2 * row + 1], 1.0f);
      }
    }
}

// dout, qkv, lse, D -> dqkv += (q): one (b, h, ROWS-query tile) per block, a warp per 16 MT
// queries, walking WALK-key tiles up to the block's last query
template <int HS, bool N>
__global__ void __launch_bounds__(TC_THREADS)
attention_backward_q_tc2_kernel(fy_bf16 *dqkv, const fy_bf16 *dout, const fy_bf16 *qkv, const float *lse,
                                const float *D, const int32_t *mask, int Tn, int C, int NH, float scale, int nq) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  constexpr int LD = HS + 8, DT = HS / 8, MT = tc2<HS, N>::MT, QR = tc2<HS, N>::ROWS, KT = tc2<HS, N>::WALK;
  fy_bf16 *sQ = reinterpret_cast<fy_bf16 *>(tc_smem), *sdO = sQ + QR * LD, *sK = sdO + QR * LD, *sV = sK + 2 * KT * LD;
  float *sLse = reinterpret_cast<float *>(sV + 2 * KT * LD), *sD = sLse + QR;
  int *sOk = reinterpret_cast<int *>(sD + QR);
  const int bh = blockIdx.x / nq, qt = nq - 1 - (int)(blockIdx.x % nq);
  const int b = bh / NH, h = bh % NH;
  const int64_t C3 = 3 * (int64_t)C;
  const fy_bf16 *base = tc_head(qkv, bh, NH, Tn, C3, HS), *gbase = tc_head(dout, bh, NH, Tn, C, HS);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int q0 = qt * QR, r0 = warp * 16 * MT, wlast = q0 + r0 + 16 * MT - 1;
  const int nkt = ((q0 + QR < Tn ? q0 + QR : Tn) - 1) / KT + 1;  // key tiles up to the last query
  const float sl = scale * TC_LOG2E;
  tc_load_async<HS, QR>(sQ, base, C3, q0, Tn);
  tc_load_async<HS, QR>(sdO, gbase, (int64_t)C, q0, Tn);
  tc_load_keys<HS, KT>(sK, sV, sOk, 0, base, C, C3, mask, b, 0, Tn);
  tc_rows(sLse, sD, lse, D, bh, q0, QR, Tn);

  float dq[MT][DT][4];
  int tq[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
#pragma unroll
    for (int j = 0; j < DT; j++) dq[mt][j][0] = dq[mt][j][1] = dq[mt][j][2] = dq[mt][j][3] = 0.0f;
    tq[mt][0] = q0 + r0 + 16 * mt + g;
    tq[mt][1] = tq[mt][0] + 8;
  }

  for (int kt = 0; kt < nkt; kt++) {
    const int k0 = kt * KT, cur = kt & 1;
    tc_cp_wait();
    __syncthreads();  // key tile kt is in; every warp is done with tile kt - 1
    if (kt + 1 < nkt) tc_load_keys<HS, KT>(sK, sV, sOk, cur ^ 1, base, C, C3, mask, b, k0 + KT, Tn);
    if (k0 > wlast) continue;  // every key of the tile comes after every query of the warp
    const fy_bf16 *cK = sK + cur * KT * LD, *cV = sV + cur * KT * LD;
    const int *ok = sOk + cur * KT;
    // S = Q K^T and dP = dO V^T for the warp's queries.
    float p[MT][KT / 8][4], ds[MT][KT / 8][4];
    tc_scores_mt<HS, KT, MT>(p, ds, sQ, sdO, r0, cK, cV);
    // Every query of the warp (before T) sees every key of the tile: no mask's tests.
    if (!mask && k0 + KT - 1 <= q0 + r0 && q0 + r0 + 16 * MT <= Tn) {
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
        tc_probs_q<KT, false>(p[mt], ds[mt], ok, k0, tq[mt], sLse + r0 + 16 * mt, sD + r0 + 16 * mt, sl);
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
        tc_probs_q<KT>(p[mt], ds[mt], ok, k0, tq[mt], sLse + r0 + 16 * mt, sD + r0 + 16 * mt, sl);
    }
    tc_accumulate_mt<HS, KT, MT>(dq, ds, cK);  // dQ += dS K (times scale below)
  }

#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int row = 0; row < 2; row++) {
      if (tq[mt][row] >= Tn) continue;
      fy_bf16 *drow = dqkv + ((int64_t)b * Tn + tq[mt][row]) * C3 + (int64_t)h * HS;
#pragma unroll
      for (int j = 0; j < DT; j++) tc_add2(drow + 8 * j + 2 * t, dq[mt][j][2 * row], dq[mt][j][2 * row + 1], scale);
    }
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

// Runs F<HS> for the head size (a multiple of 16 up to 128).
#define TC_HS_DISPATCH(HSV, F)            \
  switch (HSV) {                          \
    case 16: F(16); break;                \
    case 32: F(32); break;                \
    case 48: F(48); break;                \
    case 64: F(64); break;                \
    case 80: F(80); break;                \
    case 96: F(96); break;                \
    case 112: F(112); break;              \
    default: F(128); break;               \
  }

static fy_status tc_forward(void *out, float *lse, const void *qkv, const int32_t *mask, int64_t T, int64_t C,
                            int64_t NH, float scale, unsigned nblocks, int nq, cudaStream_t st) {
  const int HS = (int)(C / NH);
#define TC_FWD(H)                                                                                        \
  do {                                                                                                   \
    size_t smem = tc_fwd_smem<H>();                                                                      \
    cudaFuncSetAttribute(attention_forward_tc_kernel<H>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem); \
    attention_forward_tc_kernel<H><<<nblocks, TC_THREADS, smem, st>>>((fy_bf16 *)out, lse, (const fy_bf16 *)qkv, \
                                                                      mask, (int)T, (int)C, (int)NH, scale, nq); \
  } while (0)
  TC_HS_DISPATCH(HS, TC_FWD);
#undef TC_FWD
  return fy_cuda_launched("attention_forward (tensor cores)");
}

static fy_status tc_backward(void *dqkv, const float *D, const void *dout, const void *qkv, const float *lse,
                             const int32_t *mask, int64_t T, int64_t C, int64_t NH, float scale, unsigned nblocks,
                             int nq, cudaStream_t st) {
  const int HS = (int)(C / NH);
#define TC_BWD(H)                                                                                          \
  do {                                                                                                     \
    size_t skv = tc_kv_smem<H>(), sq = tc_q_smem<H>();                                                     \
    cudaFuncSetAttribute(attention_backward_kv_tc_kernel<H>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)skv); \
    cudaFuncSetAttribute(attention_backward_q_tc_kernel<H>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sq);   \
    attention_backward_kv_tc_kernel<H><<<nblocks, TC_THREADS, skv, st>>>(                                  \
        (fy_bf16 *)dqkv, (const fy_bf16 *)dout, (const fy_bf16 *)qkv, lse, D, mask, (int)T, (int)C, (int)NH, scale, nq); \
    attention_backward_q_tc_kernel<H><<<nblocks, TC_THREADS, sq, st>>>(                                    \
        (fy_bf16 *)dqkv, (const fy_bf16 *)dout, (const fy_bf16 *)qkv, lse, D, mask, (int)T, (int)C, (int)NH, scale, nq); \
  } while (0)
  TC_HS_DISPATCH(HS, TC_BWD);
#undef TC_BWD
  return fy_cuda_launched("attention_backward (tensor cores)");
}

// The pipelined kernels (tc2, wide or narrow): grids of (b, h, ROWS-row tile).
template <int HS, bool N>
static void tc2_forward_launch(void *out, float *lse, const void *qkv, const int32_t *mask, int64_t B, int64_t T,
                               int64_t C, int64_t NH, float scale, cudaStream_t st) {
  const int nq = (int)((T + tc2<HS, N>::ROWS - 1) / tc2<HS, N>::ROWS);
  const size_t smem = tc2_fwd_smem<HS, N>();
  cudaFuncSetAttribute(attention_forward_tc2_kernel<HS, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  attention_forward_tc2_kernel<HS, N><<<(unsigned)(B * NH * nq), TC_THREADS, smem, st>>>(
      (fy_bf16 *)out, lse, (const fy_bf16 *)qkv, mask, (int)T, (int)C, (int)NH, scale, nq);
}

template <int HS, bool N>
static void tc2_backward_launch(void *dqkv, const float *D, const void *dout, const void *qkv, const float *lse,
                                const int32_t *mask, int64_t B, int64_t T, int64_t C, int64_t NH, float scale,
                                cudaStream_t st) {
  const int n = (int)((T + tc2<HS, N>::ROWS - 1) / tc2<HS, N>::ROWS);
  const size_t skv = tc2_kv_smem<HS, N>(), sq = tc2_q_smem<HS, N>();
  cudaFuncSetAttribute(attention_backward_kv_tc2_kernel<HS, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)skv);
  cudaFuncSetAttribute(attention_backward_q_tc2_kernel<HS, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sq);
  attention_backward_kv_tc2_kernel<HS, N><<<(unsigned)(B * NH * n), TC_THREADS, skv, st>>>(
      (fy_bf16 *)dqkv, (const fy_bf16 *)dout, (const fy_bf16 *)qkv, lse, D, mask, (int)T, (int)C, (int)NH, scale, n);
  attention_backward_q_tc2_kernel<HS, N><<<(unsigned)(B * NH * n), TC_THREADS, sq, st>>>(
      (fy_bf16 *)dqkv, (const fy_bf16 *)dout, (const fy_bf16 *)qkv, lse, D, mask, (int)T, (int)C, (int)NH, scale, n);
}

static fy_status tc2_forward(bool narrow, void *out, float *lse, const void *qkv, const int32_t *mask, int64_t B,
                             int64_t T, int64_t C, int64_t NH, float scale, cudaStream_t st) {
  const int HS = (int)(C / NH);
#define TC2_FWD(H)                                                                      \
  do {                                                                                  \
    if (narrow) tc2_forward_launch<H, tc2_n(H)>(out, lse, qkv, mask, B, T, C, NH, scale, st); \
    else tc2_forward_launch<H, false>(out, lse, qkv, mask, B, T, C, NH, scale, st);     \
  } while (0)
  TC_HS_DISPATCH(HS, TC2_FWD);
#undef TC2_FWD
  return fy_cuda_launched(narrow ? "attention_forward (tensor cores, narrow)"
                                 : "attention_forward (tensor cores, pipelined)");
}

static fy_status tc2_backward(bool narrow, void *dqkv, const float *D, const void *dout, const void *qkv,
                              const float *lse, const int32_t *mask, int64_t B, int64_t T, int64_t C, int64_t NH,
                              float scale, cudaStream_t st) {
  const int HS = (int)(C / NH);
#define TC2_BWD(H)                                                                                  \
  do {                                                                                              \
    if (narrow) tc2_backward_launch<H, tc2_n(H)>(dqkv, D, dout, qkv, lse, mask, B, T, C, NH, scale, st); \
    else tc2_backward_launch<H, false>(dqkv, D, dout, qkv, lse, mask, B, T, C, NH, scale, st);      \
  } while (0)
  TC_HS_DISPATCH(HS, TC2_BWD);
#undef TC2_BWD
  return fy_cuda_launched(narrow ? "attention_backward (tensor cores, narrow)"
                                 : "attention_backward (tensor cores, pipelined)");
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
template <int H>
static size_t tc_smem_need(int fk, int bk) {
  constexpr bool n = tc2_n(H);
  const size_t f = fk == TC_BASIC    ? tc_fwd_smem<H>()
                   : fk == TC_NARROW ? tc2_fwd_smem<H, n>()
                                     : tc2_fwd_smem<H, false>();
  const size_t kv = bk == TC_BASIC    ? tc_kv_smem<H>()
                    : bk == TC_NARROW ? tc2_kv_smem<H, n>()
                                      : tc2_kv_smem<H, false>();
  const size_t q = bk == TC_BASIC ? tc_q_smem<H>() : bk == TC_NARROW ? tc2_q_smem<H, n>() : tc2_q_smem<H, false>();
  const size_t b = kv > q ? kv : q;
  return f > b ? f : b;
}

// The dynamic shared memory a block of the attention kernels takes for this dtype and head size,
// the largest of forward and backward, as the launches below choose them (tc: the tensor-core
// kernels take the call).
static size_t att_smem_need(int HS, bool tc) {
  size_t need = 0;
  if (!tc) {
    need = att_bwd_smem_bytes(att_hsp(HS));
    const size_t f = att_fwd_smem_bytes(att_hsp(HS));
    return f > need ? f : need;
  }
#define TC_NEED(H) need = tc_smem_need<H>(tc_kind(0), tc_kind(1))
  TC_HS_DISPATCH(HS, TC_NEED);
#undef TC_NEED
  return need;
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
    if (k == TC_BASIC) return tc_forward(out, lse, qkv, mask, T, C, NH, scale, (unsigned)nblocks, nq, st);
    return tc2_forward(k == TC_NARROW, out, lse, qkv, mask, B, T, C, NH, scale, st);
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
    if (k != TC_BASIC) return tc2_backward(k == TC_NARROW, dqkv, scratch, dout, qkv, lse, mask, B, T, C, NH, scale, st);
    return tc_backward(dqkv, scratch, dout, qkv, lse, mask, T, C, NH, scale, (unsigned)nblocks, nq, st);
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
