// expert: expert parallelism for a mixture of experts (FY_OP_MOE; runtime/ep.c runs it, docs/ranks.md).
// Within a group of ep data-parallel ranks each holds E/ep of the op's experts (their rows of fc1,
// fc2 and the biases), the router whole. In forward each rank routes its own BT tokens to k experts
// each, sends those BT*k rows of C values to the ranks holding their experts (an all-to-all) and
// gets the experts' outputs back (a second one); backward sends the rows' gradients out and gets
// the inputs' gradients back the same way. Once a step the router's gradient is all-reduced over
// the data-parallel ranks (as replicate's) and each expert's over the dp/ep ranks holding it, every
// expert's every step, whether or not it got a token.
//
// Bytes: an all-to-all's are the rows one rank sends, BT*k*C values (the cost model's (n-1)/n of
// them leave the rank when routing is balanced). The runtime's work is inside the op's kernels
// (the rows move between routing and the experts' products), so the pattern has no hooks.
//
// Under tensor parallelism (core/opt.c gives a tp graph's mixtures this pattern) each expert
// is split over the tp group as the dense feed-forward is by tp_col and tp_row: F/tp of its fc1
// rows (and fc1's bias) and the same F/tp columns of its fc2 on each rank, the router and fc2's
// bias whole. Every rank routes the same tokens the same way; the kernels (ops/ops.h,
// fy_moe_dims.tp_sum) all-reduce the output's partial sums over tp in forward (BT*C values, as
// tp_row's), and in backward the routing weights' gradients (BT*k floats) and the experts' part of
// the input's gradient (BT*C, as tp_col's). Once a step each rank's part is all-reduced over dp.
// Both (ep x tp, runtime/ep.c): a rank holds its tp slice of each of its E/ep experts; the
// all-to-alls run among the ep group's ranks of one tp_rank (the tp group's ranks route the same
// tokens alike), and the tp sums are as above.

#include "planner/pattern.h"

static int ep_of(const struct fy_pattern_ctx *c) { return c->ep > 1 ? c->ep : 1; }

static int tp_of(const struct fy_pattern_ctx *c) { return c->tp > 1 ? c->tp : 1; }

// The op's router elements, its experts' (all E of them, whether or not g already holds a rank's
// part: fy_graph_set_experts, or a tp graph's slices) and of those the ones tp splits (all but
// fc2's bias, params[4] with biases).
static void expert_elems(const struct fy_pattern_ctx *c, double *router, double *experts, double *split) {
  const struct fy_op *op = &c->g->ops[c->op];
  *router = *experts = *split = 0;
  for (int k = 0; k < op->n_params; k++) {
    const struct fy_param *p = &c->g->params[op->params[k]];
    // (the slices' group: the experts' over ep, and each over tp too where tp splits it)
    const int ranks = (p->expert ? c->g->ep : 1) * (fy_param_split_tp(c->g, p) ? c->g->tp : 1);
    const double whole = (double)p->numel * ranks;
    if (k == 0) *router += whole;
    else *experts += whole;
    if (k > 0 && !(op->has_bias && k == 4)) *split += whole;
  }
}

// Its elements on one rank: the router, E/ep of the experts, and with tp its share of each.
static double expert_rank_elems(const struct fy_pattern_ctx *c) {
  double router, experts, split;
  expert_elems(c, &router, &experts, &split);
  return router + (experts - split + split / tp_of(c)) / ep_of(c);
}

static bool expert_applies(const struct fy_pattern_ctx *c) {
  const struct fy_op *op = &c->g->ops[c->op];
  const int ep = ep_of(c);
  return op->kind == FY_OP_MOE && op->experts % ep == 0 && c->dp % ep == 0 && fy_pattern_params_private(c);
}

static void expert_layout(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out) {
  const double n = expert_rank_elems(c);
  *out = (struct fy_pattern_layout){.param_elems_per_rank = n, .optim_elems_per_rank = n, .split_dim = 0};
}

static int expert_comm(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps, int max) {
  const struct fy_op *op = &c->g->ops[c->op];
  const double BT = (double)(c->g->B * c->g->T), rows = BT * op->top_k * op->C * c->param_bytes;
  const double out = BT * op->C * c->param_bytes;  // tp's sums (the kernels' fp32 on the CPU)
  switch (phase) {
  case FY_PHASE_POST_FORWARD: {  // the rows to their experts, the experts' outputs back; tp's output
    int n = fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, out, FY_PATTERN_GROUP_TP);
    n = fy_pattern_push(c, steps, n, max, FY_COMM_ALL_TO_ALL, rows, FY_PATTERN_GROUP_EP);
    return fy_pattern_push(c, steps, n, max, FY_COMM_ALL_TO_ALL, rows, FY_PATTERN_GROUP_EP);
  }
  case FY_PHASE_PRE_BACKWARD:  // a recomputed forward's sum again (as tp_row's)
    if (!(c->g->recompute && op->layer >= 0)) return 0;
    return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, out, FY_PATTERN_GROUP_TP);
  case FY_PHASE_POST_BACKWARD: { // the rows' gradients out, the inputs' gradients back; tp's sums
    int n = fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, BT * op->top_k * 4.0, FY_PATTERN_GROUP_TP);
    n = fy_pattern_push(c, steps, n, max, FY_COMM_ALL_REDUCE, out, FY_PATTERN_GROUP_TP);
    n = fy_pattern_push(c, steps, n, max, FY_COMM_ALL_TO_ALL, rows, FY_PATTERN_GROUP_EP);
    return fy_pattern_push(c, steps, n, max, FY_COMM_ALL_TO_ALL, rows, FY_PATTERN_GROUP_EP);
  }
  case FY_PHASE_GRADS: {
    double router, experts, split;
    expert_elems(c, &router, &experts, &split);
    int n = fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, router * c->param_bytes, FY_PATTERN_GROUP_DP);
    return fy_pattern_push(c, steps, n, max, FY_COMM_ALL_REDUCE, (expert_rank_elems(c) - router) * c->param_bytes,
                           FY_PATTERN_GROUP_EP_REP);
  }
  default:
    return 0;
  }
}

// Beyond the graph's slots, a rank keeps for backward the rows it computed for its experts (their
// inputs and fc1 outputs: BT*k rows of C + F values when routing is balanced), and moves the rows
// through send and receive buffers (BT*k rows of C values each) during each all-to-all.
static double expert_act_bytes(const struct fy_pattern_ctx *c) {
  // (tp: the input gradient's part, BT*C floats beside the kernels' workspace)
  if (ep_of(c) <= 1) return tp_of(c) > 1 ? (double)(c->g->B * c->g->T * c->g->ops[c->op].C) * 4.0 : 0;
  const struct fy_op *op = &c->g->ops[c->op];
  const double rows = (double)(c->g->B * c->g->T) * op->top_k;
  // (the rows' fc1 outputs are of a rank's tp slices alone: F/tp of a whole graph's op->OC F, a tp
  // graph's op->OC already; with tp the input gradient's part besides)
  const double F = c->g->tp > 1 ? (double)op->OC : (double)op->OC / tp_of(c);
  return rows * (F + 3.0 * op->C) * c->param_bytes + (tp_of(c) > 1 ? (double)(c->g->B * c->g->T * op->C) * 4.0 : 0);
}

const struct fy_pattern fy_pattern_expert = {
    .name = "expert",
    .doc = "a mixture's experts split over groups of ep data-parallel ranks (tokens to their experts' ranks "
           "and back by all-to-all), or each expert over tp (its output and input gradient all-reduced)",
    .applies = expert_applies,
    .layout = expert_layout,
    .comm = expert_comm,
    .act_bytes = expert_act_bytes,
};
