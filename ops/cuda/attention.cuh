// Causal attention on tensor cores (bf16, sm_80+: mma.sync m16n8k16, fp32 accumulation): what the
// two sets of kernels share, the basic ones (attention_basic.cu) and the pipelined ones in their
// wide and narrow shapes (attention_pipelined.cu; narrow is the default), and their launches, which
// attention.cu calls once it has chosen the set (fy_cuda_attention_set_variant).
//
// The same algorithm and the same outputs (out, lse; dqkv +=) as the fp32 kernels (attention.cu),
// for bf16 with a head size that is a multiple of 16 (every public OPT size: 64, 80 or 128): the
// score and output products run as warp-level matrix multiply-adds instead of fp32 FMAs. Four
// warps per block; a warp owns 16 rows of the block's 64-row tile (queries in forward and in the dq
// kernel, keys in the dk/dv kernel) and keeps its scores, probabilities and accumulators in
// registers.
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
#ifndef FY_OPS_CUDA_ATTENTION_CUH
#define FY_OPS_CUDA_ATTENTION_CUH

#include "ops/cuda/common.cuh"

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

// keys [k0, k0+n) -> ok (n), as att_load_keys_ok (attention.cu)
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

// ---- the launches (ops/cuda/attention.cu chooses among them) ----
// Shapes as fy_cuda_attention_forward's and _backward's; the head size C / NH a multiple of 16 up
// to 128 (attention.cu's tc_usable); D the per-query row dots rowsum(dout * out), already computed.

// The basic kernels: nblocks = B x NH x nq blocks, nq the 64-row tiles of T.
fy_status fy_cuda_attention_basic_forward(void *out, float *lse, const void *qkv, const int32_t *mask, int64_t T,
                                          int64_t C, int64_t NH, float scale, unsigned nblocks, int nq,
                                          cudaStream_t st);
fy_status fy_cuda_attention_basic_backward(void *dqkv, const float *D, const void *dout, const void *qkv,
                                           const float *lse, const int32_t *mask, int64_t T, int64_t C, int64_t NH,
                                           float scale, unsigned nblocks, int nq, cudaStream_t st);
// The dynamic shared memory a block of the basic forward (backward false) or backward (the larger
// of its two kernels) takes at head size HS.
size_t fy_cuda_attention_basic_smem(int HS, bool backward);

// The pipelined kernels, wide (narrow false: "pipelined") or narrow.
fy_status fy_cuda_attention_pipelined_forward(bool narrow, void *out, float *lse, const void *qkv,
                                              const int32_t *mask, int64_t B, int64_t T, int64_t C, int64_t NH,
                                              float scale, cudaStream_t st);
fy_status fy_cuda_attention_pipelined_backward(bool narrow, void *dqkv, const float *D, const void *dout,
                                               const void *qkv, const float *lse, const int32_t *mask, int64_t B,
                                               int64_t T, int64_t C, int64_t NH, float scale, cudaStream_t st);
size_t fy_cuda_attention_pipelined_smem(bool narrow, int HS, bool backward);

#endif
