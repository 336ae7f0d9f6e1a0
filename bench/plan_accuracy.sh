#!/usr/bin/env bash
# The planner against the runs it plans, on the sim device: for each precision, ferry plan writes
# the fastest plan for MODEL at BATCH x SEQ in DEVICE_MEM, ferry train runs it, and the predicted
# tokens/s and device peak are set beside the measured ones (the median of the steps after the
# first). The precisions alternate over RUNS rounds, so that drift of the shared machine hits
# both; every run prints a JSON line, then one line per precision with the medians and ratios.
# The probe is measured once into a temporary file (not the user's cache).
# usage: bench/plan_accuracy.sh [runs=2] [build dir=build] [model=opt-125m] [batch=4] [seq=256]
#                               [device mem=1GiB] [precisions=fp32,bf16] [steps=4]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-2}" build="${2:-build}" model="${3:-opt-125m}" batch="${4:-4}" seq="${5:-256}" mem="${6:-1GiB}"
precisions="${7:-fp32,bf16}" steps="${8:-4}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export FERRY_PROBE="$tmp/probe.json"
"$build/ferry" probe --device sim --device-mem "$mem" >/dev/null
for i in $(seq "$runs"); do
  for p in ${precisions//,/ }; do
    "$build/ferry" plan --device sim --device-mem "$mem" --model "$model" --batch "$batch" --seq "$seq" \
      --precision "$p" --out "$tmp/plan-$p.json" >/dev/null
    "$build/ferry" train --model "$model" --plan "$tmp/plan-$p.json" --device-mem "$mem" --seq "$seq" --steps "$steps" \
      --quiet --log "$tmp/run.jsonl"
    python3 - "$tmp/plan-$p.json" "$tmp/run.jsonl" "$p" "$model" <<'PY' | tee -a "$tmp/rows"
import json, statistics, sys
plan = json.load(open(sys.argv[1]))
rows = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
meas = statistics.median(r["tokens_per_s"] for r in rows[1:] or rows)
peak = max(r["device_peak_mib"] for r in rows)
pred = plan["predicted"]
print(json.dumps({"bench": "plan_accuracy", "model": sys.argv[4], "precision": sys.argv[3],
                  "micro_batch": plan["micro_batch"], "grad_accum": plan["grad_accum"],
                  "predicted_tokens_per_s": round(pred["tokens_per_s"], 1), "tokens_per_s": round(meas, 1),
                  "predicted_peak_mib": round(pred["device_peak_bytes"] / 1048576, 1), "peak_mib": peak,
                  "bottleneck": pred["bottleneck"]}))
PY
  done
done
python3 - "$tmp/rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for p in dict.fromkeys(r["precision"] for r in rows):
    mine = [r for r in rows if r["precision"] == p]
    pred = statistics.median(r["predicted_tokens_per_s"] for r in mine)
    meas = statistics.median(r["tokens_per_s"] for r in mine)
    print(json.dumps({"bench": "plan_accuracy_summary", "model": mine[0]["model"], "precision": p, "runs": len(mine),
                      "predicted_tokens_per_s": round(pred, 1), "tokens_per_s": round(meas, 1),
                      "predicted_over_measured": round(pred / meas, 3),
                      "peak_predicted_over_measured": round(mine[0]["predicted_peak_mib"] / mine[0]["peak_mib"], 3)}))
PY
