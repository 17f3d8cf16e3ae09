#!/usr/bin/env bash
# cmake --install, then build a consumer with find_package(zeroshard) and
# another with pkg-config, and run both.
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")" && pwd)
prefix=$(mktemp -d /tmp/zs_install_XXXXXX)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
libdir=$(dirname "$(find "$prefix" -name 'libzeroshard.so' | head -1)")
cmake -S "$src" -B "$prefix/consumer" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/consumer" >/dev/null
LD_LIBRARY_PATH="$libdir" "$prefix/consumer/consumer"
PKG_CONFIG_PATH="$libdir/pkgconfig" cc -std=c99 -Wall -Werror "$src/consumer.c" \
  $(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs zeroshard) -o "$prefix/pc_consumer"
LD_LIBRARY_PATH="$libdir" "$prefix/pc_consumer"
# Only the C API is exported from the shared library.
bad=$(nm -D --defined-only "$libdir/libzeroshard.so" | awk '{print $3}' | grep -v -e '^zs_' -e '^ZEROSHARD_' || true)
if [ -n "$bad" ]; then echo "unexpected exported symbols:"; echo "$bad" | head; exit 1; fi
echo "install check passed"
