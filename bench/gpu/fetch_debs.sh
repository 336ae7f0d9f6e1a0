#!/usr/bin/env bash
# Downloads, on a Debian 12 machine with network, the Debian packages that ferry needs to build and
# run, as .deb files into bench/gpu/debs/ (git-ignored), for bench/gpu/check.sh to unpack on a GPU
# machine where nothing can be installed. Nothing is installed here: `apt-get download` only
# fetches. The list is the packages below plus every package they depend on (recursively, no
# Recommends), less the base system every Linux machine with Python has (libc, libstdc++, python3,
# ...): those must come from the GPU machine itself, since an older copy of them first on
# LD_LIBRARY_PATH would break its PyTorch.
#
# usage: bench/gpu/fetch_debs.sh [--dry-run] [--no-mpi] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")"

out=debs dry=0 mpi=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --no-mpi) mpi=0 ;;
    --out) out="$2"; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "fetch_debs.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

# What ferry's meson.build asks for (libraries and their -dev halves), and the build tools.
pkgs="libdnnl-dev libdnnl2 libjson-c-dev libjson-c5 libjemalloc-dev libjemalloc2 libuv1-dev libuv1
      libhwloc-dev libhwloc15 meson ninja-build pkg-config"
# runtime/comm's MPI backend: meson.build requires MPI for C.
[ "$mpi" = 1 ] && pkgs="$pkgs libopenmpi-dev libopenmpi3 openmpi-bin"

# The base system, taken from the GPU machine (a regex on package names).
base='^(libc6|libc6-dev|libc-dev-bin|linux-libc-dev|libcrypt1|libcrypt-dev|libgcc-s1|libstdc\+\+6|gcc-[0-9]+-base|libgomp1|zlib1g|libzstd1|liblzma5|libbz2-1\.0|libssl3|libselinux1|libpcre2-8-0|perl-base|perl|perl-modules-[0-9.]+|libperl[0-9.]+|debconf|dpkg|tar|bash|coreutils|sensible-utils|python3|python3-minimal|python3\.[0-9]+|python3\.[0-9]+-minimal|libpython3\.[0-9]+-minimal|libpython3\.[0-9]+-stdlib|libpython3-stdlib|python3-pkg-resources|python3-setuptools|libexpat1|libffi8|libsqlite3-0|libncursesw6|libtinfo6|libreadline8|readline-common|media-types|mime-support|tzdata|libuuid1|libmd0|libbsd0|libsystemd0|libudev1|libcap2|libgcrypt20|libgpg-error0|liblz4-1|libdb5\.3|netbase|libnsl2|libtirpc3|libtirpc-common|libkrb5-3|libk5crypto3|libkrb5support0|libkeyutils1|libcom-err2|libgssapi-krb5-2|gcc|gcc-[0-9]+|cpp|cpp-[0-9]+|g\+\+|g\+\+-[0-9]+|libgcc-[0-9]+-dev|libstdc\+\+-[0-9]+-dev|binutils.*|libbinutils|libctf.*|libgprofng0|libjansson4|libisl23|libmpc3|libmpfr6|libgmp10|libasan[0-9]+|liblsan0|libtsan[0-9]+|libubsan1|libquadmath0|libitm1|libatomic1|libcc1-0|lsb-base|sysvinit-utils|init-system-helpers|ucf)$'
# Pulled in by openmpi's packaging but not needed to build or run ferry (Fortran bindings, the
# autotools of its wrapper compilers, ssh for remote launch, X11 for hwloc's viewer, user accounts).
base="${base%)\$}|adduser|passwd|libpam.*|libaudit.*|libcap-ng0|libsemanage.*|libsepol2|debianutils|autoconf|automake|autotools-dev|m4|gfortran.*|libgfortran-[0-9]+-dev|flang-.*|openssh-client|libfido2-1|libcbor.*|libedit2|libx11-.*|libxau6|libxcb1|libxdmcp6|libxext6|libxnvctrl0|libjs-.*)\$"

# The packages to fetch: $pkgs and what they depend on, recursively (Depends and Pre-Depends, no
# Recommends). Of alternatives ("a | b") only the first is taken, and a virtual package is taken as
# its first provider, as apt would on a machine that has none of them; the base system is left out.
closure() {
  python3 - "$base" $pkgs <<'PY'
import re, subprocess, sys
base = re.compile(sys.argv[1])
queue, seen, out = list(sys.argv[2:]), set(), []
while queue:
    p = queue.pop(0)
    if p in seen or base.match(p):
        continue
    seen.add(p)
    r = subprocess.run(["apt-cache", "depends", "--no-recommends", "--no-suggests", "--no-conflicts",
                        "--no-breaks", "--no-replaces", "--no-enhances", p],
                       capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        continue
    out.append(p)
    lines = r.stdout.splitlines()[1:]
    in_group = False  # inside "a | b | c" after its first member
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(\|?)(?:Pre)?Depends: (\S+)", lines[i])
        if not m:
            i += 1
            continue
        alt, name = m.group(1) == "|", m.group(2)
        providers = []
        while i + 1 < len(lines) and re.match(r"^ {4}\S", lines[i + 1]):
            providers.append(lines[i + 1].strip())
            i += 1
        if not in_group:
            if name.startswith("<"):
                name = providers[0] if providers else None
            if name:
                name = name.split(":")[0]
                if name not in seen:
                    queue.append(name)
        in_group = alt
        i += 1
print("\n".join(sorted(out)))
PY
}

if ! apt-cache show libdnnl-dev >/dev/null 2>&1; then
  echo "fetch_debs.sh: apt's package lists lack libdnnl-dev; run apt-get update first" >&2
  [ "$dry" = 1 ] || exit 1
fi
list="$(closure | grep -Ev "$base" || true)"
[ -n "$list" ] || list="$(echo $pkgs | tr ' ' '\n')"
n=$(echo "$list" | wc -l)
if [ "$dry" = 1 ]; then
  echo "would download $n packages into bench/gpu/$out:"
  echo "$list" | tr '\n' ' '
  echo
  exit 0
fi
mkdir -p "$out"
cd "$out"
rm -f ./*.deb
# One call for all: apt-get resolves each name to the candidate version of this machine's release.
# shellcheck disable=SC2086
apt-get download $list
echo "fetch_debs.sh: $(ls ./*.deb | wc -l) packages, $(du -sh . | cut -f1) in bench/gpu/$out"
