// fy_plan (docs/design.md, "The objects"): everything the planner decided, as a JSON file a person can
// read and edit — micro-batch and accumulation, chunk size, device cache blocks, prefetch depth,
// recomputation, how many chunks keep their state on disk, the parallel pattern — with what the
// cost model predicts for it. The search tries the knobs, keeps plans that fit every tier, and
// chooses the fastest predicted.
#ifndef FY_PLAN_H
#define FY_PLAN_H

#include <stdbool.h>
#include <stdio.h>

#include "planner/cost.h"
#include "planner/probe.h"

struct fy_plan {
  char model[256];         // preset name or config path, as given
  struct fy_plan_knobs k;
  char pattern[32];        // the parallel pattern of every operator (one rank: replicate)
  int dp, tp;              // data- and tensor-parallel ranks
  int pp;                  // pipeline stages (runtime/pipeline.h; 0 or 1: none, as plan files without "pp")
  int ep;                  // expert-parallel group size (knobs.ep; 1: none, as plan files without "ep")
  struct fy_probe machine; // the machine it was made for
  struct fy_cost predicted;
  // Empty, or why ferry train does not run this layout (fy_plan_refused): a layout given whole
  // (--dp, --pp and --tp, or a published one) is priced all the same when no layout that runs
  // fits, so that it can be compared; --plan refuses such a plan file, saying this.
  char refused[192];
};

// Searches plans for `batch` sequences of `seq` tokens per step (on one rank, in the device's
// default precision). FY_ERR_NOMEM with the smallest
// device memory that would work when nothing fits. n_tried may be NULL.
fy_status fy_plan_search(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                         const struct fy_probe *probe, struct fy_plan *best, int *n_tried);
// The same over `ranks` ranks: every dp x tp grid the model allows (tp dividing its heads and
// feed-forward size, dp the batch, which is then the global batch), data-parallel ranks sharding
// the chunks (zero), tensor-parallel ones splitting each layer. On a GPU (probe "cuda") the
// search also tries the whole model resident, its ranks replicas (knobs.resident), unless
// offload_only.
// precision: "fp32", "bf16" or "fp16" (cpu and sim), NULL or "" for the device's default (bf16
// on a GPU, fp32 on cpu and sim); every plan tried is for it (knobs.precision).
fy_status fy_plan_search_ranks(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                               int ranks, bool offload_only, const char *precision, const struct fy_probe *probe,
                               struct fy_plan *best, int *n_tried);
// The same for plans with the one-step-delayed update (optimizer_lag 1, ferry train
// --optimizer-lag 1: offloaded, 16-bit, one micro-batch a step) or without it (0).
fy_status fy_plan_search_lag(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                             int ranks, bool offload_only, const char *precision, int optimizer_lag,
                             const struct fy_probe *probe, struct fy_plan *best, int *n_tried);
// The same for AdamW state stored as `state` ("fp32", "bf16", "8bit"; NULL: fp32, knobs.optimizer_state):
// offloaded plans only when it is not fp32 (a resident GPU keeps fp32 state).
fy_status fy_plan_search_state(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                               int ranks, bool offload_only, const char *precision, int optimizer_lag, const char *state,
                               const struct fy_probe *probe, struct fy_plan *best, int *n_tried);
// How `ferry plan --gpus N` lays its ranks out: the cluster they lie on (cluster.nodes 0: one
// machine, every link the probe's comm_gbps) and the axes the user fixed (0: searched).
struct fy_plan_grid {
  struct fy_cluster cluster;
  int dp, pp, tp;
};
// The same on a grid: without a cluster or a fixed axis, fy_plan_search_state's plans, and
// pipelines (pp > 1), resident and offloaded, that ferry train runs (fy_plan_refused), chosen over
// the plans without stages only when more than 5% faster (or alone fitting). With a cluster or an
// axis fixed it prices layouts: every dp x pp x tp grid of the ranks (tp dividing the heads, the
// feed-forward size and a node's GPUs, pp the decoder layers, dp the batch; the fixed axes as
// given) that ferry train runs, each micro-batch count, recomputation and data-parallel pattern
// (replicate, zero) it runs, each stage resident on its GPUs (fy_cost_simulate's stage-by-stage
// cost) or, on sim and with offload_only, offloaded; the same preference for one stage.
// FY_ERR_INVALID naming the numbers when the grid or a fixed axis cannot be laid out;
// FY_ERR_UNSUPPORTED with the reason when ferry train runs none of its layouts; FY_ERR_NOMEM with
// the fixed layout's memory (or the least any layout needs) when none fits.
// The resident plan of one GPU alone (ferry plan --resident): every micro-batch dividing batch,
// recomputation off and on, the fastest that fits; FY_ERR_NOMEM with the least device memory one
// needs when none does.
fy_status fy_plan_search_resident(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                                  const char *precision, const struct fy_probe *probe, struct fy_plan *best,
                                  int *n_tried);
fy_status fy_plan_search_grid(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                              int ranks, bool offload_only, const char *precision, int optimizer_lag, const char *state,
                              const struct fy_plan_grid *grid, const struct fy_probe *probe, struct fy_plan *best,
                              int *n_tried);
// Why ferry train does not run a plan of these knobs (its layout dp x pp x tp, pattern, resident
// or offloaded, expert parallelism, lag and state format) for `cfg` on `device` ("sim" or "cuda",
// where plans run; "cpu" is priced but not run from a plan), as a static sentence; NULL when it
// runs it. The one place that says what runs: the search prices nothing it refuses, and ferry
// train --plan (runtime/plan_apply.c) refuses with it. On cuda: resident replicas (pattern
// replicate) and resident stages, dp x pp; resident tensor parallelism with dp 1 (pp x tp too);
// offloaded (--offload) data-parallel ranks sharding the chunks (zero), tp, pp and dp x pp x tp;
// a mixture of experts on one GPU or as resident replicas; no expert parallelism, and stages
// without the lag or compressed AdamW state. On sim: offloaded, dp sharding the chunks, tp, pp
// and ep (not a mixture's stages).
const char *fy_plan_refused(const char *device, const struct fy_opt_config *cfg, const struct fy_plan_knobs *k);
// Re-simulates a (perhaps hand-edited) plan on `probe`: FY_ERR_INVALID with the reason when it is
// inconsistent (unknown pattern, a chunk size that is not a multiple of 16 floats or cannot hold
// the largest parameter group, more blocks than the device holds, ...), FY_ERR_NOMEM when it does
// not fit; fills p->predicted.
fy_status fy_plan_check(const struct fy_opt_config *cfg, struct fy_plan *p, const struct fy_probe *probe);
// Only what fy_plan_check says without a machine: the knobs agree with each other and the model
// (what a plan for a GPU gets before it runs: this process cannot time the GPU it was made for).
fy_status fy_plan_validate(const struct fy_opt_config *cfg, struct fy_plan *p);
fy_status fy_plan_write(const char *path, const struct fy_plan *p);
fy_status fy_plan_read(const char *path, struct fy_plan *p);
void fy_plan_print(const struct fy_plan *p, FILE *f);

#endif
