// The GPU side of a pipeline stage: NCCL send/recv between neighbouring stages on a stream of
// their own (runtime/pipeline_cuda.h).
#include "runtime/pipeline_cuda.h"

#include <cuda_runtime.h>
#include <stdlib.h>

#include "core/device_cuda.h"
#include "ops/cuda/ops_cuda.h"
#include "runtime/engine_cuda.h"

#define HELD_MAX 8  // sends held at once (1F1B holds one; the first stage's warm-up is flushed)

struct fy_pipeline_gpu {
  struct fy_model *m;
  struct fy_comm *nccl;            // not owned
  fy_stream *comm;                 // owned: where the messages go
  cudaEvent_t computed, moved;     // kernels' stream -> messages; messages -> kernels' stream
  struct fy_comm_p2p held[HELD_MAX];
  int n_held;
  void *tied;                      // the other end's part of the tied gradient (device memory)
  size_t tied_bytes;
};

static fy_status cuda_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return FY_OK;
  (void)cudaGetLastError();
  return fy_error_set(FY_ERR_INTERNAL, "pipeline stage: %s: %s", what, cudaGetErrorString(e));
}

static cudaStream_t kernels(const struct fy_pipeline_gpu *g) { return fy_cuda_stream(fy_engine_cuda_stream(g->m)); }

void fy_pipeline_gpu_free(struct fy_pipeline_gpu *g) {
  if (!g) return;
  if (g->comm) (void)fy_stream_sync(g->comm);
  if (g->tied) fy_device_dealloc(g->m->dev, g->tied, g->tied_bytes);
  if (g->computed) (void)cudaEventDestroy(g->computed);
  if (g->moved) (void)cudaEventDestroy(g->moved);
  fy_stream_free(g->comm);
  free(g);
}

fy_status fy_pipeline_gpu_create(struct fy_model *m, struct fy_comm *nccl, struct fy_pipeline_gpu **out) {
  *out = NULL;
  if (!m->kernels_ctx || fy_comm_kind(nccl) != FY_COMM_NCCL)
    return fy_error_set(FY_ERR_INTERNAL, "a pipeline stage on a GPU needs the cuda kernels and a nccl communicator");
  struct fy_pipeline_gpu *g = calloc(1, sizeof *g);
  if (!g) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  g->m = m;
  g->nccl = nccl;
  fy_status st = fy_stream_create(m->dev, &g->comm);
  if (st == FY_OK) st = cuda_ok(cudaEventCreateWithFlags(&g->computed, cudaEventDisableTiming), "cudaEventCreate");
  if (st == FY_OK) st = cuda_ok(cudaEventCreateWithFlags(&g->moved, cudaEventDisableTiming), "cudaEventCreate");
  if (st != FY_OK) {
    fy_pipeline_gpu_free(g);
    return st;
  }
  *out = g;
  return FY_OK;
}

fy_status fy_pipeline_gpu_zero(struct fy_pipeline_gpu *g, void *p, size_t bytes) {
  return cuda_ok(cudaMemsetAsync(p, 0, bytes, kernels(g)), "cudaMemsetAsync");
}

// One group of messages on the messages' stream after everything the kernels' stream has so far;
// with wait, the kernels launched next wait for it.
static fy_status issue(struct fy_pipeline_gpu *g, const struct fy_comm_p2p *msgs, int n, bool wait) {
  cudaStream_t ks = kernels(g), cs = fy_cuda_stream(g->comm);
  FY_TRY(cuda_ok(cudaEventRecord(g->computed, ks), "cudaEventRecord"));
  FY_TRY(cuda_ok(cudaStreamWaitEvent(cs, g->computed, 0), "cudaStreamWaitEvent"));
  if (n > 0) FY_TRY(fy_comm_group_p2p(g->nccl, msgs, n, g->comm));
  if (!wait) return FY_OK;
  FY_TRY(cuda_ok(cudaEventRecord(g->moved, cs), "cudaEventRecord"));
  return cuda_ok(cudaStreamWaitEvent(ks, g->moved, 0), "cudaStreamWaitEvent");
}

fy_status fy_pipeline_gpu_flush(struct fy_pipeline_gpu *g, bool wait) {
  if (g->n_held == 0 && !wait) return FY_OK;
  fy_status st = issue(g, g->held, g->n_held, wait);
  g->n_held = 0;
  return st;
}

fy_status fy_pipeline_gpu_send(struct fy_pipeline_gpu *g, const void *buf, size_t bytes, int peer) {
  if (g->n_held == HELD_MAX) FY_TRY(fy_pipeline_gpu_flush(g, false));
  g->held[g->n_held++] = (struct fy_comm_p2p){.buf = (void *)buf, .bytes = bytes, .peer = peer, .send = 1};
  return FY_OK;
}

fy_status fy_pipeline_gpu_recv(struct fy_pipeline_gpu *g, void *buf, size_t bytes, int peer) {
  struct fy_comm_p2p other[HELD_MAX], group[HELD_MAX + 1];
  int n_other = 0, n_group = 0;
  for (int k = 0; k < g->n_held; k++) {
    if (g->held[k].peer == peer) group[n_group++] = g->held[k];
    else other[n_other++] = g->held[k];
  }
  g->n_held = 0;
  group[n_group++] = (struct fy_comm_p2p){.buf = buf, .bytes = bytes, .peer = peer, .send = 0};
  if (n_other > 0) FY_TRY(issue(g, other, n_other, false));
  return issue(g, group, n_group, true);
}

fy_status fy_pipeline_gpu_sum_tied(struct fy_pipeline_gpu *g, void *grad, bool bf16, int64_t n, int peer) {
  const size_t bytes = (size_t)n * (bf16 ? 2 : 4);
  if (g->tied_bytes < bytes) {
    if (g->tied) fy_device_dealloc(g->m->dev, g->tied, g->tied_bytes);
    g->tied = NULL;
    g->tied_bytes = 0;
    FY_TRY(fy_device_alloc(g->m->dev, (size_t)n * 4, &g->tied));  // (room for fp32: accumulated steps)
    g->tied_bytes = (size_t)n * 4;
  }
  FY_TRY(fy_pipeline_gpu_flush(g, false));
  const struct fy_comm_p2p msgs[2] = {{.buf = grad, .bytes = bytes, .peer = peer, .send = 1},
                                      {.buf = g->tied, .bytes = bytes, .peer = peer, .send = 0}};
  FY_TRY(issue(g, msgs, 2, true));
  // (The messages' stream may read grad until the kernels' stream waits for it: it does, above.)
  return fy_cuda_add_forward(grad, grad, g->tied, bf16 ? FY_BF16 : FY_F32, n, kernels(g));
}
