// Tensor parallelism's bridge to whole tensors (core/graph.h, fy_param.split_dim): a rank's
// graph holds its slices of the split parameters, while initialisation, Hugging Face files and
// checkpoints speak of whole ones. These move between the rank's flat parameter layout and the
// whole tensors of `whole`, a graph of the same model built without tensor parallelism
// (parameters are matched by index: both come from the same builder, in the same order), one
// parameter at a time: no rank ever holds the whole model.
#ifndef FY_TP_H
#define FY_TP_H

#include "core/graph.h"
#include "runtime/comm.h"

// A source of whole tensors: elements [a, b) of parameter i of the whole model into dst[0..b-a)
// (the initialisation, a model's files, a checkpoint's AdamW state).
typedef void (*fy_tp_read_fn)(void *ctx, int i, int64_t a, int64_t b, float *dst);
// local <- this rank's slice of every parameter (the unsplit ones whole), read from the source.
void fy_tp_take(const struct fy_graph *part, float *local, const struct fy_graph *whole, fy_tp_read_fn read,
                void *ctx);
// dst[0 .. b-a) <- elements [a, b) of this rank's slice of parameter i (row-major in its own shape),
// read from the source run by run.
void fy_tp_read_part(const struct fy_graph *part, int i, int64_t a, int64_t b, fy_tp_read_fn read, void *ctx,
                     float *dst);
// dst[0 .. hi-lo) <- elements [lo, hi) of this rank's flat parameter layout (elements no parameter
// covers are 0), read from the source: a chunk, or a rank's shard of one, without the rest.
void fy_tp_fill(const struct fy_graph *part, int64_t lo, int64_t hi, fy_tp_read_fn read, void *ctx, float *dst);
// The floats fy_tp_gather_param's buffer needs: the largest split parameter's slices of all ranks.
int64_t fy_tp_gather_floats(const struct fy_graph *part);
// dst <- whole parameter i (whole->params[i].numel floats) from every rank's slice of it (this
// rank's: part->params[i].numel floats at slice), gathered over the tensor-parallel group tp_comm
// through buf (a collective for a split parameter: every rank of the group calls it; dst may be
// NULL on ranks that need no result). An unsplit parameter is copied, without communication.
// A mixture's experts under expert parallelism (fy_param.expert) are split the same way over the
// expert-parallel group: tp_comm is then that group's communicator (with tensor parallelism too,
// the slices of the experts' fc1 and fc2 over the ep x tp ranks, rank ep_rank * tp + tp_rank).
fy_status fy_tp_gather_param(const struct fy_graph *part, const float *slice, const struct fy_graph *whole, int i,
                             float *dst, float *buf, struct fy_comm *tp_comm);

#endif
