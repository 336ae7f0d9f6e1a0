// Token shards in llm.c's format: a header of 256 int32 (magic 20240520, version 1, token count,
// the rest 0), then `count` uint16 tokens; or, for vocabularies over 65536, llm.c's wide shards
// (magic 20240801, version 7) with uint32 tokens. Shards are mapped read-only; a data set is one shard, a
// directory of *.bin shards, or a glob pattern, taken in sorted name order.
//
// A shard may have a loss mask beside it (fine-tuning on responses alone): X.mask for the shard
// X.bin (X.bin.mask for a shard not named *.bin), a header of 256 int32 (magic 20241201, version
// 1, the shard's token count) then one byte a token, 1 when predicting that token counts in the
// loss, 0 when not (a prompt's tokens): a target whose byte is 0 becomes -100 (ignored). Shards
// without one count every target. tools/tokenize.py --prompt KEY writes them.
//
// A batch is B rows of T+1 consecutive tokens: inputs are the first T, targets the next T (targets
// are shifted by one, as the loss needs). In order: rows follow each other through the shards,
// wrapping at the end (an epoch). Shuffled: the windows of an epoch are visited in a random
// permutation drawn from the seed, different each epoch.
#ifndef FY_DATA_H
#define FY_DATA_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

#define FY_SHARD_MAGIC 20240520
#define FY_SHARD_VERSION 1
#define FY_SHARD32_MAGIC 20240801  // uint32 tokens
#define FY_SHARD32_VERSION 7
#define FY_SHARD_HEADER_INTS 256
#define FY_MASK_MAGIC 20241201  // a shard's loss mask (one byte a token)
#define FY_MASK_VERSION 1

typedef struct fy_data fy_data;

struct fy_batch {
  int64_t B, T;
  int32_t *inputs;   // (B,T) token ids
  int32_t *targets;  // (B,T) next tokens, -100 = ignored
  int32_t *mask;     // (B,T) 1 = real token, 0 = padding; NULL when every token is real
  int64_t row0;      // the stream element of its first row (rows are consecutive elements): the
                     //   same on every placement, so dropout masks are drawn from it (0 when
                     //   the batch is not the loader's)
};

// Opens the data set and checks every shard's header and every token (< vocab_size) once.
// Errors name the shard and the offending value. Rank/world split the rows of each global batch:
// rank r of W takes rows [r*B, (r+1)*B) of every window of W*B rows, so the union over ranks is
// what one process with W*B rows would see.
fy_status fy_data_open(const char *path, int64_t vocab_size, int64_t B, int64_t T, bool shuffle,
                       uint64_t seed, int rank, int world, fy_data **out);
// Fills the next batch (owned by the loader; valid until the next call).
fy_status fy_data_next(fy_data *d, struct fy_batch **out);
// The targets that count (not left out by a loss mask) in this rank's batch `ahead` batches after
// the next (0: the next), read from the masks alone: no tokens copied, the position unchanged.
int64_t fy_data_count_targets(fy_data *d, int64_t ahead);
int64_t fy_data_num_tokens(const fy_data *d);
// Position in the stream (for checkpoints): how many batches have been handed out.
int64_t fy_data_position(const fy_data *d);
fy_status fy_data_seek(fy_data *d, int64_t position);
void fy_data_close(fy_data *d);

// Writes tokens as a shard (used by tests and tools). Tokens must be < 65536.
fy_status fy_shard_write(const char *path, const uint16_t *tokens, int64_t n);
// The same as a wide shard (uint32 tokens).
fy_status fy_shard_write32(const char *path, const uint32_t *tokens, int64_t n);
// The loss mask of the shard at shard_path (n bytes, 0 or 1), written where the loader looks.
fy_status fy_shard_write_mask(const char *shard_path, const uint8_t *mask, int64_t n);

#endif
