#!/usr/bin/env python3
"""Turn text files into ferry's token shards (llm.c's format).

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, token count, the rest
0) followed by that many uint16 tokens; a tokenizer with more than 65536 tokens gets llm.c's wide
shards instead (magic 20240801, version 7, uint32 tokens). Each input FILE is one document; documents are separated
by an end-of-text token. Shards are written as PREFIX_000000.bin, PREFIX_000001.bin, ...

  --tokenizer bytes   one token per UTF-8 byte (0..255), 256 = end of text; needs nothing but the
                      standard library (the demo model's vocabulary is 512 wide, so ids fit).
  --tokenizer NAME    a Hugging Face tokenizer name or directory (e.g. facebook/opt-125m), loaded
                      with transformers' AutoTokenizer; its eos token separates documents.

Examples:
  python3 tools/tokenize.py --tokenizer bytes --out data/corpus data/corpus.txt
  python3 tools/tokenize.py --tokenizer facebook/opt-125m --out /data/wiki/wiki --shard-tokens 100000000 a.txt b.txt
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
import tempfile  # noqa: E402

MAGIC, VERSION = 20240520, 1        # uint16 tokens
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
    header = array.array("i", [0] * HEADER_INTS)
    header[0], header[1] = (WIDE_MAGIC, WIDE_VERSION) if wide else (MAGIC, VERSION)
    header[2] = len(tokens)
    if sys.byteorder != "little":
        header = array.array("i", header)
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
    def __init__(self, prefix, shard_tokens, vocab):
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.vocab = vocab
        self.buf = token_array(vocab)
        self.paths = []
        self.total = 0

    def add(self, ids):
        self.buf.extend(ids)
        while len(self.buf) >= self.shard_tokens:
            self._flush(self.buf[: self.shard_tokens])
            del self.buf[: self.shard_tokens]

    def _flush(self, tokens):
        path = "%s_%06d.bin" % (self.prefix, len(self.paths))
        write_shard(path, tokens)
        self.paths.append(path)
        self.total += len(tokens)

    def close(self):
        if len(self.buf) or not self.paths:
            self._flush(self.buf)
            self.buf = token_array(self.vocab)


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


def byte_documents(files, writer):
    for i, path in enumerate(files):
        if i:
            writer.add([BYTES_EOT])
        with open(path, "rb") as f:
            while True:
                block = f.read(READ_CHUNK)
                if not block:
                    break
                writer.add(block)  # bytes are already the token ids 0..255


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


def hf_documents(tok, files, writer):
    def encode(texts):
        # A batch of chunks at once: a fast tokenizer spreads them over the cores; each chunk is
        # encoded alone, as one at a time would be.
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            if ids and max(ids) >= writer.vocab:
                sys.exit("tokenize.py: token id %d is not below the vocabulary size %d" % (max(ids), writer.vocab))
            writer.add(ids)

    for i, path in enumerate(files):
        if i:
            writer.add([tok.eos_token_id])
        batch = []
        for text in read_chunks(path):
            batch.append(text)
            if len(batch) == BATCH_CHUNKS:
                encode(batch)
                batch = []
        if batch:
            encode(batch)


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
    ap.add_argument("files", nargs="+", metavar="FILE", help="text files, one document each")
    args = ap.parse_args(argv)
    if not 1 <= args.shard_tokens <= MAX_SHARD_TOKENS:
        ap.error("--shard-tokens must be between 1 and %d" % MAX_SHARD_TOKENS)
    for path in args.files:
        if not os.path.isfile(path):
            ap.error("no such file: %s" % path)
    outdir = os.path.dirname(args.out)
    if outdir:
        os.makedirs(outdir, exist_ok=True)

    if args.tokenizer == "bytes":
        vocab = BYTES_EOT + 1
        writer = ShardWriter(args.out, args.shard_tokens, vocab)
        byte_documents(args.files, writer)
    else:
        tok, vocab = hf_tokenizer(args.tokenizer)
        writer = ShardWriter(args.out, args.shard_tokens, vocab)
        hf_documents(tok, args.files, writer)
    writer.close()
    print("tokenize.py: %d tokens (vocabulary %d) in %d shard(s): %s" %
          (writer.total, vocab, len(writer.paths),
           writer.paths[0] if len(writer.paths) == 1 else "%s .. %s" % (writer.paths[0], writer.paths[-1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
