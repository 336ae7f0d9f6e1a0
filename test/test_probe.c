// The hardware probe: a measurement on the sim device (throttled link, a disk directory) gives
// plausible values quickly; the JSON file round-trips bit for bit; overrides parse sizes, rates and
// shorthands and name bad keys and values; malformed files are FY_ERR_FORMAT naming the key and
// the file; the default path follows $FERRY_PROBE, $XDG_CACHE_HOME, $HOME.
// usage: test_probe                  (the plain run)
//        test_probe --part timing    (the probe's time and rates held to this machine)
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "core/clock.h"
#include "core/status.h"
#include "ops/ops.h"
#include "planner/probe.h"

static char tmpdir[] = "/tmp/ferry-probe-test-XXXXXX";

static int msg_has(const char *s) { return strstr(fy_error_msg(), s) != NULL; }

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  CHECK(f != NULL);
  if (!f) return;
  fputs(text, f);
  fclose(f);
}

static int probe_equal(const struct fy_probe *a, const struct fy_probe *b) {
  return !strcmp(a->device, b->device) && a->device_mem == b->device_mem &&
         a->host_mem == b->host_mem && a->device_gflops == b->device_gflops &&
         a->host_gflops == b->host_gflops && a->h2d_gbps == b->h2d_gbps &&
         a->d2h_gbps == b->d2h_gbps && a->host_adamw_gbps == b->host_adamw_gbps &&
         a->host_mem_gbps == b->host_mem_gbps && a->disk_read_gbps == b->disk_read_gbps &&
         a->disk_write_gbps == b->disk_write_gbps && !strcmp(a->disk_dir, b->disk_dir) &&
         a->comm_gbps == b->comm_gbps && a->copy_latency_us == b->copy_latency_us &&
         a->host_copy_gbps == b->host_copy_gbps && a->kernel_overhead_us == b->kernel_overhead_us &&
         a->bf16_speedup == b->bf16_speedup && a->device_mem_gbps == b->device_mem_gbps &&
         a->host_adamw_bf16_gbps == b->host_adamw_bf16_gbps && a->host_adamw_8bit_gbps == b->host_adamw_8bit_gbps;
}

// The timing part (`--part timing`, meson suite "timing": not built with the sanitizers, whose
// copies can fall below the sim link's 2 GB/s throttle, and reported apart by test.sh): the probe
// is quick, and its rates are this machine's, within bounds that a loaded machine can break.
static void timing_measure(void) {
  struct fy_probe p;
  char disk[PATH_MAX];
  snprintf(disk, sizeof disk, "%s/disk", tmpdir);
  double t0 = fy_now();
  CHECK_OK(fy_probe_measure("sim", 256.0 * 1048576, 2.0, disk, &p));
  double secs = fy_now() - t0;
  fprintf(stderr, "probe took %.2f s:\n", secs);
  fy_probe_print(&p, stderr);
  CHECKF(secs < 10.0, "the probe took %.1f s", secs);
  // Throttled to 2 GB/s: the measured rate is the throttle unless memcpy is slower than that.
  CHECKF(fabs(p.h2d_gbps - 2.0) < 0.5, "h2d %g GB/s", p.h2d_gbps);
  CHECKF(fabs(p.d2h_gbps - 2.0) < 0.5, "d2h %g GB/s", p.d2h_gbps);
  CHECKF(p.host_gflops > 1, "%g GFLOP/s", p.host_gflops);
  CHECKF(p.host_mem_gbps > 0.2, "%g", p.host_mem_gbps);
  CHECKF(p.host_adamw_gbps > 0.1, "%g", p.host_adamw_gbps);
  // The state formats' updates timed too (their own rates: fy_probe_adamw_s prices with them).
  CHECKF(p.host_adamw_bf16_gbps > 0.1 && p.host_adamw_8bit_gbps > 0.1, "bf16 %g, 8-bit %g GB/s", p.host_adamw_bf16_gbps,
         p.host_adamw_8bit_gbps);
  CHECK(fabs(fy_probe_adamw_s(&p, FY_STATE_Q8) - fy_probe_adamw_bytes(FY_STATE_Q8) / (p.host_adamw_8bit_gbps * 1e9)) <
        1e-18);
  CHECKF(p.disk_read_gbps > 0.01 && p.disk_write_gbps > 0.01, "disk %g and %g GB/s", p.disk_read_gbps,
         p.disk_write_gbps);
  // A kernel handed to the sim's compute thread: far below a millisecond.
  CHECKF(p.kernel_overhead_us < 1000, "%g us", p.kernel_overhead_us);
  // bf16 products where the processor has them: timed (AMX ~5x, AMD's AVX512-BF16 ~2x; below 1
  // would make bf16 plans slower than fp32 ones, which is allowed).
  if (fy_matmul_bf16_native()) CHECKF(p.bf16_speedup > 0.3 && p.bf16_speedup < 30, "bf16 speedup %g", p.bf16_speedup);
}

// A measurement: every field there, plausible, and what does not depend on this machine's speed
// exact (the rates' bounds against this machine: timing_measure).
static void test_measure(struct fy_probe *p) {
  char disk[PATH_MAX];
  snprintf(disk, sizeof disk, "%s/disk", tmpdir);  // (not there yet: the probe makes it)
  CHECK_OK(fy_probe_measure("sim", 256.0 * 1048576, 2.0, disk, p));
  fy_probe_print(p, stderr);
  CHECK(!strcmp(p->device, "sim"));
  CHECK(p->device_mem == 268435456.0);
  CHECK(p->host_mem > 64.0 * 1048576 && p->host_mem < 1e16);
  // (Rates: measured, so above 0, and below what no machine reaches; a loaded machine only
  // lowers them.)
  CHECKF(p->host_gflops > 0 && p->host_gflops < 1e6, "%g", p->host_gflops);
  CHECK(p->device_gflops == p->host_gflops);  // the sim runs its kernels on this CPU
  // Throttled to 2 GB/s: the copies cannot outrun the throttle.
  CHECK(p->h2d_gbps > 0 && p->d2h_gbps > 0 && p->h2d_gbps < 2.5 && p->d2h_gbps < 2.5);
  CHECKF(p->host_mem_gbps > 0 && p->host_mem_gbps < 1e4, "%g", p->host_mem_gbps);
  CHECKF(p->host_adamw_gbps > 0 && p->host_adamw_gbps < 1e4, "%g", p->host_adamw_gbps);
  CHECKF(p->disk_read_gbps > 0 && p->disk_read_gbps < 1e4, "%g", p->disk_read_gbps);
  CHECKF(p->disk_write_gbps > 0 && p->disk_write_gbps < 1e4, "%g", p->disk_write_gbps);
  // A kernel handed to the sim's compute thread: measured (0 would read as unknown).
  CHECKF(p->kernel_overhead_us > 0, "%g us", p->kernel_overhead_us);
  // bf16 products: exactly 1 where the processor converts them to fp32 ones; else timed
  // (timing_measure holds them to a range).
  if (fy_matmul_bf16_native())
    CHECKF(p->bf16_speedup > 0, "bf16 speedup %g", p->bf16_speedup);
  else
    CHECKF(p->bf16_speedup == 1.0, "bf16 speedup %g without bf16 products", p->bf16_speedup);
  CHECK(fy_probe_gemm_gflops(p, false) == p->device_gflops);
  CHECK(fy_probe_gemm_gflops(p, true) == p->device_gflops * p->bf16_speedup);
  // The FMA peak: measured (its size is the machine's; a loaded machine lowers it, so no bound
  // against the GEMM rate here), with the instructions this processor has.
  CHECKF(p->peak_gflops > 0 && p->peak_gflops < 1e6, "peak %g", p->peak_gflops);
  const char *isa = fy_probe_fma_isa();
  CHECK(!strcmp(isa, "avx512") || !strcmp(isa, "avx2") || !strcmp(isa, "scalar"));
  // Each kind runs where the processor has it (the narrower ones too), and none where it does not.
  CHECK(fy_probe_fma_peak_gflops(1, 100000, "scalar") > 0);
  CHECK((fy_probe_fma_peak_gflops(1, 100000, "avx2") > 0) == (strcmp(isa, "scalar") != 0));
  CHECK((fy_probe_fma_peak_gflops(1, 100000, "avx512") > 0) == (strcmp(isa, "avx512") == 0));
  CHECK(fy_probe_fma_peak_gflops(1, 1000, "sve") == 0);
  char real[PATH_MAX];
  CHECK(realpath(disk, real) && !strcmp(p->disk_dir, real));
  CHECK(rmdir(disk) == 0);  // the disk tier removed its file

  // A cached probe that timed no disk, and a --disk-dir: the disk alone is timed (the directory
  // made again), once; the other fields stay as they were.
  struct fy_probe c = *p;
  c.disk_dir[0] = '\0';
  c.disk_read_gbps = c.disk_write_gbps = 0;
  bool timed = false;
  CHECK_OK(fy_probe_add_disk(&c, disk, &timed));
  CHECK(timed && c.disk_read_gbps > 0 && c.disk_write_gbps > 0);
  CHECK(realpath(disk, real) && !strcmp(c.disk_dir, real));
  CHECK(c.host_gflops == p->host_gflops && c.h2d_gbps == p->h2d_gbps && c.device_mem == p->device_mem);
  const double rd = c.disk_read_gbps;
  char again[PATH_MAX + 8];
  snprintf(again, sizeof again, "%s/../disk", disk);  // the same directory, named otherwise
  CHECK(mkdir(again, 0700) == 0 || errno == EEXIST);
  CHECK_OK(fy_probe_add_disk(&c, again, &timed));
  CHECK(!timed && c.disk_read_gbps == rd);
  CHECK_OK(fy_probe_add_disk(&c, NULL, &timed));
  CHECK(!timed && c.disk_read_gbps == rd && !strcmp(c.disk_dir, real));
  char other[PATH_MAX];
  snprintf(other, sizeof other, "%s/disk2", tmpdir);
  CHECK_OK(fy_probe_add_disk(&c, other, &timed));
  CHECK(timed && realpath(other, real) && !strcmp(c.disk_dir, real));
  CHECK(rmdir(other) == 0);
  CHECK_ERR(fy_probe_add_disk(&c, "/etc/passwd/ferry-probe", &timed), FY_ERR_IO);
  CHECK(rmdir(disk) == 0);

  struct fy_probe q;
  memset(&q, 0x5a, sizeof q);
  CHECK_ERR(fy_probe_measure("tpu", 0, 0, NULL, &q), FY_ERR_UNSUPPORTED);
  CHECK_ERR(fy_probe_measure("sim", 0, 0, NULL, &q), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_measure("sim", 1 << 30, -1, NULL, &q), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_measure("cpu", 0, 0, "/etc/passwd/ferry-probe", &q), FY_ERR_IO);  // (cannot be made)
  CHECK(msg_has("/etc/passwd"));
  CHECK((unsigned char)q.device[0] == 0x5a);  // untouched on error
}

static void test_round_trip(const struct fy_probe *p) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/cache/ferry/probe.json", tmpdir);  // parents do not exist yet
  CHECK_OK(fy_probe_write(path, p));
  struct fy_probe q;
  memset(&q, 0, sizeof q);
  CHECK_OK(fy_probe_read(path, &q));
  CHECK(probe_equal(p, &q));

  // Awkward values survive too: not representable in a few digits, tiny, huge, zero disk rates.
  struct fy_probe r = *p;
  r.device_gflops = 1.0 / 3.0;
  r.h2d_gbps = 0.1 + 0.2;
  r.host_mem = 549755813888.0 * 3;
  r.device_mem = 1e20;  // beyond an exact int64 in a double: written as a double
  r.disk_read_gbps = r.disk_write_gbps = 0;
  r.bf16_speedup = 14.7;
  r.device_mem_gbps = 4321.5;
  r.disk_dir[0] = '\0';
  snprintf(r.device, sizeof r.device, "cuda");
  CHECK_OK(fy_probe_write(path, &r));
  memset(&q, 0, sizeof q);
  CHECK_OK(fy_probe_read(path, &q));
  CHECK(probe_equal(&r, &q));

  // The file reads well: pretty-printed, units in the values a person sees, no escaped slashes.
  FILE *f = fopen(path, "r");
  char text[4096] = "";
  if (f) {
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
  }
  CHECK(strstr(text, "\"h2d_gbps\"") && strchr(text, '\n'));
  CHECK(strstr(text, "\\/") == NULL);
  struct stat sb;
  CHECK(stat(path, &sb) == 0);
  // No temporary file left next to it.
  char tmp[PATH_MAX + 32];
  snprintf(tmp, sizeof tmp, "%s.tmp-%d", path, (int)getpid());
  CHECK(access(tmp, F_OK) != 0);

  // A parent that is a file cannot become a directory, even for root.
  snprintf(tmp, sizeof tmp, "%s/cache/ferry/probe.json/x/probe.json", tmpdir);
  CHECK_ERR(fy_probe_write(tmp, p), FY_ERR_IO);
  CHECK(msg_has("probe.json/x"));
  snprintf(tmp, sizeof tmp, "%s/none.json", tmpdir);
  CHECK_ERR(fy_probe_read(tmp, &q), FY_ERR_NOT_FOUND);
  CHECK(msg_has("none.json"));
}

static void test_overrides(const struct fy_probe *base) {
  struct fy_probe p = *base;
  CHECK_OK(fy_probe_override(&p, "device_mem", "40GiB"));
  CHECK(p.device_mem == 42949672960.0);
  CHECK_OK(fy_probe_override(&p, "host-mem", "512GiB"));  // CLI spelling
  CHECK(p.host_mem == 549755813888.0);
  CHECK_OK(fy_probe_override(&p, "host_mem", "1536M"));
  CHECK(p.host_mem == 1536.0 * 1048576);
  CHECK_OK(fy_probe_override(&p, "device_mem", "123456789"));
  CHECK(p.device_mem == 123456789.0);
  CHECK_OK(fy_probe_override(&p, "device_gflops", "12.5"));
  CHECK(p.device_gflops == 12.5);
  CHECK_OK(fy_probe_override(&p, "device-tflops", "312"));
  CHECK(p.device_gflops == 312000.0);
  CHECK_OK(fy_probe_override(&p, "host_tflops", "1.5"));
  CHECK(p.host_gflops == 1500.0);
  CHECK_OK(fy_probe_override(&p, "link-gbps", "25"));
  CHECK(p.h2d_gbps == 25.0 && p.d2h_gbps == 25.0);
  CHECK_OK(fy_probe_override(&p, "d2h_gbps", "24"));
  CHECK(p.h2d_gbps == 25.0 && p.d2h_gbps == 24.0);
  CHECK_OK(fy_probe_override(&p, "disk_read_gbps", "0"));  // "no disk" is a valid answer
  CHECK(p.disk_read_gbps == 0);
  // The GEMM rate of each precision: the device's default one, the other through bf16_speedup
  // (unknown: 1 on a CPU, FY_PROBE_GPU_BF16_SPEEDUP on a GPU).
  CHECK_OK(fy_probe_override(&p, "device", "sim"));
  CHECK_OK(fy_probe_override(&p, "device_gflops", "200"));
  CHECK_OK(fy_probe_override(&p, "bf16_speedup", "0"));
  CHECK(fy_probe_gemm_gflops(&p, false) == 200 && fy_probe_gemm_gflops(&p, true) == 200);
  CHECK_OK(fy_probe_override(&p, "bf16-speedup", "2.5"));
  CHECK(fy_probe_gemm_gflops(&p, false) == 200 && fy_probe_gemm_gflops(&p, true) == 500);
  CHECK_OK(fy_probe_override(&p, "device", "cpu"));  // (another CPU device: the same processor)
  CHECK(p.bf16_speedup == 2.5);
  CHECK_OK(fy_probe_override(&p, "device", "cuda"));  // a CPU's speedup says nothing of a GPU's
  CHECK(!strcmp(p.device, "cuda") && p.bf16_speedup == 0);
  CHECK_OK(fy_probe_override(&p, "device-tflops", "989"));
  CHECK(fy_probe_gemm_gflops(&p, true) == 989000.0);
  CHECK(fy_probe_gemm_gflops(&p, false) == 989000.0 / FY_PROBE_GPU_BF16_SPEEDUP);
  CHECK_OK(fy_probe_override(&p, "bf16_speedup", "16"));
  CHECK(fy_probe_gemm_gflops(&p, false) == 989000.0 / 16);
  // The memory-bound kernels' rate: a GPU's measured bandwidth, else a byte per 100 bf16 FLOPs; on
  // cpu and sim the host's.
  CHECK(fy_probe_device_mem_gbps(&p) == 9890.0);
  CHECK_OK(fy_probe_override(&p, "device_mem_gbps", "4000"));
  CHECK(fy_probe_device_mem_gbps(&p) == 4000.0);
  CHECK_OK(fy_probe_override(&p, "device", "sim"));
  CHECK(p.bf16_speedup == 0 && p.device_mem_gbps == 0 && fy_probe_device_mem_gbps(&p) == p.host_mem_gbps);
  CHECK_OK(fy_probe_override(&p, "device", "cuda"));
  // The device's peak: a CPU's fp32 FMA peak; a GPU's dense bf16 peak by its name, or given; a
  // peak below the measured GEMM rate is none; from one kind of device to the other it is unknown.
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA H200") == 989400.0);
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA H100 80GB HBM3") == 989400.0);
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA H100 PCIe") == 756500.0);
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA A100-SXM4-80GB") == 312000.0);
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA A10") == 125000.0);
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA L4") == 121000.0);
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA L40S") == 362000.0);
  CHECK(fy_probe_gpu_peak_gflops("NVIDIA L40") == 0 && fy_probe_gpu_peak_gflops("NVIDIA A10G") == 0);
  CHECK(fy_probe_gpu_peak_gflops("Tesla V100-SXM2-16GB") == 0 && fy_probe_gpu_peak_gflops(NULL) == 0);
  CHECK(p.peak_gflops == 0 && fy_probe_peak_gflops(&p, true) == 0);  // (changed kind above)
  CHECK_OK(fy_probe_override(&p, "device-peak-tflops", "989.4"));
  CHECK(p.peak_gflops == 989400.0 && fy_probe_peak_gflops(&p, true) == 989400.0);
  CHECK(fy_probe_peak_gflops(&p, false) == 989400.0 / FY_PROBE_GPU_BF16_SPEEDUP);
  CHECK_OK(fy_probe_override(&p, "device_tflops", "1200"));  // faster than the "peak": no peak
  CHECK(fy_probe_peak_gflops(&p, true) == 0);
  CHECK_OK(fy_probe_override(&p, "device_tflops", "989"));
  CHECK_ERR(fy_probe_override(&p, "device_peak_tflops", "0"), FY_ERR_INVALID);
  CHECK_OK(fy_probe_override(&p, "device", "sim"));
  CHECK(p.peak_gflops == 0);
  CHECK_OK(fy_probe_override(&p, "device_gflops", "100"));
  CHECK_OK(fy_probe_override(&p, "peak_gflops", "150"));
  CHECK(fy_probe_peak_gflops(&p, false) == 150);
  CHECK_OK(fy_probe_override(&p, "device", "cuda"));
  CHECK_OK(fy_probe_override(&p, "disk_dir", "/scratch/ferry"));
  CHECK(!strcmp(p.disk_dir, "/scratch/ferry"));

  struct fy_probe before = p;
  CHECK_ERR(fy_probe_override(&p, "device_memory", "40GiB"), FY_ERR_INVALID);
  CHECK(msg_has("device_memory") && msg_has("device_mem"));
  CHECK_ERR(fy_probe_override(&p, "device_mem", "forty"), FY_ERR_INVALID);
  CHECK(msg_has("forty") && msg_has("device_mem"));
  CHECK_ERR(fy_probe_override(&p, "device_mem", "40XB"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "device_mem", "-1GiB"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "device_mem", "0"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "device_mem", ""), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "h2d_gbps", "12.5GB/s/x"), FY_ERR_INVALID);
  CHECK(msg_has("h2d_gbps"));
  CHECK_ERR(fy_probe_override(&p, "h2d_gbps", "nan"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "h2d_gbps", "inf"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "h2d_gbps", "-3"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "device_gflops", "0"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "device_tflops", "x"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "link_gbps", ""), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "device", "tpu"), FY_ERR_INVALID);
  CHECK_ERR(fy_probe_override(&p, "bf16_speedup", "-1"), FY_ERR_INVALID);
  char longv[600];
  memset(longv, 'a', sizeof longv - 1);
  longv[sizeof longv - 1] = '\0';
  CHECK_ERR(fy_probe_override(&p, "disk_dir", longv), FY_ERR_INVALID);
  CHECK(probe_equal(&p, &before));
}

// A valid file's text with one key's raw JSON value replaced (or removed when raw is NULL and
// key given), and `extra` ("\"k\": v") appended.
static void make_file(const char *path, const char *key, const char *raw, int remove,
                      const char *extra) {
  static const char *keys[] = {"device", "device_mem", "host_mem", "device_gflops", "host_gflops",
                               "h2d_gbps", "d2h_gbps", "host_adamw_gbps", "host_mem_gbps",
                               "disk_read_gbps", "disk_write_gbps", "disk_dir"};
  static const char *vals[] = {"\"sim\"", "268435456", "17179869184", "100.5", "100.5", "2.0",
                               "2.0", "5.0", "10.0", "1.5", "1.25", "\"/tmp\""};
  char text[4096] = "{\n";
  int first = 1;
  for (int i = 0; i < 12; i++) {
    int match = key && !strcmp(key, keys[i]);
    if (match && remove) continue;
    size_t n = strlen(text);
    snprintf(text + n, sizeof text - n, "%s  \"%s\": %s", first ? "" : ",\n", keys[i],
             match ? raw : vals[i]);
    first = 0;
  }
  size_t n = strlen(text);
  if (extra) snprintf(text + n, sizeof text - n, ",\n  %s", extra);
  n = strlen(text);
  snprintf(text + n, sizeof text - n, "\n}\n");
  write_text(path, text);
}

static void test_bad_files(void) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/edited.json", tmpdir);
  struct fy_probe p, untouched;
  memset(&p, 0x5a, sizeof p);
  untouched = p;

  make_file(path, NULL, NULL, 0, NULL);
  CHECK_OK(fy_probe_read(path, &p));
  CHECK(p.device_mem == 268435456.0 && p.disk_write_gbps == 1.25 && !strcmp(p.disk_dir, "/tmp"));
  CHECK(p.bf16_speedup == 0);  // (a file from before it: unknown)
  CHECK(p.format == 1);        // (and from before formats)
  make_file(path, NULL, NULL, 0, "\"format\": 2");
  CHECK_OK(fy_probe_read(path, &p));
  CHECK(p.format == 2);
  const char *bad_format[] = {"3", "0", "-1", "2.0", "\"2\"", "null"};
  for (size_t i = 0; i < sizeof bad_format / sizeof *bad_format; i++) {
    char extra[64];
    snprintf(extra, sizeof extra, "\"format\": %s", bad_format[i]);
    make_file(path, NULL, NULL, 0, extra);
    CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
    CHECKF(msg_has("format") && msg_has(path), "%s", fy_error_msg());
  }
  make_file(path, NULL, NULL, 0, "\"format\": 3");
  CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
  CHECK(msg_has("newer ferry") && msg_has("--remeasure"));
  memset(&p, 0x5a, sizeof p);
  make_file(path, NULL, NULL, 0, "\"bf16_speedup\": 1.8");
  CHECK_OK(fy_probe_read(path, &p));
  CHECK(p.bf16_speedup == 1.8);
  memset(&p, 0x5a, sizeof p);
  make_file(path, NULL, NULL, 0, "\"bf16_speedup\": -2");  // (optional, but checked when there)
  CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
  CHECK(msg_has("bf16_speedup"));
  memset(&p, 0x5a, sizeof p);
  // The state formats' AdamW rates: optional (a file without them reads them as 0, unknown, and is
  // priced at host_adamw_gbps on each format's bytes), read when there.
  make_file(path, NULL, NULL, 0, NULL);
  CHECK_OK(fy_probe_read(path, &p));
  CHECK(p.host_adamw_bf16_gbps == 0 && p.host_adamw_8bit_gbps == 0);
  CHECK(fy_probe_adamw_s(&p, FY_STATE_F32) == 28.0 / 5e9 && fy_probe_adamw_s(&p, FY_STATE_BF16) == 20.0 / 5e9);
  CHECK(fabs(fy_probe_adamw_s(&p, FY_STATE_Q8) - (12.0 + 4 * (1.0 + 4.0 / 256)) / 5e9) < 1e-18);
  memset(&p, 0x5a, sizeof p);
  make_file(path, NULL, NULL, 0, "\"host_adamw_8bit_gbps\": 2.5");
  CHECK_OK(fy_probe_read(path, &p));
  CHECK(p.host_adamw_8bit_gbps == 2.5 && p.host_adamw_bf16_gbps == 0);
  CHECK(fabs(fy_probe_adamw_s(&p, FY_STATE_Q8) - fy_probe_adamw_bytes(FY_STATE_Q8) / 2.5e9) < 1e-18);
  memset(&p, 0x5a, sizeof p);

  const char *not_json[] = {"", "not json", "{\"device\": \"sim\",", "{} trailing", "[1, 2]", "42",
                            "{\"device\": 'sim'}"};
  for (size_t i = 0; i < sizeof not_json / sizeof *not_json; i++) {
    write_text(path, not_json[i]);
    CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
    CHECK(msg_has(path));
  }

  make_file(path, NULL, NULL, 0, "\"device_memory\": 1, \"tflops\": 2");
  CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
  CHECK(msg_has("device_memory") && msg_has("tflops") && msg_has(path));

  make_file(path, "host_adamw_gbps", NULL, 1, NULL);
  CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
  CHECK(msg_has("host_adamw_gbps") && msg_has("missing"));

  struct { const char *key, *raw; } bad[] = {
      {"h2d_gbps", "-2.0"},        // negative
      {"device_mem", "-1"},        // negative integer
      {"host_mem_gbps", "1e999"},  // infinite
      {"host_gflops", "NaN"},      // not JSON at all in strict mode, and NaN anyway
      {"device_gflops", "0"},      // zero where a rate is needed
      {"d2h_gbps", "\"2.0\""},     // a string where a number goes
      {"host_mem", "true"},
      {"device_mem", "null"},
      {"disk_read_gbps", "[1]"},
      {"device", "3"},             // a number where a string goes
      {"device", "\"tpu\""},       // an unknown device
      {"disk_dir", "{}"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    make_file(path, bad[i].key, bad[i].raw, 0, NULL);
    CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
    CHECKF(msg_has(path), "%s", fy_error_msg());
    if (strcmp(bad[i].raw, "NaN") != 0) CHECKF(msg_has(bad[i].key), "%s", fy_error_msg());
  }
  make_file(path, "disk_read_gbps", "0", 0, NULL);  // zero disk rates are fine
  CHECK_OK(fy_probe_read(path, &p));
  CHECK(p.disk_read_gbps == 0);
  memset(&p, 0x5a, sizeof p);

  char longv[700];
  longv[0] = '"';
  memset(longv + 1, 'a', 600);
  snprintf(longv + 601, sizeof longv - 601, "\"");
  make_file(path, "disk_dir", longv, 0, NULL);
  CHECK_ERR(fy_probe_read(path, &p), FY_ERR_FORMAT);
  CHECK(msg_has("disk_dir"));
  CHECK(memcmp(&p, &untouched, sizeof p) == 0);
}

static void test_default_path(void) {
  char buf[PATH_MAX];
  setenv("FERRY_PROBE", "/etc/ferry/mine.json", 1);
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  setenv("HOME", "/home/u", 1);
  fy_probe_default_path(buf, sizeof buf);
  CHECK(!strcmp(buf, "/etc/ferry/mine.json"));
  unsetenv("FERRY_PROBE");
  fy_probe_default_path(buf, sizeof buf);
  CHECK(!strcmp(buf, "/xdg/ferry/probe.json"));
  setenv("XDG_CACHE_HOME", "relative", 1);  // invalid by the XDG spec: ignored
  fy_probe_default_path(buf, sizeof buf);
  CHECK(!strcmp(buf, "/home/u/.cache/ferry/probe.json"));
  unsetenv("XDG_CACHE_HOME");
  fy_probe_default_path(buf, sizeof buf);
  CHECK(!strcmp(buf, "/home/u/.cache/ferry/probe.json"));
}

// fy_probe_cached: measured and written when the file is missing or of another device (or with
// remeasure), read when it is this device's (a GPU plan without a GPU takes any), the disk added
// to a cached probe that lacks it, a broken file an error, and a failed write an error only when
// asked.
static void test_cached(const struct fy_probe *base) {
  char path[PATH_MAX], disk[PATH_MAX];
  snprintf(path, sizeof path, "%s/cache/probe.json", tmpdir);
  snprintf(disk, sizeof disk, "%s/disk2", tmpdir);
  struct fy_probe p, q;
  bool measured = false;
  struct fy_probe_cache c = {.path = path, .device = "sim", .write = true, .write_errors = true,
                             .device_mem = 64.0 * 1048576};
  CHECK_OK(fy_probe_cached(&c, &p, &measured));  // missing: measured, written
  CHECK(measured && !strcmp(p.device, "sim") && p.device_mem == 64.0 * 1048576);
  CHECK_OK(fy_probe_read(path, &q));
  CHECK(probe_equal(&p, &q));
  struct fy_probe edited = *base;  // this device's, as a user edited it: read, not measured
  edited.host_gflops = 12345;
  CHECK_OK(fy_probe_write(path, &edited));
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(!measured && p.host_gflops == 12345);
  c.disk_dir = disk;  // a disk it lacks: timed and written back, the rest kept
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(!measured && p.host_gflops == 12345 && p.disk_read_gbps > 0);
  CHECK_OK(fy_probe_read(path, &q));
  CHECK(probe_equal(&p, &q));
  c.disk_dir = NULL;
  c.device = "cuda";  // planning for a GPU from a machine without one: this CPU's will do
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(!measured && !strcmp(p.device, "sim") && p.host_gflops == 12345);
  c.device = "cpu";  // another device's: measured again
  c.write = false;  // ... and not written
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(measured && !strcmp(p.device, "cpu"));
  CHECK_OK(fy_probe_read(path, &q));
  CHECK(q.host_gflops == 12345);
  c.device = "sim", c.write = true, c.remeasure = true;
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(measured && p.host_gflops != 12345);
  c.remeasure = false;
  // A file of format 1 (kernel_overhead_us per call): that measured again, the rest kept, written
  // back as this format; a cpu probe has nothing to measure again.
  make_file(path, NULL, NULL, 0, "\"kernel_overhead_us\": 0.05");
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(!measured && p.format == FY_PROBE_FORMAT && p.kernel_overhead_us >= 0.1 && p.host_gflops == 100.5);
  CHECK_OK(fy_probe_read(path, &q));
  CHECK(q.format == FY_PROBE_FORMAT && probe_equal(&p, &q));
  make_file(path, "device", "\"cpu\"", 0, NULL);
  c.device = "cpu";
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(!measured && p.format == FY_PROBE_FORMAT && p.kernel_overhead_us == 0 && p.host_gflops == 100.5);
  CHECK_OK(fy_probe_read(path, &q));
  CHECK(q.format == FY_PROBE_FORMAT);
  c.device = "sim";
  write_text(path, "{ not json");  // broken: an error, the file left for its owner
  CHECK_ERR(fy_probe_cached(&c, &p, &measured), FY_ERR_FORMAT);
  snprintf(path, sizeof path, "/proc/ferry-none/probe.json");  // not there, and cannot be written
  CHECK_ERR(fy_probe_cached(&c, &p, &measured), FY_ERR_IO);
  c.write_errors = false;
  CHECK_OK(fy_probe_cached(&c, &p, &measured));
  CHECK(measured);
}

int main(int argc, char **argv) {
  check_args(argc, argv);
  double t0 = fy_now();
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  if (check_plain()) {
    struct fy_probe p;
    memset(&p, 0, sizeof p);
    test_measure(&p);
    test_round_trip(&p);
    test_overrides(&p);
    test_bad_files();
    test_cached(&p);
    test_default_path();
  }
  if (check_part("timing")) timing_measure();
  fy_matmul_cache_clear();
  char cmd[PATH_MAX + 16];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  CHECK(system(cmd) == 0);
  // (Five probes and a kernel-overhead measurement: about 10 s on 2 cores, 25 s with the
  // sanitizers.)
  fprintf(stderr, "test_probe: %.2f s\n", fy_now() - t0);
  return check_summary("probe");
}
