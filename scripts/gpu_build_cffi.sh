#!/usr/bin/env bash
# Run THERE (the GPU machine: no network, cwd anywhere; repo root found from
# this script's path). Makes cffi importable by ${PYTHON:-python3} from what
# scripts/gpu_pack_cffi.sh packed into .gpu-carry/cffi/:
#
#   1. if "$PYTHON -c 'import cffi'" already works: nothing to do;
#   2. extracts the carried .debs (dpkg-deb -x; else ar x + tar; else Python's
#      own ar/tar reader) into a temp prefix: libffi headers, pycparser, ply;
#   3. compiles cffi's C backend (_cffi_backend) straight with the C compiler
#      (the same flags and macros as cffi's setup.py, no setuptools/pip
#      needed), against the carried libffi headers and the system's
#      libffi.so.8 (or, if the system has none, the carried libffi8's
#      libffi.so.8, copied next to the module and found through an rpath);
#   4. installs _cffi_backend, the cffi, pycparser and ply packages and their
#      metadata (so pip sees cffi as installed) into $ZS_CFFI_SITE
#      (/tmp/zs-site), checks that cffi works from there.
#
# All progress goes to stderr. The last (only) line on stdout is a shell
# command for the caller:
#   eval "$(bash scripts/gpu_build_cffi.sh)"      # sets PYTHONPATH
# which is "export PYTHONPATH=/tmp/zs-site:$PYTHONPATH" (":" when cffi was
# already importable). Exit status is nonzero, with an ERROR line, on failure.
#
# Environment:
#   PYTHON          interpreter to build for (python3)
#   ZS_CFFI_SITE    install target (/tmp/zs-site)
#   ZS_CFFI_CARRY   packed folder (<repo>/.gpu-carry/cffi)
#   ZS_CFFI_FORCE   non-empty: build even if cffi is importable already
#   ZS_DEB_EXTRACT  auto|dpkg|ar|python: how to unpack the .debs (auto)
#   ZS_CFFI_BUNDLE_LIBFFI  non-empty: ignore the system's libffi.so.8, ship the
#                   carried one (what happens anyway when the system has none)
#   ZS_KEEP_WORK    non-empty: keep the temp build folder
#   CC              C compiler (gcc, else cc)
set -euo pipefail

log() { echo "gpu_build_cffi: $*" >&2; }
die() { echo "gpu_build_cffi: ERROR: $*" >&2; exit 1; }

PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CARRY=${ZS_CFFI_CARRY:-$ROOT/.gpu-carry/cffi}
SITE=${ZS_CFFI_SITE:-/tmp/zs-site}
EXPORT_LINE="export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}"

command -v "$PY" >/dev/null 2>&1 || die "interpreter '$PY' not found (set PYTHON=...)"
PYEXE=$("$PY" -c 'import sys; print(sys.executable)') || die "'$PY' does not run"
PYVER=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
PYMINOR=${PYVER%.*}

if [ -z "${ZS_CFFI_FORCE:-}" ] && "$PY" -c 'import cffi' >/dev/null 2>&1; then
  log "cffi $("$PY" -c 'import cffi; print(cffi.__version__, "at", cffi.__file__)') is already importable by $PYEXE; nothing to do"
  echo ':'
  exit 0
fi

# Smoke test of a site folder: exit 0 when cffi works from it.
SMOKE='
import sys
import cffi, _cffi_backend
site = sys.argv[1]
assert cffi.__file__.startswith(site), "cffi not taken from %s: %s" % (site, cffi.__file__)
assert cffi.__version__ == _cffi_backend.__version__, (cffi.__version__, _cffi_backend.__version__)
ffi = cffi.FFI()
ffi.cdef("int abs(int); size_t strlen(const char *);")
C = ffi.dlopen(None)
assert C.abs(-3) == 3
buf = bytearray(b"zeroshard\0")
assert C.strlen(ffi.from_buffer(buf)) == 9
p = ffi.new("int[4]", [1, 2, 3, 4])
assert ffi.cast("int *", p)[3] == 4
print("cffi %s (%s) OK for Python %s" % (cffi.__version__, _cffi_backend.__file__, sys.version.split()[0]))
'
smoke() { PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "$SMOKE" "$SITE"; }

[ -d "$CARRY" ] || die "$CARRY not found: run scripts/gpu_pack_cffi.sh on the dev machine and carry .gpu-carry"
SRC=$(find "$CARRY" -mindepth 1 -maxdepth 1 -type d -name 'cffi-*' | head -n1)
[ -n "$SRC" ] && [ -f "$SRC/c/_cffi_backend.c" ] && [ -d "$SRC/cffi" ] || die "no cffi source in $CARRY"
CFFI_VER=$(sed -n 's/^Version: *//p' "$SRC/PKG-INFO" | head -n1)
STAMP="cffi $CFFI_VER for $PYEXE $PYVER"

if [ -z "${ZS_CFFI_FORCE:-}" ] && [ "$(cat "$SITE/.zs-cffi-stamp" 2>/dev/null)" = "$STAMP" ] && smoke >&2 2>/dev/null; then
  log "$SITE already holds a working $STAMP; reusing it"
  echo "$EXPORT_LINE"
  exit 0
fi

WORK=$(mktemp -d /tmp/zs-cffi-build.XXXXXX)
cleanup() { [ -n "${ZS_KEEP_WORK:-}" ] && log "work dir kept: $WORK" || rm -rf "$WORK"; }
trap cleanup EXIT

# --- unpack the .debs -------------------------------------------------------
PY_DEB_EXTRACT='
import io, os, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
with open(deb, "rb") as f:
    data = f.read()
if data[:8] != b"!<arch>\n":
    sys.exit("%s: not an ar archive" % deb)
pos = 8
while pos + 60 <= len(data):
    hdr = data[pos:pos + 60]
    name = hdr[:16].decode().strip().rstrip("/")
    size = int(hdr[48:58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    pos += 60 + size + (size & 1)
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as t:
            if hasattr(tarfile, "tar_filter"):
                t.extractall(dest, filter="tar")
            else:
                t.extractall(dest)
        sys.exit(0)
sys.exit("%s: no data.tar member" % deb)
'
deb_extract() {   # deb dest
  local deb=$1 dest=$2 how=${ZS_DEB_EXTRACT:-auto}
  mkdir -p "$dest"
  if { [ "$how" = auto ] || [ "$how" = dpkg ]; } && command -v dpkg-deb >/dev/null 2>&1; then
    dpkg-deb -x "$deb" "$dest" && return 0
    log "dpkg-deb -x $(basename "$deb") failed"
  fi
  if { [ "$how" = auto ] || [ "$how" = ar ]; } && command -v ar >/dev/null 2>&1; then
    local t
    t=$(mktemp -d "$WORK/ar.XXXXXX")
    if (cd "$t" && ar x "$deb" && tar xf data.tar.* -C "$dest"); then return 0; fi
    log "ar x + tar xf of $(basename "$deb") failed"
  fi
  if [ "$how" = auto ] || [ "$how" = python ]; then
    "$PY" -c "$PY_DEB_EXTRACT" "$deb" "$dest" && return 0
    log "Python extraction of $(basename "$deb") failed"
  fi
  return 1
}

PREFIX=$WORK/prefix
for pkg in libffi-dev python3-pycparser python3-ply; do
  deb=$(ls "$CARRY"/debs/${pkg}_*.deb 2>/dev/null | head -n1)
  [ -n "$deb" ] || die "no ${pkg}_*.deb in $CARRY/debs"
  deb_extract "$deb" "$PREFIX" || die "cannot unpack $deb (no dpkg-deb, ar+tar or Python tarfile that works)"
done
DIST=$PREFIX/usr/lib/python3/dist-packages
[ -f "$DIST/pycparser/__init__.py" ] && [ -f "$DIST/ply/__init__.py" ] || die "pycparser/ply missing after unpacking"

# --- C compiler, libffi headers and library ------------------------------------
CC=${CC:-$(command -v gcc || command -v cc || true)}
[ -n "$CC" ] || die "no C compiler (gcc/cc) found"

case $(uname -m) in
  x86_64) DEBARCH=amd64 TRIPLET=x86_64-linux-gnu ;;
  aarch64) DEBARCH=arm64 TRIPLET=aarch64-linux-gnu ;;
  *) DEBARCH=$(uname -m) TRIPLET=$(uname -m)-linux-gnu ;;
esac
FFI_INC=
libffi_dev=$(ls "$CARRY"/debs/libffi-dev_*_"$DEBARCH".deb 2>/dev/null | head -n1 || true)
if [ -n "$libffi_dev" ]; then
  FFI_INC=$(dirname "$(find "$PREFIX/usr/include" -name ffi.h | head -n1)")
  [ -f "$FFI_INC/ffitarget.h" ] || die "ffitarget.h missing in $FFI_INC"
elif echo '#include <ffi.h>' | "$CC" -E -x c - >/dev/null 2>&1; then
  log "carried libffi-dev is not for $DEBARCH; using the system's ffi.h"
else
  die "carried libffi-dev is not for this machine ($(uname -m)) and the system has no ffi.h"
fi

# libffi.so.8: the system's (any path the dynamic loader knows), else the carried one.
LIBDIR=$WORK/lib
mkdir -p "$LIBDIR"
sys_ffi=
if [ -z "${ZS_CFFI_BUNDLE_LIBFFI:-}" ]; then
  for c in /usr/lib/$TRIPLET/libffi.so.8 /lib/$TRIPLET/libffi.so.8 /usr/lib64/libffi.so.8 \
           /lib64/libffi.so.8 /usr/lib/libffi.so.8 /usr/local/lib/libffi.so.8 \
           $( { /sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null || true; } |
              awk '$1 == "libffi.so.8" {print $NF}'); do
    if [ -e "$c" ]; then sys_ffi=$c; break; fi
  done
fi
RPATH=()
if [ -n "$sys_ffi" ]; then
  log "linking against the system's $sys_ffi"
  ln -s "$sys_ffi" "$LIBDIR/libffi.so"
else
  libffi8=$(ls "$CARRY"/debs/libffi8_*_"$DEBARCH".deb 2>/dev/null | head -n1 || true)
  [ -n "$libffi8" ] || die "the system has no libffi.so.8 and no libffi8 .deb for $DEBARCH was carried"
  deb_extract "$libffi8" "$PREFIX" || die "cannot unpack $libffi8"
  so=$(find "$PREFIX" -name 'libffi.so.8.*' -type f | head -n1)
  [ -n "$so" ] || die "no libffi.so.8.* in $libffi8"
  log "${ZS_CFFI_BUNDLE_LIBFFI:+ZS_CFFI_BUNDLE_LIBFFI set}${ZS_CFFI_BUNDLE_LIBFFI:-the system has no libffi.so.8}: shipping the carried $(basename "$so") next to _cffi_backend"
  mkdir -p "$WORK/stage/_zs_cffi_libs"
  cp "$so" "$WORK/stage/_zs_cffi_libs/libffi.so.8"
  ln -s "$WORK/stage/_zs_cffi_libs/libffi.so.8" "$LIBDIR/libffi.so"
  # shellcheck disable=SC2054  # one linker argument, commas intended
  RPATH=(-Wl,-rpath,'$ORIGIN/_zs_cffi_libs')
fi

# --- Python headers --------------------------------------------------------------
read -r INCLUDEPY EXT_SUFFIX < <("$PY" -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))')
[ -n "$EXT_SUFFIX" ] || die "cannot read EXT_SUFFIX from $PYEXE"
PY_INC=$INCLUDEPY
if [ ! -f "$PY_INC/Python.h" ]; then
  alt=$CARRY/python-include/python$PYMINOR
  if [ -f "$alt/Python.h" ]; then
    log "WARNING: $PYEXE has no Python.h in $INCLUDEPY (no python$PYMINOR-dev);" \
        "using the carried headers of Python $(cat "$alt/ZS_PY_VERSION" 2>/dev/null || echo "$PYMINOR.?") (same minor version, same ABI)"
    PY_INC=$alt
  else
    die "$PYEXE has no Python.h ($INCLUDEPY) and no python$PYMINOR headers were carried"
  fi
fi

# --- compile _cffi_backend ----------------------------------------------------
CFLAGS_ZS=(-O2 -g0 -fPIC -fwrapv -fno-strict-aliasing -DNDEBUG -DFFI_BUILDING=1 -Wno-deprecated-declarations)
# The same probes as cffi's setup.py.
echo '__thread int some_threadlocal_variable_42;' >"$WORK/t1.c"
"$CC" -c "$WORK/t1.c" -o "$WORK/t1.o" >/dev/null 2>&1 && CFLAGS_ZS+=(-DUSE__THREAD)
echo 'int main(void) { __sync_synchronize(); return 0; }' >"$WORK/t2.c"
"$CC" "$WORK/t2.c" -o "$WORK/t2" >/dev/null 2>&1 && CFLAGS_ZS+=(-DHAVE_SYNC_SYNCHRONIZE)

mkdir -p "$WORK/stage"
MOD=$WORK/stage/_cffi_backend$EXT_SUFFIX
INC=()
[ -n "$FFI_INC" ] && INC+=(-I"$FFI_INC")
INC+=(-I"$PY_INC")
log "compiling cffi $CFFI_VER's _cffi_backend for Python $PYVER ($PYEXE) with $CC"
"$CC" -shared "${CFLAGS_ZS[@]}" "${INC[@]}" "$SRC/c/_cffi_backend.c" \
  -L"$LIBDIR" -lffi ${RPATH[@]+"${RPATH[@]}"} -o "$MOD" >"$WORK/cc.log" 2>&1 ||
  { cat "$WORK/cc.log" >&2; die "compiling _cffi_backend failed"; }

# --- install into $SITE ----------------------------------------------------------
mkdir -p "$SITE"
rm -rf "$SITE"/_cffi_backend.* "$SITE"/_zs_cffi_libs "$SITE"/cffi "$SITE"/cffi-*.dist-info \
       "$SITE"/pycparser "$SITE"/pycparser-*.egg-info "$SITE"/ply "$SITE"/ply-*.egg-info "$SITE"/.zs-cffi-stamp
cp "$MOD" "$SITE/"
[ -d "$WORK/stage/_zs_cffi_libs" ] && cp -a "$WORK/stage/_zs_cffi_libs" "$SITE/"
cp -R "$SRC/cffi" "$SITE/cffi"
cp -R "$DIST"/pycparser "$DIST"/pycparser-*.egg-info "$DIST"/ply "$DIST"/ply-*.egg-info "$SITE/"
mkdir -p "$SITE/cffi-$CFFI_VER.dist-info"
{
  echo "Metadata-Version: 2.1"
  echo "Name: cffi"
  echo "Version: $CFFI_VER"
  echo "Summary: Foreign Function Interface for Python calling C code."
  echo "License: MIT"
  echo "Requires-Dist: pycparser"
} >"$SITE/cffi-$CFFI_VER.dist-info/METADATA"
echo "zeroshard-gpu_build_cffi" >"$SITE/cffi-$CFFI_VER.dist-info/INSTALLER"
echo "cffi" >"$SITE/cffi-$CFFI_VER.dist-info/top_level.txt"
: >"$SITE/cffi-$CFFI_VER.dist-info/RECORD"
"$PY" -m compileall -q "$SITE/cffi" "$SITE/pycparser" "$SITE/ply" >/dev/null 2>&1 || true

smoke >&2 || die "cffi built but does not work from $SITE (see above)"
echo "$STAMP" >"$SITE/.zs-cffi-stamp"
log "installed into $SITE; callers: $EXPORT_LINE"
echo "$EXPORT_LINE"
