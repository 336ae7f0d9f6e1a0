// The training loop (fy_train) and its reporting: the progress bar, the JSON log line, the
// profile and the summary.
#include "runtime/trainer.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <errno.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/log.h"
#include "core/parse.h"
#include "ops/ops.h"
#include "fy_config.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "memory/tier.h"
#include "runtime/pipeline.h"
#include "runtime/run.h"

static double peak_rss_bytes(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss * 1024.0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *x, int64_t n) {
  if (n <= 0) return 0;
  qsort(x, (size_t)n, sizeof *x, cmp_double);
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

static void format_duration(char *buf, size_t n, double s) {
  if (s < 60) snprintf(buf, n, "%.0fs", s);
  else if (s < 3600) snprintf(buf, n, "%dm%02ds", (int)s / 60, (int)s % 60);
  else snprintf(buf, n, "%dh%02dm", (int)s / 3600, ((int)s % 3600) / 60);
}

// v as a JSON number in fmt, or null when it is not finite.
static void json_number(char buf[32], double v, const char *fmt) {
  if (isfinite(v)) snprintf(buf, 32, fmt, v);
  else snprintf(buf, 32, "null");
}

static void progress_bar(int64_t done, int64_t total, double eta_s) {
  char eta[32];
  format_duration(eta, sizeof eta, eta_s);
  int width = 30, fill = (int)(width * done / (total ? total : 1));
  printf("[");
  for (int i = 0; i < width; i++) putchar(i < fill ? '#' : '.');
  printf("] %lld/%lld  eta %s", (long long)done, (long long)total, eta);
  fflush(stdout);
}

// What the training loop keeps from one step to the next: fy_train's state, which the functions
// its body is made of share. eff: the options the run trains with (given, with a plan's knobs and
// the device's defaults; o points at it).
struct training {
  const struct fy_train_opts *given;
  struct fy_train_opts eff;
  const struct fy_train_opts *o;
  struct fy_train_result *res;
  char init_dir[4096];  // (eff.init may point here)
  struct run r;
  FILE *log;
  double *step_times;
  struct fy_ckpt_writer *ckpt;
  bool *ckpt_busy;
  int64_t first_step, scale_good;
  double scale;
  bool lead;        // one rank speaks, logs and writes for all (replicas are identical)
  int64_t save_every;
  bool sharded;
  int64_t tokens_per_step;
  double flops_per_step, llmc_over;
  bool tty, out_gone;
  double t_start, t_sum, t_opt, val_s;
  int64_t val_every;
};

// One step's figures, as its report gives them.
struct step_report {
  double t0, loss, norm;
  bool overflow, ignored, validated;
  float lr;
  double dt, tok_s, gflops, rss;
};

// The run set up (setup, the config's dropout said, resume, the checkpoint writer, the save-space
// check), the ranks' parts in it, and the log and step timings opened.
static fy_status open_training(struct training *t, struct fy_comm *comm) {
  const struct fy_train_opts *o = t->o, *given = t->given;
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  fy_status st = setup(o, r, o->shuffle, false, comm);
  const struct fy_opt_config *cfg = &r->cfg;  // (said once, by the rank that speaks)
  if (st == FY_OK && r->rank == 0) {
    // transformers' OPT drops the residual branches with `dropout` (which --dropout applies), the
    // attention probabilities with `attention_dropout` and whole layers with `layerdrop` (which
    // ferry does not; `activation_dropout` OPT reads but never applies).
    if (cfg->dropout > 0 && o->dropout == 0)
      fy_log_info("the config asks for dropout %g on the residual branches; ferry trains without it unless asked "
                  "(--dropout config, or --dropout P)", (double)cfg->dropout);
    if (cfg->attention_dropout > 0 || cfg->layerdrop > 0)
      fy_log_info("the config asks for attention_dropout %g and layerdrop %g; ferry applies neither",
                  (double)cfg->attention_dropout, (double)cfg->layerdrop);
  }
  if (st == FY_OK && o->resume) st = resume(o, r, &t->first_step, &t->scale, &t->scale_good);
  if (st == FY_OK && o->save && o->save_every > 0 && r->rank == 0)
    st = fy_ckpt_writer_create(o->save, o->keep, run_split(r) ? &r->whole : r->model, &t->ckpt);
  if (st == FY_OK && o->save && r->rank == 0) check_save_space(o, fy_opt_num_params(&r->cfg), o->steps - t->first_step);
  // A snapshot is the whole state again (weights, m and v: 12 bytes a parameter). When the host
  // tier cannot hold one beside the state (a model that fills the host memory, or chunks sharded
  // across ranks, of which the writing rank holds its share), an offloaded run writes its
  // checkpoints chunk by chunk from where the state lives, and training waits for each write.
  if (st == FY_OK && t->ckpt && r->x && r->tp == 1 &&
      (double)fy_host_in_use(r->host) + 12.0 * (double)r->model->graph->n_param_elems > (double)fy_host_cap(r->host)) {
    r->ckpt_by_chunk = res->ckpt_by_chunk = true;
    if (!o->quiet)
      printf("ferry: checkpoints are written chunk by chunk (a %.3g GiB snapshot does not fit beside the state in the "
             "host memory): training waits for each write\n", 12.0 * r->model->graph->n_param_elems / 1073741824.0);
  }
  t->lead = r->rank == 0;
  // Every rank knows when checkpoints are written: with sharded chunks all of them gather.
  t->save_every = given->save && given->save_every > 0 ? given->save_every : 0;
  // (--disk-master: one rank's weights live with the engine as sharded ones do, some on disk)
  t->sharded = (r->x && (r->world > 1 || !r->model->params)) || r->tp > 1;
  if (!t->lead) {
    t->eff.quiet = true;
    t->eff.log_path = NULL;
    t->eff.save = NULL;
    t->eff.save_every = 0;
  }
  res->rank = r->rank;
  res->world = r->world;
  if (st == FY_OK && o->log_path && !(t->log = fopen(o->log_path, "w")))
    st = fy_error_set(FY_ERR_IO, "cannot open the log %s for writing", o->log_path);
  if (st == FY_OK && (!(t->step_times = calloc((size_t)o->steps + 1, sizeof *t->step_times)) ||
                      !(t->ckpt_busy = calloc((size_t)o->steps + 1, sizeof *t->ckpt_busy))))
    st = fy_error_set(FY_ERR_NOMEM, "cannot allocate the step timings");
  return st;
}

// A step's tokens and FLOPs, and the model's memory and chunks in the result.
static void size_run(struct training *t) {
  const struct fy_train_opts *o = t->o;
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  struct fy_model *model = r->model;
  t->tokens_per_step = o->batch * o->seq * o->grad_accum * r->dp;
  // Model FLOPs as PaLM and Megatron count them, and llm.c's count beside them (core/opt.c).
  t->flops_per_step = fy_opt_step_flops(&r->cfg, o->batch, o->seq, FY_FLOPS_PALM) * (double)o->grad_accum * r->dp;
  t->llmc_over = fy_opt_step_flops(&r->cfg, o->batch, o->seq, FY_FLOPS_LLMC) * (double)o->grad_accum * r->dp /
                 t->flops_per_step;
  res->model_state_bytes = (double)model->state_bytes;
  res->activation_bytes = (double)model->act_bytes;
  if (r->x) {
    struct fy_offload_stats xs;
    fy_offload_stats(r->x, &xs);
    res->n_blocks = xs.n_blocks;
    res->n_chunks = xs.n_chunks;
    res->n_disk_chunks = xs.n_disk_chunks;
    res->n_device_chunks = xs.n_device_chunks;
    fy_offload_spec_counts(r->x, &res->spec_chunks, &res->spec_steps, &res->spec_redone);
    res->device_updates = fy_offload_device_updates(r->x);
    res->chunk_bytes = xs.chunk_bytes;
    res->disk_tier_bytes = r->disk ? (double)fy_disk_in_use(r->disk) : 0;
  }
}

// The run's opening lines: the model, the batch, a step's FLOPs, where the state lives.
static void print_header(const struct training *t) {
  const struct fy_train_opts *o = t->o;
  const struct fy_train_result *res = t->res;
  const struct run *r = &t->r;
  const struct fy_model *model = r->model;
  if (o->quiet) return;
  printf("ferry: %s, %.2fM parameters, %s, %d threads x %d ranks | batch %lld x %lld x %lld accum = %lld tokens/step | "
         "%lld tokens in %s\n",
         r->cfg.name, fy_opt_num_params(&r->cfg) / 1e6, o->precision, omp_get_max_threads(), r->world,
         (long long)o->batch, (long long)o->seq, (long long)o->grad_accum, (long long)t->tokens_per_step,
         (long long)fy_data_num_tokens(r->data), o->data);
  printf("ferry: %.4g GFLOP a step, model FLOPs as PaLM and Megatron count them (llm.c's count: %.4g)\n",
         t->flops_per_step / 1e9, t->flops_per_step * t->llmc_over / 1e9);
  if (r->pp > 1)
    printf("ferry: a grid of dp %d x pp %d x tp %d: %d pipeline stages of %lld decoder layers, 1F1B over %lld "
           "micro-batches a step (bubble %.0f%% by (p - 1)/(m + p - 1))\n", r->dp, r->pp, r->tp, r->pp,
           (long long)(r->cfg.num_hidden_layers / r->pp), (long long)o->grad_accum,
           100.0 * (r->pp - 1) / (double)(o->grad_accum + r->pp - 1));
  char disk_b[32];
  if (r->x)
    printf("ferry: %s device %.0f MiB: %d cache blocks of %.1f MiB for %d chunks, activations %.1f MiB; "
           "host tier %.1f of %.0f MiB; gradients and AdamW state of %d chunks on disk%s%s%s%s, %d on the device\n",
           r->dev->name, r->dev->cap / 1048576.0, res->n_blocks, res->chunk_bytes / 1048576.0, res->n_chunks,
           model->act_bytes / 1048576.0, fy_host_in_use(r->host) / 1048576.0, fy_host_cap(r->host) / 1048576.0,
           res->n_disk_chunks, r->disk ? " (" : "",
           r->disk ? fy_format_bytes(res->disk_tier_bytes, disk_b, sizeof disk_b) : "", r->disk ? ")" : "",
           o->disk_master && res->n_disk_chunks > 0 ? ", their master weights there too" : "", res->n_device_chunks);
  if (res->spec_chunks > 0)
    printf("ferry: speculative updates: %d host chunk%s updated as their gradients come home, before the gradient "
           "norm (kept when it does not clip, else redone: the exact step's numbers)\n", res->spec_chunks,
           res->spec_chunks > 1 ? "s" : "");
  if (res->device_updates > 0)
    printf("ferry: device updates: %d host chunk%s updated by the %s device after the norm, their master and AdamW "
           "state over the link and back\n", res->device_updates, res->device_updates > 1 ? "s" : "", r->dev->name);
  // (a GPU offloaded with none of the host optimizer's levers, and no plan that chose so: the
  // step waits for the host's AdamW of every chunk after the norm, which in 16 bits is most of it)
  if (r->x && o->device && strcmp(o->device, "cuda") == 0 && !o->plan && !o->optimizer_lag && res->n_device_chunks == 0 &&
      res->spec_chunks == 0 && res->device_updates == 0)
    printf("ferry: the host updates every chunk after the gradient norm (no --device-chunks, --spec-chunks or "
           "--device-updates); --plan auto lets the planner choose them, and ferry plan says what they buy\n");
  if (!r->x)
    printf("ferry: model state %.1f MiB (params, grads, AdamW m and v), activations %.1f MiB\n",
           model->state_bytes / 1048576.0, model->act_bytes / 1048576.0);
  fflush(stdout);
}

// A pipeline stage's share of the model, said by every stage (each holds its own parameters
// alone, runtime/pipeline.h): its layers, its parameters and the bytes of their state.
static void print_stage(const struct training *t) {
  const struct run *r = &t->r;
  if (r->pp <= 1 || t->given->quiet) return;
  const struct fy_graph *g = r->model->graph;
  int64_t held = 0, whole = 0;
  for (int i = 0; i < g->n_params; i++) held += g->params[i].absent ? 0 : g->params[i].numel;
  for (int i = 0; i < r->whole_graph->n_params; i++) whole += r->whole_graph->params[i].numel;
  const int64_t per = r->cfg.num_hidden_layers / r->pp;
  char b[32], a[32];
  char layers[48];
  if (per == 1) snprintf(layers, sizeof layers, "decoder layer %d", r->pp_rank);
  else snprintf(layers, sizeof layers, "decoder layers %lld-%lld", (long long)(r->pp_rank * per),
                (long long)((r->pp_rank + 1) * per - 1));
  printf("ferry: pipeline stage %d of %d (rank %d, tp rank %d): %s%s%s, %lld of the model's %lld "
         "parameters (%s of weights, gradients and AdamW state), activations %s\n", r->pp_rank, r->pp, r->rank,
         r->tp_rank, layers, r->pp_rank == 0 ? ", the embeddings" : "",
         r->pp_rank == r->pp - 1 ? ", the final norm and lm_head" : "", (long long)held, (long long)whole,
         fy_format_bytes((double)r->model->state_bytes, b, sizeof b),
         fy_format_bytes((double)r->model->act_bytes, a, sizeof a));
  fflush(stdout);
}

// Before the first step: profiling, the loss scale (checked), what resuming starts from.
static fy_status prepare_steps(struct training *t) {
  const struct fy_train_opts *o = t->o;
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  r->model->profile = o->profile;
  if (r->x && (o->profile || o->profile_waits) && !fy_offload_profile(r->x, true) && t->lead)
    fy_log_info("--profile: the %s device cannot time its streams; the compute stream's waits are not measured",
                r->dev->name);
  res->first_step = t->first_step;
  if (o->loss_scale > 0 && (o->loss_scale != exp2(round(log2(o->loss_scale))) || o->loss_scale < 1))
    return fy_error_set(FY_ERR_INVALID, "--loss-scale %g must be a power of two >= 1", o->loss_scale);
  if (o->loss_scale > 0 && !o->resume) t->scale = o->loss_scale;
  if (t->first_step > 0 && !o->quiet)
    printf("ferry: resuming from %s at step %lld\n", o->resume, (long long)t->first_step);
  if (t->first_step > 0 && t->first_step >= o->steps && o->steps > 0 && r->rank == 0)
    fy_log_info("the checkpoint is at step %lld and --steps %lld counts from the start of training: nothing to "
                "train (--steps above %lld goes on)", (long long)t->first_step, (long long)o->steps,
                (long long)t->first_step);
  t->t_start = fy_now();
  t->val_every = o->val_every > 0 ? o->val_every : o->steps / 10 > 0 ? o->steps / 10 : 1;
  res->val_loss = res->first_loss = res->last_loss = NAN;  // (steps whose every target is ignored have none)
  return FY_OK;
}

// One optimizer step with its loss scaling (an fp16 overflow skips it), a step whose every target
// is ignored, the lagged update drained where it must be, and the step's timing.
static fy_status run_step(struct training *t, int64_t step, struct step_report *s) {
  const struct fy_train_opts *o = t->o;
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  *s = (struct step_report){.t0 = fy_now()};
  if (t->ckpt) t->ckpt_busy[step] = fy_ckpt_busy(t->ckpt);
  if (r->x) fy_offload_set_step(r->x, step + 1);
  // (a failed collective names its step)
  struct fy_comm *named[] = {r->comm,    r->tp_compute, r->dp_compute, r->pp_comm,    r->pp_compute,
                             r->ep_comm, r->ep_rep,     r->ep_compute, r->rep_compute};
  for (int i = 0; i < (int)(sizeof named / sizeof *named) && r->world > 1; i++)
    if (named[i]) fy_comm_set_step(named[i], step + 1);
  fy_status st = r->x && !r->pipe ? step_offload(o, r, step, t->scale, &s->loss, &s->norm, &s->overflow)
                      : step_resident(o, r, step, t->scale, &s->loss, &s->norm, &s->overflow, &t->t_sum, &t->t_opt);
  if (st == FY_OK && s->overflow && o->loss_scale <= 0)
    st = fy_error_set(FY_ERR_NUMERIC, "the gradient norm is %f; no parameter was updated", s->norm);
  if (st == FY_OK && o->loss_scale > 0) {
    struct fy_loss_scaler sc = {.scale = t->scale, .good = t->scale_good, .growth_interval = 2000};
    if ((st = fy_loss_scaler_update(&sc, s->overflow)) == FY_OK && s->overflow) {
      fy_log_info("step %lld: gradients overflow at loss scale %g; step skipped, scale now %g", (long long)step + 1,
                  t->scale, sc.scale);
      res->skipped_steps++;
    }
    t->scale = sc.scale;
    t->scale_good = sc.good;
  }
  // A step whose every target is ignored (loss masks) updates nothing, and is still a step:
  // logged, validated, checkpointed and counted like the others.
  s->ignored = st == FY_ERR_NOT_FOUND;
  if (s->ignored) {
    fy_log_warn("step %lld: every target of the batch is ignored; no update", (long long)step + 1);
    st = FY_OK;
    s->loss = NAN;
    res->ignored_steps++;
  }
  // (a stage holds part of the model; expert-parallel ranks would stop at different ops, each
  // waiting in another all-to-all)
  if (st == FY_ERR_NUMERIC && !r->x && !r->pipe && r->ep == 1) name_nonfinite(r);
  if (st != FY_OK) return fy_error_wrap(st, "step %lld", (long long)step + 1);
  // --optimizer-lag: the last step, and those that write a checkpoint, end with every update
  // applied (before their validation, so that the last one is the saved model's)
  const bool ckpt_step = t->save_every > 0 && (step + 1) % t->save_every == 0;
  if (o->optimizer_lag > 0 && (step + 1 == o->steps || ckpt_step) && (st = drain_updates(o, r)) != FY_OK)
    return fy_error_wrap(st, "step %lld", (long long)step + 1);
  s->lr = fy_lr_at(o, step);
  s->dt = fy_now() - s->t0;
  t->step_times[step] = s->dt;
  s->tok_s = t->tokens_per_step / s->dt;
  s->gflops = t->flops_per_step / s->dt / 1e9;
  s->rss = peak_rss_bytes();
  if (!s->ignored) {
    if (isnan(res->first_loss)) res->first_loss = (float)s->loss;
    res->last_loss = (float)s->loss;
  }
  res->steps = step + 1;
  return FY_OK;
}

// Validation (every rank takes part: its rows, and the collectives of its forward passes), every
// val_every steps and after the last.
static fy_status maybe_validate(struct training *t, int64_t step, struct step_report *s) {
  const struct fy_train_opts *o = t->o;
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  if (!r->val || !((step + 1) % t->val_every == 0 || step + 1 == o->steps)) return FY_OK;
  double tv = fy_now();
  fy_status st = mean_loss(r, r->val, o->val_batches, &res->val_loss, NULL, NULL);
  if (st != FY_OK) return fy_error_wrap(st, "validation after step %lld", (long long)step + 1);
  s->validated = true;
  res->validations++;
  t->val_s = fy_now() - tv;
  return FY_OK;
}

// The step's line in the JSON log (--log).
static void log_step(const struct training *t, int64_t step, const struct step_report *s) {
  const struct fy_train_opts *o = t->o;
  const struct fy_train_result *res = t->res;
  const struct run *r = &t->r;
  FILE *log = t->log;
  // (null: the loss of a step without a target, the norm of an fp16 overflow, a validation loss
  // without a target; JSON has no NaN or infinity)
  char loss_json[32], norm_json[32], val_json[32];
  json_number(loss_json, s->loss, "%.6f");
  json_number(norm_json, s->norm, "%.6g");
  json_number(val_json, res->val_loss, "%.6f");
  fprintf(log, "{\"step\":%lld,\"loss\":%s,\"lr\":%.6g,\"grad_norm\":%s,\"step_s\":%.6f,"
          "\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"gflops_llmc\":%.2f,\"peak_rss_mib\":%.1f,\"device_peak_mib\":%.4f,"
          "\"host_tier_mib\":%.4f,\"host_peak_mib\":%.4f,\"device_state_mib\":%.4f,\"chunk_mib\":%.4f,"
          "\"optimizer_state\":\"%s\"",
          (long long)step + 1, loss_json, s->lr, norm_json, s->dt, s->tok_s, s->gflops, s->gflops * t->llmc_over,
          s->rss / 1048576.0, r->dev->bytes_peak / 1048576.0, r->host ? fy_host_in_use(r->host) / 1048576.0 : 0.0,
          r->host ? fy_host_peak(r->host) / 1048576.0 : 0.0,
          r->x ? fy_offload_device_state_bytes(r->x) / 1048576.0 : 0.0, res->chunk_bytes / 1048576.0,
          fy_state_format_name(r->model->state_format));
  if (s->ignored || (s->overflow && o->loss_scale > 0))
    fprintf(log, ",\"skipped\":\"%s\"", s->ignored ? "every target ignored" : "gradient overflow");
  if (r->model->cfg.num_local_experts > 0 && !s->ignored) {  // (the objective is loss + aux_loss)
    char aux_json[32];
    json_number(aux_json, r->aux_loss, "%.6f");
    fprintf(log, ",\"aux_loss\":%s", aux_json);
  }
  int64_t experts_loaded = 0, experts = 0;  // (offloaded mixtures: so far, fy_offload_experts)
  if (r->x) fy_offload_experts(r->x, &experts_loaded, &experts);
  if (experts > 0)
    fprintf(log, ",\"expert_chunks_loaded\":%lld,\"expert_chunks\":%lld", (long long)experts_loaded, (long long)experts);
  if (s->validated) fprintf(log, ",\"val_loss\":%s,\"val_s\":%.4f", val_json, t->val_s);
  if (r->gpu >= 0) fprintf(log, ",\"device_other_mib\":%.1f", gpu_other_bytes(r) / 1048576.0);
  if (r->disk) fprintf(log, ",\"disk_tier_mib\":%.4f", res->disk_tier_bytes / 1048576.0);
  if (res->device_updates > 0) fprintf(log, ",\"device_updates\":%d", res->device_updates);
  if (res->spec_chunks > 0)  // (--spec-chunks: so far, report_step)
    fprintf(log, ",\"spec_chunks\":%d,\"spec_steps\":%lld,\"spec_redone\":%lld", res->spec_chunks,
            (long long)res->spec_steps, (long long)res->spec_redone);
  fprintf(log, "}\n");
}

// The step's report: its JSON log line, its console line (with the validation's), the progress
// bar on a terminal.
static void report_step(struct training *t, int64_t step, const struct step_report *s) {
  const struct fy_train_opts *o = t->o;
  const struct fy_train_result *res = t->res;
  const struct run *r = &t->r;
  if (r->x)  // (the speculative updates so far: the log line's and the result's)
    fy_offload_spec_counts(r->x, &t->res->spec_chunks, &t->res->spec_steps, &t->res->spec_redone);
  if (t->log) log_step(t, step, s);
  if (o->quiet) return;
  if (t->tty) printf("\r\033[K");
  // Offloaded or on a GPU, the peak that matters is the device's (under --device-mem); on the
  // cpu the process's.
  const bool dev_peak = r->x || r->gpu >= 0;
  char peak[32];
  fy_format_bytes(dev_peak ? (double)r->dev->bytes_peak : s->rss, peak, sizeof peak);
  char loss_txt[32] = "     -";  // every target ignored (loss NaN)
  if (isfinite(s->loss)) snprintf(loss_txt, sizeof loss_txt, "%.4f", s->loss);
  printf("step %5lld/%lld | loss %s | lr %.2e | norm %6.3f | %8.0f tok/s | %6.1f GFLOP/s | "
         "%s peak %9s | %.0f ms\n",
         (long long)step + 1, (long long)o->steps, loss_txt, s->lr, s->norm, s->tok_s, s->gflops,
         dev_peak ? "device" : "RSS", peak, s->dt * 1e3);
  if (s->validated)
    printf("validation after step %lld | loss %.4f | perplexity %.4g | %lld batches of %lld x %lld | %.0f ms\n",
           (long long)step + 1, res->val_loss, exp(res->val_loss), (long long)o->val_batches,
           (long long)(o->batch * r->dp), (long long)o->seq, t->val_s * 1e3);
  if (t->tty)
    progress_bar(step + 1, o->steps, (fy_now() - t->t_start) / (step + 1 - t->first_step) * (o->steps - step - 1));
  // Where these lines go is gone (the reader of a pipe ended, as `| tee` does when its terminal
  // closes; the terminal itself; a full disk): stop as a signal would, with a checkpoint, rather
  // than train on unseen (ferry train ignores SIGPIPE, so the write fails instead of killing it).
  if ((fflush(stdout) != 0 || ferror(stdout)) && !t->out_gone) {
    t->out_gone = true;
    fprintf(stderr, "ferry: cannot write to standard output (%s): stopping after this step\n", strerror(errno));
  }
}

// Whether the run stops after this step (a signal, standard output gone, --stop-after), agreed by
// every rank.
static fy_status should_stop(struct training *t, int64_t step, bool *stop) {
  const struct fy_train_opts *o = t->o;
  struct run *r = &t->r;
  *stop = (o->stop && *o->stop) || t->out_gone || (o->stop_after > 0 && step + 1 - t->first_step >= o->stop_after);
  if (r->world > 1) {  // a signal may reach the ranks in different steps: they stop together
    float any = *stop ? 1.0f : 0.0f;
    FY_TRY(fy_comm_all_reduce(r->comm, &any, 1, FY_COMM_F32, NULL));
    *stop = any > 0;
  }
  return FY_OK;
}

// A checkpoint every --save-every steps, after the last and when the run stops.
static fy_status maybe_checkpoint(struct training *t, int64_t step, bool stop) {
  const struct fy_train_opts *o = t->o;
  if (t->save_every > 0 && (t->ckpt || t->sharded || t->r.pipe || t->r.ep > 1) &&
      (stop || (step + 1) % t->save_every == 0 || step + 1 == o->steps)) {
    FY_TRY(checkpoint(o, &t->r, t->ckpt, step + 1, t->scale, t->scale_good));
    if (t->ckpt) t->res->checkpoints++;
  }
  return FY_OK;
}

// --profile: the ops' and the stalls' seconds a step in the result, and printed with the cpu's
// micro-batch sum and AdamW.
static fy_status profile_run(struct training *t) {
  const struct fy_train_opts *o = t->o;
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  struct fy_model *model = r->model;
  const int64_t first_step = t->first_step;
  if (r->x && (o->profile || o->profile_waits) && res->steps > first_step && fy_offload_profile(r->x, true)) {
    FY_TRY(fy_offload_stalls(r->x, res->stall_s));
    for (int i = 0; i < FY_STALL_COUNT; i++) res->stall_s[i] /= (double)(res->steps - first_step);
    res->stalls_timed = true;
  }
  if (!o->profile && res->stalls_timed && !o->quiet) {  // (--profile-waits alone)
    printf("compute waited per step over %lld steps:", (long long)(res->steps - first_step));
    fy_stall_print(stdout, res->stall_s);
  }
  for (int k = 0; o->profile && res->steps > first_step && k < FY_OP_KIND_COUNT; k++)
    for (int ph = 0; ph < 2; ph++) res->op_seconds[k][ph] = model->op_seconds[k][ph] / (double)(res->steps - first_step);
  if (o->profile && res->steps && !o->quiet) {
    double total = 0;
    for (int i = 0; i < res->steps; i++) total += t->step_times[i];
    printf("profile over %lld steps (%.3f s/step):\n", (long long)res->steps, total / res->steps);
    for (int k = 0; k < FY_OP_KIND_COUNT; k++)
      for (int ph = 0; ph < 2; ph++)
        if (model->op_seconds[k][ph] > 0)
          printf("  %-14s %-8s %8.1f ms/step %5.1f%%\n", fy_op_kind_name(k), ph ? "backward" : "forward",
                 1e3 * model->op_seconds[k][ph] / res->steps, 100 * model->op_seconds[k][ph] / total);
    if (res->stalls_timed) {  // (as ferry plan predicts them)
      printf("  compute waited per step:");
      fy_stall_print(stdout, res->stall_s);
    }
    if (!r->x) {
      printf("  %-23s %8.1f ms/step %5.1f%%\n", "sum micro-batches", 1e3 * t->t_sum / res->steps,
             100 * t->t_sum / total);
      printf("  %-23s %8.1f ms/step %5.1f%%\n", "clip + AdamW", 1e3 * t->t_opt / res->steps, 100 * t->t_opt / total);
    }
  }
  return FY_OK;
}

// The run's speed (medians of the steps), peaks, cache and copy counts in the result.
static void measure_run(struct training *t) {
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  const int64_t first_step = t->first_step;
  const double *step_times = t->step_times;
  // Medians skip the first step (it creates the GEMM primitives and touches fresh pages).
  int64_t ran = res->steps - first_step;
  if (t->ckpt && ran > 1) {  // steps that overlapped a checkpoint write
    double *busy = calloc((size_t)ran, sizeof *busy);
    int64_t nb = 0;
    for (int64_t i = first_step + 1; busy && i < res->steps; i++)
      if (t->ckpt_busy[i]) busy[nb++] = step_times[i];
    res->step_s_ckpt = median(busy, nb);
    free(busy);
  }
  if (ran > 1) {
    double med = median(t->step_times + first_step + 1, ran - 1);
    res->tokens_per_s = t->tokens_per_step / med;
    res->gflops = t->flops_per_step / med / 1e9;
    res->step_s = med;
  } else if (ran == 1) {
    res->tokens_per_s = t->tokens_per_step / step_times[first_step];
    res->gflops = t->flops_per_step / step_times[first_step] / 1e9;
    res->step_s = step_times[first_step];
  }
  res->gflops_llmc = res->gflops * t->llmc_over;
  res->final_loss_scale = t->scale;
  res->peak_rss_bytes = peak_rss_bytes();
  res->device_peak_bytes = (double)r->dev->bytes_peak;
  if (r->x) {
    struct fy_offload_stats xs;
    fy_offload_stats(r->x, &xs);
    res->cache_loads = xs.cache.loads;
    res->cache_prefetches = xs.cache.prefetches;
    res->cache_evictions = xs.cache.evictions;
    res->cache_spills = xs.cache.spills;
    fy_offload_experts(r->x, &res->expert_loads, &res->expert_parts);
  }
  struct fy_copy_stats cs;
  fy_device_copy_stats(r->dev, &cs);
  for (int d = 0; d < 2; d++) {
    res->copy_bytes[d] = cs.bytes[d];
    res->copy_busy_s[d] = cs.busy_s[d];
  }
}

// The run's last line: steps, loss, speed, peak memory.
static void print_summary(const struct training *t) {
  const struct fy_train_result *res = t->res;
  const struct run *r = &t->r;
  char other[96] = "";
  if (r->gpu >= 0)  // (the CUDA context, cuBLASLt, NCCL's buffers: outside --device-mem)
    snprintf(other, sizeof other, "; GPU %d: %.0f MiB in use besides ferry's %.0f MiB", r->gpu,
             gpu_other_bytes(r) / 1048576.0, r->dev->bytes_in_use / 1048576.0);
  printf("ferry: %lld steps, loss %.4f -> %.4f, median %.0f tok/s, %.1f GFLOP/s (llm.c's count: %.1f), "
         "peak RSS %.2f GiB%s\n",
         (long long)res->steps, res->first_loss, res->last_loss, res->tokens_per_s, res->gflops, res->gflops_llmc,
         res->peak_rss_bytes / 1073741824.0, other);
  if (res->expert_parts > 0)  // (offloaded mixtures of experts: only the experts that got tokens are loaded)
    printf("ferry: expert chunks loaded: %lld of %lld\n", (long long)res->expert_loads, (long long)res->expert_parts);
  if (res->spec_chunks > 0)  // (the next step after a redone one does not speculate)
    printf("ferry: speculative updates of %d chunks: kept in %lld of %lld steps that speculated, redone in %lld (the "
           "norm clipped or the step skipped)\n", res->spec_chunks, (long long)(res->spec_steps - res->spec_redone),
           (long long)res->spec_steps, (long long)res->spec_redone);
}

// After the last step: the checkpoints written, every update applied, the weights' hash and the
// final save (gathered from the ranks' shards or slices), the profile, the figures and summary.
static fy_status finish_run(struct training *t) {
  const struct fy_train_opts *o = t->o, *given = t->given;
  struct fy_train_result *res = t->res;
  struct run *r = &t->r;
  struct fy_model *model = r->model;
  fy_status st = FY_OK;
  if (t->ckpt) {
    FY_TRY(fy_ckpt_wait(t->ckpt));
    res->checkpoint_s = fy_ckpt_last_seconds(t->ckpt);
    res->checkpoint_bytes = dir_bytes(o->save);
  }
  FY_TRY(drain_updates(o, r));  // (offloaded: synced)
  if (r->x) {
    res->host_tier_bytes = (double)fy_host_in_use(r->host);
    res->device_state_bytes = (double)fy_offload_device_state_bytes(r->x);
    res->model_state_bytes = (double)fy_offload_state_bytes(r->x);
  }
  // Sharded weights come together chunk by chunk for the hash and the final save, on the rank that
  // saves (with neither, not at all); tensor-parallel ranks' slices come together below.
  // The final save (a run without checkpoints), as every rank knows it: the gathers are
  // collectives, and only rank 0 keeps --save (and writes).
  const bool final_save = given->save && t->save_every == 0, saving = t->lead && final_save;
  uint64_t *hash = o->hash_params ? &res->params_hash : NULL;
  const bool gather = final_save || hash;
  if (t->sharded && r->tp == 1 && r->pp == 1 && gather)  // (a pipeline's stages: below)
    FY_TRY(finish_sharded(r, saving ? o->save : NULL, t->lead, hash));
  if (!o->quiet && t->tty) printf("\r\033[K");
  FY_TRY(profile_run(t));
  measure_run(t);
  // Tensor-parallel slices and pipeline stages' parameters come together parameter by parameter
  // for the hash and the final save.
  if (run_split(r)) {
    if (gather) FY_TRY(finish_tp(r, saving ? o->save : NULL, t->lead, hash));
  } else if (!t->sharded) {
    if (hash && model->params) *hash = hash_params(model);  // (0 on the ranks that only took part)
    if (saving) st = fy_model_save(model, o->save, FY_F32, (size_t)5 << 30);
  }
  if (saving && st == FY_OK && !o->quiet) printf("ferry: saved a Hugging Face checkpoint to %s\n", o->save);
  if (!o->quiet && st == FY_OK && res->steps) print_summary(t);
  return st;
}

// What the run holds let go of, a checkpoint write in flight finished first (its failure is the
// run's when nothing failed before).
static fy_status close_training(struct training *t, fy_status st) {
  if (t->log) fclose(t->log);
  free(t->step_times);
  free(t->ckpt_busy);
  if (t->ckpt) {
    fy_status w = fy_ckpt_wait(t->ckpt);  // a write in flight finishes (or fails) before we go
    if (st == FY_OK) st = w;
    fy_ckpt_writer_free(t->ckpt);
  }
  teardown(&t->r);
  return st;
}

fy_status fy_train(const struct fy_train_opts *given, struct fy_train_result *res) {
  memset(res, 0, sizeof *res);
  struct training t = {.given = given, .eff = *given, .res = res, .scale = 1.0};
  t.o = &t.eff;
  FY_TRY(resolve_init(&t.eff.init, t.init_dir, sizeof t.init_dir));
  FY_TRY(resolve_seq(&t.eff));
  // The communicator first: a plan's machine is rank 0's (apply_plan). The run owns it from setup
  // on; until then every return frees it.
  struct fy_comm *comm = NULL;
  FY_TRY(make_comm(t.o, &comm));
  fy_status st = given->plan ? apply_plan(&t.eff, comm, given->seq != 0) : FY_OK;
  if (st == FY_OK) st = check_train_opts(&t.eff);
  if (st != FY_OK) {
    fy_comm_free(comm);
    return st;
  }
  if ((st = open_training(&t, comm)) != FY_OK) goto done;
  size_run(&t);
  t.tty = isatty(STDOUT_FILENO);
  print_header(&t);
  print_stage(&t);
  if ((st = prepare_steps(&t)) != FY_OK) goto done;
  for (int64_t step = t.first_step; step < t.o->steps; step++) {
    struct step_report s;
    bool stop;
    if ((st = run_step(&t, step, &s)) != FY_OK || (st = maybe_validate(&t, step, &s)) != FY_OK) goto done;
    report_step(&t, step, &s);
    if ((st = should_stop(&t, step, &stop)) != FY_OK || (st = maybe_checkpoint(&t, step, stop)) != FY_OK) goto done;
    if (stop) {
      res->interrupted = true;
      if (!t.o->quiet)
        printf("ferry: stopped after step %lld%s\n", (long long)step + 1, t.ckpt ? ", checkpoint written" : "");
      break;
    }
  }
  st = finish_run(&t);
done:
  return close_training(&t, st);
}
