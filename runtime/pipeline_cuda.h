// The GPU side of a pipeline stage (runtime/pipeline.h on --device cuda; runtime/pipeline_cuda.c,
// built with the CUDA backend): the activations leaving a stage and their gradients coming back go
// between neighbouring stages' GPUs by NCCL send/recv (fy_comm_group_p2p) on a stream of their own,
// ordered against the kernels' stream by events, so that a message overlaps the kernels where the
// schedule lets it.
//
// NCCL's send blocks its stream until the peer receives, so two neighbours in 1F1B's steady state
// (each sending the other what it just computed and waiting for what the other computed) must
// group the send with the receive. A send is therefore held until the stage next receives: then the
// held sends to that peer go in one group with the receive (Megatron's send-forward-receive-backward
// and send-backward-receive-forward), and those to the other neighbour go first, alone (as a
// lone send before a receive from the other side would). fy_pipeline_gpu_flush issues what is held
// (the warm-up's forwards, whose next receive may be far, and the end of the step).
//
// Ordering: a group waits on the kernels' stream for everything launched before it (what it sends
// is computed, and where it receives nobody reads any more); the kernels' stream waits for a group
// that receives before its next kernel (it reads what came). A send alone is not waited for: its
// buffer is not written again before a later receive the kernels do wait for (the stage's
// activation arena waits for its micro-batch's backward, after the gradient's receive; the
// activations' gradient arena for the next receive, or fy_pipeline_gpu_flush(wait)). Evaluation's
// forward passes (fy_pipeline_forward_eval) send forward alone, so a send is issued at once and
// waited for (flush with wait): the next batch's forward on the same arena finds it sent.
// An offloaded stage (--offload) is ordered the same way: its kernels' stream is its offload
// engine's compute stream, and fy_offload_stage_pass returns without waiting for the half-pass, so
// neither the host nor a message waits for the engine's write-backs (on its copy stream).
#ifndef FY_PIPELINE_CUDA_H
#define FY_PIPELINE_CUDA_H

#include <stdbool.h>

#include "fy_config.h"
#include "runtime/comm.h"
#include "runtime/model.h"

struct fy_pipeline_gpu;

#if FY_HAVE_CUDA
// For model m (on a cuda device, its kernels attached), its messages over nccl (the pipeline's
// ranks in stage order, a nccl communicator; not owned).
fy_status fy_pipeline_gpu_create(struct fy_model *m, struct fy_comm *nccl, struct fy_pipeline_gpu **out);
void fy_pipeline_gpu_free(struct fy_pipeline_gpu *g);
// bytes of device memory at p set to 0, on the kernels' stream.
fy_status fy_pipeline_gpu_zero(struct fy_pipeline_gpu *g, void *p, size_t bytes);
// A send of bytes at buf (device memory) to stage peer, held until the next receive or flush.
fy_status fy_pipeline_gpu_send(struct fy_pipeline_gpu *g, const void *buf, size_t bytes, int peer);
// A receive of bytes into buf from stage peer (with the sends held, as the header says); the kernels
// launched after it read what came.
fy_status fy_pipeline_gpu_recv(struct fy_pipeline_gpu *g, void *buf, size_t bytes, int peer);
// The sends held, issued; with wait, the kernels' stream waits for every message so far.
fy_status fy_pipeline_gpu_flush(struct fy_pipeline_gpu *g, bool wait);
// The tied embedding's gradient (n elements at grad, bf16 or fp32) summed with stage peer's part,
// the same bits on both (a + b = b + a), on the kernels' stream.
fy_status fy_pipeline_gpu_sum_tied(struct fy_pipeline_gpu *g, void *grad, bool bf16, int64_t n, int peer);
#else
// (Without the CUDA backend no stage runs on a GPU: runtime/run.c never makes one.)
static inline void fy_pipeline_gpu_free(struct fy_pipeline_gpu *g) { (void)g; }
static inline fy_status fy_pipeline_gpu_unavailable(void) {
  return fy_error_set(FY_ERR_UNSUPPORTED, "pipeline stages on a GPU: this ferry was built without CUDA");
}
static inline fy_status fy_pipeline_gpu_create(struct fy_model *m, struct fy_comm *nccl, struct fy_pipeline_gpu **out) {
  (void)m, (void)nccl;
  *out = NULL;
  return fy_pipeline_gpu_unavailable();
}
static inline fy_status fy_pipeline_gpu_zero(struct fy_pipeline_gpu *g, void *p, size_t bytes) {
  (void)g, (void)p, (void)bytes;
  return fy_pipeline_gpu_unavailable();
}
static inline fy_status fy_pipeline_gpu_send(struct fy_pipeline_gpu *g, const void *buf, size_t bytes, int peer) {
  (void)g, (void)buf, (void)bytes, (void)peer;
  return fy_pipeline_gpu_unavailable();
}
static inline fy_status fy_pipeline_gpu_recv(struct fy_pipeline_gpu *g, void *buf, size_t bytes, int peer) {
  (void)g, (void)buf, (void)bytes, (void)peer;
  return fy_pipeline_gpu_unavailable();
}
static inline fy_status fy_pipeline_gpu_flush(struct fy_pipeline_gpu *g, bool wait) {
  (void)g, (void)wait;
  return fy_pipeline_gpu_unavailable();
}
static inline fy_status fy_pipeline_gpu_sum_tied(struct fy_pipeline_gpu *g, void *grad, bool bf16, int64_t n,
                                                 int peer) {
  (void)g, (void)grad, (void)bf16, (void)n, (void)peer;
  return fy_pipeline_gpu_unavailable();
}
#endif

#endif
