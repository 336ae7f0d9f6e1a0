// bench/adamw: host AdamW (fy_adamw_update) against this machine's memory bandwidth.
// It measures, on buffers far larger than the caches, a STREAM-like kernel of AdamW's traffic
// shape (4 float streams read, 3 written: 28 B per element), plain STREAM copy and triad for
// reference, a read-only sum (4 B/element), fy_adamw_update (counted as 28 B/param), the bf16
// chunks' fy_adamw_update_bf16 (bf16 gradients in, bf16 weights out: also 28 B/param) and fy_sumsq
// (4 B/param). Every figure is the median over --reps timed runs after one warm-up run; pages
// are first-touched, in parallel with the same static split as the kernels, before anything is
// timed. adamw's and adamw_bf16's fraction_of_stream are against stream4r3w (the ratio of the
// medians; adamw's fraction_paired is the median of the per-rep ratios, steadier on a shared
// machine), sumsq's is against stream_read. STREAM copy counts 8 B and triad 12 B (no write-allocate traffic), as
// STREAM itself does. Meant for sizes far beyond the caches. Prints JSON lines.
//
// Compressed state (fy_adamw_state_update, one range of weight decay over the whole buffer):
// adamw_state_bf16 and adamw_state_8bit with fp32 gradients, and _bf16grad with the bf16
// gradients in the copy (the new bf16 weights written over them), each with the bytes a
// parameter moves (weights read and written 8, gradients 4 read, or 2 read and 2 written; m and v
// read and written: 8 in bf16, 4 in 8 bits plus the scales' 16 bytes a 256-element block), GB/s
// on that count, ns a parameter, and the time against fp32 state with the same gradients
// (speedup_vs_fp32: adamw's or adamw_bf16's median over this one's). On a machine shared with
// other work the 8-bit update (a few dozen vector operations a parameter besides AdamW's, which
// keep up with memory only when the cores are free) loses more to the neighbours than the
// memory-bound fp32 update, so each of these lines also gives the fastest rep (ns_per_param_best,
// gbps_best) and speedup_best, the fp32 line's fastest rep over this one's; and the median of the
// calling thread's CPU time (ns_per_param_cpu, gbps_cpu, and speedup_cpu against the fp32 line's
// CPU time). The calling thread is one of the OpenMP threads and, with every kernel's static
// split, does 1/threads of the work: its CPU time is that share's time while it ran, its memory
// stalls included, the turns the machine gave to other work left out (a wait at the region's end
// counts only while the thread spins). Per parameter it is divided by all n parameters, so with
// T threads it reads as wall time would on T free cores.
//
// --into: instead, fy_adamw_state_update_into (speculative updates: into a spare slot, the inputs
// kept) against the in-place fy_adamw_state_update, fp32, bf16 and 8-bit state, fp32 and bf16 gradients,
// one range over the whole buffer. Each rep runs the in-place update on one set of buffers and the
// out-of-place one between two other sets (A -> B, then B -> A), alternating which goes first;
// lines give wall ns a parameter (median, best), the calling thread's CPU ns a parameter (median,
// as above), and into over in-place for each (ratio of the medians; ratio_paired: the median of
// the per-rep ratios).
//
// usage: adamw [--params 67108864] [--threads 2] [--reps 7] [--into]
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ops/ops.h"
#include "bench_util.h"

// The reference kernels. noinline keeps each a separate, honest loop; the arrays are restrict so
// gcc vectorises them like the AdamW loop.
__attribute__((noinline)) static void k_copy(float *restrict c, const float *restrict a,
                                             int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) c[i] = a[i];
}

__attribute__((noinline)) static void k_triad(float *restrict a, const float *restrict b,
                                              const float *restrict c, float s, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}

// AdamW's shape: reads a, b, c, d; writes a, b, c (d plays the gradient, b and c the moments).
// With 0 < s < 1 the values stay bounded and c >= 0, so AdamW can run on the same buffers.
__attribute__((noinline)) static void k_4r3w(float *restrict a, float *restrict b,
                                             float *restrict c, const float *restrict d, float s,
                                             int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float g = d[i];
    float bi = s * b[i] + g;
    float ci = s * c[i] + g * g;
    b[i] = bi;
    c[i] = ci;
    a[i] = s * a[i] - 1e-3f * bi;
  }
}

// Read-only: 4 B/element, the reference for fy_sumsq (which reads one stream). 64 independent
// partial sums (four AVX-512 registers) so the adds never wait on one another.
__attribute__((noinline)) static double k_read(const float *restrict a, int64_t n) {
  double s = 0.0;
#pragma omp parallel reduction(+ : s)
  {
    float acc[64] = {0};
    int64_t nb = n / 64;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nb; blk++)
      for (int j = 0; j < 64; j++) acc[j] += a[blk * 64 + j];
    for (int j = 0; j < 64; j++) s += acc[j];
  }
  for (int64_t i = n / 64 * 64; i < n; i++) s += a[i];
  return s;
}

// The calling thread's CPU time: it stops while the thread waits for a core (a busy machine's
// neighbours), not while it waits for memory or spins at the parallel region's end for the other
// threads.
static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// The fastest of v[0..n).
static double best(const double *v, int n) {
  double b = v[0];
  for (int i = 1; i < n; i++) b = v[i] < b ? v[i] : b;
  return b;
}

static void print_stream(const char *name, int64_t n, int threads, int bytes, double gbps) {
  printf("{\"bench\":\"%s\",\"params\":%lld,\"threads\":%d,\"bytes_per_elem\":%d,\"gbps\":%.2f}\n",
         name, (long long)n, threads, bytes, gbps);
}

static void *bench_alloc(size_t bytes) {
  void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
  if (!p) {
    fprintf(stderr, "adamw: out of memory for %zu bytes\n", bytes);
    exit(1);
  }
  return p;
}

// --into (see the header).
static int bench_into(int64_t n, int threads, int reps) {
  float *grad = bench_alloc((size_t)n * 4);
  uint16_t *gw[3];
  for (int k = 0; k < 3; k++) gw[k] = bench_alloc((size_t)n * 2);
  float *p[3];
  for (int k = 0; k < 3; k++) p[k] = bench_alloc((size_t)n * 4);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    uint32_t h = (uint32_t)i * 2654435761u;
    grad[i] = ((float)((h * 2246822519u) >> 8) / 16777216.0f - 0.5f) * 0.01f;
    for (int k = 0; k < 3; k++) {
      p[k][i] = ((float)(h >> 8) / 16777216.0f - 0.5f) * 0.1f;
      gw[k][i] = fy_f32_to_bf16(grad[i]);
    }
  }
  const struct fy_adamw_range all = {0, n, 0.01f};
  enum { F32, F32G, B16, B16G, Q8, Q8G, NR };
  static const char *names[NR] = {"fp32", "fp32_bf16grad", "bf16", "bf16_bf16grad", "8bit", "8bit_bf16grad"};
  double *t[NR][2], *tc[NR][2], *pair[NR];
  for (int k = 0; k < NR; k++) {
    pair[k] = malloc((size_t)reps * sizeof(double));
    for (int j = 0; j < 2; j++) {
      t[k][j] = malloc((size_t)reps * sizeof(double));
      tc[k][j] = malloc((size_t)reps * sizeof(double));
    }
  }
  for (int k = 0; k < NR; k++) {
    const enum fy_state_format f = k < B16 ? FY_STATE_F32 : k < Q8 ? FY_STATE_BF16 : FY_STATE_Q8;
    const bool bf = k == F32G || k == B16G || k == Q8G;
    const size_t mb = fy_state_moment_bytes(f, n);
    void *m[3], *v[3];
    float *zero = calloc((size_t)n, 4);
    if (!zero) return 1;
    for (int j = 0; j < 3; j++) {
      m[j] = bench_alloc(mb), v[j] = bench_alloc(mb);
      fy_state_encode(f, FY_MOMENT_M, m[j], zero, n);  // (first touch on the threads)
      fy_state_encode(f, FY_MOMENT_V, v[j], zero, n);
    }
    free(zero);
    for (int r = -1; r < reps; r++) {
      const int a = 1 + ((r + 1) & 1), b = 3 - a;  // into: a -> b; in place: set 0
      double ti = 0, tci = 0, to = 0, tco = 0;
      for (int o = 0; o < 2; o++) {
        const bool in_place = (o == 0) == (r % 2 == 0);
        const double w0 = fy_now(), c0 = cpu_s();
        fy_status st;
        if (in_place)
          st = bf ? fy_adamw_state_update_bf16(f, p[0], m[0], v[0], gw[0], n, &all, 1, 1e-3f, 0.9f, 0.999f, 1e-8f,
                                               r + 2, 1.0f)
                  : fy_adamw_state_update(f, p[0], m[0], v[0], grad, n, &all, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, r + 2,
                                          1.0f);
        else
          st = fy_adamw_state_update_into(f, p[b], m[b], v[b], bf ? gw[b] : NULL, p[a], m[a], v[a], bf ? NULL : grad,
                                          bf ? gw[a] : NULL, n, &all, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, r + 2, 1.0f);
        const double w1 = fy_now(), c1 = cpu_s();
        if (st != FY_OK) {
          fprintf(stderr, "adamw: %s\n", fy_error_msg());
          return 1;
        }
        if (in_place) ti = w1 - w0, tci = c1 - c0;
        else to = w1 - w0, tco = c1 - c0;
      }
      if (r < 0) continue;
      t[k][0][r] = ti, t[k][1][r] = to, tc[k][0][r] = tci, tc[k][1][r] = tco, pair[k][r] = to / ti;
    }
    for (int j = 0; j < 3; j++) free(m[j]), free(v[j]);
    const double bi = best(t[k][0], reps), bo = best(t[k][1], reps);
    const double mi = median(t[k][0], reps), mo = median(t[k][1], reps);
    const double ci = median(tc[k][0], reps), co = median(tc[k][1], reps);
    const double ns = 1e9 / (double)n;
    printf("{\"bench\":\"adamw_into_%s\",\"params\":%lld,\"threads\":%d,\"in_place_ns_per_param\":%.3f,"
           "\"into_ns_per_param\":%.3f,\"ratio\":%.3f,\"ratio_paired\":%.3f,\"in_place_ns_best\":%.3f,"
           "\"into_ns_best\":%.3f,\"ratio_best\":%.3f,\"in_place_ns_cpu\":%.3f,\"into_ns_cpu\":%.3f,"
           "\"ratio_cpu\":%.3f}\n",
           names[k], (long long)n, threads, mi * ns, mo * ns, mo / mi, median(pair[k], reps), bi * ns, bo * ns, bo / bi,
           ci * ns, co * ns, co / ci);
    fflush(stdout);
  }
  for (int k = 0; k < 3; k++) free(p[k]), free(gw[k]);
  free(grad);
  return 0;
}

int main(int argc, char **argv) {
  int64_t n = 64ll << 20;
  int threads = 2, reps = 7;
  bool into = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--into")) into = true;
    else if (!strcmp(argv[i], "--params") && i + 1 < argc) n = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--params N] [--threads N] [--reps N] [--into]\n", argv[0]);
      return 2;
    }
  }
  if (n <= 0 || threads <= 0 || reps <= 0) {
    fprintf(stderr, "adamw: --params, --threads and --reps must be positive\n");
    return 2;
  }
  omp_set_num_threads(threads);
  if (into) return bench_into(n, threads, reps);

  // One set of four buffers for every kernel, so all see the same pages. The STREAM kernels keep
  // what AdamW reads sane (m bounded, v >= 0, all finite), and interleaving one run of each kernel
  // per rep makes the machine's noise hit them all alike.
  size_t bytes = ((size_t)n * sizeof(float) + 63) & ~(size_t)63;
  float *buf[4];
  for (int k = 0; k < 4; k++) {
    buf[k] = aligned_alloc(64, bytes);
    if (!buf[k]) {
      fprintf(stderr, "adamw: out of memory for 4 x %zu bytes\n", bytes);
      return 1;
    }
  }
  float *param = buf[0], *m = buf[1], *v = buf[2], *grad = buf[3];
  // The offloaded bf16 chunks' AdamW (fy_adamw_update_bf16): bf16 gradients in, the new bf16
  // weights written over them (which the next rep takes as its gradients).
  uint16_t *gw = aligned_alloc(64, ((size_t)n * sizeof(uint16_t) + 63) & ~(size_t)63);
  if (!gw) {
    fprintf(stderr, "adamw: out of memory\n");
    return 1;
  }
  // First touch, with the kernels' static split, so each thread's pages are mapped before timing.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    uint32_t h = (uint32_t)i * 2654435761u;
    param[i] = ((float)(h >> 8) / 16777216.0f - 0.5f) * 0.1f;
    grad[i] = ((float)((h * 2246822519u) >> 8) / 16777216.0f - 0.5f) * 0.01f;
    gw[i] = fy_f32_to_bf16(grad[i]);
    m[i] = 0.0f;
    v[i] = 0.0f;
  }

  // m and v of the compressed formats, starting at 0 like m and v above.
  const size_t b16 = fy_state_moment_bytes(FY_STATE_BF16, n), b8 = fy_state_moment_bytes(FY_STATE_Q8, n);
  void *m16 = aligned_alloc(64, (b16 + 63) & ~(size_t)63), *v16 = aligned_alloc(64, (b16 + 63) & ~(size_t)63);
  void *m8 = aligned_alloc(64, (b8 + 63) & ~(size_t)63), *v8 = aligned_alloc(64, (b8 + 63) & ~(size_t)63);
  if (!m16 || !v16 || !m8 || !v8) {
    fprintf(stderr, "adamw: out of memory for the compressed state\n");
    return 1;
  }
  fy_state_encode(FY_STATE_BF16, FY_MOMENT_M, m16, m, n);  // (first touch on the threads, as above)
  fy_state_encode(FY_STATE_BF16, FY_MOMENT_V, v16, v, n);
  fy_state_encode(FY_STATE_Q8, FY_MOMENT_M, m8, m, n);
  fy_state_encode(FY_STATE_Q8, FY_MOMENT_V, v8, v, n);
  const struct fy_adamw_range all = {0, n, 0.01f};

  enum { COPY, TRIAD, READ, S4, ADAMW, SUMSQ, PAIR, ADAMW16, ST16, ST16G, ST8, ST8G, NB };
  double *t[NB], *tc[NB];  // wall and the calling thread's CPU time
  for (int k = 0; k < NB; k++) t[k] = malloc((size_t)reps * sizeof(double)), tc[k] = calloc((size_t)reps, sizeof(double));
  volatile double sink = 0.0;
  for (int r = -1; r < reps; r++) {  // r == -1: the warm-up, not timed
    double t0 = fy_now();
    k_copy(m, param, n);
    double t1 = fy_now();
    k_triad(m, grad, param, 0.5f, n);
    double t2 = fy_now();
    sink += k_read(param, n);
    double t3 = fy_now();
    k_4r3w(param, m, v, grad, 0.5f, n);
    double t4 = fy_now(), c4 = cpu_s();
    fy_adamw_update(param, m, v, grad, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, r + 2, 1.0f);
    double t5 = fy_now(), c5 = cpu_s();
    sink += fy_sumsq(grad, n);
    double t6 = fy_now(), c6 = cpu_s();
    fy_adamw_update_bf16(param, m, v, gw, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, r + 2, 1.0f);
    double t7 = fy_now(), c7 = cpu_s();
    fy_status st = fy_adamw_state_update(FY_STATE_BF16, param, m16, v16, grad, n, &all, 1, 1e-3f, 0.9f, 0.999f, 1e-8f,
                                         r + 2, 1.0f);
    double t8 = fy_now(), c8 = cpu_s();
    if (st == FY_OK)
      st = fy_adamw_state_update_bf16(FY_STATE_BF16, param, m16, v16, gw, n, &all, 1, 1e-3f, 0.9f, 0.999f, 1e-8f,
                                      r + 2, 1.0f);
    double t9 = fy_now(), c9 = cpu_s();
    if (st == FY_OK)
      st = fy_adamw_state_update(FY_STATE_Q8, param, m8, v8, grad, n, &all, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, r + 2, 1.0f);
    double t10 = fy_now(), c10 = cpu_s();
    if (st == FY_OK)
      st = fy_adamw_state_update_bf16(FY_STATE_Q8, param, m8, v8, gw, n, &all, 1, 1e-3f, 0.9f, 0.999f, 1e-8f, r + 2,
                                      1.0f);
    double t11 = fy_now(), c11 = cpu_s();
    if (st != FY_OK) {
      fprintf(stderr, "adamw: %s\n", fy_error_msg());
      return 1;
    }
    if (r < 0) continue;
    t[ST16][r] = t8 - t7, t[ST16G][r] = t9 - t8, t[ST8][r] = t10 - t9, t[ST8G][r] = t11 - t10;
    tc[ST16][r] = c8 - c7, tc[ST16G][r] = c9 - c8, tc[ST8][r] = c10 - c9, tc[ST8G][r] = c11 - c10;
    tc[ADAMW][r] = c5 - c4, tc[ADAMW16][r] = c7 - c6;
    t[ADAMW16][r] = t7 - t6;
    t[COPY][r] = t1 - t0, t[TRIAD][r] = t2 - t1, t[READ][r] = t3 - t2;
    t[S4][r] = t4 - t3, t[ADAMW][r] = t5 - t4, t[SUMSQ][r] = t6 - t5;
    t[PAIR][r] = (t4 - t3) / (t5 - t4);  // this rep's adamw / stream4r3w bandwidth
  }
  double gb = (double)n / 1e9;
  double copy_gbps = 8 * gb / median(t[COPY], reps), triad_gbps = 12 * gb / median(t[TRIAD], reps);
  double read_gbps = 4 * gb / median(t[READ], reps), s4_gbps = 28 * gb / median(t[S4], reps);
  double adamw_s = median(t[ADAMW], reps), adamw_gbps = 28 * gb / adamw_s;
  double sumsq_gbps = 4 * gb / median(t[SUMSQ], reps);

  print_stream("stream_copy", n, threads, 8, copy_gbps);
  print_stream("stream_triad", n, threads, 12, triad_gbps);
  print_stream("stream_read", n, threads, 4, read_gbps);
  print_stream("stream4r3w", n, threads, 28, s4_gbps);
  printf("{\"bench\":\"adamw\",\"params\":%lld,\"threads\":%d,\"bytes_per_param\":28,\"ms\":%.3f,"
         "\"gbps\":%.2f,\"ns_per_param\":%.3f,\"fraction_of_stream\":%.3f,\"fraction_paired\":%.3f}\n",
         (long long)n, threads, adamw_s * 1e3, adamw_gbps, adamw_s * 1e9 / (double)n, adamw_gbps / s4_gbps,
         median(t[PAIR], reps));
  const double adamw16_gbps = 28 * gb / median(t[ADAMW16], reps);
  printf("{\"bench\":\"adamw_bf16\",\"params\":%lld,\"threads\":%d,\"bytes_per_param\":28,\"ms\":%.3f,"
         "\"gbps\":%.2f,\"ns_per_param\":%.3f,\"fraction_of_stream\":%.3f}\n",
         (long long)n, threads, median(t[ADAMW16], reps) * 1e3, adamw16_gbps,
         median(t[ADAMW16], reps) * 1e9 / (double)n, adamw16_gbps / s4_gbps);
  // The compressed formats: bytes a parameter as in the header comment.
  const double scales = 2.0 * 2 * 4 / FY_Q8_BLOCK;  // m's and v's scale, read and written
  const struct { const char *name; int k; double bytes; double fp32_s; int fp32_k; } st_rows[] = {
      {"adamw_state_bf16", ST16, 20, adamw_s, ADAMW},
      {"adamw_state_bf16_bf16grad", ST16G, 20, median(t[ADAMW16], reps), ADAMW16},
      {"adamw_state_8bit", ST8, 16 + scales, adamw_s, ADAMW},
      {"adamw_state_8bit_bf16grad", ST8G, 16 + scales, median(t[ADAMW16], reps), ADAMW16},
  };
  for (int k = 0; k < 4; k++) {
    const double b = best(t[st_rows[k].k], reps), fb = best(t[st_rows[k].fp32_k], reps);
    const double s = median(t[st_rows[k].k], reps);  // (sorts: the best first)
    const double c = median(tc[st_rows[k].k], reps), fc = median(tc[st_rows[k].fp32_k], reps);
    printf("{\"bench\":\"%s\",\"params\":%lld,\"threads\":%d,\"bytes_per_param\":%.4g,\"ms\":%.3f,"
           "\"gbps\":%.2f,\"ns_per_param\":%.3f,\"fraction_of_stream\":%.3f,\"speedup_vs_fp32\":%.3f,"
           "\"ns_per_param_best\":%.3f,\"gbps_best\":%.2f,\"speedup_best\":%.3f,\"ns_per_param_cpu\":%.3f,"
           "\"gbps_cpu\":%.2f,\"speedup_cpu\":%.3f}\n",
           st_rows[k].name, (long long)n, threads, st_rows[k].bytes, s * 1e3, st_rows[k].bytes * gb / s,
           s * 1e9 / (double)n, st_rows[k].bytes * gb / s / s4_gbps, st_rows[k].fp32_s / s, b * 1e9 / (double)n,
           st_rows[k].bytes * gb / b, fb / b, c * 1e9 / (double)n, st_rows[k].bytes * gb / c, fc / c);
  }
  printf("{\"bench\":\"sumsq\",\"params\":%lld,\"threads\":%d,\"bytes_per_param\":4,\"gbps\":%.2f,"
         "\"fraction_of_stream\":%.3f}\n",
         (long long)n, threads, sumsq_gbps, sumsq_gbps / read_gbps);
  for (int k = 0; k < NB; k++) free(t[k]), free(tc[k]);
  for (int k = 0; k < 4; k++) free(buf[k]);
  free(gw);
  free(m16), free(v16), free(m8), free(v8);
  return 0;
}
