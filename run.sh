#!/usr/bin/env bash
# Installs what is missing, builds ferry, and trains the demo model on the bundled corpus.
# Extra arguments go to `ferry train` (e.g. ./run.sh --steps 50).
set -euo pipefail
cd "$(dirname "$0")"
. tools/bootstrap.sh
fy_install_deps
fy_build build
fy_demo_data
exec ./build/ferry train "$@"
