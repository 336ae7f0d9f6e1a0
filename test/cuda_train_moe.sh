#!/usr/bin/env bash
# test/cuda_train_moe.sh: a mixture of experts (ops/cuda/moe.cu) trained on --device cuda, resident,
# against --device cpu: a few steps of a small mixture (opt-moe-tiny) on random tokens, the fp32
# losses, load-balancing terms and gradient norms to rounding (test/cuda_train.sh's 1e-3), with
# gradient accumulation (2 x B/2) too, and bf16 within bf16's rounding (cuda_train.sh's 2e-2); then
# offloaded (--offload: the router alone first, only the experts that got tokens loaded into the
# GPU's cache, runtime/offload.c) against the same cpu runs, and with one token a pass (its top 2 of
# 4 experts) fewer expert chunks loaded than the mixtures hold. On the emulator (test/cudaemu) in
# ./test.sh; on a GPU by bench/gpu/check.sh. Exit 77 (skipped) where there is no GPU.
#
# usage: test/cuda_train_moe.sh FERRY DIR [--model M] [--batch B] [--seq T] [--steps N]
#   DIR          where the runs' logs and the token shard go (made if missing)
#   --model M    a mixture's preset or config.json directory (default opt-moe-tiny), --batch B (4, even),
#                --seq T (32), --steps N (4)
set -uo pipefail

[ $# -ge 2 ] || { sed -n '11,14p' "$0" >&2; exit 2; }
ferry="$1" d="$2"
shift 2
model=opt-moe-tiny batch=4 seq=32 steps=4
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || { echo "cuda_train_moe.sh: $1 needs a value" >&2; exit 2; }
  case "$1" in
    --model) model="$2" ;;
    --batch) batch="$2" ;;
    --seq) seq="$2" ;;
    --steps) steps="$2" ;;
    *) echo "cuda_train_moe.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ -x "$ferry" ] || { echo "cuda_train_moe.sh: $ferry is not a program" >&2; exit 2; }
half=$((batch / 2))
[ $((half * 2)) -eq "$batch" ] && [ "$half" -gt 0 ] || { echo "cuda_train_moe.sh: --batch must be even" >&2; exit 2; }
mkdir -p "$d/data" || exit 2
# Random tokens below 97 (opt-moe-tiny's vocabulary; any preset's is larger), in ferry's shard format.
python3 - "$d/data/shard_000.bin" <<'PY' || exit 2
import random, struct, sys
rnd = random.Random(7)
toks = [rnd.randrange(3, 97) for _ in range(20000)]
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
    f.write(struct.pack("<%dH" % len(toks), *toks))
PY

common=(train --model "$model" --data "$d/data" --steps "$steps" --batch "$batch" --seq "$seq" --seed 1 --lr 1e-3
        --warmup 0 --no-shuffle)
# ferry_run NAME ARGS...: ferry ARGS with its output in $d/NAME.out, shown when it fails
ferry_run() { local name="$1"; shift; "$ferry" "$@" >"$d/$name.out" 2>&1 || { cat "$d/$name.out"; exit 1; }; }
# Whether there is a GPU at all: the first GPU run, its failure read.
if ! "$ferry" "${common[@]}" --device cuda --precision fp32 --log "$d/cuda.jsonl" >"$d/cuda.out" 2>&1; then
  if grep -q -E "no NVIDIA driver|no GPU|built without CUDA" "$d/cuda.out"; then
    echo "cuda_train_moe.sh: no GPU: skipped"
    exit 77
  fi
  cat "$d/cuda.out"
  exit 1
fi
ferry_run cpu "${common[@]}" --device cpu --log "$d/cpu.jsonl"
ferry_run accumcpu "${common[@]}" --device cpu --batch "$half" --grad-accum 2 --log "$d/accumcpu.jsonl"
ferry_run accumcuda "${common[@]}" --device cuda --precision fp32 --batch "$half" --grad-accum 2 --log "$d/accumcuda.jsonl"
ferry_run cpu16 "${common[@]}" --device cpu --precision bf16 --log "$d/cpu16.jsonl"
ferry_run cuda16 "${common[@]}" --device cuda --precision bf16 --log "$d/cuda16.jsonl"

# CPU.jsonl CUDA.jsonl TOL: loss, aux_loss and grad_norm of every step agree within TOL (relative,
# at least 1 for the loss and the norm; the aux_loss, ~0.04, within TOL of itself).
same() {
  python3 - "$@" <<'PY'
import json, sys
def rows(p):
    return [json.loads(l) for l in open(p) if l.startswith("{") and '"loss"' in l]
a, b, tol = rows(sys.argv[1]), rows(sys.argv[2]), float(sys.argv[3])
ok = len(a) == len(b) > 0
for x, y in zip(a, b):
    print(f"step {x['step']}: loss {x['loss']:.6f} {y['loss']:.6f}  aux {x['aux_loss']:.6f} {y['aux_loss']:.6f}  "
          f"norm {x['grad_norm']:.5f} {y['grad_norm']:.5f}")
    ok = ok and abs(x["loss"] - y["loss"]) <= tol * max(1.0, abs(x["loss"]))
    ok = ok and abs(x["aux_loss"] - y["aux_loss"]) <= tol * abs(x["aux_loss"]) and x["aux_loss"] > 0
    ok = ok and abs(x["grad_norm"] - y["grad_norm"]) <= tol * max(1.0, abs(x["grad_norm"]))
sys.exit(0 if ok else 1)
PY
}
echo "fp32, cpu against cuda:"
same "$d/cpu.jsonl" "$d/cuda.jsonl" 1e-3 || exit 1
echo "fp32, 2 x batch $half accumulated, cpu against cuda:"
same "$d/accumcpu.jsonl" "$d/accumcuda.jsonl" 1e-3 || exit 1
echo "bf16, cpu against cuda:"
same "$d/cpu16.jsonl" "$d/cuda16.jsonl" 2e-2 || exit 1

# Offloaded on the GPU (the state in pinned host memory, a cache of chunks on the GPU): the same
# steps, fp32 and bf16, against the same cpu runs.
ferry_run offload "${common[@]}" --device cuda --precision fp32 --offload --log "$d/offload.jsonl"
ferry_run offload16 "${common[@]}" --device cuda --precision bf16 --offload --log "$d/offload16.jsonl"
echo "fp32, cpu against cuda --offload:"
same "$d/cpu.jsonl" "$d/offload.jsonl" 1e-3 || exit 1
echo "bf16, cpu against cuda --offload:"
same "$d/cpu16.jsonl" "$d/offload16.jsonl" 2e-2 || exit 1
# One token a pass (--batch 1 --seq 1, 2 micro-batches a step): 2 of each mixture's 4 experts get
# it, and only those are loaded (the log's count so far of the experts' ranges loaded, against the
# experts of the chunks loaded from home); 2 cache blocks for the 6 chunks, so that backward loads
# the mixtures' chunks and their experts again; the others' zero gradients still go through the
# micro-batches' sum and AdamW as on the cpu.
one=(--batch 1 --seq 1 --grad-accum 2)
ferry_run onecpu "${common[@]}" "${one[@]}" --device cpu --log "$d/onecpu.jsonl"
ferry_run oneoffload "${common[@]}" "${one[@]}" --device cuda --precision fp32 --offload --blocks 2 \
  --log "$d/oneoffload.jsonl"
echo "fp32, one token a pass, cpu against cuda --offload:"
same "$d/onecpu.jsonl" "$d/oneoffload.jsonl" 1e-3 || exit 1
python3 - "$d/oneoffload.jsonl" <<'PY' || exit 1
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"expert_chunks"' in l]
if not r:
    sys.exit("cuda_train_moe.sh: the offloaded run's log has no expert chunk counts")
n, total = r[-1]["expert_chunks_loaded"], r[-1]["expert_chunks"]
print(f"one token a pass: expert chunks loaded {n} of {total}")
sys.exit(0 if 0 < n and 2 * n <= total else 1)
PY
echo "cuda_train_moe.sh: all agree"
