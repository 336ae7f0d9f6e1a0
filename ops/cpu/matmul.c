// Matrix products through oneDNN's matmul primitive (2.x C API).
//
// Creating a oneDNN primitive JIT-compiles a kernel (milliseconds), so one primitive is made per
// distinct problem (shape, transposes, strides, alpha, beta, bias, fp32 or bf16 operands) and kept
// in a small list; a model has a few dozen such problems. Transposes and row strides are expressed
// as strides of the memory descriptors, never as copies. beta != 0 is a sum post-op (oneDNN reads
// dst and adds); alpha != 1 is an output scale (applied to the product before the sum).
//
// Not thread-safe (ops.h: one caller at a time); the parallelism is oneDNN's, on the OpenMP
// threads of the caller.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "core/dtype.h"
#include "ops/ops.h"

// Everything that makes two problems different primitives. Compared bytewise, so it is always
// memset to 0 first (padding).
struct mm_key {
  int64_t batch, M, N, K;
  int64_t lda, ldb, ldc;
  int64_t sa, sb, sc;
  uint32_t alpha_bits, beta_bits;
  int32_t ta, tb, bias;
  int32_t bf16;  // a and b in bf16 (fy_matmul16)
};

struct mm_entry {
  struct mm_key key;
  dnnl_primitive_t prim;
  dnnl_memory_t mem_a, mem_b, mem_c, mem_bias;  // handles re-pointed at each call
  struct mm_entry *next;
};

static dnnl_engine_t mm_engine;
static dnnl_stream_t mm_stream;
static struct mm_entry *mm_cache;  // most recently created first

static fy_status mm_fail(dnnl_status_t s, const char *what, const struct mm_key *k) {
  return fy_error_set(FY_ERR_INTERNAL,
                      "oneDNN %s failed (status %d) for %smatmul batch=%lld M=%lld N=%lld K=%lld "
                      "ta=%d tb=%d lda=%lld ldb=%lld ldc=%lld",
                      what, (int)s, k->bf16 ? "bf16 " : "", (long long)k->batch, (long long)k->M,
                      (long long)k->N, (long long)k->K, k->ta, k->tb, (long long)k->lda,
                      (long long)k->ldb, (long long)k->ldc);
}

static fy_status mm_init_engine(void) {
  dnnl_status_t s;
  if (!mm_engine) {
    s = dnnl_engine_create(&mm_engine, dnnl_cpu, 0);
    if (s != dnnl_success) {
      mm_engine = NULL;
      return fy_error_set(FY_ERR_INTERNAL, "oneDNN engine creation failed (status %d)", (int)s);
    }
  }
  if (!mm_stream) {
    s = dnnl_stream_create(&mm_stream, mm_engine, dnnl_stream_default_flags);
    if (s != dnnl_success) {
      mm_stream = NULL;
      return fy_error_set(FY_ERR_INTERNAL, "oneDNN stream creation failed (status %d)", (int)s);
    }
  }
  return FY_OK;
}

static void mm_entry_free(struct mm_entry *e) {
  if (e->prim) dnnl_primitive_destroy(e->prim);
  if (e->mem_a) dnnl_memory_destroy(e->mem_a);
  if (e->mem_b) dnnl_memory_destroy(e->mem_b);
  if (e->mem_c) dnnl_memory_destroy(e->mem_c);
  if (e->mem_bias) dnnl_memory_destroy(e->mem_bias);
  free(e);
}

// A (rows, cols) matrix, possibly batched, whose element (i, j) of batch n lives at
// n*sbatch + i*srow + j*scol. 2-D when batch == 1 (the common, fastest-dispatched case).
static dnnl_status_t mm_desc(dnnl_memory_desc_t *md, int64_t batch, int64_t rows, int64_t cols,
                             int64_t sbatch, int64_t srow, int64_t scol, dnnl_data_type_t dt) {
  if (batch == 1) {
    dnnl_dims_t dims = {rows, cols}, strides = {srow, scol};
    return dnnl_memory_desc_init_by_strides(md, 2, dims, dt, strides);
  }
  dnnl_dims_t dims = {batch, rows, cols}, strides = {sbatch, srow, scol};
  return dnnl_memory_desc_init_by_strides(md, 3, dims, dt, strides);
}

// Whether oneDNN's "gemm" implementation serves this problem better than its first choice,
// brgemm. Two cases, measured with oneDNN 2.6 at 2 threads (bench/gemm_impl times every
// implementation of every product of a step; medians of 5):
// - a long reduction against both sides of the output (K >= 8 max(M, N)), as the tied output
//   projection's input gradient (512 x 768 from K = 50272): brgemm splits only the output among
//   threads (AVX-512 machines: 161 against 222 GFLOP/s on the first, 316 against 386 on a second);
// - b stored (K, N), as in every backward product of a linear (the input gradient multiplies by
//   the weight, the weight gradient by the input): brgemm runs at half its rate for some widths
//   (OPT-125m's feed-forward, N = 3072: fc2's input gradient at 206 against 395 GFLOP/s, its
//   weight gradient at 176 against 392; not at N = 1024 or 4096) and is level or behind elsewhere
//   (the output projection's weight gradient, 50272 x 768 from K = 512: 307 against 361). A
//   forward product (b is an (N, K) weight) stays with brgemm: level on average, ahead at 128 rows.
// Batched products (attention) keep oneDNN's own choice (no difference measured). The rule reads
// the shape and layout only, so every run of a problem picks the same implementation and gives
// the same bits.
// (With bf16 operands brgemm's AMX kernels lead everywhere: 2-3 TFLOP/s against gemm's 1-2.4.)
static bool mm_prefers_gemm(const struct mm_key *k) {
  if (k->batch != 1 || k->bf16) return false;
  int64_t side = k->M > k->N ? k->M : k->N;
  return k->K >= 8 * side || !k->tb;
}

// The primitive descriptor for `desc`: oneDNN's first implementation, or where mm_prefers_gemm says
// so its first "gemm" one when it offers one.
static dnnl_status_t mm_pick(dnnl_primitive_desc_t *pd, const dnnl_matmul_desc_t *desc,
                             dnnl_primitive_attr_t attr, const struct mm_key *k) {
  *pd = NULL;
  dnnl_primitive_desc_iterator_t it = NULL;
  if (mm_prefers_gemm(k) &&
      dnnl_primitive_desc_iterator_create(&it, desc, attr, mm_engine, NULL) == dnnl_success) {
    do {
      dnnl_primitive_desc_t cand = dnnl_primitive_desc_iterator_fetch(it);
      const char *impl = NULL;
      if (cand && dnnl_primitive_desc_query(cand, dnnl_query_impl_info_str, 0, &impl) == dnnl_success &&
          impl && strncmp(impl, "gemm", 4) == 0)
        *pd = cand;
      else if (cand)
        dnnl_primitive_desc_destroy(cand);
    } while (!*pd && dnnl_primitive_desc_iterator_next(it) == dnnl_success);
    dnnl_primitive_desc_iterator_destroy(it);
  }
  return *pd ? dnnl_success : dnnl_primitive_desc_create(pd, desc, attr, mm_engine, NULL);
}

static fy_status mm_create(const struct mm_key *k, float alpha, float beta,
                           struct mm_entry **out) {
  FY_TRY(mm_init_engine());
  struct mm_entry *e = calloc(1, sizeof *e);
  if (!e) return fy_error_set(FY_ERR_NOMEM, "out of memory caching a matmul primitive");
  e->key = *k;
  dnnl_memory_desc_t a_md, b_md, c_md, bias_md;
  dnnl_status_t s;
  // op(a) is (M,K): a stored (M,K) with row stride lda, or (K,M) with row stride lda.
  const dnnl_data_type_t in = k->bf16 ? dnnl_bf16 : dnnl_f32;
  s = mm_desc(&a_md, k->batch, k->M, k->K, k->sa, k->ta ? 1 : k->lda, k->ta ? k->lda : 1, in);
  if (s == dnnl_success)
    s = mm_desc(&b_md, k->batch, k->K, k->N, k->sb, k->tb ? 1 : k->ldb, k->tb ? k->ldb : 1, in);
  if (s == dnnl_success) s = mm_desc(&c_md, k->batch, k->M, k->N, k->sc, k->ldc, 1, dnnl_f32);
  if (s == dnnl_success && k->bias) {
    // (1,N) or (1,1,N): broadcast over rows and batches.
    dnnl_dims_t dims = {1, 1, k->N}, strides = {k->N, k->N, 1};
    int nd = k->batch == 1 ? 2 : 3;
    s = dnnl_memory_desc_init_by_strides(&bias_md, nd, dims + (3 - nd), dnnl_f32,
                                         strides + (3 - nd));
  }
  if (s != dnnl_success) {
    free(e);
    return mm_fail(s, "memory descriptor", k);
  }

  dnnl_matmul_desc_t desc;
  s = dnnl_matmul_desc_init(&desc, &a_md, &b_md, k->bias ? &bias_md : NULL, &c_md);
  if (s != dnnl_success) {
    free(e);
    return mm_fail(s, "matmul descriptor", k);
  }
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t post = NULL;
  s = dnnl_primitive_attr_create(&attr);
  if (s == dnnl_success && alpha != 1.0f)
    s = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha);
  if (s == dnnl_success && beta != 0.0f) {
    s = dnnl_post_ops_create(&post);
    if (s == dnnl_success) s = dnnl_post_ops_append_sum(post, beta);
    if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(attr, post);
  }
  dnnl_primitive_desc_t pd = NULL;
  if (s == dnnl_success) s = mm_pick(&pd, &desc, attr, k);
  if (s == dnnl_success) s = dnnl_primitive_create(&e->prim, pd);
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (post) dnnl_post_ops_destroy(post);
  if (attr) dnnl_primitive_attr_destroy(attr);
  if (s != dnnl_success) {
    e->prim = NULL;
    mm_entry_free(e);
    return mm_fail(s, "primitive creation", k);
  }
  // Memory objects with no buffer yet (DNNL_MEMORY_NONE); each call points them at its data.
  s = dnnl_memory_create(&e->mem_a, &a_md, mm_engine, DNNL_MEMORY_NONE);
  if (s == dnnl_success) s = dnnl_memory_create(&e->mem_b, &b_md, mm_engine, DNNL_MEMORY_NONE);
  if (s == dnnl_success) s = dnnl_memory_create(&e->mem_c, &c_md, mm_engine, DNNL_MEMORY_NONE);
  if (s == dnnl_success && k->bias)
    s = dnnl_memory_create(&e->mem_bias, &bias_md, mm_engine, DNNL_MEMORY_NONE);
  if (s != dnnl_success) {
    mm_entry_free(e);
    return mm_fail(s, "memory creation", k);
  }
  e->next = mm_cache;
  mm_cache = e;
  *out = e;
  return FY_OK;
}

// The product behind every entry point: a and b are floats, or bf16 with bf16 set.
static fy_status mm_run(float *c, const void *a, const void *b, const float *bias, int64_t batch, int64_t M,
                        int64_t N, int64_t K, bool ta, bool tb, float alpha, float beta, int64_t lda, int64_t ldb,
                        int64_t ldc, int64_t stride_a, int64_t stride_b, int64_t stride_c, bool bf16) {
  if (batch < 0 || M < 0 || N < 0 || K < 0)
    return fy_error_set(FY_ERR_INVALID, "matmul with a negative size (batch=%lld M=%lld N=%lld "
                        "K=%lld)", (long long)batch, (long long)M, (long long)N, (long long)K);
  if (lda == 0) lda = ta ? M : K;
  if (ldb == 0) ldb = tb ? K : N;
  if (ldc == 0) ldc = N;
  if (stride_a == 0) stride_a = M * K;
  if (stride_b == 0) stride_b = K * N;
  if (stride_c == 0) stride_c = M * N;
  if (lda < (ta ? M : K) || ldb < (tb ? K : N) || ldc < N)
    return fy_error_set(FY_ERR_INVALID, "matmul row stride too small (lda=%lld ldb=%lld "
                        "ldc=%lld for M=%lld N=%lld K=%lld ta=%d tb=%d)", (long long)lda,
                        (long long)ldb, (long long)ldc, (long long)M, (long long)N, (long long)K,
                        (int)ta, (int)tb);
  if (batch == 0 || M == 0 || N == 0) return FY_OK;
  if (K == 0) {
    // An empty sum: c = beta*c (+ bias); oneDNN rejects zero-size reductions.
    for (int64_t n = 0; n < batch; n++)
      for (int64_t i = 0; i < M; i++) {
        float *row = c + n * stride_c + i * ldc;
        for (int64_t j = 0; j < N; j++)
          row[j] = (beta == 0.0f ? 0.0f : beta * row[j]) + (bias ? bias[j] : 0.0f);
      }
    return FY_OK;
  }

  struct mm_key k;
  memset(&k, 0, sizeof k);
  k.batch = batch;
  k.M = M;
  k.N = N;
  k.K = K;
  k.lda = lda;
  k.ldb = ldb;
  k.ldc = ldc;
  if (batch > 1) {
    k.sa = stride_a;
    k.sb = stride_b;
    k.sc = stride_c;
  }
  memcpy(&k.alpha_bits, &alpha, sizeof alpha);
  memcpy(&k.beta_bits, &beta, sizeof beta);
  k.ta = ta;
  k.tb = tb;
  k.bias = bias != NULL;
  k.bf16 = bf16;

  struct mm_entry *e = NULL, **prev = &mm_cache;
  for (struct mm_entry *it = mm_cache; it; prev = &it->next, it = it->next) {
    if (memcmp(&it->key, &k, sizeof k) == 0) {
      e = it;
      // Move to the front: the next lookup is most likely the same problem again.
      *prev = it->next;
      it->next = mm_cache;
      mm_cache = it;
      break;
    }
  }
  if (!e) FY_TRY(mm_create(&k, alpha, beta, &e));

  dnnl_status_t s = dnnl_memory_set_data_handle(e->mem_a, (void *)a);
  if (s == dnnl_success) s = dnnl_memory_set_data_handle(e->mem_b, (void *)b);
  if (s == dnnl_success) s = dnnl_memory_set_data_handle(e->mem_c, c);
  if (s == dnnl_success && bias) s = dnnl_memory_set_data_handle(e->mem_bias, (void *)bias);
  if (s != dnnl_success) return mm_fail(s, "set_data_handle", &k);
  dnnl_exec_arg_t args[4] = {
      {DNNL_ARG_SRC, e->mem_a},
      {DNNL_ARG_WEIGHTS, e->mem_b},
      {DNNL_ARG_DST, e->mem_c},
      {DNNL_ARG_BIAS, e->mem_bias},
  };
  s = dnnl_primitive_execute(e->prim, mm_stream, bias ? 4 : 3, args);
  if (s == dnnl_success) s = dnnl_stream_wait(mm_stream);
  if (s != dnnl_success) return mm_fail(s, "execute", &k);
  return FY_OK;
}

// `bias` (N) is added to every row of every product when not NULL (ops/cpu/linear.c uses it to
// fuse nn.Linear's bias).
fy_status fy_matmul_bias(float *c, const float *a, const float *b, const float *bias, int64_t batch, int64_t M,
                         int64_t N, int64_t K, bool ta, bool tb, float alpha, float beta, int64_t lda, int64_t ldb,
                         int64_t ldc, int64_t stride_a, int64_t stride_b, int64_t stride_c) {
  return mm_run(c, a, b, bias, batch, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc, stride_a, stride_b, stride_c,
                false);
}

// ---- bf16 operands ----

// The operands of fy_matmul16 as bf16, grown as needed (one caller at a time, as every product).
static uint16_t *mm_a16, *mm_b16;
static int64_t mm_a16_cap, mm_b16_cap;

bool fy_matmul_bf16_native(void) {
  // oneDNN's effective ISA (ONEDNN_MAX_CPU_ISA caps it) with bf16 products that outrun its fp32
  // ones: AMX's tile products (~5x), or AVX512-BF16's dot products on AMD (Zen 4 and later: 2 bf16
  // products a lane where an FMA does one, ~2x a product, 1.3x an OPT-125m step). Intel's
  // processors with AVX512-BF16 but no AMX issue its dot products at half the FMAs' rate, which
  // ran oneDNN 2.6's bf16 products below its fp32 ones (Sapphire Rapids capped to AVX512_CORE_BF16).
  static int native = -1;
  if (native < 0) {
    const unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    const bool amx = (isa & dnnl_cpu_isa_avx512_core_amx) == dnnl_cpu_isa_avx512_core_amx;
    const bool dot = (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
    __builtin_cpu_init();
    native = amx || (dot && __builtin_cpu_is("amd"));
  }
  return native;
}

// x (n) floats holding bf16 values -> *buf (n) bf16 (rounding to nearest even: exact for them).
static fy_status mm_to_bf16(uint16_t **buf, int64_t *cap, const float *x, int64_t n) {
  if (n > *cap) {
    free(*buf);
    *buf = malloc((size_t)n * sizeof **buf);
    *cap = *buf ? n : 0;
    if (!*buf) return fy_error_set(FY_ERR_NOMEM, "out of memory for a bf16 product's operand (%lld elements)",
                                   (long long)n);
  }
  fy_convert_from_f32(*buf, FY_BF16, x, (size_t)n);
  return FY_OK;
}

fy_status fy_matmul16(float *c, const float *a, const float *b, const float *bias, int64_t M, int64_t N, int64_t K,
                      bool ta, bool tb, float beta) {
  if (!fy_matmul_bf16_native() || M <= 0 || N <= 0 || K <= 0)
    return fy_matmul_bias(c, a, b, bias, 1, M, N, K, ta, tb, 1.0f, beta, 0, 0, 0, 0, 0, 0);
  FY_TRY(mm_to_bf16(&mm_a16, &mm_a16_cap, a, M * K));
  FY_TRY(mm_to_bf16(&mm_b16, &mm_b16_cap, b, K * N));
  return mm_run(c, mm_a16, mm_b16, bias, 1, M, N, K, ta, tb, 1.0f, beta, 0, 0, 0, 0, 0, 0, true);
}

// c (M,N) = alpha * op(a) (M,K) @ op(b) (K,N) + beta * c
fy_status fy_matmul(float *c, const float *a, const float *b, int64_t M, int64_t N, int64_t K,
                    bool ta, bool tb, float alpha, float beta) {
  return mm_run(c, a, b, NULL, 1, M, N, K, ta, tb, alpha, beta, 0, 0, 0, 0, 0, 0, false);
}

// c[i] (M,N) = alpha * op(a[i]) (M,K) @ op(b[i]) (K,N) + beta * c[i], i < batch
fy_status fy_matmul_batched(float *c, const float *a, const float *b, int64_t batch, int64_t M,
                            int64_t N, int64_t K, bool ta, bool tb, float alpha, float beta,
                            int64_t lda, int64_t ldb, int64_t ldc, int64_t stride_a,
                            int64_t stride_b, int64_t stride_c) {
  return mm_run(c, a, b, NULL, batch, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc, stride_a, stride_b, stride_c,
                false);
}

void fy_matmul_cache_clear(void) {
  fy_moe_workspace_free();  // (the mixture-of-experts kernels' rows, kept between calls like these)
  free(mm_a16);
  free(mm_b16);
  mm_a16 = mm_b16 = NULL;
  mm_a16_cap = mm_b16_cap = 0;
  while (mm_cache) {
    struct mm_entry *e = mm_cache;
    mm_cache = e->next;
    mm_entry_free(e);
  }
  if (mm_stream) dnnl_stream_destroy(mm_stream);
  if (mm_engine) dnnl_engine_destroy(mm_engine);
  mm_stream = NULL;
  mm_engine = NULL;
}
