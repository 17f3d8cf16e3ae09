"""glibc's malloc and a training step's large, short-lived tensors.

glibc serves a block of at least its mmap threshold (128 KiB at first) with
a mapping of its own, unmapped on free; smaller ones come from its arenas,
where a freed block stays resident for reuse. It also raises the threshold
to the size of each mapped block freed, up to 32 MiB, so after the first
step the full-size gradients and activations of every later step come from
the arenas and stay there once freed: 1.1 GiB "free but kept" per rank at
406M (bench/bench_torch_memory.py), on top of what torch and the engine use.
A fixed threshold (mallopt(M_MMAP_THRESHOLD), which also turns the raising
off) keeps every block at or above it a mapping of its own, returned to the
system when torch frees it, at the cost of page faults on every such block.

Off unless asked, as the trade-off is the user's (406M GPT, 2 ranks, peak
RSS per rank, median step; docs/memory.md):
ZS_MALLOC_MMAP_THRESHOLD=1048576 5463 -> 4810 MiB, 15.5 -> 21.9 s. 0 or
unset leaves glibc's own behaviour, as does glibc's MALLOC_MMAP_THRESHOLD_
when set (it acts by itself).

A backward frees the activations as it goes, but glibc keeps their pages
as free heap, while the engine's gradient shards grow beside them (from
its own pool: blocks of 1 MiB and more are mappings of their own, see
impl/device/host_device.cpp), so the backward's end held the gradients
and the forward's activations at once. So the free heap pages go back to
the system (malloc_trim(0), which keeps the heap's layout: the next
forward faults the pages in again) as units' backwards end, each time the
engine's memory grew by GROWTH_PER_TRIM since the last trim (below). With
the engine giving the freed gradients back after each step
(impl/grad/reducer.cpp), 406M GPT, 2 ranks: peak RSS 5049-5185 MiB a rank
without trims, 4219-4225 with these, 4159-4167 trimming after every unit;
GPT-2 124M under the HF Trainer: CPU a step 2.87-2.92, 3.11-3.23 and 3.47
s a rank (docs/memory.md). ZS_MALLOC_TRIM=0 turns them off. The refaults
are most of what the trims cost: zsrun starts its ranks with glibc's heap
on transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, read at
process start only), where they come back 2 MiB a fault and the trims cost
nothing measurable (2.65-2.84 against 2.50-2.96 s without trims, 2.88-3.31
with trims on small pages).
"""
import ctypes
import os

_M_MMAP_THRESHOLD = -3  # malloc.h
_DEFAULT = 0  # off unless asked: see the trade-off in docs/memory.md
_applied = None


def fix_mmap_threshold():
    """Apply the threshold once per process; returns it (None: left alone)."""
    global _applied
    if _applied is not None:
        return _applied or None
    _applied = 0
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return None
    text = os.environ.get("ZS_MALLOC_MMAP_THRESHOLD", str(_DEFAULT))
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"ZS_MALLOC_MMAP_THRESHOLD={text!r}: expected a number of bytes (0: glibc's own)") from None
    if value <= 0:
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(_M_MMAP_THRESHOLD, min(value, 2 ** 31 - 1)) == 1:
        _applied = value
    return _applied or None


_malloc_trim = None


def trim():
    """Give glibc's free heap pages back to the system (malloc_trim(0));
    nothing where the C library is not glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            _malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def trims_on():
    value = os.environ.get("ZS_MALLOC_TRIM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"ZS_MALLOC_TRIM={value!r}: expected 1 (free heap pages go back as the engine's "
                         "memory grows, the default) or 0 (glibc keeps them)")
    return value == "1"


# Every trim makes the next forward fault the returned pages in again, and
# a trim after every unit's backward cost a small model's step 20% of its
# CPU for 5% of its peak. What the heap holds only adds to the peak while
# the engine's own memory (its pools are mappings of their own, apart from
# glibc's heap) grows beside it, as the gradient shards do through the
# backward: so the heap goes back once the engine grew by GROWTH_PER_TRIM
# since the last trim (or since its lowest point after it). The peak then
# stays within about that of trimming after every unit; a model whose
# gradients are small next to its activations hardly trims at all.
GROWTH_PER_TRIM = 64 << 20
_grown_from = None


def trim_as_engine_grows(held):
    """A unit's backward ended, or the backward did, and the engine's host
    memory is `held` bytes (its pools' blocks in use and idle, all
    resident): trim() if that grew by GROWTH_PER_TRIM since the last trim,
    unless ZS_MALLOC_TRIM is 0. Returns whether it trimmed."""
    global _grown_from
    if not trims_on():
        return False
    if _grown_from is None or held < _grown_from:
        _grown_from = held
    if held - _grown_from < GROWTH_PER_TRIM:
        return False
    trim()
    _grown_from = held
    return True
