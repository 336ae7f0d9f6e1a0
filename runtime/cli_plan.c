// ferry probe and ferry plan: the machine described for the planner, the plan chosen and explained.
#include <getopt.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/parse.h"
#include "core/opt.h"
#include "planner/plan.h"
#include "planner/probe.h"
#include "planner/profile.h"
#include "core/graph.h"
#include <sys/stat.h>
#include "ops/ops.h"
#include "runtime/checkpoint.h"
#include "fy_config.h"
#include "runtime/cli.h"

// Machine description for the planner: the cached probe (measured when there is none, or with
// --remeasure), then the overrides given on the command line.
struct machine_args {
  const char *device, *disk_dir, *file;
  size_t device_mem;
  double link;
  bool remeasure, no_write;
  int n_set;
  const char *set_key[32], *set_val[32];
};

static int gpus_here(void) {
#if FY_HAVE_CUDA
  return fy_probe_gpu_count();
#else
  return 0;
#endif
}

// For a GPU (--device cuda): the GPU's own figures when this machine has one (GPU 0, measured and
// cached like any probe), else this CPU's measured as the sim device, to be given the GPU's on the
// command line (the planner can then plan for a machine you do not have).
static fy_status load_machine(const struct machine_args *a, struct fy_probe *p, bool *measured) {
  char path[4096];
  if (a->file) snprintf(path, sizeof path, "%s", a->file);
  else fy_probe_default_path(path, sizeof path);
  const char *dev = a->device ? a->device : "sim";
  const bool cuda = strcmp(dev, "cuda") == 0;
  const struct fy_probe_cache c = {.path = path, .device = dev, .disk_dir = a->disk_dir, .gpu = cuda && gpus_here() > 0,
                                   .remeasure = a->remeasure, .write = !a->no_write, .write_errors = true,
                                   .device_mem = a->device_mem ? (double)a->device_mem : 1073741824.0,
                                   .link_gbps = a->link};
  FY_TRY(fy_probe_cached(&c, p, measured));
  if (cuda && strcmp(p->device, "cuda") != 0) {
    bool given = false;
    for (int i = 0; i < a->n_set; i++)
      given |= strcmp(a->set_key[i], "device_tflops") == 0 || strcmp(a->set_key[i], "device_gflops") == 0;
    const char *why = "no GPU here (ferry was built without CUDA)";
#if FY_HAVE_CUDA
    why = fy_probe_find_gpu(0) != FY_OK ? fy_error_msg() : "no GPU measured";
#endif
    if (!given)
      fprintf(stderr, "ferry: %s; the GPU's GEMM rate and link are this CPU's as the sim device's; give the GPU's "
              "with --device-tflops, --link-gbps and --device-mem\n", why);
  }
  if (a->device) FY_TRY(fy_probe_override(p, "device", a->device));
  if (a->device_mem) {
    char v[64];
    snprintf(v, sizeof v, "%zu", a->device_mem);
    FY_TRY(fy_probe_override(p, "device_mem", v));
  }
  // The sim's link as --sim-link-gbps throttles it, as ferry train runs it: a cached probe may have
  // timed another throttle, or none.
  if (a->link > 0 && strcmp(p->device, "sim") == 0) {
    char v[64];
    snprintf(v, sizeof v, "%g", a->link);
    FY_TRY(fy_probe_override(p, "link_gbps", v));
  }
  for (int i = 0; i < a->n_set; i++) FY_TRY(fy_probe_override(p, a->set_key[i], a->set_val[i]));
  // A host AdamW rate given (--host-adamw-gbps: a machine described, not this one): the state
  // formats' rates measured here are not that machine's, so they are priced from it (memory-bound,
  // fy_probe_adamw_s) unless given too (--set host_adamw_8bit_gbps=X).
  bool given[3] = {false, false, false};
  const char *keys[3] = {"host_adamw_gbps", "host_adamw_bf16_gbps", "host_adamw_8bit_gbps"};
  for (int i = 0; i < a->n_set; i++)
    for (int j = 0; j < 3; j++) given[j] |= strcmp(a->set_key[i], keys[j]) == 0;
  if (given[0] && !given[1]) p->host_adamw_bf16_gbps = 0;
  if (given[0] && !given[2]) p->host_adamw_8bit_gbps = 0;
  return FY_OK;
}

// A machine override as it is parsed: a value the probe would refuse is a usage error (exit 2),
// said before any measuring.
static bool override_ok(const char *cmd, const char *key, const char *value) {
  struct fy_probe scratch = {.device = "sim"};
  if (fy_probe_override(&scratch, key, value) == FY_OK) return true;
  fprintf(stderr, "ferry %s: %s\n", cmd, fy_error_msg());
  return false;
}

// An offloaded plan whose compute waits on the optimizer (or the norm, or the disk: the step's
// per-step costs) for a noticeable part of its step: the plans for 2 and 4 times the global batch,
// when they are faster per token, said with the batch that buys it (the optimizer's cost is per
// step, the compute's per token), so that the user can choose the bigger batch.
static void say_bigger_batch(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq, int ranks,
                             bool offload_only, const char *precision, int lag, const char *state,
                             const struct fy_probe *probe, const struct fy_plan *best) {
  const struct fy_cost *c = &best->predicted;
  const double per_step = c->stall_s[FY_STALL_OPTIMIZER] + c->stall_s[FY_STALL_DISK] + c->stall_s[FY_STALL_NORM];
  if (best->k.resident || per_step < 0.05 * c->step_s) return;
  for (int f = 2; f <= 4; f *= 2) {
    struct fy_plan big;
    if (fy_plan_search_state(cfg, model, batch * f, seq, ranks, offload_only, precision, lag, state, probe, &big,
                             NULL) != FY_OK)
      continue;  // (does not fit: nothing to say)
    const double gain = big.predicted.tokens_per_s / c->tokens_per_s;
    if (gain < 1.05) continue;
    printf("  a bigger global batch buys speed here (the optimizer's cost is per step, the compute's per token): "
           "%lld sequences a step (per rank: micro-batch %lld x %lld accumulated) would run at %.0f tokens/s, %.2fx\n",
           (long long)(batch * f), (long long)big.k.micro_batch, (long long)big.k.grad_accum,
           big.predicted.tokens_per_s, gain);
  }
}

// A plan with speculative updates is priced for steps whose norm does not clip. A step that clips
// (or skips) has them redone, and the steps after it do not speculate until one would have stood
// (runtime/offload.c, spec_settle): while the norm clips, a step is the plan's without speculation.
// Said with that figure (the search priced it beside the plan: fy_cost.clip_step_s), which is what
// a model trained from random weights gets at first.
static void say_when_clipping(const struct fy_plan *best) {
  const struct fy_cost *c = &best->predicted;
  if (best->k.spec_chunks <= 0 || best->refused[0] || !(c->clip_step_s > 0)) return;
  const double tokens = c->tokens_per_s * c->step_s / c->clip_step_s;
  printf("  while the norm clips (as a fresh model's first steps do at --clip 1) speculation pauses: %.3f s/step, "
         "%.0f tokens/s, %.2fx the figure above\n", c->clip_step_s, tokens, tokens / c->tokens_per_s);
}

// ferry plan --largest: for each AdamW state format, the largest OPT preset any plan fits on this
// machine at the batch, sequence, precision and ranks given (presets tried from the largest down,
// the first that fits wins: one search each until then). In 16-bit the search puts the disk
// chunks' master weights on disk too where that is what fits (disk_master), and says so.
static void largest_by_state(int64_t batch, int64_t seq, int ranks, bool offload_only, const char *precision, int lag,
                             const struct fy_probe *probe) {
  const char *const *names = fy_opt_preset_names();
  int n = 0;
  while (names[n]) n++;
  printf("largest preset this machine trains (%lld x %lld tokens a step%s%s):\n", (long long)batch, (long long)seq,
         precision ? ", " : "", precision ? precision : "");
  const char *fmts[] = {"fp32", "bf16", "8bit"};
  for (int f = 0; f < 3; f++) {
    const char *found = NULL;
    struct fy_plan p;
    for (int i = n - 1; i >= 0 && !found; i--) {
      struct fy_opt_config cfg;
      if (strncmp(names[i], "opt-", 4) != 0 || fy_opt_preset(names[i], &cfg) != FY_OK) continue;
      if (cfg.num_local_experts > 0) continue;  // (--largest compares the dense presets)
      if (seq > cfg.max_position_embeddings) continue;
      if (fy_plan_search_state(&cfg, names[i], batch, seq, ranks, offload_only, precision, lag, fmts[f], probe, &p,
                               NULL) == FY_OK)
        found = names[i];
    }
    char hb[32], db[32];
    if (found)
      printf("  --optimizer-state %-4s  %-9s host %s, disk %s%s, %.0f tokens/s predicted\n", fmts[f], found,
             fy_format_bytes(p.predicted.host_bytes, hb, sizeof hb), fy_format_bytes(p.predicted.disk_bytes, db, sizeof db),
             p.k.disk_master ? " (master weights there too: --disk-master)" : "", p.predicted.tokens_per_s);
    else
      printf("  --optimizer-state %-4s  none\n", fmts[f]);
  }
}

// ferry probe's or ferry plan's command line: the machine, and what to plan and show.
struct plan_args {
  struct machine_args machine;
  const char *model, *out, *svg, *precision, *state;
  int64_t batch, seq, gpus, lag;
  bool profile, offload_only, resident_only, largest, gpus_given;
  int64_t nodes, gpus_per_node, dp, pp, tp;  // (0: not given)
  double intra_gbps, inter_gbps;
};

// ferry probe's or ferry plan's command line into a: -1 to go on, else the exit code (--help: 0).
// A plan option given to probe is refused; so is a value the probe or the planner would refuse.
static int parse_plan_args(int argc, char **argv, bool plan, struct plan_args *a) {
  const char *cmd = plan ? "plan" : "probe";
  *a = (struct plan_args){.model = "opt-125m", .batch = 8, .seq = 1024, .gpus = 1};
  struct machine_args *m = &a->machine;
  static char keybuf[32][32];  // (the overrides' keys: the option's name, '_' for '-')
  int c, idx = 0;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, ":", plan_opts, &idx)) != -1) {
    bool ok = true;
    switch (c) {
      case PLAN_DEVICE: m->device = optarg; break;
      case PLAN_DEVICE_MEM: ok = parse_size("--device-mem", optarg, &m->device_mem); break;
      case PLAN_LINK: {
        float f = 0;
        ok = parse_f32("--sim-link-gbps", optarg, 0, &f);
        m->link = f;
        break;
      }
      case PLAN_DISK: m->disk_dir = optarg; break;
      case PLAN_FILE: m->file = optarg; break;
      case PLAN_REMEASURE: m->remeasure = true; break;
      case PLAN_NO_WRITE: m->no_write = true; break;
      case PLAN_SET: {
        char *eq = strchr(optarg, '=');
        if (!eq || m->n_set == 32) { fprintf(stderr, "ferry %s: --set needs key=value\n", cmd); return 2; }
        *eq = 0;
        m->set_key[m->n_set] = optarg;
        m->set_val[m->n_set++] = eq + 1;
        ok = override_ok(cmd, m->set_key[m->n_set - 1], eq + 1);
        break;
      }
      case PLAN_OVR:
        if (m->n_set == 32) return 2;
        snprintf(keybuf[m->n_set], sizeof keybuf[0], "%s", plan_opts[idx].name);
        for (char *q = keybuf[m->n_set]; *q; q++) if (*q == '-') *q = '_';
        m->set_key[m->n_set] = keybuf[m->n_set];
        m->set_val[m->n_set++] = optarg;
        ok = override_ok(cmd, keybuf[m->n_set - 1], optarg);
        break;
      case PLAN_MODEL: a->model = optarg; break;
      case PLAN_BATCH: ok = parse_i64("--batch", optarg, 1, &a->batch); break;
      case PLAN_SEQ: ok = parse_i64("--seq", optarg, 1, &a->seq); break;
      case PLAN_OUT: a->out = optarg; break;
      case PLAN_SVG: a->svg = optarg; break;
      case PLAN_GPUS: ok = parse_i64("--gpus", optarg, 1, &a->gpus), a->gpus_given = true; break;
      case PLAN_NODES:
      case PLAN_GPN:
      case PLAN_DP:
      case PLAN_PP:
      case PLAN_TP:
      case PLAN_INTRA:
      case PLAN_INTER: {
        if (!plan) {
          fprintf(stderr, "ferry probe: --%s is ferry plan's\n", plan_opts[idx].name);
          return 2;
        }
        char flag[40];
        snprintf(flag, sizeof flag, "--%s", plan_opts[idx].name);
        if (c == PLAN_INTRA || c == PLAN_INTER) {
          float f = 0;
          ok = parse_f32(flag, optarg, 0, &f);
          if (ok && !(f > 0)) ok = false, fprintf(stderr, "ferry plan: %s must be positive GB/s\n", flag);
          *(c == PLAN_INTRA ? &a->intra_gbps : &a->inter_gbps) = f;
        } else {
          int64_t *dst = c == PLAN_NODES ? &a->nodes : c == PLAN_GPN ? &a->gpus_per_node : c == PLAN_DP ? &a->dp
                         : c == PLAN_PP ? &a->pp : &a->tp;
          ok = parse_i64(flag, optarg, 1, dst);
        }
        break;
      }
      case PLAN_PROFILE: a->profile = true; break;
      case PLAN_OFFLOAD: a->offload_only = true; break;
      case PLAN_RESIDENT: a->resident_only = true; break;
      case PLAN_LAG:
        if (!plan) {
          fprintf(stderr, "ferry probe: --optimizer-lag is ferry plan's\n");
          return 2;
        }
        ok = parse_i64("--optimizer-lag", optarg, 0, &a->lag) && (a->lag <= 1 || (fprintf(stderr, "ferry plan: "
             "--optimizer-lag %lld: 0 or 1\n", (long long)a->lag), false));
        break;
      case PLAN_STATE:
      case PLAN_LARGEST:
        if (!plan) {
          // (by the option's name: argv[optind - 1] is the value when it came as a word of its own)
          fprintf(stderr, "ferry probe: --%s is ferry plan's\n", plan_opts[idx].name);
          return 2;
        }
        if (c == PLAN_LARGEST) {
          a->largest = true;
        } else {
          enum fy_state_format sf;
          if (!fy_state_format_from_name(optarg, &sf)) {
            fprintf(stderr, "ferry plan: --optimizer-state %s: fp32, bf16 or 8bit\n", optarg);
            return 2;
          }
          a->state = optarg;
        }
        break;
      case PLAN_PRECISION:
        if (!plan) {
          fprintf(stderr, "ferry probe: --precision is ferry plan's (the probe measures both bf16 and fp32 products)\n");
          return 2;
        }
        enum fy_dtype dt;
        if (!fy_precision_dtype(optarg, &dt)) {
          fprintf(stderr, "ferry plan: --precision %s: fp32, bf16 or fp16\n", optarg);
          return 2;
        }
        a->precision = optarg;
        break;
      case PLAN_HELP:
        usage_probe_or_plan(cmd, plan);
        return 0;
      case ':': fprintf(stderr, "ferry %s: %s needs a value\n", cmd, argv[optind - 1]); return 2;
      default: fprintf(stderr, "ferry %s: unknown option '%s' (see 'ferry %s --help')\n", cmd, argv[optind - 1], cmd); return 2;
    }
    if (!ok) return 2;
  }
  // The cluster: both of --nodes and --gpus-per-node, --gpus their product (or given as it).
  if ((a->nodes > 0) != (a->gpus_per_node > 0)) {
    fprintf(stderr, "ferry plan: a cluster is --nodes K and --gpus-per-node G together\n");
    return 2;
  }
  if ((a->intra_gbps > 0 || a->inter_gbps > 0) && !a->nodes) {
    fprintf(stderr, "ferry plan: --intra-gbps and --inter-gbps describe a cluster's links: give --nodes K "
            "--gpus-per-node G too (one machine's link is --comm-gbps)\n");
    return 2;
  }
  if (a->nodes > 0) {
    const int64_t all = a->nodes * a->gpus_per_node;
    if (a->gpus_given && a->gpus != all) {
      fprintf(stderr, "ferry plan: --gpus %lld is not --nodes %lld x --gpus-per-node %lld = %lld\n", (long long)a->gpus,
              (long long)a->nodes, (long long)a->gpus_per_node, (long long)all);
      return 2;
    }
    a->gpus = all;
  }
  if (a->dp || a->pp || a->tp) {  // (what cannot multiply to the ranks, said before any measuring)
    const int64_t fixed = (a->dp ? a->dp : 1) * (a->pp ? a->pp : 1) * (a->tp ? a->tp : 1);
    if (!a->gpus_given && !a->nodes && a->dp && a->pp && a->tp) a->gpus = fixed;  // (the layout's ranks)
    if (a->gpus % fixed || (a->dp && a->pp && a->tp && fixed != a->gpus)) {
      fprintf(stderr, "ferry plan: --dp %lld x --pp %lld x --tp %lld (%lld) does not lay out %lld GPUs\n",
              (long long)(a->dp ? a->dp : 1), (long long)(a->pp ? a->pp : 1), (long long)(a->tp ? a->tp : 1),
              (long long)fixed, (long long)a->gpus);
      return 2;
    }
  }
  return -1;
}

// The --gpus ranks share this machine's memory and disk, as ferry train's ranks do (each takes its
// share by default): each rank is planned with its share, unless given.
static void share_by_ranks(const struct machine_args *m, int64_t gpus, struct fy_probe *probe) {
  bool host_given = false, disk_given = false;
  for (int i = 0; i < m->n_set; i++) {
    host_given |= strcmp(m->set_key[i], "host_mem") == 0;
    disk_given |= strcmp(m->set_key[i], "disk_space") == 0;
  }
  if (!host_given) probe->host_mem = floor(probe->host_mem / (double)gpus);
  if (!disk_given) probe->disk_space = floor(probe->disk_space / (double)gpus);
}

// ferry plan --profile: each operator kind's count, FLOPs, activations and predicted times in one
// micro-batch of the plan.
static fy_status print_op_profile(const struct fy_opt_config *cfg, const struct fy_plan *best,
                                  const struct fy_probe *probe) {
  struct fy_graph *g;
  FY_TRY(fy_opt_build_graph(cfg, best->k.micro_batch, best->k.seq, &g));
  if (best->k.recompute) fy_graph_set_recompute(g, true);
  double t[FY_OP_KIND_COUNT][2] = {{0}}, fl[FY_OP_KIND_COUNT] = {0}, act[FY_OP_KIND_COUNT] = {0};
  int n[FY_OP_KIND_COUNT] = {0};
  enum fy_dtype cdt = FY_F32;
  fy_precision_dtype(fy_cost_precision(&best->k, probe->device), &cdt);
  const int ab = strcmp(probe->device, "cuda") == 0 && cdt == FY_BF16 ? 2 : 4;
  for (int o = 0; o < g->n_ops; o++) {
    struct fy_op_profile pr;
    fy_profile_op(g, o, probe, ab, cdt, &pr);
    int kd = g->ops[o].kind;
    n[kd]++;
    t[kd][0] += pr.seconds[0];
    t[kd][1] += pr.seconds[1];
    fl[kd] += pr.flops[0] + pr.flops[1];
    act[kd] += pr.act_bytes;
  }
  printf("profile of one micro-batch (%lld x %lld):\n  %-14s %5s %12s %12s %12s %12s\n", (long long)best->k.micro_batch,
         (long long)best->k.seq, "op kind", "ops", "GFLOP", "act MiB", "fwd ms", "bwd ms");
  for (int kd = 0; kd < FY_OP_KIND_COUNT; kd++)
    if (n[kd])
      printf("  %-14s %5d %12.2f %12.1f %12.3f %12.3f\n", fy_op_kind_name(kd), n[kd], fl[kd] / 1e9,
             act[kd] / 1048576.0, t[kd][0] * 1e3, t[kd][1] * 1e3);
  fy_graph_free(g);
  return FY_OK;
}

// ferry plan --svg: the predicted step drawn (an offloaded plan's streams and cache).
static fy_status draw_plan(const struct fy_opt_config *cfg, const struct fy_plan *best, const struct fy_probe *probe,
                           const char *svg) {
  if (best->k.resident) {
    printf("ferry: --svg draws an offloaded step's streams and cache; this plan is resident (no copies or cache to "
           "draw): %s not written (--offload plans it offloaded)\n", svg);
    return FY_OK;
  }
  struct fy_device *tl;
  struct fy_cost cst;
  FY_TRY(fy_cost_simulate(cfg, &best->k, probe, &cst, &tl));
  fy_status st = fy_cost_svg(tl, &cst, svg);
  fy_device_free(tl);
  if (st == FY_OK) printf("ferry: drew the step in %s\n", svg);
  return st;
}

// ferry plan --resident: the resident plan of one GPU alone (fy_plan_search_resident), the run an
// offloaded plan is compared with.
static fy_status plan_resident(const struct fy_opt_config *cfg, const struct plan_args *a, const struct fy_probe *probe,
                               struct fy_plan *best, int *tried) {
  if (strcmp(probe->device, "cuda") != 0 || a->gpus > 1 || a->nodes || a->offload_only || a->lag || a->state)
    return fy_error_set(FY_ERR_INVALID, "--resident plans the whole model on one GPU (--device cuda), without "
                        "--offload, --gpus, --nodes, --optimizer-lag or --optimizer-state");
  fy_status st = fy_plan_search_resident(cfg, a->model, a->batch, a->seq, a->precision, probe, best, tried);
  return st == FY_ERR_NOMEM ? fy_error_wrap(st, "--resident (ferry plan without it offloads the model)") : st;
}

// ferry plan on the machine described: the fastest plan, explained (and written with --out), then
// what --largest, --profile and --svg ask for.
static fy_status plan_and_explain(const struct plan_args *a, const struct fy_probe *probe) {
  struct fy_opt_config cfg;
  struct fy_plan best;
  int tried = 0;
  struct stat sb;
  FY_TRY(stat(a->model, &sb) == 0 ? fy_ckpt_config_read(a->model, &cfg) : fy_opt_preset(a->model, &cfg));
  // A mixture of experts is planned where it trains (runtime/run.c; planner/plan.c, fy_plan_refused):
  // on sim and on GPUs, with data-parallel ranks (on sim its expert-parallel size searched), tensor
  // parallelism (each expert split: core/opt.c) and pipeline stages, searched or fixed. Not on a
  // cluster: the expert pattern's all-to-alls are priced at one link.
  if (cfg.num_local_experts > 0) {
    const bool sim = strcmp(probe->device, "sim") == 0, cuda = strcmp(probe->device, "cuda") == 0;
    if (!sim && !cuda)
      return fy_error_set(FY_ERR_UNSUPPORTED, "%s is a mixture of experts: plans are made for --device sim and cuda "
                          "(the cpu device trains it resident without a plan)", a->model);
    if (a->nodes)
      return fy_error_set(FY_ERR_UNSUPPORTED, "%s is a mixture of experts: its plans are made for the ranks of one "
                          "machine, not a cluster (--nodes): not supported yet", a->model);
  }
  // The cluster's links default to the probe's collectives' bandwidth.
  const double comm = fy_probe_comm_gbps(probe);
  const struct fy_plan_grid grid = {
      .cluster = {.nodes = (int)a->nodes, .gpus_per_node = (int)a->gpus_per_node,
                  .intra_gbps = a->nodes ? (a->intra_gbps > 0 ? a->intra_gbps : comm) : 0,
                  .inter_gbps = a->nodes ? (a->inter_gbps > 0 ? a->inter_gbps : comm) : 0},
      .dp = (int)a->dp, .pp = (int)a->pp, .tp = (int)a->tp};
  if (a->resident_only)
    FY_TRY(plan_resident(&cfg, a, probe, &best, &tried));
  else
    FY_TRY(fy_plan_search_grid(&cfg, a->model, a->batch, a->seq, (int)a->gpus, a->offload_only, a->precision,
                               (int)a->lag, a->state, &grid, probe, &best, &tried));
  fy_plan_print(&best, stdout);
  printf("  (%d plans simulated)\n", tried);
  if (best.refused[0]) {  // (priced for comparison: no run line)
  } else if (best.pp > 1) {  // (how to run it: the plan file, and the same layout spelled out)
    const bool gpu = strcmp(probe->device, "cuda") == 0;
    printf("  run it: mpirun -np %d ./build/ferry train --plan %s%s --data DIR\n", best.dp * best.pp * best.tp,
           a->out ? a->out : "FILE", gpu ? " --device cuda" : "");
    printf("     or: mpirun -np %d ./build/ferry train --device cpu --model %s --data DIR --batch %lld --grad-accum %lld "
           "--seq %lld --pp %d --tp %d%s%s  (the cpu device's pipelines; dp %d replicated)\n", best.dp * best.pp * best.tp,
           a->model, (long long)best.k.micro_batch, (long long)best.k.grad_accum, (long long)best.k.seq, best.pp, best.tp,
           best.k.recompute ? " --recompute" : "", best.k.precision[0] ? (strcmp(best.k.precision, "bf16") == 0 ?
           " --precision bf16" : "") : "", best.dp);
  } else if (best.dp * best.tp > 1) {
    printf("  run it: mpirun -np %d ./build/ferry train --plan %s%s --data DIR%s\n", best.dp * best.tp,
           a->out ? a->out : "FILE", strcmp(probe->device, "cuda") == 0 ? " --device cuda" : "",
           best.ep > 1 ? "  (its ep: the plan file's)" : "");
  }
  say_when_clipping(&best);
  say_bigger_batch(&cfg, a->model, a->batch, a->seq, (int)a->gpus, a->offload_only, a->precision, (int)a->lag, a->state,
                   probe, &best);
  const double x = fy_probe_gemm_gflops(probe, true) / fy_probe_gemm_gflops(probe, false);
  if (strcmp(best.k.precision, "bf16") == 0 && strcmp(probe->device, "cuda") != 0 && x <= 1.0)
    printf("  (this processor multiplies bf16 as fp32: a bf16 step runs its products at the fp32 rate and rounds each "
           "tensor besides, slower than an fp32 step here)\n");
  else if (strcmp(best.k.precision, "fp32") == 0 && x >= 1.2)
    printf("  (this %s multiplies bf16 %.1fx as fast as fp32: ferry plan --precision bf16 plans for that)\n",
           strcmp(probe->device, "cuda") == 0 ? "GPU" : "processor", x);
  if (a->out) {
    FY_TRY(fy_plan_write(a->out, &best));
    printf("ferry: wrote the plan to %s\n", a->out);
  }
  if (a->largest)
    largest_by_state(a->batch, a->seq, (int)a->gpus, a->offload_only, a->precision, (int)a->lag, probe);
  if (a->profile) FY_TRY(print_op_profile(&cfg, &best, probe));
  if (a->svg) FY_TRY(draw_plan(&cfg, &best, probe, a->svg));
  return FY_OK;
}

int cmd_probe_or_plan(int argc, char **argv, bool plan) {
  const char *cmd = plan ? "plan" : "probe";
  struct plan_args a;
  int rc = parse_plan_args(argc, argv, plan, &a);
  if (rc >= 0) return rc;
  struct fy_probe probe;
  bool measured;
  fy_status st = load_machine(&a.machine, &probe, &measured);
  if (st == FY_OK && plan && a.gpus > 1) share_by_ranks(&a.machine, a.gpus, &probe);
  if (st == FY_OK && !plan) {
    fy_probe_print(&probe, stdout);
    if (measured) printf("(measured now%s)\n", a.machine.no_write ? "" : "; cached");
    return 0;
  }
  if (st == FY_OK) st = plan_and_explain(&a, &probe);
  if (st != FY_OK) {
    fprintf(stderr, "ferry %s: error: %s\n", cmd, fy_error_msg());
    return 1;
  }
  return 0;
}
