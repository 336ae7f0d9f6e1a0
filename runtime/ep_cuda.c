// Expert parallelism on GPUs (runtime/ep_cuda.h).
//
// The rows on the wire, as runtime/ep.c's but padded: a source's dispatch layout has each expert's
// block rounded up to fy_moe_rows rows (zeros after its rows), expert by expert, so the blocks for
// one rank's experts are contiguous and go as one message. A rank holding experts receives them
// source by source, each source's expert by expert: block (s, e) is source s's rows for local
// expert e, computed as one product of that many rows, as one rank computes expert e for its own
// tokens; the results go back in the order they came, into the source's layout, where the combine
// kernel reads them. Each expert's gradient is its blocks' sum in source order, and the sources are
// the data-parallel ranks in order: the replicas' all-reduce's sum. A rank's own blocks are copied
// on the stream, not sent.
#include "runtime/ep_cuda.h"

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "core/device_cuda.h"
#include "ops/cuda/ops_cuda.h"

struct ep_cuda_op {
  int64_t *n;       // E: this rank's token-choices per expert (its last forward's)
  int64_t *recv_n;  // ep x E/ep: the rows each source sent to each expert held here
  void *xr, *hr;    // the blocks received (rows_cap, C) and their h (rows_cap, F), kept for backward
  int64_t rows_cap;
};

struct fy_ep_cuda {
  // The group's size and this rank's place in it. whole: the graph keeps every expert (the offload
  // engine's chunks, sharded across the data-parallel ranks, gather them all, as on sim:
  // runtime/ep.c): this rank computes experts [rank E/P, (rank + 1) E/P) of the stacked parameters
  // and writes the others' gradients as zeros, which the chunks' reduce-scatter adds.
  int P, rank, n_ops;
  bool whole;
  struct fy_comm *nccl;
  struct ep_cuda_op *ops;
  // The blocks' scratch, shared by the ops: as (rows, F), dh (rows, F), y or dy (rows, C), dx (rows, C).
  void *scratch;
  int64_t scratch_rows;
  int *ex;  // ep x E/ep: block i's local expert, i % (E/ep)
  int64_t *rows;  // 4 x ep: struct ep_rows's arrays
  size_t es;  // the compute dtype's bytes
  // Offloaded, the gradients may land over the weights in the cache's block (c->g[k] == c->w[k]):
  // the experts' backward reads copies of the local experts' w1 and w2, taken first.
  void *keep;
  size_t keep_bytes;
  // 16-bit compute: one block's gradients of one expert (w1, b1, w2, b2 in the compute dtype, each
  // block's rounded as one rank's backward rounds its micro-batch's), and, offloaded, the local
  // experts' fp32 sums of them (resident, the sums go to m->grads: fy_ep_all_reduce_grads).
  void *blockg, *sums;
  size_t blockg_bytes, sums_bytes;
};

// (F, C of the widest mixture: the scratch's row)
static void widest(const struct fy_graph *g, int64_t *F, int64_t *C) {
  *F = *C = 0;
  for (int o = 0; o < g->n_ops; o++)
    if (g->ops[o].kind == FY_OP_MOE) {
      if (g->ops[o].OC > *F) *F = g->ops[o].OC;
      if (g->ops[o].C > *C) *C = g->ops[o].C;
    }
}

fy_status fy_ep_cuda_create(struct fy_model *m, struct fy_comm *nccl, struct fy_ep_cuda **out) {
  const struct fy_graph *g = m->graph;
  const bool whole = g->ep <= 1;
  const int P = whole && nccl ? fy_comm_size(nccl) : g->ep;
  if (P < 2 || !m->ep_comm || !nccl)
    return fy_error_set(FY_ERR_INVALID, "expert parallelism on GPUs needs a group of at least 2 ranks and its "
                        "communicators");
  if (strcmp(fy_comm_kind_name(nccl), "nccl") != 0 || fy_comm_size(nccl) != P)
    return fy_error_set(FY_ERR_INVALID, "expert parallelism on GPUs: the rows go by nccl over the group's %d ranks", P);
  struct fy_ep_cuda *e = calloc(1, sizeof *e);
  if (!e || !(e->ops = calloc((size_t)g->n_ops, sizeof *e->ops))) {
    free(e);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  e->P = P;
  e->rank = whole ? fy_comm_rank(nccl) : g->ep_rank;
  e->whole = whole;
  e->n_ops = g->n_ops;
  e->nccl = nccl;
  e->es = 4;  // (the compute dtype is set after this: the first forward reads the model's, set_dtype)
  int most = 0;
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_MOE) continue;
    struct ep_cuda_op *s = &e->ops[o];
    s->n = calloc((size_t)op->experts, sizeof *s->n);
    s->recv_n = calloc((size_t)op->experts, sizeof *s->recv_n);  // (ep x E/ep = E)
    if (!s->n || !s->recv_n) {
      fy_ep_cuda_free(m, e);
      return fy_error_set(FY_ERR_NOMEM, "out of memory");
    }
    most = op->experts > most ? op->experts : most;
    if (op->experts % P != 0) {
      fy_ep_cuda_free(m, e);
      return fy_error_set(FY_ERR_INVALID, "%s: %d experts do not split over %d ranks", op->name, op->experts, P);
    }
  }
  e->ex = malloc((size_t)(most ? most : 1) * sizeof *e->ex);
  e->rows = malloc((size_t)(4 * e->P) * sizeof *e->rows);
  if (!e->ex || !e->rows) {
    fy_ep_cuda_free(m, e);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  *out = e;
  return FY_OK;
}

static void buf_free(struct fy_model *m, void **p, size_t bytes) {
  if (*p) fy_device_dealloc(m->dev, *p, bytes);
  *p = NULL;
}

void fy_ep_cuda_free(struct fy_model *m, struct fy_ep_cuda *e) {
  if (!e) return;
  int64_t F, C;
  widest(m->graph, &F, &C);
  for (int o = 0; o < e->n_ops; o++) {
    struct ep_cuda_op *s = &e->ops[o];
    const struct fy_op *op = &m->graph->ops[o];
    free(s->n);
    free(s->recv_n);
    buf_free(m, &s->xr, (size_t)(s->rows_cap * op->C) * e->es);
    buf_free(m, &s->hr, (size_t)(s->rows_cap * op->OC) * e->es);
  }
  buf_free(m, &e->scratch, (size_t)(e->scratch_rows * 2 * (F + C)) * e->es);
  buf_free(m, &e->keep, e->keep_bytes);
  buf_free(m, &e->blockg, e->blockg_bytes);
  buf_free(m, &e->sums, e->sums_bytes);
  free(e->ex);
  free(e->rows);
  free(e->ops);
  free(e);
}

// Room for `rows` rows: op o's blocks and the scratch, grown (after the stream has finished with
// the old ones) when a step's routing sends this rank more rows than it has had.
static fy_status ensure_rows(struct fy_model *m, struct fy_ep_cuda *e, int o, int64_t rows, cudaStream_t st) {
  struct ep_cuda_op *s = &e->ops[o];
  const struct fy_op *op = &m->graph->ops[o];
  int64_t F, C;
  widest(m->graph, &F, &C);
  if (rows <= s->rows_cap && rows <= e->scratch_rows) return FY_OK;
  if (cudaStreamSynchronize(st) != cudaSuccess)
    return fy_error_set(FY_ERR_INTERNAL, "cuda: waiting for the kernels: %s", cudaGetErrorString(cudaGetLastError()));
  const int64_t want = rows + rows / 4;  // (some room: the counts change from step to step)
  if (rows > s->rows_cap) {
    buf_free(m, &s->xr, (size_t)(s->rows_cap * op->C) * e->es);
    buf_free(m, &s->hr, (size_t)(s->rows_cap * op->OC) * e->es);
    s->rows_cap = 0;
    FY_TRY(fy_device_alloc(m->dev, (size_t)(want * op->C) * e->es, &s->xr));
    fy_status st2 = fy_device_alloc(m->dev, (size_t)(want * op->OC) * e->es, &s->hr);
    if (st2 != FY_OK) {
      buf_free(m, &s->xr, (size_t)(want * op->C) * e->es);
      return fy_error_wrap(st2, "%s: the %lld rows its experts received", op->name, (long long)rows);
    }
    s->rows_cap = want;
  }
  if (rows > e->scratch_rows) {
    buf_free(m, &e->scratch, (size_t)(e->scratch_rows * 2 * (F + C)) * e->es);
    e->scratch_rows = 0;
    fy_status st2 = fy_device_alloc(m->dev, (size_t)(want * 2 * (F + C)) * e->es, &e->scratch);
    if (st2 != FY_OK) return fy_error_wrap(st2, "%s: scratch for the %lld rows its experts received", op->name,
                                           (long long)rows);
    e->scratch_rows = want;
  }
  return FY_OK;
}

// The compute dtype's element size for the buffers: the model's is set after fy_ep_cuda_create,
// before the first forward (a change frees the buffers sized in the old one).
static void set_dtype(struct fy_model *m, struct fy_ep_cuda *e, enum fy_dtype dt, cudaStream_t st) {
  const size_t es = fy_dtype_size(dt);
  if (es == e->es) return;
  int64_t F, C;
  widest(m->graph, &F, &C);
  cudaStreamSynchronize(st);  // (before the first forward nothing is queued on them; to be safe)
  for (int o = 0; o < e->n_ops; o++) {
    struct ep_cuda_op *s = &e->ops[o];
    const struct fy_op *op = &m->graph->ops[o];
    buf_free(m, &s->xr, (size_t)(s->rows_cap * op->C) * e->es);
    buf_free(m, &s->hr, (size_t)(s->rows_cap * op->OC) * e->es);
    s->rows_cap = 0;
  }
  buf_free(m, &e->scratch, (size_t)(e->scratch_rows * 2 * (F + C)) * e->es);
  e->scratch_rows = 0;
  buf_free(m, &e->keep, e->keep_bytes);
  e->keep_bytes = 0;
  e->es = es;
}

// A device buffer of at least `bytes` (grown after the stream has finished with the old one).
static fy_status ensure_buf(struct fy_model *m, void **p, size_t *have, size_t bytes, cudaStream_t st) {
  if (bytes <= *have) return FY_OK;
  if (*p && cudaStreamSynchronize(st) != cudaSuccess)
    return fy_error_set(FY_ERR_INTERNAL, "cuda: waiting for the kernels: %s", cudaGetErrorString(cudaGetLastError()));
  buf_free(m, p, *have);
  *have = 0;
  FY_TRY(fy_device_alloc(m->dev, bytes, p));
  *have = bytes;
  return FY_OK;
}

// The rows a source sends each rank (its experts' padded blocks) and where they start in its
// dispatch layout; the rows this rank receives from each source and where they go (source-major).
// (arrays of the group's size, in struct fy_ep_cuda)
struct ep_rows {
  int64_t *send, *soff, *recv, *roff, rows_in;
};

static void rows_of(const struct ep_cuda_op *s, int P, int El, struct ep_rows *r) {
  int64_t so = 0, ro = 0;
  for (int p = 0; p < P; p++) {
    r->send[p] = r->recv[p] = 0;
    for (int e = 0; e < El; e++) {
      r->send[p] += fy_moe_rows(s->n[p * El + e]);
      r->recv[p] += fy_moe_rows(s->recv_n[p * El + e]);
    }
    r->soff[p] = so, r->roff[p] = ro;
    so += r->send[p], ro += r->recv[p];
  }
  r->rows_in = ro;
}

// The all-to-all: block p of `from` (rows fo[p].., fn[p] of them) to rank p, which receives it as
// this rank's block of `to` (to[ro[p]..], tn[p] rows): one NCCL group of sends and receives on the
// stream, this rank's own block a copy on it.
static fy_status all_to_all(struct fy_ep_cuda *e, const void *from, const int64_t *fo, const int64_t *fn, void *to,
                            const int64_t *to_off, const int64_t *tn, size_t row_bytes, fy_stream *s) {
  struct fy_comm_p2p msgs[2 * e->P];
  int n = 0;
  for (int p = 0; p < e->P; p++) {
    char *src = (char *)from + (size_t)fo[p] * row_bytes, *dst = (char *)to + (size_t)to_off[p] * row_bytes;
    if (p == e->rank) {
      if (fn[p] && cudaMemcpyAsync(dst, src, (size_t)fn[p] * row_bytes, cudaMemcpyDeviceToDevice, fy_cuda_stream(s)) !=
                       cudaSuccess)
        return fy_error_set(FY_ERR_INTERNAL, "cuda: copying this rank's own rows: %s",
                            cudaGetErrorString(cudaGetLastError()));
      continue;
    }
    if (fn[p]) msgs[n++] = (struct fy_comm_p2p){.buf = src, .bytes = (size_t)fn[p] * row_bytes, .peer = p, .send = 1};
    if (tn[p]) msgs[n++] = (struct fy_comm_p2p){.buf = dst, .bytes = (size_t)tn[p] * row_bytes, .peer = p, .send = 0};
  }
  return n ? fy_comm_group_p2p(e->nccl, msgs, n, s) : FY_OK;
}

// This rank's experts' part of a stacked parameter (whole: experts [rank El, (rank + 1) El) of E,
// each of n elements; split: the parameter is theirs alone).
static void *local(const struct fy_ep_cuda *e, void *p, int El, int64_t n) {
  return p && e->whole ? (char *)p + (size_t)((int64_t)e->rank * El * n) * e->es : p;
}

// whole, on a backward's first write: the other ranks' experts' gradients are zeros here.
static fy_status zero_others(const struct fy_ep_cuda *e, void *g, int E, int El, int64_t n, cudaStream_t st) {
  if (!g || !e->whole) return FY_OK;
  const int64_t lo = (int64_t)e->rank * El, hi = lo + El;
  if (cudaMemsetAsync(g, 0, (size_t)(lo * n) * e->es, st) != cudaSuccess ||
      cudaMemsetAsync((char *)g + (size_t)(hi * n) * e->es, 0, (size_t)((E - hi) * n) * e->es, st) != cudaSuccess)
    return fy_error_set(FY_ERR_INTERNAL, "cuda: zeroing the other ranks' experts' gradients: %s",
                        cudaGetErrorString(cudaGetLastError()));
  return FY_OK;
}

static struct fy_moe_dims dims(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  return (struct fy_moe_dims){.BT = a->BT, .C = op->C, .F = op->OC, .E = op->experts, .K = op->top_k,
                              .gelu = op->gelu, .bf16 = a->m->compute_dtype == FY_BF16};
}

// The source's results in the op's aux slot (fy_cuda_moe_forward's layout: h (cap,F) then y (cap,C)).
static void *source_y(const struct fy_op_args *a, const struct fy_moe_dims *d, size_t es) {
  return (char *)fy_engine_act(a->m, a->op->aux[1]) + (size_t)(fy_moe_rows_cap(d->BT, d->E, d->K) * d->F) * es;
}

fy_status fy_ep_cuda_moe_forward(struct fy_ep_cuda *e, const struct fy_op_args *a, const struct fy_ep_cuda_env *env,
                                 double *balance) {
  struct fy_model *m = a->m;
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  struct ep_cuda_op *s = &e->ops[c->op];
  const struct fy_moe_dims d = dims(a);
  const enum fy_dtype dt = m->compute_dtype;
  const int P = e->P, El = op->experts / P, b = op->has_bias;
  const cudaStream_t st = fy_cuda_stream(env->launch);
  set_dtype(m, e, dt, st);
  const size_t es = e->es;
  if (c->batch->mask)
    return fy_error_set(FY_ERR_UNSUPPORTED, "--ep with a padded batch (an attention mask): not supported yet (one "
                        "rank routes its padding to no expert)");
  float *route = fy_engine_act(m, op->aux[0]);
  FY_TRY(fy_cuda_moe_ep_route(route, balance, a->in0, c->w[0], dt, &d, env->work, env->pinned, st));  // (waits)
  const int *hc = env->pinned;
  for (int k = 0; k < op->experts; k++) s->n[k] = hc[k];
  // The counts first: each rank learns how many rows each source sends each of its experts (a
  // host all-to-all; the forward waited for the stream to bring its own down).
  FY_TRY(fy_comm_all_to_all(m->ep_comm, s->n, s->recv_n, (size_t)El));
  struct ep_rows r = {e->rows, e->rows + P, e->rows + 2 * P, e->rows + 3 * P, 0};
  rows_of(s, P, El, &r);
  FY_TRY(ensure_rows(m, e, c->op, r.rows_in, st));
  void *xs, *dy, *dx;
  fy_cuda_moe_ep_buffers(&d, dt, env->work, &xs, &dy, &dx);
  char *as = e->scratch, *yr = as + (size_t)(2 * e->scratch_rows * d.F) * es;
  FY_TRY(all_to_all(e, xs, r.soff, r.send, s->xr, r.roff, r.recv, (size_t)d.C * es, env->launch));
  for (int i = 0; i < P * El; i++) e->ex[i] = i % El;
  const int64_t F = d.F, C = d.C;
  FY_TRY(fy_cuda_moe_ep_experts_forward(env->blas, yr, s->hr, as, s->xr, e->ex, s->recv_n, P * El,
                                        local(e, c->w[1], El, F * C), b ? local(e, c->w[2], El, F) : NULL,
                                        local(e, c->w[2 + b], El, C * F), b ? local(e, c->w[4], El, C) : NULL, dt, &d,
                                        st));
  void *ys = source_y(a, &d, es);
  FY_TRY(all_to_all(e, yr, r.roff, r.recv, ys, r.soff, r.send, (size_t)d.C * es, env->launch));  // (back the same way)
  return fy_cuda_moe_ep_combine(a->out, ys, route, dt, &d, st);
}

// 16-bit compute: the local experts' backward block by block. Each block's weight gradients are one
// product of its rows rounded to the compute dtype, as one rank's backward rounds its micro-batch's
// gradient of that expert, and the blocks add in fp32 in source order: 0 + g_0 + g_1 .., as one
// rank accumulating adds its micro-batches' rounded gradients (grads_sum) and the replicas' fp32
// sum adds theirs (fy_ep_all_reduce_grads). Resident, the sums are the experts' gradients in
// m->grads (the fp32 buffer at the 16-bit one's offsets; their rounding goes to cgrads too, which
// an accumulating step's grads_sum reads); offloaded, they are rounded into the chunk's block,
// whose reduce-scatter sums the ranks' gradients in 16 bits as it sums the dense ones.
static fy_status experts_backward_16(struct fy_ep_cuda *e, const struct fy_op_args *a,
                                     const struct fy_ep_cuda_env *env, char *dxr, char *as, char *dh,
                                     const char *dyr, const void *w1, const void *w2, const struct fy_moe_dims *d,
                                     cudaStream_t st) {
  struct fy_model *m = a->m;
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  const struct ep_cuda_op *s = &e->ops[c->op];
  const enum fy_dtype dt = m->compute_dtype;
  const int P = e->P, El = op->experts / P, b = op->has_bias;
  const int64_t F = d->F, C = d->C;
  const size_t es = e->es;
  const int64_t n[4] = {F * C, b ? F : 0, C * F, b ? C : 0};  // w1, b1, w2, b2: one expert's elements
  void *gl[4] = {local(e, c->g[1], El, n[0]), b ? local(e, c->g[2], El, n[1]) : NULL, local(e, c->g[2 + b], El, n[2]),
                 b ? local(e, c->g[4], El, n[3]) : NULL};
  const int64_t one = n[0] + n[1] + n[2] + n[3];
  FY_TRY(ensure_buf(m, &e->blockg, &e->blockg_bytes, (size_t)one * es, st));
  float *acc[4];
  void *bg[4];
  int64_t at = 0;
  if (!e->whole && !m->cgrads)
    return fy_error_set(FY_ERR_INTERNAL, "--ep on GPUs in 16-bit compute: the model has no 16-bit gradients");
  if (e->whole) FY_TRY(ensure_buf(m, &e->sums, &e->sums_bytes, (size_t)(El * one) * 4, st));
  for (int k = 0; k < 4; k++) {
    bg[k] = (char *)e->blockg + (size_t)at * es;
    acc[k] = !gl[k]   ? NULL
             : e->whole ? (float *)e->sums + El * at
                        : m->grads + ((const uint16_t *)gl[k] - (const uint16_t *)m->cgrads);
    at += n[k];
  }
  const bool first = a->first[1];
  if (e->whole && !first)  // (a sum already in the block: it goes on from there)
    for (int k = 0; k < 4; k++)
      if (gl[k]) FY_TRY(fy_cuda_accumulate(acc[k], gl[k], dt, El * n[k], true, st));
  bool written[El];
  memset(written, 0, sizeof written);
  static const int zero = 0;  // (each block alone: its expert's weights are the pointers given)
  int64_t off = 0;
  for (int i = 0; i < P * El; i++) {
    const int64_t R = fy_moe_rows(s->recv_n[i]);
    const int x = i % El;
    if (!R) continue;
    FY_TRY(fy_cuda_moe_ep_experts_backward(env->blas, dxr + (size_t)(off * C) * es, bg[0], bg[1], bg[2], bg[3],
                                           as + (size_t)(off * F) * es, dh + (size_t)(off * F) * es,
                                           dyr + (size_t)(off * C) * es, (const char *)s->xr + (size_t)(off * C) * es,
                                           (const char *)s->hr + (size_t)(off * F) * es, &zero, &s->recv_n[i], 1, 1,
                                           (const char *)w1 + (size_t)(x * F * C) * es,
                                           (const char *)w2 + (size_t)(x * C * F) * es, false, dt, d, st));
    for (int k = 0; k < 4; k++)
      if (gl[k]) FY_TRY(fy_cuda_accumulate(acc[k] + x * n[k], bg[k], dt, n[k], first && !written[x], st));
    written[x] = true;
    off += R;
  }
  for (int x = 0; x < El; x++)  // (an expert no source sent a row to: zeros, as one rank's)
    for (int k = 0; k < 4 && first && !written[x]; k++)
      if (gl[k] && cudaMemsetAsync(acc[k] + x * n[k], 0, (size_t)n[k] * 4, st) != cudaSuccess)
        return fy_error_set(FY_ERR_INTERNAL, "cuda: zeroing an expert's gradients: %s",
                            cudaGetErrorString(cudaGetLastError()));
  for (int k = 0; k < 4; k++)
    if (gl[k]) FY_TRY(fy_cuda_convert(gl[k], dt, acc[k], FY_F32, El * n[k], st));
  return FY_OK;
}

fy_status fy_ep_cuda_moe_backward(struct fy_ep_cuda *e, const struct fy_op_args *a, const struct fy_ep_cuda_env *env,
                                  float dbalance) {
  struct fy_model *m = a->m;
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  const struct ep_cuda_op *s = &e->ops[c->op];
  const struct fy_moe_dims d = dims(a);
  const enum fy_dtype dt = m->compute_dtype;
  const int P = e->P, El = op->experts / P, b = op->has_bias;
  const cudaStream_t st = fy_cuda_stream(env->launch);
  const size_t es = e->es;
  const float *route = fy_engine_act(m, op->aux[0]);
  struct ep_rows r = {e->rows, e->rows + P, e->rows + 2 * P, e->rows + 3 * P, 0};
  rows_of(s, P, El, &r);  // (the forward's counts: the blocks it kept)
  void *xs, *dy, *dx;
  fy_cuda_moe_ep_buffers(&d, dt, env->work, &xs, &dy, &dx);
  const size_t rf = (size_t)(e->scratch_rows * d.F) * es, rc = (size_t)(e->scratch_rows * d.C) * es;
  char *as = e->scratch, *dh = as + rf, *dyr = dh + rf, *dxr = dyr + rc;  // (the scratch's layout)
  FY_TRY(fy_cuda_moe_ep_dispatch_grad(a->dout, source_y(a, &d, es), route, dt, &d, env->work, st));
  FY_TRY(all_to_all(e, dy, r.soff, r.send, dyr, r.roff, r.recv, (size_t)d.C * es, env->launch));
  for (int i = 0; i < P * El; i++) e->ex[i] = i % El;
  const int64_t F = d.F, C = d.C;
  const void *w1 = local(e, c->w[1], El, F * C), *w2 = local(e, c->w[2 + b], El, C * F);
  if (c->g[1] == c->w[1]) {  // (offloaded: the gradients over the weights; copies of the local experts' first)
    const size_t n = (size_t)(El * F * C) * es;
    if (2 * n > e->keep_bytes) {
      if (cudaStreamSynchronize(st) != cudaSuccess)
        return fy_error_set(FY_ERR_INTERNAL, "cuda: waiting for the kernels: %s",
                            cudaGetErrorString(cudaGetLastError()));
      buf_free(m, &e->keep, e->keep_bytes);
      e->keep_bytes = 0;
      FY_TRY(fy_device_alloc(m->dev, 2 * n, &e->keep));
      e->keep_bytes = 2 * n;
    }
    if (cudaMemcpyAsync(e->keep, w1, n, cudaMemcpyDeviceToDevice, st) != cudaSuccess ||
        cudaMemcpyAsync((char *)e->keep + n, w2, n, cudaMemcpyDeviceToDevice, st) != cudaSuccess)
      return fy_error_set(FY_ERR_INTERNAL, "cuda: keeping the experts' weights: %s",
                          cudaGetErrorString(cudaGetLastError()));
    w1 = e->keep, w2 = (char *)e->keep + n;
  }
  if (a->first[1]) {
    FY_TRY(zero_others(e, c->g[1], d.E, El, F * C, st));
    FY_TRY(zero_others(e, b ? c->g[2] : NULL, d.E, El, F, st));
    FY_TRY(zero_others(e, c->g[2 + b], d.E, El, C * F, st));
    FY_TRY(zero_others(e, b ? c->g[4] : NULL, d.E, El, C, st));
  }
  if (es != 4)
    FY_TRY(experts_backward_16(e, a, env, dxr, as, dh, dyr, w1, w2, &d, st));
  else
    FY_TRY(fy_cuda_moe_ep_experts_backward(env->blas, dxr, local(e, c->g[1], El, F * C),
                                           b ? local(e, c->g[2], El, F) : NULL, local(e, c->g[2 + b], El, C * F),
                                           b ? local(e, c->g[4], El, C) : NULL, as, dh, dyr, s->xr, s->hr, e->ex,
                                           s->recv_n, P * El, El, w1, w2, !a->first[1], dt, &d, st));
  FY_TRY(all_to_all(e, dxr, r.roff, r.recv, dx, r.soff, r.send, (size_t)d.C * es, env->launch));
  return fy_cuda_moe_ep_route_backward(env->blas, fy_engine_dinput(m, op, 0), c->g[0], a->in0, route, c->w[0],
                                       dbalance, !a->first[0], dt, &d, env->work, st);
}
