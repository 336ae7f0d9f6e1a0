# Sourced by run.sh and test.sh: installs the Debian packages ferry needs (when missing) and
# builds it with meson and ninja. Safe to run again; it only does what is missing.

FY_DEBS="gcc g++ pkg-config meson ninja-build python3 libdnnl-dev libjson-c-dev libjemalloc-dev libuv1-dev libhwloc-dev libxxhash-dev clang libclang-rt-14-dev openmpi-bin libopenmpi-dev"

fy_install_deps() {
  local missing=""
  for p in $FY_DEBS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  [ -z "$missing" ] && return 0
  fy_apt_install $missing
}

# fy_apt_install PKG...: installs Debian packages (apt-get update first).
fy_apt_install() {
  echo "ferry: installing Debian packages: $*"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q >/dev/null || { echo "ferry: apt-get update failed" >&2; return 1; }
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@" >/dev/null \
    || { echo "ferry: apt-get install $* failed" >&2; return 1; }
}

# fy_build DIR [meson options...]
fy_build() {
  local dir="$1"; shift
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" "$@" >"$dir.setup.log" 2>&1 || { cat "$dir.setup.log" >&2; return 1; }
  fi
  ninja -C "$dir" >"$dir.build.log" 2>&1 || { tail -40 "$dir.build.log" >&2; return 1; }
}

# The demo data: the bundled corpus, tokenized byte by byte (no download, no tokenizer package).
fy_demo_data() {
  if ! ls data/demo/*.bin >/dev/null 2>&1; then
    mkdir -p data/demo
    python3 tools/tokenize.py --tokenizer bytes --out data/demo/corpus data/corpus.txt
  fi
}

# fy_reference_python: the Python the reference checks run with (torch, transformers, safetensors
# and numpy, from PyPI), in a virtual environment of the project's: $FERRY_VENV, or ferry/venv in
# the user's cache directory (~/.cache), so that every checkout and CI run on the machine shares
# the one install of a few GB. Made, or completed, when a package is missing; its bin/ then goes
# first on PATH, so the scripts' python3 is that one. A machine with the packages in its own
# python3 uses that instead.
# Returns 1, saying why, when they cannot be had (no network, no venv module): the checks that
# need them are then skipped and counted as skipped.
FY_PY_REFS="torch transformers safetensors numpy"
fy_reference_python() {
  local imports="import torch, transformers, safetensors, numpy"
  python3 -c "$imports" 2>/dev/null && return 0
  local venv="${FERRY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry/venv}"
  if [ ! -x "$venv/bin/python3" ]; then
    mkdir -p "$(dirname "$venv")" || return 1
    python3 -m venv "$venv" >"$venv.log" 2>&1 || {
      # Debian's python3 keeps the venv module in a package of its own.
      fy_apt_install python3-venv && python3 -m venv "$venv" >"$venv.log" 2>&1
    } || { echo "ferry: could not make a virtual environment in $venv (see $venv.log)" >&2; return 1; }
  fi
  if ! "$venv/bin/python3" -c "$imports" 2>/dev/null; then
    echo "ferry: installing $FY_PY_REFS into $venv (the reference checks' Python; a few GB, once)"
    "$venv/bin/python3" -m pip install -q --disable-pip-version-check $FY_PY_REFS >>"$venv.log" 2>&1 \
      || { echo "ferry: pip install $FY_PY_REFS failed (see $venv.log)" >&2; return 1; }
  fi
  PATH="$venv/bin:$PATH"
  export PATH
}
