// One optimizer step (resident parameters, or offloaded), --optimizer-lag's delayed update, and
// the mean loss over batches (validation, ferry eval).
#include "runtime/trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "fy_config.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/ep.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/pipeline.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "memory/tier.h"
#include "runtime/run.h"

// The targets that count in this step (the data's loss masks leave some out), over every
// data-parallel rank: counts[k] those of micro-batch k, *total their sum, from the masks before
// any batch is read. The loss is the mean over the total, so a step's loss and gradient are those
// of one batch of the whole step, however it is split into micro-batches and ranks.
static fy_status step_targets(const struct fy_train_opts *o, struct run *r, int64_t *counts, int64_t *total) {
  const int64_t K = o->grad_accum;
  for (int64_t k = 0; k < K; k++) counts[k] = fy_data_count_targets(r->data, k);
  if (r->dp > 1) {  // exact counts (a float's 24 bits are not enough for every run): int64 as 2 words
    int64_t all[r->dp * K];
    FY_TRY(fy_comm_all_gather(r->dp_comm, counts, all, (size_t)(2 * K), FY_COMM_F32, NULL));
    for (int64_t k = 0; k < K; k++) {
      counts[k] = 0;
      for (int i = 0; i < r->dp; i++) counts[k] += all[i * K + k];
    }
  }
  *total = 0;
  for (int64_t k = 0; k < K; k++) *total += counts[k];
  return FY_OK;
}

// A step whose every target is ignored: its micro-batches are passed over (the data stream moves
// on as if they were trained) and nothing is updated.
static fy_status skip_step(const struct fy_train_opts *o, struct run *r) {
  FY_TRY(fy_data_seek(r->data, fy_data_position(r->data) + o->grad_accum));
  return FY_ERR_NOT_FOUND;
}

// --optimizer-lag on the cpu: the update still pending (the gradients in lag_grads, with their
// step's arguments), as the exact step would have applied it.
static fy_status apply_lagged(const struct fy_train_opts *o, struct run *r) {
  if (!r->lag.pending) return FY_OK;
  r->lag.pending = false;
  if (r->lag.skip) return FY_OK;
  struct fy_model *m = r->model;
  float *g = m->grads;
  m->grads = r->lag_grads;
  fy_status st = r->pipe ? fy_pipeline_adamw(r->pipe, &o->adamw, r->lag.lr, r->lag.t, r->lag.grad_scale, r->lag.norm)
                         : fy_optimizer_step(m, &o->adamw, r->lag.lr, r->lag.t, r->lag.grad_scale, r->lag.norm);
  m->grads = g;
  return st;
}

// --optimizer-lag (resident): the step before's update now; this step's gradients kept (swapped with
// the lag's buffer) and its update applied after the next step's passes.
static fy_status defer_update(const struct fy_train_opts *o, struct run *r, int64_t step, float unscale, double norm,
                              bool overflow) {
  struct fy_model *model = r->model;
  fy_status st = apply_lagged(o, r);
  float *t = model->grads;
  model->grads = r->lag_grads;
  r->lag_grads = t;
  r->lag = (struct lagged_update){.pending = true, .skip = overflow, .lr = fy_lr_at(o, step), .grad_scale = unscale,
                                  .t = r->updates + 1, .norm = norm};
  if (!overflow) r->updates++;
  return st;
}

// --optimizer-lag: the update still pending applied, so that the weights are those after every
// step so far (before a checkpoint, a validation that ends the run, the end); the next step starts
// the lag again. Without the lag, offloaded: the engine's streams synced.
fy_status drain_updates(const struct fy_train_opts *o, struct run *r) {
  if (r->x) return fy_offload_drain(r->x);
  return apply_lagged(o, r);
}

// One step of a pipeline stage (runtime/pipeline.h): the step's micro-batches on the 1F1B
// schedule, the tied embedding's gradient summed between the ends, the replicas' gradients summed,
// the norm over every stage, AdamW on this stage's parameters; the loss from the last stage.
static fy_status step_pipeline(const struct fy_train_opts *o, struct run *r, int64_t step, double scale,
                               double *loss_out, double *norm_out, bool *overflow, double *t_opt) {
  struct fy_model *model = r->model;
  const int64_t K = o->grad_accum;
  int64_t counts[K], total = 0;
  FY_TRY(step_targets(o, r, counts, &total));
  if (total == 0) return skip_step(o, r);
  // Every stage reads the same micro-batches (the first its tokens, the last its targets, all the
  // masks), kept until their backward: the loader keeps only the last.
  const size_t bt = (size_t)(o->batch * o->seq);
  int32_t *keep = malloc(3 * bt * (size_t)K * sizeof *keep);
  if (!keep) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  struct fy_batch copies[K], *mb[K];
  int n = 0;
  fy_status st = FY_OK;
  for (int64_t k = 0; k < K && st == FY_OK; k++) {
    struct fy_batch *b;
    if ((st = fy_data_next(r->data, &b)) != FY_OK || counts[k] == 0) continue;  // (no targets: no gradient)
    int32_t *at = keep + 3 * bt * (size_t)n;
    copies[n] = *b;
    copies[n].inputs = memcpy(at, b->inputs, bt * sizeof *at);
    copies[n].targets = memcpy(at + bt, b->targets, bt * sizeof *at);
    copies[n].mask = b->mask ? memcpy(at + 2 * bt, b->mask, bt * sizeof *at) : NULL;
    mb[n] = &copies[n];
    n++;
  }
  double losses[K > 0 ? K : 1];
  if (st == FY_OK) st = fy_pipeline_run(r->pipe, mb, n, (float)(scale / (double)total), K > 1, losses);
  free(keep);
  FY_TRY(st);
  // A mixture of experts: each micro-batch's load-balancing terms, every stage's layers' added.
  const bool moe = model->cfg.num_local_experts > 0;
  double aux[K > 0 ? K : 1];
  if (moe) FY_TRY(fy_pipeline_aux_sums(r->pipe, n, aux));
  // The loss: the last stages' sums over the data-parallel ranks (each micro-batch's in fp32, as
  // step_resident sums them, with its balance terms), then from the last stage to the others.
  double loss_sum = 0, aux_sum = 0;
  if (fy_pipeline_is_last(r->pipe)) {
    float global[2 * (K > 0 ? K : 1)];
    for (int i = 0; i < n; i++) global[i] = (float)losses[i], global[n + i] = moe ? (float)aux[i] : 0.0f;
    if (r->dp > 1 && n > 0)
      FY_TRY(fy_comm_all_reduce(r->dp_comm, global, (size_t)(moe ? 2 * n : n), FY_COMM_F32, NULL));
    for (int i = 0; i < n; i++) {
      loss_sum += r->dp > 1 ? global[i] : losses[i];
      if (moe) aux_sum += r->dp > 1 ? global[n + i] : aux[i];
    }
  }
  FY_TRY(fy_pipeline_share_from_last(r->pipe, &loss_sum));
  if (moe) FY_TRY(fy_pipeline_share_from_last(r->pipe, &aux_sum));
  if (!isfinite(loss_sum)) return fy_error_set(FY_ERR_NUMERIC, "the loss is %f", loss_sum / (double)total);
  *loss_out = loss_sum / (double)total;
  r->aux_loss = aux_sum / (double)total;
  if (r->x) {  // offloaded: the engine sums the tied gradient, the norm over the stages, and updates
    double t0 = fy_now(), sums[K > 0 ? K : 1];
    st = fy_offload_update(r->x, &o->adamw, fy_lr_at(o, step), r->updates + 1, (float)(1.0 / scale), norm_out, sums,
                           overflow);
    if (st == FY_OK && !*overflow) r->updates++;
    *t_opt += fy_now() - t0;
    return st;
  }
  if (K > 1) {  // the optimizer reads m->grads: the fp32 sum
    float *t = model->grads;
    model->grads = model->grad_acc;
    model->grad_acc = t;
  }
  model->grads_f32 = K > 1;
  FY_TRY(fy_pipeline_sum_tied(r->pipe));
  if (r->dp > 1)  // (with --ep the experts' over ep_rep, their replicas in the stage's other ep groups)
    FY_TRY(fy_pipeline_all_reduce_grads(r->pipe, r->pp_compute ? r->dp_compute : r->dp_comm, r->ep_rep));
  double t0 = fy_now();
  float unscale = (float)(1.0 / scale);
  *norm_out = fy_pipeline_grad_norm(r->pipe, unscale);  // (on GPUs: after the streams' messages and sums)
  if (r->pp_compute) FY_TRY(fy_comm_status(r->pp_compute));  // their errors, before an update uses them
  if (r->pp_compute && r->dp_compute) FY_TRY(fy_comm_status(r->dp_compute));
  *overflow = !isfinite(*norm_out);
  if (r->lag_own) {  // --optimizer-lag: the step before's update now, this one's after the next step's passes
    st = defer_update(o, r, step, unscale, *norm_out, *overflow);
  } else if (!*overflow) {
    st = fy_pipeline_adamw(r->pipe, &o->adamw, fy_lr_at(o, step), r->updates + 1, unscale, *norm_out);
    if (st == FY_OK) r->updates++;
  }
  *t_opt += fy_now() - t0;
  return st;
}

// One optimizer step on resident parameters: micro-batches, their sum, norm, AdamW.
fy_status step_resident(const struct fy_train_opts *o, struct run *r, int64_t step, double scale,
                        double *loss_out, double *norm_out, bool *overflow, double *t_sum, double *t_opt) {
  if (r->pipe) return step_pipeline(o, r, step, scale, loss_out, norm_out, overflow, t_opt);
  struct fy_model *model = r->model;
  int64_t counts[o->grad_accum], total = 0, n_with_grads = 0;
  FY_TRY(step_targets(o, r, counts, &total));
  if (total == 0) return skip_step(o, r);
  double loss_sum = 0, aux_sum = 0;
  for (int64_t micro = 0; micro < o->grad_accum; micro++) {
    struct fy_batch *batch;
    struct fy_loss loss;
    FY_TRY(fy_data_next(r->data, &batch));
    if (counts[micro] == 0) continue;  // every target of this micro-batch ignored: no gradient from it
    FY_TRY(fy_engine_forward(model, batch, &loss));
    // Every data-parallel rank's part of the micro-batch (tensor-parallel ranks share their
    // sequences: the sum runs over the data-parallel group), so that all see a non-finite loss.
    float global[2] = {(float)loss.sum, (float)loss.aux_sum};
    if (r->dp > 1) FY_TRY(fy_comm_all_reduce(r->dp_comm, global, 2, FY_COMM_F32, NULL));
    const double sum = r->dp > 1 ? global[0] : loss.sum;
    if (!isfinite(sum)) return fy_error_set(FY_ERR_NUMERIC, "the loss is %f", sum / (double)counts[micro]);
    loss_sum += sum;
    aux_sum += r->dp > 1 ? global[1] : loss.aux_sum;
    FY_TRY(fy_engine_backward(model, batch, (float)(scale / (double)total)));
    // Micro-batches' gradients are summed apart from the backward pass (which overwrites), in
    // the same order and with the same adds on every placement.
    if (o->grad_accum > 1) {
      double tz = fy_now();
      model->kernels->grads_sum(model, n_with_grads == 0);
      *t_sum += fy_now() - tz;
    }
    n_with_grads++;
  }
  *loss_out = loss_sum / (double)total;
  r->aux_loss = aux_sum / (double)total;
  if (o->grad_accum > 1) {  // the optimizer reads m->grads: the fp32 sum
    float *t = model->grads;
    model->grads = model->grad_acc;
    model->grad_acc = t;
  }
  model->grads_f32 = o->grad_accum > 1;
  // Data parallelism: the gradients summed across ranks (in rank order, the same bits on every
  // rank), so every rank applies the same update to its replica; on GPUs by NCCL, in the dtype the
  // optimizer reads them in.
  // Expert parallelism: the dense parameters' over every data-parallel rank, each expert's over the
  // ranks holding it (runtime/ep.h).
  // (On GPUs model->dp_comm and rep_compute are nccl communicators over dp_comm's and ep_rep's ranks.)
  if (r->dp > 1)
    FY_TRY(r->ep > 1 ? fy_ep_all_reduce_grads(model, model->dp_comm, r->rep_compute ? r->rep_compute : r->ep_rep)
                     : fy_engine_all_reduce_grads(model));
  double t0 = fy_now();
  float unscale = (float)(1.0 / scale);  // exact: the scale is a power of two
  *norm_out = fy_optimizer_grad_norm(model, unscale);
  // A sum on the GPUs' stream that failed (a lost peer: NCCL's error is asynchronous, and aborting
  // the communicator lets the stream go on) is on the communicator once the norm has waited for
  // the stream: no update from gradients that were never summed.
  if (r->dp > 1) {
    fy_status st = fy_comm_status(model->dp_comm);
    if (st != FY_OK) return fy_error_wrap(st, "summing the replicas' gradients");
  }
  *overflow = !isfinite(*norm_out);
  fy_status st = FY_OK;
  if (r->lag_own) {  // the step before's update now, this one's after the next step's passes
    st = defer_update(o, r, step, unscale, *norm_out, *overflow);
  } else if (!*overflow &&
             (st = fy_optimizer_step(model, &o->adamw, fy_lr_at(o, step), r->updates + 1, unscale, *norm_out)) == FY_OK) {
    r->updates++;
  }
  *t_opt += fy_now() - t0;
  return st;
}

// The same step with the model state offloaded: enqueue, then wait for the norm only.
fy_status step_offload(const struct fy_train_opts *o, struct run *r, int64_t step, double scale,
                       double *loss_out, double *norm_out, bool *overflow) {
  double sums[o->grad_accum];
  int64_t counts[o->grad_accum], total = 0;
  int n = 0;
  FY_TRY(step_targets(o, r, counts, &total));
  if (total == 0) return skip_step(o, r);
  for (int64_t micro = 0; micro < o->grad_accum; micro++) {
    struct fy_batch *batch;
    FY_TRY(fy_data_next(r->data, &batch));
    if (counts[micro] == 0) continue;  // every target of this micro-batch ignored: no gradient from it
    FY_TRY(fy_offload_micro(r->x, batch, n, (float)(scale / (double)total)));
    n++;
  }
  FY_TRY(fy_offload_update(r->x, &o->adamw, fy_lr_at(o, step), r->updates + 1, (float)(1.0 / scale), norm_out, sums,
                           overflow));
  if (!*overflow) r->updates++;
  double aux[n > 0 ? n : 1];  // a mixture of experts' load-balancing terms, as step_resident sums them
  for (int i = 0; i < n; i++) aux[i] = fy_offload_aux_sum(r->x, i);
  if (r->dp > 1) {
    float tally[2 * o->grad_accum];
    for (int i = 0; i < n; i++) tally[i] = (float)sums[i], tally[n + i] = (float)aux[i];
    FY_TRY(fy_comm_all_reduce(r->dp_comm, tally, (size_t)(2 * n), FY_COMM_F32, NULL));
    for (int i = 0; i < n; i++) sums[i] = tally[i], aux[i] = tally[n + i];
  }
  double loss_sum = 0, aux_sum = 0;
  for (int i = 0; i < n; i++) loss_sum += sums[i], aux_sum += aux[i];
  *loss_out = loss_sum / (double)total;
  r->aux_loss = aux_sum / (double)total;
  if (!isfinite(*loss_out)) return fy_error_set(FY_ERR_NUMERIC, "the loss is %f", *loss_out);
  return FY_OK;
}

// The mean token loss over the first n batches of `data` (from its start: each evaluation reads
// the same ones), forward passes alone and without dropout, over every data-parallel rank's rows:
// their sums added in rank order (doubles travel as pairs of words). `first`, when not NULL, is
// called with the first batch after its forward (ferry eval --dump).
fy_status mean_loss(struct run *r, fy_data *data, int64_t n, double *mean,
                    fy_status (*first)(struct run *r, const struct fy_batch *b, void *ctx), void *ctx) {
  double sum = 0;
  int64_t count = 0;
  FY_TRY(fy_data_seek(data, 0));
  for (int64_t i = 0; i < n; i++) {
    struct fy_batch *batch;
    struct fy_loss loss = {0};
    FY_TRY(fy_data_next(data, &batch));
    if (r->pipe) {  // through the stages in turn: the loss on the last
      FY_TRY(fy_pipeline_forward_eval(r->pipe, batch, &loss.sum));
      loss.count = fy_engine_count_targets(batch);
    } else if (r->x) {
      FY_TRY(fy_offload_forward(r->x, batch, &loss.sum));
      loss.count = fy_engine_count_targets(batch);
    } else {
      FY_TRY(fy_engine_forward_eval(r->model, batch, &loss));
    }
    sum += loss.sum;
    count += loss.count;
    if (i == 0 && first) FY_TRY(first(r, batch, ctx));
  }
  if (r->pipe) FY_TRY(fy_pipeline_share_from_last(r->pipe, &sum));  // (the same sum of the same adds)
  if (r->dp > 1) {
    double mine[2] = {sum, (double)count}, all[2 * r->dp];
    FY_TRY(fy_comm_all_gather(r->dp_comm, mine, all, 4, FY_COMM_F32, NULL));
    sum = count = 0;
    for (int k = 0; k < r->dp; k++) sum += all[2 * k], count += (int64_t)all[2 * k + 1];
  }
  *mean = count ? sum / (double)count : NAN;
  return FY_OK;
}

// After a non-finite loss: runs the batch's forward again op by op and names the first op whose
// output is not finite (resident parameters only).
void name_nonfinite(struct run *r) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", fy_error_msg());
  fy_data_seek(r->data, fy_data_position(r->data) - 1);
  struct fy_batch *batch;
  struct fy_loss loss;
  if (fy_data_next(r->data, &batch) != FY_OK) return;
  int op = -1;
  if (fy_engine_find_nonfinite(r->model, batch, &op) == FY_OK && op >= 0) {
    const struct fy_op *p = &r->model->graph->ops[op];
    fy_error_set(FY_ERR_NUMERIC, "%s; the first non-finite value is in the output of %s (%s)", msg, p->name,
                 fy_op_kind_name(p->kind));
  } else {
    fy_error_set(FY_ERR_NUMERIC, "%s", msg);
  }
  (void)loss;
}
