#include "runtime/model.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/fileio.h"
#include "core/rand.h"
#include "core/log.h"
#include "core/parse.h"
#include "core/safetensors.h"
#include "ops/ops.h"
#include "runtime/engine.h"
#include "memory/tier.h"
#include "planner/pattern.h"

// Runs one copy or memset on a stream of the device and waits for it: for setup and staging,
// not the training loop.
static fy_status dev_sync_op(struct fy_device *dev, void *dst, const void *src, int value, size_t n) {
  fy_stream *s;
  FY_TRY(fy_stream_create(dev, &s));
  fy_status st = src ? fy_copy_async(s, dst, src, n) : dev->ops->memset_async(s, dst, value, n);
  if (st == FY_OK) st = fy_stream_sync(s);
  fy_stream_free(s);
  return st;
}

static bool host_addressable(const struct fy_device *dev) { return dev->kind != FY_DEVICE_CUDA; }

static fy_status buf_alloc(struct fy_device *dev, int64_t elems, size_t esize, void **out) {
  size_t n = (size_t)(elems > 0 ? elems : 1) * esize;
  FY_TRY(fy_device_alloc(dev, n, out));
  if (host_addressable(dev)) memset(*out, 0, n);
  else return dev_sync_op(dev, *out, NULL, 0, n);
  return FY_OK;
}

fy_status fy_model_upload(struct fy_model *m, void *dst, const void *src, size_t n) {
  if (!m->device_memory) {
    memmove(dst, src, n);
    return FY_OK;
  }
  if (m->kernels->wait) FY_TRY(m->kernels->wait(m));  // the kernels are done with dst and src
  // Every micro-batch stages its batch through here: one stream for the model's life, not one per copy.
  if (!m->staging) FY_TRY(fy_stream_create(m->dev, &m->staging));
  FY_TRY(fy_copy_async(m->staging, dst, src, n));
  return fy_stream_sync(m->staging);
}

fy_status fy_model_download(struct fy_model *m, void *dst, const void *src, size_t n) {
  return fy_model_upload(m, dst, src, n);  // cudaMemcpyDefault: the direction follows the pointers
}

static fy_status cpu_grads_sumsq(struct fy_model *m, double *sums) {
  for (int i = 0; i < m->graph->n_params; i++)
    sums[i] = m->graph->params[i].absent ? 0 : fy_sumsq(fy_model_grad(m, i), m->graph->params[i].numel);
  return FY_OK;
}

static void cpu_adamw(struct fy_model *m, float *p, float *mo, float *v, const float *g, int64_t n, float lr,
                      float b1, float b2, float eps, float wd, int64_t t, float scale) {
  m->cparams_fresh = false;  // the 16-bit copy is refreshed before the next forward
  fy_adamw_update(p, mo, v, g, n, lr, b1, b2, eps, wd, t, scale);
}

static void cpu_grads_sum(struct fy_model *m, bool first) {
  if (first) memcpy(m->grad_acc, m->grads, (size_t)m->graph->n_param_elems * 4);
  else fy_add_forward(m->grad_acc, m->grad_acc, m->grads, m->graph->n_param_elems);
}

static void cpu_prepare_weights(struct fy_model *m) {
  fy_round_to_dtype(m->cparams, m->params, m->compute_dtype, (size_t)m->graph->n_param_elems);
}

static fy_status cpu_attention_decode(struct fy_model *m, int o, void *kcache, void *vcache, float *scratch,
                                      int64_t len, int64_t n, int64_t cap) {
  const struct fy_op *op = &m->graph->ops[o];
  return fy_attention_decode(fy_engine_act(m, op->out), kcache, vcache, scratch, fy_engine_act(m, op->in[0]), len, n,
                             cap, op->C, op->NH, op->scale);
}

const struct fy_model_kernels fy_model_cpu_kernels = {
    .op_forward = fy_op_call_forward,
    .op_backward = fy_op_call_backward,
    .grads_sumsq = cpu_grads_sumsq,
    .adamw = cpu_adamw,
    .prepare_weights = cpu_prepare_weights,
    .grads_sum = cpu_grads_sum,
    .attention_decode = cpu_attention_decode,
};

// Parameter-sized buffers: from the host tier when offloading (zeroed, untouched pages), else
// from the device.
static fy_status home_alloc(struct fy_model *m, int64_t elems, float **out) {
  if (m->host) return fy_host_alloc(m->host, (size_t)elems * 4, (void **)out);
  return buf_alloc(m->dev, elems, 4, (void **)out);
}

// Floats of AdamW's m (and of v): one moment's buffer in the model's state format (ops/ops.h).
static int64_t moment_elems(const struct fy_model *m) {
  return (int64_t)((fy_state_moment_bytes(m->state_format, m->graph->n_param_elems) + 3) / 4);
}

static void home_free(struct fy_model *m, float *p, int64_t elems) {
  if (!p) return;
  if (m->host)
    fy_host_dealloc(m->host, p, (size_t)elems * 4);
  else
    fy_device_dealloc(m->dev, p, (size_t)(elems > 0 ? elems : 1) * 4);
}

fy_status fy_model_create(const struct fy_opt_config *cfg, int64_t B, int64_t T,
                          struct fy_device *dev, struct fy_model **out) {
  return fy_model_create_with(cfg, B, T, dev, NULL, out);
}

fy_status fy_model_create_with(const struct fy_opt_config *cfg, int64_t B, int64_t T,
                               struct fy_device *dev, const struct fy_model_opts *opts,
                               struct fy_model **out) {
  struct fy_model *m = calloc(1, sizeof *m);
  if (!m) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the model");
  m->cfg = *cfg;
  m->dev = dev;
  m->kernels = &fy_model_cpu_kernels;
  m->device_memory = !host_addressable(dev);
  int tp = opts && opts->tp > 1 ? opts->tp : 1;
  if (tp > 1 && (!opts->tp_comm || fy_comm_size(opts->tp_comm) != tp)) {
    free(m);
    return fy_error_set(FY_ERR_INVALID, "tensor parallelism over %d ranks needs their communicator", tp);
  }
  fy_status st = fy_opt_build_graph_tp(cfg, B, T, tp, tp > 1 ? opts->tp_rank : 0, &m->graph);
  if (st != FY_OK) {
    free(m);
    return st;
  }
  if (tp > 1) m->tp_comm = opts->tp_comm;
  if (!(m->patterns = calloc((size_t)m->graph->n_ops, sizeof *m->patterns))) {
    fy_graph_free(m->graph);
    free(m);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  for (int o = 0; o < m->graph->n_ops && st == FY_OK; o++) st = fy_model_set_pattern(m, o, m->graph->ops[o].pattern);
  if (st != FY_OK) {
    free(m->patterns);
    fy_graph_free(m->graph);
    free(m);
    return st;
  }
  // The cuda attention kernels are flash-style: they keep the log-sum-exp, not the probabilities.
  if (m->device_memory) fy_graph_set_flash_attention(m->graph, true);
  if (opts && opts->recompute) fy_graph_set_recompute(m->graph, true);
  if (opts && opts->inference) fy_graph_set_forward_only(m->graph);  // (no activation gradients either)
  if (m->device_memory && opts && opts->act16) st = fy_graph_set_act16(m->graph, true);
  m->host = opts ? opts->host : NULL;
  m->state_format = opts ? opts->state_format : FY_STATE_F32;
  if (m->state_format == FY_STATE_Q8) m->graph->chunk_align = FY_Q8_BLOCK;  // (memory/chunk.c)
  if (st == FY_OK && opts && opts->pp > 1) {  // a pipeline stage: its parameters alone take room
    int lo, hi;
    st = fy_graph_stage_ops(m->graph, cfg->num_hidden_layers, opts->pp, opts->pp_stage, &lo, &hi);
    if (st == FY_OK) fy_graph_set_stage(m->graph, lo, hi);
  }
  if (st == FY_OK) st = fy_chunk_layout_create(m->graph, opts ? opts->chunk_elems : 0, &m->layout);
  if (st == FY_OK && opts && opts->pp > 1) {  // (the offload engine's chunks: the stage's ops use them)
    int lo, hi;
    fy_graph_stage_ops(m->graph, cfg->num_hidden_layers, opts->pp, opts->pp_stage, &lo, &hi);
    fy_chunk_layout_keep_ops(m->layout, m->graph->n_ops, lo, hi);
  }
  if (st != FY_OK) {
    free(m->patterns);
    fy_graph_free(m->graph);
    free(m);
    return st;
  }
  const struct fy_graph *g = m->graph;
  int64_t np = g->n_param_elems;
  const bool inference = opts && opts->inference;  // the weights alone: no gradients, m or v
  m->weights16 = inference && opts->weights16 && opts->act16 && m->device_memory && !m->host;
  double state = m->weights16 ? 2.0 * (double)np : inference ? 4.0 * (double)np
                                                  : 8.0 * (double)np + (double)fy_state_bytes(m->state_format, np),
         acts = 4.0 * (double)(g->act_elems + g->grad_elems + g->scratch_elems);
  if (!m->host && dev->cap && state + acts > (double)(dev->cap - dev->bytes_in_use)) {
    fy_chunk_layout_free(m->layout);
    fy_graph_free(m->graph);
    free(m);
    char need[32], sb[32], ab[32], has[32];
    return fy_error_set(FY_ERR_NOMEM,
                        "%s with micro-batch %lld x %lld needs %s (%s of %s, %s of activations) but the %s "
                        "device has %s",
                        cfg->name, (long long)B, (long long)T, fy_format_bytes(state + acts, need, sizeof need),
                        fy_format_bytes(state, sb, sizeof sb),
                        inference ? "weights" : "parameters, gradients and AdamW state",
                        fy_format_bytes(acts, ab, sizeof ab), dev->name,
                        fy_format_bytes((double)(dev->cap - dev->bytes_in_use), has, sizeof has));
  }
  if ((!(m->host && opts->no_params) && !m->weights16 && (st = home_alloc(m, np, &m->params)) != FY_OK) ||
      (!m->host && !inference && (st = home_alloc(m, np, &m->grads)) != FY_OK) ||
      (!m->host && !inference && (st = home_alloc(m, moment_elems(m), &m->m)) != FY_OK) ||
      (!m->host && !inference && (st = home_alloc(m, moment_elems(m), &m->v)) != FY_OK) ||
      (st = buf_alloc(dev, g->act_elems, 4, (void **)&m->acts)) != FY_OK ||
      (st = buf_alloc(dev, g->grad_elems, 4, (void **)&m->dacts)) != FY_OK ||
      (st = buf_alloc(dev, g->scratch_elems, 4, (void **)&m->scratch)) != FY_OK ||
      (st = buf_alloc(dev, B * T, 4, (void **)&m->positions)) != FY_OK ||
      (m->device_memory && (st = buf_alloc(dev, 3 * B * T, 4, (void **)&m->dbatch)) != FY_OK) ||
      (tp > 1 && (st = buf_alloc(dev, m->tp_buf_elems = fy_graph_tp_buf_elems(g, cfg->hidden_size), 4, (void **)&m->tp_buf)) != FY_OK) ||
      (m->device_memory && !(m->host_positions = calloc((size_t)(B * T), 4)) &&
       (st = fy_error_set(FY_ERR_NOMEM, "out of memory")) != FY_OK)) {
    fy_model_free(m);
    char sb[32];
    return fy_error_wrap(st, "allocating the model's state (%s of parameter state)",
                         fy_format_bytes(state, sb, sizeof sb));
  }
  m->state_bytes = m->host ? 4 * np : (int64_t)state;
  m->act_bytes = 4 * (g->act_elems + g->grad_elems + g->scratch_elems + B * T);
  *out = m;
  return FY_OK;
}

fy_status fy_model_set_compute_dtype(struct fy_model *m, enum fy_dtype dt) {
  if (dt != FY_F32 && dt != FY_BF16 && dt != FY_F16)
    return fy_error_set(FY_ERR_INVALID, "compute dtype %s: ferry computes in f32, bf16 or f16", fy_dtype_name(dt));
  if (dt == FY_F16 && m->device_memory)
    return fy_error_set(FY_ERR_UNSUPPORTED, "f16 compute on the %s device: its kernels are f32 and bf16", m->dev->name);
  if (m->weights16 && dt == FY_F32)
    return fy_error_set(FY_ERR_INVALID, "a model built with 16-bit weights alone cannot compute in f32");
  m->cparams_esize = m->device_memory ? 2 : 4;  // real bf16 on the GPU, rounded floats on the CPU
  // Offloaded (the state in a host tier): the offload engine keeps the 16-bit copies, per chunk.
  if (dt != FY_F32 && !m->cparams && !m->host) {
    int64_t n = m->graph->n_param_elems;
    FY_TRY(buf_alloc(m->dev, n, m->cparams_esize, (void **)&m->cparams));
    if (m->device_memory && m->grads) FY_TRY(buf_alloc(m->dev, n, 2, (void **)&m->cgrads));
  }
  // A GPU's 16-bit activations take half the arenas (core/graph.h, act16): planned again and
  // allocated again at the new sizes (nothing points into them yet).
  bool act16 = m->device_memory && dt != FY_F32;
  if (act16 != m->graph->act16) {
    const struct fy_graph *g = m->graph;
    fy_device_dealloc(m->dev, m->acts, (size_t)(g->act_elems > 0 ? g->act_elems : 1) * 4);
    fy_device_dealloc(m->dev, m->dacts, (size_t)(g->grad_elems > 0 ? g->grad_elems : 1) * 4);
    m->acts = m->dacts = NULL;
    FY_TRY(fy_graph_set_act16(m->graph, act16));
    FY_TRY(buf_alloc(m->dev, g->act_elems, 4, (void **)&m->acts));
    FY_TRY(buf_alloc(m->dev, g->grad_elems, 4, (void **)&m->dacts));
    m->act_bytes = 4 * (g->act_elems + g->grad_elems + g->scratch_elems + g->B * g->T);
  }
  m->compute_dtype = dt;
  m->cparams_fresh = false;
  return FY_OK;
}

fy_status fy_model_set_pattern(struct fy_model *m, int op, const char *name) {
  FY_ASSERT(op >= 0 && op < m->graph->n_ops);
  if (!name || !*name) {
    m->patterns[op] = NULL;
    return FY_OK;
  }
  const struct fy_pattern *p = fy_pattern_find(name);
  if (!p) return fy_error_set(FY_ERR_INVALID, "op %s: unknown parallel pattern '%s'", m->graph->ops[op].name, name);
  // (The graph is this rank's part already: its split ops are the slices.)
  struct fy_pattern_ctx c = {.g = m->graph, .op = op, .dp = 1, .tp = 1, .param_bytes = 4};
  if (!p->applies(&c))
    return fy_error_set(FY_ERR_INVALID, "op %s: the pattern %s does not apply to it", m->graph->ops[op].name, name);
  m->patterns[op] = p;
  // (name may be the op's own pattern field: a copy onto itself would be undefined, and glibc's
  // snprintf empties it.)
  char *field = m->graph->ops[op].pattern;
  if (name != field) snprintf(field, sizeof m->graph->ops[op].pattern, "%s", name);
  return FY_OK;
}

fy_status fy_model_enable_accumulation(struct fy_model *m) {
  if (m->grad_acc) return FY_OK;
  FY_TRY(home_alloc(m, m->graph->n_param_elems, &m->grad_acc));
  m->state_bytes += 4 * m->graph->n_param_elems;
  return FY_OK;
}

void fy_model_free(struct fy_model *m) {
  if (!m) return;
  const struct fy_graph *g = m->graph;
  if (g) {
    int64_t np = g->n_param_elems;
    float *home[] = {m->params, m->grads, m->m, m->v, m->grad_acc};
    for (size_t i = 0; i < sizeof home / sizeof *home; i++) home_free(m, home[i], i == 2 || i == 3 ? moment_elems(m) : np);
    struct { void *p; int64_t n; } bufs[] = {{m->acts, g->act_elems}, {m->dacts, g->grad_elems},
                                            {m->scratch, g->scratch_elems}, {m->positions, g->B * g->T},
                                            {m->dbatch, 3 * g->B * g->T}, {m->tp_buf, m->tp_buf_elems}};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
      if (bufs[i].p) fy_device_dealloc(m->dev, bufs[i].p, (size_t)(bufs[i].n > 0 ? bufs[i].n : 1) * 4);
    size_t n16 = (size_t)(g->n_param_elems > 0 ? g->n_param_elems : 1);
    if (m->cparams) fy_device_dealloc(m->dev, m->cparams, n16 * m->cparams_esize);
    if (m->cgrads) fy_device_dealloc(m->dev, m->cgrads, n16 * 2);
  }
  free(m->host_positions);
  free(m->patterns);
  fy_stream_free(m->staging);
  fy_chunk_layout_free(m->layout);
  fy_graph_free(m->graph);
  free(m);
}

// ---- initialisation ----

static uint64_t fnv1a(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  return h;
}

// Elements [a, b) of a stream of N(0, std) values: element i is one of the pair that draws 2 (i/2)
// and 2 (i/2) + 1 give (splitmix64 steps its state by a constant, so any pair is reached at once).
static void fill_normal(float *x, int64_t a, int64_t b, float std, uint64_t state) {
  state += (uint64_t)(a / 2 * 2) * 0x9e3779b97f4a7c15ull;
  for (int64_t i = a / 2 * 2; i < b; i += 2) {
    // Box-Muller on two uniforms in (0, 1].
    double u1 = ((fy_splitmix64(&state) >> 11) + 1.0) * 0x1.0p-53;
    double u2 = (fy_splitmix64(&state) >> 11) * 0x1.0p-53;
    double r = sqrt(-2.0 * log(u1)), s, c;
    sincos(2 * M_PI * u2, &s, &c);  // (glibc's sin and cos, bit for bit, at about the price of one)
    if (i >= a) x[i - a] = (float)(std * r * c);
    if (i + 1 < b) x[i + 1 - a] = (float)(std * r * s);
  }
}

// Elements [a, b) of parameter p's initial values into x.
static void init_param(const struct fy_model *m, const struct fy_param *p, uint64_t seed, int64_t a, int64_t b,
                       float *x) {
  const char *suffix = strrchr(p->name, '.');
  bool is_norm = strstr(p->name, "layer_norm") != NULL;
  if (p->rank == 2) {
    fill_normal(x, a, b, m->cfg.init_std, seed ^ fnv1a(p->name));
    if (p->padding_idx >= 0) {  // the padding row is 0
      int64_t r0 = p->padding_idx * p->shape[1], r1 = r0 + p->shape[1];
      for (int64_t k = r0 > a ? r0 : a; k < (r1 < b ? r1 : b); k++) x[k - a] = 0.0f;
    }
  } else {
    float v = is_norm && suffix && strcmp(suffix, ".weight") == 0 ? 1.0f : 0.0f;
    for (int64_t k = a; k < b; k++) x[k - a] = v;
  }
}

// Every weight (fp32, on the host) to a device the host cannot address: into params, or with
// weights16 into cparams in the compute dtype (the conversion on the host, then current).
static fy_status upload_weights(struct fy_model *m, const float *host) {
  const size_t n = (size_t)m->graph->n_param_elems;
  if (!m->weights16) return fy_model_upload(m, m->params, host, n * 4);
  if (!m->cparams) return fy_error_set(FY_ERR_INVALID, "16-bit weights before the compute dtype is set");
  void *w16 = malloc(n * m->cparams_esize);
  if (!w16) return fy_error_set(FY_ERR_NOMEM, "cannot stage the 16-bit weights");
  fy_convert_from_f32(w16, m->compute_dtype, host, n);
  fy_status st = fy_model_upload(m, m->cparams, w16, n * m->cparams_esize);
  free(w16);
  m->cparams_fresh = st == FY_OK;
  return st;
}

// ---- Hugging Face checkpoints ----

static const struct fy_st_tensor *find_tensor(const fy_safetensors *st, const char *name) {
  const struct fy_st_tensor *t = fy_safetensors_find(st, name);
  // Older OPT checkpoints (and OPTModel) name the decoder without the "model." prefix.
  if (!t && strncmp(name, "model.", 6) == 0) t = fy_safetensors_find(st, name + 6);
  return t;
}

// The tensor of parameter p in a model directory's files, checked against the config's shape and
// ferry's dtypes.
static fy_status param_tensor(const fy_safetensors *st, const char *dir, const struct fy_param *p,
                              const struct fy_st_tensor **out) {
  const struct fy_st_tensor *t = *out = find_tensor(st, p->name);
  if (!t) return fy_error_set(FY_ERR_NOT_FOUND, "%s: the checkpoint has no tensor %s", dir, p->name);
  bool same = t->rank == p->rank;
  for (int k = 0; same && k < p->rank; k++) same = t->shape[k] == p->shape[k];
  if (!same) {
    char want[64], got[64] = "";
    snprintf(want, sizeof want, p->rank == 2 ? "(%lld, %lld)" : "(%lld)", (long long)p->shape[0],
             (long long)p->shape[1]);
    for (int k = 0; k < t->rank; k++)
      snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", k ? ", " : "", (long long)t->shape[k]);
    return fy_error_set(FY_ERR_INVALID, "%s: tensor %s has shape (%s), the config needs %s", dir, p->name, got, want);
  }
  if (t->dtype != FY_F32 && t->dtype != FY_BF16 && t->dtype != FY_F16)
    return fy_error_set(FY_ERR_UNSUPPORTED, "%s: tensor %s has dtype %s; ferry reads f32, bf16, f16", dir, p->name,
                        fy_dtype_name(t->dtype));
  return FY_OK;
}

struct fy_model_source {
  const struct fy_model *m;
  uint64_t seed;
  fy_safetensors *st;             // NULL: OPT's initialisation
  const struct fy_st_tensor **t;  // with files: each parameter's tensor
  // Upcycling (a mixture of experts from a dense checkpoint): per parameter, the elements of the
  // dense tensor its values repeat (every expert a copy of the layer's feed-forward), or -1 for a
  // router drawn as OPT's initialisation; 0 for a parameter read as it is.
  int64_t *repeat;
};

// A mixture's parameter the dense checkpoint lacks: layers.l.block_sparse_moe.experts.fcN.x is
// E copies of layers.l.fcN.x (*dense, *repeat its elements), the gate is drawn (*repeat -1).
static fy_status upcycle_tensor(const fy_safetensors *st, const char *dir, const struct fy_opt_config *c,
                                const struct fy_param *p, const struct fy_st_tensor **dense, int64_t *repeat) {
  const char *moe = strstr(p->name, ".block_sparse_moe.");
  if (!moe || c->num_local_experts <= 0) return FY_ERR_NOT_FOUND;
  const char *what = moe + strlen(".block_sparse_moe.");
  if (strcmp(what, "gate.weight") == 0) {
    *dense = NULL;
    *repeat = -1;
    return FY_OK;
  }
  if (strncmp(what, "experts.", 8) != 0) return FY_ERR_NOT_FOUND;
  char name[FY_NAME_MAX + 16];
  snprintf(name, sizeof name, "%.*s.%s", (int)(moe - p->name), p->name, what + 8);  // layers.l.fc1.weight
  struct fy_param one = *p;  // the dense tensor's shape: one expert's
  snprintf(one.name, sizeof one.name, "%s", name);
  one.shape[0] = p->shape[0] / c->num_local_experts;
  one.numel = p->numel / c->num_local_experts;
  fy_status st2 = param_tensor(st, dir, &one, dense);
  if (st2 != FY_OK)
    return fy_error_wrap(st2, "%s has neither %s nor a dense %s to start its experts from", dir, p->name, name);
  *repeat = one.numel;
  return FY_OK;
}

fy_status fy_model_source_open(const struct fy_model *m, const char *dir, uint64_t seed,
                               struct fy_model_source **out) {
  const struct fy_graph *g = m->graph;
  struct fy_model_source *s = calloc(1, sizeof *s);
  if (!s || (dir && !(s->t = calloc((size_t)g->n_params, sizeof *s->t)))) {
    free(s);
    return fy_error_set(FY_ERR_NOMEM, "cannot allocate a weights source");
  }
  *s = (struct fy_model_source){.m = m, .seed = seed, .t = s->t};  // (repeat: allocated when upcycling)
  fy_status status = dir ? fy_safetensors_open_dir(dir, &s->st) : FY_OK;
  int upcycled = 0;
  for (int i = 0; dir && i < g->n_params && status == FY_OK; i++) {
    if (!find_tensor(s->st, g->params[i].name) && strstr(g->params[i].name, ".block_sparse_moe.")) {
      if (!s->repeat && !(s->repeat = calloc((size_t)g->n_params, sizeof *s->repeat))) {
        status = fy_error_set(FY_ERR_NOMEM, "cannot allocate a weights source");
        break;
      }
      status = upcycle_tensor(s->st, dir, &m->cfg, &g->params[i], &s->t[i], &s->repeat[i]);
      upcycled += status == FY_OK;
      if (status == FY_ERR_NOT_FOUND) status = param_tensor(s->st, dir, &g->params[i], &s->t[i]);
      continue;
    }
    status = param_tensor(s->st, dir, &g->params[i], &s->t[i]);
  }
  if (status == FY_OK && upcycled)
    fy_log_info("%s: a dense checkpoint: each mixture layer's experts start as copies of its feed-forward, its "
                "router drawn as OPT's initialisation (upcycling)", dir);
  if (status != FY_OK) {
    fy_model_source_close(s);
    return status;
  }
  *out = s;
  return FY_OK;
}

void fy_model_source_read(const struct fy_model_source *s, int i, int64_t a, int64_t b, float *dst) {
  const struct fy_param *p = &s->m->graph->params[i];
  if (!s->st) {
    init_param(s->m, p, s->seed, a, b, dst);
    return;
  }
  const struct fy_st_tensor *t = s->t[i];
  const int64_t rep = s->repeat ? s->repeat[i] : 0;
  if (rep < 0) {  // an upcycled router: drawn
    init_param(s->m, p, s->seed, a, b, dst);
    return;
  }
  // (upcycled experts: element k is the dense tensor's k mod rep, read in runs)
  for (int64_t k = a; k < b;) {
    const int64_t at = rep ? k % rep : k, n = rep && rep - at < b - k ? rep - at : b - k;
    const char *src = (const char *)t->data + (size_t)at * fy_dtype_size(t->dtype);
    fy_convert_to_f32(dst + (k - a), src, t->dtype, (size_t)n);
    fy_safetensors_done_with(src, (size_t)n * fy_dtype_size(t->dtype));
    k += n;
  }
}

void fy_model_source_close(struct fy_model_source *s) {
  if (!s) return;
  fy_safetensors_close(s->st);
  free(s->t);
  free(s->repeat);
  free(s);
}

void fy_model_source_fill(const struct fy_model_source *s, int64_t lo, int64_t hi, float *dst) {
  const struct fy_graph *g = s->m->graph;
  memset(dst, 0, (size_t)(hi - lo) * 4);
  // The parameters' parts in pieces of at most SOURCE_PIECE elements, read on every thread (a
  // piece's values depend on its positions alone: drawn, or converted from the file).
  enum { SOURCE_PIECE = 1 << 20 };
  int64_t a, b, n = 0;
  for (int i = 0; i < g->n_params; i++)
    if (fy_param_part(&g->params[i], lo, hi, &a, &b)) n += (b - a + SOURCE_PIECE - 1) / SOURCE_PIECE;
  struct piece { int i; int64_t a, b; } *pieces = malloc((size_t)(n > 0 ? n : 1) * sizeof *pieces);
  FY_ASSERT(pieces);
  n = 0;
  for (int i = 0; i < g->n_params; i++)
    if (fy_param_part(&g->params[i], lo, hi, &a, &b))
      for (int64_t k = a; k < b; k += SOURCE_PIECE)
        pieces[n++] = (struct piece){i, k, k + SOURCE_PIECE < b ? k + SOURCE_PIECE : b};
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t k = 0; k < n; k++) {
    const struct piece *q = &pieces[k];
    fy_model_source_read(s, q->i, q->a, q->b, dst + (g->params[q->i].offset + q->a - lo));
  }
  free(pieces);
}

void fy_model_init_random(struct fy_model *m, uint64_t seed) {
  const struct fy_graph *g = m->graph;
  m->cparams_fresh = false;
  // Device memory the host cannot address: initialise a host copy and upload it.
  float *host = fy_model_params_on_device(m) ? calloc((size_t)g->n_param_elems, 4) : m->params;
  FY_ASSERT(host);
  // In pieces on every thread, as an offloaded model's chunks are drawn (a parameter at a time,
  // the largest, the token embedding, took one thread a sixth of the whole).
  const struct fy_model_source opt_init = {.m = m, .seed = seed};
  fy_model_source_fill(&opt_init, 0, g->n_param_elems, host);
  if (fy_model_params_on_device(m)) {
    FY_ASSERT(upload_weights(m, host) == FY_OK);
    free(host);
    // (A model for evaluation has no AdamW state.)
    if (m->m) FY_ASSERT(dev_sync_op(m->dev, m->m, NULL, 0, (size_t)moment_elems(m) * 4) == FY_OK);
    if (m->v) FY_ASSERT(dev_sync_op(m->dev, m->v, NULL, 0, (size_t)moment_elems(m) * 4) == FY_OK);
    return;
  }
  // (All zero bytes are zero state in every format: 8-bit codes 0 with scales 0.)
  if (m->m) memset(m->m, 0, (size_t)moment_elems(m) * 4);
  if (m->v) memset(m->v, 0, (size_t)moment_elems(m) * 4);
}

fy_status fy_model_load(struct fy_model *m, const char *dir) {
  m->cparams_fresh = false;
  struct fy_model_source *src;
  FY_TRY(fy_model_source_open(m, dir, 0, &src));
  const struct fy_graph *g = m->graph;
  fy_status status = FY_OK;
  float *host = fy_model_params_on_device(m) ? calloc((size_t)g->n_param_elems, 4) : m->params;
  if (!host) status = fy_error_set(FY_ERR_NOMEM, "cannot stage the weights");
  for (int i = 0; i < g->n_params && status == FY_OK; i++)
    if (!g->params[i].absent) fy_model_source_read(src, i, 0, g->params[i].numel, host + g->params[i].offset);
  if (fy_model_params_on_device(m) && host) {
    if (status == FY_OK) status = upload_weights(m, host);
    free(host);
  }
  // A checkpoint may carry lm_head.weight even when tied; it must then equal the embedding.
  if (status == FY_OK && m->cfg.tie_word_embeddings && fy_safetensors_find(src->st, "lm_head.weight"))
    fy_log_debug("%s: lm_head.weight ignored (tied to embed_tokens)", dir);
  fy_model_source_close(src);
  return status;
}

// The parameters as safetensors tensors of dtype (names and shapes; no data yet), malloc'd.
static struct fy_st_tensor *param_tensors(const struct fy_graph *g, enum fy_dtype dtype) {
  struct fy_st_tensor *ts = calloc((size_t)g->n_params, sizeof *ts);
  for (int i = 0; ts && i < g->n_params; i++) {
    const struct fy_param *p = &g->params[i];
    ts[i] = (struct fy_st_tensor){.name = p->name, .dtype = dtype, .rank = p->rank,
                                  .shape = {p->shape[0], p->shape[1]},
                                  .nbytes = (size_t)p->numel * fy_dtype_size(dtype)};
  }
  return ts;
}

fy_status fy_model_save_open(const struct fy_model *m, const char *dir, size_t max_shard_bytes,
                             struct fy_st_writer **out) {
  const struct fy_graph *g = m->graph;
  FY_TRY(fy_mkdir_p(dir));
  struct fy_st_tensor *ts = param_tensors(g, FY_F32);
  if (!ts) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the tensor list");
  fy_status st = fy_st_writer_open_dir(dir, ts, g->n_params, max_shard_bytes, out);
  free(ts);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "saving the model to %s", dir);
}

fy_status fy_model_save_put(const struct fy_model *m, struct fy_st_writer *w, int64_t lo, int64_t hi,
                            const float *data) {
  int64_t a, b;
  for (int i = 0; i < m->graph->n_params; i++) {
    const struct fy_param *p = &m->graph->params[i];
    if (fy_param_part(p, lo, hi, &a, &b))
      FY_TRY(fy_st_writer_put(w, i, (size_t)a * 4, data + (p->offset + a - lo), (size_t)(b - a) * 4));
  }
  return FY_OK;
}

fy_status fy_model_save_commit(const struct fy_model *m, const char *dir, struct fy_st_writer *w) {
  struct fy_opt_config cfg = m->cfg;
  snprintf(cfg.torch_dtype, sizeof cfg.torch_dtype, "float32");
  fy_status st = fy_st_writer_commit(w);
  if (st == FY_OK) st = fy_opt_config_write(dir, &cfg);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "saving the model to %s", dir);
}

fy_status fy_model_save(const struct fy_model *m, const char *dir, enum fy_dtype dtype,
                        size_t max_shard_bytes) {
  const struct fy_graph *g = m->graph;
  if (m->weights16)
    return fy_error_set(FY_ERR_UNSUPPORTED, "saving a model that holds its weights in 16 bits alone (built for "
                        "evaluation on a GPU)");
  FY_TRY(fy_mkdir_p(dir));
  struct fy_st_tensor *ts = param_tensors(g, dtype);
  void *conv = NULL;
  if (!ts) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the tensor list");
  if (dtype != FY_F32) {
    conv = malloc((size_t)g->n_param_elems * 2);
    if (!conv) {
      free(ts);
      return fy_error_set(FY_ERR_NOMEM, "cannot allocate a %s copy of the weights", fy_dtype_name(dtype));
    }
  }
  float *host = m->params;
  if (fy_model_params_on_device(m)) {
    host = malloc((size_t)g->n_param_elems * 4);
    fy_status sd = host ? fy_model_download((struct fy_model *)m, host, m->params, (size_t)g->n_param_elems * 4)
                        : fy_error_set(FY_ERR_NOMEM, "cannot stage the weights");
    if (sd != FY_OK) {
      free(host);
      free(conv);
      free(ts);
      return sd;
    }
  }
  for (int i = 0; i < g->n_params; i++) {
    const struct fy_param *p = &g->params[i];
    if (dtype == FY_F32) {
      ts[i].data = host + p->offset;
    } else {
      uint16_t *d = (uint16_t *)conv + p->offset;
      fy_convert_from_f32(d, dtype, host + p->offset, (size_t)p->numel);
      ts[i].data = d;
    }
  }
  struct fy_opt_config cfg = m->cfg;
  snprintf(cfg.torch_dtype, sizeof cfg.torch_dtype, "%s",
           dtype == FY_F32 ? "float32" : dtype == FY_BF16 ? "bfloat16" : "float16");
  fy_status st = fy_safetensors_write_dir(dir, ts, g->n_params, max_shard_bytes);
  if (st == FY_OK) st = fy_opt_config_write(dir, &cfg);
  free(conv);
  free(ts);
  if (host != m->params) free(host);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "saving the model to %s", dir);
}
