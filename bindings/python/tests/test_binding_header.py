"""The hand-written cdef in zeroshard._ffi against the real header.

The header is preprocessed with the C compiler, parsed by a fresh cffi.FFI
and by pycparser, and compared with the package's declarations: every
function (name and type, and that the library exports it), every typedef,
enum value and struct (field names, types, offsets and sizes). Struct
layouts and the header's integer macros and ZS_XXX_INIT initialisers are
also checked against a C program compiled from the real header, so a field
or function added to the header but not to the binding fails here.
"""
import os
import re
import shutil
import subprocess

import cffi
import pycparser
import pytest

from zeroshard import _ffi, core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
INCLUDE = os.path.join(ROOT, "include")
HEADER = os.path.join(INCLUDE, "zeroshard", "zeroshard.h")
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")

# Types cffi knows natively but pycparser needs declared to parse the text.
_PYCPARSER_PRELUDE = "".join("typedef int %s;\n" % t for t in (
    "size_t", "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t",
    "uint64_t", "intptr_t", "uintptr_t", "ptrdiff_t"))


def _header_text():
    with open(HEADER, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def preprocessed():
    # #include lines go first: stddef/stdint types are cffi built-ins, and
    # the system headers' contents are nothing cffi could parse.
    text = re.sub(r'^[ \t]*#[ \t]*include[ \t]*[<"].*$', "", _header_text(), flags=re.M)
    out = subprocess.run([CC, "-E", "-P", "-DZS_API=", "-x", "c", "-"], input=text,
                         capture_output=True, text=True, check=True).stdout
    return out


@pytest.fixture(scope="module")
def parsed(preprocessed):
    """Names by kind, read from the header with pycparser."""
    ast = pycparser.CParser().parse(_PYCPARSER_PRELUDE + preprocessed, "zeroshard.h")
    builtins = set(re.findall(r"typedef int (\w+);", _PYCPARSER_PRELUDE))
    names = {"functions": [], "typedefs": [], "structs": {}, "enums": {}}
    c_ast = pycparser.c_ast

    def visit_type(node):
        # Record struct bodies and enums wherever they are declared.
        if isinstance(node, c_ast.Struct) and node.decls is not None:
            names["structs"][node.name] = [d.name for d in node.decls]
        elif isinstance(node, c_ast.Enum) and node.values is not None:
            names["enums"][node.name] = [e.name for e in node.values.enumerators]
        for _, child in node.children():
            visit_type(child)

    for ext in ast.ext:
        if isinstance(ext, c_ast.Typedef):
            if ext.name not in builtins:
                names["typedefs"].append(ext.name)
            visit_type(ext.type)
        elif isinstance(ext, c_ast.Decl):
            if isinstance(ext.type, c_ast.FuncDecl):
                names["functions"].append(ext.name)
            else:
                visit_type(ext.type)
    return names


@pytest.fixture(scope="module")
def fresh(preprocessed):
    """A fresh FFI over the real header, with the same library opened."""
    ffi = cffi.FFI()
    ffi.cdef(preprocessed)
    return ffi, ffi.dlopen(_ffi.library_path)


@pytest.fixture(scope="module")
def package_parsed():
    """What the package's own cdef declares, read the same way."""
    text = subprocess.run([CC, "-E", "-P", "-x", "c", "-"], input=_ffi.CDEF,
                          capture_output=True, text=True, check=True).stdout
    ast = pycparser.CParser().parse(_PYCPARSER_PRELUDE + text, "cdef")
    c_ast = pycparser.c_ast
    funcs = [e.name for e in ast.ext
             if isinstance(e, c_ast.Decl) and isinstance(e.type, c_ast.FuncDecl)]
    return funcs


def _compile_and_run(tmp_path, name, source):
    src = tmp_path / (name + ".c")
    exe = tmp_path / name
    src.write_text(source)
    subprocess.run([CC, "-std=c99", "-Wall", "-I", INCLUDE, str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return dict(line.rsplit(" ", 1) for line in out.splitlines() if line)


def test_header_parses_and_has_content(parsed):
    assert "zs_context_create" in parsed["functions"]
    assert "zs_context_options" in parsed["structs"]
    assert "zs_status" in parsed["enums"]
    assert len(parsed["functions"]) > 60


def test_function_sets_match(parsed, package_parsed):
    header = set(parsed["functions"])
    package = set(package_parsed)
    assert header - package == set(), "functions in the header but not in the binding"
    assert package - header == set(), "functions in the binding but not in the header"
    assert len(package_parsed) == len(package), "a function declared twice in the cdef"


def test_function_types_match(parsed, fresh):
    ffi2, lib2 = fresh
    for name in parsed["functions"]:
        want = ffi2.getctype(ffi2.typeof(getattr(lib2, name)))
        got = _ffi.ffi.getctype(_ffi.ffi.typeof(getattr(_ffi.lib, name)))
        assert got == want, name


def test_typedefs_match(parsed, fresh):
    ffi2, _ = fresh
    for name in parsed["typedefs"]:
        want = ffi2.getctype(ffi2.typeof(name))
        got = _ffi.ffi.getctype(_ffi.ffi.typeof(name))
        assert got == want, name


def test_enums_match(parsed, fresh):
    ffi2, lib2 = fresh
    assert parsed["enums"], "no enums parsed"
    for name, members in parsed["enums"].items():
        want = ffi2.typeof("enum " + name).relements
        got = _ffi.ffi.typeof("enum " + name).relements
        assert got == want, name
        assert set(want) == set(members)
        for m in members:
            assert getattr(_ffi.lib, m) == getattr(lib2, m), m


def _fields(ffi, struct):
    t = ffi.typeof("struct " + struct)
    return [(n, ffi.getctype(f.type), f.offset, f.bitsize) for n, f in t.fields]


def test_structs_match_fresh_parse(parsed, fresh):
    ffi2, _ = fresh
    for name, fields in parsed["structs"].items():
        assert [f[0] for f in _fields(_ffi.ffi, name)] == fields, name
        assert _fields(_ffi.ffi, name) == _fields(ffi2, name), name
        assert _ffi.ffi.sizeof("struct " + name) == ffi2.sizeof("struct " + name), name


def test_opaque_struct_stays_opaque():
    # DLManagedTensor is declared, not defined, by the header.
    assert _ffi.ffi.typeof("struct DLManagedTensor").fields is None


def test_struct_layout_matches_the_compiler(parsed, tmp_path):
    lines = []
    for name, fields in parsed["structs"].items():
        lines.append('  printf("sizeof:%s %%zu\\n", sizeof(struct %s));' % (name, name))
        for f in fields:
            lines.append('  printf("offsetof:%s.%s %%zu\\n", offsetof(struct %s, %s));'
                         % (name, f, name, f))
    source = ("#include <stddef.h>\n#include <stdio.h>\n#include <zeroshard/zeroshard.h>\n"
              "int main(void) {\n%s\n  return 0;\n}\n" % "\n".join(lines))
    c = _compile_and_run(tmp_path, "layout", source)
    assert len(c) == sum(1 + len(f) for f in parsed["structs"].values())
    ffi = _ffi.ffi
    for name, fields in parsed["structs"].items():
        assert ffi.sizeof("struct " + name) == int(c["sizeof:" + name]), name
        for f in fields:
            assert ffi.offsetof("struct " + name, f) == int(c["offsetof:%s.%s" % (name, f)]), \
                (name, f)


def _macros():
    """Object-like macros of the header: name -> body."""
    out = {}
    text = _header_text().replace("\\\n", " ")
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?![\w(])(.*)$", text, flags=re.M):
        out[m.group(1)] = m.group(2).strip()
    return out


def test_integer_macros_match(tmp_path):
    macros = {n: b for n, b in _macros().items()
              if n.startswith("ZS_") and not n.endswith("_INIT") and n != "ZS_API" and b}
    assert "ZS_MAX_DIMS" in macros and "ZS_VERSION" in macros
    lines = ['  printf("%s %%lld\\n", (long long)(%s));' % (n, n) for n in macros]
    source = ("#include <stdio.h>\n#include <zeroshard/zeroshard.h>\n"
              "int main(void) {\n%s\n  return 0;\n}\n" % "\n".join(lines))
    c = _compile_and_run(tmp_path, "macros", source)
    for n in macros:
        assert hasattr(_ffi, n), "macro %s is not mirrored in zeroshard._ffi" % n
        assert getattr(_ffi, n) == int(c[n]), n


def test_init_macros_match(parsed, tmp_path):
    inits = sorted(n for n in _macros() if n.startswith("ZS_") and n.endswith("_INIT"))
    assert len(inits) >= 8
    lines = []
    structs = {}
    for macro in inits:
        struct = macro[:-len("_INIT")].lower()
        assert struct in parsed["structs"], "%s initialises no known struct" % macro
        structs[macro] = struct
        var = "v_" + struct
        lines.append("  { static const struct %s %s = %s;" % (struct, var, macro))
        for f in parsed["structs"][struct]:
            lines.append('    dump("%s.%s", (const unsigned char*)&%s.%s, sizeof(%s.%s));'
                         % (struct, f, var, f, var, f))
        lines.append("  }")
    source = ("#include <stdio.h>\n#include <zeroshard/zeroshard.h>\n"
              "static void dump(const char* n, const unsigned char* p, size_t k) {\n"
              "  printf(\"%s \", n);\n  for (size_t i = 0; i < k; ++i) printf(\"%02x\", p[i]);\n"
              "  printf(\"\\n\");\n}\n"
              "int main(void) {\n" + "\n".join(lines) + "\n  return 0;\n}\n")
    c = _compile_and_run(tmp_path, "inits", source)
    ffi = _ffi.ffi
    for macro, struct in structs.items():
        s = core._new_struct(struct)
        raw = bytes(ffi.buffer(s))
        ftypes = dict(ffi.typeof("struct " + struct).fields)
        for f in parsed["structs"][struct]:
            off = ffi.offsetof("struct " + struct, f)
            size = ffi.sizeof(ftypes[f].type)
            assert raw[off:off + size].hex() == c["%s.%s" % (struct, f)], (macro, f)


def test_dlpack_ctypes_layout(tmp_path):
    # core's ctypes view of DLManagedTensor (used by the capsule destructor)
    # against dlpack.h, where it is installed.
    found = [d for d in ("/usr/include", "/usr/local/include")
             if os.path.exists(os.path.join(d, "dlpack", "dlpack.h"))]
    if not found:
        pytest.skip("dlpack/dlpack.h not installed")
    source = ("#include <stddef.h>\n#include <stdio.h>\n#include <dlpack/dlpack.h>\n"
              "int main(void) {\n"
              '  printf("size %zu\\n", sizeof(DLManagedTensor));\n'
              '  printf("manager_ctx %zu\\n", offsetof(DLManagedTensor, manager_ctx));\n'
              '  printf("deleter %zu\\n", offsetof(DLManagedTensor, deleter));\n'
              '  printf("shape %zu\\n", offsetof(DLTensor, shape));\n'
              "  return 0;\n}\n")
    c = _compile_and_run(tmp_path, "dlpack", source)
    assert int(c["size"]) == core.ctypes.sizeof(core._DLManagedTensor)
    assert int(c["manager_ctx"]) == core._DLManagedTensor.manager_ctx.offset
    assert int(c["deleter"]) == core._DLManagedTensor.deleter.offset
    assert int(c["shape"]) == core._DLTensor.shape.offset
