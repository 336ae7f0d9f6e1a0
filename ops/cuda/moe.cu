// A mixture-of-experts feed-forward block on the GPU: the contract of fy_moe_forward and
// fy_moe_backward (ops/ops.h, "mixture of experts"), the same routing record and dispatch layout,
// so that the CPU's and the GPU's records can be compared entry by entry.
//
// Forward: one kernel per token computes the router's logits (fp32 sums whatever the dtype: a
// bf16-rounded logit would flip the top-K near a tie, and the CPU's router is fp32 in every
// precision), the softmax, the top K and their renormalised weights. Then the permutation: a
// counting kernel (one block per expert: its token-choices and the sum of its probabilities), a
// placing kernel (one block per expert: its first row from the counts before it, rounded as
// fy_moe_rows, then its choices in (token, choice) order by a scan over the choices), a gather of
// the inputs into those rows and zeros for the rounding rows. The counts come down to the host (one
// wait for the stream: the products' row counts depend on them), and each expert with tokens runs
// its two products through cuBLASLt, in a loop over the experts, with the activation between them
// over all rows at once. Last, each token's output is the weighted sum of its K rows, in the order
// chosen. Backward reads the record and runs the same steps the other way; the experts' counts
// that size its products are the forward's, handed in by the caller (else brought down again, one
// wait). Every sum has a fixed order: the results depend on the routing, never on the scheduling.
// A token that d->mask marks as padding goes to no expert (its choices and rows -1, its weights 0),
// as ops/cpu/moe.c's: its output row is 0, it is left out of the balance term (the counts and the
// probabilities' means over the N routed tokens; N = the counts' sum / K, so that no kernel needs
// the mask but the router) and it has no gradient through the block.
#include "ops/cuda/common.cuh"

extern "C" {
#include "core/graph.h"  // (fy_moe_rows, fy_moe_rows_cap)
}

#define MOE_THREADS 256

// fy_moe_rows (core/graph.h), on the device: n rounded up to 3 significant bits, at least 8.
__device__ __forceinline__ int64_t moe_rows(int64_t n) {
  if (n <= 0) return 0;
  if (n <= 8) return 8;
  int64_t step = 1;
  while ((n + step - 1) / step > 15) step *= 2;
  return (n + step - 1) / step * step;
}

// Expert e's first row in the dispatch layout: the rounded blocks of the experts before it.
__device__ __forceinline__ int64_t moe_first_row(const int *counts, int e) {
  int64_t off = 0;
  for (int i = 0; i < e; i++) off += moe_rows(counts[i]);
  return off;
}

// inp (BT,C), gate (E,C) -> route (BT, E+3K): per token (one block): the logits (a warp per expert,
// lanes over the channels, a butterfly sum), then in thread 0 the softmax, the top K (the larger
// probability first, the lower index on a tie) and their weights, as ops/cpu/moe.c does; a token
// that mask (BT, device; NULL: none) marks as padding then gets choice -1, weight 0 and row -1. The
// other rows (the last K entries) are the placing kernel's. Dynamic shared memory: E floats.
template <typename T>
__global__ void moe_route_kernel(float *route, const T *inp, const T *gate, const int32_t *mask, int64_t C, int E,
                                 int K) {
  extern __shared__ float logit[];
  const int64_t t = blockIdx.x, S = E + 3 * K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  const T *x = inp + t * C;
  for (int e = warp; e < E; e += nw) {
    const T *g = gate + (int64_t)e * C;
    float s = 0.0f;
    for (int64_t c = lane; c < C; c += 32) s += fy_ld(x + c) * fy_ld(g + c);
    s = fy_warp_sum(s);
    if (lane == 0) logit[e] = s;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  float *r = route + t * S;
  float mx = logit[0], sum = 0.0f;
  for (int e = 1; e < E; e++) mx = logit[e] > mx ? logit[e] : mx;
  for (int e = 0; e < E; e++) sum += r[e] = expf(logit[e] - mx);
  for (int e = 0; e < E; e++) r[e] /= sum;
  float chosen = 0.0f;
  for (int j = 0; j < K; j++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      bool taken = false;
      for (int i = 0; i < j; i++) taken |= (int)r[E + i] == e;
      if (!taken && (best < 0 || r[e] > r[best])) best = e;
    }
    r[E + j] = (float)best;
    chosen += r[best];
  }
  for (int j = 0; j < K; j++) r[E + K + j] = r[(int)r[E + j]] / chosen;
  if (mask && mask[t] == 0)  // padding: no expert (its probabilities stay, counted nowhere)
    for (int j = 0; j < K; j++) r[E + j] = -1.0f, r[E + K + j] = 0.0f, r[E + 2 * K + j] = -1.0f;
}

// Whether a token's routing record r is padding's (routed to no expert).
__device__ __forceinline__ bool moe_padding(const float *r, int E) { return r[E] < 0.0f; }

// The routed tokens N from the counts (E): each has exactly K choices.
__device__ __forceinline__ int64_t moe_routed_tokens(const int *counts, int E, int K) {
  int64_t n = 0;
  for (int e = 0; e < E; e++) n += counts[e];
  return n / K;
}

// route (BT, E+3K) -> counts (E): each expert's token-choices, psum (E): the sum of its
// probabilities over the routed tokens (NULL: not wanted; padding chose no expert and adds nothing). One block per expert; threads walk the tokens
// with a stride, then a fixed tree in shared memory.
__global__ void moe_count_kernel(int *counts, float *psum, const float *route, int64_t BT, int E, int K) {
  __shared__ int sn[MOE_THREADS];
  __shared__ float sp[MOE_THREADS];
  const int e = blockIdx.x;
  const int64_t S = E + 3 * K;
  int n = 0;
  float p = 0.0f;
  for (int64_t t = threadIdx.x; t < BT; t += blockDim.x) {
    const float *r = route + t * S;
    if (moe_padding(r, E)) continue;
    for (int j = 0; j < K; j++) n += (int)r[E + j] == e;
    p += r[e];
  }
  sn[threadIdx.x] = n;
  sp[threadIdx.x] = p;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h /= 2) {
    if (threadIdx.x < h) {
      sn[threadIdx.x] += sn[threadIdx.x + h];
      sp[threadIdx.x] += sp[threadIdx.x + h];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    counts[e] = sn[0];
    if (psum) psum[e] = sp[0];
  }
}

// counts (E) -> the rows of route (its last K entries per token): expert e's choices get rows
// first_row(e), first_row(e)+1, .. in (token, choice) order. One block per expert: the BT*K
// choices split into one contiguous segment a thread; a thread counts its segment's choices of e,
// every thread adds up the counts of the segments before its own, then walks its segment again.
__global__ void moe_place_kernel(float *route, const int *counts, int64_t BT, int E, int K) {
  __shared__ int seg[MOE_THREADS];
  const int e = blockIdx.x;
  const int64_t S = E + 3 * K, N = BT * K, per = (N + blockDim.x - 1) / blockDim.x;
  const int64_t i0 = threadIdx.x * per, i1 = i0 + per < N ? i0 + per : N;
  int n = 0;
  for (int64_t i = i0; i < i1; i++) n += (int)route[(i / K) * S + E + i % K] == e;
  seg[threadIdx.x] = n;
  __syncthreads();
  int64_t row = moe_first_row(counts, e);
  for (int k = 0; k < (int)threadIdx.x; k++) row += seg[k];
  for (int64_t i = i0; i < i1; i++) {
    float *r = route + (i / K) * S;
    if ((int)r[E + i % K] == e) r[E + 2 * K + i % K] = (float)row++;
  }
}

// inp (BT,C), route -> xs (rows,C): each token's input copied to its K rows (padding: none). One
// block a token.
template <typename T>
__global__ void moe_gather_kernel(T *xs, const T *inp, const float *route, int64_t C, int E, int K) {
  const int64_t t = blockIdx.x, S = E + 3 * K;
  const float *r = route + t * S;
  if (moe_padding(r, E)) return;
  for (int j = 0; j < K; j++) {
    T *o = xs + (int64_t)r[E + 2 * K + j] * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = inp[t * C + c];
  }
}

// counts (E) -> buf (rows,W): zeros in each expert's rounding rows (after its n_e rows up to its
// rounded count). One block per expert.
template <typename T>
__global__ void moe_pad_kernel(T *buf, const int *counts, int64_t W) {
  const int e = blockIdx.x;
  const int64_t n = counts[e], from = (moe_first_row(counts, e) + n) * W, to = (moe_first_row(counts, e) + moe_rows(n)) * W;
  for (int64_t i = from + threadIdx.x; i < to; i += blockDim.x) fy_st(buf + i, 0.0f);
}

// y (rows,C), route -> out (BT,C) = sum_j weight_j y[row_j], the choices in order (padding: 0).
// One block a token. (TO fp32 with T bf16: tensor parallelism's partial output, summed over the
// group in fp32.)
template <typename TO, typename T>
__global__ void moe_combine_kernel(TO *out, const T *y, const float *route, int64_t C, int E, int K) {
  const int64_t t = blockIdx.x, S = E + 3 * K;
  const float *r = route + t * S;
  const int k = moe_padding(r, E) ? 0 : K;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float s = 0.0f;
    for (int j = 0; j < k; j++) s += r[E + K + j] * fy_ld(y + (int64_t)r[E + 2 * K + j] * C + c);
    fy_st(out + t * C + c, s);
  }
}

// dout (BT,C), y (rows,C), route -> dy (rows,C): dy[row_j] = weight_j dout[t]; dw (BT,K) fp32:
// dw[t][j] = dout[t] . y[row_j] (lanes over channels, then warps in order); padding: no rows, its
// dw 0. One block a token.
template <typename T>
__global__ void moe_dispatch_grad_kernel(T *dy, float *dw, const T *dout, const T *y, const float *route, int64_t C,
                                         int E, int K) {
  __shared__ float part[32];
  const int64_t t = blockIdx.x, S = E + 3 * K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  const float *r = route + t * S;
  const T *g = dout + t * C;
  if (moe_padding(r, E)) {
    if (threadIdx.x < K) dw[t * K + threadIdx.x] = 0.0f;
    return;
  }
  for (int j = 0; j < K; j++) {
    const int64_t row = (int64_t)r[E + 2 * K + j];
    const float w = r[E + K + j];
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float gc = fy_ld(g + c);
      fy_st(dy + row * C + c, w * gc);
      s += gc * fy_ld(y + row * C + c);
    }
    s = fy_warp_sum(s);
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      float tot = 0.0f;
      for (int k = 0; k < nw; k++) tot += part[k];
      dw[t * K + j] = tot;
    }
    __syncthreads();
  }
}

// route, dw (BT,K), counts (E) -> dlog (BT,E): the router's logits' gradient, as ops/cpu/moe.c: the
// renormalised weights' d/dp, the balance term's bal x f_e (bal = dbalance_E / N with dbalance_E =
// dbalance x E, f_e = n_e / N, N the routed tokens), then the softmax's backward; padding: 0. One
// thread a token.
template <typename T>
__global__ void moe_router_grad_kernel(T *dlog, const float *route, const float *dw, const int *counts, int64_t BT,
                                       int E, int K, float dbalance_E) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= BT) return;
  const int64_t S = E + 3 * K;
  const float *r = route + t * S;
  if (moe_padding(r, E)) {
    for (int e = 0; e < E; e++) fy_st(dlog + t * E + e, 0.0f);
    return;
  }
  const int64_t N = moe_routed_tokens(counts, E, K);  // (>= 1: this token is routed)
  const float bal = dbalance_E / (float)N;
  float chosen = 0.0f, wdw = 0.0f;
  for (int j = 0; j < K; j++) {
    chosen += r[(int)r[E + j]];
    wdw += dw[t * K + j] * r[E + K + j];
  }
  // dp[e] = bal f_e + (dw_j - wdw) / chosen for the choice j of e (if any)
  float pdp = 0.0f;
  for (int e = 0; e < E; e++) {
    float dp = bal * (float)((double)counts[e] / (double)N);
    for (int j = 0; j < K; j++)
      if ((int)r[E + j] == e) dp += (dw[t * K + j] - wdw) / chosen;
    pdp += r[e] * dp;
  }
  for (int e = 0; e < E; e++) {
    float dp = bal * (float)((double)counts[e] / (double)N);
    for (int j = 0; j < K; j++)
      if ((int)r[E + j] == e) dp += (dw[t * K + j] - wdw) / chosen;
    fy_st(dlog + t * E + e, r[e] * (dp - pdp));
  }
}

// dx (rows,C), route -> dinp (BT,C) += each token's K rows, in the choices' order (padding: none).
// One block a token. (TO fp32: tensor parallelism's part of the input's gradient, summed over the
// group in fp32.)
template <typename TO, typename T>
__global__ void moe_scatter_add_kernel(TO *dinp, const T *dx, const float *route, int64_t C, int E, int K) {
  const int64_t t = blockIdx.x, S = E + 3 * K;
  const float *r = route + t * S;
  if (moe_padding(r, E)) return;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float s = fy_ld(dinp + t * C + c);
    for (int j = 0; j < K; j++) s += fy_ld(dx + (int64_t)r[E + 2 * K + j] * C + c);
    fy_st(dinp + t * C + c, s);
  }
}

// dst (n) += src (n) fp32: tensor parallelism's summed part of the input's gradient added.
template <typename T>
__global__ void moe_add_f32_kernel(T *dst, const float *src, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    fy_st(dst + i, fy_ld(dst + i) + src[i]);
}

// ---- the host side ----

// The workspace's parts (fy_cuda_moe_workspace_bytes), each 256-byte aligned: counts (E) int and
// right after them psum (E) fp32 (one copy down brings both), xs (cap,C), as (cap,F), dy (cap,C), dh (cap,F), dx (cap,C) in dt, dw (BT,K) fp32,
// dlog (BT,E) in dt; with tensor parallelism (d->tp_sum) last tp (BT,C) fp32, the partial sums
// that go over the group (in bf16, forward's output; in both dtypes, backward's input gradient's
// part). Forward uses the first three (and tp).
struct moe_ws {
  int *counts;
  float *psum;
  char *xs, *as, *dy, *dh, *dx;
  float *dw;
  char *dlog;
  float *tp;
};

static size_t ws_round(size_t n) { return (n + 255) / 256 * 256; }

static size_t moe_ws_layout(const struct fy_moe_dims *d, size_t es, char *base, struct moe_ws *w) {
  const size_t cap = (size_t)fy_moe_rows_cap(d->BT, d->E, d->K);
  const size_t sizes[9] = {(size_t)d->E * 8, cap * d->C * es, cap * d->F * es, cap * d->C * es,
                           cap * d->F * es, cap * d->C * es, (size_t)(d->BT * d->K) * 4, (size_t)(d->BT * d->E) * es,
                           d->tp_sum ? (size_t)(d->BT * d->C) * 4 : 0};
  char *p[9];
  size_t off = 0;
  for (int i = 0; i < 9; i++) {
    p[i] = base ? base + off : NULL;
    off += ws_round(sizes[i]);
  }
  if (w) *w = (struct moe_ws){(int *)p[0], p[0] ? (float *)(p[0] + (size_t)d->E * 4) : NULL, p[1], p[2], p[3], p[4], p[5],
                              (float *)p[6], p[7], d->tp_sum ? (float *)p[8] : NULL};
  return off;
}

extern "C" size_t fy_cuda_moe_workspace_bytes(const struct fy_moe_dims *d, enum fy_dtype dt) {
  return moe_ws_layout(d, fy_dtype_size(dt), NULL, NULL);
}

extern "C" size_t fy_cuda_moe_pinned_bytes(const struct fy_moe_dims *d) { return (size_t)d->E * 8; }

// The counts (and the probabilities' sums) down to pinned memory, then the one wait.
static fy_status moe_counts_down(int *host, const struct moe_ws *w, int E, cudaStream_t st) {
  if (cudaMemcpyAsync(host, w->counts, (size_t)E * 8, cudaMemcpyDeviceToHost, st) != cudaSuccess ||
      cudaStreamSynchronize(st) != cudaSuccess)
    return fy_error_set(FY_ERR_INTERNAL, "cuda moe: reading the experts' token counts: %s",
                        cudaGetErrorString(cudaGetLastError()));
  return FY_OK;
}

// The activation in place or into another buffer, over n elements.
static fy_status moe_act(void *out, const void *h, bool gelu, enum fy_dtype dt, int64_t n, cudaStream_t st) {
  return gelu ? fy_cuda_gelu_forward(out, h, dt, n, st) : fy_cuda_relu_forward(out, h, dt, n, st);
}

// The router alone (route's first E+2K entries a token); fy_cuda_moe_forward runs it first too.
extern "C" fy_status fy_cuda_moe_route(float *route, const void *inp, const void *gate, enum fy_dtype dt,
                                       const struct fy_moe_dims *d, cudaStream_t st) {
  const int E = d->E, K = d->K;
  if (E < 1 || K < 1 || K > E) return fy_error_set(FY_ERR_INVALID, "cuda moe: top %d of %d experts", K, E);
  FY_CUDA_DISPATCH("moe_route", dt, T,
                   moe_route_kernel<T><<<(unsigned)d->BT, 128, (size_t)E * 4, st>>>(
                       route, (const T *)inp, (const T *)gate, d->mask, d->C, E, K));
  return fy_cuda_launched("moe: routing");
}

extern "C" fy_status fy_cuda_moe_forward(struct fy_cuda_blas *h, void *out, float *route, void *rows, double *balance,
                                         const void *inp, const void *gate, const void *w1, const void *b1,
                                         const void *w2, const void *b2, enum fy_dtype dt, const struct fy_moe_dims *d,
                                         void *work, void *pinned, cudaStream_t st) {
  const int64_t BT = d->BT, C = d->C, F = d->F, cap = fy_moe_rows_cap(BT, d->E, d->K);
  const int E = d->E, K = d->K;
  if (cap >= (int64_t)1 << 24)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda moe: %lld routed rows (the routing record holds rows below 2^24)",
                        (long long)cap);
  if (E < 1 || K < 1 || K > E) return fy_error_set(FY_ERR_INVALID, "cuda moe: top %d of %d experts", K, E);
  const size_t es = fy_dtype_size(dt);
  struct moe_ws w;
  moe_ws_layout(d, es, (char *)work, &w);
  char *hb = (char *)rows, *yb = hb + (size_t)(cap * F) * es;  // h (cap,F) then y (cap,C), in dt
  int *hc = (int *)pinned;
  const float *hp = (const float *)pinned + E;
  FY_TRY(fy_cuda_moe_route(route, inp, gate, dt, d, st));
  FY_CUDA_DISPATCH("moe_forward", dt, T,
                   moe_count_kernel<<<E, MOE_THREADS, 0, st>>>(w.counts, w.psum, route, BT, E, K);
                   moe_place_kernel<<<E, MOE_THREADS, 0, st>>>(route, w.counts, BT, E, K);
                   moe_gather_kernel<T><<<(unsigned)BT, 128, 0, st>>>((T *)w.xs, (const T *)inp, route, C, E, K);
                   moe_pad_kernel<T><<<E, MOE_THREADS, 0, st>>>((T *)w.xs, w.counts, C));
  FY_TRY(fy_cuda_launched("moe_forward: routing"));
  FY_TRY(moe_counts_down(hc, &w, E, st));
  // h (R,F) = xs (R,C) @ w1_e^T + b1_e per expert, as = act(h) over all rows, y (R,C) = as @ w2_e^T + b2_e
  int64_t off = 0;
  for (int e = 0; e < E; e++) {
    const int64_t R = fy_moe_rows(hc[e]);
    if (R)
      FY_TRY(fy_cuda_linear_forward(h, hb + (size_t)(off * F) * es, w.xs + (size_t)(off * C) * es,
                                    (const char *)w1 + (size_t)(e * F * C) * es,
                                    b1 ? (const char *)b1 + (size_t)(e * F) * es : NULL, dt, R, C, F, st));
    off += R;
  }
  const int64_t total = off;
  FY_TRY(moe_act(w.as, hb, d->gelu, dt, total * F, st));
  off = 0;
  for (int e = 0; e < E; e++) {
    const int64_t R = fy_moe_rows(hc[e]);
    if (R)
      FY_TRY(fy_cuda_linear_forward(h, yb + (size_t)(off * C) * es, w.as + (size_t)(off * F) * es,
                                    (const char *)w2 + (size_t)(e * C * F) * es,
                                    b2 ? (const char *)b2 + (size_t)(e * C) * es : NULL, dt, R, F, C, st));
    off += R;
  }
  // Tensor parallelism: each rank's y rows are partial products (its F columns of fc2; fc2's bias
  // from one rank), so the combine is too: summed over the group in fp32 (in place in fp32; in
  // bf16 through tp, then rounded once), as the cpu's kernels sum it.
  float *acc = d->tp_sum && dt != FY_F32 ? w.tp : NULL;
  if (acc) {
    FY_CUDA_DISPATCH("moe_forward", dt, T,
                     moe_combine_kernel<float, T><<<(unsigned)BT, 128, 0, st>>>(acc, (const T *)yb, route, C, E, K));
  } else {
    FY_CUDA_DISPATCH("moe_forward", dt, T,
                     moe_combine_kernel<T, T><<<(unsigned)BT, 128, 0, st>>>((T *)out, (const T *)yb, route, C, E, K));
  }
  FY_TRY(fy_cuda_launched("moe_forward: combine"));
  if (d->tp_sum) {
    FY_TRY(d->tp_sum(d->tp_ctx, acc ? acc : (float *)out, BT * C));
    if (acc) FY_TRY(fy_cuda_convert(out, dt, acc, FY_F32, BT * C, st));
  }
  // E x sum_e f_e P_e, from the counts and the probabilities' sums (fp32 sums on the device), over
  // the N routed tokens (every token without a mask; none routed: 0).
  int64_t N = 0;
  for (int e = 0; e < E; e++) N += hc[e];
  N /= K;
  double b = 0;
  for (int e = 0; e < E && N > 0; e++) b += (double)hc[e] / (double)N * ((double)hp[e] / (double)N);
  *balance = (double)E * b;
  return FY_OK;
}

extern "C" fy_status fy_cuda_moe_backward(struct fy_cuda_blas *h, void *dinp, void *dgate, void *dw1, void *db1,
                                          void *dw2, void *db2, const void *dout, const void *inp, const float *route,
                                          const void *rows, const void *gate, const void *w1, const void *w2,
                                          float dbalance, bool accumulate, enum fy_dtype dt,
                                          const struct fy_moe_dims *d, void *work, void *pinned, const int *counts,
                                          cudaStream_t st) {
  const int64_t BT = d->BT, C = d->C, F = d->F, cap = fy_moe_rows_cap(BT, d->E, d->K);
  const int E = d->E, K = d->K;
  const size_t es = fy_dtype_size(dt);
  struct moe_ws w;
  moe_ws_layout(d, es, (char *)work, &w);
  const char *hb = (const char *)rows, *yb = hb + (size_t)(cap * F) * es;
  FY_CUDA_DISPATCH("moe_backward", dt, T,
                   moe_count_kernel<<<E, MOE_THREADS, 0, st>>>(w.counts, w.psum, route, BT, E, K);
                   moe_gather_kernel<T><<<(unsigned)BT, 128, 0, st>>>((T *)w.xs, (const T *)inp, route, C, E, K);
                   moe_pad_kernel<T><<<E, MOE_THREADS, 0, st>>>((T *)w.xs, w.counts, C);
                   moe_dispatch_grad_kernel<T><<<(unsigned)BT, 128, 0, st>>>((T *)w.dy, w.dw, (const T *)dout,
                                                                              (const T *)yb, route, C, E, K);
                   moe_pad_kernel<T><<<E, MOE_THREADS, 0, st>>>((T *)w.dy, w.counts, C));
  FY_TRY(fy_cuda_launched("moe_backward: dispatch"));
  // Tensor parallelism: y is this rank's part, so are the weights' gradients dw: summed over the
  // group, the router's gradient is then the same on every rank, as the router is.
  if (d->tp_sum) FY_TRY(d->tp_sum(d->tp_ctx, w.dw, BT * K));
  // The products' row counts: the forward's (no wait), else the ones just counted, brought down.
  const int *hc = counts;
  if (!hc) {
    FY_TRY(moe_counts_down((int *)pinned, &w, E, st));
    hc = (const int *)pinned;
  }
  int64_t total = 0;
  for (int e = 0; e < E; e++) total += fy_moe_rows(hc[e]);
  FY_TRY(moe_act(w.as, hb, d->gelu, dt, total * F, st));
  // Per expert: dh (R,F) = dy (R,C) @ w2_e (C,F) (before dw2 is written: the gradient may share the
  // weight's memory), then dw2_e (C,F) (+)= dy^T @ as, db2_e (+)= column sums of dy. An expert with
  // no token: its gradient zero (or, accumulating, unchanged).
  int64_t off = 0;
  for (int e = 0; e < E; e++) {
    const int64_t R = fy_moe_rows(hc[e]);
    char *gw2 = (char *)dw2 + (size_t)(e * C * F) * es, *gb2 = db2 ? (char *)db2 + (size_t)(e * C) * es : NULL;
    if (R == 0) {
      if (!accumulate) {
        if (cudaMemsetAsync(gw2, 0, (size_t)(C * F) * es, st) != cudaSuccess ||
            (gb2 && cudaMemsetAsync(gb2, 0, (size_t)C * es, st) != cudaSuccess))
          return fy_cuda_launched("moe_backward: an expert without tokens");
      }
      continue;
    }
    FY_TRY(fy_cuda_matmul(h, w.dh + (size_t)(off * F) * es, w.dy + (size_t)(off * C) * es,
                          (const char *)w2 + (size_t)(e * C * F) * es, NULL, dt, R, F, C, false, false, 1.0f, 0.0f, st));
    FY_TRY(fy_cuda_linear_backward_params(h, gw2, gb2, w.dy + (size_t)(off * C) * es, w.as + (size_t)(off * F) * es, dt,
                                          R, F, C, accumulate, st));
    off += R;
  }
  // dh *= act'(h), over all rows at once
  if (d->gelu) FY_TRY(fy_cuda_gelu_backward(w.dh, w.dh, hb, dt, total * F, st));
  else FY_TRY(fy_cuda_relu_backward(w.dh, w.dh, w.as, dt, total * F, st));
  // Per expert: dx (R,C) = dh (R,F) @ w1_e (F,C), then dw1_e (F,C) (+)= dh^T @ xs, db1_e (+)= sums of dh.
  off = 0;
  for (int e = 0; e < E; e++) {
    const int64_t R = fy_moe_rows(hc[e]);
    char *gw1 = (char *)dw1 + (size_t)(e * F * C) * es, *gb1 = db1 ? (char *)db1 + (size_t)(e * F) * es : NULL;
    if (R == 0) {
      if (!accumulate) {
        if (cudaMemsetAsync(gw1, 0, (size_t)(F * C) * es, st) != cudaSuccess ||
            (gb1 && cudaMemsetAsync(gb1, 0, (size_t)F * es, st) != cudaSuccess))
          return fy_cuda_launched("moe_backward: an expert without tokens");
      }
      continue;
    }
    if (dinp)
      FY_TRY(fy_cuda_matmul(h, w.dx + (size_t)(off * C) * es, w.dh + (size_t)(off * F) * es,
                            (const char *)w1 + (size_t)(e * F * C) * es, NULL, dt, R, C, F, false, false, 1.0f, 0.0f,
                            st));
    FY_TRY(fy_cuda_linear_backward_params(h, gw1, gb1, w.dh + (size_t)(off * F) * es, w.xs + (size_t)(off * C) * es, dt,
                                          R, C, F, accumulate, st));
    off += R;
  }
  // The router: dlog (BT,E), then dinp (BT,C) += dlog @ gate (E,C) and each token's rows of dx
  // (before dgate is written, as above), and dgate (E,C) (+)= dlog^T @ inp (BT,C).
  // (the balance term's 1/N on the device, from the counts counted there: N is not on the host)
  FY_CUDA_DISPATCH("moe_backward", dt, T,
                   moe_router_grad_kernel<T><<<(unsigned)((BT + 127) / 128), 128, 0, st>>>(
                       (T *)w.dlog, route, w.dw, w.counts, BT, E, K, dbalance * (float)E));
  FY_TRY(fy_cuda_launched("moe_backward: router"));
  if (dinp) {
    FY_TRY(fy_cuda_matmul(h, dinp, w.dlog, gate, NULL, dt, BT, C, E, false, false, 1.0f, 1.0f, st));
    if (d->tp_sum) {
      // Tensor parallelism: dx is this rank's part (its F columns of fc1): the tokens' sums of it
      // into tp (fp32, from zeros), summed over the group, then added (the router's term above is
      // whole on every rank already), as the cpu's kernels do.
      if (cudaMemsetAsync(w.tp, 0, (size_t)(BT * C) * 4, st) != cudaSuccess)
        return fy_cuda_launched("moe_backward: the input gradient's part");
      FY_CUDA_DISPATCH("moe_backward", dt, T,
                       moe_scatter_add_kernel<float, T><<<(unsigned)BT, 128, 0, st>>>(w.tp, (const T *)w.dx, route,
                                                                                       C, E, K));
      FY_TRY(fy_cuda_launched("moe_backward: scatter"));
      FY_TRY(d->tp_sum(d->tp_ctx, w.tp, BT * C));
      FY_CUDA_DISPATCH("moe_backward", dt, T,
                       moe_add_f32_kernel<T><<<(unsigned)((BT * C + 255) / 256 < 4096 ? (BT * C + 255) / 256 : 4096),
                                               256, 0, st>>>((T *)dinp, w.tp, BT * C));
      FY_TRY(fy_cuda_launched("moe_backward: the input gradient's sum"));
    } else {
      FY_CUDA_DISPATCH("moe_backward", dt, T,
                       moe_scatter_add_kernel<T, T><<<(unsigned)BT, 128, 0, st>>>((T *)dinp, (const T *)w.dx, route,
                                                                                  C, E, K));
      FY_TRY(fy_cuda_launched("moe_backward: scatter"));
    }
  }
  return fy_cuda_matmul(h, dgate, w.dlog, inp, NULL, dt, E, C, BT, true, false, 1.0f, accumulate ? 1.0f : 0.0f, st);
}

// ---- expert parallelism's pieces (runtime/ep_cuda.c) ----
// The steps of fy_cuda_moe_forward and _backward above, apart, so that the rows can go to the ranks
// holding their experts and back in between. The rows stay in the padded dispatch layout all the
// way: a source's block for expert e is fy_moe_rows(n_e) rows (its rounding rows zeros), the
// blocks of one rank's experts are contiguous, and a rank holding experts computes each block it
// receives as one product of that many rows, as one rank computes that expert for its own tokens.

extern "C" void fy_cuda_moe_ep_buffers(const struct fy_moe_dims *d, enum fy_dtype dt, void *work, void **xs, void **dy,
                                       void **dx) {
  struct moe_ws w;
  moe_ws_layout(d, fy_dtype_size(dt), (char *)work, &w);
  *xs = w.xs, *dy = w.dy, *dx = w.dx;
}

extern "C" fy_status fy_cuda_moe_ep_route(float *route, double *balance, const void *inp, const void *gate,
                                          enum fy_dtype dt, const struct fy_moe_dims *d, void *work, void *pinned,
                                          cudaStream_t st) {
  const int64_t BT = d->BT, C = d->C, cap = fy_moe_rows_cap(BT, d->E, d->K);
  const int E = d->E, K = d->K;
  if (cap >= (int64_t)1 << 24)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda moe: %lld routed rows (the routing record holds rows below 2^24)",
                        (long long)cap);
  struct moe_ws w;
  moe_ws_layout(d, fy_dtype_size(dt), (char *)work, &w);
  FY_TRY(fy_cuda_moe_route(route, inp, gate, dt, d, st));
  FY_CUDA_DISPATCH("moe_ep_route", dt, T,
                   moe_count_kernel<<<E, MOE_THREADS, 0, st>>>(w.counts, w.psum, route, BT, E, K);
                   moe_place_kernel<<<E, MOE_THREADS, 0, st>>>(route, w.counts, BT, E, K);
                   moe_gather_kernel<T><<<(unsigned)BT, 128, 0, st>>>((T *)w.xs, (const T *)inp, route, C, E, K);
                   moe_pad_kernel<T><<<E, MOE_THREADS, 0, st>>>((T *)w.xs, w.counts, C));
  FY_TRY(fy_cuda_launched("moe_ep_route"));
  FY_TRY(moe_counts_down((int *)pinned, &w, E, st));
  const int *hc = (const int *)pinned;
  const float *hp = (const float *)pinned + E;
  double b = 0;  // (as fy_cuda_moe_forward's)
  for (int e = 0; e < E; e++) b += (double)hc[e] / (double)BT * ((double)hp[e] / (double)BT);
  *balance = (double)E * b;
  return FY_OK;
}

extern "C" fy_status fy_cuda_moe_ep_experts_forward(struct fy_cuda_blas *h, void *y, void *hrows, void *as,
                                                    const void *x, const int *ex, const int64_t *cnt, int nb,
                                                    const void *w1, const void *b1, const void *w2, const void *b2,
                                                    enum fy_dtype dt, const struct fy_moe_dims *d, cudaStream_t st) {
  const int64_t C = d->C, F = d->F;
  const size_t es = fy_dtype_size(dt);
  int64_t off = 0;
  for (int i = 0; i < nb; i++) {  // h (R,F) = x (R,C) @ w1_e^T + b1_e
    const int64_t R = fy_moe_rows(cnt[i]), e = ex[i];
    if (R)
      FY_TRY(fy_cuda_linear_forward(h, (char *)hrows + (size_t)(off * F) * es, (const char *)x + (size_t)(off * C) * es,
                                    (const char *)w1 + (size_t)(e * F * C) * es,
                                    b1 ? (const char *)b1 + (size_t)(e * F) * es : NULL, dt, R, C, F, st));
    off += R;
  }
  if (off) FY_TRY(moe_act(as, hrows, d->gelu, dt, off * F, st));
  off = 0;
  for (int i = 0; i < nb; i++) {  // y (R,C) = act(h) @ w2_e^T + b2_e
    const int64_t R = fy_moe_rows(cnt[i]), e = ex[i];
    if (R)
      FY_TRY(fy_cuda_linear_forward(h, (char *)y + (size_t)(off * C) * es, (const char *)as + (size_t)(off * F) * es,
                                    (const char *)w2 + (size_t)(e * C * F) * es,
                                    b2 ? (const char *)b2 + (size_t)(e * C) * es : NULL, dt, R, F, C, st));
    off += R;
  }
  return FY_OK;
}

extern "C" fy_status fy_cuda_moe_ep_combine(void *out, const void *y, const float *route, enum fy_dtype dt,
                                            const struct fy_moe_dims *d, cudaStream_t st) {
  FY_CUDA_DISPATCH("moe_ep_combine", dt, T,
                   moe_combine_kernel<T, T><<<(unsigned)d->BT, 128, 0, st>>>((T *)out, (const T *)y, route, d->C, d->E,
                                                                          d->K));
  return fy_cuda_launched("moe_ep_combine");
}

extern "C" fy_status fy_cuda_moe_ep_dispatch_grad(const void *dout, const void *y, const float *route, enum fy_dtype dt,
                                                  const struct fy_moe_dims *d, void *work, cudaStream_t st) {
  const int64_t BT = d->BT, C = d->C;
  const int E = d->E, K = d->K;
  struct moe_ws w;
  moe_ws_layout(d, fy_dtype_size(dt), (char *)work, &w);
  FY_CUDA_DISPATCH("moe_ep_dispatch_grad", dt, T,
                   moe_count_kernel<<<E, MOE_THREADS, 0, st>>>(w.counts, w.psum, route, BT, E, K);
                   moe_dispatch_grad_kernel<T><<<(unsigned)BT, 128, 0, st>>>((T *)w.dy, w.dw, (const T *)dout,
                                                                              (const T *)y, route, C, E, K);
                   moe_pad_kernel<T><<<E, MOE_THREADS, 0, st>>>((T *)w.dy, w.counts, C));
  return fy_cuda_launched("moe_ep_dispatch_grad");
}

// One linear layer's backward over blocks of rows, block i (fy_moe_rows(cnt[i]) rows; none:
// skipped) of expert ex[i], the blocks one after another in din, dout and in: din (R,IN) = dout
// (R,OUT) @ w_e (OUT,IN), dw_e (OUT,IN) += dout^T @ in, db_e (OUT) += column sums of dout.
static fy_status blocks_linear_backward(struct fy_cuda_blas *h, void *din, void *dw, void *db, const void *dout,
                                        const void *in, const void *w, const int *ex, const int64_t *cnt, int nb,
                                        int64_t IN, int64_t OUT, enum fy_dtype dt, cudaStream_t st) {
  const size_t es = fy_dtype_size(dt);
  int64_t off = 0;
  for (int i = 0; i < nb; i++) {
    const int64_t R = fy_moe_rows(cnt[i]), e = ex[i];
    if (!R) continue;
    FY_TRY(fy_cuda_matmul(h, (char *)din + (size_t)(off * IN) * es, (const char *)dout + (size_t)(off * OUT) * es,
                          (const char *)w + (size_t)(e * OUT * IN) * es, NULL, dt, R, IN, OUT, false, false, 1.0f,
                          0.0f, st));
    FY_TRY(fy_cuda_linear_backward_params(h, (char *)dw + (size_t)(e * OUT * IN) * es,
                                          db ? (char *)db + (size_t)(e * OUT) * es : NULL,
                                          (const char *)dout + (size_t)(off * OUT) * es,
                                          (const char *)in + (size_t)(off * IN) * es, dt, R, IN, OUT, true, st));
    off += R;
  }
  return FY_OK;
}

extern "C" fy_status fy_cuda_moe_ep_experts_backward(struct fy_cuda_blas *h, void *dx, void *dw1, void *db1, void *dw2,
                                                     void *db2, void *as, void *dh, const void *dy, const void *x,
                                                     const void *hrows, const int *ex, const int64_t *cnt, int nb,
                                                     int experts, const void *w1, const void *w2, bool accumulate,
                                                     enum fy_dtype dt, const struct fy_moe_dims *d, cudaStream_t st) {
  const int64_t C = d->C, F = d->F;
  const size_t es = fy_dtype_size(dt);
  // Each block's gradients add to its expert's, in block (source) order, onto zeros unless
  // accumulating: 0 + g_0 + g_1 .. as the replicas' all-reduce adds them in rank order (an expert
  // that got no row keeps its zeros).
  if (!accumulate) {
    const size_t n = (size_t)experts * (size_t)(F * C) * es;
    if (cudaMemsetAsync(dw1, 0, n, st) != cudaSuccess || cudaMemsetAsync(dw2, 0, n, st) != cudaSuccess ||
        (db1 && cudaMemsetAsync(db1, 0, (size_t)(experts * F) * es, st) != cudaSuccess) ||
        (db2 && cudaMemsetAsync(db2, 0, (size_t)(experts * C) * es, st) != cudaSuccess))
      return fy_cuda_launched("moe_ep_experts_backward: zeros");
  }
  int64_t total = 0;
  for (int i = 0; i < nb; i++) total += fy_moe_rows(cnt[i]);
  if (!total) return FY_OK;
  FY_TRY(moe_act(as, hrows, d->gelu, dt, total * F, st));
  // Per block: dh (R,F) = dy (R,C) @ w2_e (C,F), dw2_e += dy^T @ as, db2_e += column sums of dy
  FY_TRY(blocks_linear_backward(h, dh, dw2, db2, dy, as, w2, ex, cnt, nb, F, C, dt, st));
  if (d->gelu) FY_TRY(fy_cuda_gelu_backward(dh, dh, hrows, dt, total * F, st));
  else FY_TRY(fy_cuda_relu_backward(dh, dh, as, dt, total * F, st));
  // Per block: dx (R,C) = dh (R,F) @ w1_e (F,C), dw1_e += dh^T @ x, db1_e += column sums of dh
  FY_TRY(blocks_linear_backward(h, dx, dw1, db1, dh, x, w1, ex, cnt, nb, C, F, dt, st));
  return FY_OK;
}

extern "C" fy_status fy_cuda_moe_ep_route_backward(struct fy_cuda_blas *h, void *dinp, void *dgate, const void *inp,
                                                   const float *route, const void *gate, float dbalance,
                                                   bool accumulate, enum fy_dtype dt, const struct fy_moe_dims *d,
                                                   void *work, cudaStream_t st) {
  const int64_t BT = d->BT, C = d->C;
  const int E = d->E, K = d->K;
  struct moe_ws w;
  moe_ws_layout(d, fy_dtype_size(dt), (char *)work, &w);
  const float bal = dbalance * (float)E;  // (as fy_cuda_moe_backward's router, from here on)
  FY_CUDA_DISPATCH("moe_ep_route_backward", dt, T,
                   moe_router_grad_kernel<T><<<(unsigned)((BT + 127) / 128), 128, 0, st>>>((T *)w.dlog, route, w.dw,
                                                                                           w.counts, BT, E, K, bal));
  FY_TRY(fy_cuda_launched("moe_ep_route_backward: router"));
  if (dinp) {
    FY_TRY(fy_cuda_matmul(h, dinp, w.dlog, gate, NULL, dt, BT, C, E, false, false, 1.0f, 1.0f, st));
    FY_CUDA_DISPATCH("moe_ep_route_backward", dt, T,
                     moe_scatter_add_kernel<T, T><<<(unsigned)BT, 128, 0, st>>>((T *)dinp, (const T *)w.dx, route, C,
                                                                                E, K));
    FY_TRY(fy_cuda_launched("moe_ep_route_backward: scatter"));
  }
  return fy_cuda_matmul(h, dgate, w.dlog, inp, NULL, dt, E, C, BT, true, false, 1.0f, accumulate ? 1.0f : 0.0f, st);
}
