// tp_col: Megatron's column-parallel linear layer. The weight (OC,C) and the bias are split by
// output features over the tensor-parallel group, so each rank holds OC/tp rows and produces
// out (BT,OC/tp) from the whole input. Forward needs no communication: the input is replicated
// and the output stays split (the next op, typically a tp_row linear, takes it as it is).
// Backward all-reduces the input gradient over tp, since each rank only has its rows'
// contribution to it. The shard's gradients are all-reduced over dp.
//
// The all-reduce cannot run in place on the input's gradient slot: gradients accumulate there
// (a residual's consumer may already have written to it), and summing that slot over tp would
// count the other contribution tp times. So each rank keeps a private (BT,C) buffer for its
// partial input gradient and adds the reduced result into the slot.
#include "planner/pattern.h"

// dinput_part (BT,C) holds this rank's part of the input gradient: summed over tp, then added to
// the slot.
static fy_status tp_col_post_backward(const struct fy_pattern_run *r) {
  const struct fy_op *op = &r->g->ops[r->op];
  int64_t n = r->g->B * r->g->T * op->C;
  FY_TRY(r->all_reduce(r->ctx, FY_PATTERN_GROUP_TP, r->dinput_part, (size_t)n));
  return r->add(r->ctx, r->dinput, r->dinput_part, (size_t)n);
}

static bool tp_col_applies(const struct fy_pattern_ctx *c) {
  const struct fy_op *op = &c->g->ops[c->op];
  // A tied weight (OPT's lm_head) would have to be split at its other user too.
  return op->kind == FY_OP_LINEAR && c->tp >= 1 && op->OC % c->tp == 0 &&
         fy_pattern_params_private(c);
}

static void tp_col_layout(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out) {
  double n = (double)fy_pattern_param_elems(c, 0, true) / c->tp;
  *out = (struct fy_pattern_layout){.param_elems_per_rank = n, .optim_elems_per_rank = n,
                                    .split_dim = 0};
}

static int tp_col_comm(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps,
                       int max) {
  const struct fy_op *op = &c->g->ops[c->op];
  switch (phase) {
  case FY_PHASE_POST_BACKWARD: {
    double bytes = (double)(c->g->B * c->g->T * op->C) * c->param_bytes;
    return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, bytes, FY_PATTERN_GROUP_TP);
  }
  case FY_PHASE_GRADS: {
    double bytes = (double)fy_pattern_param_elems(c, 0, true) / c->tp * c->param_bytes;
    return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, bytes, FY_PATTERN_GROUP_DP);
  }
  default:
    return 0;
  }
}

static double tp_col_act_bytes(const struct fy_pattern_ctx *c) {
  if (c->tp <= 1) return 0;
  return (double)(c->g->B * c->g->T * c->g->ops[c->op].C) * c->param_bytes;
}

const struct fy_pattern fy_pattern_tp_col = {
    .name = "tp_col",
    .doc = "Megatron column-parallel linear: weight split by output features over tp; "
           "input gradient all-reduced over tp in backward",
    .applies = tp_col_applies,
    .layout = tp_col_layout,
    .comm = tp_col_comm,
    .act_bytes = tp_col_act_bytes,
    .post_backward = tp_col_post_backward,
};
