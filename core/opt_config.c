// Hugging Face OPT config.json: reading with transformers' OPTConfig defaults, checking, writing.
#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/fileio.h"
#include "core/opt.h"

#define CFG_MAX_FILE (16 << 20)
// Bounds far above any real model that keep every later size product inside int64.
#define CFG_MAX_DIM ((int64_t)1 << 24)
#define CFG_MAX_VOCAB ((int64_t)1 << 31)
#define CFG_MAX_LAYERS ((int64_t)1000000)
#define CFG_MAX_PARAMS ((double)((int64_t)1 << 50))

static void cfg_defaults(struct fy_opt_config *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->name, sizeof c->name, "custom");
  c->vocab_size = 50272;
  c->hidden_size = 768;
  c->word_embed_proj_dim = 768;
  c->ffn_dim = 3072;
  c->num_hidden_layers = 12;
  c->num_attention_heads = 12;
  c->max_position_embeddings = 2048;
  c->do_layer_norm_before = true;
  c->remove_final_layer_norm = false;
  c->enable_bias = true;
  c->layer_norm_elementwise_affine = true;
  c->tie_word_embeddings = true;
  c->init_std = 0.02f;
  c->layer_norm_eps = 1e-5f;
  c->dropout = 0.1f;
  c->attention_dropout = 0.0f;
  c->activation_dropout = 0.0f;
  c->layerdrop = 0.0f;
  c->pad_token_id = 1;
  c->bos_token_id = 2;
  c->eos_token_id = 2;
  snprintf(c->torch_dtype, sizeof c->torch_dtype, "float32");
  // Dense unless config.json names experts; then Mixtral's defaults for the rest.
  c->num_local_experts = 0;
  c->num_experts_per_tok = 2;
  c->moe_layer_frequency = 1;
  c->router_aux_loss_coef = 0.001f;
}

// The parameter count in double precision (cannot overflow), for the sanity bound only;
// fy_opt_num_params is the exact count.
static double cfg_params_estimate(const struct fy_opt_config *c) {
  double D = (double)c->hidden_size, F = (double)c->ffn_dim, L = (double)c->num_hidden_layers;
  double V = (double)c->vocab_size, P = (double)c->word_embed_proj_dim;
  double layer = 4 * D * D + 2 * D * F + 4 * D + F + D + 4 * D;
  double emb = V * P + ((double)c->max_position_embeddings + 2) * D;
  if (P != D) emb += 2 * P * D;
  if (!c->tie_word_embeddings) emb += V * P;
  if (c->num_local_experts > 0 && c->moe_layer_frequency > 0)
    layer += 1.0 / (double)c->moe_layer_frequency * ((double)c->num_local_experts - 1) * (2 * D * F + F + D);
  return L * layer + emb + 2 * D;
}

// The mixture-of-experts keys: all or nothing checked only when num_local_experts says a mixture.
static fy_status cfg_check_moe(const struct fy_opt_config *c) {
  if (c->num_local_experts == 0) return FY_OK;
  if (c->num_local_experts < 0 || c->num_local_experts > 4096)
    return fy_error_set(FY_ERR_INVALID, "OPT config: num_local_experts = %lld is out of range [0, 4096] (0: dense)",
                        (long long)c->num_local_experts);
  if (c->num_experts_per_tok < 1 || c->num_experts_per_tok > c->num_local_experts)
    return fy_error_set(FY_ERR_INVALID, "OPT config: num_experts_per_tok = %lld must be in [1, num_local_experts = %lld]",
                        (long long)c->num_experts_per_tok, (long long)c->num_local_experts);
  if (c->moe_layer_frequency < 1 || c->moe_layer_frequency > c->num_hidden_layers)
    return fy_error_set(FY_ERR_INVALID, "OPT config: moe_layer_frequency = %lld must be in [1, num_hidden_layers = %lld] "
                        "(layer l is a mixture when (l + 1) %% moe_layer_frequency == 0)",
                        (long long)c->moe_layer_frequency, (long long)c->num_hidden_layers);
  if (!(c->router_aux_loss_coef >= 0 && c->router_aux_loss_coef <= 1e3f))
    return fy_error_set(FY_ERR_INVALID, "OPT config: router_aux_loss_coef = %g is out of range [0, 1000]",
                        (double)c->router_aux_loss_coef);
  return FY_OK;
}

fy_status fy_opt_config_check(const struct fy_opt_config *c) {
  if (!c) return fy_error_set(FY_ERR_INVALID, "OPT config: NULL");
  if (!memchr(c->name, 0, sizeof c->name) || !memchr(c->torch_dtype, 0, sizeof c->torch_dtype))
    return fy_error_set(FY_ERR_INVALID, "OPT config: name or torch_dtype is not terminated");
  struct {
    const char *key;
    int64_t v, lo, hi;
  } ints[] = {
      {"vocab_size", c->vocab_size, 1, CFG_MAX_VOCAB},
      {"hidden_size", c->hidden_size, 1, CFG_MAX_DIM},
      {"word_embed_proj_dim", c->word_embed_proj_dim, 1, CFG_MAX_DIM},
      {"ffn_dim", c->ffn_dim, 1, CFG_MAX_DIM},
      {"num_hidden_layers", c->num_hidden_layers, 1, CFG_MAX_LAYERS},
      {"num_attention_heads", c->num_attention_heads, 1, CFG_MAX_DIM},
      {"max_position_embeddings", c->max_position_embeddings, 1, CFG_MAX_DIM},
  };
  for (size_t i = 0; i < sizeof ints / sizeof *ints; i++)
    if (ints[i].v < ints[i].lo || ints[i].v > ints[i].hi)
      return fy_error_set(FY_ERR_INVALID, "OPT config: %s = %lld is out of range [%lld, %lld]",
                          ints[i].key, (long long)ints[i].v, (long long)ints[i].lo,
                          (long long)ints[i].hi);
  if (c->hidden_size % c->num_attention_heads != 0)
    return fy_error_set(FY_ERR_INVALID, "OPT config: hidden_size %lld is not divisible by "
                        "num_attention_heads %lld", (long long)c->hidden_size,
                        (long long)c->num_attention_heads);
  struct {
    const char *key;
    int64_t v;
  } toks[] = {{"pad_token_id", c->pad_token_id}, {"bos_token_id", c->bos_token_id},
              {"eos_token_id", c->eos_token_id}};
  for (size_t i = 0; i < 3; i++)  // -1 = none (null in config.json)
    if (toks[i].v < -1 || toks[i].v >= c->vocab_size)
      return fy_error_set(FY_ERR_INVALID, "OPT config: %s = %lld is outside the vocabulary (%lld)",
                          toks[i].key, (long long)toks[i].v, (long long)c->vocab_size);
  struct {
    const char *key;
    float v, lo, hi;
  } fl[] = {
      {"dropout", c->dropout, 0, 1},
      {"attention_dropout", c->attention_dropout, 0, 1},
      {"activation_dropout", c->activation_dropout, 0, 1},
      {"layerdrop", c->layerdrop, 0, 1},
      {"init_std", c->init_std, 0, 1e3f},
      {"layer_norm_eps", c->layer_norm_eps, 0, 1},
  };
  for (size_t i = 0; i < sizeof fl / sizeof *fl; i++)
    if (!(fl[i].v >= fl[i].lo && fl[i].v <= fl[i].hi))  // also refuses NaN
      return fy_error_set(FY_ERR_INVALID, "OPT config: %s = %g is out of range [%g, %g]", fl[i].key,
                          (double)fl[i].v, (double)fl[i].lo, (double)fl[i].hi);
  if (!(c->init_std > 0) || !(c->layer_norm_eps > 0))
    return fy_error_set(FY_ERR_INVALID, "OPT config: init_std and layer_norm_eps must be positive");
  if (!(c->train_dropout >= 0 && c->train_dropout < 1))
    return fy_error_set(FY_ERR_INVALID, "dropout %g: a probability in [0, 1) (1 would drop every branch)",
                        (double)c->train_dropout);
  FY_TRY(cfg_check_moe(c));
  double np = cfg_params_estimate(c);
  if (np > CFG_MAX_PARAMS)
    return fy_error_set(FY_ERR_INVALID, "OPT config: %.3g parameters is absurd (limit 2^50)", np);
  return FY_OK;
}

// ---- reading ----

static void cfg_line_col(const char *s, size_t off, int *line, int *col) {
  *line = 1;
  *col = 1;
  for (size_t i = 0; i < off && s[i]; i++) {
    if (s[i] == '\n') {
      (*line)++;
      *col = 1;
    } else {
      (*col)++;
    }
  }
}

// Integer key: an integral JSON number (768 or 768.0); null allowed when null_value is given.
static fy_status cfg_int(json_object *root, const char *path, const char *key, int64_t *v,
                         const int64_t *null_value) {
  json_object *o;
  if (!json_object_object_get_ex(root, key, &o)) return FY_OK;
  if (json_object_is_type(o, json_type_null) && null_value) {
    *v = *null_value;
    return FY_OK;
  }
  if (json_object_is_type(o, json_type_int)) {
    int64_t x = json_object_get_int64(o);
    if (x == INT64_MAX && json_object_get_uint64(o) > (uint64_t)INT64_MAX)
      return fy_error_set(FY_ERR_INVALID, "%s: \"%s\" is too large", path, key);
    *v = x;
    return FY_OK;
  }
  if (json_object_is_type(o, json_type_double)) {
    double d = json_object_get_double(o);
    if (isfinite(d) && d == floor(d) && fabs(d) < 9e15) {
      *v = (int64_t)d;
      return FY_OK;
    }
    return fy_error_set(FY_ERR_INVALID, "%s: \"%s\" must be an integer, not %s", path, key,
                        json_object_to_json_string(o));
  }
  return fy_error_set(FY_ERR_INVALID, "%s: \"%s\" must be an integer, not %s", path, key,
                      json_object_to_json_string(o));
}

static fy_status cfg_float(json_object *root, const char *path, const char *key, float *v) {
  json_object *o;
  if (!json_object_object_get_ex(root, key, &o)) return FY_OK;
  if (json_object_is_type(o, json_type_int) || json_object_is_type(o, json_type_double)) {
    double d = json_object_get_double(o);
    if (!isfinite(d) || fabs(d) > 1e30)
      return fy_error_set(FY_ERR_INVALID, "%s: \"%s\" = %s is not a finite number", path, key,
                          json_object_to_json_string(o));
    *v = (float)d;
    return FY_OK;
  }
  return fy_error_set(FY_ERR_INVALID, "%s: \"%s\" must be a number, not %s", path, key,
                      json_object_to_json_string(o));
}

static fy_status cfg_bool(json_object *root, const char *path, const char *key, bool *v) {
  json_object *o;
  if (!json_object_object_get_ex(root, key, &o)) return FY_OK;
  if (!json_object_is_type(o, json_type_boolean))
    return fy_error_set(FY_ERR_INVALID, "%s: \"%s\" must be true or false, not %s", path, key,
                        json_object_to_json_string(o));
  *v = json_object_get_boolean(o);
  return FY_OK;
}

// String key; *v = NULL when absent or null.
static fy_status cfg_str(json_object *root, const char *path, const char *key, const char **v) {
  json_object *o;
  *v = NULL;
  if (!json_object_object_get_ex(root, key, &o) || json_object_is_type(o, json_type_null))
    return FY_OK;
  if (!json_object_is_type(o, json_type_string))
    return fy_error_set(FY_ERR_INVALID, "%s: \"%s\" must be a string, not %s", path, key,
                        json_object_to_json_string(o));
  *v = json_object_get_string(o);
  return FY_OK;
}

static fy_status cfg_parse(json_object *root, const char *path, struct fy_opt_config *c) {
  const char *s;
  FY_TRY(cfg_str(root, path, "model_type", &s));
  if (s && strcmp(s, "opt") != 0)
    return fy_error_set(FY_ERR_INVALID, "%s: model_type is \"%s\"; ferry reads OPT models "
                        "(model_type \"opt\")", path, s);
  FY_TRY(cfg_str(root, path, "activation_function", &s));
  if (s && strcmp(s, "relu") != 0 && strcmp(s, "gelu") != 0)
    return fy_error_set(FY_ERR_INVALID, "%s: activation_function \"%s\" is not supported (\"relu\", as OPT "
                        "models, or \"gelu\", as Galactica's)", path, s);
  c->activation = s && strcmp(s, "gelu") == 0 ? FY_ACT_GELU : FY_ACT_RELU;
  FY_TRY(cfg_str(root, path, "torch_dtype", &s));
  if (!s) FY_TRY(cfg_str(root, path, "dtype", &s));  // transformers >= 4.56 writes "dtype"
  if (s) {
    if (strlen(s) >= sizeof c->torch_dtype)
      return fy_error_set(FY_ERR_INVALID, "%s: torch_dtype \"%s\" is unknown", path, s);
    snprintf(c->torch_dtype, sizeof c->torch_dtype, "%s", s);
  }
  FY_TRY(cfg_int(root, path, "vocab_size", &c->vocab_size, NULL));
  FY_TRY(cfg_int(root, path, "hidden_size", &c->hidden_size, NULL));
  c->word_embed_proj_dim = c->hidden_size;  // OPTConfig: word_embed_proj_dim or hidden_size
  int64_t proj_null = c->hidden_size, none = -1;
  FY_TRY(cfg_int(root, path, "word_embed_proj_dim", &c->word_embed_proj_dim, &proj_null));
  FY_TRY(cfg_int(root, path, "ffn_dim", &c->ffn_dim, NULL));
  FY_TRY(cfg_int(root, path, "num_hidden_layers", &c->num_hidden_layers, NULL));
  FY_TRY(cfg_int(root, path, "num_attention_heads", &c->num_attention_heads, NULL));
  FY_TRY(cfg_int(root, path, "max_position_embeddings", &c->max_position_embeddings, NULL));
  FY_TRY(cfg_int(root, path, "pad_token_id", &c->pad_token_id, &none));
  FY_TRY(cfg_int(root, path, "bos_token_id", &c->bos_token_id, &none));
  FY_TRY(cfg_int(root, path, "eos_token_id", &c->eos_token_id, &none));
  FY_TRY(cfg_bool(root, path, "do_layer_norm_before", &c->do_layer_norm_before));
  FY_TRY(cfg_bool(root, path, "_remove_final_layer_norm", &c->remove_final_layer_norm));
  FY_TRY(cfg_bool(root, path, "enable_bias", &c->enable_bias));
  FY_TRY(cfg_bool(root, path, "layer_norm_elementwise_affine", &c->layer_norm_elementwise_affine));
  FY_TRY(cfg_bool(root, path, "tie_word_embeddings", &c->tie_word_embeddings));
  FY_TRY(cfg_float(root, path, "dropout", &c->dropout));
  FY_TRY(cfg_float(root, path, "attention_dropout", &c->attention_dropout));
  FY_TRY(cfg_float(root, path, "activation_dropout", &c->activation_dropout));
  FY_TRY(cfg_float(root, path, "layerdrop", &c->layerdrop));
  FY_TRY(cfg_float(root, path, "init_std", &c->init_std));
  FY_TRY(cfg_int(root, path, "num_local_experts", &c->num_local_experts, NULL));
  FY_TRY(cfg_int(root, path, "num_experts_per_tok", &c->num_experts_per_tok, NULL));
  FY_TRY(cfg_int(root, path, "moe_layer_frequency", &c->moe_layer_frequency, NULL));
  FY_TRY(cfg_float(root, path, "router_aux_loss_coef", &c->router_aux_loss_coef));
  c->layer_norm_eps = 1e-5f;
  fy_status st = fy_opt_config_check(c);
  if (st != FY_OK) fy_error_wrap(st, "%s", path);
  return st;
}

// The model's name: the basename of the directory holding config.json, else "custom".
static void cfg_name(const char *dir, struct fy_opt_config *c) {
  char *real = realpath(dir, NULL);
  const char *base = NULL;
  if (real) {
    base = strrchr(real, '/');
    base = base ? base + 1 : real;
  }
  if (base && base[0] && strlen(base) < sizeof c->name)
    snprintf(c->name, sizeof c->name, "%s", base);
  else
    snprintf(c->name, sizeof c->name, "custom");
  free(real);
}

fy_status fy_opt_config_read(const char *path, struct fy_opt_config *cfg) {
  if (!path || !cfg) return fy_error_set(FY_ERR_INVALID, "fy_opt_config_read: NULL argument");
  struct stat sb;
  if (stat(path, &sb) != 0) {
    int e = errno;
    return fy_error_set(e == ENOENT ? FY_ERR_NOT_FOUND : FY_ERR_IO, "cannot open %s: %s", path,
                        strerror(e));
  }
  size_t plen = strlen(path);
  char *file = malloc(plen + 16), *dir = malloc(plen + 3);
  if (!file || !dir) {
    free(file);
    free(dir);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  if (S_ISDIR(sb.st_mode)) {
    snprintf(file, plen + 16, "%s%sconfig.json", path, plen && path[plen - 1] == '/' ? "" : "/");
    snprintf(dir, plen + 3, "%s", path);
  } else {
    snprintf(file, plen + 16, "%s", path);
    const char *slash = strrchr(path, '/');
    if (slash) snprintf(dir, plen + 3, "%.*s", (int)(slash - path + 1), path);
    else snprintf(dir, plen + 3, ".");
  }
  struct fy_opt_config c;
  cfg_defaults(&c);
  cfg_name(dir, &c);
  free(dir);
  char *buf = NULL;
  size_t len = 0;
  fy_status st = fy_file_read_all(file, CFG_MAX_FILE, "a config.json", &buf, &len);
  if (st != FY_OK) {
    free(file);
    return st;
  }
  json_tokener *tok = json_tokener_new();
  json_object *root = NULL;
  if (!tok) {
    st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  } else {
    root = json_tokener_parse_ex(tok, buf, (int)len);
    enum json_tokener_error je = json_tokener_get_error(tok);
    size_t end = json_tokener_get_parse_end(tok);
    int line, col;
    if (!root || je != json_tokener_success) {
      cfg_line_col(buf, end, &line, &col);
      st = fy_error_set(FY_ERR_FORMAT, "%s: invalid JSON: %s at line %d, column %d (byte %zu)",
                        file, je == json_tokener_continue ? "unexpected end of file"
                                                          : json_tokener_error_desc(je),
                        line, col, end);
    } else {
      size_t i = end;
      while (i < len && (buf[i] == ' ' || buf[i] == '\n' || buf[i] == '\t' || buf[i] == '\r')) i++;
      if (i < len) {
        cfg_line_col(buf, i, &line, &col);
        st = fy_error_set(FY_ERR_FORMAT, "%s: invalid JSON: trailing data at line %d, column %d",
                          file, line, col);
      } else if (!json_object_is_type(root, json_type_object)) {
        st = fy_error_set(FY_ERR_FORMAT, "%s: invalid config: the top level is not a JSON object",
                          file);
      } else {
        st = cfg_parse(root, file, &c);
      }
    }
    json_tokener_free(tok);
  }
  json_object_put(root);
  free(buf);
  free(file);
  if (st == FY_OK) *cfg = c;
  return st;
}

// ---- writing ----

// The shortest decimal that reads back as the same float, as Python prints it (0.1, 0.0, 1e-05).
static json_object *cfg_new_float(float f) {
  char s[48];
  for (int p = 1; p <= 9; p++) {
    snprintf(s, sizeof s, "%.*g", p, (double)f);
    if (strtof(s, NULL) == f) break;
  }
  if (!strpbrk(s, ".eEn")) strcat(s, ".0");
  return json_object_new_double_s((double)f, s);
}

static json_object *cfg_new_token(int64_t id) {
  return id < 0 ? NULL : json_object_new_int64(id);
}

fy_status fy_opt_config_write(const char *dir, const struct fy_opt_config *c) {
  if (!dir || !c) return fy_error_set(FY_ERR_INVALID, "fy_opt_config_write: NULL argument");
  FY_TRY(fy_opt_config_check(c));
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return fy_error_set(FY_ERR_IO, "cannot create directory %s: %s", dir, strerror(errno));
  json_object *o = json_object_new_object(), *arch = json_object_new_array();
  if (!o || !arch) {
    json_object_put(o);
    json_object_put(arch);
    return fy_error_set(FY_ERR_NOMEM, "out of memory");
  }
  // A mixture has no class in transformers: the name says what it is, and no loader mistakes it
  // for a dense OPT model.
  json_object_array_add(arch, json_object_new_string(c->num_local_experts > 0 ? "OPTMoEForCausalLM" : "OPTForCausalLM"));
  // Sorted keys, as transformers' to_json_string writes them.
  json_object_object_add(o, "_remove_final_layer_norm", json_object_new_boolean(c->remove_final_layer_norm));
  json_object_object_add(o, "activation_dropout", cfg_new_float(c->activation_dropout));
  json_object_object_add(o, "activation_function", json_object_new_string(c->activation == FY_ACT_GELU ? "gelu" : "relu"));
  json_object_object_add(o, "architectures", arch);
  json_object_object_add(o, "attention_dropout", cfg_new_float(c->attention_dropout));
  json_object_object_add(o, "bos_token_id", cfg_new_token(c->bos_token_id));
  json_object_object_add(o, "do_layer_norm_before", json_object_new_boolean(c->do_layer_norm_before));
  json_object_object_add(o, "dropout", cfg_new_float(c->dropout));
  json_object_object_add(o, "enable_bias", json_object_new_boolean(c->enable_bias));
  json_object_object_add(o, "eos_token_id", cfg_new_token(c->eos_token_id));
  json_object_object_add(o, "ffn_dim", json_object_new_int64(c->ffn_dim));
  json_object_object_add(o, "hidden_size", json_object_new_int64(c->hidden_size));
  json_object_object_add(o, "init_std", cfg_new_float(c->init_std));
  json_object_object_add(o, "layer_norm_elementwise_affine",
                         json_object_new_boolean(c->layer_norm_elementwise_affine));
  json_object_object_add(o, "layerdrop", cfg_new_float(c->layerdrop));
  json_object_object_add(o, "max_position_embeddings", json_object_new_int64(c->max_position_embeddings));
  if (c->num_local_experts > 0)
    json_object_object_add(o, "moe_layer_frequency", json_object_new_int64(c->moe_layer_frequency));
  json_object_object_add(o, "model_type", json_object_new_string("opt"));
  json_object_object_add(o, "num_attention_heads", json_object_new_int64(c->num_attention_heads));
  if (c->num_local_experts > 0) {
    json_object_object_add(o, "num_experts_per_tok", json_object_new_int64(c->num_experts_per_tok));
  }
  json_object_object_add(o, "num_hidden_layers", json_object_new_int64(c->num_hidden_layers));
  if (c->num_local_experts > 0)
    json_object_object_add(o, "num_local_experts", json_object_new_int64(c->num_local_experts));
  json_object_object_add(o, "pad_token_id", cfg_new_token(c->pad_token_id));
  if (c->num_local_experts > 0)
    json_object_object_add(o, "router_aux_loss_coef", cfg_new_float(c->router_aux_loss_coef));
  json_object_object_add(o, "tie_word_embeddings", json_object_new_boolean(c->tie_word_embeddings));
  json_object_object_add(o, "torch_dtype", json_object_new_string(c->torch_dtype[0] ? c->torch_dtype : "float32"));
  json_object_object_add(o, "use_cache", json_object_new_boolean(true));
  json_object_object_add(o, "vocab_size", json_object_new_int64(c->vocab_size));
  json_object_object_add(o, "word_embed_proj_dim", json_object_new_int64(c->word_embed_proj_dim));
  size_t n;
  const char *s = json_object_to_json_string_length(
      o, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE, &n);
  fy_status st;
  size_t dl = strlen(dir);
  char *path = malloc(dl + 16), *text = s ? malloc(n + 2) : NULL;
  if (!path || !text) {
    st = fy_error_set(FY_ERR_NOMEM, "out of memory");
  } else {
    snprintf(path, dl + 16, "%s%sconfig.json", dir, dl && dir[dl - 1] == '/' ? "" : "/");
    memcpy(text, s, n);
    text[n] = '\n';
    st = fy_file_write_atomic(path, &(struct fy_file_piece){text, n + 1}, 1);
  }
  free(path);
  free(text);
  json_object_put(o);
  return st;
}
