// libFuzzer target: the checkpoint index, trainer.json (fy_ckpt_index_read), and the `latest`
// pointer (fy_ckpt_resolve): arbitrary JSON, wrong types, negative and huge numbers, pointers
// that try to leave the checkpoint root. Accepted metadata must hold non-negative counts.
#include "runtime/checkpoint.h"
#include "fuzz_common.h"

#include <sys/stat.h>

static char fz_root[256];

static void fz_root_cleanup(void) {
  char p[400];
  snprintf(p, sizeof p, "%s/trainer.json", fz_root);
  unlink(p);
  snprintf(p, sizeof p, "%s/latest", fz_root);
  unlink(p);
  rmdir(fz_root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!fz_root[0]) {
    const char *tmp = getenv("TMPDIR");
    snprintf(fz_root, sizeof fz_root, "%s/ferry-fuzz-ckpt-%d", tmp ? tmp : "/tmp", (int)getpid());
    if (mkdir(fz_root, 0700) != 0) abort();
    atexit(fz_root_cleanup);
  }
  // The first byte picks what the input is: the index, or the latest pointer.
  bool as_latest = size > 0 && data[0] == 'L';
  char p[400];
  snprintf(p, sizeof p, "%s/%s", fz_root, as_latest ? "latest" : "trainer.json");
  FILE *f = fopen(p, "wb");
  if (!f) abort();
  if (size > (size_t)as_latest) fwrite(data + as_latest, 1, size - as_latest, f);
  fclose(f);
  struct fy_ckpt_meta meta;
  if (as_latest) {
    char dir[512];
    if (fy_ckpt_resolve(fz_root, dir, sizeof dir) == FY_OK) {
      // A resolved step directory stays inside the root.
      if (strncmp(dir, fz_root, strlen(fz_root)) != 0 || strstr(dir + strlen(fz_root), "..")) abort();
    }
    unlink(p);
  } else if (fy_ckpt_index_read(fz_root, &meta) == FY_OK) {
    if (meta.step < 0 || meta.sequences < 0 || meta.updates < 0 || meta.updates > meta.step) abort();
  }
  return 0;
}
