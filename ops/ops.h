// Operator kernels (docs/design.md "Conventions"): <op>_forward / <op>_backward, outputs first, then
// inputs, then sizes, each with a shape comment. Backward kernels ACCUMULATE into their gradient
// outputs (+=) unless a comment says otherwise. These are the CPU (fp32) kernels; they run on the
// calling thread with OpenMP threads. Sizes are int64_t where a product may pass 2^31.
//
// Naming inside this header: B batch, T sequence, C channels in, OC channels out, V vocabulary,
// NH heads, HS head size (C = NH * HS), BT = B * T rows.
#ifndef FY_OPS_H
#define FY_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/status.h"

// The sizes (elements of the loop) above which a kernel's loop is split among OpenMP threads; at
// or below them it runs on the calling thread alone (waking the team would cost more than the
// split saves). The planner counts a step's parallel regions with them: on the sim device each
// one wakes the stream thread's team (planner/profile.c).
#define FY_PAR_ELEMENTWISE ((int64_t)1 << 16)  // relu, add, bias add, dropout-add (gelu: 1/8 of it)
#define FY_PAR_ROWS ((int64_t)1 << 14)         // layernorm, cross-entropy, bias sums: rows x width
#define FY_PAR_EMBEDDING ((int64_t)1 << 15)    // embedding rows x width

// ---- matrix products (ops/cpu/matmul.c, oneDNN; one primitive cached per shape) ----

// c (M,N) = alpha * op(a) @ op(b) + beta * c, row-major; op(a) is (M,K): a is (M,K) or, with
// ta, (K,M); op(b) is (K,N): b is (K,N) or, with tb, (N,K). beta is 0 or 1 (1 accumulates).
// lda/ldb/ldc are the row strides in elements (0 means packed). Safe to call from one thread at a
// time; parallel inside. beta 0 never reads c; c must not overlap a or b.
fy_status fy_matmul(float *c, const float *a, const float *b, int64_t M, int64_t N, int64_t K,
                    bool ta, bool tb, float alpha, float beta);
// Same, with strided batches (for attention): `batch` products, each matrix at a + i*stride_a...
// (a stride of 0 means packed: M*K, K*N, M*N).
fy_status fy_matmul_batched(float *c, const float *a, const float *b, int64_t batch, int64_t M,
                            int64_t N, int64_t K, bool ta, bool tb, float alpha, float beta,
                            int64_t lda, int64_t ldb, int64_t ldc, int64_t stride_a,
                            int64_t stride_b, int64_t stride_c);
// The general form behind both: `bias` (N), when not NULL, is added to every row of every
// product (nn.Linear's bias fused into the product).
fy_status fy_matmul_bias(float *c, const float *a, const float *b, const float *bias, int64_t batch,
                         int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha, float beta,
                         int64_t lda, int64_t ldb, int64_t ldc, int64_t stride_a, int64_t stride_b,
                         int64_t stride_c);
// The product of operands that hold bf16 values (16-bit numerics on the CPU), c (M,N) = op(a) @
// op(b) + bias + beta * c, packed: where the processor multiplies bf16 in hardware
// (fy_matmul_bf16_native), a and b are converted to bf16 (exactly) and multiplied with fp32
// accumulation, as a GPU's bf16 product is: ~5x the fp32 rate on AMX, ~2x on AMD's AVX512-BF16.
// Elsewhere, fy_matmul_bias (the same products but for the order of the fp32 additions).
fy_status fy_matmul16(float *c, const float *a, const float *b, const float *bias, int64_t M, int64_t N, int64_t K,
                      bool ta, bool tb, float beta);
// Whether fy_matmul16 multiplies in bf16: AMX in oneDNN's effective ISA (ONEDNN_MAX_CPU_ISA caps
// it), or AVX512-BF16 there on an AMD processor.
bool fy_matmul_bf16_native(void);
// Frees the cached primitives (at exit; tests call it to stay leak-free).
void fy_matmul_cache_clear(void);

// ---- embedding: row lookup; used for tokens and for learned positions ----

// ids (BT) int32, table (V,C) -> out (BT,C). out = table[ids].
void fy_embedding_forward(float *out, const int32_t *ids, const float *table, int64_t BT,
                          int64_t C);
// dout (BT,C) -> dtable (V,C) += scatter-add by ids. Deterministic (no atomics on floats).
void fy_embedding_backward(float *dtable, const float *dout, const int32_t *ids, int64_t BT,
                           int64_t C, int64_t V);

// ---- layernorm (eps as given by the model, OPT uses 1e-5); weight/bias may be NULL ----

// inp (BT,C), weight (C), bias (C) -> out (BT,C), mean (BT), rstd (BT)
void fy_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                          const float *weight, const float *bias, int64_t BT, int64_t C, float eps);
// dout (BT,C), inp, mean, rstd -> dinp (BT,C) +=, dweight (C) +=, dbias (C) += (any may be NULL)
void fy_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                           const float *inp, const float *weight, const float *mean,
                           const float *rstd, int64_t BT, int64_t C);
// The parameter half alone: dweight (C), dbias (C) (NULL to skip), += when accumulate, else =;
// does not read the weights, so the gradients may be written over them.
void fy_layernorm_backward_params(float *dweight, float *dbias, const float *dout,
                                  const float *inp, const float *mean, const float *rstd,
                                  int64_t BT, int64_t C, bool accumulate);

// ---- linear: out = inp @ weight^T + bias (PyTorch's nn.Linear); bias may be NULL ----
//
// Parameter gradients may also be written (=) instead of accumulated: the first gradient a
// parameter receives in a backward pass overwrites, so that it can land over the weights in the
// same memory (chunks, docs/design.md) without a zeroing pass. The weights are not read then.
// bf16: inp, weight and dout hold bf16 values (a bf16 model on the CPU); the products then go
// through fy_matmul16.

// inp (BT,C), weight (OC,C), bias (OC) -> out (BT,OC)
fy_status fy_linear_forward(float *out, const float *inp, const float *weight, const float *bias,
                            int64_t BT, int64_t C, int64_t OC, bool bf16);
// dout (BT,OC) -> dinp (BT,C) +=, dweight (OC,C) +=, dbias (OC) +=. Any of dinp/dweight/dbias may
// be NULL to skip it.
fy_status fy_linear_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                             const float *inp, const float *weight, int64_t BT, int64_t C,
                             int64_t OC, bool bf16);
// dout (BT,OC), inp (BT,C) -> dweight (OC,C), dbias (OC) (NULL to skip): += when accumulate,
// else =. dweight and dbias may be the memory of the weights and bias themselves.
fy_status fy_linear_backward_params(float *dweight, float *dbias, const float *dout,
                                    const float *inp, int64_t BT, int64_t C, int64_t OC,
                                    bool accumulate, bool bf16);

// ---- causal multi-head attention with a padding mask ----

// qkv (B,T,3C) holds q, k, v side by side per row (q at [0,C), k at [C,2C), v at [2C,3C)), head h
// at columns [h*HS,(h+1)*HS) of each. mask (B,T) int32, 1 = real token, 0 = padding; NULL = all 1.
// Query t of batch b attends to keys s <= t with mask[b,s] = 1. scores = q.k * scale. A query with
// no key to attend to (only possible with left padding) gets a zero output and zero gradient.
// -> out (B,T,C) (heads concatenated), att (B,NH,T,T) the softmax probabilities (kept for backward;
// entries for s > t are 0).
fy_status fy_attention_forward(float *out, float *att, const float *qkv, const int32_t *mask,
                               int64_t B, int64_t T, int64_t C, int64_t NH, float scale);
// dout (B,T,C), qkv, att -> dqkv (B,T,3C) +=. scratch holds B*NH*T*T floats.
fy_status fy_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                                const float *att, int64_t B, int64_t T, int64_t C, int64_t NH,
                                float scale);
// The oneDNN products and parallel loops one forward (or backward) call makes: what it costs in
// hand-offs to OpenMP's threads besides its work (the planner prices them on the sim device).
int64_t fy_attention_kernel_calls(int64_t B, int64_t T, bool backward);
// New tokens against the keys and values of the tokens before them (incremental decoding, as
// ferry sample does): qkv (n,3C) of the tokens at positions len .. len+n-1 -> their keys and
// values into rows len .. len+n-1 of kcache and vcache (cap,C); out (n,C) = per head and token t,
// softmax(scale q.k) over cache rows 0..len+t, times their values. att: NH*n*cap floats of
// scratch (several tokens go through products, as fy_attention_forward's; one through loops).
// Rows len .. len+n-1 of fy_attention_forward without a mask (the same sums, in another order).
fy_status fy_attention_decode(float *out, float *kcache, float *vcache, float *att, const float *qkv, int64_t len,
                              int64_t n, int64_t cap, int64_t C, int64_t NH, float scale);

// ---- elementwise ----

// inp (N) -> out (N) = max(inp, 0)
void fy_relu_forward(float *out, const float *inp, int64_t N);
// dout (N), out (N) (the forward output) -> dinp (N) += dout * (out > 0); in place when dinp is
// dout (the graph's shared gradient buffer, fy_op.grad_shared): dinp = dout * (out > 0)
void fy_relu_backward(float *dinp, const float *dout, const float *out, int64_t N);
// inp (N) -> out (N) = inp * Phi(inp) (gelu with erf, as PyTorch's default)
void fy_gelu_forward(float *out, const float *inp, int64_t N);
// dout (N), inp (N) (the forward input) -> dinp (N) += dout * gelu'(inp); in place when dinp is
// dout: dinp = dout * gelu'(inp)
void fy_gelu_backward(float *dinp, const float *dout, const float *inp, int64_t N);
// a (N), b (N) -> out (N) = a + b
void fy_add_forward(float *out, const float *a, const float *b, int64_t N);
// dout (N) -> da (N) +=, db (N) += (either may be NULL)
void fy_add_backward(float *da, float *db, const float *dout, int64_t N);
// bias (C) -> out (rows,C) += bias on every row (a row-split linear's bias, added after the sum of
// its partial products: planner/patterns/tp_row.c)
void fy_bias_add(float *out, const float *bias, int64_t rows, int64_t C);

// ---- mixture of experts (ops/cpu/moe.c; core/graph.h FY_OP_MOE) ----
//
// route (BT, E+3K), per token: the router's softmax over the E experts, the K chosen (expert ids
// as floats, the most probable first, the lower id on a tie), their weights (the chosen
// probabilities over their sum) and their rows in the dispatch layout (floats: exact below 2^24).
// rows: fy_moe_rows_cap(BT,E,K) x F floats of the experts' fc1 outputs (before the activation),
// then as many x C of their fc2 outputs (before the weights), expert e's block of fy_moe_rows(n_e)
// rows after expert e-1's. balance = E x sum_e f_e P_e (the Switch/Mixtral load-balancing term:
// f_e the token-choices routed to e over BT, each of the K choices counted; P_e the mean
// probability of e over the tokens); the caller scales it by its coefficient.
// Padding (mask 0, the attention mask's padding) is routed to no expert, as if every router logit
// of it were masked: its choices and rows are -1 and its weights 0 in route, its output row is 0
// (the layer passes the residual alone), it has no gradient through the block, and f_e and P_e
// are over the routed tokens only (none: balance 0).
struct fy_moe_dims {
  int64_t BT, C, F;      // tokens, model width, an expert's feed-forward width
  int E, K;              // experts, experts a token
  bool gelu;             // the experts' activation: gelu (else relu)
  bool bf16;             // the experts' products with bf16 operands, as fy_linear_forward's
  const int32_t *mask;   // (BT): 0 = padding, routed to no expert; NULL: every token routed
  enum fy_dtype block_grads;  // fy_moe_experts_backward: each block's weight gradients rounded to this
                              // dtype before they add (16-bit numerics); FY_F32 (0): not rounded
  // Tensor parallelism (planner/patterns/expert.c): w1, b1 and w2 are this rank's slices of every expert
  // (F its share of the rows of fc1, the same columns of fc2) and tp_sum(tp_ctx, buf, n) sums n
  // floats over the group in place (the same bits on every rank). Forward sums the output (each
  // rank's experts' products are partial), backward the routing weights' gradients (BT,K) and the
  // experts' part of the input's gradient; fc2's bias is given to one rank of the group alone, so
  // that it is in the sum once. The routing, the balance term and the router's gradient are then
  // the same on every rank. NULL: one rank holds the experts whole.
  fy_status (*tp_sum)(void *tp_ctx, float *buf, int64_t n);
  void *tp_ctx;
};
// inp (BT,C), gate (E,C), w1 (E*F,C), b1 (E*F) or NULL, w2 (E*C,F), b2 (E*C) or NULL
//   -> out (BT,C), route, rows, *balance
fy_status fy_moe_forward(float *out, float *route, float *rows, double *balance, const float *inp, const float *gate,
                         const float *w1, const float *b1, const float *w2, const float *b2,
                         const struct fy_moe_dims *d);
// inp (BT,C), gate (E,C) -> route's first E+2K columns per token (the softmax, the K chosen, their
// weights): forward's routing alone, the same bits, so that an offloaded step knows which experts'
// weights to load before their products run (runtime/offload.c).
fy_status fy_moe_route(float *route, const float *inp, const float *gate, const struct fy_moe_dims *d);
// route, dw (BT,K) the gradients of each token's K weights, n (E) the experts' token-choices ->
// dlog (BT,E): the gradient of the router's logits (fy_moe_backward's and fy_moe_route_backward's)
void fy_moe_router_dlogits(float *dlog, const float *route, const float *dw, const int64_t *n, float dbalance,
                           const struct fy_moe_dims *d);
// dout (BT,C) and forward's tensors; dbalance = d(objective)/d(balance) -> dinp (BT,C) += (NULL:
// not wanted), dgate (E,C), dw1, db1, dw2, db2 = (or += with accumulate). An expert that got no
// token has a zero gradient (left as it is with accumulate), and its weights are not read. Without
// accumulate a gradient may be its weight's memory (dgate = gate, dw1 = w1, ...: an offloaded step
// writes gradients over the weights): every weight is read before its gradient is written. The routing itself (top-K) has no
// gradient; its weights do, through the renormalisation and the softmax, and so does P_e.
fy_status fy_moe_backward(float *dinp, float *dgate, float *dw1, float *db1, float *dw2, float *db2, const float *dout,
                          const float *inp, const float *route, const float *rows, const float *gate, const float *w1,
                          const float *w2, float dbalance, bool accumulate, const struct fy_moe_dims *d);
// The kernels keep their gathered rows and scratch from call to call (fy_moe_rows_cap's rows of the
// largest call so far); this frees them (fy_matmul_cache_clear calls it with the products' caches).
// fy_moe_workspace: that scratch, at least `floats` of it (its contents not kept; NULL: no memory).
float *fy_moe_workspace(size_t floats);
void fy_moe_workspace_free(void);

// ---- mixture of experts in pieces, for expert parallelism (ops/cpu/moe_ep.c; runtime/ep.c) ----
//
// The arithmetic of fy_moe_forward / fy_moe_backward split where the rows leave for the ranks
// that hold their experts and come back. route as above, but the row field holds the token-choice's
// row in the unpadded dispatch order (expert by expert, tokens in order); n (E): the rows of each
// expert. A block is one source's rows for one expert (ex[i] its index among the experts w1, w2
// hold, cnt[i] its rows), computed as one product of fy_moe_rows(cnt[i]) rows as fy_moe_forward
// computes an expert; blocks lie one after another, unpadded in x, y, dy, dx, padded (rounding rows
// zero) in xpad (rows, C) and hpad (rows, F), rows = fy_moe_blocks_rows.
// inp (BT,C), gate (E,C) -> route (fy_moe_route's, and the rows in dispatch order), n (E), *balance
// (fy_moe_forward's)
fy_status fy_moe_route_rows(float *route, int64_t *n, double *balance, const float *inp, const float *gate,
                           const struct fy_moe_dims *d);
// xs (BT*K, C) <- each token's row once per choice, in the dispatch order
void fy_moe_dispatch(float *xs, const float *inp, const float *route, const struct fy_moe_dims *d);
int64_t fy_moe_blocks_rows(const int64_t *cnt, int nb);
// x (sum cnt, C), w1 (E'*F,C), b1, w2 (E'*C,F), b2 (the held experts') -> y (sum cnt, C), xpad, hpad
fy_status fy_moe_experts_forward(float *y, float *xpad, float *hpad, const float *x, const int *ex, const int64_t *cnt,
                                 int nb, const float *w1, const float *b1, const float *w2, const float *b2,
                                 const struct fy_moe_dims *d);
// dy (sum cnt, C), forward's xpad, hpad -> dx (sum cnt, C); dw1, db1, dw2, db2 of the `experts`
// held: the sum of their blocks' gradients in block order (=, or += with accumulate), each rounded
// to d->block_grads first, zero for an expert without blocks or rows. Every block's products with
// w1 and w2 come before any gradient is written, so that (without accumulate) dw1 and dw2 may be
// w1's and w2's memory. The scratch is fy_moe_workspace's.
fy_status fy_moe_experts_backward(float *dx, float *dw1, float *db1, float *dw2, float *db2, const float *dy,
                                  const float *xpad, const float *hpad, const int *ex, const int64_t *cnt, int nb,
                                  const float *w1, const float *w2, int experts, bool accumulate,
                                  const struct fy_moe_dims *d);
// route, y (BT*K, C) in the dispatch order -> out (BT,C) = sum_j weight_j y[row j]
void fy_moe_combine(float *out, const float *route, const float *y, const struct fy_moe_dims *d);
// dout (BT,C), route, y -> dy (BT*K, C) in the dispatch order, dw (BT,K) the weights' gradients
void fy_moe_combine_backward(float *dy, float *dw, const float *dout, const float *route, const float *y,
                             const struct fy_moe_dims *d);
// dw, dx (BT*K, C) in the dispatch order, inp, route, gate, n -> dinp (BT,C) += (NULL: not
// wanted), dgate (E,C) = (+= with accumulate; gate is read first: dgate may be its memory)
fy_status fy_moe_route_backward(float *dinp, float *dgate, const float *dw, const float *dx, const float *inp,
                                const float *route, const float *gate, const int64_t *n, float dbalance,
                                bool accumulate, const struct fy_moe_dims *d);

// ---- dropout on a residual branch, fused with the add (OPT: before each residual add) ----
//
// The mask is drawn, never stored, from key (fy_dropout_key: the seed and the site) and the
// token: row r of the call is token u0 + r of the data stream, column j its j-th feature
// (ops/dropout.h), so backward regenerates the forward's. p in [0,1); 0 is fy_add_forward.

// a (rows,C) the residual, b (rows,C) the branch -> out (rows,C) = a + b * keep / (1 - p)
void fy_dropout_add_forward(float *out, const float *a, const float *b, int64_t rows, int64_t C, uint64_t key,
                            int64_t u0, float p);
// dout (rows,C) -> da (rows,C) += dout, db (rows,C) += dout * keep / (1 - p) (either may be NULL)
void fy_dropout_add_backward(float *da, float *db, const float *dout, int64_t rows, int64_t C, uint64_t key,
                             int64_t u0, float p);

// ---- softmax cross-entropy over the vocabulary ----

// logits (BT,V), targets (BT) int32 (-100 = ignored) -> losses (BT) (0 where ignored).
// Returns the number of targets not ignored. A target outside [0,V) other than -100 is a caller
// error (the data loader checks tokens).
int64_t fy_crossentropy_forward(float *losses, const float *logits, const int32_t *targets,
                                int64_t BT, int64_t V);
// logits (BT,V), targets -> dlogits (BT,V) = dloss * (softmax(logits) - onehot(target)), and 0 on
// ignored rows. OVERWRITES (not +=), and dlogits may be the same buffer as logits (in place).
void fy_crossentropy_backward(float *dlogits, const float *logits, const int32_t *targets,
                              int64_t BT, int64_t V, float dloss);

// ---- optimizer ----

// AdamW with PyTorch's semantics (torch.optim.AdamW): decoupled weight decay
// p -= lr*wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
// p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). t counts from 1. grad_scale
// multiplies g first (clipping and gradient averaging without another pass).
void fy_adamw_update(float *param, float *m, float *v, const float *grad, int64_t n, float lr,
                     float beta1, float beta2, float eps, float weight_decay, int64_t t,
                     float grad_scale);
// The same reading bf16 gradients from gw and writing the updated weights back there in bf16
// (round to nearest even): an offloaded chunk's gradients come home over its bf16 weights, and one
// pass turns them into the next weights (runtime/offload.c). Equal to fy_adamw_update on the
// widened gradients followed by that rounding.
void fy_adamw_update_bf16(float *param, float *m, float *v, uint16_t *gw, int64_t n, float lr, float beta1,
                          float beta2, float eps, float weight_decay, int64_t t, float grad_scale);
// Sum of squares of x (N), accumulated in double for a placement-independent norm.
double fy_sumsq(const float *x, int64_t n);
// The same of bf16 values: equal to fy_sumsq of them widened.
double fy_sumsq_bf16(const uint16_t *x, int64_t n);

// ---- AdamW with compressed state (ops/cpu/adamw_state.c) ----
//
// m and v may be stored in three formats. One moment (m or v) of n elements is one buffer of
// fy_state_moment_bytes(format, n) bytes:
// - FY_STATE_F32: n floats (fy_adamw_update's state).
// - FY_STATE_BF16: n bf16 values (uint16_t), rounded to nearest even on every store.
// - FY_STATE_Q8: block-wise quantised 8-bit state (the 8-bit optimizers of Dettmers et al.):
//   n one-byte codes at byte 0 (m: int8_t, v: uint8_t), then, at byte fy_q8_scales_offset(n),
//   one float scale (the block's absolute maximum) per block of FY_Q8_BLOCK elements, block b
//   holding elements [b * FY_Q8_BLOCK, (b + 1) * FY_Q8_BLOCK) of the buffer (the last one may be
//   short). Element i is scale[i / FY_Q8_BLOCK] * code_value[code[i]], with the codes of
//   fy_q8_code_values. A buffer's layout depends on its n: always pass a buffer the n it was made
//   with. Blocks are counted from the start of the buffer passed in, so the same elements fall in
//   the same blocks only when buffers start at multiples of FY_Q8_BLOCK of a common origin (a
//   rank's shard of a chunk must start at a multiple of FY_Q8_BLOCK for its state to be the
//   unsharded run's).
//
// Block size 256 (bitsandbytes' 8-bit optimizers use 2048 in the paper and 256 in later
// versions): a block is one CUDA thread block of 256 threads, one element a thread, with no loop;
// a scale costs 4/256 of a byte an element (m and v: 2.03 bytes a parameter against 2.004 at
// 2048, under 1.5% more); and a smaller block confines an outlier's loss of resolution to 255
// neighbours instead of 2047, and lets a chunk's shard boundaries (multiples of 256 elements)
// keep their blocks aligned.
#define FY_Q8_BLOCK 256

enum fy_state_format { FY_STATE_F32, FY_STATE_BF16, FY_STATE_Q8 };
enum fy_moment { FY_MOMENT_M, FY_MOMENT_V };

// "fp32", "bf16", "8bit" (the --optimizer-state names), and back (false for another name, *f
// untouched).
const char *fy_state_format_name(enum fy_state_format f);
bool fy_state_format_from_name(const char *name, enum fy_state_format *f);
// Bytes of one moment's buffer of n elements (codes, padding and scales for FY_STATE_Q8), and of
// m and v together (2 x that): what the planner and the runtime count per n parameters.
size_t fy_state_moment_bytes(enum fy_state_format f, int64_t n);
size_t fy_state_bytes(enum fy_state_format f, int64_t n);
// FY_STATE_Q8: blocks of n elements, and the byte offset of their scales in a moment's buffer
// (n rounded up to 64, so the scales start on a cache line).
int64_t fy_q8_blocks(int64_t n);
size_t fy_q8_scales_offset(int64_t n);

// The 8-bit codes: small floats relative to the block's absmax. A code's magnitude k = 8 e + f
// (e the exponent, f 3 mantissa bits) has the value f 2^-S for e = 0 (subnormals, step 2^-S) and
// (8 + f) 2^(e-1-S) for e >= 1. m (int8_t, the code of -x is -k): S = 17, 4 exponent bits, the top
// code k = 120 is exactly 1 (codes 121..127 and -128 are never written; they read as the formula
// goes on, -128 as -2), the smallest nonzero 2^-17 = 7.6e-6. v (uint8_t): S = 33, 5 exponent
// bits, the top code 248 is 1 (249..255 never written), the smallest nonzero 2^-33 = 1.2e-10, so
// that sqrt(v) reaches about as far below its absmax as m (2^-16.5). Each binade holds 8 values,
// the relative spacing 1/8 to 1/16: a float with 4 significant bits. The codes' values by byte
// ((uint8_t)code), exact in float: in [-2, 1.875] and [0, 1.875].
const float *fy_q8_code_values(enum fy_moment which);

// Quantisation of a block (to the LAST code, the CUDA kernels' too): absmax = the largest |x| of
// the block's values; a block holding a NaN or an infinity stores scale NaN and all codes 0 (it
// reads back as NaN, as fp32 state would, rather than as a finite lie); absmax 0 stores scale 0
// and codes 0. Otherwise a value x stores the code nearest to the ratio r = |x| * (1 / absmax),
// the reciprocal rounded to float and the product rounded to float (round to nearest even), both
// as if float's exponent had no bounds (it matters only for absmax below 2^-126 or from 2^126 on,
// and the code makes up for it exactly); nearest in exact arithmetic, a tie going to the even
// magnitude k (round to nearest even on the code's 3 mantissa bits); r <= 1 + 2^-23, so the
// absmax element stores the top code and reads back exactly. For m the sign of x is the code's
// sign (0 for r rounding to 0). For v, a positive value whose nearest magnitude is 0 stores the
// smallest positive code instead: a stored v is 0 only where the value was, so a tiny v beside a
// large one in its block never turns m / (sqrt(v) + eps) into m / eps. Negative v (never written
// by the update) stores 0. Error of a round trip: for |x| >= absmax 2^(3-S) (the normal binades)
// |x - read back| <= |x| (1/17 + 2^-21) (the worst, 1/17, at r = 2^e (1 + 1/16)); below, half
// the step, absmax 2^-(S+1) (v's positive values below that step: absmax 2^-S), plus the read
// back product's rounding.

// A run of a buffer's elements [off, off + n) updated with weight decay weight_decay. A call
// takes the ranges of the whole buffer at once (sorted by off, disjoint, inside [0, n)), so that
// a block shared by two parameters with different decay is requantised once, after both are
// updated. Elements in no range (padding between parameters) are not updated: their param and
// gradient are neither read nor written, their m and v keep their values (in FY_STATE_Q8 they are
// requantised with their block's new scale, as any other element).
struct fy_adamw_range {
  int64_t off, n;
  float weight_decay;
};

// FY_OK when ranges (n_ranges; NULL if 0) are sorted, disjoint, of n >= 0 and inside [0, n); else
// FY_ERR_INVALID with the first bad range.
fy_status fy_adamw_ranges_check(int64_t n, const struct fy_adamw_range *ranges, int n_ranges);

// param (n), m and v buffers of format f (n elements each), grad (n) -> param, m, v updated:
// m and v read back to float, fy_adamw_update's formula and order of operations on each element
// of each range (per-step constants computed in double as there; no fused multiply-adds), param
// written, m and v stored back (FY_STATE_Q8: the block's new scale from the updated values, then
// each value's code; the update itself uses the unrounded new m and v). FY_STATE_F32 calls
// fy_adamw_update on each range: the same bits as today. Parallel over blocks (FY_STATE_Q8) or
// elements with OpenMP; the result does not depend on the thread count. Fails (FY_ERR_INVALID)
// only on bad ranges or t < 1, before anything is written.
fy_status fy_adamw_state_update(enum fy_state_format f, float *param, void *m, void *v, const float *grad,
                                int64_t n, const struct fy_adamw_range *ranges, int n_ranges, float lr,
                                float beta1, float beta2, float eps, int64_t t, float grad_scale);
// The same with bf16 gradients in gw and the new weights written back there in bf16 (round to
// nearest even), as fy_adamw_update_bf16. Elements in no range keep their gw.
fy_status fy_adamw_state_update_bf16(enum fy_state_format f, float *param, void *m, void *v, uint16_t *gw,
                                     int64_t n, const struct fy_adamw_range *ranges, int n_ranges, float lr,
                                     float beta1, float beta2, float eps, int64_t t, float grad_scale);
// Out of place, for speculative updates (a chunk updated into a spare slot before the gradient
// norm is known, its old weights and state kept for a redo): param, m, v (format f, n elements)
// and either grad (fp32 gradients, w16_out NULL) or gw (bf16 gradients, w16_out non-NULL), the
// other NULL -> param_out, m_out, v_out (and w16_out) = byte for byte what
// fy_adamw_state_update(_bf16) would leave in param, m, v (and gw), the whole buffers (8-bit: the
// padding before the scales copied too); the inputs are not written. Elements in no range are
// copied (8-bit: requantised with their block, as in place). One pass over the buffers; the
// outputs must not overlap the inputs. Parallel with OpenMP; the result does not depend on the
// thread count. Fails (FY_ERR_INVALID) as the in-place update, and on a wrong choice of grad, gw
// and w16_out, before anything is written.
fy_status fy_adamw_state_update_into(enum fy_state_format f, float *param_out, void *m_out, void *v_out,
                                     uint16_t *w16_out, const float *param, const void *m, const void *v,
                                     const float *grad, const uint16_t *gw, int64_t n,
                                     const struct fy_adamw_range *ranges, int n_ranges, float lr, float beta1,
                                     float beta2, float eps, int64_t t, float grad_scale);
// Conversions for checkpoints and for changing format: src (n) float -> dst, one moment's buffer
// of format f (the stores of the update: bf16 round to nearest even, 8-bit as above); and back,
// dst (n) = the values the update would read. In parallel over blocks for large n.
void fy_state_encode(enum fy_state_format f, enum fy_moment which, void *dst, const float *src, int64_t n);
void fy_state_decode(enum fy_state_format f, enum fy_moment which, float *dst, const void *src, int64_t n);

#endif
