// The parallel-pattern registry: the built-ins, their layouts and costs on an OPT-tiny graph
// against hand-computed values, refused registrations, and a pattern defined here, outside the
// library, that registers with one call and is then used like a built-in.
#include <string.h>

#include "check.h"
#include "core/graph.h"
#include "core/opt.h"
#include "planner/cost.h"
#include "planner/pattern.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/tp.h"

// ---- A plug-in pattern, as a user would write one --------------------------------------------
// offload_only: the rank holds none of the op's parameters nor their optimizer state; an owner
// (say, a host-side parameter server) broadcasts the weights before forward and before backward,
// and the gradients are reduce-scattered back to it after backward.
static double toy_bytes(const struct fy_pattern_ctx *c) {
  const struct fy_op *op = &c->g->ops[c->op];
  double n = 0;
  for (int k = 0; k < op->n_params; k++) n += (double)c->g->params[op->params[k]].numel;
  return n * c->param_bytes;
}

static bool toy_applies(const struct fy_pattern_ctx *c) { return c->g->ops[c->op].n_params > 0; }

static void toy_layout(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out) {
  *out = (struct fy_pattern_layout){.param_elems_per_rank = 0, .optim_elems_per_rank = 0,
                                    .split_dim = -1};
}

static int toy_comm(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps, int max) {
  if (c->dp <= 1 || max < 1) return 0;
  if (phase == FY_PHASE_PRE_FORWARD || phase == FY_PHASE_PRE_BACKWARD) {
    steps[0] = (struct fy_comm_step){.op = FY_COMM_BROADCAST, .bytes = toy_bytes(c), .group = 0};
    return 1;
  }
  if (phase == FY_PHASE_POST_BACKWARD) {
    steps[0] = (struct fy_comm_step){.op = FY_COMM_REDUCE_SCATTER, .bytes = toy_bytes(c), .group = 0};
    return 1;
  }
  return 0;
}

// The gathered weights need a staging buffer while they are in use.
static double toy_act_bytes(const struct fy_pattern_ctx *c) { return toy_bytes(c); }

static const struct fy_pattern offload_only = {
    .name = "offload_only",
    .doc = "holds nothing on the rank: weights broadcast before use, gradients sent back",
    .applies = toy_applies,
    .layout = toy_layout,
    .comm = toy_comm,
    .act_bytes = toy_act_bytes,
};

// ---- Helpers ----------------------------------------------------------------------------------
static int find_op(const struct fy_graph *g, const char *name) {
  for (int o = 0; o < g->n_ops; o++)
    if (strcmp(g->ops[o].name, name) == 0) return o;
  return -1;
}

static struct fy_pattern_layout layout_of(const struct fy_pattern *p, const struct fy_pattern_ctx *c) {
  struct fy_pattern_layout l = {.param_elems_per_rank = -1, .optim_elems_per_rank = -1,
                                .split_dim = -2};
  p->layout(c, &l);
  return l;
}

static bool near(double a, double b) { return fabs(a - b) <= 1e-9 * fmax(1.0, fabs(b)); }

// Steps of one phase, checked for the single step (or none) the built-ins produce.
static void check_phase(const struct fy_pattern *p, const struct fy_pattern_ctx *c, int phase,
                        enum fy_comm_op want_op, double want_bytes, int want_group) {
  struct fy_comm_step s[FY_PATTERN_MAX_STEPS];
  memset(s, 0, sizeof s);
  int n = p->comm(c, phase, s, FY_PATTERN_MAX_STEPS);
  if (want_op == FY_COMM_NONE) {
    CHECKF(n == 0, "%s op %d phase %d dp %d tp %d: %d steps, wanted none", p->name, c->op, phase,
           c->dp, c->tp, n);
    return;
  }
  CHECKF(n == 1 && s[0].op == want_op && near(s[0].bytes, want_bytes) && s[0].group == want_group,
         "%s op %d phase %d dp %d tp %d: %d steps, first %s %.0f bytes group %d; wanted %s %.0f "
         "group %d",
         p->name, c->op, phase, c->dp, c->tp, n, n ? fy_comm_op_name(s[0].op) : "-",
         n ? s[0].bytes : 0, n ? s[0].group : -1, fy_comm_op_name(want_op), want_bytes, want_group);
}

// ---- Tests ------------------------------------------------------------------------------------
static void test_builtin(void) {
  fy_pattern_register_builtin();
  fy_pattern_register_builtin();  // idempotent
  CHECK(fy_pattern_count() == 5);
  const char *names[] = {"replicate", "zero", "tp_col", "tp_row", "expert"};
  const struct fy_pattern *want[] = {&fy_pattern_replicate, &fy_pattern_zero, &fy_pattern_tp_col,
                                     &fy_pattern_tp_row, &fy_pattern_expert};
  for (int i = 0; i < 5; i++) {
    const struct fy_pattern *p = fy_pattern_find(names[i]);
    CHECKF(p == want[i], "find(%s)", names[i]);
    CHECK(fy_pattern_at(i) == want[i]);
    if (p) CHECK(p->doc && strlen(p->doc) > 0 && !strchr(p->doc, '\n'));
  }
  CHECK(fy_pattern_find("nope") == NULL);
  CHECK(fy_pattern_find("") == NULL);
  CHECK(fy_pattern_find(NULL) == NULL);
  CHECK(fy_pattern_at(-1) == NULL);
  CHECK(fy_pattern_at(5) == NULL);
}

// The expert pattern on opt-moe-tiny's mixture (E 4, top 2, C 32, F 64, biases): where it applies,
// its layout (the router whole, the experts over ep) and its steps against hand-computed bytes.
static void test_expert(void) {
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-moe-tiny", &cfg));
  const int64_t B = 2, T = 8, BT = B * T, C = 32, F = 64, E = 4, K = 2;
  CHECK(cfg.hidden_size == C && cfg.ffn_dim == F && cfg.num_local_experts == E && cfg.num_experts_per_tok == K);
  struct fy_graph *g, *part;
  fy_status st = fy_opt_build_graph(&cfg, B, T, &g);
  CHECK_OK(st);
  if (st != FY_OK) return;
  const struct fy_pattern *ex = fy_pattern_find("expert");
  CHECK(ex == &fy_pattern_expert);
  const int moe = find_op(g, "layers.1.block_sparse_moe"), fc1 = find_op(g, "layers.0.fc1");
  CHECK(moe >= 0 && fc1 >= 0);
  if (moe < 0 || fc1 < 0 || !ex) return;
  const double router = (double)(E * C), experts = (double)(E * (F * C + F + C * F + C));
  struct fy_pattern_ctx c = {.g = g, .op = moe, .dp = 4, .tp = 1, .ep = 2, .param_bytes = 4};
  CHECK(ex->applies(&c));
  for (int ep = 1; ep <= 4; ep *= 2) {  // ep 1, 2, 4 of dp 4
    c.ep = ep;
    CHECKF(ex->applies(&c), "expert applies with ep %d of dp 4", ep);
    struct fy_pattern_layout l = layout_of(ex, &c);
    CHECKF(near(l.param_elems_per_rank, router + experts / ep) && near(l.optim_elems_per_rank, router + experts / ep) &&
           l.split_dim == 0, "expert layout with ep %d: %.0f elements", ep, l.param_elems_per_rank);
    CHECK(near(fy_pattern_state_bytes(ex, &c), (router + experts / ep) * (4 + 8)));
    // Forward and backward: two all-to-alls of the BT*K rows of C values over the ep group.
    for (int ph = FY_PHASE_POST_FORWARD; ph <= FY_PHASE_POST_BACKWARD; ph += FY_PHASE_POST_BACKWARD - FY_PHASE_POST_FORWARD) {
      struct fy_comm_step s[FY_PATTERN_MAX_STEPS];
      int n = ex->comm(&c, ph, s, FY_PATTERN_MAX_STEPS);
      CHECKF(n == (ep > 1 ? 2 : 0), "expert phase %d ep %d: %d steps", ph, ep, n);
      for (int i = 0; i < n; i++)
        CHECK(s[i].op == FY_COMM_ALL_TO_ALL && near(s[i].bytes, (double)(BT * K * C * 4)) &&
              s[i].group == FY_PATTERN_GROUP_EP && fy_pattern_group_size(&c, s[i].group) == ep);
    }
    // Nothing before forward or backward (the rows move inside the op).
    struct fy_comm_step s[FY_PATTERN_MAX_STEPS];
    CHECK(ex->comm(&c, FY_PHASE_PRE_FORWARD, s, FY_PATTERN_MAX_STEPS) == 0);
    CHECK(ex->comm(&c, FY_PHASE_PRE_BACKWARD, s, FY_PATTERN_MAX_STEPS) == 0);
    // Once a step: the router over dp, each expert over the dp/ep ranks that hold it (none when ep = dp).
    int n = ex->comm(&c, FY_PHASE_GRADS, s, FY_PATTERN_MAX_STEPS);
    CHECKF(n == (ep < 4 ? 2 : 1), "expert grads ep %d: %d steps", ep, n);
    CHECK(n >= 1 && s[0].op == FY_COMM_ALL_REDUCE && near(s[0].bytes, router * 4) && s[0].group == FY_PATTERN_GROUP_DP);
    if (n == 2)
      CHECK(s[1].op == FY_COMM_ALL_REDUCE && near(s[1].bytes, experts / ep * 4) && s[1].group == FY_PATTERN_GROUP_EP_REP &&
            fy_pattern_group_size(&c, s[1].group) == 4 / ep);
    CHECK(near(fy_pattern_comm_bytes(ex, &c), (ep > 1 ? 4.0 * BT * K * C * 4 : 0) + router * 4 + (ep < 4 ? experts / ep * 4 : 0)));
    CHECK(ep > 1 ? ex->act_bytes(&c) > 0 : ex->act_bytes(&c) == 0);
  }
  c.ep = 3;  // 3 does not divide the 4 experts (nor dp 4)
  CHECK(!ex->applies(&c));
  c.ep = 4, c.dp = 2;  // ep must divide the data-parallel ranks
  CHECK(!ex->applies(&c));
  c.ep = 2, c.op = fc1;  // a dense feed-forward is not a mixture
  CHECK(!ex->applies(&c));
  // A rank's graph (fy_graph_set_experts) holds its experts' rows: the pattern counts the whole op
  // all the same, and the graph's expert parameters are half of the whole ones.
  CHECK_OK(fy_opt_build_graph(&cfg, B, T, &part));
  CHECK_ERR(fy_graph_set_experts(part, 3, 0), FY_ERR_INVALID);
  CHECK_OK(fy_graph_set_experts(part, 2, 1));
  struct fy_pattern_ctx pc = {.g = part, .op = moe, .dp = 2, .tp = 1, .ep = 2, .param_bytes = 4};
  c.op = moe, c.dp = 2;
  CHECK(near(layout_of(ex, &pc).param_elems_per_rank, layout_of(ex, &c).param_elems_per_rank));
  const struct fy_op *op = &part->ops[moe];
  for (int k = 0; k < op->n_params; k++) {
    const struct fy_param *p = &part->params[op->params[k]], *w = &g->params[op->params[k]];
    CHECKF(p->expert == (k > 0) && p->numel * (k > 0 ? 2 : 1) == w->numel &&
           (k == 0 || (p->split_dim == 0 && p->full_shape[0] == w->shape[0])), "%s on expert-parallel rank 1", p->name);
  }
  fy_graph_free(part);
  fy_graph_free(g);
}

// A whole tensor's elements as their own indices (fy_tp_read_fn): a slice read from it names the
// whole elements it took.
static void read_index(void *ctx, int i, int64_t a, int64_t b, float *dst) {
  (void)ctx, (void)i;
  for (int64_t e = a; e < b; e++) dst[e - a] = (float)e;
}

// The expert pattern under tensor parallelism (ep 1, tp 2) on opt-moe-tiny's mixture: the tp graph
// gives its mixtures the pattern, the layout counts what a rank's graph holds (the router and fc2's
// bias whole, half of every expert's fc1 rows, fc1 bias and fc2 columns), the steps are the
// kernels' sums over tp (output; routing weights' gradients and input gradient), and a rank reads
// expert e's fc1 rows [e F + r F/2, +F/2) (runtime/tp.c, split_blocks).
static void test_expert_tp(void) {
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-moe-tiny", &cfg));
  const int64_t B = 2, T = 8, BT = B * T, C = 32, F = 64, E = 4, K = 2;
  struct fy_graph *g = NULL, *part = NULL;
  CHECK_OK(fy_opt_build_graph(&cfg, B, T, &g));
  CHECK_OK(fy_opt_build_graph_tp(&cfg, B, T, 2, 1, &part));
  if (!g || !part) {
    fy_graph_free(g);
    fy_graph_free(part);
    return;
  }
  const int moe = find_op(g, "layers.1.block_sparse_moe");
  CHECK(moe >= 0 && find_op(part, "layers.1.block_sparse_moe") == moe);
  if (moe < 0) return;
  const struct fy_op *op = &part->ops[moe];
  CHECK(strcmp(op->pattern, "expert") == 0 && op->OC == F / 2 && g->ops[moe].pattern[0] == 0);
  double held = 0;
  for (int k = 0; k < op->n_params; k++) held += (double)part->params[op->params[k]].numel;
  const double router = (double)(E * C), split = (double)(E * (F * C + F + C * F)), whole = router + E * C;
  CHECK(near(held, whole + split / 2));
  struct fy_pattern_ctx c = {.g = g, .op = moe, .dp = 2, .tp = 2, .ep = 1, .param_bytes = 4};
  CHECK(fy_pattern_expert.applies(&c));
  struct fy_pattern_layout l = layout_of(&fy_pattern_expert, &c);
  CHECKF(near(l.param_elems_per_rank, held) && near(l.optim_elems_per_rank, held), "expert layout with tp 2: %.0f "
         "elements, a rank's graph holds %.0f", l.param_elems_per_rank, held);
  struct fy_pattern_ctx pc = c;  // (a rank's graph counted as the whole one)
  pc.g = part;
  CHECK(near(layout_of(&fy_pattern_expert, &pc).param_elems_per_rank, held));
  struct fy_comm_step s[FY_PATTERN_MAX_STEPS];
  int n = fy_pattern_expert.comm(&c, FY_PHASE_POST_FORWARD, s, FY_PATTERN_MAX_STEPS);
  CHECK(n == 1 && s[0].op == FY_COMM_ALL_REDUCE && near(s[0].bytes, (double)(BT * C * 4)) &&
        s[0].group == FY_PATTERN_GROUP_TP);
  n = fy_pattern_expert.comm(&c, FY_PHASE_POST_BACKWARD, s, FY_PATTERN_MAX_STEPS);
  CHECK(n == 2 && s[0].op == FY_COMM_ALL_REDUCE && near(s[0].bytes, (double)(BT * K * 4)) &&
        s[0].group == FY_PATTERN_GROUP_TP && s[1].op == FY_COMM_ALL_REDUCE && near(s[1].bytes, (double)(BT * C * 4)) &&
        s[1].group == FY_PATTERN_GROUP_TP);
  n = fy_pattern_expert.comm(&c, FY_PHASE_GRADS, s, FY_PATTERN_MAX_STEPS);  // a rank's part over dp
  CHECK(n == 2 && near(s[0].bytes, router * 4) && s[0].group == FY_PATTERN_GROUP_DP &&
        near(s[1].bytes, (held - router) * 4) && fy_pattern_group_size(&c, s[1].group) == 2);
  CHECK(fy_pattern_expert.act_bytes(&c) > 0);
  // The slices: fc1's rows expert by expert, fc2's columns, fc2's bias whole.
  const struct fy_param *w1 = &part->params[op->params[1]], *b1 = &part->params[op->params[2]],
                       *w2 = &part->params[op->params[3]], *b2 = &part->params[op->params[4]];
  CHECK(w1->split_dim == 0 && w1->split_blocks == E && w1->shape[0] == E * F / 2 && w1->full_shape[0] == E * F);
  CHECK(b1->split_dim == 0 && b1->split_blocks == E && b1->numel == E * F / 2);
  CHECK(w2->split_dim == 1 && w2->shape[1] == F / 2 && w2->full_shape[1] == F && b2->split_dim == -1);
  float *slice = malloc((size_t)w1->numel * 4);
  bool rows_ok = slice != NULL, cols_ok = slice != NULL;
  if (slice) {
    fy_tp_read_part(part, op->params[1], 0, w1->numel, read_index, NULL, slice);
    for (int64_t e = 0; e < E; e++)  // rank 1: rows [e F + F/2, (e + 1) F) of every expert
      for (int64_t f = 0; f < F / 2; f++)
        for (int64_t x = 0; x < C; x++)
          rows_ok &= slice[(e * F / 2 + f) * C + x] == (float)((e * F + F / 2 + f) * C + x);
    fy_tp_read_part(part, op->params[3], 0, w2->numel, read_index, NULL, slice);
    for (int64_t r = 0; r < E * C; r++)  // rank 1: columns [F/2, F) of every row
      for (int64_t f = 0; f < F / 2; f++) cols_ok &= slice[r * F / 2 + f] == (float)(r * F + F / 2 + f);
  }
  CHECK(rows_ok && cols_ok);
  // ep 2 with tp 2 (runtime/ep.c): ep rank 1, tp rank 1 holds experts 2 and 3, of each its tp
  // slice (fc1 rows [e F + F/2, (e + 1) F), fc2 rows [e C, (e + 1) C) columns [F/2, F)), fc2's
  // bias their rows whole; the layout counts a quarter of the split and half of fc2's bias.
  CHECK_OK(fy_graph_set_experts(part, 2, 1));
  CHECK(w1->expert && w1->split_dim == 0 && w1->numel == E * F * C / 4 && w2->split_dim == 1 && w2->numel == E * C * F / 4 &&
        b2->expert && b2->split_dim == 0 && b2->numel == E * C / 2 && fy_param_split_tp(part, w1) &&
        fy_param_split_tp(part, b1) && fy_param_split_tp(part, w2) && !fy_param_split_tp(part, b2));
  if (slice) {
    fy_tp_read_part(part, op->params[1], 0, w1->numel, read_index, NULL, slice);
    for (int64_t e = 0; e < E / 2; e++)
      for (int64_t f = 0; f < F / 2; f++)
        for (int64_t x = 0; x < C; x++)
          rows_ok &= slice[(e * F / 2 + f) * C + x] == (float)(((E / 2 + e) * F + F / 2 + f) * C + x);
    fy_tp_read_part(part, op->params[2], 0, b1->numel, read_index, NULL, slice);
    for (int64_t e = 0; e < E / 2; e++)
      for (int64_t f = 0; f < F / 2; f++) rows_ok &= slice[e * F / 2 + f] == (float)((E / 2 + e) * F + F / 2 + f);
    fy_tp_read_part(part, op->params[3], 0, w2->numel, read_index, NULL, slice);
    for (int64_t r = 0; r < E / 2 * C; r++)
      for (int64_t f = 0; f < F / 2; f++) cols_ok &= slice[r * F / 2 + f] == (float)((E / 2 * C + r) * F + F / 2 + f);
    fy_tp_read_part(part, op->params[4], 0, b2->numel, read_index, NULL, slice);
    for (int64_t r = 0; r < E / 2 * C; r++) cols_ok &= slice[r] == (float)(E / 2 * C + r);
  }
  CHECK(rows_ok && cols_ok);
  held = 0;
  for (int k = 0; k < op->n_params; k++) held += (double)part->params[op->params[k]].numel;
  CHECK(near(held, router + E * C / 2 + split / 4));
  c.ep = 2;
  CHECK(fy_pattern_expert.applies(&c));
  CHECKF(near(layout_of(&fy_pattern_expert, &c).param_elems_per_rank, held), "expert layout with ep 2 x tp 2: %.0f "
         "elements, a rank's graph holds %.0f", layout_of(&fy_pattern_expert, &c).param_elems_per_rank, held);
  pc.g = part, pc.ep = 2;
  CHECK(near(layout_of(&fy_pattern_expert, &pc).param_elems_per_rank, held));
  free(slice);
  fy_graph_free(part);
  fy_graph_free(g);
}

static void test_costs(void) {
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-tiny", &cfg));
  const int64_t B = 2, T = 8, BT = B * T;
  struct fy_graph *g;
  fy_status st = fy_opt_build_graph(&cfg, B, T, &g);
  CHECK_OK(st);
  if (st != FY_OK) return;
  const struct fy_pattern *rep = fy_pattern_find("replicate"), *zero = fy_pattern_find("zero");
  const struct fy_pattern *col = fy_pattern_find("tp_col"), *row = fy_pattern_find("tp_row");
  if (!rep || !zero || !col || !row) {
    CHECK(!"built-ins missing");
    fy_graph_free(g);
    return;
  }
  int fc1 = find_op(g, "layers.0.fc1"), qkv = find_op(g, "layers.1.self_attn.qkv");
  int head = find_op(g, "lm_head"), emb = find_op(g, "embed_tokens");
  CHECK(fc1 >= 0 && qkv >= 0 && head >= 0 && emb >= 0);
  if (fc1 < 0 || qkv < 0 || head < 0 || emb < 0) {
    fy_graph_free(g);
    return;
  }
  const int64_t D = cfg.hidden_size, F = cfg.ffn_dim, V = cfg.vocab_size;

  const int dps[] = {1, 2, 4}, tps[] = {1, 2}, pbs[] = {4, 2};
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 2; b++)
      for (int e = 0; e < 2; e++) {
        int dp = dps[a], tp = tps[b], pb = pbs[e];
        double sum_rep = 0, sum_zero = 0, sum_rep_state = 0, sum_zero_state = 0;
        for (int o = 0; o < g->n_ops; o++) {
          struct fy_pattern_ctx c = {.g = g, .op = o, .dp = dp, .tp = tp,
                                     .chunk_elems = g->chunk_elems, .param_bytes = pb};
          const struct fy_op *op = &g->ops[o];
          double all = 0, owned = 0, w = 0, bias = 0;
          for (int k = 0; k < op->n_params; k++) {
            const struct fy_param *prm = &g->params[op->params[k]];
            all += (double)prm->numel;
            if (prm->first_use != o) continue;
            owned += (double)prm->numel;
            if (prm->rank == 2) w += (double)prm->numel;
            else bias += (double)prm->numel;
          }
          CHECK(rep->applies(&c) && zero->applies(&c));

          // replicate: everything, state and gradient all-reduce.
          struct fy_pattern_layout lr = layout_of(rep, &c), lz = layout_of(zero, &c);
          CHECK(near(lr.param_elems_per_rank, owned) && near(lr.optim_elems_per_rank, owned));
          CHECK(lr.split_dim == -1 && lz.split_dim == -1);
          sum_rep += lr.param_elems_per_rank;
          sum_zero += lz.param_elems_per_rank;
          double rs = fy_pattern_state_bytes(rep, &c), zs = fy_pattern_state_bytes(zero, &c);
          sum_rep_state += rs;
          sum_zero_state += zs;
          CHECK(near(rs, owned * (pb == 2 ? 14 : 12)));
          // zero: 1/dp of replicate's state.
          CHECKF(near(zs * dp, rs), "op %d dp %d: zero %.1f, replicate %.1f", o, dp, zs, rs);
          CHECK(near(lz.param_elems_per_rank * dp, owned) && near(lz.optim_elems_per_rank * dp, owned));
          CHECK(rep->act_bytes(&c) == 0 && zero->act_bytes(&c) == 0);

          double dpon = dp > 1 ? 1 : 0, tpon = tp > 1 ? 1 : 0;
          CHECK(near(fy_pattern_comm_bytes(rep, &c), dpon * owned * pb));
          check_phase(rep, &c, FY_PHASE_GRADS, dp > 1 && owned > 0 ? FY_COMM_ALL_REDUCE : FY_COMM_NONE,
                      owned * pb, 0);
          check_phase(rep, &c, FY_PHASE_PRE_FORWARD, FY_COMM_NONE, 0, 0);
          CHECK(near(fy_pattern_comm_bytes(zero, &c), dpon * (2 * all + owned) * pb));
          check_phase(zero, &c, FY_PHASE_PRE_FORWARD, dp > 1 && all > 0 ? FY_COMM_ALL_GATHER : FY_COMM_NONE,
                      all * pb, 0);
          check_phase(zero, &c, FY_PHASE_PRE_BACKWARD, dp > 1 && all > 0 ? FY_COMM_ALL_GATHER : FY_COMM_NONE,
                      all * pb, 0);
          check_phase(zero, &c, FY_PHASE_POST_BACKWARD,
                      dp > 1 && owned > 0 ? FY_COMM_REDUCE_SCATTER : FY_COMM_NONE, owned * pb, 0);
          check_phase(zero, &c, FY_PHASE_GRADS, FY_COMM_NONE, 0, 0);

          // Tensor parallelism: linear layers only, never a tied weight.
          bool lin = op->kind == FY_OP_LINEAR && o != head;
          CHECKF(col->applies(&c) == lin, "tp_col applies to op %d (%s) tp %d", o, op->name, tp);
          CHECKF(row->applies(&c) == lin, "tp_row applies to op %d (%s) tp %d", o, op->name, tp);
          if (!lin) continue;
          struct fy_pattern_layout lc = layout_of(col, &c), lw = layout_of(row, &c);
          CHECK(lc.split_dim == 0 && lw.split_dim == 1);
          CHECK(near(lc.param_elems_per_rank * tp, owned) && near(lc.optim_elems_per_rank * tp, owned));
          CHECK(near(lw.param_elems_per_rank, w / tp + bias) && near(lw.optim_elems_per_rank, w / tp + bias));
          double bt_c = (double)(BT * op->C) * pb, bt_oc = (double)(BT * op->OC) * pb;
          CHECK(near(col->act_bytes(&c), tpon * bt_c));
          CHECK(row->act_bytes(&c) == 0);
          check_phase(col, &c, FY_PHASE_PRE_FORWARD, FY_COMM_NONE, 0, 0);
          check_phase(col, &c, FY_PHASE_POST_FORWARD, FY_COMM_NONE, 0, 0);
          check_phase(col, &c, FY_PHASE_POST_BACKWARD, tp > 1 ? FY_COMM_ALL_REDUCE : FY_COMM_NONE, bt_c, 1);
          check_phase(col, &c, FY_PHASE_GRADS, dp > 1 ? FY_COMM_ALL_REDUCE : FY_COMM_NONE, owned / tp * pb, 0);
          CHECK(near(fy_pattern_comm_bytes(col, &c), tpon * bt_c + dpon * owned / tp * pb));
          check_phase(row, &c, FY_PHASE_POST_FORWARD, tp > 1 ? FY_COMM_ALL_REDUCE : FY_COMM_NONE, bt_oc, 1);
          check_phase(row, &c, FY_PHASE_PRE_BACKWARD, FY_COMM_NONE, 0, 0);
          check_phase(row, &c, FY_PHASE_POST_BACKWARD, FY_COMM_NONE, 0, 0);
          check_phase(row, &c, FY_PHASE_GRADS, dp > 1 ? FY_COMM_ALL_REDUCE : FY_COMM_NONE,
                      (w / tp + bias) * pb, 0);
          CHECK(near(fy_pattern_comm_bytes(row, &c), tpon * bt_oc + dpon * (w / tp + bias) * pb));
        }
        // Every parameter held once (the tied table at its first user), and zero shards it all.
        CHECK(near(sum_rep, (double)fy_opt_num_params(&cfg)));
        CHECK(near(sum_zero * dp, sum_rep));
        CHECK(near(sum_zero_state * dp, sum_rep_state));
      }

  // Hand-computed values for opt-tiny (D 32, F 64, V 97), B 2, T 8, bf16, dp 2, tp 2.
  CHECK(D == 32 && F == 64 && V == 97);
  struct fy_pattern_ctx c = {.g = g, .op = fc1, .dp = 2, .tp = 2, .chunk_elems = g->chunk_elems,
                             .param_bytes = 2};
  // fc1: weight 64x32 = 2048, bias 64.
  CHECK(near(layout_of(rep, &c).param_elems_per_rank, 2112));
  CHECK(near(layout_of(zero, &c).param_elems_per_rank, 1056));
  CHECK(near(layout_of(col, &c).param_elems_per_rank, 1056));     // weight and bias split
  CHECK(near(layout_of(row, &c).param_elems_per_rank, 1024 + 64)); // bias whole on every rank
  CHECK(near(fy_pattern_state_bytes(rep, &c), 2112 * 14));
  CHECK(near(fy_pattern_comm_bytes(rep, &c), 4224));                // all-reduce of 2112 x 2
  CHECK(near(fy_pattern_comm_bytes(zero, &c), 3 * 4224));           // 2 gathers + reduce-scatter
  CHECK(near(fy_pattern_comm_bytes(col, &c), 16 * 32 * 2 + 1056 * 2));  // dinp 1024 + grads 2112
  CHECK(near(fy_pattern_comm_bytes(row, &c), 16 * 64 * 2 + 1088 * 2));  // out 2048 + grads 2176
  CHECK(near(col->act_bytes(&c), 16 * 32 * 2));
  // The fused QKV: (3D x D) + 3 biases of D.
  c.op = qkv;
  CHECK(near(layout_of(rep, &c).param_elems_per_rank, 3 * 32 * 32 + 3 * 32));
  CHECK(near(layout_of(col, &c).param_elems_per_rank, (3 * 32 * 32 + 3 * 32) / 2.0));
  CHECK(near(layout_of(row, &c).param_elems_per_rank, 3 * 32 * 32 / 2.0 + 3 * 32));
  // The tied table: held by embed_tokens, gathered again (not held) by lm_head.
  c.op = head;
  CHECK(layout_of(rep, &c).param_elems_per_rank == 0);
  CHECK(near(fy_pattern_comm_bytes(zero, &c), 2.0 * 97 * 32 * 2));
  CHECK(!col->applies(&c) && !row->applies(&c));
  c.op = emb;
  CHECK(near(layout_of(rep, &c).param_elems_per_rank, 97 * 32));
  CHECK(!col->applies(&c) && !row->applies(&c));
  // tp_col needs OC divisible by tp, tp_row needs C divisible.
  c.op = fc1;
  c.tp = 3;
  CHECK(!col->applies(&c) && !row->applies(&c));
  c.tp = 64;
  CHECK(col->applies(&c) && !row->applies(&c));
  c.tp = 32;
  CHECK(col->applies(&c) && row->applies(&c));
  // Recomputed layers run tp_row's forward all-reduce again before backward.
  c.tp = 2;
  fy_graph_set_recompute(g, true);
  check_phase(row, &c, FY_PHASE_PRE_BACKWARD, FY_COMM_ALL_REDUCE, 16 * 64 * 2, 1);
  CHECK(near(fy_pattern_comm_bytes(row, &c), 2 * 16 * 64 * 2 + 1088 * 2));
  fy_graph_set_recompute(g, false);
  fy_graph_free(g);
}

static bool never(const struct fy_pattern_ctx *c) { return false; }

static void test_refused(void) {
  int n = fy_pattern_count();
  struct fy_pattern dup = fy_pattern_replicate;
  dup.doc = "another replicate";
  CHECK_ERR(fy_pattern_register(&dup), FY_ERR_INVALID);
  CHECK_ERR(fy_pattern_register(&fy_pattern_zero), FY_ERR_INVALID);
  CHECK_ERR(fy_pattern_register(NULL), FY_ERR_INVALID);
  struct fy_pattern p = offload_only;
  p.name = "toy_with_holes";
  p.applies = never;
  for (int slot = 0; slot < 5; slot++) {
    struct fy_pattern q = p;
    if (slot == 0) q.doc = NULL;
    if (slot == 1) q.applies = NULL;
    if (slot == 2) q.layout = NULL;
    if (slot == 3) q.comm = NULL;
    if (slot == 4) q.act_bytes = NULL;
    CHECK_ERR(fy_pattern_register(&q), FY_ERR_INVALID);
  }
  const char *bad_names[] = {"", "has space", "a/b", "0123456789012345678901234567890123456789"};
  for (int i = 0; i < 4; i++) {
    struct fy_pattern q = p;
    q.name = bad_names[i];
    CHECK_ERR(fy_pattern_register(&q), FY_ERR_INVALID);
  }
  p.name = NULL;
  CHECK_ERR(fy_pattern_register(&p), FY_ERR_INVALID);
  CHECK(fy_pattern_count() == n);
  CHECK(fy_pattern_find("toy_with_holes") == NULL);
}

static void test_plugin(void) {
  int n = fy_pattern_count();
  CHECK(fy_pattern_find("offload_only") == NULL);
  CHECK_OK(fy_pattern_register(&offload_only));  // the one call
  CHECK(fy_pattern_count() == n + 1);
  const struct fy_pattern *p = fy_pattern_find("offload_only");
  CHECK(p == &offload_only);
  CHECK(fy_pattern_at(n) == &offload_only);
  CHECK_ERR(fy_pattern_register(&offload_only), FY_ERR_INVALID);
  if (!p) return;

  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-tiny", &cfg));
  struct fy_graph *g;
  fy_status st = fy_opt_build_graph(&cfg, 2, 8, &g);
  CHECK_OK(st);
  if (st != FY_OK) return;
  int fc1 = find_op(g, "layers.0.fc1");
  struct fy_pattern_ctx c = {.g = g, .op = fc1, .dp = 4, .tp = 1, .chunk_elems = g->chunk_elems,
                             .param_bytes = 2};
  CHECK(p->applies(&c));
  CHECK(fy_pattern_state_bytes(p, &c) == 0);
  CHECK(near(fy_pattern_comm_bytes(p, &c), 3 * 2112 * 2));
  CHECK(near(p->act_bytes(&c), 2112 * 2));
  c.dp = 1;
  CHECK(fy_pattern_comm_bytes(p, &c) == 0);

  // A planner's question, asked of the whole registry: which applicable pattern keeps the least
  // state on a rank for fc1 at dp 4? The plug-in, which keeps none.
  c.dp = 4;
  const struct fy_pattern *best = NULL;
  double best_bytes = 0;
  for (int i = 0; i < fy_pattern_count(); i++) {
    const struct fy_pattern *q = fy_pattern_at(i);
    if (!q->applies(&c)) continue;
    double b = fy_pattern_state_bytes(q, &c);
    if (!best || b < best_bytes) best = q, best_bytes = b;
  }
  CHECK(best == &offload_only);
  fy_graph_free(g);

  // The planner uses it as it uses a built-in: a plan whose data-parallel ranks run offload_only
  // keeps no model state on the host and pays for its broadcasts and reduce-scatters.
  struct fy_probe probe = {.device = "sim", .device_mem = 64 << 20, .host_mem = 1 << 30, .device_gflops = 100,
                           .host_gflops = 100, .h2d_gbps = 5, .d2h_gbps = 5, .host_adamw_gbps = 5,
                           .host_mem_gbps = 10, .comm_gbps = 2};
  struct fy_plan_knobs k = {.micro_batch = 2, .grad_accum = 1, .seq = 8, .prefetch = 1, .disk_chunks = 0, .dp = 4};
  struct fy_cost rep, toy;
  snprintf(k.pattern, sizeof k.pattern, "replicate");
  CHECK_OK(fy_cost_simulate(&cfg, &k, &probe, &rep, NULL));
  snprintf(k.pattern, sizeof k.pattern, "offload_only");
  CHECK_OK(fy_cost_simulate(&cfg, &k, &probe, &toy, NULL));
  CHECKF(rep.fits && toy.fits && toy.host_bytes < 0.2 * rep.host_bytes,
         "host state: replicate %.0f bytes, offload_only %.0f", rep.host_bytes, toy.host_bytes);
  CHECKF(toy.comm_s > rep.comm_s && rep.comm_s > 0, "collectives: replicate %g s, offload_only %g s", rep.comm_s,
         toy.comm_s);
}

// ---- The runtime runs a plug-in pattern's hooks -------------------------------------------------
// probe: its hooks only count, look at the buffers they are given and sum the output over the
// data-parallel group (one rank here: nothing), so training is unchanged.
static int probe_fwd, probe_bwd, probe_op = -1;
static bool probe_buffers_ok = true;
static fy_status probe_post_forward(const struct fy_pattern_run *r) {
  probe_fwd++;
  probe_buffers_ok = probe_buffers_ok && r->out && r->op == probe_op && !r->bias;
  const struct fy_op *op = &r->g->ops[r->op];
  return r->all_reduce(r->ctx, FY_PATTERN_GROUP_DP, r->out, (size_t)(r->g->B * r->g->T * op->OC));
}
static fy_status probe_post_backward(const struct fy_pattern_run *r) {
  probe_bwd++;
  probe_buffers_ok = probe_buffers_ok && r->dinput && !r->dinput_part && r->op == probe_op;
  return FY_OK;
}

static void test_runtime(void) {
  static struct fy_pattern probe;
  probe = offload_only;
  probe.name = "probe";
  probe.post_forward = probe_post_forward;
  probe.post_backward = probe_post_backward;
  CHECK_OK(fy_pattern_register(&probe));
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_preset("opt-tiny", &cfg));
  struct fy_device *dev;
  CHECK_OK(fy_device_cpu_create(0, &dev));
  struct fy_model *m;
  if (fy_model_create(&cfg, 2, 8, dev, &m) != FY_OK) {
    CHECK(0);
    fy_device_free(dev);
    return;
  }
  fy_model_init_random(m, 7);
  int32_t ids[16], tg[16];
  for (int i = 0; i < 16; i++) ids[i] = (i * 5 + 1) % 97, tg[i] = (i * 3 + 2) % 97;
  struct fy_batch b = {.inputs = ids, .targets = tg, .B = 2, .T = 8};
  size_t n = (size_t)m->graph->n_param_elems;
  float *want = malloc(n * 4);
  struct fy_loss l0, l1;
  CHECK_OK(fy_engine_forward(m, &b, &l0));
  CHECK_OK(fy_engine_backward(m, &b, 1.0f / 16));
  memcpy(want, m->grads, n * 4);
  probe_op = find_op(m->graph, "layers.1.fc1");
  CHECK_OK(fy_model_set_pattern(m, probe_op, "probe"));
  CHECK(strcmp(m->graph->ops[probe_op].pattern, "probe") == 0);
  CHECK_OK(fy_engine_forward(m, &b, &l1));
  CHECK_OK(fy_engine_backward(m, &b, 1.0f / 16));
  CHECKF(probe_fwd == 1 && probe_bwd == 1, "the plug-in's hooks ran %d and %d times", probe_fwd, probe_bwd);
  CHECK(probe_buffers_ok);
  CHECK(l0.sum == l1.sum && memcmp(want, m->grads, n * 4) == 0);
  // Refused: an unknown name, and a pattern that does not apply to the op.
  CHECK_ERR(fy_model_set_pattern(m, probe_op, "sideways"), FY_ERR_INVALID);
  CHECK_ERR(fy_model_set_pattern(m, find_op(m->graph, "embed_tokens"), "tp_row"), FY_ERR_INVALID);
  CHECK_OK(fy_model_set_pattern(m, probe_op, ""));
  CHECK_OK(fy_engine_forward(m, &b, &l1));
  CHECK(probe_fwd == 1);
  free(want);
  fy_model_free(m);
  fy_device_free(dev);
}

// Fills the registry to its capacity; the next registration is refused. Runs last.
static void test_full(void) {
  static char names[FY_PATTERN_MAX][FY_PATTERN_NAME_MAX];
  static struct fy_pattern ps[FY_PATTERN_MAX];
  int room = FY_PATTERN_MAX - fy_pattern_count();
  for (int i = 0; i < room; i++) {
    snprintf(names[i], sizeof names[i], "filler_%d", i);
    ps[i] = offload_only;
    ps[i].name = names[i];
    CHECK_OK(fy_pattern_register(&ps[i]));
  }
  CHECK(fy_pattern_count() == FY_PATTERN_MAX);
  snprintf(names[room], sizeof names[room], "one_too_many");
  ps[room] = offload_only;
  ps[room].name = names[room];
  CHECK_ERR(fy_pattern_register(&ps[room]), FY_ERR_INVALID);
  CHECK(fy_pattern_find("filler_0") == &ps[0]);
  CHECK(fy_pattern_find("one_too_many") == NULL);
}

int main(void) {
  test_builtin();
  test_expert();
  test_expert_tp();
  test_costs();
  test_refused();
  test_plugin();
  test_runtime();
  test_full();
  return check_summary("test_pattern");
}
