// The matrix products of one CPU training step of an OPT shape, each timed with every
// implementation oneDNN offers for it and with fy_matmul (the one ops/cpu/matmul.c picks), so that
// the rule in mm_prefers_gemm can be checked on a new machine or oneDNN version. One JSON line per
// product and implementation, then one with the step's product time for each choice.
//
// usage: bench/gemm_impl [--rows BT] [--hidden C] [--ffn F] [--vocab V] [--reps N] [--threads N]
// (defaults: OPT-125m at batch 4 x 128: 512 768 3072 50272)
#include <omp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "bench/bench_util.h"
#include "ops/ops.h"

struct product {
  const char *name;
  int64_t M, N, K;
  bool ta, tb;
  float beta;
  int per_layer;  // how many of them a layer (or, for the output projection, the step) runs
  bool once;      // the output projection: once a step, not once a layer
};

static double time_ferry(const struct product *p, int reps, float *a, float *b, float *c) {
  if (fy_matmul(c, a, b, p->M, p->N, p->K, p->ta, p->tb, 1.0f, p->beta) != FY_OK) return -1;
  double *t = malloc((size_t)reps * sizeof *t);
  for (int r = 0; r < reps; r++) {
    double t0 = fy_now();
    fy_matmul(c, a, b, p->M, p->N, p->K, p->ta, p->tb, 1.0f, p->beta);
    t[r] = fy_now() - t0;
  }
  double m = median(t, reps);
  free(t);
  return m;
}

// rank: the implementation's place in oneDNN's list (0 its first choice; two may share a name),
// -1 for ferry's pick.
static void print_row(const struct product *p, const char *impl, int rank, double t) {
  printf("{\"bench\":\"gemm_impl\",\"product\":\"%s\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"ta\":%d,\"tb\":%d,"
         "\"impl\":\"%s\",\"rank\":%d,\"ms\":%.3f,\"gflops\":%.1f}\n",
         p->name, (long long)p->M, (long long)p->N, (long long)p->K, p->ta, p->tb, impl, rank, t * 1e3,
         2.0 * (double)p->M * (double)p->N * (double)p->K / t / 1e9);
  fflush(stdout);
}

// Every implementation oneDNN offers for the product (the reference one, which takes seconds
// where the others take milliseconds, left out), each timed and printed; returns the best median.
static double time_impls(const struct product *p, int reps, float *a, float *b, float *c) {
  static dnnl_engine_t eng;
  static dnnl_stream_t st;
  if (!eng) {
    dnnl_engine_create(&eng, dnnl_cpu, 0);
    dnnl_stream_create(&st, eng, dnnl_stream_default_flags);
  }
  // The same descriptors as ops/cpu/matmul.c: row-major, a or b transposed through strides.
  dnnl_memory_desc_t amd, bmd, cmd;
  dnnl_dims_t ad = {p->M, p->K}, as = {p->ta ? 1 : p->K, p->ta ? p->M : 1};
  dnnl_dims_t bd = {p->K, p->N}, bs = {p->tb ? 1 : p->N, p->tb ? p->K : 1};
  dnnl_dims_t cd = {p->M, p->N}, cs = {p->N, 1};
  dnnl_memory_desc_init_by_strides(&amd, 2, ad, dnnl_f32, as);
  dnnl_memory_desc_init_by_strides(&bmd, 2, bd, dnnl_f32, bs);
  dnnl_memory_desc_init_by_strides(&cmd, 2, cd, dnnl_f32, cs);
  dnnl_matmul_desc_t desc;
  dnnl_matmul_desc_init(&desc, &amd, &bmd, NULL, &cmd);
  dnnl_primitive_attr_t attr;
  dnnl_primitive_attr_create(&attr);
  dnnl_post_ops_t post = NULL;
  if (p->beta != 0.0f) {
    dnnl_post_ops_create(&post);
    dnnl_post_ops_append_sum(post, p->beta);
    dnnl_primitive_attr_set_post_ops(attr, post);
  }
  double best = 1e30;
  double *t = malloc((size_t)reps * sizeof *t);
  dnnl_primitive_desc_iterator_t it;
  if (dnnl_primitive_desc_iterator_create(&it, &desc, attr, eng, NULL) == dnnl_success) {
    int rank = 0;
    do {
      dnnl_primitive_desc_t pd = dnnl_primitive_desc_iterator_fetch(it);
      const char *impl = NULL;
      dnnl_primitive_t prim;
      if (pd && dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl &&
          strncmp(impl, "ref", 3) != 0 && dnnl_primitive_create(&prim, pd) == dnnl_success) {
        dnnl_memory_t ma, mb, mc;
        dnnl_memory_create(&ma, &amd, eng, a);
        dnnl_memory_create(&mb, &bmd, eng, b);
        dnnl_memory_create(&mc, &cmd, eng, c);
        dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
        dnnl_primitive_execute(prim, st, 3, args);
        dnnl_stream_wait(st);
        for (int r = 0; r < reps; r++) {
          double t0 = fy_now();
          dnnl_primitive_execute(prim, st, 3, args);
          dnnl_stream_wait(st);
          t[r] = fy_now() - t0;
        }
        double m = median(t, reps);
        print_row(p, impl, rank, m);
        if (m < best) best = m;
        dnnl_memory_destroy(ma);
        dnnl_memory_destroy(mb);
        dnnl_memory_destroy(mc);
        dnnl_primitive_destroy(prim);
      }
      if (pd) dnnl_primitive_desc_destroy(pd);
      rank++;
    } while (dnnl_primitive_desc_iterator_next(it) == dnnl_success);
    dnnl_primitive_desc_iterator_destroy(it);
  }
  free(t);
  if (post) dnnl_post_ops_destroy(post);
  dnnl_primitive_attr_destroy(attr);
  return best;
}

int main(int argc, char **argv) {
  int64_t BT = 512, C = 768, F = 3072, V = 50272;
  int reps = 7, threads = 2;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      fprintf(stderr, "usage: %s [--rows BT] [--hidden C] [--ffn F] [--vocab V] [--reps N] [--threads N]\n", argv[0]);
      return 2;
    }
    if (!strcmp(argv[i], "--rows")) BT = atoll(v);
    else if (!strcmp(argv[i], "--hidden")) C = atoll(v);
    else if (!strcmp(argv[i], "--ffn")) F = atoll(v);
    else if (!strcmp(argv[i], "--vocab")) V = atoll(v);
    else if (!strcmp(argv[i], "--reps")) reps = atoi(v);
    else if (!strcmp(argv[i], "--threads")) threads = atoi(v);
    else {
      fprintf(stderr, "%s: unknown option %s\n", argv[0], argv[i]);
      return 2;
    }
    i++;
  }
  if (BT < 1 || C < 1 || F < 1 || V < 1 || reps < 1 || threads < 1) {
    fprintf(stderr, "%s: sizes, --reps and --threads must be positive\n", argv[0]);
    return 2;
  }
  omp_set_num_threads(threads);
  // out = inp @ w^T (forward); dinp += dout @ w (input gradient); dw += dout^T @ inp (weight
  // gradient): for q, k, v and out_proj (C -> C), fc1 (C -> F), fc2 (F -> C), the output projection.
  const struct product prods[] = {
      {"fwd attn", BT, C, C, false, true, 0, 4, false},   {"fwd fc1", BT, F, C, false, true, 0, 1, false},
      {"fwd fc2", BT, C, F, false, true, 0, 1, false},    {"fwd lm_head", BT, V, C, false, true, 0, 1, true},
      {"dinp attn", BT, C, C, false, false, 1, 4, false}, {"dinp fc1", BT, C, F, false, false, 1, 1, false},
      {"dinp fc2", BT, F, C, false, false, 1, 1, false},  {"dinp lm_head", BT, C, V, false, false, 1, 1, true},
      {"dw attn", C, C, BT, true, false, 1, 4, false},    {"dw fc1", F, C, BT, true, false, 1, 1, false},
      {"dw fc2", C, F, BT, true, false, 1, 1, false},     {"dw lm_head", V, C, BT, true, false, 1, 1, true},
  };
  const int np = (int)(sizeof prods / sizeof prods[0]);
  // Per layer and once a step: the sums for ferry's pick and for the best implementation of each.
  double layer_ferry = 0, layer_best = 0, once_ferry = 0, once_best = 0;
  for (int i = 0; i < np; i++) {
    const struct product *p = &prods[i];
    float *a = malloc((size_t)(p->M * p->K) * 4), *b = malloc((size_t)(p->K * p->N) * 4),
          *c = calloc((size_t)(p->M * p->N), 4);
    if (!a || !b || !c) {
      fprintf(stderr, "%s: out of memory\n", argv[0]);
      return 1;
    }
    for (int64_t j = 0; j < p->M * p->K; j++) a[j] = (float)(j % 13) * 0.01f - 0.06f;
    for (int64_t j = 0; j < p->K * p->N; j++) b[j] = (float)(j % 7) * 0.01f - 0.03f;
    double mine = time_ferry(p, reps, a, b, c);
    if (mine < 0) {
      fprintf(stderr, "%s: %s\n", argv[0], fy_error_msg());
      return 1;
    }
    print_row(p, "ferry", -1, mine);
    double best = time_impls(p, reps, a, b, c);
    (p->once ? &once_ferry : &layer_ferry)[0] += p->per_layer * mine;
    (p->once ? &once_best : &layer_best)[0] += p->per_layer * best;
    free(a);
    free(b);
    free(c);
  }
  printf("{\"bench\":\"gemm_impl_step\",\"rows\":%lld,\"hidden\":%lld,\"ffn\":%lld,\"vocab\":%lld,"
         "\"layer_ms_ferry\":%.2f,\"layer_ms_best\":%.2f,\"lm_head_ms_ferry\":%.2f,\"lm_head_ms_best\":%.2f,"
         "\"ferry_time_over_best\":%.3f}\n",
         (long long)BT, (long long)C, (long long)F, (long long)V, layer_ferry * 1e3, layer_best * 1e3,
         once_ferry * 1e3, once_best * 1e3, (layer_ferry + once_ferry) / (layer_best + once_best));
  fy_matmul_cache_clear();
  return 0;
}
