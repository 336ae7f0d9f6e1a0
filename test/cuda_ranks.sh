#!/usr/bin/env bash
# test/cuda_ranks.sh: ferry train on several GPUs, one rank each (mpirun; --device cuda --offload:
# every chunk sharded across the ranks, its blocks gathered and its gradients reduce-scattered by
# NCCL on the copy streams; --tp; and resident replicas), against one rank with the same global
# batch. bench/gpu/check.sh runs it on a machine with two GPUs or more; ./test.sh on the CUDA
# emulator (test/cudaemu, whose NCCL runs the ranks' collectives through shared memory) with four
# emulated GPUs and a smaller model.
#
# usage: test/cuda_ranks.sh FERRY DIR [--model M] [--seq T] [--offload-mem SIZE] [--gpus N]
#   DIR          where the runs' logs and checkpoints go (made if missing)
#   --model M    a preset or a config.json directory (default opt-demo), --seq T (128)
#   --offload-mem SIZE   each rank's --device-mem (default 160MiB, for opt-demo)
#   --gpus N     GPUs on this machine (default: nvidia-smi's count); 2 ranks need 2, 3 ranks 3
# Checks: 2 ranks x batch 2 = 1 rank x batch 4 (fp32 losses within 1e-4: each gradient summed in
# two halves; bf16 within 2e-2: each rank's bf16 gradients summed by NCCL), with accumulation,
# with dropout and validation; each rank's host tier about half of one rank's; a checkpoint saved
# by 2 ranks resumed by 2 ranks (the straight run's losses) and by 1 rank; 3 ranks x 2 = 1 x 6 with
# three GPUs; tensor parallelism (--tp 2) = 1 rank, with its checkpoint and saved model, and a
# 2 x 2 grid with four GPUs; --tp 2 without --offload (slices on the GPUs) = 1 rank, with its
# checkpoint, a grid without --offload refused; 2 sharded ranks with --spec-chunks and --device-updates = the exact run; 2 resident replicas = 1 rank, with their
# checkpoint, and planned; plans of 2 resident stages, 2 resident tp slices and 2 offloaded stages
# = 1 rank; 2 pipeline stages (--pp 2) = 1 rank, with their checkpoint and
# validation, offloaded with 8-bit AdamW state and with --optimizer-lag 1, and ferry eval --pp 2 =
# 1 GPU's loss; dp 2 x pp 2 and pp 2 x tp 2 (resident with its checkpoint, and offloaded) with
# four GPUs, dp 2 x pp 2 x tp 2 with eight; a mixture of experts through 2 stages (resident and
# offloaded) = 1 rank; expert parallelism (--ep 2, resident, opt-moe-tiny) = 1 rank accumulating,
# with experts that get no token (2 groups of ep 2 with four GPUs), planned, and offloaded, and
# in bf16 = 1 rank accumulating; tensor parallelism on opt-moe-tiny (--tp 2 resident, and offloaded
# as ferry plan lays it out) = 1 rank; two
# ranks on one GPU refused; a rank killed mid-run ends the job within
# --comm-timeout plus 10 s.
# Exit status: 0 when every check holds, 1 otherwise, 2 for bad usage, 77 with fewer than 2 GPUs
# or without mpirun.
set -uo pipefail

[ $# -ge 2 ] || { sed -n '8,12p' "$0" >&2; exit 2; }
ferry="$1" d="$2"
shift 2
model=opt-demo seq=128 mem=160MiB gpus=""
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || { echo "cuda_ranks.sh: $1 needs a value" >&2; exit 2; }
  case "$1" in
    --model) model="$2" ;;
    --seq) seq="$2" ;;
    --offload-mem) mem="$2" ;;
    --gpus) gpus="$2" ;;
    *) echo "cuda_ranks.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ -x "$ferry" ] || { echo "cuda_ranks.sh: $ferry is not a program" >&2; exit 2; }
command -v mpirun >/dev/null 2>&1 || { echo "cuda_ranks.sh: no mpirun: skipped"; exit 77; }
[ -n "$gpus" ] || gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
[ "$gpus" -ge 2 ] 2>/dev/null || { echo "cuda_ranks.sh: ${gpus:-no} GPU(s), 2 ranks need 2: skipped"; exit 77; }
mkdir -p "$d" || exit 2
data="$(cd "$(dirname "$0")/.." && pwd)/data/demo"
mpi=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
[ -n "${FY_EMU_GPUS:-}" ] && mpi+=(-x FY_EMU_GPUS)
pass=0 fail=0

# run NAME RANKS ARGS...: ferry train on RANKS ranks (1: no mpirun) with its output in $d/NAME.out
# (shown when it fails) and its log in $d/NAME.jsonl; with LOUD=1, without --quiet; with RES=1,
# resident (without --offload and its --device-mem)
run() {
  local name="$1" np="$2"
  shift 2
  local a skip="" args=()
  for a in "${common[@]}"; do
    if [ -n "$skip" ]; then skip=""; continue; fi
    if [ -n "${RES:-}" ] && [ "$a" = --device-mem ]; then skip=1; continue; fi
    [ -n "${RES:-}" ] && [ "$a" = --offload ] && continue
    [ -n "${LOUD:-}" ] && [ "$a" = --quiet ] || args+=("$a")
  done
  local cmd=("$ferry" "${args[@]}" "$@" --log "$d/$name.jsonl")
  [ "$np" -gt 1 ] && cmd=("${mpi[@]}" -np "$np" "${cmd[@]}")
  rm -f "$d/$name.jsonl"
  "${cmd[@]}" >"$d/$name.out" 2>&1 && return 0
  echo "FAIL  $name: exit $?"
  tail -20 "$d/$name.out"
  return 1
}
# check WHAT A B TOL [KEY]: the KEY (loss) values of A.jsonl and B.jsonl, step for step, within TOL
# relative; B may start later (a resumed run): its steps are compared with A's
check() {
  if python3 - "$d/$2.jsonl" "$d/$3.jsonl" "$4" "${5:-loss}" <<'PY'; then pass=$((pass + 1)); echo "ok    $1"; else fail=$((fail + 1)); echo "FAIL  $1"; fi
import json, sys
a, b, tol, key = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
rows = [{r["step"]: r[key] for r in (json.loads(l) for l in open(p) if l.startswith("{")) if key in r} for p in (a, b)]
for p, r in zip((a, b), rows):
    print("      %-40s" % p.rsplit("/", 1)[-1], " ".join("%.5f" % r[k] for k in sorted(r)))
ok = len(rows[1]) > 0 and set(rows[1]) <= set(rows[0])
ok = ok and all(abs(rows[0][k] - rows[1][k]) <= tol * max(1.0, abs(rows[0][k])) for k in rows[1])
sys.exit(0 if ok else 1)
PY
}

common=(train --model "$model" --steps 8 --seq "$seq" --seed 1 --lr 1e-3 --warmup 0 --no-shuffle --data "$data"
  --device cuda --offload --device-mem "$mem" --quiet)
for p in fp32 bf16; do
  run one$p 1 --precision $p --batch 4 || exit 1
  run two$p 2 --precision $p --batch 2 || exit 1
done
check "2 ranks x 2 = 1 rank x 4, fp32" onefp32 twofp32 1e-4
check "2 ranks x 2 = 1 rank x 4, bf16" onebf16 twobf16 2e-2
# half WHAT ONE TWO [AT_MOST]: each of TWO's ranks keeps about half of ONE's host tier: at most
# AT_MOST (default 0.55) of it, and a chunk
half() {
  if python3 - "$d/$2.jsonl" "$d/$3.jsonl" "${4:-0.55}" <<'PY'; then pass=$((pass + 1)); echo "ok    $1"; else fail=$((fail + 1)); echo "FAIL  $1"; fi
import json, sys
one, two = ([json.loads(l) for l in open(p) if l.startswith("{")][-1] for p in sys.argv[1:3])
print("      host tier: 1 rank %.3f MiB, each of 2 ranks %.3f MiB (chunk %.3f MiB)" % (one["host_tier_mib"], two["host_tier_mib"], two["chunk_mib"]))
sys.exit(0 if two["host_tier_mib"] <= float(sys.argv[3]) * one["host_tier_mib"] + two["chunk_mib"] else 1)
PY
}
half "each rank's host tier about half" onefp32 twofp32
# --spec-chunks on 2 sharded GPU ranks: each rank's shards of the last chunks updated before the
# norm, kept or redone alike on both: the exact run's losses (tolerance 0), clipping (the default
# clip here) and not (--clip 100, against its own exact run), the kept steps counted in the log.
run twospec 2 --precision bf16 --batch 2 --spec-chunks 100 || exit 1
run twonc 2 --precision bf16 --batch 2 --clip 100 || exit 1
run twospecnc 2 --precision bf16 --batch 2 --clip 100 --spec-chunks 100 || exit 1
check "2 sharded GPU ranks speculating = the exact run, clipping" twobf16 twospec 0
check "2 sharded GPU ranks speculating = the exact run, not clipping" twonc twospecnc 0
if tail -n 1 "$d/twospecnc.jsonl" | grep -q '"spec_steps":8,"spec_redone":0' &&
  tail -n 1 "$d/twospec.jsonl" | grep -q '"spec_redone":[1-9]'; then
  pass=$((pass + 1)); echo "ok    2 sharded GPU ranks: every unclipped step's speculation stood, clipped ones redone"
else fail=$((fail + 1)); echo "FAIL  spec counts: $(tail -n 1 "$d/twospecnc.jsonl") / $(tail -n 1 "$d/twospec.jsonl")"; fi
# --device-updates on 2 sharded GPU ranks: each rank's GPU updates its shards of host chunks after
# the norm, beside speculation: the exact run's losses (tolerance 0). (8-bit state with device
# updates: test/cuda_train.sh on one GPU, test/test_offload.c on sim.)
run twodu 2 --precision bf16 --batch 2 --device-updates 100 --spec-chunks 2 || exit 1
check "2 sharded GPU ranks with device updates = the exact run" twobf16 twodu 0
if tail -n 1 "$d/twodu.jsonl" | grep -q '"device_updates":[1-9]'; then
  pass=$((pass + 1)); echo "ok    2 sharded GPU ranks: the log says how many chunks the GPU updates"
else fail=$((fail + 1)); echo "FAIL  device updates not in the log: $(tail -n 1 "$d/twodu.jsonl")"; fi
run twoacc 2 --precision bf16 --batch 1 --grad-accum 2 || exit 1
check "2 ranks x 2 micro-batches of 1 = 1 rank x 4, bf16" onebf16 twoacc 2e-2
dv=(--dropout 0.1 --val-data "$data" --val-every 4 --val-batches 2)
run onedrop 1 --precision fp32 --batch 4 "${dv[@]}" || exit 1
run twodrop 2 --precision fp32 --batch 2 "${dv[@]}" || exit 1
check "dropout, 2 ranks = 1 rank, fp32" onedrop twodrop 1e-4
check "validation, 2 ranks = 1 rank, fp32" onedrop twodrop 1e-4 val_loss
rm -rf "$d/ck"
LOUD=1 run save 2 --precision bf16 --batch 2 --save "$d/ck" --save-every 4 --stop-after 4 || exit 1
run resume2 2 --precision bf16 --batch 2 --resume "$d/ck" || exit 1
run resume1 1 --precision bf16 --batch 4 --resume "$d/ck" || exit 1
check "a 2-rank checkpoint resumed by 2 ranks: the straight run" twobf16 resume2 1e-5
check "a 2-rank checkpoint resumed by 1 rank" twobf16 resume1 2e-2
if [ "$gpus" -ge 3 ]; then
  run one6 1 --precision fp32 --batch 6 || exit 1
  run three 3 --precision fp32 --batch 2 || exit 1
  check "3 ranks x 2 = 1 rank x 6, fp32" one6 three 1e-4
fi

# Tensor parallelism (--tp 2, Megatron's split): 2 ranks split every layer's heads and
# feed-forward features, their partial products and input gradients summed by NCCL on the compute
# stream; the same losses as 1 rank, with dropout and validation too; the model they save evaluates
# as 1 rank's, and ferry eval --tp 2 on the GPUs gives the cpu's loss; a tensor-parallel checkpoint resumes on 2 ranks (the straight run) and on 1; with 4
# GPUs a 2 x 2 grid (tensor-parallel pairs, their chunks sharded across the pairs) = 1 rank.
for p in fp32 bf16; do run tp$p 2 --precision $p --batch 4 --tp 2 --save "$d/tp${p}model" || exit 1; done
check "--tp 2 = 1 rank, fp32" onefp32 tpfp32 1e-4
check "--tp 2 = 1 rank, bf16" onebf16 tpbf16 2e-2
# (a tensor-parallel rank also keeps whole what every rank needs: the embeddings, layernorms and
# the row-split layers' biases; 12% of opt-demo, whose learned positions are a large part)
half "each --tp 2 rank's host tier about half" onefp32 tpfp32 0.6
run tpdrop 2 --precision fp32 --batch 4 --tp 2 "${dv[@]}" || exit 1
check "dropout, --tp 2 = 1 rank, fp32" onedrop tpdrop 1e-4
check "validation, --tp 2 = 1 rank, fp32" onedrop tpdrop 1e-4 val_loss
run onesaved 1 --precision fp32 --batch 4 --save "$d/onemodel" || exit 1
ev=(eval --data "$data" --seq "$seq" --batch 4 --batches 2 --device cpu)
if a=$("$ferry" "${ev[@]}" --init "$d/onemodel" 2>&1) && b=$("$ferry" "${ev[@]}" --init "$d/tpfp32model" 2>&1) &&
  python3 -c 'import sys; a, b = (float(x.split()[2]) for x in sys.argv[1:]); sys.exit(abs(a - b) > 1e-4 * a)' "$a" "$b"; then
  pass=$((pass + 1)); echo "ok    the model --tp 2 saves evaluates as 1 rank's ($(echo "$a" | cut -d' ' -f3) and $(echo "$b" | cut -d' ' -f3))"
else
  fail=$((fail + 1)); echo "FAIL  the model --tp 2 saves: $a / $b"
fi
# ferry eval --tp 2 on 2 GPUs, each rank's slices resident and offloaded: the cpu's loss (fp32).
for how in resident --offload; do
  evg=(eval --data "$data" --seq "$seq" --batch 4 --batches 2 --device cuda --precision fp32 --init "$d/onemodel" --tp 2)
  [ "$how" = --offload ] && evg+=(--offload)
  if c=$("${mpi[@]}" -np 2 "$ferry" "${evg[@]}" 2>&1 | grep '^eval loss') &&
    python3 -c 'import sys; a, b = (float(x.split()[2]) for x in sys.argv[1:]); sys.exit(abs(a - b) > 1e-4 * a)' "$a" "$c"; then
    pass=$((pass + 1)); echo "ok    ferry eval --tp 2 on 2 GPUs ($how): the cpu's loss ($(echo "$c" | cut -d' ' -f3))"
  else
    fail=$((fail + 1)); echo "FAIL  ferry eval --tp 2 on 2 GPUs ($how): '$c' against the cpu's '$a'"
  fi
done
rm -rf "$d/cktp"
run tpsave 2 --precision fp32 --batch 4 --tp 2 --save "$d/cktp" --save-every 4 --stop-after 4 || exit 1
run tpres2 2 --precision fp32 --batch 4 --tp 2 --resume "$d/cktp" || exit 1
run tpres1 1 --precision fp32 --batch 4 --resume "$d/cktp" || exit 1
check "a --tp 2 checkpoint resumed by --tp 2: the straight run" tpfp32 tpres2 1e-5
check "a --tp 2 checkpoint resumed by 1 rank" tpfp32 tpres1 1e-4
if [ "$gpus" -ge 4 ]; then
  run grid 4 --precision fp32 --batch 2 --tp 2 || exit 1
  check "a 2 x 2 grid (--tp 2 on 4 ranks) = 1 rank x 4, fp32" onefp32 grid 1e-4
fi
# Replicas (no --offload: each rank holds the whole model on its GPU, and NCCL sums the gradients
# on the compute stream before every rank's identical AdamW): 2 ranks x 2 = 1 (offloaded) rank x 4
# in fp32 and bf16 (the bf16 gradients summed in bf16), with accumulation (their fp32 sum summed);
# a checkpoint of 2 replicas resumes on 2 (the straight run) and on 1 offloaded rank.
for p in fp32 bf16; do RES=1 run rtwo$p 2 --precision $p --batch 2 || exit 1; done
check "2 replicas x 2 = 1 rank x 4, fp32" onefp32 rtwofp32 1e-4
check "2 replicas x 2 = 1 rank x 4, bf16" onebf16 rtwobf16 2e-2
RES=1 run rtwoacc 2 --precision bf16 --batch 1 --grad-accum 2 || exit 1
check "2 replicas x 2 micro-batches of 1 = 1 rank x 4, bf16" onebf16 rtwoacc 2e-2
rm -rf "$d/rck"
RES=1 run rsave 2 --precision bf16 --batch 2 --save "$d/rck" --save-every 4 --stop-after 4 || exit 1
RES=1 run rres2 2 --precision bf16 --batch 2 --resume "$d/rck" || exit 1
run rres1 1 --precision bf16 --batch 4 --resume "$d/rck" || exit 1
check "a checkpoint of 2 replicas resumed by 2: the straight run" rtwobf16 rres2 1e-5
check "a checkpoint of 2 replicas resumed by 1 offloaded rank" rtwobf16 rres1 2e-2
# Pipeline stages (--pp 2: each stage's layers on its GPU, the activations and their gradients
# sent GPU to GPU by NCCL send/recv, grouped where both directions go at once): 4 micro-batches of
# 1 on the 1F1B schedule, resident, = 1 resident rank running the same micro-batches in fp32 (the
# same sums in the same order: within 1e-5), and offloaded (--offload: each stage's chunks through
# its GPU's cache) = 1 rank x 4 in bf16; the stages' checkpoint of step 2 resumes on 1 rank (the
# straight run's losses); with 4 GPUs, 2 pipelines of 2 stages. (Each stops after 4 of the 8 steps.)
pv=(--val-data "$data" --val-every 2 --val-batches 2)  # (validation: each batch's forward through the stages)
RES=1 run pone 1 --precision fp32 --batch 1 --grad-accum 4 --stop-after 4 "${pv[@]}" || exit 1
rm -rf "$d/ppck"
RES=1 run ppfp32 2 --precision fp32 --batch 1 --grad-accum 4 --stop-after 4 --pp 2 --save "$d/ppck" --save-every 2 \
  "${pv[@]}" || exit 1
check "--pp 2 on 2 GPUs = 1 rank, fp32" pone ppfp32 1e-5
check "validation through --pp 2 on 2 GPUs = 1 rank, fp32" pone ppfp32 1e-6 val_loss
run ppoff 2 --precision bf16 --batch 1 --grad-accum 4 --stop-after 4 --pp 2 || exit 1
check "--pp 2 --offload on 2 GPUs = 1 rank x 4, bf16" onebf16 ppoff 2e-2
run ppspec 2 --precision bf16 --batch 1 --grad-accum 4 --stop-after 4 --pp 2 --spec-chunks 100 || exit 1
check "--pp 2 --offload --spec-chunks on 2 GPUs = the same stages without speculation" ppoff ppspec 0
run ppdu 2 --precision bf16 --batch 1 --grad-accum 4 --stop-after 4 --pp 2 --device-updates 100 || exit 1
check "--pp 2 --offload --device-updates on 2 GPUs = the same stages updated on the host" ppoff ppdu 0
RES=1 run ppres1 1 --precision fp32 --batch 1 --grad-accum 4 --stop-after 2 --resume "$d/ppck/step-00000002" || exit 1
check "a --pp 2 checkpoint on GPUs resumed by 1 rank" ppfp32 ppres1 1e-5
# Offloaded stages keep what one offloaded rank keeps: 8-bit AdamW state (fp32 compute, the same
# sums: every printed digit), and with --optimizer-lag 1 (bf16, one micro-batch a step: each update
# a step late, the gradients home over the 16-bit copy) 8-bit state too, validating each time; the
# lagged run within 2e-4 of 1 rank's (the tied embedding's two bf16 parts summed with one rounding
# more than 1 rank's; no lag would be 3e-2 off by step 2).
for how in "q8:--precision fp32 --grad-accum 4 --optimizer-state 8bit" \
  "lag:--precision bf16 --grad-accum 1 --optimizer-lag 1 --optimizer-state 8bit"; do
  run "pxone${how%%:*}" 1 --batch 1 --stop-after 4 ${how#*:} "${pv[@]}" || exit 1
  run "pxpp${how%%:*}" 2 --batch 1 --stop-after 4 ${how#*:} "${pv[@]}" --pp 2 || exit 1
done
check "--pp 2 --offload with 8-bit AdamW state on 2 GPUs = 1 rank, fp32" pxoneq8 pxppq8 1e-6
check "validation through --pp 2 --offload on 2 GPUs = 1 rank, fp32" pxoneq8 pxppq8 1e-6 val_loss
check "--pp 2 --offload with --optimizer-lag 1 and 8-bit state on 2 GPUs = 1 rank, bf16" pxonelag pxpplag 2e-4
check "validation through lagged --pp 2 --offload on 2 GPUs = 1 rank, bf16" pxonelag pxpplag 2e-4 val_loss
# ferry eval --pp 2 on 2 GPUs (offloaded in fp32, resident in bf16, whose stages keep the 16-bit
# weights alone): 1 GPU's loss, every digit.
for how in "fp32:--offload --device-mem $mem" "bf16:"; do
  evp=(eval --data "$data" --seq "$seq" --batch 2 --batches 3 --device cuda --init "$d/onemodel" --precision ${how%%:*}
    ${how#*:})
  what="${how%%:*} ${how#*:}" && [ -n "${how#*:}" ] || what="${how%%:*} resident"
  if e1=$("$ferry" "${evp[@]}" 2>&1 | grep '^eval loss') && e2=$("${mpi[@]}" -np 2 "$ferry" "${evp[@]}" --pp 2 2>&1 |
    grep '^eval loss') && [ -n "$e1" ] && [ "$e1" = "$e2" ]; then
    pass=$((pass + 1)); echo "ok    ferry eval --pp 2 on 2 GPUs ($what): 1 GPU's loss ($(echo "$e1" | cut -d' ' -f3))"
  else
    fail=$((fail + 1)); echo "FAIL  ferry eval --pp 2 on 2 GPUs ($what): '${e2:-}' against 1 GPU's '${e1:-}'"
  fi
done
if [ "$gpus" -ge 4 ]; then  # two pipelines, their stages' gradients summed by NCCL across them
  RES=1 run dppp 4 --precision fp32 --batch 1 --grad-accum 2 --pp 2 --stop-after 4 || exit 1
  check "dp 2 x pp 2 on 4 GPUs = 1 rank x 4, fp32" onefp32 dppp 1e-4
  # pp 2 x tp 2: a tensor-parallel pair in each stage (its sums by NCCL on the kernels' stream),
  # each tp rank sending to the next stage's same tp rank (on the messages' stream): resident,
  # = 1 rank on the same micro-batches in fp32, its checkpoint of step 1 resumed on 1 rank, and
  # offloaded (each rank's slices of its stage's chunks through its GPU's cache), = 1 rank too.
  # (2 steps each: the emulator's 4 ranks are slow.)
  rm -rf "$d/pptpck"
  RES=1 run pptp 4 --precision fp32 --batch 1 --grad-accum 4 --stop-after 2 --pp 2 --tp 2 --save "$d/pptpck" \
    --save-every 1 || exit 1
  check "pp 2 x tp 2 on 4 GPUs = 1 rank, fp32" pone pptp 1e-4
  RES=1 run pptpres1 1 --precision fp32 --batch 1 --grad-accum 4 --stop-after 1 --resume "$d/pptpck/step-00000001" \
    || exit 1
  check "a pp 2 x tp 2 checkpoint on GPUs resumed by 1 rank" pptp pptpres1 1e-4
  run pptpoff 4 --precision fp32 --batch 1 --grad-accum 4 --stop-after 2 --pp 2 --tp 2 || exit 1
  check "pp 2 x tp 2 --offload on 4 GPUs = 1 rank, fp32" pone pptpoff 1e-4
fi
# With 8 GPUs the whole grid, dp 2 x pp 2 x tp 2, offloaded (each tp rank's slices of its stage's
# chunks sharded over the 2 pipelines). (./test.sh emulates 4 GPUs; with FY_EMU_GPUS=8 and --gpus 8
# it took 5 s.)
if [ "$gpus" -ge 8 ]; then
  run grid8 8 --precision fp32 --batch 1 --grad-accum 2 --pp 2 --tp 2 --stop-after 2 || exit 1
  check "dp 2 x pp 2 x tp 2 --offload on 8 GPUs = 1 rank x 4, fp32" onefp32 grid8 1e-4
fi
# A mixture of experts through 2 stages (opt-moe-tiny's widths over 4 layers, each a mixture of 8
# experts, top 1, untied; 4 micro-batches of 8 random tokens a step): resident, and offloaded with
# 2 cache blocks (each stage loads only the experts its micro-batches routed to, a micro-batch's
# backward those of its own forward), fp32, = 1 resident rank: losses and aux_losses within 1e-5.
mkdir -p "$d/moe/cfg" "$d/moe/data"
python3 - "$d/moe" <<'PY' || exit 2
import json, random, struct, sys
json.dump({"model_type": "opt", "vocab_size": 97, "hidden_size": 32, "word_embed_proj_dim": 32, "ffn_dim": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 64,
           "do_layer_norm_before": True, "activation_function": "relu", "pad_token_id": 1, "dropout": 0.0,
           "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 1,
           "moe_layer_frequency": 1, "router_aux_loss_coef": 0.01}, open(sys.argv[1] + "/cfg/config.json", "w"))
rnd = random.Random(5)
toks = [rnd.randrange(3, 97) for _ in range(4000)]
open(sys.argv[1] + "/data/shard_000.bin", "wb").write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)) +
                                                      struct.pack("<%dH" % len(toks), *toks))
PY
kept=("${common[@]}")
common=(train --model "$d/moe/cfg" --data "$d/moe/data" --steps 2 --seq 8 --batch 1 --grad-accum 4 --seed 1 --lr 1e-3
  --warmup 0 --no-shuffle --device cuda --precision fp32 --quiet)
run moe1 1 || exit 1
run moepp 2 --pp 2 || exit 1
run moeppoff 2 --pp 2 --offload --blocks 2 || exit 1
for r in moepp moeppoff; do
  check "a mixture through --pp 2 ($r) = 1 rank: losses" moe1 $r 1e-5
  check "a mixture through --pp 2 ($r) = 1 rank: aux_losses" moe1 $r 1e-5 aux_loss
done
common=("${kept[@]}")
# ferry plan for 2 GPUs with room for the whole model on each and too little host memory to
# offload it plans replicas (resident, pattern replicate), and mpirun -np 2 ferry train --plan
# trains them as the replicas above.
FERRY_PROBE="$d/probe.json" "$ferry" plan --device cuda --gpus 2 --device-mem 2GiB --host-mem 64KiB --model "$model" \
  --batch 4 --seq "$seq" --out "$d/rplan.json" >"$d/rplan_plan.out" 2>&1 || { cat "$d/rplan_plan.out"; exit 1; }
if grep -q '"resident":true' "$d/rplan.json" && grep -q '"dp":2' "$d/rplan.json" &&
  grep -q '"pattern":"replicate"' "$d/rplan.json"; then
  RES=1 run rplan 2 --precision bf16 --plan "$d/rplan.json" || exit 1
  check "a resident plan for 2 GPUs (replicas) = 1 rank x 4, bf16" onebf16 rplan 2e-2
else
  fail=$((fail + 1))
  cat "$d/rplan_plan.out"
  echo "FAIL  the plan for 2 GPUs with room for the whole model is not 2 resident replicas"
fi
# Plans of other layouts that ferry train runs on GPUs, written by ferry plan with an axis fixed and
# run from their file under mpirun (4 of the 8 steps each): two resident stages (--pp 2) and two
# resident tensor-parallel slices (--tp 2, dp 1) = 1 rank in fp32; two offloaded stages (--pp 2
# --offload, each its own chunks through its GPU's cache) = 1 rank in bf16; the stages' first
# peaking where their plan says.
for lay in "pp 2 fp32 onefp32 1e-4" "tp 2 fp32 onefp32 1e-4" "pp 2 bf16 onebf16 2e-2 --offload"; do
  set -- $lay
  ax=$1 n=$2 p=$3 ref=$4 tol=$5 off=${6:-}
  name="plan$ax$p${off:+off}"
  lim=(--device-mem 2GiB --host-mem 64KiB)
  [ -n "$off" ] && lim=(--device-mem "$mem" --host-mem 1GiB)
  FERRY_PROBE="$d/probe.json" "$ferry" plan --device cuda --gpus 2 --"$ax" "$n" $off "${lim[@]}" --precision "$p" \
    --model "$model" --batch 4 --seq "$seq" --out "$d/$name.json" >"$d/${name}_plan.out" 2>&1 || { cat "$d/${name}_plan.out"; exit 1; }
  if grep -q "\"$ax\":$n" "$d/$name.json" && grep -q "\"resident\":$([ -n "$off" ] && echo false || echo true)" "$d/$name.json"; then
    if [ -n "$off" ]; then
      run "$name" 2 --plan "$d/$name.json" --stop-after 4 || exit 1
    else
      RES=1 run "$name" 2 --plan "$d/$name.json" --stop-after 4 || exit 1
    fi
    check "a plan of $ax $n${off:+ $off} for 2 GPUs, $p = 1 rank x 4" "$ref" "$name" "$tol"
    # (a pipeline's stage 0, rank 0, peaks where the plan says, to the log's 100 bytes)
    if [ "$ax" = pp ]; then
      if python3 - "$d/$name.json" "$d/$name.jsonl" <<'PY'; then pass=$((pass + 1)); echo "ok    its stage 0's device peak as planned"; else fail=$((fail + 1)); echo "FAIL  $name: stage 0's device peak"; fi
import json, sys
said = json.load(open(sys.argv[1]))["predicted"]["stage_peak_bytes"][0]
got = max(json.loads(l)["device_peak_mib"] for l in open(sys.argv[2]) if l.startswith("{")) * 2 ** 20
print("      stage 0: planned %.0f bytes, ran %.0f" % (said, got))
sys.exit(0 if abs(got - said) <= 100 else 1)
PY
    fi
  else
    fail=$((fail + 1))
    cat "$d/${name}_plan.out"
    echo "FAIL  ferry plan --gpus 2 --$ax $n${off:+ $off} on cuda is not that layout"
  fi
done

# Without --offload, --tp keeps each rank's slices on its GPU with their gradients and AdamW state
# (updated there; the cache is not used): = 1 rank in fp32, and a checkpoint of it resumes on
# 1 rank. A grid (2 data-parallel x 2 tensor-parallel GPUs) without --offload is refused, saying
# how to run it.
LOUD=1 RES=1 run tpres 2 --precision fp32 --batch 4 --tp 2 || exit 1
check "--tp 2 without --offload (slices on the GPUs) = 1 rank, fp32" onefp32 tpres 1e-4
line="$(grep -a -m1 -E 'for [0-9]+ chunks.*on the device' "$d/tpres.out")"
if [[ "$line" =~ for\ ([0-9]+)\ chunks.*\ ([0-9]+)\ on\ the\ device ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ]; then
  pass=$((pass + 1)); echo "ok    --tp 2 without --offload keeps all ${BASH_REMATCH[1]} chunks of a rank on its GPU"
else
  fail=$((fail + 1)); echo "FAIL  --tp 2 without --offload: not every chunk on the GPU: $line"
fi
rm -rf "$d/tpresck"
RES=1 run tpressave 2 --precision fp32 --batch 4 --tp 2 --save "$d/tpresck" --save-every 4 --stop-after 4 || exit 1
RES=1 run tpres1 1 --precision fp32 --batch 4 --resume "$d/tpresck" || exit 1
check "a checkpoint of --tp 2 without --offload resumed by 1 rank" tpres tpres1 1e-4
if [ "$gpus" -ge 4 ]; then
  timeout 120 "${mpi[@]}" -np 4 "$ferry" train --model "$model" --seq "$seq" --data "$data" --device cuda --steps 1 \
    --tp 2 >"$d/gridresident.out" 2>&1
  code=$?
  if [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && grep -q "add --offload" "$d/gridresident.out"; then
    pass=$((pass + 1)); echo "ok    a 2 x 2 grid without --offload is refused: $(grep -m1 -o -- '--tp 2 on 4.*' "$d/gridresident.out" | cut -c1-80)"
  else
    fail=$((fail + 1)); echo "FAIL  a 2 x 2 grid without --offload: exit $code"; tail -5 "$d/gridresident.out"
  fi
fi

# Expert parallelism (--ep, runtime/ep_cuda.h) on opt-moe-tiny (4 experts a mixture layer), resident:
# each rank holds its experts alone, a mixture's rows go to their experts' GPUs and back by grouped
# NCCL send/recv (the counts first, by a host all-to-all). ep 2 = 1 rank accumulating the same 2
# micro-batches without clipping: the same losses and, on the emulator (deterministic kernels), the
# same saved weights byte for byte. Experts that get no token (every token routed to rank 0's two
# experts; with --recompute, whose forwards move the rows again): with 4 GPUs 2 groups of ep 2
# (each expert's gradient summed over its 2 replicas) within 1e-5 of 1 rank accumulating 4, with 2
# ep 2 = 1 rank accumulating 2. A resident plan with ep 2 trains as --ep 2; --ep 2 --offload (the
# experts' chunks sharded with the dense ones) gives 1 rank's weights too.
python3 - "$d/moe.bin" <<'PY' || exit 2
import random, struct, sys
random.seed(5)
t = [(i * 7 + random.randrange(3)) % 97 for i in range(20000)]  # (below opt-moe-tiny's vocabulary)
open(sys.argv[1], "wb").write(struct.pack("<256i", 20240520, 1, len(t), *([0] * 253)) + struct.pack("<%dH" % len(t), *t))
PY
# same_weights A B WHAT: on the emulator (deterministic kernels) runs A and B saved the same
# weights byte for byte.
same_weights() {
  [ -n "${FY_EMU_GPUS:-}" ] || return 0
  if cmp -s "$d/$1/model.safetensors" "$d/$2/model.safetensors"; then
    pass=$((pass + 1)); echo "ok    $3"
  else
    fail=$((fail + 1)); echo "FAIL  $3: the saved weights differ"
  fi
}
dense=("${common[@]}")
common=(train --model opt-moe-tiny --data "$d/moe.bin" --seq 32 --batch 2 --steps 3 --seed 1 --lr 1e-3 --warmup 0
  --no-shuffle --device cuda --precision fp32 --clip 0 --quiet)
rm -rf "$d/moeone" "$d/moeep2" "$d/moestarve"
run moeone 1 --grad-accum 2 --save "$d/moeone" || exit 1
LOUD=1 run moeep2 2 --ep 2 --save "$d/moeep2" || exit 1
check "--ep 2 on 2 GPUs = 1 rank accumulating 2, fp32" moeone moeep2 1e-6
same_weights moeone moeep2 "--ep 2 on 2 emulated GPUs saves 1 rank's weights byte for byte"
# (layers 1 and 3 are the mixtures: their final_layer_norm makes every token's input the bias,
# and a gate that prefers experts 0 and 1 for it)
python3 - "$d/moeep2" "$d/moestarve" <<'PY' || exit 2
import json, os, struct, sys
raw = open(os.path.join(sys.argv[1], "model.safetensors"), "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr, data = json.loads(raw[8:8 + n]), bytearray(raw[8 + n:])
def put(name, values):
    a, b = hdr[name]["data_offsets"]
    assert (b - a) // 4 == len(values), name
    data[a:b] = struct.pack("<%df" % len(values), *values)
for l in (1, 3):
    pre = "model.decoder.layers.%d." % l
    C = hdr[pre + "final_layer_norm.weight"]["shape"][0]
    put(pre + "final_layer_norm.weight", [0.0] * C)
    put(pre + "final_layer_norm.bias", [1.0] * C)
    put(pre + "block_sparse_moe.gate.weight", [w / C for w in (3, 2, -3, -3) for _ in range(C)])
os.makedirs(sys.argv[2])
open(os.path.join(sys.argv[2], "model.safetensors"), "wb").write(raw[:8 + n] + bytes(data))
open(os.path.join(sys.argv[2], "config.json"), "w").write(open(os.path.join(sys.argv[1], "config.json")).read())
PY
if [ "$gpus" -ge 4 ]; then
  run moestarve1 1 --batch 1 --grad-accum 4 --steps 2 --init "$d/moestarve" || exit 1
  run moestarve 4 --batch 1 --steps 2 --ep 2 --init "$d/moestarve" --recompute || exit 1
  check "starved experts, 2 groups of ep 2 on 4 GPUs (--recompute) = 1 rank accumulating 4, fp32" moestarve1 moestarve 1e-5
else
  run moestarve1 1 --grad-accum 2 --steps 2 --init "$d/moestarve" || exit 1
  run moestarve 2 --ep 2 --steps 2 --init "$d/moestarve" --recompute || exit 1
  check "starved experts, --ep 2 on 2 GPUs (--recompute) = 1 rank accumulating 2, fp32" moestarve1 moestarve 1e-6
fi
# A resident plan for 2 GPUs with "ep": 2 (ferry plan's, its precision fp32) trains as --ep 2 does,
# each rank holding its experts alone (the same model state).
FERRY_PROBE="$d/probe.json" "$ferry" plan --device cuda --gpus 2 --device-mem 2GiB --host-mem 64KiB --model opt-moe-tiny \
  --batch 4 --seq 32 --out "$d/moeplan.json" >"$d/moeplan_plan.out" 2>&1 || { cat "$d/moeplan_plan.out"; exit 1; }
if python3 - "$d/moeplan.json" <<'PY'; then
import json, sys
p = json.load(open(sys.argv[1]))
assert p["resident"] and p["dp"] == 2, "not 2 resident replicas: %s" % p
p.update(ep=2, precision="fp32", micro_batch=2, grad_accum=1)
json.dump(p, open(sys.argv[1], "w"))
PY
  LOUD=1 run moeplan 2 --plan "$d/moeplan.json" || exit 1
  check "a resident plan with ep 2 on 2 GPUs = --ep 2" moeep2 moeplan 1e-6
  a="$(grep -m1 'model state' "$d/moeep2.out")" b="$(grep -m1 'model state' "$d/moeplan.out")"
else
  a="" b="the plan for 2 GPUs of opt-moe-tiny"
fi
if [ -n "$a" ] && [ "$a" = "$b" ]; then
  pass=$((pass + 1)); echo "ok    the plan's ranks hold their experts alone as --ep 2's (${a#*ferry: })"
else
  fail=$((fail + 1)); echo "FAIL  the plan with ep 2: '$b' against --ep 2's '$a'"
fi
# Offloaded (--offload: every chunk sharded across the ranks, as on sim): each rank's graph keeps
# every expert, computes its own and writes zeros for the others' gradients, which the chunks'
# reduce-scatter adds: 1 rank's losses, and on the emulator its weights byte for byte.
rm -rf "$d/moeoff"
run moeoff 2 --ep 2 --offload --save "$d/moeoff" || exit 1
check "--ep 2 --offload on 2 GPUs = 1 rank accumulating 2, fp32" moeone moeoff 1e-6
same_weights moeone moeoff "--ep 2 --offload on 2 emulated GPUs saves 1 rank's weights byte for byte"
# In bf16 (the GPU's default): each source's block of an expert's gradient rounded to bf16 as its
# own backward rounds it, the blocks and the dense gradients summed in fp32 (runtime/ep_cuda.c,
# fy_ep_all_reduce_grads), as 1 rank adds its micro-batches' rounded gradients: the same losses and,
# on the emulator, the same saved weights byte for byte (2 replicas summing in bf16: step 3 1e-4 off).
rm -rf "$d/moeonebf16" "$d/moeep2bf16"
run moeonebf16 1 --grad-accum 2 --precision bf16 --save "$d/moeonebf16" || exit 1
run moeep2bf16 2 --ep 2 --precision bf16 --save "$d/moeep2bf16" || exit 1
check "--ep 2 on 2 GPUs = 1 rank accumulating 2, bf16" moeonebf16 moeep2bf16 1e-6
same_weights moeonebf16 moeep2bf16 "--ep 2 in bf16 on 2 emulated GPUs saves 1 rank's weights byte for byte"
# Tensor parallelism on the mixture (--tp 2): each rank holds half of every expert's fc1 rows and
# fc2 columns, the router and fc2's bias whole; the CUDA kernels sum the output, the routing
# weights' gradients and the input gradient's part over the pair by NCCL on their stream. Resident
# (the slices on the GPUs), and offloaded as ferry plan --offload lays out 2 GPUs for it (one
# tensor-parallel group, tp 2 dp 1; its plan in fp32 on the micro-batches above): each = 1 rank,
# loss and aux_loss within 1e-5 (each sum in two halves; the emulator gives the printed digits).
run moetp 2 --tp 2 --grad-accum 2 || exit 1
check "--tp 2 on a mixture, resident on 2 GPUs = 1 rank, fp32" moeone moetp 1e-5
check "--tp 2 on a mixture, resident on 2 GPUs = 1 rank, fp32: aux_losses" moeone moetp 1e-5 aux_loss
FERRY_PROBE="$d/probe.json" "$ferry" plan --device cuda --gpus 2 --offload --device-mem 2GiB --host-mem 1GiB \
  --model opt-moe-tiny --batch 4 --seq 32 --out "$d/moetpplan.json" >"$d/moetpplan_plan.out" 2>&1 ||
  { cat "$d/moetpplan_plan.out"; exit 1; }
python3 - "$d/moetpplan.json" <<'PY' || exit 1
import json, sys
p = json.load(open(sys.argv[1]))
assert p["tp"] == 2 and p["dp"] == 1 and not p["resident"], "not one offloaded tp 2 group: %s" % p
p.update(precision="fp32", micro_batch=2, grad_accum=2)
json.dump(p, open(sys.argv[1], "w"))
PY
run moetpoff 2 --plan "$d/moetpplan.json" || exit 1
check "--tp 2 --offload on a mixture (ferry plan's for 2 GPUs) = 1 rank, fp32" moeone moetpoff 1e-5
check "--tp 2 --offload on a mixture (ferry plan's for 2 GPUs) = 1 rank, fp32: aux_losses" moeone moetpoff 1e-5 aux_loss
common=("${dense[@]}")

# The emulator's NCCL only (FY_EMU_NCCL_FAIL, test/cudaemu/emu_nccl.cc): every rank's last
# reduce-scatter of step 1 (one per chunk) fails as a lost peer makes NCCL's fail. The stream goes
# on once the communicator is aborted; the step must fail instead of updating from gradients that
# were never summed, and no model may be saved from it.
if [ -n "${FY_EMU_GPUS:-}" ]; then
  chunks=$(sed -n 's/.* for \([0-9]*\) chunks.*/\1/p' "$d/save.out" | head -1)
  rm -rf "$d/lost"
  FY_EMU_NCCL_FAIL="ncclReduceScatter:${chunks:-0}" timeout 120 "${mpi[@]}" -x FY_EMU_NCCL_FAIL -np 2 "$ferry" "${common[@]}" \
    --precision fp32 --batch 2 --steps 1 --save "$d/lost" >"$d/lost.out" 2>&1
  code=$?
  if [ -n "$chunks" ] && [ "$code" -ne 0 ] && grep -q "ncclReduceScatter failed" "$d/lost.out" &&
    [ ! -e "$d/lost/model.safetensors" ]; then
    pass=$((pass + 1)); echo "ok    a reduce-scatter lost at the end of a step fails the step (exit $code), nothing saved"
  else
    fail=$((fail + 1)); echo "FAIL  a reduce-scatter lost at the end of a step (chunks ${chunks:-?}): exit $code"
    ls "$d/lost" 2>/dev/null; tail -20 "$d/lost.out"
  fi
  # The same for a tensor-parallel sum in the forward (the third all-reduce: step 1's second
  # layer's out_proj) and for the replicas' gradient sum (resident, the first all-reduce).
  for lost in "tp ncclAllReduce:3 --offload --device-mem $mem --tp 2" "replicas ncclAllReduce:1"; do
    set -- $lost
    what=$1 inject=$2
    shift 2
    rm -rf "$d/lost$what"
    FY_EMU_NCCL_FAIL="$inject" timeout 120 "${mpi[@]}" -x FY_EMU_NCCL_FAIL -np 2 "$ferry" train --model "$model" \
      --seq "$seq" --data "$data" --device cuda "$@" --precision fp32 --batch 2 --steps 1 --quiet --save "$d/lost$what" \
      >"$d/lost$what.out" 2>&1
    code=$?
    if [ "$code" -ne 0 ] && grep -q "ncclAllReduce failed" "$d/lost$what.out" && [ ! -e "$d/lost$what/model.safetensors" ]; then
      pass=$((pass + 1)); echo "ok    a lost all-reduce ($what) fails the step (exit $code), nothing saved"
    else
      fail=$((fail + 1)); echo "FAIL  a lost all-reduce ($what): exit $code"; ls "$d/lost$what" 2>/dev/null; tail -20 "$d/lost$what.out"
    fi
  done
fi

# Two ranks on one GPU (CUDA_VISIBLE_DEVICES=0 for both): NCCL refuses them, and ferry says so
# instead of hanging.
CUDA_VISIBLE_DEVICES=0 timeout 120 "${mpi[@]}" -x CUDA_VISIBLE_DEVICES -np 2 "$ferry" "${common[@]}" --precision fp32 \
  --batch 2 --steps 1 >"$d/samegpu.out" 2>&1
code=$?
if [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && grep -q "ncclCommInitRank failed" "$d/samegpu.out"; then
  pass=$((pass + 1)); echo "ok    2 ranks on one GPU are refused: $(grep -m1 -o 'ncclCommInitRank failed.*' "$d/samegpu.out")"
else
  fail=$((fail + 1)); echo "FAIL  2 ranks on one GPU: exit $code"; tail -20 "$d/samegpu.out"
fi

# A rank killed mid-run: the survivor's collective times out (or mpirun ends the job) within
# --comm-timeout plus 10 s.
rm -f "$d/kill.jsonl"
timeout 300 "${mpi[@]}" -np 2 "$ferry" "${common[@]}" --precision fp32 --batch 2 --steps 100000 --comm-timeout 5 \
  --log "$d/kill.jsonl" >"$d/kill.out" 2>&1 &
job=$!
for _ in $(seq 1 120); do [ -s "$d/kill.jsonl" ] && break; sleep 0.5; done  # training has started
victim=$(pgrep -f -- "^$ferry train .*--log $d/kill.jsonl" | tail -1)
start=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
wait "$job"; code=$?
elapsed=$(($(date +%s) - start))
if [ -n "$victim" ] && [ "$code" -ne 0 ] && [ "$elapsed" -le 15 ]; then
  pass=$((pass + 1)); echo "ok    a killed rank ends the job (exit $code after ${elapsed} s)"
else
  fail=$((fail + 1)); echo "FAIL  a killed rank (${victim:-no rank found}): exit $code after ${elapsed} s"; tail -20 "$d/kill.out"
fi

echo "cuda_ranks: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
