// core/opt_config.c: reading Hugging Face OPT config.json files, defaults, bad input, writing;
// and core/parse.c: the sizes a person writes on the command line and reads in messages.
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/fileio.h"
#include "core/graph.h"
#include "core/opt.h"
#include "core/parse.h"
#include "test/check.h"

static char tmpdir[64];

static const char *put(const char *name, const char *text) {
  static char p[256];
  snprintf(p, sizeof p, "%s/%s", tmpdir, name);
  FILE *f = fopen(p, "w");
  fputs(text, f);
  fclose(f);
  return p;
}

// facebook/opt-350m's config.json as published on the Hub (post-LN, projection 512 -> 1024).
static const char *opt350m =
    "{\n"
    "  \"_name_or_path\": \"facebook/opt-350m\",\n"
    "  \"activation_dropout\": 0.0,\n"
    "  \"activation_function\": \"relu\",\n"
    "  \"architectures\": [\"OPTForCausalLM\"],\n"
    "  \"attention_dropout\": 0.0,\n"
    "  \"bos_token_id\": 2,\n"
    "  \"do_layer_norm_before\": false,\n"
    "  \"dropout\": 0.1,\n"
    "  \"eos_token_id\": 2,\n"
    "  \"ffn_dim\": 4096,\n"
    "  \"hidden_size\": 1024,\n"
    "  \"init_std\": 0.02,\n"
    "  \"layerdrop\": 0.0,\n"
    "  \"max_position_embeddings\": 2048,\n"
    "  \"model_type\": \"opt\",\n"
    "  \"num_attention_heads\": 16,\n"
    "  \"num_hidden_layers\": 24,\n"
    "  \"pad_token_id\": 1,\n"
    "  \"prefix\": \"</s>\",\n"
    "  \"torch_dtype\": \"float16\",\n"
    "  \"transformers_version\": \"4.20.0.dev0\",\n"
    "  \"use_cache\": true,\n"
    "  \"vocab_size\": 50272,\n"
    "  \"word_embed_proj_dim\": 512\n"
    "}\n";

static void test_good(void) {
  struct fy_opt_config c;
  put("config.json", opt350m);
  CHECK_OK(fy_opt_config_read(tmpdir, &c));  // the directory form
  CHECK(c.hidden_size == 1024 && c.ffn_dim == 4096 && c.num_hidden_layers == 24);
  CHECK(c.num_attention_heads == 16 && c.word_embed_proj_dim == 512 && c.vocab_size == 50272);
  CHECK(c.max_position_embeddings == 2048 && !c.do_layer_norm_before && !c.remove_final_layer_norm);
  CHECK(c.enable_bias && c.layer_norm_elementwise_affine && c.tie_word_embeddings);
  CHECK(c.dropout == 0.1f && c.attention_dropout == 0 && c.init_std == 0.02f && c.layer_norm_eps == 1e-5f);
  CHECK(c.pad_token_id == 1 && c.bos_token_id == 2 && c.eos_token_id == 2);
  CHECK(strcmp(c.torch_dtype, "float16") == 0);
  const char *base = strrchr(tmpdir, '/') + 1;
  CHECKF(strcmp(c.name, base) == 0, "name %s", c.name);
  struct fy_opt_config c2;
  char file[300];
  snprintf(file, sizeof file, "%s/config.json", tmpdir);
  CHECK_OK(fy_opt_config_read(file, &c2));  // the file form
  CHECK(memcmp(&c, &c2, sizeof c) == 0);
  char slash[300];
  snprintf(slash, sizeof slash, "%s/", tmpdir);
  CHECK_OK(fy_opt_config_read(slash, &c2));
  CHECK(c2.hidden_size == 1024);
}

static void test_defaults(void) {
  struct fy_opt_config c;
  const char *p = put("empty.json", "{}");
  CHECK_OK(fy_opt_config_read(p, &c));
  CHECK(c.vocab_size == 50272 && c.hidden_size == 768 && c.num_hidden_layers == 12);
  CHECK(c.ffn_dim == 3072 && c.num_attention_heads == 12 && c.max_position_embeddings == 2048);
  CHECK(c.do_layer_norm_before && !c.remove_final_layer_norm && c.word_embed_proj_dim == 768);
  CHECK(c.dropout == 0.1f && c.attention_dropout == 0 && c.activation_dropout == 0 && c.layerdrop == 0);
  CHECK(c.init_std == 0.02f && c.enable_bias && c.layer_norm_elementwise_affine && c.tie_word_embeddings);
  CHECK(c.pad_token_id == 1 && c.bos_token_id == 2 && c.eos_token_id == 2);
  CHECK(c.layer_norm_eps == 1e-5f);
  // word_embed_proj_dim follows hidden_size when absent or null.
  p = put("w.json", "{\"hidden_size\": 64, \"num_attention_heads\": 4}");
  CHECK_OK(fy_opt_config_read(p, &c));
  CHECK(c.word_embed_proj_dim == 64);
  p = put("w.json", "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"word_embed_proj_dim\": null,"
                    " \"pad_token_id\": null, \"_remove_final_layer_norm\": true, \"enable_bias\": false,"
                    " \"hidden_size_unknown_key\": [1, {}], \"num_hidden_layers\": 2.0}");
  CHECK_OK(fy_opt_config_read(p, &c));
  CHECK(c.word_embed_proj_dim == 64 && c.pad_token_id == -1 && c.remove_final_layer_norm);
  CHECK(!c.enable_bias && c.num_hidden_layers == 2);
}

static void test_bad(void) {
  struct fy_opt_config c;
  memset(&c, 0x5a, sizeof c);
  struct fy_opt_config before = c;
  char p[300];
  snprintf(p, sizeof p, "%s/missing", tmpdir);
  CHECK_ERR(fy_opt_config_read(p, &c), FY_ERR_NOT_FOUND);
  CHECK(strstr(fy_error_msg(), p) != NULL);
  mkdir(p, 0755);  // a directory without config.json
  CHECK_ERR(fy_opt_config_read(p, &c), FY_ERR_NOT_FOUND);
  rmdir(p);
  CHECK_ERR(fy_opt_config_read(put("bad.json", "{\"hidden_size\": 768,\n  \"x\": }"), &c), FY_ERR_FORMAT);
  CHECK(strstr(fy_error_msg(), "line 2") != NULL);
  CHECK_ERR(fy_opt_config_read(put("bad.json", "{\"hidden_size\": 768"), &c), FY_ERR_FORMAT);
  CHECK_ERR(fy_opt_config_read(put("bad.json", ""), &c), FY_ERR_FORMAT);
  CHECK_ERR(fy_opt_config_read(put("bad.json", "{} {}"), &c), FY_ERR_FORMAT);
  CHECK_ERR(fy_opt_config_read(put("bad.json", "[768]"), &c), FY_ERR_FORMAT);
  // Wrong types and values: each names the key.
  static const struct {
    const char *json, *key;
  } cases[] = {
      {"{\"hidden_size\": \"768\"}", "hidden_size"},
      {"{\"hidden_size\": -768}", "hidden_size"},
      {"{\"hidden_size\": 768.5}", "hidden_size"},
      {"{\"hidden_size\": 0}", "hidden_size"},
      {"{\"hidden_size\": null}", "hidden_size"},
      {"{\"vocab_size\": true}", "vocab_size"},
      {"{\"num_hidden_layers\": 1000001}", "num_hidden_layers"},
      {"{\"num_hidden_layers\": 99999999999999999999}", "num_hidden_layers"},
      {"{\"ffn_dim\": 1e300}", "ffn_dim"},
      {"{\"num_attention_heads\": 7}", "num_attention_heads"},
      {"{\"do_layer_norm_before\": 1}", "do_layer_norm_before"},
      {"{\"tie_word_embeddings\": \"true\"}", "tie_word_embeddings"},
      {"{\"dropout\": \"0.1\"}", "dropout"},
      {"{\"dropout\": 1.5}", "dropout"},
      {"{\"init_std\": -1}", "init_std"},
      {"{\"model_type\": \"llama\"}", "model_type"},
      {"{\"model_type\": 5}", "model_type"},
      {"{\"activation_function\": \"silu\"}", "activation_function"},
      {"{\"activation_function\": \"gelu_new\"}", "activation_function"},
      {"{\"pad_token_id\": 50272}", "pad_token_id"},
      {"{\"eos_token_id\": -5}", "eos_token_id"},
      {"{\"word_embed_proj_dim\": 0}", "word_embed_proj_dim"},
      // Each size is plausible alone, the product is not: about 1.3e18 parameters.
      {"{\"hidden_size\": 1048576, \"num_attention_heads\": 16, \"ffn_dim\": 4194304, "
       "\"num_hidden_layers\": 100000}", "parameters"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    fy_status st = fy_opt_config_read(put("bad.json", cases[i].json), &c);
    CHECKF(st == FY_ERR_INVALID, "%s gave %d", cases[i].json, (int)st);
    CHECKF(strstr(fy_error_msg(), cases[i].key) != NULL, "%s: message '%s' lacks '%s'",
           cases[i].json, fy_error_msg(), cases[i].key);
    fprintf(stderr, "  expected error: %s\n", fy_error_msg());
  }
  CHECK(memcmp(&c, &before, sizeof c) == 0);  // failures leave the output alone
  // Unknown model_type is refused, "opt" is fine; relu (OPT's, the default) and gelu (Galactica's).
  CHECK_OK(fy_opt_config_read(put("ok.json", "{\"model_type\": \"opt\", \"activation_function\": \"relu\"}"), &c));
  CHECK(c.activation == FY_ACT_RELU);
  CHECK_OK(fy_opt_config_read(put("ok.json", "{\"activation_function\": \"gelu\"}"), &c));
  CHECK(c.activation == FY_ACT_GELU);
  CHECK_OK(fy_opt_config_read(put("ok.json", "{}"), &c));
  CHECK(c.activation == FY_ACT_RELU);
}

static void test_check(void) {
  struct fy_opt_config c;
  CHECK_OK(fy_opt_config_read(put("empty.json", "{}"), &c));
  CHECK_OK(fy_opt_config_check(&c));
  struct fy_opt_config d = c;
  d.hidden_size = 100;
  CHECK_ERR(fy_opt_config_check(&d), FY_ERR_INVALID);
  d = c;
  d.layer_norm_eps = 0;
  CHECK_ERR(fy_opt_config_check(&d), FY_ERR_INVALID);
  d = c;
  d.vocab_size = (int64_t)1 << 40;
  CHECK_ERR(fy_opt_config_check(&d), FY_ERR_INVALID);
  d = c;
  memset(d.name, 'x', sizeof d.name);
  CHECK_ERR(fy_opt_config_check(&d), FY_ERR_INVALID);
}

static void test_write(void) {
  struct fy_opt_config c;
  put("config.json", opt350m);
  CHECK_OK(fy_opt_config_read(tmpdir, &c));
  char out[300];
  snprintf(out, sizeof out, "%s/saved", tmpdir);
  CHECK_OK(fy_opt_config_write(out, &c));
  struct fy_opt_config r;
  CHECK_OK(fy_opt_config_read(out, &r));
  CHECKF(strcmp(r.name, "saved") == 0, "%s", r.name);
  snprintf(r.name, sizeof r.name, "%s", c.name);
  CHECK(memcmp(&c, &r, sizeof c) == 0);
  // The file is what transformers expects.
  char p[400];
  snprintf(p, sizeof p, "%s/config.json", out);
  FILE *f = fopen(p, "r");
  char text[4096] = {0};
  if (f) {
    fread(text, 1, sizeof text - 1, f);
    fclose(f);
  }
  CHECK(strstr(text, "\"model_type\": \"opt\"") != NULL);
  CHECK(strstr(text, "\"OPTForCausalLM\"") != NULL);
  CHECK(strstr(text, "\"dropout\": 0.1,") != NULL);
  CHECK(strstr(text, "\"attention_dropout\": 0.0,") != NULL);
  CHECK(strstr(text, "\"init_std\": 0.02,") != NULL);
  CHECK(strstr(text, "\"_remove_final_layer_norm\": false") != NULL);
  CHECK(strstr(text, "\"word_embed_proj_dim\": 512") != NULL);
  CHECK(strstr(text, "\"torch_dtype\": \"float16\"") != NULL);

  // Changed fields survive; token ids of -1 are written as null.
  c.num_hidden_layers = 3;
  c.hidden_size = 96;
  c.num_attention_heads = 6;
  c.word_embed_proj_dim = 96;
  c.ffn_dim = 384;
  c.vocab_size = 512;
  c.pad_token_id = -1;
  c.enable_bias = false;
  c.tie_word_embeddings = false;
  c.dropout = 0;
  c.init_std = 0.0125f;
  c.activation = FY_ACT_GELU;
  snprintf(c.torch_dtype, sizeof c.torch_dtype, "float32");
  CHECK_OK(fy_opt_config_write(out, &c));
  CHECK_OK(fy_opt_config_read(out, &r));
  snprintf(r.name, sizeof r.name, "%s", c.name);
  CHECK(memcmp(&c, &r, sizeof c) == 0);
  // An invalid config is not written, and the old file stays.
  c.hidden_size = 97;
  CHECK_ERR(fy_opt_config_write(out, &c), FY_ERR_INVALID);
  CHECK_OK(fy_opt_config_read(out, &r));
  CHECK(r.hidden_size == 96);
  // Writing into a path below a regular file fails with an I/O error.
  snprintf(p, sizeof p, "%s/config.json/sub", out);
  c.hidden_size = 96;
  CHECK_ERR(fy_opt_config_write(p, &c), FY_ERR_IO);
  DIR *d = opendir(out);
  int n = 0;
  struct dirent *de;
  while (d && (de = readdir(d))) n += de->d_name[0] != '.';
  if (d) closedir(d);
  CHECK(n == 1);  // no temporary files left behind
}

static void test_sizes(void) {
  double b = 0;
  CHECK(fy_parse_size("512MiB", &b) && b == 512.0 * 1048576);
  CHECK(fy_parse_size("1.5g", &b) && b == 1.5 * 1073741824);
  CHECK(fy_parse_size("4096", &b) && b == 4096);
  b = 7;
  CHECK(!fy_parse_size("12 parsecs", &b) && !fy_parse_size("-1GiB", &b) && !fy_parse_size("", &b) &&
        !fy_parse_size("5 ", &b) && !fy_parse_size("5  GiB", &b) && b == 7);
  char buf[32];
  CHECK(strcmp(fy_format_bytes(512, buf, sizeof buf), "512 B") == 0);
  CHECK(strcmp(fy_format_bytes(700 * 1024.0, buf, sizeof buf), "700.0 KiB") == 0);
  CHECK(strcmp(fy_format_bytes(12.34 * 1048576, buf, sizeof buf), "12.3 MiB") == 0);
  CHECK(strcmp(fy_format_bytes(1.5 * 1073741824, buf, sizeof buf), "1.50 GiB") == 0);
  CHECK(strcmp(fy_format_bytes(2.54 * 1099511627776.0, buf, sizeof buf), "2.54 TiB") == 0);
  // What it writes reads back (to its rounding).
  CHECK(fy_parse_size(fy_format_bytes(3.25 * 1073741824, buf, sizeof buf), &b) && b == 3.25 * 1073741824);
}

// Mixtures of experts: Mixtral's keys and moe_layer_frequency, their checks, writing them (only
// for a mixture), the presets, and the parameter count against the graph's.
static void test_moe(void) {
  struct fy_opt_config c;
  CHECK_OK(fy_opt_config_read(put("moe.json", "{\"num_hidden_layers\": 4, \"num_local_experts\": 8}"), &c));
  CHECK(c.num_local_experts == 8 && c.num_experts_per_tok == 2 && c.moe_layer_frequency == 1 &&
        c.router_aux_loss_coef == 0.001f);  // Mixtral's defaults
  CHECK(fy_opt_layer_is_moe(&c, 0) && fy_opt_layer_is_moe(&c, 3) && fy_opt_moe_layers(&c) == 4);
  CHECK_OK(fy_opt_config_read(put("moe.json", "{\"num_hidden_layers\": 5, \"num_local_experts\": 4, "
                                  "\"num_experts_per_tok\": 1, \"moe_layer_frequency\": 2, "
                                  "\"router_aux_loss_coef\": 0.02}"), &c));
  CHECK(!fy_opt_layer_is_moe(&c, 0) && fy_opt_layer_is_moe(&c, 1) && !fy_opt_layer_is_moe(&c, 2) &&
        fy_opt_layer_is_moe(&c, 3) && fy_opt_moe_layers(&c) == 2 && c.router_aux_loss_coef == 0.02f);
  CHECK_OK(fy_opt_config_read(put("dense.json", "{\"num_experts_per_tok\": 9}"), &c));  // (dense: unused)
  CHECK(c.num_local_experts == 0 && fy_opt_moe_layers(&c) == 0);
  static const struct {
    const char *json, *key;
  } bad[] = {
      {"{\"num_local_experts\": 4, \"num_experts_per_tok\": 5}", "num_experts_per_tok"},
      {"{\"num_local_experts\": 4, \"num_experts_per_tok\": 0}", "num_experts_per_tok"},
      {"{\"num_local_experts\": 1}", "num_experts_per_tok"},  // Mixtral's default k = 2 > 1
      {"{\"num_local_experts\": -2}", "num_local_experts"},
      {"{\"num_local_experts\": 4, \"moe_layer_frequency\": 0}", "moe_layer_frequency"},
      {"{\"num_local_experts\": 4, \"num_hidden_layers\": 2, \"moe_layer_frequency\": 3}", "moe_layer_frequency"},
      {"{\"num_local_experts\": 4, \"router_aux_loss_coef\": -0.1}", "router_aux_loss_coef"},
      {"{\"num_local_experts\": 4, \"num_experts_per_tok\": 2.5}", "num_experts_per_tok"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    fy_status st = fy_opt_config_read(put("bad.json", bad[i].json), &c);
    CHECKF(st == FY_ERR_INVALID, "%s gave %d", bad[i].json, (int)st);
    CHECKF(strstr(fy_error_msg(), bad[i].key) != NULL, "%s: message '%s' lacks '%s'", bad[i].json, fy_error_msg(),
           bad[i].key);
    fprintf(stderr, "  expected error: %s\n", fy_error_msg());
  }
  // Presets, written and read back; a dense config says nothing of experts.
  struct fy_opt_config p, r;
  CHECK_OK(fy_opt_preset("opt-125m-moe8", &p));
  CHECK(p.num_local_experts == 8 && p.num_experts_per_tok == 2 && p.moe_layer_frequency == 2 &&
        p.hidden_size == 768 && p.num_hidden_layers == 12 && fy_opt_moe_layers(&p) == 6);
  CHECK_OK(fy_opt_preset("opt-moe-tiny", &p));
  char out[256];
  snprintf(out, sizeof out, "%s/moe_out", tmpdir);
  CHECK_OK(fy_opt_config_write(out, &p));
  CHECK_OK(fy_opt_config_read(out, &r));
  CHECK(r.num_local_experts == p.num_local_experts && r.num_experts_per_tok == p.num_experts_per_tok &&
        r.moe_layer_frequency == p.moe_layer_frequency && r.router_aux_loss_coef == p.router_aux_loss_coef);
  char *text = NULL;
  size_t len = 0;
  CHECK_OK(fy_file_read_all(check_path(out, "config.json"), 1 << 20, "config", &text, &len));
  CHECK(text && strstr(text, "OPTMoEForCausalLM") && strstr(text, "\"num_local_experts\": 4"));
  free(text);
  CHECK_OK(fy_opt_preset("opt-tiny", &p));
  CHECK_OK(fy_opt_config_write(out, &p));
  text = NULL;
  CHECK_OK(fy_file_read_all(check_path(out, "config.json"), 1 << 20, "config", &text, &len));
  CHECK(text && !strstr(text, "experts") && !strstr(text, "moe") && strstr(text, "\"OPTForCausalLM\""));
  free(text);
  // The count of parameters is the graph's; the FLOPs count the k active experts alone.
  const char *names[] = {"opt-moe-tiny", "opt-125m-moe8"};
  for (int i = 0; i < 2; i++) {
    CHECK_OK(fy_opt_preset(names[i], &p));
    struct fy_graph *g = NULL;
    CHECK_OK(fy_opt_build_graph(&p, 1, 8, &g));
    int64_t n = 0, moe_ops = 0;
    for (int k = 0; g && k < g->n_params; k++) n += g->params[k].numel;
    for (int k = 0; g && k < g->n_ops; k++) moe_ops += g->ops[k].kind == FY_OP_MOE;
    CHECKF(n == fy_opt_num_params(&p), "%s: graph %lld, count %lld", names[i], (long long)n,
           (long long)fy_opt_num_params(&p));
    CHECK(moe_ops == fy_opt_moe_layers(&p));
    CHECK(g && fy_graph_find_param(g, "model.decoder.layers.1.block_sparse_moe.gate.weight") >= 0 &&
          fy_graph_find_param(g, "model.decoder.layers.1.fc1.weight") < 0 &&
          fy_graph_find_param(g, "model.decoder.layers.0.fc1.weight") >= 0);
    fy_graph_free(g);
    struct fy_opt_config all = p;  // every expert active: more FLOPs
    all.num_experts_per_tok = all.num_local_experts;
    CHECK(fy_opt_step_flops(&p, 1, 8, FY_FLOPS_PALM) < fy_opt_step_flops(&all, 1, 8, FY_FLOPS_PALM));
  }
  // Under tensor parallelism each expert is split (core/opt.c): a rank's slices, counted whole, are
  // the model's parameters.
  CHECK_OK(fy_opt_preset("opt-125m-moe8", &p));
  struct fy_graph *g = NULL;
  CHECK_OK(fy_opt_build_graph_tp(&p, 1, 8, 2, 0, &g));
  int64_t whole = 0;
  for (int k = 0; g && k < g->n_params; k++) whole += g->params[k].numel * (g->params[k].split_dim >= 0 ? 2 : 1);
  CHECKF(whole == fy_opt_num_params(&p), "opt-125m-moe8 over tp 2: %lld, count %lld", (long long)whole,
         (long long)fy_opt_num_params(&p));
  fy_graph_free(g);
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/fy_cfg_XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 2;
  }
  test_good();
  test_defaults();
  test_bad();
  test_check();
  test_write();
  test_moe();
  test_sizes();
  check_rm_rf(tmpdir);
  return check_summary("config");
}
