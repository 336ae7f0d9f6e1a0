// Training checkpoints (issue: nothing lost on interruption). A checkpoint root holds one
// directory per saved step plus a `latest` file naming the newest complete one:
//
//   ROOT/latest                      "step-00000010"
//   ROOT/step-00000010/config.json   }  a Hugging Face model directory (transformers loads it)
//   ROOT/step-00000010/model.safetensors (or shards and model.safetensors.index.json)
//   ROOT/step-00000010/optimizer.safetensors  AdamW's exp_avg.<name> and exp_avg_sq.<name>, stored as
//                                    the run stored them (f32, bf16, or 8-bit codes and their
//                                    blocks' scales: runtime/checkpoint.c)
//   ROOT/step-00000010/trainer.json  step, sequences consumed, seed, loss scale, options
//   ROOT/step-00000010/checksums.xxh128  XXH3-128 of every other file, written last (xxhsum -c reads it)
//
// Everything is stored per parameter (by its Hugging Face name), never per rank or chunk, so a
// checkpoint resumes under another placement. Writing is atomic: a step directory is written
// under a temporary name, every file fsync'd, then renamed and the root fsync'd; `latest` is
// replaced (temporary file, fsync, rename) only after that, and the previous checkpoint is
// removed only once the new one is complete. A crash at any moment leaves `latest` naming a
// complete checkpoint (or no `latest` at all before the first). Every file is checked against its
// checksum before a checkpoint is read (fy_ckpt_verify): damage no parser notices is refused.
#ifndef FY_CHECKPOINT_H
#define FY_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>

#include "runtime/model.h"

#define FY_CKPT_SUMS "checksums.xxh128"

struct fy_ckpt_meta {
  int64_t step;        // optimizer steps done
  int64_t sequences;   // sequences the data loader has handed out (over all ranks)
  uint64_t seed;
  double loss_scale;
  int64_t loss_scale_good;  // steps since the loss scale last changed (dynamic scaling)
  int64_t updates;     // AdamW updates applied: step less the skipped steps (overflow, no targets)
  char options[1024];  // the run's options as JSON (informative)
  // How the run stored AdamW's m and v ("fp32", "bf16", "8bit": --optimizer-state; "" reads as
  // fp32, checkpoints before the option). optimizer.safetensors holds them in that format (f32,
  // bf16, or 8-bit codes with a scale a block, blocks counted from each parameter group's start so
  // that they are the same in every layout: runtime/checkpoint.c); checkpoints before that held
  // f32 values whatever the format, and still load. The writer takes the values the run's state
  // reads back as and stores them again in the format, to the run's bits; a resume reads values,
  // which the run's format stores to the same bits again (in another format, converted).
  char optimizer_state[8];
};

// The state to write, in host memory, in the model's flat parameter layout.
struct fy_ckpt_snapshot {
  float *params, *m, *v;  // graph->n_param_elems each
  struct fy_ckpt_meta meta;
};

struct fy_ckpt_writer;

// root is created if missing. keep: complete checkpoints kept (at least 1).
fy_status fy_ckpt_writer_create(const char *root, int keep, const struct fy_model *m,
                                 struct fy_ckpt_writer **out);
// Bytes a parameter of a checkpoint of a run with AdamW state in format f: the f32 weights and m
// and v as optimizer.safetensors holds them (8-bit: the codes and a scale a block, 2.03).
double fy_ckpt_bytes_per_param(enum fy_state_format f);
// Waits for a write in flight, then frees.
void fy_ckpt_writer_free(struct fy_ckpt_writer *w);
// The writer's own snapshot buffers, to fill before fy_ckpt_write_async (valid until then);
// allocated at the first call (NULL, with the error set, when they cannot be).
struct fy_ckpt_snapshot *fy_ckpt_snapshot_buffers(struct fy_ckpt_writer *w);
// Writes the snapshot on libuv's thread pool and returns at once; waits first for the previous
// write. Returns the previous write's error, if it had one.
fy_status fy_ckpt_write_async(struct fy_ckpt_writer *w);
// A state handed to the writer piece by piece: fill puts elements [lo, hi) of the flat weights, m
// and v (the values the state reads back as) into params, m and v (hi - lo floats each; NULL: the writer cannot take them, and the fill
// only does its part, for instance in a gather with other ranks). It is called for consecutive
// pieces covering the layout in order, each once, and for all of them even after an error.
typedef fy_status (*fy_ckpt_fill_fn)(void *ctx, int64_t lo, int64_t hi, float *params, float *m, float *v);
// Writes the state `fill` hands out in pieces of `piece` elements (the same files, the same atomic
// steps; with 8-bit state piece a multiple of FY_Q8_BLOCK, as chunks are, so no block crosses two) on the calling thread, holding one piece at a time: for a state no snapshot of which fits
// beside it (a model that fills the host memory, or chunks sharded across ranks that no rank holds
// whole). Waits first for the previous write; returns this write's status (a fill's error among them).
fy_status fy_ckpt_write_pieces(struct fy_ckpt_writer *w, const struct fy_ckpt_meta *meta, int64_t piece,
                               fy_ckpt_fill_fn fill, void *ctx);
// The fill's calls of a write of n elements in pieces of `piece`, with no buffers: what a rank that
// takes part in the gathers of another rank's fy_ckpt_write_pieces calls. The first fill error.
fy_status fy_ckpt_fill_without(int64_t n, int64_t piece, fy_ckpt_fill_fn fill, void *ctx);
// Waits for the write in flight and returns its status.
fy_status fy_ckpt_wait(struct fy_ckpt_writer *w);
// True while a write is in flight.
bool fy_ckpt_busy(struct fy_ckpt_writer *w);
double fy_ckpt_last_seconds(const struct fy_ckpt_writer *w);  // duration of the last write
double fy_ckpt_last_hash_seconds(const struct fy_ckpt_writer *w);  // of which hashing its files

// Checks every file of step directory dir against the checksums written with it (FY_CKPT_SUMS):
// a file that does not match, or a listed file or the list missing, is refused (FY_ERR_FORMAT or
// FY_ERR_NOT_FOUND, FY_ERR_IO for a read error) naming the file and the previous complete
// checkpoint in dir's root that checks out, if any, to use instead. A checkpoint written before
// checksums passes with a one-line note. A directory checked in this process is not hashed again
// while its files stand as they did (inode, size, times). fy_ckpt_load, fy_ckpt_adam_open and
// fy_ckpt_model_dir call it.
fy_status fy_ckpt_verify(const char *dir);

// Resolves a checkpoint path: a step directory, or a root (its `latest`). dir receives the step
// directory.
fy_status fy_ckpt_resolve(const char *path, char *dir, size_t n);
// The model directory path stands for: the step directory that `latest` names when path is a
// checkpoint root (into buf), else path itself (a Hugging Face model directory, or a step
// directory, which is one). *dir is buf or path. A step directory's files are checked (fy_ckpt_verify).
fy_status fy_ckpt_model_dir(const char *path, char *buf, size_t n, const char **dir);
// The configuration of the model directory path stands for (fy_ckpt_model_dir); a checkpoint's
// is named as the run that wrote it named its model (its --model, less any directory part), not
// "step-00000010".
fy_status fy_ckpt_config_read(const char *path, struct fy_opt_config *cfg);
// Reads a checkpoint into the model's parameters and into m, v (flat layout; may be NULL to skip)
// and its metadata. Checks every file's checksum (fy_ckpt_verify) and every tensor's name, shape
// and dtype. m and v receive values, whatever the checkpoint's format (the values its stored
// state reads back as).
fy_status fy_ckpt_load(const char *path, struct fy_model *model, float *m, float *v, struct fy_ckpt_meta *meta);

// A checkpoint's AdamW state read part by part, so that an offloaded run resumes one chunk at a
// time instead of holding the whole model's m and v at once. open checks every file's checksum and
// every tensor's name, shape and dtype (as fy_ckpt_load); read fills elements [lo, hi) of the flat m and v layout into
// m[0..hi-lo) and v[0..hi-lo) (elements no parameter covers are left as they are).
struct fy_ckpt_adam;
fy_status fy_ckpt_adam_open(const char *path, const struct fy_model *model, struct fy_ckpt_adam **out);
void fy_ckpt_adam_read(const struct fy_ckpt_adam *a, int64_t lo, int64_t hi, float *m, float *v);
// Elements [b0, b1) of parameter i's m and v into m[0..b1-b0) and v[0..b1-b0) (either may be NULL).
void fy_ckpt_adam_read_param(const struct fy_ckpt_adam *a, int i, int64_t b0, int64_t b1, float *m, float *v);
void fy_ckpt_adam_close(struct fy_ckpt_adam *a);

// trainer.json of a step directory (runtime/checkpoint_index.c): written atomically; read with
// every field checked (FY_ERR_FORMAT naming the file and the field).
fy_status fy_ckpt_index_write(const char *dir, const struct fy_ckpt_meta *meta);
fy_status fy_ckpt_index_read(const char *dir, struct fy_ckpt_meta *meta);
// Writes text to path through a temporary file in the same directory: fsync, rename.
fy_status fy_ckpt_write_text(const char *path, const char *text);

#endif
