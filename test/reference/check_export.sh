#!/usr/bin/env bash
# A checkpoint written by `ferry train --save` loads in transformers and gives ferry's logits.
# For each reference model: train 3 steps from it, save, dump ferry's logits on one batch, and
# let make_reference.py --check-export compare them with transformers' on the same input.
# usage: test/reference/check_export.sh path/to/ferry
set -euo pipefail
ferry="$1"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for name in pre_ln post_ln; do
  python3 - "$tmp/$name.bin" <<'PY'
import random, struct, sys
random.seed(5)
toks = [random.randrange(53) for _ in range(4000)]
hdr = [20240520, 1, len(toks)] + [0] * 253
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", *hdr))
    f.write(struct.pack("<%dH" % len(toks), *toks))
PY
  # A training checkpoint, exported by `ferry export`, is what transformers loads.
  "$ferry" train --init "$here/$name" --data "$tmp/$name.bin" --batch 2 --seq 16 --steps 3 \
    --lr 1e-3 --save "$tmp/run_$name" --save-every 2 --quiet
  "$ferry" export "$tmp/run_$name" "$tmp/ckpt_$name"
  "$ferry" eval --init "$tmp/ckpt_$name" --data "$tmp/$name.bin" --batch 2 --seq 16 --batches 1 \
    --dump "$tmp/dump_$name.safetensors"
  python3 "$here/make_reference.py" --check-export "$tmp/ckpt_$name" --dump "$tmp/dump_$name.safetensors"
done
