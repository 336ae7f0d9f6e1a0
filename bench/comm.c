// bench/comm: the mpi backend's all-reduce, reduce-scatter and all-gather against the raw MPI calls
// in the same run (MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather; for all-reduce also
// MPI_Reduce_scatter_block + MPI_Allgather, the same two phases as ferry's deterministic one), for
// buffers of 1 MiB to 256 MiB (f32). Each point is the median over --reps of the slowest rank's time,
// ferry and MPI alternating. Bandwidths are nccl-tests' bus bandwidth: algbw = size / time, times
// 2 (n-1)/n for all-reduce and (n-1)/n for reduce-scatter and all-gather, where size is the larger
// buffer (the whole buffer of an all-reduce, the send buffer of a reduce-scatter, the receive buffer
// of an all-gather). JSON lines from rank 0; ratio = ferry's bus bandwidth / MPI's (goal >= 0.9).
//
// usage: mpirun -np 2 build/bench/comm [--min-mib 1] [--max-mib 256] [--reps 7]
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "runtime/comm.h"

enum impl { FERRY, RAW, RAW_RS_AG, NIMPL };
enum bench_op { AR, RS, AG };

struct bufs {
  float *a, *b;  // a: the all-reduce buffer / reduce-scatter send / all-gather receive; b: the other
  size_t n;      // elements of a
};

// One run of op by impl on n elements (the larger buffer); returns the slowest rank's seconds.
static double run_once(struct fy_comm *c, enum bench_op op, enum impl im, struct bufs *B, int N, int r) {
  size_t n = B->n, part = n / (size_t)N;
  MPI_Barrier(MPI_COMM_WORLD);
  double t = MPI_Wtime();
  fy_status st = FY_OK;
  int rc = MPI_SUCCESS;
  switch (op) {
    case AR:
      if (im == FERRY) st = fy_comm_all_reduce(c, B->a, n, FY_COMM_F32, NULL);
      else if (im == RAW) rc = MPI_Allreduce(MPI_IN_PLACE, B->a, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else {
        rc = MPI_Reduce_scatter_block(B->a, B->b, (int)part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        if (rc == MPI_SUCCESS)
          rc = MPI_Allgather(B->b, (int)part, MPI_FLOAT, B->a, (int)part, MPI_FLOAT, MPI_COMM_WORLD);
      }
      break;
    case RS:
      if (im == FERRY) st = fy_comm_reduce_scatter(c, B->a, B->b, part, FY_COMM_F32, NULL);
      else rc = MPI_Reduce_scatter_block(B->a, B->b, (int)part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case AG:
      if (im == FERRY) st = fy_comm_all_gather(c, B->b, B->a, part, FY_COMM_F32, NULL);
      else rc = MPI_Allgather(B->b, (int)part, MPI_FLOAT, B->a, (int)part, MPI_FLOAT, MPI_COMM_WORLD);
      break;
  }
  t = MPI_Wtime() - t;
  if (st != FY_OK || rc != MPI_SUCCESS) {
    fprintf(stderr, "comm bench: rank %d: %s\n", r, st != FY_OK ? fy_error_msg() : "MPI call failed");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  double worst = 0;
  MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

int main(int argc, char **argv) {
  double min_mib = 1, max_mib = 256;
  int reps = 7;
  for (int i = 1; i < argc; i++) {
    if (i + 1 < argc && strcmp(argv[i], "--min-mib") == 0) min_mib = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--max-mib") == 0) max_mib = atof(argv[++i]);
    else if (i + 1 < argc && strcmp(argv[i], "--reps") == 0) reps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: mpirun -np N comm [--min-mib X] [--max-mib Y] [--reps R]\n");
      return 2;
    }
  }
  if (reps < 1) reps = 1;
  struct fy_comm *c = NULL;
  if (fy_comm_create("mpi", 600, &c) != FY_OK) {
    fprintf(stderr, "comm bench: %s\n", fy_error_msg());
    return 1;
  }
  int N = fy_comm_size(c), r = fy_comm_rank(c);
  size_t max_bytes = (size_t)(max_mib * 1048576);
  struct bufs B;
  B.a = malloc(max_bytes);
  B.b = malloc(max_bytes);
  if (!B.a || !B.b) {
    fprintf(stderr, "comm bench: cannot allocate 2 x %zu bytes\n", max_bytes);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (size_t i = 0; i < max_bytes / 4; i++) B.a[i] = 1.0f, B.b[i] = 1.0f;  // touch the pages
  static const char *op_name[] = {"all-reduce", "reduce-scatter", "all-gather"};
  double *t[NIMPL];
  for (int k = 0; k < NIMPL; k++) t[k] = malloc((size_t)reps * sizeof(double));
  for (double mib = min_mib; mib <= max_mib * 1.0001; mib *= 4) {
    size_t bytes = (size_t)(mib * 1048576);
    B.n = bytes / 4 / (size_t)N * (size_t)N;  // a multiple of the world size
    bytes = B.n * 4;
    for (int op = AR; op <= AG; op++) {
      int nimpl = op == AR ? NIMPL : RAW + 1;
      for (int k = 0; k < nimpl; k++) {
        for (size_t i = 0; i < B.n; i++) B.a[i] = 1.0f;  // sums stay normal numbers
        run_once(c, op, k, &B, N, r);                     // warm-up
      }
      for (int i = 0; i < reps; i++) {
        for (size_t j = 0; j < B.n && op == AR && i % 8 == 0; j++) B.a[j] = 1.0f;
        for (int k = 0; k < nimpl; k++) t[k][i] = run_once(c, op, k, &B, N, r);
      }
      double factor = op == AR ? 2.0 * (N - 1) / N : (double)(N - 1) / N;
      double med[NIMPL], bus[NIMPL];
      for (int k = 0; k < nimpl; k++) {
        med[k] = median(t[k], reps);
        bus[k] = (double)bytes / med[k] / 1e9 * factor;
      }
      if (r == 0) {
        printf("{\"op\":\"%s\",\"bytes\":%zu,\"ranks\":%d,\"reps\":%d,\"ferry_ms\":%.3f,\"mpi_ms\":%.3f,"
               "\"ferry_busbw_gbs\":%.3f,\"mpi_busbw_gbs\":%.3f,\"ratio\":%.3f",
               op_name[op], bytes, N, reps, med[FERRY] * 1e3, med[RAW] * 1e3, bus[FERRY], bus[RAW],
               bus[FERRY] / bus[RAW]);
        if (op == AR)
          printf(",\"mpi_rs_ag_ms\":%.3f,\"mpi_rs_ag_busbw_gbs\":%.3f,\"ratio_rs_ag\":%.3f", med[RAW_RS_AG] * 1e3,
                 bus[RAW_RS_AG], bus[FERRY] / bus[RAW_RS_AG]);
        printf("}\n");
        fflush(stdout);
      }
    }
  }
  for (int k = 0; k < NIMPL; k++) free(t[k]);
  free(B.a);
  free(B.b);
  fy_comm_free(c);
  return 0;
}
