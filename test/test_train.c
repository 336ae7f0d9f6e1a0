// Integration: the trainer end to end on a tiny model and a synthetic shard — the loss falls, runs
// are reproducible, micro-batching does not change the result, checkpoints round-trip, and bad
// input is refused with a message.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "core/opt.h"
#include "core/safetensors.h"
#include "ops/ops.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/trainer.h"
#include "runtime/optimizer.h"

static char tmpdir[256];

// A learnable stream: each token follows from the two before it.
static void write_pattern_shard(const char *path, int64_t n, int vocab) {
  uint16_t *t = malloc((size_t)n * sizeof *t);
  t[0] = 3;
  t[1] = 5;
  for (int64_t i = 2; i < n; i++) t[i] = (uint16_t)((t[i - 1] + 2 * t[i - 2] + (i % 7 == 0)) % vocab);
  CHECK_OK(fy_shard_write(path, t, n));
  free(t);
}

static struct fy_train_opts tiny_opts(const char *data) {
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  o.hash_params = true;  // runs are compared bit for bit
  o.model = "opt-tiny";
  o.data = data;
  o.batch = 4;
  o.seq = 32;
  o.steps = 40;
  o.lr = 1e-2f;
  o.warmup = 4;
  o.quiet = true;
  o.shuffle = false;
  return o;
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/ferry_train_XXXXXX");
  if (!mkdtemp(tmpdir)) return 1;
  char shard[512], bad_shard[512], save[512], save2[512], cmd[1024];
  snprintf(shard, sizeof shard, "%s/train.bin", tmpdir);
  snprintf(bad_shard, sizeof bad_shard, "%s/big_ids.bin", tmpdir);
  snprintf(save, sizeof save, "%s/ckpt", tmpdir);
  snprintf(save2, sizeof save2, "%s/ckpt_bf16", tmpdir);
  write_pattern_shard(shard, 20000, 97);

  // The loss falls.
  struct fy_train_opts o = tiny_opts(shard);
  o.save = save;
  struct fy_train_result r1, r2;
  CHECK_OK(fy_train(&o, &r1));
  CHECKF(r1.steps == 40 && r1.last_loss < 0.6f * r1.first_loss, "loss %f -> %f", r1.first_loss, r1.last_loss);
  CHECK(r1.first_loss > 4.0f && r1.first_loss < 5.2f);  // about ln(97) = 4.57 at initialisation
  CHECK(r1.tokens_per_s > 0 && r1.gflops > 0);

  // Reproducible: the same seed gives the same losses bit for bit.
  o.save = NULL;
  CHECK_OK(fy_train(&o, &r2));
  CHECK(r1.last_loss == r2.last_loss && r1.first_loss == r2.first_loss);
  CHECK(r1.params_hash != 0 && r1.params_hash == r2.params_hash);
  // The hash only when asked for (the CLI's runs skip a pass over every weight at the end).
  {
    struct fy_train_opts nh = o;
    struct fy_train_result r3;
    nh.hash_params = false;
    nh.steps = 2;
    CHECK_OK(fy_train(&nh, &r3));
    CHECK(r3.steps == 2 && r3.params_hash == 0);
  }

  // Micro-batching: 2 x 2 with accumulation equals 4 at once (same sequences, same mean).
  struct fy_train_opts a = tiny_opts(shard);
  a.steps = 6;
  struct fy_train_result ra, rb;
  CHECK_OK(fy_train(&a, &ra));
  a.batch = 2;
  a.grad_accum = 2;
  CHECK_OK(fy_train(&a, &rb));
  CHECKF(fabsf(ra.last_loss - rb.last_loss) <= 1e-5f * fabsf(ra.last_loss), "accum: %.8f vs %.8f",
         ra.last_loss, rb.last_loss);

  // Recomputation changes memory, never the numbers: bit for bit the same losses.
  struct fy_train_opts rc = tiny_opts(shard);
  rc.steps = 6;
  struct fy_train_result r_rc;
  CHECK_OK(fy_train(&rc, &ra));
  rc.recompute = true;
  CHECK_OK(fy_train(&rc, &r_rc));
  CHECKF(ra.last_loss == r_rc.last_loss && ra.first_loss == r_rc.first_loss, "recompute: %.9g vs %.9g",
         ra.last_loss, r_rc.last_loss);
  CHECK(r_rc.activation_bytes < ra.activation_bytes);

  // Dropout (--dropout): it changes training (masks are drawn, the loss still falls); the masks
  // follow the seed and the tokens' place in the data, so recomputation draws the same (bit for
  // bit) and 2 x 2 micro-batches the masks of 4 at once; another seed draws others; evaluation
  // never drops; a probability of 1 is refused.
  {
    struct fy_train_opts d = tiny_opts(shard);
    d.steps = 6;
    struct fy_train_result none, r_do, r_do_rc, r_do_acc, r_do_seed;
    CHECK_OK(fy_train(&d, &none));
    d.dropout = 0.3f;
    CHECK_OK(fy_train(&d, &r_do));
    CHECKF(r_do.first_loss != none.first_loss && r_do.params_hash != none.params_hash && r_do.last_loss < r_do.first_loss,
           "dropout: loss %.9g -> %.9g, without %.9g", r_do.first_loss, r_do.last_loss, none.first_loss);
    d.recompute = true;
    CHECK_OK(fy_train(&d, &r_do_rc));
    CHECKF(r_do_rc.params_hash == r_do.params_hash && r_do_rc.last_loss == r_do.last_loss, "dropout with recompute differs");
    d.recompute = false;
    d.batch = 2;
    d.grad_accum = 2;
    CHECK_OK(fy_train(&d, &r_do_acc));
    CHECKF(fabsf(r_do_acc.last_loss - r_do.last_loss) <= 1e-5f * fabsf(r_do.last_loss),
           "dropout, 2 x 2 micro-batches: %.9g, 4 at once %.9g", r_do_acc.last_loss, r_do.last_loss);
    d.batch = 4;
    d.grad_accum = 1;
    d.seed += 1;  // (also another initialisation: compare the first loss's distance instead)
    CHECK_OK(fy_train(&d, &r_do_seed));
    CHECK(r_do_seed.params_hash != r_do.params_hash);
    d.seed -= 1;
    double e_none = 0, e_do = 0;
    struct fy_train_opts e = tiny_opts(shard);
    e.eval_batches = 2;
    CHECK_OK(fy_eval(&e, &e_none));
    e.dropout = 0.3f;
    CHECK_OK(fy_eval(&e, &e_do));
    CHECKF(e_none == e_do, "eval with a dropout option: %.9g, without %.9g", e_do, e_none);
    d.dropout = 1.0f;
    CHECK_ERR(fy_train(&d, &r_do), FY_ERR_INVALID);
  }

  // Loss masks: a step's loss is the mean over the targets its whole batch counts, however the
  // batch is split into micro-batches (micro-batches of unequal counts: 2 x 2 accumulated equals
  // 4 at once). A step whose every target is ignored updates nothing and is still a step: logged
  // (loss null), counted, checkpointed, and AdamW's bias correction counts only the updates, so
  // that run equals one that starts at its next batch (bit for bit), straight or resumed from the
  // checkpoint written at the ignored step.
  {
    const int64_t n = 20000, bt = 4 * 32;  // tokens; a batch's targets (4 x 32)
    char mshard[600], mshard2[600], mlog[600], mck[600];
    snprintf(mshard, sizeof mshard, "%s/masked/train.bin", tmpdir);
    snprintf(mshard2, sizeof mshard2, "%s/masked/later.bin", tmpdir);
    snprintf(mlog, sizeof mlog, "%s/masked/log.jsonl", tmpdir);
    snprintf(mck, sizeof mck, "%s/masked/ck", tmpdir);
    snprintf(cmd, sizeof cmd, "%s/masked", tmpdir);
    CHECK(mkdir(cmd, 0755) == 0);
    uint16_t *tok = malloc((size_t)n * sizeof *tok);
    uint8_t *mask = malloc((size_t)n);
    tok[0] = 3, tok[1] = 5;
    for (int64_t i = 2; i < n; i++) tok[i] = (uint16_t)((tok[i - 1] + 2 * tok[i - 2] + (i % 7 == 0)) % 97);
    // Target k (token k, k >= 1) counts where mask[k]: none in the first batch (tokens 1 .. 128),
    // then sequences whose counts differ (1 in 5 of the even windows' targets, every odd one's).
    for (int64_t k = 0; k < n; k++) mask[k] = k <= bt ? 0 : ((k - 1) / 32) % 2 ? 1 : k % 5 == 0;
    CHECK_OK(fy_shard_write(mshard, tok, n));
    CHECK_OK(fy_shard_write_mask(mshard, mask, n));
    CHECK_OK(fy_shard_write(mshard2, tok + bt, n - bt));  // the same stream from the second batch on
    CHECK_OK(fy_shard_write_mask(mshard2, mask + bt, n - bt));
    free(tok);
    free(mask);

    struct fy_train_opts m = tiny_opts(mshard2);
    m.steps = 4;
    m.warmup = 0;
    m.schedule = "constant";
    struct fy_train_result whole, split, later, skipped, resumed;
    CHECK_OK(fy_train(&m, &whole));
    m.batch = 2;
    m.grad_accum = 2;
    CHECK_OK(fy_train(&m, &split));
    CHECKF(fabsf(split.first_loss - whole.first_loss) <= 1e-6f * whole.first_loss &&
           fabsf(split.last_loss - whole.last_loss) <= 1e-5f * whole.last_loss,
           "masked, 2 x 2 micro-batches: loss %.9g -> %.9g; 4 at once %.9g -> %.9g", split.first_loss, split.last_loss,
           whole.first_loss, whole.last_loss);
    m.batch = 4;
    m.grad_accum = 1;
    m.steps = 3;
    CHECK_OK(fy_train(&m, &later));
    m.data = mshard;  // the same, after a first batch with nothing to learn
    m.steps = 4;
    m.log_path = mlog;
    m.val_data = mshard;  // (validation on that first batch: no target, no mean)
    m.val_batches = 1;
    m.val_every = 4;
    CHECK_OK(fy_train(&m, &skipped));
    CHECKF(skipped.steps == 4 && skipped.ignored_steps == 1 && skipped.params_hash == later.params_hash &&
           skipped.first_loss == later.first_loss && skipped.last_loss == later.last_loss,
           "a step without targets: %lld steps, %lld ignored, loss %.9g -> %.9g (want %.9g -> %.9g), same weights %d",
           (long long)skipped.steps, (long long)skipped.ignored_steps, skipped.first_loss, skipped.last_loss,
           later.first_loss, later.last_loss, skipped.params_hash == later.params_hash);
    FILE *f = fopen(mlog, "r");
    char line[2048];
    int lines = 0, first_null = 0, val_null = 0;
    while (f && fgets(line, sizeof line, f)) {
      if (lines == 0) first_null = strstr(line, "\"loss\":null") && strstr(line, "\"skipped\":\"every target ignored\"");
      val_null = strstr(line, "\"val_loss\":null") != NULL;
      lines++;
    }
    if (f) fclose(f);
    CHECKF(lines == 4 && first_null && val_null && isnan(skipped.val_loss),
           "the log of a run with an ignored step: %d lines, first %s, validation %s", lines,
           first_null ? "null" : "not null", val_null ? "null" : "not null");
    m.log_path = NULL;
    m.val_data = NULL;
    m.val_every = 0;
    m.save = mck;
    m.save_every = 1;
    m.stop_after = 1;  // a checkpoint after the ignored step alone
    CHECK_OK(fy_train(&m, &resumed));
    CHECK(resumed.steps == 1 && resumed.ignored_steps == 1 && resumed.checkpoints == 1);
    m.stop_after = 0;
    m.resume = mck;
    CHECK_OK(fy_train(&m, &resumed));
    CHECKF(resumed.params_hash == later.params_hash, "resumed after the ignored step: other weights");
  }

  // fy_sample on the trained model: reproducible from the seed, another seed draws another
  // continuation, top-k 1 and a tiny top-p are greedy (temperature 0), top-k 5 and top-p 0.5 draw
  // only tokens among the 5 (and the half) most likely, the prompt comes back first, and a stop
  // token ends it.
  {
    struct fy_train_opts so = tiny_opts(shard);
    so.init = save;
    so.model = NULL;
    const int32_t prompt[3] = {3, 5, 13};
    int32_t a[23], b[23], c[23], g[23], k1[23], p1[23], ks[23], ps[23];
    int64_t na, nb, nc, ng, nk1, np1, nks, nps;
    struct fy_sample_opts sp = {.prompt = prompt, .n_prompt = 3, .n_new = 20, .temperature = 1.0f};
    CHECK_OK(fy_sample(&so, &sp, a, &na));
    CHECK_OK(fy_sample(&so, &sp, b, &nb));
    so.seed += 1;
    CHECK_OK(fy_sample(&so, &sp, c, &nc));
    sp.temperature = 0;
    CHECK_OK(fy_sample(&so, &sp, g, &ng));
    sp.temperature = 1.0f;
    sp.top_k = 1;
    CHECK_OK(fy_sample(&so, &sp, k1, &nk1));
    sp.top_k = 0, sp.top_p = 1e-6f;
    CHECK_OK(fy_sample(&so, &sp, p1, &np1));
    sp.temperature = 3.0f, sp.top_p = 0, sp.top_k = 5;  // (a high temperature: every token likely)
    CHECK_OK(fy_sample(&so, &sp, ks, &nks));
    sp.top_k = 0, sp.top_p = 0.5f;
    CHECK_OK(fy_sample(&so, &sp, ps, &nps));
    CHECK(na == 23 && nb == 23 && nc == 23 && ng == 23 && nk1 == 23 && np1 == 23 && nks == 23 && nps == 23);
    int in_vocab = 1;
    for (int i = 0; i < 23; i++) in_vocab &= a[i] >= 0 && a[i] < 97;
    CHECK(memcmp(a, b, sizeof a) == 0 && memcmp(a, c, sizeof a) != 0 && memcmp(g, k1, sizeof g) == 0 && in_vocab &&
          a[0] == 3 && a[1] == 5 && a[2] == 13);
    CHECK(memcmp(g, p1, sizeof g) == 0);
    // Each token drawn with top-k 5 is among the 5 largest logits after the tokens before it, and
    // with top-p 0.5 among the fewest largest whose probabilities (at temperature 3) reach 0.5:
    // checked against a full forward of each continuation.
    struct fy_opt_config scfg;
    CHECK_OK(fy_opt_config_read(save, &scfg));
    struct fy_device *cpu;
    CHECK_OK(fy_device_cpu_create(0, &cpu));
    struct fy_model *fm;
    CHECK_OK(fy_model_create(&scfg, 1, 22, cpu, &fm));
    CHECK_OK(fy_model_load(fm, save));
    for (int which = 0; which < 2; which++) {
      const int32_t *seq = which ? ps : ks;
      int32_t in[22], tg[22];
      for (int t = 0; t < 22; t++) in[t] = seq[t], tg[t] = -100;
      struct fy_batch fb = {.B = 1, .T = 22, .inputs = in, .targets = tg};
      struct fy_loss fl;
      CHECK_OK(fy_engine_forward_eval(fm, &fb, &fl));
      const float *lg = fy_engine_act(fm, fm->graph->logits_slot);
      int worst_rank = 0, outside = 0;
      for (int t = 2; t < 22; t++) {  // the token at t + 1 was drawn from the logits at t
        const float *row = lg + (int64_t)t * scfg.vocab_size, drawn = row[seq[t + 1]];
        double mx = -INFINITY, sum = 0, above = 0;
        int rank = 0;
        for (int64_t v = 0; v < scfg.vocab_size; v++) mx = fmax(mx, row[v]);
        for (int64_t v = 0; v < scfg.vocab_size; v++) {
          sum += exp((row[v] - mx) / 3.0);
          if (row[v] > drawn) above += exp((row[v] - mx) / 3.0), rank++;
        }
        worst_rank = rank > worst_rank ? rank : worst_rank;
        outside += above >= 0.5 * sum * (1 + 1e-4);  // the tokens before it already held half
      }
      if (which == 0) CHECKF(worst_rank < 5, "top-k 5 drew a token of rank %d", worst_rank + 1);
      else CHECKF(outside == 0, "top-p 0.5 drew %d tokens outside the nucleus", outside);
    }
    fy_model_free(fm);
    fy_device_free(cpu);
    // A stop token ends the continuation (kept as its last); -1 stops at the config's eos.
    const int32_t stop = a[7];
    sp = (struct fy_sample_opts){.prompt = prompt, .n_prompt = 3, .n_new = 20, .temperature = 1.0f,
                                 .stop = &stop, .n_stop = 1};
    so.seed -= 1;
    CHECK_OK(fy_sample(&so, &sp, b, &nb));
    int64_t first = 3;
    while (a[first] != stop) first++;
    CHECKF(nb == first + 1 && memcmp(a, b, (size_t)nb * 4) == 0, "stopped after %lld tokens, not %lld",
           (long long)nb, (long long)first + 1);
    sp.n_stop = -1;
    CHECK_OK(fy_sample(&so, &sp, b, &nb));
    int64_t eos = 3;
    while (eos < 23 && a[eos] != scfg.eos_token_id) eos++;
    CHECK(nb == (eos < 23 ? eos + 1 : 23) && memcmp(a, b, (size_t)nb * 4) == 0);
    const int32_t bad = 97;
    sp.stop = &bad, sp.n_stop = 1;
    CHECK_ERR(fy_sample(&so, &sp, b, &nb), FY_ERR_INVALID);
    sp.n_stop = 0, sp.top_p = 1.5f;
    CHECK_ERR(fy_sample(&so, &sp, b, &nb), FY_ERR_INVALID);
    sp.top_p = 0, sp.n_prompt = 0;
    CHECK_ERR(fy_sample(&so, &sp, a, &na), FY_ERR_INVALID);
  }

  // The learning-rate schedules: a warmup from lr/warmup to lr, then cosine or linear down to
  // min_lr at the last step, or constant; an unknown one is refused.
  {
    struct fy_train_opts s = tiny_opts(shard);
    s.steps = 11;
    s.warmup = 2;
    s.lr = 1.0f;
    s.min_lr = 0.1f;
    const float warm0 = fy_lr_at(&s, 0), warm1 = fy_lr_at(&s, 1);
    CHECK(warm0 == 0.5f && warm1 == 1.0f);
    CHECK(fy_lr_at(&s, 2) == 1.0f && fabsf(fy_lr_at(&s, 10) - 0.1f) < 1e-6f);
    CHECKF(fabsf(fy_lr_at(&s, 6) - 0.55f) < 1e-6f, "cosine halfway %g", fy_lr_at(&s, 6));  // (cos 90 degrees)
    CHECK(fy_lr_at(&s, 4) > 0.55f + 0.5f * 0.45f);  // a cosine lies above the line early on
    s.schedule = "linear";
    CHECK(fy_lr_at(&s, 0) == warm0 && fy_lr_at(&s, 2) == 1.0f && fabsf(fy_lr_at(&s, 10) - 0.1f) < 1e-6f);
    CHECKF(fabsf(fy_lr_at(&s, 4) - (0.1f + 0.75f * 0.9f)) < 1e-6f, "linear at a quarter %g", fy_lr_at(&s, 4));
    s.schedule = "constant";
    CHECK(fy_lr_at(&s, 0) == warm0 && fy_lr_at(&s, 5) == 1.0f && fy_lr_at(&s, 10) == 1.0f);
    s.schedule = "step";
    struct fy_train_result rs;
    CHECK_ERR(fy_train(&s, &rs), FY_ERR_INVALID);
    // AdamW's hyper-parameters through the library too (eps 0: NaN where a gradient is zero).
    s.schedule = NULL;
    s.adamw.eps = 0;
    CHECK_ERR(fy_train(&s, &rs), FY_ERR_INVALID);
    s.adamw.eps = 1e-8f;
    s.adamw.beta2 = 1.0f;
    CHECK_ERR(fy_train(&s, &rs), FY_ERR_INVALID);
  }

  // Validation (--val-data): every val_every steps and after the last; forward passes without
  // dropout, so the last one is ferry eval's loss of the saved model, bit for bit; training is
  // the same with or without it; a validation set that is not one, or --val-every alone, is refused.
  {
    char val_shard[600], vsave[600];
    snprintf(val_shard, sizeof val_shard, "%s/val.bin", tmpdir);
    snprintf(vsave, sizeof vsave, "%s/val_model", tmpdir);
    write_pattern_shard(val_shard, 3000, 97);  // (the same rule as the training stream: learnt)
    struct fy_train_opts v = tiny_opts(shard);
    v.steps = 7;
    v.dropout = 0.2f;
    struct fy_train_result plain, with_val;
    CHECK_OK(fy_train(&v, &plain));
    CHECK(isnan(plain.val_loss) && plain.validations == 0);
    v.val_data = val_shard;
    v.val_every = 3;
    v.val_batches = 4;
    v.save = vsave;
    CHECK_OK(fy_train(&v, &with_val));
    CHECKF(with_val.validations == 3 && with_val.params_hash == plain.params_hash && with_val.last_loss == plain.last_loss,
           "validation: %d runs (want 3: steps 3, 6, 7); training %s", with_val.validations,
           with_val.params_hash == plain.params_hash ? "unchanged" : "changed by it");
    struct fy_train_opts e = tiny_opts(val_shard);
    e.init = vsave;
    e.eval_batches = 4;
    double ev = 0;
    CHECK_OK(fy_eval(&e, &ev));
    CHECKF(ev == with_val.val_loss && ev < 0.9 * log(97.0), "validation %.9g, ferry eval of the saved model %.9g",
           with_val.val_loss, ev);
    v.save = NULL;
    v.val_data = "/nonexistent/val.bin";
    CHECKF(fy_train(&v, &with_val) != FY_OK && strstr(fy_error_msg(), "--val-data"), "a missing validation set: %s",
           fy_error_msg());
    v.val_data = NULL;
    CHECK_ERR(fy_train(&v, &with_val), FY_ERR_INVALID);  // --val-every without --val-data
  }

  // Dynamic loss scaling: without overflow, bit for bit the numbers of no scaling (the scale is a
  // power of two); with a scale that overflows, steps are skipped and the scale halved until the
  // gradients fit, and training goes on.
  struct fy_train_opts ls = tiny_opts(shard);
  ls.steps = 8;
  struct fy_train_result r_plain, r_scaled, r_over;
  CHECK_OK(fy_train(&ls, &r_plain));
  ls.loss_scale = 65536;
  CHECK_OK(fy_train(&ls, &r_scaled));
  CHECKF(r_scaled.params_hash == r_plain.params_hash && r_scaled.skipped_steps == 0, "scaled run differs");
  ls.loss_scale = 0x1p140;  // the loss gradient itself is past fp32's range
  ls.steps = 40;
  CHECK_OK(fy_train(&ls, &r_over));
  CHECKF(r_over.skipped_steps > 0 && r_over.final_loss_scale < 0x1p140 && r_over.last_loss < r_over.first_loss,
         "overflow: %lld skipped, scale %g, loss %f -> %f", (long long)r_over.skipped_steps, r_over.final_loss_scale,
         r_over.first_loss, r_over.last_loss);
  ls.loss_scale = 3;
  CHECK_ERR(fy_train(&ls, &r_over), FY_ERR_INVALID);  // not a power of two

  // 16-bit numerics (--precision): bf16 and fp16 follow fp32 within their rounding (and differ
  // from it: the rounding is real). fp16's gradients overflow at a large loss scale: steps are
  // skipped and the scale comes down to where they fit (2^24 -> ~2^16 here), then training goes on.
  struct fy_train_opts hp = tiny_opts(shard);
  hp.steps = 30;
  struct fy_train_result r32, r_bf16, r_fp16, r_f16over;
  CHECK_OK(fy_train(&hp, &r32));
  hp.precision = "bf16";
  CHECK_OK(fy_train(&hp, &r_bf16));
  hp.precision = "fp16";
  CHECK_OK(fy_train(&hp, &r_fp16));
  hp.loss_scale = 0x1p24;
  CHECK_OK(fy_train(&hp, &r_f16over));
  fprintf(stderr, "  last loss: fp32 %.5f, bf16 %.5f, fp16 %.5f (scale %g), fp16 from 2^24 %.5f (%lld skipped, scale %g)\n",
          r32.last_loss, r_bf16.last_loss, r_fp16.last_loss, r_fp16.final_loss_scale, r_f16over.last_loss,
          (long long)r_f16over.skipped_steps, r_f16over.final_loss_scale);
  CHECK(fabs(r_bf16.last_loss - r32.last_loss) < 0.02 * r32.last_loss && r_bf16.params_hash != r32.params_hash);
  CHECK(fabs(r_fp16.last_loss - r32.last_loss) < 0.01 * r32.last_loss && r_fp16.params_hash != r32.params_hash);
  CHECK(r_fp16.skipped_steps == 0 && r_fp16.final_loss_scale == 65536);
  CHECKF(r_f16over.skipped_steps > 0 && r_f16over.final_loss_scale < 0x1p24 && r_f16over.last_loss < r_f16over.first_loss,
         "fp16 overflow: %lld skipped, scale %g", (long long)r_f16over.skipped_steps, r_f16over.final_loss_scale);
  hp.precision = "fp8";  // (16-bit on sim: test_offload)
  CHECK_ERR(fy_train(&hp, &r_fp16), FY_ERR_INVALID);
  struct fy_loss_scaler sc = fy_loss_scaler_init(4);
  CHECK_OK(fy_loss_scaler_update(&sc, true));
  CHECK_OK(fy_loss_scaler_update(&sc, true));
  CHECK(sc.scale == 1);
  CHECK_ERR(fy_loss_scaler_update(&sc, true), FY_ERR_NUMERIC);  // overflow at the minimum
  sc = fy_loss_scaler_init(8);
  sc.growth_interval = 3;
  for (int i = 0; i < 3; i++) CHECK_OK(fy_loss_scaler_update(&sc, false));
  CHECK(sc.scale == 16 && sc.good == 0);

  // The checkpoint round-trips: loading it gives the trained weights back bit for bit, and
  // a bf16, sharded save loads back within bf16 rounding.
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_config_read(save, &cfg));
  CHECK(cfg.hidden_size == 32 && cfg.vocab_size == 97);
  struct fy_device *dev;
  CHECK_OK(fy_device_cpu_create(0, &dev));
  struct fy_model *m1, *m2;
  // Decoding against the cache of keys and values (ferry sample), with a model built for 3 tokens,
  // gives the logits a full forward gives each position: a token at a time, and in runs of 3, 1,
  // 2 and 2 (the prompt's way); the trained model, and a post-LN one with the embeddings projected
  // (opt-350m's shape) and gelu.
  for (int variant = 0; variant < 2; variant++) {
    struct fy_opt_config dc = cfg;
    if (variant == 1) dc.do_layer_norm_before = false, dc.word_embed_proj_dim = 16, dc.activation = FY_ACT_GELU;
    const int64_t T = 8, V = dc.vocab_size;
    struct fy_model *full, *part;
    CHECK_OK(fy_model_create(&dc, 1, T, dev, &full));
    CHECK_OK(fy_model_create(&dc, 1, 3, dev, &part));
    if (variant == 0) {
      CHECK_OK(fy_model_load(full, save));
      CHECK_OK(fy_model_load(part, save));
    } else {
      fy_model_init_random(full, 11);
      fy_model_init_random(part, 11);
    }
    int32_t toks[8] = {5, 17, 3, 96, 40, 40, 1, 60}, tg[8];
    for (int t = 0; t < T; t++) tg[t] = -100;
    struct fy_batch fb = {.B = 1, .T = T, .inputs = toks, .targets = tg};
    struct fy_loss fl;
    CHECK_OK(fy_engine_forward_eval(full, &fb, &fl));
    const float *want = fy_engine_act(full, full->graph->logits_slot);
    struct fy_kv_cache *kv = NULL;
    CHECK_OK(fy_kv_cache_create(part, T, &kv));
    double worst = 0;
    float first[128];
    const float *lg;
    for (int t = 0; t < T; t++) {
      CHECK_OK(fy_engine_decode(part, kv, &toks[t], 1, &lg));
      if (t == 0) memcpy(first, lg, (size_t)(V < 128 ? V : 128) * 4);
      for (int64_t v = 0; v < V; v++) worst = fmax(worst, fabs((double)lg[v] - want[t * V + v]));
    }
    CHECKF(worst < 1e-4, "variant %d: decoded logits vs the full forward's: %g", variant, worst);
    CHECK_ERR(fy_engine_decode(part, kv, toks, 1, &lg), FY_ERR_INVALID);  // full
    fy_kv_cache_reset(kv);
    CHECK(fy_kv_cache_len(kv) == 0);
    worst = 0;
    const int runs[] = {3, 1, 2, 2};
    for (int t = 0, r = 0; t < T; t += runs[r++]) {
      CHECK_OK(fy_engine_decode(part, kv, &toks[t], runs[r], &lg));
      const int64_t last = t + runs[r] - 1;  // the logits after the run's last token
      for (int64_t v = 0; v < V; v++) worst = fmax(worst, fabs((double)lg[v] - want[last * V + v]));
    }
    CHECK(fy_kv_cache_len(kv) == T);
    CHECKF(worst < 1e-4, "variant %d: logits decoded in runs vs the full forward's: %g", variant, worst);
    fy_kv_cache_reset(kv);
    CHECK_OK(fy_engine_decode(part, kv, toks, 1, &lg));  // position 0 again: the same logits
    CHECK(memcmp(first, lg, (size_t)(V < 128 ? V : 128) * 4) == 0);
    const int32_t bad = (int32_t)V;
    CHECK_ERR(fy_engine_decode(part, kv, &bad, 1, &lg), FY_ERR_INVALID);    // outside the vocabulary
    CHECK_ERR(fy_engine_decode(part, kv, toks, 4, &lg), FY_ERR_INVALID);    // more than it was built for
    CHECK_ERR(fy_engine_decode(part, kv, toks, 0, &lg), FY_ERR_INVALID);
    CHECK_OK(fy_engine_decode(part, kv, toks, 3, &lg));
    CHECK_OK(fy_engine_decode(part, kv, toks, 3, &lg));
    CHECK_ERR(fy_engine_decode(part, kv, toks, 3, &lg), FY_ERR_INVALID);    // 7 + 3 past the cache's 8
    CHECK(fy_kv_cache_len(kv) == 7);  // (1 + 3 + 3: the refused run left it as it was)
    fy_kv_cache_free(kv);
    fy_model_free(full);
    fy_model_free(part);
    kv = NULL;
    CHECK_OK(fy_model_create(&dc, 2, 3, dev, &part));
    CHECK_ERR(fy_kv_cache_create(part, T, &kv), FY_ERR_INVALID);  // built for 2 sequences, not one
    fy_model_free(part);
  }
  CHECK_OK(fy_model_create(&cfg, 2, 8, dev, &m1));
  CHECK_OK(fy_model_create(&cfg, 2, 8, dev, &m2));
  CHECK_OK(fy_model_load(m1, save));
  CHECK_OK(fy_model_save(m1, save2, FY_BF16, 20000));
  CHECK(access(save2, F_OK) == 0);
  snprintf(cmd, sizeof cmd, "%s/model.safetensors.index.json", save2);
  CHECKF(access(cmd, F_OK) == 0, "a small shard size writes an index");
  CHECK_OK(fy_model_load(m2, save2));
  double err = check_rel_err(m2->params, m1->params, m1->graph->n_param_elems);
  CHECKF(err > 0 && err < 4e-3, "bf16 round trip error %g", err);
  fy_model_init_random(m2, 7);
  CHECK(memcmp(m1->params, m2->params, (size_t)m1->graph->n_param_elems * 4) != 0);
  CHECK_OK(fy_model_load(m2, save));
  CHECK(memcmp(m1->params, m2->params, (size_t)m1->graph->n_param_elems * 4) == 0);
  // Part by part (a sharded rank's way), at odd boundaries: the same values as the whole, from
  // initialisation (m2 initialised whole) and from the files (m1 loaded whole).
  {
    int64_t n = m1->graph->n_param_elems, cuts[] = {0, 1, 7, 333, 1024, 4097, n / 2 + 1, n - 3, n};
    float *init = malloc((size_t)n * 4), *load = malloc((size_t)n * 4);
    CHECK(init && load);
    fy_model_init_random(m2, 7);
    struct fy_model_source *si = NULL, *sl = NULL;
    CHECK_OK(fy_model_source_open(m2, NULL, 7, &si));
    CHECK_OK(fy_model_source_open(m1, save, 0, &sl));
    for (int k = 0; si && sl && init && load && k + 1 < (int)(sizeof cuts / sizeof *cuts); k++) {
      fy_model_source_fill(si, cuts[k], cuts[k + 1], init + cuts[k]);
      fy_model_source_fill(sl, cuts[k], cuts[k + 1], load + cuts[k]);
    }
    fy_model_source_close(si);
    fy_model_source_close(sl);
    CHECK(init && memcmp(init, m2->params, (size_t)n * 4) == 0);
    CHECK(load && memcmp(load, m1->params, (size_t)n * 4) == 0);
    free(init);
    free(load);
  }

  // Eval of the saved model on the same data gives a loss near the last training loss.
  struct fy_train_opts e = tiny_opts(shard);
  e.model = NULL;
  e.init = save;
  e.eval_batches = 4;
  double eval_loss = 0;
  CHECK_OK(fy_eval(&e, &eval_loss));
  CHECKF(eval_loss < 0.8 * r1.first_loss, "eval loss %f", eval_loss);

  // Bad input.
  uint16_t big[100];
  for (int i = 0; i < 100; i++) big[i] = (uint16_t)(i == 50 ? 500 : i % 90);
  CHECK_OK(fy_shard_write(bad_shard, big, 100));
  struct fy_train_opts b = tiny_opts(bad_shard);
  b.seq = 8;
  CHECK_ERR(fy_train(&b, &r2), FY_ERR_INVALID);  // token 500 >= vocab 97
  b = tiny_opts(shard);
  b.seq = 65;
  CHECK_ERR(fy_train(&b, &r2), FY_ERR_INVALID);  // longer than max_position_embeddings 64
  b = tiny_opts(shard);
  b.model = "/nonexistent/model";
  CHECK_ERR(fy_train(&b, &r2), FY_ERR_NOT_FOUND);
  b = tiny_opts(shard);
  b.init = "/nonexistent/ckpt";
  CHECK(fy_train(&b, &r2) != FY_OK);
  b = tiny_opts(shard);
  b.model = "opt-demo";  // a config whose shapes differ from the checkpoint's
  b.init = save;
  CHECK_ERR(fy_train(&b, &r2), FY_ERR_INVALID);

  // A checkpoint missing a tensor.
  fy_safetensors *st;
  snprintf(cmd, sizeof cmd, "%s/model.safetensors", save);
  CHECK_OK(fy_safetensors_open(cmd, &st));
  int n = fy_safetensors_count(st);
  struct fy_st_tensor *keep = calloc((size_t)n, sizeof *keep);
  int k = 0;
  for (int i = 0; i < n; i++) {
    const struct fy_st_tensor *t = fy_safetensors_at(st, i);
    if (strcmp(t->name, "model.decoder.layers.1.fc2.bias") != 0) keep[k++] = *t;
  }
  char partial[512];
  snprintf(partial, sizeof partial, "%s/partial", tmpdir);
  snprintf(cmd, sizeof cmd, "mkdir -p %s && cp %s/config.json %s/", partial, save, partial);
  CHECK(system(cmd) == 0);
  snprintf(cmd, sizeof cmd, "%s/model.safetensors", partial);
  CHECK_OK(fy_safetensors_write(cmd, keep, k, NULL));
  fy_safetensors_close(st);
  free(keep);
  CHECK_ERR(fy_model_load(m2, partial), FY_ERR_NOT_FOUND);

  fy_model_free(m1);
  fy_model_free(m2);
  fy_device_free(dev);
  fy_matmul_cache_clear();

  // Ranks' threads (fy_rank_threads: local ranks, online cores, the cores a rank may run on).
  {
    struct { int local, online, mine, want; bool cramped; } cases[] = {
        {2, 16, 16, 8, false},  // unbound (--bind-to none): half each
        {3, 2, 2, 1, false},    // more ranks than cores: one each, never 0
        {2, 16, 1, 1, true},    // mpirun's core each for 2 ranks: said to be cramped
        {4, 16, 8, 4, false},   // a socket of 8 cores each, 2 ranks to a socket
        {2, 16, 8, 8, false},   // bound to half the machine each: as bound
        {1, 16, 16, 16, false}, {2, 3, 3, 1, false}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
      bool cramped = !cases[i].cramped;
      int n = fy_rank_threads(cases[i].local, cases[i].online, cases[i].mine, &cramped);
      CHECKF(n == cases[i].want && cramped == cases[i].cramped, "%d ranks, %d cores, %d allowed: %d threads%s",
             cases[i].local, cases[i].online, cases[i].mine, n, cramped ? " (cramped)" : "");
    }
  }
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
  CHECK(system(cmd) == 0);
  return check_summary("train");
}
