#!/usr/bin/env bash
# Installs what is missing, builds ferry, and runs every test: the unit, integration and reference
# tests (meson test), the CUDA backend on the CPU emulator (test/cudaemu), the same tests again
# under AddressSanitizer and UndefinedBehaviorSanitizer, and the
# transformers round trip of a saved checkpoint, the OPT variants that the fixtures do not cover,
# random configurations trained along random paths, bf16 training against PyTorch's, and
# tools/convert.py (with torch and transformers, which it installs in the project's virtual
# environment, ~/.cache/ferry/venv, when missing), and, with the sanitizers, ferry train with random options and the
# fuzz targets for 6 s each (skipped without clang's libFuzzer).
# The checks that hold this machine to rates and times (meson suite "timing": the planner's
# predicted steps, the probe's rates, prefetch overlap, the sim link's copies) run with --timing,
# alone after the release build's suite, and are reported on a line of their own, "timing: N
# passed, N failed": a loaded machine can fail them, so they are not in the count.
# Ends with one line: "N passed, N failed[, N skipped]".
#
# usage: ./test.sh [--no-sanitize] [--sanitize-only] [--timing]
set -uo pipefail
cd "$(dirname "$0")"
. tools/bootstrap.sh

sanitize=1 plain=1 timing=0
for a in "$@"; do
  case "$a" in
    --timing) timing=1 ;;
    --no-sanitize) sanitize=0 ;;
    --sanitize-only) plain=0 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

fy_install_deps || { echo "0 passed, 1 failed"; exit 1; }
fy_demo_data || { echo "0 passed, 1 failed"; exit 1; }
passed=0 failed=0 skipped=0
timing_ran=0 timing_passed=0 timing_failed=0 timing_failures=""

# meson_results DIR: the last meson test run in DIR as "PASSED FAILED SKIPPED FAILED_NAMES" (the
# names comma-separated, "-" when none), from meson's log (meson counts exit 77 as skipped). A run
# that left no log (meson could not start: it is removed before each run) is one failure.
meson_results() {
  python3 - "$1/meson-logs/testlog.json" <<'PY'
import json, os, sys
p = f = s = 0
bad = []
if not os.path.exists(sys.argv[1]):
    print(0, 1, 0, "meson-test-did-not-run")
    sys.exit()
for line in open(sys.argv[1]):
    t = json.loads(line)
    r = t.get("result")
    if r in ("OK", "EXPECTEDFAIL"): p += 1
    elif r == "SKIP": s += 1
    else: f += 1; bad.append(t.get("name", "?"))
print(p, f, s, ",".join(bad) or "-")
PY
}

# run_suite DIR LABEL [ARG...]: meson's tests in build dir DIR (those named, or all, less the
# timing suite), their results added to the counts. Three at a time (the slowest ones wait on
# processes most of the time), but for those that wait on timeouts, which run alone, last
# (test/meson.build).
run_suite() {
  local dir="$1" label="$2" p f s names
  shift 2
  section "$label: meson test in $dir${1:+ ($*)}"
  rm -f "$dir/meson-logs/testlog.json"
  meson test -C "$dir" --print-errorlogs --num-processes 3 --timeout-multiplier 3 "$@" >"$dir.test.log" 2>&1
  tail -n 12 "$dir.test.log"
  read -r p f s names < <(meson_results "$dir")
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
  [ "$f" -eq 0 ] || grep -E "^(FAIL|  expected)|error" "$dir.test.log" | head -40
}

# run_timing DIR: meson's suite "timing" in DIR (test/meson.build), one test at a time, counted
# apart from the rest: a loaded machine can fail what it holds. Its failures are listed here and
# named on the timing line at the end.
run_timing() {
  local dir="$1" p f s names
  section "timing (reported apart, not counted): meson test in $dir --suite timing"
  rm -f "$dir/meson-logs/testlog.json"
  meson test -C "$dir" --suite timing --print-errorlogs --num-processes 1 --timeout-multiplier 3 >"$dir.timing.log" 2>&1
  tail -n 8 "$dir.timing.log"
  read -r p f s names < <(meson_results "$dir")
  timing_ran=1
  timing_passed=$((timing_passed + p)); timing_failed=$((timing_failed + f))
  if [ "$f" -ne 0 ]; then
    timing_failures="${timing_failures:+$timing_failures,}$names"
    grep -E "^FAIL" "$dir.timing.log" | head -40
  fi
}

# section TITLE: a section's heading, with the minutes and seconds since test.sh started (the
# differences show where CI's time goes).
section() { printf '== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

# count CMD...: runs CMD and counts it as passed or failed.
count() { if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi; }
# count_logged LOG CMD...: the same with CMD's output in LOG; its last line is shown when it
# passes, and when not the lines that say what went wrong (those that are not a passing case's).
count_logged() {
  local log="$1"
  shift
  if "$@" >"$log" 2>&1; then
    passed=$((passed + 1)); tail -n 1 "$log"
  else
    failed=$((failed + 1)); grep -v '^{"variant"' "$log" | head -40
  fi
}

# torch and transformers for the reference checks, in the project's virtual environment
# (tools/bootstrap.sh); without them (no network) those checks are counted as skipped.
have_refs=0
if [ "$plain" = 1 ]; then
  section "the reference checks' Python: torch, transformers, safetensors, numpy"
  fy_reference_python && have_refs=1
fi

if [ "$plain" = 1 ]; then
  if fy_build build; then
    run_suite build "release build" --no-suite timing
    [ "$timing" = 1 ] && run_timing build
    # A checkpoint ferry saves loads in transformers and gives ferry's logits.
    if [ "$have_refs" = 1 ]; then
      section "transformers loads a ferry checkpoint"
      count test/reference/check_export.sh build/ferry
      # Configurations the fixtures do not cover (no biases, no affine norms, untied lm_head, ...),
      # trained by ferry and by transformers side by side.
      section "OPT variants: ferry and transformers train them alike"
      count python3 test/reference/check_variants.py build/ferry
      # Random configurations, each trained along a random path (ranks, accumulation, offload, resume).
      section "random OPT configurations along random paths: ferry and transformers train them alike"
      count_logged build/random_variants.log python3 test/reference/check_variants.py build/ferry --random 24 --seed 1
      # The same random cases on the cpu and on a random sim placement, fp32, bf16 or fp16: bit for bit.
      section "random OPT configurations: the sim device's placements give the cpu's bits"
      count_logged build/placements.log python3 test/reference/check_variants.py build/ferry --placements 30 --seed 1
      # A mixture of experts (issue 37), trained by ferry and by a PyTorch mixture written in the script.
      section "mixture of experts: ferry and a PyTorch reference train it alike"
      count python3 test/reference/check_moe.py build/ferry
      # ferry's bf16 on the cpu against PyTorch in bf16 with fp32 master weights (transformers' OPT).
      section "bf16: ferry's training and PyTorch's agree within bf16's rounding, and the loss falls"
      count python3 test/reference/check_bf16.py build/ferry
      # A model saved as PyTorch pickles, converted by tools/convert.py, gives ferry the same loss.
      section "tools/convert.py: PyTorch pickles to safetensors"
      count test/reference/check_convert.sh build/ferry
    else
      section "skipped: the transformers round trip, the OPT variants, the random configurations, the bf16 check, the mixture of experts and tools/convert.py (no torch and transformers: see above)"
      skipped=$((skipped + 7))
    fi
    # Every plan ferry plan writes trains, in the device and host memory it says (random machines,
    # models, batches, memory, precisions and ranks on the sim device).
    section "random plans on the sim device: each trains in the memory it predicts (test/plan_random.py)"
    count_logged build/plan_random.log python3 test/plan_random.py build/ferry 20 1
  else
    failed=$((failed + 1))
  fi
fi

# The CUDA backend's own code on the CUDA emulator (test/cudaemu/README.md; needs the toolkit's
# headers, not a GPU): the op test against the CPU, the transformers reference on --device cuda,
# training on the emulated GPU against the CPU (fp32, bf16, accumulation, resume, offloaded,
# chunks kept on the GPU, dropout), the GPUs it refuses (test/cuda_compat.sh), the nccl
# communicator and training on several emulated GPUs
# (mpirun, the emulator's NCCL) against one, random plans trained in the memory they predict, and
# random configurations trained on it against transformers.
if [ "$plain" = 1 ]; then
  if [ ! -f /usr/local/cuda/include/cublasLt.h ] && [ ! -f /usr/include/cublasLt.h ]; then
    section "skipped: the CUDA emulator (no CUDA toolkit headers)"
    skipped=$((skipped + 12))
  elif fy_build build-emu -Dcuda=disabled -Demulate_cuda=true; then
    run_suite build-emu "CUDA emulator" backend_ops reference_cuda cuda_train_moe comm_nccl comm_nccl_2_ranks comm_nccl_3_ranks \
      bench_gpu_gemm bench_gpu_attention
    section "training on the emulated GPU against the CPU (test/cuda_train.sh)"
    count_logged build-emu/cuda_train.log test/cuda_train.sh build-emu/ferry build-emu/cuda_train \
      --model test/cudaemu/opt-tiny --batch 4 --seq 32 --offload-mem 40MiB --blocks 3
    section "which GPUs: too old, no code in the build, too little shared memory (test/cuda_compat.sh)"
    count_logged build-emu/cuda_compat.log test/cuda_compat.sh build-emu/ferry build-emu/cuda_compat
    section "training on 2, 3 and 4 emulated GPUs against 1 (test/cuda_ranks.sh)"
    if command -v mpirun >/dev/null 2>&1; then
      # (FY_EMU_JITTER_US: streams wait up to 200 us before each job, so they interleave in more ways)
      FY_EMU_JITTER_US=200 FY_EMU_GPUS=4 count_logged build-emu/cuda_ranks.log test/cuda_ranks.sh build-emu/ferry build-emu/cuda_ranks \
        --model test/cudaemu/opt-tiny --seq 32 --offload-mem 40MiB --gpus 4
    else
      echo "skipped: no mpirun"
      skipped=$((skipped + 1))
    fi
    section "random plans on 1 to 4 emulated GPUs, resident and offloaded: each trains in the memory it predicts"
    FY_EMU_GPUS=4 count_logged build-emu/plan_random.log python3 test/plan_random.py build-emu/ferry 16 1 --gpu
    if [ "$have_refs" = 1 ]; then
      section "random OPT configurations trained on 1 to 4 emulated GPUs: ferry and transformers train them alike"
      FY_EMU_GPUS=4 count_logged build-emu/random_variants.log python3 test/reference/check_variants.py build-emu/ferry \
        --random 10 --seed 1 --gpu --gpus 4
    else
      section "skipped: random configurations on the emulated GPU (no torch and transformers: see above)"
      skipped=$((skipped + 1))
    fi
  else
    failed=$((failed + 1))
  fi
fi

if [ "$sanitize" = 1 ]; then
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  export LSAN_OPTIONS="suppressions=$PWD/test/lsan.supp"
  # Sanitizers instrument host code; the CUDA kernels (which nvcc builds) stay out of this build.
  if fy_build build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized -Dcuda=disabled; then
    # (the slowest test, the layouts against one rank, runs once: in the release build)
    run_suite build-asan "AddressSanitizer + UndefinedBehaviorSanitizer" --no-suite release_only
  else
    failed=$((failed + 1))
  fi
  # ferry train with random option sets, valid and not, under the sanitizers: each run ends by
  # itself, with 0, 1 or 2 and a message, and without a report.
  section "ferry train and eval with random options (test/cli_random.py, AddressSanitizer build)"
  mkdir -p build-asan
  count_logged build-asan/cli_random.log python3 test/cli_random.py build-asan/ferry 100 1
  # The parsers of untrusted files under libFuzzer, 6 s each (test/fuzz/README.md).
  section "fuzz targets (test/fuzz/run.sh 6)"
  test/fuzz/run.sh 6
  case $? in
    0) passed=$((passed + 1)) ;;
    77) skipped=$((skipped + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
fi

section "done"
if [ "$timing_ran" = 1 ]; then
  echo "timing: $timing_passed passed, $timing_failed failed${timing_failures:+ ($timing_failures)} (not in the count below)"
fi
if [ "$skipped" -gt 0 ]; then
  echo "$passed passed, $failed failed, $skipped skipped"
else
  echo "$passed passed, $failed failed"
fi
[ "$failed" -eq 0 ]
