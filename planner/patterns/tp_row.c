// tp_row: Megatron's row-parallel linear layer. The weight (OC,C) is split by input features over
// the tensor-parallel group: each rank holds C/tp columns, takes its slice of the input (BT,C/tp)
// as a tp_col layer left it, and computes a partial out (BT,OC) that is all-reduced over tp after
// forward. The bias is not split: every rank holds it whole and adds it once, after the
// all-reduce. Backward needs no communication: the input gradient stays split like the input.
// The gradients (the weight's shard and the bias) are all-reduced over dp.
//
// When the layer's activations are recomputed, its forward (all-reduce included) runs again just
// before its backward, which is counted as communication before backward.
//
// The output slot is written, not accumulated, so its all-reduce runs in place: no extra memory.
#include "planner/pattern.h"

// out (BT,OC) holds this rank's partial product: summed over tp, then the bias (OC) added once.
static fy_status tp_row_post_forward(const struct fy_pattern_run *r) {
  const struct fy_op *op = &r->g->ops[r->op];
  int64_t BT = r->g->B * r->g->T, OC = op->OC;
  FY_TRY(r->all_reduce(r->ctx, FY_PATTERN_GROUP_TP, r->out, (size_t)(BT * OC)));
  return r->bias ? r->add_bias(r->ctx, r->out, r->bias, BT, OC) : FY_OK;
}

static bool tp_row_applies(const struct fy_pattern_ctx *c) {
  const struct fy_op *op = &c->g->ops[c->op];
  return op->kind == FY_OP_LINEAR && c->tp >= 1 && op->C % c->tp == 0 &&
         fy_pattern_params_private(c);
}

static double tp_row_elems(const struct fy_pattern_ctx *c) {
  return (double)fy_pattern_param_elems(c, 1, true) / c->tp +
         (double)fy_pattern_param_elems(c, 2, true);
}

static void tp_row_layout(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out) {
  double n = tp_row_elems(c);
  *out = (struct fy_pattern_layout){.param_elems_per_rank = n, .optim_elems_per_rank = n,
                                    .split_dim = 1};
}

static int tp_row_comm(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps,
                       int max) {
  const struct fy_op *op = &c->g->ops[c->op];
  double out_bytes = (double)(c->g->B * c->g->T * op->OC) * c->param_bytes;
  switch (phase) {
  case FY_PHASE_POST_FORWARD:
    return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, out_bytes, FY_PATTERN_GROUP_TP);
  case FY_PHASE_PRE_BACKWARD:
    if (!(c->g->recompute && op->layer >= 0)) return 0;
    return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, out_bytes, FY_PATTERN_GROUP_TP);
  case FY_PHASE_GRADS:
    return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, tp_row_elems(c) * c->param_bytes,
                           FY_PATTERN_GROUP_DP);
  default:
    return 0;
  }
}

static double tp_row_act_bytes(const struct fy_pattern_ctx *c) { return 0; }

const struct fy_pattern fy_pattern_tp_row = {
    .name = "tp_row",
    .doc = "Megatron row-parallel linear: weight split by input features over tp; "
           "output all-reduced over tp after forward",
    .applies = tp_row_applies,
    .layout = tp_row_layout,
    .comm = tp_row_comm,
    .act_bytes = tp_row_act_bytes,
    .post_forward = tp_row_post_forward,
};
