#!/usr/bin/env bash
# Several ranks under mpirun (runtime/comm.h; replicated parameters on cpu, sharded chunks on sim):
# 2 ranks with --batch 2 follow 1 rank with --batch 4 (losses and weights within 1e-5; 16-bit
# sharded ranks: bit for bit the replicated 16-bit ranks; bf16 and 8-bit AdamW state: replicated and
# sharded ranks bit for bit 1 rank with 2 micro-batches, and their checkpoints resume across
# layouts exactly), rank 0
# alone speaks and writes, a rank killed mid-run ends the job (non-zero, within the timeout
# plus 10 s) instead of hanging it, and a signal to one rank stops them all with a checkpoint.
# usage: test/test_ranks.sh path/to/ferry            (exit 77 = skipped: no mpirun)
set -u
ferry="$1"
command -v mpirun >/dev/null 2>&1 || { echo "skipped: mpirun is not installed"; exit 77; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Open MPI leaves allocations behind in components it has unloaded (no names to suppress): under
# AddressSanitizer the MPI runs skip the leak check, the single-rank ones keep it.
mpi=(env ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0" mpirun --allow-run-as-root --oversubscribe -x ASAN_OPTIONS)
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok    $1"; }
bad() { fail=$((fail + 1)); echo "FAIL  $1"; }

python3 - "$tmp/data.bin" <<'PY'
import random, struct, sys
random.seed(3)
n = 40000
t = [(i * 7 + random.randrange(3)) % 97 for i in range(n)]
open(sys.argv[1], "wb").write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)) + struct.pack("<%dH" % n, *t))
PY
# compare REF RUN TOL [WTOL]: the losses of RUN.json (the last steps of REF.json's) within TOL
# relative, the saved weights RUN/ against REF/ within WTOL (default TOL) normalised error.
compare() {
  python3 - "$tmp" "$1" "$2" "$3" "${4:-$3}" <<'PY'
import json, struct, sys
d, a, b, tol, wtol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
la = {r["step"]: r["loss"] for r in map(json.loads, open("%s/%s.json" % (d, a)))}
lb = {r["step"]: r["loss"] for r in map(json.loads, open("%s/%s.json" % (d, b)))}
assert sorted(lb) == sorted(la)[-len(lb):] and lb, (sorted(la), sorted(lb))
for s in lb:
    assert abs(la[s] - lb[s]) <= tol * abs(la[s]), (s, la[s], lb[s])
def tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    return {k: struct.unpack("<%df" % ((v["data_offsets"][1] - v["data_offsets"][0]) // 4),
                             raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in hdr.items() if k != "__metadata__"}
x, y = tensors("%s/%s/model.safetensors" % (d, a)), tensors("%s/%s/model.safetensors" % (d, b))
assert x.keys() == y.keys()
num = sum((p - q) ** 2 for k in x for p, q in zip(x[k], y[k]))
den = sum(p * p for k in x for p in x[k])
assert (num / den) ** 0.5 <= wtol, (num / den) ** 0.5
print("  %s vs %s: %d losses within %g, weights within %.2g" % (a, b, len(lb), tol, (num / den) ** 0.5))
PY
}
common=(--model opt-tiny --data "$tmp/data.bin" --seq 32 --steps 12 --threads 1 --quiet)
"$ferry" train "${common[@]}" --batch 4 --log "$tmp/one.json" --save "$tmp/one" || bad "one rank trains"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --log "$tmp/two.json" --save "$tmp/two" >"$tmp/two.out" 2>&1 \
  || { bad "two ranks train"; cat "$tmp/two.out"; }
if compare one two 1e-5; then ok "2 ranks follow 1 rank with the same global batch"; else bad "2 ranks differ from 1 rank"; fi
[ "$(grep -c 'rank 1' "$tmp/two.out")" -eq 0 ] && ok "only rank 0 prints" || bad "rank 1 printed"

# A run saved by 2 ranks resumes as 1 rank (checkpoints are per parameter, data positions count
# sequences of the whole stream): 6 steps on 2 ranks, then 6 more on 1, against 12 straight.
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --save "$tmp/ck2" --save-every 100 --stop-after 6 \
  >/dev/null 2>&1 || bad "2 ranks checkpoint"
"$ferry" train "${common[@]}" --batch 4 --resume "$tmp/ck2" --log "$tmp/resumed.json" --save "$tmp/resumed" \
  || bad "1 rank resumes the 2-rank checkpoint"
# The 2-rank steps sum each gradient in two halves: ~1e-6 apart from one rank after these steps
# (9.7e-7 in the release build, 1.1e-6 with the sanitizer build's arithmetic).
if compare one resumed 1e-6 2e-6; then ok "2 ranks checkpoint, 1 rank resumes: losses within 1e-6, weights within 2e-6 of the straight run"; else bad "2-to-1 resume differs"; fi

# Chunk sharding (the zero pattern, --device sim): every rank keeps 1/2 of each chunk (weights,
# gradients, m, v), gathers the rest into the device cache and reduce-scatters the gradients. With
# 4 cache blocks the chunks are evicted and loaded (gathered) again within every pass.
sim=(--device sim --blocks 4 --prefetch 2)
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --log "$tmp/zero.json" --save "$tmp/zero"   || bad "2 sharded ranks train"
compare one zero 1e-5 && ok "2 ranks with sharded chunks in the host tier follow 1 rank" || bad "sharded ranks differ from 1 rank"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --device-chunks 1000 --log "$tmp/zerodev.json"   --save "$tmp/zerodev" || bad "2 sharded ranks with shards on the device train"
compare one zerodev 1e-5 && ok "2 ranks with sharded chunks on the device (no offload) follow 1 rank"   || bad "sharded ranks on the device differ from 1 rank"
mkdir -p "$tmp/disk"
"$ferry" train "${common[@]}" --batch 4 --grad-accum 2 --log "$tmp/accum.json" --save "$tmp/accum" || bad "1 rank accumulates"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --grad-accum 2 --disk-dir "$tmp/disk" --disk-chunks 4   --log "$tmp/zeroacc.json" --save "$tmp/zeroacc" || bad "2 sharded ranks with accumulation and a disk tier train"
compare accum zeroacc 1e-5 && ok "2 sharded ranks with 2 micro-batches and 4 chunks' shards on disk follow 1 rank"   || bad "sharded ranks with accumulation and disk differ"
# Each rank's model state is half the single rank's, on the tiers' own counters (within 10% plus
# one chunk): the host tier's in-use bytes and its peak (no rank ever holds the whole model's
# weights: each initialises its shards alone), and the device memory the state took.
"$ferry" train "${common[@]}" "${sim[@]}" --batch 4 --steps 2 --log "$tmp/mem1.json" || bad "1 rank on sim"
"$ferry" train "${common[@]}" "${sim[@]}" --batch 4 --steps 2 --device-chunks 1000 --log "$tmp/memd1.json" || bad "1 rank, state on the device"
if python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
last = lambda f: [json.loads(l) for l in open(d + "/" + f)][-1]
for one, two, key in (("mem1.json", "zero.json", "host_tier_mib"), ("mem1.json", "zero.json", "host_peak_mib"),
                      ("memd1.json", "zerodev.json", "device_state_mib")):
    a, b = last(one), last(two)
    want = a[key] / 2
    assert abs(b[key] - want) <= 0.1 * want + b["chunk_mib"], (key, a[key], b[key], b["chunk_mib"])
    print("  %s: 1 rank %.4f MiB, each of 2 ranks %.4f MiB (chunks of %.4f MiB)" % (key, a[key], b[key], b["chunk_mib"]))
PY
then ok "each of 2 sharded ranks keeps half the model state (host tier; device)"; else bad "sharded model state is not 1/2"; fi
# Sharded ranks read their shards of a Hugging Face model alone (--init: each reads its part of
# every tensor), and follow 1 rank that loads it whole.
"$ferry" train "${common[@]}" --batch 4 --steps 4 --init "$tmp/one" --log "$tmp/init1.json" --save "$tmp/init1" \
  || bad "1 rank starts from a saved model"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --steps 4 --init "$tmp/one" --log "$tmp/init2.json" \
  --save "$tmp/init2" || bad "2 sharded ranks start from a saved model"
compare init1 init2 1e-5 && ok "2 sharded ranks that read their shards of a saved model follow 1 rank" \
  || bad "sharded ranks starting from a saved model differ"

# The ranks of one node share its memory: each one's host tier defaults to its share of it.
"$ferry" train --model opt-tiny --data "$tmp/data.bin" --seq 32 --steps 1 --threads 1 "${sim[@]}" --batch 4 >"$tmp/cap1.out" 2>&1
"${mpi[@]}" -np 2 "$ferry" train --model opt-tiny --data "$tmp/data.bin" --seq 32 --steps 1 --threads 1 "${sim[@]}" --batch 2 \
  >"$tmp/cap2.out" 2>&1
one=$(sed -n 's/.*host tier [0-9.]* of \([0-9]*\) MiB.*/\1/p' "$tmp/cap1.out")
two=$(sed -n 's/.*host tier [0-9.]* of \([0-9]*\) MiB.*/\1/p' "$tmp/cap2.out")
if [ -n "$one" ] && [ -n "$two" ] && [ $((one / 2 - two)) -ge -1 ] && [ $((one / 2 - two)) -le 1 ]; then
  ok "each of 2 ranks on one node takes half its memory by default ($two of $one MiB)"
else bad "the default host tier of 2 ranks: '$two' MiB, of 1 rank '$one' MiB"; cat "$tmp/cap1.out" "$tmp/cap2.out"; fi
if "${mpi[@]}" -np 2 "$ferry" train --model opt-175b --data "$tmp/data.bin" --seq 32 --batch 1 --steps 1 >"$tmp/big.out" 2>&1; then
  bad "2 replicated ranks of OPT-175B are accepted"
else grep -q "2 ranks share this machine's" "$tmp/big.out" && ok "replicated ranks too big for their share of the machine are refused, saying so" \
  || { bad "replicated ranks too big: unclear message"; cat "$tmp/big.out"; }; fi
# A sharded checkpoint (gathered by every rank, written by rank 0) resumes on 2 sharded ranks and
# on 1 rank.
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --save "$tmp/ckz" --save-every 100 --stop-after 6 \
  >/dev/null 2>&1 || bad "2 sharded ranks checkpoint"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --resume "$tmp/ckz" --log "$tmp/zres2.json" \
  --save "$tmp/zres2" || bad "2 sharded ranks resume"
"$ferry" train "${common[@]}" --batch 4 --resume "$tmp/ckz" --log "$tmp/zres1.json" --save "$tmp/zres1" || bad "1 rank resumes a sharded checkpoint"
compare zero zres2 1e-6 && compare one zres1 1e-5 && ok "a sharded checkpoint resumes on 2 sharded ranks and on 1 rank" \
  || bad "resuming a sharded checkpoint differs"
# Rank 0's host memory holds its share of the state but no snapshot of the whole model (a model
# that fills the node): the ranks gather the checkpoint chunk by chunk and rank 0 writes each
# chunk as it comes, the same bytes as from a snapshot.
loud=(--model opt-tiny --data "$tmp/data.bin" --seq 32 --steps 12 --threads 1)
"${mpi[@]}" -np 2 "$ferry" train "${loud[@]}" "${sim[@]}" --batch 2 --host-mem 400KiB --save "$tmp/ckzc" --save-every 100 \
  --stop-after 6 >"$tmp/ckzc.out" 2>&1 || bad "2 sharded ranks checkpoint with a small host memory"
same=1
for f in model.safetensors optimizer.safetensors config.json; do
  cmp -s "$tmp/ckz/step-00000006/$f" "$tmp/ckzc/step-00000006/$f" || same=0
done
if grep -q "checkpoints are written chunk by chunk" "$tmp/ckzc.out" && [ $same = 1 ]; then
  ok "a sharded checkpoint written chunk by chunk (no snapshot fits) is the same bytes as one from a snapshot"
else bad "sharded checkpoint chunk by chunk: $(grep -c 'chunk by chunk' "$tmp/ckzc.out") messages, same files: $same"; fi
# Sharded chunks with 16-bit compute: each rank keeps its shard of the fp32 master and of the 16-bit
# copy the blocks are gathered from; the gradients come home over that copy's shard (with 2
# micro-batches, summed in fp32). The ranks' 16-bit gradients are summed as the replicated ranks'
# are, so the sharded run is bit for bit the replicated one (--device cpu, 2 ranks); against 1
# rank the difference is each rank rounding its half of every gradient (measured 5e-5 in the
# losses, 3e-3 in the weights after 12 steps).
for p in bf16 fp16; do
  "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --precision $p --log "$tmp/rep$p.json" --save "$tmp/rep$p" \
    || bad "2 replicated $p ranks train"
  "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision $p --log "$tmp/zero$p.json" \
    --save "$tmp/zero$p" || bad "2 sharded $p ranks train"
  compare "rep$p" "zero$p" 0 && ok "2 $p ranks with sharded chunks: the replicated run's bits" || bad "sharded $p ranks differ from replicated ones"
done
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --device-chunks 1000 \
  --log "$tmp/zerodev16.json" --save "$tmp/zerodev16" || bad "2 sharded bf16 ranks with shards on the device train"
compare repbf16 zerodev16 0 && ok "2 sharded bf16 ranks with the shards on the device: the replicated run's bits" \
  || bad "sharded bf16 ranks with the shards on the device differ"
"$ferry" train "${common[@]}" --batch 4 --precision bf16 --log "$tmp/onebf16.json" --save "$tmp/onebf16" || bad "1 bf16 rank trains"
compare onebf16 zerobf16 1e-4 5e-3 && ok "2 sharded bf16 ranks follow 1 bf16 rank" || bad "sharded bf16 ranks drift from 1 rank"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --precision bf16 --grad-accum 2 --log "$tmp/repacc16.json" \
  --save "$tmp/repacc16" || bad "2 replicated bf16 ranks accumulate"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --grad-accum 2 --disk-dir "$tmp/disk" \
  --disk-chunks 4 --log "$tmp/zeroacc16.json" --save "$tmp/zeroacc16" || bad "2 sharded bf16 ranks with accumulation and disk train"
compare repacc16 zeroacc16 0 && ok "2 sharded bf16 ranks with 2 micro-batches and 4 chunks' shards on disk: the replicated run's bits" \
  || bad "sharded bf16 ranks with accumulation and disk differ"
# --disk-master: each rank's shard of a disk chunk's fp32 master in its disk slot, with m and v.
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --disk-dir "$tmp/disk" --disk-chunks 4 \
  --disk-master --log "$tmp/zerodm16.json" --save "$tmp/zerodm16" || bad "2 sharded bf16 ranks with master weights on disk train"
compare repbf16 zerodm16 0 && ok "2 sharded bf16 ranks with 4 chunks' master shards on disk: the replicated run's bits" \
  || bad "sharded bf16 ranks with master weights on disk differ"
# --spec-chunks: each sharded rank updates its shards of the last layers' chunks before the norm,
# into spare slots; the norm (the same on both ranks) keeps or redoes them alike: the replicated
# run's bits whether the steps clip (the default clip here) or not (--clip 100, against its own).
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --spec-chunks 100 \
  --log "$tmp/zspec16.json" --save "$tmp/zspec16" >"$tmp/zspec16.out" 2>&1 || bad "2 sharded bf16 ranks speculate"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --precision bf16 --clip 100 --log "$tmp/repnc16.json" \
  --save "$tmp/repnc16" || bad "2 replicated bf16 ranks train without clipping"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --clip 100 --spec-chunks 100 \
  --disk-dir "$tmp/disk" --disk-chunks 2 --log "$tmp/zspecnc16.json" --save "$tmp/zspecnc16" >"$tmp/zspecnc16.out" 2>&1 \
  || bad "2 sharded bf16 ranks speculate without clipping"
lastspec() { tail -n 1 "$tmp/$1.json" | grep -o '"spec_steps":[0-9]*,"spec_redone":[0-9]*'; }
if compare repbf16 zspec16 0 && compare repnc16 zspecnc16 0 && [ -n "$(lastspec zspec16)" ] &&
  [ "$(lastspec zspecnc16)" = '"spec_steps":12,"spec_redone":0' ]; then
  ok "2 sharded bf16 ranks with speculative updates: the replicated run's bits, clipping ($(lastspec zspec16)) or not"
else bad "sharded bf16 ranks with speculative updates differ: $(lastspec zspec16) $(lastspec zspecnc16)"; fi
# --device-updates: each sharded rank's shards of its host chunks updated by its (sim) device, beside
# speculation and a disk chunk: the replicated run's bits.
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --device-updates 2 --spec-chunks 2 \
  --disk-dir "$tmp/disk" --disk-chunks 1 --log "$tmp/zdu16.json" --save "$tmp/zdu16" >"$tmp/zdu16.out" 2>&1 \
  || bad "2 sharded bf16 ranks with device updates train"
if compare repbf16 zdu16 0 && grep -q "\"device_updates\":2" "$tmp/zdu16.json"; then
  ok "2 sharded bf16 ranks with device updates of 2 chunks' shards: the replicated run's bits"
else bad "sharded bf16 ranks with device updates differ"; fi
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --save "$tmp/ckz16" --save-every 100 \
  --stop-after 6 >/dev/null 2>&1 || bad "2 sharded bf16 ranks checkpoint"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --precision bf16 --resume "$tmp/ckz16" \
  --log "$tmp/zres16.json" --save "$tmp/zres16" || bad "2 sharded bf16 ranks resume"
compare zerobf16 zres16 0 && ok "2 sharded bf16 ranks resume their checkpoint exactly" || bad "resuming sharded bf16 ranks differs"
"$ferry" train "${common[@]}" "${sim[@]}" --batch 4 --steps 2 --precision bf16 --log "$tmp/mem16.json" || bad "1 bf16 rank on sim"
if python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
last = lambda f: [json.loads(l) for l in open(d + "/" + f)][-1]
a, b = last("mem16.json"), last("zerobf16.json")
want = a["host_tier_mib"] / 2
assert abs(b["host_tier_mib"] - want) <= 0.1 * want + b["chunk_mib"], (a["host_tier_mib"], b["host_tier_mib"])
print("  bf16 host_tier_mib: 1 rank %.4f MiB, each of 2 ranks %.4f MiB" % (a["host_tier_mib"], b["host_tier_mib"]))
PY
then ok "each of 2 sharded bf16 ranks keeps half the model state"; else bad "sharded bf16 model state is not 1/2"; fi
# AdamW state stored as bf16 or 8-bit (--optimizer-state): 1 rank with 2 micro-batches of 2, 2
# replicated ranks of 2 and 2 sharded ranks of 2 (shards in the host tier; 16-bit compute also
# with 4 chunks' shards on disk) end with the same bits: weights, m and v (the step-12
# checkpoints' model.safetensors and optimizer.safetensors, which hold m and v as they are stored:
# bf16, or 8-bit codes and scales), in fp32 and bf16 compute. A checkpoint written by 2 sharded
# ranks resumes on 1 rank, and one written by 1 rank on 2 sharded ranks, to those same bits.
# same_state A B: A's and B's step-12 checkpoints hold the same weights and AdamW state.
same_state() {
  cmp -s "$tmp/$1/step-00000012/optimizer.safetensors" "$tmp/$2/step-00000012/optimizer.safetensors" &&
    cmp -s "$tmp/$1/step-00000012/model.safetensors" "$tmp/$2/step-00000012/model.safetensors"
}
for sf in bf16 8bit; do
  for p in fp32 bf16; do
    st=(--optimizer-state $sf --precision $p --save-every 12)
    "$ferry" train "${common[@]}" --batch 2 --grad-accum 2 "${st[@]}" --save "$tmp/sf1$sf$p" || bad "1 rank with $sf state ($p) trains"
    "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 "${st[@]}" --save "$tmp/sfrep$sf$p" \
      || bad "2 replicated ranks with $sf state ($p) train"
    "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 "${st[@]}" --save "$tmp/sfzero$sf$p" \
      || bad "2 sharded ranks with $sf state ($p) train"
    same_state "sf1$sf$p" "sfrep$sf$p" && same_state "sf1$sf$p" "sfzero$sf$p" \
      && ok "$sf AdamW state, $p compute: 2 replicated and 2 sharded ranks end with 1 rank's bits (weights, m, v)" \
      || bad "$sf AdamW state, $p compute: ranks differ from 1 rank"
  done
  st=(--optimizer-state $sf --precision bf16 --save-every 12)
  "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 "${st[@]}" --disk-dir "$tmp/disk" --disk-chunks 4 \
    --save "$tmp/sfdisk$sf" || bad "2 sharded ranks with $sf state on disk train"
  same_state "sf1${sf}bf16" "sfdisk$sf" && ok "$sf AdamW state: 2 sharded ranks with 4 chunks' shards on disk end with 1 rank's bits" \
    || bad "$sf AdamW state on disk: sharded ranks differ from 1 rank"
  # (each rank's device updating its shards of every host chunk, a quarter shard at a time: a
  # piece's m and v, 8-bit codes and their blocks' scales apart, cut from the shard's buffers)
  "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 "${st[@]}" --device-updates 100 \
    --log "$tmp/sfdu$sf.json" --save "$tmp/sfdu$sf" || bad "2 sharded ranks with $sf state and device updates train"
  same_state "sf1${sf}bf16" "sfdu$sf" && grep -q '"device_updates":[1-9]' "$tmp/sfdu$sf.json" && ok "$sf AdamW state: 2 sharded ranks whose devices update their shards end with 1 rank's bits" \
    || bad "$sf AdamW state with device updates: sharded ranks differ from 1 rank"
  st=(--optimizer-state $sf)
  "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 "${st[@]}" --save "$tmp/sfckz$sf" --save-every 100 --stop-after 6 \
    >/dev/null 2>&1 || bad "2 sharded ranks with $sf state checkpoint"
  "$ferry" train "${common[@]}" --batch 2 --grad-accum 2 "${st[@]}" --resume "$tmp/sfckz$sf" --save "$tmp/sfres1$sf" \
    --save-every 12 || bad "1 rank resumes 2 sharded ranks' $sf checkpoint"
  "$ferry" train "${common[@]}" --batch 2 --grad-accum 2 "${st[@]}" --save "$tmp/sfck1$sf" --save-every 100 --stop-after 6 \
    >/dev/null 2>&1 \
    || bad "1 rank with $sf state checkpoints"
  "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 "${st[@]}" --resume "$tmp/sfck1$sf" \
    --save "$tmp/sfresz$sf" --save-every 12 || bad "2 sharded ranks resume 1 rank's $sf checkpoint"
  same_state "sf1${sf}fp32" "sfres1$sf" && same_state "sf1${sf}fp32" "sfresz$sf" \
    && ok "$sf AdamW state: 2 sharded ranks' checkpoint resumes on 1 rank, and 1 rank's on 2 sharded ranks, exactly" \
    || bad "$sf AdamW state: resuming across ranks and layouts differs"
done
if "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --device-chunks 3 >"$tmp/part.out" 2>&1; then
  bad "a partial --device-chunks with sharding is accepted"
else grep -q "all in the host tier (0) or all on the device" "$tmp/part.out" && ok "a partial --device-chunks with sharding is refused" \
  || { bad "a partial --device-chunks: unclear message"; cat "$tmp/part.out"; }; fi

# A data-parallel x tensor-parallel grid on GPUs shards its chunks through pinned host memory:
# without --offload it is refused with the flag to use (this machine may have no GPU: the refusal
# comes first; test/cuda_ranks.sh runs --tp on GPUs with and without --offload, real or emulated).
if "${mpi[@]}" -np 4 "$ferry" train "${common[@]}" --batch 2 --device cuda --tp 2 >"$tmp/cuda2.out" 2>&1; then
  bad "a 2 x 2 grid on GPUs without --offload is accepted"
else grep -q "add --offload" "$tmp/cuda2.out" && ok "a 2 x 2 grid on GPUs without --offload is refused" \
  || { bad "a grid on GPUs without --offload: unclear message"; cat "$tmp/cuda2.out"; }; fi

# Tensor parallelism (--tp, Megatron's split): 2 ranks split every layer's heads and feed-forward
# features and share the sequences; 4 ranks form a 2 x 2 grid (2 data-parallel groups of 2).
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 4 --tp 2 --log "$tmp/tp.json" --save "$tmp/tp" \
  || bad "2 tensor-parallel ranks train"
compare one tp 1e-5 && ok "2 tensor-parallel ranks follow 1 rank" || bad "tensor-parallel ranks differ from 1 rank"
# With --device-updates each tensor-parallel rank's host chunks are updated by its (sim) device, the
# norm over both slices as before: the bits of the same ranks updating on the host.
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 4 --tp 2 --precision bf16 --log "$tmp/tpsim.json" \
  --save "$tmp/tpsim" || bad "2 tensor-parallel offloaded ranks train"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 4 --tp 2 --precision bf16 --device-updates 100 \
  --log "$tmp/tpdu.json" --save "$tmp/tpdu" || bad "2 tensor-parallel ranks with device updates train"
compare tpsim tpdu 0 && ok "2 tensor-parallel ranks with device updates: the bits of host updates" \
  || bad "tensor-parallel ranks with device updates differ"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" --batch 2 --tp 2 --log "$tmp/grid.json" --save "$tmp/grid" \
  || bad "a 2 x 2 grid trains"
compare one grid 1e-5 && ok "a 2 x 2 grid (tensor-parallel pairs, data-parallel across) follows 1 rank" \
  || bad "the 2 x 2 grid differs from 1 rank"
# Dropout (ops/dropout.h): the masks follow the seed and each sequence's place in the data, so 2
# data-parallel ranks with sharded chunks and a 2 x 2 grid (tensor-parallel pairs, whose residual
# adds see whole rows) draw the single rank's masks. Validation (--val-data) on the ranks: each
# takes its rows, the losses are summed over them, and the result is the single rank's.
val=(--dropout 0.2 --val-data "$tmp/data.bin" --val-every 5 --val-batches 2)
"$ferry" train "${common[@]}" --batch 4 "${val[@]}" --log "$tmp/do1.json" --save "$tmp/do1" || bad "1 rank trains with dropout"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 "${val[@]}" --log "$tmp/do2.json" --save "$tmp/do2" \
  || bad "2 sharded ranks train with dropout"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" --batch 2 --tp 2 "${val[@]}" --log "$tmp/dogrid.json" --save "$tmp/dogrid" \
  || bad "a 2 x 2 grid trains with dropout"
compare do1 do2 1e-5 && compare do1 dogrid 1e-5 && ! compare one do1 1e-3 >/dev/null 2>&1 \
  && ok "with dropout, 2 sharded ranks and a 2 x 2 grid follow 1 rank (and differ from no dropout)" \
  || bad "dropout over ranks differs from 1 rank"
if python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
val = lambda f: {r["step"]: r["val_loss"] for r in map(json.loads, open(d + "/" + f)) if "val_loss" in r}
a = val("do1.json")
assert sorted(a) == [5, 10, 12], a
for f in ("do2.json", "dogrid.json"):
    b = val(f)
    assert sorted(b) == sorted(a) and all(abs(a[s] - b[s]) <= 1e-5 * a[s] for s in a), (f, a, b)
print("  validation after steps %s: %s" % (sorted(a), [round(a[s], 5) for s in sorted(a)]))
PY
then ok "validation on 2 sharded ranks and on a 2 x 2 grid: the single rank's losses"; else bad "validation over ranks differs"; fi
# Checkpoints hold whole tensors: a tensor-parallel checkpoint resumes on 1 rank, and a 1-rank one
# on tensor-parallel ranks.
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 4 --tp 2 --save "$tmp/cktp" --save-every 100 --stop-after 6 \
  >/dev/null 2>&1 || bad "tensor-parallel ranks checkpoint"
"$ferry" train "${common[@]}" --batch 4 --resume "$tmp/cktp" --log "$tmp/tpres1.json" --save "$tmp/tpres1" \
  || bad "1 rank resumes a tensor-parallel checkpoint"
"$ferry" train "${common[@]}" --batch 4 --save "$tmp/ck1" --save-every 100 --stop-after 6 >/dev/null 2>&1 || bad "1 rank checkpoints"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 4 --tp 2 --resume "$tmp/ck1" --log "$tmp/tpres2.json" \
  --save "$tmp/tpres2" || bad "tensor-parallel ranks resume a 1-rank checkpoint"
compare one tpres1 1e-5 && compare one tpres2 1e-5 && ok "tensor-parallel checkpoints resume on 1 rank and the reverse" \
  || bad "resuming across tensor parallelism differs"
# Tensor-parallel slices keep fp32 AdamW state: an 8-bit checkpoint (codes and scales of whole
# tensors) resumes on them converted, as on 1 rank with fp32 state.
"$ferry" train "${common[@]}" --batch 4 --optimizer-state 8bit --save "$tmp/ck8" --save-every 100 --stop-after 6 >/dev/null 2>&1 \
  || bad "1 rank with 8-bit state checkpoints"
"$ferry" train "${common[@]}" --batch 4 --resume "$tmp/ck8" --log "$tmp/res8to1.json" --save "$tmp/res8to1" 2>"$tmp/res8to1.err" \
  || bad "1 rank resumes an 8-bit checkpoint in fp32"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 4 --tp 2 --resume "$tmp/ck8" --log "$tmp/res8tp.json" \
  --save "$tmp/res8tp" >"$tmp/res8tp.out" 2>&1 || bad "tensor-parallel ranks resume an 8-bit checkpoint"
compare res8to1 res8tp 1e-5 && grep -q "stored as 8bit and this run stores it as fp32" "$tmp/res8tp.out" \
  && ok "an 8-bit checkpoint resumes on tensor-parallel ranks, converted with a warning, as on 1 rank" \
  || { bad "an 8-bit checkpoint on tensor-parallel ranks"; cat "$tmp/res8tp.out"; }
# Tensor parallelism with the zero pattern: 2 x 2 ranks, each tensor-parallel slice's chunks
# sharded over the 2 data-parallel ranks that hold it; its checkpoint resumes on 1 rank.
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --tp 2 --log "$tmp/tpzero.json" --save "$tmp/tpzero" \
  || bad "a 2 x 2 grid with sharded chunks trains"
compare one tpzero 1e-5 && ok "a 2 x 2 grid with sharded chunks (tp inside, zero across) follows 1 rank" \
  || bad "the 2 x 2 grid with sharded chunks differs from 1 rank"
# Its ranks take their shards straight from the whole model's tensors and save chunk by chunk: the
# host tier never holds a rank's slices whole (its peak is its steady state, within a chunk).
if python3 - "$tmp/tpzero.json" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print("  host tier %.4f MiB, its peak %.4f MiB (chunks of %.4f MiB)" % (r["host_tier_mib"], r["host_peak_mib"], r["chunk_mib"]))
assert r["host_peak_mib"] <= r["host_tier_mib"] + r["chunk_mib"]
PY
then ok "a 2 x 2 sharded grid's host peak is its state's"; else bad "a 2 x 2 sharded grid held more than its state"; fi
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" --batch 2 --tp 2 --precision bf16 --log "$tmp/grid16.json" \
  --save "$tmp/grid16" || bad "a bf16 2 x 2 grid trains"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --tp 2 --precision bf16 --log "$tmp/tpzero16.json" \
  --save "$tmp/tpzero16" || bad "a bf16 2 x 2 grid with sharded chunks trains"
compare grid16 tpzero16 0 && ok "a bf16 2 x 2 grid with sharded chunks: the replicated grid's bits" \
  || bad "the bf16 2 x 2 grid with sharded chunks differs from the replicated one"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --tp 2 --save "$tmp/cktz" --save-every 100 --stop-after 6 \
  >/dev/null 2>&1 || bad "the 2 x 2 sharded grid checkpoints"
"$ferry" train "${common[@]}" --batch 4 --resume "$tmp/cktz" --log "$tmp/tzres.json" --save "$tmp/tzres" \
  || bad "1 rank resumes the 2 x 2 sharded grid's checkpoint"
compare one tzres 1e-5 && ok "the 2 x 2 sharded grid's checkpoint resumes on 1 rank" || bad "resuming the 2 x 2 sharded grid differs"
"${mpi[@]}" -np 4 "$ferry" train "${common[@]}" "${sim[@]}" --batch 2 --tp 2 --resume "$tmp/ck1" --log "$tmp/tzres2.json" \
  --save "$tmp/tzres2" || bad "the 2 x 2 sharded grid resumes a 1-rank checkpoint"
compare one tzres2 1e-5 && ok "the 2 x 2 sharded grid resumes a 1-rank checkpoint" || bad "the 2 x 2 sharded grid's resume differs"
# A tensor-parallel rank's smallest working set is its slices': a --device-mem below one rank's
# (434 KiB here) holds each of 2 tensor-parallel ranks' (318 KiB).
if "$ferry" train "${common[@]}" --batch 2 --device sim --device-mem 400KiB --steps 1 >"$tmp/tpmem1.out" 2>&1; then
  bad "1 rank trains in 400 KiB of device memory (the check below means nothing)"
elif ! grep -q "cannot hold the smallest working set" "$tmp/tpmem1.out"; then bad "1 rank in 400 KiB: unclear"; cat "$tmp/tpmem1.out"
elif "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --device sim --device-mem 400KiB --steps 2 --tp 2 \
  >"$tmp/tpmem2.out" 2>&1; then ok "2 tensor-parallel ranks train in device memory too small for 1 rank"
else bad "2 tensor-parallel ranks in 400 KiB"; cat "$tmp/tpmem2.out"; fi
# Each tensor-parallel rank reads its slices of a Hugging Face directory's tensors (--init).
"$ferry" train "${common[@]}" --batch 4 --steps 3 --init "$tmp/one" --log "$tmp/ft1.json" --save "$tmp/ft1" \
  || bad "1 rank starts from a saved model"
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 4 --steps 3 --tp 2 --init "$tmp/one" --log "$tmp/fttp.json" \
  --save "$tmp/fttp" || bad "tensor-parallel ranks start from a saved model"
compare ft1 fttp 1e-5 && ok "tensor-parallel ranks start from a saved model as 1 rank does" \
  || bad "tensor-parallel ranks start from a saved model differently"
# ferry eval over ranks: data-parallel groups read their rows of each batch, tensor-parallel ranks
# split each layer (resident, and offloaded on sim with the chunks sharded across a 2 x 2 grid):
# the mean loss is the single rank's; a --tp that does not divide the ranks is refused.
ev=(--model opt-tiny --data "$tmp/data.bin" --seq 32 --threads 1 --init "$tmp/one" --batches 3)
evloss() { sed -n 's/^eval loss \([0-9.]*\) .*/\1/p' "$tmp/$1.out"; }
"$ferry" eval "${ev[@]}" --batch 4 >"$tmp/ev1.out" 2>&1 || bad "1 rank evaluates"
"${mpi[@]}" -np 2 "$ferry" eval "${ev[@]}" --batch 4 --tp 2 >"$tmp/evtp.out" 2>&1 || bad "2 tensor-parallel ranks evaluate"
"${mpi[@]}" -np 4 "$ferry" eval "${ev[@]}" --batch 2 --tp 2 >"$tmp/evgrid.out" 2>&1 || bad "a 2 x 2 grid evaluates"
"${mpi[@]}" -np 4 "$ferry" eval "${ev[@]}" --batch 2 --tp 2 --device sim --device-mem 300KiB >"$tmp/evsim.out" 2>&1 \
  || bad "a 2 x 2 grid evaluates offloaded on sim"
if python3 - "$(evloss ev1)" "$(evloss evtp)" "$(evloss evgrid)" "$(evloss evsim)" <<'PY'
import sys
v = [float(x) for x in sys.argv[1:]]
print("  eval losses: 1 rank %s, tp 2 %s, 2 x 2 %s, 2 x 2 on sim %s" % tuple(sys.argv[1:]))
assert len(v) == 4 and all(abs(x - v[0]) <= 1e-5 * v[0] for x in v), v
PY
then ok "ferry eval with --tp 2 and on a 2 x 2 grid (cpu, sim): the single rank's loss"
else bad "ferry eval over tensor-parallel ranks differs"; for f in ev1 evtp evgrid evsim; do cat "$tmp/$f.out"; done; fi
if "${mpi[@]}" -np 3 "$ferry" eval "${ev[@]}" --batch 2 --tp 2 >"$tmp/ev3.out" 2>&1; then bad "ferry eval --tp 2 on 3 ranks is accepted"
else grep -q "does not divide the 3 ranks" "$tmp/ev3.out" && ok "ferry eval --tp 2 on 3 ranks is refused" \
  || { bad "ferry eval --tp 2 on 3 ranks: unclear message"; cat "$tmp/ev3.out"; }; fi

# A mixture of experts under --tp (core/opt.c, planner/patterns/expert.c): each expert's fc1 split
# by its output rows and its fc2 by its input columns, the router whole on every rank; the output,
# the routing weights' gradients and the experts' part of the input gradient summed over the pair.
# 3 steps of opt-moe-tiny (about 30 s in all, mostly mpirun's starts, on the busy 2-core dev
# machine): 2 ranks on cpu and on sim (offloaded, its experts loaded by need) give 1 rank's losses
# and load-balancing losses within 1e-5 (the printed digits) and its weights within 1e-5, as the
# dense tp runs above (7.4e-7 on the dev machine); a 2 x 2 grid, replicated on cpu and sharded on
# sim, gives 1 rank accumulating 2 micro-batches (each data-parallel rank balances its own tokens'
# routing); a tp checkpoint resumes on 1 rank and a 1-rank one on tp ranks (--ep with --tp:
# test_ranks_ep.sh).
moe=(--model opt-moe-tiny --data "$tmp/data.bin" --seq 32 --steps 3 --threads 1 --quiet --comm-timeout 30)
aux_same() {  # aux_same REF RUN: the load-balancing losses of RUN.json within 1e-5 of REF.json's
  python3 - "$tmp/$1.json" "$tmp/$2.json" <<'PY'
import json, sys
a, b = ({r["step"]: r["aux_loss"] for r in map(json.loads, open(f))} for f in sys.argv[1:])
assert b and all(abs(a[s] - b[s]) <= 1e-5 * abs(a[s]) for s in b), (a, b)
PY
}
"$ferry" train "${moe[@]}" --batch 4 --log "$tmp/moe1.json" --save "$tmp/moe1" || bad "1 rank trains opt-moe-tiny"
"$ferry" train "${moe[@]}" --batch 2 --grad-accum 2 --log "$tmp/moeacc.json" --save "$tmp/moeacc" \
  || bad "1 rank trains opt-moe-tiny accumulating 2 micro-batches"
"${mpi[@]}" -np 2 "$ferry" train "${moe[@]}" --batch 4 --tp 2 --log "$tmp/moetp.json" --save "$tmp/moetp" \
  >"$tmp/moetp.out" 2>&1 || { bad "2 tensor-parallel ranks train opt-moe-tiny"; cat "$tmp/moetp.out"; }
compare moe1 moetp 1e-5 && aux_same moe1 moetp && ok "a mixture of experts on 2 tensor-parallel ranks follows 1 rank" \
  || bad "a mixture of experts on tensor-parallel ranks differs from 1 rank"
"${mpi[@]}" -np 2 "$ferry" train "${moe[@]}" "${sim[@]}" --batch 4 --tp 2 --log "$tmp/moetpsim.json" --save "$tmp/moetpsim" \
  >"$tmp/moetpsim.out" 2>&1 || { bad "2 tensor-parallel ranks train opt-moe-tiny on sim"; cat "$tmp/moetpsim.out"; }
compare moe1 moetpsim 1e-5 && aux_same moe1 moetpsim \
  && ok "a mixture of experts on 2 tensor-parallel ranks offloaded (sim) follows 1 rank" \
  || bad "a mixture of experts on tensor-parallel ranks on sim differs from 1 rank"
"${mpi[@]}" -np 4 "$ferry" train "${moe[@]}" --batch 2 --tp 2 --log "$tmp/moegrid.json" --save "$tmp/moegrid" \
  >"$tmp/moegrid.out" 2>&1 || { bad "a 2 x 2 grid trains opt-moe-tiny"; cat "$tmp/moegrid.out"; }
"${mpi[@]}" -np 4 "$ferry" train "${moe[@]}" "${sim[@]}" --batch 2 --tp 2 --log "$tmp/moegridsim.json" \
  --save "$tmp/moegridsim" >"$tmp/moegridsim.out" 2>&1 || { bad "a 2 x 2 grid trains opt-moe-tiny on sim"; cat "$tmp/moegridsim.out"; }
compare moeacc moegrid 1e-5 && aux_same moeacc moegrid && compare moeacc moegridsim 1e-5 && aux_same moeacc moegridsim \
  && ok "a mixture of experts on a 2 x 2 grid (cpu; sim, its chunks sharded) follows 1 rank accumulating its 2 micro-batches" \
  || bad "a mixture of experts on a 2 x 2 grid differs"
"${mpi[@]}" -np 2 "$ferry" train "${moe[@]}" --batch 4 --tp 2 --save "$tmp/moecktp" --save-every 100 --stop-after 2 \
  >/dev/null 2>&1 || bad "tensor-parallel ranks checkpoint opt-moe-tiny"
"$ferry" train "${moe[@]}" --batch 4 --resume "$tmp/moecktp" --log "$tmp/moeres1.json" --save "$tmp/moeres1" \
  || bad "1 rank resumes a tensor-parallel mixture's checkpoint"
"$ferry" train "${moe[@]}" --batch 4 --save "$tmp/moeck1" --save-every 100 --stop-after 2 >/dev/null 2>&1 \
  || bad "1 rank checkpoints opt-moe-tiny"
"${mpi[@]}" -np 2 "$ferry" train "${moe[@]}" --batch 4 --tp 2 --resume "$tmp/moeck1" --log "$tmp/moeres2.json" \
  --save "$tmp/moeres2" >/dev/null 2>&1 || bad "tensor-parallel ranks resume a 1-rank mixture's checkpoint"
compare moe1 moeres1 1e-5 && compare moe1 moeres2 1e-5 && aux_same moe1 moeres1 && aux_same moe1 moeres2 \
  && ok "a tensor-parallel mixture's checkpoint resumes on 1 rank and the reverse" \
  || bad "resuming a mixture across tensor parallelism differs"
# The planner over ranks: ferry plan --gpus 2 chooses a grid and its knobs; mpirun -np 2 ferry
# train --plan FILE runs it (the same sequences as 1 rank with the plan's global batch), and a run
# with another number of ranks refuses it.
export FERRY_PROBE="$tmp/probe.json"
"$ferry" plan --model opt-tiny --batch 4 --seq 32 --gpus 2 --device sim --device-mem 4MiB --out "$tmp/plan2.json" \
  >"$tmp/plan2.out" 2>&1 || { bad "ferry plan --gpus 2"; cat "$tmp/plan2.out"; }
grep -q "^  2 ranks: " "$tmp/plan2.out" && ok "ferry plan --gpus 2 lays out 2 ranks" || { bad "the 2-rank plan"; cat "$tmp/plan2.out"; }
loud=()  # (common without --quiet: the plan's print is checked)
for a in "${common[@]}"; do [ "$a" = --quiet ] || loud+=("$a"); done
"${mpi[@]}" -np 2 "$ferry" train "${loud[@]}" --device-mem 4MiB --plan "$tmp/plan2.json" --log "$tmp/planned.json" \
  --save "$tmp/planned" >"$tmp/planned.out" 2>&1 || bad "2 ranks run the 2-rank plan"
compare one planned 1e-5 && ok "2 ranks running the planner's 2-rank plan follow 1 rank" || bad "the 2-rank plan's run differs"
# A tensor-parallel plan file (1 x 2): its chunks hold one rank's half of each group, smaller than
# the whole model's largest (3168 floats for opt-tiny; 3104 is a plan the search wrote on a CI
# machine, refused once as too small for a group it does not hold). It runs as 1 rank does, and
# in the device memory its plan predicts (a rank's buffers of its own counted: once they were not).
python3 - "$tmp/plan2.json" "$tmp/plantp.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p.update(dp=1, tp=2, pp=1, pattern="replicate", micro_batch=4, grad_accum=1, chunk_elems=3104, blocks=2, device_chunks=0)
json.dump(p, open(sys.argv[2], "w"))
PY
"${mpi[@]}" -np 2 "$ferry" train "${loud[@]}" --device-mem 4MiB --plan "$tmp/plantp.json" --log "$tmp/plannedtp.json" \
  --save "$tmp/plannedtp" >"$tmp/plannedtp.out" 2>&1 || { bad "2 ranks run a tensor-parallel plan"; cat "$tmp/plannedtp.out"; }
compare one plannedtp 1e-5 && ok "2 ranks running a tensor-parallel plan file follow 1 rank" \
  || bad "the tensor-parallel plan's run differs"
peak=$(sed -n 's/^  memory per rank: device \([0-9.]*\) KiB (peak).*/\1/p' "$tmp/plannedtp.out" | head -1)
if [ -n "$peak" ] && "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --steps 2 --device-mem "$(python3 -c \
    "import math, sys; print(math.ceil(float(sys.argv[1]) * 1024 + 52))" "$peak")" --plan "$tmp/plantp.json" \
    >"$tmp/tppeak.out" 2>&1; then
  ok "a tensor-parallel plan runs in the device memory it predicts ($peak KiB)"
else
  bad "a tensor-parallel plan needs more than its predicted ${peak:-?} KiB"; cat "$tmp/plannedtp.out" "$tmp/tppeak.out"
fi
n=$(grep -c "^  2 ranks: " "$tmp/planned.out")
[ "$n" -eq 1 ] && ok "rank 0 alone prints the plan it runs" || { bad "the plan printed $n times"; cat "$tmp/planned.out"; }
# A mixture's tensor-parallel plan (ferry plan --tp 2 on sim: the expert pattern counts each rank's
# slices of the experts): it runs as 1 rank does, in the device memory it predicts.
"$ferry" plan --model opt-moe-tiny --batch 4 --seq 32 --gpus 2 --tp 2 --device sim --device-mem 2MiB \
  --out "$tmp/planmoe.json" >"$tmp/planmoe.out" 2>&1 || { bad "ferry plan --tp 2 of a mixture"; cat "$tmp/planmoe.out"; }
peak=$(python3 -c "import json, sys; print(int(json.load(open(sys.argv[1]))['predicted']['device_peak_bytes']))" \
  "$tmp/planmoe.json" 2>/dev/null)
if [ -n "$peak" ] && "${mpi[@]}" -np 2 "$ferry" train "${moe[@]}" --device-mem "$peak" --plan "$tmp/planmoe.json" \
    --log "$tmp/plannedmoe.json" --save "$tmp/plannedmoe" >"$tmp/plannedmoe.out" 2>&1 && compare moe1 plannedmoe 1e-5; then
  ok "a mixture's tensor-parallel plan runs as 1 rank in the device memory it predicts ($peak bytes)"
else bad "a mixture's tensor-parallel plan (${peak:-?} bytes)"; cat "$tmp/planmoe.out" "$tmp/plannedmoe.out"; fi
# --plan auto under mpirun: rank 0 alone reads or measures the machine, and every rank plans from
# its figures: with the probe above, the plan ferry plan --gpus 2 wrote (the same numbers); with
# none cached, one rank measures (not both, timing each other); with a broken probe file, every
# rank stops and says why.
"${mpi[@]}" -np 2 "$ferry" train "${loud[@]}" --batch 2 --device-mem 4MiB --plan auto --log "$tmp/auto2.json" \
  --save "$tmp/auto2" >"$tmp/auto2.out" 2>&1 || { bad "2 ranks with --plan auto"; cat "$tmp/auto2.out"; }
compare planned auto2 0 && ok "2 ranks with --plan auto run the plan ferry plan --gpus 2 chose" \
  || { bad "--plan auto on 2 ranks ran another plan"; cat "$tmp/auto2.out"; }
FERRY_PROBE="$tmp/fresh.json" "${mpi[@]}" -x FERRY_PROBE -np 2 "$ferry" train "${loud[@]}" --batch 2 --steps 2 \
  --device-mem 4MiB --plan auto >"$tmp/fresh.out" 2>&1 || { bad "2 ranks with --plan auto and no probe"; cat "$tmp/fresh.out"; }
n=$(grep -c "this machine measured for the planner" "$tmp/fresh.out")
[ "$n" -eq 1 ] && [ -s "$tmp/fresh.json" ] && ok "--plan auto on 2 ranks: one rank measures the machine" \
  || { bad "--plan auto on 2 ranks: measured $n times"; cat "$tmp/fresh.out"; }
echo '{"device": ' >"$tmp/broken.json"
if FERRY_PROBE="$tmp/broken.json" "${mpi[@]}" -x FERRY_PROBE -np 2 "$ferry" train "${loud[@]}" --batch 2 --steps 2 \
  --device-mem 4MiB --plan auto >"$tmp/broken.out" 2>&1; then bad "--plan auto with a broken probe file ran"
else grep -q "broken.json: not JSON" "$tmp/broken.out" && grep -q "rank 0 could not read or measure the machine" \
  "$tmp/broken.out" && ok "--plan auto with a broken probe file: both ranks stop, rank 0 says why" \
  || { bad "--plan auto with a broken probe file: unclear"; cat "$tmp/broken.out"; }; fi
if "$ferry" train "${common[@]}" --device-mem 4MiB --plan "$tmp/plan2.json" >"$tmp/plan1.out" 2>&1; then
  bad "1 rank runs a 2-rank plan"
else grep -q "is for 2 ranks" "$tmp/plan1.out" && ok "1 rank refuses a 2-rank plan" || { bad "a 2-rank plan on 1 rank: unclear"; cat "$tmp/plan1.out"; }; fi
if "${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 4 --tp 3 >"$tmp/tp3.out" 2>&1; then bad "--tp 3 on 2 ranks is accepted"
else grep -q "does not divide the 2 ranks" "$tmp/tp3.out" && ok "--tp that does not divide the ranks is refused" \
  || { bad "--tp 3: unclear message"; cat "$tmp/tp3.out"; }; fi

# Pipeline parallelism (--pp, runtime/pipeline.h): 4-layer models (opt-tiny's shape), with the
# lm_head tied to the embeddings and untied, 4 micro-batches a step on the 1F1B schedule. Untied,
# every stage's ops are one rank's, so pp 2 and pp 4 are one rank's bits; tied, the embedding's
# two parts of the gradient are summed between the first and last stage (Megatron's way), one
# rounding apart from one rank's sum (4e-7 in the weights after 12 steps).
for v in tied:true untied:false; do
  mkdir -p "$tmp/cfg-${v%%:*}"
  python3 - "$tmp/cfg-${v%%:*}/config.json" "${v##*:}" <<'PY'
import json, sys
json.dump({"model_type": "opt", "vocab_size": 97, "hidden_size": 32, "word_embed_proj_dim": 32, "ffn_dim": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 64,
           "do_layer_norm_before": True, "activation_function": "relu", "pad_token_id": 1, "dropout": 0.0,
           "tie_word_embeddings": sys.argv[2] == "true"}, open(sys.argv[1], "w"))
PY
done
pcommon=(--data "$tmp/data.bin" --seq 32 --steps 12 --threads 1 --quiet --grad-accum 4)
# Validation (--val-data) every 4 steps: each batch's forward through the stages in turn.
pval=(--val-data "$tmp/data.bin" --val-every 4 --val-batches 2)
# compare_val REF RUN TOL: RUN.json's validation losses are REF.json's (within TOL relative).
compare_val() {
  python3 - "$tmp" "$1" "$2" "$3" <<'PY'
import json, sys
d, a, b, tol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
va, vb = ({r["step"]: r["val_loss"] for r in map(json.loads, open("%s/%s.json" % (d, x))) if "val_loss" in r} for x in (a, b))
assert va and sorted(va) == sorted(vb), (va, vb)
assert all(abs(va[s] - vb[s]) <= tol * abs(va[s]) for s in va), (va, vb)
print("  %s vs %s: %d validation losses within %g" % (a, b, len(va), tol))
PY
}
for v in tied untied; do
  "$ferry" train "${pcommon[@]}" "${pval[@]}" --model "$tmp/cfg-$v" --batch 4 --log "$tmp/p1$v.json" --save "$tmp/p1$v" \
    || bad "1 rank trains the 4-layer $v model"
  for p in 2 4; do
    "${mpi[@]}" -np $p "$ferry" train "${pcommon[@]}" "${pval[@]}" --model "$tmp/cfg-$v" --batch 4 --pp $p \
      --log "$tmp/pp$p$v.json" --save "$tmp/pp$p$v" >"$tmp/pp$p$v.out" 2>&1 || { bad "pp $p ($v) trains"; cat "$tmp/pp$p$v.out"; }
  done
done
compare p1untied pp2untied 0 && compare p1untied pp4untied 0 \
  && ok "pp 2 and pp 4 (untied lm_head): one rank's losses and weights, bit for bit" || bad "pp 2 or 4 (untied) differ from 1 rank"
compare p1tied pp2tied 1e-5 && compare p1tied pp4tied 1e-5 \
  && ok "pp 2 and pp 4 (tied lm_head, its gradient summed between the ends) follow 1 rank" || bad "pp 2 or 4 (tied) differ from 1 rank"
compare_val p1untied pp2untied 0 && compare_val p1untied pp4untied 0 && compare_val p1tied pp2tied 1e-5 \
  && compare_val p1tied pp4tied 1e-5 && ok "validation through pp 2 and pp 4: one rank's losses (untied: the same)" \
  || bad "validation through the stages differs from 1 rank's"
# The same bits with fewer micro-batches than stages (1 a step on 4 stages), and with
# recomputation, bf16 numerics and dropout (whose masks follow the micro-batch, not the rank).
"$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --grad-accum 1 --log "$tmp/pa1.json" --save "$tmp/pa1" \
  || bad "1 rank without accumulation"
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --grad-accum 1 --pp 4 \
  --log "$tmp/pa4.json" --save "$tmp/pa4" || bad "pp 4 with 1 micro-batch a step"
knobs=(--grad-accum 3 --recompute --precision bf16 --dropout 0.1)
"$ferry" train "${pcommon[@]}" "${pval[@]}" --model "$tmp/cfg-untied" --batch 4 "${knobs[@]}" --log "$tmp/pk1.json" \
  --save "$tmp/pk1" || bad "1 rank with recomputation, bf16 and dropout"
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" "${pval[@]}" --model "$tmp/cfg-untied" --batch 4 "${knobs[@]}" --pp 2 \
  --log "$tmp/pk2.json" --save "$tmp/pk2" || bad "pp 2 with recomputation, bf16 and dropout"
compare pa1 pa4 0 && compare pk1 pk2 0 && compare_val pk1 pk2 0 \
  && ok "pp 4 with 1 micro-batch, pp 2 with recomputation, bf16 and dropout (validation without): one rank's bits" \
  || bad "pp with other knobs differs"
# --optimizer-lag 1 (each update a step late, 1 micro-batch a step): on cpu stages the lagged
# update of each stage's parameters, on sim stages the engine's own (bf16); one rank's lagged
# run's bits, its checkpoint (written after the pending update) the same bytes.
lag=(--model "$tmp/cfg-untied" --batch 4 --grad-accum 1 --steps 6 --optimizer-lag 1 --save-every 3)
for d in cpu:"--device cpu" sim:"--device sim --blocks 4 --precision bf16"; do
  for n in 1 2; do
    run=("$ferry"); [ $n = 1 ] || run=("${mpi[@]}" -np $n "$ferry")
    "${run[@]}" train "${pcommon[@]}" "${lag[@]}" ${d#*:} --pp $n --log "$tmp/plag$n${d%%:*}.json" \
      --save "$tmp/plag$n${d%%:*}.d" >"$tmp/plag.out" 2>&1 || { bad "pp $n with --optimizer-lag 1 (${d%%:*})"; cat "$tmp/plag.out"; }
    ln -sfn "$tmp/plag$n${d%%:*}.d/step-00000006" "$tmp/plag$n${d%%:*}"  # (the last checkpoint: compare's weights)
  done
done
same=1
for d in cpu sim; do
  for f in model.safetensors optimizer.safetensors; do
    cmp -s "$tmp/plag1$d.d/step-00000003/$f" "$tmp/plag2$d.d/step-00000003/$f" || same=0
  done
done
[ $same = 1 ] && compare plag1cpu plag2cpu 0 && compare plag1sim plag2sim 0 \
  && ok "pp 2 with --optimizer-lag 1 on cpu and sim: one rank's lagged bits and checkpoint bytes" \
  || bad "pp 2 with --optimizer-lag 1 differs from 1 rank's lagged run"
# dp 2 x pp 2 (replicated): the global batch split over 2 pipelines, as 2 data-parallel ranks split it.
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 2 --log "$tmp/pdp2.json" \
  --save "$tmp/pdp2" || bad "2 data-parallel ranks train the 4-layer model"
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 2 --pp 2 --log "$tmp/pdp2pp2.json" \
  --save "$tmp/pdp2pp2" >"$tmp/pdp2pp2.out" 2>&1 || { bad "dp 2 x pp 2 trains"; cat "$tmp/pdp2pp2.out"; }
compare pdp2 pdp2pp2 0 && compare p1untied pdp2pp2 1e-5 \
  && ok "dp 2 x pp 2: the bits of dp 2, and 1 rank's losses" || bad "dp 2 x pp 2 differs"
# pp 2 x tp 2: tensor-parallel groups within the stages, the bits of tp 2 (whose own sums are
# within 1e-5 of one rank's).
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --tp 2 --log "$tmp/ptp2.json" \
  --save "$tmp/ptp2" || bad "tp 2 trains the 4-layer model"
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --tp 2 --pp 2 --log "$tmp/ptp2pp2.json" \
  --save "$tmp/ptp2pp2" >"$tmp/ptp2pp2.out" 2>&1 || { bad "pp 2 x tp 2 trains"; cat "$tmp/ptp2pp2.out"; }
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-tied" --batch 4 --tp 2 --pp 2 --log "$tmp/ptp2pp2t.json" \
  --save "$tmp/ptp2pp2t" >"$tmp/ptp2pp2t.out" 2>&1 || { bad "pp 2 x tp 2 (tied) trains"; cat "$tmp/ptp2pp2t.out"; }
compare ptp2 ptp2pp2 0 && compare p1tied ptp2pp2t 1e-5 1e-4 \
  && ok "pp 2 x tp 2: the bits of tp 2 (untied); 1 rank's losses (tied)" || bad "pp 2 x tp 2 differs"
# The whole grid, dp 2 x pp 2 x tp 2 (8 ranks): the bits of dp 2 x tp 2.
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 2 --tp 2 --steps 4 --log "$tmp/pg1.json" \
  --save "$tmp/pg1" || bad "dp 2 x tp 2 trains the 4-layer model"
"${mpi[@]}" -np 8 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 2 --tp 2 --pp 2 --steps 4 \
  --log "$tmp/pg2.json" --save "$tmp/pg2" >"$tmp/pg2.out" 2>&1 || { bad "dp 2 x pp 2 x tp 2 trains"; cat "$tmp/pg2.out"; }
compare pg1 pg2 0 && ok "dp 2 x pp 2 x tp 2 (8 ranks): the bits of dp 2 x tp 2" || bad "dp 2 x pp 2 x tp 2 differs"
# Checkpoints are layout-free: the stages send their parameters, one at a time, to the first, which
# writes one rank's files; each stage of a resumed run reads its own tensors.
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 2 --save "$tmp/pck2" \
  --save-every 100 --stop-after 6 >/dev/null 2>&1 || bad "pp 2 checkpoints"
"$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --save "$tmp/pck1" --save-every 100 --stop-after 6 \
  >/dev/null 2>&1 || bad "1 rank checkpoints the 4-layer model"
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --tp 2 --pp 2 --save "$tmp/pck22" \
  --save-every 100 --stop-after 6 >/dev/null 2>&1 || bad "pp 2 x tp 2 checkpoints"
same=1
for f in model.safetensors optimizer.safetensors; do cmp -s "$tmp/pck1/step-00000006/$f" "$tmp/pck2/step-00000006/$f" || same=0; done
[ $same = 1 ] && ok "a pp 2 checkpoint is the same bytes as 1 rank's" || bad "a pp 2 checkpoint differs from 1 rank's"
"$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --resume "$tmp/pck2" --log "$tmp/pres1.json" \
  --save "$tmp/pres1" || bad "1 rank resumes a pp 2 checkpoint"
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 4 --resume "$tmp/pck22" \
  --log "$tmp/pres4.json" --save "$tmp/pres4" || bad "pp 4 resumes a pp 2 x tp 2 checkpoint"
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --tp 2 --pp 2 --resume "$tmp/pck1" \
  --log "$tmp/pres22.json" --save "$tmp/pres22" || bad "pp 2 x tp 2 resumes a 1-rank checkpoint"
# (against the same checkpoints resumed by 1 rank and by tp 2: the same bits)
"$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --resume "$tmp/pck22" --log "$tmp/pres22r1.json" \
  --save "$tmp/pres22r1" || bad "1 rank resumes a pp 2 x tp 2 checkpoint"
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --tp 2 --resume "$tmp/pck1" \
  --log "$tmp/pres1tp.json" --save "$tmp/pres1tp" || bad "tp 2 resumes a 1-rank checkpoint"
compare p1untied pres1 0 && compare pres22r1 pres4 0 && compare pres1tp pres22 0 \
  && ok "checkpoints across layouts, bit for bit: pp 2 -> 1 rank, pp 2 x tp 2 -> pp 4, 1 rank -> pp 2 x tp 2" \
  || bad "resuming across pipeline layouts differs"
# Each stage holds its own parameters alone, with their gradients and AdamW state (the embeddings
# with the first, the final norm and lm_head with the last, a tied lm_head's weight on both), and
# every stage says how many: the test counts the same from the 1-rank model's tensors. --init from
# a Hugging Face model: each stage reads its own tensors, and trains as 1 rank from the same file.
ploud=(--data "$tmp/data.bin" --seq 32 --steps 12 --threads 1 --grad-accum 4)  # (pcommon without --quiet)
for v in untied tied; do
  "${mpi[@]}" -np 2 "$ferry" train "${ploud[@]}" --model "$tmp/cfg-$v" --batch 4 --pp 2 --init "$tmp/p1$v" \
    --log "$tmp/pi2$v.json" --save "$tmp/pi2$v" >"$tmp/pi2$v.out" 2>&1 \
    || { bad "pp 2 --init ($v)"; cat "$tmp/pi2$v.out"; }
  "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-$v" --batch 4 --init "$tmp/p1$v" --log "$tmp/pi1$v.json" \
    --save "$tmp/pi1$v" || bad "1 rank --init ($v)"
  python3 - "$tmp/p1$v/model.safetensors" "$tmp/pi2$v.out" "$v" <<'PY' \
    && ok "pp 2 ($v): each stage holds its parameters alone (counted from the tensors)" || bad "pp 2 ($v): a stage's parameters"
import json, re, struct, sys
path, out, tied = sys.argv[1], sys.argv[2], sys.argv[3] == "tied"
raw = open(path, "rb").read()
header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
pp, layers = 2, 4
held, total = [0] * pp, 0
for name, t in header.items():
    if name == "__metadata__": continue
    n = 1
    for d in t["shape"]: n *= d
    total += n
    m = re.search(r"layers\.(\d+)\.", name)
    stage = int(m.group(1)) // (layers // pp) if m else 0 if "embed_" in name else pp - 1
    held[stage] += n
    if tied and "embed_tokens" in name: held[pp - 1] += n  # (the lm_head's weight on the last stage)
said = {int(s): (int(h), int(w)) for s, h, w in
        re.findall(r"pipeline stage (\d+) of 2 \(rank \d+, tp rank 0\): .*?, (\d+) of the model's (\d+) parameters",
                   open(out).read())}
print("  counted", held, "of", total, "; the stages say", said)
assert sorted(said) == list(range(pp)), said
for s in range(pp):
    assert said[s] == (held[s], total), (s, said[s], held[s], total)
    assert 0.35 * total < held[s] < 0.65 * total, (s, held[s], total)  # about half each
PY
done
compare pi1untied pi2untied 0 && compare pi1tied pi2tied 1e-5 \
  && ok "pp 2 --init from a Hugging Face model: 1 rank's losses and weights (untied bit for bit)" \
  || bad "pp 2 --init differs from 1 rank"
# Pipelines on the offloading engine (--device sim): each stage's chunks go through its own device
# cache (4 blocks: chunks evicted and loaded again within every half-pass, the trace the step's
# 1F1B order); its half-passes run the cpu's kernels in the same order, so a sim stage has the cpu
# stage's bits. dp 2 x pp 2 shards each stage's chunks over its 2 data-parallel ranks, with every
# chunk's gradients and AdamW state on disk (the tied embedding's summed between the ends there).
psim=(--device sim --blocks 4 --prefetch 2)
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" "${pval[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 2 "${psim[@]}" \
  --log "$tmp/ps2.json" --save "$tmp/ps2" >"$tmp/ps2.out" 2>&1 || { bad "pp 2 on sim trains"; cat "$tmp/ps2.out"; }
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" "${pval[@]}" --model "$tmp/cfg-tied" --batch 4 --pp 4 "${psim[@]}" \
  --log "$tmp/ps4.json" --save "$tmp/ps4" >"$tmp/ps4.out" 2>&1 || { bad "pp 4 (tied) on sim trains"; cat "$tmp/ps4.out"; }
compare p1untied ps2 0 && compare pp4tied ps4 0 && compare_val p1untied ps2 0 && compare_val pp4tied ps4 0 \
  && ok "pp 2 (untied) and pp 4 (tied) on sim, validating: one rank's bits, the cpu pipeline's bits" || bad "pp on sim differs"
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-tied" --batch 2 --pp 2 "${psim[@]}" --disk-dir "$tmp/disk" \
  --disk-chunks 100 --log "$tmp/psd.json" --save "$tmp/psd" >"$tmp/psd.out" 2>&1 || { bad "dp 2 x pp 2 sharded on disk trains"; cat "$tmp/psd.out"; }
compare p1tied psd 1e-5 && ok "dp 2 x pp 2 on sim, chunks sharded, their state on disk: 1 rank's losses and weights within 1e-5" \
  || bad "dp 2 x pp 2 sharded on sim with the disk tier differs from 1 rank"
# A stage sends once its half-pass's last op is done, before the rest of that half-pass on the
# compute stream: here each stage's first 2 chunks live on the device, and their gradients' sum
# over the micro-batches follows the backward's last op (fy_offload_stage_pass).
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 2 "${psim[@]}" --device-chunks 2 \
  --log "$tmp/psdc.json" --save "$tmp/psdc" >"$tmp/psdc.out" 2>&1 || { bad "pp 2 on sim with device chunks trains"; cat "$tmp/psdc.out"; }
compare p1untied psdc 0 && ok "pp 2 on sim with 2 chunks a stage on the device: one rank's bits" \
  || bad "pp 2 on sim with device chunks differs from 1 rank"
# --spec-chunks on stages: each stage's last chunks updated before the norm (every stage's), kept
# or redone alike on every stage: one rank's bits (pp 2, untied), and dp 2 x pp 2 (tied, sharded)
# within 1e-5 of 1 rank as without it.
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 2 "${psim[@]}" --spec-chunks 100 \
  --log "$tmp/psspec.json" --save "$tmp/psspec" >"$tmp/psspec.out" 2>&1 || { bad "pp 2 on sim speculating trains"; cat "$tmp/psspec.out"; }
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-tied" --batch 2 --pp 2 "${psim[@]}" --spec-chunks 100 \
  --log "$tmp/psdspec.json" --save "$tmp/psdspec" >"$tmp/psdspec.out" 2>&1 || { bad "dp 2 x pp 2 speculating trains"; cat "$tmp/psdspec.out"; }
if compare p1untied psspec 0 && compare p1tied psdspec 1e-5 && tail -n 1 "$tmp/psspec.json" | grep -q '"spec_steps":[1-9]'; then
  ok "pp 2 and dp 2 x pp 2 on sim with speculative updates: as without them ($(tail -n 1 "$tmp/psspec.json" | grep -o '"spec_steps":[0-9]*,"spec_redone":[0-9]*'))"
else bad "pipeline stages with speculative updates differ"; fi
# --device-updates on stages: each stage's host chunks updated by its (sim) device after the norm:
# one rank's bits (pp 2, untied), and dp 2 x pp 2 (tied, sharded, a disk chunk and a speculated one
# a stage) within 1e-5 of 1 rank as without it.
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 2 "${psim[@]}" --device-updates 100 \
  --log "$tmp/psdu.json" --save "$tmp/psdu" >"$tmp/psdu.out" 2>&1 || { bad "pp 2 on sim with device updates trains"; cat "$tmp/psdu.out"; }
"${mpi[@]}" -np 4 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-tied" --batch 2 --pp 2 "${psim[@]}" --device-updates 100 \
  --spec-chunks 1 --disk-dir "$tmp/disk" --disk-chunks 1 --log "$tmp/psddu.json" --save "$tmp/psddu" >"$tmp/psddu.out" 2>&1 \
  || { bad "dp 2 x pp 2 with device updates trains"; cat "$tmp/psddu.out"; }
if compare p1untied psdu 0 && compare p1tied psddu 1e-5 && tail -n 1 "$tmp/psdu.json" | grep -q '"device_updates":[1-9]'; then
  ok "pp 2 and dp 2 x pp 2 on sim with device updates: as without them"
else bad "pipeline stages with device updates differ"; fi
# A sim pipeline's checkpoint is one rank's (bytes), and resumes on 1 rank: fp32 state, and 8-bit
# AdamW state kept compressed in the stages' chunks.
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 2 "${psim[@]}" --save "$tmp/psck" \
  --save-every 100 --stop-after 6 >/dev/null 2>&1 || bad "pp 2 on sim checkpoints"
"$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --resume "$tmp/psck" --log "$tmp/psres.json" \
  --save "$tmp/psres" || bad "1 rank resumes a pp 2 sim checkpoint"
q8=(--model "$tmp/cfg-untied" --batch 4 "${psim[@]}" --optimizer-state 8bit)
"$ferry" train "${pcommon[@]}" "${q8[@]}" --log "$tmp/pq1.json" --save "$tmp/pq1" || bad "1 rank with 8-bit state on sim"
"$ferry" train "${pcommon[@]}" "${q8[@]}" --save "$tmp/pq1ck" --save-every 100 --stop-after 6 >/dev/null 2>&1 \
  || bad "1 rank with 8-bit state checkpoints"
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" "${q8[@]}" --pp 2 --save "$tmp/pq2ck" --save-every 100 --stop-after 6 \
  >"$tmp/pq2.out" 2>&1 || { bad "pp 2 with 8-bit state on sim checkpoints"; cat "$tmp/pq2.out"; }
"$ferry" train "${pcommon[@]}" "${q8[@]}" --resume "$tmp/pq2ck" --log "$tmp/pq2res.json" --save "$tmp/pq2res" \
  || bad "1 rank resumes a pp 2 checkpoint of 8-bit state"
same=1
for d in psck/step-00000006:pck1/step-00000006 pq2ck/step-00000006:pq1ck/step-00000006; do
  for f in model.safetensors optimizer.safetensors; do cmp -s "$tmp/${d%%:*}/$f" "$tmp/${d##*:}/$f" || same=0; done
done
[ $same = 1 ] && compare p1untied psres 0 && compare pq1 pq2res 0 \
  && ok "pp 2 on sim (fp32 and 8-bit AdamW state): one rank's checkpoint bytes, resumed on 1 rank bit for bit" \
  || bad "pp 2 sim checkpoints differ from 1 rank's"
# 8-bit AdamW state on cpu stages (each stage's blocks those of one rank's flat buffer): one
# rank's bits and checkpoint bytes (a 1-rank 8-bit run on sim has the cpu's), and a 1-rank
# checkpoint resumed on a cpu pipeline.
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --optimizer-state 8bit --pp 2 \
  --save "$tmp/pqc2.d" --save-every 6 --log "$tmp/pqc2.json" >"$tmp/pqc2.out" 2>&1 || { bad "pp 2 with 8-bit state on cpu"; cat "$tmp/pqc2.out"; }
ln -sfn "$tmp/pqc2.d/step-00000012" "$tmp/pqc2"
"${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --optimizer-state 8bit --pp 2 \
  --resume "$tmp/pq1ck" --save "$tmp/pqc2res" --log "$tmp/pqc2res.json" >"$tmp/pqc2.out" 2>&1 \
  || { bad "pp 2 on cpu resumes a 1-rank 8-bit checkpoint"; cat "$tmp/pqc2.out"; }
same=1
for f in model.safetensors optimizer.safetensors; do
  cmp -s "$tmp/pqc2.d/step-00000006/$f" "$tmp/pq1ck/step-00000006/$f" || same=0
done
[ $same = 1 ] && compare pq1 pqc2 0 && compare pq1 pqc2res 0 \
  && ok "pp 2 on cpu with 8-bit AdamW state: one rank's bits and checkpoint bytes; a 1-rank checkpoint resumes on it" \
  || bad "pp 2 on cpu with 8-bit state differs from 1 rank"
# A mixture of experts through the stages (the 4-layer model with every layer a mixture of 4
# experts, top 2, untied; 3 steps of 4 micro-batches): each stage runs its layers' mixtures, the
# gradient of each layer's load-balancing term is its own router's, and the stages' terms are added
# into the step's aux_loss. pp 2 on cpu and on sim give one rank's losses, aux_losses and weights,
# bit for bit, and one rank's checkpoint bytes (resumed on 1 rank, the straight run's bits); dp 2 x
# pp 2 sharded on sim gives dp 2 sharded's (each rank's balance term is of its own rows, so dp
# 2's, not one rank's); with 8 experts top 1 and 4 tokens a micro-batch a sim stage loads only the
# experts that got tokens, each micro-batch's backward those of its own forward (1F1B runs the next
# micro-batch's forward between them; 2 cache blocks: the chunk is loaded again in between). --ep
# with --pp on cuda is refused (below; on the cpu and sim it runs: test_ranks_ep.sh).
for v in moe:4:2 moe8:8:1; do
  IFS=: read -r name e k <<<"$v"
  mkdir -p "$tmp/cfg-$name"
  python3 - "$tmp/cfg-$name/config.json" "$e" "$k" <<'PY'
import json, sys
json.dump({"model_type": "opt", "vocab_size": 97, "hidden_size": 32, "word_embed_proj_dim": 32, "ffn_dim": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 64,
           "do_layer_norm_before": True, "activation_function": "relu", "pad_token_id": 1, "dropout": 0.0,
           "tie_word_embeddings": False, "num_local_experts": int(sys.argv[2]), "num_experts_per_tok": int(sys.argv[3]),
           "moe_layer_frequency": 1, "router_aux_loss_coef": 0.01}, open(sys.argv[1], "w"))
PY
done
# compare_moe REF RUN: RUN.json's losses and aux_losses are REF.json's (every printed digit of the
# last steps), RUN/'s weights REF/'s bytes.
compare_moe() {
  python3 - "$tmp" "$1" "$2" <<'PY' && cmp -s "$tmp/$1/model.safetensors" "$tmp/$2/model.safetensors"
import json, sys
d, a, b = sys.argv[1:4]
la, lb = ({r["step"]: (r["loss"], r["aux_loss"]) for r in map(json.loads, open("%s/%s.json" % (d, x)))} for x in (a, b))
assert lb and sorted(lb) == sorted(la)[-len(lb):] and all(la[s] == lb[s] and lb[s][1] > 0 for s in lb), (la, lb)
PY
}
mcommon=(--data "$tmp/data.bin" --seq 32 --steps 3 --threads 1 --quiet --grad-accum 4 --model "$tmp/cfg-moe")
"$ferry" train "${mcommon[@]}" --batch 4 --log "$tmp/m1.json" --save "$tmp/m1.d" --save-every 2 || bad "1 rank trains a mixture"
"${mpi[@]}" -np 2 "$ferry" train "${mcommon[@]}" --batch 4 --pp 2 --log "$tmp/mpp.json" --save "$tmp/mpp.d" --save-every 2 \
  >"$tmp/mpp.out" 2>&1 || { bad "pp 2 trains a mixture"; cat "$tmp/mpp.out"; }
ln -sfn "$tmp/m1.d/step-00000003" "$tmp/m1"
ln -sfn "$tmp/mpp.d/step-00000003" "$tmp/mpp"
"${mpi[@]}" -np 2 "$ferry" train "${mcommon[@]}" --batch 4 --pp 2 "${psim[@]}" --log "$tmp/mps.json" --save "$tmp/mps" \
  >"$tmp/mps.out" 2>&1 || { bad "pp 2 on sim trains a mixture"; cat "$tmp/mps.out"; }
"$ferry" train "${mcommon[@]}" --batch 4 --resume "$tmp/mpp.d/step-00000002" --log "$tmp/mres.json" --save "$tmp/mres" \
  >"$tmp/mres.out" 2>&1 || { bad "1 rank resumes a mixture's pp 2 checkpoint"; cat "$tmp/mres.out"; }
"${mpi[@]}" -np 2 "$ferry" train "${mcommon[@]}" --batch 2 "${psim[@]}" --log "$tmp/md2.json" --save "$tmp/md2" \
  >"$tmp/md2.out" 2>&1 || { bad "dp 2 on sim trains a mixture"; cat "$tmp/md2.out"; }
"${mpi[@]}" -np 4 "$ferry" train "${mcommon[@]}" --batch 2 --pp 2 "${psim[@]}" --log "$tmp/md2p2.json" --save "$tmp/md2p2" \
  >"$tmp/md2p2.out" 2>&1 || { bad "dp 2 x pp 2 on sim trains a mixture"; cat "$tmp/md2p2.out"; }
same=1
for f in model.safetensors optimizer.safetensors; do cmp -s "$tmp/m1.d/step-00000002/$f" "$tmp/mpp.d/step-00000002/$f" || same=0; done
[ $same = 1 ] && compare_moe m1 mpp && compare_moe m1 mps && compare_moe m1 mres && compare_moe md2 md2p2 \
  && ok "a mixture through pp 2 (cpu, sim): one rank's losses, aux_losses, weights and checkpoint bytes; dp 2 x pp 2 sharded on sim: dp 2's" \
  || bad "a mixture's pipeline differs from 1 rank (or dp 2 x pp 2 from dp 2)"
m8=(--data "$tmp/data.bin" --seq 4 --steps 2 --threads 1 --quiet --grad-accum 4 --batch 1 --model "$tmp/cfg-moe8")
"$ferry" train "${m8[@]}" --log "$tmp/m81.json" --save "$tmp/m81" || bad "1 rank trains 8 experts top 1"
"${mpi[@]}" -np 2 "$ferry" train "${m8[@]}" --pp 2 --device sim --blocks 2 --prefetch 0 --log "$tmp/m8s.json" --save "$tmp/m8s" \
  >"$tmp/m8s.out" 2>&1 || { bad "pp 2 on sim trains 8 experts top 1"; cat "$tmp/m8s.out"; }
loaded=$(python3 -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1])][-1]; \
print('%d of %d' % (r['expert_chunks_loaded'], r['expert_chunks']))" "$tmp/m8s.json" 2>/dev/null)
if compare_moe m81 m8s && [ -n "$loaded" ] && [ "${loaded%% of*}" -lt "${loaded##*of }" ]; then
  ok "a sim stage loads only the experts that got tokens (stage 0: $loaded expert parts), one rank's bits"
else bad "a sim stage's experts by need ('$loaded')"; fi
# Layouts that do not fit are refused before anything is allocated, naming the numbers; what
# pipelines do not run yet says so.
refused() {  # refused NAME EXPECTED-TEXT NP ARGS...: the run fails, saying EXPECTED-TEXT
  local name="$1" want="$2" np="$3"; shift 3
  if "${mpi[@]}" -np "$np" "$ferry" train --data "$tmp/data.bin" --seq 32 --steps 1 --threads 1 --quiet "$@" \
    >"$tmp/refused.out" 2>&1; then bad "$name is accepted"
  else grep -q -- "$want" "$tmp/refused.out" && ok "$name is refused" || { bad "$name: unclear message"; cat "$tmp/refused.out"; }; fi
}
refused "--pp 3 with 4 layers" "--pp 3 does not divide the model's 4 decoder layers" 3 --model "$tmp/cfg-untied" --batch 4 --pp 3
refused "--pp 4 with opt-tiny's 2 layers" "more pipeline stages than the model's 2 decoder layers" 4 --model opt-tiny --batch 4 --pp 4
refused "--pp 2 on 3 ranks" "= 2 ranks a pipeline does not divide the 3 ranks" 3 --model "$tmp/cfg-untied" --batch 4 --pp 2
refused "--pp 2 --tp 2 on 2 ranks" "--pp 2 x --tp 2 = 4 ranks a pipeline does not divide the 2 ranks" 2 --model "$tmp/cfg-untied" --batch 4 --pp 2 --tp 2
refused "--ep 2 with --tp 2 on cuda" "--ep 2 with --tp 2 on --device cuda: expert parallelism on GPUs moves whole experts' rows" 4 \
  --model "$tmp/cfg-moe" --batch 2 --tp 2 --ep 2 --device cuda --offload
# ferry eval through the stages: 1 rank's loss on pp 2, pp 2 x tp 2 (cpu) and pp 2 on sim.
evals=(--init "$tmp/p1tied" --data "$tmp/data.bin" --seq 32 --batch 2 --batches 3 --threads 1)
"$ferry" eval "${evals[@]}" >"$tmp/ev1.out" 2>&1 || bad "ferry eval on 1 rank"
same=1
for l in "2:--pp 2" "4:--pp 2 --tp 2" "2:--pp 2 --device sim"; do
  "${mpi[@]}" -np ${l%%:*} "$ferry" eval "${evals[@]}" ${l#*:} >"$tmp/evpp.out" 2>&1 && cmp -s "$tmp/ev1.out" "$tmp/evpp.out" \
    || { same=0; echo "  $l:"; cat "$tmp/evpp.out"; }
done
[ $same = 1 ] && ok "ferry eval --pp (2, 2 x tp 2, 2 on sim): one rank's loss ($(cut -d' ' -f3 "$tmp/ev1.out"))" \
  || bad "ferry eval --pp differs from 1 rank"
# ferry sample decodes on one rank: --pp (and --tp) refused, saying so.
if "$ferry" sample --init "$tmp/p1tied" --prompt-ids 5,6 --tokens 2 --pp 2 >"$tmp/spp.out" 2>&1; then
  bad "ferry sample --pp 2 is accepted"
else grep -q "ferry sample --pp 2: not supported (sampling decodes on one rank" "$tmp/spp.out" \
  && ok "ferry sample --pp 2 is refused, saying why" || { bad "ferry sample --pp 2: unclear message"; cat "$tmp/spp.out"; }; fi
# A pipeline plan on sim (ferry plan --gpus 2 --pp 2: offloaded stages): its file runs under
# mpirun with --plan (the plan's "pp" and micro-batches applied) and follows 1 rank's 4 sequences a
# step; rank 0 prints the plan it runs.
"$ferry" plan --model opt-tiny --batch 4 --seq 32 --gpus 2 --pp 2 --device sim --device-mem 4MiB \
  --out "$tmp/planpp.json" >"$tmp/planpp.out" 2>&1 || { bad "ferry plan --gpus 2 --pp 2 on sim"; cat "$tmp/planpp.out"; }
"${mpi[@]}" -np 2 "$ferry" train "${loud[@]}" --device-mem 4MiB --plan "$tmp/planpp.json" --log "$tmp/plannedpp.json" \
  --save "$tmp/plannedpp" \
  >"$tmp/plannedpp.out" 2>&1 || { bad "2 ranks run a pipeline plan file"; cat "$tmp/plannedpp.out"; }
if grep -q "x 2 pipeline stages" "$tmp/plannedpp.out" && grep -q "each stage offloads its own chunks" "$tmp/plannedpp.out" \
  && compare one plannedpp 1e-5; then ok "a pp 2 plan file (sim, offloaded stages) runs under mpirun and follows 1 rank"
else bad "the pp 2 plan file's run"; cat "$tmp/planpp.out" "$tmp/plannedpp.out"; fi
# The same plan file with the host optimizer's levers (the planner prices them on stages): each
# stage speculates on 1 of its chunks and has its device update 2; the same sequences, the levers
# in the log, and rank 0 names them.
python3 -c 'import json, sys; p = json.load(open(sys.argv[1])); p.update(spec_chunks=1, device_updates=2); json.dump(p, open(sys.argv[2], "w"))' \
  "$tmp/planpp.json" "$tmp/planppl.json"
"${mpi[@]}" -np 2 "$ferry" train "${loud[@]}" --device-mem 4MiB --plan "$tmp/planppl.json" --log "$tmp/plannedppl.json" \
  --save "$tmp/plannedppl" >"$tmp/plannedppl.out" 2>&1 || { bad "2 ranks run a pipeline plan file with levers"; cat "$tmp/plannedppl.out"; }
if grep -q "device updates: each stage's 2 host chunks" "$tmp/plannedppl.out" && compare one plannedppl 1e-5 \
  && tail -n 1 "$tmp/plannedppl.json" | grep -q '"device_updates":2'; then
  ok "a pp 2 plan file with spec_chunks and device_updates (sim) runs them and follows 1 rank"
else bad "the pp 2 plan file with levers"; cat "$tmp/plannedppl.out"; fi
# A dead stage ends the job within --comm-timeout (5 s here) and says what failed. Stage 1 (rank
# 1, found by its OMPI_COMM_WORLD_RANK) is killed once training has started (its log has a step):
# mpirun sees it die and ends the job, naming it (or stage 0 times out first). Then stage 1 is
# stopped instead (SIGSTOP: a hung stage or a lost node, which mpirun does not see): stage 0's
# receive from it (or, between steps, the step's collective) must time out and abort the job,
# saying which of its operations did not complete within the timeout. (Within 20 s more than the timeout:
# a guard against a hang, not a timing; on the 2-core dev machine the kill ended the job 2 s after
# the signal, the stop 6 s after.)
stage1() {  # stage1 JOB: the pid of rank 1 of the job whose mpirun is JOB
  local p
  for p in $(pgrep -f "ferry train --data $tmp/data.bin .*--log $tmp/pkill.json" | grep -vx "$1"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1 && { echo "$p"; return; }
  done
}
for sig in KILL STOP; do
  rm -f "$tmp/pkill.json"
  "${mpi[@]}" -np 2 "$ferry" train "${pcommon[@]}" --model "$tmp/cfg-untied" --batch 4 --pp 2 --steps 100000 \
    --comm-timeout 5 --log "$tmp/pkill.json" >"$tmp/pkill.out" 2>&1 &
  job=$!
  for _ in $(seq 1 240); do [ -s "$tmp/pkill.json" ] && break; sleep 0.25; done  # training has started
  victim=$(stage1 "$job")
  start=$(date +%s)
  if [ -n "$victim" ]; then kill -"$sig" "$victim"; else kill "$job"; fi  # (no stage 1 found: end the job)
  wait "$job"; code=$?
  elapsed=$(( $(date +%s) - start ))
  [ -n "$victim" ] && kill -KILL "$victim" 2>/dev/null  # (a stopped stage that outlived its job)
  said="rank 0: [a-z-]+ of [0-9.]+ [KMG]?i?B( from rank 1)? did not complete within 5 s at step [0-9]+ \\(a rank died or hangs\\)"
  [ $sig = KILL ] && said="rank 1 .*exited on signal 9|$said"
  if [ -n "$victim" ] && [ "$code" -ne 0 ] && [ "$elapsed" -le 25 ] && grep -Eq "$said" "$tmp/pkill.out"; then
    ok "a pipeline stage given SIG$sig ends the job (exit $code after ${elapsed}s): $(grep -Eo "$said" "$tmp/pkill.out" | head -1)"
  else bad "a pipeline stage given SIG$sig: victim '$victim', exit $code after ${elapsed}s"; cat "$tmp/pkill.out"; fi
done

# Ranks that mpirun leaves unbound (--bind-to none) each see every core: without --threads or
# OMP_NUM_THREADS each takes its share of them (at least 1), and says so; --threads still decides.
online=$(getconf _NPROCESSORS_ONLN)
share=$(( online / 3 )); [ "$share" -ge 1 ] || share=1
thr=(--model opt-tiny --data "$tmp/data.bin" --seq 32 --batch 3 --steps 1)
env -u OMP_NUM_THREADS "${mpi[@]}" --bind-to none -np 3 "$ferry" train "${thr[@]}" >"$tmp/thr.out" 2>&1
env -u OMP_NUM_THREADS "${mpi[@]}" --bind-to none -np 3 "$ferry" train "${thr[@]}" --threads 2 >"$tmp/thr2.out" 2>&1
if grep -q "$share threads x 3 ranks" "$tmp/thr.out" && grep -q "2 threads x 3 ranks" "$tmp/thr2.out" &&
   grep -q "3 ranks share this machine's $online cores: $share OpenMP thread" "$tmp/thr.out" &&
   ! grep -q "OpenMP thread" "$tmp/thr2.out"; then
  ok "unbound ranks share the cores ($share threads each of 3), --threads decides"
else bad "unbound ranks' threads (expected $share)"; cat "$tmp/thr.out" "$tmp/thr2.out"; fi

# A rank that dies ends the job: the survivor's collective times out (or mpirun ends it). (Within
# 60 s of the kill, 12 times the --comm-timeout: a guard against a hang, not a timing; it ends in
# 5-8 s on an idle machine.)
start=$(date +%s)
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --steps 100000 --comm-timeout 5 >"$tmp/kill.out" 2>&1 &
job=$!
sleep 3
victim=$(pgrep -f "ferry train --model opt-tiny --data $tmp/data.bin" | tail -1)
[ -n "$victim" ] && kill -9 "$victim"
wait "$job"; code=$?
elapsed=$(( $(date +%s) - start - 3 ))
if [ "$code" -ne 0 ] && [ "$elapsed" -le 60 ]; then ok "a killed rank ends the job (exit $code after ${elapsed}s)"
else bad "a killed rank: exit $code after ${elapsed}s"; cat "$tmp/kill.out"; fi

# A signal to one rank stops every rank after the same step, with a checkpoint, and the job ends 0
# (the ranks agree on stopping in a collective each step; without it the other rank would wait in
# its next step's collective until --comm-timeout).
"${mpi[@]}" -np 2 "$ferry" train "${common[@]}" --batch 2 --steps 100000 --comm-timeout 20 --save "$tmp/sigrk" \
  --save-every 100000 --log "$tmp/sigrk.jsonl" >"$tmp/sigrk.out" 2>&1 &
job=$!
for _ in $(seq 1 240); do [ -s "$tmp/sigrk.jsonl" ] && break; sleep 0.25; done  # training has started
victim=$(pgrep -f "ferry train --model opt-tiny --data $tmp/data.bin" | grep -vx "$job" | tail -1)
[ -n "$victim" ] && kill -TERM "$victim"
wait "$job"; code=$?
last=$(tail -1 "$tmp/sigrk.jsonl" 2>/dev/null | python3 -c "import json, sys; print(json.load(sys.stdin)['step'])" 2>/dev/null)
saved=$(cat "$tmp/sigrk/latest" 2>/dev/null)
if [ "$code" -eq 0 ] && [ -n "$last" ] && [ "$saved" = "$(printf 'step-%08d' "$last")" ] && [ "$last" -lt 100000 ]; then
  ok "SIGTERM to one rank stops both after step $last, with its checkpoint"
else bad "SIGTERM to one rank: exit $code, last logged step '$last', latest '$saved'"; cat "$tmp/sigrk.out"; fi

echo "ranks: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
