#!/usr/bin/env bash
# bench/scaling.sh: scaling of ferry train over ranks with the mpi backend. Layouts: replicate
# (data parallelism on the cpu device, the default), zero (data parallelism with the chunks sharded
# over the ranks, on the sim device), tp (tensor parallelism on the cpu device: the ranks share
# every sequence, so only strong scaling applies) and pp (pipeline parallelism on the cpu device,
# one stage a rank: the step's micro-batches, 4 a stage, go through the stages on the 1F1B
# schedule, against one rank running the same micro-batches; strong scaling alone, whose bound on
# the same cores is the bubble's, m / (m + p - 1), reported beside it), and ppsim (the same on the
# sim device: each stage offloads its own layers' chunks, against one rank offloading them all).
# Weak scaling: every rank keeps the same per-rank batch (the global batch grows with the ranks).
# Strong scaling: the global batch stays (the per-rank batch shrinks). The machine's cores are
# split evenly between the ranks (OMP threads = cores / ranks), so that 1 and N ranks use the same
# hardware: ideal weak scaling then takes N times as long for N times the work (efficiency =
# N x one-rank time / N-rank time, 1 is ideal) and ideal strong scaling takes as long (speedup 1).
# On a cluster, give each rank its own cores or GPU and read the same numbers against N.
# usage: bench/scaling.sh [build dir=build] [ranks=2] [model=opt-demo] [batch=16] [seq=128] [steps=8]
#                         [layout=replicate|zero|tp|pp|ppsim]
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}" n="${2:-2}" model="${3:-opt-demo}" batch="${4:-16}" seq="${5:-128}" steps="${6:-8}"
layout="${7:-replicate}"
case "$layout" in
  replicate) extra=() ;;
  zero) extra=(--device sim --device-mem 2GiB) ;;
  tp) extra=() ;;
  pp) micro=$((4 * n)); extra=(--grad-accum "$micro") ;;  # (the micro-batch: batch / micro sequences)
  ppsim) micro=$((4 * n)); extra=(--grad-accum "$micro" --device sim --device-mem 2GiB) ;;
  *) echo "scaling: layout is replicate, zero, tp, pp or ppsim, not '$layout'" >&2; exit 2 ;;
esac
command -v mpirun >/dev/null || { echo "scaling: mpirun is not installed" >&2; exit 1; }
cores=$(nproc)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp/data.bin" <<'PY'
import random, struct, sys
random.seed(1)
n = 400000
t = [random.randrange(256) for _ in range(n)]
open(sys.argv[1], "wb").write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)) + struct.pack("<%dH" % n, *t))
PY
mpi=(mpirun --allow-run-as-root --oversubscribe -np "$n")
run() {  # label ranks per-rank-batch threads
  local log="$tmp/$1.json"
  if [ "$2" -eq 1 ]; then
    "$build/ferry" train --model "$model" --data "$tmp/data.bin" --batch "$3" --seq "$seq" --steps "$steps" \
      --threads "$4" --quiet --log "$log" "${extra[@]}"
  else
    "${mpi[@]}" "$build/ferry" train --model "$model" --data "$tmp/data.bin" --batch "$3" --seq "$seq" \
      --steps "$steps" --threads "$4" --quiet --log "$log" "${extra[@]}" "${@:5}"
  fi
  python3 - "$log" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]  # the first step builds the GEMM primitives
print(statistics.median(r["step_s"] for r in rows))
PY
}
per=$((cores / n > 0 ? cores / n : 1))
bubble=1
if [ "$layout" = pp ] || [ "$layout" = ppsim ]; then  # the same micro-batches a step, on one rank and through n stages
  mb=$((batch / micro > 0 ? batch / micro : 1))
  one=$(run one 1 "$mb" "$cores")
  weak=0
  strong=$(run strong "$n" "$mb" "$per" --pp "$n")
  bubble=$(python3 -c "print(round($micro / ($micro + $n - 1), 3))")
else
  one=$(run one 1 "$batch" "$cores")
fi
if [ "$layout" = pp ] || [ "$layout" = ppsim ]; then :
elif [ "$layout" = tp ]; then  # the tensor-parallel ranks share each sequence: the same global batch
  weak=0
  strong=$(run strong "$n" "$batch" "$per" --tp "$n")
else
  weak=$(run weak "$n" "$batch" "$per")
  strong=$(run strong "$n" $((batch / n)) "$per")
fi
python3 - "$one" "$weak" "$strong" "$n" "$model" "$batch" "$seq" "$layout" "$bubble" <<'PY'
import json, sys
one, weak, strong = map(float, sys.argv[1:4])
n = int(sys.argv[4])
row = {"bench": "scaling", "layout": sys.argv[8], "model": sys.argv[5], "ranks": n, "batch": int(sys.argv[6]),
       "seq": int(sys.argv[7]), "one_rank_step_s": round(one, 4)}
if weak > 0:
    row.update({"weak_step_s": round(weak, 4), "weak_efficiency": round(n * one / weak, 3)})
row.update({"strong_step_s": round(strong, 4), "strong_speedup": round(one / strong, 3)})
if sys.argv[8] in ("pp", "ppsim"):  # the 1F1B bound on the same cores: m / (m + p - 1)
    row["bubble_bound"] = float(sys.argv[9])
print(json.dumps(row))
PY
