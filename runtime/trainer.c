#include "runtime/trainer.h"
#include "runtime/sample.h"

#include <limits.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <json-c/json.h>

#include "core/clock.h"
#include "core/fileio.h"
#include "core/log.h"
#include "core/parse.h"
#include "core/rand.h"
#include "ops/ops.h"
#include "core/safetensors.h"
#include "fy_config.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "runtime/tp.h"
#include "ops/cuda/parts.h"
#include "runtime/engine_cuda.h"
#include "fy_config.h"
#include "planner/plan.h"
#include "planner/probe.h"
#include "memory/tier.h"

void fy_train_opts_defaults(struct fy_train_opts *o) {
  static char demo_data[4096];
  snprintf(demo_data, sizeof demo_data, "%s/data/demo", FY_SOURCE_DIR);
  *o = (struct fy_train_opts){
      .model = NULL, .init = NULL, .data = demo_data, .batch = 16, .seq = 0,
      .grad_accum = 1, .steps = 600, .lr = 2e-3f, .min_lr = -1, .warmup = -1,
      .adamw = fy_adamw_defaults(), .seed = 1337, .shuffle = true, .threads = 0, .device = "cpu",
      .disk_chunks = -1, .prefetch = 2, .keep = 2, .comm = "auto", .comm_timeout = 300,
      .eval_batches = 8, .val_batches = 10};
}

bool fy_lr_schedule_known(const char *name) {
  return !name || !strcmp(name, "cosine") || !strcmp(name, "linear") || !strcmp(name, "constant");
}

float fy_lr_at(const struct fy_train_opts *o, int64_t t) {
  float min_lr = o->min_lr >= 0 ? o->min_lr : o->lr * 0.1f;
  int64_t warm = o->warmup >= 0 ? o->warmup : (o->steps >= 20 ? o->steps / 20 : 0);
  if (t < warm) return o->lr * (float)(t + 1) / (float)warm;
  if (o->steps <= warm + 1 || (o->schedule && strcmp(o->schedule, "constant") == 0)) return o->lr;
  double frac = (double)(t - warm) / (double)(o->steps - warm - 1);
  if (o->schedule && strcmp(o->schedule, "linear") == 0) return min_lr + (float)(1.0 - frac) * (o->lr - min_lr);
  return min_lr + (float)(0.5 * (1.0 + cos(M_PI * frac))) * (o->lr - min_lr);
}

static double peak_rss_bytes(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss * 1024.0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *x, int64_t n) {
  if (n <= 0) return 0;
  qsort(x, (size_t)n, sizeof *x, cmp_double);
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// --init naming a checkpoint root: its latest step directory (the weights; the AdamW state there
// is not read). buf holds the path.
static fy_status resolve_init(const char **init, char *buf, size_t n) {
  if (!*init || strcmp(*init, "random") == 0) return FY_OK;
  fy_status st = fy_ckpt_model_dir(*init, buf, n, init);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "--init %s", *init);
}

// Whether two configurations make the same model (the tensors' shapes and the computation).
static const char *config_difference(const struct fy_opt_config *a, const struct fy_opt_config *b, char *buf,
                                     size_t n) {
  const struct { const char *name; int64_t x, y; } f[] = {
      {"vocab_size", a->vocab_size, b->vocab_size},
      {"hidden_size", a->hidden_size, b->hidden_size},
      {"word_embed_proj_dim", a->word_embed_proj_dim, b->word_embed_proj_dim},
      {"ffn_dim", a->ffn_dim, b->ffn_dim},
      {"num_hidden_layers", a->num_hidden_layers, b->num_hidden_layers},
      {"num_attention_heads", a->num_attention_heads, b->num_attention_heads},
      {"max_position_embeddings", a->max_position_embeddings, b->max_position_embeddings},
      {"do_layer_norm_before", a->do_layer_norm_before, b->do_layer_norm_before},
      {"_remove_final_layer_norm", a->remove_final_layer_norm, b->remove_final_layer_norm},
      {"enable_bias", a->enable_bias, b->enable_bias},
      {"layer_norm_elementwise_affine", a->layer_norm_elementwise_affine, b->layer_norm_elementwise_affine},
      {"tie_word_embeddings", a->tie_word_embeddings, b->tie_word_embeddings},
      {"activation_function (0 relu, 1 gelu)", a->activation, b->activation},
  };
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    if (f[i].x != f[i].y) {
      snprintf(buf, n, "%s %lld, not %lld", f[i].name, (long long)f[i].y, (long long)f[i].x);
      return buf;
    }
  return NULL;
}

// --model naming a Hugging Face directory that holds weights, without --init (or --resume): only
// its config.json is read, so the model starts from random weights. Whoever fine-tunes or
// evaluates "--model opt-1.3b-dir" most likely meant those weights: say so (--init random keeps
// it quiet).
static void warn_weights_unread(const struct fy_train_opts *o) {
  if (!o->model || o->init || o->resume) return;
  char dir[4096];
  struct stat sb;
  if (stat(o->model, &sb) != 0 || snprintf(dir, sizeof dir, "%s", o->model) >= (int)sizeof dir) return;
  if (!S_ISDIR(sb.st_mode)) {  // a config.json given itself: the weights would be beside it
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else snprintf(dir, sizeof dir, ".");
  }
  const char *weights = fy_safetensors_dir_weights(dir);
  if (weights)
    fy_log_warn("--model %s gives the model's shape only (its config.json): the weights beside it (%s) are not "
                "loaded, and the model starts from random weights; --init %s starts from them (--init random: "
                "random on purpose)",
                o->model, weights, dir);
}

// The model's configuration: --model (preset or config), else the --init checkpoint's, else the
// --resume checkpoint's, else the demo. A resumed run continues the checkpoint's model: a --model
// or --init of another model is refused (it failed on the first tensor's shape, or trained a
// model of another activation or layer-norm placement from the checkpoint's weights).
static fy_status resolve_config(const struct fy_train_opts *o, struct fy_opt_config *cfg) {
  const char *src = o->model;
  if (!src && o->init && strcmp(o->init, "random") != 0) src = o->init;
  struct fy_opt_config saved;
  if (o->resume) {
    char dir[4096];
    fy_status st = fy_ckpt_resolve(o->resume, dir, sizeof dir);
    if (st == FY_OK) st = fy_ckpt_verify(dir);  // (before the run is set up; later reads find it checked)
    if (st == FY_OK) st = fy_ckpt_config_read(dir, &saved);
    if (st != FY_OK) return fy_error_wrap(st, "--resume %s", o->resume);
    if (!src) {
      *cfg = saved;
      return FY_OK;
    }
  }
  if (!src) src = "opt-demo";
  struct stat sb;
  if (stat(src, &sb) == 0) {
    FY_TRY(fy_ckpt_config_read(src, cfg));
  } else if (fy_opt_preset(src, cfg) != FY_OK) {
    return fy_error_set(FY_ERR_NOT_FOUND,
                        "--model %s is neither a preset nor a directory with config.json "
                        "(presets: opt-tiny, opt-demo, opt-125m ... opt-175b)", src);
  }
  char why[128];
  if (o->resume && config_difference(cfg, &saved, why, sizeof why))
    return fy_error_set(FY_ERR_INVALID,
                        "--resume %s holds another model than %s %s (its config.json: %s); a resumed run "
                        "continues the checkpoint's model: leave out %s",
                        o->resume, o->model ? "--model" : "--init", src, why, o->model ? "--model" : "--init");
  return FY_OK;
}

// The dropout a training run applies (--dropout, or config.json's with --dropout config).
static float train_dropout(const struct fy_train_opts *o, const struct fy_opt_config *cfg) {
  return o->dropout == FY_DROPOUT_CONFIG ? cfg->dropout : o->dropout;
}

// Everything one run holds; torn down in reverse.
struct run {
  struct fy_comm *comm;  // the ranks (single when launched alone)
  int rank, world;
  // A dp x tp grid: rank = dp_rank * tp + tp_rank. dp_comm: the ranks holding the same slices
  // (the world without tensor parallelism); tp_comm: those sharing sequences (NULL for tp 1).
  int tp, tp_rank, dp, dp_rank;
  struct fy_comm *dp_comm, *tp_comm;
  // The groups of the ops' pattern hooks (sim and GPUs: on the compute stream); on GPUs with
  // resident parameters dp_compute also sums the replicas' gradients (nccl).
  struct fy_comm *tp_compute, *dp_compute;
  // Sharded chunks: the blocks' collectives, over dp_comm's ranks: nccl on GPUs, an mpi
  // communicator of their own on sim (the same plumbing as on GPUs).
  struct fy_comm *dp_blocks;
  // With tensor parallelism: the whole model's graph and, when needed, its weights (the model as
  // Hugging Face files and checkpoints hold it; params NULL while not needed).
  struct fy_graph *whole_graph;
  struct fy_model whole;
  struct fy_opt_config cfg;
  struct fy_device *dev;
  struct fy_host_tier *host;
  struct fy_disk_tier *disk;
  struct fy_model *model;
  struct fy_offload *x;  // NULL: parameters resident on a cpu device
  bool ckpt_by_chunk;    // checkpoints written chunk by chunk from the offloaded state (fy_ckpt_write_pieces)
  bool eval;             // set up for evaluation (an offload engine of forward passes alone)
  fy_data *data;
  fy_data *val;          // validation batches (--val-data), NULL without
  int gpu;               // the GPU a cuda run trains on, -1 on the cpu and sim devices
  int64_t updates;       // AdamW updates applied: the next one's bias correction is for updates + 1
  // --optimizer-lag on the cpu: the gradients of the last step (lag_grads, swapped with the
  // model's own, which lag_own was allocated to stand in for) and that step's update's arguments,
  // applied after the next step's passes (step_resident) or by drain_updates.
  float *lag_grads, *lag_own;
  struct lagged_update { bool pending, skip; float lr, grad_scale; int64_t t; double norm; } lag;
};

static size_t machine_ram(void) {
  return (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
}

// The host memory one rank may use by default: its share of the node's, which its ranks share.
static size_t rank_ram(const struct run *r) {
  int n = r->comm ? fy_comm_local_size(r->comm) : 1;
  return machine_ram() / (size_t)(n > 0 ? n : 1);
}

int fy_rank_threads(int local, int online, int mine, bool *cramped) {
  int share = local > 0 ? online / local : online;
  if (share < 1) share = 1;
  *cramped = mine < share;
  return mine < share ? (mine >= 1 ? mine : 1) : share;
}

// Several ranks on this machine share its cores. Open MPI's mpirun binds each rank to a core of its
// own for 2 ranks, to a socket (every core, on one socket) for more, and to nothing with
// --oversubscribe or --bind-to none; a rank's team would then take every core it sees, and teams
// that outnumber the cores wait on each other at every barrier (a small kernel many times slower).
// Bound to fewer cores than its share, a rank's host work is slower than it need be: said once,
// by rank 0.
static void share_cores(const struct run *r) {
  const int local = r->comm ? fy_comm_local_size(r->comm) : 1;
  if (local <= 1 || getenv("OMP_NUM_THREADS")) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  const int online = (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (online < 1 || sched_getaffinity(0, sizeof set, &set) != 0) return;
  const int mine = CPU_COUNT(&set);
  bool cramped = false;
  const int n = fy_rank_threads(local, online, mine, &cramped);
  if (r->rank == 0 && cramped)
    fy_log_warn("each of the %d ranks here may run on %d of this machine's %d cores (as mpirun binds them): its "
                "host work (AdamW, the cpu's kernels) gets %d thread%s; mpirun --bind-to none lets each take %d",
                local, mine, online, n, n == 1 ? "" : "s", online / local);
  if (n < omp_get_max_threads()) {
    if (r->rank == 0)
      fy_log_info("%d ranks share this machine's %d cores: %d OpenMP thread%s each (--threads N sets it)", local,
                  online, n, n == 1 ? "" : "s");
    omp_set_num_threads(n);
  }
}

// --precision as a dtype (checked in setup: fp32, bf16 or fp16; fy_train fills in the default).
static enum fy_dtype precision_dtype(const struct fy_train_opts *o) {
  enum fy_dtype dt = FY_F32;
  fy_precision_dtype(o->precision, &dt);
  return dt;
}

// --optimizer-state as a format (checked in check_train_opts; NULL: fp32).
static enum fy_state_format state_format(const struct fy_train_opts *o) {
  enum fy_state_format f = FY_STATE_F32;
  if (o->optimizer_state) fy_state_format_from_name(o->optimizer_state, &f);
  return f;
}

// A communicator over c's ranks for collectives on the compute device's memory: an mpi one for
// host memory, NCCL's for a GPU's (bootstrapped by an mpi one).
static fy_status device_comm(struct fy_comm *c, int rank, bool cuda, struct fy_comm **out) {
  struct fy_comm *split = NULL;
  FY_TRY(fy_comm_split(c, 0, rank, &split));
  if (!cuda) {
    *out = split;
    return FY_OK;
  }
#if FY_HAVE_NCCL
  return fy_comm_nccl_create(split, out);  // (takes split)
#else
  fy_comm_free(split);
  return fy_error_set(FY_ERR_UNSUPPORTED, "this ferry was built without NCCL");
#endif
}

// On a GPU: what is in use there besides ferry's own count (the CUDA context, cuBLASLt's
// handles, NCCL's buffers, other processes), 0 elsewhere.
static double gpu_other_bytes(const struct run *r) {
#if FY_HAVE_CUDA
  if (r->gpu < 0) return 0;
  size_t free_b, total;
  fy_engine_cuda_memory(r->gpu, &free_b, &total);
  double used = (double)total - (double)free_b, ours = (double)r->dev->bytes_in_use;
  return used > ours ? used - ours : 0;
#else
  (void)r;
  return 0;
#endif
}

#if FY_HAVE_CUDA
// This rank's GPU (its local rank on the node: one rank per GPU) as r->dev, capped at --device-mem.
static fy_status open_gpu(const struct fy_train_opts *o, struct run *r) {
  int gpu = 0;
  if (r->world > 1) FY_TRY(fy_engine_cuda_rank_device(r->rank, fy_comm_local_rank(r->comm), &gpu));
  FY_TRY(fy_engine_cuda_device(gpu, o->device_mem, &r->dev));
  r->gpu = gpu;
  return FY_OK;
}

// A model resident on the run's GPU: what it will take there (fy_cost_resident_bytes, to the
// byte) against --device-mem or what the GPU has free, refused before anything is allocated with
// the numbers and the ways to make it fit.
static fy_status resident_fits(const struct fy_train_opts *o, const struct run *r) {
  const int gpu = r->gpu;
  double need, state;
  FY_TRY(fy_cost_resident_bytes(&r->cfg, o->batch, o->seq, o->recompute, !r->eval, precision_dtype(o) != FY_F32,
                                o->grad_accum > 1, &need, &state));
  const double has = o->device_mem ? (double)o->device_mem : (double)fy_engine_cuda_free_memory(gpu);
  if (need <= has || has <= 0) return FY_OK;
  char b[4][32];
  // (A model for evaluation or sampling: weights and activations alone, and other remedies.)
  const char *remedy = r->eval ? "run it on the cpu (--device cpu), or, with ferry eval, offloaded (--offload: the "
                                 "weights in pinned host memory, a cache of its chunks on the GPU) or with a smaller "
                                 "--batch"
                               : "train it offloaded (--offload: the state in pinned host memory, a cache of its "
                                 "chunks on the GPU), or with --recompute or a smaller --batch, or split over GPUs "
                                 "(--tp)";
  return fy_error_set(FY_ERR_NOMEM,
                      "%s resident on GPU %d with micro-batch %lld x %lld needs %s (%s of weights%s, %s of "
                      "activations and kernel scratch) but %s %s: %s", r->cfg.name, gpu, (long long)o->batch,
                      (long long)o->seq, fy_format_bytes(need, b[0], sizeof b[0]),
                      fy_format_bytes(state, b[1], sizeof b[1]), r->eval ? "" : ", gradients and AdamW state",
                      fy_format_bytes(need - state, b[2], sizeof b[2]),
                      o->device_mem ? "--device-mem is" : "the GPU has", fy_format_bytes(has, b[3], sizeof b[3]), remedy);
}
#endif

// The offloading setup: the device (sim, or a GPU), host tier, optional disk tier, chunked model,
// offload engine.
static fy_status setup_offload(const struct fy_train_opts *o, struct run *r, bool cuda) {
  const struct fy_opt_config *cfg = &r->cfg;
  // 16-bit compute: the blocks hold bf16 on a GPU, rounded floats (4 bytes) on sim.
  enum fy_dtype cdt = precision_dtype(o);
  size_t esize = cuda && cdt != FY_F32 ? 2 : 4;
  size_t dev_mem = o->device_mem ? o->device_mem : (size_t)1 << 30;
  size_t host_cap = o->host_mem ? o->host_mem : rank_ram(r);
  if (cuda) {
#if FY_HAVE_CUDA
    FY_TRY(open_gpu(o, r));
    if (!o->device_mem) {  // the cache takes what the GPU has free, less a margin for CUDA's own
      dev_mem = fy_engine_cuda_free_memory(r->gpu) / 100 * FY_CUDA_FREE_PERCENT;
      if (!dev_mem) return fy_error_set(FY_ERR_NOT_FOUND, "--device cuda: cannot read the GPU's free memory");
      r->dev->cap = dev_mem;
    }
    FY_TRY(fy_engine_cuda_host_tier(host_cap, &r->host));
#else
    return fy_error_set(FY_ERR_UNSUPPORTED, "--device cuda: this ferry was built without CUDA");
#endif
  } else {
    FY_TRY(fy_device_sim_create(dev_mem, o->sim_link_gbps, &r->dev));
    if (o->sim_jitter_us > 0) fy_device_sim_set_jitter(r->dev, o->sim_jitter_us, o->seed);
    FY_TRY(fy_host_tier_create(host_cap, -1, NULL, NULL, &r->host));
  }
  int64_t chunk = (int64_t)(o->chunk_mib * 1048576.0 / 4), ce0;  // --chunk-mib counts fp32 elements
  size_t need;
  FY_TRY(fy_offload_plan_min_bytes(cfg, o->batch, o->seq, r->tp, o->recompute, r->eval, cuda, esize, chunk, &need, &ce0));
  const enum fy_state_format sf = state_format(o);
  if (r->dp > 1) {  // chunks split into one shard per rank, each of whole 64-byte lines
    // (8-bit state: of whole blocks of FY_Q8_BLOCK elements, so that each shard quantises the
    // unsharded run's blocks; the layout's groups are packed at such multiples too, model.c)
    int64_t q = (sf == FY_STATE_Q8 && !r->eval ? FY_Q8_BLOCK : 16) * (int64_t)r->dp;
    if (ce0 % q != 0)
      FY_TRY(fy_offload_plan_min_bytes(cfg, o->batch, o->seq, r->tp, o->recompute, r->eval, cuda, esize, (ce0 + q - 1) / q * q,
                                       &need, &ce0));
  }
  need += o->device_reserve;  // (the cuda engine's own buffers are in need: they come out of the same cap)
  if (need > dev_mem) {
    char has[32], chunk_b[32], need_b[32];
    return fy_error_set(FY_ERR_NOMEM,
                        "--device-mem %s cannot hold the smallest working set of %s with micro-batch "
                        "%lld x %lld (the chunks one operator needs at once, %s each, plus the "
                        "activations%s): it needs at least %s%s",
                        fy_format_bytes((double)dev_mem, has, sizeof has), cfg->name, (long long)o->batch,
                        (long long)o->seq, fy_format_bytes((double)ce0 * esize, chunk_b, sizeof chunk_b),
                        o->device_reserve ? " and the key/value cache" : "",
                        fy_format_bytes((double)need, need_b, sizeof need_b),
                        o->recompute || r->eval ? "" : " (--recompute lowers it)");
  }
  // By default chunks are as small as the largest parameter group allows: finer caching.
  // Tensor parallelism: the ops' collectives run on the compute stream, on a group of their own
  // (on GPUs through NCCL, on the activations in device memory).
  if (r->tp > 1) {
    fy_status st = device_comm(r->tp_comm, r->tp_rank, cuda, &r->tp_compute);
    if (st != FY_OK) return fy_error_wrap(st, "--tp %d on GPUs", r->tp);
  }
  if (r->world > 1) FY_TRY(fy_comm_split(r->dp_comm, 0, r->dp_rank, &r->dp_compute));
  // Chunks sharded across ranks: no whole-model weights, each rank sets its shards alone
  // (set_shards; with tensor parallelism from the whole model's tensors, tp_take_weights). So does
  // evaluation (or sampling) in bf16 on a GPU, whose chunks' bf16 copies are the weights.
  struct fy_model_opts mo = {.recompute = o->recompute, .inference = r->eval, .chunk_elems = ce0, .host = r->host,
                             .tp = r->tp, .tp_rank = r->tp_rank, .tp_comm = r->tp_compute,
                             .state_format = r->eval ? FY_STATE_F32 : sf,
                             .no_params = r->dp > 1 || (r->eval && cuda && cdt != FY_F32),
                             .act16 = cuda && cdt != FY_F32};
  FY_TRY(fy_model_create_with(cfg, o->batch, o->seq, r->dev, &mo, &r->model));
  r->model->dp_comm = r->dp_compute;
#if FY_HAVE_CUDA
  if (cuda) FY_TRY(fy_engine_cuda_attach(r->model));  // its kernels launch on the offload's compute stream
#endif
  if (cdt != FY_F32) FY_TRY(fy_model_set_compute_dtype(r->model, cdt));
  const struct fy_chunk_layout *l = r->model->layout;
  // Gradients and AdamW's m and v go to the host tier while they fit (after the parameters and a
  // few chunk-sized buffers), the rest of the chunks' to disk.
  // Kept aside: chunk-sized buffers for spilling (a few at once) and, with a disk tier, for two
  // disk chunks' m and v (one read while the other is written) and, with fp32 gradients, one's
  // gradients and its write-back.
  // With sharding each rank keeps 1/N of every chunk's state (its weights too, once training starts).
  size_t chunk_bytes = (size_t)l->chunk_elems * 4, in_use = fy_host_in_use(r->host);
  bool g16 = fy_offload_grads_in_copy(cdt, (int)o->grad_accum);  // no fp32 gradients in the host tier
  // Per chunk: m, v, the gradients unless they come home over the 16-bit copy, and with sharding
  // the rank's shard of the master weights (one rank's stay in the model's buffer, counted in use).
  // (Evaluation keeps no gradients, m or v: only the sharded weights.)
  // m and v in the run's state format: a slot of fy_state_moment_bytes(S) each (runtime/offload.c).
  size_t shard_bytes = chunk_bytes / (size_t)r->dp,
         mv_bytes = 2 * fy_state_moment_bytes(sf, l->chunk_elems / r->dp),
         per_chunk = ((r->dp > 1) + (r->eval || g16 ? 0 : 1)) * shard_bytes + (r->eval ? 0 : mv_bytes);
  size_t reserve = 3 * chunk_bytes;
  if (cdt != FY_F32) reserve += (size_t)l->n_chunks * (size_t)l->chunk_elems / (size_t)r->dp * esize;  // 16-bit weights
  size_t spare = host_cap > in_use + reserve ? host_cap - in_use - reserve : 0;
  int fit = per_chunk ? (int)(spare / per_chunk) : l->n_chunks;
  if (fit < l->n_chunks && !r->eval) {
    reserve += 2 * mv_bytes + (g16 ? 0 : 3) * shard_bytes;  // (the disk chunks' buffers: runtime/offload.c)
    spare = host_cap > in_use + reserve ? host_cap - in_use - reserve : 0;
    fit = (int)(spare / per_chunk);
  }
  if (r->eval && fit < l->n_chunks)
    return fy_error_set(FY_ERR_NOMEM, "the weights' shards do not fit in the host memory (--host-mem)");
  int n_dev = o->device_chunks < l->n_chunks ? o->device_chunks : l->n_chunks;
  // (The device's own chunks keep their state there: the host tier holds the rest's.)
  int n_host = l->n_chunks - (n_dev > 0 && r->dp == 1 ? n_dev : 0);
  int n_disk = o->disk_chunks >= 0 ? o->disk_chunks : (fit >= n_host ? 0 : n_host - fit);
  // Several ranks: the shards live in the host tier, or all of them on the device.
  bool shards_on_device = r->dp > 1 && n_dev == l->n_chunks;
  if (r->dp > 1 && n_dev > 0 && !shards_on_device)
    return fy_error_set(FY_ERR_INVALID, "--device-chunks %d: with %d ranks the chunks are sharded, and their shards live "
                        "either all in the host tier (0) or all on the device (%d or more)", o->device_chunks, r->dp,
                        l->n_chunks);
  if (shards_on_device && cuda)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--device-chunks %d with %d ranks on GPUs: sharded chunks are updated by "
                        "the host, so their shards live in pinned host memory (--device-chunks 0)", o->device_chunks,
                        r->dp);
  if (shards_on_device) n_dev = 0;
  if (o->disk_chunks < 0 && n_disk > l->n_chunks - n_dev) n_disk = l->n_chunks - n_dev;
  if (n_disk > l->n_chunks) n_disk = l->n_chunks;
  if (shards_on_device && o->disk_chunks < 0) n_disk = 0;
  if (shards_on_device && n_disk > 0)
    return fy_error_set(FY_ERR_INVALID, "--device-chunks %d keeps every shard on the device; --disk-chunks must be 0",
                        o->device_chunks);
  char b1[32], b2[32], b3[32], b4[32];
  if (n_disk > 0 && !o->disk_dir)
    return fy_error_set(FY_ERR_NOMEM,
                        "the gradients and AdamW state of %d of %d chunks (%s) do not fit in the host "
                        "memory (--host-mem %s, %s of it for the parameters); give a disk tier with --disk-dir",
                        n_disk, l->n_chunks,
                        fy_format_bytes((double)n_disk * ((g16 ? 0.0 : (double)shard_bytes) + (double)mv_bytes), b1, sizeof b1),
                        fy_format_bytes((double)host_cap, b2, sizeof b2), fy_format_bytes((double)in_use, b3, sizeof b3));
  if (n_disk > 0) {
    // Each disk chunk's slot holds its m, v and, unless they come home over the 16-bit copy, its
    // gradients (fp32, this rank's shard). The file grows as steps write it, so a disk too small is
    // said now rather than at a step's first write; the ranks on this machine (given the same
    // --disk-dir) share its file system.
    const size_t need = (size_t)n_disk * fy_disk_slot_bytes((g16 ? 0 : shard_bytes) + mv_bytes);
    const int local = r->comm && fy_comm_local_size(r->comm) > 1 ? fy_comm_local_size(r->comm) : 1;
    double space = 0;
    fy_status st = fy_mkdir_p(o->disk_dir);  // (made when missing, as --save's directory is)
    if (st == FY_OK) st = fy_disk_space(o->disk_dir, &space);
    if (st == FY_OK && (double)need * local > space) {
      char b5[32];
      return fy_error_set(FY_ERR_NOMEM,
                          "--disk-dir %s: the gradients and AdamW state of %d of %d chunks need %s on disk%s%s%s, and "
                          "its file system has %s free: free some space, give a --disk-dir on a larger disk, or more "
                          "--host-mem (now %s, %s of it for the parameters)", o->disk_dir, n_disk, l->n_chunks,
                          fy_format_bytes((double)need, b1, sizeof b1), local > 1 ? " (" : "",
                          local > 1 ? fy_format_bytes((double)need * local, b4, sizeof b4) : "",
                          local > 1 ? " for the ranks on this machine)" : "",
                          fy_format_bytes(space, b2, sizeof b2), fy_format_bytes((double)host_cap, b3, sizeof b3),
                          fy_format_bytes((double)in_use, b5, sizeof b5));
    }
    if (st == FY_OK) st = fy_disk_tier_open(o->disk_dir, need, &r->disk);
    if (st != FY_OK) return fy_error_wrap(st, "--disk-dir");
    if (o->sim_jitter_us > 0) fy_disk_set_jitter(r->disk, o->sim_jitter_us, o->seed + 1);  // (the test hook too)
  }
  if (r->dp > 1) {  // the blocks' gathers and reduce-scatters (in GPU memory: through NCCL)
    fy_status st = device_comm(r->dp_comm, r->dp_rank, cuda, &r->dp_blocks);
    if (st != FY_OK) return fy_error_wrap(st, "%d data-parallel ranks%s", r->dp, cuda ? " on GPUs" : "");
  }
  struct fy_offload_opts xo = {.forward_only = r->eval, .prefetch = o->prefetch, .n_blocks = o->blocks,
                               .device_reserve = o->device_reserve, .max_micro = (int)o->grad_accum,
                               .disk = r->disk, .n_disk_chunks = n_disk, .n_device_chunks = n_dev,
                               .comm = r->dp_comm, .block_comm = r->dp_blocks, .shards_on_device = shards_on_device,
                               .tp_comm = r->tp_comm, .optimizer_lag = o->optimizer_lag};
  fy_status st = fy_offload_create(r->model, &xo, &r->x);
  if (st == FY_ERR_NOMEM && in_use + reserve > host_cap)
    return fy_error_wrap(st, "--host-mem %s holds the parameters (%s) but not the chunk-sized buffers the offload "
                         "keeps beside them (about %s): give more, about %s", fy_format_bytes((double)host_cap, b1, sizeof b1),
                         fy_format_bytes((double)in_use, b2, sizeof b2), fy_format_bytes((double)reserve, b3, sizeof b3),
                         fy_format_bytes((double)(in_use + reserve), b4, sizeof b4));
  return st;
}

// Weights part by part for the shards of a sharded run (fy_offload_set_shards): from a Hugging
// Face directory or checkpoint (dir), or OPT's initialisation.
static fy_status shard_fill(void *ctx, int64_t lo, int64_t hi, float *dst) {
  fy_model_source_fill(ctx, lo, hi, dst);
  return FY_OK;
}

static fy_status set_shards(struct run *r, const char *dir, uint64_t seed) {
  struct fy_model_source *s;
  FY_TRY(fy_model_source_open(r->model, dir, seed, &s));
  fy_status st = fy_offload_set_shards(r->x, shard_fill, s);
  fy_model_source_close(s);
  return st;
}

static void tp_read_weights(void *ctx, int i, int64_t a, int64_t b, float *dst) {
  fy_model_source_read(ctx, i, a, b, dst);
}

// A source of whole tensors (fy_tp_read_fn) as pieces of this rank's flat layout (fy_tp_fill): for
// fy_offload_set_shards, and AdamW's state chunk by chunk.
struct tp_fill_source {
  const struct fy_graph *part;
  fy_tp_read_fn read;
  void *ctx;
};

static fy_status tp_shard_fill(void *ctx, int64_t lo, int64_t hi, float *dst) {
  const struct tp_fill_source *f = ctx;
  fy_tp_fill(f->part, lo, hi, f->read, f->ctx, dst);
  return FY_OK;
}

// Tensor parallelism: this rank's slices of the weights, read tensor by tensor from a Hugging Face
// directory or checkpoint (dir) or drawn as OPT's initialisation (the values of the whole model,
// whatever --tp). Sharded (no weight buffer): straight into the rank's shards, never its slices
// whole.
static fy_status tp_take_weights(struct run *r, const char *dir, uint64_t seed) {
  struct fy_model_source *s;
  FY_TRY(fy_model_source_open(&r->whole, dir, seed, &s));
  fy_status st = FY_OK;
  if (r->model->params) {
    fy_tp_take(r->model->graph, r->model->params, r->whole_graph, tp_read_weights, s);
    r->model->cparams_fresh = false;
  } else {
    struct tp_fill_source f = {r->model->graph, tp_read_weights, s};
    st = fy_offload_set_shards(r->x, tp_shard_fill, &f);
  }
  fy_model_source_close(s);
  return st;
}

// --seq against the model's learned positions.
static fy_status seq_fits(int64_t seq, const struct fy_opt_config *cfg) {
  if (seq <= cfg->max_position_embeddings) return FY_OK;
  return fy_error_set(FY_ERR_INVALID, "--seq %lld is longer than the model allows (%lld positions)", (long long)seq,
                      (long long)cfg->max_position_embeddings);
}

// The run's communicator over every rank (--comm, --comm-timeout).
static fy_status make_comm(const struct fy_train_opts *o, struct fy_comm **out) {
  return fy_comm_create(o->comm ? o->comm : "auto", o->comm_timeout > 0 ? o->comm_timeout : 300, out);
}

// comm: the run's communicator when the caller made it already (it is the run's then, freed by
// teardown), else NULL to make it here.
static fy_status setup(const struct fy_train_opts *o, struct run *r, bool shuffle, bool eval, struct fy_comm *comm) {
  memset(r, 0, sizeof *r);
  r->eval = eval;
  r->gpu = -1;
  if (comm) r->comm = comm;
  else FY_TRY(make_comm(o, &r->comm));
  r->rank = fy_comm_rank(r->comm);
  r->world = fy_comm_size(r->comm);
  if (r->world > 1) fy_log_set_rank(r->rank);
  r->tp = o->tp > 1 ? o->tp : 1;
  if (r->world % r->tp != 0)
    return fy_error_set(FY_ERR_INVALID, "--tp %d does not divide the %d rank%s: run a multiple of %d ranks (mpirun -np %d "
                        "ferry ...)", r->tp, r->world, r->world == 1 ? "" : "s", r->tp, r->tp);
  r->tp_rank = r->rank % r->tp;
  r->dp_rank = r->rank / r->tp;
  r->dp = r->world / r->tp;
  r->dp_comm = r->comm;
  if (r->tp > 1) {
    FY_TRY(fy_comm_split(r->comm, r->dp_rank, r->tp_rank, &r->tp_comm));
    FY_TRY(fy_comm_split(r->comm, r->tp_rank, r->dp_rank, &r->dp_comm));  // of one rank when dp is 1
  }
  if (o->batch < 1) return fy_error_set(FY_ERR_INVALID, "--batch must be at least 1");
  if (o->seq < 1) return fy_error_set(FY_ERR_INVALID, "--seq must be at least 1");
  if (o->threads > 0) omp_set_num_threads(o->threads);
  else share_cores(r);
  FY_TRY(resolve_config(o, &r->cfg));
  if (r->rank == 0) warn_weights_unread(o);
  // Dropout while training (evaluation has none); its probability is checked with the graph.
  if (!eval) r->cfg.train_dropout = train_dropout(o, &r->cfg);
  FY_TRY(seq_fits(o->seq, &r->cfg));
  fy_status st;
  const char *device = o->device ? o->device : "cpu";
  // Several ranks: replicated parameters on the cpu device, chunk-sharded ones (zero) on sim and on GPUs.
  enum fy_dtype cdt;
  if (o->precision && !fy_precision_dtype(o->precision, &cdt))
    return fy_error_set(FY_ERR_INVALID, "--precision %s: fp32, bf16 or fp16", o->precision);
  if (o->precision && strcmp(o->precision, "fp32") != 0 && strcmp(device, "cpu") != 0 && strcmp(device, "sim") != 0 &&
      !(strcmp(device, "cuda") == 0 && strcmp(o->precision, "bf16") == 0))
    return fy_error_set(FY_ERR_UNSUPPORTED, "--precision %s with --device %s: 16-bit compute runs on --device cpu "
                        "and sim (bf16, fp16) and cuda (bf16)", o->precision, device);
  if (o->offload && strcmp(device, "cuda") != 0)
    return fy_error_set(FY_ERR_INVALID, "--offload is for --device cuda (the sim device always offloads, the cpu "
                        "device never does)");
  if (r->tp > 1 && strcmp(device, "cpu") != 0 && strcmp(device, "sim") != 0 && strcmp(device, "cuda") != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--tp %d with --device %s: tensor parallelism runs on --device cpu, sim "
                        "or cuda", r->tp, device);
  // --tp on GPUs without --offload: each rank's slices stay on its GPU with their gradients and
  // AdamW state, updated there (the offload engine with every chunk on the device: its cache is
  // not used). Evaluation keeps no state: its slices go through the cache as offloaded.
  const bool tp_resident = r->tp > 1 && strcmp(device, "cuda") == 0 && !o->offload;
  if (tp_resident && r->dp > 1)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--tp %d on %d ranks with --device cuda: a grid of %d data-parallel x %d "
                        "tensor-parallel GPUs shards its chunks through pinned host memory: add --offload", r->tp,
                        r->world, r->dp, r->tp);
  if (tp_resident && o->disk_chunks > 0)
    return fy_error_set(FY_ERR_INVALID, "--disk-chunks %d with --tp %d on GPUs: without --offload every chunk's state "
                        "stays on the GPUs; add --offload to put some on disk", o->disk_chunks, r->tp);
  if (r->world > 1 && strcmp(device, "cpu") != 0 && strcmp(device, "sim") != 0 && strcmp(device, "cuda") != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "%d ranks with --device %s: several ranks train with --device cpu or "
                        "cuda (replicated parameters), sim or cuda --offload (chunks sharded across the ranks)",
                        r->world, device);
  if (tp_resident) {
    struct fy_train_opts all = *o;
    all.device_chunks = eval ? 0 : INT_MAX;
    FY_TRY(setup_offload(&all, r, true));
  } else if (strcmp(device, "sim") == 0 || (strcmp(device, "cuda") == 0 && o->offload)) {
    FY_TRY(setup_offload(o, r, strcmp(device, "cuda") == 0));
  } else if (strcmp(device, "cpu") == 0) {
    // The cpu device may hand out what the machine has (its share of it, with several ranks); a
    // model that cannot fit is refused before anything is allocated, with what it would need.
    FY_TRY(fy_device_cpu_create(rank_ram(r), &r->dev));
    struct fy_model_opts mo = {.recompute = o->recompute, .tp = r->tp, .tp_rank = r->tp_rank, .tp_comm = r->tp_comm,
                               .inference = r->eval, .state_format = r->eval ? FY_STATE_F32 : state_format(o)};
    st = fy_model_create_with(&r->cfg, o->batch, o->seq, r->dev, &mo, &r->model);
    int local = fy_comm_local_size(r->comm);
    char ram[32];
    if (st != FY_OK && local > 1)
      return fy_error_wrap(st, "%d ranks share this machine's %s, each replicating the model", local,
                           fy_format_bytes((double)machine_ram(), ram, sizeof ram));
    FY_TRY(st);
    r->model->dp_comm = r->dp_comm;  // the ops run on this thread
    if (precision_dtype(o) != FY_F32) FY_TRY(fy_model_set_compute_dtype(r->model, precision_dtype(o)));
    if (o->grad_accum > 1) FY_TRY(fy_model_enable_accumulation(r->model));
    if (o->optimizer_lag > 0 && !r->eval) {
      r->lag_own = calloc((size_t)r->model->graph->n_param_elems, sizeof(float));
      if (!r->lag_own) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the gradients --optimizer-lag keeps");
      r->lag_grads = r->lag_own;
    }
  } else if (strcmp(device, "cuda") == 0) {
#if FY_HAVE_CUDA
    // Everything resident on the GPU (--offload takes the branch above), fp32 or bf16 compute;
    // several ranks are replicas, one GPU each, whose gradients NCCL sums.
    FY_TRY(open_gpu(o, r));
    FY_TRY(resident_fits(o, r));
    if (r->dp > 1) {
      st = device_comm(r->dp_comm, r->dp_rank, true, &r->dp_compute);
      if (st != FY_OK) return fy_error_wrap(st, "%d ranks on GPUs", r->dp);
    }
    // (Evaluation or sampling in bf16 keeps the weights in bf16 alone: 2 bytes a parameter.)
    struct fy_model_opts mo = {.recompute = o->recompute, .inference = r->eval,
                               .act16 = precision_dtype(o) != FY_F32, .weights16 = r->eval};
    FY_TRY(fy_model_create_with(&r->cfg, o->batch, o->seq, r->dev, &mo, &r->model));
    r->model->dp_comm = r->dp_compute;  // (the hooks and the gradients' sum: on the GPU's stream)
    FY_TRY(fy_engine_cuda_attach(r->model));
    if (precision_dtype(o) != FY_F32) FY_TRY(fy_model_set_compute_dtype(r->model, precision_dtype(o)));
    if (o->grad_accum > 1) FY_TRY(fy_model_enable_accumulation(r->model));
#else
    return fy_error_set(FY_ERR_UNSUPPORTED, "--device cuda: this ferry was built without CUDA (no nvcc, or -Dcuda=disabled)");
#endif
  } else {
    return fy_error_set(FY_ERR_INVALID, "--device %s: ferry knows cpu, sim and cuda", device);
  }
  r->model->dropout_seed = o->seed;
  // With tensor parallelism each rank takes its slices of the whole model's tensors (so that any
  // tp starts from the same weights as one rank); r->whole describes the whole model (no buffers).
  if (r->tp > 1) {
    FY_TRY(fy_opt_build_graph(&r->cfg, o->batch, o->seq, &r->whole_graph));
    r->whole = (struct fy_model){.cfg = r->cfg, .graph = r->whole_graph, .kernels = &fy_model_cpu_kernels};
  }
  bool random = !o->init || strcmp(o->init, "random") == 0;
  if (r->tp > 1) {
    st = tp_take_weights(r, random ? NULL : o->init, o->seed);  // (m and v are zero from their allocation)
    if (st != FY_OK) return fy_error_wrap(st, "--init");
  } else if (r->model->host && !r->model->params) {  // sharded, or bf16 chunks alone: this rank's part
    st = set_shards(r, random ? NULL : o->init, o->seed);
    if (st != FY_OK) return fy_error_wrap(st, "--init");
  } else if (random) {
    fy_model_init_random(r->model, o->seed);
  } else {
    st = fy_model_load(r->model, o->init);
    if (st != FY_OK) return fy_error_wrap(st, "--init");
  }
  if (!o->data && eval) return FY_OK;  // (fy_sample: no data set)
  st = fy_data_open(o->data, r->cfg.vocab_size, o->batch, o->seq, shuffle, o->seed, r->dp_rank, r->dp, &r->data);
  if (st != FY_OK) {
    if (st == FY_ERR_NOT_FOUND && strstr(o->data, "/data/demo"))  // (not made yet)
      return fy_error_wrap(st, "the demo data is made by ./run.sh (python3 tools/tokenize.py "
                               "--tokenizer bytes --out data/demo/corpus data/corpus.txt); --data");
    return fy_error_wrap(st, "--data");
  }
  if (o->val_data && !eval) {  // in order, each rank its rows: as ferry eval reads them
    st = fy_data_open(o->val_data, r->cfg.vocab_size, o->batch, o->seq, false, o->seed, r->dp_rank, r->dp, &r->val);
    if (st != FY_OK) return fy_error_wrap(st, "--val-data");
  }
  return FY_OK;
}

static void teardown(struct run *r) {
  if (r->lag_own && r->model && r->model->grads == r->lag_own) {  // the model frees its own
    r->model->grads = r->lag_grads;
    r->lag_grads = r->lag_own;
  }
  free(r->lag_own);
  fy_data_close(r->data);
  fy_data_close(r->val);
  fy_offload_free(r->x);  // before the communicators it duplicated
  fy_comm_free(r->dp_blocks);
#if FY_HAVE_CUDA
  if (r->model && r->model->kernels_ctx) fy_engine_cuda_detach(r->model);
#endif
  fy_model_free(r->model);
  if (r->disk) fy_disk_tier_close(r->disk);
  if (r->host) fy_host_tier_free(r->host);
  fy_device_free(r->dev);
  fy_graph_free(r->whole_graph);
  fy_comm_free(r->tp_compute);
  fy_comm_free(r->dp_compute);
  fy_comm_free(r->tp_comm);
  if (r->dp_comm != r->comm) fy_comm_free(r->dp_comm);
  fy_comm_free(r->comm);
}

// FNV-1a of the weights, parameter by parameter in the flat layout's order (first use, whatever
// the chunk size, so that runs with different chunk layouts compare), fed piece by piece (the same
// value whether the weights are whole or come chunk by chunk).
struct weights_hash {
  uint64_t h;
  const struct fy_graph *g;
  int *order;  // parameters by offset
  int next;
};

// The parameters' indices by offset (malloc'd; NULL when it cannot be).
static int *param_order(const struct fy_graph *g) {
  int *order = malloc((size_t)(g->n_params > 0 ? g->n_params : 1) * sizeof *order);
  for (int i = 0; order && i < g->n_params; i++) {  // insertion sort: a few hundred parameters, mostly in order
    int k = i;
    for (; k > 0 && g->params[order[k - 1]].offset > g->params[i].offset; k--) order[k] = order[k - 1];
    order[k] = i;
  }
  return order;
}

static fy_status weights_hash_init(struct weights_hash *wh, const struct fy_graph *g) {
  *wh = (struct weights_hash){.h = 0xcbf29ce484222325ull, .g = g};
  if (!(wh->order = param_order(g))) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the weights' hash");
  return FY_OK;
}

// The parameters that start in [lo, hi) of the flat buffer (data holds those elements): whole in it.
static void weights_hash_piece(struct weights_hash *wh, int64_t lo, int64_t hi, const float *data) {
  for (; wh->next < wh->g->n_params; wh->next++) {
    const struct fy_param *p = &wh->g->params[wh->order[wh->next]];
    if (p->offset >= hi) break;
    FY_ASSERT(p->offset >= lo && p->offset + p->numel <= hi);
    const uint8_t *b = (const uint8_t *)(data + (p->offset - lo));
    for (size_t k = 0; k < (size_t)p->numel * 4; k++) wh->h = (wh->h ^ b[k]) * 0x100000001b3ull;
  }
}

static uint64_t hash_params(struct fy_model *m) {
  struct weights_hash wh;
  float *host = m->params;
  size_t bytes = (size_t)m->graph->n_param_elems * 4;
  if (weights_hash_init(&wh, m->graph) != FY_OK) return 0;
  if (fy_model_params_on_device(m) && (!(host = malloc(bytes)) || fy_model_download(m, host, m->params, bytes) != FY_OK)) {
    free(host);
    free(wh.order);
    return 0;
  }
  weights_hash_piece(&wh, 0, m->graph->n_param_elems, host);
  if (host != m->params) free(host);
  free(wh.order);
  return wh.h;
}

// The end of a run with chunks sharded across ranks: the weights come together chunk by chunk on
// the lead rank, which hashes them (hash: not NULL) and (save: a directory) writes each chunk as it
// comes, so that no rank holds the whole model. A collective; the other ranks only take part.
static fy_status finish_sharded(struct run *r, const char *save, bool lead, uint64_t *hash) {
  struct fy_model *m = r->model;
  const int64_t ce = m->layout->chunk_elems, n = m->graph->n_param_elems;
  struct weights_hash wh = {0};
  struct fy_st_writer *w = NULL;
  float *buf = NULL;
  fy_status st = fy_offload_sync(r->x);
  if (st == FY_OK && lead) {
    if (hash) st = weights_hash_init(&wh, m->graph);
    if (st == FY_OK && !(buf = malloc((size_t)ce * 4))) st = fy_error_set(FY_ERR_NOMEM, "cannot allocate a chunk");
    if (st == FY_OK && save) st = fy_model_save_open(m, save, (size_t)5 << 30, &w);
  }
  // Every chunk, even after an error here: the other ranks gather each of them too.
  for (int c = 0; c < m->layout->n_chunks; c++) {
    fy_status g = fy_offload_chunk_weights_out(r->x, c, st == FY_OK ? buf : NULL);
    if (st == FY_OK) st = g;
    if (st != FY_OK || !lead) continue;
    int64_t lo = c * ce, hi = lo + ce < n ? lo + ce : n;
    if (hash) weights_hash_piece(&wh, lo, hi, buf);
    if (w) st = fy_model_save_put(m, w, lo, hi, buf);
  }
  if (w && st == FY_OK) st = fy_model_save_commit(m, save, w);
  else fy_st_writer_abort(w);
  if (st == FY_OK && lead && hash) *hash = wh.h;
  free(buf);
  free(wh.order);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "gathering the weights at the end of training");
}

// The whole model's state from the tensor-parallel slices, one parameter at a time in the whole
// layout's order, for checkpoints and the final save: no rank holds the whole model. The ranks of
// a tensor-parallel group walk the same parameters (each split one is a gather, a collective); the
// lead keeps what they give.
struct tp_walk {
  struct run *r;
  int kinds;                 // 1: the weights; 3: weights, m and v
  const float *local[3];     // this rank's slices, in its own layout (resident)
  int chunk;                 // offloaded (local NULL): the chunk of this rank's layout in cbuf (-1: none)
  float *cbuf;               // its weights, m and v (chunk_elems floats each)
  int *order;                // the whole model's parameters by offset
  int next;                  // order[next]: the first parameter not yet handed out whole
  int held;                  // the split parameter in whole[] (-1: none)
  float *whole[3], *buf;     // whole[]: the lead's copy of one parameter; buf: the gathered slices
};

static void tp_walk_free(struct tp_walk *t) {
  for (int k = 0; k < 3; k++) free(t->whole[k]);
  free(t->buf);
  free(t->cbuf);
  free(t->order);
  memset(t, 0, sizeof *t);
}

// A collective over the tensor-parallel group: every rank of it gets the buffers or none does.
// local NULL: the slices come chunk by chunk from the offloaded state (fy_offload_chunk_state_out,
// in order: parameters have the same order in every layout; a collective over the data-parallel
// group with sharding, whose other ranks call fy_offload_state_out).
static fy_status tp_walk_init(struct tp_walk *t, struct run *r, int kinds, float *const local[3], bool lead) {
  *t = (struct tp_walk){.r = r, .kinds = kinds, .held = -1, .chunk = -1};
  const struct fy_graph *g = r->whole_graph;
  int64_t most = 1;  // the largest split parameter, whole
  for (int i = 0; i < g->n_params; i++)
    if (r->model->graph->params[i].split_dim >= 0 && g->params[i].numel > most) most = g->params[i].numel;
  int64_t gathered = fy_tp_gather_floats(r->model->graph);
  bool ok = (t->order = param_order(g)) && (t->buf = malloc((size_t)(gathered > 0 ? gathered : 1) * 4));
  if (ok && !local) ok = (t->cbuf = malloc((size_t)r->model->layout->chunk_elems * 3 * 4)) != NULL;
  for (int k = 0; k < kinds; k++) {
    t->local[k] = local ? local[k] : NULL;
    if (lead && ok) ok = (t->whole[k] = malloc((size_t)most * 4)) != NULL;
  }
  float failed = ok ? 0.0f : 1.0f;
  fy_status st = fy_comm_all_reduce(r->tp_comm, &failed, 1, FY_COMM_F32, NULL);
  char size[32];
  if (st == FY_OK && failed > 0)
    st = fy_error_set(FY_ERR_NOMEM, "cannot allocate the buffers to gather the tensor-parallel slices (%s on the "
                      "lead rank)", fy_format_bytes(((double)gathered + (double)kinds * most) * 4, size, sizeof size));
  if (st != FY_OK) tp_walk_free(t);
  return st;
}

// The whole of parameter i: the lead's buffers after gathering a split one, else this rank's copy
// (valid until the next call).
static fy_status tp_walk_param(struct tp_walk *t, int i, const float *out[3]) {
  const struct fy_graph *part = t->r->model->graph;
  const struct fy_param *p = &part->params[i];
  fy_status st = FY_OK;
  const float *slice[3];
  if (t->cbuf) {  // offloaded: the chunk that holds it (each chunk once, in order: the walk's order)
    const int64_t ce = t->r->model->layout->chunk_elems;
    const int c = (int)(p->offset / ce);
    FY_ASSERT(c >= t->chunk && p->offset + p->numel <= (int64_t)(c + 1) * ce);
    for (; t->chunk < c; t->chunk++) {  // (a chunk no parameter of the walk starts in is still gathered)
      fy_status s1 = t->kinds > 1 ? fy_offload_chunk_state_out(t->r->x, t->chunk + 1, t->cbuf, t->cbuf + ce, t->cbuf + 2 * ce)
                                  : fy_offload_chunk_weights_out(t->r->x, t->chunk + 1, t->cbuf);
      if (st == FY_OK) st = s1;
    }
    for (int k = 0; k < t->kinds; k++) slice[k] = t->cbuf + k * ce + (p->offset - (int64_t)c * ce);
  } else {
    for (int k = 0; k < t->kinds; k++) slice[k] = t->local[k] + p->offset;
  }
  for (int k = 0; k < t->kinds; k++) {
    out[k] = p->split_dim < 0 ? slice[k] : t->whole[k];
    if (p->split_dim < 0 || t->held == i) continue;
    fy_status s1 = fy_tp_gather_param(part, slice[k], t->r->whole_graph, i, t->whole[k], t->buf, t->r->tp_comm);
    if (st == FY_OK) st = s1;  // (the other kinds' gathers still run: the group's ranks call them all)
  }
  if (p->split_dim >= 0) t->held = st == FY_OK ? i : -1;
  return st;
}

// A piece of the whole state for the checkpoint writer (fy_ckpt_fill_fn): elements [lo, hi) of the
// whole layout's weights, m and v; NULL buffers on the ranks that only take part.
static fy_status tp_walk_fill(void *ctx, int64_t lo, int64_t hi, float *params, float *m, float *v) {
  struct tp_walk *t = ctx;
  const struct fy_graph *g = t->r->whole_graph;
  float *dst[3] = {params, m, v};
  fy_status st = FY_OK;
  for (int k = t->next; k < g->n_params; k++) {
    const struct fy_param *q = &g->params[t->order[k]];
    int64_t a, b;
    if (q->offset >= hi) break;
    if (!fy_param_part(q, lo, hi, &a, &b)) continue;
    const float *whole[3];
    fy_status s1 = tp_walk_param(t, t->order[k], whole);
    if (st == FY_OK) st = s1;
    for (int j = 0; st == FY_OK && j < t->kinds; j++)
      if (dst[j]) memcpy(dst[j] + (q->offset + a - lo), whole[j] + a, (size_t)(b - a) * 4);
    if (q->offset + q->numel <= hi) t->next = k + 1;
  }
  return st;
}

// The end of a tensor-parallel run: the weights come together parameter by parameter on the lead,
// which hashes them and (save: a directory) writes each as it comes. Every rank of the
// tensor-parallel group of data-parallel rank 0 takes part; the others (replicas) do nothing, or
// with sharded chunks take part in their data-parallel group's gathers. Offloaded, the slices come
// chunk by chunk (no rank holds its slices whole).
static fy_status finish_tp(struct run *r, const char *save, bool lead, uint64_t *hash) {
  if (r->x) FY_TRY(fy_offload_sync(r->x));
  if (r->dp_rank != 0) {
    for (int c = 0; r->x && r->dp > 1 && c < r->model->layout->n_chunks; c++)
      FY_TRY(fy_offload_chunk_weights_out(r->x, c, NULL));
    return FY_OK;
  }
  const struct fy_graph *g = r->whole_graph;
  struct tp_walk t;
  float *local[3] = {r->model->params, NULL, NULL};
  FY_TRY(tp_walk_init(&t, r, 1, r->x ? NULL : local, lead));
  struct weights_hash wh = {0};
  struct fy_st_writer *w = NULL;
  fy_status st = lead && hash ? weights_hash_init(&wh, g) : FY_OK;
  if (st == FY_OK && lead && save) st = fy_model_save_open(&r->whole, save, (size_t)5 << 30, &w);
  for (int k = 0; k < g->n_params; k++) {  // every parameter, even after an error here: the gathers are collectives
    const struct fy_param *q = &g->params[t.order[k]];
    const float *whole[3];
    fy_status s1 = tp_walk_param(&t, t.order[k], whole);
    if (st == FY_OK) st = s1;
    if (st != FY_OK || !lead) continue;
    if (hash) weights_hash_piece(&wh, q->offset, q->offset + q->numel, whole[0]);
    if (w) st = fy_model_save_put(&r->whole, w, q->offset, q->offset + q->numel, whole[0]);
  }
  if (w && st == FY_OK) st = fy_model_save_commit(&r->whole, save, w);
  else fy_st_writer_abort(w);
  if (st == FY_OK && lead && hash) *hash = wh.h;
  free(wh.order);
  tp_walk_free(&t);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "gathering the weights at the end of training");
}

static void format_duration(char *buf, size_t n, double s) {
  if (s < 60) snprintf(buf, n, "%.0fs", s);
  else if (s < 3600) snprintf(buf, n, "%dm%02ds", (int)s / 60, (int)s % 60);
  else snprintf(buf, n, "%dh%02dm", (int)s / 3600, ((int)s % 3600) / 60);
}

// v as a JSON number in fmt, or null when it is not finite.
static void json_number(char buf[32], double v, const char *fmt) {
  if (isfinite(v)) snprintf(buf, 32, fmt, v);
  else snprintf(buf, 32, "null");
}

static void progress_bar(int64_t done, int64_t total, double eta_s) {
  char eta[32];
  format_duration(eta, sizeof eta, eta_s);
  int width = 30, fill = (int)(width * done / (total ? total : 1));
  printf("[");
  for (int i = 0; i < width; i++) putchar(i < fill ? '#' : '.');
  printf("] %lld/%lld  eta %s", (long long)done, (long long)total, eta);
  fflush(stdout);
}

// The targets that count in this step (the data's loss masks leave some out), over every
// data-parallel rank: counts[k] those of micro-batch k, *total their sum, from the masks before
// any batch is read. The loss is the mean over the total, so a step's loss and gradient are those
// of one batch of the whole step, however it is split into micro-batches and ranks.
static fy_status step_targets(const struct fy_train_opts *o, struct run *r, int64_t *counts, int64_t *total) {
  const int64_t K = o->grad_accum;
  for (int64_t k = 0; k < K; k++) counts[k] = fy_data_count_targets(r->data, k);
  if (r->dp > 1) {  // exact counts (a float's 24 bits are not enough for every run): int64 as 2 words
    int64_t all[r->dp * K];
    FY_TRY(fy_comm_all_gather(r->dp_comm, counts, all, (size_t)(2 * K), FY_COMM_F32, NULL));
    for (int64_t k = 0; k < K; k++) {
      counts[k] = 0;
      for (int i = 0; i < r->dp; i++) counts[k] += all[i * K + k];
    }
  }
  *total = 0;
  for (int64_t k = 0; k < K; k++) *total += counts[k];
  return FY_OK;
}

// A step whose every target is ignored: its micro-batches are passed over (the data stream moves
// on as if they were trained) and nothing is updated.
static fy_status skip_step(const struct fy_train_opts *o, struct run *r) {
  FY_TRY(fy_data_seek(r->data, fy_data_position(r->data) + o->grad_accum));
  return FY_ERR_NOT_FOUND;
}

// --optimizer-lag on the cpu: the update still pending (the gradients in lag_grads, with their
// step's arguments), as the exact step would have applied it.
static fy_status apply_lagged(const struct fy_train_opts *o, struct run *r) {
  if (!r->lag.pending) return FY_OK;
  r->lag.pending = false;
  if (r->lag.skip) return FY_OK;
  struct fy_model *m = r->model;
  float *g = m->grads;
  m->grads = r->lag_grads;
  fy_status st = fy_optimizer_step(m, &o->adamw, r->lag.lr, r->lag.t, r->lag.grad_scale, r->lag.norm);
  m->grads = g;
  return st;
}

// --optimizer-lag: the update still pending applied, so that the weights are those after every
// step so far (before a checkpoint, a validation that ends the run, the end); the next step starts
// the lag again. Without the lag, offloaded: the engine's streams synced.
static fy_status drain_updates(const struct fy_train_opts *o, struct run *r) {
  if (r->x) return fy_offload_drain(r->x);
  return apply_lagged(o, r);
}

// One optimizer step on resident parameters: micro-batches, their sum, norm, AdamW.
static fy_status step_resident(const struct fy_train_opts *o, struct run *r, int64_t step, double scale,
                               double *loss_out, double *norm_out, bool *overflow, double *t_sum, double *t_opt) {
  struct fy_model *model = r->model;
  int64_t counts[o->grad_accum], total = 0, n_with_grads = 0;
  FY_TRY(step_targets(o, r, counts, &total));
  if (total == 0) return skip_step(o, r);
  double loss_sum = 0;
  for (int64_t micro = 0; micro < o->grad_accum; micro++) {
    struct fy_batch *batch;
    struct fy_loss loss;
    FY_TRY(fy_data_next(r->data, &batch));
    if (counts[micro] == 0) continue;  // every target of this micro-batch ignored: no gradient from it
    FY_TRY(fy_engine_forward(model, batch, &loss));
    // Every data-parallel rank's part of the micro-batch (tensor-parallel ranks share their
    // sequences: the sum runs over the data-parallel group), so that all see a non-finite loss.
    float global = (float)loss.sum;
    if (r->dp > 1) FY_TRY(fy_comm_all_reduce(r->dp_comm, &global, 1, FY_COMM_F32, NULL));
    const double sum = r->dp > 1 ? global : loss.sum;
    if (!isfinite(sum)) return fy_error_set(FY_ERR_NUMERIC, "the loss is %f", sum / (double)counts[micro]);
    loss_sum += sum;
    FY_TRY(fy_engine_backward(model, batch, (float)(scale / (double)total)));
    // Micro-batches' gradients are summed apart from the backward pass (which overwrites), in
    // the same order and with the same adds on every placement.
    if (o->grad_accum > 1) {
      double tz = fy_now();
      model->kernels->grads_sum(model, n_with_grads == 0);
      *t_sum += fy_now() - tz;
    }
    n_with_grads++;
  }
  *loss_out = loss_sum / (double)total;
  if (o->grad_accum > 1) {  // the optimizer reads m->grads: the fp32 sum
    float *t = model->grads;
    model->grads = model->grad_acc;
    model->grad_acc = t;
  }
  model->grads_f32 = o->grad_accum > 1;
  // Data parallelism: the gradients summed across ranks (in rank order, the same bits on every
  // rank), so every rank applies the same update to its replica; on GPUs by NCCL, in the dtype the
  // optimizer reads them in.
  if (r->dp > 1) FY_TRY(fy_engine_all_reduce_grads(model));
  double t0 = fy_now();
  float unscale = (float)(1.0 / scale);  // exact: the scale is a power of two
  *norm_out = fy_optimizer_grad_norm(model, unscale);
  // A sum on the GPUs' stream that failed (a lost peer: NCCL's error is asynchronous, and aborting
  // the communicator lets the stream go on) is on the communicator once the norm has waited for
  // the stream: no update from gradients that were never summed.
  if (r->dp > 1) {
    fy_status st = fy_comm_status(model->dp_comm);
    if (st != FY_OK) return fy_error_wrap(st, "summing the replicas' gradients");
  }
  *overflow = !isfinite(*norm_out);
  fy_status st = FY_OK;
  if (r->lag_own) {  // the step before's update now, this one's after the next step's passes
    st = apply_lagged(o, r);
    float *t = model->grads;
    model->grads = r->lag_grads;
    r->lag_grads = t;
    r->lag = (struct lagged_update){.pending = true, .skip = *overflow, .lr = fy_lr_at(o, step), .grad_scale = unscale,
                                    .t = r->updates + 1, .norm = *norm_out};
    if (!*overflow) r->updates++;
  } else if (!*overflow &&
             (st = fy_optimizer_step(model, &o->adamw, fy_lr_at(o, step), r->updates + 1, unscale, *norm_out)) == FY_OK) {
    r->updates++;
  }
  *t_opt += fy_now() - t0;
  return st;
}

// The same step with the model state offloaded: enqueue, then wait for the norm only.
static fy_status step_offload(const struct fy_train_opts *o, struct run *r, int64_t step, double scale,
                              double *loss_out, double *norm_out, bool *overflow) {
  double sums[o->grad_accum];
  int64_t counts[o->grad_accum], total = 0;
  int n = 0;
  FY_TRY(step_targets(o, r, counts, &total));
  if (total == 0) return skip_step(o, r);
  for (int64_t micro = 0; micro < o->grad_accum; micro++) {
    struct fy_batch *batch;
    FY_TRY(fy_data_next(r->data, &batch));
    if (counts[micro] == 0) continue;  // every target of this micro-batch ignored: no gradient from it
    FY_TRY(fy_offload_micro(r->x, batch, n, (float)(scale / (double)total)));
    n++;
  }
  FY_TRY(fy_offload_update(r->x, &o->adamw, fy_lr_at(o, step), r->updates + 1, (float)(1.0 / scale), norm_out, sums,
                           overflow));
  if (!*overflow) r->updates++;
  if (r->dp > 1) {
    float tally[o->grad_accum];
    for (int i = 0; i < n; i++) tally[i] = (float)sums[i];
    FY_TRY(fy_comm_all_reduce(r->dp_comm, tally, (size_t)n, FY_COMM_F32, NULL));
    for (int i = 0; i < n; i++) sums[i] = tally[i];
  }
  double loss_sum = 0;
  for (int i = 0; i < n; i++) loss_sum += sums[i];
  *loss_out = loss_sum / (double)total;
  if (!isfinite(*loss_out)) return fy_error_set(FY_ERR_NUMERIC, "the loss is %f", *loss_out);
  return FY_OK;
}

// The mean token loss over the first n batches of `data` (from its start: each evaluation reads
// the same ones), forward passes alone and without dropout, over every data-parallel rank's rows:
// their sums added in rank order (doubles travel as pairs of words). `first`, when not NULL, is
// called with the first batch after its forward (ferry eval --dump).
static fy_status mean_loss(struct run *r, fy_data *data, int64_t n, double *mean,
                           fy_status (*first)(struct run *r, const struct fy_batch *b, void *ctx), void *ctx) {
  double sum = 0;
  int64_t count = 0;
  FY_TRY(fy_data_seek(data, 0));
  for (int64_t i = 0; i < n; i++) {
    struct fy_batch *batch;
    struct fy_loss loss = {0};
    FY_TRY(fy_data_next(data, &batch));
    if (r->x) {
      FY_TRY(fy_offload_forward(r->x, batch, &loss.sum));
      loss.count = fy_engine_count_targets(batch);
    } else {
      FY_TRY(fy_engine_forward_eval(r->model, batch, &loss));
    }
    sum += loss.sum;
    count += loss.count;
    if (i == 0 && first) FY_TRY(first(r, batch, ctx));
  }
  if (r->dp > 1) {
    double mine[2] = {sum, (double)count}, all[2 * r->dp];
    FY_TRY(fy_comm_all_gather(r->dp_comm, mine, all, 4, FY_COMM_F32, NULL));
    sum = count = 0;
    for (int k = 0; k < r->dp; k++) sum += all[2 * k], count += (int64_t)all[2 * k + 1];
  }
  *mean = count ? sum / (double)count : NAN;
  return FY_OK;
}

// After a non-finite loss: runs the batch's forward again op by op and names the first op whose
// output is not finite (resident parameters only).
static void name_nonfinite(struct run *r) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", fy_error_msg());
  fy_data_seek(r->data, fy_data_position(r->data) - 1);
  struct fy_batch *batch;
  struct fy_loss loss;
  if (fy_data_next(r->data, &batch) != FY_OK) return;
  int op = -1;
  if (fy_engine_find_nonfinite(r->model, batch, &op) == FY_OK && op >= 0) {
    const struct fy_op *p = &r->model->graph->ops[op];
    fy_error_set(FY_ERR_NUMERIC, "%s; the first non-finite value is in the output of %s (%s)", msg, p->name,
                 fy_op_kind_name(p->kind));
  } else {
    fy_error_set(FY_ERR_NUMERIC, "%s", msg);
  }
  (void)loss;
}

// The run's options as JSON, kept in each checkpoint for whoever reads it later (a model path too
// long for buf is left out rather than cut).
static void options_json(const struct fy_train_opts *o, const char *model, double dropout, char *buf, size_t n) {
  char lr[32], drop[32];  // (as the user wrote them: lr is a float, whose double has noise digits)
  snprintf(lr, sizeof lr, "%g", (double)o->lr);
  snprintf(drop, sizeof drop, "%g", dropout);
  json_object *j = json_object_new_object();
  json_object_object_add(j, "model", json_object_new_string(model));
  json_object_object_add(j, "batch", json_object_new_int64(o->batch));
  json_object_object_add(j, "seq", json_object_new_int64(o->seq));
  json_object_object_add(j, "grad_accum", json_object_new_int64(o->grad_accum));
  json_object_object_add(j, "steps", json_object_new_int64(o->steps));
  json_object_object_add(j, "lr", json_object_new_double_s(o->lr, lr));
  json_object_object_add(j, "device", json_object_new_string(o->device ? o->device : "cpu"));
  json_object_object_add(j, "recompute", json_object_new_boolean(o->recompute));
  json_object_object_add(j, "precision", json_object_new_string(o->precision ? o->precision : "fp32"));
  json_object_object_add(j, "dropout", json_object_new_double_s(dropout, drop));
  json_object_object_add(j, "optimizer_state", json_object_new_string(fy_state_format_name(state_format(o))));
  json_object_object_add(j, "seed", json_object_new_uint64(o->seed));
  json_object_object_add(j, "schedule", json_object_new_string(o->schedule ? o->schedule : "cosine"));
  const char *text = json_object_to_json_string_ext(j, JSON_C_TO_STRING_PLAIN);
  if (strlen(text) >= n) {
    json_object_object_del(j, "model");
    text = json_object_to_json_string_ext(j, JSON_C_TO_STRING_PLAIN);
  }
  snprintf(buf, n, "%s", strlen(text) < n ? text : "{}");
  json_object_put(j);
}

static void checkpoint_meta(const struct fy_train_opts *o, struct run *r, struct fy_ckpt_meta *meta,
                            int64_t steps_done, double scale, int64_t scale_good) {
  // Sequences of the whole stream (all ranks), so that a run resumes under another rank count.
  *meta = (struct fy_ckpt_meta){.step = steps_done, .sequences = fy_data_position(r->data) * o->batch * r->dp,
                                .seed = o->seed, .loss_scale = scale, .loss_scale_good = scale_good,
                                .updates = r->updates};
  snprintf(meta->optimizer_state, sizeof meta->optimizer_state, "%s", fy_state_format_name(r->model->state_format));
  // (the model's name: --model's, else its config's, so that a run resumed without --model names it)
  options_json(o, o->model ? o->model : r->cfg.name, r->cfg.train_dropout, meta->options, sizeof meta->options);
}

// Tensor parallelism: the ranks of data-parallel group 0 gather their slices parameter by
// parameter while rank 0 writes them (tp_walk: no rank holds the whole model; training waits).
// Offloaded, they take their slices chunk by chunk from wherever the state lives (with sharding,
// gathered over their data-parallel groups, whose other ranks only take part).
#define TP_CKPT_PIECE ((int64_t)1 << 22)  // elements the writer takes at a time (offloaded: a chunk's)

static fy_status checkpoint_tp(struct run *r, struct fy_ckpt_writer *w, const struct fy_train_opts *o,
                               int64_t steps_done, double scale, int64_t scale_good) {
  struct fy_model *m = r->model;
  float *local[3] = {m->params, m->m, m->v};
  if (r->x) FY_TRY(fy_offload_sync(r->x));
  if (r->dp_rank != 0) return r->x ? fy_offload_state_out(r->x, NULL, NULL, NULL) : FY_OK;
  struct tp_walk t;
  fy_status st = tp_walk_init(&t, r, 3, r->x ? NULL : local, w != NULL);
  if (st != FY_OK) return st;
  const int64_t piece = r->x ? r->model->layout->chunk_elems : TP_CKPT_PIECE;
  if (w) {
    struct fy_ckpt_meta meta;
    checkpoint_meta(o, r, &meta, steps_done, scale, scale_good);
    st = fy_ckpt_write_pieces(w, &meta, piece, tp_walk_fill, &t);
  } else {  // the writer's pieces, taking part in their gathers
    st = fy_ckpt_fill_without(r->whole_graph->n_param_elems, piece, tp_walk_fill, &t);
  }
  tp_walk_free(&t);
  return st;
}

// A piece of the checkpoint written chunk by chunk: chunk lo / chunk_elems of the offloaded state.
static fy_status checkpoint_chunk(void *ctx, int64_t lo, int64_t hi, float *params, float *m, float *v) {
  (void)hi;
  struct run *r = ctx;
  return fy_offload_chunk_state_out(r->x, (int)(lo / r->model->layout->chunk_elems), params, m, v);
}

// Copies the training state after `steps_done` steps into the writer's buffers and starts the
// write in the background; or, when no snapshot fits, writes it chunk by chunk while training waits.
static fy_status checkpoint(const struct fy_train_opts *o, struct run *r, struct fy_ckpt_writer *w,
                            int64_t steps_done, double scale, int64_t scale_good) {
  struct fy_model *m = r->model;
  FY_TRY(drain_updates(o, r));  // (--optimizer-lag: a checkpoint holds every update so far)
  // With chunks sharded across ranks, or tensor-parallel slices, every rank takes part in
  // gathering the state; only the writer (rank 0, w != NULL) keeps it.
  if (r->tp > 1) return checkpoint_tp(r, w, o, steps_done, scale, scale_good);
  struct fy_ckpt_snapshot *s = w && !r->ckpt_by_chunk ? fy_ckpt_snapshot_buffers(w) : NULL;
  if (w && !r->ckpt_by_chunk && !s) return fy_error_wrap(FY_ERR_NOMEM, "checkpoint");
  if (!w) return r->x ? fy_offload_state_out(r->x, NULL, NULL, NULL) : FY_OK;
  size_t bytes = (size_t)m->graph->n_param_elems * 4;
  if (r->ckpt_by_chunk) {  // (the other ranks' fy_offload_state_out gathers the same chunks in order)
    FY_TRY(fy_offload_sync(r->x));
    struct fy_ckpt_meta meta;
    checkpoint_meta(o, r, &meta, steps_done, scale, scale_good);
    return fy_ckpt_write_pieces(w, &meta, m->layout->chunk_elems, checkpoint_chunk, r);
  }
  if (r->x) {
    FY_TRY(fy_offload_state_out(r->x, s->params, s->m, s->v));  // after the optimizer stream is done
  } else if (fy_model_params_on_device(m)) {  // a GPU's state comes down to the snapshot
    FY_TRY(fy_model_download(m, s->m, m->m, bytes));
    FY_TRY(fy_model_download(m, s->v, m->v, bytes));
    FY_TRY(fy_model_download(m, s->params, m->params, bytes));
  } else {  // (compressed state: the values it reads back as, checkpoint.h)
    fy_state_decode(m->state_format, FY_MOMENT_M, s->m, m->m, m->graph->n_param_elems);
    fy_state_decode(m->state_format, FY_MOMENT_V, s->v, m->v, m->graph->n_param_elems);
    memcpy(s->params, m->params, bytes);
  }
  checkpoint_meta(o, r, &s->meta, steps_done, scale, scale_good);
  return fy_ckpt_write_async(w);
}

// Offloaded: AdamW's state into the chunks one at a time, this rank's part of each (its shard with
// sharding), through a buffer of two chunks instead of the whole model's m and v. read gives
// elements [lo, hi) of the flat layout's m and v.
typedef void (*adam_read_fn)(void *ctx, int64_t lo, int64_t hi, float *m, float *v);

static fy_status adam_into_chunks(struct run *r, adam_read_fn read, void *ctx) {
  int64_t ce = r->model->layout->chunk_elems, lo, n;
  fy_offload_shard(r->x, &lo, &n);
  float *buf = malloc((size_t)ce * 2 * 4);
  fy_status st = buf ? FY_OK : fy_error_set(FY_ERR_NOMEM, "cannot allocate a chunk to read the AdamW state");
  for (int c = 0; st == FY_OK && c < r->model->layout->n_chunks; c++) {
    memset(buf, 0, (size_t)ce * 2 * 4);
    read(ctx, c * ce + lo, c * ce + lo + n, buf + lo, buf + ce + lo);
    st = fy_offload_adam_state(r->x, c, buf, buf + ce, true);
  }
  free(buf);
  return st;
}

static void ckpt_adam_read(void *ctx, int64_t lo, int64_t hi, float *m, float *v) { fy_ckpt_adam_read(ctx, lo, hi, m, v); }

static fy_status resume_adam_by_chunk(const char *path, struct run *r) {
  struct fy_ckpt_adam *a;
  FY_TRY(fy_ckpt_adam_open(path, r->model, &a));
  fy_status st = adam_into_chunks(r, ckpt_adam_read, a);
  fy_ckpt_adam_close(a);
  return st;
}

// This rank's weights and AdamW state from a checkpoint (one rank, replicas, or chunks sharded
// across ranks).
static fy_status resume_state(const char *path, struct run *r, struct fy_ckpt_meta *meta) {
  struct fy_model *m = r->model;
  if (r->x) {  // offloaded: the weights (this rank's shards alone, when sharded), then AdamW's state by chunk
    char dir[4096];
    if (m->params) {
      FY_TRY(fy_ckpt_load(path, m, NULL, NULL, meta));
    } else {
      FY_TRY(fy_ckpt_resolve(path, dir, sizeof dir));
      FY_TRY(fy_ckpt_index_read(dir, meta));
      FY_TRY(set_shards(r, dir, 0));
    }
    return resume_adam_by_chunk(path, r);
  }
  size_t bytes = (size_t)m->graph->n_param_elems * 4;
  // Read into host buffers, then up to the GPU, or (compressed state) stored in the run's format.
  const bool staged = fy_model_params_on_device(m) || m->state_format != FY_STATE_F32;
  float *mm = m->m, *vv = m->v;
  if (staged && (!(mm = calloc(1, bytes)) || !(vv = calloc(1, bytes)))) {
    free(mm);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate %.1f MiB to read the AdamW state", 2 * bytes / 1048576.0);
  }
  fy_status st = fy_ckpt_load(path, m, mm, vv, meta);
  if (st == FY_OK && m->state_format != FY_STATE_F32) {
    fy_state_encode(m->state_format, FY_MOMENT_M, m->m, mm, m->graph->n_param_elems);
    fy_state_encode(m->state_format, FY_MOMENT_V, m->v, vv, m->graph->n_param_elems);
  } else if (st == FY_OK && staged) {
    st = fy_model_upload(m, m->m, mm, bytes);
    if (st == FY_OK) st = fy_model_upload(m, m->v, vv, bytes);
  }
  if (staged) {
    free(mm);
    free(vv);
  }
  return st;
}

// A checkpoint's AdamW state as a source of whole tensors (fy_tp_read_fn): m (k 0) or v (k 1).
struct tp_adam_source { const struct fy_ckpt_adam *a; int k; };

static void tp_read_adam(void *ctx, int i, int64_t a, int64_t b, float *dst) {
  const struct tp_adam_source *s = ctx;
  fy_ckpt_adam_read_param(s->a, i, a, b, s->k ? NULL : dst, s->k ? dst : NULL);
}

// A checkpoint's AdamW state as pieces of this rank's flat layout (adam_read_fn): m and v of its
// slices (src: m's source, then v's).
struct tp_adam_fill { const struct fy_graph *part; struct tp_adam_source src[2]; };

static void tp_adam_fill_read(void *ctx, int64_t lo, int64_t hi, float *m, float *v) {
  struct tp_adam_fill *f = ctx;
  fy_tp_fill(f->part, lo, hi, tp_read_adam, &f->src[0], m);
  fy_tp_fill(f->part, lo, hi, tp_read_adam, &f->src[1], v);
}

// Tensor parallelism: this rank's slices of a checkpoint's weights and AdamW state, read tensor by
// tensor from its files (checkpoints hold whole tensors; no rank reads the whole model at once).
static fy_status resume_tp(const char *path, struct run *r, struct fy_ckpt_meta *meta) {
  struct fy_model *m = r->model;
  char dir[4096];
  FY_TRY(fy_ckpt_resolve(path, dir, sizeof dir));
  FY_TRY(fy_ckpt_index_read(dir, meta));
  FY_TRY(tp_take_weights(r, dir, 0));
  struct fy_ckpt_adam *a;
  FY_TRY(fy_ckpt_adam_open(dir, &r->whole, &a));
  struct tp_adam_fill f = {m->graph, {{.a = a, .k = 0}, {.a = a, .k = 1}}};
  fy_status st = FY_OK;
  if (r->x) {
    st = adam_into_chunks(r, tp_adam_fill_read, &f);
  } else {
    fy_tp_take(m->graph, m->m, r->whole_graph, tp_read_adam, &f.src[0]);
    fy_tp_take(m->graph, m->v, r->whole_graph, tp_read_adam, &f.src[1]);
  }
  fy_ckpt_adam_close(a);
  return st;
}

// Continues from a checkpoint: parameters, AdamW state, step and data position.
static fy_status resume(const struct fy_train_opts *o, struct run *r, int64_t *first_step, double *scale,
                        int64_t *scale_good) {
  struct fy_ckpt_meta meta;
  fy_status st = r->tp > 1 ? resume_tp(o->resume, r, &meta) : resume_state(o->resume, r, &meta);
  if (st != FY_OK) return fy_error_wrap(st, "--resume %s", o->resume);
  const char *fmt = fy_state_format_name(r->model->state_format);
  if (strcmp(meta.optimizer_state, fmt) != 0 && r->rank == 0)
    fy_log_warn("--resume %s: its AdamW state was stored as %s and this run stores it as %s (--optimizer-state): "
                "converted, so the run goes on from rounded m and v%s", o->resume, meta.optimizer_state, fmt,
                r->model->state_format == FY_STATE_F32 ? " (widening loses nothing more)" : "");
  int64_t global_batch = o->batch * r->dp;
  if (meta.sequences % global_batch != 0)
    return fy_error_set(FY_ERR_INVALID, "--resume %s: %lld sequences were consumed, not a whole number of "
                        "global batches of %lld (%lld per rank x %d ranks)", o->resume, (long long)meta.sequences,
                        (long long)global_batch, (long long)o->batch, r->dp);
  FY_TRY(fy_data_seek(r->data, meta.sequences / global_batch));
  *first_step = meta.step;
  *scale = o->loss_scale > 0 ? meta.loss_scale : 1.0;
  *scale_good = meta.loss_scale_good;
  r->updates = meta.updates;
  return FY_OK;
}

// Whether --save's file system can hold what the run will write there, said once at the start
// rather than found at a write hours later: with --save-every, checkpoints of the whole state (12
// bytes a parameter: weights, m, v), --keep of them kept and one more while it is written (those
// already in the root count); else the final weights (4 bytes a parameter). A warning, as space
// may be freed meanwhile: a write that does not fit stops the run, the checkpoints before it kept.
static void check_save_space(const struct fy_train_opts *o, double params, int64_t steps_left) {
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", o->save);
  double space = 0;
  while (fy_disk_space(dir, &space) != FY_OK) {  // (the nearest directory that exists)
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = '\0';
    else *slash = '\0';
    if (strcmp(dir, ".") == 0 || strcmp(dir, "/") == 0) {
      if (fy_disk_space(dir, &space) != FY_OK) return;
      break;
    }
  }
  int existing = 0;
  DIR *d = o->save_every > 0 ? opendir(o->save) : NULL;
  for (struct dirent *e; d && (e = readdir(d));) existing += strncmp(e->d_name, "step-", 5) == 0;
  if (d) closedir(d);
  const int64_t writes = o->save_every > 0 ? (steps_left + o->save_every - 1) / o->save_every : 1;
  int more = o->save_every > 0 ? (o->keep + 1 - existing > 1 ? o->keep + 1 - existing : 1) : 1;
  if (more > writes) more = (int)writes;
  if (more < 1) return;
  const double each = (o->save_every > 0 ? 12.0 : 4.0) * params, need = each * more;
  if (space >= need) return;
  char b[3][32];
  if (o->save_every > 0)
    fy_log_warn("--save %s: %d more checkpoint%s of %s (--keep %d, and one more while it is written) need %s, and its "
                "file system has %s free: the run will stop at the first write that does not fit; free some space "
                "or save elsewhere", o->save, more, more > 1 ? "s" : "", fy_format_bytes(each, b[0], sizeof b[0]),
                o->keep, fy_format_bytes(need, b[1], sizeof b[1]), fy_format_bytes(space, b[2], sizeof b[2]));
  else
    fy_log_warn("--save %s: the final weights need %s (fp32), and its file system has %s free: the run will stop "
                "at the end without them; free some space or save elsewhere", o->save,
                fy_format_bytes(need, b[0], sizeof b[0]), fy_format_bytes(space, b[1], sizeof b[1]));
}

static double dir_bytes(const char *root) {
  char dir[4096], cmd[4200];
  if (fy_ckpt_resolve(root, dir, sizeof dir) != FY_OK) return 0;
  double total = 0;
  const char *files[] = {"model.safetensors", "optimizer.safetensors", "config.json", "trainer.json"};
  for (int i = 0; i < 4; i++) {
    snprintf(cmd, sizeof cmd, "%s/%s", dir, files[i]);
    struct stat sb;
    if (stat(cmd, &sb) == 0) total += (double)sb.st_size;
  }
  return total;
}

// --plan: the plan's knobs replace the run's (a plan that cannot fit this machine is refused with
// the reason). An offloaded plan runs on the sim device, whose machine is the cached probe with
// this run's device memory and link, or with --device cuda on the GPU with --offload (the plan
// came from `ferry plan --device cuda`: this process cannot time a GPU, and the offload engine
// refuses a plan that does not fit when it sets up). A resident plan (ferry plan --device cuda
// for a model that fits the GPU whole) runs with --device cuda without --offload, its ranks
// replicas. With several ranks (comm), rank 0 alone reads or measures the machine (timing it while
// the others time it too would measure them all) and every rank plans from its figures: the same
// plan everywhere.
// seq_given: --seq was given (not the default), so a plan for other sequences says it overrides it.
static fy_status apply_plan(struct fy_train_opts *o, struct fy_comm *comm, bool seq_given) {
  const bool cuda = o->device && strcmp(o->device, "cuda") == 0, automatic = strcmp(o->plan, "auto") == 0;
  const int ranks = fy_comm_size(comm), rank = fy_comm_rank(comm);
  if (cuda && automatic && !FY_HAVE_CUDA)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--plan auto with --device cuda needs a ferry built with CUDA: write a "
                        "plan with ferry plan --device cuda%s --out FILE and train with --plan FILE",
                        ranks > 1 ? " --gpus N" : "");
  struct fy_opt_config cfg;
  FY_TRY(resolve_config(o, &cfg));
  cfg.train_dropout = train_dropout(o, &cfg);  // (the planner prices the graph that will run)
  struct fy_probe probe;
  size_t dev_mem = o->device_mem ? o->device_mem : (size_t)1 << 30;
  if (!cuda || automatic) {
    // The sim device: the cached probe with this run's device memory and link. A GPU (--plan
    // auto): the cached probe of a GPU, else this machine's measured (GPU 0's figures).
    char path[4096];
    fy_probe_default_path(path, sizeof path);
    const struct fy_probe_cache c = {.path = path, .device = cuda ? "cuda" : "sim", .disk_dir = o->disk_dir,
                                     .gpu = cuda, .write = true,  // (a cache: failing to write it is no error)
                                     .device_mem = (double)dev_mem, .link_gbps = o->sim_link_gbps};
    bool measured = false;
    fy_status st = rank == 0 ? fy_probe_cached(&c, &probe, &measured) : FY_OK;
    if (ranks > 1) {  // rank 0's figures (or that it has none) to every rank
      int32_t ok = st == FY_OK;
      FY_TRY(fy_comm_broadcast(comm, &ok, sizeof ok, 0, NULL));
      if (!ok)
        return rank == 0 ? st : fy_error_set(FY_ERR_INVALID, "--plan auto: rank 0 could not read or measure the machine");
      FY_TRY(fy_comm_broadcast(comm, &probe, sizeof probe, 0, NULL));
    }
    FY_TRY(st);
    if (rank == 0 && measured) fy_log_info("--plan auto: this machine measured for the planner (cached in %s)", path);
    char v[64];
    if (!cuda || o->device_mem) {
      snprintf(v, sizeof v, "%zu", dev_mem);
      FY_TRY(fy_probe_override(&probe, "device_mem", v));
    }
    if (o->host_mem) {
      snprintf(v, sizeof v, "%zu", o->host_mem);
      FY_TRY(fy_probe_override(&probe, "host_mem", v));
    }
    if (!cuda && o->sim_link_gbps > 0) {
      snprintf(v, sizeof v, "%g", o->sim_link_gbps);
      FY_TRY(fy_probe_override(&probe, "link_gbps", v));
    }
    // The ranks on this machine share its memory and its disk: each plans with its share, as it
    // runs with it (setup_offload), --host-mem being already one rank's.
    const int local = fy_comm_local_size(comm) > 1 ? fy_comm_local_size(comm) : 1;
    if (!o->host_mem) probe.host_mem = floor(probe.host_mem / local);
    probe.disk_space = floor(probe.disk_space / local);
    if (!o->disk_dir) {  // (a disk the cached probe timed is not this run's without --disk-dir)
      probe.disk_read_gbps = probe.disk_write_gbps = probe.disk_space = 0;
      probe.disk_dir[0] = '\0';
    }
  }
  struct fy_plan plan;
  if (automatic) {  // the global batch as if every rank were data-parallel, in this run's precision
    FY_TRY(fy_plan_search_state(&cfg, o->model ? o->model : cfg.name, o->batch * o->grad_accum * ranks, o->seq, ranks,
                                cuda && o->offload, o->precision, o->optimizer_lag, o->optimizer_state, &probe, &plan,
                                NULL));
  } else {
    FY_TRY(fy_plan_read(o->plan, &plan));
    if (plan.k.resident && !cuda)
      return fy_error_set(FY_ERR_INVALID, "--plan %s keeps the whole model on a GPU (resident): train it with "
                          "--device cuda", o->plan);
    if (plan.k.resident && o->offload)
      return fy_error_set(FY_ERR_INVALID, "--plan %s keeps the whole model on the GPU (resident), and --offload asks "
                          "for it offloaded: drop --offload, or write an offloaded plan (ferry plan --offload)", o->plan);
    if (plan.k.seq != o->seq && seq_given && fy_comm_launch_rank() == 0)  // (rank 0 speaks for all)
      fy_log_info("--plan %s is for sequences of %lld tokens, not %lld: the plan's are used", o->plan,
                  (long long)plan.k.seq, (long long)o->seq);
    if (o->batch_given && (plan.k.micro_batch != o->batch || plan.k.grad_accum != o->grad_accum) &&
        fy_comm_launch_rank() == 0)
      fy_log_info("--plan %s is for micro-batches of %lld sequences, %lld accumulated a step, not --batch %lld "
                  "--grad-accum %lld: the plan's are used", o->plan, (long long)plan.k.micro_batch,
                  (long long)plan.k.grad_accum, (long long)o->batch, (long long)o->grad_accum);
    if (plan.dp * plan.tp != ranks)  // (first: its memory and chunks are for that many)
      return fy_error_set(FY_ERR_INVALID, "--plan %s is for %d ranks (%d x %d); this run has %d", o->plan,
                          plan.dp * plan.tp, plan.dp, plan.tp, ranks);
    fy_status st = cuda ? fy_plan_validate(&cfg, &plan) : fy_plan_check(&cfg, &plan, &probe);
    if (st != FY_OK) return fy_error_wrap(st, "--plan %s cannot run here", o->plan);
    if (plan.dp > 1 && !plan.k.resident && strcmp(plan.pattern, "zero") != 0)
      return fy_error_set(FY_ERR_UNSUPPORTED, "--plan %s: the data-parallel ranks of an offloaded run shard the chunks "
                          "(pattern zero), not %s", o->plan, plan.pattern);
  }
  // The plan's precision is the run's; another given with --precision is refused, as its memory
  // and speed are another plan's. (A plan file written before plans said theirs is for the
  // device's default, and takes --precision as such files always did.)
  enum fy_dtype pdt = FY_F32;  // (a plan file's precision is checked when read)
  fy_precision_dtype(fy_cost_precision(&plan.k, cuda ? "cuda" : "sim"), &pdt);
  const char *prec = fy_precision_name(pdt);  // (static: not the local plan's)
  if (o->precision && strcmp(o->precision, prec) != 0 && plan.k.precision[0])
    return fy_error_set(FY_ERR_INVALID, "--plan %s is for %s compute, not --precision %s: drop --precision, or write a "
                        "plan for it (ferry plan --precision %s)", o->plan, prec, o->precision, o->precision);
  if (o->precision && strcmp(o->precision, prec) != 0 && fy_comm_launch_rank() == 0)
    fy_log_info("--plan %s says no precision (written before plans did): it was priced for %s compute, and runs in "
                "--precision %s", o->plan, prec, o->precision);
  if (!o->precision) o->precision = prec;
  o->tp = plan.tp;
  const struct fy_plan_knobs *k = &plan.k;
  if (cuda) {
    o->offload = !k->resident;  // (--device-mem stays the run's: the GPU's unless given)
  } else {
    o->device = "sim";
    o->device_mem = dev_mem;
  }
  o->batch = k->micro_batch;
  o->grad_accum = k->grad_accum;
  o->seq = k->seq;
  o->recompute = k->recompute;
  if (!k->resident) {  // (a resident run has no chunks)
    o->chunk_mib = k->chunk_elems * 4.0 / 1048576.0;
    o->blocks = k->blocks;
    o->prefetch = k->prefetch;
    o->disk_chunks = k->disk_chunks;
    o->device_chunks = k->device_chunks;
  }
  if (k->optimizer_lag && !o->optimizer_lag && fy_comm_launch_rank() == 0)
    fy_log_info("--plan %s is for the one-step-delayed update: training with --optimizer-lag %d", o->plan,
                k->optimizer_lag);
  if (k->optimizer_lag) o->optimizer_lag = k->optimizer_lag;
  // The plan's AdamW state format is the run's (its host and disk bytes are that format's).
  enum fy_state_format pf = FY_STATE_F32;
  if (k->optimizer_state[0]) fy_state_format_from_name(k->optimizer_state, &pf);  // (checked when read)
  if (o->optimizer_state && strcmp(o->optimizer_state, fy_state_format_name(pf)) != 0)
    return fy_error_set(FY_ERR_INVALID, "--plan %s is for AdamW state stored as %s, not --optimizer-state %s: drop "
                        "--optimizer-state, or write a plan for it (ferry plan --optimizer-state %s)", o->plan,
                        fy_state_format_name(pf), o->optimizer_state, o->optimizer_state);
  o->optimizer_state = fy_state_format_name(pf);
  if (o->quiet || fy_comm_launch_rank() != 0) return FY_OK;  // (rank 0 speaks for all)
  if (!cuda || automatic) {
    fy_plan_print(&plan, stdout);
  } else if (k->resident) {  // (not re-simulated here: the plan's own figures are those of ferry plan)
    printf("plan %s for the GPU: the whole model resident%s; micro-batch %lld x %lld tokens, %lld accumulated, "
           "recompute %s\n", o->plan, plan.dp > 1 ? " on every rank (replicas)" : "", (long long)k->micro_batch,
           (long long)k->seq, (long long)k->grad_accum, k->recompute ? "on" : "off");
  } else {
    printf("plan %s for the GPU: micro-batch %lld x %lld tokens, %lld accumulated; chunks of %.2f MiB, prefetch %d, "
           "recompute %s, the AdamW state of %d chunks on disk, %d on the GPU\n", o->plan, (long long)k->micro_batch,
           (long long)k->seq, (long long)k->grad_accum, o->chunk_mib, k->prefetch,
           k->recompute ? "on" : "off", k->disk_chunks > 0 ? k->disk_chunks : 0, k->device_chunks);
  }
  return FY_OK;
}

// --seq not given (0): FY_DEFAULT_SEQ tokens, or the model's positions when it has fewer.
static fy_status resolve_seq(struct fy_train_opts *o) {
  if (o->seq != 0) return FY_OK;
  struct fy_opt_config cfg;
  FY_TRY(resolve_config(o, &cfg));
  o->seq = cfg.max_position_embeddings < FY_DEFAULT_SEQ ? cfg.max_position_embeddings : FY_DEFAULT_SEQ;
  return FY_OK;
}

// The run's defaults that depend on its device (precision, fp16's loss scale), and the checks of
// its options.
static fy_status check_train_opts(struct fy_train_opts *e) {
  if (!e->precision) e->precision = fy_cost_default_precision(e->device);
  // fp16 overflows without loss scaling: dynamic scaling from 2^16 unless a scale was given.
  if (e->precision && strcmp(e->precision, "fp16") == 0 && !(e->loss_scale > 0)) e->loss_scale = 65536;
  if (e->steps < 0) return fy_error_set(FY_ERR_INVALID, "--steps must not be negative");
  if (e->grad_accum < 1) return fy_error_set(FY_ERR_INVALID, "--grad-accum must be at least 1");
  if (!(e->lr >= 0) || !isfinite(e->lr)) return fy_error_set(FY_ERR_INVALID, "--lr must be a number >= 0");
  const struct fy_adamw *h = &e->adamw;
  if (!(h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1 && h->eps > 0 && isfinite(h->eps) &&
        h->weight_decay >= 0 && isfinite(h->weight_decay)))
    return fy_error_set(FY_ERR_INVALID, "AdamW needs betas in [0, 1), eps > 0 and a weight decay >= 0 (got betas %g "
                        "and %g, eps %g, weight decay %g)", h->beta1, h->beta2, h->eps, h->weight_decay);
  if (e->save_every < 0) return fy_error_set(FY_ERR_INVALID, "--save-every must not be negative");
  if (e->save_every > 0 && !e->save) return fy_error_set(FY_ERR_INVALID, "--save-every needs --save DIR");
  if (e->val_every > 0 && !e->val_data) return fy_error_set(FY_ERR_INVALID, "--val-every needs --val-data PATH");
  if (!fy_lr_schedule_known(e->schedule))
    return fy_error_set(FY_ERR_INVALID, "--schedule %s: cosine, linear or constant", e->schedule);
  if (e->val_data && e->val_batches < 1) return fy_error_set(FY_ERR_INVALID, "--val-batches must be at least 1");
  if (e->optimizer_lag < 0 || e->optimizer_lag > 1)
    return fy_error_set(FY_ERR_INVALID, "--optimizer-lag %d: 0 (the exact step) or 1 (each update a step late)",
                        e->optimizer_lag);
  if (e->optimizer_lag > 0 && e->grad_accum > 1)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-lag 1 does not combine with --grad-accum %lld (each step's "
                        "gradients would need a second fp32 sum)", (long long)e->grad_accum);
  enum fy_state_format sf;
  if (e->optimizer_state && !fy_state_format_from_name(e->optimizer_state, &sf))
    return fy_error_set(FY_ERR_INVALID, "--optimizer-state %s: fp32, bf16 or 8bit", e->optimizer_state);
  const bool compressed = e->optimizer_state && sf != FY_STATE_F32;
  if (compressed && e->device && strcmp(e->device, "cuda") == 0 && !e->offload)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-state %s on a resident GPU run: the resident GPU keeps fp32 "
                        "AdamW state; train offloaded (--offload, where host, disk and device chunks keep it in %s) "
                        "or use --optimizer-state fp32", e->optimizer_state, e->optimizer_state);
  if (compressed && e->tp > 1)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-state %s with --tp %d: tensor-parallel slices keep fp32 AdamW "
                        "state (use --optimizer-state fp32)", e->optimizer_state, e->tp);
  if (e->optimizer_lag > 0 && e->device && strcmp(e->device, "cuda") == 0 && !e->offload)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--optimizer-lag 1 is for offloaded runs (--device cuda --offload, "
                        "--device sim) and the cpu: a resident GPU run updates on the GPU, where the lag hides nothing");
  return FY_OK;
}

fy_status fy_train(const struct fy_train_opts *given, struct fy_train_result *res) {
  memset(res, 0, sizeof *res);
  struct fy_train_opts eff = *given;
  const struct fy_train_opts *o = &eff;
  char init_dir[4096];
  FY_TRY(resolve_init(&eff.init, init_dir, sizeof init_dir));
  FY_TRY(resolve_seq(&eff));
  // The communicator first: a plan's machine is rank 0's (apply_plan). The run owns it from setup
  // on; until then every return frees it.
  struct fy_comm *comm = NULL;
  FY_TRY(make_comm(o, &comm));
  fy_status st = given->plan ? apply_plan(&eff, comm, given->seq != 0) : FY_OK;
  if (st == FY_OK) st = check_train_opts(&eff);
  if (st != FY_OK) {
    fy_comm_free(comm);
    return st;
  }
  struct run r;
  FILE *log = NULL;
  double *step_times = NULL;
  struct fy_ckpt_writer *ckpt = NULL;
  bool *ckpt_busy = NULL;
  int64_t first_step = 0, scale_good = 0;
  double scale = 1.0;
  st = setup(o, &r, o->shuffle, false, comm);
  const struct fy_opt_config *cfg = &r.cfg;  // (said once, by the rank that speaks)
  if (st == FY_OK && r.rank == 0) {
    // transformers' OPT drops the residual branches with `dropout` (which --dropout applies), the
    // attention probabilities with `attention_dropout` and whole layers with `layerdrop` (which
    // ferry does not; `activation_dropout` OPT reads but never applies).
    if (cfg->dropout > 0 && o->dropout == 0)
      fy_log_info("the config asks for dropout %g on the residual branches; ferry trains without it unless asked "
                  "(--dropout config, or --dropout P)", (double)cfg->dropout);
    if (cfg->attention_dropout > 0 || cfg->layerdrop > 0)
      fy_log_info("the config asks for attention_dropout %g and layerdrop %g; ferry applies neither",
                  (double)cfg->attention_dropout, (double)cfg->layerdrop);
  }
  if (st == FY_OK && o->resume) st = resume(o, &r, &first_step, &scale, &scale_good);
  if (st == FY_OK && o->save && o->save_every > 0 && r.rank == 0)
    st = fy_ckpt_writer_create(o->save, o->keep, r.tp > 1 ? &r.whole : r.model, &ckpt);
  if (st == FY_OK && o->save && r.rank == 0) check_save_space(o, fy_opt_num_params(&r.cfg), o->steps - first_step);
  // A snapshot is the whole state again (weights, m and v: 12 bytes a parameter). When the host
  // tier cannot hold one beside the state (a model that fills the host memory, or chunks sharded
  // across ranks, of which the writing rank holds its share), an offloaded run writes its
  // checkpoints chunk by chunk from where the state lives, and training waits for each write.
  if (st == FY_OK && ckpt && r.x && r.tp == 1 &&
      (double)fy_host_in_use(r.host) + 12.0 * (double)r.model->graph->n_param_elems > (double)fy_host_cap(r.host)) {
    r.ckpt_by_chunk = res->ckpt_by_chunk = true;
    if (!o->quiet)
      printf("ferry: checkpoints are written chunk by chunk (a %.3g GiB snapshot does not fit beside the state in the "
             "host memory): training waits for each write\n", 12.0 * r.model->graph->n_param_elems / 1073741824.0);
  }
  bool lead = r.rank == 0;  // one rank speaks, logs and writes for all (replicas are identical)
  // Every rank knows when checkpoints are written: with sharded chunks all of them gather.
  const int64_t save_every = given->save && given->save_every > 0 ? given->save_every : 0;
  const bool sharded = (r.x && r.world > 1) || r.tp > 1;
  if (!lead) {
    eff.quiet = true;
    eff.log_path = NULL;
    eff.save = NULL;
    eff.save_every = 0;
  }
  res->rank = r.rank;
  res->world = r.world;
  if (st == FY_OK && o->log_path && !(log = fopen(o->log_path, "w")))
    st = fy_error_set(FY_ERR_IO, "cannot open the log %s for writing", o->log_path);
  if (st == FY_OK && (!(step_times = calloc((size_t)o->steps + 1, sizeof *step_times)) ||
                      !(ckpt_busy = calloc((size_t)o->steps + 1, sizeof *ckpt_busy))))
    st = fy_error_set(FY_ERR_NOMEM, "cannot allocate the step timings");
  if (st != FY_OK) goto done;

  struct fy_model *model = r.model;
  const int64_t tokens_per_step = o->batch * o->seq * o->grad_accum * r.dp;
  // Model FLOPs as PaLM and Megatron count them, and llm.c's count beside them (core/opt.c).
  const double flops_per_step = fy_opt_step_flops(&r.cfg, o->batch, o->seq, FY_FLOPS_PALM) * (double)o->grad_accum * r.dp;
  const double llmc_over = fy_opt_step_flops(&r.cfg, o->batch, o->seq, FY_FLOPS_LLMC) * (double)o->grad_accum * r.dp /
                           flops_per_step;
  res->model_state_bytes = (double)model->state_bytes;
  res->activation_bytes = (double)model->act_bytes;
  if (r.x) {
    struct fy_offload_stats xs;
    fy_offload_stats(r.x, &xs);
    res->n_blocks = xs.n_blocks;
    res->n_chunks = xs.n_chunks;
    res->n_disk_chunks = xs.n_disk_chunks;
    res->n_device_chunks = xs.n_device_chunks;
    res->chunk_bytes = xs.chunk_bytes;
    res->disk_tier_bytes = r.disk ? (double)fy_disk_in_use(r.disk) : 0;
  }
  bool tty = isatty(STDOUT_FILENO), out_gone = false;
  if (!o->quiet) {
    printf("ferry: %s, %.2fM parameters, %s, %d threads x %d ranks | batch %lld x %lld x %lld accum = %lld tokens/step | "
           "%lld tokens in %s\n",
           r.cfg.name, fy_opt_num_params(&r.cfg) / 1e6, o->precision, omp_get_max_threads(), r.world, (long long)o->batch,
           (long long)o->seq, (long long)o->grad_accum, (long long)tokens_per_step,
           (long long)fy_data_num_tokens(r.data), o->data);
    printf("ferry: %.4g GFLOP a step, model FLOPs as PaLM and Megatron count them (llm.c's count: %.4g)\n",
           flops_per_step / 1e9, flops_per_step * llmc_over / 1e9);
    char disk_b[32];
    if (r.x)
      printf("ferry: %s device %.0f MiB: %d cache blocks of %.1f MiB for %d chunks, activations %.1f MiB; "
             "host tier %.1f of %.0f MiB; gradients and AdamW state of %d chunks on disk%s%s%s, %d on the device\n",
             r.dev->name, r.dev->cap / 1048576.0, res->n_blocks, res->chunk_bytes / 1048576.0, res->n_chunks,
             model->act_bytes / 1048576.0, fy_host_in_use(r.host) / 1048576.0, fy_host_cap(r.host) / 1048576.0,
             res->n_disk_chunks, r.disk ? " (" : "",
             r.disk ? fy_format_bytes(res->disk_tier_bytes, disk_b, sizeof disk_b) : "", r.disk ? ")" : "",
             res->n_device_chunks);
    else
      printf("ferry: model state %.1f MiB (params, grads, AdamW m and v), activations %.1f MiB\n",
             model->state_bytes / 1048576.0, model->act_bytes / 1048576.0);
    fflush(stdout);
  }
  model->profile = o->profile;
  if (r.x && o->profile && !fy_offload_profile(r.x, true) && lead)
    fy_log_info("--profile: the %s device cannot time its streams; the compute stream's waits are not measured",
                r.dev->name);
  res->first_step = first_step;
  if (o->loss_scale > 0 && (o->loss_scale != exp2(round(log2(o->loss_scale))) || o->loss_scale < 1)) {
    st = fy_error_set(FY_ERR_INVALID, "--loss-scale %g must be a power of two >= 1", o->loss_scale);
    goto done;
  }
  if (o->loss_scale > 0 && !o->resume) scale = o->loss_scale;
  if (first_step > 0 && !o->quiet) printf("ferry: resuming from %s at step %lld\n", o->resume, (long long)first_step);
  if (first_step > 0 && first_step >= o->steps && o->steps > 0 && r.rank == 0)
    fy_log_info("the checkpoint is at step %lld and --steps %lld counts from the start of training: nothing to "
                "train (--steps above %lld goes on)", (long long)first_step, (long long)o->steps,
                (long long)first_step);
  double t_start = fy_now(), t_sum = 0, t_opt = 0, val_s = 0;
  const int64_t val_every = o->val_every > 0 ? o->val_every : o->steps / 10 > 0 ? o->steps / 10 : 1;
  res->val_loss = res->first_loss = res->last_loss = NAN;  // (steps whose every target is ignored have none)
  for (int64_t step = first_step; step < o->steps; step++) {
    double t0 = fy_now(), loss = 0, norm = 0;
    bool overflow = false;
    if (ckpt) ckpt_busy[step] = fy_ckpt_busy(ckpt);
    if (r.x) fy_offload_set_step(r.x, step + 1);
    struct fy_comm *named[] = {r.comm, r.tp_compute, r.dp_compute};  // (a failed collective names its step)
    for (int i = 0; i < 3 && r.world > 1; i++)
      if (named[i]) fy_comm_set_step(named[i], step + 1);
    st = r.x ? step_offload(o, &r, step, scale, &loss, &norm, &overflow)
             : step_resident(o, &r, step, scale, &loss, &norm, &overflow, &t_sum, &t_opt);
    if (st == FY_OK && overflow && o->loss_scale <= 0)
      st = fy_error_set(FY_ERR_NUMERIC, "the gradient norm is %f; no parameter was updated", norm);
    if (st == FY_OK && o->loss_scale > 0) {
      struct fy_loss_scaler sc = {.scale = scale, .good = scale_good, .growth_interval = 2000};
      if ((st = fy_loss_scaler_update(&sc, overflow)) == FY_OK && overflow) {
        fy_log_info("step %lld: gradients overflow at loss scale %g; step skipped, scale now %g", (long long)step + 1,
                    scale, sc.scale);
        res->skipped_steps++;
      }
      scale = sc.scale;
      scale_good = sc.good;
    }
    // A step whose every target is ignored (loss masks) updates nothing, and is still a step:
    // logged, validated, checkpointed and counted like the others.
    const bool ignored = st == FY_ERR_NOT_FOUND;
    if (ignored) {
      fy_log_warn("step %lld: every target of the batch is ignored; no update", (long long)step + 1);
      st = FY_OK;
      loss = NAN;
      res->ignored_steps++;
    }
    if (st == FY_ERR_NUMERIC && !r.x) name_nonfinite(&r);
    if (st != FY_OK) {
      fy_error_wrap(st, "step %lld", (long long)step + 1);
      goto done;
    }
    // --optimizer-lag: the last step, and those that write a checkpoint, end with every update
    // applied (before their validation, so that the last one is the saved model's)
    const bool ckpt_step = save_every > 0 && (step + 1) % save_every == 0;
    if (o->optimizer_lag > 0 && (step + 1 == o->steps || ckpt_step) && (st = drain_updates(o, &r)) != FY_OK) {
      fy_error_wrap(st, "step %lld", (long long)step + 1);
      goto done;
    }
    float lr = fy_lr_at(o, step);
    double dt = fy_now() - t0;
    step_times[step] = dt;
    double tok_s = tokens_per_step / dt, gflops = flops_per_step / dt / 1e9, rss = peak_rss_bytes();
    if (!ignored) {
      if (isnan(res->first_loss)) res->first_loss = (float)loss;
      res->last_loss = (float)loss;
    }
    res->steps = step + 1;
    // Validation (every rank takes part: its rows, and the collectives of its forward passes).
    bool validated = false;
    if (r.val && ((step + 1) % val_every == 0 || step + 1 == o->steps)) {
      double tv = fy_now();
      if ((st = mean_loss(&r, r.val, o->val_batches, &res->val_loss, NULL, NULL)) != FY_OK) {
        fy_error_wrap(st, "validation after step %lld", (long long)step + 1);
        goto done;
      }
      validated = true;
      res->validations++;
      val_s = fy_now() - tv;
    }
    if (log) {
      // (null: the loss of a step without a target, the norm of an fp16 overflow, a validation loss
      // without a target; JSON has no NaN or infinity)
      char loss_json[32], norm_json[32], val_json[32];
      json_number(loss_json, loss, "%.6f");
      json_number(norm_json, norm, "%.6g");
      json_number(val_json, res->val_loss, "%.6f");
      fprintf(log, "{\"step\":%lld,\"loss\":%s,\"lr\":%.6g,\"grad_norm\":%s,\"step_s\":%.6f,"
              "\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"gflops_llmc\":%.2f,\"peak_rss_mib\":%.1f,\"device_peak_mib\":%.4f,"
              "\"host_tier_mib\":%.4f,\"host_peak_mib\":%.4f,\"device_state_mib\":%.4f,\"chunk_mib\":%.4f,"
              "\"optimizer_state\":\"%s\"",
              (long long)step + 1, loss_json, lr, norm_json, dt, tok_s, gflops, gflops * llmc_over, rss / 1048576.0,
              r.dev->bytes_peak / 1048576.0, r.host ? fy_host_in_use(r.host) / 1048576.0 : 0.0,
              r.host ? fy_host_peak(r.host) / 1048576.0 : 0.0,
              r.x ? fy_offload_device_state_bytes(r.x) / 1048576.0 : 0.0, res->chunk_bytes / 1048576.0,
              fy_state_format_name(r.model->state_format));
      if (ignored || (overflow && o->loss_scale > 0))
        fprintf(log, ",\"skipped\":\"%s\"", ignored ? "every target ignored" : "gradient overflow");
      if (validated) fprintf(log, ",\"val_loss\":%s,\"val_s\":%.4f", val_json, val_s);
      if (r.gpu >= 0) fprintf(log, ",\"device_other_mib\":%.1f", gpu_other_bytes(&r) / 1048576.0);
      if (r.disk) fprintf(log, ",\"disk_tier_mib\":%.4f", res->disk_tier_bytes / 1048576.0);
      fprintf(log, "}\n");
    }
    if (!o->quiet) {
      if (tty) printf("\r\033[K");
      // Offloaded or on a GPU, the peak that matters is the device's (under --device-mem); on the
      // cpu the process's.
      const bool dev_peak = r.x || r.gpu >= 0;
      char peak[32];
      fy_format_bytes(dev_peak ? (double)r.dev->bytes_peak : rss, peak, sizeof peak);
      char loss_txt[32] = "     -";  // every target ignored (loss NaN)
      if (isfinite(loss)) snprintf(loss_txt, sizeof loss_txt, "%.4f", loss);
      printf("step %5lld/%lld | loss %s | lr %.2e | norm %6.3f | %8.0f tok/s | %6.1f GFLOP/s | "
             "%s peak %9s | %.0f ms\n",
             (long long)step + 1, (long long)o->steps, loss_txt, lr, norm, tok_s, gflops, dev_peak ? "device" : "RSS",
             peak, dt * 1e3);
      if (validated)
        printf("validation after step %lld | loss %.4f | perplexity %.4g | %lld batches of %lld x %lld | %.0f ms\n",
               (long long)step + 1, res->val_loss, exp(res->val_loss), (long long)o->val_batches,
               (long long)(o->batch * r.dp), (long long)o->seq, val_s * 1e3);
      if (tty)
        progress_bar(step + 1, o->steps, (fy_now() - t_start) / (step + 1 - first_step) * (o->steps - step - 1));
      // Where these lines go is gone (the reader of a pipe ended, as `| tee` does when its terminal
      // closes; the terminal itself; a full disk): stop as a signal would, with a checkpoint, rather
      // than train on unseen (ferry train ignores SIGPIPE, so the write fails instead of killing it).
      if ((fflush(stdout) != 0 || ferror(stdout)) && !out_gone) {
        out_gone = true;
        fprintf(stderr, "ferry: cannot write to standard output (%s): stopping after this step\n", strerror(errno));
      }
    }
    bool stop = (o->stop && *o->stop) || out_gone || (o->stop_after > 0 && step + 1 - first_step >= o->stop_after);
    if (r.world > 1) {  // a signal may reach the ranks in different steps: they stop together
      float any = stop ? 1.0f : 0.0f;
      if ((st = fy_comm_all_reduce(r.comm, &any, 1, FY_COMM_F32, NULL)) != FY_OK) goto done;
      stop = any > 0;
    }
    if (save_every > 0 && (ckpt || sharded) && (stop || (step + 1) % save_every == 0 || step + 1 == o->steps)) {
      if ((st = checkpoint(o, &r, ckpt, step + 1, scale, scale_good)) != FY_OK) goto done;
      if (ckpt) res->checkpoints++;
    }
    if (stop) {
      res->interrupted = true;
      if (!o->quiet) printf("ferry: stopped after step %lld%s\n", (long long)step + 1, ckpt ? ", checkpoint written" : "");
      break;
    }
  }
  if (ckpt) {
    if ((st = fy_ckpt_wait(ckpt)) != FY_OK) goto done;
    res->checkpoint_s = fy_ckpt_last_seconds(ckpt);
    res->checkpoint_bytes = dir_bytes(o->save);
  }
  if ((st = drain_updates(o, &r)) != FY_OK) goto done;  // (offloaded: synced)
  if (r.x) {
    res->host_tier_bytes = (double)fy_host_in_use(r.host);
    res->device_state_bytes = (double)fy_offload_device_state_bytes(r.x);
    res->model_state_bytes = (double)fy_offload_state_bytes(r.x);
  }
  // Sharded weights come together chunk by chunk for the hash and the final save, on the rank that
  // saves (with neither, not at all); tensor-parallel ranks' slices come together below.
  // The final save (a run without checkpoints), as every rank knows it: the gathers are
  // collectives, and only rank 0 keeps --save (and writes).
  const bool final_save = given->save && save_every == 0, saving = lead && final_save;
  uint64_t *hash = o->hash_params ? &res->params_hash : NULL;
  const bool gather = final_save || hash;
  if (sharded && r.tp == 1 && gather && (st = finish_sharded(&r, saving ? o->save : NULL, lead, hash)) != FY_OK)
    goto done;
  if (!o->quiet && tty) printf("\r\033[K");
  if (r.x && o->profile && res->steps > first_step && fy_offload_profile(r.x, true)) {
    if ((st = fy_offload_stalls(r.x, res->stall_s)) != FY_OK) goto done;
    for (int i = 0; i < FY_STALL_COUNT; i++) res->stall_s[i] /= (double)(res->steps - first_step);
    res->stalls_timed = true;
  }
  for (int k = 0; o->profile && res->steps > first_step && k < FY_OP_KIND_COUNT; k++)
    for (int ph = 0; ph < 2; ph++) res->op_seconds[k][ph] = model->op_seconds[k][ph] / (double)(res->steps - first_step);
  if (o->profile && res->steps && !o->quiet) {
    double total = 0;
    for (int i = 0; i < res->steps; i++) total += step_times[i];
    printf("profile over %lld steps (%.3f s/step):\n", (long long)res->steps, total / res->steps);
    for (int k = 0; k < FY_OP_KIND_COUNT; k++)
      for (int ph = 0; ph < 2; ph++)
        if (model->op_seconds[k][ph] > 0)
          printf("  %-14s %-8s %8.1f ms/step %5.1f%%\n", fy_op_kind_name(k), ph ? "backward" : "forward",
                 1e3 * model->op_seconds[k][ph] / res->steps, 100 * model->op_seconds[k][ph] / total);
    if (res->stalls_timed) {  // (as ferry plan predicts them)
      printf("  compute waited per step:");
      for (int i = 0; i < FY_STALL_COUNT; i++)
        printf("%s %s %.3f s", i ? "," : "", fy_stall_name((enum fy_stall)i), res->stall_s[i]);
      printf("\n");
    }
    if (!r.x) {
      printf("  %-23s %8.1f ms/step %5.1f%%\n", "sum micro-batches", 1e3 * t_sum / res->steps, 100 * t_sum / total);
      printf("  %-23s %8.1f ms/step %5.1f%%\n", "clip + AdamW", 1e3 * t_opt / res->steps, 100 * t_opt / total);
    }
  }
  // Medians skip the first step (it creates the GEMM primitives and touches fresh pages).
  int64_t ran = res->steps - first_step;
  if (ckpt && ran > 1) {  // steps that overlapped a checkpoint write
    double *busy = calloc((size_t)ran, sizeof *busy);
    int64_t nb = 0;
    for (int64_t i = first_step + 1; busy && i < res->steps; i++)
      if (ckpt_busy[i]) busy[nb++] = step_times[i];
    res->step_s_ckpt = median(busy, nb);
    free(busy);
  }
  if (ran > 1) {
    double med = median(step_times + first_step + 1, ran - 1);
    res->tokens_per_s = tokens_per_step / med;
    res->gflops = flops_per_step / med / 1e9;
    res->step_s = med;
  } else if (ran == 1) {
    res->tokens_per_s = tokens_per_step / step_times[first_step];
    res->gflops = flops_per_step / step_times[first_step] / 1e9;
    res->step_s = step_times[first_step];
  }
  res->gflops_llmc = res->gflops * llmc_over;
  res->final_loss_scale = scale;
  res->peak_rss_bytes = peak_rss_bytes();
  res->device_peak_bytes = (double)r.dev->bytes_peak;
  if (r.x) {
    struct fy_offload_stats xs;
    fy_offload_stats(r.x, &xs);
    res->cache_loads = xs.cache.loads;
    res->cache_prefetches = xs.cache.prefetches;
    res->cache_evictions = xs.cache.evictions;
    res->cache_spills = xs.cache.spills;
  }
  struct fy_copy_stats cs;
  fy_device_copy_stats(r.dev, &cs);
  for (int d = 0; d < 2; d++) {
    res->copy_bytes[d] = cs.bytes[d];
    res->copy_busy_s[d] = cs.busy_s[d];
  }
  // Tensor-parallel slices come together parameter by parameter for the hash and the final save.
  if (r.tp > 1) {
    if (gather && (st = finish_tp(&r, saving ? o->save : NULL, lead, hash)) != FY_OK) goto done;
  } else if (!sharded) {
    if (hash && model->params) *hash = hash_params(model);  // (0 on the ranks that only took part)
    if (saving) st = fy_model_save(model, o->save, FY_F32, (size_t)5 << 30);
  }
  if (saving && st == FY_OK && !o->quiet) printf("ferry: saved a Hugging Face checkpoint to %s\n", o->save);
  if (!o->quiet && st == FY_OK && res->steps) {
    char other[96] = "";
    if (r.gpu >= 0)  // (the CUDA context, cuBLASLt, NCCL's buffers: outside --device-mem)
      snprintf(other, sizeof other, "; GPU %d: %.0f MiB in use besides ferry's %.0f MiB", r.gpu,
               gpu_other_bytes(&r) / 1048576.0, r.dev->bytes_in_use / 1048576.0);
    printf("ferry: %lld steps, loss %.4f -> %.4f, median %.0f tok/s, %.1f GFLOP/s (llm.c's count: %.1f), "
           "peak RSS %.2f GiB%s\n",
           (long long)res->steps, res->first_loss, res->last_loss, res->tokens_per_s, res->gflops, res->gflops_llmc,
           res->peak_rss_bytes / 1073741824.0, other);
  }
done:
  if (log) fclose(log);
  free(step_times);
  free(ckpt_busy);
  if (ckpt) {
    fy_status w = fy_ckpt_wait(ckpt);  // a write in flight finishes (or fails) before we go
    if (st == FY_OK) st = w;
    fy_ckpt_writer_free(ckpt);
  }
  teardown(&r);
  return st;
}

// ferry eval --dump: the first batch's inputs and logits (cpu: the logits are in host memory).
static fy_status dump_first(struct run *r, const struct fy_batch *batch, void *path) {
  const struct fy_graph *g = r->model->graph;
  struct fy_st_tensor ts[2] = {
      {.name = "input_ids", .dtype = FY_I32, .rank = 2, .shape = {g->B, g->T}, .data = batch->inputs,
       .nbytes = (size_t)(g->B * g->T) * 4},
      {.name = "logits", .dtype = FY_F32, .rank = 3, .shape = {g->B, g->T, r->cfg.vocab_size},
       .data = r->model->acts + g->slots[g->logits_slot].offset,
       .nbytes = (size_t)(g->B * g->T * r->cfg.vocab_size) * 4}};
  return fy_safetensors_write(path, ts, 2, NULL);
}

fy_status fy_eval(const struct fy_train_opts *o, double *mean_loss_out) {
  struct fy_train_opts e = *o;
  char init_dir[4096];
  FY_TRY(resolve_init(&e.init, init_dir, sizeof init_dir));
  // The whole model on the cpu or a GPU; or, offloaded (sim, or a GPU with --offload), the chunks
  // through the device cache in forward passes alone (no gradients or AdamW state kept). On a GPU
  // the forward runs in bf16 unless told otherwise.
  if (!e.device) e.device = "cpu";
  const bool cuda = strcmp(e.device, "cuda") == 0, sim = strcmp(e.device, "sim") == 0;
  if (!cuda && !sim && strcmp(e.device, "cpu") != 0)
    return fy_error_set(FY_ERR_INVALID, "--device %s: ferry eval runs on cpu, sim or cuda", e.device);
  if (e.offload && !cuda) return fy_error_set(FY_ERR_INVALID, "--offload is for --device cuda (sim always offloads)");
  if (o->dump && strcmp(e.device, "cpu") != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--dump writes the cpu's logits: use --device cpu");
  if (!e.precision) e.precision = fy_cost_default_precision(e.device);
  FY_TRY(resolve_seq(&e));
  struct run r;
  fy_status st = setup(&e, &r, false, true, NULL);
  if (st == FY_OK) st = mean_loss(&r, r.data, o->eval_batches, mean_loss_out, o->dump && r.rank == 0 ? dump_first : NULL,
                                  (void *)o->dump);
  if (st == FY_OK && r.rank == 0 && !o->quiet && isfinite(*mean_loss_out))
    printf("eval loss %.6f (perplexity %.4g) over %lld batches of %lld x %lld\n", *mean_loss_out, exp(*mean_loss_out),
           (long long)o->eval_batches, (long long)(o->batch * r.dp), (long long)e.seq);
  else if (st == FY_OK && r.rank == 0 && !o->quiet)  // (NaN: the loss masks leave no target)
    printf("eval loss nan: every target of the %lld batches of %lld x %lld is ignored (loss masks)\n",
           (long long)o->eval_batches, (long long)(o->batch * r.dp), (long long)e.seq);
  teardown(&r);
  return st;
}

fy_status fy_sample(const struct fy_train_opts *o, const struct fy_sample_opts *s, int32_t *out, int64_t *n_out) {
  *n_out = 0;
  if (s->n_prompt < 1) return fy_error_set(FY_ERR_INVALID, "sample: the prompt needs at least one token");
  if (s->n_new < 0 || !(s->temperature >= 0) || s->top_k < 0)
    return fy_error_set(FY_ERR_INVALID, "sample: tokens, temperature and top-k must not be negative");
  if (!(s->top_p >= 0 && s->top_p <= 1))
    return fy_error_set(FY_ERR_INVALID, "sample: top-p %g is not in [0, 1]", s->top_p);
  struct fy_train_opts e = *o;
  e.batch = 1;
  e.data = NULL;
  char init_dir[4096];
  FY_TRY(resolve_init(&e.init, init_dir, sizeof init_dir));
  const bool cuda = e.device && strcmp(e.device, "cuda") == 0;
  if (e.device && strcmp(e.device, "cpu") != 0 && !cuda)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--device %s: ferry sample runs on the cpu or a GPU (cuda)", e.device);
  if (e.offload && !cuda) return fy_error_set(FY_ERR_INVALID, "--offload is for --device cuda");
  if (!e.offload && (e.blocks || e.host_mem))
    return fy_error_set(FY_ERR_INVALID, "--blocks and --host-mem are for --offload");
  if (!cuda && e.device_mem) return fy_error_set(FY_ERR_INVALID, "--device-mem is for --device cuda");
  if (!e.precision) e.precision = fy_cost_default_precision(e.device);
  if (strcmp(e.precision, "fp32") != 0 && !(cuda && strcmp(e.precision, "bf16") == 0))
    return fy_error_set(FY_ERR_UNSUPPORTED, "--precision %s: ferry sample computes in fp32, or bf16 on a GPU",
                        e.precision);
  // The window: --seq, else every position the model has (a token costs one token's work whatever
  // the context: the keys and values of the tokens before are cached).
  struct fy_opt_config cfg;
  FY_TRY(resolve_config(&e, &cfg));
  const int64_t window = e.seq > 0 ? e.seq : cfg.max_position_embeddings;
  FY_TRY(seq_fits(window, &cfg));
  // The model is built for the prompt's tokens to run FY_SAMPLE_PREFILL at a time (products of that
  // many rows); each new token then runs alone, on its first row.
  e.seq = window < FY_SAMPLE_PREFILL ? window : FY_SAMPLE_PREFILL;
  // Offloaded, the chunk cache leaves the key/value cache its room (two buffers, each rounded up by
  // the allocator).
  if (e.offload)
    e.device_reserve = (size_t)fy_kv_cache_bytes(&cfg, window, precision_dtype(&e)) + ((size_t)4 << 20);
  const int64_t V = cfg.vocab_size;
  for (int64_t i = 0; i < s->n_prompt; i++)
    if (s->prompt[i] < 0 || s->prompt[i] >= V)
      return fy_error_set(FY_ERR_INVALID, "sample: prompt token %lld is %d, outside the vocabulary (%lld)",
                          (long long)i, s->prompt[i], (long long)V);
  const int32_t eos = cfg.eos_token_id >= 0 && cfg.eos_token_id < V ? (int32_t)cfg.eos_token_id : -1;
  const int32_t *stop = s->n_stop < 0 ? &eos : s->stop;
  const int n_stop = s->n_stop < 0 ? eos >= 0 : s->n_stop;
  for (int i = 0; i < n_stop; i++)
    if (stop[i] < 0 || stop[i] >= V)
      return fy_error_set(FY_ERR_INVALID, "sample: stop token %d is outside the vocabulary (%lld)", stop[i],
                          (long long)V);
  struct run r;
  fy_status st = setup(&e, &r, false, true, NULL);
  struct fy_kv_cache *kv = NULL;
  struct fy_sample_cand *cand = malloc((size_t)V * sizeof *cand);
  if (st == FY_OK && !cand) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (st == FY_OK) st = fy_kv_cache_create(r.model, window, &kv);
  memcpy(out, s->prompt, (size_t)s->n_prompt * 4);
  uint64_t rng = o->seed;
  const float *logits = NULL;
  int64_t n = s->n_prompt;
  bool stopped = false;
  double t0 = fy_now(), t1 = t0;
  // out[0, fed): the tokens run so far (the cache holds the last of them); out[n] is drawn from
  // the logits after out[n - 1].
  for (int64_t fed = 0; st == FY_OK && !stopped && n < s->n_prompt + s->n_new; n++) {
    if (fy_kv_cache_len(kv) + (n - fed) > window) {
      // The window is full: the newest half of it (at least the last token) runs again from
      // position 0, as the model sees the start of a sequence.
      fy_kv_cache_reset(kv);
      fed = n - (window / 2 > 0 ? window / 2 : 1);
    }
    while (st == FY_OK && fed < n) {
      const int64_t k = n - fed < e.seq ? n - fed : e.seq;
      st = r.x ? fy_offload_decode(r.x, kv, out + fed, k, &logits)
               : fy_engine_decode(r.model, kv, out + fed, k, &logits);
      fed += k;
    }
    if (st != FY_OK) break;
    out[n] = fy_sample_token(logits, V, s->temperature, s->top_k, s->top_p, cand, &rng);
    for (int i = 0; i < n_stop; i++) stopped |= out[n] == stop[i];
    if (n == s->n_prompt) t1 = fy_now();
  }
  if (s->prompt_seconds) *s->prompt_seconds = t1 - t0;
  if (s->new_seconds) *s->new_seconds = n > s->n_prompt ? fy_now() - t1 : 0;
  if (st == FY_OK) *n_out = n;
  fy_kv_cache_free(kv);
  free(cand);
  teardown(&r);
  return st;
}

// Copies src to dst through a temporary file: fsync, rename.
static fy_status copy_file(const char *src, const char *dst) {
  FILE *in = fopen(src, "rb");
  if (!in) return fy_error_set(FY_ERR_IO, "cannot open %s", src);
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp-%d", dst, (int)getpid());
  FILE *out = fopen(tmp, "wb");
  if (!out) {
    fclose(in);
    return fy_error_set(FY_ERR_IO, "cannot create %s", tmp);
  }
  static char buf[1 << 20];
  size_t n;
  bool ok = true;
  while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, n, out) == n;
  ok = ok && !ferror(in) && fflush(out) == 0 && fsync(fileno(out)) == 0;
  fclose(in);
  ok = fclose(out) == 0 && ok;
  if (!ok || rename(tmp, dst) != 0) {
    unlink(tmp);
    return fy_error_set(FY_ERR_IO, "writing %s failed (disk full?)", dst);
  }
  return FY_OK;
}

fy_status fy_export(const char *checkpoint, const char *out_dir) {
  char dir[4096];
  FY_TRY(fy_ckpt_resolve(checkpoint, dir, sizeof dir));
  FY_TRY(fy_ckpt_verify(dir));
  // Check what we copy: the config parses and the weights open with every header claim checked.
  struct fy_opt_config cfg;
  FY_TRY(fy_opt_config_read(dir, &cfg));
  fy_safetensors *st;
  FY_TRY(fy_safetensors_open_dir(dir, &st));
  int n = fy_safetensors_count(st);
  fy_safetensors_close(st);
  if (n == 0) return fy_error_set(FY_ERR_FORMAT, "%s holds no weights", dir);
  if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
    return fy_error_set(FY_ERR_IO, "cannot create %s: %s", out_dir, strerror(errno));
  DIR *d = opendir(dir);
  if (!d) return fy_error_set(FY_ERR_IO, "cannot read %s", dir);
  struct dirent *e;
  fy_status status = FY_OK;
  while (status == FY_OK && (e = readdir(d))) {
    const char *nm = e->d_name;
    bool model_file = strcmp(nm, "config.json") == 0 ||
                      (strncmp(nm, "model", 5) == 0 && (strstr(nm, ".safetensors") != NULL));
    if (!model_file) continue;
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/%s", dir, nm);
    snprintf(b, sizeof b, "%s/%s", out_dir, nm);
    status = copy_file(a, b);
  }
  closedir(d);
  return status;
}
