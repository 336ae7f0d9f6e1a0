#!/usr/bin/env bash
# The ferry command line as a user meets it: help, a short run that saves and logs, and bad input
# of every kind named in the issue — each must give a clear message and a non-zero exit, never a
# crash (an exit status above 128 means a signal).
# usage: test/test_cli.sh path/to/ferry                   (the plain run)
#        test/test_cli.sh path/to/ferry --part small-fs   (a --disk-dir and a --save on a 1 MiB tmpfs;
#                                                         exits 77, skipped, where mounting one is
#                                                         not permitted)
#        test/test_cli.sh path/to/ferry --part timing     (SIGINT ends ferry eval within 2 s; meson
#                                                         suite "timing", reported apart by test.sh)
set -u
ferry="$1"
part=""
[ "${2:-}" = --part ] && part="${3:-}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0

# expect CODE DESCRIPTION PATTERN -- ARGS...: runs ferry, checks the exit code and that stderr or
# stdout matches PATTERN.
expect() {
  local want="$1" what="$2" pattern="$3"; shift 4
  local out code
  out="$("$ferry" "$@" 2>&1)"; code=$?
  if [ "$code" -eq "$want" ] && printf '%s' "$out" | grep -qiE -- "$pattern"; then
    pass=$((pass + 1)); printf 'ok    %s\n' "$what"
  else
    fail=$((fail + 1)); printf 'FAIL  %s (exit %d, wanted %d)\n%s\n' "$what" "$code" "$want" "$(printf '%s' "$out" | tail -5)"
  fi
}

# A shard of N tokens below V (python3 is a test dependency; the format is llm.c's).
make_shard() {  # path n vocab [magic]
  python3 - "$@" <<'PY'
import random, struct, sys
path, n, v = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
magic = int(sys.argv[4]) if len(sys.argv) > 4 else 20240520
random.seed(1)
toks = [random.randrange(v) for _ in range(n)]
with open(path, "wb") as f:
    f.write(struct.pack("<256i", magic, 1, n, *([0] * 253)))
    f.write(struct.pack("<%dH" % n, *toks))
PY
}

# started LOG PID: waits until the run PID has logged its first step to LOG (it has started: a
# signal now asks it to stop, where before the run a signal ends the process at once); fails when
# the run ends first. (It waited a fixed 1.5 s, which a loaded machine's sanitizer build can take
# to load the model.)
started() {
  while kill -0 "$2" 2>/dev/null; do
    [ -s "$1" ] && return 0
    sleep 0.1
  done
  return 1
}

# Part small-fs: a --disk-dir whose file system cannot hold the state, and a --save whose file system
# cannot hold a checkpoint, on a 1 MiB tmpfs.
small_fs() {
  local small=(--model opt-demo --device sim --device-mem 64MiB --host-mem 30MiB --batch 4 --seq 32)
  mkdir -p "$tmp/smallfs"
  if ! mount -t tmpfs -o size=1m tmpfs "$tmp/smallfs" 2>"$tmp/mount.err"; then
    echo "skipped: a --disk-dir on a full file system needs a 1 MiB tmpfs, and mounting one is not permitted here: $(cat "$tmp/mount.err")"
    return 77
  fi
  trap 'umount "$tmp/smallfs" 2>/dev/null; rm -rf "$tmp"' EXIT
  expect 1 "a --disk-dir whose file system cannot hold the state" "--disk-dir .*smallfs: the gradients and AdamW state of [0-9]+ of [0-9]+ chunks need .* on disk, and its file system has 1.0 MiB free" \
    -- train "${small[@]}" --data "$tmp/ok.bin" --disk-dir "$tmp/smallfs" --steps 1
  expect 1 "--plan auto with a --disk-dir too small for the state" "fits the disk tier: .*smallfs has" \
    -- train "${small[@]}" --data "$tmp/ok.bin" --disk-dir "$tmp/smallfs" --plan auto --steps 1
  expect 1 "a --save whose file system cannot hold a checkpoint is said at the start" \
    "warning: --save .*smallfs/ck: 1 more checkpoint of .* has 1.0 MiB free" \
    -- train --model opt-demo --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 1 --save "$tmp/smallfs/ck" --save-every 1
  expect 1 "and one for the final weights" "warning: --save .*smallfs/w: the final weights need .* has 1.0 MiB free" \
    -- train --model opt-demo --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 1 --save "$tmp/smallfs/w"
  umount "$tmp/smallfs"
}

# Part timing: SIGINT ends ferry eval at once, within 2 s (the plain run checks how it ends).
eval_sigint_time() {
  make_shard "$tmp/long.bin" 300000 97
  "$ferry" eval --model opt-demo --data "$tmp/long.bin" --batch 16 --seq 128 --batches 140 >/dev/null 2>"$tmp/evalsig.err" &
  local pid=$! code t0 took
  sleep 1.5
  t0=$(date +%s.%N)
  kill -INT "$pid"
  wait "$pid"; code=$?
  took=$(python3 -c "import sys; print('%.1f' % (float(sys.argv[2]) - float(sys.argv[1])))" "$t0" "$(date +%s.%N)")
  if [ "$code" -eq 130 ] && python3 -c "import sys; sys.exit(float(sys.argv[1]) > 2)" "$took"; then
    pass=$((pass + 1)); echo "ok    SIGINT ends ferry eval within 2 s (${took}s)"
  else fail=$((fail + 1)); echo "FAIL  SIGINT to ferry eval: exit $code after ${took}s"; tail -5 "$tmp/evalsig.err"; fi
}

make_shard "$tmp/ok.bin" 5000 97
if [ -n "$part" ]; then
  skip=0
  case "$part" in
    small-fs) small_fs || skip=1 ;;
    timing) eval_sigint_time ;;
    *) echo "test_cli.sh: no part named '$part'"; exit 1 ;;
  esac
  echo "cli --part $part: $pass passed, $fail failed"
  [ "$fail" -eq 0 ] || exit 1
  [ "$skip" -eq 0 ] || exit 77
  exit 0
fi
make_shard "$tmp/magic.bin" 5000 97 12345
make_shard "$tmp/vocab.bin" 5000 200
make_shard "$tmp/small.bin" 20 97
tiny=(--model opt-tiny --data "$tmp/ok.bin" --batch 2 --seq 16)

expect 0 "ferry --help lists the commands" "train" -- --help
expect 0 "ferry train --help lists the flags" "--grad-accum" -- train --help
expect 0 "ferry presets lists opt-175b" "opt-175b" -- presets
expect 2 "an unknown command" "unknown command" -- fly
expect 2 "an unknown flag" "unknown option '--bogus'" -- train --bogus
expect 2 "a flag without its value" "needs a value" -- train --batch
expect 2 "a flag with a bad number" "whole number" -- train --batch two
expect 2 "a negative learning rate" "--lr" -- train --lr -1
expect 2 "a beta of 1 or more" "--beta1 is an AdamW beta, in \[0, 1\): got '1.5'" -- train --beta1 1.5
expect 2 "an AdamW eps of 0 (NaN weights where a gradient is zero)" "--eps must be above 0" -- train --eps 0
expect 2 "a stray argument" "unexpected argument" -- train extra

expect 0 "a short run saves and logs" "saved a Hugging Face checkpoint" -- train "${tiny[@]}" --steps 3 \
  --save "$tmp/ckpt" --log "$tmp/log.jsonl"
lines=$(wc -l < "$tmp/log.jsonl" 2>/dev/null || echo 0)
if [ "$lines" -eq 3 ] && grep -q '"tokens_per_s"' "$tmp/log.jsonl"; then pass=$((pass + 1)); echo "ok    the log has one JSON line per step"
else fail=$((fail + 1)); echo "FAIL  the log has $lines lines"; fi
expect 0 "eval of the saved checkpoint" "eval loss" -- eval --init "$tmp/ckpt" --data "$tmp/ok.bin" --batch 2 --seq 16
expect 0 "eval in bf16 on the cpu" "eval loss" -- eval --init "$tmp/ckpt" --data "$tmp/ok.bin" --batch 2 --seq 16 \
  --precision bf16
cpu_eval="$("$ferry" eval --init "$tmp/ckpt" --data "$tmp/ok.bin" --batch 2 --seq 16 2>/dev/null |
  sed 's/[][().*^$+?{}|\\]/\\&/g')"  # (as a regular expression)
expect 0 "eval offloaded on the sim device: the cpu's loss" "^${cpu_eval:-no eval line}\$" -- eval --init "$tmp/ckpt" \
  --data "$tmp/ok.bin" --batch 2 --seq 16 --device sim --device-mem 2MiB
expect 1 "eval --offload without a GPU device" "--offload is for --device cuda" -- eval --init "$tmp/ckpt" \
  --data "$tmp/ok.bin" --offload
# A Hugging Face directory given as --model (its shape) without --init: its weights are not loaded,
# and the run says so, with the --init that loads them; --init random says it is meant.
expect 0 "eval --model of a directory with weights: random weights, said" \
  "weights beside it \(model.safetensors\) are not loaded.*--init $tmp/ckpt starts" -- eval --model "$tmp/ckpt" \
  --data "$tmp/ok.bin" --batch 2 --seq 16
out="$("$ferry" eval --model "$tmp/ckpt" --init random --data "$tmp/ok.bin" --batch 2 --seq 16 2>&1)"
if printf '%s' "$out" | grep -q "eval loss" && ! printf '%s' "$out" | grep -q "not loaded"; then
  pass=$((pass + 1)); echo "ok    --model with --init random: nothing said"
else fail=$((fail + 1)); printf 'FAIL  --model with --init random\n%s\n' "$out"; fi
expect 2 "eval on an unknown device" "cpu, sim or cuda" -- eval --init "$tmp/ckpt" --data "$tmp/ok.bin" \
  --device tpu
expect 1 "eval --dump on a GPU" "use --device cpu" -- eval --init "$tmp/ckpt" --data "$tmp/ok.bin" --device cuda \
  --dump "$tmp/d.safetensors"

# Configs.
expect 1 "a missing config" "neither a preset nor" -- train --model "$tmp/none" --data "$tmp/ok.bin"
mkdir -p "$tmp/badjson" && printf '{"hidden_size": 32,' > "$tmp/badjson/config.json"
expect 1 "a malformed config.json" "config.json" -- train --model "$tmp/badjson" --data "$tmp/ok.bin"
mkdir -p "$tmp/badheads" && printf '{"model_type":"opt","hidden_size":30,"num_attention_heads":4}' > "$tmp/badheads/config.json"
expect 1 "heads that do not divide hidden_size" "num_attention_heads" -- train --model "$tmp/badheads" --data "$tmp/ok.bin"

# Checkpoints: truncated, lying header, missing tensor.
for kind in truncated lying missing; do
  mkdir -p "$tmp/$kind" && cp "$tmp/ckpt/config.json" "$tmp/$kind/"
done
size=$(stat -c %s "$tmp/ckpt/model.safetensors")
head -c $((size - 100)) "$tmp/ckpt/model.safetensors" > "$tmp/truncated/model.safetensors"
expect 1 "a truncated safetensors file" "safetensors" -- train "${tiny[@]}" --init "$tmp/truncated"
python3 - "$tmp/ckpt/model.safetensors" "$tmp/lying/model.safetensors" "$tmp/missing/model.safetensors" <<'PY'
import json, struct, sys
src, lying, missing = sys.argv[1:]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n]); data = raw[8 + n:]
def write(path, h, d):
    b = json.dumps(h).encode(); b += b" " * (-len(b) % 8)
    open(path, "wb").write(struct.pack("<Q", len(b)) + b + d)
h = json.loads(json.dumps(hdr))
name = next(k for k in h if k != "__metadata__")
h[name]["data_offsets"] = [len(data) - 4, len(data) + 4096]   # past the end of the data
write(lying, h, data)
h = json.loads(json.dumps(hdr)); del h["model.decoder.layers.1.fc1.weight"]
write(missing, h, data)
PY
expect 1 "a header that lies about offsets" "offset|outside|past|beyond" -- train "${tiny[@]}" --init "$tmp/lying"
expect 1 "a checkpoint that lacks a tensor" "no tensor model.decoder.layers.1.fc1.weight" -- train "${tiny[@]}" --init "$tmp/missing"

# Data.
expect 1 "a shard with the wrong magic" "magic" -- train --model opt-tiny --data "$tmp/magic.bin" --batch 2 --seq 16
expect 1 "a token id not below the vocabulary" "vocab" -- train --model opt-tiny --data "$tmp/vocab.bin" --batch 2 --seq 16
expect 1 "a data set smaller than one batch" "token|window" -- train --model opt-tiny --data "$tmp/small.bin" --batch 2 --seq 16
expect 1 "no shards at all" "no .*shard|not found|no such" -- train --model opt-tiny --data "$tmp/nothing/*.bin" --batch 2 --seq 16
expect 0 "without --seq, a model of 64 positions trains on 64" "batch 2 x 64 x 1 accum" -- train --model opt-tiny \
  --data "$tmp/ok.bin" --batch 2 --steps 1
expect 1 "a sequence longer than the model allows" "longer than the model allows" -- train "${tiny[@]:0:4}" --batch 2 --seq 65
expect 1 "a model the memory cannot hold" "needs .* GiB .* but the cpu device has" -- train --model opt-175b --data "$tmp/ok.bin" --batch 1 --seq 16
expect 1 "a batch the memory cannot hold" "needs .* GiB .* activations" -- train --model opt-tiny --data "$tmp/ok.bin" --batch 1000000 --seq 64

# Offloading to the sim device.
expect 0 "training offloaded to a small sim device" "cache blocks" -- train "${tiny[@]}" --steps 2 --device sim \
  --device-mem 4MiB --chunk-mib 0.05 --blocks 2
expect 2 "an unknown device" "--device is cpu, sim or cuda" -- train "${tiny[@]}" --device tpu
expect 2 "a device memory that is not a size" "size such as" -- train "${tiny[@]}" --device sim --device-mem lots
expect 1 "a device memory below the smallest working set" "needs at least" -- train "${tiny[@]}" --device sim \
  --device-mem 64KiB
expect 0 "a disk directory that does not exist is made" "state of 1 chunks on disk" -- train "${tiny[@]}" --steps 1 \
  --device sim --device-mem 4MiB --disk-dir "$tmp/made/for/disk" --disk-chunks 1
expect 1 "a disk directory that cannot be made" "cannot create directory .*Not a directory" -- train "${tiny[@]}" \
  --device sim --device-mem 4MiB --disk-dir "$tmp/ok.bin/disk" --disk-chunks 1
expect 0 "--disk-master puts the disk chunks' master weights on disk" "state of 1 chunks on disk .*master weights there too" \
  -- train "${tiny[@]}" --steps 1 --device sim --device-mem 4MiB --precision bf16 --disk-dir "$tmp/dm" --disk-chunks 1 \
  --disk-master
expect 1 "--disk-master in fp32 is refused with the reason" "--disk-master needs 16-bit compute" -- train "${tiny[@]}" \
  --steps 1 --device sim --device-mem 4MiB --disk-dir "$tmp/dm" --disk-chunks 1 --disk-master

# Checkpoints: stop after 2 of 4 steps, resume in a new process, export.
expect 0 "a run stopped after 2 steps leaves a checkpoint" "stopped after step 2, checkpoint written" -- train \
  "${tiny[@]}" --steps 4 --save "$tmp/ck" --save-every 10 --stop-after 2 --no-shuffle
expect 0 "a new process resumes it" "resuming from .* at step 2" -- train "${tiny[@]}" --steps 4 --resume "$tmp/ck" \
  --save "$tmp/ck" --save-every 10 --no-shuffle
# (a resumed run takes the checkpoint's model; another one named is refused with the reason)
expect 0 "--resume without --model continues the checkpoint's model" "resuming from .* at step 4" -- \
  train --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 5 --resume "$tmp/ck" --no-shuffle
expect 0 "--resume with --steps the checkpoint has done says there is nothing to train" "at step 4 .*nothing to train" -- \
  train --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 3 --resume "$tmp/ck"
expect 0 "ferry eval --init of a checkpoint root reads its latest step" "eval loss" -- \
  eval --init "$tmp/ck" --data "$tmp/ok.bin" --batch 2 --seq 16 --batches 2
expect 0 "ferry train --init of a checkpoint root starts from its weights" "ferry: opt-tiny," -- \
  train --init "$tmp/ck" --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 1
expect 1 "--resume with another --model is refused" "holds another model than --model opt-demo.*leave out --model" -- \
  train --model opt-demo --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 5 --resume "$tmp/ck"
expect 0 "ferry export writes a Hugging Face directory" "exported" -- export "$tmp/ck" "$tmp/hf"
if [ -f "$tmp/hf/config.json" ] && [ -f "$tmp/hf/model.safetensors" ]; then pass=$((pass + 1)); echo "ok    the export has config.json and model.safetensors"
else fail=$((fail + 1)); echo "FAIL  the export lacks config.json or model.safetensors"; fi
# A byte flipped in the middle of a checkpoint's file, which no parser notices: its checksum
# (checksums.xxh128) refuses it in --resume, --init and export, naming the file and the checkpoint
# before it. One written before checksums (none listed, none named in trainer.json) resumes, said.
flip_middle() {  # FILE: the lowest bit of its middle byte
  python3 - "$1" <<'PY'
import os, sys
p = sys.argv[1]; mid = os.path.getsize(p) // 2
with open(p, "r+b") as f:
    f.seek(mid); b = f.read(1); f.seek(mid); f.write(bytes([b[0] ^ 1]))
PY
}
cp -r "$tmp/ck" "$tmp/ckbad" && flip_middle "$tmp/ckbad/step-00000004/model.safetensors"
damaged="ckbad/step-00000004/model.safetensors is damaged.*the previous complete checkpoint, .*ckbad/step-00000002, is intact"
expect 1 "--resume of a checkpoint with a byte flipped in its weights is refused, naming the file and the one before" \
  "$damaged" -- train --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 5 --resume "$tmp/ckbad"
expect 1 "--init of it is refused" "$damaged" -- train --init "$tmp/ckbad" --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 1
expect 1 "ferry export of it is refused" "$damaged" -- export "$tmp/ckbad" "$tmp/hfbad"
expect 0 "the checkpoint the refusal names resumes" "resuming from .* at step 2" -- \
  train --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 3 --resume "$tmp/ckbad/step-00000002"
cp -r "$tmp/ck" "$tmp/ckbad2" && flip_middle "$tmp/ckbad2/step-00000004/optimizer.safetensors"
expect 1 "--resume of a checkpoint with a byte flipped in its AdamW state is refused" \
  "ckbad2/step-00000004/optimizer.safetensors is damaged.*ckbad2/step-00000002, is intact" -- \
  train --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 5 --resume "$tmp/ckbad2"
cp -r "$tmp/ck" "$tmp/ckold" && rm "$tmp/ckold/step-00000004/checksums.xxh128"
expect 1 "a checkpoint whose trainer.json names checksums it lost is refused" "checksums.xxh128 is missing" -- \
  train --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 5 --resume "$tmp/ckold"
python3 -c 'import json, sys; p = sys.argv[1]; o = json.load(open(p)); del o["checksums"]; json.dump(o, open(p, "w"))' \
  "$tmp/ckold/step-00000004/trainer.json"
expect 0 "a checkpoint from before checksums resumes, with a note" "carries no checksums \(written by an older ferry\)" -- \
  train --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 5 --resume "$tmp/ckold"
expect 1 "resuming from a Hugging Face directory says what --init does" "Hugging Face model.*--init" -- \
  train "${tiny[@]}" --resume "$tmp/hf"
expect 1 "exporting a Hugging Face directory says it loads as it is" "transformers loads it as it is" -- export "$tmp/hf" "$tmp/hf2"
expect 1 "resuming from something that is not a checkpoint" "not a ferry checkpoint" -- train "${tiny[@]}" --resume "$tmp"
expect 1 "resuming from a directory that does not exist" "nothing-here: No such file" -- train "${tiny[@]}" --resume "$tmp/nothing-here"
expect 2 "--save-every without a number" "whole number" -- train "${tiny[@]}" --save-every often

# SIGINT: the run finishes its step, writes a checkpoint and exits 0; a second signal exits at once
# and leaves either no checkpoint or one that resumes. SIGHUP (the terminal closed) stops the run
# as SIGINT does; under nohup (SIGHUP ignored) it runs on.
stops_with_checkpoint() {  # SIGNAL DIR: a long run sent SIGNAL once it has started
  "$ferry" train "${tiny[@]}" --steps 1000000 --save "$2" --save-every 1000000 --log "$2.jsonl" --quiet >/dev/null 2>&1 &
  local pid=$! code
  started "$2.jsonl" "$pid"
  kill -"$1" "$pid"
  wait "$pid"; code=$?
  if [ "$code" -eq 0 ] && [ -f "$2/latest" ]; then pass=$((pass + 1)); echo "ok    SIG$1 ends the run with a checkpoint and exit 0"
  else fail=$((fail + 1)); echo "FAIL  SIG$1: exit $code, latest $(cat "$2/latest" 2>&1)"; fi
}
stops_with_checkpoint INT "$tmp/sig"
stops_with_checkpoint HUP "$tmp/hup"
nohup "$ferry" train "${tiny[@]}" --steps 1000000 --save "$tmp/nohup" --save-every 1000000 --log "$tmp/nohup.jsonl" \
  --quiet >/dev/null 2>&1 &
pid=$!
started "$tmp/nohup.jsonl" "$pid"
kill -HUP "$pid"
sleep 1
if kill -0 "$pid" 2>/dev/null; then
  kill -TERM "$pid"; wait "$pid"; code=$?
  if [ "$code" -eq 0 ] && [ -f "$tmp/nohup/latest" ]; then pass=$((pass + 1)); echo "ok    under nohup SIGHUP is ignored (SIGTERM then stops it)"
  else fail=$((fail + 1)); echo "FAIL  under nohup, SIGTERM after SIGHUP: exit $code"; fi
else
  wait "$pid"; fail=$((fail + 1)); echo "FAIL  under nohup SIGHUP ended the run (exit $?)"
fi
# Its output's reader ends (`ferry train | head`, or `| tee` whose terminal closed): the run stops
# after the step with a checkpoint and exit 0 (SIGPIPE would end it without one), saying why.
( "$ferry" train "${tiny[@]}" --steps 1000000 --save "$tmp/pipe" --save-every 1000000 2>"$tmp/pipe.err"; echo $? >"$tmp/pipe.code" ) | head -n 3 >/dev/null
code=$(cat "$tmp/pipe.code")
if [ "$code" -eq 0 ] && [ -f "$tmp/pipe/latest" ] && grep -q "cannot write to standard output" "$tmp/pipe.err"; then
  pass=$((pass + 1)); echo "ok    the reader of its output ends: the run stops with a checkpoint and exit 0"
else fail=$((fail + 1)); echo "FAIL  output reader gone: exit $code, latest $(cat "$tmp/pipe/latest" 2>&1)"; cat "$tmp/pipe.err"; fi
# (a model whose steps take a while, so that the second signal comes before the run is over)
slow=(--model opt-demo --data "$tmp/ok.bin" --batch 16 --seq 128)
# (its stderr is kept, and shown when the check fails. This check once failed in about one run of
# seven in the sanitizer build: the signal handler ran on the stack pointer of a oneDNN GEMM, which
# points into heap memory; the signals are now taken by a thread of ferry's own, runtime/main.c.)
"$ferry" train "${slow[@]}" --steps 1000000 --save "$tmp/sig2" --save-every 1 --log "$tmp/sig2.jsonl" --quiet \
  >/dev/null 2>"$tmp/sig2.err" &
pid=$!
started "$tmp/sig2.jsonl" "$pid"
kill -INT "$pid"; sleep 0.05; kill -INT "$pid"  # apart: two pending SIGINTs merge into one
wait "$pid"; code=$?
resumed=0
if [ -f "$tmp/sig2/latest" ]; then
  "$ferry" train "${slow[@]}" --steps 1000000 --resume "$tmp/sig2" --stop-after 1 --quiet >/dev/null 2>&1 && resumed=1
else
  resumed=1
fi
if [ "$code" -eq 130 ] && [ "$resumed" -eq 1 ]; then pass=$((pass + 1)); echo "ok    a second SIGINT exits at once (130), the checkpoint left resumes"
else fail=$((fail + 1)); echo "FAIL  second SIGINT: exit $code, resumed $resumed"; tail -20 "$tmp/sig2.err"; fi

# ferry eval has nothing to keep: the first SIGINT ends it at once, 130, without "stopping after
# this step" (it said so and went on to the last batch). (How soon: the timing part.)
make_shard "$tmp/long.bin" 300000 97
"$ferry" eval --model opt-demo --data "$tmp/long.bin" --batch 16 --seq 128 --batches 140 >/dev/null 2>"$tmp/evalsig.err" &
pid=$!
sleep 1.5
kill -INT "$pid"
wait "$pid"; code=$?
if [ "$code" -eq 130 ] && ! grep -q "stopping after" "$tmp/evalsig.err"; then
  pass=$((pass + 1)); echo "ok    SIGINT ends ferry eval at once (130)"
else fail=$((fail + 1)); echo "FAIL  SIGINT to ferry eval: exit $code"; tail -5 "$tmp/evalsig.err"; fi

# The planner: probe (cached where FERRY_PROBE says), plan, run a plan, refuse what cannot fit.
export FERRY_PROBE="$tmp/probe.json"
expect 0 "ferry probe measures and caches the machine" "device_gflops" -- probe --device sim --device-mem 64MiB \
  --sim-link-gbps 2
[ -f "$tmp/probe.json" ] && { pass=$((pass + 1)); echo "ok    the probe is cached in FERRY_PROBE"; } || { fail=$((fail + 1)); echo "FAIL  no probe file"; }
# A --disk-dir the cached probe has not timed: timed now and cached, and the plan may use it.
# The cached probe timed the link at 2 GB/s; a plan for another throttle plans for that one.
expect 0 "ferry plan --sim-link-gbps plans for that link, not the cached probe's" "link 0\.5/0\.5 GB/s" -- plan \
  --device sim --device-mem 64MiB --model opt-tiny --batch 4 --seq 32 --sim-link-gbps 0.5
expect 2 "ferry plan --sim-link-gbps that is not a number" "needs a number" -- plan --device sim --sim-link-gbps fast
expect 0 "ferry plan --disk-dir times a disk the cached probe lacks" "predicted: .* s/step" -- plan --device sim \
  --device-mem 64MiB --model opt-tiny --batch 4 --seq 32 --disk-dir "$tmp/plandisk"
if python3 - "$tmp/probe.json" "$(cd "$tmp/plandisk" 2>/dev/null && pwd -P)" <<'PY'; then
import json, sys
p = json.load(open(sys.argv[1]))
sys.exit(0 if p["disk_dir"] == sys.argv[2] and p["disk_read_gbps"] > 0 and p["disk_write_gbps"] > 0 else 1)
PY
  pass=$((pass + 1)); echo "ok    the disk's rates join the cached probe"
else
  fail=$((fail + 1)); echo "FAIL  the cached probe did not gain the disk"; grep disk "$tmp/probe.json"
fi
expect 0 "ferry plan explains a plan and writes it" "predicted: .* s/step" -- plan --device sim --device-mem 64MiB \
  --model opt-tiny --batch 4 --seq 32 --out "$tmp/plan.json" --svg "$tmp/plan.svg"
expect 0 "ferry plan --model of a checkpoint root plans its model" "predicted: .* s/step" -- plan --device sim \
  --device-mem 64MiB --model "$tmp/ck" --batch 4 --seq 32
# A cluster you do not have, and a layout priced on it (docs/planning.md, "Pipelines and clusters").
expect 0 "ferry plan prices a dp x pp x tp layout on a cluster" "2 data-parallel .* x 2 pipeline stages x 2 tensor-parallel" \
  -- plan --device cuda --device-mem 80GiB --device-tflops 312 --model opt-1.3b --batch 8 --seq 2048 --nodes 2 \
  --gpus-per-node 4 --intra-gbps 200 --inter-gbps 25 --dp 2 --pp 2 --tp 2 --out "$tmp/planpp.json"
grep -q '"pp":2' "$tmp/planpp.json" 2>/dev/null && { pass=$((pass + 1)); echo "ok    the plan file keeps pp"; } ||
  { fail=$((fail + 1)); echo "FAIL  the plan file lacks \"pp\":2"; }
expect 2 "ferry plan --gpus that is not --nodes x --gpus-per-node" "--gpus 6 is not --nodes 2 x --gpus-per-node 4 = 8" \
  -- plan --nodes 2 --gpus-per-node 4 --gpus 6
expect 2 "ferry plan --inter-gbps without a cluster" "give --nodes K --gpus-per-node G" -- plan --inter-gbps 10
expect 1 "ferry plan --pp that does not divide the layers" "--pp 5 does not divide the model's 24 decoder layers" \
  -- plan --device cuda --device-mem 80GiB --model opt-1.3b --batch 8 --seq 2048 --nodes 2 --gpus-per-node 5 --pp 5
grep -q "<svg" "$tmp/plan.svg" 2>/dev/null && { pass=$((pass + 1)); echo "ok    the step is drawn as SVG"; } || { fail=$((fail + 1)); echo "FAIL  no SVG"; }
expect 0 "ferry train --plan FILE runs the plan" "cache blocks" -- train --model opt-tiny --data "$tmp/ok.bin" \
  --device-mem 64MiB --plan "$tmp/plan.json" --steps 2
# The plan's sequences and batches are the run's: said when --seq or --batch asks for others, not
# when they are left out.
expect 0 "--plan FILE with another --batch says the plan's are used" "micro-batches of [0-9]+ sequences, [0-9]+ accumulated a step, not --batch 3" \
  -- train --model opt-tiny --data "$tmp/ok.bin" --device-mem 64MiB --plan "$tmp/plan.json" --steps 1 --batch 3
expect 0 "--plan FILE with another --seq says the plan's are used" "for sequences of 32 tokens, not 16" -- train \
  --model opt-tiny --data "$tmp/ok.bin" --device-mem 64MiB --plan "$tmp/plan.json" --steps 1 --seq 16
out="$("$ferry" train --model opt-tiny --data "$tmp/ok.bin" --device-mem 64MiB --plan "$tmp/plan.json" --steps 1 2>&1)"
if [ $? -eq 0 ] && ! printf '%s' "$out" | grep -qE "for sequences of|for micro-batches of"; then
  pass=$((pass + 1)); echo "ok    --plan FILE without --seq or --batch says nothing of them"
else
  fail=$((fail + 1)); printf 'FAIL  --plan FILE without --seq or --batch\n%s\n' "$(printf '%s' "$out" | tail -5)"
fi
# A plan's device updates (and its chunks on the device) are the run's.
python3 -c 'import json, sys; p = json.load(open(sys.argv[1])); p.update(device_chunks=2, device_updates=3); json.dump(p, open(sys.argv[2], "w"))' \
  "$tmp/plan.json" "$tmp/plandu.json"
expect 0 "ferry train --plan FILE runs its device updates" "device updates: 3 host chunks updated by the sim device" \
  -- train --model opt-tiny --data "$tmp/ok.bin" --device-mem 64MiB --plan "$tmp/plandu.json" --steps 2
expect 2 "--device-updates that is not a number" "--device-updates" -- train --model opt-tiny --device-updates many
expect 0 "ferry train --plan auto" "cache blocks" -- train --model opt-tiny --data "$tmp/ok.bin" --device-mem 64MiB \
  --batch 4 --seq 32 --plan auto --steps 2
# --plan auto with too little host memory for the state and a --disk-dir the cached probe has not
# timed: the disk is timed and the plan puts state on it.
expect 0 "--plan auto puts the state the host cannot hold on a new --disk-dir" "AdamW state of [1-9][0-9]* chunks on disk" \
  -- train --model opt-demo --data "$tmp/ok.bin" --device-mem 64MiB --host-mem 30MiB --disk-dir "$tmp/autodisk" \
  --batch 4 --seq 32 --plan auto --steps 2 --log "$tmp/autodisk.jsonl"
grep -q '"disk_tier_mib":[1-9]' "$tmp/autodisk.jsonl" 2>/dev/null && { pass=$((pass + 1)); echo "ok    the log says what the disk tier holds"; } ||
  { fail=$((fail + 1)); echo "FAIL  the log lacks disk_tier_mib"; }
# A disk too small for the state: the planner (its free space, or --disk-space) and the run refuse
# it before the first step, instead of failing at a step's first write.
small=(--model opt-demo --device sim --device-mem 64MiB --host-mem 30MiB --batch 4 --seq 32)
expect 1 "ferry plan with --disk-space too small for the state" "fits the disk tier: .* need at least .* on disk, and .*autodisk has 1.0 MiB" \
  -- plan "${small[@]}" --disk-dir "$tmp/autodisk" --disk-space 1MiB
expect 2 "a --disk-space that is not a size" "size such as" -- plan "${small[@]}" --disk-space lots
expect 0 "ferry probe --disk-space" "disk_space +5.00 GiB" -- probe --device sim --disk-dir "$tmp/autodisk" --disk-space 5GiB
# (A --disk-dir and a --save on a file system too small for them: the part small-fs.)
# A plan is for one precision (the device's default unless --precision): it says so, its file
# keeps it, a run of it computes in it, and another --precision is refused.
expect 0 "ferry plan --precision bf16" "plan for opt-tiny in bf16 on sim .* in bf16" -- plan --device sim \
  --device-mem 64MiB --model opt-tiny --batch 4 --seq 32 --precision bf16 --out "$tmp/plan16.json"
grep -q '"precision":"bf16"' "$tmp/plan16.json" 2>/dev/null && { pass=$((pass + 1)); echo "ok    the plan file says bf16"; } ||
  { fail=$((fail + 1)); echo "FAIL  the plan file lacks \"precision\":\"bf16\""; }
expect 0 "a bf16 plan trains in bf16" 'M parameters, bf16,' -- train --model opt-tiny --data "$tmp/ok.bin" \
  --device-mem 64MiB --plan "$tmp/plan16.json" --steps 1
expect 1 "a bf16 plan with --precision fp32" "is for bf16 compute, not --precision fp32" -- train --model opt-tiny \
  --data "$tmp/ok.bin" --device-mem 64MiB --plan "$tmp/plan16.json" --precision fp32 --steps 1
expect 1 "a default (fp32) plan with --precision bf16" "is for fp32 compute" -- train --model opt-tiny \
  --data "$tmp/ok.bin" --device-mem 64MiB --plan "$tmp/plan.json" --precision bf16 --steps 1
sed '/"precision"/d' "$tmp/plan16.json" > "$tmp/plan_old.json"  # (a plan from before plans named theirs)
expect 0 "a plan without a precision takes --precision" "M parameters, bf16," -- train \
  --model opt-tiny --data "$tmp/ok.bin" --device-mem 64MiB --plan "$tmp/plan_old.json" --precision bf16 --steps 1
expect 0 "--plan auto --precision bf16 plans for bf16" "plan for opt-tiny in bf16" -- train --model opt-tiny \
  --data "$tmp/ok.bin" --device-mem 64MiB --batch 4 --seq 32 --plan auto --precision bf16 --steps 1
expect 0 "a bf16 plan on a processor without bf16 products says so" "multiplies bf16 as fp32" -- plan --device sim \
  --device-mem 64MiB --model opt-tiny --batch 4 --seq 32 --precision bf16 --bf16-speedup 1
expect 0 "an fp32 plan where bf16 products are faster says so" "multiplies bf16 1.7x as fast as fp32" -- plan \
  --device sim --device-mem 64MiB --model opt-tiny --batch 4 --seq 32 --bf16-speedup 1.7
expect 2 "ferry plan --precision fp8" "fp32, bf16 or fp16" -- plan --device sim --model opt-tiny --precision fp8
expect 2 "ferry probe --precision" "ferry plan's" -- probe --precision bf16
expect 1 "fp16 plans are no GPU's" "fp16 runs on cpu and sim" -- plan --device cuda --device-tflops 100 \
  --device-mem 8GiB --model opt-tiny --batch 4 --seq 32 --precision fp16
# ferry plan --resident: the resident run alone, to compare an offloaded plan with (micro-batch and
# recomputation chosen); refused off a GPU, and saying what it needs when the GPU is too small.
expect 0 "ferry plan --resident prices the resident run" "resident: weights.*recompute" -- plan --device cuda \
  --device-tflops 100 --device-mem 40GiB --model opt-1.3b --batch 8 --seq 2048 --resident
expect 1 "ferry plan --resident on a GPU too small" "does not fit resident.*the least it needs" -- plan --device cuda \
  --device-tflops 100 --device-mem 8GiB --model opt-1.3b --batch 8 --seq 2048 --resident
expect 1 "ferry plan --resident off a GPU" "one GPU \\(--device cuda\\)" -- plan --device sim --model opt-tiny \
  --batch 4 --seq 32 --resident
expect 1 "a device too small for any plan" "smallest device memory that works" -- plan --device sim \
  --device-mem 64KiB --model opt-tiny --batch 4 --seq 32
printf '{"micro_batch": 4, "colour": "blue"}' > "$tmp/badplan.json"
# --plan auto with --device cuda measures GPU 0 and trains the plan; without a GPU (or CUDA in this
# build) it says so.
out="$("$ferry" train --model opt-tiny --data "$tmp/ok.bin" --device cuda --plan auto --steps 1 2>&1)"; code=$?
if { [ "$code" -eq 0 ] && printf '%s' "$out" | grep -q "plan for opt-tiny in bf16 on cuda"; } ||
  { [ "$code" -eq 1 ] && printf '%s' "$out" | grep -qE "no GPU|no NVIDIA driver|the NVIDIA driver supports|needs a ferry built with CUDA"; }; then
  pass=$((pass + 1)); echo "ok    --plan auto on cuda (a GPU measured, or none here said so)"
else
  fail=$((fail + 1)); printf 'FAIL  --plan auto on cuda (exit %d)\n%s\n' "$code" "$(printf '%s' "$out" | tail -5)"
fi
expect 1 "a malformed plan file" "unknown key" -- train --model opt-tiny --data "$tmp/ok.bin" --plan "$tmp/badplan.json"
expect 1 "a plan for a bigger device" "cannot run here" -- train --model opt-tiny --data "$tmp/ok.bin" \
  --device-mem 128KiB --plan "$tmp/plan.json" --steps 1
"$ferry" plan --model opt-tiny --batch 4 --seq 32 --gpus 2 --device sim --device-mem 4MiB --out "$tmp/plan2.json" \
  >/dev/null 2>&1
expect 1 "a plan for more ranks than this run" "is for 2 ranks" -- train --model opt-tiny --data "$tmp/ok.bin" \
  --device-mem 4MiB --plan "$tmp/plan2.json" --steps 1
expect 1 "--gpus that no grid fits" "no way to lay 5 ranks out" -- plan --model opt-tiny --batch 3 --seq 32 --gpus 5 \
  --device sim --device-mem 64MiB
# --gpus ranks share this machine's host memory (each is planned with its share), unless --host-mem
# gives a rank's.
half="$(python3 -c '
import json, sys
h = json.load(open(sys.argv[1]))["host_mem"] // 2  # (as fy_format_bytes writes it)
print("%.2f TiB" % (h / 2**40) if h >= 2**40 else "%.2f GiB" % (h / 2**30) if h >= 2**30 else "%.1f MiB" % (h / 2**20))
' "$tmp/probe.json")"
expect 0 "ferry plan --gpus 2 plans each rank with half the host memory" "on sim \(64.0 MiB device, $half host" \
  -- plan --model opt-tiny --batch 4 --seq 32 --gpus 2 --device sim --device-mem 64MiB
expect 0 "ferry plan --gpus 2 --host-mem: a rank's" "on sim \(64.0 MiB device, 3.00 GiB host" \
  -- plan --model opt-tiny --batch 4 --seq 32 --gpus 2 --device sim --device-mem 64MiB --host-mem 3GiB
unset FERRY_PROBE

# Precision, tensor parallelism and offloading: what a run cannot do is refused with the reason.
expect 0 "--precision fp16 trains with dynamic loss scaling" "loss" -- train "${tiny[@]}" --steps 2 --precision fp16
expect 1 "an unknown precision" "fp32, bf16 or fp16" -- train "${tiny[@]}" --steps 1 --precision fp8
expect 0 "bf16 chunks on the sim device" "loss" -- train "${tiny[@]}" --steps 2 --precision bf16 --device sim \
  --device-mem 4MiB
expect 0 "bf16 chunks kept on the device" "loss" -- train "${tiny[@]}" --steps 2 \
  --precision bf16 --device sim --device-mem 4MiB --device-chunks 1
expect 2 "an unknown --schedule" "cosine, linear or constant" -- train "${tiny[@]}" --steps 1 --schedule step
expect 0 "--schedule linear trains" "loss" -- train "${tiny[@]}" --steps 2 --schedule linear
# ferry sample: a model trained on a repeating sequence continues it (greedy); bad requests are refused.
python3 - "$tmp/cycle.bin" <<'PY'
import struct, sys
t = [3, 17, 42, 8, 60] * 2000
open(sys.argv[1], "wb").write(struct.pack("<256i", 20240520, 1, len(t), *([0] * 253)) + struct.pack("<%dH" % len(t), *t))
PY
"$ferry" train --model opt-tiny --data "$tmp/cycle.bin" --batch 4 --seq 16 --steps 60 --lr 1e-2 --quiet --save "$tmp/cycle" \
  >/dev/null 2>&1
expect 0 "ferry sample continues what the model learnt (greedy)" "^3,17,42,8,60,3,17,42,8,60,3,17,42$" -- sample \
  --init "$tmp/cycle" --prompt-ids 3,17,42 --tokens 10 --temperature 0
# ... past a window of 8 (the cache full three times: its newest half runs again from position 0),
# and a prompt longer than the window.
expect 0 "ferry sample past its window (--seq 8)" "^3,17,42,8,60,3,17,42,8,60,3,17,42,8,60,3,17,42,8,60,3,17,42$" -- \
  sample --init "$tmp/cycle" --prompt-ids 3,17,42 --tokens 20 --temperature 0 --seq 8
expect 0 "ferry sample with a prompt longer than its window" "^(3,17,42,8,60,){2}3,17,42,8,60,3,17$" -- \
  sample --init "$tmp/cycle" --prompt-ids 3,17,42,8,60,3,17,42,8,60,3 --tokens 6 --temperature 0 --seq 8
# A prompt longer than the 512 tokens run at once (runs of 512 and 88), with the cycle learnt at
# 640 of 1024 positions; and what --stop and --top-p do.
mkdir -p "$tmp/cycle1kcfg"
python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['max_position_embeddings'] = 1024
json.dump(c, open(sys.argv[2], 'w'))" "$tmp/cycle/config.json" "$tmp/cycle1kcfg/config.json"
"$ferry" train --model "$tmp/cycle1kcfg" --data "$tmp/cycle.bin" --batch 2 --seq 640 --steps 60 --lr 1e-2 --quiet \
  --save "$tmp/cycle1k" >/dev/null 2>&1
long=$(python3 -c "print(','.join(str(x) for x in [3, 17, 42, 8, 60] * 120))")
expect 0 "ferry sample with a prompt run in two parts" "^$long,(3,17,42,8,60,){12}3$" -- \
  sample --init "$tmp/cycle1k" --prompt-ids "$long" --tokens 61 --temperature 0
expect 0 "ferry sample ends at a --stop token" "^3,17,42,8,60$" -- sample --init "$tmp/cycle" --prompt-ids 3,17,42 \
  --tokens 10 --temperature 0 --stop 90,60
expect 0 "ferry sample --top-p 0.01 is greedy" "^3,17,42,8,60,3,17$" -- sample --init "$tmp/cycle" \
  --prompt-ids 3,17,42 --tokens 4 --top-p 0.01 --stop none
expect 2 "ferry sample --top-p 0" "probability in \\(0, 1\\]" -- sample --init "$tmp/cycle" --prompt-ids 3 --top-p 0
expect 2 "ferry sample --top-p 1.5" "probability in \\(0, 1\\]" -- sample --init "$tmp/cycle" --prompt-ids 3 --top-p 1.5
expect 2 "ferry sample with a bad --stop list" "--stop needs comma-separated" -- sample --init "$tmp/cycle" \
  --prompt-ids 3 --stop eos
expect 1 "ferry sample with a --stop token outside the vocabulary" "stop token 500 is outside" -- \
  sample --init "$tmp/cycle" --prompt-ids 3 --stop 500
expect 0 "ferry sample times the prompt and the new tokens" \
  "prompt's 3 tokens and the first new one in [0-9.]+ s \\([0-9.]+ tokens/s\\), 9 more in [0-9.]+ s" -- \
  sample --init "$tmp/cycle" --prompt-ids 3,17,42 --tokens 10 --temperature 0
if "$ferry" sample --init "$tmp/cycle" --prompt-ids 3,17,42 --tokens 10 --quiet 2>&1 | grep -q "tokens/s"; then
  fail=$((fail + 1)); echo "FAIL  ferry sample --quiet still prints its timing"
else pass=$((pass + 1)); echo "ok    ferry sample --quiet prints the tokens alone"; fi
expect 1 "ferry sample --offload on the cpu" "--offload is for --device cuda" -- sample --init "$tmp/cycle" \
  --prompt-ids 3 --offload
expect 1 "ferry sample --blocks without --offload" "are for --offload" -- sample --init "$tmp/cycle" --prompt-ids 3 \
  --blocks 4
expect 1 "ferry sample --device-mem on the cpu" "--device-mem is for --device cuda" -- sample --init "$tmp/cycle" \
  --prompt-ids 3 --device-mem 1GiB
expect 1 "ferry sample with a window longer than the model's" "longer than the model allows" -- \
  sample --init "$tmp/cycle" --prompt-ids 3 --seq 100000
expect 2 "ferry sample without a prompt" "--prompt" -- sample --init "$tmp/cycle"
expect 2 "ferry sample with a bad id list" "comma-separated" -- sample --init "$tmp/cycle" --prompt-ids 3,x
expect 1 "ferry sample with an id outside the vocabulary" "outside the vocabulary" -- sample --init "$tmp/cycle" \
  --prompt-ids 3,500
# Validation while training: printed after the step line; --val-every alone or a missing set is refused.
expect 0 "--val-data validates after the last step" "validation after step 3 \\| loss [0-9.]+ \\| perplexity" -- \
  train "${tiny[@]}" --steps 3 --val-data "$tmp/ok.bin" --val-batches 2
expect 1 "--val-every without --val-data" "--val-every needs --val-data" -- train "${tiny[@]}" --steps 1 --val-every 2
expect 1 "a missing validation set" "--val-data" -- train "${tiny[@]}" --steps 1 --val-data "$tmp/none.bin"
expect 2 "--val-batches 0" "--val-batches" -- train "${tiny[@]}" --steps 1 --val-data "$tmp/ok.bin" --val-batches 0
# Dropout: a probability below 1 or 'config'; a config that asks for dropout is told how to turn it on.
expect 2 "--dropout 1" "probability below 1" -- train "${tiny[@]}" --steps 1 --dropout 1
expect 2 "--dropout that is not a number" "--dropout" -- train "${tiny[@]}" --steps 1 --dropout lots
mkdir -p "$tmp/drop"
cp "$tmp/ckpt/"* "$tmp/drop/"
sed -i 's/"dropout": [0-9.]*/"dropout": 0.1/' "$tmp/drop/config.json"
expect 0 "a config with dropout, no --dropout: says how to turn it on" "--dropout config" -- train --init "$tmp/drop" \
  --data "$tmp/ok.bin" --batch 2 --seq 16 --steps 1
expect 0 "--dropout config trains with the config's" "loss" -- train --init "$tmp/drop" --data "$tmp/ok.bin" --batch 2 \
  --seq 16 --steps 2 --dropout config
expect 1 "--offload without a GPU device" "--offload is for --device cuda" -- train "${tiny[@]}" --steps 1 --offload
expect 1 "--tp with one rank" "does not divide the 1 rank: run a multiple of 2 ranks" -- train "${tiny[@]}" --steps 1 --tp 2
expect 2 "--tp 0" "--tp" -- train "${tiny[@]}" --steps 1 --tp 0

# tools/tokenize.py on JSON Lines (--jsonl KEY): each line's KEY string is one document, the end
# of text between documents (an empty one too); a line that is not an object with that string is
# an error naming the file and line.
tokpy="$(dirname "$0")/../tools/tokenize.py"
printf '{"text": "h\\u00e9llo", "id": 1}\n\n{"text": ""}\n{"id": 3, "text": "w\\u00f6rld"}\n' > "$tmp/docs.jsonl"
if python3 "$tokpy" --tokenizer bytes --jsonl text --out "$tmp/jl/d" "$tmp/docs.jsonl" >/dev/null &&
   python3 -c "import struct, sys; b = open(sys.argv[1], 'rb').read(); n = struct.unpack('<3i', b[:12])[2]; \
     t = list(struct.unpack('<%dH' % n, b[1024:])); \
     sys.exit(t != list('h\u00e9llo'.encode()) + [256, 256] + list('w\u00f6rld'.encode()))" "$tmp/jl/d_000000.bin"; then
  pass=$((pass + 1)); echo "ok    tokenize.py --jsonl: one document per line"
else fail=$((fail + 1)); echo "FAIL  tokenize.py --jsonl"; fi
printf '{"text": "a"}\n{"text": 5}\n' > "$tmp/bad.jsonl"
if python3 "$tokpy" --tokenizer bytes --jsonl text --out "$tmp/jl/e" "$tmp/bad.jsonl" >"$tmp/jl.out" 2>&1; then
  fail=$((fail + 1)); echo "FAIL  tokenize.py --jsonl accepted a line without the text"
elif grep -q 'bad.jsonl:2: the object has no string "text"' "$tmp/jl.out"; then
  pass=$((pass + 1)); echo "ok    tokenize.py --jsonl names the bad line"
else fail=$((fail + 1)); echo "FAIL  tokenize.py --jsonl: unclear message"; cat "$tmp/jl.out"; fi

# Prompts and responses (--jsonl KEY --prompt PKEY): a record is prompt, response, end of text, and
# the loss mask beside the shard is 0 on the prompt's tokens, 1 on the rest; ferry trains on it
# (the mask's zeros are targets it ignores); --prompt without --jsonl is refused; a shard cut in
# two cuts its mask at the same token.
printf '{"q": "ab", "a": "C"}\n{"q": "", "a": "DE"}\n{"a": "F", "q": "g"}\n' > "$tmp/sft.jsonl"
if python3 "$tokpy" --tokenizer bytes --jsonl a --prompt q --out "$tmp/sft/s" "$tmp/sft.jsonl" >/dev/null &&
   python3 -c "import struct, sys; b = open(sys.argv[1] + '.bin', 'rb').read(); m = open(sys.argv[1] + '.mask', 'rb').read(); \
     h = struct.unpack('<3i', m[:12]); n = struct.unpack('<3i', b[:12])[2]; t = list(struct.unpack('<%dH' % n, b[1024:])); \
     sys.exit(not (t == list(b'abC') + [256] + list(b'DE') + [256] + list(b'gF') + [256] and h == (20241201, 1, n) \
                   and list(m[1024:]) == [0, 0, 1, 1, 1, 1, 1, 0, 1, 1]))" "$tmp/sft/s_000000" &&
   python3 "$tokpy" --tokenizer bytes --jsonl a --prompt q --shard-tokens 4 --out "$tmp/sft4/s" "$tmp/sft.jsonl" >/dev/null &&
   python3 -c "import sys; sys.exit(open(sys.argv[1], 'rb').read()[1024:] != bytes([1, 1, 1, 0]))" "$tmp/sft4/s_000001.mask"; then
  pass=$((pass + 1)); echo "ok    tokenize.py --prompt: records and their loss masks"
else fail=$((fail + 1)); echo "FAIL  tokenize.py --prompt"; fi
if python3 "$tokpy" --tokenizer bytes --prompt q --out "$tmp/sft/x" "$tmp/sft.jsonl" >"$tmp/sftbad.out" 2>&1; then
  fail=$((fail + 1)); echo "FAIL  tokenize.py --prompt without --jsonl accepted"
elif grep -q -- "--prompt needs --jsonl" "$tmp/sftbad.out"; then pass=$((pass + 1)); echo "ok    tokenize.py --prompt needs --jsonl"
else fail=$((fail + 1)); echo "FAIL  tokenize.py --prompt without --jsonl: unclear"; cat "$tmp/sftbad.out"; fi
python3 - "$tmp/sftbig.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(300):
        f.write(json.dumps({"q": "what is %d plus %d? " % (i, i), "a": "%d." % (2 * i)}) + "\n")
PY
python3 "$tokpy" --tokenizer bytes --jsonl a --prompt q --out "$tmp/sftbig/s" "$tmp/sftbig.jsonl" >/dev/null
expect 0 "ferry trains on prompt/response shards with their loss masks" "loss" -- train --model opt-demo \
  --data "$tmp/sftbig" --batch 2 --seq 32 --steps 3
# Batches of prompt alone: evaluation says no target counts (rather than a bare nan).
printf '{"q": "%s", "a": "y"}\n' "$(printf 'x%.0s' $(seq 60))" > "$tmp/sftlong.jsonl"
python3 "$tokpy" --tokenizer bytes --jsonl a --prompt q --out "$tmp/sftlong/s" "$tmp/sftlong.jsonl" >/dev/null
expect 0 "eval of batches without a target that counts" "every target of the 1 batches of 1 x 16 is ignored" -- \
  eval --model opt-demo --data "$tmp/sftlong" --batch 1 --seq 16 --batches 1

# A tokenizer of more than 65536 tokens: tools/tokenize.py writes llm.c's wide shards (uint32) and
# a model with that vocabulary trains on them (its first loss is about ln(vocab)). Needs the
# tokenizers and transformers packages (test.sh's reference tools); without them it is left out.
if python3 -c "import tokenizers, transformers" 2>/dev/null; then
  python3 - "$tmp/bigtok" <<'PY'
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
words = {"<eos>": 0, "<unk>": 1}
words.update(("w%d" % i, 70000 - 1 - i) for i in range(69998))  # w0 is the largest id
tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(sys.argv[1])
PY
  python3 -c "import random; random.seed(2); print(' '.join('w%d' % random.randrange(300) for _ in range(3000)))" \
    > "$tmp/words.txt"
  if python3 "$(dirname "$0")/../tools/tokenize.py" --tokenizer "$tmp/bigtok" --out "$tmp/wide/w" "$tmp/words.txt" \
      >/dev/null && python3 -c "import struct, sys; h = struct.unpack('<3i', open(sys.argv[1], 'rb').read(12)); \
      sys.exit(h[:2] != (20240801, 7))" "$tmp/wide/w_000000.bin"; then
    pass=$((pass + 1)); echo "ok    tokenize.py writes uint32 shards for a vocabulary over 65536"
  else fail=$((fail + 1)); echo "FAIL  tokenize.py with a vocabulary over 65536"; fi
  # JSON Lines through a Hugging Face tokenizer: the ids of the same documents as text files.
  printf 'w1 w2 w3\nw4' > "$tmp/d1.txt"; printf 'w299 w0' > "$tmp/d2.txt"
  printf '{"t": "w1 w2 w3\\nw4"}\n{"t": "w299 w0"}\n' > "$tmp/d.jsonl"
  if python3 "$tokpy" --tokenizer "$tmp/bigtok" --out "$tmp/ft/a" "$tmp/d1.txt" "$tmp/d2.txt" >/dev/null &&
     python3 "$tokpy" --tokenizer "$tmp/bigtok" --jsonl t --out "$tmp/fj/a" "$tmp/d.jsonl" >/dev/null &&
     cmp -s "$tmp/ft/a_000000.bin" "$tmp/fj/a_000000.bin"; then
    pass=$((pass + 1)); echo "ok    tokenize.py --jsonl with a Hugging Face tokenizer: the text files' ids"
  else fail=$((fail + 1)); echo "FAIL  tokenize.py --jsonl with a Hugging Face tokenizer"; fi
  mkdir -p "$tmp/m70k"
  printf '{"model_type": "opt", "vocab_size": 70000, "hidden_size": 32, "num_attention_heads": 2, "ffn_dim": 64,
    "num_hidden_layers": 1, "max_position_embeddings": 64, "word_embed_proj_dim": 32}' > "$tmp/m70k/config.json"
  expect 0 "a 70000-token vocabulary trains on wide shards" "step +1/2 \| loss 11\.1" -- train --model "$tmp/m70k" \
    --data "$tmp/wide" --batch 2 --seq 32 --steps 2 --save "$tmp/m70k_saved"
  # tools/sample.py: the prompt through the tokenizer, ferry sample on ids, the output decoded.
  if out=$(python3 "$(dirname "$0")/../tools/sample.py" --tokenizer "$tmp/bigtok" --init "$tmp/m70k_saved" \
             --ferry "$ferry" --tokens 3 --temperature 0 "w1 w2" 2>&1) &&
     printf '%s' "$out" | grep -qE '^w1 w2( \S+){3}$'; then
    pass=$((pass + 1)); echo "ok    tools/sample.py: text in, text out ($out)"
  else fail=$((fail + 1)); echo "FAIL  tools/sample.py: $out"; fi
else
  echo "--    tokenize.py's wide shards: left out (no tokenizers/transformers)"
fi

echo "cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
