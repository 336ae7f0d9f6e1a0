#!/usr/bin/env bash
# The planner against the runs it plans, on the sim device: for each precision, ferry plan writes
# the fastest plan for MODEL at BATCH x SEQ in DEVICE_MEM, ferry train runs it, and the predicted
# tokens/s and device peak are set beside the measured ones (the median of the steps after the
# first). The precisions alternate over RUNS rounds, so that drift of the shared machine hits
# both; every run prints a JSON line, then one line per precision with the medians and ratios.
# The probe is measured once into a temporary file (not the user's cache).
# LAYOUTS (comma-separated) also plans and runs several ranks: "1" one rank; "ppN" a pipeline of N
# stages (ferry plan --gpus N --pp N, then mpirun -np N ferry train --plan, as ferry plan says to
# run it: each rank with the machine's default threads); "dpDxppP" D x P ranks. BATCH is then the
# global batch (a pipeline's micro-batches a step are what the planner chose).
# usage: bench/plan_accuracy.sh [runs=2] [build dir=build] [model=opt-125m] [batch=4] [seq=256]
#                               [device mem=1GiB] [precisions=fp32,bf16] [steps=4] [layouts=1]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-2}" build="${2:-build}" model="${3:-opt-125m}" batch="${4:-4}" seq="${5:-256}" mem="${6:-1GiB}"
precisions="${7:-fp32,bf16}" steps="${8:-4}" layouts="${9:-1}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export FERRY_PROBE="$tmp/probe.json"
"$build/ferry" probe --device sim --device-mem "$mem" >/dev/null
for i in $(seq "$runs"); do
  for lay in ${layouts//,/ }; do
  for p in ${precisions//,/ }; do
    grid=() run=()
    case "$lay" in
      1) ;;
      pp*) n="${lay#pp}"; grid=(--gpus "$n" --pp "$n")
           run=(mpirun --allow-run-as-root --oversubscribe -np "$n") ;;
      dp*x*) d="${lay#dp}" d="${d%%x*}" n="${lay#*pp}"; grid=(--gpus $((d * n)) --dp "$d" --pp "$n")
             run=(mpirun --allow-run-as-root --oversubscribe -np $((d * n))) ;;
      *) echo "plan_accuracy: unknown layout $lay (1, ppN, dpDxppP)" >&2; exit 2 ;;
    esac
    "$build/ferry" plan --device sim --device-mem "$mem" --model "$model" --batch "$batch" --seq "$seq" \
      --precision "$p" "${grid[@]}" --out "$tmp/plan-$p.json" >/dev/null
    rm -f "$tmp/run.jsonl"
    "${run[@]}" "$build/ferry" train --model "$model" --plan "$tmp/plan-$p.json" --device-mem "$mem" --seq "$seq" \
      --steps "$steps" --quiet --log "$tmp/run.jsonl"
    python3 - "$tmp/plan-$p.json" "$tmp/run.jsonl" "$p" "$model" "$lay" <<'PY' | tee -a "$tmp/rows"
import json, statistics, sys
plan = json.load(open(sys.argv[1]))
rows = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
meas = statistics.median(r["tokens_per_s"] for r in rows[1:] or rows)
peak = max(r["device_peak_mib"] for r in rows)
pred = plan["predicted"]
print(json.dumps({"bench": "plan_accuracy", "model": sys.argv[4], "precision": sys.argv[3], "layout": sys.argv[5],
                  "dp": plan.get("dp", 1), "pp": plan.get("pp", 1),
                  "micro_batch": plan["micro_batch"], "grad_accum": plan["grad_accum"],
                  "predicted_tokens_per_s": round(pred["tokens_per_s"], 1), "tokens_per_s": round(meas, 1),
                  "predicted_peak_mib": round(pred["device_peak_bytes"] / 1048576, 1), "peak_mib": peak,
                  "bottleneck": pred["bottleneck"]}))
PY
  done
  done
done
python3 - "$tmp/rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for key in dict.fromkeys((r["layout"], r["precision"]) for r in rows):
    lay, p = key
    mine = [r for r in rows if (r["layout"], r["precision"]) == key]
    pred = statistics.median(r["predicted_tokens_per_s"] for r in mine)
    meas = statistics.median(r["tokens_per_s"] for r in mine)
    print(json.dumps({"bench": "plan_accuracy_summary", "model": mine[0]["model"], "precision": p, "layout": lay,
                      "runs": len(mine),
                      "predicted_tokens_per_s": round(pred, 1), "tokens_per_s": round(meas, 1),
                      "predicted_over_measured": round(pred / meas, 3),
                      "peak_predicted_over_measured": round(mine[0]["predicted_peak_mib"] / mine[0]["peak_mib"], 3)}))
PY
