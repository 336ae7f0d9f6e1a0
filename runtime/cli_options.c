// ferry's command-line vocabulary: every command's option table and help text, and the parsers of
// option values.
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/parse.h"
#include "runtime/trainer.h"
#include "fy_config.h"
#include "runtime/cli.h"

// ferry train's options and ferry eval's (cmd_train in main.c parses both; OPT_* in cli.h).
const struct option train_opts[] = {
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
    {"disk-master", no_argument, 0, OPT_DISK_MASTER},
    {"prefetch", required_argument, 0, OPT_PREFETCH}, {"blocks", required_argument, 0, OPT_BLOCKS},
    {"chunk-mib", required_argument, 0, OPT_CHUNK_MIB}, {"save-every", required_argument, 0, OPT_SAVE_EVERY},
    {"keep", required_argument, 0, OPT_KEEP}, {"resume", required_argument, 0, OPT_RESUME},
    {"stop-after", required_argument, 0, OPT_STOP_AFTER}, {"plan", required_argument, 0, OPT_PLAN},
    {"device-chunks", required_argument, 0, OPT_DEVICE_CHUNKS}, {"loss-scale", required_argument, 0, OPT_LOSS_SCALE},
    {"comm", required_argument, 0, OPT_COMM}, {"comm-timeout", required_argument, 0, OPT_COMM_TIMEOUT},
    {"tp", required_argument, 0, OPT_TP}, {"precision", required_argument, 0, OPT_PRECISION},
    {"pp", required_argument, 0, OPT_PP}, {"ep", required_argument, 0, OPT_EP},
    {"offload", no_argument, 0, OPT_OFFLOAD}, {"dropout", required_argument, 0, OPT_DROPOUT},
    {"val-data", required_argument, 0, OPT_VAL_DATA}, {"val-every", required_argument, 0, OPT_VAL_EVERY},
    {"val-batches", required_argument, 0, OPT_VAL_BATCHES}, {"schedule", required_argument, 0, OPT_SCHEDULE},
    {"optimizer-lag", required_argument, 0, OPT_OPTIMIZER_LAG}, {"spec-chunks", required_argument, 0, OPT_SPEC_CHUNKS}, {"device-updates", required_argument, 0, OPT_DEVICE_UPDATES}, {"profile-waits", no_argument, 0, OPT_PROFILE_WAITS},
    {"optimizer-state", required_argument, 0, OPT_OPTIMIZER_STATE},
    {"help", no_argument, 0, OPT_HELP}, {0, 0, 0, 0}};
const struct option eval_opts[] = {
    {"model", required_argument, 0, OPT_MODEL}, {"init", required_argument, 0, OPT_INIT},
    {"data", required_argument, 0, OPT_DATA}, {"batch", required_argument, 0, OPT_BATCH},
    {"seq", required_argument, 0, OPT_SEQ}, {"seed", required_argument, 0, OPT_SEED},
    {"threads", required_argument, 0, OPT_THREADS}, {"batches", required_argument, 0, OPT_BATCHES},
    {"dump", required_argument, 0, OPT_DUMP}, {"device", required_argument, 0, OPT_DEVICE},
    {"device-mem", required_argument, 0, OPT_DEVICE_MEM}, {"precision", required_argument, 0, OPT_PRECISION},
    {"offload", no_argument, 0, OPT_OFFLOAD}, {"host-mem", required_argument, 0, OPT_HOST_MEM},
    {"recompute", no_argument, 0, OPT_RECOMPUTE}, {"tp", required_argument, 0, OPT_TP},
    {"pp", required_argument, 0, OPT_PP},  // (refused by fy_eval, saying why)
    {"comm", required_argument, 0, OPT_COMM}, {"comm-timeout", required_argument, 0, OPT_COMM_TIMEOUT},
    {"help", no_argument, 0, OPT_HELP}, {0, 0, 0, 0}};

// ferry sample's options (SAMPLE_* in cli.h).
const struct option sample_opts[] = {
    {"init", required_argument, 0, SAMPLE_INIT}, {"model", required_argument, 0, SAMPLE_MODEL},
    {"prompt", required_argument, 0, SAMPLE_PROMPT}, {"prompt-ids", required_argument, 0, SAMPLE_IDS},
    {"tokens", required_argument, 0, SAMPLE_TOKENS}, {"temperature", required_argument, 0, SAMPLE_TEMP},
    {"top-k", required_argument, 0, SAMPLE_TOPK}, {"top-p", required_argument, 0, SAMPLE_TOPP},
    {"stop", required_argument, 0, SAMPLE_STOP}, {"seq", required_argument, 0, SAMPLE_SEQ},
    {"seed", required_argument, 0, SAMPLE_SEED}, {"threads", required_argument, 0, SAMPLE_THREADS},
    {"device", required_argument, 0, SAMPLE_DEVICE}, {"precision", required_argument, 0, SAMPLE_PRECISION},
    {"offload", no_argument, 0, SAMPLE_OFFLOAD}, {"device-mem", required_argument, 0, SAMPLE_DEVMEM},
    {"host-mem", required_argument, 0, SAMPLE_HOSTMEM}, {"blocks", required_argument, 0, SAMPLE_BLOCKS},
    {"quiet", no_argument, 0, SAMPLE_QUIET},
    {"pp", required_argument, 0, SAMPLE_PP}, {"tp", required_argument, 0, SAMPLE_TP},  // (refused by fy_sample, saying why)
    {"help", no_argument, 0, SAMPLE_HELP}, {0, 0, 0, 0}};

// ferry probe's and ferry plan's options (PLAN_* in cli.h).
const struct option plan_opts[] = {
    {"device", required_argument, 0, PLAN_DEVICE}, {"device-mem", required_argument, 0, PLAN_DEVICE_MEM},
    {"sim-link-gbps", required_argument, 0, PLAN_LINK}, {"disk-dir", required_argument, 0, PLAN_DISK},
    {"probe-file", required_argument, 0, PLAN_FILE}, {"remeasure", no_argument, 0, PLAN_REMEASURE},
    {"no-write", no_argument, 0, PLAN_NO_WRITE}, {"set", required_argument, 0, PLAN_SET},
    {"model", required_argument, 0, PLAN_MODEL}, {"batch", required_argument, 0, PLAN_BATCH},
    {"seq", required_argument, 0, PLAN_SEQ}, {"out", required_argument, 0, PLAN_OUT},
    {"svg", required_argument, 0, PLAN_SVG}, {"gpus", required_argument, 0, PLAN_GPUS},
    {"help", no_argument, 0, PLAN_HELP}, {"profile", no_argument, 0, PLAN_PROFILE},
    {"offload", no_argument, 0, PLAN_OFFLOAD}, {"resident", no_argument, 0, PLAN_RESIDENT},
    {"optimizer-lag", required_argument, 0, PLAN_LAG},
    {"precision", required_argument, 0, PLAN_PRECISION}, {"optimizer-state", required_argument, 0, PLAN_STATE},
    {"largest", no_argument, 0, PLAN_LARGEST},
    {"nodes", required_argument, 0, PLAN_NODES}, {"gpus-per-node", required_argument, 0, PLAN_GPN},
    {"intra-gbps", required_argument, 0, PLAN_INTRA}, {"inter-gbps", required_argument, 0, PLAN_INTER},
    {"dp", required_argument, 0, PLAN_DP}, {"pp", required_argument, 0, PLAN_PP}, {"tp", required_argument, 0, PLAN_TP},
    // Overrides by their own names.
    {"host-mem", required_argument, 0, PLAN_OVR}, {"device-tflops", required_argument, 0, PLAN_OVR},
    {"device-gflops", required_argument, 0, PLAN_OVR}, {"host-gflops", required_argument, 0, PLAN_OVR},
    {"link-gbps", required_argument, 0, PLAN_OVR}, {"h2d-gbps", required_argument, 0, PLAN_OVR},
    {"d2h-gbps", required_argument, 0, PLAN_OVR}, {"host-adamw-gbps", required_argument, 0, PLAN_OVR},
    {"host-mem-gbps", required_argument, 0, PLAN_OVR}, {"disk-read-gbps", required_argument, 0, PLAN_OVR},
    {"disk-write-gbps", required_argument, 0, PLAN_OVR}, {"comm-gbps", required_argument, 0, PLAN_OVR},
    {"disk-space", required_argument, 0, PLAN_OVR}, {"bf16-speedup", required_argument, 0, PLAN_OVR},
    {"device-mem-gbps", required_argument, 0, PLAN_OVR}, {"device-peak-tflops", required_argument, 0, PLAN_OVR},
    {0, 0, 0, 0}};

void usage_main(FILE *f) {
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

void usage_train(FILE *f, bool eval) {
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
            "  --pp N             groups of N ranks split the decoder layers into stages, as ferry\n"
            "                     train --pp does; each batch goes through them in turn (default 1)\n"
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
          "  --disk-master      sim, cuda --offload with --precision bf16 or fp16: the disk chunks'\n"
          "                     fp32 master weights go to disk too, read and written with their m\n"
          "                     and v; host memory keeps only their 16-bit copy (needs disk chunks)\n"
          "  --device-chunks N  sim, cuda --offload: keep the first N chunks and their AdamW state on\n"
          "                     the device and update them there (default 0: on host threads)\n"
          "  --optimizer-lag N  1: each step's update runs under the next step, which uses the weights\n"
          "                     before it (a one-step-delayed update, as ZeRO-Offload's; different\n"
          "                     numbers, so opt-in); offloaded runs with --precision bf16 or fp16 and\n"
          "                     no --grad-accum, and cpu; pending updates are applied before a\n"
          "                     checkpoint and at the end. 0 (default): the exact step\n"
          "  --spec-chunks N    sim, cuda --offload: update up to N host chunks as their gradients\n"
          "                     come home, before the gradient norm is known, into a spare copy of\n"
          "                     their weights and state each (host memory); kept when the norm does\n"
          "                     not clip, redone otherwise: the exact step's numbers either way.\n"
          "                     Default 0 (--plan chooses N); not with --optimizer-lag\n"
          "  --device-updates N  sim, cuda --offload: up to N host chunks (the first in the model's\n"
          "                     order, not speculated) updated by the device instead of the host:\n"
          "                     after the norm their master, AdamW state and gradients cross the\n"
          "                     link a quarter chunk at a time and come back updated (two staging\n"
          "                     sets of a quarter chunk in device memory), the\n"
          "                     same bits; the link takes a share of the host's work. Default 0\n"
          "                     (--plan chooses N); not with --optimizer-lag\n"
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
          "  --profile          at the end, where a step's time went (per op kind and phase; offloaded,\n"
          "                     where the compute stream waited and why, as ferry plan predicts it)\n"
          "  --profile-waits    offloaded: the compute stream's waits alone (--profile drains a GPU's\n"
          "                     stream around each op, which changes what overlaps)\n"
          "\nseveral ranks (mpirun -np N ferry train ... or srun):\n"
          "  --comm K           auto (default: mpi under mpirun/srun), single or mpi\n"
          "  --comm-timeout S   seconds a collective may take before the job is aborted (default 300)\n"
          "  --tp N             tensor parallelism (--device cpu, sim, cuda): groups of N consecutive\n"
          "                     ranks split each layer's attention heads and feed-forward features\n"
          "                     (Megatron's column/row split; on GPUs their sums go through NCCL, and\n"
          "                     without --offload each rank's slices and their AdamW state stay on\n"
          "                     its GPU); the groups are data-parallel (default 1; several groups on\n"
          "                     GPUs need --offload)\n"
          "  --pp N             pipeline parallelism (--device cpu, sim, cuda): groups of N ranks split\n"
          "                     the decoder layers into N stages, run on the 1F1B schedule over the\n"
          "                     --grad-accum micro-batches; ranks form a dp x pp x tp grid (default 1)\n"
          "  --ep N             expert parallelism (--device cpu, sim; a mixture of experts): within\n"
          "                     groups of N consecutive data-parallel ranks each holds experts/N of every\n"
          "                     mixture layer, and tokens go to their experts' ranks and back by\n"
          "                     all-to-all (default 1)\n"
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

// ferry probe --help, ferry plan --help (cmd: "probe" or "plan").
void usage_probe_or_plan(const char *cmd, bool plan) {
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
           "                     mpirun -np N ferry train --plan FILE); pipelines (dp x pp x tp)\n"
           "                     too where their stages run (the cpu device, for now)\n"
           "  --nodes K --gpus-per-node G   a cluster of K nodes of G GPUs (--gpus K x G): every\n"
           "                     dp x pp x tp layout (tp within a node, pp dividing the layers)\n"
           "                     and micro-batch count is priced, each stage resident on its GPUs\n"
           "  --intra-gbps X     GB/s between the GPUs of a node (each GPU's; default --comm-gbps)\n"
           "  --inter-gbps X     GB/s between nodes, a node's network links together (default\n"
           "                     --comm-gbps)\n"
           "  --dp N --pp N --tp N  fix those axes and price just that layout (the others searched)\n"
           "  --comm-gbps X      collectives between ranks (default: derived, see ferry probe)\n"
           "  --offload          offloaded plans only (a GPU's default also tries it resident)\n"
           "  --resident         cuda, one GPU: the resident run alone (ferry train --device cuda\n"
           "                     without --offload), its micro-batch and recomputation chosen, to\n"
           "                     compare an offloaded plan with\n"
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
}

bool parse_i64(const char *flag, const char *s, int64_t min, int64_t *out) {
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

bool parse_f32(const char *flag, const char *s, float min, float *out) {
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
bool parse_size(const char *flag, const char *s, size_t *out) {
  double v;
  if (!fy_parse_size(s, &v)) {
    fprintf(stderr, "ferry: %s needs a size such as 512MiB or 8GiB, got '%s'\n", flag, s);
    return false;
  }
  *out = (size_t)v;
  return true;
}

// A comma-separated list of token ids into out (room for strlen(list) / 2 + 1): how many, or -1
// (said on stderr) when it is not one.
int64_t parse_ids(const char *flag, const char *list, int32_t *out) {
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

// ferry export's usage line, and with full what it does.
void usage_export(FILE *f, bool full) {
  fprintf(f, "usage: ferry export CHECKPOINT OUTDIR\n");
  if (full)
    fprintf(f, "\nWrites a Hugging Face model directory (config.json, model.safetensors or shards) that\n"
               "OPTForCausalLM.from_pretrained loads, from a training checkpoint: its root (the\n"
               "latest step) or one step directory.\n");
}

void usage_sample(FILE *f) {
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
