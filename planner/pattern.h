// Parallel patterns (docs/design.md, "fy_pattern"): how one operator's parameters lie across ranks, what
// communication runs around its forward and backward, and what that costs the planner.
//
// A pattern is a table of functions filled with designated initialisers (as ggml's and libuv's
// backends are). Patterns live in one process-wide registry by name, the name a plan file uses;
// the built-ins (replicate, zero, tp_col, tp_row, expert) are always there — every entry point registers
// them first, so a plug-in cannot take a built-in's name by registering early. A new pattern is
// one file that defines a `const struct fy_pattern` and one fy_pattern_register call.
//
// Conventions every pattern follows, so that costs from different patterns add up:
// - Ranks form a dp x tp grid; group 0 is the data-parallel group (dp ranks), group 1 the
//   tensor-parallel group (tp ranks). A collective over a group of one rank is no step at all.
// - A step's `bytes` is the size of the whole logical buffer the collective works on (the full
//   gathered tensor for an all-gather, the full input of a reduce-scatter, the buffer of an
//   all-reduce or broadcast), not the bytes one rank puts on the wire; the cost model applies the
//   algorithm's factor (2(n-1)/n for a ring all-reduce, (n-1)/n for the others).
// - Communication is per micro-batch for the four forward/backward phases and once per step
//   (after the micro-batches are accumulated) for FY_PHASE_GRADS. A pattern that keeps no full
//   gradient between micro-batches (zero) reduces it after backward instead, every micro-batch.
// - A tied parameter (OPT's embed_tokens / lm_head) is used by several ops but held, and its
//   gradient reduced, once: memory and gradient reductions count a parameter only at the op that
//   uses it first, the last in backward (fy_pattern_param_elems with owned_only), while gathers
//   before an op's forward and backward count every parameter the op reads.
#ifndef FY_PATTERN_H
#define FY_PATTERN_H

#include <stdbool.h>
#include <stdint.h>

#include "core/graph.h"
#include "core/status.h"

enum fy_comm_op {
  FY_COMM_NONE,
  FY_COMM_ALL_REDUCE,
  FY_COMM_ALL_GATHER,
  FY_COMM_REDUCE_SCATTER,
  FY_COMM_BROADCAST,
  FY_COMM_ALL_TO_ALL,  // bytes: what one rank sends (every rank's rows to their ranks; the expert pattern)
};

// Groups 2 and 3 are expert parallelism's (the expert pattern): the ep ranks of an
// expert-parallel group, and the dp/ep ranks that hold the same experts.
enum { FY_PATTERN_GROUP_DP = 0, FY_PATTERN_GROUP_TP = 1, FY_PATTERN_GROUP_EP = 2, FY_PATTERN_GROUP_EP_REP = 3 };

struct fy_comm_step {
  enum fy_comm_op op;
  double bytes;
  int group;  // FY_PATTERN_GROUP_DP (0), _TP (1), _EP (2) or _EP_REP (3)
};

// What a pattern is asked about.
struct fy_pattern_ctx {
  const struct fy_graph *g;
  int op;                 // index into g->ops: its kind, params and sizes (C, OC, ...)
  int dp, tp;             // data- and tensor-parallel group sizes (ranks = dp * tp)
  int ep;                 // expert-parallel group size, a divisor of dp (0 or 1: none)
  int64_t chunk_elems;    // the plan's chunk size (floats)
  int param_bytes;        // compute dtype bytes (4 fp32, 2 bf16); activations use it too
};

// How the op's parameters lie on one rank.
struct fy_pattern_layout {
  double param_elems_per_rank;  // compute-payload elements of this op's params held per rank
  double optim_elems_per_rank;  // parameter elements whose fp32 optimizer state (master, Adam m
                                //   and v) this rank holds; bytes: fy_pattern_optim_bytes_per_elem
  int split_dim;                // -1 none; 0 the weight's rows (output features), 1 its columns
};

enum {
  FY_PHASE_PRE_FORWARD,
  FY_PHASE_POST_FORWARD,
  FY_PHASE_PRE_BACKWARD,
  FY_PHASE_POST_BACKWARD,
  FY_PHASE_GRADS,
  FY_PHASE_COUNT,
};

// What the runtime (runtime/engine.c) hands a pattern's hooks: one op on one rank. The buffers are
// the kernels' (on a GPU: device memory, in the compute dtype, the work queued on its stream), so
// a hook touches them only through the functions below; n, rows and cols count elements.
struct fy_pattern_run {
  const struct fy_graph *g;
  int op;
  float *out;              // the op's output (forward)
  const float *bias;       // a row-split linear's bias, left out of the kernel for the pattern to add
  float *dinput;           // the input's gradient slot (backward)
  float *dinput_part;      // a column-split linear's input gradient, written apart by the kernel
  // Sums buf over this rank's data-parallel (group 0) or tensor-parallel (group 1) ranks, in place
  // (rank-order sums: the same bits on every rank); nothing for a group of one rank.
  fy_status (*all_reduce)(void *ctx, int group, float *buf, size_t n);
  fy_status (*add)(void *ctx, float *dst, const float *src, size_t n);  // dst += src
  // out (rows, cols) += bias (cols) on every row
  fy_status (*add_bias)(void *ctx, float *out, const float *bias, int64_t rows, int64_t cols);
  void *ctx;
};

#define FY_PATTERN_MAX_STEPS 4   // steps one phase may return
#define FY_PATTERN_NAME_MAX 32   // name length including the terminator
#define FY_PATTERN_MAX 64        // patterns the registry holds

struct fy_pattern {
  const char *name;  // [A-Za-z0-9_.-], as written in plan files
  const char *doc;   // one line
  // Whether the pattern can be given to this op (e.g. tp_col: linear layers only).
  bool (*applies)(const struct fy_pattern_ctx *c);
  void (*layout)(const struct fy_pattern_ctx *c, struct fy_pattern_layout *out);
  // Fills at most `max` steps for `phase` (FY_PHASE_*) and returns how many.
  int (*comm)(const struct fy_pattern_ctx *c, int phase, struct fy_comm_step *steps, int max);
  // Activation memory per rank, in bytes, beyond the graph's own activation and gradient slots
  // (e.g. gathered inputs, or a private buffer a collective needs).
  double (*act_bytes)(const struct fy_pattern_ctx *c);
  // The runtime (optional; NULL: nothing to do): run by the engine on every rank just after the
  // op's kernel, in forward (a recomputed forward included) and in backward. Chunk-level patterns
  // (zero) need none: the chunk cache gathers and reduce-scatters whole chunks.
  fy_status (*post_forward)(const struct fy_pattern_run *r);
  fy_status (*post_backward)(const struct fy_pattern_run *r);
};

// Adds `p` (which must outlive the process's use of the registry; a static const is the rule).
// The name must be valid and unused and every slot non-NULL; else FY_ERR_INVALID.
fy_status fy_pattern_register(const struct fy_pattern *p);
const struct fy_pattern *fy_pattern_find(const char *name);  // NULL if unknown
int fy_pattern_count(void);
const struct fy_pattern *fy_pattern_at(int i);               // NULL out of range
void fy_pattern_register_builtin(void);                      // idempotent

// Costs for the planner.
// Bytes communicated for the op in one step of one micro-batch: every phase's steps summed.
double fy_pattern_comm_bytes(const struct fy_pattern *p, const struct fy_pattern_ctx *c);
// Bytes of optimizer state per parameter element: fp32 m and v, plus an fp32 master copy when
// the compute dtype is narrower than fp32 (on fp32, the master weights are the weights).
int fy_pattern_optim_bytes_per_elem(int param_bytes);
// Bytes of model state this op keeps on one rank: its compute payload (which its gradients
// overwrite) plus its optimizer state — 14 per element for bf16 with everything held.
double fy_pattern_state_bytes(const struct fy_pattern *p, const struct fy_pattern_ctx *c);

// Helpers for writing patterns.
// Elements of the op's parameters; owned_only: only those this op uses first (see above).
// which: 0 all, 1 matrices (rank 2: a linear's weights), 2 vectors (rank 1: biases, norms).
int64_t fy_pattern_param_elems(const struct fy_pattern_ctx *c, int which, bool owned_only);
// Whether each of the op's parameters is read by this op alone (no tied weight to keep in step).
bool fy_pattern_params_private(const struct fy_pattern_ctx *c);
// Size of the group a step runs over (c->dp, c->tp, c->ep or c->dp / c->ep).
int fy_pattern_group_size(const struct fy_pattern_ctx *c, int group);
// Appends a step to steps[0..n) unless its group has one rank or it moves nothing; returns the
// new count. Asserts n < max when a step is added (a pattern never needs more than it allowed).
int fy_pattern_push(const struct fy_pattern_ctx *c, struct fy_comm_step *steps, int n, int max,
                    enum fy_comm_op op, double bytes, int group);
const char *fy_comm_op_name(enum fy_comm_op op);

// The built-ins (planner/patterns/*.c).
extern const struct fy_pattern fy_pattern_replicate;
extern const struct fy_pattern fy_pattern_zero;
extern const struct fy_pattern fy_pattern_tp_col;
extern const struct fy_pattern fy_pattern_tp_row;
extern const struct fy_pattern fy_pattern_expert;

#endif
