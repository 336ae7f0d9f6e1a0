#!/usr/bin/env bash
# runtime/comm's mpi backend under mpirun: the collectives with 2 and 3 ranks (3: chunks that do not
# divide evenly), with MPI at MPI_THREAD_SERIALIZED (the one-lock path), and the failure rules: a
# rank that skips a collective makes the job end after --comm-timeout with a message naming the
# operation and the step; a rank that dies makes the job end, not hang.
# usage: test/test_comm_mpi.sh path/to/test_comm      (exit 77, a skip, when mpirun is missing)
set -u
exe="$1"
if ! command -v mpirun >/dev/null 2>&1; then
  echo "mpirun not found: skipped"
  exit 77
fi
# As root, Open MPI wants --allow-run-as-root; --oversubscribe lets 3 ranks run on 2 cores.
mpi=(mpirun --allow-run-as-root --oversubscribe)
[ "$(id -u)" -ne 0 ] && mpi=(mpirun --oversubscribe)
# Under AddressSanitizer (test.sh's second pass) the ranks keep every check but leak detection: Open
# MPI leaves thousands of allocations behind at MPI_Finalize, from components it has dlclose()d, so
# they cannot be suppressed by name. (test 'comm', the single backend, still runs with it.)
if [ -n "${ASAN_OPTIONS:-}" ]; then export ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0"; fi
pass=0 fail=0
ok() { pass=$((pass + 1)); printf 'ok    %s\n' "$1"; }
bad() { fail=$((fail + 1)); printf 'FAIL  %s\n%s\n' "$1" "$2"; }

for np in 2 3; do
  out="$(timeout 120 "${mpi[@]}" -np "$np" "$exe" 2>&1)"; code=$?
  if [ "$code" -eq 0 ]; then ok "collectives, $np ranks"; else bad "collectives, $np ranks (exit $code)" "$(printf '%s' "$out" | tail -20)"; fi
done

out="$(timeout 120 "${mpi[@]}" -np 2 -x FY_COMM_MPI_THREAD=serialized "$exe" 2>&1)"; code=$?
if [ "$code" -eq 0 ]; then ok "collectives, 2 ranks, MPI_THREAD_SERIALIZED"; else bad "collectives, SERIALIZED (exit $code)" "$(printf '%s' "$out" | tail -20)"; fi

# Timeout: rank 1 skips an all-reduce; rank 0 must give up after 2 s (not before) and end the job.
# (Not how soon after: a loaded machine can take long to end an mpirun job; `timeout 60` is the
# guard against a hang, whose 124 fails.)
t0=$(date +%s.%N)
out="$(timeout 60 "${mpi[@]}" -np 2 "$exe" --timeout-case 2 2>&1)"; code=$?
t=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
msg='all-reduce of 1 MiB did not complete within 2 s at step 7 \(a rank died or hangs\)'
if [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && printf '%s' "$out" | grep -qE "$msg" \
   && awk -v t="$t" 'BEGIN { exit !(t >= 2) }'; then
  ok "timeout: exit $code after ${t%.*} s with the message"
else
  bad "timeout (exit $code after $t s)" "$(printf '%s' "$out" | tail -20)"
fi

# A rank that dies: the job ends (mpirun kills the survivor), well before the 120 s timeout.
t0=$(date +%s.%N)
out="$(timeout 60 "${mpi[@]}" -np 2 "$exe" --die-case 2>&1)"; code=$?
t=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
if [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && ! printf '%s' "$out" | grep -q "got past"; then
  ok "dead rank: the job ended, exit $code after ${t%.*} s"
else
  bad "dead rank (exit $code after $t s)" "$(printf '%s' "$out" | tail -20)"
fi

echo "comm_mpi: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
