"""Make the in-tree package importable and point it at the in-tree library.

bindings/python goes on sys.path; ZEROSHARD_LIBRARY defaults to the
repository's build/lib/libzeroshard.so (found from this file's location) when
the environment does not name a library.

ZS_DEVICE defaults to "cpu" for the tests (and the workers they launch):
they read engine memory through host pointers (ctypes, numpy), which a
context on a GPU would not give them. Tests of the CUDA path
(test_cuda.py) name their device explicitly.
"""
import os
import sys

_BINDING = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = os.path.dirname(os.path.dirname(_BINDING))

if _BINDING not in sys.path:
    sys.path.insert(0, _BINDING)
if not os.environ.get("ZEROSHARD_LIBRARY"):
    os.environ["ZEROSHARD_LIBRARY"] = os.path.join(_ROOT, "build", "lib", "libzeroshard.so")
if not os.environ.get("ZS_DEVICE"):
    os.environ["ZS_DEVICE"] = "cpu"
