// ferry eval, ferry sample and ferry export.
#include "runtime/trainer.h"
#include "runtime/sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <dirent.h>
#include <errno.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/safetensors.h"
#include "fy_config.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "planner/cost.h"
#include "memory/tier.h"
#include "runtime/run.h"

// ferry eval --dump: the first batch's inputs and logits (cpu: the logits are in host memory).
static fy_status dump_first(struct run *r, const struct fy_batch *batch, void *path) {
  const struct fy_graph *g = r->model->graph;
  struct fy_st_tensor ts[2] = {
      {.name = "input_ids", .dtype = FY_I32, .rank = 2, .shape = {g->B, g->T}, .data = batch->inputs,
       .nbytes = (size_t)(g->B * g->T) * 4},
      {.name = "logits", .dtype = FY_F32, .rank = 3, .shape = {g->B, g->T, r->cfg.vocab_size},
       .data = r->model->acts + g->slots[g->logits_slot].offset,
       .nbytes = (size_t)(g->B * g->T * r->cfg.vocab_size) * 4}};
  return fy_safetensors_write(path, ts, 2, NULL);
}

fy_status fy_eval(const struct fy_train_opts *o, double *mean_loss_out) {
  struct fy_train_opts e = *o;
  char init_dir[4096];
  FY_TRY(resolve_init(&e.init, init_dir, sizeof init_dir));
  // The whole model on the cpu or a GPU; or, offloaded (sim, or a GPU with --offload), the chunks
  // through the device cache in forward passes alone (no gradients or AdamW state kept). On a GPU
  // the forward runs in bf16 unless told otherwise.
  // With --pp each batch goes through the stages in turn (forward passes alone), the loss from the
  // last stage; the logits --dump writes are the last stage's, and rank 0 writes: refused.
  if (o->pp > 1 && o->dump)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--dump with --pp %d: the logits are the last stage's; dump them from a "
                        "run without --pp", o->pp);
  if (!e.device) e.device = "cpu";
  const bool cuda = strcmp(e.device, "cuda") == 0, sim = strcmp(e.device, "sim") == 0;
  if (!cuda && !sim && strcmp(e.device, "cpu") != 0)
    return fy_error_set(FY_ERR_INVALID, "--device %s: ferry eval runs on cpu, sim or cuda", e.device);
  if (e.offload && !cuda) return fy_error_set(FY_ERR_INVALID, "--offload is for --device cuda (sim always offloads)");
  if (o->dump && strcmp(e.device, "cpu") != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--dump writes the cpu's logits: use --device cpu");
  if (!e.precision) e.precision = fy_cost_default_precision(e.device);
  FY_TRY(resolve_seq(&e));
  struct run r;
  fy_status st = setup(&e, &r, false, true, NULL);
  if (st == FY_OK) st = mean_loss(&r, r.data, o->eval_batches, mean_loss_out, o->dump && r.rank == 0 ? dump_first : NULL,
                                  (void *)o->dump);
  if (st == FY_OK && r.rank == 0 && !o->quiet && isfinite(*mean_loss_out))
    printf("eval loss %.6f (perplexity %.4g) over %lld batches of %lld x %lld\n", *mean_loss_out, exp(*mean_loss_out),
           (long long)o->eval_batches, (long long)(o->batch * r.dp), (long long)e.seq);
  else if (st == FY_OK && r.rank == 0 && !o->quiet)  // (NaN: the loss masks leave no target)
    printf("eval loss nan: every target of the %lld batches of %lld x %lld is ignored (loss masks)\n",
           (long long)o->eval_batches, (long long)(o->batch * r.dp), (long long)e.seq);
  teardown(&r);
  return st;
}

fy_status fy_sample(const struct fy_train_opts *o, const struct fy_sample_opts *s, int32_t *out, int64_t *n_out) {
  *n_out = 0;
  if (s->n_prompt < 1) return fy_error_set(FY_ERR_INVALID, "sample: the prompt needs at least one token");
  if (s->n_new < 0 || !(s->temperature >= 0) || s->top_k < 0)
    return fy_error_set(FY_ERR_INVALID, "sample: tokens, temperature and top-k must not be negative");
  if (!(s->top_p >= 0 && s->top_p <= 1))
    return fy_error_set(FY_ERR_INVALID, "sample: top-p %g is not in [0, 1]", s->top_p);
  // Decoding runs the whole model on one rank: a layout's stages or slices would pass one token's
  // activations (a row) between ranks per layer or stage for every token, which is not built.
  if (o->pp > 1 || o->tp > 1)
    return fy_error_set(FY_ERR_UNSUPPORTED, "ferry sample --%s %d: not supported (sampling decodes on one rank with "
                        "the whole model and its key/value cache; a model trained under any layout is one Hugging "
                        "Face model (--save), which ferry sample --init reads on one rank)", o->pp > 1 ? "pp" : "tp",
                        o->pp > 1 ? o->pp : o->tp);
  struct fy_train_opts e = *o;
  e.batch = 1;
  e.data = NULL;
  char init_dir[4096];
  FY_TRY(resolve_init(&e.init, init_dir, sizeof init_dir));
  const bool cuda = e.device && strcmp(e.device, "cuda") == 0;
  if (e.device && strcmp(e.device, "cpu") != 0 && !cuda)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--device %s: ferry sample runs on the cpu or a GPU (cuda)", e.device);
  if (e.offload && !cuda) return fy_error_set(FY_ERR_INVALID, "--offload is for --device cuda");
  if (!e.offload && (e.blocks || e.host_mem))
    return fy_error_set(FY_ERR_INVALID, "--blocks and --host-mem are for --offload");
  if (!cuda && e.device_mem) return fy_error_set(FY_ERR_INVALID, "--device-mem is for --device cuda");
  if (!e.precision) e.precision = fy_cost_default_precision(e.device);
  if (strcmp(e.precision, "fp32") != 0 && !(cuda && strcmp(e.precision, "bf16") == 0))
    return fy_error_set(FY_ERR_UNSUPPORTED, "--precision %s: ferry sample computes in fp32, or bf16 on a GPU",
                        e.precision);
  // The window: --seq, else every position the model has (a token costs one token's work whatever
  // the context: the keys and values of the tokens before are cached).
  struct fy_opt_config cfg;
  FY_TRY(resolve_config(&e, &cfg));
  const int64_t window = e.seq > 0 ? e.seq : cfg.max_position_embeddings;
  FY_TRY(seq_fits(window, &cfg));
  // The model is built for the prompt's tokens to run FY_SAMPLE_PREFILL at a time (products of that
  // many rows); each new token then runs alone, on its first row.
  e.seq = window < FY_SAMPLE_PREFILL ? window : FY_SAMPLE_PREFILL;
  // Offloaded, the chunk cache leaves the key/value cache its room (two buffers, each rounded up by
  // the allocator).
  if (e.offload)
    e.device_reserve = (size_t)fy_kv_cache_bytes(&cfg, window, precision_dtype(&e)) + ((size_t)4 << 20);
  const int64_t V = cfg.vocab_size;
  for (int64_t i = 0; i < s->n_prompt; i++)
    if (s->prompt[i] < 0 || s->prompt[i] >= V)
      return fy_error_set(FY_ERR_INVALID, "sample: prompt token %lld is %d, outside the vocabulary (%lld)",
                          (long long)i, s->prompt[i], (long long)V);
  const int32_t eos = cfg.eos_token_id >= 0 && cfg.eos_token_id < V ? (int32_t)cfg.eos_token_id : -1;
  const int32_t *stop = s->n_stop < 0 ? &eos : s->stop;
  const int n_stop = s->n_stop < 0 ? eos >= 0 : s->n_stop;
  for (int i = 0; i < n_stop; i++)
    if (stop[i] < 0 || stop[i] >= V)
      return fy_error_set(FY_ERR_INVALID, "sample: stop token %d is outside the vocabulary (%lld)", stop[i],
                          (long long)V);
  struct run r;
  fy_status st = setup(&e, &r, false, true, NULL);
  struct fy_kv_cache *kv = NULL;
  struct fy_sample_cand *cand = malloc((size_t)V * sizeof *cand);
  if (st == FY_OK && !cand) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (st == FY_OK) st = fy_kv_cache_create(r.model, window, &kv);
  memcpy(out, s->prompt, (size_t)s->n_prompt * 4);
  uint64_t rng = o->seed;
  const float *logits = NULL;
  int64_t n = s->n_prompt;
  bool stopped = false;
  double t0 = fy_now(), t1 = t0;
  // out[0, fed): the tokens run so far (the cache holds the last of them); out[n] is drawn from
  // the logits after out[n - 1].
  for (int64_t fed = 0; st == FY_OK && !stopped && n < s->n_prompt + s->n_new; n++) {
    if (fy_kv_cache_len(kv) + (n - fed) > window) {
      // The window is full: the newest half of it (at least the last token) runs again from
      // position 0, as the model sees the start of a sequence.
      fy_kv_cache_reset(kv);
      fed = n - (window / 2 > 0 ? window / 2 : 1);
    }
    while (st == FY_OK && fed < n) {
      const int64_t k = n - fed < e.seq ? n - fed : e.seq;
      st = r.x ? fy_offload_decode(r.x, kv, out + fed, k, &logits)
               : fy_engine_decode(r.model, kv, out + fed, k, &logits);
      fed += k;
    }
    if (st != FY_OK) break;
    out[n] = fy_sample_token(logits, V, s->temperature, s->top_k, s->top_p, cand, &rng);
    for (int i = 0; i < n_stop; i++) stopped |= out[n] == stop[i];
    if (n == s->n_prompt) t1 = fy_now();
  }
  if (s->prompt_seconds) *s->prompt_seconds = t1 - t0;
  if (s->new_seconds) *s->new_seconds = n > s->n_prompt ? fy_now() - t1 : 0;
  if (st == FY_OK) *n_out = n;
  fy_kv_cache_free(kv);
  free(cand);
  teardown(&r);
  return st;
}

// Copies src to dst through a temporary file: fsync, rename.
static fy_status copy_file(const char *src, const char *dst) {
  FILE *in = fopen(src, "rb");
  if (!in) return fy_error_set(FY_ERR_IO, "cannot open %s", src);
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp-%d", dst, (int)getpid());
  FILE *out = fopen(tmp, "wb");
  if (!out) {
    fclose(in);
    return fy_error_set(FY_ERR_IO, "cannot create %s", tmp);
  }
  static char buf[1 << 20];
  size_t n;
  bool ok = true;
  while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, n, out) == n;
  ok = ok && !ferror(in) && fflush(out) == 0 && fsync(fileno(out)) == 0;
  fclose(in);
  ok = fclose(out) == 0 && ok;
  if (!ok || rename(tmp, dst) != 0) {
    unlink(tmp);
    return fy_error_set(FY_ERR_IO, "writing %s failed (disk full?)", dst);
  }
  return FY_OK;
}

fy_status fy_export(const char *checkpoint, const char *out_dir) {
  char dir[4096];
  FY_TRY(fy_ckpt_resolve(checkpoint, dir, sizeof dir));
  FY_TRY(fy_ckpt_verify(dir));
  // Check what we copy: the config parses and the weights open with every header claim checked.
  struct fy_opt_config cfg;
  FY_TRY(fy_opt_config_read(dir, &cfg));
  if (cfg.num_local_experts > 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "%s is a mixture of experts (%lld experts): transformers has no OPT "
                        "mixture-of-experts class to load it into, so there is nothing to export to; its weights "
                        "are ferry's safetensors in %s (ferry train --init, ferry eval and ferry sample read them)",
                        checkpoint, (long long)cfg.num_local_experts, dir);
  fy_safetensors *st;
  FY_TRY(fy_safetensors_open_dir(dir, &st));
  int n = fy_safetensors_count(st);
  fy_safetensors_close(st);
  if (n == 0) return fy_error_set(FY_ERR_FORMAT, "%s holds no weights", dir);
  if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
    return fy_error_set(FY_ERR_IO, "cannot create %s: %s", out_dir, strerror(errno));
  DIR *d = opendir(dir);
  if (!d) return fy_error_set(FY_ERR_IO, "cannot read %s", dir);
  struct dirent *e;
  fy_status status = FY_OK;
  while (status == FY_OK && (e = readdir(d))) {
    const char *nm = e->d_name;
    bool model_file = strcmp(nm, "config.json") == 0 ||
                      (strncmp(nm, "model", 5) == 0 && (strstr(nm, ".safetensors") != NULL));
    if (!model_file) continue;
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/%s", dir, nm);
    snprintf(b, sizeof b, "%s/%s", out_dir, nm);
    status = copy_file(a, b);
  }
  closedir(d);
  return status;
}
