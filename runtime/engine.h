// The step engine (docs/design.md, "One training step", steps 2 and 3): forward walks the graph's
// operators in order, backward in reverse, each op calling its kernel on the model's buffers.
//
// An op call carries everything one kernel invocation needs, with the parameter pointers already
// resolved, so that the same calls run on resident parameters (the flat buffers of fy_model) and
// on chunks in the device cache (runtime/offload.c), where they may be enqueued on a stream.
//
// Gradients: within one backward pass the first gradient a parameter receives (at its last
// forward user) overwrites, later ones accumulate. Gradients of several micro-batches are summed
// apart from that, by the caller, in the same order on every placement.
#ifndef FY_ENGINE_H
#define FY_ENGINE_H

#include "ops/dropout.h"
#include "runtime/data.h"
#include "runtime/model.h"

struct fy_loss {
  double sum;      // sum of per-token losses over targets not ignored
  int64_t count;   // number of targets not ignored
  double aux_sum;  // mixtures of experts: the load-balancing terms times their coefficient, each
                   //   weighted by count (so that over micro-batches and ranks sum / total count
                   //   is their token-weighted mean, the `aux_loss` of the log); 0 for a dense model
};

// A micro-batch as the kernels read it (device memory on an offloading device).
struct fy_dev_batch {
  int32_t *inputs, *targets, *mask, *positions;  // (B,T); mask may be NULL
  int64_t row0;  // fy_batch's: row r of the micro-batch is stream element row0 + r
  bool no_dropout;  // an evaluation pass of a training model: the residual adds do not drop
};

struct fy_op_call {
  struct fy_model *m;
  int op;
  const struct fy_dev_batch *batch;
  float *w[FY_OP_MAX_PARAMS];  // the op's parameters, in op->params order
  float *g[FY_OP_MAX_PARAMS];  // where their gradients go (may be the same memory as w)
  float loss_scale;            // backward of the loss: d(loss_scale x sum of losses)
  double *loss_sum;            // forward of the loss adds the sum of its per-row losses here
  double *aux_sum;             // forward of a mixture of experts adds its weighted balance term here
  int64_t rows;                // forward of a model built for one sequence (B = 1): only its first
                               // `rows` tokens (0: all T), for decoding fewer than it was built for
                               // (not attention: decoding runs kernels->attention_decode instead)
  int64_t row0;                // with rows, a linear op's input rows start at row0 (its output's at
                               // 0): decoding takes the logits of the last token alone
  fy_status st;                // the kernel's status
};

// The token rows a call computes, and the elements of those rows in slot s.
static inline int64_t fy_op_call_rows(const struct fy_op_call *c) {
  return c->rows > 0 ? c->rows : c->m->graph->B * c->m->graph->T;
}
static inline int64_t fy_op_call_numel(const struct fy_op_call *c, int s) {
  const struct fy_graph *g = c->m->graph;
  return c->rows > 0 ? g->slots[s].numel / (g->B * g->T) * c->rows : g->slots[s].numel;
}

// Whether op (an ADD) drops its branch in this call, and then its mask's key and the stream token
// of the batch's first row (ops/dropout.h): the same for every backend's kernels.
static inline bool fy_engine_dropout(const struct fy_op_call *c, const struct fy_op *op, uint64_t *key, int64_t *u0) {
  if (!(op->dropout > 0) || c->batch->no_dropout) return false;
  *key = fy_dropout_key(c->m->dropout_seed, op->site);
  *u0 = c->batch->row0 * c->m->graph->T;
  return true;
}

// Run one op's forward or backward kernel (signature of a stream host function): the CPU
// kernels (cpu and sim devices). A cuda device's are in runtime/engine_cuda.c.
void fy_op_call_forward(void *call);
void fy_op_call_backward(void *call);

// A backend's kernels for one op kind, forward and backward, as its op table holds them: an array
// indexed by enum fy_op_kind, one line a kind (runtime/engine.c for the CPU, runtime/engine_cuda.c
// for cuda). What a call hands them:
struct fy_pattern_run;
struct fy_op_args {
  struct fy_op_call *c;
  struct fy_model *m;
  const struct fy_graph *g;
  const struct fy_op *op;     // g->ops[c->op]
  int64_t B, T, BT;           // the graph's; BT the rows computed (fy_op_call_rows in forward)
  float *out;                 // forward: the output slot
  const float *in0;           // the first input's activation (NULL for an op without inputs)
  const float *dout;          // backward: the output's gradient (NULL for the loss)
  const bool *first;          // backward: per parameter, whether its gradient is written, not added
  struct fy_pattern_run *run; // what the op's pattern hook reads after the kernels (planner/pattern.h)
};
struct fy_op_kernels {
  fy_status (*forward)(const struct fy_op_args *a);
  fy_status (*backward)(const struct fy_op_args *a);
};
// The first op kind a table of n lacks a kernel for, or -1 when it is complete (the tests ask each
// backend: fy_engine_ops_missing, fy_engine_cuda_ops_missing).
static inline int fy_op_kernels_missing(const struct fy_op_kernels *t, int n) {
  for (int k = 0; k < FY_OP_KIND_COUNT; k++)
    if (k >= n || !t[k].forward || !t[k].backward) return k;
  return -1;
}
int fy_engine_ops_missing(void);

// After op o's kernels: its parallel pattern's hook (planner/pattern.h; nothing when it has none),
// with r's buffers filled in by the caller and the collective and arithmetic of m's kernels.
fy_status fy_engine_run_hook(struct fy_model *m, int o, bool backward, struct fy_pattern_run *r);

// Where a slot's activation and its gradient are, and an op input's gradient (NULL when nothing
// upstream needs it).
static inline float *fy_engine_act(const struct fy_model *m, int slot) {
  return m->acts + m->graph->slots[slot].offset;
}
static inline float *fy_engine_dact(const struct fy_model *m, int slot) {
  const struct fy_slot *s = &m->graph->slots[slot];
  return s->grad_in_place ? m->acts + s->offset : m->dacts + s->grad_offset;
}
static inline float *fy_engine_dinput(const struct fy_model *m, const struct fy_op *op, int k) {
  const struct fy_slot *s = &m->graph->slots[op->in[k]];
  return s->grad_offset >= 0 || s->grad_in_place ? fy_engine_dact(m, op->in[k]) : NULL;
}
// An op's input gradient that its backward must write: fy_engine_dinput, or NULL for an add's
// input that shares the output's buffer (fy_op.grad_shared), which already holds it. (A relu's
// or gelu's shared one is written, in place: fy_engine_dinput is then the output's gradient.)
static inline float *fy_engine_dinput_own(const struct fy_model *m, const struct fy_op *op, int k) {
  return fy_op_grad_handed_down(op, k) ? NULL : fy_engine_dinput(m, op, k);
}

// Resident parameters (m->params, gradients into m->grads): run the forward pass of a micro-batch
// (its B and T must be those the model was built for) after checking every id against the
// vocabulary, and the backward pass of the last forward, which writes into m->grads the gradient
// of `loss_scale` x (sum of per-token losses); callers pass 1/count for a mean.
fy_status fy_engine_forward(struct fy_model *m, const struct fy_batch *batch, struct fy_loss *loss);
// The same forward as evaluation runs it on a training model: no dropout (validation).
fy_status fy_engine_forward_eval(struct fy_model *m, const struct fy_batch *batch, struct fy_loss *loss);
fy_status fy_engine_backward(struct fy_model *m, const struct fy_batch *batch, float loss_scale);
// A pipeline stage's part of both passes (runtime/pipeline.c): ops [lo, hi) forward (training,
// with dropout), or backward in reverse, on the batch, each op exactly as the whole passes run
// it. The activation entering op lo (when lo > 0) is the caller's to put in its slot first, and
// the gradient of the one leaving op hi - 1 (when hi < n_ops) too before the backward; the
// positions are computed again from the batch's mask before the backward (the position
// embedding's reads them, and another micro-batch's forward may have run in between).
fy_status fy_engine_forward_ops(struct fy_model *m, const struct fy_batch *batch, int lo, int hi, struct fy_loss *loss);
fy_status fy_engine_backward_ops(struct fy_model *m, const struct fy_batch *batch, int lo, int hi, float loss_scale);
// Ops [lo, hi) forward as evaluation runs them (no dropout): a stage's part of a validation or
// ferry eval pass.
fy_status fy_engine_forward_eval_ops(struct fy_model *m, const struct fy_batch *batch, int lo, int hi,
                                     struct fy_loss *loss);
// Data parallelism with replicated parameters: the gradients the optimizer reads (m->grads, or a
// GPU's bf16 cgrads: fy_model_grads_16) summed over m->dp_comm's ranks in place, queued where the
// kernels run (m->dp_comm then a device communicator, nccl) or, for the CPU's kernels, at once on
// the host.
fy_status fy_engine_all_reduce_grads(struct fy_model *m);
// Runs the forward pass op by op and sets *op to the first op whose output holds a NaN or an
// infinity (-1 when none does): to name the culprit after a non-finite loss.
fy_status fy_engine_find_nonfinite(struct fy_model *m, const struct fy_batch *batch, int *op);
// Incremental decoding (ferry sample), on a resident model built for one sequence (B = 1) of T
// tokens, computing in fp32 (or bf16 on a GPU): each step runs the forward of up to T tokens at
// the next positions, their attention against the keys and values the cache keeps of the tokens
// before (kernels->attention_decode), so that a token costs one token's work whatever the context
// (and a prompt runs T tokens at a time, through the products of T rows). The cache holds `cap`
// tokens, on the model's device.
struct fy_kv_cache;
fy_status fy_kv_cache_create(const struct fy_model *m, int64_t cap, struct fy_kv_cache **out);
void fy_kv_cache_free(struct fy_kv_cache *kv);
// Empties the cache: the next token is at position 0 again.
void fy_kv_cache_reset(struct fy_kv_cache *kv);
// Tokens the cache holds (the next token's position).
int64_t fy_kv_cache_len(const struct fy_kv_cache *kv);
// Runs tokens (n, 1 <= n <= the model's T) at positions fy_kv_cache_len(kv) onwards and appends
// them; *logits (V floats on the host, valid until the next call) are the next token's, after the
// last of them. FY_ERR_INVALID when the cache cannot take them.
fy_status fy_engine_decode(struct fy_model *m, struct fy_kv_cache *kv, const int32_t *tokens, int64_t n,
                           const float **logits);
// The parts of a decoding step, for an engine that runs the ops itself (fy_offload_decode): n
// tokens checked against the model and the cache; op o's attention for them, at the cache's
// length (kernels->attention_decode, on the kernels' stream); after their pass has finished, the
// cache n tokens longer and *logits the last one's.
fy_status fy_kv_cache_check(const struct fy_kv_cache *kv, const struct fy_model *m, const int32_t *tokens, int64_t n);
fy_status fy_kv_cache_attend(struct fy_kv_cache *kv, struct fy_model *m, int o, int64_t n);
// The rows op o computes for n tokens (c->rows, c->row0): all n, but the product that makes the
// logits takes the last token's row alone (the logits read are the last token's).
void fy_kv_cache_rows(const struct fy_model *m, int o, int64_t n, struct fy_op_call *c);
fy_status fy_kv_cache_advance(struct fy_kv_cache *kv, struct fy_model *m, int64_t n, const float **logits);
// The device bytes of a cache of cap tokens for cfg's model whose kernels compute in dtype (what
// fy_kv_cache_create allocates, before the allocator's rounding).
double fy_kv_cache_bytes(const struct fy_opt_config *cfg, int64_t cap, enum fy_dtype dtype);
// Checks a batch's shape and ids against the model.
fy_status fy_engine_check_batch(const struct fy_model *m, const struct fy_batch *batch);
// Number of targets that are not -100.
int64_t fy_engine_count_targets(const struct fy_batch *batch);
// Positions as OPTLearnedPositionalEmbedding computes them, offset 2 included:
// cumsum(mask) * mask - 1 + 2 (all ones when mask is NULL).
void fy_engine_positions(int32_t *pos, const int32_t *mask, int64_t B, int64_t T);

#endif
