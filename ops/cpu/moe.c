// A mixture-of-experts feed-forward block (ops/ops.h, "mixture of experts"): a linear router, a
// softmax over the experts, top-K with the chosen probabilities renormalised, every routed token
// computed (dropless), and the Switch/Mixtral load-balancing term.
//
// Tokens are gathered per expert, so that each expert's two products are one product of its own
// rows through the same oneDNN path as the dense feed-forward (fy_linear_forward and its backward).
// Expert e's rows start at off[e] in the dispatch layout, its tokens in increasing order (a token's
// choices in the order chosen), its row count rounded up by fy_moe_rows with rows of zeros.
// Everything adds in a fixed order: the result depends on the routing, never on the threads.
// A token that d->mask marks as padding has every router logit masked: it goes to no expert (its
// choices -1, its weights 0), its output row is 0 (the layer passes the residual alone), it has no
// part in the balance term and no gradient through the block.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/graph.h"
#include "ops/ops.h"

// c (M,N) = a (M,K) @ b (K,N) or b^T, + beta c: fp32, or bf16 operands as fy_linear_forward's.
static fy_status mm(float *c, const float *a, const float *b, int64_t M, int64_t N, int64_t K, bool tb, float beta,
                    bool bf16) {
  if (bf16) return fy_matmul16(c, a, b, NULL, M, N, K, false, tb, beta);
  return fy_matmul(c, a, b, M, N, K, false, tb, 1.0f, beta);
}

// The gathered rows and the backward's scratch, kept from call to call and grown as needed (one
// caller at a time, as every product: ops/cpu/matmul.c). Sized by the bound fy_moe_rows_cap, not by
// a call's rows, so that a model's calls share one allocation: a fresh one each call touched ~165 MB
// of new pages a step of opt-125m-moe8 at 4 x 128 (page faults, and the kernel zeroing them). The
// expert-parallel pieces (ops/cpu/moe_ep.c) take their scratch from it too.
static float *moe_ws;
static size_t moe_ws_floats;

float *fy_moe_workspace(size_t floats) {
  if (floats > moe_ws_floats) {
    free(moe_ws);
    moe_ws = malloc(floats * 4);
    moe_ws_floats = moe_ws ? floats : 0;
  }
  return moe_ws;
}

void fy_moe_workspace_free(void) {
  free(moe_ws);
  moe_ws = NULL;
  moe_ws_floats = 0;
}

// Whether token t is routed (not padding).
static inline bool moe_routed(const struct fy_moe_dims *d, int64_t t) { return !d->mask || d->mask[t] != 0; }

// The tokens routed (not padding).
static int64_t moe_routed_tokens(const struct fy_moe_dims *d) {
  int64_t N = 0;
  for (int64_t t = 0; t < d->BT; t++) N += moe_routed(d, t);
  return N;
}

// Per expert: its token-choices n[e] and the first row off[e] of its rounded block, from the
// chosen experts in route; returns the rows of all blocks (<= fy_moe_rows_cap).
static int64_t moe_layout(const float *route, const struct fy_moe_dims *d, int64_t *n, int64_t *off) {
  const int64_t S = d->E + 3 * d->K;
  for (int e = 0; e < d->E; e++) n[e] = 0;
  for (int64_t t = 0; t < d->BT; t++)
    for (int j = 0; j < d->K && moe_routed(d, t); j++) n[(int)route[t * S + d->E + j]]++;
  int64_t rows = 0;
  for (int e = 0; e < d->E; e++) {
    off[e] = rows;
    rows += fy_moe_rows(n[e]);
  }
  return rows;
}

// xs (rows, C): the tokens' inputs in the dispatch layout (rounding rows zero).
static void moe_gather(float *xs, const float *inp, const float *route, const struct fy_moe_dims *d,
                       const int64_t *n, const int64_t *off, int64_t rows) {
  const int64_t S = d->E + 3 * d->K, C = d->C;
  for (int e = 0; e < d->E; e++)
    memset(xs + (off[e] + n[e]) * C, 0, (size_t)((fy_moe_rows(n[e]) - n[e]) * C) * 4);
  (void)rows;
#pragma omp parallel for schedule(static) if (d->BT * C > FY_PAR_ROWS)
  for (int64_t t = 0; t < d->BT; t++)
    for (int j = 0; j < d->K && moe_routed(d, t); j++)
      memcpy(xs + (int64_t)route[t * S + d->E + 2 * d->K + j] * C, inp + t * C, (size_t)C * 4);
}

static void moe_act(float *a, const float *h, int64_t n, bool gelu) {
  if (gelu) fy_gelu_forward(a, h, n);
  else fy_relu_forward(a, h, n);
}

// inp (BT,C), gate (E,C) -> route (BT, E+3K): the softmax, the K chosen and their weights (the
// rows column is forward's). Alone, it tells an offloaded step which experts' weights to load.
fy_status fy_moe_route(float *route, const float *inp, const float *gate, const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, C = d->C, E = d->E, K = d->K, S = E + 3 * K;
  // logits (BT,E) = inp (BT,C) @ gate^T (C,E), written with the routing record's row stride
  FY_TRY(fy_matmul_bias(route, inp, gate, NULL, 1, BT, E, C, false, true, 1.0f, 0.0f, 0, 0, S, 0, 0, 0));
  // Softmax, the top K (the larger probability first, the lower index on a tie) and their weights.
#pragma omp parallel for schedule(static) if (BT * E > FY_PAR_ROWS)
  for (int64_t t = 0; t < BT; t++) {
    float *r = route + t * S;
    float mx = r[0], sum = 0;
    for (int64_t e = 1; e < E; e++) mx = r[e] > mx ? r[e] : mx;
    for (int64_t e = 0; e < E; e++) sum += r[e] = expf(r[e] - mx);
    for (int64_t e = 0; e < E; e++) r[e] /= sum;
    float chosen = 0;
    for (int64_t j = 0; j < K; j++) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; e++) {
        bool taken = false;
        for (int64_t i = 0; i < j; i++) taken |= (int64_t)r[E + i] == e;
        if (!taken && (best < 0 || r[e] > r[best])) best = e;
      }
      r[E + j] = (float)best;
      chosen += r[best];
    }
    for (int64_t j = 0; j < K; j++) r[E + K + j] = r[(int64_t)r[E + j]] / chosen;
    if (!moe_routed(d, t))  // padding: no expert (its probabilities stay, counted nowhere)
      for (int64_t j = 0; j < K; j++) r[E + j] = -1.0f, r[E + K + j] = 0.0f, r[E + 2 * K + j] = -1.0f;
  }
  return FY_OK;
}

// inp (BT,C), gate (E,C), w1 (E*F,C), b1 (E*F) or NULL, w2 (E*C,F), b2 (E*C) or NULL
//   -> out (BT,C), route (BT, E+3K), rows (fy_moe_rows_cap, F) fc1 outputs then (.., C) the experts'
//      outputs, *balance
fy_status fy_moe_forward(float *out, float *route, float *rows, double *balance, const float *inp, const float *gate,
                         const float *w1, const float *b1, const float *w2, const float *b2,
                         const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, C = d->C, F = d->F, E = d->E, K = d->K, S = E + 3 * K;
  const int64_t cap = fy_moe_rows_cap(BT, E, K);
  if (cap >= (int64_t)1 << 24) return fy_error_set(FY_ERR_UNSUPPORTED, "mixture of experts: %lld routed rows "
                                                   "(the routing record holds rows below 2^24)", (long long)cap);
  FY_TRY(fy_moe_route(route, inp, gate, d));
  int64_t n[E], off[E], fill[E];
  const int64_t total = moe_layout(route, d, n, off);
  for (int64_t e = 0; e < E; e++) fill[e] = off[e];
  for (int64_t t = 0; t < BT; t++)
    for (int64_t j = 0; j < K && moe_routed(d, t); j++)
      route[t * S + E + 2 * K + j] = (float)fill[(int64_t)route[t * S + E + j]]++;
  float *h = rows, *y = rows + cap * F;
  // xs (total,C), as (total,F) in the backward's workspace (its size, so that it is made once)
  float *xs = fy_moe_workspace((size_t)(cap * (3 * C + 2 * F) + BT * (K + E + C)));
  if (!xs) return fy_error_set(FY_ERR_NOMEM, "mixture of experts: cannot allocate %lld rows", (long long)cap);
  float *as = xs + total * C;
  moe_gather(xs, inp, route, d, n, off, total);
  fy_status st = FY_OK;
  for (int64_t e = 0; e < E && st == FY_OK; e++) {
    const int64_t R = fy_moe_rows(n[e]), o = off[e];
    if (R == 0) continue;
    // h (R,F) = xs (R,C) @ w1_e^T + b1_e; as = act(h); y (R,C) = as @ w2_e^T + b2_e
    st = fy_linear_forward(h + o * F, xs + o * C, w1 + e * F * C, b1 ? b1 + e * F : NULL, R, C, F, d->bf16);
    if (st != FY_OK) break;
    moe_act(as + o * F, h + o * F, R * F, d->gelu);
    st = fy_linear_forward(y + o * C, as + o * F, w2 + e * C * F, b2 ? b2 + e * C : NULL, R, F, C, d->bf16);
  }
  FY_TRY(st);
  // out[t] = sum_j weight_j y[row of choice j], the choices in order.
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
  for (int64_t t = 0; t < BT; t++) {
    const float *r = route + t * S;
    float *o = out + t * C;
    for (int64_t c = 0; c < C; c++) o[c] = 0;
    for (int64_t j = 0; j < K && moe_routed(d, t); j++) {
      const float w = r[E + K + j], *yr = y + (int64_t)r[E + 2 * K + j] * C;
      for (int64_t c = 0; c < C; c++) o[c] += w * yr[c];
    }
  }
  // Tensor parallelism: each rank's y rows are partial products (its F columns of fc2), so the
  // weighted combine is too, and sums to the whole over the group (fc2's bias from one rank).
  if (d->tp_sum) FY_TRY(d->tp_sum(d->tp_ctx, out, BT * C));
  // E x sum_e f_e P_e: f_e the token-choices routed to e over the routed tokens, P_e their mean
  // probability of e (padding left out of both, as Mixtral's attention mask leaves it; none: 0).
  const int64_t N = moe_routed_tokens(d);
  double b = 0;
  for (int64_t e = 0; e < E && N > 0; e++) {
    double p = 0;
    for (int64_t t = 0; t < BT; t++)
      if (moe_routed(d, t)) p += route[t * S + e];
    b += (double)n[e] / (double)N * (p / (double)N);
  }
  *balance = (double)E * b;
  return FY_OK;
}

void fy_moe_combine_backward(float *dy, float *dw, const float *dout, const float *route, const float *y,
                             const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, C = d->C, E = d->E, K = d->K, S = E + 3 * K;
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
  for (int64_t t = 0; t < BT; t++) {
    const float *r = route + t * S, *g = dout + t * C;
    for (int64_t j = 0; j < K && moe_routed(d, t); j++) {
      const int64_t row = (int64_t)r[E + 2 * K + j];
      const float w = r[E + K + j], *yr = y + row * C;
      float *dyr = dy + row * C, s = 0;
      for (int64_t c = 0; c < C; c++) {
        dyr[c] = w * g[c];
        s += g[c] * yr[c];
      }
      dw[t * K + j] = s;
    }
  }
}

// The router's gradient: route (BT, E+3K), dw (BT,K) the gradients of each token's K weights, n (E)
// the experts' token-choices, dbalance -> dlog (BT,E), the gradient of the router's logits (d(weight_j)/
// d(p_m) for the renormalised weights, the balance term's, then the softmax's backward; padding none).
void fy_moe_router_dlogits(float *dlog, const float *route, const float *dw, const int64_t *n, float dbalance,
                           const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, E = d->E, K = d->K, S = E + 3 * K;
  // The router: d(weight_j)/d(p_m) for the renormalised weights p_{i_j} / sum_i p_i, and the
  // balance term's d(P_e)/d(p[t][e]) = 1/N times E f_e (N the routed tokens); then the softmax's backward.
  const int64_t N = moe_routed_tokens(d);
  double f[E];
  for (int64_t e = 0; e < E; e++) f[e] = N > 0 ? (double)n[e] / (double)N : 0.0;
  const float bal = N > 0 ? dbalance * (float)E / (float)N : 0.0f;
#pragma omp parallel for schedule(static) if (BT * E > FY_PAR_ROWS)
  for (int64_t t = 0; t < BT; t++) {
    const float *r = route + t * S;
    if (!moe_routed(d, t)) {  // padding: no gradient through the router
      for (int64_t e = 0; e < E; e++) dlog[t * E + e] = 0.0f;
      continue;
    }
    float dp[E], chosen = 0, wdw = 0;
    for (int64_t e = 0; e < E; e++) dp[e] = bal * (float)f[e];
    for (int64_t j = 0; j < K; j++) {
      chosen += r[(int64_t)r[E + j]];
      wdw += dw[t * K + j] * r[E + K + j];
    }
    for (int64_t j = 0; j < K; j++) dp[(int64_t)r[E + j]] += (dw[t * K + j] - wdw) / chosen;
    float pdp = 0;
    for (int64_t e = 0; e < E; e++) pdp += r[e] * dp[e];
    for (int64_t e = 0; e < E; e++) dlog[t * E + e] = r[e] * (dp[e] - pdp);
  }
}

// dout (BT,C), inp, route, rows, gate, w1, w2 as forward's; dbalance the balance term's weight in
// the objective -> dinp (BT,C) +=, dgate, dw1, db1, dw2, db2 (=, or += with accumulate; an expert
// that got no token: 0, or unchanged). db1 and db2 may be NULL (no biases).
fy_status fy_moe_backward(float *dinp, float *dgate, float *dw1, float *db1, float *dw2, float *db2, const float *dout,
                          const float *inp, const float *route, const float *rows, const float *gate, const float *w1,
                          const float *w2, float dbalance, bool accumulate, const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, C = d->C, F = d->F, E = d->E, K = d->K, S = E + 3 * K;
  const int64_t cap = fy_moe_rows_cap(BT, E, K);
  int64_t n[E], off[E];
  const int64_t total = moe_layout(route, d, n, off);
  const float *h = rows, *y = rows + cap * F;
  // xs (total,C), as (total,F), dy (total,C), dh (total,F), dx (total,C), dw (BT,K), dlog (BT,E),
  // with tensor parallelism the input gradient's part (BT,C)
  float *xs = fy_moe_workspace((size_t)(cap * (3 * C + 2 * F) + BT * (K + E + C)));
  if (!xs) return fy_error_set(FY_ERR_NOMEM, "mixture of experts: cannot allocate %lld rows", (long long)cap);
  float *as = xs + total * C, *dy = as + total * F, *dh = dy + total * C, *dx = dh + total * F;
  float *dw = dx + total * C, *dlog = dw + BT * K;
  moe_gather(xs, inp, route, d, n, off, total);
  for (int64_t e = 0; e < E; e++)
    memset(dy + (off[e] + n[e]) * C, 0, (size_t)((fy_moe_rows(n[e]) - n[e]) * C) * 4);
  // dy[row] = weight_j dout[t]; the weights' gradients dw[t][j] = dout[t] . y[row] (with tensor
  // parallelism y is this rank's part, so dw is, summed over the group: the router's gradient
  // below is then the same on every rank, as the router is).
  fy_moe_combine_backward(dy, dw, dout, route, y, d);
  if (d->tp_sum) FY_TRY(d->tp_sum(d->tp_ctx, dw, BT * K));
  fy_status st = FY_OK;
  for (int64_t e = 0; e < E && st == FY_OK; e++) {
    const int64_t R = fy_moe_rows(n[e]), o = off[e];
    float *gw1 = dw1 + e * F * C, *gb1 = db1 ? db1 + e * F : NULL, *gw2 = dw2 + e * C * F, *gb2 = db2 ? db2 + e * C : NULL;
    if (R == 0) {  // no token: its gradient is zero, defined all the same
      if (!accumulate) {
        memset(gw1, 0, (size_t)(F * C) * 4);
        memset(gw2, 0, (size_t)(C * F) * 4);
        if (gb1) memset(gb1, 0, (size_t)F * 4);
        if (gb2) memset(gb2, 0, (size_t)C * 4);
      }
      continue;
    }
    moe_act(as + o * F, h + o * F, R * F, d->gelu);
    // Each weight is read before its gradient is written: an offloaded step writes the gradients
    // over the weights (ops/ops.h).
    // dh (R,F) = dy (R,C) @ w2_e (C,F), then times act'(h)
    st = mm(dh + o * F, dy + o * C, w2 + e * C * F, R, F, C, false, 0.0f, d->bf16);
    // dw2_e (C,F) (+)= dy^T @ as, db2_e (+)= column sums of dy (the rounding rows are zeros)
    if (st == FY_OK) st = fy_linear_backward_params(gw2, gb2, dy + o * C, as + o * F, R, F, C, accumulate, d->bf16);
    if (st != FY_OK) break;
    if (d->gelu) {
      fy_gelu_backward(dh + o * F, dh + o * F, h + o * F, R * F);
    } else {
      fy_relu_backward(dh + o * F, dh + o * F, as + o * F, R * F);
    }
    // dx (R,C) = dh (R,F) @ w1_e (F,C); dw1_e (F,C) (+)= dh^T @ xs, db1_e (+)= column sums of dh
    st = mm(dx + o * C, dh + o * F, w1 + e * F * C, R, C, F, false, 0.0f, d->bf16);
    if (st == FY_OK) st = fy_linear_backward_params(gw1, gb1, dh + o * F, xs + o * C, R, C, F, accumulate, d->bf16);
  }
  FY_TRY(st);
  fy_moe_router_dlogits(dlog, route, dw, n, dbalance, d);
  if (dinp) {
    // dinp (BT,C) += dlog (BT,E) @ gate (E,C) (before dgate may overwrite gate), then each token's
    // rows of dx in the choices' order. With tensor parallelism dx is this rank's part (its F
    // columns of fc1): the tokens' sums of it go to part (BT,C), summed over the group, then added;
    // the router's term is whole on every rank already.
    float *part = d->tp_sum ? dlog + BT * E : dinp;
    if (d->tp_sum) memset(part, 0, (size_t)(BT * C) * 4);
    st = fy_matmul(dinp, dlog, gate, BT, C, E, false, false, 1.0f, 1.0f);
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
    for (int64_t t = 0; t < BT; t++)
      for (int64_t j = 0; j < K && moe_routed(d, t); j++) {
        const float *xr = dx + (int64_t)route[t * S + E + 2 * K + j] * C;
        float *o = part + t * C;
        for (int64_t c = 0; c < C; c++) o[c] += xr[c];
      }
    if (d->tp_sum && st == FY_OK) st = d->tp_sum(d->tp_ctx, part, BT * C);
    if (d->tp_sum && st == FY_OK) fy_add_forward(dinp, dinp, part, BT * C);
  }
  // dgate (E,C) (+)= dlog^T (E,BT) @ inp (BT,C)
  if (st == FY_OK) st = fy_matmul(dgate, dlog, inp, E, C, BT, true, false, 1.0f, accumulate ? 1.0f : 0.0f);
  return st;
}
