// An offloaded mixture of experts (docs/offloading.md, "Mixtures of experts"): on the sim device a
// mixture's experts are loaded into the device cache only when they got tokens, and the losses and
// weights are still bit for bit the resident cpu run's, in every placement (eviction, spills,
// jitter, the disk tier, chunks kept on the device, recomputation with micro-batches, bf16). With
// 4 tokens a pass, each routed to 1 of 8 experts, at least half of a mixture's experts get no
// token (a zero gradient, and AdamW still moves their weights and state): fewer expert chunks are
// loaded than loading whole chunks would move, and the count says so.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/graph.h"
#include "core/opt.h"
#include "memory/chunk.h"
#include "planner/cost.h"
#include "planner/plan.h"
#include "planner/probe.h"
#include "runtime/data.h"
#include "runtime/trainer.h"

static char dir[256], model_dir[300], shard[300], disk_dir[300];

static struct fy_train_opts base(void) {
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  o.hash_params = true;
  o.model = model_dir;
  o.data = shard;
  o.batch = 1;
  o.seq = 4;
  o.steps = 12;
  o.lr = 3e-3f;
  o.warmup = 2;
  o.quiet = true;
  o.seed = 7;
  return o;
}

// Runs `o` (sim) against the cpu reference: the same losses, balance terms and weights; returns
// whether the run loaded fewer expert chunks than whole chunks would have moved.
static bool same_as(const char *what, struct fy_train_opts o, const struct fy_train_result *ref) {
  struct fy_train_result r;
  fy_status st = fy_train(&o, &r);
  CHECKF(st == FY_OK, "%s: %s", what, fy_error_msg());
  if (st != FY_OK) return false;
  CHECKF(r.first_loss == ref->first_loss && r.last_loss == ref->last_loss, "%s: losses %.9g %.9g, reference %.9g %.9g",
         what, r.first_loss, r.last_loss, ref->first_loss, ref->last_loss);
  CHECKF(r.params_hash == ref->params_hash, "%s: the parameters differ from the reference", what);
  CHECKF(r.device_peak_bytes <= (double)o.device_mem, "%s: device peak %.0f over the cap %zu", what, r.device_peak_bytes,
         o.device_mem);
  fprintf(stderr, "  %-48s blocks %d/%d chunks, loads %lld, spills %lld, expert chunks loaded: %lld of %lld\n", what,
          r.n_blocks, r.n_chunks, (long long)r.cache_loads, (long long)r.cache_spills, (long long)r.expert_loads,
          (long long)r.expert_parts);
  return r.expert_parts > 0 && r.expert_loads < r.expert_parts;
}

int main(int argc, char **argv) {
  check_args(argc, argv);
  if (!check_plain()) return check_summary("offload_moe");
  snprintf(dir, sizeof dir, "/tmp/ferry_offload_moe_XXXXXX");
  if (!mkdtemp(dir)) return 1;
  snprintf(model_dir, sizeof model_dir, "%s/model", dir);
  snprintf(shard, sizeof shard, "%s/data.bin", dir);
  snprintf(disk_dir, sizeof disk_dir, "%s/disk", dir);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "mkdir -p %s %s", model_dir, disk_dir);
  CHECK(system(cmd) == 0);
  // opt-moe-tiny (layers 1 and 3 mixtures) with 8 experts and top 1.
  struct fy_opt_config cfg;
  fy_opt_preset("opt-moe-tiny", &cfg);
  cfg.num_local_experts = 8;
  cfg.num_experts_per_tok = 1;
  CHECK_OK(fy_opt_config_write(model_dir, &cfg));
  uint16_t *tok = malloc(4000 * sizeof *tok);
  for (int i = 0; i < 4000; i++) tok[i] = (uint16_t)((i * 31 + (i / 7) * 3) % 97);
  CHECK_OK(fy_shard_write(shard, tok, 4000));
  free(tok);

  struct fy_train_result ref, ref_acc, ref16;
  struct fy_train_opts o = base();
  CHECK_OK(fy_train(&o, &ref));
  CHECKF(ref.last_loss < ref.first_loss, "the reference run learns: %f -> %f", ref.first_loss, ref.last_loss);
  CHECKF(ref.expert_parts == 0, "a resident run loads no expert chunks (%lld)", (long long)ref.expert_parts);

  // Chunks of about a layer (a mixture's router and experts are one group: 34k parameters).
  struct fy_train_opts s = base();
  s.device = "sim";
  s.device_mem = 8 << 20;
  s.chunk_mib = 0.15;
  s.blocks = 2;  // eviction: experts loaded again after their chunk was
  char log_path[320];
  snprintf(log_path, sizeof log_path, "%s/log.jsonl", dir);
  s.log_path = log_path;
  struct fy_train_result got;
  CHECK_OK(fy_train(&s, &got));
  s.log_path = NULL;
  CHECKF(same_as("2 blocks (eviction), prefetch 2", s, &ref), "fewer expert chunks loaded than all");
  {  // The log's last step says the run's count.
    FILE *f = fopen(log_path, "r");
    char line[4096], last[4096] = "", want[96];
    while (f && fgets(line, sizeof line, f)) memcpy(last, line, sizeof last);
    if (f) fclose(f);
    snprintf(want, sizeof want, "\"expert_chunks_loaded\":%lld,\"expert_chunks\":%lld", (long long)got.expert_loads,
             (long long)got.expert_parts);
    CHECKF(strstr(last, want) != NULL, "the log's last step: %s (want %s)", last, want);
  }
  s.chunk_mib = 0.5;  // one chunk for the whole model: both mixtures' experts in it
  s.blocks = 0;
  same_as("one chunk", s, &ref);
  s.chunk_mib = 0.15;
  s.blocks = 1;  // spills in backward
  same_as("1 block (spills)", s, &ref);
  s.blocks = 3;
  s.sim_jitter_us = 200;
  s.sim_link_gbps = 0.5;
  same_as("3 blocks, jitter, a throttled link", s, &ref);
  s.sim_jitter_us = 0;
  s.sim_link_gbps = 0;
  s.disk_dir = disk_dir;
  s.disk_chunks = 2;
  same_as("3 blocks, AdamW state of 2 chunks on disk", s, &ref);
  s.disk_chunks = 0;
  s.disk_dir = NULL;
  s.device_chunks = 2;
  same_as("2 chunks kept on the device", s, &ref);
  s.device_chunks = 0;

  {  // Evaluation through the cache (forward passes alone): the cpu's mean loss.
    struct fy_train_opts e = base();
    e.eval_batches = 5;
    double cpu = 0, got = -1;
    CHECK_OK(fy_eval(&e, &cpu));
    e.device = "sim";
    e.device_mem = 8 << 20;
    e.chunk_mib = 0.15;
    e.blocks = 2;
    fy_status st = fy_eval(&e, &got);
    CHECKF(st == FY_OK && got == cpu, "eval on sim, 2 blocks: %.9g (%s), cpu %.9g", got, st == FY_OK ? "ok" : fy_error_msg(),
           cpu);
  }

  o.recompute = true;
  o.grad_accum = 2;
  CHECK_OK(fy_train(&o, &ref_acc));
  s.recompute = true;
  s.grad_accum = 2;
  s.blocks = 2;
  s.sim_jitter_us = 200;
  same_as("recompute, 2 micro-batches, 2 blocks, jitter", s, &ref_acc);
  s.recompute = false;
  s.grad_accum = 1;
  s.sim_jitter_us = 0;

  o = base();
  o.precision = "bf16";
  CHECK_OK(fy_train(&o, &ref16));
  s.precision = "bf16";
  same_as("bf16, 2 blocks", s, &ref16);
  // The one-step-delayed update (two 16-bit copies a chunk that swap roles) with the master weights
  // of the disk chunks on disk.
  o.optimizer_lag = 1;
  CHECK_OK(fy_train(&o, &ref16));
  s.optimizer_lag = 1;
  s.disk_dir = disk_dir;
  s.disk_chunks = 2;
  s.disk_master = true;
  same_as("bf16, lag 1, 2 chunks' state and master on disk", s, &ref16);

  // The planner's loads (planner/cost.c): a pass of 4 tokens, each to 1 of 8 experts, moves
  // 1 - (7/8)^4 = 41% of the experts' weights in expectation, one of 64 tokens nearly all of them;
  // the experts are 2/3 of this model, so the link carries clearly less at 4 tokens.
  {
    // (a machine's figures written down, not measured: the timeline is arithmetic on them)
    struct fy_probe probe = {.format = FY_PROBE_FORMAT, .device = "sim", .device_mem = 8 << 20, .host_mem = 1e9,
                             .device_gflops = 50, .host_gflops = 50, .h2d_gbps = 0.5, .d2h_gbps = 0.5,
                             .host_adamw_gbps = 5, .host_mem_gbps = 10, .copy_latency_us = 20};
    struct fy_graph *g;
    CHECK_OK(fy_opt_build_graph(&cfg, 1, 64, &g));
    struct fy_plan_knobs k = {.micro_batch = 1, .grad_accum = 1, .seq = 4, .chunk_elems = fy_chunk_min_elems(g),
                              .blocks = 2, .prefetch = 2};
    fy_graph_free(g);
    struct fy_cost few, many;
    CHECK_OK(fy_cost_simulate(&cfg, &k, &probe, &few, NULL));
    k.seq = 64;
    CHECK_OK(fy_cost_simulate(&cfg, &k, &probe, &many, NULL));
    fprintf(stderr, "  planner: copies to the device %.3f ms a step at 4 tokens, %.3f ms at 64 (%lld loads each)\n",
            few.h2d_s * 1e3, many.h2d_s * 1e3, (long long)few.loads_per_step);
    // Each mixture's chunk is loaded at least once a step: the link saves at least the two
    // mixtures' idle experts' share of 4 tokens less that of 64, at the probed rate.
    const double experts = 2.0 * 8 * (2.0 * 32 * 64 + 64 + 32) * 4;  // bytes: 2 mixtures of 8 experts
    const double saved = experts * (pow(7.0 / 8, 4) - pow(7.0 / 8, 64)) / (probe.h2d_gbps * 1e9);
    CHECKF(few.fits && many.fits && few.loads_per_step == many.loads_per_step && many.h2d_s - few.h2d_s >= 0.99 * saved,
           "the planner's loads: %.6f s at 4 tokens, %.6f s at 64 (at least %.6f s less)", few.h2d_s, many.h2d_s, saved);
  }

  // Top 2 of 4 experts and 32 tokens a pass: most experts get tokens.
  cfg.num_local_experts = 4;
  cfg.num_experts_per_tok = 2;
  CHECK_OK(fy_opt_config_write(model_dir, &cfg));
  o = base();
  o.batch = 2;
  o.seq = 16;
  o.steps = 4;
  CHECK_OK(fy_train(&o, &ref));
  s = base();
  s.batch = 2;
  s.seq = 16;
  s.steps = 4;
  s.device = "sim";
  s.device_mem = 8 << 20;
  s.chunk_mib = 0.15;
  s.blocks = 2;
  same_as("top 2 of 4, 32 tokens, 2 blocks", s, &ref);

  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  CHECK(system(cmd) == 0);
  return check_summary("offload_moe");
}
