"""Build script: the pure-Python package plus, when found, the local library.

The package loads libzeroshard with cffi in ABI mode (no compiler at install
or import). If a built library is found it is shipped inside the package:

  1. $ZEROSHARD_BUILD_DIR/lib/libzeroshard.so*   (a CMake build folder)
  2. ../../build/lib/libzeroshard.so*          (relative to this file: the
                                               repository's default build)

Otherwise the package installs without it and zeroshard._ffi falls back to
$ZEROSHARD_LIBRARY and the dynamic loader's search path.
"""
import atexit
import glob
import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_GLOB = "libzeroshard.so*"


def library_dir():
    """The folder holding libzeroshard.so*, or None."""
    candidates = []
    build_dir = os.environ.get("ZEROSHARD_BUILD_DIR")
    if build_dir:
        candidates.append(os.path.join(os.path.abspath(build_dir), "lib"))
    candidates.append(os.path.normpath(os.path.join(HERE, "..", "..", "build", "lib")))
    for d in candidates:
        if glob.glob(os.path.join(d, LIB_GLOB)):
            return d
    return None


def library_files(d):
    """{installed name: source file} for the library in d: each distinct file
    once (symlinks resolved), under the most specific name it goes by, so
    libzeroshard.so -> .so.0 -> .so.0.1.0 ships one 14 MB file, not three."""
    by_real = {}
    for path in sorted(glob.glob(os.path.join(d, LIB_GLOB))):
        real = os.path.realpath(path)
        if not os.path.isfile(real):
            continue
        name = os.path.basename(path)
        real_name = os.path.basename(real)
        if real_name.startswith("libzeroshard.so"):
            name = real_name
        by_real.setdefault(real, name)
    return {name: real for real, name in by_real.items()}


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "zeroshard")
        # Never ship a stale library left by an earlier build in build_lib.
        for old in glob.glob(os.path.join(target, LIB_GLOB)):
            os.remove(old)
        d = library_dir()
        if d is None:
            self.announce("zeroshard: no libzeroshard.so* found (set ZEROSHARD_BUILD_DIR); "
                          "installing without the library", level=3)
            return
        for name, src in library_files(d).items():
            dst = os.path.join(target, name)
            self.announce("zeroshard: shipping %s as %s" % (src, dst), level=3)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o755)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for this platform."""

    def has_ext_modules(self):
        return library_dir() is not None


def scratch_dir():
    """Build and egg-info folders outside the source tree (pip builds in
    place), removed when this build process exits."""
    d = tempfile.mkdtemp(prefix="zeroshard-setup-")
    atexit.register(shutil.rmtree, d, True)
    return d


SCRATCH = scratch_dir()

setup(
    cmdclass={"build_py": BuildPyWithLibrary},
    distclass=BinaryDistribution,
    options={
        "build": {"build_base": os.path.join(SCRATCH, "build")},
        "egg_info": {"egg_base": SCRATCH},
    },
)
