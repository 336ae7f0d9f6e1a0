#!/usr/bin/env python3
"""Turn text files into ferry's token shards (llm.c's format).

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, token count, the rest
0) followed by that many uint16 tokens; a tokenizer with more than 65536 tokens gets llm.c's wide
shards instead (magic 20240801, version 7, uint32 tokens). Each input FILE is one document, or with
--jsonl KEY each line of a JSON Lines file is an object whose KEY string is one document; documents
are separated by an end-of-text token. Shards are written as PREFIX_000000.bin, PREFIX_000001.bin, ...

Fine-tuning on responses: with --jsonl KEY --prompt PKEY each line holds a prompt (its PKEY string)
and a response (its KEY string); a record is the prompt's tokens, the response's and an end-of-text
token, and each shard gets a loss mask beside it (PREFIX_000000.mask: a header of 256 int32, magic
20241201, version 1, the token count, then one byte a token) that is 0 on the prompt's tokens and 1
on the rest, so that ferry learns to predict the responses (and where they end) and not the
prompts.

  --tokenizer bytes   one token per UTF-8 byte (0..255), 256 = end of text; needs nothing but the
                      standard library (the demo model's vocabulary is 512 wide, so ids fit).
  --tokenizer NAME    a Hugging Face tokenizer name or directory (e.g. facebook/opt-125m), loaded
                      with transformers' AutoTokenizer; its eos token separates documents.

Examples:
  python3 tools/tokenize.py --tokenizer bytes --out data/corpus data/corpus.txt
  python3 tools/tokenize.py --tokenizer facebook/opt-125m --out /data/wiki/wiki --shard-tokens 100000000 a.txt b.txt
  python3 tools/tokenize.py --tokenizer facebook/opt-125m --jsonl text --out /data/web/web part-0.jsonl part-1.jsonl
  python3 tools/tokenize.py --tokenizer facebook/opt-125m --jsonl response --prompt prompt --out /data/sft/sft train.jsonl
"""

import os
import sys

# This file shares its name with the standard library's `tokenize` (which inspect, linecache and
# so transformers import): drop the script's own directory from the path so that they get the real
# one.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
if getattr(sys.modules.get("tokenize"), "__file__", None) == os.path.abspath(__file__):
    del sys.modules["tokenize"]

import argparse  # noqa: E402
import array  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402

MAGIC, VERSION = 20240520, 1        # uint16 tokens
MASK_MAGIC, MASK_VERSION = 20241201, 1  # a shard's loss mask, one byte a token
WIDE_MAGIC, WIDE_VERSION = 20240801, 7  # uint32 tokens
HEADER_INTS = 256
MAX_SHARD_TOKENS = 2**31 - 1  # the header's count is an int32
BYTES_EOT = 256
READ_CHUNK = 1 << 20  # characters per chunk given to the tokenizer
BATCH_CHUNKS = 16  # chunks per tokenizer call


def write_shard(path, tokens):
    """Writes `tokens` (array('H'), or array('I') for a wide shard) atomically: a temporary file in
    the same directory, renamed."""
    wide = tokens.itemsize == 4
    write_with_header(path, (WIDE_MAGIC, WIDE_VERSION) if wide else (MAGIC, VERSION), tokens)


def write_mask(path, mask):
    """Writes a loss mask (bytes, 0 or 1 a token) atomically."""
    write_with_header(path, (MASK_MAGIC, MASK_VERSION), array.array("B", mask))


def write_with_header(path, magic_version, tokens):
    """The 256-int32 header (magic, version, count) and the array, through a temporary file in the
    same directory, renamed."""
    header = array.array("i", [0] * HEADER_INTS)
    header[0], header[1] = magic_version
    header[2] = len(tokens)
    if sys.byteorder != "little":
        header.byteswap()
        tokens = array.array(tokens.typecode, tokens)
        tokens.byteswap()
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp.", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def token_array(vocab):
    """An empty array for ids below vocab: uint16 when they fit, else uint32 (a wide shard)."""
    if vocab <= 65536:
        return array.array("H")
    a = array.array("I")
    return a if a.itemsize == 4 else array.array("L")


class ShardWriter:
    """Cuts the ids into shards; with masked, each shard's loss mask goes beside it."""

    def __init__(self, prefix, shard_tokens, vocab, masked=False):
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.vocab = vocab
        self.buf = token_array(vocab)
        self.mask = bytearray() if masked else None
        self.paths = []
        self.total = 0

    def add(self, ids, learn=1):
        """Appends ids (each below the vocabulary size); with a mask, learn (0 or 1) is their mask
        byte."""
        if len(ids) and max(ids) >= self.vocab:
            sys.exit("tokenize.py: token id %d is not below the vocabulary size %d" % (max(ids), self.vocab))
        self.buf.extend(ids)
        if self.mask is not None:
            self.mask.extend(bytes([learn]) * len(ids))
        while len(self.buf) >= self.shard_tokens:
            self._flush(self.buf[: self.shard_tokens], self.mask[: self.shard_tokens] if self.mask is not None else None)
            del self.buf[: self.shard_tokens]
            if self.mask is not None:
                del self.mask[: self.shard_tokens]

    def _flush(self, tokens, mask):
        path = "%s_%06d.bin" % (self.prefix, len(self.paths))
        if mask is not None:  # the mask first: a shard is never seen without its mask
            write_mask("%s_%06d.mask" % (self.prefix, len(self.paths)), mask)
        write_shard(path, tokens)
        self.paths.append(path)
        self.total += len(tokens)

    def close(self):
        if len(self.buf) or not self.paths:
            self._flush(self.buf, self.mask)
            self.buf = token_array(self.vocab)
            self.mask = bytearray() if self.mask is not None else None


def read_chunks(path):
    """The file's text in pieces of about READ_CHUNK characters, each ending at a line end."""
    with open(path, "r", encoding="utf-8", errors="strict", newline="") as f:
        pending = ""
        while True:
            block = f.read(READ_CHUNK)
            if not block:
                break
            pending += block
            cut = pending.rfind("\n")
            if cut < 0:
                continue
            yield pending[: cut + 1]
            pending = pending[cut + 1 :]
        if pending:
            yield pending


def read_blocks(path):
    """The file's bytes in pieces of READ_CHUNK."""
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_CHUNK)
            if not block:
                break
            yield block


def json_fields(files, keys, hint, binary):
    """The strings under `keys` of every non-blank line of the JSON Lines files, as a tuple (UTF-8
    bytes when binary); a line that is not an object with them stops the run, naming it (hint says
    which option names the field)."""
    for path in files:
        with open(path, "r", encoding="utf-8", errors="strict") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    sys.exit("tokenize.py: %s:%d: not a JSON object (%s)" % (path, n, e))
                values = [obj.get(k) if isinstance(obj, dict) else None for k in keys]
                for k, v in zip(keys, values):
                    if not isinstance(v, str):
                        sys.exit("tokenize.py: %s:%d: the object has no string \"%s\" (%s)" % (path, n, k, hint))
                yield tuple(v.encode("utf-8") if binary else v for v in values)


def documents(files, jsonl_key, binary):
    """The documents as (first, piece) pairs, first True at the start of each: a text file is one
    document, in pieces of about READ_CHUNK (bytes as they are when binary); with jsonl_key, every
    non-blank line of a file is a JSON object whose jsonl_key string is one document."""
    if jsonl_key is not None:
        for (text,) in json_fields(files, (jsonl_key,), "--jsonl KEY names the text's field", binary):
            yield True, text
        return
    for path in files:
        first = True
        for piece in read_blocks(path) if binary else read_chunks(path):
            yield first, piece
            first = False
        if first:  # an empty file is still a document
            yield True, b"" if binary else ""


def batches(items):
    """The items in lists of BATCH_CHUNKS (the last one shorter): one tokenizer call each."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == BATCH_CHUNKS:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_records(pairs, encode, eos, writer):
    """Each (prompt, response) record as the prompt's ids (mask 0), then the response's and eos
    (mask 1)."""
    for batch in batches(pairs):
        ids = encode([piece for pair in batch for piece in pair])
        for k in range(len(batch)):
            writer.add(ids[2 * k], learn=0)
            writer.add(list(ids[2 * k + 1]) + [eos], learn=1)


def tokenize(pieces, encode, eos, writer):
    """Feeds the pieces' ids to the writer, eos between documents; encode takes a list of pieces
    (BATCH_CHUNKS at most) and gives their ids."""
    started = False
    for batch in batches(pieces):
        for (first, _), ids in zip(batch, encode([p for _, p in batch])):
            if first and started:
                writer.add([eos])
            started = True
            writer.add(ids)


def hf_tokenizer(name):
    """The tokenizer and its vocabulary size (ids below it)."""
    try:
        from transformers import AutoTokenizer  # only on this path
    except ImportError:
        sys.exit("tokenize.py: --tokenizer %s needs the 'transformers' package "
                 "(pip install transformers), or use --tokenizer bytes" % name)
    tok = AutoTokenizer.from_pretrained(name)
    if tok.eos_token_id is None:
        sys.exit("tokenize.py: the tokenizer %s has no eos token to separate documents" % name)
    return tok, len(tok)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="tokenize.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, metavar="NAME_OR_DIR|bytes",
                    help="'bytes', or a Hugging Face tokenizer name or directory")
    ap.add_argument("--out", required=True, metavar="PREFIX",
                    help="output prefix: writes PREFIX_000000.bin, PREFIX_000001.bin, ...")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                    help="tokens per shard (default 100000000)")
    ap.add_argument("--jsonl", metavar="KEY",
                    help="the files are JSON Lines: each line's KEY string is one document")
    ap.add_argument("--prompt", metavar="PKEY",
                    help="with --jsonl: each line's PKEY string is a prompt before its KEY response; "
                         "a loss mask beside each shard leaves the prompts out of the loss")
    ap.add_argument("files", nargs="+", metavar="FILE",
                    help="text files, one document each (or JSON Lines files with --jsonl)")
    args = ap.parse_args(argv)
    if not 1 <= args.shard_tokens <= MAX_SHARD_TOKENS:
        ap.error("--shard-tokens must be between 1 and %d" % MAX_SHARD_TOKENS)
    if args.prompt is not None and args.jsonl is None:
        ap.error("--prompt needs --jsonl KEY (the response's field)")
    for path in args.files:
        if not os.path.isfile(path):
            ap.error("no such file: %s" % path)
    outdir = os.path.dirname(args.out)
    if outdir:
        os.makedirs(outdir, exist_ok=True)

    binary = args.tokenizer == "bytes"
    if binary:  # bytes are already the token ids 0..255
        vocab, eos, encode = BYTES_EOT + 1, BYTES_EOT, lambda pieces: pieces
    else:
        # A batch of pieces at once: a fast tokenizer spreads them over the cores; each piece is
        # encoded alone, as one at a time would be.
        tok, vocab = hf_tokenizer(args.tokenizer)
        eos, encode = tok.eos_token_id, lambda pieces: tok(pieces, add_special_tokens=False)["input_ids"]
    writer = ShardWriter(args.out, args.shard_tokens, vocab, masked=args.prompt is not None)
    if args.prompt is not None:
        pairs = json_fields(args.files, (args.prompt, args.jsonl),
                            "--prompt names the prompt's field, --jsonl the response's", binary)
        tokenize_records(pairs, encode, eos, writer)
    else:
        tokenize(documents(args.files, args.jsonl, binary), encode, eos, writer)
    writer.close()
    print("tokenize.py: %d tokens (vocabulary %d) in %d shard(s): %s" %
          (writer.total, vocab, len(writer.paths),
           writer.paths[0] if len(writer.paths) == 1 else "%s .. %s" % (writer.paths[0], writer.paths[-1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
