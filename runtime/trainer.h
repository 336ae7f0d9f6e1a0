// The trainer: `ferry train` and `ferry eval` without the command-line parsing. It builds the
// model (a preset or a config.json), initialises or loads it, streams batches from token shards,
// and runs steps of forward, backward and AdamW with a warmup and a learning-rate schedule.
#ifndef FY_TRAINER_H
#define FY_TRAINER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"
#include "core/graph.h"
#include "core/stall.h"
#include "runtime/optimizer.h"

#define FY_DEFAULT_SEQ 128  // tokens per sequence when --seq is not given (fewer if the model has fewer positions)

struct fy_train_opts {
  const char *model;      // preset name or a directory/file with config.json
  const char *init;       // NULL (not given) or "random", or a Hugging Face model directory
  const char *data;       // shard, directory of shards, or glob
  int64_t batch, seq, grad_accum, steps;  // seq 0: FY_DEFAULT_SEQ, or the model's positions if fewer
  bool batch_given;       // --batch or --grad-accum was given (a plan file's replace them: said so)
  float lr, min_lr;       // peak and final learning rate of the schedule (min_lr < 0: lr / 10)
  // After the warmup: "cosine" (default) or "linear" from lr down to min_lr at the last step, or
  // "constant" (lr throughout).
  const char *schedule;
  int64_t warmup;         // steps of linear warmup from 0
  struct fy_adamw adamw;
  uint64_t seed;
  bool shuffle;
  int threads;            // 0 = OpenMP's default
  bool recompute;         // recompute decoder layers' activations in backward
  // Dropout on the residual branches while training, where transformers' OPT drops (after
  // out_proj and after fc2): a probability in [0,1), or FY_DROPOUT_CONFIG for config.json's
  // `dropout`. Default 0 (none, as llm.c; the peers compare without it). The masks are drawn
  // from the seed and the tokens' place in the data (ops/dropout.h): any placement, the same.
  float dropout;
  // Where the model state lives (docs/design.md, "Tiers"). device "cpu": everything in host memory.
  // device "sim": the sim device with device_mem bytes holds a cache of chunks; parameters and
  // optimizer state live in the host tier (host_mem bytes, 0 = the machine's memory), and the
  // gradients and AdamW state that do not fit there go to disk_dir.
  const char *device;     // "cpu" (default), "sim" or "cuda"
  bool offload;           // cuda: keep the model state in the host tier and a chunk cache on the
                          //   GPU (as sim always does) instead of everything resident
  size_t device_mem;      // sim: the device's memory (default 1 GiB)
  size_t device_reserve;  // offloaded: device bytes the chunk cache leaves free (fy_sample's
                          //   key/value cache; not an option)
  double sim_link_gbps;   // sim: throttle host<->device copies to this many GB/s (0: unthrottled)
  int sim_jitter_us;      // sim: random delays before each stream's work items and disk requests (stress tests)
  size_t host_mem;        // host tier cap (0: the machine's memory)
  const char *disk_dir;   // disk tier directory (NULL: none)
  int disk_chunks;        // -1: as many as the host cannot hold; else the last N chunks'
                          //   gradients and AdamW state go to disk
  bool disk_master;       // 16-bit compute offloaded: the disk chunks' fp32 master weights go to
                          //   disk too (runtime/offload.h, disk_master); the host keeps their
                          //   16-bit copy. Needs disk chunks.
  int device_chunks;      // the first N chunks stay on the device with their AdamW state, which
                          //   is updated there (default 0: every update runs on the host)
  int prefetch;           // chunks loaded ahead of use (default 2)
  // 1: a one-step-delayed update (runtime/offload.h, optimizer_lag): step s's gradients update
  // the weights after step s+1's passes, which use the weights before them; an update still
  // pending is applied before each checkpoint and at the end (so a run's numbers depend on
  // --save-every, and a resume gives the uninterrupted run's). Offloaded (sim, cuda --offload)
  // with 16-bit compute, and cpu; no --grad-accum. 0 (default): the exact step.
  int optimizer_lag;
  // Offloaded: up to N host-tier chunks updated speculatively before the gradient norm is known
  // (runtime/offload.h, spec_chunks), each with a spare copy of its master, m, v and 16-bit copy
  // in host memory; the same bits as the exact step. 0 (default without a plan): none.
  int spec_chunks;
  int device_updates;     // --device-updates N: host-tier chunks updated by the device (runtime/offload.h); 0: none
  int blocks;             // device cache blocks (0: as many as fit)
  double chunk_mib;       // chunk size (0: the smallest that holds the largest parameter group)
  const char *save;       // without save_every: write a Hugging Face model here at the end;
                          // with it: the checkpoint root (runtime/checkpoint.h)
  int64_t save_every;     // write a training checkpoint every N steps (0: none) and at the end
  int keep;               // checkpoints kept in the root (default 2)
  const char *resume;     // a checkpoint root or step directory to continue from
  int64_t stop_after;     // end (with a checkpoint when on) after this many steps of this run
  // Loss scaling (for 16-bit gradients; exact with fp32 when no overflow): 0 off; > 0 the initial
  // scale of dynamic scaling (a power of two): an overflowing step is skipped and the scale
  // halved, 2000 good steps double it, overflow at the minimum scale (1) stops training.
  double loss_scale;
  // The numbers of the step: "fp32" (default), "bf16" or "fp16" (cpu), "fp32" or "bf16" (cuda).
  // 16-bit: weights, activations and gradients in it (on the cpu rounded to it at every op, held
  // as fp32; on cuda real bf16 tensors), with fp32 master weights and AdamW state
  // (runtime/model.h, compute_dtype); fp16 without loss_scale scales from 65536.
  const char *precision;
  // How AdamW's m and v are stored (ops/ops.h, "AdamW with compressed state"): "fp32" (default,
  // NULL), "bf16" (2 bytes a value, rounded to nearest even at every store) or "8bit" (block-wise
  // quantised codes, one byte a value and a float scale a block of 256: 1.016 bytes). Wherever the
  // state lives: the cpu's model, and offloaded (sim, cuda --offload) the host tier, disk and device
  // chunks; every placement gives the cpu's bits in each. Not on a resident GPU run, nor with --tp.
  const char *optimizer_state;
  // Ranks (runtime/comm.h): under mpirun or srun every rank trains on its own part of each
  // global batch (batch x grad_accum x ranks sequences) and the gradients are summed across ranks
  // before the norm, so N ranks with --batch B follow one rank with --batch N*B.
  const char *comm;       // "auto" (default), "single" or "mpi"
  double comm_timeout;    // seconds a collective may take before the job is aborted (default 300)
  // Tensor parallelism (Megatron's split of the attention and MLP linears, core/opt.h): groups of
  // tp consecutive ranks share each sequence; the ranks / tp groups are data-parallel (a 2-D
  // grid), each with its own part of the global batch. 0 or 1: none. --device cpu.
  int tp;
  // Pipeline parallelism (runtime/pipeline.h): groups of pp ranks (each tp ranks apart) split the
  // decoder layers into pp stages run on the 1F1B schedule over the step's grad_accum
  // micro-batches; the grid is dp x pp x tp, tp innermost. 0 or 1: none. --device cpu, sim and
  // cuda (resident or --offload; not with --tp on cuda).
  int pp;
  // Expert parallelism (runtime/ep.h): within groups of ep consecutive data-parallel ranks each
  // holds E/ep experts of every mixture layer; tokens go to their experts' ranks and back by
  // all-to-all. 0 or 1: none. --device cpu, a mixture of experts.
  int ep;
  const char *plan;       // "auto" (search with the cached probe) or a plan file (planner/plan.h):
                          //   sets micro-batch, accumulation, chunks, blocks, prefetch,
                          //   recomputation and disk placement on the sim device
  atomic_int *stop;       // set (by ferry's signal thread) to end after the current step, with
                          // a checkpoint when checkpoints are on
  const char *log_path;   // JSON lines, one per step (NULL: none)
  // Validation while training: the mean loss over the first val_batches batches of val_data
  // (taken in order, each rank its rows, as ferry eval takes them; forward passes without
  // dropout) every val_every steps and after the last (0: steps / 10, at least 1).
  const char *val_data;
  int64_t val_every, val_batches;
  bool quiet;             // no step lines (tests)
  bool hash_params;       // compute fy_train_result.params_hash at the end (tests: runs compared bit
                          // for bit); a pass over every weight, on the lead rank, so off by default
  bool profile;           // print where a step's time goes, per op kind and phase
  // Offloaded (sim, cuda --offload): time the compute stream's waits alone (--profile times them
  // too, but drains the stream around each op on a GPU, which changes what overlaps).
  bool profile_waits;
  // eval only
  int64_t eval_batches;
  const char *dump;       // write the first batch's inputs and logits here (safetensors)
};

// Defaults: the demo model on the bundled corpus (see README.md).
#define FY_DROPOUT_CONFIG (-1.0f)

// Whether name is a learning-rate schedule fy_lr_at knows (NULL: the default, cosine).
bool fy_lr_schedule_known(const char *name);

void fy_train_opts_defaults(struct fy_train_opts *o);
// The learning rate at step t (0-based) of `steps`: a linear warmup from lr/warmup to lr over the
// first `warmup` steps, then the schedule. (An unknown schedule is refused by fy_train.)
float fy_lr_at(const struct fy_train_opts *o, int64_t t);

struct fy_train_result {
  int64_t steps;
  float first_loss, last_loss;
  // Medians over the steps after the first. gflops: model FLOPs as PaLM and Megatron count them;
  // gflops_llmc: as llm.c counts them (fy_opt_step_flops).
  double tokens_per_s, gflops, gflops_llmc;
  double peak_rss_bytes;
  double model_state_bytes, activation_bytes;  // offloading: this rank's share of the model state
  double host_tier_bytes;     // offloading: the host tier's counter after the last step
  double device_state_bytes;  // offloading: device memory taken by state kept there (device chunks, shards)
  double disk_tier_bytes;     // offloading: bytes reserved in the disk tier's file (its chunks' slots)
  double device_peak_bytes;     // the device's own counter (sim: its pool)
  double step_s;                // median step time (after the first)
  double copy_bytes[2], copy_busy_s[2];  // sim: host->device [0] and device->host [1], whole run
  int n_blocks, n_chunks, n_disk_chunks, n_device_chunks;
  int64_t cache_loads, cache_prefetches, cache_evictions, cache_spills;  // sim: the chunk cache
  // sim, a mixture of experts: the experts' weights loaded, of those whole chunks would have moved
  // (fy_offload_experts; the summary's "expert chunks loaded: X of Y")
  int64_t expert_loads, expert_parts;
  double chunk_bytes;
  uint64_t params_hash;          // with opts.hash_params: FNV-1a of the parameters after training,
                                 // equal iff bit-identical (else 0)
  bool interrupted;              // ended early by opts.stop
  int rank, world;               // this process among the ranks
  int64_t skipped_steps;         // steps skipped for gradient overflow (dynamic loss scaling)
  int spec_chunks;               // --spec-chunks: the chunks that took speculative updates,
  int64_t spec_steps, spec_redone;  // the steps that speculated, those whose updates were redone
  int64_t ignored_steps;         // steps whose every target is ignored (loss masks): nothing updated
  double final_loss_scale;
  double val_loss;               // the last validation's mean loss (NAN without val_data)
  int validations;               // how many ran
  double op_seconds[FY_OP_KIND_COUNT][2];  // with opts.profile: seconds per step per op kind
  // With opts.profile, offloaded on a device with timers (sim, cuda): seconds per step the compute
  // stream waited, by cause (core/stall.h; ferry plan predicts the same); stalls_timed says so.
  double stall_s[FY_STALL_COUNT];
  bool stalls_timed;
  int64_t first_step;            // 0, or the step a resumed run started from
  int checkpoints;               // checkpoints written
  bool ckpt_by_chunk;            // written chunk by chunk from where the state lives (no snapshot fits)
  double checkpoint_s;           // the last checkpoint's write time (background)
  double checkpoint_bytes;       // its size on disk
  double step_s_ckpt;            // median time of steps that ran while a checkpoint was written
};

fy_status fy_train(const struct fy_train_opts *o, struct fy_train_result *res);

// OpenMP threads for one of `local` ranks on a machine of `online` cores when neither --threads
// nor OMP_NUM_THREADS says: the `mine` cores its affinity lets it run on, at most the machine's
// over its ranks (at least 1). *cramped: the rank may run on fewer cores than that share (mpirun
// binds each of 2 ranks to one core), so its host work (AdamW, offloaded or on the cpu) has less.
int fy_rank_threads(int local, int online, int mine, bool *cramped);
// Writes a Hugging Face model directory (config.json, model.safetensors or shards) from a
// checkpoint (a root or a step directory), checking it on the way.
fy_status fy_export(const char *checkpoint, const char *out_dir);
// Mean loss over eval_batches batches of the data (in order), optionally dumping logits: the
// whole model on the cpu or a GPU, or offloaded (sim; cuda with o->offload) through the chunk
// cache in forward passes alone. Several ranks split every batch's rows and combine their sums;
// rank 0 prints the result unless o->quiet.
fy_status fy_eval(const struct fy_train_opts *o, double *mean_loss);

// Continues a prompt with the model (--model/--init of o, on o->device: cpu or a GPU, the whole
// model there): up to `n_new` tokens, each drawn with o->seed from the softmax of the logits after
// the last token divided by temperature (0: the most likely token), among the top_k most likely
// (0: all) and, of those, the fewest most likely whose probabilities sum to top_p (0 or 1: all).
// Drawing one of the stop tokens ends it (the token kept). The window is o->seq tokens (0: the
// model's positions); when it is full its newest half runs again from position 0. The keys and
// values of the tokens before are cached (fy_engine_decode), the prompt runs FY_SAMPLE_PREFILL
// tokens at a time (the rows of the model it builds). out (room for n_prompt + n_new) receives
// the prompt and then the tokens drawn, *n_out in all.
#define FY_SAMPLE_PREFILL 512
struct fy_sample_opts {
  const int32_t *prompt;
  int64_t n_prompt, n_new;
  float temperature;
  int top_k;
  float top_p;
  const int32_t *stop;  // the stop tokens (n_stop of them; -1: the model's eos_token_id, if any)
  int n_stop;
  // Filled in when set: seconds from the model's setup to the first token drawn (the prompt's
  // pass), and from there to the last.
  double *prompt_seconds, *new_seconds;
};
fy_status fy_sample(const struct fy_train_opts *o, const struct fy_sample_opts *s, int32_t *out, int64_t *n_out);

#endif
