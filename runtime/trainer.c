// The training loop (fy_train) and its reporting: the progress bar, the JSON log line, the
// profile and the summary.
#include "runtime/trainer.h"
#include "runtime/sample.h"

#include <limits.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <dirent.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <json-c/json.h>

#include "core/clock.h"
#include "core/fileio.h"
#include "core/log.h"
#include "core/parse.h"
#include "core/rand.h"
#include "ops/ops.h"
#include "core/safetensors.h"
#include "fy_config.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "runtime/tp.h"
#include "ops/cuda/parts.h"
#include "runtime/engine_cuda.h"
#include "planner/plan.h"
#include "planner/probe.h"
#include "memory/tier.h"
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

fy_status fy_train(const struct fy_train_opts *given, struct fy_train_result *res) {
  memset(res, 0, sizeof *res);
  struct fy_train_opts eff = *given;
  const struct fy_train_opts *o = &eff;
  char init_dir[4096];
  FY_TRY(resolve_init(&eff.init, init_dir, sizeof init_dir));
  FY_TRY(resolve_seq(&eff));
  // The communicator first: a plan's machine is rank 0's (apply_plan). The run owns it from setup
  // on; until then every return frees it.
  struct fy_comm *comm = NULL;
  FY_TRY(make_comm(o, &comm));
  fy_status st = given->plan ? apply_plan(&eff, comm, given->seq != 0) : FY_OK;
  if (st == FY_OK) st = check_train_opts(&eff);
  if (st != FY_OK) {
    fy_comm_free(comm);
    return st;
  }
  struct run r;
  FILE *log = NULL;
  double *step_times = NULL;
  struct fy_ckpt_writer *ckpt = NULL;
  bool *ckpt_busy = NULL;
  int64_t first_step = 0, scale_good = 0;
  double scale = 1.0;
  st = setup(o, &r, o->shuffle, false, comm);
  const struct fy_opt_config *cfg = &r.cfg;  // (said once, by the rank that speaks)
  if (st == FY_OK && r.rank == 0) {
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
  if (st == FY_OK && o->resume) st = resume(o, &r, &first_step, &scale, &scale_good);
  if (st == FY_OK && o->save && o->save_every > 0 && r.rank == 0)
    st = fy_ckpt_writer_create(o->save, o->keep, r.tp > 1 ? &r.whole : r.model, &ckpt);
  if (st == FY_OK && o->save && r.rank == 0) check_save_space(o, fy_opt_num_params(&r.cfg), o->steps - first_step);
  // A snapshot is the whole state again (weights, m and v: 12 bytes a parameter). When the host
  // tier cannot hold one beside the state (a model that fills the host memory, or chunks sharded
  // across ranks, of which the writing rank holds its share), an offloaded run writes its
  // checkpoints chunk by chunk from where the state lives, and training waits for each write.
  if (st == FY_OK && ckpt && r.x && r.tp == 1 &&
      (double)fy_host_in_use(r.host) + 12.0 * (double)r.model->graph->n_param_elems > (double)fy_host_cap(r.host)) {
    r.ckpt_by_chunk = res->ckpt_by_chunk = true;
    if (!o->quiet)
      printf("ferry: checkpoints are written chunk by chunk (a %.3g GiB snapshot does not fit beside the state in the "
             "host memory): training waits for each write\n", 12.0 * r.model->graph->n_param_elems / 1073741824.0);
  }
  bool lead = r.rank == 0;  // one rank speaks, logs and writes for all (replicas are identical)
  // Every rank knows when checkpoints are written: with sharded chunks all of them gather.
  const int64_t save_every = given->save && given->save_every > 0 ? given->save_every : 0;
  const bool sharded = (r.x && r.world > 1) || r.tp > 1;
  if (!lead) {
    eff.quiet = true;
    eff.log_path = NULL;
    eff.save = NULL;
    eff.save_every = 0;
  }
  res->rank = r.rank;
  res->world = r.world;
  if (st == FY_OK && o->log_path && !(log = fopen(o->log_path, "w")))
    st = fy_error_set(FY_ERR_IO, "cannot open the log %s for writing", o->log_path);
  if (st == FY_OK && (!(step_times = calloc((size_t)o->steps + 1, sizeof *step_times)) ||
                      !(ckpt_busy = calloc((size_t)o->steps + 1, sizeof *ckpt_busy))))
    st = fy_error_set(FY_ERR_NOMEM, "cannot allocate the step timings");
  if (st != FY_OK) goto done;

  struct fy_model *model = r.model;
  const int64_t tokens_per_step = o->batch * o->seq * o->grad_accum * r.dp;
  // Model FLOPs as PaLM and Megatron count them, and llm.c's count beside them (core/opt.c).
  const double flops_per_step = fy_opt_step_flops(&r.cfg, o->batch, o->seq, FY_FLOPS_PALM) * (double)o->grad_accum * r.dp;
  const double llmc_over = fy_opt_step_flops(&r.cfg, o->batch, o->seq, FY_FLOPS_LLMC) * (double)o->grad_accum * r.dp /
                           flops_per_step;
  res->model_state_bytes = (double)model->state_bytes;
  res->activation_bytes = (double)model->act_bytes;
  if (r.x) {
    struct fy_offload_stats xs;
    fy_offload_stats(r.x, &xs);
    res->n_blocks = xs.n_blocks;
    res->n_chunks = xs.n_chunks;
    res->n_disk_chunks = xs.n_disk_chunks;
    res->n_device_chunks = xs.n_device_chunks;
    res->chunk_bytes = xs.chunk_bytes;
    res->disk_tier_bytes = r.disk ? (double)fy_disk_in_use(r.disk) : 0;
  }
  bool tty = isatty(STDOUT_FILENO), out_gone = false;
  if (!o->quiet) {
    printf("ferry: %s, %.2fM parameters, %s, %d threads x %d ranks | batch %lld x %lld x %lld accum = %lld tokens/step | "
           "%lld tokens in %s\n",
           r.cfg.name, fy_opt_num_params(&r.cfg) / 1e6, o->precision, omp_get_max_threads(), r.world, (long long)o->batch,
           (long long)o->seq, (long long)o->grad_accum, (long long)tokens_per_step,
           (long long)fy_data_num_tokens(r.data), o->data);
    printf("ferry: %.4g GFLOP a step, model FLOPs as PaLM and Megatron count them (llm.c's count: %.4g)\n",
           flops_per_step / 1e9, flops_per_step * llmc_over / 1e9);
    char disk_b[32];
    if (r.x)
      printf("ferry: %s device %.0f MiB: %d cache blocks of %.1f MiB for %d chunks, activations %.1f MiB; "
             "host tier %.1f of %.0f MiB; gradients and AdamW state of %d chunks on disk%s%s%s, %d on the device\n",
             r.dev->name, r.dev->cap / 1048576.0, res->n_blocks, res->chunk_bytes / 1048576.0, res->n_chunks,
             model->act_bytes / 1048576.0, fy_host_in_use(r.host) / 1048576.0, fy_host_cap(r.host) / 1048576.0,
             res->n_disk_chunks, r.disk ? " (" : "",
             r.disk ? fy_format_bytes(res->disk_tier_bytes, disk_b, sizeof disk_b) : "", r.disk ? ")" : "",
             res->n_device_chunks);
    else
      printf("ferry: model state %.1f MiB (params, grads, AdamW m and v), activations %.1f MiB\n",
             model->state_bytes / 1048576.0, model->act_bytes / 1048576.0);
    fflush(stdout);
  }
  model->profile = o->profile;
  if (r.x && o->profile && !fy_offload_profile(r.x, true) && lead)
    fy_log_info("--profile: the %s device cannot time its streams; the compute stream's waits are not measured",
                r.dev->name);
  res->first_step = first_step;
  if (o->loss_scale > 0 && (o->loss_scale != exp2(round(log2(o->loss_scale))) || o->loss_scale < 1)) {
    st = fy_error_set(FY_ERR_INVALID, "--loss-scale %g must be a power of two >= 1", o->loss_scale);
    goto done;
  }
  if (o->loss_scale > 0 && !o->resume) scale = o->loss_scale;
  if (first_step > 0 && !o->quiet) printf("ferry: resuming from %s at step %lld\n", o->resume, (long long)first_step);
  if (first_step > 0 && first_step >= o->steps && o->steps > 0 && r.rank == 0)
    fy_log_info("the checkpoint is at step %lld and --steps %lld counts from the start of training: nothing to "
                "train (--steps above %lld goes on)", (long long)first_step, (long long)o->steps,
                (long long)first_step);
  double t_start = fy_now(), t_sum = 0, t_opt = 0, val_s = 0;
  const int64_t val_every = o->val_every > 0 ? o->val_every : o->steps / 10 > 0 ? o->steps / 10 : 1;
  res->val_loss = res->first_loss = res->last_loss = NAN;  // (steps whose every target is ignored have none)
  for (int64_t step = first_step; step < o->steps; step++) {
    double t0 = fy_now(), loss = 0, norm = 0;
    bool overflow = false;
    if (ckpt) ckpt_busy[step] = fy_ckpt_busy(ckpt);
    if (r.x) fy_offload_set_step(r.x, step + 1);
    struct fy_comm *named[] = {r.comm, r.tp_compute, r.dp_compute};  // (a failed collective names its step)
    for (int i = 0; i < 3 && r.world > 1; i++)
      if (named[i]) fy_comm_set_step(named[i], step + 1);
    st = r.x ? step_offload(o, &r, step, scale, &loss, &norm, &overflow)
             : step_resident(o, &r, step, scale, &loss, &norm, &overflow, &t_sum, &t_opt);
    if (st == FY_OK && overflow && o->loss_scale <= 0)
      st = fy_error_set(FY_ERR_NUMERIC, "the gradient norm is %f; no parameter was updated", norm);
    if (st == FY_OK && o->loss_scale > 0) {
      struct fy_loss_scaler sc = {.scale = scale, .good = scale_good, .growth_interval = 2000};
      if ((st = fy_loss_scaler_update(&sc, overflow)) == FY_OK && overflow) {
        fy_log_info("step %lld: gradients overflow at loss scale %g; step skipped, scale now %g", (long long)step + 1,
                    scale, sc.scale);
        res->skipped_steps++;
      }
      scale = sc.scale;
      scale_good = sc.good;
    }
    // A step whose every target is ignored (loss masks) updates nothing, and is still a step:
    // logged, validated, checkpointed and counted like the others.
    const bool ignored = st == FY_ERR_NOT_FOUND;
    if (ignored) {
      fy_log_warn("step %lld: every target of the batch is ignored; no update", (long long)step + 1);
      st = FY_OK;
      loss = NAN;
      res->ignored_steps++;
    }
    if (st == FY_ERR_NUMERIC && !r.x) name_nonfinite(&r);
    if (st != FY_OK) {
      fy_error_wrap(st, "step %lld", (long long)step + 1);
      goto done;
    }
    // --optimizer-lag: the last step, and those that write a checkpoint, end with every update
    // applied (before their validation, so that the last one is the saved model's)
    const bool ckpt_step = save_every > 0 && (step + 1) % save_every == 0;
    if (o->optimizer_lag > 0 && (step + 1 == o->steps || ckpt_step) && (st = drain_updates(o, &r)) != FY_OK) {
      fy_error_wrap(st, "step %lld", (long long)step + 1);
      goto done;
    }
    float lr = fy_lr_at(o, step);
    double dt = fy_now() - t0;
    step_times[step] = dt;
    double tok_s = tokens_per_step / dt, gflops = flops_per_step / dt / 1e9, rss = peak_rss_bytes();
    if (!ignored) {
      if (isnan(res->first_loss)) res->first_loss = (float)loss;
      res->last_loss = (float)loss;
    }
    res->steps = step + 1;
    // Validation (every rank takes part: its rows, and the collectives of its forward passes).
    bool validated = false;
    if (r.val && ((step + 1) % val_every == 0 || step + 1 == o->steps)) {
      double tv = fy_now();
      if ((st = mean_loss(&r, r.val, o->val_batches, &res->val_loss, NULL, NULL)) != FY_OK) {
        fy_error_wrap(st, "validation after step %lld", (long long)step + 1);
        goto done;
      }
      validated = true;
      res->validations++;
      val_s = fy_now() - tv;
    }
    if (log) {
      // (null: the loss of a step without a target, the norm of an fp16 overflow, a validation loss
      // without a target; JSON has no NaN or infinity)
      char loss_json[32], norm_json[32], val_json[32];
      json_number(loss_json, loss, "%.6f");
      json_number(norm_json, norm, "%.6g");
      json_number(val_json, res->val_loss, "%.6f");
      fprintf(log, "{\"step\":%lld,\"loss\":%s,\"lr\":%.6g,\"grad_norm\":%s,\"step_s\":%.6f,"
              "\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"gflops_llmc\":%.2f,\"peak_rss_mib\":%.1f,\"device_peak_mib\":%.4f,"
              "\"host_tier_mib\":%.4f,\"host_peak_mib\":%.4f,\"device_state_mib\":%.4f,\"chunk_mib\":%.4f,"
              "\"optimizer_state\":\"%s\"",
              (long long)step + 1, loss_json, lr, norm_json, dt, tok_s, gflops, gflops * llmc_over, rss / 1048576.0,
              r.dev->bytes_peak / 1048576.0, r.host ? fy_host_in_use(r.host) / 1048576.0 : 0.0,
              r.host ? fy_host_peak(r.host) / 1048576.0 : 0.0,
              r.x ? fy_offload_device_state_bytes(r.x) / 1048576.0 : 0.0, res->chunk_bytes / 1048576.0,
              fy_state_format_name(r.model->state_format));
      if (ignored || (overflow && o->loss_scale > 0))
        fprintf(log, ",\"skipped\":\"%s\"", ignored ? "every target ignored" : "gradient overflow");
      if (validated) fprintf(log, ",\"val_loss\":%s,\"val_s\":%.4f", val_json, val_s);
      if (r.gpu >= 0) fprintf(log, ",\"device_other_mib\":%.1f", gpu_other_bytes(&r) / 1048576.0);
      if (r.disk) fprintf(log, ",\"disk_tier_mib\":%.4f", res->disk_tier_bytes / 1048576.0);
      fprintf(log, "}\n");
    }
    if (!o->quiet) {
      if (tty) printf("\r\033[K");
      // Offloaded or on a GPU, the peak that matters is the device's (under --device-mem); on the
      // cpu the process's.
      const bool dev_peak = r.x || r.gpu >= 0;
      char peak[32];
      fy_format_bytes(dev_peak ? (double)r.dev->bytes_peak : rss, peak, sizeof peak);
      char loss_txt[32] = "     -";  // every target ignored (loss NaN)
      if (isfinite(loss)) snprintf(loss_txt, sizeof loss_txt, "%.4f", loss);
      printf("step %5lld/%lld | loss %s | lr %.2e | norm %6.3f | %8.0f tok/s | %6.1f GFLOP/s | "
             "%s peak %9s | %.0f ms\n",
             (long long)step + 1, (long long)o->steps, loss_txt, lr, norm, tok_s, gflops, dev_peak ? "device" : "RSS",
             peak, dt * 1e3);
      if (validated)
        printf("validation after step %lld | loss %.4f | perplexity %.4g | %lld batches of %lld x %lld | %.0f ms\n",
               (long long)step + 1, res->val_loss, exp(res->val_loss), (long long)o->val_batches,
               (long long)(o->batch * r.dp), (long long)o->seq, val_s * 1e3);
      if (tty)
        progress_bar(step + 1, o->steps, (fy_now() - t_start) / (step + 1 - first_step) * (o->steps - step - 1));
      // Where these lines go is gone (the reader of a pipe ended, as `| tee` does when its terminal
      // closes; the terminal itself; a full disk): stop as a signal would, with a checkpoint, rather
      // than train on unseen (ferry train ignores SIGPIPE, so the write fails instead of killing it).
      if ((fflush(stdout) != 0 || ferror(stdout)) && !out_gone) {
        out_gone = true;
        fprintf(stderr, "ferry: cannot write to standard output (%s): stopping after this step\n", strerror(errno));
      }
    }
    bool stop = (o->stop && *o->stop) || out_gone || (o->stop_after > 0 && step + 1 - first_step >= o->stop_after);
    if (r.world > 1) {  // a signal may reach the ranks in different steps: they stop together
      float any = stop ? 1.0f : 0.0f;
      if ((st = fy_comm_all_reduce(r.comm, &any, 1, FY_COMM_F32, NULL)) != FY_OK) goto done;
      stop = any > 0;
    }
    if (save_every > 0 && (ckpt || sharded) && (stop || (step + 1) % save_every == 0 || step + 1 == o->steps)) {
      if ((st = checkpoint(o, &r, ckpt, step + 1, scale, scale_good)) != FY_OK) goto done;
      if (ckpt) res->checkpoints++;
    }
    if (stop) {
      res->interrupted = true;
      if (!o->quiet) printf("ferry: stopped after step %lld%s\n", (long long)step + 1, ckpt ? ", checkpoint written" : "");
      break;
    }
  }
  if (ckpt) {
    if ((st = fy_ckpt_wait(ckpt)) != FY_OK) goto done;
    res->checkpoint_s = fy_ckpt_last_seconds(ckpt);
    res->checkpoint_bytes = dir_bytes(o->save);
  }
  if ((st = drain_updates(o, &r)) != FY_OK) goto done;  // (offloaded: synced)
  if (r.x) {
    res->host_tier_bytes = (double)fy_host_in_use(r.host);
    res->device_state_bytes = (double)fy_offload_device_state_bytes(r.x);
    res->model_state_bytes = (double)fy_offload_state_bytes(r.x);
  }
  // Sharded weights come together chunk by chunk for the hash and the final save, on the rank that
  // saves (with neither, not at all); tensor-parallel ranks' slices come together below.
  // The final save (a run without checkpoints), as every rank knows it: the gathers are
  // collectives, and only rank 0 keeps --save (and writes).
  const bool final_save = given->save && save_every == 0, saving = lead && final_save;
  uint64_t *hash = o->hash_params ? &res->params_hash : NULL;
  const bool gather = final_save || hash;
  if (sharded && r.tp == 1 && gather && (st = finish_sharded(&r, saving ? o->save : NULL, lead, hash)) != FY_OK)
    goto done;
  if (!o->quiet && tty) printf("\r\033[K");
  if (r.x && o->profile && res->steps > first_step && fy_offload_profile(r.x, true)) {
    if ((st = fy_offload_stalls(r.x, res->stall_s)) != FY_OK) goto done;
    for (int i = 0; i < FY_STALL_COUNT; i++) res->stall_s[i] /= (double)(res->steps - first_step);
    res->stalls_timed = true;
  }
  for (int k = 0; o->profile && res->steps > first_step && k < FY_OP_KIND_COUNT; k++)
    for (int ph = 0; ph < 2; ph++) res->op_seconds[k][ph] = model->op_seconds[k][ph] / (double)(res->steps - first_step);
  if (o->profile && res->steps && !o->quiet) {
    double total = 0;
    for (int i = 0; i < res->steps; i++) total += step_times[i];
    printf("profile over %lld steps (%.3f s/step):\n", (long long)res->steps, total / res->steps);
    for (int k = 0; k < FY_OP_KIND_COUNT; k++)
      for (int ph = 0; ph < 2; ph++)
        if (model->op_seconds[k][ph] > 0)
          printf("  %-14s %-8s %8.1f ms/step %5.1f%%\n", fy_op_kind_name(k), ph ? "backward" : "forward",
                 1e3 * model->op_seconds[k][ph] / res->steps, 100 * model->op_seconds[k][ph] / total);
    if (res->stalls_timed) {  // (as ferry plan predicts them)
      printf("  compute waited per step:");
      for (int i = 0; i < FY_STALL_COUNT; i++)
        printf("%s %s %.3f s", i ? "," : "", fy_stall_name((enum fy_stall)i), res->stall_s[i]);
      printf("\n");
    }
    if (!r.x) {
      printf("  %-23s %8.1f ms/step %5.1f%%\n", "sum micro-batches", 1e3 * t_sum / res->steps, 100 * t_sum / total);
      printf("  %-23s %8.1f ms/step %5.1f%%\n", "clip + AdamW", 1e3 * t_opt / res->steps, 100 * t_opt / total);
    }
  }
  // Medians skip the first step (it creates the GEMM primitives and touches fresh pages).
  int64_t ran = res->steps - first_step;
  if (ckpt && ran > 1) {  // steps that overlapped a checkpoint write
    double *busy = calloc((size_t)ran, sizeof *busy);
    int64_t nb = 0;
    for (int64_t i = first_step + 1; busy && i < res->steps; i++)
      if (ckpt_busy[i]) busy[nb++] = step_times[i];
    res->step_s_ckpt = median(busy, nb);
    free(busy);
  }
  if (ran > 1) {
    double med = median(step_times + first_step + 1, ran - 1);
    res->tokens_per_s = tokens_per_step / med;
    res->gflops = flops_per_step / med / 1e9;
    res->step_s = med;
  } else if (ran == 1) {
    res->tokens_per_s = tokens_per_step / step_times[first_step];
    res->gflops = flops_per_step / step_times[first_step] / 1e9;
    res->step_s = step_times[first_step];
  }
  res->gflops_llmc = res->gflops * llmc_over;
  res->final_loss_scale = scale;
  res->peak_rss_bytes = peak_rss_bytes();
  res->device_peak_bytes = (double)r.dev->bytes_peak;
  if (r.x) {
    struct fy_offload_stats xs;
    fy_offload_stats(r.x, &xs);
    res->cache_loads = xs.cache.loads;
    res->cache_prefetches = xs.cache.prefetches;
    res->cache_evictions = xs.cache.evictions;
    res->cache_spills = xs.cache.spills;
  }
  struct fy_copy_stats cs;
  fy_device_copy_stats(r.dev, &cs);
  for (int d = 0; d < 2; d++) {
    res->copy_bytes[d] = cs.bytes[d];
    res->copy_busy_s[d] = cs.busy_s[d];
  }
  // Tensor-parallel slices come together parameter by parameter for the hash and the final save.
  if (r.tp > 1) {
    if (gather && (st = finish_tp(&r, saving ? o->save : NULL, lead, hash)) != FY_OK) goto done;
  } else if (!sharded) {
    if (hash && model->params) *hash = hash_params(model);  // (0 on the ranks that only took part)
    if (saving) st = fy_model_save(model, o->save, FY_F32, (size_t)5 << 30);
  }
  if (saving && st == FY_OK && !o->quiet) printf("ferry: saved a Hugging Face checkpoint to %s\n", o->save);
  if (!o->quiet && st == FY_OK && res->steps) {
    char other[96] = "";
    if (r.gpu >= 0)  // (the CUDA context, cuBLASLt, NCCL's buffers: outside --device-mem)
      snprintf(other, sizeof other, "; GPU %d: %.0f MiB in use besides ferry's %.0f MiB", r.gpu,
               gpu_other_bytes(&r) / 1048576.0, r.dev->bytes_in_use / 1048576.0);
    printf("ferry: %lld steps, loss %.4f -> %.4f, median %.0f tok/s, %.1f GFLOP/s (llm.c's count: %.1f), "
           "peak RSS %.2f GiB%s\n",
           (long long)res->steps, res->first_loss, res->last_loss, res->tokens_per_s, res->gflops, res->gflops_llmc,
           res->peak_rss_bytes / 1073741824.0, other);
  }
done:
  if (log) fclose(log);
  free(step_times);
  free(ckpt_busy);
  if (ckpt) {
    fy_status w = fy_ckpt_wait(ckpt);  // a write in flight finishes (or fails) before we go
    if (st == FY_OK) st = w;
    fy_ckpt_writer_free(ckpt);
  }
  teardown(&r);
  return st;
}
