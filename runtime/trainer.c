#include "runtime/trainer.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "ops/ops.h"
#include "core/safetensors.h"
#include "fy_config.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/model.h"

void fy_train_opts_defaults(struct fy_train_opts *o) {
  static char demo_data[4096];
  snprintf(demo_data, sizeof demo_data, "%s/data/demo", FY_SOURCE_DIR);
  *o = (struct fy_train_opts){
      .model = NULL, .init = "random", .data = demo_data, .batch = 16, .seq = 128,
      .grad_accum = 1, .steps = 600, .lr = 2e-3f, .min_lr = -1, .warmup = -1,
      .adamw = fy_adamw_defaults(), .seed = 1337, .shuffle = true, .threads = 0,
      .eval_batches = 8};
}

float fy_lr_at(const struct fy_train_opts *o, int64_t t) {
  float min_lr = o->min_lr >= 0 ? o->min_lr : o->lr * 0.1f;
  int64_t warm = o->warmup >= 0 ? o->warmup : (o->steps >= 20 ? o->steps / 20 : 0);
  if (t < warm) return o->lr * (float)(t + 1) / (float)warm;
  if (o->steps <= warm + 1) return o->lr;
  double frac = (double)(t - warm) / (double)(o->steps - warm - 1);
  return min_lr + (float)(0.5 * (1.0 + cos(M_PI * frac))) * (o->lr - min_lr);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

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

// The model's configuration: --model (preset or config), else the --init checkpoint's, else the demo.
static fy_status resolve_config(const struct fy_train_opts *o, struct fy_opt_config *cfg) {
  const char *src = o->model;
  if (!src && o->init && strcmp(o->init, "random") != 0) src = o->init;
  if (!src) src = "opt-demo";
  struct stat sb;
  if (stat(src, &sb) == 0) {
    FY_TRY(fy_opt_config_read(src, cfg));
  } else if (fy_opt_preset(src, cfg) != FY_OK) {
    return fy_error_set(FY_ERR_NOT_FOUND,
                        "--model %s is neither a preset nor a directory with config.json "
                        "(presets: opt-tiny, opt-demo, opt-125m ... opt-175b)", src);
  }
  if (cfg->dropout > 0 || cfg->attention_dropout > 0 || cfg->activation_dropout > 0 || cfg->layerdrop > 0)
    fy_log_info("the config asks for dropout/layerdrop; ferry trains without them");
  return FY_OK;
}

static fy_status setup(const struct fy_train_opts *o, struct fy_opt_config *cfg, struct fy_device **dev,
                       struct fy_model **model, fy_data **data, bool shuffle) {
  if (o->batch < 1) return fy_error_set(FY_ERR_INVALID, "--batch must be at least 1");
  if (o->seq < 1) return fy_error_set(FY_ERR_INVALID, "--seq must be at least 1");
  if (o->threads > 0) omp_set_num_threads(o->threads);
  FY_TRY(resolve_config(o, cfg));
  if (o->seq > cfg->max_position_embeddings)
    return fy_error_set(FY_ERR_INVALID, "--seq %lld is longer than the model allows (%lld positions)",
                        (long long)o->seq, (long long)cfg->max_position_embeddings);
  // The cpu device may hand out what the machine has; a model that cannot fit is refused before
  // anything is allocated, with what it would need.
  size_t ram = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
  FY_TRY(fy_device_cpu_create(ram, dev));
  struct fy_model_opts mo = {.recompute = o->recompute};
  fy_status st = fy_model_create_with(cfg, o->batch, o->seq, *dev, &mo, model);
  if (st != FY_OK) return st;
  if (o->grad_accum > 1) FY_TRY(fy_model_enable_accumulation(*model));
  if (!o->init || strcmp(o->init, "random") == 0) {
    fy_model_init_random(*model, o->seed);
  } else {
    st = fy_model_load(*model, o->init);
    if (st != FY_OK) return fy_error_wrap(st, "--init");
  }
  st = fy_data_open(o->data, cfg->vocab_size, o->batch, o->seq, shuffle, o->seed, 0, 1, data);
  if (st != FY_OK) {
    if (strstr(o->data, "/data/demo"))
      return fy_error_wrap(st, "the demo data is made by ./run.sh (python3 tools/tokenize.py "
                               "--tokenizer bytes --out data/demo/corpus data/corpus.txt); --data");
    return fy_error_wrap(st, "--data");
  }
  return FY_OK;
}

static void teardown(struct fy_device *dev, struct fy_model *model, fy_data *data) {
  fy_data_close(data);
  fy_model_free(model);
  fy_device_free(dev);
}

static void format_duration(char *buf, size_t n, double s) {
  if (s < 60) snprintf(buf, n, "%.0fs", s);
  else if (s < 3600) snprintf(buf, n, "%dm%02ds", (int)s / 60, (int)s % 60);
  else snprintf(buf, n, "%dh%02dm", (int)s / 3600, ((int)s % 3600) / 60);
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

fy_status fy_train(const struct fy_train_opts *o, struct fy_train_result *res) {
  memset(res, 0, sizeof *res);
  if (o->steps < 0) return fy_error_set(FY_ERR_INVALID, "--steps must not be negative");
  if (o->grad_accum < 1) return fy_error_set(FY_ERR_INVALID, "--grad-accum must be at least 1");
  if (!(o->lr >= 0) || !isfinite(o->lr)) return fy_error_set(FY_ERR_INVALID, "--lr must be a number >= 0");
  struct fy_opt_config cfg;
  struct fy_device *dev = NULL;
  struct fy_model *model = NULL;
  fy_data *data = NULL;
  FILE *log = NULL;
  double *step_times = NULL;
  fy_status st = setup(o, &cfg, &dev, &model, &data, o->shuffle);
  if (st == FY_OK && o->log_path && !(log = fopen(o->log_path, "w")))
    st = fy_error_set(FY_ERR_IO, "cannot open the log %s for writing", o->log_path);
  if (st == FY_OK && !(step_times = calloc((size_t)o->steps + 1, sizeof *step_times)))
    st = fy_error_set(FY_ERR_NOMEM, "cannot allocate the step timings");
  if (st != FY_OK) goto done;

  const int64_t tokens_per_step = o->batch * o->seq * o->grad_accum;
  const double flops_per_step = fy_opt_step_flops(&cfg, o->batch, o->seq) * (double)o->grad_accum;
  res->model_state_bytes = (double)model->state_bytes;
  res->activation_bytes = (double)model->act_bytes;
  bool tty = isatty(STDOUT_FILENO);
  if (!o->quiet) {
    printf("ferry: %s, %.2fM parameters, %d threads | batch %lld x %lld x %lld accum = %lld tokens/step | "
           "%lld tokens in %s\n",
           cfg.name, fy_opt_num_params(&cfg) / 1e6, omp_get_max_threads(), (long long)o->batch,
           (long long)o->seq, (long long)o->grad_accum, (long long)tokens_per_step,
           (long long)fy_data_num_tokens(data), o->data);
    printf("ferry: model state %.1f MiB (params, grads, AdamW m and v), activations %.1f MiB\n",
           model->state_bytes / 1048576.0, model->act_bytes / 1048576.0);
    fflush(stdout);
  }
  model->profile = o->profile;
  double t_start = now_s(), t_zero = 0, t_opt = 0;
  for (int64_t step = 0; step < o->steps; step++) {
    double t0 = now_s();
    double loss_acc = 0;
    int64_t n_with_grads = 0;
    for (int64_t micro = 0; micro < o->grad_accum; micro++) {
      struct fy_batch *batch;
      struct fy_loss loss;
      if ((st = fy_data_next(data, &batch)) != FY_OK) goto step_failed;
      if ((st = fy_engine_forward(model, batch, &loss)) != FY_OK) goto step_failed;
      if (loss.count == 0) continue;  // every target ignored: nothing to learn from this one
      double mean = loss.sum / (double)loss.count;
      if (!isfinite(mean)) {
        st = fy_error_set(FY_ERR_NUMERIC, "the loss is %f at step %lld", mean, (long long)step + 1);
        goto step_failed;
      }
      loss_acc += mean / (double)o->grad_accum;
      if ((st = fy_engine_backward(model, batch, (float)(1.0 / ((double)loss.count * o->grad_accum)))) != FY_OK)
        goto step_failed;
      // Micro-batches' gradients are summed apart from the backward pass (which overwrites), in
      // the same order and with the same adds on every placement.
      if (o->grad_accum > 1) {
        double tz = now_s();
        if (n_with_grads == 0)
          memcpy(model->grad_acc, model->grads, (size_t)model->graph->n_param_elems * 4);
        else
          fy_add_forward(model->grad_acc, model->grad_acc, model->grads, model->graph->n_param_elems);
        t_zero += now_s() - tz;
      }
      n_with_grads++;
    }
    if (n_with_grads == 0) {
      fy_log_warn("step %lld: every target of the batch is ignored; no update", (long long)step + 1);
      continue;
    }
    if (o->grad_accum > 1) {  // the optimizer reads m->grads
      float *t = model->grads;
      model->grads = model->grad_acc;
      model->grad_acc = t;
    }
    float lr = fy_lr_at(o, step);
    double t_opt0 = now_s();
    double norm = fy_optimizer_grad_norm(model, 1.0f);
    if ((st = fy_optimizer_step(model, &o->adamw, lr, step + 1, 1.0f, norm)) != FY_OK) {
      fy_error_wrap(st, "step %lld", (long long)step + 1);
      goto done;
    }
    t_opt += now_s() - t_opt0;
    double dt = now_s() - t0;
    step_times[step] = dt;
    double tok_s = tokens_per_step / dt, gflops = flops_per_step / dt / 1e9, rss = peak_rss_bytes();
    if (step == 0) res->first_loss = (float)loss_acc;
    res->last_loss = (float)loss_acc;
    res->steps = step + 1;
    if (log)
      fprintf(log, "{\"step\":%lld,\"loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.6g,\"step_s\":%.6f,"
              "\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"peak_rss_mib\":%.1f}\n",
              (long long)step + 1, loss_acc, lr, norm, dt, tok_s, gflops, rss / 1048576.0);
    if (!o->quiet) {
      if (tty) printf("\r\033[K");
      printf("step %5lld/%lld | loss %.4f | lr %.2e | norm %6.3f | %8.0f tok/s | %6.1f GFLOP/s | "
             "peak %.2f GiB | %.0f ms\n",
             (long long)step + 1, (long long)o->steps, loss_acc, lr, norm, tok_s, gflops,
             rss / 1073741824.0, dt * 1e3);
      if (tty) progress_bar(step + 1, o->steps, (now_s() - t_start) / (step + 1) * (o->steps - step - 1));
      fflush(stdout);
    }
    continue;
  step_failed:
    fy_error_wrap(st, "step %lld", (long long)step + 1);
    goto done;
  }
  if (!o->quiet && tty) printf("\r\033[K");
  if (o->profile && res->steps) {
    double total = 0;
    for (int i = 0; i < res->steps; i++) total += step_times[i];
    printf("profile over %lld steps (%.3f s/step):\n", (long long)res->steps, total / res->steps);
    for (int k = 0; k < FY_OP_KIND_COUNT; k++)
      for (int ph = 0; ph < 2; ph++)
        if (model->op_seconds[k][ph] > 0)
          printf("  %-14s %-8s %8.1f ms/step %5.1f%%\n", fy_op_kind_name(k), ph ? "backward" : "forward",
                 1e3 * model->op_seconds[k][ph] / res->steps, 100 * model->op_seconds[k][ph] / total);
    printf("  %-23s %8.1f ms/step %5.1f%%\n", "sum micro-batches", 1e3 * t_zero / res->steps, 100 * t_zero / total);
    printf("  %-23s %8.1f ms/step %5.1f%%\n", "clip + AdamW", 1e3 * t_opt / res->steps, 100 * t_opt / total);
  }
  // Medians skip the first step (it creates the GEMM primitives and touches fresh pages).
  if (res->steps > 1) {
    double med = median(step_times + 1, res->steps - 1);
    res->tokens_per_s = tokens_per_step / med;
    res->gflops = flops_per_step / med / 1e9;
  } else if (res->steps == 1) {
    res->tokens_per_s = tokens_per_step / step_times[0];
    res->gflops = flops_per_step / step_times[0] / 1e9;
  }
  res->peak_rss_bytes = peak_rss_bytes();
  if (o->save) {
    st = fy_model_save(model, o->save, FY_F32, (size_t)5 << 30);
    if (st == FY_OK && !o->quiet) printf("ferry: saved a Hugging Face checkpoint to %s\n", o->save);
  }
  if (!o->quiet && st == FY_OK && res->steps)
    printf("ferry: %lld steps, loss %.4f -> %.4f, median %.0f tok/s, %.1f GFLOP/s, peak RSS %.2f GiB\n",
           (long long)res->steps, res->first_loss, res->last_loss, res->tokens_per_s, res->gflops,
           res->peak_rss_bytes / 1073741824.0);
done:
  if (log) fclose(log);
  free(step_times);
  teardown(dev, model, data);
  return st;
}

fy_status fy_eval(const struct fy_train_opts *o, double *mean_loss) {
  struct fy_opt_config cfg;
  struct fy_device *dev = NULL;
  struct fy_model *model = NULL;
  fy_data *data = NULL;
  fy_status st = setup(o, &cfg, &dev, &model, &data, false);
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; st == FY_OK && i < o->eval_batches; i++) {
    struct fy_batch *batch;
    struct fy_loss loss;
    if ((st = fy_data_next(data, &batch)) != FY_OK) break;
    if ((st = fy_engine_forward(model, batch, &loss)) != FY_OK) break;
    sum += loss.sum;
    count += loss.count;
    if (i == 0 && o->dump) {
      const struct fy_graph *g = model->graph;
      struct fy_st_tensor ts[2] = {
          {.name = "input_ids", .dtype = FY_I32, .rank = 2, .shape = {g->B, g->T},
           .data = batch->inputs, .nbytes = (size_t)(g->B * g->T) * 4},
          {.name = "logits", .dtype = FY_F32, .rank = 3, .shape = {g->B, g->T, cfg.vocab_size},
           .data = model->acts + g->slots[g->logits_slot].offset,
           .nbytes = (size_t)(g->B * g->T * cfg.vocab_size) * 4}};
      st = fy_safetensors_write(o->dump, ts, 2, NULL);
    }
  }
  *mean_loss = count ? sum / (double)count : NAN;
  teardown(dev, model, data);
  return st;
}
