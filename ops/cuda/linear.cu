// Matrix products through cuBLASLt, and nn.Linear on top of them.
//
// cuBLASLt is column-major; ferry's matrices are row-major. A row-major (R,C) matrix is the same
// bytes as a column-major (C,R) one, so row-major c = op(a) @ op(b) is computed as column-major
// c^T = op(b)^T @ op(a)^T: cuBLASLt's A is our b, its B is our a, its m/n/k are our N/M/K. Its
// bias epilogue adds a vector along D's rows (length m = N), which is our bias over columns.
//
// Building a matmul descriptor, three layouts and running the algorithm heuristic costs far more
// than a small product, so each distinct call shape (dtype, sizes, transposes, bias or not, and
// the alignment of every pointer, which the heuristic relies on) gets them once and keeps them in a
// small cache owned by the handle.
//
// The bias and relu ride the product as cuBLASLt's epilogue. Where the heuristic offers no
// algorithm with that epilogue for a shape (a GPU, a cuBLASLt version or an alignment may lack
// one), the product runs without it and one kernel adds the bias and applies the relu after it
// (the sums then round once more, to the dtype, before the bias): slower, not an error. The same
// can be asked for (fy_cuda_blas_set_epilogue, or FERRY_CUDA_EPILOGUE=kernels): an epilogue moves
// the heuristic's choice of algorithm, and on some GPUs the product with it is the slower of the two
// by more than the kernel after it costs (bench/gpu_gemm times both).
//
// Tuning (opt-in: fy_cuda_blas_set_tuning, or FERRY_CUDA_GEMM_TUNE=N): the heuristic's first
// algorithm is not always the fastest for a shape (an epilogue moves its choice). With tuning, a
// shape's first calls each run one of the heuristic's first N candidates, timed with events on the
// caller's stream (no waiting, no extra memory: every call still computes its own product); once
// each candidate has run TUNE_REPS times and the last one has finished, the shape keeps the one
// with the smallest time. Results then depend on which algorithm won (float rounding), so runs
// are not bit-for-bit repeatable with it; without it they are.
#include <cublasLt.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/common.cuh"

extern "C" {
#include "core/log.h"
}

#define MM_CACHE 256  // (a mixture's experts bring a few shapes each per distinct row count)
#define TUNE_MAX 16  // candidates tried at most
#define TUNE_REPS 3  // runs of each (the smallest time counts: a first run may load its kernel)

struct mm_key {
  int dt, ta, tb, has_bias, relu;
  int kernels;  // the bias and relu as kernels after the product, by the handle's choice
  int64_t M, N, K;
  int al_a, al_b, al_c, al_bias, al_cin;  // al_cin: of the C read (beta != 0) when it is not c
};

struct mm_entry {
  bool used;
  struct mm_key key;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
  bool plain;  // no algorithm with the key's epilogue: the bias and relu run as kernels after it
  // Tuning: candidates cand[0..ncand) (cand[0] is the heuristic's choice, algo until decided),
  // trials launched so far (trial i runs candidate i % ncand between events ev[2i], ev[2i+1]).
  cublasLtMatmulAlgo_t *cand;
  int ncand, trials;
  cudaEvent_t *ev;
};

struct fy_cuda_blas {
  cublasLtHandle_t lt;
  void *ws;
  size_t ws_bytes;
  struct mm_entry cache[MM_CACHE];
  int next_victim;  // entries are replaced round-robin once the cache is full
  int tune;         // candidates to time per shape (0 or 1: the heuristic's first)
  bool kernels;     // no epilogues: the bias and relu run as kernels after the product
};

static fy_status lt_fail(cublasStatus_t s, const char *what) {
  return fy_error_set(FY_ERR_INTERNAL, "cuBLASLt: %s: %s", what, cublasLtGetStatusString(s));
}

#define LT_TRY(call, what)                                  \
  do {                                                      \
    cublasStatus_t lt_s_ = (call);                          \
    if (lt_s_ != CUBLAS_STATUS_SUCCESS) return lt_fail(lt_s_, what); \
  } while (0)

// The largest power of two, up to 256, that divides the address (256 is what cuBLASLt assumes
// unless told less).
static int align_of(const void *p) {
  uintptr_t a = (uintptr_t)p;
  int al = 256;
  while (al > 1 && a % (uintptr_t)al) al >>= 1;
  return al;
}

static void tune_release(struct mm_entry *e) {
  for (int i = 0; e->ev && i < 2 * e->ncand * TUNE_REPS; i++)
    if (e->ev[i]) cudaEventDestroy(e->ev[i]);
  free(e->ev);
  free(e->cand);
  e->ev = NULL;
  e->cand = NULL;
  e->ncand = 0;
}

static void entry_release(struct mm_entry *e) {
  if (!e->used) return;
  tune_release(e);
  if (e->lc) cublasLtMatrixLayoutDestroy(e->lc);
  if (e->lb) cublasLtMatrixLayoutDestroy(e->lb);
  if (e->la) cublasLtMatrixLayoutDestroy(e->la);
  if (e->op) cublasLtMatmulDescDestroy(e->op);
  memset(e, 0, sizeof *e);
}

extern "C" fy_status fy_cuda_blas_create(void *workspace, size_t workspace_bytes,
                                         struct fy_cuda_blas **out) {
  struct fy_cuda_blas *h = (struct fy_cuda_blas *)calloc(1, sizeof *h);
  if (!h) return fy_error_set(FY_ERR_NOMEM, "cannot allocate the cuBLASLt handle");
  cublasStatus_t s = cublasLtCreate(&h->lt);
  if (s != CUBLAS_STATUS_SUCCESS) {
    free(h);
    return lt_fail(s, "cublasLtCreate");
  }
  h->ws = workspace;
  h->ws_bytes = workspace ? workspace_bytes : 0;
  const char *t = getenv("FERRY_CUDA_GEMM_TUNE");
  if (t && *t) fy_cuda_blas_set_tuning(h, atoi(t));
  const char *ep = getenv("FERRY_CUDA_EPILOGUE");
  if (ep && *ep) {
    if (!strcmp(ep, "kernels")) h->kernels = true;
    else if (strcmp(ep, "fused"))
      fy_log_warn("FERRY_CUDA_EPILOGUE=%s: not \"fused\" or \"kernels\"; using fused", ep);
  }
  *out = h;
  return FY_OK;
}

extern "C" void fy_cuda_blas_set_tuning(struct fy_cuda_blas *h, int candidates) {
  h->tune = candidates < 0 ? 0 : candidates > TUNE_MAX ? TUNE_MAX : candidates;
}

extern "C" void fy_cuda_blas_set_epilogue(struct fy_cuda_blas *h, bool fused) { h->kernels = !fused; }

extern "C" void fy_cuda_blas_free(struct fy_cuda_blas *h) {
  if (!h) return;
  for (int i = 0; i < MM_CACHE; i++) entry_release(&h->cache[i]);
  cublasLtDestroy(h->lt);
  free(h);
}

// Fills e for key k (bias points at the caller's bias, whose address the heuristic reads); plain:
// without the key's bias and relu (the product alone). FY_ERR_UNSUPPORTED: no algorithm.
static fy_status entry_build(struct fy_cuda_blas *h, struct mm_entry *e, const struct mm_key *k,
                             const void *bias, bool plain) {
  memset(e, 0, sizeof *e);
  e->used = true;  // so that entry_release frees whatever was made before a failure
  e->key = *k;
  e->plain = plain;
  cudaDataType_t ty = k->dt == FY_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  // fp32 compute in both cases; for fp32 inputs this is true fp32 (CUBLAS_COMPUTE_32F_FAST_TF32
  // would round the inputs to tf32 and miss the op tests' 1e-4).
  LT_TRY(cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  cublasOperation_t opa = k->tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  cublasOperation_t opb = k->ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B is our a
  LT_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "transa");
  LT_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "transb");
  const bool relu = k->relu && !plain, has_bias = k->has_bias && !plain;
  const cublasLtEpilogue_t epi = relu ? (has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU)
                                      : (has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
  if (epi != CUBLASLT_EPILOGUE_DEFAULT)
    LT_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "epilogue");
  if (has_bias) {
    int32_t bty = (int32_t)ty;
    LT_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bty, sizeof bty), "bias type");
    LT_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), "bias");
  }
  const uint64_t M = (uint64_t)k->M, N = (uint64_t)k->N, K = (uint64_t)k->K;
  // Our b: (K,N) row-major = (N,K) column-major, ld N; with tb, (N,K) row-major = (K,N) col., ld K.
  if (k->tb) LT_TRY(cublasLtMatrixLayoutCreate(&e->la, ty, K, N, (int64_t)K), "layout of b");
  else LT_TRY(cublasLtMatrixLayoutCreate(&e->la, ty, N, K, (int64_t)N), "layout of b");
  // Our a: (M,K) row-major = (K,M) column-major, ld K; with ta, (K,M) row-major = (M,K) col., ld M.
  if (k->ta) LT_TRY(cublasLtMatrixLayoutCreate(&e->lb, ty, M, K, (int64_t)M), "layout of a");
  else LT_TRY(cublasLtMatrixLayoutCreate(&e->lb, ty, K, M, (int64_t)K), "layout of a");
  // Our c: (M,N) row-major = (N,M) column-major, ld N. C and D share it (D is written over C).
  LT_TRY(cublasLtMatrixLayoutCreate(&e->lc, ty, N, M, (int64_t)N), "layout of c");

  cublasLtMatmulPreference_t pref;
  LT_TRY(cublasLtMatmulPreferenceCreate(&pref), "preference");
  uint64_t ws = h->ws_bytes;
  uint32_t al_a = (uint32_t)k->al_b, al_b = (uint32_t)k->al_a, al_d = (uint32_t)k->al_c;
  uint32_t al_c = (uint32_t)(k->al_cin ? k->al_cin : k->al_c);
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d);
  cublasLtMatmulHeuristicResult_t res[TUNE_MAX];
  int nres = 0, want = h->tune > 1 ? h->tune : 1;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(h->lt, e->op, e->la, e->lb, e->lc, e->lc, pref, want, res, &nres);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED) return lt_fail(s, "algorithm heuristic");
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || nres == 0)  // (how cuBLASLt says it has none: either)
    return fy_error_set(FY_ERR_UNSUPPORTED,
                        "cuBLASLt: no algorithm for %s (%lld,%lld,%lld) ta=%d tb=%d bias=%d relu=%d",
                        fy_dtype_name((enum fy_dtype)k->dt), (long long)k->M, (long long)k->N,
                        (long long)k->K, k->ta, k->tb, has_bias, relu);
  e->algo = res[0].algo;
  if (nres > 1) {  // tuning: the candidates and their events (without them, no tuning: not an error)
    e->cand = (cublasLtMatmulAlgo_t *)malloc((size_t)nres * sizeof *e->cand);
    e->ev = (cudaEvent_t *)calloc((size_t)(2 * nres * TUNE_REPS), sizeof *e->ev);
    bool ok = e->cand && e->ev;
    e->ncand = nres;
    for (int i = 0; ok && i < 2 * nres * TUNE_REPS; i++) ok = cudaEventCreate(&e->ev[i]) == cudaSuccess;
    for (int i = 0; ok && i < nres; i++) e->cand[i] = res[i].algo;
    if (!ok) {
      (void)cudaGetLastError();
      tune_release(e);
    }
  }
  return FY_OK;
}

// Tuning: once every trial has finished, the candidate with the smallest time becomes the shape's
// algorithm (a candidate that failed to launch has none).
static void tune_decide(struct mm_entry *e) {
  const int n = e->ncand * TUNE_REPS;
  if (cudaEventQuery(e->ev[2 * n - 1]) != cudaSuccess) {  // not finished yet (or failed): later
    (void)cudaGetLastError();
    return;
  }
  float best = INFINITY;
  int pick = 0;
  for (int i = 0; i < n; i++) {
    float ms = INFINITY;
    if (cudaEventElapsedTime(&ms, e->ev[2 * i], e->ev[2 * i + 1]) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (ms < best) best = ms, pick = i % e->ncand;
  }
  e->algo = e->cand[pick];
  tune_release(e);
}

static fy_status entry_get(struct fy_cuda_blas *h, const struct mm_key *k, const void *bias,
                           struct mm_entry **out) {
  for (int i = 0; i < MM_CACHE; i++) {
    struct mm_entry *e = &h->cache[i];
    if (e->used && memcmp(&e->key, k, sizeof *k) == 0) {
      *out = e;
      return FY_OK;
    }
  }
  int slot = -1;
  for (int i = 0; i < MM_CACHE && slot < 0; i++)
    if (!h->cache[i].used) slot = i;
  if (slot < 0) {
    slot = h->next_victim;
    h->next_victim = (h->next_victim + 1) % MM_CACHE;
  }
  struct mm_entry *e = &h->cache[slot];
  entry_release(e);
  fy_status st = entry_build(h, e, k, bias, k->kernels != 0);
  if (st == FY_ERR_UNSUPPORTED && !k->kernels && (k->has_bias || k->relu)) {  // none with the epilogue: without it
    entry_release(e);
    st = entry_build(h, e, k, bias, true);
    if (st == FY_OK)
      fy_log_info("cuBLASLt has no algorithm for the %s product (%lld,%lld,%lld) with its %s epilogue: the product runs "
                  "without it, and kernels after it", fy_dtype_name((enum fy_dtype)k->dt), (long long)k->M,
                  (long long)k->N, (long long)k->K, k->relu ? (k->has_bias ? "bias and relu" : "relu") : "bias");
  }
  if (st != FY_OK) {
    entry_release(e);
    return st;
  }
  *out = e;
  return FY_OK;
}

// c (M,N) += bias on every row, then relu: what the epilogue would have done, for a plain entry
// (one pass over c).
static fy_status epilogue_kernels(const struct mm_entry *e, void *c, const void *bias, bool relu, enum fy_dtype dt,
                                  int64_t M, int64_t N, cudaStream_t st) {
  if (!e->plain) return FY_OK;
  if (bias) return fy_cuda_bias_add_relu(c, bias, relu, dt, M, N, st);
  if (relu) return fy_cuda_relu_forward(c, c, dt, M * N, st);
  return FY_OK;
}

// fy_cuda_matmul, with relu applied to the result in the epilogue when asked, and the C that beta
// scales read from cin (the same layout as c) instead of c when cin is not NULL.
static fy_status matmul_epi(struct fy_cuda_blas *h, void *c, const void *cin, const void *a, const void *b,
                            const void *bias, bool relu, enum fy_dtype dt, int64_t M, int64_t N, int64_t K, bool ta,
                            bool tb, float alpha, float beta, cudaStream_t st) {
  if (dt != FY_F32 && dt != FY_BF16) return fy_cuda_bad_dtype("matmul", dt);
  if (M <= 0 || N <= 0) return FY_OK;
  if (K <= 0)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda matmul: K=%lld (an empty sum)", (long long)K);
  struct mm_key k;
  memset(&k, 0, sizeof k);  // the key is compared with memcmp: no stray padding bytes
  k.dt = dt;
  k.ta = ta;
  k.tb = tb;
  k.has_bias = bias != NULL;
  k.relu = relu;
  k.kernels = h->kernels && (bias || relu);  // (a product without either needs no entry of its own)
  k.M = M;
  k.N = N;
  k.K = K;
  k.al_a = align_of(a);
  k.al_b = align_of(b);
  k.al_c = align_of(c);
  k.al_bias = bias ? align_of(bias) : 0;
  if (cin && cin != c) k.al_cin = align_of(cin);
  else cin = c;
  struct mm_entry *e;
  FY_TRY(entry_get(h, &k, bias, &e));
  if (bias && !e->plain)  // the cached descriptor may hold another call's bias of the same alignment
    LT_TRY(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), "bias");
  if (e->ncand > 1 && e->trials < e->ncand * TUNE_REPS) {  // tuning: this call runs the next trial
    const int i = e->trials++;
    const bool ran = cudaEventRecord(e->ev[2 * i], st) == cudaSuccess &&
                     cublasLtMatmul(h->lt, e->op, &alpha, b, e->la, a, e->lb, &beta, cin, e->lc, c, e->lc,
                                    &e->cand[i % e->ncand], h->ws, h->ws_bytes, st) == CUBLAS_STATUS_SUCCESS;
    if (ran && cudaEventRecord(e->ev[2 * i + 1], st) == cudaSuccess) return epilogue_kernels(e, c, bias, relu, dt, M, N, st);
    if (ran) {  // the product is done; only its timing failed
      (void)cudaGetLastError();
      tune_release(e);
      return epilogue_kernels(e, c, bias, relu, dt, M, N, st);
    }
    // A candidate that cannot run (or an event that cannot be recorded): no tuning for this
    // shape, and the call runs with the heuristic's choice below.
    (void)cudaGetLastError();
    tune_release(e);
  } else if (e->ncand > 1) {
    tune_decide(e);
  }
  LT_TRY(cublasLtMatmul(h->lt, e->op, &alpha, b, e->la, a, e->lb, &beta, cin, e->lc, c, e->lc,
                        &e->algo, h->ws, h->ws_bytes, st),
         "cublasLtMatmul");
  return epilogue_kernels(e, c, bias, relu, dt, M, N, st);
}

extern "C" fy_status fy_cuda_matmul(struct fy_cuda_blas *h, void *c, const void *a, const void *b,
                                    const void *bias, enum fy_dtype dt, int64_t M, int64_t N,
                                    int64_t K, bool ta, bool tb, float alpha, float beta,
                                    cudaStream_t st) {
  return matmul_epi(h, c, NULL, a, b, bias, false, dt, M, N, K, ta, tb, alpha, beta, st);
}

// dout (BT,OC) -> dbias (OC) (+)= column sums, or with gridDim.y > 1 parts (gridDim.y, OC) of them
// Block (b, p) owns columns [32b, 32b+32) of rows [p*R, (p+1)*R), R = BT / gridDim.y rounded up;
// thread (tx, ty) walks rows ty, ty+32, ... of them (coalesced across tx), then the 32 partial sums
// of a column are added in a fixed order: no atomics. One part: the sum goes to dbias; several
// (a narrow layer, e.g. OC = 2048: 64 column blocks, would leave most of the GPU idle): to part,
// and bias_grad_final_kernel adds the parts in order.
template <typename T>
__global__ void __launch_bounds__(1024)
bias_grad_kernel(T *dbias, float *part, const T *dout, int64_t BT, int64_t OC, bool accumulate) {
  __shared__ float sums[32][33];
  int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  int64_t c = (int64_t)blockIdx.x * 32 + tx;
  int64_t per = (BT + gridDim.y - 1) / gridDim.y, i0 = (int64_t)blockIdx.y * per;
  int64_t i1 = i0 + per < BT ? i0 + per : BT;
  float acc = 0.0f;
  if (c < OC)
    for (int64_t i = i0 + ty; i < i1; i += 32) acc += fy_ld(dout + i * OC + c);
  sums[ty][tx] = acc;
  __syncthreads();
  if (ty != 0 || c >= OC) return;
  float s = 0.0f;
  for (int k2 = 0; k2 < 32; k2++) s += sums[k2][tx];
  if (part) part[(int64_t)blockIdx.y * OC + c] = s;
  else fy_st(dbias + c, accumulate ? fy_ld(dbias + c) + s : s);
}

// part (parts, OC) -> dbias (OC) (+)= their sum, in order
template <typename T>
__global__ void bias_grad_final_kernel(T *dbias, const float *part, int parts, int64_t OC, bool accumulate) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= OC) return;
  float s = 0.0f;
  for (int p = 0; p < parts; p++) s += part[(int64_t)p * OC + c];
  fy_st(dbias + c, accumulate ? fy_ld(dbias + c) + s : s);
}

#define BIAS_GRAD_PARTS 16

extern "C" fy_status fy_cuda_linear_relu_forward(struct fy_cuda_blas *h, void *out, const void *inp,
                                                 const void *weight, const void *bias, enum fy_dtype dt,
                                                 int64_t BT, int64_t C, int64_t OC, cudaStream_t st) {
  // out (BT,OC) = max(inp (BT,C) @ weight^T (C,OC) + bias, 0)
  return matmul_epi(h, out, NULL, inp, weight, bias, true, dt, BT, OC, C, false, true, 1.0f, 0.0f, st);
}

extern "C" fy_status fy_cuda_linear_add_forward(struct fy_cuda_blas *h, void *out, const void *inp,
                                                const void *weight, const void *bias, const void *residual,
                                                enum fy_dtype dt, int64_t BT, int64_t C, int64_t OC,
                                                cudaStream_t st) {
  // out (BT,OC) = inp (BT,C) @ weight^T (C,OC) + bias + residual (BT,OC): residual is the C of the
  // product with beta = 1 (out may be residual itself)
  return matmul_epi(h, out, residual, inp, weight, bias, false, dt, BT, OC, C, false, true, 1.0f, 1.0f, st);
}

extern "C" fy_status fy_cuda_linear_forward(struct fy_cuda_blas *h, void *out, const void *inp,
                                            const void *weight, const void *bias,
                                            enum fy_dtype dt, int64_t BT, int64_t C, int64_t OC,
                                            cudaStream_t st) {
  // out (BT,OC) = inp (BT,C) @ weight^T (C,OC) + bias
  return fy_cuda_matmul(h, out, inp, weight, bias, dt, BT, OC, C, false, true, 1.0f, 0.0f, st);
}

extern "C" fy_status fy_cuda_linear_backward_params(struct fy_cuda_blas *h, void *dweight,
                                                    void *dbias, const void *dout,
                                                    const void *inp, enum fy_dtype dt,
                                                    int64_t BT, int64_t C, int64_t OC,
                                                    bool accumulate, cudaStream_t st) {
  // dweight (OC,C) (+)= dout^T (OC,BT) @ inp (BT,C)
  if (dweight) {
    if (BT > 0) {
      FY_TRY(fy_cuda_matmul(h, dweight, dout, inp, NULL, dt, OC, C, BT, true, false, 1.0f,
                            accumulate ? 1.0f : 0.0f, st));
    } else if (!accumulate) {
      if (cudaMemsetAsync(dweight, 0, (size_t)(OC * C) * fy_dtype_size(dt), st) != cudaSuccess)
        return fy_cuda_launched("linear_backward_params");
    }
  }
  if (dbias && OC > 0) {
    unsigned grid = (unsigned)((OC + 31) / 32);
    // The parts go to the cuBLASLt workspace: the products before this kernel on the stream are
    // done with it, and the next ones start after the final kernel.
    bool split = BT >= 32 * BIAS_GRAD_PARTS && h->ws_bytes >= (size_t)(BIAS_GRAD_PARTS * OC) * sizeof(float);
    float *part = split ? (float *)h->ws : NULL;
    dim3 pgrid(grid, split ? BIAS_GRAD_PARTS : 1);
    unsigned fgrid = (unsigned)((OC + 255) / 256);
    FY_CUDA_DISPATCH("linear_backward_params", dt, T,
                     bias_grad_kernel<T><<<pgrid, 1024, 0, st>>>((T *)dbias, part, (const T *)dout,
                                                                 BT < 0 ? 0 : BT, OC, accumulate);
                     if (split) bias_grad_final_kernel<T><<<fgrid, 256, 0, st>>>((T *)dbias, part,
                                                                                BIAS_GRAD_PARTS, OC, accumulate));
    FY_TRY(fy_cuda_launched("linear_backward_params"));
  }
  return FY_OK;
}

extern "C" fy_status fy_cuda_linear_backward(struct fy_cuda_blas *h, void *dinp, void *dweight,
                                             void *dbias, const void *dout, const void *inp,
                                             const void *weight, enum fy_dtype dt, int64_t BT,
                                             int64_t C, int64_t OC, cudaStream_t st) {
  // dinp (BT,C) += dout (BT,OC) @ weight (OC,C)
  if (dinp && BT > 0 && OC > 0)
    FY_TRY(fy_cuda_matmul(h, dinp, dout, weight, NULL, dt, BT, C, OC, false, false, 1.0f, 1.0f, st));
  return fy_cuda_linear_backward_params(h, dweight, dbias, dout, inp, dt, BT, C, OC, true, st);
}
