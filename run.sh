#!/usr/bin/env bash
# Installs what is missing, builds ferry, trains the demo model on the bundled corpus (checkpoints
# in out/demo), and ends with a few lines the model writes from a prompt (ferry sample).
# Extra arguments go to `ferry train` (e.g. ./run.sh --steps 50). Ctrl-C stops training after the
# current step with a checkpoint; ./run.sh --resume out/demo goes on from it.
set -euo pipefail
cd "$(dirname "$0")"
. tools/bootstrap.sh
fy_install_deps
fy_build build
fy_demo_data
save=out/demo
for ((i = 1; i <= $#; i++)); do  # (a --save of the caller's is where the checkpoints go)
  if [ "${!i}" = "--save" ] && [ $i -lt $# ]; then j=$((i + 1)); save="${!j}"; fi
  case "${!i}" in --save=*) save="${!i#--save=}" ;; esac
done
echo "ferry: training the demo model; Ctrl-C stops after the current step with a checkpoint in $save," \
  "and ./run.sh --resume $save goes on from it"
status=0
./build/ferry train --save "$save" --save-every 100 "$@" || status=$?
# 130: stopped by Ctrl-C (a checkpoint was written); anything else but 0 is an error.
if [ "$status" -ne 0 ] && [ "$status" -ne 130 ]; then exit "$status"; fi
echo
echo "ferry: what the model writes after \"The \" (ferry sample --init $save --prompt 'The '):"
./build/ferry sample --init "$save" --prompt "The " --tokens 300 --temperature 0.8 --top-k 40 --seed 1 --quiet
echo
