// Expert parallelism's kernels (ops/cpu/moe_ep.c) against the whole mixture's (ops/cpu/moe.c), in
// one process: two "ranks" each route their own tokens, their rows are laid out for the two
// experts' owners as runtime/ep.c's all-to-alls lay them out (copied here instead of sent), each
// owner computes its two experts block by block, and the results come back. Every output, input
// gradient and router gradient must be the whole kernel's bit for bit on each rank's tokens, and
// each expert's gradient the sum of the two ranks' in rank order; an expert no token chooses has a
// zero gradient, or keeps its gradient when accumulating (also when only one rank's tokens skip it).
// The gradients may be the weights' memory (an offloaded step writes them over the weights). With bf16 products (16-bit compute, as
// the engine runs --precision bf16) the pieces' products are the whole kernel's too, and each
// expert's gradient the sum of the two ranks' rounded to bf16 (fy_moe_dims.block_grads).
#include <string.h>

#include "check.h"
#include "core/graph.h"
#include "ops/ops.h"

enum { P = 2, BT = 24, C = 16, F = 24, E = 4, K = 2, El = E / P, S = E + 3 * K };

static uint64_t rng = 12345;
static float frand(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng >> 40) & 0xffffff) / 16777216.0f - 0.5f;
}
static void fill(float *x, int64_t n, float scale, bool positive) {
  for (int64_t i = 0; i < n; i++) x[i] = positive ? 0.1f + scale * (frand() + 0.5f) : scale * frand();
}
static bool same(const float *a, const float *b, int64_t n) { return memcmp(a, b, (size_t)n * 4) == 0; }

// Rows of expert (or block) e start at the sum of the counts before it (the unpadded dispatch order).
static int64_t first_row(const int64_t *n, int e) {
  int64_t r = 0;
  for (int i = 0; i < e; i++) r += n[i];
  return r;
}

// starve 1: no token of either rank chooses expert 3; 2: rank 0's alone (rank 1's do).
static void run_case(int starve, bool gelu, bool accumulate, bool bf16) {
  const struct fy_moe_dims d = {.BT = BT, .C = C, .F = F, .E = E, .K = K, .gelu = gelu, .bf16 = bf16,
                                .block_grads = bf16 ? FY_BF16 : FY_F32};
  const int64_t cap = fy_moe_rows_cap(BT, E, K);
  static float inp[P][BT * C], dout[P][BT * C], gate[E * C], w1[E * F * C], b1[E * F], w2[E * C * F], b2[E * C];
  for (int s = 0; s < P; s++)
    fill(inp[s], BT * C, 2.0f, starve == 1 || (starve == 2 && s == 0)), fill(dout[s], BT * C, 1.0f, false);
  fill(gate, E * C, 1.0f, false), fill(w1, E * F * C, 0.5f, false), fill(b1, E * F, 0.1f, false);
  fill(w2, E * C * F, 0.5f, false), fill(b2, E * C, 0.1f, false);
  if (starve)  // positive inputs and a negative row: expert 3 is never among their top 2
    for (int c = 0; c < C; c++) gate[3 * C + c] = -4.0f;
  const float dbal = 0.37f;
  // The whole kernel on each rank's tokens; the experts' gradients summed in rank order.
  static float out_r[P][BT * C], route_r[BT * S], rows_r[(BT * K + BT * K / 8 + 9 * E) * (F + C)];
  static float din_r[P][BT * C], dg_r[P][E * C], g1[P][E * F * C], gb1[P][E * F], g2[P][E * C * F], gb2[P][E * C];
  double bal_r[P];
  for (int s = 0; s < P; s++) {
    CHECK_OK(fy_moe_forward(out_r[s], route_r, rows_r, &bal_r[s], inp[s], gate, w1, b1, w2, b2, &d));
    memset(din_r[s], 0, sizeof din_r[s]);
    CHECK_OK(fy_moe_backward(din_r[s], dg_r[s], g1[s], gb1[s], g2[s], gb2[s], dout[s], inp[s], route_r, rows_r, gate,
                             w1, w2, dbal, false, &d));
  }
  (void)cap;
  static float s1[E * F * C], sb1[E * F], s2[E * C * F], sb2[E * C];  // the replicas' all-reduce
  for (int s = 0; s < P && bf16; s++) {  // (16-bit numerics: of each replica's gradients as the engine rounds them)
    fy_round_to_dtype(g1[s], g1[s], FY_BF16, E * F * C), fy_round_to_dtype(g2[s], g2[s], FY_BF16, E * C * F);
    fy_round_to_dtype(gb1[s], gb1[s], FY_BF16, E * F), fy_round_to_dtype(gb2[s], gb2[s], FY_BF16, E * C);
  }
  for (int64_t i = 0; i < E * F * C; i++) s1[i] = g1[0][i] + g1[1][i], s2[i] = g2[0][i] + g2[1][i];
  for (int64_t i = 0; i < E * F; i++) sb1[i] = gb1[0][i] + gb1[1][i];
  for (int64_t i = 0; i < E * C; i++) sb2[i] = gb2[0][i] + gb2[1][i];
  // The pieces, rank by rank.
  static float route[P][BT * S], xs[P][BT * K * C], ys[P][BT * K * C], out[P][BT * C];
  int64_t n[P][E];
  double bal[P];
  for (int s = 0; s < P; s++) {
    CHECK_OK(fy_moe_route_rows(route[s], n[s], &bal[s], inp[s], gate, &d));
    CHECK(bal[s] == bal_r[s]);
    fy_moe_dispatch(xs[s], inp[s], route[s], &d);
  }
  if (starve) CHECK(n[0][3] == 0 && (starve == 1 ? n[1][3] == 0 : n[1][3] > 0));
  // Owner q receives, source by source, its experts' rows: block (s, e) = n[s][q El + e] rows.
  static float xr[P][P * BT * K * C], yr[P][P * BT * K * C], xpad[P][(P * BT * K + P * El * 16) * C],
      hpad[P][(P * BT * K + P * El * 16) * F], dyr[P][P * BT * K * C], dxr[P][P * BT * K * C];
  int ex[P * El];
  int64_t cnt[P][P * El];
  for (int i = 0; i < P * El; i++) ex[i] = i % El;
  for (int q = 0; q < P; q++) {
    int64_t u = 0;
    for (int s = 0; s < P; s++)
      for (int e = 0; e < El; e++) {
        const int64_t m = cnt[q][s * El + e] = n[s][q * El + e];
        memcpy(xr[q] + u * C, xs[s] + first_row(n[s], q * El + e) * C, (size_t)(m * C) * 4);
        u += m;
      }
    CHECK(fy_moe_blocks_rows(cnt[q], P * El) <= P * BT * K + P * El * 16);
    CHECK_OK(fy_moe_experts_forward(yr[q], xpad[q], hpad[q], xr[q], ex, cnt[q], P * El, w1 + q * El * F * C,
                                    b1 + q * El * F, w2 + q * El * C * F, b2 + q * El * C, &d));
  }
  // The results back to their sources (in the sources' dispatch order), weighed.
  for (int q = 0; q < P; q++)
    for (int64_t s = 0, u = 0; s < P; s++)
      for (int e = 0; e < El; e++) {
        const int64_t m = cnt[q][s * El + e];
        memcpy(ys[s] + first_row(n[s], q * El + e) * C, yr[q] + u * C, (size_t)(m * C) * 4);
        u += m;
      }
  for (int s = 0; s < P; s++) {
    fy_moe_combine(out[s], route[s], ys[s], &d);
    CHECKF(same(out[s], out_r[s], BT * C), "rank %d's output (starve %d gelu %d bf16 %d)", s, starve, gelu, bf16);
  }
  // Backward: the rows' gradients out, the experts' gradients summed over sources, dx back.
  static float dy[P][BT * K * C], dw[P][BT * K], dx[P][BT * K * C], din[P][BT * C], dg[P][E * C];
  static float h1[E * F * C], hb1[E * F], h2[E * C * F], hb2[E * C];
  for (int s = 0; s < P; s++) fy_moe_combine_backward(dy[s], dw[s], dout[s], route[s], ys[s], &d);
  if (accumulate) {  // a gradient already there: the blocks' sum is added to it
    fill(h1, E * F * C, 1.0f, false), fill(hb1, E * F, 1.0f, false), fill(h2, E * C * F, 1.0f, false), fill(hb2, E * C, 1.0f, false);
  }
  static float keep1[E * F * C];
  memcpy(keep1, h1, sizeof keep1);
  for (int q = 0; q < P; q++) {
    for (int64_t s = 0, u = 0; s < P; s++)
      for (int e = 0; e < El; e++) {
        const int64_t m = cnt[q][s * El + e];
        memcpy(dyr[q] + u * C, dy[s] + first_row(n[s], q * El + e) * C, (size_t)(m * C) * 4);
        u += m;
      }
    CHECK_OK(fy_moe_experts_backward(dxr[q], h1 + q * El * F * C, hb1 + q * El * F, h2 + q * El * C * F, hb2 + q * El * C,
                                     dyr[q], xpad[q], hpad[q], ex, cnt[q], P * El, w1 + q * El * F * C,
                                     w2 + q * El * C * F, El, accumulate, &d));
    if (!accumulate) {  // the gradients over the weights: the same numbers
      static float a1[El * F * C], a2[El * C * F], ab1[El * F], ab2[El * C], adx[P * BT * K * C];
      memcpy(a1, w1 + q * El * F * C, sizeof a1), memcpy(a2, w2 + q * El * C * F, sizeof a2);
      CHECK_OK(fy_moe_experts_backward(adx, a1, ab1, a2, ab2, dyr[q], xpad[q], hpad[q], ex, cnt[q], P * El, a1, a2, El,
                                       false, &d));
      CHECKF(same(a1, h1 + q * El * F * C, El * F * C) && same(a2, h2 + q * El * C * F, El * C * F) &&
                 same(adx, dxr[q], first_row(cnt[q], P * El) * C),
             "owner %d's gradients written over its weights (starve %d gelu %d bf16 %d)", q, starve, gelu, bf16);
    }
  }
  if (!accumulate) {
    CHECKF(same(h1, s1, E * F * C) && same(hb1, sb1, E * F) && same(h2, s2, E * C * F) && same(hb2, sb2, E * C),
           "the experts' gradients against the whole kernel's summed over ranks (starve %d gelu %d bf16 %d)", starve, gelu,
           bf16);
  } else if (starve == 1) {  // expert 3: no token anywhere, its gradient left as it was
    CHECK(same(h1 + 3 * F * C, keep1 + 3 * F * C, F * C));
  }
  if (starve == 1 && !accumulate) {
    bool zero = true;
    for (int64_t i = 0; i < F * C; i++) zero &= h1[3 * F * C + i] == 0 && h2[3 * C * F + i] == 0;
    CHECK(zero);
  }
  for (int q = 0; q < P; q++)
    for (int64_t s = 0, u = 0; s < P; s++)
      for (int e = 0; e < El; e++) {
        const int64_t m = cnt[q][s * El + e];
        memcpy(dx[s] + first_row(n[s], q * El + e) * C, dxr[q] + u * C, (size_t)(m * C) * 4);
        u += m;
      }
  for (int s = 0; s < P; s++) {
    memset(din[s], 0, sizeof din[s]);
    CHECK_OK(fy_moe_route_backward(din[s], dg[s], dw[s], dx[s], inp[s], route[s], gate, n[s], dbal, false, &d));
    static float ag[E * C], adin[BT * C];  // dgate over the gate: the same numbers
    memcpy(ag, gate, sizeof ag), memset(adin, 0, sizeof adin);
    CHECK_OK(fy_moe_route_backward(adin, ag, dw[s], dx[s], inp[s], route[s], ag, n[s], dbal, false, &d));
    CHECK(same(ag, dg[s], E * C) && same(adin, din[s], BT * C));
    CHECKF(same(din[s], din_r[s], BT * C) && same(dg[s], dg_r[s], E * C),
           "rank %d's input and router gradients (starve %d gelu %d bf16 %d)", s, starve, gelu, bf16);
  }
}

int main(void) {
  run_case(false, true, false, false);
  run_case(false, false, false, false);
  run_case(true, true, false, false);
  run_case(true, false, true, false);
  run_case(false, true, false, true);
  run_case(true, false, true, true);
  run_case(2, true, false, false);
  run_case(2, false, false, true);
  run_case(2, false, true, false);
  return check_summary("test_moe_ep");
}
