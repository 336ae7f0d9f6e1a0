// The hardware probe (`ferry probe`): what the planner needs to know about a machine.
//
// fy_probe_measure times this machine in a few seconds; the result is cached in a JSON file that a
// person can read and edit, and every value can be overridden (fy_probe_override) so that the
// planner can be asked about a machine the user does not have.
//
// The file is one JSON object whose keys are exactly the fields below, all of them present, no
// others:
//   "format"            integer: the file's layout, FY_PROBE_FORMAT as written (absent: 1)
//   "device"            string: "cpu", "sim" or "cuda"
//   "device_mem"        number, bytes (> 0)
//   "host_mem"          number, bytes (> 0)
//   "device_gflops"     number, GFLOP/s (> 0)          "host_gflops"   number, GFLOP/s (> 0)
//   "h2d_gbps"          number, GB/s = 1e9 B/s (> 0)   "d2h_gbps"      number, GB/s (> 0)
//   "host_adamw_gbps"   number, GB/s (> 0)             "host_mem_gbps" number, GB/s (> 0)
//   "disk_read_gbps"    number, GB/s (>= 0)            "disk_write_gbps" number, GB/s (>= 0)
//   "disk_dir"          string, "" when no disk directory was probed
//   "comm_gbps"         number, GB/s (>= 0): bus bandwidth of collectives between ranks; 0 (the
//                       default, and what a file without the key reads as): derived, see
//                       fy_probe_comm_gbps
//   "copy_latency_us"   number, microseconds (>= 0): what one copy across the link costs besides
//                       its bytes (measured on sim; 0 or absent: none)
//   "host_copy_gbps"    number, GB/s (>= 0): one thread's memcpy rate (0 or absent: unknown)
//   "kernel_overhead_us" number, microseconds (>= 0): what one parallel region of a kernel costs on
//                       the device besides its FLOPs and bytes (measured on sim; 0 or absent:
//                       the planner's default)
//   "bf16_speedup"      number (>= 0): how many times the device's bf16 products (fp32
//                       accumulation) outrun its fp32 ones, measured; 0 or absent: unknown (see
//                       fy_probe_gemm_gflops)
//   "device_mem_gbps"   number, GB/s (>= 0): a GPU's memory bandwidth (measured on one); 0 or
//                       absent: unknown (see fy_probe_device_mem_gbps)
//   "peak_gflops"       number, GFLOP/s (>= 0): the device's dense peak in its default precision
//                       (MFU's denominator beside the GEMM rate): on cpu and sim the fp32 FMA
//                       peak of all cores, measured; on a GPU its bf16 tensor-core peak from a
//                       table by name; 0 or absent: unknown (see fy_probe_peak_gflops)
// Numbers are written so that they read back bit for bit.
#ifndef FY_PLANNER_PROBE_H
#define FY_PLANNER_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "core/status.h"
#include "ops/ops.h"

// The probe file's format, written as its "format". 1 (a file without the key): kernel_overhead_us
// per kernel call. 2: per parallel region of a kernel, about 1.5x the same machine's format-1
// figure. fy_probe_cached measures again what an older format meant otherwise; a file from a
// newer ferry is refused.
#define FY_PROBE_FORMAT 2

struct fy_probe {
  int format;                 // the file's format it was read from (FY_PROBE_FORMAT when measured)
  char device[32];            // "cpu", "sim" or "cuda"
  double device_mem;          // bytes the device may hold
  double host_mem;            // bytes of host memory for model state
  double device_gflops;       // sustained GEMM rate of the device (GFLOP/s) in its default precision:
                              // fp32 on cpu and sim (M=512 N=3072 K=768), bf16 with fp32
                              // accumulation on a GPU (fy_probe_measure_gpu)
  double host_gflops;         // the same on the host CPU (for sim/cpu they are the same CPU)
  double h2d_gbps, d2h_gbps;  // copy bandwidth host->device and back (GB/s = 1e9 B/s)
  double host_adamw_gbps;     // host AdamW throughput in GB/s of the 28 B/param it moves
  // The same with m and v stored as bf16 and as 8-bit blocks (--optimizer-state bf16, 8bit), in
  // GB/s of the bytes they move a parameter (fy_probe_adamw_bytes: 20 and 16.06), measured: their
  // updates convert each moment, so a few cores may not keep up with the memory (2 cores of the
  // dev machine: 8-bit at 44% of fp32's bytes a second). 0 when unknown (a probe file from before
  // them, until ferry probe --remeasure; a machine described by --host-adamw-gbps alone): priced at
  // host_adamw_gbps, as memory-bound.
  double host_adamw_bf16_gbps, host_adamw_8bit_gbps;
  double host_mem_gbps;       // host memory bandwidth (memory-bound kernels: layernorm, relu, add)
  double disk_read_gbps, disk_write_gbps;  // 0 when no disk directory was probed
  char disk_dir[512];         // "" when none
  double comm_gbps;           // collectives between ranks (bus bandwidth), 0: derived
  double copy_latency_us;     // a copy across the link besides bytes / rate (the copy engine's
                              // hand-offs; measured on sim), 0 when unknown
  double host_copy_gbps;      // one thread's memcpy (bytes copied per second, GB/s): what a sim
                              // copy engine's memcpy takes from the cores; 0 when unknown
  double kernel_overhead_us;  // a kernel's parallel region (planner/profile.h's kernel_calls)
                              // besides its FLOPs and bytes; on sim: the hand-off to the
                              // compute stream's thread, and OpenMP waking that thread's helpers
                              // (libgomp stops spinning between parallel regions once the process
                              // has more OpenMP threads than cores, as every sim stream thread's
                              // team makes it); 0 when unknown
  double bf16_speedup;        // the device's bf16 products over its fp32 ones (rate / rate): ~1 on a
                              // CPU that converts bf16 to fp32, ~2 on AVX512-BF16 (AMD), ~5 on AMX,
                              // ~15 on a GPU's tensor cores against its fp32 cores; 0 when unknown
  double device_mem_gbps;     // a GPU's memory bandwidth (GB/s; a copy within it moves its bytes
                              // twice, read and written): what its memory-bound kernels run at;
                              // 0 when unknown, and on cpu and sim (the host's memory)
  double peak_gflops;         // the device's dense peak (GFLOP/s) in its default precision: a
                              // CPU's fp32 FMA peak (fy_probe_fma_peak_gflops), a GPU's bf16
                              // tensor-core peak (fy_probe_gpu_peak_gflops); 0 when unknown
  double disk_space;          // bytes the disk tier may fill for each rank: disk_dir's free space
                              // when the probe was loaded (fy_probe_cached), or given ("disk_space"
                              // override); 0: no bound known. Not in the file: it changes as the
                              // disk fills.
};

// Seconds a parameter of the host's AdamW with m and v stored in `state`: the format's measured
// rate (host_adamw_bf16_gbps, host_adamw_8bit_gbps) or, unknown, host_adamw_gbps on its bytes
// (memory-bound); fp32's is host_adamw_gbps on 28 bytes. fy_probe_adamw_bytes(state): the bytes
// a parameter it moves (the master and m and v read and written, an fp32 gradient read; 8-bit
// with its blocks' scales, as a chunk of many blocks has them).
double fy_probe_adamw_s(const struct fy_probe *p, enum fy_state_format state);
double fy_probe_adamw_bytes(enum fy_state_format state);

// The bandwidth (GB/s) the device's memory-bound kernels run at: on cpu and sim the host's memory
// bandwidth; on a GPU device_mem_gbps, or when unknown 1 byte per 100 FLOPs of its bf16 GEMM rate
// (H100/H200: ~3.3-4.8 TB/s against ~400-990 TFLOP/s dense bf16).
double fy_probe_device_mem_gbps(const struct fy_probe *p);

// The device's GEMM rate (GFLOP/s) for products in bf16 (fp32 accumulation) or in fp32: device_gflops
// in the device's default precision, the other through bf16_speedup. Unknown (0), it is taken as 1
// on cpu and sim (the products a CPU without bf16 hardware runs: fp32 ones) and
// FY_PROBE_GPU_BF16_SPEEDUP on a GPU (bf16 tensor cores against fp32 cores: H100/H200 989 against
// 67 TFLOP/s, A100 312 against 19.5).
#define FY_PROBE_GPU_BF16_SPEEDUP 15.0
double fy_probe_gemm_gflops(const struct fy_probe *p, bool bf16);

// The device's dense peak (GFLOP/s) for products in bf16 (fp32 accumulation) or fp32, what MFU is
// measured against beside the GEMM rate: peak_gflops in the device's default precision; a GPU's
// fp32 peak that over FY_PROBE_GPU_BF16_SPEEDUP (ferry's fp32 products are true fp32, no TF32); a
// CPU's bf16 peak twice its fp32 one with AVX512-BF16, the same without bf16 hardware, unknown with
// AMX. 0 when unknown, or when below the GEMM rate fy_probe_gemm_gflops gives (no peak, then).
double fy_probe_peak_gflops(const struct fy_probe *p, bool bf16);
// This processor's fp32 multiply-add peak (GFLOP/s) on `threads` OpenMP threads (< 1: all):
// independent chains of real FMA instructions, `iterations` rounds of 12 chains a thread, the best
// of three. isa: "avx512", "avx2" or "scalar" (fmaf), NULL for the best of the vector kinds the
// processor runs (the widest, fy_probe_fma_isa, and AVX2 under AVX-512); 0 for a kind it does not
// run. FY_PROBE_FMA_ITERATIONS takes ~10 ms a run on
// a current core.
#define FY_PROBE_FMA_ITERATIONS 2000000L
double fy_probe_fma_peak_gflops(int threads, long iterations, const char *isa);
const char *fy_probe_fma_isa(void);
// A GPU's dense bf16 tensor-core peak (GFLOP/s) by its name (cudaGetDeviceProperties' "NVIDIA
// H100 80GB HBM3", ...): H200, H100 (SXM, PCIe, NVL), A100, L40S, A30, L4, A10; 0 for any other.
double fy_probe_gpu_peak_gflops(const char *name);

// The bus bandwidth (GB/s) the planner assumes for collectives between ranks: comm_gbps when set;
// else on cpu and sim (ranks on one host, MPI through shared memory) half the host memory
// bandwidth, and on cuda 25 GB/s (PCIe 4.0 x16; set comm_gbps for NVLink or a network).
double fy_probe_comm_gbps(const struct fy_probe *p);

// Measures this machine (small, quick runs: the whole probe takes a few seconds on 2 cores; every
// rate is the median of a few timed runs after a warm-up).
// dev_kind "cpu" or "sim" (anything else: FY_ERR_UNSUPPORTED).
// device_mem: for sim the device's cap (> 0, else FY_ERR_INVALID); for cpu the cap, or 0 for the
// host memory (the cpu device's memory is host memory).
// link_gbps: for sim the link's throttle (as fy_device_sim_create; 0 = unthrottled), and h2d/d2h
// are then measured through the sim's copy engines; ignored for cpu (plain copies are timed).
// host_mem is the memory available now (MemAvailable, bounded by a cgroup v2 limit).
// disk_dir: a writable directory to time the disk tier in (256 MB written, then read), or NULL /
// "" for none (disk rates 0). The disk tier does not fsync and the page cache cannot be dropped
// without root, so both disk rates are what the tier sees for a 256 MB burst (often the page
// cache's rate), an upper bound on the disk's sustained rate: edit the file for a big disk tier.
fy_status fy_probe_measure(const char *dev_kind, double device_mem, double link_gbps,
                           const char *disk_dir, struct fy_probe *out);
// The disk part alone, for a cached probe and a --disk-dir it has not timed: unless p already
// holds the rates of that directory (the same one, resolved), times it as fy_probe_measure does
// (making it when missing) and sets p's disk fields; *measured says whether it did.
fy_status fy_probe_add_disk(struct fy_probe *p, const char *disk_dir, bool *measured);

// The probe a command plans with: the file at `path` when it holds `device`'s (for cuda without a
// GPU to measure, any: this CPU's, to be given the GPU's figures), else (or with remeasure) this
// machine measured — device_mem, link_gbps and disk_dir as fy_probe_measure takes them, a cuda
// probe as the sim device's with GPU 0's figures when `gpu` — and written back when `write`; a
// cached probe also gains disk_dir's rates when it lacks them (fy_probe_add_disk), written back
// too, and one of an older format has the fields whose meaning changed measured again (the rest
// kept as the file has them), said in a line on stderr and written back. Either way disk_space is
// the free space of its disk_dir now. A write that fails is an error only with write_errors.
// *measured: whether it measured. A file that cannot be read or parsed is an error (an edited file
// is not silently replaced).
struct fy_probe_cache {
  const char *path, *device, *disk_dir;
  bool gpu, remeasure, write, write_errors;
  double device_mem, link_gbps;
};
fy_status fy_probe_cached(const struct fy_probe_cache *c, struct fy_probe *p, bool *measured);

// A GPU's part of the probe (planner/probe_cuda.c; only in a build with CUDA or its emulator,
// FY_HAVE_CUDA): the GPUs CUDA sees (0 on any error), and GPU `ordinal` measured into p's device
// fields — "cuda", the memory ferry train takes of what is free on it now (FY_CUDA_FREE_PERCENT),
// its bf16 GEMM rate (fp32 accumulation, the kernels'
// cuBLASLt path, square products grown from 512 until one takes 2 ms, at most 8192) and its fp32
// one the same way (bf16_speedup: the first over the second), its memory bandwidth (a copy within it
// of up to 512 MiB), pinned copies
// each way and what a 4 KiB copy costs — leaving the host's fields as they are (fy_probe_measure
// fills those). FY_ERR_NOT_FOUND without that GPU.
int fy_probe_gpu_count(void);
// FY_OK when GPU `ordinal` is there, else why not (the driver, CUDA_VISIBLE_DEVICES, ...).
fy_status fy_probe_find_gpu(int ordinal);
fy_status fy_probe_measure_gpu(int ordinal, struct fy_probe *p);
// The median of v[0..n) (sorts v): each rate the probe reports is one over a few timed runs.
double fy_probe_median(double *v, int n);

// Writes the JSON file (pretty-printed) atomically: a temporary file in the same directory,
// fsync, rename. Creates the missing parent directories.
fy_status fy_probe_write(const char *path, const struct fy_probe *p);
// Reads and validates the file. FY_ERR_NOT_FOUND when it does not exist, FY_ERR_IO when it cannot
// be read; FY_ERR_FORMAT naming the file and the key for: not JSON, not an object, unknown keys
// (all named), missing keys, a wrong type, a negative, NaN or infinite value, a zero where a
// positive value is needed, an unknown device or a string too long. *p is untouched on error.
fy_status fy_probe_read(const char *path, struct fy_probe *p);

// The default cache path: $FERRY_PROBE if set, else $XDG_CACHE_HOME/ferry/probe.json (when
// absolute), else ~/.cache/ferry/probe.json.
void fy_probe_default_path(char *buf, size_t n);

// Applies one override "key=value": key as in the file (a '-' may stand for '_', so CLI flag names
// work: "device-mem"). Sizes (device_mem, host_mem) take a number with an optional binary unit:
// B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (as the CLI's --device-mem: all binary); rates a plain
// number in the key's unit. Shorthands: device_tflops / host_tflops (TFLOP/s, set the gflops key),
// device_peak_tflops (TFLOP/s, sets peak_gflops),
// link_gbps (sets h2d_gbps and d2h_gbps). disk_space, not a key of the file, takes a size or 0.
// FY_ERR_INVALID naming the bad key or value; *p is untouched then.
fy_status fy_probe_override(struct fy_probe *p, const char *key, const char *value);

// One line per field, for humans, with the keys that override them.
void fy_probe_print(const struct fy_probe *p, FILE *f);

#endif
