// ferry: the command line. Each command is a function here that parses its options, checks them
// and runs; the option tables, help texts and value parsers are in cli_options.c, ferry probe and
// plan in cli_plan.c, the stop signals in cli_signals.c (runtime/cli.h declares them).
#include <getopt.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/opt.h"
#include "ops/ops.h"
#include "runtime/checkpoint.h"
#include "runtime/trainer.h"
#include "fy_config.h"
#include "runtime/cli.h"

#define FERRY_VERSION "0.1.0"

static int cmd_export(int argc, char **argv) {
  if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
    usage_export(stdout, true);
    return 0;
  }
  if (argc != 3) {
    usage_export(stderr, false);
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

static int cmd_presets(void) {
  for (const char *const *p = fy_opt_preset_names(); *p; p++) {
    struct fy_opt_config c;
    fy_opt_preset(*p, &c);
    printf("%-10s %9.1fM parameters, %2lld layers, hidden %5lld, %3lld heads, %s\n", *p,
           fy_opt_num_params(&c) / 1e6, (long long)c.num_hidden_layers, (long long)c.hidden_size,
           (long long)c.num_attention_heads, c.do_layer_norm_before ? "pre-LN" : "post-LN");
    if (c.num_local_experts > 0)
      printf("%-10s a mixture of %lld experts, top %lld, in one layer of %lld\n", "", (long long)c.num_local_experts,
             (long long)c.num_experts_per_tok, (long long)c.moe_layer_frequency);
  }
  return 0;
}

static int cmd_version(void) {
  printf("ferry %s\n", FERRY_VERSION);
  // The GPU architectures the CUDA kernels were compiled for (meson's -Dgpu_arch).
  printf("CUDA: %s\n", FY_HAVE_CUDA ? FY_CUDA_ARCHS : "not built (no nvcc when it was configured)");
  return 0;
}

// ferry train's or ferry eval's command line into o: -1 to go on, else the exit code (--help: 0).
static int parse_train_args(int argc, char **argv, bool eval, struct fy_train_opts *o) {
  const char *cmd = eval ? "eval" : "train";
  int64_t v;
  int c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, ":", eval ? eval_opts : train_opts, NULL)) != -1) {
    bool ok = true;
    switch (c) {
      case OPT_MODEL: o->model = optarg; break;
      case OPT_INIT: o->init = optarg; break;
      case OPT_DATA: o->data = optarg; break;
      case OPT_BATCH: ok = parse_i64("--batch", optarg, 1, &o->batch); o->batch_given = true; break;
      case OPT_SEQ: ok = parse_i64("--seq", optarg, 1, &o->seq); break;
      case OPT_ACCUM: ok = parse_i64("--grad-accum", optarg, 1, &o->grad_accum); o->batch_given = true; break;
      case OPT_STEPS: ok = parse_i64("--steps", optarg, 0, &o->steps); break;
      case OPT_LR: ok = parse_f32("--lr", optarg, 0, &o->lr); break;
      case OPT_MIN_LR: ok = parse_f32("--min-lr", optarg, 0, &o->min_lr); break;
      case OPT_WARMUP: ok = parse_i64("--warmup", optarg, 0, &o->warmup); break;
      case OPT_WD: ok = parse_f32("--weight-decay", optarg, 0, &o->adamw.weight_decay); break;
      case OPT_B1:
      case OPT_B2: {
        const char *flag = c == OPT_B1 ? "--beta1" : "--beta2";
        float *beta = c == OPT_B1 ? &o->adamw.beta1 : &o->adamw.beta2;
        if ((ok = parse_f32(flag, optarg, 0, beta)) && !(*beta < 1)) {
          fprintf(stderr, "ferry: %s is an AdamW beta, in [0, 1): got '%s'\n", flag, optarg);
          ok = false;
        }
        break;
      }
      case OPT_EPS:
        // (0 would divide a parameter's zero gradient by its zero second moment: NaN weights)
        if ((ok = parse_f32("--eps", optarg, 0, &o->adamw.eps)) && !(o->adamw.eps > 0)) {
          fprintf(stderr, "ferry: --eps must be above 0 (AdamW divides by sqrt(v) + eps), got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_CLIP: ok = parse_f32("--clip", optarg, 0, &o->adamw.clip); break;
      case OPT_SEED: ok = parse_i64("--seed", optarg, 0, &v); o->seed = (uint64_t)v; break;
      case OPT_NO_SHUFFLE: o->shuffle = false; break;
      case OPT_THREADS: ok = parse_i64("--threads", optarg, 1, &v); o->threads = (int)v; break;
      case OPT_SAVE: o->save = optarg; break;
      case OPT_LOG: o->log_path = optarg; break;
      case OPT_QUIET: o->quiet = true; break;
      case OPT_PROFILE: o->profile = true; break;
      case OPT_PROFILE_WAITS: o->profile_waits = true; break;
      case OPT_RECOMPUTE: o->recompute = true; break;
      case OPT_VAL_DATA: o->val_data = optarg; break;
      case OPT_SCHEDULE:
        o->schedule = optarg;
        if (!fy_lr_schedule_known(optarg)) {
          fprintf(stderr, "ferry: --schedule is cosine, linear or constant, got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_VAL_EVERY: ok = parse_i64("--val-every", optarg, 1, &o->val_every); break;
      case OPT_VAL_BATCHES: ok = parse_i64("--val-batches", optarg, 1, &o->val_batches); break;
      case OPT_DROPOUT:
        if (strcmp(optarg, "config") == 0)
          o->dropout = FY_DROPOUT_CONFIG;
        else if (!parse_f32("--dropout", optarg, 0, &o->dropout) || o->dropout >= 1) {
          if (o->dropout >= 1) fprintf(stderr, "ferry: --dropout is a probability below 1 or 'config', got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_DEVICE:
        o->device = optarg;
        if (strcmp(optarg, "cpu") != 0 && strcmp(optarg, "sim") != 0 && strcmp(optarg, "cuda") != 0) {
          fprintf(stderr, "ferry: --device is cpu, sim or cuda, got '%s'\n", optarg);
          ok = false;
        }
        break;
      case OPT_DEVICE_MEM: ok = parse_size("--device-mem", optarg, &o->device_mem); break;
      case OPT_LINK: {
        float f;
        ok = parse_f32("--sim-link-gbps", optarg, 0, &f);
        o->sim_link_gbps = f;
        break;
      }
      case OPT_JITTER: ok = parse_i64("--sim-jitter-us", optarg, 0, &v); o->sim_jitter_us = (int)v; break;
      case OPT_HOST_MEM: ok = parse_size("--host-mem", optarg, &o->host_mem); break;
      case OPT_DISK_DIR: o->disk_dir = optarg; break;
      case OPT_DISK_CHUNKS: ok = parse_i64("--disk-chunks", optarg, 0, &v); o->disk_chunks = (int)v; break;
      case OPT_DISK_MASTER: o->disk_master = true; break;
      case OPT_PREFETCH: ok = parse_i64("--prefetch", optarg, 0, &v); o->prefetch = (int)v; break;
      case OPT_BLOCKS: ok = parse_i64("--blocks", optarg, 1, &v); o->blocks = (int)v; break;
      case OPT_SAVE_EVERY: ok = parse_i64("--save-every", optarg, 1, &o->save_every); break;
      case OPT_KEEP: ok = parse_i64("--keep", optarg, 1, &v); o->keep = (int)v; break;
      case OPT_RESUME: o->resume = optarg; break;
      case OPT_STOP_AFTER: ok = parse_i64("--stop-after", optarg, 1, &o->stop_after); break;
      case OPT_PLAN: o->plan = optarg; break;
      case OPT_LOSS_SCALE: {
        float f;
        if (strcmp(optarg, "dynamic") == 0) o->loss_scale = 65536;
        else if ((ok = parse_f32("--loss-scale", optarg, 1, &f))) o->loss_scale = f;
        break;
      }
      case OPT_COMM: o->comm = optarg; break;
      case OPT_COMM_TIMEOUT: {
        float f;
        ok = parse_f32("--comm-timeout", optarg, 0.001f, &f);
        o->comm_timeout = f;
        break;
      }
      case OPT_DEVICE_CHUNKS: ok = parse_i64("--device-chunks", optarg, 0, &v); o->device_chunks = (int)v; break;
      case OPT_SPEC_CHUNKS: ok = parse_i64("--spec-chunks", optarg, 0, &v); o->spec_chunks = (int)v; break;
      case OPT_DEVICE_UPDATES: ok = parse_i64("--device-updates", optarg, 0, &v); o->device_updates = (int)v; break;
      case OPT_OPTIMIZER_LAG: ok = parse_i64("--optimizer-lag", optarg, 0, &v); o->optimizer_lag = (int)v; break;
      case OPT_OPTIMIZER_STATE: o->optimizer_state = optarg; break;  // (checked by fy_train)
      case OPT_TP: ok = parse_i64("--tp", optarg, 1, &v); o->tp = (int)v; break;
      case OPT_PP: ok = parse_i64("--pp", optarg, 1, &v); o->pp = (int)v; break;
      case OPT_EP: ok = parse_i64("--ep", optarg, 1, &v); o->ep = (int)v; break;
      case OPT_PRECISION: o->precision = optarg; break;
      case OPT_OFFLOAD: o->offload = true; break;
      case OPT_CHUNK_MIB: {
        float f;
        ok = parse_f32("--chunk-mib", optarg, 0, &f);
        o->chunk_mib = f;
        break;
      }
      case OPT_BATCHES: ok = parse_i64("--batches", optarg, 1, &o->eval_batches); break;
      case OPT_DUMP: o->dump = optarg; break;
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
  return -1;
}

static int cmd_train(int argc, char **argv, bool eval) {
  stop_signals_start();  // before anything here starts a thread
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  const char *cmd = eval ? "eval" : "train";
  int rc = parse_train_args(argc, argv, eval, &o);
  if (rc >= 0) return rc;
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

// ferry sample's command line: what fy_sample takes, and how the prompt and stop tokens were given.
struct sample_args {
  struct fy_train_opts o;
  struct fy_sample_opts s;
  const char *text, *ids, *stop;  // --prompt, --prompt-ids, --stop
  bool quiet;
};

// ferry sample's command line into a: -1 to go on, else the exit code (--help: 0).
static int parse_sample_args(int argc, char **argv, struct sample_args *a) {
  struct fy_train_opts *o = &a->o;
  struct fy_sample_opts *s = &a->s;
  *a = (struct sample_args){.s = {.n_new = 100, .temperature = 1.0f, .top_p = 1.0f, .n_stop = -1}};
  fy_train_opts_defaults(o);
  o->model = NULL;
  o->init = NULL;
  o->seq = 0;
  int64_t v;
  int c;
  optind = 1;
  opterr = 0;
  while ((c = getopt_long(argc, argv, ":", sample_opts, NULL)) != -1) {
    bool ok = true;
    switch (c) {
      case SAMPLE_INIT: o->init = optarg; break;
      case SAMPLE_MODEL: o->model = optarg; break;
      case SAMPLE_PROMPT: a->text = optarg; break;
      case SAMPLE_IDS: a->ids = optarg; break;
      case SAMPLE_TOKENS: ok = parse_i64("--tokens", optarg, 0, &s->n_new); break;
      case SAMPLE_TEMP: ok = parse_f32("--temperature", optarg, 0, &s->temperature); break;
      case SAMPLE_TOPK: ok = parse_i64("--top-k", optarg, 0, &v) && v <= INT32_MAX; s->top_k = (int)v; break;
      case SAMPLE_TOPP:
        ok = parse_f32("--top-p", optarg, 0, &s->top_p);
        if (ok && !(s->top_p > 0 && s->top_p <= 1)) {
          fprintf(stderr, "ferry sample: --top-p is a probability in (0, 1], got '%s'\n", optarg);
          ok = false;
        }
        break;
      case SAMPLE_STOP: a->stop = optarg; break;
      case SAMPLE_SEQ: ok = parse_i64("--seq", optarg, 1, &o->seq); break;
      case SAMPLE_SEED: ok = parse_i64("--seed", optarg, 0, &v); o->seed = (uint64_t)v; break;
      case SAMPLE_THREADS: ok = parse_i64("--threads", optarg, 1, &v); o->threads = (int)v; break;
      case SAMPLE_DEVICE: o->device = optarg; break;
      case SAMPLE_OFFLOAD: o->offload = true; break;
      case SAMPLE_DEVMEM: ok = parse_size("--device-mem", optarg, &o->device_mem); break;
      case SAMPLE_HOSTMEM: ok = parse_size("--host-mem", optarg, &o->host_mem); break;
      case SAMPLE_BLOCKS: ok = parse_i64("--blocks", optarg, 1, &v) && v <= INT32_MAX; o->blocks = (int)v; break;
      case SAMPLE_QUIET: a->quiet = true; break;
      case SAMPLE_PRECISION: o->precision = optarg; break;
      case SAMPLE_PP: ok = parse_i64("--pp", optarg, 1, &v); o->pp = (int)v; break;
      case SAMPLE_TP: ok = parse_i64("--tp", optarg, 1, &v); o->tp = (int)v; break;
      case SAMPLE_HELP: usage_sample(stdout); return 0;
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
  return -1;
}

// The prompt's ids (its bytes, or the list, checked against the vocabulary by fy_sample) and the
// stop tokens likewise, into a->s, in prompt and stops (the caller frees both): -1 to go on, else
// the exit code.
static int sample_tokens(struct sample_args *a, int32_t **prompt, int32_t **stops) {
  struct fy_sample_opts *s = &a->s;
  if (!a->o.init || (!a->text == !a->ids)) {
    fprintf(stderr, "ferry sample: give --init DIR and one of --prompt TEXT or --prompt-ids IDS\n");
    return 2;
  }
  size_t cap = a->text ? strlen(a->text) : strlen(a->ids) / 2 + 1;
  *prompt = malloc((cap ? cap : 1) * sizeof **prompt);
  *stops = malloc((a->stop ? strlen(a->stop) / 2 + 1 : 1) * sizeof **stops);
  if (!*prompt || !*stops) return 1;
  if (a->text) {
    for (size_t i = 0; i < cap; i++) (*prompt)[i] = (unsigned char)a->text[i];
    s->n_prompt = (int64_t)cap;
  } else if ((s->n_prompt = parse_ids("--prompt-ids", a->ids, *prompt)) < 0) {
    return 2;
  }
  if (a->stop && strcmp(a->stop, "none") == 0) {
    s->n_stop = 0;
  } else if (a->stop) {
    int64_t n = parse_ids("--stop", a->stop, *stops);
    if (n < 0) return 2;
    s->stop = *stops, s->n_stop = (int)n;
  }
  s->prompt = *prompt;
  return -1;
}

// The tokens on stdout (as text when the prompt was), then, on stderr, how long the prompt's pass
// and the tokens after it took.
static void print_sample(const struct sample_args *a, const int32_t *out, int64_t n_out, double prompt_s,
                         double new_s) {
  for (int64_t i = 0; i < n_out; i++) {
    if (a->text && out[i] < 256) putchar(out[i]);
    else if (a->text) printf("<%d>", out[i]);
    else printf(i ? ",%d" : "%d", out[i]);
  }
  putchar('\n');
  const int64_t n_prompt = a->s.n_prompt;
  if (a->quiet || n_out <= n_prompt) return;
  fflush(stdout);  // (stdout is the tokens: the timing follows them, on stderr)
  const int64_t more = n_out - n_prompt - 1;
  fprintf(stderr, "ferry sample: the prompt's %lld tokens and the first new one in %.3f s (%.1f tokens/s)",
          (long long)n_prompt, prompt_s, (double)n_prompt / (prompt_s > 0 ? prompt_s : 1e-9));
  if (more > 0) fprintf(stderr, ", %lld more in %.3f s (%.1f tokens/s)", (long long)more, new_s,
                        (double)more / (new_s > 0 ? new_s : 1e-9));
  fputc('\n', stderr);
}

static int cmd_sample(int argc, char **argv) {
  struct sample_args a;
  int rc = parse_sample_args(argc, argv, &a);
  if (rc >= 0) return rc;
  int32_t *prompt = NULL, *stops = NULL;
  rc = sample_tokens(&a, &prompt, &stops);
  if (rc >= 0) {
    free(prompt), free(stops);
    return rc;
  }
  int32_t *out = malloc((size_t)(a.s.n_prompt + a.s.n_new) * sizeof *out);
  int64_t n_out = 0;
  double prompt_s = 0, new_s = 0;
  a.s.prompt_seconds = &prompt_s, a.s.new_seconds = &new_s;
  fy_status st = out ? fy_sample(&a.o, &a.s, out, &n_out) : fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (st == FY_OK) print_sample(&a, out, n_out, prompt_s, new_s);
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
  if (strcmp(cmd, "presets") == 0) return cmd_presets();
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) return cmd_version();
  if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
    usage_main(stdout);
    return 0;
  }
  fprintf(stderr, "ferry: unknown command '%s'\n\n", cmd);
  usage_main(stderr);
  return 2;
}
