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

int cmd_probe_or_plan(int argc, char **argv, bool plan) {
  enum { P_DEVICE = 300, P_DEVICE_MEM, P_LINK, P_DISK, P_FILE, P_REMEASURE, P_NO_WRITE, P_SET, P_MODEL, P_BATCH,
         P_SEQ, P_OUT, P_SVG, P_GPUS, P_HELP, P_OVR, P_PROFILE, P_OFFLOAD, P_PRECISION, P_LAG, P_STATE, P_LARGEST };
  static const struct option opts[] = {
      {"device", required_argument, 0, P_DEVICE}, {"device-mem", required_argument, 0, P_DEVICE_MEM},
      {"sim-link-gbps", required_argument, 0, P_LINK}, {"disk-dir", required_argument, 0, P_DISK},
      {"probe-file", required_argument, 0, P_FILE}, {"remeasure", no_argument, 0, P_REMEASURE},
      {"no-write", no_argument, 0, P_NO_WRITE}, {"set", required_argument, 0, P_SET},
      {"model", required_argument, 0, P_MODEL}, {"batch", required_argument, 0, P_BATCH},
      {"seq", required_argument, 0, P_SEQ}, {"out", required_argument, 0, P_OUT}, {"svg", required_argument, 0, P_SVG},
      {"gpus", required_argument, 0, P_GPUS}, {"help", no_argument, 0, P_HELP},
      {"profile", no_argument, 0, P_PROFILE}, {"offload", no_argument, 0, P_OFFLOAD},
      {"optimizer-lag", required_argument, 0, P_LAG},
      {"precision", required_argument, 0, P_PRECISION},
      {"optimizer-state", required_argument, 0, P_STATE}, {"largest", no_argument, 0, P_LARGEST},
      // Overrides by their own names.
      {"host-mem", required_argument, 0, P_OVR}, {"device-tflops", required_argument, 0, P_OVR},
      {"device-gflops", required_argument, 0, P_OVR}, {"host-gflops", required_argument, 0, P_OVR},
      {"link-gbps", required_argument, 0, P_OVR}, {"h2d-gbps", required_argument, 0, P_OVR},
      {"d2h-gbps", required_argument, 0, P_OVR}, {"host-adamw-gbps", required_argument, 0, P_OVR},
      {"host-mem-gbps", required_argument, 0, P_OVR}, {"disk-read-gbps", required_argument, 0, P_OVR},
      {"disk-write-gbps", required_argument, 0, P_OVR}, {"comm-gbps", required_argument, 0, P_OVR},
      {"disk-space", required_argument, 0, P_OVR},
      {"bf16-speedup", required_argument, 0, P_OVR}, {"device-mem-gbps", required_argument, 0, P_OVR},
      {"device-peak-tflops", required_argument, 0, P_OVR},
      {0, 0, 0, 0}};
  const char *cmd = plan ? "plan" : "probe";
  struct machine_args a = {0};
  const char *model = "opt-125m", *out = NULL, *svg = NULL, *precision = NULL, *state = NULL;
  int64_t batch = 8, seq = 1024, gpus = 1;
  bool profile = false, offload_only = false, largest = false;
  int64_t lag = 0;
  int c, idx = 0;
  optind = 1;
  opterr = 0;
  static char keybuf[32][32];
  while ((c = getopt_long(argc, argv, ":", opts, &idx)) != -1) {
    bool ok = true;
    switch (c) {
      case P_DEVICE: a.device = optarg; break;
      case P_DEVICE_MEM: ok = parse_size("--device-mem", optarg, &a.device_mem); break;
      case P_LINK: {
        float f = 0;
        ok = parse_f32("--sim-link-gbps", optarg, 0, &f);
        a.link = f;
        break;
      }
      case P_DISK: a.disk_dir = optarg; break;
      case P_FILE: a.file = optarg; break;
      case P_REMEASURE: a.remeasure = true; break;
      case P_NO_WRITE: a.no_write = true; break;
      case P_SET: {
        char *eq = strchr(optarg, '=');
        if (!eq || a.n_set == 32) { fprintf(stderr, "ferry %s: --set needs key=value\n", cmd); return 2; }
        *eq = 0;
        a.set_key[a.n_set] = optarg;
        a.set_val[a.n_set++] = eq + 1;
        ok = override_ok(cmd, a.set_key[a.n_set - 1], eq + 1);
        break;
      }
      case P_OVR:
        if (a.n_set == 32) return 2;
        snprintf(keybuf[a.n_set], sizeof keybuf[0], "%s", opts[idx].name);
        for (char *q = keybuf[a.n_set]; *q; q++) if (*q == '-') *q = '_';
        a.set_key[a.n_set] = keybuf[a.n_set];
        a.set_val[a.n_set++] = optarg;
        ok = override_ok(cmd, keybuf[a.n_set - 1], optarg);
        break;
      case P_MODEL: model = optarg; break;
      case P_BATCH: ok = parse_i64("--batch", optarg, 1, &batch); break;
      case P_SEQ: ok = parse_i64("--seq", optarg, 1, &seq); break;
      case P_OUT: out = optarg; break;
      case P_SVG: svg = optarg; break;
      case P_GPUS: ok = parse_i64("--gpus", optarg, 1, &gpus); break;
      case P_PROFILE: profile = true; break;
      case P_OFFLOAD: offload_only = true; break;
      case P_LAG:
        if (!plan) {
          fprintf(stderr, "ferry probe: --optimizer-lag is ferry plan's\n");
          return 2;
        }
        ok = parse_i64("--optimizer-lag", optarg, 0, &lag) && (lag <= 1 || (fprintf(stderr, "ferry plan: "
             "--optimizer-lag %lld: 0 or 1\n", (long long)lag), false));
        break;
      case P_STATE:
      case P_LARGEST:
        if (!plan) {
          fprintf(stderr, "ferry probe: %s is ferry plan's\n", argv[optind - 1]);
          return 2;
        }
        if (c == P_LARGEST) {
          largest = true;
        } else {
          enum fy_state_format sf;
          if (!fy_state_format_from_name(optarg, &sf)) {
            fprintf(stderr, "ferry plan: --optimizer-state %s: fp32, bf16 or 8bit\n", optarg);
            return 2;
          }
          state = optarg;
        }
        break;
      case P_PRECISION:
        if (!plan) {
          fprintf(stderr, "ferry probe: --precision is ferry plan's (the probe measures both bf16 and fp32 products)\n");
          return 2;
        }
        enum fy_dtype dt;
        if (!fy_precision_dtype(optarg, &dt)) {
          fprintf(stderr, "ferry plan: --precision %s: fp32, bf16 or fp16\n", optarg);
          return 2;
        }
        precision = optarg;
        break;
      case P_HELP:
        usage_probe_or_plan(cmd, plan);
        return 0;
      case ':': fprintf(stderr, "ferry %s: %s needs a value\n", cmd, argv[optind - 1]); return 2;
      default: fprintf(stderr, "ferry %s: unknown option '%s' (see 'ferry %s --help')\n", cmd, argv[optind - 1], cmd); return 2;
    }
    if (!ok) return 2;
  }
  struct fy_probe probe;
  bool measured;
  fy_status st = load_machine(&a, &probe, &measured);
  // The --gpus ranks share this machine's memory and disk, as ferry train's ranks do (each takes
  // its share by default): each rank is planned with its share, unless given.
  if (st == FY_OK && plan && gpus > 1) {
    bool host_given = false, disk_given = false;
    for (int i = 0; i < a.n_set; i++) {
      host_given |= strcmp(a.set_key[i], "host_mem") == 0;
      disk_given |= strcmp(a.set_key[i], "disk_space") == 0;
    }
    if (!host_given) probe.host_mem = floor(probe.host_mem / (double)gpus);
    if (!disk_given) probe.disk_space = floor(probe.disk_space / (double)gpus);
  }
  if (st == FY_OK && !plan) {
    fy_probe_print(&probe, stdout);
    if (measured) printf("(measured now%s)\n", a.no_write ? "" : "; cached");
    return 0;
  }
  struct fy_opt_config cfg;
  struct fy_plan best;
  int tried = 0;
  if (st == FY_OK) {
    struct stat sb;
    st = stat(model, &sb) == 0 ? fy_ckpt_config_read(model, &cfg) : fy_opt_preset(model, &cfg);
  }
  if (st == FY_OK)
    st = fy_plan_search_state(&cfg, model, batch, seq, (int)gpus, offload_only, precision, (int)lag, state, &probe, &best,
                              &tried);
  if (st == FY_OK) {
    fy_plan_print(&best, stdout);
    printf("  (%d plans simulated)\n", tried);
    say_bigger_batch(&cfg, model, batch, seq, (int)gpus, offload_only, precision, (int)lag, state, &probe, &best);
    const double x = fy_probe_gemm_gflops(&probe, true) / fy_probe_gemm_gflops(&probe, false);
    if (strcmp(best.k.precision, "bf16") == 0 && strcmp(probe.device, "cuda") != 0 && x <= 1.0)
      printf("  (this processor multiplies bf16 as fp32: a bf16 step runs its products at the fp32 rate and rounds each "
             "tensor besides, slower than an fp32 step here)\n");
    else if (strcmp(best.k.precision, "fp32") == 0 && x >= 1.2)
      printf("  (this %s multiplies bf16 %.1fx as fast as fp32: ferry plan --precision bf16 plans for that)\n",
             strcmp(probe.device, "cuda") == 0 ? "GPU" : "processor", x);
    if (out && (st = fy_plan_write(out, &best)) == FY_OK) printf("ferry: wrote the plan to %s\n", out);
  }
  if (st == FY_OK && largest) largest_by_state(batch, seq, (int)gpus, offload_only, precision, (int)lag, &probe);
  if (st == FY_OK && profile) {
    struct fy_graph *g;
    st = fy_opt_build_graph(&cfg, best.k.micro_batch, best.k.seq, &g);
    if (st == FY_OK) {
      if (best.k.recompute) fy_graph_set_recompute(g, true);
      double t[FY_OP_KIND_COUNT][2] = {{0}}, fl[FY_OP_KIND_COUNT] = {0}, act[FY_OP_KIND_COUNT] = {0};
      int n[FY_OP_KIND_COUNT] = {0};
      enum fy_dtype cdt = FY_F32;
      fy_precision_dtype(fy_cost_precision(&best.k, probe.device), &cdt);
      const int ab = strcmp(probe.device, "cuda") == 0 && cdt == FY_BF16 ? 2 : 4;
      for (int o = 0; o < g->n_ops; o++) {
        struct fy_op_profile pr;
        fy_profile_op(g, o, &probe, ab, cdt, &pr);
        int kd = g->ops[o].kind;
        n[kd]++;
        t[kd][0] += pr.seconds[0];
        t[kd][1] += pr.seconds[1];
        fl[kd] += pr.flops[0] + pr.flops[1];
        act[kd] += pr.act_bytes;
      }
      printf("profile of one micro-batch (%lld x %lld):\n  %-14s %5s %12s %12s %12s %12s\n", (long long)best.k.micro_batch,
             (long long)best.k.seq, "op kind", "ops", "GFLOP", "act MiB", "fwd ms", "bwd ms");
      for (int kd = 0; kd < FY_OP_KIND_COUNT; kd++)
        if (n[kd])
          printf("  %-14s %5d %12.2f %12.1f %12.3f %12.3f\n", fy_op_kind_name(kd), n[kd], fl[kd] / 1e9,
                 act[kd] / 1048576.0, t[kd][0] * 1e3, t[kd][1] * 1e3);
      fy_graph_free(g);
    }
  }
  if (st == FY_OK && svg && best.k.resident) {
    printf("ferry: --svg draws an offloaded step's streams and cache; this plan is resident (no copies or cache to "
           "draw): %s not written (--offload plans it offloaded)\n", svg);
  } else if (st == FY_OK && svg) {
    struct fy_device *tl;
    struct fy_cost cst;
    st = fy_cost_simulate(&cfg, &best.k, &probe, &cst, &tl);
    if (st == FY_OK) {
      st = fy_cost_svg(tl, &cst, svg);
      fy_device_free(tl);
      if (st == FY_OK) printf("ferry: drew the step in %s\n", svg);
    }
  }
  if (st != FY_OK) {
    fprintf(stderr, "ferry %s: error: %s\n", cmd, fy_error_msg());
    return 1;
  }
  return 0;
}
