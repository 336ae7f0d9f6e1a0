// Causal attention on tensor cores, the pipelined kernels (bf16, sm_80+; "pipelined" and "narrow" to
// fy_cuda_attention_set_variant and FERRY_CUDA_ATTENTION, narrow the default).
//
// The same algorithm and outputs as the basic kernels (attention_basic.cu), with two changes aimed
// at what bounds them: a warp there reads a whole 64-row tile from shared memory for only 16 rows
// of its own, about as many shared-memory bytes per tensor-core FLOP as the SM can serve. Here a
// warp owns MT row blocks of 16 (MT = 2 for heads up to 64 in the wide, "pipelined" shape), and each
// fragment it reads from a shared tile serves all of them; and the tiles a block walks are
// double-buffered and filled with cp.async (16-byte copies straight to shared memory, zero-filled
// past T), the next tile loading while the current one is used. One barrier per tile: after it,
// every warp is done with the previous tile, whose buffers the next copy takes. The narrow shape
// keeps MT = 1 with the double buffering: fewer registers a thread, so more blocks on an SM.
#include "ops/cuda/attention.cuh"

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

// attention_basic.cu's tc_load by cp.async: rows [row0, row0+R) of one head -> dst (R, HS+8); rows
// past T are zero
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

fy_status fy_cuda_attention_pipelined_forward(bool narrow, void *out, float *lse, const void *qkv,
                                              const int32_t *mask, int64_t B, int64_t T, int64_t C, int64_t NH,
                                              float scale, cudaStream_t st) {
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

fy_status fy_cuda_attention_pipelined_backward(bool narrow, void *dqkv, const float *D, const void *dout,
                                               const void *qkv, const float *lse, const int32_t *mask, int64_t B,
                                               int64_t T, int64_t C, int64_t NH, float scale, cudaStream_t st) {
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

template <int HS, bool N>
static size_t tc2_smem(bool backward) {
  if (!backward) return tc2_fwd_smem<HS, N>();
  return tc2_kv_smem<HS, N>() > tc2_q_smem<HS, N>() ? tc2_kv_smem<HS, N>() : tc2_q_smem<HS, N>();
}

size_t fy_cuda_attention_pipelined_smem(bool narrow, int HS, bool backward) {
  size_t need = 0;
#define TC2_NEED(H) need = narrow ? tc2_smem<H, tc2_n(H)>(backward) : tc2_smem<H, false>(backward)
  TC_HS_DISPATCH(HS, TC2_NEED);
#undef TC2_NEED
  return need;
}
