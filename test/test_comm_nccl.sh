#!/usr/bin/env bash
# runtime/comm_nccl.c under mpirun, one rank per GPU: the collectives with one rank, and with 2 and 3
# when the machine has that many GPUs; with two GPUs or more, the failure rules: a rank that skips a
# collective (on the default stream, and enqueued on a stream, which only the watchdog sees) makes the
# job end after --comm-timeout with a message naming the operation and the step; a rank that dies
# makes the job end, not hang.
# usage: test/test_comm_nccl.sh path/to/test_comm_nccl                  (one rank)
#        test/test_comm_nccl.sh path/to/test_comm_nccl --part 2-ranks   (two ranks, and the failure rules)
#        test/test_comm_nccl.sh path/to/test_comm_nccl --part 3-ranks   (three ranks)
# Each exits 77, a skip, without mpirun or without as many GPUs as its ranks.
set -u
exe="$1"
part=""
[ "${2:-}" = --part ] && part="${3:-}"
case "$part" in
  "") need=1 ;;
  2-ranks) need=2 ;;
  3-ranks) need=3 ;;
  *) echo "test_comm_nccl.sh: no part named '$part'"; exit 1 ;;
esac
if ! command -v mpirun >/dev/null 2>&1; then
  echo "mpirun not found: skipped"
  exit 77
fi
gpus="$("$exe" --gpus 2>/dev/null)"; code=$?
if [ "$code" -eq 77 ]; then
  echo "no GPU: skipped"
  exit 77
fi
if [ "$code" -ne 0 ] || [ -z "$gpus" ]; then
  echo "FAIL  $exe --gpus (exit $code)"
  exit 1
fi
if [ "$gpus" -lt "$need" ]; then
  echo "$gpus GPU(s): $need ranks need $need: skipped"
  exit 77
fi
mpi=(mpirun --allow-run-as-root --oversubscribe)
[ "$(id -u)" -ne 0 ] && mpi=(mpirun --oversubscribe)
if [ -n "${ASAN_OPTIONS:-}" ]; then export ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0:protect_shadow_gap=0"; fi
pass=0 fail=0
ok() { pass=$((pass + 1)); printf 'ok    %s\n' "$1"; }
bad() { fail=$((fail + 1)); printf 'FAIL  %s\n%s\n' "$1" "$2"; }
echo "$gpus GPU(s)"

np=$need
out="$(timeout 180 "${mpi[@]}" -np "$np" "$exe" 2>&1)"; code=$?
if [ "$code" -eq 0 ]; then ok "collectives, $np rank(s)"; else bad "collectives, $np rank(s) (exit $code)" "$(printf '%s' "$out" | tail -30)"; fi

if [ "$part" = 2-ranks ]; then
  msg='all-reduce of 1 MiB did not complete within 8 s at step 7 \(a rank died or hangs\)'
  for how in "" "--stream"; do
    t0=$(date +%s.%N)
    out="$(timeout 90 "${mpi[@]}" -np 2 "$exe" --timeout-case 8 $how 2>&1)"; code=$?
    t=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
    if [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && printf '%s' "$out" | grep -qE "$msg" \
       && ! printf '%s' "$out" | grep -q "instead of ending the job" \
       && awk -v t="$t" 'BEGIN { exit !(t >= 8 && t < 60) }'; then
      ok "timeout ${how:-(default stream)}: exit $code after ${t%.*} s with the message"
    else
      bad "timeout ${how:-(default stream)} (exit $code after $t s)" "$(printf '%s' "$out" | tail -30)"
    fi
  done

  t0=$(date +%s.%N)
  out="$(timeout 90 "${mpi[@]}" -np 2 "$exe" --die-case 2>&1)"; code=$?
  t=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
  if [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && ! printf '%s' "$out" | grep -q "got past"; then
    ok "dead rank: the job ended, exit $code after ${t%.*} s"
  else
    bad "dead rank (exit $code after $t s)" "$(printf '%s' "$out" | tail -30)"
  fi
fi

echo "comm_nccl${part:+ --part $part}: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
