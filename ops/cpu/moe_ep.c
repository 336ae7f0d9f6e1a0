// A mixture of experts in pieces, for expert parallelism (ops/ops.h, "mixture of experts in
// pieces"; runtime/ep.c moves the rows between the ranks). A source rank routes its tokens and
// lays their rows out expert by expert (fy_moe_route_rows, fy_moe_dispatch); the ranks holding the
// experts compute them on the rows they receive, block by block (fy_moe_experts_forward and
// _backward); the source weighs the results (fy_moe_combine) and, in backward, sends the rows'
// gradients out (fy_moe_combine_backward) and finishes the router's (fy_moe_route_backward).
//
// Each piece does the arithmetic of fy_moe_forward / fy_moe_backward (ops/cpu/moe.c) in the same
// order: a block of one source's rows for one expert is rounded up to fy_moe_rows and computed as
// one product, as one rank computes that expert for its own tokens, so that the experts split
// over ranks give one rank's numbers (the gradients summed over sources in source order, as the
// replicas' all-reduce sums them in rank order). In 16-bit numerics (--precision bf16, fp16) the
// products are the whole op's (fy_moe_dims.bf16) on the same fp32 rows holding 16-bit values, and
// each block's gradients are rounded before the sources add (fy_moe_dims.block_grads).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/graph.h"
#include "ops/ops.h"

fy_status fy_moe_route_rows(float *route, int64_t *n, double *balance, const float *inp, const float *gate,
                           const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, E = d->E, K = d->K, S = E + 3 * K;
  if (BT * K >= (int64_t)1 << 24)
    return fy_error_set(FY_ERR_UNSUPPORTED, "mixture of experts: %lld routed rows (the routing record holds rows "
                        "below 2^24)", (long long)(BT * K));
  FY_TRY(fy_moe_route(route, inp, gate, d));  // (fy_moe_forward's routing, the same bits)
  // The dispatch rows, unpadded: expert by expert, each expert's token-choices in token order.
  int64_t fill[E];
  for (int64_t e = 0; e < E; e++) n[e] = 0;
  for (int64_t t = 0; t < BT; t++)
    for (int64_t j = 0; j < K; j++) n[(int64_t)route[t * S + E + j]]++;
  for (int64_t e = 0, rows = 0; e < E; e++) fill[e] = rows, rows += n[e];
  for (int64_t t = 0; t < BT; t++)
    for (int64_t j = 0; j < K; j++) route[t * S + E + 2 * K + j] = (float)fill[(int64_t)route[t * S + E + j]]++;
  double b = 0;
  for (int64_t e = 0; e < E; e++) {
    double p = 0;
    for (int64_t t = 0; t < BT; t++) p += route[t * S + e];
    b += (double)n[e] / (double)BT * (p / (double)BT);
  }
  *balance = (double)E * b;
  return FY_OK;
}

void fy_moe_dispatch(float *xs, const float *inp, const float *route, const struct fy_moe_dims *d) {
  const int64_t S = d->E + 3 * d->K, C = d->C;
#pragma omp parallel for schedule(static) if (d->BT * C > FY_PAR_ROWS)
  for (int64_t t = 0; t < d->BT; t++)
    for (int j = 0; j < d->K; j++)
      memcpy(xs + (int64_t)route[t * S + d->E + 2 * d->K + j] * C, inp + t * C, (size_t)C * 4);
}

int64_t fy_moe_blocks_rows(const int64_t *cnt, int nb) {
  int64_t rows = 0;
  for (int i = 0; i < nb; i++) rows += fy_moe_rows(cnt[i]);
  return rows;
}

static void act(float *a, const float *h, int64_t n, bool gelu) {
  if (gelu) fy_gelu_forward(a, h, n);
  else fy_relu_forward(a, h, n);
}

fy_status fy_moe_experts_forward(float *y, float *xpad, float *hpad, const float *x, const int *ex, const int64_t *cnt,
                                 int nb, const float *w1, const float *b1, const float *w2, const float *b2,
                                 const struct fy_moe_dims *d) {
  const int64_t C = d->C, F = d->F;
  int64_t most = 0;
  for (int i = 0; i < nb; i++) most = fy_moe_rows(cnt[i]) > most ? fy_moe_rows(cnt[i]) : most;
  // as (R,F), ypad (R,C): the kernels' scratch kept between calls (fresh pages each call cost more
  // than the products on a small batch)
  float *as = fy_moe_workspace((size_t)(most * (F + C)) + 1);
  if (!as) return fy_error_set(FY_ERR_NOMEM, "mixture of experts: cannot allocate %lld rows", (long long)most);
  float *ypad = as + most * F;
  fy_status st = FY_OK;
  for (int64_t i = 0, o = 0, u = 0; i < nb && st == FY_OK; i++) {  // o: padded rows before block i, u: unpadded
    const int64_t R = fy_moe_rows(cnt[i]), e = ex[i];
    memcpy(xpad + o * C, x + u * C, (size_t)(cnt[i] * C) * 4);
    memset(xpad + (o + cnt[i]) * C, 0, (size_t)((R - cnt[i]) * C) * 4);
    if (R > 0) {
      // h (R,F) = xs (R,C) @ w1_e^T + b1_e; as = act(h); y (R,C) = as @ w2_e^T + b2_e
      st = fy_linear_forward(hpad + o * F, xpad + o * C, w1 + e * F * C, b1 ? b1 + e * F : NULL, R, C, F, d->bf16);
      if (st != FY_OK) break;
      act(as, hpad + o * F, R * F, d->gelu);
      st = fy_linear_forward(ypad, as, w2 + e * C * F, b2 ? b2 + e * C : NULL, R, F, C, d->bf16);
      memcpy(y + u * C, ypad, (size_t)(cnt[i] * C) * 4);
    }
    o += R, u += cnt[i];
  }
  return st;
}

// g (n) += t (n), in fp32 (t NULL: += 0, which turns -0 into +0 as adding a zero gradient does).
static void add_grads(float *g, const float *t, int64_t n) {
  if (!g) return;
  if (t) {
#pragma omp parallel for simd schedule(static) if (n > FY_PAR_ROWS)
    for (int64_t k = 0; k < n; k++) g[k] += t[k];
  } else {
#pragma omp parallel for simd schedule(static) if (n > FY_PAR_ROWS)
    for (int64_t k = 0; k < n; k++) g[k] += 0.0f;
  }
}

fy_status fy_moe_experts_backward(float *dx, float *dw1, float *db1, float *dw2, float *db2, const float *dy,
                                  const float *xpad, const float *hpad, const int *ex, const int64_t *cnt, int nb,
                                  const float *w1, const float *w2, int experts, bool accumulate,
                                  const struct fy_moe_dims *d) {
  const int64_t C = d->C, F = d->F, rows = fy_moe_blocks_rows(cnt, nb);
  int64_t most = 0;
  for (int i = 0; i < nb; i++) most = fy_moe_rows(cnt[i]) > most ? fy_moe_rows(cnt[i]) : most;
  // Every block's as (rows,F), dh (rows,F) and padded dy (rows,C), laid out as xpad and hpad; one
  // block's dx (R,C); one expert's gradients (F*C, C*F, F, C). The kernels' scratch, kept between
  // calls: a fresh allocation each call (~19 MB at opt-125m's widths) cost its page faults.
  const int64_t gsz = 2 * F * C + F + C;
  float *as = fy_moe_workspace((size_t)(rows * (2 * F + C) + most * C + gsz) + 1);
  // seen[e]: a block named expert e; zero[e]: (without accumulate) its blocks so far had no rows, so
  // its gradient is zero, not yet written (a block with rows writes its own over it and adds 0).
  bool *seen = calloc(2 * (size_t)(experts > 0 ? experts : 1), 1), *zero = seen + (experts > 0 ? experts : 1);
  if (!as || !seen) {
    free(seen);
    return fy_error_set(FY_ERR_NOMEM, "mixture of experts: cannot allocate %lld rows", (long long)rows);
  }
  float *dh = as + rows * F, *dyp = dh + rows * F, *dxp = dyp + rows * C;
  float *tw1 = dxp + most * C, *tw2 = tw1 + F * C, *tb1 = tw2 + C * F, *tb2 = tb1 + F;
  fy_status st = FY_OK;
  // First every block's products with the weights (dh, dx), then the gradients: every weight is read
  // before any gradient is written, so that the gradients may be the weights' memory (an offloaded
  // step writes them over the weights) without a copy of the weights. Each block's numbers are
  // those of the block computed whole, as before: the same products on the same rows.
  for (int64_t i = 0, o = 0, u = 0; i < nb && st == FY_OK; i++) {
    const int64_t R = fy_moe_rows(cnt[i]), e = ex[i];
    if (R > 0) {
      memcpy(dyp + o * C, dy + u * C, (size_t)(cnt[i] * C) * 4);
      memset(dyp + (o + cnt[i]) * C, 0, (size_t)((R - cnt[i]) * C) * 4);
      act(as + o * F, hpad + o * F, R * F, d->gelu);
      // dh (R,F) = dy (R,C) @ w2_e (C,F), then times act'(h)
      st = d->bf16 ? fy_matmul16(dh + o * F, dyp + o * C, w2 + e * C * F, NULL, R, F, C, false, false, 0.0f)
                   : fy_matmul(dh + o * F, dyp + o * C, w2 + e * C * F, R, F, C, false, false, 1.0f, 0.0f);
      if (st != FY_OK) break;
      if (d->gelu) fy_gelu_backward(dh + o * F, dh + o * F, hpad + o * F, R * F);
      else fy_relu_backward(dh + o * F, dh + o * F, as + o * F, R * F);
      // dx (R,C) = dh (R,F) @ w1_e (F,C)
      st = d->bf16 ? fy_matmul16(dxp, dh + o * F, w1 + e * F * C, NULL, R, C, F, false, false, 0.0f)
                   : fy_matmul(dxp, dh + o * F, w1 + e * F * C, R, C, F, false, false, 1.0f, 0.0f);
      if (st != FY_OK) break;
      memcpy(dx + u * C, dxp, (size_t)(cnt[i] * C) * 4);
    }
    o += R, u += cnt[i];
  }
  for (int64_t i = 0, o = 0; i < nb && st == FY_OK; i++) {
    const int64_t R = fy_moe_rows(cnt[i]), e = ex[i];
    float *gw1 = dw1 + e * F * C, *gb1 = db1 ? db1 + e * F : NULL, *gw2 = dw2 + e * C * F, *gb2 = db2 ? db2 + e * C : NULL;
    // This block's gradients of expert e: written into its gradient by its first block (unless
    // accumulating), added after (zeros for a block without rows), as the sum over sources.
    const bool first = !seen[e] && !accumulate;
    seen[e] = true;
    if (R == 0) {
      if (first) zero[e] = true;
      else if (!zero[e])  // (+ 0, without a buffer of zeros; nothing to add to a zero not yet written)
        add_grads(gw1, NULL, F * C), add_grads(gw2, NULL, C * F), add_grads(gb1, NULL, F), add_grads(gb2, NULL, C);
      continue;
    }
    // Written straight into the gradient by the expert's first block with rows; after a block
    // without rows (0 + x: x, its -0 turned into +0, as x + 0) and added 0.
    const bool direct = first || zero[e];
    float *w1g = direct ? gw1 : tw1, *w2g = direct ? gw2 : tw2, *b1g = direct ? gb1 : tb1, *b2g = direct ? gb2 : tb2;
    // dw2_e (C,F) = dy^T @ as, db2_e = column sums of dy (the rounding rows are zeros)
    st = fy_linear_backward_params(w2g, gb2 ? b2g : NULL, dyp + o * C, as + o * F, R, F, C, false, d->bf16);
    // dw1_e (F,C) = dh^T @ xs, db1_e = column sums of dh
    if (st == FY_OK)
      st = fy_linear_backward_params(w1g, gb1 ? b1g : NULL, dh + o * F, xpad + o * C, R, C, F, false, d->bf16);
    if (st != FY_OK) break;
    // 16-bit numerics: a block is one source's rows for expert e, and its gradients are rounded as
    // that source's own backward rounds them (the engine's, fy_op_call_backward) before the
    // sources add in fp32, as one rank adds its micro-batches' and the replicas' all-reduce theirs.
    if (d->block_grads != FY_F32) {
      fy_round_to_dtype(w1g, w1g, d->block_grads, (size_t)(F * C));
      fy_round_to_dtype(w2g, w2g, d->block_grads, (size_t)(C * F));
      if (gb1) fy_round_to_dtype(b1g, b1g, d->block_grads, (size_t)F);
      if (gb2) fy_round_to_dtype(b2g, b2g, d->block_grads, (size_t)C);
    }
    if (zero[e]) {
      add_grads(gw1, NULL, F * C), add_grads(gw2, NULL, C * F), add_grads(gb1, NULL, F), add_grads(gb2, NULL, C);
      zero[e] = false;
    } else if (!first) {
      add_grads(gw1, tw1, F * C), add_grads(gw2, tw2, C * F);
      add_grads(gb1, gb1 ? tb1 : NULL, F), add_grads(gb2, gb2 ? tb2 : NULL, C);
    }
    o += R;
  }
  // An expert no block named (no source sent it a row, and none was listed) or whose blocks had no
  // rows: a zero gradient.
  for (int64_t e = 0; e < experts && st == FY_OK && !accumulate; e++) {
    if (seen[e] && !zero[e]) continue;
    memset(dw1 + e * F * C, 0, (size_t)(F * C) * 4);
    memset(dw2 + e * C * F, 0, (size_t)(C * F) * 4);
    if (db1) memset(db1 + e * F, 0, (size_t)F * 4);
    if (db2) memset(db2 + e * C, 0, (size_t)C * 4);
  }
  free(seen);
  return st;
}

void fy_moe_combine(float *out, const float *route, const float *y, const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, C = d->C, E = d->E, K = d->K, S = E + 3 * K;
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
  for (int64_t t = 0; t < BT; t++) {
    const float *r = route + t * S;
    float *o = out + t * C;
    for (int64_t c = 0; c < C; c++) o[c] = 0;
    for (int64_t j = 0; j < K; j++) {
      const float w = r[E + K + j], *yr = y + (int64_t)r[E + 2 * K + j] * C;
      for (int64_t c = 0; c < C; c++) o[c] += w * yr[c];
    }
  }
}

fy_status fy_moe_route_backward(float *dinp, float *dgate, const float *dw, const float *dx, const float *inp,
                                const float *route, const float *gate, const int64_t *n, float dbalance,
                                bool accumulate, const struct fy_moe_dims *d) {
  const int64_t BT = d->BT, C = d->C, E = d->E, K = d->K, S = E + 3 * K;
  // dlog (BT,E), then with tensor parallelism the tokens' sums of dx (BT,C), this rank's part
  float *dlog = malloc((size_t)(BT * E + (d->tp_sum ? BT * C : 0)) * 4 + 4);
  if (!dlog) return fy_error_set(FY_ERR_NOMEM, "mixture of experts: cannot allocate the router's gradient");
  fy_moe_router_dlogits(dlog, route, dw, n, dbalance, d);  // (one rank's router gradient, the same bits)
  fy_status st = FY_OK;
  if (dinp) {
    // dinp (BT,C) += dlog (BT,E) @ gate (E,C) (before dgate may overwrite gate, as in
    // fy_moe_backward), then each token's rows of dx in the choices' order; with tensor
    // parallelism dx holds this rank's slices' part: its sums go to part, summed over the group and
    // then added (fy_moe_backward's order: the same bits as a tp mixture's).
    float *part = d->tp_sum ? dlog + BT * E : dinp;
    if (d->tp_sum) memset(part, 0, (size_t)(BT * C) * 4);
    st = fy_matmul(dinp, dlog, gate, BT, C, E, false, false, 1.0f, 1.0f);
#pragma omp parallel for schedule(static) if (BT * C > FY_PAR_ROWS)
    for (int64_t t = 0; t < BT; t++)
      for (int64_t j = 0; j < K; j++) {
        const float *xr = dx + (int64_t)route[t * S + E + 2 * K + j] * C;
        float *o = part + t * C;
        for (int64_t c = 0; c < C; c++) o[c] += xr[c];
      }
    if (d->tp_sum && st == FY_OK) st = d->tp_sum(d->tp_ctx, part, BT * C);
    if (d->tp_sum && st == FY_OK) fy_add_forward(dinp, dinp, part, BT * C);
  }
  // dgate (E,C) (+)= dlog^T (E,BT) @ inp (BT,C)
  if (st == FY_OK) st = fy_matmul(dgate, dlog, inp, E, C, BT, true, false, 1.0f, accumulate ? 1.0f : 0.0f);
  free(dlog);
  return st;
}
