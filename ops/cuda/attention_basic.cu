// Causal attention on tensor cores, the basic kernels (bf16, sm_80+; "basic" to
// fy_cuda_attention_set_variant and FERRY_CUDA_ATTENTION): four warps a block, a warp owning 16 rows
// of the block's 64-row tile, the tiles it walks loaded with plain 16-byte loads between two
// barriers, one at a time. The pipelined kernels (attention_pipelined.cu) are these with the tile
// loads overlapped and, in the wide shape, more rows a warp; what they share is in attention.cuh.
#include "ops/cuda/attention.cuh"

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

// tc_accumulate_mt for one row block
template <int HS, int NC>
static __device__ __forceinline__ void tc_accumulate(float acc[HS / 8][4], const float w[NC / 8][4], const fy_bf16 *x) {
  tc_accumulate_mt<HS, NC, 1>(reinterpret_cast<float(*)[HS / 8][4]>(acc),
                              reinterpret_cast<const float(*)[NC / 8][4]>(w), x);
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

fy_status fy_cuda_attention_basic_forward(void *out, float *lse, const void *qkv, const int32_t *mask, int64_t T,
                                          int64_t C, int64_t NH, float scale, unsigned nblocks, int nq,
                                          cudaStream_t st) {
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

fy_status fy_cuda_attention_basic_backward(void *dqkv, const float *D, const void *dout, const void *qkv,
                                           const float *lse, const int32_t *mask, int64_t T, int64_t C, int64_t NH,
                                           float scale, unsigned nblocks, int nq, cudaStream_t st) {
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

template <int HS>
static size_t tc_smem(bool backward) {
  if (!backward) return tc_fwd_smem<HS>();
  return tc_kv_smem<HS>() > tc_q_smem<HS>() ? tc_kv_smem<HS>() : tc_q_smem<HS>();
}

size_t fy_cuda_attention_basic_smem(int HS, bool backward) {
  size_t need = 0;
#define TC_NEED(H) need = tc_smem<H>(backward)
  TC_HS_DISPATCH(HS, TC_NEED);
#undef TC_NEED
  return need;
}
