# Sourced by run.sh and test.sh: installs the Debian packages ferry needs (when missing) and
# builds it with meson and ninja. Safe to run again; it only does what is missing.

FY_DEBS="gcc g++ pkg-config meson ninja-build python3 libdnnl-dev libjson-c-dev libjemalloc-dev libuv1-dev libhwloc-dev libxxhash-dev clang libclang-rt-14-dev openmpi-bin libopenmpi-dev"

fy_install_deps() {
  local missing=""
  for p in $FY_DEBS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  [ -z "$missing" ] && return 0
  echo "ferry: installing Debian packages:$missing"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q >/dev/null || { echo "ferry: apt-get update failed" >&2; return 1; }
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends $missing >/dev/null \
    || { echo "ferry: apt-get install$missing failed" >&2; return 1; }
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
