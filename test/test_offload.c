// Chunked heterogeneous memory on the sim device (docs/design.md, "Chunks", "Tiers"): the placement
// changes speed and memory, never the numbers. A small model is trained for 20 steps in many
// placements; the losses and the final parameters must be bit-identical to the resident cpu run,
// and the sim device's own counter must never pass its cap.
// usage: test_offload                 (the plain run)
//        test_offload --part timing   (prefetch overlaps transfers with compute, timed)
#include <math.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "core/device.h"
#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/data.h"
#include "runtime/trainer.h"

static char dir[256], model_dir[300], shard[300], disk_dir[300];

static struct fy_train_opts base(void) {
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  o.hash_params = true;  // runs are compared bit for bit
  o.model = model_dir;
  o.data = shard;
  o.batch = 2;
  o.seq = 16;
  o.steps = 20;
  o.lr = 3e-3f;
  o.warmup = 2;
  o.quiet = true;
  o.seed = 7;
  return o;
}

// Runs `o` and checks it against the reference run bit for bit.
static void same_as(const char *what, struct fy_train_opts o, const struct fy_train_result *ref) {
  struct fy_train_result r;
  fy_status st = fy_train(&o, &r);
  CHECKF(st == FY_OK, "%s: %s", what, fy_error_msg());
  if (st != FY_OK) return;
  CHECKF(r.first_loss == ref->first_loss && r.last_loss == ref->last_loss, "%s: losses %.9g %.9g, reference %.9g %.9g",
         what, r.first_loss, r.last_loss, ref->first_loss, ref->last_loss);
  CHECKF(r.params_hash == ref->params_hash, "%s: the parameters differ from the reference", what);
  if (o.device && strcmp(o.device, "sim") == 0)
    CHECKF(r.device_peak_bytes <= (double)o.device_mem, "%s: device peak %.0f over the cap %zu", what,
           r.device_peak_bytes, o.device_mem);
  fprintf(stderr, "  %-44s blocks %d/%d chunks, disk chunks %d, device peak %.0f KiB, loads %lld "
          "(prefetched %lld), evictions %lld, spills %lld\n", what, r.n_blocks, r.n_chunks, r.n_disk_chunks,
          r.device_peak_bytes / 1024, (long long)r.cache_loads, (long long)r.cache_prefetches,
          (long long)r.cache_evictions, (long long)r.cache_spills);
  if (o.blocks == 1) CHECKF(r.cache_spills > 0 && r.cache_evictions > 0, "%s: 1 block must evict and spill", what);
  if (o.blocks == 2) CHECKF(r.cache_evictions > 0, "%s: 2 blocks must evict", what);
}

// Prefetch on a throttled link, a model wide enough that compute and transfers weigh alike: the
// same bits resident, on demand and prefetched (plain run, 2 steps each); and, the timing part
// (`--part timing`, meson suite "timing"), prefetch overlaps the transfers with compute: a step
// with prefetch takes clearly less than its compute time plus its transfer time, both measured
// here, on the same attempt, up to 3 attempts on a shared machine.
static void prefetch_overlap(struct fy_opt_config cfg, bool timing) {
  cfg.hidden_size = 192;
  cfg.ffn_dim = 768;
  cfg.num_attention_heads = 4;
  cfg.max_position_embeddings = 128;
  CHECK_OK(fy_opt_config_write(model_dir, &cfg));
  struct fy_train_opts ov = base();
  ov.device = "sim";
  ov.device_mem = 64 << 20;
  ov.chunk_mib = 1.2;
  ov.batch = 4;
  ov.seq = 96;
  ov.steps = timing ? 6 : 2;
  ov.disk_dir = NULL;
  ov.disk_chunks = 0;
  bool overlapped = false;
  for (int attempt = 0; attempt < (timing ? 3 : 1) && !overlapped; attempt++) {
    struct fy_train_result compute, slow, fast;
    ov.blocks = 0;
    ov.sim_link_gbps = 0;
    ov.prefetch = 2;
    CHECK_OK(fy_train(&ov, &compute));  // unthrottled, everything resident: compute alone
    ov.blocks = 3;
    ov.sim_link_gbps = 0.4;
    ov.prefetch = 0;
    CHECK_OK(fy_train(&ov, &slow));     // on demand: transfers add to the step
    ov.prefetch = 2;
    CHECK_OK(fy_train(&ov, &fast));     // prefetch: transfers hide behind compute
    double per_step = (fast.copy_busy_s[0] + fast.copy_busy_s[1]) / ov.steps;
    fprintf(stderr, "  overlap: compute %.1f ms, transfers %.1f ms/step (%.1f MB in, %.1f MB out); "
            "on demand %.1f ms, prefetch %.1f ms\n", compute.step_s * 1e3, per_step * 1e3,
            fast.copy_bytes[0] / ov.steps / 1e6, fast.copy_bytes[1] / ov.steps / 1e6, slow.step_s * 1e3,
            fast.step_s * 1e3);
    if (!timing) {
      CHECK(fast.params_hash == slow.params_hash && slow.params_hash == compute.params_hash);
      CHECK(fast.n_blocks == 3 && fast.copy_bytes[0] > 0 && fast.copy_bytes[1] > 0);
    }
    overlapped = fast.step_s < 0.85 * (compute.step_s + per_step) && fast.step_s < slow.step_s;
  }
  if (timing) CHECKF(overlapped, "a step with prefetch was not clearly shorter than compute plus transfers");
}

int main(int argc, char **argv) {
  check_args(argc, argv);
  snprintf(dir, sizeof dir, "/tmp/ferry_offload_XXXXXX");
  if (!mkdtemp(dir)) return 1;
  snprintf(model_dir, sizeof model_dir, "%s/model", dir);
  snprintf(shard, sizeof shard, "%s/data.bin", dir);
  snprintf(disk_dir, sizeof disk_dir, "%s/disk", dir);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "mkdir -p %s %s", model_dir, disk_dir);
  CHECK(system(cmd) == 0);
  // A 4-layer model: several chunks of a few layers each.
  struct fy_opt_config cfg;
  fy_opt_preset("opt-tiny", &cfg);
  cfg.num_hidden_layers = 4;
  CHECK_OK(fy_opt_config_write(model_dir, &cfg));
  uint16_t *tok = malloc(30000 * sizeof *tok);
  for (int i = 0; i < 30000; i++) tok[i] = (uint16_t)((i * 31 + (i / 7) * 3) % 97);
  CHECK_OK(fy_shard_write(shard, tok, 30000));
  free(tok);
  if (check_part("timing")) prefetch_overlap(cfg, true);
  if (!check_plain()) {
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    return check_summary("offload");
  }

  struct fy_train_result ref;
  struct fy_train_opts o = base();
  CHECK_OK(fy_train(&o, &ref));
  CHECKF(ref.last_loss < ref.first_loss, "the reference run learns: %f -> %f", ref.first_loss, ref.last_loss);

  // The sim placements: chunks of about one layer (the token embedding is the largest group).
  struct fy_train_opts s = base();
  s.device = "sim";
  s.device_mem = 8 << 20;
  s.chunk_mib = 0.05;
  same_as("sim, everything resident", s, &ref);
  s.blocks = 2;  // fewer blocks than chunks: eviction every step
  for (int p = 0; p <= 4; p++) {
    if (p == 2 || p == 3) continue;
    s.prefetch = p;
    snprintf(cmd, sizeof cmd, "sim, 2 blocks (eviction), prefetch %d", p);
    same_as(cmd, s, &ref);
  }
  s.blocks = 1;  // the tied embedding is spilled to the host during backward
  s.prefetch = 2;
  same_as("sim, 1 block (spills), prefetch 2", s, &ref);
  s.blocks = 3;
  same_as("sim, 3 blocks, prefetch 2", s, &ref);
  // Evaluation through the chunk cache (forward passes alone, no gradients or AdamW state): the
  // resident cpu's mean loss bit for bit, with every chunk resident, with 2 blocks (eviction), with
  // recomputation; and in bf16 the cpu's bf16 loss.
  {
    struct fy_train_opts e = base();
    e.eval_batches = 5;
    double cpu = 0, cpu16 = 0, got = -1;
    CHECK_OK(fy_eval(&e, &cpu));
    e.precision = "bf16";
    CHECK_OK(fy_eval(&e, &cpu16));
    e.precision = NULL;
    e.device = "sim";
    e.device_mem = 8 << 20;
    e.chunk_mib = 0.05;
    const char *what[] = {"every chunk resident", "2 blocks", "2 blocks, recompute", "2 blocks, bf16"};
    for (int k = 0; k < 4; k++) {
      e.blocks = k ? 2 : 0;
      e.recompute = k == 2;
      e.precision = k == 3 ? "bf16" : NULL;
      fy_status st = fy_eval(&e, &got);
      CHECKF(st == FY_OK && got == (k == 3 ? cpu16 : cpu), "eval on sim, %s: %.9g (%s), cpu %.9g", what[k], got,
             st == FY_OK ? "ok" : fy_error_msg(), k == 3 ? cpu16 : cpu);
    }
    CHECK(cpu16 != cpu);
  }
  s.loss_scale = 65536;  // exact: a power of two, no overflow
  same_as("sim, 3 blocks, dynamic loss scaling", s, &ref);
  s.loss_scale = 0;
  s.disk_dir = disk_dir;
  s.disk_chunks = 1000;
  same_as("sim, 3 blocks, AdamW state on disk", s, &ref);
  s.sim_jitter_us = 300;
  same_as("sim, jitter, AdamW state on disk", s, &ref);
  s.sim_jitter_us = 0;
  s.disk_chunks = 2;
  same_as("sim, 3 blocks, AdamW state of 2 chunks on disk", s, &ref);
  s.disk_chunks = 1;
  s.device_chunks = 2;
  same_as("sim, 2 chunks updated on the device, 1 on disk", s, &ref);
  // A loss scale: the device chunks take the unscaling factor (and the skip flag) from device
  // memory, where it is copied after the norm; with jitter every stream's order is tested.
  struct fy_train_result ref_scaled;
  o = base();
  o.loss_scale = 0x1p100f;
  CHECK_OK(fy_train(&o, &ref_scaled));
  s.loss_scale = 0x1p100f;
  s.sim_jitter_us = 200;
  same_as("sim, 2 chunks on the device, loss scale 2^100", s, &ref_scaled);
  s.loss_scale = 0;
  s.sim_jitter_us = 0;
  s.device_chunks = 0;
  s.disk_chunks = -1;
  s.disk_dir = NULL;
  // Stress: random delays before every work item of every stream (copies, kernels, optimizer).
  s.sim_jitter_us = 300;
  s.sim_link_gbps = 0.5;
  same_as("sim, jitter and a throttled link", s, &ref);
  s.blocks = 2;
  s.grad_accum = 2;
  s.batch = 1;
  struct fy_train_result ref_acc;
  o = base();
  o.grad_accum = 2;
  o.batch = 1;
  CHECK_OK(fy_train(&o, &ref_acc));
  same_as("sim, jitter, 2 blocks, 2 micro-batches", s, &ref_acc);
  s.device_chunks = 1;
  same_as("sim, jitter, 2 micro-batches, chunk 0 on the device", s, &ref_acc);
  s.device_chunks = 0;
  s.blocks = 3;
  s.grad_accum = 1;
  s.batch = 2;
  s.sim_jitter_us = 0;
  s.sim_link_gbps = 0;

  // Recomputation and gradient accumulation: each placement against its own cpu reference.
  struct fy_train_result ref2;
  o = base();
  o.recompute = true;
  o.grad_accum = 2;
  o.batch = 1;
  CHECK_OK(fy_train(&o, &ref2));
  s.recompute = true;
  s.grad_accum = 2;
  s.batch = 1;
  same_as("sim, recompute, 2 micro-batches", s, &ref2);
  s.device_chunks = 100;  // everything on the device, updated there
  same_as("sim, recompute, 2 micro-batches, all on the device", s, &ref2);
  s.device_chunks = 0;
  s.recompute = false;
  s.grad_accum = 1;
  s.batch = 2;

  // Dropout (ops/dropout.h): the masks follow the seed and the data, so each placement (eviction,
  // jitter on every stream, recomputation with 2 micro-batches) draws the cpu's, bit for bit.
  {
    struct fy_train_result ref_do, ref_do2;
    o = base();
    o.dropout = 0.2f;
    CHECK_OK(fy_train(&o, &ref_do));
    CHECKF(ref_do.last_loss != ref.last_loss && ref_do.last_loss < ref_do.first_loss, "dropout: %.9g -> %.9g (none: %.9g)",
           ref_do.first_loss, ref_do.last_loss, ref.last_loss);
    struct fy_train_opts d = s;
    d.dropout = 0.2f;
    d.blocks = 2;
    d.sim_jitter_us = 200;
    same_as("sim, dropout 0.2, 2 blocks, jitter", d, &ref_do);
    o.recompute = true;
    o.grad_accum = 2;
    o.batch = 1;
    CHECK_OK(fy_train(&o, &ref_do2));
    d.recompute = true;
    d.grad_accum = 2;
    d.batch = 1;
    same_as("sim, dropout 0.2, recompute, 2 micro-batches", d, &ref_do2);
  }

  // Validation between steps: a training engine runs the forward part of its pass (no dropout),
  // then the trace goes on where the next pass starts. Each placement (eviction, spills, jitter,
  // recomputation, bf16) gets the cpu's validation losses, and its training is what it was without.
  {
    struct fy_train_opts v = base();
    v.steps = 8;
    v.dropout = 0.1f;
    v.val_data = shard;
    v.val_every = 3;
    v.val_batches = 3;
    struct fy_train_result cpu_v, cpu_nov, got;
    CHECK_OK(fy_train(&v, &cpu_v));
    struct fy_train_opts nv = v;
    nv.val_data = NULL;
    nv.val_every = 0;
    CHECK_OK(fy_train(&nv, &cpu_nov));
    CHECK(cpu_v.validations == 3 && cpu_v.params_hash == cpu_nov.params_hash && !isnan(cpu_v.val_loss));
    const char *what[] = {"2 blocks, jitter", "1 block (spills)", "2 blocks, recompute", "2 blocks, bf16"};
    for (int k = 0; k < 4; k++) {
      struct fy_train_opts d = v;
      d.device = "sim";
      d.device_mem = 8 << 20;
      d.chunk_mib = 0.05;
      d.blocks = k == 1 ? 1 : 2;
      d.sim_jitter_us = k == 0 ? 200 : 0;
      d.recompute = k == 2;
      struct fy_train_result ref_k = cpu_v;
      if (k == 3) {  // against the cpu's own bf16 run
        struct fy_train_opts c16 = v;
        c16.precision = d.precision = "bf16";
        CHECK_OK(fy_train(&c16, &ref_k));
      }
      fy_status st = fy_train(&d, &got);
      CHECKF(st == FY_OK && got.val_loss == ref_k.val_loss && got.params_hash == ref_k.params_hash &&
                 got.validations == 3,
             "validation on sim, %s: %s, val loss %.9g (cpu %.9g), parameters %s", what[k],
             st == FY_OK ? "ok" : fy_error_msg(), got.val_loss, ref_k.val_loss,
             got.params_hash == ref_k.params_hash ? "the same" : "differ");
    }
  }

  // 16-bit compute: the blocks carry the weights in the compute dtype (a copy in the host tier that
  // every update refreshes from the fp32 master) and the kernels round as on the cpu, so every
  // placement equals the cpu's own 16-bit run bit for bit.
  struct fy_train_result ref16;
  o = base();
  o.precision = "bf16";
  CHECK_OK(fy_train(&o, &ref16));
  CHECKF(ref16.last_loss != ref.last_loss, "bf16 rounds: loss %.9g, fp32 %.9g", ref16.last_loss, ref.last_loss);
  s.precision = "bf16";
  s.blocks = 0;
  same_as("sim bf16, everything resident", s, &ref16);
  s.blocks = 2;
  s.prefetch = 2;
  same_as("sim bf16, 2 blocks (eviction), prefetch 2", s, &ref16);
  s.blocks = 1;
  same_as("sim bf16, 1 block (spills)", s, &ref16);
  s.blocks = 3;
  s.disk_dir = disk_dir;
  s.disk_chunks = 2;
  same_as("sim bf16, 3 blocks, 2 chunks' AdamW state on disk", s, &ref16);
  s.disk_chunks = 1000;  // (m and v read ahead and written behind the updates; every request delayed at random)
  s.sim_jitter_us = 300;
  same_as("sim bf16, jitter, every chunk's AdamW state on disk", s, &ref16);
  s.sim_jitter_us = 0;
  // Chunks kept on the device: their kernels read the 16-bit copy there, which their AdamW
  // (on the device) rewrites from the fp32 master.
  s.disk_chunks = 1;
  s.device_chunks = 2;
  same_as("sim bf16, 2 chunks on the device, 1 on disk", s, &ref16);
  s.disk_dir = NULL;
  s.disk_chunks = -1;
  s.device_chunks = 100;
  s.blocks = 0;
  same_as("sim bf16, every chunk on the device", s, &ref16);
  s.device_chunks = 0;
  s.blocks = 3;
  o.grad_accum = 2;
  o.batch = 1;
  CHECK_OK(fy_train(&o, &ref16));
  s.grad_accum = 2;
  s.batch = 1;
  s.blocks = 2;
  s.sim_jitter_us = 300;
  same_as("sim bf16, jitter, 2 blocks, 2 micro-batches", s, &ref16);
  s.device_chunks = 1;  // its gradients summed in fp32 on the device
  same_as("sim bf16, jitter, 2 micro-batches, chunk 0 on the device", s, &ref16);
  s.device_chunks = 0;
  s.sim_jitter_us = 0;
  s.grad_accum = 1;
  s.batch = 2;
  o = base();
  o.recompute = true;
  o.precision = "bf16";
  CHECK_OK(fy_train(&o, &ref16));
  s.recompute = true;
  same_as("sim bf16, recompute, 2 blocks", s, &ref16);
  s.recompute = false;
  // fp16 from a loss scale of 2^24: the first steps overflow and are skipped, and a skipped step
  // must leave the chunks' 16-bit weights as they were (the gradients came home over them).
  // The log stays JSON: an overflowing step's norm is null, and the step says why it was skipped.
  o = base();
  o.precision = "fp16";
  o.loss_scale = 0x1p24f;
  char log16[600];
  snprintf(log16, sizeof log16, "%s/fp16.jsonl", dir);
  o.log_path = log16;
  CHECK_OK(fy_train(&o, &ref16));
  CHECKF(ref16.skipped_steps > 0 && ref16.skipped_steps < o.steps, "fp16 from 2^24 skips some steps: %lld",
         (long long)ref16.skipped_steps);
  {
    FILE *f = fopen(log16, "r");
    char line[2048];
    int lines = 0, overflowed = 0, not_json = 0;
    while (f && fgets(line, sizeof line, f)) {
      lines++;
      overflowed += strstr(line, "\"grad_norm\":null") && strstr(line, "\"skipped\":\"gradient overflow\"");
      not_json += strstr(line, "inf") || strstr(line, "nan");
    }
    if (f) fclose(f);
    CHECKF(lines == o.steps && overflowed == ref16.skipped_steps && !not_json,
           "fp16 log: %d lines, %d overflows marked (want %lld), %d with inf or nan", lines, overflowed,
           (long long)ref16.skipped_steps, not_json);
  }
  o.log_path = NULL;
  s.precision = "fp16";
  s.loss_scale = 0x1p24f;
  same_as("sim fp16, loss scaling with skipped steps, 2 blocks", s, &ref16);
  s.device_chunks = 1;  // a skipped step leaves the device's 16-bit weights too
  same_as("sim fp16, skipped steps, chunk 0 on the device", s, &ref16);
  s.device_chunks = 0;
  s.disk_dir = disk_dir;  // (their gradients come home over the 16-bit copy, not to disk)
  s.disk_chunks = 2;
  same_as("sim fp16, skipped steps, 2 chunks' AdamW state on disk", s, &ref16);
  s.disk_dir = NULL;
  s.disk_chunks = -1;
  s.precision = NULL;
  s.loss_scale = 0;
  s.blocks = 3;

  // --optimizer-lag 1: each step's update runs under the next step, which uses the weights before
  // it. The cpu applies the update kept from the step before after each step's passes; the sim
  // swaps two 16-bit copies a chunk (and keeps the device chunks' gradients a step). Every
  // placement gives the cpu's bits, and the numbers differ from the exact step's.
  {
    struct fy_train_result lag16, exact16;
    o = base();
    o.precision = "bf16";
    CHECK_OK(fy_train(&o, &exact16));
    o.optimizer_lag = 1;
    CHECK_OK(fy_train(&o, &lag16));
    CHECKF(lag16.first_loss == exact16.first_loss && lag16.last_loss != exact16.last_loss &&
           lag16.params_hash != exact16.params_hash && lag16.last_loss < lag16.first_loss,
           "lag: the first step as the exact one's (%.9g, %.9g), then other numbers, still learning (%.9g -> %.9g; "
           "exact %.9g)", lag16.first_loss, exact16.first_loss, lag16.first_loss, lag16.last_loss, exact16.last_loss);
    struct fy_train_opts l = s;
    l.precision = "bf16";
    l.optimizer_lag = 1;
    l.blocks = 2;
    same_as("sim bf16 lag 1, 2 blocks, prefetch 2", l, &lag16);
    l.sim_jitter_us = 300;
    l.disk_dir = disk_dir;
    l.disk_chunks = 1000;
    same_as("sim bf16 lag 1, jitter, every chunk's state on disk", l, &lag16);
    l.disk_chunks = 1;
    l.device_chunks = 2;
    l.blocks = 3;
    same_as("sim bf16 lag 1, jitter, 2 chunks on the device, 1 on disk", l, &lag16);
    l.sim_jitter_us = 0;
    l.disk_dir = NULL;
    l.disk_chunks = -1;
    // A validation between steps reads the weights the next step reads, and changes nothing.
    char val[600];
    snprintf(val, sizeof val, "%s", shard);
    struct fy_train_result cpu_v, sim_v;
    o.val_data = l.val_data = val;
    o.val_every = l.val_every = 7;
    o.val_batches = l.val_batches = 2;
    CHECK_OK(fy_train(&o, &cpu_v));
    CHECKF(cpu_v.params_hash == lag16.params_hash && cpu_v.validations == 3, "lag: validation changes the run");
    CHECK_OK(fy_train(&l, &sim_v));
    CHECKF(sim_v.val_loss == cpu_v.val_loss && sim_v.params_hash == cpu_v.params_hash,
           "lag: sim validation %.9g, cpu %.9g", sim_v.val_loss, cpu_v.val_loss);
    o.val_data = l.val_data = NULL;
    o.val_every = l.val_every = 0;
    // fp16 with skipped steps: a skipped update is skipped a step late, its copy rebuilt.
    struct fy_train_result lag_fp16;
    o.precision = l.precision = "fp16";
    o.loss_scale = l.loss_scale = 0x1p24f;
    CHECK_OK(fy_train(&o, &lag_fp16));
    CHECKF(lag_fp16.skipped_steps > 0, "lag fp16 from 2^24 skips steps");
    same_as("sim fp16 lag 1, skipped steps, 2 chunks on the device", l, &lag_fp16);
    // What the lag cannot do is refused with the reason: fp32 offloaded, accumulation, lag 2.
    o.precision = l.precision = NULL;
    o.loss_scale = l.loss_scale = 0;
    l.device_chunks = 0;
    struct fy_train_result r;
    CHECK_ERR(fy_train(&l, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "16-bit compute") != NULL);
    l.precision = "bf16";
    l.grad_accum = 2;
    CHECK_ERR(fy_train(&l, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "--grad-accum") != NULL);
    l.grad_accum = 1;
    l.optimizer_lag = 2;
    CHECK_ERR(fy_train(&l, &r), FY_ERR_INVALID);
  }

  // --spec-chunks: host chunks updated as their gradients come home, before the norm, into spare
  // slots, kept when the norm neither clips nor skips and redone otherwise: every placement gives
  // the cpu's exact bits, whichever way the norm goes, and both ways are taken.
  {
    struct fy_train_opts e = base(), p = s;
    p.spec_chunks = 3;
    struct fy_train_result ref, r;
    e.adamw.clip = p.adamw.clip = 100.0f;  // (never clips: every step's speculation stands)
    CHECK_OK(fy_train(&e, &ref));
    CHECK_OK(fy_train(&p, &r));
    same_as("sim fp32 spec 3, no clipping", p, &ref);
    CHECKF(r.spec_chunks == 3 && r.spec_steps == p.steps && r.spec_redone == 0,
           "spec, no clipping: %d chunks, %lld steps speculated, %lld redone", r.spec_chunks, (long long)r.spec_steps,
           (long long)r.spec_redone);
    e.precision = p.precision = "bf16";
    e.adamw.clip = p.adamw.clip = 1.5f;  // (norms 1.1 to 2.7 here: some steps clip, some do not)
    CHECK_OK(fy_train(&e, &ref));
    p.sim_jitter_us = 300;
    p.disk_dir = disk_dir;
    p.disk_chunks = 1;
    p.device_chunks = 1;
    p.spec_chunks = 1000;  // (as many as the host tier's chunks)
    CHECK_OK(fy_train(&p, &r));
    CHECKF(r.spec_steps > 0 && r.spec_redone > 0 && r.spec_redone < r.spec_steps && r.spec_chunks == r.n_chunks - 2,
           "spec, clip 1.5: %d of %d chunks, %lld steps speculated, %lld redone (both ways wanted)", r.spec_chunks,
           r.n_chunks, (long long)r.spec_steps, (long long)r.spec_redone);
    same_as("sim bf16 spec, clipping, jitter, device and disk chunks", p, &ref);
    p.sim_jitter_us = 0;
    p.disk_dir = NULL;
    p.disk_chunks = -1;
    p.device_chunks = 0;
    // 8-bit state, fp32 gradients at home (summed over 2 micro-batches): against the same run
    // without speculation.
    struct fy_train_opts q = p;
    q.grad_accum = 2;
    q.optimizer_state = "8bit";
    q.chunk_mib = 0.0625;  // (a multiple of 256 elements)
    q.spec_chunks = 0;
    CHECK_OK(fy_train(&q, &ref));
    q.spec_chunks = 2;
    same_as("sim bf16 8-bit state, accumulation 2, spec 2", q, &ref);
    e.precision = p.precision = "fp16";  // skipped steps: redone as skipped, the copy rebuilt
    e.loss_scale = p.loss_scale = 0x1p24f;
    CHECK_OK(fy_train(&e, &ref));
    CHECKF(ref.skipped_steps > 0, "spec fp16 from 2^24 skips steps");
    same_as("sim fp16 spec, skipped steps", p, &ref);
    e.loss_scale = p.loss_scale = 0;
    // What it does not combine with is refused with the reason.
    p.precision = "bf16";
    p.optimizer_lag = 1;
    CHECK_ERR(fy_train(&p, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "--optimizer-lag") != NULL);
    e.spec_chunks = 2;  // (the cpu has no host updates to start early)
    CHECK_ERR(fy_train(&e, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "offloaded") != NULL);
  }

  // --device-updates: host chunks updated by the device after the norm, their master, m, v and
  // gradients copied in and master, m, v and 16-bit copy home: every placement gives the cpu's
  // bits, beside speculated, device and disk chunks, clipped and skipped steps, compressed state.
  {
    struct fy_train_opts e = base(), p = s;
    p.device_updates = 2;
    struct fy_train_result ref, r;
    CHECK_OK(fy_train(&e, &ref));
    CHECK_OK(fy_train(&p, &r));
    same_as("sim fp32 device updates 2", p, &ref);
    CHECKF(r.device_updates == 2, "device updates: %d chunks", r.device_updates);
    e.precision = p.precision = "bf16";
    e.adamw.clip = p.adamw.clip = 1.5f;  // (some steps clip, some do not)
    CHECK_OK(fy_train(&e, &ref));
    p.sim_jitter_us = 300;
    p.disk_dir = disk_dir;
    p.disk_chunks = 1;
    p.device_chunks = 1;
    p.spec_chunks = 1;
    p.device_updates = 1000;  // (every host-tier chunk not speculated)
    CHECK_OK(fy_train(&p, &r));
    CHECKF(r.device_updates == r.n_chunks - 3 && r.spec_chunks == 1 && r.device_updates > 0,
           "device updates beside speculation: %d of %d chunks (1 on the device, 1 on disk, 1 speculated)",
           r.device_updates, r.n_chunks);
    same_as("sim bf16 device updates, spec 1, clipping, jitter, device and disk chunks", p, &ref);
    p.sim_jitter_us = 0;
    p.disk_dir = NULL;
    p.disk_chunks = -1;
    p.device_chunks = 0;
    p.spec_chunks = 0;
    struct fy_train_opts q = p;  // 8-bit state, fp32 gradients summed over 2 micro-batches
    q.grad_accum = 2;
    q.optimizer_state = "8bit";
    q.chunk_mib = 0.0625;  // (a multiple of 256 elements)
    q.device_updates = 0;
    CHECK_OK(fy_train(&q, &ref));
    q.device_updates = 3;
    same_as("sim bf16 8-bit state, accumulation 2, device updates 3", q, &ref);
    e.precision = p.precision = "fp16";  // skipped steps: the copy from the master as it was
    e.loss_scale = p.loss_scale = 0x1p24f;
    CHECK_OK(fy_train(&e, &ref));
    CHECKF(ref.skipped_steps > 0, "device updates fp16 from 2^24 skips steps");
    same_as("sim fp16 device updates, skipped steps", p, &ref);
    e.loss_scale = p.loss_scale = 0;
    p.precision = "bf16";
    p.optimizer_lag = 1;
    CHECK_ERR(fy_train(&p, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "--optimizer-lag") != NULL);
    p.optimizer_lag = 0;
    p.device_updates = -1;
    CHECK_ERR(fy_train(&p, &r), FY_ERR_INVALID);
    e.device_updates = 2;  // (the cpu has no host tier to update elsewhere)
    CHECK_ERR(fy_train(&e, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "offloaded") != NULL);
  }

  // --profile times the compute stream's waits (the sim device's events keep when they were
  // reached): with a slow link and no prefetch most of a step is waiting for chunk loads, the
  // waits add up to no more than the steps, and the numbers are those of the run without it.
  {
    struct fy_train_opts p = s;
    p.blocks = 2;
    p.prefetch = 0;
    p.sim_link_gbps = 0.02;
    p.steps = 3;
    p.profile = true;
    struct fy_train_result timed, plain;
    CHECK_OK(fy_train(&p, &timed));
    p.profile = false;
    CHECK_OK(fy_train(&p, &plain));
    double waited = 0;
    for (int i = 0; i < FY_STALL_COUNT; i++) waited += timed.stall_s[i];
    fprintf(stderr, "  profile: %.4f s a step, waits: loads %.4f, optimizer %.4f, disk %.4f, norm %.4f\n",
            timed.step_s, timed.stall_s[FY_STALL_LOAD], timed.stall_s[FY_STALL_OPTIMIZER],
            timed.stall_s[FY_STALL_DISK], timed.stall_s[FY_STALL_NORM]);
    CHECKF(timed.stalls_timed && timed.stall_s[FY_STALL_LOAD] > 0 && waited <= 1.5 * timed.step_s * timed.steps &&
               timed.stall_s[FY_STALL_LOAD] >= timed.stall_s[FY_STALL_OPTIMIZER],
           "profile: waits %.4f s a step (loads %.4f) over steps of %.4f s", waited, timed.stall_s[FY_STALL_LOAD],
           timed.step_s);
    CHECK(timed.params_hash == plain.params_hash && !plain.stalls_timed);
  }

  // --optimizer-state bf16 and 8bit: m and v stored compressed wherever they live (host tier, disk
  // read and written in their stored size, device chunks, fp32 and bf16 compute), every placement
  // the cpu's bits in each format: 8-bit blocks hold the same elements whatever the chunk size (the
  // layout packs groups at 256 elements). The formats' numbers differ from fp32's and each other's.
  {
    const char *fmts[] = {"bf16", "8bit"};
    for (int f = 0; f < 2; f++) {
      for (int prec = 0; prec < 2; prec++) {
        struct fy_train_result cref;
        o = base();
        o.optimizer_state = fmts[f];
        o.precision = prec ? "bf16" : NULL;
        CHECK_OK(fy_train(&o, &cref));
        CHECKF(cref.last_loss < cref.first_loss && (prec || cref.params_hash != ref.params_hash),
               "%s state, %s: learns (%.9g -> %.9g) with other numbers than fp32 state's", fmts[f],
               prec ? "bf16" : "fp32", cref.first_loss, cref.last_loss);
        struct fy_train_opts q = s;
        q.optimizer_state = fmts[f];
        q.precision = o.precision;
        q.blocks = 2;
        q.disk_dir = NULL;
        q.disk_chunks = -1;
        q.device_chunks = 0;
        char what[160];
        snprintf(what, sizeof what, "%s state %s: host chunks, 2 blocks", fmts[f], prec ? "bf16" : "fp32");
        same_as(what, q, &cref);
        q.disk_dir = disk_dir;
        q.disk_chunks = 1000;
        q.sim_jitter_us = 300;
        snprintf(what, sizeof what, "%s state %s: jitter, every chunk on disk", fmts[f], prec ? "bf16" : "fp32");
        same_as(what, q, &cref);
        q.sim_jitter_us = 0;
        q.disk_chunks = 1;
        q.device_chunks = 2;
        q.blocks = 3;
        snprintf(what, sizeof what, "%s state %s: 2 device chunks, 1 on disk", fmts[f], prec ? "bf16" : "fp32");
        same_as(what, q, &cref);
        q.chunk_mib = 0.1;  // other chunks: the same blocks
        q.disk_dir = NULL;
        q.disk_chunks = -1;
        q.device_chunks = 0;
        snprintf(what, sizeof what, "%s state %s: larger chunks", fmts[f], prec ? "bf16" : "fp32");
        same_as(what, q, &cref);
      }
    }
    // 2 micro-batches (fp32 gradients in the host tier and on disk) in 8-bit.
    struct fy_train_result acc8;
    o = base();
    o.optimizer_state = "8bit";
    o.grad_accum = 2;
    o.batch = 1;
    CHECK_OK(fy_train(&o, &acc8));
    struct fy_train_opts q = s;
    q.optimizer_state = "8bit";
    q.grad_accum = 2;
    q.batch = 1;
    q.blocks = 2;
    q.disk_dir = disk_dir;
    q.disk_chunks = 2;
    q.device_chunks = 1;
    same_as("8bit state, 2 micro-batches, chunk 0 on the device, 2 on disk", q, &acc8);
    // The lag and 8-bit state.
    struct fy_train_result lag8;
    o = base();
    o.optimizer_state = "8bit";
    o.precision = "bf16";
    o.optimizer_lag = 1;
    CHECK_OK(fy_train(&o, &lag8));
    q = s;
    q.optimizer_state = "8bit";
    q.precision = "bf16";
    q.optimizer_lag = 1;
    q.blocks = 2;
    q.disk_dir = disk_dir;
    q.disk_chunks = 1;
    q.device_chunks = 1;
    same_as("8bit state, bf16 lag 1, chunk 0 on the device, 1 on disk", q, &lag8);
    // What cannot be: an unknown format, a resident GPU, --tp.
    q = s;
    q.optimizer_state = "int4";
    struct fy_train_result r;
    CHECK_ERR(fy_train(&q, &r), FY_ERR_INVALID);
    CHECK(strstr(fy_error_msg(), "fp32, bf16 or 8bit") != NULL);
    q.optimizer_state = "8bit";
    q.device = "cuda";
    CHECK_ERR(fy_train(&q, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "--offload") != NULL);
  }

  // --disk-master: the disk chunks' fp32 master weights live on disk too (the host keeps their
  // 16-bit copy), read ahead and written back with m and v by the optimizer. Every state format,
  // the lag, jitter on every stream and disk request, device chunks beside, skipped steps and
  // validation between steps: the cpu's bits. The host tier holds no master for a disk chunk.
  {
    const char *fmts[] = {"fp32", "bf16", "8bit"};
    struct fy_train_result cref, with, without;
    for (int f = 0; f < 3; f++) {
      o = base();
      o.precision = "bf16";
      o.optimizer_state = fmts[f];
      CHECK_OK(fy_train(&o, &cref));
      struct fy_train_opts q = s;
      q.precision = "bf16";
      q.optimizer_state = fmts[f];
      q.blocks = 2;
      q.disk_dir = disk_dir;
      q.disk_chunks = 1000;
      q.disk_master = true;
      char what[160];
      snprintf(what, sizeof what, "disk master, %s state: every chunk on disk", fmts[f]);
      same_as(what, q, &cref);
      q.disk_chunks = 2;
      q.device_chunks = 1;
      q.sim_jitter_us = 300;
      snprintf(what, sizeof what, "disk master, %s state: jitter, 2 on disk, 1 on the device", fmts[f]);
      same_as(what, q, &cref);
    }
    // The host tier without the disk chunks' masters: every chunk on disk saves the model's
    // weights (4 bytes a parameter) less the optimizer's two chunk-sized buffers for them.
    struct fy_train_opts q = s;
    q.precision = "bf16";
    q.optimizer_state = "8bit";
    q.disk_dir = disk_dir;
    q.disk_chunks = 1000;
    q.steps = 2;
    CHECK_OK(fy_train(&q, &without));
    q.disk_master = true;
    CHECK_OK(fy_train(&q, &with));
    const double np = (double)fy_opt_num_params(&cfg), saved = without.host_tier_bytes - with.host_tier_bytes;
    fprintf(stderr, "  disk master: host tier %.0f bytes against %.0f (%.3f bytes a parameter fewer; %d chunks of %.0f "
            "bytes)\n", with.host_tier_bytes, without.host_tier_bytes, saved / np, with.n_chunks, with.chunk_bytes);
    CHECKF(saved >= 4 * np - 2 * with.chunk_bytes - 65536 && saved <= 4 * np, "disk master saves %.0f bytes of host "
           "memory; the masters are %.0f", saved, 4 * np);
    // The lag: each disk chunk's master read and written under the next step.
    struct fy_train_result lag16;
    o = base();
    o.precision = "bf16";
    o.optimizer_lag = 1;
    CHECK_OK(fy_train(&o, &lag16));
    q = s;
    q.precision = "bf16";
    q.optimizer_lag = 1;
    q.blocks = 2;
    q.disk_dir = disk_dir;
    q.disk_chunks = 1000;
    q.disk_master = true;
    q.sim_jitter_us = 300;
    same_as("disk master, bf16 lag 1, jitter, every chunk on disk", q, &lag16);
    q.sim_jitter_us = 0;
    // Validation between steps reads the 16-bit copies, and changes nothing.
    o.val_data = q.val_data = shard;
    o.val_every = q.val_every = 7;
    o.val_batches = q.val_batches = 2;
    struct fy_train_result cpu_v, sim_v;
    CHECK_OK(fy_train(&o, &cpu_v));
    CHECK_OK(fy_train(&q, &sim_v));
    CHECKF(sim_v.val_loss == cpu_v.val_loss && sim_v.params_hash == cpu_v.params_hash,
           "disk master, lag: validation %.9g, cpu %.9g", sim_v.val_loss, cpu_v.val_loss);
    // fp16 from 2^24: skipped steps rebuild a disk chunk's 16-bit copy from its master on disk.
    struct fy_train_result f16;
    o = base();
    o.precision = "fp16";
    o.loss_scale = 0x1p24f;
    CHECK_OK(fy_train(&o, &f16));
    q = s;
    q.precision = "fp16";
    q.loss_scale = 0x1p24f;
    q.blocks = 2;
    q.disk_dir = disk_dir;
    q.disk_chunks = 2;
    q.disk_master = true;
    same_as("disk master, fp16 skipped steps, 2 chunks on disk", q, &f16);
    // What cannot be is refused with the reason: fp32 compute, no disk chunks, the cpu device.
    q.loss_scale = 0;
    q.precision = NULL;
    struct fy_train_result r;
    CHECK_ERR(fy_train(&q, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "16-bit compute") != NULL);
    q.precision = "bf16";
    q.disk_chunks = 0;
    CHECK_ERR(fy_train(&q, &r), FY_ERR_INVALID);
    CHECK(strstr(fy_error_msg(), "no chunk's state goes to disk") != NULL);
    q.disk_chunks = 2;
    q.device = "cpu";
    CHECK_ERR(fy_train(&q, &r), FY_ERR_UNSUPPORTED);
    CHECK(strstr(fy_error_msg(), "offloaded") != NULL);
  }

  // The smallest device: refused before training, with the minimum it needs.
  s.blocks = 0;
  s.device_mem = 64 << 10;
  struct fy_train_result r;
  CHECK_ERR(fy_train(&s, &r), FY_ERR_NOMEM);
  CHECK(strstr(fy_error_msg(), "needs at least") != NULL);
  s.device_mem = 8 << 20;
  // A disk directory that does not exist is made, with its parents (and the tier's files are
  // gone after the run); one that cannot be made is refused.
  s.disk_chunks = 1000;
  char made[400];
  snprintf(made, sizeof made, "%s/made/for/disk", dir);
  s.disk_dir = made;
  CHECK_OK(fy_train(&s, &r));
  DIR *md = opendir(made);
  int left = 0;
  for (struct dirent *e; md && (e = readdir(md));) left += e->d_name[0] != '.';
  if (md) closedir(md);
  CHECKF(md && left == 0, "--disk-dir %s: %s, %d files left", made, md ? "made" : "not made", left);
  s.disk_dir = "/etc/passwd/x";
  CHECK_ERR(fy_train(&s, &r), FY_ERR_IO);
  // AdamW state that fits neither host memory nor a disk tier.
  s.disk_dir = NULL;
  s.disk_chunks = -1;
  s.host_mem = 200 << 10;
  CHECK(fy_train(&s, &r) != FY_OK);
  CHECK(strstr(fy_error_msg(), "--disk-dir") != NULL || strstr(fy_error_msg(), "host") != NULL);
  s.host_mem = 0;
  // A full disk while training: a clear error, not a crash.
  struct rlimit old, lim = {.rlim_cur = 8192, .rlim_max = RLIM_INFINITY};
  getrlimit(RLIMIT_FSIZE, &old);
  lim.rlim_max = old.rlim_max;
  signal(SIGXFSZ, SIG_IGN);
  s.disk_dir = disk_dir;
  s.disk_chunks = 1000;
  setrlimit(RLIMIT_FSIZE, &lim);
  fy_status st = fy_train(&s, &r);
  setrlimit(RLIMIT_FSIZE, &old);
  CHECKF(st == FY_ERR_IO, "full disk: status %d: %s", st, fy_error_msg());
  fprintf(stderr, "  expected error: %s\n", fy_error_msg());

  prefetch_overlap(cfg, false);

  fy_matmul_cache_clear();
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  CHECK(system(cmd) == 0);
  return check_summary("offload");
}
