// The CUDA kernels (docs/design.md "Conventions"): the same operators and contracts as ops/ops.h — same
// shapes, backward kernels ACCUMULATE (+=) unless a comment says otherwise — run on a cudaStream_t.
// Pointers are device memory. Activations, weights and their gradients have the element type `dt`:
// FY_F32 or FY_BF16 (anything else is FY_ERR_UNSUPPORTED); arithmetic is fp32 whatever `dt`, and
// statistics (mean, rstd, lse, losses) and optimizer state are always fp32. Every function returns
// after queueing its work; a failure to launch is reported as a fy_status with the CUDA message.
//
// Determinism: no kernel adds floats with atomics. Sums over rows (embedding, layernorm and bias
// gradients), the sum of squares and attention's gradients are reduced in a fixed order, so a rerun
// gives the same bits.
//
// C-callable: the .cu files compile as C++ and define these with C linkage.
#ifndef FY_OPS_CUDA_H
#define FY_OPS_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
// Before the extern "C" block: in C++ these are libstdc++ wrappers that must not get C linkage.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "core/dtype.h"
#include "core/status.h"
#include "ops/cuda/parts.h"
#include "ops/ops.h"

// ---- embedding ----

// ids (BT) int32, table (V,C) -> out (BT,C)
fy_status fy_cuda_embedding_forward(void *out, const int32_t *ids, const void *table,
                                    enum fy_dtype dt, int64_t BT, int64_t C, cudaStream_t st);
// dout (BT,C), ids (BT) -> dtable (V,C) +=. Each thread block owns 64 table rows x 128 channels:
// it picks out, in token order, the tokens whose id it owns (all threads filter the ids together,
// a prefix sum packs the matches), adds their rows into an fp32 tile in shared memory, then adds
// the tile to dtable once. No two blocks touch the same element, so there are no atomics, and the
// rows of one id are summed in token order: the result is deterministic. Ids outside [0,V) are
// ignored.
fy_status fy_cuda_embedding_backward(void *dtable, const void *dout, const int32_t *ids,
                                     enum fy_dtype dt, int64_t BT, int64_t C, int64_t V,
                                     cudaStream_t st);

// ---- layernorm (one row per warp); weight/bias may be NULL ----

// inp (BT,C), weight (C), bias (C) -> out (BT,C), mean (BT) fp32, rstd (BT) fp32 (mean/rstd may be
// NULL when no backward follows)
fy_status fy_cuda_layernorm_forward(void *out, float *mean, float *rstd, const void *inp,
                                    const void *weight, const void *bias, enum fy_dtype dt,
                                    int64_t BT, int64_t C, float eps, cudaStream_t st);
// Row ranges the parameter gradients are split into when scratch is given (FY_CUDA_LN_PARTS,
// ops/cuda/parts.h): scratch then holds 2 * FY_CUDA_LN_PARTS * C floats. Without scratch (NULL)
// one block per 32 channels walks every row: deterministic too, but a narrow layer (C = 768: 24
// blocks) leaves most of the GPU idle.
// dout (BT,C), inp, weight, mean, rstd -> dinp (BT,C) +=, dweight (C) +=, dbias (C) += (any NULL).
// dinp must not overlap dout, inp or weight.
fy_status fy_cuda_layernorm_backward(void *dinp, void *dweight, void *dbias, const void *dout,
                                     const void *inp, const void *weight, const float *mean,
                                     const float *rstd, enum fy_dtype dt, int64_t BT, int64_t C,
                                     float *scratch, cudaStream_t st);
// dout, inp, mean, rstd -> dweight (C), dbias (C): += when accumulate, else = (may overwrite the
// weights themselves: they are not read). scratch as above, or NULL.
fy_status fy_cuda_layernorm_backward_params(void *dweight, void *dbias, const void *dout,
                                            const void *inp, const float *mean, const float *rstd,
                                            enum fy_dtype dt, int64_t BT, int64_t C,
                                            bool accumulate, float *scratch, cudaStream_t st);

// ---- elementwise (outputs may alias inputs) ----

// inp (N) -> out (N) = max(inp, 0)
fy_status fy_cuda_relu_forward(void *out, const void *inp, enum fy_dtype dt, int64_t N,
                               cudaStream_t st);
// dout (N), out (N) -> dinp (N) += dout * (out > 0); in place when dinp is dout: dinp = dout * (out > 0)
fy_status fy_cuda_relu_backward(void *dinp, const void *dout, const void *out, enum fy_dtype dt,
                                int64_t N, cudaStream_t st);
// inp (N) -> out (N) = inp * Phi(inp) (gelu with erf)
fy_status fy_cuda_gelu_forward(void *out, const void *inp, enum fy_dtype dt, int64_t N,
                               cudaStream_t st);
// dout (N), inp (N) (the forward input) -> dinp (N) += dout * gelu'(inp); in place when dinp is
// dout: dinp = dout * gelu'(inp)
fy_status fy_cuda_gelu_backward(void *dinp, const void *dout, const void *inp, enum fy_dtype dt,
                                int64_t N, cudaStream_t st);
// a (N), b (N) -> out (N) = a + b
fy_status fy_cuda_add_forward(void *out, const void *a, const void *b, enum fy_dtype dt, int64_t N,
                              cudaStream_t st);
// dout (N) -> da (N) +=, db (N) += (either may be NULL)
fy_status fy_cuda_add_backward(void *da, void *db, const void *dout, enum fy_dtype dt, int64_t N,
                               cudaStream_t st);
// bias (C) -> out (rows,C) += bias on every row (fy_bias_add)
fy_status fy_cuda_bias_add(void *out, const void *bias, enum fy_dtype dt, int64_t rows, int64_t C, cudaStream_t st);
// The same, then out = max(out, 0) with relu (NaN passes): a product's bias and relu as one kernel
fy_status fy_cuda_bias_add_relu(void *out, const void *bias, bool relu, enum fy_dtype dt, int64_t rows, int64_t C,
                                cudaStream_t st);
// The dropout-add of ops/ops.h (fy_dropout_add_forward, _backward), the same masks:
// a (rows,C) the residual, b (rows,C) the branch -> out (rows,C) = a + b * keep / (1 - p)
fy_status fy_cuda_dropout_add_forward(void *out, const void *a, const void *b, enum fy_dtype dt, int64_t rows,
                                      int64_t C, uint64_t key, int64_t u0, float p, cudaStream_t st);
// dout (rows,C) -> da += dout, db += dout * keep / (1 - p) (either may be NULL)
fy_status fy_cuda_dropout_add_backward(void *da, void *db, const void *dout, enum fy_dtype dt, int64_t rows,
                                       int64_t C, uint64_t key, int64_t u0, float p, cudaStream_t st);

// src (N) of type src_dt -> dst (N) fp32 = src (first) or dst + src, widened exactly: the sum of a
// chunk's gradients over micro-batches.
fy_status fy_cuda_accumulate(float *dst, const void *src, enum fy_dtype src_dt, int64_t N, bool first,
                             cudaStream_t st);

// src (N) -> dst (N) in another float type (f32 <-> bf16; bf16 rounded to nearest even); the same
// type: a copy.
fy_status fy_cuda_convert(void *dst, enum fy_dtype dst_dt, const void *src, enum fy_dtype src_dt,
                          int64_t N, cudaStream_t st);
// ---- softmax cross-entropy (one row per block, online max and sum: no probabilities stored) ----

// logits (BT,V), targets (BT) int32 (-100 = ignored) -> losses (BT) fp32 (0 where ignored), lse (BT)
// fp32 = log(sum(exp(logits))) per row (NULL to skip; lets backward skip its statistics pass).
// Unlike fy_crossentropy_forward, the count of targets not ignored is not returned: the caller has
// the targets on the host.
fy_status fy_cuda_crossentropy_forward(float *losses, float *lse, const void *logits,
                                       const int32_t *targets, enum fy_dtype dt, int64_t BT,
                                       int64_t V, cudaStream_t st);
// logits (BT,V), targets, lse (BT) or NULL -> dlogits (BT,V) = dloss * (softmax - onehot), 0 on
// ignored rows. OVERWRITES (not +=); dlogits may be logits (in place). With lse NULL the row
// statistics are recomputed in the same kernel.
fy_status fy_cuda_crossentropy_backward(void *dlogits, const void *logits, const int32_t *targets,
                                        const float *lse, enum fy_dtype dt, int64_t BT, int64_t V,
                                        float dloss, cudaStream_t st);

// ---- optimizer ----

// param (n) fp32, m (n), v (n), grad (n) of type grad_dt -> param, m, v updated in place, with the
// formula of fy_adamw_update (ops/ops.h), constants computed in double as there. param_bf16 (n),
// when not NULL, receives the new weights rounded to bf16 (the compute payload), in the same pass.
fy_status fy_cuda_adamw_update(float *param, float *m, float *v, const void *grad,
                               enum fy_dtype grad_dt, uint16_t *param_bf16, int64_t n, float lr,
                               float beta1, float beta2, float eps, float weight_decay, int64_t t,
                               float grad_scale, cudaStream_t st);
// The same with the gradient scale read from device memory when the kernel runs: scale_skip[0]
// the scale, scale_skip[1] != 0 skips the step (nothing is written, param_bf16 neither). For an
// update launched before the step's gradient norm is known on the host (runtime/offload.c).
fy_status fy_cuda_adamw_update_deferred(float *param, float *m, float *v, const void *grad,
                                        enum fy_dtype grad_dt, uint16_t *param_bf16, int64_t n,
                                        float lr, float beta1, float beta2, float eps,
                                        float weight_decay, int64_t t, const float *scale_skip,
                                        cudaStream_t st);

// AdamW with m and v stored as bf16 or 8-bit (ops/cuda/adamw_state.cu; ops/ops.h "AdamW with
// compressed state" for the formats, the buffers' layout and the quantisation rule): the same
// results as fy_adamw_state_update on the CPU to the last bit and code (explicit round-to-nearest
// operations, no fused multiply-adds: unlike fy_cuda_adamw_update, whose fp32 results differ from
// the CPU's by them). f is FY_STATE_BF16 or FY_STATE_Q8 (FY_STATE_F32: fy_cuda_adamw_update, and
// FY_ERR_UNSUPPORTED here). param (n) fp32, m and v (device buffers of
// fy_state_moment_bytes(f, n)), grad (n) of type grad_dt -> updated in place; param_bf16 (n), when
// not NULL, the new weights in bf16, and it may be grad itself (bf16 gradients in, bf16 weights
// out, as fy_adamw_state_update_bf16). ranges (n_ranges) are in DEVICE memory and must satisfy
// fy_adamw_ranges_check (not checked here: check the host copy before uploading it). scale_skip:
// NULL, or device memory read when the kernel runs as in fy_cuda_adamw_update_deferred
// (scale_skip[0] replaces grad_scale, scale_skip[1] != 0 skips the step: nothing is written).
// 8-bit: one thread block of FY_Q8_BLOCK threads per quantisation block; bf16: grid-stride.
fy_status fy_cuda_adamw_state_update(enum fy_state_format f, float *param, void *m, void *v, const void *grad,
                                     enum fy_dtype grad_dt, uint16_t *param_bf16, int64_t n,
                                     const struct fy_adamw_range *ranges, int n_ranges, float lr, float beta1,
                                     float beta2, float eps, int64_t t, float grad_scale, const float *scale_skip,
                                     cudaStream_t st);

// x (n) -> *out (device, double) = (accumulate ? *out : 0) + sum of x^2, accumulated in double.
// A grid of one block per 256 elements, at most FY_CUDA_SUMSQ_PARTS (ops/cuda/parts.h; scratch
// holds that many doubles), writes one partial each to scratch with a fixed tree inside the block;
// one block then adds the partials in a fixed tree. Both depend on n alone: the same bits on every
// run and every GPU model.
fy_status fy_cuda_sumsq(double *out, const void *x, enum fy_dtype dt, int64_t n, double *scratch,
                        bool accumulate, cudaStream_t st);

// ---- matrix products through cuBLASLt ----

// A cuBLASLt handle, a workspace and a cache of matmul descriptors and chosen algorithms per shape
// (dtype, sizes, transposes, bias, beta, pointer alignments). Use from one thread at a time, as
// fy_matmul. The workspace (device memory, 32 MiB is plenty; NULL/0 = none) is the caller's, so
// that it is counted by the device that handed it out; it must outlive the handle. The products
// and the linear backward's bias-gradient parts use it in stream order: launch all of a handle's
// work on one stream at a time.
struct fy_cuda_blas;
fy_status fy_cuda_blas_create(void *workspace, size_t workspace_bytes, struct fy_cuda_blas **out);
void fy_cuda_blas_free(struct fy_cuda_blas *h);
// Times the heuristic's first `candidates` algorithms (at most 16) on each shape's first calls and
// keeps the fastest (0 or 1: the heuristic's first, the default; FERRY_CUDA_GEMM_TUNE=N at create
// sets it too). Results may then differ run to run by float rounding. For shapes not seen yet.
void fy_cuda_blas_set_tuning(struct fy_cuda_blas *h, int candidates);
// fused (the default; FERRY_CUDA_EPILOGUE=fused): the bias and relu of a product ride cuBLASLt's
// epilogue where it has an algorithm for them; false (FERRY_CUDA_EPILOGUE=kernels at create): the
// product runs without them and one kernel adds the bias and applies the relu after it (the sums
// round to the dtype once more before the bias). Whichever is faster depends on the GPU and
// cuBLASLt (bench/gpu_gemm times both). For the calls after it.
void fy_cuda_blas_set_epilogue(struct fy_cuda_blas *h, bool fused);

// c (M,N) = alpha * op(a) @ op(b) + beta * c (+ bias (N) on every row, when not NULL), row-major,
// as fy_matmul: op(a) is (M,K): a is (M,K) or, with ta, (K,M); op(b) is (K,N): b is (K,N) or, with
// tb, (N,K). a, b, c and bias are all of type dt; fp32 compute (true fp32 for FY_F32: no TF32).
// The bias is added unscaled (cuBLASLt's epilogue: c = alpha * a@b + beta * c + bias); with
// alpha != 1 that differs from fy_matmul_bias, whose oneDNN output scale scales the bias too.
fy_status fy_cuda_matmul(struct fy_cuda_blas *h, void *c, const void *a, const void *b,
                         const void *bias, enum fy_dtype dt, int64_t M, int64_t N, int64_t K,
                         bool ta, bool tb, float alpha, float beta, cudaStream_t st);

// inp (BT,C), weight (OC,C), bias (OC) or NULL -> out (BT,OC); the bias rides cuBLASLt's epilogue.
fy_status fy_cuda_linear_forward(struct fy_cuda_blas *h, void *out, const void *inp,
                                 const void *weight, const void *bias, enum fy_dtype dt,
                                 int64_t BT, int64_t C, int64_t OC, cudaStream_t st);
// The same followed by relu, in cuBLASLt's epilogue (no pass of its own over out): nn.Linear and
// nn.ReLU of OPT's feed-forward block in one call. relu's backward needs only its output.
fy_status fy_cuda_linear_relu_forward(struct fy_cuda_blas *h, void *out, const void *inp,
                                      const void *weight, const void *bias, enum fy_dtype dt,
                                      int64_t BT, int64_t C, int64_t OC, cudaStream_t st);
// The same plus a residual (BT,OC) in the product's own sum (cuBLASLt's C with beta = 1; out may
// be the residual): nn.Linear and the residual add after out_proj and fc2 in one call.
fy_status fy_cuda_linear_add_forward(struct fy_cuda_blas *h, void *out, const void *inp,
                                     const void *weight, const void *bias, const void *residual,
                                     enum fy_dtype dt, int64_t BT, int64_t C, int64_t OC, cudaStream_t st);
// dout (BT,OC), inp (BT,C), weight (OC,C) -> dinp (BT,C) +=, dweight (OC,C) +=, dbias (OC) +=
// (any NULL to skip)
fy_status fy_cuda_linear_backward(struct fy_cuda_blas *h, void *dinp, void *dweight, void *dbias,
                                  const void *dout, const void *inp, const void *weight,
                                  enum fy_dtype dt, int64_t BT, int64_t C, int64_t OC,
                                  cudaStream_t st);
// dout (BT,OC), inp (BT,C) -> dweight (OC,C), dbias (OC): += when accumulate, else = (may be the
// weights' own memory). dbias is a column sum in a fixed order (no atomics).
fy_status fy_cuda_linear_backward_params(struct fy_cuda_blas *h, void *dweight, void *dbias,
                                         const void *dout, const void *inp, enum fy_dtype dt,
                                         int64_t BT, int64_t C, int64_t OC, bool accumulate,
                                         cudaStream_t st);

// ---- mixture of experts (ops/cuda/moe.cu; ops/ops.h "mixture of experts") ----
//
// fy_moe_forward and fy_moe_backward on the GPU: the same routing record route (BT, E+3K) fp32,
// the same dispatch layout, the experts' products through cuBLASLt in a loop over the experts
// (d->bf16 is not read: dt says). rows is the op's aux slot, holding h (cap,F) then y (cap,C) in
// dt (cap = fy_moe_rows_cap). work: device memory of fy_cuda_moe_workspace_bytes(d, dt); pinned:
// page-locked host memory of fy_cuda_moe_pinned_bytes(d). Unlike the other kernels the forward
// WAITS for the stream once: the experts' token counts come down (into pinned's first E ints) to
// size their products; the backward reuses them when handed in (else it waits once too). An expert
// with no token is skipped; its gradient is zero (=) or left as it is (accumulate). d->mask (BT,
// device memory; NULL: none) marks padding, routed to no expert as fy_moe_forward's. Tensor
// parallelism as the cpu's (d->tp_sum, ops/ops.h): the callback gets device memory, fp32 whatever
// dt (the bf16 output and input gradient's part go through an fp32 part of work), to sum over the
// group in stream order (NCCL on st); work's size then includes that part (d->tp_sum set when
// sizing it).
size_t fy_cuda_moe_workspace_bytes(const struct fy_moe_dims *d, enum fy_dtype dt);
size_t fy_cuda_moe_pinned_bytes(const struct fy_moe_dims *d);
// inp (BT,C), gate (E,C), w1 (E*F,C), b1 (E*F) or NULL, w2 (E*C,F), b2 (E*C) or NULL -> out (BT,C),
// route, rows, *balance (host: E x sum_e f_e P_e, as fy_moe_forward's)
fy_status fy_cuda_moe_forward(struct fy_cuda_blas *h, void *out, float *route, void *rows, double *balance,
                              const void *inp, const void *gate, const void *w1, const void *b1, const void *w2,
                              const void *b2, enum fy_dtype dt, const struct fy_moe_dims *d, void *work, void *pinned,
                              cudaStream_t st);
// The router alone, as fy_cuda_moe_forward's first step (no wait): route's first E+2K entries a
// token (the probabilities, the choices, their weights; not the rows). The offload engine runs it
// before the op to learn which experts get tokens (runtime/offload.c, moe_experts); the forward
// then routes again, to the same bits.
fy_status fy_cuda_moe_route(float *route, const void *inp, const void *gate, enum fy_dtype dt,
                            const struct fy_moe_dims *d, cudaStream_t st);
// dout (BT,C) and forward's tensors -> dinp (BT,C) += (NULL: not wanted), dgate, dw1, db1, dw2, db2
// = (or += with accumulate); db1, db2 NULL without biases. dbalance as fy_moe_backward's. counts
// (E, host): the experts' token counts of the forward that wrote route (fy_cuda_moe_forward left
// them in pinned), so that the backward does not wait; NULL: counted again and brought down (a wait).
fy_status fy_cuda_moe_backward(struct fy_cuda_blas *h, void *dinp, void *dgate, void *dw1, void *db1, void *dw2,
                               void *db2, const void *dout, const void *inp, const float *route, const void *rows,
                               const void *gate, const void *w1, const void *w2, float dbalance, bool accumulate,
                               enum fy_dtype dt, const struct fy_moe_dims *d, void *work, void *pinned,
                               const int *counts, cudaStream_t st);

// Expert parallelism's pieces (runtime/ep_cuda.c moves the rows between the ranks in between):
// the steps of fy_cuda_moe_forward and _backward apart, the rows in the same padded dispatch
// layout throughout (a block of fy_moe_rows(n) rows a source and expert, its rounding rows zeros).
// fy_cuda_moe_ep_buffers: the source's rows in work (each (cap,C) in dt): xs the dispatched
// inputs (fy_cuda_moe_ep_route's), dy their gradients (fy_cuda_moe_ep_dispatch_grad's), dx the
// inputs' gradients that come back (fy_cuda_moe_ep_route_backward reads them).
void fy_cuda_moe_ep_buffers(const struct fy_moe_dims *d, enum fy_dtype dt, void *work, void **xs, void **dy, void **dx);
// The source's forward, first: inp, gate -> route (its rows too), xs; the counts and the
// probabilities' sums come down to pinned (E int32, then E fp32: WAITS for the stream); *balance.
fy_status fy_cuda_moe_ep_route(float *route, double *balance, const void *inp, const void *gate, enum fy_dtype dt,
                               const struct fy_moe_dims *d, void *work, void *pinned, cudaStream_t st);
// The experts held here on the nb blocks received, in order: block i is fy_moe_rows(cnt[i]) rows of
// x for local expert ex[i] (w1, b1, w2, b2 the local experts' stacked parameters) -> y and hrows
// (the blocks' h, kept for backward) in the same rows; as: scratch of as many rows of F.
fy_status fy_cuda_moe_ep_experts_forward(struct fy_cuda_blas *h, void *y, void *hrows, void *as, const void *x,
                                         const int *ex, const int64_t *cnt, int nb, const void *w1, const void *b1,
                                         const void *w2, const void *b2, enum fy_dtype dt, const struct fy_moe_dims *d,
                                         cudaStream_t st);
// The source's forward, last: y (its rows' results, back in its dispatch layout), route -> out (BT,C).
fy_status fy_cuda_moe_ep_combine(void *out, const void *y, const float *route, enum fy_dtype dt,
                                 const struct fy_moe_dims *d, cudaStream_t st);
// The source's backward, first: dout, y, route -> dy (the buffers') and the routing weights'
// gradients (in work).
fy_status fy_cuda_moe_ep_dispatch_grad(const void *dout, const void *y, const float *route, enum fy_dtype dt,
                                       const struct fy_moe_dims *d, void *work, cudaStream_t st);
// The experts held here, backward, on the blocks forward computed: dy, x, hrows -> dx (the same
// rows) and the local experts' (`experts` of them) gradients, each block's added in block order
// onto zeros (or onto what they hold, accumulate); as, dh: scratch of the blocks' rows of F.
fy_status fy_cuda_moe_ep_experts_backward(struct fy_cuda_blas *h, void *dx, void *dw1, void *db1, void *dw2, void *db2,
                                          void *as, void *dh, const void *dy, const void *x, const void *hrows,
                                          const int *ex, const int64_t *cnt, int nb, int experts, const void *w1,
                                          const void *w2, bool accumulate, enum fy_dtype dt,
                                          const struct fy_moe_dims *d, cudaStream_t st);
// The source's backward, last: the router's gradient, dinp (BT,C) += (NULL: not wanted) through the
// router and the rows' dx (the buffers'), dgate = (or +=).
fy_status fy_cuda_moe_ep_route_backward(struct fy_cuda_blas *h, void *dinp, void *dgate, const void *inp,
                                        const float *route, const void *gate, float dbalance, bool accumulate,
                                        enum fy_dtype dt, const struct fy_moe_dims *d, void *work, cudaStream_t st);

// ---- causal multi-head attention, flash style (the T x T matrix is never stored) ----
//
// Layout and masking as fy_attention_forward (ops/ops.h): qkv (B,T,3C) with q, k, v side by side,
// head h at columns [h*HS,(h+1)*HS); mask (B,T) int32 (1 = real token) or NULL; query t attends to
// keys s <= t with mask[b,s] = 1; a query with no key gets zeros (output and gradient). HS = C/NH
// must be at most 128. Tiles of 64 queries x 64 keys in shared memory, online softmax in fp32.

// qkv (B,T,3C), mask (B,T) -> out (B,T,C), lse (B,NH,T) fp32: the log-sum-exp of each query's
// scaled scores (-inf for a query with no key), all backward needs besides out.
fy_status fy_cuda_attention_forward(void *out, float *lse, const void *qkv, const int32_t *mask,
                                    enum fy_dtype dt, int64_t B, int64_t T, int64_t C, int64_t NH,
                                    float scale, cudaStream_t st);
// dout (B,T,C), qkv, out, lse, mask -> dqkv (B,T,3C) +=. scratch holds B*NH*T floats. Two kernels
// instead of atomics: one per key tile accumulates dk and dv over the query tiles after it, one per
// query tile accumulates dq over the key tiles before it (each recomputes the probabilities), so
// every gradient element has one owner and a fixed summation order.
fy_status fy_cuda_attention_backward(void *dqkv, float *scratch, const void *dout, const void *qkv,
                                     const void *out, const float *lse, const int32_t *mask,
                                     enum fy_dtype dt, int64_t B, int64_t T, int64_t C, int64_t NH,
                                     float scale, cudaStream_t st);
// New tokens against the cached keys and values of the tokens before them (incremental decoding,
// as fy_attention_decode on the CPU): qkv (n,3C) of the tokens at positions len .. len+n-1 -> their
// keys and values into rows len .. len+n-1 of kcache and vcache (cap,C); out (n,C) = per head and
// token t, softmax(scale q.k) over cache rows 0..len+t times their values. A warp per head and
// token; cap at most 12000 (the scores in shared memory).
fy_status fy_cuda_attention_decode(void *out, void *kcache, void *vcache, const void *qkv, enum fy_dtype dt,
                                   int64_t len, int64_t n, int64_t cap, int64_t C, int64_t NH, float scale,
                                   cudaStream_t st);
// The bf16 tensor-core kernels to use: "basic", "pipelined" (a warp owns 32 rows for heads up to
// 64, and the tiles walked are double-buffered with cp.async), "narrow" (pipelined, a warp owning
// 16 rows; for heads over 64 the pipelined kernels) or "auto" (the default, NULL too: narrow, the
// fastest on an H200), for both passes, or "FORWARD,BACKWARD" (such as "pipelined,basic"), for
// measuring one against another; FERRY_CUDA_ATTENTION names them too. All give the same results
// within bf16 rounding (test_backend_ops runs each).
fy_status fy_cuda_attention_set_variant(const char *name);
// Whether the current GPU can run the attention kernels of a model with this dtype, width C and
// NH heads: the dynamic shared memory a block of them takes (the largest of forward and backward)
// against what the GPU allows one block (227 KiB on sm_90, 163 on sm_80, 99 on sm_86/89/120). Only
// fp32 with heads over 80 goes past 99 KiB; FY_ERR_UNSUPPORTED then says so and what would fit.
// The launches check the same and fail with the same message.
fy_status fy_cuda_attention_check(enum fy_dtype dt, int64_t C, int64_t NH);

// ---- which GPUs this build runs on (ops/cuda/arch.cu) ----

// Whether GPU `ordinal` can run this build's kernels: compute capability 8.0 or newer (bf16 on
// tensor cores) and machine code or PTX for it in the build (asked of the CUDA runtime, which
// would otherwise fail at the first kernel). FY_ERR_UNSUPPORTED names the GPU, its architecture,
// the build's, and how to rebuild for it.
fy_status fy_cuda_gpu_usable(int ordinal);

#ifdef __cplusplus
}
#endif

#endif
