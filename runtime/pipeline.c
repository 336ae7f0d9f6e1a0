// Pipeline stages and their 1F1B schedule (runtime/pipeline.h).
#include "runtime/pipeline.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/engine.h"
#include "runtime/ep.h"
#include "runtime/offload.h"
#include "runtime/optimizer.h"
#include "runtime/pipeline_cuda.h"

// Message tags: a stage sends activations forward and gradients backward; between two ranks with
// one tag they arrive in the order sent, which is the schedule's order on both.
enum { TAG_ACT = 1 << 20, TAG_GRAD, TAG_TIED };

struct fy_pipeline {
  struct fy_model *m;
  struct fy_offload *x;    // the offload engine running the stage's ops (fy_pipeline_set_offload), or NULL
  struct fy_comm *comm;
  int pp, stage;
  int lo, hi;              // this stage's ops
  int in_slot, out_slot;   // the activation entering op lo and the one leaving op hi - 1 (-1: none)
  int n_arenas;            // activation arenas: one per micro-batch in flight (1F1B: pp - stage)
  float **arenas;          // each the stage's span of the model's arena alone (the model's own given
                           // back: m->acts is one of these while the pipeline lives, NULL after)
  bool took_acts;          // the model's arena given back, m->acts arenas[0]
  int64_t span_lo, span_hi;  // the floats of the arena this stage's ops read and write
  struct fy_comm_req **act_sends;  // per arena: the send of its out_slot still in flight
  struct fy_comm_req *grad_send;   // the in_slot gradient's send in flight, from grad_buf
  float *grad_buf;
  bool *used;              // per parameter: an op of this stage reads it
  bool *owned;             // per parameter: this stage's (where its first use is): the norm, the sums
  bool *zero_first;        // used here, but its first gradient of a pass is written elsewhere
  int tied;                // the embedding's weight used on the first and the last stage, or -1
  float *tied_buf;
  int64_t own_lo, own_hi;  // the flat range of the owned parameters
  int max_micro;           // micro-batches a step at most (fy_pipeline_create's)
  double *aux;             // per micro-batch of the step: this stage's mixtures' balance terms (struct
                           // fy_loss's aux_sum; resident, forward_one keeps them; offloaded, the engine)
  struct fy_pipeline_gpu *gpu;  // on a GPU: its messages (runtime/pipeline_cuda.h); NULL on the cpu
};

fy_status fy_pipeline_check_layout(int pp, int tp, int world, int64_t layers) {
  if (pp < 1) return fy_error_set(FY_ERR_INVALID, "--pp %d: at least 1 stage", pp);
  if (world % (pp * tp) != 0)
    return fy_error_set(FY_ERR_INVALID, "--pp %d x --tp %d = %d ranks a pipeline does not divide the %d rank%s: the "
                        "grid is dp x pp x tp, so run a multiple of %d ranks (mpirun -np %d ferry ...)", pp, tp, pp * tp,
                        world, world == 1 ? "" : "s", pp * tp, pp * tp);
  if (pp > layers)
    return fy_error_set(FY_ERR_INVALID, "--pp %d: more pipeline stages than the model's %lld decoder layers", pp,
                        (long long)layers);
  if (layers % pp != 0)
    return fy_error_set(FY_ERR_INVALID, "--pp %d does not divide the model's %lld decoder layers (each stage takes "
                        "the same number of layers): use a divisor of %lld", pp, (long long)layers, (long long)layers);
  return FY_OK;
}

// The one slot made before op `at` and read at or after it (the residual stream between two
// layers), or -1 with the error set when there is not exactly one.
static int crossing_slot(const struct fy_graph *g, int at) {
  int found = -1;
  for (int s = 0; s < g->n_slots; s++) {
    const struct fy_slot *sl = &g->slots[s];
    if (sl->producer < 0 || sl->producer >= at || sl->last_consumer < at) continue;
    if (found >= 0) {
      fy_error_set(FY_ERR_UNSUPPORTED, "a pipeline stage starting at op %s would receive more than one activation",
                   g->ops[at].name);
      return -1;
    }
    found = s;
  }
  if (found < 0) fy_error_set(FY_ERR_INTERNAL, "no activation enters op %s", g->ops[at].name);
  return found;
}

void fy_pipeline_free(struct fy_pipeline *p) {
  if (!p) return;
  fy_pipeline_gpu_free(p->gpu);  // (its messages done first: they read and write the arenas)
  if (p->act_sends)
    for (int a = 0; a < p->n_arenas; a++) fy_comm_wait(p->comm, p->act_sends[a]);
  fy_comm_wait(p->comm, p->grad_send);
  if (p->arenas) {
    for (int a = 0; a < p->n_arenas; a++)
      if (p->arenas[a]) fy_device_dealloc(p->m->dev, p->arenas[a] + p->span_lo, (size_t)(p->span_hi - p->span_lo) * 4);
    if (p->took_acts) p->m->acts = NULL;  // (the model's own went back at creation)
  }
  free(p->arenas);
  free(p->act_sends);
  free(p->grad_buf);
  free(p->used);
  free(p->owned);
  free(p->zero_first);
  free(p->tied_buf);
  free(p->aux);
  free(p);
}

static fy_status create(struct fy_model *m, struct fy_comm *comm, struct fy_comm *nccl, int pp, int stage,
                        int max_micro, struct fy_pipeline **out) {
  *out = NULL;
  const struct fy_graph *g = m->graph;
  if ((m->device_memory && !nccl) || (!m->host && !m->grads && !g->forward_only))  // (offloaded: the engine keeps them)
    return fy_error_set(FY_ERR_UNSUPPORTED, "pipeline stages run on resident models (cpu, cuda) and offloaded (sim, "
                        "cuda --offload) for now");
  for (int i = 0; i < g->n_params; i++)  // (fy_model_opts.pp: the stage's parameters alone)
    if (!g->params[i].absent && g->params[i].offset < 0)
      return fy_error_set(FY_ERR_INTERNAL, "pipeline stage %d: parameter %s has no place", stage, g->params[i].name);
  if (fy_comm_size(comm) != pp || fy_comm_rank(comm) != stage)
    return fy_error_set(FY_ERR_INTERNAL, "the pipeline's communicator is rank %d of %d, not stage %d of %d",
                        fy_comm_rank(comm), fy_comm_size(comm), stage, pp);
  FY_TRY(fy_pipeline_check_layout(pp, 1, pp, m->cfg.num_hidden_layers));
  struct fy_pipeline *p = calloc(1, sizeof *p);
  if (!p) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  p->m = m;
  p->comm = comm;
  p->pp = pp;
  p->stage = stage;
  p->tied = -1;
  p->in_slot = p->out_slot = -1;
  fy_status st = nccl ? fy_pipeline_gpu_create(m, nccl, &p->gpu) : FY_OK;
  if (st == FY_OK) st = fy_graph_stage_ops(g, m->cfg.num_hidden_layers, pp, stage, &p->lo, &p->hi);
  if (st == FY_OK && stage > 0 && (p->in_slot = crossing_slot(g, p->lo)) < 0) st = FY_ERR_UNSUPPORTED;
  if (st == FY_OK && stage < pp - 1 && (p->out_slot = crossing_slot(g, p->hi)) < 0) st = FY_ERR_UNSUPPORTED;
  if (st != FY_OK) {
    fy_pipeline_free(p);
    return st;
  }
  // 1F1B keeps at most pp - stage micro-batches' activations on a stage.
  p->n_arenas = pp - stage < max_micro ? pp - stage : max_micro;
  if (p->n_arenas < 1) p->n_arenas = 1;
  p->arenas = calloc((size_t)p->n_arenas, sizeof *p->arenas);
  p->act_sends = calloc((size_t)p->n_arenas, sizeof *p->act_sends);
  p->used = calloc((size_t)g->n_params + 1, sizeof *p->used);
  p->owned = calloc((size_t)g->n_params + 1, sizeof *p->owned);
  p->zero_first = calloc((size_t)g->n_params + 1, sizeof *p->zero_first);
  p->max_micro = max_micro > 1 ? max_micro : 1;
  p->aux = calloc((size_t)p->max_micro, sizeof *p->aux);
  if (!p->arenas || !p->act_sends || !p->used || !p->owned || !p->zero_first || !p->aux)
    st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  // The slots this stage's ops touch lie in one span of the arena (slots are laid out in forward
  // order; with recomputation the layers' shared region is at its start): a micro-batch in flight
  // needs that span alone. Its arena is addressed as the model's is, from span_lo floats before
  // the allocation (never read or written there).
  fy_graph_ops_act_span(g, p->lo, p->hi, &p->span_lo, &p->span_hi);
  for (int a = 0; a < p->n_arenas && st == FY_OK; a++) {
    const size_t bytes = (size_t)(p->span_hi - p->span_lo) * 4;
    float *buf;
    st = fy_device_alloc(m->dev, bytes, (void **)&buf);
    if (st == FY_OK) {
      p->arenas[a] = buf - p->span_lo;
      if (p->gpu) st = fy_pipeline_gpu_zero(p->gpu, buf, bytes);
      else memset(buf, 0, bytes);
    } else {
      st = fy_error_wrap(st, "pipeline stage %d: the activations of %d micro-batches in flight", stage, p->n_arenas);
    }
  }
  // The model's own arena (the whole graph's activations) goes back: the stage's span is all it uses.
  if (st == FY_OK) {
    fy_device_dealloc(m->dev, m->acts, (size_t)(g->act_elems > 0 ? g->act_elems : 1) * 4);
    m->acts = p->arenas[0];
    p->took_acts = true;
    m->act_bytes = 4 * ((int64_t)p->n_arenas * (p->span_hi - p->span_lo) + g->grad_elems + g->scratch_elems +
                        g->B * g->T);
  }
  // Expert parallelism within the stage: the mixtures' state of each micro-batch in flight.
  if (st == FY_OK && m->ep) st = fy_ep_set_arenas(m->ep, g, p->n_arenas);
  if (st == FY_OK && p->in_slot >= 0 && !p->gpu &&  // (a GPU sends from the gradient arena: pipeline_cuda.h)
      !(p->grad_buf = malloc((size_t)fy_graph_slot_floats(g, p->in_slot) * sizeof(float))))
    st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  p->own_lo = g->n_param_elems;
  p->own_hi = 0;
  for (int i = 0; i < g->n_params && st == FY_OK; i++) {
    const struct fy_param *q = &g->params[i];
    const bool first_here = q->first_use >= p->lo && q->first_use < p->hi,
               last_here = q->last_use >= p->lo && q->last_use < p->hi;
    p->used[i] = first_here || last_here;
    if (p->used[i] == q->absent)  // (the model was made for this stage: fy_model_opts.pp)
      st = fy_error_set(FY_ERR_INTERNAL, "pipeline stage %d: parameter %s %s", stage, q->name,
                        q->absent ? "is read here but absent" : "is held but not read here");
    p->owned[i] = first_here;
    p->zero_first[i] = p->used[i] && !last_here;
    if (first_here != last_here) p->tied = i;  // (a parameter read by two stages: the tied embedding)
    if (p->owned[i]) {
      if (q->offset < p->own_lo) p->own_lo = q->offset;
      if (q->offset + q->numel > p->own_hi) p->own_hi = q->offset + q->numel;
    }
  }
  // The owned parameters lie together in the flat layout (first-use order): the data-parallel sum's one range.
  for (int i = 0; i < g->n_params && st == FY_OK; i++) {
    const struct fy_param *q = &g->params[i];
    if (!p->owned[i] && !q->absent && q->offset < p->own_hi && q->offset + q->numel > p->own_lo)
      st = fy_error_set(FY_ERR_INTERNAL, "parameter %s lies among pipeline stage %d's own", q->name, stage);
  }
  if (st == FY_OK && p->tied >= 0 && !p->gpu &&
      !(p->tied_buf = malloc((size_t)g->params[p->tied].numel * sizeof(float))))
    st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (st != FY_OK) {
    fy_pipeline_free(p);
    return st;
  }
  *out = p;
  return FY_OK;
}

fy_status fy_pipeline_create(struct fy_model *m, struct fy_comm *comm, int pp, int stage, int max_micro,
                             struct fy_pipeline **out) {
  return create(m, comm, NULL, pp, stage, max_micro, out);
}

fy_status fy_pipeline_create_gpu(struct fy_model *m, struct fy_comm *comm, struct fy_comm *nccl, int pp, int stage,
                                 int max_micro, struct fy_pipeline **out) {
  return create(m, comm, nccl, pp, stage, max_micro, out);
}

bool fy_pipeline_is_last(const struct fy_pipeline *p) { return p->stage == p->pp - 1; }

void fy_pipeline_set_offload(struct fy_pipeline *p, struct fy_offload *x) { p->x = x; }

int fy_pipeline_schedule(int pp, int stage, int n, bool *forward) {
  // 1F1B: stage s runs pp - s - 1 forwards ahead (warm-up), then one forward and one backward in
  // turn while forwards remain, then the remaining backwards (cool-down).
  const int warm = pp - stage - 1 < n ? pp - stage - 1 : n;
  int f = 0, b = 0, k = 0;
  while (f < warm) forward[k++] = true, f++;
  while (f < n) {
    forward[k++] = true, f++;
    forward[k++] = false, b++;
  }
  while (b < n) forward[k++] = false, b++;
  return k;
}

static fy_status forward_one(struct fy_pipeline *p, struct fy_batch *const *mb, int i, float loss_scale,
                             double *losses) {
  struct fy_model *m = p->m;
  const struct fy_graph *g = m->graph;
  const int a = i % p->n_arenas;
  FY_TRY(fy_comm_wait(p->comm, p->act_sends[a]));  // (long done: its micro-batch's backward has run)
  p->act_sends[a] = NULL;
  m->acts = p->arenas[a];
  if (m->ep) fy_ep_use_arena(m->ep, a);  // (the mixtures' rows kept for this micro-batch's backward)
  if (p->in_slot >= 0 && p->gpu)
    FY_TRY(fy_pipeline_gpu_recv(p->gpu, m->acts + g->slots[p->in_slot].offset,
                                (size_t)fy_graph_slot_floats(g, p->in_slot) * sizeof(float), p->stage - 1));
  else if (p->in_slot >= 0)
    FY_TRY(fy_comm_recv(p->comm, m->acts + g->slots[p->in_slot].offset,
                        (size_t)fy_graph_slot_floats(g, p->in_slot) * sizeof(float), p->stage - 1, TAG_ACT));
  struct fy_loss loss = {0};
  // (Offloaded: the out_slot computed when it returns, or on a GPU ordered before the send; its
  // loss comes after the step's passes, fy_pipeline_run.)
  if (p->x) FY_TRY(fy_offload_stage_pass(p->x, mb[i], i, true, loss_scale));
  else FY_TRY(fy_engine_forward_ops(m, mb[i], p->lo, p->hi, &loss));
  losses[i] = fy_pipeline_is_last(p) ? loss.sum : 0;
  p->aux[i] = loss.aux_sum;
  if (p->out_slot >= 0 && p->gpu)
    FY_TRY(fy_pipeline_gpu_send(p->gpu, m->acts + g->slots[p->out_slot].offset,
                                (size_t)fy_graph_slot_floats(g, p->out_slot) * sizeof(float), p->stage + 1));
  else if (p->out_slot >= 0)  // (the arena's slot stays as it is until this micro-batch's backward)
    FY_TRY(fy_comm_isend(p->comm, m->acts + g->slots[p->out_slot].offset,
                         (size_t)fy_graph_slot_floats(g, p->out_slot) * sizeof(float), p->stage + 1, TAG_ACT,
                         &p->act_sends[a]));
  return FY_OK;
}

static fy_status backward_one(struct fy_pipeline *p, struct fy_batch *const *mb, int i, float loss_scale,
                              bool accumulate) {
  struct fy_model *m = p->m;
  const struct fy_graph *g = m->graph;
  m->acts = p->arenas[i % p->n_arenas];
  if (m->ep) fy_ep_use_arena(m->ep, i % p->n_arenas);
  if (p->out_slot >= 0 && p->gpu)
    FY_TRY(fy_pipeline_gpu_recv(p->gpu, m->dacts + g->slots[p->out_slot].grad_offset,
                                (size_t)fy_graph_slot_floats(g, p->out_slot) * sizeof(float), p->stage + 1));
  else if (p->out_slot >= 0)
    FY_TRY(fy_comm_recv(p->comm, m->dacts + g->slots[p->out_slot].grad_offset,
                        (size_t)fy_graph_slot_floats(g, p->out_slot) * sizeof(float), p->stage + 1, TAG_GRAD));
  // Offloaded, the engine does what follows on its chunks: the tied embedding's part zeroed in
  // its block, the micro-batches' gradients summed as they come home.
  if (p->x) FY_TRY(fy_offload_stage_pass(p->x, mb[i], i, false, loss_scale));
  // A parameter whose first gradient of the pass is another stage's (the tied embedding on the
  // first stage): this stage's part starts from zero, summed with the other's after the passes.
  for (int k = 0; !p->x && k < g->n_params; k++) {
    if (!p->zero_first[k]) continue;
    if (!p->gpu) {
      memset(fy_model_grad(m, k), 0, (size_t)g->params[k].numel * sizeof(float));
      continue;
    }
    // (On a GPU the kernels write 16-bit compute's gradients in cgrads.)
    const bool c16 = m->cgrads && m->compute_dtype != FY_F32;
    void *at = c16 ? (void *)((char *)m->cgrads + g->params[k].offset * 2) : (void *)fy_model_grad(m, k);
    FY_TRY(fy_pipeline_gpu_zero(p->gpu, at, (size_t)g->params[k].numel * (c16 ? 2 : 4)));
  }
  if (!p->x) FY_TRY(fy_engine_backward_ops(m, mb[i], p->lo, p->hi, loss_scale));
  if (p->in_slot >= 0 && p->gpu) {  // (sent from the arena: pipeline_cuda.h says why it stays)
    FY_TRY(fy_pipeline_gpu_send(p->gpu, m->dacts + g->slots[p->in_slot].grad_offset,
                                (size_t)fy_graph_slot_floats(g, p->in_slot) * sizeof(float), p->stage - 1));
  } else if (p->in_slot >= 0) {
    FY_TRY(fy_comm_wait(p->comm, p->grad_send));
    p->grad_send = NULL;
    const int64_t n = fy_graph_slot_floats(g, p->in_slot);
    memcpy(p->grad_buf, m->dacts + g->slots[p->in_slot].grad_offset, (size_t)n * sizeof(float));
    FY_TRY(fy_comm_isend(p->comm, p->grad_buf, (size_t)n * sizeof(float), p->stage - 1, TAG_GRAD, &p->grad_send));
  }
  // Micro-batches' gradients summed apart from the backward pass, in order, as one rank sums them.
  if (accumulate && !p->x) m->kernels->grads_sum(m, i == 0);
  return FY_OK;
}

fy_status fy_pipeline_run(struct fy_pipeline *p, struct fy_batch *const *mb, int n, float loss_scale, bool accumulate,
                          double *losses) {
  bool order[2 * (n > 0 ? n : 1)];
  const int steps = fy_pipeline_schedule(p->pp, p->stage, n, order);
  int f = 0, b = 0;
  fy_status st = FY_OK;
  const int warm = p->pp - p->stage - 1 < n ? p->pp - p->stage - 1 : n;  // (the warm-up's forwards)
  for (int k = 0; k < steps && st == FY_OK; k++) {
    st = order[k] ? forward_one(p, mb, f++, loss_scale, losses) : backward_one(p, mb, b++, loss_scale, accumulate);
    if (st == FY_OK && p->gpu && order[k] && f <= warm)  // (a warm-up send: its next receive may be far)
      st = fy_pipeline_gpu_flush(p->gpu, false);
  }
  for (int a = 0; a < p->n_arenas && st == FY_OK; a++) {
    st = fy_comm_wait(p->comm, p->act_sends[a]);
    p->act_sends[a] = NULL;
  }
  if (st == FY_OK) st = fy_comm_wait(p->comm, p->grad_send);
  if (st == FY_OK) p->grad_send = NULL;
  if (st == FY_OK && p->gpu) st = fy_pipeline_gpu_flush(p->gpu, true);
  // Offloaded, the losses and balance terms (fy_pipeline_aux_sums) are read once the stage's
  // passes are computed: on a GPU the host did not wait for them.
  if (st == FY_OK && p->x) st = fy_offload_stage_losses(p->x, n, losses);
  for (int i = 0; st == FY_OK && p->x && !fy_pipeline_is_last(p) && i < n; i++) losses[i] = 0;
  p->m->acts = p->arenas[0];
  if (p->m->ep) fy_ep_use_arena(p->m->ep, 0);
  return st;
}

fy_status fy_pipeline_forward_eval(struct fy_pipeline *p, const struct fy_batch *b, double *loss_sum) {
  struct fy_model *m = p->m;
  const struct fy_graph *g = m->graph;
  // One batch at a time on the first arena: the send of the last one's activation is done before
  // this one's forward overwrites it (its receiver is already past it, one batch ahead at most).
  // On a GPU the kernels' stream waited for it after it was issued (below).
  FY_TRY(fy_comm_wait(p->comm, p->act_sends[0]));
  p->act_sends[0] = NULL;
  m->acts = p->arenas[0];
  const size_t in_bytes = p->in_slot >= 0 ? (size_t)fy_graph_slot_floats(g, p->in_slot) * sizeof(float) : 0;
  if (p->in_slot >= 0 && p->gpu)
    FY_TRY(fy_pipeline_gpu_recv(p->gpu, m->acts + g->slots[p->in_slot].offset, in_bytes, p->stage - 1));
  else if (p->in_slot >= 0)
    FY_TRY(fy_comm_recv(p->comm, m->acts + g->slots[p->in_slot].offset, in_bytes, p->stage - 1, TAG_ACT));
  struct fy_loss loss = {0};
  if (p->x) FY_TRY(fy_offload_stage_forward(p->x, b, &loss.sum));
  else FY_TRY(fy_engine_forward_eval_ops(m, b, p->lo, p->hi, &loss));
  *loss_sum = fy_pipeline_is_last(p) ? loss.sum : 0;
  if (p->out_slot < 0) return FY_OK;
  const size_t out_bytes = (size_t)fy_graph_slot_floats(g, p->out_slot) * sizeof(float);
  if (p->gpu) {
    // Issued now, not held: nothing comes back from the next stage to group it with. The kernels'
    // stream waits for it (until the next stage receives, which it does when it reaches this
    // batch), so the next forward on this arena, an evaluation's or a step's, finds it sent.
    FY_TRY(fy_pipeline_gpu_send(p->gpu, m->acts + g->slots[p->out_slot].offset, out_bytes, p->stage + 1));
    return fy_pipeline_gpu_flush(p->gpu, true);
  }
  // (in flight until the next batch, or the next step's first forward, waits for it)
  return fy_comm_isend(p->comm, m->acts + g->slots[p->out_slot].offset, out_bytes, p->stage + 1, TAG_ACT,
                       &p->act_sends[0]);
}

fy_status fy_pipeline_sum_tied(struct fy_pipeline *p) {
  if (p->tied < 0 || p->pp == 1) return FY_OK;
  const bool last = fy_pipeline_is_last(p);
  FY_ASSERT(p->stage == 0 || last);
  const int64_t n = p->m->graph->params[p->tied].numel;
  float *mine = fy_model_grad(p->m, p->tied);
  const int peer = last ? 0 : p->pp - 1;
  if (p->gpu) {  // the gradients the optimizer reads: 16-bit ones in cgrads, or the fp32 sum
    const bool b16 = fy_model_grads_16(p->m);
    void *at = b16 ? (void *)((char *)p->m->cgrads + p->m->graph->params[p->tied].offset * 2) : (void *)mine;
    return fy_pipeline_gpu_sum_tied(p->gpu, at, b16, n, peer);
  }
  struct fy_comm_req *req;
  FY_TRY(fy_comm_isend(p->comm, mine, (size_t)n * sizeof(float), peer, TAG_TIED, &req));
  fy_status st = fy_comm_recv(p->comm, p->tied_buf, (size_t)n * sizeof(float), peer, TAG_TIED);
  fy_status w = fy_comm_wait(p->comm, req);
  FY_TRY(st);
  FY_TRY(w);
  // The last stage's part (the lm_head's, which one rank writes first) plus the first's: one
  // expression on both ends, so both hold the same bits.
  const float *lm = last ? mine : p->tied_buf, *emb = last ? p->tied_buf : mine;
  for (int64_t i = 0; i < n; i++) mine[i] = lm[i] + emb[i];
  return FY_OK;
}

fy_status fy_pipeline_all_reduce_grads(struct fy_pipeline *p, struct fy_comm *dp, struct fy_comm *rep) {
  struct fy_model *m = p->m;
  if (m->graph->ep > 1 && p->gpu)  // (refused by the trainer: runtime/run.c, ep_layout)
    return fy_error_set(FY_ERR_UNSUPPORTED, "expert parallelism within pipeline stages on GPUs");
  if (p->gpu) {  // dp a nccl communicator: summed where the kernels run, in the dtype the optimizer reads
    const bool b16 = fy_model_grads_16(m);
    char *base = b16 ? (char *)m->cgrads : (char *)m->grads;
    const size_t es = b16 ? 2 : 4;
    const enum fy_reduce_dtype dt = b16 ? FY_COMM_BF16 : FY_COMM_F32;
    if (p->own_lo < p->own_hi)
      FY_TRY(m->kernels->all_reduce(m, dp, base + (size_t)p->own_lo * es, (size_t)(p->own_hi - p->own_lo), dt));
    if (p->tied >= 0 && !p->owned[p->tied])
      FY_TRY(m->kernels->all_reduce(m, dp, base + (size_t)m->graph->params[p->tied].offset * es,
                                    (size_t)m->graph->params[p->tied].numel, dt));
    return FY_OK;
  }
  // Expert parallelism within the stage (its graph holds E/ep experts of each of its mixtures):
  // the experts' gradients summed over their replicas alone (rep: the same ep_rank of the stage's
  // other groups), the dense ones over dp, as runtime/ep.c sums one rank's whole model.
  if (m->graph->ep > 1 && p->own_lo < p->own_hi)
    FY_TRY(fy_ep_all_reduce_range(m, dp, rep, p->own_lo, p->own_hi));
  else if (p->own_lo < p->own_hi)
    FY_TRY(fy_comm_all_reduce(dp, m->grads + p->own_lo, (size_t)(p->own_hi - p->own_lo), FY_COMM_F32, NULL));
  if (p->tied >= 0 && !p->owned[p->tied])  // (the last stage's copy of the tied embedding's)
    FY_TRY(fy_comm_all_reduce(dp, fy_model_grad(m, p->tied), (size_t)m->graph->params[p->tied].numel, FY_COMM_F32,
                              NULL));
  return FY_OK;
}

double fy_pipeline_grad_norm(struct fy_pipeline *p, float grad_scale) {
  // The stage's own parameters over its tp and ep groups (its experts apart only under ep, in
  // rank order), then the stages' sums.
  double mine = fy_optimizer_grad_sumsq(p->m, p->owned, p->m->graph->ep > 1), all[p->pp];
  if (fy_comm_all_gather(p->comm, &mine, all, 2, FY_COMM_F32, NULL) != FY_OK) return NAN;  // (doubles as 2 words)
  double total = 0;
  for (int k = 0; k < p->pp; k++) total += all[k];
  return sqrt(total) * fabs((double)grad_scale);
}

fy_status fy_pipeline_adamw(struct fy_pipeline *p, const struct fy_adamw *h, float lr, int64_t t, float grad_scale,
                            double norm) {
  return fy_optimizer_step_some(p->m, h, lr, t, grad_scale, norm, p->used);
}

fy_status fy_pipeline_aux_sums(struct fy_pipeline *p, int n, double *aux) {
  if (n < 1) return FY_OK;
  if (n > p->max_micro) return fy_error_set(FY_ERR_INTERNAL, "%d micro-batches of at most %d", n, p->max_micro);
  double mine[n], all[(size_t)p->pp * (size_t)n];
  for (int i = 0; i < n; i++) mine[i] = p->x ? fy_offload_aux_sum(p->x, i) : p->aux[i];
  if (p->pp > 1) FY_TRY(fy_comm_all_gather(p->comm, mine, all, (size_t)(2 * n), FY_COMM_F32, NULL));  // (doubles as 2 words)
  else memcpy(all, mine, sizeof mine);
  // Added in stage order, the layers' order: one rank adds them one layer at a time, so this is
  // one rank's sum up to the rounding of a double (far below the log's 6 digits).
  for (int i = 0; i < n; i++) {
    aux[i] = 0;
    for (int s = 0; s < p->pp; s++) aux[i] += all[(size_t)s * (size_t)n + (size_t)i];
  }
  return FY_OK;
}

fy_status fy_pipeline_share_from_last(struct fy_pipeline *p, double *x) {
  if (p->pp == 1) return FY_OK;
  return fy_comm_broadcast(p->comm, x, sizeof *x, p->pp - 1, NULL);
}

int fy_pipeline_owner(const struct fy_graph *g, int64_t layers, int pp, int i) {
  for (int s = 0; s < pp; s++) {
    int lo, hi;
    if (fy_graph_stage_ops(g, layers, pp, s, &lo, &hi) == FY_OK && g->params[i].first_use < hi) return s;
  }
  return pp - 1;
}
