# Sourced by scripts/setup.sh and scripts/sanitize.sh: ZS_CCACHE_FLAGS, the
# CMake arguments that compile through ccache when it is installed
# (ZS_CCACHE=0: without). The objects live beside the venv under
# ~/.cache/zeroshard/ccache ($ZS_CCACHE_DIR), where a CI machine that keeps
# its venv keeps them too, and are shared by every clone: paths inside the
# clone are hashed relative to it (base_dir) and -g's compile directory is
# not hashed, so a clone in another folder hits the same objects.
ZS_CCACHE_FLAGS=()
if [ "${ZS_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  zs_ccache_dir="${ZS_CCACHE_DIR:-${ZS_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/zeroshard}/ccache}"
  mkdir -p "$zs_ccache_dir"
  # The build and three sanitizer builds of one commit take about 3 GB.
  [ -f "$zs_ccache_dir/ccache.conf" ] || echo "max_size = 12G" >"$zs_ccache_dir/ccache.conf"
  zs_launcher="env;CCACHE_DIR=$zs_ccache_dir;CCACHE_BASEDIR=$PWD;CCACHE_NOHASHDIR=1;ccache"
  ZS_CCACHE_FLAGS=(-DCMAKE_C_COMPILER_LAUNCHER="$zs_launcher" -DCMAKE_CXX_COMPILER_LAUNCHER="$zs_launcher"
                   -DCMAKE_CUDA_COMPILER_LAUNCHER="$zs_launcher")
  unset zs_launcher
fi
