// Safetensors files (Hugging Face's format): an 8-byte little-endian header length, a JSON header
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw data. Reading maps the file and checks every header claim against the file size
// (offsets inside the data, end - begin = numel * dtype size, no overlap); a file that lies is
// refused with FY_ERR_FORMAT and a message naming the file and the tensor.
//
// A model directory holds either `model.safetensors` or shards listed in
// `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {"name": "file", ...}}).
#ifndef FY_SAFETENSORS_H
#define FY_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

struct fy_st_tensor {
  const char *name;      // owned by the file or set that holds it
  enum fy_dtype dtype;
  int rank;
  int64_t shape[FY_MAX_RANK];
  const void *data;      // points into the mapping (read) or to caller memory (write)
  size_t nbytes;
};

// A set of tensors read from one file or from a sharded directory. Opaque.
typedef struct fy_safetensors fy_safetensors;

// Opens one .safetensors file.
fy_status fy_safetensors_open(const char *path, fy_safetensors **out);
// Opens a model directory: model.safetensors.index.json if present (all its shards), else
// model.safetensors. Error if neither exists.
fy_status fy_safetensors_open_dir(const char *dir, fy_safetensors **out);
// The weights file a Hugging Face model directory holds, the first there of
// model.safetensors.index.json, model.safetensors, pytorch_model.bin.index.json and
// pytorch_model.bin (the last two PyTorch pickles, which ferry does not read); NULL for none.
const char *fy_safetensors_dir_weights(const char *dir);
void fy_safetensors_close(fy_safetensors *st);

int fy_safetensors_count(const fy_safetensors *st);
const struct fy_st_tensor *fy_safetensors_at(const fy_safetensors *st, int i);
// NULL if absent.
const struct fy_st_tensor *fy_safetensors_find(const fy_safetensors *st, const char *name);
// Bytes [p, p + n) of an open file's tensor data will not be read again soon: their whole pages
// leave this process's resident memory (they stay in the page cache; reading them again reloads
// them). For reading a large file part by part.
void fy_safetensors_done_with(const void *p, size_t n);

// Writes `n` tensors to one file, atomically (a temporary file in the same directory, fsync'd,
// then renamed). metadata: NULL or pairs of strings {key, value, key, value, ..., NULL}.
fy_status fy_safetensors_write(const char *path, const struct fy_st_tensor *tensors, int n,
                               const char *const *metadata);
// Writes a model directory: model.safetensors when the total is at most max_shard_bytes (0 = never
// shard), else model-00001-of-0000N.safetensors ... plus model.safetensors.index.json.
fy_status fy_safetensors_write_dir(const char *dir, const struct fy_st_tensor *tensors, int n,
                                   size_t max_shard_bytes);

// A file (or model directory) written part by part, for a state too large to hold whole at once:
// the tensors' names, dtypes and shapes are fixed at open (their data pointers are not read), and
// the header goes out then; put writes bytes [off, off + n) of tensor i, in any order; commit
// checks that every byte of every tensor was put, then makes the files (and a sharded directory's
// index) take their names as the writes above do. commit and abort free the writer; abort
// removes what was written. The files are the same bytes as the writes above would make.
typedef struct fy_st_writer fy_st_writer;  // (struct fy_st_writer where a header only names it)
fy_status fy_st_writer_open(const char *path, const struct fy_st_tensor *tensors, int n,
                            const char *const *metadata, fy_st_writer **out);
fy_status fy_st_writer_open_dir(const char *dir, const struct fy_st_tensor *tensors, int n,
                                size_t max_shard_bytes, fy_st_writer **out);
fy_status fy_st_writer_put(fy_st_writer *w, int i, size_t off, const void *data, size_t n);
fy_status fy_st_writer_commit(fy_st_writer *w);
void fy_st_writer_abort(fy_st_writer *w);

#endif
