// The CUDA emulator's cuBLASLt: the matmul calls ferry makes (ops/cuda/linear.cu), computed on
// the CPU on the call's stream, with the checks the library makes.
//
// D = epilogue(alpha op(A) op(B) + beta C [+ bias]) in column-major layouts, fp32 accumulation,
// f32 or bf16 matrices. Epilogues: DEFAULT, BIAS, RELU, RELU_BIAS (bias: one value per row of D).
// Attribute sizes are checked as cuBLASLt does; an algorithm remembers the alignments its
// heuristic was promised, and a call with a pointer aligned less fails (cuBLASLt's kernels would
// read wrongly); layouts must agree with the operation's shapes; D may be C, but not A or B.
// FY_EMU_LT_NO_EPILOGUE=1: the heuristic offers no algorithm for a descriptor with an epilogue
// other than DEFAULT (as cuBLASLt may not for some GPU, shape or alignment), to test what a
// caller does then.
#include <cublasLt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "test/cudaemu/emu_internal.h"

struct cublasLtContext {
  int unused;
};

namespace {

struct desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void *bias = NULL;
  int32_t bias_type = -1;  // -1: D's type
};

struct layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};

struct preference {
  uint64_t max_workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};

const int CANDIDATES = 3;  // distinct algorithms the heuristic offers (to exercise tuning)

cublasStatus_t set(void *dst, size_t want, const void *buf, size_t n) {
  if (!buf || n != want) return CUBLAS_STATUS_INVALID_VALUE;
  memcpy(dst, buf, n);
  return CUBLAS_STATUS_SUCCESS;
}

float load(const void *p, cudaDataType_t t, int64_t i) {
  if (t == CUDA_R_32F) return ((const float *)p)[i];
  uint16_t h;
  memcpy(&h, (const uint16_t *)p + i, 2);
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

void store(void *p, cudaDataType_t t, int64_t i, float v) {
  if (t == CUDA_R_32F) {
    ((float *)p)[i] = v;
    return;
  }
  ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
}

size_t elem(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

int align_of(const void *p) {
  int a = 256;
  while (a > 1 && (uintptr_t)p % (uintptr_t)a) a >>= 1;
  return a;
}

bool overlaps(const void *a, size_t na, const void *b, size_t nb) {
  return (const char *)a < (const char *)b + nb && (const char *)b < (const char *)a + na;
}

size_t span(const layout &l) { return ((l.cols - 1) * (uint64_t)l.ld + l.rows) * elem(l.type); }

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  *h = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

const char *cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    default: return "CUBLAS_STATUS (cuda emulator)";
  }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  desc *m = new desc;
  m->compute = compute;
  m->scale = scale;
  *d = (cublasLtMatmulDesc_t)m;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete (desc *)d;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t n) {
  desc *m = (desc *)d;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return set(&m->transa, 4, buf, n);
    case CUBLASLT_MATMUL_DESC_TRANSB: return set(&m->transb, 4, buf, n);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set(&m->epilogue, 4, buf, n);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set(&m->bias, sizeof(void *), buf, n);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set(&m->bias_type, 4, buf, n);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (type != CUDA_R_32F && type != CUDA_R_16BF) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (rows == 0 || cols == 0 || ld < (int64_t)rows) return CUBLAS_STATUS_INVALID_VALUE;
  layout *m = new layout{type, rows, cols, ld};
  *l = (cublasLtMatrixLayout_t)m;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete (layout *)l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  *p = (cublasLtMatmulPreference_t) new preference;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete (preference *)p;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t n) {
  preference *m = (preference *)p;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set(&m->max_workspace, 8, buf, n);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return set(&m->align[0], 4, buf, n);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return set(&m->align[1], 4, buf, n);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return set(&m->align[2], 4, buf, n);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return set(&m->align[3], 4, buf, n);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int want,
                                              cublasLtMatmulHeuristicResult_t *res, int *got) {
  (void)h, (void)a, (void)b, (void)c, (void)dl;
  if (want <= 0 || !d || !got) return CUBLAS_STATUS_INVALID_VALUE;
  const preference *m = (const preference *)p;
  for (int i = 0; i < 4; i++)
    if (m->align[i] == 0 || (m->align[i] & (m->align[i] - 1))) return CUBLAS_STATUS_INVALID_VALUE;
  const char *no_epi = getenv("FY_EMU_LT_NO_EPILOGUE");
  if (no_epi && strcmp(no_epi, "1") == 0 && ((const desc *)d)->epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    *got = 0;
    return CUBLAS_STATUS_NOT_SUPPORTED;  // (what cuBLASLt answers a configuration it has nothing for)
  }
  int n = want < CANDIDATES ? want : CANDIDATES;
  for (int i = 0; i < n; i++) {
    memset(&res[i], 0, sizeof res[i]);
    res[i].algo.data[0] = (uint64_t)i + 1;
    for (int k = 0; k < 4; k++) res[i].algo.data[1 + k] = m->align[k];
    res[i].workspaceSize = 0;
    res[i].state = CUBLAS_STATUS_SUCCESS;
    res[i].wavesCount = 1.0f;
  }
  *got = n;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t dsc, const void *alpha_p, const void *A,
                              cublasLtMatrixLayout_t Al, const void *B, cublasLtMatrixLayout_t Bl, const void *beta_p,
                              const void *C, cublasLtMatrixLayout_t Cl, void *D, cublasLtMatrixLayout_t Dl,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes, cudaStream_t st) {
  (void)h, (void)ws, (void)ws_bytes;
  if (!dsc || !Al || !Bl || !Cl || !Dl || !alpha_p || !beta_p || !algo) return CUBLAS_STATUS_INVALID_VALUE;
  const desc m = *(const desc *)dsc;  // the call's values: the descriptor may change after it
  const layout la = *(const layout *)Al, lb = *(const layout *)Bl, lc = *(const layout *)Cl, ld = *(const layout *)Dl;
  const float alpha = *(const float *)alpha_p, beta = *(const float *)beta_p;
  const bool ta = m.transa == CUBLAS_OP_T, tb = m.transb == CUBLAS_OP_T;
  const uint64_t M = ta ? la.cols : la.rows, K = ta ? la.rows : la.cols;
  const uint64_t KB = tb ? lb.cols : lb.rows, N = tb ? lb.rows : lb.cols;
  if (K != KB || ld.rows != M || ld.cols != N || lc.rows != M || lc.cols != N || lc.ld != ld.ld)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (la.type != lb.type || lc.type != ld.type) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (algo->data[0] < 1 || algo->data[0] > (uint64_t)CANDIDATES) return CUBLAS_STATUS_INVALID_VALUE;
  const void *ptr[4] = {A, B, C, D};
  for (int i = 0; i < 4; i++)
    if ((uint64_t)align_of(ptr[i]) < algo->data[1 + i]) {
      fprintf(stderr, "cudaemu: cublasLtMatmul: matrix %c at %p is aligned to %d bytes, its algorithm was chosen for %llu\n",
              "ABCD"[i], ptr[i], align_of(ptr[i]), (unsigned long long)algo->data[1 + i]);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  const bool bias = m.epilogue == CUBLASLT_EPILOGUE_BIAS || m.epilogue == CUBLASLT_EPILOGUE_RELU_BIAS;
  const bool relu = m.epilogue == CUBLASLT_EPILOGUE_RELU || m.epilogue == CUBLASLT_EPILOGUE_RELU_BIAS;
  if (!bias && !relu && m.epilogue != CUBLASLT_EPILOGUE_DEFAULT) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (bias && !m.bias) return CUBLAS_STATUS_INVALID_VALUE;
  const cudaDataType_t bias_type = m.bias_type < 0 ? ld.type : (cudaDataType_t)m.bias_type;
  if (overlaps(D, span(ld), A, span(la)) || overlaps(D, span(ld), B, span(lb)))
    fy_emu_fail("cublasLtMatmul: D at %p overlaps an input (A %p, B %p)", D, A, B);
  // Every operand read or written lies wholly in the current GPU's memory.
  const int gpu = fy_emu_current_device();
  const void *operand[5] = {A, B, beta != 0.0f ? C : NULL, D, bias ? m.bias : NULL};
  const size_t bytes[5] = {span(la), span(lb), span(lc), span(ld), bias ? M * elem(bias_type) : 0};
  static const char *const operand_name[5] = {"A", "B", "C", "D", "the bias"};
  for (int i = 0; i < 5; i++)
    if (operand[i] && fy_emu_device_of(operand[i], bytes[i]) != gpu)
      fy_emu_fail("cublasLtMatmul on GPU %d: %s (%zu bytes at %p) is not in its memory", gpu, operand_name[i],
                  bytes[i], operand[i]);
  const void *bias_p = m.bias;
  std::function<void()> job = [=] {
    // op(A) as M rows of K and op(B) as N rows of K, in fp32: each element of D is one dot product
    std::vector<float> a((size_t)(M * K)), b((size_t)(N * K));
    for (uint64_t i = 0; i < M; i++)
      for (uint64_t k = 0; k < K; k++)
        a[i * K + k] = load(A, la.type, ta ? (int64_t)(k + i * la.ld) : (int64_t)(i + k * la.ld));
    for (uint64_t j = 0; j < N; j++)
      for (uint64_t k = 0; k < K; k++)
        b[j * K + k] = load(B, lb.type, tb ? (int64_t)(j + k * lb.ld) : (int64_t)(k + j * lb.ld));
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < (int64_t)N; j++)
      for (uint64_t i = 0; i < M; i++) {
        const float *x = &a[i * K], *y = &b[(uint64_t)j * K];
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (uint64_t k = 0; k < K; k++) s += x[k] * y[k];
        float v = alpha * s;
        if (beta != 0.0f) v += beta * load(C, lc.type, (int64_t)(i + j * lc.ld));
        if (bias) v += load(bias_p, bias_type, (int64_t)i);
        if (relu) v = v > 0.0f ? v : 0.0f;
        store(D, ld.type, (int64_t)(i + j * ld.ld), v);
      }
  };
  fy_emu_enqueue(st, std::move(job));  // a host computation in stream order, not a kernel of fibers
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
