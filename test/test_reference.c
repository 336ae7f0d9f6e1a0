// ferry against Hugging Face transformers (fixtures from test/reference/make_reference.py): for
// each small OPT model, the logits and loss of a padded batch, the gradient of every parameter,
// and the losses and parameters after 5 AdamW steps with clipping. On the cpu device by default;
// `--device cuda` runs the same checks with the model resident on GPU 0
// and its CUDA kernels (fp32, true fp32 GEMMs), exiting 77 (skipped) when there is no GPU.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/opt.h"
#include "fy_config.h"
#include "core/safetensors.h"
#include "ops/ops.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"
#include "runtime/data.h"
#include "runtime/trainer.h"
#if FY_HAVE_CUDA
#include "runtime/engine_cuda.h"
#endif

static bool on_cuda;  // the model on GPU 0 (--device cuda)

// The hyperparameters make_reference.py uses.
static const float REF_LR = 1e-2f;
static const int REF_STEPS = 5;

static bool is_zero_grad(const char *name) { return strstr(name, "self_attn.k_proj.bias") != NULL; }

static const struct fy_st_tensor *need(const fy_safetensors *st, const char *name) {
  const struct fy_st_tensor *t = fy_safetensors_find(st, name);
  CHECKF(t != NULL, "fixture lacks %s", name);
  return t;
}

// A host copy of n floats of the model's memory (downloaded when it lives on the GPU).
static float *host_copy(struct fy_model *m, const float *p, int64_t n) {
  float *h = malloc((size_t)n * 4);
  if (!h) {
    fprintf(stderr, "reference: out of memory\n");
    exit(1);
  }
  if (fy_model_download(m, h, p, (size_t)n * 4) != FY_OK) {
    fprintf(stderr, "reference: download failed: %s\n", fy_error_msg());
    exit(1);
  }
  return h;
}

// On a failed comparison: the rows (of a matrix) whose error is largest, to tell one wrong row
// (a padding row, say) from a wrong kernel.
static void worst_rows(const struct fy_param *p, const float *got, const float *want) {
  int64_t rows = p->rank == 2 ? p->shape[0] : 1, cols = p->numel / rows;
  int64_t top[3] = {-1, -1, -1};
  double err[3] = {0, 0, 0};
  for (int64_t r = 0; r < rows; r++) {
    double e = 0;
    for (int64_t c = 0; c < cols; c++) {
      double d = (double)got[r * cols + c] - want[r * cols + c];
      e += d * d;
    }
    for (int k = 0; k < 3; k++)
      if (e > err[k]) {
        for (int j = 2; j > k; j--) err[j] = err[j - 1], top[j] = top[j - 1];
        err[k] = e, top[k] = r;
        break;
      }
  }
  for (int k = 0; k < 3 && top[k] >= 0; k++) {
    double w = 0;
    for (int64_t c = 0; c < cols; c++) w += (double)want[top[k] * cols + c] * want[top[k] * cols + c];
    fprintf(stderr, "    row %lld: error %.3g against a row norm of %.3g\n", (long long)top[k], sqrt(err[k]), sqrt(w));
  }
}

static void run_fixture(const char *dir) {
  fprintf(stderr, "fixture %s\n", dir);
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_config_read(dir, &cfg));
  char path[1024];
  snprintf(path, sizeof path, "%s/expected.safetensors", dir);
  fy_safetensors *ex;
  fy_status st = fy_safetensors_open(path, &ex);
  CHECK_OK(st);
  if (st != FY_OK) return;
  const struct fy_st_tensor *ids = need(ex, "input_ids"), *mask = need(ex, "attention_mask"),
                            *targets = need(ex, "targets"), *logits = need(ex, "logits"),
                            *loss = need(ex, "loss"), *step_loss = need(ex, "step_loss"),
                            *step_norm = need(ex, "step_grad_norm");
  if (!ids || !mask || !targets || !logits || !loss || !step_loss || !step_norm) return;
  int64_t B = ids->shape[0], T = ids->shape[1];
  struct fy_device *dev = NULL;
  struct fy_model *m = NULL;
#if FY_HAVE_CUDA
  if (on_cuda) CHECK_OK(fy_engine_cuda_device(0, 0, &dev));
#endif
  if (!on_cuda) CHECK_OK(fy_device_cpu_create(0, &dev));
  if (dev) CHECK_OK(fy_model_create(&cfg, B, T, dev, &m));
#if FY_HAVE_CUDA
  if (on_cuda && m) CHECK_OK(fy_engine_cuda_attach(m));
#endif
  if (!m) return;
  CHECK_OK(fy_model_load(m, dir));
  struct fy_batch batch = {.B = B, .T = T, .inputs = (int32_t *)ids->data,
                           .targets = (int32_t *)targets->data, .mask = (int32_t *)mask->data};
  const struct fy_graph *g = m->graph;

  // Forward: logits and loss.
  struct fy_loss l;
  CHECK_OK(fy_engine_forward(m, &batch, &l));
  float *lg = host_copy(m, m->acts + g->slots[g->logits_slot].offset, B * T * cfg.vocab_size);
  double e = check_rel_err(lg, logits->data, B * T * cfg.vocab_size);
  free(lg);
  CHECKF(e < 1e-5, "logits: normalised error %.3g", e);
  float mean = (float)(l.sum / l.count), want = ((const float *)loss->data)[0];
  CHECKF(fabsf(mean - want) <= 1e-5f * fabsf(want), "loss %.8f, transformers %.8f", mean, want);
  fprintf(stderr, "  logits error %.2g, loss %.7f vs %.7f\n", e, mean, want);

  // Backward: every parameter's gradient. The key projection's bias has an analytic gradient of
  // zero (adding q.b to every score of a row leaves the softmax unchanged), so both sides hold
  // rounding noise there: that one is checked to be negligible against the total gradient norm.
  CHECK_OK(fy_engine_backward(m, &batch, 1.0f / (float)l.count));  // overwrites the gradients
  float *grads = host_copy(m, m->grads, g->n_param_elems);
  // The same forward and backward again give the same bits (no kernel reads what an earlier pass
  // left behind, no float atomics).
  CHECK_OK(fy_engine_forward(m, &batch, &l));
  CHECK_OK(fy_engine_backward(m, &batch, 1.0f / (float)l.count));
  float *again = host_copy(m, m->grads, g->n_param_elems);
  for (int i = 0; i < g->n_params; i++) {
    const struct fy_param *p = &g->params[i];
    CHECKF(memcmp(grads + p->offset, again + p->offset, (size_t)p->numel * 4) == 0,
           "gradient of %s differs between two identical passes", p->name);
  }
  free(again);
  double total = 0;
  for (int i = 0; i < g->n_params; i++) {
    char name[256];
    snprintf(name, sizeof name, "grad.%s", g->params[i].name);
    const struct fy_st_tensor *t = fy_safetensors_find(ex, name);
    if (t) total += fy_sumsq(t->data, g->params[i].numel);
  }
  total = sqrt(total);
  double worst = 0;
  for (int i = 0; i < g->n_params; i++) {
    char name[256];
    snprintf(name, sizeof name, "grad.%s", g->params[i].name);
    const struct fy_st_tensor *t = need(ex, name);
    if (!t) continue;
    if (is_zero_grad(g->params[i].name)) {
      double n = sqrt(fy_sumsq(grads + g->params[i].offset, g->params[i].numel));
      CHECKF(n < 1e-6 * total, "%s: gradient norm %.3g should be ~0 (total %.3g)", g->params[i].name, n, total);
      continue;
    }
    e = check_rel_err(grads + g->params[i].offset, t->data, g->params[i].numel);
    CHECKF(e < 1e-4, "gradient of %s: normalised error %.3g", g->params[i].name, e);
    if (e >= 1e-4) worst_rows(g->params + i, grads + g->params[i].offset, t->data);
    if (e > worst) worst = e;
  }
  free(grads);
  fprintf(stderr, "  %d gradients, worst normalised error %.2g\n", g->n_params, worst);

  // Five AdamW steps with clipping, from the same weights. Parameters with zero analytic gradient
  // move by Adam's normalised rounding noise on either side, at most lr per step.
  float *initial = host_copy(m, m->params, g->n_param_elems);
  struct fy_adamw h = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f, .clip = 1.0f};
  for (int s = 0; s < REF_STEPS; s++) {
    CHECK_OK(fy_engine_forward(m, &batch, &l));
    float got = (float)(l.sum / l.count), ref = ((const float *)step_loss->data)[s];
    CHECKF(fabsf(got - ref) <= 1e-4f * fabsf(ref), "step %d loss %.7f, transformers %.7f", s + 1, got, ref);
    CHECK_OK(fy_engine_backward(m, &batch, 1.0f / (float)l.count));
    double norm = fy_optimizer_grad_norm(m, 1.0f), rnorm = ((const float *)step_norm->data)[s];
    CHECKF(fabs(norm - rnorm) <= 1e-4 * rnorm, "step %d grad norm %.7f, transformers %.7f", s + 1, norm, rnorm);
    CHECK_OK(fy_optimizer_step(m, &h, REF_LR, s + 1, 1.0f, norm));
  }
  worst = 0;
  float *params = host_copy(m, m->params, g->n_param_elems);
  for (int i = 0; i < g->n_params; i++) {
    char name[256];
    snprintf(name, sizeof name, "final.%s", g->params[i].name);
    const struct fy_st_tensor *t = need(ex, name);
    if (!t) continue;
    if (is_zero_grad(g->params[i].name)) {
      const float *p = params + g->params[i].offset, *p0 = initial + g->params[i].offset, *r = t->data;
      int far = 0;
      for (int64_t k = 0; k < g->params[i].numel; k++)
        far += fabsf(p[k] - p0[k]) > 1.01f * REF_LR * REF_STEPS || fabsf(r[k] - p0[k]) > 1.01f * REF_LR * REF_STEPS;
      CHECKF(far == 0, "%s moved more than Adam's bound", g->params[i].name);
      continue;
    }
    e = check_rel_err(params + g->params[i].offset, t->data, g->params[i].numel);
    CHECKF(e < 1e-4, "%s after %d steps: normalised error %.3g", g->params[i].name, REF_STEPS, e);
    if (e > worst) worst = e;
  }
  fprintf(stderr, "  after %d AdamW steps, worst parameter error %.2g\n", REF_STEPS, worst);
  free(initial);
  free(params);
#if FY_HAVE_CUDA
  if (on_cuda) fy_engine_cuda_detach(m);
#endif
  fy_model_free(m);
  fy_device_free(dev);
  fy_safetensors_close(ex);
}

// `ferry eval --device cuda` (the whole model on the GPU): fp32 gives the cpu's mean loss, bf16
// (its default there) comes close; offloaded (--offload), bf16 gives about the resident bf16 loss.
static void eval_on_cuda(const char *dir) {
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_config_read(dir, &cfg));
  char shard[256];
  snprintf(shard, sizeof shard, "/tmp/fy_reference_eval_%d.bin", (int)getpid());
  uint16_t tok[2000];
  for (int i = 0; i < 2000; i++) tok[i] = (uint16_t)((i * 7 + i / 13) % cfg.vocab_size);
  CHECK_OK(fy_shard_write(shard, tok, 2000));
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  o.init = dir;
  o.data = shard;
  o.batch = 2;
  o.seq = cfg.max_position_embeddings < 16 ? cfg.max_position_embeddings : 16;
  o.eval_batches = 3;
  o.quiet = true;
  o.precision = "fp32";
  double cpu = 0, gpu = 0, gpu16 = 0;
  o.device = "cpu";
  CHECK_OK(fy_eval(&o, &cpu));
  o.device = "cuda";
  CHECK_OK(fy_eval(&o, &gpu));
  o.precision = NULL;
  CHECK_OK(fy_eval(&o, &gpu16));
  CHECKF(fabs(gpu - cpu) <= 1e-5 * fabs(cpu) && fabs(gpu16 - cpu) <= 2e-2 * fabs(cpu),
         "%s: eval on cuda %.6f (fp32), %.6f (bf16), on the cpu %.6f", dir, gpu, gpu16, cpu);
  // Offloaded: the chunks through the device cache in forward passes alone, 2 blocks.
  double off16 = 0;
  o.offload = true;
  o.blocks = 2;
  CHECK_OK(fy_eval(&o, &off16));
  CHECKF(fabs(off16 - gpu16) <= 1e-3 * fabs(gpu16), "%s: eval offloaded on cuda %.6f, resident %.6f", dir, off16,
         gpu16);
  unlink(shard);
}

int main(int argc, char **argv) {
  const char *src = getenv("FY_SOURCE_DIR");
  int first = 1;
  if (argc > 2 && strcmp(argv[1], "--device") == 0) {
    on_cuda = strcmp(argv[2], "cuda") == 0;
    if (!on_cuda && strcmp(argv[2], "cpu") != 0) {
      fprintf(stderr, "reference: --device takes cpu or cuda, not %s\n", argv[2]);
      return 2;
    }
    first = 3;
  }
  if (on_cuda) {
#if FY_HAVE_CUDA
    size_t free_bytes = fy_engine_cuda_free_memory(0);
    if (free_bytes == 0) {
      fprintf(stderr, "reference: no GPU (or no driver): skipped\n");
      return 77;
    }
#else
    fprintf(stderr, "reference: built without CUDA: skipped\n");
    return 77;
#endif
  }
  char dir[1024];
  const char *fixtures[] = {"pre_ln", "post_ln"};
  for (int i = 0; i < 2; i++) {
    snprintf(dir, sizeof dir, "%s/test/reference/%s", src ? src : ".", fixtures[i]);
    run_fixture(dir);
    if (on_cuda) eval_on_cuda(dir);
  }
  for (int i = first; i < argc; i++) run_fixture(argv[i]);
  fy_matmul_cache_clear();
  return check_summary("reference");
}
