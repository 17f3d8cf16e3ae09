#!/usr/bin/env bash
# Packs what the GPU proof (scripts/gpu_check.sh) needs into .gpu-carry/,
# on a machine that builds but has no GPU: the programs and library of a
# CUDA build, stripped of debug info, and the shared libraries a CUDA
# machine's image may lack (Gloo and what it links). The folder is ignored
# by git; hand it to the GPU machine next to a checkout of the same commit.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh >/dev/null
[ -x build/bin/bench_gpu_kernels ] || {
  echo "gpu_pack: build/ has no CUDA programs (was nvcc found at configure time?)" >&2
  exit 1
}

out=.gpu-carry
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >>.git/info/exclude
rm -rf "$out/bin" "$out/lib"
mkdir -p "$out/bin" "$out/lib"
for p in zs_tests train_mlp zsrun gather_layers bench_gpu_kernels; do
  strip --strip-debug -o "$out/bin/$p" "build/bin/$p"
done
strip --strip-debug -o "$out/lib/libzeroshard.so.0" build/lib/libzeroshard.so.0.*
ln -sf libzeroshard.so.0 "$out/lib/libzeroshard.so"
# Everything the programs link beyond the C and C++ runtimes, which the
# GPU machine has in newer versions.
ldd build/lib/libzeroshard.so build/bin/zs_tests build/bin/train_mlp |
  awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*|libzeroshard)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
# cffi for the Python binding (the GPU image has none and cannot download).
[ -d "$out/cffi" ] || scripts/gpu_pack_cffi.sh
git rev-parse HEAD >"$out/commit"
du -sh "$out"
