"""Installing the package with pip (offline, no build isolation) and loading
the library it ships; the loader's fallbacks and its error."""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BINDING = os.path.dirname(HERE)
ROOT = os.path.dirname(os.path.dirname(BINDING))
BUILD_LIB = os.path.join(ROOT, "build", "lib")

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import zeroshard
with zeroshard.Context(rank=0, world_size=1) as ctx:
    p = ctx.register("w", "fp32", (3,), init="uniform", seed=1)
    ctx.fetch([p]).wait()
    n = len(p.copy_to())
print(json.dumps({"file": zeroshard.__file__, "library_path": zeroshard.library_path,
                  "version": zeroshard.version(), "nbytes": n}))
"""


def _have_pip():
    r = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    return r.returncode == 0


pytestmark = [
    pytest.mark.skipif(not _have_pip(), reason="pip is not available"),
    pytest.mark.skipif(not os.path.exists(os.path.join(BUILD_LIB, "libzeroshard.so")),
                       reason="the library is not built"),
]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("ZEROSHARD_LIBRARY", "ZEROSHARD_BUILD_DIR", "PYTHONPATH",
                        "LD_LIBRARY_PATH")}
    env.update(extra)
    return env


def pip_install(source, target, env):
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation",
                        "--no-deps", "--no-index", "--disable-pip-version-check", "--quiet",
                        "--target", str(target), str(source)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def probe(target, cwd, env):
    return subprocess.run([sys.executable, "-c", PROBE, str(target)], env=env, cwd=str(cwd),
                          capture_output=True, text=True, timeout=60)


def shipped(target):
    return sorted(n for n in os.listdir(os.path.join(str(target), "zeroshard"))
                  if n.startswith("libzeroshard.so"))


def test_pip_install_ships_the_local_library(tmp_path):
    before = sorted(os.listdir(BINDING))
    target = tmp_path / "site"
    pip_install(BINDING, target, clean_env())
    # Found at ../../build/lib relative to setup.py; one copy of the file.
    assert len(shipped(target)) == 1
    left = [n for n in set(os.listdir(BINDING)) - set(before)
            if n == "build" or n.endswith(".egg-info")]
    assert left == [], "the build left %s in the source tree" % left
    r = probe(target, tmp_path, clean_env())
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(target))
    assert info["library_path"].startswith(os.path.join(str(target), "zeroshard"))
    assert os.path.basename(info["library_path"]).startswith("libzeroshard.so")
    assert info["nbytes"] == 12 and info["version"].count(".") == 2


def _copy_source(tmp_path):
    # A copy of the binding outside the repository: ../../build/lib does not
    # exist from there, so only ZEROSHARD_BUILD_DIR can point at a library.
    src = tmp_path / "work" / "src" / "python"
    shutil.copytree(BINDING, src, ignore=shutil.ignore_patterns(
        "tests", "build", "*.egg-info", "__pycache__", "libzeroshard.so*"))
    assert not os.path.exists(os.path.join(str(src), "..", "..", "build", "lib"))
    return src


def test_build_dir_env_and_install_without_library(tmp_path):
    src = _copy_source(tmp_path)

    with_lib = tmp_path / "with"
    pip_install(src, with_lib, clean_env(ZEROSHARD_BUILD_DIR=os.path.join(ROOT, "build")))
    assert len(shipped(with_lib)) == 1

    without = tmp_path / "without"
    pip_install(src, without, clean_env())
    assert shipped(without) == []
    # Nothing shipped, nothing named, nothing on the loader path: the error
    # lists every place tried.
    r = probe(without, tmp_path, clean_env())
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "next to the package" in r.stderr
    assert "libzeroshard.so.0" in r.stderr and "libzeroshard.so (" in r.stderr
    # The loader path is the last resort.
    r = probe(without, tmp_path, clean_env(LD_LIBRARY_PATH=BUILD_LIB))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert os.path.realpath(info["library_path"]) == os.path.realpath(
        os.path.join(BUILD_LIB, "libzeroshard.so.0"))


def test_explicit_library_wins_and_must_load(tmp_path):
    code = "import sys; sys.path.insert(0, %r); import zeroshard; print(zeroshard.library_path)" \
        % BINDING
    good = os.path.join(BUILD_LIB, "libzeroshard.so")
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(ZEROSHARD_LIBRARY=good),
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == good, r.stderr
    bad = str(tmp_path / "nowhere" / "libzeroshard.so")
    r = subprocess.run([sys.executable, "-c", code],
                       env=clean_env(ZEROSHARD_LIBRARY=bad, LD_LIBRARY_PATH=BUILD_LIB),
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and bad in r.stderr and "ZEROSHARD_LIBRARY" in r.stderr
