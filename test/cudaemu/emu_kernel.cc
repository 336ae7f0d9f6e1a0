// The CUDA emulator's kernels: a block's threads as fibers on a stream's worker thread, its
// barriers, the warp meetings (shuffles, mma.sync, ldmatrix) and cp.async.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <vector>

#include "test/cudaemu/emu_internal.h"

// A switch back to the scheduler restores every register it saved: nothing is clobbered
#pragma GCC diagnostic ignored "-Wclobbered"

// Switching fibers: on x86-64 a few instructions that keep the callee-saved registers on the
// fiber's stack (kernels leave the floating-point control words alone; swapcontext also saves the
// signal mask: two system calls a switch, most of an emulated kernel's time); elsewhere, and under
// AddressSanitizer (which follows swapcontext's stack changes), ucontext.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define FAST_SWITCH 1
extern "C" void fy_emu_switch(void **save_sp, void *load_sp);
asm(R"(
  .text
  .globl fy_emu_switch
  .type fy_emu_switch, @function
fy_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fy_emu_switch, .-fy_emu_switch
)");
struct context {
  void *sp;
};
#else
#define FAST_SWITCH 0
struct context {
  ucontext_t uc;
};
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace {

const size_t STACK = 256 << 10;  // a fiber's stack (and a guard page below it)

enum fiber_state { READY, AT_BARRIER, AT_WARP, DONE };

struct async_copy {
  void *dst;
  const void *src;
  bool ok;
};

struct fiber {
  context ctx;
  char *stack;
  uint3 tid;
  int lane, warp;
  fiber_state state;
  unsigned wait;  // AT_BARRIER: the generation it waits to end; AT_WARP: the meeting's number
  const char *where;
  unsigned warp_seq;  // warp meetings entered
  std::vector<async_copy> copies;
};

struct warp_slot {
  const char *what;
  fy_emu_warp_fn fn;
  int arrived;
  unsigned char in[32][64], out[32][64];
};

struct warp_state {
  int lanes;
  unsigned completed;  // meetings completed (in order)
  warp_slot slot[2];   // meeting k uses slot k % 2: k + 2 starts only after every lane left k
};

struct block_run {
  const char *kernel;
  const std::function<void()> *body;
  int n, exited, bar_arrived;
  unsigned bar_gen;
  uint64_t progress;
  uint64_t rng;
  std::vector<warp_state> warps;
  fiber *cur;
  context sched;
};

thread_local std::vector<char *> stacks;  // this worker's fiber stacks, kept across launches
thread_local std::vector<fiber> fibers;
thread_local block_run *run;
thread_local unsigned char *dyn_smem;

uint64_t next_random(uint64_t *s) {  // xorshift64*
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

// v in an order drawn at random (Fisher-Yates)
template <typename T>
void shuffle(std::vector<T> &v, uint64_t *rng) {
  for (size_t i = v.size(); i > 1; i--) std::swap(v[i - 1], v[next_random(rng) % i]);
}

char *stack_get(size_t i) {
  while (stacks.size() <= i) {
    long page = sysconf(_SC_PAGESIZE);
    char *m = (char *)mmap(NULL, STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                           -1, 0);
    if (m == MAP_FAILED) fy_emu_fail("cannot map a fiber stack");
    mprotect(m, page, PROT_NONE);  // an overflowing kernel stack faults here
    stacks.push_back(m + page);
  }
  return stacks[i];
}

void context_switch(context *save, context *load) {
#if FAST_SWITCH
  fy_emu_switch(&save->sp, load->sp);
#else
  swapcontext(&save->uc, &load->uc);
#endif
}

void yield_to_scheduler(fiber *f) { context_switch(&f->ctx, &run->sched); }

void copy_now(const async_copy &c) {
  if (c.ok) {
    fy_emu_check_range(c.src, 16, "cp.async source");
    memcpy(c.dst, c.src, 16);
  } else {
    memset(c.dst, 0, 16);
  }
}

void barrier_release_if_complete() {
  if (run->bar_arrived > 0 && run->bar_arrived + run->exited == run->n) {
    run->bar_gen++;
    run->bar_arrived = 0;
    run->progress++;
  }
}

void fiber_main() {
  fiber *f = run->cur;
  (*run->body)();
  if (!f->copies.empty())
    fy_emu_fail("kernel %s: thread (%u,%u,%u) of block (%u,%u,%u) ended with cp.async copies not waited for",
                run->kernel, f->tid.x, f->tid.y, f->tid.z, blockIdx.x, blockIdx.y, blockIdx.z);
  f->state = DONE;
  run->exited++;
  run->progress++;
  barrier_release_if_complete();
  yield_to_scheduler(f);  // for good: a fiber that is done is not resumed
  fy_emu_fail("a finished fiber resumed");
}

// f's context: fiber_main on f's stack, at its first switch
void context_start(fiber &f) {
#if FAST_SWITCH
  uint64_t *top = (uint64_t *)(f.stack + STACK);  // 16-byte aligned
  *--top = 0;                                     // fiber_main's return address (it never returns)
  *--top = (uint64_t)(uintptr_t)&fiber_main;      // fy_emu_switch's ret: 16-byte aligned, as a call leaves it
  for (int i = 0; i < 6; i++) *--top = 0;          // rbp rbx r12 r13 r14 r15
  f.ctx.sp = top;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack;
  f.ctx.uc.uc_stack.ss_size = STACK;
  f.ctx.uc.uc_link = NULL;
  makecontext(&f.ctx.uc, fiber_main, 0);
#endif
}

bool runnable(const fiber &f) {
  switch (f.state) {
    case READY: return true;
    case AT_BARRIER: return run->bar_gen != f.wait;
    case AT_WARP: return run->warps[f.warp].completed > f.wait;
    default: return false;
  }
}

[[noreturn]] void deadlock() {
  char msg[4096];
  int len = snprintf(msg, sizeof msg, "kernel %s: block (%u,%u,%u) cannot go on (a hang on a GPU):", run->kernel,
                     blockIdx.x, blockIdx.y, blockIdx.z);
  int shown = 0;
  for (auto &f : fibers) {
    if (f.state == DONE || shown >= 8) continue;
    shown++;
    len += snprintf(msg + len, sizeof msg - len, " thread %u waits at %s;", f.tid.x + blockDim.x * (f.tid.y + blockDim.y * f.tid.z),
                    f.where);
    if (len >= (int)sizeof msg) break;
  }
  fy_emu_fail("%s (%d of %d threads have returned)", msg, run->exited, run->n);
}

}  // namespace

void fy_emu_run_grid(const char *name, dim3 grid, dim3 block, size_t smem, uint64_t seed,
                     const std::function<void()> &body) {
  const int n = (int)(block.x * block.y * block.z);
  block_run r{};
  r.kernel = name;
  r.body = &body;
  r.n = n;
  r.rng = seed * 0x9E3779B97F4A7C15ull | 1;
  run = &r;
  gridDim = grid;
  blockDim = block;
  // The dynamic shared memory: exactly the launch's bytes (a sanitizer sees a read past them)
  void *smem_mem = NULL;
  if (smem && posix_memalign(&smem_mem, 128, smem) != 0)
    fy_emu_fail("kernel %s: cannot allocate %zu bytes of shared memory", name, smem);
  dyn_smem = (unsigned char *)smem_mem;
  fibers.resize(n);
  std::vector<int> order(n);
  // The blocks in an order drawn at random: no block may count on another's having run
  const uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
  if (nblocks > UINT32_MAX) fy_emu_fail("kernel %s: %llu blocks: more than the emulator takes", name, (unsigned long long)nblocks);
  std::vector<uint32_t> blocks(nblocks);
  for (uint64_t b = 0; b < nblocks; b++) blocks[b] = (uint32_t)b;
  shuffle(blocks, &r.rng);
  for (uint64_t bi = 0; bi < nblocks; bi++) {
    const uint64_t b = blocks[bi];
    blockIdx = make_uint3((unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                          (unsigned)(b / ((uint64_t)grid.x * grid.y)));
    if (smem) memset(dyn_smem, 0xff, smem);  // NaN in fp32 and bf16: what was never written shows
    r.exited = r.bar_arrived = 0;
    r.bar_gen = 0;
    r.warps.resize((n + 31) / 32);  // (the slots' 8 KiB of operands need no clearing)
    for (int w = 0; w < (int)r.warps.size(); w++) {
      warp_state &ws = r.warps[w];
      ws.lanes = n - 32 * w < 32 ? n - 32 * w : 32;
      ws.completed = 0;
      ws.slot[0].arrived = ws.slot[1].arrived = 0;
    }
    for (int i = 0; i < n; i++) {
      fiber &f = fibers[i];
      f.tid = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
      f.lane = i % 32;
      f.warp = i / 32;
      f.state = READY;
      f.where = "its start";
      f.warp_seq = 0;
      f.copies.clear();
      f.stack = stack_get(i);
      context_start(f);
      order[i] = i;
    }
    while (r.exited < n) {
      shuffle(order, &r.rng);  // this round's order
      uint64_t before = r.progress;
      for (int k = 0; k < n; k++) {
        fiber &f = fibers[order[k]];
        if (!runnable(f)) continue;
        r.cur = &f;
        threadIdx = f.tid;
        context_switch(&r.sched, &f.ctx);
      }
      if (r.progress == before && r.exited < n) deadlock();
    }
  }
  free(smem_mem);
  dyn_smem = NULL;
  run = NULL;
}

void *fy_emu_dynamic_smem(void) { return dyn_smem; }

void __syncthreads(void) {
  fiber *f = run->cur;
  const unsigned gen = run->bar_gen;
  run->bar_arrived++;
  run->progress++;
  barrier_release_if_complete();
  if (run->bar_gen != gen) return;  // the last to arrive
  f->state = AT_BARRIER;
  f->wait = gen;
  f->where = "__syncthreads";
  yield_to_scheduler(f);
  f->state = READY;
  threadIdx = f->tid;
}

void fy_emu_warp(unsigned mask, const char *what, fy_emu_warp_fn fn, const void *in, size_t n_in, void *out,
                 size_t n_out) {
  fiber *f = run->cur;
  warp_state &w = run->warps[f->warp];
  const unsigned lanes = w.lanes == 32 ? 0xffffffffu : (1u << w.lanes) - 1;
  if (mask != lanes)
    fy_emu_fail("kernel %s: %s in warp %d with mask %#x, but the warp's threads are %#x (the emulator "
                "takes whole warps only)",
                run->kernel, what, f->warp, mask, lanes);
  const unsigned seq = f->warp_seq++;
  warp_slot &s = w.slot[seq & 1];
  if (s.arrived == 0) {
    s.what = what;
    s.fn = fn;
  } else if (s.fn != fn) {
    fy_emu_fail("kernel %s: the threads of warp %d meet at different instructions (%s and %s)", run->kernel,
                f->warp, s.what, what);
  }
  memcpy(s.in[f->lane], in, n_in);
  run->progress++;
  if (++s.arrived == w.lanes) {
    fn(s.in, s.out, w.lanes);
    s.arrived = 0;
    w.completed = seq + 1;
  } else {
    f->state = AT_WARP;
    f->wait = seq;
    f->where = what;
    yield_to_scheduler(f);
    f->state = READY;
    threadIdx = f->tid;
  }
  memcpy(out, s.out[f->lane], n_out);
}

void fy_emu_shfl_xor_fn(const unsigned char in[32][64], unsigned char out[32][64], int lanes) {
  for (int l = 0; l < lanes; l++) {
    fy_emu_shfl_in a;
    memcpy(&a, in[l], sizeof a);
    int src = l ^ a.arg;
    if (src >= lanes) src = l;  // a lane outside the warp: the caller's own value, as on a GPU
    fy_emu_shfl_in b;
    memcpy(&b, in[src], sizeof b);
    memcpy(out[l], &b.v, sizeof b.v);
  }
}

void fy_emu_shfl_up_fn(const unsigned char in[32][64], unsigned char out[32][64], int lanes) {
  for (int l = 0; l < lanes; l++) {
    fy_emu_shfl_in a;
    memcpy(&a, in[l], sizeof a);
    int src = l - a.arg >= 0 ? l - a.arg : l;  // lanes below delta keep their own value
    fy_emu_shfl_in b;
    memcpy(&b, in[src], sizeof b);
    memcpy(out[l], &b.v, sizeof b.v);
  }
}

// ---- tensor cores ----
//
// mma.m16n8k16 with .row.col bf16 inputs and fp32 accumulators, fragments as the PTX ISA lays
// them out (lane = 4 g + t): A (16x16) a0: (g, 2t..2t+1), a1: (g+8, 2t..), a2: (g, 2t+8..),
// a3: (g+8, 2t+8..); B (16x8, k x n) b0: (2t..2t+1, g), b1: (2t+8.., g); C and D (16x8) c0, c1:
// (g, 2t..2t+1), c2, c3: (g+8, 2t..2t+1). In a 32-bit register the lower-numbered element is the
// low half.

namespace {

float bf16_lo(uint32_t r) {
  uint32_t u = r << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
float bf16_hi(uint32_t r) {
  uint32_t u = r & 0xffff0000u;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

struct mma_in {
  float c[4];
  uint32_t a[4], b[2];
};

void mma_fn(const unsigned char in[32][64], unsigned char out[32][64], int lanes) {
  if (lanes != 32) fy_emu_fail("mma.sync in a warp of %d threads", lanes);
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; l++) {
    mma_in m;
    memcpy(&m, in[l], sizeof m);
    const int g = l >> 2, t = l & 3;
    A[g][2 * t] = bf16_lo(m.a[0]), A[g][2 * t + 1] = bf16_hi(m.a[0]);
    A[g + 8][2 * t] = bf16_lo(m.a[1]), A[g + 8][2 * t + 1] = bf16_hi(m.a[1]);
    A[g][2 * t + 8] = bf16_lo(m.a[2]), A[g][2 * t + 9] = bf16_hi(m.a[2]);
    A[g + 8][2 * t + 8] = bf16_lo(m.a[3]), A[g + 8][2 * t + 9] = bf16_hi(m.a[3]);
    B[2 * t][g] = bf16_lo(m.b[0]), B[2 * t + 1][g] = bf16_hi(m.b[0]);
    B[2 * t + 8][g] = bf16_lo(m.b[1]), B[2 * t + 9][g] = bf16_hi(m.b[1]);
    C[g][2 * t] = m.c[0], C[g][2 * t + 1] = m.c[1];
    C[g + 8][2 * t] = m.c[2], C[g + 8][2 * t + 1] = m.c[3];
  }
  float D[16][8];
  for (int i = 0; i < 16; i++)
    for (int j = 0; j < 8; j++) {
      double s = 0;  // products of bf16 are exact in double; the sum rounds once
      for (int k = 0; k < 16; k++) s += (double)A[i][k] * B[k][j];
      D[i][j] = (float)(s + C[i][j]);
    }
  for (int l = 0; l < 32; l++) {
    const int g = l >> 2, t = l & 3;
    float d[4] = {D[g][2 * t], D[g][2 * t + 1], D[g + 8][2 * t], D[g + 8][2 * t + 1]};
    memcpy(out[l], d, sizeof d);
  }
}

// ldmatrix .x4: lane l addresses row l % 8 of matrix l / 8 (8 b16 elements); lane l = 4 g + t
// receives, of matrix i, the elements (row g, columns 2t and 2t+1), or with .trans (row 2t, column
// g) and (row 2t+1, column g).
void ldmatrix_x4(const unsigned char in[32][64], unsigned char out[32][64], int lanes, bool trans) {
  if (lanes != 32) fy_emu_fail("ldmatrix in a warp of %d threads", lanes);
  uint16_t M[4][8][8];
  for (int l = 0; l < 32; l++) {
    const uint16_t *row;
    memcpy(&row, in[l], sizeof row);
    if (((uintptr_t)row & 15) != 0) fy_emu_fail("ldmatrix: row address %p is not 16-byte aligned", (const void *)row);
    memcpy(M[l / 8][l % 8], row, 16);
  }
  for (int l = 0; l < 32; l++) {
    const int g = l >> 2, t = l & 3;
    uint32_t r[4];
    for (int i = 0; i < 4; i++)
      r[i] = trans ? (uint32_t)M[i][2 * t][g] | (uint32_t)M[i][2 * t + 1][g] << 16
                   : (uint32_t)M[i][g][2 * t] | (uint32_t)M[i][g][2 * t + 1] << 16;
    memcpy(out[l], r, sizeof r);
  }
}
void ldmatrix_fn(const unsigned char in[32][64], unsigned char out[32][64], int lanes) {
  ldmatrix_x4(in, out, lanes, false);
}
void ldmatrix_trans_fn(const unsigned char in[32][64], unsigned char out[32][64], int lanes) {
  ldmatrix_x4(in, out, lanes, true);
}

}  // namespace

void fy_emu_mma_m16n8k16_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  mma_in m;
  memcpy(m.c, c, sizeof m.c);
  memcpy(m.a, a, sizeof m.a);
  m.b[0] = b0;
  m.b[1] = b1;
  fy_emu_warp(0xffffffffu, "mma.sync", mma_fn, &m, sizeof m, c, 4 * sizeof(float));
}

void fy_emu_ldmatrix_x4(uint32_t r[4], const void *row) {
  fy_emu_warp(0xffffffffu, "ldmatrix", ldmatrix_fn, &row, sizeof row, r, 4 * sizeof(uint32_t));
}

void fy_emu_ldmatrix_x4_trans(uint32_t r[4], const void *row) {
  fy_emu_warp(0xffffffffu, "ldmatrix", ldmatrix_trans_fn, &row, sizeof row, r, 4 * sizeof(uint32_t));
}

void fy_emu_cp_async16(void *dst, const void *src, bool ok) {
  if (((uintptr_t)dst | (ok ? (uintptr_t)src : 0)) & 15)
    fy_emu_fail("kernel %s: cp.async of 16 bytes at unaligned addresses %p <- %p", run->kernel, dst, src);
  async_copy c = {dst, src, ok};
  if (next_random(&run->rng) & 1) copy_now(c);  // lands at once, or at the wait
  else run->cur->copies.push_back(c);
}

void fy_emu_cp_async_wait_all(void) {
  fiber *f = run->cur;
  for (const async_copy &c : f->copies) copy_now(c);
  f->copies.clear();
}

void fy_emu_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "cudaemu: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  fflush(stderr);
  abort();
}

uint64_t fy_emu_seed(void) {
  static uint64_t seed = [] {
    const char *s = getenv("FY_EMU_SEED");
    return s && *s ? strtoull(s, NULL, 10) : 1ull;
  }();
  return seed;
}
