#!/usr/bin/env bash
# Run HERE (the Debian dev machine, Debian's package archive reachable).
#
# Fills .gpu-carry/cffi/ (git-ignored through .git/info/exclude) with what
# scripts/gpu_build_cffi.sh needs to build and install cffi on the GPU machine,
# which has a Python without cffi and no network:
#
#   cffi-<ver>/        upstream cffi source from Debian's source package
#                      python-cffi (orig tarball, Debian's patches applied),
#                      trimmed to the C backend (c/), the Python package
#                      (cffi/) and setup.py/setup.cfg/PKG-INFO/LICENSE
#   debs/              libffi-dev (ffi.h, ffitarget.h), libffi8 (libffi.so.8,
#                      only used there when the system has none),
#                      python3-pycparser and python3-ply (pure Python; cffi
#                      needs pycparser, Debian's pycparser imports ply)
#   python-include/    Python headers of a local CPython of the GPU machine's
#                      minor version (default 3.12), used there only when its
#                      interpreter has no Python.h (no python3.X-dev)
#   MANIFEST.txt       versions, sizes and sha256 of what was packed
#
# apt runs with a private configuration under a temp dir: the system's
# sources, lists and package caches are neither read for sources nor written.
#
# Environment:
#   ZS_DEBIAN_SUITE    Debian suite to take the packages from (bookworm)
#   ZS_DEBIAN_MIRROR   archive URL (http://deb.debian.org/debian)
#   ZS_GPU_ARCH        Debian architecture of the GPU machine (amd64)
#   ZS_GPU_PY_MINOR    Python minor version of the GPU machine (3.12)
#   ZS_PY_INCLUDE      Python include dir to carry (default: searched for
#                      python$ZS_GPU_PY_MINOR headers; "none" to skip)
#
# Usage: bash scripts/gpu_pack_cffi.sh
set -euo pipefail

log() { echo "gpu_pack_cffi: $*" >&2; }
die() { echo "gpu_pack_cffi: ERROR: $*" >&2; exit 1; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$ROOT/.gpu-carry/cffi
SUITE=${ZS_DEBIAN_SUITE:-bookworm}
MIRROR=${ZS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ARCH=${ZS_GPU_ARCH:-amd64}
PYMINOR=${ZS_GPU_PY_MINOR:-3.12}

for tool in apt-get tar patch sha256sum; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found"
done

# --- keep .gpu-carry/ out of git ---------------------------------------------
exclude=$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
case $exclude in /*) ;; *) exclude=$ROOT/$exclude ;; esac
mkdir -p "$(dirname "$exclude")"
touch "$exclude"
if ! grep -qxF '/.gpu-carry/' "$exclude"; then
  echo '/.gpu-carry/' >>"$exclude"
  log "added /.gpu-carry/ to $exclude"
fi

# --- private apt configuration -----------------------------------------------
TMP=$(mktemp -d /tmp/zs-pack-cffi.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/lists/partial" "$TMP/dl" "$TMP/src"
signed=
[ -r /usr/share/keyrings/debian-archive-keyring.gpg ] &&
  signed="[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
cat >"$TMP/sources.list" <<EOF
deb ${signed}${MIRROR} ${SUITE} main
deb-src ${signed}${MIRROR} ${SUITE} main
EOF
APT=(apt-get -q
  -o "Dir::Etc::SourceList=$TMP/sources.list"
  -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$TMP/lists"
  -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
  -o "Dir::Cache::Archives=$TMP/dl"
  -o "APT::Sandbox::User=root"
  -o "APT::Architecture=$ARCH" -o "APT::Architectures::=$ARCH")

log "apt-get update ($MIRROR $SUITE main, private lists in $TMP)"
"${APT[@]}" update >"$TMP/update.log" 2>&1 || { cat "$TMP/update.log" >&2; die "apt-get update failed"; }

log "apt-get source --download-only python-cffi"
(cd "$TMP/src" && "${APT[@]}" source --download-only python-cffi >"$TMP/source.log" 2>&1) ||
  { cat "$TMP/source.log" >&2; die "apt-get source python-cffi failed"; }

log "apt-get download libffi-dev libffi8 python3-pycparser python3-ply"
(cd "$TMP/dl" && "${APT[@]}" download libffi-dev libffi8 python3-pycparser python3-ply >"$TMP/download.log" 2>&1) ||
  { cat "$TMP/download.log" >&2; die "apt-get download failed"; }

# --- cffi source: orig tarball + Debian's patches, trimmed -------------------
orig=$(ls "$TMP"/src/python-cffi_*.orig.tar.* 2>/dev/null | head -n1)
[ -n "$orig" ] || die "no python-cffi orig tarball downloaded"
debtar=$(ls "$TMP"/src/python-cffi_*.debian.tar.* 2>/dev/null | head -n1 || true)
tar xf "$orig" --no-same-owner -C "$TMP/src"
srcdir=$(find "$TMP/src" -mindepth 1 -maxdepth 1 -type d -name 'cffi-*' | head -n1)
[ -n "$srcdir" ] && [ -f "$srcdir/c/_cffi_backend.c" ] || die "unexpected layout of $orig"
applied=()
if [ -n "$debtar" ]; then
  mkdir -p "$TMP/deb"
  tar xf "$debtar" -C "$TMP/deb"
  if [ -f "$TMP/deb/debian/patches/series" ]; then
    while read -r p _; do
      case $p in ''|'#'*) continue ;; esac
      patch -d "$srcdir" -p1 -s --forward --no-backup-if-mismatch <"$TMP/deb/debian/patches/$p" ||
        die "Debian patch $p does not apply"
      applied+=("$p")
    done <"$TMP/deb/debian/patches/series"
  fi
fi
rm -rf "$srcdir"/{doc,demo,testing,cffi.egg-info} "$srcdir"/c/libffi_* "$srcdir"/c/test_c.py
find "$srcdir" \( -name '__pycache__' -o -name '*.pyc' \) -prune -exec rm -rf {} +
ver=$(sed -n 's/^Version: *//p' "$srcdir/PKG-INFO" | head -n1)
[ -n "$ver" ] || die "no Version in $srcdir/PKG-INFO"

# --- Python headers for the GPU machine's minor version (fallback) -----------
pyinc=${ZS_PY_INCLUDE:-}
if [ -z "$pyinc" ]; then
  for d in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYMINOR".*/include/python"$PYMINOR" \
           /usr/local/include/python"$PYMINOR" /usr/include/python"$PYMINOR"; do
    if [ -f "$d/Python.h" ] && [ -f "$d/pyconfig.h" ]; then pyinc=$d; fi   # last (newest pyenv) wins
  done
fi

# --- assemble ------------------------------------------------------------------
rm -rf "$DEST"
mkdir -p "$DEST/debs"
cp -a "$srcdir" "$DEST/"
cp "$TMP"/dl/*.deb "$DEST/debs/"
pyinc_ver=none
if [ -n "$pyinc" ] && [ "$pyinc" != none ]; then
  [ -f "$pyinc/Python.h" ] || die "ZS_PY_INCLUDE=$pyinc has no Python.h"
  m=$(basename "$pyinc")            # python3.12
  mkdir -p "$DEST/python-include"
  cp -a "$pyinc" "$DEST/python-include/$m"
  pyinc_ver=$(sed -n 's/^#define PY_VERSION[[:space:]]*"\(.*\)"/\1/p' "$pyinc/patchlevel.h")
  echo "$pyinc_ver" >"$DEST/python-include/$m/ZS_PY_VERSION"
else
  log "WARNING: no python$PYMINOR headers found here; the GPU machine must have Python.h itself"
fi

{
  echo "# packed by scripts/gpu_pack_cffi.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "suite: $MIRROR $SUITE main ($ARCH)"
  echo "cffi: $ver (from $(basename "$orig"); Debian patches: ${applied[*]:-none})"
  echo "python-include: $pyinc_ver${pyinc:+ (from $pyinc)}"
  echo "debs:"
  for f in "$DEST"/debs/*.deb; do echo "  $(basename "$f")"; done
  echo "sha256:"
  (cd "$DEST" && find . -type f ! -name MANIFEST.txt -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sed 's/^/  /')
} >"$DEST/MANIFEST.txt"

log "packed cffi $ver into $DEST ($(du -sh "$DEST" | cut -f1), $(find "$DEST" -type f | wc -l) files)"
log "carry it to the GPU machine with the path .gpu-carry (or .gpu-carry/cffi)"
