#include "runtime/sample.h"

#include <math.h>
#include <stdlib.h>

#include "core/rand.h"

// One draw in [0, 1) of the sampler's generator (reproducible from the seed).
static double sample_uniform(uint64_t *state) { return (double)(fy_splitmix64(state) >> 11) * 0x1p-53; }

int fy_sample_cand_cmp(const void *pa, const void *pb) {
  const struct fy_sample_cand *a = pa, *b = pb;
  if (a->logit != b->logit) return a->logit > b->logit ? -1 : 1;
  return (a->id > b->id) - (a->id < b->id);
}

// Quickselect: Hoare partitions around the middle element until the k-th largest is in place.
void fy_sample_select(struct fy_sample_cand *cand, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const struct fy_sample_cand pivot = cand[lo + (hi - lo) / 2];
    int64_t i = lo, j = hi;
    while (i <= j) {  // [lo, i) before the pivot, (j, hi] after it
      while (fy_sample_cand_cmp(&cand[i], &pivot) < 0) i++;
      while (fy_sample_cand_cmp(&cand[j], &pivot) > 0) j--;
      if (i <= j) {
        const struct fy_sample_cand t = cand[i];
        cand[i++] = cand[j];
        cand[j--] = t;
      }
    }
    if (k - 1 <= j) hi = j;
    else if (k - 1 >= i) lo = i;
    else return;
  }
}

// Only the candidates that can be drawn are sorted: the k largest, selected in O(V); for top_p,
// those within a widening distance of the largest logit once they hold top_p of the probability
// (they contain the nucleus, which takes the largest first).
int32_t fy_sample_token(const float *logits, int64_t V, float temperature, int top_k, float top_p,
                        struct fy_sample_cand *cand, uint64_t *rng) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; i++) best = logits[i] > logits[best] ? i : best;
  if (temperature <= 0) return (int32_t)best;
  const double top = logits[best];
#define SAMPLE_W(l) exp(((double)(l) - top) / temperature)  // probability, but for the common factor
  for (int64_t i = 0; i < V; i++) cand[i] = (struct fy_sample_cand){logits[i], (int32_t)i};
  int64_t k = V;  // the candidates: cand[0, k)
  if (top_k > 0 && top_k < V) {
    k = top_k;
    fy_sample_select(cand, V, k);
  }
  double sum = 0;
  for (int64_t i = 0; i < k; i++) sum += SAMPLE_W(cand[i].logit);
  if (top_p > 0 && top_p < 1) {
    int64_t m = k;
    for (double gap = 16;; gap *= 2) {  // the candidates within gap temperatures of the largest
      const double floor = top - gap * temperature;
      double mass = 0;
      m = 0;
      for (int64_t i = 0; i < k; i++)
        if (cand[i].logit >= floor) {
          const struct fy_sample_cand t = cand[m];
          cand[m++] = cand[i];
          cand[i] = t;
          mass += SAMPLE_W(cand[m - 1].logit);
        }
      if (mass >= (double)top_p * sum || m == k) break;
    }
    qsort(cand, (size_t)m, sizeof *cand, fy_sample_cand_cmp);
    double acc = 0;
    int64_t n = 0;
    while (n < m && acc < (double)top_p * sum) acc += SAMPLE_W(cand[n++].logit);
    k = n > 0 ? n : 1, sum = acc > 0 ? acc : sum;
  } else if (k < V) {
    qsort(cand, (size_t)k, sizeof *cand, fy_sample_cand_cmp);
  }
  double u = sample_uniform(rng) * sum, acc = 0;
  for (int64_t i = 0; i < k; i++) {
    acc += SAMPLE_W(cand[i].logit);
    if (u < acc) return cand[i].id;
  }
#undef SAMPLE_W
  return cand[k - 1].id;
}
