// Plan files (planner/plan.h): JSON a person can read and edit, read back strictly. Apart from
// the search so that the reader builds alone for the fuzzer (test/fuzz/fuzz_plan.c).
#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "core/fileio.h"
#include "planner/plan.h"


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
  json_object_object_add(o, "resident", json_object_new_boolean(k->resident));
  if (k->precision[0])  // (the search always sets it; a plan read from a file without it has none)
    json_object_object_add(o, "precision", json_object_new_string(k->precision));
  json_object_object_add(o, "disk_chunks", json_object_new_int(k->disk_chunks));
  json_object_object_add(o, "device_chunks", json_object_new_int(k->device_chunks));
  if (k->disk_master) json_object_object_add(o, "disk_master", json_object_new_boolean(true));
  if (k->optimizer_lag) json_object_object_add(o, "optimizer_lag", json_object_new_int(k->optimizer_lag));
  if (k->spec_chunks) json_object_object_add(o, "spec_chunks", json_object_new_int(k->spec_chunks));
  if (k->device_updates) json_object_object_add(o, "device_updates", json_object_new_int(k->device_updates));
  if (k->optimizer_state[0] && strcmp(k->optimizer_state, "fp32") != 0)
    json_object_object_add(o, "optimizer_state", json_object_new_string(k->optimizer_state));
  json_object_object_add(o, "pattern", json_object_new_string(p->pattern));
  json_object_object_add(o, "dp", json_object_new_int(p->dp));
  json_object_object_add(o, "tp", json_object_new_int(p->tp));
  if (p->pp > 1) json_object_object_add(o, "pp", json_object_new_int(p->pp));
  if (p->ep > 1) json_object_object_add(o, "ep", json_object_new_int(p->ep));
  if (k->cluster.nodes > 0) {  // (where the ranks were priced: ferry plan --nodes ...)
    json_object *cl = json_object_new_object();
    json_object_object_add(cl, "nodes", json_object_new_int(k->cluster.nodes));
    json_object_object_add(cl, "gpus_per_node", json_object_new_int(k->cluster.gpus_per_node));
    json_object_object_add(cl, "intra_gbps", num(k->cluster.intra_gbps));
    json_object_object_add(cl, "inter_gbps", num(k->cluster.inter_gbps));
    json_object_object_add(o, "cluster", cl);
  }
  json_object *m = json_object_new_object();
  json_object_object_add(m, "device", json_object_new_string(p->machine.device));
  json_object_object_add(m, "device_mem", num(p->machine.device_mem));
  json_object_object_add(m, "host_mem", num(p->machine.host_mem));
  json_object_object_add(m, "device_gflops", num(p->machine.device_gflops));
  json_object_object_add(m, "bf16_speedup", num(p->machine.bf16_speedup));
  json_object_object_add(m, "device_mem_gbps", num(p->machine.device_mem_gbps));  // (0: unknown)
  json_object_object_add(m, "h2d_gbps", num(p->machine.h2d_gbps));
  json_object_object_add(m, "d2h_gbps", num(p->machine.d2h_gbps));
  json_object_object_add(o, "machine", m);
  const struct fy_cost *c = &p->predicted;
  json_object *pr = json_object_new_object();
  json_object_object_add(pr, "step_s", num(c->step_s));
  json_object_object_add(pr, "tokens_per_s", num(c->tokens_per_s));
  json_object_object_add(pr, "mfu", num(c->mfu));            // of the device's measured GEMM rate
  json_object_object_add(pr, "mfu_peak", num(c->mfu_peak));  // of its dense peak (mfu when unknown)
  json_object_object_add(pr, "peak_gflops", num(c->peak_gflops));  // 0: unknown
  json_object_object_add(pr, "bottleneck", json_object_new_string(c->bottleneck));
  json_object_object_add(pr, "device_peak_bytes", num(c->device_peak));
  json_object_object_add(pr, "host_bytes", num(c->host_bytes));
  json_object_object_add(pr, "disk_bytes", num(c->disk_bytes));
  json_object_object_add(pr, "chunks", json_object_new_int(c->n_chunks));
  if (p->pp > 1) {  // (each stage's device peak: a rank's own, as its run logs it)
    json_object *sb = json_object_new_array();
    for (int s = 0; s < p->pp && s < FY_COST_MAX_STAGES; s++) json_object_array_add(sb, num(c->stage_bytes[s]));
    json_object_object_add(pr, "stage_peak_bytes", sb);
  }
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
                                      "recompute", "resident", "precision", "disk_chunks", "disk_master", "device_chunks", "optimizer_lag", "spec_chunks", "device_updates", "optimizer_state", "pattern", "dp", "tp", "pp", "ep",
                                      "cluster", "machine", "predicted"};
  if (!json_object_is_type(o, json_type_object)) {  // (found by fuzz_plan: a bare number parsed)
    json_object_put(o);
    return fy_error_set(FY_ERR_FORMAT, "plan %s: not a JSON object", path);
  }
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
  // (Optional: plans written before it keep every chunk's state off the device.)
  if (st == FY_OK && json_object_object_get_ex(o, "device_chunks", NULL) &&
      (st = get_int(o, path, "device_chunks", 0, 1 << 24, &v)) == FY_OK)
    k->device_chunks = (int)v;
  // (Optional: 0, the exact step, when absent.)
  if (st == FY_OK && json_object_object_get_ex(o, "optimizer_lag", NULL) &&
      (st = get_int(o, path, "optimizer_lag", 0, 1, &v)) == FY_OK)
    k->optimizer_lag = (int)v;
  // (Optional: no speculative updates when absent.)
  if (st == FY_OK && json_object_object_get_ex(o, "spec_chunks", NULL) &&
      (st = get_int(o, path, "spec_chunks", 0, 1 << 24, &v)) == FY_OK)
    k->spec_chunks = (int)v;
  // (Optional: no device updates when absent.)
  if (st == FY_OK && json_object_object_get_ex(o, "device_updates", NULL) &&
      (st = get_int(o, path, "device_updates", 0, 1 << 24, &v)) == FY_OK)
    k->device_updates = (int)v;
  if (st == FY_OK && (st = get_int(o, path, "dp", 1, 1 << 16, &v)) == FY_OK) p->dp = (int)v;
  if (st == FY_OK && (st = get_int(o, path, "tp", 1, 1 << 16, &v)) == FY_OK) p->tp = (int)v;
  p->pp = 1;  // (optional: no pipeline when absent)
  if (st == FY_OK && json_object_object_get_ex(o, "pp", NULL) && (st = get_int(o, path, "pp", 1, 1 << 16, &v)) == FY_OK)
    p->pp = (int)v;
  k->pp = p->pp > 1 ? p->pp : 0;
  p->ep = 1;  // (optional: no expert parallelism when absent)
  if (st == FY_OK && json_object_object_get_ex(o, "ep", NULL) && (st = get_int(o, path, "ep", 1, 1 << 16, &v)) == FY_OK)
    p->ep = (int)v;
  if (st == FY_OK && p->ep > 1 && p->dp % p->ep)
    st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"ep\" is %d, which does not divide \"dp\" %d (an expert-parallel group is "
                      "ep of the data-parallel ranks)", path, p->ep, p->dp);
  k->ep = p->ep > 1 ? p->ep : 0;
  json_object *x;
  // (Optional: the cluster the plan was priced for; every link the probe's comm_gbps without it.)
  if (st == FY_OK && json_object_object_get_ex(o, "cluster", &x)) {
    json_object *y;
    const char *ik[] = {"nodes", "gpus_per_node"}, *dk[] = {"intra_gbps", "inter_gbps"};
    int *iv[] = {&k->cluster.nodes, &k->cluster.gpus_per_node};
    double *dv[] = {&k->cluster.intra_gbps, &k->cluster.inter_gbps};
    if (!json_object_is_type(x, json_type_object)) st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"cluster\" must be an object", path);
    for (int i = 0; i < 2 && st == FY_OK; i++)
      if ((st = get_int(x, path, ik[i], 1, 1 << 20, &v)) == FY_OK) *iv[i] = (int)v;
    for (int i = 0; i < 2 && st == FY_OK; i++) {
      if (!json_object_object_get_ex(x, dk[i], &y) ||
          !(json_object_is_type(y, json_type_double) || json_object_is_type(y, json_type_int)) ||
          !(json_object_get_double(y) > 0) || !isfinite(json_object_get_double(y)))
        st = fy_error_set(FY_ERR_FORMAT, "plan %s: cluster \"%s\" must be a positive number", path, dk[i]);
      else
        *dv[i] = json_object_get_double(y);
    }
  }
  if (st == FY_OK) {
    if (!json_object_object_get_ex(o, "recompute", &x) || !json_object_is_type(x, json_type_boolean))
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"recompute\" must be true or false", path);
    else
      k->recompute = json_object_get_boolean(x);
  }
  // (Optional: false, the master weights in host memory, when absent.)
  if (st == FY_OK && json_object_object_get_ex(o, "disk_master", &x)) {
    if (!json_object_is_type(x, json_type_boolean))
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"disk_master\" must be true or false", path);
    else
      k->disk_master = json_object_get_boolean(x);
  }
  // (Optional: plans written before resident ones existed are offloaded.)
  if (st == FY_OK && json_object_object_get_ex(o, "resident", &x)) {
    if (!json_object_is_type(x, json_type_boolean))
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"resident\" must be true or false", path);
    else
      k->resident = json_object_get_boolean(x);
  }
  // (Optional: plans written before it are for the device's default precision, bf16 on a GPU and
  // fp32 on cpu and sim.)
  if (st == FY_OK && json_object_object_get_ex(o, "precision", &x)) {
    const char *s = json_object_is_type(x, json_type_string) ? json_object_get_string(x) : NULL;
    enum fy_dtype dt;
    if (!fy_precision_dtype(s, &dt))
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"precision\" must be \"fp32\", \"bf16\" or \"fp16\"", path);
    else
      snprintf(k->precision, sizeof k->precision, "%s", s);
  }
  // (Optional: fp32 state when absent.)
  if (st == FY_OK && json_object_object_get_ex(o, "optimizer_state", &x)) {
    const char *s = json_object_is_type(x, json_type_string) ? json_object_get_string(x) : "";
    if (strcmp(s, "fp32") != 0 && strcmp(s, "bf16") != 0 && strcmp(s, "8bit") != 0)
      st = fy_error_set(FY_ERR_FORMAT, "plan %s: \"optimizer_state\" must be \"fp32\", \"bf16\" or \"8bit\"", path);
    else
      snprintf(k->optimizer_state, sizeof k->optimizer_state, "%s", s);
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

