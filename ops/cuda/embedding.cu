// Embedding lookup and its deterministic scatter-add backward.
#include "ops/cuda/common.cuh"

// ids (BT) int32, table (V,C) -> out (BT,C)
template <typename T>
__global__ void embedding_forward_kernel(T *out, const int32_t *ids, const T *table, int64_t BT,
                                         int64_t C) {
  // One block row per token row: the id is read once per block, the channels are coalesced.
  for (int64_t i = blockIdx.x; i < BT; i += gridDim.x) {
    const T *src = table + (int64_t)ids[i] * C;
    T *dst = out + i * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dst[c] = src[c];
  }
}

#define EMB_ROWS 64     // table rows a block owns
#define EMB_COLS 128    // channels a block owns (one per thread)
#define EMB_PER 8       // ids each thread examines per round
#define EMB_IDS (EMB_COLS * EMB_PER)  // ids per round

// dout (BT,C), ids (BT) -> dtable (V,C) +=
// Block (rb, cb) owns table rows [rb*64, rb*64+64) and channels [cb*128, cb*128+128), so each
// dtable element has exactly one writer: no atomics. The block reads the ids in rounds of 1024:
// thread t examines ids t*8 .. t*8+7 of the round and keeps those in the block's rows; a prefix
// sum over the threads' counts packs them, in token order, into a list in shared memory; then
// thread c adds dout[i][c] for every listed token into its fp32 accumulator for that row. Tokens
// of one id are thus summed in token order (deterministic), a bf16 table is rounded once, and the
// serial part of a block is its matches (about BT * 64 / V), not all BT ids.
template <typename T>
__global__ void __launch_bounds__(EMB_COLS)
embedding_backward_kernel(T *dtable, const T *dout, const int32_t *ids, int64_t BT, int64_t C,
                          int64_t V) {
  __shared__ float acc[EMB_ROWS][EMB_COLS];
  __shared__ int32_t list_i[EMB_IDS];    // token index within the round
  __shared__ unsigned char list_r[EMB_IDS];  // row within the block's range
  __shared__ int warp_total[EMB_COLS / 32];
  __shared__ int touched[EMB_ROWS];
  const int64_t v0 = (int64_t)blockIdx.x * EMB_ROWS;
  const int64_t c = (int64_t)blockIdx.y * EMB_COLS + threadIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int r = 0; r < EMB_ROWS; r++) acc[r][threadIdx.x] = 0.0f;
  if (threadIdx.x < EMB_ROWS) touched[threadIdx.x] = 0;
  for (int64_t i0 = 0; i0 < BT; i0 += EMB_IDS) {
    // This thread's matches among its 8 ids.
    int rows[EMB_PER], n = 0;
#pragma unroll
    for (int k = 0; k < EMB_PER; k++) {
      int64_t i = i0 + threadIdx.x * EMB_PER + k;
      int64_t r = i < BT ? (int64_t)ids[i] - v0 : -1;
      rows[k] = r >= 0 && r < EMB_ROWS && r + v0 < V ? (int)r : -1;
      n += rows[k] >= 0;
    }
    // Exclusive prefix sum of n over the block, in thread order.
    int incl = n;
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    __syncthreads();  // the previous round's list is consumed
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    int base = 0, total = 0;
    for (int w = 0; w < EMB_COLS / 32; w++) {
      if (w < warp) base += warp_total[w];
      total += warp_total[w];
    }
    int pos = base + incl - n;
#pragma unroll
    for (int k = 0; k < EMB_PER; k++)
      if (rows[k] >= 0) {
        list_i[pos] = threadIdx.x * EMB_PER + k;
        list_r[pos] = (unsigned char)rows[k];
        touched[rows[k]] = 1;
        pos++;
      }
    __syncthreads();
    if (c < C) {
      // Eight loads in flight before the adds (a frequent id makes this loop long); the adds
      // stay in list order.
      int j = 0;
      for (; j + 8 <= total; j += 8) {
        float g[8];
#pragma unroll
        for (int k = 0; k < 8; k++) g[k] = fy_ld(dout + (i0 + list_i[j + k]) * C + c);
#pragma unroll
        for (int k = 0; k < 8; k++) acc[list_r[j + k]][threadIdx.x] += g[k];
      }
      for (; j < total; j++) acc[list_r[j]][threadIdx.x] += fy_ld(dout + (i0 + list_i[j]) * C + c);
    }
  }
  __syncthreads();
  if (c >= C) return;
  // Untouched rows are not read or written (less traffic). The touched ones go eight at a time,
  // all loads before the stores: they are distinct rows, and a load behind each store would
  // serialise the loop.
  const int nrows = V - v0 < EMB_ROWS ? (int)(V - v0) : EMB_ROWS;
  for (int r0 = 0; r0 < nrows; r0 += 8) {
    float old[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
      if (r0 + k < nrows && touched[r0 + k]) old[k] = fy_ld(dtable + (v0 + r0 + k) * C + c);
#pragma unroll
    for (int k = 0; k < 8; k++)
      if (r0 + k < nrows && touched[r0 + k])
        fy_st(dtable + (v0 + r0 + k) * C + c, old[k] + acc[r0 + k][threadIdx.x]);
  }
}

extern "C" fy_status fy_cuda_embedding_forward(void *out, const int32_t *ids, const void *table,
                                               enum fy_dtype dt, int64_t BT, int64_t C,
                                               cudaStream_t st) {
  if (BT <= 0 || C <= 0) return FY_OK;
  unsigned grid = (unsigned)(BT < 65536 ? BT : 65536);
  int threads = C >= 256 ? 256 : 64;
  FY_CUDA_DISPATCH("embedding_forward", dt, T,
                   embedding_forward_kernel<T><<<grid, threads, 0, st>>>(
                       (T *)out, ids, (const T *)table, BT, C));
  return fy_cuda_launched("embedding_forward");
}

extern "C" fy_status fy_cuda_embedding_backward(void *dtable, const void *dout,
                                                const int32_t *ids, enum fy_dtype dt, int64_t BT,
                                                int64_t C, int64_t V, cudaStream_t st) {
  if (BT <= 0 || C <= 0 || V <= 0) return FY_OK;
  int64_t rb = (V + EMB_ROWS - 1) / EMB_ROWS, cb = (C + EMB_COLS - 1) / EMB_COLS;
  if (rb > 0x7fffffff || cb > 65535)
    return fy_error_set(FY_ERR_UNSUPPORTED, "cuda embedding_backward: V=%lld C=%lld too large",
                        (long long)V, (long long)C);
  dim3 grid((unsigned)rb, (unsigned)cb);
  FY_CUDA_DISPATCH("embedding_backward", dt, T,
                   embedding_backward_kernel<T><<<grid, EMB_COLS, 0, st>>>(
                       (T *)dtable, (const T *)dout, ids, BT, C, V));
  return fy_cuda_launched("embedding_backward");
}
