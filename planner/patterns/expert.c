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
#include "planner/pattern.h"

static int ep_of(const struct fy_pattern_ctx *c) { return c->ep > 1 ? c->ep : 1; }

// The op's router elements and its experts' (all E of them, whether or not g already holds a
// rank's part: fy_graph_set_experts).
static void expert_elems(const struct fy_pattern_ctx *c, double *router, double *experts) {
  const struct fy_op *op = &c->g->ops[c->op];
  *router = *experts = 0;
  for (int k = 0; k < op->n_params; k++) {
    const struct fy_param *p = &c->g->params[op->params[k]];
    if (k == 0) *router += (double)p->numel;
    else *experts += (double)p->numel * (p->expert ? c->g->ep : 1);
  }
}

static bool expert_applies(const struct fy_pattern_ctx *c) {
  const struct fy_op *op = &c->g->ops[c->op];
  const int ep = ep_of(c);
  return op->kind == FY_OP_MOE && op->experts % ep == 0 && c->dp % ep == 0 && fy_pattern_params_private(c);
}

static void expert_layout(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out) {
  double router, experts;
  expert_elems(c, &router, &experts);
  const double n = router + experts / ep_of(c);
  *out = (struct fy_pattern_layout){.param_elems_per_rank = n, .optim_elems_per_rank = n, .split_dim = 0};
}

static int expert_comm(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps, int max) {
  const struct fy_op *op = &c->g->ops[c->op];
  const double rows = (double)(c->g->B * c->g->T) * op->top_k * op->C * c->param_bytes;
  switch (phase) {
  case FY_PHASE_POST_FORWARD:    // the rows to their experts, the experts' outputs back
  case FY_PHASE_POST_BACKWARD: { // the rows' gradients out, the inputs' gradients back
    int n = fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_TO_ALL, rows, FY_PATTERN_GROUP_EP);
    return fy_pattern_push(c, steps, n, max, FY_COMM_ALL_TO_ALL, rows, FY_PATTERN_GROUP_EP);
  }
  case FY_PHASE_GRADS: {
    double router, experts;
    expert_elems(c, &router, &experts);
    int n = fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, router * c->param_bytes, FY_PATTERN_GROUP_DP);
    return fy_pattern_push(c, steps, n, max, FY_COMM_ALL_REDUCE, experts / ep_of(c) * c->param_bytes,
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
  if (ep_of(c) <= 1) return 0;
  const struct fy_op *op = &c->g->ops[c->op];
  const double rows = (double)(c->g->B * c->g->T) * op->top_k;
  return rows * (op->OC + 3.0 * op->C) * c->param_bytes;
}

const struct fy_pattern fy_pattern_expert = {
    .name = "expert",
    .doc = "expert parallelism: a mixture's experts split over groups of ep data-parallel ranks; "
           "tokens to their experts' ranks and back by all-to-all, forward and backward",
    .applies = expert_applies,
    .layout = expert_layout,
    .comm = expert_comm,
    .act_bytes = expert_act_bytes,
};
