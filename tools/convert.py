#!/usr/bin/env python3
"""Convert a Hugging Face model saved as PyTorch pickles into the safetensors files ferry reads.

ferry's --init reads a model directory's model.safetensors (or its sharded index). Older OPT
checkpoints, facebook/opt-* among them, come as pytorch_model.bin (or pytorch_model-*-of-*.bin
with pytorch_model.bin.index.json). This writes OUT/model.safetensors, or one safetensors shard
per input shard with model.safetensors.index.json, and copies config.json and the tokenizer's
files. One input shard is held at a time (memory-mapped where the file allows), so a model larger
than this machine's memory converts too.

Tensor names are kept (with or without the "model." prefix: ferry reads both). A tensor that shares
its storage with an earlier one (a tied lm_head.weight) is left out when it is lm_head.weight
(ferry and transformers tie it to embed_tokens) and copied otherwise. Dtypes are kept unless
--dtype says otherwise.

Examples:
  python3 tools/convert.py ~/models/opt-1.3b /data/opt-1.3b-st
  python3 tools/convert.py facebook/opt-125m /data/opt-125m-st      (downloads the .bin files)
  ./build/ferry train --model /data/opt-125m-st --init /data/opt-125m-st --data shards/ ...

Needs: pip install torch safetensors (and huggingface_hub for a name instead of a directory).
"""

import os
import sys

# tools/ holds tokenize.py, which shadows the standard library's `tokenize` (that torch imports):
# the script's own directory leaves the path.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

WEIGHTS = "pytorch_model.bin"
WEIGHTS_INDEX = "pytorch_model.bin.index.json"
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json")


def source_dir(src):
    if os.path.isdir(src):
        return src
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        sys.exit("convert.py: %s is not a directory (a model name needs: pip install huggingface_hub)" % src)
    return snapshot_download(src, allow_patterns=list(COPIED) + ["pytorch_model*.bin", WEIGHTS_INDEX])


def input_shards(src):
    """The pickle files in order, and which file holds each tensor (None: one file)."""
    index = os.path.join(src, WEIGHTS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        return files, weight_map
    if os.path.isfile(os.path.join(src, WEIGHTS)):
        return [WEIGHTS], None
    if os.path.isfile(os.path.join(src, "model.safetensors")) or \
            os.path.isfile(os.path.join(src, "model.safetensors.index.json")):
        sys.exit("convert.py: %s already holds safetensors files: ferry reads it as it is" % src)
    sys.exit("convert.py: %s holds neither %s nor %s" % (src, WEIGHTS, WEIGHTS_INDEX))


def load(path, torch, trust):
    """The pickle's dict of tensors: memory-mapped when its format allows, and unpickling nothing
    but tensors and plain containers unless trust (a pickle can run code when loaded)."""
    import pickle
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=not trust)
        except RuntimeError:  # a file in the legacy (pre-zip) format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError:
        sys.exit("convert.py: %s holds objects other than tensors, which a safe load refuses; if you "
                 "trust where it comes from, --trust-pickle loads it anyway" % path)


def convert(src, out, dtype=None, trust=False):
    import torch
    from safetensors.torch import save_file

    src = source_dir(src)
    files, weight_map = input_shards(src)
    os.makedirs(out, exist_ok=True)
    names = ["model.safetensors"] if len(files) == 1 else \
        ["model-%05d-of-%05d.safetensors" % (i + 1, len(files)) for i in range(len(files))]
    seen = {}  # storage pointer -> first tensor name, across shards
    out_map, total, count = {}, 0, 0
    for name, fname in zip(names, files):
        state = load(os.path.join(src, fname), torch, trust)
        if not isinstance(state, dict):
            sys.exit("convert.py: %s does not hold a dict of tensors" % fname)
        tensors = {}
        for key, t in state.items():
            if not isinstance(t, torch.Tensor):
                continue
            if weight_map is not None and weight_map.get(key, fname) != fname:
                continue  # listed under another file: taken there
            ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if t.numel() and ptr in seen:
                if key.endswith("lm_head.weight"):
                    print("convert.py: %s is tied to %s: left out" % (key, seen[ptr]))
                    continue
                t = t.clone()
            elif t.numel():
                seen[ptr] = key
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[key] = t.contiguous()
        # Written under a temporary name, then renamed: an interrupted run leaves no half file.
        fd, tmp = tempfile.mkstemp(prefix=name + ".tmp.", dir=out)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"format": "pt"})
            os.replace(tmp, os.path.join(out, name))
        except BaseException:
            os.unlink(tmp)
            raise
        for key, t in tensors.items():
            out_map[key] = name
            total += t.numel() * t.element_size()
        count += len(tensors)
        del state, tensors
    if len(names) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(out_map.items()))}, f, indent=2)
    copied = [f for f in COPIED if os.path.isfile(os.path.join(src, f))]
    for f in copied:
        shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
    if "config.json" not in copied:
        print("convert.py: warning: %s has no config.json (ferry's --model needs one)" % src)
    size = "%.1f MiB" % (total / 1048576) if total >= 1048576 else "%d bytes" % total
    print("convert.py: %d tensors (%s) in %d file(s) under %s" % (count, size, len(names), out))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", metavar="SRC", help="a model directory with pytorch_model.bin, or a Hub name")
    ap.add_argument("out", metavar="OUT", help="the directory to write (created if missing)")
    ap.add_argument("--dtype", choices=("keep", "f32", "bf16", "f16"), default="keep",
                    help="the floating-point dtype written (default: keep each tensor's)")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="unpickle whatever the files hold (they may run code: only for files you trust)")
    args = ap.parse_args(argv)
    try:
        import torch
        import safetensors  # noqa: F401
    except ImportError:
        sys.exit("convert.py: needs torch and safetensors (pip install torch safetensors)")
    dtype = {"keep": None, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    if os.path.abspath(args.src) == os.path.abspath(args.out):
        ap.error("OUT must differ from SRC")
    convert(args.src, args.out, dtype, args.trust_pickle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
