// The checkpoint index: trainer.json and the `latest` pointer (runtime/checkpoint.h), apart from
// the rest so that their parsers can be fuzzed on their own (test/fuzz/fuzz_checkpoint.c).
#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/checkpoint.h"
#include "core/fileio.h"

// Writes text to path through a temporary file in the same directory: fsync, rename.
fy_status fy_ckpt_write_text(const char *path, const char *text) {
  return fy_file_write_atomic(path, &(struct fy_file_piece){text, strlen(text)}, 1);
}

fy_status fy_ckpt_index_write(const char *dir, const struct fy_ckpt_meta *meta) {
  json_object *o = json_object_new_object();
  json_object_object_add(o, "format", json_object_new_string("ferry-checkpoint"));
  json_object_object_add(o, "version", json_object_new_int(1));
  json_object_object_add(o, "step", json_object_new_int64(meta->step));
  json_object_object_add(o, "sequences", json_object_new_int64(meta->sequences));
  json_object_object_add(o, "seed", json_object_new_uint64(meta->seed));
  json_object_object_add(o, "loss_scale", json_object_new_double(meta->loss_scale));
  json_object_object_add(o, "loss_scale_good_steps", json_object_new_int64(meta->loss_scale_good));
  json_object_object_add(o, "adamw_updates", json_object_new_int64(meta->updates));
  // The list of the files' checksums, written after this file (runtime/checkpoint.c): a checkpoint
  // without it that names it lost it.
  json_object_object_add(o, "checksums", json_object_new_string(FY_CKPT_SUMS));
  json_object_object_add(o, "optimizer_state",
                         json_object_new_string(meta->optimizer_state[0] ? meta->optimizer_state : "fp32"));
  json_object *opts = json_tokener_parse(meta->options[0] ? meta->options : "{}");
  json_object_object_add(o, "options", opts ? opts : json_object_new_object());
  char path[4200];
  snprintf(path, sizeof path, "%s/trainer.json", dir);
  fy_status st = fy_ckpt_write_text(path, json_object_to_json_string_ext(o, JSON_C_TO_STRING_PRETTY));
  json_object_put(o);
  return st;
}

fy_status fy_ckpt_index_read(const char *dir, struct fy_ckpt_meta *meta) {
  char p[4200];
  snprintf(p, sizeof p, "%s/trainer.json", dir);
  json_object *o = json_object_from_file(p);
  if (!o) return fy_error_set(FY_ERR_FORMAT, "%s: cannot be read as JSON", p);
  fy_status st = FY_OK;
  json_object *v;
  memset(meta, 0, sizeof *meta);
  if (!json_object_is_type(o, json_type_object) || !json_object_object_get_ex(o, "format", &v) ||
      strcmp(json_object_get_string(v), "ferry-checkpoint") != 0) {
    st = fy_error_set(FY_ERR_FORMAT, "%s: not a ferry checkpoint index", p);
  } else {
    const char *keys[] = {"step", "sequences"};
    int64_t *dst[] = {&meta->step, &meta->sequences};
    for (int i = 0; i < 2 && st == FY_OK; i++) {
      if (!json_object_object_get_ex(o, keys[i], &v) || !json_object_is_type(v, json_type_int) ||
          json_object_get_int64(v) < 0)
        st = fy_error_set(FY_ERR_FORMAT, "%s: \"%s\" must be a whole number >= 0", p, keys[i]);
      else
        *dst[i] = json_object_get_int64(v);
    }
    if (st == FY_OK && json_object_object_get_ex(o, "seed", &v)) meta->seed = json_object_get_uint64(v);
    meta->loss_scale = 1.0;
    if (st == FY_OK && json_object_object_get_ex(o, "loss_scale", &v)) {
      meta->loss_scale = json_object_get_double(v);
      if (!(meta->loss_scale > 0) || !isfinite(meta->loss_scale))
        st = fy_error_set(FY_ERR_FORMAT, "%s: \"loss_scale\" must be a positive number", p);
    }
    if (st == FY_OK && json_object_object_get_ex(o, "loss_scale_good_steps", &v)) {
      meta->loss_scale_good = json_object_get_int64(v);
      if (meta->loss_scale_good < 0) st = fy_error_set(FY_ERR_FORMAT, "%s: \"loss_scale_good_steps\" is negative", p);
    }
    // AdamW's bias correction counts the updates applied (checkpoints before this field: every step)
    meta->updates = meta->step;
    if (st == FY_OK && json_object_object_get_ex(o, "adamw_updates", &v)) {
      if (!json_object_is_type(v, json_type_int) || json_object_get_int64(v) < 0 ||
          json_object_get_int64(v) > meta->step)
        st = fy_error_set(FY_ERR_FORMAT, "%s: \"adamw_updates\" must be a whole number from 0 to \"step\"", p);
      else
        meta->updates = json_object_get_int64(v);
    }
    snprintf(meta->optimizer_state, sizeof meta->optimizer_state, "fp32");  // (checkpoints before the field)
    if (st == FY_OK && json_object_object_get_ex(o, "optimizer_state", &v)) {
      const char *f = json_object_is_type(v, json_type_string) ? json_object_get_string(v) : "";
      if (strcmp(f, "fp32") != 0 && strcmp(f, "bf16") != 0 && strcmp(f, "8bit") != 0)
        st = fy_error_set(FY_ERR_FORMAT, "%s: \"optimizer_state\" must be \"fp32\", \"bf16\" or \"8bit\"", p);
      else
        snprintf(meta->optimizer_state, sizeof meta->optimizer_state, "%s", f);
    }
    if (st == FY_OK && json_object_object_get_ex(o, "options", &v))
      snprintf(meta->options, sizeof meta->options, "%s", json_object_to_json_string(v));
  }
  json_object_put(o);
  return st;
}


// fy_ckpt_model_dir without the check of the files' checksums (runtime/checkpoint.c): what reads
// config.json and trainer.json alone (ferry plan --model) need not read the tensors.
static fy_status model_dir(const char *path, char *buf, size_t n, const char **dir) {
  *dir = path;
  char p[4200];
  snprintf(p, sizeof p, "%s/latest", path);
  if (access(p, F_OK) != 0) return FY_OK;  // (anything but a root reports itself when read)
  FY_TRY(fy_ckpt_resolve(path, buf, n));
  *dir = buf;
  return FY_OK;
}

// The model the run that wrote meta named, into out ("" when it named none).
static void model_name(const struct fy_ckpt_meta *meta, char *out, size_t n) {
  if (n) out[0] = 0;
  json_object *o = json_tokener_parse(meta->options), *v;
  if (o && json_object_object_get_ex(o, "model", &v) && json_object_is_type(v, json_type_string)) {
    const char *name = json_object_get_string(v), *slash = strrchr(name, '/');
    if (slash && slash[1]) name = slash + 1;
    if (strlen(name) < n) snprintf(out, n, "%s", name);
  }
  json_object_put(o);
}

fy_status fy_ckpt_config_read(const char *path, struct fy_opt_config *cfg) {
  char buf[4096], p[4200], name[sizeof cfg->name];
  const char *dir;
  FY_TRY(model_dir(path, buf, sizeof buf, &dir));
  FY_TRY(fy_opt_config_read(dir, cfg));
  snprintf(p, sizeof p, "%s/trainer.json", dir);
  struct fy_ckpt_meta meta;
  if (access(p, R_OK) == 0 && fy_ckpt_index_read(dir, &meta) == FY_OK) {  // (a step directory)
    model_name(&meta, name, sizeof name);
    if (name[0]) memcpy(cfg->name, name, sizeof name);
  }
  return FY_OK;
}

fy_status fy_ckpt_resolve(const char *path, char *dir, size_t n) {
  char p[4200], name[256];
  snprintf(p, sizeof p, "%s/latest", path);
  FILE *f = fopen(p, "r");
  if (f) {
    bool ok = fgets(name, sizeof name, f) != NULL;
    fclose(f);
    name[strcspn(name, "\r\n")] = 0;
    if (!ok || strncmp(name, "step-", 5) != 0 || strchr(name, '/') || strstr(name, ".."))
      return fy_error_set(FY_ERR_FORMAT, "%s does not name a checkpoint directory", p);
    snprintf(dir, n, "%s/%s", path, name);
    return FY_OK;
  }
  snprintf(p, sizeof p, "%s/trainer.json", path);
  if (access(p, R_OK) == 0) {
    snprintf(dir, n, "%s", path);
    return FY_OK;
  }
  struct stat sb;
  if (stat(path, &sb) != 0) return fy_error_set(FY_ERR_NOT_FOUND, "%s: %s", path, strerror(errno));
  snprintf(p, sizeof p, "%s/config.json", path);
  if (access(p, R_OK) == 0)  // (what --save writes without --save-every, or ferry export)
    return fy_error_set(FY_ERR_NOT_FOUND,
                        "%s is not a ferry checkpoint (no latest, no trainer.json) but a Hugging Face model "
                        "(config.json): transformers loads it as it is, and ferry train --init %s starts "
                        "from its weights (with fresh AdamW state)",
                        path, path);
  return fy_error_set(FY_ERR_NOT_FOUND, "%s is not a ferry checkpoint (no latest, no trainer.json)", path);
}
