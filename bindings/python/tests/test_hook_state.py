"""What zeroshard.torch's hooks keep of the process's context is one object
per context (hook_state.HookState, from hook_state.hook_state()), not module
globals.

The hook modules and optim.py are parsed for module-level containers and
`global` statements; the imported hook modules are checked for mutable
attributes; and one process (world size 1, no launcher) checks the state's
life: made before the context when hooks run first and then the context's,
dropped by shutdown(), except the scopes a forward opened, which the
forward's post-hook still closes when shutdown() runs inside it.
"""
import ast
import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TORCH_PKG = HERE.parent / "zeroshard" / "torch"

_MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
_MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "deque", "defaultdict", "OrderedDict", "Counter",
                  "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}


def _module_level_mutables(path):
    """(line, name) of each module-level assignment of a mutable container,
    and of each `global` statement anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = ", ".join(ast.unparse(t) for t in targets)
            if isinstance(value, _MUTABLE_NODES):
                found.append((node.lineno, names))
            elif isinstance(value, ast.Call):
                fn = value.func
                called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if called in _MUTABLE_CALLS:
                    found.append((node.lineno, names))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append((node.lineno, "global " + ", ".join(node.names)))
    return found


def test_the_check_finds_module_level_state(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import collections\n_a = []\n_b = {'x': 1}\n_c = collections.deque()\n_D = (1, 2)\n"
                    "def f():\n    global _e\n    _e = 1\n")
    assert [n for _, n in _module_level_mutables(path)] == ["_a", "_b", "_c", "global _e"]


# The modules the hooks are made of (hooks.py and the concepts split out of it).
_HOOK_MODULES = ["hooks", "hook_state", "gather_unit", "forward_scope", "frozen_call", "grad_arrival",
                 "leaf_modules", "hollow", "_autograd"]


@pytest.mark.parametrize("name", [m + ".py" for m in _HOOK_MODULES] + ["optim.py"])
def test_no_module_level_mutable_state(name):
    found = _module_level_mutables(TORCH_PKG / name)
    assert not found, (f"zeroshard/torch/{name} keeps module-level state {found}: what the hooks keep of "
                       "the context belongs in hook_state.HookState (hook_state.hook_state())")


@pytest.mark.parametrize("name", _HOOK_MODULES)
def test_imported_hooks_module_holds_no_mutable_attribute(name):
    pytest.importorskip("torch")
    import importlib
    from zeroshard.torch.hook_state import HookState
    module = importlib.import_module("zeroshard.torch." + name)
    mutable = (list, dict, set, bytearray, collections.deque, HookState)
    bad = sorted(k for k, v in vars(module).items() if not k.startswith("__") and isinstance(v, mutable))
    assert not bad, f"zeroshard.torch.{name} has module-level mutable state: {bad}"


_WORKER = textwrap.dedent('''
    import json, sys
    import torch
    import torch.nn as nn
    import zeroshard.torch as zt
    from zeroshard.torch import saved
    from zeroshard.torch.hook_state import hook_state

    store = sys.argv[1]
    out = {}
    n = [0]

    def context():
        n[0] += 1
        return zt.init_context(rank=0, world_size=1, file_store_path=f"{store}.{n[0]}")

    class Shutter(nn.Module):
        def forward(self, x):
            zt.shutdown()
            return x

    class Outer(nn.Module):
        def __init__(self, shut=False):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), Shutter() if shut else nn.Identity())
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.inner(x))

    x = torch.randn(3, 4)
    # No context: the default state, the same object at every call.
    s0 = hook_state()
    out["no_context"] = zt.current_context() is None
    out["same_object"] = s0 is hook_state()
    out["defaults"] = [len(s0.running), len(s0.opened), s0.step_open, s0.scopes, s0.inference, s0.loss_scale,
                       s0.scaled_backwards, len(s0.ran)]
    m = Outer()
    zt.partition_module(m)  # creates the context: the state is still s0
    out["context_keeps_state"] = hook_state() is s0
    opt = zt.ZeroShardOptimizer(m.parameters(), lr=0.1)
    m(x).pow(2).mean().backward()
    out["in_step"] = [s0.step_open, len(s0.ran), m._zs_hooks.ran]
    opt.step()
    out["after_step"] = [s0.step_open, len(s0.ran), m._zs_hooks.ran]
    m(x).sum()  # a step left open at shutdown
    engine = m._zs_hooks
    zt.shutdown()
    s1 = hook_state()
    out["shutdown_drops_state"] = s1 is not s0
    out["after_shutdown"] = [s1.step_open, s1.scopes, len(s1.running), len(s1.opened), len(s1.ran), engine.ran]

    # shutdown() inside a scope a submodule opened: its post-hook closes it.
    context()
    m2 = Outer(shut=True)
    zt.partition_module(m2)
    m2.inner(x)
    s2 = hook_state()
    out["shutdown_in_scope"] = [zt.current_context() is None, len(saved._active), len(s2.opened), s2.scopes]
    print("RESULT " + json.dumps(out))
''')


def test_state_is_the_contexts(tmp_path):
    pytest.importorskip("torch")
    lib = os.environ.get("ZEROSHARD_LIBRARY", "")
    if not os.path.exists(lib):
        pytest.skip(f"{lib or 'libzeroshard.so'} is not built")
    worker = tmp_path / "hook_state_worker.py"
    worker.write_text(_WORKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env["ZS_DEVICE"] = "cpu"
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path / "store")], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert r["no_context"] and r["same_object"], r
    assert r["defaults"] == [0, 0, False, 0, False, 1.0, 0, 0], r
    assert r["context_keeps_state"], r
    assert r["in_step"] == [True, 1, True], r
    assert r["after_step"] == [False, 0, False], r
    assert r["shutdown_drops_state"], r
    assert r["after_shutdown"] == [False, 0, 0, 0, 0, False], r
    assert r["shutdown_in_scope"] == [True, 0, 0, 0], r
