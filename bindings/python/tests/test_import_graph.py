"""The package's modules import each other without a cycle.

Every module under bindings/python/zeroshard is parsed (not imported), and
each import of a module of the package, at module level or inside a
function, is an edge; the graph must be a DAG. Importing a submodule
implicitly imports its parent packages: that is no edge (a package's
__init__ importing its submodules is the usual layout), only what the
code names is.
"""
import ast
import os
import subprocess
import sys

_PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zeroshard")
_PKG = "zeroshard"


def _modules():
    """{dotted module name: (path, is_package)} of every .py file of the package."""
    mods = {}
    root = os.path.dirname(_PKG_DIR)
    for dirpath, dirnames, filenames in os.walk(_PKG_DIR):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)[:-3].split(os.sep)
            is_pkg = rel[-1] == "__init__"
            if is_pkg:
                rel = rel[:-1]
            mods[".".join(rel)] = (path, is_pkg)
    return mods


def _resolve(name, mods):
    """The package module `name` is, or the nearest enclosing one (an
    attribute of a module, `from x import name`); None outside the package."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _edges(module, path, is_pkg, mods):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when there
            # is one, else a name of pkg itself.
            for a in node.names:
                sub = base + "." + a.name
                targets.append(sub if sub in mods else base)
        for t in targets:
            if not (t == _PKG or t.startswith(_PKG + ".")):
                continue
            target = _resolve(t, mods)
            if target is not None and target != module:
                out.add(target)
    return out


def import_graph():
    mods = _modules()
    return {m: _edges(m, path, is_pkg, mods) for m, (path, is_pkg) in mods.items()}


def find_cycle(graph):
    """One cycle as a list of modules (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    stack = []

    def visit(m):
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if color.get(n, WHITE) == GREY:
                return stack[stack.index(n):] + [n]
            if color.get(n, WHITE) == WHITE:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            found = visit(m)
            if found:
                return found
    return None


def test_graph_is_built():
    graph = import_graph()
    assert "zeroshard.core" in graph and "zeroshard.torch.hooks" in graph
    assert "zeroshard.torch._context" in graph["zeroshard.torch.hooks"]


def test_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    if cycle:
        print("import cycle: " + " -> ".join(cycle))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_fsdp2s_api_loads_on_first_use():
    """`import zeroshard.torch` does not import torch.distributed.fsdp
    (torch.distributed.tensor and sympy under it: half a second of every
    rank's start); the first use of `fully_shard` or a policy does,
    and the names are torch's own classes and zeroshard's function, as when
    they were imported eagerly."""
    code = """
import sys
import zeroshard.torch as zt
assert "torch.distributed.fsdp" not in sys.modules, sorted(m for m in sys.modules if "fsdp" in m)
assert {"fully_shard", "MixedPrecisionPolicy"} <= set(dir(zt))
from zeroshard.torch import MixedPrecisionPolicy
import torch.distributed.fsdp as fsdp
assert MixedPrecisionPolicy is fsdp.MixedPrecisionPolicy
assert zt.OffloadPolicy is fsdp.OffloadPolicy and zt.CPUOffloadPolicy is fsdp.CPUOffloadPolicy
import zeroshard.torch.fsdp2
assert callable(zt.fully_shard) and zt.fully_shard is zeroshard.torch.fsdp2.fully_shard
assert issubclass(zt.ZeroShardFSDPModule, object)
try:
    zt.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e), e
else:
    raise AssertionError("zt.no_such_name did not raise")
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(_PKG_DIR))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
