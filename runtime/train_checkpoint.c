// Checkpoints of a training run: writing them (whole, chunk by chunk, or as tensor-parallel
// slices), resuming from them, the save-space check, and the weights' hash and gathers for the
// final save.
#include "runtime/trainer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <dirent.h>
#include <json-c/json.h>

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
#include "memory/tier.h"
#include "runtime/run.h"

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

uint64_t hash_params(struct fy_model *m) {
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
fy_status finish_sharded(struct run *r, const char *save, bool lead, uint64_t *hash) {
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

// The whole model's state from the tensor-parallel slices and the pipeline stages' parameters, one
// parameter at a time in the whole layout's order, for checkpoints and the final save: no rank
// holds the whole model. The ranks of a tensor-parallel group walk the same parameters (each split
// one is a gather, a collective); with pipeline stages, every stage of the pipeline walks them too,
// and a parameter of a later stage goes whole from its stage's first tensor-parallel rank to the
// first stage's (point-to-point, in the walk's order on both ends). The lead (rank 0, of the first
// stage) keeps what they give.
struct tp_walk {
  struct run *r;
  int kinds;                 // 1: the weights; 3: weights, m and v
  const float *local[3];     // this rank's slices, in its own layout (resident)
  int chunk;                 // offloaded (local NULL): the chunk of this rank's layout in cbuf (-1: none)
  float *cbuf;               // its weights, m and v (chunk_elems floats each)
  int *order;                // the whole model's parameters by offset
  int next;                  // order[next]: the first parameter not yet handed out whole
  int held;                  // the split parameter in whole[] (-1: none)
  float *whole[3], *buf;     // whole[]: the lead's copy of one parameter (a later stage's first
                             // tensor-parallel rank's, to send); buf: the gathered slices
};

enum { TAG_WALK = 1 << 21 };  // (point-to-point messages of the walk over the pipeline's stages)

// The stage whose parameter i is, when a pipeline's first stage does not hold it (-1: it does).
static int walk_sender(const struct tp_walk *t, int i) {
  const struct run *r = t->r;
  if (r->pp <= 1) return -1;
  const int s = fy_pipeline_owner(r->model->graph, r->cfg.num_hidden_layers, r->pp, i);
  return s > 0 ? s : -1;
}

static void tp_walk_free(struct tp_walk *t) {
  for (int k = 0; k < 3; k++) free(t->whole[k]);
  free(t->buf);
  free(t->cbuf);
  free(t->order);
  memset(t, 0, sizeof *t);
}

// A GPU's resident state (a pipeline stage on --device cuda) copied to the host for the walk:
// local[k] then points at the copies (weights; with kinds 3 also m and v), *own at what to free.
// Nothing elsewhere (the cpu's state is host memory; offloaded state comes chunk by chunk).
static fy_status walk_host_copies(struct run *r, int kinds, float *local[3], float **own) {
  *own = NULL;
  struct fy_model *m = r->model;
  if (r->x || !fy_model_params_on_device(m)) return FY_OK;
  const size_t n = (size_t)m->graph->n_param_elems;
  float *h = malloc(n * (size_t)kinds * 4 + 4);
  if (!h) return fy_error_set(FY_ERR_NOMEM, "cannot allocate a host copy of this rank's state (%zu floats)", n * kinds);
  const float *src[3] = {m->params, m->m, m->v};
  for (int k = 0; k < kinds; k++) {
    fy_status st = fy_model_download(m, h + (size_t)k * n, src[k], n * 4);
    if (st != FY_OK) {
      free(h);
      return st;
    }
    local[k] = h + (size_t)k * n;
  }
  *own = h;
  return FY_OK;
}

// A collective over the tensor-parallel group: every rank of it gets the buffers or none does.
// local NULL: the slices come chunk by chunk from the offloaded state (fy_offload_chunk_state_out,
// in order: parameters have the same order in every layout; a collective over the data-parallel
// group with sharding, whose other ranks call fy_offload_state_out).
static fy_status tp_walk_init(struct tp_walk *t, struct run *r, int kinds, float *const local[3], bool lead) {
  *t = (struct tp_walk){.r = r, .kinds = kinds, .held = -1, .chunk = -1};
  const struct fy_graph *g = r->whole_graph;
  int64_t most = 1;  // the largest split parameter, whole, or one that moves between stages
  for (int i = 0; i < g->n_params; i++)
    if ((r->model->graph->params[i].split_dim >= 0 || walk_sender(t, i) >= 0) && g->params[i].numel > most)
      most = g->params[i].numel;
  lead = lead || (r->pp > 1 && r->tp_rank == 0);  // (a later stage's first rank gathers what it sends)
  int64_t gathered = fy_tp_gather_floats(r->model->graph);
  bool ok = (t->order = param_order(g)) && (t->buf = malloc((size_t)(gathered > 0 ? gathered : 1) * 4));
  if (ok && !local) ok = (t->cbuf = malloc((size_t)r->model->layout->chunk_elems * 3 * 4)) != NULL;
  for (int k = 0; k < kinds; k++) {
    t->local[k] = local ? local[k] : NULL;
    if (lead && ok) ok = (t->whole[k] = malloc((size_t)most * 4)) != NULL;
  }
  float failed = ok ? 0.0f : 1.0f;
  fy_status st = r->tp > 1 ? fy_comm_all_reduce(r->tp_comm, &failed, 1, FY_COMM_F32, NULL) : FY_OK;
  if (st == FY_OK && r->pp > 1) st = fy_comm_all_reduce(r->pp_comm, &failed, 1, FY_COMM_F32, NULL);
  if (st == FY_OK && r->ep > 1) st = fy_comm_all_reduce(r->ep_comm, &failed, 1, FY_COMM_F32, NULL);
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
  const int sender = walk_sender(t, i);
  if (p->absent) {  // another pipeline stage's: the first stage's first rank receives it whole
    for (int k = 0; k < t->kinds; k++) out[k] = t->whole[k];
    if (t->r->pp_rank != 0 || t->r->tp_rank != 0 || sender < 0 || t->held == i) return FY_OK;
    for (int k = 0; k < t->kinds && st == FY_OK; k++)
      st = fy_comm_recv(t->r->pp_comm, t->whole[k], (size_t)t->r->whole_graph->params[i].numel * 4, sender, TAG_WALK);
    t->held = st == FY_OK ? i : -1;
    return st == FY_OK ? FY_OK : fy_error_wrap(st, "receiving %s from pipeline stage %d", p->name, sender);
  }
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
    fy_status s1 = fy_tp_gather_param(part, slice[k], t->r->whole_graph, i, t->whole[k], t->buf,
                                      !p->expert ? t->r->tp_comm
                                      : fy_param_split_tp(part, p) ? t->r->eptp_comm : t->r->ep_comm);
    if (st == FY_OK) st = s1;  // (the other kinds' gathers still run: the group's ranks call them all)
  }
  if (sender >= 0 && t->r->tp_rank == 0 && t->held != i) {  // a later stage's: whole to the first stage
    const size_t bytes = (size_t)t->r->whole_graph->params[i].numel * 4;
    for (int k = 0; k < t->kinds && st == FY_OK; k++) {
      struct fy_comm_req *req;
      st = fy_comm_isend(t->r->pp_comm, out[k], bytes, 0, TAG_WALK, &req);
      if (st == FY_OK) st = fy_comm_wait(t->r->pp_comm, req);
    }
    if (st != FY_OK) st = fy_error_wrap(st, "sending %s to the first pipeline stage", p->name);
  }
  if (p->split_dim >= 0 || sender >= 0) t->held = st == FY_OK ? i : -1;
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
fy_status finish_tp(struct run *r, const char *save, bool lead, uint64_t *hash) {
  if (r->x) FY_TRY(fy_offload_sync(r->x));
  if (r->dp_rank / r->ep != 0) {  // (with --ep the ranks of the first expert-parallel group gather)
    for (int c = 0; r->x && r->dp > 1 && c < r->model->layout->n_chunks; c++)
      FY_TRY(fy_offload_chunk_weights_out(r->x, c, NULL));
    return FY_OK;
  }
  const struct fy_graph *g = r->whole_graph;
  struct tp_walk t;
  float *local[3] = {r->model->params, NULL, NULL}, *own;
  FY_TRY(walk_host_copies(r, 1, local, &own));
  fy_status si = tp_walk_init(&t, r, 1, r->x ? NULL : local, lead);
  if (si != FY_OK) free(own);
  FY_TRY(si);
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
  free(own);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "gathering the weights at the end of training");
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
  if (r->dp_rank / r->ep != 0) return r->x ? fy_offload_state_out(r->x, NULL, NULL, NULL) : FY_OK;
  // A resident stage's compressed m and v: the values they read back as (fp32), which the writer
  // stores again in the run's format, as one rank's checkpoint does.
  float *decoded = NULL;
  const int64_t np = m->graph->n_param_elems;
  if (!r->x && m->state_format != FY_STATE_F32) {
    if (!(decoded = malloc((size_t)(np > 0 ? 2 * np : 1) * 4)))
      return fy_error_set(FY_ERR_NOMEM, "cannot allocate the stage's AdamW state to checkpoint it");
    fy_state_decode(m->state_format, FY_MOMENT_M, local[1] = decoded, m->m, np);
    fy_state_decode(m->state_format, FY_MOMENT_V, local[2] = decoded + np, m->v, np);
  }
  struct tp_walk t;
  float *own;
  FY_TRY(walk_host_copies(r, 3, local, &own));
  fy_status st = tp_walk_init(&t, r, 3, r->x ? NULL : local, w != NULL);
  if (st != FY_OK) {
    free(own);
    free(decoded);
    return st;
  }
  const int64_t piece = r->x ? r->model->layout->chunk_elems : TP_CKPT_PIECE;
  if (w) {
    struct fy_ckpt_meta meta;
    checkpoint_meta(o, r, &meta, steps_done, scale, scale_good);
    st = fy_ckpt_write_pieces(w, &meta, piece, tp_walk_fill, &t);
  } else {  // the writer's pieces, taking part in their gathers
    st = fy_ckpt_fill_without(r->whole_graph->n_param_elems, piece, tp_walk_fill, &t);
  }
  tp_walk_free(&t);
  free(own);
  free(decoded);
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
fy_status checkpoint(const struct fy_train_opts *o, struct run *r, struct fy_ckpt_writer *w,
                     int64_t steps_done, double scale, int64_t scale_good) {
  struct fy_model *m = r->model;
  FY_TRY(drain_updates(o, r));  // (--optimizer-lag: a checkpoint holds every update so far)
  // With chunks sharded across ranks, or tensor-parallel slices, every rank takes part in
  // gathering the state; only the writer (rank 0, w != NULL) keeps it.
  if (run_split(r)) return checkpoint_tp(r, w, o, steps_done, scale, scale_good);
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
  } else {  // (compressed state: the values it reads back as, which the writer stores again, checkpoint.h)
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
  } else if (fy_model_params_on_device(m)) {  // (a pipeline stage on a GPU: taken on the host, then up)
    const size_t n = (size_t)m->graph->n_param_elems;
    float *h = calloc(n + 1, 4);
    if (!h) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
    for (int k = 0; k < 2 && st == FY_OK; k++) {
      fy_tp_take(m->graph, h, r->whole_graph, tp_read_adam, &f.src[k]);
      st = fy_model_upload(m, k ? m->v : m->m, h, n * 4);
    }
    free(h);
  } else if (m->state_format != FY_STATE_F32) {  // (a resident stage's compressed state: read, then stored so)
    const int64_t np = m->graph->n_param_elems;
    float *buf = calloc((size_t)(np > 0 ? 2 * np : 1), 4);
    if (!buf) st = fy_error_set(FY_ERR_NOMEM, "cannot allocate the stage's AdamW state to read it");
    if (st == FY_OK) {
      fy_tp_take(m->graph, buf, r->whole_graph, tp_read_adam, &f.src[0]);
      fy_tp_take(m->graph, buf + np, r->whole_graph, tp_read_adam, &f.src[1]);
      fy_state_encode(m->state_format, FY_MOMENT_M, m->m, buf, np);
      fy_state_encode(m->state_format, FY_MOMENT_V, m->v, buf + np, np);
    }
    free(buf);
  } else {
    fy_tp_take(m->graph, m->m, r->whole_graph, tp_read_adam, &f.src[0]);
    fy_tp_take(m->graph, m->v, r->whole_graph, tp_read_adam, &f.src[1]);
  }
  fy_ckpt_adam_close(a);
  return st;
}

// Continues from a checkpoint: parameters, AdamW state, step and data position.
fy_status resume(const struct fy_train_opts *o, struct run *r, int64_t *first_step, double *scale,
                 int64_t *scale_good) {
  struct fy_ckpt_meta meta;
  fy_status st = run_split(r) ? resume_tp(o->resume, r, &meta) : resume_state(o->resume, r, &meta);
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
// rather than found at a write hours later: with --save-every, checkpoints of the whole state
// (weights, m and v: 12 bytes a parameter with fp32 state, 8 with bf16, 6.03 with 8-bit), --keep of them kept and one more while it is written (those
// already in the root count); else the final weights (4 bytes a parameter). A warning, as space
// may be freed meanwhile: a write that does not fit stops the run, the checkpoints before it kept.
void check_save_space(const struct fy_train_opts *o, double params, int64_t steps_left) {
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
  const double each = (o->save_every > 0 ? fy_ckpt_bytes_per_param(state_format(o)) : 4.0) * params,
               need = each * more;
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

double dir_bytes(const char *root) {
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
