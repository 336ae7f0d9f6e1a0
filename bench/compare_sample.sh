#!/usr/bin/env bash
# ferry sample against transformers' generate (bench/peers/torch_sample.py) on the same model
# (random weights, saved once), prompt and thread count, greedy with the key/value cache, fp32 on
# the CPU, alternating runs so that drift of the shared machine hits both; prints every run's JSON
# line, then one line with the medians and ratios (the prompt's pass, and the tokens after it)
# and whether both drew the same tokens.
# usage: bench/compare_sample.sh [runs=3] [build dir=build] [model=opt-125m] [prompt tokens=400] [tokens=40]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}" build="${2:-build}" model="${3:-opt-125m}" n_prompt="${4:-400}" n_new="${5:-40}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$build/ferry" train --model "$model" --steps 0 --save "$tmp/model" --quiet >/dev/null
ids="$(python3 -c 'import random, sys; random.seed(3)
print(",".join(str(random.randrange(3, 50000)) for _ in range(int(sys.argv[1]))))' "$n_prompt")"
for i in $(seq "$runs"); do
  "$build/ferry" sample --init "$tmp/model" --prompt-ids "$ids" --tokens "$n_new" --temperature 0 --stop none \
    --threads 2 >"$tmp/ferry.out" 2>"$tmp/ferry.err"
  python3 - "$tmp/ferry.out" "$tmp/ferry.err" "$n_prompt" <<'PY' | tee -a "$tmp/rows"
import json, re, sys
ids = [int(x) for x in open(sys.argv[1]).read().split(",")][int(sys.argv[3]):]
m = re.search(r"prompt's (\d+) tokens and the first new one in [0-9.]+ s \(([0-9.]+) tokens/s\), (\d+) more in "
              r"[0-9.]+ s \(([0-9.]+) tokens/s\)", open(sys.argv[2]).read())
if not m:
    sys.exit("compare_sample.sh: no timing line from ferry sample")
print(json.dumps({"bench": "ferry_sample", "threads": 2, "prompt_tokens": int(m.group(1)), "tokens": len(ids),
                  "prompt_tokens_per_s": float(m.group(2)), "tokens_per_s": float(m.group(4)), "ids": ids}))
PY
  python3 bench/peers/torch_sample.py --init "$tmp/model" --prompt-ids "$ids" --tokens "$n_new" --threads 2 |
    tee -a "$tmp/rows"
done
python3 - "$tmp/rows" "$model" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ferry = [r for r in rows if r.get("bench") == "ferry_sample"]
torch = [r for r in rows if r.get("peer") == "torch_sample"]
med = lambda rs, k: statistics.median(r[k] for r in rs)
pairs = [f["tokens_per_s"] / t["tokens_per_s"] for f, t in zip(ferry, torch)]
ppairs = [f["prompt_tokens_per_s"] / t["prompt_tokens_per_s"] for f, t in zip(ferry, torch)]
print(json.dumps({"compare": "ferry_sample_vs_torch_generate", "model": sys.argv[2], "runs": len(ferry),
                  "ferry_prompt_tokens_per_s": med(ferry, "prompt_tokens_per_s"),
                  "torch_prompt_tokens_per_s": med(torch, "prompt_tokens_per_s"),
                  "prompt_speedup_pairs": [round(x, 3) for x in ppairs],
                  "prompt_speedup_median": round(statistics.median(ppairs), 3),
                  "ferry_tokens_per_s": med(ferry, "tokens_per_s"), "torch_tokens_per_s": med(torch, "tokens_per_s"),
                  "speedup_pairs": [round(x, 3) for x in pairs], "speedup_median": round(statistics.median(pairs), 3),
                  "same_tokens": all(f["ids"] == t["ids"] for f, t in zip(ferry, torch))}))
PY
