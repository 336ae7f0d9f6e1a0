// Pipeline parallelism (docs/ranks.md, "Pipeline parallelism"): the pp ranks of one pipeline each
// run a contiguous range of the graph's operators, a stage: the first the embeddings and the first
// layers, the last the last layers, the final norm, the lm_head and the loss. A step's micro-batches
// go through the stages on the 1F1B schedule (warm-up forwards, then one forward and one backward
// in turn, then the cool-down backwards); the activation leaving a stage and its gradient coming
// back travel between neighbouring stages as point-to-point messages (runtime/comm.h).
//
// Each stage runs its ops exactly as the whole passes run them (fy_engine_forward_ops and
// fy_engine_backward_ops), on its own arena of activations per micro-batch in flight, so every
// activation, gradient and parameter gradient of a stage has the bits one rank computes. The
// exception is a tied lm_head: the embedding's weight lives on the first and the last stage, each
// computes its own part of its gradient, and the two parts are summed between them before the
// optimizer (as Megatron does), one rounding apart from one rank's sum.
//
// What is here now: the resident cpu device, and the offloading engine on sim (runtime/offload.h:
// each stage's chunks, its parameters' alone, in its own host tier, disk and device cache; the
// engine runs the stage's ops a half-pass at a time, a micro-batch's forward or backward, on the
// activations of that micro-batch's arena, and returns when they are done so that they can be
// sent; its cache's trace is the step's 1F1B order of half-passes, and its fy_offload_update sums
// the tied embedding's gradient between the ends and the norm over the stages; chunks sharded
// over the data-parallel ranks of a stage, their state on disk, and compressed AdamW state as on
// one rank), each stage's model made for it (fy_model_opts.pp: its parameters alone, with their
// gradients and AdamW state; the tied embedding on both ends), with tensor-parallel groups within
// the stages. --save, checkpoints and --resume go parameter by parameter
// (runtime/train_checkpoint.c: the stages send theirs to the first, which writes; each stage
// reads its own tensors), so no rank holds the whole model and any layout resumes any other's.
// On --device cuda (fy_pipeline_create_gpu), resident or offloaded, the activations are on the
// stage's GPU and the messages go by NCCL send/recv (runtime/pipeline_cuda.h). Not yet: the
// interleaved schedule.
#ifndef FY_PIPELINE_H
#define FY_PIPELINE_H

#include <stdbool.h>

#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"

// Whether pp stages fit a model of `layers` decoder layers on `world` ranks with tp
// tensor-parallel ranks a group: FY_ERR_INVALID naming the numbers that do not (pp not dividing
// the layers, more stages than layers, dp x pp x tp not the ranks). For every rank before any
// allocates.
fy_status fy_pipeline_check_layout(int pp, int tp, int world, int64_t layers);

struct fy_pipeline;

// Stage `stage` of pp over model m (made for this stage, fy_model_opts.pp; its parameters set),
// its neighbours the ranks stage - 1 and stage + 1 of comm (the pipeline's ranks, in stage order;
// not owned), for steps of up to max_micro micro-batches. The model's activation arena goes back to its device: each of the
// stage's arenas (one per micro-batch in flight) holds the stage's span of it alone, m->acts one of
// them while the pipeline lives (NULL after fy_pipeline_free).
fy_status fy_pipeline_create(struct fy_model *m, struct fy_comm *comm, int pp, int stage, int max_micro,
                             struct fy_pipeline **out);
// The same on a GPU: m on a cuda device with its kernels attached, the activations and their
// gradients sent over nccl (the same ranks as comm, a nccl communicator; not owned).
fy_status fy_pipeline_create_gpu(struct fy_model *m, struct fy_comm *comm, struct fy_comm *nccl, int pp, int stage,
                                 int max_micro, struct fy_pipeline **out);
void fy_pipeline_free(struct fy_pipeline *p);
bool fy_pipeline_is_last(const struct fy_pipeline *p);
// Offloaded (--device sim): the engine made for the stage (fy_offload_opts.stage_lo/hi, after the
// pipeline, so that its cache's blocks come out of what the activations leave of the device) runs
// its ops' half-passes; it sums the micro-batches' gradients as they come home, and its
// fy_offload_update sums the tied embedding's gradient between the ends and the norm over the
// stages, instead of fy_pipeline_sum_tied, _grad_norm and _adamw.
struct fy_offload;
void fy_pipeline_set_offload(struct fy_pipeline *p, struct fy_offload *x);
// The 1F1B order of stage `stage` of pp over n micro-batches: forward[k] true for a forward, false
// for a backward, 2n in all (returned); fy_pipeline_run's order, and the offload engine's trace.
int fy_pipeline_schedule(int pp, int stage, int n, bool *forward);

// One step's passes on the 1F1B schedule over the n micro-batches mb (n <= max_micro; every stage
// passes the same ones), the loss scaled by loss_scale. Micro-batch k's parameter gradients are
// summed into m->grad_acc (kernels->grads_sum, first for k = 0) when accumulate, else left in
// m->grads (n = 1). On the last stage losses[k] = micro-batch k's sum of token losses (others: 0).
fy_status fy_pipeline_run(struct fy_pipeline *p, struct fy_batch *const *mb, int n, float loss_scale, bool accumulate,
                          double *losses);
// Forward passes alone (validation between steps, ferry eval): batch b (the same on every stage)
// through the stages in turn, each stage's ops as evaluation runs them (no dropout, no backward),
// on its first arena; *loss_sum the batch's sum of token losses on the last stage (others: 0).
// Between steps; a stage then runs the next batch's while the later stages run this one's.
fy_status fy_pipeline_forward_eval(struct fy_pipeline *p, const struct fy_batch *b, double *loss_sum);
// The tied embedding's gradient (in m->grads) summed between the first and the last stage, the
// same bits on both (the last stage's part + the first's). Nothing without a tied lm_head.
fy_status fy_pipeline_sum_tied(struct fy_pipeline *p);
// Data parallelism across pipelines: this stage's parameters' gradients (m->grads) summed over dp
// (the ranks of the same stage in the other pipelines), in place, as fy_engine_all_reduce_grads
// sums them (the same bits), the rest of the buffer left alone. On GPUs dp is a nccl
// communicator, and the sum is queued on the kernels' stream. With expert parallelism within the
// stage (graph->ep > 1, the cpu alone) the experts' gradients are summed over rep instead (the
// ranks holding the same experts: runtime/ep.h, fy_ep_all_reduce_grads; NULL when there is none).
fy_status fy_pipeline_all_reduce_grads(struct fy_pipeline *p, struct fy_comm *dp, struct fy_comm *rep);
// The global gradient norm (sum of squares of this stage's own parameters, with a tensor-parallel
// group's parts and the stage's expert-parallel group's experts, added over the stages in stage
// order; the tied weight counted once), scaled as
// fy_optimizer_grad_norm's. NAN when a sum failed (the step is refused).
double fy_pipeline_grad_norm(struct fy_pipeline *p, float grad_scale);
// AdamW on the parameters this stage uses (the tied weight on both ends), as fy_optimizer_step.
fy_status fy_pipeline_adamw(struct fy_pipeline *p, const struct fy_adamw *h, float lr, int64_t t, float grad_scale,
                            double norm);
// The stage whose parameters include the whole model's parameter i (where its first use is; a
// tied embedding the first stage's), for gathering the whole model (runtime/train_checkpoint.c).
int fy_pipeline_owner(const struct fy_graph *g, int64_t layers, int pp, int i);
// A mixture of experts' load-balancing terms of the last fy_pipeline_run's n micro-batches, every
// stage's (each its own layers' mixtures: the gradient of a layer's term is its router's, local to
// its stage) added in stage order: aux[k] that of micro-batch k, as one rank's forward sums it
// (struct fy_loss's aux_sum), the same on every stage. A collective of the pipeline's stages.
fy_status fy_pipeline_aux_sums(struct fy_pipeline *p, int n, double *aux);
// A double from the last stage to every stage (the step's loss, reported by rank 0).
fy_status fy_pipeline_share_from_last(struct fy_pipeline *p, double *x);

#endif
