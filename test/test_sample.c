// Tests for runtime/sample.c: selecting the k largest candidates, and drawing a token with
// temperature, top-k and top-p (what each allows, how often, and the same draws from a seed).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "runtime/sample.h"

// fy_sample_select leaves the k largest in front: sorted, they are the first k of a full sort,
// for arrays with many equal logits (ties go by id) and every k.
static void test_select(void) {
  srand(5);
  int bad = 0;
  for (int trial = 0; trial < 5000; trial++) {
    const int64_t n = 1 + rand() % 300, k = 1 + rand() % n;
    const int levels = 1 + rand() % 20;
    struct fy_sample_cand *a = malloc((size_t)n * sizeof *a), *b = malloc((size_t)n * sizeof *b);
    for (int64_t i = 0; i < n; i++) a[i] = b[i] = (struct fy_sample_cand){(float)(rand() % levels), (int32_t)i};
    fy_sample_select(a, n, k);
    qsort(a, (size_t)k, sizeof *a, fy_sample_cand_cmp);
    qsort(b, (size_t)n, sizeof *b, fy_sample_cand_cmp);
    bad += memcmp(a, b, (size_t)k * sizeof *a) != 0;
    free(a);
    free(b);
  }
  CHECKF(bad == 0, "%d of 5000 selections differ from a full sort", bad);
}

// Draws from probabilities 0.5, 0.3, 0.15, 0.05 (ids 0..3, in shuffled positions of a
// vocabulary of 6 whose other two are far less likely): how often each comes.
static void draw_counts(float temperature, int top_k, float top_p, int draws, int counts[6]) {
  const float p[6] = {0.05f, 1e-9f, 0.5f, 0.15f, 1e-9f, 0.3f};
  float logits[6];
  for (int i = 0; i < 6; i++) logits[i] = logf(p[i]);
  struct fy_sample_cand cand[6];
  uint64_t rng = 42;
  memset(counts, 0, 6 * sizeof *counts);
  for (int d = 0; d < draws; d++) counts[fy_sample_token(logits, 6, temperature, top_k, top_p, cand, &rng)]++;
}

static void test_token(void) {
  const int N = 40000;
  int c[6];
  // Temperature 1: the probabilities themselves.
  draw_counts(1.0f, 0, 0, N, c);
  const double want[6] = {0.05, 0, 0.5, 0.15, 0, 0.3};
  double worst = 0;
  for (int i = 0; i < 6; i++) worst = fmax(worst, fabs((double)c[i] / N - want[i]));
  CHECKF(worst < 0.01, "temperature 1: frequencies off by %.4f", worst);
  // Temperature 0, top-k 1 and a tiny top-p: always the likeliest (id 2).
  draw_counts(0.0f, 0, 0, 100, c);
  CHECK(c[2] == 100);
  draw_counts(1.0f, 1, 0, 100, c);
  CHECK(c[2] == 100);
  draw_counts(1.0f, 0, 1e-6f, 100, c);
  CHECK(c[2] == 100);
  // Top-k 2: ids 2 and 5 alone, 5 : 3.
  draw_counts(1.0f, 2, 0, N, c);
  CHECK(c[0] == 0 && c[1] == 0 && c[3] == 0 && c[4] == 0);
  CHECKF(fabs((double)c[2] / N - 0.625) < 0.01, "top-k 2: id 2 drawn %.4f of the time", (double)c[2] / N);
  // Top-p 0.45: the likeliest alone holds it; 0.6: the two likeliest; 0.81: three.
  draw_counts(1.0f, 0, 0.45f, 1000, c);
  CHECK(c[2] == 1000);
  draw_counts(1.0f, 0, 0.6f, N, c);
  CHECK(c[0] == 0 && c[3] == 0 && c[2] + c[5] == N);
  CHECKF(fabs((double)c[2] / N - 0.625) < 0.01, "top-p 0.6: id 2 drawn %.4f of the time", (double)c[2] / N);
  draw_counts(1.0f, 0, 0.81f, N, c);
  CHECK(c[0] == 0 && c[3] > 0 && c[2] + c[3] + c[5] == N);
  // Top-k 3 then top-p 0.9 of those three (0.95 of the whole): the three, as they stand.
  draw_counts(1.0f, 3, 0.9f, N, c);
  CHECK(c[0] == 0 && c[1] == 0 && c[4] == 0);
  CHECKF(fabs((double)c[3] / N - 0.15 / 0.95) < 0.01, "top-k 3, top-p 0.9: id 3 drawn %.4f of the time",
         (double)c[3] / N);
  // A high temperature flattens: the two unlikely ids come up.
  draw_counts(100.0f, 0, 0, N, c);
  CHECK(c[1] > N / 10 && c[4] > N / 10);
  // The same seed draws the same tokens; top-k and top-p agree with a full sort's order on a
  // large vocabulary with many ties.
  enum { V = 5000 };
  float *lg = malloc(V * sizeof *lg);
  struct fy_sample_cand *cand = malloc(V * sizeof *cand);
  for (int i = 0; i < V; i++) lg[i] = (float)((i * 7919) % 37) * 0.25f;
  int32_t a[50], b[50];
  for (int pass = 0; pass < 2; pass++) {
    uint64_t rng = 9;
    for (int d = 0; d < 50; d++) (pass ? b : a)[d] = fy_sample_token(lg, V, 0.7f, 300, 0.5f, cand, &rng);
  }
  CHECK(memcmp(a, b, sizeof a) == 0);
  int outside = 0;  // the logits of the top 300 are at least the 300th largest
  float *sorted = malloc(V * sizeof *sorted);
  memcpy(sorted, lg, V * sizeof *sorted);
  for (int i = 0; i < V; i++)
    for (int j = i; j > 0 && sorted[j] > sorted[j - 1]; j--) {
      float t = sorted[j];
      sorted[j] = sorted[j - 1];
      sorted[j - 1] = t;
    }
  for (int d = 0; d < 50; d++) outside += lg[a[d]] < sorted[299];
  CHECK(outside == 0);
  free(sorted);
  free(lg);
  free(cand);
}

int main(void) {
  test_select();
  test_token();
  return check_summary("sample");
}
