// Internal to the ferry executable (runtime/main.c, cli_options.c, cli_plan.c, cli_signals.c):
// what the command-line files share. Not an API; nothing outside them includes it.
#ifndef FY_CLI_H
#define FY_CLI_H

#include <getopt.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

// cli_options.c: ferry train's and ferry eval's options (getopt_long's codes and tables).
enum {
  OPT_MODEL = 256, OPT_INIT, OPT_DATA, OPT_BATCH, OPT_SEQ, OPT_ACCUM, OPT_STEPS, OPT_LR, OPT_MIN_LR,
  OPT_WARMUP, OPT_WD, OPT_B1, OPT_B2, OPT_EPS, OPT_CLIP, OPT_SEED, OPT_NO_SHUFFLE, OPT_THREADS,
  OPT_SAVE, OPT_LOG, OPT_QUIET, OPT_BATCHES, OPT_DUMP, OPT_PROFILE, OPT_RECOMPUTE, OPT_DEVICE, OPT_DEVICE_MEM, OPT_LINK, OPT_JITTER, OPT_HOST_MEM,
  OPT_DISK_DIR, OPT_DISK_CHUNKS, OPT_DISK_MASTER, OPT_PREFETCH, OPT_BLOCKS, OPT_CHUNK_MIB, OPT_SAVE_EVERY, OPT_KEEP,
  OPT_RESUME, OPT_STOP_AFTER, OPT_PLAN, OPT_DEVICE_CHUNKS, OPT_LOSS_SCALE, OPT_COMM, OPT_COMM_TIMEOUT, OPT_TP, OPT_PP, OPT_EP, OPT_PRECISION, OPT_OFFLOAD, OPT_DROPOUT, OPT_SCHEDULE, OPT_VAL_DATA, OPT_VAL_EVERY, OPT_VAL_BATCHES, OPT_OPTIMIZER_LAG, OPT_SPEC_CHUNKS, OPT_DEVICE_UPDATES, OPT_OPTIMIZER_STATE, OPT_PROFILE_WAITS, OPT_HELP,
};
extern const struct option train_opts[], eval_opts[];

// cli_options.c: ferry sample's options (cmd_sample in main.c parses them).
enum {
  SAMPLE_INIT = 256, SAMPLE_MODEL, SAMPLE_PROMPT, SAMPLE_IDS, SAMPLE_TOKENS, SAMPLE_TEMP, SAMPLE_TOPK, SAMPLE_TOPP,
  SAMPLE_STOP, SAMPLE_SEQ, SAMPLE_SEED, SAMPLE_THREADS, SAMPLE_DEVICE, SAMPLE_OFFLOAD, SAMPLE_DEVMEM, SAMPLE_HOSTMEM,
  SAMPLE_BLOCKS, SAMPLE_PRECISION, SAMPLE_QUIET, SAMPLE_HELP, SAMPLE_PP, SAMPLE_TP,
};
extern const struct option sample_opts[];

// cli_options.c: ferry probe's and ferry plan's options, one table (cli_plan.c parses it; probe
// refuses plan's own). PLAN_OVR: a probe field overridden by its own name, the option's with '_'
// for '-'.
enum {
  PLAN_DEVICE = 300, PLAN_DEVICE_MEM, PLAN_LINK, PLAN_DISK, PLAN_FILE, PLAN_REMEASURE, PLAN_NO_WRITE, PLAN_SET,
  PLAN_MODEL, PLAN_BATCH, PLAN_SEQ, PLAN_OUT, PLAN_SVG, PLAN_GPUS, PLAN_HELP, PLAN_OVR, PLAN_PROFILE, PLAN_OFFLOAD, PLAN_RESIDENT,
  PLAN_PRECISION, PLAN_LAG, PLAN_STATE, PLAN_LARGEST, PLAN_NODES, PLAN_GPN, PLAN_INTRA, PLAN_INTER, PLAN_DP, PLAN_PP,
  PLAN_TP,
};
extern const struct option plan_opts[];

// cli_options.c: the help texts.
void usage_main(FILE *f);
void usage_train(FILE *f, bool eval);
void usage_sample(FILE *f);
void usage_export(FILE *f, bool full);
void usage_probe_or_plan(const char *cmd, bool plan);

// cli_options.c: option values, said on stderr when they are not ones.
bool parse_i64(const char *flag, const char *s, int64_t min, int64_t *out);
bool parse_f32(const char *flag, const char *s, float min, float *out);
bool parse_size(const char *flag, const char *s, size_t *out);
int64_t parse_ids(const char *flag, const char *list, int32_t *out);

// cli_signals.c: stop_requested is the trainer's stop flag (fy_train_opts.stop); a run sets
// stop_armed when a first signal should stop it rather than end the process.
extern atomic_int stop_requested;
extern atomic_bool stop_armed;
void stop_signals_start(void);

// cli_plan.c: ferry probe (plan false) and ferry plan.
int cmd_probe_or_plan(int argc, char **argv, bool plan);

#endif
