// Expert parallelism: a mixture's rows to their experts' ranks and back (runtime/ep.h).
//
// The order of rows on the wire: a source sends its rows in its dispatch order (expert by expert,
// so the rows for one rank are contiguous, its experts in order); a rank holding experts receives
// them source by source, each source's expert by expert: block (s, e) is source s's rows for local
// expert e. It computes the blocks in that order and sends each source's results back in the
// order they came. Each expert's gradient is its blocks' sum in source order, and the source ranks
// are the data-parallel ranks in order, so the sum is the replicated run's all-reduce's.
#include "runtime/ep.h"

#include <stdlib.h>
#include <string.h>

#include "ops/ops.h"

struct ep_op {  // what a mixture op's forward leaves for its backward
  int64_t *n;       // E: this rank's token-choices per expert
  int64_t *recv_n;  // ep x E/ep: the rows each source sent to each expert held here
  float *xpad, *hpad;
  int64_t pad_cap;  // rows xpad and hpad hold
};

struct fy_ep {
  // The group's size and this rank's place in it. whole: the graph keeps every expert (the offload
  // engine's chunks, sharded across the data-parallel ranks like the dense weights, gather them all):
  // this rank computes experts [rank E/P, (rank + 1) E/P) of the stacked parameters and writes the
  // others' gradients as zeros, so the chunks' reduce-scatter sums each expert's gradient from the
  // rank that computed it (x + 0 = x: the bits of the split graph's).
  int P, rank;
  bool whole;
  // whole, and the others' experts' gradients are never read (the offload engine's write-back sends
  // each rank's own experts' alone: fy_ep_others_unread): no zeros written for them.
  bool others_unread;
  int n_ops;
  // n_sets x n_ops: a pipeline stage keeps one set a micro-batch in flight (its activations'
  // arena: 1F1B runs later micro-batches' forwards before an earlier one's backward), set the one
  // in use (fy_ep_use_arena); 1 set otherwise.
  int n_sets, set;
  struct ep_op *ops;
  // The flat gradient buffer as runs of experts' or dense elements (fy_ep_all_reduce_grads);
  // padding between parameters goes with the run before it.
  int n_runs;
  struct ep_run { int64_t lo, hi; bool expert; } *runs;
};

static int by_offset(const void *a, const void *b) {
  const struct fy_param *x = *(const struct fy_param *const *)a, *y = *(const struct fy_param *const *)b;
  return (x->offset > y->offset) - (x->offset < y->offset);
}

// Cuts [0, n_param_elems) into runs where the parameters change between experts and dense.
static fy_status make_runs(const struct fy_graph *g, struct fy_ep *ep) {
  const struct fy_param **p = malloc((size_t)(g->n_params + 1) * sizeof *p);
  ep->runs = malloc((size_t)(g->n_params + 1) * sizeof *ep->runs);
  if (!p || !ep->runs) {
    free(p);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  int n = 0;
  for (int i = 0; i < g->n_params; i++)
    if (!g->params[i].absent) p[n++] = &g->params[i];
  qsort(p, (size_t)n, sizeof *p, by_offset);
  ep->n_runs = 0;
  for (int i = 0; i < n; i++) {
    struct ep_run *last = ep->n_runs ? &ep->runs[ep->n_runs - 1] : NULL;
    if (last && last->expert == p[i]->expert) continue;
    if (last) last->hi = p[i]->offset;
    const int64_t lo = last ? p[i]->offset : 0;
    ep->runs[ep->n_runs++] = (struct ep_run){.lo = lo, .expert = p[i]->expert};
  }
  if (ep->n_runs) ep->runs[ep->n_runs - 1].hi = g->n_param_elems;
  free(p);
  return FY_OK;
}

fy_status fy_ep_create(struct fy_model *m, struct fy_ep **out) {
  const struct fy_graph *g = m->graph;
  struct fy_ep *ep = calloc(1, sizeof *ep);
  if (!ep || !(ep->ops = calloc((size_t)g->n_ops, sizeof *ep->ops))) {
    free(ep);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  ep->n_ops = g->n_ops;
  ep->n_sets = 1;
  ep->whole = g->ep <= 1;
  ep->P = ep->whole ? (m->ep_comm ? fy_comm_size(m->ep_comm) : 1) : g->ep;
  ep->rank = ep->whole ? (m->ep_comm ? fy_comm_rank(m->ep_comm) : 0) : g->ep_rank;
  if (ep->P < 2) {
    fy_ep_free(ep);
    return fy_error_set(FY_ERR_INVALID, "expert parallelism needs a group of at least 2 ranks");
  }
  fy_status st = make_runs(g, ep);
  if (st != FY_OK) {
    fy_ep_free(ep);
    return st;
  }
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_MOE) continue;
    if (op->experts % ep->P != 0) {
      fy_ep_free(ep);
      return fy_error_set(FY_ERR_INVALID, "%s: %d experts do not split over %d ranks", op->name, op->experts, ep->P);
    }
    struct ep_op *s = &ep->ops[o];
    s->n = calloc((size_t)op->experts, sizeof *s->n);
    s->recv_n = calloc((size_t)op->experts, sizeof *s->recv_n);  // (ep x E/ep = E)
    if (!s->n || !s->recv_n) {
      fy_ep_free(ep);
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    }
  }
  *out = ep;
  return FY_OK;
}

void fy_ep_free(struct fy_ep *ep) {
  if (!ep) return;
  for (int o = 0; o < ep->n_sets * ep->n_ops; o++) {
    free(ep->ops[o].n);
    free(ep->ops[o].recv_n);
    free(ep->ops[o].xpad);
    free(ep->ops[o].hpad);
  }
  free(ep->ops);
  free(ep->runs);
  free(ep);
}

fy_status fy_ep_set_arenas(struct fy_ep *ep, const struct fy_graph *g, int n) {
  if (n <= ep->n_sets) return FY_OK;
  struct ep_op *ops = realloc(ep->ops, (size_t)n * (size_t)ep->n_ops * sizeof *ops);
  if (!ops) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  ep->ops = ops;
  memset(ops + (size_t)ep->n_sets * ep->n_ops, 0, (size_t)(n - ep->n_sets) * (size_t)ep->n_ops * sizeof *ops);
  const int from = ep->n_sets;
  ep->n_sets = n;  // (what is allocated below is freed with the rest)
  for (int k = from; k < n; k++)
    for (int o = 0; o < ep->n_ops; o++) {
      if (g->ops[o].kind != FY_OP_MOE) continue;
      struct ep_op *s = &ops[k * ep->n_ops + o];
      s->n = calloc((size_t)g->ops[o].experts, sizeof *s->n);
      s->recv_n = calloc((size_t)g->ops[o].experts, sizeof *s->recv_n);
      if (!s->n || !s->recv_n) return fy_error_set(FY_ERR_NOMEM, "out of memory");
    }
  return FY_OK;
}

void fy_ep_use_arena(struct fy_ep *ep, int a) { ep->set = a < ep->n_sets ? a : 0; }

void fy_ep_others_unread(struct fy_ep *ep) { ep->others_unread = ep->whole; }

// Tensor parallelism within the expert-parallel ranks (--ep with --tp): the sums over the
// tensor-parallel group, in fp32, as a tensor-parallel mixture's (runtime/engine.c).
static fy_status tp_sum(void *ctx, float *buf, int64_t n) {
  struct fy_model *m = ctx;
  return m->kernels->all_reduce ? m->kernels->all_reduce(m, m->tp_comm, buf, (size_t)n, FY_COMM_F32)
                                : fy_comm_all_reduce(m->tp_comm, buf, (size_t)n, FY_COMM_F32, NULL);
}

static struct fy_moe_dims dims(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  // 16-bit numerics: the whole op's products, and each source's part of an expert's gradients
  // rounded as its own backward would round them before the sources add (the engine leaves the
  // experts' sums as they are: fy_op_call_backward), so the sum is 1 rank's over its micro-batches.
  // With --tp the experts held here are this rank's tp slices of them (F is its share, op->OC):
  // the rows they get are the same on each rank of the tp group (its ranks route the same tokens
  // alike and send them to the same ep ranks of their own tp_rank), and their partial outputs and
  // input gradients are summed over tp as a tensor-parallel mixture's (ops/ops.h, tp_sum).
  const bool tp = a->m->tp_comm && fy_comm_size(a->m->tp_comm) > 1;
  return (struct fy_moe_dims){.BT = a->BT, .C = op->C, .F = op->OC, .E = op->experts, .K = op->top_k,
                              .gelu = op->gelu, .bf16 = a->m->compute_dtype == FY_BF16,
                              .block_grads = a->m->compute_dtype, .tp_sum = tp ? tp_sum : NULL, .tp_ctx = a->m};
}

// This rank's experts' part of a stacked parameter (whole: experts [e0, e0 + El) of E, each of n
// elements; split: the parameter is theirs alone).
static float *local(const struct fy_ep *ep, float *p, int El, int64_t n) {
  return p && ep->whole ? p + (int64_t)ep->rank * El * n : p;
}

// whole, on a backward's first write: the other ranks' experts' gradients are zeros here (they add
// nothing to the sum over the data-parallel ranks).
static void zero_others(const struct fy_ep *ep, float *g, int E, int El, int64_t n) {
  if (!g || !ep->whole || ep->others_unread) return;
  memset(g, 0, (size_t)((int64_t)ep->rank * El * n) * 4);
  const int64_t hi = (int64_t)(ep->rank + 1) * El;
  memset(g + hi * n, 0, (size_t)((E - hi) * n) * 4);
}

// The floats sent to and received from each rank of the group, from the row counts.
static void counts(const struct ep_op *s, int P, int El, int64_t C, int64_t *send, int64_t *recv, int64_t *rows_in) {
  *rows_in = 0;
  for (int p = 0; p < P; p++) {
    send[p] = recv[p] = 0;
    for (int e = 0; e < El; e++) send[p] += s->n[p * El + e], recv[p] += s->recv_n[p * El + e];
    *rows_in += recv[p];
    send[p] *= C, recv[p] *= C;
  }
}

// The blocks held here: source-major, then local expert (ex[i] = i % El, cnt[i] = recv_n[i]).
static int *block_experts(int P, int El) {
  int *ex = malloc((size_t)(P * El) * sizeof *ex);
  for (int i = 0; ex && i < P * El; i++) ex[i] = i % El;
  return ex;
}

fy_status fy_ep_moe_forward(const struct fy_op_args *a, double *balance) {
  if (a->c->batch->mask)  // (one rank's kernels route padding to no expert; the pieces route every row)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--ep with a padded batch (an attention mask): not supported yet (one "
                        "rank routes its padding to no expert)");
  struct fy_model *m = a->m;
  const struct fy_ep *ep = m->ep;
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  struct ep_op *s = &m->ep->ops[m->ep->set * m->ep->n_ops + a->c->op];
  const struct fy_moe_dims d = dims(a);
  const int P = m->ep->P, El = op->experts / P, b = op->has_bias;
  const int64_t C = d.C, F = d.F, BTK = d.BT * d.K;
  float *route = fy_engine_act(m, op->aux[0]), *ys = fy_engine_act(m, op->aux[1]);  // (BTK*C <= the slot's)
  FY_TRY(fy_moe_route_rows(route, s->n, balance, a->in0, c->w[0], &d));
  // The counts first: each rank learns how many rows each source sends each of its experts.
  FY_TRY(fy_comm_all_to_all(m->ep_comm, s->n, s->recv_n, (size_t)El));
  int64_t send[P], recv[P], rows_in;
  counts(s, P, El, C, send, recv, &rows_in);
  const int64_t pad = fy_moe_blocks_rows(s->recv_n, P * El);
  if (pad > s->pad_cap) {
    free(s->xpad);
    free(s->hpad);
    s->xpad = malloc((size_t)(pad * C) * 4);
    s->hpad = malloc((size_t)(pad * d.F) * 4);
    s->pad_cap = s->xpad && s->hpad ? pad : 0;
    if (!s->pad_cap) return fy_error_set(FY_ERR_NOMEM, "%s: cannot keep %lld rows", op->name, (long long)pad);
  }
  float *xs = malloc((size_t)((BTK + 2 * rows_in) * C) * 4 + 4);
  int *ex = block_experts(P, El);
  fy_status st = xs && ex ? FY_OK : fy_error_set(FY_ERR_NOMEM, "%s: cannot allocate %lld rows", op->name,
                                                 (long long)(BTK + 2 * rows_in));
  float *xr = xs + BTK * C, *yr = xr + rows_in * C;
  if (st == FY_OK) {
    fy_moe_dispatch(xs, a->in0, route, &d);
    st = fy_comm_all_to_all_v(m->ep_comm, xs, send, xr, recv);
  }
  // (with --tp fc2's bias from the group's rank 0 alone: it is in the outputs' sum once)
  const bool b2 = b && (!d.tp_sum || a->g->tp_rank == 0);
  if (st == FY_OK)
    st = fy_moe_experts_forward(yr, s->xpad, s->hpad, xr, ex, s->recv_n, P * El, local(ep, c->w[1], El, F * C),
                                b ? local(ep, c->w[2], El, F) : NULL, local(ep, c->w[2 + b], El, C * F),
                                b2 ? local(ep, c->w[4], El, C) : NULL, &d);
  if (st == FY_OK) st = fy_comm_all_to_all_v(m->ep_comm, yr, recv, ys, send);  // (the results, back the same way)
  if (st == FY_OK) fy_moe_combine(a->out, route, ys, &d);
  if (st == FY_OK && d.tp_sum) st = d.tp_sum(d.tp_ctx, a->out, d.BT * C);  // (each rank's slices: partial sums)
  free(xs);
  free(ex);
  return st;
}

fy_status fy_ep_moe_backward(const struct fy_op_args *a, float dbalance) {
  struct fy_model *m = a->m;
  const struct fy_ep *ep = m->ep;
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  const struct ep_op *s = &m->ep->ops[m->ep->set * m->ep->n_ops + a->c->op];
  const struct fy_moe_dims d = dims(a);
  const int P = m->ep->P, El = op->experts / P, b = op->has_bias;
  const int64_t C = d.C, F = d.F, BTK = d.BT * d.K;
  const float *route = fy_engine_act(m, op->aux[0]), *ys = fy_engine_act(m, op->aux[1]);
  int64_t send[P], recv[P], rows_in;
  counts(s, P, El, C, send, recv, &rows_in);
  // dy and dx in the dispatch order (BTK rows each), the weights' gradients, dy and dx as received
  float *dy = malloc((size_t)((2 * BTK + 2 * rows_in) * C + BTK) * 4 + 4);
  int *ex = block_experts(P, El);
  fy_status st = dy && ex ? FY_OK : fy_error_set(FY_ERR_NOMEM, "%s: cannot allocate the rows' gradients", op->name);
  float *dx = dy + BTK * C, *dyr = dx + BTK * C, *dxr = dyr + rows_in * C, *dw = dxr + rows_in * C;
  // Offloaded, the gradients land over the weights in the chunk's block (c->g[k] == c->w[k]): the
  // pieces read every weight before they write its gradient (the experts' products of all blocks
  // before their gradients, the router's input gradient before dgate), so they need no copies.
  const float *gate = c->w[0], *w1 = local(ep, c->w[1], El, F * C), *w2 = local(ep, c->w[2 + b], El, C * F);
  if (st == FY_OK) {
    fy_moe_combine_backward(dy, dw, a->dout, route, ys, &d);
    // (with --tp ys is this rank's part, so dw is: summed, the router's gradient is the group's)
    if (d.tp_sum) st = d.tp_sum(d.tp_ctx, dw, BTK);
    if (st == FY_OK) st = fy_comm_all_to_all_v(m->ep_comm, dy, send, dyr, recv);
  }
  if (st == FY_OK && a->first[1]) {
    zero_others(ep, c->g[1], d.E, El, F * C);
    zero_others(ep, b ? c->g[2] : NULL, d.E, El, F);
    zero_others(ep, c->g[2 + b], d.E, El, C * F);
    zero_others(ep, b ? c->g[4] : NULL, d.E, El, C);
  }
  if (st == FY_OK)
    st = fy_moe_experts_backward(dxr, local(ep, c->g[1], El, F * C), b ? local(ep, c->g[2], El, F) : NULL,
                                 local(ep, c->g[2 + b], El, C * F), b ? local(ep, c->g[4], El, C) : NULL, dyr,
                                 s->xpad, s->hpad, ex, s->recv_n, P * El, w1, w2, El, !a->first[1], &d);
  if (st == FY_OK) st = fy_comm_all_to_all_v(m->ep_comm, dxr, recv, dx, send);
  if (st == FY_OK)
    st = fy_moe_route_backward(fy_engine_dinput(m, op, 0), c->g[0], dw, dx, a->in0, route, gate, s->n, dbalance,
                               !a->first[0], &d);
  free(dy);
  free(ex);
  return st;
}

// The runs of the flat gradient buffer (make_runs), each summed over its own group (the all-reduce
// sums every element in rank order, whatever the runs: the dense ones get the replicas' bits).
// A GPU's 16-bit gradients (cgrads, fy_model_grads_16) are summed in fp32: the dense runs widened
// into m->grads first, the experts' there already (runtime/ep_cuda.c sums each expert's blocks in
// fp32, each rounded as its source's own backward rounds it), and the optimizer reads that fp32 sum
// (grads_f32), as it reads one rank's sum of its micro-batches' rounded gradients: so ep 2 gives the
// bits of 1 rank accumulating the same micro-batches (a 16-bit all-reduce would round the sum).
fy_status fy_ep_all_reduce_grads(struct fy_model *m, struct fy_comm *dp, struct fy_comm *rep) {
  return fy_ep_all_reduce_range(m, dp, rep, 0, m->graph->n_param_elems);
}

// (the runs clipped to [lo, hi): a pipeline stage's own parameters, whose runs are the whole
// buffer's there, as its graph lays out only its own parameters and the others are absent)
fy_status fy_ep_all_reduce_range(struct fy_model *m, struct fy_comm *dp, struct fy_comm *rep, int64_t lo, int64_t hi) {
  const struct fy_ep *ep = m->ep;
  fy_status st = FY_OK;
  const bool g16 = fy_model_grads_16(m);
  if (g16 && !m->kernels->chunk_add)
    return fy_error_set(FY_ERR_INTERNAL, "--ep: 16-bit gradients without the kernels to widen them");
  for (int i = 0; i < ep->n_runs && st == FY_OK; i++) {
    struct fy_comm *c = ep->runs[i].expert ? rep : dp;
    const int64_t a = ep->runs[i].lo > lo ? ep->runs[i].lo : lo, b = ep->runs[i].hi < hi ? ep->runs[i].hi : hi;
    if (a >= b) continue;
    const size_t n = (size_t)(b - a);
    if (g16 && !ep->runs[i].expert)
      st = m->kernels->chunk_add(m, m->grads + a, (const uint16_t *)m->cgrads + a, m->compute_dtype, (int64_t)n, true);
    if (st != FY_OK || !c) continue;
    // (on GPUs through the kernels' all-reduce: nccl on their stream, runtime/ep_cuda.h)
    st = m->kernels->all_reduce ? m->kernels->all_reduce(m, c, m->grads + a, n, FY_COMM_F32)
                                : fy_comm_all_reduce(c, m->grads + a, n, FY_COMM_F32, NULL);
  }
  if (g16) m->grads_f32 = true;
  return st;
}
