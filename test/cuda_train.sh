#!/usr/bin/env bash
# test/cuda_train.sh: ferry train on --device cuda against --device cpu, a few steps of a small
# model: fp32 losses to rounding; bf16 within bf16's rounding; accumulation and a resumed
# checkpoint; offloaded (a chunk cache on the GPU, chunks and their AdamW state kept there) in
# fp32 and bf16, with --optimizer-lag 1, --spec-chunks, --device-updates and with --optimizer-state 8bit; plans from ferry plan --device cuda (offloaded, resident; bf16 and fp32) and --plan auto; dropout
# with validation between steps; ferry sample on the GPU, resident and offloaded. bench/gpu/check.sh
# runs it on a GPU with opt-demo; ./test.sh on the CUDA emulator (test/cudaemu) with a smaller model.
#
# usage: test/cuda_train.sh FERRY DIR [--model M] [--batch B] [--seq T] [--offload-mem SIZE] [--blocks N]
#   DIR          where the runs' logs and checkpoints go (made if missing)
#   --model M    a preset or a config.json directory (default opt-demo), --batch B (4), --seq T (128)
#   --offload-mem SIZE   --device-mem of the offloaded runs: room for a few of the model's chunks
#                (default 160MiB, for opt-demo)
#   --blocks N   the offloaded runs' cache blocks (default: what --offload-mem leaves)
# Exit status: 0 when every comparison holds, 1 otherwise, 2 for bad usage.
set -uo pipefail

[ $# -ge 2 ] || { sed -n '9,15p' "$0" >&2; exit 2; }
ferry="$1" d="$2"
shift 2
model=opt-demo batch=4 seq=128 offload_mem=160MiB blocks=()
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || { echo "cuda_train.sh: $1 needs a value" >&2; exit 2; }
  case "$1" in
    --model) model="$2" ;;
    --batch) batch="$2" ;;
    --seq) seq="$2" ;;
    --offload-mem) offload_mem="$2" ;;
    --blocks) blocks=(--blocks "$2") ;;
    *) echo "cuda_train.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ -x "$ferry" ] || { echo "cuda_train.sh: $ferry is not a program" >&2; exit 2; }
mkdir -p "$d" || exit 2
data="$(cd "$(dirname "$0")/.." && pwd)/data/demo"
half=$((batch / 2))
[ $((half * 2)) -eq "$batch" ] && [ "$half" -gt 0 ] || { echo "cuda_train.sh: --batch must be even (accumulation runs 2 x B/2)" >&2; exit 2; }

# ferry_run NAME ARGS...: ferry ARGS with its output in $d/NAME.out, shown when it fails
ferry_run() { local name="$1"; shift; "$ferry" "$@" >"$d/$name.out" 2>&1 || { cat "$d/$name.out"; exit 1; }; }
# fp32 on both sides: the losses of 8 steps agree to rounding.
common=(train --model "$model" --steps 8 --batch "$batch" --seq "$seq" --seed 1 --lr 1e-3 --warmup 0 --no-shuffle)
same32() {  # CPU.jsonl CUDA.jsonl: the fp32 losses agree
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{") and '"loss"' in l] for p in sys.argv[1:])
print("cpu ", " ".join(f"{x:.6f}" for x in a))
print("cuda", " ".join(f"{x:.6f}" for x in b))
ok = len(a) == len(b) > 0 and all(abs(x - y) <= 1e-3 * max(1.0, abs(x)) for x, y in zip(a, b))
sys.exit(0 if ok else 1)
PY
}
ferry_run cpu "${common[@]}" --device cpu --log "$d/cpu.jsonl" || exit 1
ferry_run cuda "${common[@]}" --device cuda --precision fp32 --log "$d/cuda.jsonl" || exit 1
if ! same32 "$d/cpu.jsonl" "$d/cuda.jsonl"; then
  # Which part: the same run with the epilogue fusions off (relu and the residual adds as ops).
  if FERRY_CUDA_FUSE=0 ferry_run nofuse "${common[@]}" --device cuda --precision fp32 --log "$d/nofuse.jsonl" &&
    same32 "$d/cpu.jsonl" "$d/nofuse.jsonl"; then
    echo "with FERRY_CUDA_FUSE=0 the losses agree: the fused epilogues are at fault"
  else
    echo "with FERRY_CUDA_FUSE=0 they still differ: not (only) the fused epilogues"
  fi
  exit 1
fi
# ferry eval of a freshly initialised model (no --init: no AdamW state to zero on the GPU) on the
# GPU and on the CPU: the same fp32 loss.
ev=(eval --model "$model" --batch "$batch" --seq "$seq" --batches 2 --seed 1)
ferry_run evalcpu "${ev[@]}" --device cpu || exit 1
ferry_run evalcuda "${ev[@]}" --device cuda --precision fp32 || exit 1
python3 - "$d/evalcpu.out" "$d/evalcuda.out" <<'PY' || exit 1
import re, sys
a, b = (float(re.search(r"eval loss ([0-9.]+)", open(p).read()).group(1)) for p in sys.argv[1:])
print(f"eval, random init: cpu {a:.6f} cuda {b:.6f}")
sys.exit(0 if abs(a - b) <= 1e-3 * max(1.0, a) else 1)
PY
# ... in bf16, resident (the weights in bf16 alone on the GPU) and offloaded (in bf16 alone in
# pinned host memory, a cache of their chunks on the GPU): the same loss.
ferry_run evalcuda16 "${ev[@]}" --device cuda || exit 1
ferry_run evaloff16 "${ev[@]}" --device cuda --offload --device-mem "$offload_mem" || exit 1
python3 - "$d/evalcuda16.out" "$d/evaloff16.out" <<'PY' || exit 1
import re, sys
a, b = (float(re.search(r"eval loss ([0-9.]+)", open(p).read()).group(1)) for p in sys.argv[1:])
print(f"eval bf16, random init: resident {a:.6f} offloaded {b:.6f}")
sys.exit(0 if abs(a - b) <= 1e-3 * max(1.0, a) else 1)
PY
# bf16 compute (fp32 master and AdamW state) on the GPU against the CPU's bf16 numerics: the
# same 8 steps within bf16's rounding.
ferry_run cpu16 "${common[@]}" --device cpu --precision bf16 --log "$d/cpu16.jsonl" || exit 1
ferry_run cuda16 "${common[@]}" --device cuda --precision bf16 --log "$d/cuda16.jsonl" || exit 1
# A resident model that --device-mem cannot hold is refused before anything is allocated, with what
# it needs (the run's own peak: 1 MiB short of it fails) and the ways to make it fit.
peak="$(python3 -c 'import json,sys; print(int(max(json.loads(l)["device_peak_mib"] for l in open(sys.argv[1]) if l.startswith("{"))))' "$d/cuda16.jsonl")"
if "$ferry" "${common[@]}" --device cuda --precision bf16 --device-mem "$((peak - 1))MiB" --steps 1 >"$d/toobig.out" 2>&1; then
  echo "a resident model bigger than --device-mem trained"; exit 1
fi
grep -q "resident on GPU 0 .* needs .* but --device-mem is .*--offload" "$d/toobig.out" || { cat "$d/toobig.out"; echo "unclear refusal"; exit 1; }
python3 - "$d/cpu16.jsonl" "$d/cuda16.jsonl" "$d/cpu.jsonl" <<'PY' || exit 1
import json, sys
a, b, f32 = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{") and '"loss"' in l] for p in sys.argv[1:])
print("cpu bf16 ", " ".join(f"{x:.5f}" for x in a))
print("cuda bf16", " ".join(f"{x:.5f}" for x in b))
ok = len(a) == len(b) == len(f32) > 0 and all(abs(x - y) <= 2e-2 * max(1.0, abs(x)) for x, y in zip(a, b))
ok = ok and all(abs(x - y) <= 5e-2 * max(1.0, abs(x)) for x, y in zip(f32, b))
sys.exit(0 if ok else 1)
PY
# Gradient accumulation (2 x batch 2 = batch 4) and a checkpoint resumed on the GPU (8 steps
# straight = 4, a checkpoint, 4 more in a new process), bf16 both.
b16=(--device cuda --precision bf16)
ferry_run accum "${common[@]}" "${b16[@]}" --batch "$half" --grad-accum 2 --log "$d/accum.jsonl" || exit 1
ferry_run ck1 "${common[@]}" "${b16[@]}" --save "$d/ck" --save-every 4 --stop-after 4 || exit 1
ferry_run ck2 "${common[@]}" "${b16[@]}" --resume "$d/ck" --log "$d/resumed.jsonl" || exit 1
python3 - "$d/cuda16.jsonl" "$d/accum.jsonl" "$d/resumed.jsonl" <<'PY' || exit 1
import json, sys
rows = [{r["step"]: r["loss"] for r in (json.loads(l) for l in open(p) if l.startswith("{"))} for p in sys.argv[1:]]
straight, accum, resumed = rows
print("accum  ", " ".join(f"{accum[k]:.5f}" for k in sorted(accum)))
print("resumed", " ".join(f"{resumed[k]:.5f}" for k in sorted(resumed)))
ok = sorted(accum) == sorted(straight) and all(abs(accum[k] - straight[k]) <= 2e-2 * abs(straight[k]) for k in straight)
ok = ok and sorted(resumed) == [5, 6, 7, 8] and all(abs(resumed[k] - straight[k]) <= 1e-5 * abs(straight[k]) for k in resumed)
sys.exit(0 if ok else 1)
PY
# Offloading on the GPU (--offload: state in pinned host memory, a chunk cache on the GPU with
# room for a few chunks) gives the resident run's numbers (fp32, the same kernels in the same
# order: equal to rounding).
ferry_run offload "${common[@]}" --device cuda --precision fp32 --offload --device-mem "$offload_mem" "${blocks[@]}" --log "$d/offload.jsonl" ||
  exit 1
grep "cache blocks" "$d/offload.out" || true
# The same with the first two chunks and their AdamW state kept on the GPU (the chunk kernels:
# sums of squares, AdamW with the scale from device memory).
ferry_run devchunks "${common[@]}" --device cuda --precision fp32 --offload --device-mem "$offload_mem" "${blocks[@]}" --device-chunks 2 \
  --log "$d/devchunks.jsonl" ||
  exit 1
python3 - "$d/cuda.jsonl" "$d/offload.jsonl" "$d/devchunks.jsonl" <<'PY' || exit 1
import json, sys
a, b, c = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:])
print("offload   ", " ".join(f"{x:.6f}" for x in b))
print("dev chunks", " ".join(f"{x:.6f}" for x in c))
close = lambda u, v: len(u) == len(v) > 0 and all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(u, v))
sys.exit(0 if close(a, b) and close(a, c) else 1)
PY
# A system that limits pinned memory (the emulator's FY_EMU_PIN_LIMIT: cudaHostRegister refuses
# past 600 kB; a GPU ignores it): the blocks it cannot pin stay pageable, with one warning, and the
# numbers are the same.
if "$ferry" version | grep -q "emulator"; then
  FY_EMU_PIN_LIMIT=600000 ferry_run pageable "${common[@]}" --device cuda --precision fp32 --offload \
    --device-mem "$offload_mem" "${blocks[@]}" --log "$d/pageable.jsonl" || exit 1
  grep -q "host tier: pinning .* failed .* stay in pageable memory" "$d/pageable.out" ||
    { cat "$d/pageable.out"; echo "no warning that pinning failed"; exit 1; }
  python3 - "$d/offload.jsonl" "$d/pageable.jsonl" <<'PY' || exit 1
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:])
print("pageable  ", " ".join(f"{x:.6f}" for x in b))
sys.exit(0 if len(a) == len(b) > 0 and a == b else 1)
PY
fi
# A plan written for the GPU (ferry plan --device cuda --offload, timed from this machine with the
# GPU's memory; bf16 compute, a GPU's default) runs there, offloaded with the plan's micro-batches,
# chunks, blocks and prefetch: the resident bf16 run's losses (within the offloaded bf16 runs'
# bound below), and the device memory the plan predicted (blocks, activations, the kernels'
# scratch: within 3%).
FERRY_PROBE="$d/probe.json" "$ferry" plan --device cuda --offload --device-mem "$offload_mem" --model "$model" \
  --batch "$batch" --seq "$seq" --out "$d/plan.json" >"$d/plan.out" 2>&1 || { cat "$d/plan.out"; exit 1; }
ferry_run planned "${common[@]}" --device cuda --precision bf16 --plan "$d/plan.json" --device-mem "$offload_mem" \
  --log "$d/planned.jsonl" || exit 1
grep -q "cuda:0 device" "$d/planned.out" || { echo "--plan FILE --device cuda did not train on the GPU"; exit 1; }
python3 - "$d/cuda16.jsonl" "$d/planned.jsonl" "$d/plan.json" <<'PY' || exit 1
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:3])
print("planned   ", " ".join(f"{x:.5f}" for x in b))
ok = len(a) == len(b) > 0 and all(abs(x - y) <= 5e-3 * max(1.0, abs(x)) for x, y in zip(a, b))
plan = json.load(open(sys.argv[3]))
want = plan["predicted"]["device_peak_bytes"] / 1048576.0
got = max(json.loads(l)["device_peak_mib"] for l in open(sys.argv[2]) if l.startswith("{"))
print("planned device peak %.2f MiB, the run's %.2f MiB (%d blocks)" % (want, got, plan["blocks"]))
sys.exit(0 if ok and abs(got - want) <= 0.03 * want else 1)
PY
# The same plan without chunks kept on the GPU, and again with 2 device updates (the plan file's
# "device_updates"): the same losses to the last digit, and the second's device peak the first's
# plus the two staging sets the planner counts (a piece's fp32 master, m and v, its gradients as
# they come home, bf16 with one micro-batch a step and else fp32, and its bf16 copy, each in
# 256-byte granules; a piece a quarter of a chunk in whole 256-element blocks) and the steps'
# scales: the staging is what the runtime allocates.
for n in 0 2; do
  python3 -c 'import json, sys; p = json.load(open(sys.argv[1])); p.update(device_chunks=0, device_updates=int(sys.argv[3])); json.dump(p, open(sys.argv[2], "w"))' \
    "$d/plan.json" "$d/plandu$n.json" "$n"
  ferry_run planneddu$n "${common[@]}" --device cuda --precision bf16 --plan "$d/plandu$n.json" \
    --device-mem "$offload_mem" --log "$d/planneddu$n.jsonl" || exit 1
done
python3 - "$d/planneddu0.jsonl" "$d/planneddu2.jsonl" "$d/plan.json" <<'PY' || exit 1
import json, sys
a, b = ([json.loads(l) for l in open(p) if l.startswith("{")] for p in sys.argv[1:3])
plan = json.load(open(sys.argv[3]))
ce, gb = plan["chunk_elems"], 2 if plan["grad_accum"] == 1 else 4
up = lambda n: (n + 255) // 256 * 256
pe = up((ce + 3) // 4)
staging = (2 * (3 * up(pe * 4) + up(pe * gb) + up(pe * 2)) + up(16)) / 1048576.0
grew = max(r["device_peak_mib"] for r in b) - max(r["device_peak_mib"] for r in a)
same = [r["loss"] for r in a] == [r["loss"] for r in b]
print("planned, 2 device updates: losses %s; device peak %.4f MiB more, the staging %.4f MiB" % (
    "the same" if same else "not the same", grew, staging))
sys.exit(0 if len(a) > 0 and same and b[-1].get("device_updates") == 2 and abs(grew - staging) <= 2e-4 else 1)
PY
# With room for the whole model on the GPU and too little host memory to offload it the plan is
# resident: it trains without --offload (the resident bf16 run's losses, to rounding), and its
# device memory is the run's peak to the log's 0.1 MiB (the model's buffers and the kernels'
# scratch, byte for byte).
FERRY_PROBE="$d/probe.json" "$ferry" plan --device cuda --device-mem 2GiB --host-mem 64KiB --model "$model" \
  --batch "$batch" --seq "$seq" --out "$d/resident.json" >"$d/resident_plan.out" 2>&1 || { cat "$d/resident_plan.out"; exit 1; }
grep -q '"resident":true' "$d/resident.json" || { cat "$d/resident_plan.out"; echo "the plan for a model that fits the GPU is not resident"; exit 1; }
ferry_run resident "${common[@]}" --device cuda --plan "$d/resident.json" --device-mem 2GiB --log "$d/resident.jsonl" || exit 1
grep -q "the whole model resident" "$d/resident.out" || { cat "$d/resident.out"; echo "--plan (resident) did not say so"; exit 1; }
python3 - "$d/cuda16.jsonl" "$d/resident.jsonl" "$d/resident.json" <<'PY' || exit 1
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:3])
print("resident  ", " ".join(f"{x:.5f}" for x in b))
plan = json.load(open(sys.argv[3]))
ok = len(a) == len(b) > 0 and all(abs(x - y) <= (5e-3 if plan["recompute"] else 1e-6) * max(1.0, abs(x)) for x, y in zip(a, b))
want = plan["predicted"]["device_peak_bytes"] / 1048576.0
rows = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
got = max(r["device_peak_mib"] for r in rows)
other = rows[-1].get("device_other_mib", -1)  # (the GPU's memory in use besides ferry's: CUDA's own)
print("resident plan: device peak %.2f MiB predicted, the run's %.2f MiB; host tier %.1f MiB; %.1f MiB of the GPU "
      "in use besides" % (want, got, rows[-1]["host_tier_mib"], other))
sys.exit(0 if ok and abs(got - want) <= 0.051 and rows[-1]["host_tier_mib"] == 0 and other >= 0 else 1)
PY
# The same two plans for fp32 compute (ferry plan --precision fp32: 4-byte blocks, activations and
# gradients, no bf16 copy of the weights): the run computes in the plan's precision (no
# --precision given), gives the fp32 run's losses, and takes the device memory the plan predicted
# (offloaded within 3%, resident to the log's 0.1 MiB), more than the bf16 plan's.
for kind in offloaded resident; do
  if [ "$kind" = offloaded ]; then where=(--offload --device-mem "$offload_mem") mem="$offload_mem" bf=plan
  else where=(--device-mem 2GiB --host-mem 64KiB) mem=2GiB bf=resident; fi
  FERRY_PROBE="$d/probe.json" "$ferry" plan --device cuda --precision fp32 "${where[@]}" --model "$model" \
    --batch "$batch" --seq "$seq" --out "$d/${kind}32.json" >"$d/${kind}32_plan.out" 2>&1 ||
    { cat "$d/${kind}32_plan.out"; exit 1; }
  ferry_run "${kind}32" "${common[@]}" --device cuda --plan "$d/${kind}32.json" --device-mem "$mem" \
    --log "$d/${kind}32.jsonl" || exit 1
  grep -q "M parameters, fp32," "$d/${kind}32.out" || { cat "$d/${kind}32.out"; echo "the fp32 plan did not train in fp32"; exit 1; }
  python3 - "$d/cuda.jsonl" "$d/${kind}32.jsonl" "$d/${kind}32.json" "$d/$bf.json" "$kind" <<'PY' || exit 1
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:3])
plan, plan16 = (json.load(open(p)) for p in sys.argv[3:5])
print("%-10s" % (sys.argv[5] + "32"), " ".join(f"{x:.5f}" for x in b))
ok = len(a) == len(b) > 0 and all(abs(x - y) <= 1e-3 * max(1.0, abs(x)) for x, y in zip(a, b))
want = plan["predicted"]["device_peak_bytes"] / 1048576.0
got = max(json.loads(l)["device_peak_mib"] for l in open(sys.argv[2]) if l.startswith("{"))
want16 = plan16["predicted"]["device_peak_bytes"] / 1048576.0
print("%s fp32 plan: device peak %.2f MiB predicted (bf16: %.2f), the run's %.2f MiB" % (sys.argv[5], want, want16, got))
tol = 0.03 * want if sys.argv[5] == "offloaded" else 0.051
sys.exit(0 if ok and plan["precision"] == "fp32" and abs(got - want) <= tol and (want > want16 or sys.argv[5] == "offloaded") else 1)
PY
done
# --plan auto on the GPU: the GPU measured (ferry probe's figures for GPU 0: on ./test.sh the
# emulator's) and cached, the fastest plan chosen for it and trained: the resident bf16 run's
# losses within the offloaded bf16 runs' bound.
FERRY_PROBE="$d/auto_probe.json" ferry_run auto "${common[@]}" --device cuda --plan auto --log "$d/auto.jsonl" || exit 1
grep -q '"device": *"cuda"' "$d/auto_probe.json" || { cat "$d/auto.out"; echo "--plan auto did not probe the GPU"; exit 1; }
python3 - "$d/cuda16.jsonl" "$d/auto.jsonl" <<'PY' || exit 1
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:3])
print("plan auto ", " ".join(f"{x:.5f}" for x in b))
sys.exit(0 if len(a) == len(b) > 0 and all(abs(x - y) <= 5e-3 * max(1.0, abs(x)) for x, y in zip(a, b)) else 1)
PY

# Dropout (the GPU draws the CPU's masks) with validation between steps (forward passes without
# dropout; offloaded: the forward part of a pass through the chunk cache), fp32: cpu, cuda and
# cuda --offload agree to rounding, losses and validation losses.
dv=(--dropout 0.1 --val-data "$data" --val-every 4 --val-batches 2)
ferry_run cpudrop "${common[@]}" "${dv[@]}" --device cpu --log "$d/cpudrop.jsonl" || exit 1
ferry_run cudadrop "${common[@]}" "${dv[@]}" --device cuda --precision fp32 --log "$d/cudadrop.jsonl" || exit 1
ferry_run offdrop "${common[@]}" "${dv[@]}" --device cuda --precision fp32 --offload --device-mem "$offload_mem" "${blocks[@]}" \
  --log "$d/offdrop.jsonl" || exit 1
python3 - "$d/cpudrop.jsonl" "$d/cudadrop.jsonl" "$d/offdrop.jsonl" <<'PY' || exit 1
import json, sys
rows = [[json.loads(l) for l in open(p) if l.startswith("{")] for p in sys.argv[1:]]
get = lambda rs, k: [r[k] for r in rs if k in r]
for name, rs in zip(("cpu", "cuda", "offload"), rows):
  print(f"dropout {name:8}", " ".join(f"{x:.5f}" for x in get(rs, "loss")), "| val", " ".join(f"{x:.5f}" for x in get(rs, "val_loss")))
close = lambda u, v: len(u) == len(v) > 0 and all(abs(x - y) <= 1e-3 * max(1.0, abs(x)) for x, y in zip(u, v))
ok = all(close(get(rows[0], k), get(r, k)) for r in rows[1:] for k in ("loss", "val_loss"))
ok = ok and len(get(rows[0], "val_loss")) == 2
sys.exit(0 if ok else 1)
PY
# bf16 chunks offloaded (the weights cross the link in bf16, a host copy refreshed by every
# update; the gradients come home widened to fp32) against bf16 resident: the same kernels in
# the same order, AdamW on the host instead of the GPU (last-bit differences may move a
# weight's bf16 rounding).
ferry_run offload16 "${common[@]}" "${b16[@]}" --offload --device-mem "$offload_mem" "${blocks[@]}" --log "$d/offload16.jsonl" || exit 1
# The first step's gradients are the resident run's (the same weights and kernels), and so is
# their norm: the sums of squares are taken from the blocks on the GPU before the gradients go
# home (a sum of a block already reused for another chunk's weights would differ).
python3 - "$d/cuda16.jsonl" "$d/offload16.jsonl" <<'PY' || exit 1
import json, sys
a, b = ([json.loads(l)["grad_norm"] for l in open(p) if l.startswith("{") and '"grad_norm"' in l] for p in sys.argv[1:])
print("first step's norm, resident and offloaded bf16:", a[0], b[0])
sys.exit(0 if a[0] == b[0] else 1)
PY
# ... with two chunks' m and v on disk (their bf16 gradients come home over the host copy, as the
# others'): the same numbers, bit for bit.
ferry_run disk16 "${common[@]}" "${b16[@]}" --offload --device-mem "$offload_mem" "${blocks[@]}" --disk-dir "$d/disk" \
  --disk-chunks 2 --log "$d/disk16.jsonl" || exit 1
grep -q "AdamW state of 2 chunks on disk" "$d/disk16.out" || { cat "$d/disk16.out"; echo "no chunks on disk"; exit 1; }
# ... and with those two chunks' fp32 master weights on disk too (--disk-master; the host keeps
# their bf16 copy, which the update writes from the master read back): the same bits.
ferry_run diskm16 "${common[@]}" "${b16[@]}" --offload --device-mem "$offload_mem" "${blocks[@]}" --disk-dir "$d/diskm" \
  --disk-chunks 2 --disk-master --log "$d/diskm16.jsonl" || exit 1
# ... and with the first two chunks on the GPU in bf16 (the kernels read their bf16 copy there;
# the deferred AdamW reads bf16 gradients and rewrites the copy), alone and with accumulation
# (the bf16 gradients summed in fp32 on the GPU) against the resident accumulated run.
ferry_run devchunks16 "${common[@]}" "${b16[@]}" --offload --device-mem "$offload_mem" "${blocks[@]}" --device-chunks 2 \
  --log "$d/devchunks16.jsonl" || exit 1
ferry_run devchunks16acc "${common[@]}" "${b16[@]}" --offload --device-mem "$offload_mem" "${blocks[@]}" --device-chunks 2 --batch "$half" \
  --grad-accum 2 --log "$d/devchunks16acc.jsonl" || exit 1
python3 - "$d/cuda16.jsonl" "$d/offload16.jsonl" "$d/devchunks16.jsonl" "$d/accum.jsonl" "$d/devchunks16acc.jsonl" \
  "$d/disk16.jsonl" "$d/diskm16.jsonl" <<'PY' || exit 1
import json, sys
a, b, c, acc, dacc, disk, diskm = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:])
print("offload bf16     ", " ".join(f"{x:.5f}" for x in b))
print("2 chunks on disk ", " ".join(f"{x:.5f}" for x in disk), "(the same)" if disk == b else "(not the same)")
print("+ masters there  ", " ".join(f"{x:.5f}" for x in diskm), "(the same)" if diskm == b else "(not the same)")
if disk != b or diskm != b:
    sys.exit(1)
print("dev chunks bf16  ", " ".join(f"{x:.5f}" for x in c))
print("dev chunks accum ", " ".join(f"{x:.5f}" for x in dacc))
close = lambda u, v: len(u) == len(v) > 0 and all(abs(x - y) <= 5e-3 * max(1.0, abs(x)) for x, y in zip(u, v))
sys.exit(0 if close(a, b) and close(a, c) and close(acc, dacc) else 1)
PY
# --optimizer-lag 1 offloaded on the GPU: each step's host updates run under the next step (two
# bf16 copies a chunk), the device chunks' after the next step's passes. Against the CPU's
# lagged bf16 run within bf16's rounding; with two chunks' m and v on disk the same bits; its
# first step the exact run's, its later ones not.
lag=(--offload --device-mem "$offload_mem" "${blocks[@]}" --optimizer-lag 1)
ferry_run cpulag16 "${common[@]}" --device cpu --precision bf16 --optimizer-lag 1 --log "$d/cpulag16.jsonl" || exit 1
ferry_run lag16 "${common[@]}" "${b16[@]}" "${lag[@]}" --log "$d/lag16.jsonl" || exit 1
ferry_run lagdisk16 "${common[@]}" "${b16[@]}" "${lag[@]}" --disk-dir "$d/disklag" --disk-chunks 2 \
  --log "$d/lagdisk16.jsonl" || exit 1
ferry_run lagdev16 "${common[@]}" "${b16[@]}" "${lag[@]}" --device-chunks 2 --log "$d/lagdev16.jsonl" || exit 1
python3 - "$d/cpulag16.jsonl" "$d/lag16.jsonl" "$d/lagdisk16.jsonl" "$d/lagdev16.jsonl" "$d/offload16.jsonl" <<'PY' || exit 1
import json, sys
cpu, lag, disk, dev, exact = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:])
print("lag 1 cpu bf16   ", " ".join(f"{x:.5f}" for x in cpu))
print("lag 1 offload    ", " ".join(f"{x:.5f}" for x in lag))
print("lag 1, 2 on disk ", " ".join(f"{x:.5f}" for x in disk), "(the same)" if disk == lag else "(not the same)")
print("lag 1, 2 on GPU  ", " ".join(f"{x:.5f}" for x in dev))
close = lambda u, v, e: len(u) == len(v) > 0 and all(abs(x - y) <= e * max(1.0, abs(x)) for x, y in zip(u, v))
ok = close(cpu, lag, 2e-2) and disk == lag and close(lag, dev, 5e-3)
ok = ok and lag[0] == exact[0] and lag[1:] != exact[1:]
sys.exit(0 if ok else 1)
PY
# --spec-chunks offloaded on the GPU: host chunks updated as their gradients come home (summed on
# the GPU), before the norm, into spare slots, kept or redone by the norm: the exact offloaded run's
# losses, to the last digit, with every step clipping (the default --clip 1 here), with none
# clipping (--clip 100, against its own exact run), and with two chunks on the GPU.
spec=(--offload --device-mem "$offload_mem" "${blocks[@]}" --spec-chunks 1000)
ferry_run spec16 "${common[@]}" "${b16[@]}" "${spec[@]}" --log "$d/spec16.jsonl" || exit 1
ferry_run noclip16 "${common[@]}" "${b16[@]}" --offload --device-mem "$offload_mem" "${blocks[@]}" --clip 100 \
  --log "$d/noclip16.jsonl" || exit 1
ferry_run specnoclip16 "${common[@]}" "${b16[@]}" "${spec[@]}" --clip 100 --device-chunks 2 \
  --log "$d/specnoclip16.jsonl" || exit 1
ferry_run devnoclip16 "${common[@]}" "${b16[@]}" --offload --device-mem "$offload_mem" "${blocks[@]}" --clip 100 \
  --device-chunks 2 --log "$d/devnoclip16.jsonl" || exit 1
grep -q "kept in 0 of" "$d/spec16.out" && grep -q "kept in 8 of 8" "$d/specnoclip16.out" ||
  { echo "spec: the counts of kept and redone steps are not as expected"; grep "speculative" "$d/spec16.out" "$d/specnoclip16.out"; exit 1; }
python3 - "$d/offload16.jsonl" "$d/spec16.jsonl" "$d/devnoclip16.jsonl" "$d/specnoclip16.jsonl" <<'PY' || exit 1
import json, sys
a, b, c, e = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:])
print("spec, clip 1     ", " ".join(f"{x:.5f}" for x in b), "(the same)" if a == b else "(not the same)")
print("spec, clip 100   ", " ".join(f"{x:.5f}" for x in e), "(the same)" if c == e else "(not the same)")
sys.exit(0 if a == b and c == e and len(a) > 0 and len(c) > 0 else 1)
PY
# --optimizer-state 8bit offloaded on the GPU: host chunks updated on the host, two chunks on the
# GPU by its 8-bit kernel (the same codes as the CPU's), two on disk at their stored size: against
# the CPU's bf16 run with 8-bit state within bf16's rounding.
q8=(--offload --device-mem "$offload_mem" "${blocks[@]}" --optimizer-state 8bit)
ferry_run cpuq8 "${common[@]}" --device cpu --precision bf16 --optimizer-state 8bit --log "$d/cpuq8.jsonl" || exit 1
ferry_run q8 "${common[@]}" "${b16[@]}" "${q8[@]}" --device-chunks 2 --disk-dir "$d/diskq8" --disk-chunks 2 \
  --log "$d/q8.jsonl" || exit 1
python3 - "$d/cpuq8.jsonl" "$d/q8.jsonl" "$d/offload16.jsonl" <<'PY' || exit 1
import json, sys
cpu, q8, exact = ([json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:])
print("8-bit state cpu  ", " ".join(f"{x:.5f}" for x in cpu))
print("8-bit state GPU  ", " ".join(f"{x:.5f}" for x in q8))
close = lambda u, v, e: len(u) == len(v) > 0 and all(abs(x - y) <= e * max(1.0, abs(x)) for x, y in zip(u, v))
sys.exit(0 if close(cpu, q8, 2e-2) and q8 != exact else 1)
PY
# --device-updates offloaded on the GPU: host chunks updated by the GPU's AdamW after the norm,
# their master, m, v and gradients over the link and back: the exact offloaded runs' losses to the
# last digit, in fp32, in bf16 (every step clipping), beside speculation and two chunks on the GPU
# (no step clipping), and with 8-bit state beside GPU and disk chunks.
du=(--offload --device-mem "$offload_mem" "${blocks[@]}" --device-updates 1000)
ferry_run du32 "${common[@]}" --device cuda --precision fp32 "${du[@]}" --log "$d/du32.jsonl" || exit 1
ferry_run du16 "${common[@]}" "${b16[@]}" "${du[@]}" --log "$d/du16.jsonl" || exit 1
ferry_run duspec16 "${common[@]}" "${b16[@]}" "${du[@]}" --spec-chunks 2 --clip 100 --device-chunks 2 \
  --log "$d/duspec16.jsonl" || exit 1
ferry_run duq8 "${common[@]}" "${b16[@]}" "${q8[@]}" --device-chunks 2 --disk-dir "$d/diskduq8" --disk-chunks 2 \
  --device-updates 1000 --log "$d/duq8.jsonl" || exit 1
grep -q "device updates: [1-9][0-9]* host chunk" "$d/du16.out" ||
  { echo "device updates: the run does not say how many chunks the GPU updates"; exit 1; }
python3 - "$d/offload.jsonl" "$d/du32.jsonl" "$d/offload16.jsonl" "$d/du16.jsonl" "$d/devnoclip16.jsonl" \
  "$d/duspec16.jsonl" "$d/q8.jsonl" "$d/duq8.jsonl" <<'PY' || exit 1
import json, sys
runs = [[json.loads(l)["loss"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:]]
ok = True
for name, (a, b) in zip(("fp32", "bf16", "bf16 spec, 2 on GPU", "8-bit state"), zip(runs[0::2], runs[1::2])):
    print(f"device updates {name:20s}", " ".join(f"{x:.5f}" for x in b), "(the same)" if a == b else "(not the same)")
    ok = ok and a == b and len(a) > 0
sys.exit(0 if ok else 1)
PY
# ferry sample on the GPU (a token at a time, the keys and values cached there) against the
# CPU's: the same tokens drawn in fp32 (the same seed), past a window of 8 (the cache run again
# from its newest half); bf16 draws as many tokens, each in the vocabulary.
ferry_run samplemodel "${common[@]}" --device cpu --save "$d/samplemodel" || exit 1
sp=(sample --init "$d/samplemodel" --prompt-ids 2,10,20 --tokens 24 --temperature 1 --seed 5 --seq 8 --stop none --quiet)
ferry_run samplecpu "${sp[@]}" || exit 1
ferry_run samplecuda "${sp[@]}" --device cuda --precision fp32 || exit 1
ferry_run samplecuda16 "${sp[@]}" --device cuda || exit 1
python3 - "$d/samplecpu.out" "$d/samplecuda.out" "$d/samplecuda16.out" "$d/samplemodel/config.json" <<'PY' || exit 1
import json, sys
a, b, c = ([int(x) for x in open(p).read().split()[-1].split(",")] for p in sys.argv[1:4])
V = json.load(open(sys.argv[4]))["vocab_size"]
print("sample cpu      ", a)
print("sample cuda fp32", b)
print("sample cuda bf16", c)
sys.exit(0 if a == b and len(c) == len(a) == 27 and all(0 <= x < V for x in c) else 1)
PY
# ... and offloaded (the weights in pinned host memory, a cache of their chunks on the GPU, every
# pass loading what it lacks): the tokens drawn resident, fp32 and bf16.
ferry_run sampleoff "${sp[@]}" --device cuda --precision fp32 --offload --device-mem "$offload_mem" "${blocks[@]}" || exit 1
ferry_run sampleoff16 "${sp[@]}" --device cuda --offload --device-mem "$offload_mem" "${blocks[@]}" || exit 1
python3 - "$d/samplecuda.out" "$d/sampleoff.out" "$d/samplecuda16.out" "$d/sampleoff16.out" <<'PY' || exit 1
import sys
a, b, c, e = ([int(x) for x in open(p).read().split()[-1].split(",")] for p in sys.argv[1:5])
print("sample offloaded fp32", b)
print("sample offloaded bf16", e)
sys.exit(0 if a == b and c == e else 1)
PY
echo "cuda_train: every comparison holds"
