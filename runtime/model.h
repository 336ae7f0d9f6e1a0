// fy_model: an OPT model's state on one device, one flat buffer per kind of state (as llm.c):
// parameters, their gradients, AdamW's m and v, the activation arena and the activation-gradient
// arena of the graph. On the cpu device the fp32 parameters are also the master weights.
#ifndef FY_MODEL_H
#define FY_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/graph.h"
#include "core/opt.h"
#include "memory/chunk.h"
#include "ops/ops.h"
#include "runtime/comm.h"

struct fy_st_writer;

struct fy_model {
  struct fy_opt_config cfg;
  struct fy_graph *graph;
  struct fy_chunk_layout *layout;  // parameters packed into chunks (memory/chunk.h)
  struct fy_device *dev;  // not owned
  struct fy_host_tier *host;  // not owned; NULL when everything is on dev
  float *params, *grads, *m, *v;  // graph->n_param_elems each; m and v in state_format (one
                                  // moment's buffer of fy_state_moment_bytes(state_format,
                                  // n_param_elems) bytes each, ops/ops.h: floats in FY_STATE_F32)
  enum fy_state_format state_format;  // how AdamW's m and v are stored (--optimizer-state)
  float *grad_acc;        // the sum over micro-batches (NULL without gradient accumulation)
  float *acts;            // graph->act_elems
  float *dacts;           // graph->grad_elems
  float *scratch;         // graph->scratch_elems
  int32_t *positions;     // (B,T) position ids of the current micro-batch (offset included)
  // A device whose memory the host cannot address (cuda): the batch goes through dbatch (inputs,
  // targets, mask) and host_positions, and host code stages parameters through copies.
  bool device_memory;
  int32_t *dbatch, *host_positions;
  fy_stream *staging;     // the stream those copies run on (created on first use)
  const struct fy_model_kernels *kernels;
  void *kernels_ctx;
  // 16-bit numerics on a host-addressable device (fy_model_set_compute_dtype): the kernels read
  // cparams, the fp32 master weights rounded to compute_dtype before each forward, and every op's
  // output, input gradients and parameter gradients are rounded to it as they are written (fp16
  // overflows to inf, which loss scaling catches). The storage stays fp32: these are the numbers
  // of 16-bit training, not its memory. FY_F32 (the default): none of this.
  // On a device the host cannot address (cuda) the 16-bit buffers hold real 16-bit values: cparams
  // and cgrads (the parameters' gradients as the kernels write them) are arrays of bf16 with the
  // parameters' element offsets, cparams_esize 2 (4 on the cpu, where cgrads is NULL).
  // Offloaded (host != NULL) neither buffer exists: the offload engine keeps each chunk's weights
  // in the compute dtype (cparams_esize bytes an element) and the kernels write the gradients
  // over them in the device's blocks (runtime/offload.h).
  enum fy_dtype compute_dtype;
  float *cparams, *cgrads;
  size_t cparams_esize;
  // cparams hold the current master weights. Initialising or loading clears it, and so does an
  // optimizer step that does not write cparams itself (the CPU's); the next forward then refreshes
  // cparams (kernels->prepare_weights). Code that writes m->params otherwise must clear it.
  bool cparams_fresh;
  bool grads_f32;  // the optimizer reads m->grads as fp32 (a sum over micro-batches), not cgrads
  // Evaluation or sampling on a GPU in 16-bit (fy_model_opts.weights16): the weights are cparams
  // alone (2 bytes a parameter), params NULL; loading and initialising convert on the host.
  bool weights16;
  // Seconds spent per op kind, forward [0] and backward [1], when `profile` is set.
  bool profile;
  double op_seconds[FY_OP_KIND_COUNT][2];
  // Tensor parallelism (graph->tp > 1): the group's communicator (not owned; collectives run on
  // the thread that runs the ops) and a private (BT, C) buffer for a column-split linear's partial
  // input gradient before it is summed over the group.
  struct fy_comm *tp_comm;
  float *tp_buf;
  int64_t tp_buf_elems;
  // Expert parallelism (graph->ep > 1, runtime/ep.h): the expert-parallel group's communicator
  // (not owned) and what its mixtures' forward passes keep for their backward.
  struct fy_comm *ep_comm;
  struct fy_ep *ep;
  // Per op: the parallel pattern whose runtime hooks run after its kernels (NULL: none), from
  // the graph's op->pattern; and the data-parallel group those hooks may sum over (not owned).
  const struct fy_pattern **patterns;
  struct fy_comm *dp_comm;
  uint64_t dropout_seed;  // the run's seed, for the dropout masks of the graph's residual adds
  int64_t state_bytes;    // bytes of params + grads + m + v
  int64_t act_bytes;      // bytes of acts + dacts + scratch + positions
};

struct fy_host_tier;
struct fy_model;

// The kernels the engine and the optimizer run on the model's device: the CPU ones (cpu and sim
// devices, whose memory the host can address) unless a backend replaces them
// (runtime/engine_cuda.c for a cuda device). `ctx` is the backend's.
struct fy_model_kernels {
  void (*op_forward)(void *call);   // struct fy_op_call * (runtime/engine.h)
  void (*op_backward)(void *call);
  // sums[i] = the sum of squares of parameter i's gradient (as the optimizer reads it), in double,
  // for every parameter: one pass, one wait for a device.
  fy_status (*grads_sumsq)(struct fy_model *m, double *sums);
  // With a 16-bit compute dtype: cparams <- the master weights in it (before a forward, when
  // cparams_fresh is false).
  void (*prepare_weights)(struct fy_model *m);
  // Gradient accumulation: grad_acc (fp32) = (first) or += this micro-batch's parameter gradients.
  void (*grads_sum)(struct fy_model *m, bool first);
  // Kernels that launch on a stream (a device the host cannot address; NULL for the CPU's, which
  // are host functions): from now on launch on `s`. The offload engine hands its compute stream.
  void (*set_stream)(struct fy_model *m, fy_stream *s);
  // The same without waiting for the old stream: the offload engine's device updates launch a few
  // kernels on a stream of their own and switch back, their order kept by the engine's events.
  void (*launch_on)(struct fy_model *m, fy_stream *s);
  void (*adamw)(struct fy_model *m, float *param, float *mom, float *var, const float *grad, int64_t n,
                float lr, float beta1, float beta2, float eps, float weight_decay, int64_t t, float grad_scale);
  // Chunks the offload engine keeps on such a device, launched on the stream of set_stream (NULL
  // where host functions on the stream do this work, as on the sim device). Gradients are of
  // dtype g_dt (fp32, or the compute dtype bf16 before any sum over micro-batches):
  // *sum (device) = sum of g (n)^2, in double;
  fy_status (*chunk_sumsq)(struct fy_model *m, double *sum, const void *g, enum fy_dtype g_dt, int64_t n);
  // AdamW as `adamw`, with the gradient scale and a skip flag read from device memory when the
  // kernel runs (scale_skip[0], scale_skip[1] != 0: leave everything as it is): the offload engine
  // launches it before the step's gradient norm is known on the host; param16 (n, NULL with fp32
  // compute) receives the new weights in the compute dtype in the same pass;
  fy_status (*chunk_adamw)(struct fy_model *m, float *param, float *mom, float *var, const void *grad,
                           enum fy_dtype g_dt, void *param16, int64_t n, float lr, float beta1, float beta2,
                           float eps, float weight_decay, int64_t t, const float *scale_skip);
  // The same with m and v stored in format f (ops/ops.h: FY_STATE_BF16 or FY_STATE_Q8, buffers of
  // n elements), every parameter of the chunk at once as ranges (n_ranges, in DEVICE memory) with
  // their weight decay (NULL where the device has no such kernels);
  fy_status (*chunk_adamw_state)(struct fy_model *m, enum fy_state_format f, float *param, void *mom, void *var,
                                 const void *grad, enum fy_dtype g_dt, void *param16, int64_t n,
                                 const struct fy_adamw_range *ranges, int n_ranges, float lr, float beta1, float beta2,
                                 float eps, int64_t t, const float *scale_skip);
  // dst (n, fp32) = src (first) or dst + src, src of dtype src_dt widened: the micro-batches' sum
  // of a chunk's gradients.
  fy_status (*chunk_add)(struct fy_model *m, float *dst, const void *src, enum fy_dtype src_dt, int64_t n, bool first);
  // dst (n, the compute dtype) = src (n, fp32) rounded: a chunk's 16-bit copy from its master.
  fy_status (*chunk_to16)(struct fy_model *m, void *dst, const float *src, int64_t n);
  // The host waits until every kernel launched so far has finished (NULL where kernels are host
  // functions, done when they return): fy_model_upload and fy_model_download copy on a stream of
  // their own, and a kernel still queued may read what an upload overwrites (the last
  // micro-batch's tokens, which the embedding's backward reads) or write what a download reads.
  fy_status (*wait)(struct fy_model *m);
  // On the kernels' buffers, queued where the kernels are (NULL in the CPU's table: host loops and
  // a collective on the calling thread), for the parallel patterns' hooks (planner/pattern.h, run
  // by fy_engine_run_hook) and the replicas' gradients (fy_engine_all_reduce_grads): buf (n of dt)
  // summed over communicator c in place, dst (n) += src, and out (rows, cols) += bias on every row.
  fy_status (*all_reduce)(struct fy_model *m, struct fy_comm *c, void *buf, size_t n, enum fy_reduce_dtype dt);
  fy_status (*pattern_add)(struct fy_model *m, void *dst, const void *src, int64_t n);
  fy_status (*pattern_bias_add)(struct fy_model *m, void *out, const void *bias, int64_t rows, int64_t cols);
  // Incremental decoding (fy_engine_decode): attention op `op` for the n tokens in its input at
  // positions len .. len+n-1, against kcache and vcache (cap, C, in the compute dtype, where the
  // kernels read), their keys and values appended there; scratch: NH * n * cap host floats (the
  // CPU's).
  fy_status (*attention_decode)(struct fy_model *m, int op, void *kcache, void *vcache, float *scratch, int64_t len,
                                int64_t n, int64_t cap);
  // The router alone of mixture op `op` over its first `rows` tokens (its routing record, aux[0],
  // from its input and `gate`, where the kernels read), launched on the stream of set_stream: the
  // offload engine's look at which experts get tokens before the op runs (NULL in the CPU's table:
  // the engine runs fy_moe_route as a host function on its stream).
  fy_status (*moe_route)(struct fy_model *m, int op, const void *gate, int64_t rows);
};

// Whether the optimizer reads the gradients in cgrads (a GPU's 16-bit ones, no fp32 sum over
// micro-batches) rather than in m->grads.
static inline bool fy_model_grads_16(const struct fy_model *m) {
  return m->cgrads && m->compute_dtype != FY_F32 && !m->grads_f32;
}

struct fy_model_opts {
  bool recompute;             // recompute each decoder layer's activations in backward (core/graph.h)
  int64_t chunk_elems;        // pack parameters into chunks of this many floats (0: one chunk)
  struct fy_host_tier *host;  // when set, parameters live there (offloading), not on dev, and
                              // gradients and AdamW's m and v are left to the caller (NULL here)
  int tp, tp_rank;            // tensor parallelism: this rank's part of the graph (0, 0: none)
  struct fy_comm *tp_comm;    // the tensor-parallel group (tp > 1), not owned
  int ep, ep_rank;            // expert parallelism: this rank's experts (0, 0: none; runtime/ep.h)
  struct fy_comm *ep_comm;    // the expert-parallel group (ep > 1), not owned
  bool inference;             // forward only (evaluation): no parameter gradients, m or v
  bool no_params;             // with host: no buffer for the whole model's weights (m->params
                              // NULL): chunks sharded across ranks keep only their shards, which
                              // are set part by part (fy_model_source_fill)
  bool act16;                 // on a GPU, 16-bit activations from the start (what a 16-bit compute
                              // dtype sets, fy_model_set_compute_dtype): the fp32 arenas, twice
                              // the size, are never allocated (they could pass the device's cap)
  bool weights16;             // with inference and act16 (a GPU computing in 16 bits): no fp32
                              // weights, only the compute dtype's copy (fy_model.weights16)
  // How AdamW's m and v are stored (FY_STATE_F32 by default): the resident model's m and v, and
  // the offload engine's (runtime/offload.c). FY_STATE_Q8 also packs parameter groups and chunks
  // at multiples of FY_Q8_BLOCK elements (fy_graph.chunk_align), so that every chunk size
  // quantises the same blocks.
  enum fy_state_format state_format;
  // Pipeline parallelism (runtime/pipeline.h): stage pp_stage of pp (pp > 1) holds only the
  // parameters its ops read (fy_graph_set_stage), with their gradients and AdamW state; the
  // others are absent from every buffer. 0, 0: the whole model.
  int pp, pp_stage;
};

// Allocates every buffer on `dev` for micro-batches of B x T; parameters are zero until
// fy_model_init_random or fy_model_load. opts may be NULL (defaults: no recomputation).
fy_status fy_model_create(const struct fy_opt_config *cfg, int64_t B, int64_t T,
                          struct fy_device *dev, struct fy_model **out);
fy_status fy_model_create_with(const struct fy_opt_config *cfg, int64_t B, int64_t T,
                               struct fy_device *dev, const struct fy_model_opts *opts,
                               struct fy_model **out);
void fy_model_free(struct fy_model *m);
// Allocates the buffer that sums gradients over micro-batches.
fy_status fy_model_enable_accumulation(struct fy_model *m);

// OPT's initialisation: weights of linear layers and embeddings ~ N(0, init_std), biases 0,
// layer norms weight 1 and bias 0, the padding row of the token embedding 0. Each parameter draws
// from its own stream (seed, parameter name), so the result does not depend on the layout.
void fy_model_init_random(struct fy_model *m, uint64_t seed);
// Loads weights from a Hugging Face model directory (model.safetensors or a sharded index), any of
// f32/f16/bf16. Names are matched with or without the "model." prefix; a missing tensor or a shape
// that differs is an error naming it; lm_head.weight is ignored when tied.
fy_status fy_model_load(struct fy_model *m, const char *dir);
// The same values part by part, for ranks that keep only a part of the model (the shards of
// sharded chunks, tensor-parallel slices): a source of the weights, open for reading any part of
// any parameter: OPT's initialisation with seed (dir NULL), or a Hugging Face model directory's
// tensors (each checked at open as fy_model_load does).
struct fy_model_source;
fy_status fy_model_source_open(const struct fy_model *m, const char *dir, uint64_t seed,
                               struct fy_model_source **out);
// Elements [a, b) of parameter i into dst[0 .. b - a).
void fy_model_source_read(const struct fy_model_source *s, int i, int64_t a, int64_t b, float *dst);
// Elements [lo, hi) of the flat parameter buffer (the layout's offsets; elements no parameter
// covers are 0) into dst[0 .. hi - lo).
void fy_model_source_fill(const struct fy_model_source *s, int64_t lo, int64_t hi, float *dst);
void fy_model_source_close(struct fy_model_source *s);
// Writes config.json and the weights (f32, or bf16/f16 when dtype says so) as transformers'
// save_pretrained does, sharding files above max_shard_bytes (0 = one file).
fy_status fy_model_save(const struct fy_model *m, const char *dir, enum fy_dtype dtype,
                        size_t max_shard_bytes);
// The same files (f32) from weights handed over piece by piece, for weights that no one buffer
// holds whole (chunks sharded across ranks): open starts them in dir; put writes the parameters'
// elements in [lo, hi) of the flat buffer (data holds those elements); commit completes them and
// writes config.json (fy_st_writer_abort drops them instead). Both free the writer.
fy_status fy_model_save_open(const struct fy_model *m, const char *dir, size_t max_shard_bytes,
                             struct fy_st_writer **out);
fy_status fy_model_save_put(const struct fy_model *m, struct fy_st_writer *w, int64_t lo, int64_t hi,
                            const float *data);
fy_status fy_model_save_commit(const struct fy_model *m, const char *dir, struct fy_st_writer *w);

// Sets the compute dtype (FY_F32, FY_BF16 or FY_F16) of a model whose parameters are resident on a
// host-addressable device (allocates cparams for 16-bit dtypes).
fy_status fy_model_set_compute_dtype(struct fy_model *m, enum fy_dtype dt);

// Gives op `op` the pattern `name` (planner/pattern.h; "" for none): its runtime hooks run after
// the op's kernels from then on. FY_ERR_INVALID for an unknown pattern or one that does not apply.
fy_status fy_model_set_pattern(struct fy_model *m, int op, const char *name);

// Copies between host memory and the model's device (a plain memcpy on host-addressable ones).
fy_status fy_model_upload(struct fy_model *m, void *dst, const void *src, size_t n);
fy_status fy_model_download(struct fy_model *m, void *dst, const void *src, size_t n);
// The CPU kernels (the default of every model).
extern const struct fy_model_kernels fy_model_cpu_kernels;

// Whether the parameters live in device memory the host cannot address (resident on a GPU); with
// a host tier (offloading) they are host memory whatever the device.
static inline bool fy_model_params_on_device(const struct fy_model *m) { return m->device_memory && !m->host; }

static inline float *fy_model_param(const struct fy_model *m, int id) {
  return m->params + m->graph->params[id].offset;
}
static inline float *fy_model_grad(const struct fy_model *m, int id) {  // (NULL without gradients: inference)
  return m->grads ? m->grads + m->graph->params[id].offset : NULL;
}

#endif
