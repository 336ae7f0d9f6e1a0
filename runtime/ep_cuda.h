// Expert parallelism on GPUs (runtime/ep_cuda.c, built only with the cuda option): the mixture ops
// of a resident model whose graph has ep > 1 (each rank of the expert-parallel group holds E/ep
// experts, runtime/ep.h), or of an offloaded one whose graph keeps every expert (--offload: each
// rank computes its E/ep of them and writes zeros for the others' gradients, as runtime/ep.c's
// "whole"), with the GPU's kernels (ops/cuda/moe.cu, "expert parallelism's pieces").
// A mixture's forward routes this rank's tokens on the GPU, brings the experts' row counts down
// (a wait for the stream), exchanges them with the group over its mpi communicator (m->ep_comm,
// a host all-to-all), then sends each token's rows to the ranks holding its experts and gets their
// results back by grouped ncclSend/ncclRecv on the kernels' stream (an all-to-all over the group's
// nccl communicator); backward sends the rows' gradients the same way and gets the inputs' back.
// Resident, the experts' gradients stay on the rank that holds them; fy_ep_all_reduce_grads sums
// them over the ranks that hold the same experts, and the dense ones over every data-parallel rank
// (offloaded, the chunks' reduce-scatter sums them all). In bf16 the rows move in bf16, and each
// source's block of an expert's gradient is rounded to bf16 before the blocks add in fp32 (resident:
// in m->grads, which fy_ep_all_reduce_grads sums in fp32), as 1 rank accumulating rounds and adds.
#ifndef FY_EP_CUDA_H
#define FY_EP_CUDA_H

#include "runtime/comm.h"
#include "runtime/engine.h"

struct fy_cuda_blas;
// What the cuda engine lends the mixture ops: its GEMM handle, the mixtures' workspace (device,
// fy_cuda_moe_workspace_bytes of the largest op) and page-locked buffer, and its stream.
struct fy_ep_cuda_env {
  struct fy_cuda_blas *blas;
  void *work, *pinned;
  fy_stream *launch;
};

struct fy_ep_cuda;
// The per-op state of m (graph->ep > 1; or graph->ep 1, the experts split over nccl's ranks;
// m->ep_comm the group's mpi communicator) over nccl, the same group's nccl communicator (not
// owned). Device buffers for the rows received grow as needed.
fy_status fy_ep_cuda_create(struct fy_model *m, struct fy_comm *nccl, struct fy_ep_cuda **out);
void fy_ep_cuda_free(struct fy_model *m, struct fy_ep_cuda *e);
// A mixture op's passes (collectives over the group, which every rank of it runs in the same
// order): forward writes the op's output, its routing record and *balance (this rank's tokens'
// load-balancing term); backward the input's gradient, the router's and the local experts'.
fy_status fy_ep_cuda_moe_forward(struct fy_ep_cuda *e, const struct fy_op_args *a, const struct fy_ep_cuda_env *env,
                                 double *balance);
fy_status fy_ep_cuda_moe_backward(struct fy_ep_cuda *e, const struct fy_op_args *a, const struct fy_ep_cuda_env *env,
                                  float dbalance);

#endif
