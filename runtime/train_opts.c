// The training options: their defaults, the learning-rate schedule, and the checks fy_train makes
// of them before a run is set up.
#include "runtime/trainer.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ops/ops.h"
#include "fy_config.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "planner/cost.h"
#include "memory/tier.h"
#include "runtime/run.h"

void fy_train_opts_defaults(struct fy_train_opts *o) {
  static char demo_data[4096];
  snprintf(demo_data, sizeof demo_data, "%s/data/demo", FY_SOURCE_DIR);
  *o = (struct fy_train_opts){
      .model = NULL, .init = NULL, .data = demo_data, .batch = 16, .seq = 0,
      .grad_accum = 1, .steps = 600, .lr = 2e-3f, .min_lr = -1, .warmup = -1,
      .adamw = fy_adamw_defaults(), .seed = 1337, .shuffle = true, .threads = 0, .device = "cpu",
      .disk_chunks = -1, .prefetch = 2, .keep = 2, .comm = "auto", .comm_timeout = 300,
      .eval_batches = 8, .val_batches = 10};
}

bool fy_lr_schedule_known(const char *name) {
  return !name || !strcmp(name, "cosine") || !strcmp(name, "linear") || !strcmp(name, "constant");
}

float fy_lr_at(const struct fy_train_opts *o, int64_t t) {
  float min_lr = o->min_lr >= 0 ? o->min_lr : o->lr * 0.1f;
  int64_t warm = o->warmup >= 0 ? o->warmup : (o->steps >= 20 ? o->steps / 20 : 0);
  if (t < warm) return o->lr * (float)(t + 1) / (float)warm;
  if (o->steps <= warm + 1 || (o->schedule && strcmp(o->schedule, "constant") == 0)) return o->lr;
  double frac = (double)(t - warm) / (double)(o->steps - warm - 1);
  if (o->schedule && strcmp(o->schedule, "linear") == 0) return min_lr + (float)(1.0 - frac) * (o->lr - min_lr);
  return min_lr + (float)(0.5 * (1.0 + cos(M_PI * frac))) * (o->lr - min_lr);
}

// --seq not given (0): FY_DEFAULT_SEQ tokens, or the model's positions when it has fewer.
fy_status resolve_seq(struct fy_train_opts *o) {
  if (o->seq != 0) return FY_OK;
  struct fy_opt_config cfg;
  FY_TRY(resolve_config(o, &cfg));
  o->seq = cfg.max_position_embeddings < FY_DEFAULT_SEQ ? cfg.max_position_embeddings : FY_DEFAULT_SEQ;
  return FY_OK;
}

// The run offloads through a host tier: --device sim, or --device cuda --offload.
static bool offloaded(const struct fy_train_opts *e) {
  return e->device && strcmp(e->device, "cpu") != 0 && (strcmp(e->device, "cuda") != 0 || e->offload);
}

// A lever of the offloaded exact step's host optimizer (--spec-chunks, --device-updates), `flag`
// asking for n chunks of it; `what` says what it does to an offloaded run's host updates.
static fy_status check_host_lever(const struct fy_train_opts *e, const char *flag, int n, const char *what) {
  if (n < 0) return fy_error_set(FY_ERR_INVALID, "%s must not be negative", flag);
  if (n == 0) return FY_OK;
  if (!offloaded(e))
    return fy_error_set(FY_ERR_UNSUPPORTED, "%s %d: it is for offloaded runs (--device sim, --device cuda --offload), "
                        "%s", flag, n, what);
  if (e->optimizer_lag > 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "%s %d: --optimizer-lag 1 runs each update under the next step already",
                        flag, n);
  return FY_OK;
}

// The run's defaults that depend on its device (precision, fp16's loss scale), and the checks of
// its options.
fy_status check_train_opts(struct fy_train_opts *e) {
  if (!e->precision) e->precision = fy_cost_default_precision(e->device);
  // fp16 overflows without loss scaling: dynamic scaling from 2^16 unless a scale was given.
  if (e->precision && strcmp(e->precision, "fp16") == 0 && !(e->loss_scale > 0)) e->loss_scale = 65536;
  if (e->steps < 0) return fy_error_set(FY_ERR_INVALID, "--steps must not be negative");
  if (e->grad_accum < 1) return fy_error_set(FY_ERR_INVALID, "--grad-accum must be at least 1");
  if (!(e->lr >= 0) || !isfinite(e->lr)) return fy_error_set(FY_ERR_INVALID, "--lr must be a number >= 0");
  const struct fy_adamw *h = &e->adamw;
  if (!(h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1 && h->eps > 0 && isfinite(h->eps) &&
        h->weight_decay >= 0 && isfinite(h->weight_decay)))
    return fy_error_set(FY_ERR_INVALID, "AdamW needs betas in [0, 1), eps > 0 and a weight decay >= 0 (got betas %g "
                        "and %g, eps %g, weight decay %g)", h->beta1, h->beta2, h->eps, h->weight_decay);
  if (e->save_every < 0) return fy_error_set(FY_ERR_INVALID, "--save-every must not be negative");
  if (e->save_every > 0 && !e->save) return fy_error_set(FY_ERR_INVALID, "--save-every needs --save DIR");
  if (e->val_every > 0 && !e->val_data) return fy_error_set(FY_ERR_INVALID, "--val-every needs --val-data PATH");
  if (!fy_lr_schedule_known(e->schedule))
    return fy_error_set(FY_ERR_INVALID, "--schedule %s: cosine, linear or constant", e->schedule);
  if (e->val_data && e->val_batches < 1) return fy_error_set(FY_ERR_INVALID, "--val-batches must be at least 1");
  if (e->optimizer_lag < 0 || e->optimizer_lag > 1)
    return fy_error_set(FY_ERR_INVALID, "--optimizer-lag %d: 0 (the exact step) or 1 (each update a step late)",
                        e->optimizer_lag);
  if (e->optimizer_lag > 0 && e->grad_accum > 1)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-lag 1 does not combine with --grad-accum %lld (each step's "
                        "gradients would need a second fp32 sum)", (long long)e->grad_accum);
  enum fy_state_format sf;
  if (e->optimizer_state && !fy_state_format_from_name(e->optimizer_state, &sf))
    return fy_error_set(FY_ERR_INVALID, "--optimizer-state %s: fp32, bf16 or 8bit", e->optimizer_state);
  const bool compressed = e->optimizer_state && sf != FY_STATE_F32;
  if (compressed && e->device && strcmp(e->device, "cuda") == 0 && !e->offload)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-state %s on a resident GPU run: the resident GPU keeps fp32 "
                        "AdamW state; train offloaded (--offload, where host, disk and device chunks keep it in %s) "
                        "or use --optimizer-state fp32", e->optimizer_state, e->optimizer_state);
  if (compressed && e->tp > 1)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-state %s with --tp %d: tensor-parallel slices keep fp32 AdamW "
                        "state (use --optimizer-state fp32)", e->optimizer_state, e->tp);
  if (e->pp > 1) {  // (what pipeline stages do not run yet: docs/ranks.md, "Pipeline parallelism")
    const bool cuda = e->device && strcmp(e->device, "cuda") == 0;
    if (e->device && strcmp(e->device, "cpu") != 0 && strcmp(e->device, "sim") != 0 && !cuda)
      return fy_error_set(FY_ERR_UNSUPPORTED, "--pp %d with another device (stages run on --device cpu, sim and "
                          "cuda): not supported yet", e->pp);
  }
  if (e->disk_master && (!e->precision || strcmp(e->precision, "fp32") == 0))
    return fy_error_set(FY_ERR_UNSUPPORTED, "--disk-master needs 16-bit compute (--precision bf16 or fp16): the host "
                        "then keeps the 16-bit copy the device reads while the fp32 master is on disk; in fp32 the "
                        "master is what the device reads");
  if (e->disk_master && !offloaded(e))
    return fy_error_set(FY_ERR_UNSUPPORTED, "--disk-master is for offloaded runs (--device sim, --device cuda "
                        "--offload), whose chunks' state may live on disk");
  FY_TRY(check_host_lever(e, "--spec-chunks", e->spec_chunks,
                          "whose host updates it starts before the gradient norm is known"));
  FY_TRY(check_host_lever(e, "--device-updates", e->device_updates,
                          "whose host-tier chunks it has the device update"));
  if (e->optimizer_lag > 0 && e->device && strcmp(e->device, "cuda") == 0 && !e->offload)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-lag 1 is for offloaded runs (--device cuda --offload, "
                        "--device sim) and the cpu: a resident GPU run updates on the GPU, where the lag hides nothing");
  return FY_OK;
}
