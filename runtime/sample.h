// Drawing the next token from a model's logits (ferry sample): temperature, top-k and top-p, in a
// fixed order so that a seed draws the same tokens on every device.
#ifndef FY_SAMPLE_H
#define FY_SAMPLE_H

#include <stdint.h>

// A candidate token, and the order that puts the most likely first (ties: the lower id).
struct fy_sample_cand {
  float logit;
  int32_t id;
};
int fy_sample_cand_cmp(const void *a, const void *b);

// Moves the k largest of cand[0, n) (1 <= k <= n, fy_sample_cand_cmp's order) to cand[0, k), in
// no order, in O(n).
void fy_sample_select(struct fy_sample_cand *cand, int64_t n, int64_t k);

// A token from logits (V): the largest with temperature 0, else drawn with *rng from
// softmax(logits / temperature) over the top_k largest (0: all), and of those the fewest largest
// whose probabilities sum to top_p or more (0 or >= 1: all); the draw walks them most likely first
// (or in id order without top-k and top-p). cand: scratch for V candidates.
int32_t fy_sample_token(const float *logits, int64_t V, float temperature, int top_k, float top_p,
                        struct fy_sample_cand *cand, uint64_t *rng);

#endif
