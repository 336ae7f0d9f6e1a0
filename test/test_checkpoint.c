// Checkpoints and resume (runtime/checkpoint.h): resuming is exact; a run killed at any moment
// while writing leaves a checkpoint that loads and resumes; a full disk gives a clear error and
// keeps the previous checkpoint; export gives the weights back; bad checkpoints are refused, and
// so are damaged ones (a byte flipped: the checksums), naming the file and the checkpoint before.
// usage: test_checkpoint path/to/ferry     (the plain run)
//        test_checkpoint --part full-disk   (a full disk on a small tmpfs; exits 77 where mounting
//                                            one is not permitted)
#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "check.h"
#include "core/opt.h"
#include "core/safetensors.h"
#include "ops/ops.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/trainer.h"

static char dir[256], model_dir[300], shard[300];

static struct fy_train_opts base(void) {
  struct fy_train_opts o;
  fy_train_opts_defaults(&o);
  o.hash_params = true;  // runs are compared bit for bit
  o.model = model_dir;
  o.data = shard;
  o.batch = 2;
  o.seq = 16;
  o.steps = 10;
  o.lr = 3e-3f;
  o.warmup = 2;
  o.quiet = true;
  o.seed = 11;
  return o;
}

static void path(char *out, const char *name) { snprintf(out, 512, "%s/%s", dir, name); }

static bool last_by_chunk;  // how check_resume's checkpoint was written

// 10 steps straight against 5, a checkpoint, and 5 more resumed from it: bit for bit, the weights
// and the AdamW state (both runs save step 10: the same optimizer.safetensors, which holds m and v
// as the run stores them, and the same model.safetensors).
static void check_resume(const char *what, struct fy_train_opts o) {
  char root[512];
  snprintf(root, sizeof root, "%s/resume_%d", dir, rand());
  struct fy_train_result straight, first, second;
  o.steps = 10;
  char straight_root[600], second_root[600];
  snprintf(straight_root, sizeof straight_root, "%s_straight", root);
  snprintf(second_root, sizeof second_root, "%s_second", root);
  o.save = straight_root;  // (with the lag its checkpoints apply the pending update: the straight run writes them too)
  o.save_every = 5;
  CHECK_OK(fy_train(&o, &straight));
  o.stop_after = 5;  // interrupted after 5 of 10 steps
  o.save = root;
  o.save_every = 5;
  CHECK_OK(fy_train(&o, &first));
  CHECK(first.checkpoints == 1 && first.interrupted && first.steps == 5);
  last_by_chunk = first.ckpt_by_chunk;
  char sums[700];  // every writer (a snapshot, chunk by chunk, from disk) leaves the checksums
  snprintf(sums, sizeof sums, "%s/step-00000005/" FY_CKPT_SUMS, root);
  CHECKF(access(sums, R_OK) == 0, "%s: the checkpoint has no %s", what, FY_CKPT_SUMS);
  o.stop_after = 0;
  o.steps = 10;
  o.save = second_root;
  o.save_every = 5;
  o.resume = root;
  CHECK_OK(fy_train(&o, &second));
  CHECKF(second.first_step == 5 && second.steps == 10, "%s: resumed at %lld", what, (long long)second.first_step);
  CHECKF(second.last_loss == straight.last_loss && second.params_hash == straight.params_hash,
         "%s: resumed run ends at loss %.9g, straight %.9g", what, second.last_loss, straight.last_loss);
  char cmd[2000];
  snprintf(cmd, sizeof cmd, "cmp -s %s/step-00000010/optimizer.safetensors %s/step-00000010/optimizer.safetensors && "
           "cmp -s %s/step-00000010/model.safetensors %s/step-00000010/model.safetensors", straight_root, second_root,
           straight_root, second_root);
  CHECKF(system(cmd) == 0, "%s: the resumed run's AdamW state or weights at step 10 differ from the straight run's", what);
  fprintf(stderr, "  resume exact: %s\n", what);
}


// The step directory a run with options o writes after 3 steps under root.
static void save_3(struct fy_train_opts o, const char *root, char *step_dir, bool *by_chunk) {
  struct fy_train_result r;
  o.steps = 3;
  o.save = root;
  o.save_every = 3;
  CHECK_OK(fy_train(&o, &r));
  *by_chunk = r.ckpt_by_chunk;
  CHECK_OK(fy_ckpt_resolve(root, step_dir, 600));
}

// A checkpoint written chunk by chunk (o's host memory holds no snapshot) is the same bytes as
// one written from a snapshot (a host memory without a cap).
static void same_files_by_chunk(const char *what, struct fy_train_opts o) {
  char a[512], b[512], da[600], db[600], cmd[1400];
  snprintf(a, sizeof a, "%s/bychunk_%d", dir, rand());
  snprintf(b, sizeof b, "%s/snapshot_%d", dir, rand());
  bool ca, cb;
  save_3(o, a, da, &ca);
  o.host_mem = 0;
  save_3(o, b, db, &cb);
  CHECKF(ca && !cb, "%s: the checkpoints were not written one chunk by chunk, one from a snapshot", what);
  snprintf(cmd, sizeof cmd, "cmp -s %s/model.safetensors %s/model.safetensors && cmp -s %s/optimizer.safetensors "
           "%s/optimizer.safetensors && cmp -s %s/config.json %s/config.json", da, db, da, db, da, db);
  CHECKF(system(cmd) == 0, "%s: a checkpoint written chunk by chunk differs from one written from a snapshot", what);
  fprintf(stderr, "  same files chunk by chunk: %s\n", what);
}

// Flips the lowest bit of the byte in the middle of file name in directory d.
static void flip_middle(const char *d, const char *name) {
  char p[700];
  snprintf(p, sizeof p, "%s/%s", d, name);
  FILE *f = fopen(p, "r+b");
  CHECKF(f != NULL, "cannot open %s", p);
  if (!f) return;
  fseek(f, 0, SEEK_END);
  long mid = ftell(f) / 2;
  fseek(f, mid, SEEK_SET);
  int c = fgetc(f);
  fseek(f, mid, SEEK_SET);
  fputc(c ^ 1, f);
  fclose(f);
}

static void copy_tree(const char *from, const char *to) {
  char cmd[1400];
  snprintf(cmd, sizeof cmd, "rm -rf %s && cp -r %s %s", to, from, to);
  CHECK(system(cmd) == 0);
}

// st is a refusal of a damaged checkpoint whose message names bad and the previous checkpoint
// prev ("": none was left).
static void check_refused(const char *what, fy_status st, const char *bad, const char *prev) {
  char want[800];
  snprintf(want, sizeof want, "the previous complete checkpoint, %s, is intact", prev);
  const char *msg = fy_error_msg();
  bool named = strstr(msg, bad) && strstr(msg, " is damaged") &&
               (prev[0] ? strstr(msg, want) != NULL : strstr(msg, "no earlier complete checkpoint") != NULL);
  CHECKF(st == FY_ERR_FORMAT && named, "%s: %d %s", what, st, msg);
  fprintf(stderr, "  refused (%s): %s\n", what, msg);
}

// A byte flipped in the middle of a checkpoint's weights or AdamW state, which no parser notices,
// is refused by --resume, --init, ferry export and fy_ckpt_load, naming the file and the
// checkpoint before it; the untouched one resumes bit for bit, and so does one written before
// checksums (none recorded), with a note.
static void check_damage(void) {
  char good[512], dmg[512], prev[700], bad[700], out[512];
  path(good, "two");
  path(dmg, "damaged");
  path(out, "damaged_export");
  struct fy_train_result r, straight, resumed;
  struct fy_train_opts o = base();
  o.steps = 6;
  CHECK_OK(fy_train(&o, &straight));
  o.stop_after = 4;  // (of 6: the learning rate's schedule is the straight run's)
  o.save = good;
  o.save_every = 2;
  o.keep = 2;
  CHECK_OK(fy_train(&o, &r));
  CHECK(r.checkpoints == 2);
  o = base();
  o.steps = 6;
  o.resume = good;
  CHECK_OK(fy_train(&o, &resumed));
  CHECK(resumed.first_step == 4 && resumed.params_hash == straight.params_hash);

  const char *files[] = {"model.safetensors", "optimizer.safetensors"};
  struct fy_device *dev;
  struct fy_model *m;
  struct fy_opt_config cfg;
  CHECK_OK(fy_opt_config_read(model_dir, &cfg));
  CHECK_OK(fy_device_cpu_create(0, &dev));
  CHECK_OK(fy_model_create(&cfg, 1, 4, dev, &m));
  struct fy_ckpt_meta meta;
  for (int i = 0; i < 2; i++) {
    copy_tree(good, dmg);
    char step4[600];
    snprintf(step4, sizeof step4, "%s/step-00000004", dmg);
    snprintf(bad, sizeof bad, "%s/%s", step4, files[i]);
    snprintf(prev, sizeof prev, "%s/step-00000002", dmg);
    flip_middle(step4, files[i]);
    o = base();
    o.steps = 6;
    o.resume = dmg;
    check_refused("--resume", fy_train(&o, &r), bad, prev);
    o = base();
    o.steps = 1;
    o.init = dmg;
    check_refused("--init of the root", fy_train(&o, &r), bad, prev);
    o.init = step4;
    check_refused("--init of the step directory", fy_train(&o, &r), bad, prev);
    check_refused("ferry export", fy_export(dmg, out), bad, prev);
    check_refused("fy_ckpt_load", fy_ckpt_load(dmg, m, m->m, m->v, &meta), bad, prev);
    // The checkpoint named in its place resumes (steps 3 and 4 again, then 5 and 6).
    o = base();
    o.steps = 6;
    o.resume = prev;
    CHECK_OK(fy_train(&o, &r));
    CHECK(r.first_step == 2 && r.params_hash == straight.params_hash);
  }
  // The checkpoint before damaged too: none to name.
  flip_middle(prev, "model.safetensors");
  check_refused("export, both damaged", fy_export(dmg, out), bad, "");
  // The list of checksums lost while trainer.json names it: refused.
  copy_tree(good, dmg);
  snprintf(bad, sizeof bad, "%s/step-00000004/" FY_CKPT_SUMS, dmg);
  CHECK(unlink(bad) == 0);
  fy_status st = fy_ckpt_load(dmg, m, m->m, m->v, &meta);
  CHECKF(st == FY_ERR_NOT_FOUND && strstr(fy_error_msg(), FY_CKPT_SUMS " is missing"), "%d %s", st, fy_error_msg());
  // A checkpoint from before checksums (no list, trainer.json without "checksums") resumes bit for
  // bit, with a one-line note.
  char idx[700], note[600];
  snprintf(idx, sizeof idx, "%s/step-00000004/trainer.json", dmg);
  json_object *j = json_object_from_file(idx);
  CHECK(j && json_object_object_get_ex(j, "checksums", NULL));
  json_object_object_del(j, "checksums");
  CHECK(json_object_to_file_ext(idx, j, JSON_C_TO_STRING_PRETTY) == 0);
  json_object_put(j);
  path(note, "note.txt");
  fflush(stderr);
  int saved = dup(2), fd = open(note, O_CREAT | O_TRUNC | O_WRONLY, 0644);
  dup2(fd, 2);
  o = base();
  o.steps = 6;
  o.resume = dmg;
  st = fy_train(&o, &r);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  CHECKF(st == FY_OK && r.first_step == 4 && r.params_hash == straight.params_hash, "old format: %s", fy_error_msg());
  char text[4096] = {0};
  FILE *f = fopen(note, "r");
  size_t len = f ? fread(text, 1, sizeof text - 1, f) : 0;
  if (f) fclose(f);
  text[len] = 0;
  const char *at = strstr(text, "carries no checksums");
  CHECKF(at && !strstr(at + 1, "carries no checksums"), "the note on a checkpoint without checksums, once: '%s'", text);
  fprintf(stderr, "  damaged checkpoints refused; an old one resumes with: %s", text);
  fy_model_free(m);
  fy_device_free(dev);
}

// A full disk while writing: a clear error and the previous checkpoint intact, on a small tmpfs
// (its own part, `--part full-disk`: skipped where mounting one is not permitted).
static void test_full_disk(void) {
  char small[512], root[512];
  path(small, "small");
  mkdir(small, 0755);
  if (mount("tmpfs", small, "tmpfs", 0, "size=600k") != 0) {
    CHECK_SKIP("a full disk needs a small tmpfs, and mounting one is not permitted here (%s)", strerror(errno));
    return;
  }
  struct fy_train_opts o = base();
  struct fy_train_result rn;
  fy_status st;
  snprintf(root, sizeof root, "%s/ck", small);
  o.save = root;
  o.save_every = 1;
  o.steps = 6;
  st = fy_train(&o, &rn);
  CHECKF(st == FY_ERR_IO, "disk full: %d %s", st, fy_error_msg());
  fprintf(stderr, "  expected error: %s\n", fy_error_msg());
  struct fy_train_opts r2 = base();
  r2.resume = root;
  CHECK_OK(fy_train(&r2, &rn));  // the checkpoint that made it loads and resumes
  // The same when the checkpoints are written chunk by chunk (a host memory with no room for a
  // snapshot): the error, the temporary directory gone, the last complete checkpoint resumes.
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf %s", root);  // (room for one checkpoint again)
  CHECK(system(cmd) == 0);
  snprintf(root, sizeof root, "%s/ck2", small);
  o.device = "sim";
  o.device_mem = 4 << 20;
  o.chunk_mib = 0.05;
  o.save = NULL;
  o.save_every = 0;
  o.steps = 1;
  CHECK_OK(fy_train(&o, &rn));
  o.host_mem = (size_t)(1.25 * rn.host_tier_bytes);
  o.save = root;
  o.save_every = 1;
  o.steps = 6;
  st = fy_train(&o, &rn);
  CHECKF(st == FY_ERR_IO && rn.ckpt_by_chunk, "disk full, chunk by chunk: %d %s", st, fy_error_msg());
  fprintf(stderr, "  expected error: %s\n", fy_error_msg());
  r2 = o;
  r2.save = NULL;
  r2.save_every = 0;
  r2.resume = root;
  CHECK_OK(fy_train(&r2, &rn));
  snprintf(cmd, sizeof cmd, "ls -a %s | grep -q tmp", root);
  CHECKF(system(cmd) != 0, "a temporary checkpoint directory was left in %s", root);
  CHECK(umount(small) == 0);
}

// Rewrites step directory d's checksums from its files as they stand (a checkpoint edited by a
// test made to look as an older ferry wrote it, its list still valid).
static void rewrite_sums(const char *d) {
  char p[700], line[1024], text[8192] = "";
  snprintf(p, sizeof p, "%s/" FY_CKPT_SUMS, d);
  FILE *f = fopen(p, "r");
  CHECKF(f != NULL, "cannot read %s", p);
  if (!f) return;
  size_t len = 0;
  while (fgets(line, sizeof line, f)) {
    char name[512], fp[1300];
    if (sscanf(line, "%*32s  %511s", name) != 1) continue;
    snprintf(fp, sizeof fp, "%s/%s", d, name);
    FILE *g = fopen(fp, "rb");
    CHECKF(g != NULL, "cannot read %s", fp);
    if (!g) continue;
    fseek(g, 0, SEEK_END);
    long n = ftell(g);
    fseek(g, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    CHECK(buf && fread(buf, 1, (size_t)n, g) == (size_t)n);
    fclose(g);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(buf, (size_t)n));
    free(buf);
    for (int i = 0; i < 16; i++) len += (size_t)snprintf(text + len, sizeof text - len, "%02x", c.digest[i]);
    len += (size_t)snprintf(text + len, sizeof text - len, "  %s\n", name);
  }
  fclose(f);
  f = fopen(p, "w");
  fputs(text, f);
  fclose(f);
}

// The tensor data's bytes of safetensors file d/name (less its header).
static long data_bytes(const char *d, const char *name) {
  char p[700];
  snprintf(p, sizeof p, "%s/%s", d, name);
  FILE *f = fopen(p, "rb");
  uint64_t h = 0;
  long n = -1;
  if (f && fread(&h, 8, 1, f) == 1 && fseek(f, 0, SEEK_END) == 0) n = ftell(f) - 8 - (long)h;
  if (f) fclose(f);
  return n;
}

// A checkpoint holds AdamW's state as the run stores it: a model's bf16 and 8-bit state (random
// values over many magnitudes, a NaN, a zero parameter, values near float's smallest) written
// from the values it reads back as and read back, then stored again in the format: the same bytes
// (codes, scales, padding) as the state written. Read into a model of another layout (fp32 state,
// parameter groups 16-aligned instead of 256), each parameter reads back the same values. The
// files: BF16 tensors, or I8 and U8 codes with F32 scales, about 1/2 and 1/4 of fp32's bytes.
static void test_stored_state(const struct fy_opt_config *cfg) {
  struct fy_device *dev;
  CHECK_OK(fy_device_cpu_create(0, &dev));
  long bytes[3] = {0};
  for (int f = FY_STATE_F32; f <= FY_STATE_Q8; f++) {
    struct fy_model_opts mo = {.state_format = (enum fy_state_format)f};
    struct fy_model *m, *other;
    CHECK_OK(fy_model_create_with(cfg, 1, 4, dev, &mo, &m));
    CHECK_OK(fy_model_create(cfg, 1, 4, dev, &other));
    const struct fy_graph *g = m->graph;
    const int64_t n = g->n_param_elems;
    const size_t sb = fy_state_moment_bytes((enum fy_state_format)f, n);
    float *val[2], *back[2], *oth[2];
    void *state[2], *again[2];
    for (int k = 0; k < 2; k++) {
      val[k] = calloc((size_t)n, 4);
      back[k] = calloc((size_t)n, 4);
      oth[k] = calloc((size_t)other->graph->n_param_elems, 4);
      state[k] = calloc(sb, 1);
      again[k] = calloc(sb, 1);
    }
    srand(17);
    for (int i = 0; i < g->n_params; i++) {
      const struct fy_param *p = &g->params[i];
      for (int64_t e = 0; e < p->numel; e++) {
        double x = ((double)rand() / RAND_MAX - 0.5) * pow(10.0, -(double)(i % 9) - 4.0 * (double)((e / 200) % 3));
        if (i == 1) x = 0;                 // a parameter of zeros
        if (i == 2) x *= 1e-30;            // near float's smallest (and i == 4's v, below)
        val[0][p->offset + e] = (float)x;
        val[1][p->offset + e] = (float)(x * x * (1.0 + (double)rand() / RAND_MAX) * (i == 4 ? 1e-28 : 1.0));
      }
      if (i == 3) val[0][p->offset + p->numel / 2] = NAN;  // a block that reads back NaN
    }
    for (int k = 0; k < 2; k++) fy_state_encode((enum fy_state_format)f, (enum fy_moment)k, state[k], val[k], n);
    char root[512], sd[600];
    snprintf(root, sizeof root, "%s/stored_%s", dir, fy_state_format_name((enum fy_state_format)f));
    struct fy_ckpt_writer *w;
    CHECK_OK(fy_ckpt_writer_create(root, 1, m, &w));
    struct fy_ckpt_snapshot *s = fy_ckpt_snapshot_buffers(w);
    CHECK(s != NULL);
    memcpy(s->params, m->params, (size_t)n * 4);
    fy_state_decode((enum fy_state_format)f, FY_MOMENT_M, s->m, state[0], n);
    fy_state_decode((enum fy_state_format)f, FY_MOMENT_V, s->v, state[1], n);
    s->meta = (struct fy_ckpt_meta){.step = 1, .seed = 1, .loss_scale = 1, .updates = 1};
    snprintf(s->meta.optimizer_state, sizeof s->meta.optimizer_state, "%s", fy_state_format_name((enum fy_state_format)f));
    CHECK_OK(fy_ckpt_write_async(w));
    CHECK_OK(fy_ckpt_wait(w));
    fy_ckpt_writer_free(w);
    struct fy_ckpt_meta meta;
    CHECK_OK(fy_ckpt_load(root, m, back[0], back[1], &meta));
    CHECK(strcmp(meta.optimizer_state, fy_state_format_name((enum fy_state_format)f)) == 0);
    for (int k = 0; k < 2; k++) fy_state_encode((enum fy_state_format)f, (enum fy_moment)k, again[k], back[k], n);
    CHECKF(memcmp(again[0], state[0], sb) == 0 && memcmp(again[1], state[1], sb) == 0,
           "%s state: a checkpoint's m and v, stored again, differ from the state written",
           fy_state_format_name((enum fy_state_format)f));
    CHECK_OK(fy_ckpt_load(root, other, oth[0], oth[1], &meta));
    int differ = 0;
    for (int i = 0; i < g->n_params; i++)
      for (int k = 0; k < 2; k++)
        differ += memcmp(back[k] + g->params[i].offset, oth[k] + other->graph->params[i].offset,
                         (size_t)g->params[i].numel * 4) != 0;
    CHECKF(differ == 0, "%s state: %d tensors read into another layout differ", fy_state_format_name((enum fy_state_format)f),
           differ);
    CHECK_OK(fy_ckpt_resolve(root, sd, sizeof sd));
    fy_safetensors *st;
    char opath[700];
    snprintf(opath, sizeof opath, "%s/optimizer.safetensors", sd);
    CHECK_OK(fy_safetensors_open(opath, &st));
    char name[200];
    snprintf(name, sizeof name, "exp_avg.%s", g->params[0].name);
    const struct fy_st_tensor *tm = fy_safetensors_find(st, name);
    snprintf(name, sizeof name, "exp_avg_sq.%s", g->params[0].name);
    const struct fy_st_tensor *tv = fy_safetensors_find(st, name);
    snprintf(name, sizeof name, "exp_avg_absmax.%s", g->params[0].name);
    const struct fy_st_tensor *ts = fy_safetensors_find(st, name);
    const enum fy_dtype want_m = f == FY_STATE_Q8 ? FY_I8 : f == FY_STATE_BF16 ? FY_BF16 : FY_F32;
    const enum fy_dtype want_v = f == FY_STATE_Q8 ? FY_U8 : want_m;
    CHECKF(tm && tv && tm->dtype == want_m && tv->dtype == want_v && (f == FY_STATE_Q8) == (ts != NULL),
           "%s state: optimizer.safetensors does not hold the format's tensors", fy_state_format_name((enum fy_state_format)f));
    fy_safetensors_close(st);
    bytes[f] = data_bytes(sd, "optimizer.safetensors");
    for (int k = 0; k < 2; k++) {
      free(val[k]);
      free(back[k]);
      free(oth[k]);
      free(state[k]);
      free(again[k]);
    }
    fy_model_free(m);
    fy_model_free(other);
  }
  const double params = (double)fy_opt_num_params(cfg);
  fprintf(stderr, "  optimizer.safetensors' tensor data for %.0f parameters: fp32 %ld bytes (%.2f a parameter), bf16 "
          "%ld (%.2f), 8bit %ld (%.2f)\n", params, bytes[0], bytes[0] / params, bytes[1],
          bytes[1] / params, bytes[2], bytes[2] / params);
  CHECK(bytes[0] == (long)(8 * params) && bytes[1] == (long)(4 * params) && bytes[2] < 0.3 * bytes[0]);
  fy_device_free(dev);
}

int main(int argc, char **argv) {
  check_args(argc, argv);
  const char *ferry = argc > 1 && strcmp(argv[1], "--part") ? argv[1] : NULL;
  srand((unsigned)time(NULL));
  snprintf(dir, sizeof dir, "/tmp/ferry_ckpt_XXXXXX");
  if (!mkdtemp(dir)) return 1;
  path(model_dir, "model");
  path(shard, "data.bin");
  mkdir(model_dir, 0755);
  struct fy_opt_config cfg;
  fy_opt_preset("opt-tiny", &cfg);
  cfg.num_hidden_layers = 3;
  CHECK_OK(fy_opt_config_write(model_dir, &cfg));
  uint16_t tok[20000];
  for (int i = 0; i < 20000; i++) tok[i] = (uint16_t)((i * 13 + i / 5) % 97);
  CHECK_OK(fy_shard_write(shard, tok, 20000));
  if (check_part("full-disk")) test_full_disk();
  if (!check_plain()) {
    char rm[300];
    snprintf(rm, sizeof rm, "rm -rf %s", dir);
    CHECK(system(rm) == 0);
    return check_summary("checkpoint");
  }

  struct fy_train_opts o = base();
  check_resume("cpu", o);
  o.grad_accum = 2;
  o.batch = 1;
  check_resume("cpu, 2 micro-batches", o);
  o = base();
  o.device = "sim";
  o.device_mem = 4 << 20;
  o.chunk_mib = 0.05;
  o.blocks = 2;
  check_resume("sim, eviction", o);
  o.precision = "bf16";  // the chunks' bf16 copies are rebuilt from the resumed master weights
  check_resume("sim bf16, eviction", o);
  o.device_chunks = 2;  // ... and the device's chunks take the resumed master and its bf16 copy
  check_resume("sim bf16, 2 chunks updated on the device", o);
  o.precision = NULL;
  check_resume("sim, 2 chunks updated on the device", o);
  o.precision = "bf16";  // --optimizer-lag: the checkpoint holds every update, and resumes exactly
  o.optimizer_lag = 1;
  check_resume("sim bf16 lag 1, 2 chunks updated on the device", o);
  o.device_chunks = 0;
  check_resume("sim bf16 lag 1", o);
  o.optimizer_lag = 0;
  o.precision = NULL;
  CHECK(!last_by_chunk);  // a snapshot fits: checkpoints are written in the background
  // A host memory that holds the state but not a snapshot of it as well: the checkpoints are
  // written chunk by chunk from where the state lives (training waits), and resume exactly.
  {
    struct fy_train_result r;
    struct fy_train_opts q = o;
    q.steps = 1;
    CHECK_OK(fy_train(&q, &r));
    o.host_mem = (size_t)(1.25 * r.host_tier_bytes);
    check_resume("sim, checkpoints written chunk by chunk", o);
    CHECKF(last_by_chunk, "a host tier of %zu bytes (state %.0f) still took a snapshot", o.host_mem, r.host_tier_bytes);
    o.precision = "bf16";
    check_resume("sim bf16, checkpoints written chunk by chunk", o);
    CHECK(last_by_chunk);
    o.device_chunks = 2;  // chunks whose state lives on the device
    check_resume("sim bf16, 2 chunks on the device, checkpoints written chunk by chunk", o);
    CHECK(last_by_chunk);
    same_files_by_chunk("sim bf16, 2 chunks on the device", o);
    o.precision = NULL;
    o.device_chunks = 0;
    o.host_mem = 0;
  }
  char disk[512];
  path(disk, "disk");
  mkdir(disk, 0755);
  o.disk_dir = disk;
  o.disk_chunks = 100;
  check_resume("sim, gradients and AdamW state on disk", o);
  {  // on disk and in a small host tier: chunk by chunk from the disk
    struct fy_train_result r;
    struct fy_train_opts q = o;
    q.steps = 1;
    CHECK_OK(fy_train(&q, &r));
    o.host_mem = (size_t)(r.host_tier_bytes + 6.0 * (double)fy_opt_num_params(&cfg));  // half a snapshot
    check_resume("sim, AdamW state on disk, checkpoints written chunk by chunk", o);
    CHECK(last_by_chunk);
    same_files_by_chunk("sim, AdamW state on disk", o);
    o.host_mem = 0;
    // 16-bit: a disk chunk's slot holds m and v alone (the gradients come home over the copy).
    q = o;
    q.precision = "bf16";
    check_resume("sim bf16, AdamW state on disk", q);
    q.disk_master = true;  // the master weights there too: checkpoints read them, a resume writes them
    check_resume("sim bf16, master weights on disk", q);
    q.optimizer_lag = 1;   // (the pending update applied to them before each checkpoint)
    check_resume("sim bf16 lag 1, master weights on disk", q);
    q.optimizer_lag = 0;
    q.disk_master = false;
    q.spec_chunks = 1000;  // (the engine keeps every chunk's master, swapped with spare slots)
    check_resume("sim bf16 speculative updates, AdamW state on disk", q);
    q.spec_chunks = 0;
    q.device_updates = 1000;  // (the host chunks' state read back from the device before a checkpoint)
    check_resume("sim bf16 device updates, AdamW state on disk", q);
    q.device_updates = 0;
    q.steps = 1;
    CHECK_OK(fy_train(&q, &r));
    q.steps = o.steps;
    q.host_mem = (size_t)(r.host_tier_bytes + 6.0 * (double)fy_opt_num_params(&cfg));
    check_resume("sim bf16, AdamW state on disk, checkpoints written chunk by chunk", q);
    CHECK(last_by_chunk);
    same_files_by_chunk("sim bf16, AdamW state on disk", q);
  }

  // A checkpoint saved with one placement resumes under another (per-parameter storage).
  char root[512];
  path(root, "cross");
  struct fy_train_result a, b, straight;
  o = base();
  CHECK_OK(fy_train(&o, &straight));
  o.stop_after = 5;
  o.save = root;
  o.save_every = 5;
  o.device = "sim";
  o.device_mem = 4 << 20;
  o.chunk_mib = 0.05;
  CHECK_OK(fy_train(&o, &a));
  o = base();
  o.resume = root;
  CHECK_OK(fy_train(&o, &b));
  CHECK(b.params_hash == straight.params_hash);

  // --optimizer-state bf16 and 8bit: a checkpoint holds the values the stored state reads back as
  // (f32 tensors) and says the format; the same format stores them again to the same bits, so a
  // resume is exact on the cpu and under every placement (host chunks with eviction, device and
  // disk chunks, checkpoints written chunk by chunk, 16-bit compute, the lag).
  {
    const char *fmts[] = {"bf16", "8bit"};
    for (int f = 0; f < 2; f++) {
      char what[160];
      struct fy_train_opts q = base();
      q.optimizer_state = fmts[f];
      snprintf(what, sizeof what, "cpu, %s state", fmts[f]);
      check_resume(what, q);
      q.device = "sim";
      q.device_mem = 4 << 20;
      q.chunk_mib = 0.05;
      q.blocks = 2;
      snprintf(what, sizeof what, "sim, eviction, %s state", fmts[f]);
      check_resume(what, q);
      q.precision = "bf16";
      q.device_chunks = 1;
      q.disk_dir = dir;
      q.disk_chunks = 1;
      snprintf(what, sizeof what, "sim bf16, a device chunk and a disk chunk, %s state", fmts[f]);
      check_resume(what, q);
      q.optimizer_lag = 1;
      snprintf(what, sizeof what, "sim bf16 lag 1, a device chunk and a disk chunk, %s state", fmts[f]);
      check_resume(what, q);
      q.optimizer_lag = 0;
      q.device_chunks = 0;
      q.disk_dir = NULL;
      q.disk_chunks = -1;
      struct fy_train_result one;
      struct fy_train_opts p1 = q;
      p1.steps = 1;
      CHECK_OK(fy_train(&p1, &one));
      q.host_mem = (size_t)(1.25 * one.host_tier_bytes);  // no room for a snapshot: chunk by chunk
      snprintf(what, sizeof what, "sim bf16, checkpoints written chunk by chunk, %s state", fmts[f]);
      check_resume(what, q);
      CHECK(last_by_chunk);
    }
    // trainer.json says the format; a resume in another format converts, warns and trains on.
    char root8[512], sd[600], line[4096];
    path(root8, "state8");
    struct fy_train_opts q = base();
    q.optimizer_state = "8bit";
    q.stop_after = 5;
    q.save = root8;
    q.save_every = 5;
    struct fy_train_result r8, rc;
    CHECK_OK(fy_train(&q, &r8));
    CHECK_OK(fy_ckpt_resolve(root8, sd, sizeof sd));
    snprintf(line, sizeof line, "grep -Eq '\"optimizer_state\": *\"8bit\"' %s/trainer.json", sd);
    CHECKF(system(line) == 0, "%s/trainer.json does not say the 8-bit format", sd);
    char rootb[512];  // (and a bf16 one, resumed in 8-bit)
    path(rootb, "stateb");
    q.optimizer_state = "bf16";
    q.save = rootb;
    struct fy_train_result rb;
    CHECK_OK(fy_train(&q, &rb));
    const char *to[] = {"fp32", "bf16", "8bit"}, *from[] = {"8bit", "8bit", "bf16"}, *froms[] = {root8, root8, rootb};
    for (int k = 0; k < 3; k++) {
      struct fy_train_opts c = base();
      c.optimizer_state = to[k];
      c.resume = froms[k];
      c.device = k ? "sim" : NULL;
      c.device_mem = 4 << 20;
      c.chunk_mib = 0.05;
      char errf[512];
      path(errf, "convert.err");
      fflush(stderr);
      int saved = dup(2), fd = open(errf, O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 2);
      fy_status st = fy_train(&c, &rc);
      fflush(stderr);
      dup2(saved, 2);
      close(saved);
      close(fd);
      CHECKF(st == FY_OK && rc.first_step == 5 && rc.last_loss < r8.first_loss, "resume %s -> %s: %s", from[k], to[k],
             st == FY_OK ? "ok" : fy_error_msg());
      snprintf(line, sizeof line, "grep -q 'stored as %s and this run stores it as %s' %s", from[k], to[k], errf);
      CHECKF(system(line) == 0, "resume %s -> %s: no warning that the state is converted", from[k], to[k]);
    }
    fprintf(stderr, "  resume in another state format: converted with a warning\n");

    // A checkpoint of an 8-bit run as ferry wrote them before they held the codes (m and v as f32
    // values, trainer.json saying 8bit) still resumes, and exactly: the values store to the run's
    // codes again. Made from root8: its values written as an fp32 checkpoint (a model of another
    // layout), trainer.json then saying 8bit, the checksums made again.
    struct fy_device *cdev;
    struct fy_model *cm;
    CHECK_OK(fy_device_cpu_create(0, &cdev));
    CHECK_OK(fy_model_create(&cfg, 1, 4, cdev, &cm));
    struct fy_ckpt_meta meta8;
    CHECK_OK(fy_ckpt_load(root8, cm, cm->m, cm->v, &meta8));
    char old8[512], sdo[600];
    path(old8, "state8_f32");
    struct fy_ckpt_writer *cw;
    CHECK_OK(fy_ckpt_writer_create(old8, 1, cm, &cw));
    struct fy_ckpt_snapshot *snap = fy_ckpt_snapshot_buffers(cw);
    CHECK(snap != NULL);
    const size_t nb = (size_t)cm->graph->n_param_elems * 4;
    memcpy(snap->params, cm->params, nb);
    memcpy(snap->m, cm->m, nb);
    memcpy(snap->v, cm->v, nb);
    snap->meta = meta8;
    snprintf(snap->meta.optimizer_state, sizeof snap->meta.optimizer_state, "fp32");
    CHECK_OK(fy_ckpt_write_async(cw));
    CHECK_OK(fy_ckpt_wait(cw));
    fy_ckpt_writer_free(cw);
    fy_model_free(cm);
    fy_device_free(cdev);
    CHECK_OK(fy_ckpt_resolve(old8, sdo, sizeof sdo));
    CHECK_OK(fy_ckpt_index_write(sdo, &meta8));  // (says 8bit)
    rewrite_sums(sdo);
    snprintf(line, sizeof line, "grep -Eq '\"optimizer_state\": *\"8bit\"' %s/trainer.json", sdo);
    CHECKF(system(line) == 0, "%s/trainer.json does not say 8bit", sdo);
    char s8[512], r8o[512];
    path(s8, "state8_straight");
    path(r8o, "state8_f32_resumed");
    struct fy_train_opts q8 = base();
    q8.optimizer_state = "8bit";
    q8.save = s8;
    q8.save_every = 5;
    struct fy_train_result st8, ro8;
    CHECK_OK(fy_train(&q8, &st8));
    q8.save = r8o;
    q8.resume = old8;
    CHECK_OK(fy_train(&q8, &ro8));
    snprintf(line, sizeof line, "cmp -s %s/step-00000010/optimizer.safetensors %s/step-00000010/optimizer.safetensors",
             s8, r8o);
    CHECKF(ro8.first_step == 5 && ro8.params_hash == st8.params_hash && system(line) == 0,
           "an 8-bit checkpoint holding f32 values (before the codes) does not resume exactly");
    CHECKF(data_bytes(sdo, "optimizer.safetensors") > 3 * data_bytes(sd, "optimizer.safetensors"),
           "the f32 checkpoint's AdamW state is not the larger (%ld bytes against the 8-bit one's %ld)",
           data_bytes(sdo, "optimizer.safetensors"), data_bytes(sd, "optimizer.safetensors"));
    fprintf(stderr, "  an 8-bit checkpoint of f32 values (an older ferry's) resumes exactly\n");
  }
  test_stored_state(&cfg);

  // Export: a Hugging Face directory with the checkpoint's weights.
  char out[512], sdir[600];
  path(out, "exported");
  CHECK_OK(fy_export(root, out));
  CHECK_OK(fy_ckpt_resolve(root, sdir, sizeof sdir));
  struct fy_device *dev;
  CHECK_OK(fy_device_cpu_create(0, &dev));
  struct fy_model *m1, *m2;
  CHECK_OK(fy_model_create(&cfg, 1, 4, dev, &m1));
  CHECK_OK(fy_model_create(&cfg, 1, 4, dev, &m2));
  CHECK_OK(fy_model_load(m1, out));
  struct fy_ckpt_meta meta;
  CHECK_OK(fy_ckpt_load(root, m2, m2->m, m2->v, &meta));
  CHECK(meta.step == 5 && meta.sequences == 10);
  CHECK(memcmp(m1->params, m2->params, (size_t)m1->graph->n_param_elems * 4) == 0);
  CHECK_ERR(fy_export("/nonexistent", out), FY_ERR_NOT_FOUND);

  // Bad checkpoints.
  char bad[512], p[700];
  path(bad, "bad");
  snprintf(p, sizeof p, "cp -r %s %s", sdir, bad);
  CHECK(system(p) == 0);
  snprintf(p, sizeof p, "%s/" FY_CKPT_SUMS, bad);  // (trainer.json edited by hand: a checkpoint without checksums)
  CHECK(unlink(p) == 0);
  snprintf(p, sizeof p, "%s/trainer.json", bad);
  FILE *f = fopen(p, "w");
  fputs("{\"format\": \"ferry-checkpoint\", \"step\": \"five\", \"sequences\": 10}", f);
  fclose(f);
  CHECK_ERR(fy_ckpt_load(bad, m2, m2->m, m2->v, &meta), FY_ERR_FORMAT);
  // AdamW's update count: at most the steps; an index from before the field counts every step.
  f = fopen(p, "w");
  fputs("{\"format\": \"ferry-checkpoint\", \"step\": 5, \"sequences\": 10, \"adamw_updates\": 6}", f);
  fclose(f);
  CHECK_ERR(fy_ckpt_load(bad, m2, m2->m, m2->v, &meta), FY_ERR_FORMAT);
  f = fopen(p, "w");
  fputs("{\"format\": \"ferry-checkpoint\", \"step\": 5, \"sequences\": 10, \"adamw_updates\": 3}", f);
  fclose(f);
  CHECK_OK(fy_ckpt_load(bad, m2, m2->m, m2->v, &meta));
  CHECK(meta.step == 5 && meta.updates == 3);
  f = fopen(p, "w");
  fputs("{\"format\": \"ferry-checkpoint\", \"step\": 5, \"sequences\": 10}", f);
  fclose(f);
  CHECK_OK(fy_ckpt_load(bad, m2, m2->m, m2->v, &meta));
  CHECK(meta.updates == 5);
  snprintf(p, sizeof p, "%s/optimizer.safetensors", bad);
  f = fopen(p, "r+");
  fseek(f, 0, SEEK_END);
  CHECK(ftruncate(fileno(f), ftell(f) - 64) == 0);
  fclose(f);
  CHECK_ERR(fy_ckpt_load(bad, m2, m2->m, m2->v, &meta), FY_ERR_FORMAT);
  snprintf(p, sizeof p, "%s/latest", bad);
  f = fopen(p, "w");
  fputs("../../etc\n", f);
  fclose(f);
  CHECK_ERR(fy_ckpt_load(bad, m2, m2->m, m2->v, &meta), FY_ERR_FORMAT);
  CHECK_ERR(fy_ckpt_load(model_dir, m2, m2->m, m2->v, &meta), FY_ERR_NOT_FOUND);
  fy_model_free(m1);
  fy_model_free(m2);
  fy_device_free(dev);

  check_damage();

  // A loss that turns non-finite stops with the step and the operator named; the last good
  // checkpoint stays.
  o = base();
  o.lr = 1e30f;
  path(root, "nan");
  o.save = root;
  o.save_every = 1;
  o.adamw.clip = 0;
  struct fy_train_result rn;
  fy_status st = fy_train(&o, &rn);
  CHECKF(st == FY_ERR_NUMERIC && strstr(fy_error_msg(), "output of"), "%d: %s", st, fy_error_msg());
  fprintf(stderr, "  expected error: %s\n", fy_error_msg());
  CHECK(fy_ckpt_resolve(root, sdir, sizeof sdir) == FY_OK);
  struct fy_device *dev2;
  struct fy_model *m3;
  CHECK_OK(fy_device_cpu_create(0, &dev2));
  CHECK_OK(fy_model_create(&cfg, 1, 4, dev2, &m3));
  CHECK_OK(fy_ckpt_load(root, m3, m3->m, m3->v, &meta));
  int finite = 1;
  for (int64_t i = 0; i < m3->graph->n_param_elems; i++) finite &= isfinite(m3->params[i]) != 0;
  CHECKF(finite && meta.step < rn.steps + 1, "the kept checkpoint (step %lld) holds finite weights", (long long)meta.step);
  fy_model_free(m3);
  fy_device_free(dev2);

  // Killed at random moments while checkpointing every step: a checkpoint always loads.
  if (ferry) {
    path(root, "killed");
    char steps[16];
    int survived = 0;
    for (int i = 0; i < 12; i++) {
      snprintf(steps, sizeof steps, "%d", 1000);
      pid_t pid = fork();
      char sd0[600];
      bool have = fy_ckpt_resolve(root, sd0, sizeof sd0) == FY_OK;
      if (pid == 0) {
        int devnull = open("/dev/null", 1);
        dup2(devnull, 1);
        dup2(devnull, 2);
        const char *args[] = {ferry, "train", "--model", model_dir, "--data", shard, "--batch", "2", "--seq", "16",
                              "--steps", steps, "--save", root, "--save-every", "1", "--threads", "1", "--quiet",
                              have ? "--resume" : NULL, root, NULL};
        execv(ferry, (char *const *)args);
        _exit(127);
      }
      struct timespec ts = {0, (long)(50 + rand() % 400) * 1000000L};
      nanosleep(&ts, NULL);
      // (On a loaded machine the run may not have written its first checkpoint yet: the first kill
      // waits for one, up to a minute, so that some kill always lands after a checkpoint.)
      char sdk[600];
      for (int w = 0; !have && survived == 0 && w < 6000 && fy_ckpt_resolve(root, sdk, sizeof sdk) != FY_OK; w++)
        nanosleep(&(struct timespec){0, 10000000L}, NULL);
      kill(pid, SIGKILL);
      int status;
      waitpid(pid, &status, 0);
      struct fy_train_opts r3 = base();
      r3.resume = root;
      r3.steps = 0;  // load only
      char sd[600];
      if (fy_ckpt_resolve(root, sd, sizeof sd) != FY_OK) continue;  // killed before the first
      struct fy_train_result rr;
      r3.steps = 100000;
      r3.stop = &(atomic_int){1};  // one step after loading, then stop
      fy_status s3 = fy_train(&r3, &rr);
      CHECKF(s3 == FY_OK, "after kill %d: %s", i, fy_error_msg());
      survived += s3 == FY_OK;
    }
    fprintf(stderr, "  %d kills during checkpointing, every checkpoint left resumed\n", survived);
    CHECK(survived > 0);
  }

  fy_matmul_cache_clear();
  snprintf(p, sizeof p, "rm -rf %s", dir);
  CHECK(system(p) == 0);
  return check_summary("checkpoint");
}
