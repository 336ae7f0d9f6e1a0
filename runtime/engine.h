// The step engine (DESIGN.md, "One training step", steps 2 and 3): forward walks the graph's
// operators in order, backward in reverse, each op calling its kernel on the model's buffers.
#ifndef FY_ENGINE_H
#define FY_ENGINE_H

#include "runtime/data.h"
#include "runtime/model.h"

struct fy_loss {
  double sum;      // sum of per-token losses over targets not ignored
  int64_t count;   // number of targets not ignored
};

// Runs the forward pass on a micro-batch (its B and T must be those the model was built for).
// Checks every token and target id against the vocabulary first.
fy_status fy_engine_forward(struct fy_model *m, const struct fy_batch *batch, struct fy_loss *loss);
// Runs the backward pass of the last forward, adding into m->grads the gradient of
// `loss_scale` x (sum of per-token losses). Callers pass 1/count for a mean.
fy_status fy_engine_backward(struct fy_model *m, const struct fy_batch *batch, float loss_scale);
// Positions as OPTLearnedPositionalEmbedding computes them, offset 2 included:
// cumsum(mask) * mask - 1 + 2 (all ones when mask is NULL).
void fy_engine_positions(int32_t *pos, const int32_t *mask, int64_t B, int64_t T);

#endif
