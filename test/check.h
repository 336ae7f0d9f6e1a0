// A minimal test harness: CHECK records a failure and goes on; a test program returns
// check_summary() from main, which prints the counts and is non-zero when anything failed.
#ifndef FY_TEST_CHECK_H
#define FY_TEST_CHECK_H

#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int check_failed_ = 0, check_total_ = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    check_total_++;                                                          \
    if (!(cond)) {                                                           \
      check_failed_++;                                                       \
      fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);        \
    }                                                                        \
  } while (0)

#define CHECKF(cond, ...)                                                    \
  do {                                                                       \
    check_total_++;                                                          \
    if (!(cond)) {                                                           \
      check_failed_++;                                                       \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
      fprintf(stderr, __VA_ARGS__);                                          \
      fputc('\n', stderr);                                                   \
    }                                                                        \
  } while (0)

// A call returning fy_status that must succeed; prints the library's message if not.
#define CHECK_OK(expr)                                                       \
  do {                                                                       \
    check_total_++;                                                          \
    fy_status st_ = (expr);                                                  \
    if (st_ != FY_OK) {                                                      \
      check_failed_++;                                                       \
      fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #expr, fy_error_msg()); \
    }                                                                        \
  } while (0)

// A call that must fail with `want`; its message is printed so a reader sees what users see.
#define CHECK_ERR(expr, want)                                                \
  do {                                                                       \
    check_total_++;                                                          \
    fy_status st_ = (expr);                                                  \
    if (st_ != (want)) {                                                     \
      check_failed_++;                                                       \
      fprintf(stderr, "FAIL %s:%d: %s returned %d, wanted %d\n", __FILE__, __LINE__, #expr, \
              (int)st_, (int)(want));                                        \
    } else {                                                                 \
      fprintf(stderr, "  expected error: %s\n", fy_error_msg());             \
    }                                                                        \
  } while (0)

// Normalised error ||a - b|| / max(||b||, tiny), the measure of docs/design.md's op tests.
static inline double check_rel_err(const float *a, const float *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)a[i] - (double)b[i];
    num += d * d;
    den += (double)b[i] * (double)b[i];
  }
  return sqrt(num) / (den > 1e-30 ? sqrt(den) : 1e-15);
}

// Random test data: one xorshift64* stream per test program (the same sequence every run).
static uint64_t check_rng_ = 0x243F6A8885A308D3ull;
static inline double check_urand(void) {  // [0, 1)
  check_rng_ ^= check_rng_ >> 12;
  check_rng_ ^= check_rng_ << 25;
  check_rng_ ^= check_rng_ >> 27;
  return (double)((check_rng_ * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53;
}
static inline float check_frand(float scale) { return (float)((2.0 * check_urand() - 1.0) * scale); }  // (-scale, scale)
static inline float *check_fnew(int64_t n) {  // zeroed; aborts when out of memory
  float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
  if (!p) abort();
  return p;
}

// Scratch space for tests: a path under a directory (a ring of buffers, so that several may be live
// at once) and removing a tree (directories made writable first, for tests that take permissions
// away).
static inline const char *check_path(const char *dir, const char *name) {
  static char buf[8][512];
  static int k;
  char *p = buf[k++ % 8];
  snprintf(p, sizeof buf[0], "%s/%s", dir, name);
  return p;
}

static inline void check_rm_rf(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *de;
  char p[1024];
  while ((de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
    struct stat sb;
    if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode)) {
      chmod(p, 0755);
      check_rm_rf(p);
    } else {
      unlink(p);
    }
  }
  closedir(d);
  rmdir(dir);
}

// A program's parts that do not belong in its plain run are meson tests of their own
// (test/meson.build): `test_x --part NAME` runs part NAME alone, and the plain run (no --part)
// runs the rest. Two kinds:
// - a part that not every machine allows (mounting a tmpfs, NUMA binding, a user whom permissions
//   stop): where it cannot run it says why with CHECK_SKIP, and the program exits 77, which meson
//   (and test.sh, reading meson's log) counts as skipped rather than passed;
// - the part "timing" (meson suite "timing"): the checks that hold this machine to rates and
//   times (predicted against measured steps, probe rates, overlap), which a loaded machine can
//   fail; test.sh runs and reports them apart, outside its count. The plain run keeps what is
//   deterministic about the same features.
// A plain run never skips: what may be skipped is a part of its own.
static const char *check_part_ = NULL;  // the --part asked for; NULL in the plain run
static int check_part_seen_ = 0, check_skipped_ = 0;

static inline void check_args(int argc, char **argv) {
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--part")) check_part_ = argv[i + 1];
}
// Whether this is the plain run.
static inline int check_plain(void) { return check_part_ == NULL; }
// Whether this run is part `name` (a program asks for each of its parts, so that a --part it
// does not have fails instead of passing with no checks).
static inline int check_part(const char *name) {
  if (!check_part_ || strcmp(check_part_, name)) return 0;
  check_part_seen_ = 1;
  return 1;
}
// This machine does not allow the part: says why; the program then exits 77.
#define CHECK_SKIP(...)                                                      \
  do {                                                                       \
    check_skipped_++;                                                        \
    fprintf(stderr, "  skipped: ");                                          \
    fprintf(stderr, __VA_ARGS__);                                            \
    fputc('\n', stderr);                                                     \
  } while (0)

static inline int check_summary(const char *name) {
  if (check_part_ && !check_part_seen_) {
    fprintf(stderr, "%s: no part named '%s'\n", name, check_part_);
    return 1;
  }
  if (check_skipped_ && !check_part_) {
    fprintf(stderr, "%s: the plain run skipped something: that belongs in a part of its own\n", name);
    return 1;
  }
  fprintf(stderr, "%s%s%s: %d checks, %d failed%s\n", name, check_part_ ? " --part " : "",
          check_part_ ? check_part_ : "", check_total_, check_failed_, check_skipped_ ? ", skipped" : "");
  if (check_failed_) return 1;
  return check_skipped_ ? 77 : 0;
}

#endif
