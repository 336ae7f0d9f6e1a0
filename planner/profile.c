#include "planner/profile.h"

#include <string.h>

#include "ops/ops.h"

// Attention's small batched products run at about half the rate of the large GEMMs (measured
// with ferry train --profile on opt-125m: ~100-140 GFLOP/s against ~210).
#define ATTENTION_EFFICIENCY 0.55

double fy_profile_mem_rate(const struct fy_probe *p) { return fy_probe_device_mem_gbps(p) * 1e9; }

// The input gradients an add's backward writes: those not sharing its output's (core/graph.h).
static int add_own_grads(const struct fy_op *op) {
  int n = 0;
  for (int k = 0; k < op->n_in; k++) n += !fy_op_grad_handed_down(op, k);
  return n;
}

// ---- each op kind's costs ----
// cost: the FLOPs and memory bytes of the op's forward [0] and backward [1] and its workspace, ab
// bytes an element. regions: the parallel regions of one call of the op's CPU kernels, forward
// [0] and backward [1]: a oneDNN product each, a loop each when it is large enough to be split
// (ops/ops.h's FY_PAR_*; a smaller one runs on the calling thread and wakes no team). bf16_products:
// a bf16 linear's products are bf16 ones (the probe's bf16_speedup is not exactly 1), each
// converting both its operands first (ops/cpu/matmul.c, fy_matmul16: a loop each). The rounding
// passes of 16-bit precision come after, for every kind (cpu_regions).

static void linear_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  (void)ab;
  const double BT = (double)g->B * (double)g->T;
  out->flops[0] = 2 * BT * (double)op->C * (double)op->OC;
  out->flops[1] = 2 * out->flops[0];
}
static void linear_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute, bool bf16_products,
                           double r[2]) {
  const double BT = (double)g->B * (double)g->T, C = (double)op->C, OC = (double)op->OC;
  const double ew = (double)FY_PAR_ELEMENTWISE, rows = (double)FY_PAR_ROWS;
  // the product; the input's and the weight's products, and the bias's sums
  r[0] = 1;
  r[1] = 2 + (op->has_bias && BT * OC > rows ? 1 : 0);
  if (compute == FY_BF16 && bf16_products) {
    const double in = BT * C > ew, w = OC * C > ew, out = BT * OC > ew;
    r[0] += in + w;                        // input, weight
    r[1] += (out + w) + (out + in);        // dout and weight; dout and input
  }
}

static void attention_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  const double B = (double)g->B, T = (double)g->T;
  out->flops[0] = 4 * B * T * T * (double)op->C;
  out->flops[1] = 2 * out->flops[0];
  out->workspace_bytes = (double)g->scratch_elems * ab;
}
static void attention_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute,
                              bool bf16_products, double r[2]) {
  (void)op, (void)compute, (void)bf16_products;
  for (int b = 0; b < 2; b++) r[b] = (double)fy_attention_kernel_calls(g->B, g->T, b);
}

static void layernorm_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  const double BTC = (double)g->B * (double)g->T * (double)op->C;
  out->mem_bytes[0] = BTC * ab * 2;
  out->mem_bytes[1] = BTC * ab * 4;
}
static void layernorm_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute,
                              bool bf16_products, double r[2]) {
  (void)compute, (void)bf16_products;
  // backward: the input's gradient, then the parameters'
  r[0] = (double)g->B * (double)g->T * (double)op->C > (double)FY_PAR_ROWS ? 1 : 0;
  r[1] = r[0] * (op->n_params ? 2 : 1);
}

// relu and gelu (gelu's erf is a few dozen flops an element: still memory-bound)
static void elementwise_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  out->mem_bytes[0] = (double)g->slots[op->out].numel * ab * 2;
  out->mem_bytes[1] = (double)g->slots[op->out].numel * ab * 3;
}
static void relu_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute, bool bf16_products,
                         double r[2]) {
  (void)compute, (void)bf16_products;
  r[0] = r[1] = (double)g->slots[op->out].numel > (double)FY_PAR_ELEMENTWISE ? 1 : 0;
}
static void gelu_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute, bool bf16_products,
                         double r[2]) {
  (void)compute, (void)bf16_products;
  r[0] = r[1] = (double)g->slots[op->out].numel > (double)FY_PAR_ELEMENTWISE / 8 ? 1 : 0;
}

// backward: an input's own gradient zeroed, then dout added (none for a shared one)
static void add_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  out->mem_bytes[0] = (double)g->slots[op->out].numel * ab * 3;
  out->mem_bytes[1] = (double)g->slots[op->out].numel * ab * 4 * add_own_grads(op);
}
static void add_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute, bool bf16_products,
                        double r[2]) {
  (void)compute, (void)bf16_products;
  // backward: a loop for each input's gradient but those sharing the output's
  r[0] = (double)g->slots[op->out].numel > (double)FY_PAR_ELEMENTWISE ? 1 : 0;
  r[1] = r[0] * add_own_grads(op);
}

static void embedding_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  out->mem_bytes[0] = out->mem_bytes[1] = (double)g->B * (double)g->T * (double)op->C * ab * 2;
}
static void embedding_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute,
                              bool bf16_products, double r[2]) {
  (void)compute, (void)bf16_products;
  r[0] = r[1] = (double)g->B * (double)g->T * (double)op->C > (double)FY_PAR_EMBEDDING ? 1 : 0;
}

static void cross_entropy_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  out->mem_bytes[0] = out->mem_bytes[1] = (double)g->B * (double)g->T * (double)op->V * ab * 3;
}
static void cross_entropy_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute,
                                  bool bf16_products, double r[2]) {
  (void)compute, (void)bf16_products;
  r[0] = r[1] = (double)g->B * (double)g->T * (double)op->V > (double)FY_PAR_ROWS ? 1 : 0;
}

// A mixture of experts: the router's product and the K experts' two products a token (the
// rounding rows of fy_moe_rows ignored), backward twice forward; the gathers, the weighted sums and
// the softmax pass over memory. Its workspace (ops/cpu/moe.c's own allocation) is not counted yet.
static void moe_cost(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out) {
  const double BT = (double)g->B * (double)g->T, C = (double)op->C, F = (double)op->OC, E = op->experts,
               K = op->top_k;
  out->flops[0] = 2 * BT * C * E + K * 4 * BT * C * F;
  out->flops[1] = 2 * out->flops[0];
  out->mem_bytes[0] = BT * K * (3 * C + 2 * F) * ab;
  out->mem_bytes[1] = 2 * out->mem_bytes[0];
}
static void moe_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute, bool bf16_products,
                        double r[2]) {
  (void)g, (void)compute, (void)bf16_products;
  // forward: the router's product, the softmax, the gather, two products an expert, the sum;
  // backward: three loops, four products an expert, the router's two
  r[0] = 4 + 2.0 * op->experts;
  r[1] = 5 + 4.0 * op->experts;
}

// The planner's table of op kinds: a new op kind is one line here. efficiency: the share of the
// probed GEMM rate the op's FLOPs run at.
static const struct profile_kind {
  void (*cost)(const struct fy_graph *g, const struct fy_op *op, int ab, struct fy_op_profile *out);
  void (*regions)(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute, bool bf16_products,
                  double r[2]);
  double efficiency;
} profile_kinds[] = {
    [FY_OP_EMBEDDING] = {embedding_cost, embedding_regions, 1.0},
    [FY_OP_LAYERNORM] = {layernorm_cost, layernorm_regions, 1.0},
    [FY_OP_LINEAR] = {linear_cost, linear_regions, 1.0},
    [FY_OP_ATTENTION] = {attention_cost, attention_regions, ATTENTION_EFFICIENCY},
    [FY_OP_RELU] = {elementwise_cost, relu_regions, 1.0},
    [FY_OP_ADD] = {add_cost, add_regions, 1.0},
    [FY_OP_CROSS_ENTROPY] = {cross_entropy_cost, cross_entropy_regions, 1.0},
    [FY_OP_GELU] = {elementwise_cost, gelu_regions, 1.0},
    [FY_OP_MOE] = {moe_cost, moe_regions, 1.0},
};
_Static_assert(sizeof profile_kinds / sizeof profile_kinds[0] == FY_OP_KIND_COUNT, "an op kind without costs");

int fy_profile_ops_missing(void) {
  for (int k = 0; k < FY_OP_KIND_COUNT; k++)
    if (k >= (int)(sizeof profile_kinds / sizeof profile_kinds[0]) || !profile_kinds[k].cost ||
        !profile_kinds[k].regions || !(profile_kinds[k].efficiency > 0))
      return k;
  return -1;
}

static const struct profile_kind *kind_of(const struct fy_op *op) {
  FY_ASSERT(op->kind < FY_OP_KIND_COUNT && profile_kinds[op->kind].cost);
  return &profile_kinds[op->kind];
}

// The parallel regions of one call of the op's CPU kernels, forward [0] and backward [1]: the
// kind's own, and in 16-bit precision each rounding pass (runtime/engine.c; fy_round_to_dtype
// splits above FY_PAR_ELEMENTWISE).
static void cpu_regions(const struct fy_graph *g, const struct fy_op *op, enum fy_dtype compute, bool bf16_products,
                        double r[2]) {
  const double numel = (double)g->slots[op->out].numel, ew = (double)FY_PAR_ELEMENTWISE;
  r[0] = r[1] = 0;
  kind_of(op)->regions(g, op, compute, bf16_products, r);
  if (compute == FY_F32) return;
  if (op->kind != FY_OP_CROSS_ENTROPY && numel > ew) r[0] += 1;
  for (int k = 0; k < op->n_in && op->kind != FY_OP_EMBEDDING; k++)
    if ((double)g->slots[op->in[k]].numel > ew && !fy_op_grad_handed_down(op, k)) r[1] += 1;
  for (int k = 0; k < op->n_params; k++)
    if ((double)g->params[op->params[k]].numel > ew) r[1] += 1;
}

void fy_profile_op(const struct fy_graph *g, int o, const struct fy_probe *p, int ab, enum fy_dtype compute,
                   struct fy_op_profile *out) {
  const struct fy_op *op = &g->ops[o];
  memset(out, 0, sizeof *out);
  out->op = o;
  kind_of(op)->cost(g, op, ab, out);
  out->act_bytes = (double)g->slots[op->out].numel * ab;
  for (int k = 0; k < op->n_aux; k++) out->act_bytes += (double)g->slots[op->aux[k]].numel * ab;
  for (int k = 0; k < op->n_params; k++) out->param_bytes += (double)g->params[op->params[k]].numel * ab;
  // Memory-bound kernels run at the device's memory bandwidth.
  bool gpu = strcmp(p->device, "cuda") == 0;
  // On cpu and sim in 16-bit precision: the output rounded (read and written, as floats), and in
  // backward each input's gradient but the token ids' and each parameter's (inside the op's kernel
  // call: no more hand-offs on sim).
  if (!gpu && compute != FY_F32) {
    if (op->kind != FY_OP_CROSS_ENTROPY) out->mem_bytes[0] += (double)g->slots[op->out].numel * 8;
    for (int k = 0; k < op->n_in && op->kind != FY_OP_EMBEDDING; k++)
      out->mem_bytes[1] += (double)g->slots[op->in[k]].numel * 8;
    for (int k = 0; k < op->n_params; k++) out->mem_bytes[1] += (double)g->params[op->params[k]].numel * 8;
  }
  const bool bf16 = compute == FY_BF16 && (gpu || op->kind == FY_OP_LINEAR);
  double gemm = fy_probe_gemm_gflops(p, bf16) * 1e9, mem = fy_profile_mem_rate(p);
  double eff = kind_of(op)->efficiency;
  // On a GPU, a relu or residual add that rides the linear before it (fy_graph_fusion) costs its
  // forward nothing: no pass over memory, no kernel.
  bool fused = gpu && o > 0 && fy_graph_fusion(g, o - 1) != FY_FUSED_NONE;
  if (fused) out->mem_bytes[0] = 0;
  for (int b = 0; b < 2; b++) out->seconds[b] = out->flops[b] / (gemm * eff) + out->mem_bytes[b] / mem;
  cpu_regions(g, op, gpu ? FY_F32 : compute, p->bf16_speedup > 0 && p->bf16_speedup != 1.0, out->kernel_calls);
  if (fused) out->kernel_calls[0] = 0;
}

double fy_profile_op_seconds(const struct fy_graph *g, int o, bool backward, const struct fy_probe *p, int ab,
                             enum fy_dtype compute) {
  struct fy_op_profile pr;
  fy_profile_op(g, o, p, ab, compute, &pr);
  return pr.seconds[backward];
}
