#!/usr/bin/env python3
"""ZeroShard.jl against include/zeroshard/zeroshard.h, without Julia.

No Julia toolchain can be installed where zeroshard is built, so this reads
the package's sources instead of running them. It checks

  - every ``ccall`` of a ``zs_`` symbol: the symbol is a header function,
    called through ``libzeroshard``; the argument types are as many as the C
    parameters and each one is the Julia type of its C type; the return
    type too; the call passes as many values as it declares types;
  - every header function has a ccall;
  - every ``mutable struct zs_...`` mirror: the header's fields, in order,
    of the Julia types of their C types;
  - every ``const ZS_...`` constant: the value the C compiler gives it, and
    every enum value of the header is defined (the _ENUM_MIN_/_MAX_
    sentinels may be left out).

Julia type aliases (``const zs_context = Ptr{Cvoid}``) are resolved first;
a function-pointer typedef of the header (``zs_progress_fn``) is a
``Ptr{Cvoid}``;
``Ref{T}`` and ``Ptr{T}`` are the same argument type, and ``Cstring`` is a
``char*``.

    check_ccalls.py [--self-test] HEADER PACKAGE_DIR

--self-test makes one drift of each kind in a copy of the sources (in
memory) and fails unless each is reported.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

# C scalar types -> Julia.
SCALARS = {"int": "Cint", "size_t": "Csize_t", "double": "Cdouble", "float": "Cfloat",
           "char": "Cchar", "void": "Cvoid", "int64_t": "Int64", "uint64_t": "UInt64",
           "DLManagedTensor": "Cvoid"}


# ---------------------------------------------------------------- the header

def preprocess(header):
    text = open(header, encoding="utf-8").read()
    text = re.sub(r'^[ \t]*#[ \t]*include[ \t]*[<"].*$', "", text, flags=re.M)
    out = subprocess.run([CC, "-E", "-P", "-DZS_API=", "-x", "c", "-"], input=text,
                         capture_output=True, text=True, check=True).stdout
    return out


def parse_header(pp):
    h = {"handles": set(re.findall(r"typedef struct \w+_s\s*\*\s*(zs_\w+);", pp)),
         "callbacks": set(re.findall(r"typedef [\w\s*]+\(\s*\*\s*(zs_\w+)\s*\)\s*\(", pp)),
         "enums": {}, "structs": {}, "functions": {}}
    for name, body in re.findall(r"typedef enum (zs_\w+) \{(.*?)\} \1;", pp, re.S):
        h["enums"][name] = [item.split("=")[0].strip() for item in body.split(",") if item.strip()]
    for name, body in re.findall(r"typedef struct (zs_\w+) \{(.*?)\} \1;", pp, re.S):
        fields = []
        for decl in (d.strip() for d in body.split(";") if d.strip()):
            parts = decl.split(",")
            head = parts[0]
            cut = max(head.rfind(" "), head.rfind("*"))
            ctype = head[:cut + 1].strip()
            for n in [head[cut + 1:]] + parts[1:]:
                n = n.strip()
                m = re.match(r"(\w+)\[(\d+)\]$", n)
                fields.append((m.group(1), ctype, int(m.group(2))) if m else (n, ctype, None))
        h["structs"][name] = fields
    flat = " ".join(pp.split())
    for decl in flat.split(";"):
        m = re.match(r"^\s*}?\s*((?:const )?[\w ]*?\**)\s*\b(zs_\w+)\(([^()]*)\)\s*$", decl)
        if not m or m.group(1).startswith("typedef"):
            continue
        ret, name, args = m.group(1).strip(), m.group(2), m.group(3).strip()
        params = []
        if args != "void":
            for a in args.split(","):
                a = a.strip()
                cut = max(a.rfind(" "), a.rfind("*"))
                params.append((a[:cut + 1].strip(), a[cut + 1:]))
        h["functions"][name] = (ret, params)
    return h


def c_constants(header_dir, names):
    """name -> value, as the C compiler sees them."""
    lines = "\n".join('  printf("%s %%lld\\n", (long long)(%s));' % (n, n) for n in names)
    src = "#include <stdio.h>\n#include <zeroshard/zeroshard.h>\nint main(void) {\n%s\n  return 0;\n}\n" % lines
    with tempfile.TemporaryDirectory() as d:
        c, exe = os.path.join(d, "c.c"), os.path.join(d, "c")
        open(c, "w").write(src)
        subprocess.run([CC, "-I", header_dir, c, "-o", exe], check=True)
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (l.split() for l in out.splitlines())}


def julia_of_c(ctype, header, arg=True):
    """The canonical Julia type of a C type (aliases resolved)."""
    t = " ".join(ctype.replace("*", " * ").split())
    t = t.replace("struct ", "")
    stars = t.count("*")
    base = t.replace("*", "").replace("const", "").strip()
    if base in header["handles"] or base in header["callbacks"]:
        j = "Ptr{Cvoid}"
    elif base in header["enums"]:
        j = "Cint"
    elif base in header["structs"]:
        j = base
    else:
        j = SCALARS.get(base)
        if j is None:
            raise ValueError("no Julia type for C type %r" % ctype)
    for _ in range(stars):
        j = "Ptr{%s}" % j
    return j


# ---------------------------------------------------------------- the package

def split_top(s, sep=","):
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def strip_comments(text):
    text = re.sub(r"#=.*?=#", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        in_str = False
        for i, ch in enumerate(line):
            if ch == '"':
                in_str = not in_str
            elif ch == "#" and not in_str:
                line = line[:i]
                break
        out.append(line)
    return "\n".join(out)


def julia_sources(pkg):
    files = {}
    for sub in ("src", "test", "examples"):
        d = os.path.join(pkg, sub)
        for root, _, names in os.walk(d):
            for n in sorted(names):
                if n.endswith(".jl"):
                    p = os.path.join(root, n)
                    files[os.path.relpath(p, pkg)] = open(p, encoding="utf-8").read()
    return files


def find_ccalls(text):
    """(line, inner text) of every ccall( ... ) with balanced parentheses."""
    for m in re.finditer(r"\bccall\(", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text.count("\n", 0, m.start()) + 1, text[m.end():i - 1]


def julia_aliases(files):
    aliases = {}
    for text in files.values():
        for name, value in re.findall(r"^const (zs_\w+) = (\S+)\s*$", strip_comments(text), re.M):
            aliases[name] = value
    return aliases


def canonical_julia(t, aliases, arg=True):
    t = "".join(t.split())
    for _ in range(5):  # aliases of aliases
        t = re.sub(r"\b(zs_\w+)\b", lambda m: aliases.get(m.group(1), m.group(1)), t)
    if arg:
        t = t.replace("Ref{", "Ptr{")
    t = t.replace("Cstring", "Ptr{Cchar}").replace("Ptr{UInt8}", "Ptr{Cchar}")
    return t


def check(header_path, files):
    errors = []
    header = parse_header(preprocess(header_path))
    aliases = julia_aliases(files)
    called = set()

    for path, text in sorted(files.items()):
        code = strip_comments(text)
        for line, inner in find_ccalls(code):
            where = "%s:%d" % (path, line)
            parts = split_top(inner)
            target = parts[0]
            m = re.match(r"\(\s*:(\w+)\s*,\s*(\w+)\s*\)$", target) or re.match(r":(\w+)$", target)
            if not m:
                errors.append("%s: ccall target %s is not (:symbol, libzeroshard)" % (where, target))
                continue
            sym = m.group(1)
            if not sym.startswith("zs_"):
                continue  # libc (the example's sinf)
            called.add(sym)
            if len(m.groups()) < 2 or m.group(2) != "libzeroshard":
                errors.append("%s: %s is called without libzeroshard" % (where, sym))
            if sym not in header["functions"]:
                errors.append("%s: %s is not a function of the header" % (where, sym))
                continue
            cret, cparams = header["functions"][sym]
            if len(parts) < 3:
                errors.append("%s: %s: ccall lacks its types" % (where, sym))
                continue
            jret, jtuple, values = parts[1], parts[2], parts[3:]
            if not (jtuple.startswith("(") and jtuple.endswith(")")):
                errors.append("%s: %s: argument types %s are not a tuple" % (where, sym, jtuple))
                continue
            jtypes = split_top(jtuple[1:-1])
            want_ret = julia_of_c(cret, header, arg=False)
            got_ret = canonical_julia(jret, aliases, arg=False)
            if got_ret != want_ret and not (cret.replace(" ", "") == "constchar*" and jret.strip() == "Cstring"):
                errors.append("%s: %s returns %s in C, so %s in Julia, not %s" % (where, sym, cret, want_ret, jret))
            if len(jtypes) != len(cparams):
                errors.append("%s: %s takes %d arguments in C, the ccall declares %d"
                              % (where, sym, len(cparams), len(jtypes)))
                continue
            if len(values) != len(jtypes):
                errors.append("%s: %s declares %d argument types but passes %d values"
                              % (where, sym, len(jtypes), len(values)))
            for i, ((ctype, cname), jt) in enumerate(zip(cparams, jtypes)):
                want, got = julia_of_c(ctype, header), canonical_julia(jt, aliases)
                if want != got:
                    errors.append("%s: %s argument %d (%s) is %s in C, so %s in Julia, not %s"
                                  % (where, sym, i + 1, cname, ctype, want, jt))

    for sym in sorted(set(header["functions"]) - called):
        errors.append("%s is declared in the header but no ccall calls it" % sym)

    # Struct mirrors.
    jstructs = {}
    for path, text in files.items():
        for name, body in re.findall(r"^(?:mutable )?struct (zs_\w+)\n(.*?)^end", strip_comments(text), re.M | re.S):
            jstructs[name] = re.findall(r"^\s*(\w+)::(.+?)\s*$", body, re.M)
    for name, cfields in header["structs"].items():
        if name not in jstructs:
            errors.append("struct %s has no Julia mirror" % name)
            continue
        jf = jstructs[name]
        if [f[0] for f in jf] != [f[0] for f in cfields]:
            errors.append("struct %s: header fields %s, Julia %s"
                          % (name, [f[0] for f in cfields], [f[0] for f in jf]))
            continue
        for (fname, ctype, count), (_, jtype) in zip(cfields, jf):
            want = julia_of_c(ctype, header, arg=False)
            if count is not None:
                want = "NTuple{%d,%s}" % (count, want)
            got = canonical_julia(jtype, aliases, arg=False)
            if got != want:
                errors.append("struct %s.%s is %s%s in C, so %s in Julia, not %s"
                              % (name, fname, ctype, "[%d]" % count if count else "", want, jtype))
    for name in sorted(set(jstructs) - set(header["structs"])):
        errors.append("Julia struct %s is not in the header" % name)

    # Constants: enum values and the integer macros mirrored.
    jconsts = {}
    for text in files.values():
        for name, value in re.findall(r"^const (ZS_\w+) = (.+?)\s*$", strip_comments(text), re.M):
            jconsts[name] = value
    enum_names = [n for values in header["enums"].values() for n in values]
    values = c_constants(os.path.dirname(os.path.dirname(header_path)), enum_names + sorted(
        n for n in jconsts if n not in enum_names))
    for n in enum_names:
        if n not in jconsts and not re.search(r"_ENUM_M(IN|AX)_$", n):
            errors.append("enum value %s is not defined in Julia" % n)
    for n, v in sorted(jconsts.items()):
        m = re.match(r"^(?:Cint\()?(-?\d+)\)?$", v)
        if not m:
            errors.append("const %s = %s: not an integer literal" % (n, v))
        elif int(m.group(1)) != values[n]:
            errors.append("const %s is %s in Julia, %d in C" % (n, m.group(1), values[n]))
    return errors, len(called), len(jstructs), len(jconsts)


# ---------------------------------------------------------------- self-test

DRIFTS = [
    # (what, file, old, new, expected fragment of an error)
    ("an argument type", "src/lib.jl",
     "(:zs_grad_push, libzeroshard), zs_status, (zs_param, Ptr{Cvoid}, zs_dtype, Csize_t)",
     "(:zs_grad_push, libzeroshard), zs_status, (zs_param, Ptr{Cvoid}, zs_dtype, UInt64)",
     "zs_grad_push argument 4 (grad_bytes) is size_t"),
    ("an argument count", "src/lib.jl",
     "(:zs_barrier, libzeroshard), zs_status, (Ptr{zs_work}, zs_group), out_, group)",
     "(:zs_barrier, libzeroshard), zs_status, (Ptr{zs_work},), out_)",
     "zs_barrier takes 2 arguments in C"),
    ("a symbol", "src/lib.jl", "(:zs_release, libzeroshard)", "(:zs_release_all, libzeroshard)",
     "zs_release_all is not a function of the header"),
    ("a return type", "src/lib.jl", "(:zs_last_error, libzeroshard), Cstring", "(:zs_last_error, libzeroshard), Cint",
     "zs_last_error returns const char*"),
    ("a struct field", "src/lib.jl", "    grad_norm::Cdouble", "    grad_norm::Cfloat",
     "struct zs_step_result.grad_norm is double"),
    ("an enum value", "src/lib.jl", "const ZS_GROUP_HPZ = Cint(4)", "const ZS_GROUP_HPZ = Cint(5)",
     "const ZS_GROUP_HPZ is 5 in Julia, 4 in C"),
    ("a value passed", "src/lib.jl", "zs_work_test, libzeroshard), zs_status, (zs_work, Ptr{Cint}), work, done)",
     "zs_work_test, libzeroshard), zs_status, (zs_work, Ptr{Cint}), work)",
     "zs_work_test declares 2 argument types but passes 1 values"),
    ("a callback type", "src/lib.jl",
     "(:zs_checkpoint_verify, libzeroshard), zs_status, (Cstring, Ptr{Cchar}, zs_progress_fn, Ptr{Cvoid})",
     "(:zs_checkpoint_verify, libzeroshard), zs_status, (Cstring, Ptr{Cchar}, Cint, Ptr{Cvoid})",
     "zs_checkpoint_verify argument 3 (progress) is zs_progress_fn"),
]


def self_test(header, files):
    errors, _, _, _ = check(header, files)
    if errors:
        print("self-test: the package itself does not pass:\n  " + "\n  ".join(errors))
        return 1
    failed = 0
    for what, path, old, new, fragment in DRIFTS:
        if old not in files[path]:
            print("self-test: %s: %r not found in %s" % (what, old, path))
            failed += 1
            continue
        drifted = dict(files)
        drifted[path] = files[path].replace(old, new, 1)
        errs, _, _, _ = check(header, drifted)
        if any(fragment in e for e in errs):
            print("self-test: %s drift caught: %s" % (what, next(e for e in errs if fragment in e)))
        else:
            print("self-test: %s drift NOT caught (errors: %s)" % (what, errs))
            failed += 1
    return 1 if failed else 0


def main(argv):
    selftest = "--self-test" in argv
    args = [a for a in argv[1:] if a != "--self-test"]
    if len(args) != 2 or CC is None:
        print(__doc__ if CC else "check_ccalls: no C compiler (set CC)")
        return 2
    header, pkg = args
    files = julia_sources(pkg)
    if selftest:
        return self_test(header, files)
    errors, ncalls, nstructs, nconsts = check(header, files)
    if errors:
        print("ZeroShard.jl differs from %s:\n  %s" % (header, "\n  ".join(errors)))
        return 1
    print("ZeroShard.jl matches the header: %d functions called, %d structs, %d constants"
          % (ncalls, nstructs, nconsts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
