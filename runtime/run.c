// A run's setup and teardown (struct run, runtime/run.h): the model's configuration, the
// placement (cpu, GPU, offloaded), the ranks' communicators, and the weights each rank takes.
#include "runtime/trainer.h"

#include <limits.h>
#include <omp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/fileio.h"
#include "core/log.h"
#include "core/parse.h"
#include "ops/ops.h"
#include "core/safetensors.h"
#include "fy_config.h"
#include "runtime/data.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/offload.h"
#include "runtime/checkpoint.h"
#include "runtime/comm.h"
#include "runtime/pipeline.h"
#include "runtime/tp.h"
#include "ops/cuda/parts.h"
#include "runtime/engine_cuda.h"
#include "planner/cost.h"
#include "memory/tier.h"
#include "runtime/run.h"
#include "runtime/ep.h"

// --init naming a checkpoint root: its latest step directory (the weights; the AdamW state there
// is not read). buf holds the path.
fy_status resolve_init(const char **init, char *buf, size_t n) {
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
fy_status resolve_config(const struct fy_train_opts *o, struct fy_opt_config *cfg) {
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
float train_dropout(const struct fy_train_opts *o, const struct fy_opt_config *cfg) {
  return o->dropout == FY_DROPOUT_CONFIG ? cfg->dropout : o->dropout;
}

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
enum fy_dtype precision_dtype(const struct fy_train_opts *o) {
  enum fy_dtype dt = FY_F32;
  fy_precision_dtype(o->precision, &dt);
  return dt;
}

// --optimizer-state as a format (checked in check_train_opts; NULL: fp32).
enum fy_state_format state_format(const struct fy_train_opts *o) {
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
double gpu_other_bytes(const struct run *r) {
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
  // --disk-master (the engine keeps each chunk's master, the disk chunks' on disk), and evaluation
  // (or sampling) in bf16 on a GPU, whose chunks' bf16 copies are the weights.
  const bool disk_master = o->disk_master && !r->eval;
  // Speculative updates (--spec-chunks): the engine keeps each chunk's master weights itself too,
  // so that a chunk's and its spare slot's can swap.
  const bool spec = o->spec_chunks > 0 && !r->eval;
  struct fy_model_opts mo = {.recompute = o->recompute, .inference = r->eval, .chunk_elems = ce0, .host = r->host,
                             .tp = r->tp, .tp_rank = r->tp_rank, .tp_comm = r->tp_compute,
                             .state_format = r->eval ? FY_STATE_F32 : sf,
                             .no_params = r->dp > 1 || disk_master || spec || (r->eval && cuda && cdt != FY_F32),
                             .act16 = cuda && cdt != FY_F32, .pp = r->pp, .pp_stage = r->pp_rank};
  FY_TRY(fy_model_create_with(cfg, o->batch, o->seq, r->dev, &mo, &r->model));
  r->model->dp_comm = r->dp_compute;
  // --ep offloaded (sim): every rank's graph keeps every expert, in chunks sharded across the
  // data-parallel ranks like the dense weights (the cache gathers a mixture's whole chunk, the
  // reduce-scatter sums its gradients: every expert's every step, whoever got tokens); a mixture's
  // op computes this rank's experts alone, its rows moved by the all-to-alls of runtime/ep.c on the
  // compute stream (ep_comm, which no other thread uses). The graph is not split: checkpoints and
  // resuming are the dense sharded run's (r->ep 1 from here on).
  // On GPUs (cuda --offload) the same with the GPU's pieces (runtime/ep_cuda.h): the rows by NCCL
  // send/recv on the compute stream over ep_compute, the counts over ep_comm on the host.
  if (r->ep > 1 && !cuda) {
    r->model->ep_comm = r->ep_comm;
    FY_TRY(fy_ep_create(r->model, &r->model->ep));
    r->ep = 1;
  }
#if FY_HAVE_CUDA
  if (cuda) FY_TRY(fy_engine_cuda_attach(r->model));  // its kernels launch on the offload's compute stream
  if (cuda && r->ep > 1) {
    fy_status se = device_comm(r->ep_comm, r->ep_rank, true, &r->ep_compute);
    if (se != FY_OK) return fy_error_wrap(se, "--ep %d on GPUs", r->ep);
    r->model->ep_comm = r->ep_comm;
    FY_TRY(fy_engine_cuda_set_ep(r->model, r->ep_compute));
    r->ep = 1;
  }
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
  // Per chunk that may go to disk: m, v, the gradients unless they come home over the 16-bit copy,
  // and with --disk-master the rank's part of its master weights. The master weights stay in host
  // memory otherwise: one rank's in the model's buffer (counted in use), a sharded rank's shards
  // (counted here), and with --disk-master those of the chunks kept on the device.
  // (Evaluation keeps no gradients, m or v: only the sharded weights, one rank's in the model.)
  // m and v in the run's state format: a slot of fy_state_moment_bytes(S) each (runtime/offload.c).
  int n_dev = o->device_chunks < l->n_chunks ? o->device_chunks : l->n_chunks;
  size_t shard_bytes = chunk_bytes / (size_t)r->dp,
         mv_bytes = 2 * fy_state_moment_bytes(sf, l->chunk_elems / r->dp),
         per_chunk = r->eval ? (r->dp > 1 ? shard_bytes : 0)
                           : (g16 ? 0 : shard_bytes) + mv_bytes + (disk_master ? shard_bytes : 0);
  size_t reserve = 3 * chunk_bytes;
  if (cdt != FY_F32) reserve += (size_t)l->n_chunks * (size_t)l->chunk_elems / (size_t)r->dp * esize;  // 16-bit weights
  if (cdt != FY_F32 && o->optimizer_lag > 0 && !r->eval)  // (their second copy, but for the device's chunks)
    reserve += (size_t)(l->n_chunks - (r->dp == 1 ? n_dev : 0)) * (size_t)l->chunk_elems / (size_t)r->dp * esize;
  // the master's shards, or with speculation its chunks: the engine's (the model has none)
  if ((r->dp > 1 || spec) && !r->eval && !disk_master) reserve += (size_t)l->n_chunks * shard_bytes;
  if (disk_master && r->dp == 1) reserve += (size_t)n_dev * shard_bytes;  // (the device chunks' masters' host copy)
  // Speculation: a spare slot per speculated chunk (master, m, v, 16-bit copy), for at most the
  // chunks not on the device.
  if (spec) {
    const int most = l->n_chunks - n_dev, k = o->spec_chunks < most ? o->spec_chunks : most;
    reserve += (size_t)(k > 0 ? k : 0) *
               (shard_bytes + mv_bytes + (cdt != FY_F32 ? (size_t)l->chunk_elems / (size_t)r->dp * esize : 0));
  }
  size_t spare = host_cap > in_use + reserve ? host_cap - in_use - reserve : 0;
  int fit = per_chunk ? (int)(spare / per_chunk) : l->n_chunks;
  if (fit < l->n_chunks && !r->eval) {
    // (the disk chunks' buffers: runtime/offload.c; with --disk-master two sets of master weights)
    reserve += 2 * mv_bytes + (g16 ? 0 : 3) * shard_bytes + (disk_master ? 2 * shard_bytes : 0);
    spare = host_cap > in_use + reserve ? host_cap - in_use - reserve : 0;
    fit = (int)(spare / per_chunk);
  }
  if (r->eval && fit < l->n_chunks)
    return fy_error_set(FY_ERR_NOMEM, "the weights' shards do not fit in the host memory (--host-mem)");
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
  if (disk_master && n_disk == 0)
    return fy_error_set(FY_ERR_INVALID, "--disk-master puts the disk chunks' master weights on disk, and no chunk's "
                        "state goes to disk here (%s): give --disk-chunks N with a --disk-dir, or drop --disk-master",
                        o->disk_chunks == 0 ? "--disk-chunks 0" : shards_on_device ? "every shard is on the device"
                                                                : "--host-mem holds every chunk's");
  if (n_disk > 0 && !o->disk_dir)
    return fy_error_set(FY_ERR_NOMEM,
                        "the gradients and AdamW state%s of %d of %d chunks (%s) do not fit in the host "
                        "memory (--host-mem %s, %s of it for the parameters); give a disk tier with --disk-dir",
                        disk_master ? " and master weights" : "", n_disk, l->n_chunks,
                        fy_format_bytes((double)n_disk * (double)per_chunk, b1, sizeof b1),
                        fy_format_bytes((double)host_cap, b2, sizeof b2), fy_format_bytes((double)in_use, b3, sizeof b3));
  if (n_disk > 0) {
    // Each disk chunk's slot holds its m, v, unless they come home over the 16-bit copy its
    // gradients (fp32, this rank's shard), and with --disk-master its master weights (fp32, the
    // same). The file grows as steps write it, so a disk too small is said now rather than at a
    // step's first write; the ranks on this machine (given the same --disk-dir) share its file system.
    const size_t need = (size_t)n_disk * fy_disk_slot_bytes(per_chunk);
    const int local = r->comm && fy_comm_local_size(r->comm) > 1 ? fy_comm_local_size(r->comm) : 1;
    double space = 0;
    fy_status st = fy_mkdir_p(o->disk_dir);  // (made when missing, as --save's directory is)
    if (st == FY_OK) st = fy_disk_space(o->disk_dir, &space);
    if (st == FY_OK && (double)need * local > space) {
      char b5[32];
      return fy_error_set(FY_ERR_NOMEM,
                          "--disk-dir %s: the gradients and AdamW state%s of %d of %d chunks need %s on disk%s%s%s, and "
                          "its file system has %s free: free some space, give a --disk-dir on a larger disk, or more "
                          "--host-mem (now %s, %s of it for the parameters)", o->disk_dir,
                          disk_master ? " (and master weights)" : "", n_disk, l->n_chunks,
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
                               .tp_comm = r->tp_comm, .optimizer_lag = o->optimizer_lag, .disk_master = disk_master,
                               .spec_chunks = spec ? o->spec_chunks : 0,
                               .device_updates = r->eval ? 0 : o->device_updates};
  // A pipeline stage: its activations' arenas (one per micro-batch in flight) before the cache's
  // blocks take what is left of the device; the engine runs the stage's ops in the 1F1B order.
  // (Evaluation: forward passes alone, one a step in the engine's trace.)
  bool order[2 * (o->grad_accum > 0 ? o->grad_accum : 1)];
  if (r->pp > 1 && cuda) {  // (on GPUs the stages' messages go by NCCL send/recv)
    fy_status sp = device_comm(r->pp_comm, r->pp_rank, true, &r->pp_compute);
    if (sp != FY_OK) return fy_error_wrap(sp, "%d pipeline stages on GPUs", r->pp);
    FY_TRY(fy_pipeline_create_gpu(r->model, r->pp_comm, r->pp_compute, r->pp, r->pp_rank,
                                  r->eval ? 1 : (int)o->grad_accum, &r->pipe));
  } else if (r->pp > 1) {
    FY_TRY(fy_pipeline_create(r->model, r->pp_comm, r->pp, r->pp_rank, r->eval ? 1 : (int)o->grad_accum, &r->pipe));
  }
  if (r->pp > 1) {
    FY_TRY(fy_graph_stage_ops(r->model->graph, cfg->num_hidden_layers, r->pp, r->pp_rank, &xo.stage_lo, &xo.stage_hi));
    xo.n_schedule = r->eval ? (order[0] = true, 1) : fy_pipeline_schedule(r->pp, r->pp_rank, (int)o->grad_accum, order);
    xo.schedule = order;
    xo.stage_comm = r->pp_comm;
  }
  fy_status st = fy_offload_create(r->model, &xo, &r->x);
  if (st == FY_OK && r->pipe) fy_pipeline_set_offload(r->pipe, r->x);
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

fy_status set_shards(struct run *r, const char *dir, uint64_t seed) {
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
fy_status tp_take_weights(struct run *r, const char *dir, uint64_t seed) {
  struct fy_model_source *s;
  FY_TRY(fy_model_source_open(&r->whole, dir, seed, &s));
  fy_status st = FY_OK;
  if ((r->model->params && fy_model_params_on_device(r->model)) || r->model->weights16) {
    // (a GPU's: taken on the host, then up; evaluating in 16 bits, a pipeline stage's weights are
    // its 16-bit copy alone, converted on the host as fy_model_load converts one rank's)
    struct fy_model *m = r->model;
    const size_t n = (size_t)m->graph->n_param_elems;
    float *host = calloc(n + 1, 4);
    void *w16 = m->weights16 ? malloc(n * m->cparams_esize + 1) : NULL;
    if (!host || (m->weights16 && !w16)) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
    if (st == FY_OK && m->weights16 && !m->cparams)
      st = fy_error_set(FY_ERR_INTERNAL, "16-bit weights before the compute dtype is set");
    if (st == FY_OK) fy_tp_take(m->graph, host, r->whole_graph, tp_read_weights, s);
    if (st == FY_OK && w16) fy_convert_from_f32(w16, m->compute_dtype, host, n);
    if (st == FY_OK) st = w16 ? fy_model_upload(m, m->cparams, w16, n * m->cparams_esize)
                              : fy_model_upload(m, m->params, host, n * 4);
    m->cparams_fresh = w16 && st == FY_OK;  // (16-bit weights current; fp32 ones converted at the next pass)
    free(host);
    free(w16);
  } else if (r->model->params) {
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
fy_status seq_fits(int64_t seq, const struct fy_opt_config *cfg) {
  if (seq <= cfg->max_position_embeddings) return FY_OK;
  return fy_error_set(FY_ERR_INVALID, "--seq %lld is longer than the model allows (%lld positions)", (long long)seq,
                      (long long)cfg->max_position_embeddings);
}

// The run's communicator over every rank (--comm, --comm-timeout).
fy_status make_comm(const struct fy_train_opts *o, struct fy_comm **out) {
  return fy_comm_create(o->comm ? o->comm : "auto", o->comm_timeout > 0 ? o->comm_timeout : 300, out);
}

// Expert parallelism (--ep): groups of ep consecutive data-parallel ranks, checked before any rank
// allocates (the experts' count against ep comes with the model's config, in setup).
static fy_status ep_layout(const struct fy_train_opts *o, struct run *r) {
  r->ep = o->ep > 1 ? o->ep : 1;
  if (r->ep == 1) return FY_OK;
  // Within pipeline stages (--pp) the groups are of each stage's data-parallel ranks (dp_comm's: the
  // same stage and tp_rank): a stage's graph holds E/ep experts of its own layers' mixtures, and
  // the stage's gradient sums, norm and checkpoints take their experts' parts as runtime/ep.c does
  // (fy_pipeline_all_reduce_grads, fy_pipeline_grad_norm; train_checkpoint.c's walk), each
  // micro-batch in flight its own mixtures' state (fy_ep_set_arenas, picked by the host before each
  // half-pass). On sim (offloaded, the graph keeping every expert in the stage's sharded chunks,
  // setup_offload) the host waits for each half-pass's ops before the next (fy_offload_stage_pass);
  // on GPUs it does not, so their compute stream would have to pick the state itself: not yet.
  if (r->pp > 1 && o->device && strcmp(o->device, "cpu") != 0 && strcmp(o->device, "sim") != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--ep %d with --pp %d on --device %s: expert parallelism within "
                        "pipeline stages runs on --device cpu and sim for now", r->ep, r->pp, o->device);
  // On GPUs the expert-parallel pieces (runtime/ep_cuda.c) hold whole experts: no tensor-parallel sums.
  if (r->tp > 1 && o->device && strcmp(o->device, "cuda") == 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--ep %d with --tp %d on --device cuda: expert parallelism on GPUs moves "
                        "whole experts' rows, not tensor-parallel slices; --ep with --tp runs on --device cpu and sim "
                        "for now", r->ep, r->tp);
  if (r->dp % r->ep != 0)
    return fy_error_set(FY_ERR_INVALID, "--ep %d does not divide the %d data-parallel rank%s (%d rank%s / tp %d / pp "
                        "%d): run a multiple of %d ranks", r->ep, r->dp, r->dp == 1 ? "" : "s", r->world,
                        r->world == 1 ? "" : "s", r->tp, r->pp, r->ep * r->tp * r->pp);
  // With --tp the groups are of the data-parallel ranks of one tp_rank (dp_comm's): the ranks of a
  // tensor-parallel group see the same tokens, route them alike and send them to the same
  // expert-parallel ranks of their own tp_rank, each computing its tp slice of the experts there
  // (runtime/ep.c sums the slices' outputs over tp as a tensor-parallel mixture does).
  r->ep_rank = r->dp_rank % r->ep;
  FY_TRY(fy_comm_split(r->dp_comm, r->dp_rank / r->ep, r->ep_rank, &r->ep_comm));
  if (r->dp > r->ep) FY_TRY(fy_comm_split(r->dp_comm, r->ep_rank, r->dp_rank, &r->ep_rep));
  if (r->tp > 1)  // (the ep group's tp groups: one stage's)
    FY_TRY(fy_comm_split(r->comm, r->dp_rank / r->ep * r->pp + r->pp_rank, r->ep_rank * r->tp + r->tp_rank,
                         &r->eptp_comm));
  return FY_OK;
}

// comm: the run's communicator when the caller made it already (it is the run's then, freed by
// teardown), else NULL to make it here.
fy_status setup(const struct fy_train_opts *o, struct run *r, bool shuffle, bool eval, struct fy_comm *comm) {
  memset(r, 0, sizeof *r);
  r->eval = eval;
  r->gpu = -1;
  if (comm) r->comm = comm;
  else FY_TRY(make_comm(o, &r->comm));
  r->rank = fy_comm_rank(r->comm);
  r->world = fy_comm_size(r->comm);
  if (r->world > 1) fy_log_set_rank(r->rank);
  r->tp = o->tp > 1 ? o->tp : 1;
  r->pp = o->pp > 1 ? o->pp : 1;
  if (r->pp > 1 && r->world % (r->pp * r->tp) != 0)  // (the layers' split is checked with the model's config)
    return fy_pipeline_check_layout(r->pp, r->tp, r->world, INT64_MAX);
  if (r->world % r->tp != 0)
    return fy_error_set(FY_ERR_INVALID, "--tp %d does not divide the %d rank%s: run a multiple of %d ranks (mpirun -np %d "
                        "ferry ...)", r->tp, r->world, r->world == 1 ? "" : "s", r->tp, r->tp);
  // The grid dp x pp x tp, tp innermost: rank = (dp_rank * pp + pp_rank) * tp + tp_rank.
  r->tp_rank = r->rank % r->tp;
  r->pp_rank = r->rank / r->tp % r->pp;
  r->dp_rank = r->rank / (r->tp * r->pp);
  r->dp = r->world / (r->tp * r->pp);
  r->dp_comm = r->comm;
  if (r->tp > 1) FY_TRY(fy_comm_split(r->comm, r->rank / r->tp, r->tp_rank, &r->tp_comm));
  if (r->tp > 1 || r->pp > 1)  // (of one rank when dp is 1)
    FY_TRY(fy_comm_split(r->comm, r->pp_rank * r->tp + r->tp_rank, r->dp_rank, &r->dp_comm));
  if (r->pp > 1) FY_TRY(fy_comm_split(r->comm, r->dp_rank * r->tp + r->tp_rank, r->pp_rank, &r->pp_comm));
  FY_TRY(ep_layout(o, r));
  if (o->batch < 1) return fy_error_set(FY_ERR_INVALID, "--batch must be at least 1");
  if (o->seq < 1) return fy_error_set(FY_ERR_INVALID, "--seq must be at least 1");
  if (o->threads > 0) omp_set_num_threads(o->threads);
  else share_cores(r);
  FY_TRY(resolve_config(o, &r->cfg));
  if (r->pp > 1) FY_TRY(fy_pipeline_check_layout(r->pp, r->tp, r->world, r->cfg.num_hidden_layers));
  if (r->rank == 0) warn_weights_unread(o);
  // Dropout while training (evaluation has none); its probability is checked with the graph.
  if (!eval) r->cfg.train_dropout = train_dropout(o, &r->cfg);
  FY_TRY(seq_fits(o->seq, &r->cfg));
  fy_status st;
  const char *device = o->device ? o->device : "cpu";
  // A mixture of experts runs with the CPU's kernels (cpu, sim offloaded) or the GPU's (resident or
  // --offload); with --tp on each, every expert split as the dense feed-forward (core/opt.c), its
  // partial sums over the group by the kernels (ops/ops.h, fy_moe_dims.tp_sum; NCCL on GPUs).
  if (r->cfg.num_local_experts > 0 && strcmp(device, "cpu") != 0 && strcmp(device, "sim") != 0 &&
      strcmp(device, "cuda") != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "%s is a mixture of experts: it runs on --device cpu, sim (offloaded) or "
                        "cuda (resident or --offload), with or without --tp", r->cfg.name);
  if (r->ep > 1 && strcmp(device, "cpu") != 0 && strcmp(device, "sim") != 0 && strcmp(device, "cuda") != 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--ep %d on --device %s: expert parallelism runs on --device cpu, sim and "
                        "cuda", r->ep, device);
  if (r->ep > 1 && r->cfg.num_local_experts == 0)
    return fy_error_set(FY_ERR_INVALID, "--ep %d: %s has no mixture-of-experts layers (num_local_experts 0) to split",
                        r->ep, r->cfg.name);
  if (r->ep > 1 && r->cfg.num_local_experts % r->ep != 0)
    return fy_error_set(FY_ERR_INVALID, "--ep %d does not divide the %lld experts of %s's mixture layers: each rank of "
                        "an expert-parallel group holds experts/ep of them", r->ep,
                        (long long)r->cfg.num_local_experts, r->cfg.name);
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
                               .inference = r->eval, .state_format = r->eval ? FY_STATE_F32 : state_format(o),
                               .pp = r->pp, .pp_stage = r->pp_rank,  // (a pipeline stage: its parameters alone)
                               .ep = r->ep, .ep_rank = r->ep_rank, .ep_comm = r->ep_comm};  // (its experts alone)
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
    if (r->pp > 1) {  // the stages' activations and gradients go GPU to GPU by NCCL send/recv
      st = device_comm(r->pp_comm, r->pp_rank, true, &r->pp_compute);
      if (st != FY_OK) return fy_error_wrap(st, "%d pipeline stages on GPUs", r->pp);
    }
    if (r->ep > 1) {  // a mixture's rows to their experts' GPUs and back by NCCL send/recv (runtime/ep_cuda.h)
      st = device_comm(r->ep_comm, r->ep_rank, true, &r->ep_compute);
      if (st == FY_OK && r->ep_rep) st = device_comm(r->ep_rep, fy_comm_rank(r->ep_rep), true, &r->rep_compute);
      if (st != FY_OK) return fy_error_wrap(st, "--ep %d on GPUs", r->ep);
    }
    // (Evaluation or sampling in bf16 keeps the weights in bf16 alone: 2 bytes a parameter.) A
    // pipeline stage holds its own parameters alone.
    struct fy_model_opts mo = {.recompute = o->recompute, .inference = r->eval,
                               .act16 = precision_dtype(o) != FY_F32, .weights16 = r->eval,
                               .pp = r->pp, .pp_stage = r->pp_rank,
                               .ep = r->ep, .ep_rank = r->ep_rank, .ep_comm = r->ep_comm};  // (its experts alone)
    FY_TRY(fy_model_create_with(&r->cfg, o->batch, o->seq, r->dev, &mo, &r->model));
    r->model->dp_comm = r->dp_compute;  // (the hooks and the gradients' sum: on the GPU's stream)
    FY_TRY(fy_engine_cuda_attach(r->model));
    if (r->ep > 1) FY_TRY(fy_engine_cuda_set_ep(r->model, r->ep_compute));
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
  // tp starts from the same weights as one rank), and a pipeline stage its own parameters;
  // r->whole describes the whole model (no buffers).
  if (run_split(r)) {
    FY_TRY(fy_opt_build_graph(&r->cfg, o->batch, o->seq, &r->whole_graph));
    // Stages with 8-bit AdamW state: the whole model laid out in one rank's chunks (resident: one
    // chunk), so that a checkpoint's pieces hold whole 8-bit blocks, as one rank's do.
    if (r->pp > 1 && r->model->state_format == FY_STATE_Q8) {
      struct fy_chunk_layout *l;
      r->whole_graph->chunk_align = FY_Q8_BLOCK;
      FY_TRY(fy_chunk_layout_create(r->whole_graph, r->x ? r->model->layout->chunk_elems : 0, &l));
      fy_chunk_layout_free(l);
    }
    r->whole = (struct fy_model){.cfg = r->cfg, .graph = r->whole_graph, .kernels = &fy_model_cpu_kernels};
  }
  bool random = !o->init || strcmp(o->init, "random") == 0;
  if (run_split(r)) {
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
  if (r->pp > 1 && !r->pipe) {  // (offloaded, setup_offload made it)
    if ((!r->model->grads && !r->eval) || r->x || (r->model->device_memory && !r->pp_compute))
      return fy_error_set(FY_ERR_UNSUPPORTED, "--pp %d: pipeline stages train on --device cpu, sim and cuda for now",
                          r->pp);
    if (r->pp_compute)
      FY_TRY(fy_pipeline_create_gpu(r->model, r->pp_comm, r->pp_compute, r->pp, r->pp_rank,
                                    r->eval ? 1 : (int)o->grad_accum, &r->pipe));
    else
      FY_TRY(fy_pipeline_create(r->model, r->pp_comm, r->pp, r->pp_rank, r->eval ? 1 : (int)o->grad_accum,
                                &r->pipe));
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

void teardown(struct run *r) {
  if (r->lag_own && r->model && r->model->grads == r->lag_own) {  // the model frees its own
    r->model->grads = r->lag_grads;
    r->lag_grads = r->lag_own;
  }
  free(r->lag_own);
  fy_data_close(r->data);
  fy_data_close(r->val);
  fy_offload_free(r->x);  // before the communicators it duplicated
  fy_pipeline_free(r->pipe);  // (its sends in flight finished: before the model and pp_comm)
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
  fy_comm_free(r->ep_compute);
  fy_comm_free(r->rep_compute);
  fy_comm_free(r->ep_comm);
  fy_comm_free(r->ep_rep);
  fy_comm_free(r->eptp_comm);
  if (r->dp_comm != r->comm) fy_comm_free(r->dp_comm);
  fy_comm_free(r->pp_compute);
  fy_comm_free(r->pp_comm);
  fy_comm_free(r->comm);
}
