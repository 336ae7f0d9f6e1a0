// Host and disk tiers: where model state lives when it is not on the device.
//
// Host tier: memory from a jemalloc arena of its own, capped and counted, optionally pinned (the
// CUDA backend passes cudaHostRegister-like hooks) and placed on one NUMA node (the GPU's). Every
// call is thread-safe.
//
// Disk tier: slots in one scratch file under a directory, read and written asynchronously on
// libuv's thread pool. Requests run concurrently and in no particular order: a caller that needs
// one request to follow another waits for the first (fy_disk_wait) before starting the second.
// Submitting is thread-safe; a request object is used by one submitter at a time.
#ifndef FY_MEMORY_TIER_H
#define FY_MEMORY_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

// ---- host tier ----

struct fy_host_tier;

// cap: bytes callers may hold at once (0 = unlimited). numa_node: an hwloc OS index of a NUMA node
// to place the pages on, or -1 for no placement; on a single-node machine placement is a no-op.
// pin/unpin, when not NULL, are called on every allocation and free; with a pin hook every
// allocation is rounded up to whole pages so that no two allocations share a page (pinning the
// same page twice is an error for cudaHostRegister). The hooks may be called from several threads
// at once. When pin fails (a system that limits pinned memory), the block and every later one stay
// pageable (one warning says so; pin is not called again) and unpin is called only for the blocks
// pin pinned.
fy_status fy_host_tier_create(size_t cap, int numa_node, fy_status (*pin)(void *p, size_t n),
                              void (*unpin)(void *p), struct fy_host_tier **out);
// Returns the arena's memory to the system; allocations still held become invalid.
void fy_host_tier_free(struct fy_host_tier *t);
// n bytes, 64-byte aligned, zeroed. Over the cap: FY_ERR_NOMEM, message with requested/in use/cap.
fy_status fy_host_alloc(struct fy_host_tier *t, size_t n, void **out);
// n must be the size given to fy_host_alloc. p == NULL is a no-op.
void fy_host_dealloc(struct fy_host_tier *t, void *p, size_t n);
// Bytes held by callers now and at most so far (requested sizes).
size_t fy_host_in_use(const struct fy_host_tier *t);
size_t fy_host_peak(const struct fy_host_tier *t);
// The cap given at creation.
size_t fy_host_cap(const struct fy_host_tier *t);

// The NUMA node (hwloc OS index) nearest to a PCI device given by its bus id ("0000:3b:00.0", as
// cudaDeviceGetPCIBusId writes it), or -1 when unknown. sim/cpu callers pass -1 to the tier.
int fy_numa_node_of_pci(const char *bus_id);
// The NUMA node of the calling thread (its binding, else the CPU it last ran on), or -1.
int fy_numa_node_of_cpuset_default(void);

// ---- disk tier ----

struct fy_disk_tier;

// Creates dir/ferry-<pid>-<n>.bin. The directory must exist and be writable: this is checked by
// creating and writing a probe file (FY_ERR_IO naming the directory and the errno text otherwise).
// cap: bytes that may be reserved (0 = unlimited); when cap > 0 the file system's free space must
// hold it (FY_ERR_IO otherwise).
fy_status fy_disk_tier_open(const char *dir, size_t cap, struct fy_disk_tier **out);
// Waits for pending requests, then removes the tier's file.
void fy_disk_tier_close(struct fy_disk_tier *t);
// The bytes a slot of n bytes takes in a tier's file (n rounded up to 4 KiB, as fy_disk_alloc).
size_t fy_disk_slot_bytes(size_t n);
// The bytes free on dir's file system now for a writer without root (statvfs's f_bavail):
// FY_ERR_IO naming dir when it cannot be asked.
fy_status fy_disk_space(const char *dir, double *bytes);
// Reserves n bytes (rounded up to 4 KiB) and returns their offset in the file as the handle. The
// file grows sparsely, so a full disk shows up on write, not here. Over the cap: FY_ERR_NOMEM.
// Slots are never returned before close.
fy_status fy_disk_alloc(struct fy_disk_tier *t, size_t n, int64_t *handle);

struct fy_disk_req;  // opaque, reusable once waited for
fy_status fy_disk_req_create(struct fy_disk_req **out);
// r must not be in flight (wait for it first).
void fy_disk_req_free(struct fy_disk_req *r);
// Start a read/write of n bytes at handle+off into/from buf and return at once; buf must stay valid
// until fy_disk_wait returns. FY_ERR_INVALID when the range is outside the reserved slots or r is
// still in flight.
fy_status fy_disk_read_async(struct fy_disk_tier *t, int64_t handle, size_t off, void *buf, size_t n,
                             struct fy_disk_req *r);
fy_status fy_disk_write_async(struct fy_disk_tier *t, int64_t handle, size_t off, const void *buf,
                              size_t n, struct fy_disk_req *r);
// Blocks until r completes and returns its status (FY_OK for a request never started). A failed or
// short write gives FY_ERR_IO "disk tier <dir>: writing N bytes failed: <errno text>"; a short read
// FY_ERR_IO too. A failed write leaves the bytes of that range undefined, and every other range
// as it was.
fy_status fy_disk_wait(struct fy_disk_req *r);
// Bytes reserved (sum of rounded slot sizes).
size_t fy_disk_in_use(const struct fy_disk_tier *t);

// Bytes moved by successful requests and the seconds spent in read/write calls (summed over
// requests, so concurrent requests add up).
struct fy_disk_stats {
  double read_bytes, write_bytes, read_s, write_s;
};
void fy_disk_stats(const struct fy_disk_tier *t, struct fy_disk_stats *out);

// Test hook: each request waits a random 0..max_us microseconds before it runs (drawn at
// submission from a generator seeded with seed); 0 = off. Finds callers that forget to wait.
void fy_disk_set_jitter(struct fy_disk_tier *t, int max_us, uint64_t seed);

#endif
