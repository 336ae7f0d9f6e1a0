// ferry: the command line. `ferry train`, `ferry eval`, `ferry --help`.
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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
#include "runtime/trainer.h"
#include "fy_config.h"

#define FERRY_VERSION "0.1.0"

static bool parse_i64(const char *flag, const char *s, int64_t min, int64_t *out);
static bool parse_f32(const char *flag, const char *s, float min, float *out);
static bool parse_size(const char *flag, const char *s, size_t *out);

// Stopping a run. The first SIGINT, SIGTERM or SIGHUP (its terminal closed; unless ignored, as
// under nohup) asks the trainer to stop after the current step (and checkpoint); a second one ends
// the process at once, by the signal's own default action, as an unhandled signal would.
// Checkpoints are renamed into place whole, so nothing is left half-written.
//
// The signals are taken by one thread of ours in sigwait(), blocked in every other thread (which
// inherit the mask: it is set before the run starts any). A handler instead would run on whatever
// thread the kernel picks, on that thread's stack pointer as it is at that instant, and oneDNN's
// JIT GEMM kernels point rsp into heap memory while they run: the signal frame landed there
// (AddressSanitizer caught it in about one second signal of seven during a GEMM).
static atomic_int stop_requested = 0;
static atomic_bool stop_armed = false;  // a run has started: the first signal asks it to stop

static void stop_or_exit(int sig) {
  if (atomic_load(&stop_armed) && !atomic_exchange(&stop_requested, 1)) {
    static const char msg[] = "\nferry: stopping after this step (again to stop now)\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    return;
  }
  signal(sig, SIG_DFL);  // end as the signal ends a process that does not handle it
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, NULL);
  raise(sig);
  _exit(128 + sig);
}

static void *stop_signal_thread(void *arg) {
  const sigset_t *set = arg;
  for (;;) {
    int sig;
    if (sigwait(set, &sig) == 0) stop_or_exit(sig);
  }
  return NULL;
}

// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and so in every thread it starts from now on)
// and starts the thread that takes them; stop_or_exit is also their handler, for a thread that was
// started before the mask was set (by a library: none is now). Until a run sets stop_armed, a
// signal ends the process at once. A SIGHUP that is ignored (nohup) stays ignored.
static void stop_signals_start(void) {
  static sigset_t set;
  sigemptyset(&set);
  struct sigaction sa = {.sa_handler = stop_or_exit}, hup;
  sigemptyset(&sa.sa_mask);
  const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; i++) {
    if (sigs[i] == SIGHUP && (sigaction(SIGHUP, NULL, &hup) != 0 || hup.sa_handler == SIG_IGN)) continue;
    sigaddset(&set, sigs[i]);
    sigaction(sigs[i], &sa, NULL);
  }
  pthread_t t;
  if (pthread_sigmask(SIG_BLOCK, &set, NULL) != 0 || pthread_create(&t, NULL, stop_signal_thread, &set) != 0) {
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);  // no thread: the handler takes them where they land
    return;
  }
  pthread_detach(t);
}

static int cmd_export(int argc, char **argv) {
  if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
    printf("usage: ferry export CHECKPOINT OUTDIR\n\n"
           "Writes a Hugging Face model directory (config.json, model.safetensors or shards) that\n"
           "OPTForCausalLM.from_pretrained loads, from a training checkpoint: its root (the\n"
           "latest step) or one step directory.\n");
    return 0;
  }
  if (argc != 3) {
    fprintf(stderr, "usage: ferry export CHECKPOINT OUTDIR\n");
    return 2;
  }
  fy_status st = fy_export(argv[1], argv[2]);
  if (st != FY_OK) {
    fprintf(stderr, "ferry export: error: %s\n", fy_error_msg());
    return 1;
  }
  printf("ferry: exported %s to %s\n", argv[1], argv[2]);
  return 0;
}

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
// the first that fits wins: one search each until then).
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
      printf("  --optimizer-state %-4s  %-9s host %s, disk %s, %.0f tokens/s predicted\n", fmts[f], found,
             fy_format_bytes(p.predicted.host_bytes, hb, sizeof hb), fy_format_bytes(p.predicted.disk_bytes, db, sizeof db),
             p.predicted.tokens_per_s);
    else
      printf("  --optimizer-state %-4s  none\n", fmts[f]);
  }
}

static int cmd_probe_or_plan(int argc, char **argv, bool plan) {
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
        printf("usage: ferry %s [options]\n\n", cmd);
        if (plan)
          printf("Chooses the plan (micro-batch, chunk size, device cache blocks, prefetch, recomputation,\n"
                 "optimizer state on host or disk) that the cost model predicts fastest, and explains it.\n"
                 "On a GPU (--device cuda) a model that fits whole is planned resident: weights, gradients,\n"
                 "AdamW state and activations on the GPU, as ferry train --device cuda runs it without\n"
                 "--offload (several ranks: replicas); else it is offloaded.\n\n"
                 "  --model M          preset, config directory or ferry checkpoint (default opt-125m)\n"
                 "  --batch B          sequences per step (default 8); --seq T tokens each (default 1024)\n"
                 "  --out FILE         write the plan as JSON (ferry train --plan FILE runs it)\n"
                 "  --svg FILE         draw the predicted step: streams as lanes, and device memory\n"
                 "  --profile          each operator kind's FLOPs, memory and predicted time\n"
                 "  --gpus N           ranks (default 1): every dp x tp grid is tried, tensor-parallel\n"
                 "                     ranks splitting each layer, data-parallel ones sharding the\n"
                 "                     chunks; --batch is then the global batch (run the plan with\n"
                 "                     mpirun -np N ferry train --plan FILE)\n"
                 "  --comm-gbps X      collectives between ranks (default: derived, see ferry probe)\n"
                 "  --offload          offloaded plans only (a GPU's default also tries it resident)\n"
                 "  --precision P      the compute the plan is for: fp32 (default on cpu, sim), bf16\n"
                 "                     (default on cuda; its products at bf16_speedup x the fp32 rate)\n"
                 "                     or fp16 (cpu, sim); ferry train --plan FILE runs it in P\n"
                 "  --optimizer-lag N  1: plans for the one-step-delayed update (ferry train --optimizer-lag\n"
                 "                     1: each step's host updates under the next step; 16-bit, offloaded,\n"
                 "                     no accumulation); the plan file runs with it. Default 0\n"
                 "  --optimizer-state F  plans for AdamW state stored as fp32 (default), bf16 or 8bit\n"
                 "                     (ferry train --optimizer-state F; offloaded plans only unless fp32)\n"
                 "  --largest          then, for each state format, the largest preset this machine\n"
                 "                     trains at this batch, sequence, precision and ranks\n");
        else
          printf("Measures device memory, GEMM rates (fp32, and bf16 where the processor multiplies\n"
                 "bf16: bf16_speedup), copy bandwidth each way, host AdamW and memory bandwidth and disk\n"
                 "rates, and caches them (default ~/.cache/ferry/probe.json).\n"
                 "--device cuda measures GPU 0 (free memory, bf16 and fp32 GEMM rates, memory bandwidth,\n"
                 "pinned copies) when this machine has one and ferry was built with CUDA; else the CPU\n"
                 "stands in as the sim device and the GPU's figures are yours to give (--device-tflops,\n"
                 "--link-gbps, --device-mem-gbps).\n\n");
        printf("machine (the probe, then overrides):\n"
               "  --device cpu|sim|cuda   --device-mem SIZE   --sim-link-gbps X   --disk-dir DIR\n"
               "  --probe-file PATH  --remeasure  --no-write\n"
               "  --host-mem SIZE (each rank's; default: this machine's, shared by the --gpus ranks)\n"
               "  --device-tflops X --device-gflops X --host-gflops X --link-gbps X\n"
               "  --h2d-gbps X --d2h-gbps X --host-adamw-gbps X --host-mem-gbps X --disk-read-gbps X\n"
               "  --disk-write-gbps X   --comm-gbps X   --bf16-speedup X   --device-mem-gbps X\n"
               "  --device-peak-tflops X (the device's dense peak, MFU's other denominator; default:\n"
               "                     a CPU's FMA peak measured, a known GPU's data-sheet figure)\n"
               "  --disk-space SIZE  (what the disk tier may fill for each rank; default: the free space\n"
               "                     of the disk directory now, shared by the --gpus ranks; 0: no bound)\n"
               "  --set key=value (any probe field)\n"
               "  (device rates are in the device's default precision: a GPU's bf16, a CPU's fp32)\n");
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

static void usage_main(FILE *f) {
  fprintf(f,
          "usage: ferry <command> [options]\n"
          "\n"
          "Trains OPT language models (Hugging Face's OPTForCausalLM) on the CPU or a GPU, with the\n"
          "model state on the device, in host memory or on disk, on one rank or several.\n"
          "\n"
          "commands:\n"
          "  train     train a model (with no options: the demo model on the bundled corpus)\n"
          "  eval      mean loss of a model on token shards\n"
          "  export    write a Hugging Face model directory from a training checkpoint\n"
          "  sample    continue a prompt with a model (what has it learnt?)\n"
          "  probe     measure this machine for the planner (cached in a file you can edit)\n"
          "  plan      choose and explain a plan: memory per tier, step time, MFU, bottleneck\n"
          "  presets   list the built-in model presets\n"
          "  version   print the version\n"
          "\n"
          "Run 'ferry <command> --help' for a command's options.\n");
}

static void usage_train(FILE *f, bool eval) {
  struct fy_train_opts d;
  fy_train_opts_defaults(&d);
  if (eval)
    fprintf(f, "usage: ferry eval [--model M] [--init DIR] [--data PATH] [options]\n\n"
               "Prints the mean loss over --batches batches of the data, taken in order.\n\n");
  else
    fprintf(f, "usage: ferry train [options]\n\n"
               "Trains with AdamW, a linear warmup and a decay of the learning rate (--schedule).\n"
               "With no options it trains the demo model on the bundled corpus for a few minutes.\n\n");
  fprintf(f,
          "model and data:\n"
          "  --model M          a preset (ferry presets) or a directory with config.json\n"
          "                     (default: the --init checkpoint's config, else opt-demo)\n"
          "  --init I           'random' (OPT's initialisation, default), a Hugging Face model\n"
          "                     directory (model.safetensors or a sharded index) or a ferry\n"
          "                     checkpoint (its latest step's weights)\n"
          "  --data PATH        a token shard, a directory of *.bin shards or a glob\n"
          "                     (default: %s)\n"
          "  --batch B          sequences per micro-batch (default %lld)\n"
          "  --seq T            tokens per sequence (default %d, or the model's positions if fewer)\n"
          "  --threads N        OpenMP threads (default: all cores, or under mpirun the ranks' share)\n"
          "  --seed S           seed for initialisation and shuffling (default %llu)\n",
          d.data, (long long)d.batch, FY_DEFAULT_SEQ, (unsigned long long)d.seed);
  if (eval) {
    fprintf(f,
            "  --batches N        batches to average over (default %lld)\n"
            "  --dump FILE        write the first batch's input_ids and logits (safetensors; cpu)\n"
            "  --device D         cpu (default), cuda (the whole model on the GPU) or sim (offloaded)\n"
            "  --offload          with --device cuda: the chunks through a device cache, as training\n"
            "                     offloads them (a model bigger than the GPU); in bf16 the host holds\n"
            "                     the weights in bf16 alone (2 bytes a parameter)\n"
            "  --device-mem SIZE  device memory to use (default: all of a GPU's, 1GiB on sim)\n"
            "  --host-mem SIZE    host memory for the offloaded weights (default: the machine's)\n"
            "  --precision P      fp32 (default on cpu, sim), bf16 (default on cuda) or fp16 (cpu,\n"
            "                     sim): the forward in P, as training with it runs\n"
            "  --recompute        (accepted, and always so: evaluation keeps one layer's\n"
            "                     activations at a time, and no gradients)\n"
            "\nseveral ranks (mpirun -np N ferry eval ... or srun):\n"
            "  --comm K           auto (default: mpi under mpirun/srun), single or mpi\n"
            "  --comm-timeout S   seconds a collective may take before the job is aborted (default 300)\n"
            "  --tp N             groups of N consecutive ranks split each layer's attention heads and\n"
            "                     feed-forward features, as ferry train --tp does (default 1)\n"
            "  Each group reads its own --batch sequences of every batch (the mean is over all of\n"
            "  them: --batches batches of groups x --batch); rank 0 prints it.\n",
            (long long)d.eval_batches);
    return;
  }
  fprintf(f,
          "\ntraining:\n"
          "  --steps N          optimizer steps (default %lld)\n"
          "  --grad-accum K     micro-batches per step (default 1)\n"
          "  --lr X             peak learning rate (default %g)\n"
          "  --min-lr X         final learning rate of the decay (default lr/10)\n"
          "  --warmup N         linear warmup steps (default steps/20)\n"
          "  --schedule S       after the warmup: cosine (default) or linear from --lr down to\n"
          "                     --min-lr at the last step, or constant\n"
          "  --weight-decay X   AdamW decoupled weight decay on matrices and embeddings (default %g)\n"
          "  --beta1 X, --beta2 X, --eps X   AdamW (defaults %g, %g, %g)\n"
          "  --clip X           clip the global gradient norm to X; 0 disables (default %g)\n"
          "  --no-shuffle       take batches in order instead of a seeded shuffle\n"
          "  --loss-scale S     dynamic loss scaling from S (a power of two; 'dynamic' = 65536): an\n"
          "                     overflowing step is skipped and the scale halved; the numbers are\n"
          "                     otherwise those of no scaling, bit for bit\n"
          "  --precision P      fp32 (default on cpu, sim), bf16 (default on cuda) or fp16 (cpu, sim):\n"
          "                     weights, activations and gradients in P (on cpu and sim rounded to P\n"
          "                     at every op), fp32 master weights and AdamW state; offloaded chunks\n"
          "                     cross the link in P; fp16 scales the loss dynamically from 65536\n"
          "                     unless --loss-scale is given\n"
          "  --recompute        keep only each decoder layer's input and run its forward again in\n"
          "                     backward (activation memory of one layer instead of all)\n"
          "  --dropout P        drop the residual branches with probability P while training, where\n"
          "                     transformers' OPT does (after out_proj and fc2); 'config' takes the\n"
          "                     model's config.json value (0.1 for the published OPT); default 0\n"
          "                     (none). The masks follow --seed and the data: any placement, plan\n"
          "                     or number of ranks draws the same ones\n"
          "\nwhere the model state lives:\n"
          "  --device D         cpu (default: everything in host memory), sim (a device with its\n"
          "                     own memory that holds only a cache of parameter chunks) or cuda\n"
          "                     (GPU 0, everything resident unless --offload; when built with CUDA)\n"
          "  --offload          cuda: the model state in (pinned) host memory and a cache of chunks\n"
          "                     on the GPU, as the sim device does; the sim options below apply\n"
          "  --device-mem SIZE  sim: the device's memory, e.g. 512MiB (default 1GiB); cuda: its cap\n"
          "                     (default: the GPU's; with --offload 95%% of what it has free)\n"
          "  --sim-link-gbps X  sim: throttle host<->device copies to X GB/s, like PCIe (default: off)\n"
          "  --host-mem SIZE    sim: host memory for parameters, gradients and AdamW state\n"
          "                     (default: the machine's, shared evenly by its ranks)\n"
          "  --disk-dir DIR     sim, cuda --offload: put the AdamW state that --host-mem cannot\n"
          "                     hold under DIR (made if missing)\n"
          "  --disk-chunks N    sim, cuda --offload: put the AdamW state of the last N chunks on disk\n"
          "                     (default: auto)\n"
          "  --device-chunks N  sim, cuda --offload: keep the first N chunks and their AdamW state on\n"
          "                     the device and update them there (default 0: on host threads)\n"
          "  --optimizer-lag N  1: each step's update runs under the next step, which uses the weights\n"
          "                     before it (a one-step-delayed update, as ZeRO-Offload's; different\n"
          "                     numbers, so opt-in); offloaded runs with --precision bf16 or fp16 and\n"
          "                     no --grad-accum, and cpu; pending updates are applied before a\n"
          "                     checkpoint and at the end. 0 (default): the exact step\n"
          "  --optimizer-state F  how AdamW's m and v are stored: fp32 (default, 8 bytes a\n"
          "                     parameter), bf16 (4) or 8bit (block-wise quantised, 2.03); on the\n"
          "                     cpu and offloaded (host, disk and device chunks), not on a resident\n"
          "                     GPU nor with --tp. Resuming in another format converts (a warning)\n"
          "  --prefetch N       sim, cuda --offload: chunks loaded ahead of use (default 2)\n"
          "  --blocks N         sim, cuda --offload: device cache blocks (default: as many as fit)\n"
          "  --chunk-mib X      sim, cuda --offload: chunk size (default: the smallest that holds the largest\n"
          "                     parameter group, the token embedding)\n"
          "  --plan auto|FILE   let the planner choose micro-batch, chunks, blocks, prefetch,\n"
          "                     recomputation and disk placement (see ferry plan), or run a plan file;\n"
          "                     on cuda: auto measures GPU 0 (ferry probe --device cuda),\n"
          "                     or a FILE from ferry plan --device cuda (resident or offloaded);\n"
          "                     several ranks plan alike from rank 0's machine\n"
          "  --save DIR         write a Hugging Face model (config.json, model.safetensors) at the end;\n"
          "                     with --save-every, DIR holds training checkpoints instead\n"
          "  --save-every N     write a training checkpoint (weights, AdamW state, step, data\n"
          "                     position) every N steps and at the end, in the background (an\n"
          "                     offloaded state that fills the host memory: from the state itself,\n"
          "                     while training waits)\n"
          "  --keep N           checkpoints kept in DIR (default 2)\n"
          "  --resume PATH      continue from a checkpoint (its root or a step directory) and its\n"
          "                     model (no --model needed); --steps counts from the start of training\n"
          "  --stop-after N     end this run after N steps (with a checkpoint): for time-limited jobs\n"
          "  --val-data PATH    validation shards: the mean loss over their first --val-batches batches\n"
          "                     (in order; no dropout) every --val-every steps and after the last,\n"
          "                     printed and logged as val_loss\n"
          "  --val-every N      steps between validations (default: steps/10)\n"
          "  --val-batches K    batches per validation (default %lld)\n"
          "  --log FILE         one JSON line per step\n"
          "  --quiet            no step lines\n"
          "  --profile          at the end, where a step's time went (per op kind and phase)\n"
          "\nseveral ranks (mpirun -np N ferry train ... or srun):\n"
          "  --comm K           auto (default: mpi under mpirun/srun), single or mpi\n"
          "  --comm-timeout S   seconds a collective may take before the job is aborted (default 300)\n"
          "  --tp N             tensor parallelism (--device cpu, sim, cuda): groups of N consecutive\n"
          "                     ranks split each layer's attention heads and feed-forward features\n"
          "                     (Megatron's column/row split; on GPUs their sums go through NCCL, and\n"
          "                     without --offload each rank's slices and their AdamW state stay on\n"
          "                     its GPU); the groups are data-parallel (default 1; several groups on\n"
          "                     GPUs need --offload)\n"
          "  Each rank takes its own --batch sequences of every global batch; gradients are summed\n"
          "  across ranks; rank 0 prints, logs and saves. --device cpu replicates the parameters, and\n"
          "  so does --device cuda, one GPU per rank (the gradients summed through NCCL); --device\n"
          "  sim shards every chunk across the ranks (ZeRO-3: each rank keeps and updates 1/N of the\n"
          "  weights, gradients and AdamW state; --device-chunks 0 keeps the shards in the host\n"
          "  tier, a number >= the chunks keeps them on the device); so does --device cuda\n"
          "  --offload, one GPU per rank, the blocks gathered and reduce-scattered through NCCL.\n"
          "\nSIGINT, SIGTERM or SIGHUP (unless ignored: nohup) ends the run after the current step,\n"
          "with a checkpoint when --save-every is on; a second one ends it at once (checkpoints are\n"
          "written atomically). Losing standard output (a pipe's reader ending) stops it as the first\n"
          "signal does.\n"
          "\nEach step prints: step, loss, learning rate, gradient norm, tokens/s, model GFLOP/s\n"
          "(as PaLM and Megatron count them: 6 x non-embedding parameters x tokens, the lm_head's\n"
          "product once, attention's 12 x layers x width x sequence a token; --log's JSON adds\n"
          "gflops_llmc, llm.c's count: 6 x all parameters, attention's causal half), peak memory (the\n"
          "device's when offloaded or on a GPU, else the process's resident set), step time.\n",
          (long long)d.steps, d.lr, d.adamw.weight_decay, d.adamw.beta1, d.adamw.beta2, d.adamw.eps,
          d.adamw.clip, (long long)d.val_batches);
}

static bool parse_i64(const char *flag, const char *s, int64_t min, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end || v < min) {
    fprintf(stderr, "ferry: %s needs a whole number >= %lld, got '%s'\n", flag, (long long)min, s);
    return false;
  }
  *out = v;
  return true;
}

static bool parse_f32(const char *flag, const char *s, float min, float *out) {
  char *end;
  errno = 0;
  float v = strtof(s, &end);
  if (errno || end == s || *end || !isfinite(v) || v < min) {
    fprintf(stderr, "ferry: %s needs a number >= %g, got '%s'\n", flag, min, s);
    return false;
  }
  *out = v;
  return true;
}

// Sizes: a number with an optional unit: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (all binary).
static bool parse_size(const char *flag, const char *s, size_t *out) {
  double v;
  if (!fy_parse_size(s, &v)) {
    fprintf(stderr, "ferry: %s needs a size such as 512MiB or 8GiB, got '%s'\n", flag, s);
    return false;
  }
  *out = (size_t)v;
  return true;
}

enum {
  OPT_MODEL = 256, OPT_INIT, OPT_DATA, OPT_BATCH, OPT_SEQ, OPT_ACCUM, OPT_STEPS, OPT_LR, OPT_MIN_LR,
  OPT_WARMUP, OPT_WD, OPT_B1, OPT_B2, OPT_EPS, OPT_CLIP, OPT_SEED, OPT_NO_SHUFFLE, OPT_THREADS,
  OPT_SAVE, OPT_LOG, OPT_QUIET, OPT_BATCHES, OPT_DUMP, OPT_PROFILE, OPT_RECOMPUTE, OPT_DEVICE, OPT_DEVICE_MEM, OPT_LINK, OPT_JITTER, OPT_HOST_MEM,
  OPT_DISK_DIR, OPT_DISK_CHUNKS, OPT_PREFETCH, OPT_BLOCKS, OPT_CHUNK_MIB, OPT_SAVE_EVERY, OPT_KEEP,
  OPT_RESUME, OPT_STOP_AFTER, OPT_PLAN, OPT_DEVICE_CHUNKS, OPT_LOSS_SCALE, OPT_COMM, OPT_COMM_TIMEOUT, OPT_TP, OPT_PRECISION, OPT_OFFLOAD, OPT_DROPOUT, OPT_SCHEDULE, OPT_VAL_DATA, OPT_VAL_EVERY, OPT_VAL_BATCHES, OPT_OPTIMIZER_LAG, OPT_OPTIMIZER_STATE, OPT_HELP,
};

static int cmd_train(int argc, char **argv, bool eval) {
  static const struct option train_opts[] = {
      {"model", required_argument, 0, OPT_MODEL}, {"init", required_argument, 0, OPT_INIT},
      {"data", required_argument, 0, OPT_DATA}, {"batch", required_argument, 0, OPT_BATCH},
      {"seq", required_argument, 0, OPT_SEQ}, {"grad-accum", required_argument, 0, OPT_ACCUM},
      {"steps", required_argument, 0, OPT_STEPS}, {"lr", required_argument, 0, OPT_LR},
      {"min-lr", required_argument, 0, OPT_MIN_LR}, {"warmup", required_argument, 0, OPT_WARMUP},
      {"weight-decay", required_argument, 0, OPT_WD}, {"beta1", required_argument, 0, OPT_B1},
      {"beta2", required_argument, 0, OPT_B2}, {"eps", required_argument, 0, OPT_EPS},
      {"clip", required_argument, 0, OPT_CLIP}, {"seed", required_argument, 0, OPT_SEED},
      {"no-shuffle", no_argument, 0, OPT_NO_SHUFFLE}, {"threads", required_argument, 0, OPT_THREADS},
      {"save", required_argument, 0, OPT_SAVE}, {"log", required_argument, 0, OPT_LOG},
      {"quiet", no_argument, 0, OPT_QUIET}, {"profile", no_argument, 0, OPT_PROFILE},
      {"recompute", no_argument, 0, OPT_RECOMPUTE}, {"device", required_argument, 0, OPT_DEVICE},
      {"device-mem", required_argument, 0, OPT_DEVICE_MEM}, {"sim-link-gbps", required_argument, 0, OPT_LINK},
      {"sim-jitter-us", required_argument, 0, OPT_JITTER}, {"host-mem", required_argument, 0, OPT_HOST_MEM},
      {"disk-dir", required_argument, 0, OPT_DISK_DIR}, {"disk-chunks", required_argument, 0, OPT_DISK_CHUNKS},
      {"prefetch", required_argument, 0, OPT_PREFETCH}, {"blocks", required_argument, 0, OPT_BLOCKS},
      {"chunk-mib", required_argument, 0, OPT_CHUNK_MIB}, {"save-every", required_argument, 0, OPT_SAVE_EVERY},
      {"keep", required_argument, 0, OPT_KEEP}, {"resume", required_argument, 0, OPT_RESUME},
      {"stop-after", required_argument, 0, OPT_STOP_AFTER}, {"plan", required_argument, 0, OPT_PLAN},
      {"device-chunks", required_argument, 0, OPT_DEVICE_CHUNKS}, {"loss-scale", required_argument, 0, OPT_LOSS_SCALE},
      {"comm", required_argument, 0, OPT_COMM}, {"comm-timeout", required_argument, 0, OPT_COMM_TIMEOUT},
      {"tp", required_argument, 0, OPT_TP}, {"precision", required_argument, 0, OPT_PRECISION},
      {"offload", no_argument, 0, OPT_OFFLOAD}, {"dropout", required_argument, 0, OPT_DROPOUT},
      {"val-data", required_argument, 0, OPT_VAL_DATA}, {"val-every", required_argument, 0, OPT_VAL_EVERY},
      {"val-batches", required_argument, 0, OPT_VAL_BATCHES}, {"schedule", required_argument, 0, OPT_SCHEDULE},
      {"optimizer-lag", required_argument, 0, OPT_OPTIMIZER_LAG},
      {"optimizer-state", required_argument, 0, OPT_OPTIMIZER_STATE},
      {"help", no_argument, 0, OPT_HELP}, {0, 0, 0, 0}};
  static const struct option eval_opts[] = {
      {"model", required_argument, 0, OPT_MODEL}, {"init", required_argument, 0, OPT_INIT},
      {"data", required_argument, 0, OPT_DATA}, {"batch", required_argument, 0, OPT_BATCH},
      {"seq", required_argument, 0, OPT_SEQ}, {"seed", required_argument, 0, OPT_SEED},
      {"threads", required_argument, 0, OPT_THREADS}, {"batches", required_argument, 0, OPT_BATCHES},
      {"dump", required_argument, 0, OPT_DUMP}, {"device", required_argument, 0, OPT_DEVICE},
      {"device-mem", required_argument, 0, OPT_DEVICE_MEM}, {"precision", required_argument, 0, OPT_PRECISION},
      {"offload", no_argument, 0, OPT_OFFLOAD}, {"host-mem", required_argument, 0, OPT_HOST_MEM},
      {"recompute", no_argument, 0, OPT_RECOMPUTE}, {"tp", required_argument, 0, OPT_TP},
      {"comm", required_argument, 0, OPT_COMM}, {"comm-timeout", required_argument, 0, OPT_COMM_TIMEOUT},
      {"help", no_argument, 0, OPT_HELP}, {0, 0, 0, 0}};
  stop_signals_start();  // before anything here starts a thread
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  const char *cmd = eval ? "eval" : "train";
  int64_t v;
  int c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, ":", eval ? eval_opts : train_opts, NULL)) != -1) {
    bool ok = true;
    switch (c) {
      case OPT_MODEL: o.model = optarg; break;
      case OPT_INIT: o.init = optarg; break;
      case OPT_DATA: o.data = optarg; break;
      case OPT_BATCH: ok = parse_i64("--batch", optarg, 1, &o.batch); o.batch_given = true; break;
      case OPT_SEQ: ok = parse_i64("--seq", optarg, 1, &o.seq); break;
      case OPT_ACCUM: ok = parse_i64("--grad-accum", optarg, 1, &o.grad_accum); o.batch_given = true; break;
      case OPT_STEPS: ok = parse_i64("--steps", optarg, 0, &o.steps); break;
      case OPT_LR: ok = parse_f32("--lr", optarg, 0, &o.lr); break;
      case OPT_MIN_LR: ok = parse_f32("--min-lr", optarg, 0, &o.min_lr); break;
      case OPT_WARMUP: ok = parse_i64("--warmup", optarg, 0, &o.warmup); break;
      case OPT_WD: ok = parse_f32("--weight-decay", optarg, 0, &o.adamw.weight_decay); break;
      case OPT_B1:
      case OPT_B2: {
        const char *flag = c == OPT_B1 ? "--beta1" : "--beta2";
        float *beta = c == OPT_B1 ? &o.adamw.beta1 : &o.adamw.beta2;
        if ((ok = parse_f32(flag, optarg, 0, beta)) && !(*beta < 1)) {
          fprintf(stderr, "ferry: %s is an AdamW beta, in [0, 1): got '%s'\n", flag, optarg);
          ok = false;
        }
        break;
      }
      case OPT_EPS:
        // (0 would divide a parameter's zero gradient by its zero second moment: NaN weights)
        if ((ok = parse_f32("--eps", optarg, 0, &o.adamw.eps)) && !(o.adamw.eps > 0)) {
          fprintf(stderr, "ferry: --eps must be above 0 (AdamW divides by sqrt(v) + eps), got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_CLIP: ok = parse_f32("--clip", optarg, 0, &o.adamw.clip); break;
      case OPT_SEED: ok = parse_i64("--seed", optarg, 0, &v); o.seed = (uint64_t)v; break;
      case OPT_NO_SHUFFLE: o.shuffle = false; break;
      case OPT_THREADS: ok = parse_i64("--threads", optarg, 1, &v); o.threads = (int)v; break;
      case OPT_SAVE: o.save = optarg; break;
      case OPT_LOG: o.log_path = optarg; break;
      case OPT_QUIET: o.quiet = true; break;
      case OPT_PROFILE: o.profile = true; break;
      case OPT_RECOMPUTE: o.recompute = true; break;
      case OPT_VAL_DATA: o.val_data = optarg; break;
      case OPT_SCHEDULE:
        o.schedule = optarg;
        if (!fy_lr_schedule_known(optarg)) {
          fprintf(stderr, "ferry: --schedule is cosine, linear or constant, got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_VAL_EVERY: ok = parse_i64("--val-every", optarg, 1, &o.val_every); break;
      case OPT_VAL_BATCHES: ok = parse_i64("--val-batches", optarg, 1, &o.val_batches); break;
      case OPT_DROPOUT:
        if (strcmp(optarg, "config") == 0)
          o.dropout = FY_DROPOUT_CONFIG;
        else if (!parse_f32("--dropout", optarg, 0, &o.dropout) || o.dropout >= 1) {
          if (o.dropout >= 1) fprintf(stderr, "ferry: --dropout is a probability below 1 or 'config', got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_DEVICE:
        o.device = optarg;
        if (strcmp(optarg, "cpu") != 0 && strcmp(optarg, "sim") != 0 && strcmp(optarg, "cuda") != 0) {
          fprintf(stderr, "ferry: --device is cpu, sim or cuda, got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_DEVICE_MEM: ok = parse_size("--device-mem", optarg, &o.device_mem); break;
      case OPT_LINK: {
        float f;
        ok = parse_f32("--sim-link-gbps", optarg, 0, &f);
        o.sim_link_gbps = f;
        break;
      }
      case OPT_JITTER: ok = parse_i64("--sim-jitter-us", optarg, 0, &v); o.sim_jitter_us = (int)v; break;
      case OPT_HOST_MEM: ok = parse_size("--host-mem", optarg, &o.host_mem); break;
      case OPT_DISK_DIR: o.disk_dir = optarg; break;
      case OPT_DISK_CHUNKS: ok = parse_i64("--disk-chunks", optarg, 0, &v); o.disk_chunks = (int)v; break;
      case OPT_PREFETCH: ok = parse_i64("--prefetch", optarg, 0, &v); o.prefetch = (int)v; break;
      case OPT_BLOCKS: ok = parse_i64("--blocks", optarg, 1, &v); o.blocks = (int)v; break;
      case OPT_SAVE_EVERY: ok = parse_i64("--save-every", optarg, 1, &o.save_every); break;
      case OPT_KEEP: ok = parse_i64("--keep", optarg, 1, &v); o.keep = (int)v; break;
      case OPT_RESUME: o.resume = optarg; break;
      case OPT_STOP_AFTER: ok = parse_i64("--stop-after", optarg, 1, &o.stop_after); break;
      case OPT_PLAN: o.plan = optarg; break;
      case OPT_LOSS_SCALE: {
        float f;
        if (strcmp(optarg, "dynamic") == 0) o.loss_scale = 65536;
        else if ((ok = parse_f32("--loss-scale", optarg, 1, &f))) o.loss_scale = f;
        break;
      }
      case OPT_COMM: o.comm = optarg; break;
      case OPT_COMM_TIMEOUT: {
        float f;
        ok = parse_f32("--comm-timeout", optarg, 0.001f, &f);
        o.comm_timeout = f;
        break;
      }
      case OPT_DEVICE_CHUNKS: ok = parse_i64("--device-chunks", optarg, 0, &v); o.device_chunks = (int)v; break;
      case OPT_OPTIMIZER_LAG: ok = parse_i64("--optimizer-lag", optarg, 0, &v); o.optimizer_lag = (int)v; break;
      case OPT_OPTIMIZER_STATE: o.optimizer_state = optarg; break;  // (checked by fy_train)
      case OPT_TP: ok = parse_i64("--tp", optarg, 1, &v); o.tp = (int)v; break;
      case OPT_PRECISION: o.precision = optarg; break;
      case OPT_OFFLOAD: o.offload = true; break;
      case OPT_CHUNK_MIB: {
        float f;
        ok = parse_f32("--chunk-mib", optarg, 0, &f);
        o.chunk_mib = f;
        break;
      }
      case OPT_BATCHES: ok = parse_i64("--batches", optarg, 1, &o.eval_batches); break;
      case OPT_DUMP: o.dump = optarg; break;
      case OPT_HELP: usage_train(stdout, eval); return 0;
      case ':':
        fprintf(stderr, "ferry %s: %s needs a value\n", cmd, argv[optind - 1]);
        return 2;
      default:
        fprintf(stderr, "ferry %s: unknown option '%s' (see 'ferry %s --help')\n", cmd,
                argv[optind - 1], cmd);
        return 2;
    }
    if (!ok) return 2;
  }
  if (optind < argc) {
    fprintf(stderr, "ferry %s: unexpected argument '%s' (see 'ferry %s --help')\n", cmd, argv[optind], cmd);
    return 2;
  }
  fy_status st;
  o.stop = &stop_requested;
  if (!eval) {  // (evaluation has nothing to keep: it ends at once)
    atomic_store(&stop_armed, true);
    // A write to a pipe whose reader has ended fails instead of ending the process: the trainer
    // then stops after the step with a checkpoint (unless SIGPIPE was set to something else).
    struct sigaction pipe_sa;
    if (sigaction(SIGPIPE, NULL, &pipe_sa) == 0 && pipe_sa.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
  }
  if (eval) {
    double loss;
    st = fy_eval(&o, &loss);  // (rank 0 prints the mean)
  } else {
    struct fy_train_result r;
    st = fy_train(&o, &r);
  }
  fy_matmul_cache_clear();
  if (st != FY_OK) {
    fprintf(stderr, "ferry %s: error: %s\n", cmd, fy_error_msg());
    return 1;
  }
  return 0;
}

// A comma-separated list of token ids into out (room for strlen(list) / 2 + 1): how many, or -1
// (said on stderr) when it is not one.
static int64_t parse_ids(const char *flag, const char *list, int32_t *out) {
  int64_t n = 0;
  const int64_t cap = (int64_t)(strlen(list) / 2 + 1);
  for (const char *p = list; *p;) {
    char *end;
    errno = 0;
    long long x = strtoll(p, &end, 10);
    if (end == p || errno || x < 0 || x > INT32_MAX || (*end && *end != ',') || n == cap) {
      fprintf(stderr, "ferry sample: %s needs comma-separated token ids, got '%s'\n", flag, list);
      return -1;
    }
    out[n++] = (int32_t)x;
    p = *end ? end + 1 : end;
  }
  if (n == 0) fprintf(stderr, "ferry sample: %s needs comma-separated token ids, got '%s'\n", flag, list);
  return n > 0 ? n : -1;
}

static void usage_sample(FILE *f) {
  fprintf(f,
          "usage: ferry sample --init DIR [--prompt TEXT | --prompt-ids IDS] [options]\n"
          "\n"
          "Continues a prompt with a model, to look at what it has learnt: the prompt %d tokens\n"
          "at a time, then one token at a time, the keys and values of the tokens before cached\n"
          "(a token costs about the same whatever the context).\n"
          "\n"
          "  --init DIR         a Hugging Face model directory (--save of ferry train, ferry export)\n"
          "                     or a ferry checkpoint (its latest step);\n"
          "                     'random' draws OPT's initialisation (with --model: to time it)\n"
          "  --model M          a preset or config.json (default: the --init directory's config)\n"
          "  --prompt TEXT      the prompt as bytes, one token each (the demo model's byte\n"
          "                     vocabulary); the output is printed as text\n"
          "  --prompt-ids IDS   the prompt as token ids (comma-separated: any tokenizer's); the\n"
          "                     output is printed as ids\n"
          "  --tokens N         tokens to add at most (default 100)\n"
          "  --temperature X    sampling temperature; 0 takes the most likely token (default 1)\n"
          "  --top-k K          draw among the K most likely tokens; 0: all (default 0)\n"
          "  --top-p P          ... and of those among the fewest most likely whose probabilities\n"
          "                     add up to P (nucleus sampling; default 1: all)\n"
          "  --stop IDS         end when one of these token ids is drawn (comma-separated; it is\n"
          "                     printed), or 'none' (default: the model's eos_token_id, as\n"
          "                     transformers' generate does)\n"
          "  --seq T            the window: the tokens a new one sees (default: the model's\n"
          "                     positions); when it is full its newest half starts it again\n"
          "  --seed S           the sampler's seed (default 1337)\n"
          "  --quiet            no timing line on stderr (the prompt's pass, and the tokens a second\n"
          "                     after it)\n"
          "  --threads N        OpenMP threads (default: all cores)\n"
          "  --device D         cpu (default) or cuda (the whole model on GPU 0; in bf16 its\n"
          "                     weights take 2 bytes a parameter)\n"
          "  --offload          with --device cuda: the weights in pinned host memory and a cache of\n"
          "                     their chunks on the GPU, as ferry eval --offload (a model bigger\n"
          "                     than the GPU; every token then loads the chunks the cache lacks)\n"
          "  --device-mem SIZE  cuda: the GPU memory to use (default: what it has free)\n"
          "  --host-mem SIZE    with --offload: host memory for the weights (default: the machine's)\n"
          "  --blocks N         with --offload: the cache's blocks (default: as many as fit)\n"
          "  --precision P      fp32 (the cpu's), or on cuda bf16 (default) or fp32\n",
          FY_SAMPLE_PREFILL);
}

static int cmd_sample(int argc, char **argv) {
  enum { S_INIT = 256, S_MODEL, S_PROMPT, S_IDS, S_TOKENS, S_TEMP, S_TOPK, S_TOPP, S_STOP, S_SEQ, S_SEED, S_THREADS,
         S_DEVICE, S_OFFLOAD, S_DEVMEM, S_HOSTMEM, S_BLOCKS, S_PRECISION, S_QUIET, S_HELP };
  static const struct option opts[] = {
      {"init", required_argument, 0, S_INIT}, {"model", required_argument, 0, S_MODEL},
      {"prompt", required_argument, 0, S_PROMPT}, {"prompt-ids", required_argument, 0, S_IDS},
      {"tokens", required_argument, 0, S_TOKENS}, {"temperature", required_argument, 0, S_TEMP},
      {"top-k", required_argument, 0, S_TOPK}, {"top-p", required_argument, 0, S_TOPP},
      {"stop", required_argument, 0, S_STOP}, {"seq", required_argument, 0, S_SEQ},
      {"seed", required_argument, 0, S_SEED}, {"threads", required_argument, 0, S_THREADS},
      {"device", required_argument, 0, S_DEVICE}, {"precision", required_argument, 0, S_PRECISION},
      {"offload", no_argument, 0, S_OFFLOAD}, {"device-mem", required_argument, 0, S_DEVMEM},
      {"host-mem", required_argument, 0, S_HOSTMEM}, {"blocks", required_argument, 0, S_BLOCKS},
      {"quiet", no_argument, 0, S_QUIET},
      {"help", no_argument, 0, S_HELP}, {0, 0, 0, 0}};
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  o.model = NULL;
  o.init = NULL;
  o.seq = 0;
  const char *text = NULL, *ids = NULL, *stop = NULL;
  bool quiet = false;
  struct fy_sample_opts s = {.n_new = 100, .temperature = 1.0f, .top_p = 1.0f, .n_stop = -1};
  int64_t v;
  int c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
    bool ok = true;
    switch (c) {
      case S_INIT: o.init = optarg; break;
      case S_MODEL: o.model = optarg; break;
      case S_PROMPT: text = optarg; break;
      case S_IDS: ids = optarg; break;
      case S_TOKENS: ok = parse_i64("--tokens", optarg, 0, &s.n_new); break;
      case S_TEMP: ok = parse_f32("--temperature", optarg, 0, &s.temperature); break;
      case S_TOPK: ok = parse_i64("--top-k", optarg, 0, &v) && v <= INT32_MAX; s.top_k = (int)v; break;
      case S_TOPP:
        ok = parse_f32("--top-p", optarg, 0, &s.top_p);
        if (ok && !(s.top_p > 0 && s.top_p <= 1)) {
          fprintf(stderr, "ferry sample: --top-p is a probability in (0, 1], got '%s'\n", optarg);
          ok = false;
        }
        break;
      case S_STOP: stop = optarg; break;
      case S_SEQ: ok = parse_i64("--seq", optarg, 1, &o.seq); break;
      case S_SEED: ok = parse_i64("--seed", optarg, 0, &v); o.seed = (uint64_t)v; break;
      case S_THREADS: ok = parse_i64("--threads", optarg, 1, &v); o.threads = (int)v; break;
      case S_DEVICE: o.device = optarg; break;
      case S_OFFLOAD: o.offload = true; break;
      case S_DEVMEM: ok = parse_size("--device-mem", optarg, &o.device_mem); break;
      case S_HOSTMEM: ok = parse_size("--host-mem", optarg, &o.host_mem); break;
      case S_BLOCKS: ok = parse_i64("--blocks", optarg, 1, &v) && v <= INT32_MAX; o.blocks = (int)v; break;
      case S_QUIET: quiet = true; break;
      case S_PRECISION: o.precision = optarg; break;
      case S_HELP: usage_sample(stdout); return 0;
      case ':': fprintf(stderr, "ferry sample: %s needs a value\n", argv[optind - 1]); return 2;
      default:
        fprintf(stderr, "ferry sample: unknown option '%s' (see 'ferry sample --help')\n", argv[optind - 1]);
        return 2;
    }
    if (!ok) return 2;
  }
  if (optind < argc) {
    fprintf(stderr, "ferry sample: unexpected argument '%s' (see 'ferry sample --help')\n", argv[optind]);
    return 2;
  }
  if (!o.init || (!text == !ids)) {
    fprintf(stderr, "ferry sample: give --init DIR and one of --prompt TEXT or --prompt-ids IDS\n");
    return 2;
  }
  // The prompt's ids: its bytes, or the list (checked against the vocabulary by fy_sample); the
  // stop tokens likewise.
  size_t cap = text ? strlen(text) : strlen(ids) / 2 + 1;
  int32_t *prompt = malloc((cap ? cap : 1) * sizeof *prompt);
  int32_t *stops = malloc((stop ? strlen(stop) / 2 + 1 : 1) * sizeof *stops);
  if (!prompt || !stops) return 1;
  if (text) {
    for (size_t i = 0; i < cap; i++) prompt[i] = (unsigned char)text[i];
    s.n_prompt = (int64_t)cap;
  } else if ((s.n_prompt = parse_ids("--prompt-ids", ids, prompt)) < 0) {
    free(prompt), free(stops);
    return 2;
  }
  if (stop && strcmp(stop, "none") == 0) {
    s.n_stop = 0;
  } else if (stop) {
    int64_t n = parse_ids("--stop", stop, stops);
    if (n < 0) {
      free(prompt), free(stops);
      return 2;
    }
    s.stop = stops, s.n_stop = (int)n;
  }
  s.prompt = prompt;
  int32_t *out = malloc((size_t)(s.n_prompt + s.n_new) * sizeof *out);
  int64_t n_out = 0;
  double prompt_s = 0, new_s = 0;
  s.prompt_seconds = &prompt_s, s.new_seconds = &new_s;
  fy_status st = out ? fy_sample(&o, &s, out, &n_out) : fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (st == FY_OK) {
    for (int64_t i = 0; i < n_out; i++) {
      if (text && out[i] < 256) putchar(out[i]);
      else if (text) printf("<%d>", out[i]);
      else printf(i ? ",%d" : "%d", out[i]);
    }
    putchar('\n');
  }
  if (st == FY_OK && !quiet && n_out > s.n_prompt) {  // (on stderr, after the tokens: stdout is the tokens)
    fflush(stdout);
    const int64_t more = n_out - s.n_prompt - 1;
    fprintf(stderr, "ferry sample: the prompt's %lld tokens and the first new one in %.3f s (%.1f tokens/s)",
            (long long)s.n_prompt, prompt_s, (double)s.n_prompt / (prompt_s > 0 ? prompt_s : 1e-9));
    if (more > 0) fprintf(stderr, ", %lld more in %.3f s (%.1f tokens/s)", (long long)more, new_s,
                          (double)more / (new_s > 0 ? new_s : 1e-9));
    fputc('\n', stderr);
  }
  free(prompt), free(stops);
  free(out);
  fy_matmul_cache_clear();
  if (st != FY_OK) {
    fprintf(stderr, "ferry sample: error: %s\n", fy_error_msg());
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) return cmd_train(argc, argv, false);  // `ferry` alone: the demo
  const char *cmd = argv[1];
  if (strcmp(cmd, "train") == 0) return cmd_train(argc - 1, argv + 1, false);
  if (strcmp(cmd, "eval") == 0) return cmd_train(argc - 1, argv + 1, true);
  if (strcmp(cmd, "export") == 0) return cmd_export(argc - 1, argv + 1);
  if (strcmp(cmd, "sample") == 0) return cmd_sample(argc - 1, argv + 1);
  if (strcmp(cmd, "probe") == 0) return cmd_probe_or_plan(argc - 1, argv + 1, false);
  if (strcmp(cmd, "plan") == 0) return cmd_probe_or_plan(argc - 1, argv + 1, true);
  if (strcmp(cmd, "presets") == 0) {
    for (const char *const *p = fy_opt_preset_names(); *p; p++) {
      struct fy_opt_config c;
      fy_opt_preset(*p, &c);
      printf("%-10s %9.1fM parameters, %2lld layers, hidden %5lld, %3lld heads, %s\n", *p,
             fy_opt_num_params(&c) / 1e6, (long long)c.num_hidden_layers, (long long)c.hidden_size,
             (long long)c.num_attention_heads, c.do_layer_norm_before ? "pre-LN" : "post-LN");
    }
    return 0;
  }
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    printf("ferry %s\n", FERRY_VERSION);
    // The GPU architectures the CUDA kernels were compiled for (meson's -Dgpu_arch).
    printf("CUDA: %s\n", FY_HAVE_CUDA ? FY_CUDA_ARCHS : "not built (no nvcc when it was configured)");
    return 0;
  }
  if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
    usage_main(stdout);
    return 0;
  }
  fprintf(stderr, "ferry: unknown command '%s'\n\n", cmd);
  usage_main(stderr);
  return 2;
}
