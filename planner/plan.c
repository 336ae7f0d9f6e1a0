#include "planner/plan.h"

#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fileio.h"
#include "core/graph.h"
#include "memory/chunk.h"
#include "planner/pattern.h"

static bool better(const struct fy_cost *a, const struct fy_cost *b) {
  if (!b->fits) return a->fits;
  return a->fits && a->step_s < b->step_s * (1 - 1e-9);
}

fy_status fy_plan_search(const struct fy_opt_config *cfg, const char *model, int64_t batch, int64_t seq,
                         const struct fy_probe *probe, struct fy_plan *best, int *n_tried) {
  if (batch < 1 || seq < 1) return fy_error_set(FY_ERR_INVALID, "plan: batch and sequence must be positive");
  memset(best, 0, sizeof *best);
  snprintf(best->model, sizeof best->model, "%s", model);
  snprintf(best->pattern, sizeof best->pattern, "replicate");
  best->dp = best->tp = 1;
  best->machine = *probe;
  // The chunk sizes to try: the smallest that holds the largest group, and a few multiples.
  struct fy_graph *g;
  FY_TRY(fy_opt_build_graph(cfg, 1, seq, &g));
  int64_t min_chunk = fy_chunk_min_elems(g), total = g->n_param_elems;
  fy_graph_free(g);
  int tried = 0;
  double smallest = INFINITY;
  for (int64_t micro = batch; micro >= 1; micro--) {
    if (batch % micro) continue;
    for (int rc = 0; rc < 2; rc++)
      for (int64_t mult = 1; mult <= 4; mult *= 2) {
        if (mult > 1 && min_chunk * mult / 2 > total) break;
        for (int pf = 0; pf <= 4; pf = pf ? pf * 2 : 1) {
          struct fy_plan_knobs k = {.micro_batch = micro, .grad_accum = batch / micro, .seq = seq,
                                    .chunk_elems = min_chunk * mult, .blocks = 0, .prefetch = pf,
                                    .recompute = rc, .disk_chunks = -1};
          struct fy_cost c;
          FY_TRY(fy_cost_simulate(cfg, &k, probe, &c, NULL));
          tried++;
          if (!c.fits && c.min_device_bytes < smallest && c.host_bytes <= probe->host_mem) smallest = c.min_device_bytes;
          if (c.fits && c.min_device_bytes < smallest) smallest = c.min_device_bytes;
          if (better(&c, &best->predicted)) {
            best->k = k;
            best->predicted = c;
          }
          if (!c.fits) break;  // more prefetch will not fit either
        }
      }
  }
  if (n_tried) *n_tried = tried;
  if (!best->predicted.fits) {
    if (isfinite(smallest))
      return fy_error_set(FY_ERR_NOMEM,
                          "no plan for %s with %lld x %lld tokens per step fits %.1f MiB of device memory and %.1f "
                          "GiB of host memory; the smallest device memory that works is %.1f MiB",
                          model, (long long)batch, (long long)seq, probe->device_mem / 1048576.0,
                          probe->host_mem / 1073741824.0, smallest / 1048576.0);
    return fy_error_set(FY_ERR_NOMEM, "no plan for %s fits %.1f GiB of host memory (with a disk tier: probe a --disk-dir)",
                        model, probe->host_mem / 1073741824.0);
  }
  best->k.blocks = best->predicted.n_blocks;
  best->k.disk_chunks = best->predicted.n_disk_chunks;
  return FY_OK;
}

fy_status fy_plan_check(const struct fy_opt_config *cfg, struct fy_plan *p, const struct fy_probe *probe) {
  const struct fy_plan_knobs *k = &p->k;
  if (!fy_pattern_find(p->pattern))
    return fy_error_set(FY_ERR_INVALID, "plan: unknown parallel pattern '%s'", p->pattern);
  if (p->dp != 1 || p->tp != 1)
    return fy_error_set(FY_ERR_UNSUPPORTED, "plan: %d x %d ranks; this ferry runs one rank (dp = tp = 1)", p->dp, p->tp);
  if (k->micro_batch < 1 || k->grad_accum < 1 || k->seq < 1 || k->prefetch < 0 || k->blocks < 0)
    return fy_error_set(FY_ERR_INVALID, "plan: micro_batch, grad_accum, seq must be positive, prefetch and blocks >= 0");
  if (k->chunk_elems % 16)
    return fy_error_set(FY_ERR_INVALID, "plan: chunk_elems %lld is not a multiple of 16 (64 bytes)", (long long)k->chunk_elems);
  struct fy_graph *g;
  FY_TRY(fy_opt_build_graph(cfg, k->micro_batch, k->seq, &g));
  int64_t min_chunk = fy_chunk_min_elems(g);
  fy_graph_free(g);
  if (k->chunk_elems && k->chunk_elems < min_chunk)
    return fy_error_set(FY_ERR_INVALID, "plan: chunk_elems %lld cannot hold the largest parameter group (%lld)",
                        (long long)k->chunk_elems, (long long)min_chunk);
  FY_TRY(fy_cost_simulate(cfg, k, probe, &p->predicted, NULL));
  if (!p->predicted.fits) return fy_error_set(FY_ERR_NOMEM, "plan does not fit: %s", p->predicted.why);
  return FY_OK;
}

// ---- plan files ----

static json_object *num(double v) { return json_object_new_double(v); }

fy_status fy_plan_write(const char *path, const struct fy_plan *p) {
  json_object *o = json_object_new_object();
  const struct fy_plan_knobs *k = &p->k;
  json_object_object_add(o, "model", json_object_new_string(p->model));
  json_object_object_add(o, "micro_batch", json_object_new_int64(k->micro_batch));
  json_object_object_add(o, "grad_accum", json_object_new_int64(k->grad_accum));
  json_object_object_add(o, "seq", json_object_new_int64(k->seq));
  json_object_object_add(o, "chunk_elems", json_object_new_int64(k->chunk_elems));
  json_object_object_add(o, "blocks", json_object_new_int(k->blocks));
  json_object_object_add(o, "prefetch", json_object_new_int(k->prefetch));
  json_object_object_add(o, "recompute", json_object_new_boolean(k->recompute));
  json_object_object_add(o, "disk_chunks", json_object_new_int(k->disk_chunks));
  json_object_object_add(o, "pattern", json_object_new_string(p->pattern));
  json_object_object_add(o, "dp", json_object_new_int(p->dp));
  json_object_object_add(o, "tp", json_object_new_int(p->tp));
  json_object *m = json_object_new_object();
  json_object_object_add(m, "device", json_object_new_string(p->machine.device));
  json_object_object_add(m, "device_mem", num(p->machine.device_mem));
  json_object_object_add(m, "host_mem", num(p->machine.host_mem));
  json_object_object_add(m, "device_gflops", num(p->machine.device_gflops));
  json_object_object_add(m, "h2d_gbps", num(p->machine.h2d_gbps));
  json_object_object_add(m, "d2h_gbps", num(p->machine.d2h_gbps));
  json_object_object_add(o, "machine", m);
  const struct fy_cost *c = &p->predicted;
  json_object *pr = json_object_new_object();
  json_object_object_add(pr, "step_s", num(c->step_s));
  json_object_object_add(pr, "tokens_per_s", num(c->tokens_per_s));
  json_object_object_add(pr, "mfu", num(c->mfu));
  json_object_object_add(pr, "bottleneck", json_object_new_string(c->bottleneck));
  json_object_object_add(pr, "device_peak_bytes", num(c->device_peak));
  json_object_object_add(pr, "host_bytes", num(c->host_bytes));
  json_object_object_add(pr, "disk_bytes", num(c->disk_bytes));
  json_object_object_add(pr, "chunks", json_object_new_int(c->n_chunks));
  json_object_object_add(o, "predicted", pr);
  const char *text = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PRETTY);
  struct fy_file_piece pieces[2] = {{text, strlen(text)}, {"\n", 1}};
  fy_status st = fy_file_write_atomic(path, pieces, 2);
  json_object_put(o);
  return st == FY_OK ? FY_OK : fy_error_wrap(st, "writing the plan");
}

// Reads an integer field (required) within [lo, hi].
static fy_status get_int(json_object *o, const char *path, const char *key, int64_t lo, int64_t hi, int64_t *out) {
  json_object *v;
  if (!json_object_object_get_ex(o, key, &v))
    return fy_error_set(FY_ERR_FORMAT, "plan %s: \"%s\" is missing", path, key);
  if (!json_object_is_type(v, json_type_int))
    return fy_error_set(FY_ERR_FORMAT, "plan %s: \"%s\" must be a whole number", path, key);
  int64_t x = json_object_get_int64(v);
  if (x < lo || x > hi)
    return fy_error_set(FY_ERR_FORMAT, "plan %s: \"%s\" is %lld, outside [%lld, %lld]", path, key, (long long)x,
                        (long long)lo, (long long)hi);
  *out = x;
  return FY_OK;
}

fy_status fy_plan_read(const char *path, struct fy_plan *p) {
  json_object *o = json_object_from_file(path);
  if (!o) {
    if (access(path, R_OK) != 0) return fy_error_set(FY_ERR_NOT_FOUND, "plan %s: %s", path, strerror(errno));
    return fy_error_set(FY_ERR_FORMAT, "plan %s: not valid JSON", path);
  }
  fy_status st = FY_OK;
  memset(p, 0, sizeof *p);
  static const char *const known[] = {"model", "micro_batch", "grad_accum", "seq", "chunk_elems", "blocks", "prefetch",
                                      "recompute", "disk_chunks", "pattern", "dp", "tp", "machine", "predicted"};
  if (!json_object_is_type(o, json_type_object)) st = fy_error_set(FY_ERR_FORMAT, "plan %s: not a JSON object", path);
  json_object_object_foreach(o, key, val) {
    (void)val;
    bool ok = false;
    for (size_t i = 0; i < sizeof known / sizeof *known; i++) ok |= strcmp(key, known[i]) == 0;
    if (!ok && st == FY_OK) st = fy_error_set(FY_ERR_FORMAT, "plan %s: unknown key \"%s\"", path, key);
  }
  int64_t v = 0;
  struct fy_plan_knobs *k = &p->k;
  if (st == FY_OK) st = get_int(o, path, "micro_batch", 1, 1 << 20, &k->micro_batch);
  if (st == FY_OK) st = get_int(o, path, "grad_accum", 1, 1 << 20, &k->grad_accum);
  if (st == FY_OK) st = get_int(o, path, "seq", 1, 1 << 20, &k->seq);
  if (st == FY_OK) st = get_int(o, path, "chunk_elems", 0, INT64_C(1) << 40, &k->chunk_elems);
  if (st == FY_OK && (st = get_int(o, path, "blocks", 0, 1 << 20, &v)) == FY_OK) k->blocks = (int)v;
  if (st == FY_OK && (st = get_int(o, path, "prefetch", 0, 1 << 10, &v)) == FY_OK) k->prefetch = (int)v;
  if (st == FY_OK && (st = get_int(o, path, "disk_chunks", -1, 1 << 24, &v)) == FY_OK) k->disk_chunks = (int)v;
  if (st == FY_OK && (st = get_int(o, path, "dp", 1, 1 << 16, &v)) == FY_OK) p->dp = (int)v;
  if (st == FY_OK && (st = get_int(o, path, "tp", 1, 1 << 16, &v)) == FY_OK) p->tp = (int)v;
  json_object *x;
  if (st == FY_OK) {
    if (!json_object_object_get_ex(o, "recompute", &x) || !json_object_is_type(x, json_type_boolean))
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"recompute\" must be true or false", path);
    else
      k->recompute = json_object_get_boolean(x);
  }
  const char *strs[] = {"model", "pattern"};
  char *dst[] = {p->model, p->pattern};
  size_t cap[] = {sizeof p->model, sizeof p->pattern};
  for (int i = 0; st == FY_OK && i < 2; i++) {
    if (!json_object_object_get_ex(o, strs[i], &x) || !json_object_is_type(x, json_type_string))
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"%s\" must be a string", path, strs[i]);
    else if (strlen(json_object_get_string(x)) >= cap[i])
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"%s\" is too long", path, strs[i]);
    else
      snprintf(dst[i], cap[i], "%s", json_object_get_string(x));
  }
  json_object_put(o);
  return st;
}

void fy_plan_print(const struct fy_plan *p, FILE *f) {
  const struct fy_plan_knobs *k = &p->k;
  const struct fy_cost *c = &p->predicted;
  fprintf(f, "plan for %s on %s (%.1f GiB device, %.1f GiB host, %.0f GFLOP/s, link %.1f/%.1f GB/s)\n", p->model,
          p->machine.device, p->machine.device_mem / 1073741824.0, p->machine.host_mem / 1073741824.0,
          p->machine.device_gflops, p->machine.h2d_gbps, p->machine.d2h_gbps);
  fprintf(f, "  micro-batch %lld x %lld tokens, %lld accumulated; pattern %s on %d rank(s)\n", (long long)k->micro_batch,
          (long long)k->seq, (long long)k->grad_accum, p->pattern, p->dp * p->tp);
  fprintf(f, "  %d chunks of %.1f MiB, %d device cache blocks, prefetch %d, recompute %s\n", c->n_chunks,
          c->chunk_bytes / 1048576.0, c->n_blocks, k->prefetch, k->recompute ? "on" : "off");
  fprintf(f, "  memory: device %.2f GiB (peak), host %.2f GiB, disk %.2f GiB (state of %d chunks)\n",
          c->device_peak / 1073741824.0, c->host_bytes / 1073741824.0, c->disk_bytes / 1073741824.0, c->n_disk_chunks);
  fprintf(f, "  predicted: %.3f s/step, %.0f tokens/s, MFU %.1f%% of the device's GEMM rate\n", c->step_s,
          c->tokens_per_s, 100 * c->mfu);
  fprintf(f, "  busy per step: compute %.3f s, to device %.3f s, to host %.3f s, optimizer %.3f s; bottleneck: %s\n",
          c->compute_s, c->h2d_s, c->d2h_s, c->optim_s, c->bottleneck);
}
