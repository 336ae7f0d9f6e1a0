#!/usr/bin/env bash
# Builds the fuzz targets with clang (libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer)
# and runs each for SECONDS (default 10) on a copy of its seed corpus. Exits 1 when a target finds
# a crash, leak, timeout or out-of-memory (the reproducer's path is printed), 77 when clang or
# libFuzzer is missing, else 0. The committed corpus is never modified.
#
# usage: test/fuzz/run.sh [SECONDS] [TARGET...]     (targets: safetensors config shard checkpoint plan)
#   FY_FUZZ_DIR=DIR keeps the build, the grown corpora and the logs in DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."

secs="${1:-10}"
[ $# -gt 0 ] && shift
targets="${*:-safetensors config shard checkpoint plan}"
case "$secs" in ''|*[!0-9]*) echo "usage: test/fuzz/run.sh [SECONDS] [TARGET...]" >&2; exit 2 ;; esac

cc=""
for c in clang clang-14 clang-15 clang-16; do
  command -v "$c" >/dev/null 2>&1 && { cc="$c"; break; }
done
[ -n "$cc" ] || { echo "skipped: clang is not installed (apt-get install clang)"; exit 77; }
pkg-config --exists json-c 2>/dev/null || { echo "skipped: json-c not found by pkg-config"; exit 77; }

work="${FY_FUZZ_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/ferry-fuzz.XXXXXX")}"
mkdir -p "$work/obj" "$work/corpus" "$work/artifacts"
keep=0
[ -n "${FY_FUZZ_DIR:-}" ] && keep=1
trap '[ "$keep" = 1 ] || rm -rf "$work"' EXIT

printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }\n' >"$work/probe.c"
if ! "$cc" -fsanitize=fuzzer,address,undefined "$work/probe.c" -o "$work/probe" >"$work/probe.log" 2>&1; then
  echo "skipped: $cc cannot link -fsanitize=fuzzer (apt-get install libclang-rt-14-dev)"
  exit 77
fi

# The parsers and what they call; none of them needs fy_config.h, but a stub keeps it so.
printf '#define FY_HAVE_CUDA 0\n#define FY_SOURCE_DIR "%s"\n' "$PWD" >"$work/fy_config.h"
cflags=(-g -O1 -std=gnu11 -D_GNU_SOURCE -I. -I"$work" $(pkg-config --cflags json-c)
        -fno-sanitize-recover=all -fno-omit-frame-pointer -Wno-unused-parameter)
libs=(core/status.c core/log.c core/dtype.c core/fileio.c core/safetensors.c core/opt_config.c core/opt.c
      core/graph.c runtime/data.c runtime/checkpoint_index.c planner/plan_file.c)
echo "== fuzz: building with $cc in $work"
objs=()
for src in "${libs[@]}"; do
  o="$work/obj/$(echo "$src" | tr / _).o"
  "$cc" "${cflags[@]}" -fsanitize=fuzzer-no-link,address,undefined -c "$src" -o "$o" \
    >>"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; echo "fuzz: cannot build $src"; exit 1; }
  objs+=("$o")
done

status=0
for t in $targets; do
  src="test/fuzz/fuzz_$t.c"
  [ -f "$src" ] || { echo "fuzz: no target $t ($src)"; exit 2; }
  if ! "$cc" "${cflags[@]}" -fsanitize=fuzzer,address,undefined "$src" "${objs[@]}" \
      $(pkg-config --libs json-c) -lm -o "$work/fuzz_$t" >>"$work/build.log" 2>&1; then
    tail -20 "$work/build.log"; echo "fuzz: cannot build $src"; exit 1
  fi
  rm -rf "$work/corpus/$t"
  cp -r "test/fuzz/corpus/$t" "$work/corpus/$t"
  mkdir -p "$work/artifacts/$t"
  log="$work/fuzz_$t.log"
  mkdir -p "$work/tmp/$t"
  TMPDIR="$work/tmp/$t" ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" \
    "$work/fuzz_$t" -max_total_time="$secs" -timeout=5 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/$t/" "$work/corpus/$t" >"$log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1)
  found=$(ls "$work/artifacts/$t" 2>/dev/null)
  if [ "$rc" -ne 0 ] || [ -n "$found" ]; then
    status=1 keep=1
    echo "fuzz_$t: FAILED (exit $rc) after ${runs:-?} runs; log: $log"
    grep -E "^(==[0-9]+== ?ERROR|SUMMARY|.*runtime error|    #[0-9]+ .* in )" "$log" | head -12
    for f in $found; do echo "  reproducer: $work/artifacts/$t/$f  (rerun: $work/fuzz_$t $work/artifacts/$t/$f)"; done
  else
    echo "fuzz_$t: ok, ${runs:-?} runs in ${secs}s, ${cov:-cov: ?}, corpus $(ls "$work/corpus/$t" | wc -l) files"
  fi
done
exit "$status"
