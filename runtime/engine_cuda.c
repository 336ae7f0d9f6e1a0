// The step engine's kernels on a cuda device: the same op calls as runtime/engine.c, dispatched to
// ops/cuda on one stream. Host reads (the loss, the gradient norm) wait for the stream.
#include "runtime/engine_cuda.h"

#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/device_cuda.h"
#include "ops/cuda/ops_cuda.h"
#include "memory/tier.h"
#include "planner/pattern.h"
#include "runtime/comm.h"
#include "runtime/engine.h"
#include "runtime/ep_cuda.h"

// A micro-batch's loss, summed on the host by a host function once its per-row losses have come
// down (in stream order).
struct loss_job {
  const float *losses;
  int64_t n;
  double *sum;
};
#define LOSS_JOBS 64  // in flight at once: a step's micro-batches, two steps deep

// What a mixture's backward needs from the host, kept from the forward that wrote its routing
// record so that the backward does not wait for the stream: the experts' token counts (sizing the
// products) and the targets not ignored (the balance term's weight). Keyed by the routing record's
// address, distinct per op and per activation arena (a pipeline stage runs other micro-batches'
// forwards between one's forward and its backward): an entry is that record's last forward.
struct moe_kept {
  const float *route;
  int64_t BT;
  int64_t targets;  // -1: unknown (that forward had no targets)
  int E;
  int *counts;      // (E)
};
#define MOE_KEPT_MAX 4096  // a bound on the entries (then all dropped: the backward waits instead)

struct cuda_ctx {
  fy_stream *stream;   // owned: the engine's own stream (the resident path)
  fy_stream *launch;   // where kernels launch: stream, or the offload engine's compute stream
  cudaStream_t st;     // launch's CUDA stream
  float *losses_pinned;  // (BT) page-locked, for the asynchronous loss read
  struct loss_job jobs[LOSS_JOBS];
  int next_job;
  struct fy_cuda_blas *blas;
  void *workspace;     // cuBLASLt's (buf_bytes[0])
  float *row;          // (C) one embedding row, kept across the padding row's update
  double *dsums, *dscratch;  // per parameter; the sums' first pass
  // (2, FY_CUDA_LN_PARTS, C) for layernorm's parameter gradients split over row ranges: without
  // it one block per 32 channels walks all B x T rows (64 blocks for OPT-1.3B's C = 2048).
  float *lnscratch;
  size_t buf_bytes[FY_CUDA_SCRATCH_BUFS];  // of workspace, row, dsums, dscratch, lnscratch (engine_buf)
  // Mixtures of experts (fy_cuda_moe_forward): the ops' workspace (sized for the largest, device
  // memory), the experts' counts brought down (page-locked) and the targets, to count those not
  // ignored (the balance term's weight, as runtime/engine.c's moe_targets); NULL without them.
  void *moe_work;
  size_t moe_work_bytes;
  void *moe_pinned;     // fy_cuda_moe_pinned_bytes of the largest E, then (B*T) int32 targets
  size_t moe_pinned_bytes;
  struct moe_kept *moe_kept;  // (n_moe_kept) the forwards' counts, for the backwards
  int n_moe_kept;
  // Expert parallelism (graph->ep > 1): the mixtures' rows to their experts' ranks and back
  // (runtime/ep_cuda.h; fy_engine_cuda_set_ep), NULL otherwise.
  struct fy_ep_cuda *ep;
  // Per op: fy_graph_fusion's verdict, a linear run with the relu or residual add after it in
  // cuBLASLt's epilogue (relu; the residual as the product's C, beta 1); that op then does nothing.
  unsigned char *fused;
};

static struct cuda_ctx *ctx_of(const struct fy_model *m) { return m->kernels_ctx; }

// --profile: each op's kernels timed alone (the stream drained before and after them), into
// m->op_seconds[kind][phase] with the CPU engine's clock; no waits otherwise.
static double profile_start(const struct fy_model *m) {
  if (!m->profile) return 0;
  cudaStreamSynchronize(ctx_of(m)->st);
  return omp_get_wtime();
}
static void profile_end(struct fy_model *m, enum fy_op_kind kind, int phase, double t0) {
  if (!m->profile) return;
  cudaStreamSynchronize(ctx_of(m)->st);
  m->op_seconds[kind][phase] += omp_get_wtime() - t0;
}

static void CUDART_CB sum_losses(void *arg) {
  struct loss_job *j = arg;
  double s = 0;
  for (int64_t i = 0; i < j->n; i++) s += j->losses[i];
  *j->sum += s;
}

static fy_status zero(struct cuda_ctx *x, void *p, size_t n) {
  return cudaMemsetAsync(p, 0, n, x->st) == cudaSuccess ? FY_OK
                                                        : fy_error_set(FY_ERR_INTERNAL, "cudaMemsetAsync failed");
}

// ---- the cuda kernels of each op kind ----
// bf16 compute: activations and their gradients are bf16 at their slots' addresses (the graph's
// act16 layout: half the floats of fp32), weights and parameter gradients bf16 (runtime/model.h,
// cparams and cgrads); statistics (losses, layernorm's mean and rstd, attention's lse) stay fp32.

static fy_status embedding_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  return fy_cuda_embedding_forward(a->out, op->index == FY_INDEX_TOKENS ? a->c->batch->inputs : a->c->batch->positions,
                                   a->c->w[0], a->m->compute_dtype, a->BT, op->C, ctx_of(a->m)->st);
}

static fy_status layernorm_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const struct fy_op_call *c = a->c;
  return fy_cuda_layernorm_forward(a->out, fy_engine_act(m, op->aux[0]), fy_engine_act(m, op->aux[1]), a->in0,
                                   op->n_params ? c->w[0] : NULL, op->n_params ? c->w[1] : NULL, m->compute_dtype, a->BT,
                                   op->C, op->eps, ctx_of(m)->st);
}

static fy_status linear_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const struct fy_op_call *c = a->c;
  struct cuda_ctx *x = ctx_of(m);
  const struct fy_graph *g = a->g;
  const enum fy_dtype dt = m->compute_dtype;
  const int64_t BT = a->BT;
  const float *in0 = a->in0;
  int n_w = op->has_bias ? op->n_params / 2 : op->n_params;
  if (c->row0) in0 = (const float *)((const char *)in0 + (size_t)(c->row0 * op->C) * fy_dtype_size(dt));
  const void *bias = op->has_bias ? c->w[n_w] : NULL;
  const struct fy_op *next = &g->ops[c->op + 1];  // (when fused)
  if (op->split == FY_SPLIT_ROW) {  // a partial product: its pattern sums it, then adds the bias
    a->run->bias = (const float *)bias;
    bias = NULL;
  }
  if (x->fused[c->op] == FY_FUSED_RELU)
    return fy_cuda_linear_relu_forward(x->blas, fy_engine_act(m, next->out), in0, c->w[0], bias, dt, BT, op->C, op->OC,
                                       x->st);
  if (x->fused[c->op] == FY_FUSED_ADD)
    return fy_cuda_linear_add_forward(x->blas, fy_engine_act(m, next->out), in0, c->w[0], bias,
                                      fy_engine_act(m, next->in[next->in[0] == op->out]), dt, BT, op->C, op->OC, x->st);
  return fy_cuda_linear_forward(x->blas, a->out, in0, c->w[0], bias, dt, BT, op->C, op->OC, x->st);
}

static fy_status attention_fwd(const struct fy_op_args *a) {  // the aux slot holds the lse (flash_attention's layout)
  const struct fy_op *op = a->op;
  return fy_cuda_attention_forward(a->out, fy_engine_act(a->m, op->aux[0]), a->in0, a->c->batch->mask, a->m->compute_dtype,
                                   a->B, a->T, op->C, op->NH, op->scale, ctx_of(a->m)->st);
}

static fy_status relu_fwd(const struct fy_op_args *a) {
  const struct fy_op_call *c = a->c;
  if (c->op == 0 || ctx_of(a->m)->fused[c->op - 1] != FY_FUSED_RELU)
    return fy_cuda_relu_forward(a->out, a->in0, a->m->compute_dtype, fy_op_call_numel(c, a->op->out), ctx_of(a->m)->st);
  return FY_OK;
}

static fy_status gelu_fwd(const struct fy_op_args *a) {
  return fy_cuda_gelu_forward(a->out, a->in0, a->m->compute_dtype, fy_op_call_numel(a->c, a->op->out), ctx_of(a->m)->st);
}

static fy_status add_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  const struct fy_op_call *c = a->c;
  struct cuda_ctx *x = ctx_of(a->m);
  const enum fy_dtype dt = a->m->compute_dtype;
  uint64_t key;
  int64_t u0;
  if (fy_engine_dropout(c, op, &key, &u0))
    return fy_cuda_dropout_add_forward(a->out, a->in0, fy_engine_act(a->m, op->in[1]), dt, a->BT, op->C, key, u0,
                                       op->dropout, x->st);
  if (c->op == 0 || x->fused[c->op - 1] != FY_FUSED_ADD)
    return fy_cuda_add_forward(a->out, a->in0, fy_engine_act(a->m, op->in[1]), dt, fy_op_call_numel(c, op->out), x->st);
  return FY_OK;
}

static fy_status cross_entropy_fwd(const struct fy_op_args *a) {
  struct fy_model *m = a->m;
  struct cuda_ctx *x = ctx_of(m);
  const struct fy_op_call *c = a->c;
  const int64_t BT = a->BT;
  fy_status st = fy_cuda_crossentropy_forward(a->out, NULL, a->in0, c->batch->targets, m->compute_dtype, BT, a->op->V, x->st);
  if (st == FY_OK && c->loss_sum) {
    // The per-row losses come down and a host function sums them in stream order; the resident
    // engine then waits for the sum, the offloaded one reads it at the step's end.
    struct loss_job *j = &x->jobs[x->next_job++ % LOSS_JOBS];
    *j = (struct loss_job){.losses = x->losses_pinned, .n = BT, .sum = c->loss_sum};
    if (cudaMemcpyAsync(x->losses_pinned, a->out, (size_t)BT * 4, cudaMemcpyDeviceToHost, x->st) != cudaSuccess ||
        cudaLaunchHostFunc(x->st, sum_losses, j) != cudaSuccess ||
        (!m->host && cudaStreamSynchronize(x->st) != cudaSuccess))
      st = fy_error_set(FY_ERR_INTERNAL, "reading the losses back: %s", cudaGetErrorString(cudaGetLastError()));
  }
  return st;
}

// The element size of gradients (in the compute dtype).
static size_t grad_esize(const struct fy_model *m) { return m->compute_dtype == FY_F32 ? 4 : 2; }

static fy_status embedding_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct cuda_ctx *x = ctx_of(a->m);
  const size_t es = grad_esize(a->m);
  const struct fy_param *p = &a->g->params[op->params[0]];
  float *dtable = a->c->g[0];
  fy_status st = FY_OK;
  if (a->first[0]) st = zero(x, dtable, (size_t)p->numel * es);
  // nn.Embedding(padding_idx=...): the padding row keeps what it had before the lookup's gradient.
  char *row = p->padding_idx >= 0 ? (char *)dtable + (size_t)(p->padding_idx * op->C) * es : NULL;
  if (st == FY_OK && row && cudaMemcpyAsync(x->row, row, (size_t)op->C * es, cudaMemcpyDeviceToDevice, x->st) != cudaSuccess)
    st = fy_error_set(FY_ERR_INTERNAL, "saving the padding row");
  if (st == FY_OK)
    st = fy_cuda_embedding_backward(dtable, a->dout, op->index == FY_INDEX_TOKENS ? a->c->batch->inputs : a->c->batch->positions,
                                    a->m->compute_dtype, a->BT, op->C, op->V, x->st);
  if (st == FY_OK && row && cudaMemcpyAsync(row, x->row, (size_t)op->C * es, cudaMemcpyDeviceToDevice, x->st) != cudaSuccess)
    st = fy_error_set(FY_ERR_INTERNAL, "restoring the padding row");
  return st;
}

static fy_status layernorm_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  struct cuda_ctx *x = ctx_of(m);
  const struct fy_op_call *c = a->c;
  const enum fy_dtype dt = m->compute_dtype;
  fy_status st = FY_OK;
  float *dinp = fy_engine_dinput(m, op, 0);
  if (dinp)
    st = fy_cuda_layernorm_backward(dinp, NULL, NULL, a->dout, a->in0, op->n_params ? c->w[0] : NULL,
                                    fy_engine_act(m, op->aux[0]), fy_engine_act(m, op->aux[1]), dt, a->BT, op->C, NULL,
                                    x->st);
  if (st == FY_OK && op->n_params)
    st = fy_cuda_layernorm_backward_params(c->g[0], c->g[1], a->dout, a->in0, fy_engine_act(m, op->aux[0]),
                                           fy_engine_act(m, op->aux[1]), dt, a->BT, op->C, !a->first[0], x->lnscratch,
                                           x->st);
  return st;
}

static fy_status linear_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  struct cuda_ctx *x = ctx_of(m);
  const struct fy_op_call *c = a->c;
  const enum fy_dtype dt = m->compute_dtype;
  const int64_t BT = a->BT;
  fy_status st = FY_OK;
  int n_w = op->has_bias ? op->n_params / 2 : op->n_params;
  float *dinp = fy_engine_dinput(m, op, 0);
  if (op->split == FY_SPLIT_COL) {  // this rank's part, apart: its pattern sums it into the slot
    FY_ASSERT(BT * op->C <= m->tp_buf_elems);
    dinp = a->run->dinput_part = m->tp_buf;
    st = zero(x, dinp, (size_t)(BT * op->C) * grad_esize(m));
  }
  if (st == FY_OK && dinp)
    st = fy_cuda_linear_backward(x->blas, dinp, NULL, NULL, a->dout, a->in0, c->w[0], dt, BT, op->C, op->OC, x->st);
  if (st == FY_OK)
    st = fy_cuda_linear_backward_params(x->blas, c->g[0], op->has_bias ? c->g[n_w] : NULL, a->dout, a->in0, dt, BT, op->C,
                                        op->OC, !a->first[0], x->st);
  return st;
}

static fy_status attention_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  return fy_cuda_attention_backward(fy_engine_dinput(m, op, 0), m->scratch, a->dout, a->in0, fy_engine_act(m, op->out),
                                    fy_engine_act(m, op->aux[0]), a->c->batch->mask, m->compute_dtype, a->B, a->T, op->C,
                                    op->NH, op->scale, ctx_of(m)->st);
}

static fy_status relu_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  return fy_cuda_relu_backward(fy_engine_dinput(a->m, op, 0), a->dout, fy_engine_act(a->m, op->out), a->m->compute_dtype,
                               a->g->slots[op->out].numel, ctx_of(a->m)->st);
}

static fy_status gelu_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  return fy_cuda_gelu_backward(fy_engine_dinput(a->m, op, 0), a->dout, a->in0, a->m->compute_dtype,
                               a->g->slots[op->out].numel, ctx_of(a->m)->st);
}

static fy_status add_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const enum fy_dtype dt = m->compute_dtype;
  uint64_t key;
  int64_t u0;
  if (fy_engine_dropout(a->c, op, &key, &u0))
    return fy_cuda_dropout_add_backward(fy_engine_dinput_own(m, op, 0), fy_engine_dinput_own(m, op, 1), a->dout, dt, a->BT,
                                        op->C, key, u0, op->dropout, ctx_of(m)->st);
  return fy_cuda_add_backward(fy_engine_dinput_own(m, op, 0), fy_engine_dinput_own(m, op, 1), a->dout, dt,
                              a->g->slots[op->out].numel, ctx_of(m)->st);
}

static fy_status cross_entropy_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  return fy_cuda_crossentropy_backward(fy_engine_dact(a->m, op->in[0]), a->in0, a->c->batch->targets, NULL,
                                       a->m->compute_dtype, a->BT, op->V, a->c->loss_scale, ctx_of(a->m)->st);
}

static fy_status all_reduce_cuda(struct fy_model *m, struct fy_comm *c, void *buf, size_t n, enum fy_reduce_dtype dt);

// A tensor-parallel mixture's sums over the group (fy_moe_dims.tp_sum): device memory, fp32, by
// NCCL on the kernels' stream, as the dense tp patterns' sums.
static fy_status moe_tp_sum_cuda(void *ctx, float *buf, int64_t n) {
  struct fy_model *m = ctx;
  return all_reduce_cuda(m, m->tp_comm, buf, (size_t)n, FY_COMM_F32);
}

// A mixture of experts (ops/cuda/moe.cu): its parameters in op->params order, as runtime/engine.c's.

// The targets not ignored of the call's first BT rows (the balance term's weight, struct fy_loss):
// the batch's targets (device memory) come down in stream order; valid after the next wait.
static int32_t *moe_targets_down(const struct fy_op_args *a) {
  struct cuda_ctx *x = ctx_of(a->m);
  int32_t *t = (int32_t *)((char *)x->moe_pinned + x->moe_pinned_bytes) - a->g->B * a->g->T;
  if (cudaMemcpyAsync(t, a->c->batch->targets, (size_t)a->BT * 4, cudaMemcpyDeviceToHost, x->st) != cudaSuccess) return NULL;
  return t;
}
static int64_t moe_count(const int32_t *t, int64_t n) {
  int64_t k = 0;
  for (int64_t i = 0; i < n; i++) k += t[i] != -100;
  return k;
}

// The preamble of moe_fwd and moe_bwd: the op's dims (its padding mask the batch's), its routing
// record, and the checks.
struct moe_call {
  struct cuda_ctx *x;
  struct fy_moe_dims d;
  float *route;  // the routing record (op->aux[0])
  int b;         // 1 with biases (they sit between the weights in op->params)
};

static fy_status moe_begin(const struct fy_op_args *a, struct moe_call *mc) {
  const struct fy_op *op = a->op;
  struct cuda_ctx *x = ctx_of(a->m);
  const bool tp = a->m->tp_comm && fy_comm_size(a->m->tp_comm) > 1;  // (its experts are slices: core/opt.c)
  *mc = (struct moe_call){.x = x, .route = fy_engine_act(a->m, op->aux[0]), .b = op->has_bias,
                          .d = {.BT = a->BT, .C = op->C, .F = op->OC, .E = op->experts, .K = op->top_k,
                                .gelu = op->gelu, .bf16 = a->m->compute_dtype == FY_BF16, .mask = a->c->batch->mask,
                                .tp_sum = tp ? moe_tp_sum_cuda : NULL, .tp_ctx = a->m}};
  FY_ASSERT(x->moe_work && fy_cuda_moe_workspace_bytes(&mc->d, a->m->compute_dtype) <= x->moe_work_bytes);
  if (a->g->tp > 1 && !mc->d.tp_sum)  // (a tp graph's experts are slices: their sums need the group)
    return fy_error_set(FY_ERR_INTERNAL, "cuda moe: a tensor-parallel graph without its group's communicator");
  return FY_OK;
}

static struct moe_kept *moe_kept_find(struct cuda_ctx *x, const float *route) {
  for (int i = 0; i < x->n_moe_kept; i++)
    if (x->moe_kept[i].route == route) return &x->moe_kept[i];
  return NULL;
}

static void moe_kept_free(struct cuda_ctx *x) {
  for (int i = 0; i < x->n_moe_kept; i++) free(x->moe_kept[i].counts);
  free(x->moe_kept);
  x->moe_kept = NULL;
  x->n_moe_kept = 0;
}

// After a forward that left its counts in pinned memory: keep them (and the targets' count, -1 when
// unknown) for this routing record's backward. Out of memory only loses the entry (the backward waits).
static void moe_keep(struct cuda_ctx *x, const struct moe_call *mc, const int *counts, int64_t targets) {
  struct moe_kept *k = moe_kept_find(x, mc->route);
  if (!k) {
    if (x->n_moe_kept >= MOE_KEPT_MAX) moe_kept_free(x);
    struct moe_kept *grown = realloc(x->moe_kept, (size_t)(x->n_moe_kept + 1) * sizeof *grown);
    if (!grown) return;
    x->moe_kept = grown;
    k = &grown[x->n_moe_kept];
    *k = (struct moe_kept){.route = mc->route};
    if (!(k->counts = malloc((size_t)mc->d.E * sizeof *k->counts))) return;
    x->n_moe_kept++;
  } else if (k->E != mc->d.E) {
    int *c = realloc(k->counts, (size_t)mc->d.E * sizeof *c);
    if (!c) {
      k->BT = -1;  // (unusable)
      return;
    }
    k->counts = c;
  }
  k->BT = mc->d.BT;
  k->E = mc->d.E;
  k->targets = targets;
  memcpy(k->counts, counts, (size_t)mc->d.E * sizeof *counts);
}

static fy_status moe_fwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const struct fy_op_call *c = a->c;
  struct moe_call mc;
  FY_TRY(moe_begin(a, &mc));
  struct cuda_ctx *x = mc.x;
  const int b = mc.b;
  // The targets come down with the counts (the forward waits for them anyway): the balance term's
  // weight now, and the backward's later (moe_keep).
  int32_t *targets = NULL;
  if (c->batch->targets && !(targets = moe_targets_down(a)))
    return fy_error_set(FY_ERR_INTERNAL, "cuda moe: reading the targets: %s", cudaGetErrorString(cudaGetLastError()));
  double balance;
  const struct fy_ep_cuda_env env = {x->blas, x->moe_work, x->moe_pinned, x->launch};
  if (x->ep) FY_TRY(fy_ep_cuda_moe_forward(x->ep, a, &env, &balance));  // (experts over ranks: runtime/ep_cuda.c)
  else  // (with tensor parallelism fc2's bias goes into the group's sum once, from its rank 0)
    FY_TRY(fy_cuda_moe_forward(x->blas, a->out, mc.route, fy_engine_act(m, op->aux[1]), &balance, a->in0, c->w[0],
                               c->w[1], b ? c->w[2] : NULL, c->w[2 + b],
                               b && (!mc.d.tp_sum || a->g->tp_rank == 0) ? c->w[4] : NULL, m->compute_dtype, &mc.d,
                               x->moe_work, x->moe_pinned, x->st));
  // (fy_cuda_moe_forward waited for the stream: the targets and the counts are down)
  const int64_t ntargets = targets ? moe_count(targets, a->BT) : -1;
  if (c->aux_sum) {
    if (!targets) return fy_error_set(FY_ERR_INVALID, "cuda moe: a balance term without targets");
    *c->aux_sum += (double)op->aux_coef * balance * (double)ntargets;
  }
  moe_keep(x, &mc, (const int *)x->moe_pinned, ntargets);
  return FY_OK;
}

static fy_status moe_bwd(const struct fy_op_args *a) {
  const struct fy_op *op = a->op;
  struct fy_model *m = a->m;
  const struct fy_op_call *c = a->c;
  struct moe_call mc;
  FY_TRY(moe_begin(a, &mc));
  struct cuda_ctx *x = mc.x;
  const int b = mc.b;
  // The forward's counts and targets (no wait), else the targets brought down now (one wait).
  const struct moe_kept *k = moe_kept_find(x, mc.route);
  if (k && k->BT != a->BT) k = NULL;
  int64_t ntargets = k ? k->targets : -1;
  if (ntargets < 0) {
    int32_t *targets = moe_targets_down(a);
    if (!targets || cudaStreamSynchronize(x->st) != cudaSuccess)
      return fy_error_set(FY_ERR_INTERNAL, "cuda moe: reading the targets: %s", cudaGetErrorString(cudaGetLastError()));
    ntargets = moe_count(targets, a->BT);
  }
  // The objective's balance term is coef x balance x (the micro-batch's targets) x loss_scale.
  const float dbalance = op->aux_coef * c->loss_scale * (float)ntargets;
  if (x->ep) {
    const struct fy_ep_cuda_env env = {x->blas, x->moe_work, x->moe_pinned, x->launch};
    return fy_ep_cuda_moe_backward(x->ep, a, &env, dbalance);
  }
  return fy_cuda_moe_backward(x->blas, fy_engine_dinput(m, op, 0), c->g[0], c->g[1], b ? c->g[2] : NULL, c->g[2 + b],
                              b ? c->g[4] : NULL, a->dout, a->in0, mc.route, fy_engine_act(m, op->aux[1]), c->w[0],
                              c->w[1], c->w[2 + b], dbalance, !a->first[0], m->compute_dtype, &mc.d, x->moe_work,
                              x->moe_pinned, k ? k->counts : NULL, x->st);
}

// The offload engine's router alone (runtime/offload.c, moe_experts), the op's forward's first step.
static fy_status moe_route_cuda(struct fy_model *m, int o, const void *gate, int64_t rows) {
  const struct fy_op *op = &m->graph->ops[o];
  const struct fy_moe_dims d = {.BT = rows, .C = op->C, .F = op->OC, .E = op->experts,
                                .K = op->top_k};
  return fy_cuda_moe_route(fy_engine_act(m, op->aux[0]), fy_engine_act(m, op->in[0]), gate, m->compute_dtype, &d,
                           ctx_of(m)->st);
}

// The cuda backend's op table: a new op kind is one line here (and one in runtime/engine.c's).
static const struct fy_op_kernels cuda_ops[] = {
    [FY_OP_EMBEDDING] = {embedding_fwd, embedding_bwd},
    [FY_OP_LAYERNORM] = {layernorm_fwd, layernorm_bwd},
    [FY_OP_LINEAR] = {linear_fwd, linear_bwd},
    [FY_OP_ATTENTION] = {attention_fwd, attention_bwd},
    [FY_OP_RELU] = {relu_fwd, relu_bwd},
    [FY_OP_ADD] = {add_fwd, add_bwd},
    [FY_OP_CROSS_ENTROPY] = {cross_entropy_fwd, cross_entropy_bwd},
    [FY_OP_GELU] = {gelu_fwd, gelu_bwd},
    [FY_OP_MOE] = {moe_fwd, moe_bwd},
};
_Static_assert(sizeof cuda_ops / sizeof cuda_ops[0] == FY_OP_KIND_COUNT, "an op kind without cuda kernels");

int fy_engine_cuda_ops_missing(void) { return fy_op_kernels_missing(cuda_ops, (int)(sizeof cuda_ops / sizeof cuda_ops[0])); }

static void op_forward_cuda(void *arg) {
  struct fy_op_call *c = arg;
  struct fy_model *m = c->m;
  const struct fy_graph *g = m->graph;
  const struct fy_op *op = &g->ops[c->op];
  float *out = fy_engine_act(m, op->out);
  const double t0 = profile_start(m);
  struct fy_pattern_run run = {.out = out};
  const struct fy_op_args a = {.c = c, .m = m, .g = g, .op = op, .B = g->B, .T = g->T, .BT = fy_op_call_rows(c),
                               .out = out, .in0 = op->n_in > 0 ? fy_engine_act(m, op->in[0]) : NULL, .run = &run};
  FY_ASSERT(op->kind < FY_OP_KIND_COUNT && cuda_ops[op->kind].forward);
  fy_status st = cuda_ops[op->kind].forward(&a);
  if (st == FY_OK) st = fy_engine_run_hook(m, c->op, false, &run);
  profile_end(m, op->kind, 0, t0);
  if (st != FY_OK) c->st = fy_error_wrap(st, "forward of %s on cuda", op->name);
}

static void op_backward_cuda(void *arg) {
  struct fy_op_call *c = arg;
  struct fy_model *m = c->m;
  struct cuda_ctx *x = ctx_of(m);
  const struct fy_graph *g = m->graph;
  const struct fy_op *op = &g->ops[c->op];
  const double t0 = profile_start(m);
  fy_status st = FY_OK;
  for (int k = 0; k < op->n_zero && st == FY_OK; k++) {  // (gradients are in the compute dtype)
    const struct fy_slot *s = &g->slots[op->zero[k]];
    st = zero(x, m->dacts + s->grad_offset, (size_t)s->numel * grad_esize(m));
  }
  bool first[FY_OP_MAX_PARAMS];
  for (int k = 0; k < op->n_params; k++) first[k] = g->params[op->params[k]].last_use == c->op;
  struct fy_pattern_run run = {.dinput = op->n_in > 0 && op->kind != FY_OP_EMBEDDING ? fy_engine_dinput(m, op, 0) : NULL};
  const struct fy_op_args a = {.c = c, .m = m, .g = g, .op = op, .B = g->B, .T = g->T, .BT = g->B * g->T,
                               .in0 = op->n_in > 0 ? fy_engine_act(m, op->in[0]) : NULL,
                               .dout = op->kind == FY_OP_CROSS_ENTROPY ? NULL : fy_engine_dact(m, op->out),
                               .first = first, .run = &run};
  FY_ASSERT(op->kind < FY_OP_KIND_COUNT && cuda_ops[op->kind].backward);
  if (st == FY_OK) st = cuda_ops[op->kind].backward(&a);
  if (st == FY_OK) st = fy_engine_run_hook(m, c->op, true, &run);
  profile_end(m, op->kind, 1, t0);
  if (st != FY_OK) c->st = fy_error_wrap(st, "backward of %s on cuda", op->name);
}

// The optimizer hands over m->grads + offset; with bf16 compute the gradients are in cgrads.
// (After accumulation the optimizer reads the fp32 sum in m->grads: grads_f32.)
static bool grads_bf16(const struct fy_model *m) { return fy_model_grads_16(m); }
static const void *grads_of(const struct fy_model *m, const float *g) {
  return grads_bf16(m) ? (const void *)((const uint16_t *)m->cgrads + (g - m->grads)) : (const void *)g;
}

// Every parameter's sum into dsums (launched back to back), then one copy to the host and one wait.
static fy_status grads_sumsq_cuda(struct fy_model *m, double *sums) {
  struct cuda_ctx *x = ctx_of(m);
  const struct fy_graph *g = m->graph;
  for (int i = 0; i < g->n_params; i++)
    if (!g->params[i].absent)  // (another pipeline stage's: no gradient here)
      FY_TRY(fy_cuda_sumsq(x->dsums + i, grads_of(m, fy_model_grad(m, i)), grads_bf16(m) ? FY_BF16 : FY_F32,
                           g->params[i].numel, x->dscratch, false, x->st));
  if (cudaMemcpyAsync(sums, x->dsums, (size_t)g->n_params * sizeof *sums, cudaMemcpyDeviceToHost, x->st) !=
          cudaSuccess ||
      cudaStreamSynchronize(x->st) != cudaSuccess)
    return fy_error_set(FY_ERR_INTERNAL, "cuda: reading the gradients' sums of squares: %s",
                        cudaGetErrorString(cudaGetLastError()));
  for (int i = 0; i < g->n_params; i++)
    if (g->params[i].absent) sums[i] = 0;
  return FY_OK;
}

static void adamw_cuda(struct fy_model *m, float *p, float *mo, float *v, const float *g, int64_t n, float lr, float b1,
                       float b2, float eps, float wd, int64_t t, float scale) {
  struct cuda_ctx *x = ctx_of(m);
  // bf16 compute: the gradients are bf16 (cgrads), and the kernel writes the new weights' bf16
  // copy (cparams) in the same pass.
  uint16_t *w16 = m->compute_dtype == FY_F32 ? NULL : (uint16_t *)m->cparams + (p - m->params);
  fy_cuda_adamw_update(p, mo, v, grads_of(m, g), grads_bf16(m) ? FY_BF16 : FY_F32, w16, n, lr, b1, b2, eps, wd, t, scale,
                       x->st);
}

// The offload engine's device chunks, launched on its compute stream.
static fy_status chunk_sumsq_cuda(struct fy_model *m, double *sum, const void *g, enum fy_dtype g_dt, int64_t n) {
  struct cuda_ctx *x = ctx_of(m);
  return fy_cuda_sumsq(sum, g, g_dt, n, x->dscratch, false, x->st);
}

static fy_status chunk_adamw_cuda(struct fy_model *m, float *p, float *mo, float *v, const void *g, enum fy_dtype g_dt,
                                  void *p16, int64_t n, float lr, float b1, float b2, float eps, float wd, int64_t t,
                                  const float *scale_skip) {
  return fy_cuda_adamw_update_deferred(p, mo, v, g, g_dt, (uint16_t *)p16, n, lr, b1, b2, eps, wd, t, scale_skip,
                                       ctx_of(m)->st);
}

static fy_status chunk_adamw_state_cuda(struct fy_model *m, enum fy_state_format f, float *p, void *mo, void *v,
                                        const void *g, enum fy_dtype g_dt, void *p16, int64_t n,
                                        const struct fy_adamw_range *ranges, int n_ranges, float lr, float b1, float b2,
                                        float eps, int64_t t, const float *scale_skip) {
  return fy_cuda_adamw_state_update(f, p, mo, v, g, g_dt, (uint16_t *)p16, n, ranges, n_ranges, lr, b1, b2, eps, t, 1.0f,
                                    scale_skip, ctx_of(m)->st);
}

static fy_status chunk_add_cuda(struct fy_model *m, float *dst, const void *src, enum fy_dtype src_dt, int64_t n,
                                bool first) {
  return fy_cuda_accumulate(dst, src, src_dt, n, first, ctx_of(m)->st);
}

// grad_acc (fp32) = or += this micro-batch's gradients (bf16 ones widened on the way), one pass.
static void grads_sum_cuda(struct fy_model *m, bool first) {
  const bool bf16 = m->compute_dtype != FY_F32;
  fy_cuda_accumulate(m->grad_acc, bf16 ? (const void *)m->cgrads : m->grads, bf16 ? FY_BF16 : FY_F32,
                     m->graph->n_param_elems, first, ctx_of(m)->st);
}

// cparams <- the fp32 master weights in bf16 (after initialisation, loading or resuming; AdamW
// keeps them current after that: adamw_cuda writes the bf16 copy and leaves cparams_fresh set).
static void prepare_weights_cuda(struct fy_model *m) {
  struct cuda_ctx *x = ctx_of(m);
  if (m->weights16) return;  // (cparams are the weights: made current when they are written)
  fy_cuda_convert(m->cparams, m->compute_dtype, m->params, FY_F32, m->graph->n_param_elems, x->st);
}

// The offload engine's compute stream becomes the one kernels launch on (its events order them
// with the chunk cache's copies).
static void set_stream_cuda(struct fy_model *m, fy_stream *s) {
  struct cuda_ctx *x = ctx_of(m);
  cudaStreamSynchronize(x->st);  // what was launched on the old stream is done
  x->launch = s;
  x->st = fy_cuda_stream(s);
}

static void launch_on_cuda(struct fy_model *m, fy_stream *s) {
  struct cuda_ctx *x = ctx_of(m);
  x->launch = s;
  x->st = fy_cuda_stream(s);
}

static fy_status chunk_to16_cuda(struct fy_model *m, void *dst, const float *src, int64_t n) {
  return fy_cuda_convert(dst, m->compute_dtype, src, FY_F32, n, ctx_of(m)->st);
}

static fy_status wait_cuda(struct fy_model *m) {
  if (cudaStreamSynchronize(ctx_of(m)->st) != cudaSuccess)
    return fy_error_set(FY_ERR_INTERNAL, "cuda: waiting for the kernels: %s", cudaGetErrorString(cudaGetLastError()));
  return FY_OK;
}

// Sums over ranks (tensor parallelism's hooks, the replicas' gradients) by NCCL on the kernels'
// stream, and the hooks' arithmetic as kernels after them.
static fy_status all_reduce_cuda(struct fy_model *m, struct fy_comm *c, void *buf, size_t n, enum fy_reduce_dtype dt) {
  if (strcmp(fy_comm_kind_name(c), "nccl") != 0)
    return fy_error_set(FY_ERR_INVALID, "cuda: a sum over ranks of GPU memory on an %s communicator; on GPUs it must "
                        "be nccl", fy_comm_kind_name(c));
  return fy_comm_all_reduce(c, buf, n, dt, ctx_of(m)->launch);
}

static fy_status pattern_add_cuda(struct fy_model *m, void *dst, const void *src, int64_t n) {
  return fy_cuda_add_forward(dst, dst, src, m->compute_dtype, n, ctx_of(m)->st);
}

static fy_status pattern_bias_add_cuda(struct fy_model *m, void *out, const void *bias, int64_t rows, int64_t cols) {
  return fy_cuda_bias_add(out, bias, m->compute_dtype, rows, cols, ctx_of(m)->st);
}

static fy_status attention_decode_cuda(struct fy_model *m, int o, void *kcache, void *vcache, float *scratch,
                                       int64_t len, int64_t n, int64_t cap) {
  (void)scratch;  // (the kernel keeps its scores in shared memory)
  const struct fy_op *op = &m->graph->ops[o];
  struct cuda_ctx *x = m->kernels_ctx;
  return fy_cuda_attention_decode(fy_engine_act(m, op->out), kcache, vcache, fy_engine_act(m, op->in[0]),
                                  m->compute_dtype, len, n, cap, op->C, op->NH, op->scale, x->st);
}

static const struct fy_model_kernels cuda_kernels = {
    .op_forward = op_forward_cuda,
    .op_backward = op_backward_cuda,
    .grads_sumsq = grads_sumsq_cuda,
    .adamw = adamw_cuda,
    .prepare_weights = prepare_weights_cuda,
    .grads_sum = grads_sum_cuda,
    .set_stream = set_stream_cuda,
    .launch_on = launch_on_cuda,
    .chunk_to16 = chunk_to16_cuda,
    .chunk_sumsq = chunk_sumsq_cuda,
    .chunk_adamw = chunk_adamw_cuda,
    .chunk_adamw_state = chunk_adamw_state_cuda,
    .chunk_add = chunk_add_cuda,
    .wait = wait_cuda,
    .all_reduce = all_reduce_cuda,
    .pattern_add = pattern_add_cuda,
    .pattern_bias_add = pattern_bias_add_cuda,
    .attention_decode = attention_decode_cuda,
    .moe_route = moe_route_cuda,
};

// The engine's own device buffers, taken from the device as every other allocation is, so that its
// cap (--device-mem) and its counters include them: the kernels' scratch (fy_cuda_scratch_sizes).
static void **engine_buf(struct cuda_ctx *x, int i) {
  void **p[FY_CUDA_SCRATCH_BUFS] = {&x->workspace, (void **)&x->row, (void **)&x->dsums, (void **)&x->dscratch,
                           (void **)&x->lnscratch};
  return p[i];
}

// The mixtures' workspace (the largest op's, for all B x T rows in dtype dt) from the device, and
// their page-locked host buffer; none for a dense model.
static fy_status moe_buffers(struct fy_model *m, struct cuda_ctx *x, enum fy_dtype dt) {
  const struct fy_graph *g = m->graph;
  size_t work = 0, pinned = 0;
  for (int o = 0; o < g->n_ops; o++) {
    const struct fy_op *op = &g->ops[o];
    if (op->kind != FY_OP_MOE) continue;
    // (with tp, the workspace holds the sums' fp32 part: ops/cuda/ops_cuda.h)
    const struct fy_moe_dims d = {.BT = g->B * g->T, .C = op->C, .F = op->OC, .E = op->experts, .K = op->top_k,
                                  .tp_sum = g->tp > 1 ? moe_tp_sum_cuda : NULL};
    const size_t w = fy_cuda_moe_workspace_bytes(&d, dt), p = fy_cuda_moe_pinned_bytes(&d);
    work = w > work ? w : work;
    pinned = p > pinned ? p : pinned;
  }
  if (!work) return FY_OK;
  x->moe_pinned_bytes = pinned + (size_t)(g->B * g->T) * 4;
  if (cudaMallocHost(&x->moe_pinned, x->moe_pinned_bytes) != cudaSuccess) {
    x->moe_pinned = NULL;
    return fy_error_set(FY_ERR_NOMEM, "cuda: cannot allocate page-locked memory for the mixtures of experts");
  }
  fy_status st = fy_device_alloc(m->dev, work, &x->moe_work);
  if (st != FY_OK) return fy_error_wrap(st, "cuda: the mixtures of experts' workspace (%.1f MiB)", (double)work / 1048576.0);
  x->moe_work_bytes = work;
  return FY_OK;
}

fy_stream *fy_engine_cuda_stream(const struct fy_model *m) { return ctx_of(m)->launch; }

void fy_engine_cuda_detach(struct fy_model *m) {
  struct cuda_ctx *x = ctx_of(m);
  if (!x) return;
  // (Its own stream: the offload engine's, if kernels launched there, is gone by now.)
  if (x->stream) cudaStreamSynchronize(fy_cuda_stream(x->stream));
  fy_ep_cuda_free(m, x->ep);
  fy_cuda_blas_free(x->blas);
  for (int i = 0; i < FY_CUDA_SCRATCH_BUFS; i++)
    if (*engine_buf(x, i)) fy_device_dealloc(m->dev, *engine_buf(x, i), x->buf_bytes[i]);
  cudaFreeHost(x->losses_pinned);
  if (x->moe_work) fy_device_dealloc(m->dev, x->moe_work, x->moe_work_bytes);
  cudaFreeHost(x->moe_pinned);
  moe_kept_free(x);
  fy_stream_free(x->stream);
  free(x->fused);
  free(x);
  m->kernels_ctx = NULL;
  m->kernels = &fy_model_cpu_kernels;
}

fy_status fy_engine_cuda_attach(struct fy_model *m) {
  if (m->dev->kind != FY_DEVICE_CUDA) return fy_error_set(FY_ERR_INVALID, "the model is not on a cuda device");
  struct cuda_ctx *x = calloc(1, sizeof *x);
  if (!x) return fy_error_set(FY_ERR_NOMEM, "out of memory");
  m->kernels_ctx = x;
  const struct fy_graph *g = m->graph;
  const int64_t C = fy_graph_max_channels(g);
  fy_cuda_scratch_sizes(x->buf_bytes, g->n_params, C);
  fy_status st = FY_OK;
  // A model whose attention this GPU cannot run (fp32 with large heads on a GPU with little shared
  // memory) is refused before its first step. Its compute dtype is set after this; a model made
  // for 16-bit activations (act16) will compute in bf16, the GPU's only 16-bit type.
  const enum fy_dtype adt = g->act16 ? FY_BF16 : m->compute_dtype;
  for (int o = 0; o < g->n_ops && st == FY_OK; o++)
    if (g->ops[o].kind == FY_OP_ATTENTION) st = fy_cuda_attention_check(adt, g->ops[o].C, g->ops[o].NH);
  if (st == FY_OK) st = fy_stream_create(m->dev, &x->stream);
  if (st == FY_OK) x->st = fy_cuda_stream(x->launch = x->stream);
  for (int i = 0; i < FY_CUDA_SCRATCH_BUFS && st == FY_OK; i++) {
    st = fy_device_alloc(m->dev, x->buf_bytes[i], engine_buf(x, i));
    if (st != FY_OK) st = fy_error_wrap(st, "cuda: the engine's buffers (GEMM workspace and scratch, %.1f MiB)",
                                        (double)fy_cuda_scratch_bytes(g->n_params, C) / 1048576.0);
  }
  if (st == FY_OK && cudaMallocHost((void **)&x->losses_pinned, (size_t)(g->B * g->T) * 4) != cudaSuccess)
    st = fy_error_set(FY_ERR_NOMEM, "cuda: cannot allocate page-locked memory for the losses");
  if (st == FY_OK) st = moe_buffers(m, x, adt);
  if (st == FY_OK) st = fy_cuda_blas_create(x->workspace, x->buf_bytes[0], &x->blas);
  if (st == FY_OK && !(x->fused = calloc((size_t)g->n_ops + 1, 1))) st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  if (st != FY_OK) {
    fy_engine_cuda_detach(m);
    return st;
  }
  // FERRY_CUDA_FUSE=0 runs every op on its own (to tell a fused epilogue's fault from another's).
  const char *fuse = getenv("FERRY_CUDA_FUSE");
  for (int o = 0; o < g->n_ops && !(fuse && strcmp(fuse, "0") == 0); o++)
    x->fused[o] = (unsigned char)fy_graph_fusion(g, o);
  m->kernels = &cuda_kernels;
  return FY_OK;
}

fy_status fy_engine_cuda_set_ep(struct fy_model *m, struct fy_comm *nccl) {
  struct cuda_ctx *x = ctx_of(m);
  if (!x) return fy_error_set(FY_ERR_INVALID, "expert parallelism on GPUs: the model has no cuda kernels");
  FY_ASSERT(!x->ep);
  return fy_ep_cuda_create(m, nccl, &x->ep);
}

void fy_engine_cuda_memory(int ordinal, size_t *free_bytes, size_t *total_bytes) {
  *free_bytes = *total_bytes = 0;
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(ordinal) != cudaSuccess) return;
  if (cudaMemGetInfo(free_bytes, total_bytes) != cudaSuccess) *free_bytes = *total_bytes = 0;
  cudaSetDevice(prev);
}

size_t fy_engine_cuda_free_memory(int ordinal) {
  size_t free_b, total;
  fy_engine_cuda_memory(ordinal, &free_b, &total);
  return free_b;
}

fy_status fy_engine_cuda_host_tier(size_t cap, struct fy_host_tier **out) {
  return fy_host_tier_create(cap, -1, fy_cuda_host_pin, fy_cuda_host_unpin, out);
}

fy_status fy_engine_cuda_rank_device(int rank, int local_rank, int *ordinal) {
  int n = fy_cuda_device_count();
  if (n <= 0) {
    char who[64];
    snprintf(who, sizeof who, "--device cuda: rank %d", rank);
    return fy_cuda_find_gpu(0, who);
  }
  if (local_rank >= n && n > 1)
    return fy_error_set(FY_ERR_INVALID, "--device cuda: rank %d is local rank %d but its node has %d GPUs (one rank "
                        "per GPU)", rank, local_rank, n);
  *ordinal = local_rank < n ? local_rank : 0;
  return FY_OK;
}

fy_status fy_engine_cuda_device(int ordinal, size_t cap, struct fy_device **out) {
  FY_TRY(fy_cuda_find_gpu(ordinal, "--device cuda"));
  FY_TRY(fy_cuda_gpu_usable(ordinal));  // before anything is allocated: a GPU this build cannot drive
  return fy_device_cuda_create(ordinal, cap, out);
}
