// zero: ZeRO-3 over the data-parallel group, at the granularity of ferry's chunks: each rank
// holds 1/dp of every chunk's compute payload and of its optimizer state. The op's parameters are
// all-gathered before its forward and again before its backward (they are not kept in between),
// and its gradients are reduce-scattered to their owners right after backward, on every
// micro-batch, because no rank keeps a full gradient between micro-batches.
//
// The gathered weights occupy the device chunk cache's blocks, which the planner sizes itself, so
// the pattern adds no activation memory.
#include "planner/pattern.h"

static bool zero_applies(const struct fy_pattern_ctx *c) { return true; }

static void zero_layout(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out) {
  double n = (double)fy_pattern_param_elems(c, 0, true) / c->dp;
  *out = (struct fy_pattern_layout){.param_elems_per_rank = n, .optim_elems_per_rank = n,
                                    .split_dim = -1};
}

static int zero_comm(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps,
                     int max) {
  switch (phase) {
  case FY_PHASE_PRE_FORWARD:
  case FY_PHASE_PRE_BACKWARD: {
    // Every parameter the op reads, a tied one too: it was dropped after its other use.
    double bytes = (double)fy_pattern_param_elems(c, 0, false) * c->param_bytes;
    return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_GATHER, bytes, FY_PATTERN_GROUP_DP);
  }
  case FY_PHASE_POST_BACKWARD: {
    // A tied parameter is reduced once, by the op that uses it first: the last in backward.
    double bytes = (double)fy_pattern_param_elems(c, 0, true) * c->param_bytes;
    return fy_pattern_push(c, steps, 0, max, FY_COMM_REDUCE_SCATTER, bytes, FY_PATTERN_GROUP_DP);
  }
  default:
    return 0;
  }
}

static double zero_act_bytes(const struct fy_pattern_ctx *c) { return 0; }

const struct fy_pattern fy_pattern_zero = {
    .name = "zero",
    .doc = "ZeRO-3: chunks sharded over dp; all-gather before forward and backward, "
           "reduce-scatter of gradients after backward",
    .applies = zero_applies,
    .layout = zero_layout,
    .comm = zero_comm,
    .act_bytes = zero_act_bytes,
};
