// Internal to the trainer (runtime/trainer.c, run.c, step.c, train_checkpoint.c, plan_apply.c,
// train_opts.c, eval_sample.c): the run these files share and the helpers they call across
// files. Not part of the trainer's API (runtime/trainer.h); nothing outside these files includes it.
#ifndef FY_RUN_H
#define FY_RUN_H

#include <stdbool.h>
#include <stdint.h>

#include "core/opt.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "runtime/data.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/trainer.h"
#include "memory/tier.h"

// Everything one run holds; torn down in reverse.
struct run {
  struct fy_comm *comm;  // the ranks (single when launched alone)
  int rank, world;
  // A dp x tp grid: rank = dp_rank * tp + tp_rank. dp_comm: the ranks holding the same slices
  // (the world without tensor parallelism); tp_comm: those sharing sequences (NULL for tp 1).
  int tp, tp_rank, dp, dp_rank;
  struct fy_comm *dp_comm, *tp_comm;
  // Pipeline parallelism (--pp): the grid is dp x pp x tp, rank = (dp_rank * pp + pp_rank) * tp +
  // tp_rank; pp_comm holds one pipeline's stages in order (NULL for pp 1), pipe its schedule.
  int pp, pp_rank;
  struct fy_comm *pp_comm;
  struct fy_comm *pp_compute;  // on GPUs: pp_comm's ranks as a nccl communicator (the stages' messages)
  struct fy_pipeline *pipe;
  // Expert parallelism (--ep, runtime/ep.h): data-parallel rank dp_rank is rank ep_rank = dp_rank %
  // ep of expert-parallel group dp_rank / ep (ep_comm, NULL for ep 1); ep_rep: the ranks holding the
  // same experts, one a group (NULL when there is one group), over which the experts' gradients sum.
  int ep, ep_rank;
  struct fy_comm *ep_comm, *ep_rep;
  // With --tp too: ep_comm holds the group's ranks of this tp_rank (they exchange the rows of the
  // experts' slices they hold); eptp_comm all ep x tp ranks of the group, rank ep_rank * tp + tp_rank,
  // over which an expert's tp slice is gathered whole (runtime/tp.h). NULL otherwise.
  struct fy_comm *eptp_comm;
  // On GPUs (resident): ep_comm's and ep_rep's ranks as nccl communicators (the mixtures' rows;
  // the experts' gradients' sum over their replicas).
  struct fy_comm *ep_compute, *rep_compute;
  // The groups of the ops' pattern hooks (sim and GPUs: on the compute stream); on GPUs with
  // resident parameters dp_compute also sums the replicas' gradients (nccl).
  struct fy_comm *tp_compute, *dp_compute;
  // Sharded chunks: the blocks' collectives, over dp_comm's ranks: nccl on GPUs, an mpi
  // communicator of their own on sim (the same plumbing as on GPUs).
  struct fy_comm *dp_blocks;
  // With tensor or pipeline parallelism: the whole model's graph and, when needed, its weights (the
  // model as Hugging Face files and checkpoints hold it; params NULL while not needed).
  struct fy_graph *whole_graph;
  struct fy_model whole;
  struct fy_opt_config cfg;
  struct fy_device *dev;
  struct fy_host_tier *host;
  struct fy_disk_tier *disk;
  struct fy_model *model;
  struct fy_offload *x;  // NULL: parameters resident on a cpu device
  bool ckpt_by_chunk;    // checkpoints written chunk by chunk from the offloaded state (fy_ckpt_write_pieces)
  bool eval;             // set up for evaluation (an offload engine of forward passes alone)
  fy_data *data;
  fy_data *val;          // validation batches (--val-data), NULL without
  int gpu;               // the GPU a cuda run trains on, -1 on the cpu and sim devices
  int64_t updates;       // AdamW updates applied: the next one's bias correction is for updates + 1
  // --optimizer-lag on the cpu: the gradients of the last step (lag_grads, swapped with the
  // model's own, which lag_own was allocated to stand in for) and that step's update's arguments,
  // applied after the next step's passes (step_resident) or by drain_updates.
  float *lag_grads, *lag_own;
  double aux_loss;       // a mixture of experts: the last step's load-balancing terms (struct fy_loss)
  struct lagged_update { bool pending, skip; float lr, grad_scale; int64_t t; double norm; } lag;
};

// Whether the rank's parameters are parts of the whole model's (tensor-parallel slices, a pipeline
// stage's, expert-parallel experts): the weights are taken, checkpointed and saved through the
// whole model's graph (r->whole_graph, runtime/tp.h).
static inline bool run_split(const struct run *r) { return r->tp > 1 || r->pp > 1 || r->ep > 1; }

// run.c: the run's configuration, placement and weights.
fy_status resolve_init(const char **init, char *buf, size_t n);
fy_status resolve_config(const struct fy_train_opts *o, struct fy_opt_config *cfg);
float train_dropout(const struct fy_train_opts *o, const struct fy_opt_config *cfg);
enum fy_dtype precision_dtype(const struct fy_train_opts *o);
enum fy_state_format state_format(const struct fy_train_opts *o);
double gpu_other_bytes(const struct run *r);
fy_status seq_fits(int64_t seq, const struct fy_opt_config *cfg);
fy_status make_comm(const struct fy_train_opts *o, struct fy_comm **out);
fy_status setup(const struct fy_train_opts *o, struct run *r, bool shuffle, bool eval, struct fy_comm *comm);
void teardown(struct run *r);
fy_status set_shards(struct run *r, const char *dir, uint64_t seed);
fy_status tp_take_weights(struct run *r, const char *dir, uint64_t seed);

// train_opts.c: the options' checks and derived defaults.
fy_status resolve_seq(struct fy_train_opts *o);
fy_status check_train_opts(struct fy_train_opts *e);

// step.c: the steps, the lagged update, the mean loss.
fy_status step_resident(const struct fy_train_opts *o, struct run *r, int64_t step, double scale, double *loss_out,
                        double *norm_out, bool *overflow, double *t_sum, double *t_opt);
fy_status step_offload(const struct fy_train_opts *o, struct run *r, int64_t step, double scale, double *loss_out,
                       double *norm_out, bool *overflow);
fy_status drain_updates(const struct fy_train_opts *o, struct run *r);
fy_status mean_loss(struct run *r, fy_data *data, int64_t n, double *mean,
                    fy_status (*first)(struct run *r, const struct fy_batch *b, void *ctx), void *ctx);
void name_nonfinite(struct run *r);

// train_checkpoint.c: checkpoints, resuming, the final save's gathers and hash.
fy_status checkpoint(const struct fy_train_opts *o, struct run *r, struct fy_ckpt_writer *w, int64_t steps_done,
                     double scale, int64_t scale_good);
fy_status resume(const struct fy_train_opts *o, struct run *r, int64_t *first_step, double *scale,
                 int64_t *scale_good);
void check_save_space(const struct fy_train_opts *o, double params, int64_t steps_left);
double dir_bytes(const char *root);
uint64_t hash_params(struct fy_model *m);
fy_status finish_sharded(struct run *r, const char *save, bool lead, uint64_t *hash);
fy_status finish_tp(struct run *r, const char *save, bool lead, uint64_t *hash);

// plan_apply.c: --plan.
fy_status apply_plan(struct fy_train_opts *o, struct fy_comm *comm, bool seq_given);

#endif
