// Tensor parallelism's bridge to whole tensors (core/graph.h, fy_param.split_dim): a rank's
// graph holds its slices of the split parameters, while initialisation, Hugging Face files and
// checkpoints speak of whole ones. These copy between the rank's flat parameter layout and that
// of `whole`, a graph of the same model built without tensor parallelism (parameters are matched
// by index: both come from the same builder, in the same order).
#ifndef FY_TP_H
#define FY_TP_H

#include "core/graph.h"
#include "runtime/comm.h"

// local <- this rank's slice of full (every parameter: the whole ones copied).
void fy_tp_take(const struct fy_graph *part, float *local, const struct fy_graph *whole, const float *full);
// full <- every rank's slices of local, gathered over the tensor-parallel group tp_comm (a
// collective: every rank of the group calls it; full may be NULL on ranks that need no result).
fy_status fy_tp_gather(const struct fy_graph *part, const float *local, const struct fy_graph *whole, float *full,
                       struct fy_comm *tp_comm);

#endif
