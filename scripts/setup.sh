#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test zeroshard
# (Debian packages for everything native, PyPI into .venv/ for Python), then
# configures and builds into build/. Safe to run again.
#
#   scripts/setup.sh [install] [build]    (no argument: both)
#
# .venv is a link to a venv kept per version of scripts/requirements.txt
# under $ZS_VENV_CACHE (default ~/.cache/zeroshard): torch from PyPI brings
# several GB of CUDA libraries, installed once per machine and reused by
# every clone (CI runs in a fresh one).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(install build)

install_packages() {
  # clang and libclang-rt-14-dev: the libFuzzer targets of scripts/sanitize.sh
  # (ASan, UBSan and TSan come with g++). libopenblas0: the host GEMM of
  # the engine's Muon (impl/device/blas.h, loaded at run time). liburing-dev: the NVMe swapper; fio:
  # the baseline bench/bench_swapper measures it against. iproute2 (ip, tc):
  # bench/bench_quant's rate-limited veth link between two network namespaces.
  # ccache: every build's objects are kept under the venv's cache folder
  # (scripts/ccache.sh), so a machine that built a commit before rebuilds only
  # what changed, in this build and the sanitizer ones.
  packages=(cmake g++ make pkg-config libgloo-dev nlohmann-json3-dev libdlpack-dev
            libgtest-dev googletest python3-venv libxxhash-dev libsodium-dev swig clang libclang-rt-14-dev
            liburing-dev libopenblas0 fio iproute2 ccache)
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # The interpreter that makes the venv: the machine's python3 (3.11). Debian's
  # own python3 needs python3-venv for that; another python3 (pyenv) has it.
  python3 -c "import venv, ensurepip" 2>/dev/null || missing+=(python3-venv)
  # Rust (bindings/rust, std only): a cargo already on PATH (rustup) is used
  # as it is; otherwise Debian 12's cargo-web (Rust 1.85 or later; its plain
  # `cargo` package is 1.65, older than the crates' rust-version 1.77).
  command -v cargo >/dev/null 2>&1 || missing+=(cargo-web)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
  fi

  requirements=scripts/requirements.txt
  key=$( (python3 --version; cat "$requirements") | sha256sum | cut -c1-16)
  venv="${ZS_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/zeroshard}/venv-$key"
  if [ ! -f "$venv/.complete" ]; then
    echo "setup: making the Python environment $venv from $requirements"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements"
    touch "$venv/.complete"
  fi
  if [ -e .venv ] && [ ! -L .venv ]; then
    echo "setup: .venv is a folder, not the link this script makes; leaving it (remove it to use $venv)"
  else
    ln -sfn "$venv" .venv
  fi
}

build_tree() {
  source scripts/ccache.sh
  cmake -S . -B build -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" "${ZS_CCACHE_FLAGS[@]}"
  cmake --build build -j"$(nproc)"
}

for step in "${steps[@]}"; do
  case "$step" in
    install) install_packages ;;
    build) build_tree ;;
    *) echo "usage: scripts/setup.sh [install] [build]" >&2; exit 2 ;;
  esac
done
