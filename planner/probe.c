// The hardware probe: measurements, the JSON cache file, overrides.
#include "planner/probe.h"

#include <errno.h>
#include <json-c/json.h>
#include <omp.h>
#include <limits.h>
#include <math.h>
#include <pwd.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fy_config.h"
#include "core/clock.h"
#include "core/device.h"
#include "core/fileio.h"
#include "core/log.h"
#include "core/parse.h"
#include "memory/tier.h"
#include "ops/ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define FY_X86 1
#endif

#define GEMM_M 512
#define GEMM_N 3072
#define GEMM_K 768
#define TRIAD_BYTES (256u << 20)     // the three arrays together
#define ADAMW_PARAMS (16 << 20)
#define ADAMW_BYTES_PER_PARAM 28.0   // reads p, m, v, g; writes p, m, v
#define COPY_BYTES ((size_t)64 << 20)
#define DISK_BYTES ((size_t)256 << 20)
#define DISK_REQS 4                  // concurrent requests, as chunk traffic issues them
#define PROBE_MAX_FILE ((size_t)1 << 20)  // a probe file is a few hundred bytes
#define SIM_PROBE_CAP ((size_t)256 << 20)  // the sim pool the copy test needs, whatever the cap said

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double fy_probe_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void *alloc_aligned(size_t n) {
  void *p = NULL;
  return posix_memalign(&p, 64, n) == 0 ? p : NULL;
}

// ---- peaks ----

// The fp32 multiply-add peak: FMA_CHAINS independent chains of fused multiply-adds per thread,
// a = a * b + c, enough to cover the FMA units' latency times their throughput on current x86
// cores (4 cycles x 2 units: 8; 12 leaves room). Written with intrinsics because the project
// compiles with -ffp-contract=off: `a * b + c` in C is then a multiply and an add, two
// instructions, and measures half the peak. The widest kind the processor runs is chosen at run
// time (AVX-512, else AVX2 with FMA); the values converge to c / (1 - b) = 0.1, no overflow or
// subnormals. Each returns the fused multiply-adds done (lanes x chains x iterations).
#define FMA_CHAINS 12
#ifdef FY_X86
__attribute__((target("avx512f"))) static double fma_run_avx512(long n, float *sink) {
  const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  __m512 a[FMA_CHAINS];
  for (int k = 0; k < FMA_CHAINS; k++) a[k] = _mm512_set1_ps(1.0f + (float)k * 1e-3f);
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
    for (int k = 0; k < FMA_CHAINS; k++) a[k] = _mm512_fmadd_ps(a[k], b, c);
  }
  __m512 sum = a[0];
  for (int k = 1; k < FMA_CHAINS; k++) sum = _mm512_add_ps(sum, a[k]);
  *sink = _mm512_reduce_add_ps(sum);
  return 16.0 * FMA_CHAINS * (double)n;
}

__attribute__((target("avx2,fma"))) static double fma_run_avx2(long n, float *sink) {
  const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  __m256 a[FMA_CHAINS];
  for (int k = 0; k < FMA_CHAINS; k++) a[k] = _mm256_set1_ps(1.0f + (float)k * 1e-3f);
  for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
    for (int k = 0; k < FMA_CHAINS; k++) a[k] = _mm256_fmadd_ps(a[k], b, c);
  }
  __m256 sum = a[0];
  for (int k = 1; k < FMA_CHAINS; k++) sum = _mm256_add_ps(sum, a[k]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  *sink = lanes[0] + lanes[7];
  return 8.0 * FMA_CHAINS * (double)n;
}
#endif

// Without vector FMA: scalar chains through fmaf (one instruction where the processor has it,
// else a library call: then a floor, not a peak).
static double fma_run_scalar(long n, float *sink) {
  float a[FMA_CHAINS];
  for (int k = 0; k < FMA_CHAINS; k++) a[k] = 1.0f + (float)k * 1e-3f;
  for (long i = 0; i < n; i++)
    for (int k = 0; k < FMA_CHAINS; k++) a[k] = fmaf(a[k], 0.999999f, 1e-7f);
  float sum = 0;
  for (int k = 0; k < FMA_CHAINS; k++) sum += a[k];
  *sink = sum;
  return FMA_CHAINS * (double)n;
}

const char *fy_probe_fma_isa(void) {
#ifdef FY_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
#endif
  return "scalar";
}

double fy_probe_fma_peak_gflops(int threads, long iterations, const char *isa) {
  const char *have = fy_probe_fma_isa();
  if (!isa) {
    // The best of the vector kinds the processor has: the widest is not always the fastest (a
    // core may split a 512-bit FMA in two, and a loaded one gives either run less).
    double best = fy_probe_fma_peak_gflops(threads, iterations, have);
    if (!strcmp(have, "avx512")) best = fmax(best, fy_probe_fma_peak_gflops(threads, iterations, "avx2"));
    return best;
  }
  double (*run)(long, float *) = fma_run_scalar;
#ifdef FY_X86
  // (a narrower kind than the processor's widest runs too: AVX-512 implies AVX2 and FMA)
  if (!strcmp(isa, "avx512") && !strcmp(have, "avx512")) run = fma_run_avx512;
  else if (!strcmp(isa, "avx2") && strcmp(have, "scalar") != 0) run = fma_run_avx2;
  else if (strcmp(isa, "scalar") != 0) return 0;
#else
  if (strcmp(isa, "scalar") != 0) return 0;
#endif
  if (threads < 1) threads = omp_get_max_threads();
  double best = 0;
  for (int r = 0; r < 3; r++) {  // the best of three: a busy core only ever lowers it
    double sum = 0;
    float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sum, sink)
    {
      float s = 0;
      run(iterations / 16 + 1, &s);  // (wakes the core to its sustained clock)
      const double t0 = fy_now();
      const double fmas = run(iterations, &s);
      const double t = fy_now() - t0;
      sum += t > 0 ? 2.0 * fmas / t / 1e9 : 0;
      sink += s;
    }
    if (sink > 0 && sum > best) best = sum;  // (uses the chains' results)
  }
  return best;
}

// With vdpbf16ps (AVX512-BF16) a lane does two bf16 multiply-adds where an fp32 FMA does one: 2x
// the fp32 peak. AMX's tiles run many times that, at no peak ferry knows (0); a processor without
// either converts bf16 to fp32 and multiplies at the fp32 peak (1).
static double cpu_bf16_peak_factor(void) {
#ifdef FY_X86
  unsigned a, b, c, d;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1)) return 0;  // AMX-BF16
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1) && __builtin_cpu_supports("avx512f")) return 2;
#endif
  return 1;
}

// Dense (not 2:4 sparse) bf16 tensor-core peaks with fp32 accumulation, from the vendor's data
// sheets, by a name as cudaGetDeviceProperties gives it; the first entry the name contains wins,
// so the more specific come first. A GPU not here has no known peak.
static const struct {
  const char *name;
  double tflops;
} gpu_peaks[] = {
    {"H200", 989.4},  {"H100 PCIe", 756.5}, {"H100 NVL", 835.0}, {"H100", 989.4}, {"A100", 312.0},
    {"L40S", 362.0},  {"A30", 165.0},       {"L4", 121.0},       {"A10", 125.0},
};

double fy_probe_gpu_peak_gflops(const char *name) {
  if (!name) return 0;
  for (size_t i = 0; i < sizeof gpu_peaks / sizeof *gpu_peaks; i++) {
    const char *at = strstr(name, gpu_peaks[i].name);
    if (!at) continue;
    // The whole word: "L4" is not "L40", "A10" not "A100".
    const char next = at[strlen(gpu_peaks[i].name)];
    if ((next >= '0' && next <= '9') || (next >= 'A' && next <= 'Z')) continue;
    return gpu_peaks[i].tflops * 1000.0;
  }
  return 0;
}

double fy_probe_peak_gflops(const struct fy_probe *p, bool bf16) {
  if (!(p->peak_gflops > 0)) return 0;
  const bool gpu = strcmp(p->device, "cuda") == 0;
  double peak = p->peak_gflops;
  if (gpu && !bf16) peak /= FY_PROBE_GPU_BF16_SPEEDUP;  // ferry's fp32 products are true fp32: no TF32
  if (!gpu && bf16) peak *= cpu_bf16_peak_factor();
  // A peak below a measured rate is not the peak of this precision's products (e.g. an override
  // for the other precision): unknown.
  return peak >= fy_probe_gemm_gflops(p, bf16) ? peak : 0;
}

// ---- measurements ----

// A linear layer's three products at OPT-125m's width with 512 tokens (the fc1 of 768 -> 3072),
// laid out as ops/cpu/linear.c runs them: forward out (M,N) = inp (M,K) @ weight (N,K)^T, the
// input's gradient (M,K) = dout (M,N) @ weight (N,K), and the weight's (N,K) += dout^T @ inp.
// (Not the forward's weight as (K,N): with rows of 3072 floats, 12 KiB apart, oneDNN ran that at
// 0.36x the linears' rate on a Sapphire Rapids, and the planner's times with it.)
enum { GEMM_FORWARD, GEMM_DINP, GEMM_DWEIGHT, GEMM_KINDS };

// The median seconds of 5 runs of one of them (after a warm-up, which also JITs it): fp32, or
// with bf16 what a bf16 run's linears take (fy_matmul16: the operands converted to bf16 each call,
// as there, where the processor multiplies bf16; else the fp32 product).
static fy_status time_gemm(float *out, float *din, float *dw, const float *inp, const float *w, const float *dout,
                           int kind, bool bf16, double *seconds) {
  double t[5];
  fy_status st = FY_OK;
  for (int r = -1; r < 5 && st == FY_OK; r++) {
    double t0 = fy_now();
    switch (kind) {
      case GEMM_FORWARD:
        st = bf16 ? fy_matmul16(out, inp, w, NULL, GEMM_M, GEMM_N, GEMM_K, false, true, 0.0f)
                  : fy_matmul(out, inp, w, GEMM_M, GEMM_N, GEMM_K, false, true, 1.0f, 0.0f);
        break;
      case GEMM_DINP:
        st = bf16 ? fy_matmul16(din, dout, w, NULL, GEMM_M, GEMM_K, GEMM_N, false, false, 0.0f)
                  : fy_matmul(din, dout, w, GEMM_M, GEMM_K, GEMM_N, false, false, 1.0f, 0.0f);
        break;
      default:
        st = bf16 ? fy_matmul16(dw, dout, inp, NULL, GEMM_N, GEMM_K, GEMM_M, true, false, 1.0f)
                  : fy_matmul(dw, dout, inp, GEMM_N, GEMM_K, GEMM_M, true, false, 1.0f, 1.0f);
    }
    if (r >= 0) t[r] = fy_now() - t0;
  }
  if (st == FY_OK) *seconds = fy_probe_median(t, 5);
  return st;
}

// device_gflops: the forward's fp32 rate. bf16_speedup: the three products' fp32 time over their
// bf16 time (a bf16 product's rate differs by layout more than an fp32 one's: on a Zen 4 the
// forward ran 1.8x its fp32 rate, the backward's products less).
static fy_status measure_gemm(double *gflops, double *bf16_speedup) {
  const size_t mk = (size_t)GEMM_M * GEMM_K, nk = (size_t)GEMM_N * GEMM_K, mn = (size_t)GEMM_M * GEMM_N;
  float *inp = alloc_aligned(mk * sizeof(float)), *w = alloc_aligned(nk * sizeof(float));
  float *out = alloc_aligned(mn * sizeof(float)), *dout = alloc_aligned(mn * sizeof(float));
  float *din = alloc_aligned(mk * sizeof(float)), *dw = alloc_aligned(nk * sizeof(float));
  fy_status st = FY_OK;
  if (!inp || !w || !out || !dout || !din || !dw) {
    st = fy_error_set(FY_ERR_NOMEM, "probe: no memory for the GEMM test");
    goto out;
  }
  for (size_t i = 0; i < mk; i++) inp[i] = (float)(i % 7) * 0.01f;
  for (size_t i = 0; i < nk; i++) w[i] = (float)(i % 5) * 0.01f, dw[i] = 0;
  for (size_t i = 0; i < mn; i++) dout[i] = (float)(i % 3) * 0.01f;
  double s32[GEMM_KINDS] = {0}, s16[GEMM_KINDS] = {0}, t32 = 0, t16 = 0;
  // bf16 products only where the processor has them (else a bf16 run's products are these fp32
  // ones: exactly 1, not a ratio of two noisy timings of the same thing).
  const bool native = fy_matmul_bf16_native();
  for (int k = 0; k < GEMM_KINDS && st == FY_OK; k++) {
    st = time_gemm(out, din, dw, inp, w, dout, k, false, &s32[k]);
    if (st == FY_OK && native) st = time_gemm(out, din, dw, inp, w, dout, k, true, &s16[k]);
    t32 += s32[k], t16 += s16[k];
  }
  // The forward once more, after the others: the faster of its two medians. (About one probe in
  // ten on a shared 2-core machine measured half the rate: its five runs, ~30 ms, all inside one
  // spell of another tenant's load or of a core taken away.)
  double again = 0;
  if (st == FY_OK) st = time_gemm(out, din, dw, inp, w, dout, GEMM_FORWARD, false, &again);
  if (st == FY_OK) {
    *gflops = 2.0 * GEMM_M * GEMM_N * GEMM_K / fmin(s32[GEMM_FORWARD], again) / 1e9;
    *bf16_speedup = native ? t32 / t16 : 1.0;
  } else {
    st = fy_error_wrap(st, "probe: GEMM");
  }
out:
  free(inp), free(w), free(out), free(dout), free(din), free(dw);
  return st;
}

// STREAM's triad; bytes are counted as STREAM counts them (two reads and a write per element, no
// write-allocate traffic), which is how the memory-bound kernels' bytes are counted too.
static fy_status measure_triad(double *gbps) {
  const int64_t n = TRIAD_BYTES / (3 * sizeof(float));
  float *a = alloc_aligned((size_t)n * sizeof(float));
  float *b = alloc_aligned((size_t)n * sizeof(float));
  float *c = alloc_aligned((size_t)n * sizeof(float));
  if (!a || !b || !c) {
    free(a), free(b), free(c);
    return fy_error_set(FY_ERR_NOMEM, "probe: no memory for the memory-bandwidth test");
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) a[i] = 0.0f, b[i] = 1.0f, c[i] = 2.0f;  // first touch, as used
  const float s = 0.5f;
  double t[4];
  for (int r = -1; r < 4; r++) {
    double t0 = fy_now();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
    if (r >= 0) t[r] = fy_now() - t0;
  }
  volatile float sink = a[n / 2];
  (void)sink;
  *gbps = 3.0 * sizeof(float) * (double)n / fy_probe_median(t, 4) / 1e9;
  free(a), free(b), free(c);
  return FY_OK;
}

// One thread's memcpy of a buffer larger than the caches: bytes copied per second.
static fy_status measure_memcpy(double *gbps) {
  const size_t n = TRIAD_BYTES / 2;
  char *a = alloc_aligned(n), *b = alloc_aligned(n);
  if (!a || !b) {
    free(a), free(b);
    return fy_error_set(FY_ERR_NOMEM, "probe: no memory for the memcpy test");
  }
  memset(a, 1, n);
  memset(b, 2, n);
  double t[3];
  for (int r = -1; r < 3; r++) {
    double t0 = fy_now();
    memcpy(b, a, n);
    if (r >= 0) t[r] = fy_now() - t0;
  }
  volatile char sink = b[n / 2];
  (void)sink;
  *gbps = (double)n / fy_probe_median(t, 3) / 1e9;
  free(a), free(b);
  return FY_OK;
}

// Host AdamW with m and v stored as `sf` (fy_adamw_state_update: fp32 state with fy_adamw_update,
// the others with their conversions; every core, one range of n decayed parameters from fp32
// gradients): GB/s of the bytes a parameter it moves (fy_probe_adamw_bytes).
static fy_status measure_adamw_state(enum fy_state_format sf, double *gbps) {
  const int64_t n = ADAMW_PARAMS;
  const size_t mb = fy_state_moment_bytes(sf, n);
  float *p = alloc_aligned((size_t)n * sizeof(float)), *g = alloc_aligned((size_t)n * sizeof(float));
  void *m = alloc_aligned(mb), *v = alloc_aligned(mb);
  fy_status st = p && g && m && v ? FY_OK : fy_error_set(FY_ERR_NOMEM, "probe: no memory for the AdamW test");
  if (st == FY_OK) {  // (each page first touched by the thread that updates it)
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) p[i] = 1.0f, g[i] = 1e-3f * (float)(i & 15);
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < mb; b += 4096) {
      memset((char *)m + b, 0, mb - b < 4096 ? mb - b : 4096);
      memset((char *)v + b, 0, mb - b < 4096 ? mb - b : 4096);
    }
  }
  const struct fy_adamw_range all = {0, n, 0.1f};
  double t[3];
  for (int r = -1; r < 3 && st == FY_OK; r++) {
    double t0 = fy_now();
    st = fy_adamw_state_update(sf, p, m, v, g, n, &all, 1, 1e-4f, 0.9f, 0.95f, 1e-8f, r + 2, 1.0f);
    if (r >= 0) t[r] = fy_now() - t0;
  }
  if (st == FY_OK) *gbps = fy_probe_adamw_bytes(sf) * (double)n / fy_probe_median(t, 3) / 1e9;
  free(p), free(g), free(m), free(v);
  return st;
}

double fy_probe_adamw_bytes(enum fy_state_format state) {
  const int64_t n = ADAMW_PARAMS;
  return state == FY_STATE_F32 ? ADAMW_BYTES_PER_PARAM : 12.0 + 4.0 * (double)fy_state_moment_bytes(state, n) / (double)n;
}

double fy_probe_adamw_s(const struct fy_probe *p, enum fy_state_format state) {
  const double own = state == FY_STATE_BF16 ? p->host_adamw_bf16_gbps : state == FY_STATE_Q8 ? p->host_adamw_8bit_gbps : 0;
  return fy_probe_adamw_bytes(state) / ((own > 0 ? own : p->host_adamw_gbps) * 1e9);
}

// Wall time of one copy of n bytes on stream s, from enqueue to the host seeing it done.
static fy_status time_copy(fy_stream *s, void *dst, const void *src, size_t n, double *secs) {
  double t0 = fy_now();
  FY_TRY(fy_copy_async(s, dst, src, n));
  FY_TRY(fy_stream_sync(s));
  *secs = fy_now() - t0;
  return FY_OK;
}

static fy_status measure_copies(bool sim, double link_gbps, double cap, double *h2d, double *d2h, double *lat_us) {
  struct fy_device *dev = NULL;
  size_t pool = sim ? (cap < (double)SIM_PROBE_CAP ? (size_t)cap : SIM_PROBE_CAP) : 0;
  fy_status st = sim ? fy_device_sim_create(pool, link_gbps, &dev) : fy_device_cpu_create(0, &dev);
  if (st != FY_OK) return fy_error_wrap(st, "probe: creating the %s device", sim ? "sim" : "cpu");
  size_t n = COPY_BYTES;
  if (sim && n > pool / 2) n = (pool / 2) & ~(size_t)4095;
  if (n < 4096) n = pool;  // a tiny cap: copy what fits
  fy_stream *s = NULL;
  void *dbuf = NULL;
  char *hbuf = alloc_aligned(n ? n : 1);
  if (!hbuf) st = fy_error_set(FY_ERR_NOMEM, "probe: no memory for the copy test");
  if (st == FY_OK) st = fy_device_alloc(dev, n, &dbuf);
  if (st == FY_OK) st = fy_stream_create(dev, &s);
  if (st == FY_OK) {
    memset(hbuf, 1, n);
    double up[3], down[3], w;
    // The warm-ups fault in both buffers' pages.
    st = time_copy(s, dbuf, hbuf, n, &w);
    if (st == FY_OK) st = time_copy(s, hbuf, dbuf, n, &w);
    for (int r = 0; r < 3 && st == FY_OK; r++) {
      st = time_copy(s, dbuf, hbuf, n, &up[r]);
      if (st == FY_OK) st = time_copy(s, hbuf, dbuf, n, &down[r]);
    }
    if (st == FY_OK) {
      *h2d = (double)n / fy_probe_median(up, 3) / 1e9;
      *d2h = (double)n / fy_probe_median(down, 3) / 1e9;
      // The latency: 100 small copies queued back to back, beyond what their bytes take.
      size_t small = n < 4096 ? n : 4096;
      double lat[3];
      for (int r = 0; r < 3 && st == FY_OK && lat_us; r++) {
        double t0 = fy_now();
        for (int i = 0; i < 100 && st == FY_OK; i++) st = fy_copy_async(s, dbuf, hbuf, small);
        if (st == FY_OK) st = fy_stream_sync(s);
        lat[r] = (fy_now() - t0) / 100 - (double)small / (*h2d * 1e9);
      }
      if (st == FY_OK && lat_us) *lat_us = fy_probe_median(lat, 3) > 0 ? fy_probe_median(lat, 3) * 1e6 : 0;
    } else {
      st = fy_error_wrap(st, "probe: copy test");
    }
  } else {
    st = fy_error_wrap(st, "probe: copy test");
  }
  fy_stream_free(s);
  if (dbuf) fy_device_dealloc(dev, dbuf, n);
  fy_device_free(dev);
  free(hbuf);
  return st;
}

// The sim's cost of a parallel region besides its work (its FLOPs at the GEMM rate, its bytes at
// the memory rate, as planner/profile.c counts them): a layer's small kernels (layernorm, linear,
// relu, residual add) run as host functions on a sim stream, as a training step runs them, and
// what they take beyond that work is shared among their parallel regions. It is the hand-off to
// the stream's thread and, mostly, the OpenMP team that thread wakes for every region: with more
// threads in the process's teams than cores, libgomp's helpers sleep between regions instead of
// spinning, so a small kernel on the sim costs about twice what it does on the main thread (2
// cores: ~50 us a region). Neither the same kernels on the main thread (its team may spin) nor
// the calls (the add's loop is too small to be split: it costs its work alone) are the measure.
#define KO_BT 256
#define KO_C 128
#define KO_LAYERS 40
#define KO_ROUNDS 7
struct ko_bufs { float *x, *y, *h, *w, *mean, *rstd, *lw, *lb; };
static void ko_layernorm(void *a) {
  struct ko_bufs *b = a;
  fy_layernorm_forward(b->y, b->mean, b->rstd, b->x, b->lw, b->lb, KO_BT, KO_C, 1e-5f);
}
static void ko_linear(void *a) {
  struct ko_bufs *b = a;
  (void)fy_linear_forward(b->h, b->y, b->w, NULL, KO_BT, KO_C, 4 * KO_C, false);
}
static void ko_relu(void *a) {
  struct ko_bufs *b = a;
  fy_relu_forward(b->h, b->h, KO_BT * 4 * KO_C);
}
static void ko_add(void *a) {
  struct ko_bufs *b = a;
  fy_add_forward(b->x, b->x, b->y, KO_BT * KO_C);
}
static void (*const ko_kernels[])(void *) = {ko_layernorm, ko_linear, ko_relu, ko_add};
#define KO_N (sizeof ko_kernels / sizeof *ko_kernels)

// One layer of the KO kernels as planner/profile.c models them (fp32): their work in seconds and
// their parallel regions (by ops/ops.h's sizes: the add's loop is not split).
static double ko_layer_work(double gflops, double mem_gbps) {
  const double bt = KO_BT, c = KO_C, flops = 2 * bt * c * 4 * c;        // linear
  double bytes = bt * c * 4 * 2 + bt * 4 * c * 4 * 2 + bt * c * 4 * 3;  // layernorm, relu, add
  return flops / (gflops * 1e9) + bytes / (mem_gbps * 1e9);
}
static int ko_layer_regions(void) {
  return (KO_BT * KO_C > FY_PAR_ROWS) + 1 + (KO_BT * 4 * KO_C > FY_PAR_ELEMENTWISE) +
         (KO_BT * KO_C > FY_PAR_ELEMENTWISE);
}

static fy_status measure_kernel_overhead(double gflops, double mem_gbps, double *us) {
  struct ko_bufs b = {0};
  float **bufs[] = {&b.x, &b.y, &b.h, &b.w, &b.mean, &b.rstd, &b.lw, &b.lb};
  size_t sizes[] = {KO_BT * KO_C, KO_BT * KO_C, KO_BT * 4 * KO_C, 4 * KO_C * KO_C, KO_BT, KO_BT, KO_C, KO_C};
  enum { NB = sizeof bufs / sizeof *bufs };
  fy_status st = FY_OK;
  for (int i = 0; i < NB; i++)
    if (!(*bufs[i] = alloc_aligned(sizes[i] * sizeof(float)))) st = fy_error_set(FY_ERR_NOMEM, "probe: kernel test");
  struct fy_device *dev = NULL;
  fy_stream *s = NULL;
  if (st == FY_OK) st = fy_device_sim_create(1 << 20, 0, &dev);
  if (st == FY_OK) st = fy_stream_create(dev, &s);
  if (st == FY_OK) {
    for (int i = 0; i < NB; i++)
      for (size_t k = 0; k < sizes[i]; k++) (*bufs[i])[k] = i == 6 ? 1.0f : (float)(k % 13) * 0.01f;
    for (size_t k = 0; k < KO_N && st == FY_OK; k++) st = fy_stream_enqueue(s, ko_kernels[k], &b);  // (oneDNN's JIT)
    if (st == FY_OK) st = fy_stream_sync(s);
  }
  const double work = ko_layer_work(gflops, mem_gbps);
  double d[KO_ROUNDS];
  for (int r = 0; r < KO_ROUNDS && st == FY_OK; r++) {
    double t0 = fy_now();
    for (int l = 0; l < KO_LAYERS && st == FY_OK; l++)
      for (size_t k = 0; k < KO_N && st == FY_OK; k++) st = fy_stream_enqueue(s, ko_kernels[k], &b);
    if (st == FY_OK) st = fy_stream_sync(s);
    d[r] = (fy_now() - t0 - KO_LAYERS * work) / (KO_LAYERS * ko_layer_regions());
  }
  if (st == FY_OK) *us = fmax(fy_probe_median(d, KO_ROUNDS) * 1e6, 0.1);  // measured: never the 0 of "unknown"
  else st = fy_error_wrap(st, "probe: kernel overhead test");
  if (s) fy_stream_free(s);
  fy_device_free(dev);
  for (int i = 0; i < NB; i++) free(*bufs[i]);
  return st;
}

// Submits DISK_REQS requests that together cover the slot, waits for all of them.
static fy_status disk_pass(struct fy_disk_tier *t, int64_t h, char *buf, size_t bytes, bool write,
                           struct fy_disk_req **reqs, double *secs) {
  const size_t part = bytes / DISK_REQS;
  fy_status st = FY_OK;
  int started = 0;
  double t0 = fy_now();
  for (int i = 0; i < DISK_REQS && st == FY_OK; i++, started++)
    st = write ? fy_disk_write_async(t, h, i * part, buf + i * part, part, reqs[i])
               : fy_disk_read_async(t, h, i * part, buf + i * part, part, reqs[i]);
  if (st != FY_OK) started--;
  for (int i = 0; i < started; i++) {
    fy_status w = fy_disk_wait(reqs[i]);
    if (st == FY_OK) st = w;
  }
  *secs = fy_now() - t0;
  return st;
}

// The disk tier does not fsync, and a non-root process cannot drop the page cache safely, so the
// write rate is what the tier sees for a 256 MB burst (the page cache absorbs it up to the kernel's
// dirty limits) and the read, right after, is mostly served from the page cache. Both are what is
// measured, and upper bounds for the disk's sustained rates. A disk with less than twice the burst
// free is timed with half its free space (the planner then finds what fits there).
static fy_status measure_disk(const char *dir, double *rd, double *wr) {
  struct fy_disk_tier *t = NULL;
  struct fy_disk_req *reqs[DISK_REQS] = {0};
  char *buf = NULL;
  int64_t h = 0;
  double space = 0;
  size_t bytes = DISK_BYTES;
  const size_t least = DISK_REQS * 4096;
  fy_status st = fy_disk_space(dir, &space);
  if (st == FY_OK && space / 2 < (double)bytes) bytes = (size_t)(space / 2) / least * least;
  if (st == FY_OK && bytes < least)
    st = fy_error_set(FY_ERR_IO, "%s has %.0f bytes free, too few for a disk tier", dir, space);
  if (st == FY_OK) st = fy_disk_tier_open(dir, 0, &t);
  if (st == FY_OK) st = fy_disk_alloc(t, bytes, &h);
  for (int i = 0; i < DISK_REQS && st == FY_OK; i++) st = fy_disk_req_create(&reqs[i]);
  if (st == FY_OK && !(buf = alloc_aligned(bytes)))
    st = fy_error_set(FY_ERR_NOMEM, "probe: no memory for the disk test");
  if (st == FY_OK) {
    for (size_t i = 0; i < bytes; i += 4096) memset(buf + i, (int)(i >> 12) | 1, 4096);
    double tw = 0, tr = 0;
    st = disk_pass(t, h, buf, bytes, true, reqs, &tw);
    if (st == FY_OK) st = disk_pass(t, h, buf, bytes, false, reqs, &tr);
    if (st == FY_OK) {
      *wr = (double)bytes / tw / 1e9;
      *rd = (double)bytes / tr / 1e9;
    }
  }
  if (st != FY_OK) st = fy_error_wrap(st, "probe: disk test");
  for (int i = 0; i < DISK_REQS; i++)
    if (reqs[i]) fy_disk_req_free(reqs[i]);
  if (t) fy_disk_tier_close(t);
  free(buf);
  return st;
}

static unsigned long long read_ull_file(const char *path, bool *ok) {
  FILE *f = fopen(path, "r");
  char line[64];
  *ok = false;
  if (!f) return 0;
  unsigned long long v = 0;
  if (fgets(line, sizeof line, f)) {
    char *end;
    errno = 0;
    v = strtoull(line, &end, 10);
    *ok = errno == 0 && end != line;
  }
  fclose(f);
  return v;
}

// Memory available to this process now: MemAvailable, bounded by a cgroup v2 limit.
static double host_mem_available(void) {
  double avail = 0;
  FILE *f = fopen("/proc/meminfo", "r");
  if (f) {
    char line[256];
    unsigned long long kb;
    while (fgets(line, sizeof line, f))
      if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = (double)kb * 1024.0;
    fclose(f);
  }
  if (avail <= 0) {
    long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0) avail = (double)pages * (double)psz;
  }
  bool ok_max, ok_cur;
  unsigned long long max = read_ull_file("/sys/fs/cgroup/memory.max", &ok_max);  // "max": no limit
  unsigned long long cur = read_ull_file("/sys/fs/cgroup/memory.current", &ok_cur);
  if (ok_max && ok_cur && max > cur && (double)(max - cur) < avail) avail = (double)(max - cur);
  return avail;
}

// Four significant digits: the run-to-run noise is larger than that, and the file stays readable.
static double round4(double x) {
  if (!(x > 0) || !isfinite(x)) return x;
  double scale = pow(10.0, 3 - floor(log10(x)));
  return round(x * scale) / scale;
}

fy_status fy_probe_measure(const char *dev_kind, double device_mem, double link_gbps,
                           const char *disk_dir, struct fy_probe *out) {
  if (!dev_kind || (strcmp(dev_kind, "cpu") != 0 && strcmp(dev_kind, "sim") != 0))
    return fy_error_set(FY_ERR_UNSUPPORTED, "probe: cannot measure device '%s' (cpu or sim)",
                        dev_kind ? dev_kind : "(null)");
  bool sim = strcmp(dev_kind, "sim") == 0;
  if (!(device_mem >= 0) || !isfinite(device_mem) || (sim && device_mem <= 0))
    return fy_error_set(FY_ERR_INVALID, "probe: the %s device needs a memory size > 0, got %g",
                        dev_kind, device_mem);
  if (!(link_gbps >= 0) || !isfinite(link_gbps))
    return fy_error_set(FY_ERR_INVALID, "probe: the link rate must be >= 0 GB/s, got %g", link_gbps);
  if (disk_dir && strlen(disk_dir) >= sizeof out->disk_dir)  // (before the seconds of measuring)
    return fy_error_set(FY_ERR_INVALID, "probe: disk directory name too long (%zu bytes)",
                        strlen(disk_dir));
  struct fy_probe p;
  memset(&p, 0, sizeof p);
  p.format = FY_PROBE_FORMAT;
  snprintf(p.device, sizeof p.device, "%s", dev_kind);
  p.host_mem = host_mem_available();
  if (!(p.host_mem > 0)) return fy_error_set(FY_ERR_INTERNAL, "probe: cannot tell the host's memory");
  p.device_mem = device_mem > 0 ? floor(device_mem) : p.host_mem;
  FY_TRY(measure_triad(&p.host_mem_gbps));
  FY_TRY(measure_memcpy(&p.host_copy_gbps));
  FY_TRY(measure_gemm(&p.host_gflops, &p.bf16_speedup));
  p.device_gflops = p.host_gflops;  // cpu and sim run their kernels on this CPU
  FY_TRY(measure_adamw_state(FY_STATE_F32, &p.host_adamw_gbps));
  FY_TRY(measure_adamw_state(FY_STATE_BF16, &p.host_adamw_bf16_gbps));
  FY_TRY(measure_adamw_state(FY_STATE_Q8, &p.host_adamw_8bit_gbps));
  FY_TRY(measure_copies(sim, link_gbps, p.device_mem, &p.h2d_gbps, &p.d2h_gbps, sim ? &p.copy_latency_us : NULL));
  if (sim) FY_TRY(measure_kernel_overhead(p.device_gflops, p.host_mem_gbps, &p.kernel_overhead_us));
  p.peak_gflops = fy_probe_fma_peak_gflops(0, FY_PROBE_FMA_ITERATIONS, NULL);
  double *rates[] = {&p.device_gflops, &p.host_gflops, &p.h2d_gbps, &p.d2h_gbps, &p.host_adamw_gbps,
                     &p.host_adamw_bf16_gbps, &p.host_adamw_8bit_gbps, &p.host_mem_gbps, &p.bf16_speedup,
                     &p.peak_gflops};
  for (size_t i = 0; i < sizeof rates / sizeof *rates; i++) *rates[i] = round4(*rates[i]);
  bool measured;
  if (disk_dir && disk_dir[0]) FY_TRY(fy_probe_add_disk(&p, disk_dir, &measured));
  *out = p;
  return FY_OK;
}

fy_status fy_probe_add_disk(struct fy_probe *p, const char *disk_dir, bool *measured) {
  *measured = false;
  if (!disk_dir || !disk_dir[0]) return FY_OK;
  if (strlen(disk_dir) >= sizeof p->disk_dir)
    return fy_error_set(FY_ERR_INVALID, "probe: disk directory name too long (%zu bytes)", strlen(disk_dir));
  FY_TRY(fy_mkdir_p(disk_dir));  // (the directory the disk tier will use: made when missing)
  char real[PATH_MAX];
  const char *d = realpath(disk_dir, real) && strlen(real) < sizeof p->disk_dir ? real : disk_dir;
  if (p->disk_dir[0] && p->disk_read_gbps > 0 && p->disk_write_gbps > 0 && strcmp(d, p->disk_dir) == 0) return FY_OK;
  double rd = 0, wr = 0;
  FY_TRY(measure_disk(disk_dir, &rd, &wr));
  p->disk_read_gbps = round4(rd);
  p->disk_write_gbps = round4(wr);
  snprintf(p->disk_dir, sizeof p->disk_dir, "%s", d);
  *measured = true;
  return FY_OK;
}

// A probe read from a file of an older format, brought to this one: the kernel overhead (format 1:
// per kernel call, on sim) measured again per parallel region. *changed: whether p changed.
static fy_status upgrade_format(const char *path, struct fy_probe *p, bool *changed) {
  if (p->format >= FY_PROBE_FORMAT) return FY_OK;
  if (strcmp(p->device, "sim") == 0 && p->kernel_overhead_us > 0) {
    const double old = p->kernel_overhead_us;
    FY_TRY(measure_kernel_overhead(p->device_gflops, p->host_mem_gbps, &p->kernel_overhead_us));
    fy_log_info("probe file %s is from an older ferry (format %d): kernel_overhead_us, now per parallel "
                "region of a kernel, measured again: %.3g us (was %.3g per call); the rest kept",
                path, p->format, p->kernel_overhead_us, old);
  }
  p->format = FY_PROBE_FORMAT;
  *changed = true;
  return FY_OK;
}

fy_status fy_probe_cached(const struct fy_probe_cache *c, struct fy_probe *p, bool *measured) {
  const bool cuda = strcmp(c->device, "cuda") == 0;
  *measured = false;
  fy_status st = c->remeasure ? FY_ERR_NOT_FOUND : fy_probe_read(c->path, p);
  // (Planning for a GPU from a machine without one: any cached probe of this CPU will do.)
  if (st == FY_OK && strcmp(p->device, c->device) != 0 && (!cuda || c->gpu)) st = FY_ERR_NOT_FOUND;
  bool changed = false;
  if (st == FY_ERR_NOT_FOUND) {
    FY_TRY(fy_probe_measure(cuda ? "sim" : c->device, c->device_mem, c->link_gbps, c->disk_dir, p));
    if (cuda && c->gpu) {
#if FY_HAVE_CUDA
      FY_TRY(fy_probe_measure_gpu(0, p));
#else
      return fy_error_set(FY_ERR_UNSUPPORTED, "probe: measuring a GPU needs a ferry built with CUDA");
#endif
    }
    *measured = changed = true;
  } else if (st != FY_OK) {
    return st;
  } else {
    FY_TRY(upgrade_format(c->path, p, &changed));
    // A file from before peak_gflops: measured now (a few tens of ms) and not written back, so that
    // the file still reads in the ferry that wrote it.
    if (!cuda && strcmp(p->device, "cuda") != 0 && !(p->peak_gflops > 0))
      p->peak_gflops = round4(fy_probe_fma_peak_gflops(0, FY_PROBE_FMA_ITERATIONS, NULL));
    bool timed = false;
    FY_TRY(fy_probe_add_disk(p, c->disk_dir, &timed));  // a --disk-dir the cached probe has not timed
    changed = changed || timed;
  }
  // (A directory that has gone: no bound known, as the disk tier will say when it opens.)
  if (p->disk_dir[0] && fy_disk_space(p->disk_dir, &p->disk_space) != FY_OK) p->disk_space = 0;
  if (!changed || !c->write) return FY_OK;
  st = fy_probe_write(c->path, p);
  return c->write_errors ? st : FY_OK;
}

// ---- the fields, shared by the file and the overrides ----

enum kind { K_STRING, K_BYTES, K_RATE, K_RATE0 };  // K_RATE0: zero allowed (disk)

struct field {
  const char *key;
  enum kind kind;
  size_t off, cap;  // cap: the char array's size for strings
  const char *unit;
  bool optional;    // added after the first files: a file without it reads as 0 (derived or none)
};

#define NUM(name, kind, unit) {#name, kind, offsetof(struct fy_probe, name), 0, unit, false}
#define NUM_OPTIONAL(name, unit) {#name, K_RATE0, offsetof(struct fy_probe, name), 0, unit, true}
#define STR(name) {#name, K_STRING, offsetof(struct fy_probe, name), sizeof(((struct fy_probe *)0)->name), "", false}
static const struct field fields[] = {
    STR(device),
    NUM(device_mem, K_BYTES, "bytes"),
    NUM(host_mem, K_BYTES, "bytes"),
    NUM(device_gflops, K_RATE, "GFLOP/s"),
    NUM(host_gflops, K_RATE, "GFLOP/s"),
    NUM(h2d_gbps, K_RATE, "GB/s"),
    NUM(d2h_gbps, K_RATE, "GB/s"),
    NUM(host_adamw_gbps, K_RATE, "GB/s"),
    NUM(host_mem_gbps, K_RATE, "GB/s"),
    NUM(disk_read_gbps, K_RATE0, "GB/s"),
    NUM(disk_write_gbps, K_RATE0, "GB/s"),
    STR(disk_dir),
    NUM_OPTIONAL(comm_gbps, "GB/s"),
    NUM_OPTIONAL(copy_latency_us, "us"),
    NUM_OPTIONAL(host_copy_gbps, "GB/s"),
    NUM_OPTIONAL(kernel_overhead_us, "us"),
    NUM_OPTIONAL(bf16_speedup, "x"),
    NUM_OPTIONAL(device_mem_gbps, "GB/s"),
    NUM_OPTIONAL(peak_gflops, "GFLOP/s"),
    NUM_OPTIONAL(host_adamw_bf16_gbps, "GB/s"),
    NUM_OPTIONAL(host_adamw_8bit_gbps, "GB/s"),
};
#define NFIELDS (sizeof fields / sizeof *fields)

// The keys, comma-separated, for the messages that name them all (with `extra` after the numbers'
// shorthands when not NULL).
static const char *known_keys(const char *extra) {
  static char buf[1024];
  size_t n = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < NFIELDS && n < sizeof buf; i++)
    n += (size_t)snprintf(buf + n, sizeof buf - n, "%s%s", i ? ", " : "", fields[i].key);
  if (extra && n < sizeof buf) snprintf(buf + n, sizeof buf - n, ", %s", extra);
  return buf;
}

static double *num_at(struct fy_probe *p, const struct field *f) { return (double *)((char *)p + f->off); }
static char *str_at(struct fy_probe *p, const struct field *f) { return (char *)p + f->off; }

static bool device_known(const char *s) {
  return !strcmp(s, "cpu") || !strcmp(s, "sim") || !strcmp(s, "cuda");
}

// ---- the file ----

// The shortest of %.15g..%.17g that reads back as the same double: "12.5", not "12.499999999999998".
static void format_double(char *buf, size_t n, double v) {
  for (int prec = 15; prec <= 17; prec++) {
    snprintf(buf, n, "%.*g", prec, v);
    if (strtod(buf, NULL) == v) break;
  }
  if (!strpbrk(buf, ".eEn")) strncat(buf, ".0", n - strlen(buf) - 1);  // stays a JSON double
}

static fy_status mkdir_parents(const char *path) {
  char dir[PATH_MAX];
  if (snprintf(dir, sizeof dir, "%s", path) >= (int)sizeof dir)
    return fy_error_set(FY_ERR_INVALID, "path too long: %s", path);
  char *slash = strrchr(dir, '/');
  if (!slash || slash == dir) return FY_OK;
  *slash = '\0';
  for (char *q = dir + 1;; q++) {
    if (*q == '/' || *q == '\0') {
      char c = *q;
      *q = '\0';
      if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return fy_error_set(FY_ERR_IO, "cannot create directory %s: %s", dir, strerror(errno));
      *q = c;
      if (c == '\0') break;
    }
  }
  return FY_OK;
}

fy_status fy_probe_write(const char *path, const struct fy_probe *p) {
  json_object *o = json_object_new_object();
  json_object_object_add(o, "format", json_object_new_int(FY_PROBE_FORMAT));  // (p in this ferry's terms)
  for (size_t i = 0; i < NFIELDS; i++) {
    const struct field *f = &fields[i];
    json_object *v;
    if (f->kind == K_STRING) {
      v = json_object_new_string(str_at((struct fy_probe *)p, f));
    } else {
      double d = *num_at((struct fy_probe *)p, f);
      if (f->kind == K_BYTES && d == floor(d) && fabs(d) < 9007199254740992.0) {
        v = json_object_new_int64((int64_t)d);
      } else {
        char buf[40];
        format_double(buf, sizeof buf, d);
        v = json_object_new_double_s(d, buf);
      }
    }
    json_object_object_add(o, f->key, v);
  }
  const char *text =
      json_object_to_json_string_ext(o, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE);
  fy_status st = mkdir_parents(path);
  char tmp[PATH_MAX + 32];
  snprintf(tmp, sizeof tmp, "%s.tmp-%d", path, (int)getpid());
  FILE *f = st == FY_OK ? fopen(tmp, "w") : NULL;
  if (st == FY_OK && !f) st = fy_error_set(FY_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
  if (f) {
    size_t n = strlen(text);
    bool ok = fwrite(text, 1, n, f) == n && fputc('\n', f) != EOF && fflush(f) == 0 &&
              fsync(fileno(f)) == 0;
    int err = errno;
    ok = fclose(f) == 0 && ok;
    if (ok && rename(tmp, path) != 0) ok = false, err = errno;
    if (!ok) {
      unlink(tmp);
      st = fy_error_set(FY_ERR_IO, "writing %s: %s", path, strerror(err ? err : EIO));
    }
  }
  json_object_put(o);
  return st;
}

static fy_status parse_object(const char *path, const char *text, json_object **out) {
  json_tokener *tok = json_tokener_new();
  if (!tok) return fy_error_set(FY_ERR_NOMEM, "probe file %s: out of memory", path);
  json_tokener_set_flags(tok, JSON_TOKENER_STRICT);
  int len = (int)strlen(text);
  json_object *o = json_tokener_parse_ex(tok, text, len);
  enum json_tokener_error jerr = json_tokener_get_error(tok);
  size_t end = json_tokener_get_parse_end(tok);
  json_tokener_free(tok);
  if (!o || jerr != json_tokener_success) {
    json_object_put(o);
    return fy_error_set(FY_ERR_FORMAT, "probe file %s: not JSON (%s at byte %zu)", path,
                        jerr == json_tokener_continue ? "unexpected end" : json_tokener_error_desc(jerr),
                        end);
  }
  for (const char *q = text + end; *q; q++)
    if (!strchr(" \t\r\n", *q)) {
      json_object_put(o);
      return fy_error_set(FY_ERR_FORMAT, "probe file %s: not JSON (text after the object at byte %zu)",
                          path, (size_t)(q - text));
    }
  if (!json_object_is_type(o, json_type_object)) {
    json_object_put(o);
    return fy_error_set(FY_ERR_FORMAT, "probe file %s: not a JSON object", path);
  }
  *out = o;
  return FY_OK;
}

fy_status fy_probe_read(const char *path, struct fy_probe *out) {
  char *text = NULL;
  fy_status rst = fy_file_read_all(path, PROBE_MAX_FILE, "a probe file", &text, NULL);
  if (rst != FY_OK) return fy_error_wrap(rst, "probe file");
  json_object *o = NULL;
  fy_status st = parse_object(path, text, &o);
  free(text);
  if (st != FY_OK) return st;

  // Unknown keys first, all of them named: a misspelt key would otherwise read as "missing".
  char unknown[512] = "";
  json_object_object_foreach(o, key, val) {
    (void)val;
    bool known = !strcmp(key, "format");
    for (size_t i = 0; i < NFIELDS && !known; i++) known = !strcmp(key, fields[i].key);
    if (!known) {
      size_t u = strlen(unknown);
      snprintf(unknown + u, sizeof unknown - u, "%s'%s'", u ? ", " : "", key);
    }
  }
  if (unknown[0]) {
    json_object_put(o);
    return fy_error_set(FY_ERR_FORMAT, "probe file %s: unknown key(s) %s (known: %s)", path, unknown, known_keys("format"));
  }
  struct fy_probe p;
  memset(&p, 0, sizeof p);
  p.format = 1;  // (a file without the key: from before formats)
  json_object *fv;
  if (json_object_object_get_ex(o, "format", &fv)) {
    int64_t v = json_object_get_int64(fv);
    if (!json_object_is_type(fv, json_type_int) || v < 1)
      st = fy_error_set(FY_ERR_FORMAT, "probe file %s: 'format' must be an integer >= 1", path);
    else if (v > FY_PROBE_FORMAT)
      st = fy_error_set(FY_ERR_FORMAT, "probe file %s: format %lld is from a newer ferry (this one reads "
                        "1 to %d): 'ferry probe --remeasure' writes this one's", path, (long long)v, FY_PROBE_FORMAT);
    else
      p.format = (int)v;
  }
  for (size_t i = 0; i < NFIELDS && st == FY_OK; i++) {
    const struct field *f = &fields[i];
    json_object *v;
    if (!json_object_object_get_ex(o, f->key, &v)) {
      if (f->optional) continue;
      st = fy_error_set(FY_ERR_FORMAT, "probe file %s: key '%s' is missing", path, f->key);
    } else if (f->kind == K_STRING) {
      if (!json_object_is_type(v, json_type_string)) {
        st = fy_error_set(FY_ERR_FORMAT, "probe file %s: '%s' must be a string", path, f->key);
      } else {
        const char *s = json_object_get_string(v);
        if (strlen(s) >= f->cap || strlen(s) != (size_t)json_object_get_string_len(v))
          st = fy_error_set(FY_ERR_FORMAT, "probe file %s: '%s' is too long or holds a NUL", path, f->key);
        else if (f->off == offsetof(struct fy_probe, device) && !device_known(s))
          st = fy_error_set(FY_ERR_FORMAT, "probe file %s: 'device' is '%s' (cpu, sim or cuda)", path, s);
        else
          memcpy(str_at(&p, f), s, strlen(s) + 1);
      }
    } else {
      if (!json_object_is_type(v, json_type_int) && !json_object_is_type(v, json_type_double)) {
        st = fy_error_set(FY_ERR_FORMAT, "probe file %s: '%s' must be a number (%s), got %s", path,
                          f->key, f->unit, json_type_to_name(json_object_get_type(v)));
      } else {
        double d = json_object_get_double(v);
        if (!isfinite(d) || d < 0 || (d == 0 && f->kind != K_RATE0))
          st = fy_error_set(FY_ERR_FORMAT, "probe file %s: '%s' must be a finite number %s 0 (%s), got %g",
                            path, f->key, f->kind == K_RATE0 ? ">=" : ">", f->unit, d);
        else
          *num_at(&p, f) = d;
      }
    }
  }
  json_object_put(o);
  if (st == FY_OK) *out = p;
  return st;
}

void fy_probe_default_path(char *buf, size_t n) {
  const char *e = getenv("FERRY_PROBE");
  if (e && e[0]) {
    snprintf(buf, n, "%s", e);
    return;
  }
  e = getenv("XDG_CACHE_HOME");
  if (e && e[0] == '/') {  // the XDG spec: a relative value is invalid and ignored
    snprintf(buf, n, "%s/ferry/probe.json", e);
    return;
  }
  const char *home = getenv("HOME");
  if (!home || !home[0]) {
    struct passwd *pw = getpwuid(getuid());
    home = pw && pw->pw_dir ? pw->pw_dir : ".";
  }
  snprintf(buf, n, "%s/.cache/ferry/probe.json", home);
}

// ---- overrides ----

// A size with an optional binary unit (core/parse.h), in whole bytes, at least one.
static bool parse_size(const char *s, double *out) {
  double v;
  if (!fy_parse_size(s, &v) || floor(v) <= 0) return false;
  *out = floor(v);
  return true;
}

static bool parse_rate(const char *s, bool zero_ok, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  while (*end == ' ') end++;
  if (errno || end == s || *end || !isfinite(v) || v < 0 || (v == 0 && !zero_ok)) return false;
  *out = v;
  return true;
}

fy_status fy_probe_override(struct fy_probe *p, const char *key_in, const char *value) {
  char key[64];
  if (!key_in || !value || snprintf(key, sizeof key, "%s", key_in) >= (int)sizeof key)
    return fy_error_set(FY_ERR_INVALID, "probe override: bad key '%s'", key_in ? key_in : "(null)");
  for (char *q = key; *q; q++)
    if (*q == '-') *q = '_';
  while (*value == ' ') value++;

  // Shorthands first.
  double v = 0;
  bool tflops_dev = !strcmp(key, "device_tflops"), tflops_host = !strcmp(key, "host_tflops");
  bool tflops_peak = !strcmp(key, "device_peak_tflops");
  if (tflops_dev || tflops_host || tflops_peak) {
    if (!parse_rate(value, false, &v))
      return fy_error_set(FY_ERR_INVALID, "probe override %s: '%s' is not a rate > 0 in TFLOP/s "
                          "(e.g. 312)", key_in, value);
    *(tflops_dev ? &p->device_gflops : tflops_host ? &p->host_gflops : &p->peak_gflops) = v * 1000.0;
    return FY_OK;
  }
  if (!strcmp(key, "disk_space")) {  // (not a field of the file)
    if (!(strcmp(value, "0") == 0 ? (v = 0, true) : parse_size(value, &v)))
      return fy_error_set(FY_ERR_INVALID, "probe override %s: '%s' is not a size such as 500GiB (or 0: no bound)",
                          key_in, value);
    p->disk_space = v;
    return FY_OK;
  }
  if (!strcmp(key, "link_gbps")) {
    if (!parse_rate(value, false, &v))
      return fy_error_set(FY_ERR_INVALID, "probe override %s: '%s' is not a rate > 0 in GB/s "
                          "(e.g. 25)", key_in, value);
    p->h2d_gbps = p->d2h_gbps = v;
    return FY_OK;
  }
  const struct field *f = NULL;
  for (size_t i = 0; i < NFIELDS && !f; i++)
    if (!strcmp(key, fields[i].key)) f = &fields[i];
  if (!f)
    return fy_error_set(FY_ERR_INVALID, "probe override: unknown key '%s' (known: %s)", key_in,
                        known_keys("device_tflops, host_tflops, device_peak_tflops, link_gbps, disk_space"));
  switch (f->kind) {
    case K_STRING:
      if (strlen(value) >= f->cap)
        return fy_error_set(FY_ERR_INVALID, "probe override %s: value too long (%zu bytes, at most %zu)",
                            key_in, strlen(value), f->cap - 1);
      if (f->off == offsetof(struct fy_probe, device) && !device_known(value))
        return fy_error_set(FY_ERR_INVALID, "probe override %s: '%s' is not a device (cpu, sim or cuda)",
                            key_in, value);
      // A CPU's bf16 speedup and memory say nothing of a GPU's, nor a GPU's of a CPU's: from one
      // kind to the other they become unknown (their defaults), unless given.
      if (f->off == offsetof(struct fy_probe, device) && (strcmp(p->device, "cuda") == 0) != (strcmp(value, "cuda") == 0))
        p->bf16_speedup = p->device_mem_gbps = p->peak_gflops = 0;
      memcpy(str_at(p, f), value, strlen(value) + 1);
      return FY_OK;
    case K_BYTES:
      if (!parse_size(value, &v))
        return fy_error_set(FY_ERR_INVALID, "probe override %s: '%s' is not a size such as 40GiB or "
                            "512MiB", key_in, value);
      break;
    case K_RATE:
    case K_RATE0:
      if (!parse_rate(value, f->kind == K_RATE0, &v))
        return fy_error_set(FY_ERR_INVALID, "probe override %s: '%s' is not a number %s 0 in %s (e.g. "
                            "12.5)", key_in, value, f->kind == K_RATE0 ? ">=" : ">", f->unit);
      break;
  }
  *num_at(p, f) = v;
  return FY_OK;
}

// ---- printing ----

static void print_bytes(FILE *f, const char *key, double b) {
  const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double x = b;
  while (x >= 1024.0 && u < 5) x /= 1024.0, u++;
  fprintf(f, "%-16s %.2f %s (%.0f bytes)\n", key, x, unit[u], b);
}

double fy_probe_gemm_gflops(const struct fy_probe *p, bool bf16) {
  const bool gpu = strcmp(p->device, "cuda") == 0;
  const double x = p->bf16_speedup > 0 ? p->bf16_speedup : gpu ? FY_PROBE_GPU_BF16_SPEEDUP : 1.0;
  if (gpu) return bf16 ? p->device_gflops : p->device_gflops / x;
  return bf16 ? p->device_gflops * x : p->device_gflops;
}

double fy_probe_device_mem_gbps(const struct fy_probe *p) {
  if (strcmp(p->device, "cuda") != 0) return p->host_mem_gbps;
  return p->device_mem_gbps > 0 ? p->device_mem_gbps : p->device_gflops / 100;
}

double fy_probe_comm_gbps(const struct fy_probe *p) {
  if (p->comm_gbps > 0) return p->comm_gbps;
  return strcmp(p->device, "cuda") == 0 ? 25.0 : p->host_mem_gbps / 2;
}

void fy_probe_print(const struct fy_probe *p, FILE *f) {
  bool disk = p->disk_dir[0] != '\0';
  fprintf(f, "%-16s %s\n", "device", p->device);
  print_bytes(f, "device_mem", p->device_mem);
  print_bytes(f, "host_mem", p->host_mem);
  const bool gpu = strcmp(p->device, "cuda") == 0;
  if (gpu)
    fprintf(f, "%-16s %.1f GFLOP/s (bf16 GEMM, fp32 accumulation)\n", "device_gflops", p->device_gflops);
  else
    fprintf(f, "%-16s %.1f GFLOP/s (fp32 GEMM %dx%dx%d)\n", "device_gflops", p->device_gflops, GEMM_M, GEMM_N,
            GEMM_K);
  if (p->bf16_speedup > 0)
    fprintf(f, "%-16s %.2fx (%s GEMM %.1f GFLOP/s)\n", "bf16_speedup", p->bf16_speedup, gpu ? "fp32" : "bf16",
            fy_probe_gemm_gflops(p, !gpu));
  else
    fprintf(f, "%-16s unknown: taken as %gx (%s GEMM %.1f GFLOP/s)\n", "bf16_speedup",
            gpu ? FY_PROBE_GPU_BF16_SPEEDUP : 1.0, gpu ? "fp32" : "bf16", fy_probe_gemm_gflops(p, !gpu));
  if (p->peak_gflops > 0)
    fprintf(f, "%-16s %.1f GFLOP/s (%s)\n", "peak_gflops", p->peak_gflops,
            gpu ? "dense bf16 tensor-core peak" : "fp32 FMA peak, all cores");
  else
    fprintf(f, "%-16s unknown (%s)\n", "peak_gflops",
            gpu ? "a GPU not in ferry's table: give --device-peak-tflops" : "give --device-peak-tflops");
  fprintf(f, "%-16s %.1f GFLOP/s\n", "host_gflops", p->host_gflops);
  fprintf(f, "%-16s %.2f GB/s (host -> device)\n", "h2d_gbps", p->h2d_gbps);
  fprintf(f, "%-16s %.2f GB/s (device -> host)\n", "d2h_gbps", p->d2h_gbps);
  fprintf(f, "%-16s %.2f GB/s (%.0f M params/s at 28 B/param)\n", "host_adamw_gbps",
          p->host_adamw_gbps, p->host_adamw_gbps * 1e9 / ADAMW_BYTES_PER_PARAM / 1e6);
  const double own[] = {p->host_adamw_bf16_gbps, p->host_adamw_8bit_gbps};
  const char *key[] = {"host_adamw_bf16_gbps", "host_adamw_8bit_gbps"};
  for (int i = 0; i < 2; i++) {
    const enum fy_state_format sf = i ? FY_STATE_Q8 : FY_STATE_BF16;
    fprintf(f, "%s %.2f GB/s (%.0f M params/s at %.2f B/param, %s state%s)\n", key[i],
            own[i] > 0 ? own[i] : p->host_adamw_gbps, 1e-6 / fy_probe_adamw_s(p, sf), fy_probe_adamw_bytes(sf),
            i ? "8-bit" : "bf16", own[i] > 0 ? "" : "; unknown: host_adamw_gbps on its bytes");
  }
  fprintf(f, "%-16s %.2f GB/s (triad)\n", "host_mem_gbps", p->host_mem_gbps);
  if (gpu && p->device_mem_gbps > 0)
    fprintf(f, "%-16s %.1f GB/s (a copy within the GPU, read and written)\n", "device_mem_gbps", p->device_mem_gbps);
  else if (gpu)
    fprintf(f, "%-16s unknown: taken as %.1f GB/s (a byte per 100 FLOPs of the bf16 GEMM rate)\n", "device_mem_gbps",
            fy_probe_device_mem_gbps(p));
  if (disk) {
    fprintf(f, "%-16s %.2f GB/s (256 MB burst, page cache included)\n", "disk_read_gbps", p->disk_read_gbps);
    fprintf(f, "%-16s %.2f GB/s (256 MB burst, page cache included)\n", "disk_write_gbps", p->disk_write_gbps);
    fprintf(f, "%-16s %s\n", "disk_dir", p->disk_dir);
  } else {
    fprintf(f, "%-16s %.2f GB/s\n", "disk_read_gbps", p->disk_read_gbps);
    fprintf(f, "%-16s %.2f GB/s\n", "disk_write_gbps", p->disk_write_gbps);
    fprintf(f, "%-16s (none probed)\n", "disk_dir");
  }
  if (p->disk_space > 0) print_bytes(f, "disk_space", p->disk_space);
  fprintf(f, "%-16s %.2f GB/s (collectives between ranks%s)\n", "comm_gbps", fy_probe_comm_gbps(p),
          p->comm_gbps > 0 ? "" : "; derived, set comm_gbps to change it");
  fprintf(f, "%-16s %.1f us (per copy across the link, besides its bytes)\n", "copy_latency_us", p->copy_latency_us);
  fprintf(f, "%-16s %.2f GB/s (one thread's memcpy)\n", "host_copy_gbps", p->host_copy_gbps);
  fprintf(f, "%-16s %.1f us (per parallel region of a kernel on the device, besides its work)\n", "kernel_overhead_us",
          p->kernel_overhead_us);
}
