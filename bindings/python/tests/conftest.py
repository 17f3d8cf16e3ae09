"""Make the in-tree package importable and point it at the in-tree library.

bindings/python goes on sys.path; ZEROSHARD_LIBRARY defaults to the
repository's build/lib/libzeroshard.so (found from this file's location) when
the environment does not name a library.
"""
import os
import sys

_BINDING = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = os.path.dirname(os.path.dirname(_BINDING))

if _BINDING not in sys.path:
    sys.path.insert(0, _BINDING)
if not os.environ.get("ZEROSHARD_LIBRARY"):
    os.environ["ZEROSHARD_LIBRARY"] = os.path.join(_ROOT, "build", "lib", "libzeroshard.so")
