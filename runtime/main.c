// ferry: the command line. `ferry train`, `ferry eval`, `ferry --help`.
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/trainer.h"

#define FERRY_VERSION "0.1.0"

static volatile sig_atomic_t stop_requested = 0;

// The first signal asks the trainer to stop after the current step (and checkpoint); a second
// one exits at once. Checkpoints are renamed into place whole, so nothing is left half-written.
static void on_signal(int sig) {
  if (stop_requested) _exit(128 + sig);
  stop_requested = 1;
  static const char msg[] = "\nferry: stopping after this step (again to stop now)\n";
  ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)w;
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

static void usage_main(FILE *f) {
  fprintf(f,
          "usage: ferry <command> [options]\n"
          "\n"
          "Trains OPT language models (Hugging Face's OPTForCausalLM) on the CPU.\n"
          "\n"
          "commands:\n"
          "  train     train a model (with no options: the demo model on the bundled corpus)\n"
          "  eval      mean loss of a model on token shards\n"
          "  export    write a Hugging Face model directory from a training checkpoint\n"
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
               "Trains with AdamW, a linear warmup and a cosine decay of the learning rate.\n"
               "With no options it trains the demo model on the bundled corpus for a few minutes.\n\n");
  fprintf(f,
          "model and data:\n"
          "  --model M          a preset (ferry presets) or a directory with config.json\n"
          "                     (default: the --init checkpoint's config, else opt-demo)\n"
          "  --init I           'random' (OPT's initialisation, default) or a Hugging Face model\n"
          "                     directory (model.safetensors or a sharded index)\n"
          "  --data PATH        a token shard, a directory of *.bin shards or a glob\n"
          "                     (default: %s)\n"
          "  --batch B          sequences per micro-batch (default %lld)\n"
          "  --seq T            tokens per sequence (default %lld)\n"
          "  --threads N        OpenMP threads (default: all cores)\n"
          "  --seed S           seed for initialisation and shuffling (default %llu)\n",
          d.data, (long long)d.batch, (long long)d.seq, (unsigned long long)d.seed);
  if (eval) {
    fprintf(f,
            "  --batches N        batches to average over (default %lld)\n"
            "  --dump FILE        write the first batch's input_ids and logits (safetensors)\n",
            (long long)d.eval_batches);
    return;
  }
  fprintf(f,
          "\ntraining:\n"
          "  --steps N          optimizer steps (default %lld)\n"
          "  --grad-accum K     micro-batches per step (default 1)\n"
          "  --lr X             peak learning rate (default %g)\n"
          "  --min-lr X         final learning rate of the cosine decay (default lr/10)\n"
          "  --warmup N         linear warmup steps (default steps/20)\n"
          "  --weight-decay X   AdamW decoupled weight decay on matrices and embeddings (default %g)\n"
          "  --beta1 X, --beta2 X, --eps X   AdamW (defaults %g, %g, %g)\n"
          "  --clip X           clip the global gradient norm to X; 0 disables (default %g)\n"
          "  --no-shuffle       take batches in order instead of a seeded shuffle\n"
          "  --recompute        keep only each decoder layer's input and run its forward again in\n"
          "                     backward (activation memory of one layer instead of all)\n"
          "\nwhere the model state lives:\n"
          "  --device D         cpu (default: everything in host memory) or sim (a device with its\n"
          "                     own memory that holds only a cache of parameter chunks)\n"
          "  --device-mem SIZE  sim: the device's memory, e.g. 512MiB (default 1GiB)\n"
          "  --sim-link-gbps X  sim: throttle host<->device copies to X GB/s, like PCIe (default: off)\n"
          "  --host-mem SIZE    sim: host memory for parameters, gradients and AdamW state\n"
          "                     (default: the machine's)\n"
          "  --disk-dir DIR     sim: put the AdamW state that --host-mem cannot hold under DIR\n"
          "  --disk-chunks N    sim: put the AdamW state of the last N chunks on disk (default: auto)\n"
          "  --prefetch N       sim: chunks loaded ahead of use (default 2)\n"
          "  --blocks N         sim: device cache blocks (default: as many as fit)\n"
          "  --chunk-mib X      sim: chunk size (default: the smallest that holds the largest\n"
          "                     parameter group, the token embedding)\n"
          "  --save DIR         write a Hugging Face model (config.json, model.safetensors) at the end;\n"
          "                     with --save-every, DIR holds training checkpoints instead\n"
          "  --save-every N     write a training checkpoint (weights, AdamW state, step, data\n"
          "                     position) every N steps and at the end, in the background\n"
          "  --keep N           checkpoints kept in DIR (default 2)\n"
          "  --resume PATH      continue from a checkpoint (its root or a step directory); --steps\n"
          "                     counts from the start of training\n"
          "  --stop-after N     end this run after N steps (with a checkpoint): for time-limited jobs\n"
          "  --log FILE         one JSON line per step\n"
          "  --quiet            no step lines\n"
          "  --profile          at the end, where a step's time went (per op kind and phase)\n"
          "\nSIGINT or SIGTERM ends the run after the current step, with a checkpoint when\n"
          "--save-every is on; a second one ends it at once (checkpoints are written atomically).\n"
          "\nEach step prints: step, loss, learning rate, gradient norm, tokens/s, model GFLOP/s\n"
          "(6 x parameters x tokens plus attention, per second), peak resident memory, step time.\n",
          (long long)d.steps, d.lr, d.adamw.weight_decay, d.adamw.beta1, d.adamw.beta2, d.adamw.eps,
          d.adamw.clip);
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
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  double mult = 1;
  const char *u = end;
  if (*u == 'K' || *u == 'k') mult = 1024.0, u++;
  else if (*u == 'M' || *u == 'm') mult = 1048576.0, u++;
  else if (*u == 'G' || *u == 'g') mult = 1073741824.0, u++;
  else if (*u == 'T' || *u == 't') mult = 1099511627776.0, u++;
  if (mult > 1 && *u == 'i') u++;
  if (*u == 'B' || *u == 'b') u++;
  if (errno || end == s || *u || !isfinite(v) || v <= 0 || v * mult > 1e18) {
    fprintf(stderr, "ferry: %s needs a size such as 512MiB or 8GiB, got '%s'\n", flag, s);
    return false;
  }
  *out = (size_t)(v * mult);
  return true;
}

enum {
  OPT_MODEL = 256, OPT_INIT, OPT_DATA, OPT_BATCH, OPT_SEQ, OPT_ACCUM, OPT_STEPS, OPT_LR, OPT_MIN_LR,
  OPT_WARMUP, OPT_WD, OPT_B1, OPT_B2, OPT_EPS, OPT_CLIP, OPT_SEED, OPT_NO_SHUFFLE, OPT_THREADS,
  OPT_SAVE, OPT_LOG, OPT_QUIET, OPT_BATCHES, OPT_DUMP, OPT_PROFILE, OPT_RECOMPUTE, OPT_DEVICE, OPT_DEVICE_MEM, OPT_LINK, OPT_JITTER, OPT_HOST_MEM,
  OPT_DISK_DIR, OPT_DISK_CHUNKS, OPT_PREFETCH, OPT_BLOCKS, OPT_CHUNK_MIB, OPT_SAVE_EVERY, OPT_KEEP,
  OPT_RESUME, OPT_STOP_AFTER, OPT_HELP,
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
      {"stop-after", required_argument, 0, OPT_STOP_AFTER},
      {"help", no_argument, 0, OPT_HELP}, {0, 0, 0, 0}};
  static const struct option eval_opts[] = {
      {"model", required_argument, 0, OPT_MODEL}, {"init", required_argument, 0, OPT_INIT},
      {"data", required_argument, 0, OPT_DATA}, {"batch", required_argument, 0, OPT_BATCH},
      {"seq", required_argument, 0, OPT_SEQ}, {"seed", required_argument, 0, OPT_SEED},
      {"threads", required_argument, 0, OPT_THREADS}, {"batches", required_argument, 0, OPT_BATCHES},
      {"dump", required_argument, 0, OPT_DUMP}, {"help", no_argument, 0, OPT_HELP}, {0, 0, 0, 0}};
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
      case OPT_BATCH: ok = parse_i64("--batch", optarg, 1, &o.batch); break;
      case OPT_SEQ: ok = parse_i64("--seq", optarg, 1, &o.seq); break;
      case OPT_ACCUM: ok = parse_i64("--grad-accum", optarg, 1, &o.grad_accum); break;
      case OPT_STEPS: ok = parse_i64("--steps", optarg, 0, &o.steps); break;
      case OPT_LR: ok = parse_f32("--lr", optarg, 0, &o.lr); break;
      case OPT_MIN_LR: ok = parse_f32("--min-lr", optarg, 0, &o.min_lr); break;
      case OPT_WARMUP: ok = parse_i64("--warmup", optarg, 0, &o.warmup); break;
      case OPT_WD: ok = parse_f32("--weight-decay", optarg, 0, &o.adamw.weight_decay); break;
      case OPT_B1: ok = parse_f32("--beta1", optarg, 0, &o.adamw.beta1) && o.adamw.beta1 < 1; break;
      case OPT_B2: ok = parse_f32("--beta2", optarg, 0, &o.adamw.beta2) && o.adamw.beta2 < 1; break;
      case OPT_EPS: ok = parse_f32("--eps", optarg, 0, &o.adamw.eps); break;
      case OPT_CLIP: ok = parse_f32("--clip", optarg, 0, &o.adamw.clip); break;
      case OPT_SEED: ok = parse_i64("--seed", optarg, 0, &v); o.seed = (uint64_t)v; break;
      case OPT_NO_SHUFFLE: o.shuffle = false; break;
      case OPT_THREADS: ok = parse_i64("--threads", optarg, 1, &v); o.threads = (int)v; break;
      case OPT_SAVE: o.save = optarg; break;
      case OPT_LOG: o.log_path = optarg; break;
      case OPT_QUIET: o.quiet = true; break;
      case OPT_PROFILE: o.profile = true; break;
      case OPT_RECOMPUTE: o.recompute = true; break;
      case OPT_DEVICE:
        o.device = optarg;
        if (strcmp(optarg, "cpu") != 0 && strcmp(optarg, "sim") != 0) {
          fprintf(stderr, "ferry: --device is cpu or sim, got '%s'\n", optarg);
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
    if (!ok) {
      if (c == OPT_B1 || c == OPT_B2) fprintf(stderr, "ferry: betas must be in [0, 1)\n");
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "ferry %s: unexpected argument '%s' (see 'ferry %s --help')\n", cmd, argv[optind], cmd);
    return 2;
  }
  fy_status st;
  o.stop = &stop_requested;
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  if (eval) {
    double loss;
    st = fy_eval(&o, &loss);
    if (st == FY_OK) printf("eval loss %.6f over %lld batches of %lld x %lld\n", loss,
                            (long long)o.eval_batches, (long long)o.batch, (long long)o.seq);
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

int main(int argc, char **argv) {
  if (argc < 2) return cmd_train(argc, argv, false);  // `ferry` alone: the demo
  const char *cmd = argv[1];
  if (strcmp(cmd, "train") == 0) return cmd_train(argc - 1, argv + 1, false);
  if (strcmp(cmd, "eval") == 0) return cmd_train(argc - 1, argv + 1, true);
  if (strcmp(cmd, "export") == 0) return cmd_export(argc - 1, argv + 1);
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
