#!/usr/bin/env python3
"""Turn text files into ferry's token shards (llm.c's format).

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, token count, the rest
0) followed by that many uint16 tokens. Each input FILE is one document; documents are separated
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

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
MAX_SHARD_TOKENS = 2**31 - 1  # the header's count is an int32
BYTES_EOT = 256
READ_CHUNK = 1 << 20  # characters per tokenizer call


def write_shard(path, tokens):
    """Writes `tokens` (array('H')) atomically: a temporary file in the same directory, renamed."""
    header = array.array("i", [0] * HEADER_INTS)
    header[0], header[1], header[2] = MAGIC, VERSION, len(tokens)
    if sys.byteorder != "little":
        header = array.array("i", header)
        header.byteswap()
        tokens = array.array("H", tokens)
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


class ShardWriter:
    def __init__(self, prefix, shard_tokens):
        self.prefix = prefix
        self.shard_tokens = shard_tokens
        self.buf = array.array("H")
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
            self.buf = array.array("H")


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


def hf_documents(name, files, writer):
    try:
        from transformers import AutoTokenizer  # only on this path
    except ImportError:
        sys.exit("tokenize.py: --tokenizer %s needs the 'transformers' package "
                 "(pip install transformers), or use --tokenizer bytes" % name)
    tok = AutoTokenizer.from_pretrained(name)
    vocab = len(tok)
    if vocab > 65536:
        sys.exit("tokenize.py: the tokenizer %s has %d tokens; shards hold uint16 ids (at most 65536)"
                 % (name, vocab))
    eos = tok.eos_token_id
    if eos is None:
        sys.exit("tokenize.py: the tokenizer %s has no eos token to separate documents" % name)
    for i, path in enumerate(files):
        if i:
            writer.add([eos])
        for text in read_chunks(path):
            ids = tok.encode(text, add_special_tokens=False)
            if ids and max(ids) > 65535:
                sys.exit("tokenize.py: token id %d does not fit in uint16" % max(ids))
            writer.add(ids)
    return vocab


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

    writer = ShardWriter(args.out, args.shard_tokens)
    if args.tokenizer == "bytes":
        byte_documents(args.files, writer)
        vocab = BYTES_EOT + 1
    else:
        vocab = hf_documents(args.tokenizer, args.files, writer)
    writer.close()
    print("tokenize.py: %d tokens (vocabulary %d) in %d shard(s): %s" %
          (writer.total, vocab, len(writer.paths),
           writer.paths[0] if len(writer.paths) == 1 else "%s .. %s" % (writer.paths[0], writer.paths[-1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
