// The step engine on a cuda device (runtime/engine_cuda.c, built only with the cuda option):
// the op calls dispatch to ops/cuda kernels on one stream, and the optimizer's sum of squares and
// AdamW run there too. fp32 compute and state for now (the reference tests' precision).
#ifndef FY_ENGINE_CUDA_H
#define FY_ENGINE_CUDA_H

#include "runtime/model.h"

// A cuda device on GPU `ordinal` capped at `cap` bytes (0: the GPU's memory): for code outside
// *_cuda.c files, which must not see CUDA's headers.
fy_status fy_engine_cuda_device(int ordinal, size_t cap, struct fy_device **out);
// The GPU a rank trains on (one rank per GPU): its local rank on the node, or GPU 0 when it sees
// only one (a launcher that gives every rank its own CUDA_VISIBLE_DEVICES), the rule by which the
// nccl communicator picks its GPU (runtime/comm_nccl.c).
fy_status fy_engine_cuda_rank_device(int rank, int local_rank, int *ordinal);
// GPU `ordinal`'s free and total bytes now (cudaMemGetInfo; 0 and 0 on error): total less free
// beside a device's bytes_in_use is what lies outside ferry's count (the CUDA context, cuBLASLt's
// handles, NCCL's buffers, other processes). fy_engine_cuda_free_memory: the free bytes alone.
void fy_engine_cuda_memory(int ordinal, size_t *free_bytes, size_t *total_bytes);
size_t fy_engine_cuda_free_memory(int ordinal);
// A host tier whose pages are pinned for the GPUs (cudaHostRegister), so that the chunk cache's
// copies are asynchronous DMA.
struct fy_host_tier;
fy_status fy_engine_cuda_host_tier(size_t cap, struct fy_host_tier **out);
// Gives a model created on a cuda device its CUDA kernels (model->kernels) and their context, with
// the kernels' scratch (taken from the device, inside its cap): fy_cuda_scratch_bytes
// (ops/cuda/parts.h) for the model's parameters and widest op.
fy_status fy_engine_cuda_attach(struct fy_model *m);
void fy_engine_cuda_detach(struct fy_model *m);
// Expert parallelism (m's graph has ep > 1, m->ep_comm its group over mpi): the mixtures' rows go
// to their experts' ranks and back over nccl, the same group's nccl communicator (not owned; it
// outlives the model's kernels). A resident model's, after fy_engine_cuda_attach.
struct fy_comm;
fy_status fy_engine_cuda_set_ep(struct fy_model *m, struct fy_comm *nccl);
// The stream the model's kernels launch on (its own, or the offload engine's compute stream), for
// work that must be ordered with them (a pipeline stage's messages: runtime/pipeline_cuda.c).
fy_stream *fy_engine_cuda_stream(const struct fy_model *m);
// The first op kind the cuda op table lacks a kernel for, or -1 (runtime/engine.h,
// fy_op_kernels_missing).
int fy_engine_cuda_ops_missing(void);

#endif
