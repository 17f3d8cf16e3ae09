"""ZS_MALLOC_MMAP_THRESHOLD and ZS_MALLOC_TRIM (zeroshard/torch/_malloc.py):
glibc's mmap threshold fixed when asked, so a freed large block leaves the
process instead of staying in an arena; left alone when not asked; the
free heap goes back to the system before the optimizer step, and as a
unit's backward ends once the engine's memory grew by GROWTH_PER_TRIM,
unless ZS_MALLOC_TRIM=0 (a model's backward counted on one rank); a bad
value named. Each case in a fresh interpreter (the
setting is per process)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

PROBE = r"""
import ctypes, json, os, sys
from zeroshard.torch._malloc import fix_mmap_threshold

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = fix_mmap_threshold()
# A freed 8 MiB mapping raises glibc's own threshold to 8 MiB; a 2 MiB block
# then comes from the arena unless the threshold is fixed.
libc.free(libc.malloc(8 << 20))
before = libc.mallinfo2().hblkhd
p = libc.malloc(2 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(p)
print(json.dumps({"applied": applied, "mapped": mapped}))
"""

# 64 blocks of 2 MiB from the arena, written and freed: the heap keeps them
# resident until trim_as_engine_grows gives the pages back, once the
# engine's memory (given here) grew by GROWTH_PER_TRIM. The probe fixes
# glibc's thresholds itself (the mmap threshold above the blocks, the trim
# threshold past them) so that the layout the interpreter's imports left
# cannot decide the case: with glibc's defaults a freed run that happens to
# border the top of the heap is trimmed by free() already.
TRIM_PROBE = r"""
import ctypes, json, os
from zeroshard.torch._malloc import GROWTH_PER_TRIM, trim_as_engine_grows

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
assert libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
start = rss()
blocks = [libc.malloc(2 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 2 << 20)
for b in blocks:
    libc.free(b)
freed = rss()
early = trim_as_engine_grows(100 << 20) or trim_as_engine_grows((100 << 20) + GROWTH_PER_TRIM - 1)
kept = rss()
trim_as_engine_grows(50 << 20)  # fell: growth counts from its lowest point since
late = trim_as_engine_grows((50 << 20) + GROWTH_PER_TRIM)
print(json.dumps({"kept": freed - start, "early": early, "kept_while_short": freed - kept, "late": late,
                  "returned": freed - rss()}))
"""


def probe(code=PROBE, **env):
    e = dict(os.environ)
    for k in ("MALLOC_MMAP_THRESHOLD_", "ZS_MALLOC_MMAP_THRESHOLD", "ZS_MALLOC_TRIM"):
        e.pop(k, None)
    e.update(env)
    e["PYTHONPATH"] = str(REPO / "bindings" / "python") + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("ZEROSHARD_LIBRARY", str(REPO / "build" / "lib" / "libzeroshard.so"))
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_left_to_glibc_unless_asked():
    import json
    r = probe()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out == {"applied": None, "mapped": 0}, out


def test_a_fixed_threshold_maps_large_blocks_of_their_own():
    import json
    r = probe(ZS_MALLOC_MMAP_THRESHOLD="1048576")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["applied"] == 1048576 and out["mapped"] >= 2 << 20, out


def test_glibcs_own_variable_is_left_to_act():
    import json
    r = probe(MALLOC_MMAP_THRESHOLD_="1048576", ZS_MALLOC_MMAP_THRESHOLD="4194304")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["applied"] is None and out["mapped"] >= 2 << 20, out


def test_a_bad_value_is_named():
    r = probe(ZS_MALLOC_MMAP_THRESHOLD="lots")
    assert r.returncode != 0 and "ZS_MALLOC_MMAP_THRESHOLD='lots'" in r.stderr, r.stderr


def test_the_heap_a_backward_freed_goes_back_once_the_engine_grew_unless_turned_off():
    import json
    on = probe(TRIM_PROBE)
    assert on.returncode == 0, on.stderr
    out = json.loads(on.stdout.splitlines()[-1])
    assert out["kept"] >= 100 << 20, f"the freed blocks were not kept resident to begin with: {out}"
    assert not out["early"] and out["kept_while_short"] < 16 << 20, out
    assert out["late"] and out["returned"] >= 100 << 20, out
    off = probe(TRIM_PROBE, ZS_MALLOC_TRIM="0")
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout.splitlines()[-1])["returned"] < 16 << 20, off.stdout
    bad = probe(TRIM_PROBE, ZS_MALLOC_TRIM="yes")
    assert bad.returncode != 0 and "ZS_MALLOC_TRIM='yes'" in bad.stderr, bad.stderr


# One rank, three Linear units (each over the persistence threshold, so
# released after its backward, each a 1 MiB gradient): the trims a backward
# and a step make, with the growth per trim argv[2] (0: the default).
BACKWARD_PROBE = r"""
import json, sys
import torch
import zeroshard.torch as zt
from zeroshard.torch import _malloc

if int(sys.argv[2]):
    _malloc.GROWTH_PER_TRIM = int(sys.argv[2])
calls = [0]
real = _malloc.trim
def counted():
    calls[0] += 1
    real()
_malloc.trim = counted
zt.init_context(rank=0, world_size=1, file_store_path=sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                            torch.nn.Linear(512, 512))
zt.partition_module(model)
opt = zt.ZeroShardOptimizer(model.parameters(), lr=0.1)
model(torch.randn(8, 512)).pow(2).mean().backward()
backward = calls[0]
opt.step()
print(json.dumps({"backward": backward, "step": calls[0] - backward}))
"""


def test_the_heap_goes_back_as_the_engines_gradients_grow(tmp_path):
    import json
    pytest.importorskip("torch")

    def trims(name, growth, **env):
        probe_text = BACKWARD_PROBE.replace("sys.argv[1]", repr(str(tmp_path / name)))
        r = probe(probe_text.replace("int(sys.argv[2])", str(growth)), ZS_DEVICE="cpu", **env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.splitlines()[-1])

    # Each unit's gradient grows the engine by 1 MiB: with a growth of
    # 1 MiB a trim, the units after the first trim; under the default
    # (64 MiB) this model never grows enough to.
    per_unit = trims("store_unit", 1 << 20)
    assert per_unit["backward"] >= 2, per_unit
    assert trims("store_default", 0) == {"backward": 0, "step": 0}
    assert trims("store_off", 1 << 20, ZS_MALLOC_TRIM="0") == {"backward": 0, "step": 0}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
