#!/usr/bin/env bash
# tools/convert.py turns a model saved as PyTorch pickles into the safetensors files ferry reads:
# a tied fp16 post-LN OPT saved by transformers as one pytorch_model.bin, and the same tensors in
# two pickle shards with an index and without the "model." prefix (as older checkpoints name
# them), and the single file in the legacy pickle format all give ferry the loss of transformers'
# own safetensors save; ferry's message for a pickled model names the tool; what convert.py cannot
# convert is refused with the reason.
# usage: test/reference/check_convert.sh path/to/ferry
set -euo pipefail
ferry="$(realpath "$1")"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
python3 - <<'PY' 2>/dev/null
import json, os, random, struct
import torch
from transformers import OPTConfig, OPTForCausalLM
cfg = OPTConfig(vocab_size=97, hidden_size=32, num_attention_heads=4, ffn_dim=64, num_hidden_layers=2,
                max_position_embeddings=64, word_embed_proj_dim=32, do_layer_norm_before=False)
torch.manual_seed(0)
m = OPTForCausalLM(cfg).to(torch.float16)
m.save_pretrained("st")
sd = m.state_dict()
for d in ("bin1", "bin2"):
    os.makedirs(d)
    cfg.save_pretrained(d)
torch.save(sd, "bin1/pytorch_model.bin")
keys = sorted(sd)
parts = [{k.removeprefix("model."): sd[k] for k in keys[:len(keys) // 2]},
         {k.removeprefix("model."): sd[k] for k in keys[len(keys) // 2:]}]
weight_map = {}
for i, part in enumerate(parts):
    name = "pytorch_model-%05d-of-00002.bin" % (i + 1)
    torch.save(part, "bin2/" + name)
    weight_map.update((k, name) for k in part)
json.dump({"metadata": {}, "weight_map": weight_map}, open("bin2/pytorch_model.bin.index.json", "w"))
random.seed(4)
toks = [random.randrange(97) for _ in range(4000)]
open("data.bin", "wb").write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253))
                             + struct.pack("<%dH" % len(toks), *toks))
PY
fail=0
if "$ferry" eval --init bin1 --model bin1 --data data.bin --seq 16 >out.txt 2>&1 || ! grep -q "tools/convert.py" out.txt; then
  echo "FAIL  a pickled model: no pointer to tools/convert.py"; cat out.txt; fail=1
fi
ref="$("$ferry" eval --init st --model st --data data.bin --batch 2 --seq 16 --batches 3)"
# bin3: the single file in the legacy (pre-zip) pickle format, which cannot be memory-mapped.
mkdir empty bin3 bin4
cp bin1/config.json bin3/
python3 -c "import torch; torch.save(torch.load('bin1/pytorch_model.bin'), 'bin3/pytorch_model.bin', \
  _use_new_zipfile_serialization=False)"
for d in bin1 bin2 bin3; do
  python3 "$here/../../tools/convert.py" "$d" "conv_$d" >/dev/null
  got="$("$ferry" eval --init "conv_$d" --model "conv_$d" --data data.bin --batch 2 --seq 16 --batches 3)"
  if [ "$got" = "$ref" ]; then echo "ok    $d converted: $got"; else echo "FAIL  $d converted: '$got', want '$ref'"; fail=1; fi
done
[ -f conv_bin2/model.safetensors.index.json ] || { echo "FAIL  two pickle shards did not give two safetensors shards"; fail=1; }
# What it cannot convert is said, with a non-zero exit: a directory that is safetensors already, one
# without weights, the output over the input, a pickle holding more than tensors (unless trusted).
python3 -c "import argparse, torch; sd = torch.load('bin1/pytorch_model.bin'); sd['args'] = argparse.Namespace(); \
  torch.save(sd, 'bin4/pytorch_model.bin')"
for args in "st out_st:already holds safetensors" "empty out_e:holds neither" "bin1 bin1:must differ" \
            "bin4 out_b4:--trust-pickle"; do
  set -- ${args%%:*}
  if python3 "$here/../../tools/convert.py" "$1" "$2" >msg.txt 2>&1 || ! grep -q -- "${args#*:}" msg.txt; then
    echo "FAIL  convert.py $1 $2: $(tail -1 msg.txt)"; fail=1
  else echo "ok    convert.py $1 $2 refused: $(tail -1 msg.txt)"; fi
done
python3 "$here/../../tools/convert.py" bin4 out_b4 --trust-pickle >/dev/null && [ -f out_b4/model.safetensors ] \
  || { echo "FAIL  --trust-pickle did not convert"; fail=1; }
exit "$fail"
