// The OPT model family (Hugging Face's OPTForCausalLM): its configuration, the built-in presets,
// reading config.json, and building the operator graph with its parameters.
#ifndef FY_OPT_H
#define FY_OPT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

struct fy_opt_config {
  char name[64];                 // preset name or "custom"
  int64_t vocab_size;
  int64_t hidden_size;           // D
  int64_t word_embed_proj_dim;   // embedding width; != hidden_size adds project_in/project_out
  int64_t ffn_dim;
  int64_t num_hidden_layers;
  int64_t num_attention_heads;
  int64_t max_position_embeddings;
  bool do_layer_norm_before;     // pre-LN (true) or post-LN (OPT-350m)
  bool remove_final_layer_norm;  // config._remove_final_layer_norm
  bool enable_bias;
  bool layer_norm_elementwise_affine;
  bool tie_word_embeddings;
  enum fy_opt_activation { FY_ACT_RELU, FY_ACT_GELU } activation;  // activation_function ("relu", "gelu")
  float init_std;
  float layer_norm_eps;          // 1e-5 (not in OPT's config.json; nn.LayerNorm's default)
  float dropout, attention_dropout, activation_dropout, layerdrop;  // as config.json says
  // The dropout this run applies to the residual branches (ferry train --dropout; 0: none): the
  // graph's residual adds drop with it. Not config.json's `dropout`, which is kept as read and
  // written back as it was.
  float train_dropout;
  int64_t pad_token_id, bos_token_id, eos_token_id;
  char torch_dtype[16];          // as written in config.json ("float16", "float32", ...)
  // Mixture of experts (docs/training.md, "Mixture of experts"; Mixtral's config.json names plus
  // moe_layer_frequency). num_local_experts 0: a dense model, the other three unused. Otherwise
  // decoder layer l (from 0) is a mixture when (l + 1) % moe_layer_frequency == 0 (Qwen2-MoE's
  // decoder_sparse_step rule: frequency 2 makes layers 1, 3, 5, ... sparse, 1 every layer): its
  // feed-forward block is num_local_experts OPT feed-forwards, a linear router without bias,
  // top-num_experts_per_tok routing with the chosen probabilities renormalised, dropless, and the
  // load-balancing loss times router_aux_loss_coef added to the training objective.
  int64_t num_local_experts;     // E
  int64_t num_experts_per_tok;   // k
  int64_t moe_layer_frequency;   // n
  float router_aux_loss_coef;
};

// Whether decoder layer l of cfg is a mixture of experts.
static inline bool fy_opt_layer_is_moe(const struct fy_opt_config *c, int64_t l) {
  return c->num_local_experts > 0 && c->moe_layer_frequency > 0 && (l + 1) % c->moe_layer_frequency == 0;
}
// Number of mixture-of-experts layers of cfg.
static inline int64_t fy_opt_moe_layers(const struct fy_opt_config *c) {
  return c->num_local_experts > 0 && c->moe_layer_frequency > 0 ? c->num_hidden_layers / c->moe_layer_frequency : 0;
}

// Fills `cfg` with a preset: "opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b", "opt-6.7b",
// "opt-13b", "opt-30b", "opt-66b", "opt-175b", and the small ones "opt-tiny" (tests) and
// "opt-demo" (the bundled corpus' byte-level vocabulary); mixtures of experts: "opt-moe-tiny"
// (tests) and "opt-125m-moe8" (opt-125m's shape, 8 experts, top 2, every other layer). The
// "facebook/" prefix is accepted.
fy_status fy_opt_preset(const char *name, struct fy_opt_config *cfg);
// A NULL-terminated list of preset names, for --help.
const char *const *fy_opt_preset_names(void);
// Reads a Hugging Face config.json (path to the file or to the directory holding it), with HF's
// defaults for absent keys, and checks it (positive sizes, heads divide hidden_size, model_type
// "opt" when given, activation "relu" or "gelu": OPT's, and Galactica's, which is an OPT model).
fy_status fy_opt_config_read(const char *path, struct fy_opt_config *cfg);
// Writes config.json as transformers' save_pretrained would for this config.
fy_status fy_opt_config_write(const char *dir, const struct fy_opt_config *cfg);
// Checks the fields for consistency (used by both of the above).
fy_status fy_opt_config_check(const struct fy_opt_config *cfg);
// Number of parameters (tied embeddings counted once; every expert of a mixture).
int64_t fy_opt_num_params(const struct fy_opt_config *cfg);

// Builds the graph of OPTForCausalLM for micro-batches of B x T tokens: parameters named as in
// Hugging Face's state dict, the fused QKV projection of each layer laid out as q, k, v, and the
// loss (softmax cross-entropy over already-shifted targets) as the last operator.
struct fy_graph;
fy_status fy_opt_build_graph(const struct fy_opt_config *cfg, int64_t B, int64_t T,
                             struct fy_graph **out);
// One rank's part of the graph under tensor parallelism over tp ranks (Megatron's split): in each
// decoder layer the fused QKV and fc1 are column-split (FY_SPLIT_COL: NH/tp heads, ffn/tp
// features), out_proj and fc2 row-split (FY_SPLIT_ROW); a mixture's experts each split the same
// way (ffn/tp of every expert's fc1 rows and fc2 columns: the expert pattern, the router whole);
// everything else is whole on every rank.
// tp must divide the heads and the feed-forward size. tp 1 is fy_opt_build_graph.
fy_status fy_opt_build_graph_tp(const struct fy_opt_config *cfg, int64_t B, int64_t T, int tp, int tp_rank,
                                struct fy_graph **out);
// Which count of a step's model FLOPs: ferry's own (PaLM's appendix B and Megatron-LM's), or
// llm.c's (its gpt2_estimate_mfu), kept beside it so that a rate compares with llm.c's figures.
enum fy_flops_count {
  FY_FLOPS_PALM,  // what ferry prints as GFLOP/s and MFU
  FY_FLOPS_LLMC,  // llm.c's: every parameter, and the causal half of attention
};
// Model FLOPs of forward and backward of one B x T micro-batch (no recomputation counted), the one
// place any figure of ferry's counts them. Per token, with L layers, hidden size D and T positions:
//   FY_FLOPS_PALM: 6 x (matrix and other non-embedding parameters) + 6 x V x W (the lm_head
//                  product, once, tied or not) + 12 x L x D x T (QK^T and AV, the mask ignored)
//   FY_FLOPS_LLMC: 6 x fy_opt_num_params + 6 x L x D x T
// See core/opt.c for what each term holds and why.
double fy_opt_step_flops(const struct fy_opt_config *cfg, int64_t B, int64_t T, enum fy_flops_count count);

#endif
