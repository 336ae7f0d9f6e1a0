#!/usr/bin/env bash
# bench/gpu/check.sh: on a fresh GPU machine that has nvcc, PyTorch and transformers but none of
# ferry's Debian packages (and where nothing can be installed), builds ferry with CUDA, runs the op
# tests and the training reference tests on the GPU, and benchmarks, inside a time budget (8
# minutes), printing a short table last.
#
# The Debian packages come along as .deb files (bench/gpu/fetch_debs.sh downloads them beforehand
# on a machine with network) and are unpacked with `dpkg -x` into a prefix; their pkg-config files
# are pointed at the prefix, and PKG_CONFIG_PATH, CPATH, LIBRARY_PATH and LD_LIBRARY_PATH lead
# meson, the compilers and the programs there. Each step runs under `timeout` with what is left of
# the budget, so a hung step costs its share and the table still prints.
#
# What the steps took on an H200 (December 2026, 16 cores): unpacking 3 s, configure and build for
# sm_90 30-42 s, op tests 4, reference tests 3, gpu training 27, ferry 1.3B 10, PyTorch 1.3B 28-39,
# attention and GEMM benches 3, ferry 1.3B with each set of attention kernels 70, offloaded 6.7B in
# fp32 246, the largest at 40 GiB 80. Everything does not fit one 8-minute budget: a second call
# on the still-warm machine runs the rest (--steps). Issue 35's figures, most wanted first:
# --steps 'bench offload 6.7b bf16 40 GiB exact 8bit,bench offload 13b bf16 40 GiB' (4 OPT-6.7B
# runs and 1 OPT-13B run; a 6.7B run took ~60 s to start before its steps on the H200, so about 7
# minutes), then 'bench offload 6.7b bf16 40 GiB' (fp32 state and the lag, 6 runs) and 'bench
# offload 6.7b bf16 40 GiB exact 8bit no clip' (4 runs).
#
# usage: bench/gpu/check.sh [--dry-run] [--build-only] [--no-bench] [--no-big] [--debs DIR] [--prefix DIR]
#                           [--build DIR] [--budget SECONDS] [--jobs N] [--logs DIR] [--steps LIST]
#                           [--pair-runs N]
#   --dry-run     resolve the arguments, nvcc, meson and the .deb files, print the plan, run nothing
#   --build-only  unpack and build, no tests and no benchmarks (for a machine without a GPU)
#   --no-big      without the OPT-6.7B runs (offloaded against resident in fp32, ~4 minutes on an H200,
#                 and in bf16; ~110 GiB of host memory; bf16 chunks at a 40 GiB cap, the largest
#                 preset that fits that host)
#   --steps LIST  only the steps named (comma-separated; shell patterns: 'bench offload*'), besides
#                 configure and build (quick when the build is there): a second call on a machine
#                 still warm runs what the first had no time for
#   --pair-runs N ferry's and PyTorch's 1.3B runs alternate, N of each (default 3)
# Exit status: 0 when every step that ran passed (skips allowed), 1 otherwise, 2 for bad usage.
set -uo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root" || exit 2

dry=0 build_only=0 bench=1 big=1 budget=480 steps="" pair_runs=3
debs="bench/gpu/debs" prefix="${TMPDIR:-/tmp}/ferry-prefix" build="build-gpu" logs=""
jobs="$(nproc 2>/dev/null || echo 4)"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --build-only) build_only=1 ;;
    --no-bench) bench=0 ;;
    --no-big) big=0 ;;
    --debs|--prefix|--build|--budget|--jobs|--logs|--steps|--pair-runs)
      [ $# -ge 2 ] || { echo "check.sh: $1 needs a value" >&2; exit 2; }
      case "$1" in
        --debs) debs="$2" ;;
        --prefix) prefix="$2" ;;
        --build) build="$2" ;;
        --budget) budget="$2" ;;
        --jobs) jobs="$2" ;;
        --logs) logs="$2" ;;
        --steps) steps="$2" ;;
        --pair-runs) pair_runs="$2" ;;
      esac
      shift ;;
    -h|--help) sed -n '2,/^# Exit status/p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
  shift
done
case "$pair_runs" in ''|*[!0-9]*|0) echo "check.sh: --pair-runs is a positive integer" >&2; exit 2 ;; esac
case "$budget" in ''|*[!0-9]*) echo "check.sh: --budget takes whole seconds" >&2; exit 2 ;; esac
case "$jobs" in ''|*[!0-9]*) echo "check.sh: --jobs takes a number" >&2; exit 2 ;; esac
case "$prefix" in /*) ;; *) prefix="$root/$prefix" ;; esac
[ -n "$logs" ] || logs="$build-logs"
case "$logs" in /*) ;; *) logs="$root/$logs" ;; esac

t0=$SECONDS
rows=()  # "step|result|seconds|detail", printed as the closing table
failed=0
row() {  # (a row of a step that --steps did not select is left out)
  case "$1" in nvcc|debs|meson|"demo data") ;; *) selected "$1" || return 0 ;; esac
  rows+=("$1|$2|$3|$4")
}
left() { echo $((budget - (SECONDS - t0))); }
say() { echo "== $*"; }

# Whether --steps selects step NAME (configure and build always run).
selected() {
  if [ -z "$steps" ] || [ "$1" = configure ] || [ "$1" = build ]; then return 0; fi
  local p
  IFS=',' read -ra pats <<<"$steps"
  for p in "${pats[@]}"; do
    p="${p#"${p%%[![:space:]]*}"}"
    # shellcheck disable=SC2053
    [[ "$1" == $p ]] && return 0
  done
  return 1
}

# run_step NAME LIMIT DETAIL CMD...: runs CMD with stdout and stderr in $logs/NAME.log under
# timeout min(LIMIT, time left - 15 s kept for the table); exit 77 is a skip, 124 a timeout, 78
# a step --steps did not select (no row).
run_step() {
  local name="$1" limit="$2" detail="$3"
  shift 3
  selected "$name" || return 78
  local log="$logs/${name// /_}.log"
  local l; l=$(($(left) - 15))
  [ "$limit" -gt "$l" ] && limit=$l
  if [ "$dry" = 1 ]; then
    echo "plan: [$name, at most ${limit}s] $*"
    return 0
  fi
  if [ "$limit" -le 5 ]; then
    row "$name" "skipped" 0 "no time left in the ${budget}s budget"
    return 1
  fi
  say "$name (at most ${limit}s): $*"
  local s=$SECONDS rc
  if declare -F "$1" >/dev/null; then
    # timeout runs programs, not shell functions: the function goes to a fresh bash with the
    # variables it reads.
    timeout --kill-after=5 "$limit" bash -c \
      "$(declare -p meson_cmd build logs root pair_runs); $(declare -f); \"\$@\"" _ "$@" >"$log" 2>&1
  else
    timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
  fi
  rc=$?
  local d=$((SECONDS - s))
  case $rc in
    0) row "$name" "ok" "$d" "$detail" ;;
    77) row "$name" "skipped" "$d" "$detail (exit 77)" ;;
    124|137) row "$name" "TIMEOUT" "$d" "$detail (log: $log)"; failed=1 ;;
    *) row "$name" "FAIL" "$d" "$detail (exit $rc, log: $log)"; failed=1 ;;
  esac
  if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then tail -n 25 "$log" | sed 's/^/   | /'; fi
  return $rc
}

table() {
  local gpu="(none seen)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  fi
  echo
  echo "ferry GPU check: $gpu; $((SECONDS - t0)) s of a ${budget} s budget"
  printf '%-24s %-8s %7s  %s\n' "step" "result" "seconds" "detail"
  local r
  for r in "${rows[@]}"; do
    IFS='|' read -r n res sec det <<<"$r"
    printf '%-24s %-8s %7s  %s\n' "$n" "$res" "$sec" "$det"
  done
}

# ---- 1. nvcc and the CUDA libraries ----

find_nvcc() {
  local c
  for c in "${NVCC:-}" "$(command -v nvcc 2>/dev/null)" /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc \
           /opt/cuda/bin/nvcc; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}
if nvcc="$(find_nvcc)"; then
  cuda_home="$(cd "$(dirname "$nvcc")/.." && pwd)"
  nvcc_ver="$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  export PATH="$cuda_home/bin:$PATH" CUDA_PATH="$cuda_home" CUDA_HOME="$cuda_home"
  cuda_libs="$cuda_home/lib64"
  # cuBLASLt may live in a pip wheel (nvidia-cublas) next to PyTorch rather than in the toolkit.
  if [ ! -e "$cuda_libs/libcublasLt.so" ]; then
    w="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)"
    [ -n "$w" ] && [ -d "$w" ] && cuda_libs="$cuda_libs:$w"
  fi
  export LIBRARY_PATH="$cuda_libs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  row "nvcc" "ok" 0 "$nvcc (CUDA ${nvcc_ver:-?})"
else
  row "nvcc" "FAIL" 0 "not found: set NVCC or put nvcc on PATH"
  failed=1
  if [ "$dry" = 0 ]; then table; exit 1; fi
fi

# ---- 2. the Debian packages, unpacked into the prefix ----

shopt -s nullglob
deb_files=("$debs"/*.deb)
shopt -u nullglob
unpack_debs() {
  mkdir -p "$prefix"
  local d
  for d in "${deb_files[@]}"; do
    if command -v dpkg >/dev/null 2>&1; then
      dpkg -x "$d" "$prefix" || return 1
    else  # a .deb is an ar archive holding data.tar.*
      local tmp; tmp="$(mktemp -d)"
      (cd "$tmp" && ar x "$root/$d" 2>/dev/null || ar x "$d") || { rm -rf "$tmp"; return 1; }
      tar -xf "$tmp"/data.tar.* -C "$prefix" || { rm -rf "$tmp"; return 1; }
      rm -rf "$tmp"
    fi
  done
  # pkg-config files name /usr: point them at the prefix.
  find "$prefix" -name '*.pc' -path '*pkgconfig*' -print0 | xargs -0 -r sed -i \
    -e "s|=/usr|=$prefix/usr|g" -e "s| -I/usr| -I$prefix/usr|g" -e "s| -L/usr| -L$prefix/usr|g" \
    -e "s|,/usr/|,$prefix/usr/|g"
  touch "$prefix/.ferry-unpacked"
}
use_prefix() {
  local u="$prefix/usr" a="x86_64-linux-gnu" libdirs
  export PKG_CONFIG_PATH="$u/lib/$a/pkgconfig:$u/share/pkgconfig:$u/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export CPATH="$u/include:$u/include/$a${CPATH:+:$CPATH}"
  # Every folder of the prefix that holds a shared library (openmpi keeps its own).
  libdirs="$(find "$prefix" -name '*.so*' \( -type f -o -type l \) -printf '%h\n' 2>/dev/null | sort -u | tr '\n' ':')"
  export LIBRARY_PATH="$u/lib/$a:${libdirs}${LIBRARY_PATH:-}"
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$u/lib/$a:${libdirs%:}"
  export PATH="$PATH:$u/bin"  # after the machine's own tools: its meson and ninja come first
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$u/lib/python3/dist-packages"
  export OPAL_PREFIX="$u"  # openmpi, relocated: where its components and help files are
}
if [ ${#deb_files[@]} -eq 0 ]; then
  row "debs" "skipped" 0 "no .deb in $debs: using the machine's packages (bench/gpu/fetch_debs.sh makes them)"
elif [ "$dry" = 1 ]; then
  echo "plan: unpack ${#deb_files[@]} packages from $debs into $prefix with dpkg -x; rewrite its .pc files"
  use_prefix
  row "debs" "planned" 0 "${#deb_files[@]} packages -> $prefix"
else
  s=$SECONDS
  if [ -f "$prefix/.ferry-unpacked" ] && [ -z "$(find "$debs" -name '*.deb' -newer "$prefix/.ferry-unpacked" | head -n 1)" ]; then
    use_prefix
    row "debs" "ok" 0 "${#deb_files[@]} packages, already in $prefix"
  elif unpack_debs; then
    use_prefix
    row "debs" "ok" $((SECONDS - s)) "${#deb_files[@]} packages -> $prefix"
  else
    row "debs" "FAIL" $((SECONDS - s)) "unpacking into $prefix failed"
    failed=1
    table
    exit 1
  fi
fi

# meson and ninja: the machine's (pip's) when it has them, else the unpacked Debian ones.
meson_cmd=()
if command -v meson >/dev/null 2>&1 && [ "$(command -v meson)" != "$prefix/usr/bin/meson" ]; then
  meson_cmd=(meson)
elif [ -f "$prefix/usr/bin/meson" ]; then
  meson_cmd=(python3 "$prefix/usr/bin/meson")
fi
if [ ${#meson_cmd[@]} -eq 0 ] || ! command -v ninja >/dev/null 2>&1; then
  row "meson" "FAIL" 0 "meson or ninja missing (neither on PATH nor in the debs)"
  failed=1
  if [ "$dry" = 0 ]; then table; exit 1; fi
else
  row "meson" "ok" 0 "$("${meson_cmd[@]}" --version 2>/dev/null || echo '?'), ninja $(ninja --version 2>/dev/null)"
fi

# ---- 3. build ----

[ "$dry" = 1 ] || mkdir -p "$logs"
setup_args=(setup "$build" -Dcuda=enabled -Dbuildtype=release)
# Machine code for this GPU alone (not the default list's three architectures and PTX): the build
# is most of a short GPU session's first minutes.
gpu_cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')"
case "$gpu_cc" in [1-9][0-9]|[1-9][0-9][0-9]) setup_args+=("-Dgpu_arch=$gpu_cc") ;; esac
[ -f "$build/build.ninja" ] && setup_args+=(--reconfigure)
run_step "configure" 120 "meson, CUDA on" "${meson_cmd[@]}" "${setup_args[@]}" &&
  run_step "build" 300 "ninja -j$jobs" ninja -C "$build" -j "$jobs"
built=$?
if [ "$dry" = 0 ] && [ $built -ne 0 ]; then table; exit 1; fi
if [ "$build_only" = 1 ]; then table; exit $failed; fi

# ---- 4. tests on the GPU ----

meson_test() {  # the named meson tests that this build defines
  local want=() t
  local have; have="$("${meson_cmd[@]}" test -C "$build" --list 2>/dev/null)"
  for t in "$@"; do grep -qx "$t" <<<"$have" && want+=("$t"); done
  [ ${#want[@]} -gt 0 ] || { echo "none of $* defined"; return 77; }
  local out rc
  out="$("${meson_cmd[@]}" test -C "$build" --print-errorlogs --num-processes 1 "${want[@]}" 2>&1)"
  rc=$?
  echo "$out"
  # Every test skipped (no GPU, no mpirun): a skip, not a pass.
  [ $rc -eq 0 ] && grep -Eq '^Ok: +0 *$' <<<"$out" && return 77
  return $rc
}
export FY_SOURCE_DIR="$root" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# The demo corpus as byte tokens (what ferry train reads by default), for the training steps.
if [ "$dry" = 0 ] && [ ! -f data/demo/corpus_000000.bin ]; then
  python3 tools/tokenize.py --tokenizer bytes --out data/demo/corpus data/corpus.txt >"$logs/tokenize.log" 2>&1 ||
    row "demo data" "FAIL" 0 "tools/tokenize.py (log: $logs/tokenize.log)"
fi
if [ "$dry" = 1 ]; then
  selected "op tests" && echo "plan: [op tests] meson test -C $build backend_ops"
  selected "reference tests" && echo "plan: [reference tests] meson test -C $build reference_cuda reference"
  selected "nccl comm test" && echo "plan: [nccl comm test] meson test -C $build comm_nccl"
  selected "random configurations" && echo "plan: [random configurations] test/reference/check_variants.py --random 16 --gpu"
else
  run_step "op tests" 150 "CUDA kernels vs CPU kernels (test_backend_ops)" meson_test backend_ops
  run_step "reference tests" 90 "transformers fixtures, model on the GPU and on the CPU" meson_test reference_cuda reference
  run_step "nccl comm test" 60 "fy_comm nccl backend under mpirun, one rank per GPU" meson_test comm_nccl
  # Random OPT configurations (odd head sizes and widths, every flag, gelu, dropout, loss masks)
  # trained 5 steps on the GPU in fp32, resident or offloaded, accumulated, recomputed, resumed,
  # and evaluated, against transformers on the CPU (test/reference/README.md).
  if python3 -c 'import torch, transformers, safetensors' >/dev/null 2>&1; then
    run_step "random configurations" 90 "ferry on cuda vs transformers, 16 random models and paths" \
      python3 test/reference/check_variants.py "$build/ferry" --random 16 --seed 1 --gpu
  else
    row "random configurations" "skipped" 0 "torch, transformers or safetensors not importable"
  fi
fi

# Training on the GPU against the CPU (test/cuda_train.sh, which ./test.sh runs on the CUDA
# emulator): fp32 and bf16, accumulation, a resumed checkpoint, offloaded with and without chunks
# kept on the GPU, dropout with validation; then the rate of opt-125m.
gpu_train() {
  local d="$logs/train"
  "$root/test/cuda_train.sh" "$build/ferry" "$d" --model opt-demo --batch 4 --seq 128 --offload-mem 160MiB || return 1
  "$root/test/cuda_compat.sh" "$build/ferry" "$d/compat" || return 1  # the build's architectures, a run on this GPU
  ferry_run() { local name="$1"; shift; "$build/ferry" "$@" >"$d/$name.out" 2>&1 || { cat "$d/$name.out"; return 1; }; }
  # The rate of opt-125m fp32 resident on the GPU (tokens are bytes of the demo corpus).
  ferry_run speed train --device cuda --precision fp32 --model opt-125m --steps 6 --batch 8 --seq 512 --quiet \
    --log "$d/speed.jsonl" ||
    return 1
  python3 - "$d/speed.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
print(json.dumps({"bench": "ferry_cuda_fp32", "model": "opt-125m", "batch": 8, "seq": 512,
                  "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 1),
                  "gflops": round(statistics.median(r["gflops"] for r in rows), 1)}))
PY
}
if [ "$dry" = 1 ]; then
  selected "gpu training" && echo "plan: [gpu training] ferry train --device cuda vs --device cpu, opt-demo, 8 steps; opt-125m rate"
elif [[ "$("$build/ferry" train --help 2>&1)" == *"or cuda"* ]]; then  # (grep -q under pipefail: SIGPIPE)
  run_step "gpu training" 200 "opt-demo: cuda vs cpu fp32 and bf16, accumulation, resume; opt-125m rate" gpu_train
else
  row "gpu training" "skipped" 0 "ferry train has no --device cuda yet"
fi

# Several GPUs (needs 2; test/cuda_ranks.sh, which ./test.sh runs on 4 emulated GPUs): 2 ranks
# with --batch 2 shard the chunks (--offload; the blocks gathered and reduce-scattered through NCCL
# on the copy streams, the norm's sums through MPI) and follow 1 rank with --batch 4 (fp32 within
# 1e-4, bf16 within 2e-2), with accumulation, dropout and validation, a checkpoint saved by 2
# ranks and resumed by 2 and by 1, 3 ranks with 3 GPUs, tensor parallelism (--tp 2; a 2 x 2 grid
# with 4 GPUs), pipeline stages (--pp 2, resident, NCCL send/recv between the GPUs, with their
# checkpoint resumed by 1 rank), expert parallelism (--ep 2 on opt-moe-tiny, resident and
# --offload, vs 1 rank accumulating; tested on the emulator only so far), and a killed rank ending
# the job.
gpu_ranks() {
  "$root/test/cuda_ranks.sh" "$build/ferry" "$logs/ranks" --model opt-demo --seq 128 --offload-mem 160MiB
}
if [ "$dry" = 1 ]; then
  selected "gpu ranks" && echo "plan: [gpu ranks] test/cuda_ranks.sh: mpirun -np 2 (3, 4) ferry train --device cuda --offload (and --tp 2, --pp 2, --ep 2) vs 1 rank (with 2 GPUs or more)"
elif ! command -v mpirun >/dev/null 2>&1; then
  row "gpu ranks" "skipped" 0 "no mpirun"
elif [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -lt 2 ]; then
  row "gpu ranks" "skipped" 0 "needs 2 GPUs"
else
  run_step "gpu ranks" 300 "2 ranks, sharded chunks, --tp, --pp and --ep through NCCL, vs 1 rank (test/cuda_ranks.sh)" gpu_ranks
fi

# ---- 5. benchmarks ----

bench_json=()
bench_step() {  # NAME LIMIT CMD...: the step's last JSON line goes into the table's detail
  local name="$1" limit="$2"
  shift 2
  if run_step "$name" "$limit" "" "$@" && [ "$dry" = 0 ]; then
    local f="$logs/${name// /_}.log" j
    j="$(grep '^{' "$f" | grep tokens_per_s | tail -n 1)"
    [ -n "$j" ] || j="$(grep '^{' "$f" | tail -n 1)"
    bench_json+=("$name|$j")
  fi
}
# Offloading against resident on the same GPU: MODEL BATCH SEQ [ferry train options...]; the
# offloaded run gets a quarter of the device memory the resident one peaked at.
offload_ratio() {
  local model="$1" batch="$2" seq="$3"
  shift 3
  local run=(train --device cuda --model "$model" --batch "$batch" --seq "$seq" --steps 5 --quiet "$@")
  local tag; tag="$(printf '%s' "$model$*" | tr -c 'A-Za-z0-9.-' '_')"  # one pair of logs per call
  # A resident run that does not fit the GPU (its device memory said so) is a skip, not a failure.
  if ! "$build/ferry" "${run[@]}" --log "$logs/res-$tag.jsonl" >"$logs/res-$tag.out" 2>&1; then
    cat "$logs/res-$tag.out"
    grep -qiE 'resident on GPU [0-9]+ with micro-batch|device: [0-9]+ bytes requested|out of memory' "$logs/res-$tag.out" && return 77
    return 1
  fi
  local peak; peak="$(python3 -c 'import json,sys; print(int(max(json.loads(l)["device_peak_mib"] for l in open(sys.argv[1])) / 4))' "$logs/res-$tag.jsonl")"
  "$build/ferry" "${run[@]}" --offload --device-mem "${peak}MiB" --log "$logs/off-$tag.jsonl" || return 1
  python3 - "$logs/res-$tag.jsonl" "$logs/off-$tag.jsonl" "$peak" "$model" <<'PY'
import json, statistics, sys
r, o = ([json.loads(l) for l in open(p)][1:] for p in sys.argv[1:3])
tr, to = (statistics.median(x["tokens_per_s"] for x in rows) for rows in (r, o))
print(json.dumps({"bench": "ferry_cuda_offload", "model": sys.argv[4], "device_mem_mib": int(sys.argv[3]),
                  "tokens_per_s": round(to, 1), "resident_tokens_per_s": round(tr, 1), "ratio": round(to / tr, 3)}))
PY
}
# The largest preset that trains with a 40 GiB cap on this machine's 128 GiB of host memory:
# OPT-6.7B in bf16 chunks (14 bytes a parameter on the host, 94 GB; OPT-13B's 182 GB do not fit,
# nor, with its optimizer state partly on disk, the ~90 GB of it the host cannot hold on a 64 GiB
# disk). The planner is asked about OPT-13B on this machine (its host memory, and the free space
# of a disk tier under the logs), and says why it fits or not.
largest_40g() {
  local why
  if "$build/ferry" plan --device cuda --offload --precision bf16 --device-mem 40GiB --model opt-13b --batch 8 \
      --seq 2048 --disk-dir "$logs/disk13b" >"$logs/plan13b.txt" 2>&1; then
    why="a plan fits: $(grep 'memory per rank' "$logs/plan13b.txt")"
  else
    why="$(tail -n 1 "$logs/plan13b.txt")"
  fi
  rm -rf "$logs/disk13b"
  "$build/ferry" train --device cuda --offload --precision bf16 --device-mem 40GiB --model opt-6.7b --batch 8 \
    --seq 2048 --recompute --steps 3 --quiet --log "$logs/largest.jsonl" || return 1
  python3 - "$logs/largest.jsonl" "$why" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
print(json.dumps({"bench": "ferry_cuda_largest_40gib", "model": "opt-6.7b", "device_mem_gib": 40,
                  "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 1),
                  "opt_13b_planner": sys.argv[2].strip()[:300]}))
PY
}
# Issue 35's side-by-side: OPT-6.7B in bf16, 8 x 2048 a micro-batch, recomputation on both sides,
# resident against offloaded at a 40 GiB cap (ferry train --plan auto: the planner's chunks, cache
# and device chunks; the same global batch), and offloaded with 8-bit AdamW state and
# --optimizer-lag 1 (the fastest offloaded configuration the planner predicts), alternating
# (resident, offloaded, 8-bit lagged, twice), 4 steps each (the first not timed). Then what the planner,
# from this GPU's probe, predicts for the offloaded runs, and where their compute stream waited
# (--profile-waits, which drains nothing). Prints tokens/s, the ratios of medians, MFU (Megatron's FLOPs: 6 x parameters x
# tokens plus 12 x layers x width x sequence per token, over the H200's 989 TFLOP/s dense bf16).
offload_bf16_40g() {
  # (not --quiet: the waits' line, parsed below, is printed at the end of a run that is not quiet)
  local common=(train --device cuda --precision bf16 --model opt-6.7b --batch 8 --seq 2048 --recompute --steps 4)
  local off=(--offload --device-mem 40GiB --plan auto --profile-waits)
  [ -f "$logs/probe.json" ] || FERRY_PROBE="$logs/probe.json" "$build/ferry" probe --device cuda --remeasure \
    >"$logs/probe.out" 2>&1 || return 1
  local round
  for round in 1 2; do
    FERRY_PROBE="$logs/probe.json" "$build/ferry" "${common[@]}" --log "$logs/b40-res-$round.jsonl" \
      >"$logs/b40-res-$round.out" 2>&1 || { cat "$logs/b40-res-$round.out"; return 1; }
    FERRY_PROBE="$logs/probe.json" "$build/ferry" "${common[@]}" "${off[@]}" --log "$logs/b40-off-$round.jsonl" \
      >"$logs/b40-off-$round.out" 2>&1 || { cat "$logs/b40-off-$round.out"; return 1; }
    FERRY_PROBE="$logs/probe.json" "$build/ferry" "${common[@]}" "${off[@]}" --optimizer-state 8bit --optimizer-lag 1 \
      --log "$logs/b40-lag-$round.jsonl" >"$logs/b40-lag-$round.out" 2>&1 || { cat "$logs/b40-lag-$round.out"; return 1; }
  done
  for lag in 0 1; do
    local q8=()
    [ "$lag" = 1 ] && q8=(--optimizer-state 8bit)
    FERRY_PROBE="$logs/probe.json" "$build/ferry" plan --device cuda --offload --device-mem 40GiB --precision bf16 \
      --model opt-6.7b --batch 8 --seq 2048 --optimizer-lag "$lag" "${q8[@]}" >"$logs/b40-plan-$lag.txt" 2>&1 || return 1
  done
  python3 - "$logs" "$root/bench/gpu" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[2])
from runlogs import clipping, device_updates, predicted, rate, waits
d = sys.argv[1]
res, off, lag = rate(d, "b40-res"), rate(d, "b40-off"), rate(d, "b40-lag")
p0, p1 = predicted(f"{d}/b40-plan-0.txt"), predicted(f"{d}/b40-plan-1.txt")
# (a fresh model clips at the default --clip 1: the offloaded run against the plan's clipping figure)
p0c = clipping(f"{d}/b40-plan-0.txt") or p0
print(json.dumps({"bench": "ferry_cuda_offload_bf16_40gib", "model": "opt-6.7b", "lag": "8bit state, lag 1",
                  "resident_tokens_per_s": round(res[0], 1), "tokens_per_s": round(off[0], 1),
                  "lag_tokens_per_s": round(lag[0], 1), "ratio": round(off[0] / res[0], 3),
                  "lag_ratio": round(lag[0] / res[0], 3), "mfu_h200_bf16": round(off[1] / 989e3, 3),
                  "lag_mfu_h200_bf16": round(lag[1] / 989e3, 3), "resident_mfu_h200_bf16": round(res[1] / 989e3, 3),
                  "predicted_tokens_per_s": p0, "lag_predicted_tokens_per_s": p1,
                  "predicted_clipping_tokens_per_s": p0c, "device_updates": device_updates(d, "b40-off"),
                  "predicted_over_measured": round(p0 / off[0], 3) if p0 else None,
                  "clipping_predicted_over_measured": round(p0c / off[0], 3) if p0c else None,
                  "lag_predicted_over_measured": round(p1 / lag[0], 3) if p1 else None,
                  "waits": waits(f"{d}/b40-off-2.out"), "lag_waits": waits(f"{d}/b40-lag-2.out"),
                  "predicted_waits": waits(f"{d}/b40-plan-0.txt"), "lag_predicted_waits": waits(f"{d}/b40-plan-1.txt")}))
PY
}
# Issue 35's exact step: OPT-6.7B bf16 offloaded at 40 GiB with 8-bit AdamW state and no lag, the
# plan ferry plan makes (speculative host updates and device updates, chosen by the mean of the
# step that does not clip and the one that clips; each log says how many chunks the GPU updated),
# against the resident run, alternating, 2 rounds of 4 steps (the first of each run not timed).
# Speculation stands only in steps whose norm does not clip, and a model trained from random
# weights clips its first steps at the default --clip 1: the default run is held against the
# plan's clipping figure. With `noclip` (its own step, for a second call) both sides train with
# --clip 0, the speed of a step whose norm is below the clip (fine-tuning, later pretraining),
# held against the plan's predicted figure. Each offloaded run's summary line says in how many
# steps the speculation stood.
offload_exact8_40g() {  # [noclip]
  local tag=e8 extra=()
  [ "${1:-}" = noclip ] && tag=e8nc extra=(--clip 0)
  local common=(train --device cuda --precision bf16 --model opt-6.7b --batch 8 --seq 2048 --recompute --steps 4)
  local off=(--offload --device-mem 40GiB --plan auto --optimizer-state 8bit --profile-waits)
  [ -f "$logs/probe.json" ] || FERRY_PROBE="$logs/probe.json" "$build/ferry" probe --device cuda --remeasure \
    >"$logs/probe.out" 2>&1 || return 1
  local round kind
  for round in 1 2; do
    for kind in res off8; do
      local args=("${common[@]}" "${extra[@]}")
      [ "$kind" = off8 ] && args+=("${off[@]}")
      FERRY_PROBE="$logs/probe.json" "$build/ferry" "${args[@]}" --log "$logs/$tag-$kind-$round.jsonl" \
        >"$logs/$tag-$kind-$round.out" 2>&1 || { cat "$logs/$tag-$kind-$round.out"; return 1; }
    done
  done
  FERRY_PROBE="$logs/probe.json" "$build/ferry" plan --device cuda --offload --device-mem 40GiB --precision bf16 \
    --model opt-6.7b --batch 8 --seq 2048 --optimizer-state 8bit >"$logs/$tag-plan.txt" 2>&1 || return 1
  FERRY_PROBE="$logs/probe.json" "$build/ferry" plan --device cuda --resident --precision bf16 \
    --model opt-6.7b --batch 8 --seq 2048 >"$logs/$tag-plan-res.txt" 2>&1  # (a resident run that cannot fit: no figure)
  python3 - "$logs" "$root/bench/gpu" "$tag" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[2])
from runlogs import clipping, device_updates, predicted, rate, spec, waits
d, tag = sys.argv[1], sys.argv[3]
noclip = tag == "e8nc"
p, pr = predicted(f"{d}/{tag}-plan.txt"), predicted(f"{d}/{tag}-plan-res.txt")
pc = clipping(f"{d}/{tag}-plan.txt") or p  # (the plan's step while the norm clips)
want = p if noclip else pc                 # (what this pair's offloaded run is held against)
res, off = rate(d, f"{tag}-res"), rate(d, f"{tag}-off8")
probe = json.load(open(f"{d}/probe.json"))  # (this host's AdamW by state format: the plan prices 8-bit's)
adamw = {f: probe.get(k) for f, k in (("fp32", "host_adamw_gbps"), ("bf16", "host_adamw_bf16_gbps"),
                                      ("8bit", "host_adamw_8bit_gbps"))}
print(json.dumps({"bench": "ferry_cuda_offload_bf16_40gib_exact_8bit" + ("_noclip" if noclip else ""),
                  "model": "opt-6.7b", "clip": 0 if noclip else 1,
                  "resident_tokens_per_s": round(res[0], 1), "tokens_per_s": round(off[0], 1),
                  "ratio": round(off[0] / res[0], 3), "mfu_h200_bf16": round(off[1] / 989e3, 3),
                  "resident_mfu_h200_bf16": round(res[1] / 989e3, 3), "flops_count": "palm",
                  "spec": spec(f"{d}/{tag}-off8-2.out"), "device_updates": device_updates(d, f"{tag}-off8"),
                  "predicted_tokens_per_s": p, "predicted_clipping_tokens_per_s": pc,
                  "resident_predicted_tokens_per_s": pr,
                  "predicted_ratio": round(want / pr, 3) if want and pr else None,
                  "predicted_over_measured": round(want / off[0], 3) if want else None,
                  "resident_predicted_over_measured": round(pr / res[0], 3) if pr else None,
                  "waits": waits(f"{d}/{tag}-off8-2.out"), "predicted_waits": waits(f"{d}/{tag}-plan.txt"),
                  "host_adamw_gbps": adamw}))
PY
}
# OPT-13B in bf16 offloaded at a 40 GiB cap on this machine (host tier, and a disk tier under the
# logs for what the host cannot hold): 3 steps, tokens/s and MFU; where the planner refuses it
# (host memory and disk), why. With --optimizer-state 8bit where this ferry has it (fewer host
# bytes a parameter).
offload_13b_40g() {
  local state=()
  "$build/ferry" train --help 2>&1 | grep -q -- '--optimizer-state' && state=(--optimizer-state 8bit)
  # (16 sequences a step: the planner, given the H200's figures, says the host optimizer's per-step
  # cost then falls under issue 35's 35% MFU (docs/benchmarks.md); 8 a step leaves it at ~28%)
  local run=(train --device cuda --precision bf16 --model opt-13b --batch 16 --seq 2048 --recompute --steps 3 --quiet
             --offload --device-mem 40GiB --plan auto --disk-dir "$logs/disk13b" "${state[@]}")
  FERRY_PROBE="$logs/probe.json" "$build/ferry" "${run[@]}" --log "$logs/b13.jsonl" >"$logs/b13.out" 2>&1
  local rc=$?
  FERRY_PROBE="$logs/probe.json" "$build/ferry" plan --device cuda --offload --device-mem 40GiB --precision bf16 \
    --model opt-13b --batch 16 --seq 2048 --disk-dir "$logs" "${state[@]}" >"$logs/b13-plan.txt" 2>&1
  rm -rf "$logs/disk13b"
  python3 - "$logs/b13.jsonl" "$logs/b13.out" "$rc" "${state[*]}" "$logs/b13-plan.txt" <<'PY'
import json, statistics, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])][1:]
except OSError:
    rows = []
if sys.argv[3] != "0" or not rows:
    print(json.dumps({"bench": "ferry_cuda_offload_13b_40gib", "trained": False, "state": sys.argv[4],
                      "why": open(sys.argv[2]).read().strip().splitlines()[-1][:300]}))
else:
    gf = statistics.median(r["gflops"] for r in rows)
    print(json.dumps({"bench": "ferry_cuda_offload_13b_40gib", "trained": True, "state": sys.argv[4],
                      "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 1),
                      "mfu_h200_bf16": round(gf / 989e3, 3), "host_tier_mib": rows[-1].get("host_tier_mib"),
                      "predicted": next((l.strip() for l in open(sys.argv[5]) if "predicted:" in l), None)}))
PY
}
ferry_13b() {  # [LABEL [VAR=VALUE ...]]: the run's environment (which kernels: FERRY_CUDA_*)
  local label="${1:-default}"
  [ $# -gt 0 ] && shift
  # (the demo shard's windows in order: the tokens bench/peers/torch_opt.py --data takes too)
  env "$@" "$build/ferry" train --device cuda --precision bf16 --model opt-1.3b --batch 8 --seq 2048 --steps 5 \
    --data "$root/data/demo/corpus_000000.bin" --no-shuffle --quiet --log "$logs/ferry13b-$label.jsonl" || return 1
  python3 - "$logs/ferry13b-$label.jsonl" "$*" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
tps = statistics.median(r["tokens_per_s"] for r in rows)
gf = statistics.median(r["gflops"] for r in rows)
gfl = statistics.median(r["gflops_llmc"] for r in rows)
# MFU against the H200's dense bf16 peak (989 TFLOP/s), model FLOPs as PaLM and Megatron count
# them, and as llm.c counts them (core/opt.c).
print(json.dumps({"bench": "ferry_cuda_bf16", "model": "opt-1.3b", "env": sys.argv[2], "tokens_per_s": round(tps, 1),
                  "gflops": round(gf, 1), "mfu_h200_bf16": round(gf / 989e3, 3), "flops_count": "palm",
                  "gflops_llmc": round(gfl, 1), "mfu_h200_bf16_llmc": round(gfl / 989e3, 3)}))
PY
}
# ferry against PyTorch on the same 1.3B step, alternating ferry, torch, ferry, torch, ... $pair_runs
# of each, on the same tokens (the demo shard's windows in order on both sides), fused AdamW on both,
# weight decay on the same parameters (bench/peers/torch_opt.py); the ratio of the medians. (The
# first ferry run's log is the plan step's measured rate.)
pair_13b() {
  local i label
  for i in $(seq "$pair_runs"); do
    label=default
    [ "$i" -gt 1 ] && label="pair-$i"
    ferry_13b "$label" >"$logs/pair13b-ferry-$i.json" || return 1
    cat "$logs/pair13b-ferry-$i.json"
    python3 "$root/bench/peers/torch_opt.py" --device cuda --model opt-1.3b --dtype bf16 --batch 8 --seq 2048 \
      --steps 5 --warmup 2 --data "$root/data/demo/corpus_000000.bin" --compile no >"$logs/pair13b-torch-$i.json" ||
      return 1
    cat "$logs/pair13b-torch-$i.json"
  done
  python3 - "$logs" "$pair_runs" <<'PY'
import json, statistics, sys
logs, n = sys.argv[1], int(sys.argv[2])
ferry = [json.loads(open(f"{logs}/pair13b-ferry-{i}.json").read().strip().splitlines()[-1]) for i in range(1, n + 1)]
torch = [json.loads(open(f"{logs}/pair13b-torch-{i}.json").read().strip().splitlines()[-1]) for i in range(1, n + 1)]
med = lambda rs, k: statistics.median(r[k] for r in rs)
f, t = med(ferry, "tokens_per_s"), med(torch, "tokens_per_s")
print(json.dumps({"bench": "ferry_vs_torch_cuda_bf16", "model": "opt-1.3b", "batch": 8, "seq": 2048, "runs": n,
                  "ferry_tokens_per_s": round(f, 1), "torch_tokens_per_s": round(t, 1), "ratio": round(f / t, 3),
                  "ratio_pairs": [round(a["tokens_per_s"] / b["tokens_per_s"], 3) for a, b in zip(ferry, torch)],
                  "tokens_per_s": round(f, 1), "gflops": round(med(ferry, "gflops"), 1),
                  "mfu_h200_bf16": round(med(ferry, "mfu_h200_bf16"), 3),
                  "mfu_h200_bf16_llmc": round(med(ferry, "mfu_h200_bf16_llmc"), 3), "flops_count": "palm",
                  "torch_mfu_h200_bf16": round(med(torch, "gflops") / 989e3, 3), "torch_adamw": torch[0]["adamw"],
                  "torch": torch[0]["torch"], "transformers": torch[0]["transformers"]}))
PY
}
# The 1.3B step with each set of attention kernels (FERRY_CUDA_ATTENTION; auto is narrow), auto
# first and last (the drift between), and which is the fastest in the step rather than alone.
ferry_13b_attention() {
  local pair
  ferry_13b att-auto-first FERRY_CUDA_ATTENTION=auto || return 1
  for pair in basic pipelined pipelined,narrow narrow,pipelined auto; do
    ferry_13b "att-${pair/,/-}" FERRY_CUDA_ATTENTION="$pair" || return 1
  done
  python3 - "$logs" <<'PY'
import json, statistics, sys
rates = {}
for pair in ("auto-first", "basic", "pipelined", "pipelined,narrow", "narrow,pipelined", "auto"):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/ferry13b-att-{pair.replace(',', '-')}.jsonl")][1:]
    rates[pair] = round(statistics.median(r["tokens_per_s"] for r in rows), 1)
best = max(rates, key=rates.get)
print(json.dumps({"bench": "ferry_cuda_attention_pairs", "model": "opt-1.3b", "rates": rates,
                  "faster": best.replace("-first", ""), "tokens_per_s": rates[best],
                  "speedup": round(rates[best] / statistics.mean((rates["auto"], rates["auto-first"])), 3)}))
PY
}
# The planner's view of the same step from this GPU's probe (ferry probe --device cuda: free
# memory, bf16 and fp32 GEMM rates, memory bandwidth, pinned copies), beside the measured rate:
# what calibrates the cost model.
plan_13b() {
  FERRY_PROBE="$logs/probe.json" "$build/ferry" probe --device cuda --remeasure >"$logs/probe.out" 2>&1 || return 1
  FERRY_PROBE="$logs/probe.json" "$build/ferry" plan --device cuda --model opt-1.3b --batch 8 --seq 2048 \
    --out "$logs/plan13b.json" || return 1
  python3 - "$logs/plan13b.json" "$logs/ferry13b-default.jsonl" "$logs/probe.json" <<'PY'
import json, statistics, sys
plan, probe = json.load(open(sys.argv[1])), json.load(open(sys.argv[3]))
try:
    got = statistics.median(r["tokens_per_s"] for r in [json.loads(l) for l in open(sys.argv[2])][1:])
except (OSError, ValueError, statistics.StatisticsError):
    got = 0
want = plan["predicted"]["tokens_per_s"]
print(json.dumps({"bench": "plan_cuda", "model": "opt-1.3b", "resident": plan.get("resident", False),
                  "device_chunks": plan.get("device_chunks", 0), "predicted_tokens_per_s": round(want, 1),
                  "measured_tokens_per_s": round(got, 1), "predicted_over_measured": round(want / got, 3) if got else None,
                  "gpu_bf16_tflops": round(probe["device_gflops"] / 1e3, 1), "bf16_speedup": probe.get("bf16_speedup"),
                  "device_mem_gbps": round(probe.get("device_mem_gbps", 0), 1)}))
PY
}
# ferry sample on the GPU: MODEL TOKENS [ferry sample options...], random weights, a 512-token prompt
# (one pass) and TOKENS more, greedy: the prompt's tokens/s and the new tokens'.
sample_bench() {
  local model="$1" tokens="$2" ids
  shift 2
  local tag; tag="$(printf '%s' "$model$*" | tr -c 'A-Za-z0-9.-' '_')"
  ids="$(python3 -c 'import random; random.seed(1); print(",".join(str(random.randrange(3, 50000)) for _ in range(512)))')"
  "$build/ferry" sample --device cuda --model "$model" --init random --prompt-ids "$ids" --tokens "$tokens" \
    --temperature 0 --stop none "$@" >"$logs/sample-$tag.out" 2>"$logs/sample-$tag.err" || { cat "$logs/sample-$tag.err"; return 1; }
  python3 - "$logs/sample-$tag.err" "$model" "$*" <<'PY'
import json, re, sys
t = open(sys.argv[1]).read()
m = re.search(r"prompt's (\d+) tokens and the first new one in [0-9.]+ s \(([0-9.]+) tokens/s\), \d+ more in [0-9.]+ s "
              r"\(([0-9.]+) tokens/s\)", t)
if not m:
    sys.exit("no timing line in ferry sample's output")
print(json.dumps({"bench": "ferry_cuda_sample", "model": sys.argv[2], "options": sys.argv[3],
                  "prompt_tokens_per_s": float(m.group(2)), "tokens_per_s": float(m.group(3))}))
PY
}
# Issue 37's figure on a GPU: opt-125m-moe8 (8 experts, top 2, every other layer; 323.6M
# parameters, 153.6M acting on a token) against a dense model of the same total parameters
# (opt-125m's shape with ffn_dim 13824: 323.5M; no dropout, as the presets), resident in bf16,
# batch 8 x 1024, 6 steps each (the first not timed), after test/cuda_train_moe.sh has checked the mixture's training on this
# GPU against the CPU. ratio: the mixture's tokens/s over the dense model's; flop_ratio: the
# dense model's FLOPs a token over the mixture's (ferry's count: active experts only); efficiency =
# ratio / flop_ratio, what the mixture keeps of its FLOP advantage after routing, gathering, the
# per-expert products and the wait for the experts' counts.
moe_vs_dense() {
  local d="$logs/moe"
  "$root/test/cuda_train_moe.sh" "$build/ferry" "$d/check" || return 1
  mkdir -p "$d/dense" || return 1
  python3 - "$d/dense/config.json" <<'PY' || return 1
import json, sys
json.dump(dict(model_type="opt", architectures=["OPTForCausalLM"], vocab_size=50272, hidden_size=768,
               num_attention_heads=12, ffn_dim=13824, num_hidden_layers=12, max_position_embeddings=2048,
               word_embed_proj_dim=768, do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0,
               layerdrop=0.0, activation_function="relu", enable_bias=True), open(sys.argv[1], "w"))
PY
  local run=(train --device cuda --precision bf16 --batch 8 --seq 1024 --steps 6 --quiet)
  "$build/ferry" "${run[@]}" --model opt-125m-moe8 --log "$d/moe.jsonl" || return 1
  "$build/ferry" "${run[@]}" --model "$d/dense" --log "$d/dense.jsonl" || return 1
  python3 - "$d/moe.jsonl" "$d/dense.jsonl" <<'PY'
import json, statistics, sys
m, dn = ([json.loads(l) for l in open(p) if l.startswith("{") and '"loss"' in l][1:] for p in sys.argv[1:3])
tm, td = (statistics.median(r["tokens_per_s"] for r in rows) for rows in (m, dn))
gm, gd = (statistics.median(r["gflops"] for r in rows) for rows in (m, dn))
flop_ratio = (gd / td) / (gm / tm)  # FLOPs a token, dense over mixture
print(json.dumps({"bench": "ferry_cuda_moe_vs_dense", "model": "opt-125m-moe8", "dense": "opt-125m ffn 13824",
                  "batch": 8, "seq": 1024, "precision": "bf16", "tokens_per_s": round(tm, 1),
                  "dense_tokens_per_s": round(td, 1), "ratio": round(tm / td, 3), "flop_ratio": round(flop_ratio, 3),
                  "efficiency": round(tm / td / flop_ratio, 3), "gflops": round(gm, 1), "dense_gflops": round(gd, 1),
                  "aux_loss_last": m[-1].get("aux_loss")}))
PY
}
have_torch() { python3 -c 'import torch, transformers; assert torch.cuda.is_available()' >/dev/null 2>&1; }
if [ "$bench" = 1 ]; then
  # OPT-1.3B in bf16, everything on the GPU, batch 8 x 2048: ferry against PyTorch (autocast bf16,
  # fused AdamW), alternating, in the same run; then PyTorch's step under torch.compile. MFU = model
  # FLOPs (PaLM's and Megatron's count; llm.c's beside it) / step time / the H200's bf16 dense peak
  # (989).
  if have_torch; then
    bench_step "bench ferry vs torch 1.3b bf16" $((60 * pair_runs + 30)) pair_13b
    bench_step "plan 1.3b from the GPU probe" 30 plan_13b
    bench_step "bench torch 1.3b bf16 compiled" 240 python3 bench/peers/torch_opt.py --device cuda --model opt-1.3b \
      --dtype bf16 --batch 8 --seq 2048 --steps 6 --warmup 3 --data "$root/data/demo/corpus_000000.bin" --compile only
  else
    bench_step "bench ferry 1.3b bf16" 120 ferry_13b
    bench_step "plan 1.3b from the GPU probe" 30 plan_13b
    row "bench ferry vs torch 1.3b bf16" "skipped" 0 "torch with CUDA not importable"
  fi
  # What the 1.3B step is made of, with the alternatives that are not the default yet: the attention
  # kernels alone, basic, pipelined, narrow and the default's pairing (one layer's forward and
  # backward at the 1.3B shape; the op tests above checked each), and the step's matrix products
  # shape by shape (forward, input, weight and bias gradients), each with the heuristic's algorithm
  # and tuned among its first 8, and the forward's bias and relu in cuBLASLt's epilogue against a
  # kernel after the product.
  # Then the 1.3B step again with whichever alternative was the faster: the measurements that
  # decide the defaults.
  bench_step "bench attention kernels" 40 "$build/bench/gpu_attention" --model opt-1.3b --batch 8 --seq 2048
  bench_step "bench ferry 1.3b attention kernels" 150 ferry_13b_attention
  # Heads of 80 and 128 (OPT-2.7B, OPT-6.7B and larger), where narrow is the pipelined shape.
  bench_step "bench attention kernels 2.7b" 40 "$build/bench/gpu_attention" --model opt-2.7b --batch 8 --seq 2048
  bench_step "bench attention kernels 6.7b" 40 "$build/bench/gpu_attention" --model opt-6.7b --batch 8 --seq 2048
  bench_step "bench gemm shapes" 90 "$build/bench/gpu_gemm" --model opt-1.3b --batch 8 --seq 2048 --tune 8
  faster=()
  att="$(sed -n 's/.*"faster": *"\([a-z,]*\)".*/\1/p' "$logs/bench_attention_kernels.log" 2>/dev/null | tail -n 1)"
  case "$att" in ''|auto) ;; *) faster+=(FERRY_CUDA_ATTENTION="$att") ;; esac
  gemm_step_faster() {  # the step line of bench/gpu_gemm says the alternative $1 is over 2% faster
    python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]; sys.exit(0 if r and r[-1].get(sys.argv[2], 0) > 1.02 else 1)' \
      "$logs/bench_gemm_shapes.log" "$1" 2>/dev/null
  }
  gemm_step_faster tuned_speedup && faster+=(FERRY_CUDA_GEMM_TUNE=8)
  gemm_step_faster kernels_speedup && faster+=(FERRY_CUDA_EPILOGUE=kernels)
  if [ ${#faster[@]} -gt 0 ]; then
    bench_step "bench ferry 1.3b bf16 faster" 120 ferry_13b faster "${faster[@]}"
  fi
  # The issue's other target next (a short budget keeps the two): OPT-6.7B (fp32 state: ~107 GB of
  # host memory when offloaded; the largest preset whose state fits this machine's 128 GiB, and a
  # quarter of its resident peak is under 40 GiB), batch 8 x 2048
  # with recomputation so that the resident run fits the GPU too: ~22 s a step on an H200 in fp32,
  # so 3 steps (the last 2 timed).
  if [ "$big" = 1 ]; then
    bench_step "bench offload 6.7b" 300 offload_ratio opt-6.7b 8 2048 --recompute --steps 3 --precision fp32
    # The same in bf16, where the GPU's step is ~10x shorter and the host's AdamW over 6.7B
    # parameters (28 bytes of host memory traffic each) is what an offloaded step waits for: the
    # ratio a bf16 user sees (a skip if the resident run does not fit the GPU).
    bench_step "bench offload 6.7b bf16" 240 offload_ratio opt-6.7b 8 2048 --recompute --steps 4 --precision bf16
  fi
  if [ "$big" = 1 ]; then
    # Issue 35: OPT-6.7B bf16 resident against offloaded at 40 GiB (and with the lag), alternating;
    # OPT-13B bf16 offloaded at 40 GiB.
    # (the issue's target first: the exact 8-bit step at the default clip, then OPT-13B's MFU, then
    # fp32 state and the lag, then the 8-bit step without clipping)
    bench_step "bench offload 6.7b bf16 40 GiB exact 8bit" 420 offload_exact8_40g
    bench_step "bench offload 13b bf16 40 GiB" 300 offload_13b_40g
    bench_step "bench offload 6.7b bf16 40 GiB" 420 offload_bf16_40g
    bench_step "bench offload 6.7b bf16 40 GiB exact 8bit no clip" 420 offload_exact8_40g noclip
  fi
  bench_step "bench offload 1.3b" 150 offload_ratio opt-1.3b 8 1024 --recompute --precision fp32
  # The same in bf16 (chunks of bf16 weights; the host's AdamW over 1.3B parameters per step is
  # what an offloaded bf16 step waits for).
  bench_step "bench offload 1.3b bf16" 120 offload_ratio opt-1.3b 8 2048 --recompute --precision bf16
  # Where ferry's 1.3B bf16 step goes: each op kind's kernels timed alone (the table is in the log).
  run_step "profile 1.3b bf16" 60 "ferry train --profile (per op kind)" "$build/ferry" train --device cuda \
    --precision bf16 --model opt-1.3b --batch 8 --seq 2048 --steps 3 --profile
  if [ "$big" = 1 ]; then
    bench_step "bench largest at 40 GiB" 150 largest_40g
  fi
  # Sampling (ferry sample --device cuda): OPT-1.3B resident in bf16; OPT-6.7B offloaded through a
  # cache of 6 GiB of its 12.5 GiB of bf16 weights (every token loads what the cache lacks).
  bench_step "bench sample 1.3b" 60 sample_bench opt-1.3b 128
  # A mixture of experts against a dense model of its total size (alone: --steps 'bench moe*').
  bench_step "bench moe 125m-moe8 vs dense" 150 moe_vs_dense
  if [ "$big" = 1 ]; then
    bench_step "bench sample 6.7b offloaded" 120 sample_bench opt-6.7b 32 --offload --device-mem 6GiB
  fi
fi
# Each benchmark's JSON, shortened to its rate, replaces the step's detail in the table.
for bj in "${bench_json[@]}"; do
  name="${bj%%|*}" j="${bj#*|}"
  rate="$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(", ".join(f"{k} {r[k]}" for k in ("tokens_per_s","lag_tokens_per_s","lag_ratio","noclip_tokens_per_s","noclip_ratio","trained","prompt_tokens_per_s","gflops","step_s_median","mfu_h200_bf16","mfu_h200_bf16_llmc","ratio","flop_ratio","efficiency","speedup","faster","step_saving_ms","tuned_speedup","kernels_speedup","predicted_over_measured","bf16_speedup","device_mem_gbps","resident","env") if k in r))' "$j" 2>/dev/null)"
  for i in "${!rows[@]}"; do
    IFS='|' read -r n res sec det <<<"${rows[$i]}"
    [ "$n" = "$name" ] && rows[$i]="$n|$res|$sec|${rate:-$j}"
  done
done

table
exit $failed
