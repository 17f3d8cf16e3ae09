"""A warm spare for a rank that zsrun may have to replace (docs/healing.md,
landing step 7): `zsrun --restarts R --spare -- python SCRIPT ARGS` starts

    python -m zeroshard.spare SCRIPT ARGS

beside the ranks. It imports the modules SCRIPT's import statements name
(found with `ast`: none of SCRIPT runs), then blocks on stdin. When a rank
dies, zsrun writes that rank's variables to it (NAME=value lines, then an
empty line: RANK, LOCAL_RANK, ROLE_RANK, ZS_HEAL_REPLACEMENT), and the spare
runs SCRIPT as `python SCRIPT ARGS` would, as that rank's replacement: the
imports a replacement would spend seconds on are done. At EOF without an
assignment (the job ended) it exits 0.
"""
import ast
import importlib
import os
import runpy
import sys


def imported_modules(path):
    """(module, names) for each absolute import statement of SCRIPT, in
    order, wherever it stands (a function's imports too): names are what
    `from module import ...` takes (empty for `import module`)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
    return found


def preload(found):
    """Imports each module and takes each name from it: a package that
    loads its classes on first access (transformers) loads them now. What
    fails (optional, or guarded by the script) is left for the script."""
    for module, names in found:
        try:
            m = importlib.import_module(module)
            for name in names:
                getattr(m, name, None)
        except Exception:  # noqa: BLE001 (the script meets the same error itself, with its own handling)
            pass


def read_assignment(stream):
    """NAME=value lines up to an empty line; None at EOF before one."""
    env = {}
    for raw in stream:
        line = raw.decode().rstrip("\n")
        if not line:
            return env
        name, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"zeroshard.spare: zsrun sent {line!r}, expected NAME=value")
        env[name] = value
    return None


def main(argv):
    if not argv:
        sys.exit("usage: python -m zeroshard.spare SCRIPT [ARGS...] (started by zsrun --spare)")
    script = os.path.abspath(argv[0])
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    preload(imported_modules(script))
    env = read_assignment(sys.stdin.buffer)
    if env is None:
        return  # the job ended before a rank was lost
    os.environ.update(env)
    os.environ.pop("ZS_HEAL_SPARE", None)
    run_as_rank(argv)


def run_as_rank(argv):
    """Runs SCRIPT (argv[0]) as `python SCRIPT ARGS` would, in a process
    that imported its modules before it had a rank's environment: what
    those imports would have done with one is done now."""
    if "zeroshard.hf" in sys.modules:
        # Its import routed nothing (no rank then): a replacement's
        # torch.distributed init goes over the engine (torch/heal_dist.py).
        from zeroshard.torch import heal_dist
        heal_dist.route_replacement_init()
    sys.argv = [argv[0]] + argv[1:]
    runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
