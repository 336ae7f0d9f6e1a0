// Expert parallelism (docs/ranks.md, "Expert parallelism"): within a group of ep data-parallel
// ranks each holds E/ep experts of every mixture layer (core/graph.h, fy_graph_set_experts), the
// router and the dense weights whole. A mixture's forward routes this rank's tokens, sends each
// token's row to the ranks holding its experts and gets their results back (two all-to-alls,
// fy_comm_all_to_all_v, the row counts exchanged first); its backward sends the rows' gradients
// the same way and gets the inputs' gradients back. The kernels are ops/cpu/moe_ep.c's; in 16-bit
// numerics they compute the whole op's products and round each source's part of an expert's
// gradient before the sources add (fy_moe_dims.block_grads), as 1 rank rounds each micro-batch's.
// Offloaded (--device sim, sharded chunks) the graph keeps every expert instead: a rank computes
// its E/ep of them and writes zeros for the others' gradients (runtime/ep.c, "whole"; none where
// the write-back sends each rank's own experts' alone, fy_ep_others_unread). With
// tensor parallelism too (--ep with --tp) the experts held are this rank's tp slices of them, the
// group is the ep ranks of this tp_rank, and the slices' partial sums are summed over tp as a
// tensor-parallel mixture's (fy_moe_dims.tp_sum, over m->tp_comm).
#ifndef FY_EP_H
#define FY_EP_H

#include "runtime/comm.h"
#include "runtime/engine.h"
#include "runtime/model.h"

struct fy_ep;
// The per-op state of a model whose graph has ep > 1 (m->ep), over the group m->ep_comm; with
// graph->ep 1, of a graph that keeps every expert, split over m->ep_comm's ranks (at least 2).
fy_status fy_ep_create(struct fy_model *m, struct fy_ep **out);
void fy_ep_free(struct fy_ep *ep);
// A pipeline stage's micro-batches in flight (runtime/pipeline.c): n sets of the mixtures' per-op
// state (row counts, padded rows kept for the backward), one for each activation arena of the
// graph g, and the one the next passes use (a: the arena's index).
fy_status fy_ep_set_arenas(struct fy_ep *ep, const struct fy_graph *g, int n);
void fy_ep_use_arena(struct fy_ep *ep, int a);
// A mixture op's passes under expert parallelism (runtime/engine.c calls them for FY_OP_MOE):
// collectives over the expert-parallel group, which every rank of it runs in the same order.
// forward: the op's output and *balance (the load-balancing term of this rank's tokens).
fy_status fy_ep_moe_forward(const struct fy_op_args *a, double *balance);
fy_status fy_ep_moe_backward(const struct fy_op_args *a, float dbalance);
// The gradients summed over the data-parallel ranks (in rank order, as fy_engine_all_reduce_grads):
// the dense parameters' over dp (all of them), the experts' over rep, the ranks that hold the same
// experts (NULL when there is one such rank: nothing to sum). Every expert's gradient every step,
// whether or not it got a token.
fy_status fy_ep_all_reduce_grads(struct fy_model *m, struct fy_comm *dp, struct fy_comm *rep);
// The same for the elements [lo, hi) of the flat buffer alone (a pipeline stage's own parameters,
// fy_pipeline_all_reduce_grads).
fy_status fy_ep_all_reduce_range(struct fy_model *m, struct fy_comm *dp, struct fy_comm *rep, int64_t lo, int64_t hi);
// Whole graph: nothing reads the gradients of the experts other ranks hold (the offload engine's
// ranged write-back sends each rank's own experts' alone), so the backward leaves them unwritten
// instead of writing zeros (~75 MB a mixture of opt-125m-moe8 at --ep 2).
void fy_ep_others_unread(struct fy_ep *ep);

#endif
