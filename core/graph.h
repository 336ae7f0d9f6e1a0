// fy_graph: the model as an ordered list of operators (docs/design.md, "The objects").
//
// Forward walks `ops` in order, backward in reverse. Parameters live in one flat buffer laid out
// in first-use order (so chunks, later, are contiguous ranges of it); activations are slots at
// offsets in one arena. Gradients of activations live in a second arena whose slots are reused
// once dead (liveness over the backward walk, as ggml-alloc does), so backward needs about one
// layer's worth of activation gradients. The gradient of a slot marked `grad_in_place` (the
// logits) is written over its value by its consumer's backward. A residual add's inputs, and a
// relu's or gelu's input, take over the op's output gradient buffer where that is safe
// (fy_op.grad_shared): no copy, no zeroing, and for the feed-forward block's wide activation one
// (BT, 4C) buffer fewer.
#ifndef FY_GRAPH_H
#define FY_GRAPH_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

enum fy_op_kind {
  FY_OP_EMBEDDING,      // in: token or position ids; param: table (V,C) -> out (BT,C)
  FY_OP_LAYERNORM,      // in (BT,C); params: weight, bias (or none) -> out (BT,C); aux: mean, rstd
  FY_OP_LINEAR,         // in (BT,C); params: weight (OC,C) [, bias (OC)] -> out (BT,OC)
  FY_OP_ATTENTION,      // in qkv (BT,3C) -> out (BT,C); aux: probabilities (B,NH,T,T), or
                        //   with flash_attention the log-sum-exp (B,NH,T)
  FY_OP_RELU,           // in (N) -> out (N)
  FY_OP_ADD,            // in a, b (N) -> out (N)
  FY_OP_CROSS_ENTROPY,  // in logits (BT,V), targets -> out: per-row losses (BT)
  FY_OP_GELU,           // in (N) -> out (N) (exact, with erf)
  FY_OP_MOE,            // in (BT,C); params: gate (E,C), fc1 (E*F,C) [, fc1 bias (E*F)], fc2 (E*C,F)
                        //   [, fc2 bias (E*C)] -> out (BT,C); aux: routing (BT, E+3K), dispatched
                        //   rows (fy_moe_rows_cap, F+C) (ops/ops.h, "mixture of experts")
  FY_OP_KIND_COUNT,
};

enum fy_index_source { FY_INDEX_TOKENS, FY_INDEX_POSITIONS };

#define FY_OP_MAX_PARAMS 6
#define FY_OP_MAX_IN 2
#define FY_OP_MAX_AUX 2
#define FY_NAME_MAX 96

struct fy_param {
  char name[FY_NAME_MAX];  // Hugging Face name, e.g. model.decoder.layers.3.fc1.weight
  int rank;
  int64_t shape[2];
  int64_t numel;
  int64_t offset;          // elements from the start of the flat parameter buffer
                           //   (= chunk * chunk_elems + chunk_offset once packed into chunks)
  int chunk;               // the chunk holding it (memory/chunk.h); 0 before packing
  int64_t chunk_offset;    // elements from the start of its chunk
  bool decay;              // weight decay applies (matrices and embeddings, not biases or norms)
  int first_use;           // index of the first op that reads it
  int last_use;            // index of the last one: the first to write its gradient in backward
  int64_t padding_idx;     // embedding row whose gradient stays zero (nn.Embedding), or -1
  // Tensor parallelism (Megatron's split, g->tp ranks): -1 when every rank holds all of it; 0
  // when split by rows (output features: this rank holds rows [tp_rank*shape[0], +shape[0]) of
  // full_shape), 1 when split by columns (input features). shape is this rank's part.
  int split_dim;
  int64_t full_shape[2];
  // split_dim 0 within each of split_blocks equal blocks of rows (0 or 1: one block, the above): a
  // mixture's stacked experts under tensor parallelism, expert e's fc1 rows [e F, (e+1) F) each
  // split, so that this rank holds rows [e F + tp_rank F/tp, +F/tp) of every expert, expert by expert.
  int64_t split_blocks;
  // A pipeline stage's graph (fy_graph_set_stage): no op of the stage reads it, so no buffer holds
  // it (offset -1, chunk -1, outside n_param_elems); its op indices stay the whole graph's.
  bool absent;
  // Expert parallelism (fy_graph_set_experts): a mixture's stacked experts split by rows over the
  // g->ep ranks of an expert-parallel group (split_dim 0: this rank holds experts [ep_rank E/ep,
  // (ep_rank + 1) E/ep), rows [ep_rank*shape[0], +shape[0]) of full_shape). With tensor parallelism
  // too (fy_param_split_tp) the experts' fc1 and fc2 keep tp's split_dim (and split_blocks, the
  // whole E) and full_shape the whole tensor's: this rank holds its tp slice of each of its E/ep
  // experts; fc2's bias, which tp does not split, is split by ep alone as above.
  bool expert;
};

// The part of parameter p in elements [lo, hi) of the flat parameter buffer: [*a, *b) of p, false
// when it has none (reading or writing a range of the buffer parameter by parameter).
static inline bool fy_param_part(const struct fy_param *p, int64_t lo, int64_t hi, int64_t *a, int64_t *b) {
  if (p->absent) return false;  // (no part of a pipeline stage's buffers)
  *a = lo > p->offset ? lo - p->offset : 0;
  *b = hi < p->offset + p->numel ? hi - p->offset : p->numel;
  return *a < *b;
}

struct fy_slot {
  int64_t numel;           // elements (floats, or 16-bit values with act16)
  int64_t offset;          // in the activation arena (floats)
  int64_t grad_offset;     // in the gradient arena (floats); -1 when no gradient is kept
  int producer;            // op index
  int last_consumer;       // highest op index reading it (-1: none)
  bool grad_in_place;
};

struct fy_op {
  enum fy_op_kind kind;
  char name[64];           // short, for messages: "layers.3.fc1"
  int layer;               // decoder layer, -1 outside the stack
  int n_params;
  int params[FY_OP_MAX_PARAMS];  // LINEAR: weight ids first, then bias ids (a fused QKV has 3+3)
  int n_in;
  int in[FY_OP_MAX_IN];
  int out;
  int n_aux;
  int aux[FY_OP_MAX_AUX];
  // Sizes; which are used depends on the kind.
  int64_t C, OC, V, NH;
  float eps, scale;
  // ADD of a residual (in[0]) and a branch (in[1]) with dropout on the branch while training
  // (ops/dropout.h): its probability (0: a plain add), the site whose key draws the mask (2 x
  // layer, + 1 for the feed-forward residual), and C, the width of a token's row.
  float dropout;
  int site;
  bool has_bias;
  enum fy_index_source index;
  // Slots whose gradient becomes live (is zeroed) just before this op's backward.
  int n_zero;
  int zero[FY_OP_MAX_IN];
  // Inputs whose gradient is the output's buffer, taken over (plan_gradients' rule): an ADD's
  // hands its output's gradient down unchanged, so its backward does nothing for them; a RELU's or
  // GELU's backward writes its input's gradient over its output's, in place.
  bool grad_shared[FY_OP_MAX_IN];
  // Tensor parallelism (LINEAR): COL holds a slice of the output features (input whole, output
  // split; the input gradient is summed over the tensor-parallel group in backward); ROW a slice
  // of the input features (input split, the output summed over the group in forward, the bias
  // added after the sum). NONE: the op runs whole on every rank.
  enum fy_split { FY_SPLIT_NONE, FY_SPLIT_COL, FY_SPLIT_ROW } split;
  // The parallel pattern (planner/pattern.h) whose runtime hooks run after this op's kernels:
  // "tp_col" / "tp_row" for split linears; empty for none (chunk-level patterns need none).
  char pattern[32];
  // MOE: E experts of F = OC features, top K, the activation (gelu, else relu) and the
  // load-balancing loss' coefficient.
  int experts, top_k;
  bool gelu;
  float aux_coef;
};

// A mixture of experts (FY_OP_MOE) computes each expert's tokens as one product whose row count is
// rounded up to 3 significant bits (8, 9, .., 15, 16, 18, ..: fy_moe_rows), so that the
// data-dependent counts make few distinct problems for the products' kernels (oneDNN compiles one
// per shape) at under 1/8 more rows; the rounding rows are zeros. The rows of all E experts
// together, for BT tokens routed to K experts each, are at most fy_moe_rows_cap.
static inline int64_t fy_moe_rows(int64_t n) {
  if (n <= 0) return 0;
  if (n <= 8) return 8;
  int64_t step = 1;
  while ((n + step - 1) / step > 15) step *= 2;  // n / step rounded up in [8, 15] or 16
  return (n + step - 1) / step * step;
}
static inline int64_t fy_moe_rows_cap(int64_t BT, int64_t E, int64_t K) {
  return BT * K + (BT * K) / 8 + 9 * E;
}

// Whether input k's gradient is its op's output gradient, handed down unchanged (an ADD's shared
// input): its backward writes nothing for it, and a 16-bit run rounds nothing.
static inline bool fy_op_grad_handed_down(const struct fy_op *op, int k) {
  return op->kind == FY_OP_ADD && op->grad_shared[k];
}

struct fy_graph {
  int n_ops, n_params, n_slots;
  struct fy_op *ops;
  struct fy_param *params;
  struct fy_slot *slots;
  int64_t B, T;            // the micro-batch the slots are sized for
  int64_t n_param_elems;   // size of each flat parameter-sized buffer (floats)
  int64_t chunk_elems;     // parameters are packed in chunks of this many floats (one chunk:
                           //   n_param_elems) — see memory/chunk.h
  int64_t chunk_align;     // set before packing: parameter groups and chunks start at multiples of
                           //   this many floats (0: 16, a 64-byte line; 256 for 8-bit AdamW state,
                           //   whose blocks must hold the same elements whatever the chunk size)
  int64_t act_elems;       // activation arena (floats)
  bool recompute;          // decoder layers' activations are recomputed in backward
  bool forward_only;       // forward passes alone (evaluation): fy_graph_set_forward_only
  bool flash_attention;    // attention keeps B*NH*T statistics, not the T x T probabilities
  bool act16;              // activations and their gradients are 16-bit, two to a float of the
                           //   arenas (fp32 statistics and losses excepted): fy_graph_set_act16
  int64_t grad_elems;      // activation-gradient arena (floats)
  int64_t scratch_elems;   // workspace for one backward op (attention's)
  int loss_slot;           // per-row losses of the cross-entropy op
  int logits_slot;
  int tp, tp_rank;         // tensor-parallel group size and this rank's place in it (1, 0: none)
  int ep, ep_rank;         // expert-parallel group size and this rank's place in it (1, 0: none)
};

// Whether p is split over the tensor-parallel group of g (a mixture's experts may be split over the
// expert-parallel group too, or alone: fy_param.expert).
static inline bool fy_param_split_tp(const struct fy_graph *g, const struct fy_param *p) {
  return g->tp > 1 && p->split_dim >= 0 && (!p->expert || p->split_dim == 1 || p->split_blocks > 1);
}

// Construction (used by model builders): ops, params and slots are appended in forward order.
fy_status fy_graph_create(int64_t B, int64_t T, struct fy_graph **out);
void fy_graph_free(struct fy_graph *g);
int fy_graph_add_param(struct fy_graph *g, const char *name, int rank, const int64_t *shape,
                       bool decay);
int fy_graph_add_slot(struct fy_graph *g, int64_t numel);
// Appends an op (copied); returns its index. Sets the producer of op->out.
int fy_graph_add_op(struct fy_graph *g, const struct fy_op *op);
// Lays parameters out in first-use order (params listed by one op stay in the order listed, so a
// fused QKV's weights are adjacent) and sizes the arenas with liveness-based reuse for gradients.
fy_status fy_graph_finalize(struct fy_graph *g);
// Recomputation per decoder layer: on, the activations a layer makes for itself share one region
// (a layer's forward runs again just before its backward) and only layer inputs are kept.
void fy_graph_set_recompute(struct fy_graph *g, bool on);
// Forward passes alone (evaluation): nothing is kept for a backward, so the activations a decoder
// layer makes for itself share one region (the recomputation layout, with no backward to run it)
// and the gradient arena and the backward scratch are empty. One way: a graph stays forward-only.
void fy_graph_set_forward_only(struct fy_graph *g);
// Flash-style attention (the cuda kernels): each attention op's aux slot holds one float per query
// and head (the log-sum-exp) instead of the T x T probabilities, and so does the backward scratch.
void fy_graph_set_flash_attention(struct fy_graph *g, bool on);
// 16-bit activations (a GPU's bf16 tensors): every slot except the fp32 statistics (ops' aux
// slots) and the per-row losses takes half its elements in floats of the arenas, and both arenas
// are planned again (act_elems and grad_elems shrink). Offsets stay in floats, 64-byte aligned;
// numel stays the element count.
fy_status fy_graph_set_act16(struct fy_graph *g, bool on);
// The floats of its arena slot s takes (from its offset): its elements, half of them with act16
// (except fp32 statistics and losses), rounded up to the arenas' 64-byte alignment.
int64_t fy_graph_slot_floats(const struct fy_graph *g, int s);
// What a backend that has epilogues (cuda: cuBLASLt's) may do with op o, a linear, and the op after
// it: run them as one call writing the next op's output, when only that op reads the linear's
// output (whose memory then stays unwritten), the next op's output shares no memory with the
// linear's input (read while it is written), and no pattern hook needs the linear's output. The
// next op is a relu (its backward reads only its output), or an add of a residual (its backward
// reads nothing) whose output is the residual itself or apart from it, without dropout.
enum fy_fusion { FY_FUSED_NONE, FY_FUSED_RELU, FY_FUSED_ADD };
enum fy_fusion fy_graph_fusion(const struct fy_graph *g, int o);

// One pass of training over a micro-batch as a list of actions: every op forward in order, then
// backward in reverse, with a decoder layer's forward run again just before its backward when
// the graph recomputes. `out` must hold fy_graph_max_actions(g) entries; returns the count.
enum fy_action_kind { FY_ACT_FORWARD, FY_ACT_RECOMPUTE, FY_ACT_BACKWARD };
struct fy_action {
  int op;
  enum fy_action_kind kind;
};
int fy_graph_max_actions(const struct fy_graph *g);
int fy_graph_pass_actions(const struct fy_graph *g, struct fy_action *out);
// The first op of the decoder layer that op o ends, or -1 when o is outside the stack or is not
// its layer's last op.
int fy_graph_layer_first_op(const struct fy_graph *g, int o);
// Pipeline stage `stage` of pp (docs/ranks.md): the ops [*lo, *hi) of its decoder layers (each
// stage the same number; the embeddings with the first, the final norm, lm_head and loss with the
// last). FY_ERR_INVALID when pp does not divide the layers.
fy_status fy_graph_stage_ops(const struct fy_graph *g, int64_t layers, int pp, int stage, int *lo, int *hi);
// Keeps only the parameters ops [lo, hi) read (a pipeline stage's: a tied embedding on the first
// and the last stage), the others marked absent; before the parameters are packed into chunks
// (memory/chunk.h), which lays out the kept ones alone.
void fy_graph_set_stage(struct fy_graph *g, int lo, int hi);
// The span [*lo, *hi) of the activation arena (floats) the slots of ops [op_lo, op_hi) lie in
// (inputs, outputs and aux slots; slots are laid out in forward order): what a pipeline stage's
// micro-batch in flight needs. No slot: [0, 1).
void fy_graph_ops_act_span(const struct fy_graph *g, int op_lo, int op_hi, int64_t *lo, int64_t *hi);
// Expert parallelism over ep ranks (docs/ranks.md): every mixture's experts (fc1, fc2 and their
// biases, not the router) keep the rows of the E/ep experts of ep_rank (fy_param.expert; of a
// tensor-parallel graph, its slices of them); before
// the parameters are packed into chunks (memory/chunk.h), which lays out the smaller ones.
// FY_ERR_INVALID, naming the numbers, when ep does not divide a mixture's experts.
fy_status fy_graph_set_experts(struct fy_graph *g, int ep, int ep_rank);
// Index of the parameter with this name, or -1.
int fy_graph_find_param(const struct fy_graph *g, const char *name);
// The largest channel count C of any op (at least 1): the widest row a kernel's scratch holds.
int64_t fy_graph_max_channels(const struct fy_graph *g);
// A tensor-parallel rank's buffer for a column-split linear's partial input gradient (the model's
// tp_buf): (B*T, hidden) floats; none with one rank.
static inline int64_t fy_graph_tp_buf_elems(const struct fy_graph *g, int64_t hidden) {
  return g->tp > 1 ? g->B * g->T * hidden : 0;
}
// The bytes a model of this graph takes on a device that holds all of it (runtime/model.h: what
// fy_model_create_with, then fy_model_set_compute_dtype and fy_model_enable_accumulation
// allocate), each flat buffer rounded up to `granule` as that device's allocator counts it: the
// fp32 weights (but for evaluation in bf16, fy_model_opts.weights16); with `train` their
// gradients and AdamW's m and v, and with `accumulate` the sum over micro-batches; with `bf16`
// the 16-bit weights (and gradients); the arenas (recomputation, flash attention and act16 set as
// the run sets them), the positions, the batch and tp_buf.
double fy_graph_model_bytes(const struct fy_graph *g, int64_t hidden, bool train, bool bf16, bool accumulate,
                            size_t granule);
// The device buffers an offloaded model of this graph keeps besides its chunks, in the order they
// are allocated (runtime/model.c, runtime/offload.c; the planner prices the same list): the
// arenas, tp_buf (tensor parallelism), the model's batch in device memory (gpu: dbatch), the
// positions, and last the offload engine's two micro-batches of ids, targets, mask and positions.
// Writes their bytes (unrounded; at least 1 for an arena) and returns how many.
#define FY_GRAPH_OFFLOAD_BUFS 8
int fy_graph_offload_buffers(const struct fy_graph *g, int64_t hidden, bool gpu, size_t bytes[FY_GRAPH_OFFLOAD_BUFS]);
const char *fy_op_kind_name(enum fy_op_kind k);

#endif
