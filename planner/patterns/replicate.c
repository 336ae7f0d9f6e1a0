// replicate: every rank holds all of the op's parameters and their optimizer state (plain data
// parallelism, as DDP does); the gradients are all-reduced over the data-parallel group once
// the step's micro-batches are accumulated.
#include "planner/pattern.h"

static bool replicate_applies(const struct fy_pattern_ctx *c) { return true; }

static void replicate_layout(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out) {
  double n = (double)fy_pattern_param_elems(c, 0, true);
  *out = (struct fy_pattern_layout){.param_elems_per_rank = n, .optim_elems_per_rank = n,
                                    .split_dim = -1};
}

static int replicate_comm(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps,
                          int max) {
  if (phase != FY_PHASE_GRADS) return 0;
  double bytes = (double)fy_pattern_param_elems(c, 0, true) * c->param_bytes;
  return fy_pattern_push(c, steps, 0, max, FY_COMM_ALL_REDUCE, bytes, FY_PATTERN_GROUP_DP);
}

static double replicate_act_bytes(const struct fy_pattern_ctx *c) { return 0; }

const struct fy_pattern fy_pattern_replicate = {
    .name = "replicate",
    .doc = "every rank holds all parameters and optimizer state; gradients all-reduced over dp",
    .applies = replicate_applies,
    .layout = replicate_layout,
    .comm = replicate_comm,
    .act_bytes = replicate_act_bytes,
};
